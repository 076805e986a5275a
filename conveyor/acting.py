"""Acting helpers shared by every architecture that runs a policy on a batch.

``policy_step`` runs one batched forward and samples; ``step_targets``
turns an env step's flags into the training rewards and discounts of
docs/design.md "Discounts and the truncation bootstrap":
``discount = gamma * (1 - terminated)``, and at a truncated step
the bootstrap ``gamma * V(final_obs)`` is folded into the reward with
discount 0, so the return ops need no special case.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from conveyor.models.heads import ModelOut


class Action(NamedTuple):
    actions: Tensor  # [B] int64 or [B, A] float
    logp: Tensor  # [B]
    value: Tensor  # [B]
    out: ModelOut | None = None  # the forward's output with its autograd graph, when kept


def policy_step(model: nn.Module, obs: Tensor, generator: torch.Generator | None = None,
                uniform: Tensor | None = None, keep_graph: bool = False) -> Action:
    """One forward on ``obs [B, ...]``; sample actions (by inverse CDF when ``uniform`` is given).

    ``keep_graph`` returns the output ``[1, B, ...]`` with its autograd graph, so a learner whose
    parameters do not change during the rollout (PAAC A2C) can backpropagate through the acting
    forward instead of computing it a second time.
    """
    with torch.set_grad_enabled(keep_graph):
        out = model(obs.unsqueeze(0))
    params, value = out.params[0].detach(), out.value[0].detach()
    actions = out.policy.sample(params, uniform, generator)
    return Action(actions, out.policy.log_prob(params, actions), value, out if keep_graph else None)


@torch.no_grad()
def values_of(model: nn.Module, obs: Tensor) -> Tensor:
    """V(obs) for ``obs [B, ...]``."""
    return model(obs.unsqueeze(0)).value[0]


def step_targets(model: nn.Module | None, rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
                 final_obs: np.ndarray | None, gamma: float, device: torch.device | str = "cpu",
                 final_values: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Training ``(rewards, discounts)`` ``[B]`` for one step, bootstrapping truncated episodes.

    Only the rows that were truncated (and not terminated) get a forward pass on
    their final observation. ``final_values`` ``[B]``, when given, is V(final_obs)
    already computed for every row, and neither ``model`` nor ``final_obs`` is read (HTS
    computes it in a fixed-size batch, so a row's value does not depend on which rows were
    cut; SEED's needs each env's recurrent state).
    """
    reward = torch.as_tensor(rewards, dtype=torch.float32, device=device).clone()
    discount = gamma * (1.0 - torch.as_tensor(terminated, dtype=torch.float32, device=device))
    cut = np.flatnonzero(truncated & ~terminated)
    if len(cut):
        if final_values is None:
            final_values = values_of(model, torch.as_tensor(final_obs[cut], device=device))
        else:
            final_values = final_values[cut]
        reward[cut] += gamma * final_values.float()
        discount[cut] = 0.0
    return reward, discount
