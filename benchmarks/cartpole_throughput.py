"""Training SPS on CartPole-v1 with 16 envs, A2C: conveyor paac/a2c against stable-baselines3 A2C and a minimal
in-process A2C loop, side by side in one run (issue 47: paac >= 2x SB3 and >= 1.5x the minimal loop).

All three train A2C (t_max 5, a 64x64 tanh MLP, RMSProp, one torch thread) on 16 CartPole-v1 envs for the same
number of env steps, in turns (conveyor, sb3, minimal, conveyor, ...) so that machine noise hits each alike:

- ``conveyor``: ``paac/a2c`` with its defaults but 16 envs (the preset's 128 learn sooner; here all three step
  16), SB3's learning rate 7e-4 and no reward normalization (the preset's 1e-2, made for 128 envs, drives 16
  envs' policy to the 9-step episodes of a fixed action, and a run whose episodes last 9 steps resets 15x as
  many envs as one that learns: not the same work), and an unreachable target, in a fresh process as a user
  runs it; SPS over the training loop's time (the time split, start-up excluded);
- ``sb3``: SB3's ``A2C("MlpPolicy", n_envs=16)`` on its in-process ``DummyVecEnv`` (SB3's default A2C with
  ``n_steps=5``), SPS over ``learn()``;
- ``minimal``: the loop one would write by hand (below): 16 gymnasium envs stepped in a Python loop, one
  forward with a Categorical sample per step, an update every 5 steps; SPS over the loop.

The table gives each one's median SPS and the ratios of conveyor's to the others (the median of each repeat's
ratio: ``paired_ratio``), with the machine and load.

    .venv/bin/python benchmarks/cartpole_throughput.py --steps 100000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENVS, UNROLL = 16, 5


def conveyor_sps(steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "conveyor.cli", "train", "--arch", "paac", "--algo", "a2c",
                        "--env", "CartPole-v1", "--num-envs", str(ENVS), "--lr", "7e-4", "--no-normalize-reward",
                        "--total-steps", str(steps),
                        "--target-return", "inf",
                        "--out", out, "--no-progress"], check=True, capture_output=True)
        summary = json.loads(Path(out, "summary.json").read_text())
    return summary["env_steps"] / sum(summary["time_split"].values())


def sb3_sps(steps: int) -> float:
    import torch
    from stable_baselines3 import A2C
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)
    model = A2C("MlpPolicy", make_vec_env("CartPole-v1", n_envs=ENVS, seed=0), n_steps=UNROLL, seed=0, device="cpu")
    start = time.perf_counter()
    model.learn(total_timesteps=steps)
    return model.num_timesteps / (time.perf_counter() - start)


def minimal_sps(steps: int) -> float:
    """A2C as a short script writes it: no worker processes, no storage classes, no telemetry."""
    import gymnasium as gym
    import numpy as np
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    envs = [gym.make("CartPole-v1") for _ in range(ENVS)]
    obs = np.stack([env.reset(seed=i)[0] for i, env in enumerate(envs)])
    body = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    policy, value = nn.Linear(64, 2), nn.Linear(64, 1)
    params = [*body.parameters(), *policy.parameters(), *value.parameters()]
    optimizer = torch.optim.RMSprop(params, lr=7e-4, eps=1e-5)
    done = 0
    start = time.perf_counter()
    while done < steps:
        logps, values, entropies, rewards, masks = [], [], [], [], []
        for _ in range(UNROLL):
            features = body(torch.as_tensor(obs))
            dist = torch.distributions.Categorical(logits=policy(features))
            action = dist.sample()
            logps.append(dist.log_prob(action))
            entropies.append(dist.entropy())
            values.append(value(features).squeeze(-1))
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


RUNNERS = {"conveyor": conveyor_sps, "sb3": sb3_sps, "minimal": minimal_sps}


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median over repeats of ours / theirs within a repeat. A repeat's runs follow each other within
    seconds, so they share the machine's speed of the moment, which on the shared 2-core VM moves a run's SPS by
    +-20% from one minute to the next (all of its time buckets at once); the ratio of the two medians would mix
    runs made at different speeds."""
    return round(statistics.median(a / b for a, b in zip(ours, theirs)), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000, help="env steps of each run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one runner in this process (each run is a fresh one)
    parser.add_argument("--out", default="benchmarks/results/cartpole_throughput.json")
    args = parser.parse_args()
    if args.only:
        print(RUNNERS[args.only](args.steps))
        return
    sps: dict[str, list[float]] = {name: [] for name in RUNNERS}
    for repeat in range(args.repeats):
        for name in RUNNERS:  # each in its own process: no warm caches or imports carried over
            result = subprocess.run([sys.executable, __file__, "--only", name, "--steps", str(args.steps)],
                                    check=True, capture_output=True, text=True)
            sps[name].append(float(result.stdout.strip().splitlines()[-1]))
            print(f"repeat {repeat}: {name} {sps[name][-1]:,.0f} SPS", flush=True)
    median = {name: statistics.median(values) for name, values in sps.items()}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.node()}, {os.cpu_count()} cpus",
        "load_at_end": round(os.getloadavg()[0], 1), "command": " ".join(["benchmarks/cartpole_throughput.py",
                                                                          *sys.argv[1:]]),
        "steps": args.steps, "sps": sps, "median_sps": median,
        "conveyor_over_sb3": paired_ratio(sps["conveyor"], sps["sb3"]),
        "conveyor_over_minimal": paired_ratio(sps["conveyor"], sps["minimal"]),
        "ratio_of_medians": {"sb3": round(median["conveyor"] / median["sb3"], 2),
                             "minimal": round(median["conveyor"] / median["minimal"], 2)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("| | conveyor paac/a2c | SB3 A2C | minimal loop |\n|---|---|---|---|")
    print(f"| SPS (median of {args.repeats}) | {median['conveyor']:,.0f} | {median['sb3']:,.0f} | "
          f"{median['minimal']:,.0f} |")
    print(f"conveyor / SB3 {result['conveyor_over_sb3']}x, conveyor / minimal {result['conveyor_over_minimal']}x "
          f"(medians of each repeat's ratios); wrote {args.out}")


if __name__ == "__main__":
    main()
