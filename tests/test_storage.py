"""The rollout schema, rollout storage markers and env-column minibatches."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from conveyor.models import policy_family
from conveyor.storage.rollout import ROLLOUT_FIELDS, RolloutStorage, env_columns, step_samples
from conveyor.storage.schema import (UINT8_MARKER, FieldSpec, RolloutSchema, action_field, fill_marker,
                                     observation_field, standard_fields)
from conveyor.storage.shm import SharedArrays
from conveyor.storage.unrolls import UnrollQueue


def rollout(T: int, B: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype = torch.float32) -> RolloutStorage:
    """Storage for T steps of B envs with discrete actions."""
    return RolloutStorage(RolloutSchema(FieldSpec(obs_shape, obs_dtype), FieldSpec((), torch.int64), ROLLOUT_FIELDS),
                          T, B)


def test_new_storage_is_marked_unwritten():
    storage = rollout(3, 2, (4,), torch.uint8)
    assert storage.unwritten_steps() == 6
    assert (storage.obs == UINT8_MARKER).all()
    assert (storage.actions == -1).all() and (storage.policy_version == -1).all()
    assert torch.isnan(storage.behaviour_logp).all()


def test_insert_fills_every_step_once():
    storage = rollout(3, 2, (4,))
    for t in range(3):
        storage.insert(t, torch.full((2, 4), float(t)), torch.tensor([t, t]), torch.zeros(2), torch.zeros(2),
                       torch.ones(2), torch.full((2,), 0.99), version=7)
        assert storage.unwritten_steps() == 2 * (2 - t)
    storage.insert_last(torch.full((2, 4), 3.0))
    batch = storage.batch()
    assert batch["obs"][:, 0, 0].tolist() == [0, 1, 2, 3]
    assert (batch["policy_version"] == 7).all()


def test_env_columns_keep_time_order():
    storage = rollout(2, 4, (1,))
    storage.obs.copy_(torch.arange(12, dtype=torch.float32).view(3, 4, 1))
    sub = env_columns(storage.batch(), torch.tensor([3, 1]))
    assert sub["obs"][..., 0].tolist() == [[3, 1], [7, 5], [11, 9]]
    assert sub["rewards"].shape == (2, 2)


def test_step_samples_pick_single_steps_time_major_and_drop_the_bootstrap_row():
    storage = rollout(2, 3, (1,))
    storage.obs.copy_(torch.arange(9, dtype=torch.float32).view(3, 3, 1))  # obs[t, b] = 3 t + b
    storage.rewards.copy_(torch.arange(6, dtype=torch.float32).view(2, 3))
    sub = step_samples(storage.batch(), torch.tensor([5, 0, 3]))  # flat index t * B + b
    assert sub["obs"][..., 0].tolist() == [[5, 0, 3]]  # obs[1, 2], obs[0, 0], obs[1, 0]; never row T = 2
    assert sub["rewards"].tolist() == [[5, 0, 3]] and "valid" not in sub  # every step is valid
    storage.drop_step(0, torch.tensor([False, True, False]))
    sub = step_samples(storage.batch(), torch.tensor([5, 0, 1]))
    assert sub["valid"].tolist() == [[True, True, False]]
    assert sub["behaviour_value"].shape == (1, 3)


def test_drop_step_masks_the_lost_step_and_bootstraps_the_steps_before_from_its_value():
    """A step lost mid-rollout (its worker died) acts like a truncation at s_t for the steps before it."""
    from conveyor.returns import nstep_returns

    T, B, gamma = 4, 2, 0.9
    storage = rollout(T, B, (1,))
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    for step in range(T):
        storage.insert(step, torch.zeros(B, 1), torch.zeros(B, dtype=torch.int64), torch.zeros(B), values[step],
                       torch.ones(B), torch.full((B,), gamma), 0)
    storage.drop_step(2, torch.tensor([False, True]))
    assert storage.valid.tolist() == [[True, True], [True, True], [True, False], [True, True]]
    returns = nstep_returns(storage.rewards, storage.discounts, torch.tensor([9.0, 10.0]))
    # env 1: G_2 = V(s_2) = 6, so G_1 = 1 + 0.9 * 6 and G_0 = 1 + 0.9 * G_1, as if the episode were cut at s_2
    assert returns[:, 1].tolist() == pytest.approx([1 + gamma * (1 + gamma * 6.0), 1 + gamma * 6.0, 6.0,
                                                    1 + gamma * 10.0])
    # env 0 is untouched
    assert returns[0, 0].item() == pytest.approx(sum(gamma**k for k in range(4)) + gamma**4 * 9.0)
    storage.insert(2, torch.zeros(B, 1), torch.zeros(B, dtype=torch.int64), torch.zeros(B), values[2],
                   torch.ones(B), torch.full((B,), gamma), 1)
    assert storage.valid.all()  # the next rollout's step 2 is valid again


def test_host_memory_writes_equal_torchs_and_land_in_the_fields():
    """A CPU storage writes through numpy views of its fields; one whose obs dtype numpy lacks (bfloat16) writes
    with torch. Both hold the same values, for whole steps and for env groups, with tensor and int versions."""
    storages = [rollout(2, 4, (2,)), rollout(2, 4, (2,), torch.bfloat16)]
    assert storages[0]._host is not None and storages[1]._host is None
    for storage in storages:
        storage.drop_step(1, torch.tensor([True, False, False, False]))
        storage.insert(0, torch.arange(8.0).view(4, 2), torch.tensor([1, 0, 1, 0]), torch.full((4,), -0.5),
                       torch.arange(4.0), torch.ones(4), torch.full((4,), 0.9), 3)
        for first, version in ((0, 4), (2, torch.tensor([5, 6]))):  # env groups write their columns
            columns = slice(first, first + 2)
            storage.insert(1, torch.full((2, 2), float(first)), torch.tensor([0, 1]), torch.zeros(2),
                           torch.ones(2), torch.zeros(2), torch.ones(2), version, envs=columns)
    host, reference = (storage.batch() for storage in storages)
    assert set(host) == set(reference) and "valid" not in host  # the dropped step was written again
    for name, value in host.items():  # the bootstrap row was not written: markers on both
        torch.testing.assert_close(value, reference[name].to(value.dtype), rtol=0, atol=0, equal_nan=True)
    assert host["policy_version"].tolist() == [[3, 3, 3, 3], [4, 4, 5, 6]]
    assert host["obs"][1, :, 0].tolist() == [0, 0, 2, 2] and host["rewards"][0].tolist() == [1, 1, 1, 1]


def test_unwrite_puts_the_markers_back_in_the_given_columns():
    storage = rollout(2, 3, (1,))
    for step in range(2):
        storage.insert(step, torch.ones(3, 1), torch.ones(3, dtype=torch.int64), torch.ones(3), torch.ones(3),
                       torch.ones(3), torch.ones(3), 0)
    storage.unwrite(torch.tensor([1]))
    assert storage.unwritten_steps() == 2
    assert torch.isnan(storage.rewards[:, 1]).all() and (storage.actions[:, 1] == -1).all()
    assert (storage.rewards[:, [0, 2]] == 1).all()


# ---- the rollout schema --------------------------------------------------------------------------

SPACES = {
    "vector obs, discrete actions": (gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(3)),
    "pixel obs, continuous actions": (gym.spaces.Box(0, 255, (2, 6, 5), np.uint8),
                                      gym.spaces.Box(-1, 1, (2,), np.float32)),
}
LSTM_STATE = {"state_h": FieldSpec((7,), torch.float32, "start")}


def full_schema(obs_space: gym.Space, action_space: gym.Space) -> RolloutSchema:
    """Every standard field, and a recurrent state as an extra."""
    obs, action = observation_field(obs_space), action_field(policy_family(action_space))
    return RolloutSchema(obs, action, standard_fields(obs, action), LSTM_STATE)


def is_marker(values: torch.Tensor) -> bool:
    if values.dtype.is_floating_point:
        return bool(torch.isnan(values).all())
    if values.dtype == torch.uint8:
        return bool((values == UINT8_MARKER).all())
    if values.dtype == torch.bool:
        return not values.any()
    return bool((values == -1).all())


@pytest.mark.parametrize("spaces", SPACES.values(), ids=SPACES.keys())
def test_torch_storage_and_shared_arrays_of_one_schema_agree(spaces):
    obs_space, action_space = spaces
    schema = full_schema(obs_space, action_space)
    T, B, slots = 4, 3, 2
    tensors = schema.tensors(T, B)
    specs = schema.array_specs(slots, T, envs=B, prefix="seg_")
    assert [spec.name for spec in specs] == [f"seg_{name}" for name in tensors] == [f"seg_{name}" for name in
                                                                                    schema.fields]
    shared = SharedArrays(specs)
    try:
        for name, tensor in tensors.items():
            slot = torch.from_numpy(shared[f"seg_{name}"][1])
            assert (slot.shape, slot.dtype) == (tensor.shape, tensor.dtype), name
    finally:
        shared.close()
    # Time-major [T(+1), B, ...] by time kind; the spaces and the policy family fix obs and actions.
    assert tensors["obs"].shape == (T + 1, B, *obs_space.shape)
    assert tensors["obs"].dtype == torch.from_numpy(obs_space.sample()).dtype
    assert tensors["behaviour_value"].shape == tensors["first"].shape == (T + 1, B)
    assert tensors["rewards"].shape == tensors["policy_version"].shape == (T, B)
    assert tensors["final_obs"].shape == (T, B, *obs_space.shape)
    assert tensors["state_h"].shape == (B, 7)
    discrete = isinstance(action_space, gym.spaces.Discrete)
    assert tensors["actions"].shape == (T, B, *action_space.shape) and tensors["prev_action"].shape[2:] == \
        action_space.shape
    assert tensors["actions"].dtype == tensors["prev_action"].dtype == (torch.int64 if discrete else torch.float32)
    # Without an env axis (GA3C: one env per segment) the slot holds [T(+1), ...].
    unbatched = {spec.name: spec.shape for spec in schema.array_specs(slots, T)}
    assert unbatched["obs"] == (slots, T + 1, *obs_space.shape) and unbatched["state_h"] == (slots, 7)


@pytest.mark.parametrize("spaces", SPACES.values(), ids=SPACES.keys())
def test_fresh_buffers_of_a_schema_hold_the_markers(spaces):
    schema = full_schema(*spaces)
    for name, tensor in schema.tensors(2, 3).items():
        assert is_marker(tensor), name
    queue = UnrollQueue(2, schema.fields, capacity=2)
    for name, tensor in queue.pool.items():
        assert is_marker(tensor), name
    shared = SharedArrays(schema.array_specs(2, 2, envs=3))  # zeroed memory; fill_marker marks it
    try:
        for name in schema.fields:
            fill_marker(shared[name])
            assert is_marker(torch.from_numpy(shared[name])), name
    finally:
        shared.close()


def test_an_unroll_is_counted_before_the_training_side_can_take_it():
    """``UnrollQueue.put(..., on_stored)``: the count (SEED's env_steps) runs with the unroll copied in and not
    yet visible to ``get_batch``, so a batch never holds steps the run has not counted; a put refused because the
    queue stopped counts nothing."""
    fields = {"rewards": FieldSpec((), torch.float32, "step")}
    queue = UnrollQueue(2, fields, capacity=1)
    seen = []
    assert queue.put(0, {"rewards": torch.ones(2)}, lambda: seen.append((len(queue), queue.pool["rewards"][0].sum())))
    assert seen == [(0, 2.0)] and len(queue) == 1
    queue.close()
    assert not queue.put(1, {"rewards": torch.ones(2)}, lambda: seen.append("counted"), poll_s=0.01)
    assert seen == [(0, 2.0)]


def test_a_storage_without_behaviour_log_probs_takes_none_and_only_none():
    # PAAC's A2C: no loss reads behaviour log-probs, so acting computes none and the storage has no field for them
    obs, action = FieldSpec((4,), torch.float32), FieldSpec((), torch.int64)
    storage = RolloutStorage(RolloutSchema(obs, action, [n for n in ROLLOUT_FIELDS if n != "behaviour_logp"]), 2, 3)
    step = (torch.zeros(3, 4), torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="pass logp exactly when the schema has behaviour_logp"):
        storage.insert(0, *step, torch.zeros(3), torch.zeros(3), torch.ones(3), torch.ones(3), version=0)
    for t in range(2):
        storage.insert(t, *step, None, torch.zeros(3), torch.ones(3), torch.ones(3), version=0)
    assert storage.unwritten_steps() == 0 and "behaviour_logp" not in storage.batch()
    with pytest.raises(ValueError, match="pass logp exactly when the schema has behaviour_logp"):
        rollout(2, 3, (4,)).insert(0, *step, None, torch.zeros(3), torch.ones(3), torch.ones(3), version=0)


def test_schema_names_standard_fields_and_declares_the_rest():
    obs, action = FieldSpec((4,), torch.float32), FieldSpec((), torch.int64)
    with pytest.raises(ValueError, match="unknown rollout fields \\['logp'\\]"):
        RolloutSchema(obs, action, ("obs", "logp"))
    with pytest.raises(ValueError, match="standard rollout fields"):
        RolloutSchema(obs, action, ("obs",), {"rewards": FieldSpec((), torch.float32)})
    with pytest.raises(ValueError, match="needs the rollout fields \\['behaviour_value'\\]"):
        RolloutStorage(RolloutSchema(obs, action, [n for n in ROLLOUT_FIELDS if n != "behaviour_value"]), 2, 2)
    storage = RolloutStorage(RolloutSchema(obs, action, ROLLOUT_FIELDS, {"uniforms": FieldSpec((), torch.float32)}),
                             2, 3)
    assert storage.uniforms.shape == (2, 3) and set(storage.batch()) == {*ROLLOUT_FIELDS, "uniforms"}
