"""Prioritized sequence replay for R2D2 (Kapturowski et al. 2019; SEED RL section 3.2) that stores each frame once.

Sequences come from the per-env streams of the acting side (SEED:
``storage.unrolls.PartialUnrolls`` with ``overlap``, whose sink is ``add``):
``L`` steps (``L + 1`` observations), the recurrent state the actor used at
the first step, and the LSTM inputs it used at every step (``first`` flags
that reset the core, previous action, previous reward). Consecutive
sequences of a stream share ``overlap + 1`` observations, and a frame-stacked
observation (Atari ``[K, 84, 84]``, oldest frame first) repeats the previous
``K - 1`` frames: storing sequences whole would keep each frame about
``K * L / (L - overlap)`` times.

Storage (all preallocated and marker-filled):

- the ring: ``capacity`` env steps, written in order; step ``s`` (its
  *stamp*: the running count of steps written) lives at ``s % capacity``.
  Per step: the newest frame of its observation (``frame``; the whole
  observation when ``frame_stack`` is 1), ``first``, ``prev_action``,
  ``prev_reward``, the transition it starts (``actions``, ``rewards``,
  ``discounts`` = ``gamma * (1 - terminated)``, ``policy_version``), and
  ``prev``: the stamp of the frame before it in its observation's stack.
  ``prev`` is the previous step of the stream, or the step itself where an
  episode starts (the env's frame stack repeats its reset frame: gymnasium
  ``FrameStackObservation(padding_type="reset")``, checked on insert); a
  stream's first sequence writes the ``K - 1`` older frames of its first
  observation as padding steps first, so even a stream that starts
  mid-episode is rebuilt exactly;
- the sequence table (``sequence_slots`` rows): each sequence's ``L + 1``
  observation stamps, the stamp of the oldest frame it needs, its id and
  start state. A sequence that continues its stream's previous one writes
  only its ``L - overlap`` new steps (and the transition of the shared
  boundary step); one whose predecessor is gone is written whole.

``sample`` rebuilds the stacked observations with ``K - 1`` vectorized hops
along ``prev`` and one ``index_select`` of frames. A sequence is evicted
(priority 0, never sampled again) as soon as the ring write passes its
oldest frame. Sampling is proportional to ``priority ** alpha`` through a
``SumTree``; importance weights ``(N P(i)) ** -beta`` (N: live sequences)
are normalized by their batch maximum (Ape-X / R2D2). New sequences enter
with the largest priority seen so far (Schaul et al. 2015), so each is
likely to be replayed once before the learner has measured its TD error.

Sequence keys, as ``sample`` returns them (time-major, ``B`` sequences):

- observation-aligned, ``L + 1`` steps: ``obs``, ``first`` (bool: this step
  starts an episode), ``prev_action``, ``prev_reward``;
- transition-aligned, ``L`` steps: ``actions``, ``rewards``, ``discounts``,
  ``policy_version``;
- ``state_h``, ``state_c`` ``[B, H]``: the LSTM state before step 0;
- ``weights [B]``: importance weights; ``ids [B]`` (int64, CPU): the
  sequence ids to pass back to ``update_priorities``.

``state_dict`` / ``load_state_dict`` carry everything but the streams'
continuation (a resumed run's streams start afresh) into checkpoints: plain
tensors and numbers, the frames ``zlib``-compressed.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any

import numpy as np
import torch
from torch import Tensor

from conveyor.errors import ConfigError
from conveyor.storage.schema import STATE_KEYS, marker_tensor
from conveyor.storage.sum_tree import SumTree

OBS_KEYS = ("first", "prev_action", "prev_reward")
STEP_KEYS = ("actions", "rewards", "discounts", "policy_version")

ZLIB_CHUNK = 64 * 1024**2  # frame bytes (de)compressed at a time for checkpoints
ZLIB_INPUT = 1024**2  # compressed bytes fed to the decompressor at a time

# A zero TD error must not make a sequence unreachable forever.
MIN_PRIORITY = 1e-6


def frame_shape(obs_shape: tuple[int, ...], frame_stack: int) -> tuple[int, ...]:
    """The shape of one stored frame: ``obs_shape[1:]`` for a stack of ``frame_stack > 1`` frames, else ``obs_shape``."""
    return tuple(obs_shape[1:]) if frame_stack > 1 else tuple(obs_shape)


def sequence_slots(capacity: int, seq_len: int, overlap: int) -> int:
    """Rows of the sequence table: each sequence writes at least ``seq_len - overlap`` new steps, so no more are
    live at once."""
    return capacity // (seq_len - overlap) + 1


def _ring_specs(obs_shape: tuple[int, ...], obs_dtype: torch.dtype,
                frame_stack: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-step shape and dtype of every ring field."""
    return {
        "frame": (frame_shape(obs_shape, frame_stack), obs_dtype),
        "prev": ((), torch.int64),
        "first": ((), torch.bool),
        "prev_action": ((), torch.int64),
        "prev_reward": ((), torch.float32),
        "actions": ((), torch.int64),
        "rewards": ((), torch.float32),
        "discounts": ((), torch.float32),
        "policy_version": ((), torch.int64),
    }


def _table_specs(seq_len: int, lstm_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-sequence shape and dtype of every sequence-table field."""
    return {
        "stamps": ((seq_len + 1,), torch.int64),
        "oldest": ((), torch.int64),
        "id": ((), torch.int64),
        "live": ((), torch.bool),
        "state_h": ((lstm_size,), torch.float32),
        "state_c": ((lstm_size,), torch.float32),
    }


def _nbytes(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in specs.values())


def step_bytes(obs_shape: tuple[int, ...], obs_dtype: torch.dtype, frame_stack: int) -> int:
    """Ring bytes per stored env step."""
    return _nbytes(_ring_specs(obs_shape, obs_dtype, frame_stack))


def replay_bytes_needed(capacity: int, seq_len: int, overlap: int, obs_shape: tuple[int, ...],
                        obs_dtype: torch.dtype, frame_stack: int, lstm_size: int) -> int:
    """Bytes a ``SequenceReplay`` of this shape allocates (ring, sequence table and sum-tree)."""
    slots = sequence_slots(capacity, seq_len, overlap)
    tree_leaves = 1 << max(1, int(np.ceil(np.log2(slots))))
    return (capacity * step_bytes(obs_shape, obs_dtype, frame_stack) + slots * _nbytes(_table_specs(seq_len, lstm_size))
            + 2 * tree_leaves * 8)


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


def check_replay_fits(capacity: int, seq_len: int, overlap: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype,
                      frame_stack: int, lstm_size: int, budget_bytes: int) -> int:
    """Raise ``ConfigError`` unless the replay fits ``budget_bytes`` and the memory available now; returns its size."""
    need = replay_bytes_needed(capacity, seq_len, overlap, obs_shape, obs_dtype, frame_stack, lstm_size)
    each = step_bytes(obs_shape, obs_dtype, frame_stack)
    shape = (f"replay_capacity {capacity} steps x {each:,} bytes (seq_len {seq_len}, obs {tuple(obs_shape)} "
             f"{obs_dtype}, each frame stored once)")
    if need > budget_bytes:
        raise ConfigError(f"replay needs {need:,} bytes for {shape} > replay_bytes {budget_bytes:,}: "
                          "lower --replay-capacity, or raise --replay-bytes")
    available = available_memory_bytes()
    if available is not None and need > available:
        raise ConfigError(f"replay needs {need:,} bytes for {shape} but only {available:,} bytes of memory are "
                          "available: lower --replay-capacity")
    return need


class SequenceReplay:
    """Prioritized replay of fixed-length sequences over a ring of single frames (see the module docstring);
    thread-safe (one lock around every operation).

    Sequences are named by ids: the running count of insertions; row ``id % sequence_slots`` of the table holds
    one, so ``update_priorities`` can tell (and skip) ids evicted since they were sampled.
    """

    def __init__(self, capacity: int, seq_len: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype,
                 lstm_size: int, *, overlap: int = 0, frame_stack: int = 1, priority_exponent: float = 0.9,
                 importance_exponent: float = 0.6):
        if seq_len < 1 or lstm_size < 1 or frame_stack < 1 or not 0 <= overlap < seq_len:
            raise ValueError(f"SequenceReplay needs seq_len, lstm_size, frame_stack >= 1 and 0 <= overlap < seq_len, "
                             f"got {seq_len}, {lstm_size}, {frame_stack}, {overlap}")
        if capacity < seq_len + frame_stack:
            raise ValueError(f"a replay of {capacity} steps cannot hold one sequence of {seq_len + 1} observations "
                             f"with {frame_stack - 1} older frames")
        if frame_stack > 1 and (len(obs_shape) < 2 or obs_shape[0] != frame_stack):
            raise ValueError(f"observations {tuple(obs_shape)} are not a stack of {frame_stack} frames")
        self.capacity, self.seq_len, self.lstm_size = capacity, seq_len, lstm_size
        self.overlap, self.frame_stack = overlap, frame_stack
        self.obs_shape, self.obs_dtype = tuple(obs_shape), obs_dtype
        self.priority_exponent = priority_exponent
        self.importance_exponent = importance_exponent
        self.ring = {key: marker_tensor((capacity, *shape), dtype)
                     for key, (shape, dtype) in _ring_specs(self.obs_shape, obs_dtype, frame_stack).items()}
        self.slots = sequence_slots(capacity, seq_len, overlap)
        self.table = {key: marker_tensor((self.slots, *shape), dtype)
                      for key, (shape, dtype) in _table_specs(seq_len, lstm_size).items()}
        self.tree = SumTree(self.slots)
        self.max_priority = 1.0
        self.written = 0  # ring steps ever written (the next stamp)
        self.inserted = 0  # sequences ever inserted (the next id)
        self.size = 0  # live sequences
        self.streams: dict[int, int] = {}  # stream -> id of its last sequence
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        return (sum(t.element_size() * t.nelement() for t in (*self.ring.values(), *self.table.values()))
                + self.tree.nbytes)

    def _hops(self, stamps: Tensor, hops: int) -> Tensor:
        """The stamps ``hops`` frames back along ``prev`` from ``stamps`` (any shape)."""
        for _ in range(hops):
            stamps = self.ring["prev"][stamps % self.capacity]
        return stamps

    def _continuation(self, stream: int | None) -> Tensor | None:
        """The ``overlap + 1`` stamps a new sequence of ``stream`` shares with its stream's previous one, if that
        one is still live and stays so once the new steps are written; else None."""
        last = self.streams.get(stream) if stream is not None else None
        if last is None:
            return None
        row = last % self.slots
        if not (bool(self.table["live"][row]) and int(self.table["id"][row]) == last):
            return None
        shared = self.table["stamps"][row, self.seq_len - self.overlap:]
        oldest = int(self._hops(shared[:1], self.frame_stack - 1)[0])
        return shared if oldest >= self.written + self.seq_len - self.overlap - self.capacity else None

    def add(self, sequence: dict[str, Tensor], stream: int | None = None, continues: bool = False) -> int:
        """Store one sequence given time-first (``obs [L + 1, ...]``, ``actions [L]``, ``state_h [H]``...); returns its
        id. ``continues``: its first ``overlap + 1`` observations are the last ones of the previous sequence added
        for ``stream`` (``PartialUnrolls``' ``continues``), so only the new steps are written. Copies, so
        ``sequence`` may be a view into a buffer that is reused afterwards."""
        L, K, C = self.seq_len, self.frame_stack, self.capacity
        obs, first = sequence["obs"], sequence["first"].bool()
        if tuple(obs.shape) != (L + 1, *self.obs_shape):
            raise ValueError(f"sequence obs has shape {tuple(obs.shape)}, expected {(L + 1, *self.obs_shape)}")
        frames = obs[:, -1] if K > 1 else obs
        # An episode start's stack must be its reset frame repeated, as the ring rebuilds it.
        starts = first[1:]
        if K > 1 and starts.any() and not (obs[1:][starts] == frames[1:][starts].unsqueeze(1)).all():
            raise ValueError("a frame stack at an episode start is not its first frame repeated: the env's frame "
                             "stack pads differently from gymnasium FrameStackObservation(padding_type='reset')")
        with self._lock:
            shared = self._continuation(stream) if continues else None
            start = self.written
            if shared is None:  # written whole: K - 1 padding steps (the first stack's older frames), then L + 1
                pads = torch.arange(start, start + K - 1)
                stamps = torch.arange(start + K - 1, start + K + L)
                new_obs, new_steps = 0, 0
                self.written += K + L
            else:
                pads = torch.zeros(0, dtype=torch.int64)
                stamps = torch.cat([shared, torch.arange(start, start + L - self.overlap)])
                new_obs, new_steps = self.overlap + 1, self.overlap
                self.written += L - self.overlap
            # Evict what the write passes: sequences needing an overwritten frame, and this id's table row.
            row = self.inserted % self.slots
            dead = self.table["live"] & (self.table["oldest"] < self.written - C)
            dead[row] |= bool(self.table["live"][row])
            if dead.any():
                gone = dead.nonzero().squeeze(1)
                self.table["live"][gone] = False
                self.tree.update(gone.numpy(), np.zeros(len(gone)))
                self.size -= len(gone)
            # Ring: padding frames, then the new observations' frames and links, then the new transitions.
            if K > 1 and shared is None:
                self.ring["frame"][pads % C] = obs[0, : K - 1].to(self.obs_dtype)
                self.ring["prev"][pads % C] = torch.cat([pads[:1], pads[:-1]])
            # The frame before each observation's newest in its stack: the step before, itself at an episode start
            # (the reset frame repeated), the padding for the first observation of a sequence written whole.
            before = torch.cat([pads[-1:] if len(pads) else stamps[:1], stamps[:-1]])
            previous = torch.where(first, stamps, before)
            previous[0] = before[0]
            fresh = stamps[new_obs:] % C
            self.ring["frame"][fresh] = frames[new_obs:].to(self.obs_dtype)
            self.ring["prev"][fresh] = previous[new_obs:]
            for key in OBS_KEYS:
                self.ring[key][fresh] = sequence[key][new_obs:].to(self.ring[key].dtype)
            for key in STEP_KEYS:
                self.ring[key][stamps[new_steps:L] % C] = sequence[key][new_steps:].to(self.ring[key].dtype)
            # Table.
            seq_id = self.inserted
            self.table["stamps"][row] = stamps
            self.table["oldest"][row] = pads[0] if len(pads) else self._hops(stamps[:1], K - 1)[0]
            self.table["id"][row] = seq_id
            self.table["live"][row] = True
            for key in STATE_KEYS:
                self.table[key][row] = sequence[key]
            self.tree.update(np.array([row]), np.array([self.max_priority ** self.priority_exponent]))
            self.size += 1
            self.inserted += 1
            if stream is not None:
                self.streams[stream] = seq_id
        return seq_id

    def insert(self, sequences: dict[str, Tensor]) -> np.ndarray:
        """Store ``M`` unrelated sequences given sequence-first (``obs [M, L + 1, ...]``...); returns their ids ``[M]``."""
        return np.array([self.add({key: value[m] for key, value in sequences.items()})
                         for m in range(len(sequences["obs"]))], dtype=np.int64)

    def _gather(self, rows: Tensor) -> dict[str, Tensor]:
        """The sequences in table ``rows [B]``, time-major, their stacks rebuilt (the lock is held)."""
        L, K, C, B = self.seq_len, self.frame_stack, self.capacity, len(rows)
        stamps = self.table["stamps"][rows].T.contiguous()  # [L + 1, B]
        stack = [stamps]
        for _ in range(K - 1):  # oldest frame first, as the env stacks them
            stack.insert(0, self.ring["prev"][stack[0] % C])
        where = stamps % C
        frames = torch.stack(stack, -1) % C if K > 1 else where  # [L + 1, B(, K)]
        batch = {"obs": self.ring["frame"].index_select(0, frames.view(-1)).view(L + 1, B, *self.obs_shape)}
        batch.update({key: self.ring[key][where] for key in OBS_KEYS})
        batch.update({key: self.ring[key][where[:L]] for key in STEP_KEYS})
        batch.update({key: self.table[key][rows] for key in STATE_KEYS})
        batch["ids"] = self.table["id"][rows]
        return batch

    def sequences(self, ids: np.ndarray) -> dict[str, Tensor]:
        """The live sequences ``ids [B]`` as a batch (``sample``'s keys but ``weights``; for tests and diagnostics)."""
        ids = np.asarray(ids, dtype=np.int64)
        with self._lock:
            if not self._live_ids(ids).all():
                raise KeyError(f"sequences {ids[~self._live_ids(ids)].tolist()} are not in the replay")
            return self._gather(torch.from_numpy(ids % self.slots))

    def sample(self, batch_size: int, rng: np.random.Generator,
               device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """``batch_size`` sequences drawn proportionally to ``priority ** alpha`` (stratified), as a batch
        (see the module docstring) on ``device``."""
        with self._lock:
            if self.size == 0:
                raise ValueError("cannot sample from an empty replay")
            rows = self.tree.sample(batch_size, rng)
            probs = self.tree[rows] / self.tree.total
            size = self.size
            batch = self._gather(torch.from_numpy(rows))
        ids = batch.pop("ids")
        weights = (size * probs) ** -self.importance_exponent
        batch["weights"] = torch.from_numpy(weights / weights.max()).float()
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        batch["ids"] = ids
        return batch

    def _live_ids(self, ids: np.ndarray) -> np.ndarray:
        rows = torch.from_numpy(ids % self.slots)
        return (self.table["live"][rows] & (self.table["id"][rows] == torch.from_numpy(ids))).numpy()

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
            live = self._live_ids(ids)
            if live.any():
                self.tree.update(ids[live] % self.slots, priorities[live] ** self.priority_exponent)
                self.max_priority = max(self.max_priority, float(priorities[live].max()))
            return int(live.sum())

    def priorities_of(self, ids: np.ndarray) -> np.ndarray:
        """The stored ``priority ** alpha`` of ids (0 once evicted; for tests and diagnostics)."""
        ids = np.asarray(ids, dtype=np.int64)
        with self._lock:
            return np.where(self._live_ids(ids), self.tree[ids % self.slots], 0.0)

    # ---- checkpoints ------------------------------------------------------------------------
    def _shape(self) -> list[Any]:
        return [self.capacity, self.seq_len, self.overlap, self.frame_stack, list(self.obs_shape), str(self.obs_dtype),
                self.lstm_size]

    def state_dict(self) -> dict[str, Any]:
        """Everything but the streams' continuation, as tensors and plain values; the written frames
        ``zlib``-compressed (level 1) into a uint8 tensor."""
        with self._lock:
            held = min(self.written, self.capacity)
            raw = self.ring["frame"][:held].numpy().reshape(-1).view(np.uint8)
            packed, compressor = bytearray(), zlib.compressobj(1)
            for begin in range(0, len(raw), ZLIB_CHUNK):
                packed += compressor.compress(raw[begin: begin + ZLIB_CHUNK])
            packed += compressor.flush()
            state: dict[str, Any] = {
                "shape": self._shape(), "written": self.written, "inserted": self.inserted, "size": self.size,
                "max_priority": self.max_priority, "frames_zlib": torch.frombuffer(packed, dtype=torch.uint8),
                "ring": {key: value[:held].clone() for key, value in self.ring.items() if key != "frame"},
                "table": {key: value.clone() for key, value in self.table.items()},
                "priorities": torch.from_numpy(self.tree[np.arange(self.slots)]),
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict`` of a replay of the same shape (``ConfigError`` otherwise)."""
        if list(state["shape"]) != self._shape():
            raise ConfigError(f"the checkpoint's replay has shape {state['shape']} (capacity, seq_len, overlap, "
                              f"frame_stack, obs, dtype, lstm) but this run's is {self._shape()}: resume with the "
                              "same settings, or --no-checkpoint-replay")
        held = min(int(state["written"]), self.capacity)
        with self._lock:
            raw = self.ring["frame"][:held].numpy().reshape(-1).view(np.uint8)
            packed, decompressor, filled = state["frames_zlib"].numpy(), zlib.decompressobj(), 0
            for begin in range(0, len(packed), ZLIB_INPUT):  # straight into the ring, a bounded piece at a time
                pending = packed[begin: begin + ZLIB_INPUT]
                while len(pending):
                    chunk = decompressor.decompress(pending, ZLIB_CHUNK)
                    raw[filled: filled + len(chunk)] = np.frombuffer(chunk, np.uint8)
                    filled, pending = filled + len(chunk), decompressor.unconsumed_tail
            if filled != len(raw) or not decompressor.eof:
                raise ValueError(f"the checkpoint's replay frames hold {filled:,} bytes, expected {len(raw):,}")
            for key, value in state["ring"].items():
                self.ring[key][:held] = value
            for key, value in state["table"].items():
                self.table[key].copy_(value)
            self.tree.update(np.arange(self.slots), state["priorities"].numpy())
            self.written, self.inserted = int(state["written"]), int(state["inserted"])
            self.size, self.max_priority = int(state["size"]), float(state["max_priority"])
            self.streams = {}
