"""``--config FILE``: a TOML file of ``conveyor train`` flags, keyed by the flag names without their dashes.

::

    arch = "paac"
    env = "CartPole-v1"
    lr = 0.0012
    num-envs = 32
    hidden = [64, 64]
    env-arg = {sutton_barto_reward = true}
    progress = false

``conveyor tune`` writes its best configuration as one (``best.toml``), and each trial's as ``trial.toml``.
The file's values become command-line tokens (``flag_tokens``) that the train parser reads as it reads the
command line, so a value means in the file what it means after its flag: the CLI (``cli.py``) parses them
under the flags that were given, so explicit flags win over the file and the file wins over the presets.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from conveyor.config import read_toml_file
from conveyor.errors import ConfigError
from conveyor.files import write_text_atomic


def read_flag_file(path: Path | str, known: set[str]) -> dict[str, Any]:
    """The file's ``flag name -> value`` (TOML values); ``known``: the flag names it may use. A file that cannot
    be read, is not TOML or names another key is a one-line ``ConfigError``."""
    data = read_toml_file("--config", path)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"--config {path}: unknown key {unknown[0]!r}: its keys are `conveyor train` flag names "
                          "without the dashes (`conveyor train --help`)")
    return data


def flag_tokens(flags: dict[str, Any]) -> list[str]:
    """``flags`` (name -> TOML value) as the command-line tokens that give them: ``true``/``false`` as
    ``--name``/``--no-name``, a list as ``--name a,b``, a table as one ``--name key=value`` per entry."""
    tokens: list[str] = []
    for name, value in flags.items():
        flag = "--" + name
        if isinstance(value, bool):
            tokens.append(flag if value else "--no-" + name)
        elif isinstance(value, dict):  # env-arg = {key = value}: one --env-arg KEY=VALUE (JSON) per entry
            tokens += [f"{flag}={key}={json.dumps(item)}" for key, item in value.items()]
        elif isinstance(value, (list, tuple)):
            tokens.append(f"{flag}={','.join(str(item) for item in value)}")
        elif isinstance(value, float):
            tokens.append(f"{flag}={value!r}")  # repr: the shortest text that reads back as the same float
        elif isinstance(value, (int, str)):
            tokens.append(f"{flag}={value}")
        else:
            raise ConfigError(f"{name} = {value!r}: a flag's value is a number, a string, a boolean, a list or "
                              "(env-arg) a table")
    return tokens


def toml_value(value: Any) -> str:
    """``value`` (a number, string, boolean, list/tuple, or a table as a dict or ``(key, value)`` pairs) in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                          "inf" if value > 0 else "-inf")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (non-ASCII as \\uXXXX escapes)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise ConfigError(f"{value!r} has no TOML form: a flag's value is a number, a string, a boolean or a list")


def write_flag_file(path: Path | str, flags: dict[str, Any], header: str = "") -> None:
    """Write ``flags`` (name -> value) as a flag file (atomically), after ``header``'s lines as comments."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += [f"{name} = {toml_value(value)}" for name, value in flags.items()]
    write_text_atomic(path, "\n".join(lines) + "\n")
