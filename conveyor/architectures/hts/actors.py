"""HTS-RL's parts (Liu et al. 2020), wired by ``conveyor.architectures.hts.run``.

- ``delayed_update``: the one-step delayed gradient (eq. 6).
- ``Actors``: actor threads serving the state buffer (``state_buffer``)
  with the acting parameters and writing the filling storage; ``paused()``
  holds them between requests while the main thread replaces an executor.
- ``restart_dead_executors``: replaces dead executors so the round in flight
  completes: their envs' cells of the filling storage are voided (counted as
  dropped) and written again by the successor, on the envs' next episodes.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterable, Iterator

import numpy as np
import torch
from torch import Tensor, nn

from conveyor.acting import step_targets, values_of
from conveyor.envs.history import EnvHistory
from conveyor.learner import Learner
from conveyor.storage.double import DoubleStorage
from conveyor.telemetry import Telemetry
from conveyor.architectures.hts.state_buffer import StateBuffer

POLL_S = 0.1
"""Longest an actor or the main thread waits before checking for stop and dead executors."""


@torch.no_grad()
def copy_params(targets: Iterable[Tensor], sources: Iterable[Tensor]) -> None:
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def acting_tensors(model: nn.Module) -> list[Tensor]:
    """What decides a model's actions: its parameters, then its buffers (the input statistics of
    ``normalize_obs``)."""
    return [*model.parameters(), *model.buffers()]


def delayed_update(learner: Learner, behaviour: list[Tensor], batch: dict[str, Tensor], epochs: int = 1,
                   minibatches: int = 1, generator: torch.Generator | None = None,
                   steps: bool = False) -> dict[str, float]:
    """One HTS-RL update (eq. 6): the algorithm's update computed at the behaviour parameters theta_{t-1}
    (``behaviour``, in ``acting_tensors`` order) on the data they collected, applied to theta_t.

    A2C: theta_{t+1} = theta_t + step(g(theta_{t-1})), one optimizer step with the gradient at theta_{t-1}.
    PPO: its ``epochs x minibatches`` steps run from theta_{t-1} exactly as synchronous PPO would (the first
    at ratio 1), and the change they make moves theta_t. Either way it is one policy version. The gradient is
    taken under the input statistics theta_{t-1} acted with; the learner's own statistics then take in the batch.
    ``steps``: minibatches of single steps (``Learner.update_epochs``; ``algos.ppo.epoch_batch`` says when).
    """
    params, buffers = list(learner.model.parameters()), list(learner.model.buffers())
    version = learner.version
    current = [p.detach().clone() for p in params]
    statistics = [b.clone() for b in buffers]
    copy_params(params + buffers, behaviour)
    metrics = learner.update_epochs(batch, epochs, minibatches, generator, steps=steps)
    copy_params(params, [c + (p.detach() - b) for c, p, b in zip(current, params, behaviour)])
    copy_params(buffers, statistics)  # update_epochs folded the batch into theta_{t-1}'s statistics: redo it
    learner.observe(batch["obs"])
    learner.version = version + (learner.version > version)  # one policy version; none if every step was skipped
    return metrics


class Actors:
    """Actor threads serving the state buffer with ``model`` (the acting parameters, stamped ``version``)."""

    def __init__(self, num: int, buffer: StateBuffer, storage: DoubleStorage, model: nn.Module, gamma: float,
                 telemetry: Telemetry):
        self.buffer, self.storage, self.model, self.gamma, self.telemetry = buffer, storage, model, gamma, telemetry
        self.version = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._gate = threading.Condition()
        self._paused = False
        self._serving = 0
        self._threads = [threading.Thread(target=self._loop, name=f"hts-actor-{i}", daemon=True) for i in range(num)]
        for thread in self._threads:
            thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"HTS actor failed: {self.error!r}") from self.error

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold every actor outside the buffer: none holds a request or writes the storage meanwhile."""
        with self._gate:
            self._paused = True
            self._gate.wait_for(lambda: self._serving == 0)
        try:
            yield
        finally:
            with self._gate:
                self._paused = False
                self._gate.notify_all()

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
                with self._gate:
                    if not self._gate.wait_for(lambda: not self._paused, POLL_S):
                        continue
                    self._serving += 1
                try:
                    envs = self.buffer.take_ready(POLL_S)
                    if len(envs):
                        with self.telemetry.timer("act"):
                            self._serve(envs, inputs, finals)
                        self.telemetry.count("actor_forwards")
                        self.telemetry.count("actor_requests", len(envs))
                finally:
                    with self._gate:
                        self._serving -= 1
                        self._gate.notify_all()
        except BaseException as error:  # reported by check() in the main thread
            self.error = error

    @torch.no_grad()
    def _serve(self, envs: np.ndarray, inputs: Tensor, finals: Tensor) -> None:
        buffer, storage, device = self.buffer, self.storage, self.storage.device
        # Read every field of the requests first: an executor rewrites its row once answered.
        t = buffer.request_step[envs]
        uniform = torch.as_tensor(buffer.uniform[envs], device=device)
        reward, terminated, truncated = buffer.reward[envs], buffer.terminated[envs], buffer.truncated[envs]
        episode_return, new_game = buffer.episode_return[envs], buffer.new_game[envs]
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
            storage.write_results(t[result] - 1, envs[result], rewards, discounts, episode_return[result],
                                  (terminated | truncated)[result], new_game[result])
        if act.any():
            actions = out.policy.sample(params[act], uniform[act])
            storage.write_actions(t[act], envs[act], inputs[rows[act]], actions,
                                  out.policy.log_prob(params[act], actions), value[act], self.version)
        if last.any():  # may complete the round: no env of this batch waits for an action then
            storage.write_last(envs[last], inputs[rows[last]], value[last])
        if act.any():
            buffer.send_actions(envs[act], actions.cpu().numpy())


def restart_dead_executors(buffer: StateBuffer, actors: Actors, storage: DoubleStorage, history: EnvHistory,
                           round_index: int, telemetry: Telemetry) -> None:
    """Replace every dead executor (see the module docstring); raise ``WorkerFailure`` past
    ``EnvCfg.max_restarts`` (``StateBuffer.restart_budget``)."""
    for index in buffer.dead_executors():
        buffer.restart_budget.spend(buffer.death(index))
        envs = buffer.envs_of(index)
        with actors.paused():
            dropped = storage.forget(envs)
            # Its dead predecessor may have begun up to alpha episodes this round: their seeds are not reused.
            history.next_episode[envs] += buffer.sync_interval
            episodes = history.next_episode[envs].copy()
            history.start_games(envs)
            buffer.restart(index, episodes, round_index)
        telemetry.add_restart(dropped)
