"""benchmarks/tune_evidence.py: a tuned configuration against the preset, on seeds the study did not run."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "tune_evidence.py"


def test_the_verdict_follows_the_iqm_of_each_arm_and_p_of_improvement_counts_pairs():
    evidence = load_benchmark_script("tune_evidence")
    # IQM of 5 runs: the mean of the middle 3 (the lowest and the highest are a quarter each, cut)
    result = evidence.compare([-900.0, -200.0, -210.0, -190.0, -100.0], [-250.0, -240.0, -1200.0, -230.0, -220.0],
                              reps=200)
    assert result["tuned"]["iqm"] == pytest.approx((-200 - 210 - 190) / 3)
    assert result["preset"]["iqm"] == pytest.approx((-250 - 240 - 230) / 3)
    assert result["tuned_wins"]
    # of the 25 pairs, tuned is above preset in all but those with its -900 (below 4 of 5 presets)
    assert result["p_tuned_above_preset"]["value"] == pytest.approx(21 / 25)
    low, high = result["p_tuned_above_preset"]["low"], result["p_tuned_above_preset"]["high"]
    assert 0 <= low <= 21 / 25 <= high <= 1
    assert result["tuned"]["low"] <= result["tuned"]["iqm"] <= result["tuned"]["high"]
    same = evidence.compare([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], reps=50)
    assert not same["tuned_wins"] and same["p_tuned_above_preset"]["value"] == pytest.approx(0.5)


def test_the_preset_arm_is_best_toml_without_the_sampled_values():
    best = {"arch": "paac", "algo": "a2c", "env": "CartPole-v1", "total-steps": 3000, "env-backend": "inproc",
            "lr": 0.001, "num-envs": 32}
    flags = load_benchmark_script("tune_evidence").arm_flags(best, {"lr", "num-envs"})
    assert flags["tuned"] == best
    assert flags["preset"] == {"arch": "paac", "algo": "a2c", "env": "CartPole-v1", "total-steps": 3000,
                               "env-backend": "inproc"}


@pytest.mark.slow  # a 2-trial study and 4 runs: about 30 s
def test_a_tiny_study_is_checked_on_new_seeds_and_its_evidence_is_written_and_resumed(tmp_path):
    study, out, runs = tmp_path / "study", tmp_path / "out", tmp_path / "runs"
    tune = [sys.executable, "-m", "conveyor", "tune", "--arch", "paac", "--env", "CartPole-v1", "--trials", "2",
            "--steps", "3000", "--jobs", "1", "--out", str(study)]
    assert subprocess.run(tune, cwd=ROOT, capture_output=True, text=True).returncode == 0
    command = [sys.executable, str(SCRIPT), str(study), "--seeds", "7,8", "--out", str(out), "--runs", str(runs)]
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("run: conveyor train --arch=paac --algo=a2c --env=CartPole-v1 --total-steps=3000") == 4
    result = json.loads((out / "evidence.json").read_text())
    assert result["seeds"] == [7, 8]
    assert set(result["flags"]["tuned"]) - set(result["flags"]["preset"]) == {
        "lr", "entropy-coef", "gamma", "max-grad-norm", "num-envs", "unroll"}
    for arm in ("tuned", "preset"):
        for seed, final in zip((7, 8), result[arm]["finals"]):
            meta = json.loads((out / arm / "CartPole-v1" / "paac-a2c" / f"seed-{seed}.json").read_text())
            assert meta["seed"] == seed and meta["stop_reason"] == "total_steps reached"
            summary = json.loads((runs / "paac-a2c-CartPole-v1" / arm / f"seed-{seed}" / "summary.json").read_text())
            assert summary["seed"] == seed and summary["env_steps"] >= 3000  # the study's whole budget
            curve = (out / arm / "CartPole-v1" / "paac-a2c" / f"seed-{seed}.csv").read_text().splitlines()
            assert float(curve[-1].split(",")[2]) == pytest.approx(final)
    assert result["tuned_wins"] == (result["tuned"]["iqm"] > result["preset"]["iqm"])
    trials = list(csv.DictReader((out / "trials.csv").open()))
    assert [row["trial"] for row in trials] == ["0", "1"] and {row["state"] for row in trials} == {"COMPLETE"}
    assert {p.name for p in out.iterdir()} >= {"best.toml", "history.png", "evidence.md", "trials.csv"}
    assert "Verdict: " in (out / "evidence.md").read_text()
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)  # every run finished: none runs again
    assert again.returncode == 0 and "run: conveyor train" not in again.stdout
    assert json.loads((out / "evidence.json").read_text())["tuned"] == result["tuned"]


def test_a_folder_without_a_finished_study_is_refused_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith(f"{tmp_path} has no best.toml: pass a `conveyor tune` "
                                                          "study's folder, after its trials")
