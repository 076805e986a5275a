"""Plots of run directories: return vs env steps, return vs wall time, SPS, policy-lag histograms.

``plot_runs(run_dirs, out_dir)`` reads each run's ``summary.json`` and
``returns.csv`` and writes small PNGs (matplotlib, Agg backend):

- ``return_vs_steps_<env>.png`` and ``return_vs_time_<env>.png``: one line
  per run, the mean of the last 100 episodes (as ``return_mean_last100``);
  one figure per env, since returns of different envs do not share an axis;
- ``sps.png``: env steps per second of each run;
- ``lag.png``: each run's policy-lag histogram (fraction of actions by lag).

Directories without a ``summary.json`` (failed runs) are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from conveyor.files import atomic_write
from conveyor.returns_file import read_returns

SMOOTHING_EPISODES = 100
DPI = 80


@dataclass
class RunData:
    directory: Path
    label: str
    env: str
    summary: dict[str, Any]
    curve: np.ndarray  # [episodes, 3]: env_steps, wall_time_s, return


def run_label(summary: dict[str, Any]) -> str:
    return f"{summary.get('arch', '?')}/{summary.get('algo', '?')} s{summary.get('seed', '?')}"


def load_run(run_dir: Path | str, label: str | None = None) -> RunData | None:
    """A run's summary and episode curve; None when the run has no summary (it failed or is running)."""
    run_dir = Path(run_dir)
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        return None
    summary = json.loads(summary_file.read_text())
    curve = read_returns(run_dir / "returns.csv")
    return RunData(run_dir, label or run_label(summary), str(summary.get("env", "?")), summary, curve)


def distinct_labels(runs: Sequence[RunData]) -> list[RunData]:
    """``runs`` with each label that several runs share suffixed by the run's directory, so that two runs of
    the same arch/algo/seed (say, one flag apart) get two legend entries instead of two lines under one name."""
    groups: dict[str, list[Path]] = {}
    for run in runs:
        groups.setdefault(run.label, []).append(run.directory)
    suffix = {}
    for label, directories in groups.items():
        names = [d.resolve().name for d in directories]
        if len(directories) > 1:  # the folder's name, else (two folders of one name) its whole path
            unique = len(set(names)) == len(names)
            suffix.update({(label, d): name if unique else str(d) for d, name in zip(directories, names)})
    return [replace(run, label=f"{run.label} ({suffix[run.label, run.directory]})")
            if (run.label, run.directory) in suffix else run for run in runs]


def trailing_mean(values: np.ndarray, window: int = SMOOTHING_EPISODES) -> np.ndarray:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def file_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(run_dirs: Sequence[Path | str], out_dir: Path | str, labels: Sequence[str] | None = None) -> list[Path]:
    """Write the plots of ``run_dirs`` into ``out_dir``; returns the PNG paths (none when no run has a summary)."""
    runs = [run for i, d in enumerate(run_dirs)
            if (run := load_run(d, labels[i] if labels else None)) is not None]
    if not runs:
        return []
    runs = distinct_labels(runs)
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for env in sorted({run.env for run in runs}):
        group = [run for run in runs if run.env == env]
        for column, xlabel, stem in ((0, "env steps", "return_vs_steps"), (1, "wall time (s)", "return_vs_time")):
            fig, ax = plt.subplots(figsize=(6, 3.6))
            for run in group:
                if len(run.curve):
                    ax.plot(run.curve[:, column], trailing_mean(run.curve[:, 2]), label=run.label, linewidth=1.2)
            ax.set(xlabel=xlabel, ylabel=f"return (mean of last {SMOOTHING_EPISODES})", title=env)
            ax.grid(alpha=0.3)
            if any(len(run.curve) for run in group):
                ax.legend(fontsize=7)
            written.append(_save(fig, out_dir / f"{stem}_{file_safe(env)}.png", plt))
    written.append(_plot_sps(runs, out_dir, plt))
    written.append(_plot_lag(runs, out_dir, plt))
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=DPI)
    plt.close(fig)
    return path


def _plot_sps(runs: Sequence[RunData], out_dir: Path, plt: Any) -> Path:
    labels = [f"{run.label}\n{run.env}" for run in runs]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.8 * len(runs) + 1.5), 3.6))
    bars = ax.bar(range(len(runs)), [float(run.summary.get("sps", 0.0)) for run in runs], color="tab:blue")
    ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(runs)), labels, rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="env steps per second", title="throughput")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, out_dir / "sps.png", plt)


def _plot_lag(runs: Sequence[RunData], out_dir: Path, plt: Any) -> Path:
    from matplotlib.ticker import MaxNLocator

    cols = min(len(runs), 4)
    rows = math.ceil(len(runs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.2 * rows), squeeze=False)
    for ax, run in zip(axes.flat, runs):
        histogram = {int(k): int(v) for k, v in (run.summary.get("policy_lag") or {}).get("histogram", {}).items()}
        total = sum(histogram.values())
        if total:
            lags = sorted(histogram)
            ax.bar(lags, [histogram[lag] / total for lag in lags], width=0.8, color="tab:orange")
            ax.set_xlim(min(lags) - 0.6, max(max(lags), min(lags) + 4) + 0.6)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        else:
            ax.text(0.5, 0.5, "no lag recorded", ha="center", va="center", transform=ax.transAxes, fontsize=7)
        ax.set_title(f"{run.label}\n{run.env}", fontsize=7)
        ax.set_xlabel("policy lag (updates)", fontsize=7)
        ax.set_ylabel("fraction of actions", fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(runs):]:
        ax.axis("off")
    return _save(fig, out_dir / "lag.png", plt)


# ---- `conveyor plot` -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="DIR", help="run directories (their --out)")
    parser.add_argument("--out", type=Path, default=Path("plots"), help="where to write the PNGs (default: plots)")


def main(args: argparse.Namespace) -> int:
    from conveyor.errors import ConfigError

    missing = [str(d) for d in args.runs if not (Path(d) / "summary.json").is_file()]
    if len(missing) == len(args.runs):
        raise ConfigError(f"no summary.json in {', '.join(missing)}: pass the --out DIR of finished runs")
    for directory in missing:
        print(f"skipped {directory}: no summary.json")
    for path in plot_runs(args.runs, args.out):
        print(f"written: {path}")
    return 0
