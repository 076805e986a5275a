"""make_env: Atari preprocessing, the StepTime env, id and kwargs errors."""

from __future__ import annotations

import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pytest

from conveyor.config import ConfigError, EnvCfg
from conveyor.envs import EPISODE_KEY, STEP_TIME_ID, make_env
from conveyor.envs.atari import SCREEN_SIZE
from conveyor.envs.step_time import EPISODE_STEPS, StepTimeEnv


def area_resize_reference(screen: np.ndarray, size: int) -> np.ndarray:
    """Exact area averaging: upsample by repetition to a common multiple, then block means."""
    height, width = screen.shape
    tall, wide = np.lcm(height, size), np.lcm(width, size)
    fine = np.repeat(np.repeat(screen.astype(np.float64), tall // height, 0), wide // width, 1)
    return fine.reshape(size, tall // size, size, wide // size).mean(axis=(1, 3))


# -- Atari -------------------------------------------------------------------


def test_atari_observation_is_channel_first_uint8_stack():
    env = make_env(EnvCfg(id="ALE/Pong-v5"), seed=0)
    assert env.observation_space.shape == (4, SCREEN_SIZE, SCREEN_SIZE)
    assert env.observation_space.dtype == np.uint8
    obs, _ = env.reset()
    assert obs.shape == (4, SCREEN_SIZE, SCREEN_SIZE) and obs.dtype == np.uint8
    assert obs.max() > obs.min()  # a real picture, not a blank
    assert all(np.array_equal(frame, obs[0]) for frame in obs)  # the stack starts padded with the first frame
    env.close()


def test_frame_stack_shifts_one_frame_per_step():
    env = make_env(EnvCfg(id="ALE/Pong-v5"), seed=1)
    obs, _ = env.reset()
    changed = False
    for _ in range(60):
        new_obs, *_ = env.step(env.action_space.sample())
        np.testing.assert_array_equal(new_obs[:-1], obs[1:])
        changed |= not np.array_equal(new_obs[-1], obs[-1])
        obs = new_obs
    assert changed
    env.close()


def test_atari_frames_are_max_pooled_area_resized_grayscale():
    # Sticky actions off and no no-ops, so a raw env driven by hand stays in lockstep.
    args = (("repeat_action_probability", 0.0),)
    env = make_env(EnvCfg(id="ALE/Breakout-v5", noop_max=0, frame_stack=1, env_args=args), seed=3)
    raw = gym.make("ALE/Breakout-v5", frameskip=1, obs_type="grayscale", repeat_action_probability=0.0)
    env.reset(seed=5)
    raw.reset(seed=5)
    for action in [1, 2, 2, 3, 0, 2, 3, 3, 1, 2] * 3:
        obs, *_ = env.step(action)
        screens = [raw.step(action)[0] for _ in range(4)]
        expected = area_resize_reference(np.maximum(screens[-2], screens[-1]), SCREEN_SIZE)
        assert np.abs(obs[0].astype(np.float64) - expected).max() <= 0.51
    env.close()
    raw.close()


def test_clipped_training_reward_and_unclipped_reported_return():
    # MsPacman scores 10+ per pellet; a short frame limit ends the game quickly.
    args = (("max_num_frames_per_episode", 1200),)
    clipped_env = make_env(EnvCfg(id="ALE/MsPacman-v5", env_args=args), seed=2)
    raw_env = make_env(EnvCfg(id="ALE/MsPacman-v5", env_args=args, clip_rewards=False), seed=2)
    clipped_env.reset()
    raw_env.reset()
    rng = np.random.default_rng(0)
    clipped_sum = raw_sum = 0.0
    for _ in range(400):
        action = int(rng.integers(clipped_env.action_space.n))
        _, clipped, term, trunc, clipped_info = clipped_env.step(action)
        _, raw, *_, raw_info = raw_env.step(action)
        assert clipped == np.sign(raw)
        clipped_sum += clipped
        raw_sum += raw
        if term or trunc:
            break
    assert term or trunc
    assert raw_sum > clipped_sum > 0
    assert clipped_info[EPISODE_KEY]["r"] == raw_info[EPISODE_KEY]["r"] == raw_sum


def test_episodic_life_ends_learning_episodes_but_reports_the_whole_game():
    env = make_env(EnvCfg(id="ALE/Breakout-v5", episodic_life=True, clip_rewards=False), seed=4)
    ale = env.unwrapped.ale
    env.reset()
    assert ale.lives() == 5
    rng = np.random.default_rng(1)
    life_losses, game_reward = 0, 0.0
    for _ in range(5000):
        _, reward, terminated, truncated, info = env.step(int(rng.integers(4)))
        game_reward += reward
        if EPISODE_KEY in info:
            break
        if terminated:
            life_losses += 1
            env.reset()
            assert ale.lives() == 5 - life_losses  # the game went on, no restart
    assert life_losses == 4 and terminated  # four lost lives, then the game itself ended
    assert info[EPISODE_KEY]["r"] == game_reward
    env.reset()
    assert ale.lives() == 5


def test_atari_args_that_conveyor_sets_are_refused():
    with pytest.raises(ConfigError, match="frame_skip"):
        make_env(EnvCfg(id="ALE/Pong-v5", env_args=(("frameskip", 2),)), seed=0)


# -- ids and seeds -----------------------------------------------------------------


@pytest.mark.parametrize("env_id, hint", [("Foo-v0", "CartPole-v1"), ("ALE/NoSuchGame-v5", "CartPole-v1"),
                                           ("no_such_module:Env-v0", "PYTHONPATH")])
def test_unknown_id_is_a_one_line_config_error(env_id, hint):
    with pytest.raises(ConfigError) as error:
        make_env(EnvCfg(id=env_id), seed=0)
    message = str(error.value)
    assert repr(env_id) in message and hint in message and "\n" not in message


def test_same_seed_same_episode():
    def rollout(seed: int) -> np.ndarray:
        env = make_env(EnvCfg(id="CartPole-v1"), seed=seed)
        obs = [env.reset()[0]]
        obs += [env.step(step % 2)[0] for step in range(20)]
        return np.array(obs)

    np.testing.assert_array_equal(rollout(3), rollout(3))
    assert not np.array_equal(rollout(3), rollout(4))


# -- StepTime ---------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, mean_ms, var_ms2", [
    ({}, 1.0, 1.0),  # exponential, mean 1 ms
    ({"dist": "exponential", "mean_ms": 3.0}, 3.0, 9.0),
    ({"dist": "gamma", "mean_ms": 2.0, "shape": 4.0}, 2.0, 1.0),  # var = mean^2 / k
    ({"dist": "constant", "mean_ms": 0.5}, 0.5, 0.0),
])
def test_step_time_distribution(kwargs, mean_ms, var_ms2):
    env = StepTimeEnv(**kwargs)
    env.reset(seed=0)
    samples_ms = np.array([env.sample_step_time() for _ in range(20000)]) * 1000
    assert samples_ms.mean() == pytest.approx(mean_ms, rel=0.03)
    assert samples_ms.var() == pytest.approx(var_ms2, rel=0.1, abs=1e-9)


def test_step_time_is_spent_and_seeded():
    env = make_env(EnvCfg(id=STEP_TIME_ID, env_args=(("dist", "constant"), ("mean_ms", "5"))), seed=0)
    env.reset()
    start = time.perf_counter()
    for _ in range(10):
        env.step(0)
    assert time.perf_counter() - start >= 0.05
    a, b = StepTimeEnv(), StepTimeEnv()
    a.reset(seed=9)
    b.reset(seed=9)
    assert [a.sample_step_time() for _ in range(5)] == [b.sample_step_time() for _ in range(5)]


def test_step_time_busy_burns_cpu_and_sleep_does_not(monkeypatch):
    sleeping = StepTimeEnv(dist="constant", mean_ms=50)
    sleeping.reset(seed=0)
    cpu = time.process_time()
    sleeping.step(0)
    assert time.process_time() - cpu < 0.025

    def no_sleep(seconds: float) -> None:
        raise AssertionError("busy mode must not sleep")

    monkeypatch.setattr(time, "sleep", no_sleep)
    busy = StepTimeEnv(dist="constant", mean_ms=20, busy="true")
    busy.reset(seed=0)
    start = time.perf_counter()
    busy.step(0)
    assert time.perf_counter() - start >= 0.02


def test_step_time_reward_follows_the_action_and_episodes_truncate():
    env = make_env(EnvCfg(id=STEP_TIME_ID, env_args=(("mean_ms", 0.0),)), seed=0)
    obs, _ = env.reset()
    right = wrong = 0.0
    for step in range(EPISODE_STEPS):
        best = int(obs[0] > 0)
        action = best if step % 2 else 1 - best
        obs, reward, terminated, truncated, info = env.step(action)
        if action == best:
            right += reward
        else:
            wrong += reward
        assert not terminated
        assert truncated == (step == EPISODE_STEPS - 1)
    assert (right, wrong) == (EPISODE_STEPS / 2, 0.0)
    assert info[EPISODE_KEY]["r"] == right and info[EPISODE_KEY]["l"] == EPISODE_STEPS


@pytest.mark.parametrize("args, field", [
    ((("dist", "uniform"),), "dist"),
    ((("mean_ms", -1),), "mean_ms"),
    ((("mean_ms", "fast"),), "mean_ms"),
    ((("shape", 0),), "shape"),
    ((("busy", "maybe"),), "busy"),
    ((("speed", 2),), "speed"),
])
def test_step_time_bad_kwargs_are_config_errors(args, field):
    with pytest.raises(ConfigError, match=field):
        make_env(EnvCfg(id=STEP_TIME_ID, env_args=args), seed=0)


def test_mujoco_warnings_about_gymnasiums_own_model_files_are_dropped_and_the_rest_printed(capsys):
    """MuJoCo 4 warns at each compile of gymnasium's half_cheetah.xml (a deprecated attribute): a fresh process
    that builds HalfCheetah prints nothing of it; any other MuJoCo warning still reaches stderr."""
    pytest.importorskip("mujoco")
    from conveyor.envs.gym_api import _print_mujoco_warning

    built = subprocess.run([sys.executable, "-c", "from conveyor.config import EnvCfg\n"
                            "from conveyor.envs import make_env\n"
                            "make_env(EnvCfg(id='HalfCheetah-v5'), 0).close()"],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert "settotalmass" not in built.stdout + built.stderr
    _print_mujoco_warning("Nan, Inf or huge value in QACC at DOF 0")
    assert capsys.readouterr().err == "MuJoCo warning: Nan, Inf or huge value in QACC at DOF 0\n"
