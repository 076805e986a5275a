"""GA3C's prediction and training queues: shared slots and index pipes (the agents' side is ``agents.py``).

Storage owns memory; transport moves indices. One shared memory block
(``SharedArrays``) holds

- a *request slot* per agent id: the observation to act on, the answer
  (action, log-prob, value, parameter version) and sequence numbers; the
  id's counters (steps, env and wait seconds, env errors, episodes started)
  and the segment slot its holder is filling (``holding``, ``holding_gen``);
- ``num_segments`` *segment slots* of t_max steps each, holding the rollout
  fields ``SEGMENT_FIELDS`` (observations with the bootstrap one, actions,
  env rewards, flags, the truncated episodes' last observations, behaviour
  log-probs, values and versions, finished episodes' returns) as
  ``seg_<field>``, with the steps written so far (``seg_steps``) and a generation
  (``seg_gen``, raised by the learner each time it takes the slot off the
  training queue).

Three ``IndexPipe``s carry 4-byte indices, never data: ``requests`` (agent
ids waiting for a prediction), ``free_segments`` and ``full_segments`` (the
training queue; TorchBeast's free/full queues). Each agent also has its own
one-byte *reply pipe*: a predictor writes the answer into the agent's slot,
then one byte down that pipe. An agent has at most one request outstanding
and checks that the answer carries its request's sequence number, so answers
cannot cross between agents; segment slots circulate free -> agent -> full ->
trainer -> free, so each is consumed once.

Deaths and restarts. An agent may die at any instruction (SIGKILL, a crash,
an env that fails to build), so every hand-off is either one atomic pipe
operation or checkable afterwards by the learner:

- *Requests.* Predictors take each (id, sequence number) once: an entry whose
  number was already taken (a dead agent's leftover in the queue, seen again
  once its id is reused) is skipped, and an answer is written only while its
  number is still the id's latest, so a late answer never overwrites a newer
  one. Observations are read after the sequence number, so they belong to it.
- *Segment slots.* An agent claims a free slot by ``readv`` from the free pipe
  straight into its ``holding`` field in shared memory: the kernel moves the
  index from the pipe to the record in one step, so no slot is ever only in a
  dead process's head. It then notes the slot's generation and writes steps
  (``seg_steps`` counts those complete); pushing puts the index on the
  training queue, then clears ``holding``. When an agent has exited
  (``Channels.detach``) the learner reads what is left on the training queue
  (raising generations), and the slot in ``holding`` is the agent's own
  unfinished segment exactly when its generation did not move: that segment
  is dropped (never trained on, never counted in ``env_steps``; its
  ``seg_steps`` are the dropped steps) and its slot goes back to the free
  pool. Segments it had pushed are complete and are trained on as usual.
  Agents never hand slots back themselves; a deliberately stopped agent's
  slot comes back the same way, so nothing leaks however an agent ends.
"""
from __future__ import annotations

import fcntl
import os
import select
import struct
import termios
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np

from conveyor.envs.shm_worker import MESSAGE_BYTES
from conveyor.storage.shm import ArraySpec, SharedArrays

if TYPE_CHECKING:  # agent processes import this module and never load torch
    from conveyor.storage.schema import RolloutSchema

INDEX_DTYPE = np.dtype("<i4")
# Writes of at most PIPE_BUF bytes are atomic, so 4-byte indices never interleave between writers.
_CHUNK = select.PIPE_BUF // INDEX_DTYPE.itemsize
_POLL_MS = 500


class IndexPipe:
    """A multi-producer, multi-consumer queue of small int indices over one OS pipe, across processes.

    Every write of whole indices up to PIPE_BUF bytes is atomic and the pipe
    only ever holds whole indices, so any read of a multiple of 4 bytes takes
    whole indices. Capacity is the pipe buffer (64 KiB = 16384 indices on
    Linux); callers keep fewer than that in flight, so writes never block.
    """

    def __init__(self, fds: tuple[int, int] | None = None):
        self.read_fd, self.write_fd = fds if fds is not None else os.pipe()
        os.set_blocking(self.read_fd, False)

    def put(self, indices: Any) -> None:
        data = np.asarray(indices, INDEX_DTYPE).reshape(-1)
        for start in range(0, len(data), _CHUNK):
            os.write(self.write_fd, data[start:start + _CHUNK].tobytes())

    def get(self, max_count: int, timeout_s: float) -> np.ndarray:
        """Up to ``max_count`` indices that are waiting; waits up to ``timeout_s`` for the first one."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                data = os.read(self.read_fd, max_count * INDEX_DTYPE.itemsize)
                return np.frombuffer(data, INDEX_DTYPE).astype(np.int64)
            except BlockingIOError:
                pass  # empty, or another consumer took what was there
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                return np.zeros(0, np.int64)
            self.wait(min(left_ms, _POLL_MS) / 1000)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until something can be read (True), taking nothing."""
        poller = select.poll()
        poller.register(self.read_fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout_s * 1000))))

    def __len__(self) -> int:
        waiting = fcntl.ioctl(self.read_fd, termios.FIONREAD, b"\0\0\0\0")
        return struct.unpack("i", waiting)[0] // INDEX_DTYPE.itemsize

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            os.close(fd)


SEGMENT_FIELDS = ("obs", "final_obs", "actions", "env_rewards", "terminated", "truncated", "behaviour_logp",
                  "behaviour_value", "policy_version", "episode_return")
"""The rollout fields of a segment (``conveyor.storage.schema``): each step as the env gave it (the learner
folds the truncation bootstrap in) and as the predictor answered; ``behaviour_value[T]`` stays the marker."""
SEGMENT_PREFIX = "seg_"
"""Segment arrays are named ``seg_<field>`` in the shared block (the request slots use the plain names)."""


def channel_specs(schema: RolloutSchema, num_ids: int, num_segments: int, unroll: int) -> list[ArraySpec]:
    """The layout of the shared block: ``num_ids`` request slots, ``num_segments`` segment slots of ``unroll`` steps
    holding ``schema``'s fields."""
    A, S = num_ids, num_segments
    obs, action = schema.fields["obs"], schema.fields["actions"]
    return [
        ArraySpec("obs", (A, *obs.shape), obs.array_dtype),
        ArraySpec("request_seq", (A,), "int64"),
        ArraySpec("reply_seq", (A,), "int64"),
        ArraySpec("action", (A, *action.shape), action.array_dtype),
        ArraySpec("logp", (A,), "float32"),
        ArraySpec("value", (A,), "float32"),
        ArraySpec("version", (A,), "int64"),
        ArraySpec("stop", (A,), "bool"),
        ArraySpec("shutdown", (1,), "bool"),
        # Per-id counters written only by the agent that holds the id; they accumulate over its holders.
        ArraySpec("steps", (A,), "int64"),
        ArraySpec("env_time_s", (A,), "float64"),
        ArraySpec("wait_time_s", (A,), "float64"),
        ArraySpec("env_errors", (A,), "int64"),
        ArraySpec("episodes", (A,), "int64"),
        # time.monotonic() at which the id's holder began the env call under way (make, reset, step); 0: none.
        ArraySpec("env_call_since", (A,), "float64"),
        # Why the id's holder ended, if it failed: one line, then the traceback (``shm_worker.write_message``).
        ArraySpec("message", (A, MESSAGE_BYTES), "uint8"),
        # The segment slot the id's holder claimed (read from the free pipe straight into here) and its generation.
        ArraySpec("holding", (A,), INDEX_DTYPE.str),
        ArraySpec("holding_gen", (A,), "int64"),
        *schema.array_specs(S, unroll, prefix=SEGMENT_PREFIX),
        ArraySpec("seg_agent", (S,), "int64"),
        ArraySpec("seg_number", (S,), "int64"),
        ArraySpec("seg_steps", (S,), "int64"),
        ArraySpec("seg_gen", (S,), "int64"),
    ]


# Fields that coordinate rather than carry data: they start at these values, not at the marker.
_CONTROL_START = {"request_seq": 0, "reply_seq": -1, "stop": False, "shutdown": False, "steps": 0,
                  "env_time_s": 0.0, "wait_time_s": 0.0, "env_errors": 0, "episodes": 0, "env_call_since": 0.0,
                  "message": 0,
                  "holding": -1, "holding_gen": -1, "seg_steps": 0, "seg_gen": 0}


class Reply(NamedTuple):
    action: np.ndarray
    logp: float
    value: float
    version: int


class Channels:
    """Learner side: the shared block, the three index pipes and the agents' reply pipes.

    ``schema`` (``SEGMENT_FIELDS`` of the run's spaces) fixes what a segment of ``unroll`` steps holds."""

    def __init__(self, schema: RolloutSchema, num_ids: int, num_segments: int, unroll: int):
        self.shared = SharedArrays(channel_specs(schema, num_ids, num_segments, unroll))
        self.segment_fields = tuple(schema.fields)
        self.num_ids = num_ids
        self.num_segments = num_segments
        if max(self.num_ids, num_segments) * INDEX_DTYPE.itemsize >= 65536:
            raise ValueError(f"{self.num_ids} agent ids / {num_segments} segments exceed what one pipe holds")
        self._fill_markers()
        self.requests, self.free_segments, self.full_segments = IndexPipe(), IndexPipe(), IndexPipe()
        self.free_segments.put(np.arange(num_segments))
        self.reply_fds = [-1] * self.num_ids
        """Write end of each agent id's reply pipe (-1: no agent holds the id)."""
        # Held while writing to or closing a reply pipe: a predictor never writes to a closed (or reused) fd.
        self.reply_lock = threading.Lock()
        # Held while taking requests and writing answers: each sequence number is taken and answered once.
        self._request_lock = threading.Lock()
        self._taken_seq = np.zeros(self.num_ids, np.int64)
        # Held while reading the training queue (and raising generations) and while reclaiming a slot.
        self._segment_lock = threading.Lock()
        self._taken_back: deque[int] = deque()
        """The head of the training queue: slots read off the pipe but not used (oldest first)."""

    def _fill_markers(self) -> None:
        from conveyor.storage.schema import fill_marker  # imports torch, which agent processes never load

        for spec in self.shared.specs:
            array = self.shared[spec.name]
            if spec.name in _CONTROL_START:
                array[...] = _CONTROL_START[spec.name]
            else:
                fill_marker(array)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.shared[name]

    def agent_spec(self, agent: int, reply_read: int) -> dict[str, Any]:
        """What an agent process needs to attach (JSON-safe); the fds must be passed to it."""
        return {"agent": agent, "specs": [list(s) for s in self.shared.specs], "shm_fd": self.shared.fd,
                "reply_fd": reply_read,
                "pipes": {name: [pipe.read_fd, pipe.write_fd] for name, pipe in self._pipes().items()}}

    def _pipes(self) -> dict[str, IndexPipe]:
        return {"requests": self.requests, "free_segments": self.free_segments, "full_segments": self.full_segments}

    def agent_fds(self) -> tuple[int, ...]:
        return (self.shared.fd, *(fd for pipe in self._pipes().values() for fd in (pipe.read_fd, pipe.write_fd)))

    # ---- predictors ----------------------------------------------------------------------
    def take_numbered(self, max_count: int, timeout_s: float) -> tuple[np.ndarray, np.ndarray]:
        """Waiting requests as (agent ids, their sequence numbers), each number taken once (see the module
        docstring); at most ``max_count``, waiting up to ``timeout_s`` for the first. Read the observations
        after this returns: they belong to these numbers."""
        ids = self.requests.get(max_count, timeout_s)
        if not len(ids):
            return ids, ids
        with self._request_lock:
            ids = np.unique(ids)  # a dead agent's leftover entry and its successor's can meet in one take
            seqs = self.shared["request_seq"][ids]
            fresh = seqs > self._taken_seq[ids]
            ids, seqs = ids[fresh], seqs[fresh]
            self._taken_seq[ids] = seqs
        return ids, seqs

    def answer(self, ids: np.ndarray, actions: np.ndarray, logp: np.ndarray, value: np.ndarray, version: int,
               seqs: np.ndarray) -> None:
        """Write each agent's answer (to request number ``seqs``, from ``take_numbered``) into its slot, then wake
        it with one byte on its reply pipe. An answer whose number is no longer its id's latest is dropped."""
        shared = self.shared
        with self._request_lock:
            current = self._taken_seq[ids] == seqs
            if not current.all():
                ids, seqs = ids[current], seqs[current]
                actions, logp, value = actions[current], logp[current], value[current]
            shared["action"][ids] = actions
            shared["logp"][ids] = logp
            shared["value"][ids] = value
            shared["version"][ids] = version
            shared["reply_seq"][ids] = seqs
        with self.reply_lock:
            for agent in ids.tolist():
                fd = self.reply_fds[agent]
                if fd >= 0:
                    try:
                        os.write(fd, b"\1")
                    except BrokenPipeError:
                        pass  # the agent died; the pool restarts it

    def close_reply(self, agent: int) -> None:
        with self.reply_lock:
            fd, self.reply_fds[agent] = self.reply_fds[agent], -1
        if fd >= 0:
            os.close(fd)

    # ---- trainers ------------------------------------------------------------------------
    def _take_full(self, max_count: int) -> np.ndarray:
        """Up to ``max_count`` slots off the training queue, oldest first, without waiting; the generation of
        each slot read off the pipe moves on."""
        with self._segment_lock:
            head = [self._taken_back.popleft() for _ in range(min(max_count, len(self._taken_back)))]
            slots = np.zeros(0, np.int64)
            if len(head) < max_count:
                slots = self.full_segments.get(max_count - len(head), 0.0)
                self.shared["seg_gen"][slots] += 1
        return np.concatenate([np.array(head, np.int64), slots])

    def take_queued(self) -> np.ndarray:
        """Every slot on the training queue now, without waiting (as ``take_segments`` would take them)."""
        return self._take_full(self.num_segments)

    def queued_segments(self) -> int:
        """Length of the training queue."""
        return len(self._taken_back) + len(self.full_segments)

    def take_segments(self, count: int, should_stop: Callable[[], bool]) -> np.ndarray | None:
        """``count`` full segment slots, waiting as long as it takes; None (nothing taken) once ``should_stop()``."""
        slots = np.zeros(0, np.int64)
        while len(slots) < count:
            if should_stop():
                self.full_segments.put(slots)  # back to the queue: nothing taken is lost
                return None
            taken = self._take_full(count - len(slots))
            if not len(taken):
                self.full_segments.wait(0.1)
            slots = np.concatenate([slots, taken])
        return slots

    def segments(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of the segments in ``slots``, time-major ``[T(+1), B, ...]`` (B = len(slots)), by field name."""
        return {name: np.ascontiguousarray(self.shared[SEGMENT_PREFIX + name][slots].swapaxes(0, 1))
                for name in self.segment_fields}

    def release_segments(self, slots: np.ndarray) -> None:
        self.free_segments.put(slots)

    # ---- agents that have exited ---------------------------------------------------------
    def detach(self, agent: int) -> int:
        """The process holding id ``agent`` has exited, however it ended: close its reply pipe and return the
        segment slot it was filling to the free pool, dropping what it had written. Returns the dropped steps."""
        self.close_reply(agent)
        shared = self.shared
        with self._segment_lock:
            # The pipe holds all the agent pushed that the learner has not read yet: read it (moving
            # generations on) to the head of the queue, where trainers take it first.
            while len(queued := self.full_segments.get(self.num_segments, 0.0)):
                shared["seg_gen"][queued] += 1
                self._taken_back.extend(queued.tolist())
            slot, gen = int(shared["holding"][agent]), int(shared["holding_gen"][agent])
            dropped = 0
            # gen < 0: claimed, not yet noted (nothing written). An unmoved generation: claimed and not pushed.
            if slot >= 0 and (gen < 0 or gen == shared["seg_gen"][slot]):
                dropped = int(shared["seg_steps"][slot]) if gen >= 0 else 0
                shared["seg_steps"][slot] = 0
                self.free_segments.put(slot)
            shared["holding"][agent] = -1
            shared["holding_gen"][agent] = -1
        return dropped

    def close(self) -> None:
        for pipe in self._pipes().values():
            pipe.close()
        self.shared.close()
