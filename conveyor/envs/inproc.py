"""The ``inproc`` backend: every env stepped one after another in the calling process.

A cheap env (CartPole steps in a few microseconds) costs less than the round
trip to a worker process: two pipe writes, two wake-ups and the scheduler
between them, each step. ``InProcessVectorEnv`` runs the same ``EnvWorker``
the shm workers run (``conveyor.envs.shm_worker``), on ordinary arrays of the
same layout, so a run steps the same envs with the same seeds, episode
boundaries, reward normalization and env history as on ``shm``, and its
seeded parameters are the same bit for bit; a resumed run rebuilds its envs
the same way, so a run may resume on either backend.

What it gives up, and why ``auto`` (``choose_backend``) picks it only for envs
that step in microseconds: the envs do not run in parallel with each other
or with the learner, an env that hangs hangs the run (no
``--env-step-timeout-s``), and an env that crashes the interpreter takes the
run with it (no worker restart). An env that raises is reset and counted, as
on ``shm``, up to ``max_env_errors``.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
import traceback
from typing import Any, Callable, Iterator, NamedTuple

import gymnasium as gym
import numpy as np

from conveyor.config import EnvCfg
from conveyor.envs.history import EnvHistory
from conveyor.envs.make import env_spaces, make_env
from conveyor.envs.native_vector import measure_native_step_us, native_entry_point, native_vector_refusal
from conveyor.envs.shm_worker import (
    REPLY_ENV_ERROR,
    EnvRaised,
    EnvWorker,
    ObsShapeMismatch,
    WorkerSpec,
    env_worker_layout,
    read_message,
)
from conveyor.envs.vector_api import InProcessBackend, ObsShapeError, StepResult
from conveyor.errors import WorkerFailure, error_line


class InProcessVectorEnv(InProcessBackend):
    """``cfg.num_envs`` envs stepped in this process (see the module docstring); the ``VectorEnv`` protocol."""

    def __init__(self, cfg: EnvCfg, seed: int, spaces: tuple[gym.Space, gym.Space], *, gamma: float | None = None,
                 copy: bool = True, env_state: dict[str, Any] | None = None, env_offset: int = 0) -> None:
        """``spaces``: the env's (observation, action) spaces, checked by the caller (``make_vector_env``)."""
        super().__init__()
        self.cfg = cfg
        self.num_envs = cfg.num_envs
        self.copy = copy
        self.restarts = 0  # nothing to restart: the envs live and die with this process
        self.single_observation_space, self.single_action_space = spaces
        layout = env_worker_layout(cfg.num_envs, 1, *spaces)
        self._arrays = {spec.name: np.zeros(spec.shape, spec.dtype) for spec in layout}
        self.history = EnvHistory.from_state(env_state) if env_state else EnvHistory(cfg.num_envs)
        self._replaying = env_state is not None
        replay = tuple(tuple(plan) for plan in self.history.replay_plan()) if self._replaying else ()
        spec = WorkerSpec(0, cfg, seed, gamma, 0, cfg.num_envs, tuple(self.history.next_episode.tolist()), replay,
                          (), -1, -1, -1, env_offset)
        self._worker = EnvWorker(spec, self._arrays)  # type: ignore[arg-type]
        self._restarted = np.zeros(cfg.num_envs, bool)  # never set: no worker dies here
        arrays = self._arrays
        self._views = StepResult(arrays["obs"], arrays["reward"], arrays["terminated"], arrays["truncated"],
                                 arrays["final_obs"], arrays["episode_return"], arrays["episode_length"],
                                 self._restarted)
        self._actions = arrays["actions"]
        self._actions_shape = self._actions.shape

    @property
    def env_errors(self) -> int:
        """Env exceptions so far (each one reset its env and truncated its episode)."""
        return int(self._arrays["env_errors"].sum())

    def reset(self) -> np.ndarray:
        """Reset every env (a resumed run's: replay each to where that run stopped); the first observations."""
        self._check_open()
        self._call(self._worker.reset, "resetting")
        if self._replaying:  # the envs rebuilt the recorded games: the history already holds them
            self._replaying = False
        else:
            self.history.start_games(slice(None))
        return self._views.obs.copy() if self.copy else self._views.obs

    def _take(self, actions: Any) -> None:
        self._actions[...] = actions

    def _step(self) -> StepResult:
        reply = self._call(self._worker.step, "stepping")
        views = self._views
        self.history.record(self._actions, views.terminated | views.truncated, self._arrays["new_game"])
        if reply == REPLY_ENV_ERROR and self.env_errors > self.cfg.max_env_errors:
            message, details = read_message(self._arrays["message"][0])
            raise WorkerFailure(f"{self.env_errors} env errors exceed max_env_errors={self.cfg.max_env_errors}; "
                                f"last one: {message}", details)
        if self.copy:
            return StepResult(*(array.copy() for array in views))
        return views

    def _release(self) -> None:
        self._worker.close()

    def _call(self, command: Callable[[], bytes], action: str) -> bytes:
        """Run the worker's ``command``; its failures as the shm backend reports its workers' (one line)."""
        try:
            return command()
        except ObsShapeMismatch as error:
            raise ObsShapeError(str(error)) from None
        except Exception as error:
            said = str(error) if isinstance(error, EnvRaised) else f"env {self.cfg.id!r}: {error_line(error)}"
            raise WorkerFailure(f"{said}, while {action} (in process)",
                                "".join(traceback.format_exception(error))) from error


MEASURE_LIMIT_S = 3.0
"""``choose_backend`` gives up timing an env after this long (a step that hangs, a very slow env): ``shm``."""


class _MeasureTimeout(Exception):
    """Raised inside the env's step by the alarm that bounds ``measure_step_us``."""


@contextlib.contextmanager
def _alarm_after(seconds: float) -> Iterator[None]:
    """Raise ``_MeasureTimeout`` in this thread after ``seconds`` (SIGALRM: the main thread only; elsewhere, and
    where signals do not exist, no bound). A timer set before (pytest-timeout's, a caller's ``alarm``) is set
    again afterwards with the time it had left, at once if that ran out meanwhile."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _MeasureTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    earlier, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if earlier > 0:
            signal.setitimer(signal.ITIMER_REAL, max(earlier - (time.monotonic() - start), 1e-3))


def measure_step_us(cfg: EnvCfg, seed: int, *, rounds: int = 5, steps: int = 40, max_s: float = 0.5) -> float:
    """The wall-clock of one ``step`` of one env of ``cfg`` (resets included), in microseconds: the fastest of
    ``rounds`` rounds of ``steps`` steps on actions drawn beforehand, after one round of warm-up (an env's first
    steps run its checks), so that a busy machine's preemptions inflate it less; fewer rounds when they take
    longer than ``max_s`` (a slow env). ``inf`` when the steps take over ``MEASURE_LIMIT_S`` in all (a step that
    hangs), in the main thread, where an alarm can cut them short."""
    env = make_env(cfg, seed)
    try:
        env.action_space.seed(seed)
        # as the env loop hands them over: Discrete actions as Python ints (EnvWorker.int_actions)
        actions = [action.item() if np.ndim(action) == 0 else action
                   for action in (env.action_space.sample() for _ in range(steps))]
        best, began = math.inf, time.perf_counter()
        with _alarm_after(MEASURE_LIMIT_S):
            for round_ in range(rounds + 1):
                start = time.perf_counter()
                for action in actions:
                    _, _, terminated, truncated, _ = env.step(action)
                    if terminated or truncated:
                        env.reset()
                if round_:  # round 0 warms up
                    best = min(best, (time.perf_counter() - start) / steps * 1e6)
                if time.perf_counter() - began > max_s and round_:
                    break
        return best
    except _MeasureTimeout:
        return math.inf
    except Exception as error:  # the env's own (a reset that raises, say): one line naming it
        raise WorkerFailure(f"env {cfg.id!r} raised while --env-backend auto timed its steps: {error_line(error)}",
                            "".join(traceback.format_exception(error))) from None
    finally:
        env.close()


INPROC_MAX_STEP_US = 30.0
"""``auto`` steps an env in process when one of its steps takes at most this long. Measured on the 2-core CPU
with paac/a2c and its presets (``benchmarks/env_backends.py``, BENCHMARKS.md "Fastest to a trained agent";
in-process SPS over shm's): MinAtar Breakout (10 us a step, 16 envs) 1.11x, MountainCar (15 us, 64 envs) 1.05x,
CartPole (23 us, 64 envs) 1.16x, and with 16 envs 1.24x; Pendulum (39 us, 8 envs) 0.82x, SpaceInvaders (66 us,
16 envs) 0.83x, Acrobot (95 us, 64 envs) 0.77x. Above it the worker processes' parallel stepping saves more than
their round trips cost; the envs' count moved no row across the line."""


class BackendChoice(NamedTuple):
    """What ``auto`` picked for an env and why (printed at a run's start and kept in its config.json)."""

    backend: str
    step_us: float
    """The measured mean step time of one env, microseconds."""
    reason: str


def choose_backend(cfg: EnvCfg, seed: int, *, native: bool = True) -> BackendChoice:
    """``vector`` where the env has a native vector env that can run ``cfg`` (``native_vector_refusal``) and
    ``native`` (false: a resumed run's envs are an action history, which only ``inproc`` and ``shm`` replay);
    else ``inproc`` where one env steps in at most ``INPROC_MAX_STEP_US`` (``measure_step_us``), or where the envs
    would have a single worker process (nothing to step in parallel); else ``shm``. An env that breaks the
    gymnasium API is refused first, in one line (``env_spaces``), as at any run's start."""
    env_spaces(cfg, seed)
    if native and not native_vector_refusal(cfg):
        step_us = measure_native_step_us(cfg, seed)
        name = native_entry_point(cfg).rpartition(":")[2]
        return BackendChoice("vector", step_us, f"gymnasium's native vector env {name} steps all {cfg.num_envs} "
                                                f"envs at once, {step_us:.2f} us per env: in this process")
    step_us = measure_step_us(cfg, seed)
    if math.isinf(step_us):  # recorded as the bound: config.json stays plain JSON
        return BackendChoice("shm", MEASURE_LIMIT_S * 1e6, f"timing one env took over {MEASURE_LIMIT_S:g} s (a step "
                                                          "that hangs, or a very slow env): its steps go to worker "
                                                          "processes")
    workers = cfg.num_workers or 1
    if workers == 1:
        return BackendChoice("inproc", step_us, f"one env steps in {step_us:.1f} us, and one worker process would "
                                                "step them no sooner")
    if step_us <= INPROC_MAX_STEP_US:
        return BackendChoice("inproc", step_us, f"one env steps in {step_us:.1f} us, at most "
                                                f"{INPROC_MAX_STEP_US:g} us: in this process")
    return BackendChoice("shm", step_us, f"one env steps in {step_us:.1f} us, over {INPROC_MAX_STEP_US:g} us: in "
                                         f"{workers} worker processes")
