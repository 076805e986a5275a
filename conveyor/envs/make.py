"""``make_env``: one seeded gymnasium env from an ``EnvCfg``.

Every env made here reports each finished real episode through its step
info: ``info[EPISODE_KEY] = {"r": unclipped return, "l": length in agent
steps, "t": seconds}`` at the episode's last step (gymnasium's
``RecordEpisodeStatistics``, placed below any reward clipping and episodic
life). Training code reads returns from there, never by summing the
training reward, which may be clipped.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from conveyor.config import ConfigError, EnvCfg

EPISODE_KEY = "episode"
"""Info key of a finished real episode's statistics (``r`` return, ``l`` length)."""
LIFE_CONTINUED_KEY = "life_continued"
"""Reset-info key set (True) when a reset continued the game instead of starting one (Atari episodic life):
the game's state then depends on the actions before the reset too."""

_ID_HINT = "use a gymnasium id such as CartPole-v1, ALE/Pong-v5 or HalfCheetah-v5"


def gym_make(env_id: str, kwargs: dict[str, Any]) -> gym.Env:
    """``gymnasium.make`` whose id and keyword mistakes raise ``ConfigError``."""
    try:
        return gym.make(env_id, **kwargs)
    except (gym.error.UnregisteredEnv, gym.error.DeprecatedEnv, ModuleNotFoundError) as exc:
        reason = " ".join(str(exc).split())
        raise ConfigError(f"unknown env id {env_id!r} ({reason}): {_ID_HINT}") from None
    except TypeError as exc:
        if "unexpected keyword argument" not in str(exc):
            raise
        raise ConfigError(f"env {env_id!r} rejects env_args {sorted(kwargs)}: {exc}") from None


def make_env(cfg: EnvCfg, seed: int) -> gym.Env:
    """One env for ``cfg.id`` (any gymnasium id; Atari ids get the standard preprocessing).

    The env comes back already reset once with ``seed``, which fixes all of
    its random streams (dynamics, no-op starts, sticky actions); call
    ``reset()`` without a seed to start each episode. ``cfg.env_args`` go to
    the env's constructor. Unknown ids raise ``ConfigError``.
    """
    if cfg.is_atari:
        from conveyor.envs.atari import make_atari

        env = make_atari(cfg)
    else:
        env = gym.wrappers.RecordEpisodeStatistics(gym_make(cfg.id, cfg.kwargs), stats_key=EPISODE_KEY)
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return env


def episode_seed(seed: int, env: int, episode: int) -> int:
    """The seed that starts episode ``episode`` of env ``env`` of a run seeded ``seed`` (a 32-bit hash of all three).

    Seeding every episode makes an env's state a function of (episode, actions since its reset): a restarted
    worker re-seeds its envs from their episode counters, and a resumed run rebuilds them by replaying actions.
    """
    return int(np.random.SeedSequence([seed, env, episode]).generate_state(1)[0])


def env_spaces(cfg: EnvCfg, seed: int) -> tuple[gym.Space, gym.Space]:
    """The (observation, action) spaces of ``cfg.id`` after our preprocessing, from a throwaway env."""
    probe = make_env(cfg, seed)
    try:
        return probe.observation_space, probe.action_space
    finally:
        probe.close()
