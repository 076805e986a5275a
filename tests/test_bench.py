"""`conveyor bench` and `conveyor plot`: a small matrix end to end, failures recorded, suites, plots."""

import csv
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conveyor.bench import run_suite
from conveyor.bench.child import OUTCOME_FILE, SPEC_FILE
from conveyor.bench.report import (eval_protocol, final_return, final_time_limits, replace_section, result_row,
                                   section_markers, seed_band, threshold_crossing, write_results)
from conveyor.bench.suites import (LEARNING_FLAGS, PONG_STEPS, BenchRun, EnvBudget, LearningEnv, Suite, bench_cfg,
                                   learning_suite, quick_suite, reference, train_config)
from conveyor.cli import main
from conveyor.config import ARCHS, AlgoCfg, ArchCfg, ConfigError, EnvCfg
from conveyor.envs import STEP_TIME_ID
from conveyor.plots import distinct_labels, load_run, plot_runs, trailing_mean
from tests.fault_env import alive, children
from tests.test_hung_envs import wait_for

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


@pytest.mark.slow
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


@pytest.mark.slow  # runs the SB3 peer where it is installed
def test_failed_run_is_recorded_and_the_suite_continues(tmp_path):
    # Fails inside the child: there is no earlier run to resume.
    broken = tiny_run("broken", 0)
    broken = dataclasses.replace(broken, cfg=dataclasses.replace(broken.cfg, resume=str(tmp_path / "no-such-run")))
    runs = (broken, BenchRun("sb3-a2c", bench_cfg(TINY, ArchCfg(), AlgoCfg(), 0, torch_threads=1), framework="sb3",
                             eval_episodes=1))
    rows = run_suite(Suite("failures", "a failing run and a peer", runs), tmp_path, log=lambda line: None)
    broken_row, peer = rows
    assert broken_row["status"] == "failed"
    assert broken_row["error"].startswith("CheckpointError: no checkpoints in") and "\n" not in broken_row["error"]
    if importlib.util.find_spec("stable_baselines3") is None:
        assert peer["status"] == "skipped" and "stable-baselines3 is not installed" in peer["error"]
    else:
        assert peer["status"] == "ok" and peer["env_steps"] >= 1000 and peer["final_metric"] is not None
    table = (tmp_path / "results.md").read_text()
    assert "| paac/a2c CartPole-v1 s0 | failed: CheckpointError: no checkpoints" in table
    assert len(read_rows(tmp_path)) == 2


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_killed_bench_parent_takes_its_child_along_and_the_run_writes_its_summary(tmp_path):
    """The child runs in a session of its own (no Ctrl-C from the terminal): when `conveyor bench` is killed
    outright, the kernel sends it SIGTERM, and its run stops as on any signal instead of training on alone."""
    run_dir = tmp_path / "runs" / "long"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; from conveyor.bench.child import execute; "
        "from conveyor.bench.suites import BenchRun, EnvBudget, bench_cfg; "
        "from conveyor.config import AlgoCfg, ArchCfg, EnvCfg; "
        "budget = EnvBudget(EnvCfg(id='CartPole-v1', num_envs=4, num_workers=1), total_steps=10**9, "
        "time_limit_s=600.0, eval_episodes=0); "
        "cfg = bench_cfg(budget, ArchCfg(name='paac'), AlgoCfg(name='a2c'), 0, torch_threads=1); "
        "execute(BenchRun('long', cfg, eval_episodes=0), Path(sys.argv[1]))"), str(run_dir)])
    try:
        metrics = run_dir / "metrics.csv"
        wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, "training", 300)
        [child] = [pid for pid, command in children(parent.pid).items() if str(run_dir / SPEC_FILE) in command]
    finally:
        parent.kill()
        parent.wait()
    try:
        wait_for(lambda: not alive(child), "exit of the orphaned child")
    finally:  # a failure here must not leave a run of 10**9 steps behind
        if alive(child):
            os.killpg(child, signal.SIGKILL)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "signal SIGTERM" and summary["env_steps"] < 10**9
    assert json.loads((run_dir / OUTCOME_FILE).read_text())["status"] == "ok"


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


def test_plot_labels_tell_apart_runs_of_the_same_arch_algo_seed(tmp_path):
    for name in ("lr1e-3", "lr3e-4", "other"):
        write_fake_run(tmp_path / name, "paac" if name != "other" else "hts", "CartPole-v1", [0], 5000.0)
    write_fake_run(tmp_path / "x" / "run", "ga3c", "CartPole-v1", [0], 5000.0)
    write_fake_run(tmp_path / "y" / "run", "ga3c", "CartPole-v1", [0], 5000.0)
    dirs = [tmp_path / name for name in ("lr1e-3", "lr3e-4", "other", "x/run", "y/run")]
    labels = [run.label for run in distinct_labels([load_run(d) for d in dirs])]
    assert labels == ["paac/a2c s0 (lr1e-3)", "paac/a2c s0 (lr3e-4)", "hts/a2c s0",
                      f"ga3c/a2c s0 ({tmp_path / 'x/run'})", f"ga3c/a2c s0 ({tmp_path / 'y/run'})"]


def test_trailing_mean_matches_a_loop():
    values = np.arange(250, dtype=float)
    expected = [values[max(0, i - 99): i + 1].mean() for i in range(250)]
    assert np.allclose(trailing_mean(values), expected)


def test_final_time_limit_is_the_fastest_finished_run_per_env():
    rows = [{"status": "ok", "env": "A", "wall_time_s": 30.0}, {"status": "ok", "env": "A", "wall_time_s": 20.0},
            {"status": "failed", "env": "A", "wall_time_s": None}, {"status": "ok", "env": "B", "wall_time_s": 7.0}]
    assert final_time_limits(rows) == {"A": 20.0, "B": 7.0}


# ---- the learning suite ----------------------------------------------------------------------------
def labels_on(suite, env_id):
    return {f"{run.arch_label}/{run.algo_label or run.cfg.algo.name}" for run in suite.runs if run.cfg.env.id == env_id}


def test_learning_suite_is_issue_15s_matrix_with_only_the_allowed_flags():
    suite = learning_suite()
    budgets = {env.id: (env.total_steps, env.threshold) for env in suite.learning_envs}
    assert budgets == {"CartPole-v1": (300_000, 475.0), "Pendulum-v1": (300_000, -250.0),
                       "HalfCheetah-v5": (1_000_000, 1500.0), "MinAtar/Breakout-v1": (1_000_000, None),
                       "MinAtar/SpaceInvaders-v1": (1_000_000, None), "ALE/Pong-v5": (PONG_STEPS["cpu"], None)}
    discrete = {"paac/a2c", "ga3c/ga3c", "seed/vtrace", "impact/impact", "hts/a2c"}
    assert labels_on(suite, "CartPole-v1") == discrete | {"paac/ppo", "seed/r2d2", "impact/appo", "impact/impala",
                                                          "hts/ppo"}
    assert labels_on(suite, "Pendulum-v1") == {"paac/ppo", "hts/ppo", "impact/impact", "seed/vtrace"}
    assert labels_on(suite, "HalfCheetah-v5") == {"paac/ppo", "impact/impact"}
    for env_id in ("MinAtar/Breakout-v1", "MinAtar/SpaceInvaders-v1"):
        assert labels_on(suite, env_id) == discrete | {"seed/r2d2"}
    assert labels_on(suite, "ALE/Pong-v5") == discrete
    assert len(suite.runs) == 33 * 3 and {run.cfg.seed for run in suite.runs} == {1, 2, 3}
    for run in suite.runs:
        # Each run is a user's `conveyor train` line: the presets chose everything else.
        assert set(run.flags[::2]) <= LEARNING_FLAGS and "--env" in run.flags and "--total-steps" in run.flags
        assert dataclasses.replace(run.cfg, time_limit_s=0.0, progress=True) == train_config(run.flags)
        assert run.cfg.time_limit_s > 0
        # Pong's final policies also play as the published scores were: no sticky actions, 30 episodes.
        pong = run.cfg.env.id == "ALE/Pong-v5"
        assert (run.eval_episodes, run.eval_env_args, run.eval_checkpoints) == (
            (30, (("repeat_action_probability", 0.0),), ("latest",)) if pong else (0, (), ()))
    impala = next(run for run in suite.runs if run.algo_label == "impala")
    assert "--algo" not in impala.flags and impala.cfg.algo.name == "vtrace"  # the preset picks the algorithm
    minatar_missing = importlib.util.find_spec("minatar") is None
    for run in suite.runs:
        skipped = run.cfg.env.id.startswith("MinAtar/") and minatar_missing
        assert bool(run.skip_reason) == skipped
    [pong_env] = [env for env in suite.learning_envs if env.id == "ALE/Pong-v5"]
    assert eval_protocol(pong_env) == "final policy, 30 episodes, up to 30 no-op starts, repeat_action_probability=0.0"
    assert reference("CartPole-v1", "paac/a2c").endswith("rl-baselines3-zoo benchmark (SB3 A2C, 500k steps)")
    assert reference("ALE/Pong-v5", "ga3c/ga3c") == "18: GA3C paper table 3 (1 day on a GPU, no sticky actions)"
    assert reference("Pendulum-v1", "seed/vtrace").startswith("none published")


def test_learning_suite_quick_scaled_and_on_a_gpu():
    quick = learning_suite(quick=True)
    assert [env.id for env in quick.learning_envs] == ["CartPole-v1"] and quick.name == "learning-quick"
    assert {run.cfg.seed for run in quick.runs} == {1} and len(quick.runs) == 10
    scaled = learning_suite(seeds=(4,), quick=True, budget_scale=0.01)
    assert {run.cfg.total_steps for run in scaled.runs} == {3000} and {run.cfg.seed for run in scaled.runs} == {4}
    pong = learning_suite(device="cuda", budget_scale=0.5)
    assert {run.cfg.total_steps for run in pong.runs if run.cfg.env.id == "ALE/Pong-v5"} == {PONG_STEPS["cuda"] // 2}
    with pytest.raises(ConfigError, match="budget-scale"):
        learning_suite(budget_scale=2.0)


def write_returns(run_dir, returns, steps_per_episode=100, seconds_per_episode=0.5, stop_reason="finished"):
    """A finished run directory: summary.json and returns.csv with episode i ending at (i+1) * the step/time."""
    run_dir.mkdir(parents=True)
    ends = np.arange(1, len(returns) + 1)
    curve = np.stack([ends * steps_per_episode, ends * seconds_per_episode, np.asarray(returns, float)], axis=1)
    np.savetxt(run_dir / "returns.csv", curve, delimiter=",", header="env_steps,wall_time_s,return", comments="")
    (run_dir / "summary.json").write_text(json.dumps({"env_steps": int(curve[-1, 0]), "stop_reason": stop_reason}))
    return curve


def test_threshold_crossing_by_hand(tmp_path):
    # 100 episodes of 0 then 500: the last-100 mean at episode i (0-based) is 5 * (i - 99); >= 475 at i = 194.
    curve = write_returns(tmp_path / "a", [0.0] * 100 + [500.0] * 150)
    assert threshold_crossing(curve, 475.0) == (19_500.0, 97.5)
    assert threshold_crossing(curve, 500.0) == (20_000.0, 100.0)  # i = 199: the first all-500 window
    assert threshold_crossing(curve, 501.0) is None
    assert threshold_crossing(curve[:99], -1.0) is None  # fewer than 100 episodes never count
    assert final_return(curve) == 500.0 and final_return(curve[:150]) == 250.0 and final_return(curve[:0]) is None


def test_learning_report_on_synthetic_runs(tmp_path):
    suite = learning_suite(seeds=(1, 2, 3), quick=True)
    chosen = [run for run in suite.runs if run.name.startswith(("paac-a2c-", "ga3c-ga3c-"))]
    out = tmp_path / "out"
    rows = []
    for run in chosen:
        run_dir = out / "runs" / run.name
        if run.name.startswith("paac-a2c-"):  # solves, later for each seed, and stops there
            write_returns(run_dir, [0.0] * (100 + 10 * run.cfg.seed) + [500.0] * 100,
                          stop_reason="target_return reached")
            rows.append(result_row(run, run.cfg, run_dir, "ok", "", 1.0))
        elif run.cfg.seed == 3:  # one ga3c seed failed
            rows.append(result_row(run, run.cfg, run_dir, "failed", "WorkerFailure: boom", 1.0))
        else:  # seed 2 ran out of time
            write_returns(run_dir, [100.0 * run.cfg.seed] * 300, steps_per_episode=1000,
                          stop_reason="time_limit_s reached" if run.cfg.seed == 2 else "total_steps reached")
            rows.append(result_row(run, run.cfg, run_dir, "ok", "", 1.0))
    markdown = tmp_path / "BENCHMARKS.md"
    write_results(dataclasses.replace(suite, runs=tuple(chosen)), out, rows, 12.0, markdown=markdown)

    results = {row["run"]: row for row in csv.DictReader(open(out / "learning.csv"))}
    paac, ga3c = results["paac/a2c"], results["ga3c/ga3c"]
    # paac seed s: 100 + 10 s zeros, then 500s; the last-100 mean reaches 475 at episode 100 + 10 s + 94 (0-based).
    steps = [(100 + 10 * seed + 95) * 100 for seed in (1, 2, 3)]
    assert float(paac["steps_to_threshold_mean"]) == pytest.approx(np.mean(steps))
    assert float(paac["steps_to_threshold_std"]) == pytest.approx(np.std(steps))
    assert float(paac["wall_s_to_threshold_mean"]) == pytest.approx(np.mean(steps) / 200)
    assert paac["seeds_reached"] == "3" and float(paac["final_return_mean"]) == 500.0
    # ga3c: seeds 1 and 2 finish flat at 100 and 200; seed 3 failed.
    assert ga3c["seeds"] == "3" and ga3c["seeds_ok"] == "2" and ga3c["seeds_reached"] == "0"
    assert float(ga3c["final_return_mean"]) == 150.0 and float(ga3c["final_return_std"]) == 50.0
    assert ga3c["notes"] == "failed: WorkerFailure: boom; 1 stopped at the wall-time guard" and ga3c["flags"] == "--arch ga3c --algo ga3c"

    table = (out / "results.md").read_text()
    assert "#### CartPole-v1: 300,000 env steps, threshold 475" in table
    assert (f"| paac/a2c | `--arch paac --algo a2c` | 3/3 | 500.0 ± 0.0 | {np.mean(steps):,.0f} ± "
            f"{np.std(steps):,.0f} (3/3) |") in table
    assert ("| ga3c/ga3c | `--arch ga3c --algo ga3c` | 2/3 (failed: WorkerFailure: boom; 1 stopped at the wall-time "
            "guard) | 150.0 ± 50.0 | not reached | not reached | none published") in table
    for name in ("learning_steps_CartPole-v1.png", "learning_time_CartPole-v1.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC and (out / name).stat().st_size > 1000
        assert f"(out/{name})" in markdown.read_text()
    assert all(marker in markdown.read_text() for marker in section_markers("learning-quick"))


def test_seed_band_holds_a_run_that_stopped_at_the_threshold():
    fast = np.array([[100.0, 1.0, 500.0], [200.0, 2.0, 500.0]])
    slow = np.array([[100.0, 1.0, 0.0], [400.0, 4.0, 0.0]])
    x, mean, low, high, count = seed_band([fast, slow], 0, held=[True, False], points=5)
    assert x.tolist() == [0.0, 100.0, 200.0, 300.0, 400.0]
    assert count.tolist() == [0, 2, 2, 2, 2] and np.isnan(mean[0])
    assert mean[1:].tolist() == [250.0, 250.0, 250.0, 250.0]  # trailing means: fast 500, slow 0
    assert low[1:].tolist() == [0.0] * 4 and high[1:].tolist() == [500.0] * 4
    _, _, _, _, unheld = seed_band([fast, slow], 0, held=[False, False], points=5)
    assert unheld.tolist() == [0, 2, 2, 1, 1]


@pytest.mark.slow
def test_learning_suite_runs_a_real_child_end_to_end(tmp_path, capsys):
    out = tmp_path / "learning"
    code = main(["bench", "--suite", "learning", "--quick", "--budget-scale", "0.01", "--archs", "paac",
                 "--only", "paac-a2c", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    [row] = read_rows(out)
    assert row["status"] == "ok" and row["name"] == "paac-a2c-CartPole-v1-s1" and int(row["env_steps"]) >= 3000
    run_dir = out / "runs" / row["name"]
    assert (run_dir / "returns.csv").read_text().startswith("env_steps,wall_time_s,return")
    assert "RuntimeWarning" not in (run_dir / "bench.log").read_text()  # `python -m conveyor.bench.child`
    assert json.loads((run_dir / "config.json").read_text())["total_steps"] == 3000
    assert (out / "learning_steps_CartPole-v1.png").read_bytes()[:8] == PNG_MAGIC
    assert "| paac/a2c | `--arch paac --algo a2c` | 1/1 |" in (out / "results.md").read_text()


@pytest.mark.slow
def test_learning_env_with_an_eval_protocol_evaluates_the_final_policy_in_it(tmp_path):
    # CartPole's Sutton & Barto reward pays 0 per step and -1 at a failure: a return <= 0 shows the evaluation
    # played the protocol's env (training's pays +1 per step), as Pong's plays without sticky actions.
    protocol = (("sutton_barto_reward", True),)
    env = LearningEnv("CartPole-v1", 1000, 475.0, 60.0, runs=(("paac", "a2c", ""),), eval_episodes=3,
                      eval_env_args=protocol)
    flags = ("--arch", "paac", "--algo", "a2c", "--env", "CartPole-v1", "--seed", "1", "--total-steps", "1000",
             "--num-envs", "16")  # 80 steps a rollout: checkpoints at 400, 800 and the end
    cfg = dataclasses.replace(train_config(flags), time_limit_s=60.0, progress=False, torch_threads=1)
    # Checkpoints every 400 steps: the evaluation plays only the final one, as the learning suite asks.
    cfg = dataclasses.replace(cfg, checkpoint_every=400)
    run = BenchRun("paac-a2c-CartPole-v1-s1", cfg, eval_episodes=3, eval_env_args=protocol,
                   eval_checkpoints=("latest",), flags=flags)
    out = tmp_path / "out"
    rows = run_suite(Suite("learning", "protocol", (run,), (env,)), out, log=lambda line: None)
    assert rows[0]["status"] == "ok", rows[0]["error"]
    result = json.loads((out / "runs" / run.name / "eval.json").read_text())
    assert result["env_args"] == {"sutton_barto_reward": True} and result["noop_max"] == 30
    assert len(list((out / "runs" / run.name / "checkpoints").glob("ckpt-*.pt"))) >= 3
    [policy] = result["policies"]  # the run's final checkpoint alone
    assert policy["env_steps"] >= 1000 and len(policy["returns"]) == 3
    assert all(r in (-1.0, 0.0) for r in policy["returns"])
    [learning] = list(csv.DictReader(open(out / "learning.csv")))
    assert learning["eval_protocol"] == "final policy, 3 episodes, sutton_barto_reward=True"
    assert float(learning["eval_return_mean"]) == pytest.approx(np.mean(policy["returns"]))
    table = (out / "results.md").read_text()
    assert "Evaluated: final policy, 3 episodes, sutton_barto_reward=True; mean ± std over seeds" in table
    assert "| wall time to threshold | evaluated | published |" in table
    with pytest.raises(ConfigError, match="eval_checkpoints need conveyor's evaluation"):
        BenchRun("sb3", cfg, framework="sb3", eval_checkpoints=("latest",))


def test_learning_flags_are_checked(capsys):
    assert main(["bench", "--suite", "quick", "--quick", "--list"]) == 2
    assert "belong to the learning suite" in capsys.readouterr().err
    assert main(["bench", "--suite", "learning", "--quick", "--envs", "Pendulum", "--list"]) == 2
    assert "--envs Pendulum matches no run" in capsys.readouterr().err
    assert main(["bench", "--suite", "learning", "--envs", "pendulum", "--archs", "hts", "--list"]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    assert len(listed) == 3 and all("conveyor train --arch hts --algo ppo --env Pendulum-v1" in l for l in listed)
