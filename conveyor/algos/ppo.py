"""PPO (Schulman et al. 2017) with GAE(lambda); the HTS-RL and PAAC variant of the on-policy update.

Advantages come from the values recorded at acting time (``batch["behaviour_value"]``
``[T + 1, B]``), so they stay fixed across epochs and minibatches;
``returns = advantages + behaviour_value[:T]`` are the value targets; with ``batch["value_moments"]``
(``ModelCfg.normalize_values``: ``Learner.fit_value_targets``) the value loss is taken in their standardized units.
``loss = ppo_clip(exp(logp - behaviour_logp), A) + value_coef * value - entropy_coef * entropy``;
advantages are normalized per call when ``cfg.algo.normalize_advantages`` (over the whole minibatch when
data-parallel ranks each hold part of it: ``batch["advantage_moments"]``).
Minibatching happens outside (``Learner.update_epochs``): by env columns, any B
works; by single steps (feed-forward models), the batch first gets its fixed
targets from ``with_targets`` (``advantages``, ``returns`` ``[T, B]``), which the
loss then uses instead of running GAE, since a minibatch of scattered steps has
no time axis. Means run over ``batch["valid"]`` when the batch has it (steps a
dead worker lost are false).
"""

from __future__ import annotations

import torch
from torch import Tensor

from conveyor.algos import LossFn, actor_critic_total, batch_series, rollout_length, term_graph
from conveyor.config import RunCfg
from conveyor.losses import masked_mean, normalize_advantages, ppo_clip_loss, value_loss
from conveyor.models.heads import ModelOut
from conveyor.returns import gae


def make_loss(cfg: RunCfg) -> LossFn:
    algo = cfg.algo

    def loss_fn(model_out: ModelOut, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        values = model_out.value
        if "advantages" in batch:  # fixed by with_targets (the batch may be scattered steps: [1, N])
            advantages, returns = batch_series(batch, "advantages", values), batch_series(batch, "returns", values)
            T = advantages.shape[0]
        else:
            T = rollout_length(model_out, batch)
            advantages, returns = _targets(batch, values, algo.gae_lambda)
        valid = batch.get("valid")
        if algo.normalize_advantages:
            advantages = normalize_advantages(advantages, mask=valid, moments=batch.get("advantage_moments"))
        acting = model_out.time_slice(0, T)
        log_ratio = acting.log_prob(batch["actions"]) - batch_series(batch, "behaviour_logp", values)
        ratio = torch.exp(log_ratio)
        policy = ppo_clip_loss(ratio, advantages, algo.clip, valid)
        value = value_loss(values[:T], returns, valid, moments=batch.get("value_moments"))
        with term_graph(algo.entropy_coef):
            entropy = masked_mean(acting.entropy(), valid)
        detached_ratio = ratio.detach() if valid is None else ratio.detach()[valid]
        return actor_critic_total(
            policy, value, entropy, algo.value_coef, algo.entropy_coef,
            ratio_mean=detached_ratio.mean(), ratio_max=detached_ratio.max(),
            clip_fraction=((detached_ratio - 1).abs() > algo.clip).to(ratio.dtype).mean(),
            # Schulman's k3 estimator of KL(behaviour || current): unbiased and never negative.
            approx_kl=masked_mean(ratio - 1 - log_ratio, valid))

    return loss_fn


def _targets(batch: dict[str, Tensor], like: Tensor, gae_lambda: float) -> tuple[Tensor, Tensor]:
    """GAE advantages and value targets ``[T, B]`` from the acting-time values ``behaviour_value [T + 1, B]``."""
    behaviour_value = batch_series(batch, "behaviour_value", like)
    T = behaviour_value.shape[0] - 1
    advantages = gae(batch_series(batch, "rewards", like), batch_series(batch, "discounts", like),
                     behaviour_value[:T], behaviour_value[T], gae_lambda)
    return advantages, advantages + behaviour_value[:T]


def with_targets(batch: dict[str, Tensor], gae_lambda: float) -> dict[str, Tensor]:
    """``batch`` plus its fixed PPO targets ``advantages`` and ``returns`` ``[T, B]`` (float32, detached): what
    the loss needs once minibatches are single steps without a time axis (``Learner.update_epochs(steps=True)``)."""
    with torch.no_grad():
        advantages, returns = _targets(batch, batch["behaviour_value"].float(), gae_lambda)
    return {**batch, "advantages": advantages, "returns": returns}


def epoch_batch(cfg: RunCfg, recurrent: bool, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], bool]:
    """What ``Learner.update_epochs`` trains on, and whether its minibatches are single steps (``steps``).

    PPO with a feed-forward model draws minibatches of single steps from all of T x B, as CleanRL and SB3
    do, so the batch gets its fixed targets first (``with_targets``); minibatches of whole env columns
    would hold few, correlated trajectories (one env each, when there are as many minibatches as envs).
    A recurrent model keeps env columns (its core needs the time order); other algorithms take one step.
    """
    if cfg.algo.name != "ppo" or recurrent:
        return batch, False
    return with_targets(batch, cfg.algo.gae_lambda), True
