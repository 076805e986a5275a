"""The env backends side by side: PAAC A2C's training SPS with ``--env-backend shm`` and ``inproc`` per env,
and what ``auto`` picks there.

Each env trains paac/a2c with its presets (16 envs on 2 env workers for the classic and MinAtar families)
alternately on each backend (shm, inproc, shm, inproc, ...), so that machine noise hits both; each run lasts
``--seconds`` of wall time, and SPS counts env steps over the training loop's time (the time split: start-up
excluded). Beside the medians and the ratio inproc / shm stand the one-env step time that ``auto`` measures
(``conveyor.envs.inproc.measure_step_us``) and its choice, so the rule's constant (``SHM_STEP_OVERHEAD_US``) can
be held against the crossover. Rows go to ``--out`` (CSV) with the machine, the load and the date.

    .venv/bin/python benchmarks/env_backends.py --seconds 15 --repeats 2
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import conveyor
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, RunCfg
from conveyor.envs.inproc import choose_backend

ENVS = ("CartPole-v1", "Acrobot-v1", "MountainCar-v0", "Pendulum-v1", "MinAtar/Breakout-v1",
        "MinAtar/SpaceInvaders-v1")


def config(env_id: str, backend: str, seconds: float, seed: int, out: str) -> RunCfg:
    return RunCfg(env=EnvCfg(id=env_id, backend=backend), algo=AlgoCfg(name="a2c"), arch=ArchCfg(name="paac"),
                  total_steps=10**9, time_limit_s=seconds, target_return=float("inf"), seed=seed, out=out,
                  progress=False, log_interval_s=seconds)


def measure(env_id: str, backend: str, seconds: float, seed: int) -> float:
    """Training SPS of one run: env steps over the training loop's time."""
    with tempfile.TemporaryDirectory() as out:
        summary = conveyor.train(config(env_id, backend, seconds, seed, out))
    return summary["env_steps"] / sum(summary["time_split"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="wall time of each run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per backend and env")
    parser.add_argument("--envs", nargs="+", default=list(ENVS))
    parser.add_argument("--out", default="benchmarks/results/env_backends.csv")
    args = parser.parse_args()
    rows = []
    for env_id in args.envs:
        sps: dict[str, list[float]] = {"shm": [], "inproc": []}
        for repeat in range(args.repeats):
            for backend in sps:
                sps[backend].append(measure(env_id, backend, args.seconds, seed=repeat))
        resolved = config(env_id, "auto", args.seconds, 0, "")
        choice = choose_backend(resolved.env, 0)
        shm, inproc = statistics.median(sps["shm"]), statistics.median(sps["inproc"])
        row = {"env": env_id, "num_envs": resolved.env.num_envs, "num_workers": resolved.env.num_workers,
               "shm_sps": round(shm), "inproc_sps": round(inproc), "inproc_over_shm": round(inproc / shm, 2),
               "step_us": round(choice.step_us, 1), "auto": choice.backend,
               "runs": " ".join(f"{b}:{round(v)}" for b, values in sps.items() for v in values)}
        rows.append(row)
        print(row, flush=True)
    load = os.getloadavg()[0]
    meta = (f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {os.cpu_count()} cpus, load {load:.1f} at the end; "
            f"benchmarks/env_backends.py --seconds {args.seconds:g} --repeats {args.repeats}\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as file:
        file.write(meta)
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
