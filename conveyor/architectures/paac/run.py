"""PAAC (Clemente et al. 2017): synchronous batched advantage actor-critic.

One master holds the model. Each step it runs one batched forward over all
n_e observations, n_w worker processes step their n_e / n_w envs in shared
memory, and the transitions go into ``[t_max, n_e]`` storage; after t_max
steps, one update (A2C: n-step returns; PPO: GAE, epochs x minibatches).
The policy that acts is always the one being updated: lag 0.

Faults: a dead env worker is restarted (``make_vector_env(restart_workers=True)``),
its envs on their next episodes; so is a hung one (``--env-step-timeout-s``),
and a stop request ends a step that hangs (``stop=run.should_stop``). The
step they lost is masked out of the loss (``RolloutStorage.drop_step``; the
steps before it bootstrap from its V(s_t), as at a truncation) and counted in ``dropped_steps``, never in
``env_steps``; the rest of the rollout, theirs included, is trained on. Checkpoints hold
the env history and the sampler's state, so a resumed run rebuilds every env
and reaches the same parameters as an uninterrupted one.

Under torchrun each rank steps its share of the n_e envs and samples their
actions from the draw for all n_e; the ranks' gradients are averaged before
clipping (docs/design.md "Data-parallel learners").
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor.acting import policy_step, step_targets, values_of
from conveyor import algos
from conveyor.algos import ppo
from conveyor.config import RunCfg
from conveyor.envs import make_vector_env
from conveyor.models import ModelOut, make_model
from conveyor.run import Run
from conveyor.storage.rollout import ROLLOUT_FIELDS, RolloutStorage
from conveyor.storage.schema import RolloutSchema


def run(cfg: RunCfg) -> dict[str, Any]:
    with Run(cfg) as run:
        venv = run.closing(make_vector_env(run.env_cfg, cfg.seed, gamma=cfg.algo.gamma, restart_workers=True,
                                           env_state=run.resume_state.get("env_state"), stop=run.should_stop,
                                           env_offset=run.env_offset))
        model = make_model(cfg.model, venv.single_observation_space, venv.single_action_space)
        learner = run.learner(model, algos.make_loss(cfg))
        device = learner.device
        schema = RolloutSchema.build(venv.single_observation_space, model.policy, ROLLOUT_FIELDS)
        storage = RolloutStorage(schema, cfg.arch.unroll, venv.num_envs, device)
        sampler = torch.Generator().manual_seed(cfg.seed)
        if "sampler" in run.resume_state:
            sampler.set_state(run.resume_state["sampler"])
        run.save_with_checkpoints(lambda: {"env_state": venv.history and venv.history.state(),
                                           "sampler": sampler.get_state()})
        is_ppo = cfg.algo.name == "ppo"
        epochs, minibatches = (cfg.algo.ppo_epochs, cfg.algo.ppo_minibatches) if is_ppo else (1, 1)
        # A2C's parameters stay fixed for the whole rollout: backpropagate through the acting
        # forwards rather than run them again (PPO's later epochs need fresh forwards anyway).
        reuse_graph = not is_ppo
        rows = None if run.dist is None else (run.env_offset, cfg.env.num_envs)  # this rank's rows of all envs
        obs = torch.as_tensor(venv.reset(), device=device)
        while not run.should_stop():
            outputs = []
            restarts_before = venv.restarts
            for t in range(cfg.arch.unroll):
                with run.timer("act"):
                    act = policy_step(model, obs, sampler, keep_graph=reuse_graph, rows=rows)
                    outputs.append(act.out)
                with run.timer("env"):
                    step = venv.step(act.actions.cpu().numpy())
                with run.timer("act"):
                    rewards, discounts = step_targets(model, step.reward, step.terminated, step.truncated,
                                                      step.final_obs, cfg.algo.gamma, device)
                storage.insert(t, obs, act.actions, act.logp, act.value, rewards, discounts, learner.version)
                if step.restarted.any():
                    storage.drop_step(t, torch.as_tensor(step.restarted, device=device))
                obs = torch.as_tensor(step.obs, device=device)
                run.record_episodes(step.episode_return)
            with run.timer("learn"):
                run.telemetry.add_lag(learner.version, storage.policy_version)
                if reuse_graph:
                    storage.insert_last(obs)
                    with torch.no_grad():  # V(s_T) is only the bootstrap: no gradient flows into it
                        outputs.append(model(obs.unsqueeze(0)))
                    metrics = learner.update(storage.batch(), ModelOut.cat_time(outputs))
                else:  # PPO's advantages need V(s_T) under the acting parameters
                    storage.insert_last(obs, values_of(model, obs))
                    batch, steps = ppo.epoch_batch(cfg, bool(model.lstm_size), storage.batch())
                    metrics = learner.update_epochs(batch, epochs, minibatches, sampler, steps=steps)
                kept = int(storage.valid.sum())
                run.telemetry.add_steps(kept)
                if venv.restarts > restarts_before:
                    run.telemetry.add_restart(storage.valid.numel() - kept, venv.restarts - restarts_before)
            run.share_progress()
            run.after_update(learner, metrics)
        return run.finish(learner)
