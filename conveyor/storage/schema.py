"""The rollout schema: what a rollout holds, declared once for torch storage and shared memory alike.

Every architecture moves the same kinds of data from acting to learning
(docs/design.md "Data conventions"): observations, actions, training rewards and
discounts, what the behaviour policy computed, the parameter version that
acted. ``standard_fields`` names each kind once, with its shape and dtype
per env and step, given the observation's and the action's (the action's
come from the policy family: int64 ``[]`` for categorical, float32 ``[A]``
for Gaussian policies). An architecture builds one ``RolloutSchema`` from
its spaces and policy family, naming the standard fields it carries and
declaring any of its own as extras (R2D2's LSTM state). From that one
schema come

- torch storage: ``tensors(T, B)``, time-major ``[T(+1), B, ...]``
  (``RolloutStorage``), and ``fields`` for the per-env unroll buffers
  (``PartialUnrolls``, ``UnrollQueue``);
- shared memory: ``array_specs(slots, T, envs)``, ``[slots, T(+1), envs, ...]``
  (IMPACT's batch slots, GA3C's segments).

A field's time kind (``FieldSpec.kind``) says how many entries a rollout of
T steps holds:

- ``"obs"``: one per observation, ``T + 1`` (obs, episode starts, the
  behaviour value with its bootstrap V(s_T));
- ``"step"``: one per acting step, ``T`` (actions, rewards, log-probs);
- ``"start"``: one, at the rollout's first step (a recurrent state).

New storage is filled with marker values (NaN for floats, -1 for integers,
0xAB for uint8, False for bool), so that reading an entry nobody wrote shows
at once, in ``unwritten_steps`` and in any loss it would poison.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from conveyor.storage.shm import ArraySpec

UINT8_MARKER = 0xAB
FIELD_KINDS = ("obs", "step", "start")
STATE_KEYS = ("state_h", "state_c")
"""The fields of an LSTM core's state ``(h, c)`` at a rollout's first step (kind ``start``, ``[B, H]``)."""


def marker_value(dtype: torch.dtype) -> float | int | bool:
    """The 'never written' marker of ``dtype``."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.uint8:
        return UINT8_MARKER
    if dtype == torch.bool:
        return False
    return -1


def marker_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """A new tensor filled with the 'never written' marker of its dtype."""
    return torch.full(shape, marker_value(dtype), dtype=dtype, device=device)


def fill_marker(array: np.ndarray) -> None:
    """Fill a numpy array (shared memory) in place with the marker of its dtype."""
    values = torch.from_numpy(array)
    values.fill_(marker_value(values.dtype))


@dataclass(frozen=True)
class FieldSpec:
    """One field of a rollout: its shape and dtype per env and step, and its time kind (module docstring)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = "step"

    def __post_init__(self) -> None:
        if self.kind not in FIELD_KINDS:
            raise ValueError(f"unknown field kind {self.kind!r}: choose one of {', '.join(FIELD_KINDS)}")

    def time_dims(self, T: int) -> tuple[int, ...]:
        """The time axis of this field in a rollout of T steps: ``(T + 1,)``, ``(T,)`` or none."""
        return {"obs": (T + 1,), "step": (T,), "start": ()}[self.kind]

    @property
    def array_dtype(self) -> str:
        """The numpy dtype string of ``dtype`` (what an ``ArraySpec`` holds)."""
        return torch.empty((), dtype=self.dtype).numpy().dtype.str


def observation_field(space: Any) -> FieldSpec:
    """The ``obs`` field of a Box observation space."""
    return FieldSpec(tuple(space.shape), torch.from_numpy(np.zeros((), space.dtype)).dtype, "obs")


def action_field(family: Any) -> FieldSpec:
    """The ``actions`` field of a policy family (``conveyor.models.policy_family``)."""
    return FieldSpec(tuple(family.action_shape()), torch.int64 if family.discrete else torch.float32)


def standard_fields(obs: FieldSpec, action: FieldSpec) -> dict[str, FieldSpec]:
    """Every field name the architectures share, for observations ``obs`` and actions ``action``."""
    return {
        "obs": FieldSpec(obs.shape, obs.dtype, "obs"),
        # obs[t] starts an episode (a recurrent core resets there).
        "first": FieldSpec((), torch.bool, "obs"),
        "actions": FieldSpec(action.shape, action.dtype),
        # The training reward: at a truncated step gamma * V(final_obs) is folded in (and the discount is 0).
        "rewards": FieldSpec((), torch.float32),
        # gamma * (1 - terminated[t]); 0 at a truncated step.
        "discounts": FieldSpec((), torch.float32),
        # The env's reward as it came, for learners that fold the truncation bootstrap in themselves (GA3C):
        # with terminated, truncated and final_obs it makes rewards and discounts.
        "env_rewards": FieldSpec((), torch.float32),
        "terminated": FieldSpec((), torch.bool),
        "truncated": FieldSpec((), torch.bool),
        # The last observation of the episode that ended at step t (obs[t + 1] is the next one's first).
        "final_obs": FieldSpec(obs.shape, obs.dtype),
        "behaviour_logp": FieldSpec((), torch.float32),
        # V(s_t) under the acting parameters, V(s_T) the bootstrap.
        "behaviour_value": FieldSpec((), torch.float32, "obs"),
        # The learner's update count of the parameters that chose actions[t] (lag = learner version - this).
        "policy_version": FieldSpec((), torch.int64),
        # The unclipped return of the episode that ended at step t; NaN elsewhere.
        "episode_return": FieldSpec((), torch.float64),
        # A recurrent core's inputs besides obs: the action and reward before obs[t], zeros where first.
        "prev_action": FieldSpec(action.shape, action.dtype, "obs"),
        "prev_reward": FieldSpec((), torch.float32, "obs"),
    }


def state_fields(lstm_size: int) -> dict[str, FieldSpec]:
    """The extras holding an LSTM core's state of width ``lstm_size`` at a rollout's first step (``STATE_KEYS``);
    none for a feed-forward model (``lstm_size`` 0)."""
    return {name: FieldSpec((lstm_size,), torch.float32, "start") for name in STATE_KEYS} if lstm_size else {}


class RolloutSchema:
    """The fields one architecture's rollouts carry: standard ones by name, its own as ``extras``.

    ``fields`` keeps the order of ``names`` then ``extras``.
    """

    def __init__(self, obs: FieldSpec, action: FieldSpec, names: Iterable[str],
                 extras: Mapping[str, FieldSpec] | None = None) -> None:
        standard = standard_fields(obs, action)
        names, extras = tuple(names), dict(extras or {})
        unknown = [name for name in names if name not in standard]
        if unknown:
            raise ValueError(f"unknown rollout fields {unknown}: use names from {', '.join(standard)}, "
                             "or declare the field as an extra")
        clashing = sorted(extras.keys() & set(standard))
        if clashing:
            raise ValueError(f"extras {clashing} are standard rollout fields: name them instead of declaring them")
        self.fields: dict[str, FieldSpec] = {**{name: standard[name] for name in names}, **extras}

    @classmethod
    def build(cls, obs_space: Any, family: Any, names: Iterable[str],
              extras: Mapping[str, FieldSpec] | None = None) -> RolloutSchema:
        """The schema for a Box observation space and a policy family (``conveyor.models.policy_family``)."""
        return cls(observation_field(obs_space), action_field(family), names, extras)

    def tensors(self, T: int, B: int, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Marker-filled, time-major storage of T steps of B envs: ``[T + 1, B, ...]`` for ``obs`` fields,
        ``[T, B, ...]`` for ``step`` fields, ``[B, ...]`` for ``start`` fields."""
        return {name: marker_tensor((*spec.time_dims(T), B, *spec.shape), spec.dtype, device)
                for name, spec in self.fields.items()}

    def array_specs(self, slots: int, T: int, envs: int | None = None, prefix: str = "") -> list[ArraySpec]:
        """Shared-memory layout of ``slots`` rollouts of T steps: ``[slots, T (+ 1), envs, ...]`` per field
        (``[slots, envs, ...]`` for ``start`` fields; no env axis when ``envs`` is None), named
        ``prefix + name``."""
        env_dims = () if envs is None else (envs,)
        return [ArraySpec(prefix + name, (slots, *spec.time_dims(T), *env_dims, *spec.shape), spec.array_dtype)
                for name, spec in self.fields.items()]
