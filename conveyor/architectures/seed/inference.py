"""SEED's central inference: env rows in, actions out, every env's state kept on the learner.

``CentralInference.process`` is what the ``Batcher`` calls with the steps of
many actors. For each batch it closes each env's previous transition
(reward, discount ``gamma * (1 - terminated)``, and at a truncated step
``gamma * V(final_obs)`` folded into the reward with discount 0, as
``acting.step_targets`` does for vector envs), appends the new observation
to the env's partial unroll (``storage.unrolls.PartialUnrolls``), runs the
policy once on all rows with each env's recurrent state, records the
action, the policy's per-step values and the learner version that acted,
and returns each request its own actions. Finished unrolls go to a sink.

Counting (the run's ``env_steps``): a step counts once the sink has stored
an unroll holding it and before the learner can take it (``on_steps(n)``
from the sink's ``on_stored``: a ``CountedSink``), never when it is acted.
So with V-trace ``env_steps`` equals the transitions handed to the learner's
unroll queue, and every one it trains on was counted before the run's stop
decision (counted after the put returned, a batch trained meanwhile could
hold steps that then counted as after the stop). With ``overlap`` (R2D2) a sequence's first
``overlap`` steps were already counted with the sequence before it, so
``env_steps`` counts distinct acted steps stored in replay (each is stored
about ``T / (T - overlap)`` times; what is trained depends on the replay
ratio). When an env's stream ends (``release``: its actor died,
disconnected or stalled past the server's deadline) or it continues under
another run id (a discontinuity), its partial unroll is dropped, never
emitted; its acted steps that no emitted unroll held are counted as
``dropped_steps`` (``release`` returns them). Finished episodes' returns
are reported as they arrive (``on_episodes``).

Reconnects (episode accounting): an actor computes its episodes' returns
itself and keeps its envs, their episodes and run ids across a reconnect
(``actor``), so an episode it continues on a new stream ends with its whole
return, never a fragment. The learner matches a stream's first Step
(``EnvSteps.stream_start``) to the same actor's previous stream (same
``actor`` name, env rows in order): a row whose run id the previous stream
had in progress continues that episode (``episodes_resumed``; the policy
still sees it as ``first``: the learner dropped its recurrent state and
partial unroll). The first Step also carries again the returns of the
actor's last Step that got no reply: a return the learner already counted
(it had the row's next run id) is dropped, one it never received is
counted now (``episode_returns_recovered``). An episode in progress when
its stream ended that no later stream of its actor continues (the actor
process died or was restarted, rebuilt its envs, or has not come back) is
cut: never reported as a return (so never in ``return_mean_last100``) and
counted in ``episodes_cut``. The count is provisional while the actor may
still come back: it includes the episodes of actors disconnected when the
run ends. The previous streams of the last ``_MAX_DETACHED_ACTORS`` actors
are kept (at most ``_MAX_DETACHED_ROWS`` env rows); an older one's
episodes stay counted as cut.

Extension points (R2D2 plugs in here):

- the ``Policy``: what acts. V-trace samples from the actor-critic and keeps
  behaviour log-probs (``ActorCriticPolicy``). R2D2
  takes epsilon-greedy actions with ``eps_i = 0.4 ** (1 + 7 i / (N - 1))``
  for env slot ``i`` (``ActInput.slots``) and gives ``bootstrap_values`` from
  its Q-values. A policy whose model has an LSTM core (R2D2's always, V-trace's
  with ``--lstm-size``; ``LearnerPolicy``) declares its state in
  ``state_fields`` with ``initial_state`` and reads ``ActInput.first``,
  ``prev_action``, ``prev_reward``: every unroll then stores them and the
  state it started from, which the learner replays it from
  (``acting.forward_unrolls``);
- the unroll sink: V-trace ``UnrollQueue.put``; R2D2 inserts the sequence
  (``obs``, ``actions``, ``rewards``, ``discounts``, ``first``,
  ``prev_action``, ``prev_reward``, start state) into replay;
- ``overlap``: consecutive sequences share that many steps (R2D2: 40 of 80).
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol

import numpy as np
import torch
from torch import Tensor

from conveyor.acting import CoreInputs, GsdeNoise, policy_step, step_targets, values_of
from conveyor.learner import Learner
from conveyor.storage.schema import FieldSpec, RolloutSchema, action_field, state_fields
from conveyor.storage.unrolls import CountedSink, PartialUnrolls, Unroll
from conveyor.architectures.seed.batcher import EnvSteps, InferenceStats

_MAX_DETACHED_ACTORS = 4096
"""Actors whose ended stream's episodes are remembered for a reconnect (the oldest are forgotten)."""
_MAX_DETACHED_ROWS = 65536
"""Env rows of all remembered ended streams together."""


@dataclass
class ActInput:
    """What the policy sees for B env rows (CPU tensors)."""

    slots: Tensor  # int64 [B]: env slot ids (R2D2: per-env epsilon)
    obs: Tensor  # [B, *obs_shape]
    first: Tensor  # bool [B]: obs starts an episode (a recurrent core starts from initial_state)
    prev_action: Tensor  # [B, *action_shape], zeros where first
    prev_reward: Tensor  # float32 [B], zeros where first
    state: tuple[Tensor, ...] = ()  # recurrent state rows [B, ...] (already reset where first)


@dataclass
class ActOutput:
    actions: Tensor  # [B, *action_shape]
    version: int  # learner version of the parameters that acted
    extras: dict[str, Tensor] = field(default_factory=dict)  # per-step values named in Policy.step_fields
    state: tuple[Tensor, ...] = ()  # recurrent state after the step


class Policy(Protocol):
    """What acts inside ``CentralInference`` (the pluggable part; see the module docstring)."""

    action_spec: FieldSpec
    """Shape and dtype of one env's action."""
    step_fields: tuple[str, ...]
    """Rollout fields (``conveyor.storage.schema`` names) of the per-step values ``act`` returns in ``extras``
    and the unrolls store (V-trace: behaviour_logp)."""
    state_fields: dict[str, FieldSpec]
    """Recurrent state tensors per env, in ``ActInput.state`` order (kind ``start``); empty without a core."""

    def initial_state(self, n: int) -> tuple[Tensor, ...]: ...

    def act(self, inputs: ActInput) -> ActOutput: ...

    def bootstrap_values(self, inputs: ActInput) -> Tensor:
        """``[B]`` value of the final observations ``inputs.obs`` of truncated episodes."""
        ...


class LearnerPolicy:
    """What the policies acting with the learner's own model share (V-trace's, R2D2's): the model, the lock that
    keeps acting forwards off parameters mid-update, the action spec, and for a model with an LSTM core the
    state each env slot carries (``state_fields``, ``initial_state``) and the core's inputs (``core``)."""

    def __init__(self, learner: Learner, lock: Any) -> None:
        self.learner = learner
        self.lock = lock
        self.lstm_size = learner.model.lstm_size
        self.action_spec = action_field(learner.model.policy)
        self.state_fields = state_fields(self.lstm_size)

    def initial_state(self, n: int) -> tuple[Tensor, ...]:
        return tuple(torch.zeros(n, self.lstm_size) for _ in self.state_fields)

    def core(self, inputs: ActInput, reset: bool = True) -> CoreInputs | None:
        """The core's inputs besides the observations (None without a core); ``reset`` False ignores ``first``
        (a truncated episode's final observation continues its episode)."""
        if not self.state_fields:
            return None
        return CoreInputs(inputs.state, inputs.first if reset else None,  # type: ignore[arg-type]
                          inputs.prev_action, inputs.prev_reward)


class ActorCriticPolicy(LearnerPolicy):
    """V-trace acting on the learner: sample from the learner's own model, keep behaviour log-probs; a model
    with an LSTM core acts from each env slot's state (``CentralInference`` keeps it and stores it at each
    unroll's start)."""

    step_fields = ("behaviour_logp",)

    def __init__(self, learner: Learner, lock: Any, seed: int, gsde: GsdeNoise | None = None) -> None:
        """``gsde``: a gSDE model's noise, one matrix per env slot."""
        super().__init__(learner, lock)
        self.generator = torch.Generator(device=learner.device).manual_seed(seed)
        self.gsde = gsde

    def act(self, inputs: ActInput) -> ActOutput:
        obs = inputs.obs.to(self.learner.device)
        with self.lock:
            version = self.learner.version
            action = policy_step(self.learner.model, obs, self.generator, core=self.core(inputs), gsde=self.gsde,
                                 envs=inputs.slots)
        return ActOutput(action.actions, version, {"behaviour_logp": action.logp},
                         tuple(s.cpu() for s in action.state))

    def bootstrap_values(self, inputs: ActInput) -> torch.Tensor:
        with self.lock:
            return values_of(self.learner.model, inputs.obs.to(self.learner.device), self.core(inputs, False))


UNROLL_FIELDS = ("obs", "first", "actions", "rewards", "discounts", "policy_version")
"""What every unroll stores, whatever the policy."""


def unroll_schema(policy: Policy, obs_spec: FieldSpec) -> RolloutSchema:
    """Everything an unroll stores for ``policy``: ``UNROLL_FIELDS``, the policy's step fields, and with a
    recurrent state the core's other inputs and the state itself."""
    recurrent_inputs = ("prev_action", "prev_reward") if policy.state_fields else ()
    return RolloutSchema(obs_spec, policy.action_spec, (*UNROLL_FIELDS, *policy.step_fields, *recurrent_inputs),
                         policy.state_fields)


def _grow_rows(tensor: Tensor, rows: int, fill: float | int | bool) -> Tensor:
    if rows <= tensor.shape[0]:
        return tensor
    grown = torch.full((max(rows, 2 * tensor.shape[0]), *tensor.shape[1:]), fill, dtype=tensor.dtype)
    grown[: tensor.shape[0]] = tensor
    return grown


class CentralInference:
    """``process`` of the SEED batcher: env rows in, actions out, unrolls to ``sink``. Runs on the
    inference thread only (slot state is not locked)."""

    def __init__(self, policy: Policy, obs_spec: FieldSpec, unroll: int, gamma: float, sink: CountedSink, *,
                 overlap: int = 0, stats: InferenceStats | None = None,
                 on_steps: Callable[[int], None] | None = None,
                 on_episodes: Callable[[np.ndarray], None] | None = None,
                 timer: Callable[[str], ContextManager[Any]] | None = None) -> None:
        self.policy = policy
        self.gamma = gamma
        self.sink = sink
        self.unrolls = PartialUnrolls(unroll, unroll_schema(policy, obs_spec).fields, self._emit, overlap=overlap)
        self.stats = stats or InferenceStats()
        self.on_steps = on_steps
        """``on_steps(n)``: the sink stored an unroll holding n new acted steps (see the module docstring)."""
        self.on_episodes = on_episodes
        """``on_episodes(returns)``: per env row of a batch, the return of an episode that ended there, else NaN."""
        self.timer = timer or (lambda bucket: contextlib.nullcontext())
        action = policy.action_spec
        # Per slot: acted and waiting for its reward; run id of its episode; last action; recurrent state.
        self.pending = torch.zeros(0, dtype=torch.bool)
        self.run_id = torch.zeros(0, dtype=torch.int64)
        self.last_action = torch.zeros((0, *action.shape), dtype=action.dtype)
        self.state = tuple(torch.zeros((0, *spec.shape), dtype=spec.dtype) for spec in policy.state_fields.values())
        # Per slot: leading steps of its partial unroll that an emitted unroll already held (0 or overlap).
        self.emitted = torch.zeros(0, dtype=torch.int64)
        # Reconnects (see the module docstring): the slots of each named actor's latest stream, by actor and by
        # first slot; the run id per env row (-1: none) of the episodes in progress when an actor's stream ended.
        self.actor_slots: dict[str, Tensor] = {}
        self.slot_actor: dict[int, str] = {}
        self.detached: collections.OrderedDict[str, Tensor] = collections.OrderedDict()
        self.detached_rows = 0

    def _emit(self, slot: int, unroll: Unroll) -> None:
        """``PartialUnrolls``' sink: a full unroll to ``sink``, its steps not counted before (all but the overlap
        an earlier unroll of the slot held) counted when the sink has stored it."""
        steps = int(self.unrolls.T - self.emitted[slot])
        self.emitted[slot] = self.unrolls.overlap
        self.sink(slot, unroll, lambda: self.on_steps(steps) if self.on_steps is not None else None)

    def _grow(self, rows: int) -> None:
        self.unrolls.grow(rows)
        self.emitted = _grow_rows(self.emitted, rows, 0)
        self.pending = _grow_rows(self.pending, rows, False)
        self.run_id = _grow_rows(self.run_id, rows, -1)
        self.last_action = _grow_rows(self.last_action, rows, 0)
        self.state = tuple(_grow_rows(s, rows, 0) for s in self.state)

    def release(self, slots: list[int]) -> int:
        """Forget the slots (their stream ended): drop their partial unrolls and state. Returns the
        dropped steps (acted, never handed to the sink)."""
        index = torch.tensor(slots, dtype=torch.int64)
        self._grow(int(index.max()) + 1 if len(slots) else 0)
        if len(slots):
            self._detach(int(slots[0]))
        return self._drop(index)

    # ---- reconnects ----------------------------------------------------------------------------
    def _in_progress(self, slots: Tensor) -> Tensor:
        """Per slot, the run id of its episode in progress; -1 where the learner has none."""
        return torch.where(self.pending[slots], self.run_id[slots], torch.full_like(slots, -1))

    def _detach(self, first_slot: int) -> None:
        """The stream starting at ``first_slot`` ended: remember its actor's episodes in progress (counted as
        cut until a later stream of the actor continues them)."""
        name = self.slot_actor.pop(first_slot, None)
        if name is None or name not in self.actor_slots or int(self.actor_slots[name][0]) != first_slot:
            return
        open_runs = self._in_progress(self.actor_slots.pop(name))
        in_progress = int((open_runs >= 0).sum())
        if not in_progress:
            return
        self.stats.count("episodes_cut", in_progress)
        self._forget_detached(name)
        self.detached[name] = open_runs
        self.detached_rows += len(open_runs)
        while len(self.detached) > _MAX_DETACHED_ACTORS or self.detached_rows > _MAX_DETACHED_ROWS:
            self._forget_detached(next(iter(self.detached)))  # the oldest: its episodes stay cut

    def _forget_detached(self, name: str) -> Tensor | None:
        runs = self.detached.pop(name, None)
        if runs is not None:
            self.detached_rows -= len(runs)
        return runs

    def _resume(self, request: EnvSteps) -> np.ndarray:
        """The episode returns of a stream's first Step to report, matched against its actor's previous stream
        (see the module docstring); registers the stream as its actor's latest."""
        returns = request.episode_return
        name = request.actor
        if not name:
            return returns
        slots = torch.tensor(request.env_ids, dtype=torch.int64)  # a copy: decoded arrays are read-only
        previous = self.actor_slots.pop(name, None)
        counted = False  # whether the previous stream's episodes in progress are already counted as cut
        if previous is not None:  # its stream is still open here (its end not yet seen) or not yet released
            self.slot_actor.pop(int(previous[0]), None)
            open_runs = self._in_progress(previous)
        else:
            open_runs = self._forget_detached(name)
            counted = True
        self.actor_slots[name] = slots
        self.slot_actor[int(slots[0])] = name
        if open_runs is None:
            return returns
        known = open_runs >= 0
        in_progress = int(known.sum())
        if len(open_runs) != len(slots):  # not the same actor's envs: nothing continues
            if not counted:
                self.stats.count("episodes_cut", in_progress)
            return returns
        run_ids = torch.tensor(request.run_ids, dtype=torch.int64)
        ended = torch.from_numpy(~np.isnan(returns))
        same = known & (open_runs == run_ids)  # the learner has this row's current episode: it continues
        recovered = known & ~same & ended  # the episode in progress ended in a Step the learner never got
        cut = known & ~same & ~ended
        duplicate = same & ended  # the learner got the Step that ended the previous episode: counted then
        returns = returns.copy()
        returns[duplicate.numpy()] = np.nan
        cuts = int(cut.sum())
        self.stats.count("episodes_cut", cuts - in_progress if counted else cuts)
        if same.any():
            self.stats.count("episodes_resumed", int(same.sum()))
        if recovered.any():
            self.stats.count("episode_returns_recovered", int(recovered.sum()))
        return returns

    def _drop(self, slots: Tensor) -> int:
        unemitted = (self.unrolls.cursor[slots] - self.emitted[slots]).clamp(min=0)
        self.unrolls.reset(slots)
        self.emitted[slots] = 0
        steps = int(unemitted.sum())
        if steps:
            self.stats.count("partial_unrolls_dropped", int((unemitted > 0).sum()))
            self.stats.count("dropped_steps", steps)
        self.pending[slots] = False
        self.run_id[slots] = -1
        self.last_action[slots] = 0
        if self.state:
            for table, init in zip(self.state, self.policy.initial_state(len(slots))):
                table[slots] = init
        return steps

    def process(self, requests: list[EnvSteps]) -> list[np.ndarray]:
        with self.timer("act"):
            actions = self._step(requests)
        out = actions.numpy()
        bounds = np.cumsum([len(r.env_ids) for r in requests])[:-1]
        return np.split(out, bounds)

    def _step(self, requests: list[EnvSteps]) -> Tensor:
        def cat(name: str) -> Tensor:
            return torch.from_numpy(np.concatenate([getattr(r, name) for r in requests]))

        slots = cat("env_ids")
        self._grow(int(slots.max()) + 1)
        run_ids, obs = cat("run_ids"), cat("obs")
        reward, terminated, truncated = cat("reward").float(), cat("terminated"), cat("truncated")
        final_obs = cat("final_obs")
        ended = terminated | truncated
        pending = self.pending[slots]
        # A step that continues an episode under a different run id: the actor lost or restarted it.
        broken = pending & ~ended & (run_ids != self.run_id[slots])
        if broken.any():
            self.stats.count("discontinuities", int(broken.sum()))
            self._drop(slots[broken])
            pending = pending & ~broken

        # 1. Close each slot's previous transition: discount = gamma (1 - terminated), and a truncated
        #    step gets gamma * V(final_obs) in its reward and discount 0 (docs/design.md "Discounts and
        #    the truncation bootstrap").
        #    V(final_obs) needs the slot's recurrent state, so the policy computes it for the open transitions
        #    and step_targets folds it in (rows not pending are never written: their 0 is unused).
        cut_all = truncated & ~terminated
        cut = pending & cut_all
        final_values = torch.zeros(len(slots))
        if cut.any():
            rows = cut.nonzero().squeeze(1)
            cut_slots = slots[rows]
            finals = final_obs[pending[cut_all]]
            inputs = ActInput(cut_slots, finals, torch.zeros(len(rows), dtype=torch.bool),
                              self.last_action[cut_slots], reward[rows], tuple(s[cut_slots] for s in self.state))
            final_values[rows] = self.policy.bootstrap_values(inputs).float().cpu()
        reward, discount = step_targets(None, reward.numpy(), terminated.numpy(), truncated.numpy(), None, self.gamma,
                                        final_values=final_values)
        closed = slots[pending]
        self.unrolls.write("rewards", closed, reward[pending], offset=-1)
        self.unrolls.write("discounts", closed, discount[pending], offset=-1)
        if self.on_episodes is not None:
            self.on_episodes(np.concatenate([self._resume(r) if r.stream_start else r.episode_return
                                             for r in requests]))
        else:
            for r in requests:
                if r.stream_start:
                    self._resume(r)

        # 2. The new observation starts or continues each slot's unroll; a full unroll goes to the sink.
        first = ~pending | ended
        keep = (~first).view(-1, *([1] * len(self.policy.action_spec.shape)))
        prev_action = torch.where(keep, self.last_action[slots], torch.zeros_like(self.last_action[slots]))
        prev_reward = torch.where(first, torch.zeros_like(reward), cat("reward").float())
        if self.state and first.any():
            starts = slots[first]
            for table, init in zip(self.state, self.policy.initial_state(len(starts))):
                table[starts] = init
        state = tuple(s[slots] for s in self.state)
        self.unrolls.write("obs", slots, obs)
        self.unrolls.write("first", slots, first)
        if self.state:
            self.unrolls.write("prev_action", slots, prev_action)
            self.unrolls.write("prev_reward", slots, prev_reward)
            for name, rows in zip(self.policy.state_fields, state):
                self.unrolls.write(name, slots, rows)
        emitted = self.unrolls.emit_full(slots)  # the sink may block (a full queue throttles the actors)
        if emitted:
            self.stats.count("unrolls", emitted)

        # 3. One forward for every row; record what acted.
        out = self.policy.act(ActInput(slots, obs, first, prev_action, prev_reward, state))
        actions = out.actions.cpu()
        self.unrolls.write("actions", slots, actions)
        self.unrolls.write("policy_version", slots, torch.full((len(slots),), out.version, dtype=torch.int64))
        for name in self.policy.step_fields:
            self.unrolls.write(name, slots, out.extras[name].cpu())
        self.unrolls.advance(slots)
        self.pending[slots] = True
        self.run_id[slots] = run_ids
        self.last_action[slots] = actions.to(self.last_action.dtype)
        for table, rows in zip(self.state, out.state):
            table[slots] = rows.cpu().to(table.dtype)
        return actions
