"""Hung envs and stopped workers (``--env-step-timeout-s``): an env whose step never returns, or a worker
stopped with SIGSTOP, is found within the timeout, killed and restarted (counted against ``--max-restarts``),
or the run stops with one line naming the env; a stop request ends a run whose env hangs within seconds, and
no child outlives the run, nor a main process killed with SIGKILL."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import conveyor
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.envs import make_vector_env
from conveyor.envs import vector
from conveyor.errors import WorkerDied, WorkerFailure
from conveyor.procs import descendants
from tests.fault_env import (HANGING_ID, TAGGED_FAMILY, TAGGED_ID, BatchRecorder, alive, check_transitions,
                              children, kill_child)

VECTOR_TIMEOUT_S = 2.0
RUN_TIMEOUT_S = 3.0
"""The runs' --env-step-timeout-s: small, but with room for a loaded machine's scheduling."""
PATIENCE_S = 120.0
"""How long a test waits for something that should happen soon (a busy machine starts Python slowly)."""
REPO = Path(__file__).resolve().parent.parent


def hanging_cfg(num_envs: int = 4, num_workers: int = 2, timeout_s: float = VECTOR_TIMEOUT_S,
                max_restarts: int = 10, **env_args) -> EnvCfg:
    return EnvCfg(id=HANGING_ID, num_envs=num_envs, num_workers=num_workers, env_step_timeout_s=timeout_s,
                  max_restarts=max_restarts, env_args=tuple(env_args.items()), backend="shm")


def wait_for(condition, what: str, timeout_s: float = PATIENCE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---- the vector env ------------------------------------------------------------------------------

def test_a_worker_whose_env_hangs_is_restarted_within_the_timeout_then_the_limit_stops_it_with_one_line():
    seed = 5
    cfg = hanging_cfg(max_restarts=1, hang_at=3, hang_home=seed + 2)  # env 2, in worker 1, on its 3rd step
    with make_vector_env(cfg, seed, restart_workers=True) as venv:
        venv.reset()
        for _ in range(2):
            assert not venv.step(np.zeros(4, int)).restarted.any()
        hung_pid = venv.worker_pids[1]
        start = time.monotonic()
        result = venv.step(np.zeros(4, int))
        took = time.monotonic() - start
        assert VECTOR_TIMEOUT_S <= took < VECTOR_TIMEOUT_S + 30
        np.testing.assert_array_equal(result.restarted, [False, False, True, True])
        assert venv.restarts == 1 and not alive(hung_pid)
        # The replacement's env 2 hangs on its 3rd step too: one restart more than max_restarts allows.
        with pytest.raises(WorkerFailure) as failure:
            for _ in range(3):
                venv.step(np.zeros(4, int))
    message = str(failure.value)
    assert "\n" not in message
    assert f"env worker 1 (pid {venv.worker_pids[1]}, envs 2-3) of {HANGING_ID!r} hung while stepping" in message
    assert "--env-step-timeout-s" in message and "max_restarts=1" in message and "--max-restarts" in message
    assert not [pid for pid in venv.worker_pids if alive(pid)]


def test_a_stopped_worker_is_reported_as_hung_and_killed():
    with make_vector_env(dataclasses.replace(hanging_cfg(), id=TAGGED_ID), 0) as venv:
        venv.reset()
        venv.step(np.zeros(4, int))
        stopped = venv.worker_pids[0]
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerDied, match=r"^env worker 0 \(pid \d+, envs 0-1\) of .*Tagged.* hung while "
                                             r"stepping: .*--env-step-timeout-s.*; killed it$"):
            venv.step(np.zeros(4, int))
        assert VECTOR_TIMEOUT_S <= time.monotonic() - start < VECTOR_TIMEOUT_S + 30
        assert not alive(stopped)


@pytest.mark.slow
def test_a_stop_request_ends_a_step_that_hangs_even_without_a_timeout(monkeypatch):
    monkeypatch.setattr(vector, "CLOSE_GRACE_S", 1.0)
    stop = threading.Event()
    with make_vector_env(hanging_cfg(timeout_s=0, hang_at=1), 0, stop=stop.is_set) as venv:
        venv.reset()
        pids = venv.worker_pids
        threading.Timer(0.5, stop.set).start()
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"still stepping 1 s after the run was asked to stop: killed$"):
            venv.step(np.zeros(4, int))
        assert time.monotonic() - start < 30
    assert not [pid for pid in pids if alive(pid)]


# ---- runs ----------------------------------------------------------------------------------------

def run_cfg(arch: str, tmp_path: Path, env: EnvCfg, **overrides) -> RunCfg:
    """A small run of ``arch`` on ``env`` (num_envs and num_workers are set here)."""
    shapes = {
        "paac": (dict(num_envs=4, num_workers=2), dict(arch=ArchCfg(name="paac", unroll=5))),
        "ga3c": (dict(), dict(algo=AlgoCfg(name="ga3c"), arch=ArchCfg(name="ga3c", num_agents=2, min_train_batch=4,
                                                                       unroll=5))),
        "hts": (dict(num_envs=4, num_workers=2), dict(arch=ArchCfg(name="hts", num_actors=2, sync_interval=5))),
        "impact": (dict(num_envs=4, num_workers=2),
                   dict(algo=AlgoCfg(name="impact"), arch=ArchCfg(name="impact", worker_batch=8, buffer_batches=2,
                                                                  replay_times=2))),
        "seed": (dict(num_envs=4, num_workers=1),
                 dict(algo=AlgoCfg(name="vtrace", optimizer="adam", lr=1e-3),
                      arch=ArchCfg(name="seed", local_actors=2, unroll=5, batch_size=4, inference_batch=32,
                                   inference_timeout_ms=2.0))),
    }
    env_fields, run_fields = shapes[arch]
    base = dict(env=dataclasses.replace(env, family=TAGGED_FAMILY, **env_fields), model=ModelCfg(hidden=(16,)),
                total_steps=2000, torch_threads=1, progress=False, target_return=float("inf"), log_interval_s=30.0,
                out=str(tmp_path / "run"), **run_fields)
    return RunCfg(**{**base, **overrides})


# every architecture in make test-slow (6-9 s each); make test keeps the worker-level hang tests above
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["paac", "ga3c", "hts", "impact", "seed"])
def test_hung_envs_are_killed_and_restarted_and_the_run_reaches_its_step_count(arch, tmp_path, monkeypatch):
    """The first env of each of the run's 2 workers (env workers, agents, executors, IMPACT workers, SEED
    actors) to take its 30th step hangs there, so no worker can go on; the run restarts both (their
    successors' envs do not hang) and goes on; no transition is trained on twice."""
    marker = tmp_path / "hung"
    env = hanging_cfg(timeout_s=RUN_TIMEOUT_S, hang_at=30, marker=str(marker), hangs=2)
    if arch == "seed":
        monkeypatch.setenv("CONVEYOR_TOKEN", "hung-env-test-token")
    recorder = BatchRecorder(monkeypatch)
    summary = conveyor.train(run_cfg(arch, tmp_path, env))
    assert Path(f"{marker}.1").exists(), "fewer than 2 envs hung"
    assert summary["stop_reason"] == "total_steps reached"
    assert summary["restarts"] == 2
    if arch != "impact":  # IMPACT trains each batch up to replay_times times (tests/test_faults_impact.py)
        check_transitions(recorder.transitions)
    assert children() == {}


@pytest.mark.slow
def test_a_paac_run_whose_env_hangs_past_max_restarts_stops_with_one_line_naming_the_env(tmp_path):
    env = hanging_cfg(timeout_s=RUN_TIMEOUT_S, max_restarts=0, hang_at=20)
    with pytest.raises(WorkerFailure) as failure:
        conveyor.train(run_cfg("paac", tmp_path, env, total_steps=10**9))
    message = str(failure.value)
    assert "\n" not in message and "hung while stepping" in message and repr(HANGING_ID) in message
    assert "--env-step-timeout-s" in message and "--max-restarts" in message
    assert list((tmp_path / "run" / "checkpoints").glob("*.pt")), "a failed run still leaves a checkpoint"
    assert children() == {}


@pytest.mark.slow
def test_a_stopped_paac_worker_is_found_killed_and_restarted(tmp_path, monkeypatch):
    recorder = BatchRecorder(monkeypatch)
    env = EnvCfg(id=TAGGED_ID, env_step_timeout_s=RUN_TIMEOUT_S, backend="shm")
    stopper = kill_child("conveyor.envs.shm_worker", lambda: len(recorder.batches) >= 5, sig=signal.SIGSTOP)
    summary = conveyor.train(run_cfg("paac", tmp_path, env))
    assert stopper.killed, "no env worker was stopped"
    assert not alive(stopper.killed)
    assert summary["stop_reason"] == "total_steps reached" and summary["restarts"] == 1
    check_transitions(recorder.transitions)
    assert children() == {}


@pytest.mark.slow
def test_a_seed_run_whose_envs_hang_stops_on_sigterm_and_leaves_no_actor_or_env_worker(tmp_path, monkeypatch):
    """Both local actors' envs hang for good (no timeout); a SIGTERM stops the run, which stops its actors
    (SIGTERM, then SIGKILL past the grace period): their env workers, stuck in a step, must die with them."""
    monkeypatch.setenv("CONVEYOR_TOKEN", "hung-env-test-token")
    marker = tmp_path / "hung"
    env = hanging_cfg(timeout_s=0, hang_at=30, marker=str(marker), hangs=2)
    processes: list[int] = []

    def stop_once_hung() -> None:
        wait_for(lambda: Path(f"{marker}.1").exists(), "both actors' envs to hang")
        processes.extend(descendants(os.getpid()))
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_hung, daemon=True).start()
    summary = conveyor.train(run_cfg("seed", tmp_path, env, total_steps=10**9))
    assert summary["stop_reason"] == "signal SIGTERM"
    assert len(processes) == 4, processes  # 2 actors, each with 1 env worker
    wait_for(lambda: not [pid for pid in processes if alive(pid)], "the actors and env workers to exit", 30)


# ---- the command line: signals ---------------------------------------------------------------------

def start_hanging_run(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    """A ``conveyor train`` (paac) whose env hangs for good once it has run a while, with the timeout off;
    returns it, once an env hangs, and its descendants (the env workers)."""
    marker = tmp_path / "hung"
    hung = Path(f"{marker}.0")
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "train", "--arch", "paac", "--env", HANGING_ID,
                             "--env-arg", "hang_at=200", "--env-arg", f"marker={marker}",
                             "--env-step-timeout-s", "0", "--num-envs", "4", "--num-workers", "2", "--env-backend", "shm",
                             "--total-steps", "100000000", "--target-return", "inf", "--torch-threads", "1",
                             "--no-progress", "--out", str(tmp_path / "run")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + PATIENCE_S
    while not hung.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the env never hung: {proc.communicate()[1]}")
        time.sleep(0.05)
    workers = descendants(proc.pid)
    assert len(workers) == 2, workers
    return proc, workers


@pytest.mark.slow
def test_sigterm_ends_a_run_whose_env_hangs_within_seconds_leaving_no_child(tmp_path):
    proc, workers = start_hanging_run(tmp_path)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=PATIENCE_S)
    assert time.monotonic() - signalled < vector.CLOSE_GRACE_S + 15, "the run took too long to stop"
    assert proc.returncode == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "still stepping" in lines[0] and "asked to stop" in lines[0] and "--resume" in lines[0]
    wait_for(lambda: not [pid for pid in workers if alive(pid)], "the env workers to exit", timeout_s=30)


def test_sigkill_of_the_main_process_leaves_no_env_worker_alive(tmp_path):
    proc, workers = start_hanging_run(tmp_path)  # one worker hangs in its env, the other waits for a command
    proc.kill()
    proc.communicate(timeout=PATIENCE_S)
    wait_for(lambda: not [pid for pid in workers if alive(pid)], "the env workers to die with the run", 30)
