"""HTS-RL's actor threads (Liu et al. 2020), wired by ``conveyor.architectures.hts.run``.

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
import time
from typing import Iterator

import numpy as np
import torch
from torch import nn

from conveyor.acting import GsdeNoise, step_targets, values_of
from conveyor.envs.history import EnvHistory
from conveyor.storage.double import DoubleStorage
from conveyor.telemetry import Telemetry
from conveyor.transfer import to_device
from conveyor.architectures.hts.state_buffer import StateBuffer

POLL_S = 0.1
"""Longest an actor or the main thread waits before checking for stop and dead executors."""


class Actors:
    """Actor threads serving the state buffer with ``model`` (the acting parameters, stamped ``version``) in
    round ``round``. A gSDE model's actions take ``gsde``'s noise of env e at its step ``round * T + t``: a
    function of the seed, the env and the step alone, as the executors' uniforms are."""

    def __init__(self, num: int, buffer: StateBuffer, storage: DoubleStorage, model: nn.Module, gamma: float,
                 telemetry: Telemetry, gsde: GsdeNoise | None = None):
        self.buffer, self.storage, self.model, self.gamma, self.telemetry = buffer, storage, model, gamma, telemetry
        self.gsde = gsde
        self.version = 0
        self.round = 0
        self.device = next(model.parameters()).device
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._gate = threading.Condition()
        self._paused = False
        self._serving = 0
        self._solo = num == 1
        """One actor: it may answer before it writes the storage (``_serve``)."""
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
        # Row i is env i in every forward: the batch never changes shape, so neither do a row's floats. The
        # rows are staged in host memory (numpy: a few rows change per serve) and the forward reads them whole.
        obs_dtype = self.storage.filling.obs.numpy().dtype
        inputs = np.zeros(self.buffer.obs.shape, obs_dtype)
        finals = np.zeros_like(inputs)
        try:
            while not self._stop.is_set():
                with self._gate:
                    if not self._gate.wait_for(lambda: not self._paused, POLL_S):
                        continue
                    self._serving += 1
                try:
                    envs = self.buffer.take_ready(POLL_S)
                    if len(envs):
                        start = time.perf_counter()
                        self._serve(envs, inputs, finals)
                        self.telemetry.add_time("act", time.perf_counter() - start)
                        self.telemetry.count("actor_forwards")
                        self.telemetry.count("actor_requests", len(envs))
                finally:
                    with self._gate:
                        self._serving -= 1
                        if self._paused:
                            self._gate.notify_all()
        except BaseException as error:  # reported by check() in the main thread
            self.error = error

    @torch.inference_mode()
    def _serve(self, envs: np.ndarray, inputs: np.ndarray, finals: np.ndarray) -> None:
        """Answer the requests of ``envs``: one forward over every row, the actions, the storage cells.

        Everything but the forward, the sampling and the truncation bootstrap is numpy on a few rows (a torch
        op on a handful of numbers costs microseconds; this runs for every env step). Order: every field of the
        requests is copied first (an executor rewrites its row once answered). A lone actor sends the actions
        right after sampling and writes the storage while the envs step (nobody else can serve these envs'
        next requests, so the round cannot complete meanwhile); with several, results and actions are in the
        storage before the actions go out (an env served next by another actor may complete the round). The
        last writes, which may complete the round, come after the rest.
        """
        buffer, storage, model, device = self.buffer, self.storage, self.model, self.device
        t = buffer.request_step[envs]
        inputs[envs] = buffer.obs[envs]
        result, act, last = t > 0, t < storage.T, t == storage.T  # result: step t-1 ended
        acting, ending = envs[act], envs[result]
        if len(ending):
            reward, episode_return = buffer.reward[ending], buffer.episode_return[ending]
            new_game = buffer.new_game[ending]
            terminated, truncated = buffer.terminated[ending], buffer.truncated[ending]
            cut = truncated & ~terminated
            if cut.any():
                finals[ending[cut]] = buffer.final_obs[ending[cut]]
        out = model(to_device(inputs, device).unsqueeze(0))
        value = out.value[0].cpu().numpy()
        if len(acting):
            rows = to_device(acting, device)
            params = out.params[0][rows]
            if self.gsde is not None:
                actions = self.gsde.actions(model, params, out.features[0][rows], buffer.env_offset + acting,
                                            self.round * storage.T + t[act])
            else:
                actions = out.policy.sample(params, to_device(buffer.uniform[acting], device))
            logp = out.policy.log_prob(params, actions).cpu().numpy()
            actions = actions.cpu().numpy()
            if self._solo:
                buffer.send_actions(acting, actions)
        if len(ending):
            if cut.any():  # the truncation bootstrap, V(final_obs) from a fixed-size forward
                final_values = values_of(model, to_device(finals, device))
                final_values = final_values.cpu()[torch.from_numpy(ending)]
                rewards, discounts = step_targets(model, reward, terminated, truncated, None, self.gamma, "cpu",
                                                  final_values)
                rewards, discounts = rewards.numpy(), discounts.numpy()
            else:  # step_targets without a cut row, in numpy: the same float32 values, bit for bit
                rewards = reward.astype(np.float32)
                discounts = np.where(terminated, np.float32(0.0), np.float32(self.gamma))
            storage.write_results(t[result] - 1, ending, rewards, discounts, episode_return, terminated | truncated,
                                  new_game)
        if len(acting):
            storage.write_actions(t[act], acting, inputs[acting], actions, logp, value[acting], self.version)
            if not self._solo:
                buffer.send_actions(acting, actions)
        if last.any():
            storage.write_last(envs[last], inputs[envs[last]], value[envs[last]])


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
