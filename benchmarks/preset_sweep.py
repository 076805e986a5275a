"""Wall-clock to a return threshold by preset values: one arch/algo on one env over a grid of flags and seeds.

Each cell is a fresh ``conveyor train`` with the arch, algo, env, seed and the cell's flags (everything else from
the presets) until the mean return of the last 100 episodes reaches ``--target-return`` (the env's threshold by
default) or ``--total-steps``. A row records the env steps and learner updates it took, the run's own clock
(``summary.json``'s ``wall_time_s``: Python's start-up and imports excluded) and the wall-clock of the whole
command. Cells run in
turns (every cell for seed 0, then seed 1, ...) so that machine noise hits each alike; medians are what to read.
This is how the paac/a2c and seed/vtrace classic-discrete presets were chosen (docs/benchmarks-log.md "Fastest
to a trained agent, round 2"):

    .venv/bin/python benchmarks/preset_sweep.py --arch paac --env CartPole-v1 --seeds 0 1 2 3 4 \
        --cell "--num-envs 64 --lr 0.006" --cell "--num-envs 128 --lr 0.01" --out benchmarks/results/sweep.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIELDS = ("date", "load", "arch", "algo", "env", "cell", "seed", "stopped", "env_steps", "updates", "run_s",
          "wall_s")


def run_cell(args: argparse.Namespace, cell: str, seed: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "run")
        command = [sys.executable, "-m", "conveyor", "train", "--arch", args.arch, "--env", args.env,
                   "--seed", str(seed), "--total-steps", str(args.total_steps), "--out", str(out), "--no-progress",
                   *(["--algo", args.algo] if args.algo else []),
                   *(["--target-return", str(args.target_return)] if args.target_return is not None else []),
                   *shlex.split(cell)]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        wall = time.perf_counter() - start
        summary = json.loads((out / "summary.json").read_text())
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "load": round(os.getloadavg()[0], 1), "arch": summary["arch"],
            "algo": summary["algo"], "env": args.env, "cell": cell, "seed": seed,
            "stopped": summary["stop_reason"], "env_steps": summary["env_steps"],
            "updates": summary["learner_version"], "run_s": round(summary["wall_time_s"], 2),
            "wall_s": round(wall, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True)
    parser.add_argument("--algo", default="")
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--cell", action="append", required=True, help="the flags of one cell (repeat the option)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--total-steps", type=int, default=600_000, help="the cap of each run")
    parser.add_argument("--target-return", type=float, default=None, help="default: the env's threshold")
    parser.add_argument("--out", required=True, help="CSV to append the rows to")
    args = parser.parse_args()
    path = Path(args.out)
    new = not path.exists()
    rows: list[dict[str, object]] = []
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, FIELDS)
        if new:
            writer.writeheader()
        for seed in args.seeds:
            for cell in args.cell:
                row = run_cell(args, cell, seed)
                writer.writerow(row)
                handle.flush()
                rows.append(row)
                print(f"{cell} seed {seed}: {row['stopped']} at {row['env_steps']:,} steps, {row['run_s']} s of "
                      f"the run, {row['wall_s']} s in all", flush=True)
    for cell in args.cell:
        mine = [row for row in rows if row["cell"] == cell]
        print(f"{cell}: median {statistics.median(r['run_s'] for r in mine)} s of the run, "
              f"{statistics.median(r['wall_s'] for r in mine)} s in all, "
              f"{statistics.median(r['env_steps'] for r in mine):,.0f} steps ({len(mine)} seeds)")


if __name__ == "__main__":
    main()
