"""conveyor: high-throughput deep RL over one set of shared parts.

``conveyor.train(cfg)`` runs the architecture named by ``cfg.arch.name`` and
returns the run's summary (the contents of ``summary.json``).
"""

from conveyor.config import AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg

__all__ = ["train", "RunCfg", "EnvCfg", "ModelCfg", "AlgoCfg", "ArchCfg", "ConfigError"]
__version__ = "0.1.0"


def train(cfg: RunCfg) -> dict:
    """Train with ``cfg`` and return the summary dict (also written to ``<out>/summary.json``)."""
    from conveyor.architectures import run

    return run(cfg)
