"""MinAtar (Young & Tian 2019): ten-by-ten miniature Atari games as conveyor envs.

The ``minatar`` package (a core dependency) registers its gymnasium ids,
``MinAtar/{Asterix,Breakout,Freeway,Seaquest,SpaceInvaders}-v0`` (all six
actions) and ``-v1`` (each game's minimal action set), only when asked:
gymnasium 1.x loads no ``gymnasium.envs`` entry-point plugins.
``register_minatar`` asks, the first time a ``MinAtar/`` id is made; ``minatar``
is imported only then, and without its plotting libraries: at import it loads
matplotlib's pyplot and seaborn (and so scipy), about 2 s of CPU per process
on an idle machine and over 60 s for 16 GA3C agents starting together on a
loaded 2-core one (their first env call then timed out as hung). Only
rendering needs them (``render_mode``: ``conveyor enjoy``), and it loads them
then (``_attach_plotting``).

``make_minatar(cfg)`` builds, from the inside out:

1. MinAtar's gymnasium env (``env_args`` go to its constructor:
   ``sticky_action_prob``, default 0.1; ``difficulty_ramping``, default True);
2. ``MinAtarFrames``: observations as uint8 ``[C, 10, 10]`` (channel-first,
   0 or 255, so the model's /255 makes them exactly 0 or 1), and each reset
   forgets the sticky action of the previous episode;
3. ``RecordEpisodeStatistics``: each episode's return and length at its last step.

No frame skip, frame stack or reward clipping: the paper uses none (its
rewards are already small integers, and the state holds trails that show
motion).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator

import gymnasium as gym
import numpy as np

from conveyor.config import EnvCfg
from conveyor.envs.gym_api import EPISODE_KEY, gym_make
from conveyor.errors import ConfigError
from conveyor.presets import MINATAR_PREFIX

NOOP_ACTION = 0  # index 0 of MinAtar's full action set ('n'); the sticky action of a fresh env


PLOTTING_MODULES = ("matplotlib.pyplot", "seaborn")
"""What ``minatar`` imports at load time for rendering only (inside ``try``: it runs on without them)."""


@contextlib.contextmanager
def _without_plotting() -> Iterator[None]:
    """Imports inside fail for ``PLOTTING_MODULES`` not loaded yet (a ``None`` entry in ``sys.modules``), and the
    warnings ``minatar`` logs about it are muted."""
    hidden = [name for name in PLOTTING_MODULES if name not in sys.modules]
    sys.modules.update(dict.fromkeys(hidden, None))
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def _attach_plotting() -> None:
    """Give ``minatar``'s modules the plotting names their render code uses, where the import left them out."""
    import minatar.environment
    import minatar.gym
    import seaborn
    from matplotlib import colors, pyplot

    for module, names in ((minatar.environment, {"plt": pyplot, "colors": colors, "sns": seaborn}),
                          (minatar.gym, {"sns": seaborn})):
        for name, value in names.items():
            if not hasattr(module, name):
                setattr(module, name, value)


def register_minatar() -> None:
    """Register MinAtar's gymnasium ids (once per process); ``ConfigError`` if ``minatar`` is not installed."""
    if any(env_id.startswith(MINATAR_PREFIX) for env_id in gym.registry):
        return
    try:
        with _without_plotting():
            import minatar.gym
    except ModuleNotFoundError as exc:
        raise ConfigError(f"MinAtar ids need the minatar package ({exc}): pip install minatar") from None
    minatar.gym.register_envs()


class MinAtarFrames(gym.Wrapper):
    """MinAtar's bool ``[10, 10, C]`` states as uint8 ``[C, 10, 10]`` with values 0 and 255.

    ``reset`` also sets the game's remembered action to the no-op a fresh env
    starts with: MinAtar repeats the previous action with probability
    ``sticky_action_prob``, and keeps that action across resets, which would
    make an episode depend on how the previous one ended. conveyor seeds every
    episode and rebuilds envs by replaying an episode's actions (restarts,
    resume), so an episode must depend on its seed and its own actions only.
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        height, width, channels = env.observation_space.shape
        self.observation_space = gym.spaces.Box(0, 255, (channels, height, width), np.uint8)
        self.game = env.unwrapped.game  # minatar.Environment: holds the sticky action

    @staticmethod
    def _observe(state: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(state.transpose(2, 0, 1)).view(np.uint8) * np.uint8(255)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        self.game.last_action = NOOP_ACTION
        state, info = self.env.reset(seed=seed, options=options)
        return self._observe(state), info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        state, reward, terminated, truncated, info = self.env.step(action)
        return self._observe(state), float(reward), terminated, truncated, info


def make_minatar(cfg: EnvCfg) -> gym.Env:
    """The MinAtar env of ``cfg`` (see the module docstring), not yet seeded."""
    register_minatar()
    if cfg.kwargs.get("render_mode"):
        _attach_plotting()
    env = MinAtarFrames(gym_make(cfg.id, cfg.kwargs))
    return gym.wrappers.RecordEpisodeStatistics(env, stats_key=EPISODE_KEY)
