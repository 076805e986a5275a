"""make_vector_env: exactly-once ordered steps, auto-reset, seeds, failures, shutdown; the shm and inproc
backends step the same envs to the same results; auto's choice; envpool."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from conveyor.config import ConfigError, EnvCfg
from conveyor.errors import WorkerFailure
from conveyor.envs import STEP_TIME_ID, ObsShapeError, episode_seed, make_env, make_vector_env
from tests.fault_env import HANGING_ID, children

# Workers import this module by name to find the counting env (gymnasium's "module:id" form).
COUNTING_ID = "tests.test_vector:CountingTest-v0"
NO_ERROR = -1


class CountingEnv(gym.Env):
    """Observation ``[episode seed, episode, t, last action]``: every step says where it came from.

    The env's first seed (``seed + i`` for vector env i, from ``make_env``) is its home; later seeded resets
    (the vector env seeds every episode: ``episode_seed``) change only the first column. ``episode`` counts
    resets, the construction's included. Episodes last ``3 + home % 4`` steps; they end terminated for even
    homes and truncated for odd ones. The reward is the action, so the return is the
    sum of the episode's actions. For failure tests, env ``fail_seed`` raises
    on its ``fail_every``-th steps, and env ``reshape_seed`` returns a longer
    observation at step ``reshape_at``.
    """

    def __init__(self, fail_seed: int = NO_ERROR, fail_every: int = 0, reshape_seed: int = NO_ERROR,
                 reshape_at: int = 0) -> None:
        self.observation_space = gym.spaces.Box(-(2**31), 2**31, (4,), np.int64)
        self.action_space = gym.spaces.Discrete(1000)
        self.fail_seed, self.fail_every = fail_seed, fail_every
        self.reshape_seed, self.reshape_at = reshape_seed, reshape_at
        self.identity = self.home = NO_ERROR
        self.episode = -1
        self.t = 0
        self.total_steps = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self.identity = seed
            self.home = seed if self.home == NO_ERROR else self.home
        self.episode += 1
        self.t = 0
        return np.array([self.identity, self.episode, 0, -1]), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.total_steps += 1
        if self.home == self.fail_seed and self.total_steps % self.fail_every == 0:
            raise RuntimeError("counting env failure on purpose")
        self.t += 1
        obs = np.array([self.identity, self.episode, self.t, action])
        if self.home == self.reshape_seed and self.total_steps == self.reshape_at:
            obs = np.zeros(5, np.int64)
        ended = self.t == episode_length(self.home)
        return obs, float(action), ended and self.home % 2 == 0, ended and self.home % 2 == 1, {}


def episode_length(home: int) -> int:
    return 3 + home % 4


gym.register("CountingTest-v0", entry_point=CountingEnv)


def counting_cfg(num_envs: int = 6, num_workers: int = 2, backend: str = "shm", **env_args: Any) -> EnvCfg:
    return EnvCfg(id=COUNTING_ID, num_envs=num_envs, num_workers=num_workers, env_args=tuple(env_args.items()),
                  backend=backend)


# What both of conveyor's own backends must do alike (worker processes are shm's alone: see the tests below).
OWN_BACKENDS = pytest.mark.parametrize("backend", ["shm", "inproc"])


@OWN_BACKENDS
def test_every_step_of_every_env_arrives_exactly_once_in_order(backend):
    seed, batch = 100, 6
    home = seed + np.arange(batch)
    rng = np.random.default_rng(0)

    def seeds(episode: np.ndarray) -> np.ndarray:  # the vector env's episode k is the env's episode k + 1
        return np.array([episode_seed(seed, i, k - 1) for i, k in enumerate(episode)])

    with make_vector_env(counting_cfg(batch, 3, backend), seed) as venv:
        assert (venv.num_envs, venv.single_action_space, venv.single_observation_space.shape) == (
            batch, gym.spaces.Discrete(1000), (4,))
        obs = venv.reset()
        # Episode 0 was make_env's seeding reset; the vector env's reset starts episode 1.
        np.testing.assert_array_equal(obs, np.stack([seeds(np.ones(batch, int)), np.ones(batch), np.zeros(batch),
                                                     -np.ones(batch)], 1))
        episode, t, returns = np.ones(batch, int), np.zeros(batch, int), np.zeros(batch)
        for step in range(60):
            actions = rng.integers(0, 1000, batch)
            if step % 2:
                result = venv.step(actions)
            else:
                venv.step_async(actions)
                result = venv.step_wait()
            t += 1
            returns += actions
            ended = t == episode_length(home)
            np.testing.assert_array_equal(result.terminated, ended & (home % 2 == 0))
            np.testing.assert_array_equal(result.truncated, ended & (home % 2 == 1))
            np.testing.assert_array_equal(result.reward, actions.astype(np.float32))
            np.testing.assert_array_equal(result.final_obs[ended],
                                          np.stack([seeds(episode), episode, t, actions], 1)[ended])
            np.testing.assert_array_equal(result.episode_return[ended], returns[ended])
            assert np.isnan(result.episode_return[~ended]).all()
            np.testing.assert_array_equal(result.episode_length, np.where(ended, t, 0))
            episode += ended
            t[ended] = 0
            returns[ended] = 0
            expected_obs = np.stack([seeds(episode), episode, t, np.where(ended, -1, actions)], 1)
            np.testing.assert_array_equal(result.obs, expected_obs)
        assert episode.min() > 60 // 6


@OWN_BACKENDS
def test_env_i_is_make_env_with_seed_plus_i_and_episode_k_starts_from_episode_seed(backend):
    cfg = EnvCfg(id="CartPole-v1", num_envs=4, num_workers=2, backend=backend)
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 2, (30, cfg.num_envs))

    def vector_rollout(seed: int) -> np.ndarray:
        with make_vector_env(cfg, seed) as venv:
            return np.stack([venv.reset()] + [venv.step(a).obs for a in actions])

    rollout = vector_rollout(7)
    np.testing.assert_array_equal(rollout, vector_rollout(7))
    assert not np.array_equal(rollout, vector_rollout(8))
    for i in range(cfg.num_envs):
        env = make_env(cfg, 7 + i)
        episode = 0
        single = [env.reset(seed=episode_seed(7, i, episode))[0]]
        for a in actions[:, i]:
            obs, _, terminated, truncated, _ = env.step(a)
            if terminated or truncated:
                episode += 1
                obs = env.reset(seed=episode_seed(7, i, episode))[0]
            single.append(obs)
        np.testing.assert_array_equal(rollout[:, i], np.stack(single))


@OWN_BACKENDS
def test_copy_false_returns_reused_views(backend):
    with make_vector_env(counting_cfg(2, 1, backend), 0, copy=False) as venv:
        venv.reset()
        first = venv.step(np.zeros(2, int))
        second = venv.step(np.ones(2, int))
        assert first.obs is second.obs
        np.testing.assert_array_equal(first.obs[:, 3], [1, 1])


@OWN_BACKENDS
def test_wrong_action_shape_is_refused(backend):
    with make_vector_env(counting_cfg(2, 1, backend), 0) as venv:
        venv.reset()
        with pytest.raises(ValueError, match="shape"):
            venv.step(np.zeros(3, int))


def test_close_leaves_no_processes_and_no_shared_memory_segments():
    segments_before = set(os.listdir("/dev/shm"))
    children_before = set(children())
    venv = make_vector_env(counting_cfg(4, 2), 0)
    pids = venv.worker_pids
    assert len(pids) == 2 and set(pids) <= set(children())
    venv.reset()
    venv.step(np.zeros(4, int))
    venv.close()
    venv.close()
    assert set(children()) <= children_before
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert set(os.listdir("/dev/shm")) <= segments_before
    with pytest.raises(RuntimeError, match="closed"):
        venv.step(np.zeros(4, int))


def test_dead_worker_is_named_within_seconds():
    venv = make_vector_env(counting_cfg(4, 2), 0)
    venv.reset()
    pids = venv.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"env worker 1 \(pid \d+, envs 2-3\).*SIGKILL"):
        venv.step(np.zeros(4, int))
    assert time.monotonic() - start < 3.0
    with pytest.raises(RuntimeError, match="env worker 1"):
        venv.step(np.zeros(4, int))
    venv.close()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


@OWN_BACKENDS
def test_env_that_raises_is_reset_truncated_and_counted(backend):
    seed = 10
    cfg = dataclasses.replace(counting_cfg(4, 2, backend, fail_seed=seed + 3, fail_every=2), max_env_errors=2)
    with make_vector_env(cfg, seed) as venv:
        venv.reset()
        before = venv.step(np.full(4, 5))
        result = venv.step(np.full(4, 6))  # env 3's second step raises
        assert venv.env_errors == 1
        assert result.truncated[3] and not result.terminated[3] and np.isnan(result.episode_return[3])
        np.testing.assert_array_equal(result.final_obs[3], before.obs[3])
        np.testing.assert_array_equal(result.obs[3], [episode_seed(seed, 3, 1), 2, 0, -1])  # a fresh episode
        np.testing.assert_array_equal(result.obs[:3, 2], [2, 2, 2])  # the others went on
        venv.step(np.zeros(4, int))
        venv.step(np.zeros(4, int))
        assert venv.env_errors == 2
        venv.step(np.zeros(4, int))
        with pytest.raises(RuntimeError, match=r"3 env errors exceed max_env_errors=2.*on purpose"):
            venv.step(np.zeros(4, int))


@OWN_BACKENDS
def test_observation_shape_change_is_an_error(backend):
    with make_vector_env(counting_cfg(4, 2, backend, reshape_seed=1, reshape_at=2), 0) as venv:
        venv.reset()
        venv.step(np.zeros(4, int))
        with pytest.raises(ObsShapeError, match=r"env 1 .*shape \(5,\), expected \(4,\)"):
            venv.step(np.zeros(4, int))


def test_unknown_id_fails_before_starting_workers():
    children_before = set(children())
    with pytest.raises(ConfigError, match="Nope-v0"):
        make_vector_env(EnvCfg(id="Nope-v0", num_envs=2, num_workers=1), 0)
    assert set(children()) <= children_before


@pytest.mark.parametrize("backend", ["shm", "envpool"])
def test_pong_backends_share_shapes_and_auto_reset_semantics(backend):
    if backend == "envpool":
        pytest.importorskip("envpool")
    # A 200-frame limit truncates every episode after about 50 agent steps.
    cfg = EnvCfg(id="ALE/Pong-v5", num_envs=4, num_workers=2, backend=backend,
                 env_args=(("max_num_frames_per_episode", 200),))
    with make_vector_env(cfg, 0) as venv:
        assert venv.single_observation_space.shape == (4, 84, 84)
        assert venv.single_action_space == gym.spaces.Discrete(6)
        obs = venv.reset()
        assert obs.shape == (4, 4, 84, 84) and obs.dtype == np.uint8
        rng = np.random.default_rng(0)
        finished = np.zeros(4, bool)
        for _ in range(51):
            result = venv.step(rng.integers(0, 6, 4))
            assert result.reward.dtype == np.float32 and set(np.unique(result.reward)) <= {-1.0, 0.0, 1.0}
            assert result.terminated.dtype == result.truncated.dtype == bool
            assert result.episode_return.dtype == np.float64 and result.episode_length.dtype == np.int64
            done = result.truncated | result.terminated
            np.testing.assert_array_equal(done, ~np.isnan(result.episode_return))
            for i in np.flatnonzero(done):
                assert 42 <= result.episode_length[i] <= 50  # no-op starts use up to 30 frames
                assert all(np.array_equal(frame, result.obs[i, 0]) for frame in result.obs[i])  # fresh stack
                np.testing.assert_array_equal(result.final_obs[i, :-1], obs[i, 1:])  # the old episode's last
            finished |= done
            obs = result.obs
        assert finished.all()


def test_dead_worker_is_restarted_with_its_envs_on_their_next_episodes():
    seed = 3
    cfg = dataclasses.replace(counting_cfg(4, 2), max_restarts=1)
    with make_vector_env(cfg, seed, restart_workers=True) as venv:
        venv.reset()
        before = venv.step(np.full(4, 7))
        assert not before.restarted.any()
        os.kill(venv.worker_pids[1], signal.SIGKILL)
        start = time.monotonic()
        result = venv.step(np.full(4, 8))
        assert time.monotonic() - start < 5.0
        np.testing.assert_array_equal(result.restarted, [False, False, True, True])
        np.testing.assert_array_equal(result.obs[:2, 2], [2, 2])  # envs 0-1 went on
        # Envs 2-3 start the episode after the one that was cut (the vector env's episode 1, not 0 again).
        np.testing.assert_array_equal(result.obs[2:, 0], [episode_seed(seed, 2, 1), episode_seed(seed, 3, 1)])
        np.testing.assert_array_equal(result.obs[2:, 2], [0, 0])
        assert not result.terminated[2:].any() and not result.truncated[2:].any()
        assert venv.restarts == 1
        assert not venv.step(np.full(4, 9)).restarted.any()
        os.kill(venv.worker_pids[0], signal.SIGKILL)
        with pytest.raises(WorkerFailure, match=r"env worker 0 .*SIGKILL.*; the run's 1 restarts reach max_restarts=1: "
                                                r"raise --max-restarts"):
            venv.step(np.zeros(4, int))


@pytest.mark.parametrize("env_id, env_args, recorded_on, rebuilt_on", [
    (COUNTING_ID, (), "shm", "shm"),
    (COUNTING_ID, (), "inproc", "shm"),  # a run resumes on either of conveyor's own backends
    ("CartPole-v1", (), "shm", "inproc"),
    pytest.param("ALE/Breakout-v5", (("repeat_action_probability", 0.25),), "shm", "inproc",  # lives, sticky, no-ops
                 marks=pytest.mark.slow),
])
def test_env_state_rebuilds_every_env_exactly(env_id, env_args, recorded_on, rebuilt_on):
    cfg = EnvCfg(id=env_id, num_envs=4, num_workers=2, env_args=env_args, episodic_life=True, backend=recorded_on)
    actions = np.random.default_rng(1).integers(0, 4 if "Breakout" in env_id else 2, (260, 4))
    with make_vector_env(cfg, 5) as venv:
        venv.reset()
        for a in actions[:200]:
            venv.step(a)
        state = venv.history.state()
        original = [venv.step(a) for a in actions[200:]]
    if "Breakout" in env_id:  # the recorded games span lost lives
        assert any(len(b) and b[:-1].any() for b in state["boundaries"])
    with make_vector_env(dataclasses.replace(cfg, backend=rebuilt_on), 5, env_state=state) as venv:
        venv.reset()
        rebuilt = [venv.step(a) for a in actions[200:]]
    for ours, theirs in zip(original, rebuilt):
        for field in ("obs", "reward", "terminated", "truncated", "episode_return"):
            mine, rebuilt_field = getattr(ours, field), getattr(theirs, field)
            if field == "obs" and env_id == COUNTING_ID:  # its reset counter (column 1) is not state a seed sets
                mine, rebuilt_field = mine[:, [0, 2, 3]], rebuilt_field[:, [0, 2, 3]]
            np.testing.assert_array_equal(mine, rebuilt_field)


def test_env_history_keeps_only_the_running_games_and_round_trips_through_a_checkpoint_state():
    from conveyor.envs.history import EnvHistory, Replay

    history = EnvHistory(3)
    history.start_games(slice(None))
    # env 0: a life lost at step 1 (the game goes on); env 1: a new game after step 0; env 2 plays on.
    history.record(np.array([1, 2, 3]), np.array([False, True, False]), np.array([False, True, False]))
    history.record(np.array([4, 5, 6]), np.array([True, False, False]), np.array([False, False, False]))
    history.record(np.array([7, 8, 9]), np.array([False, False, False]), np.array([False, False, False]))
    assert history.replay_plan() == [Replay(0, [1, 4, 7], [False, True, False]), Replay(1, [5, 8], [False, False]),
                                     Replay(0, [3, 6, 9], [False, False, False])]
    assert history.next_episode.tolist() == [2, 2, 1]
    restored = EnvHistory.from_state(history.state())
    assert restored.replay_plan() == history.replay_plan()
    np.testing.assert_array_equal(restored.next_episode, history.next_episode)
    restored.start_games([2])
    assert restored.replay_plan()[2] == Replay(1, [], [])


def test_envpool_backend_refuses_to_rebuild_envs_from_a_checkpoint():
    from conveyor.envs.history import EnvHistory

    with pytest.raises(ConfigError, match="envpool backend cannot rebuild its envs.*--env-backend shm"):
        make_vector_env(EnvCfg(id="ALE/Pong-v5", num_envs=2, num_workers=1, backend="envpool"), 0,
                        env_state=EnvHistory(2).state())


@pytest.mark.parametrize("env_id", ["CartPole-v1", "MinAtar/Breakout-v1"])
def test_inproc_steps_the_same_envs_to_the_same_results_as_shm(env_id):
    actions = np.random.default_rng(2).integers(0, 2, (300, 4))

    def rollout(backend: str) -> list:
        cfg = EnvCfg(id=env_id, num_envs=4, num_workers=2, backend=backend)
        with make_vector_env(cfg, 11, gamma=0.99) as venv:
            return [venv.reset()] + [venv.step(a) for a in actions]

    shm, inproc = rollout("shm"), rollout("inproc")
    np.testing.assert_array_equal(shm[0], inproc[0])
    for ours, theirs in zip(shm[1:], inproc[1:]):
        for field in ours._fields:
            np.testing.assert_array_equal(getattr(ours, field), getattr(theirs, field), err_msg=field)
    assert sum(int(step.terminated.sum() + step.truncated.sum()) for step in shm[1:]) > 4  # episodes ended


def test_inproc_starts_no_process():
    children_before = set(children())
    with make_vector_env(counting_cfg(4, 2, "inproc"), 0) as venv:
        venv.reset()
        venv.step(np.zeros(4, int))
        assert set(children()) <= children_before
        assert venv.restarts == 0


def test_auto_steps_cheap_envs_in_process_and_slow_ones_in_workers():
    from conveyor.envs.inproc import INPROC_MAX_STEP_US, choose_backend

    sleeping = (("dist", "constant"), ("mean_ms", 2.0))  # each step sleeps 2 ms
    # One worker saves nothing by stepping elsewhere, however slow the env.
    alone = choose_backend(EnvCfg(id=STEP_TIME_ID, num_envs=4, num_workers=1, env_args=sleeping), 0)
    assert alone.backend == "inproc" and alone.step_us >= 1000
    slow = choose_backend(EnvCfg(id=STEP_TIME_ID, num_envs=16, num_workers=2, env_args=sleeping), 0)
    assert slow.backend == "shm" and slow.step_us > INPROC_MAX_STEP_US and "worker processes" in slow.reason
    with make_vector_env(EnvCfg(id=STEP_TIME_ID, num_envs=4, num_workers=1, backend="auto"), 0) as venv:
        assert type(venv).__name__ == "InProcessVectorEnv"


def test_timing_an_env_keeps_a_timer_set_before_it():
    """pytest-timeout (and a caller's alarm) arm SIGALRM before a run starts: auto's bounded timing gives the
    timer back with what it had left, rather than cancel it."""
    from conveyor.envs.inproc import choose_backend

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 600)
        choose_backend(EnvCfg(id="MountainCar-v0", num_envs=4, num_workers=2), 0)  # timed: no native vector env
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 500 < left <= 600 and signal.getsignal(signal.SIGALRM) is not None and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.slow
def test_auto_gives_an_env_whose_step_hangs_to_worker_processes():
    from conveyor.envs.inproc import MEASURE_LIMIT_S, choose_backend

    start = time.monotonic()
    choice = choose_backend(EnvCfg(id=HANGING_ID, num_envs=4, num_workers=2, env_args=(("hang_at", 3),)), 0)
    assert choice.backend == "shm" and "over" in choice.reason
    assert time.monotonic() - start < MEASURE_LIMIT_S + 30  # the alarm cut the hanging step short
