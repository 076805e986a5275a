"""R2D2 (Kapturowski et al. 2019; SEED RL section 3.2): transformed n-step double-Q learning on sequences.

Burn-in is the caller's: ``model_out`` and ``batch`` cover the learning part
only. ``model_out.q`` ``[T + 1, B, A]`` holds the online Q values (rescaled
space); the batch adds ``target_q [T + 1, B, A]`` from the target network and
``weights [B]``, the prioritized-replay importance weights.

With ``delta_t = r2d2_targets(...)_t - Q(s_t, a_t)`` (see ``conveyor.losses.r2d2_targets``:
steps with fewer than n steps left bootstrap from s_T)::

    loss = mean_b( weights_b * mean_t 0.5 delta_{t,b}^2 )

``metrics["priorities"]`` is the ``[B]`` tensor
``eta * max_t |delta| + (1 - eta) * mean_t |delta|`` to write back to replay.
"""

from __future__ import annotations

from torch import Tensor

from conveyor.algos import LossFn, batch_series, rollout_length
from conveyor.config import RunCfg
from conveyor.losses import r2d2_targets, sequence_priorities
from conveyor.models.heads import ModelOut


def make_loss(cfg: RunCfg) -> LossFn:
    algo = cfg.algo

    def loss_fn(model_out: ModelOut, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        if model_out.q is None:
            raise ValueError("the r2d2 loss needs Q values: build the model with a dueling head (dueling=True)")
        T = rollout_length(model_out, batch)
        online_q = model_out.q
        targets = r2d2_targets(batch_series(batch, "rewards", online_q), batch_series(batch, "discounts", online_q),
                               online_q, batch_series(batch, "target_q", online_q), n=algo.n_step,
                               eps=algo.value_rescale_eps)
        taken_q = online_q[:T].gather(-1, batch["actions"].long().unsqueeze(-1)).squeeze(-1)
        td_errors = targets - taken_q
        weights = batch_series(batch, "weights", online_q)
        if weights.shape != td_errors.shape[1:]:
            raise ValueError(f"r2d2: weights has shape {tuple(weights.shape)}, "
                             f"expected [B] = {tuple(td_errors.shape[1:])}")
        loss = (weights * (0.5 * td_errors.pow(2)).mean(0)).mean()
        metrics = {
            "loss": loss.detach(),
            "td_abs_mean": td_errors.detach().abs().mean(),
            "q_mean": taken_q.detach().mean(),
            "priorities": sequence_priorities(td_errors, algo.eta),
        }
        return loss, metrics

    return loss_fn
