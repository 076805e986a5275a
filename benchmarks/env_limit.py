"""Every architecture against the env limit: training SPS on Pong as a fraction of raw env stepping.

The env limit is what the same envs give with nothing else to do: ``make_vector_env`` with the run's
preprocessing (Atari: no-op starts, frame skip 4, 84x84 grayscale, frame stack 4) stepped with uniformly random
actions by the same number of env worker processes. Each architecture then trains A2C-family defaults (Nature
CNN) for a fixed wall time on the same 16 envs and 2 env processes where it has them:

- paac, hts, impact: ``--num-envs 16 --num-workers 2``;
- seed: 2 local actors x 8 envs, one env worker each (``--local-actors 2 --num-envs 8 --num-workers 1``);
- ga3c: 16 agents (``--num-agents 16``): an agent process steps its one env itself, so it has 16 env processes.

``--envs N --workers W`` change that layout the same way for every architecture (SEED: W actors x N / W
envs), and ``--device cuda`` puts every learner (and SEED's inference) on the GPU.

Runs alternate (limit, paac, ga3c, seed, impact, hts, limit, ...) ``--repeats`` times; the table shows medians
and each architecture's SPS / limit. Issue 19's bar: >= 0.7 for the asynchronous ones on a CPU. The table goes
to the ``--section`` (default ``env-limit``) of ``docs/benchmarks-log.md`` and ``benchmarks/results/<section>.csv``.

    .venv/bin/python benchmarks/env_limit.py                 # about 8 minutes
    .venv/bin/python benchmarks/env_limit.py --seconds 5 --repeats 1 --no-markdown   # a smoke run
    python benchmarks/env_limit.py --device cuda --envs 64 --workers 16 --section env-limit-cuda-64   # GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from seed_inference import steady_sps  # benchmarks/ is on sys.path when this script runs

ROOT = Path(__file__).resolve().parent.parent
SECTION = "env-limit"
ENV = "ALE/Pong-v5"
ARCHS = ("paac", "ga3c", "seed", "impact", "hts")


def arch_flags(arch: str, envs: int, workers: int) -> list[str]:
    """The env layout flags that give ``arch`` ``envs`` envs over ``workers`` env processes (GA3C: one each)."""
    if arch == "ga3c":
        return ["--num-agents", str(envs)]
    if arch == "seed":
        return ["--local-actors", str(workers), "--num-envs", str(envs // workers), "--num-workers", "1"]
    return ["--num-envs", str(envs), "--num-workers", str(workers)]


def env_limit_sps(seconds: float, envs: int, workers: int) -> float:
    """Env steps per second of the run's vector env stepped with random actions (after a warm-up second)."""
    from conveyor.config import EnvCfg
    from conveyor.envs import make_vector_env

    venv = make_vector_env(EnvCfg(id=ENV, num_envs=envs, num_workers=workers), seed=0)
    try:
        rng = np.random.default_rng(0)
        actions = venv.single_action_space.n
        venv.reset()
        steps, start, warm = 0, time.perf_counter(), None
        while time.perf_counter() - start < seconds + 1.0:
            venv.step(rng.integers(0, actions, size=envs))
            if warm is None and time.perf_counter() - start >= 1.0:
                warm, steps = time.perf_counter(), 0
            steps += envs
        return steps / (time.perf_counter() - warm)
    finally:
        venv.close()


def train_sps(arch: str, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(args.out) / f"{arch}-{time.monotonic_ns()}"
    budget_s = args.startup_s + args.seconds
    command = [sys.executable, "-m", "conveyor", "train", "--arch", arch, "--env", ENV,
               *arch_flags(arch, args.envs, args.workers), "--device", args.device,
               "--target-return", "inf", "--total-steps", str(10**9), "--time-limit-s", str(budget_s),
               "--log-interval-s", "1", "--no-progress", "--out", str(run_dir), *args.train_flags.split()]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=budget_s + 300)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"sps": steady_sps(run_dir / "metrics.csv"), "split": summary["time_split_fraction"]}


def markdown(rows: list[dict[str, Any]], command: str, args: argparse.Namespace, load: float) -> str:
    from conveyor.bench import device_name

    def num(value: Any, digits: int) -> str:
        return "-" if not isinstance(value, (int, float)) or value != value else f"{value:,.{digits}f}"

    limit = next(row["sps"] for row in rows if row["what"] == "env limit")
    lines = [
        f"Command: `{command}` ({args.seconds:.0f} s measured per run; training runs after {args.startup_s:.0f} s "
        f"of start-up, default flags plus the env layout below; medians of alternating runs). {ENV}, Nature CNN, "
        f"learners on {device_name(args.device)}.",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (load average about {load:.0f} during the runs), "
        f"Python {platform.python_version()}, torch {__import__('torch').__version__}; date: "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        "| what | envs / env processes | SPS | SPS / env limit | time split env/act/learn/wait % |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['what']} | {row['layout']} | failed: {row['error'][:100]} |||")
            continue
        split = row.get("split")
        split_text = "/".join(f"{100 * split.get(bucket, 0):.0f}" for bucket in ("env", "act", "learn", "wait")) \
            if split else "-"
        lines.append(f"| {row['what']} | {row['layout']} | {num(row['sps'], 0)} | {num(row['sps'] / limit, 2)} | "
                     f"{split_text} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--envs", type=int, default=16, help="envs of every run")
    parser.add_argument("--workers", type=int, default=2, help="env processes (SEED: local actors) of every run")
    parser.add_argument("--device", default="cpu", help="every learner's device (cpu, cuda)")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds per run")
    parser.add_argument("--train-flags", default="", help="more flags for every training run, e.g. '--env-groups 2'")
    parser.add_argument("--startup-s", type=float, default=15.0, help="seconds each training run gets to start")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="runs/bench-env-limit", help="run directories")
    parser.add_argument("--section", default=SECTION, help="docs/benchmarks-log.md section and results/<section>.csv")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite the docs/benchmarks-log.md section")
    args = parser.parse_args()
    if args.envs % args.workers:
        parser.error(f"--envs {args.envs} must be a multiple of --workers {args.workers}")
    from conveyor.bench import publish_results

    archs = args.archs.split(",")
    samples: dict[str, list[dict[str, Any]]] = {"env limit": [], **{arch: [] for arch in archs}}
    loads = []
    for _ in range(args.repeats):
        samples["env limit"].append({"sps": env_limit_sps(args.seconds, args.envs, args.workers)})
        for arch in archs:
            samples[arch].append(train_sps(arch, args))
            loads.append(os.getloadavg()[0])
            print(json.dumps({"what": arch, **samples[arch][-1]}), flush=True)
    rows = []
    for what, runs in samples.items():
        layout = f"{args.envs} / {args.envs if what == 'ga3c' else args.workers}"
        good = [run for run in runs if "error" not in run]
        if not good:
            rows.append({"what": what, "layout": layout, **runs[-1]})
            continue
        middle = sorted(good, key=lambda run: run["sps"])[len(good) // 2]
        rows.append({"what": what, "layout": layout, "sps": statistics.median(run["sps"] for run in good),
                     "split": middle.get("split")})
    command = " ".join(["benchmarks/env_limit.py", *sys.argv[1:]])
    publish_results(ROOT, args.section, [{k: v for k, v in row.items() if k != "split"} for row in rows],
                    markdown(rows, command, args, sum(loads) / max(1, len(loads))),
                    markdown=not args.no_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
