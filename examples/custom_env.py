"""An env of your own: ``Corridor-v0``, a corridor of ``length`` cells the agent has to walk to its right end.

Importing this module registers ``Corridor-v0`` with gymnasium, so conveyor
trains it by naming the module before the id (run from the repository root:
conveyor imports ``MODULE`` from the current directory or ``PYTHONPATH``)::

    conveyor train --env examples.custom_env:Corridor-v0

With the presets of a discrete-action env (``classic-discrete``: PAAC A2C,
16 envs) the run stops once the mean return of the last 100 episodes reaches
the registered ``reward_threshold``, -10 (the best return is -9), after
about 1.6k env steps (seeds 0-2: 1,520 to 1,600; a few seconds; ``--arch
impact``: 5.1k, ``--arch seed``: 4.6k, seed 0). ``--env-arg length=6`` makes
a shorter corridor (best return -5: pass ``--target-return -6`` too).

The agent starts in cell 0 and sees its cell as a one-hot float32 vector;
action 1 moves right, action 0 left (cell 0 has a wall). Each step costs -1;
reaching the last cell ends the episode (terminated), and 100 steps cut it
(truncated, by gymnasium's ``TimeLimit``). A random walk needs about 81 steps.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class Corridor(gym.Env):
    """See the module docstring. What conveyor's env check asks of it: a Box observation space whose dtype and
    shape every observation has, ``reset`` returning ``(obs, info)`` and ``step`` five values."""

    def __init__(self, length: int = 10) -> None:
        if length < 2:
            raise ValueError(f"length must be at least 2, got {length}")
        self.length = length
        self.observation_space = gym.spaces.Box(0.0, 1.0, (length,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.position = 0

    def _observe(self) -> np.ndarray:
        obs = np.zeros(self.length, np.float32)
        obs[self.position] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.position = 0
        return self._observe(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.position = max(0, self.position + (1 if int(action) == 1 else -1))
        terminated = self.position == self.length - 1
        return self._observe(), -1.0, terminated, False, {}


if "Corridor-v0" not in gym.registry:  # importing the module twice must not register it twice
    gym.register("Corridor-v0", entry_point=Corridor, max_episode_steps=100, reward_threshold=-10.0)
