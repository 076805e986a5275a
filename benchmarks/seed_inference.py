"""SEED central inference: latency and SPS vs actors and envs per actor, TCP loopback vs a unix socket.

Each configuration is one ``conveyor train --arch seed --algo vtrace`` run of a fixed wall time with
``--local-actors A --num-envs E`` (one env worker process per actor), training as in a real run, on
CartPole-v1 (MLP) and Pong (Nature CNN, 4x84x84 uint8 frames). Reported per run:

- SPS: env steps per second in steady state (from ``metrics.csv``, after the actors' start-up);
- latency p50/p99: what an actor waits for its actions, send to reply, network included (the
  end-to-end inference latency of the SEED paper's table 13), as the actors report it;
- server p50: the part of it spent inside the learner (queued for a batch plus the forward pass);
- batch: mean env rows per inference forward pass; lag: mean policy lag of the trained steps.

The table goes to the ``seed-inference`` section of ``docs/benchmarks-log.md`` and to
``benchmarks/results/seed_inference.csv``.

    .venv/bin/python benchmarks/seed_inference.py              # about 4 minutes on 2 cores
    .venv/bin/python benchmarks/seed_inference.py --seconds 4  # a smoke run
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
SECTION = "seed-inference"
STARTUP_S = 10.0  # actors import, build their envs and connect before the measured interval


class Config(NamedTuple):
    env: str
    transport: str  # "tcp" (localhost loopback) or "unix"
    actors: int
    envs_per_actor: int


CONFIGS = [
    Config("CartPole-v1", "tcp", 1, 1),
    Config("CartPole-v1", "tcp", 1, 8),
    Config("CartPole-v1", "tcp", 2, 8),
    Config("CartPole-v1", "tcp", 4, 8),
    Config("CartPole-v1", "tcp", 2, 32),
    Config("CartPole-v1", "unix", 1, 1),
    Config("CartPole-v1", "unix", 2, 8),
    Config("CartPole-v1", "unix", 4, 8),
    Config("ALE/Pong-v5", "tcp", 1, 4),
    Config("ALE/Pong-v5", "tcp", 2, 4),
    Config("ALE/Pong-v5", "unix", 2, 4),
]


def run_config(config: Config, seconds: float, out: Path, socket_dir: Path) -> dict[str, Any]:
    name = f"{config.env.replace('/', '_')}-{config.transport}-a{config.actors}-e{config.envs_per_actor}"
    run_dir = out / name
    listen = f"unix:{socket_dir}/{name}.sock" if config.transport == "unix" else "localhost:0"
    command = [sys.executable, "-m", "conveyor.cli", "train", "--arch", "seed", "--algo", "vtrace",
               "--env", config.env, "--local-actors", str(config.actors), "--num-envs", str(config.envs_per_actor),
               "--num-workers", "1", "--listen", listen, "--inference-batch", "64", "--unroll", "20",
               "--batch-size", "8", "--target-return", "inf", "--total-steps", str(10**9),
               "--time-limit-s", str(STARTUP_S + seconds), "--log-interval-s", "1", "--no-progress",
               "--torch-threads", "1", "--out", str(run_dir)]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=STARTUP_S + seconds + 120)
    row: dict[str, Any] = {**config._asdict(), "wall_s": time.perf_counter() - started}
    if proc.returncode != 0:
        row["error"] = (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]
        return row
    summary = json.loads((run_dir / "summary.json").read_text())
    inference = summary["inference"]
    row.update(sps=steady_sps(run_dir / "metrics.csv"),
               latency_p50_ms=inference["inference_latency_ms"]["p50"],
               latency_p99_ms=inference["inference_latency_ms"]["p99"],
               server_p50_ms=inference["server_latency_ms"]["p50"],
               batch_mean=inference["inference_batch"]["mean"],
               lag_mean=summary["policy_lag"]["mean"], updates=summary["updates"])
    return row


def steady_sps(metrics_csv: Path) -> float:
    """Env steps per second from the second log row with steps to the last (skips the start-up)."""
    rows = [row for row in csv.DictReader(metrics_csv.open()) if row.get("env_steps", "").isdigit()]
    rows = [row for row in rows if int(row["env_steps"]) > 0]
    if len(rows) < 3:
        return float("nan")
    first, last = rows[1], rows[-1]
    steps = int(last["env_steps"]) - int(first["env_steps"])
    return steps / (float(last["wall_time_s"]) - float(first["wall_time_s"]))


def markdown(rows: list[dict[str, Any]], command: str, seconds: float, load: float) -> str:
    def num(value: Any, digits: int) -> str:
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"

    lines = [
        f"Command: `{command}` ({seconds:.0f} s measured per row after {STARTUP_S:.0f} s of start-up; "
        "training runs as usual).",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (load average about "
        f"{load:.0f} during the runs, so expect noise), Python {platform.python_version()}, {platform.system()} {platform.release()}; "
        f"date: {time.strftime('%Y-%m-%d')}.",
        "",
        "| env | transport | actors | envs/actor | SPS | latency p50 ms | latency p99 ms | server p50 ms "
        "| batch | lag |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['env']} | {row['transport']} | {row['actors']} | {row['envs_per_actor']} | "
                         f"failed: {row['error'][:120]} ||||||")
            continue
        lines.append(f"| {row['env']} | {row['transport']} | {row['actors']} | {row['envs_per_actor']} | "
                     f"{num(row['sps'], 0)} | {num(row['latency_p50_ms'], 2)} | {num(row['latency_p99_ms'], 2)} | "
                     f"{num(row['server_p50_ms'], 2)} | {num(row['batch_mean'], 1)} | {num(row['lag_mean'], 2)} |")
    lines += [
        "",
        "SPS: env steps/s in steady state. Latency: what an actor waits for its actions, send to reply, network "
        "included (SEED table 13); server: the part of it inside the learner (waiting for a batch plus the "
        "forward pass). Batch: env rows per inference forward pass. Lag: mean policy lag of the trained steps.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="measured seconds per configuration")
    parser.add_argument("--out", default="runs/bench-seed-inference", help="run directories")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite the docs/benchmarks-log.md section")
    args = parser.parse_args()
    from conveyor.bench import publish_results

    out = Path(args.out)
    rows, loads = [], []
    with tempfile.TemporaryDirectory(prefix="seedb-") as socket_dir:
        for config in CONFIGS:
            row = run_config(config, args.seconds, out, Path(socket_dir))
            rows.append(row)
            loads.append(os.getloadavg()[0])
            print(json.dumps(row), flush=True)
    command = "benchmarks/seed_inference.py" + (f" --seconds {args.seconds:g}" if args.seconds != 12.0 else "")
    table = markdown(rows, command, args.seconds, sum(loads) / len(loads))
    publish_results(ROOT, SECTION, rows, table, markdown=not args.no_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
