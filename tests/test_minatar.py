"""MinAtar (Young & Tian 2019) as an env family: the envs through make_env, seeding, the family's presets and
encoder, the envpool refusal, and one short training run end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
import torch

import conveyor
from conveyor import presets
from conveyor.cli import build_parser, config_from_args
from conveyor.config import ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg
from conveyor.envs import EPISODE_KEY, make_env, make_vector_env
from conveyor.models.encoders import ENCODERS

BREAKOUT = "MinAtar/Breakout-v1"
# Each game's channels and minimal action set (MinAtar's -v1 ids).
GAMES = {"Asterix": (4, 5), "Breakout": (4, 3), "Freeway": (7, 3), "Seaquest": (10, 6), "SpaceInvaders": (6, 4)}


@pytest.mark.parametrize("game", GAMES)
def test_observations_are_channel_first_uint8_zero_or_255(game):
    channels, actions = GAMES[game]
    env = make_env(EnvCfg(id=f"MinAtar/{game}-v1"), seed=0)
    assert env.observation_space == gym.spaces.Box(0, 255, (channels, 10, 10), np.uint8)
    assert env.action_space == gym.spaces.Discrete(actions)
    obs, _ = env.reset(seed=1)
    seen = [obs] + [env.step(env.action_space.sample())[0] for _ in range(30)]
    for obs in seen:
        assert obs.shape == (channels, 10, 10) and obs.dtype == np.uint8 and obs.flags.c_contiguous
        assert set(np.unique(obs)) <= {0, 255}
    assert any(obs.any() for obs in seen)  # not blank
    env.close()


@pytest.mark.filterwarnings("ignore:.*out of date")  # gymnasium takes -v0 (all six actions) for an old -v1
def test_full_action_set_ids_and_env_args():
    env = make_env(EnvCfg(id="MinAtar/Breakout-v0", env_args=(("sticky_action_prob", 0.0),)), seed=0)
    assert env.action_space == gym.spaces.Discrete(6) and env.unwrapped.game.sticky_action_prob == 0.0
    env.close()
    with pytest.raises(ConfigError, match="rejects env_args"):
        make_env(EnvCfg(id=BREAKOUT, env_args=(("no_such_arg", 1),)), seed=0)
    with pytest.raises(ConfigError, match="unknown env id 'MinAtar/Pong-v1'"):
        make_env(EnvCfg(id="MinAtar/Pong-v1"), seed=0)


def play(env: gym.Env, seed: int, actions: list[int]) -> tuple[np.ndarray, list[float], list[bool]]:
    obs = [env.reset(seed=seed)[0]]
    rewards, dones = [], []
    for action in actions:
        ob, reward, terminated, truncated, _ = env.step(action)
        obs.append(ob)
        rewards.append(reward)
        dones.append(terminated or truncated)
        if terminated or truncated:
            break
    return np.array(obs), rewards, dones


def test_same_seed_same_episode_different_seed_different_episode():
    actions = list(np.random.default_rng(0).integers(0, 3, 300))
    first = play(make_env(EnvCfg(id=BREAKOUT), seed=5), 11, actions)
    again = play(make_env(EnvCfg(id=BREAKOUT), seed=6), 11, actions)
    other = play(make_env(EnvCfg(id=BREAKOUT), seed=5), 12, actions)
    np.testing.assert_array_equal(first[0], again[0])
    assert first[1:] == again[1:]
    assert len(first[0]) != len(other[0]) or not np.array_equal(first[0], other[0])


def test_an_episode_does_not_depend_on_how_the_previous_one_ended():
    """MinAtar's sticky action outlives a reset; conveyor rebuilds an env from (episode seed, actions), so
    the wrapper's reset forgets it: a used env and a fresh one play a seeded episode alike."""
    cfg = EnvCfg(id=BREAKOUT, env_args=(("sticky_action_prob", 0.5),))
    actions = [1, 2, 0, 2, 1, 1, 2, 0] * 10
    used = make_env(cfg, seed=0)
    used.reset(seed=3)
    for _ in range(5):
        used.step(2)
    used.unwrapped.game.last_action = used.unwrapped.action_set[2]  # ended on "right", not a fresh env's no-op
    replayed = play(used, 7, actions)
    fresh = play(make_env(cfg, seed=0), 7, actions)
    np.testing.assert_array_equal(replayed[0], fresh[0])


def test_episode_statistics_report_returns():
    env = make_env(EnvCfg(id=BREAKOUT), seed=0)
    env.reset(seed=2)
    total, info, done = 0.0, {}, False
    while not done:
        _, reward, terminated, truncated, info = env.step(env.action_space.sample())
        total += reward
        done = terminated or truncated
    assert info[EPISODE_KEY]["r"] == pytest.approx(total)


def test_family_preset_and_encoder():
    assert presets.id_family(BREAKOUT) == "minatar" and presets.id_family("MinAtar/Seaquest-v0") == "minatar"
    assert EnvCfg(id=BREAKOUT).is_minatar and not EnvCfg(id=BREAKOUT).is_atari
    cfg = config_from_args(build_parser().parse_args(["train", "--arch", "paac", "--env", BREAKOUT]))
    assert (cfg.model.name, cfg.preset_sources["model.name"]) == ("minatar_cnn", "minatar")
    assert cfg.total_steps == 5_000_000  # the paper's budget; --total-steps overrides it
    assert config_from_args(build_parser().parse_args(
        ["train", "--env", BREAKOUT, "--total-steps", "1000000"])).total_steps == 1_000_000


def test_minatar_cnn_is_the_papers_network():
    encoder, features = ENCODERS["minatar_cnn"]((4, 10, 10), ModelCfg(name="minatar_cnn"))
    assert features == 128
    assert encoder(torch.zeros(5, 4, 10, 10)).shape == (5, 128)
    convs = [m for m in encoder.modules() if isinstance(m, torch.nn.Conv2d)]
    linears = [m for m in encoder.modules() if isinstance(m, torch.nn.Linear)]
    assert [(c.out_channels, c.kernel_size, c.stride) for c in convs] == [(16, (3, 3), (1, 1))]
    assert [(fc.in_features, fc.out_features) for fc in linears] == [(16 * 8 * 8, 128)]


def test_envpool_backend_refuses_minatar_in_one_line():
    with pytest.raises(ConfigError) as error:
        make_vector_env(EnvCfg(id=BREAKOUT, num_envs=2, num_workers=1, backend="envpool"), 0)
    assert "--env-backend shm" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow  # a Breakout run (4-5 s); make test keeps MinAtar's env and model tests
def test_paac_trains_on_breakout_end_to_end(tmp_path):
    out = tmp_path / "run"
    # One learner thread: two would fight the two env workers for this machine's cores (it only changes speed).
    cfg = RunCfg(env=EnvCfg(id=BREAKOUT), arch=ArchCfg(name="paac"), total_steps=3000, seed=1, progress=False,
                 out=str(out), torch_threads=1, log_interval_s=0.5)
    summary = conveyor.train(cfg)
    assert summary["env_steps"] >= 3000 and summary["episodes"] > 0
    assert np.isfinite(summary["return_mean_last100"]) and summary["return_mean_last100"] >= 0
    assert json.loads((out / "summary.json").read_text())["env_steps"] == summary["env_steps"]
    assert json.loads((out / "config.json").read_text())["model"]["name"] == "minatar_cnn"
    metrics = pd.read_csv(out / "metrics.csv")
    assert {"env_steps", "sps", "return_mean_last100", "loss/loss"} <= set(metrics.columns)
    assert metrics["env_steps"].iloc[-1] == summary["env_steps"] and np.isfinite(metrics["loss/loss"]).all()


def test_training_envs_skip_minatars_plotting_imports_and_rendering_loads_them():
    # minatar imports pyplot and seaborn (and scipy) at load time for rendering only: seconds of CPU in every
    # env process, which made 16 GA3C agents starting on a loaded machine time out as hung.
    code = (
        "import sys\n"
        "from conveyor.config import EnvCfg\n"
        "from conveyor.envs import make_env\n"
        "env = make_env(EnvCfg(id='MinAtar/Breakout-v1'), 0)\n"
        "env.reset(seed=0)\n"
        "print(*(name in sys.modules for name in ('seaborn', 'matplotlib.pyplot', 'scipy')))\n"
        "shown = make_env(EnvCfg(id='MinAtar/Breakout-v1', env_args=(('render_mode', 'rgb_array'),)), 0)\n"
        "shown.reset(seed=0)\n"
        "print(shown.render().shape)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["False False False", "(10, 10, 3)"]
    assert "Cannot import" not in result.stderr  # minatar's warnings about the missing modules are muted
