"""`conveyor bench --suite race`: the race's bookkeeping, rl-zoo's settings as SB3 arguments, skipped peers,
and (slow) a small race end to end."""

import collections
import csv
import dataclasses
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conveyor.bench import external, race, run_suite, zoo
from conveyor.bench.race import (CLOCK_FILE, RaceEnv, censored_stats, race_crossing, race_row, race_suite,
                                 summarize, write_race_results)
from conveyor.bench.report import threshold_crossing
from conveyor.bench.runners import race_watch
from conveyor.bench.runners.race_watch import RaceWatch
from conveyor.bench.suites import RaceGoal, Suite
from conveyor.cli import main

GOAL = RaceGoal(threshold=10.0, max_steps=10_000, time_limit_s=100.0)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def curve(returns, seconds_per_episode=1.0, steps_per_episode=10):
    """returns.csv rows: episode i ends at (i + 1) * steps env steps and (i + 1) * seconds on the run's clock."""
    n = len(returns)
    return np.column_stack([np.arange(1, n + 1) * steps_per_episode, np.arange(1, n + 1) * seconds_per_episode,
                            np.asarray(returns, dtype=float)])


def fake_run(tmp_path, name, returns, *, startup=4.0, status="ok", env="CartPole-v1", contender=("paac", "a2c"),
             framework="conveyor", seed=0, seconds_per_episode=0.5, machine_speed=None, goal=None):
    """A finished bench run's directory (spec, clock, returns.csv, summary.json) and its results row; ``goal``:
    the race goal its spec records (as ``child.execute`` writes it)."""
    run_dir = tmp_path / "runs" / name
    run_dir.mkdir(parents=True)
    spawned = 1_000_000.0
    spec = {"spawned_unix": spawned}
    if machine_speed is not None:
        spec["machine_speed"] = machine_speed
    if goal is not None:
        spec["race"] = dataclasses.asdict(goal)
    (run_dir / "bench_spec.json").write_text(json.dumps(spec))
    (run_dir / CLOCK_FILE).write_text(json.dumps({"spawned_unix": spawned, "run_start_unix": spawned + startup,
                                                  "startup_s": startup}))
    data = curve(returns, seconds_per_episode)
    np.savetxt(run_dir / "returns.csv", data, delimiter=",", header="env_steps,wall_time_s,return", comments="",
               fmt=["%d", "%.3f", "%.3f"])
    (run_dir / "summary.json").write_text(json.dumps({"recipe": "" if framework == "conveyor" else "a recipe"}))
    row = {"name": name, "framework": framework, "arch": contender[0], "algo": contender[1], "env": env,
           "seed": seed, "status": status, "error": "" if status == "ok" else "boom", "env_steps": len(returns) * 10,
           "wall_time_s": len(returns) * seconds_per_episode, "return_mean_last100": float(np.mean(returns[-100:])),
           "stop_reason": "target_return reached", "run_dir": str(run_dir)}
    return row


# ---- bookkeeping ---------------------------------------------------------------------------------------
def test_crossing_time_is_the_spawn_offset_plus_the_runs_own_crossing_time():
    # 100 episodes of 0, then 10s: the last-100 mean reaches 10 * k / 100 >= 10 after k = 100 more episodes;
    # only once 100 episodes exist, as `conveyor train --target-return` stops.
    returns = [0.0] * 100 + [10.0] * 150
    crossing = race_crossing(curve(returns, 0.2), 10.0, 3.5, GOAL)
    assert crossing.reached and crossing.steps == 2000 and crossing.run_time_s == pytest.approx(40.0)
    assert crossing.time_s == pytest.approx(3.5 + 40.0)
    # The first 99 episodes' high returns do not count: fewer than 100 episodes.
    early = race_crossing(curve([50.0] * 99 + [0.0] * 50), 10.0, 0.0, GOAL)
    assert early.reached and early.steps == 1000  # the 100th episode: mean 49.5


def test_never_reached_or_past_a_cap_is_capped():
    assert race_crossing(curve([1.0] * 500), 10.0, 1.0, GOAL) == race.Crossing(False, None, None)
    assert not race_crossing(curve([1.0] * 50), 10.0, 1.0, GOAL).reached  # fewer than 100 episodes
    # Crossed at run time 100 s: with 2 s of start-up that is past the 100 s cap, and the row keeps when.
    late = race_crossing(curve([20.0] * 100, 1.0), 10.0, 2.0, GOAL)
    assert not late.reached and late.time_s is None and late.run_time_s == pytest.approx(100.0)
    # Crossed within the time cap but beyond the step cap.
    assert not race_crossing(curve([20.0] * 100, 0.1, steps_per_episode=200), 10.0, 0.0, GOAL).reached


def test_race_rows_and_medians_with_spread_over_seeds(tmp_path):
    rows = [fake_run(tmp_path, "a-s0", [20.0] * 100, startup=4.0, seconds_per_episode=0.5),  # 4 + 50 s
            fake_run(tmp_path, "a-s1", [20.0] * 100, startup=6.0, seconds_per_episode=0.3, seed=1),  # 6 + 30 s
            fake_run(tmp_path, "a-s2", [1.0] * 300, startup=5.0, seed=2),  # never reaches
            fake_run(tmp_path, "b-s0", [1.0] * 300, contender=("sb3", "ppo"), framework="sb3"),
            fake_run(tmp_path, "b-s1", [20.0] * 100, contender=("sb3", "ppo"), framework="sb3", seed=1),
            fake_run(tmp_path, "b-s2", [20.0] * 100, contender=("sb3", "ppo"), framework="sb3", seed=2,
                     status="failed")]
    raced = [race_row(row, GOAL) for row in rows]
    assert [row["reached"] for row in raced] == [True, True, False, False, True, False]
    assert [row["capped"] for row in raced] == [False, False, True, True, False, False]  # failed: not capped
    assert raced[0]["time_to_threshold_s"] == pytest.approx(54.0) and raced[1]["time_to_threshold_s"] == 36.0
    assert raced[0]["steps_to_threshold"] == 1000 and raced[2]["time_to_threshold_s"] is None
    assert raced[0]["startup_s"] == 4.0 and raced[3]["settings"] == "a recipe"

    paac, sb3 = summarize(raced, {})
    assert (paac["contender"], paac["seeds"], paac["seeds_ok"], paac["seeds_reached"]) == ("paac/a2c", 3, 3, 2)
    assert paac["time_median_s"] == pytest.approx(54.0) and paac["time_min_s"] == pytest.approx(36.0)
    assert math.isinf(paac["time_max_s"]) and paac["steps_median"] == 1000
    assert paac["startup_median_s"] == 5.0
    # sb3/ppo: one of two finished seeds reached, so the censored median is "not reached"; the failure is noted.
    assert (sb3["seeds_ok"], sb3["seeds_reached"]) == (2, 1) and math.isinf(sb3["time_median_s"])
    assert sb3["notes"] == "failed: boom"


def test_censored_median_is_finite_only_when_over_half_reached():
    assert censored_stats([]) is None
    assert censored_stats([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert censored_stats([3.0, None, 1.0]) == (3.0, 1.0, math.inf)
    assert math.isinf(censored_stats([3.0, None, None])[0])
    assert math.isinf(censored_stats([3.0, None])[0])


def test_report_table_chart_and_csvs(tmp_path):
    env = RaceEnv("CartPole-v1", 10.0, 10_000, 100.0)
    rows = [fake_run(tmp_path, "a-s0", [20.0] * 100),
            fake_run(tmp_path, "b-s0", [1.0] * 300, contender=("sb3", "dqn"), framework="sb3")]
    rows.append({**rows[1], "name": "c-s0", "arch": "cleanrl", "algo": "ppo", "framework": "cleanrl",
                 "status": "skipped", "error": "not installed here", "run_dir": str(tmp_path / "runs" / "c-s0")})
    suite = Suite("race", "a test race", (), race_envs=(env,))
    markdown = tmp_path / "BENCHMARKS.md"
    markdown.write_text("# Benchmarks\n\nOther sections.\n")
    write_race_results(suite, tmp_path, rows, 12.0, markdown=markdown)
    text = (tmp_path / "results.md").read_text()
    assert "| paac/a2c | 1/1 | 54.0 s | 1,000 | 4.0 s | - | 1,000, 20.0 |" in text
    assert "| sb3/dqn | 0/1 | not reached | - | 4.0 s | - | 3,000, 1.0 | a recipe |" in text
    assert "The machine's speed" not in text  # no run recorded one: nothing to compare
    assert "| cleanrl/ppo | - | skipped: not installed here |" in text
    assert "![race_CartPole-v1](race_CartPole-v1.png)" in text
    assert (tmp_path / "race_CartPole-v1.png").read_bytes()[:8] == PNG_MAGIC
    with open(tmp_path / "race.csv") as f:
        assert [row["reached"] for row in csv.DictReader(f)] == ["True", "False", "False"]
    with open(tmp_path / "race_summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert [row["contender"] for row in summary] == ["paac/a2c", "sb3/dqn", "cleanrl/ppo"]
    # sb3/dqn stopped without reaching: its 300 episodes of 0.5 s after a 4 s start-up, from spawn (the chart's bar)
    assert float(summary[1]["stop_time_median_s"]) == pytest.approx(154.0)
    assert summary[1]["stop_steps_median"] == "3000.0"
    published = markdown.read_text()
    assert published.startswith("# Benchmarks\n\nOther sections.\n")
    assert "<!-- conveyor bench --suite race: start -->" in published and "(./race_CartPole-v1.png)" in published


def test_the_table_shows_the_machine_speed_and_warns_when_it_moved_between_runs(tmp_path):
    env = RaceEnv("CartPole-v1", 10.0, 10_000, 100.0)
    suite = Suite("race", "a test race", (), race_envs=(env,))

    def page(speeds):
        rows = [fake_run(tmp_path / str(len(list(tmp_path.iterdir()))), f"{i}", [20.0] * 100, seed=i,
                         contender=(("paac", "a2c"), ("sb3", "ppo"))[i % 2], machine_speed=speed)
                for i, speed in enumerate(speeds)]
        write_race_results(suite, tmp_path, rows, 1.0)
        return (tmp_path / "results.md").read_text()

    steady = page([1000.0, 1100.0, 1050.0, 1090.0])  # within SPEED_SPREAD: no warning
    assert "| paac/a2c | 2/2 | 54.0 s (54.0 s - 54.0 s) | 1,000 (1,000 - 1,000) | 4.0 s | 1,025/s |" in steady
    assert "| 4.0 s | 1,095/s |" in steady and "The machine's speed" not in steady
    moved = page([1000.0, 2200.0, 1000.0, 2200.0])  # SB3's seeds ran on a 2.2x faster machine
    assert ("The machine's speed moved between this table's runs, from 1,000/s to 2,200/s (2.20x): times taken "
            "at speeds that far apart are not side by side.") in moved
    partly = page([1000.0, None, 1000.0, 1000.0])  # a run from before the speed was recorded
    assert "The machine's speed was not recorded for runs of sb3/ppo (from before the race recorded it)." in partly
    with open(tmp_path / "race.csv") as f:
        assert [row["machine_speed"] for row in csv.DictReader(f)] == ["1000.0", "", "1000.0", "1000.0"]


def test_the_machine_speed_workload_is_timed_on_one_thread_and_leaves_torch_as_it_was():
    import torch

    from conveyor.bench.machine_speed import machine_speed

    threads = torch.get_num_threads()
    assert machine_speed(seconds=0.05) > 0
    assert torch.get_num_threads() == threads


def test_merge_keeps_earlier_rows_that_a_rerun_does_not_replace(tmp_path):
    """``--merge``: a later invocation on another env adds its tables to the earlier ones; a rerun of one
    contender's seed replaces that row alone; the numbers read back from race.csv make the same summary."""
    cartpole, acrobot = RaceEnv("CartPole-v1", 10.0, 10_000, 200.0), RaceEnv("Acrobot-v1", 10.0, 10_000, 200.0)
    first = [fake_run(tmp_path / "a", f"p-s{seed}", [20.0] * 100, seed=seed) for seed in (0, 1)]
    first.append(fake_run(tmp_path / "a", "d-s0", [1.0] * 300, contender=("sb3", "dqn"), framework="sb3"))
    write_race_results(Suite("race", "first", (), race_envs=(cartpole,)), tmp_path, first, 10.0)
    before = (tmp_path / "race_summary.csv").read_text()
    rerun = [fake_run(tmp_path / "b", "p-s1", [20.0] * 100, seed=1, startup=54.0)]  # the same contender and seed
    acro = [fake_run(tmp_path / "b", "q-s0", [20.0] * 100, env="Acrobot-v1")]
    for elapsed in (2.0, 5.0):  # as run_suite does: the results rewritten after each run, one invocation
        write_race_results(Suite("race", "second", (), race_envs=(acrobot,)), tmp_path, acro, elapsed, merge=True,
                           started_unix=1e9)
    assert (tmp_path / "race_summary.csv").read_text().startswith(before.rstrip("\n"))  # CartPole's lines as they were
    write_race_results(Suite("race", "third", (), race_envs=(cartpole,)), tmp_path, rerun, 5.0, merge=True)
    with open(tmp_path / "race.csv") as f:
        raced = [(row["env"], row["contender"], row["seed"], row["time_to_threshold_s"]) for row in csv.DictReader(f)]
    assert raced == [("CartPole-v1", "paac/a2c", "0", "54.0"), ("CartPole-v1", "sb3/dqn", "0", ""),
                     ("CartPole-v1", "paac/a2c", "1", "104.0"), ("Acrobot-v1", "paac/a2c", "0", "54.0")]
    text = (tmp_path / "results.md").read_text()
    assert "(CartPole-v1 10, Acrobot-v1 10)" in text and "seeds 0,1." in text
    assert "4 runs on " in text and "from 3 invocations merged with `--merge`: " in text
    with open(tmp_path / "invocations.csv") as f:
        assert [int(row["runs"]) for row in csv.DictReader(f)] == [3, 1, 1]  # each invocation's own runs
    assert "| paac/a2c | 2/2 | 79.0 s (54.0 s - 104.0 s) |" in text
    assert "#### Acrobot-v1" in text and (tmp_path / "race_Acrobot-v1.png").is_file()
    write_race_results(Suite("race", "fresh", (), race_envs=(acrobot,)), tmp_path, acro, 5.0)  # no --merge
    with open(tmp_path / "race.csv") as f:
        assert [row["env"] for row in csv.DictReader(f)] == ["Acrobot-v1"]
    with open(tmp_path / "invocations.csv") as f:
        assert len(list(csv.DictReader(f))) == 1  # a fresh table: this invocation's alone
    assert "1 run in 5 s on " in (tmp_path / "results.md").read_text()


def test_a_full_invocation_merged_into_the_race_folder_updates_the_race_section(tmp_path, monkeypatch):
    """Pong raced with ``--full --merge`` into the folder of the other envs' invocations adds its table to that
    folder's ``race`` section (once a second ``race-full`` section repeated every table); a folder of ``--full``
    invocations alone keeps its own name, on a merge and on a rewrite."""
    cartpole, pong = RaceEnv("CartPole-v1", 10.0, 10_000, 200.0), RaceEnv("ALE/Pong-v5", 0.0, 10_000, 200.0)
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n<!-- conveyor bench --suite race: start -->\nold\n<!-- conveyor bench --suite race: "
                    "end -->\n")
    out, full = tmp_path / "race", tmp_path / "full"
    out.mkdir()
    full.mkdir()
    monkeypatch.setattr(sys, "argv", ["conveyor", "bench", "--suite", "race", "--envs", "CartPole"])
    write_race_results(Suite("race", "", (), race_envs=(cartpole,)), out, [fake_run(tmp_path / "a", "p-s0",
                       [20.0] * 100)], 10.0, markdown=page, started_unix=1e9)
    monkeypatch.setattr(sys, "argv", ["conveyor", "bench", "--suite", "race", "--full", "--envs", "Pong", "--merge"])
    write_race_results(Suite("race-full", "", (), race_envs=(pong,)), out, [fake_run(tmp_path / "b", "p-s0",
                       [20.0] * 100, env="ALE/Pong-v5")], 10.0, markdown=page, merge=True, started_unix=2e9)
    text = page.read_text()
    assert "race-full" not in text and text.count("#### CartPole-v1") == 1 and text.count("#### ALE/Pong-v5") == 1
    assert (out / "results.md").read_text().startswith("Suite `race`: ")
    assert main(["bench", "--suite", "race", "--rewrite", "--out", str(out), "--markdown", str(page)]) == 0
    assert page.read_text() == text
    for started in (1e9, 2e9):  # --full invocations alone: their own folder's name
        write_race_results(Suite("race-full", "", (), race_envs=(pong,)), full, [fake_run(
            tmp_path / "c", f"p-s0-{started:.0f}", [20.0] * 100, env="ALE/Pong-v5")], 10.0, merge=True,
            started_unix=started)
        assert (full / "results.md").read_text().startswith("Suite `race-full`: ")


def test_rewrite_renders_the_tables_again_from_the_folder_after_an_edited_invocation(tmp_path, capsys):
    """``--rewrite``: dropping a superseded invocation and adding a note to another shows in results.md and in
    the markdown's section, with every row kept and nothing run; misuse is a one-line usage error."""
    cartpole = RaceEnv("CartPole-v1", 10.0, 10_000, 200.0)
    first = [fake_run(tmp_path / "a", f"p-s{seed}", [20.0] * 100, seed=seed) for seed in (0, 1)]
    write_race_results(Suite("race", "first", (), race_envs=(cartpole,)), tmp_path, first, 10.0, started_unix=1e9)
    again = [fake_run(tmp_path / "b", f"p-s{seed}", [20.0] * 100, seed=seed, startup=2.0) for seed in (0, 1)]
    write_race_results(Suite("race", "second", (), race_envs=(cartpole,)), tmp_path, again, 8.0, merge=True,
                       started_unix=2e9)
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n<!-- conveyor bench --suite race: start -->\nold\n<!-- conveyor bench --suite race: "
                    "end -->\n")
    with open(tmp_path / race.INVOCATIONS_CSV, newline="") as f:
        invocations = list(csv.DictReader(f))
    assert len(invocations) == 2 and "from 2 invocations merged" in (tmp_path / "results.md").read_text()
    invocations[1]["note"] = "the second, with a comma"
    race_csv = (tmp_path / race.RACE_CSV).read_text()
    with open(tmp_path / race.INVOCATIONS_CSV, "w", newline="") as f:  # the first's rows were all rerun: dropped
        writer = csv.DictWriter(f, race.INVOCATION_FIELDS)
        writer.writeheader()
        writer.writerow(invocations[1])
    assert main(["bench", "--suite", "race", "--rewrite", "--out", str(tmp_path), "--markdown", str(page)]) == 0
    assert "rewrote the race's tables of 2 runs" in capsys.readouterr().out
    text = (tmp_path / "results.md").read_text()
    assert "2 runs in 8 s on " in text and "merged" not in text and "| paac/a2c | 2/2 | 52.0 s" in text
    assert f", {invocations[1]['date']}; `{invocations[1]['command']}`;" in text  # when it ran, not today
    assert "| paac/a2c | 2/2 | 52.0 s" in page.read_text() and "\nold\n" not in page.read_text()
    assert (tmp_path / race.RACE_CSV).read_text() == race_csv  # the rows as they were
    invocations[0]["note"] = "kept for the test"
    with open(tmp_path / race.INVOCATIONS_CSV, "w", newline="") as f:
        writer = csv.DictWriter(f, race.INVOCATION_FIELDS)
        writer.writeheader()
        writer.writerows(invocations)
    assert main(["bench", "--suite", "race", "--rewrite", "--out", str(tmp_path)]) == 0
    assert "(the second, with a comma)" in (tmp_path / "results.md").read_text()
    capsys.readouterr()
    for flags, named in ((["--merge"], "leave out --merge"), (["--only", "paac"], "leave out --only"),
                         (["--out", str(tmp_path / "none")], "holds no race.csv")):
        assert main(["bench", "--suite", "race", "--rewrite", "--out", str(tmp_path), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0], err
    assert main(["bench", "--suite", "quick", "--rewrite"]) == 2
    assert "--rewrite belongs to the race suite" in capsys.readouterr().err


def test_a_merge_into_an_invocations_csv_it_cannot_rewrite_is_refused_before_any_run(tmp_path, capsys):
    """A hand-written note with an unquoted comma once crashed a race's rewrite after its first 7-minute run and
    truncated the file; now the race refuses at once, in one line, and the file stays as it was."""
    from conveyor.cli import main

    header = ",".join(race.INVOCATION_FIELDS)
    broken = f"{header}\n2026-11-28,abc1234,conveyor bench --suite race,3,75,,a note, with a comma,1795896368.2\n"
    (tmp_path / race.INVOCATIONS_CSV).write_text(broken)
    assert main(["bench", "--suite", "race", "--quick", "--only", "paac-a2c", "--merge", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 2 has more cells than its header" in err[0] and "quote" in err[0], err
    assert (tmp_path / race.INVOCATIONS_CSV).read_text() == broken
    assert not (tmp_path / "runs").exists()


def test_a_time_cap_judges_its_rows_by_its_own_cap_and_the_table_says_which(tmp_path):
    """``--time-cap``: a run's row is judged against the cap its spec records, not the env's, and the env's
    table keeps the env's cap in its title and names the contenders stopped sooner, on a merge too."""
    cartpole, acrobot = RaceEnv("CartPole-v1", 10.0, 10_000, 100.0), RaceEnv("Acrobot-v1", 10.0, 10_000, 100.0)
    sooner = dataclasses.replace(cartpole.goal(), time_limit_s=50.0)
    rows = [fake_run(tmp_path / "a", "p-s0", [20.0] * 100, goal=cartpole.goal()),  # 54 s: within 100 s
            fake_run(tmp_path / "a", "d-s0", [20.0] * 100, contender=("sb3", "dqn"), framework="sb3", goal=sooner)]
    write_race_results(Suite("race", "", (), race_envs=(cartpole,)), tmp_path, rows, 10.0)
    with open(tmp_path / "race.csv") as f:
        raced = list(csv.DictReader(f))
    assert [(row["reached"], row["cap_time_s"]) for row in raced] == [("True", "100.0"), ("False", "50.0")]
    assert raced[1]["run_time_at_crossing_s"] == "50.0"  # it crossed at 54 s from spawn: past its own cap
    text = (tmp_path / "results.md").read_text()
    assert "#### CartPole-v1: threshold 10, cap 100 s and 10,000 env steps" in text
    assert "| sb3/dqn | 0/1 | not reached |" in text
    note = ("Stopped sooner than this env's time cap (`--time-cap`), from spawn: sb3/dqn at 50 s; a run that did "
            "not reach by then reads `not reached`.")
    assert note in text
    # Merged with an invocation on another env, the kept rows' env keeps its own cap, the highest of its rows.
    write_race_results(Suite("race", "", (), race_envs=(acrobot,)), tmp_path,
                       [fake_run(tmp_path / "b", "q-s0", [20.0] * 100, env="Acrobot-v1")], 5.0, merge=True)
    text = (tmp_path / "results.md").read_text()
    assert "#### CartPole-v1: threshold 10, cap 100 s and" in text and note in text
    assert text.count("Stopped sooner") == 1  # Acrobot's runs ran to its cap


# ---- the suite -----------------------------------------------------------------------------------------
def test_a_time_cap_lowers_each_runs_cap_and_never_raises_it(tmp_path, monkeypatch):
    monkeypatch.setenv(external.PEERS_DIR_ENV, str(tmp_path / "no-peers"))
    envs = [RaceEnv("CartPole-v1", 475.0, 500_000, 600.0), RaceEnv("Acrobot-v1", -100.0, 1_000_000, 60.0)]
    suite = race_suite((0,), envs=envs, time_cap_s=120.0)
    caps = {(run.cfg.env.id, run.cfg.time_limit_s, run.race.time_limit_s) for run in suite.runs}
    assert caps == {("CartPole-v1", 120.0, 120.0), ("Acrobot-v1", 60.0, 60.0)}  # the sooner of the two
    assert [env.time_limit_s for env in suite.race_envs] == [600.0, 60.0]  # the envs' own, for the tables
    for bad in (0.0, -5.0, math.nan, math.inf):
        with pytest.raises(race.ConfigError, match="--time-cap .* is not a positive number of seconds"):
            race_suite((0,), envs=envs, time_cap_s=bad)


def test_suite_contenders_flags_and_variants(tmp_path, monkeypatch):
    monkeypatch.setenv(external.PEERS_DIR_ENV, str(tmp_path / "no-peers"))
    suite = race_suite(quick=True)
    assert suite.name == "race-quick" and [env.id for env in suite.race_envs] == ["CartPole-v1", "Acrobot-v1"]
    assert {run.cfg.seed for run in suite.runs} == {0}
    assert all(run.cfg.time_limit_s == race.QUICK_TIME_LIMIT_S and run.race is not None for run in suite.runs)
    cartpole = [run for run in suite.runs if run.cfg.env.id == "CartPole-v1"]
    labels = [f"{run.arch_label}/{run.algo_label or run.cfg.algo.name}" for run in cartpole]
    assert labels == ["paac/a2c", "paac/ppo", "hts/a2c", "hts/ppo", "ga3c/ga3c", "seed/vtrace", "seed/r2d2",
                      "impact/impact", "sb3/a2c", "sb3/ppo", "sb3/dqn", "sample-factory/appo", "cleanrl/ppo"]
    for run in cartpole[:8]:  # conveyor: only arch, algo, env and seed (and the step cap where the preset's budget
        # is above it); the threshold stops the run
        assert run.flags[::2][:4] == ("--arch", "--algo", "--env", "--seed")
        assert run.flags[8:] in ((), ("--total-steps", "500000"))
        assert run.cfg.target_return == 475.0 and run.cfg.total_steps <= 500_000
    assert [run.arch_label for run in cartpole[:8] if len(run.flags) > 8] == ["seed"]  # seed/vtrace's preset: 1M
    assert cartpole[-1].skip_reason.endswith("is not built (make peers)")

    envs = [RaceEnv("Pendulum-v1", -250.0, 1_000_000, 60.0)]
    pendulum = race_suite((1, 2), envs=envs)
    labels = {f"{run.arch_label}/{run.algo_label or run.cfg.algo.name}" for run in pendulum.runs}
    assert not labels & {"ga3c/ga3c", "seed/r2d2", "sb3/dqn"}  # discrete actions only
    assert {"paac/a2c", "paac/ppo", "hts/ppo", "impact/impact", "sb3/a2c", "sb3/ppo"} <= labels
    assert len(pendulum.runs) == 2 * len(labels)
    assert [env.id for env in race.race_envs()] == [env.id for env in race.RACE_ENVS if not env.full_only]
    assert race.race_envs(full=True)[-1].id == "ALE/Pong-v5"


def test_cli_flags(capsys):
    assert main(["bench", "--suite", "race", "--quick", "--list", "--only", "sb3"]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in listed] == [f"sb3-{algo}-{env}-s0" for env in ("CartPole-v1", "Acrobot-v1")
                                                       for algo in ("a2c", "ppo", "dqn")]
    assert main(["bench", "--suite", "quick", "--full"]) == 2
    assert "--full belongs to the race suite" in capsys.readouterr().err
    assert main(["bench", "--suite", "race", "--quick", "--full", "--list"]) == 2
    assert main(["bench", "--suite", "peers", "--quick"]) == 2
    capsys.readouterr()
    assert main(["bench", "--suite", "race", "--quick", "--list", "--only", "sb3-a2c", "--time-cap", "5"]) == 0
    assert all(", 5 s cap," in line for line in capsys.readouterr().out.strip().splitlines())
    for flags, named in ((["--suite", "quick", "--time-cap", "5"], "--time-cap belongs to the race suite"),
                         (["--suite", "race", "--time-cap", "-1", "--list"], "not a positive number of seconds"),
                         (["--suite", "race", "--rewrite", "--time-cap", "5"], "leave out --time-cap")):
        assert main(["bench", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0], err


def test_peers_not_installed_are_skipped_rows(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "stable_baselines3" else real_find_spec(name, *args))
    monkeypatch.setenv(external.PEERS_DIR_ENV, str(tmp_path / "no-peers"))
    race.sb3_skip_reason.cache_clear()
    try:
        suite = race_suite(envs=[RaceEnv("CartPole-v1", 475.0, 500_000, 60.0)], seeds=(0,))
    finally:
        race.sb3_skip_reason.cache_clear()
    peers = dataclasses.replace(suite, runs=tuple(run for run in suite.runs if run.framework != "conveyor"))
    rows = run_suite(peers, tmp_path / "out", log=lambda line: None)
    assert [row["status"] for row in rows] == ["skipped"] * 5
    errors = [row["error"] for row in rows]
    assert errors[:3] == [zoo.SB3_NOT_INSTALLED] * 3
    assert errors[3].startswith("sample-factory's venv") and errors[4].startswith("cleanrl's venv")
    assert all(error.endswith("is not built (make peers)") for error in errors[3:])
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| sb3/ppo | - | skipped: stable-baselines3 is not installed" in table


# ---- rl-zoo's settings ---------------------------------------------------------------------------------
needs_zoo = pytest.mark.skipif(zoo.zoo_version() is None, reason="rl_zoo3 is not installed (make bench-deps)")


@needs_zoo
def test_rl_zoo_cartpole_a2c_and_ppo_from_the_installed_package():
    a2c = zoo.zoo_recipe("a2c", "CartPole-v1")
    assert (a2c.key, a2c.n_envs, a2c.n_timesteps, a2c.policy) == ("CartPole-v1", 8, 500_000, "MlpPolicy")
    assert a2c.kwargs == {"ent_coef": 0.0} and a2c.normalize is None and not a2c.notes
    ppo = zoo.zoo_recipe("ppo", "CartPole-v1")
    assert (ppo.n_envs, ppo.n_timesteps, ppo.policy) == (8, 100_000, "MlpPolicy")
    assert ppo.kwargs == {"n_steps": 32, "batch_size": 256, "gae_lambda": 0.8, "gamma": 0.98, "n_epochs": 20,
                          "ent_coef": 0.0, "learning_rate": zoo.LinearSchedule(0.001),
                          "clip_range": zoo.LinearSchedule(0.2)}
    assert ppo.kwargs["learning_rate"](0.25) == pytest.approx(0.00025)
    assert "rl-zoo 2.9.2 ppo.yml, its own entry" == ppo.source
    # No entry of its own: DQN has none for Pendulum (nor is it an Atari id); MinAtar takes the atari entry.
    assert zoo.zoo_recipe("dqn", "Pendulum-v1") is None
    minatar = zoo.zoo_recipe("ppo", "MinAtar/Breakout-v1")
    assert minatar.key == "atari" and minatar.policy == "MlpPolicy" and minatar.env_wrapper is None
    assert minatar.frame_stack is None and "MinAtar has no rl-zoo entry" in minatar.source


def test_rl_zoo_translation_of_normalize_policy_kwargs_and_wrappers():
    import torch

    pendulum = zoo.translate("a2c", "Pendulum-v1", "Pendulum-v1", {
        "normalize": True, "n_envs": 8, "n_timesteps": 1e6, "policy": "MlpPolicy", "gamma": 0.9, "use_sde": True,
        "learning_rate": "lin_7e-4", "policy_kwargs": "dict(log_std_init=-2, ortho_init=False)"})
    assert pendulum.normalize == {"gamma": 0.9} and pendulum.n_timesteps == 1_000_000
    assert pendulum.kwargs == {"gamma": 0.9, "use_sde": True, "learning_rate": zoo.LinearSchedule(7e-4),
                               "policy_kwargs": {"log_std_init": -2, "ortho_init": False}}
    acrobot = zoo.translate("ppo", "Acrobot-v1", "Acrobot-v1", {"normalize": "dict(norm_obs=True, norm_reward=False)",
                                                                "n_timesteps": 1e6, "policy": "MlpPolicy"})
    assert acrobot.normalize == {"norm_obs": True, "norm_reward": False} and acrobot.n_envs == 1
    assert zoo.eval_kwargs("dict(net_arch=dict(pi=[64], vf=[64]), activation_fn=nn.ReLU)") == {
        "net_arch": {"pi": [64], "vf": [64]}, "activation_fn": torch.nn.ReLU}
    with pytest.raises(ValueError, match="cannot evaluate"):
        zoo.eval_kwargs("__import__('os').system('true')")
    with pytest.raises(ValueError, match="not translated"):
        zoo.translate("ppo", "CartPole-v1", "CartPole-v1", {"n_timesteps": 1, "policy": "MlpPolicy", "callback": "x"})
    pong = zoo.translate("dqn", "ALE/Pong-v5", "atari", {
        "env_wrapper": ["stable_baselines3.common.atari_wrappers.AtariWrapper"], "frame_stack": 4,
        "policy": "CnnPolicy", "n_timesteps": 1e7, "train_freq": [4, "step"]})
    assert pong.frame_stack == 4 and pong.policy == "CnnPolicy" and pong.kwargs == {"train_freq": (4, "step")}
    assert "frameskip=1" in pong.notes[0]


# ---- the peers' runners ---------------------------------------------------------------------------------
def load_cleanrl_runner():
    """``cleanrl_runner.py`` as its venv runs it, by path (it imports only the standard library and its sibling
    ``race_watch`` until its ``main``)."""
    import sys

    spec = importlib.util.spec_from_file_location("cleanrl_runner_under_test",
                                                  external.RUNNERS / "cleanrl_runner.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_race_watch_stops_at_the_first_full_window_at_the_threshold():
    watch = RaceWatch(threshold=10.0, window=3, max_steps=1_000, time_limit_s=math.inf, started_unix=0.0,
                      run_start_unix=0.0)
    watch.episode(30.0, 5)
    watch.episode(30.0, 9)
    assert watch.stop_reason(9) == ""  # a mean of 30 over 2 episodes: the window is not full yet
    watch.episode(-29.0, 12)  # (30 + 30 - 29) / 3 = 10.33
    assert watch.stop_reason(12) == race_watch.TARGET_REACHED == watch.ended
    assert [(steps, value) for steps, _, value in watch.rows] == [(5, 30.0), (9, 30.0), (12, -29.0)]


def test_race_watch_caps_steps_and_time_and_writes_what_external_reads(tmp_path):
    watch = RaceWatch(10.0, 100, max_steps=3, time_limit_s=math.inf, started_unix=0.0, run_start_unix=0.0)
    assert watch.stop_reason(2) == "" and watch.ended == race_watch.OWN_BUDGET
    assert watch.stop_reason(3) == race_watch.STEP_CAP
    late = RaceWatch(10.0, 100, max_steps=10, time_limit_s=5.0, started_unix=0.0, run_start_unix=0.0)
    assert late.stop_reason(1) == race_watch.TIME_CAP  # the deadline, 5 s after the unix epoch, is long past
    watch.episode(4.0, 2)
    watch.write(tmp_path, "peer_result.json", 3, status=0, device="cpu")
    result = json.loads((tmp_path / "peer_result.json").read_text())
    assert {key: result[key] for key in ("stop_reason", "env_steps", "episodes", "return_mean_last100", "status")} \
        == {"stop_reason": race_watch.STEP_CAP, "env_steps": 3, "episodes": 1, "return_mean_last100": 4.0,
            "status": 0}
    assert (tmp_path / "returns.csv").read_text().splitlines()[1].split(",")[::2] == ["2", "4.000"]


def test_cleanrl_wrapper_reads_every_episode_of_a_real_env_and_stops_the_script():
    """The runner's wrapper on gymnasium's own RecordEpisodeStatistics: every episode's raw return at the step
    it ended, every step counted, and RaceStop out of ``step`` at the threshold."""
    import gymnasium as gym

    runner = load_cleanrl_runner()
    watch = runner.RaceWatch(threshold=1e9, window=100, max_steps=10**9, time_limit_s=math.inf, started_unix=0.0,
                             run_start_unix=0.0)
    counter = runner.StepCounter(watch)
    env = runner.watched_statistics(gym.wrappers.RecordEpisodeStatistics, counter)(gym.make("CartPole-v1"))
    env.reset(seed=0)
    lengths, length = [], 0
    while len(lengths) < 5:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        length += 1
        if terminated or truncated:
            lengths.append(length)
            length = 0
            env.reset()
    assert counter.steps == sum(lengths)
    assert [value for _, _, value in watch.rows] == [float(n) for n in lengths]  # CartPole pays 1 a step
    assert [steps for steps, _, _ in watch.rows] == list(np.cumsum(lengths))
    watch.threshold, watch.recent = 0.0, collections.deque(watch.recent, maxlen=5)  # the window is full now
    with pytest.raises(runner.RaceStop):
        env.step(0)
    assert watch.ended == "target_return reached"


def test_cleanrl_wrapper_reads_a_one_element_array_return():
    """gymnasium 0.28's wrapper (ppo_continuous_action.py's) reports a return as a 1-element array."""
    runner = load_cleanrl_runner()

    class ArrayReturns:
        def step(self, action):
            return None, 0.0, True, False, {"episode": {"r": np.array([-123.5]), "l": np.array([200])}}

    watch = runner.RaceWatch(1e9, 100, 10**9, math.inf, started_unix=0.0, run_start_unix=0.0)
    counter = runner.StepCounter(watch)
    runner.watched_statistics(ArrayReturns, counter)().step(0)
    assert watch.rows[0][::2] == (1, -123.5) and counter.steps == 1


def test_cleanrl_counts_agent_steps_above_a_frame_skip_and_stamps_episodes_with_them():
    """ppo_atari's chain: the statistics wrapper sits on the raw frames and only reports episodes; the skip
    wrapper above it counts agent steps, and an episode that ended inside an agent step is stamped with it."""
    import gymnasium as gym

    runner = load_cleanrl_runner()

    class SkipThree(gym.Wrapper):  # stands for SB3's MaxAndSkipEnv: 3 inner steps, fewer at an episode's end
        def step(self, action):
            reward = 0.0
            for _ in range(3):
                observation, r, terminated, truncated, info = self.env.step(action)
                reward += r
                if terminated or truncated:
                    break
            return observation, reward, terminated, truncated, info

    watch = runner.RaceWatch(1e9, 100, 10**9, math.inf, started_unix=0.0, run_start_unix=0.0)
    counter = runner.StepCounter(watch)
    frames = runner.watched_statistics(gym.wrappers.RecordEpisodeStatistics, counter, counts_steps=False)(
        gym.make("CartPole-v1"))
    env = runner.counted_steps(SkipThree, counter)(frames)
    env.reset(seed=0)
    agent_steps, ends = 0, []
    while len(ends) < 4:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        agent_steps += 1
        if terminated or truncated:
            ends.append(agent_steps)
            env.reset()
    assert counter.steps == agent_steps  # agent steps, not frames
    assert [steps for steps, _, _ in watch.rows] == ends
    # each return is its episode's frames (CartPole pays 1 a frame): 3 an agent step, 1 to 3 in the last one
    for (_, _, value), length in zip(watch.rows, np.diff([0, *ends])):
        assert 3 * (length - 1) + 1 <= value <= 3 * length


def test_cleanrl_recipes_and_skips(tmp_path, monkeypatch):
    monkeypatch.setenv(external.PEERS_DIR_ENV, str(tmp_path))
    assert "MinAtar's ids are gymnasium's" in external.skip_reason("cleanrl", "MinAtar/Breakout-v1")
    assert external.skip_reason("cleanrl", "CartPole-v1").endswith("is not built (make peers)")
    python = tmp_path / "cleanrl" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    assert external.skip_reason("cleanrl", "Pendulum-v1") == ""
    command, result, text = external.runner_command("cleanrl", "Pendulum-v1")
    assert command[:2] == [str(python), "-I"] and command[-2:] == ["--script", "ppo_continuous_action"]
    assert result == "cleanrl_result.json" and "ppo_continuous_action.py as published" in text
    command, _, text = external.runner_command("cleanrl", "ALE/Pong-v5")
    assert command[-2:] == ["--script", "ppo_atari"] and "ppo_atari.py as published" in text


# ---- end to end ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("stable_baselines3") is None or zoo.zoo_version() is None,
                    reason="needs make bench-deps (stable-baselines3, rl_zoo3)")
def test_small_race_end_to_end(tmp_path):
    """paac/a2c (presets) and SB3 PPO (rl-zoo) race on CartPole to a low threshold: both stop there, and the
    race time is the child's start-up plus the run's own crossing time."""
    env = RaceEnv("CartPole-v1", 50.0, 200_000, 300.0)
    suite = race_suite((0,), envs=[env])
    runs = tuple(run for run in suite.runs if run.name.startswith(("paac-a2c-", "sb3-ppo-")))
    rows = run_suite(dataclasses.replace(suite, runs=runs), tmp_path, log=lambda line: None)
    assert [row["status"] for row in rows] == ["ok", "ok"], rows
    with open(tmp_path / "race.csv") as f:
        raced = list(csv.DictReader(f))
    for row in raced:
        assert row["reached"] == "True" and row["stop_reason"] == "target_return reached"
        assert float(row["startup_s"]) > 0 and float(row["machine_speed"]) > 0  # timed by the parent, per run
        assert float(row["time_to_threshold_s"]) == pytest.approx(
            float(row["startup_s"]) + float(row["run_time_at_crossing_s"]))
    assert "rl-zoo 2.9.2 ppo.yml" in raced[1]["settings"]
    assert (tmp_path / "race_CartPole-v1.png").read_bytes()[:8] == PNG_MAGIC
    assert "| paac/a2c | 1/1 |" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("stable_baselines3") is None or zoo.zoo_version() is None,
                    reason="needs make bench-deps (stable-baselines3, rl_zoo3)")
def test_an_sb3_race_run_stopped_by_sigterm_writes_its_summary_and_returns(tmp_path):
    """SIGTERM (the bench's timeout, ``kill``) stops an SB3 run at its next step, and the run writes its summary
    and returns as a conveyor run does, so a long race stopped from outside keeps its curve."""
    code = ("import sys; from pathlib import Path; from conveyor.bench.suites import RaceGoal; "
            "from conveyor.bench.zoo import run_zoo; from conveyor.config import EnvCfg, RunCfg; "
            "run_zoo('ppo', RunCfg(env=EnvCfg(id='CartPole-v1'), seed=0, log_interval_s=0.2), Path(sys.argv[1]), "
            "RaceGoal(1e9, 10**9, 3600.0), __import__('time').time())")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = tmp_path / "metrics.csv", time.monotonic() + 120
        while not (metrics.exists() and any(int(row["episodes"]) >= 5 for row in csv.DictReader(metrics.open()))):
            assert child.poll() is None and time.monotonic() < deadline, child.stderr and child.stderr.read()
            time.sleep(0.1)
        child.send_signal(signal.SIGTERM)
        assert child.wait(60) == 0, child.stderr.read()
    finally:
        child.kill()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"] == "signal SIGTERM" and summary["framework"] == "stable-baselines3"
    returns = (tmp_path / "returns.csv").read_text().splitlines()
    assert summary["episodes"] >= 5 and len(returns) == summary["episodes"] + 1  # a header, then every episode


PPO_ATARI_CHAIN = """
import json, math, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import cleanrl_runner as runner
import gym
from stable_baselines3.common import atari_wrappers

watch = runner.RaceWatch(1e9, 100, 10**9, math.inf, started_unix=0.0, run_start_unix=0.0)
counter = runner.StepCounter(watch)
gym.wrappers.RecordEpisodeStatistics = runner.watched_statistics(
    gym.wrappers.RecordEpisodeStatistics, counter, counts_steps=False)
atari_wrappers.MaxAndSkipEnv = runner.counted_steps(atari_wrappers.MaxAndSkipEnv, counter)
gym.make = runner.old_api_make(gym)
from cleanrl.ppo_atari import make_env  # after the patches, as the runner runs the script

env = make_env("ALE/Pong-v5", 3, 0, False, "test")()
first = np.array(env.reset())
after_reset = counter.steps
steps, clipped, done = 0, 0.0, False
while not done:
    observation, reward, done, info = env.step(env.action_space.sample())
    steps, clipped = steps + 1, clipped + reward
counted = counter.steps
again = make_env("ALE/Pong-v5", 3, 0, False, "test")()
print(json.dumps({"shape": list(np.array(observation).shape), "steps": steps, "after_reset": after_reset,
                  "counted": counted, "rows": watch.rows, "clipped": clipped,
                  "frameskip": env.unwrapped._frameskip,
                  "sticky": float(env.unwrapped.ale.getFloat("repeat_action_probability")),
                  "same_start": bool(np.array_equal(np.array(again.reset()), first))}))
"""


@pytest.mark.slow
def test_cleanrl_ppo_atari_gets_pong_in_gym_023s_api_and_counts_its_agent_steps():
    """In CleanRL's venv, ppo_atari.py's own env chain (its make_env, SB3 1.2.0's wrappers) on the runner's
    ``gym.make``: ale-py 0.8.1's Pong in gym 0.23's step API, sticky actions kept and the frames skipped once (by
    MaxAndSkipEnv), one agent step counted per skip (FireResetEnv's two at a reset included), the episode's raw
    return at the step it ended, and a seed that reproduces the start."""
    reason = external.skip_reason("cleanrl", "ALE/Pong-v5")
    if reason:
        pytest.skip(reason)
    env = {"ALE_PY_ROM_DIR": str(external.conveyor_rom_dir()), "PATH": os.environ["PATH"]}
    done = subprocess.run([str(external.CLEANRL.python()), "-I", "-W", "ignore", "-c", PPO_ATARI_CHAIN,
                           str(external.RUNNERS)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["shape"] == [4, 84, 84] and seen["frameskip"] == 1 and seen["sticky"] == 0.25
    assert seen["after_reset"] == 2  # FireResetEnv's FIRE and RIGHT
    assert seen["counted"] == seen["after_reset"] + seen["steps"]
    (row,) = seen["rows"]
    assert row[0] == seen["counted"] and row[2] == seen["clipped"] <= -1  # Pong's points are +-1: unclipped
    assert seen["same_start"]


@pytest.mark.slow
@pytest.mark.parametrize("framework, settings", [("cleanrl", "cleanrl/ppo.py as published"),
                                                 ("sample-factory", "train_gym_env.py's CartPole-v1 command line")])
def test_a_peer_in_its_own_venv_races_to_a_low_threshold(tmp_path, framework, settings):
    """A peer's runner in its own venv (CleanRL's ppo.py as published; Sample Factory's APPO) stops at the race's
    threshold: the episodes it played are in returns.csv through the first crossing, which is the row's, and the
    race time is the child's start-up plus the run's own crossing time."""
    if external.skip_reason(framework, "CartPole-v1"):
        pytest.skip(external.skip_reason(framework, "CartPole-v1"))
    env = RaceEnv("CartPole-v1", 40.0, 200_000, 300.0)
    suite = race_suite((0,), envs=[env])
    runs = tuple(run for run in suite.runs if run.framework == framework)
    rows = run_suite(dataclasses.replace(suite, runs=runs), tmp_path, log=lambda line: None)
    assert [row["status"] for row in rows] == ["ok"], rows
    with open(tmp_path / "race.csv") as f:
        (raced,) = list(csv.DictReader(f))
    assert raced["reached"] == "True" and raced["stop_reason"] == "target_return reached"
    assert float(raced["time_to_threshold_s"]) == pytest.approx(
        float(raced["startup_s"]) + float(raced["run_time_at_crossing_s"]))
    assert settings in raced["settings"]
    returns = np.loadtxt(tmp_path / "runs" / runs[0].name / "returns.csv", delimiter=",", skiprows=1)
    steps, run_time = threshold_crossing(returns, 40.0)
    assert steps == float(raced["steps_to_threshold"])
    assert run_time == pytest.approx(float(raced["run_time_at_crossing_s"]), abs=1e-3)
    # CleanRL reports one episode at a time and stops at the first crossing; Sample Factory's episodes come in
    # batches and keep arriving while its processes stop, so the last-100 mean may fall back under the threshold
    if framework == "cleanrl":
        assert returns[-1, 0] == steps
    assert np.all(np.diff(returns[:, 0]) >= 0) and returns[-1, 0] <= 200_000
