"""``check_env_api``: refuse, at start and in one line, an env that breaks the API conveyor steps envs through.

``env_spaces`` runs it once per process and env (id and ``env_args``) on a
throwaway env, before any worker starts, so a broken env is refused with a
``ConfigError`` naming the rule (exit code 2) instead of failing later, deep
in a worker. It builds the env as the run would (``gym_make``), but without
gymnasium's ``PassiveEnvChecker`` (whose warnings would be more lines), and
checks the env the registered entry point made (inside the ``TimeLimit`` and
``OrderEnforcing`` wrappers ``gymnasium.make`` adds, which would hide a wrong
return value behind an unpacking error):

1. the observation space is a ``Box`` (conveyor's models read one array);
2. the action space is a ``Discrete`` starting at 0 or a 1-D ``Box``;
3. ``reset(seed=...)`` returns ``(obs, info)``, ``info`` a dict;
4. ``step(action)`` returns ``(obs, reward, terminated, truncated, info)``: five values, reward a number,
   terminated and truncated bools, ``info`` a dict;
5. every observation is a numpy array of the observation space's dtype and shape.

It resets the env once and takes ``PROBE_STEPS`` random steps (resetting
where an episode ends), in a thread the run waits for a bounded time (an env
that hangs there is left to the workers' ``--env-step-timeout-s``). Unlike
``gymnasium.utils.env_checker`` it does not warn about style: it refuses what
would break a run, and lets the rest pass (observations outside the space's
bounds, say). Atari and MinAtar ids are skipped: conveyor builds those with
its own wrappers.
"""

from __future__ import annotations

import numbers
import sys
import threading
import traceback
import warnings
from typing import Any

import gymnasium as gym
import numpy as np

from conveyor.config import EnvCfg
from conveyor.envs.gym_api import gym_make
from conveyor.errors import ConfigError, WorkerFailure, error_line

PROBE_STEPS = 3
"""Random steps the check takes (after one reset)."""
PROBE_TIMEOUT_S = 5.0
"""How long a run waits for the check (see ``check_env_api``)."""
_MAKE_WRAPPERS = (gym.wrappers.TimeLimit, gym.wrappers.OrderEnforcing, gym.wrappers.PassiveEnvChecker)
_checked: set[tuple[str, str]] = set()


def _refuse(env_id: str, rule: str, found: str) -> ConfigError:
    return ConfigError(f"env {env_id!r} breaks conveyor's env API: {rule}, but {found}")


def check_spaces(env_id: str, observation_space: Any, action_space: Any) -> None:
    """Rules 1 and 2 (see the module docstring)."""
    if not isinstance(observation_space, gym.spaces.Box):
        flattens = (gym.spaces.Dict, gym.spaces.Tuple, gym.spaces.Discrete, gym.spaces.MultiDiscrete,
                    gym.spaces.MultiBinary)
        fix = " (flatten it: gymnasium.wrappers.FlattenObservation)" if isinstance(observation_space, flattens) else ""
        raise _refuse(env_id, "the observation space must be a Box", f"it is {observation_space!r}{fix}")
    if isinstance(action_space, gym.spaces.Discrete):
        if int(action_space.start) != 0:
            raise _refuse(env_id, "a Discrete action space must start at 0", f"it is {action_space!r}")
    elif not (isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1):
        raise _refuse(env_id, "the action space must be Discrete or a 1-D Box", f"it is {action_space!r}")


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of dtype {value.dtype} and shape {value.shape}"
    return f"a {type(value).__name__}"


def _check_obs(env_id: str, space: gym.spaces.Box, obs: Any, call: str) -> None:
    if not isinstance(obs, np.ndarray) or obs.dtype != space.dtype or obs.shape != space.shape:
        raise _refuse(env_id, f"observations must be numpy arrays of the observation space's dtype and shape "
                      f"({space.dtype}, {space.shape})", f"{call} returned {_describe(obs)}")


def _check_reset(env_id: str, env: gym.Env, space: gym.spaces.Box, seed: int | None) -> None:
    result = env.reset(seed=seed)
    if not (isinstance(result, tuple) and len(result) == 2):
        found = f"a tuple of {len(result)} values" if isinstance(result, tuple) else _describe(result)
        raise _refuse(env_id, "reset() must return (obs, info)", f"it returned {found}")
    obs, info = result
    _check_obs(env_id, space, obs, "reset()")
    if not isinstance(info, dict):
        raise _refuse(env_id, "reset() must return (obs, info) with info a dict", f"info is {_describe(info)}")


def _check_step(env_id: str, env: gym.Env, space: gym.spaces.Box, action: Any) -> bool:
    """One step; whether the episode ended."""
    result = env.step(action)
    rule = "step() must return (obs, reward, terminated, truncated, info)"
    if isinstance(result, tuple) and len(result) == 4:
        raise _refuse(env_id, rule, "it returned 4 values, the old gym API's (obs, reward, done, info): split done "
                      "into terminated and truncated")
    if not (isinstance(result, tuple) and len(result) == 5):
        found = f"a tuple of {len(result)} values" if isinstance(result, tuple) else _describe(result)
        raise _refuse(env_id, rule, f"it returned {found}")
    obs, reward, terminated, truncated, info = result
    _check_obs(env_id, space, obs, "step()")
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, (numbers.Real, np.integer, np.floating)):
        raise _refuse(env_id, f"{rule}, reward a number", f"reward is {_describe(reward)}")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, (bool, np.bool_)):
            raise _refuse(env_id, f"{rule}, {name} a bool", f"{name} is {_describe(flag)}")
    if not isinstance(info, dict):
        raise _refuse(env_id, f"{rule}, info a dict", f"info is {_describe(info)}")
    return bool(terminated or truncated)


def entry_env(env: gym.Env) -> gym.Env:
    """The env the registered entry point made: ``env`` without the wrappers ``gymnasium.make`` adds."""
    while isinstance(env, _MAKE_WRAPPERS):
        env = env.env
    return env


def _probe(cfg: EnvCfg, seed: int) -> None:
    env = gym_make(cfg.id, cfg.kwargs, disable_env_checker=True)
    try:
        check_spaces(cfg.id, env.observation_space, env.action_space)
        inner = entry_env(env)
        space = inner.observation_space
        inner.action_space.seed(seed)
        _check_reset(cfg.id, inner, space, seed)
        for _ in range(PROBE_STEPS):
            if _check_step(cfg.id, inner, space, inner.action_space.sample()):
                _check_reset(cfg.id, inner, space, None)
    finally:
        env.close()


def check_env_api(cfg: EnvCfg, seed: int) -> None:
    """Refuse ``cfg.id`` with a one-line ``ConfigError`` if its env breaks a rule of the module docstring; a no-op
    for Atari and MinAtar ids and for an env (id and ``env_args``) this process has checked already.

    The env is probed in a thread of its own, waited for up to ``PROBE_TIMEOUT_S``: an env that hangs in its
    first calls cannot hang the run here, where no worker timeout guards it. It is left to its thread, one
    warning line says so, and the workers' timeout (``--env-step-timeout-s``) takes over (an env that is merely
    that slow to make starts unchecked). The env's own exceptions become a ``WorkerFailure`` naming the env and
    the exception's last line (its traceback in ``details``).
    """
    key = (cfg.id, repr(cfg.env_args))
    if cfg.is_atari or cfg.is_minatar or key in _checked:
        return
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            _probe(cfg, seed)
            outcome.append(None)
        except ConfigError as refusal:
            outcome.append(refusal)
        except BaseException as error:  # the env's own: one line naming it, the traceback for the run's errors.log
            outcome.append(WorkerFailure(f"env {cfg.id!r} raised during the start-up check of its API: "
                                         f"{error_line(error)}", "".join(traceback.format_exception(error))))

    limit = PROBE_TIMEOUT_S
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one line of a refusal says what is wrong
        thread = threading.Thread(target=probe, name="conveyor-env-check", daemon=True)
        thread.start()
        thread.join(limit)
    if not outcome:
        print(f"conveyor: warning: env {cfg.id!r} took longer than {limit:g} s to be made, reset and stepped "
              f"{PROBE_STEPS} times; starting without checking its API", file=sys.stderr, flush=True)
        return
    if outcome[0] is not None:
        raise outcome[0]
    _checked.add(key)
