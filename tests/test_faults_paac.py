"""PAAC under faults: a killed env worker is restarted and the step it lost masked out of the loss, and its
restarts live on through a resume (exact resume itself: test_exact_resume.py)."""

from __future__ import annotations

import dataclasses

import pytest

import conveyor
from conveyor.config import ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.errors import WorkerFailure
from tests.fault_env import (TAGGED_FAMILY, TAGGED_ID, BatchRecorder, check_transitions, children, kill_child,
                              train_killing_one)

UNROLL, ENVS = 5, 4


def tagged_cfg(tmp_path, **overrides) -> RunCfg:
    base = dict(env=EnvCfg(id=TAGGED_ID, family=TAGGED_FAMILY, num_envs=ENVS, num_workers=2, backend="shm"),  # to kill
                arch=ArchCfg(name="paac", unroll=UNROLL),
                total_steps=6000, torch_threads=1, progress=False, target_return=float("inf"), out=str(tmp_path))
    return RunCfg(**{**base, **overrides})


@pytest.mark.slow  # 9 s; make test keeps PAAC's worker restart in test_hung_envs.py
def test_killed_env_worker_is_restarted_and_only_its_lost_step_dropped(monkeypatch, tmp_path):
    summary, recorder = train_killing_one(monkeypatch, tagged_cfg(tmp_path), "conveyor.envs.shm_worker")
    # The killed worker's 2 envs lose the step they were taking: nothing more, nothing less.
    assert summary["dropped_steps"] == ENVS // 2
    counts = check_transitions(recorder.transitions)
    assert counts["transitions"] == len(recorder.transitions) == summary["env_steps"] >= 6000
    # Cut episodes: at most the ones running at the end plus the two the kill cut short.
    assert counts["episodes"] - counts["complete_episodes"] <= ENVS + 2
    assert not children()
    # The run's restart count and dropped steps live on through a resume.
    resumed = conveyor.train(tagged_cfg(tmp_path, total_steps=7000, resume=str(tmp_path)))
    assert (resumed["restarts"], resumed["dropped_steps"]) == (1, ENVS // 2)


def test_killed_env_worker_past_max_restarts_stops_the_run(monkeypatch, tmp_path):
    recorder = BatchRecorder(monkeypatch)
    cfg = tagged_cfg(tmp_path, total_steps=10**9, env=EnvCfg(id=TAGGED_ID, family=TAGGED_FAMILY, num_envs=ENVS,
                                                             num_workers=2, max_restarts=0, backend="shm"))
    kill_child("conveyor.envs.shm_worker", lambda: len(recorder.batches) >= 5)
    with pytest.raises(WorkerFailure, match=r"env worker \d .*died.*SIGKILL.*--max-restarts") as failure:
        conveyor.train(cfg)
    assert "\n" not in str(failure.value)
    assert list((tmp_path / "checkpoints").glob("*.pt")), "a failed run still leaves a checkpoint"
    assert not children()


@pytest.mark.slow
def test_envpool_backend_checkpoints_without_an_env_history_and_resumes(tmp_path):
    pytest.importorskip("envpool")
    cfg = RunCfg(env=EnvCfg(id="ALE/Pong-v5", num_envs=4, num_workers=1, backend="envpool"),
                 model=ModelCfg(name="nips_cnn"), arch=ArchCfg(name="paac", unroll=5), total_steps=400, torch_threads=1, progress=False,
                 target_return=float("inf"), out=str(tmp_path))
    first = conveyor.train(cfg)
    resumed = conveyor.train(dataclasses.replace(cfg, total_steps=800, resume=str(tmp_path)))
    assert resumed["env_steps"] >= 800 > first["env_steps"]
