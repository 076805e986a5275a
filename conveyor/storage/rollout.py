"""Rollout storage: one ``[T, B]`` time-major block of transitions.

The storage owns its memory; the runner writes step ``t`` in place and the
learner reads the whole block as a batch dict (see DESIGN.md "Data
conventions"). New buffers are filled with marker values (NaN for floats,
-1 for integers, 0xAB for uint8) so that reading a step nobody wrote shows at
once, in ``unwritten_steps`` and in any loss it would poison.
"""

from __future__ import annotations

import torch
from torch import Tensor

UINT8_MARKER = 0xAB


def marker_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """A new tensor filled with the 'never written' marker of its dtype."""
    if dtype.is_floating_point:
        fill: float | int = float("nan")
    elif dtype == torch.uint8:
        fill = UINT8_MARKER
    elif dtype == torch.bool:
        fill = False
    else:
        fill = -1
    return torch.full(shape, fill, dtype=dtype, device=device)


class RolloutStorage:
    """``obs [T+1, B, ...]``, ``actions``, ``rewards``, ``discounts``, ``behaviour_logp``,
    ``behaviour_value [T+1, B]``, ``policy_version`` and ``valid`` for T steps of B envs.

    ``valid [T, B]`` (bool, true unless ``drop_step`` cleared it) is a mask, not data: it starts true.

    ``uniforms [T, B, ...]`` holds the per-step uniform numbers that picked the
    actions when the architecture samples by inverse CDF (HTS).
    """

    def __init__(self, T: int, B: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype,
                 action_shape: tuple[int, ...], action_dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.T, self.B = T, B
        self.obs = marker_tensor((T + 1, B, *obs_shape), obs_dtype, device)
        self.actions = marker_tensor((T, B, *action_shape), action_dtype, device)
        self.rewards = marker_tensor((T, B), torch.float32, device)
        self.discounts = marker_tensor((T, B), torch.float32, device)
        self.behaviour_logp = marker_tensor((T, B), torch.float32, device)
        self.behaviour_value = marker_tensor((T + 1, B), torch.float32, device)
        self.policy_version = marker_tensor((T, B), torch.int64, device)
        self.valid = torch.ones((T, B), dtype=torch.bool, device=device)

    def insert(self, t: int, obs: Tensor, actions: Tensor, logp: Tensor, value: Tensor, rewards: Tensor,
               discounts: Tensor, version: int | Tensor) -> None:
        self.obs[t].copy_(obs)
        self.actions[t].copy_(actions)
        self.behaviour_logp[t].copy_(logp)
        self.behaviour_value[t].copy_(value)
        self.rewards[t].copy_(rewards)
        self.discounts[t].copy_(discounts)
        self.valid[t] = True
        if isinstance(version, Tensor):
            self.policy_version[t].copy_(version)
        else:
            self.policy_version[t].fill_(version)

    def unwrite(self, envs: Tensor) -> None:
        """Put the marker values back into every step of env columns ``envs`` (their data is void)."""
        for tensor in (self.obs, self.actions, self.rewards, self.discounts, self.behaviour_logp,
                       self.behaviour_value, self.policy_version):
            tensor[:, envs] = marker_tensor((), tensor.dtype, tensor.device)
        self.valid[:, envs] = True

    def drop_step(self, t: int, envs: Tensor) -> None:
        """Step ``t`` of the envs ``envs`` ([B] bool) was lost (their worker died mid-step): mask it out of every
        loss, and make it return V(s_t) (reward V(s_t), discount 0) so the steps before it bootstrap from there,
        as at a truncation. Call after ``insert(t, ...)``."""
        self.valid[t, envs] = False
        self.rewards[t, envs] = self.behaviour_value[t, envs]
        self.discounts[t, envs] = 0.0

    def insert_last(self, obs: Tensor, value: Tensor | None = None) -> None:
        """The bootstrap observation ``obs[T]`` (and its behaviour value, when the algorithm uses it)."""
        self.obs[self.T].copy_(obs)
        if value is not None:
            self.behaviour_value[self.T].copy_(value)

    def batch(self) -> dict[str, Tensor]:
        return {
            "obs": self.obs,
            "actions": self.actions,
            "rewards": self.rewards,
            "discounts": self.discounts,
            "behaviour_logp": self.behaviour_logp,
            "behaviour_value": self.behaviour_value,
            "policy_version": self.policy_version,
            "valid": self.valid,
        }

    def unwritten_steps(self) -> int:
        """Transitions still holding the marker (a completed rollout has none)."""
        return int(torch.isnan(self.rewards).sum())


def env_columns(batch: dict[str, Tensor], columns: Tensor) -> dict[str, Tensor]:
    """The sub-batch of the env columns ``columns`` (time order kept; PPO minibatches)."""
    return {key: value.index_select(1, columns) if value.dim() >= 2 else value for key, value in batch.items()}
