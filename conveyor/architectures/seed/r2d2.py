"""R2D2 on any architecture that runs inference on the learner (SEED RL section 3.2, table 8).

The parts, none tied to the gRPC transport:

- ``R2D2Policy``: epsilon-greedy acting with per-actor epsilons, plugged
  into ``inference.CentralInference``, which keeps each env's LSTM
  state, previous action and reward on the learner and cuts its stream into
  overlapping sequences that start with the state the actor used.
- ``ReplayLearning``: the replay as the sequences' sink, prioritized
  sampling once ``min_replay`` sequences are stored, priority write-back,
  and (``checkpoint_replay``) the replay and its sampler in checkpoints.
- ``R2D2Learner``: a ``Learner`` whose update burns the LSTM in without
  gradient, runs the target network, applies the transformed n-step
  double-Q loss (``conveyor.algos.r2d2``), and syncs the target network every
  ``target_update_interval`` updates. It returns the new sequence priorities.
- ``make_replay``: the prioritized sequence replay for a run (sequences
  overlapping by half, Atari frame stacks stored one frame per step),
  refused at start when it cannot fit the memory budget.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from conveyor import algos
from conveyor.acting import forward_step, forward_unrolls
from conveyor.config import RunCfg
from conveyor.errors import ConfigError
from conveyor.learner import Learner, LossFn
from conveyor.models import frozen_copy, make_model
from conveyor.returns import value_rescale_inverse
from conveyor.run import Run
from conveyor.storage.replay import SequenceReplay, check_replay_fits
from conveyor.architectures.seed.inference import ActInput, ActOutput, LearnerPolicy

def actor_epsilons(num_actors: int, base: float = 0.4, alpha: float = 7.0) -> Tensor:
    """Per-actor exploration ``eps_i = base ** (1 + alpha i / (N - 1))`` for i in [0, N) (Ape-X, R2D2, SEED
    table 8): from 0.4 down to 0.4 ** 8 = 6.6e-4. One actor gets ``base``."""
    i = torch.arange(num_actors, dtype=torch.float64)
    exponent = 1 + alpha * i / max(num_actors - 1, 1)
    return (base ** exponent).float()


def epsilon_greedy(q: Tensor, epsilon: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Greedy actions of ``q [B, A]``, replaced by a uniform action with probability ``epsilon [B]``."""
    B, A = q.shape
    explore = torch.rand(B, generator=generator) < epsilon.cpu()
    uniform = torch.randint(A, (B,), generator=generator)
    return torch.where(explore, uniform, q.argmax(-1).cpu())


def make_replay(cfg: RunCfg, observation_space: gym.spaces.Box, lstm_size: int) -> SequenceReplay:
    """The run's sequence replay; ``ConfigError`` (with the bytes needed) when it cannot fit."""
    arch = cfg.arch
    overlap = arch.seq_len // 2
    frame_stack = cfg.env.frame_stack if cfg.env.is_atari else 1
    min_steps = arch.min_replay * (arch.seq_len - overlap)
    if min_steps > arch.replay_capacity:
        raise ConfigError(f"min_replay ({arch.min_replay} sequences, {min_steps} steps) exceeds replay_capacity "
                          f"({arch.replay_capacity} steps): learning would never start; lower --min-replay")
    if arch.replay_capacity < arch.seq_len + frame_stack:
        raise ConfigError(f"replay_capacity ({arch.replay_capacity} steps) cannot hold one sequence of seq_len "
                          f"{arch.seq_len}: raise --replay-capacity")
    obs_dtype = torch.from_numpy(np.zeros((), observation_space.dtype)).dtype
    check_replay_fits(arch.replay_capacity, arch.seq_len, overlap, observation_space.shape, obs_dtype, frame_stack,
                      lstm_size, arch.replay_bytes)
    return SequenceReplay(arch.replay_capacity, arch.seq_len, observation_space.shape, obs_dtype, lstm_size,
                          overlap=overlap, frame_stack=frame_stack, priority_exponent=cfg.algo.priority_exponent,
                          importance_exponent=cfg.algo.importance_exponent)


class R2D2Policy(LearnerPolicy):
    """Epsilon-greedy acting on the learner's online network, for ``inference.CentralInference``.

    Env slot ``i`` acts with ``epsilons[i % len(epsilons)]``. The LSTM state
    ``(state_h, state_c)`` of every slot is kept by ``CentralInference`` and
    stored at each sequence's start (kind ``start``). The value of a truncated
    episode's final observation is ``h^-1(max_a Q(final, a))``, Q in
    rescaled space. ``lock`` keeps the forward off parameters mid-update.
    """

    step_fields: tuple[str, ...] = ()

    def __init__(self, learner: Learner, lock: threading.Lock, epsilons: Tensor, seed: int,
                 value_rescale_eps: float = 1e-3):
        super().__init__(learner, lock)
        self.epsilons = epsilons.float().cpu()
        self.value_rescale_eps = value_rescale_eps
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def _q(self, inputs: ActInput, reset: bool) -> tuple[Tensor, tuple[Tensor, Tensor], int]:
        with self.lock:
            out = forward_step(self.learner.model, inputs.obs.to(self.learner.device), self.core(inputs, reset))
            version = self.learner.version
        return out.q[0], tuple(s[0].cpu() for s in out.state), version

    def act(self, inputs: ActInput) -> ActOutput:
        q, state, version = self._q(inputs, True)
        epsilon = self.epsilons[inputs.slots % len(self.epsilons)]
        return ActOutput(epsilon_greedy(q, epsilon, self.generator), version, {}, state)

    def bootstrap_values(self, inputs: ActInput) -> Tensor:
        q, _, _ = self._q(inputs, False)
        return value_rescale_inverse(q.max(-1).values, self.value_rescale_eps)


class ReplayLearning:
    """R2D2's learning side next to central inference: finished sequences go into the replay (``sink``),
    the training loop takes prioritized ``get`` batches and ``train``s on them. ``build`` makes the whole
    R2D2 set for a run: learner, acting policy, replay.

    Learning starts once ``min_replay`` sequences are stored. With ``replay_ratio`` r > 0 the learner
    samples at most r sequences per sequence inserted after that (SEED: one update per
    ``batch_size / r`` new sequences), and the sink (the inference thread, hence every actor) waits
    while inserts run more than ``AHEAD_UPDATES`` updates' worth ahead of the learner: updates per env
    step are then fixed by the configuration, not by which side happens to be faster. The two waits
    exclude each other (the learner waits only when it has sampled more than r times the inserts since
    ``min_replay``, the sink only when r times those inserts exceed the samples), so they cannot deadlock;
    both also give up on ``close``.

    ``state_dict`` (what ``build`` adds to every checkpoint with ``checkpoint_replay``) holds the replay, the
    sampler's RNG state and the samples drawn, so a resumed run samples on as if it had not stopped.
    """

    AHEAD_UPDATES = 2

    def __init__(self, learner: "R2D2Learner", policy: R2D2Policy, replay: SequenceReplay, min_replay: int,
                 batch_size: int, lock: threading.Lock, seed: int, replay_ratio: float = 0.0):
        self.learner = learner
        self.policy = policy
        self.replay = replay
        self.min_replay = min_replay
        self.batch_size = batch_size
        self.replay_ratio = replay_ratio
        self.lock = lock
        self.rng = np.random.default_rng(seed)
        self.sampled = 0  # sequences this learner has sampled (batch_size per update)
        self._cond = threading.Condition()
        self._closed = False

    @classmethod
    def build(cls, run: Run, observation_space: gym.spaces.Box, action_space: gym.Space, lock: threading.Lock,
              num_actors: int) -> "ReplayLearning":
        """For ``run.cfg``; the replay's memory is checked first, before anything else is made. With
        ``checkpoint_replay`` the replay goes into checkpoints and is restored from the one resumed."""
        cfg = run.cfg
        replay = make_replay(cfg, observation_space, cfg.model.lstm_size)
        model = make_model(cfg.model, observation_space, action_space, dueling=True)
        learner = run.learner(model, algos.make_loss(cfg), learner_cls=R2D2Learner)
        policy = R2D2Policy(learner, lock, actor_epsilons(num_actors, cfg.algo.exploration_eps), cfg.seed,
                            cfg.algo.value_rescale_eps)
        learning = cls(learner, policy, replay, cfg.arch.min_replay, cfg.arch.batch_size, lock, cfg.seed,
                       cfg.arch.replay_ratio)
        if cfg.arch.checkpoint_replay:
            if "replay" in run.resume_state:  # taken out: the compressed copy is not kept for the whole run
                learning.load_state_dict({key: run.resume_state.pop(key) for key in learning.CHECKPOINT_KEYS})
            run.save_with_checkpoints(learning.state_dict)
        return learning

    CHECKPOINT_KEYS = ("replay", "replay_rng", "replay_sampled")

    def state_dict(self) -> dict[str, Any]:
        """The replay, the sampler's RNG state and the sequences sampled, for checkpoints."""
        with self._cond:
            sampled = self.sampled
        return {"replay": self.replay.state_dict(), "replay_rng": self.rng.bit_generator.state,
                "replay_sampled": sampled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.replay.load_state_dict(state["replay"])
        self.rng.bit_generator.state = state["replay_rng"]
        self.sampled = int(state["replay_sampled"])

    def _fresh(self) -> int:
        """Sequences inserted since learning could start."""
        return self.replay.inserted - self.min_replay

    def _may_learn(self) -> bool:
        if self.replay.inserted < self.min_replay:
            return False
        return not self.replay_ratio or self.sampled <= self.replay_ratio * self._fresh()

    def _may_insert(self) -> bool:
        return (not self.replay_ratio
                or self.replay_ratio * self._fresh() <= self.sampled + self.AHEAD_UPDATES * self.batch_size)

    def sink(self, slot: int, sequence: dict[str, Tensor], on_stored: Callable[[], None]) -> None:
        """Store a finished sequence (a ``CountedSink``); waits while the learner is behind (a closed run drops
        it)."""
        with self._cond:
            while not self._may_insert() and not self._closed:
                self._cond.wait(0.1)
            if self._closed:
                return
        self.replay.add(sequence, slot, bool(sequence["continues"]))
        on_stored()
        with self._cond:
            self._cond.notify_all()

    def get(self, timeout_s: float) -> dict[str, Tensor] | None:
        """A prioritized batch, or None when the learner may not learn yet within ``timeout_s``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._may_learn() or self._closed, timeout_s) or self._closed:
                return None
            self.sampled += self.batch_size
            self._cond.notify_all()
        return self.replay.sample(self.batch_size, self.rng, self.learner.device)

    def train(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """One update on a ``get`` batch; the new priorities go back to replay."""
        metrics, priorities = self.learner.learn(batch, self.lock)
        if not self.learner.nonfinite:  # a skipped update's TD errors are NaN: the batch keeps its priorities
            self.replay.update_priorities(batch["ids"], priorities)
        return metrics

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class R2D2Learner(Learner):
    """A ``Learner`` with a target network and burn-in; ``learn(batch)`` is one R2D2 update.

    A replay batch covers whole sequences (``L + 1`` observations).
    The first ``burn_in`` steps only warm the LSTM up from the stored state
    (no gradient); the loss covers the remaining ``L - burn_in`` transitions.
    The target network runs over the whole sequence from the same stored
    state, so its state at the learning part is burned in too.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, cfg: RunCfg):
        super().__init__(model, self._loss_keeping_priorities, cfg)
        self.r2d2_loss = loss_fn
        self.target_model = frozen_copy(self.model)
        self.burn_in = cfg.arch.burn_in
        self.target_update_interval = cfg.arch.target_update
        self.priorities = torch.zeros(0)  # of the last update's batch

    def _loss_keeping_priorities(self, model_out: Any, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = self.r2d2_loss(model_out, batch)
        self.priorities = metrics["priorities"]
        return loss, metrics

    def forward(self, batch: dict[str, Tensor]) -> Any:
        return forward_unrolls(self.model, batch, batch["state"])

    def learning_batch(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The learning part of sampled sequences: burned-in online state, target-network Q, sliced steps."""
        K = self.burn_in
        state = (batch["state_h"].unsqueeze(0), batch["state_c"].unsqueeze(0))
        with torch.no_grad():
            target_q = forward_unrolls(self.target_model, batch, state).q[K:]
            if K:
                state = self.model(batch["obs"][:K], state, batch["first"][:K], batch["prev_action"][:K],
                                   batch["prev_reward"][:K]).state
        learn = {key: batch[key][K:] for key in ("obs", "first", "prev_action", "prev_reward", "actions", "rewards",
                                                 "discounts", "policy_version")}
        learn.update(state=state, target_q=target_q, weights=batch["weights"])
        return learn

    def learn(self, batch: dict[str, Tensor], params_lock: Any = None) -> tuple[dict[str, float], Tensor]:
        """One update on a replay batch; returns the metrics and the ``[B]`` priorities to write back.
        ``params_lock`` (held only while the optimizer steps) keeps acting forwards off half-updated weights."""
        metrics, _ = self.compute_gradients(self.learning_batch(batch))
        with params_lock or contextlib.nullcontext():
            self.apply_gradients(batch["obs"])
        if self.version % self.target_update_interval == 0:
            self.sync_target()
        return metrics, self.priorities

    def sync_target(self) -> None:
        self.target_model.load_state_dict(self.model.state_dict())

    def state(self, **extra: Any) -> dict[str, Any]:
        return super().state(target_model=self.target_model.state_dict(), **extra)

    def restore(self, state: dict[str, Any], path: Any = "checkpoint") -> None:
        super().restore(state, path)
        if "target_model" in state:
            self.target_model.load_state_dict(state["target_model"])
        else:
            self.sync_target()
