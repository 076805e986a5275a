"""PAAC env groups off and on, side by side: training SPS with ``--env-groups 1`` and ``--env-groups 2``.

Each setting trains PAAC A2C (t_max 5, 16 envs, 2 env workers, the default torch threads) alternately with
env groups off and on (off, on, off, on, ...), so that machine noise hits both; each run lasts ``--seconds``
of wall time. SPS counts env steps over the training loop's time (the time split: start-up excluded, as in
``paac_vs_sb3_pong.py``). The table gives the median of the repeats and the ratio on / off. Settings:

- ``pong``: ALE/Pong-v5 with the Nature CNN (the forward is a large share of a step);
- ``steptime``: conveyor/StepTime-v0, each env step sleeping an exponential 1 ms (a simulator elsewhere);
- ``cartpole``: CartPole-v1 with the MLP (env steps and forwards both cost microseconds).

``--envs``, ``--workers`` and ``--device`` change the layout and the learner's device for every setting.

    .venv/bin/python benchmarks/paac_overlap.py --seconds 25 --pong-seconds 45 --repeats 3
    python benchmarks/paac_overlap.py --settings pong --device cuda --envs 64 --workers 16 --repeats 1   # GPU
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
SETTINGS = {"pong": ("ALE/Pong-v5", "nature_cnn"), "steptime": ("conveyor/StepTime-v0", None),  # None: the preset's
            "cartpole": ("CartPole-v1", None)}


def measure(setting: str, groups: int, seconds: float, seed: int, args: argparse.Namespace) -> dict:
    env_id, model = SETTINGS[setting]
    with tempfile.TemporaryDirectory() as out:
        cfg = RunCfg(env=EnvCfg(id=env_id, num_envs=args.envs, num_workers=args.workers),
                     model=ModelCfg(name=model), algo=AlgoCfg(name="a2c"),
                     arch=ArchCfg(name="paac", unroll=UNROLL, env_groups=groups), device=args.device,
                     total_steps=10**9, time_limit_s=seconds, target_return=float("inf"), seed=seed, out=out,
                     progress=False, log_interval_s=seconds)
        summary = conveyor.train(cfg)
    split = summary["time_split"]
    train_s = sum(split.values())
    if not summary["env_steps"]:
        raise SystemExit(f"{setting}: no update within {seconds:g} s (start-up took it all): raise --seconds")
    return {"setting": setting, "env_groups": groups, "env_steps": summary["env_steps"], "train_s": train_s,
            "sps": summary["env_steps"] / train_s, "time_split": {k: round(v, 2) for k, v in split.items()},
            "policy_lag_max": summary["policy_lag"]["max"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="wall time of each run")
    parser.add_argument("--pong-seconds", type=float, default=45.0,
                        help="wall time of each pong run (start-up takes ~10 s of it, an update ~0.3 s)")
    parser.add_argument("--repeats", type=int, default=3, help="off/on pairs per setting")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2, help="env worker processes")
    parser.add_argument("--device", default="cpu", help="learner device (cpu, cuda)")
    parser.add_argument("--out", default="benchmarks/results/paac_overlap.json")
    args = parser.parse_args()

    rows: list[dict] = []
    for setting in args.settings:
        for repeat in range(args.repeats):
            for groups in (1, 2):
                seconds = args.pong_seconds if setting == "pong" else args.seconds
                row = {"repeat": repeat, **measure(setting, groups, seconds, repeat, args)}
                rows.append(row)
                print(f"{setting} env_groups={groups} repeat {repeat}: {row['sps']:.0f} SPS {row['time_split']}",
                      flush=True)
    table = []
    for setting in args.settings:
        median = {groups: statistics.median(r["sps"] for r in rows if r["setting"] == setting
                                            and r["env_groups"] == groups) for groups in (1, 2)}
        table.append({"setting": setting, "sps_off": median[1], "sps_on": median[2], "ratio": median[2] / median[1]})
    device = device_name(args.device)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "device": device, "seconds": args.seconds, "pong_seconds": args.pong_seconds, "repeats": args.repeats,
              "num_envs": args.envs, "num_workers": args.workers, "unroll": UNROLL, "rows": rows, "table": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("\n| setting | SPS, groups off (median) | SPS, groups on (median) | on / off |")
    print("|---|---|---|---|")
    for r in table:
        print(f"| {r['setting']} | {r['sps_off']:,.0f} | {r['sps_on']:,.0f} | {r['ratio']:.2f} |")


if __name__ == "__main__":
    main()
