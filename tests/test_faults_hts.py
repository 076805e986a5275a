"""HTS-RL under faults: a killed executor is restarted and the round in flight completes without losing or
duplicating a transition; a stopped run resumed from its checkpoint, on as many env workers or not, reaches the
same parameters as one that never stopped."""

from __future__ import annotations

import dataclasses

import pytest

import conveyor
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.errors import WorkerFailure
from tests.fault_env import TAGGED_ID, BatchRecorder, check_transitions, children, kill_child, train_killing_one

ALPHA, ENVS = 5, 4


def tagged_cfg(tmp_path, max_restarts: int = 10, **overrides) -> RunCfg:
    base = dict(env=EnvCfg(id=TAGGED_ID, num_envs=ENVS, num_workers=2, max_restarts=max_restarts),
                model=ModelCfg(hidden=(16,)), arch=ArchCfg(name="hts", num_actors=2, sync_interval=ALPHA),
                total_steps=4000, torch_threads=1, progress=False, target_return=float("inf"), out=str(tmp_path))
    return RunCfg(**{**base, **overrides})


def test_killed_executor_is_restarted_and_no_transition_is_lost_or_duplicated(monkeypatch, tmp_path):
    summary, recorder = train_killing_one(monkeypatch, tagged_cfg(tmp_path), "conveyor.architectures.hts.state_buffer")
    assert 0 <= summary["dropped_steps"] <= ALPHA * ENVS // 2
    counts = check_transitions(recorder.transitions)
    # Every counted round but the last (saved in the checkpoint for the delayed update) was learned from.
    assert counts["transitions"] == len(recorder.transitions) == summary["env_steps"] - ALPHA * ENVS
    assert counts["episodes"] - counts["complete_episodes"] <= 2 * ENVS + 2
    assert not children()


def test_killed_executor_past_max_restarts_stops_the_run(monkeypatch, tmp_path):
    recorder = BatchRecorder(monkeypatch)
    kill_child("conveyor.architectures.hts.state_buffer", lambda: len(recorder.batches) >= 5)
    with pytest.raises(WorkerFailure, match=r"executor \d .*SIGKILL.*--max-restarts") as failure:
        conveyor.train(tagged_cfg(tmp_path, max_restarts=0, total_steps=10**9))
    assert "\n" not in str(failure.value)
    assert not children()


# PPO makes 16 optimizer steps per batch, so fewer batches cover the same checkpoint/resume path. gSDE: the
# resumed round count places each env's noise. Moved: as PAAC's (test_faults_paac.py), on other env workers.
@pytest.mark.parametrize("algo,env,total_steps,split_at,resumed_workers",
                         [("a2c", "CartPole-v1", 8_000, 3_000, 2), ("ppo", "CartPole-v1", 3_000, 1_200, 2),
                          ("a2c", "Pendulum-v1", 3_000, 1_200, 2), ("a2c", "CartPole-v1", 5_000, 2_000, 4)],
                         ids=["a2c", "ppo", "a2c-gsde", "a2c-moved"])
def test_resumed_run_reaches_the_same_parameters_as_an_uninterrupted_one(tmp_path, algo, env, total_steps, split_at,
                                                                        resumed_workers):
    model = ModelCfg(hidden=(32, 32), gsde=env == "Pendulum-v1", gsde_interval=3)
    cfg = RunCfg(env=EnvCfg(id=env, num_envs=8, num_workers=2), model=model,
                 algo=AlgoCfg(name=algo), arch=ArchCfg(name="hts", num_actors=2, sync_interval=5),
                 total_steps=total_steps, torch_threads=1, progress=False, target_return=float("inf"))
    whole = conveyor.train(dataclasses.replace(cfg, out=str(tmp_path / "whole")))
    first = conveyor.train(dataclasses.replace(cfg, out=str(tmp_path / "split"), total_steps=split_at))
    assert first["param_sha256"] != whole["param_sha256"]
    resumed = conveyor.train(dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, num_workers=resumed_workers),
                                                 out=str(tmp_path / "split"), resume=str(tmp_path / "split")))
    assert (resumed["env_steps"], resumed["episodes"]) == (whole["env_steps"], whole["episodes"])
    assert resumed["param_sha256"] == whole["param_sha256"]
