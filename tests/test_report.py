"""`conveyor report`: its statistics against rliable's, normalization, export, the committed results page."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from conveyor.bench import aggregate, claims, stats

REPO = Path(__file__).resolve().parent.parent
# A small fixed score matrix: 5 runs (rows) of 3 tasks (columns), with ties and an outlier.
SCORES = np.array([[10.0, 200.0, -3.0], [12.0, 180.0, -1.0], [9.0, 500.0, -3.0], [30.0, 210.0, 0.0],
                   [11.0, 190.0, -2.0]])
REPS = 300


@pytest.fixture(scope="module")
def rliable(request):
    """rliable's ``metrics`` and ``library`` modules. rliable 1.2.0 needs arch < 8, and arch 7.2's import
    applies pandas' private ``deprecate_kwarg`` with the signature pandas 3 dropped (the decorator only marks
    a keyword of a plotting method as renamed); a stand-in while arch imports lets rliable run under the pins."""
    pytest.importorskip("rliable", reason="rliable is not installed (the test extra has it)")
    import pandas.util._decorators as decorators

    monkeypatch = pytest.MonkeyPatch()
    request.addfinalizer(monkeypatch.undo)
    monkeypatch.setattr(decorators, "deprecate_kwarg", lambda *names, **options: (lambda function: function))
    from rliable import library, metrics

    return metrics, library


def test_iqm_and_interval_match_rliable(rliable):
    metrics, library = rliable
    np.random.seed(0)  # rliable's StratifiedBootstrap draws from NumPy's global RandomState
    points, intervals = library.get_interval_estimates(
        {"x": SCORES}, lambda scores: np.array([metrics.aggregate_iqm(scores)]), reps=REPS)
    estimate, low, high = stats.stratified_bootstrap(list(SCORES.T), stats.pooled_iqm, reps=REPS, seed=0)
    np.testing.assert_allclose(estimate, points["x"])
    np.testing.assert_allclose([low[0], high[0]], intervals["x"][:, 0])
    assert low[0] < estimate[0] < high[0]


def test_performance_profile_matches_rliable(rliable):
    _, library = rliable
    taus = np.linspace(-5.0, 250.0, 7)
    np.random.seed(0)
    profiles, bands = library.create_performance_profile({"x": SCORES}, taus, reps=REPS)
    estimate, low, high = stats.stratified_bootstrap(list(SCORES.T), stats.profile_statistic(taus), reps=REPS, seed=0)
    np.testing.assert_allclose(estimate, profiles["x"])
    np.testing.assert_allclose(np.stack([low, high]), bands["x"])


def test_probability_of_improvement_matches_rliable(rliable):
    metrics, _ = rliable
    other = SCORES + np.array([[1.0, -50.0, 0.0]])
    estimate, low, high = stats.probability_of_improvement(list(SCORES.T), list(other.T), reps=REPS)
    assert estimate == pytest.approx(metrics.probability_of_improvement(SCORES, other))
    assert low <= estimate <= high


def test_iqm_is_the_trimmed_mean():
    assert stats.iqm(np.array([1.0, 2.0, 3.0, 4.0, 100.0, -100.0, 5.0, 6.0])) == pytest.approx(3.5)
    assert stats.iqm(SCORES) == pytest.approx(np.sort(SCORES.ravel())[3:12].mean())


def test_identical_runs_improve_with_probability_one_half():
    estimate, low, high = stats.probability_of_improvement(list(SCORES.T), list(SCORES.T), reps=REPS)
    assert estimate == 0.5
    assert low <= 0.5 <= high
    assert stats.probability_of_improvement([SCORES[:, 0] + 100], [SCORES[:, 0]], reps=REPS) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("counts", [(5, 5, 5), (4,), (3, 5, 2)])
def test_all_replicates_draw_the_indices_that_one_draw_per_replicate_would(counts):
    """The draws of every replicate at once are rliable's draws one replicate after another: with equal
    counts one ``[runs, tasks]`` draw per replicate, else one draw per task."""
    reference = np.random.RandomState(7)
    expected = [[] for _ in counts]
    for _ in range(50):
        if len(set(counts)) == 1:
            drawn = reference.randint(0, counts[0], size=(counts[0], len(counts)))
            per_task = [drawn[:, task] for task in range(len(counts))]
        else:
            per_task = [reference.randint(0, count, size=count) for count in counts]
        for task, index in enumerate(per_task):
            expected[task].append(index)
    drawn = stats._run_indices(np.random.RandomState(7), list(counts), 50)
    for task, count in enumerate(counts):
        assert drawn[task].shape == (50, count)
        np.testing.assert_array_equal(drawn[task], np.stack(expected[task]))


def test_unequal_seed_counts_resample_within_each_task():
    tasks = [np.array([1.0, 2.0, 3.0]), np.array([10.0, 11.0])]
    estimate, low, high = stats.stratified_bootstrap(tasks, stats.pooled_iqm, reps=REPS)
    assert estimate[0] == pytest.approx(stats.iqm(np.concatenate(tasks)))
    assert low[0] <= estimate[0] <= high[0]


def test_normalization_maps_random_to_zero_and_reference_to_one():
    cartpole = aggregate.SCORES["CartPole-v1"]
    np.testing.assert_allclose(stats.normalized([cartpole.random, cartpole.reference, 261.1],
                                                cartpole.random, cartpole.reference), [0.0, 1.0, 0.5])
    pendulum = aggregate.SCORES["Pendulum-v1"]
    assert stats.normalized(-615.35, pendulum.random, pendulum.reference) == pytest.approx(0.5)


def _run_dir(path: Path, arch: str, seed: int, returns: list[float]) -> Path:
    """A finished run's directory as `conveyor train` leaves it (the parts a report reads)."""
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"env": "CartPole-v1", "arch": arch, "algo": "a2c", "seed": seed,
                                                   "stop_reason": "total_steps reached"}))
    rows = [f"{100 * (i + 1)},{0.5 * (i + 1):.3f},{value:.3f}" for i, value in enumerate(returns)]
    (path / "returns.csv").write_text("env_steps,wall_time_s,return\n" + "\n".join(rows) + "\n")
    return path


def test_an_exported_run_reports_as_its_run_directory(tmp_path):
    rng = np.random.default_rng(0)
    for seed in range(3):
        for arch, offset in (("paac", 0.0), ("hts", 20.0)):
            _run_dir(tmp_path / "runs" / f"{arch}-{seed}", arch, seed, list(rng.uniform(10, 60, 250) + offset))
    from_runs = aggregate.find_runs([tmp_path / "runs"])
    for record in from_runs:
        aggregate.export_run(record, tmp_path / "exported")
    assert sorted(p.name for p in (tmp_path / "exported" / "CartPole-v1" / "paac-a2c").iterdir()) == [
        "seed-0.csv", "seed-0.json", "seed-1.csv", "seed-1.json", "seed-2.csv", "seed-2.json"]
    exported = aggregate.find_runs([tmp_path / "exported"])
    assert aggregate.numbers_csv(aggregate.aggregate(exported, REPS)) == aggregate.numbers_csv(
        aggregate.aggregate(from_runs, REPS))
    assert len(from_runs[0].curve) <= aggregate.CURVE_POINTS + 1
    with pytest.raises(aggregate.ConfigError, match="twice"):
        aggregate.find_runs([tmp_path / "runs", tmp_path / "exported"])


def test_the_page_spans_numbers_from_the_lowest_to_the_highest():
    assert aggregate._span([102_280, 88_960], "{:,}".format) == "88,960 to 102,280"  # not by their strings
    assert aggregate._span(["2026-12-02", "2026-11-28"]) == "2026-11-28 to 2026-12-02"
    assert aggregate._span([1_000_000, 1_000_000], "{:,}".format) == "1,000,000"


def test_the_results_page_regenerates_from_the_committed_data(tmp_path, monkeypatch):
    """docs/results.md is what `conveyor report` writes from benchmarks/results/matrix, byte for byte."""
    monkeypatch.chdir(REPO)
    committed = Path("docs/results.md").read_text()
    command = next(line for line in committed.splitlines() if line.startswith("<!-- Written by `"))
    runs, out, page_path = Path("benchmarks/results/matrix"), Path("docs/results"), Path("docs/results.md")
    claims_dir = Path("benchmarks/results/claims")
    report_command = aggregate.report_command([runs], out, page_path, stats.BOOTSTRAP_REPS, claims_dir)
    assert report_command in command
    records = aggregate.find_runs([runs])
    rows = aggregate.aggregate(records)
    assert aggregate.numbers_csv(rows) == (out / "numbers.csv").read_text()
    text = aggregate.page(records, rows, report_command, "results", "results/numbers.csv", stats.BOOTSTRAP_REPS,
                          claims.claims_section(claims_dir))
    assert text == committed
    for name in aggregate.figure_names(rows):
        assert (out / name).is_file(), f"{out / name} is missing: rerun the command in docs/results.md"


def test_bad_input_is_one_line_with_exit_code_2(tmp_path, capsys):
    from conveyor.cli import main

    for argv, message in (([str(tmp_path / "no-such-dir")], "no-such-dir is not a directory"),
                          ([str(tmp_path)], "no runs in"), ([str(tmp_path), "--reps", "0"], "--reps 0"),
                          ([str(tmp_path), "--claims", str(tmp_path / "none")], "--claims")):
        assert main(["report", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


# ---- the papers' claims (conveyor.bench.claims) --------------------------------------------------------
def _efficiency_rows(env: str, hts: list[float], paac: list[float], budget: int = 1000) -> list[dict]:
    return [{"part": "efficiency", "env": env, "arch": arch, "seed": str(seed), "status": "ok",
             "step_budget": str(budget), "return_mean_last100": str(value), "mode": "full"}
            for arch, values in (("hts", hts), ("paac", paac)) for seed, value in enumerate(values)]


def test_expected_minutes_scale_with_the_seeds_a_claim_runs():
    impact, hts, paac = claims.CLAIMS["impact"], claims.CLAIMS["hts"], claims.CLAIMS["paac"]
    assert impact.expected_minutes(len(impact.seeds)) == impact.full_minutes
    assert impact.expected_minutes(1) == pytest.approx(impact.full_minutes / 3, abs=1)  # six 600 s runs a seed
    assert hts.expected_minutes(1) == pytest.approx(5 + 1.5)  # the speed part runs once whatever the seeds
    assert paac.expected_minutes(1) == paac.full_minutes


def test_claims_script_refuses_seeds_for_a_claim_that_runs_none():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "claims.py"), "paac", "--seeds", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--seeds: claim paac measures throughput and runs no seeds; leave --seeds out" in done.stderr
    assert "Traceback" not in done.stderr


def test_improvement_verdicts_follow_the_non_inferiority_rule():
    assert claims.improvement_verdict(0.2, 0.05, 0.45) == claims.FAILS  # the CI lies below 0.5: paac is better
    assert claims.improvement_verdict(0.5, 0.3, 0.7) == claims.HOLDS  # its low end reaches the margin
    assert claims.improvement_verdict(0.45, 0.2, 0.7) == claims.INCONCLUSIVE
    assert claims.improvement_verdict(1.0, 1.0, 1.0, runs=2) == claims.INCONCLUSIVE  # too few runs to tell


def test_hts_sample_efficiency_verdicts_from_rows():
    # Every hts run above every paac run: P = 1 with a degenerate interval [1, 1].
    better = claims.hts_verdicts(_efficiency_rows("A", [10, 11, 12], [1, 2, 3]))
    assert [(f.verdict, f.numbers.split(";")[0]) for f in better] == [(claims.HOLDS, "P(hts > paac) 1.00 [1.00, 1.00]")]
    assert better[0].seeds == "0, 1, 2" and "1,000 env steps" in better[0].what
    worse = claims.hts_verdicts(_efficiency_rows("A", [1, 2, 3], [10, 11, 12]))
    assert worse[0].verdict == claims.FAILS and worse[0].numbers.startswith("P(hts > paac) 0.00")
    # Identical scores: P = 0.5 exactly; two envs add a pooled line.
    same = claims.hts_verdicts(_efficiency_rows("A", [5, 5, 5], [5, 5, 5])
                               + _efficiency_rows("B", [1, 2, 3], [1, 2, 3]))
    assert [f.what.partition(", ")[2] for f in same] == ["A: last-100 mean return at 1,000 env steps",
                                                           "B: last-100 mean return at 1,000 env steps",
                                                           "A and B pooled"]
    assert same[0].numbers.startswith("P(hts > paac) 0.50 [0.50, 0.50]") and same[0].verdict == claims.HOLDS
    # P(hts > paac) on B by hand: of the 9 pairs, 3 ties and 3 wins -> (3 + 1.5) / 9 = 0.5.
    assert same[1].numbers.startswith("P(hts > paac) 0.50")
    failed = _efficiency_rows("A", [10, 11, 12], [1, 2, 3])
    failed[0]["status"] = "failed"
    assert "(2 and 3 runs)" in claims.hts_verdicts(failed)[0].numbers and claims.hts_verdicts(failed)[0].verdict == \
        claims.INCONCLUSIVE


def test_speed_and_eq7_verdicts():
    common = {"part": "speed", "status": "ok", "config": "StepTime gamma k=0.5"}
    rows = [{**common, "table": "compare", "alpha": "32", "hts_sps": "1500", "paac_sps": "1000", "hts_runs": "1500",
             "paac_runs": "1000"},
            {**common, "table": "eq7", "alpha": "64", "sps": "900", "predicted_sps": "1000", "error_pct": "-10"},
            {**common, "table": "eq7", "alpha": "256", "sps": "500", "predicted_sps": "1000", "error_pct": "-50"}]
    speed, close, far = claims.hts_verdicts(rows)
    assert speed.verdict == claims.HOLDS and "HTS / PAAC SPS 1.50" in speed.numbers
    assert close.verdict == claims.HOLDS and "error -10%" in close.numbers
    assert far.verdict == claims.FAILS


def test_growth_findings_use_the_ratio_of_medians():
    rows = [{"num_envs": n, "sps": sps, "time_learn": learn, "time_env": 0.5, "status": "ok"}
            for n, sps, learn in ((8, 100, 0.4), (8, 120, 0.4), (8, 300, 0.4), (64, 240, 0.1))]
    sps, share = claims.paac_verdicts(rows)
    assert sps.verdict == claims.HOLDS and sps.numbers.startswith("largest / smallest 2.00")  # 240 / median 120
    assert share.verdict == claims.HOLDS
    flat = claims.growth_finding("x", {1.0: 100.0, 4.0: 105.0})
    assert flat.verdict == claims.INCONCLUSIVE  # within the 10 % band
    assert claims.growth_finding("x", {1.0: 100.0, 4.0: 50.0}).verdict == claims.FAILS
    assert claims.growth_finding("x", {1.0: 100.0}).verdict == claims.INCONCLUSIVE


def test_ga3c_seed_and_impact_verdicts():
    grid = [{"part": "grid", "status": "ok", "agents": a, "predictors": "1", "trainers": "1", "lag_mean": lag,
             "tps": tps} for a, lag, tps in ((1, 0.5, 10.0), (8, 3.0, 40.0))]
    tuned = {"part": "autotune", "status": "ok", "agents": 6, "predictors": 1, "trainers": 2, "tps": 38.0}
    lag, tps, autotune = claims.ga3c_verdicts([*grid, tuned])
    assert (lag.verdict, tps.verdict, autotune.verdict) == (claims.HOLDS, claims.HOLDS, claims.HOLDS)
    assert "ratio 0.95" in autotune.numbers
    seed = [{"inference": kind, "actors": a, "sps": sps, "latency_p50_ms": 1.0, "status": "ok"}
            for kind, a, sps in (("central", 1, 100), ("central", 4, 300), ("local", 1, 200), ("local", 4, 600))]
    growth, versus = claims.seed_verdicts(seed)
    assert growth.verdict == claims.HOLDS and versus.verdict == claims.FAILS and "0.50" in versus.numbers
    impact = [{"replay_times": k, "seed": s, "status": "ok", "return_mean_last100": k + s / 10, "time_limit_s": 60}
              for k in (1, 2, 4) for s in range(3)]
    (finding,) = claims.impact_verdicts(impact)  # a table without the ratio runs: the K finding alone
    assert finding.verdict == claims.HOLDS and finding.numbers.startswith("P(K=4 > K=1) 1.00")
    ratios = [{"replay_times": 2, "impact_ratio": ratio, "seed": s, "status": "ok", "time_limit_s": 60,
               "return_mean_last100": score + s / 10} for ratio, score in (("target", 0.5), ("worker", 9.0))
              for s in range(3)]
    reuse, versus_r1, versus_r2 = claims.impact_verdicts([*impact, *ratios])
    assert reuse.numbers == finding.numbers  # the ratio runs never enter the K comparison
    assert versus_r1.what.startswith("R3 (impact) beats R1 (target)") and versus_r1.verdict == claims.HOLDS
    assert versus_r1.numbers.startswith("P(R3 > R1) 1.00") and "R3 2.10, R1 0.60 (3 and 3 runs)" in versus_r1.numbers
    assert versus_r2.verdict == claims.FAILS and versus_r2.numbers.startswith("P(R3 > R2) 0.00")


def test_the_claims_section_renders_runs_and_missing_claims(tmp_path):
    fixture = tmp_path / "claims"
    (fixture / "hts").mkdir(parents=True)
    rows = [{**row, "date": "2026-01-02", "command": "benchmarks/claims.py hts"}
            for row in _efficiency_rows("CartPole-v1", [10, 11, 12], [1, 2, 3])]
    quick = {**rows[0], "mode": "quick", "return_mean_last100": "-100"}  # a smoke run's row never counts
    with open(fixture / "hts" / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows([*rows, quick])
    text = claims.claims_section(fixture)
    assert text == claims.claims_section(fixture)  # deterministic
    assert "Command: `benchmarks/claims.py hts`; 6 rows; dates 2026-01-02." in text
    assert ("| sample efficiency, CartPole-v1: last-100 mean return at 1,000 env steps | **holds** "
            "| P(hts > paac) 1.00 [1.00, 1.00]; mean return hts 11.0, paac 2.0 (3 and 3 runs) | 0, 1, 2 |") in text
    assert "Not run yet: part speed (`benchmarks/claims.py hts --parts speed`)." in text
    assert ("Not run yet: seeds 3, 4, 5, 6, 7, 8, 9 (`benchmarks/claims.py hts --seeds 3,4,5,6,7,8,9`).\n\n"
            "Not run yet: part speed") in text  # hts's default seeds are 0-9; the fixture has 0-2
    assert "Why (" not in text
    (fixture / "hts" / claims.NOTES_FILE).write_text("Ten seeds are few.\n")  # a hand-written reason, shown
    missing = "Not run yet: part speed (`benchmarks/claims.py hts --parts speed`)."
    assert claims.claims_section(fixture) == text.replace(
        missing, f"{missing}\n\nWhy (`benchmarks/results/claims/hts/notes.md`): Ten seeds are few.")
    for name in ("paac", "ga3c", "seed", "impact"):
        assert f"No full run yet: `benchmarks/claims.py {name}` produces it" in text


def test_a_claim_run_for_some_seeds_or_parts_keeps_the_rows_of_the_others():
    rows = [{"part": "efficiency", "seed": "0", "n": 1}, {"part": "efficiency", "seed": "1", "n": 2},
            {"part": "speed", "seed": "", "n": 3}, {"part": "efficiency", "seed": "2", "n": 4}]
    assert [row["n"] for row in claims.rows_kept(rows, ("efficiency", "speed"), [1])] == [1, 4]  # speed reruns
    assert [row["n"] for row in claims.rows_kept(rows, ("efficiency",), [1])] == [1, 3, 4]
    assert [row["n"] for row in claims.rows_kept(rows, ("speed",), [0, 1, 2])] == [1, 2, 4]
    assert claims.rows_kept(rows, ("efficiency", "speed"), [0, 1, 2]) == []  # a full rerun replaces all
    impact = [{"seed": "0", "n": 1}, {"seed": "1", "n": 2}]  # a claim without parts, run a seed at a time
    assert [row["n"] for row in claims.rows_kept(impact, (), [2])] == [1, 2]
    assert [row["n"] for row in claims.rows_kept(impact, (), [0])] == [2]
    assert claims.rows_kept([{"sps": "1"}], (), [0]) == []  # unseeded rows (paac's grid) are always rerun
