"""Issue 51's attacks on a run directory (rows 1, 2, 8, 10 and 12): a second writer on a directory in use is
refused with one line naming the holder; SIGHUP (a closed terminal, a dropped SSH connection) saves the run as
SIGTERM does, then exits 129; a link planted at any name a run writes is replaced, never written through; readers
survive checkpoints rotated away under them; a foreign --checkpoint file, a non-finite --target and an eval or
enjoy --seed outside [0, 2**32) are one correct line. The soak puts rows 1 and 2 and a resume together."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import conveyor.files
import conveyor.learner
from conveyor.cli import main
from conveyor.evaluate import evaluate_run
from conveyor.learner import load_latest_checkpoint
from conveyor.returns_file import read_returns
from conveyor.run import checkpoint_steps
from conveyor.procs import descendants
from tests.fault_env import alive, gone_within

TINY_RUN = ["--num-envs", "2", "--num-workers", "1", "--unroll", "5", "--torch-threads", "1", "--no-progress",
            "--target-return", "inf"]
ROOT = Path(__file__).resolve().parent.parent


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A tiny finished run with three checkpoints."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *TINY_RUN, "--total-steps", "60", "--checkpoint-every", "20", "--keep-checkpoints", "5",
                 "--out", str(out)]) == 0
    return out


def start_holder(directory: Path) -> subprocess.Popen:
    """Another process that holds ``directory``'s lock until its stdin closes (or it is killed)."""
    code = ("import sys; from conveyor.files import lock_run_dir; lock_run_dir(sys.argv[1]); "
            "print('locked', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(directory)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline() == "locked\n", "the holder could not take the lock"
    return holder


# ---- row 1: one writer per run directory --------------------------------------------------------------------
def test_a_second_writer_on_a_directory_in_use_exits_2_naming_the_holder_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = start_holder(out)
    try:
        before = files_of(out)
        assert main(["train", *TINY_RUN, "--total-steps", "40", "--out", str(out)]) == 2
        line = one_line(capsys.readouterr().err)
        assert f"pid {holder.pid}" in line and "--out" in line, line
        assert files_of(out) == before  # no config.json, no metrics.csv, no checkpoint
    finally:
        holder.kill()
        holder.wait()
    # The kernel released the lock with the process that held it, however it ended.
    assert main(["train", *TINY_RUN, "--total-steps", "40", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["env_steps"] >= 40
    assert (out / conveyor.files.LOCK_NAME).read_text().strip() == str(os.getpid())  # its last holder


def test_a_resume_of_a_run_still_training_is_refused_before_anything_is_written(finished_run, tmp_path, capsys):
    holder = start_holder(finished_run)  # stands for the run still training there
    try:
        before = files_of(finished_run)
        assert main(["train", "--resume", str(finished_run), "--total-steps", "200"]) == 2
        assert f"pid {holder.pid}" in one_line(capsys.readouterr().err)
        assert files_of(finished_run) == before
        # Reading is never locked out.
        assert main(["enjoy", "--run", str(finished_run), "--episodes", "1"]) == 0
    finally:
        holder.stdin.close()
        holder.wait()
    capsys.readouterr()


def test_a_link_at_the_lock_is_refused_and_its_target_kept(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    (out / conveyor.files.LOCK_NAME).symlink_to(victim)
    assert main(["train", *TINY_RUN, "--total-steps", "40", "--out", str(out)]) == 2
    assert "symbolic link" in one_line(capsys.readouterr().err)
    assert victim.read_text() == "precious"


@pytest.fixture
def start_trainer():
    """Starts ``conveyor train FLAGS`` in a session of its own (as from a terminal of its own: SIGHUP to its
    group). Whatever a session still holds when the test ends, a failed test's trainer above all, is killed then:
    a trainer left running would fail every later test of this pytest worker that counts its children."""
    started: list[subprocess.Popen] = []

    def start(*flags: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "train", *flags], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        for pid in in_session(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it exited while we looked
        proc.communicate()


# ---- row 2: SIGHUP ------------------------------------------------------------------------------------------
def hang_up(start_trainer, arch: str, algo: str, out: Path) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Start a run in its own session, wait until it logs, then SIGHUP its whole process group (as a closed
    terminal does); returns how it ended and its worker processes."""
    proc = start_trainer("--out", str(out), "--no-progress", "--arch", arch, "--algo", algo, "--log-interval-s", "0.5",
                         "--env-backend", "shm", "--total-steps", "100000000", "--target-return", "inf",
                         "--torch-threads", "1")
    deadline = time.monotonic() + 120
    while not (out / "metrics.csv").exists() or (out / "metrics.csv").read_text().count("\n") < 2:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run never started logging"
        time.sleep(0.2)
    workers = descendants(proc.pid)
    assert workers, "the run should have worker processes"
    os.killpg(proc.pid, signal.SIGHUP)
    stdout, stderr = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), workers


def assert_saved_and_no_orphans(result: subprocess.CompletedProcess, out: Path, workers: list[int]) -> None:
    assert result.returncode == 128 + signal.SIGHUP, result.stderr  # once the run saved everything, as SIGTERM does
    assert "Traceback" not in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "signal SIGHUP"
    assert list((out / "checkpoints").glob("ckpt-*.pt"))
    deadline = time.monotonic() + 10
    while [pid for pid in workers if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if alive(pid)], "a worker process outlived the run"


def test_sighup_to_the_process_group_saves_a_paac_run(tmp_path, start_trainer):
    out = tmp_path / "run"
    result, workers = hang_up(start_trainer, "paac", "a2c", out)
    assert_saved_and_no_orphans(result, out, workers)


@pytest.mark.slow
@pytest.mark.parametrize("arch, algo", [("seed", "vtrace"), ("impact", "impact"), ("ga3c", "ga3c"), ("hts", "a2c")])
def test_sighup_to_the_process_group_saves_every_architecture(tmp_path, start_trainer, arch, algo):
    out = tmp_path / "run"
    result, workers = hang_up(start_trainer, arch, algo, out)
    assert_saved_and_no_orphans(result, out, workers)


# ---- the soak (Done when) -------------------------------------------------------------------------------------
# Its third part, a torchrun rank started with a changed flag, is tests/test_resume_rules.py's and
# tests/test_distributed.py's (every rank exits 2 naming the field; no SIGABRT, no hang).
SOAK = ["--env", "CartPole-v1", "--num-envs", "4", "--num-workers", "2", "--env-backend", "shm", "--unroll", "5",
        "--checkpoint-every", "1000", "--keep-checkpoints", "3", "--log-interval-s", "0.5", "--torch-threads", "1",
        "--no-progress", "--target-return", "inf"]


def in_session(session: int) -> list[int]:
    """Live processes of session ``session``: whatever a trainer started there and left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # no process, or one that exited while we looked
        if stat[0] != "Z" and int(stat[3]) == session:
            found.append(int(entry.name))
    return found


def metric_steps(out: Path) -> list[int]:
    with open(out / "metrics.csv") as f:
        return [int(row["env_steps"]) for row in csv.DictReader(f) if row.get("env_steps", "").isdigit()]


@pytest.mark.slow
def test_soak_a_racing_trainer_a_hang_up_and_a_resume_lose_nothing_and_leave_no_process(tmp_path, start_trainer):
    out = tmp_path / "run"
    a = start_trainer(*SOAK, "--out", str(out), "--total-steps", "100000000")
    deadline = time.monotonic() + 180
    # A checkpoint can land before the first metrics row (every 1000 steps against every 0.5 s): wait for both.
    while (not list(out.glob("checkpoints/ckpt-*.pt")) or not (out / "metrics.csv").exists()
           or len(metric_steps(out)) < 2):
        assert a.poll() is None, a.communicate()[1]
        assert time.monotonic() < deadline, "trainer A never logged or checkpointed"
        time.sleep(0.2)
    config = (out / "config.json").read_bytes()

    # B on A's directory, mid-run: refused in one line naming A, before it writes anything.
    b = start_trainer(*SOAK, "--out", str(out), "--total-steps", "2000", "--seed", "7")
    _, b_err = b.communicate(timeout=120)
    assert b.returncode == 2, b_err
    assert f"pid {a.pid}" in one_line(b_err)
    assert (out / "config.json").read_bytes() == config  # not B's (another seed)
    assert (out / conveyor.files.LOCK_NAME).read_text().strip() == str(a.pid)
    assert not in_session(b.pid)

    # A closed terminal: SIGHUP to A's whole group; A saves, then exits 129.
    workers = descendants(a.pid)
    assert workers, "A should have env worker processes"
    os.killpg(a.pid, signal.SIGHUP)
    _, a_err = a.communicate(timeout=120)
    assert a.returncode == 128 + signal.SIGHUP, a_err
    assert "Traceback" not in a_err, a_err
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["stop_reason"] == "signal SIGHUP"
    saved = stopped["env_steps"]
    assert checkpoint_steps(load_latest_checkpoint(out)[0]) == saved  # the final checkpoint: every step of A
    episodes_before = read_returns(out / "returns.csv")
    assert len(episodes_before) == stopped["episodes"] > 0
    assert gone_within(workers, 10) and not in_session(a.pid), "A left a process behind"

    # The resume goes on from A's final checkpoint to the end.
    total = saved + 2000
    resumed = start_trainer("--resume", str(out), "--total-steps", str(total))
    _, resumed_err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, resumed_err
    assert not in_session(resumed.pid), "the resumed run left a process behind"
    finished = json.loads((out / "summary.json").read_text())
    assert finished["stop_reason"] == "total_steps reached" and finished["env_steps"] >= total
    steps = metric_steps(out)
    assert steps == sorted(steps), "metrics.csv's env_steps went backwards"
    assert steps[-1] == finished["env_steps"] and any(step > saved for step in steps)
    episodes = read_returns(out / "returns.csv")
    assert len(episodes) == finished["episodes"] > len(episodes_before)
    assert np.array_equal(episodes[:len(episodes_before)], episodes_before)  # A's episodes, all kept
    # then the resumed run's, none stepped twice: an episode is stamped with the env steps counted before the
    # rollout it ended in, so those of the resumed run's first rollout carry A's last count
    assert (episodes[len(episodes_before):, 0] >= saved).all() and (episodes_before[:, 0] <= saved).all()


# ---- row 8: no write through a planted link ------------------------------------------------------------------
def plant(directory: Path, names: list[str], victim: Path) -> None:
    for name in names:
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).symlink_to(victim)


def test_a_run_replaces_links_planted_at_its_files_and_never_writes_their_targets(tmp_path):
    victim = tmp_path / "victim.csv"
    victim.write_text("env_steps,wall_time_s,return\n")  # what the run would append to, were it followed
    out = tmp_path / "run"
    names = ["returns.csv", "metrics.csv", "summary.json", "config.json"]
    plant(out, names, victim)
    assert main(["train", *TINY_RUN, "--total-steps", "60", "--out", str(out)]) == 0
    assert victim.read_text() == "env_steps,wall_time_s,return\n"
    for name in names:
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 0, name


def test_appended_files_and_videos_never_follow_a_planted_link(finished_run, tmp_path, monkeypatch, capsys):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    # A log appended to (SEED's actor logs, Ray's start-up log) and metrics.csv when a link is planted mid-run.
    log = tmp_path / "actor-0.log"
    log.symlink_to(victim)
    with conveyor.files.open_append(log) as f:
        f.write(b"started\n")
    assert not log.is_symlink() and log.read_bytes() == b"started\n"
    from conveyor.telemetry import MetricsCsv
    metrics = MetricsCsv(tmp_path / "metrics.csv")
    metrics.write({"env_steps": 1})
    (tmp_path / "metrics.csv").unlink()
    (tmp_path / "metrics.csv").symlink_to(victim)
    metrics.write({"env_steps": 2})
    assert not (tmp_path / "metrics.csv").is_symlink()
    # A video: links at the name it used to write first, and at its own name.
    video = tmp_path / "clip.mp4"
    plant(tmp_path, [".clip.partial.mp4", "clip.mp4"], victim)
    assert main(["enjoy", "--run", str(finished_run), "--episodes", "1", "--video", str(video)]) == 0
    assert not video.is_symlink() and video.stat().st_size > 0
    # Even a link at the very name the recorder draws is refused, never written through.
    monkeypatch.setattr(conveyor.files.secrets, "token_hex", lambda n: "guessed")
    (tmp_path / ".clip2.mp4.guessed.partial.mp4").symlink_to(victim)
    with pytest.raises(FileExistsError):
        main(["enjoy", "--run", str(finished_run), "--episodes", "1", "--video", str(tmp_path / "clip2.mp4")])
    assert victim.read_text() == "precious"
    capsys.readouterr()


@pytest.mark.slow
def test_a_seed_run_replaces_links_at_learner_address_and_its_actor_logs(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "run"
    plant(out, ["learner_address", "actors/actor-0.log"], victim)
    assert main(["train", "--arch", "seed", "--algo", "vtrace", "--num-envs", "2", "--num-workers", "1",
                 "--torch-threads", "1", "--no-progress", "--target-return", "inf", "--total-steps", "400",
                 "--out", str(out)]) == 0
    assert victim.read_text() == "precious"
    assert not (out / "learner_address").is_symlink() and ":" in (out / "learner_address").read_text()
    assert not (out / "actors/actor-0.log").is_symlink()


# ---- row 12: readers of a run still training; foreign files; non-finite targets -----------------------------
def rotate_away_on_first_read(monkeypatch, names: set[str]) -> list[str]:
    """Fault injection: each checkpoint in ``names`` is deleted just before it is read, as a run still training
    rotates its old ones away between a reader's listing and its load."""
    read = conveyor.learner._read_checkpoint
    deleted: list[str] = []

    def rotated(path, device):
        if path.name in names and path.name not in deleted:
            deleted.append(path.name)
            path.unlink()
        return read(path, device)

    monkeypatch.setattr(conveyor.learner, "_read_checkpoint", rotated)
    return deleted


def test_readers_take_the_newest_checkpoint_still_there(finished_run, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    names = sorted(p.name for p in (run / "checkpoints").glob("ckpt-*.pt"))
    assert len(names) >= 3
    # eval of every checkpoint: the one rotated away is skipped, with a line saying so and no advice to delete.
    deleted = rotate_away_on_first_read(monkeypatch, {names[0]})
    result = evaluate_run(run, episodes=1)
    assert deleted == [names[0]]
    assert [p["checkpoint"] for p in result["policies"]] == names[1:]
    line = one_line(capsys.readouterr().err)
    assert names[0] in line and "skipped" in line and "delete it" not in line
    # eval --checkpoint latest, and load_latest_checkpoint (load_policy, enjoy, export): the next newest, quietly.
    monkeypatch.undo()
    rotate_away_on_first_read(monkeypatch, {names[-1]})
    result = evaluate_run(run, episodes=1, checkpoints=("latest",))
    assert [p["checkpoint"] for p in result["policies"]] == [names[-2]]
    capsys.readouterr()
    fresh = tmp_path / "fresh"
    shutil.copytree(finished_run, fresh)
    rotate_away_on_first_read(monkeypatch, {names[-1]})
    path, _ = load_latest_checkpoint(fresh)
    assert path.name == names[-2] and capsys.readouterr().err == ""


def test_a_file_that_is_no_checkpoint_gets_no_advice_to_delete_it(finished_run, tmp_path, capsys):
    foreign = tmp_path / "passwd"
    foreign.write_text("root:x:0:0:root:/root:/bin/bash\n")
    for command in (["enjoy", "--run", str(finished_run), "--episodes", "1"],
                    ["eval", "--run", str(finished_run), "--episodes", "1"],
                    ["export", "--run", str(finished_run), "--format", "torchscript", "--out", str(tmp_path / "policy.pt")]):
        assert main([*command, "--checkpoint", str(foreign)]) == 2
        line = one_line(capsys.readouterr().err)
        assert "not a conveyor checkpoint" in line and "delete it" not in line and "--checkpoint latest" in line
    assert foreign.read_text().startswith("root:")


@pytest.mark.parametrize("target", ["nan", "inf", "-inf"])
def test_eval_refuses_a_target_that_is_not_finite(finished_run, capsys, target):
    assert main(["eval", "--run", str(finished_run), "--episodes", "1", "--target", target]) == 2
    assert "--target" in one_line(capsys.readouterr().err)
    assert not (finished_run / "eval.json").exists()


@pytest.mark.parametrize("command", ["eval", "enjoy"])
@pytest.mark.parametrize("seed, message", [(2**32, "seed must lie in [0, 2**32), got 4294967296"),
                                           (-1, "seed must lie in [0, 2**32), got -1"),
                                           (2**32 - 1, "with 2 episodes (one seed each) reaches 4294967296")])
def test_eval_and_enjoy_refuse_seeds_outside_0_to_2_32(finished_run, capsys, command, seed, message):
    assert main([command, "--run", str(finished_run), "--episodes", "2", f"--seed={seed}"]) == 2
    line = one_line(capsys.readouterr().err)
    assert message in line and line.endswith("pass a --seed from 0 to 4294967294"), line
    assert not (finished_run / "eval.json").exists()
