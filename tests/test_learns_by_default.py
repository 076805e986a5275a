"""Defaults learn: each architecture, given nothing but ``--arch`` (its own algorithm), ``--env CartPole-v1``,
a seed and a step budget, learns far above random play (about 22 per episode). The presets choose everything
else; a test that needed more flags would hide a defect. The full thresholds (475 within 300k steps, Pendulum,
MuJoCo) run in ``make test-learning`` and ``conveyor bench --suite learning``."""

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
# SEED's preset acts with 128 envs for wall-clock (more steps to 475, each far cheaper): seed 1 held 145 at 150k
# steps and 156 at 200k, in 15-20 s of training, where its earlier 8 envs took 32 s for 60k.
# The bar is on the curve's peak: with 256 envs acting, the last 100 episodes are the shortest of a moment, so a
# dip of the asynchronous policy reads as a collapse. SEED seed 1 beside two CPU hogs: peaks 125-258 in 12 runs,
# and once the last 100 read 27.6 at 200k while that policy still played 62.9 in evaluation. So the final policy
# is judged by the evaluation protocol (10 episodes from fresh envs): it must play twice as long as random.
SMOKE = [("paac", 60_000, 100.0), ("hts", 60_000, 100.0), ("ga3c", 60_000, 100.0), ("seed", 200_000, 100.0),
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
