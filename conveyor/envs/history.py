"""``EnvHistory``: what a run remembers to rebuild its envs exactly, without pickling them.

conveyor seeds every episode: episode k of global env i starts with
``reset(seed=episode_seed(seed, i, k))`` (``EnvWorker``). An env's state is
then a function of the episode that began its current *game* with a seeded
reset and the actions taken since, plus the episode boundaries in between
(an Atari lost life ends an episode for learning, but the next reset continues
the game: ``LIFE_CONTINUED_KEY``). ``EnvHistory`` records exactly that, one
step of all envs at a time, keeping only the steps of games still running.

A checkpoint stores ``state()`` (tensors and lists: loadable with
``weights_only=True``); a resumed run hands ``replay_plan()`` to its env
workers, which re-seed each env and replay its actions, and arrive where the
interrupted run stopped, down to the RNG of sticky actions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class Replay(NamedTuple):
    """How to rebuild one env: seeded reset with ``game_episode``, then each action; after action j, when
    ``boundaries[j]``, the episode ended and a reset continued the game."""

    game_episode: int
    actions: list
    boundaries: list


class EnvHistory:
    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.next_episode = np.zeros(num_envs, np.int64)
        """[B] index of the episode each env's next reset starts (the worker's counter, mirrored)."""
        self.game_episode = np.full(num_envs, -1, np.int64)
        """[B] index of the seeded reset that began each env's current game (-1: not started)."""
        self._actions: list[list] = [[] for _ in range(num_envs)]  # per env, since its game began
        self._boundaries: list[list[bool]] = [[] for _ in range(num_envs)]

    def start_games(self, envs: Any) -> None:
        """``envs`` (indices or a [B] mask) were reset with a seed: each starts a new game now."""
        for env in np.arange(self.num_envs)[envs].tolist():
            self.game_episode[env] = self.next_episode[env]
            self.next_episode[env] += 1
            self._actions[env], self._boundaries[env] = [], []

    def record(self, actions: np.ndarray, done: np.ndarray, new_game: np.ndarray) -> None:
        """One step of every env: ``actions [B, ...]``; ``done [B]`` the episode ended and the env was reset;
        ``new_game [B]`` that reset was a seeded one (not a continued game)."""
        done = np.asarray(done, bool)
        for env, (action, ended) in enumerate(zip(np.asarray(actions).tolist(), done.tolist())):
            self._actions[env].append(action)
            self._boundaries[env].append(ended)
        self.next_episode += done
        for env in np.flatnonzero(done & np.asarray(new_game, bool)).tolist():
            self.game_episode[env] = self.next_episode[env] - 1
            self._actions[env], self._boundaries[env] = [], []

    def replay_plan(self) -> list[Replay]:
        """Per env, the ``Replay`` that rebuilds its current state."""
        return [Replay(int(self.game_episode[env]), list(self._actions[env]), list(self._boundaries[env]))
                for env in range(self.num_envs)]

    # ---- checkpoints ---------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        import torch  # here: env worker processes import this module and never need torch

        return {
            "next_episode": torch.from_numpy(self.next_episode.copy()),
            "game_episode": torch.from_numpy(self.game_episode.copy()),
            "actions": [torch.as_tensor(actions) for actions in self._actions],
            "boundaries": [torch.as_tensor(bounds, dtype=torch.bool) for bounds in self._boundaries],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "EnvHistory":
        next_episode = state["next_episode"].numpy()
        history = cls(len(next_episode))
        history.next_episode[:] = next_episode
        history.game_episode[:] = state["game_episode"].numpy()
        history._actions = [actions.tolist() for actions in state["actions"]]
        history._boundaries = [bounds.tolist() for bounds in state["boundaries"]]
        return history
