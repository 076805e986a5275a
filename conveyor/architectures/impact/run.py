"""IMPACT (Luo et al. 2020, algorithm 1): async workers, circular buffer C(N, K), clipped target network.

W worker processes (``env.num_workers``, ``collector``; started by ``workers``) each
hold their own copy of the policy and step ``env.num_envs / W`` envs. A
worker fills one of its batch slots in shared memory with S steps
(``--worker-batch``): observations, actions (the unclipped Gaussian sample;
the env gets it clipped to the action bounds), behaviour log-probs,
training rewards and discounts, the parameter version that acted and the
finished episodes' returns. It then sends the slot's index to the learner
down a pipe and fills its other slot. Between batches it loads the newest
parameters from the ``ParamBlock`` when their version has moved.

The learner walks the ``CircularBuffer`` round-robin. When the position at
the cursor is empty it takes the oldest ready slot, copies it in and hands
the slot back to its worker. On a batch's first use the target network's
log-probs (and policy parameters, for the KL penalty) are attached. With an
LSTM core (``--lstm-size``) each batch carries the state its envs started it
from and the core's inputs (``collector.batch_fields``); the learner and the
target network replay it from that state (``acting.forward_unrolls``). Every
update: lag histogram, one optimizer step; every ``--target-update``
updates the target network copies the learner, every ``--broadcast-interval``
updates the learner publishes its weights.

Dead workers: ``Workers`` notices a worker process that died while the
learner waits for a batch or hands a slot back, and restarts it (same
index, fresh env seeds, newest weights) up to ``--max-restarts`` times per
run. Batches it had sent are kept; the one it was writing is dropped and
its slot reused. Each restart is counted (``restarts``, ``dropped_steps``
in the summary); ``env_steps`` counts only batches put into the buffer.
Past the limit the run stops with ``WorkerFailure`` naming the worker.

Presets: ``appo`` is K = 1 without target network (the target log-probs are
the worker's, so the IMPACT ratio is PPO's ratio to the worker);
``impala`` is the same with the V-trace loss.

Time split: ``env`` and ``act`` are the workers' seconds (summed over
workers), ``wait`` the learner waiting for a batch, ``learn`` its updates.
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor import algos
from conveyor.acting import forward_unrolls
from conveyor.config import RunCfg
from conveyor.errors import WorkerFailure
from conveyor.envs import env_spaces
from conveyor.models import frozen_copy, make_model
from conveyor.run import Run
from conveyor.storage.circular import CircularBuffer
from conveyor.architectures.impact.collector import POLL_S, SLOTS_PER_WORKER, batch_fields, pool_specs
from conveyor.architectures.impact.workers import Workers
from conveyor.architectures.impact.params import ParamBlock
from conveyor.architectures.impact.ray_workers import RayWorkers
from conveyor.ray_launcher import RayLauncher, check_available
from conveyor.storage.shm import SharedArrays

def run(cfg: RunCfg) -> dict[str, Any]:
    arch, use_target = cfg.arch, cfg.arch.use_target_network and cfg.algo.name == "impact"
    with Run(cfg) as run:
        obs_space, action_space = env_spaces(cfg.env, cfg.seed)
        model = make_model(cfg.model, obs_space, action_space)
        learner = run.learner(model, algos.make_loss(cfg))
        target = frozen_copy(model) if use_target else None
        pool = run.closing(SharedArrays(pool_specs(cfg, obs_space, action_space)))
        params = run.closing(ParamBlock(model))
        params.publish(model, learner.version)
        restarts = {"max_restarts": cfg.env.max_restarts, "on_restart": run.telemetry.add_restart,
                    "stopping": run.stop_event.is_set}
        if arch.launcher == "ray":
            check_available()
            launcher = run.closing(RayLauncher(arch.ray_address, arch.ray_strategy, count=cfg.env.num_workers,
                                               role="impact worker", out=run.out))
            workers = run.closing(RayWorkers(run.cfg, pool, params, launcher, model, **restarts))
        else:
            workers = run.closing(Workers(run.cfg, pool, params, **restarts))
        buffer = CircularBuffer(arch.buffer_batches, arch.replay_times, learner.device)
        worker_versions = [-1] * cfg.env.num_workers
        fields = batch_fields(cfg)

        @torch.no_grad()
        def attach_target(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if target is None:  # APPO: the worker's policy is the trust region's anchor
                return {"target_logp": batch["behaviour_logp"]}
            out = forward_unrolls(target, batch).time_slice(0, -1)  # an LSTM core replays from the batch's state
            extra = {"target_logp": out.log_prob(batch["actions"])}
            if cfg.algo.kl_coef > 0:
                extra["target_params"] = out.params
            return extra

        while not run.should_stop():
            if buffer.needs_batch():
                try:
                    with run.timer("wait"):
                        slot = workers.next_slot(POLL_S)  # restarts dead workers (their partial batches dropped)
                    if slot is None:
                        continue
                    buffer.put({name: pool[name][slot] for name in fields})
                    returns, (env_s, act_s) = pool["episode_return"][slot].copy(), pool["seconds"][slot]
                    worker_versions[slot // SLOTS_PER_WORKER] = int(pool["policy_version"][slot].max())
                    run.telemetry.add_time("env", env_s)
                    run.telemetry.add_time("act", act_s)
                    run.telemetry.env_errors = int(pool["env_errors"].sum())
                    run.record_env_step(returns.size, returns.reshape(-1))  # only batches put count as env steps
                    workers.release(slot)
                except WorkerFailure:
                    if run.stop_event.is_set():  # a SIGTERM to the process group also ended the workers
                        break
                    raise
                continue
            with run.timer("learn"):
                batch, _ = buffer.take(attach_target if cfg.algo.name == "impact" else None)
                run.telemetry.add_lag(learner.version, batch["policy_version"].cpu().numpy())
                metrics = learner.update(batch)
                if target is not None and learner.version % arch.target_update == 0:
                    target.load_state_dict(model.state_dict())
                    run.telemetry.count("target_syncs")
                if learner.version % arch.broadcast_interval == 0:
                    params.publish(model, learner.version)
                    run.telemetry.count("broadcasts")
            run.after_update(learner, metrics)
        return run.finish(learner, batches_received=buffer.batches_put, worker_param_versions=worker_versions)
