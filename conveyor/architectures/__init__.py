"""The five architectures; each module wires shared parts in one ``run(cfg)``."""

from __future__ import annotations

import importlib
from typing import Any

from conveyor.config import RunCfg


def run(cfg: RunCfg) -> dict[str, Any]:
    """Train with the architecture named by ``cfg.arch.name``; returns the summary."""
    module = importlib.import_module(f"conveyor.architectures.{cfg.arch.name}")
    return module.run(cfg)
