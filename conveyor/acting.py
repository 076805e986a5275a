"""Acting helpers shared by every architecture that runs a policy on a batch.

``policy_step`` runs one batched forward and samples; ``step_targets``
turns an env step's flags into the training rewards and discounts of
DESIGN.md: ``discount = gamma * (1 - terminated)``, and at a truncated step
the bootstrap ``gamma * V(final_obs)`` is folded into the reward with
discount 0, so the return ops need no special case.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn


class Action(NamedTuple):
    actions: Tensor  # [B] int64 or [B, A] float
    logp: Tensor  # [B]
    value: Tensor  # [B]


@torch.no_grad()
def policy_step(model: nn.Module, obs: Tensor, generator: torch.Generator | None = None,
                uniform: Tensor | None = None) -> Action:
    """One forward on ``obs [B, ...]``; sample actions (by inverse CDF when ``uniform`` is given)."""
    out = model(obs.unsqueeze(0))
    params = out.params[0]
    actions = out.policy.sample(params, uniform, generator)
    return Action(actions, out.policy.log_prob(params, actions), out.value[0])


@torch.no_grad()
def values_of(model: nn.Module, obs: Tensor) -> Tensor:
    """V(obs) for ``obs [B, ...]``."""
    return model(obs.unsqueeze(0)).value[0]


def step_targets(model: nn.Module, rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
                 final_obs: np.ndarray | None, gamma: float, device: torch.device | str = "cpu",
                 final_values: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Training ``(rewards, discounts)`` ``[B]`` for one step, bootstrapping truncated episodes.

    Only the rows that were truncated (and not terminated) get a forward pass on
    their final observation. ``final_values`` ``[B]``, when given, is V(final_obs)
    already computed for every row, and ``final_obs`` is not read (HTS computes it
    in a fixed-size batch, so a row's value does not depend on which rows were cut).
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
