"""The CPU work that synchronous A2C on Pong cannot avoid, per env step, in core-milliseconds: an upper bound on
the SPS of any implementation on a machine with ``--cores`` cores, and so on PAAC's speed-up over SB3 A2C.

Issue 19 asks conveyor PAAC for >= 2x stable-baselines3 A2C's SPS on the 2-core CPU. Whatever the code around
it, one A2C env step on Pong costs at least: the env's step (ALE emulation, max-pool, resize to 84x84, frame
stack), the acting forward of the Nature CNN, and its share of the update (backward and optimizer step over the
t_max x envs batch). This measures each part alone, in CPU time of this one process with one torch thread (the
most efficient way to spend a core: no threads to synchronize), so a busy machine barely moves the figures:

- env: 16 Pong envs (conveyor's Atari preprocessing) stepped one after another with random actions;
- act: the forward on 16 observations, keeping the graph (PAAC: the update backpropagates through it);
- learn: the A2C loss over t_max = 5 such forwards, backward, RMSProp step (PAAC computes no second forward);
- SB3 does the acting forward without a graph and computes the forward again inside ``train()``: its
  floor is env + no-graph forward + a graph forward of 80 + the same backward and step.

Ceiling SPS = cores x 1000 / (core-ms per env step): every core busy all the time on this work and nothing
else. The same figures bound issue 19's env-limit fraction (``env_limit.py``: training SPS over the SPS of
the same envs stepped with random actions, which spend every core on the env): an architecture that does at
least one forward and one backward per step reaches at most env / (env + the cheaper act-and-learn). ``--sb3-sps`` (what ``paac_vs_sb3_pong.py`` measured for SB3 on the same machine) turns it into the
largest speed-up any A2C implementation could show over SB3 there.

    .venv/bin/python benchmarks/pong_compute_floor.py --sb3-sps 700
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from conveyor.config import EnvCfg, ModelCfg
from conveyor.envs.make import env_spaces, make_env
from conveyor.models import make_model

NUM_ENVS = 16
UNROLL = 5
FRAME_STACK = 4


def cpu_ms(work, repeats: int) -> float:
    """Median CPU time of ``work()`` over ``repeats`` calls, in ms (one warm-up call first)."""
    work()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        work()
        times.append((time.process_time() - start) * 1e3)
    return float(np.median(times))


def env_ms_per_step(steps: int) -> float:
    cfg = EnvCfg(id="ALE/Pong-v5", num_envs=NUM_ENVS)
    envs = [make_env(cfg, seed=i) for i in range(NUM_ENVS)]
    rng = np.random.default_rng(0)
    stack = np.zeros((NUM_ENVS, FRAME_STACK, 84, 84), np.uint8)

    def step_all() -> None:
        for i, env in enumerate(envs):
            frame, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
            if terminated or truncated:
                frame, _ = env.reset()
            stack[i, :-1] = stack[i, 1:]  # the frame stack's copy, as the vector env does it
            stack[i, -1] = np.asarray(frame).reshape(-1, 84, 84)[-1]

    per_round = cpu_ms(lambda: [step_all() for _ in range(steps // NUM_ENVS // 10)], repeats=10)
    for env in envs:
        env.close()
    return per_round / (steps // NUM_ENVS // 10 * NUM_ENVS)


def model_ms_per_step(repeats: int) -> dict[str, float]:
    obs_space, act_space = env_spaces(EnvCfg(id="ALE/Pong-v5"), seed=0)
    model = make_model(ModelCfg(name="nature_cnn"), obs_space, act_space)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=7e-4, alpha=0.99, eps=1e-5)
    obs = torch.randint(0, 256, (UNROLL, NUM_ENVS, *obs_space.shape), dtype=torch.uint8)
    actions = torch.randint(0, act_space.n, (UNROLL, NUM_ENVS))
    returns = torch.randn(UNROLL, NUM_ENVS)

    def a2c_step(out) -> None:
        advantage = returns - out.value
        loss = (-(out.log_prob(actions) * advantage.detach()).mean() + 0.5 * advantage.pow(2).mean()
                - 0.01 * out.policy.entropy(out.params).mean())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def act_kept() -> list:
        return [model(obs[t : t + 1]) for t in range(UNROLL)]

    def act_no_graph() -> None:
        with torch.no_grad():
            for t in range(UNROLL):
                model(obs[t : t + 1])

    def paac_learn() -> None:  # the acting forwards' graphs, then one backward through them
        outs = act_kept()
        params = torch.cat([out.params for out in outs])
        value = torch.cat([out.value for out in outs])
        a2c_step(type(outs[0])(outs[0].policy, params, value))

    def sb3_learn() -> None:  # the forward again over the whole rollout, then backward
        a2c_step(model(obs))

    act = cpu_ms(act_kept, repeats)
    act_plain = cpu_ms(act_no_graph, repeats)
    batch = UNROLL * NUM_ENVS
    return {
        "act_kept_graph": act / batch,
        "paac_act_and_learn": cpu_ms(paac_learn, repeats) / batch,
        "act_no_graph": act_plain / batch,
        "sb3_act_and_learn": (act_plain + cpu_ms(sb3_learn, repeats)) / batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-steps", type=int, default=8000, help="env steps per env measurement")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats of each model measurement")
    parser.add_argument("--cores", type=int, default=2, help="cores of the machine the ceiling is for")
    parser.add_argument("--sb3-sps", type=float, default=None,
                        help="SB3 A2C's measured SPS on this machine (benchmarks/paac_vs_sb3_pong.py)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/pong_compute_floor.json"))
    args = parser.parse_args()

    torch.set_num_threads(1)
    env = env_ms_per_step(args.env_steps)
    model = model_ms_per_step(args.repeats)
    paac = env + model["paac_act_and_learn"]
    sb3 = env + model["sb3_act_and_learn"]
    ceiling = args.cores * 1e3 / paac
    env_limit_fraction = env / (env + min(model["paac_act_and_learn"], model["sb3_act_and_learn"]))
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {args.cores} cores",
        "torch": torch.__version__, "core_ms_per_env_step": {"env": env, **model, "paac_total": paac,
                                                             "sb3_total": sb3},
        "paac_ceiling_sps": ceiling, "sb3_ceiling_sps": args.cores * 1e3 / sb3,
        "max_env_limit_fraction": env_limit_fraction,
    }
    print(f"Core-ms per env step (CPU time, 1 torch thread; {NUM_ENVS} envs, t_max {UNROLL}, Nature CNN):\n")
    print("| part | core-ms per env step |\n|---|---:|")
    print(f"| env step (emulation, preprocessing, frame stack) | {env:.3f} |")
    print(f"| acting forward, graph kept (PAAC) | {model['act_kept_graph']:.3f} |")
    print(f"| acting forward + learn: backward through the kept graphs, RMSProp (PAAC) | "
          f"{model['paac_act_and_learn']:.3f} |")
    print(f"| acting forward, no graph (SB3) | {model['act_no_graph']:.3f} |")
    print(f"| acting forward + learn: forward again, backward, RMSProp (SB3) | {model['sb3_act_and_learn']:.3f} |")
    print(f"| **PAAC total** | **{paac:.3f}** |\n| SB3 total | {sb3:.3f} |\n")
    print(f"Ceiling on {args.cores} cores: PAAC {ceiling:,.0f} SPS, SB3 {result['sb3_ceiling_sps']:,.0f} SPS "
          f"(floor ratio SB3 / PAAC: {sb3 / paac:.2f}x)")
    print(f"Largest env-limit fraction of any architecture that trains on every step: {env_limit_fraction:.2f}")
    if args.sb3_sps:
        result["sb3_measured_sps"] = args.sb3_sps
        result["max_speedup_over_sb3"] = ceiling / args.sb3_sps
        print(f"Largest possible PAAC / SB3 against SB3's measured {args.sb3_sps:,.0f} SPS: "
              f"{ceiling / args.sb3_sps:.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
