"""The frames' memory layout of the built-in CNNs on the CPU: channels-last (conveyor's) against NCHW, side by side.

conveyor's model hands the built-in CNNs of 84x84 frames their frames channels-last on the CPU where a gradient
will flow (``ActorCritic.channels_last_frames``, ``CHANNELS_LAST_ENCODERS``). This script times both layouts in
turns (channels-last, NCHW, channels-last, ...) so that machine noise hits both alike, on the batches the presets
make:

- ``ppo minibatch``: PPO's update on one minibatch of 256 frames (paac/ppo on Atari: 8 envs x 128 steps in 4
  minibatches), the model's forward and backward;
- ``a2c rollout``: A2C's five acting forwards of 32 envs keeping their graphs, then one backward (paac/a2c on
  Atari reuses the acting graphs); the Nature CNN and the IMPALA ResNet;
- ``acting``: the encoder's forward without a graph on 32 frames converted to each layout: why the model acts on
  NCHW frames;
- the same for the MinAtar CNN (16 envs x 5 steps, and 16 frames acting): why its small frames stay NCHW.

Each row: the median seconds per call of each layout over ``--repeats`` turns, and their ratio (NCHW / channels-last:
above 1, channels-last is faster).

    .venv/bin/python benchmarks/cnn_layout.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import gymnasium as gym
import numpy as np
import torch

from conveyor.config import ModelCfg
from conveyor.models import ActorCritic, make_model

RESULTS = Path(__file__).parent / "results" / "cnn_layout.json"


def model_of(name: str, frame: tuple[int, ...]) -> ActorCritic:
    torch.manual_seed(0)
    cfg = ModelCfg(name=name, hidden=(64, 64), lstm_size=0, normalize_obs=False, separate_value_net=False,
                   log_std_init=0.0)
    return make_model(cfg, gym.spaces.Box(0, 255, frame, np.uint8), gym.spaces.Discrete(6))


def train_calls(model: ActorCritic, obs: torch.Tensor, chunks: int) -> dict[bool, Callable[[], None]]:
    """Per layout (channels-last or not): forwards of ``chunks`` batches ``obs [1, B, ...]`` keeping their graphs,
    then one backward, through the model as it trains (``channels_last_frames`` switched)."""

    def call(channels_last: bool) -> Callable[[], None]:
        def update() -> None:
            kept, model.channels_last_frames = model.channels_last_frames, channels_last
            model.zero_grad(set_to_none=True)
            outs = [model(obs) for _ in range(chunks)]
            sum(out.params.sum() + out.value.sum() for out in outs).backward()
            model.channels_last_frames = kept

        return update

    return {True: call(True), False: call(False)}


def acting_calls(model: ActorCritic, obs: torch.Tensor) -> dict[bool, Callable[[], None]]:
    """Per layout: one forward without a graph of ``obs [B, ...]``'s frames converted to that layout (the model
    itself acts on NCHW frames: this row is why)."""

    def call(layout: torch.memory_format) -> Callable[[], None]:
        def act() -> None:
            with torch.inference_mode():
                x = obs.to(torch.float32, memory_format=layout) / 255.0
                model.encoder(x)

        return act

    return {True: call(torch.channels_last), False: call(torch.contiguous_format)}


def timed(call: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def compare(label: str, calls: dict[bool, Callable[[], None]], count: int, repeats: int) -> dict:
    times: dict[bool, list[float]] = {True: [], False: []}
    for layout in (True, False):  # warm-up: oneDNN builds its kernels for each layout once
        timed(calls[layout], 2)
    for _ in range(repeats):
        for layout in (True, False):
            times[layout].append(timed(calls[layout], count))
    channels_last, nchw = statistics.median(times[True]), statistics.median(times[False])
    row = {"batch": label, "channels_last_s": channels_last, "nchw_s": nchw, "ratio": nchw / channels_last}
    print(f"{label:45s} channels-last {channels_last * 1e3:7.2f} ms  NCHW {nchw * 1e3:7.2f} ms  "
          f"ratio {row['ratio']:.2f}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    nature, minatar = model_of("nature_cnn", (4, 84, 84)), model_of("minatar_cnn", (4, 10, 10))
    impala = model_of("impala_resnet", (4, 84, 84))

    def frames(model: ActorCritic, *shape: int) -> torch.Tensor:
        return torch.randint(0, 256, (*shape, *model.obs_shape), dtype=torch.uint8)

    rows = [
        compare("nature_cnn ppo minibatch: 256, fwd+bwd", train_calls(nature, frames(nature, 1, 256), 1), 6,
                args.repeats),
        compare("nature_cnn a2c rollout: 5 x 32, fwd+bwd", train_calls(nature, frames(nature, 1, 32), 5), 6,
                args.repeats),
        compare("impala_resnet a2c rollout: 5 x 32, fwd+bwd", train_calls(impala, frames(impala, 1, 32), 5), 2,
                args.repeats),
        compare("nature_cnn acting: 32, encoder inference", acting_calls(nature, frames(nature, 32)), 50,
                args.repeats),
        compare("minatar_cnn a2c rollout: 5 x 16, fwd+bwd", train_calls(minatar, frames(minatar, 1, 16), 5), 100,
                args.repeats),
        compare("minatar_cnn acting: 16, encoder inference", acting_calls(minatar, frames(minatar, 16)), 400,
                args.repeats),
    ]
    record = {"command": "benchmarks/cnn_layout.py", "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
                         f"torch {torch.__version__}, {torch.get_num_threads()} torch threads",
              "load_average": os.getloadavg(), "repeats": args.repeats, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
