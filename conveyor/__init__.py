"""conveyor: high-throughput deep RL over one set of shared parts.

``conveyor.train(cfg)`` runs the architecture named by ``cfg.arch.name`` and
returns the run's summary (the contents of ``summary.json``).
"""

import os

# libgomp's threads spin for 300k iterations after each parallel region before sleeping; in PAAC
# that spinning steals the cores the env workers step on right after every forward. A tenth of it
# keeps back-to-back regions (a backward pass) fast: +10% SPS on Pong with 2 cores. Takes effect
# only when conveyor is imported before torch, as the CLI does.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from conveyor.config import AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg  # noqa: E402

__all__ = ["train", "RunCfg", "EnvCfg", "ModelCfg", "AlgoCfg", "ArchCfg", "ConfigError"]
__version__ = "0.1.0"


def train(cfg: RunCfg) -> dict:
    """Train with ``cfg`` and return the summary dict (also written to ``<out>/summary.json``)."""
    from conveyor.architectures import run

    return run(cfg)
