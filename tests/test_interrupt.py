"""Ctrl-C / SIGTERM: a checkpoint is saved, the process exits within seconds, no child is left, and
``--resume`` continues the run. A killed env worker: one line, exit 1, a checkpoint, no orphans."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.procs import descendants
from tests.fault_env import HANGING_ID, alive, children


# make test keeps SIGHUP to a paac run's process group (tests/test_attacks.py), the same stop path.
@pytest.mark.slow
@pytest.mark.parametrize("arch, algo, sig", [
    ("paac", "a2c", signal.SIGINT), ("paac", "a2c", signal.SIGTERM), ("ga3c", "ga3c", signal.SIGINT),
    ("seed", "vtrace", signal.SIGINT), ("impact", "impact", signal.SIGTERM), ("hts", "a2c", signal.SIGINT),
])
def test_signal_saves_checkpoint_and_exits_without_orphans(tmp_path, arch, algo, sig):
    out = tmp_path / "run"
    shared_memory_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "train", "--out", str(out), "--no-progress",
                             "--arch", arch, "--algo", algo, "--log-interval-s", "0.5", "--env-backend", "shm",
                             "--total-steps", "100000000", "--target-return", "inf", "--torch-threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "metrics.csv").exists() or not (out / "metrics.csv").read_text().count("\n") >= 2:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run never started logging"
        time.sleep(0.5)
    workers = descendants(proc.pid)
    assert workers, "the run should have worker processes"
    signalled = time.monotonic()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - signalled < 20, "the run took too long to stop"
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == f"signal {sig.name}"
    assert list((out / "checkpoints").glob("*.pt"))
    deadline = time.monotonic() + 10
    while [pid for pid in workers if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if alive(pid)], "a worker process outlived the run"
    assert set(os.listdir("/dev/shm")) <= shared_memory_before, "the run left shared memory segments"

    resumed = subprocess.run([sys.executable, "-m", "conveyor.cli", "train", "--resume", str(out),
                              "--total-steps", str(summary["env_steps"] + 2000), "--no-progress"],
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    after = json.loads((out / "summary.json").read_text())
    assert after["env_steps"] >= summary["env_steps"] + 2000
    assert after["learner_version"] > summary["learner_version"]
    assert os.path.exists(out / "config.json")


@pytest.mark.slow  # make test keeps the API's half: tests/test_faults_paac.py, past max_restarts
def test_killed_worker_past_max_restarts_stops_the_run_with_one_line_and_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "train", "--out", str(out), "--no-progress",
                             "--total-steps", "100000000", "--target-return", "inf", "--torch-threads", "1",
                             "--max-restarts", "0", "--env-backend", "shm"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "metrics.csv").exists() or (out / "metrics.csv").read_text().count("\n") < 2:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run never started logging"
        time.sleep(0.5)
    workers = list(children(proc.pid))
    os.kill(workers[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "died" in lines[0] and "SIGKILL" in lines[0] and "--max-restarts" in lines[0] and "--resume" in lines[0]
    assert list((out / "checkpoints").glob("*.pt"))
    time.sleep(0.5)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()
                and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]]


@pytest.mark.slow  # 60-85 s each; make test keeps both halves: Ctrl-C writes a checkpoint (above), and a resumed
# run reaches an uninterrupted run's parameters (tests/test_exact_resume.py)
@pytest.mark.parametrize("arch", ["paac", "hts"])
def test_ctrl_c_then_resume_reaches_the_parameters_of_an_uninterrupted_run(tmp_path, arch):
    args = [sys.executable, "-m", "conveyor.cli", "train", "--arch", arch, "--num-envs", "8", "--seed", "3",
            "--total-steps", "40000", "--target-return", "inf", "--torch-threads", "1", "--no-progress",
            "--log-interval-s", "0.2"]
    whole = subprocess.run(args + ["--out", str(tmp_path / "whole")], capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "split"
    proc = subprocess.Popen(args + ["--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "metrics.csv").exists() or (out / "metrics.csv").read_text().count("\n") < 4:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run never started logging"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["stop_reason"] == "signal SIGINT" and stopped["env_steps"] < 40000
    resumed = subprocess.run([sys.executable, "-m", "conveyor.cli", "train", "--resume", str(out), "--no-progress"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    expected = json.loads((tmp_path / "whole" / "summary.json").read_text())
    final = json.loads((out / "summary.json").read_text())
    assert final["env_steps"] == expected["env_steps"]
    assert final["param_sha256"] == expected["param_sha256"]


@pytest.mark.slow
def test_a_signal_while_a_resumed_run_replays_its_games_stops_at_once_and_keeps_the_checkpoint(tmp_path):
    """A resumed run's env workers first replay each env's episode so far (seconds on Atari). Ctrl-C then kills
    them at once (there is no step to finish): exit 0, one line saying so, the checkpoint as it was, no orphans."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "conveyor.cli", "train", "--no-progress", "--torch-threads", "1", "--env-backend", "shm"]
    first = subprocess.run(args + ["--out", str(out), "--env", HANGING_ID, "--env-arg", "hang_at=1000000000",
                                   "--total-steps", "2000", "--target-return", "inf"],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    (checkpoint,) = (out / "checkpoints").glob("*.pt")
    saved = checkpoint.read_bytes()
    # The 4th step of an env hangs, creating marker.0: one the resumed run replays (the start-up check of the
    # env's API steps a fresh one 3 times; every episode lasts 4 to 8 steps, and seed 0's run leaves envs deep
    # enough into theirs).
    marker = tmp_path / "replaying"
    proc = subprocess.Popen(args + ["--resume", str(out), "--total-steps", "4000", "--env-arg", "hang_at=4",
                                    "--env-arg", f"marker={marker}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not Path(f"{marker}.0").exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the resumed run never replayed a step"
        time.sleep(0.05)
    workers = descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "replaying the resumed run's games when the run was asked to stop" in lines[0]
    assert [path.name for path in (out / "checkpoints").glob("*.pt")] == [checkpoint.name]
    assert checkpoint.read_bytes() == saved
    assert not [pid for pid in workers if alive(pid)], "a worker process outlived the run"


def test_ctrl_c_outside_a_run_is_one_line_and_exit_130(monkeypatch, capsys):
    """A Ctrl-C where no run's signal handler holds it (while the CLI still imports torch, say) is a
    KeyboardInterrupt: one line and the shell's code for it, no traceback."""
    from conveyor import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_presets", interrupted)
    assert cli.main(["presets"]) == 130
    assert capsys.readouterr().err == "conveyor: interrupted\n"
