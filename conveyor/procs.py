"""Child processes: the one owner of how conveyor starts, stops, reaps and restarts them.

Parent side: ``start_child`` starts ``python -c ENTRY`` (never multiprocessing's spawn, which re-imports the
parent's ``__main__``) inheriting only the file descriptors named, and writes its spec to its stdin as JSON:
nothing crossing into a process is ever unpickled. ``close_children`` asks children to stop and ``reap``
waits for them within one grace period (``CLOSE_GRACE_S``) and kills whoever is left; ``exit_reason`` says
how one ended; a ``RestartBudget`` counts the restarts of dead children against ``max_restarts`` and stops
the run with one line when they are spent. ``SignalRelay`` hands the signals that stop a process to a thread of
its own, never running stop code inside a signal handler.

Child side: ``child_prologue`` is the first thing every child's entry point runs (it ignores Ctrl-C and SIGHUP, reads
the spec, restores the parent's ``sys.path``, and ties the child's life to its parent's: ``die_with_parent``);
``parent_gone`` tells a child whose pipes cannot show it that its parent has died (where the kernel cannot
kill it with its parent).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from conveyor.errors import WorkerFailure
from conveyor.storage.shm import ArraySpec

CLOSE_GRACE_S = 5.0
"""How long children may take to exit, once asked to or once their pipe closed, before they are killed."""

# Env-stepping children run one per core: a BLAS/OpenMP thread pool in each would only oversubscribe.
SINGLE_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_parent_pid: int | None = None
"""In a child, the pid of the parent that started it (``child_prologue``); None elsewhere."""
_DATACLASS_KEY = "dataclass"
"""How a dataclass field of a NamedTuple spec travels: ``{"dataclass": "module:QualName", "fields": {...}}``."""


# ---- parent side -------------------------------------------------------------------------------
def start_child(entry: str, spec: Any, pass_fds: Sequence[int]) -> subprocess.Popen:
    """Start ``python -c entry`` with single-threaded numerical libraries and only ``pass_fds`` inherited,
    and write ``spec`` to its stdin (``child_prologue`` reads it). ``spec`` is a NamedTuple (its fields:
    JSON values, dataclasses, ``ArraySpec``s) or a JSON-ready dict. Unlike multiprocessing's spawn it never
    re-imports the parent's ``__main__`` (which may import torch), so a child starts in the time its own
    imports take. A child that dies before reading its spec is not an error here: its owner notices the
    death the way it notices any other. The child is killed when the thread that called this exits
    (``die_with_parent``): start children from the thread that owns them for as long as they run."""
    fields = spec if isinstance(spec, dict) else {name: _spec_json(value) for name, value in spec._asdict().items()}
    env = dict(os.environ)
    for name in SINGLE_THREAD_VARS:
        env.setdefault(name, "1")
    process = subprocess.Popen([sys.executable, "-c", entry], stdin=subprocess.PIPE, env=env,
                               pass_fds=tuple(pass_fds))
    try:
        process.stdin.write(json.dumps({"sys_path": sys.path, "parent_pid": os.getpid(), "spec": fields}).encode())
        process.stdin.close()
    except BrokenPipeError:
        pass  # it died at start
    return process


def _spec_json(value: Any) -> Any:
    """A NamedTuple spec's field as JSON: a dataclass as its class's name and its fields (``_DATACLASS_KEY``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return {_DATACLASS_KEY: f"{cls.__module__}:{cls.__qualname__}", "fields": dataclasses.asdict(value)}
    return value


def close_children(processes: Sequence[subprocess.Popen], command_fds: Sequence[int], farewell: bytes = b"") -> None:
    """Write ``farewell`` (the children's stop command, if they have one) down each command pipe and close it,
    so that a child reads end of file after it, then ``reap`` them."""
    for fd in command_fds:
        if farewell:
            try:
                os.write(fd, farewell)
            except OSError:
                pass  # already gone
        os.close(fd)
    reap(processes)


def terminate(processes: Iterable[subprocess.Popen]) -> None:
    """Send SIGTERM to those of ``processes`` still running (for children that stop on a signal)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()


def reap(processes: Sequence[subprocess.Popen]) -> None:
    """Wait for ``processes`` to exit within one shared grace period (``CLOSE_GRACE_S``); kill whoever is
    still running then."""
    deadline = time.monotonic() + CLOSE_GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Make this process the reaper of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``): a process
    that a child leaves behind (an env that forked, even into a session of its own) becomes this process's child
    instead of init's, so ``end_descendants`` finds it. A no-op elsewhere."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)


def descendants(pid: int | None = None) -> list[int]:
    """The live processes below ``pid`` (default: this one): its children, theirs, and so on (Linux ``/proc``;
    empty elsewhere)."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
            except (OSError, ValueError, IndexError):
                continue  # exited while we looked
            if state != b"Z":
                parents.setdefault(int(ppid), []).append(int(entry.name))
    found, frontier = [], [os.getpid() if pid is None else pid]
    while frontier:
        frontier = [child for parent in frontier for child in parents.get(parent, ())]
        found += frontier
    return found


def end_descendants(grace_s: float = 1.0) -> list[int]:
    """End every process still below this one: SIGTERM, then SIGKILL for whoever is left after ``grace_s``
    (processes that ignore SIGTERM), and reap those that are this process's children. Returns their pids."""
    left = descendants()
    if not left:
        return left
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else CLOSE_GRACE_S)
        while time.monotonic() < deadline and set(left) & set(descendants()):
            for pid in left:  # reaped here, our children stop showing as live zombies
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            time.sleep(0.02)
    return left


def exit_reason(code: int | None) -> str:
    """How a process with return code ``code`` (``Popen.returncode``) ended, for a one-line message."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:  # a real-time signal, which has no name
            return f"killed by signal {-code}"
    return f"exit code {code}"


class RestartBudget:
    """The restarts of dead children a run allows (``EnvCfg.max_restarts``), counted by the owner of the
    children each time it replaces one."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.restarts = 0
        """Restarts spent so far."""

    def spend(self, death: str, details: str = "") -> None:
        """Count one restart for the death ``death`` describes (one line naming the child, its pid and its
        exit reason) and say so on stderr; when none is left, raise ``WorkerFailure``: that line, the limit
        and the fix, with ``details`` (the child's traceback, if it sent one)."""
        if self.restarts >= self.max_restarts:
            limit = ("restarts are off (max_restarts=0)" if not self.max_restarts else
                     f"the run's {self.restarts} restarts reach max_restarts={self.max_restarts}")
            raise WorkerFailure(f"{death}; {limit}: raise --max-restarts or fix what kills it", details)
        self.restarts += 1
        print(f"conveyor: {death}; restarting it ({self.restarts} of at most {self.max_restarts} restarts)",
              file=sys.stderr, flush=True)


class SignalRelay:
    """Calls ``callback(signum)`` on a thread of its own for each of ``signals`` that arrives, until ``close``.

    A Python signal handler runs in the main thread between two of its bytecodes, where that thread may hold a
    lock: stop code taking the same lock there (``Event.set``, grpc's ``call.cancel``) waits for ever, and an
    exception raised there can leave a lock taken (a SEED actor hung so in 1 of ~15 SIGTERMs). Here the handler
    does nothing; the interpreter's C handler writes the signal's number to a pipe
    (``signal.set_wakeup_fd``) at once, even while the main thread is inside a long C call, and the relay
    thread reads it from there. Install it from the main thread; ``close`` restores the previous handlers and
    wakeup fd."""

    _CLOSE = 0  # no signal has number 0: the relay thread's stop request

    def __init__(self, signals: Iterable[int], callback: Any) -> None:
        self._signals = frozenset(signals)
        self._callback = callback
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._thread = threading.Thread(target=self._relay, name="conveyor-signals", daemon=True)
        self._thread.start()
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._previous = {sig: signal.signal(sig, _ignore_in_handler) for sig in self._signals}

    def _relay(self) -> None:
        while True:
            signum = os.read(self._read_fd, 1)[0]
            if signum == self._CLOSE:
                return
            if signum in self._signals:  # the wakeup fd also carries other handled signals (SIGALRM)
                self._callback(signum)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.write(self._write_fd, bytes([self._CLOSE]))
        self._thread.join()
        os.close(self._read_fd)
        os.close(self._write_fd)


def _ignore_in_handler(signum: int, frame: Any) -> None:
    """The Python-level handler of ``SignalRelay``'s signals: the relay thread acts on them."""


# ---- child side --------------------------------------------------------------------------------
def child_prologue(spec_type: type | None = None) -> Any:
    """The start of every child's entry point: ignore Ctrl-C and SIGHUP (they reach the whole process group: a
    closed terminal sends SIGHUP; the parent saves the run and decides when its children stop), read the spec ``start_child`` wrote, restore the parent's ``sys.path``
    (so env ids like ``pkg.module:Env-v0`` import the same modules), remember the parent (``parent_gone``)
    and die with it (``die_with_parent``). Returns the spec as a ``spec_type`` NamedTuple (a dataclass field
    as that dataclass again, every list as the tuple its field's type says: ``tuple[ArraySpec, ...]`` as
    ``ArraySpec``s, see ``_from_json``; a plain tuple else), or the dict as sent when ``spec_type`` is None."""
    global _parent_pid
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    data = json.loads(sys.stdin.buffer.read())
    sys.path[:] = data["sys_path"]
    _parent_pid = data["parent_pid"]
    die_with_parent(_parent_pid)
    fields = data["spec"]
    if spec_type is None:
        return fields
    hints = typing.get_type_hints(spec_type)
    for name, value in fields.items():
        if isinstance(value, dict) and _DATACLASS_KEY in value:
            fields[name] = _dataclass_from_json(value)
        elif isinstance(value, list):
            value = _from_json(hints.get(name, tuple), value)
            fields[name] = value if isinstance(value, tuple) else tuple(value)
    return spec_type(**fields)


def _dataclass_from_json(sent: dict[str, Any]) -> Any:
    """The dataclass ``_spec_json`` sent: its class (imported by the name the parent wrote) over its fields."""
    module, _, qualname = sent[_DATACLASS_KEY].partition(":")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return _from_json(cls, sent["fields"])


def _from_json(hint: Any, value: Any) -> Any:
    """``value`` as JSON gave it, back as the type ``hint`` says: a dataclass from its fields (each by its own
    hint), a NamedTuple (``ArraySpec``) or a tuple (``tuple[X, ...]``, ``tuple[X, Y]``) from a list; anything else
    as it is."""
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        hints = typing.get_type_hints(hint)
        return hint(**{name: _from_json(hints.get(name, Any), item) for name, item in value.items()})
    if isinstance(value, list):
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: the tuple arm, if any
            hint = next((arm for arm in typing.get_args(hint) if arm is tuple or typing.get_origin(arm) is tuple),
                        Any)
        if isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields"):  # a NamedTuple
            hints = typing.get_type_hints(hint)
            items = zip(hint._fields, value, strict=True)
            return hint(*(_from_json(hints.get(name, Any), item) for name, item in items))
        if hint is tuple or typing.get_origin(hint) is tuple:
            args = typing.get_args(hint)
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_from_json(args[0], item) for item in value)
            if len(args) == len(value):
                return tuple(_from_json(arg, item) for arg, item in zip(args, value))
            return tuple(value)
    return value


def array_specs_from_json(rows: Iterable[Sequence[Any]]) -> tuple[ArraySpec, ...]:
    """``ArraySpec``s back from their JSON form (``[name, shape, dtype]`` lists)."""
    return tuple(ArraySpec(name, tuple(shape), dtype) for name, shape, dtype in rows)


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """Have the kernel send ``signum`` (SIGKILL unless said) to this process when its parent dies (Linux
    ``PR_SET_PDEATHSIG``; elsewhere only ``parent_gone`` tells), and exit now if ``parent_pid`` has already
    died. A child blocked where it cannot look (an env stuck in C code or in a loop, a stopped process) thus
    never outlives a parent killed by SIGKILL; SIGTERM instead lets a training run stop as on a signal. The
    kernel tracks the parent *thread*: the one that started this process."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os._exit(1)


def parent_gone() -> bool:
    """In a child: whether the parent that started it has died (the child was re-parented). False outside
    a child."""
    return _parent_pid is not None and os.getppid() != _parent_pid
