"""HTS-RL (Liu et al. 2020): executors, actors and a learner over two storages, with a one-step delayed gradient.

- Executors (``cfg.env.num_workers`` processes, ``conveyor.architectures.hts.executors``)
  step each env as soon as its action arrives and post its next observation,
  with a uniform number drawn from the env's own seeded generator.
- Actors (``cfg.arch.num_actors`` threads here, in the learner process: the
  acting parameters are swapped in place at a sync point, no copy crosses a
  process boundary, and a torch forward releases the GIL) take every request
  waiting in the state buffer, run one forward, sample by inverse CDF with the
  executor's uniform, answer, and write the transitions into the filling
  storage (``conveyor.storage.double``).
- Every ``sync_interval`` (alpha) steps per env the round ends: the storages
  swap, the parameters that acted become the gradient point theta_{t-1}, the
  learner's latest theta_t act next, and the main thread learns from the full
  storage while the next round is collected. The data is always exactly one
  update behind the learner (lag 1; the first batch, lag 0). A2C applies the
  gradient at theta_{t-1} to theta_t (eq. 6, ``delayed.delayed_update``); PPO
  runs its epochs from theta_t with ratios against theta_{t-1}'s log-probs, as
  the authors' code does (``delayed.lagged_ppo_update``).

Determinism: an action depends only on the acting parameters, the env's
observation and the env's uniform number. Actors forward a fixed-size batch
whose row i is always env i (a row's floats depend on the batch size, not on
the other rows), episodes are recorded at the swap in (step, env) order, and
the learner sees whole storages. So a seed gives the same ``param_sha256`` for
any number of actors and any timing (same ``torch_threads``).

Checkpoints are written at the swap (just after the next round started, which
they do not hold: a resumed run plays it again from the same env states and
uniforms): the learner (theta_t), the behaviour parameters (A2C's gradient point), the full storage
not yet learned from, the env history and the round count. A resumed run rebuilds every env
(``EnvHistory``), learns that storage and goes on: it reaches the same
``param_sha256`` as a run that never stopped. Ctrl-C lets the round in flight
finish (up to ``STOP_GRACE_S``) so the last checkpoint is such a point too.

Under torchrun each rank runs this whole loop on its share of the envs (their global indices seed them and
their uniforms); the delayed gradient is averaged over the ranks before clipping and applied by each, and the
ranks swap, stop and checkpoint together (docs/design.md "Data-parallel learners").

Faults: a dead executor is restarted (``conveyor.architectures.hts.actors.restart_dead_executors``), and
so is one whose env hangs in a call (``--env-step-timeout-s``: ``StateBuffer.kill_hung``);
the round in flight completes with its envs re-run from step 0 on their next
episodes, so no transition is lost inside an episode or trained on twice.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from conveyor import algos
from conveyor.acting import GsdeNoise
from conveyor.algos import ppo
from conveyor.config import RunCfg
from conveyor.envs.history import EnvHistory
from conveyor.architectures.hts.actors import POLL_S, Actors, restart_dead_executors
from conveyor.architectures.hts.delayed import acting_tensors, copy_params, delayed_update, lagged_ppo_update
from conveyor.models import frozen_copy, make_model
from conveyor.run import Run
from conveyor.storage.double import DoubleStorage
from conveyor.storage.rollout import ROLLOUT_FIELDS, RolloutStorage
from conveyor.storage.schema import RolloutSchema
from conveyor.architectures.hts.state_buffer import StateBuffer

STOP_GRACE_S = 10.0
"""After a stop signal, how long the round in flight may take to finish (so the checkpoint is exact)."""


def _wait_round(run: Run, buffer: StateBuffer, actors: Actors, storage: DoubleStorage, history: EnvHistory,
                rounds: int) -> bool:
    """Wait until the filling storage is full, replacing dead executors (and hung ones, killed); False when the
    run was stopped (signal) and the round did not finish within ``STOP_GRACE_S``."""
    stopped_at = None
    with run.timer("wait"):
        while not storage.wait_full(POLL_S):
            actors.check()
            buffer.kill_hung()
            restart_dead_executors(buffer, actors, storage, history, rounds, run.telemetry)
            buffer.check_env_errors()
            if run.stop_event.is_set():
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > STOP_GRACE_S:
                    return False
    return True


def run(cfg: RunCfg) -> dict[str, Any]:
    with Run(cfg) as run:
        resumed = run.resume_state.get("hts_rounds") is not None
        rounds = int(run.resume_state["hts_rounds"]) if resumed else 0
        env_cfg = run.env_cfg  # this process's envs (under torchrun, its rank's share)
        history = EnvHistory.from_state(run.resume_state["env_state"]) if resumed else EnvHistory(env_cfg.num_envs)
        buffer = run.closing(StateBuffer(env_cfg, cfg.seed, cfg.arch.sync_interval, gamma=cfg.algo.gamma,
                                         start=history if resumed else None, first_round=rounds,
                                         env_offset=run.env_offset))
        if not resumed:
            history.start_games(slice(None))
        obs_space = buffer.single_observation_space
        model = make_model(cfg.model, obs_space, buffer.single_action_space)
        learner = run.learner(model, algos.make_loss(cfg))
        # The acting parameters (theta_t of the round) and, for A2C's delayed gradient (eq. 6), the gradient point
        # of the next update (theta_{t-1}); PPO's update reads theta_{t-1}'s log-probs from the batch instead.
        acting = frozen_copy(learner.model)
        delayed_gradient = cfg.algo.name != "ppo"
        behaviour = [t.detach().clone() for t in acting_tensors(learner.model)] if delayed_gradient else None
        schema = RolloutSchema.build(obs_space, model.policy, ROLLOUT_FIELDS)
        # Host memory: actors write it a few cells at a time; the learner takes it to its device at the swap.
        storage = DoubleStorage(lambda: RolloutStorage(schema, cfg.arch.sync_interval, env_cfg.num_envs))
        gsde = GsdeNoise.for_model(cfg.model, cfg.seed)
        actors = run.closing(Actors(cfg.arch.num_actors, buffer, storage, acting, cfg.algo.gamma, run.telemetry,
                                    gsde))
        actors.version, actors.round = learner.version, rounds
        sampler = torch.Generator().manual_seed(cfg.seed)
        pending = None  # the full storage's batch, collected by ``behaviour``, not learned from yet
        if resumed:
            sampler.set_state(run.resume_state["sampler"])
            pending = run.resume_state["pending_batch"]
            if pending is not None:
                pending = {key: value.to(learner.device) for key, value in pending.items()}
                if delayed_gradient:
                    copy_params(behaviour, run.resume_state["behaviour"])
        run.save_with_checkpoints(lambda: {
            "hts_rounds": rounds, "env_state": history.state(), "sampler": sampler.get_state(),
            "pending_batch": pending, "behaviour": behaviour if pending is not None else None})
        env_seconds = 0.0
        gap_seconds, gaps = 0.0, 0  # from a round found full to the next one's start (eq. 7's overhead per round)
        buffer.start_round()
        while True:
            if pending is not None:  # learn from the last round while the actors collect this one
                with run.timer("learn"):
                    run.telemetry.add_lag(learner.version, pending["policy_version"].cpu())
                    if not delayed_gradient:
                        batch, steps = ppo.epoch_batch(cfg, bool(model.lstm_size), pending)
                        metrics = lagged_ppo_update(learner, batch, cfg.algo.ppo_epochs, cfg.algo.ppo_minibatches,
                                                    sampler, steps)
                    else:
                        metrics = delayed_update(learner, behaviour, pending)
                pending = None
                run.after_update(learner, metrics, checkpoint=False)
            if not _wait_round(run, buffer, actors, storage, history, rounds):
                break
            full_at = time.perf_counter()
            full = storage.swap()
            rounds += 1
            # The parameters that just acted become the gradient point; the learner's latest act next.
            if delayed_gradient:
                copy_params(behaviour, acting_tensors(acting))
            copy_params(acting_tensors(acting), acting_tensors(learner.model))
            actors.version, actors.round = learner.version, rounds
            for t in range(storage.T):
                run.record_env_step(storage.B, full.episode_returns[t])
            run.share_progress()
            stop = run.should_stop()
            if not stop:  # the next round starts now; the rest of the swap's bookkeeping overlaps with it
                buffer.start_round()
                gap_seconds, gaps = gap_seconds + time.perf_counter() - full_at, gaps + 1
            pending = {key: value.to(learner.device) for key, value in full.storage.batch().items()}
            actions = full.storage.actions.numpy()
            for t in range(storage.T):  # (step, env) order, whatever order the actors served them in
                history.record(actions[t], full.episode_ends[t], full.new_games[t])
            run.telemetry.add_time("env", buffer.env_seconds - env_seconds)
            env_seconds, run.telemetry.env_errors = buffer.env_seconds, buffer.env_errors
            if stop:
                break
            # Everything a resumed run needs is here: the learner, theta_{t-1}, the storage not learned from,
            # the envs' history up to the swap and the round count (the round in flight is played again).
            run.checkpoint_if_due(learner)
        return run.finish(learner, num_actors=cfg.arch.num_actors, num_executors=cfg.env.num_workers,
                          sync_interval=cfg.arch.sync_interval, rounds=rounds,
                          action_wait_ms=1e3 * buffer.action_wait_s, env_step_ms=1e3 * buffer.env_step_s,
                          round_gap_ms=1e3 * gap_seconds / gaps if gaps else float("nan"))
