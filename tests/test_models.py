"""Model shapes, dtypes and policy-family maths."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from conveyor.config import ConfigError, ModelCfg
from conveyor.models import Categorical, DiagGaussian, frozen_copy, make_model
from conveyor.transfer import to_device

IMAGE = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
VECTOR = gym.spaces.Box(-1, 1, (6,), np.float32)
DISCRETE = gym.spaces.Discrete(5)
CONTINUOUS = gym.spaces.Box(-1, 1, (3,), np.float32)


def model_cfg(**fields):
    """A complete model config (a bare ``ModelCfg`` leaves its preset fields None)."""
    return ModelCfg(**{"name": "auto", "hidden": (64, 64), "lstm_size": 0, "normalize_obs": False,
                       "normalize_values": False, "separate_value_net": False, "log_std_init": -0.5, **fields})


@pytest.mark.parametrize("name", ["nips_cnn", "nature_cnn", "impala_resnet"])
def test_cnn_encoders_shapes(name):
    model = make_model(model_cfg(name=name), IMAGE, DISCRETE)
    obs = torch.randint(0, 256, (3, 2, 4, 84, 84), dtype=torch.uint8)
    out = model(obs)
    assert out.params.shape == (3, 2, 5)
    assert out.value.shape == (3, 2)
    assert out.log_prob(torch.zeros(3, 2, dtype=torch.long)).shape == (3, 2)


@pytest.mark.parametrize("name", ["nips_cnn", "nature_cnn", "impala_resnet"])
def test_built_in_cnns_read_frames_channels_last_on_the_cpu_and_compute_the_same(name):
    model = make_model(model_cfg(name=name), IMAGE, DISCRETE)
    obs = torch.randint(0, 256, (2, 3, 4, 84, 84), dtype=torch.uint8)
    frames = model._inputs(obs.flatten(0, 1))
    assert frames.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(frames, obs.flatten(0, 1).float() / 255.0)  # the same values, only laid out otherwise
    with torch.no_grad():  # acting: a forward without a graph is faster on NCHW frames
        assert model._inputs(obs.flatten(0, 1)).is_contiguous()
    out = model(obs)
    model.channels_last_frames = False
    assert model._inputs(obs.flatten(0, 1)).is_contiguous()
    reference = model(obs)
    torch.testing.assert_close(out.params, reference.params, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.value, reference.value, rtol=1e-5, atol=1e-6)


def test_vector_models_small_frames_and_encoders_of_your_own_get_their_input_as_it_is():
    assert not make_model(model_cfg(), VECTOR, DISCRETE).channels_last_frames
    minatar = make_model(model_cfg(name="minatar_cnn"), gym.spaces.Box(0, 1, (4, 10, 10), np.uint8), DISCRETE)
    assert minatar._inputs(torch.ones(2, 4, 10, 10, dtype=torch.uint8)).is_contiguous()
    custom = make_model(model_cfg(name="examples.custom_model:MyEncoder"), IMAGE, DISCRETE)
    seen = []
    custom.encoder.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    custom(torch.randint(0, 256, (1, 2, 4, 84, 84), dtype=torch.uint8))
    assert seen == [True]  # its forward may view its input as it likes


def test_auto_model_picks_by_observation_rank():
    assert make_model(model_cfg(), IMAGE, DISCRETE).encoder_name == "nature_cnn"
    assert make_model(model_cfg(), VECTOR, DISCRETE).encoder_name == "mlp"


def test_gaussian_head_shapes_and_log_prob():
    model = make_model(model_cfg(name="mlp"), VECTOR, CONTINUOUS)
    out = model(torch.randn(4, 2, 6))
    assert out.params.shape == (4, 2, 6)  # mean and log-std for 3 action dims
    actions = out.sample()
    assert actions.shape == (4, 2, 3)
    mean, log_std = out.params[..., :3], out.params[..., 3:]
    reference = torch.distributions.Normal(mean, log_std.exp()).log_prob(actions).sum(-1)
    torch.testing.assert_close(out.log_prob(actions), reference)
    torch.testing.assert_close(out.entropy(), torch.distributions.Normal(mean, log_std.exp()).entropy().sum(-1))


def test_gaussian_log_std_starts_at_log_std_init():
    model = make_model(model_cfg(name="mlp", log_std_init=-2.0), VECTOR, CONTINUOUS)
    torch.testing.assert_close(model(torch.randn(1, 5, 6)).params[..., 3:], torch.full((1, 5, 3), -2.0))


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


def test_inverse_cdf_sampling_counts_the_cumulative_probabilities_below_the_uniform():
    # the rule, one row at a time in numpy: the action is the number of cumulative probabilities below u (clipped to
    # the last action where rounding leaves the total under u), ties and zero-probability actions included
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4000, 5, generator=generator)
    logits[::7, 2] = -float("inf")  # actions of probability 0
    uniforms = torch.rand(4000, generator=generator)
    uniforms[::11] = torch.softmax(logits[::11], -1).cumsum(-1)[:, 1]  # u exactly on a cumulative probability
    uniforms[5] = 1.0 - 1e-9
    cdf = torch.softmax(logits, -1).cumsum(-1).numpy()
    expected = [min(sum(1 for c in row if c < u), 4) for row, u in zip(cdf, uniforms.tolist())]
    assert Categorical(5).sample(logits, uniforms).tolist() == expected


def test_log_prob_and_entropy_from_one_softmax_equal_each_alone():
    logits, actions = torch.randn(5, 3, 4), torch.randint(0, 4, (5, 3))
    logp, entropy = Categorical(4).log_prob_and_entropy(logits, actions)
    assert torch.equal(logp, Categorical(4).log_prob(logits, actions))
    assert torch.equal(entropy, Categorical(4).entropy(logits))
    params, continuous = torch.randn(5, 3, 6), torch.randn(5, 3, 3)
    logp, entropy = DiagGaussian(3).log_prob_and_entropy(params, continuous)
    assert torch.equal(logp, DiagGaussian(3).log_prob(params, continuous))
    assert torch.equal(entropy, DiagGaussian(3).entropy(params))


@pytest.mark.parametrize("space, action_space, fields", [
    (VECTOR, DISCRETE, {}), (VECTOR, CONTINUOUS, {}), (VECTOR, DISCRETE, {"normalize_obs": True}),
    (VECTOR, CONTINUOUS, {"separate_value_net": True}), (gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), DISCRETE, {}),
])
def test_acting_on_rows_computes_what_the_forward_does(space, action_space, fields):
    model = make_model(model_cfg(**fields), space, action_space)
    if model.obs_normalizer is not None:  # statistics away from the identity
        model.obs_normalizer.update(torch.randn(50, 6) * 3 + 1)
    obs = torch.as_tensor(np.stack([space.sample() for _ in range(7)]))
    assert model.acts_on_rows
    params, value = model.act_rows(obs)
    out = model(obs.unsqueeze(0))
    assert torch.equal(params, out.params[0]) and torch.equal(value, out.value[0])
    with pytest.raises(ValueError, match="does not match the model's"):
        model.act_rows(obs.unsqueeze(0))


def test_models_with_a_core_a_dueling_head_or_gsde_act_through_the_forward():
    assert not make_model(model_cfg(lstm_size=8), VECTOR, DISCRETE).acts_on_rows
    assert not make_model(model_cfg(), VECTOR, DISCRETE, dueling=True).acts_on_rows
    assert not make_model(model_cfg(gsde=True), VECTOR, CONTINUOUS).acts_on_rows


def test_gaussian_inverse_cdf_sample():
    family = DiagGaussian(1)
    params = torch.tensor([[1.0, np.log(2.0)]], dtype=torch.float32)
    # u = Phi(1) -> mean + 1 * std
    u = torch.tensor([[0.8413447460685429]])
    torch.testing.assert_close(family.sample(params, u), torch.tensor([[3.0]]), atol=1e-4, rtol=0)


def test_lstm_core_resets_on_done_and_carries_state():
    model = make_model(model_cfg(name="mlp", lstm_size=8), VECTOR, DISCRETE)
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


def test_a_frozen_copy_computes_the_same_takes_no_gradients_and_keeps_its_own_weights():
    model = make_model(model_cfg(name="mlp", lstm_size=8), VECTOR, DISCRETE)
    obs, done = torch.randn(4, 2, 6), torch.zeros(4, 2)
    frozen = frozen_copy(model)
    torch.testing.assert_close(frozen(obs, done=done).params, model(obs, done=done).params)
    assert not any(p.requires_grad for p in frozen.parameters()) and all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # a learner step on the original
    assert not torch.equal(frozen(obs, done=done).params, model(obs, done=done).params)


def test_dueling_head_q_values():
    model = make_model(model_cfg(name="mlp", lstm_size=8), VECTOR, DISCRETE, dueling=True)
    out = model(torch.randn(5, 2, 6))
    assert out.q.shape == (5, 2, 5)
    torch.testing.assert_close(out.value, out.q.max(-1).values)


def test_model_errors():
    with pytest.raises(ConfigError, match="image observations"):
        make_model(model_cfg(name="nature_cnn"), VECTOR, DISCRETE)
    with pytest.raises(ConfigError, match="flat observations"):
        make_model(model_cfg(name="mlp"), IMAGE, DISCRETE)
    model = make_model(model_cfg(), VECTOR, DISCRETE)
    with pytest.raises(ValueError, match="does not match"):
        model(torch.randn(1, 2, 7))


def test_unsupported_action_spaces_are_refused():
    for space in (gym.spaces.MultiDiscrete([2, 3]), gym.spaces.Box(-1, 1, (2, 2)),
                  gym.spaces.Dict({"a": gym.spaces.Discrete(2)})):
        with pytest.raises(ConfigError, match="action space .* is not supported: use a Discrete or 1-D Box"):
            make_model(model_cfg(), VECTOR, space)


def test_obs_normalizer_statistics_equal_those_of_all_data_seen():
    model = make_model(model_cfg(normalize_obs=True), VECTOR, DISCRETE)
    data = torch.randn(50, 4, 6) * torch.arange(1.0, 7.0) + 3.0
    for chunk in data.split([7, 20, 23]):  # batches of different sizes
        model.obs_normalizer.update(chunk)
    flat = data.reshape(-1, 6)
    torch.testing.assert_close(model.obs_normalizer.mean, flat.mean(0))
    torch.testing.assert_close(model.obs_normalizer.var, flat.var(0, unbiased=False))
    assert float(model.obs_normalizer.count) == flat.shape[0]
    standardized = model.obs_normalizer(flat)
    torch.testing.assert_close(standardized.mean(0), torch.zeros(6), atol=1e-4, rtol=0)
    torch.testing.assert_close(standardized.std(0, unbiased=False), torch.ones(6), atol=1e-4, rtol=0)


def test_obs_normalizer_clips_and_starts_as_identity():
    model = make_model(model_cfg(normalize_obs=True), VECTOR, DISCRETE)
    plain = make_model(model_cfg(), VECTOR, DISCRETE)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("obs_normalizer.")})
    obs = torch.rand(2, 3, 6) * 2 - 1
    torch.testing.assert_close(model(obs).params, plain(obs).params)  # before any update: mean 0, variance 1
    model.obs_normalizer.update(torch.zeros(10, 6))
    assert model.obs_normalizer(torch.full((1, 6), 5.0)).eq(10.0).all()  # variance 0: clipped to +10


def test_obs_normalizer_statistics_travel_in_the_state_dict_and_forward_leaves_them():
    model = make_model(model_cfg(normalize_obs=True), VECTOR, DISCRETE)
    assert {"obs_normalizer.mean", "obs_normalizer.var", "obs_normalizer.count"} <= set(model.state_dict())
    assert all(tensor.is_floating_point() for tensor in model.state_dict().values())  # IMPACT's ParamBlock
    model.obs_normalizer.update(torch.randn(100, 6) + 2.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(4, 3, 6))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    copy = make_model(model_cfg(normalize_obs=True), VECTOR, DISCRETE)
    copy.load_state_dict(model.state_dict())
    obs = torch.randn(2, 3, 6)
    torch.testing.assert_close(copy(obs).params, model(obs).params)
    assert "obs_normalizer.mean" not in make_model(model_cfg(), VECTOR, DISCRETE).state_dict()


def test_frames_are_scaled_then_standardized_per_pixel_as_sample_factory_does():
    model = make_model(model_cfg(normalize_obs=True), IMAGE, DISCRETE)
    frames = torch.randint(0, 256, (3, 6, 4, 84, 84), dtype=torch.uint8)
    frames[..., :20, :] = 87  # a still background: variance 0
    for chunk in frames:
        model.obs_normalizer.update(chunk)
    scaled = frames.reshape(-1, 4, 84, 84).double().numpy() / 255.0
    mean, var = scaled.mean(0), scaled.var(0)
    np.testing.assert_allclose(model.obs_normalizer.mean.numpy(), mean, atol=1e-6)
    np.testing.assert_allclose(model.obs_normalizer.var.numpy(), var, atol=1e-6)
    obs = torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8)
    obs[..., :20, :] = 87
    obs[0, 0, 3, 3] = 200  # the ball over the background: (200 - 87) / 255 / sqrt(1e-5) is far past the clip
    expected = np.clip((obs.double().numpy() / 255.0 - mean) / np.sqrt(var + 1e-5), -5.0, 5.0)
    for grad in (True, False):  # channels-last where a gradient flows, NCHW when acting: the same numbers
        with torch.set_grad_enabled(grad):
            inputs = model._inputs(obs)
        assert inputs.is_contiguous(memory_format=torch.channels_last) == grad
        np.testing.assert_allclose(inputs.detach().numpy(), expected, atol=1e-4)
    assert float(inputs[0, 0, 3, 3]) == 5.0 and float(inputs[1:, :, :20].abs().max()) < 1e-3


def test_value_normalizer_standardizes_the_head_and_keeps_values_in_env_units():
    model = make_model(model_cfg(normalize_values=True), VECTOR, DISCRETE)
    plain = make_model(model_cfg(), VECTOR, DISCRETE)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("value_normalizer.")})
    obs = torch.randn(2, 3, 6)
    torch.testing.assert_close(model(obs).value, plain(obs).value)  # before any update: the identity
    targets = torch.randn(40) * 3.0 + 7.0
    for chunk in targets.split([15, 25]):
        model.value_normalizer.update(chunk)
    mean, var = targets.double().mean(), targets.double().var(unbiased=False)
    torch.testing.assert_close(model.value_normalizer.moments().double(),
                               torch.stack([mean, torch.sqrt(var + 1e-5)]), rtol=1e-5, atol=1e-5)
    head = plain(obs).value  # the same weights: what the head outputs
    torch.testing.assert_close(model(obs).value, mean.float() + torch.sqrt(var + 1e-5).float() * head)
    params, values = model.act_rows(obs[0])
    torch.testing.assert_close(values, model(obs[:1]).value[0])
    assert {"value_normalizer.mean", "value_normalizer.var", "value_normalizer.count"} <= set(model.state_dict())


def test_separate_value_net_has_its_own_encoder():
    model = make_model(model_cfg(separate_value_net=True), VECTOR, CONTINUOUS)
    assert model.value_encoder is not None
    obs = torch.randn(3, 2, 6)
    out = model(obs)
    out.value.sum().backward()
    assert all(p.grad is None for p in model.encoder.parameters())  # the value loss leaves the policy trunk alone
    assert all(p.grad is not None for p in model.value_encoder.parameters())
    model.zero_grad()
    model(obs).params.sum().backward()
    assert all(p.grad is None for p in model.value_encoder.parameters())
    assert make_model(model_cfg(), VECTOR, CONTINUOUS).value_encoder is None


def test_separate_value_net_refuses_recurrent_and_dueling_models():
    with pytest.raises(ConfigError, match="separate_value_net does not support a recurrent core"):
        model_cfg(separate_value_net=True, lstm_size=8)
    with pytest.raises(ConfigError, match="dueling Q head has neither"):
        make_model(model_cfg(separate_value_net=True), VECTOR, DISCRETE, dueling=True)


@pytest.mark.parametrize("space", [DISCRETE, CONTINUOUS])
def test_sampling_draws_from_the_generator_on_its_own_device(space):
    # A CPU generator serving a model elsewhere draws on the CPU; on the CPU the draws are those of a plain call.
    model = make_model(model_cfg(), VECTOR, space)
    out = model(torch.randn(1, 4, 6))
    actions = out.sample(generator=torch.Generator().manual_seed(3))
    again = out.sample(generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(actions, again)
    if space is DISCRETE:
        uniform = torch.rand((1, 4), generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(actions, out.policy.sample(out.params, uniform))
    else:
        noise = torch.randn((1, 4, 3), generator=torch.Generator().manual_seed(3))
        mean, log_std = out.params.chunk(2, dim=-1)
        torch.testing.assert_close(actions, mean + noise * log_std.exp())


def test_to_device_on_the_cpu_is_as_tensor():
    shared = np.arange(6, dtype=np.float32)
    as_is = to_device(shared, "cpu")
    shared[0] = 7.0  # same dtype on the CPU: the tensor is a view of the array, as torch.as_tensor gives
    assert as_is[0].item() == 7.0 and as_is.dtype == torch.float32
    converted = to_device(np.array([True, False]), torch.device("cpu"), torch.float32)
    assert converted.tolist() == [1.0, 0.0]
    # what from_numpy would warn about or refuse goes through as_tensor: read-only arrays, lists
    frozen = np.arange(3.0)
    frozen.flags.writeable = False
    assert to_device(frozen, "cpu").tolist() == [0.0, 1.0, 2.0]
    assert to_device([1, 2], "cpu").dtype == torch.int64
    tensor = torch.ones(2)
    assert to_device(tensor, "cpu") is tensor
