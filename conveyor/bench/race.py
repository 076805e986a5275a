"""``conveyor bench --suite race``: wall-clock time from process start to a return threshold.

Every contender races on each env (``RACE_ENVS``) until the mean return of
its last 100 training episodes reaches the env's threshold, counting only
once 100 episodes exist (as ``conveyor train --target-return`` stops), or
until a cap (env steps, wall time; ``--time-cap`` stops an invocation's runs
sooner, and each row keeps the cap it ran under). Contenders, each with its
own defaults or published tuned settings and nothing else:

* every conveyor architecture/algorithm that applies to the env
  (``CONVEYOR_CONTENDERS``; GA3C and R2D2 on discrete actions only), built
  from ``--arch/--algo/--env/--seed`` alone, so the presets choose the rest;
  the race adds only its threshold as ``target_return``, its time cap as
  ``time_limit_s`` and, where the preset's ``total_steps`` is above the step
  cap, the cap;
* stable-baselines3 A2C, PPO and DQN with rl-baselines3-zoo's
  hyperparameters for the env (``zoo.py``), where rl-zoo has them;
* Sample Factory APPO and CleanRL PPO in virtual environments of their own
  (``external.py``; ``make peers``), or ``skipped`` rows saying why.

The clock. ``child.execute`` stamps ``spawned_unix`` (``time.time()``) into
the run's spec just before it spawns the child, so Python's start-up and
imports count. The child records when its run's own clock started
(``race_clock.json``: ``run_start_unix``; for conveyor runs the first
``Telemetry`` the run creates, for the peers the one their runner creates).
Each finished episode in ``returns.csv`` carries its wall time on the run's
clock; the race time of an episode is ``run_start_unix - spawned_unix``
(``startup_s``) plus that wall time. A run that crossed the threshold within
both caps ``reached`` it; any other is ``capped`` (its race time is the time
cap, drawn hatched). Over seeds: the median (censored: a seed that did not
reach counts as infinitely slow, so the median is "not reached" unless over
half the seeds reached), min and max. Times taken hours apart on a shared
machine are not side by side: before each run the parent times a fixed
workload (``machine_speed.py``), each row keeps it, and an env's table says
when its rows ran at speeds more than ``SPEED_SPREAD`` apart.

Results (``write_race_results``): ``race.csv`` (every run), ``race_summary.csv``
(every env and contender over seeds), ``results.md`` (a table per env) and
``race_<env>.png`` (time to threshold, log scale, min-max whiskers), ``invocations.csv`` (when, at which commit
and with which command each invocation whose rows the folder holds ran: ``--merge`` appends one, and the page
lists them).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from conveyor.bench.suites import RACE_CLOCK_FILE as CLOCK_FILE
from conveyor.bench.suites import RACE_WINDOW as WINDOW
from conveyor.bench.suites import SPEC_FILE
from conveyor.bench.suites import BenchRun, PeerUnavailable, RaceGoal, Suite, run_name, train_config
from conveyor.bench.suites import write_race_clock as write_clock
from conveyor.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from conveyor.config import RunCfg

HOUR = 3600.0
RACE_CSV, SUMMARY_CSV, INVOCATIONS_CSV = "race.csv", "race_summary.csv", "invocations.csv"
INVOCATION_FIELDS = ("date", "commit", "command", "runs", "elapsed_s", "load", "note", "started_unix")
"""``invocations.csv``: one row per invocation whose rows the results folder holds (``--merge`` appends), so the
page says when, at which commit and with which command each of its rows ran."""
DEFAULT_SEEDS = (0, 1, 2)
SPEED_SPREAD = 1.5
"""An env's table warns when the fastest machine speed of its runs is more than this times the slowest. Above
the noise of one sample: on the idle 2-core VM, 18 samples in a row spread 1.32x (1 s each) and 1.45x (3 s
each), drifting over tens of seconds (2026-12-02); the night-to-afternoon shift that prompted it was 2x."""


@dataclass(frozen=True)
class RaceEnv:
    """An env of the race: the threshold of the last-100 mean return, the caps, the package it needs."""

    id: str
    threshold: float
    max_steps: int
    time_limit_s: float
    package: str = ""
    full_only: bool = False
    """Only in ``--full`` (Pong: hours per run on a CPU)."""

    def goal(self) -> RaceGoal:
        return RaceGoal(self.threshold, self.max_steps, self.time_limit_s)


RACE_ENVS = (
    RaceEnv("CartPole-v1", 475.0, 500_000, 600.0),
    RaceEnv("Acrobot-v1", -100.0, 1_000_000, 900.0),
    RaceEnv("Pendulum-v1", -250.0, 1_000_000, 1800.0),
    RaceEnv("MinAtar/Breakout-v1", 10.0, 5_000_000, 2 * HOUR, package="minatar"),
    RaceEnv("MinAtar/SpaceInvaders-v1", 50.0, 5_000_000, 2 * HOUR, package="minatar"),
    RaceEnv("ALE/Pong-v5", 0.0, 10_000_000, 6 * HOUR, package="ale_py", full_only=True),
)
QUICK_ENVS = ("CartPole-v1", "Acrobot-v1")
QUICK_TIME_LIMIT_S = 15.0
"""``--quick``: each run's time cap (CartPole and Acrobot, one seed, every contender: under 10 minutes on 2
cores, start-ups included); most contenders do not reach the thresholds that fast, and the chart says so."""

CONVEYOR_CONTENDERS = (("paac", "a2c"), ("paac", "ppo"), ("hts", "a2c"), ("hts", "ppo"), ("ga3c", "ga3c"),
                       ("seed", "vtrace"), ("seed", "r2d2"), ("impact", "impact"))
SB3_ALGOS = ("a2c", "ppo", "dqn")
DISCRETE_ONLY_ALGOS = ("ga3c", "r2d2", "dqn")


# ---- the suite -----------------------------------------------------------------------------------------
def is_continuous(env_id: str) -> bool:
    from conveyor.envs.gym_api import env_family

    return env_family(env_id) in ("classic-continuous", "mujoco")


def conveyor_race_config(arch: str, algo: str, env: RaceEnv, seed: int) -> tuple[RunCfg, tuple[str, ...]]:
    """A conveyor contender's config and the ``conveyor train`` flags it came from: only arch, algo, env and
    seed (``--total-steps`` too where the preset's is above the env's step cap), the presets pick the rest."""
    flags: tuple[str, ...] = ("--arch", arch, "--algo", algo, "--env", env.id, "--seed", str(seed))
    cfg = train_config(flags)
    if cfg.total_steps > env.max_steps:
        flags += ("--total-steps", str(env.max_steps))
        cfg = train_config(flags)
    return dataclasses.replace(cfg, target_return=env.threshold, time_limit_s=env.time_limit_s, progress=False), flags


def _carrier(env: RaceEnv, seed: int) -> RunCfg:
    """A peer run's config: it carries only the env, seed and caps (the peer's own settings are its recipe's)."""
    from conveyor.config import EnvCfg, RunCfg

    return RunCfg(env=EnvCfg(id=env.id), seed=seed, total_steps=env.max_steps, time_limit_s=env.time_limit_s,
                  target_return=env.threshold, progress=False)


@functools.cache
def sb3_skip_reason(algo: str, env_id: str) -> str:
    """Why SB3 ``algo`` with rl-zoo's settings cannot race on ``env_id`` here ("" when it can)."""
    from conveyor.bench.zoo import SB3_NOT_INSTALLED, zoo_entry, zoo_version

    if importlib.util.find_spec("stable_baselines3") is None:
        return SB3_NOT_INSTALLED
    try:
        found = zoo_entry(algo, env_id)
    except PeerUnavailable as error:
        return str(error)
    return "" if found else f"rl-zoo {zoo_version()} has no {algo} entry for {env_id}, nor an atari one"


def race_envs(quick: bool = False, full: bool = False) -> tuple[RaceEnv, ...]:
    if quick and full:
        raise ConfigError("--quick and --full exclude each other")
    if quick:
        return tuple(dataclasses.replace(env, time_limit_s=QUICK_TIME_LIMIT_S) for env in RACE_ENVS
                     if env.id in QUICK_ENVS)
    return tuple(env for env in RACE_ENVS if full or not env.full_only)


def race_suite(seeds: Sequence[int] | None = None, *, quick: bool = False, full: bool = False,
               envs: Sequence[RaceEnv] | None = None, time_cap_s: float | None = None) -> Suite:
    """The race: every contender on every env of ``race_envs(quick, full)`` (or ``envs``), for each seed
    (default 0, 1, 2; ``quick``: 0). ``time_cap_s`` (``--time-cap``): each run stops at this many seconds from
    spawn where that is sooner than its env's time cap."""
    from conveyor.bench.external import PEERS, skip_reason

    seeds = tuple(seeds or ((0,) if quick else DEFAULT_SEEDS))
    envs = tuple(envs) if envs is not None else race_envs(quick, full)
    check_time_cap(time_cap_s)
    source_commit()  # the commit this invocation starts from, for invocations.csv
    runs: list[BenchRun] = []
    # The runs' caps; the suite's envs keep their own, so the tables can say which rows ran under a lower one.
    capped = tuple(dataclasses.replace(env, time_limit_s=min(env.time_limit_s, time_cap_s or math.inf))
                   for env in envs)
    for env in capped:
        missing = env.package and importlib.util.find_spec(env.package) is None
        env_skip = f"{env.package} is not installed (pip install {env.package})" if missing else ""
        continuous = is_continuous(env.id)
        for arch, algo in CONVEYOR_CONTENDERS:
            if continuous and algo in DISCRETE_ONLY_ALGOS:
                continue
            for seed in seeds:
                cfg, flags = conveyor_race_config(arch, algo, env, seed)
                runs.append(BenchRun(run_name("conveyor", arch, algo, env.id, seed), cfg, eval_episodes=0,
                                     flags=flags, skip_reason=env_skip, race=env.goal()))
        for algo in SB3_ALGOS:
            if continuous and algo in DISCRETE_ONLY_ALGOS:
                continue
            skip = env_skip or sb3_skip_reason(algo, env.id)
            for seed in seeds:
                runs.append(BenchRun(run_name("sb3", "", algo, env.id, seed), _carrier(env, seed), framework="sb3",
                                     eval_episodes=0, algo_label=algo, skip_reason=skip, race=env.goal()))
        for framework, peer in PEERS.items():
            skip = env_skip or skip_reason(framework, env.id)
            for seed in seeds:
                runs.append(BenchRun(run_name(framework, "", peer.algo, env.id, seed), _carrier(env, seed),
                                     framework=framework, eval_episodes=0, algo_label=peer.algo, skip_reason=skip,
                                     race=env.goal()))
    name = "race-quick" if quick else "race-full" if full else "race"
    return Suite(name, race_description(envs, seeds), tuple(runs), race_envs=envs)


def check_time_cap(time_cap_s: float | None) -> None:
    if time_cap_s is not None and not (math.isfinite(time_cap_s) and time_cap_s > 0):
        raise ConfigError(f"--time-cap {time_cap_s:g} is not a positive number of seconds: pass e.g. --time-cap 600")


def race_description(envs: Sequence[RaceEnv], seeds: Sequence[int]) -> str:
    scope = ", ".join(f"{env.id} {env.threshold:g}" for env in envs)
    return (f"wall-clock time from process start until the mean return of the last {WINDOW} training episodes "
            f"reaches the threshold ({scope}); conveyor's defaults vs stable-baselines3 with rl-zoo's tuned "
            f"settings, Sample Factory APPO and CleanRL PPO; seeds {','.join(map(str, seeds))}")


# ---- the child side --------------------------------------------------------------------------------------
def run_conveyor(cfg: RunCfg, run_dir: Path, goal: RaceGoal, spawned_unix: float) -> None:
    """``conveyor.train(cfg)``, recording when the run's clock started: the first ``Telemetry`` created in this
    process is the run's (``Run.__init__``); its ``start_time`` is on ``perf_counter``'s clock, turned into
    unix time here. The time cap left after start-up becomes the run's ``time_limit_s``."""
    from conveyor import train
    from conveyor.telemetry import Telemetry

    starts: list[float] = []
    original = Telemetry.__init__

    def recording_init(self: Telemetry, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not starts:
            starts.append(time.time() - (time.perf_counter() - self.start_time))

    Telemetry.__init__ = recording_init  # type: ignore[method-assign]
    try:
        left = goal.time_limit_s - (time.time() - spawned_unix)
        train(dataclasses.replace(cfg, time_limit_s=max(1.0, left)))
    finally:
        Telemetry.__init__ = original  # type: ignore[method-assign]
        write_clock(run_dir, spawned_unix, starts[0] if starts else None)


def race_child(spec: dict[str, Any], cfg: RunCfg, run_dir: Path) -> None:
    """A race run in its child (``child.child_main``): the contender until the goal or a cap, then its clock."""
    goal = RaceGoal(**spec["race"])
    spawned = float(spec["spawned_unix"])
    framework, algo = spec["framework"], spec["algo"]
    if framework == "conveyor":
        run_conveyor(cfg, run_dir, goal, spawned)
        return
    if framework == "sb3":
        from conveyor.bench.zoo import run_zoo

        run_zoo(algo, cfg, run_dir, goal, spawned)  # writes its own clock
        return
    from conveyor.bench.external import run_external

    run_external(framework, algo, cfg, run_dir, goal, spawned)  # writes its own clock


# ---- bookkeeping -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Crossing:
    """Where a run stands in the race: ``reached`` the threshold within both caps at ``time_s`` from spawn
    (``steps`` env steps), or capped (``time_s`` and ``steps`` None)."""

    reached: bool
    time_s: float | None
    steps: float | None
    run_time_s: float | None = None
    """The crossing on the run's own clock (whether or not within the caps)."""


def race_crossing(curve: np.ndarray, threshold: float, startup_s: float, goal: RaceGoal,
                  window: int = WINDOW) -> Crossing:
    """The race result of a ``returns.csv`` curve (``[episodes, 3]``: env steps, run wall time, return) whose
    run clock started ``startup_s`` after its process was spawned: the first episode at which the mean of the
    last ``window`` returns reached ``threshold`` (only once ``window`` episodes exist), if within the caps."""
    from conveyor.bench.report import threshold_crossing

    found = threshold_crossing(curve, threshold, window)
    if found is None:
        return Crossing(False, None, None)
    steps, run_time = found
    race_time = startup_s + run_time
    if race_time > goal.time_limit_s or steps > goal.max_steps:
        return Crossing(False, None, None, run_time)
    return Crossing(True, race_time, steps, run_time)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def contender_label(row: dict[str, Any]) -> str:
    """``arch/algo`` for conveyor runs, ``framework algo`` for the peers (``sb3/ppo``, ...)."""
    return f"{row['arch']}/{row['algo']}"


def race_row(row: dict[str, Any], goal: RaceGoal) -> dict[str, Any]:
    """A bench results row (``report.result_row``) with its race result: reached, time and steps to the
    threshold from spawn, start-up, and how the run ended. The goal is the one the run's spec records (a
    ``--time-cap`` run's lower cap), else ``goal``, its env's."""
    from conveyor.returns_file import read_returns

    run_dir = Path(row["run_dir"])
    clock = _read_json(run_dir / CLOCK_FILE)
    summary = _read_json(run_dir / "summary.json")
    spec = _read_json(run_dir / SPEC_FILE)
    goal = RaceGoal(**spec["race"]) if spec.get("race") else goal
    startup = clock.get("startup_s")
    speed = spec.get("machine_speed")  # None for runs from before machine_speed.py
    crossing = Crossing(False, None, None)
    if startup is not None and row["status"] == "ok":
        try:
            crossing = race_crossing(read_returns(run_dir / "returns.csv"), goal.threshold, float(startup), goal)
        except ValueError:
            pass
    return {
        "env": row["env"], "contender": contender_label(row), "framework": row["framework"], "seed": row["seed"],
        "status": row["status"], "error": row["error"], "threshold": goal.threshold,
        "cap_time_s": goal.time_limit_s, "cap_steps": goal.max_steps, "reached": crossing.reached,
        "capped": row["status"] == "ok" and not crossing.reached, "time_to_threshold_s": crossing.time_s,
        "steps_to_threshold": crossing.steps, "startup_s": startup, "run_time_at_crossing_s": crossing.run_time_s,
        "env_steps": row["env_steps"], "run_wall_time_s": row["wall_time_s"],
        "return_mean_last100": row["return_mean_last100"], "stop_reason": row["stop_reason"],
        "settings": summary.get("recipe") or "", "machine_speed": speed, "run_dir": row["run_dir"],
    }


RACE_FIELDS = ("env", "contender", "framework", "seed", "status", "error", "threshold", "cap_time_s", "cap_steps",
               "reached", "capped", "time_to_threshold_s", "steps_to_threshold", "startup_s",
               "run_time_at_crossing_s", "env_steps", "run_wall_time_s", "return_mean_last100", "stop_reason",
               "settings", "machine_speed", "run_dir")
SUMMARY_FIELDS = ("env", "contender", "framework", "settings", "seeds", "seeds_ok", "seeds_reached", "threshold",
                  "cap_time_s", "cap_steps", "time_median_s", "time_min_s", "time_max_s", "steps_median",
                  "steps_min", "steps_max", "startup_median_s", "stop_steps_median", "stop_time_median_s",
                  "return_median_last100",
                  "machine_speed_median", "machine_speed_min", "machine_speed_max", "machine_speed_runs", "notes")


def _finite(value: Any) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def censored_stats(values: Sequence[float | None]) -> tuple[float, float, float] | None:
    """Median, min and max over seeds, a seed that did not reach (None) counting as infinitely slow: the
    median is finite only when more than half the seeds reached; None without seeds."""
    import numpy as np

    if not values:
        return None
    array = np.array([math.inf if value is None else float(value) for value in values])
    return float(np.median(array)), float(array.min()), float(array.max())


def summarize(rows: Sequence[dict[str, Any]], settings: dict[tuple[str, str], str]) -> list[dict[str, Any]]:
    """One line per (env, contender) over its seeds, in the rows' order. Seeds that failed or were skipped
    are left out of the statistics and named in ``notes``."""
    import numpy as np

    results = []
    for key in dict.fromkeys((row["env"], row["contender"]) for row in rows):
        group = [row for row in rows if (row["env"], row["contender"]) == key]
        ok = [row for row in group if row["status"] == "ok"]
        times = censored_stats([row["time_to_threshold_s"] for row in ok])
        steps = censored_stats([row["steps_to_threshold"] for row in ok])
        startups = [row["startup_s"] for row in ok if row["startup_s"] is not None]
        finals = [row["return_mean_last100"] for row in ok if _finite(row["return_mean_last100"])]
        stop_steps = [row["env_steps"] for row in ok if _finite(row["env_steps"])]
        stop_times = [float(row["startup_s"] or 0.0) + float(row["run_wall_time_s"]) for row in ok
                      if _finite(row.get("run_wall_time_s"))]
        speeds = [row["machine_speed"] for row in ok if _finite(row.get("machine_speed"))]
        notes = sorted({f"{row['status']}: {row['error']}" for row in group if row["status"] != "ok"})
        first = group[0]
        results.append({
            "env": key[0], "contender": key[1], "framework": first["framework"],
            "settings": settings.get(key) or first["settings"], "seeds": len(group), "seeds_ok": len(ok),
            "seeds_reached": sum(bool(row["reached"]) for row in ok), "threshold": first["threshold"],
            "cap_time_s": min(row["cap_time_s"] for row in group), "cap_steps": first["cap_steps"],
            "time_median_s": times and times[0], "time_min_s": times and times[1], "time_max_s": times and times[2],
            "steps_median": steps and steps[0], "steps_min": steps and steps[1], "steps_max": steps and steps[2],
            "startup_median_s": float(np.median(startups)) if startups else None,
            "stop_steps_median": float(np.median(stop_steps)) if stop_steps else None,
            "stop_time_median_s": float(np.median(stop_times)) if stop_times else None,
            "return_median_last100": float(np.median(finals)) if finals else None,
            "machine_speed_median": float(np.median(speeds)) if speeds else None,
            "machine_speed_min": min(speeds, default=None), "machine_speed_max": max(speeds, default=None),
            "machine_speed_runs": len(speeds), "notes": "; ".join(notes),
        })
    return results


# ---- the report -------------------------------------------------------------------------------------------
def _settings(suite: Suite) -> dict[tuple[str, str], str]:
    """What each contender ran with, for the table (peers' recipes come from their runs' summaries)."""
    settings: dict[tuple[str, str], str] = {}
    for run in suite.runs:
        label = f"{run.arch_label}/{run.algo_label or run.cfg.algo.name}"
        if run.framework == "conveyor" and run.flags:
            flags = list(run.flags)
            seed_at = flags.index("--seed")
            del flags[seed_at: seed_at + 2]
            settings[(run.cfg.env.id, label)] = f"`conveyor train {' '.join(flags)}` (presets)"
    return settings


def _time(value: float | None, digits: int = 1) -> str:
    """A time to threshold; a seed that did not reach has none: a cap, or its recipe's own budget, stopped it
    first (the at-stop column says where), so no time bound follows from it."""
    if value is None:
        return "-"
    return "not reached" if math.isinf(value) else f"{value:,.{digits}f} s"


def _steps(value: float | None) -> str:
    """Env steps to the threshold; a seed that did not reach has none ("-")."""
    return "-" if value is None or math.isinf(value) else f"{value:,.0f}"


def _cell(text: str, limit: int = 220) -> str:
    text = str(text).replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def race_table(env: RaceEnv, results: Sequence[dict[str, Any]]) -> list[str]:
    """An env's markdown table, fastest median first; capped and skipped contenders below, saying so."""
    rank = sorted(results, key=lambda r: (r["seeds_ok"] == 0, r["time_median_s"] is None,
                                          r["time_median_s"] if r["time_median_s"] is not None else 0.0))
    lines = ["| contender | reached | time to threshold: median (min-max) | env steps to threshold "
             "| start-up | machine speed | at stop: env steps, last-100 return | settings |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for result in rank:
        if not result["seeds_ok"]:
            status = result["notes"] or "no runs"
            lines.append(f"| {result['contender']} | - | {_cell(status, 160)} | - | - | - | - "
                         f"| {_cell(result['settings'])} |")
            continue
        time_text, steps_text = _time(result["time_median_s"]), _steps(result["steps_median"])
        if result["seeds_ok"] > 1 and result["seeds_reached"]:  # a spread only where some seed reached
            time_text += f" ({_time(result['time_min_s'])} - {_time(result['time_max_s'])})"
            steps_text += f" ({_steps(result['steps_min'])} - {_steps(result['steps_max'])})"
        reached = f"{result['seeds_reached']}/{result['seeds_ok']}"
        if result["notes"]:
            reached += f" ({_cell(result['notes'], 100)})"
        startup = "-" if result["startup_median_s"] is None else f"{result['startup_median_s']:.1f} s"
        final = "-" if result["return_median_last100"] is None else f"{result['return_median_last100']:.1f}"
        stopped = "-" if result["stop_steps_median"] is None else f"{result['stop_steps_median']:,.0f}"
        speed = _speed(result.get("machine_speed_median"))
        lines.append(f"| {result['contender']} | {reached} | {time_text} | {steps_text} | {startup} | {speed} "
                     f"| {stopped}, {final} | {_cell(result['settings'])} |")
    return lines


def _speed(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}/s"


def speed_note(results: Sequence[dict[str, Any]]) -> str:
    """Under an env's table (``results``: its ``summarize`` lines): a warning when its runs' machine speeds
    (``machine_speed.py``) lie further apart than ``SPEED_SPREAD``, and which contenders have runs from before the
    race recorded it; "" when every run has a speed and they are all about one."""
    lows = [r["machine_speed_min"] for r in results if r.get("machine_speed_min") is not None]
    highs = [r["machine_speed_max"] for r in results if r.get("machine_speed_max") is not None]
    unknown = [r["contender"] for r in results if r["seeds_ok"] and (r.get("machine_speed_runs") or 0) < r["seeds_ok"]]
    notes = []
    if lows and max(highs) > SPEED_SPREAD * min(lows):
        notes.append(f"The machine's speed moved between this table's runs, from {_speed(min(lows))} to "
                     f"{_speed(max(highs))} ({max(highs) / min(lows):.2f}x): times taken at speeds that far apart "
                     "are not side by side.")
    if lows and unknown:
        notes.append(f"The machine's speed was not recorded for runs of {', '.join(unknown)} (from before the race "
                     "recorded it).")
    return " ".join(notes)


def cap_note(env: RaceEnv, results: Sequence[dict[str, Any]]) -> str:
    """Under an env's table (``results``: its ``summarize`` lines): which contenders' runs were stopped sooner
    than the env's time cap (``--time-cap``); "" when none were."""
    lower = [f"{r['contender']} at {r['cap_time_s']:,.0f} s" for r in results
             if r["seeds_ok"] and r["cap_time_s"] is not None and r["cap_time_s"] < env.time_limit_s]
    if not lower:
        return ""
    return (f"Stopped sooner than this env's time cap (`--time-cap`), from spawn: {', '.join(lower)}; a run that "
            "did not reach by then reads `not reached`.")


def plot_race(env: RaceEnv, results: Sequence[dict[str, Any]], out_dir: Path) -> Path | None:
    """``race_<env>.png``: per contender that ran, the median time to threshold as a bar on a log scale with
    min-max whiskers; a median that did not reach is drawn hatched to where its runs stopped (a cap or the
    recipe's budget, in seconds from spawn: median), and labelled so."""
    from conveyor.plots import _pyplot, _save, file_safe

    ran = [result for result in results if result["seeds_ok"]]
    if not ran:
        return None
    ran.sort(key=lambda r: r["time_median_s"])
    plt = _pyplot()
    cap = env.time_limit_s
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(ran) + 1.6))
    floor = 0.5
    for y, result in enumerate(ran):
        median, low, high = result["time_median_s"], result["time_min_s"], result["time_max_s"]
        capped = math.isinf(median)
        stopped = min(result.get("stop_time_median_s") or cap, cap)
        width = (stopped if capped else median) - floor
        colour = {"conveyor": "tab:blue"}.get(result["framework"], "tab:orange")
        ax.barh(y, width, left=floor, color="white" if capped else colour, edgecolor=colour,
                hatch="///" if capped else None, linewidth=1.2)
        if result["seeds_ok"] > 1 and math.isfinite(low):  # min-max whisker; ">" at the cap: a seed did not reach
            ax.plot([low, min(high, cap)], [y, y], color="black", linewidth=1, marker="|", markersize=6)
            if math.isinf(high):
                ax.plot([cap], [y], marker=">", color="black", markersize=5)
        counts = f"({result['seeds_reached']}/{result['seeds_ok']})"
        at_stop = f"{result['stop_steps_median'] / 1e6:.2g}M steps, " if result["stop_steps_median"] else ""
        text = (f"not reached {counts}\nstopped at {at_stop}{stopped:,.0f} s" if capped
                else f"{median:,.1f} s {counts}")
        right = stopped if capped else cap if math.isinf(high) else max(median, high)  # right of bar and whisker
        ax.text(right * 1.12, y, text, va="center", fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(floor, cap * 6)
    ax.axvline(cap, color="grey", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(ran)), [result["contender"] for result in ran], fontsize=8)
    ax.invert_yaxis()
    absent = [result["contender"] for result in results if not result["seeds_ok"]]
    ax.set_xlabel(f"seconds from process start to a last-{WINDOW} mean return of {env.threshold:g} "
                  f"(median over seeds, min-max; log scale)"
                  + (f"\nnot run (skipped or failed, see the table): {', '.join(absent)}" if absent else ""),
                  fontsize=8)
    ax.set_title(f"{env.id}: time to {env.threshold:g} (cap {cap:,.0f} s, {env.max_steps:,} steps)", fontsize=9)
    ax.grid(axis="x", alpha=0.3, which="both")
    return _save(fig, out_dir / f"race_{file_safe(env.id)}.png", plt)


@functools.cache
def source_commit() -> str:
    """The short commit of the conveyor checkout this runs from ("" outside a git checkout), as it was at the first
    call: ``race_suite`` makes it when the invocation starts, before runs during which the checkout may move on."""
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return found.stdout.strip() if found.returncode == 0 else ""


def this_invocation(runs: int, elapsed_s: float, load: str, started_unix: float) -> dict[str, Any]:
    """The row of ``invocations.csv`` of this process's invocation, started at ``started_unix`` (its key: the
    suite rewrites the results after every run, and each rewrite updates the same row)."""
    return {"date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started_unix)), "commit": source_commit(),
            "command": shlex.join(["conveyor", *sys.argv[1:]]), "runs": runs, "elapsed_s": round(elapsed_s),
            "load": load, "note": "", "started_unix": f"{started_unix:.3f}"}


def read_invocations(path: Path) -> list[dict[str, Any]]:
    """The rows of an ``invocations.csv`` (none where there is no file). A row with more or fewer cells than the
    header (a hand-written note with an unquoted comma) raises ConfigError naming its line: a ``--merge`` race
    checks the file before its first run (``check_merge_target``), not after it."""
    import csv

    if not path.is_file():
        return []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    for number, row in enumerate(rows, start=2):
        if None in row or None in row.values():
            raise ConfigError(f"{path} line {number} has {'more' if None in row else 'fewer'} cells than its header "
                              f"({', '.join(reader.fieldnames or [])}): quote a cell that holds a comma")
    return rows


def check_merge_target(out: Path) -> None:
    """Refuse, before any run, a results folder whose ``invocations.csv`` a ``--merge`` could not rewrite."""
    read_invocations(out / INVOCATIONS_CSV)


def _runs(count: int) -> str:
    return f"{count} run" + ("" if count == 1 else "s")


def invocation_text(invocation: dict[str, Any]) -> str:
    parts = [invocation["date"] or "date unknown", f"commit {invocation['commit'] or 'unknown'}",
             f"`{invocation['command']}`",
             _runs(int(invocation["runs"])) + (f" in {invocation['elapsed_s']} s" if invocation["elapsed_s"] else "")]
    if invocation["load"]:
        parts.append(f"load average {invocation['load']}")
    return ", ".join(parts) + (f" ({invocation['note']})" if invocation.get("note") else "")


def race_report(suite: Suite, results: Sequence[dict[str, Any]], runs: int, elapsed_s: float,
                plots: Sequence[str], load: str, invocations: Sequence[dict[str, Any]] = ()) -> str:
    """The race's page; ``invocations``: those whose rows the ``runs`` are, when more than this one (``--merge``)."""
    from importlib.metadata import version

    command = "conveyor bench --suite race" + (" --quick" if suite.name.endswith("-quick") else
                                               " --full" if suite.name.endswith("-full") else "")
    machine = (f"{os.cpu_count()} cores ({platform.machine()}, Python {platform.python_version()}, torch "
               f"{version('torch')})")
    if len(invocations) > 1:
        provenance = (f"{_runs(runs)} on {machine}, from {len(invocations)} invocations merged with `--merge`: "
                      + "; ".join(invocation_text(invocation) for invocation in invocations) + ".")
    else:  # the invocation's own date and command where known (a --rewrite runs later, from another command)
        date, command = ((invocations[0]["date"], invocations[0]["command"]) if invocations
                         else (time.strftime("%Y-%m-%d"), command))
        provenance = f"{_runs(runs)} in {elapsed_s:.0f} s on {machine}, {date}; `{command}`; load average {load}."
    lines = [
        f"Suite `{suite.name}`: {suite.description}.", "",
        provenance, "",
        "Time to threshold: seconds from just before the run's process was spawned (Python start-up and imports "
        f"count) to the end of the first episode at which the mean return of the last {WINDOW} training episodes "
        "reached the threshold, within the caps (time and env steps); every contender stops there. Median over "
        "seeds (a seed that did not reach counts as infinitely slow: `not reached` unless over half did), "
        "min-max in brackets where any seed reached (a seed that did not: `not reached`, with no time bound: a cap "
        "or its recipe's budget stopped it, and the at-stop column says where). Start-up: from spawn to the start "
        "of the run's own clock, after "
        "its imports (median). Machine speed: how fast the shared machine was just before the run (a fixed "
        "training step on one torch thread, per second, `conveyor/bench/machine_speed.py`; median; `-` for runs from "
        "before it was recorded). At stop: where the run was when it stopped (threshold, a cap, or its recipe's own "
        "budget). Every conveyor contender runs with its presets alone; each peer with its own published "
        "settings (the settings column).",
    ]
    for env in suite.race_envs:
        env_results = [result for result in results if result["env"] == env.id]
        if not env_results:
            continue
        lines += ["", f"#### {env.id}: threshold {env.threshold:g}, cap {env.time_limit_s:,.0f} s and "
                      f"{env.max_steps:,} env steps", "", *race_table(env, env_results)]
        if note := " ".join(filter(None, (cap_note(env, env_results), speed_note(env_results)))):
            lines += ["", note]
        from conveyor.plots import file_safe

        stem = f"race_{file_safe(env.id)}"
        lines += ["", *(f"![{Path(p).stem}]({p})" for p in plots if Path(p).stem == stem)]
    return "\n".join(lines) + "\n"


def read_race_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``race.csv`` with their types back (numbers, None for empty, bools)."""
    import csv

    def typed(key: str, text: str) -> Any:
        if key in ("reached", "capped"):
            return text == "True"
        if key in ("seed",):
            return int(text)
        if key in ("threshold", "cap_time_s", "cap_steps", "time_to_threshold_s", "steps_to_threshold",
                   "startup_s", "run_time_at_crossing_s", "env_steps", "run_wall_time_s", "return_mean_last100",
                   "machine_speed"):
            if text in ("", "None"):
                return None
            return int(text) if text.lstrip("-").isdigit() else float(text)  # as it was written
        return text

    with open(path, newline="") as f:
        return [{key: typed(key, value) for key, value in row.items()} for row in csv.DictReader(f)]


def merged_rows(out: Path, suite: Suite, raced: list[dict[str, Any]]) -> tuple[Suite, list[dict[str, Any]], int]:
    """``raced`` with the rows of ``out``'s earlier ``race.csv`` that it does not rerun (the same env, contender
    and seed), in ``RACE_ENVS``' order of envs; ``suite`` made to describe them all; how many rows were kept."""
    new = {(row["env"], row["contender"], row["seed"]) for row in raced}
    kept = [row for row in read_race_csv(out / RACE_CSV) if (row["env"], row["contender"], row["seed"]) not in new]
    # An env of the earlier rows as they were raced (their threshold and caps: the highest, as rows stopped
    # sooner by --time-cap keep theirs), unless this invocation races it.
    known = {}
    for env_id in dict.fromkeys(row["env"] for row in kept):
        group = [row for row in kept if row["env"] == env_id]
        known[env_id] = RaceEnv(env_id, group[0]["threshold"], max(row["cap_steps"] for row in group),
                                max(row["cap_time_s"] for row in group))
    known.update((env.id, env) for env in suite.race_envs)
    ids = dict.fromkeys(row["env"] for row in (*kept, *raced))
    envs = tuple(known[env_id] for env_id in dict.fromkeys([*(e.id for e in RACE_ENVS), *ids]) if env_id in ids)
    order = {env.id: i for i, env in enumerate(envs)}
    rows = sorted([*kept, *raced], key=lambda row: order[row["env"]])  # stable: each env's rows keep their order
    seeds = sorted({int(row["seed"]) for row in rows})
    return dataclasses.replace(suite, race_envs=envs, description=race_description(envs, seeds)), rows, len(kept)


def write_race_results(suite: Suite, out: Path, rows: list[dict[str, Any]], elapsed_s: float,
                       markdown: Path | None = None, merge: bool = False, started_unix: float | None = None) -> None:
    """``race.csv``, ``race_summary.csv``, the charts, ``invocations.csv`` and ``results.md`` (and ``markdown``'s
    race section). ``merge``: with the rows of ``out``'s earlier ``race.csv`` that ``rows`` do not rerun
    (``merged_rows``) and its earlier invocations. ``started_unix``: when this invocation started (None: now less
    ``elapsed_s``); a rewrite by the same invocation replaces its row."""
    from conveyor.bench.report import write_csv

    goals = {env.id: env.goal() for env in suite.race_envs}
    settings = _settings(suite)
    raced = [race_row(row, goals[row["env"]]) for row in rows if row["env"] in goals]
    for row in raced:  # in race.csv too, so a later --merge still shows what a kept row ran with
        row["settings"] = row["settings"] or settings.get((row["env"], row["contender"]), "")
    load = " / ".join(f"{value:.1f}" for value in os.getloadavg()) + " (1 / 5 / 15 min, at the end)"
    started = time.time() - elapsed_s if started_unix is None else started_unix
    invocations = [this_invocation(len(raced), elapsed_s, load, started)]
    if merge and (out / RACE_CSV).is_file():
        suite, raced, kept = merged_rows(out, suite, raced)
        earlier = [row for row in read_invocations(out / INVOCATIONS_CSV)
                   if row.get("started_unix") != invocations[0]["started_unix"]]
        if kept and not earlier:  # a results folder from before invocations.csv
            earlier = [{"date": "", "commit": "", "command": "earlier invocations", "runs": kept, "elapsed_s": "",
                        "load": "", "note": "not recorded: from before invocations.csv"}]
        invocations[:0] = earlier
        suite = dataclasses.replace(suite, name=folder_suite_name([row["command"] for row in invocations]))
    write_csv(out / RACE_CSV, raced, RACE_FIELDS)
    write_csv(out / INVOCATIONS_CSV, invocations, INVOCATION_FIELDS)
    publish_race(suite, out, raced, invocations, settings, elapsed_s, load, markdown)


def folder_suite_name(commands: Sequence[str]) -> str:
    """The name of a results folder's tables, and of the markdown section they go to, from the commands of every
    invocation it holds: ``race-full`` or ``race-quick`` where all of them were, else ``race``. So a ``--full``
    invocation merged into the race's folder adds Pong's table to the ``race`` section, not a second copy of the
    whole section under ``race-full``."""
    for name, flag in (("race-full", "--full"), ("race-quick", "--quick")):
        if commands and all(flag in command for command in commands):
            return name
    return "race"


def rewrite_race_results(out: Path, markdown: Path | None = None) -> int:
    """``out``'s summary, charts and ``results.md`` (and ``markdown``'s race section) written again from its
    ``race.csv`` and ``invocations.csv``, running nothing: after a note in ``invocations.csv`` was edited or a
    superseded invocation dropped from it. Returns how many rows the tables hold."""
    if not (out / RACE_CSV).is_file():
        raise ConfigError(f"{out} holds no {RACE_CSV} to rewrite from: pass the --out of an earlier race")
    invocations = read_invocations(out / INVOCATIONS_CSV)
    name = folder_suite_name([invocation["command"] for invocation in invocations])
    suite, raced, _ = merged_rows(out, Suite(name, "", ()), [])
    if invocations and sum(int(invocation["runs"]) for invocation in invocations) < len(raced):
        raise ConfigError(f"{out / INVOCATIONS_CSV} accounts for fewer runs than {out / RACE_CSV} holds "
                          f"({len(raced)}): restore the invocation whose rows those are, or note them in one")
    last = invocations[-1] if invocations else {"elapsed_s": "", "load": ""}
    publish_race(suite, out, raced, invocations, {}, float(last["elapsed_s"] or 0.0), last["load"], markdown)
    return len(raced)


def publish_race(suite: Suite, out: Path, raced: list[dict[str, Any]], invocations: list[dict[str, Any]],
                 settings: dict[tuple[str, str], str], elapsed_s: float, load: str, markdown: Path | None) -> None:
    """``race_summary.csv``, the charts and ``results.md`` (and ``markdown``'s race section) of ``raced``."""
    from conveyor.bench.report import update_markdown_section, write_csv

    results = summarize(raced, settings)
    write_csv(out / SUMMARY_CSV, results, SUMMARY_FIELDS)
    plots = [path for env in suite.race_envs
             if (path := plot_race(env, [r for r in results if r["env"] == env.id], out)) is not None]
    (out / "results.md").write_text(race_report(suite, results, len(raced), elapsed_s, [p.name for p in plots],
                                                load, invocations))
    if markdown is not None:
        prefix = os.path.relpath(out, markdown.parent)
        body = race_report(suite, results, len(raced), elapsed_s, [f"{prefix}/{p.name}" for p in plots], load,
                           invocations)
        update_markdown_section(markdown, suite.name, body)
