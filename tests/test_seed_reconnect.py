"""SEED actors that reconnect: an episode continued on a new stream reports its whole return (never a fragment),
one cut by a lost actor is counted in ``episodes_cut`` and never reported, and no return is counted twice.

The inference-level tests drive ``CentralInference`` with named streams step by step (either order of an old
stream's release and its actor's next stream); the end-to-end test runs a real ``Actor`` (in a thread, its env in
a worker process) against an in-process server, breaks its stream mid-episode, then replaces it by another actor,
on an env whose every episode lasts ``EPISODE`` steps at reward 1.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import grpc
import gymnasium as gym
import numpy as np
import torch

from conveyor.config import EnvCfg
from conveyor.storage.schema import FieldSpec
from conveyor.architectures.seed.actor import Actor
from conveyor.architectures.seed.batcher import Batcher, EnvSteps, InferenceStats
from conveyor.architectures.seed.inference import CentralInference
from conveyor.architectures.seed.server import SeedServer
from tests.test_seed import TOKEN, EchoPolicy, wait_until

torch.set_num_threads(1)
EPISODE = 12
FIXED_ID = "tests.test_seed_reconnect:Fixed-v0"


class FixedEnv(gym.Env):
    """Episodes of exactly ``EPISODE`` steps, reward 1 each: every whole episode returns ``EPISODE``."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0, 0.0], np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([0.0, self.t / EPISODE], np.float32), 1.0, self.t == EPISODE, False, {}


gym.register("Fixed-v0", entry_point=FixedEnv)


# ---- central inference: one actor's streams, step by step ------------------------------------------

class Streams:
    """``CentralInference`` fed named streams of ``k`` env rows; records the returns it reports."""

    def __init__(self):
        self.stats = InferenceStats()
        self.returns = []
        self.inference = CentralInference(EchoPolicy(), FieldSpec((2,), torch.float32, "obs"), 4, 0.9,
                                          lambda slot, u, stored: None, stats=self.stats,
                                          on_episodes=lambda r: self.returns.extend(r[~np.isnan(r)].tolist()))

    def step(self, slots, run_ids, *, actor="a:1", start=False, returns=None, terminated=None):
        k = len(slots)
        self.inference.process([EnvSteps(
            np.asarray(slots, np.int64), np.asarray(run_ids, np.int64), np.zeros((k, 2), np.float32),
            np.ones(k, np.float32), np.asarray(terminated if terminated is not None else [False] * k),
            np.zeros(k, bool), np.zeros((0, 2), np.float32),
            np.asarray(returns if returns is not None else [np.nan] * k, np.float32), actor, start)])

    def counter(self, name):
        return self.stats.counters.get(name, 0)


def test_a_reconnected_actor_continues_its_episodes_and_none_is_counted_twice():
    s = Streams()
    s.step([0, 1], [10, 11], start=True)
    s.step([0, 1], [10, 11])
    s.inference.release([0, 1])  # the stream broke mid-episode; the actor keeps its envs and comes back
    assert s.counter("episodes_cut") == 2  # provisional: until the actor continues them
    s.step([0, 1], [10, 11], start=True)
    assert (s.counter("episodes_cut"), s.counter("episodes_resumed")) == (0, 2)
    # Row 0's episode ends in a Step whose reply is lost: the learner counted it once; the next stream's first
    # Step repeats it (row 0 already runs episode 20 here), and it is not counted again.
    s.step([0, 1], [20, 11], returns=[7.0, np.nan], terminated=[True, False])
    s.inference.release([0, 1])
    s.step([2, 3], [20, 11], start=True, returns=[7.0, np.nan])
    assert s.returns == [7.0]
    # Row 1's episode ends in a Step the learner never gets: the repeat is counted, the episode not cut.
    s.inference.release([2, 3])
    s.step([0, 1], [20, 21], start=True, returns=[np.nan, 9.0])
    assert s.returns == [7.0, 9.0]
    assert (s.counter("episodes_cut"), s.counter("episodes_resumed"), s.counter("episode_returns_recovered")) == \
        (0, 5, 1)


def test_episodes_of_an_actor_that_never_continues_them_are_cut_and_never_reported():
    s = Streams()
    s.step([0, 1, 2], [10, 11, 12], start=True)
    s.step([0, 1, 2], [10, 11, 12])
    s.inference.release([0, 1, 2])  # the actor process died: a restarted one has another name and new envs
    s.step([0, 1, 2], [30, 31, 32], actor="a:2", start=True)
    assert s.counter("episodes_cut") == 3 and s.counter("episodes_resumed") == 0
    # The same actor rebuilt its envs (new run ids): whatever its old stream had in progress is cut.
    s.step([0, 1, 2], [30, 31, 32], actor="a:2")
    s.inference.release([0, 1, 2])
    s.step([3, 4, 5], [40, 31, 41], actor="a:2", start=True)
    assert s.counter("episodes_cut") == 5 and s.counter("episodes_resumed") == 1
    assert s.returns == []


def test_a_reconnect_seen_before_the_old_stream_ends_is_matched_too():
    """A broken connection may reach the learner long after the actor's new stream: the old slots are still open
    when the new stream's first Step arrives; their later release counts nothing."""
    s = Streams()
    s.step([0, 1], [10, 11], start=True)
    s.step([0, 1], [10, 11])
    s.step([2, 3], [10, 99], start=True)  # row 1 lost its episode (say the env was rebuilt)
    assert (s.counter("episodes_cut"), s.counter("episodes_resumed")) == (1, 1)
    s.inference.release([0, 1])
    s.step([2, 3], [10, 99])
    assert (s.counter("episodes_cut"), s.counter("episodes_resumed")) == (1, 1)
    s.inference.release([2, 3])  # and this stream's episodes wait for the actor again
    assert s.counter("episodes_cut") == 3


def test_unnamed_streams_keep_the_old_accounting():
    s = Streams()
    s.step([0], [10], actor="", start=True)
    s.inference.release([0])
    s.step([0], [11], actor="", start=True, returns=[5.0])
    assert s.returns == [5.0] and s.counter("episodes_cut") == 0


# ---- end to end: a real actor whose stream breaks -----------------------------------------------------

ENVS = 3


class Learner:
    """An in-process SEED server wired as ``architectures.seed`` wires it, on the fixed-length env."""

    def __init__(self, tmp_path):
        self.stats = InferenceStats()
        self.returns = []
        self.inference = CentralInference(EchoPolicy(), FieldSpec((2,), torch.float32, "obs"), 5, 0.9,
                                          lambda slot, u, stored: None, stats=self.stats,
                                          on_episodes=lambda r: self.returns.extend(r[~np.isnan(r)].tolist()))
        self.batcher = Batcher(self.inference.process, 64, 0.002, stats=self.stats)
        env_json = json.dumps({**dataclasses.asdict(EnvCfg(id=FIXED_ID, num_envs=ENVS, num_workers=1)), "gamma": 0.9})
        self.server = SeedServer(self.batcher, self.inference.release, listen=f"unix:{tmp_path}/r.sock", token=TOKEN,
                                 env_config_json=env_json, obs_shape=(2,), obs_dtype=np.float32, base_seed=0,
                                 max_message_bytes=1 << 16, stats=self.stats)
        self.batcher.expected_rows = lambda: self.server.expected_envs
        self.batcher.on_timeout = self.server.mark_late
        self.address = self.server.start()

    def break_streams(self):
        """Cancel every open stream (as the idle watchdog does): its actor sees the break and reconnects."""
        with self.server._lock:
            streams = list(self.server._streams)
        for stream in streams:
            stream.context.cancel()
        return len(streams)

    def close(self):
        self.server.close(0.5)
        self.batcher.close()


class ActorThread:
    """An ``Actor`` that reconnects after every break (as ``Actor.run`` does) until ``stop``."""

    def __init__(self, address, name):
        self.actor = Actor(address, TOKEN, ENVS, 1)
        self.actor.name = name
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stopped.is_set():
            try:
                self.actor._session()
                return
            except grpc.RpcError:
                time.sleep(0.05)

    def stop(self):
        self.stopped.set()


def test_an_actor_reconnecting_mid_episode_reports_whole_returns_and_a_replaced_one_cuts_its_episodes(tmp_path):
    learner = Learner(tmp_path)
    first = second = None
    try:
        first = ActorThread(learner.address, "host:1")
        wait_until(lambda: len(learner.returns) >= ENVS, what="first episodes")
        breaks = 0
        for pause in (0.13, 0.31, 0.07, 0.22):  # break the stream at arbitrary points of the episodes
            time.sleep(pause)
            wait_until(lambda: learner.server.open_envs == ENVS, what="the actor's stream")
            breaks += learner.break_streams()
            seen = len(learner.returns)
            wait_until(lambda: len(learner.returns) >= seen + ENVS, what="episodes after the reconnect")
        counters = learner.stats.counters
        assert breaks == 4
        # The returns waited for may come from the old stream's last Steps, before the actor is back: its episodes
        # count as cut until its next stream continues them, which the design guarantees happens.
        wait_until(lambda: counters.get("episodes_cut", 0) == 0, what="the actor to continue its episodes")
        # Each break continues (or recovers the return of) every episode in progress. The envs run in lockstep
        # (fixed-length episodes), so a break that lands between two of their episodes finds none in progress.
        continued = counters.get("episodes_resumed", 0) + counters.get("episode_returns_recovered", 0)
        assert continued % ENVS == 0 and 0 < continued <= breaks * ENVS, counters
        # The actor process is replaced: its episodes in progress are cut, the new actor's start afresh.
        first.stop()
        learner.break_streams()
        first.thread.join(timeout=30)
        first.actor.close()
        wait_until(lambda: learner.stats.counters.get("episodes_cut", 0) == ENVS, what="the cut episodes")
        second = ActorThread(learner.address, "host:2")
        seen = len(learner.returns)
        wait_until(lambda: len(learner.returns) >= seen + 2 * ENVS, what="the new actor's episodes")
        assert learner.stats.counters["episodes_cut"] == ENVS
        assert learner.returns and set(learner.returns) == {float(EPISODE)}  # no fragment, ever
    finally:
        learner.close()
        for actor in (first, second):
            if actor is not None:
                actor.stop()
                actor.thread.join(timeout=30)
                actor.actor.close()
