"""Algorithms: ``make_loss(cfg)`` -> ``f(model_out, batch) -> (loss, metrics)``.

One module per ``cfg.algo.name`` (a2c, ppo, vtrace, impact, r2d2, ga3c). ``model_out``
is the model's output on ``batch["obs"]`` ``[T + 1, B, ...]`` (the last step is the
bootstrap observation); ``batch`` holds time-major tensors ``actions [T, B(, A)]``,
``rewards [T, B]``, ``discounts [T, B]``, ``behaviour_logp [T, B]``,
``behaviour_value [T + 1, B]`` and what each algorithm documents on top. The
loss is a scalar tensor; metrics are detached 0-dim tensors (R2D2 adds its
``[B]`` priorities). Losses never step optimizers or log.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import Tensor

from conveyor.config import ALGOS, RunCfg
from conveyor.models.heads import ModelOut

LossFn = Callable[[ModelOut, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]

__all__ = ["DISCRETE_ONLY", "LossFn", "actor_critic_total", "batch_series", "make_loss", "rollout_length",
           "term_graph"]

DISCRETE_ONLY = ("ga3c", "r2d2")
"""Algorithms whose losses need action probabilities or action values: refused for continuous actions."""


def make_loss(cfg: RunCfg) -> LossFn:
    """The loss function of ``cfg.algo.name``."""
    if cfg.algo.name not in ALGOS:
        raise ValueError(f"unknown algo {cfg.algo.name!r}: choose one of {', '.join(ALGOS)}")
    # Imported on demand: the algorithm modules import the helpers below from this package.
    return importlib.import_module(f"conveyor.algos.{cfg.algo.name}").make_loss(cfg)


def rollout_length(model_out: ModelOut, batch: dict[str, Tensor]) -> int:
    """T, the acting steps of ``batch``; checks that ``model_out`` covers the T + 1 observations."""
    T = batch["rewards"].shape[0]
    if model_out.value.shape[0] != T + 1:
        raise ValueError(f"model_out has {model_out.value.shape[0]} time steps, expected T + 1 = {T + 1}: "
                         "run the model on all of batch['obs'], bootstrap observation included")
    return T


def batch_series(batch: dict[str, Tensor], key: str, like: Tensor) -> Tensor:
    """``batch[key]`` in the dtype of the model output ``like``, so the return ops see one dtype."""
    if key not in batch:
        raise KeyError(f"the batch has no {key!r}: the architecture must provide it for this algorithm")
    return batch[key].to(like.dtype)


def actor_critic_total(policy: Tensor, value: Tensor, entropy: Tensor, value_coef: float, entropy_coef: float,
                       **extra: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The tail every actor-critic loss shares: ``loss = policy + value_coef * value - entropy_coef * entropy``
    (``entropy`` is the mean entropy, a bonus), and the metrics ``loss``, ``policy_loss``, ``value_loss``,
    ``entropy`` plus ``extra``, all detached."""
    loss = policy + value_coef * value
    if entropy_coef:  # else the entropy is a metric only (``term_graph``)
        loss = loss - entropy_coef * entropy
    metrics = {"loss": loss, "policy_loss": policy, "value_loss": value, "entropy": entropy, **extra}
    return loss, {name: m.detach() for name, m in metrics.items()}


def term_graph(coef: float) -> torch.set_grad_enabled:
    """``with term_graph(coef):`` around a loss term that ``coef`` weighs: without an autograd graph when ``coef``
    is 0. The term is then a metric only, and backpropagating it would add zeros to every gradient: a dozen ops
    of a small model's update (CartPole's entropy, with the a2c preset's coefficient 0)."""
    return torch.set_grad_enabled(torch.is_grad_enabled() and coef != 0)
