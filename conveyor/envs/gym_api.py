"""What every env maker here (``make``, ``atari``) shares with gymnasium: ``gym_make``, and the info keys
through which our envs report finished episodes and continued games."""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from conveyor.errors import ConfigError

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
