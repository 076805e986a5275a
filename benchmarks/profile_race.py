"""Where a race contender's CPU goes: ``conveyor train`` with its presets alone, sampled by py-spy.

One run of ``conveyor train --arch A --algo L --env E`` (the race's command, with ``--time-limit-s``) is sampled
by ``py-spy record --subprocesses`` (env workers and actor processes included) at ``--rate`` Hz. Only samples
in which a thread runs count (py-spy leaves out idle ones), so the shares are of CPU time, not of wall-clock.
The report, a small text file, has:

- the run's own time split from its ``metrics.csv`` (env / act / learn / wait seconds, env steps, SPS);
- each process's share of the samples (the learner's main process, each env worker);
- the functions with the most samples of their own ("self") and in their call trees ("total"), per process kind;
- the architecture's loop line by line: the main process's samples by the line of
  ``conveyor/architectures/<arch>/run.py`` they pass through and the function called there, which shows the
  work between the time split's timed blocks (storage writes, telemetry) beside the timed calls.

    .venv/bin/python benchmarks/profile_race.py --arch paac --algo a2c --env MinAtar/SpaceInvaders-v1 --seconds 60
    .venv/bin/python benchmarks/profile_race.py --arch paac --algo a2c --env CartPole-v1 --seconds 20 \
        -- --num-envs 16 --lr 7e-4 --no-normalize-reward

Flags after ``--`` go to ``conveyor train`` as they are (the default report's name then ends with them).

``make bench-deps`` installs py-spy. The report goes to ``--out`` (default
``benchmarks/results/profiles/<arch>-<algo>-<env>.txt``).
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROCESS_FRAME = re.compile(r'process (\d+):"(.*?)"(?:;|(?= \d+$))')
"""A process frame at the front of a raw line: a child's stack starts with its parents' process frames, and a
command line that py-spy could not read is empty."""
FRAME = re.compile(r"^(.*) \((.*)\)$")
BOOTSTRAP = ("<frozen", "<string>", "runpy")
TIME_COLUMNS = ("time_env", "time_act", "time_learn", "time_wait")


def parse_raw(text: str) -> list[tuple[int, int, list[str], int]]:
    """py-spy's raw (collapsed) stacks: one (root pid, pid, frames root first, samples) per line; the root is
    the process py-spy started, ``pid`` the one sampled (the last of the line's process frames)."""
    lines: list[str] = []
    for line in text.splitlines():
        if lines and not line.startswith("process "):  # a frame name that held a newline: py-spy, sampling an
            lines[-1] += " " + line  # import, read a module's docstring as a function name (seen 2026-12-06)
        else:
            lines.append(line)
    stacks = []
    for line in lines:
        pids, position = [], 0
        while (match := PROCESS_FRAME.match(line, position)) is not None:
            pids.append(int(match.group(1)))
            position = match.end()
        stack, _, count = line[position:].rpartition(" ")
        if not pids or not count.isdigit():
            raise ValueError(f"a stack without its process frame (py-spy --subprocesses): {line[:120]}")
        stacks.append((pids[0], pids[-1], stack.split(";") if stack else [], int(count)))
    return stacks


def entry(frames: list[str]) -> str:
    """The first frame of a stack that is not the interpreter's start-up (runpy, ``-c``'s ``<string>``)."""
    for frame in frames:
        if not any(part in frame for part in BOOTSTRAP):
            return short(frame)
    return "start-up"


def short(frame: str) -> str:
    """``function (path:line)`` with the path cut to its last two parts and the line dropped."""
    match = FRAME.match(frame)
    if match is None:
        return frame
    name, where = match.groups()
    path = where.rsplit(":", 1)[0]
    return f"{name} ({'/'.join(Path(path).parts[-2:])})"


def summarize(stacks: list[tuple[int, int, list[str], int]], rows: int) -> list[str]:
    """The report's tables: each process's share, then per process kind (the learner's main process, or a child
    named by where its stacks enter, ``main (envs/shm_worker.py)``) the functions by self and total samples."""
    total = sum(count for *_, count in stacks) or 1
    entries: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for _, pid, frames, count in stacks:
        entries[pid][entry(frames)] += count
    kinds = {pid: "main" if pid == root else "child: " + entries[pid].most_common(1)[0][0]
             for root, pid, _, _ in stacks}
    per_process: collections.Counter[tuple[int, str]] = collections.Counter()
    kind_samples: collections.Counter[str] = collections.Counter()
    self_samples: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    tree_samples: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for _, pid, frames, count in stacks:
        kind = kinds[pid]
        per_process[(pid, kind)] += count
        kind_samples[kind] += count
        if frames:
            self_samples[kind][short(frames[-1])] += count
        for name in {short(frame) for frame in frames}:
            tree_samples[kind][name] += count
    lines = [f"samples: {total}", "", "process share of the samples:"]
    lines += [f"  {count / total:6.1%}  pid {pid} {kind}" for (pid, kind), count in per_process.most_common()]
    for kind, kind_total in kind_samples.most_common():
        for title, counter in (("self", self_samples[kind]), ("total (in the call tree)", tree_samples[kind])):
            lines += ["", f"{kind}: functions by {title} samples, % of the process kind's {kind_total}:"]
            lines += [f"  {count / kind_total:6.1%}  {name}" for name, count in counter.most_common(rows)]
    return lines


def loop_lines(stacks: list[tuple[int, int, list[str], int]], arch: str, rows: int) -> list[str]:
    """The main process's samples by the line of ``architectures/<arch>/run.py``'s ``run`` they pass through and
    the function called from it (``(the line itself)`` where the line's own code ran), as % of the samples in the
    loop; the main process is the one py-spy started (``root == pid``)."""
    where = f"architectures/{arch}/run.py:"
    lines: collections.Counter[str] = collections.Counter()
    for root, pid, frames, count in stacks:
        if root != pid:
            continue
        at = next((i for i, frame in enumerate(frames) if frame.startswith("run (") and where in frame), None)
        if at is None:
            continue
        line = frames[at].rsplit(":", 1)[1].rstrip(")")
        callee = short(frames[at + 1]) if at + 1 < len(frames) else "(the line itself)"
        lines[f"line {line}: {callee}"] += count
    total = sum(lines.values())
    if not total:
        return []
    return ["", f"the loop (architectures/{arch}/run.py) by line and the function it calls, % of its {total} samples:",
            *(f"  {count / total:6.1%}  {name}" for name, count in lines.most_common(rows))]


def time_split(run_dir: Path) -> list[str]:
    """The run's last metrics row: env steps, wall time, SPS and the time split."""
    with (run_dir / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        return ["the run wrote no metrics row"]
    last = rows[-1]
    split = ", ".join(f"{name[5:]} {float(last[name]):.1f} s" for name in TIME_COLUMNS if last.get(name))
    wall, timed = float(last["wall_time_s"]), sum(float(last[name]) for name in TIME_COLUMNS if last.get(name))
    return [f"run: {int(float(last['env_steps'])):,} env steps in {wall:.1f} s "
            f"({float(last['sps']):,.0f} SPS at the last log), last-100 return {last['return_mean_last100']}",
            f"time split (the run's own telemetry, wall-clock): {split}; outside it {wall - timed:.1f} s "
            f"({(wall - timed) / wall:.0%}: start-up and the loop's untimed work)"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True)
    parser.add_argument("--algo", required=True)
    parser.add_argument("--env", required=True)
    parser.add_argument("--seconds", type=float, default=60.0, help="the run's --time-limit-s")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--rows", type=int, default=15, help="functions listed per table")
    parser.add_argument("--out", type=Path, help="the report (default benchmarks/results/profiles/...)")
    parser.add_argument("train_flags", nargs="*", help="after --: more flags for conveyor train")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        print("profile_race: py-spy is not installed (make bench-deps)", file=sys.stderr)
        return 2
    name = "-".join([args.arch, args.algo, args.env.replace("/", "_"),
                     *(re.sub(r"[^A-Za-z0-9.-]+", "", flag).lstrip("-") for flag in args.train_flags)])
    out = args.out or ROOT / "benchmarks" / "results" / "profiles" / f"{name}.txt"
    train = ["conveyor", "train", "--arch", args.arch, "--algo", args.algo, "--env", args.env,
             "--time-limit-s", str(args.seconds), "--no-progress", *args.train_flags]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, raw = Path(tmp) / "run", Path(tmp) / "profile.raw"
        command = [py_spy, "record", "--format", "raw", "--output", str(raw), "--rate", str(args.rate),
                   "--subprocesses", "--nonblocking", "--", sys.executable, "-m", "conveyor", *train[1:],
                   "--out", str(run_dir)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode or not raw.is_file():
            print(f"profile_race: py-spy or the run failed ({done.returncode}): "
                  f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        # py-spy's raw output held a byte that is not UTF-8 in one of four runs (2026-12-06): it becomes U+FFFD
        # in the frame it sits in, rather than the whole profile being lost.
        stacks = parse_raw(raw.read_text(errors="replace"))
        split = time_split(run_dir)
    header = [f"profile of `{' '.join(train)}` under py-spy {args.rate} Hz (--subprocesses, CPU samples only)",
              f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
              f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}; "
              f"load average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}",
              f"command: .venv/bin/python benchmarks/profile_race.py {' '.join(sys.argv[1:])}", *split, ""]
    report = "\n".join(header + summarize(stacks, args.rows) + loop_lines(stacks, args.arch, args.rows)) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report, end="")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
