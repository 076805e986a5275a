"""Soak: run each architecture for a long time and record the memory of its whole process tree.

Every ``--interval`` seconds the resident set size (RSS) of the run's process
and all its descendants (env workers, executors, agents, actors) is summed
from /proc, and the run's env steps are read from its ``metrics.csv``. Memory
should stay flat: the growth from the end of warm-up (the first ``--warmup``
fraction of the samples) to the end should be under 10%. Writes ``soak.csv``
(one row per sample) and ``soak.md`` under ``--out`` and, with
``--markdown``, the ``soak`` section of docs/benchmarks-log.md.

    .venv/bin/python benchmarks/soak.py --minutes 30 --markdown docs/benchmarks-log.md   # the full soak (2.5 h)
    .venv/bin/python benchmarks/soak.py --minutes 30 --parallel                  # all five at once (30 min)
    .venv/bin/python benchmarks/soak.py --minutes 1 --interval 5                 # a smoke run
    .venv/bin/python benchmarks/soak.py --attack --minutes 10 --interval 10      # SEED under attack

With ``--parallel`` the architectures share the cores, so each trains fewer
steps in its 30 minutes; memory growth is what this measures, not speed.

``--attack`` soaks SEED alone (its local actors are the honest ones) while
``python -m tests.seed_attack attack`` runs beside it for the whole time, in
rounds: 40 clients sending 15 MiB messages without the token and 40 with a
wrong one, Hellos with 10 MiB actor names, a token holder's 300 idle streams
and a request for 4096 env slots (issue 21, rows 5-7; its outcomes go to
``seed-attack.log``). The learner's RSS should stay flat and the honest SPS
(after warm-up) near that of a run without ``--attack``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conveyor.bench import update_markdown_section, write_csv
from conveyor.telemetry import read_metrics

ARCH_ALGOS = {"paac": "a2c", "ga3c": "ga3c", "seed": "vtrace", "impact": "impact", "hts": "a2c"}
PAGE = os.sysconf("SC_PAGE_SIZE")
ROOT = Path(__file__).resolve().parent.parent


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant, from /proc's parent links."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # exited while we looked
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def tree_rss_mb(root: int) -> tuple[float, int]:
    total, count = 0, 0
    for pid in process_tree(root):
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
            count += 1
        except (OSError, ValueError, IndexError):
            continue
    return total / 2**20, count


def env_steps(run: Path) -> int:
    """The env steps in the last row of ``run``'s metrics.csv (0 before the first row)."""
    try:
        rows = read_metrics(run / "metrics.csv")[1]
    except FileNotFoundError:
        return 0
    return int(float(rows[-1]["env_steps"])) if rows else 0


def start_attacker(out: Path, token_file: Path, minutes: float, learner: subprocess.Popen) -> subprocess.Popen | None:
    """``python -m tests.seed_attack attack`` against the SEED learner once it listens (None if it exits first)."""
    address_file = out / "seed" / "learner_address"
    while not address_file.is_file():
        if learner.poll() is not None:
            return None
        time.sleep(0.5)
    with open(out / "seed-attack.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "tests.seed_attack", "attack", "--learner",
                                 address_file.read_text().strip(), "--token-file", str(token_file),
                                 "--seconds", str(minutes * 60)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def soak(arch: str, minutes: float, interval_s: float, out: Path, attack: bool = False) -> tuple[list[dict], int]:
    """The memory and env step samples of one run, and its env steps in all."""
    command = [sys.executable, "-m", "conveyor.cli", "train", "--arch", arch, "--algo", ARCH_ALGOS[arch],
               "--env", "CartPole-v1", "--total-steps", str(10**12), "--target-return", "inf",
               "--time-limit-s", str(minutes * 60), "--out", str(out / arch), "--no-progress"]
    token_file = out / "token"
    if attack:  # the attacker holds the token too (rows 6 and 7 are a token holder's)
        token_file.write_text(secrets.token_urlsafe(32))
        token_file.chmod(0o600)
        command += ["--token-file", str(token_file)]
    rows: list[dict] = []
    start = time.monotonic()
    attacker = None
    with open(out / f"{arch}.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            if attack:
                attacker = start_attacker(out, token_file, minutes, process)
            while process.poll() is None:
                time.sleep(interval_s)
                rss, processes = tree_rss_mb(process.pid)
                # Samples past the time limit may catch the run shutting down: only training counts.
                if process.poll() is None and time.monotonic() - start <= minutes * 60:
                    rows.append({"arch": arch, "t_s": round(time.monotonic() - start, 1), "rss_mb": round(rss, 1),
                                 "processes": processes, "env_steps": env_steps(out / arch)})
        finally:
            if attacker is not None:
                attacker.kill()
                attacker.wait()
        if process.returncode != 0:
            raise RuntimeError(f"{arch} exited with {process.returncode}; see {out / f'{arch}.log'}")
    return rows, json.loads((out / arch / "summary.json").read_text())["env_steps"]


def growth(rows: list[dict], warmup: float) -> tuple[float, float, float, float]:
    """(RSS after warm-up, RSS at the end, relative growth between them, env steps per second between them)."""
    settled = rows[min(len(rows) - 1, int(len(rows) * warmup))]
    end = rows[-1]
    sps = (end["env_steps"] - settled["env_steps"]) / max(end["t_s"] - settled["t_s"], 1e-9)
    return settled["rss_mb"], end["rss_mb"], (end["rss_mb"] - settled["rss_mb"]) / settled["rss_mb"], sps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="wall time per architecture")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between memory samples")
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of samples treated as warm-up")
    parser.add_argument("--archs", default=",".join(ARCH_ALGOS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"))
    parser.add_argument("--markdown", type=Path, default=None, help="docs/benchmarks-log.md to update")
    parser.add_argument("--parallel", action="store_true", help="run all architectures at the same time")
    parser.add_argument("--attack", action="store_true",
                        help="soak SEED alone with tests.seed_attack running beside it (see the docstring)")
    args = parser.parse_args()
    if args.attack:
        args.archs = "seed"

    args.out.mkdir(parents=True, exist_ok=True)
    all_rows: list[dict] = []
    lines = ["| arch | minutes | env steps | samples | processes | RSS after warm-up MB | RSS at end MB | growth | "
             "SPS after warm-up |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    archs = args.archs.split(",")
    with tempfile.TemporaryDirectory() as runs, ThreadPoolExecutor(len(archs) if args.parallel else 1) as pool:
        results = pool.map(lambda arch: soak(arch, args.minutes, args.interval, Path(runs), args.attack), archs)
        for arch, (rows, steps) in zip(archs, results):
            all_rows += rows
            settled, end, rel, sps = growth(rows, args.warmup)
            lines.append(f"| {arch} | {args.minutes:g} | {steps:,} | {len(rows)} | "
                         f"{rows[-1]['processes']} | {settled:.0f} | "
                         f"{end:.0f} | {rel:+.1%} | {sps:,.0f} |")
            print(lines[-1], flush=True)
        if args.attack:
            shutil.copy(Path(runs) / "seed-attack.log", args.out / "seed-attack.log")
    write_csv(args.out / "soak.csv", all_rows, ["arch", "t_s", "rss_mb", "processes", "env_steps"])
    body = "\n".join([
        f"`benchmarks/soak.py --minutes {args.minutes:g} --interval {args.interval:g}"
        f"{' --parallel' if args.parallel else ''}{' --attack' if args.attack else ''}` on CartPole-v1, "
        f"{'with tests.seed_attack beside it (rows 5-7 of issue 21), ' if args.attack else ''}"
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores. RSS summed over the run's "
        "whole process tree; growth from the end of warm-up to the end (target: under 10%).",
        "", *lines])
    (args.out / "soak.md").write_text(body + "\n")
    if args.markdown:
        update_markdown_section(args.markdown, "soak-attack" if args.attack else "soak", body)
    print(body)


if __name__ == "__main__":
    main()
