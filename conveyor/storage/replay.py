"""Prioritized sequence replay for R2D2 (Kapturowski et al. 2019; SEED RL section 3.2).

``SequenceReplay`` holds ``capacity`` fixed-length sequences in preallocated,
marker-filled, time-major tensors (``obs [L + 1, capacity, ...]``: gathering
a batch of sequences is one ``index_select`` per field that already comes out
``[L + 1, B, ...]``). Sampling is proportional to ``priority ** alpha`` through
a ``SumTree``; importance weights ``(N P(i)) ** -beta`` are normalized by their
batch maximum (Ape-X / R2D2). New sequences enter with the largest priority
seen so far (Schaul et al. 2015), so each is likely to be replayed once before
the learner has measured its TD error.

Sequences come from the per-env streams of the acting side (SEED:
``storage.unrolls.PartialUnrolls`` with ``overlap``, whose sink is ``add``):
``L`` steps (``L + 1`` observations), the recurrent state the actor used at
the first step, and the LSTM inputs it used at every step (``first`` flags
that reset the core, previous action, previous reward). Sequences cross
episode boundaries: the ``first`` flag resets the core there and the zero
discount of the terminal step stops the n-step target.

Sequence keys, as ``sample`` returns them (time-major, ``B`` sequences):

- observation-aligned, ``L + 1`` steps: ``obs``, ``first`` (bool: this step
  starts an episode), ``prev_action``, ``prev_reward``;
- transition-aligned, ``L`` steps: ``actions``, ``rewards``, ``discounts``
  (``gamma * (1 - terminated)``), ``policy_version``;
- ``state_h``, ``state_c`` ``[B, H]``: the LSTM state before step 0;
- ``weights [B]``: importance weights; ``ids [B]`` (int64, CPU): the
  sequence ids to pass back to ``update_priorities``.
"""

from __future__ import annotations

import threading
import numpy as np
import torch
from torch import Tensor

from conveyor.config import ConfigError
from conveyor.storage.schema import marker_tensor
from conveyor.storage.sum_tree import SumTree

STATE_KEYS = ("state_h", "state_c")

# A zero TD error must not make a sequence unreachable forever.
MIN_PRIORITY = 1e-6


def _field_specs(seq_len: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype,
                 lstm_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-sequence shape (time first) and dtype of every stored field."""
    L = seq_len
    return {
        "obs": ((L + 1, *obs_shape), obs_dtype),
        "first": ((L + 1,), torch.bool),
        "prev_action": ((L + 1,), torch.int64),
        "prev_reward": ((L + 1,), torch.float32),
        "actions": ((L,), torch.int64),
        "rewards": ((L,), torch.float32),
        "discounts": ((L,), torch.float32),
        "policy_version": ((L,), torch.int64),
        "state_h": ((lstm_size,), torch.float32),
        "state_c": ((lstm_size,), torch.float32),
    }


def sequence_bytes(seq_len: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype, lstm_size: int) -> int:
    """Bytes one stored sequence takes."""
    return sum(int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in _field_specs(seq_len, obs_shape, obs_dtype, lstm_size).values())


def replay_bytes_needed(capacity: int, seq_len: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype,
                        lstm_size: int) -> int:
    """Bytes a ``SequenceReplay`` of this shape allocates (sequences and sum-tree)."""
    tree_leaves = 1 << max(1, int(np.ceil(np.log2(capacity))))
    return capacity * sequence_bytes(seq_len, obs_shape, obs_dtype, lstm_size) + 2 * tree_leaves * 8


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_replay_fits(capacity: int, seq_len: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype,
                      lstm_size: int, budget_bytes: int) -> int:
    """Raise ``ConfigError`` unless the replay fits ``budget_bytes`` and the memory available now; returns its size."""
    need = replay_bytes_needed(capacity, seq_len, obs_shape, obs_dtype, lstm_size)
    each = sequence_bytes(seq_len, obs_shape, obs_dtype, lstm_size)
    shape = f"replay_capacity {capacity} x seq_len {seq_len} (obs {tuple(obs_shape)} {obs_dtype}, {each:,} bytes each)"
    if need > budget_bytes:
        raise ConfigError(f"replay needs {need:,} bytes for {shape} > replay_bytes {budget_bytes:,}: "
                          "lower --replay-capacity or --seq-len, or raise --replay-bytes")
    available = available_memory_bytes()
    if available is not None and need > available:
        raise ConfigError(f"replay needs {need:,} bytes for {shape} but only {available:,} bytes of memory are "
                          "available: lower --replay-capacity or --seq-len")
    return need


def _gather(stored: Tensor, dim: int, index: Tensor) -> Tensor:
    """``stored.index_select(dim, index)``, done on a view whose trailing dims are one (fewer, longer copies)."""
    flat = stored.reshape(*stored.shape[: dim + 1], -1)
    return flat.index_select(dim, index).view(*stored.shape[:dim], len(index), *stored.shape[dim + 1:])


class SequenceReplay:
    """Prioritized replay of fixed-length sequences; thread-safe (one lock around every operation).

    Sequences are named by ids: the running count of insertions. Slot
    ``id % capacity`` holds the sequence, so ``update_priorities`` can tell
    (and skip) ids whose slot a newer sequence has taken since they were sampled.
    """

    def __init__(self, capacity: int, seq_len: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype,
                 lstm_size: int, *, priority_exponent: float = 0.9, importance_exponent: float = 0.6):
        if capacity < 1 or seq_len < 1 or lstm_size < 1:
            raise ValueError(f"SequenceReplay needs capacity, seq_len and lstm_size >= 1, "
                             f"got {capacity}, {seq_len}, {lstm_size}")
        self.capacity, self.seq_len, self.lstm_size = capacity, seq_len, lstm_size
        self.obs_shape, self.obs_dtype = tuple(obs_shape), obs_dtype
        self.priority_exponent = priority_exponent
        self.importance_exponent = importance_exponent
        self.specs = _field_specs(seq_len, self.obs_shape, obs_dtype, lstm_size)
        # Time-major: field [time..., capacity, ...] for sequence fields, [capacity, H] for states.
        self.fields: dict[str, Tensor] = {}
        for key, (shape, dtype) in self.specs.items():
            stored = (capacity, *shape) if key in STATE_KEYS else (shape[0], capacity, *shape[1:])
            self.fields[key] = marker_tensor(stored, dtype)
        self.tree = SumTree(capacity)
        self.max_priority = 1.0
        self.inserted = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return min(self.inserted, self.capacity)

    @property
    def nbytes(self) -> int:
        return sum(t.element_size() * t.nelement() for t in self.fields.values()) + self.tree.nbytes

    def insert(self, sequences: dict[str, Tensor]) -> np.ndarray:
        """Store ``M`` sequences given sequence-first (``obs [M, L + 1, ...]``, ``actions [M, L]``,
        ``state_h [M, H]``...); evicts the oldest when full; returns their ids ``[M]``."""
        count = len(sequences["obs"])
        if count > self.capacity:
            raise ValueError(f"cannot insert {count} sequences into a replay of capacity {self.capacity}")
        for key, (shape, _) in self.specs.items():
            if tuple(sequences[key].shape) != (count, *shape):
                raise ValueError(f"sequence field {key} has shape {tuple(sequences[key].shape)}, "
                                 f"expected {(count, *shape)}")
        with self._lock:
            ids = np.arange(self.inserted, self.inserted + count, dtype=np.int64)
            start = self.inserted % self.capacity
            head = min(count, self.capacity - start)
            # Consecutive slots, in at most two runs (the second after wrapping around): plain slice copies.
            runs = ((slice(start, start + head), slice(0, head)), (slice(0, count - head), slice(head, count)))
            for slots, rows in runs:
                for key, stored in self.fields.items():
                    value = sequences[key][rows]
                    if key in STATE_KEYS:
                        stored[slots] = value
                    else:
                        stored[:, slots] = value.transpose(0, 1)
            self.tree.update(ids % self.capacity, np.full(count, self.max_priority ** self.priority_exponent))
            self.inserted += count
        return ids

    def add(self, sequence: dict[str, Tensor]) -> int:
        """Store one sequence given time-first (``obs [L + 1, ...]``, ``state_h [H]``...); returns its id.
        Copies, so ``sequence`` may be a view into a buffer that is reused afterwards."""
        return int(self.insert({key: sequence[key].unsqueeze(0) for key in self.specs})[0])

    def sample(self, batch_size: int, rng: np.random.Generator,
               device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """``batch_size`` sequences drawn proportionally to ``priority ** alpha`` (stratified), as a batch
        (see the module docstring) on ``device``."""
        with self._lock:
            size = len(self)
            if size == 0:
                raise ValueError("cannot sample from an empty replay")
            slots = self.tree.sample(batch_size, rng)
            probs = self.tree[slots] / self.tree.total
            # The id of the sequence now in each slot: the last insertion that landed there.
            ids = self.inserted - 1 - (self.inserted - 1 - slots) % self.capacity
            index = torch.from_numpy(slots)
            batch = {key: _gather(stored, 0 if key in STATE_KEYS else 1, index) for key, stored in self.fields.items()}
        weights = (size * probs) ** -self.importance_exponent
        batch["weights"] = torch.from_numpy(weights / weights.max()).float()
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        batch["ids"] = torch.from_numpy(ids)
        return batch

    def update_priorities(self, ids: np.ndarray | Tensor, priorities: np.ndarray | Tensor) -> int:
        """Set the priorities of sampled sequences (R2D2: ``eta max|delta| + (1 - eta) mean|delta|``);
        ids evicted since sampling are skipped. Returns how many were written."""
        if isinstance(priorities, Tensor):
            priorities = priorities.detach().cpu().double().numpy()
        priorities = np.asarray(priorities, dtype=np.float64).reshape(-1)
        ids = np.asarray(ids.cpu() if isinstance(ids, Tensor) else ids, dtype=np.int64).reshape(-1)
        if ids.shape != priorities.shape:
            raise ValueError(f"update_priorities: {len(ids)} ids but {len(priorities)} priorities")
        if not np.all(np.isfinite(priorities)):
            raise ValueError("update_priorities: priorities must be finite (a NaN TD error reached replay)")
        priorities = np.maximum(priorities, MIN_PRIORITY)
        with self._lock:
            live = ids >= self.inserted - self.capacity
            if live.any():
                self.tree.update(ids[live] % self.capacity, priorities[live] ** self.priority_exponent)
                self.max_priority = max(self.max_priority, float(priorities[live].max()))
            return int(live.sum())

    def priorities_of(self, ids: np.ndarray) -> np.ndarray:
        """The stored ``priority ** alpha`` of live ids (for tests and diagnostics)."""
        with self._lock:
            return self.tree[np.asarray(ids) % self.capacity]
