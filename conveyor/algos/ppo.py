"""PPO (Schulman et al. 2017) with GAE(lambda); the HTS-RL and PAAC variant of the on-policy update.

Advantages come from the values recorded at acting time (``batch["behaviour_value"]``
``[T + 1, B]``), so they stay fixed across epochs and minibatches;
``returns = advantages + behaviour_value[:T]`` are the value targets.
``loss = ppo_clip(exp(logp - behaviour_logp), A) + value_coef * value - entropy_coef * entropy``;
advantages are normalized per call when ``cfg.algo.normalize_advantages``.
Minibatching (by env columns) happens outside: any B works. Means run over
``batch["valid"]`` when the batch has it (steps a dead worker lost are false).
"""

from __future__ import annotations

import torch
from torch import Tensor

from conveyor.algos import LossFn, actor_critic_total, batch_series, rollout_length
from conveyor.config import RunCfg
from conveyor.losses import masked_mean, normalize_advantages, ppo_clip_loss, value_loss
from conveyor.models.heads import ModelOut
from conveyor.returns import gae


def make_loss(cfg: RunCfg) -> LossFn:
    algo = cfg.algo

    def loss_fn(model_out: ModelOut, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        T = rollout_length(model_out, batch)
        values = model_out.value
        behaviour_value = batch_series(batch, "behaviour_value", values)
        advantages = gae(batch_series(batch, "rewards", values), batch_series(batch, "discounts", values),
                         behaviour_value[:T], behaviour_value[T], algo.gae_lambda)
        returns = advantages + behaviour_value[:T]
        valid = batch.get("valid")
        if algo.normalize_advantages:
            advantages = normalize_advantages(advantages, mask=valid)
        acting = model_out.time_slice(0, T)
        log_ratio = acting.log_prob(batch["actions"]) - batch_series(batch, "behaviour_logp", values)
        ratio = torch.exp(log_ratio)
        policy = ppo_clip_loss(ratio, advantages, algo.clip, valid)
        value = value_loss(values[:T], returns, valid)
        entropy = masked_mean(acting.entropy(), valid)
        detached_ratio = ratio.detach() if valid is None else ratio.detach()[valid]
        return actor_critic_total(
            policy, value, entropy, algo.value_coef, algo.entropy_coef,
            ratio_mean=detached_ratio.mean(), ratio_max=detached_ratio.max(),
            clip_fraction=((detached_ratio - 1).abs() > algo.clip).to(ratio.dtype).mean(),
            # Schulman's k3 estimator of KL(behaviour || current): unbiased and never negative.
            approx_kl=masked_mean(ratio - 1 - log_ratio, valid))

    return loss_fn
