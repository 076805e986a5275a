"""`conveyor bench` and `conveyor plot`: a small matrix end to end, failures recorded, suites, plots."""

import csv
import importlib.util
import json

import numpy as np
import pytest
import torch

from conveyor.bench import (
    BenchRun,
    EnvBudget,
    Suite,
    bench_cfg,
    final_time_limits,
    quick_suite,
    replace_section,
    run_suite,
    section_markers,
)
from conveyor.cli import main
from conveyor.config import ARCHS, AlgoCfg, ArchCfg, EnvCfg
from conveyor.envs import STEP_TIME_ID
from conveyor.plots import plot_runs, trailing_mean

torch.set_num_threads(1)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = EnvBudget(EnvCfg(id="CartPole-v1", num_envs=4, num_workers=1), total_steps=1000, time_limit_s=60.0,
                 eval_episodes=2)


def tiny_run(name, seed, budget=TINY, **kwargs):
    return BenchRun(name, bench_cfg(budget, ArchCfg(name="paac"), AlgoCfg(name="a2c"), seed, torch_threads=1),
                    eval_episodes=budget.eval_episodes, **kwargs)


def read_rows(out):
    with open(out / "results.csv") as f:
        return list(csv.DictReader(f))


def test_two_run_matrix_end_to_end(tmp_path):
    markdown = tmp_path / "BENCHMARKS.md"
    markdown.write_text("# Benchmarks\n\nSomeone else's section.\n")
    suite = Suite("pair", "two tiny paac runs", (tiny_run("paac-s0", 0), tiny_run("paac-s1", 1)))
    out = tmp_path / "results"
    rows = run_suite(suite, out, log=lambda line: None, markdown=markdown)

    assert [row["status"] for row in rows] == ["ok", "ok"]
    csv_rows = read_rows(out)
    assert [row["name"] for row in csv_rows] == ["paac-s0", "paac-s1"]
    for row in csv_rows:
        assert int(row["env_steps"]) >= 1000 and float(row["sps"]) > 0
        assert row["lag_mean"] == "0.0" and row["lag_max"] == "0"  # PAAC acts with the learner's parameters
        assert int(row["final_metric_policies"]) == 10  # a checkpoint every 100 steps, the last 10 kept
        assert float(row["final_metric"]) > 0 and float(row["required_time_target"]) == 475.0
        run_dir = out / "runs" / row["name"]
        assert (run_dir / "summary.json").is_file() and (run_dir / "eval.json").is_file()
    # Final time metric: the limit is the fastest run's wall time, for both runs.
    limit = min(float(row["wall_time_s"]) for row in csv_rows)
    assert all(float(row["final_time_limit_s"]) == pytest.approx(limit) for row in csv_rows)

    table = (out / "results.md").read_text()
    assert "| paac/a2c CartPole-v1 s0 | ok |" in table and "| paac/a2c CartPole-v1 s1 | ok |" in table
    for name in ("return_vs_steps_CartPole-v1.png", "return_vs_time_CartPole-v1.png", "sps.png", "lag.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
        assert f"(results/{name})" in markdown.read_text()  # linked relative to BENCHMARKS.md
    text = markdown.read_text()
    assert text.startswith("# Benchmarks\n\nSomeone else's section.\n")
    assert all(marker in text for marker in section_markers("pair"))


def test_failed_run_is_recorded_and_the_suite_continues(tmp_path):
    bad = EnvBudget(EnvCfg(id="NoSuchEnv-v0", num_envs=4, num_workers=1), total_steps=1000, time_limit_s=60.0)
    runs = (tiny_run("broken", 0, budget=bad),
            BenchRun("sb3-a2c", bench_cfg(TINY, ArchCfg(), AlgoCfg(), 0, torch_threads=1), framework="sb3",
                     eval_episodes=1))
    rows = run_suite(Suite("failures", "a failing run and a peer", runs), tmp_path, log=lambda line: None)
    broken, peer = rows
    assert broken["status"] == "failed"
    assert broken["error"].startswith("ConfigError: unknown env id 'NoSuchEnv-v0'") and "\n" not in broken["error"]
    if importlib.util.find_spec("stable_baselines3") is None:
        assert peer["status"] == "skipped" and "stable-baselines3 is not installed" in peer["error"]
    else:
        assert peer["status"] == "ok" and peer["env_steps"] >= 1000 and peer["final_metric"] is not None
    assert "| paac/a2c NoSuchEnv-v0 s0 | failed: ConfigError: unknown env id" in (tmp_path / "results.md").read_text()
    assert len(read_rows(tmp_path)) == 2


def test_quick_suite_has_every_architecture_on_cartpole_and_step_time():
    runs = quick_suite().runs
    for env_id in ("CartPole-v1", STEP_TIME_ID):
        assert sorted(run.cfg.arch.name for run in runs if run.cfg.env.id == env_id) == sorted(ARCHS)
    # Budgeted to finish in under 10 minutes on 2 cores: training caps leave room for start-up and evaluation.
    assert sum(run.cfg.time_limit_s for run in runs) <= 300
    assert all(run.cfg.torch_threads == 1 and run.cfg.env.num_workers == 2 for run in runs)


def test_bench_command_lists_and_rejects_bad_input(capsys):
    assert main(["bench", "--suite", "quick", "--list", "--only", "hts"]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    assert len(listed) == 2 and all(line.startswith("hts-a2c-") for line in listed)
    assert main(["bench", "--suite", "quick", "--only", "nope"]) == 2
    assert "matches no run" in capsys.readouterr().err
    assert main(["bench", "--suite", "nope"]) == 2
    assert main(["bench", "--suite", "peers", "--seeds", "x"]) == 2


def test_replace_section_inserts_then_replaces_in_place():
    start, end = section_markers("quick")
    text = replace_section("# Benchmarks\n\nintro\n", "quick", "table v1")
    assert text == f"# Benchmarks\n\nintro\n\n### `quick`\n\n{start}\ntable v1\n{end}\n"
    again = replace_section(text + "\n## other\n", "quick", "table v2\n")
    assert again == text.replace("table v1", "table v2") + "\n## other\n"


def write_fake_run(run_dir, arch, env, lags, sps):
    run_dir.mkdir(parents=True)
    summary = {"arch": arch, "algo": "a2c", "env": env, "seed": 0, "sps": sps,
               "policy_lag": {"mean": 0.5, "max": max(lags), "histogram": {str(k): 10 for k in lags}}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    steps = np.arange(1, 301) * 100
    curve = np.stack([steps, steps / sps, np.minimum(steps / 100.0, 200.0)], axis=1)
    np.savetxt(run_dir / "returns.csv", curve, delimiter=",", header="env_steps,wall_time_s,return", comments="")


def test_plot_produces_pngs(tmp_path, capsys):
    write_fake_run(tmp_path / "a", "paac", "CartPole-v1", [0], 5000.0)
    write_fake_run(tmp_path / "b", "hts", "CartPole-v1", [1], 4000.0)
    write_fake_run(tmp_path / "c", "ga3c", STEP_TIME_ID, [0, 1, 2, 5], 900.0)
    (tmp_path / "failed").mkdir()
    dirs = [tmp_path / name for name in ("a", "b", "c", "failed")]
    written = plot_runs(dirs, tmp_path / "plots")
    names = sorted(path.name for path in written)
    assert names == sorted(["return_vs_steps_CartPole-v1.png", "return_vs_time_CartPole-v1.png",
                            "return_vs_steps_conveyor_StepTime-v0.png", "return_vs_time_conveyor_StepTime-v0.png",
                            "sps.png", "lag.png"])
    for path in written:
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size < 200_000
    assert main(["plot", *map(str, dirs), "--out", str(tmp_path / "cli")]) == 0
    assert "skipped" in capsys.readouterr().out and (tmp_path / "cli" / "sps.png").is_file()
    assert main(["plot", str(tmp_path / "failed")]) == 2


def test_trailing_mean_matches_a_loop():
    values = np.arange(250, dtype=float)
    expected = [values[max(0, i - 99): i + 1].mean() for i in range(250)]
    assert np.allclose(trailing_mean(values), expected)


def test_final_time_limit_is_the_fastest_finished_run_per_env():
    rows = [{"status": "ok", "env": "A", "wall_time_s": 30.0}, {"status": "ok", "env": "A", "wall_time_s": 20.0},
            {"status": "failed", "env": "A", "wall_time_s": None}, {"status": "ok", "env": "B", "wall_time_s": 7.0}]
    assert final_time_limits(rows) == {"A": 20.0, "B": 7.0}
