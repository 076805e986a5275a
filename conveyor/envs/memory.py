"""``conveyor/Memory-v0``: answer a cue seen ``length - 1`` steps ago (a task only a policy with memory solves).

An episode has ``length`` steps (default 2, at least 2). The first
observation shows a cue c, 0 or 1, drawn uniformly by the env's seeded
generator: ``[1, 0, 0]`` or ``[0, 1, 0]`` (float32). The next ``length - 2``
observations are blank, ``[0, 0, 0]``, and the last one asks, ``[0, 0, 1]``.
Actions are Discrete(2). An action before the question earns 0; the answer
ends the episode (terminated) with reward +1 if it equals the cue, else -1.

The bounds (what ``tests/test_recurrent_actor_critic.py`` checks):

- **Feed-forward: expected return 0, whatever the policy.** Observations
  do not depend on actions, and the question looks the same whatever the
  cue, so a policy that sees only the current observation answers
  independently of the cue: right with probability exactly 1/2, expected
  return ``1/2 - 1/2 = 0``. The mean of 100 such episodes has standard
  deviation 0.1 (returns are +-1).
- **With memory: return 1** (answer the cue), the maximum.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from conveyor.errors import ConfigError

ENV_ID = "conveyor/Memory-v0"
FEED_FORWARD_BOUND = 0.0
"""The best expected return of a policy without memory (module docstring)."""
MEMORY_RETURN = 1.0
"""The return of a policy that remembers the cue."""
SOLVED = 0.9
"""The registered reward threshold (a run stops there unless it sets ``--target-return``): 95% right answers, ten
standard deviations of a 100-episode mean above the feed-forward bound."""


class MemoryEnv(gym.Env[np.ndarray, np.int64]):
    """Cue, ``length - 2`` blank steps, question (see the module docstring)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, length: int | str = 2) -> None:
        try:  # values from --env-arg arrive as strings
            self.length = int(length)
        except (TypeError, ValueError):
            raise ConfigError(f"Memory length must be an integer, got {length!r}") from None
        if self.length < 2:
            raise ConfigError(f"Memory length must be at least 2 (a cue and a question), got {length!r}")
        self.observation_space = gym.spaces.Box(0.0, 1.0, (3,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.cue = 0
        self.t = 0

    def _observe(self) -> np.ndarray:
        obs = np.zeros(3, np.float32)
        if self.t == 0:
            obs[self.cue] = 1.0
        elif self.t == self.length - 1:
            obs[2] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.cue = int(self.np_random.integers(2))
        self.t = 0
        return self._observe(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.t == self.length - 1:
            return self._observe(), (1.0 if int(action) == self.cue else -1.0), True, False, {}
        self.t += 1
        return self._observe(), 0.0, False, False, {}


def register() -> None:
    """Register ``conveyor/Memory-v0`` with gymnasium (idempotent)."""
    if ENV_ID not in gym.registry:
        gym.register(ENV_ID, entry_point="conveyor.envs.memory:MemoryEnv", reward_threshold=SOLVED)
