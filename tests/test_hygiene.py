"""Issue 51's hygiene rows: a worker's error keeps its cause (the exception's last line and the env in the one
line, the traceback in the run's ``errors.log``) on every env backend; the ``conveyor`` command ends although
an env left a thread and a process that ignores SIGTERM behind; ``conveyor actor`` imports no torch."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conveyor.cli import main
from tests.fault_env import LEAKY_ID, RAISING_ID, alive

REPO = Path(__file__).resolve().parent.parent
QUIET = ["--no-progress", "--num-envs", "2", "--total-steps", "4000", "--max-restarts", "0"]
RESET_FAULT = "ValueError: injected fault in reset call 2"


def failure_line(capsys) -> str:
    """The CLI's one line about the failed run (an in-process env may have printed tracebacks of counted errors
    before it)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("conveyor: run failed: "), lines
    return lines[-1]


def logged(run: Path) -> str:
    text = (run / "errors.log").read_text()
    assert "Traceback (most recent call last):" in text
    return text


@pytest.mark.parametrize("arch, backend", [("paac", "shm"), ("paac", "inproc"), ("hts", "shm")])
def test_an_env_whose_reset_raises_is_named_with_its_exception(tmp_path, capsys, arch, backend):
    run = tmp_path / "run"
    assert main(["train", "--arch", arch, "--env", RAISING_ID, "--env-backend", backend, "--out", str(run),
                 *QUIET]) == 1
    line = failure_line(capsys)
    assert re.search(rf"env \d \({re.escape(RAISING_ID)}\) raised on reset: {RESET_FAULT}", line), line
    assert f"traceback in {run / 'errors.log'}" in line or arch == "hts", line  # hts: the executor's stderr
    if arch != "hts":
        assert RESET_FAULT in logged(run)


@pytest.mark.parametrize("backend", ["shm", "inproc"])
def test_an_env_whose_step_keeps_raising_is_named_with_its_exception(tmp_path, capsys, backend):
    run = tmp_path / "run"
    # The start-up check takes 3 steps of an env of its own: the workers' envs raise from their 4th step on.
    assert main(["train", "--env", RAISING_ID, "--env-arg", "raise_in=step", "--env-arg", "after=4",
                 "--max-env-errors", "2", "--env-backend", backend, "--out", str(run), *QUIET]) == 1
    line = failure_line(capsys)
    assert "env errors exceed max_env_errors=2" in line
    assert f"({RAISING_ID}) raised on step: ValueError: injected fault in step call" in line, line
    assert "ValueError: injected fault in step call" in logged(run)


def test_an_env_that_raises_in_the_start_up_check_is_one_line(tmp_path, capsys):
    assert main(["train", "--env", RAISING_ID, "--env-arg", "raise_in=step", "--env-arg", "after=1",
                 "--out", str(tmp_path / "run"), *QUIET]) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"conveyor: run failed: env {RAISING_ID!r} raised during the start-up check of its API: "
                           "ValueError: injected fault in step call 1"), line
    assert len(line.splitlines()) == 1


def test_an_env_whose_reset_raises_while_auto_times_it_is_one_line(tmp_path, capsys):
    assert main(["train", "--env", RAISING_ID, "--out", str(tmp_path / "run"), *QUIET]) == 1
    line = failure_line(capsys)
    assert f"env {RAISING_ID!r} raised while --env-backend auto timed its steps: {RESET_FAULT}" in line, line


def test_a_ga3c_agent_names_its_env_and_exception(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--arch", "ga3c", "--env", RAISING_ID, "--env-backend", "shm", "--out", str(run),
                 *QUIET]) == 1
    line = failure_line(capsys)
    assert re.search(rf"GA3C agent \d \(pid \d+\) died \(exit code 1\): env \d \({re.escape(RAISING_ID)}\) raised on "
                     rf"reset: {RESET_FAULT}", line), line
    assert f"traceback in {run / 'errors.log'}" in line, line
    assert RESET_FAULT in logged(run)


@pytest.mark.slow
def test_an_impact_worker_names_its_env_and_exception(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--arch", "impact", "--env", RAISING_ID, "--env-backend", "shm", "--out", str(run),
                 *QUIET]) == 1
    line = failure_line(capsys)
    assert f"raised on reset: {RESET_FAULT}" in line and "Traceback" not in line, line
    assert RESET_FAULT in logged(run)


def test_the_command_ends_although_an_env_leaves_a_thread_and_a_process_behind(tmp_path):
    """The env's thread is no daemon and its process (in a session of its own) ignores SIGTERM: before, the
    trainer never exited after its summary, and the process outlived it."""
    marker = f"conveyor-leaky-{uuid.uuid4().hex}"
    command = [sys.executable, "-m", "conveyor", "train", "--env", LEAKY_ID, "--env-arg", f"marker={marker}",
               "--env-backend", "inproc", "--num-envs", "2", "--total-steps", "200", "--no-progress",
               "--out", str(tmp_path / "run")]
    trainer = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = trainer.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.communicate()
        pytest.fail("the trainer did not exit after its run")
    finally:
        left = leftovers(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert trainer.returncode == 0, err.decode()
    assert b"stopped: total_steps reached" in out
    assert not left, f"processes left behind: {left}"
    assert b"left behind" in err and b"left running by an env" in err


def leftovers(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_conveyor_actor_imports_no_torch():
    code = ("import sys\nfrom conveyor.cli import main\ntry:\n    main(['actor', '--help'])\nexcept SystemExit:\n"
            "    pass\nassert 'torch' not in sys.modules, 'conveyor actor imported torch'\n"
            "from conveyor.architectures.seed.actor import Actor\nassert 'torch' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--learner" in done.stdout
