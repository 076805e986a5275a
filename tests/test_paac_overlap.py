"""PAAC env groups (``--env-groups``, Sample Factory's double-buffered sampling): a group of workers steps while
the policy acts on another's observations. Against invariants, not timings: the same seed takes the same actions
and sees the same observations with groups on and off, every env column of every step is written once, lag stays
0, PPO ends with the same parameters bit for bit and A2C to rounding; a worker killed in one group is restarted
and masks that group's step only; a resumed run reaches an uninterrupted one's parameters; bad group counts are
refused in one line."""

from __future__ import annotations

from collections import Counter

import gymnasium as gym
import numpy as np
import pytest
import torch

import conveyor
from conveyor.acting import SharedDraw, pipelined_steps, policy_step
from conveyor.cli import main
from conveyor.config import AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg
from conveyor.envs import make_vector_env
from conveyor.learner import Learner, load_latest_checkpoint
from conveyor.models import make_model
from conveyor.storage.rollout import RolloutStorage
from tests.fault_env import TAGGED_FAMILY, TAGGED_ID, check_transitions, children, train_killing_one

ENVS, WORKERS, UNROLL = 8, 2, 8


def cfg_for(tmp_path, groups: int, algo: str = "a2c", total_steps: int = 1600, **overrides) -> RunCfg:
    # A2C at lr 2e-3 (the 16-env rate): with the 128-env preset's 1e-2 the groups' rounding grows into another
    # sampled action within 1600 steps
    base = dict(env=EnvCfg(id="CartPole-v1", num_envs=ENVS, num_workers=WORKERS, backend="shm"),  # auto: vector
                algo=AlgoCfg(name=algo, lr=2e-3 if algo == "a2c" else None),
                arch=ArchCfg(name="paac", unroll=UNROLL, env_groups=groups), total_steps=total_steps, seed=3,
                torch_threads=1, progress=False, target_return=float("inf"), out=str(tmp_path / f"{algo}-{groups}"))
    return RunCfg(**{**base, **overrides})


def recorded_run(monkeypatch, cfg: RunCfg) -> tuple[dict, list[dict], list[Counter]]:
    """``conveyor.train(cfg)``, recording every batch the learner computed gradients on (with the acting forward's
    outputs, for A2C) and, per rollout, how often each (step, env column) was inserted into the storage."""
    batches: list[dict] = []
    writes: list[Counter] = [Counter()]
    compute, insert, batch = Learner.compute_gradients, RolloutStorage.insert, RolloutStorage.batch

    def recording(learner, data, model_out=None):
        kept = {key: value.detach().clone() for key, value in data.items()}
        if model_out is not None:
            kept["out_params"], kept["out_value"] = model_out.params.detach().clone(), model_out.value.detach().clone()
        batches.append(kept)
        return compute(learner, data, model_out)

    def counting_insert(storage, t, *args, envs=slice(None), **kwargs):
        writes[-1].update((t, env) for env in range(storage.B)[envs])
        return insert(storage, t, *args, envs=envs, **kwargs)

    def closing_batch(storage):
        assert storage.unwritten_steps() == 0
        writes.append(Counter())
        return batch(storage)

    monkeypatch.setattr(Learner, "compute_gradients", recording)
    monkeypatch.setattr(RolloutStorage, "insert", counting_insert)
    monkeypatch.setattr(RolloutStorage, "batch", closing_batch)
    summary = conveyor.train(cfg)
    monkeypatch.undo()
    return summary, batches, writes[:-1]


def max_param_difference(a: str, b: str) -> float:
    left, right = load_latest_checkpoint(a)[1]["model"], load_latest_checkpoint(b)[1]["model"]
    return max(float((left[key].double() - right[key].double()).abs().max()) for key in left)


ROW_INVARIANCE = ("the forward gave some row other numbers in a batch of {n} rows than in one of {whole}: this "
                  "machine's BLAS breaks the premise of the same-actions guarantee (paac/run.py docstring)")


# ---- the pieces ----------------------------------------------------------------------------------------

def test_pipelined_steps_act_on_each_step_once_after_waiting_for_the_last():
    assert list(pipelined_steps(1, 2)) == [("act", 0, 0), ("wait", 0, 0), ("act", 1, 0), ("wait", 1, 0)]
    events = list(pipelined_steps(2, 3))
    assert events[:4] == [("act", 0, 0), ("act", 0, 1), ("wait", 0, 0), ("act", 1, 0)]
    for g in range(2):
        mine = [(event, t) for event, t, group in events if group == g]
        assert mine == [(event, t) for t in range(3) for event in ("act", "wait")]
    # Group 0 acts on step t + 1 while group 1's step t is in flight: the overlap.
    assert events.index(("act", 1, 0)) < events.index(("wait", 0, 1))


def test_groups_sample_their_rows_of_one_draw_for_the_whole_batch():
    torch.manual_seed(0)
    model = make_model(ModelCfg(name="mlp", hidden=(16,), lstm_size=0, normalize_obs=False, separate_value_net=False),
                       gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(5))
    obs = torch.randn(12, 4)
    whole_sampler, parts_sampler = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    draw = SharedDraw(parts_sampler, 3)
    for _ in range(3):  # the samplers stay in step from one step to the next
        whole = policy_step(model, obs, whole_sampler)
        parts = [policy_step(model, obs[4 * g:4 * g + 4], draw.generator(g), rows=(4 * g, 12)) for g in range(3)]
        assert torch.equal(torch.cat([part.actions for part in parts]), whole.actions)
        assert torch.equal(torch.cat([part.logp for part in parts]), whole.logp), ROW_INVARIANCE.format(n=4, whole=12)
        assert torch.equal(parts_sampler.get_state(), whole_sampler.get_state())


def test_env_groups_step_the_envs_a_whole_step_would_and_record_one_history():
    cfg = EnvCfg(id="CartPole-v1", num_envs=6, num_workers=2, backend="shm")
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 2, (40, 6))
    with make_vector_env(cfg, 5) as whole, make_vector_env(cfg, 5) as split:
        groups = split.split(2)
        assert [group.envs for group in groups] == [slice(0, 3), slice(3, 6)]
        assert np.array_equal(whole.reset(), split.reset())
        results: list = [None, None]
        for event, t, g in pipelined_steps(2, len(actions)):
            if event == "act":
                groups[g].step_async(actions[t, groups[g].envs])
                continue
            results[g] = groups[g].step_wait()
            if g == 1:
                expected = whole.step(actions[t])
                for name, got in zip(expected._fields, map(np.concatenate, zip(*results))):
                    assert np.array_equal(getattr(expected, name), got, equal_nan=True), (t, name)
        state, other = whole.history.state(), split.history.state()  # what a checkpoint rebuilds the envs from
        for key in ("actions", "boundaries"):
            assert len(state[key]) == len(other[key]) and all(map(torch.equal, state[key], other[key])), key
        for key in ("next_episode", "game_episode"):
            assert torch.equal(state[key], other[key]), key
        # A group may not run two steps ahead of another (its history row could not be completed in order).
        groups[0].step(actions[0, :3])
        groups[0].step(actions[1, :3])
        with pytest.raises(RuntimeError, match="two steps ahead"):
            groups[0].step_async(actions[2, :3])
        with pytest.raises(RuntimeError, match="different steps"):
            split.step_async(actions[0])
        with pytest.raises(RuntimeError, match="different steps"):
            split.reset()
        with pytest.raises(ValueError, match="do not split into 3 groups"):
            split.split(3)


def test_a_worker_killed_in_one_group_is_restarted_in_that_groups_wait_only():
    cfg = EnvCfg(id="CartPole-v1", num_envs=4, num_workers=2, backend="shm")
    with make_vector_env(cfg, 0, restart_workers=True) as venv:
        first, second = venv.split(2)
        venv.reset()
        first.step_async(np.zeros(2, int))
        victim = venv._workers[1].process
        victim.kill()  # before its command: killed after it, the worker may already have answered the step
        victim.wait()
        second.step_async(np.zeros(2, int))
        assert not first.step_wait().restarted.any() and venv.restarts == 0  # the other group's death is not its
        assert second.step_wait().restarted.all() and venv.restarts == 1
        for _ in range(3):  # both go on
            assert not first.step(np.zeros(2, int)).restarted.any()
            assert not second.step(np.zeros(2, int)).restarted.any()


# ---- runs ----------------------------------------------------------------------------------------------

def test_a2c_with_groups_acts_and_observes_as_without_and_writes_every_column_once(monkeypatch, tmp_path):
    off, off_batches, _ = recorded_run(monkeypatch, cfg_for(tmp_path, 1))
    on, on_batches, writes = recorded_run(monkeypatch, cfg_for(tmp_path, 2))
    assert len(on_batches) == len(off_batches) == on["learner_version"] == 1600 // (ENVS * UNROLL)
    # The first rollout's parameters are the same: so is every number the learner reads, acting outputs included.
    first_on, first_off = on_batches[0], off_batches[0]
    assert first_on.keys() == first_off.keys()
    for key in first_on:  # (behaviour_value's bootstrap row stays NaN: A2C reads V(s_T) from its own forward)
        torch.testing.assert_close(first_on[key], first_off[key], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda text: f"{key}: {ROW_INVARIANCE.format(n=ENVS // 2, whole=ENVS)}: {text}")
    # After that the parameters differ in rounding only (the weight gradient sums the half batches' terms in
    # another order): the same actions, observations, rewards and episodes.
    for on_batch, off_batch in zip(on_batches, off_batches):
        assert "valid" not in on_batch and "valid" not in off_batch  # no step was dropped
        for key in ("obs", "actions", "rewards", "discounts"):
            assert torch.equal(on_batch[key], off_batch[key]), key
    assert on["episodes"] == off["episodes"] and on["env_steps"] == off["env_steps"]
    assert max_param_difference(on["out"], off["out"]) < 1e-5
    # Every (step, env column) of every rollout was written exactly once; every action by the learner's version.
    assert all(count == Counter({(t, env): 1 for t in range(UNROLL) for env in range(ENVS)}) for count in writes)
    assert on["policy_lag"] == {"mean": 0.0, "max": 0, "histogram": {"0": on["env_steps"]}}


@pytest.mark.slow
def test_ppo_with_groups_ends_with_the_same_parameters_bit_for_bit(tmp_path):
    # PPO's gradients come from its own forwards over the stored batch, which groups leave unchanged.
    off, on = (conveyor.train(cfg_for(tmp_path, groups, "ppo", 1024)) for groups in (1, 2))
    assert on["param_sha256"] == off["param_sha256"]
    assert on["policy_lag"]["max"] == 0


@pytest.mark.slow
def test_a_resumed_run_with_groups_reaches_the_uninterrupted_ones_parameters(tmp_path):
    # Groups step on shm, whose envs keep --normalize-reward's statistics out of checkpoints (docs/presets.md):
    # the env's own rewards, as a run that must resume exactly on shm takes them.
    raw = EnvCfg(id="CartPole-v1", num_envs=ENVS, num_workers=WORKERS, backend="shm", normalize_reward=False)
    whole = conveyor.train(cfg_for(tmp_path, 2, total_steps=1024, out=str(tmp_path / "whole"), env=raw))
    conveyor.train(cfg_for(tmp_path, 2, total_steps=512, out=str(tmp_path / "split"), env=raw))
    resumed = conveyor.train(cfg_for(tmp_path, 2, total_steps=1024, out=str(tmp_path / "split"),
                                     resume=str(tmp_path / "split"), env=raw))
    assert (resumed["env_steps"], resumed["episodes"]) == (whole["env_steps"], whole["episodes"])
    assert resumed["param_sha256"] == whole["param_sha256"]


@pytest.mark.slow
def test_a_killed_worker_in_one_group_drops_that_step_of_its_envs_only(monkeypatch, tmp_path):
    cfg = RunCfg(env=EnvCfg(id=TAGGED_ID, family=TAGGED_FAMILY, num_envs=4, num_workers=2),
                 arch=ArchCfg(name="paac", unroll=5, env_groups=2),
                 total_steps=3000, torch_threads=1, progress=False, target_return=float("inf"), out=str(tmp_path))
    summary, recorder = train_killing_one(monkeypatch, cfg, "conveyor.envs.shm_worker")
    assert summary["dropped_steps"] == 2  # the killed worker's 2 envs lose the step they were taking
    counts = check_transitions(recorder.transitions)  # nothing trained on twice, no gap inside an episode
    assert counts["transitions"] == summary["env_steps"] >= 3000
    assert summary["policy_lag"]["max"] == 0
    assert not children()


@pytest.mark.slow  # two torchrun ranks take ~25 s to start and run on the 2-core machine
def test_two_ranks_with_groups_end_as_one_process_without_them(tmp_path):
    """Groups within each rank's workers: 2 ranks x 2 workers x 2 groups sample the actions one process on all 8
    envs samples (the same episodes) and end with its parameters to rounding."""
    from tests.test_distributed import finished, summary, torchrun

    # lr 2e-3, as in tests/test_distributed.py's rounding tests: the 128-env preset's 1e-2 grows rounding into
    # another sampled action within 800 steps
    proc = torchrun(tmp_path / "two", "--arch", "paac", "--algo", "a2c", "--num-workers", "2", "--env-groups", "2",
                    "--total-steps", "800", "--lr", "0.002", "--env-backend", "shm")
    # both on shm: auto would step the single process's CartPole in gymnasium's vector env, other episodes
    single = conveyor.train(RunCfg(env=EnvCfg(id="CartPole-v1", num_envs=8, num_workers=2, backend="shm"),
                                   algo=AlgoCfg(lr=2e-3),
                                   arch=ArchCfg(name="paac", env_groups=1), total_steps=800, torch_threads=1,
                                   progress=False, out=str(tmp_path / "one")))
    finished(proc)
    assert summary(tmp_path / "two")["episodes"] == single["episodes"]
    assert max_param_difference(str(tmp_path / "two"), single["out"]) < 1e-6


# ---- configuration -------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--env-groups", "3"], "--env-groups 3 must divide --num-workers 2"),
    (["--env-groups", "4", "--num-workers", "2", "--num-envs", "8"], "--env-groups 4 must divide --num-workers 2"),
    (["--env-groups", "0"], "env_groups must be positive"),
    (["--env-groups", "2", "--env-backend", "envpool"], "--env-groups 1 or --env-backend shm"),
])
def test_bad_group_counts_are_refused_in_one_line_with_exit_2(capsys, tmp_path, args, message):
    assert main(["train", "--out", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_other_architectures_ignore_env_groups_and_the_preset_fills_it():
    assert RunCfg(arch=ArchCfg(name="hts", env_groups=3)).arch.env_groups == 3  # read by paac only
    with pytest.raises(ConfigError):
        RunCfg(arch=ArchCfg(name="paac", env_groups=3))
    for env_id in ("CartPole-v1", "ALE/Pong-v5", "conveyor/StepTime-v0"):
        for workers in (1, 2, 3):
            cfg = RunCfg(env=EnvCfg(id=env_id, num_envs=6, num_workers=workers), arch=ArchCfg(name="paac"))
            assert cfg.env.num_workers % cfg.arch.env_groups == 0, (env_id, workers)
    assert RunCfg(env=EnvCfg(backend="envpool"), arch=ArchCfg(name="paac")).arch.env_groups == 1
