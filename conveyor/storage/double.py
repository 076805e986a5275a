"""HTS-RL double storage: two ``[alpha, B]`` rollout storages, one filled while the learner reads the other.

Actors write each env's transitions into the *filling* storage in whatever
order envs are served: ``write_actions`` (obs, action, behaviour log-prob
and value, policy version at step ``t``), ``write_results`` (reward,
discount and finished-episode return of step ``t``) and, last for each env,
``write_last`` (the bootstrap observation ``obs[alpha]`` and its value).
When every env has written its last step the storage is full; ``swap``
then checks that every transition was written exactly once, hands the
full storage out for learning and makes a fresh, marker-filled one the
filling storage (the one the learner finished with is dropped). Writers
touch disjoint ``(t, env)`` cells, so only the write counts take a lock.
The storages live in host memory and writes go through numpy views of
their tensors (a handful of rows per call: a numpy fancy assignment costs
a microsecond, a torch ``index_put_`` several); the learner moves the full
storage to its device in one copy at the swap.
``forget`` voids some envs' cells of the filling storage (their executor
died mid-round and its successor writes them again).
"""

from __future__ import annotations

import threading
from typing import Callable, NamedTuple, Union

import numpy as np
import torch
from torch import Tensor

from conveyor.storage.rollout import RolloutStorage

ArrayLike = Union[np.ndarray, Tensor]
"""Values to write: numpy arrays or CPU tensors."""


class Round(NamedTuple):
    """A full storage and what the learner's bookkeeping needs of its steps, ``[T, B]`` numpy each."""

    storage: RolloutStorage
    episode_returns: np.ndarray
    """Unclipped return of the episode that ended at step t of env b, NaN elsewhere."""
    episode_ends: np.ndarray
    """Whether env b's episode ended at step t (and the env was reset)."""
    new_games: np.ndarray
    """Whether that reset started a new game with a seed (``EnvHistory.record``)."""


class DoubleStorage:
    def __init__(self, new_storage: Callable[[], RolloutStorage]):
        """``new_storage()`` makes one marker-filled ``RolloutStorage`` of ``T`` steps and ``B`` envs, on the
        CPU."""
        self._new_storage = new_storage
        self._fill(new_storage())
        self.T, self.B, self.device = self.filling.T, self.filling.B, self.filling.rewards.device
        self._lock = threading.Condition()
        self._reset_counts()

    def _fill(self, storage: RolloutStorage) -> None:
        if storage.rewards.device.type != "cpu":
            raise ValueError(f"HTS storages live in host memory, got one on {storage.rewards.device}")
        self.filling = storage
        self._arrays = {name: tensor.numpy() for name, tensor in storage.data.items()}

    def _reset_counts(self) -> None:
        self._action_writes = np.zeros((self.T, self.B), np.int64)
        self._result_writes = np.zeros((self.T, self.B), np.int64)
        self._last_writes = np.zeros(self.B, np.int64)
        self.episode_returns = np.full((self.T, self.B), np.nan)
        self.episode_ends = np.zeros((self.T, self.B), bool)
        self.new_games = np.zeros((self.T, self.B), bool)

    def write_actions(self, t: np.ndarray, env: np.ndarray, obs: ArrayLike, actions: ArrayLike, logp: ArrayLike,
                      value: ArrayLike, version: int) -> None:
        """Step ``t[i]`` of env ``env[i]``: what the actor saw and chose (arrays or CPU tensors, cast to the
        fields' dtypes)."""
        a = self._arrays
        a["obs"][t, env] = obs
        a["actions"][t, env] = actions
        a["behaviour_logp"][t, env] = logp
        a["behaviour_value"][t, env] = value
        a["policy_version"][t, env] = version
        with self._lock:
            np.add.at(self._action_writes, (t, env), 1)

    def write_results(self, t: np.ndarray, env: np.ndarray, rewards: ArrayLike, discounts: ArrayLike,
                      episode_returns: np.ndarray, episode_ends: np.ndarray, new_games: np.ndarray) -> None:
        """The training reward and discount of step ``t[i]`` of env ``env[i]`` (truncation folded in), and
        the ``Round`` fields of that step."""
        a = self._arrays
        a["rewards"][t, env] = rewards
        a["discounts"][t, env] = discounts
        with self._lock:
            self.episode_returns[t, env] = episode_returns
            self.episode_ends[t, env] = episode_ends
            self.new_games[t, env] = new_games
            np.add.at(self._result_writes, (t, env), 1)

    def write_last(self, env: np.ndarray, obs: ArrayLike, value: ArrayLike) -> None:
        """The bootstrap observation ``obs[T]`` of ``env`` and its behaviour value: the env's round is done."""
        a = self._arrays
        a["obs"][self.T, env] = obs
        a["behaviour_value"][self.T, env] = value
        with self._lock:
            np.add.at(self._last_writes, env, 1)
            if self._last_writes.sum() >= self.B:
                self._lock.notify_all()

    def wait_full(self, timeout_s: float) -> bool:
        """Whether every env wrote its last step (waits up to ``timeout_s``)."""
        with self._lock:
            return self._lock.wait_for(lambda: self._last_writes.sum() >= self.B, timeout_s)

    def forget(self, envs: np.ndarray) -> int:
        """Void every cell of ``envs`` in the filling storage, to be written again; returns how many
        transitions (steps with their result) were dropped. Call while no writer runs."""
        with self._lock:
            dropped = int(self._result_writes[:, envs].sum())
            self.filling.unwrite(torch.as_tensor(envs, dtype=torch.int64))
            for counts in (self._action_writes, self._result_writes):
                counts[:, envs] = 0
            self._last_writes[envs] = 0
            self.episode_returns[:, envs] = np.nan
            self.episode_ends[:, envs] = self.new_games[:, envs] = False
        return dropped

    def swap(self) -> Round:
        """The full ``Round``; a fresh storage starts filling.

        Raises ``RuntimeError`` when a transition is missing or was written twice.
        """
        with self._lock:
            for name, counts in (("actions", self._action_writes), ("results", self._result_writes),
                                 ("bootstrap observations", self._last_writes)):
                if (counts != 1).any():
                    bad = np.argwhere(counts != 1)[0].tolist()
                    raise RuntimeError(f"HTS storage swap: {name} at (step, env) {bad} written "
                                       f"{counts[tuple(bad)]} times instead of once")
            full = Round(self.filling, self.episode_returns, self.episode_ends, self.new_games)
            self._fill(self._new_storage())
            self._reset_counts()
        return full
