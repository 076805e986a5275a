"""The comparison matrix of the results page (issue 48): every arch/algo on each env, defaults only, several seeds.

    .venv/bin/python benchmarks/matrix.py [--envs TEXT,TEXT] [--archs ARCH,ARCH/ALGO] [--seeds N,N] [--jobs 2] [--list]

Each run is ``conveyor train --arch A --algo L --env E --seed N --total-steps S`` and nothing else (the presets
choose the rest, as in the learning suite). ``--jobs`` runs go at once (default 2: the matrix is hours of CPU on
two cores, and a run's learning at equal env steps does not depend on the load; its wall-time curve does, so the
results page's time curves are those of a machine running two at a time). As each run finishes, its small form
(``conveyor report --export``: ``benchmarks/results/matrix/<env>/<arch>-<algo>/seed-N.csv`` and ``.json``) is
written; a run whose export exists is not run again, so the same command resumes, and ``conveyor report``
picks up whatever exists:

    conveyor report benchmarks/results/matrix --claims benchmarks/results/claims --out docs/results --page docs/results.md

Run directories (checkpoints, logs) go to ``runs/matrix/`` (git-ignored). ``MATRIX`` is issue 48's list:
CartPole-v1 and Pendulum-v1 at 300k steps with 5 seeds (CartPole stops at its threshold, 475), five MinAtar
games at 1M steps with 3 seeds for every discrete architecture with its own algorithm and seed/r2d2, and
HalfCheetah-v5 at 1M steps with 3 seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from conveyor.bench.aggregate import export_run, find_runs
from conveyor.bench.child import stop_child
from conveyor.bench.suites import LEARNING_ENVS, MINATAR_RUNS
from conveyor.plots import file_safe

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "matrix"
POLL_S = 1.0


@dataclass(frozen=True)
class MatrixEnv:
    id: str
    total_steps: int
    seeds: tuple[int, ...]
    runs: tuple[tuple[str, str], ...]  # (arch, algo)


def _learning_runs(env_id: str) -> tuple[tuple[str, str], ...]:
    """The learning suite's (arch, algo) rows of ``env_id``, without its named presets (appo, impala)."""
    (env,) = [env for env in LEARNING_ENVS if env.id == env_id]
    return tuple((arch, algo) for arch, algo, preset in env.runs if not preset)


MINATAR = tuple((arch, algo) for arch, algo, _ in MINATAR_RUNS)
MATRIX = (
    MatrixEnv("CartPole-v1", 300_000, (1, 2, 3, 4, 5), _learning_runs("CartPole-v1")),
    MatrixEnv("Pendulum-v1", 300_000, (1, 2, 3, 4, 5), _learning_runs("Pendulum-v1")),
    *(MatrixEnv(f"MinAtar/{game}-v1", 1_000_000, (1, 2, 3), MINATAR)
      for game in ("Breakout", "SpaceInvaders", "Asterix", "Freeway", "Seaquest")),
    MatrixEnv("HalfCheetah-v5", 1_000_000, (1, 2, 3), (("paac", "ppo"), ("impact", "impact"))),
)


@dataclass(frozen=True)
class MatrixRun:
    env: str
    arch: str
    algo: str
    seed: int
    total_steps: int

    @property
    def name(self) -> str:
        return f"{file_safe(self.env)}/{self.arch}-{self.algo}/seed-{self.seed}"

    def command(self, run_dir: Path) -> list[str]:
        return [sys.executable, "-m", "conveyor", "train", "--arch", self.arch, "--algo", self.algo, "--env",
                self.env, "--seed", str(self.seed), "--total-steps", str(self.total_steps), "--no-progress",
                "--out", str(run_dir)]


def selected(envs: Sequence[str], archs: Sequence[str], seeds: Sequence[int]) -> list[MatrixRun]:
    """The matrix's runs whose env id contains one of ``envs`` and whose arch or arch/algo is in ``archs`` (all
    when empty), with ``seeds`` in place of each env's own; seed-major, so that every row gets its first seeds
    first."""
    runs = [MatrixRun(env.id, arch, algo, seed, env.total_steps)
            for env in MATRIX if not envs or any(text in env.id for text in envs)
            for seed in (seeds or env.seeds)
            for arch, algo in env.runs if not archs or arch in archs or f"{arch}/{algo}" in archs]
    return sorted(runs, key=lambda run: run.seed)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", default="", help="only envs whose id contains one of these (comma-separated)")
    parser.add_argument("--archs", default="", help="only these architectures, or arch/algo pairs "
                        "(comma-separated: seed/vtrace runs SEED's V-trace rows without its R2D2 ones)")
    parser.add_argument("--seeds", default="", help="these seeds in place of each env's own (comma-separated)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (default 2)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "matrix", help="run directories' root")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the exports go (default "
                        "benchmarks/results/matrix)")
    parser.add_argument("--total-steps", type=int, default=0, help="a smoke run's budget in place of each env's "
                        "(pass another --results: these are not the matrix's runs)")
    parser.add_argument("--list", action="store_true", help="print the runs still to do and exit")
    args = parser.parse_args(argv)
    split = [text for text in args.envs.split(",") if text], [text for text in args.archs.split(",") if text]
    try:
        seeds = [int(seed) for seed in args.seeds.split(",") if seed]
    except ValueError:
        parser.error(f"--seeds {args.seeds}: pass whole numbers, comma-separated")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: pass 1 or more")
    if args.total_steps and args.results.resolve() == RESULTS:
        parser.error("--total-steps makes smoke runs: pass --results DIR too, so that they stay out of the matrix")
    runs = selected(*split, seeds)
    if args.total_steps:
        runs = [dataclasses.replace(run, total_steps=args.total_steps) for run in runs]
    if not runs:
        parser.error("no run of the matrix matches --envs and --archs: `--list` without them shows the matrix")
    todo = [run for run in runs if not (args.results / f"{run.name}.json").exists()]
    print(f"matrix: {len(runs) - len(todo)} of {len(runs)} runs done, {len(todo)} to run, {args.jobs} at once",
          flush=True)
    if args.list:
        print("\n".join(run.name for run in todo))
        return 0
    return run_all(todo, args.runs, args.results, args.jobs)


def run_all(todo: list[MatrixRun], root: Path, results: Path, jobs: int) -> int:
    """Run ``todo``, ``jobs`` at once, exporting each into ``results`` as it ends; on SIGINT/SIGTERM stop the
    running ones."""
    running: dict[subprocess.Popen, tuple[MatrixRun, Path, float]] = {}
    failed: list[str] = []
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while (todo and not stopping) or running:
            while todo and not stopping and len(running) < jobs:
                run = todo.pop(0)
                run_dir = root / run.name
                shutil.rmtree(run_dir, ignore_errors=True)  # a run stopped halfway starts again, whole
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                log = (run_dir.parent / f"seed-{run.seed}.log").open("w")
                child = subprocess.Popen(run.command(run_dir), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # a Ctrl-C reaches this script, which stops it
                log.close()
                running[child] = (run, run_dir, time.monotonic())
                print(f"started {run.name}", flush=True)
            if stopping:
                for child in running:
                    stop_child(child)
            for child in [child for child in running if child.poll() is not None]:
                run, run_dir, started = running.pop(child)
                if child.returncode == 0 and not stopping:
                    (record,) = find_runs([run_dir])
                    export_run(record, results)
                    print(f"done {run.name}: {record.final:.1f} at {int(record.curve[-1, 0]):,} steps, "
                          f"{time.monotonic() - started:.0f} s", flush=True)
                elif not stopping:
                    failed.append(run.name)
                    print(f"FAILED {run.name} (exit {child.returncode}): see {run_dir.parent}/seed-{run.seed}.log",
                          flush=True)
            time.sleep(POLL_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopping:
        print("matrix: stopped; the same command resumes (unfinished runs start again)", file=sys.stderr)
        return 130
    if failed:
        print(f"matrix: {len(failed)} runs failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
