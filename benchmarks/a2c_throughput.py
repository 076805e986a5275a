"""Training SPS of A2C with 16 envs: conveyor paac/a2c against stable-baselines3 A2C and a minimal in-process A2C
loop, side by side in one run (issue 47: on CartPole paac >= 2x SB3 and >= 1.5x the minimal loop).

All train A2C (t_max 5, RMSProp, one torch thread) on 16 envs of ``--env`` for the same number of env steps, in
turns (conveyor, sb3, minimal, conveyor, ...) so that machine noise hits each alike. Each runs the network that
conveyor's presets pick for the env, so the comparison is of the frameworks, not of the models:

- ``CartPole-v1``: a 64x64 tanh MLP (SB3's ``MlpPolicy``);
- ``MinAtar/Breakout-v1``: the MinAtar paper's CNN (16 3x3 convs, fc 128: ``minatar_cnn``), given to SB3 as a
  features extractor; ``sb3-mlp`` adds SB3's ``MlpPolicy`` on the flat frames, the network the race's SB3 rows
  run (rl-zoo publishes no MinAtar recipe, and its ``atari`` entry's ``CnnPolicy`` is built for 84x84 frames).

The contenders:

- ``conveyor``: ``paac/a2c`` in a fresh process as a user runs it, with an unreachable target; SPS over the
  training loop's wall-clock from the end of its first episode (``returns.csv``) to its end (``summary.json``):
  start-up excluded, and everything the loop does counted (its time split leaves out the storage writes and
  bookkeeping between its timed blocks: 13% of the loop on CartPole, 8% on MinAtar; until 2026-12-03 this
  script divided by the split, and so overstated conveyor's SPS by as much). On CartPole: its defaults but 16
  envs (the preset's 128 learn sooner; here all step 16), SB3's learning rate 7e-4 and no reward normalization
  (the preset's 1e-2, made for 128 envs, drives 16 envs' policy to the 9-step episodes of a fixed action, and a
  run whose episodes last 9 steps resets 15x as many envs as one that learns: not the same work). On MinAtar:
  its presets alone;
- ``sb3``: SB3's ``A2C`` (its defaults: ``n_steps=5``) with 16 envs on its in-process ``DummyVecEnv``, SPS over
  ``learn()``;
- ``minimal``: the loop one would write by hand (below): 16 gymnasium envs stepped in a Python loop, one
  forward with a Categorical sample per step, an update every 5 steps; SPS over the loop.

The table gives each one's median SPS and the ratios of conveyor's to the others (the median of each repeat's
ratio: ``paired_ratio``), with the machine and load.

    .venv/bin/python benchmarks/a2c_throughput.py --steps 100000 --repeats 5
    .venv/bin/python benchmarks/a2c_throughput.py --env MinAtar/Breakout-v1 --steps 100000 --repeats 5
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ENVS, UNROLL = 16, 5
CONVEYOR_FLAGS = {
    "CartPole-v1": ["--num-envs", str(ENVS), "--lr", "7e-4", "--no-normalize-reward"],
    "MinAtar/Breakout-v1": [],  # the presets: 16 envs, the MinAtar CNN
}
"""conveyor's flags besides ``--arch paac --algo a2c --env``, per env this script measures."""


def make_env(env_id: str) -> Any:
    """The env as the peers get it (``conveyor.bench.zoo.make_gym_env``: MinAtar's bool ``[10, 10, C]`` frames)."""
    from conveyor.bench.zoo import make_gym_env

    return make_gym_env(env_id)


def make_body(obs_shape: tuple[int, ...]) -> tuple[Any, int]:
    """The network conveyor's presets pick, in plain torch: ``(body, features)`` on float observations as the env
    gives them (MinAtar's ``[N, 10, 10, C]`` frames are moved to channels first inside)."""
    from torch import nn

    if len(obs_shape) == 1:
        return nn.Sequential(nn.Linear(obs_shape[0], 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh()), 64
    height, width, channels = obs_shape

    class ChannelsFirst(nn.Module):
        def forward(self, x: Any) -> Any:
            return x.permute(0, 3, 1, 2)

    conv_out = 16 * (height - 2) * (width - 2)
    return nn.Sequential(ChannelsFirst(), nn.Conv2d(channels, 16, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(conv_out, 128), nn.ReLU()), 128


def conveyor_sps(env_id: str, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "conveyor.cli", "train", "--arch", "paac", "--algo", "a2c",
                        "--env", env_id, *CONVEYOR_FLAGS[env_id], "--total-steps", str(steps),
                        "--target-return", "inf", "--out", out, "--no-progress"], check=True, capture_output=True)
        summary = json.loads(Path(out, "summary.json").read_text())
        with open(Path(out, "returns.csv")) as returns:
            first = next(csv.DictReader(returns))  # the first episode's end: the loop has been running a while
    return ((summary["env_steps"] - int(first["env_steps"]))
            / (summary["wall_time_s"] - float(first["wall_time_s"])))


def sb3_sps(env_id: str, steps: int, same_network: bool = True) -> float:
    import torch
    from stable_baselines3 import A2C
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    torch.set_num_threads(1)
    venv = make_vec_env(lambda: make_env(env_id), n_envs=ENVS, seed=0)
    policy_kwargs = None
    if same_network and len(venv.observation_space.shape) > 1:
        class Body(BaseFeaturesExtractor):
            def __init__(self, observation_space: Any) -> None:
                body, features = make_body(observation_space.shape)
                super().__init__(observation_space, features)
                self.body = body

            def forward(self, observations: Any) -> Any:
                return self.body(observations)

        policy_kwargs = {"features_extractor_class": Body, "net_arch": []}
    model = A2C("MlpPolicy", venv, n_steps=UNROLL, seed=0, device="cpu", policy_kwargs=policy_kwargs)
    start = time.perf_counter()
    model.learn(total_timesteps=steps)
    return model.num_timesteps / (time.perf_counter() - start)


def minimal_sps(env_id: str, steps: int) -> float:
    """A2C as a short script writes it: no worker processes, no storage classes, no telemetry."""
    import numpy as np
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    envs = [make_env(env_id) for _ in range(ENVS)]
    obs = np.stack([env.reset(seed=i)[0] for i, env in enumerate(envs)]).astype(np.float32)
    body, features = make_body(obs.shape[1:])
    policy, value = nn.Linear(features, envs[0].action_space.n), nn.Linear(features, 1)
    params = [*body.parameters(), *policy.parameters(), *value.parameters()]
    optimizer = torch.optim.RMSprop(params, lr=7e-4, eps=1e-5)
    done = 0
    start = time.perf_counter()
    while done < steps:
        logps, values, entropies, rewards, masks = [], [], [], [], []
        for _ in range(UNROLL):
            hidden = body(torch.as_tensor(obs))
            dist = torch.distributions.Categorical(logits=policy(hidden))
            action = dist.sample()
            logps.append(dist.log_prob(action))
            entropies.append(dist.entropy())
            values.append(value(hidden).squeeze(-1))
            step_rewards, step_masks = np.zeros(ENVS, np.float32), np.ones(ENVS, np.float32)
            for i, (env, a) in enumerate(zip(envs, action.tolist())):
                o, r, terminated, truncated, _ = env.step(a)
                step_rewards[i] = r
                if terminated or truncated:
                    step_masks[i] = 0.0 if terminated else 1.0
                    o, _ = env.reset()
                obs[i] = o
            rewards.append(torch.as_tensor(step_rewards))
            masks.append(torch.as_tensor(step_masks))
        with torch.no_grad():
            ret = value(body(torch.as_tensor(obs))).squeeze(-1)
        returns = []
        for r, m in zip(reversed(rewards), reversed(masks)):
            ret = r + 0.99 * m * ret
            returns.append(ret)
        returns = torch.stack(returns[::-1])
        advantages = returns - torch.stack(values)
        loss = (-(advantages.detach() * torch.stack(logps)).mean() + 0.5 * advantages.pow(2).mean()
                - 0.01 * torch.stack(entropies).mean())
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        done += UNROLL * ENVS
    return done / (time.perf_counter() - start)


RUNNERS: dict[str, Callable[[str, int], float]] = {"conveyor": conveyor_sps, "sb3": sb3_sps, "minimal": minimal_sps}
PIXEL_RUNNERS: dict[str, Callable[[str, int], float]] = {
    **RUNNERS, "sb3-mlp": lambda env_id, steps: sb3_sps(env_id, steps, same_network=False)}
"""Envs with frames add SB3's ``MlpPolicy`` on the flat frames (what the race runs)."""


def runners(env_id: str) -> dict[str, Callable[[str, int], float]]:
    return RUNNERS if env_id == "CartPole-v1" else PIXEL_RUNNERS


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median over repeats of ours / theirs within a repeat. A repeat's runs follow each other within
    seconds, so they share the machine's speed of the moment, which on the shared 2-core VM moves a run's SPS by
    +-20% from one minute to the next (all of its time buckets at once); the ratio of the two medians would mix
    runs made at different speeds."""
    return round(statistics.median(a / b for a, b in zip(ours, theirs)), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="CartPole-v1", choices=sorted(CONVEYOR_FLAGS))
    parser.add_argument("--steps", type=int, default=100_000, help="env steps of each run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one runner in this process (each run is a fresh one)
    parser.add_argument("--out", help="default: benchmarks/results/a2c_throughput_<env>.json")
    args = parser.parse_args()
    contenders = runners(args.env)
    if args.only:
        print(contenders[args.only](args.env, args.steps))
        return
    out = Path(args.out or f"benchmarks/results/a2c_throughput_{args.env.replace('/', '_')}.json")
    sps: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(args.repeats):
        for name in contenders:  # each in its own process: no warm caches or imports carried over
            result = subprocess.run([sys.executable, __file__, "--only", name, "--env", args.env,
                                     "--steps", str(args.steps)], check=True, capture_output=True, text=True)
            sps[name].append(float(result.stdout.strip().splitlines()[-1]))
            print(f"repeat {repeat}: {name} {sps[name][-1]:,.0f} SPS", flush=True)
    median = {name: statistics.median(values) for name, values in sps.items()}
    paired = {name: paired_ratio(sps["conveyor"], sps[name]) for name in contenders if name != "conveyor"}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.node()}, {os.cpu_count()} cpus",
        "load_at_end": round(os.getloadavg()[0], 1), "command": " ".join(["benchmarks/a2c_throughput.py",
                                                                          *sys.argv[1:]]),
        "env": args.env, "steps": args.steps, "sps": sps, "median_sps": median,
        **{f"conveyor_over_{name.replace('-', '_')}": ratio for name, ratio in paired.items()},
        "ratio_of_medians": {name: round(median["conveyor"] / median[name], 2) for name in paired},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"| {args.env} | " + " | ".join(contenders) + " |\n|---|" + "---|" * len(contenders))
    print(f"| SPS (median of {args.repeats}) | " + " | ".join(f"{median[name]:,.0f}" for name in contenders) + " |")
    print(", ".join(f"conveyor / {name} {ratio}x" for name, ratio in paired.items())
          + f" (medians of each repeat's ratios); wrote {out}")


if __name__ == "__main__":
    main()
