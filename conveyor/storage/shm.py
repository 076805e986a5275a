"""Numpy arrays shared between processes through one anonymous memory file.

A ``SharedArrays`` block packs named arrays into a single memfd (Linux
``memfd_create``): it has no name in ``/dev/shm``, so nothing can leak. The
kernel frees the memory when the last process holding the file descriptor or
a mapping of it exits, however that process ends. Another process attaches
by inheriting the descriptor (``subprocess.Popen(pass_fds=...)``) and
rebuilding the block from the same specs, which fix the layout.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Cache-line alignment keeps arrays written by different processes off shared lines.
_ALIGN = 64


class ArraySpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str
    """A numpy dtype string (``np.dtype(x).str``), so specs travel as JSON."""


def _anonymous_file(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("conveyor-shared-arrays")
    else:  # macOS and other systems without memfd: an already-unlinked temporary file
        with tempfile.TemporaryFile() as handle:
            fd = os.dup(handle.fileno())
    os.ftruncate(fd, max(size, 1))
    return fd


def _layout(specs: Sequence[ArraySpec]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for spec in specs:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize
    return offsets, end


class SharedArrays:
    """Named numpy arrays in one shared anonymous memory file.

    ``SharedArrays(specs)`` creates the block; ``SharedArrays(specs, fd)``
    attaches to one created elsewhere (``fd`` inherited from the creator).
    Arrays are zero-initialised at creation and indexed by name.
    """

    def __init__(self, specs: Sequence[ArraySpec], fd: int | None = None) -> None:
        self.specs = tuple(ArraySpec(s.name, tuple(s.shape), np.dtype(s.dtype).str) for s in specs)
        offsets, size = _layout(self.specs)
        self.fd = _anonymous_file(size) if fd is None else fd
        self._mmap = mmap.mmap(self.fd, max(size, 1))
        self.arrays: dict[str, np.ndarray] = {
            spec.name: np.ndarray(spec.shape, spec.dtype, buffer=self._mmap, offset=offset)
            for spec, offset in zip(self.specs, offsets)
        }

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def close(self) -> None:
        """Drop this process's descriptor and mapping (idempotent).

        The mapping stays alive while views handed out earlier still exist;
        the memory is freed once every process has let go of it.
        """
        if self.fd < 0:
            return
        self.arrays = {}
        try:
            self._mmap.close()
        except BufferError:
            pass  # outstanding numpy views keep the mapping; it goes with them
        os.close(self.fd)
        self.fd = -1
