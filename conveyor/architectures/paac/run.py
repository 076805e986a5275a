"""PAAC (Clemente et al. 2017): synchronous batched advantage actor-critic.

One master holds the model. Each step it runs one batched forward over all
n_e observations, n_w worker processes step their n_e / n_w envs in shared
memory, and the transitions go into ``[t_max, n_e]`` storage; after t_max
steps, one update (A2C: n-step returns; PPO: GAE, epochs x minibatches).
The policy that acts is always the one being updated: lag 0.

Env groups (``--env-groups G``, Sample Factory's double-buffered sampling):
the workers are cut into G groups (``ShmVectorEnv.split``) and the step is
taken group by group (``pipelined_steps``): while group g's envs step in their
worker processes, the master runs the forward on group g + 1's observations,
then sends it its actions and takes group g's step. Every group acts on step
t with the same parameters, the update still waits for every group's last
step (lag 0), and every group samples its rows of one draw for all n_e
(``SharedDraw``), so a seeded run takes the same actions and sees the same
observations with any G, as long as the model's forward gives each row the
same numbers in a batch of n_e / G rows as in one of n_e (true of the MLP and
the Nature CNN on the 2-core CPU measured; ``tests/test_paac_overlap.py``
checks the MLP). Parameters agree bit for bit where the learner runs a forward
of its own (PPO, and A2C with a small model: ``RunCfg.small_model``), to
rounding only where A2C's gradient flows back through the acting forwards (a
CNN's): each weight's gradient summed over G x t_max forwards of n_e / G rows
adds the same terms in another order than over t_max forwards of n_e
(docs/design.md "PAAC env groups"). The preset leaves
groups off: on the 2-core CPU measured they were no faster on Pong, StepTime
or CartPole (BENCHMARKS.md "PAAC env groups"; each step pays two forwards'
fixed costs, and the forward competes with a stepping worker for the cores).

Faults: a dead env worker is restarted (``make_vector_env(restart_workers=True)``),
its envs on their next episodes; so is a hung one (``--env-step-timeout-s``),
and a stop request (a signal) ends a step that hangs, or the start of envs that
replay a resumed run's games (``stop=run.asked_to_stop``, under torchrun too). The
step they lost is masked out of the loss (``RolloutStorage.drop_step``; the
steps before it bootstrap from its V(s_t), as at a truncation) and counted in ``dropped_steps``, never in
``env_steps``; the rest of the rollout, theirs included, is trained on. With env groups, a group waits for
and restarts its own workers only. Checkpoints hold
the env history, the sampler's state and (gSDE) each env's noise step count, so a resumed run rebuilds every env
and reaches the same parameters as an uninterrupted one.

Under torchrun each rank steps its share of the n_e envs and samples their
actions from the draw for all n_e; the ranks' gradients are averaged before
clipping (docs/design.md "Data-parallel learners"). Env groups split each
rank's workers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from conveyor.acting import GsdeNoise, SharedDraw, pipelined_steps, policy_step, step_targets, values_of
from conveyor import algos
from conveyor.algos import ppo
from conveyor.config import RunCfg
from conveyor.envs import make_vector_env
from conveyor.envs.vector import split_envs
from conveyor.models import ModelOut, make_model
from conveyor.run import Run
from conveyor.storage.rollout import ROLLOUT_FIELDS, RolloutStorage
from conveyor.storage.schema import RolloutSchema
from conveyor.transfer import to_device


def run(cfg: RunCfg) -> dict[str, Any]:
    with Run(cfg) as run:
        venv = run.closing(make_vector_env(run.env_cfg, cfg.seed, gamma=cfg.algo.gamma, restart_workers=True,
                                           env_state=run.resume_state.get("env_state"), stop=run.asked_to_stop,
                                           env_offset=run.env_offset))
        groups = split_envs(venv, cfg.arch.env_groups)
        model = make_model(cfg.model, venv.single_observation_space, venv.single_action_space)
        learner = run.learner(model, algos.make_loss(cfg))
        device = learner.device
        is_ppo = cfg.algo.name == "ppo"
        # A2C reads no behaviour log-probs: acting computes none, and the storage holds none
        fields = ROLLOUT_FIELDS if is_ppo else [name for name in ROLLOUT_FIELDS if name != "behaviour_logp"]
        schema = RolloutSchema.build(venv.single_observation_space, model.policy, fields)
        storage = RolloutStorage(schema, cfg.arch.unroll, venv.num_envs, device)
        sampler = torch.Generator().manual_seed(cfg.seed)
        gsde = GsdeNoise.for_model(cfg.model, cfg.seed)
        if "sampler" in run.resume_state:
            sampler.set_state(run.resume_state["sampler"])
            if gsde is not None:
                gsde.load_steps(run.resume_state["gsde_steps"])
        run.save_with_checkpoints(lambda: {"env_state": venv.history and venv.history.state(),
                                           "sampler": sampler.get_state(),
                                           "gsde_steps": gsde and gsde.steps_state()})
        epochs, minibatches = (cfg.algo.ppo_epochs, cfg.algo.ppo_minibatches) if is_ppo else (1, 1)
        # A2C's parameters stay fixed for the whole rollout, so its gradient may flow back through the acting
        # forwards instead of a forward of its own. That saves a CNN's costly forward (Pong, 16 envs: 166-179 ms a
        # rollout and update against 202-213 ms); a small model's forward costs less than backpropagating through
        # T separate graphs, op by op (CartPole 128 envs: 4.7-5.6 ms against 4.8-6.6; MinAtar 16 envs: 8.0-8.3
        # against 9.7-10.1). PPO's epochs need forwards of their own anyway.
        reuse_graph = not is_ppo and not cfg.small_model
        draw = SharedDraw(sampler, len(groups))
        # Each group's rows of all envs (every rank's): it samples them from the draw for the whole batch.
        whole = run.dist is not None or len(groups) > 1
        rows = [(run.env_offset + group.envs.start, cfg.env.num_envs) if whole else None for group in groups]
        env_ids = [run.env_offset + np.arange(group.envs.start, group.envs.stop) for group in groups]
        first_obs = to_device(venv.reset(), device)
        obs = [first_obs[group.envs] for group in groups]  # each group's observations to act on
        acts: list[Any] = [None] * len(groups)
        while not run.should_stop():
            outputs: list[list[ModelOut]] = [[] for _ in range(cfg.arch.unroll)]  # [t][group]
            episode_returns = np.full(venv.num_envs, np.nan)
            restarts_before = venv.restarts
            for event, t, g in pipelined_steps(len(groups), cfg.arch.unroll):
                group = groups[g]
                if event == "act":
                    with run.timer("act"):
                        acts[g] = act = policy_step(model, obs[g], draw.generator(g), keep_graph=reuse_graph,
                                                    rows=rows[g], gsde=gsde, envs=env_ids[g], logp=is_ppo)
                        if reuse_graph:
                            outputs[t].append(act.out)
                    with run.timer("env"):
                        group.step_async(act.actions.cpu().numpy())
                    continue
                act = acts[g]
                with run.timer("env"):
                    step = group.step_wait()
                with run.timer("act"):
                    rewards, discounts = step_targets(model, step.reward, step.terminated, step.truncated,
                                                      step.final_obs, cfg.algo.gamma, device)
                storage.insert(t, obs[g], act.actions, act.logp, act.value, rewards, discounts, learner.version,
                               envs=group.envs)
                if step.restarted.any():
                    storage.drop_step(t, torch.as_tensor(np.flatnonzero(step.restarted) + group.envs.start,
                                                         device=device))
                obs[g] = to_device(step.obs, device)  # a new tensor: A2C's graph keeps the old
                episode_returns[group.envs] = step.episode_return
                if g == len(groups) - 1:  # step t of every env is in
                    run.record_episodes(episode_returns.copy())
            last_obs = torch.cat(obs) if len(groups) > 1 else obs[0]
            with run.timer("learn"):
                run.telemetry.add_lag(learner.version, storage.policy_version)
                if is_ppo:  # PPO's advantages need V(s_T) under the acting parameters
                    storage.insert_last(last_obs, values_of(model, last_obs))
                    batch, steps = ppo.epoch_batch(cfg, bool(model.lstm_size), storage.batch())
                    metrics = learner.update_epochs(batch, epochs, minibatches, sampler, steps=steps)
                else:
                    storage.insert_last(last_obs)
                    out = None  # the learner's forward on all T + 1 steps
                    if reuse_graph:
                        with torch.no_grad():  # V(s_T) is only the bootstrap: no gradient flows into it
                            bootstrap = model(last_obs.unsqueeze(0))
                        out = ModelOut.cat_time([ModelOut.cat_envs(parts) for parts in outputs] + [bootstrap])
                    metrics = learner.update(storage.batch(), out)
                kept = int(storage.valid.sum())
                run.telemetry.add_steps(kept)
                if venv.restarts > restarts_before:
                    run.telemetry.add_restart(storage.valid.numel() - kept, venv.restarts - restarts_before)
            run.share_progress()
            run.after_update(learner, metrics)
        return run.finish(learner)
