"""IMPALA V-trace actor-critic (Espeholt et al. 2018; SEED RL section 3.1).

The learner's own log-probs (detached) are the target policy of the trace;
``loss = -mean(logp * pg_advantages) + value_coef * 0.5 mean((V - vs)^2)
- entropy_coef * entropy`` with ``vs, pg_advantages = vtrace(behaviour_logp, logp, ...,
clip_rho, clip_c, clip_pg_rho)`` and lambda 1, as in the IMPALA paper.
"""

from __future__ import annotations

from torch import Tensor

from conveyor.algos import LossFn, actor_critic_total, batch_series, rollout_length, term_graph
from conveyor.config import RunCfg
from conveyor.losses import policy_gradient_loss, value_loss
from conveyor.models.heads import ModelOut
from conveyor.returns import vtrace


def make_loss(cfg: RunCfg) -> LossFn:
    algo = cfg.algo

    def loss_fn(model_out: ModelOut, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        T = rollout_length(model_out, batch)
        values = model_out.value
        acting = model_out.time_slice(0, T)
        logp = acting.log_prob(batch["actions"])
        behaviour_logp = batch_series(batch, "behaviour_logp", values)
        targets = vtrace(behaviour_logp, logp, batch_series(batch, "rewards", values),
                         batch_series(batch, "discounts", values), values[:T], values[T],
                         clip_rho=algo.clip_rho, clip_c=algo.clip_c, clip_pg_rho=algo.clip_pg_rho)
        policy = policy_gradient_loss(logp, targets.pg_advantages)
        value = value_loss(values[:T], targets.vs)
        with term_graph(algo.entropy_coef):
            entropy = acting.entropy().mean()
        rhos = (logp - behaviour_logp).exp()
        return actor_critic_total(policy, value, entropy, algo.value_coef, algo.entropy_coef,
                                  rho_mean=rhos.mean(), rho_max=rhos.max(),
                                  rho_clip_fraction=(rhos > algo.clip_rho).to(rhos.dtype).mean())

    return loss_fn
