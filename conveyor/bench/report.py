"""The results of a suite: ``results.csv``, ``results.md``, plots, a section of docs/benchmarks-log.md.

Fixed-budget suites get one row per run (its summary and evaluation), the
plots of ``conveyor.plots`` and a table of SPS, returns, evaluation metrics,
lag and time split. The learning suite gets, per env, the runs of each
architecture/algorithm summarized over seeds (``learning_results``): final
return, env steps and wall time until the mean of the last 100 episodes
reached the env's threshold (``threshold_crossing``), the final policy's mean
score in the protocol of the env's published numbers where that differs from
training's (``eval_protocol``), the published number to compare with;
``learning.csv``; and two PNGs per env, return vs env steps and vs wall time,
every row on one axes as the mean over seeds with a min-max band
(``plot_learning``).
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from conveyor.bench.suites import BenchRun, LearningEnv, Suite, reference
from conveyor.files import atomic_write
from conveyor.plots import SMOOTHING_EPISODES, RunData, file_safe, load_run, trailing_mean

if TYPE_CHECKING:
    from conveyor.config import RunCfg

ROW_FIELDS = (
    "name", "framework", "arch", "algo", "env", "seed", "status", "error", "env_steps", "wall_time_s", "sps",
    "episodes", "updates", "return_mean_last100", "final_metric", "final_metric_policies", "final_time_limit_s",
    "final_time_metric", "required_time_target", "required_time_s", "lag_mean", "lag_max", "time_env", "time_act",
    "time_learn", "time_wait", "stop_reason", "param_sha256", "bench_wall_s", "run_dir",
)
LEARNING_FIELDS = (
    "env", "run", "flags", "seeds", "seeds_ok", "final_return_mean", "final_return_std", "threshold",
    "seeds_reached", "steps_to_threshold_mean", "steps_to_threshold_std", "wall_s_to_threshold_mean",
    "wall_s_to_threshold_std", "eval_protocol", "eval_return_mean", "eval_return_std", "reference", "notes",
)
BENCHMARKS_LOG = Path("docs") / "benchmarks-log.md"
"""The dated benchmark record, relative to the repository root: the scripts under ``benchmarks/`` rewrite its
marked sections (BENCHMARKS.md says how to reproduce each)."""
TARGET_STOP, TIME_STOP, BUDGET_STOP = "target_return reached", "time_limit_s reached", "total_steps reached"
"""A run's stop reason when it stopped at its target return / its wall-time limit / its step budget (``conveyor.run``)."""
CURVE_POINTS = 200
LEARNING_PLOTS = {"learning_steps": "env steps", "learning_time": "wall time (s)"}
"""The learning suite's PNGs per env (file stem: x axis), in returns.csv column order."""


# ---- one row per run -----------------------------------------------------------------------------
def result_row(run: BenchRun, cfg: RunCfg, run_dir: Path, status: str, error: str,
               bench_wall_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {field: None for field in ROW_FIELDS}
    row.update(name=run.name, framework=run.framework, arch=run.arch_label, algo=run.algo_label or cfg.algo.name,
               env=cfg.env.id, seed=cfg.seed, status=status, error=error, bench_wall_s=round(bench_wall_s, 1),
               run_dir=str(run_dir))
    summary_file = run_dir / "summary.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        lag = summary.get("policy_lag") or {}
        split = summary.get("time_split_fraction") or {}
        row.update({key: summary.get(key) for key in ("env_steps", "wall_time_s", "sps", "episodes", "updates",
                                                      "return_mean_last100", "stop_reason", "param_sha256")})
        recorded = bool(lag.get("histogram"))  # a run that never updated has no lag to report
        row.update(lag_mean=lag.get("mean") if recorded else None, lag_max=lag.get("max") if recorded else None,
                   **{f"time_{bucket}": split.get(bucket) for bucket in ("env", "act", "learn", "wait")})
    eval_file = run_dir / "eval.json"
    if eval_file.is_file():
        result = json.loads(eval_file.read_text())
        required = result.get("required_time_metric") or {}
        row.update(final_metric=result.get("final_metric"), final_metric_policies=result.get("final_metric_policies"),
                   required_time_target=required.get("target"), required_time_s=required.get("wall_time_s"))
    return row


def final_time_limits(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per env, the final time metric's limit: the wall time of the fastest finished run (HTS-RL section 5)."""
    limits: dict[str, float] = {}
    for row in rows:
        if row["status"] == "ok" and row["wall_time_s"] is not None:
            limits[row["env"]] = min(limits.get(row["env"], math.inf), float(row["wall_time_s"]))
    return limits


def add_final_time_metrics(rows: Sequence[dict[str, Any]]) -> None:
    """Fill ``final_time_metric`` of each evaluated run from its eval.json and its env's time limit."""
    from conveyor.evaluate import final_time_metric, load_eval

    limits = final_time_limits(rows)
    for row in rows:
        if row["final_metric_policies"] is None or row["env"] not in limits:
            continue
        _, policies = load_eval(row["run_dir"])
        value = final_time_metric(policies, limits[row["env"]])
        row["final_time_limit_s"] = limits[row["env"]]
        row["final_time_metric"] = value if math.isfinite(value) else None


def row_label(row: dict[str, Any]) -> str:
    return f"{row['arch']}/{row['algo']} s{row['seed']}"


def row_line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row['error']}"
    return (f"ok: {_num(row['env_steps'])} steps in {_num(row['wall_time_s'], 1)}s ({_num(row['sps'])} SPS), "
            f"return {_num(row['return_mean_last100'], 1)}, final metric {_num(row['final_metric'], 1)}, "
            f"lag {_num(row['lag_mean'], 2)}/{_num(row['lag_max'])}")


# ---- writing the results folder -------------------------------------------------------------------
def write_results(suite: Suite, out: Path, rows: list[dict[str, Any]], elapsed_s: float,
                  markdown: Path | None = None) -> None:
    """``results.csv`` and the suite's report (``results.md``, plots; ``learning.csv`` for the learning
    suite); with ``markdown``, also the suite's section of that file, linking the plots relative to it."""
    write_csv(out / "results.csv", rows, ROW_FIELDS)
    if suite.learning_envs:
        results = learning_results(suite.learning_envs, suite.runs, rows)
        write_csv(out / "learning.csv", results, LEARNING_FIELDS)
        plots = [path for env in suite.learning_envs
                 for path in plot_learning(env, [r for r in rows if r["env"] == env.id], out)]
        report = learning_report
        details: Any = results
    else:
        from conveyor.plots import plot_runs

        add_final_time_metrics(rows)
        finished = [row for row in rows if (Path(row["run_dir"]) / "summary.json").is_file()]
        plots = plot_runs([row["run_dir"] for row in finished], out, labels=[row_label(row) for row in finished])
        report = markdown_report
        details = rows
    (out / "results.md").write_text(report(suite, details, len(rows), elapsed_s, [p.name for p in plots]))
    if markdown is not None:
        prefix = os.path.relpath(out, markdown.parent)
        body = report(suite, details, len(rows), elapsed_s, [f"{prefix}/{p.name}" for p in plots])
        update_markdown_section(markdown, suite.name, body)


def write_csv(path: Path, rows: Sequence[dict[str, Any]], fields: Sequence[str] | None = None) -> None:
    """``rows`` as CSV; the columns are ``fields``, else every key any row has. Written whole or not at all
    (``files.atomic_write``): a row that does not fit the columns leaves the file as it was."""
    with atomic_write(path, text=True) as f:
        writer = csv.DictWriter(f, fieldnames=list(fields or sorted({key for row in rows for key in row})))
        writer.writeheader()
        writer.writerows(rows)


def section_markers(suite_name: str) -> tuple[str, str]:
    return (f"<!-- conveyor bench --suite {suite_name}: start -->", f"<!-- conveyor bench --suite {suite_name}: end -->")


def replace_section(text: str, suite_name: str, body: str) -> str:
    """``text`` with the suite's marked section set to ``body`` (appended under a heading when absent)."""
    start, end = section_markers(suite_name)
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text and text.index(start) < text.index(end):
        return text[: text.index(start)] + block + text[text.index(end) + len(end):]
    return f"{text.rstrip()}\n\n### `{suite_name}`\n\n{block}\n".lstrip()


def update_markdown_section(path: Path, section: str, body: str) -> None:
    """Set the marked ``section`` of the Markdown file at ``path`` (``BENCHMARKS_LOG``) to ``body``."""
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    path.write_text(replace_section(text, section, body))


def device_name(device: str) -> str:
    """What a benchmark's learner ran on, for its table: the GPU's name for a cuda device, else "CPU"."""
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"


def publish_results(root: Path, section: str, rows: Sequence[dict[str, Any]], table: str,
                    markdown: bool = True) -> None:
    """What a ``benchmarks/*.py`` script leaves: ``rows`` in ``benchmarks/results/<section>.csv`` (``-`` as
    ``_``), ``table`` on stdout and, with ``markdown``, as the ``section`` of ``BENCHMARKS_LOG``."""
    results = root / "benchmarks" / "results" / f"{section.replace('-', '_')}.csv"
    results.parent.mkdir(parents=True, exist_ok=True)
    write_csv(results, rows)
    print(table)
    if markdown:
        update_markdown_section(root / BENCHMARKS_LOG, section, table)


def _num(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{float(value):,.{digits}f}"


def _cell(text: str, limit: int = 140) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _report_head(suite: Suite, runs: int, elapsed_s: float) -> list[str]:
    """A report's first lines: the suite, the machine, the date and the command."""
    import torch

    return [f"Suite `{suite.name}`: {suite.description}.", "",
            f"{runs} runs in {elapsed_s:.0f} s on {os.cpu_count()} cores ({platform.machine()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}), {time.strftime('%Y-%m-%d')}; "
            f"`conveyor bench --suite {suite.name.replace('-quick', ' --quick')}`.", ""]


def _images(plots: Sequence[str]) -> list[str]:
    return ["", " ".join(f"![{Path(p).stem}]({p})" for p in plots)] if plots else []


def markdown_report(suite: Suite, rows: Sequence[dict[str, Any]], runs: int, elapsed_s: float,
                    plots: Sequence[str]) -> str:
    """A fixed-budget suite's Markdown: how it ran, the table, what the columns mean, the plots."""
    lines = [
        *_report_head(suite, runs, elapsed_s),
        "| run | status | env steps | wall s | SPS | return (last 100) | final metric | final time metric "
        "| time to target | lag mean / max | time split env / act / learn / wait |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        status = "ok" if row["status"] == "ok" else f"{row['status']}: {_cell(row['error'])}"
        split = ("-" if row["time_env"] is None else
                 " / ".join(f"{100 * (row[f'time_{b}'] or 0):.0f}" for b in ("env", "act", "learn", "wait")) + " %")
        timed = (f"{_num(row['final_time_metric'], 1)} (<= {_num(row['final_time_limit_s'], 1)} s)"
                 if row["final_time_limit_s"] is not None else "-")
        target = "-"
        if row["required_time_target"] is not None:
            target = (f"{_num(row['required_time_s'], 1)} s" if row["required_time_s"] is not None
                      else f"> {_num(row['wall_time_s'], 1)} s")
        lag = "-" if row["lag_mean"] is None else f"{_num(row['lag_mean'], 2)} / {_num(row['lag_max'])}"
        lines.append(
            f"| {row['arch']}/{row['algo']} {row['env']} s{row['seed']} | {status} | {_num(row['env_steps'])} "
            f"| {_num(row['wall_time_s'], 1)} | {_num(row['sps'])} | {_num(row['return_mean_last100'], 1)} "
            f"| {_num(row['final_metric'], 1)} | {timed} | {target} | {lag} | {split} |")
    targets = sorted({f"{row['env']}: {row['required_time_target']:g}" for row in rows
                      if row["required_time_target"] is not None})
    lines += [
        "",
        "Return (last 100): mean training return of the last 100 episodes. Final metric: mean of 10 evaluation "
        "episodes for each of the last 10 checkpoints (HTS-RL section 5). Final time metric: the same over the "
        "checkpoints saved within the wall time of the fastest run on that env. Time to target: wall time until "
        "the running evaluation mean (last 10 checkpoints x 10 episodes) reached the env's reward threshold"
        + (f" ({', '.join(targets)})" if targets else "") + "; `>` means not within the run. "
        "Lag: learner version minus the version that chose each action. Time split: share of the measured time "
        "spent stepping envs, choosing actions, learning and waiting.",
    ]
    return "\n".join(lines + _images(plots)) + "\n"


# ---- the learning suite ----------------------------------------------------------------------------
def threshold_crossing(curve: np.ndarray, threshold: float,
                       window: int = SMOOTHING_EPISODES) -> tuple[float, float] | None:
    """``(env steps, wall time s)`` at the end of the first episode where the mean return of the last
    ``window`` episodes reached ``threshold``, counting only once ``window`` episodes exist (as a run's own
    ``--target-return`` stop does); None when it never did. ``curve``: ``[episodes, 3]`` rows of returns.csv."""
    if len(curve) < window:
        return None
    means = trailing_mean(curve[:, 2], window)[window - 1:]
    reached = np.flatnonzero(means >= threshold)
    if not len(reached):
        return None
    episode = int(reached[0]) + window - 1
    return float(curve[episode, 0]), float(curve[episode, 1])


def final_return(curve: np.ndarray, window: int = SMOOTHING_EPISODES) -> float | None:
    """Mean return of the last ``window`` episodes (fewer if the run had fewer); None without episodes."""
    return float(curve[-window:, 2].mean()) if len(curve) else None


def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and population standard deviation (ddof 0) over seeds; None for no values."""
    if not values:
        return None, None
    return float(np.mean(values)), float(np.std(values))


def row_run_label(row: dict[str, Any]) -> str:
    return f"{row['arch']}/{row['algo']}"


def runs_by_label(rows: Sequence[dict[str, Any]]) -> dict[str, list[RunData]]:
    """The finished runs (status ok, with episodes) of ``rows`` by arch/algo, in the rows' order."""
    groups: dict[str, list[RunData]] = {}
    for row in rows:
        run = load_run(row["run_dir"]) if row["status"] == "ok" else None
        if run is not None and len(run.curve):
            groups.setdefault(row_run_label(row), []).append(run)
    return groups


def learning_results(envs: Sequence[LearningEnv], runs: Sequence[BenchRun],
                     rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per (env, arch/algo) over the seeds that have run, in the suite's order."""
    flags = {(run.cfg.env.id, f"{run.arch_label}/{run.algo_label or run.cfg.algo.name}"):
             " ".join(run.flags[: run.flags.index("--env")]) for run in runs if "--env" in run.flags}
    results = []
    for env in envs:
        env_rows = [row for row in rows if row["env"] == env.id]
        finished = runs_by_label(env_rows)
        for label in dict.fromkeys(row_run_label(row) for row in env_rows):
            group = [row for row in env_rows if row_run_label(row) == label]
            curves = [run.curve for run in finished.get(label, [])]
            finals = [final_return(curve) for curve in curves]
            crossings = [] if env.threshold is None else [
                crossing for curve in curves if (crossing := threshold_crossing(curve, env.threshold))]
            final_mean, final_std = _mean_std(finals)
            steps_mean, steps_std = _mean_std([steps for steps, _ in crossings])
            wall_mean, wall_std = _mean_std([wall for _, wall in crossings])
            eval_mean, eval_std = _mean_std([row["final_metric"] for row in group if row["final_metric"] is not None])
            notes = sorted({f"{row['status']}: {row['error']}" for row in group if row["status"] != "ok"})
            if capped := sum(row["stop_reason"] == TIME_STOP for row in group):
                notes.append(f"{capped} stopped at the wall-time guard")
            results.append({
                "env": env.id, "run": label, "flags": flags.get((env.id, label), ""), "seeds": len(group),
                "seeds_ok": len(finals), "final_return_mean": final_mean, "final_return_std": final_std,
                "threshold": env.threshold, "seeds_reached": None if env.threshold is None else len(crossings),
                "steps_to_threshold_mean": steps_mean, "steps_to_threshold_std": steps_std,
                "wall_s_to_threshold_mean": wall_mean, "wall_s_to_threshold_std": wall_std,
                "eval_protocol": eval_protocol(env), "eval_return_mean": eval_mean, "eval_return_std": eval_std,
                "reference": reference(env.id, label), "notes": "; ".join(notes),
            })
    return results


def eval_protocol(env: LearningEnv) -> str:
    """How an env's final policies are evaluated after training ("" when they are not)."""
    from conveyor.evaluate import NOOP_MAX
    from conveyor.presets import is_atari_id

    if not env.eval_episodes:
        return ""
    parts = [f"final policy, {env.eval_episodes} episodes"]
    if is_atari_id(env.id):
        parts.append(f"up to {NOOP_MAX} no-op starts")
    parts += [f"{key}={value}" for key, value in env.eval_env_args]
    return ", ".join(parts)


def seed_band(curves: Sequence[np.ndarray], column: int, held: Sequence[bool],
              points: int = CURVE_POINTS) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Over seeds: ``(x, mean, low, high, count)`` of the last-100 mean return on a common grid of
    ``column`` (0 env steps, 1 wall time), each seed interpolated within its own range. A seed that is
    ``held`` (it stopped at the threshold) keeps its last value up to the longest seed's end."""
    x_end = max(float(curve[-1, column]) for curve in curves)
    grid = np.linspace(0.0, x_end, points)
    values = np.full((len(curves), points), np.nan)
    for i, curve in enumerate(curves):
        x, y = curve[:, column], trailing_mean(curve[:, 2])
        end = x_end if held[i] else x[-1]
        inside = (grid >= x[0]) & (grid <= end)
        values[i, inside] = np.interp(grid[inside], x, y)  # beyond x[-1], interp holds the last value
    count = np.sum(~np.isnan(values), axis=0)
    filled = np.where(np.isnan(values), 0.0, values)
    mean = np.where(count > 0, filled.sum(axis=0) / np.maximum(count, 1), np.nan)
    low = np.where(count > 0, np.min(np.where(np.isnan(values), np.inf, values), axis=0), np.nan)
    high = np.where(count > 0, np.max(np.where(np.isnan(values), -np.inf, values), axis=0), np.nan)
    return grid, mean, low, high, count


def plot_learning(env: LearningEnv, rows: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """``learning_steps_<env>.png`` and ``learning_time_<env>.png``: every arch/algo of ``rows`` on one axes,
    mean over seeds with a min-max band; none when no run of the env has episodes."""
    from conveyor.plots import _pyplot, _save

    groups = runs_by_label(rows)
    if not groups:
        return []
    plt = _pyplot()
    written = []
    for column, (stem, xlabel) in enumerate(LEARNING_PLOTS.items()):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, runs in groups.items():
            held = [run.summary.get("stop_reason") == TARGET_STOP for run in runs]
            x, mean, low, high, count = seed_band([run.curve for run in runs], column, held)
            (line,) = ax.plot(x, mean, linewidth=1.3, label=f"{label} ({len(runs)} seed{'s' * (len(runs) > 1)})")
            band = count > 1
            if band.any():
                ax.fill_between(x, low, high, where=band, color=line.get_color(), alpha=0.2, linewidth=0)
        if env.threshold is not None:
            ax.axhline(env.threshold, color="black", linestyle="--", linewidth=1, label=f"threshold {env.threshold:g}")
        ax.set(xlabel=xlabel, ylabel=f"return (mean of last {SMOOTHING_EPISODES})", title=env.id)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(fig, out_dir / f"{stem}_{file_safe(env.id)}.png", plt))
    return written


def _spread(mean: float | None, std: float | None, digits: int = 0, unit: str = "") -> str:
    return "-" if mean is None else f"{_num(mean, digits)} ± {_num(std, digits)}{unit}"


def _to_threshold(result: dict[str, Any], key: str, digits: int, unit: str) -> str:
    if result["threshold"] is None:
        return "no threshold"
    if not result["seeds_reached"]:
        return "not reached"
    value = _spread(result[f"{key}_mean"], result[f"{key}_std"], digits, unit)
    return f"{value} ({result['seeds_reached']}/{result['seeds']})"


def learning_report(suite: Suite, results: Sequence[dict[str, Any]], runs: int, elapsed_s: float,
                    plots: Sequence[str]) -> str:
    """The learning suite's Markdown: per env a table of the rows over seeds, then its two plots."""
    lines = [
        *_report_head(suite, runs, elapsed_s),
        "Each row is `conveyor train FLAGS --env ENV --seed N --total-steps STEPS`, nothing else. Final return: "
        "mean of the last 100 training episodes of each seed, then mean ± std (ddof 0) over the seeds that "
        "finished. To threshold: the env steps and wall time at which the mean of the last 100 episodes first "
        "reached the threshold, mean ± std over the seeds that reached it (k/n: how many). Runs on an env with "
        "a registered reward threshold (CartPole-v1: 475) stop there, as `conveyor train` does. Plots: mean over "
        "seeds of the last-100 mean with a min-max band; a run that stopped at the threshold holds its value.",
    ]
    for env in suite.learning_envs:
        env_results = [result for result in results if result["env"] == env.id]
        if not env_results:
            continue
        target = "no threshold" if env.threshold is None else f"threshold {env.threshold:g}"
        protocol = eval_protocol(env)
        lines += [
            "",
            f"#### {env.id}: {env.total_steps:,} env steps, {target}",
            "",
            *([f"Evaluated: {protocol}; mean ± std over seeds of each seed's mean score.", ""] if protocol else []),
            "| arch/algo | flags | seeds ok | final return | env steps to threshold | wall time to threshold "
            f"|{' evaluated |' if protocol else ''} published |",
            f"|---|---|---:|---:|---:|---:|{'---:|' if protocol else ''}---|",
        ]
        for result in env_results:
            seeds = f"{result['seeds_ok']}/{result['seeds']}"
            if result["notes"]:
                seeds += f" ({_cell(result['notes'], 100)})"
            evaluated = f" {_spread(result['eval_return_mean'], result['eval_return_std'], 1)} |" if protocol else ""
            lines.append(
                f"| {result['run']} | `{result['flags']}` | {seeds} "
                f"| {_spread(result['final_return_mean'], result['final_return_std'], 1)} "
                f"| {_to_threshold(result, 'steps_to_threshold', 0, '')} "
                f"| {_to_threshold(result, 'wall_s_to_threshold', 1, ' s')} |{evaluated} {result['reference']} |")
        stems = {f"{stem}_{file_safe(env.id)}" for stem in LEARNING_PLOTS}
        lines += _images([p for p in plots if Path(p).stem in stems])
    return "\n".join(lines) + "\n"
