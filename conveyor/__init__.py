"""conveyor: high-throughput deep RL over one set of shared parts.

``conveyor.train(cfg)`` runs the architecture named by ``cfg.arch.name`` and
returns the run's summary (the contents of ``summary.json``);
``conveyor.load_policy(run_dir)`` gives a trained run's policy to act with
(``conveyor/policy.py``).
"""

import os

# libgomp's threads spin for 300k iterations after each parallel region before sleeping; in PAAC
# that spinning steals the cores the env workers step on right after every forward. A tenth of it
# keeps back-to-back regions (a backward pass) fast: +10% SPS on Pong with 2 cores. Takes effect
# only when conveyor is imported before torch, as the CLI does.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from typing import TYPE_CHECKING  # noqa: E402

from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg  # noqa: E402
from conveyor.errors import ConfigError  # noqa: E402

if TYPE_CHECKING:
    from conveyor.policy import Policy

__all__ = ["train", "load_policy", "RunCfg", "EnvCfg", "ModelCfg", "AlgoCfg", "ArchCfg", "ConfigError"]
__version__ = "0.1.0"


def train(cfg: RunCfg) -> dict:
    """Train with ``cfg`` and return the summary dict (also written to ``<out>/summary.json``)."""
    from conveyor.architectures import run

    return run(cfg)


def load_policy(run_dir: "str | os.PathLike[str]", checkpoint: "str | int" = "latest", device: str = "cpu",
                seed: "int | None" = None) -> "Policy":
    """The policy of the run in ``run_dir`` at ``checkpoint`` (``latest``, an env-step count, or a ``.pt`` file):
    ``policy.act(obs, state=None, deterministic=False) -> (action, state)`` on observations of
    ``policy.make_env(seed=..., render_mode=...)``. See ``conveyor.policy``."""
    from conveyor.policy import load_policy as load

    return load(run_dir, checkpoint, device, seed)
