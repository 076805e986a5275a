"""``conveyor tune``'s search spaces: what a study samples, per algorithm and env family, beside the presets.

A space maps train flag names (without dashes, as in a ``--config`` file) to a ``Range`` (numbers between
two bounds, log-uniform where ``log``) or a ``Choice`` (a list of values). ``SPACES`` holds the defaults,
one per ``(arch, algo)`` key where ``*`` matches any architecture; ``space_for`` takes the architecture's own
entry, else the ``*`` one, and adjusts it to the env family (``FAMILIES``, and ``GAUSSIAN`` on continuous
actions). The ranges surround every preset's value (``presets.py``; ``tests/test_tune.py`` checks each
architecture and algorithm on one env of each family) and the ranges rl-zoo's ``hyperparams_opt.py`` samples
for the same algorithms.

``--space FILE`` (TOML) changes it: each table names a flag and gives ``low``/``high`` (and ``log = true``) or
``choices = [...]``, replacing or adding that parameter; ``defaults = false`` at the top drops the default
entries, so the file's tables are the whole space::

    [lr]
    low = 1e-4
    high = 3e-3
    log = true

    [num-envs]
    choices = [16, 32, 64]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from conveyor.config import read_toml_file
from conveyor.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """Numbers from ``low`` to ``high`` (integers for an integer flag), log-uniform where ``log``."""

    low: float
    high: float
    log: bool = False

    def ends(self) -> tuple[Any, ...]:
        return (self.low, self.high)


@dataclass(frozen=True)
class Choice:
    """One of ``values`` (a list value, such as ``hidden``'s, as its flag's text: ``"64,64"``)."""

    values: tuple[Any, ...]

    def ends(self) -> tuple[Any, ...]:
        return self.values


Param = Union[Range, Choice]
Space = dict[str, Param]

GAMMAS = Choice((0.9, 0.95, 0.98, 0.99, 0.995, 0.999))  # rl-zoo's gamma choices
LAMBDAS = Choice((0.8, 0.9, 0.92, 0.95, 0.98, 0.99, 0.995, 1.0))  # rl-zoo's gae_lambda choices, and IMPACT's 0.995
_ACTOR_CRITIC: Space = {
    "lr": Range(1e-4, 1e-2, log=True),
    "entropy-coef": Range(1e-8, 0.1, log=True),  # rl-zoo's ent_coef range; its floor stands for the presets' 0
    "gamma": GAMMAS,
    "max-grad-norm": Choice((0.5, 1.0, 5.0, 40.0)),
    "num-envs": Choice((8, 16, 32, 64, 128, 256)),
}
_A2C: Space = {**_ACTOR_CRITIC, "unroll": Choice((5, 8, 16, 32))}
_PPO: Space = {**_ACTOR_CRITIC, "unroll": Choice((32, 64, 128, 256)), "ppo-epochs": Choice((1, 2, 4, 8, 10)),
               "ppo-minibatches": Choice((1, 2, 4, 8, 16, 32)), "clip": Choice((0.1, 0.2, 0.3)), "gae-lambda": LAMBDAS}
_VTRACE: Space = {**_ACTOR_CRITIC, "unroll": Choice((5, 8, 10, 20, 40))}
# IMPACT's workers send worker-batch steps per env: its unroll (HTS: sync-interval, its alpha).
_IMPACT_BATCH: Space = {"worker-batch": Choice((10, 32, 50, 64)), "replay-times": Range(1, 32, log=True)}


def _without(space: Space, name: str) -> Space:
    return {k: v for k, v in space.items() if k != name}


SPACES: dict[tuple[str, str], Space] = {
    ("*", "a2c"): _A2C,
    ("hts", "a2c"): {**_without(_A2C, "unroll"), "sync-interval": Choice((5, 8, 16, 32))},
    ("*", "ppo"): _PPO,
    ("hts", "ppo"): {**_without(_PPO, "unroll"), "sync-interval": Choice((32, 64, 128, 256))},
    ("*", "vtrace"): _VTRACE,
    ("impact", "vtrace"): {**_without(_VTRACE, "unroll"), **_IMPACT_BATCH},
    ("*", "impact"): {**_ACTOR_CRITIC, **_IMPACT_BATCH, "clip": Choice((0.1, 0.2, 0.3, 0.4)), "gae-lambda": LAMBDAS},
    ("*", "ga3c"): {**_without(_A2C, "num-envs"), "num-agents": Choice((8, 16, 32))},
    ("*", "r2d2"): {  # SEED table 8 and the classic-discrete presets bracket these
        "lr": Range(1e-5, 3e-3, log=True),
        "gamma": Choice((*GAMMAS.values, 0.997)),  # R2D2's 0.997 (Kapturowski et al. 2019, table 2)
        "n-step": Choice((3, 5, 10)),
        "replay-ratio": Choice((0.5, 0.75, 1.0, 2.0, 4.0, 8.0, 16.0)),
        "target-update": Choice((50, 100, 500, 2500)),
        "exploration-eps": Range(0.05, 0.5),
        "adam-eps": Range(1e-6, 1e-3, log=True),
    },
}
"""The default spaces per ``(arch, algo)``, ``*`` for any architecture; ``FAMILIES`` adjusts them per env family."""
_CONTINUOUS: Space = {"entropy-coef": Range(0.0, 0.01), "lr": Range(1e-5, 3e-3, log=True)}  # presets: entropy 0
FAMILIES: dict[str, Space] = {
    "classic-continuous": _CONTINUOUS,
    "mujoco": _CONTINUOUS,
    "atari": {"lr": Range(1e-5, 1e-3, log=True), "num-envs": Choice((8, 16, 32, 64))},
}
"""Per env family, ranges that replace those of the same name (a parameter the space lacks stays out)."""
GAUSSIAN: Space = {"log-std-init": Range(-4.0, 1.0)}  # rl-zoo's log_std_init range
"""Added on continuous-action families for the algorithms with a Gaussian policy (all but R2D2): the initial log
standard deviation decides how far early exploration reaches (the Pendulum presets' -2 and -1.5, BENCHMARKS.md)."""


def space_for(arch: str, algo: str, family: str) -> Space:
    """The default space of ``arch``/``algo`` on ``family``: ``SPACES``' entry of the architecture (else ``*``),
    with ``FAMILIES``' ranges of ``family`` in place of its own, and ``GAUSSIAN`` on continuous families."""
    space = SPACES.get((arch, algo)) or SPACES.get(("*", algo))
    if space is None:
        raise ConfigError(f"no search space for --algo {algo}: pass --space FILE")
    space = {**space, **{k: v for k, v in FAMILIES.get(family, {}).items() if k in space}}
    if family in ("classic-continuous", "mujoco") and algo != "r2d2":
        space.update(GAUSSIAN)
    return space


def read_space_file(path: Path | str, space: Space, known: set[str]) -> Space:
    """``space`` changed by the TOML file at ``path`` (see the module docstring); ``known``: the train flag names a
    parameter may have. A file that cannot be read or names an unknown flag is a one-line ``ConfigError``."""
    data = read_toml_file("--space", path)
    keep = data.pop("defaults", True)
    if not isinstance(keep, bool):
        raise ConfigError(f"--space {path}: defaults must be true or false, got {keep!r}")
    out = dict(space) if keep else {}
    for name, entry in data.items():
        if name not in known:
            raise ConfigError(f"--space {path}: unknown parameter {name!r}: name a `conveyor train` flag without "
                              "its dashes (`conveyor train --help`)")
        out[name] = _param(path, name, entry)
    if not out:
        raise ConfigError(f"--space {path} leaves nothing to search: add a parameter table, or drop defaults = false")
    return out


def _param(path: Path | str, name: str, entry: Any) -> Param:
    if not isinstance(entry, dict):
        raise ConfigError(f"--space {path}: {name} must be a table with low and high, or choices")
    extra = sorted(set(entry) - {"low", "high", "log", "choices"})
    if extra:
        raise ConfigError(f"--space {path}: {name} has an unknown key {extra[0]!r}: use low, high, log or choices")
    if "choices" in entry:
        values = entry["choices"]
        if not isinstance(values, list) or not values or set(entry) != {"choices"}:
            raise ConfigError(f"--space {path}: {name}'s choices must be a non-empty list, without low/high/log")
        return Choice(tuple(",".join(map(str, v)) if isinstance(v, list) else v for v in values))
    low, high, log = entry.get("low"), entry.get("high"), entry.get("log", False)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (low, high))
    if not numbers or not isinstance(log, bool) or low > high:
        raise ConfigError(f"--space {path}: {name} wants finite numbers low <= high (and log = true or false), got "
                          f"low = {low!r}, high = {high!r}")
    if log and low <= 0:
        raise ConfigError(f"--space {path}: {name} is log-uniform and needs low > 0, got {low!r}")
    return Range(low, high, log)


def describe(param: Param) -> str:
    """``param`` in a line: ``1e-04..0.01 (log)`` or ``{8, 16, 32}``."""
    if isinstance(param, Range):
        return f"{param.low:g}..{param.high:g}{' (log)' if param.log else ''}"
    return "{" + ", ".join(str(v) for v in param.values) + "}"
