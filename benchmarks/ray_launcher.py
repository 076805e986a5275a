"""Ray actors vs child processes: the same SEED and IMPACT runs with ``--launcher ray`` and ``--launcher process``.

Each row is one ``conveyor train`` of a fixed wall time with default flags (plus ``--launcher``), on one host:
``--launcher ray`` starts a private local Ray (``--ray-address local``), so its start-up includes Ray's own.
Runs alternate launcher by launcher, ``--repeats`` times; the table shows medians. Reported:

- start-up s: from starting ``conveyor train`` to the first logged env step (imports, Ray, actors, envs);
- SPS: env steps per second in steady state (``metrics.csv``, after start-up);
- SEED: inference latency p50/p99 (an actor's request to its reply, ``summary.json``);
- IMPACT: policy lag mean (Ray workers act with the weights published when their call was made).

The table goes to the ``ray-launcher`` section of ``docs/benchmarks-log.md`` and ``benchmarks/results/ray-launcher.csv``.

    .venv/bin/python benchmarks/ray_launcher.py                   # about 6 minutes
    .venv/bin/python benchmarks/ray_launcher.py --seconds 5 --repeats 1 --no-markdown   # a smoke run
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from seed_inference import steady_sps  # benchmarks/ is on sys.path when this script runs

ROOT = Path(__file__).resolve().parent.parent
SECTION = "ray-launcher"
LAUNCHERS = ("process", "ray")


def first_step_s(metrics_csv: Path) -> float | None:
    """``wall_time_s`` of the first logged row with env steps, or None yet."""
    try:
        for row in csv.DictReader(metrics_csv.open()):
            if row.get("env_steps", "").isdigit() and int(row["env_steps"]) > 0:
                return float(row["wall_time_s"])
    except (OSError, ValueError):
        return None
    return None


def run_one(arch: str, env: str, launcher: str, seconds: float, out: Path) -> dict[str, Any]:
    run_dir = out / f"{arch}-{env.replace('/', '_')}-{launcher}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "conveyor", "train", "--arch", arch, "--env", env, "--launcher", launcher,
               "--target-return", "inf", "--total-steps", str(10**9), "--log-interval-s", "1", "--no-progress",
               "--out", str(run_dir)]
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    startup = None
    while proc.poll() is None and startup is None and time.monotonic() - started < 180:
        if first_step_s(run_dir / "metrics.csv") is not None:
            startup = time.monotonic() - started
        time.sleep(0.1)
    time.sleep(seconds)
    proc.send_signal(2)  # SIGINT: a clean stop writes summary.json
    _, stderr = proc.communicate(timeout=180)
    row: dict[str, Any] = {"arch": arch, "env": env, "launcher": launcher}
    if proc.returncode != 0 or startup is None:
        row["error"] = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return row
    summary = json.loads((run_dir / "summary.json").read_text())
    row.update(startup_s=startup, sps=steady_sps(run_dir / "metrics.csv"), lag=summary["policy_lag"]["mean"])
    latency = summary.get("inference", {}).get("inference_latency_ms", {})
    row.update(latency_p50_ms=latency.get("p50", float("nan")), latency_p99_ms=latency.get("p99", float("nan")))
    return row


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (arch, env, launcher): medians over repeats; failures kept when nothing succeeded."""
    merged: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        merged.setdefault((row["arch"], row["env"], row["launcher"]), []).append(row)
    result = []
    for (arch, env, launcher), group in merged.items():
        good = [row for row in group if "error" not in row]
        if not good:
            result.append(group[-1])
            continue
        result.append({"arch": arch, "env": env, "launcher": launcher, "runs": len(good),
                       **{key: statistics.median(row[key] for row in good)
                          for key in ("startup_s", "sps", "lag", "latency_p50_ms", "latency_p99_ms")}})
    return result


def markdown(rows: list[dict[str, Any]], command: str, seconds: float, load: float) -> str:
    def num(value: Any, digits: int) -> str:
        return "-" if not isinstance(value, (int, float)) or value != value else f"{value:,.{digits}f}"

    lines = [
        f"Command: `{command}` ({seconds:.0f} s measured per run after start-up; default flags plus `--launcher`; "
        "medians of alternating runs). `ray`: a private local Ray (`--ray-address local`), one CPU per actor.",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (load average about "
        f"{load:.0f} during the runs: expect noise), Python {platform.python_version()}; date: "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        "| arch | env | launcher | start-up s | SPS | SPS ray / process | inference p50 ms | inference p99 ms | lag mean |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    process_sps = {(row["arch"], row["env"]): row.get("sps") for row in rows if row["launcher"] == "process"}
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['arch']} | {row['env']} | {row['launcher']} | failed: {row['error'][:100]} |||||")
            continue
        base = process_sps.get((row["arch"], row["env"]))
        ratio = row["sps"] / base if row["launcher"] == "ray" and base else float("nan")
        seed = row["arch"] == "seed"
        lines.append(f"| {row['arch']} | {row['env']} | {row['launcher']} | {num(row['startup_s'], 1)} | "
                     f"{num(row['sps'], 0)} | {num(ratio, 2)} | {num(row['latency_p50_ms'], 2) if seed else '-'} | "
                     f"{num(row['latency_p99_ms'], 2) if seed else '-'} | {num(row['lag'], 1)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="seed,impact")
    parser.add_argument("--envs", default="CartPole-v1,MinAtar/Breakout-v1")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per run")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per launcher")
    parser.add_argument("--out", default="runs/bench-ray-launcher", help="run directories")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite the docs/benchmarks-log.md section")
    args = parser.parse_args()
    from conveyor.bench import publish_results

    runs, loads = [], []
    for env in args.envs.split(","):
        for arch in args.archs.split(","):
            for _ in range(args.repeats):
                for launcher in LAUNCHERS:
                    runs.append(run_one(arch, env, launcher, args.seconds, Path(args.out)))
                    loads.append(os.getloadavg()[0])
                    print(json.dumps(runs[-1]), flush=True)
    rows = medians(runs)
    command = " ".join(["benchmarks/ray_launcher.py", *sys.argv[1:]])
    publish_results(ROOT, SECTION, rows, markdown(rows, command, args.seconds, sum(loads) / len(loads)),
                    markdown=not args.no_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
