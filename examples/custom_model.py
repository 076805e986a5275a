"""A network of your own: ``MyEncoder``, an MLP with layer normalization, as conveyor's encoder (torso).

conveyor builds it as ``MyEncoder(obs_space, hidden=...)`` and puts its own
policy and value heads (and an LSTM core with ``--lstm-size``) on its
``out_features`` features (run from the repository root, or put this
directory on ``PYTHONPATH``)::

    conveyor train --model examples.custom_model:MyEncoder
    conveyor train --env examples.custom_env:Corridor-v0 --model examples.custom_model:MyEncoder --hidden 32

The first solves CartPole-v1 as the default MLP does (mean return 475 after
167k env steps with ``--seed 1``; the default MLP: 173k);
``config.json`` records the name, so ``conveyor train --resume DIR`` and
``conveyor eval DIR`` rebuild the same network. From Python, pass the class
itself: ``conveyor.ModelCfg(name=MyEncoder)`` (kept as
``examples.custom_model:MyEncoder``).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from torch import Tensor, nn


class MyEncoder(nn.Module):
    """Observations ``[N, *obs_space.shape]`` (flattened) -> ``[N, out_features]``: per layer of ``hidden``,
    Linear, LayerNorm, Tanh."""

    def __init__(self, obs_space: gym.spaces.Box, hidden: tuple[int, ...] = (64, 64)) -> None:
        super().__init__()
        size = int(np.prod(obs_space.shape))
        layers: list[nn.Module] = [nn.Flatten()]
        for width in hidden:
            layers += [nn.Linear(size, width), nn.LayerNorm(width), nn.Tanh()]
            size = width
        self.net = nn.Sequential(*layers)
        self.out_features = size  # conveyor's heads read this many features

    def forward(self, obs: Tensor) -> Tensor:
        return self.net(obs)
