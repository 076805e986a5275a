"""The peer reference for the seed/vtrace Pendulum-v1 row: stable-baselines3 A2C with rl-baselines3-zoo's tuned
Pendulum hyperparameters, with and without gSDE, at conveyor's 300k-step budget.

V-trace (IMPALA, SEED RL) is a policy gradient that uses each sample once, like A2C. This measures what the
best-tuned one-pass peer reaches in the same budget, and which part of its recipe does it:

- ``--sde rollout``: rl-zoo's recipe (``a2c.yml`` Pendulum-v1): gSDE (Raffin et al. 2022) with the exploration
  matrix drawn once per 8-step rollout, so each env's noise is correlated in time;
- ``--sde step``: the same Gaussian, std(s)^2 = phi(s)^2 @ sigma^2, with the noise drawn afresh every step
  (``sde_sample_freq=1``): state-dependent width, no correlation in time;
- ``--sde off``: a learned std per action dimension (conveyor's Gaussian).

Everything else is rl-zoo's: 8 envs, n_steps 8, gamma 0.9, GAE lambda 0.9, vf_coef 0.4, max_grad_norm 0.5,
RMSProp, learning rate linear from 7e-4 over rl-zoo's 1M steps (``--lr-horizon``), log_std_init -2, no
orthogonal init, VecNormalize. Prints the mean return of the last 100 episodes every 25k steps and a Markdown
row per run. Needs the bench extra (``make bench-deps``).

    .venv/bin/python benchmarks/sb3_a2c_pendulum.py --sde rollout step off --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

N_ENVS, N_STEPS, LR = 8, 8, 7e-4
REPORT_EVERY = 25_000


def run(sde: str, seed: int, steps: int, lr_horizon: int, *, ortho_init: bool = False, gae_lambda: float = 0.9,
        vf_coef: float = 0.4) -> dict:
    from stable_baselines3 import A2C
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    curve: list[tuple[int, float]] = []

    class Curve(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps // REPORT_EVERY > len(curve) and self.model.ep_info_buffer:
                curve.append((self.num_timesteps, float(np.mean([e["r"] for e in self.model.ep_info_buffer]))))
                print(f"  {sde} seed {seed}: {self.num_timesteps:,} steps, return (last 100) {curve[-1][1]:.1f}",
                      flush=True)
            return True

    def lr(progress_remaining: float) -> float:  # SB3 passes 1 -> 0 over this run; rl-zoo's schedule spans lr_horizon
        return LR * (1.0 - (1.0 - progress_remaining) * steps / lr_horizon)

    env = VecNormalize(make_vec_env("Pendulum-v1", n_envs=N_ENVS, seed=seed), gamma=0.9)
    model = A2C("MlpPolicy", env, n_steps=N_STEPS, gamma=0.9, gae_lambda=gae_lambda, vf_coef=vf_coef, ent_coef=0.0,
                max_grad_norm=0.5, use_rms_prop=True, normalize_advantage=False, learning_rate=lr,
                use_sde=sde != "off", sde_sample_freq=1 if sde == "step" else -1,
                policy_kwargs=dict(log_std_init=-2.0, ortho_init=ortho_init), seed=seed, verbose=0)
    model.learn(steps, callback=Curve())
    return {"sde": sde, "seed": seed, "final": curve[-1][1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sde", nargs="+", choices=("rollout", "step", "off"), default=["rollout", "step", "off"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=300_000)
    parser.add_argument("--lr-horizon", type=int, default=1_000_000, help="rl-zoo's n_timesteps (the lr schedule)")
    # One part of the recipe changed at a time, towards conveyor's choices (docs/benchmarks-log.md, 2026-11-26):
    parser.add_argument("--ortho-init", action="store_true", help="orthogonal init, as conveyor (rl-zoo: off)")
    parser.add_argument("--gae-lambda", type=float, default=0.9, help="1.0: n-step returns, as conveyor's A2C")
    parser.add_argument("--vf-coef", type=float, default=0.4, help="0.2: conveyor's 0.5 x MSE at rl-zoo's 0.4")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [run(sde, seed, args.steps, args.lr_horizon, ortho_init=args.ortho_init, gae_lambda=args.gae_lambda,
                vf_coef=args.vf_coef) for sde in args.sde for seed in args.seeds]
    print(f"\nMachine: {platform.machine()}, {platform.python_version()}; {time.strftime('%Y-%m-%d')}; "
          f"SB3 A2C on Pendulum-v1, {args.steps:,} steps; ortho init {args.ortho_init}, GAE lambda "
          f"{args.gae_lambda:g}, vf_coef {args.vf_coef:g}\n")
    print("| gSDE noise | seeds | return (last 100) at the end, per seed | mean ± std |")
    print("|---|---|---|---|")
    for sde in args.sde:
        finals = [r["final"] for r in rows if r["sde"] == sde]
        print(f"| {sde} | {', '.join(map(str, args.seeds))} | {', '.join(f'{f:.0f}' for f in finals)} "
              f"| {np.mean(finals):.0f} ± {np.std(finals):.0f} |")


if __name__ == "__main__":
    main()
