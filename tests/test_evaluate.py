"""Evaluation protocols (HTS-RL section 5): the arithmetic by hand, and on synthetic checkpoints."""

import json
import math

import pytest
import torch

from conveyor.cli import main
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.envs import STEP_TIME_ID, make_env
from conveyor.evaluate import (
    ModelAgent,
    PolicyEval,
    evaluate_run,
    final_metric,
    final_time_metric,
    model_for_checkpoint,
    protocol_metrics,
    required_time,
    running_means,
    window_mean,
)
from conveyor.learner import save_checkpoint
from conveyor.models import make_model

torch.set_num_threads(1)


def policies_with_means(means, wall_times=None, episodes=10):
    """Policies whose 10 episodes average exactly ``means[i]`` (returns mean - 4.5 ... mean + 4.5)."""
    wall_times = wall_times or [float(i) for i in range(len(means))]
    return [PolicyEval(f"ckpt-{i}", 100 * (i + 1), wall_times[i], i,
                       tuple(m - 4.5 + j for j in range(episodes))) for i, m in enumerate(means)]


def test_final_metric_is_the_mean_of_the_last_10_policies_x_10_episodes():
    policies = policies_with_means([10.0 * i for i in range(12)])  # 0, 10, ..., 110
    # Last 10 policies: 20 .. 110, mean 65; all 100 episodes count equally.
    assert final_metric(policies) == pytest.approx(65.0)
    assert window_mean(policies) == pytest.approx(65.0)
    episodes = [r for p in policies[2:] for r in p.returns]
    assert len(episodes) == 100 and final_metric(policies) == pytest.approx(sum(episodes) / 100)
    # Fewer than 10 policies: all of them.
    assert final_metric(policies[:3]) == pytest.approx(10.0)
    assert math.isnan(final_metric([]))


def test_final_time_metric_uses_only_policies_within_the_limit():
    policies = policies_with_means([10.0 * i for i in range(12)], wall_times=[5.0 * i for i in range(12)])
    # Within 20 s: policies 0..4 (means 0..40), mean 20.
    assert final_time_metric(policies, 20.0) == pytest.approx(20.0)
    # Within 57 s: policies 0..11 -> the last 10 of them, as the final metric.
    assert final_time_metric(policies, 57.0) == pytest.approx(final_metric(policies))
    assert math.isnan(final_time_metric(policies, -1.0))


def test_required_time_metric_on_a_known_curve():
    # Policy i has mean 10 i and was saved at 2 i + 1 seconds. The running mean over the last
    # (up to) 10 policies is 5 i for i < 10 and 10 i - 45 after: 0, 5, ..., 45, 55, 65, 75, ...
    policies = policies_with_means([10.0 * i for i in range(15)], wall_times=[2.0 * i + 1 for i in range(15)])
    assert running_means(policies)[:12] == pytest.approx([5.0 * i for i in range(10)] + [55.0, 65.0])
    assert required_time(policies, 60.0).wall_time_s == 23.0  # i = 11: 65 >= 60, i = 10: 55 < 60
    assert required_time(policies, 55.0).wall_time_s == 21.0  # reaching the target exactly counts
    assert required_time(policies, 0.0).wall_time_s == 1.0
    assert required_time(policies, 1000.0) is None
    metrics = protocol_metrics(policies, time_limit_s=9.0, target=60.0)
    assert metrics["required_time_metric"] == {"target": 60.0, "reached": True, "wall_time_s": 23.0,
                                               "env_steps": 1200, "checkpoint": "ckpt-11"}
    assert metrics["final_time_metric"] == {"time_limit_s": 9.0, "value": pytest.approx(20.0), "policies": 5}
    assert metrics["final_metric"] == pytest.approx(95.0) and metrics["final_metric_policies"] == 10


STEP_TIME = EnvCfg(id=STEP_TIME_ID, num_envs=1, num_workers=1, env_args=(("dist", "constant"), ("mean_ms", 0.0)))


def bandit_model(correct: bool):
    """A StepTime policy that always picks the rewarded action (return 100) or never does (return 0)."""
    env = make_env(STEP_TIME, 0)
    model = make_model(RunCfg(model=ModelCfg(hidden=(8,))).model, env.observation_space, env.action_space)
    env.close()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.encoder[0].weight[0, 0] = 100.0  # h0 = tanh(100 obs[0]) ~ sign(obs[0])
        sign = 1000.0 if correct else -1000.0
        model.policy_head.weight[1, 0] = sign  # rewarded action: obs[0] > 0
        model.policy_head.weight[0, 0] = -sign
    return model


def write_synthetic_run(run_dir, correct_from=6, count=12):
    """Checkpoint k (k = 0..11): saved at 10 k seconds; its policy is right iff k >= correct_from."""
    cfg = RunCfg(env=STEP_TIME, model=ModelCfg(hidden=(8,)), seed=3)
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    for k in range(count):
        steps = 100 * (k + 1)
        save_checkpoint(run_dir / "checkpoints" / f"ckpt-{steps:012d}.pt",
                        {"model": bandit_model(k >= correct_from).state_dict(), "version": k, "env_steps": steps,
                         "wall_time_s": 10.0 * k})


def test_evaluate_run_on_synthetic_checkpoints(tmp_path):
    write_synthetic_run(tmp_path)
    result = evaluate_run(tmp_path, episodes=10, time_limit_s=85.0, target=50.0)
    assert [p["mean"] for p in result["policies"]] == [0.0] * 6 + [100.0] * 6
    assert all(len(p["returns"]) == 10 for p in result["policies"])
    # Last 10 policies (k = 2..11): 6 right ones of 10 -> 60.
    assert result["final_metric"] == pytest.approx(60.0)
    # Within 85 s: k = 0..8, right for k = 6, 7, 8 -> 300 / 9.
    assert result["final_time_metric"]["value"] == pytest.approx(100.0 / 3)
    assert result["final_time_metric"]["policies"] == 9
    # Running mean: k = 9 -> 400 / 10 = 40; k = 10 (window 1..10) -> 500 / 10 = 50 >= 50 at 100 s.
    assert result["running_mean"][9] == pytest.approx(40.0)
    assert result["required_time_metric"]["wall_time_s"] == 100.0
    assert json.loads((tmp_path / "eval.json").read_text())["final_metric"] == pytest.approx(60.0)


def test_eval_command_prints_the_table_and_exits_2_on_bad_runs(tmp_path, capsys):
    write_synthetic_run(tmp_path / "run", correct_from=1, count=2)
    assert main(["eval", "--run", str(tmp_path / "run"), "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "final metric (2 of the last 10 policies x 2 episodes): 50.00" in out
    assert "eval.json" in out
    assert main(["eval", "--run", str(tmp_path / "nothing")]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    (tmp_path / "empty" / "config.json").write_text((tmp_path / "run" / "config.json").read_text())
    assert main(["eval", "--run", str(tmp_path / "empty")]) == 2
    assert "no checkpoints" in capsys.readouterr().err
    # A checkpoint of another model: one line, exit 2.
    other = RunCfg(env=STEP_TIME, model=ModelCfg(hidden=(16,)))
    (tmp_path / "run" / "config.json").write_text(other.to_json())
    assert main(["eval", "--run", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not fit" in err and len(err.splitlines()) == 1


def test_eval_env_arg_reaches_the_env_and_is_recorded(tmp_path, capsys):
    write_synthetic_run(tmp_path, correct_from=1, count=2)
    assert main(["eval", "--run", str(tmp_path), "--episodes", "2", "--env-arg", "mean_ms=0.5"]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["env_args"] == {"mean_ms": 0.5} and [p["mean"] for p in result["policies"]] == [0.0, 100.0]
    capsys.readouterr()
    # The override replaces the run's own dist (constant): a bad one is the env's one-line usage error.
    assert main(["eval", "--run", str(tmp_path), "--episodes", "1", "--env-arg", "dist=bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown StepTime dist 'bogus'" in err and len(err.splitlines()) == 1


def test_eval_checkpoint_picks_the_policies_it_plays(tmp_path, capsys):
    write_synthetic_run(tmp_path)  # 12 checkpoints at 100 .. 1200 env steps, right from k = 6 (700 steps)
    result = evaluate_run(tmp_path, episodes=2, checkpoints=("latest", 300, "latest"))
    assert [(p["env_steps"], p["mean"]) for p in result["policies"]] == [(300, 0.0), (1200, 100.0)]
    assert result["final_metric"] == pytest.approx(50.0)
    other_file = tmp_path / "checkpoints" / "ckpt-000000000700.pt"
    assert main(["eval", "--run", str(tmp_path), "--episodes", "1", "--checkpoint", str(other_file)]) == 0
    assert [p["env_steps"] for p in json.loads((tmp_path / "eval.json").read_text())["policies"]] == [700]
    capsys.readouterr()
    assert main(["eval", "--run", str(tmp_path), "--checkpoint", "250"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no checkpoint at 250 env steps" in err and "100, 200, 300" in err and len(err.splitlines()) == 1


def test_q_head_and_recurrent_core_are_read_off_the_checkpoint():
    env = make_env(EnvCfg(id="CartPole-v1"), 0)
    saved = make_model(RunCfg(arch=ArchCfg(name="seed"), algo=AlgoCfg(name="r2d2"),
                              model=ModelCfg(hidden=(16,), lstm_size=8)).model, env.observation_space,
                       env.action_space, dueling=True)
    cfg = RunCfg(model=ModelCfg(hidden=(16,)))  # the config leaves the core and the head implicit (R2D2)
    model = model_for_checkpoint(cfg, env.observation_space, env.action_space, saved.state_dict())
    model.load_state_dict(saved.state_dict())
    agent = ModelAgent(model, epsilon=0.0)
    agent.reset(3, seed=0)
    obs = torch.randn(3, 4).numpy()
    actions = agent.act(obs, prev_reward=torch.zeros(3).numpy())
    with torch.no_grad():
        greedy = model(torch.as_tensor(obs).unsqueeze(0)).q[0].argmax(-1).numpy()
    assert actions.tolist() == greedy.tolist()  # epsilon 0: greedy on Q
    env.close()
