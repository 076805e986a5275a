"""Numpy arrays shared between processes through one anonymous memory file.

A ``SharedArrays`` block packs named arrays into a single memfd (Linux
``memfd_create``): it has no name in ``/dev/shm``, so nothing can leak. The
kernel frees the memory when the last process holding the file descriptor or
a mapping of it exits, however that process ends. Another process attaches
by inheriting the descriptor (``subprocess.Popen(pass_fds=...)``) and
rebuilding the block from the same specs, which fix the layout.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

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


def send_child_spec(stream: Any, spec: Any) -> None:
    """Write the parent's ``sys.path`` and ``spec`` (a NamedTuple of ints, tuples, ``ArraySpec``s and an
    ``EnvCfg`` field named ``env_cfg``) to a child process's stdin as JSON: nothing crossing into a
    process is ever unpickled."""
    fields = {}
    for name, value in spec._asdict().items():
        fields[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    stream.write(json.dumps({"sys_path": sys.path, "spec": fields}).encode())
    stream.close()


def receive_child_spec(spec_type: type) -> Any:
    """Read what ``send_child_spec`` wrote to this process's stdin; restores ``sys.path``."""
    from conveyor.config import EnvCfg

    data = json.loads(sys.stdin.buffer.read())
    sys.path[:] = data["sys_path"]
    fields = data["spec"]
    for name, value in fields.items():
        if name == "env_cfg":
            value["env_args"] = tuple(tuple(pair) for pair in value["env_args"])
            fields[name] = EnvCfg(**value)
        elif name == "array_specs":
            fields[name] = tuple(ArraySpec(spec_name, tuple(shape), dtype) for spec_name, shape, dtype in value)
        elif isinstance(value, list):
            fields[name] = tuple(value)
    return spec_type(**fields)


# Env-stepping children run one per core: a BLAS/OpenMP thread pool in each would only oversubscribe.
SINGLE_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def start_child(entry: str, pass_fds: Sequence[int]) -> subprocess.Popen:
    """Start ``python -c entry`` with a piped stdin (for its spec), single-threaded numerical
    libraries, and only ``pass_fds`` inherited. Unlike multiprocessing's spawn it never re-imports
    the parent's ``__main__`` (which may import torch), so children start in the time their own
    imports take."""
    env = dict(os.environ)
    for name in SINGLE_THREAD_VARS:
        env.setdefault(name, "1")
    return subprocess.Popen([sys.executable, "-c", entry], stdin=subprocess.PIPE, env=env, pass_fds=tuple(pass_fds))


def reap(processes: Sequence[subprocess.Popen], grace_s: float) -> None:
    """Wait for ``processes`` to exit within one shared grace period; kill whoever is still running."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
