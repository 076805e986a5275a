"""The five architectures, one package each: ``<name>/run.py`` wires shared parts in one ``run(cfg)``; the
package's other modules are that architecture's other process side (actors, workers, agents, servers).
No architecture package imports another."""

from __future__ import annotations

import importlib
from typing import Any

from conveyor.config import RunCfg
from conveyor.imports import is_ref


def run(cfg: RunCfg) -> dict[str, Any]:
    """Train with the architecture named by ``cfg.arch.name``; returns the summary."""
    # Imported here, not above: the packages' child processes (GA3C's agents, HTS's executors) import this
    # package, and torch's import would cost each of them a second and a half of CPU at start.
    from conveyor.transfer import usable_device

    usable_device(cfg.device)
    if is_ref(cfg.model.name):  # an encoder of your own: a misfit is refused before any process starts
        from conveyor.envs import env_spaces
        from conveyor.models import make_model

        make_model(cfg.model, *env_spaces(cfg.env, cfg.seed), dueling=cfg.algo.name == "r2d2")
    module = importlib.import_module(f"conveyor.architectures.{cfg.arch.name}.run")
    return module.run(cfg)
