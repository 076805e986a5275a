"""Observation, value-target and reward normalization: where the statistics change, where they travel, what they
leave alone."""

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch

from conveyor.algos import make_loss
from conveyor.architectures.hts.delayed import acting_tensors, delayed_update
from conveyor.architectures.impact.params import ParamBlock
from conveyor.algos.ppo import with_targets
from conveyor.config import AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg
from conveyor.envs import EPISODE_KEY, make_env, make_vector_env
from conveyor.learner import Learner
from conveyor.models import ObsNormalizer, make_model
from conveyor.storage.rollout import step_samples

OBS = gym.spaces.Box(-1, 1, (4,), np.float32)
ACTIONS = gym.spaces.Discrete(2)
T, B = 5, 4


def learner_for(algo="a2c", normalize_obs=True, seed=0):
    cfg = RunCfg(algo=AlgoCfg(name=algo, lr=0.01, ppo_epochs=2, ppo_minibatches=2),
                 model=ModelCfg(hidden=(16,), normalize_obs=normalize_obs))
    torch.manual_seed(seed)
    return Learner(make_model(cfg.model, OBS, ACTIONS), make_loss(cfg), cfg)


def random_batch(seed):
    generator = torch.Generator().manual_seed(seed)
    return {"obs": torch.randn(T + 1, B, 4, generator=generator) * 3 + 1,
            "actions": torch.randint(0, 2, (T, B), generator=generator),
            "rewards": torch.randn(T, B, generator=generator), "discounts": torch.full((T, B), 0.99),
            "behaviour_logp": torch.full((T, B), float(np.log(0.5))),
            "behaviour_value": torch.randn(T + 1, B, generator=generator),
            "policy_version": torch.zeros(T, B, dtype=torch.int64)}


def statistics_of(*batches):
    normalizer = ObsNormalizer((4,))
    for batch in batches:
        normalizer.update(batch["obs"])
    return normalizer.state_dict()


def assert_same_tensors(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def assert_statistics(normalizer, expected):
    for name, value in normalizer.state_dict().items():
        torch.testing.assert_close(value, expected[name])


def test_the_learner_takes_the_gradient_under_the_old_statistics_and_observes_each_batch_once():
    for algo, epochs, minibatches in (("a2c", 1, 1), ("ppo", 2, 2)):
        normalized, plain = learner_for(algo), learner_for(algo, normalize_obs=False)
        batch = random_batch(1)
        # Before any update the statistics are the identity, so if they move only after the optimizer steps
        # (not before the forward) the update equals the plain model's.
        for learner in (normalized, plain):
            learner.update_epochs(batch, epochs, minibatches, torch.Generator().manual_seed(0))
        assert_same_tensors(list(normalized.model.parameters()), list(plain.model.parameters()))
        # PPO takes 2 epochs x 2 minibatches of steps, yet counts every observation once.
        assert_statistics(normalized.model.obs_normalizer, statistics_of(batch))
        assert float(normalized.model.obs_normalizer.count) == (T + 1) * B


def test_delayed_update_takes_the_gradient_under_the_behaviour_statistics():
    base = learner_for()
    base.update(random_batch(1))
    behaviour = [t.detach().clone() for t in acting_tensors(base.model)]  # theta_{t-1} with its statistics
    base.update(random_batch(2))
    batch = random_batch(3)
    results = []
    for seen in (random_batch(4), random_batch(5)):  # theta_t with statistics that differ between the two
        learner = copy.deepcopy(base)
        learner.observe(seen["obs"])
        delayed_update(learner, behaviour, batch)
        results.append([p.detach() for p in learner.model.parameters()])
        # The learner's statistics move on from its own by this batch; theta_{t-1}'s play no part.
        assert_statistics(learner.model.obs_normalizer, statistics_of(random_batch(1), random_batch(2), seen, batch))
    assert_same_tensors(*results)  # the gradient was taken under the behaviour statistics alone
    learner = copy.deepcopy(base)
    other = [t.clone() for t in behaviour]
    other[-3] += 1.0  # the behaviour's mean (buffers follow the parameters: mean, var, count)
    delayed_update(learner, other, batch)
    assert not all(torch.equal(p, q) for p, q in zip(learner.model.parameters(), results[0]))


def test_weight_broadcast_carries_the_statistics():
    model_cfg = RunCfg(model=ModelCfg(hidden=(8,), normalize_obs=True)).model
    model = make_model(model_cfg, OBS, ACTIONS)
    model.obs_normalizer.update(torch.randn(50, 4) * 2 + 1)
    reader = make_model(model_cfg, OBS, ACTIONS)
    block = ParamBlock(model)
    try:
        block.publish(model, 3)
        assert block.read_into(reader) == 3
    finally:
        block.close()
    for name, value in model.state_dict().items():
        assert torch.equal(value, reader.state_dict()[name]), name


def test_make_env_normalizes_training_rewards_and_keeps_episode_returns():
    cfg = EnvCfg(id="CartPole-v1", normalize_reward=True)
    env, reference = make_env(cfg, 0, gamma=0.9), gym.wrappers.NormalizeReward(gym.make("CartPole-v1"), gamma=0.9)
    reference.reset(seed=0)
    rewards, expected, episode = [], [], None
    for step in range(200):
        _, reward, terminated, truncated, info = env.step(step % 2)
        expected.append(reference.step(step % 2)[1])
        rewards.append(reward)
        if terminated or truncated:
            episode = info[EPISODE_KEY]
            break
    np.testing.assert_allclose(rewards, np.clip(expected, -10, 10))
    assert not np.allclose(rewards, 1.0)
    assert episode is not None and episode["r"] == len(rewards)  # env units: 1 per step
    assert make_env(cfg, 0).step(0)[1] == 1.0  # no discount given (evaluation): rewards as the env gives them
    assert make_env(EnvCfg(id="CartPole-v1", normalize_reward=False), 0, gamma=0.9).step(0)[1] == 1.0


def test_vector_env_workers_normalize_rewards_with_the_given_discount():
    cfg = EnvCfg(id="CartPole-v1", num_envs=2, num_workers=1, normalize_reward=True)
    with make_vector_env(cfg, 0, gamma=0.99) as venv:
        venv.reset()
        rewards, returns = [], []
        for _ in range(100):
            step = venv.step(np.zeros(2, np.int64))
            rewards.append(step.reward.copy())
            returns += step.episode_return[~np.isnan(step.episode_return)].tolist()
    assert not np.allclose(rewards, 1.0) and np.all(np.abs(rewards) <= 10)
    assert returns and all(r == int(r) and r >= 8 for r in returns)  # raw CartPole returns


def test_reward_normalization_is_refused_on_envpool():
    with pytest.raises(ConfigError, match="normalize_reward runs in conveyor's own env loop, not in envpool"):
        EnvCfg(normalize_reward=True, backend="envpool")


def value_learner(seed=0):
    cfg = RunCfg(algo=AlgoCfg(name="ppo", lr=0.01, ppo_epochs=2, ppo_minibatches=2),
                 model=ModelCfg(hidden=(16,), normalize_values=True))
    torch.manual_seed(seed)
    return Learner(make_model(cfg.model, OBS, ACTIONS), make_loss(cfg), cfg)


def test_the_learner_folds_each_batchs_valid_value_targets_once_before_its_epochs():
    learner = value_learner()
    batches = [with_targets(random_batch(seed), gae_lambda=0.95) for seed in (1, 2)]
    batches[1]["valid"] = torch.ones(T, B, dtype=torch.bool)
    batches[1]["valid"][2, 1] = False  # a step a dead worker lost: its target stays out
    batches[1]["returns"][2, 1] = 1e6
    seen = []
    original = learner.compute_gradients

    def record(minibatch, model_out=None):
        seen.append(minibatch["value_moments"].clone())
        return original(minibatch, model_out)

    learner.compute_gradients = record
    for batch in batches:
        learner.update_epochs(batch, 2, 2, torch.Generator().manual_seed(0), steps=True)
    targets = torch.cat([batches[0]["returns"].flatten(), batches[1]["returns"][batches[1]["valid"]]]).double()
    normalizer = learner.model.value_normalizer
    assert float(normalizer.count) == 2 * T * B - 1
    torch.testing.assert_close(normalizer.mean.double(), targets.mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(normalizer.var.double(), targets.var(unbiased=False), rtol=1e-5, atol=1e-6)
    # Every step of a batch standardizes with the statistics that include that batch, fixed across its epochs.
    assert len(seen) == 8 and all(torch.equal(m, seen[0]) for m in seen[:4]) and torch.equal(seen[-1],
                                                                                           normalizer.moments())
    first = batches[0]["returns"].flatten().double()
    torch.testing.assert_close(seen[0].double(), torch.stack([first.mean(), (first.var(unbiased=False) + 1e-5).sqrt()]),
                               rtol=1e-5, atol=1e-6)


def test_the_value_loss_trains_the_head_on_standardized_targets():
    learner = value_learner()
    batch = with_targets(random_batch(3), gae_lambda=0.95)
    batch["returns"] = batch["returns"] * 50.0 + 200.0  # returns far from the head's unit scale
    learner.update_epochs(batch, 2, 2, torch.Generator().manual_seed(0), steps=True)
    mean, std = learner.model.value_normalizer.moments()
    returns = batch["returns"].double()
    torch.testing.assert_close(mean.double(), returns.mean(), rtol=1e-5, atol=1e-4)
    assert float(std) > 20.0
    out = learner.model(batch["obs"])
    head = (out.value - mean) / std  # what the head outputs: unit scale, not 200
    assert float(head.abs().max()) < 5.0
    expected = 0.5 * ((head[:T] - ((batch["returns"] - mean) / std).clamp(-5, 5)) ** 2).mean()
    metrics, _ = learner.compute_gradients({**step_batch(batch), "value_moments": torch.stack([mean, std])})
    assert metrics["value_loss"] == pytest.approx(float(expected), rel=1e-4)


def step_batch(batch):
    """All T x B steps of ``batch`` as one ``[1, N]`` minibatch (``Learner.update_epochs(steps=True)``)."""
    return step_samples(batch, torch.arange(T * B))


def test_value_normalization_is_refused_where_targets_are_not_fixed_before_the_update():
    for algo in ("a2c", "vtrace"):
        with pytest.raises(ConfigError, match="--normalize-values standardizes value targets .* PPO's"):
            RunCfg(algo=AlgoCfg(name=algo), model=ModelCfg(normalize_values=True),
                   arch=ArchCfg(name="paac" if algo == "a2c" else "impact"))
