"""``conveyor report``: runs aggregated over seeds and envs, and their small committed form.

Reads run directories (``summary.json``, ``returns.csv``: a run's ``--out``, or any folder holding such) and
exported runs (``seed-N.csv`` with ``seed-N.json``, written by ``--export``), groups them by (env, arch/algo),
and writes into ``--out``: ``numbers.csv`` (every number the report shows), one PNG per figure and the
Markdown page (``--page``, default ``OUT/results.md``). The statistics are ``conveyor.bench.stats``': the
interquartile mean of the final return with a 95% stratified bootstrap interval, per env and normalized
across envs (``SCORES``), performance profiles, the probability of improvement of every arch/algo over every
other, the IQM over the course of training against env steps and wall time and, with ``--claims``, the papers'
claims' verdicts (``conveyor.bench.claims``).

A run's curve is its ``checkpoint_curve``: the mean return of the last 100 episodes at up to
``CURVE_POINTS + 1`` episodes spread evenly over its env steps, rounded as its exported CSV holds it, so a run
directory and its export report the same numbers. Nothing reads the clock: a run's date is when its
``summary.json`` was written, kept in its export; rerunning the command on the same data rewrites the same
bytes (docs/results.md, from ``benchmarks/results/matrix``; tests/test_report.py checks).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from conveyor.bench import stats
from conveyor.bench.claims import claims_section
from conveyor.bench.report import TARGET_STOP
from conveyor.errors import ConfigError
from conveyor.files import write_text_atomic
from conveyor.plots import SMOOTHING_EPISODES, file_safe, trailing_mean

CURVE_POINTS = 100
CURVE_FIELDS = ("env_steps", "wall_s", f"return_mean_last{SMOOTHING_EPISODES}")
GRID_POINTS = 50
"""Points of a sample-efficiency curve, evenly from 0 to the end every run of the arch/algo reached."""
PROFILE_POINTS = 101


@dataclass(frozen=True)
class EnvScores:
    random: float
    reference: float
    source: str


SCORES: dict[str, EnvScores] = {
    "CartPole-v1": EnvScores(22.2, 500.0, "random: mean of 1,000 episodes of uniform-random actions (reset seeds "
                             "0-999, gymnasium 1.4.0); reference: the most an episode returns (reward 1 per step, "
                             "truncated at 500 steps; gymnasium's CartPole-v1)"),
    "Pendulum-v1": EnvScores(-1230.7, 0.0, "random: mean of 1,000 episodes of uniform-random actions (reset seeds "
                             "0-999, gymnasium 1.4.0); reference: the most an episode returns (every step's reward "
                             "is at most 0; gymnasium's Pendulum-v1)"),
}
"""Per env, the scores that map a final return to 0 (a uniform-random policy) and 1 (the reference), with
their sources. An env without an entry is reported in its own units and left out of the normalized,
across-env numbers."""


@dataclass(frozen=True)
class RunRecord:
    env: str
    arch: str
    algo: str
    seed: int
    curve: np.ndarray  # [points, 3]: CURVE_FIELDS
    stop_reason: str
    date: str  # YYYY-MM-DD, when the run finished
    source: Path

    @property
    def label(self) -> str:
        return f"{self.arch}/{self.algo}"

    @property
    def final(self) -> float:
        return float(self.curve[-1, 2])


# ---- reading runs ---------------------------------------------------------------------------------
def checkpoint_curve(returns: np.ndarray) -> np.ndarray:
    """``returns`` (``[episodes, 3]``: returns.csv) as ``[points, 3]``: env steps, wall s and the mean return of
    the last 100 episodes at the last episode ending by each of ``CURVE_POINTS + 1`` evenly spaced env steps."""
    means = trailing_mean(returns[:, 2])
    targets = np.linspace(returns[0, 0], returns[-1, 0], CURVE_POINTS + 1)
    rows = np.unique(np.searchsorted(returns[:, 0], targets, side="right") - 1)
    return np.column_stack([returns[rows, 0], np.round(returns[rows, 1], 3), np.round(means[rows], 4)])


def _run_dir_record(run_dir: Path) -> RunRecord | None:
    from conveyor.returns_file import read_returns

    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text())
    returns = read_returns(run_dir / "returns.csv")
    if not len(returns):
        print(f"skipped {run_dir}: no episodes")
        return None
    return RunRecord(str(summary["env"]), str(summary["arch"]), str(summary["algo"]), int(summary["seed"]),
                     checkpoint_curve(returns), str(summary.get("stop_reason", "")),
                     time.strftime("%Y-%m-%d", time.gmtime(summary_file.stat().st_mtime)), run_dir)


def _exported_record(meta_file: Path) -> RunRecord:
    meta = json.loads(meta_file.read_text())
    curve_file = meta_file.with_suffix(".csv")
    try:
        curve = np.loadtxt(curve_file, delimiter=",", skiprows=1, ndmin=2).reshape(-1, 3)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{curve_file} is not an exported run's curve ({error}): export it again with "
                          "conveyor report RUN_DIR --export DIR") from None
    if not len(curve):
        raise ConfigError(f"{curve_file} has no rows: export it again with conveyor report RUN_DIR --export DIR")
    return RunRecord(meta["env"], meta["arch"], meta["algo"], int(meta["seed"]), curve, meta["stop_reason"],
                     meta["date"], meta_file)


def find_runs(paths: Sequence[Path]) -> list[RunRecord]:
    """The runs under ``paths``, sorted by env, arch/algo and seed; a ConfigError when a path does not exist,
    none is found or two are the same run."""
    records: list[RunRecord] = []
    for path in paths:
        if not path.is_dir():
            raise ConfigError(f"{path} is not a directory: pass run directories (a run's --out) or folders of "
                              "exported runs (seed-N.csv with seed-N.json)")
        for summary in sorted(path.rglob("summary.json")):
            if (record := _run_dir_record(summary.parent)) is not None:
                records.append(record)
        records += [_exported_record(meta) for meta in sorted(path.rglob("seed-*.json"))]
    if not records:
        raise ConfigError(f"no runs in {', '.join(map(str, paths))}: pass run directories with a summary.json "
                          "or exported runs (seed-N.csv with seed-N.json)")
    records.sort(key=lambda r: (r.env, r.label, r.seed))
    for first, second in zip(records, records[1:]):
        if (first.env, first.label, first.seed) == (second.env, second.label, second.seed):
            raise ConfigError(f"{first.label} seed {first.seed} on {first.env} twice ({first.source} and "
                              f"{second.source}): pass one of them")
    return records


# ---- exporting --------------------------------------------------------------------------------------
def export_run(record: RunRecord, root: Path) -> Path:
    """Write ``record`` as ``root/<env>/<arch>-<algo>/seed-<N>.csv`` (its checkpoint curve) and ``.json``
    (what it is, how it ended, its date); returns the CSV's path."""
    folder = root / file_safe(record.env) / f"{record.arch}-{record.algo}"
    folder.mkdir(parents=True, exist_ok=True)
    lines = [",".join(CURVE_FIELDS)] + [f"{int(steps)},{wall:.3f},{ret:.4f}" for steps, wall, ret in record.curve]
    meta = {"env": record.env, "arch": record.arch, "algo": record.algo, "seed": record.seed,
            "env_steps": int(record.curve[-1, 0]), "wall_time_s": float(record.curve[-1, 1]),
            "stop_reason": record.stop_reason, "date": record.date}
    write_text_atomic(folder / f"seed-{record.seed}.csv", "\n".join(lines) + "\n")
    write_text_atomic(folder / f"seed-{record.seed}.json", json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return folder / f"seed-{record.seed}.csv"


# ---- the numbers --------------------------------------------------------------------------------------
NUMBER_FIELDS = ("table", "env", "run", "other", "x", "value", "low", "high", "runs")


def _groups(records: Sequence[RunRecord]) -> dict[tuple[str, str], list[RunRecord]]:
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for record in records:
        groups.setdefault((record.env, record.label), []).append(record)
    return groups


def _row(table: str, env: str, run: str, estimate: tuple[Any, Any, Any], runs: int, other: str = "",
         x: float | str = "") -> dict[str, Any]:
    value, low, high = (float(np.squeeze(v)) for v in estimate)
    return {"table": table, "env": env, "run": run, "other": other, "x": x, "value": value, "low": low,
            "high": high, "runs": runs}


def sample_grid(runs: Sequence[RunRecord], column: int) -> tuple[np.ndarray, np.ndarray]:
    """``(grid, [runs, points])``: each run's curve on a common grid of ``column`` (0 env steps, 1 wall s) up to
    where every run that did not stop at its target still has data (a run that did holds its last value)."""
    ends = [run.curve[-1, column] for run in runs if run.stop_reason != TARGET_STOP]
    grid = np.linspace(0.0, min(ends) if ends else max(run.curve[-1, column] for run in runs), GRID_POINTS)
    return grid, np.stack([np.interp(grid, run.curve[:, column], run.curve[:, 2]) for run in runs])


def aggregate(records: Sequence[RunRecord], reps: int = stats.BOOTSTRAP_REPS) -> list[dict[str, Any]]:
    """Every number of the report, as ``NUMBER_FIELDS`` rows: ``final`` (IQM of the final return per env and
    arch/algo), ``normalized`` (the same normalized; env ``all``: over the envs in ``SCORES``), ``profile``
    (fraction of normalized runs above x), ``improvement`` (P(run > other) over their common envs),
    ``curve_steps`` / ``curve_time`` (IQM of the return at x env steps / wall s)."""
    groups = _groups(records)
    labels = sorted({label for _, label in groups})
    rows: list[dict[str, Any]] = []
    for (env, label), runs in groups.items():
        finals = np.array([run.final for run in runs])
        rows.append(_row("final", env, label, stats.stratified_bootstrap([finals], stats.pooled_iqm, reps), len(runs)))
        if env in SCORES:
            scores = stats.normalized(finals, SCORES[env].random, SCORES[env].reference)
            rows.append(_row("normalized", env, label, stats.stratified_bootstrap([scores], stats.pooled_iqm, reps),
                             len(runs)))
        for table, column in (("curve_steps", 0), ("curve_time", 1)):
            grid, values = sample_grid(runs, column)
            value, low, high = stats.stratified_bootstrap([values], stats.pooled_iqm, reps)
            rows += [_row(table, env, label, (value[i], low[i], high[i]), len(runs), x=float(grid[i]))
                     for i in range(len(grid))]
    normalized = {label: [stats.normalized([run.final for run in runs], SCORES[env].random, SCORES[env].reference)
                          for (env, run_label), runs in groups.items() if run_label == label and env in SCORES]
                  for label in labels}
    normalized = {label: tasks for label, tasks in normalized.items() if tasks}
    pooled = np.concatenate([np.concatenate(tasks) for tasks in normalized.values()]) if normalized else np.zeros(0)
    taus = np.linspace(min(0.0, float(pooled.min(initial=0.0))), max(1.0, float(pooled.max(initial=1.0))),
                       PROFILE_POINTS)
    for label, tasks in normalized.items():
        runs_count = sum(len(task) for task in tasks)
        rows.append(_row("normalized", "all", label, stats.stratified_bootstrap(tasks, stats.pooled_iqm, reps),
                         runs_count))
        value, low, high = stats.stratified_bootstrap(tasks, stats.profile_statistic(taus), reps)
        rows += [_row("profile", "all", label, (value[i], low[i], high[i]), runs_count, x=float(taus[i]))
                 for i in range(len(taus))]
    for i, x_label in enumerate(labels):
        for y_label in labels[i + 1:]:
            envs = sorted(env for env, label in groups if label == x_label and (env, y_label) in groups)
            if not envs:
                continue
            tasks_x = [np.array([run.final for run in groups[env, x_label]]) for env in envs]
            tasks_y = [np.array([run.final for run in groups[env, y_label]]) for env in envs]
            rows.append(_row("improvement", " ".join(envs), x_label,
                             stats.probability_of_improvement(tasks_x, tasks_y, reps), sum(map(len, tasks_x)),
                             other=y_label))
    return rows


def numbers_csv(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as CSV, every float with 6 significant digits."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=NUMBER_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: f"{value:.6g}" if isinstance(value, float) else value for key, value in row.items()})
    return buffer.getvalue()


# ---- figures ----------------------------------------------------------------------------------------
def _select(rows: Sequence[dict[str, Any]], table: str, env: str | None = None,
            run: str | None = None) -> list[dict[str, Any]]:
    return [row for row in rows if row["table"] == table and env in (None, row["env"]) and run in (None, row["run"])]


def figure_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The report's PNGs, in the page's order."""
    envs = sorted({row["env"] for row in _select(rows, "final")})
    names = ["final_iqm.png"]
    names += ["profile.png"] * bool(_select(rows, "profile")) + ["improvement.png"] * bool(_select(rows, "improvement"))
    return names + [f"{stem}_{file_safe(env)}.png" for env in envs for stem in ("curve_steps", "curve_time")]


def _interval_panel(ax: Any, rows: Sequence[dict[str, Any]], labels: Sequence[str], title: str, xlabel: str) -> None:
    for i, row in enumerate(rows):
        ax.errorbar(row["value"], i, xerr=[[row["value"] - row["low"]], [row["high"] - row["value"]]], fmt="o",
                    capsize=4, color=f"C{labels.index(row['run'])}")
    ax.set_yticks(range(len(rows)), [f"{row['run']} ({row['runs']})" for row in rows])
    ax.set(title=title, xlabel=xlabel)
    ax.grid(alpha=0.3, axis="x")


def write_figures(rows: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    from conveyor.plots import _pyplot, _save

    plt = _pyplot()
    labels = sorted({row["run"] for row in _select(rows, "final")})
    panels = [(env, _select(rows, "final", env), "final return (IQM)")
              for env in sorted({row["env"] for row in _select(rows, "final")})]
    if normalized := _select(rows, "normalized", "all"):
        panels.append(("all envs, normalized", normalized, "normalized final return (IQM)"))
    written = []
    height = 0.4 + sum(0.8 + 0.35 * len(panel_rows) for _, panel_rows, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(6, height), squeeze=False)
    for ax, (title, panel_rows, xlabel) in zip(axes[:, 0], panels):
        _interval_panel(ax, panel_rows, labels, title, xlabel)
    written.append(_save(fig, out / "final_iqm.png", plt))
    if profile := _select(rows, "profile"):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for label in sorted({row["run"] for row in profile}):
            points = _select(profile, "profile", run=label)
            x = [row["x"] for row in points]
            color = f"C{labels.index(label)}"
            ax.plot(x, [row["value"] for row in points], color=color, label=label)
            ax.fill_between(x, [row["low"] for row in points], [row["high"] for row in points], color=color,
                            alpha=0.2, linewidth=0)
        ax.set(xlabel="normalized final return tau", ylabel="fraction of runs > tau", title="performance profile")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "profile.png", plt))
    if improvement := _select(rows, "improvement"):
        fig, ax = plt.subplots(figsize=(6, 1.2 + 0.45 * len(improvement)))
        for i, row in enumerate(improvement):
            ax.errorbar(row["value"], i, xerr=[[row["value"] - row["low"]], [row["high"] - row["value"]]], fmt="o",
                        capsize=4, color="C0")
        ax.set_yticks(range(len(improvement)), [f"P({row['run']} > {row['other']})" for row in improvement])
        ax.axvline(0.5, color="black", linestyle="--", linewidth=1)
        ax.set(xlim=(0, 1), xlabel="probability of improvement", title="probability of improvement (common envs)")
        ax.grid(alpha=0.3, axis="x")
        written.append(_save(fig, out / "improvement.png", plt))
    for env in sorted({row["env"] for row in _select(rows, "final")}):
        for table, xlabel in (("curve_steps", "env steps"), ("curve_time", "wall time (s)")):
            fig, ax = plt.subplots(figsize=(6, 3.6))
            for label in labels:
                points = _select(rows, table, env, label)
                if not points:
                    continue
                x = [row["x"] for row in points]
                color = f"C{labels.index(label)}"
                ax.plot(x, [row["value"] for row in points], color=color, label=f"{label} ({points[0]['runs']})")
                ax.fill_between(x, [row["low"] for row in points], [row["high"] for row in points], color=color,
                                alpha=0.2, linewidth=0)
            ax.set(xlabel=xlabel, ylabel=f"return (mean of last {SMOOTHING_EPISODES}), IQM", title=env)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            written.append(_save(fig, out / f"{table}_{file_safe(env)}.png", plt))
    return written


# ---- the page ---------------------------------------------------------------------------------------
def _num(value: float) -> str:
    digits = 2 if abs(value) < 10 else 1
    return f"{value:,.{digits}f}"


def _interval(row: dict[str, Any] | None) -> str:
    return "-" if row is None else f"{_num(row['value'])} [{_num(row['low'])}, {_num(row['high'])}]"


def _span(values: Sequence[Any], text: Callable[[Any], str] = str) -> str:
    """The lowest to the highest of ``values`` (compared as they are, then written by ``text``): numbers compare
    as numbers, not as their formatted strings ("88,960" sorts after "102,280")."""
    low, high = min(values), max(values)
    return text(low) if low == high else f"{text(low)} to {text(high)}"


def page(records: Sequence[RunRecord], rows: Sequence[dict[str, Any]], command: str, figures: str,
         numbers: str, reps: int, claims: str = "") -> str:
    """The Markdown page: how to regenerate it, the tables, the figures (under ``figures``, relative to the
    page), ``claims`` (the "Paper claims" section, ``claims.claims_section``), the normalization table;
    ``numbers``: the link to numbers.csv."""
    groups = _groups(records)
    lines = [
        "# Results", "",
        f"<!-- Written by `{command}`: edit the data or conveyor/bench/aggregate.py, not this page. -->", "",
        f"Every number below comes from the runs that `{command}` reads, and that command rewrites this page "
        f"byte for byte. A run's final return is the mean return of its last {SMOOTHING_EPISODES} "
        "training episodes when it stopped (at its step budget, or at its target return: CartPole-v1 stops at "
        "475). IQM: the interquartile mean over runs (the mean of the middle half); [low, high]: its 95% "
        f"stratified bootstrap confidence interval ({reps:,} replicates, RandomState seed {stats.BOOTSTRAP_SEED}). "
        "Normalized: (return - random) / (reference - random), from the table at the end. The statistics are "
        "those of Agarwal et al. 2021, *Deep Reinforcement Learning at the Edge of the Statistical Precipice* "
        f"(the `rliable` package's definitions); [every number]({numbers}) as CSV.", "",
        "## Final return", "",
        "| env | arch/algo | seeds | env steps | dates | final return, IQM [95% CI] | normalized |",
        "|---|---|---|---:|---|---:|---:|",
    ]
    for (env, label), runs in groups.items():
        final = _select(rows, "final", env, label)[0]
        normalized = _select(rows, "normalized", env, label)
        steps = _span([int(run.curve[-1, 0]) for run in runs], "{:,}".format)
        lines.append(f"| {env} | {label} | {', '.join(str(run.seed) for run in runs)} "
                     f"| {steps} | {_span([run.date for run in runs])} "
                     f"| {_interval(final)} | {_interval(normalized[0] if normalized else None)} |")
    lines += ["", f"![final return]({figures}/final_iqm.png)"]
    if across := _select(rows, "normalized", "all"):
        lines += [
            "", "## Across envs", "",
            "The normalized final returns of each arch/algo over the envs of the normalization table it ran, "
            "pooled (each env's runs resampled within that env). The performance profile: the fraction of "
            "those runs whose normalized return exceeds tau, with its 95% band.", "",
            "| arch/algo | envs | runs | normalized final return, IQM [95% CI] |", "|---|---|---:|---:|",
        ]
        for row in across:
            envs = sorted(env for env, label in groups if label == row["run"] and env in SCORES)
            lines.append(f"| {row['run']} | {', '.join(envs)} | {row['runs']} | {_interval(row)} |")
        lines += ["", f"![performance profile]({figures}/profile.png)"]
    if improvement := _select(rows, "improvement"):
        lines += [
            "", "## Probability of improvement", "",
            "P(X > Y): the probability that a run of X ends above a run of Y on the same env (ties count half), "
            "averaged over the envs both ran; 0.5 is no difference, and a confidence interval that excludes 0.5 "
            "is a difference these seeds show.", "",
            "| X | Y | envs | P(X > Y) [95% CI] |", "|---|---|---|---:|",
        ]
        lines += [f"| {row['run']} | {row['other']} | {row['env'].replace(' ', ', ')} | {_interval(row)} |"
                  for row in improvement]
        lines += ["", f"![probability of improvement]({figures}/improvement.png)"]
    lines += ["", "## Sample efficiency", "",
              f"The IQM over seeds of the mean return of the last {SMOOTHING_EPISODES} episodes against env steps "
              "and against wall time, with its 95% band, up to where every seed has data (a seed that stopped at "
              "its target return holds it).", ""]
    for env in sorted({env for env, _ in groups}):
        lines.append(f"![{env} against env steps]({figures}/curve_steps_{file_safe(env)}.png) "
                     f"![{env} against wall time]({figures}/curve_time_{file_safe(env)}.png)")
    if claims:
        lines += ["", claims.rstrip("\n")]
    lines += ["", "## Normalization", "", "| env | random | reference | source |", "|---|---:|---:|---|"]
    lines += [f"| {env} | {scores.random:g} | {scores.reference:g} | {scores.source} |"
              for env, scores in SCORES.items()]
    return "\n".join(lines) + "\n"


def write_report(records: Sequence[RunRecord], out: Path, page_path: Path, command: str,
                 reps: int = stats.BOOTSTRAP_REPS, figures: bool = True, claims: str = "") -> list[Path]:
    """``numbers.csv``, the figures (unless not ``figures``) and the page (with ``claims``, the "Paper claims"
    section); returns what was written."""
    out.mkdir(parents=True, exist_ok=True)
    rows = aggregate(records, reps)
    write_text_atomic(out / "numbers.csv", numbers_csv(rows))
    written = [out / "numbers.csv"] + (write_figures(rows, out) if figures else [])
    figures_dir = Path(os.path.relpath(out, page_path.parent)).as_posix()
    page_path.parent.mkdir(parents=True, exist_ok=True)
    text = page(records, rows, command, figures_dir, f"{figures_dir}/numbers.csv", reps, claims)
    write_text_atomic(page_path, text)
    return written + [page_path]


# ---- `conveyor report` --------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="DIR",
                        help="run directories (a run's --out, or folders holding runs) and folders of exported runs")
    parser.add_argument("--out", type=Path, default=Path("report"),
                        help="where numbers.csv and the PNGs go (default: report)")
    parser.add_argument("--page", type=Path, default=None,
                        help="the Markdown page to write, its figure links relative to it (default: OUT/results.md)")
    parser.add_argument("--export", type=Path, default=None, metavar="DIR",
                        help="instead of a report, write each run as DIR/<env>/<arch>-<algo>/seed-N.csv and .json "
                             "(its curve and date, no checkpoints: small enough to commit)")
    parser.add_argument("--claims", type=Path, default=None, metavar="DIR",
                        help="also render the papers' claims from DIR/<claim>/runs.csv (benchmarks/claims.py's "
                             "results, e.g. benchmarks/results/claims) as the page's \"Paper claims\" section")
    parser.add_argument("--reps", type=int, default=stats.BOOTSTRAP_REPS,
                        help=f"bootstrap replicates per interval (default: {stats.BOOTSTRAP_REPS})")


def report_command(runs: Sequence[Path], out: Path, page_path: Path | None, reps: int,
                   claims: Path | None = None) -> str:
    """The command line that writes this report, as its page states it."""
    words = ["conveyor report", *map(str, runs), *(["--claims", str(claims)] if claims else []), "--out", str(out)]
    if page_path is not None:
        words += ["--page", str(page_path)]
    if reps != stats.BOOTSTRAP_REPS:
        words += ["--reps", str(reps)]
    return " ".join(words)


def main(args: argparse.Namespace) -> int:
    if args.reps < 1:
        raise ConfigError(f"--reps {args.reps}: give at least 1 bootstrap replicate (default {stats.BOOTSTRAP_REPS})")
    if args.claims is not None and not args.claims.is_dir():
        raise ConfigError(f"--claims {args.claims} is not a directory: pass the folder benchmarks/claims.py writes "
                          "(benchmarks/results/claims)")
    records = find_runs(args.runs)
    if args.export is not None:
        for record in records:
            print(f"written: {export_run(record, args.export)}")
        return 0
    page_path = args.page or args.out / "results.md"
    command = report_command(args.runs, args.out, args.page, args.reps, args.claims)
    claims = claims_section(args.claims) if args.claims is not None else ""
    for path in write_report(records, args.out, page_path, command, args.reps, claims=claims):
        print(f"written: {path}")
    return 0
