"""Observation encoders: ``build(obs_shape, cfg) -> (module, feature_size)``.

``mlp`` for flat vectors; ``nips_cnn`` (Mnih et al. 2013: 16 8x8/4, 32 4x4/2,
fc256) and ``nature_cnn`` (Mnih et al. 2015: 32 8x8/4, 64 4x4/2, 64 3x3/1,
fc512) as used by PAAC and GA3C; ``impala_resnet`` (Espeholt et al. 2018:
three stacks of conv + max-pool + two residual blocks, fc256) for IMPALA/SEED;
``minatar_cnn`` (Young & Tian 2019: 16 3x3/1, fc128, ReLU) for the 10x10 MinAtar
frames, the network of the MinAtar paper's experiments.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from conveyor.config import ModelCfg


def _orthogonal(module: nn.Module, gain: float = math.sqrt(2)) -> nn.Module:
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
    return _orthogonal(nn.Sequential(*layers)), size


def _dqn_cnn(obs_shape: tuple[int, ...], convs: list[tuple[int, int, int]], fc: int) -> tuple[nn.Module, int]:
    layers: list[nn.Module] = []
    channels = obs_shape[0]
    for out, kernel, stride in convs:
        layers += [nn.Conv2d(channels, out, kernel, stride), nn.ReLU()]
        channels = out
    conv = nn.Sequential(*layers, nn.Flatten())
    net = nn.Sequential(conv, nn.Linear(_conv_out(conv, obs_shape), fc), nn.ReLU())
    return _orthogonal(net), fc


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
    conv = nn.Sequential(*layers, nn.ReLU(), nn.Flatten())
    net = nn.Sequential(conv, nn.Linear(_conv_out(conv, obs_shape), 256), nn.ReLU())
    return _orthogonal(net), 256


ENCODERS: dict[str, Callable[[tuple[int, ...], ModelCfg], tuple[nn.Module, int]]] = {
    "mlp": mlp,
    "nips_cnn": nips_cnn,
    "nature_cnn": nature_cnn,
    "impala_resnet": impala_resnet,
    "minatar_cnn": minatar_cnn,
}
