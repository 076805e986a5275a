"""GA3C (Babaeizadeh et al. 2017): agents, predictor threads and trainer threads around one model.

N_A agent processes each play one env (``agents.py``, ``queues.py``):
before each action an agent puts its id on the prediction queue and waits;
N_P predictor threads each take every waiting request (at least one, at most
``max_predict_batch``), run one batched forward and answer each agent. After
t_max steps an agent puts its segment on the training queue; N_T trainer
threads take ``min_train_batch`` segments at a time and update the model
(``--algo ga3c``: eq. 5). ``--autotune`` moves N_A, N_P or N_T by +-1 every
``autotune_interval`` seconds and keeps the move only if TPS rose
(``conveyor.architectures.ga3c.autotune``).

An agent process that dies (killed, or its env fails to build) is noticed
by the main loop within 0.1 s and restarted with the same id, its episodes
going on from the id's next episode seed; the segment it was writing is
dropped (never trained on, never in ``env_steps``; counted in the summary's
``dropped_steps``), its slot goes back to the free pool, and each restart is
counted in ``restarts``. Past ``--max-restarts`` restarts the run stops with
``WorkerFailure`` (``agents.py`` has the mechanics).
Steps that agents stopped on purpose (autotune, the end of the run) had
half-written are reported as ``ga3c.abandoned_steps``.

Sharing one model between threads takes three locks:

- ``update_lock``: one trainer updates at a time. Trainers share ``.grad``,
  and autograd refuses a backward whose saved parameters another trainer's
  optimizer step changed in place. So N_T > 1 overlaps one trainer's
  gathering and copying of segments with another's update, not two updates.
  The main loop decides to stop under it too: no update lands after the
  decision (its segments count as ``count/steps_after_stop``), so a run
  stopped at its target return reports a last-100 return at or above it.
- ``params_lock``: a predictor's forward and an optimizer step exclude each
  other, so every prediction sees one whole parameter version and the version
  stamped on its action is exact. Trainers' forward and backward run
  alongside predictions (they only read parameters).
- ``gather_lock``: one trainer gathers at a time, so batches fill in arrival
  order and no two trainers hold half batches that together starve agents of
  free segment slots.

Policy lag (learner version minus the version that chose each action) is
positive here by design; the summary's histogram shows how much.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from conveyor.acting import GsdeNoise, policy_step, step_targets
from conveyor.architectures.ga3c.autotune import KNOBS, Autotuner, Counts, plot_history
from conveyor.architectures.ga3c.agents import AgentPool
from conveyor.architectures.ga3c.meter import Meter
from conveyor.architectures.ga3c.queues import SEGMENT_FIELDS, Channels
from conveyor.architectures.ga3c.threads import ThreadGroup, locked
from conveyor import algos
from conveyor.config import RunCfg
from conveyor.envs import env_spaces
from conveyor.models import make_model
from conveyor.run import Run
from conveyor.storage.schema import RolloutSchema
from conveyor.transfer import to_device

MAX_THREADS = 8
"""Most predictor and trainer threads autotune may choose."""


def training_batch(model: nn.Module, seg: dict[str, np.ndarray], gamma: float,
                   device: torch.device) -> dict[str, Tensor]:
    """The learner's batch from copied segments (``Channels.segments``), truncation bootstrap folded in.

    A segment has no V(s_T) from acting time (a2c and ga3c recompute it): its ``behaviour_value[T]`` is the marker.
    """
    targets = [step_targets(model, seg["env_rewards"][t], seg["terminated"][t], seg["truncated"][t],
                            seg["final_obs"][t], gamma, device) for t in range(len(seg["env_rewards"]))]
    batch = {name: to_device(seg[name], device)
             for name in ("obs", "actions", "behaviour_logp", "behaviour_value", "policy_version")}
    batch["rewards"] = torch.stack([reward for reward, _ in targets])
    batch["discounts"] = torch.stack([discount for _, discount in targets])
    return batch


def run(cfg: RunCfg) -> dict[str, Any]:
    arch = cfg.arch
    with Run(cfg) as run:
        obs_space, action_space = env_spaces(cfg.env, cfg.seed)
        model = make_model(cfg.model, obs_space, action_space)
        learner = run.learner(model, algos.make_loss(cfg))
        device, tel = learner.device, run.telemetry
        start = Counts(arch.num_agents, arch.num_predictors, arch.num_trainers)
        high = Counts(max(2 * arch.num_agents, 8), MAX_THREADS, MAX_THREADS) if arch.autotune else start
        # Agents fill at most one segment each; one trainer gathers at a time: this many never run out.
        num_segments = arch.min_train_batch + 2 * high.agents
        # Twice the ids: an agent that was asked to stop holds its id until it has exited.
        segment = RolloutSchema.build(obs_space, model.policy, SEGMENT_FIELDS)
        channels = run.closing(Channels(segment, 2 * high.agents, num_segments, arch.unroll))
        agents = run.closing(AgentPool(channels, cfg.to_dict(), cfg.seed, max_restarts=cfg.env.max_restarts,
                                       on_restart=tel.add_restart, ending=run.stop_event.is_set,
                                       env_step_timeout_s=cfg.env.env_step_timeout_s))
        update_lock, params_lock, gather_lock = threading.Lock(), threading.Lock(), threading.Lock()
        # gSDE: one noise matrix per agent id, used under params_lock (the predictors act one at a time)
        gsde = GsdeNoise.for_model(cfg.model, (cfg.seed, tel.env_steps))

        def predict(stop: threading.Event, serial: int) -> None:
            generator = torch.Generator(device=device).manual_seed(cfg.seed * 1000 + serial)
            while not stop.is_set():
                ids, seqs = channels.take_numbered(arch.max_predict_batch, 0.1)
                if not len(ids):
                    continue
                with run.timer("act"):
                    obs = to_device(channels["obs"][ids], device)
                    with params_lock:
                        version = learner.version
                        act = policy_step(model, obs, generator, gsde=gsde, envs=ids)
                    channels.answer(ids, act.actions.cpu().numpy(), act.logp.cpu().numpy(),
                                    act.value.cpu().numpy(), version, seqs)
                tel.count("predictions", len(ids))
                tel.count("predict_batches")

        def train(stop: threading.Event, serial: int) -> None:
            while locked(gather_lock, stop):
                try:
                    slots = channels.take_segments(arch.min_train_batch, stop.is_set)
                finally:
                    gather_lock.release()
                if slots is None:
                    return
                seg = channels.segments(slots)
                channels.release_segments(slots)
                with update_lock, run.timer("learn"):
                    if run.stop_event.is_set():
                        run.telemetry.count("steps_after_stop", seg["env_rewards"].size)
                        return
                    batch = training_batch(model, seg, cfg.algo.gamma, device)
                    tel.add_lag(learner.version, seg["policy_version"])
                    metrics, _ = learner.compute_gradients(batch)
                    with params_lock:
                        learner.apply_gradients(batch["obs"])
                    run.record_env_step(seg["env_rewards"].size, seg["episode_return"].reshape(-1))
                    run.after_update(learner, metrics)

        predictors = run.closing(ThreadGroup("ga3c-predictor", predict, run))
        trainers = run.closing(ThreadGroup("ga3c-trainer", train, run))
        groups = {"agents": agents, "predictors": predictors, "trainers": trainers}

        def apply(counts: Counts) -> None:
            for knob in KNOBS:
                groups[knob].resize(getattr(counts, knob))
                tel.gauge(f"num_{knob}", getattr(counts, knob))

        apply(start)
        meter = Meter(run, channels, cfg)
        tuner = Autotuner(start, Counts(1, 1, 1), high, random.Random(cfg.seed)) if arch.autotune else None
        history: list[dict[str, Any]] = []

        def decided_to_stop() -> bool:
            with update_lock:
                return run.should_stop()

        while not decided_to_stop():
            run.stop_event.wait(0.1)
            agents.check()
            meter.sample()
            if tuner is None or not tel.updates:
                continue
            if not history and meter.decision["updates"] == 0:
                meter.tps_since_decision()  # measure from the first update on, not from the agents' start-up
            elif meter.seconds_since_decision() >= arch.autotune_interval:
                decision = tuner.step(meter.tps_since_decision())
                history.append(decision.row(tel.wall_time_s))
                apply(decision.next)
        counts = {knob: len(groups[knob]) for knob in KNOBS}
        agents.close()
        for group in (predictors, trainers):
            group.close()
            if group.error is not None:
                raise group.error
        if history:
            plot_history(history, run.out / "autotune.png")
        return run.finish(learner, ga3c={**meter.summary(), "final_counts": counts, "autotune": history,
                                         "abandoned_steps": agents.abandoned_steps})
