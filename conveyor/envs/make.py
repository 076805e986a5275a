"""``make_env``: one seeded gymnasium env from an ``EnvCfg``.

Every env made here reports each finished real episode through its step
info: ``info[EPISODE_KEY] = {"r": unclipped return, "l": length in agent
steps, "t": seconds}`` at the episode's last step (gymnasium's
``RecordEpisodeStatistics``, placed below any reward clipping and episodic
life). Training code reads returns from there, never by summing the
training reward, which may be clipped or normalized.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from conveyor.config import EnvCfg
from conveyor.envs.atari import make_atari
from conveyor.envs.check import check_env_api
from conveyor.envs.gym_api import EPISODE_KEY, gym_make
from conveyor.envs.minatar import make_minatar

NORMALIZED_REWARD_CLIP = 10.0
"""``normalize_reward`` clips the scaled training reward to [-10, 10] (as SB3's ``VecNormalize``)."""


def make_env(cfg: EnvCfg, seed: int, gamma: float | None = None) -> gym.Env:
    """One env for ``cfg.id`` (any gymnasium id; Atari ids get the standard preprocessing, MinAtar ids
    channel-first uint8 frames: ``conveyor.envs.atari``, ``conveyor.envs.minatar``).

    The env comes back already reset once with ``seed``, which fixes all of
    its random streams (dynamics, no-op starts, sticky actions); call
    ``reset()`` without a seed to start each episode. ``cfg.env_args`` go to
    the env's constructor. Unknown ids raise ``ConfigError``.

    With ``cfg.normalize_reward`` and the run's discount ``gamma``, the
    training reward is divided by the running std of this env's
    ``gamma``-discounted return and clipped to +-``NORMALIZED_REWARD_CLIP``
    (gymnasium's ``NormalizeReward``, outside the episode statistics, so
    returns stay in env units). The statistics live in the env: they start
    afresh when its worker restarts or a run resumes. Without ``gamma``
    (evaluation, which reads only episode statistics) rewards are left as
    they are.
    """
    if cfg.is_atari:
        env = make_atari(cfg)
    elif cfg.is_minatar:
        env = make_minatar(cfg)
    else:
        env = gym.wrappers.RecordEpisodeStatistics(gym_make(cfg.id, cfg.kwargs), stats_key=EPISODE_KEY)
    if cfg.normalize_reward and gamma is not None:
        env = gym.wrappers.ClipReward(gym.wrappers.NormalizeReward(env, gamma),
                                      -NORMALIZED_REWARD_CLIP, NORMALIZED_REWARD_CLIP)
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return env


def episode_seed(seed: int, env: int, episode: int) -> int:
    """The seed that starts episode ``episode`` of env ``env`` of a run seeded ``seed`` (a 32-bit hash of all three).

    Seeding every episode makes an env's state a function of (episode, actions since its reset): a restarted
    worker re-seeds its envs from their episode counters, and a resumed run rebuilds them by replaying actions.
    """
    return int(np.random.SeedSequence([seed, env, episode]).generate_state(1)[0])


def env_spaces(cfg: EnvCfg, seed: int) -> tuple[gym.Space, gym.Space]:
    """The (observation, action) spaces of ``cfg.id`` after our preprocessing, from a throwaway env. Every run
    reads them before it starts a worker, so this is where an env that breaks the API is refused, in one line
    (``conveyor.envs.check``)."""
    check_env_api(cfg, seed)
    probe = make_env(cfg, seed)
    try:
        return probe.observation_space, probe.action_space
    finally:
        probe.close()
