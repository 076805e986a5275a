"""IMPACT: circular buffer C(N, K), weight broadcast, the objective against numpy, presets, end-to-end runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from conveyor.algos import make_loss
from conveyor.config import AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg
from conveyor.learner import param_sha256
from conveyor.models import make_model
from conveyor.models.heads import Categorical, DiagGaussian, ModelOut
from conveyor.storage.circular import CircularBuffer
from conveyor.architectures.impact.params import ParamBlock

torch.set_num_threads(1)


# ---- circular buffer ---------------------------------------------------------------------------
def labelled(label: int) -> dict[str, torch.Tensor]:
    return {"obs": torch.full((3, 2), float(label)), "actions": torch.full((2, 2), label)}


def drive(buffer: CircularBuffer, takes: int, attach=None) -> list[int]:
    """A learner loop: refill the cursor's position with the next batch when empty, else take."""
    arrivals, taken = iter(range(1000)), []
    while len(taken) < takes:
        if buffer.needs_batch():
            buffer.put(labelled(next(arrivals)))
        else:
            batch, _ = buffer.take(attach)
            taken.append(int(batch["actions"][0, 0]))
    return taken


@pytest.mark.parametrize("N,K", [(1, 1), (2, 2), (3, 2), (4, 3)])
def test_each_batch_is_used_k_times_and_positions_refill_in_cyclic_order(N, K):
    buffer = CircularBuffer(N, K)
    taken = drive(buffer, takes=N * K * 5)
    # Batches b*N .. b*N + N-1 fill positions 0..N-1 and are walked round-robin K times, then replaced.
    expected = [group * N + position for group in range(5) for _ in range(K) for position in range(N)]
    assert taken == expected
    assert buffer.batches_put == 5 * N and buffer.batches_taken == 5 * N * K


def test_attach_runs_once_per_batch_and_its_values_stay_with_the_batch():
    calls = []

    def attach(batch):
        calls.append(int(batch["actions"][0, 0]))
        return {"target_logp": batch["obs"][:-1, :] * 10}

    buffer = CircularBuffer(2, 3)
    uses_seen = []
    for _ in range(12):
        if buffer.needs_batch():
            buffer.put(labelled(buffer.batches_put))
        batch, uses = buffer.take(attach)
        uses_seen.append(uses)
        assert torch.equal(batch["target_logp"], batch["obs"][:-1] * 10)
    assert calls == [0, 1, 2, 3]  # once each, on first use only
    assert uses_seen == [0, 0, 1, 1, 2, 2] * 2


def test_buffer_refuses_misuse_and_marks_unwritten_storage():
    buffer = CircularBuffer(2, 2)
    with pytest.raises(RuntimeError, match="empty"):
        buffer.take()
    buffer.put(labelled(0))
    with pytest.raises(RuntimeError, match="still holds"):
        buffer.put(labelled(1))
    buffer.take()
    with pytest.raises(ValueError, match="obs"):
        buffer.put({"obs": torch.zeros(4, 2), "actions": torch.zeros(2, 2, dtype=torch.long)})
    fresh = CircularBuffer(3, 1)
    fresh.put(labelled(5))
    assert torch.isnan(fresh._storage["obs"][1:]).all() and (fresh._storage["actions"][1:] == -1).all()


# ---- weight broadcast --------------------------------------------------------------------------
SPACES = (gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
READER = """
import sys, gymnasium as gym, numpy as np, torch
from conveyor.config import ModelCfg, RunCfg
from conveyor.learner import param_sha256
from conveyor.models import make_model
from conveyor.architectures.impact.params import ParamBlock
model = make_model(RunCfg(model=ModelCfg(hidden=(8,))).model, gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
block = ParamBlock(model, int(sys.argv[1]))
print(block.read_into(model), param_sha256(model))
"""


def test_broadcast_reaches_every_reader_process():
    model = make_model(RunCfg(model=ModelCfg(hidden=(8,))).model, *SPACES)  # resolved: no None fields
    block = ParamBlock(model)
    try:
        block.publish(model, 7)
        readers = [subprocess.Popen([sys.executable, "-c", READER, str(block.fd)], pass_fds=(block.fd,),
                                    stdout=subprocess.PIPE, text=True) for _ in range(2)]
        outputs = [reader.communicate(timeout=120)[0].split() for reader in readers]
    finally:
        block.close()
    assert outputs == [["7", param_sha256(model)]] * 2


def test_reads_are_never_torn_while_the_learner_publishes():
    writer_model, reader_model = (make_model(RunCfg(model=ModelCfg(hidden=(64,))).model, *SPACES) for _ in range(2))
    block = ParamBlock(writer_model)
    assert block.read_into(reader_model) == -1 and block.version == -1
    done = threading.Event()

    def publish_forever():
        version = 0
        while not done.is_set():
            version += 1
            with torch.no_grad():
                for p in writer_model.parameters():
                    p.fill_(version)
            block.publish(writer_model, version)

    writer = threading.Thread(target=publish_forever)
    writer.start()
    try:
        versions = []
        while len(versions) < 300:
            version = block.read_into(reader_model)
            if version > 0:
                values = torch.cat([p.detach().reshape(-1) for p in reader_model.parameters()])
                assert (values == version).all(), "a read mixed two publications"
                versions.append(version)
    finally:
        done.set()
        writer.join()
        block.close()
    assert versions == sorted(versions)


# ---- the IMPACT objective against numpy --------------------------------------------------------
T, B = 6, 4


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_policy(continuous):
    """(log_prob(params, actions), entropy(params), kl(p, q)) in numpy, written from the textbook formulas."""
    if continuous:
        def split(params):
            mean, log_std = np.split(params, 2, axis=-1)
            return mean, np.clip(log_std, -20, 2)

        def log_prob(params, actions):
            mean, log_std = split(params)
            std = np.exp(log_std)
            return (-((actions - mean) ** 2) / (2 * std**2) - log_std - 0.5 * np.log(2 * np.pi)).sum(-1)

        def entropy(params):
            return (split(params)[1] + 0.5 + 0.5 * np.log(2 * np.pi)).sum(-1)

        def kl(p, q):
            (pm, pl), (qm, ql) = split(p), split(q)
            return (ql - pl + (np.exp(2 * pl) + (pm - qm) ** 2) / (2 * np.exp(2 * ql)) - 0.5).sum(-1)
    else:
        def log_prob(params, actions):
            return np.take_along_axis(np_log_softmax(params), actions[..., None], -1)[..., 0]

        def entropy(params):
            logp = np_log_softmax(params)
            return -(np.exp(logp) * logp).sum(-1)

        def kl(p, q):
            lp, lq = np_log_softmax(p), np_log_softmax(q)
            return (np.exp(lp) * (lp - lq)).sum(-1)
    return log_prob, entropy, kl


def np_vtrace_gae(worker_logp, target_logp, rewards, discounts, values, lam, clip_rho, clip_c, clip_pg_rho):
    """IMPACT's V-trace GAE-lambda as an explicit sum over future TD errors (paper section 3.1)."""
    rho = np.exp(target_logp - worker_logp)
    c = lam * np.minimum(clip_c, rho)
    V = values  # [T + 1, B]
    delta = np.minimum(clip_rho, rho) * (rewards + discounts * V[1:] - V[:-1])
    vs = V.copy()
    for t in range(T):
        for i in range(t, T):
            vs[t] += np.prod(discounts[t:i] * c[t:i], axis=0) * delta[i]
    pg_adv = np.minimum(clip_pg_rho, rho) * (rewards + discounts * vs[1:] - V[:-1])
    return vs[:-1], pg_adv


@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize("ratio_kind,kl_coef", [("impact", 0.0), ("impact", 0.3), ("target", 0.0), ("worker", 0.0)])
def test_impact_objective_matches_numpy_reference(continuous, ratio_kind, kl_coef):
    rng = np.random.default_rng(3)
    A = 2
    family = DiagGaussian(A) if continuous else Categorical(3)
    P = family.param_size
    learner_params, worker_params, target_params = (rng.normal(size=(T + 1, B, P)) for _ in range(3))
    worker_params = learner_params + 0.8 * worker_params  # workers lag behind; some ratios get clipped
    target_params = learner_params[:T] + 0.3 * target_params[:T]
    values = rng.normal(size=(T + 1, B)) * 3
    if continuous:
        actions = rng.normal(size=(T, B, A))
    else:
        actions = rng.integers(0, 3, size=(T, B))
    rewards, discounts = rng.normal(size=(T, B)), np.full((T, B), 0.97)
    discounts[2, 1] = discounts[4, 3] = 0.0
    log_prob, entropy, kl = np_policy(continuous)
    algo = AlgoCfg(name="impact", gae_lambda=0.9, clip=0.25, impact_rho=1.5, kl_coef=kl_coef, clip_rho=1.2,
                   entropy_coef=0.02, value_coef=0.7, impact_ratio=ratio_kind)
    cfg = RunCfg(algo=algo, arch=ArchCfg(name="impact"))

    t = torch.from_numpy
    batch = {"actions": t(actions), "rewards": t(rewards), "discounts": t(discounts),
             "behaviour_logp": t(log_prob(worker_params[:T], actions)),
             "target_logp": t(log_prob(target_params, actions)), "target_params": t(target_params)}
    out = ModelOut(family, t(learner_params), t(values))
    loss, metrics = make_loss(cfg)(out, batch)

    worker_logp, target_logp = log_prob(worker_params[:T], actions), log_prob(target_params, actions)
    learner_logp = log_prob(learner_params[:T], actions)
    vs, adv = np_vtrace_gae(worker_logp, target_logp, rewards, discounts, values, algo.gae_lambda,
                            algo.clip_rho, algo.clip_c, algo.clip_pg_rho)
    pi, pi_target, pi_worker = np.exp(learner_logp), np.exp(target_logp), np.exp(worker_logp)
    ratio = {"target": pi / pi_target, "worker": pi / pi_worker,
             "impact": pi / np.maximum(pi_target, pi_worker / algo.impact_rho)}[ratio_kind]
    policy = -np.mean(np.minimum(ratio * adv, np.clip(ratio, 1 - algo.clip, 1 + algo.clip) * adv))
    value = 0.5 * np.mean((values[:T] - vs) ** 2)
    ent = np.mean(entropy(learner_params[:T]))
    expected = policy + algo.value_coef * value - algo.entropy_coef * ent
    if kl_coef:
        kl_term = np.mean(kl(target_params, learner_params[:T]))
        expected += kl_coef * kl_term
        assert float(metrics["kl_target"]) == pytest.approx(kl_term, rel=1e-9)
    assert float(metrics["policy_loss"]) == pytest.approx(policy, rel=1e-9)
    assert float(metrics["value_loss"]) == pytest.approx(value, rel=1e-9)
    assert float(loss) == pytest.approx(expected, rel=1e-9)
    if ratio_kind == "impact":  # the clip must actually bind somewhere for the test to mean something
        assert 0 < np.mean(worker_logp - target_logp > math.log(algo.impact_rho)) < 1


# ---- presets -----------------------------------------------------------------------------------
def test_presets_set_their_fields_and_refuse_contradictions():
    appo = RunCfg(arch=ArchCfg(name="impact", preset="appo"))
    assert (appo.algo.name, appo.arch.replay_times, appo.arch.use_target_network) == ("impact", 1, False)
    impala = RunCfg(arch=ArchCfg(name="impact", preset="impala", buffer_batches=2))
    assert (impala.algo.name, impala.arch.replay_times, impala.arch.buffer_batches) == ("vtrace", 1, 2)
    impact = RunCfg(arch=ArchCfg(name="impact", preset="impact", replay_times=4), algo=AlgoCfg(name="impact"))
    assert impact.arch.use_target_network and impact.arch.replay_times == 4
    assert RunCfg.from_dict(impala.to_dict()) == impala
    with pytest.raises(ConfigError, match="replay_times"):
        RunCfg(arch=ArchCfg(name="impact", preset="appo", replay_times=4))
    with pytest.raises(ConfigError, match="--algo"):
        RunCfg(arch=ArchCfg(name="impact", preset="impala"), algo=AlgoCfg(name="impact"))
    with pytest.raises(ConfigError, match="--arch impact"):
        ArchCfg(name="paac", preset="appo")
    with pytest.raises(ConfigError, match="target network"):
        RunCfg(arch=ArchCfg(name="impact", preset="appo"), algo=AlgoCfg(kl_coef=0.1))



def test_cli_preset_flag_and_refusals(tmp_path):
    from conveyor.cli import build_parser, config_from_args, main

    args = build_parser().parse_args(["train", "--arch", "impact", "--preset", "impala", "--buffer-batches", "2"])
    cfg = config_from_args(args)
    assert (cfg.algo.name, cfg.arch.replay_times, cfg.arch.buffer_batches) == ("vtrace", 1, 2)
    assert main(["train", "--arch", "impact", "--preset", "appo", "--replay-times", "3"]) == 2

# ---- end to end --------------------------------------------------------------------------------
# Tuned on CartPole (rl-zoo's PPO settings for it: lr 1e-3, gamma 0.98, lambda 0.8) with K=8 replays.
CARTPOLE_ALGO = AlgoCfg(name="impact", lr=1e-3, gamma=0.98, gae_lambda=0.8)


def impact_cfg(tmp_path, **overrides) -> RunCfg:
    env = overrides.pop("env", EnvCfg(id="CartPole-v1", num_envs=8, num_workers=2))
    arch = overrides.pop("arch", ArchCfg(name="impact", worker_batch=32, replay_times=8))
    algo = overrides.pop("algo", CARTPOLE_ALGO)
    return RunCfg(env=env, arch=arch, algo=algo, out=str(tmp_path / "run"), progress=False, torch_threads=1,
                  log_interval_s=30.0, **overrides)


def train(cfg):
    from conveyor.architectures import run

    return run(cfg)


def check_common(summary, cfg):
    """What every IMPACT summary must show: lag histogram, time split, K-bounded reuse, target syncs, broadcasts."""
    K = cfg.arch.replay_times
    assert summary["updates"] <= K * summary["batches_received"]
    assert summary["updates"] >= K * (summary["batches_received"] - cfg.arch.buffer_batches)
    lag = summary["policy_lag"]
    assert sum(lag["histogram"].values()) == summary["updates"] * cfg.arch.worker_batch * cfg.env.envs_per_worker
    assert set(summary["time_split"]) == {"env", "act", "learn", "wait"}
    assert all(seconds > 0 for name, seconds in summary["time_split"].items() if name != "wait")
    # Workers act with published parameters only, never newer than the learner's (-1: delivered no batch). That
    # every worker gets the broadcast is test_broadcast_reaches_every_reader_process: here a worker on a loaded
    # machine may fill all its batches before the first update, so "each > 0" would depend on timing.
    assert all(-1 <= version <= summary["learner_version"] for version in summary["worker_param_versions"])
    # The target network (impact's own algorithm only) takes the learner's weights every target_update updates.
    resolved = json.loads((Path(cfg.out) / "config.json").read_text())
    if resolved["algo"]["name"] == "impact" and resolved["arch"]["use_target_network"]:
        assert summary["counters"].get("target_syncs", 0) == summary["updates"] // resolved["arch"]["target_update"]
    else:
        assert "target_syncs" not in summary["counters"]


@pytest.mark.slow  # 25-40 s; make test keeps IMPACT's learning on Memory-v0 (test_recurrent_actor_critic.py)
def test_impact_learns_cartpole(tmp_path):
    # Random play scores 23 on CartPole; with these settings 30k env steps reached 150-160 (mean of the
    # last 100 episodes) on the seeds tried on an idle machine. The workers act on parameters as old as the
    # load makes them (a clean-clone make test beside a training run and a CPU hog ended at 98.9), so the bar
    # is 60, well above random; test_learns_by_default holds the presets to their own bar over 60k steps.
    cfg = impact_cfg(tmp_path, total_steps=30_000, seed=1)
    summary = train(cfg)
    check_common(summary, cfg)
    assert summary["return_mean_last100"] >= 60, summary["return_mean_last100"]
    assert max(summary["worker_param_versions"]) > 0  # it learned, so workers acted with updated weights


@pytest.mark.slow  # 40-75 s; impact's learning stays in make test on Memory-v0
def test_impact_improves_pendulum(tmp_path):
    # Gaussian head. Random play scores -1256 +- 296 per Pendulum-v1 episode (200 episodes), so the mean of
    # 100 random episodes lies within -1256 +- 90 (3 standard errors). With these settings 70k env steps
    # reached -350 and -490 on the seeds tried (the curve takes off near 50k), so -900 is well above
    # random and leaves room for the run-to-run noise of asynchronous training.
    env = EnvCfg(id="Pendulum-v1", num_envs=8, num_workers=2)
    algo = AlgoCfg(name="impact", lr=1e-3, gamma=0.9, entropy_coef=0.0, max_grad_norm=0.5)
    arch = ArchCfg(name="impact", worker_batch=50, buffer_batches=4, replay_times=16)
    cfg = impact_cfg(tmp_path, env=env, algo=algo, arch=arch, total_steps=70_000, seed=0)
    summary = train(cfg)
    check_common(summary, cfg)
    assert summary["return_mean_last100"] >= -900, summary["return_mean_last100"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["appo", "impala"])
def test_presets_run_one_update_per_batch(tmp_path, preset):
    arch = ArchCfg(name="impact", preset=preset, worker_batch=16)
    cfg = impact_cfg(tmp_path, arch=arch, algo=AlgoCfg(), total_steps=2000)
    summary = train(cfg)
    check_common(summary, cfg)  # no target network in either preset: no target syncs
    assert summary["algo"] == ("vtrace" if preset == "impala" else "impact")


@pytest.mark.slow  # 8 s; make test keeps IMPACT's worker deaths in test_faults_impact.py (repeated deaths)
def test_dead_worker_stops_the_run_with_its_name_and_leaves_no_process(tmp_path):
    from conveyor.architectures.impact.collector import pool_specs
    from conveyor.architectures.impact.workers import Workers
    from conveyor.storage.shm import SharedArrays

    cfg = impact_cfg(tmp_path)
    model = make_model(cfg.model, *SPACES)
    pool = SharedArrays(pool_specs(cfg, *SPACES))
    params = ParamBlock(model)
    params.publish(model, 0)
    workers = Workers(cfg, pool, params)
    try:
        slot = None
        while slot is None:
            slot = workers.next_slot(1.0)
        workers.release(slot)
        workers.processes[1].kill()
        with pytest.raises(RuntimeError, match="impact worker 1"):
            for _ in range(100):
                workers.next_slot(0.5)
    finally:
        processes = list(workers.processes)
        workers.close()
        params.close()
        pool.close()
    assert all(process.poll() is not None for process in processes)


@pytest.mark.slow
def test_impact_solves_cartpole(tmp_path):
    # The presets alone, as a user gets them (`conveyor train --arch impact --env CartPole-v1`). Its workers and
    # learner race each other, so a run's batches differ from run to run. This test used to set K = 8 replays
    # of each batch, the presets' K = 4 only since their sweep (benchmarks/results/preset_sweep.csv); with K = 8,
    # 4 of 26 runs (beside CPU hogs or in `make test-slow`, 2026-12-04 and 05) peaked near 474 and then wavered
    # around 400-460 to 600k steps (one: 473.8 at 117k, 411 at 600k), where the race's K = 4 runs reach 475 at
    # 125k-139k steps; with the presets this test passed 7 of 7 runs, three and four at a time on the 2 cores
    # (2026-12-05). 600k steps leave room.
    cfg = RunCfg(env=EnvCfg(id="CartPole-v1"), arch=ArchCfg(name="impact"), out=str(tmp_path / "run"),
                 progress=False, log_interval_s=30.0, total_steps=600_000, seed=0)
    summary = train(cfg)
    check_common(summary, cfg)
    assert summary["stop_reason"] == "target_return reached" and summary["return_mean_last100"] >= 475, summary

