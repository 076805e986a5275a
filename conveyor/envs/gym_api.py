"""What every env maker here (``make``, ``atari``) shares with gymnasium: ``gym_make``, ``registered_spec``, and
the info keys through which our envs report finished episodes and continued games; and ``env_family``, the preset
family of any id, for what builds configs above the env layer (a config builds no env: ``conveyor train`` passes it
in as ``EnvCfg.family``, and so may a Python caller, ``EnvCfg(id=ID, family=env_family(ID))``).

Env ids: any id gymnasium knows; ``MODULE:ID`` first imports ``MODULE`` (which registers ``ID``) through
``conveyor.imports``, so a failing import is one line in every process that builds the env; an id whose
namespace (``NS/Name-v0``) is unknown loads the ``gymnasium.envs`` entry point named ``NS`` of an installed
package (the plugin scheme of gym 0.26, which gymnasium 1.x no longer runs by itself). The id stays as the
user typed it in the config, so a resumed run or a SEED actor on another host rebuilds the same env.
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import parse_env_id

from conveyor.errors import ConfigError
from conveyor.imports import import_module
from conveyor.presets import id_family

EPISODE_KEY = "episode"
"""Info key of a finished real episode's statistics (``r`` return, ``l`` length)."""
LIFE_CONTINUED_KEY = "life_continued"
"""Reset-info key set (True) when a reset continued the game instead of starting one (Atari episodic life):
the game's state then depends on the actions before the reset too."""
PLUGIN_GROUP = "gymnasium.envs"
"""Entry-point group through which installed packages offer to register their envs (name: the id namespace)."""

_ID_HINT = "use a gymnasium id such as CartPole-v1, ALE/Pong-v5 or HalfCheetah-v5, or MODULE:ID for your own env"

MUJOCO_ASSET_WARNINGS = ("compiler attribute 'settotalmass' is deprecated",)
"""Starts of MuJoCo warnings about gymnasium's own model files (MuJoCo 4 deprecates an attribute that
``half_cheetah.xml`` sets): nothing a user can fix, printed by every process that builds the env; dropped."""


_plugins_loaded: set[str] = set()


def _load_plugin(env_id: str) -> None:
    """Run the ``gymnasium.envs`` entry points named after ``env_id``'s namespace, once per process, if no id of
    that namespace is registered yet (a plugin that registered its ids is never run again: gymnasium would warn
    about every id it registers twice)."""
    if env_id in gym.registry:
        return
    try:
        namespace = parse_env_id(env_id)[0]
    except gym.error.Error:
        return
    if namespace is None or namespace in _plugins_loaded or any(
            spec.namespace == namespace for spec in gym.registry.values()):
        return
    _plugins_loaded.add(namespace)
    for point in metadata.entry_points(group=PLUGIN_GROUP):
        if point.name != namespace:
            continue
        what = f"--env {env_id!r} (entry point {point.name} = {point.value} of group {PLUGIN_GROUP})"
        try:
            register = point.load()
        except Exception as error:
            import_module(point.module, what)  # the one-line error of a failing import
            raise ConfigError(f"{what} cannot be loaded ({error}): fix or reinstall that package") from None
        try:
            if callable(register):
                register()
        except Exception as error:
            raise ConfigError(f"{what} raised {type(error).__name__}: {error}: fix or reinstall that package") from None


def _split(env_id: str) -> tuple[str | None, str]:
    """(module, id) of ``MODULE:ID``; (None, id) of a plain id."""
    module, sep, name = env_id.rpartition(":")
    return (module, name) if sep else (None, env_id)


def _prepare(env_id: str) -> None:
    """Import the module of a ``MODULE:ID`` id, or run the plugin of its namespace: whatever registers it."""
    module, name = _split(env_id)
    if module is not None:
        import_module(module, f"--env {env_id!r}")
    else:
        _load_plugin(name)


def entry_module(spec: gym.envs.registration.EnvSpec | None) -> str:
    """The module of ``spec``'s entry point (``"gymnasium.envs.mujoco.half_cheetah_v5"``); "" without one."""
    entry = spec.entry_point if spec is not None else ""
    return entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "")


def _print_mujoco_warning(message: str) -> None:
    if not message.startswith(MUJOCO_ASSET_WARNINGS):
        print(f"MuJoCo warning: {message}", file=sys.stderr, flush=True)


_mujoco_warnings_routed = False


def _route_mujoco_warnings(env_id: str) -> None:
    """Before this process builds its first MuJoCo env: MuJoCo's warnings go through ``_print_mujoco_warning``,
    which drops ``MUJOCO_ASSET_WARNINGS``."""
    global _mujoco_warnings_routed
    if _mujoco_warnings_routed or "mujoco" not in entry_module(registered_spec(env_id)).split("."):
        return
    try:
        import mujoco
    except ImportError:  # gymnasium.make then names the missing package and its install command
        return
    mujoco.set_mju_user_warning(_print_mujoco_warning)
    _mujoco_warnings_routed = True


def registered_spec(env_id: str) -> gym.envs.registration.EnvSpec | None:
    """The registered ``EnvSpec`` of ``env_id`` (``MODULE:ID`` too), or None when there is none."""
    try:
        _prepare(env_id)
        return gym.spec(_split(env_id)[1])
    except (gym.error.Error, ConfigError):
        return None


def gym_make(env_id: str, kwargs: dict[str, Any], **make_kwargs: Any) -> gym.Env:
    """``gymnasium.make(env_id, **make_kwargs, **kwargs)`` whose id, import and keyword mistakes raise
    ``ConfigError`` (``kwargs``: the env's own constructor arguments, ``env_args``)."""
    _prepare(env_id)
    _route_mujoco_warnings(env_id)
    try:
        return gym.make(env_id, **make_kwargs, **kwargs)
    except gym.error.DependencyNotInstalled as exc:
        raise ConfigError(f"env {env_id!r} needs a package this Python lacks: {' '.join(str(exc).split())}") from None
    except (gym.error.UnregisteredEnv, gym.error.DeprecatedEnv, ModuleNotFoundError) as exc:
        reason = " ".join(str(exc).split())
        module, name = _split(env_id)
        if module is not None and isinstance(exc, gym.error.UnregisteredEnv):
            raise ConfigError(f"unknown env id {env_id!r}: importing {module!r} registered no env {name!r} "
                              f"({reason}): call gymnasium.register({name!r}, entry_point=...) at the top level of "
                              f"{module!r}") from None
        raise ConfigError(f"unknown env id {env_id!r} ({reason}): {_ID_HINT}") from None
    except TypeError as exc:
        if "unexpected keyword argument" not in str(exc):
            raise
        raise ConfigError(f"env {env_id!r} rejects env_args {sorted(kwargs)}: {exc}") from None


_built_families: dict[tuple[str, str], str] = {}
"""``built_family``'s answers, per id and ``repr`` of its env_args: one build each per process."""


def env_family(env_id: str, env_args: tuple[tuple[str, Any], ...] = ()) -> str:
    """The preset family of ``env_id`` (``presets.py``'s module docstring): ``id_family``'s where the id tells it,
    else ``built_family``'s."""
    return id_family(env_id, env_args) or built_family(env_id, env_args)


def built_family(env_id: str, env_args: tuple[tuple[str, Any], ...] = ()) -> str:
    """The preset family of ``env_id`` read off the env built once with ``env_args``: ``mujoco`` when its entry
    point lives in a ``mujoco`` module, else ``classic-discrete`` or ``classic-continuous`` by its action space.
    An unknown id raises the ``ConfigError`` of ``gym_make``."""
    key = (env_id, repr(env_args))
    if key not in _built_families:
        env = gym_make(env_id, dict(env_args))
        try:
            if "mujoco" in entry_module(env.spec).split("."):
                family = "mujoco"
            elif isinstance(env.action_space, gym.spaces.Discrete):
                family = "classic-discrete"
            else:
                family = "classic-continuous"
        finally:
            env.close()
        _built_families[key] = family
    return _built_families[key]
