"""The learning curve of a Sample Factory race run that did not finish, read from Sample Factory's own log.

A race run writes its rows when it stops; a run stopped by hand (a Pong screen that outlasts the session) leaves
only its folder: ``bench_spec.json`` (when the run was spawned) and ``bench.log``, where Sample Factory prints,
every few seconds, ``Fps is (...). Total num frames: N`` and ``Avg episode reward: [(0, 'R')]`` (the mean return
of its last 100 episodes, ``stats_avg``; on Atari the real game's, from ``RecordEpisodeStatistics``). This prints
them as CSV, one row per ``--every`` seconds of the run and its last, with agent steps = frames / ``--frameskip``
(the Atari recipe counts frames, 4 per agent step)::

    .venv/bin/python benchmarks/sf_log_curve.py benchmarks/results/race/runs/sample-factory-appo-ALE_Pong-v5-s0 \\
        > benchmarks/results/race/pong_sf_screen.csv
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[.,]\d+\]\[\d+\] "
                  r"(?:Fps is \(10 sec: [\d.nan]+, 60 sec: [\d.nan]+, 300 sec: ([\d.nan]+)\)\. Total num frames: (\d+)"
                  r"|Avg episode reward: \[\(0, '([-\d.]+)'\)\])")


def curve(log: str, spawned_unix: float, frameskip: int, every_s: float) -> list[dict[str, float]]:
    """Rows ``wall_s`` (from the spawn), ``env_steps``, ``sps_300s`` and ``return_mean_last100`` of each report that
    has both lines, thinned to the first of every ``every_s`` seconds and the last."""
    reports: list[dict[str, float]] = []
    for stamp, sps_300s, frames, reward in LINE.findall(log):
        wall_s = datetime.datetime.fromisoformat(stamp).timestamp() - spawned_unix  # the log's clock: local time
        if frames:
            reports.append({"wall_s": round(wall_s), "env_steps": int(frames) // frameskip,
                            "sps_300s": round(float(sps_300s) / frameskip, 1), "return_mean_last100": None})
        elif reports and reports[-1]["return_mean_last100"] is None:
            reports[-1]["return_mean_last100"] = float(reward)
    reports = [row for row in reports if row["return_mean_last100"] is not None]
    kept = [row for i, row in enumerate(reports)
            if i == len(reports) - 1 or i == 0 or row["wall_s"] // every_s != reports[i - 1]["wall_s"] // every_s]
    return kept


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the race run's folder (bench_spec.json, bench.log)")
    parser.add_argument("--frameskip", type=int, default=4, help="frames per agent step in the log's counts")
    parser.add_argument("--every", type=float, default=300.0, help="seconds between the rows printed")
    args = parser.parse_args(argv)
    spawned = json.loads((args.run_dir / "bench_spec.json").read_text())["spawned_unix"]
    rows = curve((args.run_dir / "bench.log").read_text(errors="replace"), spawned, args.frameskip, args.every)
    print("wall_s,env_steps,sps_300s,return_mean_last100")
    for row in rows:
        print(f"{row['wall_s']},{row['env_steps']},{row['sps_300s']},{row['return_mean_last100']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
