"""A2C as in PAAC (Clemente et al. 2017, algorithm 1): n-step returns, policy gradient, value, entropy.

``loss = pg + value_coef * value - entropy_coef * entropy`` with
``G_t = r_t + d_t G_{t+1}`` bootstrapped from V(s_T) and advantages ``G_t - V(s_t)``.
Means run over ``batch["valid"]`` when the batch has it (steps a dead worker lost are false). A categorical
policy's loss is one op with its gradient written out (``losses.categorical_actor_critic_loss``: the terms'
numbers to rounding, in a fraction of the autograd nodes); a Gaussian's is built from the terms.
"""

from __future__ import annotations

from torch import Tensor

from conveyor.algos import LossFn, actor_critic_total, batch_series, rollout_length, term_graph
from conveyor.config import RunCfg
from conveyor.losses import categorical_actor_critic_loss, masked_mean, policy_gradient_loss, value_loss
from conveyor.models.heads import ModelOut
from conveyor.returns import nstep_returns


def make_loss(cfg: RunCfg) -> LossFn:
    algo = cfg.algo

    def loss_fn(model_out: ModelOut, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        T = rollout_length(model_out, batch)
        values = model_out.value
        acting = model_out.time_slice(0, T)
        returns = nstep_returns(batch_series(batch, "rewards", values), batch_series(batch, "discounts", values),
                                values[T].detach())
        valid = batch.get("valid")
        if model_out.policy.discrete:
            loss, terms = categorical_actor_critic_loss(acting.params, acting.value, batch["actions"], returns,
                                                        algo.value_coef, algo.entropy_coef, valid)
            policy, value, entropy, advantage_mean = terms.unbind()
            return loss, {"loss": loss.detach(), "policy_loss": policy, "value_loss": value, "entropy": entropy,
                          "advantage_mean": advantage_mean}
        advantages = returns - acting.value  # values[:T], sliced once for both terms: one node less to backprop
        logp, entropies = acting.log_prob_and_entropy(batch["actions"])
        policy = policy_gradient_loss(logp, advantages, valid)
        value = value_loss(acting.value, returns, valid)
        with term_graph(algo.entropy_coef):
            entropy = masked_mean(entropies, valid)
        return actor_critic_total(policy, value, entropy, algo.value_coef, algo.entropy_coef,
                                  advantage_mean=masked_mean(advantages.detach(), valid))

    return loss_fn
