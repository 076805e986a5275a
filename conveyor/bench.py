"""``conveyor bench``: run a suite of runs one after another and write a results folder.

A suite is a list of ``BenchRun``s: architectures x algorithms x envs x
seeds, each with a fixed budget of env steps and a wall-time cap, or a peer
framework (stable-baselines3 A2C/PPO, Sample Factory APPO) configured with
the same env, model, number of envs and n-steps. Suites: ``quick``,
``atari``, ``mujoco``, ``peers`` (see ``SUITES``).

Each run executes in a child process of its own session
(``python -m conveyor.bench --child SPEC``): it trains, then evaluates its
policies with the protocols of ``conveyor.evaluate`` (``eval.json``). A run
that raises, crashes or outlives its timeout (its whole process group is
ended) is recorded as failed with a one-line error; a peer that is not
installed is recorded as skipped; the suite continues either way.

The results folder ``OUT`` holds ``results.csv`` (one row per run: its
summary and evaluation), ``results.md`` (the table), the plots of
``conveyor.plots`` and ``runs/<name>/`` (each run's own directory, with
``bench.log``). Results are rewritten after every run, so an interrupted
suite leaves what it finished.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from conveyor.config import AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg
from conveyor.envs import STEP_TIME_ID

FRAMEWORKS = ("conveyor", "sb3", "sample-factory")
# The algorithm each architecture runs in the suites (discrete actions / continuous actions).
ARCH_ALGOS = {"paac": "a2c", "ga3c": "ga3c", "seed": "vtrace", "impact": "impact", "hts": "a2c"}
ARCH_ALGOS_CONTINUOUS = {"paac": "ppo", "ga3c": "a2c", "seed": "vtrace", "impact": "impact", "hts": "ppo"}
START_AND_EVAL_GRACE_S = 240.0
"""Seconds a child gets beyond its training time limit, for start-up and evaluation."""
TERMINATE_GRACE_S = 30.0
"""Seconds a timed-out child gets to stop after SIGTERM before SIGKILL."""
EXIT_SKIPPED = 3
SPEC_FILE = "bench_spec.json"
OUTCOME_FILE = "outcome.json"


class PeerUnavailable(RuntimeError):
    """A peer framework that is not installed; the run is recorded as skipped."""


@dataclass(frozen=True)
class BenchRun:
    """One run of a suite: a config (for peers: the settings they match) and how many evaluation episodes."""

    name: str
    cfg: RunCfg
    framework: str = "conveyor"
    eval_episodes: int = 10
    """Evaluation episodes per policy; 0 skips evaluation (e.g. the step-time env, where only speed matters)."""
    algo_label: str = ""
    """The algorithm's name in tables when it is not ``cfg.algo.name`` (a peer's own name for it)."""

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise ConfigError(f"unknown framework {self.framework!r}: choose one of {', '.join(FRAMEWORKS)}")
        if not self.cfg.time_limit_s:
            raise ConfigError(f"bench run {self.name} needs a wall-time cap: set time_limit_s")

    @property
    def timeout_s(self) -> float:
        return self.cfg.time_limit_s + max(START_AND_EVAL_GRACE_S, 0.5 * self.cfg.time_limit_s)

    @property
    def arch_label(self) -> str:
        return self.cfg.arch.name if self.framework == "conveyor" else self.framework

    @property
    def label(self) -> str:
        return f"{self.arch_label}/{self.algo_label or self.cfg.algo.name} {self.cfg.env.id} s{self.cfg.seed}"


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    runs: tuple[BenchRun, ...]


@dataclass(frozen=True)
class EnvBudget:
    """An env of a suite with its budget: env steps, a wall-time cap, evaluation episodes, the model."""

    env: EnvCfg
    total_steps: int
    time_limit_s: float
    eval_episodes: int = 10
    model: ModelCfg = ModelCfg()


def run_name(framework: str, arch: str, algo: str, env_id: str, seed: int) -> str:
    who = arch if framework == "conveyor" else framework
    return f"{who}-{algo}-{env_id.replace('/', '_')}-s{seed}"


def bench_cfg(budget: EnvBudget, arch: ArchCfg, algo: AlgoCfg, seed: int, **fields: Any) -> RunCfg:
    """A fixed-budget run: never stops early on a return, and keeps 10 policies for evaluation."""
    return RunCfg(env=budget.env, model=budget.model, algo=algo, arch=arch, seed=seed,
                  total_steps=budget.total_steps, time_limit_s=budget.time_limit_s, target_return=math.inf,
                  checkpoint_every=max(1, budget.total_steps // 10), keep_checkpoints=10, progress=False, **fields)


def arch_matrix(archs: dict[str, str], budgets: Sequence[EnvBudget], seeds: Sequence[int],
                **fields: Any) -> tuple[BenchRun, ...]:
    """Every (env, architecture with its algorithm, seed), env by env."""
    return tuple(
        BenchRun(run_name("conveyor", arch, algo, budget.env.id, seed),
                 bench_cfg(budget, ArchCfg(name=arch), AlgoCfg(name=algo), seed, **fields),
                 eval_episodes=budget.eval_episodes)
        for budget in budgets for arch, algo in archs.items() for seed in seeds)


# ---- suites ------------------------------------------------------------------------------------
def quick_suite(seeds: Sequence[int] = (0,)) -> Suite:
    budgets = [
        EnvBudget(EnvCfg(id="CartPole-v1", num_envs=16, num_workers=2), total_steps=60_000, time_limit_s=30.0),
        EnvBudget(EnvCfg(id=STEP_TIME_ID, num_envs=16, num_workers=2,
                         env_args=(("dist", "exponential"), ("mean_ms", 1.0))),
                  total_steps=20_000, time_limit_s=25.0, eval_episodes=0),
    ]
    return Suite("quick", "all five architectures on CartPole-v1 (60k env steps, 30 s cap) and "
                 "conveyor/StepTime-v0 (exponential 1 ms steps; 20k env steps, 25 s cap); 16 envs, 2 env workers, "
                 "one learner thread", arch_matrix(ARCH_ALGOS, budgets, seeds, torch_threads=1, log_interval_s=1.0))


def atari_suite(seeds: Sequence[int] = (0,)) -> Suite:
    budgets = [EnvBudget(EnvCfg(id=env_id, num_envs=32, num_workers=8), total_steps=10_000_000,
                         time_limit_s=3 * 3600.0) for env_id in ("ALE/Pong-v5", "ALE/Breakout-v5")]
    return Suite("atari", "all five architectures on Pong and Breakout (10M env steps, 3 h cap; 32 envs, "
                 "8 env workers)", arch_matrix(ARCH_ALGOS, budgets, seeds, log_interval_s=10.0))


def mujoco_suite(seeds: Sequence[int] = (0,)) -> Suite:
    budgets = [EnvBudget(EnvCfg(id="HalfCheetah-v5", num_envs=16, num_workers=4), total_steps=1_000_000,
                         time_limit_s=3600.0)]
    return Suite("mujoco", "all five architectures on HalfCheetah-v5 with their continuous-action algorithms "
                 "(1M env steps, 1 h cap; 16 envs, 4 env workers)",
                 arch_matrix(ARCH_ALGOS_CONTINUOUS, budgets, seeds, log_interval_s=5.0))


def peers_suite(seeds: Sequence[int] = (0,)) -> Suite:
    env = EnvCfg(id="CartPole-v1", num_envs=8, num_workers=2)
    budget = EnvBudget(env, total_steps=100_000, time_limit_s=90.0, model=ModelCfg(hidden=(64, 64)))
    pairs = [  # (framework, arch settings, algorithm settings): each conveyor row with the peer doing the same
        ("conveyor", ArchCfg(name="paac", unroll=5), AlgoCfg(name="a2c")),
        ("sb3", ArchCfg(name="paac", unroll=5), AlgoCfg(name="a2c")),
        ("conveyor", ArchCfg(name="paac", unroll=32), AlgoCfg(name="ppo")),
        ("sb3", ArchCfg(name="paac", unroll=32), AlgoCfg(name="ppo")),
        # APPO = IMPACT without the target network, each batch used once.
        ("conveyor", ArchCfg(name="impact", replay_times=1, use_target_network=False), AlgoCfg(name="impact")),
        ("sample-factory", ArchCfg(name="impact", replay_times=1, use_target_network=False), AlgoCfg(name="impact")),
    ]
    runs = []
    for framework, arch, algo in pairs:
        algo_label = "appo" if framework == "sample-factory" else ""
        for seed in seeds:
            runs.append(BenchRun(run_name(framework, arch.name, algo_label or algo.name, env.id, seed),
                                 bench_cfg(budget, arch, algo, seed, torch_threads=1, log_interval_s=1.0),
                                 framework=framework, algo_label=algo_label))
    return Suite("peers", "conveyor vs stable-baselines3 A2C and PPO (and Sample Factory APPO where installed) on "
                 "CartPole-v1: same MLP (64, 64) with linear policy and value heads, 8 envs, same n-steps "
                 "(A2C 5, PPO 32), learning rates, optimizers, clipping and loss weights; 100k env steps, 90 s cap",
                 tuple(runs))


SUITES: dict[str, Callable[[Sequence[int]], Suite]] = {
    "quick": quick_suite, "atari": atari_suite, "mujoco": mujoco_suite, "peers": peers_suite,
}


# ---- running a suite ---------------------------------------------------------------------------
def run_suite(suite: Suite, out_dir: Path | str, *, log: Callable[[str], None] = print,
              markdown: Path | None = None) -> list[dict[str, Any]]:
    """Run every run of ``suite`` in turn; writes the results folder after each; returns the rows."""
    out = Path(out_dir)
    try:
        (out / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"bench output dir {out} is not writable ({error.strerror}): pass another --out") from None
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for index, run in enumerate(suite.runs, 1):
        log(f"[{index}/{len(suite.runs)}] {run.label} ...")
        row = execute(run, out / "runs" / run.name)
        rows.append(row)
        log(f"    {row_line(row)}")
        write_results(suite, out, rows, time.perf_counter() - started, markdown=None)
    elapsed = time.perf_counter() - started
    write_results(suite, out, rows, elapsed, markdown=markdown)
    counts = {status: sum(row["status"] == status for row in rows) for status in ("ok", "failed", "skipped")}
    log(f"suite {suite.name}: {counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped in "
        f"{elapsed:.0f}s; results in {out}")
    return rows


def execute(run: BenchRun, run_dir: Path) -> dict[str, Any]:
    """Run one ``BenchRun`` in a child process; returns its results row."""
    if run_dir.exists():
        if not (run_dir / SPEC_FILE).is_file():
            raise ConfigError(f"{run_dir} exists and is not a bench run: pass another --out")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cfg = dataclasses.replace(run.cfg, out=str(run_dir))
    spec = {"name": run.name, "framework": run.framework, "eval_episodes": run.eval_episodes,
            "config": cfg.to_dict()}
    (run_dir / SPEC_FILE).write_text(json.dumps(spec, indent=2, default=str))
    started = time.perf_counter()
    timed_out = False
    with open(run_dir / "bench.log", "w") as log_file:
        child = subprocess.Popen([sys.executable, "-m", "conveyor.bench", "--child", str(run_dir / SPEC_FILE)],
                                 stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        try:
            returncode = child.wait(timeout=run.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            returncode = stop_child(child)
        except BaseException:
            stop_child(child)
            raise
        finally:
            kill_process_group(child)
    status, error = outcome(run_dir, returncode, timed_out, run.timeout_s)
    return result_row(run, cfg, run_dir, status, error, time.perf_counter() - started)


def stop_child(child: subprocess.Popen) -> int:
    """SIGTERM to the child (its run stops, writes its summary and closes its workers); if it is still
    there after ``TERMINATE_GRACE_S``, SIGKILL to its whole process group."""
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    try:
        return child.wait(timeout=TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        kill_process_group(child)
    try:
        return child.wait(timeout=TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        return -signal.SIGKILL


def kill_process_group(child: subprocess.Popen) -> None:
    """SIGKILL whatever is left in the child's process group (e.g. workers of a run that crashed)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


def outcome(run_dir: Path, returncode: int, timed_out: bool, timeout_s: float) -> tuple[str, str]:
    """``(status, one-line error)`` of a finished child."""
    if timed_out:
        return "failed", f"timed out after {timeout_s:.0f}s (stopped; see {run_dir / 'bench.log'})"
    try:
        written = json.loads((run_dir / OUTCOME_FILE).read_text())
        return str(written["status"]), str(written.get("error", ""))
    except (OSError, ValueError, KeyError):
        pass
    if returncode == 0:
        return "ok", ""
    return "failed", f"{_exit_text(returncode)}: {last_line(run_dir / 'bench.log')}"


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1] if lines else "no output"


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# ---- results -----------------------------------------------------------------------------------
ROW_FIELDS = (
    "name", "framework", "arch", "algo", "env", "seed", "status", "error", "env_steps", "wall_time_s", "sps",
    "episodes", "updates", "return_mean_last100", "final_metric", "final_metric_policies", "final_time_limit_s",
    "final_time_metric", "required_time_target", "required_time_s", "lag_mean", "lag_max", "time_env", "time_act",
    "time_learn", "time_wait", "stop_reason", "param_sha256", "bench_wall_s", "run_dir",
)


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


def write_results(suite: Suite, out: Path, rows: list[dict[str, Any]], elapsed_s: float,
                  markdown: Path | None = None) -> None:
    from conveyor.plots import plot_runs

    add_final_time_metrics(rows)
    write_csv(out / "results.csv", rows, ROW_FIELDS)
    finished = [row for row in rows if (Path(row["run_dir"]) / "summary.json").is_file()]
    plots = plot_runs([row["run_dir"] for row in finished], out, labels=[row_label(row) for row in finished])
    (out / "results.md").write_text(markdown_report(suite, rows, elapsed_s, [p.name for p in plots]))
    if markdown is not None:
        prefix = os.path.relpath(out, markdown.parent)
        body = markdown_report(suite, rows, elapsed_s, [f"{prefix}/{p.name}" for p in plots])
        update_markdown_section(markdown, suite.name, body)


def write_csv(path: Path, rows: Sequence[dict[str, Any]], fields: Sequence[str] | None = None) -> None:
    """``rows`` as CSV; the columns are ``fields``, else every key any row has."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields or sorted({key for row in rows for key in row})))
        writer.writeheader()
        writer.writerows(rows)


def update_markdown_section(path: Path, section: str, body: str) -> None:
    """Set the marked ``section`` of the Markdown file at ``path`` (BENCHMARKS.md) to ``body``."""
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    path.write_text(replace_section(text, section, body))


def row_label(row: dict[str, Any]) -> str:
    return f"{row['arch']}/{row['algo']} s{row['seed']}"


def row_line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row['error']}"
    return (f"ok: {_num(row['env_steps'])} steps in {_num(row['wall_time_s'], 1)}s ({_num(row['sps'])} SPS), "
            f"return {_num(row['return_mean_last100'], 1)}, final metric {_num(row['final_metric'], 1)}, "
            f"lag {_num(row['lag_mean'], 2)}/{_num(row['lag_max'])}")


def _num(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{float(value):,.{digits}f}"


def _cell(text: str, limit: int = 140) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def markdown_report(suite: Suite, rows: Sequence[dict[str, Any]], elapsed_s: float, plots: Sequence[str]) -> str:
    """The suite's Markdown: how it ran, the table, what the columns mean, the plots."""
    import torch

    lines = [
        f"Suite `{suite.name}`: {suite.description}.",
        "",
        f"{len(rows)} runs in {elapsed_s:.0f} s on {os.cpu_count()} cores ({platform.machine()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}), {time.strftime('%Y-%m-%d')}; "
        f"`conveyor bench --suite {suite.name}`.",
        "",
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
    if plots:
        lines += ["", " ".join(f"![{Path(p).stem}]({p})" for p in plots)]
    return "\n".join(lines) + "\n"


def section_markers(suite_name: str) -> tuple[str, str]:
    return (f"<!-- conveyor bench --suite {suite_name}: start -->", f"<!-- conveyor bench --suite {suite_name}: end -->")


def replace_section(text: str, suite_name: str, body: str) -> str:
    """``text`` with the suite's marked section set to ``body`` (appended under a heading when absent)."""
    start, end = section_markers(suite_name)
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text and text.index(start) < text.index(end):
        return text[: text.index(start)] + block + text[text.index(end) + len(end):]
    return f"{text.rstrip()}\n\n### `{suite_name}`\n\n{block}\n".lstrip()


# ---- the child: one run -------------------------------------------------------------------------
def child_main(spec_path: Path) -> int:
    """Train and evaluate the run described by ``spec_path``; writes ``outcome.json`` beside it."""
    run_dir = spec_path.parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench parent decides when a run stops (SIGTERM)
    try:
        spec = json.loads(spec_path.read_text())
        cfg = RunCfg.from_dict(spec["config"])
        framework, episodes = spec["framework"], int(spec["eval_episodes"])
        if framework == "conveyor":
            from conveyor import train
            from conveyor.evaluate import evaluate_run

            train(cfg)
            if episodes:
                evaluate_run(run_dir, episodes=episodes)
        elif framework == "sb3":
            run_sb3(cfg, run_dir, episodes)
        else:
            run_sample_factory(cfg, run_dir, episodes)
    except PeerUnavailable as error:
        _write_outcome(run_dir, "skipped", str(error))
        print(f"skipped: {error}", file=sys.stderr)
        return EXIT_SKIPPED
    except BaseException as error:  # recorded as the run's one-line error; the traceback goes to bench.log
        import traceback

        traceback.print_exc()
        _write_outcome(run_dir, "failed", one_line(error))
        return 1
    _write_outcome(run_dir, "ok", "")
    return 0


def _write_outcome(run_dir: Path, status: str, error: str) -> None:
    (run_dir / OUTCOME_FILE).write_text(json.dumps({"status": status, "error": error}))


# ---- peers --------------------------------------------------------------------------------------
def run_sample_factory(cfg: RunCfg, run_dir: Path, eval_episodes: int) -> None:
    if importlib.util.find_spec("sample_factory") is None:
        raise PeerUnavailable("Sample Factory is not installed (pip install sample-factory)")
    raise PeerUnavailable("Sample Factory is installed, but conveyor has no APPO runner for it yet")


def run_sb3(cfg: RunCfg, run_dir: Path, eval_episodes: int) -> None:
    """Train stable-baselines3 A2C or PPO with ``cfg``'s env, model and hyperparameters; write the same
    files a conveyor run writes (summary.json, returns.csv, metrics.csv) and, with ``eval_episodes``, eval.json.

    The policy is conveyor's own encoder as SB3's shared features extractor with linear policy and value
    heads (SB3 ``net_arch`` empty), initialized as conveyor does (orthogonal; heads 0.01 and 1). Envs come
    from ``conveyor.envs.make_env``, stepped in-process (``DummyVecEnv``). Time split: ``env`` is vector-env
    stepping, ``act`` the policy forward while collecting, ``learn`` SB3's ``train()``. Lag is recorded as in
    PAAC (the acting version against the version at the start of each update): 0.
    """
    try:
        import stable_baselines3 as sb3
    except ImportError:
        raise PeerUnavailable("stable-baselines3 is not installed (pip install -e '.[bench]')") from None
    import torch
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
    from stable_baselines3.common.vec_env import DummyVecEnv, VecEnvWrapper

    from conveyor.envs import EPISODE_KEY, make_env
    from conveyor.evaluate import (EVAL_SEED_OFFSET, PolicyEval, default_target, eval_result, evaluate_agents,
                                   make_eval_envs, write_eval)
    from conveyor.learner import learning_rate, make_optimizer, param_sha256
    from conveyor.models import make_model
    from conveyor.run import prepare_out_dir, seed_everything
    from conveyor.telemetry import Telemetry

    if cfg.algo.name not in ("a2c", "ppo"):
        raise ConfigError(f"the stable-baselines3 peer runs a2c or ppo, not {cfg.algo.name}")
    out = prepare_out_dir(cfg)
    (out / "config.json").write_text(cfg.to_json())
    seed_everything(cfg.seed)
    torch.set_num_threads(cfg.torch_threads or max(1, os.cpu_count() or 1))
    telemetry = Telemetry(out, log_interval_s=cfg.log_interval_s, progress=False, total_steps=cfg.total_steps)
    env_fns = [lambda i=i: make_env(cfg.env, cfg.seed + i) for i in range(cfg.env.num_envs)]
    probe = env_fns[0]()
    reference = make_model(cfg.model, probe.observation_space, probe.action_space)
    probe.close()
    features = reference.value_head.in_features

    class ConveyorEncoder(BaseFeaturesExtractor):
        """conveyor's encoder for this env and model config (a fresh copy per SB3 policy)."""

        def __init__(self, observation_space: Any) -> None:
            super().__init__(observation_space, features)
            self.encoder = copy.deepcopy(reference.encoder)

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return self.encoder(obs.float())

    class TimedVecEnv(VecEnvWrapper):
        def reset(self) -> Any:
            return self.venv.reset()

        def step_wait(self) -> Any:
            with telemetry.timer("env"):
                return self.venv.step_wait()

    def conveyor_optimizer(params: Any, lr: float, **_: Any) -> torch.optim.Optimizer:
        return make_optimizer(params, cfg)  # the learner's own optimizer and settings; lr is the same

    algo = cfg.algo
    policy_kwargs: dict[str, Any] = {"features_extractor_class": ConveyorEncoder, "net_arch": {"pi": [], "vf": []},
                                     "optimizer_class": conveyor_optimizer}
    if not reference.policy.discrete:
        policy_kwargs["log_std_init"] = float(reference.log_std.detach()[0])
    common = {"learning_rate": learning_rate(cfg), "n_steps": cfg.arch.unroll, "gamma": algo.gamma,
              "ent_coef": algo.entropy_coef, "vf_coef": algo.value_coef,
              "max_grad_norm": algo.max_grad_norm or math.inf, "policy_kwargs": policy_kwargs, "seed": cfg.seed,
              "device": "cpu", "verbose": 0}
    venv = TimedVecEnv(DummyVecEnv(env_fns))
    if algo.name == "a2c":
        model = sb3.A2C("MlpPolicy", venv, gae_lambda=1.0, normalize_advantage=False, **common)
        updates_per_train = 1
    else:
        samples = cfg.arch.unroll * cfg.env.num_envs
        batch_size = samples // algo.ppo_minibatches
        model = sb3.PPO("MlpPolicy", venv, batch_size=batch_size, n_epochs=algo.ppo_epochs,
                        gae_lambda=algo.gae_lambda, clip_range=algo.clip,
                        normalize_advantage=algo.normalize_advantages, **common)
        updates_per_train = algo.ppo_epochs * math.ceil(samples / batch_size)

    version = 0
    snapshots: list[tuple[PolicyEval, dict[str, torch.Tensor]]] = []
    next_snapshot = cfg.checkpoint_every
    stop_reason = "total_steps reached"
    sb3_train, policy_forward = model.train, model.policy.forward

    def timed_train() -> None:
        nonlocal version
        samples = cfg.arch.unroll * cfg.env.num_envs
        telemetry.add_lag(version, np.full(samples, version))
        with telemetry.timer("learn"):
            sb3_train()
        version += updates_per_train
        telemetry.add_update({})

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        with telemetry.timer("act"):
            return policy_forward(*args, **kwargs)

    def snapshot() -> None:
        policy = PolicyEval(f"snapshot-{telemetry.env_steps:012d}", telemetry.env_steps, telemetry.wall_time_s,
                            version, ())
        state = {k: v.detach().clone() for k, v in model.policy.state_dict().items()}
        snapshots.append((policy, state))
        del snapshots[: max(0, len(snapshots) - cfg.keep_checkpoints)]

    class Recorder(BaseCallback):
        def _on_step(self) -> bool:
            nonlocal next_snapshot, stop_reason
            telemetry.add_steps(cfg.env.num_envs)
            telemetry.add_episodes(np.array([info[EPISODE_KEY]["r"] if EPISODE_KEY in info else np.nan
                                             for info in self.locals["infos"]], dtype=np.float64))
            telemetry.maybe_log()
            if cfg.checkpoint_every and telemetry.env_steps >= next_snapshot:
                snapshot()
                next_snapshot += cfg.checkpoint_every
            if cfg.time_limit_s and telemetry.wall_time_s >= cfg.time_limit_s:
                stop_reason = "time_limit_s reached"
                return False
            return True

    model.train = timed_train  # type: ignore[method-assign]
    model.policy.forward = timed_forward  # type: ignore[method-assign]
    try:
        model.learn(total_timesteps=cfg.total_steps, callback=Recorder())
    finally:
        venv.close()
    if not snapshots or snapshots[-1][0].env_steps != telemetry.env_steps:
        snapshot()
    telemetry.maybe_log(force=True)
    summary = telemetry.summary(arch="sb3", algo=algo.name, env=cfg.env.id, seed=cfg.seed,
                                param_sha256=param_sha256(model.policy), learner_version=version,
                                stop_reason=stop_reason, out=str(out), framework="stable-baselines3",
                                framework_version=sb3.__version__)
    telemetry.write_summary(summary)
    telemetry.close()
    if not eval_episodes:
        return
    model.policy.forward = policy_forward  # type: ignore[method-assign]

    class SB3Agent:
        def reset(self, num_envs: int, seed: int) -> None:
            torch.manual_seed(seed)

        def act(self, obs: np.ndarray, prev_reward: np.ndarray) -> np.ndarray:
            return model.policy.predict(obs, deterministic=False)[0]

    seed = EVAL_SEED_OFFSET + cfg.seed
    envs = make_eval_envs(cfg, eval_episodes, noop_max=30, seed=seed)
    try:
        evaluated: list[PolicyEval] = []
        for policy, state in snapshots:
            model.policy.load_state_dict(state)
            evaluated += evaluate_agents([(policy, SB3Agent())], envs, seed)
    finally:
        for env in envs:
            env.close()
    write_eval(out, eval_result(out, cfg.env.id, evaluated, episodes=eval_episodes, noop_max=30, window=10,
                                seed=seed, time_limit_s=None, target=default_target(cfg)))


# ---- `conveyor bench` ----------------------------------------------------------------------------
def _parse_seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds wants comma-separated integers, got {text!r}") from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"--seeds wants non-negative integers, got {text!r}")
    return seeds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", required=True, choices=sorted(SUITES), help="which suite to run")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: bench-results/SUITE)")
    parser.add_argument("--seeds", type=_parse_seeds, default=(0,), metavar="N,N", help="seeds (default: 0)")
    parser.add_argument("--only", default="", metavar="TEXT,TEXT",
                        help="run only the runs whose name contains one of these (e.g. paac,hts)")
    parser.add_argument("--device", default=None, help="torch device of the conveyor learners (default: cpu)")
    parser.add_argument("--markdown", type=Path, default=None, metavar="FILE",
                        help="also set this suite's section of FILE (e.g. BENCHMARKS.md) to the results")
    parser.add_argument("--list", action="store_true", help="print the suite's runs and exit")


def select_suite(args: argparse.Namespace) -> Suite:
    suite = SUITES[args.suite](args.seeds)
    runs = suite.runs
    if args.only:
        wanted = [part.strip() for part in args.only.split(",") if part.strip()]
        runs = tuple(run for run in runs if any(part in run.name for part in wanted))
        if not runs:
            raise ConfigError(f"--only {args.only!r} matches no run of suite {args.suite}: see --list")
    if args.device:
        runs = tuple(dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, device=args.device)) for run in runs)
    return dataclasses.replace(suite, runs=runs)


def main(args: argparse.Namespace) -> int:
    suite = select_suite(args)
    if args.list:
        for run in suite.runs:
            print(f"{run.name}: {run.label}, {run.cfg.total_steps:,} env steps, {run.cfg.time_limit_s:.0f} s cap, "
                  f"{run.eval_episodes} evaluation episodes per policy")
        return 0
    out = args.out or Path("bench-results") / suite.name
    try:
        run_suite(suite, out, markdown=args.markdown)
    except KeyboardInterrupt:  # the running child was already stopped; finished runs are in the results
        print(f"interrupted: results of the finished runs are in {out}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(child_main(Path(sys.argv[2])))
    sys.exit("usage: python -m conveyor.bench --child SPEC (internal; use `conveyor bench`)")
