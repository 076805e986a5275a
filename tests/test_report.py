"""`conveyor report`: its statistics against rliable's, normalization, export, the committed results page."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conveyor.bench import aggregate, stats

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


def test_the_results_page_regenerates_from_the_committed_data(tmp_path, monkeypatch):
    """docs/results.md is what `conveyor report` writes from benchmarks/results/matrix, byte for byte."""
    monkeypatch.chdir(REPO)
    committed = Path("docs/results.md").read_text()
    command = next(line for line in committed.splitlines() if line.startswith("<!-- Written by `"))
    runs, out, page_path = Path("benchmarks/results/matrix"), Path("docs/results"), Path("docs/results.md")
    assert aggregate.report_command([runs], out, page_path, stats.BOOTSTRAP_REPS) in command
    records = aggregate.find_runs([runs])
    rows = aggregate.aggregate(records)
    assert aggregate.numbers_csv(rows) == (out / "numbers.csv").read_text()
    text = aggregate.page(records, rows, aggregate.report_command([runs], out, page_path, stats.BOOTSTRAP_REPS),
                          "results", "results/numbers.csv", stats.BOOTSTRAP_REPS)
    assert text == committed
    for name in aggregate.figure_names(rows):
        assert (out / name).is_file(), f"{out / name} is missing: rerun the command in docs/results.md"


def test_bad_input_is_one_line_with_exit_code_2(tmp_path, capsys):
    from conveyor.cli import main

    for argv, message in (([str(tmp_path / "no-such-dir")], "no-such-dir is not a directory"),
                          ([str(tmp_path)], "no runs in"), ([str(tmp_path), "--reps", "0"], "--reps 0")):
        assert main(["report", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
