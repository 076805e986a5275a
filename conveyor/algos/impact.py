"""IMPACT (Luo et al. 2020, section 3): PPO-clip on a target-network ratio with V-trace GAE-lambda advantages.

Batch extras: ``target_logp [T, B]``, log-probs of the taken actions under the
target network (an architecture without a target network passes the
behaviour log-probs), and, when ``cfg.algo.kl_coef > 0``, ``target_params
[T, B, P]``, the target network's policy parameters.

The surrogate ratio follows ``cfg.algo.impact_ratio`` (paper figure 4 ablation):
``target`` (R1) = pi_learner / pi_target, ``worker`` (R2) = pi_learner / pi_worker,
``impact`` (R3) = pi_learner / max(pi_target, pi_worker / impact_rho). Advantages
are the ``pg_advantages`` of ``vtrace(worker_logp, target_logp, ..., lam=gae_lambda)``
(traces c_t clipped target/worker ratios, bootstrapped from the learner's values).

``loss = ppo_clip(ratio, A, clip) + value_coef * 0.5 mean((V - vs)^2)
- entropy_coef * entropy [+ kl_coef * mean KL(target || learner)]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from conveyor.algos import LossFn, actor_critic_total, batch_series, rollout_length, term_graph
from conveyor.config import RunCfg
from conveyor.losses import impact_ratio, ppo_clip_loss, value_loss
from conveyor.models.heads import ModelOut
from conveyor.returns import vtrace


def make_loss(cfg: RunCfg) -> LossFn:
    algo = cfg.algo
    ratio_kind = algo.impact_ratio

    def loss_fn(model_out: ModelOut, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        T = rollout_length(model_out, batch)
        values = model_out.value
        acting = model_out.time_slice(0, T)
        learner_logp = acting.log_prob(batch["actions"])
        worker_logp = batch_series(batch, "behaviour_logp", values)
        target_logp = batch_series(batch, "target_logp", values)
        targets = vtrace(worker_logp, target_logp, batch_series(batch, "rewards", values),
                         batch_series(batch, "discounts", values), values[:T], values[T], lam=algo.gae_lambda,
                         clip_rho=algo.clip_rho, clip_c=algo.clip_c, clip_pg_rho=algo.clip_pg_rho)
        if ratio_kind == "target":
            ratio = torch.exp(learner_logp - target_logp)
        elif ratio_kind == "worker":
            ratio = torch.exp(learner_logp - worker_logp)
        else:
            ratio = impact_ratio(learner_logp, target_logp, worker_logp, algo.impact_rho)
        policy = ppo_clip_loss(ratio, targets.pg_advantages, algo.clip)
        value = value_loss(values[:T], targets.vs)
        with term_graph(algo.entropy_coef):
            entropy = acting.entropy().mean()
        extra = {
            "ratio_mean": ratio.mean(), "ratio_max": ratio.max(),
            "clip_fraction": ((ratio - 1).abs() > algo.clip).to(ratio.dtype).mean(),
            # Where pi_worker / pi_target exceeds rho, IMPACT's max() picks the worker term.
            "worker_ratio_clip_fraction":
                (worker_logp - target_logp > math.log(algo.impact_rho)).to(ratio.dtype).mean(),
        }
        loss, metrics = actor_critic_total(policy, value, entropy, algo.value_coef, algo.entropy_coef, **extra)
        if algo.kl_coef > 0:
            kl = acting.kl_from(batch_series(batch, "target_params", values)).mean()
            loss = loss + algo.kl_coef * kl
            metrics.update(loss=loss.detach(), kl_target=kl.detach())
        return loss, metrics

    return loss_fn
