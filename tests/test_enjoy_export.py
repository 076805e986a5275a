"""After training: ``conveyor.load_policy``, ``conveyor enjoy`` (episode lines, videos) and ``conveyor export``
(TorchScript and ONNX give load_policy's deterministic actions), on tiny real runs trained once per module:
PAAC A2C on CartPole, PAAC PPO on Pendulum (continuous, normalized observations and rewards) and SEED R2D2 (a
recurrent dueling Q network); and untrained actor-critics with an LSTM core (SEED V-trace on CartPole, IMPACT on
Pendulum)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import conveyor
from conveyor.cli import main
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.envs import env_spaces
from conveyor.export import input_names, output_names
from conveyor.learner import save_checkpoint
from conveyor.models import make_model
from conveyor.policy import load_policy, play_env_cfg
from tests.videos import video_size_and_frames

torch.set_num_threads(1)
# torch 2.13 deprecates torch.jit (TorchScript), which still works: its load warns.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


def _cartpole(**overrides):
    return dict(env=EnvCfg(id="CartPole-v1", num_envs=4, num_workers=1), progress=False, torch_threads=1, seed=0,
                **overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> run directory, each a real (tiny) training run."""
    root = tmp_path_factory.mktemp("runs")
    cfgs = {
        "paac": RunCfg(**_cartpole(total_steps=400), model=ModelCfg(hidden=(16,))),
        "pendulum": RunCfg(env=EnvCfg(id="Pendulum-v1", num_envs=2, num_workers=1, normalize_reward=True),
                           model=ModelCfg(hidden=(16,), normalize_obs=True),
                           algo=AlgoCfg(name="ppo", ppo_epochs=1, ppo_minibatches=1), arch=ArchCfg(unroll=16),
                           total_steps=64, progress=False, torch_threads=1, seed=0),
        "r2d2": RunCfg(env=EnvCfg(id="CartPole-v1", num_envs=2, num_workers=1),
                       model=ModelCfg(name="mlp", hidden=(16,), lstm_size=8), algo=AlgoCfg(name="r2d2"),
                       arch=ArchCfg(name="seed", local_actors=1, seq_len=6, burn_in=2, batch_size=2, min_replay=2,
                                    replay_capacity=16, replay_ratio=0.0),
                       total_steps=150, progress=False, torch_threads=1, seed=0),
    }
    dirs = {}
    for name, cfg in cfgs.items():
        out = root / name
        conveyor.train(dataclasses.replace(cfg, out=str(out)))
        dirs[name] = out
    lstm = ModelCfg(hidden=(16,), lstm_size=8, separate_value_net=False)
    dirs["vtrace_lstm"] = synthetic_run(root / "vtrace_lstm", RunCfg(**_cartpole(), model=lstm,
                                                                     arch=ArchCfg(name="seed")))
    dirs["impact_lstm"] = synthetic_run(root / "impact_lstm", RunCfg(env=EnvCfg(id="Pendulum-v1"), model=lstm,
                                                                     arch=ArchCfg(name="impact"), seed=0))
    # PPO's Atari presets standardize frames and value targets: statistics away from the identity, as after training.
    dirs["pong_ppo"] = synthetic_run(root / "pong_ppo", RunCfg(env=EnvCfg(id="ALE/Pong-v5"), algo=AlgoCfg(name="ppo")),
                                     statistics=True)
    return dirs


RECURRENT = ("r2d2", "vtrace_lstm", "impact_lstm")


def rollout(policy, steps, seed=0, deterministic=True):
    """Observations, rewards before them (None at starts) and the states the policy acted from, over ``steps``."""
    env = policy.make_env(seed=seed)
    obs, _ = env.reset(seed=seed)
    state, reward = None, None
    record = []
    for _ in range(steps):
        record.append((obs, reward, state))
        action, state = policy.act(obs, state, deterministic, reward)
        assert env.action_space.contains(action), action
        obs, reward, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            obs, _ = env.reset()
            state, reward = None, None
    env.close()
    return record


# ---- load_policy ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["paac", "pendulum", "r2d2", "vtrace_lstm", "impact_lstm"])
def test_load_policy_acts_validly_and_deterministically(runs, name):
    policy = conveyor.load_policy(runs[name], seed=3)
    assert policy.recurrent == (name in RECURRENT) and policy.q_head == (name == "r2d2")
    record = rollout(policy, 30, deterministic=False)  # sampled actions all lie in the action space
    obs = record[5][0]
    first, _ = policy.act(obs, deterministic=True)
    assert np.array_equal(first, policy.act(obs, deterministic=True)[0])
    again = load_policy(runs[name], checkpoint="latest")
    assert np.array_equal(first, again.act(obs, deterministic=True)[0])
    # A batch in, a batch out; a single observation, a single action.
    batch, _ = policy.act(np.stack([obs, obs, obs]), deterministic=True)
    assert batch.shape == (3, *policy.action_space.shape) and np.array_equal(batch[0], first)
    assert np.shape(first) == policy.action_space.shape
    # Sampling is reproducible under a seed.
    policy.seed(7)
    draws = [policy.act(obs)[0] for _ in range(5)]
    policy.seed(7)
    assert all(np.array_equal(a, policy.act(obs)[0]) for a in draws)


def test_continuous_actions_are_clipped_to_the_bounds_and_float32(runs):
    policy = load_policy(runs["pendulum"])
    assert policy.cfg.model.normalize_obs  # the statistics come with the weights
    low, high = policy.action_space.low, policy.action_space.high
    far = np.full((64, 3), 50.0, np.float32) * np.sign(np.random.default_rng(0).standard_normal((64, 3)))
    for deterministic in (True, False):
        actions, _ = policy.act(far, deterministic=deterministic)
        assert actions.dtype == np.float32 and actions.shape == (64, 1)
        assert (actions >= low).all() and (actions <= high).all()


def test_recurrent_state_is_carried_and_reset(runs):
    for name in RECURRENT:
        policy = load_policy(runs[name])
        env = policy.make_env(seed=0)
        obs, _ = env.reset(seed=0)
        _, s1 = policy.act(obs, deterministic=True)
        zeros = policy.initial_state(1)
        assert float(zeros.h.abs().sum()) == 0 and float(s1.h.abs().sum()) > 0
        _, s2 = policy.act(obs, s1, deterministic=True, reward=1.0)
        assert not torch.equal(s1.h, s2.h)  # the core carries its memory forward
        # state=None starts an episode: the same as passing the initial state.
        assert torch.equal(policy.act(obs, None, deterministic=True)[1].h, policy.act(obs, zeros, True)[1].h)
        batch = policy.act(np.stack([obs, obs]), deterministic=True)[1]
        reset = policy.reset_state(batch, np.array([True, False]))
        assert float(reset.h[:, 0].abs().sum()) == 0 and torch.equal(reset.h[:, 1], batch.h[:, 1])
        assert float(reset.prev_action[0].abs().sum()) == 0


@pytest.mark.parametrize("name", ["vtrace_lstm", "impact_lstm"])
def test_eval_agent_plays_a_recurrent_actor_critic_as_load_policy_does(runs, name):
    """``conveyor eval``'s agent and ``load_policy`` feed the core alike (state, previous action and reward)."""
    from conveyor.evaluate import ModelAgent

    policy = load_policy(runs[name], seed=5)
    agent = ModelAgent(policy.model)
    agent.reset(1, 5)
    env = policy.make_env(seed=0)
    obs, _ = env.reset(seed=0)
    state, reward = None, 0.0
    for step in range(20):
        action, state = policy.act(obs, state, reward=reward)
        mine = agent.act(obs[None], np.array([reward], np.float32))[0]
        if policy.net.discrete:
            assert mine == action
        else:
            np.testing.assert_allclose(np.clip(mine, policy.action_space.low, policy.action_space.high), action,
                                       rtol=1e-6, atol=1e-6)
        obs, reward, terminated, truncated, _ = env.step(action)
        if terminated or truncated:  # one episode: evaluation plays one per env
            break
    env.close()
    assert step >= 5


def test_play_env_is_the_training_env_with_real_games_and_raw_rewards():
    cfg = RunCfg(env=EnvCfg(id="ALE/Pong-v5", episodic_life=True))
    play = play_env_cfg(cfg, "rgb_array")
    assert not play.episodic_life and not play.clip_rewards and ("render_mode", "rgb_array") in play.env_args
    assert play.frame_stack == cfg.env.frame_stack and play.frame_skip == cfg.env.frame_skip


def test_env_arg_overrides_replace_only_their_keys():
    env = EnvCfg(id="ALE/Pong-v5", env_args=(("repeat_action_probability", 0.25), ("mode", 0)))
    assert env.with_env_args((("repeat_action_probability", 0.0), ("difficulty", 1))).kwargs == {
        "repeat_action_probability": 0.0, "mode": 0, "difficulty": 1}
    assert env.with_env_args(()) == env


# ---- enjoy ------------------------------------------------------------------------------------------
def episode_lines(text):
    return re.findall(r"^episode \d+: return (-?[\d.]+), length (\d+)", text, flags=re.MULTILINE)


def test_enjoy_prints_one_line_per_episode_and_records_every_frame(runs, tmp_path, capsys):
    video = tmp_path / "cartpole.mp4"
    assert main(["enjoy", "--run", str(runs["paac"]), "--episodes", "2", "--video", str(video), "--seed", "4"]) == 0
    out = capsys.readouterr().out
    lines = episode_lines(out)
    assert len(lines) == 2 and "mean return" in out
    lengths = [int(length) for _, length in lines]
    assert [float(r) for r, _ in lines] == lengths  # CartPole: +1 per step, the raw return
    assert video.is_file() and video.stat().st_size > 0
    assert not list(tmp_path.glob(".*partial*"))
    # CartPole's own rgb_array frames, and a reset frame per episode
    assert video_size_and_frames(video) == ((600, 400), sum(lengths) + 2)


def test_enjoy_returns_are_raw_env_returns(runs):
    """The Pendulum run normalizes training rewards; enjoy reports the env's own: the sum of the rewards a plain
    gymnasium Pendulum gives for the same actions from the same seed."""
    from conveyor.enjoy import play

    policy = load_policy(runs["pendulum"])
    assert policy.cfg.env.normalize_reward
    (ret, length), = play(policy, 1, seed=11, deterministic=True, echo=lambda line: None)
    plain = gym.make("Pendulum-v1")
    obs, _ = plain.reset(seed=11)
    total = 0.0
    for _ in range(length):
        obs, reward, *_ = plain.step(policy.act(obs, deterministic=True)[0])
        total += float(reward)
    assert length == 200 and ret == pytest.approx(total, rel=1e-6)


@pytest.mark.parametrize("name", ["r2d2", "vtrace_lstm"])
def test_enjoy_plays_a_recurrent_policy(runs, capsys, name):
    assert main(["enjoy", "--run", str(runs[name]), "--episodes", "2", "--deterministic"]) == 0
    assert len(episode_lines(capsys.readouterr().out)) == 2


def synthetic_run(path: Path, cfg: RunCfg, dueling: bool = False, statistics: bool = False) -> Path:
    """A run directory with an untrained model's checkpoint (for envs too slow to train on here); ``statistics``:
    its normalizers' statistics taken from random observations and targets."""
    (path / "checkpoints").mkdir(parents=True)
    (path / "config.json").write_text(cfg.to_json())
    obs_space, action_space = env_spaces(cfg.env, 0)
    model = make_model(cfg.model, obs_space, action_space, dueling=dueling)
    if statistics:
        obs_space.seed(0)
        model.obs_normalizer.update(torch.as_tensor(np.stack([obs_space.sample() for _ in range(16)])))
        model.value_normalizer.update(torch.linspace(-1.0, 0.5, 64))
    save_checkpoint(path / "checkpoints" / "ckpt-000000000000.pt", {"model": model.state_dict(), "version": 0})
    return path


def test_atari_video_holds_the_raw_emulator_frames(tmp_path, capsys):
    run = synthetic_run(tmp_path / "pong", RunCfg(env=EnvCfg(id="ALE/Pong-v5", noop_max=2)))
    policy = load_policy(run)
    assert policy.observation_space.shape == (4, 84, 84) and policy.observation_space.dtype == np.uint8
    video = tmp_path / "pong.mp4"
    assert main(["enjoy", "--run", str(run), "--episodes", "1", "--max-steps", "3", "--video", str(video)]) == 0
    assert "cut at --max-steps 3" in capsys.readouterr().out
    size, frames = video_size_and_frames(video)
    assert size == (160, 210)  # not the 84x84 network input
    assert 1 + 1 + 3 * 4 <= frames <= 1 + 2 + 3 * 4  # reset, 1-2 no-ops, 3 agent steps of 4 emulator frames


def test_env_arg_plays_pong_without_sticky_actions(tmp_path, capsys):
    """``--env-arg repeat_action_probability=0`` reaches the emulator (ALE/Pong-v5 trains with sticky actions)."""
    run = synthetic_run(tmp_path / "pong", RunCfg(env=EnvCfg(id="ALE/Pong-v5", noop_max=2)))
    for env_args, expected in [((), 0.25), ((("repeat_action_probability", 0),), 0.0)]:
        env = load_policy(run, env_args=env_args).make_env(seed=0)
        assert env.unwrapped.ale.getFloat("repeat_action_probability") == pytest.approx(expected)
        env.close()
    assert main(["enjoy", "--run", str(run), "--episodes", "1", "--max-steps", "2",
                 "--env-arg", "repeat_action_probability=0"]) == 0
    out = capsys.readouterr().out
    assert "repeat_action_probability=0;" in out and len(episode_lines(out)) == 1


# ---- export -----------------------------------------------------------------------------------------
def reference(policy, obs, state=None, reward=None):
    """load_policy's outputs for a batch: (deterministic action, head, value[, next h, next c])."""
    inputs = [torch.as_tensor(obs)]
    if policy.recurrent:
        state = state or policy.initial_state(len(obs))
        inputs += [state.h, state.c, state.prev_action, torch.as_tensor(reward, dtype=torch.float32)]
    with torch.no_grad():
        return [t.numpy() for t in policy.net(*inputs)], inputs


@pytest.mark.parametrize("fmt", ["torchscript", pytest.param("onnx", marks=pytest.mark.slow)])  # onnx: dynamo, slow
@pytest.mark.parametrize("name", ["paac", "pendulum", "pong_ppo", *(pytest.param(name, marks=pytest.mark.slow)
                                                                     for name in ("r2d2", "impact_lstm"))])
def test_exported_network_gives_load_policy_actions(runs, tmp_path, fmt, name):
    policy = load_policy(runs[name])
    out = tmp_path / f"policy.{'onnx' if fmt == 'onnx' else 'pt'}"
    assert main(["export", "--run", str(runs[name]), "--format", fmt, "--out", str(out)]) == 0
    if fmt == "onnx":
        import onnx
        import onnxruntime

        session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == input_names(policy)
        assert [o.name for o in session.get_outputs()] == output_names(policy)
        meta = json.loads({p.key: p.value for p in onnx.load(str(out)).metadata_props}["conveyor"])

        def run(inputs):
            return session.run(None, {n: t.numpy() for n, t in zip(input_names(policy), inputs)})
    else:
        module = torch.jit.load(str(out))
        files = {"conveyor.json": ""}
        torch.jit.load(str(out), _extra_files=files)
        meta = json.loads(files["conveyor.json"])

        def run(inputs):
            with torch.no_grad():
                return [t.numpy() for t in module(*inputs)]
    assert meta["inputs"] == input_names(policy) and meta["outputs"] == output_names(policy)
    record = rollout(policy, 40)
    if policy.recurrent:  # step by step, carrying the state as enjoy does
        checks = [([obs[None]], state, [0.0 if reward is None else reward]) for obs, reward, state in record]
    else:  # one batch of every recorded observation
        checks = [([np.stack([obs for obs, _, _ in record])], None, None)]
    for (obs,), state, reward in checks:
        expected, inputs = reference(policy, obs, state, reward)
        got = run(inputs)
        actions, _ = policy.act(obs, state, deterministic=True, reward=reward)
        if policy.net.discrete:
            assert np.array_equal(got[0], actions) and np.array_equal(expected[0], actions)
        else:
            np.testing.assert_allclose(got[0], actions, rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(got[1:], expected[1:]):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)
    # Any batch size.
    if not policy.recurrent:
        obs = np.stack([obs for obs, _, _ in record[:3]])
        assert run([torch.as_tensor(obs)])[0].shape[0] == 3


# ---- usage mistakes -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def no_checkpoints(runs, tmp_path_factory):
    path = tmp_path_factory.mktemp("empty")
    (path / "checkpoints").mkdir()
    (path / "config.json").write_text((runs["paac"] / "config.json").read_text())
    return path


@pytest.mark.parametrize("args, message", [
    (["enjoy", "--run", "{missing}"], "does not exist: pass the --out DIR of a conveyor run"),
    (["enjoy", "--run", "{tmp}"], "no config.json in"),
    (["export", "--run", "{tmp}", "--format", "onnx", "--out", "{tmp}/x.onnx"], "no config.json in"),
    (["enjoy", "--run", "{empty}"], "no checkpoints in"),
    (["export", "--run", "{empty}", "--format", "torchscript", "--out", "{tmp}/x.pt"], "no checkpoints in"),
    (["enjoy", "--run", "{paac}", "--checkpoint", "12345"], "no checkpoint at 12345 env steps"),
    (["export", "--run", "{paac}", "--format", "tflite", "--out", "x"], "invalid choice: 'tflite'"),
    (["enjoy", "--run", "{paac}", "--video", "{tmp}/a.mp4", "--render", "human"], "choose one"),
    (["enjoy", "--run", "{paac}", "--video", "{tmp}/a.gif"], "name a .mp4"),
    (["enjoy", "--run", "{paac}", "--episodes", "0"], "--episodes must be positive"),
    (["enjoy", "--run", "{paac}", "--video", "{tmp}/" + "v" * 250 + ".mp4"], "file name is 254 bytes long"),
    (["export", "--run", "{paac}", "--format", "torchscript", "--out", "{tmp}"], "is a directory"),
    (["export", "--run", "{paac}", "--format", "onnx", "--out", "{tmp}/" + "x" * 250 + ".onnx"], "file name is"),
])
def test_usage_mistakes_exit_2_with_one_line(runs, no_checkpoints, tmp_path, capsys, args, message):
    names = {"missing": str(tmp_path / "nope"), "tmp": str(tmp_path), "empty": str(no_checkpoints),
             "paac": str(runs["paac"])}
    assert main([arg.format(**names) for arg in args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("conveyor: error:") and message in err, err
    assert not list(tmp_path.glob(".*partial*"))  # nothing left behind


@pytest.mark.parametrize("name", ["paac", "pendulum", "r2d2"])
def test_act_refuses_bad_observations_and_takes_an_empty_batch(runs, name):
    policy = load_policy(runs[name])
    shape = policy.observation_space.shape
    good = np.zeros((3, *shape), policy.observation_space.dtype)
    nan, inf = good.copy(), good.copy()
    nan[1, 0], inf[2, -1] = np.nan, -np.inf
    for obs, says in [(nan, "1 NaN and 0 inf"), (inf, "0 NaN and 1 inf"), (nan[1], "1 NaN"), (None, "is None"),
                      ([None] * shape[0], "None among them"), (np.full(shape, "a"), "dtype <U1")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            policy.act(obs)
    assert np.shape(policy.act(nan, check=False)[0])[0] == 3  # the escape for speed: no pass over the data
    actions, state = policy.act(np.zeros((0, *shape), policy.observation_space.dtype))
    assert actions.shape == (0, *policy.action_space.shape) and actions.dtype == policy.action_space.dtype
    assert (state is None) == (not policy.recurrent)


@pytest.mark.parametrize("name", ["paac", "pendulum"])
def test_exported_network_gives_no_action_for_a_non_finite_observation(runs, tmp_path, name):
    policy = load_policy(runs[name])
    out = tmp_path / "policy.pt"
    assert main(["export", "--run", str(runs[name]), "--format", "torchscript", "--out", str(out)]) == 0
    obs = np.zeros((3, *policy.observation_space.shape), np.float32)
    obs[1, 0] = np.nan
    with torch.no_grad():
        actions = torch.jit.load(str(out))(torch.as_tensor(obs))[0].numpy()
    if policy.net.discrete:
        assert actions[1] == -1 and actions[0] >= 0 and actions[2] >= 0
    else:
        assert np.isnan(actions[1]).all() and np.isfinite(actions[[0, 2]]).all()
