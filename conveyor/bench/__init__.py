"""``conveyor bench``: run a suite of runs one after another and write a results folder.

A suite (``suites.py``) is a list of runs: architectures x algorithms x envs
x seeds, each with a budget of env steps and a wall-time cap, or a peer
framework (stable-baselines3 A2C/PPO, Sample Factory APPO; ``peers.py``)
configured with the same env, model, number of envs and n-steps. Suites:
``quick``, ``atari``, ``mujoco``, ``peers`` and ``learning`` (``--quick``:
its CartPole-only part), which runs each architecture with nothing but its
presets and holds the returns against thresholds and published numbers, and
``race`` (``race.py``): wall-clock time from process start to a return
threshold, conveyor's defaults vs peers with their own tuned settings.

Each run executes in a child process of its own session (``child.py``,
``python -m conveyor.bench.child SPEC``). A run that raises, crashes or
outlives its timeout (its whole process group is ended) is recorded as failed
with a one-line error; a peer that is not installed, or an env whose package
is missing, is recorded as skipped; the suite continues either way.

The results folder ``OUT`` holds ``results.csv`` (one row per run), the
report ``results.md`` with its plots (``report.py``) and ``runs/<name>/``
(each run's own directory, with ``bench.log``). Results are rewritten after
every run, so an interrupted suite leaves what it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

from conveyor.bench.race import check_merge_target, race_suite, rewrite_race_results, write_race_results
from conveyor.bench.report import (ROW_FIELDS, device_name, publish_results, row_line, update_markdown_section,
                                   write_csv, write_results)
from conveyor.bench.suites import SUITES, Suite, learning_suite
from conveyor.errors import ConfigError
from conveyor.hosts import accelerator

ALL_SUITES = {**SUITES, "race": race_suite}

__all__ = ["add_arguments", "device_name", "main", "publish_results", "run_suite", "update_markdown_section", "write_csv"]


def write_suite_results(suite: Suite, out: Path, rows: list[dict[str, Any]], elapsed_s: float,
                        markdown: Path | None = None, merge: bool = False, started_unix: float | None = None) -> None:
    """The results folder: ``report.write_results``; for the race, ``results.csv`` and ``race.write_race_results``
    (``merge``: keeping ``out``'s earlier race rows that these runs do not redo; ``started_unix``: when the
    invocation started)."""
    if suite.race_envs:
        write_csv(out / "results.csv", rows, ROW_FIELDS)
        write_race_results(suite, out, rows, elapsed_s, markdown=markdown, merge=merge, started_unix=started_unix)
    else:
        write_results(suite, out, rows, elapsed_s, markdown=markdown)


def run_suite(suite: Suite, out_dir: Path | str, *, log: Callable[[str], None] = print,
              markdown: Path | None = None, merge: bool = False) -> list[dict[str, Any]]:
    """Run every run of ``suite`` in turn; writes the results folder after each; returns the rows. ``merge``
    (the race): the folder's earlier race rows that these runs do not redo stay in its tables."""
    # Imported here: the package must not hold conveyor.bench.child when `python -m` starts it as a child.
    from conveyor.bench.child import execute

    out = Path(out_dir)
    try:
        (out / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"bench output dir {out} is not writable ({error.strerror}): pass another --out") from None
    rows: list[dict[str, Any]] = []
    started, started_unix = time.perf_counter(), time.time()
    for index, run in enumerate(suite.runs, 1):
        log(f"[{index}/{len(suite.runs)}] {run.label} ...")
        row = execute(run, out / "runs" / run.name)
        rows.append(row)
        log(f"    {row_line(row)}")
        write_suite_results(suite, out, rows, time.perf_counter() - started, markdown=None, merge=merge,
                            started_unix=started_unix)
    elapsed = time.perf_counter() - started
    write_suite_results(suite, out, rows, elapsed, markdown=markdown, merge=merge, started_unix=started_unix)
    counts = {status: sum(row["status"] == status for row in rows) for status in ("ok", "failed", "skipped")}
    log(f"suite {suite.name}: {counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped in "
        f"{elapsed:.0f}s; results in {out}")
    return rows


def _parse_seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds wants comma-separated integers, got {text!r}") from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"--seeds wants non-negative integers, got {text!r}")
    return seeds


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", required=True, choices=sorted(ALL_SUITES), help="which suite to run")
    parser.add_argument("--quick", action="store_true",
                        help="with --suite learning: CartPole-v1 only, one seed unless --seeds; with --suite race: "
                             "CartPole-v1 and Acrobot-v1, seed 0, a 15 s cap per run")
    parser.add_argument("--full", action="store_true", help="with --suite race: Pong too (hours per run on a CPU)")
    parser.add_argument("--time-cap", type=float, default=None, metavar="SECONDS",
                        help="with --suite race: stop each run this many seconds from its spawn where that is "
                        "sooner than its env's time cap: e.g. at twice the leader's time, where only whether a "
                        "contender is that much slower matters; the tables say which rows ran under it")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: bench-results/SUITE)")
    parser.add_argument("--seeds", type=_parse_seeds, default=None, metavar="N,N",
                        help="seeds (default: 0; learning: 1,2,3, with --quick 1; race: 0,1,2, with --quick 0)")
    parser.add_argument("--only", type=_parse_list, default=(), metavar="TEXT,TEXT",
                        help="run only the runs whose name contains one of these (e.g. paac,hts)")
    parser.add_argument("--envs", type=_parse_list, default=(), metavar="TEXT,TEXT",
                        help="run only the envs whose id contains one of these (e.g. CartPole,Pendulum)")
    parser.add_argument("--archs", type=_parse_list, default=(), metavar="ARCH,ARCH",
                        help="run only these architectures (e.g. paac,impact)")
    parser.add_argument("--device", default=None, help="torch device of the conveyor learners (default: the "
                        "preset's, cuda for Atari where torch sees a GPU, else cpu)")
    parser.add_argument("--markdown", "--update-markdown", type=Path, default=None, metavar="FILE",
                        help="also set this suite's section of FILE (e.g. docs/benchmarks-log.md) to the results")
    parser.add_argument("--merge", action="store_true",
                        help="with --suite race: keep the rows of --out's race.csv that this invocation does not "
                        "rerun (same env, contender and seed), so its tables and charts cover both")
    parser.add_argument("--rewrite", action="store_true",
                        help="with --suite race: run nothing; write --out's summary, charts and results.md (and "
                        "--markdown's section) again from its race.csv and invocations.csv, after editing a note "
                        "in invocations.csv or dropping a superseded invocation from it")
    parser.add_argument("--list", action="store_true", help="print the suite's runs and exit")
    # A smoke run of the learning suite's machinery: every step budget times this (0 < X <= 1).
    parser.add_argument("--budget-scale", type=float, default=1.0, help=argparse.SUPPRESS)


def select_suite(args: argparse.Namespace) -> Suite:
    if (args.suite not in ("learning", "race") and args.quick) or (args.suite != "learning"
                                                                 and args.budget_scale != 1.0):
        raise ConfigError("--quick and --budget-scale belong to the learning suite (--quick to the race suite too): "
                          "use them with --suite learning")
    if args.suite != "race" and (args.full or args.merge or args.time_cap is not None):
        flag = "--full" if args.full else "--merge" if args.merge else "--time-cap"
        raise ConfigError(f"{flag} belongs to the race suite: use it with --suite race")
    if args.suite == "race" and args.device:
        raise ConfigError("--device does not apply to the race: every contender runs with its own defaults")
    if args.suite == "learning":
        suite = learning_suite(args.seeds, quick=args.quick, budget_scale=args.budget_scale,
                               device=args.device or accelerator())
    elif args.suite == "race":
        suite = race_suite(args.seeds, quick=args.quick, full=args.full, time_cap_s=args.time_cap)
    else:
        suite = SUITES[args.suite](args.seeds or (0,))
    runs = suite.runs
    filters = [("--only", args.only, lambda run, part: part in run.name),
               ("--envs", args.envs, lambda run, part: part.lower() in run.cfg.env.id.lower()),
               ("--archs", args.archs, lambda run, part: part == run.arch_label)]
    for flag, wanted, matches in filters:
        if wanted:
            runs = tuple(run for run in runs if any(matches(run, part) for part in wanted))
            if not runs:
                raise ConfigError(f"{flag} {','.join(wanted)} matches no run of suite {suite.name}: see --list")
    if args.device:
        runs = tuple(dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, device=args.device)) for run in runs)
    envs = {run.cfg.env.id for run in runs}
    return dataclasses.replace(suite, runs=runs,
                               learning_envs=tuple(env for env in suite.learning_envs if env.id in envs),
                               race_envs=tuple(env for env in suite.race_envs if env.id in envs))


def rewrite(args: argparse.Namespace) -> int:
    """``--rewrite``: the race's tables from what ``--out`` holds, running nothing."""
    if args.suite != "race":
        raise ConfigError("--rewrite belongs to the race suite: use it with --suite race")
    chosen = [flag for flag, value in (("--quick", args.quick), ("--full", args.full), ("--merge", args.merge),
                                       ("--seeds", args.seeds), ("--only", args.only), ("--envs", args.envs),
                                       ("--archs", args.archs), ("--device", args.device), ("--list", args.list),
                                       ("--time-cap", args.time_cap is not None))
              if value]
    if chosen:
        raise ConfigError(f"--rewrite runs nothing and keeps every row of --out: leave out {', '.join(chosen)}")
    out = args.out or Path("bench-results") / "race"
    rows = rewrite_race_results(out, markdown=args.markdown)
    print(f"rewrote the race's tables of {rows} runs in {out}" + (f" and {args.markdown}" if args.markdown else ""))
    return 0


def main(args: argparse.Namespace) -> int:
    if args.rewrite:
        return rewrite(args)
    suite = select_suite(args)
    if args.list:
        for run in suite.runs:
            command = f" (conveyor train {' '.join(run.flags)})" if run.flags else ""
            skipped = f"; skipped: {run.skip_reason}" if run.skip_reason else ""
            protocol = "".join([*(f" --checkpoint {checkpoint}" for checkpoint in run.eval_checkpoints),
                                *(f" --env-arg {key}={value}" for key, value in run.eval_env_args)])
            print(f"{run.name}: {run.label}, {run.cfg.total_steps:,} env steps, {run.cfg.time_limit_s:.0f} s cap, "
                  f"{run.eval_episodes} evaluation episodes per policy{protocol}{command}{skipped}")
        return 0
    out = args.out or Path("bench-results") / suite.name
    if args.merge:
        check_merge_target(out)
    try:
        run_suite(suite, out, markdown=args.markdown, merge=args.merge)
    except KeyboardInterrupt:  # the running child was already stopped; finished runs are in the results
        print(f"interrupted: results of the finished runs are in {out}", file=sys.stderr)
        return 130
    return 0
