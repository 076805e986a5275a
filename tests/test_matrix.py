"""benchmarks/matrix.py: issue 48's comparison matrix, run a few at a time, exported as each run ends, resumable."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "matrix.py"


def test_the_matrix_is_issue_48s_list_defaults_only_seed_major():
    matrix = load_benchmark_script("matrix")
    runs = matrix.selected([], [], [])
    counts = {}
    for run in runs:
        counts[run.env] = counts.get(run.env, 0) + 1
    # CartPole: the 8 arch/algos of the learning suite (its named presets left out), 5 seeds; Pendulum 4 x 5;
    # MinAtar: 5 games x (5 discrete architectures + seed/r2d2) x 3 seeds; HalfCheetah 2 x 3
    assert counts == {"CartPole-v1": 40, "Pendulum-v1": 20, "MinAtar/Breakout-v1": 18,
                      "MinAtar/SpaceInvaders-v1": 18, "MinAtar/Asterix-v1": 18, "MinAtar/Freeway-v1": 18,
                      "MinAtar/Seaquest-v1": 18, "HalfCheetah-v5": 6}
    assert [run.seed for run in runs] == sorted(run.seed for run in runs)
    assert {(r.arch, r.algo) for r in runs if r.env == "MinAtar/Breakout-v1"} == {
        ("paac", "a2c"), ("ga3c", "ga3c"), ("seed", "vtrace"), ("impact", "impact"), ("hts", "a2c"), ("seed", "r2d2")}
    assert {r.total_steps for r in runs if r.env.startswith(("CartPole", "Pendulum"))} == {300_000}
    (one,) = matrix.selected(["Pendulum"], ["hts"], [7])
    assert one.command(Path("d"))[3:] == ["train", "--arch", "hts", "--algo", "ppo", "--env", "Pendulum-v1", "--seed",
                                          "7", "--total-steps", "300000", "--no-progress", "--out", "d"]
    assert one.name == "Pendulum-v1/hts-ppo/seed-7"
    vtrace_only = matrix.selected(["MinAtar"], ["seed/vtrace", "paac"], [1])
    assert {(run.arch, run.algo) for run in vtrace_only} == {("seed", "vtrace"), ("paac", "a2c")}
    assert len(vtrace_only) == 10


def matrix_command(tmp_path: Path, *extra: str, envs: str = "CartPole", archs: str = "paac") -> list[str]:
    return [sys.executable, str(SCRIPT), "--envs", envs, "--archs", archs, "--results",
            str(tmp_path / "results"), "--runs", str(tmp_path / "runs"), *extra]


@pytest.mark.slow  # 4 short runs
def test_runs_are_exported_as_they_end_and_the_same_command_runs_only_what_is_missing(tmp_path):
    command = matrix_command(tmp_path, "--seeds", "1,2", "--total-steps", "2000")
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    for algo in ("a2c", "ppo"):
        for seed in (1, 2):
            meta = json.loads((tmp_path / "results" / "CartPole-v1" / f"paac-{algo}" / f"seed-{seed}.json").read_text())
            assert (meta["arch"], meta["algo"], meta["seed"]) == ("paac", algo, seed)
            summary = json.loads((tmp_path / "runs" / "CartPole-v1" / f"paac-{algo}" / f"seed-{seed}" /
                                  "summary.json").read_text())
            assert summary["env_steps"] >= 2000 and summary["seed"] == seed
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "started" not in again.stdout
    assert "4 of 4 runs done, 0 to run" in again.stdout


@pytest.mark.slow  # 2 runs started and stopped
def test_a_signal_stops_the_running_runs_exports_nothing_half_done_and_leaves_no_process(tmp_path):
    # Pendulum has no return threshold, so neither run can end on its own before the signal (CartPole's stop at
    # 475: paac/a2c solves it in seconds, and was exported while a loaded machine still started paac/ppo)
    command = matrix_command(tmp_path, "--seeds", "1", "--total-steps", "5000000", "--jobs", "2",
                             envs="Pendulum", archs="paac,hts")
    matrix = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = [matrix.stdout.readline(), matrix.stdout.readline(), matrix.stdout.readline()]
    assert [line.split()[0] for line in started] == ["matrix:", "started", "started"]
    metrics = [tmp_path / "runs" / "Pendulum-v1" / f"{arch}-ppo" / "seed-1" / "metrics.csv" for arch in ("paac", "hts")]
    deadline = time.monotonic() + 120
    while not all(path.exists() for path in metrics) and time.monotonic() < deadline:
        time.sleep(0.2)  # both runs are training
    matrix.send_signal(signal.SIGINT)
    out, err = matrix.communicate(timeout=120)
    assert matrix.returncode == 130
    assert err.strip().splitlines()[-1] == "matrix: stopped; the same command resumes (unfinished runs start again)"
    assert not (tmp_path / "results").exists()
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "runs")], capture_output=True, text=True)
    assert leftover.stdout == "", leftover.stdout


@pytest.mark.parametrize("flags, message", [
    (["--envs", "Nope"], "no run of the matrix matches --envs and --archs"),
    (["--total-steps", "100"], "--total-steps makes smoke runs: pass --results DIR too"),
    (["--seeds", "a"], "--seeds a: pass whole numbers, comma-separated"),
])
def test_mistakes_are_one_line_and_exit_2(flags, message):
    done = subprocess.run([sys.executable, str(SCRIPT), "--list", *flags], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    assert message in done.stderr.strip().splitlines()[-1]
