"""conveyor.returns against slow numpy loops, hand-computed cases and episode-boundary invariances."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conveyor.returns import VTraceReturns, gae, nstep_returns, value_rescale, value_rescale_inverse, vtrace

GAMMA = 0.9


# ---------------------------------------------------------------- numpy references (one element at a time)

def ref_nstep(rewards, discounts, bootstrap):
    T, B = rewards.shape
    out = np.zeros((T, B))
    for b in range(B):
        for t in range(T):
            # G_t = sum_k (d_t ... d_{t+k-1}) r_{t+k} + (d_t ... d_{T-1}) V_T
            total, scale = 0.0, 1.0
            for k in range(t, T):
                total += scale * rewards[k, b]
                scale *= discounts[k, b]
            out[t, b] = total + scale * bootstrap[b]
    return out


def ref_gae(rewards, discounts, values, bootstrap, lam):
    T, B = rewards.shape
    out = np.zeros((T, B))
    for b in range(B):
        v = list(values[:, b]) + [bootstrap[b]]
        for t in range(T):
            # A_t = sum_k (prod_{j<k} d_{t+j} lam) delta_{t+k}
            total, scale = 0.0, 1.0
            for k in range(t, T):
                delta = rewards[k, b] + discounts[k, b] * v[k + 1] - v[k]
                total += scale * delta
                scale *= discounts[k, b] * lam
            out[t, b] = total
    return out


def ref_vtrace(behaviour_logp, target_logp, rewards, discounts, values, bootstrap, lam, clip_rho, clip_c, clip_pg_rho):
    """IMPALA eq. 1 as a sum: vs_s = V_s + sum_t (prod_{i<t} d_i c_i) rho_t delta_t."""
    T, B = rewards.shape
    vs = np.zeros((T, B))
    pg = np.zeros((T, B))
    for b in range(B):
        v = list(values[:, b]) + [bootstrap[b]]
        rho = [math.exp(target_logp[t, b] - behaviour_logp[t, b]) for t in range(T)]
        for s in range(T):
            total, scale = 0.0, 1.0
            for t in range(s, T):
                delta = min(clip_rho, rho[t]) * (rewards[t, b] + discounts[t, b] * v[t + 1] - v[t])
                total += scale * delta
                scale *= discounts[t, b] * lam * min(clip_c, rho[t])
            vs[s, b] = v[s] + total
        for s in range(T):
            next_vs = vs[s + 1, b] if s + 1 < T else bootstrap[b]
            pg[s, b] = min(clip_pg_rho, rho[s]) * (rewards[s, b] + discounts[s, b] * next_vs - v[s])
    return vs, pg


def random_rollout(rng, T=7, B=5):
    """Rewards, discounts with terminals and a truncation (discount 0, folded reward), values, log-probs."""
    rewards = rng.normal(size=(T, B))
    discounts = np.full((T, B), GAMMA)
    discounts[rng.random((T, B)) < 0.2] = 0.0  # terminals
    discounts[2, 0] = 0.0  # a truncation: gamma * V(final_obs) folded into the reward
    rewards[2, 0] += GAMMA * 3.7
    values = rng.normal(size=(T, B))
    bootstrap = rng.normal(size=B)
    # log importance ratios spread uniformly over [log 1e-4, log 1e4]
    behaviour_logp = -rng.random((T, B)) * 3
    target_logp = behaviour_logp + rng.uniform(math.log(1e-4), math.log(1e4), size=(T, B))
    return rewards, discounts, values, bootstrap, behaviour_logp, target_logp


def t(x, dtype=torch.float64):
    return torch.as_tensor(np.asarray(x), dtype=dtype)


# ---------------------------------------------------------------- nstep_returns

@pytest.mark.parametrize("seed", range(3))
def test_nstep_matches_reference(seed):
    rewards, discounts, values, bootstrap, _, _ = random_rollout(np.random.default_rng(seed))
    out = nstep_returns(t(rewards), t(discounts), t(bootstrap))
    np.testing.assert_allclose(out.numpy(), ref_nstep(rewards, discounts, bootstrap), rtol=1e-12, atol=1e-12)


def test_nstep_hand_computed():
    # gamma 0.5, one env, terminal at t=1, bootstrap V(s_3) = 10:
    # G_2 = 3 + 0.5 * 10 = 8; G_1 = 2 + 0 * 8 = 2; G_0 = 1 + 0.5 * 2 = 2
    out = nstep_returns(t([[1.0], [2.0], [3.0]]), t([[0.5], [0.0], [0.5]]), t([10.0]))
    np.testing.assert_allclose(out.numpy().ravel(), [2.0, 2.0, 8.0])


def test_nstep_split_at_terminal_equals_halves():
    rng = np.random.default_rng(10)
    rewards, discounts, _, bootstrap, _, _ = random_rollout(rng)
    discounts[3] = 0.0  # every env terminates at step 3
    full = nstep_returns(t(rewards), t(discounts), t(bootstrap))
    # the first half's bootstrap is cut off by the zero discount: any value gives the same result
    first = nstep_returns(t(rewards[:4]), t(discounts[:4]), t(rng.normal(size=5) * 100))
    second = nstep_returns(t(rewards[4:]), t(discounts[4:]), t(bootstrap))
    torch.testing.assert_close(full, torch.cat([first, second]))


def test_nstep_truncation_equals_bootstrap_from_final_obs():
    # A step truncated with gamma * V(final) folded in and discount 0 equals a rollout that ends there
    # and bootstraps from V(final) with discount gamma.
    rewards, final_value = t([[1.0], [2.0]]), 5.0
    folded = nstep_returns(rewards + t([[0.0], [GAMMA * final_value]]), t([[GAMMA], [0.0]]), t([123.0]))
    ended = nstep_returns(rewards, t([[GAMMA], [GAMMA]]), t([final_value]))
    torch.testing.assert_close(folded, ended)


# ---------------------------------------------------------------- gae

@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(2))
def test_gae_matches_reference(lam, seed):
    rewards, discounts, values, bootstrap, _, _ = random_rollout(np.random.default_rng(seed))
    out = gae(t(rewards), t(discounts), t(values), t(bootstrap), lam)
    np.testing.assert_allclose(out.numpy(), ref_gae(rewards, discounts, values, bootstrap, lam), rtol=1e-12, atol=1e-12)


def test_gae_lambda_one_is_nstep_minus_values():
    rewards, discounts, values, bootstrap, _, _ = random_rollout(np.random.default_rng(4))
    advantages = gae(t(rewards), t(discounts), t(values), t(bootstrap), 1.0)
    torch.testing.assert_close(advantages, nstep_returns(t(rewards), t(discounts), t(bootstrap)) - t(values))


def test_gae_hand_computed():
    # gamma 0.5, lam 0.5, V = [1, 2], V(s_2) = 4, rewards [1, 1], no terminal:
    # delta_1 = 1 + 0.5 * 4 - 2 = 1;  delta_0 = 1 + 0.5 * 2 - 1 = 1
    # A_1 = 1;  A_0 = 1 + 0.5 * 0.5 * 1 = 1.25
    out = gae(t([[1.0], [1.0]]), t([[0.5], [0.5]]), t([[1.0], [2.0]]), t([4.0]), 0.5)
    np.testing.assert_allclose(out.numpy().ravel(), [1.25, 1.0])


def test_gae_split_at_terminal_equals_halves():
    rewards, discounts, values, bootstrap, _, _ = random_rollout(np.random.default_rng(11))
    discounts[3] = 0.0
    full = gae(t(rewards), t(discounts), t(values), t(bootstrap), 0.7)
    first = gae(t(rewards[:4]), t(discounts[:4]), t(values[:4]), t(values[4]), 0.7)
    second = gae(t(rewards[4:]), t(discounts[4:]), t(values[4:]), t(bootstrap), 0.7)
    torch.testing.assert_close(full, torch.cat([first, second]))


def test_gae_gradient_flows_through_values():
    rewards, discounts, values, bootstrap, _, _ = random_rollout(np.random.default_rng(5), T=3, B=2)
    values_t = t(values).requires_grad_()
    bootstrap_t = t(bootstrap).requires_grad_()
    assert torch.autograd.gradcheck(lambda v, b: gae(t(rewards), t(discounts), v, b, 0.5), (values_t, bootstrap_t))
    assert torch.autograd.gradcheck(lambda r, b: nstep_returns(r, t(discounts), b),
                                    (t(rewards).requires_grad_(), bootstrap_t))


# ---------------------------------------------------------------- vtrace

@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("clips", [(1.0, 1.0, 1.0), (2.0, 0.5, 1.5), (1e9, 1e9, 1e9)])
def test_vtrace_matches_reference(lam, clips):
    rewards, discounts, values, bootstrap, behaviour_logp, target_logp = random_rollout(np.random.default_rng(7))
    clip_rho, clip_c, clip_pg_rho = clips
    out = vtrace(t(behaviour_logp), t(target_logp), t(rewards), t(discounts), t(values), t(bootstrap),
                 lam=lam, clip_rho=clip_rho, clip_c=clip_c, clip_pg_rho=clip_pg_rho)
    vs, pg = ref_vtrace(behaviour_logp, target_logp, rewards, discounts, values, bootstrap, lam, *clips)
    assert isinstance(out, VTraceReturns)
    # unclipped ratios reach 1e4 and their products more, so compare relative to the magnitude
    np.testing.assert_allclose(out.vs.numpy(), vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out.pg_advantages.numpy(), pg, rtol=1e-10, atol=1e-10)


def test_vtrace_on_policy_is_nstep_and_gae():
    # rho = 1 everywhere: vs = n-step returns (lam 1), pg_advantages = r + d vs' - V
    rewards, discounts, values, bootstrap, behaviour_logp, _ = random_rollout(np.random.default_rng(8))
    out = vtrace(t(behaviour_logp), t(behaviour_logp), t(rewards), t(discounts), t(values), t(bootstrap))
    torch.testing.assert_close(out.vs, nstep_returns(t(rewards), t(discounts), t(bootstrap)))
    # with lam < 1 on-policy, vs - V is GAE(lam)
    out = vtrace(t(behaviour_logp), t(behaviour_logp), t(rewards), t(discounts), t(values), t(bootstrap), lam=0.5)
    torch.testing.assert_close(out.vs - t(values), gae(t(rewards), t(discounts), t(values), t(bootstrap), 0.5))


def test_vtrace_hand_computed():
    # T=2, one env, gamma 0.5 no terminal; V = [0, 0], V(s_2) = 2, rewards [1, 1];
    # rho = [4, 0.25] (log-ratios log 4, log 0.25); clip_rho = clip_c = clip_pg_rho = 1, lam 1
    # clipped rho = [1, 0.25]; c = [1, 0.25]
    # delta_1 = 0.25 * (1 + 0.5 * 2 - 0) = 0.5  -> vs_1 = 0.5
    # delta_0 = 1 * (1 + 0.5 * 0 - 0) = 1       -> vs_0 = 1 + 0.5 * 1 * (vs_1 - V_1) = 1.25
    # pg_0 = 1 * (1 + 0.5 * vs_1 - 0) = 1.25;  pg_1 = 0.25 * (1 + 0.5 * 2 - 0) = 0.5
    out = vtrace(t([[0.0], [0.0]]), t([[math.log(4)], [math.log(0.25)]]), t([[1.0], [1.0]]), t([[0.5], [0.5]]),
                 t([[0.0], [0.0]]), t([2.0]))
    np.testing.assert_allclose(out.vs.numpy().ravel(), [1.25, 0.5])
    np.testing.assert_allclose(out.pg_advantages.numpy().ravel(), [1.25, 0.5])


def test_vtrace_split_at_terminal_equals_halves():
    rewards, discounts, values, bootstrap, behaviour_logp, target_logp = random_rollout(np.random.default_rng(12))
    discounts[3] = 0.0
    kwargs = dict(lam=0.8, clip_rho=2.0, clip_c=1.0, clip_pg_rho=1.5)
    full = vtrace(t(behaviour_logp), t(target_logp), t(rewards), t(discounts), t(values), t(bootstrap), **kwargs)
    first = vtrace(t(behaviour_logp[:4]), t(target_logp[:4]), t(rewards[:4]), t(discounts[:4]), t(values[:4]),
                   t(values[4]), **kwargs)
    second = vtrace(t(behaviour_logp[4:]), t(target_logp[4:]), t(rewards[4:]), t(discounts[4:]), t(values[4:]),
                    t(bootstrap), **kwargs)
    torch.testing.assert_close(full.vs, torch.cat([first.vs, second.vs]))
    torch.testing.assert_close(full.pg_advantages, torch.cat([first.pg_advantages, second.pg_advantages]))


def test_vtrace_truncation_equals_bootstrap_from_final_obs():
    logps, values, final_value = t([[0.3], [-0.2]]), t([[0.5], [1.5]]), 4.0
    folded = vtrace(logps, logps * 2, t([[1.0], [2.0 + GAMMA * final_value]]), t([[GAMMA], [0.0]]), values,
                    t([-50.0]))
    ended = vtrace(logps, logps * 2, t([[1.0], [2.0]]), t([[GAMMA], [GAMMA]]), values, t([final_value]))
    torch.testing.assert_close(folded.vs, ended.vs)
    torch.testing.assert_close(folded.pg_advantages, ended.pg_advantages)


def test_vtrace_outputs_are_detached_and_finite_for_extreme_ratios():
    values = torch.zeros(3, 2, requires_grad=True)
    behaviour = torch.tensor([[0.0, -300.0], [-300.0, 0.0], [0.0, 0.0]])  # ratios e^300 and e^-300 overflow
    out = vtrace(behaviour, torch.zeros(3, 2), torch.ones(3, 2), torch.full((3, 2), GAMMA), values, torch.zeros(2))
    assert not out.vs.requires_grad and not out.pg_advantages.requires_grad
    assert torch.isfinite(out.vs).all() and torch.isfinite(out.pg_advantages).all()


# ---------------------------------------------------------------- dtypes, devices, shapes

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtypes_are_preserved(dtype):
    rewards, discounts, values, bootstrap, behaviour_logp, target_logp = random_rollout(np.random.default_rng(9))
    r, d, v, b = (t(x, dtype) for x in (rewards, discounts, values, bootstrap))
    assert nstep_returns(r, d, b).dtype == dtype
    assert gae(r, d, v, b, 0.9).dtype == dtype
    out = vtrace(t(behaviour_logp, dtype), t(target_logp, dtype), r, d, v, b)
    assert out.vs.dtype == dtype and out.pg_advantages.dtype == dtype
    assert value_rescale(v).dtype == dtype and value_rescale_inverse(v).dtype == dtype
    if dtype == torch.float32:  # float32 results agree with the float64 reference to float32 precision
        np.testing.assert_allclose(gae(r, d, v, b, 0.9).numpy(), ref_gae(rewards, discounts, values, bootstrap, 0.9),
                                   rtol=1e-4, atol=1e-5)


def test_extra_trailing_dims_broadcast():
    rng = np.random.default_rng(13)
    rewards, discounts = t(rng.normal(size=(4, 2, 3))), t(np.full((4, 2, 3), GAMMA))
    bootstrap = t(rng.normal(size=(2, 3)))
    flat = nstep_returns(rewards.reshape(4, 6), discounts.reshape(4, 6), bootstrap.reshape(6))
    torch.testing.assert_close(nstep_returns(rewards, discounts, bootstrap).reshape(4, 6), flat)


def test_shape_and_dtype_errors():
    r, d, v, b = torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(3)
    with pytest.raises(ValueError, match="discounts"):
        nstep_returns(r, torch.zeros(4, 2), b)
    with pytest.raises(ValueError, match="bootstrap_value"):
        nstep_returns(r, d, torch.zeros(4))
    with pytest.raises(ValueError, match="T >= 1"):
        nstep_returns(torch.zeros(0, 3), torch.zeros(0, 3), b)
    with pytest.raises(ValueError, match="values"):
        gae(r, d, torch.zeros(5, 3), b, 0.9)
    with pytest.raises(ValueError, match="lam"):
        gae(r, d, v, b, 1.5)
    with pytest.raises(ValueError, match="target_logp"):
        vtrace(r, torch.zeros(3, 4), r, d, v, b)
    with pytest.raises(ValueError, match="dtype"):
        vtrace(r, r, r.double(), d, v, b)
    with pytest.raises(ValueError, match="clip_c"):
        vtrace(r, r, r, d, v, b, clip_c=0.0)


# ---------------------------------------------------------------- value rescaling

def test_value_rescale_matches_formula():
    x = np.concatenate([-np.logspace(-3, 6, 50), [0.0], np.logspace(-3, 6, 50)])
    expected = np.sign(x) * (np.sqrt(np.abs(x) + 1) - 1) + 1e-3 * x
    np.testing.assert_allclose(value_rescale(t(x)).numpy(), expected, rtol=1e-12, atol=1e-15)
    # hand-computed: h(3) = sqrt(4) - 1 + 0.003 = 1.003; h(-8) = -(3 - 1) - 0.008 = -2.008
    np.testing.assert_allclose(value_rescale(t([3.0, -8.0])).numpy(), [1.003, -2.008], rtol=1e-15)


@pytest.mark.parametrize("eps", [1e-3, 1e-2, 0.0])
def test_value_rescale_round_trip(eps):
    magnitudes = np.concatenate([[0.0], np.logspace(-12, 6, 3000)])
    x = t(np.concatenate([magnitudes, -magnitudes]))
    np.testing.assert_allclose(value_rescale_inverse(value_rescale(x, eps), eps).numpy(), x.numpy(), rtol=1e-12,
                               atol=0)
    # and the other way round over the whole rescaled range
    y = value_rescale(x, eps)
    np.testing.assert_allclose(value_rescale(value_rescale_inverse(y, eps), eps).numpy(), y.numpy(), rtol=1e-12,
                               atol=0)


def test_value_rescale_inverse_hand_computed():
    # h(3) = 1.003, so h^-1(1.003) = 3; h(-8) = -2.008, so h^-1(-2.008) = -8
    np.testing.assert_allclose(value_rescale_inverse(t([1.003, -2.008])).numpy(), [3.0, -8.0], rtol=1e-13)


def test_value_rescale_gradients():
    x = t([-5.0, -0.1, 0.0, 0.2, 7.0]).requires_grad_()
    assert torch.autograd.gradcheck(value_rescale, (x,))
    assert torch.autograd.gradcheck(value_rescale_inverse, (x,))
