"""PAAC and HTS-RL resume exactly: a run stopped and resumed from its checkpoint reaches the same parameters as
one that never stopped (README "Exact resume"), also when it resumes on another number of env workers."""

from __future__ import annotations

import dataclasses

import pytest

import conveyor
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg

ARCHS = {"paac": ArchCfg(name="paac", unroll=8), "hts": ArchCfg(name="hts", num_actors=2, sync_interval=5)}


# PPO makes 8 optimizer steps per batch of 8 x 32 steps, so fewer batches cover the same checkpoint/resume path. gSDE: each env's
# noise step count (PAAC) or the resumed round count (HTS) is in the checkpoint and places each env's noise.
# Moved: which worker steps an env changes nothing of its seed, its history or the sampler's draws, so a run
# continued on a machine with more cores (a CPU run's 2 env workers, a GPU machine's 16) stays exact.
@pytest.mark.parametrize("arch,algo,env,total_steps,split_at,resumed_workers", [
    ("paac", "a2c", "CartPole-v1", 12_000, 5_000, 2),
    pytest.param("paac", "ppo", "CartPole-v1", 4_000, 1_600, 2, marks=pytest.mark.slow),
    pytest.param("paac", "a2c", "Pendulum-v1", 3_000, 1_020, 2, marks=pytest.mark.slow),
    pytest.param("paac", "a2c", "CartPole-v1", 6_000, 2_500, 4, marks=pytest.mark.slow),
    # make test keeps PAAC's A2C row; PPO, gSDE, a moved run and HTS resume exactly in make test-slow
    pytest.param("hts", "a2c", "CartPole-v1", 8_000, 3_000, 2, marks=pytest.mark.slow),
    pytest.param("hts", "ppo", "CartPole-v1", 3_000, 1_200, 2, marks=pytest.mark.slow),
    pytest.param("hts", "a2c", "Pendulum-v1", 3_000, 1_200, 2, marks=pytest.mark.slow),
    pytest.param("hts", "a2c", "CartPole-v1", 5_000, 2_000, 4, marks=pytest.mark.slow),
], ids=["paac-a2c", "paac-ppo", "paac-a2c-gsde", "paac-a2c-moved", "hts-a2c", "hts-ppo", "hts-a2c-gsde",
        "hts-a2c-moved"])
def test_resumed_run_reaches_the_same_parameters_as_an_uninterrupted_one(tmp_path, arch, algo, env, total_steps,
                                                                        split_at, resumed_workers):
    cfg = RunCfg(env=EnvCfg(id=env, num_envs=8, num_workers=2), algo=AlgoCfg(name=algo), arch=ARCHS[arch],
                 model=ModelCfg(hidden=(32, 32), gsde=env == "Pendulum-v1", gsde_interval=3),
                 total_steps=total_steps, torch_threads=1, progress=False, target_return=float("inf"))
    whole = conveyor.train(dataclasses.replace(cfg, out=str(tmp_path / "whole")))
    first = conveyor.train(dataclasses.replace(cfg, out=str(tmp_path / "split"), total_steps=split_at))
    assert first["param_sha256"] != whole["param_sha256"]
    resumed = conveyor.train(dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, num_workers=resumed_workers),
                                                 out=str(tmp_path / "split"), resume=str(tmp_path / "split")))
    assert (resumed["env_steps"], resumed["episodes"]) == (whole["env_steps"], whole["episodes"])
    assert resumed["param_sha256"] == whole["param_sha256"]
