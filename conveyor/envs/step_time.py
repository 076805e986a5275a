"""A synthetic env whose step time follows a chosen distribution.

``conveyor/StepTime-v0`` exists for throughput studies: its per-step cost is
a known random variable, so the HTS-RL analysis (claim 1, eq. 7, in
docs/design.md "Throughput models") predicts the runtime of a run on it.
Each step takes

- ``dist="constant"``: exactly ``mean_ms``;
- ``dist="exponential"`` (default): Exponential with mean ``mean_ms``;
- ``dist="gamma"``: Gamma with shape ``shape`` (k) and mean ``mean_ms``
  (rate ``k / mean_ms``).

``busy=True`` burns CPU for the step time (models a compute-bound simulator);
the default sleeps (models a simulator in another process or on a device).
Step times come from their own generator, seeded by ``reset(seed=...)``, so
they are reproducible and independent of the observations.

The task is learnable: each observation is 4 floats drawn uniformly from
[-1, 1], the action space is Discrete(2), and the reward is 1 when
``action == (obs[0] > 0)`` of the observation acted on, else 0. Episodes
never terminate; the registration truncates them after
``EPISODE_STEPS`` steps (gymnasium's TimeLimit), so returns lie in
[0, EPISODE_STEPS] and a random policy earns half.
"""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np

from conveyor.errors import ConfigError

ENV_ID = "conveyor/StepTime-v0"
EPISODE_STEPS = 100
DISTRIBUTIONS = ("constant", "exponential", "gamma")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def _as_float(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"StepTime {name} must be a number, got {value!r}") from None


def _as_bool(value: Any) -> bool:
    # Values from --env-arg arrive as strings.
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS + _FALSE_WORDS:
            return word in _TRUE_WORDS
        raise ConfigError(f"StepTime busy must be true or false, got {value!r}")
    return bool(value)


class StepTimeEnv(gym.Env[np.ndarray, np.int64]):
    """Contextual-bandit env that spends a random, seeded time in every step."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, dist: str = "exponential", mean_ms: float = 1.0, shape: float = 2.0,
                 busy: bool = False) -> None:
        if dist not in DISTRIBUTIONS:
            raise ConfigError(f"unknown StepTime dist {dist!r}: choose one of {', '.join(DISTRIBUTIONS)}")
        self.dist = dist
        self.mean_s = _as_float("mean_ms", mean_ms) / 1000.0
        if not self.mean_s >= 0.0:
            raise ConfigError(f"StepTime mean_ms must be >= 0, got {mean_ms!r}")
        self.shape = _as_float("shape", shape)
        if not self.shape > 0.0:
            raise ConfigError(f"StepTime shape must be positive, got {shape!r}: pass a gamma shape k > 0")
        self.busy = _as_bool(busy)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._time_rng = np.random.default_rng()
        self._obs = np.zeros(4, np.float32)

    def sample_step_time(self) -> float:
        """Seconds the next step will take (draws from the step-time generator)."""
        if self.dist == "constant":
            return self.mean_s
        if self.dist == "exponential":
            return float(self._time_rng.exponential(self.mean_s))
        return float(self._time_rng.gamma(self.shape, self.mean_s / self.shape))

    def _spend(self, seconds: float) -> None:
        if not self.busy:
            time.sleep(seconds)
            return
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            pass

    def _observe(self) -> np.ndarray:
        self._obs = self.np_random.uniform(-1.0, 1.0, 4).astype(np.float32)
        return self._obs

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        if seed is not None:
            # A separate stream, so step times do not shift when observation draws change.
            self._time_rng = np.random.default_rng([seed, 1])
        return self._observe(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = 1.0 if int(action) == int(self._obs[0] > 0.0) else 0.0
        self._spend(self.sample_step_time())
        return self._observe(), reward, False, False, {}


def register() -> None:
    """Register ``conveyor/StepTime-v0`` with gymnasium (idempotent)."""
    if ENV_ID not in gym.registry:
        gym.register(ENV_ID, entry_point="conveyor.envs.step_time:StepTimeEnv", max_episode_steps=EPISODE_STEPS)
