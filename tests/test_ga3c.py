"""GA3C: the queues and agent protocol, resizing at run time, the autotune controller, learning."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import gymnasium as gym
import numpy as np
import pytest
import torch

from conveyor.architectures.ga3c.threads import ThreadGroup
from conveyor.architectures.ga3c.autotune import Autotuner, Counts, plot_history
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.architectures.ga3c.agents import AgentLink, AgentPool
from conveyor.architectures.ga3c.queues import SEGMENT_FIELDS, Channels, IndexPipe
from conveyor.storage.schema import FieldSpec, RolloutSchema
from tests.fault_env import alive, gone_within

torch.set_num_threads(1)
NO_RUN = types.SimpleNamespace(request_stop=lambda reason: None)


def segment_schema(obs_shape: tuple[int, ...], obs_dtype: torch.dtype = torch.float32) -> RolloutSchema:
    """GA3C segments of observations ``obs_shape`` and discrete actions."""
    return RolloutSchema(FieldSpec(obs_shape, obs_dtype), FieldSpec((), torch.int64), SEGMENT_FIELDS)


def make_channels(num_ids: int, num_segments: int, unroll: int = 3, obs_shape=(2,)) -> Channels:
    return Channels(segment_schema(obs_shape, torch.float64), num_ids, num_segments, unroll)


def in_process_link(channels: Channels, agent: int) -> AgentLink:
    """An agent endpoint in this process (threads stand in for agent processes)."""
    reply_read, reply_write = os.pipe()
    channels.reply_fds[agent] = reply_write
    # In this process the "parent" is our own parent; the link closes its own copy of the memory fd.
    spec = {**channels.agent_spec(agent, reply_read), "parent_pid": os.getppid()}
    spec["shm_fd"] = os.dup(channels.shared.fd)
    return AgentLink(spec)


# ---- index pipes ---------------------------------------------------------------------------------

def test_index_pipe_moves_whole_indices_in_order():
    pipe = IndexPipe()
    try:
        assert len(pipe.get(5, timeout_s=0.01)) == 0
        pipe.put(np.arange(3000))  # more than one atomic write
        assert len(pipe) == 3000
        taken = [pipe.get(700, timeout_s=0.1) for _ in range(5)]
        assert [len(t) for t in taken] == [700, 700, 700, 700, 200]
        assert np.concatenate(taken).tolist() == list(range(3000))
    finally:
        pipe.close()


# ---- prediction queue ----------------------------------------------------------------------------

def test_every_agent_request_gets_exactly_its_own_answer():
    """48 agents x 150 requests through 3 predictors batching whatever waits: no answer crosses over."""
    num_agents, requests = 48, 150
    channels = make_channels(num_agents, 4)
    links = [in_process_link(channels, a) for a in range(num_agents)]
    stop = threading.Event()
    batch_sizes: list[int] = []

    def predictor() -> None:
        while not stop.is_set():
            ids, seqs = channels.take_numbered(16, 0.05)
            if len(ids):
                obs = channels["obs"][ids]
                batch_sizes.append(len(ids))
                # The answer is a function of the request: agent * 10^6 + sequence number.
                channels.answer(ids, (obs[:, 0] * 1e6 + obs[:, 1]).astype(np.int64), obs[:, 1], obs[:, 0], 7, seqs)

    failures: list[str] = []

    def agent(link: AgentLink) -> None:
        for seq in range(requests):
            reply = link.predict(np.array([link.agent, seq], np.float64))
            if reply is None or int(reply.action) != link.agent * 1_000_000 + seq or reply.logp != seq:
                failures.append(f"agent {link.agent} request {seq} got {reply}")
                return

    predictors = [threading.Thread(target=predictor) for _ in range(3)]
    agents = [threading.Thread(target=agent, args=(link,)) for link in links]
    for thread in predictors + agents:
        thread.start()
    for thread in agents:
        thread.join(60)
    stop.set()
    for thread in predictors:
        thread.join(5)
    try:
        assert not failures, failures[:3]
        assert sum(batch_sizes) == num_agents * requests
        assert max(batch_sizes) <= 16
        assert (channels["wait_time_s"] > 0).all()
    finally:
        for link in links:
            link.close()
        for agent in range(num_agents):
            channels.close_reply(agent)
        channels.close()


# ---- training queue ------------------------------------------------------------------------------

def test_training_queue_loses_nothing_and_consumes_nothing_twice_while_trainers_change():
    num_agents, per_agent, batch = 8, 40, 3
    channels = make_channels(num_agents, batch + 2 * num_agents)
    links = [in_process_link(channels, a) for a in range(num_agents)]
    consumed: list[tuple[int, int]] = []
    consumed_lock = threading.Lock()

    def agent(link: AgentLink) -> None:
        for _ in range(per_agent):
            slot = link.acquire_segment()
            link["seg_env_rewards"][slot] = link.segments_pushed  # payload travels with the index
            link.push_segment(slot)

    def trainer(stop: threading.Event, serial: int) -> None:
        while True:
            slots = channels.take_segments(batch, stop.is_set)
            if slots is None:
                return
            seg = channels.segments(slots)
            numbers = channels["seg_number"][slots].copy()
            assert (seg["env_rewards"][0] == numbers).all()
            with consumed_lock:
                consumed.extend(zip(channels["seg_agent"][slots].tolist(), numbers.tolist()))
            channels.release_segments(slots)
            time.sleep(0.002)

    trainers = ThreadGroup("test-trainer", trainer, NO_RUN)
    agents = [threading.Thread(target=agent, args=(link,)) for link in links]
    try:
        trainers.resize(1)
        for thread in agents:
            thread.start()
        for count in (3, 1, 4, 2, 1):
            time.sleep(0.05)
            trainers.resize(count)
        for thread in agents:
            thread.join(60)
        while len(consumed) < num_agents * per_agent - batch and trainers.error is None:
            time.sleep(0.01)
        trainers.close()
        assert trainers.error is None
        assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("test-trainer"))
        leftover = channels.full_segments.get(10**4, 0.01)
        consumed += list(zip(channels["seg_agent"][leftover].tolist(), channels["seg_number"][leftover].tolist()))
        produced = [(a, n) for a in range(num_agents) for n in range(per_agent)]
        assert sorted(consumed) == produced  # every segment exactly once
        channels.release_segments(leftover)
        assert len(channels.free_segments) == channels.num_segments
    finally:
        for link in links:
            link.close()
        for agent in range(num_agents):
            channels.close_reply(agent)
        channels.close()


# ---- agent loop ----------------------------------------------------------------------------------

class CountingEnv(gym.Env):
    """Observation: steps taken in this episode; reward 1 per step; cut by a TimeLimit."""

    observation_space = gym.spaces.Box(0, 100, (2,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.zeros(2), {}

    def step(self, action):
        self.t += 1
        return np.array([self.t, action], np.float64), 1.0, False, False, {}


def test_agent_writes_time_major_segments_and_the_last_observation_of_a_cut_episode():
    from conveyor.envs.make import EPISODE_KEY
    from conveyor.architectures.ga3c.agents import run_agent

    env = gym.wrappers.RecordEpisodeStatistics(gym.wrappers.TimeLimit(CountingEnv(), 3), stats_key=EPISODE_KEY)
    channels = make_channels(1, 4, unroll=4)
    link = in_process_link(channels, 0)
    stop = threading.Event()

    def predictor() -> None:  # version = requests answered so far; action = its parity
        answered = 0
        while not stop.is_set():
            ids, seqs = channels.take_numbered(4, 0.05)
            if len(ids):
                channels.answer(ids, np.full(len(ids), answered % 2), np.full(len(ids), -0.5), np.zeros(len(ids)),
                                answered, seqs)
                answered += len(ids)

    answering = threading.Thread(target=predictor)
    answering.start()
    agent = threading.Thread(target=run_agent, args=(env, "Counting", link, 4))
    agent.start()
    try:
        slots = channels.take_segments(2, lambda: False)
        channels["stop"][0] = True
        agent.join(10)
        assert not agent.is_alive()
        seg = channels.segments(slots)
        assert seg["obs"].shape == (5, 2, 2)  # [T + 1, B, obs]
        assert seg["obs"][:, 0, 0].tolist() == [0, 1, 2, 0, 1]  # reset after the cut at t = 2
        assert seg["obs"][:, 1, 0].tolist() == [1, 2, 0, 1, 2]  # the next segment starts where this one ended
        assert seg["truncated"][:, 0].tolist() == [False, False, True, False]
        assert not seg["terminated"].any()
        assert seg["final_obs"][2, 0, 0] == 3  # the last observation of the cut episode, for the bootstrap
        assert seg["actions"][:, 0].tolist() == [0, 1, 0, 1] and seg["policy_version"][:, 0].tolist() == [0, 1, 2, 3]
        assert (seg["behaviour_logp"] == -0.5).all() and (seg["env_rewards"] == 1).all()
        # V(s_T) is not known at acting time: the bootstrap entry keeps the marker.
        assert seg["behaviour_value"].shape == (5, 2) and np.isnan(seg["behaviour_value"][4]).all()
        returns = seg["episode_return"][:, 0]
        assert returns[2] == 3 and np.isnan(returns[[0, 1, 3]]).all()
        assert channels["steps"][0] >= 8
    finally:
        stop.set()
        answering.join(5)
        link.close()
        channels.close_reply(0)
        channels.close()


# ---- agent processes -----------------------------------------------------------------------------

def cartpole_cfg(**arch) -> RunCfg:
    return RunCfg(env=EnvCfg(id="CartPole-v1"), algo=AlgoCfg(name="ga3c"),
                  arch=ArchCfg(name="ga3c", unroll=4, **arch), torch_threads=1, progress=False)


def test_agent_processes_resize_at_run_time_without_deadlock_or_leaks():
    cfg = cartpole_cfg()
    batch, max_agents = 2, 6
    channels = Channels(segment_schema((4,)), max_agents, batch + 2 * max_agents, 4)
    pool = AgentPool(channels, cfg.to_dict(), base_seed=0)
    rng = np.random.default_rng(0)

    def predictor(stop: threading.Event, serial: int) -> None:
        while not stop.is_set():
            ids, seqs = channels.take_numbered(8, 0.05)
            if len(ids):
                channels.answer(ids, rng.integers(0, 2, len(ids)), np.zeros(len(ids)), np.zeros(len(ids)), 0, seqs)

    def trainer(stop: threading.Event, serial: int) -> None:
        while (slots := channels.take_segments(batch, stop.is_set)) is not None:
            channels.release_segments(slots)

    predictors = ThreadGroup("test-predictor", predictor, NO_RUN)
    trainers = ThreadGroup("test-trainer", trainer, NO_RUN)
    seen_pids: set[int] = set()
    try:
        predictors.resize(2)
        trainers.resize(1)
        for agents, threads in ((2, 1), (5, 3), (1, 1), (3, 2)):
            pool.resize(agents)
            predictors.resize(threads)
            trainers.resize(threads)
            seen_pids.update(pool.pids())
            steps = int(channels["steps"].sum())
            deadline = time.monotonic() + 60
            while int(channels["steps"].sum()) < steps + 200:  # the agents make progress
                assert time.monotonic() < deadline, "no progress after resizing"
                pool.check()
                time.sleep(0.05)
            assert len(pool) == agents
        os.kill(next(iter(pool.processes.values())).pid, signal.SIGINT)  # agents leave SIGINT to the parent
        time.sleep(0.3)
        pool.check()
        # Agents asked to stop leave cleanly: their ids come back for reuse.
        deadline = time.monotonic() + 30
        while pool.stopping:
            assert time.monotonic() < deadline
            pool.check()
            time.sleep(0.05)
        assert len(pool.free_ids) == max_agents - 3
        victim = next(iter(pool.processes.values()))
        victim.kill()
        victim.wait()
        with pytest.raises(RuntimeError, match=f"pid {victim.pid}"):
            pool.check()  # an agent that dies on its own stops the run
    finally:
        pool.close()
        predictors.close()
        trainers.close()
        channels.close()
    assert not any(alive(pid) for pid in seen_pids)
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("test-"))


@pytest.mark.slow  # 4-6 s; make test keeps the same die-with-parent path for HTS's executors
def test_agents_exit_when_the_parent_is_killed(tmp_path):
    script = textwrap.dedent("""
        import json, sys, time
        import numpy as np
        from conveyor.config import RunCfg
        from conveyor.architectures.ga3c.agents import AgentPool
        import torch
        from conveyor.architectures.ga3c.queues import SEGMENT_FIELDS, Channels
        from conveyor.storage.schema import FieldSpec, RolloutSchema
        schema = RolloutSchema(FieldSpec((4,), torch.float32), FieldSpec((), torch.int64), SEGMENT_FIELDS)
        channels = Channels(schema, 2, 6, 4)
        pool = AgentPool(channels, RunCfg.from_dict(json.loads(sys.argv[1])).to_dict(), 0)
        pool.resize(2)
        print(json.dumps(pool.pids()), flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script, json.dumps(cartpole_cfg().to_dict())],
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(parent.stdout.readline())
        time.sleep(1.0)  # let the agents get to waiting for predictions nobody will answer
        parent.kill()
        parent.wait()
        assert gone_within(pids, 20), "agents outlived their parent"
    finally:
        parent.kill()
        parent.wait()


# ---- autotune ------------------------------------------------------------------------------------

def test_autotune_keeps_an_improving_change_and_reverts_a_worsening_one():
    start = Counts(3, 2, 2)
    tuner = Autotuner(start, Counts(1, 1, 1), Counts(8, 4, 4), random.Random(0))
    first = tuner.step(100.0)
    assert (first.verdict, first.measured) == ("baseline", start)
    trial = first.next
    assert trial != start and sum(abs(getattr(trial, k) - getattr(start, k)) for k in ("agents", "predictors",
                                                                                       "trainers")) == 1
    kept = tuner.step(120.0)  # TPS rose: keep
    assert (kept.verdict, kept.measured, tuner.accepted) == ("keep", trial, trial)
    worse = tuner.step(90.0)  # the next trial lowered TPS: revert to the kept setting
    assert (worse.verdict, worse.measured, worse.next) == ("revert", kept.next, trial)
    again = tuner.step(118.0)  # the restored setting is measured again as the new baseline
    assert (again.verdict, again.measured, tuner.baseline) == ("baseline", trial, 118.0)


def test_autotune_climbs_to_the_best_counts_of_an_injected_tps_signal():
    best = Counts(6, 2, 3)

    def tps(c: Counts) -> float:
        return 100 - 3 * abs(c.agents - best.agents) - 5 * abs(c.predictors - best.predictors) \
            - 4 * abs(c.trainers - best.trainers)

    low, high = Counts(1, 1, 1), Counts(10, 4, 4)
    tuner = Autotuner(Counts(1, 1, 1), low, high, random.Random(3))
    counts, rows = Counts(1, 1, 1), []
    for step in range(120):
        decision = tuner.step(tps(counts))
        rows.append(decision.row(float(step)))
        counts = decision.next
        assert counts.within(low, high)
    assert tuner.accepted == best


def test_autotune_plot_is_written(tmp_path):
    rows = [Autotuner(Counts(1, 1, 1), Counts(1, 1, 1), Counts(2, 2, 2), random.Random(0)).step(1.0).row(0.0)]
    plot_history(rows * 2, tmp_path / "autotune.png")
    assert (tmp_path / "autotune.png").read_bytes()[:4] == b"\x89PNG"


# ---- end to end ----------------------------------------------------------------------------------

@pytest.mark.slow  # make test keeps tests/test_learns_by_default.py: this architecture on CartPole, default flags
def test_ga3c_reaches_the_cartpole_threshold(tmp_path):
    """Mean last-100 return >= 195 (about 55k steps, 20 s on 2 cores); the summary is honest about lag."""
    import conveyor

    cfg = RunCfg(env=EnvCfg(id="CartPole-v1"), algo=AlgoCfg(name="ga3c", lr=0.003),
                 arch=ArchCfg(name="ga3c", num_agents=8, min_train_batch=8), total_steps=250_000,
                 target_return=195.0, out=str(tmp_path / "run"), progress=False, torch_threads=1, seed=1)
    summary = conveyor.train(cfg)
    assert summary["stop_reason"] == "target_return reached", summary["return_mean_last100"]
    assert summary["return_mean_last100"] >= 195
    lag = summary["policy_lag"]
    assert sum(lag["histogram"].values()) == summary["env_steps"]  # every trained step's lag is counted
    assert lag["max"] >= 1  # trainers update while agents act: lag > 0 shows up
    ga3c = summary["ga3c"]
    for key in ("tps", "pps", "fps", "predict_batch_mean", "prediction_queue_mean", "training_queue_mean",
                "agent_wait_ms_mean"):
        assert ga3c[key] >= 0, key
    assert ga3c["tps"] > 0 and ga3c["pps"] > 0 and ga3c["predict_batch_mean"] >= 1
    assert ga3c["final_counts"] == {"agents": 8, "predictors": 1, "trainers": 1}
    assert all(summary["time_split"][bucket] > 0 for bucket in ("env", "act", "learn", "wait"))
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["ga3c"]["tps"] == ga3c["tps"]


@pytest.mark.slow
def test_ga3c_autotune_run_changes_counts_and_plots(tmp_path):
    import conveyor

    cfg = RunCfg(env=EnvCfg(id="CartPole-v1"), model=ModelCfg(hidden=(16,)), algo=AlgoCfg(name="ga3c"),
                 arch=ArchCfg(name="ga3c", num_agents=2, min_train_batch=4, autotune=True, autotune_interval=0.2),
                 total_steps=4000, out=str(tmp_path / "run"), progress=False, torch_threads=1)
    summary = conveyor.train(cfg)
    history = summary["ga3c"]["autotune"]
    assert history and history[0]["verdict"] == "baseline"
    assert {row["verdict"] for row in history} <= {"baseline", "keep", "revert"}
    for row in history:
        assert 1 <= row["agents"] <= 8 and 1 <= row["predictors"] <= 8 and 1 <= row["trainers"] <= 8
    assert (tmp_path / "run" / "autotune.png").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("ga3c-") and t.is_alive()]


@pytest.mark.slow
def test_ga3c_pong_smoke_with_nature_cnn(tmp_path):
    import conveyor

    cfg = RunCfg(env=EnvCfg(id="ALE/Pong-v5"), model=ModelCfg(name="nature_cnn"), algo=AlgoCfg(name="ga3c"),
                 arch=ArchCfg(name="ga3c", num_agents=4, min_train_batch=4), total_steps=2000,
                 out=str(tmp_path / "run"), progress=False, torch_threads=1)
    summary = conveyor.train(cfg)
    assert summary["env_steps"] >= 2000 and summary["updates"] >= 1
    assert summary["ga3c"]["fps"] > 0
    assert sum(summary["policy_lag"]["histogram"].values()) == summary["env_steps"]
