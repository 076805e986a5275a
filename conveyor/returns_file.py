"""A run's ``returns.csv``: one row per finished episode (env_steps, wall_time_s, return).

``Telemetry.write_summary`` writes it; ``read_returns`` reads it back, for a resumed run's telemetry and for
``conveyor plot``. Numpy only, so a reader needs no torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def read_returns(path: Path) -> np.ndarray:
    """A ``returns.csv`` (``Telemetry.write_summary``) as ``[episodes, 3]``: env_steps, wall_time_s, return;
    no rows when the file is missing or holds only its header. A malformed file raises ValueError."""
    rows = path.read_text().splitlines()[1:] if path.is_file() else []
    if not any(row.strip() for row in rows):
        return np.zeros((0, 3))
    return np.loadtxt(rows, delimiter=",", ndmin=2).reshape(-1, 3)
