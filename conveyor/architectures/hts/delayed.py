"""HTS-RL's learner step (Liu et al. 2020): the update from the data the previous parameters collected.

- ``delayed_update``: the one-step delayed gradient of A2C (eq. 6); ``lagged_ppo_update``: PPO's.
- ``acting_tensors``, ``copy_params``: the tensors that decide actions (theta_{t-1}, the acting
  parameters) and the copies between them, as ``conveyor.architectures.hts.run`` keeps them.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from conveyor.learner import Learner


@torch.no_grad()
def copy_params(targets: Iterable[Tensor], sources: Iterable[Tensor]) -> None:
    targets, sources = list(targets), list(sources)
    if len(targets) != len(sources):
        raise ValueError(f"copy_params: {len(targets)} targets for {len(sources)} sources")
    if targets:
        torch._foreach_copy_(targets, sources)  # one call for the list: the same copies as one by one


def acting_tensors(model: nn.Module) -> list[Tensor]:
    """What decides a model's actions: its parameters, then its buffers (the input statistics of
    ``normalize_obs``)."""
    return [*model.parameters(), *model.buffers()]


def delayed_update(learner: Learner, behaviour: list[Tensor], batch: dict[str, Tensor]) -> dict[str, float]:
    """One HTS-RL A2C update (eq. 6): theta_{t+1} = theta_t + step(g(theta_{t-1})), one optimizer step from
    theta_t with the gradient taken at the behaviour parameters theta_{t-1} (``behaviour``, in
    ``acting_tensors`` order) on the data they collected. The gradient is taken under the input statistics
    theta_{t-1} acted with; the learner's own statistics then take in the batch.
    """
    params, buffers = list(learner.model.parameters()), list(learner.model.buffers())
    version = learner.version
    current = [p.detach().clone() for p in params]
    statistics = [b.clone() for b in buffers]
    copy_params(params + buffers, behaviour)
    metrics = learner.update(batch)
    with torch.no_grad():  # theta_t + (the change the update made to theta_{t-1}): c + (p - b), tensor by tensor
        copy_params(params, torch._foreach_add(current, torch._foreach_sub(params, behaviour[:len(params)])))
    copy_params(buffers, statistics)  # the update folded the batch into theta_{t-1}'s statistics: redo it
    learner.observe(batch["obs"])
    learner.version = version + (learner.version > version)  # none if the step was skipped
    return metrics


def lagged_ppo_update(learner: Learner, batch: dict[str, Tensor], epochs: int, minibatches: int,
                      generator: torch.Generator, steps: bool) -> dict[str, float]:
    """One HTS-RL PPO update: PPO's ``epochs x minibatches`` steps from theta_t on the data theta_{t-1}
    collected, each ratio taken against the log-probs theta_{t-1} acted with, as the authors' code does
    (``learner.py`` of github.com/IouJenLiu/HTS-RL runs its PPO update on the current model). The clip then
    bounds the step from the policy that acted; eq. 6's form (the change PPO makes from theta_{t-1}, moved
    onto theta_t) would stack it on the previous round's change. One policy version, so the lag stays 1.
    ``steps``: minibatches of single steps (``Learner.update_epochs``; ``algos.ppo.epoch_batch`` says when).
    """
    version = learner.version
    metrics = learner.update_epochs(batch, epochs, minibatches, generator, steps=steps)
    learner.version = version + (learner.version > version)  # none if every step was skipped
    return metrics
