"""The env backends side by side: PAAC A2C's training SPS with ``--env-backend shm``, ``inproc`` and ``vector``
(``--backends``; ``vector`` only on envs with a native vector env, CartPole) per env, and what ``auto`` picks.

Each env trains paac/a2c with its presets (its envs and env workers)
alternately on each backend (shm, inproc, vector, shm, ...), so that machine noise hits all; each run lasts
``--seconds`` of wall time, and SPS counts env steps over the training loop's time (the time split: start-up
excluded). Beside the medians and their ratios over shm stand the step time that ``auto`` measures
(``conveyor.envs.inproc.choose_backend``: one env's, or a native vector env's per env) and its choice, so the
rule's constant (``INPROC_MAX_STEP_US``) can be held against the crossover. Rows go to ``--out`` (CSV) with the
machine, the load and the date.

    .venv/bin/python benchmarks/env_backends.py --seconds 15 --repeats 2
    .venv/bin/python benchmarks/env_backends.py --envs CartPole-v1 --backends inproc vector
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
from conveyor.envs.native_vector import native_vector_refusal

BACKENDS = ("shm", "inproc", "vector")
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
    parser.add_argument("--backends", nargs="+", default=["shm", "inproc", "vector"], choices=BACKENDS)
    parser.add_argument("--out", default="benchmarks/results/env_backends.csv")
    args = parser.parse_args()
    rows = []
    for env_id in args.envs:
        resolved = config(env_id, "auto", args.seconds, 0, "")
        sps: dict[str, list[float]] = {backend: [] for backend in args.backends
                                       if backend != "vector" or not native_vector_refusal(resolved.env)}
        for repeat in range(args.repeats):
            for backend in sps:
                sps[backend].append(measure(env_id, backend, args.seconds, seed=repeat))
        choice = choose_backend(resolved.env, 0)
        medians = {backend: statistics.median(values) for backend, values in sps.items()}
        row = {"env": env_id, "num_envs": resolved.env.num_envs, "num_workers": resolved.env.num_workers,
               **{f"{backend}_sps": round(medians[backend]) if backend in medians else "" for backend in BACKENDS},
               **{f"{backend}_over_shm": round(medians[backend] / medians["shm"], 2)
                  if backend in medians and "shm" in medians else "" for backend in BACKENDS[1:]},
               "step_us": round(choice.step_us, 2), "auto": choice.backend,
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
