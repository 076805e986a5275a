"""The five architectures, one package each: ``<name>/run.py`` wires shared parts in one ``run(cfg)``; the
package's other modules are that architecture's other process side (actors, workers, agents, servers).
No architecture package imports another."""

from __future__ import annotations

import importlib
from typing import Any

from conveyor.config import RunCfg


def run(cfg: RunCfg) -> dict[str, Any]:
    """Train with the architecture named by ``cfg.arch.name``; returns the summary."""
    module = importlib.import_module(f"conveyor.architectures.{cfg.arch.name}.run")
    return module.run(cfg)
