"""Fault-injection harness shared by the architectures' tests.

- ``TAGGED_ID``: an env whose every observation names the transition it starts: the episode's reset seed
  (conveyor seeds every episode, ``conveyor.envs.episode_seed``) and the step ``t`` within the episode, in
  small exact floats so any model can eat them. Worker processes import this module by name (gymnasium's
  ``module:id`` form).
- ``HANGING_ID``: the tagged env, except that it hangs in ``step`` once it has taken a given number of steps
  (one env, every env, or the first few of a run; for ``EnvCfg.env_step_timeout_s``).
- ``BatchRecorder``: records the tags of every transition the learner computes gradients on.
- ``check_transitions``: asserts no transition was trained on twice and none is missing inside an episode.
- ``kill_child``: SIGKILLs a child process of this one (an env worker, executor, agent or actor) mid-run.
- ``train_killing_one``: a run in this process whose ``match`` child is killed after some updates; checks that
  it was killed, restarted once, and that the run still reached its step count.
- ``RAISING_ID``: the tagged env, except that its ``reset`` or ``step`` raises from a given call on.
- ``LEAKY_ID``: the tagged env, except that making it starts a thread that is not a daemon and a process that
  ignores SIGTERM, both sleeping for an hour (an env that would keep a run from ending).
- ``NAN_ID``: CartPole whose observations turn NaN after ``nan_after`` steps (``--env-arg nan_after=N``): an env
  that breaks mid-run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

import gymnasium as gym
import numpy as np

TAGGED_ID = "tests.fault_env:Tagged-v0"
TAGGED_FAMILY = "classic-discrete"
"""The preset family of the tagged env and of those built on it (Discrete actions), which a ``RunCfg`` of an env
of one's own is given (``EnvCfg.family``)."""
_SCALE = 65536.0


class TaggedEnv(gym.Env):
    """Observation ``[seed_hi, seed_lo, t] / 65536`` (float32, exact); episodes last ``4 + seed % 5`` steps.

    The reward is 1 for action 0, else 0: learnable, and every observation is a tag, not a state to model.
    """

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0.0, 1.0, (3,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.identity, self.t = 0, 0

    def _obs(self) -> np.ndarray:
        return np.array([self.identity >> 16, self.identity & 0xFFFF, self.t], np.float32) / _SCALE

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        if seed is not None:
            self.identity = seed
        else:  # an unseeded reset still starts a new, distinct episode
            self.identity = int(self.np_random.integers(2**32))
        self.t = 0
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        return self._obs(), float(action == 0), self.t == 4 + self.identity % 5, False, {}


gym.register("Tagged-v0", entry_point=TaggedEnv)

NAN_ID = "tests.fault_env:NanAfter-v0"


class NanAfterEnv(gym.Wrapper):
    """CartPole-v1 whose observations are NaN from its ``nan_after + 1``-th step on (counted over its episodes)."""

    def __init__(self, nan_after: int = 100) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.nan_after, self.steps = nan_after, 0

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        if self.steps > self.nan_after:
            obs = np.full_like(obs, np.nan)
        return obs, reward, terminated, truncated, info


gym.register("NanAfter-v0", entry_point=NanAfterEnv)

HANGING_ID = "tests.fault_env:Hanging-v0"


class HangingEnv(TaggedEnv):
    """A ``TaggedEnv`` whose ``hang_at``-th step (counted from its construction) sleeps ``hang_s`` seconds
    before it returns. ``hang_home``: only the env made with this seed hangs (``make_env`` gives vector env i
    ``seed + i``; -1: every env). With ``marker``, only the first ``hangs`` envs of the run to get there hang,
    each creating one of the files ``marker.0``, ``marker.1``, ...; the others (a restarted worker's) go on."""

    def __init__(self, hang_at: int = 1, hang_s: float = 3600.0, hang_home: int = -1, marker: str = "",
                 hangs: int = 1) -> None:
        super().__init__()
        self.hang_at, self.hang_s, self.hang_home = hang_at, hang_s, hang_home
        self.marker, self.hangs = marker, hangs
        self.home: int | None = None
        self.steps = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        if self.home is None:
            self.home = seed
        return super().reset(seed=seed, options=options)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.steps += 1
        if self.steps == self.hang_at and self.hang_home in (-1, self.home) and self._may_hang():
            time.sleep(self.hang_s)
        return super().step(action)

    def _may_hang(self) -> bool:
        if not self.marker:
            return True
        for k in range(self.hangs):
            try:
                os.close(os.open(f"{self.marker}.{k}", os.O_CREAT | os.O_EXCL))
                return True
            except FileExistsError:
                continue
        return False


gym.register("Hanging-v0", entry_point=HangingEnv)

RAISING_ID = "tests.fault_env:Raising-v0"


class RaisingEnv(TaggedEnv):
    """A ``TaggedEnv`` whose ``raise_in`` method (``reset`` or ``step``) raises ``ValueError`` from its ``after``-th
    call on (counted from its construction; ``make_env``'s seeding reset is call 1)."""

    def __init__(self, raise_in: str = "reset", after: int = 2) -> None:
        super().__init__()
        self.raise_in, self.after = raise_in, after
        self.calls = {"reset": 0, "step": 0}

    def _count(self, method: str) -> None:
        self.calls[method] += 1
        if method == self.raise_in and self.calls[method] >= self.after:
            raise ValueError(f"injected fault in {method} call {self.calls[method]}")

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        self._count("reset")
        return super().reset(seed=seed, options=options)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._count("step")
        return super().step(action)


gym.register("Raising-v0", entry_point=RaisingEnv)

LEAKY_ID = "tests.fault_env:Leaky-v0"


class LeakyEnv(TaggedEnv):
    """A ``TaggedEnv`` whose construction starts a non-daemon thread and a process in a session of its own that
    ignores SIGTERM (its command line holds ``marker``, to find it), each sleeping ``sleep_s`` seconds."""

    def __init__(self, marker: str = "conveyor-leaky-env", sleep_s: float = 3600.0) -> None:
        super().__init__()
        threading.Thread(target=time.sleep, args=(sleep_s,), name="leaky-env-thread").start()
        code = f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep({sleep_s}) # {marker}"
        subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdin=subprocess.DEVNULL)


gym.register("Leaky-v0", entry_point=LeakyEnv)


def tags(obs: Any) -> np.ndarray:
    """``[N, 2]`` int64 (episode seed, t) of observations ``[..., 3]``."""
    raw = np.rint(np.asarray(obs, np.float64).reshape(-1, 3) * _SCALE).astype(np.int64)
    return np.stack([(raw[:, 0] << 16) | raw[:, 1], raw[:, 2]], 1)


class BatchRecorder:
    """While active, records the tags of ``batch["obs"][:T]`` of every ``Learner.compute_gradients`` call
    (the transitions; ``obs[T]`` is only the bootstrap), less those ``batch["valid"]`` masks out."""

    def __init__(self, monkeypatch: Any) -> None:
        # Imported here: env worker processes import this module for the env and never need torch.
        from conveyor.learner import Learner

        self.batches: list[np.ndarray] = []
        self._lock = threading.Lock()
        original = Learner.compute_gradients

        def recording(learner: Learner, batch: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            steps = batch["rewards"].shape[0]
            observed = tags(batch["obs"][:steps].detach().cpu().numpy())
            if "valid" in batch:  # steps masked out of the loss are not trained on
                observed = observed[batch["valid"].cpu().numpy().reshape(-1)]
            with self._lock:
                self.batches.append(observed)
            return original(learner, batch, *args, **kwargs)

        monkeypatch.setattr(Learner, "compute_gradients", recording)

    @property
    def transitions(self) -> np.ndarray:
        with self._lock:
            return np.concatenate(self.batches) if self.batches else np.empty((0, 2), np.int64)


def check_transitions(transitions: np.ndarray) -> dict[str, int]:
    """Assert each (episode, t) was trained on at most once and every episode's steps form a prefix
    ``0..m`` (a gap is a lost transition; only an episode's tail may be missing: still running at the end, or
    cut by a worker's death). Returns counts: transitions, episodes, complete episodes."""
    unique, counts = np.unique(transitions, axis=0, return_counts=True)
    duplicated = unique[counts > 1]
    assert not len(duplicated), f"{len(duplicated)} transitions trained on twice, e.g. {duplicated[:3].tolist()}"
    steps: dict[int, list[int]] = defaultdict(list)
    for identity, t in unique.tolist():
        steps[identity].append(t)
    gaps = {identity: ts for identity, ts in steps.items() if sorted(ts) != list(range(len(ts)))}
    assert not gaps, f"{len(gaps)} episodes lost transitions in the middle, e.g. {list(gaps.items())[:3]}"
    complete = sum(len(ts) == 4 + identity % 5 for identity, ts in steps.items())
    return {"transitions": len(unique), "episodes": len(steps), "complete_episodes": complete}


def children(pid: int | None = None) -> dict[int, str]:
    """Live child processes of ``pid`` (default: this process), with their command lines."""
    pid = os.getpid() if pid is None else pid
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid and stat[0] != "Z":
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError, ValueError):
                continue  # exited while we looked
    return found


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def gone_within(pids: Iterable[int], timeout_s: float) -> bool:
    """Wait until none of ``pids`` runs; False if one still did after ``timeout_s``."""
    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_child(match: str, when: Callable[[], bool], timeout_s: float = 120.0,
               sig: int = signal.SIGKILL) -> threading.Thread:
    """A started thread that waits until ``when()`` holds, then kills one child whose command line contains
    ``match``; ``thread.killed`` holds the pid (0 when none was found in ``timeout_s``)."""

    def wait_and_kill() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if when():
                matching = [pid for pid, cmd in children().items() if match in cmd]
                if matching:
                    os.kill(matching[0], sig)
                    thread.killed = matching[0]
                    return
            time.sleep(0.05)

    thread = threading.Thread(target=wait_and_kill, daemon=True)
    thread.killed = 0  # type: ignore[attr-defined]
    thread.start()
    return thread


def train_killing_one(monkeypatch: Any, cfg: Any, match: str, after_batches: int = 20) -> tuple[dict, BatchRecorder]:
    """``conveyor.train(cfg)`` while a ``match`` child is SIGKILLed once the learner computed ``after_batches``
    gradients; asserts the run restarted it once and still stopped at ``total_steps``. Returns the summary and
    the recorder of trained transitions."""
    import conveyor

    recorder = BatchRecorder(monkeypatch)
    killer = kill_child(match, lambda: len(recorder.batches) >= after_batches)
    summary = conveyor.train(cfg)
    assert killer.killed, f"no {match} process was killed"
    assert summary["stop_reason"] == "total_steps reached"
    assert summary["restarts"] == 1
    return summary, recorder
