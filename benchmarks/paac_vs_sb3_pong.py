"""End-to-end training SPS on Pong: conveyor PAAC A2C vs stable-baselines3 A2C, side by side in one run.

Both train A2C with the Nature CNN on 16 envs, t_max = 5, frame stack 4,
84x84 grayscale, frame skip 4: conveyor with its shared-memory workers,
stable-baselines3 with SubprocVecEnv + VecFrameStack. Each runs for the same
env-step budget, alternating (conveyor, sb3, conveyor, sb3, ...) so that
machine noise hits both; SPS counts env steps over the training wall time
(start-up excluded for both; conveyor's
SPS with start-up included is reported too). The ratio is the median of the
pairs' conveyor / SB3 ratios. ``--device cuda`` puts both learners on the GPU.
Prints a Markdown table and writes JSON.

    .venv/bin/python benchmarks/paac_vs_sb3_pong.py --steps 20000 --repeats 3
    python benchmarks/paac_vs_sb3_pong.py --device cuda --workers 8 --steps 40000   # GPU machine, 16 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import conveyor
from conveyor.bench import device_name
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg

UNROLL = 5


def conveyor_sps(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cfg = RunCfg(
            env=EnvCfg(id="ALE/Pong-v5", num_envs=args.envs, num_workers=args.workers, backend=args.backend),
            model=ModelCfg(name="nature_cnn"), algo=AlgoCfg(name="a2c"),
            arch=ArchCfg(name="paac", unroll=UNROLL, env_groups=args.env_groups),
            total_steps=args.steps, target_return=float("inf"), out=out, progress=False, device=args.device,
        )
        summary = conveyor.train(cfg)
    split = summary["time_split"]
    # The time split covers the training loop (env + act + learn); like SB3's learn(), it leaves out
    # start-up (spawning workers, building the model and TensorBoard writer), which wall_time_s includes.
    train_s = sum(split.values())
    return {"sps": summary["env_steps"] / train_s, "wall_time_s": train_s, "sps_with_startup": summary["sps"],
            "time_split": {k: round(v, 2) for k, v in split.items()}}


def sb3_sps(args: argparse.Namespace) -> dict:
    import ale_py
    import gymnasium as gym
    from stable_baselines3 import A2C
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import SubprocVecEnv, VecFrameStack

    gym.register_envs(ale_py)
    # fork: the workers inherit the ALE registration (a spawned worker would not have it).
    env = make_atari_env("ALE/Pong-v5", n_envs=args.envs, seed=0, vec_env_cls=SubprocVecEnv,
                         vec_env_kwargs={"start_method": "fork"},
                         env_kwargs={"frameskip": 1, "repeat_action_probability": 0.25})
    env = VecFrameStack(env, n_stack=4)
    model = A2C("CnnPolicy", env, n_steps=UNROLL, device=args.device, verbose=0, seed=0)
    start = time.perf_counter()
    model.learn(total_timesteps=args.steps)
    wall = time.perf_counter() - start
    env.close()
    return {"sps": args.steps / wall, "wall_time_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000, help="env steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating conveyor / SB3 pairs")
    parser.add_argument("--envs", type=int, default=16, help="envs of both")
    parser.add_argument("--workers", type=int, default=2, help="conveyor env worker processes")
    parser.add_argument("--device", default="cpu", help="both learners' device (cpu, cuda)")
    parser.add_argument("--env-groups", type=int, default=1, help="conveyor PAAC's env groups (--env-groups)")
    parser.add_argument("--backend", default="shm", choices=["shm", "envpool"])
    parser.add_argument("--out", default="benchmarks/results/paac_vs_sb3_pong.json")
    args = parser.parse_args()

    rows: list[dict] = []
    for repeat in range(args.repeats):
        rows.append({"framework": f"conveyor paac a2c ({args.backend})", "repeat": repeat,
                     **conveyor_sps(args)})
        rows.append({"framework": "stable-baselines3 a2c", "repeat": repeat, **sb3_sps(args)})
    ours = [r["sps"] for r in rows if r["framework"].startswith("conveyor")]
    theirs = [r["sps"] for r in rows if r["framework"].startswith("stable")]
    ratio = statistics.median(a / b for a, b in zip(ours, theirs))
    import torch

    device = device_name(args.device)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "device": device, "torch": torch.__version__, "steps": args.steps, "num_envs": args.envs,
              "workers": args.workers, "env_groups": args.env_groups, "unroll": UNROLL, "rows": rows, "ratio": ratio}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("| framework | repeat | SPS (training) | training s | SPS incl. start-up | time split (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        with_startup = f"{r['sps_with_startup']:.0f}" if "sps_with_startup" in r else "-"
        print(f"| {r['framework']} | {r['repeat']} | {r['sps']:.0f} | {r['wall_time_s']:.1f} | {with_startup} | "
              f"{r.get('time_split', '')} |")
    print(f"\nconveyor / stable-baselines3 SPS ratio (median of {args.repeats} pairs, {device}): {ratio:.2f}")


if __name__ == "__main__":
    main()
