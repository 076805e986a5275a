"""Loss terms: pure functions of tensors, each a scalar to minimise (or a per-element term).

Targets and advantages are detached inside every term, so a caller can pass
tensors that still carry gradients without leaking them into the target.
Shapes are ``[T, B]`` unless noted; any matching shapes work where a term
only averages. Terms that average take an optional boolean ``mask`` of the
same shape: the mean runs over its true elements only (a step a dead worker
lost is masked out, ``RolloutStorage.drop_step``), and masked elements may
hold anything, NaN included.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from conveyor.models.normalize import RMS_CLIP
from conveyor.returns import value_rescale, value_rescale_inverse

__all__ = [
    "advantage_moments", "categorical_actor_critic_loss", "ga3c_entropy", "ga3c_policy_loss", "impact_ratio",
    "masked_mean", "normalize_advantages", "policy_gradient_loss", "ppo_clip_loss", "r2d2_targets",
    "sequence_priorities", "value_loss",
]


def _check_same_shape(op: str, **tensors: Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    for name, tensor in rest:
        if tensor.shape != first.shape:
            raise ValueError(f"{op}: {name} has shape {tuple(tensor.shape)}, expected {tuple(first.shape)} "
                             f"like {first_name}")


def masked_mean(values: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean of ``values`` over the elements where ``mask`` (bool, same shape) is true; all when None.

    Masked elements never reach the result, not even as NaN * 0; an all-false mask gives 0.
    """
    if mask is None:
        return values.mean()
    _check_same_shape("masked_mean", values=values, mask=mask)
    if mask.dtype != torch.bool:
        raise ValueError(f"masked_mean: mask must be bool, got {mask.dtype}")
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def policy_gradient_loss(logp: Tensor, advantages: Tensor, mask: Tensor | None = None) -> Tensor:
    """REINFORCE with a baseline (Williams 1992; A3C / PAAC): ``-mean(logp * advantages)``.

    Args:
        logp: ``[T, B]``, log pi(a_t | s_t), differentiable.
        advantages: ``[T, B]``, detached here.
        mask: ``[T, B]`` bool, the elements to average (all when None).
    """
    _check_same_shape("policy_gradient_loss", logp=logp, advantages=advantages)
    return -masked_mean(logp * advantages.detach(), mask)


def value_loss(values: Tensor, targets: Tensor, mask: Tensor | None = None, moments: Tensor | None = None,
               clip: float = RMS_CLIP) -> Tensor:
    """Squared error ``0.5 * mean((values - targets)^2)``; ``targets`` ``[T, B]`` are detached.

    With ``moments``, ``[mean, std]`` of the value targets (a ``ValueNormalizer``'s), the error is taken in
    standardized units, the targets clipped to [-clip, clip]:
    ``0.5 * mean(((values - mean) / std - clip((targets - mean) / std))^2)`` (Sample Factory's and rl_games'
    value normalization; ``values`` are in env units, ``mean + std * head``, so the first term is the head).
    """
    _check_same_shape("value_loss", values=values, targets=targets)
    targets = targets.detach()
    if moments is not None:
        mean, std = moments.detach().to(values.dtype)
        values = (values - mean) / std
        targets = ((targets - mean) / std).clamp(-clip, clip)
    return 0.5 * masked_mean((values - targets).pow(2), mask)


def categorical_actor_critic_loss(logits: Tensor, values: Tensor, actions: Tensor, returns: Tensor, value_coef: float,
                                  entropy_coef: float, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The actor-critic loss of a categorical policy (A3C / PAAC's A2C) in one autograd node whose gradient is
    written out: the number and the gradients of

    ``policy_gradient_loss(logp, G - V, mask) + value_coef * value_loss(V, G, mask)
    - entropy_coef * masked_mean(entropy, mask)``

    with ``logp = log_softmax(logits)[actions]``. Autograd would record and replay the two dozen small ops of
    those terms one by one, and on a small model (a 64x64 MLP, 16 envs) they cost more than the model's own
    forward and backward; here the forward computes the gradients with the loss, and the backward scales them.
    With ``n`` the elements averaged (``mask``'s true ones) and ``A = G - V``:

    - ``dL/dlogits = (A (p - onehot(a)) + entropy_coef p (logp + H)) / n``, as
      ``dH/dlogits = -p (logp + H)`` for ``H = -sum(p logp)``;
    - ``dL/dV = -value_coef A / n``: the policy term's advantage is a constant, as in ``policy_gradient_loss``;
      ``G`` (a target) and ``actions`` take no gradient.

    Masked elements never reach the result, not even as NaN * 0; an all-false mask gives 0, and an all-true
    mask the numbers of no mask, to the bit.

    Args:
        logits: ``[T, B, A]``, differentiable.
        values: ``[T, B]``, V(s_t), differentiable.
        actions: ``[T, B]`` integer actions taken.
        returns: ``[T, B]``, the value targets G_t (detached here).
        value_coef, entropy_coef: the terms' weights (the entropy is a bonus: subtracted).
        mask: ``[T, B]`` bool, the elements to average (all when None).

    Returns:
        ``(loss, terms)``: the scalar loss and the detached ``[4]`` terms ``[policy_loss, value_loss, entropy,
        advantage_mean]``, each a mean over the elements.
    """
    _check_same_shape("categorical_actor_critic_loss", values=values, returns=returns, actions=actions,
                      logits=logits[..., 0])
    if actions.is_floating_point():
        raise ValueError(f"categorical_actor_critic_loss: actions must be integers, got {actions.dtype}")
    if mask is not None:
        _check_same_shape("categorical_actor_critic_loss", values=values, mask=mask)
        if mask.dtype != torch.bool:
            raise ValueError(f"categorical_actor_critic_loss: mask must be bool, got {mask.dtype}")
    return _CategoricalActorCritic.apply(logits, values, actions, returns.detach(), mask, value_coef, entropy_coef)


@functools.lru_cache(maxsize=16)
def _terms_matrix(value_coef: float, entropy_coef: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[4, 5]``: from the means of ``logp_taken * A``, ``A^2``, ``-H`` and ``A``, the terms policy loss, value loss,
    entropy and mean advantage, and the loss, in one product (made once: a tensor from a list costs a few ops)."""
    return torch.tensor([[-1.0, 0.0, 0.0, 0.0, -1.0],
                         [0.0, 0.5, 0.0, 0.0, 0.5 * value_coef],
                         [0.0, 0.0, -1.0, 0.0, entropy_coef],
                         [0.0, 0.0, 0.0, 1.0, 0.0]], dtype=dtype, device=device)


class _CategoricalActorCritic(torch.autograd.Function):
    """``categorical_actor_critic_loss``'s node: the forward takes the loss and its gradients in one pass."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, values: Tensor, actions: Tensor, returns: Tensor, mask: Tensor | None,
                value_coef: float, entropy_coef: float) -> tuple[Tensor, Tensor]:
        logp = torch.log_softmax(logits, -1)
        probs = logp.exp()
        index = (actions if actions.dtype == torch.int64 else actions.long()).unsqueeze(-1)
        logp_taken = logp.gather(-1, index).squeeze(-1)
        negentropy = (probs * logp).sum(-1)
        advantages = returns - values
        if mask is None:
            count: float | Tensor = float(advantages.numel())
        else:  # zeros where masked, so a NaN there reaches neither the sums nor the gradients
            count = mask.sum().clamp(min=1).to(advantages.dtype)
            advantages = torch.where(mask, advantages, 0.0)
            logp_taken = torch.where(mask, logp_taken, 0.0)
            negentropy = torch.where(mask, negentropy, 0.0)
        means = torch.stack([logp_taken * advantages, advantages * advantages, negentropy, advantages]).sum((1, 2))
        means = means / count
        out = means @ _terms_matrix(value_coef, entropy_coef, means.dtype, means.device)
        grad_logits = probs * advantages.unsqueeze(-1)
        grad_logits.scatter_add_(-1, index, -advantages.unsqueeze(-1))  # A (p - onehot(a))
        if entropy_coef:  # + entropy_coef p (logp + H)
            grad_logits.addcmul_(probs, logp - negentropy.unsqueeze(-1), value=entropy_coef)
        grad_logits = grad_logits / count
        if mask is not None:
            grad_logits = torch.where(mask.unsqueeze(-1), grad_logits, 0.0)
        grad_values = advantages * -value_coef / count
        terms, loss = out[:4], out[4]
        ctx.save_for_backward(grad_logits, grad_values)
        ctx.mark_non_differentiable(terms)
        return loss, terms

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, _grad_terms: Tensor) -> tuple[Tensor | None, ...]:
        grad_logits, grad_values = ctx.saved_tensors
        return grad_logits * grad_loss, grad_values * grad_loss, None, None, None, None, None


def advantage_moments(advantages: Tensor, mask: Tensor | None = None) -> Tensor:
    """``[mean(A), std(A)]`` over all elements (the ``mask``ed ones), detached: what ``normalize_advantages``
    divides by. The population std (no Bessel correction) keeps a single-element batch finite."""
    advantages = advantages.detach()
    if mask is None:
        return torch.stack([advantages.mean(), advantages.std(correction=0)])
    mean = masked_mean(advantages, mask)
    return torch.stack([mean, masked_mean((advantages - mean).pow(2), mask).sqrt()])


def normalize_advantages(advantages: Tensor, eps: float = 1e-8, mask: Tensor | None = None,
                         moments: Tensor | None = None) -> Tensor:
    """``(A - mean(A)) / (std(A) + eps)`` over all elements (the ``mask``ed ones), detached (PPO
    implementations). Masked-out elements come back as 0. ``moments``, ``[mean, std]`` taken over a larger
    batch than this one (data-parallel learners: the whole minibatch, of which this is a rank's part), replace
    ``advantage_moments(advantages, mask)``.
    """
    advantages = advantages.detach()
    mean, std = advantage_moments(advantages, mask) if moments is None else moments
    if mask is None:
        return (advantages - mean) / (std + eps)
    return torch.where(mask, (advantages - mean) / (std + eps), torch.zeros_like(advantages))


def ppo_clip_loss(ratio: Tensor, advantages: Tensor, clip: float, mask: Tensor | None = None) -> Tensor:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), negated to be minimised.

    ``-mean(min(r A, clip(r, 1 - clip, 1 + clip) A))``.

    Args:
        ratio: ``[T, B]``, pi_theta / pi_old (or the IMPACT ratio), differentiable.
        advantages: ``[T, B]``, detached here.
        clip: epsilon > 0.
    """
    _check_same_shape("ppo_clip_loss", ratio=ratio, advantages=advantages)
    if not clip > 0:
        raise ValueError(f"ppo_clip_loss: clip must be positive, got {clip}")
    advantages = advantages.detach()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip, 1 + clip) * advantages
    return -masked_mean(torch.minimum(unclipped, clipped), mask)


def impact_ratio(learner_logp: Tensor, target_logp: Tensor, worker_logp: Tensor, rho: float) -> Tensor:
    """IMPACT's clipped-target ratio ``pi_learner / max(pi_target, pi_worker / rho)`` (Luo et al. 2020, J_AIS).

    Equals ``min(pi_worker / pi_target, rho) * pi_learner / pi_worker``. Computed
    as ``exp(learner_logp - max(target_logp, worker_logp - log rho))`` so tiny
    probabilities (log-probs of -200 in float32) give a finite ratio instead
    of 0/0.

    Args:
        learner_logp: ``[T, B]``, log-probs under the learner, differentiable.
        target_logp: ``[T, B]``, under the target network (detached here).
        worker_logp: ``[T, B]``, under the worker that acted (detached here).
        rho: the worker-ratio bound, >= 1 in the paper (beta = 1 / rho).

    Returns:
        ``[T, B]`` ratio; gradients flow to ``learner_logp`` only.
    """
    _check_same_shape("impact_ratio", learner_logp=learner_logp, target_logp=target_logp, worker_logp=worker_logp)
    if not rho > 0:
        raise ValueError(f"impact_ratio: rho must be positive, got {rho}")
    log_denominator = torch.maximum(target_logp.detach(), worker_logp.detach() - math.log(rho))
    return torch.exp(learner_logp - log_denominator)


def _check_probs(op: str, probs: Tensor, eps: float) -> None:
    if probs.dim() < 1:
        raise ValueError(f"{op}: probs must be [..., A], got a scalar")
    if not eps > 0:
        raise ValueError(f"{op}: eps must be positive, got {eps}")


def ga3c_policy_loss(probs: Tensor, actions: Tensor, advantages: Tensor, eps: float) -> Tensor:
    """GA3C policy term ``-mean(log(pi(a_t | s_t) + eps) * A_t)`` (Babaeizadeh et al. 2017, eq. 5).

    The eps bounds ``d log(pi + eps) / d pi`` by ``1 / eps`` when a lagged
    policy has made the taken action nearly impossible.

    Args:
        probs: ``[T, B, A]`` action probabilities, differentiable.
        actions: ``[T, B]`` int64.
        advantages: ``[T, B]``, ``R_t - V(s_t)``, detached here.
        eps: > 0.
    """
    _check_probs("ga3c_policy_loss", probs, eps)
    if actions.shape != probs.shape[:-1] or advantages.shape != probs.shape[:-1]:
        raise ValueError(f"ga3c_policy_loss: actions {tuple(actions.shape)} and advantages {tuple(advantages.shape)} "
                         f"must both have shape {tuple(probs.shape[:-1])} (probs without its action axis)")
    taken = probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    return -(torch.log(taken + eps) * advantages.detach()).mean()


def ga3c_entropy(probs: Tensor, eps: float) -> Tensor:
    """GA3C entropy ``-sum_a pi_a log(pi_a + eps)`` (Babaeizadeh et al. 2017, eq. 5), per state.

    Args:
        probs: ``[..., A]`` action probabilities.
        eps: > 0, the same as in ``ga3c_policy_loss``.

    Returns:
        ``[...]`` entropies (finite and differentiable even at pi_a = 0).
    """
    _check_probs("ga3c_entropy", probs, eps)
    return -(probs * torch.log(probs + eps)).sum(-1)


def r2d2_targets(rewards: Tensor, discounts: Tensor, online_q: Tensor, target_q: Tensor, *, n: int,
                 eps: float = 1e-3) -> Tensor:
    """R2D2 transformed n-step double-Q targets (Kapturowski et al. 2019; SEED RL section 3.2).

    For each step t, with ``m = min(n, T - t)`` steps left in the sequence and
    ``D_{t,k} = d_t d_{t+1} ... d_{t+k-1}`` (``D_{t,0} = 1``)::

        a* = argmax_a online_q[t + m, a]
        target_t = h( sum_{k<m} D_{t,k} r_{t+k} + D_{t,m} h^-1(target_q[t + m, a*]) )

    h is ``value_rescale``. ``d = gamma * (1 - terminated)`` multiplies through,
    so an episode end stops both the sum and the bootstrap. Steps with fewer
    than n steps left bootstrap from the last state s_T with the steps
    available (as rlax's n-step targets do), so every target is valid and no
    mask is needed.

    Args:
        rewards: ``[T, B]``.
        discounts: ``[T, B]``.
        online_q: ``[T + 1, B, A]``, online-network Q values (rescaled space) at
            s_0..s_T; only used for the argmax, row 0 is never a bootstrap.
        target_q: ``[T + 1, B, A]``, target-network Q values at s_0..s_T.
        n: steps before bootstrapping, >= 1.
        eps: value-rescaling epsilon.

    Returns:
        ``[T, B]`` targets in rescaled space, detached.
    """
    if rewards.dim() != 2 or rewards.shape[0] < 1:
        raise ValueError(f"r2d2_targets: rewards must be [T, B] with T >= 1, got shape {tuple(rewards.shape)}")
    _check_same_shape("r2d2_targets", rewards=rewards, discounts=discounts)
    T, B = rewards.shape
    if online_q.dim() != 3 or online_q.shape[:2] != (T + 1, B):
        raise ValueError(f"r2d2_targets: online_q must be [T + 1, B, A] = [{T + 1}, {B}, A], "
                         f"got shape {tuple(online_q.shape)}")
    _check_same_shape("r2d2_targets", online_q=online_q, target_q=target_q)
    if n < 1:
        raise ValueError(f"r2d2_targets: n must be >= 1, got {n}")
    rewards, discounts, online_q, target_q = (x.detach() for x in (rewards, discounts, online_q, target_q))

    greedy = online_q.argmax(-1, keepdim=True)
    bootstrap = value_rescale_inverse(target_q.gather(-1, greedy).squeeze(-1), eps)  # [T + 1, B]
    # Pad past the end: zero reward, unit discount and the last bootstrap repeated, so a step with m < n
    # steps left sums exactly its m real steps and bootstraps from s_T.
    rewards = torch.cat([rewards, rewards.new_zeros(n - 1, B)])
    discounts = torch.cat([discounts, discounts.new_ones(n - 1, B)])
    bootstrap = torch.cat([bootstrap, bootstrap[-1:].expand(n - 1, B)])
    returns = bootstrap[n : n + T]
    for k in reversed(range(n)):
        returns = rewards[k : k + T] + discounts[k : k + T] * returns
    return value_rescale(returns, eps)


def sequence_priorities(td_errors: Tensor, eta: float) -> Tensor:
    """R2D2 sequence priority ``eta * max_t |delta_t| + (1 - eta) * mean_t |delta_t|`` (SEED RL table 8).

    Args:
        td_errors: ``[T, B]``.
        eta: mix in [0, 1] (paper: 0.9).

    Returns:
        ``[B]`` priorities, detached.
    """
    if td_errors.dim() != 2:
        raise ValueError(f"sequence_priorities: td_errors must be [T, B], got shape {tuple(td_errors.shape)}")
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"sequence_priorities: eta must lie in [0, 1], got {eta}")
    magnitude = td_errors.detach().abs()
    return eta * magnitude.max(0).values + (1 - eta) * magnitude.mean(0)
