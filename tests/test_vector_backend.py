"""The ``vector`` backend (gymnasium's native CartPoleVectorEnv, ``conveyor.envs.native_vector``): same-step
episodes against gymnasium's single CartPole, episode seeds as ``inproc``'s, exact resume, refusals, auto's
choice."""

from __future__ import annotations

import dataclasses
import io
import json

import gymnasium as gym
import numpy as np
import pytest
import torch

import conveyor
from conveyor.config import ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg
from conveyor.envs import make_vector_env
from conveyor.envs.history import EnvHistory
from conveyor.envs.inproc import choose_backend
from conveyor.envs.native_vector import NativeVectorEnv


def vector_cfg(num_envs: int = 8, **fields) -> EnvCfg:
    return EnvCfg(**{"id": "CartPole-v1", "num_envs": num_envs, "num_workers": 1, "backend": "vector", **fields})


def balancing(obs: np.ndarray) -> np.ndarray:
    """Push the cart under the falling pole: keeps CartPole up for its 500 steps, mostly."""
    return (obs[:, 2] + 0.3 * obs[:, 3] + 0.01 * obs[:, 0] + 0.05 * obs[:, 1] > 0).astype(np.int64)


def test_episodes_match_gymnasiums_single_cartpole():
    """Each env's every step is gymnasium's single CartPoleEnv (with its TimeLimit) from the same state: even
    envs balance (their episodes reach 500 steps: truncated), odd ones act at random (terminated)."""
    batch, rng = 4, np.random.default_rng(0)
    refs = [gym.make("CartPole-v1") for _ in range(batch)]
    with make_vector_env(vector_cfg(batch), 3) as venv:
        assert isinstance(venv, NativeVectorEnv) and venv.single_observation_space == refs[0].observation_space
        obs = venv.reset()
        for ref in refs:
            ref.reset(seed=0)
        lengths = np.zeros(batch, int)
        ended, ours, theirs = [], [], []  # the episodes; each step's observations (next or final) on either side
        for _ in range(1000):
            assert np.all(np.abs(obs[lengths == 0]) <= 0.05)  # a new episode's first observation
            actions = np.where(np.arange(batch) % 2 == 0, balancing(obs), rng.integers(0, 2, batch))
            before = venv.env.state.copy()
            step = venv.step(actions)
            lengths += 1
            for i, ref in enumerate(refs):
                ref.unwrapped.state = before[:, i]  # the same state (float64) in the reference
                ref_obs, ref_reward, ref_terminated, ref_truncated, _ = ref.step(int(actions[i]))
                assert (step.reward[i], step.terminated[i], step.truncated[i]) == (ref_reward, ref_terminated,
                                                                                  ref_truncated)
                theirs.append(ref_obs)
                if ref_terminated or ref_truncated:
                    ours.append(step.final_obs[i])
                    assert step.episode_length[i] == lengths[i] == step.episode_return[i]  # CartPole: 1 a step
                    assert ref_terminated != (lengths[i] == 500)  # cut at 500, else fallen
                    ended.append(bool(ref_truncated))
                    lengths[i] = 0
                    ref.reset()
                else:
                    ours.append(step.obs[i])
                    assert np.isnan(step.episode_return[i]) and step.episode_length[i] == 0
            obs = step.obs
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-6, atol=1e-6)
    assert any(ended) and ended.count(False) > 20


def test_episodes_start_where_inproc_starts_them_and_steps_follow():
    """Episode k of env i starts from ``episode_seed(seed, i, k)``'s draw, as on ``inproc`` (and ``shm``): the
    first observation of every episode is inproc's to the bit; the physics is the single env's formulas in the
    same order (equal to the bit where numpy's array and scalar sin/cos agree: asserted to 1e-6)."""
    actions = np.random.default_rng(2).integers(0, 2, (300, 6))
    ours, theirs = (rollout(vector_cfg(6, backend=backend), 11, actions=actions) for backend in ("vector", "inproc"))
    np.testing.assert_array_equal(ours[0], theirs[0])
    starts = 0
    for mine, other in zip(ours[1:], theirs[1:]):
        for field in ("terminated", "truncated", "episode_length", "reward"):
            np.testing.assert_array_equal(getattr(mine, field), getattr(other, field), err_msg=field)
        done = mine.terminated | mine.truncated
        np.testing.assert_array_equal(mine.obs[done], other.obs[done])  # a new episode's first observation
        np.testing.assert_allclose(mine.obs, other.obs, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(mine.final_obs[done], other.final_obs[done], rtol=1e-6, atol=1e-6)
        starts += int(done.sum())
    assert starts > 50


def test_normalized_rewards_are_inprocs_to_the_bit_and_resume_with_the_envs():
    """``normalize_reward``: each env's training rewards are those of gymnasium's NormalizeReward and ClipReward
    around inproc's single envs, truncated episodes (20 steps: the wrapper keeps their discounted sum) and
    terminated ones alike; a checkpoint's env state carries the statistics on."""
    fields = dict(normalize_reward=True, env_args=(("max_episode_steps", 20),))
    actions = np.random.default_rng(5).integers(0, 2, (400, 6))
    ours, theirs = (rollout(vector_cfg(6, backend=backend, **fields), 4, actions=actions, gamma=0.95)
                    for backend in ("vector", "inproc"))
    rewards = np.array([step.reward for step in ours[1:]])
    np.testing.assert_array_equal(rewards, np.array([step.reward for step in theirs[1:]]))
    assert len(np.unique(rewards)) > 100 and np.all(np.abs(rewards) <= 10)
    assert any(step.truncated.any() for step in ours[1:]) and any(step.terminated.any() for step in ours[1:])
    assert all(np.all(step.episode_return[step.truncated] == 20) for step in ours[1:])  # returns in env units
    cfg = vector_cfg(6, **fields)
    with make_vector_env(cfg, 4, gamma=0.95) as venv:
        venv.reset()
        for action in actions[:200]:
            venv.step(action)
        state = venv.history.state()
    with make_vector_env(cfg, 4, gamma=0.95, env_state=state) as venv:
        venv.reset()
        resumed = np.array([venv.step(action).reward for action in actions[200:]])
    np.testing.assert_array_equal(resumed, rewards[200:])
    with pytest.raises(ConfigError, match="stepped with normalize_reward: resume with the run's own"):
        make_vector_env(vector_cfg(6, env_args=fields["env_args"]), 4, gamma=0.95, env_state=state).reset()


def rollout(cfg: EnvCfg, seed: int, steps: int = 300, env_offset: int = 0, actions: np.ndarray | None = None,
            gamma: float | None = None) -> list:
    if actions is None:
        actions = np.random.default_rng(7).integers(0, 2, (steps, cfg.num_envs))
    with make_vector_env(cfg, seed, env_offset=env_offset, gamma=gamma) as venv:
        return [venv.reset()] + [venv.step(a) for a in actions]


def assert_same(first: list, second: list) -> None:
    np.testing.assert_array_equal(first[0], second[0])
    for ours, theirs in zip(first[1:], second[1:]):
        for field in ours._fields:
            rows = ours.terminated | ours.truncated if field == "final_obs" else slice(None)  # else stale
            np.testing.assert_array_equal(getattr(ours, field)[rows], getattr(theirs, field)[rows], err_msg=field)


def test_a_seed_fixes_every_trajectory_and_env_offset_adds_to_it():
    cfg = vector_cfg(4)
    assert_same(rollout(cfg, 5), rollout(cfg, 5))
    # env i's episodes depend on its global index alone: a split over ranks steps the whole batch's episodes
    actions = np.random.default_rng(4).integers(0, 2, (300, 8))
    whole = rollout(vector_cfg(8), 5, actions=actions)
    share = rollout(cfg, 5, env_offset=4, actions=actions[:, 4:])
    assert_same([whole[0][4:]] + [type(step)(*(field[4:] for field in step)) for step in whole[1:]], share)
    assert not np.array_equal(rollout(cfg, 5, steps=0)[0], rollout(cfg, 6, steps=0)[0])


def test_copy_false_returns_reused_views_and_misuse_is_refused():
    with make_vector_env(vector_cfg(2), 0, copy=False) as venv:
        with pytest.raises(RuntimeError, match="before reset"):
            venv.step_async(np.zeros(2, int))
        first = venv.reset()
        step = venv.step(np.zeros(2, int))
        assert step.obs is venv.step(np.ones(2, int)).obs and first is step.obs
        with pytest.raises(ValueError, match="expected \\(2,\\)"):
            venv.step_async(np.zeros(3, int))
        assert (venv.env_errors, venv.restarts) == (0, 0)
    with pytest.raises(RuntimeError, match="closed"):
        venv.reset()


def test_env_state_continues_exactly_where_the_run_stopped():
    cfg, actions = vector_cfg(5), np.random.default_rng(3).integers(0, 2, (500, 5))
    with make_vector_env(cfg, 9) as venv:
        venv.reset()
        before = [venv.step(a) for a in actions[:250]]
        saved = io.BytesIO()
        torch.save(venv.history.state(), saved)  # as a checkpoint holds it
        original = [venv.step(a) for a in actions[250:]]
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    assert state["next_episode"].min() > 1  # each env's next episode: its seed
    with make_vector_env(cfg, 9, env_state=state) as venv:
        np.testing.assert_array_equal(venv.reset(), before[-1].obs)
        resumed = [venv.step(a) for a in actions[250:]]
    assert_same([None, *original], [None, *resumed])
    spanning = [i for j, step in enumerate(original) for i in range(5) if step.episode_length[i] > j + 1]
    assert spanning  # episodes that began before the save count their earlier steps


def test_a_checkpoint_of_one_kind_of_backend_is_refused_by_the_other():
    with make_vector_env(vector_cfg(2), 0) as venv:
        venv.reset()
        native_state = venv.history.state()
    history_state = EnvHistory(2).state()
    with pytest.raises(ConfigError, match="stepped by --env-backend inproc or shm.*resume with --env-backend inproc"):
        make_vector_env(vector_cfg(2), 0, env_state=history_state)
    for backend in ("inproc", "shm", "envpool"):
        with pytest.raises(ConfigError, match="stepped by --env-backend vector.*resume with --env-backend vector"):
            make_vector_env(vector_cfg(2, backend=backend), 0, env_state=native_state)
    with pytest.raises(ConfigError, match="holds 2 envs.*this run steps 3.*--num-envs"):
        make_vector_env(vector_cfg(3), 0, env_state=native_state).reset()
    # auto takes the backend that loads the checkpoint's kind
    with make_vector_env(vector_cfg(2, backend="auto"), 0, env_state=history_state) as venv:
        assert not isinstance(venv, NativeVectorEnv)
    with make_vector_env(vector_cfg(2, backend="auto"), 0, env_state=native_state) as venv:
        assert isinstance(venv, NativeVectorEnv)


def test_what_the_native_env_cannot_honour_is_refused_in_one_line_and_auto_passes_over_it():
    refused = {
        "no native vector env that conveyor steps.*use --env-backend auto, inproc or shm": dict(id="MountainCar-v0"),
        "--env-arg render_mode: the native vector env .* takes only max_episode_steps, sutton_barto_reward":
            dict(env_args=(("render_mode", "rgb_array"),)),
    }
    for message, fields in refused.items():
        with pytest.raises(ConfigError, match=message):
            make_vector_env(vector_cfg(2, **fields), 0)
        assert choose_backend(vector_cfg(2, backend="auto", **fields), 0).backend == "inproc"
    assert choose_backend(vector_cfg(2, backend="auto", normalize_reward=True), 0).backend == "vector"
    with pytest.raises(ConfigError, match="--env-groups 2 steps groups of the shm backend's worker processes"):
        RunCfg(env=vector_cfg(4), arch=ArchCfg(name="paac", env_groups=2))


def test_the_vector_envs_own_keywords_apply():
    cut = vector_cfg(3, env_args=(("max_episode_steps", 20),))
    with make_vector_env(cut, 0) as venv:
        obs = venv.reset()
        lengths = []
        for _ in range(100):
            step = venv.step(balancing(obs))
            obs = step.obs
            lengths += step.episode_length[step.truncated].tolist()
        assert lengths and set(lengths) == {20}
    sutton_barto = vector_cfg(3, env_args=(("sutton_barto_reward", True),))
    with make_vector_env(sutton_barto, 0) as venv:
        venv.reset()
        steps = [venv.step(np.zeros(3, int)) for _ in range(30)]  # always left: falls
    ended = [(step.reward[i], step.episode_return[i]) for step in steps for i in range(3) if step.terminated[i]]
    assert ended and all(reward == -1.0 == ret for reward, ret in ended)


def test_auto_picks_the_native_vector_env_and_records_why():
    choice = choose_backend(EnvCfg(id="CartPole-v1", num_envs=64, num_workers=2), 0)
    assert choice.backend == "vector" and 0 < choice.step_us and "CartPoleVectorEnv steps all 64 envs" in choice.reason
    assert choose_backend(EnvCfg(id="CartPole-v0", num_envs=4, num_workers=1), 0).backend == "vector"
    assert choose_backend(EnvCfg(id="CartPole-v1", num_envs=4, num_workers=1), 0, native=False).backend == "inproc"
    with make_vector_env(EnvCfg(id="CartPole-v1", num_envs=4, num_workers=1), 0) as venv:
        assert isinstance(venv, NativeVectorEnv)


def test_paac_on_the_vector_backend_resumes_to_the_same_parameters(tmp_path):
    cfg = RunCfg(env=EnvCfg(id="CartPole-v1", num_envs=8, num_workers=2), arch=ArchCfg(name="paac", unroll=8),
                 model=ModelCfg(hidden=(16,)), total_steps=2_560, torch_threads=1, progress=False,
                 target_return=float("inf"))
    whole = conveyor.train(dataclasses.replace(cfg, out=str(tmp_path / "whole")))
    recorded = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert recorded["env"]["backend"] == "vector" and recorded["env_backend_choice"]["backend"] == "vector"
    conveyor.train(dataclasses.replace(cfg, out=str(tmp_path / "split"), total_steps=1_024))
    resumed = conveyor.train(dataclasses.replace(cfg, out=str(tmp_path / "split"), resume=str(tmp_path / "split")))
    assert (resumed["env_steps"], resumed["episodes"]) == (whole["env_steps"], whole["episodes"])
    assert resumed["param_sha256"] == whole["param_sha256"]
    inproc = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, backend="inproc"),
                                 out=str(tmp_path / "split"), resume=str(tmp_path / "split"), total_steps=4_000)
    before = {path: path.read_bytes() for path in sorted((tmp_path / "split").rglob("*")) if path.is_file()}
    with pytest.raises(ConfigError, match="resume with --env-backend vector"):
        conveyor.train(inproc)
    assert {path: path.read_bytes() for path in sorted((tmp_path / "split").rglob("*")) if path.is_file()} == before
