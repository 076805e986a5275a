"""IMPACT under faults: a killed worker process is restarted (fresh env seeds, newest weights), the batch it
was writing is dropped and its slot reused, and the run goes on; past ``max_restarts`` the run stops with
one line naming the worker.

Every run here uses ``tests.fault_env``'s tagged env, so each trained transition names its episode seed and
step. IMPACT's circular buffer trains on each worker batch (unroll) up to K times, so the strongest true
statement about the trained data is: each distinct unroll was used at most K times, no transition appears in
two different unrolls (a restart that replayed its first life's episodes would repeat them), no episode
lost a transition in its middle, and the distinct unrolls are exactly the batches put into the buffer
(``env_steps / (S * E)``), less at most the last one (put just before the run stopped, never taken).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import conveyor
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.errors import WorkerFailure
from conveyor.models import make_model
from conveyor.architectures.impact.collector import FATAL, SLOTS_PER_WORKER, pool_specs
from conveyor.architectures.impact.workers import Workers
from conveyor.architectures.impact.params import ParamBlock
from conveyor.storage.shm import SharedArrays
from tests.fault_env import (TAGGED_FAMILY, TAGGED_ID, BatchRecorder, TaggedEnv, check_transitions, children,
                              gone_within, kill_child)

torch.set_num_threads(1)

W, E, S, K = 2, 2, 8, 2
IMPACT_WORKER = "impact.collector"
"""A substring of an IMPACT worker's command line (its env workers run ``conveyor.envs.shm_worker``)."""


def tagged_cfg(tmp_path: Path, *, workers: int = W, max_restarts: int = 10, total_steps: int = 1200) -> RunCfg:
    # backend shm: each IMPACT worker steps its envs in an env worker of its own, which must not outlive it
    return RunCfg(env=EnvCfg(id=TAGGED_ID, family=TAGGED_FAMILY, num_envs=workers * E, num_workers=workers,
                             max_restarts=max_restarts, backend="shm"),
                  model=ModelCfg(hidden=(16,)), algo=AlgoCfg(name="impact"),
                  arch=ArchCfg(name="impact", worker_batch=S, buffer_batches=2, replay_times=K),
                  total_steps=total_steps, target_return=float("inf"), torch_threads=1, progress=False,
                  log_interval_s=30.0, out=str(tmp_path / "run"))


def assert_no_processes_left(env_workers: set[int]) -> None:
    """No child of this process remains, and no env worker of a killed IMPACT worker outlived it (it exits once
    its pipes close; the long wait is only for a heavily loaded machine)."""
    assert not children(), f"child processes left: {children()}"
    assert gone_within(env_workers, 30), "an env worker outlived its IMPACT worker"


def killer(rec: BatchRecorder, updates: int, env_workers: set[int]):
    """``kill_child`` of an IMPACT worker once the learner made ``updates`` updates; first notes the env
    worker processes (grandchildren of this one) of every IMPACT worker in ``env_workers``."""

    def when() -> bool:
        if len(rec.batches) < updates:
            return False
        for pid, cmd in children().items():
            if IMPACT_WORKER in cmd:
                env_workers.update(children(pid))
        return True

    return kill_child(IMPACT_WORKER, when, timeout_s=300.0)


def record_deliveries(monkeypatch) -> tuple[list, list]:
    """(starts, deliveries): every worker start as (index, life, published weights version), every batch a
    worker sent as (index, life, oldest policy version in it, slot)."""
    starts, deliveries = [], []
    start, receive = Workers._start, Workers._receive

    def recording_start(self, index):
        starts.append((index, self.lives[index], self.params.version))
        return start(self, index)

    def recording_receive(self, index, data):
        for local in data:
            if local != FATAL:
                slot = index * SLOTS_PER_WORKER + local
                deliveries.append((index, self.lives[index], int(self.pool["policy_version"][slot].min()), slot))
        return receive(self, index, data)

    monkeypatch.setattr(Workers, "_start", recording_start)
    monkeypatch.setattr(Workers, "_receive", recording_receive)
    return starts, deliveries


@pytest.mark.slow  # make test keeps repeated deaths
def test_killed_worker_is_restarted_and_the_run_trains_on_every_delivered_transition_once(tmp_path, monkeypatch):
    """SIGKILL the worker after 5 updates: the run reaches total_steps with one restart, trains on exactly the
    delivered unrolls (see the module docstring), and the new process acts with the weights of its start."""
    rec = BatchRecorder(monkeypatch)
    starts, deliveries = record_deliveries(monkeypatch)
    env_workers: set[int] = set()
    # One worker: the learner must wait for the restarted one, so its batches are surely trained on (a second
    # worker would go on alone; on a loaded machine the run could end before the new process is up).
    cfg = tagged_cfg(tmp_path, workers=1)
    thread = killer(rec, updates=5, env_workers=env_workers)
    summary = conveyor.train(cfg)
    thread.join(timeout=1.0)
    assert thread.killed, "no IMPACT worker was killed"
    assert env_workers

    assert summary["stop_reason"] == "total_steps reached"
    assert summary["restarts"] == 1
    assert summary["env_steps"] >= cfg.total_steps
    # env_steps counts the batches put into the buffer; the half-written one is reported apart.
    assert summary["env_steps"] == summary["batches_received"] * S * E
    assert 0 <= summary["dropped_steps"] <= S * E and summary["dropped_steps"] % E == 0

    # Each distinct unroll used at most K times; no transition in two unrolls; no gaps inside episodes.
    unrolls: dict[bytes, tuple[np.ndarray, int]] = {}
    for batch in rec.batches:
        seen, uses = unrolls.get(batch.tobytes(), (batch, 0))
        unrolls[batch.tobytes()] = (seen, uses + 1)
    assert max(uses for _, uses in unrolls.values()) <= K
    assert sum(uses < K for _, uses in unrolls.values()) <= cfg.arch.buffer_batches  # those still in the buffer
    assert len(rec.batches) == summary["updates"]
    stats = check_transitions(np.concatenate([batch for batch, _ in unrolls.values()]))
    # Every batch put was trained on, but for the last one when the run stopped right after putting it.
    assert summary["batches_received"] - 1 <= len(unrolls) <= summary["batches_received"]
    assert stats["transitions"] == len(unrolls) * S * E
    assert summary["env_steps"] - S * E <= stats["transitions"] <= summary["env_steps"]

    # The restarted worker took the killed one's index, acted with the weights published when it started
    # (never older ones), and delivered batches.
    (index, life, published), = [start for start in starts if start[1] > 0]
    assert life == 1 and published >= 5
    reborn = [oldest for worker, worker_life, oldest, _ in deliveries if (worker, worker_life) == (index, 1)]
    assert reborn and min(reborn) >= published
    assert_no_processes_left(env_workers)


@pytest.mark.slow  # make test keeps repeated deaths
def test_no_restarts_allowed_stops_the_run_with_one_line_naming_the_worker(tmp_path, monkeypatch):
    """max_restarts=0: the first death raises WorkerFailure (one line: worker, pid, signal, the fix) after a
    checkpoint, and leaves no process behind."""
    rec = BatchRecorder(monkeypatch)
    env_workers: set[int] = set()
    thread = killer(rec, updates=3, env_workers=env_workers)
    with pytest.raises(WorkerFailure) as failure:
        conveyor.train(tagged_cfg(tmp_path, workers=1, max_restarts=0, total_steps=1_000_000))
    thread.join(timeout=1.0)
    message = str(failure.value)
    assert "\n" not in message
    assert "impact worker " in message and f"(pid {thread.killed}, envs " in message, message
    assert "SIGKILL" in message and "max_restarts=0" in message and "raise --max-restarts" in message, message
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt")), "no checkpoint before stopping"
    assert_no_processes_left(env_workers)


def test_repeated_deaths_reuse_the_slots_until_max_restarts(monkeypatch):
    """Transport level, two workers, max_restarts=3. Worker 1 is killed while starting up, and so are its next
    two lives; its fourth life must still get both slots (none leaked), deliver with the published weights
    while worker 0 delivers too, and, killed in turn mid-batch, stop with one line naming it and the fix.
    (Killing lives as they start keeps the test to one process start-up time on a loaded machine.)"""
    cfg = RunCfg(env=EnvCfg(id=TAGGED_ID, family=TAGGED_FAMILY, num_envs=W * E, num_workers=W),
                 model=ModelCfg(hidden=(8,)),
                 algo=AlgoCfg(name="impact"), arch=ArchCfg(name="impact", worker_batch=S))
    spaces = (TaggedEnv().observation_space, TaggedEnv().action_space)
    model = make_model(cfg.model, *spaces)
    pool = SharedArrays(pool_specs(cfg, *spaces))
    params = ParamBlock(model)
    params.publish(model, 3)
    starts, deliveries = record_deliveries(monkeypatch)
    dropped: list[int] = []

    def on_restart(dropped_steps: int) -> None:
        dropped.append(dropped_steps)
        if workers.lives[1] < 3:
            os.kill(workers.processes[1].pid, signal.SIGKILL)

    workers = Workers(cfg, pool, params, max_restarts=3, on_restart=on_restart)
    os.kill(workers.processes[1].pid, signal.SIGKILL)
    taken = {0: 0, 1: 0}  # batches taken per worker
    killed = False
    try:
        with pytest.raises(WorkerFailure) as failure:
            deadline = time.monotonic() + 150  # about 5 s on an idle machine
            while time.monotonic() < deadline:
                slot = workers.next_slot(0.5)
                if slot is None:
                    continue
                index = slot // SLOTS_PER_WORKER
                taken[index] += 1
                workers.release(slot)
                if index == 1 and taken[1] >= 3 and taken[0] and not killed:
                    time.sleep(0.05)  # let it write a few steps into its next slot
                    os.kill(workers.processes[1].pid, signal.SIGKILL)
                    killed = True
        message = str(failure.value)
        assert message.startswith("impact worker 1 (pid ") and "\n" not in message, message
        assert "killed by signal SIGKILL" in message and "3 restarts reach max_restarts=3: raise --max-restarts" \
            in message, message
        assert workers.restart_budget.restarts == 3 and workers.lives == [0, 3] and dropped == [0, 0, 0]
        assert [(index, life) for index, life, _ in starts] == [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3)]
        assert {(index, life) for index, life, _, _ in deliveries} == {(0, 0), (1, 3)}, set(deliveries)
        assert taken[0] > 0 and taken[1] >= 3  # both of life 3's slots went round: 3 batches from 2 slots
        assert all(oldest >= 3 for _, _, oldest, _ in deliveries)  # every life acted with the published weights
    finally:
        processes = [process for process in workers.processes if process is not None]
        workers.close()
        params.close()
        pool.close()
    assert all(process.poll() is not None for process in processes)


@pytest.mark.slow
def test_a_worker_whose_env_worker_dies_is_restarted_like_a_dead_worker(monkeypatch, tmp_path):
    rec = BatchRecorder(monkeypatch)
    killed: list[int] = []

    def kill_an_env_worker() -> None:  # a grandchild: the env worker of the IMPACT worker
        deadline = time.monotonic() + 300.0
        while not killed and time.monotonic() < deadline:
            if len(rec.batches) >= 5:
                for pid, cmd in children().items():
                    env_workers = [child for child, line in children(pid).items() if "shm_worker" in line]
                    if IMPACT_WORKER in cmd and env_workers:
                        os.kill(env_workers[0], signal.SIGKILL)
                        killed.append(env_workers[0])
                        break
            time.sleep(0.05)

    thread = threading.Thread(target=kill_an_env_worker, daemon=True)
    thread.start()
    summary = conveyor.train(tagged_cfg(tmp_path, workers=1))
    assert killed, "no env worker was killed"
    assert summary["stop_reason"] == "total_steps reached"
    assert summary["restarts"] == 1
    check_transitions(np.unique(np.concatenate(rec.batches), axis=0))
    assert not children()
