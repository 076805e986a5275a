"""gSDE (Raffin et al. 2022): the state-dependent std against numpy, the noise each env holds and redraws, the
actions' distribution against the log-prob the loss uses, and PyTorch's default init (``weight_init torch``)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import threading

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

import conveyor
from conveyor.acting import GsdeNoise, policy_step
from conveyor.config import AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg, read_config_file
from conveyor.learner import load_latest_checkpoint
from conveyor.models import GSDE_EPS, make_model

OBS = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
ACTIONS = gym.spaces.Box(-2.0, 2.0, (2,), np.float32)


def gsde_model(seed: int = 0, **fields) -> nn.Module:
    torch.manual_seed(seed)
    cfg = ModelCfg(name="mlp", hidden=(16, 16), lstm_size=0, normalize_obs=False, separate_value_net=False,
                   log_std_init=-1.0, weight_init="orthogonal", gsde=True, gsde_interval=4)
    model = make_model(dataclasses.replace(cfg, **fields), OBS, ACTIONS)
    with torch.no_grad():  # sigma entries that differ, so a wrong axis would show
        model.log_std.copy_(torch.linspace(-2.0, 0.5, model.log_std.numel()).reshape(model.log_std.shape))
    return model


def numpy_features(model: nn.Module, obs: np.ndarray) -> np.ndarray:
    x = obs.astype(np.float64)
    for layer in model.encoder:
        if isinstance(layer, nn.Linear):
            x = x @ layer.weight.detach().double().numpy().T + layer.bias.detach().double().numpy()
        else:
            x = np.tanh(x)
    return x


def test_state_dependent_std_and_log_prob_match_numpy():
    model = gsde_model()
    obs = np.random.default_rng(0).uniform(-1, 1, (5, 4, 3)).astype(np.float32)
    out = model(torch.from_numpy(obs))
    assert model.log_std.shape == (16, 2) and out.features.shape == (5, 4, 16)
    phi = numpy_features(model, obs.reshape(20, 3))
    sigma = np.exp(model.log_std.detach().double().numpy())
    std = np.sqrt(phi ** 2 @ sigma ** 2 + GSDE_EPS)  # [20, A]
    mean, log_std = out.params.detach().double().reshape(20, 4).split(2, dim=-1)
    np.testing.assert_allclose(log_std.numpy(), np.log(std), rtol=1e-5, atol=1e-6)
    actions = np.random.default_rng(1).normal(size=(20, 2))
    expected = (-0.5 * ((actions - mean.numpy()) / std) ** 2 - np.log(std) - 0.5 * math.log(2 * math.pi)).sum(-1)
    logp = out.log_prob(torch.from_numpy(actions).float().reshape(5, 4, 2))
    np.testing.assert_allclose(logp.detach().double().numpy().reshape(20), expected, rtol=1e-4, atol=1e-4)


def test_log_prob_trains_sigma_and_never_the_features():
    model = gsde_model()
    obs = torch.rand(3, 2, 3)
    out = model(obs)
    assert not out.features.requires_grad
    log_std = out.params[..., 2:]
    log_std.sum().backward()  # the std's gradient reaches sigma only: the features are detached
    assert model.log_std.grad is not None and model.log_std.grad.abs().sum() > 0
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.encoder.parameters())


def test_actions_are_mean_plus_features_times_each_envs_noise():
    model = gsde_model()
    obs = torch.rand(3, 3)
    noise = GsdeNoise(7, interval=4)
    act = policy_step(model, obs, gsde=noise, envs=np.array([0, 5, 9]))
    out = model(obs.unsqueeze(0))
    sigma = model.log_std.detach().exp()
    normals = [np.random.default_rng((7, env, 0)).standard_normal((16, 2), dtype=np.float32) for env in (0, 5, 9)]
    for row, n in enumerate(normals):
        expected = out.params[0, row, :2] + out.features[0, row] @ (sigma * torch.from_numpy(n))
        torch.testing.assert_close(act.actions[row], expected.detach())
    torch.testing.assert_close(act.logp, out.log_prob(act.actions.unsqueeze(0))[0].detach())


def test_each_env_holds_its_noise_for_the_interval_then_draws_anew():
    model = gsde_model()
    obs = torch.rand(1, 3).repeat(2, 1)  # two envs, one observation: only their noise tells them apart
    noise = GsdeNoise(3, interval=4)
    actions = [policy_step(model, obs, gsde=noise, envs=[0, 1]).actions for _ in range(9)]
    for step in range(1, 4):  # steps 0-3: one matrix per env
        torch.testing.assert_close(actions[step], actions[0])
    assert not torch.equal(actions[0][0], actions[0][1])  # envs draw apart
    assert not torch.equal(actions[4], actions[3])  # step 4: new matrices
    torch.testing.assert_close(actions[7], actions[4])
    assert not torch.equal(actions[8], actions[7])
    assert noise.steps_state() == {0: 9, 1: 9}


def test_an_envs_actions_do_not_depend_on_the_batch_or_the_order_it_acts_in():
    model = gsde_model()
    obs = torch.rand(4, 3)
    together = GsdeNoise(11, interval=2)
    apart = GsdeNoise(11, interval=2)
    for _ in range(5):
        batch = policy_step(model, obs, gsde=together, envs=[0, 1, 2, 3]).actions
        singles = [policy_step(model, obs[env:env + 1], gsde=apart, envs=[env]).actions[0] for env in (3, 1, 0, 2)]
        torch.testing.assert_close(batch[[3, 1, 0, 2]], torch.stack(singles), rtol=0, atol=1e-6)


def test_resumed_counts_continue_the_noise_of_an_uninterrupted_run():
    model = gsde_model()
    obs = torch.rand(2, 3)
    whole = GsdeNoise(5, interval=3)
    expected = [policy_step(model, obs, gsde=whole, envs=[0, 1]).actions for _ in range(7)]
    first = GsdeNoise(5, interval=3)
    for _ in range(4):
        policy_step(model, obs, gsde=first, envs=[0, 1])
    resumed = GsdeNoise(5, interval=3)
    resumed.load_steps(first.steps_state())
    rest = [policy_step(model, obs, gsde=resumed, envs=[0, 1]).actions for _ in range(3)]
    for got, want in zip(rest, expected[4:]):
        torch.testing.assert_close(got, want)


def test_actions_over_many_envs_follow_the_distribution_the_loss_scores():
    """Marginally over the noise matrices, one state's action is N(mean, phi^2 @ sigma^2): the distribution of
    the params the log-prob (and so V-trace's and PPO's ratios) reads."""
    model = gsde_model()
    envs = 20_000
    obs = torch.rand(1, 3).expand(envs, 3)
    act = policy_step(model, obs, gsde=GsdeNoise(0, interval=8), envs=np.arange(envs))
    out = model(obs[:1].unsqueeze(0))
    mean, std = out.params[0, 0, :2].detach(), out.params[0, 0, 2:].detach().exp()
    z = (act.actions - mean) / std
    torch.testing.assert_close(z.mean(0), torch.zeros(2), atol=0.04, rtol=0)  # 5 standard errors (1/sqrt(20000))
    torch.testing.assert_close(z.std(0), torch.ones(2), atol=0.03, rtol=0)


def test_a_gsde_model_refuses_to_act_without_its_noise_and_discrete_actions_refuse_gsde():
    with pytest.raises(ValueError, match="gsde= and envs="):
        policy_step(gsde_model(), torch.rand(2, 3))
    cfg = ModelCfg(name="mlp", hidden=(8,), lstm_size=0, normalize_obs=False, separate_value_net=False,
                   log_std_init=0.0, weight_init="orthogonal", gsde=True, gsde_interval=8)
    with pytest.raises(ConfigError, match="continuous actions.*drop --gsde"):
        make_model(cfg, OBS, gym.spaces.Discrete(3))
    with pytest.raises(ConfigError, match="weight_init"):
        ModelCfg(weight_init="xavier")
    with pytest.raises(ConfigError, match="gsde_interval must be positive"):
        ModelCfg(gsde_interval=0)


def test_torch_init_leaves_pytorchs_default_layers_and_orthogonal_reinitializes_them():
    torch_init = gsde_model(seed=4, weight_init="torch")
    torch.manual_seed(4)
    first = nn.Linear(3, 16)  # what PyTorch draws first under the same seed: the encoder's first layer
    torch.testing.assert_close(torch_init.encoder[0].weight, first.weight)
    orthogonal = gsde_model(seed=4)
    weight = orthogonal.encoder[2].weight.detach()  # the 16 x 16 layer: W W^T = gain^2 I
    torch.testing.assert_close(weight @ weight.T, 2.0 * torch.eye(16), atol=1e-5, rtol=0)
    head = orthogonal.policy_head.weight.detach()
    torch.testing.assert_close(head @ head.T, 1e-4 * torch.eye(2), atol=1e-8, rtol=0)
    assert not torch.allclose(torch_init.encoder[2].weight @ torch_init.encoder[2].weight.T, 2.0 * torch.eye(16),
                              atol=0.1)


def test_the_pendulum_preset_of_seed_vtrace_is_rl_zoos_a2c_recipe_and_flags_win():
    cfg = RunCfg(env=EnvCfg(id="Pendulum-v1"), arch=ArchCfg(name="seed"))
    # rl-zoo's recipe but for the initial noise: -1.5 instead of its -2 (presets.py cites the seeds)
    assert (cfg.model.gsde, cfg.model.weight_init, cfg.model.log_std_init, cfg.arch.unroll) == (True, "torch", -1.5, 8)
    assert (cfg.algo.optimizer, cfg.algo.lr, cfg.algo.value_coef) == ("rmsprop", 7e-4, 0.4)
    explicit = RunCfg(env=EnvCfg(id="Pendulum-v1"), arch=ArchCfg(name="seed"),
                      model=ModelCfg(gsde=False, weight_init="orthogonal"))
    assert (explicit.model.gsde, explicit.model.weight_init) == (False, "orthogonal")
    assert RunCfg(env=EnvCfg(id="Pendulum-v1"), arch=ArchCfg(name="paac")).model.gsde  # A2C: the same recipe
    paac_ppo = RunCfg(env=EnvCfg(id="Pendulum-v1"), arch=ArchCfg(name="paac"), algo=AlgoCfg(name="ppo"))
    assert (paac_ppo.model.gsde, paac_ppo.model.gsde_interval, paac_ppo.arch.unroll) == (True, 4, 256)  # rl-zoo PPO, 16 envs
    assert not RunCfg(env=EnvCfg(id="Pendulum-v1"), arch=ArchCfg(name="hts"), algo=AlgoCfg(name="ppo")).model.gsde


def test_a_config_json_from_before_gsde_reads_as_that_run_was_trained(tmp_path):
    """A seed/vtrace Pendulum run written before these fields trained without gSDE, orthogonally initialized:
    its config must not pick up today's preset, or its checkpoints would not fit the model it resumes."""
    data = json.loads(RunCfg(env=EnvCfg(id="Pendulum-v1"), arch=ArchCfg(name="seed")).to_json())
    del data["model"]["gsde"], data["model"]["weight_init"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    old = RunCfg.from_dict(read_config_file(tmp_path / "config.json"))
    assert (old.model.gsde, old.model.weight_init) == (False, "orthogonal")


@pytest.mark.slow  # make test keeps paac's gSDE run (tests/test_exact_resume.py)
@pytest.mark.parametrize("arch,algo", [("seed", "vtrace"), ("impact", "impact"), ("ga3c", "a2c")])
def test_the_asynchronous_architectures_act_and_learn_with_gsde(tmp_path, arch, algo):
    """SEED (noise per inference slot), IMPACT (per worker env) and GA3C (per agent id) on Pendulum: the run
    completes and learns sigma (PAAC and HTS: the resume and determinism tests)."""
    cfg = RunCfg(env=EnvCfg(id="Pendulum-v1", num_envs=4, num_workers=2), arch=ArchCfg(name=arch),
                 algo=AlgoCfg(name=algo), model=ModelCfg(gsde=True, hidden=(16, 16)), total_steps=1000,
                 torch_threads=1, progress=False, out=str(tmp_path / arch))
    summary = conveyor.train(cfg)
    assert summary["env_steps"] >= 1000 and summary["updates"] > 0
    _, state = load_latest_checkpoint(tmp_path / arch, "cpu")
    sigma = state["model"]["log_std"]
    assert sigma.shape == (16, 1) and not torch.all(sigma == cfg.model.log_std_init)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 4-6 minutes on the 2-core machine, twice that when the first seed misses
def test_seed_vtrace_learns_pendulum_with_default_flags(tmp_path):
    """The Pendulum row of issue 15 with nothing but --arch seed --env Pendulum-v1: the preset's gSDE recipe.
    Random play scores about -1250; each of seeds 1-14 measured ended between -193 and -366 at 300k steps
    (docs/benchmarks-log.md), so the bar is -450: clearly learned. Asynchronous acting makes a seed's run depend
    on the machine's load (the actors' timing decides which parameters act): beside another slow test on two
    cores seed 1 once ended at -1055 and passed alone at once. So a second seed runs when the first misses the
    bar; one of two must learn."""
    returns = []
    for seed in (1, 2):
        cfg = RunCfg(env=EnvCfg(id="Pendulum-v1"), arch=ArchCfg(name="seed"), total_steps=300_000, seed=seed,
                     progress=False, out=str(tmp_path / f"run-{seed}"))
        returns.append(conveyor.train(cfg)["return_mean_last100"])
        if returns[-1] >= -450:
            break
    assert returns[-1] >= -450, returns


def test_threads_acting_for_disjoint_envs_get_each_envs_own_noise():
    """HTS's actor threads call one ``GsdeNoise`` at once for disjoint envs; the first calls grow its tables.
    A thread switch every microsecond lands inside that growth, where an unguarded table lost draws."""
    threads, envs_each, rounds = 4, 3, 40
    shape = (5, 2)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for attempt in range(rounds):
            noise = GsdeNoise(attempt, interval=2)
            start = threading.Barrier(threads)
            got: dict[int, torch.Tensor] = {}

            def act(first: int) -> None:
                envs = np.arange(first, first + envs_each)
                start.wait()
                for step in range(4):  # two matrices per env
                    got[first, step] = noise.unit_normals(envs, np.full(envs_each, step), shape)

            workers = [threading.Thread(target=act, args=(i * envs_each,)) for i in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            for (first, step), normals in got.items():
                for row, env in enumerate(range(first, first + envs_each)):
                    want = np.random.default_rng((attempt, env, step // 2)).standard_normal(shape, dtype=np.float32)
                    assert torch.equal(normals[row], torch.from_numpy(want)), (attempt, env, step)
    finally:
        sys.setswitchinterval(switch)
