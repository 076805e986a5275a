"""The user's own code named in a config: ``--env MODULE:ID`` and ``--model MODULE:NAME``.

A config names user code by import path only, so ``config.json`` stays JSON
and every process that needs the code imports it by itself: the run, its env
workers, IMPACT workers, SEED actors (on other hosts too), a resumed run,
``conveyor eval``. ``import_module`` and ``import_object`` do that import with
the current directory on ``sys.path`` (as ``python -m`` has it; the
``conveyor`` script alone would not; child processes inherit the parent's
``sys.path``) and turn every failure into a one-line ``ConfigError`` that
names the module and the fix. ``object_ref`` goes the other way: a class or
function handed over in Python becomes its ``module:qualname``.

A class defined in the script that was run (``python train.py``: module
``__main__``) is named by the script's file name (``train:MyEncoder``; under
``python -m pkg.train``, ``pkg.train:MyEncoder``). This process keeps using
``__main__`` for it, while a child process or a resumed run imports ``train``
and so runs its top level again: keep the training call under
``if __name__ == "__main__":`` (as multiprocessing's spawn asks too).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import traceback
import types
from pathlib import Path
from typing import Any

from conveyor.errors import ConfigError

REF = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
"""``package.module:Name`` (or ``:Outer.Name``): what ``import_object`` takes."""

PATH_HINT = "check the spelling, and run from the directory that holds it or add that directory to PYTHONPATH"


def is_ref(text: str) -> bool:
    """Whether ``text`` names user code as ``module:name``."""
    return ":" in text


def _cwd_on_path() -> None:
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)  # after the installed packages: a local directory never shadows one of them


def _main_name() -> str | None:
    """The name under which another process imports this process's ``__main__``: its module under ``python -m``,
    else its script's file name; None in an interactive session or ``python -c``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return spec.name
    path = getattr(main, "__file__", None)
    return Path(path).stem if path else None


def _main_script_module(name: str) -> types.ModuleType | None:
    """``__main__``, when it is what ``name`` would import (see the module docstring), so that this process does
    not run it a second time."""
    if name in sys.modules or name != _main_name():
        return None
    return sys.modules["__main__"]


def _where(error: BaseException) -> str:
    """`` at FILE:LINE`` of the innermost frame that raised ``error`` (the user's line), if any."""
    frames = traceback.extract_tb(error.__traceback__)
    frames = [frame for frame in frames if "importlib" not in frame.filename] or frames
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def import_module(name: str, what: str) -> types.ModuleType:
    """Import module ``name`` for ``what`` (``--env 'pkg.envs:MyEnv-v0'``); ``ConfigError`` if it is missing or
    raises while it is imported."""
    _cwd_on_path()
    main = _main_script_module(name)
    if main is not None:
        return main
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and (name == error.name or name.startswith(error.name + ".")):
            raise ConfigError(f"no module named {error.name!r} (for {what}): {PATH_HINT}") from None
        raise ConfigError(f"importing {name!r} (for {what}) failed: {error}{_where(error)}: install what it "
                          "imports") from None
    except Exception as error:
        detail = " ".join(str(error).split())
        raise ConfigError(f"importing {name!r} (for {what}) raised {type(error).__name__}: {detail}{_where(error)}: "
                          "fix the module") from None


def check_ref(ref: str, what: str) -> None:
    """``ConfigError`` unless ``ref`` has the form ``module:Name`` (nothing is imported)."""
    if not REF.match(ref):
        raise ConfigError(f"{what}: {ref!r} is not MODULE:NAME (e.g. my_pkg.nets:Encoder)")


def import_object(ref: str, what: str) -> Any:
    """The object ``ref`` (``module:Name``) names, for ``what``; ``ConfigError`` if it cannot be had."""
    check_ref(ref, what)
    module_name, _, attrs = ref.partition(":")
    obj: Any = import_module(module_name, what)
    for attr in attrs.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ConfigError(f"module {module_name!r} has no {attrs!r} (for {what}): check the name after the "
                              "colon") from None
    return obj


def object_ref(obj: Any, what: str) -> str:
    """``module:qualname`` of a class or function defined at the top level of an importable module (or of the
    script that was run), so that another process can import it; ``ConfigError`` otherwise."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        raise ConfigError(f"{what}: {obj!r} has no import path (a lambda, a partial, a class made inside a "
                          "function?): define a class or function at the top level of a module and pass it, or "
                          "pass its 'module:Name'")
    if module == "__main__":
        module = _main_name() or ""
        if not module:
            raise ConfigError(f"{what}: {qualname} is defined in an interactive session: define it in a module "
                              "and pass it, or pass its 'module:Name'")
    ref = f"{module}:{qualname}"
    if not REF.match(ref):
        raise ConfigError(f"{what}: {ref!r} cannot be imported by name: rename the module or class to Python "
                          "identifiers")
    return ref
