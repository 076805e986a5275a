"""Host sizing: what the machine and the launch environment offer a run (CPUs, a GPU, torchrun's ranks).

The presets (``presets.py``) size env workers and pick the device from these; nothing here reads a config
table. ``rank_envs`` and ``cpus_per_env_host`` take the partly resolved config view a preset's ``Derived``
function gets (``c.env.num_envs``, ``c.arch.name``, ``c.arch.local_actors``).
"""

from __future__ import annotations

import os
from typing import Any


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (a container's or ``taskset``'s share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS, Windows)
        return os.cpu_count() or 1


def accelerator() -> str:
    """``cuda`` where torch sees a GPU, else ``cpu``."""
    import torch  # here, not at import: ``conveyor --help`` and the tables stay fast

    return "cuda" if torch.cuda.is_available() else "cpu"


def env_workers(num_envs: int, most: int) -> int:
    """Worker processes for ``num_envs`` envs: the largest divisor of ``num_envs`` not above ``most`` (so each
    worker owns as many envs; at least 1)."""
    return max(d for d in range(1, max(1, min(num_envs, most)) + 1) if num_envs % d == 0)


def launch_size(name: str) -> int:
    """torchrun's ``WORLD_SIZE`` or ``LOCAL_WORLD_SIZE``: 1 without torchrun (or unreadable: ``DataParallel``
    refuses that in one line)."""
    try:
        return max(1, int(os.environ.get(name, "1")))
    except ValueError:
        return 1


def rank_envs(c: Any) -> int:
    """The envs one process steps on its own workers: under torchrun each rank steps its share of num_envs."""
    ranks = launch_size("WORLD_SIZE")
    return c.env.num_envs // ranks if c.env.num_envs % ranks == 0 else c.env.num_envs


def cpus_per_env_host(c: Any) -> int:
    """CPUs for the env workers of one env host: torchrun's ranks on this machine, and SEED's local actors, each
    run their own."""
    hosts = launch_size("LOCAL_WORLD_SIZE") * (c.arch.local_actors if c.arch.name == "seed" and c.arch.local_actors
                                               else 1)
    return max(2, usable_cpus() // hosts)
