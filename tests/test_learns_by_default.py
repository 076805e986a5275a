"""Defaults learn: each architecture, given nothing but ``--arch`` (its own algorithm), ``--env CartPole-v1``,
a seed and (all but SEED, which runs its presets to 475) a step budget, learns far above random play (about 22
per episode), and its final policy plays twice as long as random. The presets choose everything else; a test
that needed more flags would hide a defect. The full thresholds (475 within 300k steps, Pendulum, MuJoCo) run in
``make test-learning`` and ``conveyor bench --suite learning``."""

from __future__ import annotations

import threading
import time

import pytest

import conveyor
from conveyor import ArchCfg, EnvCfg, RunCfg
from conveyor.evaluate import evaluate_run
from conveyor.telemetry import read_metrics
from tests.fault_env import children

# (arch, env steps, bar): budgets cut short of the presets' 475 (README "Presets"), bars well above random
# play and below what seed 1 reached at that budget (measured here, see the calibration in the closing note).
# SEED runs its presets whole instead (None: their 1M-step budget, stopped at CartPole's 475): its asynchronous
# policy swings over hundreds of updates (256 envs acting, lr 4e-3), so a policy cut at a fixed budget may be in a
# dip. Seed 1 cut at 200k, beside two CPU hogs and in CI: peaks 127-275, but the final policy played 11.8, 18.7
# and 37.7 in evaluation in 3 of 27 runs, with the code before 2026-12-06's changes as with it. Run to 475 (16
# runs, 14 of seed 1, beside two to four hogs): solved at 295k-632k steps in 20-39 s, and the final policy played
# 160-500 (docs/benchmarks-log.md "CI's failure of stop 75").
SMOKE = [("paac", 60_000, 100.0), ("hts", 60_000, 100.0), ("ga3c", 60_000, 100.0), ("seed", None, 475.0),
         ("impact", 60_000, 100.0)]
FINAL_BAR = 44.0
"""The final policy's evaluation mean must reach this: twice random play's."""


@pytest.mark.slow  # learning runs: make test keeps PAAC's shorter one (tests/test_paac.py)
@pytest.mark.parametrize("arch,steps,bar", SMOKE, ids=[row[0] for row in SMOKE])
def test_default_flags_learn_cartpole(tmp_path, arch, steps, bar):
    cfg = RunCfg(env=EnvCfg(id="CartPole-v1"), arch=ArchCfg(name=arch), total_steps=steps, seed=1,
                 progress=False, out=str(tmp_path / "run"))
    threads_before = set(threading.enumerate())
    summary = conveyor.train(cfg)
    _, rows = read_metrics(tmp_path / "run" / "metrics.csv")
    peak = max(float(row["return_mean_last100"]) for row in rows if row["return_mean_last100"] not in ("", "nan"))
    print(arch, summary["env_steps"], summary["return_mean_last100"], peak, summary["wall_time_s"])
    assert peak >= bar, peak
    final = evaluate_run(tmp_path / "run", episodes=10, checkpoints=("latest",))["final_metric"]
    assert final >= FINAL_BAR, final
    # The Python API leaves nothing running behind a run (README "From Python"): a sweep calls it again and again.
    left = wait_for_nothing_left(threads_before)
    assert left == ([], []), f"still running after train(): threads {left[0]}, child processes {left[1]}"


def wait_for_nothing_left(threads_before: set[threading.Thread], timeout_s: float = 30.0) -> tuple[list, list]:
    """Threads started since ``threads_before`` and child processes of this one still alive, once both are
    gone or after ``timeout_s``: (thread names, child pids)."""
    deadline = time.monotonic() + timeout_s
    while True:
        threads = [t.name for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        processes = sorted(children())
        if (not threads and not processes) or time.monotonic() > deadline:
            return threads, processes
        time.sleep(0.1)
