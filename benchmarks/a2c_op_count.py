"""Work per env step of A2C with 16 envs, counted rather than timed: conveyor paac/a2c against stable-baselines3
A2C and the minimal in-process loop, the three contenders of ``a2c_throughput.py`` with its settings (issue 47).

``a2c_throughput.py`` times the three, and on the shared 2-core VM its ratios move by 10% from one run to the
next. What each loop does per env step does not: this script counts it, so a change to the loop can be judged on
any machine, under any load, and the gap to a peer can be laid out op by op. For each contender it counts, on the
thread that runs the loop:

- **torch ops**: the ``aten::`` calls made from Python or from autograd's engine (the backward's ops), not the ops
  that those call in turn (``torch.profiler``'s CPU events whose parents are not ``aten::`` ops). Each costs a
  few microseconds of dispatch on this CPU whatever its size, which at 16 envs is most of its time;
- **Python calls**: the Python functions entered (``sys.setprofile``'s ``call`` events), and the calls of
  builtins and C functions (``c_call``), torch's Python bindings among them.

Each contender runs in a fresh process twice, for ``--steps`` and for twice as many env steps, and the counts per
env step are the differences divided by the extra steps: start-up (imports, building the env and the model,
conveyor's backend choice and files) is in both runs and drops out. The counts are per step of all 16 envs, so
that one update (every 5 such steps, 80 env steps) is spread over the five.

    .venv/bin/python benchmarks/a2c_op_count.py

writes ``benchmarks/results/a2c_op_count_CartPole-v1.json`` (every count, and each contender's most frequent
ops) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script whose contenders are counted here
from a2c_throughput import CONVEYOR_FLAGS, ENVS, minimal_sps, sb3_sps  # noqa: E402

ENV_ID = "CartPole-v1"
TOP_OPS = 15
"""How many of each contender's most frequent torch ops the JSON lists."""
MARKER = "a2c_op_count: the loop's thread"
COUNTED_PACKAGES = ("torch", "numpy", "gymnasium", "stable-baselines3")
"""Whose code the counts are of: another version of any may count otherwise."""


def run_conveyor(steps: int) -> None:
    from conveyor.cli import main

    with tempfile.TemporaryDirectory() as out:
        code = main(["train", "--arch", "paac", "--algo", "a2c", "--env", ENV_ID, *CONVEYOR_FLAGS[ENV_ID],
                     "--total-steps", str(steps), "--target-return", "inf", "--out", out, "--no-progress"])
    if code:
        raise SystemExit(f"conveyor train exited with {code}")


RUNNERS: dict[str, Callable[[int], Any]] = {
    "conveyor": run_conveyor,
    "sb3": lambda steps: sb3_sps(ENV_ID, steps),
    "minimal": lambda steps: minimal_sps(ENV_ID, steps),
}


def top_level_ops(events: Any, thread: int) -> collections.Counter[str]:
    """The ``aten::`` events of ``thread`` that no other ``aten::`` event encloses, counted by name."""
    counts: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.thread != thread or not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            counts[event.name] += 1
    return counts


def count(name: str, steps: int) -> dict[str, Any]:
    """Run contender ``name`` for ``steps`` env steps in this process and count its work on this thread."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    calls = collections.Counter()

    def on_event(frame: Any, event: str, arg: Any) -> None:
        calls[event] += 1

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        with record_function(MARKER):  # the profiler numbers threads its own way: this event names this one
            torch.empty(0)
        sys.setprofile(on_event)
        try:
            RUNNERS[name](steps)
        finally:
            sys.setprofile(None)
    events = profiler.events()
    thread = next(event.thread for event in events if event.name == MARKER)
    ops = top_level_ops(events, thread)
    return {"ops": dict(ops), "python_calls": calls["call"], "c_calls": calls["c_call"]}


def per_step(small: dict[str, Any], large: dict[str, Any], extra_steps: int) -> dict[str, Any]:
    """The counts of one step of all ``ENVS`` envs: ``large``'s minus ``small``'s over the ``extra_steps``."""
    vector_steps = extra_steps / ENVS
    ops = {op: (large["ops"].get(op, 0) - small["ops"].get(op, 0)) / vector_steps
           for op in set(small["ops"]) | set(large["ops"])}
    return {
        "torch_ops": round(sum(ops.values()), 1),
        "python_calls": round((large["python_calls"] - small["python_calls"]) / vector_steps, 1),
        "c_calls": round((large["c_calls"] - small["c_calls"]) / vector_steps, 1),
        "top_ops": {op: round(n, 2) for op, n in sorted(ops.items(), key=lambda item: (-item[1], item[0]))[:TOP_OPS]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8_000,
                        help="env steps of the shorter run (a multiple of 80); the longer runs twice as many")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one count in this process: "NAME STEPS"
    parser.add_argument("--out", default=f"benchmarks/results/a2c_op_count_{ENV_ID}.json")
    args = parser.parse_args()
    if args.only:
        name, steps = args.only.split()
        print(json.dumps(count(name, int(steps))))
        return
    if args.steps <= 0 or args.steps % (ENVS * 5):
        parser.error(f"--steps must be a positive multiple of {ENVS * 5} (one rollout of every contender)")
    results = {}
    for name in RUNNERS:
        runs = []
        for steps in (args.steps, 2 * args.steps):  # each in a fresh process: both pay the same start-up
            done = subprocess.run([sys.executable, __file__, "--only", f"{name} {steps}"], check=True,
                                  capture_output=True, text=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        results[name] = per_step(runs[0], runs[1], args.steps)
        print(f"{name}: {results[name]['torch_ops']} torch ops, {results[name]['python_calls']} Python calls, "
              f"{results[name]['c_calls']} C calls per step of {ENVS} envs", flush=True)
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(),
              "command": " ".join(["benchmarks/a2c_op_count.py", *sys.argv[1:]]),
              "versions": {package: metadata.version(package) for package in COUNTED_PACKAGES},
              "env": ENV_ID, "envs": ENVS,
              "steps": [args.steps, 2 * args.steps], "per_step_of_all_envs": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"| per step of {ENVS} envs | " + " | ".join(RUNNERS) + " |\n|---|" + "---:|" * len(RUNNERS))
    for key, label in (("torch_ops", "torch ops"), ("python_calls", "Python calls"), ("c_calls", "C calls")):
        print(f"| {label} | " + " | ".join(f"{results[name][key]:,.1f}" for name in RUNNERS) + " |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
