"""Scale-out under torchrun: PAAC A2C on P data-parallel ranks, SPS and efficiency SPS(P) / (P SPS(1)).

Each row is one ``torchrun --standalone --nproc-per-node P -m conveyor train --arch paac --algo a2c`` run of a
fixed wall time on ``conveyor/StepTime-v0`` with a CPU-burning step (``busy=true``, a constant 1 ms: a
compute-bound simulator; on CartPole the ranks would mostly wait for gloo), 8 envs and one env worker per rank
(``--num-envs 8P``: the same work per rank). Reported per P:

- SPS: env steps per second of the whole run in steady state (from rank 0's ``metrics.csv``, after start-up);
- efficiency: SPS(P) / (P SPS(1)), 1 for perfect scaling;
- all-reduce ms: rank 0's mean time in the gradient all-reduce of an update in the run (``summary.json``
  ``distributed.allreduce_ms``: it includes waiting for the slowest rank's batch), and the all-reduce alone,
  the same flattened gradient reduced 200 times back to back by P ranks (``--probe``).

A rank's learner and its env worker take turns (PAAC's learner waits while its envs step), so a rank keeps
about one core busy: a row with more ranks than cores is marked oversubscribed. The table goes to the
``scaleout`` section of ``docs/benchmarks-log.md`` and to ``benchmarks/results/scaleout.csv``.

    .venv/bin/python benchmarks/scaleout.py              # about 3 minutes
    .venv/bin/python benchmarks/scaleout.py --seconds 5 --no-markdown   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from seed_inference import steady_sps  # benchmarks/ is on sys.path when this script runs

ROOT = Path(__file__).resolve().parent.parent
SECTION = "scaleout"
STARTUP_S = 12.0  # torchrun's rendezvous, each rank's imports, env workers
ENVS_PER_RANK = 8
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def torchrun(ranks: int, *args: str) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc-per-node", str(ranks), *args]


def run_ranks(ranks: int, seconds: float, out: Path) -> dict[str, Any]:
    run_dir = out / f"ranks-{ranks}"
    command = torchrun(ranks, "-m", "conveyor", "train", "--arch", "paac", "--algo", "a2c",
                       "--env", "conveyor/StepTime-v0", "--env-arg", "busy=true", "--env-arg", "dist=constant",
                       "--env-arg", "mean_ms=1", "--num-envs", str(ENVS_PER_RANK * ranks), "--num-workers", "1",
                       "--torch-threads", "1", "--target-return", "inf", "--total-steps", str(10**9),
                       "--time-limit-s", str(STARTUP_S + seconds), "--log-interval-s", "1", "--no-progress",
                       "--out", str(run_dir))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=STARTUP_S + seconds + 180)
    row: dict[str, Any] = {"ranks": ranks, "envs": ENVS_PER_RANK * ranks}
    if proc.returncode != 0:
        row["error"] = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return row
    summary = json.loads((run_dir / "summary.json").read_text())
    row.update(sps=steady_sps(run_dir / "metrics.csv"), updates=summary["updates"],
               allreduce_ms=summary["distributed"]["allreduce_ms"] if ranks > 1 else float("nan"),
               split=summary["time_split_fraction"], gradient_floats=gradient_floats(run_dir))
    if ranks > 1:
        row["probe_ms"] = probe(ranks, row["gradient_floats"])
    return row


def gradient_floats(run_dir: Path) -> int:
    """What one flattened all-reduce carries: the model's parameters plus the weight."""
    from conveyor.learner import load_latest_checkpoint

    state = load_latest_checkpoint(run_dir)[1]
    return sum(tensor.numel() for name, tensor in state["model"].items() if "normalizer" not in name) + 1


def probe(ranks: int, floats: int) -> float:
    """Mean ms of one all-reduce of ``floats`` float32 among ``ranks`` gloo ranks, nothing else running."""
    proc = subprocess.run(torchrun(ranks, __file__, "--probe", str(floats)), capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])["ms"] if lines else float("nan")


def run_probe(floats: int, repeats: int = 200) -> None:
    """One torchrun rank of ``probe``."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    flat = torch.ones(floats)
    for _ in range(20):
        dist.all_reduce(flat)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(flat)
    if dist.get_rank() == 0:
        print(json.dumps({"ms": 1000 * (time.perf_counter() - start) / repeats}), flush=True)
    dist.destroy_process_group()


def markdown(rows: list[dict[str, Any]], command: str, seconds: float, load: float) -> str:
    def num(value: Any, digits: int) -> str:
        return "-" if not isinstance(value, (int, float)) or value != value else f"{value:,.{digits}f}"

    cores = os.cpu_count() or 1
    base = next((row["sps"] for row in rows if row["ranks"] == 1 and "sps" in row), float("nan"))
    lines = [
        f"Command: `{command}` ({seconds:.0f} s measured per row after {STARTUP_S:.0f} s of start-up; training "
        "runs as usual). PAAC A2C, `conveyor/StepTime-v0` with `busy=true dist=constant mean_ms=1` (each env step "
        f"burns 1 ms of CPU), {ENVS_PER_RANK} envs and 1 env worker per rank, `--torch-threads 1`, gloo on loopback.",
        f"Machine: {platform.machine()}, {cores} cores shared with other jobs (load average about {load:.0f} "
        f"during the runs: expect noise), Python {platform.python_version()}, {platform.system()} "
        f"{platform.release()}; date: {time.strftime('%Y-%m-%d')}.",
        "",
        "| ranks P | envs | SPS | efficiency SPS(P) / (P SPS(1)) | all-reduce ms per update, in the run | "
        "all-reduce ms alone | updates | time split env/act/learn/wait % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ranks = f"{row['ranks']}" + (" (oversubscribed)" if row["ranks"] > cores else "")
        if "error" in row:
            lines.append(f"| {ranks} | {row['envs']} | failed: {row['error'][:120]} ||||||")
            continue
        split = "/".join(f"{100 * row['split'][bucket]:.0f}" for bucket in ("env", "act", "learn", "wait"))
        lines.append(f"| {ranks} | {row['envs']} | {num(row['sps'], 0)} | {num(row['sps'] / (row['ranks'] * base), 2)} "
                     f"| {num(row['allreduce_ms'], 2)} | {num(row.get('probe_ms'), 2)} | {row['updates']:,} | "
                     f"{split} |")
    lines += [
        "",
        "A rank's learner and its busy env worker take turns (the learner waits while its envs step), so a rank "
        "keeps about one core busy: more ranks than cores is oversubscribed. SPS: env steps/s of all ranks. "
        "All-reduce in the run: rank 0's mean time inside the gradient all-reduce, waiting for the slowest rank's "
        "rollout included; alone: the same number of floats (the MLP's parameters and the weight) all-reduced back "
        "to back by P ranks with nothing else running.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated P values")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per configuration")
    parser.add_argument("--out", default="runs/bench-scaleout", help="run directories")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite the docs/benchmarks-log.md section")
    parser.add_argument("--probe", type=int, default=0, help=argparse.SUPPRESS)  # one rank of probe()
    args = parser.parse_args()
    if args.probe:
        run_probe(args.probe)
        return 0
    from conveyor.bench import publish_results

    rows, loads = [], []
    for ranks in (int(value) for value in args.ranks.split(",")):
        rows.append(run_ranks(ranks, args.seconds, Path(args.out)))
        loads.append(os.getloadavg()[0])
        print(json.dumps(rows[-1]), flush=True)
    command = " ".join(["benchmarks/scaleout.py", *sys.argv[1:]])
    publish_results(ROOT, SECTION, rows, markdown(rows, command, args.seconds, sum(loads) / len(loads)),
                    markdown=not args.no_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
