"""GA3C under faults: a killed agent process is restarted (same id, the id's next episode seed), the segment it
was writing is dropped and its slot returned, and the run goes on; past ``max_restarts`` the run stops with one
line naming the agent.

Every run here uses ``tests.fault_env``'s tagged env, so each trained transition names its episode seed and
step. GA3C trains on each finished segment exactly once, so the trained transitions are all distinct, no
episode lost one in its middle (only the tail of the episode a dead agent was playing), every episode seed is
``episode_seed(cfg.seed, agent id, e)`` for an episode ``e`` that id started, and ``env_steps`` is exactly the
number of transitions trained on (a dropped segment is reported as ``dropped_steps`` instead).

The deterministic tests below put an agent's death at each point of the slot and request protocols by
driving an in-process ``AgentLink`` by hand; the pool test kills real agent processes several times at
random points and checks that no segment slot leaks and every step is accounted for.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

import conveyor
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.envs import episode_seed
from conveyor.errors import WorkerFailure
from conveyor.architectures.ga3c.threads import ThreadGroup
from conveyor.architectures.ga3c.agents import AgentLink, AgentPool
from conveyor.architectures.ga3c.queues import Channels
from tests.fault_env import TAGGED_FAMILY, TAGGED_ID, BatchRecorder, check_transitions, children, kill_child, tags
from tests.test_ga3c import segment_schema

torch.set_num_threads(1)

T = 5
"""Unroll (segment length) everywhere here."""
AGENT = "ga3c.agents"
"""A substring of a GA3C agent's command line."""


def tagged_cfg(tmp_path, *, agents: int, max_restarts: int = 10, total_steps: int = 1000) -> RunCfg:
    return RunCfg(env=EnvCfg(id=TAGGED_ID, family=TAGGED_FAMILY, max_restarts=max_restarts),
                  model=ModelCfg(hidden=(16,)),
                  algo=AlgoCfg(name="ga3c"), arch=ArchCfg(name="ga3c", num_agents=agents, min_train_batch=4, unroll=T),
                  total_steps=total_steps, target_return=float("inf"), torch_threads=1, progress=False,
                  log_interval_s=30.0, out=str(tmp_path / "run"))


def agent_episode_seeds(seed: int, agents: int, episodes: int = 1000) -> set[int]:
    return {episode_seed(seed, a, e) for a in range(agents) for e in range(episodes)}


# ---- whole runs --------------------------------------------------------------------------------

def test_killed_agent_is_restarted_and_every_delivered_transition_is_trained_once(tmp_path, monkeypatch):
    rec = BatchRecorder(monkeypatch)
    # One agent: the learner must wait for the restarted one, so training surely goes on with its segments.
    cfg = tagged_cfg(tmp_path, agents=1)
    killer = kill_child(AGENT, when=lambda: len(rec.batches) >= 5)
    summary = conveyor.train(cfg)
    killer.join(timeout=1.0)
    assert killer.killed, "no GA3C agent was killed"

    assert summary["stop_reason"] == "total_steps reached"
    assert summary["restarts"] == 1
    assert summary["env_steps"] >= cfg.total_steps
    # The agent was killed with at most one unfinished segment: those steps are dropped, not counted.
    assert 0 <= summary["dropped_steps"] <= T
    trained = rec.transitions
    assert len(trained) == summary["env_steps"]  # env_steps counts exactly what was trained on
    counts = check_transitions(trained)  # nothing twice, no gap inside an episode
    # Cut short: the episode the kill interrupted, and the one(s) still running when the run stopped.
    assert counts["complete_episodes"] >= counts["episodes"] - 3
    # Every episode is seeded from (run seed, agent id, episode number): the restart went on with new ones.
    assert set(np.unique(trained[:, 0]).tolist()) <= agent_episode_seeds(cfg.seed, 1)
    assert summary["ga3c"]["abandoned_steps"] >= 0  # the agent stopped at the end: its unfinished segment
    assert not children(), f"child processes left: {children()}"


def test_a_killed_agent_stops_the_run_with_one_line_when_restarts_are_off(tmp_path, monkeypatch):
    rec = BatchRecorder(monkeypatch)
    cfg = tagged_cfg(tmp_path, agents=2, max_restarts=0, total_steps=10**6)
    killer = kill_child(AGENT, when=lambda: len(rec.batches) >= 3)
    started = time.monotonic()
    with pytest.raises(WorkerFailure) as failure:
        conveyor.train(cfg)
    killer.join(timeout=1.0)
    message = str(failure.value)
    assert "\n" not in message
    assert f"pid {killer.killed})" in message and "GA3C agent " in message
    assert "SIGKILL" in message and "max_restarts=0" in message and "--max-restarts" in message
    assert time.monotonic() - started < 20  # noticed within seconds, not at the end of a long run
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt")), "no checkpoint before stopping"
    assert not children(), f"child processes left: {children()}"


# ---- the protocols, death by death -------------------------------------------------------------

def make_channels(num_ids: int = 2, num_segments: int = 4) -> Channels:
    return Channels(segment_schema((3,)), num_ids, num_segments, T)


def link_for(channels: Channels, agent: int) -> AgentLink:
    """An agent endpoint in this process (the test plays the agent, and its death)."""
    reply_read, reply_write = os.pipe()
    channels.close_reply(agent)
    channels.reply_fds[agent] = reply_write
    spec = {**channels.agent_spec(agent, reply_read), "parent_pid": os.getppid()}
    spec["shm_fd"] = os.dup(channels.shared.fd)
    return AgentLink(spec)


def free_slots(channels: Channels) -> list[int]:
    """Take every free slot (the caller puts them back if it needs to)."""
    return sorted(channels.free_segments.get(10**4, 0.01).tolist())


def test_a_slot_is_reclaimed_exactly_when_its_dead_agent_had_not_pushed_it():
    channels = make_channels()
    links: list[AgentLink] = []
    try:
        # Died right after claiming (the slot index is in shared memory, its generation not yet noted).
        link = link_for(channels, 0)
        links.append(link)
        assert os.readv(channels.free_segments.read_fd, [channels["holding"][0:1]]) == 4
        claimed = int(channels["holding"][0])
        assert channels.detach(0) == 0
        assert free_slots(channels) == [0, 1, 2, 3]
        channels.release_segments([0, 1, 2, 3])

        # Died with three steps of its segment written: they are dropped, the slot is free again.
        link = link_for(channels, 0)
        links.append(link)
        slot = link.acquire_segment()
        channels["seg_steps"][slot] = 3
        assert channels.detach(0) == 3
        assert free_slots(channels) == [0, 1, 2, 3]
        channels.release_segments([0, 1, 2, 3])

        # Died after pushing, before clearing its record: the segment is complete and stays queued.
        link = link_for(channels, 0)
        links.append(link)
        slot = link.acquire_segment()
        channels["seg_steps"][slot] = T
        link.full_segments.put(slot)
        assert channels.detach(0) == 0
        assert channels.take_segments(1, lambda: False).tolist() == [slot]
        assert sorted(free_slots(channels) + [slot]) == [0, 1, 2, 3]
        channels.release_segments([s for s in range(4) if s != slot])

        # Died the same way, but the learner trained on the segment and another agent claimed the slot
        # before the death was noticed: the slot is the other agent's, not reclaimed twice.
        free = free_slots(channels)  # the other three, set aside: ``slot`` is with the learner
        channels.release_segments([slot])  # now the only free slot
        link = link_for(channels, 0)
        links.append(link)
        assert link.acquire_segment() == slot
        link.full_segments.put(slot)
        taken = channels.take_segments(1, lambda: False)
        channels.release_segments(taken)
        other = link_for(channels, 1)
        links.append(other)
        assert other.acquire_segment() == slot
        assert channels.detach(0) == 0
        assert free_slots(channels) == []  # not handed out twice
        assert channels.detach(1) == 0  # the other agent exits in turn: now it comes back
        assert sorted(free_slots(channels) + free) == [0, 1, 2, 3]
        assert channels.queued_segments() == 0 and claimed in range(4)
    finally:
        for link in links:
            link.close()
        for agent in range(2):
            channels.close_reply(agent)
        channels.close()


def post(link: AgentLink, obs: float) -> int:
    """The first half of ``AgentLink.predict``: the request is queued, nobody waits for the answer."""
    a = link.agent
    link["obs"][a] = obs
    link.seq += 1
    link["request_seq"][a] = link.seq
    link.requests.put(a)
    return link.seq


def test_a_dead_agents_request_is_never_answered_into_its_successors_slot():
    channels = make_channels(num_ids=1)
    links: list[AgentLink] = []

    def answer(ids, seqs, obs):
        channels.answer(ids, (obs * 10).astype(np.int64), obs, obs, 0, seqs)

    try:
        # A request left in the queue by a dead agent, then its successor's: one answer, to the successor.
        first = link_for(channels, 0)
        links.append(first)
        post(first, 1.0)
        channels.detach(0)
        second = link_for(channels, 0)
        links.append(second)
        seq = post(second, 2.0)
        ids, seqs = channels.take_numbered(1, 0.1)  # the leftover entry: it stands for the newest request
        assert ids.tolist() == [0] and seqs.tolist() == [seq]
        answer(ids, seqs, channels["obs"][ids][:, 0])
        assert len(channels.take_numbered(1, 0.05)[0]) == 0  # the successor's own entry: already answered
        assert int(channels["reply_seq"][0]) == seq and int(channels["action"][0]) == 20

        # A request taken before its agent died, answered after the successor's: the late answer is dropped.
        post(second, 3.0)
        late_ids, late_seqs = channels.take_numbered(8, 0.1)
        late_obs = channels["obs"][late_ids][:, 0]
        channels.detach(0)
        third = link_for(channels, 0)
        links.append(third)
        seq = post(third, 4.0)
        ids, seqs = channels.take_numbered(8, 0.1)
        answer(ids, seqs, channels["obs"][ids][:, 0])
        answer(late_ids, late_seqs, late_obs)  # for observation 3.0: must not land
        assert int(channels["reply_seq"][0]) == seq and int(channels["action"][0]) == 40
    finally:
        for link in links:
            link.close()
        channels.close_reply(0)
        channels.close()


# ---- real agent processes, killed again and again ----------------------------------------------

def test_repeatedly_killed_agents_leak_no_slot_and_every_step_is_accounted_for(tmp_path):
    """3 kills of 2 agents with just enough slots: a leaked slot would stall the agents; at the end every
    slot is free and every step is trained, still queued, dropped by a restart or abandoned at the stop."""
    agents, batch, kills = 2, 2, 3
    num_segments = batch + agents  # tight: the agents hold one each, the trainer gathers the rest
    cfg = tagged_cfg(tmp_path, agents=agents)
    channels = Channels(segment_schema((3,)), agents, num_segments, T)
    restarts: list[int] = []
    pool = AgentPool(channels, cfg.to_dict(), cfg.seed, max_restarts=kills, on_restart=restarts.append)
    rng = np.random.default_rng(0)
    trained: list[np.ndarray] = []

    def predictor(stop: threading.Event, serial: int) -> None:
        actions = np.random.default_rng(serial)
        while not stop.is_set():
            ids, seqs = channels.take_numbered(8, 0.05)
            if len(ids):
                channels.answer(ids, actions.integers(0, 2, len(ids)), np.zeros(len(ids)), np.zeros(len(ids)), 0,
                                seqs)
                # At most a few hundred steps a second: few enough episodes that no two 32-bit seeds collide.
                time.sleep(0.005)

    def trainer(stop: threading.Event, serial: int) -> None:
        while (slots := channels.take_segments(batch, stop.is_set)) is not None:
            trained.append(tags(channels.segments(slots)["obs"][:T]))
            channels.release_segments(slots)

    run = type("NoRun", (), {"request_stop": staticmethod(lambda reason: None)})()
    predictors, trainers = ThreadGroup("test-predictor", predictor, run), ThreadGroup("test-trainer", trainer, run)
    try:
        predictors.resize(1)
        trainers.resize(1)
        pool.resize(agents)
        for kill in range(kills + 1):
            steps, agent_steps = sum(len(t) for t in trained), channels["steps"].copy()
            deadline = time.monotonic() + (30 if kill else 60)  # agents start slowly on a busy machine
            # Every agent (the restarted one too) steps, and training goes on: no slot leaked.
            while sum(len(t) for t in trained) < steps + 60 or (channels["steps"] <= agent_steps).any():
                assert time.monotonic() < deadline, (
                    f"no progress after {kill} kills: steps {channels['steps'].tolist()}, holding "
                    f"{channels['holding'].tolist()}, {len(channels.free_segments)} free, "
                    f"{channels.queued_segments()} queued, {sum(len(t) for t in trained)} trained")
                pool.check()
                time.sleep(0.02)
            if kill < kills:
                time.sleep(float(rng.uniform(0, 0.03)))  # somewhere in a segment, or between two
                victim = list(pool.processes.values())[int(rng.integers(agents))]
                victim.kill()
                victim.wait()
                pool.check()
                assert pool.restart_budget.restarts == kill + 1 and len(pool) == agents
        assert pool.restart_budget.restarts == kills and len(restarts) == kills
        victim = list(pool.processes.values())[0]
        victim.kill()
        victim.wait()
        with pytest.raises(WorkerFailure, match=f"GA3C agent \\d \\(pid {victim.pid}\\) died \\(killed by signal "
                                                f"SIGKILL\\); the run's {kills} restarts reach max_restarts={kills}"):
            pool.check()
        pool.close()
        trainers.close()
        predictors.close()
        assert trainers.error is None and predictors.error is None

        queued = channels.take_queued()
        free = channels.free_segments.get(10**4, 0.01)
        assert sorted([*queued.tolist(), *free.tolist()]) == list(range(num_segments)), "a slot leaked"
        assert (channels["holding"] == -1).all()
        transitions = np.concatenate(trained)
        check_transitions(transitions)
        started = {episode_seed(cfg.seed, a, e) for a in range(agents) for e in range(channels["episodes"][a])}
        assert set(np.unique(transitions[:, 0]).tolist()) <= started
        accounted = len(transitions) + len(queued) * T + sum(restarts) + pool.abandoned_steps
        # A kill between counting a step and marking it written leaves it counted once, in neither place.
        assert 0 <= int(channels["steps"].sum()) - accounted <= kills + 1
    finally:
        pool.close()
        trainers.close()
        predictors.close()
        channels.close()
    assert not children(), f"child processes left: {children()}"
