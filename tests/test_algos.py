"""Each algorithm's loss on a small real model: finite, differentiable, with its metrics; A2C checked by hand."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from conveyor.algos import make_loss
from conveyor.config import ALGOS, AlgoCfg, ArchCfg, ModelCfg, RunCfg
from conveyor.models import make_model

T, B, OBS = 5, 3, 4
ARCH_OF = {"a2c": "paac", "ppo": "paac", "vtrace": "seed", "impact": "impact", "r2d2": "seed", "ga3c": "ga3c"}
COMMON_METRICS = {"loss", "policy_loss", "value_loss", "entropy"}
METRICS = {
    "a2c": COMMON_METRICS | {"advantage_mean"},
    "ga3c": COMMON_METRICS | {"advantage_mean"},
    "ppo": COMMON_METRICS | {"ratio_mean", "ratio_max", "clip_fraction", "approx_kl"},
    "vtrace": COMMON_METRICS | {"rho_mean", "rho_max", "rho_clip_fraction"},
    "impact": COMMON_METRICS | {"ratio_mean", "ratio_max", "clip_fraction", "worker_ratio_clip_fraction"},
    "r2d2": {"loss", "td_abs_mean", "q_mean", "priorities"},
}


def run_cfg(algo: str, **algo_fields) -> RunCfg:
    return RunCfg(algo=AlgoCfg(name=algo, **algo_fields), arch=ArchCfg(name=ARCH_OF[algo]))


def make_case(algo: str, continuous: bool = False, seed: int = 0):
    """A small model and a random batch with an episode end and a truncation mid-rollout."""
    torch.manual_seed(seed)
    action_space = gym.spaces.Box(-1, 1, (2,)) if continuous else gym.spaces.Discrete(3)
    observation_space = gym.spaces.Box(-np.inf, np.inf, (OBS,))
    model_cfg = RunCfg(model=ModelCfg(hidden=(16,))).model  # a bare ModelCfg leaves its preset fields None
    model = make_model(model_cfg, observation_space, action_space, dueling=algo == "r2d2")
    obs = torch.randn(T + 1, B, OBS)
    with torch.no_grad():
        behaviour = model(obs)  # a behaviour policy near the learner, as after a few updates
        behaviour_params = behaviour.params + 0.3 * torch.randn_like(behaviour.params)
        actions = behaviour.policy.sample(behaviour_params[:T])
    discounts = torch.full((T, B), 0.99)
    discounts[2, 0] = 0.0  # terminal
    rewards = torch.randn(T, B)
    discounts[3, 1] = 0.0  # truncation: the runner folded gamma * V(final_obs) into the reward
    rewards[3, 1] += 0.99 * 1.7
    batch = {
        "obs": obs, "actions": actions, "rewards": rewards, "discounts": discounts,
        "behaviour_logp": behaviour.policy.log_prob(behaviour_params[:T], actions),
        "behaviour_value": behaviour.value + 0.1 * torch.randn(T + 1, B),
        "policy_version": torch.zeros(T, B, dtype=torch.long),
    }
    if algo == "impact":
        target_params = behaviour.params[:T] + 0.2 * torch.randn(T, B, behaviour.params.shape[-1])
        batch["target_logp"] = behaviour.policy.log_prob(target_params, actions)
        batch["target_params"] = target_params
    if algo == "r2d2":
        batch["target_q"] = behaviour.q + 0.1 * torch.randn_like(behaviour.q)
        batch["weights"] = torch.rand(B) + 0.5
    return model, batch


CASES = [(algo, False) for algo in ALGOS] + [(algo, True) for algo in ("a2c", "ppo", "vtrace", "impact")]


@pytest.mark.parametrize("algo,continuous", CASES)
def test_loss_is_finite_differentiable_and_reports_metrics(algo, continuous):
    model, batch = make_case(algo, continuous)
    loss, metrics = make_loss(run_cfg(algo))(model(batch["obs"]), batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    # every layer the loss reads gets a gradient: the encoder and both heads (or the dueling streams)
    reached = [name for name, g in grads.items() if g is not None and g.abs().sum() > 0]
    assert any(name.startswith("encoder") for name in reached)
    heads = ("advantage", "state_value") if algo == "r2d2" else ("policy_head", "value_head")
    for head in heads:
        assert any(name.startswith(head) for name in reached), f"{head} got no gradient"
    assert set(metrics) == METRICS[algo]
    for name, value in metrics.items():
        assert not value.requires_grad and torch.isfinite(value).all(), name
        assert value.shape == ((B,) if name == "priorities" else ()), name


def test_a2c_loss_equals_manual_computation():
    cfg = run_cfg("a2c", gamma=0.99, value_coef=0.5, entropy_coef=0.01)
    model, batch = make_case("a2c")
    out = model(batch["obs"])
    loss, metrics = make_loss(cfg)(out, batch)

    values = out.value.detach()
    logp = torch.log_softmax(out.params[:T].detach(), -1)
    policy_terms, value_terms, entropy_terms = [], [], []
    for b in range(B):
        ret = values[T, b].item()
        for s in reversed(range(T)):
            ret = batch["rewards"][s, b].item() + batch["discounts"][s, b].item() * ret
            advantage = ret - values[s, b].item()
            policy_terms.append(-logp[s, b, batch["actions"][s, b]].item() * advantage)
            value_terms.append(0.5 * advantage**2)
            entropy_terms.append(-(logp[s, b].exp() * logp[s, b]).sum().item())
    expected = np.mean(policy_terms) + 0.5 * np.mean(value_terms) - 0.01 * np.mean(entropy_terms)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["policy_loss"].item() == pytest.approx(np.mean(policy_terms), rel=1e-5)
    assert metrics["entropy"].item() == pytest.approx(np.mean(entropy_terms), rel=1e-5)


def test_a2c_without_a_mask_equals_a2c_with_an_all_true_mask_to_the_bit():
    """``RolloutStorage.batch()`` leaves ``valid`` out while every step is valid: the loss and its gradients must
    not change for it."""
    model, batch = make_case("a2c")
    loss_fn = make_loss(run_cfg("a2c"))
    results = []
    for masked in (False, True):
        model.zero_grad()
        case = {**batch, "valid": torch.ones_like(batch["rewards"], dtype=torch.bool)} if masked else batch
        loss, metrics = loss_fn(model(case["obs"]), case)
        loss.backward()
        results.append((loss.detach(), metrics, [p.grad.clone() for p in model.parameters()]))
    (loss, metrics, grads), (masked_loss, masked_metrics, masked_grads) = results
    assert torch.equal(loss, masked_loss) and metrics.keys() == masked_metrics.keys()
    assert all(torch.equal(metrics[k], masked_metrics[k]) for k in metrics)
    for grad, masked_grad in zip(grads, masked_grads):
        assert torch.equal(grad, masked_grad)


@pytest.mark.parametrize("algo", ["a2c", "ppo", "vtrace", "impact"])
def test_entropy_at_coefficient_zero_is_a_metric_and_the_loss_is_the_rest(algo):
    """``term_graph``: at ``entropy_coef`` 0 the entropy is reported, not backpropagated; the loss and gradients
    are those of coefficient 1 plus the entropy term's own."""
    model, batch = make_case(algo)
    grads, results = [], []
    for coef in (0.0, 1.0, None):  # None: the mean entropy alone
        model.zero_grad()
        out = model(batch["obs"])
        if coef is None:
            loss = out.time_slice(0, T).entropy().mean()
        else:
            loss, metrics = make_loss(run_cfg(algo, entropy_coef=coef))(out, batch)
            results.append((loss.detach(), metrics))
        loss.backward()
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()])
    (loss0, metrics0), (loss1, metrics1) = results
    assert torch.equal(metrics0["entropy"], metrics1["entropy"]) and metrics0["entropy"] > 0
    assert loss0.item() == pytest.approx((loss1 + metrics1["entropy"]).item(), rel=1e-6)
    for at_zero, at_one, entropy in zip(*grads):
        torch.testing.assert_close(at_zero, at_one + entropy, rtol=1e-5, atol=1e-6)


def test_ppo_on_policy_first_epoch_has_unit_ratio():
    model, batch = make_case("ppo")
    out = model(batch["obs"])
    batch["behaviour_logp"] = out.policy.log_prob(out.params[:T].detach(), batch["actions"])
    _, metrics = make_loss(run_cfg("ppo"))(out, batch)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert metrics["clip_fraction"].item() == 0.0
    assert metrics["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)


def test_ppo_handles_any_minibatch_of_env_columns():
    model, batch = make_case("ppo")
    column = {k: v[:, :1] for k, v in batch.items()}
    loss, _ = make_loss(run_cfg("ppo"))(model(column["obs"]), column)
    assert torch.isfinite(loss)


def test_ppo_with_fixed_targets_equals_ppo_with_its_own_gae_and_trains_on_scattered_steps():
    """``with_targets`` computes once what the loss would; a [1, N] batch of single steps then needs no time axis."""
    from conveyor.algos.ppo import with_targets
    from conveyor.storage.rollout import step_samples

    model, batch = make_case("ppo")
    batch["valid"] = torch.ones_like(batch["rewards"], dtype=torch.bool)
    loss_fn = make_loss(run_cfg("ppo"))
    own, own_metrics = loss_fn(model(batch["obs"]), batch)
    fixed = with_targets(batch, run_cfg("ppo").algo.gae_lambda)
    loss, metrics = loss_fn(model(fixed["obs"]), fixed)
    assert loss.item() == pytest.approx(own.item(), rel=1e-6)
    assert metrics["value_loss"].item() == pytest.approx(own_metrics["value_loss"].item(), rel=1e-6)
    # Every step once, scattered: the loss of the whole [1, T*B] sample set equals the column batch's.
    steps = step_samples(fixed, torch.randperm(T * B))
    assert steps["obs"].shape[:2] == (1, T * B) and steps["advantages"].shape == (1, T * B)
    scattered, scattered_metrics = loss_fn(model(steps["obs"]), steps)
    assert scattered.item() == pytest.approx(own.item(), rel=1e-5)
    assert scattered_metrics["approx_kl"].item() == pytest.approx(own_metrics["approx_kl"].item(), abs=1e-6)


def test_impact_ratio_kinds_and_kl_penalty():
    model, batch = make_case("impact")
    batch["target_logp"][:2] -= 2.0  # the target makes early actions unlikely: pi_worker / pi_target > rho there
    losses = {}
    for kind in ("target", "worker", "impact"):
        loss, metrics = make_loss(run_cfg("impact", impact_ratio=kind))(model(batch["obs"]), batch)
        losses[kind] = loss.item()
    assert metrics["worker_ratio_clip_fraction"].item() >= 2 / T
    assert len(set(losses.values())) == 3  # three different ratios, three different surrogates
    without_kl, _ = make_loss(run_cfg("impact"))(model(batch["obs"]), batch)
    with_kl, metrics = make_loss(run_cfg("impact", kl_coef=0.5))(model(batch["obs"]), batch)
    assert metrics["kl_target"].item() > 0
    assert with_kl.item() == pytest.approx(without_kl.item() + 0.5 * metrics["kl_target"].item(), rel=1e-5)
    del batch["target_params"]
    with pytest.raises(KeyError, match="target_params"):
        make_loss(run_cfg("impact", kl_coef=0.5))(model(batch["obs"]), batch)


def test_r2d2_loss_weights_and_priorities():
    model, batch = make_case("r2d2")
    loss_fn = make_loss(run_cfg("r2d2", n_step=2, eta=0.9))
    loss, metrics = loss_fn(model(batch["obs"]), batch)
    # halving every importance weight halves the loss; the priorities do not depend on the weights
    halved = dict(batch, weights=batch["weights"] / 2)
    half_loss, half_metrics = loss_fn(model(batch["obs"]), halved)
    assert half_loss.item() == pytest.approx(loss.item() / 2, rel=1e-5)
    torch.testing.assert_close(half_metrics["priorities"], metrics["priorities"])
    assert (metrics["priorities"] > 0).all()


def test_errors_name_the_problem():
    model, batch = make_case("a2c")
    short = model(batch["obs"][:T])  # forgot the bootstrap observation
    with pytest.raises(ValueError, match="T \\+ 1"):
        make_loss(run_cfg("a2c"))(short, batch)
    model, batch = make_case("ga3c", continuous=True)
    with pytest.raises(ValueError, match="discrete"):
        make_loss(run_cfg("ga3c"))(model(batch["obs"]), batch)
    model, batch = make_case("a2c")
    with pytest.raises(ValueError, match="dueling"):
        make_loss(run_cfg("r2d2"))(model(batch["obs"]), dict(batch, target_q=torch.zeros(T + 1, B, 3),
                                                               weights=torch.ones(B)))
    with pytest.raises(ValueError, match="unknown algo"):
        make_loss(_with_bad_algo_name())


def _with_bad_algo_name() -> RunCfg:
    cfg = run_cfg("a2c")
    object.__setattr__(cfg.algo, "name", "sarsa")  # bypass validation to reach the dispatcher's own check
    return cfg
