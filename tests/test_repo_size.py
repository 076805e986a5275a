"""A lean tree (issue 49): no git-tracked file is over 2 MB, so a fresh clone stays small. Run archives and
checkpoints are not source (they stay outside the repository); a long ``metrics.csv`` is downsampled (its
folder's README says how)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_FILE_BYTES = 2 * 1024 * 1024


def tracked_files() -> list[str]:
    """The paths ``git ls-files`` lists, relative to the repository root; skips the test outside a git checkout."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"git ls-files failed: {result.stderr.decode(errors='replace').strip()}")
    return [name for name in result.stdout.decode("utf-8", errors="surrogateescape").split("\0") if name]


def test_no_tracked_file_is_over_2_mb():
    too_big = []
    for name in tracked_files():
        path = REPO / name
        if path.is_file() and not path.is_symlink():  # a deletion not yet committed is not in the tree
            size = os.path.getsize(path)
            if size > MAX_FILE_BYTES:
                too_big.append(f"{name} ({size / 1e6:.1f} MB)")
    assert not too_big, f"tracked files over 2 MB (keep run archives, checkpoints and long logs out): {too_big}"
