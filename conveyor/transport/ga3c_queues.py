"""GA3C's prediction and training queues, and the agent process on the other end.

Storage owns memory; transport moves indices. One shared memory block
(``SharedArrays``) holds

- a *request slot* per agent id: the observation to act on, the answer
  (action, log-prob, value, parameter version) and sequence numbers; the
  id's counters (steps, env and wait seconds, env errors, episodes started)
  and the segment slot its holder is filling (``holding``, ``holding_gen``);
- ``num_segments`` *segment slots* of t_max steps each (observations with the
  bootstrap one, actions, rewards, flags, the truncated episodes' last
  observations, behaviour log-probs and versions, finished episodes'
  returns), with the steps written so far (``seg_steps``) and a generation
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

Agents are plain ``subprocess`` children (``agent_main``) that import neither
torch nor the parent's ``__main__``; their spec arrives as JSON on stdin.
They ignore SIGINT (the parent stops them), stop cleanly between steps when
their ``stop`` flag is set (with no request outstanding), stop at once on the
``shutdown`` flag, and exit by themselves when the parent dies (end of file on
the reply pipe, or a changed parent pid).

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

``AgentPool.check`` (the learner's main loop, every 0.1 s) tells deaths from
deliberate stops (``stop``: autotune removing agents; ``close``: the end of
the run; a death while ``ending()``, e.g. a SIGTERM to the process group,
counts as a stop): a dead agent is detached and restarted at once with the
same id, up to ``max_restarts`` restarts per run in all (the architecture
passes ``cfg.env.max_restarts``; the default here, 0, never restarts), each
reported through ``on_restart(dropped_steps)``. The death that would need
one restart more raises ``WorkerFailure``: one line naming the agent, its
pid, its exit reason and the fix.

Seeds. Every episode is seeded: the ``e``-th episode played under agent id
``a`` (counted over all processes that held the id, in the shared
``episodes`` counter) starts with ``reset(seed=conveyor.envs.episode_seed(
cfg.seed, a, e))``. A restarted agent therefore goes on with the id's next
episode: it never replays an episode whose start its predecessor already
sent for training, and the episodes of each id are the same in every run.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, NamedTuple

import numpy as np

from conveyor.errors import WorkerFailure
from conveyor.transport.shm import ArraySpec, SharedArrays, start_child

_INDEX = np.dtype("<i4")
# Writes of at most PIPE_BUF bytes are atomic, so 4-byte indices never interleave between writers.
_CHUNK = select.PIPE_BUF // _INDEX.itemsize
_POLL_MS = 500
_AGENT_ENTRY = "from conveyor.transport.ga3c_queues import agent_main; agent_main()"
_CLOSE_GRACE_S = 5.0
_FIX = "raise --max-restarts or see the agent's error above"


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
        data = np.asarray(indices, _INDEX).reshape(-1)
        for start in range(0, len(data), _CHUNK):
            os.write(self.write_fd, data[start:start + _CHUNK].tobytes())

    def get(self, max_count: int, timeout_s: float) -> np.ndarray:
        """Up to ``max_count`` indices that are waiting; waits up to ``timeout_s`` for the first one."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                data = os.read(self.read_fd, max_count * _INDEX.itemsize)
                return np.frombuffer(data, _INDEX).astype(np.int64)
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
        return struct.unpack("i", waiting)[0] // _INDEX.itemsize

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            os.close(fd)


def channel_specs(obs_shape: tuple[int, ...], obs_dtype: Any, action_shape: tuple[int, ...], action_dtype: Any,
                  num_ids: int, num_segments: int, unroll: int) -> list[ArraySpec]:
    """The layout of the shared block: ``num_ids`` request slots, ``num_segments`` segment slots of ``unroll`` steps."""
    A, S, T = num_ids, num_segments, unroll
    return [
        ArraySpec("obs", (A, *obs_shape), obs_dtype),
        ArraySpec("request_seq", (A,), "int64"),
        ArraySpec("reply_seq", (A,), "int64"),
        ArraySpec("action", (A, *action_shape), action_dtype),
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
        # The segment slot the id's holder claimed (read from the free pipe straight into here) and its generation.
        ArraySpec("holding", (A,), _INDEX.str),
        ArraySpec("holding_gen", (A,), "int64"),
        ArraySpec("seg_obs", (S, T + 1, *obs_shape), obs_dtype),
        ArraySpec("seg_final_obs", (S, T, *obs_shape), obs_dtype),
        ArraySpec("seg_actions", (S, T, *action_shape), action_dtype),
        ArraySpec("seg_reward", (S, T), "float32"),
        ArraySpec("seg_terminated", (S, T), "bool"),
        ArraySpec("seg_truncated", (S, T), "bool"),
        ArraySpec("seg_logp", (S, T), "float32"),
        ArraySpec("seg_value", (S, T), "float32"),
        ArraySpec("seg_version", (S, T), "int64"),
        ArraySpec("seg_episode_return", (S, T), "float64"),
        ArraySpec("seg_agent", (S,), "int64"),
        ArraySpec("seg_number", (S,), "int64"),
        ArraySpec("seg_steps", (S,), "int64"),
        ArraySpec("seg_gen", (S,), "int64"),
    ]


# Fields that coordinate rather than carry data: they start at these values, not at the marker.
_CONTROL_START = {"request_seq": 0, "reply_seq": -1, "stop": False, "shutdown": False, "steps": 0,
                  "env_time_s": 0.0, "wait_time_s": 0.0, "env_errors": 0, "episodes": 0, "holding": -1,
                  "holding_gen": -1, "seg_steps": 0, "seg_gen": 0}


class Reply(NamedTuple):
    action: np.ndarray
    logp: float
    value: float
    version: int


class Channels:
    """Learner side: the shared block, the three index pipes and the agents' reply pipes."""

    def __init__(self, specs: list[ArraySpec], num_segments: int):
        self.shared = SharedArrays(specs)
        self.num_ids = self.shared["obs"].shape[0]
        self.num_segments = num_segments
        if max(self.num_ids, num_segments) * _INDEX.itemsize >= 65536:
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
        import torch

        from conveyor.storage.rollout import marker_tensor

        for spec in self.shared.specs:
            array = self.shared[spec.name]
            if spec.name in _CONTROL_START:
                array[...] = _CONTROL_START[spec.name]
            else:
                tensor = torch.from_numpy(array)
                tensor.copy_(marker_tensor(tuple(tensor.shape), tensor.dtype))

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
        """Copies of the segments in ``slots``, time-major ``[T(+1), B, ...]`` (B = len(slots))."""
        names = ("obs", "final_obs", "actions", "reward", "terminated", "truncated", "logp", "value", "version",
                 "episode_return")
        return {name: np.ascontiguousarray(self.shared[f"seg_{name}"][slots].swapaxes(0, 1)) for name in names}

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


def _exit_reason(code: int | None) -> str:
    from conveyor.envs.vector import exit_reason

    return exit_reason(code)


class AgentPool:
    """Starts, stops, watches and restarts agent processes, each holding one agent id of ``channels``.

    ``max_restarts`` bounds the restarts of dead agents over the run (0: a death raises ``WorkerFailure``);
    ``on_restart(dropped_steps)`` is called once per restart; ``ending()`` true means the run is ending,
    and an agent that dies then is only reaped. ``abandoned_steps`` counts the steps that agents stopped on
    purpose (``stop``, ``close``) had written into segments they never finished.
    """

    def __init__(self, channels: Channels, cfg_dict: dict[str, Any], base_seed: int, *, max_restarts: int = 0,
                 on_restart: Callable[[int], Any] | None = None, ending: Callable[[], bool] | None = None):
        self.channels = channels
        self.cfg_dict = cfg_dict
        self.base_seed = base_seed
        self.max_restarts = max_restarts
        self.on_restart = on_restart or (lambda dropped_steps: None)
        self.ending = ending or (lambda: False)
        self.started = 0
        self.restarts = 0
        self.dropped_steps = 0
        self.abandoned_steps = 0
        self.processes: dict[int, subprocess.Popen] = {}
        """Running agents by id, oldest first."""
        self.stopping: dict[int, subprocess.Popen] = {}
        """Agents asked to stop, until they have exited."""
        self.free_ids = list(range(channels.num_ids))

    def __len__(self) -> int:
        return len(self.processes)

    def resize(self, count: int) -> None:
        while len(self.processes) < count:
            self.start()
        while len(self.processes) > count:
            self.stop(next(reversed(self.processes)))

    def start(self) -> int:
        deadline = time.monotonic() + _CLOSE_GRACE_S
        while not self.free_ids:  # wait for an agent that was asked to stop to give its id back
            if not self.stopping or time.monotonic() > deadline:
                raise RuntimeError(f"all {self.channels.num_ids} GA3C agent ids are in use")
            time.sleep(0.01)
            self.check()
        agent = self.free_ids.pop(0)
        self._launch(agent)
        return agent

    def _launch(self, agent: int) -> None:
        """Start a process holding id ``agent`` (free: no other process holds it, nothing is attached)."""
        channels = self.channels
        channels["stop"][agent] = False
        reply_read, reply_write = os.pipe()
        spec = {"sys_path": sys.path, "cfg": self.cfg_dict, "seed": self.base_seed, "parent_pid": os.getpid(),
                **channels.agent_spec(agent, reply_read)}
        try:
            process = start_child(_AGENT_ENTRY, (*channels.agent_fds(), reply_read))
        except BaseException:
            os.close(reply_write)
            raise
        finally:
            os.close(reply_read)
        channels.reply_fds[agent] = reply_write
        self.processes[agent] = process
        self.started += 1
        try:
            process.stdin.write(json.dumps(spec).encode())
            process.stdin.close()
        except BrokenPipeError:
            pass  # it died at start; check() restarts it

    def stop(self, agent: int) -> None:
        """Ask ``agent`` to stop after its current step; its id is reused once it has exited."""
        self.channels["stop"][agent] = True
        self.stopping[agent] = self.processes.pop(agent)

    def check(self) -> None:
        """Reap agents that stopped when asked; restart those that died (raise past ``max_restarts``)."""
        for agent, process in list(self.stopping.items()):
            if process.poll() is None:
                continue
            del self.stopping[agent]
            self.abandoned_steps += self.channels.detach(agent)
            self.free_ids.append(agent)
        for agent, process in list(self.processes.items()):
            if process.poll() is None:
                continue
            if self.ending():
                del self.processes[agent]
                self.abandoned_steps += self.channels.detach(agent)
                self.free_ids.append(agent)
                continue
            failure = f"GA3C agent {agent} (pid {process.pid}) died ({_exit_reason(process.returncode)})"
            if self.restarts >= self.max_restarts:
                limit = ("restarts are off (max_restarts=0)" if not self.max_restarts else
                         f"the run's {self.restarts} restarts reach max_restarts={self.max_restarts}")
                raise WorkerFailure(f"{failure}; {limit}: {_FIX}")
            dropped = self.channels.detach(agent)
            self.restarts += 1
            self.dropped_steps += dropped
            print(f"conveyor: {failure}; restarting it ({self.restarts} of at most {self.max_restarts} restarts, "
                  f"{dropped} half-written steps dropped)", file=sys.stderr, flush=True)
            self._launch(agent)
            self.on_restart(dropped)

    def pids(self) -> list[int]:
        return [p.pid for p in (*self.processes.values(), *self.stopping.values())]

    def close(self) -> None:
        """Stop every agent at once (politely, then by force) and take back their slots; idempotent."""
        self.channels["shutdown"][0] = True
        everyone = {**self.processes, **self.stopping}
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for agent, process in everyone.items():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            self.abandoned_steps += self.channels.detach(agent)
        self.processes.clear()
        self.stopping.clear()


class AgentLink:
    """Agent side of the protocol, for agent id ``spec["agent"]``; see the module docstring."""

    def __init__(self, spec: dict[str, Any]):
        self.agent = int(spec["agent"])
        self.parent_pid = int(spec["parent_pid"])
        self.shared = SharedArrays([ArraySpec(n, tuple(s), d) for n, s, d in spec["specs"]], spec["shm_fd"])
        self.reply_fd = spec["reply_fd"]
        pipes = spec["pipes"]
        self.requests = IndexPipe(tuple(pipes["requests"]))
        self.free_segments = IndexPipe(tuple(pipes["free_segments"]))
        self.full_segments = IndexPipe(tuple(pipes["full_segments"]))
        self.seq = int(self.shared["request_seq"][self.agent])
        self.segments_pushed = 0
        self._poller = select.poll()
        self._poller.register(self.reply_fd, select.POLLIN)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.shared[name]

    def stop_requested(self) -> bool:
        return bool(self.shared["stop"][self.agent] or self.shared["shutdown"][0])

    def orphaned(self) -> bool:
        return bool(self.shared["shutdown"][0]) or os.getppid() != self.parent_pid

    def predict(self, obs: np.ndarray) -> Reply | None:
        """The answer for ``obs``; None when the run shuts down (or the parent died) first."""
        a, shared = self.agent, self.shared
        shared["obs"][a] = obs
        self.seq += 1
        shared["request_seq"][a] = self.seq  # after the observation: a predictor reads them in the other order
        start = time.perf_counter()
        self.requests.put(a)
        while shared["reply_seq"][a] != self.seq:
            if not self._poller.poll(_POLL_MS):
                if self.orphaned():
                    return None
                continue
            if not os.read(self.reply_fd, 64):  # end of file: the parent is gone
                return None
        shared["wait_time_s"][a] += time.perf_counter() - start
        return Reply(shared["action"][a].copy(), float(shared["logp"][a]), float(shared["value"][a]),
                     int(shared["version"][a]))

    def acquire_segment(self) -> int | None:
        """Claim a free segment slot (see the module docstring); None when asked to stop first."""
        a, shared = self.agent, self.shared
        record = shared["holding"][a:a + 1]
        while True:
            try:
                claimed = os.readv(self.free_segments.read_fd, [record]) == _INDEX.itemsize
            except BlockingIOError:  # none free, or another agent was quicker
                claimed = False
            if claimed:
                break
            if self.stop_requested() or self.orphaned():
                return None
            self.free_segments.wait(_POLL_MS / 1000)
        slot = int(record[0])
        shared["seg_steps"][slot] = 0
        shared["holding_gen"][a] = shared["seg_gen"][slot]
        return slot

    def push_segment(self, slot: int) -> None:
        a, shared = self.agent, self.shared
        shared["seg_agent"][slot] = a
        shared["seg_number"][slot] = self.segments_pushed
        self.segments_pushed += 1
        self.full_segments.put(slot)
        shared["holding"][a] = -1  # first: (slot, no generation) would read as claimed and unwritten
        shared["holding_gen"][a] = -1

    def close(self) -> None:
        self.shared.close()


def run_agent(env: Any, link: AgentLink, unroll: int, seed: int | None = None) -> None:
    """Play ``env`` in segments of ``unroll`` steps until asked to stop. With ``seed`` (the run's), episode ``e``
    of this agent id starts with ``reset(seed=episode_seed(seed, agent, e))``; without, unseeded resets."""
    from conveyor.envs.make import EPISODE_KEY, episode_seed

    a = link.agent
    steps, env_time, env_errors, episodes = link["steps"], link["env_time_s"], link["env_errors"], link["episodes"]
    seg_steps = link["seg_steps"]

    def reset() -> tuple[Any, dict]:
        episode = int(episodes[a])
        episodes[a] = episode + 1  # before any step of it is written: a successor never repeats it
        return env.reset(seed=episode_seed(seed, a, episode)) if seed is not None else env.reset()

    obs, _ = reset()
    slot, t = link.acquire_segment(), 0
    while slot is not None and not link.stop_requested():
        reply = link.predict(obs)
        if reply is None:
            break
        link["seg_obs"][slot, t] = obs
        link["seg_actions"][slot, t] = reply.action
        link["seg_logp"][slot, t] = reply.logp
        link["seg_value"][slot, t] = reply.value
        link["seg_version"][slot, t] = reply.version
        start = time.perf_counter()
        action = reply.action.item() if reply.action.ndim == 0 else reply.action
        try:
            next_obs, reward, terminated, truncated, info = env.step(action)
        except Exception:  # an env bug must not stop the run: cut the episode, reset, and count it
            print(f"conveyor GA3C agent {a}: env raised on step:\n{traceback.format_exc()}", file=sys.stderr)
            env_errors[a] += 1
            next_obs, reward, terminated, truncated, info = obs, 0.0, False, True, {}
        episode = info.get(EPISODE_KEY)
        if terminated or truncated:
            link["seg_final_obs"][slot, t] = next_obs
            next_obs, reset_info = reset()
            episode = episode or reset_info.get(EPISODE_KEY)
        env_time[a] += time.perf_counter() - start
        link["seg_reward"][slot, t] = reward
        link["seg_terminated"][slot, t] = terminated
        link["seg_truncated"][slot, t] = truncated
        link["seg_episode_return"][slot, t] = episode["r"] if episode else np.nan
        steps[a] += 1
        seg_steps[slot] = t + 1  # step t is written whole
        obs, t = next_obs, t + 1
        if t == unroll:
            link["seg_obs"][slot, t] = obs
            link.push_segment(slot)
            slot, t = link.acquire_segment(), 0
    # A slot still held goes back to the free pool when the learner detaches this agent.


def agent_main() -> None:
    """Entry point of an agent process: JSON spec on stdin, then ``run_agent`` until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when agents stop
    spec = json.loads(sys.stdin.buffer.read())
    sys.path[:] = spec["sys_path"]
    from conveyor.config import RunCfg
    from conveyor.envs import episode_seed, make_env

    cfg = RunCfg.from_dict(spec["cfg"])
    link = AgentLink(spec)
    agent, seed = link.agent, int(spec["seed"])
    env = make_env(cfg.env, episode_seed(seed, agent, int(link["episodes"][agent])))
    try:
        run_agent(env, link, cfg.arch.unroll, seed)
    finally:
        env.close()
        link.close()
