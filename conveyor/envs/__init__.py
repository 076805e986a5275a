"""Environments: single envs, the synthetic step-time env, vectorized stepping.

- ``make_env(cfg, seed)``: one gymnasium env (Atari ids get the standard
  preprocessing, see ``conveyor.envs.atari``; MinAtar ids channel-first uint8
  frames, see ``conveyor.envs.minatar``); finished real episodes are
  reported as ``info[EPISODE_KEY]`` with the unclipped return.
- ``conveyor/StepTime-v0`` (registered on import): a learnable env whose
  step time follows a chosen distribution (``conveyor.envs.step_time``).
- ``conveyor/Memory-v0`` (registered on import): remember a cue across a
  delay; feed-forward policies cannot (``conveyor.envs.memory``).
- ``make_vector_env(cfg, seed)``: ``cfg.num_envs`` envs stepped together by
  shared-memory worker processes (``shm``), in the calling process (``inproc``;
  ``vector``: gymnasium's own vectorized env) or envpool; ``step`` returns a
  ``StepResult`` with auto-reset, ``final_obs`` and per-episode returns.
"""

from conveyor.envs.gym_api import EPISODE_KEY
from conveyor.envs.make import env_spaces, episode_seed, make_env
from conveyor.envs.memory import ENV_ID as MEMORY_ID
from conveyor.envs.memory import register as _register_memory
from conveyor.envs.step_time import ENV_ID as STEP_TIME_ID
from conveyor.envs.step_time import register as _register_step_time
from conveyor.envs.vector import ObsShapeError, ShmVectorEnv, make_vector_env
from conveyor.envs.vector_api import StepResult, VectorEnv

_register_step_time()
_register_memory()

__all__ = ["make_env", "env_spaces", "episode_seed", "make_vector_env", "VectorEnv", "StepResult", "ObsShapeError", "ShmVectorEnv",
           "EPISODE_KEY", "STEP_TIME_ID", "MEMORY_ID"]
