"""One bench run in a child process: both sides of the process boundary.

The parent (``execute``) writes ``bench_spec.json`` into the run's directory
and starts ``python -m conveyor.bench.child SPEC`` in a session of its own,
with its output in ``bench.log``. Being in a session of its own, the child gets
no Ctrl-C from the terminal: the parent stops it (below), and a parent that is
killed outright takes it along (the kernel sends it SIGTERM, so its run stops
and writes its summary as on any signal). The child (``child_main``) trains, then
evaluates its policies with the protocols of ``conveyor.evaluate``
(``eval.json``), and writes ``outcome.json``: ``ok``, ``failed`` with a
one-line error (the traceback goes to ``bench.log``) or ``skipped`` (a peer
that is not installed). A child that outlives its timeout gets SIGTERM (the
run stops and writes its summary), then SIGKILL to its whole process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conveyor.bench.report import result_row
from conveyor.bench.suites import SPEC_FILE, BenchRun, PeerUnavailable
from conveyor.config import RunCfg
from conveyor.errors import ConfigError
from conveyor.procs import die_with_parent

CHILD_MODULE = "conveyor.bench.child"
TERMINATE_GRACE_S = 30.0
"""Seconds a timed-out child gets to stop after SIGTERM before SIGKILL."""
EXIT_SKIPPED = 3
OUTCOME_FILE = "outcome.json"
PARENT_PID_ENV = "CONVEYOR_BENCH_PARENT_PID"


# ---- the parent side ---------------------------------------------------------------------------
def execute(run: BenchRun, run_dir: Path) -> dict[str, Any]:
    """Run one ``BenchRun`` in a child process (or record it as skipped); returns its results row."""
    if run.skip_reason:
        return result_row(run, run.cfg, run_dir, "skipped", run.skip_reason, 0.0)
    if run_dir.exists():
        if not (run_dir / SPEC_FILE).is_file():
            raise ConfigError(f"{run_dir} exists and is not a bench run: pass another --out")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cfg = dataclasses.replace(run.cfg, out=str(run_dir))
    spec = {"name": run.name, "framework": run.framework, "eval_episodes": run.eval_episodes,
            "eval_env_args": [list(pair) for pair in run.eval_env_args], "eval_checkpoints": list(run.eval_checkpoints),
            "config": cfg.to_dict(), "algo": run.algo_label or cfg.algo.name,
            "race": dataclasses.asdict(run.race) if run.race else None}
    if run.race:  # before the clock starts: how fast the machine is just now (machine_speed.py)
        from conveyor.bench.machine_speed import machine_speed

        spec["machine_speed"] = machine_speed()
    started = time.perf_counter()
    timed_out = False
    with open(run_dir / "bench.log", "w") as log_file:
        # The race's clock starts here: Python's start-up and imports count (race.py).
        spec["spawned_unix"] = time.time()
        (run_dir / SPEC_FILE).write_text(json.dumps(spec, indent=2, default=str))
        child = subprocess.Popen([sys.executable, "-m", CHILD_MODULE, str(run_dir / SPEC_FILE)],
                                 stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env={**os.environ, PARENT_PID_ENV: str(os.getpid())})
        try:
            returncode = child.wait(timeout=run.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            returncode = stop_child(child)
        except BaseException:
            stop_child(child)
            raise
        finally:
            kill_process_group(child)
    status, error = outcome(run_dir, returncode, timed_out, run.timeout_s)
    return result_row(run, cfg, run_dir, status, error, time.perf_counter() - started)


def stop_child(child: subprocess.Popen) -> int:
    """SIGTERM to the child (its run stops, writes its summary and closes its workers); if it is still
    there after ``TERMINATE_GRACE_S``, SIGKILL to its whole process group."""
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    try:
        return child.wait(timeout=TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        kill_process_group(child)
    try:
        return child.wait(timeout=TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        return -signal.SIGKILL


def kill_process_group(child: subprocess.Popen) -> None:
    """SIGKILL whatever is left in the child's process group (e.g. workers of a run that crashed)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


def outcome(run_dir: Path, returncode: int, timed_out: bool, timeout_s: float) -> tuple[str, str]:
    """``(status, one-line error)`` of a finished child."""
    if timed_out:
        return "failed", f"timed out after {timeout_s:.0f}s (stopped; see {run_dir / 'bench.log'})"
    try:
        written = json.loads((run_dir / OUTCOME_FILE).read_text())
        return str(written["status"]), str(written.get("error", ""))
    except (OSError, ValueError, KeyError):
        pass
    if returncode == 0:
        return "ok", ""
    return "failed", f"{_exit_text(returncode)}: {last_line(run_dir / 'bench.log')}"


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1] if lines else "no output"


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# ---- the child side ------------------------------------------------------------------------------
def child_main(spec_path: Path) -> int:
    """Train and evaluate the run described by ``spec_path``; writes ``outcome.json`` beside it."""
    run_dir = spec_path.parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench parent decides when a run stops (SIGTERM)
    if PARENT_PID_ENV in os.environ:  # a parent killed by SIGTERM or SIGKILL cannot stop us: the kernel does
        die_with_parent(int(os.environ[PARENT_PID_ENV]), signal.SIGTERM)
    try:
        spec = json.loads(spec_path.read_text())
        cfg = RunCfg.from_dict(spec["config"])
        framework, episodes = spec["framework"], int(spec["eval_episodes"])
        if spec.get("race"):
            from conveyor.bench.race import race_child

            race_child(spec, cfg, run_dir)
        elif framework == "conveyor":
            from conveyor import train
            from conveyor.evaluate import evaluate_run

            train(cfg)
            if episodes:
                env_args = tuple((key, value) for key, value in spec["eval_env_args"])
                evaluate_run(run_dir, episodes=episodes, env_args=env_args, checkpoints=spec["eval_checkpoints"])
        elif framework == "sb3":
            from conveyor.bench.peers import run_sb3

            run_sb3(cfg, run_dir, episodes)
        elif framework == "cleanrl":
            raise PeerUnavailable("the cleanrl peer runs in the race suite only")
        else:
            from conveyor.bench.peers import run_sample_factory

            run_sample_factory(cfg, run_dir, episodes)
    except PeerUnavailable as error:
        _write_outcome(run_dir, "skipped", str(error))
        print(f"skipped: {error}", file=sys.stderr)
        return EXIT_SKIPPED
    except BaseException as error:  # recorded as the run's one-line error; the traceback goes to bench.log
        import traceback

        traceback.print_exc()
        _write_outcome(run_dir, "failed", one_line(error))
        return 1
    _write_outcome(run_dir, "ok", "")
    return 0


def _write_outcome(run_dir: Path, status: str, error: str) -> None:
    (run_dir / OUTCOME_FILE).write_text(json.dumps({"status": status, "error": error}))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m {CHILD_MODULE} SPEC (internal; use `conveyor bench`)")
    sys.exit(child_main(Path(sys.argv[1])))
