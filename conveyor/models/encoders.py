"""Observation encoders: ``build(obs_shape, cfg) -> (module, feature_size)``.

``mlp`` for flat vectors; ``nips_cnn`` (Mnih et al. 2013: 16 8x8/4, 32 4x4/2,
fc256) and ``nature_cnn`` (Mnih et al. 2015: 32 8x8/4, 64 4x4/2, 64 3x3/1,
fc512) as used by PAAC and GA3C; ``impala_resnet`` (Espeholt et al. 2018:
three stacks of conv + max-pool + two residual blocks, fc256) for IMPALA/SEED;
``minatar_cnn`` (Young & Tian 2019: 16 3x3/1, fc128, ReLU) for the 10x10 MinAtar
frames, the network of the MinAtar paper's experiments.

``custom(ref, observation_space, cfg)`` builds an encoder of your own,
``ModelCfg.name = "MODULE:CLASS"``: ``CLASS(observation_space, **kwargs)``,
where ``kwargs`` holds those of ``ENCODER_KWARGS`` its signature names (all of
them if it takes ``**kwargs``), must be an ``nn.Module`` with an integer
``out_features`` whose forward maps float observations ``[N, *obs_shape]``
(uint8 pixels already scaled to [0, 1], normalized ones standardized) to
features ``[N, out_features]``. One forward on two samples of the space, at
build time, checks that; a mismatch is a one-line ``ConfigError``.
"""

from __future__ import annotations

import inspect
import math
import traceback
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from conveyor.config import ModelCfg
from conveyor.errors import ConfigError
from conveyor.imports import import_object


class Layers(nn.Sequential):
    """``nn.Sequential`` whose forward runs each layer's ``forward`` directly. ``nn.Module.__call__`` checks for
    hooks (which no built-in model uses) around every layer, and on the 2-core CPU that costs 10-20 us a layer:
    half of a 64x64 MLP's forward on 16 rows, which PAAC runs at every env step. The layers, their parameters'
    names and their numbers are ``nn.Sequential``'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self._modules.values():
            x = layer.forward(x)  # type: ignore[union-attr]
        return x


def orthogonal_init(module: nn.Module, gain: float = math.sqrt(2)) -> nn.Module:
    """Every linear and conv layer of ``module`` orthogonal with ``gain``, zero biases (``weight_init
    orthogonal``; the built-in encoders are built with PyTorch's default init)."""
    for layer in module.modules():
        if isinstance(layer, (nn.Linear, nn.Conv2d)):
            nn.init.orthogonal_(layer.weight, gain)
            nn.init.zeros_(layer.bias)
    return module


def _conv_out(convs: nn.Module, obs_shape: tuple[int, ...]) -> int:
    with torch.no_grad():
        return int(convs(torch.zeros(1, *obs_shape)).numel())


def mlp(obs_shape: tuple[int, ...], cfg: ModelCfg) -> tuple[nn.Module, int]:
    layers: list[nn.Module] = []
    size = obs_shape[0]
    for width in cfg.hidden:
        layers += [nn.Linear(size, width), nn.Tanh()]
        size = width
    return Layers(*layers), size


def _dqn_cnn(obs_shape: tuple[int, ...], convs: list[tuple[int, int, int]], fc: int) -> tuple[nn.Module, int]:
    layers: list[nn.Module] = []
    channels = obs_shape[0]
    for out, kernel, stride in convs:
        layers += [nn.Conv2d(channels, out, kernel, stride), nn.ReLU()]
        channels = out
    conv = Layers(*layers, nn.Flatten())
    net = Layers(conv, nn.Linear(_conv_out(conv, obs_shape), fc), nn.ReLU())
    return net, fc


def nips_cnn(obs_shape: tuple[int, ...], cfg: ModelCfg) -> tuple[nn.Module, int]:
    return _dqn_cnn(obs_shape, [(16, 8, 4), (32, 4, 2)], 256)


def nature_cnn(obs_shape: tuple[int, ...], cfg: ModelCfg) -> tuple[nn.Module, int]:
    return _dqn_cnn(obs_shape, [(32, 8, 4), (64, 4, 2), (64, 3, 1)], 512)


def minatar_cnn(obs_shape: tuple[int, ...], cfg: ModelCfg) -> tuple[nn.Module, int]:
    return _dqn_cnn(obs_shape, [(16, 3, 1)], 128)


class _Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


def impala_resnet(obs_shape: tuple[int, ...], cfg: ModelCfg) -> tuple[nn.Module, int]:
    layers: list[nn.Module] = []
    channels = obs_shape[0]
    for out in (16, 32, 32):
        layers += [nn.Conv2d(channels, out, 3, padding=1), nn.MaxPool2d(3, 2, padding=1), _Residual(out), _Residual(out)]
        channels = out
    conv = Layers(*layers, nn.ReLU(), nn.Flatten())
    net = Layers(conv, nn.Linear(_conv_out(conv, obs_shape), 256), nn.ReLU())
    return net, 256


ENCODERS: dict[str, Callable[[tuple[int, ...], ModelCfg], tuple[nn.Module, int]]] = {
    "mlp": mlp,
    "nips_cnn": nips_cnn,
    "nature_cnn": nature_cnn,
    "impala_resnet": impala_resnet,
    "minatar_cnn": minatar_cnn,
}


ENCODER_KWARGS = ("hidden",)
"""The ``ModelCfg`` fields an encoder of your own may take as keyword arguments (``hidden``: ``--hidden``)."""


def _offered(factory: Callable[..., Any], cfg: ModelCfg) -> dict[str, Any]:
    """The ``ENCODER_KWARGS`` values ``factory``'s signature takes (by name, or all through ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return {}
    takes_all = any(param.kind is param.VAR_KEYWORD for param in params)
    names = {param.name for param in params if param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD)}
    return {name: getattr(cfg, name) for name in ENCODER_KWARGS
            if (takes_all or name in names) and getattr(cfg, name) is not None}


def _raised(error: BaseException) -> str:
    frame = traceback.extract_tb(error.__traceback__)[-1:]
    where = f" at {frame[0].filename}:{frame[0].lineno}" if frame else ""
    return f"{type(error).__name__}: {' '.join(str(error).split())}{where}"


def custom(ref: str, observation_space: gym.spaces.Box, cfg: ModelCfg) -> tuple[nn.Module, int]:
    """The encoder ``ref`` (``MODULE:CLASS``) names, built and checked (see the module docstring)."""
    factory = import_object(ref, f"--model {ref!r}")
    kwargs = _offered(factory, cfg)
    call = f"{ref}(obs_space{''.join(f', {name}=...' for name in kwargs)})"
    try:
        encoder = factory(observation_space, **kwargs)
    except Exception as error:
        raise ConfigError(f"encoder {call} raised {_raised(error)}: it must build from (obs_space, **kwargs)"
                          ) from None
    if not isinstance(encoder, nn.Module):
        raise ConfigError(f"encoder {call} returned a {type(encoder).__name__}: it must be a torch.nn.Module")
    features = getattr(encoder, "out_features", None)
    if isinstance(features, bool) or not isinstance(features, (int, np.integer)) or features <= 0:
        raise ConfigError(f"encoder {ref} has out_features {features!r}: set self.out_features to the (positive "
                          "int) size of the features its forward returns")
    samples = np.stack([observation_space.sample() for _ in range(2)])
    x = torch.as_tensor(samples)
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    training = encoder.training
    try:
        with torch.no_grad():
            out = encoder.eval()(x)
    except Exception as error:
        raise ConfigError(f"encoder {ref} failed on two sample observations {list(x.shape)}: {_raised(error)}: its "
                          "forward must take float observations [N, *obs_shape]") from None
    finally:
        encoder.train(training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, int(features)):
        found = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"encoder {ref} returned {found} for observations {list(x.shape)}: its forward must return "
                          f"features [N, out_features] = [2, {int(features)}]")
    return encoder, int(features)
