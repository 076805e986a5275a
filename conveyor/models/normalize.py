"""``ObsNormalizer``: running per-feature mean and variance of observations at a model's input.

The statistics are buffers (``mean``, ``var``, ``count``, all float32 so weight
broadcasts that carry floats only take them too): they are saved in
checkpoints and travel with ``state_dict`` to every copy of the model. Only
``update`` changes them; the learner calls it once per update with that
batch's observations, so acting forwards never move them and a seeded run
stays deterministic. Before the first update the statistics are the identity
(mean 0, variance 1).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

CLIP = 10.0
"""Standardized observations are clipped to [-CLIP, CLIP] (as SB3's ``VecNormalize``)."""
EPS = 1e-8
"""Added to the variance under the square root, so a constant feature maps to 0, not to inf."""


class ObsNormalizer(nn.Module):
    def __init__(self, obs_shape: tuple[int, ...]):
        super().__init__()
        self.register_buffer("mean", torch.zeros(obs_shape))
        self.register_buffer("var", torch.ones(obs_shape))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``[N, *obs_shape]`` float, standardized and clipped."""
        return ((x - self.mean) / torch.sqrt(self.var + EPS)).clamp(-CLIP, CLIP)

    @torch.no_grad()
    def update(self, obs: Tensor) -> None:
        """Fold observations ``[..., *obs_shape]`` into the statistics (Chan et al.'s pairwise combination of
        two (count, mean, variance) summaries, so the result equals the statistics of all data seen)."""
        x = obs.reshape(-1, *self.mean.shape).to(self.mean.device, torch.float32)
        n = x.shape[0]
        if n == 0:
            return
        batch_mean = x.mean(0)
        batch_var = x.var(0, unbiased=False)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * (n / total)
        self.var.copy_((self.var * self.count + batch_var * n + delta.square() * (self.count * n / total)) / total)
        self.count.copy_(total)
