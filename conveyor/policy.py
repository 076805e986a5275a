"""``load_policy``: a trained run's policy, to play it outside training (``conveyor enjoy`` and ``export``
are built on it).

``load_policy(run_dir, checkpoint="latest", device="cpu")`` reads the run's
``config.json`` (as ``--resume`` and ``conveyor eval`` do), loads a checkpoint
with ``torch.load(weights_only=True)`` and rebuilds the model shaped like it
(a dueling Q head and an LSTM core are read off its keys: R2D2's, or a V-trace
or IMPACT run's with ``--lstm-size``). The model
holds its own input preprocessing: uint8 frames are scaled to [0, 1] and the
observation normalizer's statistics are buffers saved with the weights. What
the env does (Atari frame skip, 84x84 grayscale, frame stack; MinAtar's
channel-first frames) comes from ``Policy.make_env``, the run's env as
``conveyor.envs.make_env`` builds it, with two changes for playing: real games
(no episodic life) and raw rewards (no clipping, no normalization), so the
summed step rewards are the env's score.

``Policy.act(obs, state=None, deterministic=False, reward=None)`` takes raw
observations of that env, one ``obs`` (shape ``observation_space.shape``) or a
batch (a leading dimension), and returns ``(action, state)``: numpy actions
ready for ``env.step`` (a numpy integer, or a float32 vector clipped to the
action bounds; a batch gives a batch), and the recurrent state to pass back
with the next observation (None for feed-forward models). ``state=None``
starts an episode. Actor-critic policies sample their distribution (or take
its mode: argmax logits, the Gaussian mean, with ``deterministic``; a gSDE
policy samples its state-dependent Gaussian afresh each step, as its
training log-probs score it, without per-env noise matrices); Q heads
(R2D2) act greedily, with exploration ``conveyor.evaluate.EVAL_EPSILON`` unless
``deterministic``. A recurrent core also reads the previous action (kept in
the state: the action as the policy chose it, a continuous one before
clipping to the bounds, as in training) and the previous reward: pass the
env's last reward as ``reward`` (its raw value; Atari runs trained on clipped
rewards get its sign, as in training).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from conveyor.config import EnvCfg, RunCfg
from conveyor.errors import ConfigError
from conveyor.envs import env_spaces, make_env
from conveyor.evaluate import EVAL_EPSILON, load_run_config, model_for_checkpoint
from conveyor.learner import CheckpointError, checkpoint_file, load_checkpoint, load_latest_checkpoint
from conveyor.models import ModelOut
from conveyor.transfer import to_device, usable_device


class RecurrentState(NamedTuple):
    """A recurrent policy's state between two ``act`` calls (treat it as opaque): the LSTM's ``h`` and ``c``
    ``[1, B, H]`` and the previous actions, ``[B]`` int64 (the core reads them one-hot) or ``[B, A]`` float32."""

    h: Tensor
    c: Tensor
    prev_action: Tensor


INVALID_ACTION = -1
"""The discrete action ``InferenceNet`` (an exported file) gives for an observation with NaN or inf."""


class InferenceNet(nn.Module):
    """The model with what acting adds, as one module of tensors in and out (``conveyor export`` traces it).

    ``forward(obs [B, *obs_shape] raw dtype[, state_h [1, B, H], state_c, prev_action [B(, A)], prev_reward [B]])``
    returns ``(action, head, value[, next_state_h, next_state_c])``: ``action`` the deterministic action
    (argmax of the logits or of Q; the Gaussian mean clipped to the action bounds), ``head`` the logits,
    the Gaussian mean or Q, ``value`` V(obs) (max Q for a Q head). ``prev_reward`` is the env's raw reward;
    a run trained on Atari's clipped rewards sees its sign, as in training. A row whose float observation holds
    NaN or inf gets ``INVALID_ACTION`` (discrete) or NaN actions (continuous): an exported file cannot raise, and a
    plausible action for a broken observation would hide it (``Policy.act`` raises instead).
    """

    def __init__(self, model: nn.Module, action_space: gym.Space, sign_rewards: bool):
        super().__init__()
        self.model = model
        self.discrete = bool(model.policy.discrete)
        self.q_head = bool(model.dueling)
        self.recurrent = bool(model.lstm_size)
        self.sign_rewards = sign_rewards
        if not self.discrete:
            self.register_buffer("low", torch.as_tensor(action_space.low, dtype=torch.float32))
            self.register_buffer("high", torch.as_tensor(action_space.high, dtype=torch.float32))

    def outputs(self, obs: Tensor, state_h: Tensor | None = None, state_c: Tensor | None = None,
                prev_action: Tensor | None = None, prev_reward: Tensor | None = None) -> tuple[Any, Tensor]:
        """The model's ``ModelOut`` for ``obs`` ``[B, ...]`` (time dimension dropped) and the deterministic actions."""
        model = self.model
        if self.recurrent:  # fed as training's acting fed it (R2D2, V-trace and IMPACT with an LSTM core)
            reward = torch.sign(prev_reward) if self.sign_rewards else prev_reward
            out = model(obs.unsqueeze(0), (state_h, state_c), None, prev_action.unsqueeze(0), reward.unsqueeze(0))
        else:
            out = model(obs.unsqueeze(0))
        out = ModelOut(out.policy, out.params[0], out.value[0], out.state, None if out.q is None else out.q[0])
        if self.discrete:
            greedy = out.params.argmax(-1)
        else:
            greedy = self.clip(out.policy.mode(out.params))
        return out, greedy

    def clip(self, actions: Tensor) -> Tensor:
        """Continuous actions clipped to the action space's bounds (what IMPACT's workers send their envs)."""
        return torch.minimum(torch.maximum(actions, self.low), self.high)

    def forward(self, obs: Tensor, state_h: Tensor | None = None, state_c: Tensor | None = None,
                prev_action: Tensor | None = None, prev_reward: Tensor | None = None) -> tuple[Tensor, ...]:
        out, greedy = self.outputs(obs, state_h, state_c, prev_action, prev_reward)
        if obs.is_floating_point():  # an exported file cannot raise: a row with NaN or inf gets no usable action
            bad = ~torch.isfinite(obs.flatten(1)).all(1)
            if self.discrete:
                greedy = torch.where(bad, torch.full_like(greedy, INVALID_ACTION), greedy)
            else:
                greedy = torch.where(bad.unsqueeze(-1), torch.full_like(greedy, math.nan), greedy)
        head = out.params if self.discrete else out.policy.mode(out.params)
        if self.recurrent:
            return greedy, head, out.value, out.state[0], out.state[1]
        return greedy, head, out.value


def play_env_cfg(cfg: RunCfg, render_mode: str | None = None) -> EnvCfg:
    """The run's env settings for playing: real games (no episodic life) and raw rewards (no clipping; the
    normalization of ``normalize_reward`` is applied only when ``make_env`` gets a discount, and it gets none
    here); with ``render_mode``, passed to the env's constructor."""
    env = cfg.env if render_mode is None else cfg.env.with_env_args((("render_mode", render_mode),))
    return dataclasses.replace(env, episodic_life=False, clip_rewards=False)


class Policy:
    """A run's policy at one checkpoint (see the module docstring); made by ``load_policy``."""

    def __init__(self, cfg: RunCfg, model: nn.Module, checkpoint: Path, checkpoint_state: dict[str, Any],
                 observation_space: gym.spaces.Box, action_space: gym.Space, device: torch.device,
                 seed: int | None = None):
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.env_steps = int(checkpoint_state.get("env_steps", 0))
        self.version = int(checkpoint_state.get("version", 0))
        self.observation_space = observation_space
        self.action_space = action_space
        self.device = device
        self.model = model.eval().requires_grad_(False)  # inference only (and exported outputs need no .detach())
        sign_rewards = cfg.env.is_atari and cfg.env.clip_rewards
        self.net = InferenceNet(self.model, action_space, sign_rewards).to(device).eval()
        self.generator = torch.Generator()
        self.seed(seed)

    @property
    def recurrent(self) -> bool:
        """Whether the model has an LSTM core (``act`` then returns a state to pass back)."""
        return self.net.recurrent

    @property
    def q_head(self) -> bool:
        """Whether the model is a dueling Q network (R2D2) rather than an actor-critic."""
        return self.net.q_head

    def seed(self, seed: int | None) -> None:
        """Seed the random numbers of ``act`` (sampling, epsilon-greedy exploration); None: from the OS."""
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))

    def make_env(self, seed: int | None = None, render_mode: str | None = None) -> gym.Env:
        """A fresh env as the run's policy expects it (``play_env_cfg``): ``conveyor.envs.make_env`` of the run's
        env settings, reset once with ``seed``; ``render_mode`` (``rgb_array``, ``human``) goes to the env's
        constructor. Each finished game's raw return is also in ``info["episode"]["r"]`` at its last step."""
        return make_env(play_env_cfg(self.cfg, render_mode), seed)  # type: ignore[arg-type]

    def initial_state(self, batch_size: int = 1) -> RecurrentState | None:
        """The state that starts an episode (what ``state=None`` means), for ``batch_size`` envs."""
        if not self.recurrent:
            return None
        h, c = self.model.initial_state(batch_size, self.device)
        dtype = torch.long if self.net.discrete else torch.float32
        shape = (batch_size, *self.model.policy.action_shape())
        return RecurrentState(h, c, torch.zeros(shape, dtype=dtype, device=self.device))

    def reset_state(self, state: RecurrentState | None, starts: np.ndarray) -> RecurrentState | None:
        """``state`` with the rows where ``starts`` [B] is true back at an episode's start (a batch of envs
        whose episodes end at different steps)."""
        if state is None:
            return None
        keep = to_device(~np.asarray(starts, dtype=bool), self.device)
        actions = keep.view(-1, *([1] * (state.prev_action.dim() - 1)))
        return RecurrentState(state.h * keep.view(1, -1, 1), state.c * keep.view(1, -1, 1),
                              state.prev_action * actions)

    def _batch(self, obs: Any, check: bool) -> tuple[Tensor, bool]:
        if check:
            _check_numbers(obs)
        array = np.asarray(obs)
        shape = tuple(self.observation_space.shape)
        if array.shape == shape:
            single = True
            array = array[None]
        elif array.shape[1:] == shape:
            single = False
        else:
            raise ValueError(f"observation shape {array.shape} is neither the env's {shape} nor a batch of them "
                             f"[B, {', '.join(map(str, shape))}]: pass observations of policy.make_env()")
        if array.dtype != self.observation_space.dtype:
            array = array.astype(self.observation_space.dtype)
        return to_device(array, self.device), single

    @torch.no_grad()
    def act(self, obs: Any, state: RecurrentState | None = None, deterministic: bool = False,
            reward: Any = None, check: bool = True) -> tuple[Any, RecurrentState | None]:
        """``(action, state)`` for ``obs`` (one observation, or a batch with a leading dimension); see the module
        docstring. ``state`` None starts an episode; ``reward`` (recurrent policies) is the env's reward of the
        step that led to ``obs`` (0 at an episode's start). Observations that are not numbers (None, strings) or
        not finite (NaN, inf) raise ``ValueError``; ``check=False`` skips that pass over them (speed). An empty
        batch ``[0, *obs_shape]`` gives an empty array of actions (and the state as it was)."""
        x, single = self._batch(obs, check)
        batch_size = x.shape[0]
        if not batch_size:
            empty = np.empty((0, *np.shape(self.action_space.sample())), self.action_space.dtype)
            return empty, state if state is not None or not self.recurrent else self.initial_state(0)
        inputs: tuple[Tensor, ...] = ()
        if self.recurrent:
            if state is None:
                state = self.initial_state(batch_size)
                reward = None
            if state.h.shape[1] != batch_size:
                raise ValueError(f"the state is for {state.h.shape[1]} envs and the observations for {batch_size}")
            prev_reward = torch.zeros(batch_size, device=self.device)
            if reward is not None:
                prev_reward = torch.as_tensor(np.asarray(reward, dtype=np.float32).reshape(batch_size),
                                              device=self.device)
            inputs = (state.h, state.c, state.prev_action, prev_reward)
        out, greedy = self.net.outputs(x, *inputs)
        if deterministic:
            actions = chosen = greedy
        elif self.q_head:
            explore = torch.rand(batch_size, generator=self.generator) < EVAL_EPSILON
            uniform = torch.randint(out.q.shape[-1], (batch_size,), generator=self.generator)
            actions = chosen = torch.where(explore.to(greedy.device), uniform.to(greedy.device), greedy)
        else:
            actions = chosen = out.policy.sample(out.params, None, self.generator)
            if not self.net.discrete:
                actions = self.net.clip(actions)
        next_state = None
        if self.recurrent:
            next_state = RecurrentState(out.state[0], out.state[1], chosen.long() if self.net.discrete else chosen)
        result = actions.cpu().numpy()
        if not self.net.discrete:
            result = result.astype(self.action_space.dtype, copy=False)
        return (result[0] if single else result), next_state

    def describe(self) -> str:
        """One line: what acts (architecture, algorithm, env, checkpoint)."""
        kind = "recurrent " if self.recurrent else ""
        kind += "Q network" if self.q_head else "actor-critic"
        return (f"{self.cfg.arch.name}/{self.cfg.algo.name} on {self.cfg.env.id}, {kind}, checkpoint "
                f"{self.checkpoint.name} ({self.env_steps:,} env steps)")


def _check_numbers(obs: Any) -> None:
    """Raise one ``ValueError`` naming the problem unless ``obs`` is an array (or nested lists) of finite numbers."""
    if obs is None:
        raise ValueError("the observation is None: pass the env's observation (an array), or a batch of them")
    try:
        array = np.asarray(obs)
    except ValueError as error:  # ragged nested lists
        raise ValueError(f"observations are not an array of numbers ({error})") from None
    if array.dtype.kind not in "biuf":
        found = "None among them" if array.dtype == object and any(item is None for item in array.flat) else \
            f"dtype {array.dtype}"
        raise ValueError(f"observations must be numbers, but they hold {found}: pass the env's observations")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        nan, inf = int(np.isnan(array).sum()), int(np.isinf(array).sum())
        raise ValueError(f"observations must be finite, but they hold {nan} NaN and {inf} inf values: fix the env "
                         "or what feeds it (check=False skips this check)")


def load_policy(run_dir: Path | str, checkpoint: str | int | None = "latest", device: str | torch.device = "cpu",
                seed: int | None = None, env_args: tuple[tuple[str, Any], ...] = ()) -> Policy:
    """The policy of the run in ``run_dir`` at ``checkpoint``: ``latest`` (the newest checkpoint that loads), an
    env-step count (``checkpoints/ckpt-<N>.pt``) or a path to a checkpoint file; on ``device``. ``seed`` seeds
    the random numbers of ``act``; ``env_args`` (``(key, value)`` pairs) replace those keys of the run's env
    constructor arguments in the envs it plays (``repeat_action_probability`` 0: Atari without sticky actions).
    A directory without ``config.json`` is a ``ConfigError``, a missing or unreadable checkpoint a
    ``CheckpointError`` (one line each, naming the fix)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist: pass the --out DIR of a conveyor run")
    cfg = load_run_config(run_dir, env_args)
    device = usable_device(device)
    path = checkpoint_file(run_dir, checkpoint)
    if path is None:
        path, state = load_latest_checkpoint(run_dir, device)
    else:
        state = load_checkpoint(path, device)
    observation_space, action_space = env_spaces(play_env_cfg(cfg), cfg.seed)
    model = model_for_checkpoint(cfg, observation_space, action_space, state["model"])
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:
        raise CheckpointError(f"checkpoint {path} does not fit the model of {run_dir}/config.json "
                              f"({str(error).strip().splitlines()[0]})") from None
    return Policy(cfg, model.to(device), path, state, observation_space, action_space, device, seed)
