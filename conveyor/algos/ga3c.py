"""GA3C (Babaeizadeh et al. 2017, eq. 5): A2C with ``log(pi + eps)`` and the same eps in the entropy.

``loss = -mean(log(pi(a_t) + eps) A_t) - entropy_coef * mean(-sum pi log(pi + eps))
+ value_coef * 0.5 mean((G_t - V_t)^2)``, n-step returns bootstrapped from V(s_T).
Needs a categorical policy.
"""

from __future__ import annotations

from torch import Tensor

from conveyor.algos import LossFn, actor_critic_total, batch_series, rollout_length, term_graph
from conveyor.config import RunCfg
from conveyor.losses import ga3c_entropy, ga3c_policy_loss, value_loss
from conveyor.models.heads import ModelOut
from conveyor.returns import nstep_returns


def make_loss(cfg: RunCfg) -> LossFn:
    algo = cfg.algo

    def loss_fn(model_out: ModelOut, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        if not model_out.policy.discrete:
            raise ValueError("the ga3c loss needs a discrete action space (eq. 5 uses action probabilities): "
                             "use a2c or ppo for continuous actions")
        T = rollout_length(model_out, batch)
        values = model_out.value
        returns = nstep_returns(batch_series(batch, "rewards", values), batch_series(batch, "discounts", values),
                                values[T].detach())
        advantages = returns - values[:T]
        probs = model_out.policy.probs(model_out.params[:T])
        policy = ga3c_policy_loss(probs, batch["actions"], advantages, algo.ga3c_eps)
        value = value_loss(values[:T], returns)
        with term_graph(algo.entropy_coef):
            entropy = ga3c_entropy(probs, algo.ga3c_eps).mean()
        return actor_critic_total(policy, value, entropy, algo.value_coef, algo.entropy_coef,
                                  advantage_mean=advantages.mean())

    return loss_fn
