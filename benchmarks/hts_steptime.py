"""HTS vs PAAC where the HTS-RL paper says HTS wins (high-variance step times), and its eq. 7 against measured runs.

Two tables, every row one ``conveyor train`` run of a fixed wall time, training as usual (A2C, ``--torch-threads
1``, 16 envs):

- **HTS vs PAAC at equal envs and workers**, alternating the two architectures (the order flips every repeat),
  median of ``--repeats`` runs each: ``conveyor/StepTime-v0`` with exponential and gamma (shape 0.5) step times of
  mean 2 ms (a sleep: a simulator elsewhere), one env per worker (16 workers: a worker steps its envs one after
  another, so sleeping envs need their own), HTS ``--sync-interval`` alpha and PAAC ``--unroll`` alpha (the same
  steps per update), alpha 5 (both presets) and 32; and CartPole-v1 with both presets (2 workers, alpha 5), where
  HTS's machinery costs the most against a very cheap env.
- **Eq. 7**: HTS on StepTime (exponential, then gamma 0.5, mean 2 ms) for alpha in 4, 16, 64, 256, 512: measured
  SPS and round time against ``conveyor.architectures.hts.throughput`` (claim 1 / eq. 7 of the paper): a round
  lasts E[max of 16 Gamma(alpha k, k / mean)] + alpha beta + c. The step-time law (k, mean) is the env's
  setting; beta (per step) and c (per round) are measured in the same run, not fitted: beta is what an env waits
  for its action (``summary.json`` ``action_wait_ms``, the executors' clock from posting a request to reading its
  action) plus what an env step costs beyond the drawn time (``env_step_ms`` minus the mean: the sleep's overshoot
  and the executor's writes), c the main thread's time from a round found full to the next one's start
  (``round_gap_ms``).

SPS is measured between the first metrics row 1 s after the first steps and the last row, both rows where the
step count had just grown (HTS counts steps by whole rounds: the window spans whole rounds). The tables go to the
``hts-steptime`` section of ``docs/benchmarks-log.md`` and to ``benchmarks/results/hts_steptime.csv``.

    .venv/bin/python benchmarks/hts_steptime.py                 # about 20 minutes on 2 cores
    .venv/bin/python benchmarks/hts_steptime.py --seconds 4 --repeats 1 --alphas 4,64 --no-markdown   # a smoke run
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
SECTION = "hts-steptime"
STARTUP_S = 6.0  # imports, 16 worker or executor processes; measuring starts 1 s after the first steps anyway
NUM_ENVS = 16
MEAN_MS = 2.0
STEP_TIME = "conveyor/StepTime-v0"


class Compare(NamedTuple):
    name: str
    env: str
    env_args: tuple[str, ...]
    workers: int
    alpha: int | None  # HTS --sync-interval and PAAC --unroll; None: the presets'


DISTS = {"exponential": ("dist=exponential", f"mean_ms={MEAN_MS:g}"),
         "gamma k=0.5": ("dist=gamma", "shape=0.5", f"mean_ms={MEAN_MS:g}")}
COMPARES = [
    *(Compare(f"StepTime {dist}", STEP_TIME, args, NUM_ENVS, alpha)
      for alpha in (5, 32) for dist, args in DISTS.items()),
    Compare("CartPole-v1", "CartPole-v1", (), 2, None),
]


def train(arch: str, env: str, env_args: tuple[str, ...], workers: int | None, alpha: int | None, seconds: float,
          run_dir: Path, *, algo: str = "a2c", num_envs: int | None = NUM_ENVS,
          flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """One run; its summary plus the steady ``sps`` (or ``error``). ``workers`` or ``num_envs`` None: the
    preset's; ``flags``: more ``conveyor train`` flags (benchmarks/claims.py's grids)."""
    command = [sys.executable, "-m", "conveyor", "train", "--arch", arch, "--algo", algo, "--env", env,
               *(word for arg in env_args for word in ("--env-arg", arg)),
               *(["--num-envs", str(num_envs)] if num_envs is not None else []),
               *(["--num-workers", str(workers)] if workers is not None else []), *flags,
               "--torch-threads", "1", "--target-return", "inf",
               "--total-steps", str(10**9), "--time-limit-s", f"{STARTUP_S + seconds:g}", "--log-interval-s", "0.2",
               "--no-progress", "--out", str(run_dir)]
    if alpha is not None:
        command += ["--sync-interval" if arch == "hts" else "--unroll", str(alpha)]
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
    proc = subprocess.run(command, capture_output=True, text=True, timeout=STARTUP_S + seconds + 180)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    summary = json.loads((run_dir / "summary.json").read_text())
    sps, window_s = steady_sps(run_dir / "metrics.csv")
    return {**summary, "sps": sps, "window_s": window_s}


def steady_sps(metrics_csv: Path, warmup_s: float = 1.0) -> tuple[float, float]:
    """(env steps per second, seconds measured) between the first row ``warmup_s`` after the first steps and the
    last row, counting only rows where the step count had just grown."""
    rows = [(int(row["env_steps"]), float(row["wall_time_s"])) for row in csv.DictReader(metrics_csv.open())
            if row.get("env_steps", "").isdigit() and int(row["env_steps"]) > 0]
    grown = [row for i, row in enumerate(rows) if i == 0 or row[0] > rows[i - 1][0]]
    window = [row for row in grown if row[1] >= rows[0][1] + warmup_s] if rows else []
    if len(window) < 2:
        return float("nan"), 0.0
    (steps0, t0), (steps1, t1) = window[0], window[-1]
    return (steps1 - steps0) / (t1 - t0), t1 - t0


def compare(config: Compare, seconds: float, repeats: int, out: Path) -> dict[str, Any]:
    """HTS and PAAC alternately, ``repeats`` runs each; medians and the runs' SPS."""
    runs: dict[str, list[dict[str, Any]]] = {"paac": [], "hts": []}
    for repeat in range(repeats):
        for arch in ("paac", "hts") if repeat % 2 == 0 else ("hts", "paac"):
            slug = config.name.replace(" ", "-").replace("=", "").replace("/", "_")
            run_dir = out / f"{slug}-a{config.alpha or 'preset'}-{arch}-{repeat}"
            result = train(arch, config.env, config.env_args, config.workers, config.alpha, seconds, run_dir)
            runs[arch].append(result)
            print(json.dumps({"config": config.name, "alpha": config.alpha, "arch": arch, "repeat": repeat,
                              "sps": result.get("sps"), "error": result.get("error")}), flush=True)
    row: dict[str, Any] = {"table": "compare", "config": config.name, "workers": config.workers,
                           "alpha": config.alpha or 5, "load": os.getloadavg()[0]}
    for arch, results in runs.items():
        good = [r["sps"] for r in results if "error" not in r and math.isfinite(r["sps"])]
        row[f"{arch}_sps"] = statistics.median(good) if good else float("nan")
        row[f"{arch}_runs"] = " ".join(f"{sps:.0f}" for sps in good)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            row[f"{arch}_error"] = errors[0]
    hts = [r for r in runs["hts"] if "error" not in r]
    if hts:
        row["hts_batch"] = statistics.median(r["counters"]["actor_requests"] / max(1, r["counters"]["actor_forwards"])
                                             for r in hts)
        row["hts_action_wait_ms"] = statistics.median(r["action_wait_ms"] for r in hts)
    row["ratio"] = row["hts_sps"] / row["paac_sps"]
    return row


def eq7_row(dist: str, alpha: int, seconds: float, out: Path) -> dict[str, Any]:
    """One HTS run at ``alpha`` and what eq. 7 predicts from its measured beta and c."""
    from conveyor.architectures.hts.throughput import expected_max

    args = DISTS[dist]
    shape = 1.0 if dist == "exponential" else 0.5
    mean_s = MEAN_MS / 1000.0
    result = train("hts", STEP_TIME, args, NUM_ENVS, alpha, seconds, out / f"eq7-{dist.split()[0]}-a{alpha}")
    row: dict[str, Any] = {"table": "eq7", "config": f"StepTime {dist}", "alpha": alpha, "load": os.getloadavg()[0]}
    if "error" in result:
        return {**row, "error": result["error"]}
    beta_s = (result["action_wait_ms"] + result["env_step_ms"] - MEAN_MS) / 1000.0
    overhead_s = result["round_gap_ms"] / 1000.0
    max_s = expected_max(NUM_ENVS, alpha * shape, shape / mean_s)
    predicted_round_s = max_s + alpha * beta_s + overhead_s
    measured_round_s = NUM_ENVS * alpha / result["sps"]
    return {**row, "sps": result["sps"], "window_s": result["window_s"], "rounds": result["rounds"],
            "action_wait_ms": result["action_wait_ms"], "env_step_ms": result["env_step_ms"],
            "beta_ms": 1000 * beta_s, "round_gap_ms": result["round_gap_ms"], "max_ms": 1000 * max_s,
            "measured_round_ms": 1000 * measured_round_s, "predicted_round_ms": 1000 * predicted_round_s,
            "predicted_sps": NUM_ENVS * alpha / predicted_round_s,
            "error_pct": 100 * (predicted_round_s - measured_round_s) / measured_round_s}


def num(value: Any, digits: int = 0) -> str:
    return "-" if not isinstance(value, (int, float)) or not math.isfinite(value) else f"{value:,.{digits}f}"


def markdown(rows: list[dict[str, Any]], command: str, seconds: float, repeats: int) -> str:
    loads = [row["load"] for row in rows]
    lines = [
        f"Command: `{command}` ({seconds:.0f} s per run after {STARTUP_S:.0f} s of start-up, SPS from 1 s after "
        "the first steps; training runs as usual: A2C, 16 envs, `--torch-threads 1`).",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (load average "
        f"{min(loads):.1f}-{max(loads):.1f} at the end of the rows: expect noise), Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}; date: {time.strftime('%Y-%m-%d')}.",
        "",
        f"HTS vs PAAC at equal envs and workers: median of {repeats} runs each, alternating (the order flips every "
        "repeat). alpha: HTS `--sync-interval`, PAAC `--unroll` (the same steps per update). StepTime step times "
        f"have mean {MEAN_MS:g} ms (a sleep).",
        "",
        "| env, step time | workers | alpha | PAAC SPS | HTS SPS | HTS / PAAC | PAAC runs | HTS runs | "
        "HTS actor batch | HTS action wait ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in (r for r in rows if r["table"] == "compare"):
        failed = " ".join(f"{arch} failed: {row[f'{arch}_error'][:80]}" for arch in ("paac", "hts")
                          if f"{arch}_error" in row)
        lines.append(f"| {row['config']} | {row['workers']} | {row['alpha']} | {num(row['paac_sps'])} | "
                     f"{num(row['hts_sps'])} | **{num(row['ratio'], 2)}x** | {row['paac_runs']} | {row['hts_runs']} | "
                     f"{num(row.get('hts_batch'), 1)} | {num(row.get('hts_action_wait_ms'), 2)} |"
                     + (f" {failed}" if failed else ""))
    lines += [
        "",
        "Eq. 7 (HTS-RL claim 1, `conveyor/architectures/hts/throughput.py`): one HTS run per row, 16 envs, 16 "
        "executors. Predicted round = E[max of 16 Gamma(alpha k, k / mean)] (the extreme-value formula) + alpha "
        "beta + c, with beta = action wait + (env step - mean) and c = round gap measured in the same run (not "
        "fitted); error = (predicted - measured) / measured round time.",
        "",
        "| step time | alpha | measured SPS | predicted SPS | measured round ms | predicted round ms | E[max] ms "
        "| beta ms (wait + step overshoot) | c ms | error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in (r for r in rows if r["table"] == "eq7"):
        if "error" in row:
            lines.append(f"| {row['config']} | {row['alpha']} | failed: {row['error'][:120]} ||||||||")
            continue
        lines.append(f"| {row['config'].removeprefix('StepTime ')} | {row['alpha']} | {num(row['sps'])} | "
                     f"{num(row['predicted_sps'])} | {num(row['measured_round_ms'], 1)} | "
                     f"{num(row['predicted_round_ms'], 1)} | {num(row['max_ms'], 1)} | {num(row['beta_ms'], 3)} "
                     f"({num(row['action_wait_ms'], 3)} + {num(row['env_step_ms'] - MEAN_MS, 3)}) | "
                     f"{num(row['round_gap_ms'], 2)} | {row['error_pct']:+.1f}% |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per architecture in the comparison")
    parser.add_argument("--alphas", default="4,16,64,256,512", help="eq. 7 table: comma-separated alphas")
    parser.add_argument("--skip-compare", action="store_true", help="only the eq. 7 table")
    parser.add_argument("--skip-eq7", action="store_true", help="only the comparison")
    parser.add_argument("--out", default="runs/bench-hts-steptime", help="run directories")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite the docs/benchmarks-log.md section")
    args = parser.parse_args()
    from conveyor.bench import publish_results

    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    if not args.skip_compare:
        for config in COMPARES:
            rows.append(compare(config, args.seconds, args.repeats, out))
            print(json.dumps(rows[-1]), flush=True)
    if not args.skip_eq7:
        for dist in DISTS:
            for alpha in (int(value) for value in args.alphas.split(",")):
                rows.append(eq7_row(dist, alpha, args.seconds, out))
                print(json.dumps(rows[-1]), flush=True)
    command = " ".join(["benchmarks/hts_steptime.py", *sys.argv[1:]])
    publish_results(ROOT, SECTION, rows, markdown(rows, command, args.seconds, args.repeats),
                    markdown=not args.no_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
