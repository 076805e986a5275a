"""What every vector env backend (``conveyor.envs.vector.ShmVectorEnv``, ``conveyor.envs.inproc``,
``conveyor.envs.envpool_backend``, ``conveyor.envs.native_vector``) returns, offers and raises: ``StepResult``,
the ``VectorEnv`` protocol, ``ObsShapeError``."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import gymnasium as gym
import numpy as np

from conveyor.errors import WorkerFailure


class ObsShapeError(WorkerFailure):
    """An env returned an observation whose shape differs from the one it started with."""


class StepResult(NamedTuple):
    """One step of B envs. Rows are envs; every field is a numpy array.

    When env i's episode ends at this step (``terminated[i] | truncated[i]``),
    the env has already been reset: ``obs[i]`` is the new episode's first
    observation and ``final_obs[i]`` the finished episode's last one (needed
    to bootstrap a truncated episode). ``final_obs`` rows of envs that did not
    finish hold stale data.
    """

    obs: np.ndarray
    """[B, *obs_shape] the observation to act on next."""
    reward: np.ndarray
    """[B] float32 training reward (clipped to its sign for Atari when ``clip_rewards``)."""
    terminated: np.ndarray
    """[B] bool: the episode reached a terminal state (for Atari with ``episodic_life``: also a lost life)."""
    truncated: np.ndarray
    """[B] bool: the episode was cut (time limit, or the env raised and was reset); bootstrap from ``final_obs``."""
    final_obs: np.ndarray
    """[B, *obs_shape] last observation of the finished episode, valid where ``terminated | truncated``."""
    episode_return: np.ndarray
    """[B] float64 unclipped return of a real episode that ended at this step, NaN elsewhere."""
    episode_length: np.ndarray
    """[B] int64 length in agent steps of that episode, 0 elsewhere."""
    restarted: np.ndarray
    """[B] bool: env i's worker died during this step and was restarted: the transition is lost, ``obs[i]``
    starts a new episode and no other field of row i is meaningful."""

    @classmethod
    def buffers(cls, batch: int, obs_space: gym.Space) -> StepResult:
        """Zeroed arrays for ``batch`` envs of ``obs_space`` (``episode_return`` NaN: no episode ended), which a
        backend that steps in this process fills step after step."""
        shape, dtype = obs_space.shape, obs_space.dtype
        return cls(obs=np.zeros((batch, *shape), dtype), reward=np.zeros(batch, np.float32),
                   terminated=np.zeros(batch, bool), truncated=np.zeros(batch, bool),
                   final_obs=np.zeros((batch, *shape), dtype), episode_return=np.full(batch, np.nan),
                   episode_length=np.zeros(batch, np.int64), restarted=np.zeros(batch, bool))



class EnvRecord(Protocol):
    """What a checkpoint keeps of a vector env's envs to rebuild them (``EnvHistory``, ``NativeEnvRecord``)."""

    def state(self) -> dict[str, Any]: ...


class InProcessBackend:
    """The stepping discipline of the backends whose envs step in this process (``InProcessVectorEnv``,
    ``NativeVectorEnv``, ``EnvpoolVectorEnv``): ``step_async`` checks and takes the actions, ``step_wait`` steps
    them, ``close`` is idempotent. A subclass sets ``_actions_shape`` and implements ``_take(actions)``,
    ``_step() -> StepResult`` and ``_release()``."""

    _actions_shape: tuple[int, ...]

    def __init__(self) -> None:
        self._stepping = False
        self._closed = False

    def step_async(self, actions: Any) -> None:
        """Take ``actions`` ``[B, *action_shape]``; the envs step in ``step_wait``."""
        self._check_open()
        if self._stepping:
            raise RuntimeError("step_async() called twice: call step_wait() before the next step_async()")
        if np.shape(actions) != self._actions_shape:
            raise ValueError(f"actions have shape {np.shape(actions)}, expected {self._actions_shape}")
        self._take(actions)
        self._stepping = True

    def step_wait(self) -> StepResult:
        """Step every env with the actions of ``step_async``; the ``StepResult``."""
        if not self._stepping:
            raise RuntimeError("step_wait() called without step_async()")
        self._stepping = False
        return self._step()

    def step(self, actions: Any) -> StepResult:
        self.step_async(actions)
        return self.step_wait()

    def close(self) -> None:
        """Close the envs (idempotent)."""
        if not self._closed:
            self._closed = True
            self._release()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("vector env unusable: the vector env is closed")

    def _take(self, actions: Any) -> None:
        raise NotImplementedError

    def _step(self) -> StepResult:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError


class VectorEnv(Protocol):
    """What every backend offers (``ShmVectorEnv``, ``InProcessVectorEnv``, ``EnvpoolVectorEnv``,
    ``NativeVectorEnv``)."""

    num_envs: int
    single_observation_space: gym.Space
    single_action_space: gym.Space
    restarts: int
    """Dead workers replaced so far."""
    history: EnvRecord | None
    """How to rebuild every env: ``history.state()`` is a checkpoint's ``env_state`` (None when the backend
    cannot)."""

    def reset(self) -> np.ndarray: ...

    def step_async(self, actions: Any) -> None: ...

    def step_wait(self) -> StepResult: ...

    def step(self, actions: Any) -> StepResult: ...

    def close(self) -> None: ...
