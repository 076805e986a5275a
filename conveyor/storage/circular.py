"""IMPACT's circular buffer C(N, K) (Luo et al. 2020, section 3.2 and algorithm 1).

The buffer owns N batch positions. The learner walks them round-robin: each
``take`` returns the batch at the cursor and advances. A batch is returned at
most K times; after its K-th use its position is empty, and the next time the
cursor reaches it ``needs_batch`` is true and the learner must ``put`` the
next worker batch there before it can ``take`` again. So positions are
refilled in cyclic order 0, 1, ..., N-1, 0, ... with batches in arrival order,
and over N * K updates the learner sees N batches K times each, like PPO's
K epochs over N minibatches.

On a batch's first use ``take`` calls ``attach`` once and stores what it
returns (IMPACT: the target network's log-probs) with the batch, so later
uses see the same values.

Storage is allocated on the first ``put`` from that batch's shapes and
dtypes, filled with marker values (``marker_tensor``), so a field nobody
wrote shows at once.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

from conveyor.storage.schema import marker_tensor

Batch = dict[str, Tensor]
Attach = Callable[[Batch], Batch]


class CircularBuffer:
    def __init__(self, num_batches: int, replay_times: int, device: torch.device | str = "cpu"):
        if num_batches < 1 or replay_times < 1:
            raise ValueError(f"CircularBuffer needs N >= 1 and K >= 1, got N={num_batches}, K={replay_times}")
        self.num_batches = num_batches
        self.replay_times = replay_times
        self.device = torch.device(device)
        self.cursor = 0
        self.uses = [0] * num_batches
        """Times the batch at each position has been taken."""
        self.filled = [False] * num_batches
        self.batches_put = 0
        self.batches_taken = 0
        self._storage: Batch = {}

    def needs_batch(self) -> bool:
        """True when the position at the cursor is empty: ``put`` a new batch before the next ``take``."""
        return not self.filled[self.cursor]

    def put(self, batch: dict[str, Tensor | np.ndarray]) -> None:
        """Copy ``batch`` into the empty position at the cursor (the buffer keeps no reference to it)."""
        if not self.needs_batch():
            raise RuntimeError(f"CircularBuffer.put: position {self.cursor} still holds a batch used "
                               f"{self.uses[self.cursor]} of {self.replay_times} times")
        tensors = {name: torch.as_tensor(value) for name, value in batch.items()}
        self._store(tensors)
        self.uses[self.cursor] = 0
        self.filled[self.cursor] = True
        self.batches_put += 1

    def take(self, attach: Attach | None = None) -> tuple[Batch, int]:
        """The batch at the cursor and how many times it was taken before; advances the cursor.

        ``attach(batch)`` runs on the batch's first use only; its tensors are
        stored with the batch. The returned tensors are views into the
        buffer, valid until the next ``put``.
        """
        position = self.cursor
        if not self.filled[position]:
            raise RuntimeError(f"CircularBuffer.take: position {position} is empty; put a batch first")
        uses = self.uses[position]
        if uses == 0 and attach is not None:
            self._store(attach(self._view(position)))
        batch = self._view(position)
        self.uses[position] = uses + 1
        if self.uses[position] >= self.replay_times:
            self.filled[position] = False  # the next put replaces it
        self.cursor = (position + 1) % self.num_batches
        self.batches_taken += 1
        return batch, uses

    def _view(self, position: int) -> Batch:
        return {name: storage[position] for name, storage in self._storage.items()}

    def _store(self, tensors: Batch) -> None:
        for name, value in tensors.items():
            storage = self._storage.get(name)
            if storage is None:
                storage = marker_tensor((self.num_batches, *value.shape), value.dtype, self.device)
                self._storage[name] = storage
            if storage.shape[1:] != value.shape or storage.dtype != value.dtype:
                raise ValueError(f"CircularBuffer: {name} is {value.dtype}{list(value.shape)}, the buffer holds "
                                 f"{storage.dtype}{list(storage.shape[1:])}")
            storage[self.cursor].copy_(value)
