"""End-to-end training SPS on Pong: conveyor PAAC A2C vs stable-baselines3 A2C, side by side in one run.

Both train A2C with the Nature CNN on 16 envs, t_max = 5, frame stack 4,
84x84 grayscale, frame skip 4: conveyor with its shared-memory workers,
stable-baselines3 with SubprocVecEnv + VecFrameStack. Each runs for the same
env-step budget, alternating (conveyor, sb3, conveyor, sb3, ...) so that
machine noise hits both; SPS counts env steps over the training wall time
(start-up excluded for both; conveyor's
SPS with start-up included is reported too). Prints a Markdown table and writes JSON.

    .venv/bin/python benchmarks/paac_vs_sb3_pong.py --steps 20000 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import conveyor
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg

NUM_ENVS = 16
UNROLL = 5


def conveyor_sps(steps: int, workers: int, backend: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cfg = RunCfg(
            env=EnvCfg(id="ALE/Pong-v5", num_envs=NUM_ENVS, num_workers=workers, backend=backend),
            model=ModelCfg(name="nature_cnn"), algo=AlgoCfg(name="a2c"), arch=ArchCfg(name="paac", unroll=UNROLL),
            total_steps=steps, target_return=float("inf"), out=out, progress=False,
        )
        summary = conveyor.train(cfg)
    split = summary["time_split"]
    # The time split covers the training loop (env + act + learn); like SB3's learn(), it leaves out
    # start-up (spawning workers, building the model and TensorBoard writer), which wall_time_s includes.
    train_s = sum(split.values())
    return {"sps": summary["env_steps"] / train_s, "wall_time_s": train_s, "sps_with_startup": summary["sps"],
            "time_split": {k: round(v, 2) for k, v in split.items()}}


def sb3_sps(steps: int) -> dict:
    import ale_py
    import gymnasium as gym
    from stable_baselines3 import A2C
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import SubprocVecEnv, VecFrameStack

    gym.register_envs(ale_py)
    # fork: the workers inherit the ALE registration (a spawned worker would not have it).
    env = make_atari_env("ALE/Pong-v5", n_envs=NUM_ENVS, seed=0, vec_env_cls=SubprocVecEnv,
                         vec_env_kwargs={"start_method": "fork"},
                         env_kwargs={"frameskip": 1, "repeat_action_probability": 0.25})
    env = VecFrameStack(env, n_stack=4)
    model = A2C("CnnPolicy", env, n_steps=UNROLL, device="cpu", verbose=0, seed=0)
    start = time.perf_counter()
    model.learn(total_timesteps=steps)
    wall = time.perf_counter() - start
    env.close()
    return {"sps": steps / wall, "wall_time_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000, help="env steps per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="conveyor env worker processes")
    parser.add_argument("--backend", default="shm", choices=["shm", "envpool"])
    parser.add_argument("--out", default="benchmarks/results/paac_vs_sb3_pong.json")
    args = parser.parse_args()

    rows: list[dict] = []
    for repeat in range(args.repeats):
        rows.append({"framework": f"conveyor paac a2c ({args.backend})", "repeat": repeat,
                     **conveyor_sps(args.steps, args.workers, args.backend)})
        rows.append({"framework": "stable-baselines3 a2c", "repeat": repeat, **sb3_sps(args.steps)})
    ours = [r["sps"] for r in rows if r["framework"].startswith("conveyor")]
    theirs = [r["sps"] for r in rows if r["framework"].startswith("stable")]
    ratio = (sum(ours) / len(ours)) / (sum(theirs) / len(theirs))
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
              "steps": args.steps, "num_envs": NUM_ENVS, "unroll": UNROLL, "rows": rows, "ratio": ratio}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("| framework | repeat | SPS (training) | training s | SPS incl. start-up | time split (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        with_startup = f"{r['sps_with_startup']:.0f}" if "sps_with_startup" in r else "-"
        print(f"| {r['framework']} | {r['repeat']} | {r['sps']:.0f} | {r['wall_time_s']:.1f} | {with_startup} | "
              f"{r.get('time_split', '')} |")
    print(f"\nconveyor / stable-baselines3 SPS ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
