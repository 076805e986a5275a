"""Acting helpers shared by every architecture that runs a policy on a batch.

``policy_step`` runs one batched forward and samples; ``step_targets``
turns an env step's flags into the training rewards and discounts of
docs/design.md "Discounts and the truncation bootstrap":
``discount = gamma * (1 - terminated)``, and at a truncated step
the bootstrap ``gamma * V(final_obs)`` is folded into the reward with
discount 0, so the return ops need no special case.

A model with an LSTM core acts on ``CoreInputs`` besides the observations:
each env's state rows, whether its observation starts an episode, and its
previous action and reward. ``CoreCarry`` keeps them per env between steps
(IMPACT's workers; SEED's inference keeps its own per env slot), and
``forward_unrolls`` replays a batch of unrolls on the learner from the state
each one started from.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from conveyor.models.heads import ModelOut
from conveyor.storage.schema import STATE_KEYS
from conveyor.transfer import to_device


class CoreInputs(NamedTuple):
    """What an LSTM core reads for one step of B envs besides the observations (docs/design.md "Episode ends:
    first, terminated, truncated")."""

    state: tuple[Tensor, Tensor]  # (h, c) rows [B, H]: the state before this step
    first: Tensor | None  # bool [B]: the observation starts an episode (the state is reset there); None: never
    prev_action: Tensor  # [B(, A)]: the action before this observation, zeros where first
    prev_reward: Tensor  # float32 [B]: the env reward before this observation, zeros where first

    def rows(self, index: Any) -> CoreInputs:
        """The inputs of the envs ``index`` (a bool mask or indices)."""
        return CoreInputs(tuple(s[index] for s in self.state), None if self.first is None else self.first[index],
                          self.prev_action[index], self.prev_reward[index])  # type: ignore[arg-type]


class Action(NamedTuple):
    actions: Tensor  # [B] int64 or [B, A] float
    logp: Tensor | None  # [B]; None where ``policy_step`` was asked for none
    value: Tensor  # [B]
    out: ModelOut | None = None  # the forward's output with its autograd graph, when kept
    state: tuple[Tensor, ...] = ()  # with ``core``: the LSTM state rows (h, c) [B, H] after the step


def forward_step(model: nn.Module, obs: Tensor, core: CoreInputs | None = None) -> ModelOut:
    """The model on one step of B envs, ``obs [B, ...]`` (output ``[1, B, ...]``); a recurrent model reads
    ``core`` (moved to the observations' device), a feed-forward one only ``obs``."""
    if core is None:
        return model(obs.unsqueeze(0))
    device = obs.device
    state = tuple(s.to(device).unsqueeze(0) for s in core.state)
    first = None if core.first is None else core.first.to(device).unsqueeze(0)
    return model(obs.unsqueeze(0), state, first, core.prev_action.to(device).unsqueeze(0),
                 core.prev_reward.to(device).unsqueeze(0))


class GsdeNoise:
    """gSDE's exploration noise (Raffin et al. 2022, "Smooth Exploration for Robotic Reinforcement Learning",
    section 3), kept by whatever acts for a set of envs (``ModelCfg.gsde``).

    Env ``e`` acts ``mean(s) + phi(s) @ (sigma * N)``: ``phi(s)`` the model's features (``ModelOut.features``),
    sigma the acting model's ``exp(log_std)`` ``[F, A]`` and ``N`` ``[F, A]`` unit normals held for ``interval``
    steps of that env: the ``k``-th matrix of env ``e`` (its steps ``k * interval ..``) is drawn from a generator
    seeded by ``(*seed, e, k)`` alone, so the actions do not depend on how envs are batched, which thread or
    process acts, or on the order of requests. Given the state, the action is Gaussian with mean ``mean(s)``
    and variance ``phi(s)^2 @ sigma^2``, the distribution whose log-prob the model's ``params`` give.

    ``actions(model, params, features, envs)`` counts a step of each env in ``envs``; HTS passes the step
    indices itself (``steps``). ``steps_state``/``load_steps`` keep the counts in a checkpoint. Threads may
    act for disjoint envs at once (HTS's actors): the tables grow and the counts move under a lock.
    """

    def __init__(self, seed: int | tuple[int, ...], interval: int) -> None:
        self.seed = tuple(int(s) for s in seed) if isinstance(seed, tuple) else (int(seed),)
        self.interval = int(interval)
        self._steps: dict[int, int] = {}  # env -> steps counted
        self._drawn_k = np.zeros(0, np.int64)  # [envs seen]: the k of each env's matrix in _normals, -1: none yet
        self._normals = torch.zeros(0)  # [envs seen, F, A]
        self._lock = threading.Lock()

    def unit_normals(self, envs: np.ndarray, steps: np.ndarray, shape: tuple[int, int]) -> Tensor:
        """The unit normals ``[B, F, A]`` that env ``envs[i]`` acts with at its step ``steps[i]``."""
        envs, k = np.asarray(envs, np.int64), np.asarray(steps, np.int64) // self.interval
        with self._lock:
            return self._unit_normals(envs, k, shape)

    def _unit_normals(self, envs: np.ndarray, k: np.ndarray, shape: tuple[int, int]) -> Tensor:
        """``unit_normals`` of the matrix indices ``k``; the caller holds the lock."""
        if len(envs) and envs.max() >= len(self._drawn_k):  # room for the new env indices
            size = int(envs.max()) + 1
            normals = torch.zeros(size, *shape)
            if len(self._drawn_k):
                normals[:len(self._drawn_k)] = self._normals
            self._normals = normals
            self._drawn_k = np.concatenate([self._drawn_k, np.full(size - len(self._drawn_k), -1, np.int64)])
        stale = self._drawn_k[envs] != k
        for env, index in zip(envs[stale].tolist(), k[stale].tolist()):
            normals = np.random.default_rng((*self.seed, env, index)).standard_normal(shape, dtype=np.float32)
            self._normals[env] = torch.from_numpy(normals)
            self._drawn_k[env] = index
        return self._normals[torch.from_numpy(envs)]

    def actions(self, model: nn.Module, params: Tensor, features: Tensor, envs: Any,
                steps: np.ndarray | None = None) -> Tensor:
        """Actions ``[B, A]`` for one step of ``envs`` ``[B]`` from the policy ``params`` ``[B, 2A]`` and the
        ``features`` ``[B, F]`` of ``model``'s output; ``steps`` ``[B]``: each env's step index (None: the
        count kept here, advanced by one)."""
        envs = np.asarray(envs, dtype=np.int64).reshape(-1)
        if steps is None:
            with self._lock:
                steps = np.array([self._steps.get(env, 0) for env in envs.tolist()], dtype=np.int64)
                for env, step in zip(envs.tolist(), steps.tolist()):
                    self._steps[env] = step + 1
        sigma = model.log_std.detach().exp()
        noise = to_device(self.unit_normals(envs, steps, tuple(sigma.shape)), sigma.device) * sigma
        # elementwise product and sum, not a batched matmul: a row's numbers do not depend on the batch
        return model.policy.mode(params) + (features.unsqueeze(-1) * noise).sum(1)

    @classmethod
    def for_model(cls, cfg: Any, seed: int | tuple[int, ...]) -> GsdeNoise | None:
        """The noise a model of ``cfg`` (``ModelCfg``) acts with: None unless ``cfg.gsde``."""
        return cls(seed, cfg.gsde_interval) if cfg.gsde else None

    def steps_state(self) -> dict[int, int]:
        """Each env's step count, for a checkpoint."""
        return dict(self._steps)

    def load_steps(self, steps: dict[int, int]) -> None:
        """Continue the step counts of ``steps_state`` (a resumed run)."""
        self._steps = {int(env): int(step) for env, step in steps.items()}


def policy_step(model: nn.Module, obs: Tensor, generator: torch.Generator | None = None,
                uniform: Tensor | None = None, keep_graph: bool = False, core: CoreInputs | None = None,
                rows: tuple[int, int] | None = None, gsde: GsdeNoise | None = None, envs: Any = None,
                logp: bool = True) -> Action:
    """One forward on ``obs [B, ...]`` (with ``core``, a recurrent model's other inputs); sample actions (by
    inverse CDF when ``uniform`` is given; a gSDE model's from ``gsde``'s noise of ``envs`` ``[B]``, the
    acting envs' indices). Without ``logp`` the action's ``logp`` is None: a learner that reads no behaviour
    log-probs (A2C) saves their ops.

    ``keep_graph`` returns the output ``[1, B, ...]`` with its autograd graph, so a learner whose
    parameters do not change during the rollout (PAAC A2C) can backpropagate through the acting
    forward instead of computing it a second time.

    ``rows = (first, total)``: ``obs`` are rows ``first ..`` of a batch of ``total`` envs split over processes
    (data-parallel ranks): the draw is made for the whole batch and these rows keep theirs, so each env's
    action is the one a single process stepping all ``total`` envs would sample.
    """
    # Without a graph to keep, all in inference mode: its ops skip autograd's bookkeeping and the version
    # counters, a microsecond or two of each of the step's few dozen small ops. (With one, only the forward's
    # graph is kept: what follows reads detached params.)
    with torch.enable_grad() if keep_graph else torch.inference_mode():
        out = None
        if keep_graph or core is not None or not getattr(model, "acts_on_rows", False):
            out = forward_step(model, obs, core)
            params, value = out.params[0].detach(), out.value[0].detach()
        else:  # the same numbers without the [T, B] shapes, which cost a small model's step more than its matmuls
            params, value = model.act_rows(obs)
        if out is not None and out.features is not None:
            if gsde is None:
                raise ValueError("a gSDE model acts with its envs' noise: pass gsde= and envs= to policy_step")
            actions = gsde.actions(model, params, out.features[0], envs)
        elif rows is None:
            actions = model.policy.sample(params, uniform, generator)
        else:
            first, total = rows
            whole = params.new_zeros((total, *params.shape[1:]))
            whole[first:first + len(params)] = params
            actions = model.policy.sample(whole, uniform, generator)[first:first + len(params)]
        state = () if core is None else tuple(s[0].detach() for s in out.state)
        return Action(actions, model.policy.log_prob(params, actions) if logp else None, value,
                      out if keep_graph else None, state)


class SharedDraw:
    """One draw per step for a batch acted on in ``parts`` (PAAC's env groups, each with ``policy_step(rows=...)``
    over the whole batch): ``generator(part)`` is the sampler as it stood when part 0 of the step took it, so every
    part samples its rows of one whole-batch draw, and the sampler ends the step one draw on. Each env's action is
    then the one a single forward over the whole batch would sample."""

    def __init__(self, generator: torch.Generator, parts: int) -> None:
        self._generator, self._parts = generator, parts
        self._state: Tensor | None = None

    def generator(self, part: int) -> torch.Generator:
        if self._parts > 1:
            if part == 0:
                self._state = self._generator.get_state()
            else:
                self._generator.set_state(self._state)
        return self._generator


def pipelined_steps(groups: int, steps: int) -> Iterator[tuple[str, int, int]]:
    """The order in which ``groups`` env groups take ``steps`` steps, overlapping one group's env step with the
    others' forwards (Sample Factory's double-buffered sampling): ``("act", t, g)``, run the policy on group
    ``g``'s observations of step ``t`` and send its actions; ``("wait", t, g)``, take group ``g``'s step ``t``.
    A group waits for its step ``t`` just before it acts on step ``t + 1``, so while it waits and acts the next
    group's envs step; every step ends before the last event. One group: act, wait, act, wait, ..."""
    for t in range(steps):
        for g in range(groups):
            if t:
                yield "wait", t - 1, g
            yield "act", t, g
    for g in range(groups):
        yield "wait", steps - 1, g


@torch.no_grad()
def values_of(model: nn.Module, obs: Tensor, core: CoreInputs | None = None) -> Tensor:
    """V(obs) for ``obs [B, ...]`` (with ``core``, a recurrent model's other inputs)."""
    return forward_step(model, obs, core).value[0]


def forward_unrolls(model: nn.Module, batch: dict[str, Tensor], state: tuple[Tensor, Tensor] | None = None) -> ModelOut:
    """The model on a batch of unrolls, all of ``batch["obs"]`` ``[T + 1, B, ...]``. A recurrent model replays
    them from the state each one started from (``state`` ``(h, c)`` ``[1, B, H]``, else the batch's
    ``state_h``, ``state_c`` ``[B, H]``), reset where ``first``, reading ``prev_action`` and ``prev_reward``:
    what acted, step for step. A feed-forward model reads only ``obs``."""
    if not getattr(model, "lstm_size", 0):
        return model(batch["obs"])
    if state is None:
        state = tuple(batch[key].unsqueeze(0) for key in STATE_KEYS)  # type: ignore[assignment]
    return model(batch["obs"], state, batch["first"], batch["prev_action"], batch["prev_reward"])


class CoreCarry:
    """Per env, what a recurrent core carries from one step to the next (``inputs``), kept by whatever acts
    for B envs step after step: the state rows, whether the next observation starts an episode, the
    previous action and reward. All start as at an episode's start."""

    def __init__(self, model: nn.Module, num_envs: int) -> None:
        h, c = model.initial_state(num_envs)
        self.initial = (h[0], c[0])
        self.action_shape = tuple(model.policy.action_shape())
        self.action_dtype = torch.int64 if model.policy.discrete else torch.float32
        self.state = (h[0].clone(), c[0].clone())
        self.first = torch.ones(num_envs, dtype=torch.bool)
        self.prev_action = torch.zeros(num_envs, *self.action_shape, dtype=self.action_dtype)
        self.prev_reward = torch.zeros(num_envs)

    def inputs(self) -> CoreInputs:
        """The core's inputs for the next step."""
        return CoreInputs(self.state, self.first, self.prev_action, self.prev_reward)

    def after(self, act: Action, rewards: Any) -> CoreInputs:
        """The inputs that continue each env's episode after ``act`` and its env ``rewards`` [B] (what the
        value of a truncated episode's final observation is computed from)."""
        return CoreInputs(act.state, None, act.actions.to(self.action_dtype),  # type: ignore[arg-type]
                          torch.as_tensor(rewards, dtype=torch.float32))

    def advance(self, act: Action, rewards: Any, ended: Any) -> None:
        """The step ``act`` was taken and the envs returned ``rewards`` [B]; ``ended`` [B] envs start a new
        episode with their next observation (state, previous action and reward reset there)."""
        after = self.after(act, rewards)
        ended = torch.as_tensor(ended, dtype=torch.bool)
        keep = ~ended
        self.state = tuple(torch.where(keep.unsqueeze(1), s, init)  # type: ignore[assignment]
                           for s, init in zip(after.state, self.initial))
        self.prev_action = after.prev_action * keep.view(-1, *([1] * len(self.action_shape))).to(self.action_dtype)
        self.prev_reward = after.prev_reward * keep
        self.first = ended


def step_targets(model: nn.Module | None, rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
                 final_obs: np.ndarray | None, gamma: float, device: torch.device | str = "cpu",
                 final_values: Tensor | None = None, core: CoreInputs | None = None) -> tuple[Tensor, Tensor]:
    """Training ``(rewards, discounts)`` ``[B]`` for one step, bootstrapping truncated episodes.

    Only the rows that were truncated (and not terminated) get a forward pass on
    their final observation (a recurrent model's with ``core``, the inputs that continue
    each row's episode: ``CoreCarry.after``). ``final_values`` ``[B]``, when given, is V(final_obs)
    already computed for every row, and neither ``model`` nor ``final_obs`` is read (HTS
    computes it in a fixed-size batch, so a row's value does not depend on which rows were
    cut; SEED's needs each env's recurrent state).
    """
    # In numpy, then one copy each to the device: a few 16-element torch ops cost more than the whole step.
    # float32 throughout (NumPy 2 keeps a Python float weak), so the numbers are those of the same ops in torch.
    reward = np.array(rewards, dtype=np.float32)  # a copy: the caller's array stays
    discount = np.where(terminated, np.float32(0.0), np.float32(gamma))  # gamma * (1 - terminated), in one op
    cut = np.flatnonzero(truncated & ~terminated) if truncated.any() else ()
    if len(cut):
        if final_values is None:
            rows = None if core is None else core.rows(torch.as_tensor(cut))
            final_values = values_of(model, to_device(final_obs[cut], device), rows)
        else:
            final_values = final_values[cut]
        reward[cut] += gamma * final_values.float().cpu().numpy()
        discount[cut] = 0.0
    return to_device(reward, device), to_device(discount, device)
