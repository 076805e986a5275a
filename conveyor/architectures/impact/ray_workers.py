"""IMPACT workers as Ray actors (``--launcher ray``): ``Workers``' job, across a Ray cluster's nodes.

A Ray worker (``collector.ImpactRayWorker``) is the same ``BatchCollector`` a worker process runs (same
envs, seeds, policy copy and batches); only the transport differs, since
shared memory does not cross machines. The learner keeps
``SLOTS_PER_WORKER`` ``collect`` calls queued on each worker (the worker
fills one batch while the learner holds its other one, as with processes);
a call returns the batch's arrays through Ray's object store, and
``RayWorkers`` copies them into the same slot of the learner's pool that a
process worker would have written, so the training loop reads slots exactly
as before. Weights go the other way: each call names the newest published
parameters (read from the ``ParamBlock``, put into the object store once
per version); a worker loads them before its batch when their version has
moved. A worker so acts with the weights published when its call was made,
at most one batch older than a process worker's.

Deaths: a worker whose process died (``kill -9``, its node lost) or whose
own env worker died fails its calls; ``RayWorkers`` then starts a new one in
the same placement bundle (life + 1: fresh env seeds, ``worker_seeds``) with
the newest weights, up to ``--max-restarts`` over the run, and reports the
batch it was filling as dropped (``S x E`` steps: a Ray worker does not say
how far it got). Batches it had returned are kept. A worker that raised
(a bad observation, too many env errors) stops the run with its message.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Any, Callable

import torch

from conveyor.architectures.impact.params import ParamBlock
from conveyor.architectures.impact.collector import SLOTS_PER_WORKER, ImpactRayWorker, batch_fields
from conveyor.config import RunCfg
from conveyor.errors import WorkerDied, WorkerFailure
from conveyor.procs import RestartBudget
from conveyor.ray_launcher import RayLauncher
from conveyor.storage.shm import SharedArrays


class RayWorkers:
    """``cfg.env.num_workers`` IMPACT workers as Ray actors, with ``Workers``' interface: ``next_slot`` hands
    the learner ready slots of ``pool``, ``release`` gives one back; ``on_restart(dropped_steps)`` per
    restart."""

    def __init__(self, cfg: RunCfg, pool: SharedArrays, params: ParamBlock, launcher: RayLauncher,
                 model: torch.nn.Module, *, max_restarts: int = 0, on_restart: Callable[[int], Any] | None = None,
                 stopping: Callable[[], bool] | None = None) -> None:
        self.cfg, self.pool, self.params, self.launcher, self.ray = cfg, pool, params, launcher, launcher.ray
        self.restart_budget = RestartBudget(max_restarts)
        self.on_restart = on_restart or (lambda dropped_steps: None)
        self.stopping = stopping or (lambda: False)
        self.shadow = copy.deepcopy(model)  # reads the published weights out of the ParamBlock
        self.published: list[Any] = [-1, None]
        fields = (*batch_fields(cfg), "episode_return")
        self.specs = {spec.name: (tuple(spec.shape[1:]), spec.dtype) for spec in pool.specs if spec.name in fields}
        self.errors_base = [0] * cfg.env.num_workers  # env errors of each worker's earlier lives
        self.pending: dict[Any, int] = {}  # call -> slot it fills
        self.held: set[int] = set()
        self.ready: deque[int] = deque()
        workers = range(cfg.env.num_workers)
        started = launcher.start_all(ImpactRayWorker, {index: self._args(index) for index in workers})
        self.handles = [started[index] for index in workers]
        for index in workers:
            self._fill(index)

    def _args(self, index: int) -> tuple[Any, ...]:
        return self.cfg.to_dict(), index, self.launcher.next_life(index)

    def _fill(self, index: int) -> None:
        """Queue worker ``index``'s calls: one per slot of its own that the learner does not hold."""
        for slot in range(index * SLOTS_PER_WORKER, (index + 1) * SLOTS_PER_WORKER):
            if slot not in self.held:
                self._submit(self.handles[index], slot)

    def _submit(self, handle: Any, slot: int) -> None:
        if self.params.version > self.published[0]:
            version = self.params.read_into(self.shadow)
            state = {name: tensor.detach().cpu().numpy() for name, tensor in self.shadow.state_dict().items()}
            self.published = [version, self.ray.put(state)]
        self.pending[handle.collect.remote(self.published, self.specs)] = slot

    def next_slot(self, timeout_s: float) -> int | None:
        """The oldest ready slot, waiting up to ``timeout_s``; None if none came. Restarts dead workers;
        raises ``WorkerFailure`` if a worker failed or a restart is not allowed."""
        if not self.ready and self.pending:
            done, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=timeout_s)
            for call in done:
                self._receive(call)
        return self.ready.popleft() if self.ready else None

    def release(self, slot: int) -> None:
        """Give ``slot`` back: its worker's next call fills it."""
        self.held.discard(slot)
        self._submit(self.handles[slot // SLOTS_PER_WORKER], slot)

    def _receive(self, call: Any) -> None:
        slot = self.pending.pop(call)
        index = slot // SLOTS_PER_WORKER
        try:
            reply = self.ray.get(call)
        except self.ray.exceptions.RayActorError as error:
            self._restart(index, type(error).__name__)
            return
        except self.ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, WorkerDied):  # its env worker died: a death, restarted like any other
                self._restart(index, str(error.cause).splitlines()[0])
                return
            said = (str(error.cause).strip().splitlines() or [type(error.cause).__name__])[-1]
            raise WorkerFailure(f"{self.launcher.describe(index)} failed: {said}") from None
        for name, array in reply["batch"].items():
            self.pool[name][slot] = array
        self.pool["seconds"][slot] = reply["seconds"]
        self.pool["env_errors"][index] = self.errors_base[index] + reply["env_errors"]
        self.held.add(slot)
        self.ready.append(slot)

    def _restart(self, index: int, reason: str) -> None:
        """Worker ``index`` died: drop its calls in flight (the batch it was filling is lost), start a new one."""
        death = f"{self.launcher.describe(index)} died ({reason})"
        if self.stopping():
            raise WorkerFailure(f"{death} while the run was stopping")
        self.restart_budget.spend(death)
        lost = [call for call, slot in self.pending.items() if slot // SLOTS_PER_WORKER == index]
        for call in lost:
            del self.pending[call]
        self.errors_base[index] = int(self.pool["env_errors"][index])
        self.handles[index] = self.launcher.start(index, ImpactRayWorker, *self._args(index))
        self._fill(index)
        self.on_restart(self.cfg.arch.worker_batch * self.cfg.env.envs_per_worker if lost else 0)

    def close(self) -> None:
        """The launcher kills the workers (their envs with them)."""
        self.pending.clear()
