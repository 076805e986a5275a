"""Policy distributions and the model output every loss reads.

A policy family is stateless: it interprets a parameter tensor ``params``
(categorical: logits ``[..., A]``; diagonal Gaussian: ``[..., 2A]`` = mean and
log-std) and offers log-prob, entropy, KL and sampling. Sampling takes an
optional ``uniform`` tensor so that an external generator can fix the action
(HTS-RL executors send one uniform per step; the actor samples by inverse CDF).
Random numbers come from the ``generator``'s device (so a CPU generator can
serve a cuda model, drawing the same numbers as on a CPU run) and are moved
to the parameters' device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn import functional as F

from conveyor.transfer import to_device


def _draw(draw: Callable[..., Tensor], shape: torch.Size, generator: torch.Generator | None, like: Tensor) -> Tensor:
    """``draw`` (``torch.rand``/``torch.randn``) of ``shape`` from ``generator`` on its own device, on ``like``'s
    device and dtype."""
    device = like.device if generator is None else generator.device
    return to_device(draw(shape, generator=generator, device=device, dtype=like.dtype), like.device)


class Categorical:
    """Discrete actions; ``params`` are logits ``[..., A]``; actions are int64 ``[...]``."""

    discrete = True

    def __init__(self, num_actions: int) -> None:
        self.num_actions = num_actions
        self.param_size = num_actions

    def log_prob(self, params: Tensor, actions: Tensor) -> Tensor:
        return self._pick(F.log_softmax(params, dim=-1), actions)

    def log_prob_and_entropy(self, params: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
        """``log_prob`` and ``entropy`` from one log-softmax, which a loss that needs both (A2C) would otherwise
        compute and backpropagate twice."""
        logp = F.log_softmax(params, dim=-1)
        return self._pick(logp, actions), self._entropy(logp)

    @staticmethod
    def _pick(logp: Tensor, actions: Tensor) -> Tensor:
        """The log-probs ``logp [..., A]`` of ``actions [...]``."""
        index = actions if actions.dtype == torch.int64 else actions.long()
        return logp.gather(-1, index.unsqueeze(-1)).squeeze(-1)

    def probs(self, params: Tensor) -> Tensor:
        return F.softmax(params, dim=-1)

    def entropy(self, params: Tensor) -> Tensor:
        return self._entropy(F.log_softmax(params, dim=-1))

    @staticmethod
    def _entropy(logp: Tensor) -> Tensor:
        """The entropy of the log-probs ``logp [..., A]``."""
        return -(logp.exp() * logp).sum(-1)

    def kl(self, p_params: Tensor, q_params: Tensor) -> Tensor:
        """KL(p || q) per element ``[...]``."""
        logp = F.log_softmax(p_params, dim=-1)
        logq = F.log_softmax(q_params, dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1)

    def sample(self, params: Tensor, uniform: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Inverse-CDF sample: the first action whose cumulative probability reaches ``uniform`` ``[...]`` (the last
        action where rounding leaves every one below it)."""
        # (casts only where needed: a cast to the same dtype is still a dispatched op, of an acting step's few dozen)
        probs = self.probs(params if params.dtype == torch.float32 else params.float())
        if uniform is None:
            uniform = _draw(torch.rand, probs.shape[:-1], generator, probs)
        elif uniform.dtype != torch.float32:
            uniform = uniform.float()
        # the number of cumulative probabilities below the uniform: cdf never decreases, so that is the first index
        # where it reaches the uniform (one op, where a comparison and a bool sum take two slower ones); counted
        # among the first A - 1 only, so that rounding which leaves the total under the uniform picks the last
        # action without a clamp
        return torch.searchsorted(probs[..., :-1].cumsum(-1), uniform.unsqueeze(-1)).squeeze(-1)

    def mode(self, params: Tensor) -> Tensor:
        return params.argmax(-1)

    def action_shape(self) -> tuple[int, ...]:
        return ()


class DiagGaussian:
    """Continuous actions; ``params`` ``[..., 2A]`` = (mean, log_std); actions float ``[..., A]``."""

    discrete = False

    def __init__(self, action_dim: int) -> None:
        self.action_dim = action_dim
        self.param_size = 2 * action_dim

    def _split(self, params: Tensor) -> tuple[Tensor, Tensor]:
        mean, log_std = params.chunk(2, dim=-1)
        return mean, log_std.clamp(-20.0, 2.0)

    def log_prob(self, params: Tensor, actions: Tensor) -> Tensor:
        mean, log_std = self._split(params)
        z = (actions - mean) * torch.exp(-log_std)
        return (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def entropy(self, params: Tensor) -> Tensor:
        _, log_std = self._split(params)
        return (log_std + 0.5 * (1.0 + math.log(2 * math.pi))).sum(-1)

    def log_prob_and_entropy(self, params: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
        return self.log_prob(params, actions), self.entropy(params)

    def kl(self, p_params: Tensor, q_params: Tensor) -> Tensor:
        pm, pl = self._split(p_params)
        qm, ql = self._split(q_params)
        return (ql - pl + (torch.exp(2 * pl) + (pm - qm).pow(2)) / (2 * torch.exp(2 * ql)) - 0.5).sum(-1)

    def sample(self, params: Tensor, uniform: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Sample; ``uniform`` ``[..., A]`` in (0, 1) maps through the normal inverse CDF."""
        mean, log_std = self._split(params)
        if uniform is None:
            noise = _draw(torch.randn, mean.shape, generator, mean)
        else:
            u = uniform.to(mean.dtype).clamp(1e-7, 1 - 1e-7)
            noise = math.sqrt(2.0) * torch.erfinv(2 * u - 1)
        return mean + noise * log_std.exp()

    def mode(self, params: Tensor) -> Tensor:
        return self._split(params)[0]

    def action_shape(self) -> tuple[int, ...]:
        return (self.action_dim,)


PolicyFamily = Categorical | DiagGaussian


@dataclass
class ModelOut:
    """What a model returns for observations ``[T, B, ...]``.

    ``params``: policy parameters ``[T, B, P]``; ``value``: ``[T, B]``;
    ``q``: action values ``[T, B, A]`` for Q-learning heads (else None);
    ``state``: recurrent state after the last step (None without a core);
    ``features``: with gSDE, the policy trunk's features ``[T, B, F]`` (detached) that the state-dependent
    std is computed from and that acting multiplies with each env's noise matrix (else None).
    """

    policy: PolicyFamily
    params: Tensor
    value: Tensor
    state: Any = None
    q: Tensor | None = None
    features: Tensor | None = None

    def log_prob(self, actions: Tensor) -> Tensor:
        return self.policy.log_prob(self.params, actions)

    def entropy(self) -> Tensor:
        return self.policy.entropy(self.params)

    def log_prob_and_entropy(self, actions: Tensor) -> tuple[Tensor, Tensor]:
        return self.policy.log_prob_and_entropy(self.params, actions)

    def kl_from(self, other_params: Tensor) -> Tensor:
        """KL(other || self) per step, for the IMPACT target-network penalty."""
        return self.policy.kl(other_params, self.params)

    def sample(self, uniform: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        return self.policy.sample(self.params, uniform, generator)

    def time_slice(self, start: int, stop: int | None = None) -> "ModelOut":
        """The outputs for time steps ``start:stop`` (the state is not sliced)."""
        q = None if self.q is None else self.q[start:stop]
        return ModelOut(self.policy, self.params[start:stop], self.value[start:stop], self.state, q)

    @staticmethod
    def cat_envs(outs: list["ModelOut"]) -> "ModelOut":
        """Outputs of forwards on consecutive env columns of one step joined along the env axis (feed-forward:
        no state); one output is returned as it is."""
        if len(outs) == 1:
            return outs[0]
        q = None if outs[0].q is None else torch.cat([o.q for o in outs], 1)  # type: ignore[misc]
        return ModelOut(outs[0].policy, torch.cat([o.params for o in outs], 1), torch.cat([o.value for o in outs], 1),
                        None, q)

    @staticmethod
    def cat_time(outs: list["ModelOut"]) -> "ModelOut":
        """Outputs of consecutive forwards joined along time (the last one's state is kept)."""
        q = None if outs[0].q is None else torch.cat([o.q for o in outs])  # type: ignore[misc]
        return ModelOut(outs[0].policy, torch.cat([o.params for o in outs]), torch.cat([o.value for o in outs]),
                        outs[-1].state, q)
