"""HTS-RL under faults: a killed executor is restarted and the round in flight completes without losing or
duplicating a transition (exact resume: test_exact_resume.py)."""

from __future__ import annotations

import pytest

import conveyor
from conveyor.config import ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.errors import WorkerFailure
from tests.fault_env import (TAGGED_FAMILY, TAGGED_ID, BatchRecorder, check_transitions, children, kill_child,
                              train_killing_one)

ALPHA, ENVS = 5, 4


def tagged_cfg(tmp_path, max_restarts: int = 10, **overrides) -> RunCfg:
    base = dict(env=EnvCfg(id=TAGGED_ID, family=TAGGED_FAMILY, num_envs=ENVS, num_workers=2,
                               max_restarts=max_restarts),
                model=ModelCfg(hidden=(16,)), arch=ArchCfg(name="hts", num_actors=2, sync_interval=ALPHA),
                total_steps=4000, torch_threads=1, progress=False, target_return=float("inf"), out=str(tmp_path))
    return RunCfg(**{**base, **overrides})


def test_killed_executor_is_restarted_and_no_transition_is_lost_or_duplicated(monkeypatch, tmp_path):
    summary, recorder = train_killing_one(monkeypatch, tagged_cfg(tmp_path), "conveyor.architectures.hts.executors")
    assert 0 <= summary["dropped_steps"] <= ALPHA * ENVS // 2
    counts = check_transitions(recorder.transitions)
    # Every counted round but the last (saved in the checkpoint for the delayed update) was learned from.
    assert counts["transitions"] == len(recorder.transitions) == summary["env_steps"] - ALPHA * ENVS
    assert counts["episodes"] - counts["complete_episodes"] <= 2 * ENVS + 2
    assert not children()


def test_killed_executor_past_max_restarts_stops_the_run(monkeypatch, tmp_path):
    recorder = BatchRecorder(monkeypatch)
    kill_child("conveyor.architectures.hts.executors", lambda: len(recorder.batches) >= 5)
    with pytest.raises(WorkerFailure, match=r"executor \d .*SIGKILL.*--max-restarts") as failure:
        conveyor.train(tagged_cfg(tmp_path, max_restarts=0, total_steps=10**9))
    assert "\n" not in str(failure.value)
    assert not children()
