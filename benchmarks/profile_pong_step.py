"""Where a Pong training step's time goes: PAAC A2C (Nature CNN, t_max 5) under ``torch.profiler``.

One run of ``--steps`` env steps is profiled whole. The report has three parts:

- the run's time split (env / act / learn seconds, from telemetry, as every run reports it);
- the same three regions as the profiler saw them (``Telemetry.timer`` opens a ``record_function`` range);
- the operators that took the most self time on the host and, with ``--device cuda``, on the GPU.

The report goes to stdout and to ``--out`` (default ``benchmarks/results/profile_pong_<device>.txt``).

    .venv/bin/python benchmarks/profile_pong_step.py --steps 4000                    # CPU, a smoke run
    python benchmarks/profile_pong_step.py --device cuda --envs 32 --workers 8      # GPU machine, 16 cores
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import conveyor
from conveyor.bench import device_name
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg

REGIONS = ("env", "act", "learn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="learner device (cpu, cuda)")
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2, help="env worker processes")
    parser.add_argument("--steps", type=int, default=20000, help="env steps of the profiled run")
    parser.add_argument("--rows", type=int, default=20, help="operators listed per table")
    parser.add_argument("--out", help="report file (default benchmarks/results/profile_pong_<device>.txt)")
    args = parser.parse_args()
    on_cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with tempfile.TemporaryDirectory() as out:
        cfg = RunCfg(env=EnvCfg(id="ALE/Pong-v5", num_envs=args.envs, num_workers=args.workers),
                     model=ModelCfg(name="nature_cnn"), algo=AlgoCfg(name="a2c"), arch=ArchCfg(name="paac", unroll=5),
                     total_steps=args.steps, target_return=float("inf"), out=out, progress=False, device=args.device)
        with profile(activities=activities) as prof:
            summary = conveyor.train(cfg)
    events = prof.key_averages()
    steps = summary["env_steps"]
    device = device_name(args.device)
    lines = [
        f"Command: benchmarks/profile_pong_step.py --device {args.device} --envs {args.envs} --workers "
        f"{args.workers} --steps {args.steps}",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, learner on {device}, torch {torch.__version__}; "
        f"date: {time.strftime('%Y-%m-%d')}.",
        f"Run: {steps} env steps, {summary['updates']} updates, {summary['sps']:.0f} SPS with start-up.",
        "",
        "Time split (telemetry), ms per env step and share:",
    ]
    split = summary["time_split"]
    total = sum(split.values())
    for bucket, seconds in split.items():
        lines.append(f"  {bucket:>6}: {1000 * seconds / steps:.4f} ms/step  {100 * seconds / total:5.1f}%")
    by_name = {event.key: event for event in events}
    lines += ["", "The same regions in the profile (host time, and GPU time of kernels launched inside them):"]
    for region in REGIONS:
        if region in by_name:
            event = by_name[region]
            device_us = getattr(event, "device_time_total", 0.0) if on_cuda else 0.0
            lines.append(f"  {region:>6}: {event.count} ranges, host {event.cpu_time_total / 1e3:.0f} ms"
                         + (f", GPU {device_us / 1e3:.0f} ms" if on_cuda else ""))
    lines += ["", "Operators by self host time:",
              events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60)]
    if on_cuda:
        lines += ["Operators by self GPU time:",
                  events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60)]
    report = "\n".join(lines)
    print(report)
    path = Path(args.out or f"benchmarks/results/profile_pong_{'cuda' if on_cuda else 'cpu'}.txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report + "\n")


if __name__ == "__main__":
    main()
