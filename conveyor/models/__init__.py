"""Networks: an encoder, an optional LSTM core, and policy/value or dueling-Q heads.

All models take time-major observations ``[T, B, *obs_shape]`` and return a
``ModelOut``. uint8 observations (Atari frames) are scaled to [0, 1] inside
the model so storage and transport keep the compact dtype; observations may
be standardized by running statistics (``ModelCfg.normalize_obs``,
``ObsNormalizer``), and the value head's targets too
(``ModelCfg.normalize_values``, ``ValueNormalizer``), kept as buffers, so
they travel with the weights. The
encoder is one of ``encoders.ENCODERS`` or your own (``--model MODULE:CLASS``,
``encoders.custom``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from conveyor.config import ModelCfg
from conveyor.errors import ConfigError
from conveyor.imports import is_ref
from conveyor.models import encoders
from conveyor.models.encoders import ENCODERS, Layers
from conveyor.models.heads import Categorical, DiagGaussian, ModelOut, PolicyFamily
from conveyor.models.normalize import ObsNormalizer, ValueNormalizer

__all__ = ["ActorCritic", "ModelOut", "Categorical", "DiagGaussian", "ObsNormalizer", "PolicyFamily", "ValueNormalizer",
           "make_model", "policy_family"]


def policy_family(action_space: gym.Space) -> PolicyFamily:
    if isinstance(action_space, gym.spaces.Discrete):
        return Categorical(int(action_space.n))
    if isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
        return DiagGaussian(int(action_space.shape[0]))
    raise ConfigError(f"action space {action_space} is not supported: use a Discrete or 1-D Box action space")


GSDE_EPS = 1e-6
"""Added to gSDE's variance phi(s)^2 @ sigma^2 before the square root (SB3's ``StateDependentNoiseDistribution``
epsilon): the std stays positive where the features vanish."""


CHANNELS_LAST_ENCODERS = ("nature_cnn", "nips_cnn", "impala_resnet")
"""The encoders that read their frames channels-last on the CPU when a gradient will flow (``ActorCritic``)."""


def _init_linear(layer: nn.Linear, gain: float, weight_init: str) -> nn.Linear:
    """``layer`` orthogonal with ``gain`` and a zero bias (``weight_init`` orthogonal), else as PyTorch made it."""
    if weight_init == "orthogonal":
        nn.init.orthogonal_(layer.weight, gain)
        nn.init.zeros_(layer.bias)
    return layer


class ActorCritic(nn.Module):
    """[ObsNormalizer] -> encoder -> [LSTM core] -> policy head + value head (or a dueling Q head).

    ``forward(obs [T, B, ...], state, done [T, B], prev_action [T, B(, A)], prev_reward [T, B])``.
    The LSTM takes the previous action (one-hot for discrete actions, the action
    vector for continuous ones) and the previous reward with the features
    (R2D2, IMPALA) and resets its state where ``done`` marks a new episode.
    With ``separate_value_net`` the value head reads a second encoder of the
    same architecture (no LSTM core, no dueling head). With ``gsde`` the
    Gaussian's log-std is state-dependent (``ModelCfg.gsde``) and the output
    carries the features it is computed from, for ``acting.GsdeNoise``. ``obs_normalizer`` is
    None unless ``normalize_obs``; its statistics change only through
    ``Learner.apply_gradients``, never in ``forward``. ``value_normalizer`` is None unless
    ``normalize_values``: the value head's output is then standardized, and ``value`` its denormalized
    (env-unit) value; its statistics change only through ``Learner.fit_value_targets``.
    """

    def __init__(self, obs_shape: tuple[int, ...], action_space: gym.Space, cfg: ModelCfg, dueling: bool = False,
                 observation_space: gym.spaces.Box | None = None):
        """``observation_space`` (default: an unbounded float32 Box of ``obs_shape``) is what an encoder of your
        own (``MODULE:CLASS``) is built from."""
        super().__init__()
        self.obs_shape = tuple(obs_shape)
        self.policy = policy_family(action_space)
        self.dueling = dueling
        name = cfg.name
        if name == "auto":
            name = "nature_cnn" if len(obs_shape) == 3 else "mlp"
        custom = is_ref(name)
        if not custom and name != "mlp" and len(obs_shape) != 3:
            raise ConfigError(f"model {name} needs image observations [C, H, W], got shape {obs_shape}: use --model mlp")
        if name == "mlp" and len(obs_shape) != 1:
            raise ConfigError(f"model mlp needs flat observations, got shape {obs_shape}: use --model nature_cnn")
        if observation_space is None:
            observation_space = gym.spaces.Box(-np.inf, np.inf, self.obs_shape, np.float32)

        def build() -> tuple[nn.Module, int]:
            if custom:
                return encoders.custom(name, observation_space, cfg)
            encoder, size = ENCODERS[name](self.obs_shape, cfg)
            if cfg.weight_init == "orthogonal":
                encoders.orthogonal_init(encoder)
            return encoder, size

        self.encoder_name = name
        # The built-in CNNs of 84x84 frames read them channels-last on the CPU where a gradient will flow: oneDNN's
        # NHWC convolutions made the Nature CNN's forward and backward 1.38x faster on PPO's minibatch of 256 and
        # 1.14x on A2C's five acting forwards of 32 (the IMPALA ResNet's 1.56x), where a forward without a graph
        # (acting) and the MinAtar CNN's 10x10 frames were 2-10% slower (benchmarks/cnn_layout.py;
        # docs/benchmarks-log.md "Channels-last frames"). The numbers are the same up to float rounding. An
        # encoder of your own gets its input as it is.
        self.channels_last_frames = name in CHANNELS_LAST_ENCODERS
        frames = observation_space.dtype == np.uint8
        self.obs_normalizer = ObsNormalizer(self.obs_shape, frames=frames) if cfg.normalize_obs else None
        self.encoder, feat = build()
        if cfg.separate_value_net and dueling:
            raise ConfigError("separate_value_net splits the policy and value trunks, and a dueling Q head has "
                              "neither: drop --separate-value-net")
        self.value_encoder = build()[0] if cfg.separate_value_net else None
        self.gsde = bool(cfg.gsde)
        if self.gsde and (self.policy.discrete or dueling):
            raise ConfigError("gsde is exploration for continuous actions, and this env's actions are discrete: "
                              "drop --gsde")
        self.lstm_size = cfg.lstm_size
        self.num_actions = self.policy.param_size if self.policy.discrete else 0
        if self.lstm_size:
            extra = self.policy.param_size if self.policy.discrete else self.policy.action_dim
            extra += 1  # previous action (one-hot or the vector), previous reward
            self.core = nn.LSTM(feat + extra, self.lstm_size)
            feat = self.lstm_size
        if dueling:
            if not self.policy.discrete:
                raise ConfigError("a dueling Q head needs a discrete action space: use a discrete env with r2d2")
            init = cfg.weight_init
            self.advantage = Layers(_init_linear(nn.Linear(feat, 512), math.sqrt(2), init), nn.ReLU(),
                                    _init_linear(nn.Linear(512, self.policy.param_size), 1.0, init))
            self.state_value = Layers(_init_linear(nn.Linear(feat, 512), math.sqrt(2), init), nn.ReLU(),
                                      _init_linear(nn.Linear(512, 1), 1.0, init))
        else:
            out = self.policy.param_size if self.policy.discrete else self.policy.action_dim
            self.policy_head = _init_linear(nn.Linear(feat, out), 0.01, cfg.weight_init)
            if not self.policy.discrete:
                # gSDE: sigma [features, A] (log_std holds its log); else one log-std per action dimension.
                shape = (feat, self.policy.action_dim) if self.gsde else (self.policy.action_dim,)
                self.log_std = nn.Parameter(torch.full(shape, float(cfg.log_std_init)))
            self.value_head = _init_linear(nn.Linear(feat, 1), 1.0, cfg.weight_init)
        self.value_normalizer = ValueNormalizer() if cfg.normalize_values and not dueling else None

    def initial_state(self, batch_size: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor] | None:
        if not self.lstm_size:
            return None
        zeros = torch.zeros(1, batch_size, self.lstm_size, device=device)
        return (zeros, zeros.clone())

    def forward(self, obs: Tensor, state: Any = None, done: Tensor | None = None,
                prev_action: Tensor | None = None, prev_reward: Tensor | None = None) -> ModelOut:
        if obs.shape[2:] != self.obs_shape:
            raise ValueError(f"observation shape {tuple(obs.shape[2:])} does not match the model's {self.obs_shape}")
        T, B = obs.shape[:2]
        x = self._inputs(obs.reshape(T * B, *self.obs_shape))
        # The heads read the [T * B, F] rows and their outputs take the [T, B] shape once, at the end: a linear layer
        # on [T, B, F] views its input and its output as 2-D around its matmul (two autograd nodes a head, a few
        # microseconds each of a small model's update). The numbers are the same.
        feat = _rows(self.encoder(x))
        if self.lstm_size:
            core_out, state = self._core(feat.view(T, B, -1), state, done, prev_action, prev_reward)
            feat = core_out.flatten(0, 1)
        if self.dueling:
            adv = self.advantage(feat)
            q = (self.state_value(feat) + adv - adv.mean(-1, keepdim=True)).view(T, B, -1)
            return ModelOut(self.policy, q, q.max(-1).values, state, q)
        value = self._value(x, feat).view(T, B)
        if self.gsde:  # std(s) = sqrt(phi(s)^2 @ sigma^2): the std of the action gSDE's acting adds, phi(s) @ W
            features = feat.detach()
            log_std = 0.5 * torch.log(features.pow(2) @ torch.exp(2 * self.log_std) + GSDE_EPS)
            params = torch.cat([self.policy_head.forward(feat), log_std], dim=-1)
            return ModelOut(self.policy, params.view(T, B, -1), value, state, features=features.view(T, B, -1))
        return ModelOut(self.policy, self._params(feat).view(T, B, -1), value, state)

    @property
    def acts_on_rows(self) -> bool:
        """Whether ``act_rows`` can run this model: feed-forward, policy and value heads, no gSDE features."""
        return not (self.lstm_size or self.dueling or self.gsde)

    def act_rows(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """The policy params ``[B, P]`` and values ``[B]`` of one step of B envs, ``obs [B, *obs_shape]``: the
        numbers of ``forward`` on ``obs[None]``, without its ``[T, B]`` reshapes and views, which an acting step
        of a small model pays for every step (PAAC on CartPole: about a tenth of the step). For models with
        ``acts_on_rows`` only."""
        if obs.shape[1:] != self.obs_shape:
            raise ValueError(f"observation shape {tuple(obs.shape[1:])} does not match the model's {self.obs_shape}")
        x = self._inputs(obs)
        feat = _rows(self.encoder(x))
        return self._params(feat), self._value(x, feat).view(-1)

    def _inputs(self, x: Tensor) -> Tensor:
        """Observation rows as the encoder reads them: float, frames scaled to [0, 1], standardized if asked."""
        channels_last = self.channels_last_frames and x.device.type == "cpu" and torch.is_grad_enabled()
        layout = torch.channels_last if channels_last else torch.preserve_format
        if x.dtype == torch.uint8:
            x = x.to(torch.float32, memory_format=layout)
            # The normalizer scales frames itself, in the same pass as it standardizes them.
            return x / 255.0 if self.obs_normalizer is None else self.obs_normalizer(x)
        if x.dtype != torch.float32 or channels_last:
            x = x.to(torch.float32, memory_format=layout)
        return x if self.obs_normalizer is None else self.obs_normalizer(x)

    def _params(self, feat: Tensor) -> Tensor:
        """The policy head's params ``[N, P]`` of feature rows ``[N, F]`` (without gSDE)."""
        params = self.policy_head.forward(feat)  # the heads' own forward, not their __call__: see ``encoders.Layers``
        if not self.policy.discrete:
            params = torch.cat([params, self.log_std.expand_as(params)], dim=-1)
        return params

    def _value(self, x: Tensor, feat: Tensor) -> Tensor:
        """V ``[N, 1]`` of the input rows ``x`` whose policy features are ``feat`` (in env units: the head's output
        denormalized with ``normalize_values``)."""
        value = self.value_head.forward(feat if self.value_encoder is None else _rows(self.value_encoder(x)))
        return value if self.value_normalizer is None else self.value_normalizer.denormalize(value)

    def _core(self, feat: Tensor, state: Any, done: Tensor | None, prev_action: Tensor | None,
              prev_reward: Tensor | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        T, B = feat.shape[:2]
        if prev_action is None:
            prev_action = torch.zeros(T, B, *self.policy.action_shape(), device=feat.device)
        if prev_reward is None:
            prev_reward = torch.zeros(T, B, device=feat.device)
        if self.policy.discrete:
            previous = nn.functional.one_hot(prev_action.long(), self.num_actions).float()
        else:
            previous = prev_action.float()
        inputs = torch.cat([feat, previous, prev_reward.float().unsqueeze(-1)], dim=-1)
        if state is None:
            state = self.initial_state(B, feat.device)
        if done is None:
            out, state = self.core(inputs, state)
            return out, state
        outputs = []
        for t in range(T):
            keep = (1.0 - done[t].float()).view(1, B, 1)
            state = (state[0] * keep, state[1] * keep)
            out, state = self.core(inputs[t : t + 1], state)
            outputs.append(out)
        return torch.cat(outputs), state


def _rows(features: Tensor) -> Tensor:
    """An encoder's output as ``[N, F]`` rows (a CNN's ``[N, C, H, W]`` flattened; rows are left as they are)."""
    return features if features.dim() == 2 else features.flatten(1)


def make_model(cfg: ModelCfg, observation_space: gym.Space, action_space: gym.Space, dueling: bool = False) -> ActorCritic:
    if not isinstance(observation_space, gym.spaces.Box):
        raise ConfigError(f"observation space {observation_space} is not supported: use a Box observation space")
    return ActorCritic(tuple(observation_space.shape), action_space, cfg, dueling, observation_space)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on its device that takes no gradients (a target or acting network).

    A deep copy leaves a cuda LSTM's weights in separate tensors, and cuDNN then compacts them into one chunk again
    at every call: the copy's recurrent layers are flattened once here instead.
    """
    clone = copy.deepcopy(model).requires_grad_(False)
    for module in clone.modules():
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return clone


def parameter_count(model: nn.Module) -> int:
    return int(sum(np.prod(p.shape) for p in model.parameters()))
