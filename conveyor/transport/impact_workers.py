"""IMPACT worker processes and the shared-memory batch slots they fill (``architectures.impact``).

Each of W workers (``env.num_workers``) holds its own copy of the policy and
steps ``env.num_envs / W`` envs. It fills one of its ``SLOTS_PER_WORKER``
batch slots in the shared pool with S steps (``--worker-batch``), sends the
slot index to the learner down a pipe (one byte), and fills its other slot;
the learner copies the batch into its circular buffer and hands the slot
back. Between batches a worker loads the newest parameters from the
``ParamBlock`` when their version has moved. Nothing is pickled; a closed
pipe tells either side the other has gone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from conveyor.acting import policy_step, step_targets
from conveyor.config import RunCfg
from conveyor.errors import WorkerFailure
from conveyor.envs import make_vector_env
from conveyor.envs.shm_worker import MESSAGE_BYTES, write_message
from conveyor.models import make_model
from conveyor.transport.params import ParamBlock
from conveyor.transport.shm import ArraySpec, SharedArrays, reap, start_child

SLOTS_PER_WORKER = 2
"""A worker fills one slot while the learner may still hold its other one."""
FATAL = 255
"""Reply byte of a worker that failed (its message row says why); other bytes name a ready slot."""
_WORKER_ENTRY = "from conveyor.transport.impact_workers import worker_main; worker_main()"
POLL_S = 0.2
_CLOSE_GRACE_S = 5.0


def pool_specs(cfg: RunCfg, obs_space: gym.Space, action_space: gym.Space) -> list[ArraySpec]:
    """Layout of the worker batch slots: ``[W * SLOTS_PER_WORKER, S (+1), E, ...]`` per field."""
    slots, S, E = cfg.env.num_workers * SLOTS_PER_WORKER, cfg.arch.worker_batch, cfg.env.envs_per_worker
    discrete = isinstance(action_space, gym.spaces.Discrete)
    return [
        ArraySpec("obs", (slots, S + 1, E, *obs_space.shape), np.dtype(obs_space.dtype).str),
        ArraySpec("actions", (slots, S, E, *action_space.shape), "int64" if discrete else "float32"),
        *(ArraySpec(name, (slots, S, E), "float32") for name in ("rewards", "discounts", "behaviour_logp")),
        ArraySpec("policy_version", (slots, S, E), "int64"),
        ArraySpec("episode_return", (slots, S, E), "float64"),
        ArraySpec("seconds", (slots, 2), "float64"),  # the batch's env and act time
        ArraySpec("env_errors", (cfg.env.num_workers,), "int64"),
        ArraySpec("message", (cfg.env.num_workers, MESSAGE_BYTES), "uint8"),
    ]


BATCH_FIELDS = ("obs", "actions", "rewards", "discounts", "behaviour_logp", "policy_version")


# ---- worker process ----------------------------------------------------------------------------
def worker_main() -> None:
    """Entry point of a worker process; reads its JSON spec from stdin (see ``Workers``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner decides when workers stop
    spec = json.loads(sys.stdin.read())
    sys.path[:] = spec["sys_path"]
    torch.set_num_threads(1)
    pool = SharedArrays([ArraySpec(name, tuple(shape), dtype) for name, shape, dtype in spec["pool"]],
                        spec["pool_fd"])
    try:
        collect(spec, pool)
    except Exception:
        write_message(pool["message"][spec["index"]], traceback.format_exc())
        try:
            os.write(spec["reply_fd"], bytes([FATAL]))
        except OSError:
            pass  # the learner is gone
    finally:
        pool.close()


def collect(spec: dict[str, Any], pool: SharedArrays) -> None:
    """Fill free slots with S-step batches until the learner closes the command pipe."""
    cfg, index = RunCfg.from_dict(spec["cfg"]), spec["index"]
    E, S = cfg.env.envs_per_worker, cfg.arch.worker_batch
    venv = make_vector_env(dataclasses.replace(cfg.env, num_envs=E, num_workers=1), cfg.seed + index * E)
    try:
        model = make_model(cfg.model, venv.single_observation_space, venv.single_action_space)
        params = ParamBlock(model, spec["params_fd"])
        version = params.read_into(model)
        space = venv.single_action_space
        bounds = None if model.policy.discrete else (space.low, space.high)
        seed = int(np.random.SeedSequence([cfg.seed, index]).generate_state(1)[0])
        sampler = torch.Generator().manual_seed(seed)
        free = FreeSlots(spec["command_fd"], range(index * SLOTS_PER_WORKER, (index + 1) * SLOTS_PER_WORKER))
        obs = torch.as_tensor(venv.reset())
        while (slot := free.next()) is not None:
            if params.version > version:
                version = params.read_into(model)
            batch = {name: pool[name][slot] for name in (*BATCH_FIELDS, "episode_return")}
            env_s = act_s = 0.0
            for t in range(S):
                start = time.perf_counter()
                act = policy_step(model, obs, sampler)
                actions = act.actions.numpy()
                started_env = time.perf_counter()
                step = venv.step(actions if bounds is None else np.clip(actions, *bounds))
                stepped = time.perf_counter()
                rewards, discounts = step_targets(model, step.reward, step.terminated, step.truncated,
                                                  step.final_obs, cfg.algo.gamma)
                for name, value in (("obs", obs), ("actions", actions), ("behaviour_logp", act.logp),
                                    ("rewards", rewards), ("discounts", discounts), ("policy_version", version),
                                    ("episode_return", step.episode_return)):
                    batch[name][t] = value
                obs = torch.as_tensor(step.obs)
                env_s += stepped - started_env
                act_s += time.perf_counter() - stepped + started_env - start
                if not free.poll():
                    return
            batch["obs"][S] = obs
            pool["seconds"][slot] = (env_s, act_s)
            pool["env_errors"][index] = venv.env_errors
            os.write(spec["reply_fd"], bytes([slot - index * SLOTS_PER_WORKER]))
    finally:
        venv.close()


class FreeSlots:
    """A worker's free slots; the learner returns each slot as one byte (its local index) on the command pipe,
    and closes the pipe to stop the worker (or the pipe closes because the learner died)."""

    def __init__(self, command_fd: int, slots: range):
        self.fd, self.first = command_fd, slots.start
        self.free = deque(slots)
        self.open = True
        self.poller = select.poll()
        self.poller.register(command_fd, select.POLLIN)

    def poll(self, timeout_ms: int = 0) -> bool:
        """Take returned slots; False once the learner has closed the pipe."""
        if self.open and self.poller.poll(timeout_ms):
            data = os.read(self.fd, 64)
            self.open = bool(data)
            self.free.extend(self.first + local for local in data)
        return self.open

    def next(self) -> int | None:
        """The next free slot, waiting for one; None when the learner stops."""
        while self.open and not self.free:
            self.poll(int(POLL_S * 1000))
        return self.free.popleft() if self.open else None


# ---- learner side ------------------------------------------------------------------------------
class Workers:
    """Starts the W worker processes and passes slot indices: ready ones in, free ones back."""

    def __init__(self, cfg: RunCfg, pool: SharedArrays, params: ParamBlock):
        self.pool = pool
        self.processes: list[subprocess.Popen] = []
        self.command_fds: list[int] = []
        self.reply_fds: dict[int, int] = {}  # reply fd -> worker index
        self.poller = select.poll()
        self.ready: deque[int] = deque()
        try:
            for index in range(cfg.env.num_workers):
                self._start(index, cfg, params)
        except BaseException:
            self.close()
            raise

    def _start(self, index: int, cfg: RunCfg, params: ParamBlock) -> None:
        command_read, command_write = os.pipe()
        reply_read, reply_write = os.pipe()
        process = start_child(_WORKER_ENTRY, (self.pool.fd, params.fd, command_read, reply_write))
        os.close(command_read)
        os.close(reply_write)
        self.processes.append(process)
        self.command_fds.append(command_write)
        self.reply_fds[reply_read] = index
        self.poller.register(reply_read, select.POLLIN)
        spec = {"index": index, "cfg": cfg.to_dict(), "sys_path": sys.path, "pool_fd": self.pool.fd,
                "pool": [list(s) for s in self.pool.specs], "params_fd": params.fd,
                "command_fd": command_read, "reply_fd": reply_write}
        try:
            process.stdin.write(json.dumps(spec).encode())
            process.stdin.close()
        except BrokenPipeError:
            pass  # it died at start; next_slot reports it

    def next_slot(self, timeout_s: float) -> int | None:
        """The oldest ready slot, waiting up to ``timeout_s``; None if none came. Raises if a worker died."""
        if not self.ready:
            events = self.poller.poll(int(timeout_s * 1000))
            for fd, _ in events:
                index = self.reply_fds[fd]
                data = os.read(fd, 64)
                if not data or FATAL in data:
                    raise self._died(index)
                self.ready.extend(index * SLOTS_PER_WORKER + local for local in data)
            if not events:
                for index, process in enumerate(self.processes):
                    if process.poll() is not None:
                        raise self._died(index)
        return self.ready.popleft() if self.ready else None

    def release(self, slot: int) -> None:
        index, local = divmod(slot, SLOTS_PER_WORKER)
        try:
            os.write(self.command_fds[index], bytes([local]))
        except BrokenPipeError:
            raise self._died(index) from None

    def _died(self, index: int) -> WorkerFailure:
        process = self.processes[index]
        try:
            code: Any = process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = "still running"
        raw = self.pool["message"][index].tobytes().split(b"\0", 1)[0].decode("utf-8", "replace")
        return WorkerFailure(f"impact worker {index} (pid {process.pid}) stopped (exit {code}): {raw or 'no message'}")

    def close(self) -> None:
        """Close the command pipes (workers stop at their next step), wait, kill stragglers."""
        for fd in self.command_fds:
            os.close(fd)
        self.command_fds = []
        reap(self.processes, _CLOSE_GRACE_S)
        for fd in self.reply_fds:
            os.close(fd)
        self.reply_fds = {}
        self.processes = []
