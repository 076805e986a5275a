"""Child processes: start one from a JSON spec, hand it that spec, reap it.

Children are started as ``python -c ENTRY`` (never multiprocessing's spawn, which re-imports the parent's
``__main__``), inherit only the file descriptors named, and read their spec as JSON from stdin: nothing
crossing into a process is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from conveyor.storage.shm import ArraySpec


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
