"""IMPACT vs its APPO and IMPALA presets and vs synchronous PPO; IMPACT with K in {1, 2, 4} (paper fig. 4).

Runs, one after another (each in its own process, through ``conveyor.bench.run_suite``), on CartPole-v1
and HalfCheetah-v5 with the same envs, workers, model and wall-time budget (30 s and 45 s):

- ``impact K=4``: ``--arch impact --preset impact`` (circular buffer N=4, K=4, target network every N*K updates);
- ``appo``:   ``--arch impact --preset appo`` (K=1, no target network);
- ``impala``: ``--arch impact --preset impala`` (K=1, no target network, V-trace loss);
- ``ppo``:    ``--arch paac --algo ppo`` (synchronous; rollouts of the same length as a worker batch);
- ``impact K=1`` and ``impact K=2`` on CartPole (K=4 is the main ``impact`` row).

Every run of an env uses the same loss settings (``ALGO_SETTINGS``); each algorithm keeps its own
optimizer. The table compares the runs of an env at the same env steps (the fewest any of them took in
its time) and at the same wall time (the shortest run), from each run's ``returns.csv``: the mean return
of the last 100 episodes finished by then; and when that mean first reached ``TARGETS``. Writes
``results.csv``, ``table.md`` and plots (return vs steps and vs time, SPS, lag) under
``benchmarks/results/impact_compare/`` and the ``impact-compare`` section of ``docs/benchmarks-log.md``.

    .venv/bin/python benchmarks/impact_compare.py              # about 6 minutes on 2 cores
    .venv/bin/python benchmarks/impact_compare.py --scale 0.5  # a smoke run
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.bench import run_suite, update_markdown_section, write_csv
from conveyor.bench.suites import BenchRun, EnvBudget, Suite, bench_cfg, run_name
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg
from conveyor.plots import load_run, plot_runs, trailing_mean

ROOT = Path(__file__).resolve().parent.parent
SECTION = "impact-compare"
WORKER_BATCH = 32


def budgets(scale: float) -> dict[str, EnvBudget]:
    """Every run of an env trains for the same wall time (start-up included); the step cap is never reached."""
    model, steps = ModelCfg(hidden=(64, 64)), 100_000_000
    return {
        "CartPole-v1": EnvBudget(EnvCfg(id="CartPole-v1", num_envs=8, num_workers=2), total_steps=steps,
                                 time_limit_s=30.0 * scale, eval_episodes=0, model=model),
        "HalfCheetah-v5": EnvBudget(EnvCfg(id="HalfCheetah-v5", num_envs=8, num_workers=2), total_steps=steps,
                                    time_limit_s=45.0 * scale, eval_episodes=0, model=model),
    }


# The same loss settings for every run of an env: rl-zoo's PPO settings for CartPole (lr 1e-3, gamma 0.98,
# lambda 0.8); for MuJoCo the usual PPO ones (lr 3e-4, no entropy bonus, gradient norm clip 0.5).
ALGO_SETTINGS = {
    "CartPole-v1": dict(lr=1e-3, gamma=0.98, gae_lambda=0.8),
    "HalfCheetah-v5": dict(lr=3e-4, entropy_coef=0.0, max_grad_norm=0.5),
}
TARGETS = {"CartPole-v1": 450.0, "HalfCheetah-v5": 0.0}
"""Return whose first crossing (mean of the last 100 episodes) the table reports, in env steps and seconds."""
MAIN_K = 4
"""K of the ``impact`` rows; CartPole adds K=1 and K=2 (paper fig. 4)."""


def variants(env_id: str) -> list[tuple[str, ArchCfg, AlgoCfg]]:
    """(label, arch, algo) of each run on ``env_id``."""
    continuous = env_id != "CartPole-v1"
    algo = ALGO_SETTINGS[env_id]
    impact = dict(name="impact", worker_batch=WORKER_BATCH, buffer_batches=4)
    rows = [
        (f"impact K={MAIN_K}", ArchCfg(**impact, preset="impact", replay_times=MAIN_K), AlgoCfg(name="impact", **algo)),
        ("appo", ArchCfg(**impact, preset="appo"), AlgoCfg(name="impact", **algo)),
        ("impala", ArchCfg(**impact, preset="impala"), AlgoCfg(name="vtrace", **algo)),
        ("ppo", ArchCfg(name="paac", unroll=WORKER_BATCH), AlgoCfg(name="ppo", **algo)),
    ]
    if not continuous:
        rows += [(f"impact K={k}", ArchCfg(**impact, preset="impact", replay_times=k), AlgoCfg(name="impact", **algo))
                 for k in (1, 2)]
    return rows


def make_suite(scale: float, seeds: list[int]) -> Suite:
    runs = []
    for env_id, budget in budgets(scale).items():
        for label, arch, algo in variants(env_id):
            for seed in seeds:
                cfg = bench_cfg(budget, arch, algo, seed, torch_threads=1, log_interval_s=2.0)
                name = run_name("conveyor", arch.name, label.replace(" ", "").replace("=", ""), env_id, seed)
                runs.append(BenchRun(name, cfg, eval_episodes=0, algo_label=label))
    return Suite(SECTION, "IMPACT vs APPO, IMPALA and synchronous PPO", tuple(runs))


def return_by(curve: np.ndarray, column: int, limit: float) -> float:
    """Mean return of the last 100 episodes finished when ``curve[:, column]`` (steps or seconds) <= ``limit``."""
    done = curve[curve[:, column] <= limit]
    return float(np.mean(done[-100:, 2])) if len(done) else math.nan


def first_reach(curve: np.ndarray, target: float) -> tuple[float, float]:
    """(env steps, seconds) when the mean of the last 100 episodes first reached ``target``; NaN if never."""
    reached = np.flatnonzero(trailing_mean(curve[:, 2]) >= target) if len(curve) else []
    return (float(curve[reached[0], 0]), float(curve[reached[0], 1])) if len(reached) else (math.nan, math.nan)


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: return at the env's common step budget and at its common wall time (NaN for failed runs)."""
    table = []
    for env_id in dict.fromkeys(row["env"] for row in rows):
        runs = [(row, load_run(row["run_dir"]) if row["status"] == "ok" else None)
                for row in rows if row["env"] == env_id]
        finished = [(row, data) for row, data in runs if data is not None and len(data.curve)]
        steps = min((float(row["env_steps"]) for row, _ in finished), default=math.nan)
        seconds = min((float(row["wall_time_s"]) for row, _ in finished), default=math.nan)
        for row, data in runs:
            curve = data.curve if data is not None else np.zeros((0, 3))
            reach_steps, reach_s = first_reach(curve, TARGETS[env_id])
            table.append({
                "env": env_id, "run": row["algo"], "seed": row["seed"], "status": row["status"],
                "error": row["error"], "env_steps": row["env_steps"], "wall_time_s": row["wall_time_s"],
                "sps": row["sps"], "updates": row["updates"], "lag_mean": row["lag_mean"],
                "common_steps": steps, "return_at_steps": return_by(curve, 0, steps),
                "common_time_s": seconds, "return_at_time": return_by(curve, 1, seconds),
                "target": TARGETS[env_id], "target_steps": reach_steps, "target_s": reach_s,
            })
    return table


def _num(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{float(value):,.{digits}f}"


def markdown(table: list[dict[str, Any]], command: str, elapsed_s: float, plots: list[str]) -> str:
    import torch

    lines = [
        f"`{command}` — {platform.machine()} with {os.cpu_count()} CPU cores (shared), Python "
        f"{platform.python_version()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
        f"{elapsed_s:.0f} s in all.",
        "",
        "8 envs stepped by 2 workers, MLP (64, 64), one learner thread; IMPACT rows: worker batch 32 steps x 4 envs, "
        "buffer N=4, target network every N*K updates; PPO: `--arch paac --algo ppo`, 32-step rollouts, 4 epochs x "
        "4 minibatches. Each run trains for the same wall time (start-up included). Return = mean of the last "
        "100 training episodes finished by the given env steps (the fewest any run of the env took) or wall time "
        "(the shortest run's); target reached at: when that mean first reached the target (`-`: never).",
        "",
        "| env | run | seed | env steps | wall s | SPS | updates | lag mean | return @ steps | return @ time "
        "| target reached at |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        run = r["run"] if r["status"] == "ok" else f"{r['run']} ({r['status']}: {r['error'][:80]})"
        lines.append(
            f"| {r['env']} | {run} | {r['seed']} | {_num(r['env_steps'])} | {_num(r['wall_time_s'], 1)} "
            f"| {_num(r['sps'])} | {_num(r['updates'])} | {_num(r['lag_mean'], 2)} "
            f"| {_num(r['return_at_steps'], 1)} @ {_num(r['common_steps'])} "
            f"| {_num(r['return_at_time'], 1)} @ {_num(r['common_time_s'])} s "
            f"| {_num(r['target'])}: {_num(r['target_steps'])} steps, {_num(r['target_s'], 1)} s |")
    lines += ["", " ".join(f"![{Path(p).stem}]({p})" for p in plots)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every budget (steps and seconds)")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    parser.add_argument("--work", type=Path, default=ROOT / "bench-results" / SECTION, help="run directories")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "impact_compare")
    parser.add_argument("--markdown", type=Path, default=ROOT / "docs/benchmarks-log.md")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = run_suite(make_suite(args.scale, args.seeds), args.work)
    table = compare(rows)
    if args.results.exists():
        shutil.rmtree(args.results)
    args.results.mkdir(parents=True)
    plots = plot_runs([row["run_dir"] for row in rows], args.results,
                      labels=[f"{row['algo']} s{row['seed']}" for row in rows])
    write_csv(args.results / "results.csv", table, list(table[0]) if table else ["env"])
    command = "python benchmarks/impact_compare.py" + (f" --scale {args.scale:g}" if args.scale != 1 else "")
    prefix = os.path.relpath(args.results, args.markdown.parent)
    body = markdown(table, command, time.perf_counter() - started, [f"{prefix}/{p.name}" for p in plots])
    (args.results / "table.md").write_text(markdown(table, command, time.perf_counter() - started,
                                                    [p.name for p in plots]))
    update_markdown_section(args.markdown, SECTION, body)
    print(body)


if __name__ == "__main__":
    main()
