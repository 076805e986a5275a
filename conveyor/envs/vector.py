"""Vectorized env stepping: ``make_vector_env`` and the shared-memory backend.

``ShmVectorEnv`` (backend ``shm``) runs ``cfg.num_workers`` worker processes
(``conveyor.envs.shm_worker``); worker w owns envs
``[w * k, (w + 1) * k)``, ``k = cfg.envs_per_worker``; global env i is
made with ``make_env(cfg, seed + i)`` and its episode k starts with
``reset(seed=episode_seed(seed, i, k))``, so a run is reproducible from
``seed``, and ``history`` (``EnvHistory``) says how to rebuild every env.
Observations, actions, rewards, flags and episode statistics live in one
shared memory block (``conveyor.storage.shm.SharedArrays``); each
step the master writes the actions, sends each worker one command byte down
a pipe, and waits for one status byte back. Nothing is pickled per step.

Workers are plain ``subprocess`` children running a small entry point (not
``multiprocessing``): like the spawn start method they share nothing with
the master but the memory block and two pipes, but they never re-import the
master's ``__main__`` (which may import torch), so they start in the time
numpy and gymnasium take to import. A worker whose pipe closes has died; the
master notices at once (end of file on the reply pipe), or within
``poll_interval_s`` by polling the process. A worker that owes a reply and
has begun no env call for ``cfg.env_step_timeout_s`` since the command (or
its last env call) went out is hung (an env stuck in a call, a stopped
process): the master kills it and treats it as dead. With
``restart_workers`` it starts a replacement (up to ``cfg.max_restarts`` per
vector env) whose envs begin their next episodes, and flags them in
``StepResult.restarted``: their step was lost. Otherwise, and past the
limit, it raises ``WorkerFailure`` naming the worker. Once ``stop()`` turns
true (the run was asked to stop), workers that have not answered within
``CLOSE_GRACE_S`` are killed and ``WorkerFailure`` says so, whatever their
envs do. With ``env_state`` (``EnvHistory.state()`` of an earlier run), the
first ``reset`` replays every env to where that run stopped.

Worker groups (``split``): ``venv.split(n)`` cuts the workers into ``n``
runs of consecutive workers, each an ``EnvGroup`` with its own
``step_async``/``step_wait`` over its rows (``EnvGroup.envs``), so that one
group steps while the caller works on another's observations (PAAC's
``--env-groups``). A group waits for, restarts and times out its own workers
only; the others' replies stay in their pipes. ``history`` still records one
row per step of every env: a group's part of step k waits (copied) until every
group has finished step k, so no group may start a step more than one ahead
of the slowest group's last finished one. ``step_async``/``step_wait`` of the
vector env itself step all its workers as one group.

Step semantics (both backends): see ``StepResult``.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
import weakref
from typing import Any, Callable, NamedTuple

import gymnasium as gym
import numpy as np

from conveyor.config import EnvCfg
from conveyor.errors import ConfigError, StoppedWhileStarting, WorkerDied, WorkerFailure
from conveyor.envs.envpool_backend import EnvpoolVectorEnv
from conveyor.envs.history import EnvHistory
from conveyor.envs.inproc import InProcessVectorEnv, choose_backend
from conveyor.envs.make import env_spaces
from conveyor.envs.native_vector import NativeVectorEnv, check_env_state, loads_natively
from conveyor.envs.shm_worker import (
    CMD_CLOSE,
    CMD_RESET,
    CMD_STEP,
    env_worker_layout,
    REPLY_ENV_ERROR,
    REPLY_FATAL,
    REPLY_OBS_SHAPE,
    REPLY_OK,
    WorkerSpec,
    read_message,
)
from conveyor.envs.vector_api import ObsShapeError, StepResult, VectorEnv
from conveyor.storage.shm import SharedArrays
from conveyor.procs import CLOSE_GRACE_S, RestartBudget, close_children, exit_reason, reap, start_child

_WORKER_ENTRY = "from conveyor.envs.shm_worker import main; main()"
_SUPPORTED_SPACES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)


def make_vector_env(cfg: EnvCfg, seed: int, *, gamma: float | None = None, copy: bool = True,
                    restart_workers: bool = False, env_state: dict[str, Any] | None = None,
                    stop: Callable[[], bool] | None = None, env_offset: int = 0) -> VectorEnv:
    """``cfg.num_envs`` envs stepped together by ``cfg.backend``: ``shm`` (worker processes), ``inproc`` (this
    process, ``conveyor.envs.inproc``), ``envpool``, ``vector`` (gymnasium's own vector env, this process,
    ``conveyor.envs.native_vector``), or ``auto``, which picks ``vector`` where it can, else ``inproc`` or ``shm``
    from the env's measured step time (``choose_backend``; a run resolves it once at its start and records it).

    Env i is seeded with ``seed + env_offset + i`` (``env_offset``: its global index is that, when the envs
    are a data-parallel rank's share of a run's). ``step`` returns a ``StepResult``. With
    ``copy=False`` its arrays (and ``reset``'s) are views into buffers that
    the next ``reset``/``step`` overwrites: use it when the caller copies
    the data out at once, to avoid allocating every step. ``gamma`` is the
    run's discount, which ``cfg.normalize_reward`` needs (``make_env``).
    ``env_state`` rebuilds a run's envs (``shm`` and ``inproc`` from an ``EnvHistory``'s state, ``vector`` from
    its own: ``check_env_state`` refuses the other kind in one line); ``restart_workers`` and ``stop``: see
    ``ShmVectorEnv`` (worker processes only). Call ``close()`` (or use ``with``) when done; it also runs
    at interpreter exit.
    """
    backend = cfg.backend
    if backend == "auto":  # a checkpoint's action history: only inproc and shm replay it
        backend = choose_backend(cfg, seed, native=loads_natively(env_state)).backend
    if backend == "vector":
        return NativeVectorEnv(cfg, seed, gamma=gamma, copy=copy, env_state=env_state, env_offset=env_offset)
    check_env_state(backend, env_state)
    if backend == "envpool":
        if env_state is not None:
            raise ConfigError("the envpool backend cannot rebuild its envs from a checkpoint: resume with "
                              "--env-backend shm")
        return EnvpoolVectorEnv(cfg, seed, copy=copy, env_offset=env_offset)
    if backend == "inproc":
        return InProcessVectorEnv(cfg, seed, checked_spaces(cfg, seed), gamma=gamma, copy=copy,
                                  env_state=env_state, env_offset=env_offset)
    return ShmVectorEnv(cfg, seed, gamma=gamma, copy=copy, restart_workers=restart_workers, env_state=env_state,
                        stop=stop, env_offset=env_offset)


def checked_spaces(cfg: EnvCfg, seed: int) -> tuple[gym.Space, gym.Space]:
    """The env's (observation, action) spaces (``env_spaces``), refused in one line unless the vector envs of
    ``shm`` and ``inproc`` can hold them."""
    spaces = env_spaces(cfg, seed)
    for role, space in zip(("observation", "action"), spaces):
        if not isinstance(space, _SUPPORTED_SPACES):
            raise ConfigError(f"env {cfg.id!r} has a {type(space).__name__} {role} space: the vector env "
                              "supports Box, Discrete, MultiDiscrete and MultiBinary")
    return spaces


class EnvGroup:
    """The envs ``envs`` (rows of the vector env) of the workers ``workers`` of a ``ShmVectorEnv``, stepped on their
    own (``ShmVectorEnv.split``; see the module docstring). ``step_async`` takes actions ``[num_envs, ...]`` for
    these envs only and ``step_wait`` returns their rows of the ``StepResult``."""

    def __init__(self, venv: ShmVectorEnv, workers: range) -> None:
        self._venv = venv
        self.workers = workers
        per_worker = venv.cfg.envs_per_worker
        self.envs = slice(workers.start * per_worker, workers.stop * per_worker)
        self.num_envs = len(workers) * per_worker

    def step_async(self, actions: Any) -> None:
        self._venv._step_async(self, actions)

    def step_wait(self) -> StepResult:
        return self._venv._step_wait(self)

    def step(self, actions: Any) -> StepResult:
        self.step_async(actions)
        return self.step_wait()


class _WholeEnv:
    """Every env of a vector env of any backend as its one group (``split_envs``)."""

    def __init__(self, venv: VectorEnv) -> None:
        self.venv = venv
        self.num_envs = venv.num_envs
        self.envs = slice(0, venv.num_envs)

    def step_async(self, actions: Any) -> None:
        self.venv.step_async(actions)

    def step_wait(self) -> StepResult:
        return self.venv.step_wait()


def split_envs(venv: VectorEnv, groups: int) -> list[EnvGroup | _WholeEnv]:
    """``venv``'s envs in ``groups`` groups of consecutive rows (``.envs``), each with its own
    ``step_async``/``step_wait`` (``ShmVectorEnv.split``); one group is the vector env itself, of any backend."""
    if groups == 1:
        return [_WholeEnv(venv)]
    if not isinstance(venv, ShmVectorEnv):
        raise ConfigError(f"--env-groups {groups} steps groups of the shm backend's worker processes: pass "
                          "--env-groups 1 or --env-backend shm")
    return venv.split(groups)  # type: ignore[return-value]


class _Row(NamedTuple):
    """One step of every env for ``EnvHistory.record``, filled group by group (``ShmVectorEnv._record``)."""

    actions: np.ndarray
    done: np.ndarray
    new_game: np.ndarray
    restarted: np.ndarray
    filled: np.ndarray  # [B] bool: rows written so far


class _Worker(NamedTuple):
    index: int
    process: subprocess.Popen
    command_fd: int
    reply_fd: int
    first_env: int
    num_envs: int

    def describe(self) -> str:
        return (f"env worker {self.index} (pid {self.process.pid}, envs "
                f"{self.first_env}-{self.first_env + self.num_envs - 1})")


def _shutdown(workers: list[_Worker], shared: SharedArrays) -> None:
    """Stop the workers (politely, then by force), close the pipes, release the memory block."""
    close_children([worker.process for worker in workers], [worker.command_fd for worker in workers], CMD_CLOSE)
    for worker in workers:
        os.close(worker.reply_fd)
    shared.close()


class ShmVectorEnv:
    """B envs stepped in lockstep by worker processes over shared memory (see the module docstring)."""

    def __init__(self, cfg: EnvCfg, seed: int, *, gamma: float | None = None, copy: bool = True,
                 poll_interval_s: float = 0.2, restart_workers: bool = False,
                 env_state: dict[str, Any] | None = None, stop: Callable[[], bool] | None = None,
                 env_offset: int = 0) -> None:
        """``stop``: polled while waiting for workers that are slow to answer; once it returns true, they get
        ``CLOSE_GRACE_S`` more (see the module docstring). ``env_offset``: see ``make_vector_env``."""
        self.cfg = cfg
        self.seed = seed
        self.env_offset = env_offset
        self.gamma = gamma
        self.num_envs = cfg.num_envs
        self.num_workers = cfg.num_workers
        self.copy = copy
        self._poll_ms = int(poll_interval_s * 1000)
        self.single_observation_space, self.single_action_space = checked_spaces(cfg, seed)
        self._shared = SharedArrays(env_worker_layout(cfg.num_envs, cfg.num_workers, self.single_observation_space,
                                                      self.single_action_space))
        shared = self._shared
        self._actions = shared["actions"]
        self._env_errors = shared["env_errors"]
        self._new_game = shared["new_game"]
        self._heartbeat = shared["heartbeat"]
        self._sent_at = np.zeros(cfg.num_workers)
        """When each worker was last sent a command (0: none since it started)."""
        self._stop = stop
        self._stop_seen = 0.0
        self._restarted = np.zeros(cfg.num_envs, bool)
        self._views = StepResult(shared["obs"], shared["reward"], shared["terminated"], shared["truncated"],
                                 shared["final_obs"], shared["episode_return"], shared["episode_length"],
                                 self._restarted)
        self.restart_workers = restart_workers
        self.restart_budget = RestartBudget(cfg.max_restarts)
        self.history = EnvHistory.from_state(env_state) if env_state else EnvHistory(cfg.num_envs)
        self._replaying = env_state is not None
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, shared)
        self._sent = [0] * cfg.num_workers
        """Steps each worker was sent since the start (ahead of ``_done`` by one while it steps)."""
        self._done = [0] * cfg.num_workers
        """Steps each worker finished."""
        self._pollers: dict[range, tuple[Any, dict[int, _Worker]]] = {}
        """Per run of workers waited for, a poll object on their reply pipes (dropped at every restart)."""
        self._rows: dict[int, _Row] = {}
        """Steps some group finished and another has not, by index: their part of the history row so far."""
        self._all = EnvGroup(self, range(cfg.num_workers))
        self._broken = ""
        try:
            for index in range(cfg.num_workers):
                self._start_worker(index)
            self._collect("starting", self._all.workers)
        except BaseException:
            self.close()
            raise

    # -- public API --------------------------------------------------------

    @property
    def restarts(self) -> int:
        """Workers restarted so far."""
        return self.restart_budget.restarts

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers (as started; they are gone after ``close``)."""
        return [worker.process.pid for worker in self._workers]

    @property
    def env_errors(self) -> int:
        """Env exceptions so far (each one reset its env and truncated its episode)."""
        return int(self._env_errors.sum())

    def split(self, groups: int) -> list[EnvGroup]:
        """The workers cut into ``groups`` runs of consecutive workers that step on their own (see the module
        docstring); ``groups`` must divide ``num_workers``."""
        if groups <= 0 or self.num_workers % groups:
            raise ValueError(f"{self.num_workers} env workers do not split into {groups} groups")
        size = self.num_workers // groups
        return [EnvGroup(self, range(first, first + size)) for first in range(0, self.num_workers, size)]

    def reset(self) -> np.ndarray:
        """Reset every env; return the first observations ``[B, *obs_shape]``."""
        self._check_usable()
        if self._sent != self._done:
            raise RuntimeError("reset() called between step_async() and step_wait(): call step_wait() first")
        if self._rows:
            raise RuntimeError("reset() called with groups at different steps: step the others up to them first")
        self._restarted[:] = False
        self._send(CMD_RESET, "resetting", self._all.workers)
        self._collect("resetting", self._all.workers)
        if self._replaying:  # the workers rebuilt the recorded games: the history already holds them
            self._replaying = False
        else:
            self.history.start_games(slice(None))
        return self._views.obs.copy() if self.copy else self._views.obs

    def step_async(self, actions: Any) -> None:
        """Hand ``actions`` ``[B, *action_shape]`` to the workers and return at once."""
        self._step_async(self._all, actions)

    def step_wait(self) -> StepResult:
        """Wait for the step started by ``step_async`` and return its ``StepResult``."""
        return self._step_wait(self._all)

    def step(self, actions: Any) -> StepResult:
        self.step_async(actions)
        return self.step_wait()

    def close(self) -> None:
        """Stop the workers and free the shared memory (idempotent)."""
        self._broken = self._broken or "the vector env is closed"
        self._finalizer()

    def __enter__(self) -> ShmVectorEnv:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- stepping (the whole vector env or one group) ------------------------

    def _step_async(self, group: EnvGroup, actions: Any) -> None:
        self._check_usable()
        workers = group.workers
        first, stop = workers.start, workers.stop
        sent = self._sent[first:stop]
        if sent != self._done[first:stop]:
            raise RuntimeError("step_async() called twice: call step_wait() before the next step_async()")
        if min(sent) != max(sent):
            raise RuntimeError("step_async() of workers at different steps: step the other groups up to them first")
        if sent[0] > min(self._done) + 1:
            raise RuntimeError("step_async() of a group two steps ahead of another: step_wait() the others first")
        expected = (group.num_envs, *self._actions.shape[1:])
        if np.shape(actions) != expected:
            raise ValueError(f"actions have shape {np.shape(actions)}, expected {expected}")
        self._actions[group.envs] = actions
        self._send(CMD_STEP, "stepping", workers)
        self._sent[first:stop] = [sent[0] + 1] * len(workers)

    def _step_wait(self, group: EnvGroup) -> StepResult:
        workers, rows = group.workers, group.envs
        first, stop = workers.start, workers.stop
        done = self._done[first:stop]
        if any(sent <= finished for sent, finished in zip(self._sent[first:stop], done)):
            raise RuntimeError("step_wait() called without step_async()")
        self._done[first:stop] = [done[0] + 1] * len(workers)
        self._restarted[rows] = False
        self._collect("stepping", workers)
        if group is self._all:  # the whole row at once
            self.history.record(self._actions, self._views.terminated | self._views.truncated, self._new_game)
            if self._restarted.any():
                self.history.start_games(self._restarted)
        else:
            self._record(done[0], rows)
        views = self._views if group is self._all else StepResult(*(view[rows] for view in self._views))
        if self.copy:
            return StepResult(*(array.copy() for array in views))
        return views

    def _record(self, step: int, rows: slice) -> None:
        """Hand ``history`` a group's rows ``rows`` of step ``step``, just finished: kept until every group's are in,
        then the whole row."""
        if step not in self._rows:
            self._rows[step] = _Row(np.empty_like(self._actions), np.zeros(self.num_envs, bool),
                                    np.zeros(self.num_envs, bool), np.zeros(self.num_envs, bool),
                                    np.zeros(self.num_envs, bool))
        row = self._rows[step]
        row.actions[rows] = self._actions[rows]
        row.done[rows] = self._views.terminated[rows] | self._views.truncated[rows]
        row.new_game[rows] = self._new_game[rows]
        row.restarted[rows] = self._restarted[rows]
        row.filled[rows] = True
        if not row.filled.all():
            return
        del self._rows[step]  # steps finish in order: every earlier row went before
        self.history.record(row.actions, row.done, row.new_game)
        if row.restarted.any():
            self.history.start_games(row.restarted)

    # -- workers -----------------------------------------------------------

    def _start_worker(self, index: int) -> _Worker:
        per_worker = self.cfg.envs_per_worker
        rows = slice(index * per_worker, (index + 1) * per_worker)
        command_read, command_write = os.pipe()
        reply_read, reply_write = os.pipe()
        self._heartbeat[index] = self._sent_at[index] = 0.0  # no timeout until it begins making its envs
        replay = tuple(tuple(plan) for plan in self.history.replay_plan()[rows]) if self._replaying else ()
        spec = WorkerSpec(index, self.cfg, self.seed, self.gamma, index * per_worker, per_worker,
                          tuple(self.history.next_episode[rows].tolist()), replay, self._shared.specs,
                          self._shared.fd, command_read, reply_write, self.env_offset)
        process = start_child(_WORKER_ENTRY, spec, (self._shared.fd, command_read, reply_write))
        os.close(command_read)
        os.close(reply_write)
        worker = _Worker(index, process, command_write, reply_read, index * per_worker, per_worker)
        if index < len(self._workers):
            self._workers[index] = worker
        else:
            self._workers.append(worker)
        return worker

    def _restart(self, worker: _Worker, action: str, failure: Exception | None = None) -> None:
        """Replace a dead worker (``failure``: how it ended, if not by itself); its envs start their next
        episodes (seeded) and are flagged ``restarted``."""
        failure = failure or self._died(worker, action)
        if not self.restart_workers:
            raise failure
        try:
            self.restart_budget.spend(str(failure))
        except WorkerFailure as spent:
            raise self._fail(spent) from None
        self._broken = ""
        self._pollers.clear()
        for fd in (worker.command_fd, worker.reply_fd):
            os.close(fd)
        replacement = self._start_worker(worker.index)
        self._await_reply(replacement, "restarting")
        if action != "starting":  # it must answer the command the others are answering: reset its envs
            self._command(replacement, CMD_RESET)
            self._await_reply(replacement, "restarting")
            self._restarted[replacement.first_env:replacement.first_env + replacement.num_envs] = True

    def _await_reply(self, worker: _Worker, action: str) -> None:
        """One reply from ``worker`` alone (the others' replies stay queued in their pipes)."""
        while not select.select([worker.reply_fd], [], [], self._poll_ms / 1000)[0]:
            if worker.process.poll() is not None:
                break
            if self._silent_too_long(worker):
                raise self._hung(worker, action)
        reply = os.read(worker.reply_fd, 1)
        if not reply:
            raise self._died(worker, action)
        if reply != REPLY_OK:
            self._raise_for(worker, reply, action)

    def _check_usable(self) -> None:
        if self._broken:
            raise RuntimeError(f"vector env unusable: {self._broken}")

    def _fail(self, error: Exception) -> Exception:
        self._broken = str(error)
        return error

    def _died(self, worker: _Worker, action: str) -> Exception:
        reap([worker.process])  # its pipe closed: it is exiting, or it lingers and is killed
        return self._fail(WorkerDied(f"{worker.describe()} of {self.cfg.id!r} died while {action} "
                                     f"({exit_reason(worker.process.returncode)}); see its output above"))

    def _stopping_since(self) -> float:
        """When ``stop()`` was first seen to hold (0: not yet)."""
        if not self._stop_seen and self._stop is not None and self._stop():
            self._stop_seen = time.monotonic()
        return self._stop_seen

    def _silent_too_long(self, worker: _Worker) -> bool:
        """Whether ``worker``, which owes a reply, has begun no env call for ``cfg.env_step_timeout_s`` since
        it was sent its command or began its last one (never while it starts Python and imports)."""
        beat = self._heartbeat[worker.index]
        timeout = self.cfg.env_step_timeout_s
        return bool(timeout and beat and time.monotonic() - max(beat, self._sent_at[worker.index]) > timeout)

    def _hung(self, worker: _Worker, action: str) -> Exception:
        """Kill ``worker``, which is silent too long, and say so."""
        worker.process.kill()
        worker.process.wait()
        timeout = self.cfg.env_step_timeout_s
        return self._fail(WorkerDied(
            f"{worker.describe()} of {self.cfg.id!r} hung while {action}: no env call began and no answer came "
            f"for {timeout:g} s (--env-step-timeout-s; raise it if the env is that slow); killed it"))

    def _starting(self, action: str) -> bool:
        """Whether the workers are still building their envs, or replaying a resumed run's games: no step ran."""
        return action == "starting" or self._replaying

    def _abandon(self, workers: list[_Worker], action: str) -> Exception:
        """Kill ``workers``, which did not answer when the run was asked to stop, and say so: at once while they
        start (a ``StoppedWhileStarting``: there is no step to finish), else after ``CLOSE_GRACE_S`` (a
        ``WorkerFailure``)."""
        for worker in workers:
            worker.process.kill()
            worker.process.wait()
        named = ", ".join(worker.describe() for worker in workers)
        if self._starting(action):
            doing = "replaying the resumed run's games" if self._replaying else action
            return self._fail(StoppedWhileStarting(
                f"{named} of {self.cfg.id!r} still {doing} when the run was asked to stop: killed; no step ran, "
                "so nothing new is saved"))
        return self._fail(WorkerFailure(f"{named} of {self.cfg.id!r} still {action} {CLOSE_GRACE_S:g} s after "
                                        "the run was asked to stop: killed"))

    def _message(self, worker: _Worker) -> tuple[str, str]:
        """The worker's last error: one line, and the traceback behind it."""
        return read_message(self._shared["message"][worker.index])

    def _command(self, worker: _Worker, command: bytes) -> None:
        self._sent_at[worker.index] = time.monotonic()
        os.write(worker.command_fd, command)

    def _send(self, command: bytes, action: str, workers: range) -> None:
        for worker in [self._workers[index] for index in workers]:
            try:
                self._command(worker, command)
            except BrokenPipeError:
                if not self.restart_workers:
                    raise self._died(worker, action) from None
                # Restarted by _wait, which finds its reply pipe at end of file.

    def _collect(self, action: str, workers: range) -> None:
        try:
            self._wait(action, workers)
        except BaseException:
            # Replies may still be in flight (e.g. after Ctrl-C): the pipes are out of step for good.
            self._broken = self._broken or f"interrupted while {action}"
            raise

    def _wait(self, action: str, workers: range) -> None:
        """Collect one reply from each of ``workers``; restart dead and hung ones (or raise); raise on errors and,
        past the grace period, once ``stop()`` holds. Other workers' replies stay in their pipes."""
        waiting = set(workers)
        if workers not in self._pollers:  # these workers' pipes only (a restart drops every poller)
            poller = select.poll()
            for index in workers:
                poller.register(self._workers[index].reply_fd, select.POLLIN)
            self._pollers[workers] = poller, {self._workers[index].reply_fd: self._workers[index] for index in workers}
        poller, cached = self._pollers[workers]
        worker_by_fd = dict(cached)

        def restart(worker: _Worker, failure: Exception | None = None) -> None:
            poller.unregister(worker.reply_fd)  # before its pipe closes (its number may come back)
            del worker_by_fd[worker.reply_fd]
            self._restart(worker, action, failure)
            waiting.discard(worker.index)

        problems: list[tuple[_Worker, bytes]] = []
        while waiting:
            events = poller.poll(self._poll_ms)
            if not events:
                for worker in [self._workers[index] for index in workers]:
                    if worker.process.poll() is not None and worker.reply_fd in worker_by_fd:
                        restart(worker)
                stopping = self._stopping_since() if waiting else 0.0
                if stopping and (self._starting(action) or time.monotonic() - stopping > CLOSE_GRACE_S):
                    raise self._abandon([self._workers[index] for index in sorted(waiting)], action)
                for index in sorted(waiting):
                    worker = self._workers[index]
                    if self._silent_too_long(worker):
                        failure = self._hung(worker, action)
                        if stopping:  # a replacement would only be stopped again
                            raise failure
                        restart(worker, failure)
                continue
            for fd, _ in events:
                worker = worker_by_fd.get(fd)
                if worker is None:
                    continue  # a worker replaced earlier in this loop
                reply = os.read(fd, 1)
                if not reply:
                    restart(worker)  # its rows may be half-written, even if it had replied
                    continue
                waiting.discard(worker.index)
                if reply != REPLY_OK:
                    problems.append((worker, reply))
        for worker, reply in problems:
            self._raise_for(worker, reply, action)

    def _raise_for(self, worker: _Worker, reply: bytes, action: str) -> None:
        message, details = self._message(worker)
        if reply == REPLY_OBS_SHAPE:
            raise self._fail(ObsShapeError(message))
        if reply == REPLY_FATAL:
            raise self._fail(WorkerFailure(f"{worker.describe()} failed while {action}: {message}", details))
        if reply == REPLY_ENV_ERROR and self.env_errors > self.cfg.max_env_errors:
            raise self._fail(WorkerFailure(
                f"{self.env_errors} env errors exceed max_env_errors={self.cfg.max_env_errors}; "
                f"last one, in {worker.describe()}: {message}", details))
