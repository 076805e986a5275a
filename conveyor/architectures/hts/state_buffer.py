"""HTS-RL state and action buffers between executor processes and actor threads (the parent side).

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

The executors (``cfg.num_workers`` processes, each owning ``cfg.envs_per_worker``
consecutive envs, stepping each env as soon as its action arrives and drawing the uniforms that pick
the actions) are the other side of this boundary: ``conveyor.architectures.hts.executors``.

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

``StateBuffer`` starts them as ``python -c ENTRY`` (``procs.start_child``: their spec as JSON on stdin).
"""

from __future__ import annotations

import os
import select
import subprocess
import time
import weakref
from typing import TYPE_CHECKING, NamedTuple

import gymnasium as gym
import numpy as np

from conveyor.config import EnvCfg
from conveyor.errors import ConfigError, WorkerFailure
from conveyor.envs.make import env_spaces
from conveyor.envs.shm_worker import env_worker_layout, read_message
from conveyor.storage.shm import ArraySpec, SharedArrays
from conveyor.procs import RestartBudget, close_children, exit_reason, reap, start_child
from conveyor.architectures.hts.executors import GO, RECORD, STOP, ExecutorSpec, records

if TYPE_CHECKING:
    from conveyor.envs.history import EnvHistory

_ENTRY = "from conveyor.architectures.hts.executors import main; main()"


class _Executor(NamedTuple):
    index: int
    process: subprocess.Popen
    action_fd: int
    first_env: int
    num_envs: int

    def describe(self) -> str:
        last = self.first_env + self.num_envs - 1
        return f"executor {self.index} (pid {self.process.pid}, envs {self.first_env}-{last})"


def _shutdown(executors: list[_Executor], ready_fds: tuple[int, int], shared: SharedArrays) -> None:
    """Stop the executors (STOP, then by force), close the pipes, release the memory block."""
    close_children([executor.process for executor in executors], [executor.action_fd for executor in executors],
                   records([STOP]))
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
            data = os.read(self._ready_fd, RECORD.itemsize * self.num_envs)
        except BlockingIOError:
            return np.empty(0, np.int64)  # another actor took them first
        tagged = np.frombuffer(data, RECORD).astype(np.int64)
        envs, incarnations = tagged % self.num_envs, tagged // self.num_envs
        # A dead executor's requests may still wait in the pipe: its successor re-posts them.
        return envs[incarnations == self._incarnation[self._owner[envs]]]

    def send_actions(self, envs: np.ndarray, actions: np.ndarray) -> None:
        """Write ``actions`` for ``envs`` into the action buffer and wake their executors."""
        self.actions[envs] = actions
        by_owner: dict[int, list[int]] = {}
        for env, owner in zip(envs.tolist(), self._owner[envs].tolist()):
            by_owner.setdefault(owner, []).append(env)
        for owner, owned in by_owner.items():
            _write_to_live(self._executors[owner].action_fd, records(owned))

    # ---- main-thread side ------------------------------------------------------------------
    def start_round(self) -> None:
        for executor in self._executors:
            _write_to_live(executor.action_fd, records([GO]))

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
        """Executor ``index``'s last error, in one line (``read_message``; its traceback went to stderr)."""
        return read_message(self.shared["message"][index])[0]

    def close(self) -> None:
        """Stop the executors and free the shared memory (idempotent)."""
        self._finalizer()


def _write_to_live(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except BrokenPipeError:
        pass  # the executor died: the main thread restarts it, and its successor re-posts its requests
