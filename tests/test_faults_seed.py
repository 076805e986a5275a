"""SEED RL under faults: dying, restarted and stalled actors lose no transition and duplicate none.

Server-level tests run an in-process server around a fake policy (``tests.test_seed``); the end-to-end
tests train on the tagged env (``tests.fault_env``), whose every observation names its transition, record
every transition the learner trains on, and kill or stall actors mid-run.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import torch

import conveyor
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.errors import WorkerFailure
from conveyor.storage.schema import FieldSpec
from conveyor.storage.unrolls import UnrollQueue
from conveyor.architectures.seed import server as seed_server
from conveyor.architectures.seed.batcher import Batcher, InferenceStats
from conveyor.architectures.seed.inference import CentralInference
from conveyor.architectures.seed.server import SeedServer, actor_env_seed
from tests.fault_env import TAGGED_FAMILY, TAGGED_ID, BatchRecorder, check_transitions, children, kill_child
from tests.test_seed import TOKEN, Client, EchoPolicy, env_steps, wait_until

torch.set_num_threads(1)
B, T, ENVS = 4, 5, 4  # learner batch (unrolls), unroll length, envs per local actor
STALLED_TAG = 0xDEAD0000  # episode id in the stalled client's observations


# ---- counting ------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [0, 2])
def test_steps_count_when_their_unroll_reaches_the_sink_and_dropped_ones_apart(overlap):
    """Every acted step is counted once: in env_steps when the first unroll holding it is emitted, or as
    dropped when its partial unroll is released; with overlap, repeated steps are not counted again."""
    counted, sunk = [], []
    stats = InferenceStats()
    inference = CentralInference(EchoPolicy(), FieldSpec((2,), torch.float32, "obs"), 4, 0.9,
                                 lambda slot, u, stored: (sunk.append(slot), stored()), overlap=overlap, stats=stats,
                                 on_steps=counted.append)
    for t in range(10):  # slot 0 acts on observations 0..9; slot 1 only on 0..2
        inference.process([env_steps([0, 1] if t < 3 else [0], [[t, 0]] * (2 if t < 3 else 1))])
    stride = 4 - overlap
    emitted = len(range(4, 10, stride))  # an unroll leaves when observation 4, 4 + stride, ... arrives
    assert sunk == [0] * emitted and sum(counted) == 4 + (emitted - 1) * stride
    assert inference.release([0, 1]) == 10 - sum(counted) + 3  # slot 0's unemitted steps, slot 1's three
    assert stats.counters["dropped_steps"] == 10 - sum(counted) + 3
    assert stats.counters["partial_unrolls_dropped"] == 2


# ---- the server: seeds, stalls, the idle deadline --------------------------------------------------

class Server:
    """An in-process SEED server wired as ``architectures.seed`` wires it (expected envs, late streams)."""

    def __init__(self, tmp_path, timeout_s=0.002, base_seed=0, name="s.sock", idle_timeout_s=30.0):
        self.stats = InferenceStats()
        self.inference = CentralInference(EchoPolicy(), FieldSpec((2,), torch.float32, "obs"), 5, 0.9,
                                          lambda slot, u, stored: None, stats=self.stats)
        self.batcher = Batcher(self.inference.process, 64, timeout_s, stats=self.stats)
        self.server = SeedServer(self.batcher, self.inference.release, listen=f"unix:{tmp_path}/{name}", token=TOKEN,
                                 env_config_json="{}", obs_shape=(2,), obs_dtype=np.float32, base_seed=base_seed,
                                 max_message_bytes=1 << 16, stats=self.stats, idle_timeout_s=idle_timeout_s)
        self.batcher.expected_rows = lambda: self.server.expected_envs
        self.batcher.on_timeout = self.server.mark_late
        self.address = self.server.start()

    def close(self):
        self.server.close(0.5)
        self.batcher.close()


def test_env_seeds_follow_slot_blocks_and_differ_in_every_life(tmp_path):
    server = Server(tmp_path, base_seed=3)
    try:
        first, second = Client(server.address, num_envs=2), Client(server.address, num_envs=2)
        assert [first.welcome.env_seed, second.welcome.env_seed] == [actor_env_seed(3, 0, 0), actor_env_seed(3, 2, 0)]
        first.send([[1, 0], [2, 0]])
        first.close()  # dies; its slots come back to the next actor, with the next life's seed
        wait_until(lambda: server.stats.actors_connected == 1, what="the closed stream's release")
        again = Client(server.address, num_envs=2)
        assert again.env_ids.tolist() == [0, 1] and again.welcome.env_seed == actor_env_seed(3, 0, 1)
        seeds = {actor_env_seed(3, 0, 0), actor_env_seed(3, 2, 0), actor_env_seed(3, 0, 1), actor_env_seed(4, 0, 0)}
        assert len(seeds) == 4
        second.close()
        again.close()
    finally:
        server.close()


@pytest.mark.slow  # waits out a timeout
def test_a_stalled_stream_costs_one_timeout_and_is_closed_at_the_idle_deadline(tmp_path):
    idle_timeout_s = 3.0
    server = Server(tmp_path, timeout_s=0.3, idle_timeout_s=idle_timeout_s)
    try:
        good, stalled = Client(server.address), Client(server.address)
        assert stalled.send([[1, 0], [2, 0]]).tolist() == [1, 2]  # ... and then it sends nothing more
        stalled_since = time.monotonic()
        for t in range(20):
            assert good.send([[t, 0], [t, 0]]).tolist() == [t, t]
        # The first batch without the stalled stream waited for it until its deadline; after that it is late
        # and no batch waits for it (without this, each of the 20 steps would have waited for the timeout).
        assert server.stats.counters["batch_timeouts"] <= 2
        assert server.server.expected_envs == 2
        open_envs, waited = server.server.open_envs, time.monotonic() - stalled_since
        # Still open before its idle deadline (a machine slow enough to take longer over 20 steps may be past it;
        # the learner's clock for it started when its message arrived, a little before the reply got back here).
        assert open_envs == 4 or waited >= idle_timeout_s - 0.5
        done, served = threading.Event(), []

        def keep_stepping():  # the good actor goes on (so it is never idle) while the stalled one times out
            while not done.is_set():
                served.append(good.send([[3, 0], [4, 0]]).tolist() == [3, 4])
                time.sleep(0.02)

        stepping = threading.Thread(target=keep_stepping)
        stepping.start()
        try:
            with pytest.raises(grpc.RpcError) as closed:  # the learner gives up on it after idle_timeout_s
                next(stalled.replies)
            assert closed.value.code() == grpc.StatusCode.CANCELLED
            wait_until(lambda: server.stats.actors_connected == 1, what="the stalled stream's release")
            count = len(served)
            wait_until(lambda: len(served) > count + 5, what="the good actor to be served on")
        finally:
            done.set()
            stepping.join(30)
        assert all(served) and server.stats.counters["streams_closed_idle"] == 1
        assert server.stats.counters["dropped_steps"] == 2  # the stalled stream's one step per env, never emitted
        assert server.server.open_envs == 2
        good.close()
        stalled.close()
    finally:
        server.close()


# ---- end to end ----------------------------------------------------------------------------------

def tagged_cfg(tmp_path, *, total_steps, local_actors=2, num_envs=ENVS, max_restarts=10, time_limit_s=300.0,
               timeout_ms=2.0):
    return RunCfg(env=EnvCfg(id=TAGGED_ID, family=TAGGED_FAMILY, num_envs=num_envs, num_workers=1,
                             max_restarts=max_restarts),
                  model=ModelCfg(name="mlp", hidden=(16,)),
                  algo=AlgoCfg(name="vtrace", optimizer="adam", lr=1e-3),
                  arch=ArchCfg(name="seed", local_actors=local_actors, unroll=T, batch_size=B, inference_batch=32,
                               inference_timeout_ms=timeout_ms),
                  total_steps=total_steps, target_return=float("inf"), time_limit_s=time_limit_s, torch_threads=1,
                  progress=False, out=str(tmp_path / "run"), seed=0)


class Events:
    """Records, in order, every Welcome's (first slot, life) and every unroll handed to the learner's queue."""

    def __init__(self, monkeypatch):
        self.log = []
        self._lock = threading.Lock()
        original_seed, original_put = seed_server.actor_env_seed, UnrollQueue.put

        def welcome(base_seed, first_slot, life):
            with self._lock:
                self.log.append(("welcome", first_slot, life))
            return original_seed(base_seed, first_slot, life)

        def put(queue, slot, unroll, *args, **kwargs):
            handed = original_put(queue, slot, unroll, *args, **kwargs)
            with self._lock:
                self.log.append(("unroll", slot, handed))
            return handed

        monkeypatch.setattr(seed_server, "actor_env_seed", welcome)
        monkeypatch.setattr(UnrollQueue, "put", put)

    def welcomes(self):
        with self._lock:
            return [(i, first, life) for i, (kind, first, life) in enumerate(self.log) if kind == "welcome"]

    def unrolls_after(self, index, slots):
        """Unrolls handed from ``slots`` after log entry ``index``."""
        with self._lock:
            return sum(kind == "unroll" and slot in slots for kind, slot, _ in self.log[index:])


def test_killed_local_actor_is_restarted_and_no_transition_is_lost_or_duplicated(tmp_path, monkeypatch):
    """One local actor (8 envs), SIGKILLed after 3 updates: the rest of the run is the restarted actor's."""
    recorder, events = BatchRecorder(monkeypatch), Events(monkeypatch)
    killer = kill_child("conveyor.architectures.seed.actor", lambda: len(recorder.batches) >= 3, timeout_s=300)
    summary = conveyor.train(tagged_cfg(tmp_path, total_steps=3_000, local_actors=1, num_envs=2 * ENVS))
    assert killer.killed, "no actor was killed"
    assert summary["stop_reason"] == "total_steps reached"
    assert summary["restarts"] == 1 and summary["env_steps"] >= 3_000
    # The restarted actor was welcomed with a seed of its own (a repeated one would replay the same tagged
    # episodes: check_transitions would find them twice), and most of what was trained is its.
    (_, *first), (index, *second) = events.welcomes()
    assert second != first and second == [0, 1]  # its old slots back, the next life
    assert events.unrolls_after(index, range(2 * ENVS)) > 0
    counts = check_transitions(recorder.transitions)
    trained = len(recorder.transitions)
    assert trained == counts["transitions"] == summary["updates"] * B * T
    assert sum(summary["policy_lag"]["histogram"].values()) == trained
    # env_steps counts exactly the transitions handed to the unroll queue; those not trained yet when the run
    # stopped sit in the queue (2 B unrolls) or with the prefetch thread (a batch ready, one in hand).
    assert 0 <= summary["env_steps"] - trained <= 4 * B * T
    handed = sum(kind == "unroll" and ok for kind, _, ok in events.log)
    assert summary["env_steps"] <= handed * T  # (more unrolls may have arrived after the summary was taken)
    # The dead actor's partial unrolls were dropped, never mixed into a batch, and counted with its restart.
    assert summary["dropped_steps"] == summary["inference"]["dropped_steps"]
    assert 0 < summary["dropped_steps"] <= 2 * ENVS * T
    assert children() == {}


@pytest.mark.slow
def test_a_stalled_actor_does_not_hold_up_the_others(tmp_path, monkeypatch):
    """A client that says Hello, sends one step and goes silent, with a 500 ms inference timeout: before the
    fix every later batch waited 500 ms for it (at most 16 steps/s: 5000 steps would take over 300 s, past the
    time limit, and nearly every batch closed on its timeout)."""
    monkeypatch.setenv("CONVEYOR_TOKEN", TOKEN)
    recorder = BatchRecorder(monkeypatch)
    out = tmp_path / "run"
    stall = {}

    def stall_an_actor():
        wait_until(lambda: len(recorder.batches) >= 3, timeout_s=300, what="training to start")
        client = Client((out / "learner_address").read_text().strip(), num_envs=ENVS)
        obs = np.array([[STALLED_TAG >> 16, STALLED_TAG & 0xFFFF, 0]] * ENVS, np.float32) / 65536.0
        client.send(obs)
        stall.update(client=client, batches=len(recorder.batches))

    staller = threading.Thread(target=stall_an_actor, daemon=True)
    staller.start()
    summary = conveyor.train(tagged_cfg(tmp_path, total_steps=5_000, time_limit_s=180.0, timeout_ms=500.0))
    staller.join(5.0)
    assert "client" in stall, "the stalled client never connected"
    assert summary["stop_reason"] == "total_steps reached"
    inference = summary["inference"]
    assert inference["actors_connected_max"] == 3
    assert len(recorder.batches) - stall["batches"] >= 10  # the learner kept training through the stall
    assert inference.get("batch_timeouts", 0) * 10 < inference["inference_batch"]["forwards"]
    transitions = recorder.transitions
    check_transitions(transitions)
    assert not (transitions[:, 0] == STALLED_TAG).any()  # its lone step was never trained on
    stall["client"].close()
    assert children() == {}


def test_max_restarts_0_stops_the_run_at_the_first_dead_actor_with_one_line(tmp_path, monkeypatch):
    recorder = BatchRecorder(monkeypatch)
    killer = kill_child("conveyor.architectures.seed.actor", lambda: len(recorder.batches) >= 2, timeout_s=300)
    with pytest.raises(WorkerFailure) as failure:
        conveyor.train(tagged_cfg(tmp_path, total_steps=10**7, max_restarts=0))
    message = str(failure.value)
    assert killer.killed and f"pid {killer.killed}" in message
    assert len(message.splitlines()) == 1 and "local actor" in message and "SIGKILL" in message
    assert "--max-restarts" in message
    assert children() == {}
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt"))  # the learner's state was saved first
