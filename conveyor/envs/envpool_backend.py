"""The ``envpool`` backend: envpool's C++ thread pool behind the ``StepResult`` API.

Supported ids: Atari (``ALE/Pong-v5``, ``PongNoFrameskip-v4`` -> envpool's
``Pong-v5``) and the gymnasium MuJoCo ids envpool implements
(``HalfCheetah-v5`` ...). Anything else, MinAtar included (envpool has no
MinAtar), raises ``ConfigError``: use the ``shm`` backend for it.

Atari is configured to match ``conveyor.envs.atari``: no-op starts up to
``noop_max``, ``frame_skip`` with max-pooling, 84x84 grayscale, a stack of
``frame_stack``, no fire-on-reset, the gymnasium id's sticky-action
probability (or ``env_args``'), a 108000-frame episode limit,
``episodic_life`` and reward clipping. The pixels are not bit-identical to
the shm backend's (envpool has its own resize), the semantics are.

Auto-reset: envpool resets a finished env on the *next* call, ignoring that
call's action. To give the same-step semantics of the ``shm`` backend, each
step that finishes episodes is followed at once by a call for just those
envs (envpool accepts a subset of env ids), whose result is the new
episodes' first observations; the finished episodes' last observations go
to ``final_obs``. Episode returns are summed here from envpool's unclipped
``info["reward"]`` (Atari) or the reward (MuJoCo), and reported when the
real game ends (``info["terminated"]`` or truncation), not at a lost life.
Env i gets envpool ``env_seed`` ``seed + i``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from conveyor.config import EnvCfg
from conveyor.errors import ConfigError
from conveyor.envs.atari import SCREEN_SIZE
from conveyor.envs.vector_api import InProcessBackend, StepResult

_ATARI_FRAMES_PER_EPISODE = 108_000  # ALE v5's max_num_frames_per_episode
# env_args the envpool Atari config understands under the same name as ALE's, with the type it insists on.
_ATARI_ARGS = {"repeat_action_probability": float, "full_action_space": bool, "mode": int, "difficulty": int}


def _atari_task(cfg: EnvCfg) -> tuple[str, dict[str, Any]]:
    import ale_py

    gym.register_envs(ale_py)
    try:
        defaults = gym.spec(cfg.id).kwargs
    except gym.error.Error:
        raise ConfigError(f"unknown env id {cfg.id!r}: use an Atari id such as ALE/Pong-v5") from None
    name = cfg.id.removeprefix("ALE/").rsplit("-v", 1)[0].removesuffix("NoFrameskip")
    args = cfg.kwargs
    unsupported = sorted(set(args) - set(_ATARI_ARGS) - {"max_num_frames_per_episode"})
    if unsupported:
        raise ConfigError(f"env_args {unsupported} are not supported by the envpool backend for Atari: "
                          f"use {', '.join(_ATARI_ARGS)}, or --env-backend shm")
    frames = int(args.get("max_num_frames_per_episode", defaults.get("max_num_frames_per_episode",
                                                                       _ATARI_FRAMES_PER_EPISODE)))
    options = {
        "noop_max": cfg.noop_max,
        "frame_skip": cfg.frame_skip,
        "stack_num": cfg.frame_stack,
        "img_height": SCREEN_SIZE,
        "img_width": SCREEN_SIZE,
        "gray_scale": True,
        "use_fire_reset": False,
        "episodic_life": cfg.episodic_life,
        "reward_clip": cfg.clip_rewards,
        "repeat_action_probability": float(defaults.get("repeat_action_probability", 0.0)),
        "max_episode_steps": frames // cfg.frame_skip,
    }
    options.update({key: kind(args[key]) for key, kind in _ATARI_ARGS.items() if key in args})
    return f"{name}-v5", options


def _task(cfg: EnvCfg) -> tuple[str, dict[str, Any], bool]:
    """envpool task id, its options, and whether it is Atari."""
    if cfg.is_minatar:
        raise ConfigError(f"env id {cfg.id!r} is not supported by the envpool backend (envpool has no MinAtar): "
                          "use --env-backend shm")
    import envpool

    if cfg.is_atari:
        task, options = _atari_task(cfg)
        if task in envpool.list_all_envs():
            return task, options, True
    elif envpool.registration.registry.specs.get(cfg.id, ("",))[0] == "envpool.mujoco.gym":
        return cfg.id, cfg.kwargs, False
    raise ConfigError(f"env id {cfg.id!r} is not supported by the envpool backend (Atari and MuJoCo only): "
                      "use --env-backend shm")


class EnvpoolVectorEnv(InProcessBackend):
    """``cfg.num_envs`` envs in one envpool (``cfg.num_workers`` threads), same API as ``ShmVectorEnv``."""

    def __init__(self, cfg: EnvCfg, seed: int, *, copy: bool = True, env_offset: int = 0) -> None:
        """``env_offset``: the global index of env 0 here (a data-parallel rank's share of the envs)."""
        import envpool

        super().__init__()
        task, options, self.is_atari = _task(cfg)
        batch = cfg.num_envs
        try:
            self._pool = envpool.make(task, env_type="gymnasium", num_envs=batch, batch_size=batch,
                                      num_threads=cfg.num_workers, seed=seed,
                                      env_seed=[seed + env_offset + i for i in range(batch)], **options)
        except (TypeError, ValueError, KeyError) as exc:
            raise ConfigError(f"envpool rejected {task!r} with {options}: {exc}") from None
        self.cfg = cfg
        self.num_envs = batch
        self.num_workers = cfg.num_workers
        self.copy = copy
        self.single_observation_space = self._pool.observation_space
        self.single_action_space = self._pool.action_space
        self._action_dtype = np.int32 if isinstance(self.single_action_space, gym.spaces.Discrete) else \
            self.single_action_space.dtype
        # restarted stays False: envpool's threads live in this process, nothing to restart
        self._views = StepResult.buffers(batch, self.single_observation_space)
        self._running_return = np.zeros(batch)
        self._running_length = np.zeros(batch, np.int64)
        self._reset_actions = np.zeros((batch, *self.single_action_space.shape), self._action_dtype)
        self._actions_shape = self._reset_actions.shape
        self.restarts = 0  # envpool's threads live in this process: nothing to restart
        self.history = None  # envpool cannot replay actions into a fresh env

    @property
    def env_errors(self) -> int:
        return 0  # envpool's C++ envs do not raise per step

    def reset(self) -> np.ndarray:
        self._check_open()
        obs, info = self._pool.reset()
        views = self._views
        views.obs[info["env_id"]] = obs
        self._running_return[:] = 0.0
        self._running_length[:] = 0
        return views.obs.copy() if self.copy else views.obs

    def _take(self, actions: Any) -> None:
        self._pool.send(np.asarray(actions, self._action_dtype))

    def _step(self) -> StepResult:
        obs, reward, terminated, truncated, info = self._pool.recv()
        ids = info["env_id"]
        views = self._views
        views.obs[ids] = obs
        views.reward[ids] = reward
        views.terminated[ids] = terminated
        views.truncated[ids] = truncated
        self._running_return[ids] += info["reward"] if self.is_atari else reward
        self._running_length[ids] += 1
        game_over = truncated | (info["terminated"].astype(bool) if self.is_atari else terminated)
        views.episode_return[:] = np.nan
        views.episode_length[:] = 0
        if game_over.any():
            over = ids[game_over]
            views.episode_return[over] = self._running_return[over]
            views.episode_length[over] = self._running_length[over]
            self._running_return[over] = 0.0
            self._running_length[over] = 0
        done = terminated | truncated
        if done.any():
            ended = ids[done]
            views.final_obs[ended] = obs[done]
            # envpool resets a finished env on its next call, ignoring the action: make that call now.
            self._pool.send(self._reset_actions[:len(ended)], ended)
            first_obs, *_, reset_info = self._pool.recv()
            views.obs[reset_info["env_id"]] = first_obs
        if self.copy:
            return StepResult(*(array.copy() for array in views))
        return views

    def _release(self) -> None:
        self._pool.close()
