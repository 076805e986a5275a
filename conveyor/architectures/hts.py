"""HTS-RL (Liu et al. 2020): executors, actors and a learner over two storages, with a one-step delayed gradient.

- Executors (``cfg.env.num_workers`` processes, ``conveyor.transport.state_buffer``)
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
  update behind the learner (lag 1; the first batch, lag 0).

Determinism: an action depends only on the acting parameters, the env's
observation and the env's uniform number. Actors forward a fixed-size batch
whose row i is always env i (a row's floats depend on the batch size, not on
the other rows), episodes are recorded at the swap in (step, env) order, and
the learner sees whole storages. So a seed gives the same ``param_sha256`` for
any number of actors and any timing (same ``torch_threads``).
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Iterable

import numpy as np
import torch
from torch import Tensor, nn

from conveyor.acting import step_targets, values_of
from conveyor.config import RunCfg
from conveyor.learner import Learner
from conveyor.models import make_model
from conveyor.run import Run
from conveyor.storage.double import DoubleStorage
from conveyor.storage.rollout import RolloutStorage
from conveyor.telemetry import Telemetry
from conveyor.transport.state_buffer import StateBuffer

POLL_S = 0.1
"""Longest an actor or the main thread waits before checking for stop and dead executors."""


@torch.no_grad()
def _copy(targets: Iterable[Tensor], sources: Iterable[Tensor]) -> None:
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def delayed_update(learner: Learner, behaviour: list[Tensor], batch: dict[str, Tensor], epochs: int = 1,
                   minibatches: int = 1, generator: torch.Generator | None = None) -> dict[str, float]:
    """One HTS-RL update (eq. 6): the algorithm's update computed at the behaviour parameters theta_{t-1}
    (``behaviour``, in ``model.parameters()`` order) on the data they collected, applied to theta_t.

    A2C: theta_{t+1} = theta_t + step(g(theta_{t-1})), one optimizer step with the gradient at theta_{t-1}.
    PPO: its ``epochs x minibatches`` steps run from theta_{t-1} exactly as synchronous PPO would (the first
    at ratio 1), and the change they make moves theta_t. Either way it is one policy version.
    """
    params = list(learner.model.parameters())
    version = learner.version
    current = [p.detach().clone() for p in params]
    _copy(params, behaviour)
    metrics = learner.update_epochs(batch, epochs, minibatches, generator)
    _copy(params, [c + (p.detach() - b) for c, p, b in zip(current, params, behaviour)])
    learner.version = version + 1
    return metrics


class Actors:
    """Actor threads serving the state buffer with ``model`` (the acting parameters, stamped ``version``)."""

    def __init__(self, num: int, buffer: StateBuffer, storage: DoubleStorage, model: nn.Module, gamma: float,
                 telemetry: Telemetry):
        self.buffer, self.storage, self.model, self.gamma, self.telemetry = buffer, storage, model, gamma, telemetry
        self.version = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name=f"hts-actor-{i}", daemon=True) for i in range(num)]
        for thread in self._threads:
            thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"HTS actor failed: {self.error!r}") from self.error

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10 * POLL_S + 5.0)

    def _loop(self) -> None:
        device = self.storage.device
        # Row i is env i in every forward: the batch never changes shape, so neither do a row's floats.
        inputs = torch.zeros(self.buffer.obs.shape, dtype=self.storage.filling.obs.dtype, device=device)
        finals = torch.zeros_like(inputs)
        try:
            while not self._stop.is_set():
                envs = self.buffer.take_ready(POLL_S)
                if len(envs):
                    with self.telemetry.timer("act"):
                        self._serve(envs, inputs, finals)
                    self.telemetry.count("actor_forwards")
                    self.telemetry.count("actor_requests", len(envs))
        except BaseException as error:  # reported by check() in the main thread
            self.error = error

    @torch.no_grad()
    def _serve(self, envs: np.ndarray, inputs: Tensor, finals: Tensor) -> None:
        buffer, storage, device = self.buffer, self.storage, self.storage.device
        # Read every field of the requests first: an executor rewrites its row once answered.
        t = buffer.request_step[envs]
        uniform = torch.as_tensor(buffer.uniform[envs], device=device)
        reward, terminated, truncated = buffer.reward[envs], buffer.terminated[envs], buffer.truncated[envs]
        episode_return = buffer.episode_return[envs]
        rows = torch.as_tensor(envs, device=device)
        inputs[rows] = torch.as_tensor(buffer.obs[envs], device=device)
        result, act, last = t > 0, t < storage.T, t == storage.T  # result: step t-1 ended
        cut = result & truncated & ~terminated
        final_values = None
        if cut.any():
            finals[rows[cut]] = torch.as_tensor(buffer.final_obs[envs[cut]], device=device)
            final_values = values_of(self.model, finals)[rows]
        out = self.model(inputs.unsqueeze(0))
        params, value = out.params[0][rows], out.value[0][rows]

        if result.any():
            if final_values is not None:
                final_values = final_values[result]
            rewards, discounts = step_targets(self.model, reward[result], terminated[result], truncated[result], None,
                                              self.gamma, device, final_values)
            storage.write_results(t[result] - 1, envs[result], rewards, discounts, episode_return[result])
        if act.any():
            actions = out.policy.sample(params[act], uniform[act])
            storage.write_actions(t[act], envs[act], inputs[rows[act]], actions,
                                  out.policy.log_prob(params[act], actions), value[act], self.version)
        if last.any():  # may complete the round: no env of this batch waits for an action then
            storage.write_last(envs[last], inputs[rows[last]], value[last])
        if act.any():
            buffer.send_actions(envs[act], actions.cpu().numpy())


def _wait_round(run: Run, buffer: StateBuffer, actors: Actors, storage: DoubleStorage) -> bool:
    """Wait until the filling storage is full; False when the run was stopped (signal) first."""
    with run.timer("wait"):
        while not storage.wait_full(POLL_S):
            actors.check()
            buffer.check_executors()
            if run.stop_event.is_set():
                return False
    return True


def run(cfg: RunCfg) -> dict[str, Any]:
    with Run(cfg) as run:
        buffer = run.closing(StateBuffer(cfg.env, cfg.seed, cfg.arch.sync_interval))
        obs_space = buffer.single_observation_space
        model = make_model(cfg.model, obs_space, buffer.single_action_space)
        learner = run.learner(model)
        # The acting parameters (theta_t of the round) and the gradient point of the next update (theta_{t-1}).
        acting = copy.deepcopy(learner.model).requires_grad_(False)
        behaviour = [p.detach().clone() for p in learner.model.parameters()]
        storage = DoubleStorage(lambda: RolloutStorage(
            cfg.arch.sync_interval, cfg.env.num_envs, obs_space.shape, torch.from_numpy(obs_space.sample()).dtype,
            model.policy.action_shape(), torch.int64 if model.policy.discrete else torch.float32, learner.device))
        actors = run.closing(Actors(cfg.arch.num_actors, buffer, storage, acting, cfg.algo.gamma, run.telemetry))
        actors.version = learner.version
        sampler = torch.Generator().manual_seed(cfg.seed)
        epochs, minibatches = (cfg.algo.ppo_epochs, cfg.algo.ppo_minibatches) if cfg.algo.name == "ppo" else (1, 1)
        env_seconds, rounds = 0.0, 0
        buffer.start_round()
        while _wait_round(run, buffer, actors, storage):
            full, episode_returns = storage.swap()
            rounds += 1
            # The parameters that just acted become the gradient point; the learner's latest act next.
            _copy(behaviour, acting.parameters())
            _copy(acting.parameters(), learner.model.parameters())
            actors.version = learner.version
            for t in range(storage.T):  # (step, env) order, whatever order the actors served them in
                run.record_env_step(storage.B, episode_returns[t])
            run.telemetry.add_time("env", buffer.env_seconds - env_seconds)
            env_seconds, run.telemetry.env_errors = buffer.env_seconds, buffer.env_errors
            if run.should_stop():
                break
            buffer.start_round()
            with run.timer("learn"):
                run.telemetry.add_lag(learner.version, full.policy_version.cpu())
                metrics = delayed_update(learner, behaviour, full.batch(), epochs, minibatches, sampler)
            run.after_update(learner, metrics)
        return run.finish(learner, num_actors=cfg.arch.num_actors, num_executors=cfg.env.num_workers,
                          sync_interval=cfg.arch.sync_interval, rounds=rounds)
