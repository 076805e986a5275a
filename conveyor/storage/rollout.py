"""Rollout storage: one ``[T, B]`` time-major block of transitions.

The storage owns its memory; the runner writes step ``t`` in place and the
learner reads the whole block as a batch dict (see docs/design.md "Data
conventions"). Its fields come from a ``RolloutSchema`` and start as marker
values (``conveyor.storage.schema``), so that reading a step nobody wrote
shows at once, in ``unwritten_steps`` and in any loss it would poison.
"""

from __future__ import annotations

import torch
from torch import Tensor

from conveyor.storage.schema import RolloutSchema, marker_tensor

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool)
"""Field dtypes numpy shares memory with (``RolloutStorage``'s host-memory writes)."""

ROLLOUT_FIELDS = ("obs", "actions", "rewards", "discounts", "behaviour_logp", "behaviour_value", "policy_version")
"""What a synchronous rollout (PAAC, HTS) holds: the schema of a ``RolloutStorage`` names at least these, but
``behaviour_logp`` where no loss reads it (PAAC's A2C)."""


class RolloutStorage:
    """The ``schema``'s fields for T steps of B envs: ``obs [T+1, B, ...]``, ``actions``, ``rewards``,
    ``discounts``, ``behaviour_logp``, ``behaviour_value [T+1, B]``, ``policy_version`` and any extras.

    Each field is an attribute (``storage.rewards``) and an entry of ``batch()``. ``valid [T, B]`` (bool,
    true unless ``drop_step`` cleared it) is a mask, not data: it starts true, and ``batch()`` holds it only
    while some step is false.
    """

    def __init__(self, schema: RolloutSchema, T: int, B: int, device: torch.device | str = "cpu"):
        missing = [name for name in ROLLOUT_FIELDS if name not in schema.fields and name != "behaviour_logp"]
        if missing:
            raise ValueError(f"RolloutStorage needs the rollout fields {missing}: name them in its schema")
        starts = [name for name, spec in schema.fields.items() if spec.kind == "start"]
        if starts:  # every field here has its env axis second
            raise ValueError(f"RolloutStorage holds obs and step fields, not the start fields {starts}")
        self.T, self.B = T, B
        self.data = schema.tensors(T, B, device)
        self.valid = torch.ones((T, B), dtype=torch.bool, device=device)
        # In host memory, ``insert`` writes through numpy views of the same memory: a numpy row assignment costs
        # a fraction of a microsecond, torch's select and copy_ three, and it runs for every field at every step.
        self._host = None
        if torch.device(device).type == "cpu" and all(t.dtype in _NUMPY_DTYPES for t in self.data.values()):
            self._host = {name: tensor.numpy() for name, tensor in {**self.data, "valid": self.valid}.items()}

    def __getattr__(self, name: str) -> Tensor:
        try:
            return self.__dict__["data"][name]
        except KeyError:
            raise AttributeError(f"RolloutStorage has no field {name!r}") from None

    def insert(self, t: int, obs: Tensor, actions: Tensor, logp: Tensor | None, value: Tensor, rewards: Tensor,
               discounts: Tensor, version: int | Tensor, envs: slice = slice(None)) -> None:
        """Step ``t`` of the env columns ``envs`` (all by default; PAAC's env groups write theirs in turn);
        ``logp`` None exactly where the schema has no ``behaviour_logp``."""
        if (logp is None) == ("behaviour_logp" in self.data):
            raise ValueError("RolloutStorage.insert: pass logp exactly when the schema has behaviour_logp")
        # Indexed by t alone where every column is written (PAAC's one group passes slice(0, B)): it runs at every
        # env step, and a second index costs as much as the copy.
        at = t if envs.indices(self.B) == (0, self.B, 1) else (t, envs)
        fields = (("obs", obs), ("actions", actions), ("behaviour_value", value), ("rewards", rewards),
                  ("discounts", discounts), ("policy_version", version))
        if logp is not None:
            fields += (("behaviour_logp", logp),)
        host = self._host
        if host is not None:
            for name, given in fields:
                host[name][at] = given.numpy() if isinstance(given, Tensor) else given
            host["valid"][at] = True
            return
        for name, given in fields:
            if isinstance(given, Tensor):
                self.data[name][at].copy_(given)
            else:
                self.data[name][at].fill_(given)
        self.valid[at] = True

    def unwrite(self, envs: Tensor) -> None:
        """Put the marker values back into every step of env columns ``envs`` (their data is void)."""
        for tensor in self.data.values():
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
        """The fields, and ``valid`` where a step was dropped: a loss averages over a mask only when there is one
        to apply, since a masked mean's ops and their gradients cost a small model's A2C update ~10% (the means
        are the same to the bit where every step is valid)."""
        if bool(self._host["valid"].all() if self._host is not None else self.valid.all()):
            return dict(self.data)
        return {**self.data, "valid": self.valid}

    def unwritten_steps(self) -> int:
        """Transitions still holding the marker (a completed rollout has none)."""
        return int(torch.isnan(self.rewards).sum())


def env_columns(batch: dict[str, Tensor], columns: Tensor) -> dict[str, Tensor]:
    """The sub-batch of the env columns ``columns`` (time order kept; PPO minibatches)."""
    return {key: value.index_select(1, columns) if value.dim() >= 2 else value for key, value in batch.items()}


def step_samples(batch: dict[str, Tensor], steps: Tensor) -> dict[str, Tensor]:
    """The sub-batch of the single steps ``steps`` (flat indices into ``T x B``, time-major) as a ``[1, N]``
    batch (PPO minibatches of a feed-forward model). Fields with a bootstrap row (``obs``,
    ``behaviour_value``: ``T + 1`` rows) lose it, so only targets fixed beforehand can be trained on."""
    T, B = batch["rewards"].shape[:2]
    out = {}
    for key, value in batch.items():
        if value.dim() < 2:
            out[key] = value
            continue
        per_step = value[:T].reshape(T * B, *value.shape[2:])
        out[key] = per_step.index_select(0, steps).unsqueeze(0)
    return out
