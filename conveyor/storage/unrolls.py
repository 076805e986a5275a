"""Per-env partial unrolls kept on the learner, and the queue of finished ones (SEED RL).

In SEED the actors keep nothing: every step of every env arrives at the
learner, which appends it to that env's partial unroll. ``PartialUnrolls``
owns one marker-filled buffer per env slot ``[slots, T + 1, ...]`` for every
field and a cursor per slot. When a slot holds T acted steps and the next
observation arrives, the unroll is complete: the sink gets it (views, valid
during the call) and the slot starts its next unroll from that observation
(SEED/IMPALA unrolls share their boundary observation). With
``overlap > 0`` the next unroll starts ``overlap`` steps earlier instead, so
consecutive sequences overlap (R2D2 stores 80-step sequences overlapping by
40). Besides its fields, each unroll handed to the sink holds ``continues``
(a bool scalar): it starts with the last ``overlap + 1`` observations of the
unroll the slot emitted before (False for a slot's first unroll and after
``reset``), which lets R2D2's replay store the shared steps once.

Fields are ``FieldSpec``s of a ``RolloutSchema`` (``conveyor.storage.schema``),
whose time kind says what a finished unroll holds: ``obs`` fields
``[T + 1, ...]``, ``step`` fields ``[T, ...]``, ``start`` fields ``[...]``
(written each step, emitted only at the unroll's first step: the recurrent
state the unroll starts from).

``UnrollQueue`` is the FIFO between inference and training: a pool of
``capacity`` unroll slots (it owns the memory) and free/full queues that
move only indices (TorchBeast's monobeast). ``put`` copies a finished unroll
into a free slot, blocking while none is free, which throttles the actors
when the learner falls behind; ``get_batch`` stacks ``batch_size`` full
slots time-major ``[T(+1), B, ...]`` and frees them.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch
from torch import Tensor

from conveyor.storage.schema import FieldSpec, marker_tensor

Unroll = dict[str, Tensor]
UnrollSink = Callable[[int, Unroll], None]
"""``sink(slot, unroll)``: receives each finished unroll (views; copy what you keep)."""
CountedSink = Callable[[int, Unroll, Callable[[], None]], None]
"""``sink(slot, unroll, on_stored)``: an ``UnrollSink`` that calls ``on_stored()`` once it has stored the unroll and
before the training side can take it (``UnrollQueue.put``), and never for an unroll it drops."""


class PartialUnrolls:
    """Every env slot's unroll in progress (see the module docstring). Not thread-safe: one inference
    thread owns it."""

    def __init__(self, unroll: int, fields: dict[str, FieldSpec], sink: UnrollSink, *, overlap: int = 0,
                 initial_slots: int = 0) -> None:
        if not 0 <= overlap < unroll:
            raise ValueError(f"overlap ({overlap}) must lie in [0, unroll = {unroll})")
        self.T = unroll
        self.overlap = overlap
        self.fields = dict(fields)
        self.sink = sink
        self.num_slots = 0
        self.buffers: dict[str, Tensor] = {name: self._new(name, 0) for name in self.fields}
        self.cursor = torch.zeros(0, dtype=torch.int64)
        self.continued = torch.zeros(0, dtype=torch.bool)  # per slot: the unroll in progress continues the last one
        self.grow(initial_slots)

    def _new(self, name: str, slots: int) -> Tensor:
        spec = self.fields[name]
        return marker_tensor((slots, self.T + 1, *spec.shape), spec.dtype)

    def grow(self, num_slots: int) -> None:
        """Make room for slots ``[0, num_slots)`` (capacity doubles, so growth is amortized)."""
        if num_slots <= self.num_slots:
            return
        capacity = max(num_slots, 2 * self.num_slots)
        for name, old in self.buffers.items():
            new = self._new(name, capacity)
            new[: self.num_slots] = old
            self.buffers[name] = new
        cursor = torch.zeros(capacity, dtype=torch.int64)
        cursor[: self.num_slots] = self.cursor
        self.cursor = cursor
        continued = torch.zeros(capacity, dtype=torch.bool)
        continued[: self.num_slots] = self.continued
        self.continued = continued
        self.num_slots = capacity

    def write(self, name: str, slots: Tensor, values: Tensor, offset: int = 0) -> None:
        """Write ``values [n, ...]`` at each slot's current step (``offset=-1``: the step before it)."""
        self.buffers[name][slots, self.cursor[slots] + offset] = values.to(self.buffers[name].dtype)

    def advance(self, slots: Tensor) -> None:
        """The slots have acted at their current step; move to the next one."""
        self.cursor[slots] += 1

    def emit_full(self, slots: Tensor) -> int:
        """Hand every slot in ``slots`` that holds T acted steps to the sink and start its next unroll.

        Call after writing the new observation's ``obs`` fields at the current step (index T).
        Returns how many unrolls were emitted.
        """
        full = slots[self.cursor[slots] == self.T]
        for slot in full.tolist():
            self.sink(slot, self._view(slot))
        if len(full):
            keep = slice(self.T - self.overlap, self.T + 1)
            for buffer in self.buffers.values():
                buffer[full, : self.overlap + 1] = buffer[full, keep]
            self.cursor[full] = self.overlap
            self.continued[full] = True
        return len(full)

    def _view(self, slot: int) -> Unroll:
        unroll = {}
        for name, spec in self.fields.items():
            buffer = self.buffers[name][slot]
            unroll[name] = {"obs": buffer, "step": buffer[: self.T], "start": buffer[0]}[spec.kind]
        unroll["continues"] = self.continued[slot]
        return unroll

    def reset(self, slots: Tensor) -> int:
        """Drop the slots' partial unrolls (refilled with markers); returns how many held acted steps."""
        slots = slots[slots < self.num_slots]
        dropped = int((self.cursor[slots] > 0).sum())
        for name, buffer in self.buffers.items():
            buffer[slots] = self._new(name, 1)
        self.cursor[slots] = 0
        self.continued[slots] = False
        return dropped

    def steps(self, slot: int) -> int:
        """Acted steps in ``slot``'s partial unroll."""
        return int(self.cursor[slot]) if slot < self.num_slots else 0


class UnrollQueue:
    """Finished unrolls between the inference thread and the training loop (see the module docstring)."""

    def __init__(self, unroll: int, fields: dict[str, FieldSpec], capacity: int,
                 stop: threading.Event | None = None) -> None:
        self.T = unroll
        self.fields = dict(fields)
        self.capacity = capacity
        self.stop = stop or threading.Event()
        self.pool = {name: marker_tensor((capacity, *spec.time_dims(unroll), *spec.shape), spec.dtype)
                     for name, spec in self.fields.items()}
        self._free: queue.Queue[int] = queue.Queue()
        self._full: queue.Queue[int] = queue.Queue()
        for index in range(capacity):
            self._free.put(index)

    def put(self, slot: int, unroll: Unroll, on_stored: Callable[[], None] | None = None,
            poll_s: float = 0.1) -> bool:
        """Copy ``unroll`` into a free pool slot; waits while none is free. False when stopped first.
        ``on_stored()`` runs once it is copied, before ``get_batch`` can take it (a ``CountedSink``)."""
        while not self.stop.is_set():
            try:
                index = self._free.get(timeout=poll_s)
            except queue.Empty:
                continue
            for name, tensor in self.pool.items():
                tensor[index].copy_(unroll[name])
            if on_stored is not None:
                on_stored()
            self._full.put(index)
            return True
        return False

    def get_batch(self, batch_size: int, poll_s: float = 0.1) -> dict[str, Tensor] | None:
        """``batch_size`` unrolls stacked time-major (``start`` fields: ``[B, ...]``); None once stopped.

        Waits until that many have arrived, checking the stop event every ``poll_s``.
        """
        taken: list[int] = []
        while len(taken) < batch_size:
            if self.stop.is_set():
                for index in taken:  # hand them back: nothing is lost by the wait
                    self._full.put(index)
                return None
            try:
                taken.append(self._full.get(timeout=poll_s))
            except queue.Empty:
                continue
        indices = torch.tensor(taken)
        batch = {}
        for name, spec in self.fields.items():
            rows = self.pool[name].index_select(0, indices)
            batch[name] = rows if spec.kind == "start" else rows.transpose(0, 1).contiguous()
        for index in taken:
            self._free.put(index)
        return batch

    def __len__(self) -> int:
        return self._full.qsize()

    def close(self) -> None:
        self.stop.set()


class Prefetcher:
    """A thread that assembles the next training batches while the learner trains (SEED's prefetch
    thread): ``depth`` batches of ``batch_size`` unrolls wait, already on ``device``."""

    def __init__(self, source: UnrollQueue, batch_size: int, device: torch.device | str = "cpu",
                 depth: int = 1) -> None:
        self.source = source
        self.batch_size = batch_size
        self.device = torch.device(device)
        self._ready: queue.Queue[dict[str, Tensor]] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="seed-prefetch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                batch = self.source.get_batch(self.batch_size)
                if batch is None:
                    return
                batch = {name: tensor.to(self.device, non_blocking=True) for name, tensor in batch.items()}
                while not self.source.stop.is_set():
                    try:
                        self._ready.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as error:  # surfaced by get(), so a bug here stops the run loudly
            self.error = error

    def get(self, timeout_s: float) -> dict[str, Tensor] | None:
        """The next batch, or None when none is ready within ``timeout_s``."""
        if self.error is not None:
            raise RuntimeError(f"the prefetch thread failed: {self.error!r}") from self.error
        try:
            return self._ready.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.source.close()
        self._thread.join(timeout=5.0)
