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
        # Steps since the oldest running game began, one [B] row each (a row per step keeps ``record`` cheap:
        # it runs every step). An env's game began at step _game_start[env]; _first is the number of _steps[0].
        self._actions: list[np.ndarray] = []
        self._done: list[np.ndarray] = []
        self._game_start = np.zeros(num_envs, np.int64)
        self._first = 0
        # Per env, the part of its game recorded before a resume (``from_state``), until the game ends.
        self._restored: list[tuple[list, list]] = [([], [])] * num_envs

    def start_games(self, envs: Any) -> None:
        """``envs`` (indices or a [B] mask) were reset with a seed: each starts a new game now."""
        self._begin(np.arange(self.num_envs)[envs], self.next_episode[envs])
        self.next_episode[envs] += 1

    def record(self, actions: np.ndarray, done: np.ndarray, new_game: np.ndarray) -> None:
        """One step of every env: ``actions [B, ...]`` (copied); ``done [B]`` bool, the episode ended and the env
        was reset (kept: do not modify it afterwards); ``new_game [B]`` that reset was a seeded one, not a
        continued game (read only where ``done``)."""
        self._actions.append(actions.copy())
        self._done.append(done)
        if done.any():
            self.next_episode += done
            started = done & new_game
            if started.any():
                self._begin(np.flatnonzero(started), self.next_episode[started] - 1)

    def _begin(self, envs: np.ndarray, episodes: np.ndarray) -> None:
        self.game_episode[envs] = episodes
        self._game_start[envs] = self._first + len(self._actions)
        for env in envs.tolist():
            self._restored[env] = ([], [])
        drop = int(self._game_start.min()) - self._first
        if drop > 0:  # no running game needs those steps any more
            del self._actions[:drop], self._done[:drop]
            self._first += drop

    def replay_plan(self) -> list[Replay]:
        """Per env, the ``Replay`` that rebuilds its current state."""
        plans = []
        for env in range(self.num_envs):
            steps = slice(int(self._game_start[env]) - self._first, None)
            actions, boundaries = self._restored[env]
            plans.append(Replay(int(self.game_episode[env]),
                                actions + [row[env].tolist() for row in self._actions[steps]],
                                boundaries + [bool(row[env]) for row in self._done[steps]]))
        return plans

    # ---- checkpoints ---------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        import torch  # here: env worker processes import this module and never need torch

        plans = self.replay_plan()
        return {
            "next_episode": torch.from_numpy(self.next_episode.copy()),
            "game_episode": torch.from_numpy(self.game_episode.copy()),
            "actions": [torch.as_tensor(plan.actions) for plan in plans],
            "boundaries": [torch.as_tensor(plan.boundaries, dtype=torch.bool) for plan in plans],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "EnvHistory":
        next_episode = state["next_episode"].numpy()
        history = cls(len(next_episode))
        history.next_episode[:] = next_episode
        history.game_episode[:] = state["game_episode"].numpy()
        history._restored = [(actions.tolist(), bounds.tolist())
                             for actions, bounds in zip(state["actions"], state["boundaries"])]
        return history
