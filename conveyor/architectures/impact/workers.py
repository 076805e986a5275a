"""IMPACT's worker supervisor, the learner's side (``architectures.impact``): ``Workers`` starts the W
worker processes of ``conveyor.architectures.impact.collector`` (which holds the batch slots' layout,
their ownership and the workers' seeds), passes slot indices (ready ones in, free ones back) and
restarts workers that die.

Deaths and restarts. A worker that dies (killed, crashed: its reply pipe
reaches end of file, or ``poll`` finds its process gone) is noticed at the
learner's next ``next_slot`` or ``release`` (within ``collector.POLL_S`` while the
learner waits for batches); its env worker sees its pipes close and exits
by itself. ``Workers`` then reaps it, takes any slots it
had sent before dying (complete batches), and drops what it had half
written: every slot of that worker the learner does not hold goes back to
the free pool, and its ``slot_steps`` (times the worker's envs) are reported
as dropped transitions (``on_restart(dropped_steps)``; never counted in
``env_steps``, never trained on). A new process takes the same worker index
and those free slots, and reads the newest published weights before its
first step. A worker whose own env worker died (or hung:
``EnvCfg.env_step_timeout_s``) exits (``collector.DIED_EXIT``) and is restarted the
same way; a worker that *reports* a failure (it raised: an env's observation
shape changed, too many env errors) is not restarted: the run stops with its
message.

Limit. ``max_restarts`` counts restarts over all workers of the run (the
architecture passes ``cfg.env.max_restarts``; the default here, 0, never
restarts). The death that would need one more restart, or any death while
the run is stopping, raises ``WorkerFailure`` naming the worker, its pid,
envs and exit reason.
"""

from __future__ import annotations

import os
import select
import subprocess
from collections import deque
from typing import Any, Callable

from conveyor.config import RunCfg
from conveyor.errors import WorkerFailure
from conveyor.architectures.impact.collector import FATAL, SLOTS_PER_WORKER
from conveyor.envs.shm_worker import read_message
from conveyor.architectures.impact.params import ParamBlock
from conveyor.storage.shm import SharedArrays
from conveyor.procs import RestartBudget, close_children, exit_reason, reap, start_child, terminate

_WORKER_ENTRY = "from conveyor.architectures.impact.collector import worker_main; worker_main()"


class Workers:
    """Starts the W worker processes and passes slot indices: ready ones in, free ones back; restarts workers
    that die, up to ``max_restarts`` in all, calling ``on_restart(dropped_steps)`` for each restart.

    ``stopping()`` true means the run is ending: a death then raises instead of restarting (a SIGTERM to the
    process group ends the workers too).
    """

    def __init__(self, cfg: RunCfg, pool: SharedArrays, params: ParamBlock, *, max_restarts: int = 0,
                 on_restart: Callable[[int], Any] | None = None, stopping: Callable[[], bool] | None = None):
        self.cfg, self.pool, self.params = cfg, pool, params
        self.restart_budget = RestartBudget(max_restarts)
        self.on_restart = on_restart or (lambda dropped_steps: None)
        self.stopping = stopping or (lambda: False)
        count = cfg.env.num_workers
        self.processes: list[subprocess.Popen | None] = [None] * count
        self.command_fds: list[int] = [-1] * count
        self.reply_fds: dict[int, int] = {}  # reply fd -> worker index
        self.lives = [0] * count
        """Restarts of each worker so far (its current life)."""
        self.delivered = [False] * count
        """Whether each worker's current process has sent a batch (else it may still be starting up)."""
        self.held: set[int] = set()
        """Slots the learner holds: sent by their worker, not yet released."""
        self.poller = select.poll()
        self.ready: deque[int] = deque()
        try:
            for index in range(count):
                self._start(index)
        except BaseException:
            self.close()
            raise

    def _slots(self, index: int) -> range:
        return range(index * SLOTS_PER_WORKER, (index + 1) * SLOTS_PER_WORKER)

    def _start(self, index: int) -> None:
        command_read, command_write = os.pipe()
        reply_read, reply_write = os.pipe()
        spec = {"index": index, "life": self.lives[index], "cfg": self.cfg.to_dict(),
                "pool_fd": self.pool.fd, "pool": [list(s) for s in self.pool.specs], "params_fd": self.params.fd,
                "command_fd": command_read, "reply_fd": reply_write,
                "free": [slot for slot in self._slots(index) if slot not in self.held],
                "env_errors_base": int(self.pool["env_errors"][index])}
        process = start_child(_WORKER_ENTRY, spec, (self.pool.fd, self.params.fd, command_read, reply_write))
        os.close(command_read)
        os.close(reply_write)
        self.processes[index] = process
        self.delivered[index] = False
        self.command_fds[index] = command_write
        self.reply_fds[reply_read] = index
        self.poller.register(reply_read, select.POLLIN)

    def next_slot(self, timeout_s: float) -> int | None:
        """The oldest ready slot, waiting up to ``timeout_s``; None if none came. Restarts dead workers;
        raises ``WorkerFailure`` if a worker failed or a restart is not allowed."""
        if not self.ready:
            events = self.poller.poll(int(timeout_s * 1000))
            for fd, _ in events:
                index = self.reply_fds[fd]
                if not self._receive(index, os.read(fd, 64)):
                    self._restart(index)
            if not events:
                for index, process in enumerate(self.processes):
                    if process is not None and process.poll() is not None:
                        self._restart(index)
        return self.ready.popleft() if self.ready else None

    def release(self, slot: int) -> None:
        """Hand ``slot`` back to its worker (to a restarted one if its worker died meanwhile)."""
        index, local = divmod(slot, SLOTS_PER_WORKER)
        self.held.discard(slot)
        try:
            os.write(self.command_fds[index], bytes([local]))
        except BrokenPipeError:
            self._restart(index)  # the slot is free again: the new process starts with it

    def _receive(self, index: int, data: bytes) -> bool:
        """Queue the ready slots named in ``data`` (from worker ``index``); False at end of file."""
        if FATAL in data:
            reap([self.processes[index]])
            raise WorkerFailure(self._end(index, "failed"), read_message(self.pool["message"][index])[1])
        self.delivered[index] = self.delivered[index] or bool(data)
        for local in data:
            slot = index * SLOTS_PER_WORKER + local
            self.pool["slot_steps"][slot] = 0
            self.held.add(slot)
            self.ready.append(slot)
        return bool(data)

    def _restart(self, index: int) -> None:
        """Worker ``index`` died: keep the batches it sent, drop what it half wrote, start a new process."""
        reap([self.processes[index]])  # its pipe closed: it is exiting, or it lingers and is killed
        reply_fd = next(fd for fd, owner in self.reply_fds.items() if owner == index)
        while self._receive(index, os.read(reply_fd, 64)):  # the writer is gone: this ends at end of file
            pass
        unfinished = [slot for slot in self._slots(index) if slot not in self.held]
        dropped = int(self.pool["slot_steps"][unfinished].sum()) * self.cfg.env.envs_per_worker
        self.pool["slot_steps"][unfinished] = 0
        death = self._end(index, "died")
        if self.stopping():
            raise WorkerFailure(f"{death} while the run was stopping")
        self.restart_budget.spend(death)
        self.pool["message"][index] = 0
        self.poller.unregister(reply_fd)
        os.close(reply_fd)
        del self.reply_fds[reply_fd]
        os.close(self.command_fds[index])
        self.lives[index] += 1
        self._start(index)
        self.on_restart(dropped)

    def _end(self, index: int, verb: str) -> str:
        """How worker ``index`` ended, in a line: the worker (index, pid, envs), ``verb`` with its exit reason,
        its message's one line (``read_message``)."""
        process, E = self.processes[index], self.cfg.env.envs_per_worker
        line = read_message(self.pool["message"][index])[0]
        said = f": {line}" if line else ""
        return (f"impact worker {index} (pid {process.pid}, envs {index * E}-{index * E + E - 1}) "
                f"{verb} ({exit_reason(process.poll())}){said}")

    def close(self) -> None:
        """Close the command pipes (workers stop at their next step; ones still starting up, which would only
        notice once started, get SIGTERM), wait, kill stragglers."""
        # A terminated worker's env worker sees its pipes close and exits too.
        terminate(process for process, delivered in zip(self.processes, self.delivered)
                  if process is not None and not delivered)
        close_children([process for process in self.processes if process is not None],
                       [fd for fd in self.command_fds if fd >= 0])
        self.command_fds = [-1] * len(self.command_fds)
        for fd in self.reply_fds:
            os.close(fd)
        self.reply_fds = {}
        self.processes = [None] * len(self.processes)
