"""Atari preprocessing as in Mnih et al. 2015 (and the PAAC/GA3C papers).

``make_atari(cfg)`` builds, from the inside out:

1. the ALE env with ``frameskip=1`` and the id's own sticky-action default
   (``ALE/*-v5``: ``repeat_action_probability=0.25``; ``*NoFrameskip-v4``: 0),
   unless ``env_args`` overrides it;
2. ``AtariFrames``: up to ``noop_max`` no-op frames after each reset, then
   ``frame_skip`` frames per action with the max of the last two frames,
   converted to 84x84 grayscale by area averaging;
3. ``RecordEpisodeStatistics``: the unclipped return and length (in agent
   steps) of each real game, reported as ``info[EPISODE_KEY]`` at its last step;
4. ``EpisodicLife`` (if ``cfg.episodic_life``): a lost life is terminal for
   learning, and the following ``reset()`` continues the same game;
5. reward clipping to the sign (if ``cfg.clip_rewards``);
6. a stack of the last ``frame_stack`` frames: observations are uint8
   ``[frame_stack, 84, 84]``, oldest first, channel-first.

Because 3 sits below 4 and 5, ``info["episode"]`` always describes the real
game with its real score, whatever the training reward and episode flags.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from conveyor.config import EnvCfg
from conveyor.errors import ConfigError
from conveyor.envs.gym_api import EPISODE_KEY, LIFE_CONTINUED_KEY, gym_make

SCREEN_SIZE = 84
NOOP_ACTION = 0  # index 0 of every ALE minimal action set is NOOP
# Keys make_atari sets itself; env_args may not override them.
_RESERVED_ARGS = {"frameskip": "frame_skip", "obs_type": "(grayscale is fixed)"}


def area_weights(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray]:
    """Area interpolation along one axis, as ``(index, weight)``, both ``[size_out, k]``.

    Output cell o averages the inputs its span ``[o, o + 1) * size_in / size_out``
    covers: ``out[o] = sum_j weight[o, j] * in[index[o, j]]``. Each cell
    covers at most k = ceil(scale) + 1 inputs (unused slots have weight 0).
    """
    scale = size_in / size_out
    width = int(np.ceil(scale)) + 1
    index = np.zeros((size_out, width), np.intp)
    weight = np.zeros((size_out, width), np.float32)
    for out in range(size_out):
        lo, hi = out * scale, (out + 1) * scale
        for slot, src in enumerate(range(int(lo), min(size_in, int(np.ceil(hi))))):
            index[out, slot] = src
            weight[out, slot] = (min(hi, src + 1) - max(lo, src)) / scale
    return index, weight


class AtariFrames(gym.Wrapper):
    """No-op starts, frame skip with a max over the last two frames, 84x84 grayscale.

    Expects an ALE env made with ``frameskip=1``. It is made with
    ``obs_type="ram"`` (the cheapest observation ALE builds): the screen is read
    straight from the emulator, and only for the two frames that are pooled.
    """

    def __init__(self, env: gym.Env, noop_max: int, frame_skip: int) -> None:
        super().__init__(env)
        self.noop_max = noop_max
        self.frame_skip = frame_skip
        self.ale = env.unwrapped.ale
        height, width = self.ale.getScreenDims()
        self._screens = np.zeros((2, height, width), np.uint8)
        self._pooled = np.zeros((height, width), np.uint8)
        self._row_index, self._row_weight = area_weights(height, SCREEN_SIZE)
        self._col_index, self._col_weight = area_weights(width, SCREEN_SIZE)
        self.observation_space = gym.spaces.Box(0, 255, (SCREEN_SIZE, SCREEN_SIZE), np.uint8)

    def _observe(self, screen: np.ndarray) -> np.ndarray:
        # Sparse weighted sums (einsum without BLAS): a BLAS matmul would spawn thread pools that
        # fight the env workers for cores, for no gain at this size.
        rows = np.einsum("ok,okw->ow", self._row_weight, screen[self._row_index])
        resized = np.einsum("pk,opk->op", self._col_weight, rows[:, self._col_index])
        resized += 0.5  # round to nearest on the truncating cast
        return resized.astype(np.uint8)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        _, info = self.env.reset(seed=seed, options=options)
        noops = int(self.np_random.integers(1, self.noop_max + 1)) if self.noop_max else 0
        for _ in range(noops):
            _, _, terminated, truncated, info = self.env.step(NOOP_ACTION)
            if terminated or truncated:
                _, info = self.env.reset()
        self.ale.getScreenGrayscale(self._screens[1])
        return self._observe(self._screens[1]), info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        total_reward = 0.0
        last = self.frame_skip - 1
        for frame in range(self.frame_skip):
            _, reward, terminated, truncated, info = self.env.step(action)
            total_reward += reward
            if terminated or truncated:
                break
            if frame == last - 1:
                self.ale.getScreenGrayscale(self._screens[0])
        self.ale.getScreenGrayscale(self._screens[1])
        if frame == last and self.frame_skip > 1:
            # Pool over the last two frames: some games draw sprites only on alternate frames.
            screen = np.maximum(self._screens[0], self._screens[1], out=self._pooled)
        else:  # the game ended before the second-to-last frame: only the final screen is current
            screen = self._screens[1]
        return self._observe(screen), total_reward, terminated, truncated, info


class EpisodicLife(gym.Wrapper):
    """A lost life ends the episode for learning; the next reset continues the game.

    ``reset()`` right after a lost life takes one no-op step instead of
    restarting the game (Mnih et al. 2015; baselines' EpisodicLifeEnv), whatever
    seed it is given, and says so with ``info[LIFE_CONTINUED_KEY] = True``. If that
    step ends the game, the game restarts (with the seed) and the step's
    ``info["episode"]`` is passed on in the reset info, so no real episode goes
    unreported.
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.ale = env.unwrapped.ale
        self.lives = 0
        self.life_lost = False

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        lives = self.ale.lives()
        self.life_lost = not (terminated or truncated) and 0 < lives < self.lives
        self.lives = lives
        return obs, reward, terminated or self.life_lost, truncated, info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        if self.life_lost:  # the seed is for the next real game (conveyor seeds every episode)
            obs, _, terminated, truncated, info = self.env.step(NOOP_ACTION)
            if terminated or truncated:
                obs, reset_info = self.env.reset(seed=seed, options=options)
                if EPISODE_KEY in info:
                    reset_info[EPISODE_KEY] = info[EPISODE_KEY]
                info = reset_info
            else:
                info[LIFE_CONTINUED_KEY] = True
        else:
            obs, info = self.env.reset(seed=seed, options=options)
        self.life_lost = False
        self.lives = self.ale.lives()
        return obs, info


def make_atari(cfg: EnvCfg) -> gym.Env:
    """The preprocessed Atari env of ``cfg`` (see the module docstring), not yet seeded."""
    import ale_py

    gym.register_envs(ale_py)
    kwargs = cfg.kwargs
    for key, knob in _RESERVED_ARGS.items():
        if key in kwargs:
            raise ConfigError(f"env_args {key} is set by conveyor for Atari: use {knob} instead")
    env = gym_make(cfg.id, {**kwargs, "frameskip": 1, "obs_type": "ram"})
    env = AtariFrames(env, cfg.noop_max, cfg.frame_skip)
    env = gym.wrappers.RecordEpisodeStatistics(env, stats_key=EPISODE_KEY)
    if cfg.episodic_life:
        env = EpisodicLife(env)
    if cfg.clip_rewards:
        env = gym.wrappers.TransformReward(env, np.sign)
    return gym.wrappers.FrameStackObservation(env, cfg.frame_stack)
