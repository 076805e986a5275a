"""CleanRL's PPO in a race run: a standalone script for CleanRL's own virtual environment.

``external.run_external`` starts it as ``.peers/cleanrl/bin/python -I
cleanrl_runner.py ARGS`` (isolated: conveyor is not installed there): numpy,
gym 0.23.1, gymnasium 0.28.1, torch and cleanrl 1.2.0. It runs one of
CleanRL's published single-file scripts as is (``--script``: ``ppo``, its
discrete-action PPO, whose defaults are its CartPole-v1 settings, or
``ppo_continuous_action``, whose defaults are its MuJoCo settings), with
``runpy`` as ``__main__`` and only ``--env-id`` and ``--seed`` on its command
line, so its own defaults, budget and learning-rate annealing hold.

The race watches the script through the one wrapper every env of CleanRL's
passes through, ``RecordEpisodeStatistics`` (gym's in ``ppo``, gymnasium's in
``ppo_continuous_action``, applied before any reward normalization): the
runner puts a subclass in its place that counts env steps (all envs together:
the script's ``global_step``) and sends each finished episode's raw return
into ``returns.csv`` (env steps, wall time on the run's clock, started after
the imports, return). It reads every episode, where the script's own printout
shows one per vector step. When the mean of the last ``--window`` reaches
``--threshold``, or a cap is reached, the wrapper raises ``RaceStop`` out of
the script's loop. ``cleanrl_result.json`` says when the run's clock started
(unix time), why the run stopped and how far it got.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SCRIPT_START_UNIX = time.time()
"""When this script started: ``--time-limit-s`` is what was left of the race's time cap then."""
SCRIPTS = {"ppo": "gym", "ppo_continuous_action": "gymnasium"}
"""CleanRL's scripts the race runs, and the env package each makes its envs with."""


class RaceStop(BaseException):
    """Raised out of the script's env step when the race has its answer (BaseException: no handler of the
    script's can take it for its own)."""


class RaceWatch:
    """The race's view of a run: every finished episode, the env steps so far, and when to stop."""

    def __init__(self, threshold: float, window: int, max_steps: int, time_limit_s: float, started_unix: float,
                 run_start_unix: float) -> None:
        self.threshold, self.max_steps = threshold, max_steps
        self.deadline_unix = started_unix + time_limit_s
        self.run_start_unix = run_start_unix
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.rows: list[tuple[int, float, float]] = []
        self.steps = 0
        self.stop_reason = "total_steps reached"

    def step(self) -> None:
        """One env step of one env; stops the run at a cap."""
        self.steps += 1
        if self.steps >= self.max_steps:
            self._stop("race step cap reached")
        if time.time() >= self.deadline_unix:
            self._stop("time_limit_s reached")

    def episode(self, value: float) -> None:
        """A finished episode's return; stops the run when the window's mean reaches the threshold."""
        self.recent.append(value)
        self.rows.append((self.steps, time.time() - self.run_start_unix, value))
        if len(self.recent) == self.recent.maxlen and sum(self.recent) / len(self.recent) >= self.threshold:
            self._stop("target_return reached")

    def _stop(self, reason: str) -> None:
        self.stop_reason = reason
        raise RaceStop(reason)


def watched_statistics(base: type, watch: RaceWatch) -> type:
    """``base`` (a ``RecordEpisodeStatistics``) that reports each step and each finished episode to ``watch``."""

    class RaceEpisodeStatistics(base):  # type: ignore[misc, valid-type]
        def step(self, action: Any) -> Any:
            result = super().step(action)
            info = result[-1]
            if "episode" in info:
                value = info["episode"]["r"]
                watch.episode(float(value[0] if hasattr(value, "__len__") else value))
            watch.step()
            return result

    return RaceEpisodeStatistics


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True)
    parser.add_argument("--script", choices=sorted(SCRIPTS), required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--threshold", type=float, required=True)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--time-limit-s", type=float, required=True, help="seconds left for this run")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import importlib
    import importlib.metadata

    import numpy as np
    import torch
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (the script's imports, before the clock)

    env_package = importlib.import_module(SCRIPTS[args.script])
    # The run's clock (returns.csv's wall times), after the imports as conveyor's and SB3's runs start theirs.
    run_start_unix = time.time()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)  # the script writes its TensorBoard files to runs/ under the working directory
    watch = RaceWatch(args.threshold, args.window, args.max_steps, args.time_limit_s, SCRIPT_START_UNIX,
                      run_start_unix)
    env_package.wrappers.RecordEpisodeStatistics = watched_statistics(
        env_package.wrappers.RecordEpisodeStatistics, watch)
    sys.argv = [f"{args.script}.py", f"--env-id={args.env}", f"--seed={args.seed}"]
    status = 0
    try:
        runpy.run_module(f"cleanrl.{args.script}", run_name="__main__", alter_sys=True)
    except RaceStop:
        pass
    except Exception as error:  # the script failed: recorded, and the race says so
        traceback.print_exc()
        watch.stop_reason, status = f"error: {type(error).__name__}", 1
    wall = time.time() - run_start_unix
    with open(out / "returns.csv", "w") as f:
        f.write("env_steps,wall_time_s,return\n")
        f.writelines(f"{steps},{t:.3f},{value:.3f}\n" for steps, t, value in watch.rows)
    result = {"run_start_unix": run_start_unix, "status": status, "stop_reason": watch.stop_reason,
              "env_steps": watch.steps, "wall_time_s": wall, "episodes": len(watch.rows),
              "return_mean_last100": float(np.mean(watch.recent)) if watch.recent else None,
              "framework_version": importlib.metadata.version("cleanrl"),
              "device": "cuda" if torch.cuda.is_available() else "cpu"}
    (out / "cleanrl_result.json").write_text(json.dumps(result, indent=2))
    sys.stdout.flush()
    # A stopped script leaves its SummaryWriter and envs open; their threads must not hold the exit.
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
