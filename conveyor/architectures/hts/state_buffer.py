"""HTS-RL state and action buffers between executor processes and actor threads.

The buffers are one shared memory block (``conveyor.storage.shm``) with a
row per env: the state buffer (observation, the uniform number that will
pick the action, the step index ``t`` within the round, and the previous
step's reward, flags, final observation and episode return) and the action
buffer. No data travels through pipes, only env indices (int32 records,
written atomically): executors put the index of a waiting env on the
shared *ready* pipe, tagged with the executor's incarnation
(``env + B * incarnation``); an actor takes every index waiting there at
once and answers on each owning executor's *action* pipe. The main thread
starts each round with ``GO`` on every action pipe.

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

An executor whose env spends longer than ``EnvCfg.env_step_timeout_s`` in
one call is killed as hung (``kill_hung``, from the main thread: executors
stamp the shared ``heartbeat`` before each env call and clear it while they
wait for work). A dead executor is restarted by the main thread
(``dead_executors``, ``restart``), with the actors paused: it gets a new
incarnation, so records its predecessor left in the ready pipe are dropped
by ``take_ready``, and it joins the round in flight at once, re-running its
envs' steps of the round from ``t = 0`` on their next episodes (the caller
forgets what the dead one wrote). A resumed run starts executors that rebuild their envs from an
``EnvHistory`` (``start``).

Executors run ``python -c "from conveyor.architectures.hts.state_buffer import main; main()"``
(like the vector env's workers: spec as JSON on stdin, no torch import, no
re-import of the parent's ``__main__``), ignore SIGINT, and exit when the parent's end of
their action pipe closes.
"""

from __future__ import annotations

import collections
import os
import select
import subprocess
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import gymnasium as gym
import numpy as np

from conveyor.config import ConfigError, EnvCfg
from conveyor.errors import WorkerFailure
from conveyor.envs.make import env_spaces
from conveyor.envs.shm_worker import EnvWorker, WorkerSpec, env_worker_layout, write_message
from conveyor.storage.shm import ArraySpec, SharedArrays
from conveyor.procs import RestartBudget, child_prologue, close_children, exit_reason, reap, start_child

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

if TYPE_CHECKING:
    from conveyor.envs.history import EnvHistory

_RECORD = np.dtype("<i4")
_ENTRY = "from conveyor.architectures.hts.state_buffer import main; main()"


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
    array_specs: tuple
    shm_fd: int
    ready_fd: int
    """Write end of the shared ready pipe."""
    action_fd: int
    """Read end of this executor's action pipe."""
    env_offset: int = 0
    """Global index of env 0 of the buffer (a data-parallel rank's first env): seeds and uniforms use it."""


class _Executor(NamedTuple):
    index: int
    process: subprocess.Popen
    action_fd: int
    first_env: int
    num_envs: int

    def describe(self) -> str:
        last = self.first_env + self.num_envs - 1
        return f"executor {self.index} (pid {self.process.pid}, envs {self.first_env}-{last})"


def _records(values: Any) -> bytes:
    return np.asarray(values, dtype=_RECORD).tobytes()


def _shutdown(executors: list[_Executor], ready_fds: tuple[int, int], shared: SharedArrays) -> None:
    """Stop the executors (STOP, then by force), close the pipes, release the memory block."""
    close_children([executor.process for executor in executors], [executor.action_fd for executor in executors],
                   _records([STOP]))
    executors.clear()
    for fd in ready_fds:
        os.close(fd)
    shared.close()


class StateBuffer:
    """Parent side: starts the executors; actors take requests and answer them; the main thread starts rounds."""

    def __init__(self, cfg: EnvCfg, seed: int, sync_interval: int, *, gamma: float | None = None,
                 start: EnvHistory | None = None, first_round: int = 0, env_offset: int = 0) -> None:
        """``start``: rebuild every env to the state this history recorded (a resumed run), and play rounds
        from ``first_round`` on; otherwise every env starts episode 0. ``env_offset``: the global index of env
        0 here, when the envs are a data-parallel rank's share of a run's (env i is seeded as env
        ``env_offset + i``)."""
        self.cfg, self.num_envs, self.sync_interval, self.seed = cfg, cfg.num_envs, sync_interval, seed
        self.env_offset = env_offset
        self.gamma = gamma
        self.single_observation_space, self.single_action_space = env_spaces(cfg, seed)
        obs_space, act_space = self.single_observation_space, self.single_action_space
        if not isinstance(obs_space, gym.spaces.Box):
            raise ConfigError(f"env {cfg.id!r} has a {type(obs_space).__name__} observation space: hts needs a Box")
        if isinstance(act_space, gym.spaces.Discrete):
            uniform_shape: tuple[int, ...] = ()
        elif isinstance(act_space, gym.spaces.Box) and len(act_space.shape) == 1:
            uniform_shape = act_space.shape
        else:
            raise ConfigError(f"env {cfg.id!r} has a {act_space} action space: hts needs Discrete or a 1-D Box")
        B, workers = cfg.num_envs, cfg.num_workers
        self.shared = SharedArrays([
            *env_worker_layout(B, workers, obs_space, act_space),  # what EnvWorker reads and writes; HTS adds:
            ArraySpec("uniform", (B, *uniform_shape), "float32"),
            ArraySpec("request_step", (B,), "int64"),
            ArraySpec("env_seconds", (workers,), "float64"),
            ArraySpec("action_wait", (workers, 2), "float64"),  # seconds from posting a request to its action, count
        ])
        self._uniform_shape = uniform_shape
        shared = self.shared
        self.obs, self.final_obs, self.actions = shared["obs"], shared["final_obs"], shared["actions"]
        self.reward, self.terminated, self.truncated = shared["reward"], shared["terminated"], shared["truncated"]
        self.episode_return, self.new_game = shared["episode_return"], shared["new_game"]
        self.uniform = shared["uniform"]
        self.request_step = shared["request_step"]
        """[B] step ``t`` of env b's waiting request: ``t < alpha`` acts; ``t > 0`` carries step t-1's result."""
        # The parent keeps the write end too: a restarted executor needs it.
        self._ready_fd, self._ready_write = os.pipe()
        os.set_blocking(self._ready_fd, False)  # several actors select() on it; the losers must not block
        self._executors: list[_Executor] = []
        self._owner = np.repeat(np.arange(workers), cfg.envs_per_worker)
        self._incarnation = np.zeros(workers, np.int64)
        self._hung_pids: set[int] = set()
        """Executors ``kill_hung`` killed (their deaths say so)."""
        self.restart_budget = RestartBudget(cfg.max_restarts)
        """Whoever replaces a dead executor spends a restart first, before it forgets what the dead one wrote."""
        self._finalizer = weakref.finalize(self, _shutdown, self._executors, (self._ready_fd, self._ready_write),
                                           self.shared)
        episodes = start.next_episode if start is not None else np.zeros(B, np.int64)
        plans = start.replay_plan() if start is not None else None
        try:
            for index in range(workers):
                envs = self.envs_of(index)
                replay = tuple(tuple(plans[e]) for e in envs) if plans is not None else ()
                self._executors.append(self._start_executor(index, episodes[envs], replay, first_round, False))
        except BaseException:
            self.close()
            raise

    def envs_of(self, index: int) -> np.ndarray:
        """The envs executor ``index`` steps."""
        per = self.cfg.envs_per_worker
        return np.arange(index * per, (index + 1) * per)

    def _start_executor(self, index: int, episodes: np.ndarray, replay: tuple, first_round: int,
                        join_round: bool) -> _Executor:
        per = self.cfg.envs_per_worker
        action_read, action_write = os.pipe()
        spec = ExecutorSpec(index, int(self._incarnation[index]), self.cfg, self.seed, self.gamma, index * per, per,
                            tuple(episodes.tolist()), replay, first_round, join_round, self.sync_interval,
                            self._uniform_shape, self.shared.specs, self.shared.fd, self._ready_write, action_read,
                            self.env_offset)
        try:
            process = start_child(_ENTRY, spec, (self.shared.fd, self._ready_write, action_read))
        except BaseException:
            os.close(action_write)
            raise
        finally:
            os.close(action_read)
        return _Executor(index, process, action_write, index * per, per)

    # ---- actor side ------------------------------------------------------------------------
    def take_ready(self, timeout_s: float) -> np.ndarray:
        """Indices of every env whose request waits now (empty after ``timeout_s`` without one)."""
        if not select.select([self._ready_fd], [], [], timeout_s)[0]:
            return np.empty(0, np.int64)
        try:
            data = os.read(self._ready_fd, _RECORD.itemsize * self.num_envs)
        except BlockingIOError:
            return np.empty(0, np.int64)  # another actor took them first
        records = np.frombuffer(data, _RECORD).astype(np.int64)
        envs, incarnations = records % self.num_envs, records // self.num_envs
        # A dead executor's requests may still wait in the pipe: its successor re-posts them.
        return envs[incarnations == self._incarnation[self._owner[envs]]]

    def send_actions(self, envs: np.ndarray, actions: np.ndarray) -> None:
        """Write ``actions`` for ``envs`` into the action buffer and wake their executors."""
        self.actions[envs] = actions
        by_owner: dict[int, list[int]] = {}
        for env, owner in zip(envs.tolist(), self._owner[envs].tolist()):
            by_owner.setdefault(owner, []).append(env)
        for owner, owned in by_owner.items():
            _write_to_live(self._executors[owner].action_fd, _records(owned))

    # ---- main-thread side ------------------------------------------------------------------
    def start_round(self) -> None:
        for executor in self._executors:
            _write_to_live(executor.action_fd, _records([GO]))

    def kill_hung(self) -> None:
        """Kill the executors whose env has been in one call (make, reset, step) for longer than
        ``cfg.env_step_timeout_s``; ``dead_executors`` then lists them."""
        timeout, now = self.cfg.env_step_timeout_s, time.monotonic()
        for executor, beat in zip(self._executors, self.shared["heartbeat"]):
            if timeout and beat and now - beat > timeout and executor.process.poll() is None:
                executor.process.kill()
                executor.process.wait()
                self._hung_pids.add(executor.process.pid)

    def dead_executors(self) -> list[int]:
        """Indices of the executors that have exited."""
        return [executor.index for executor in self._executors if executor.process.poll() is not None]

    def death(self, index: int) -> str:
        """What killed executor ``index``, in a line."""
        executor = self._executors[index]
        if executor.process.pid in self._hung_pids:
            return (f"HTS {executor.describe()} of {self.cfg.id!r} hung: an env call did not return for "
                    f"{self.cfg.env_step_timeout_s:g} s (--env-step-timeout-s; raise it if the env is that slow); "
                    "killed it")
        return (f"HTS {executor.describe()} of {self.cfg.id!r} exited "
                f"({exit_reason(executor.process.poll())}): {self._message(index) or 'no message'}")

    def restart(self, index: int, episodes: np.ndarray, round_index: int) -> None:
        """Replace dead executor ``index``: its envs start episodes ``episodes`` and it plays round
        ``round_index`` from step 0 at once. Call with the actors paused, after forgetting what the dead
        one wrote this round."""
        old = self._executors[index]
        os.close(old.action_fd)
        reap([old.process])
        self.shared["message"][index] = 0
        self.shared["heartbeat"][index] = 0.0
        self._incarnation[index] += 1
        self._executors[index] = self._start_executor(index, episodes, (), round_index, True)

    def check_env_errors(self) -> None:
        """Raise ``WorkerFailure`` when env errors exceed the limit."""
        errors = int(self.shared["env_errors"].sum())
        if errors > self.cfg.max_env_errors:
            raise WorkerFailure(f"{errors} env errors exceed max_env_errors={self.cfg.max_env_errors}; last one: "
                               f"{self._message(int(np.argmax(self.shared['env_errors'])))}")

    @property
    def executor_pids(self) -> list[int]:
        return [executor.process.pid for executor in self._executors]

    @property
    def env_seconds(self) -> float:
        """Seconds all executors together have spent inside env steps."""
        return float(self.shared["env_seconds"].sum())

    @property
    def action_wait_s(self) -> float:
        """Mean seconds an env waited for its action (its request posted to the action read, as the executors
        measure it: most of the throughput model's beta) over every step so far; NaN before the first."""
        seconds, count = self.shared["action_wait"].sum(axis=0)
        return float(seconds / count) if count else float("nan")

    @property
    def env_step_s(self) -> float:
        """Mean seconds of one env step (the executors' clock around ``env.step``) over every step so far."""
        count = self.shared["action_wait"][:, 1].sum()
        return self.env_seconds / count if count else float("nan")

    @property
    def env_errors(self) -> int:
        return int(self.shared["env_errors"].sum())

    def _message(self, index: int) -> str:
        return self.shared["message"][index].tobytes().split(b"\0", 1)[0].decode("utf-8", "replace")

    def close(self) -> None:
        """Stop the executors and free the shared memory (idempotent)."""
        self._finalizer()


def _write_to_live(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except BrokenPipeError:
        pass  # the executor died: the main thread restarts it, and its successor re-posts its requests


# ---- executor process ----------------------------------------------------------------------
def _read_records(action_fd: int, num_envs: int, heartbeat: np.ndarray) -> list[int]:
    """The records waiting on the action pipe (blocks for at least one); ``[STOP]`` when the parent has gone
    (end of file). Clears ``heartbeat`` while it waits: no env call is under way then."""
    heartbeat[0] = 0.0
    data = os.read(action_fd, _RECORD.itemsize * (num_envs + 1))
    return np.frombuffer(data, _RECORD).tolist() if data else [STOP]


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
        os.write(spec.ready_fd, _records([e + tag for e in indices]))

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
    except BaseException:
        write_message(shared["message"][spec.index], traceback.format_exc())
        raise
    finally:
        shared.close()
