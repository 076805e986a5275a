"""What the race's runners share: their arguments, the window of returns and the caps, and the files they write.

Standard library only: a runner imports it from its own folder, in a peer's venv where conveyor is not installed.
A runner feeds ``RaceWatch`` each finished episode's raw return and asks ``stop_reason`` whenever it can stop
its peer; at the end ``write`` leaves ``returns.csv`` (env steps, wall time on the run's clock, return) and the
result file that ``conveyor.bench.external.run_external`` turns into the run's summary and the race's clock.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path
from typing import Any

TARGET_REACHED, STEP_CAP, TIME_CAP = "target_return reached", "race step cap reached", "time_limit_s reached"
OWN_BUDGET = "total_steps reached"
"""Why a run stopped when the peer ended on its own budget (the same words as conveyor's own runs)."""


def race_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments every runner takes from ``run_external`` (a runner adds its own, such as its recipe)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--env", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--threshold", type=float, required=True)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--time-limit-s", type=float, required=True,
                        help="seconds of the race's time cap left when the runner started")
    parser.add_argument("--out", type=Path, required=True)
    return parser


class RaceWatch:
    """A race run as its runner sees it: every finished episode, and whether the race has its answer.

    ``started_unix`` is when the runner started (``time_limit_s`` was what was left of the cap then);
    ``run_start_unix`` starts the run's own clock, after the imports, as conveyor's and SB3's runs start theirs."""

    def __init__(self, threshold: float, window: int, max_steps: int, time_limit_s: float, started_unix: float,
                 run_start_unix: float) -> None:
        self.threshold, self.max_steps = threshold, max_steps
        self.deadline_unix = started_unix + time_limit_s
        self.run_start_unix = run_start_unix
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.rows: list[tuple[int, float, float]] = []
        self.ended = OWN_BUDGET

    @classmethod
    def from_args(cls, args: argparse.Namespace, started_unix: float, run_start_unix: float) -> RaceWatch:
        return cls(args.threshold, args.window, args.max_steps, args.time_limit_s, started_unix, run_start_unix)

    def left_s(self) -> float:
        return self.deadline_unix - time.time()

    def episode(self, value: float, steps: int) -> None:
        """An episode that ended at ``steps`` env steps with return ``value``."""
        self.recent.append(value)
        self.rows.append((steps, time.time() - self.run_start_unix, value))

    def reached(self) -> bool:
        """Whether the last full window's mean reached the threshold."""
        return len(self.recent) == self.recent.maxlen and sum(self.recent) / len(self.recent) >= self.threshold

    def stop_reason(self, steps: int) -> str:
        """Why the run should stop now at ``steps`` env steps ("" to go on); kept as the run's end if any."""
        reason = (TARGET_REACHED if self.reached() else STEP_CAP if steps >= self.max_steps
                  else TIME_CAP if self.left_s() <= 0 else "")
        if reason:
            self.ended = reason
        return reason

    def write(self, out: Path, result_name: str, env_steps: int, **extra: Any) -> None:
        """``returns.csv`` and the result file ``result_name`` in ``out`` (``extra``: the runner's own keys)."""
        with open(out / "returns.csv", "w") as f:
            f.write("env_steps,wall_time_s,return\n")
            f.writelines(f"{steps},{t:.3f},{value:.3f}\n" for steps, t, value in self.rows)
        result = {"run_start_unix": self.run_start_unix, "stop_reason": self.ended, "env_steps": env_steps,
                  "wall_time_s": time.time() - self.run_start_unix, "episodes": len(self.rows),
                  "return_mean_last100": sum(self.recent) / len(self.recent) if self.recent else None, **extra}
        (out / result_name).write_text(json.dumps(result, indent=2))
