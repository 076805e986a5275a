"""Dynamic adjustment of GA3C's counts (Babaeizadeh et al. 2017, sec. 4.3).

Every interval the run measures TPS (trainings per second) under the current
numbers of agents N_A, predictors N_P and trainers N_T and hands it to
``Autotuner.step``, which answers with the counts to run next:

- a measurement of the accepted setting becomes the baseline, and one knob
  (N_A, N_P or N_T, at random) moves by +-1 (at random, within bounds);
- a measurement of such a trial keeps it when TPS rose above the baseline
  (it becomes the new baseline and the next trial starts at once), and
  reverts it otherwise.

After a revert the restored setting is measured again before the next trial,
rather than compared with a number taken minutes earlier: TPS drifts as
episodes and the queue change, and a stale baseline would lock in or reject
moves on noise from another time. The controller is pure: TPS comes in, counts
go out, so tests drive it with an injected TPS signal. ``plot_history`` draws
the chosen counts and TPS over time.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from conveyor.files import atomic_write

KNOBS = ("agents", "predictors", "trainers")


@dataclass(frozen=True)
class Counts:
    agents: int
    predictors: int
    trainers: int

    def moved(self, knob: str, delta: int) -> "Counts":
        return dataclasses.replace(self, **{knob: getattr(self, knob) + delta})

    def within(self, low: "Counts", high: "Counts") -> bool:
        return all(getattr(low, k) <= getattr(self, k) <= getattr(high, k) for k in KNOBS)


@dataclass(frozen=True)
class Decision:
    measured: Counts
    """The counts the TPS was measured under."""
    tps: float
    verdict: str
    """``baseline`` (the accepted setting measured), ``keep`` (trial beat the baseline) or ``revert``."""
    next: Counts
    """The counts to run from now on."""

    def row(self, time_s: float) -> dict[str, Any]:
        return {"time_s": time_s, "tps": self.tps, "verdict": self.verdict,
                **{k: getattr(self.measured, k) for k in KNOBS},
                **{f"next_{k}": getattr(self.next, k) for k in KNOBS}}


class Autotuner:
    """The +-1 keep-or-revert controller; see the module docstring."""

    def __init__(self, start: Counts, low: Counts, high: Counts, rng: random.Random):
        if not start.within(low, high):
            raise ValueError(f"start counts {start} lie outside [{low}, {high}]")
        self.low, self.high, self.rng = low, high, rng
        self.accepted = start
        self.trial: Counts | None = None
        self.baseline = float("nan")

    def _propose(self) -> Counts:
        moves = [self.accepted.moved(k, d) for k in KNOBS for d in (-1, 1)]
        moves = [m for m in moves if m.within(self.low, self.high)]
        self.trial = self.rng.choice(moves) if moves else None
        return self.trial or self.accepted

    def step(self, tps: float) -> Decision:
        """TPS measured under the counts last returned; returns what to run next."""
        if self.trial is None:
            measured, verdict = self.accepted, "baseline"
            self.baseline = tps
        elif tps > self.baseline:
            measured, verdict = self.trial, "keep"
            self.accepted, self.baseline = self.trial, tps
        else:
            measured, verdict = self.trial, "revert"
            self.trial = None
            return Decision(measured, tps, verdict, self.accepted)
        return Decision(measured, tps, verdict, self._propose())


def plot_history(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """PNG of TPS and the counts (N_A, N_P, N_T) over time from ``Decision.row`` dicts."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Figure + Agg canvas directly: no pyplot, so the caller's matplotlib backend is left alone.
    fig = Figure(figsize=(8, 5), tight_layout=True)
    FigureCanvasAgg(fig)
    ax_tps, ax_counts = fig.subplots(2, 1, sharex=True)
    times = [r["time_s"] for r in rows]
    ax_tps.plot(times, [r["tps"] for r in rows], marker="o")
    ax_tps.set_ylabel("TPS (trainings/s)")
    for knob, label in zip(KNOBS, ("N_A agents", "N_P predictors", "N_T trainers")):
        ax_counts.step(times, [r[knob] for r in rows], where="pre", label=label)
    ax_counts.set_ylabel("count")
    ax_counts.set_xlabel("wall time (s)")
    ax_counts.legend()
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=100)
