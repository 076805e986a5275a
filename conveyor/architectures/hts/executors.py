"""HTS-RL executor processes: the child side of ``conveyor.architectures.hts.state_buffer``.

An executor (``cfg.num_workers`` processes, each owning
``cfg.envs_per_worker`` consecutive envs) steps each env as soon as its
action arrives, never waiting for its other envs: every env is a
single-env ``conveyor.envs.shm_worker.EnvWorker`` over its own rows, so
seeding (env i gets ``seed + i``), auto-reset, episode statistics and env
errors behave exactly as in the vector env. Per round it posts, for each
env, ``sync_interval`` (alpha) act requests (``t = 0 .. alpha - 1``) and
one final request (``t = alpha``: the bootstrap observation and the last
step's result), then waits for ``GO``.

All randomness that picks actions comes from the executors: in round r env
i draws one uniform number (``float32``, shape of one action's noise) per
act request from its own generator, seeded from ``(seed, i, r)``, and posts
it with the observation; actors sample by inverse CDF. So the actions do not
depend on which actor serves which env, and a restarted or resumed executor
draws exactly what the lost one would have.

This module also holds what both sides of the pipes agree on: the records
(``GO``, ``STOP``, env indices as ``RECORD`` int32s) and the ``ExecutorSpec``
the parent sends. Executors run ``python -c "from conveyor.architectures.hts.executors import main; main()"``
(like the vector env's workers: spec as JSON on stdin, no torch import, no
re-import of the parent's ``__main__``), ignore SIGINT, and exit when the parent's end of
their action pipe closes. Nothing here imports the parent's side.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, NamedTuple

import numpy as np

from conveyor.config import EnvCfg
from conveyor.envs.shm_worker import EnvWorker, WorkerSpec, write_error
from conveyor.storage.shm import ArraySpec, SharedArrays
from conveyor.procs import child_prologue

GO = -1
"""Action-pipe record, main thread -> executor: start the next round."""
STOP = -2
"""Action-pipe record, main thread -> executor: exit."""
POST_AFTER_S = 0.001
"""An executor posts the envs it stepped in one write once stepping them has taken this long (else when the
actions that came together are all stepped)."""
UNIFORM_STREAM = 0x48545352
"""Third word of an env's uniform-generator seed ``(seed, env, UNIFORM_STREAM)``: keeps the stream apart
from every other generator seeded from small integers."""

RECORD = np.dtype("<i4")
"""One record of the ready and action pipes."""


def uniform_generator(seed: int, env: int, round_index: int) -> np.random.Generator:
    """The generator whose draws pick env ``env``'s actions in round ``round_index`` (one per act request)."""
    return np.random.default_rng([seed, env, UNIFORM_STREAM, round_index])


class ExecutorSpec(NamedTuple):
    index: int
    incarnation: int
    """How many executors held this index before (its ready records carry it)."""
    env_cfg: EnvCfg
    seed: int
    gamma: float | None
    """The run's discount (``EnvCfg.normalize_reward``)."""
    first_env: int
    num_envs: int
    episodes: tuple
    """Per env, the index of the episode its first reset starts."""
    replay: tuple
    """Per env, ``history.Replay`` fields that rebuild it (a resumed run), or empty."""
    first_round: int
    """Index of the first round this executor plays (seeds its uniform generators)."""
    join_round: bool
    """Play round ``first_round`` at once (a restart joins the round in flight) instead of waiting for GO."""
    sync_interval: int
    uniform_shape: tuple[int, ...]
    array_specs: tuple[ArraySpec, ...]
    shm_fd: int
    ready_fd: int
    """Write end of the shared ready pipe."""
    action_fd: int
    """Read end of this executor's action pipe."""
    env_offset: int = 0
    """Global index of env 0 of the buffer (a data-parallel rank's first env): seeds and uniforms use it."""


def records(values: Any) -> bytes:
    """``values`` as pipe records."""
    return np.asarray(values, dtype=RECORD).tobytes()


def _read_records(action_fd: int, num_envs: int, heartbeat: np.ndarray) -> list[int]:
    """The records waiting on the action pipe (blocks for at least one); ``[STOP]`` when the parent has gone
    (end of file). Clears ``heartbeat`` while it waits: no env call is under way then."""
    heartbeat[0] = 0.0
    data = os.read(action_fd, RECORD.itemsize * (num_envs + 1))
    return np.frombuffer(data, RECORD).tolist() if data else [STOP]


def _serve(spec: ExecutorSpec, shared: SharedArrays) -> None:
    alpha, first = spec.sync_interval, spec.first_env
    envs = [EnvWorker(WorkerSpec(spec.index, spec.env_cfg, spec.seed, spec.gamma, first + i, 1, (spec.episodes[i],),
                                 (spec.replay[i],) if spec.replay else (), spec.array_specs, spec.shm_fd, -1, -1,
                                 spec.env_offset), shared) for i in range(spec.num_envs)]
    uniform, request_step = shared["uniform"], shared["request_step"]
    env_seconds = shared["env_seconds"][spec.index:spec.index + 1]
    action_wait = shared["action_wait"][spec.index]
    posted = [0.0] * spec.num_envs  # when each env's request went out
    heartbeat = shared["heartbeat"][spec.index:spec.index + 1]
    steps = [0] * spec.num_envs
    tag = shared["obs"].shape[0] * spec.incarnation
    uniforms: list[np.random.Generator] = []
    clock = time.perf_counter

    def post(indices: list[int]) -> None:
        for e in indices:
            t = steps[e - first]
            request_step[e] = t
            if t < alpha:
                uniform[e] = uniforms[e - first].random(spec.uniform_shape, dtype=np.float32)
        now = clock()
        for e in indices:
            posted[e - first] = now
        os.write(spec.ready_fd, records([e + tag for e in indices]))

    def receive() -> collections.deque:
        return collections.deque(_read_records(spec.action_fd, spec.num_envs, heartbeat))

    try:
        for env in envs:
            env.reset()
        waiting = collections.deque([GO]) if spec.join_round else receive()
        round_index = spec.first_round
        while True:  # between rounds
            command = waiting.popleft() if waiting else receive().popleft()
            if command == STOP:
                return
            if command != GO:
                raise RuntimeError(f"executor {spec.index} got record {command} between rounds, expected GO")
            steps[:] = [0] * spec.num_envs
            uniforms = [uniform_generator(spec.seed, spec.env_offset + first + i, round_index)
                        for i in range(spec.num_envs)]
            round_index += 1
            post(list(range(first, first + spec.num_envs)))
            pending = spec.num_envs
            while pending:
                if not waiting:
                    waiting = receive()
                arrived = clock()
                # Step every env whose action came in this read, then post them in one record write (one
                # wake-up, one batch for the actors), or sooner when stepping them takes longer than
                # POST_AFTER_S (a slow env's request should not wait for its siblings' steps).
                ready: list[int] = []
                began = arrived
                while waiting:
                    e = waiting.popleft()
                    if e == STOP:
                        return
                    if not first <= e < first + spec.num_envs:
                        raise RuntimeError(f"executor {spec.index} got record {e} during a round, expected one of "
                                           "its envs")
                    action_wait[0] += arrived - posted[e - first]
                    action_wait[1] += 1
                    start = clock()
                    envs[e - first].step()  # writes obs, reward, flags, final_obs, episode_return of row e
                    end = clock()
                    env_seconds[0] += end - start
                    steps[e - first] += 1
                    pending -= steps[e - first] == alpha
                    ready.append(e)
                    if end - began > POST_AFTER_S:
                        post(ready)
                        ready, began = [], clock()
                if ready:
                    post(ready)
    finally:
        for env in envs:
            env.close()


def main() -> None:
    spec: ExecutorSpec = child_prologue(ExecutorSpec)
    shared = SharedArrays(spec.array_specs, spec.shm_fd)
    try:
        _serve(spec, shared)
    except BaseException as error:
        write_error(shared["message"][spec.index], error)
        raise
    finally:
        shared.close()
