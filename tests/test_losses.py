"""conveyor.losses against numpy loops, hand-computed cases and autograd.gradcheck."""

from __future__ import annotations

import math
from decimal import Decimal, getcontext

import numpy as np
import pytest
import torch

from conveyor.losses import (
    categorical_actor_critic_loss, ga3c_entropy, ga3c_policy_loss, impact_ratio, masked_mean, normalize_advantages,
    policy_gradient_loss, ppo_clip_loss, r2d2_targets, sequence_priorities, value_loss,
)


def t(x, dtype=torch.float64):
    return torch.as_tensor(np.asarray(x), dtype=dtype)


def rng_tensor(seed, *shape):
    return t(np.random.default_rng(seed).normal(size=shape))


# ---------------------------------------------------------------- masks

def test_masked_mean_matches_a_loop_and_ignores_nan_in_masked_elements():
    values = rng_tensor(0, 5, 4)
    mask = torch.as_tensor(np.random.default_rng(1).random((5, 4)) < 0.6)
    expected = np.mean([values[i, j].item() for i in range(5) for j in range(4) if mask[i, j]])
    assert masked_mean(values, mask).item() == pytest.approx(expected, rel=1e-12)
    poisoned = values.masked_fill(~mask, float("nan"))
    assert masked_mean(poisoned, mask).item() == pytest.approx(expected, rel=1e-12)
    assert masked_mean(values, None).item() == pytest.approx(values.mean().item(), rel=1e-12)
    assert masked_mean(values, torch.zeros(5, 4, dtype=torch.bool)).item() == 0.0
    with pytest.raises(ValueError, match="bool"):
        masked_mean(values, mask.double())
    with pytest.raises(ValueError, match="shape"):
        masked_mean(values, mask[:4])


@pytest.mark.parametrize("term", ["policy_gradient", "value", "mean", "ppo_clip", "normalize"])
def test_masked_terms_equal_the_term_on_the_kept_elements_alone(term):
    a, b = rng_tensor(2, 6, 3), rng_tensor(3, 6, 3)
    mask = torch.as_tensor(np.random.default_rng(4).random((6, 3)) < 0.5)
    mask[0, 0] = True
    ratio = a.exp()
    masked_a, masked_b = a.masked_fill(~mask, float("nan")), b.masked_fill(~mask, float("nan"))
    masked_ratio = ratio.masked_fill(~mask, float("nan"))
    terms = {
        "policy_gradient": (lambda: policy_gradient_loss(masked_a, masked_b, mask),
                            lambda: policy_gradient_loss(a[mask], b[mask])),
        "value": (lambda: value_loss(masked_a, masked_b, mask), lambda: value_loss(a[mask], b[mask])),
        "mean": (lambda: masked_mean(masked_a, mask), lambda: a[mask].mean()),
        "ppo_clip": (lambda: ppo_clip_loss(masked_ratio, masked_b, 0.2, mask),
                     lambda: ppo_clip_loss(ratio[mask], b[mask], 0.2)),
        "normalize": (lambda: normalize_advantages(masked_b, mask=mask)[mask],
                      lambda: normalize_advantages(b[mask])),
    }
    masked, kept = terms[term]
    torch.testing.assert_close(masked(), kept(), rtol=1e-12, atol=1e-12)
    if term == "normalize":
        assert (normalize_advantages(masked_b, mask=mask)[~mask] == 0).all()


def test_masked_policy_gradient_gives_masked_elements_no_gradient():
    logp = rng_tensor(5, 4, 2).requires_grad_()
    mask = torch.tensor([[True, False], [True, True], [False, True], [True, True]])
    policy_gradient_loss(logp, rng_tensor(6, 4, 2), mask).backward()
    assert (logp.grad[~mask] == 0).all() and (logp.grad[mask] != 0).all()


# ---------------------------------------------------------------- policy gradient, value, entropy

def test_policy_gradient_loss_value_and_detached_advantages():
    logp, advantages = rng_tensor(0, 4, 3).requires_grad_(), rng_tensor(1, 4, 3).requires_grad_()
    loss = policy_gradient_loss(logp, advantages)
    expected = -np.mean([logp[i, j].item() * advantages[i, j].item() for i in range(4) for j in range(3)])
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert advantages.grad is None  # the advantage is a fixed weight, not differentiated
    torch.testing.assert_close(logp.grad, -advantages.detach() / 12)
    assert torch.autograd.gradcheck(lambda lp: policy_gradient_loss(lp, advantages.detach()),
                                    (logp.detach().requires_grad_(),))


def test_value_loss_value_and_gradient():
    values, targets = rng_tensor(2, 5, 2).requires_grad_(), rng_tensor(3, 5, 2).requires_grad_()
    loss = value_loss(values, targets)
    expected = 0.5 * np.mean([(values[i, j].item() - targets[i, j].item()) ** 2 for i in range(5) for j in range(2)])
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert targets.grad is None
    assert torch.autograd.gradcheck(lambda v: value_loss(v, targets.detach()), (values.detach().requires_grad_(),))
    # hand-computed: 0.5 * mean((1 - 3)^2, (2 - 2)^2) = 0.5 * 2 = 1
    assert value_loss(t([1.0, 2.0]), t([3.0, 2.0])).item() == 1.0


# ---------------------------------------------------------------- the categorical actor-critic loss in one op

def actor_critic_case(seed, T=5, B=3, A=4):
    """Logits and values (leaves that take gradients), int64 actions and returns ``[T, B]``, float64."""
    rng = np.random.default_rng(seed)
    logits = t(rng.normal(size=(T, B, A)) * 2).requires_grad_()
    values = t(rng.normal(size=(T, B))).requires_grad_()
    actions = torch.as_tensor(rng.integers(0, A, size=(T, B)))
    return logits, values, actions, t(rng.normal(size=(T, B)))


def actor_critic_by_terms(logits, values, actions, returns, value_coef, entropy_coef, mask=None):
    """The same loss composed of the single terms, through autograd."""
    logp = torch.log_softmax(logits, -1)
    logp_taken = logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return (policy_gradient_loss(logp_taken, returns - values, mask) + value_coef * value_loss(values, returns, mask)
            - entropy_coef * masked_mean(entropy, mask))


@pytest.mark.parametrize("value_coef,entropy_coef", [(0.5, 0.01), (0.25, 0.0), (1.0, 0.3)])
def test_categorical_actor_critic_loss_matches_a_loop_and_the_terms_gradients(value_coef, entropy_coef):
    logits, values, actions, returns = actor_critic_case(0)
    loss, terms = categorical_actor_critic_loss(logits, values, actions, returns, value_coef, entropy_coef)
    policy, value, entropy, advantage = [], [], [], []
    for i in range(5):
        for j in range(3):
            row = logits[i, j].detach().numpy()
            logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
            a = returns[i, j].item() - values[i, j].item()
            policy.append(-logp[actions[i, j]] * a)
            value.append(0.5 * a * a)
            entropy.append(-(np.exp(logp) * logp).sum())
            advantage.append(a)
    expected = [np.mean(policy), np.mean(value), np.mean(entropy), np.mean(advantage)]
    np.testing.assert_allclose(terms.numpy(), expected, rtol=1e-12)
    assert loss.item() == pytest.approx(expected[0] + value_coef * expected[1] - entropy_coef * expected[2],
                                        rel=1e-12)
    assert not terms.requires_grad
    grads = torch.autograd.grad(loss, (logits, values))
    by_terms = torch.autograd.grad(actor_critic_by_terms(logits, values, actions, returns, value_coef, entropy_coef),
                                   (logits, values))
    for grad, expected_grad in zip(grads, by_terms):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)
    # by finite differences in the logits (in the values the policy term's advantage is a constant, as in
    # ``policy_gradient_loss``: the comparison above holds that gradient)
    assert torch.autograd.gradcheck(
        lambda lg: categorical_actor_critic_loss(lg, values.detach(), actions, returns, value_coef, entropy_coef)[0],
        (logits.detach().requires_grad_(),))


def test_categorical_actor_critic_loss_scales_its_gradient_by_the_incoming_one_and_detaches_the_returns():
    logits, values, actions, returns = actor_critic_case(1)
    returns.requires_grad_()
    loss, _ = categorical_actor_critic_loss(logits, values, actions, returns, 0.5, 0.01)
    (3.0 * loss).backward()
    assert returns.grad is None  # the returns are targets
    once = torch.autograd.grad(categorical_actor_critic_loss(logits, values, actions, returns, 0.5, 0.01)[0],
                               (logits, values))
    torch.testing.assert_close(logits.grad, 3.0 * once[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(values.grad, 3.0 * once[1], rtol=1e-12, atol=0)


def test_masked_categorical_actor_critic_loss_is_the_loss_of_the_kept_elements_alone():
    """NaN in a masked element (logits, value, return) reaches neither the loss nor any gradient; the kept
    elements get the gradients of the loss on them alone."""
    logits, values, actions, returns = actor_critic_case(2, T=6, B=4)
    mask = torch.as_tensor(np.random.default_rng(3).random((6, 4)) < 0.5)
    mask[0, 0] = True
    poisoned_logits = logits.detach().masked_fill(~mask.unsqueeze(-1), float("nan")).requires_grad_()
    poisoned_values = values.detach().masked_fill(~mask, float("nan")).requires_grad_()
    loss, terms = categorical_actor_critic_loss(poisoned_logits, poisoned_values, actions,
                                                returns.masked_fill(~mask, float("nan")), 0.5, 0.1, mask)
    kept_loss, kept_terms = categorical_actor_critic_loss(logits[mask].unsqueeze(1), values[mask].unsqueeze(1),
                                                          actions[mask].unsqueeze(1), returns[mask].unsqueeze(1),
                                                          0.5, 0.1)
    torch.testing.assert_close(terms, kept_terms, rtol=1e-12, atol=1e-15)
    loss.backward()
    kept_loss.backward()
    assert (poisoned_logits.grad[~mask] == 0).all() and (poisoned_values.grad[~mask] == 0).all()
    torch.testing.assert_close(poisoned_logits.grad[mask], logits.grad[mask], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(poisoned_values.grad[mask], values.grad[mask], rtol=1e-12, atol=1e-15)
    assert torch.autograd.gradcheck(
        lambda lg: categorical_actor_critic_loss(lg, values.detach(), actions, returns, 0.5, 0.1, mask)[0],
        (logits.detach().requires_grad_(),))
    nothing = torch.zeros(6, 4, dtype=torch.bool)
    lg, v = logits.detach().requires_grad_(), values.detach().requires_grad_()
    loss, terms = categorical_actor_critic_loss(lg, v, actions, returns, 0.5, 0.1, nothing)
    loss.backward()
    assert loss.item() == 0.0 and (terms == 0).all() and (lg.grad == 0).all() and (v.grad == 0).all()


def test_categorical_actor_critic_loss_with_an_all_true_mask_equals_no_mask_to_the_bit():
    logits, values, actions, returns = actor_critic_case(4, T=5, B=16, A=2)
    logits, values, returns = (x.detach().float().requires_grad_(x.requires_grad) for x in (logits, values, returns))
    results = []
    for mask in (None, torch.ones(5, 16, dtype=torch.bool)):
        loss, terms = categorical_actor_critic_loss(logits, values, actions, returns, 0.5, 0.01, mask)
        results.append((loss, terms, *torch.autograd.grad(loss, (logits, values))))
    for unmasked, masked in zip(*results):
        assert unmasked.dtype == torch.float32 and torch.equal(unmasked, masked)


def test_categorical_actor_critic_loss_refuses_wrong_shapes_and_dtypes():
    logits, values, actions, returns = actor_critic_case(5)
    for call in (lambda: categorical_actor_critic_loss(logits, values[:4], actions, returns, 0.5, 0.0),
                 lambda: categorical_actor_critic_loss(logits[:, :2], values, actions, returns, 0.5, 0.0),
                 lambda: categorical_actor_critic_loss(logits, values, actions, returns[:, :2], 0.5, 0.0),
                 lambda: categorical_actor_critic_loss(logits, values, actions, returns, 0.5, 0.0, returns[:4] > 0)):
        with pytest.raises(ValueError, match="shape"):
            call()
    with pytest.raises(ValueError, match="integers"):
        categorical_actor_critic_loss(logits, values, actions.double(), returns, 0.5, 0.0)
    with pytest.raises(ValueError, match="bool"):
        categorical_actor_critic_loss(logits, values, actions, returns, 0.5, 0.0, returns)


def test_value_loss_in_standardized_units_against_a_loop():
    values, targets = rng_tensor(4, 5, 2).requires_grad_(), rng_tensor(5, 5, 2) * 4 + 1
    targets[0, 0] = 40.0  # 9 std above the mean: clipped to 5
    mean, std = 1.5, 2.0
    loss = value_loss(values, targets, moments=t([mean, std]))
    expected = 0.5 * np.mean([((values[i, j].item() - mean) / std - np.clip((targets[i, j].item() - mean) / std, -5, 5))
                              ** 2 for i in range(5) for j in range(2)])
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # hand-computed: values 3.5 and 1.5 against targets 5.5 and 1.5, mean 1.5, std 2: 0.5 * mean((1 - 2)^2, 0) = 0.25
    assert value_loss(t([3.5, 1.5]), t([5.5, 1.5]), moments=t([1.5, 2.0])).item() == 0.25
    assert torch.autograd.gradcheck(lambda v: value_loss(v, targets, moments=t([mean, std])),
                                    (values.detach().requires_grad_(),))


def test_normalize_advantages():
    advantages = rng_tensor(5, 6, 4) * 3 + 2
    normalized = normalize_advantages(advantages)
    assert normalized.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert normalized.std(correction=0).item() == pytest.approx(1.0, rel=1e-6)
    assert normalize_advantages(t([[7.0]])).item() == 0.0  # one element: finite, not NaN


# ---------------------------------------------------------------- PPO clip

def ref_ppo_clip(ratio, advantages, clip):
    terms = []
    for r, a in zip(ratio.ravel(), advantages.ravel()):
        clipped = min(max(r, 1 - clip), 1 + clip)
        terms.append(min(r * a, clipped * a))
    return -np.mean(terms)


def test_ppo_clip_matches_reference_over_extreme_ratios():
    rng = np.random.default_rng(6)
    ratio = np.exp(rng.uniform(math.log(1e-4), math.log(1e4), size=(8, 5)))
    advantages = rng.normal(size=(8, 5))
    assert ppo_clip_loss(t(ratio), t(advantages), 0.2).item() == pytest.approx(ref_ppo_clip(ratio, advantages, 0.2),
                                                                                rel=1e-12)


def test_ppo_clip_hand_computed():
    # clip 0.2:  r=1.5, A=1  -> min(1.5, 1.2) = 1.2   (gain capped above 1 + e for A > 0)
    #            r=0.5, A=1  -> min(0.5, 0.8) = 0.5   (a loss is never capped)
    #            r=0.5, A=-1 -> min(-0.5, -0.8) = -0.8 (capped below 1 - e for A < 0)
    #            r=1.5, A=-1 -> min(-1.5, -1.2) = -1.5
    # loss = -(1.2 + 0.5 - 0.8 - 1.5) / 4 = 0.15
    loss = ppo_clip_loss(t([1.5, 0.5, 0.5, 1.5]), t([1.0, 1.0, -1.0, -1.0]), 0.2)
    assert loss.item() == pytest.approx(0.15, rel=1e-12)


def test_ppo_clip_gradcheck_and_zero_gradient_when_clipped():
    ratio = t([[0.5, 0.95, 1.05], [1.5, 0.7, 1.3]]).requires_grad_()
    advantages = t([[1.0, -2.0, 0.5], [1.0, -1.0, -3.0]])
    assert torch.autograd.gradcheck(lambda r: ppo_clip_loss(r, advantages, 0.2), (ratio,))
    ppo_clip_loss(ratio, advantages, 0.2).backward()
    # r=1.5 with A>0 and r=0.7 with A<0 are clipped: no gradient there
    assert ratio.grad[1, 0] == 0 and ratio.grad[1, 1] == 0
    assert ratio.grad[0, 0] != 0 and ratio.grad[1, 2] != 0


# ---------------------------------------------------------------- IMPACT ratio

def test_impact_ratio_matches_reference():
    rng = np.random.default_rng(7)
    learner, target, worker = (-rng.random((6, 4)) * 8 for _ in range(3))
    rho = 2.0
    out = impact_ratio(t(learner), t(target), t(worker), rho).numpy()
    for i in range(6):
        for j in range(4):
            pi_l, pi_t, pi_w = math.exp(learner[i, j]), math.exp(target[i, j]), math.exp(worker[i, j])
            assert out[i, j] == pytest.approx(pi_l / max(pi_t, pi_w / rho), rel=1e-12)
            # the paper's other form: min(pi_w / pi_t, rho) * pi_l / pi_w
            assert out[i, j] == pytest.approx(min(pi_w / pi_t, rho) * pi_l / pi_w, rel=1e-12)


def test_impact_ratio_hand_computed():
    # rho 2: pi_l 0.5, pi_t 0.25, pi_w 0.8 -> 0.5 / max(0.25, 0.4) = 1.25   (worker term wins)
    #        pi_l 0.5, pi_t 0.25, pi_w 0.2 -> 0.5 / max(0.25, 0.1) = 2.0    (target term wins)
    out = impact_ratio(torch.log(t([0.5, 0.5])), torch.log(t([0.25, 0.25])), torch.log(t([0.8, 0.2])), 2.0)
    np.testing.assert_allclose(out.numpy(), [1.25, 2.0], rtol=1e-12)


def test_impact_ratio_is_finite_where_probabilities_underflow():
    # float32 exp(-200) is 0, so pi_l / max(pi_t, pi_w / rho) computed on probabilities is 0 / 0.
    learner, target, worker = [-200.0, -150.0], [-201.0, -300.0], [-199.0, -100.0]
    out = impact_ratio(t(learner, torch.float32), t(target, torch.float32), t(worker, torch.float32), 2.0)
    assert out.dtype == torch.float32
    getcontext().prec = 50
    for k in range(2):
        pi_l, pi_t, pi_w = (Decimal(x[k]).exp() for x in (learner, target, worker))
        assert out[k].item() == pytest.approx(float(pi_l / max(pi_t, pi_w / Decimal(2))), rel=1e-5)


def test_impact_ratio_gradient_reaches_learner_only():
    learner = rng_tensor(8, 3, 2).requires_grad_()
    target, worker = rng_tensor(9, 3, 2).requires_grad_(), rng_tensor(10, 3, 2).requires_grad_()
    impact_ratio(learner, target, worker, 2.0).sum().backward()
    assert target.grad is None and worker.grad is None
    assert torch.autograd.gradcheck(lambda lp: impact_ratio(lp, target.detach(), worker.detach(), 2.0),
                                    (learner.detach().requires_grad_(),))


# ---------------------------------------------------------------- GA3C

def random_probs(seed, *shape):
    logits = rng_tensor(seed, *shape)
    return torch.softmax(logits, -1)


def test_ga3c_policy_loss_matches_reference():
    probs, eps = random_probs(11, 4, 3, 5), 1e-6
    actions = torch.as_tensor(np.random.default_rng(12).integers(0, 5, size=(4, 3)))
    advantages = rng_tensor(13, 4, 3)
    expected = -np.mean([math.log(probs[i, j, actions[i, j]].item() + eps) * advantages[i, j].item()
                         for i in range(4) for j in range(3)])
    assert ga3c_policy_loss(probs, actions, advantages, eps).item() == pytest.approx(expected, rel=1e-12)


def test_ga3c_policy_loss_finite_at_zero_probability_and_gradcheck():
    # hand-computed: pi(a) = 0, eps 1e-3, A = 2 -> -log(1e-3) * 2 = 13.8155...
    loss = ga3c_policy_loss(t([[[1.0, 0.0]]]), torch.tensor([[1]]), t([[2.0]]), 1e-3)
    assert loss.item() == pytest.approx(-math.log(1e-3) * 2, rel=1e-12)
    probs = random_probs(14, 3, 2, 4).requires_grad_()
    actions = torch.tensor([[0, 3], [2, 2], [1, 0]])
    advantages = rng_tensor(15, 3, 2)
    assert torch.autograd.gradcheck(lambda p: ga3c_policy_loss(p, actions, advantages, 1e-2), (probs,))


def test_ga3c_entropy_matches_reference_and_gradcheck():
    probs, eps = random_probs(16, 3, 2, 4), 1e-6
    out = ga3c_entropy(probs, eps)
    assert out.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            expected = -sum(p * math.log(p + eps) for p in probs[i, j].tolist())
            assert out[i, j].item() == pytest.approx(expected, rel=1e-12)
    # hand-computed: one-hot -> -(1 * log(1 + eps) + 0 * log(eps)) = -log(1 + eps), finite
    assert ga3c_entropy(t([1.0, 0.0]), 1e-3).item() == pytest.approx(-math.log(1.001), rel=1e-12)
    assert torch.autograd.gradcheck(lambda p: ga3c_entropy(p, 1e-3), (probs.clone().requires_grad_(),))


# ---------------------------------------------------------------- R2D2

def h(x, eps):
    return math.copysign(math.sqrt(abs(x) + 1) - 1, x) + eps * x


def h_inverse(y, eps):
    if eps == 0:
        return math.copysign((abs(y) + 1) ** 2 - 1, y)
    return math.copysign(((math.sqrt(1 + 4 * eps * (abs(y) + 1 + eps)) - 1) / (2 * eps)) ** 2 - 1, y)


def ref_r2d2_targets(rewards, discounts, online_q, target_q, n, eps):
    T, B = rewards.shape
    out = np.zeros((T, B))
    for b in range(B):
        for s in range(T):
            m = min(n, T - s)
            total, scale = 0.0, 1.0
            for k in range(m):
                total += scale * rewards[s + k, b]
                scale *= discounts[s + k, b]
            greedy = int(np.argmax(online_q[s + m, b]))
            total += scale * h_inverse(target_q[s + m, b, greedy], eps)
            out[s, b] = h(total, eps)
    return out


@pytest.mark.parametrize("n", [1, 3, 5, 12])
def test_r2d2_targets_match_reference(n):
    rng = np.random.default_rng(n)
    T, B, A = 8, 4, 3
    rewards = rng.normal(size=(T, B)) * 3
    discounts = np.full((T, B), 0.97)
    discounts[rng.random((T, B)) < 0.2] = 0.0  # episode ends mid-sequence
    online_q, target_q = rng.normal(size=(T + 1, B, A)) * 5, rng.normal(size=(T + 1, B, A)) * 5
    out = r2d2_targets(t(rewards), t(discounts), t(online_q), t(target_q), n=n, eps=1e-3)
    np.testing.assert_allclose(out.numpy(), ref_r2d2_targets(rewards, discounts, online_q, target_q, n, 1e-3),
                               rtol=1e-9, atol=1e-9)


def test_r2d2_targets_hand_computed():
    # eps 0 (h(x) = sign(x)(sqrt(|x|+1) - 1), h^-1(y) = sign(y)((|y|+1)^2 - 1)), n 2, gamma 0.5, T 2.
    # Double Q: online argmax at s_2 is action 1, whose target value is 2 (the target's own max, 100, is ignored):
    # bootstrap h^-1(2) = 3^2 - 1 = 8.
    # t=1 (one step left): G = 4 + 0.5 * 8 = 8                -> h(8) = 3 - 1 = 2
    # t=0 (two steps):      G = -1 + 0.5 * 4 + 0.25 * 8 = 3    -> h(3) = 2 - 1 = 1
    online_q = t([[[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 5.0]]])
    target_q = t([[[0.0, 0.0]], [[0.0, 0.0]], [[100.0, 2.0]]])
    out = r2d2_targets(t([[-1.0], [4.0]]), t([[0.5], [0.5]]), online_q, target_q, n=2, eps=0.0)
    np.testing.assert_allclose(out.numpy().ravel(), [1.0, 2.0], rtol=1e-12)
    # a terminal at t=0 stops the sum and the bootstrap: G_0 = -1 -> h(-1) = -(sqrt(2) - 1)
    out = r2d2_targets(t([[-1.0], [4.0]]), t([[0.0], [0.5]]), online_q, target_q, n=2, eps=0.0)
    np.testing.assert_allclose(out.numpy().ravel(), [1 - math.sqrt(2), 2.0], rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_r2d2_targets_dtype_and_detached(dtype):
    online_q = torch.randn(4, 2, 3, dtype=dtype, requires_grad=True)
    out = r2d2_targets(torch.ones(3, 2, dtype=dtype), torch.full((3, 2), 0.9, dtype=dtype), online_q,
                       torch.randn(4, 2, 3, dtype=dtype), n=2)
    assert out.dtype == dtype and out.shape == (3, 2) and not out.requires_grad


def test_sequence_priorities():
    td = rng_tensor(17, 6, 3)
    out = sequence_priorities(td, 0.9)
    for b in range(3):
        column = [abs(x) for x in td[:, b].tolist()]
        assert out[b].item() == pytest.approx(0.9 * max(column) + 0.1 * sum(column) / 6, rel=1e-12)
    # hand-computed: |delta| = [1, 3] -> 0.9 * 3 + 0.1 * 2 = 2.9
    assert sequence_priorities(t([[1.0], [-3.0]]), 0.9).item() == pytest.approx(2.9)


# ---------------------------------------------------------------- dtypes and shape errors

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_dtypes_are_preserved(dtype):
    x = torch.rand(3, 2, dtype=dtype) + 0.5
    probs = torch.softmax(torch.randn(3, 2, 4, dtype=dtype), -1)
    actions = torch.zeros(3, 2, dtype=torch.long)
    for value in (policy_gradient_loss(x, x), value_loss(x, x), masked_mean(x), ppo_clip_loss(x, x, 0.2),
                  impact_ratio(x, x, x, 2.0), ga3c_policy_loss(probs, actions, x, 1e-6), ga3c_entropy(probs, 1e-6),
                  normalize_advantages(x), sequence_priorities(x, 0.9)):
        assert value.dtype == dtype


def test_loss_shape_errors():
    a, b = torch.zeros(4, 3), torch.zeros(3, 4)
    for call in (lambda: policy_gradient_loss(a, b), lambda: value_loss(a, b), lambda: ppo_clip_loss(a, b, 0.2),
                 lambda: impact_ratio(a, a, b, 2.0),
                 lambda: ga3c_policy_loss(torch.zeros(4, 3, 2), torch.zeros(4, 2, dtype=torch.long), a, 1e-6),
                 lambda: r2d2_targets(a, a, torch.zeros(4, 3, 2), torch.zeros(5, 3, 2), n=2),
                 lambda: r2d2_targets(a, a, torch.zeros(5, 3, 2), torch.zeros(5, 3, 3), n=2),
                 lambda: sequence_priorities(torch.zeros(4), 0.9)):
        with pytest.raises(ValueError, match="shape"):
            call()
    with pytest.raises(ValueError, match="n must be"):
        r2d2_targets(a, a, torch.zeros(5, 3, 2), torch.zeros(5, 3, 2), n=0)
