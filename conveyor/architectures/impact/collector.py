"""IMPACT's worker side (``architectures.impact``): the worker process, its ``BatchCollector``, and the
shared-memory batch slots it fills; ``workers.Workers`` (the learner's side) starts and restarts it.

Each of W workers (``env.num_workers``) holds its own copy of the policy and
steps ``env.num_envs / W`` envs. It fills one of its ``SLOTS_PER_WORKER``
batch slots in the shared pool with S steps (``--worker-batch``), sends the
slot index to the learner down a pipe (one byte), and fills its other slot;
the learner copies the batch into its circular buffer and hands the slot
back. Between batches a worker loads the newest parameters from the
``ParamBlock`` when their version has moved. Nothing is pickled; a closed
pipe tells either side the other has gone. A model with an LSTM core acts
from each env's state, previous action and reward (``acting.CoreCarry``,
carried across batches and reset at episode starts); a slot then also holds
the state at its first step and ``first``, ``prev_action``, ``prev_reward``
at all S + 1 observations (``batch_fields``).

Slot ownership. A slot belongs either to its worker (free, or being filled)
or to the learner (sent, not yet handed back: ``Workers.held``). A worker
sends a slot only once every field of its S steps is written, so the
learner never reads a half-written batch. While filling, the worker keeps
``slot_steps[slot]`` at the number of steps written; the learner zeroes it
when the slot arrives.

Seeds. Life ``r`` of worker ``i`` (r = 0 the first start, r = 1 its first
restart, ...) steps the envs that worker ``r * W + i`` of a run with
``r + 1`` times as many workers would: its vector env is seeded
``cfg.seed + (r * W + i) * E`` (E = envs per worker). No two lives of any
workers share an env seed, so a restart does not replay the episodes
(episode seeds) of an earlier life, and a rerun restarts the same way. Its action sampler is seeded from
``SeedSequence([cfg.seed, i])`` (r = 0) or ``SeedSequence([cfg.seed, i, r])``.

A worker runs ``python -c "from conveyor.architectures.impact.collector import worker_main; worker_main()"``
(spec as JSON on stdin, ``procs.child_prologue``); a Ray worker (``--launcher ray``,
``ray_workers.RayWorkers``) is an ``ImpactRayWorker`` around the same ``BatchCollector``. This module holds
what both sides agree on (the slot layout ``pool_specs``, ``SLOTS_PER_WORKER``, the ``FATAL`` reply, the
``DIED_EXIT`` code) and imports nothing of the learner's side.
"""

from __future__ import annotations

import dataclasses
import os
import select
import sys
import time
import traceback
from collections import deque
from collections.abc import Iterable
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

from conveyor.acting import CoreCarry, GsdeNoise, policy_step, step_targets
from conveyor.config import RunCfg
from conveyor.errors import WorkerDied, WorkerFailure, error_line
from conveyor.envs import make_vector_env
from conveyor.envs.shm_worker import MESSAGE_BYTES, write_message
from conveyor.models import make_model, policy_family
from conveyor.architectures.impact.params import ParamBlock
from conveyor.ray_launcher import where
from conveyor.storage.schema import STATE_KEYS, RolloutSchema, fill_marker, state_fields
from conveyor.storage.shm import ArraySpec, SharedArrays
from conveyor.procs import array_specs_from_json, child_prologue

SLOTS_PER_WORKER = 2
"""A worker fills one slot while the learner may still hold its other one."""
FATAL = 255
"""Reply byte of a worker that failed (its message row says why); other bytes name a ready slot."""
DIED_EXIT = 3
"""Exit code of a worker whose own env worker died: a death, restarted like any other."""
POLL_S = 0.2
BATCH_FIELDS = ("obs", "actions", "rewards", "discounts", "behaviour_logp", "policy_version")
"""What the learner trains on; a slot also holds each step's finished-episode return (``episode_return``)."""
CORE_FIELDS = ("first", "prev_action", "prev_reward")
"""What a model with an LSTM core also reads at each of the S + 1 observations."""


def batch_fields(cfg: RunCfg) -> tuple[str, ...]:
    """The fields of a batch the learner trains on: ``BATCH_FIELDS``, and for a model with an LSTM core
    ``CORE_FIELDS`` and the state the batch started from (``STATE_KEYS``)."""
    return (*BATCH_FIELDS, *(CORE_FIELDS + STATE_KEYS if cfg.model.lstm_size else ()))


def pool_specs(cfg: RunCfg, obs_space: gym.Space, action_space: gym.Space) -> list[ArraySpec]:
    """Layout of the worker batch slots: ``[W * SLOTS_PER_WORKER, S (+1), E, ...]`` per rollout field
    (``[W * SLOTS_PER_WORKER, E, H]`` for the LSTM state at a batch's first step)."""
    slots, S, E = cfg.env.num_workers * SLOTS_PER_WORKER, cfg.arch.worker_batch, cfg.env.envs_per_worker
    recurrent = CORE_FIELDS if cfg.model.lstm_size else ()
    schema = RolloutSchema.build(obs_space, policy_family(action_space),
                                 (*BATCH_FIELDS, *recurrent, "episode_return"), state_fields(cfg.model.lstm_size))
    return [
        *schema.array_specs(slots, S, E),
        ArraySpec("seconds", (slots, 2), "float64"),  # the batch's env and act time
        ArraySpec("slot_steps", (slots,), "int64"),  # steps written into a slot its worker is filling
        ArraySpec("env_errors", (cfg.env.num_workers,), "int64"),
        ArraySpec("message", (cfg.env.num_workers, MESSAGE_BYTES), "uint8"),
    ]


def worker_seeds(cfg: RunCfg, index: int, life: int) -> tuple[int, int]:
    """(vector-env seed, action-sampler seed) of life ``life`` of worker ``index`` (see the module docstring)."""
    env_seed = cfg.seed + (life * cfg.env.num_workers + index) * cfg.env.envs_per_worker
    entropy = [cfg.seed, index, life] if life else [cfg.seed, index]
    return env_seed, int(np.random.SeedSequence(entropy).generate_state(1)[0])


def worker_main() -> None:
    """Entry point of a worker process; reads its JSON spec from stdin (see ``Workers``)."""
    spec = child_prologue()
    torch.set_num_threads(1)
    pool = SharedArrays(array_specs_from_json(spec["pool"]), spec["pool_fd"])
    try:
        collect(spec, pool)
    except WorkerDied as death:  # our env worker died or hung: die too (no FATAL report); the learner restarts us
        print(f"conveyor impact worker {spec['index']}: {death}", file=sys.stderr, flush=True)
        write_message(pool["message"][spec["index"]], str(death))  # the learner's line about our death says why
        sys.exit(DIED_EXIT)
    except Exception as error:
        trace = traceback.format_exc()
        print(f"conveyor impact worker {spec['index']}:\n{trace}", file=sys.stderr, flush=True)
        if isinstance(error, WorkerFailure):  # from its env worker: already one line naming the env
            write_message(pool["message"][spec["index"]], str(error), f"{error.details}\n{trace}".strip())
        else:
            write_message(pool["message"][spec["index"]], error_line(error), trace)
        try:
            os.write(spec["reply_fd"], bytes([FATAL]))
        except OSError:
            pass  # the learner is gone
    finally:
        pool.close()


def collect(spec: dict[str, Any], pool: SharedArrays) -> None:
    """Fill free slots with S-step batches until the learner closes the command pipe."""
    index = spec["index"]
    collector = BatchCollector(RunCfg.from_dict(spec["cfg"]), index, spec["life"])
    try:
        params = ParamBlock(collector.model, spec["params_fd"])
        version = params.read_into(collector.model)  # a restarted worker acts with the newest weights from its first step
        free = FreeSlots(spec["command_fd"], index * SLOTS_PER_WORKER, spec["free"])
        slot_steps = pool["slot_steps"]
        while (slot := free.next()) is not None:
            if params.version > version:
                version = params.read_into(collector.model)
            slot_steps[slot] = 0

            def written(steps: int, slot: int = slot) -> bool:
                slot_steps[slot] = steps
                return free.poll()

            seconds = collector.fill({name: pool[name][slot] for name in collector.fields}, version, written)
            if seconds is None:
                return
            pool["seconds"][slot] = seconds
            pool["env_errors"][index] = spec["env_errors_base"] + collector.env_errors
            os.write(spec["reply_fd"], bytes([slot - index * SLOTS_PER_WORKER]))  # the slot is the learner's now
    finally:
        collector.close()


class BatchCollector:
    """What one life of worker ``index`` acts with: its ``env.envs_per_worker`` envs (seeded by ``worker_seeds``),
    its copy of the policy, its action sampler (and gSDE noise) and, for an LSTM core, each env's state across
    batches; ``fill`` writes the next S-step batch. The process workers fill shared slots with it, Ray workers
    their replies."""

    def __init__(self, cfg: RunCfg, index: int, life: int) -> None:
        self.cfg, E = cfg, cfg.env.envs_per_worker
        env_seed, sampler_seed = worker_seeds(cfg, index, life)
        self.venv = make_vector_env(dataclasses.replace(cfg.env, num_envs=E, num_workers=1), env_seed,
                                    gamma=cfg.algo.gamma)
        try:
            self.model = make_model(cfg.model, self.venv.single_observation_space, self.venv.single_action_space)
            space = self.venv.single_action_space
            self.bounds = None if self.model.policy.discrete else (space.low, space.high)
            self.sampler = torch.Generator().manual_seed(sampler_seed)
            self.gsde = GsdeNoise.for_model(cfg.model, sampler_seed)
            self.obs = torch.as_tensor(self.venv.reset())
            self.carry = CoreCarry(self.model, E) if cfg.model.lstm_size else None  # each env's LSTM state
            self.env_ids = np.arange(E)
        except BaseException:
            self.venv.close()
            raise
        self.fields = (*batch_fields(cfg), "episode_return")
        """The arrays ``fill`` writes (``[S (+1), E, ...]`` each, as in a slot of ``pool_specs``)."""

    @property
    def env_errors(self) -> int:
        return self.venv.env_errors

    def fill(self, batch: dict[str, np.ndarray], version: int,
             written: Callable[[int], bool] = lambda steps: True) -> tuple[float, float] | None:
        """Act ``S`` steps with the model (parameters ``version``) and write them into ``batch`` (``fields``);
        ``written(t + 1)`` after each step, and ``False`` from it stops (returns None). Returns the batch's env
        and act seconds."""
        model, carry, S = self.model, self.carry, self.cfg.arch.worker_batch
        env_s = act_s = 0.0
        if carry is not None:  # the state the learner replays this batch from
            for name, rows in zip(STATE_KEYS, carry.state):
                batch[name][:] = rows
        for t in range(S):
            start = time.perf_counter()
            core = None if carry is None else carry.inputs()
            act = policy_step(model, self.obs, self.sampler, core=core, gsde=self.gsde, envs=self.env_ids)
            actions = act.actions.numpy()
            started_env = time.perf_counter()
            step = self.venv.step(actions if self.bounds is None else np.clip(actions, *self.bounds))
            stepped = time.perf_counter()
            rewards, discounts = step_targets(model, step.reward, step.terminated, step.truncated, step.final_obs,
                                              self.cfg.algo.gamma,
                                              core=None if carry is None else carry.after(act, step.reward))
            for name, value in (("obs", self.obs), ("actions", actions), ("behaviour_logp", act.logp),
                                ("rewards", rewards), ("discounts", discounts), ("policy_version", version),
                                ("episode_return", step.episode_return)):
                batch[name][t] = value
            if carry is not None:
                _write_core(batch, t, core)
                carry.advance(act, step.reward, step.terminated | step.truncated)
            self.obs = torch.as_tensor(step.obs)
            env_s += stepped - started_env
            act_s += time.perf_counter() - stepped + started_env - start
            if not written(t + 1):
                return None
        batch["obs"][S] = self.obs
        if carry is not None:
            _write_core(batch, S, carry.inputs())
        return env_s, act_s

    def close(self) -> None:
        self.venv.close()


def _write_core(batch: dict[str, np.ndarray], t: int, core: Any) -> None:
    """The core's inputs besides obs (``CORE_FIELDS``) at observation ``t`` of a batch slot."""
    for name in CORE_FIELDS:
        batch[name][t] = getattr(core, name)


class FreeSlots:
    """A worker's free slots (global indices, starting with ``free``); the learner returns each slot as one
    byte (its index minus ``first``) on the command pipe, and closes the pipe to stop the worker (or the pipe
    closes because the learner died)."""

    def __init__(self, command_fd: int, first: int, free: Iterable[int]):
        self.fd, self.first = command_fd, first
        self.free = deque(free)
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


class ImpactRayWorker:
    """The body of one Ray worker: a ``BatchCollector`` and the parameter version it acts with."""

    def __init__(self, cfg: dict[str, Any], index: int, life: int) -> None:
        torch.set_num_threads(1)
        self.collector = BatchCollector(RunCfg.from_dict(cfg), index, life)
        self.version = -1

    def where(self) -> dict[str, Any]:
        return where()

    def collect(self, params: list[Any], specs: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, Any]:
        """One batch: ``specs`` name -> (shape, dtype) of its arrays; ``params``: ``[version, ref]`` of the
        newest weights (a list, so Ray hands the reference over unresolved and it is fetched only when new)."""
        import ray

        version, ref = params
        if version > self.version:
            state = ray.get(ref)
            self.collector.model.load_state_dict({name: torch.tensor(value) for name, value in state.items()})
            self.version = version
        batch = {name: np.empty(shape, dtype) for name, (shape, dtype) in specs.items()}
        for array in batch.values():
            fill_marker(array)  # a field the collector failed to write shows at once
        seconds = self.collector.fill(batch, self.version)
        return {"batch": batch, "seconds": seconds, "env_errors": self.collector.env_errors}
