"""Return and advantage estimators: pure torch ops on time-major tensors.

Shapes are ``[T, B]`` (extra trailing dims are allowed and broadcast along);
``bootstrap_value`` is ``[B]`` = V(s_T), the value of the observation after
the last step. ``discounts[t] = gamma * (1 - terminated[t])``: a zero discount
stops both the sum and the bootstrap, so one rollout may hold several
episodes. A truncated step arrives with ``gamma * V(final_obs)`` already
folded into its reward and discount 0, so no op needs a special case.

Outputs keep the inputs' dtype (float32 or float64) and device. The loops run
backwards over T only; B is vectorized.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["VTraceReturns", "gae", "nstep_returns", "value_rescale", "value_rescale_inverse", "vtrace"]


def _check_rollout(op: str, bootstrap_value: Tensor, **series: Tensor) -> None:
    """Raise ValueError unless every series is ``[T, ...]`` alike (T >= 1) and the bootstrap is ``[...]``."""
    first_name, first = next(iter(series.items()))
    if first.dim() < 1 or first.shape[0] < 1:
        raise ValueError(f"{op}: {first_name} must be time-major [T, B] with T >= 1, got shape {tuple(first.shape)}")
    for name, tensor in series.items():
        if tensor.shape != first.shape:
            raise ValueError(f"{op}: {name} has shape {tuple(tensor.shape)}, expected {tuple(first.shape)} "
                             f"like {first_name}")
    if bootstrap_value.shape != first.shape[1:]:
        raise ValueError(f"{op}: bootstrap_value has shape {tuple(bootstrap_value.shape)}, "
                         f"expected {tuple(first.shape[1:])} (one value per env, for s_T)")
    for name, tensor in (*series.items(), ("bootstrap_value", bootstrap_value)):
        if not tensor.is_floating_point() or tensor.dtype != first.dtype:
            raise ValueError(f"{op}: {name} has dtype {tensor.dtype}, expected {first.dtype} like {first_name}")


def _check_unit(op: str, name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{op}: {name} must lie in [0, 1], got {value}")


def nstep_returns(rewards: Tensor, discounts: Tensor, bootstrap_value: Tensor) -> Tensor:
    """Discounted n-step returns bootstrapped at the end of the rollout (PAAC / A3C targets).

    ``G_t = r_t + d_t * G_{t+1}`` with ``G_T = bootstrap_value``
    (Clemente et al. 2017, PAAC, algorithm 1; Mnih et al. 2016, A3C).

    Args:
        rewards: ``[T, B]``.
        discounts: ``[T, B]``, ``gamma * (1 - terminated)``.
        bootstrap_value: ``[B]``, V(s_T).

    Returns:
        ``[T, B]`` returns. Gradients flow to every input.
    """
    _check_rollout("nstep_returns", bootstrap_value, rewards=rewards, discounts=discounts)
    returns = []
    next_return = bootstrap_value
    # addcmul over unbound rows: one op a step where indexing, multiplying and adding take four (it runs in every
    # A2C update; the same float32 numbers: r + (1 * d) * G)
    for reward, discount in zip(reversed(rewards.unbind(0)), reversed(discounts.unbind(0))):
        next_return = torch.addcmul(reward, discount, next_return)
        returns.append(next_return)
    return torch.stack(returns[::-1])


def gae(rewards: Tensor, discounts: Tensor, values: Tensor, bootstrap_value: Tensor, lam: float) -> Tensor:
    """Generalized advantage estimation (Schulman et al. 2016; used by PPO and HTS-RL).

    ``delta_t = r_t + d_t V_{t+1} - V_t`` with ``V_T = bootstrap_value``;
    ``A_t = delta_t + d_t * lam * A_{t+1}`` with ``A_T = 0``.
    ``lam = 1`` gives n-step returns minus values; ``lam = 0`` the one-step TD error.

    Args:
        rewards: ``[T, B]``.
        discounts: ``[T, B]``, ``gamma * (1 - terminated)``.
        values: ``[T, B]``, V(s_t).
        bootstrap_value: ``[B]``, V(s_T).
        lam: lambda in [0, 1].

    Returns:
        ``[T, B]`` advantages. Gradients flow to every input (detach values
        first where the advantages are a fixed target).
    """
    _check_rollout("gae", bootstrap_value, rewards=rewards, discounts=discounts, values=values)
    _check_unit("gae", "lam", lam)
    next_values = torch.cat([values[1:], bootstrap_value.unsqueeze(0)])
    deltas = rewards + discounts * next_values - values
    advantages = []
    next_advantage = torch.zeros_like(bootstrap_value)
    for t in reversed(range(rewards.shape[0])):
        next_advantage = deltas[t] + discounts[t] * lam * next_advantage
        advantages.append(next_advantage)
    return torch.stack(advantages[::-1])


class VTraceReturns(NamedTuple):
    """V-trace outputs, both ``[T, B]`` and detached: ``vs`` (value targets), ``pg_advantages``."""

    vs: Tensor
    pg_advantages: Tensor


def vtrace(behaviour_logp: Tensor, target_logp: Tensor, rewards: Tensor, discounts: Tensor, values: Tensor,
           bootstrap_value: Tensor, *, lam: float = 1.0, clip_rho: float = 1.0, clip_c: float = 1.0,
           clip_pg_rho: float = 1.0) -> VTraceReturns:
    """V-trace off-policy value targets and policy-gradient advantages.

    Espeholt et al. 2018 (IMPALA), eq. 1 and section 4.2, as used by SEED RL
    section 3.1; with ``lam`` and the target/worker policies it is the
    V-trace GAE-lambda of IMPACT (Luo et al. 2020, section 3):

        rho_t = exp(target_logp_t - behaviour_logp_t)
        c_t = lam * min(clip_c, rho_t)
        delta_t = r_t + d_t V_{t+1} - V_t
        vs_t - V_t = min(clip_rho, rho_t) delta_t + d_t c_t (vs_{t+1} - V_{t+1})
        pg_advantages_t = min(clip_pg_rho, rho_t) (r_t + d_t vs_{t+1} - V_t)

    with ``V_T = vs_T = bootstrap_value``. The policy-gradient target uses
    ``vs_{t+1}`` without lambda blending, as in the IMPALA paper.

    Args:
        behaviour_logp: ``[T, B]``, log mu(a_t | s_t) of the policy that acted.
        target_logp: ``[T, B]``, log pi(a_t | s_t) of the policy being evaluated.
        rewards: ``[T, B]``.
        discounts: ``[T, B]``, ``gamma * (1 - terminated)``.
        values: ``[T, B]``, V(s_t).
        bootstrap_value: ``[B]``, V(s_T).
        lam: trace lambda in [0, 1].
        clip_rho, clip_c, clip_pg_rho: truncation levels rho-bar, c-bar and the
            policy-gradient rho-bar (all > 0).

    Returns:
        ``VTraceReturns(vs, pg_advantages)``, each ``[T, B]``, detached: they
        are regression and policy-gradient targets, never differentiated.
    """
    _check_rollout("vtrace", bootstrap_value, behaviour_logp=behaviour_logp, target_logp=target_logp,
                   rewards=rewards, discounts=discounts, values=values)
    _check_unit("vtrace", "lam", lam)
    for name, clip in (("clip_rho", clip_rho), ("clip_c", clip_c), ("clip_pg_rho", clip_pg_rho)):
        if not clip > 0:
            raise ValueError(f"vtrace: {name} must be positive, got {clip}")
    # Targets carry no gradient (IMPALA, rlax): detaching the inputs also keeps the loop off the autograd graph.
    rewards, discounts, values, bootstrap_value = (x.detach() for x in (rewards, discounts, values, bootstrap_value))
    # A ratio that overflows to inf is clamped back to the finite clip level.
    rhos = torch.exp(target_logp.detach() - behaviour_logp.detach())
    clipped_rhos = rhos.clamp(max=clip_rho)
    traces = lam * rhos.clamp(max=clip_c)
    next_values = torch.cat([values[1:], bootstrap_value.unsqueeze(0)])
    deltas = clipped_rhos * (rewards + discounts * next_values - values)

    corrections = []  # vs_t - V_t
    next_correction = torch.zeros_like(bootstrap_value)
    for t in reversed(range(rewards.shape[0])):
        next_correction = deltas[t] + discounts[t] * traces[t] * next_correction
        corrections.append(next_correction)
    vs = values + torch.stack(corrections[::-1])

    next_vs = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)])
    pg_advantages = rhos.clamp(max=clip_pg_rho) * (rewards + discounts * next_vs - values)
    return VTraceReturns(vs, pg_advantages)


def value_rescale(x: Tensor, eps: float = 1e-3) -> Tensor:
    """R2D2 value rescaling ``h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x``.

    Pohlen et al. 2018; Kapturowski et al. 2019 (R2D2), as in SEED RL
    section 3.2 and table 8. Any shape; elementwise.

    Computed as ``x / (sqrt(|x| + 1) + 1) + eps x``, the same function without
    the cancellation of ``sqrt(|x| + 1) - 1`` near zero (and without the sign,
    so the gradient at 0 is the true 1/2 + eps).
    """
    if eps < 0:
        raise ValueError(f"value_rescale: eps must be >= 0, got {eps}")
    return x / (torch.sqrt(x.abs() + 1) + 1) + eps * x


def value_rescale_inverse(x: Tensor, eps: float = 1e-3) -> Tensor:
    """Exact inverse of ``value_rescale`` (Pohlen et al. 2018, proposition A.2; R2D2). Any shape.

    The textbook closed form
    ``sign(x) (((sqrt(1 + 4 eps (|x| + 1 + eps)) - 1) / (2 eps))^2 - 1)``
    cancels catastrophically near 0 and divides by eps. With
    ``a = 1 + 2 eps`` and ``s = sqrt(a^2 + 4 eps |x|)`` (the same square root)
    it equals ``w (|w| + 2)`` for ``w = 2 x / (a + s)``: every term is a sum of
    same-signed quantities, so the round trip is exact to a few ulp at any
    magnitude, and ``eps = 0`` needs no special case.
    """
    if eps < 0:
        raise ValueError(f"value_rescale_inverse: eps must be >= 0, got {eps}")
    a = 1 + 2 * eps
    w = 2 * x / (a + torch.sqrt(a * a + 4 * eps * x.abs()))
    return w * (w.abs() + 2)
