"""The env worker process of the ``shm`` vector env (see ``conveyor.envs.vector``).

A worker owns a contiguous slice of the vector env's envs. It reads one
command byte from its command pipe, acts on the shared arrays and answers
with one status byte on its reply pipe; no data travels through the pipes.
Before every env call (make, reset, step) it stamps its ``heartbeat`` row
with the time, so its owner can tell a hung env (or a stopped worker) from a
slow one (``EnvCfg.env_step_timeout_s``).
It runs as ``python -c "from conveyor.envs.shm_worker import main; main()"``
and reads from stdin, once, the parent's ``sys.path`` (so ids like
``pkg.module:Env-v0`` import the same modules) and its ``WorkerSpec``, as
JSON (``conveyor.procs.start_child``). It imports neither
torch nor the parent's ``__main__``, so it starts in the time numpy and
gymnasium take to import.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, NamedTuple

import numpy as np

from conveyor.envs.gym_api import EPISODE_KEY, LIFE_CONTINUED_KEY
from conveyor.envs.make import episode_seed, make_env
from conveyor.errors import error_line
from conveyor.storage.shm import ArraySpec, SharedArrays
from conveyor.procs import child_prologue

# Commands, master -> worker.
CMD_STEP = b"s"
CMD_RESET = b"r"
CMD_CLOSE = b"c"
# Replies, worker -> master.
REPLY_OK = b"k"
REPLY_ENV_ERROR = b"e"
"""The command completed, but at least one env raised and was reset (counted in ``env_errors``)."""
REPLY_OBS_SHAPE = b"o"
"""An env returned an observation of the wrong shape; the worker can go no further."""
REPLY_FATAL = b"x"
"""The worker hit an error it cannot recover from (message in ``message``)."""

MESSAGE_BYTES = 8192
"""A worker's message row: one line for the run's error, then the traceback (its end, if it is long)."""


def env_worker_layout(num_envs: int, num_workers: int, obs_space: Any, act_space: Any) -> list[ArraySpec]:
    """The shared arrays an ``EnvWorker`` reads and writes, one row per env (messages: one per worker)."""
    return [
        ArraySpec("obs", (num_envs, *obs_space.shape), np.dtype(obs_space.dtype).str),
        ArraySpec("final_obs", (num_envs, *obs_space.shape), np.dtype(obs_space.dtype).str),
        ArraySpec("actions", (num_envs, *act_space.shape), np.dtype(act_space.dtype).str),
        ArraySpec("reward", (num_envs,), "float32"),
        ArraySpec("terminated", (num_envs,), "bool"),
        ArraySpec("truncated", (num_envs,), "bool"),
        ArraySpec("episode_return", (num_envs,), "float64"),
        ArraySpec("episode_length", (num_envs,), "int64"),
        ArraySpec("new_game", (num_envs,), "bool"),  # where an episode ended: did the reset begin a new game?
        ArraySpec("env_errors", (num_workers,), "int64"),
        ArraySpec("message", (num_workers, MESSAGE_BYTES), "uint8"),
        # time.monotonic() (one clock for all processes) at which the worker last began an env call; 0 until it
        # begins making its envs (starting Python and importing can take long on a busy machine: no timeout).
        ArraySpec("heartbeat", (num_workers,), "float64"),
    ]


class WorkerSpec(NamedTuple):
    index: int
    env_cfg: Any
    """The ``EnvCfg`` of the vector env."""
    seed: int
    """Seed of the vector env; global env i is made with ``seed + i`` and its episode k starts with
    ``reset(seed=episode_seed(seed, i, k))``."""
    gamma: float | None
    """The run's discount, for ``EnvCfg.normalize_reward`` (``make_env``); None leaves rewards as they are."""
    first_env: int
    """Row of this worker's first env in the shared arrays (its index among the vector env's envs)."""
    num_envs: int
    episodes: tuple
    """Per env, the index of the episode its first ``reset`` starts."""
    replay: tuple
    """Per env, ``history.Replay`` fields to rebuild it at its first ``reset`` (a resumed run), or empty."""
    array_specs: tuple[ArraySpec, ...]
    """``ArraySpec``s of the shared block (its layout)."""
    shm_fd: int
    command_fd: int
    reply_fd: int
    env_offset: int = 0
    """Global index of the shared arrays' row 0 (a data-parallel rank's first env): env ``env_offset + row``
    is seeded as above."""


class ObsShapeMismatch(Exception):
    pass


class EnvRaised(Exception):
    """An env's own call raised; the message names the env and the call and ends with the exception's last line
    (its type and message), and the exception is the cause."""


def write_message(row: np.ndarray, line: str, details: str = "") -> None:
    """Put ``line`` (the one-line error) and, after a newline, ``details`` (a traceback; its end if the row
    cannot hold it all) into a worker's message row, as zero-terminated UTF-8."""
    head = line.replace("\n", " ").encode("utf-8", "replace")[:MESSAGE_BYTES - 1]
    tail = ("\n" + details).encode("utf-8", "replace") if details else b""
    room = MESSAGE_BYTES - 1 - len(head)
    data = head + (tail[-room:] if room > 0 else b"")
    row[:] = 0
    row[:len(data)] = np.frombuffer(data, np.uint8)


def write_error(row: np.ndarray, error: BaseException) -> None:
    """``write_message`` of the exception being handled: ``EnvRaised``'s own line (it names the env), else the
    exception's last line; its traceback."""
    write_message(row, str(error) if isinstance(error, EnvRaised) else error_line(error), traceback.format_exc())


def read_message(row: np.ndarray) -> tuple[str, str]:
    """A message row's (one-line error, details) as ``write_message`` put them."""
    text = row.tobytes().split(b"\0", 1)[0].decode("utf-8", "replace")
    line, _, details = text.partition("\n")
    return line, details


class EnvWorker:
    """Steps ``spec.num_envs`` envs whose data lives in rows ``[first_env, first_env + num_envs)``."""

    def __init__(self, spec: WorkerSpec, shared: SharedArrays) -> None:
        self.spec = spec
        self.episode_key = EPISODE_KEY
        self.next_episode = list(spec.episodes)
        self.pending_replay: list = list(spec.replay) or [None] * spec.num_envs
        rows = slice(spec.first_env, spec.first_env + spec.num_envs)
        self.first = spec.env_offset + spec.first_env  # global index of env 0 here (seeds)
        self.obs = shared["obs"][rows]
        self.final_obs = shared["final_obs"][rows]
        self.actions = shared["actions"][rows]
        self.reward = shared["reward"][rows]
        self.terminated = shared["terminated"][rows]
        self.truncated = shared["truncated"][rows]
        self.episode_return = shared["episode_return"][rows]
        self.episode_length = shared["episode_length"][rows]
        self.new_game = shared["new_game"][rows]
        self.env_errors = shared["env_errors"][spec.index:spec.index + 1]
        self.message = shared["message"][spec.index]
        self.heartbeat = shared["heartbeat"][spec.index:spec.index + 1]
        self.obs_shape = self.obs.shape[1:]
        # Discrete actions go to envs as Python ints; others as arrays.
        self.int_actions = self.actions.ndim == 1 and self.actions.dtype.kind in "iu"
        self.envs = []
        for i in range(spec.num_envs):
            self.beat()
            self.envs.append(make_env(spec.env_cfg, spec.seed + self.first + i, spec.gamma))

    def beat(self) -> None:
        """Say that an env call begins now (see ``env_worker_layout``)."""
        self.heartbeat[0] = time.monotonic()

    def put(self, rows: np.ndarray, i: int, obs: Any) -> None:
        if np.shape(obs) != self.obs_shape:
            raise ObsShapeMismatch(
                f"env {self.first + i} ({self.spec.env_cfg.id}) returned an observation of shape "
                f"{np.shape(obs)}, expected {self.obs_shape} as at the start of the run"
            )
        rows[i] = obs

    def start_episode(self, i: int) -> tuple[Any, dict]:
        """Reset env i with its next episode's seed (an Atari lost life continues the game instead)."""
        seed = episode_seed(self.spec.seed, self.first + i, self.next_episode[i])
        self.next_episode[i] += 1
        self.beat()
        return self.envs[i].reset(seed=seed)

    def rebuild(self, i: int, game_episode: int, actions: list, boundaries: list) -> Any:
        """Bring env i to the state a run recorded (``history.Replay``); returns its observation."""
        target, self.next_episode[i] = self.next_episode[i], game_episode
        obs, _ = self.start_episode(i)
        for step, (action, boundary) in enumerate(zip(actions, boundaries)):
            self.beat()
            obs, _, terminated, truncated, _ = self.envs[i].step(
                action if self.int_actions else np.asarray(action, self.actions.dtype))
            if bool(terminated or truncated) != boundary:
                raise RuntimeError(f"replaying env {self.first + i} ({self.spec.env_cfg.id}): its episode "
                                   f"{'ended' if boundary else 'went on'} at step {step} of the recorded run but not "
                                   "now; the env is not deterministic given its seed, so it cannot be resumed exactly")
            if boundary:
                obs, _ = self.start_episode(i)
        if self.next_episode[i] != target:
            raise RuntimeError(f"replaying env {self.first + i}: reached episode {self.next_episode[i]}, "
                               f"expected {target}: the checkpoint's env history is inconsistent")
        return obs

    def reset(self) -> bytes:
        for i, replay in enumerate(self.pending_replay):
            try:
                obs = self.rebuild(i, *replay) if replay else self.start_episode(i)[0]
            except Exception as error:
                raise EnvRaised(f"env {self.first + i} ({self.spec.env_cfg.id}) raised on reset: "
                                f"{error_line(error)}") from error
            self.put(self.obs, i, obs)
        self.pending_replay = [None] * len(self.envs)
        self.new_game[:] = True
        self.reward[:] = 0.0
        self.terminated[:] = False
        self.truncated[:] = False
        self.episode_return[:] = np.nan
        self.episode_length[:] = 0
        return REPLY_OK

    def step(self) -> bytes:
        status = REPLY_OK
        actions = self.actions.tolist() if self.int_actions else list(self.actions.copy())
        # Locals: this loop is the worker's hot path.
        key, put, obs_rows, final_rows = self.episode_key, self.put, self.obs, self.final_obs
        rewards, terminals, truncations = self.reward, self.terminated, self.truncated
        returns, lengths, new_games = self.episode_return, self.episode_length, self.new_game
        heartbeat, clock = self.heartbeat, time.monotonic
        for i, env in enumerate(self.envs):
            heartbeat[0] = clock()
            try:
                obs, reward, terminated, truncated, info = env.step(actions[i])
            except Exception as exc:  # an env bug must not stop the run: reset it and let the master count it
                self.replace_after_error(i, exc)
                status = REPLY_ENV_ERROR
                continue
            rewards[i] = reward
            terminals[i] = terminated
            truncations[i] = truncated
            episode = info.get(key)
            if terminated or truncated:
                put(final_rows, i, obs)
                obs, reset_info = self.start_episode(i)
                new_games[i] = not reset_info.get(LIFE_CONTINUED_KEY, False)
                if episode is None:
                    episode = reset_info.get(key)
            put(obs_rows, i, obs)
            if episode is None:
                returns[i] = np.nan
                lengths[i] = 0
            else:
                returns[i] = episode["r"]
                lengths[i] = episode["l"]
        return status

    def replace_after_error(self, i: int, error: Exception) -> None:
        """Count the error, then cut the episode as truncated at its last good observation and reset."""
        where = f"env {self.first + i} ({self.spec.env_cfg.id}) raised on step"
        print(f"conveyor env worker {self.spec.index}: {where}:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        write_message(self.message, f"{where}: {error_line(error)}", traceback.format_exc())
        self.env_errors[0] += 1
        self.final_obs[i] = self.obs[i]
        try:
            obs, info = self.start_episode(i)
            if info.get(LIFE_CONTINUED_KEY, False):  # the failed step left the game in an unknown state: a new one
                self.next_episode[i] -= 1
                obs, _ = self.start_episode(i)
        except Exception as reset_error:
            raise EnvRaised(f"env {self.first + i} ({self.spec.env_cfg.id}) raised on reset after an error on step: "
                            f"{error_line(reset_error)}") from reset_error
        self.new_game[i] = True
        self.put(self.obs, i, obs)
        self.reward[i] = 0.0
        self.terminated[i] = False
        self.truncated[i] = True
        self.episode_return[i] = np.nan
        self.episode_length[i] = 0

    def serve(self) -> None:
        commands = {CMD_STEP: self.step, CMD_RESET: self.reset}
        read, write = os.read, os.write
        command_fd, reply_fd = self.spec.command_fd, self.spec.reply_fd
        while True:
            command = read(command_fd, 1)
            if command not in commands:  # CMD_CLOSE, or b"" when the master is gone
                return
            try:
                reply = commands[command]()
            except ObsShapeMismatch as exc:
                write_message(self.message, str(exc))
                reply = REPLY_OBS_SHAPE
            except Exception as exc:
                write_error(self.message, exc)
                reply = REPLY_FATAL
            write(reply_fd, reply)

    def close(self) -> None:
        for env in self.envs:
            env.close()


def main() -> None:
    spec: WorkerSpec = child_prologue(WorkerSpec)
    shared = SharedArrays(spec.array_specs, spec.shm_fd)
    try:
        worker = EnvWorker(spec, shared)
    except Exception as error:
        write_message(shared["message"][spec.index], f"building its envs ({spec.env_cfg.id}) failed: "
                      f"{error_line(error)}", traceback.format_exc())
        os.write(spec.reply_fd, REPLY_FATAL)
        return
    try:
        os.write(spec.reply_fd, REPLY_OK)
        worker.serve()
    except BrokenPipeError:
        pass  # the master is gone (it died, or gave up on this worker): nothing left to do
    finally:
        worker.close()
        shared.close()
