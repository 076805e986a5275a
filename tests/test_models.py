"""Model shapes, dtypes and policy-family maths."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from conveyor.config import ConfigError, ModelCfg
from conveyor.models import Categorical, DiagGaussian, make_model

IMAGE = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
VECTOR = gym.spaces.Box(-1, 1, (6,), np.float32)
DISCRETE = gym.spaces.Discrete(5)
CONTINUOUS = gym.spaces.Box(-1, 1, (3,), np.float32)


@pytest.mark.parametrize("name", ["nips_cnn", "nature_cnn", "impala_resnet"])
def test_cnn_encoders_shapes(name):
    model = make_model(ModelCfg(name=name), IMAGE, DISCRETE)
    obs = torch.randint(0, 256, (3, 2, 4, 84, 84), dtype=torch.uint8)
    out = model(obs)
    assert out.params.shape == (3, 2, 5)
    assert out.value.shape == (3, 2)
    assert out.log_prob(torch.zeros(3, 2, dtype=torch.long)).shape == (3, 2)


def test_auto_model_picks_by_observation_rank():
    assert make_model(ModelCfg(), IMAGE, DISCRETE).encoder_name == "nature_cnn"
    assert make_model(ModelCfg(), VECTOR, DISCRETE).encoder_name == "mlp"


def test_gaussian_head_shapes_and_log_prob():
    model = make_model(ModelCfg(name="mlp"), VECTOR, CONTINUOUS)
    out = model(torch.randn(4, 2, 6))
    assert out.params.shape == (4, 2, 6)  # mean and log-std for 3 action dims
    actions = out.sample()
    assert actions.shape == (4, 2, 3)
    mean, log_std = out.params[..., :3], out.params[..., 3:]
    reference = torch.distributions.Normal(mean, log_std.exp()).log_prob(actions).sum(-1)
    torch.testing.assert_close(out.log_prob(actions), reference)
    torch.testing.assert_close(out.entropy(), torch.distributions.Normal(mean, log_std.exp()).entropy().sum(-1))


def test_categorical_matches_torch_distribution():
    family = Categorical(4)
    logits = torch.randn(5, 3, 4)
    actions = torch.randint(0, 4, (5, 3))
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(family.log_prob(logits, actions), dist.log_prob(actions))
    torch.testing.assert_close(family.entropy(logits), dist.entropy())
    other = torch.randn(5, 3, 4)
    torch.testing.assert_close(family.kl(logits, other),
                               torch.distributions.kl_divergence(dist, torch.distributions.Categorical(logits=other)))


def test_inverse_cdf_sampling_is_a_function_of_the_uniform():
    family = Categorical(3)
    logits = torch.log(torch.tensor([[0.2, 0.3, 0.5]]))
    pick = lambda u: int(family.sample(logits, torch.tensor([u]))[0])  # noqa: E731
    assert [pick(0.1), pick(0.25), pick(0.49), pick(0.51), pick(0.99)] == [0, 1, 1, 2, 2]


def test_inverse_cdf_sampling_frequencies():
    family = Categorical(3)
    probs = torch.tensor([0.2, 0.3, 0.5])
    uniforms = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    actions = family.sample(probs.log().expand(200_000, 3), uniforms)
    freq = torch.bincount(actions, minlength=3).float() / 200_000
    torch.testing.assert_close(freq, probs, atol=5e-3, rtol=0)


def test_gaussian_inverse_cdf_sample():
    family = DiagGaussian(1)
    params = torch.tensor([[1.0, np.log(2.0)]], dtype=torch.float32)
    # u = Phi(1) -> mean + 1 * std
    u = torch.tensor([[0.8413447460685429]])
    torch.testing.assert_close(family.sample(params, u), torch.tensor([[3.0]]), atol=1e-4, rtol=0)


def test_lstm_core_resets_on_done_and_carries_state():
    model = make_model(ModelCfg(name="mlp", lstm_size=8), VECTOR, DISCRETE)
    obs = torch.randn(6, 2, 6)
    done = torch.zeros(6, 2)
    full = model(obs, done=done)
    first = model(obs[:3], done=done[:3])
    second = model(obs[3:], state=first.state, done=done[3:])
    torch.testing.assert_close(torch.cat([first.params, second.params]), full.params)
    done[3] = 1.0  # a new episode at t=3 must not see the earlier steps
    reset = model(obs, done=done)
    fresh = model(obs[3:], done=torch.zeros(3, 2))
    torch.testing.assert_close(reset.params[3:], fresh.params)


def test_dueling_head_q_values():
    model = make_model(ModelCfg(name="mlp", lstm_size=8), VECTOR, DISCRETE, dueling=True)
    out = model(torch.randn(5, 2, 6))
    assert out.q.shape == (5, 2, 5)
    torch.testing.assert_close(out.value, out.q.max(-1).values)


def test_model_errors():
    with pytest.raises(ConfigError, match="image observations"):
        make_model(ModelCfg(name="nature_cnn"), VECTOR, DISCRETE)
    with pytest.raises(ConfigError, match="flat observations"):
        make_model(ModelCfg(name="mlp"), IMAGE, DISCRETE)
    model = make_model(ModelCfg(), VECTOR, DISCRETE)
    with pytest.raises(ValueError, match="does not match"):
        model(torch.randn(1, 2, 7))


def test_unsupported_action_spaces_are_refused():
    for space in (gym.spaces.MultiDiscrete([2, 3]), gym.spaces.Box(-1, 1, (2, 2)),
                  gym.spaces.Dict({"a": gym.spaces.Discrete(2)})):
        with pytest.raises(ConfigError, match="action space .* is not supported: use a Discrete or 1-D Box"):
            make_model(ModelCfg(), VECTOR, space)
