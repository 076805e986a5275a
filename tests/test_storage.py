"""Rollout storage markers and env-column minibatches."""

import pytest
import torch

from conveyor.storage.rollout import UINT8_MARKER, RolloutStorage, env_columns


def test_new_storage_is_marked_unwritten():
    storage = RolloutStorage(3, 2, (4,), torch.uint8, (), torch.int64)
    assert storage.unwritten_steps() == 6
    assert (storage.obs == UINT8_MARKER).all()
    assert (storage.actions == -1).all() and (storage.policy_version == -1).all()
    assert torch.isnan(storage.behaviour_logp).all()


def test_insert_fills_every_step_once():
    storage = RolloutStorage(3, 2, (4,), torch.float32, (), torch.int64)
    for t in range(3):
        storage.insert(t, torch.full((2, 4), float(t)), torch.tensor([t, t]), torch.zeros(2), torch.zeros(2),
                       torch.ones(2), torch.full((2,), 0.99), version=7)
        assert storage.unwritten_steps() == 2 * (2 - t)
    storage.insert_last(torch.full((2, 4), 3.0))
    batch = storage.batch()
    assert batch["obs"][:, 0, 0].tolist() == [0, 1, 2, 3]
    assert (batch["policy_version"] == 7).all()


def test_env_columns_keep_time_order():
    storage = RolloutStorage(2, 4, (1,), torch.float32, (), torch.int64)
    storage.obs.copy_(torch.arange(12, dtype=torch.float32).view(3, 4, 1))
    sub = env_columns(storage.batch(), torch.tensor([3, 1]))
    assert sub["obs"][..., 0].tolist() == [[3, 1], [7, 5], [11, 9]]
    assert sub["rewards"].shape == (2, 2)


def test_drop_step_masks_the_lost_step_and_bootstraps_the_steps_before_from_its_value():
    """A step lost mid-rollout (its worker died) acts like a truncation at s_t for the steps before it."""
    from conveyor.returns import nstep_returns

    T, B, gamma = 4, 2, 0.9
    storage = RolloutStorage(T, B, (1,), torch.float32, (), torch.int64)
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


def test_unwrite_puts_the_markers_back_in_the_given_columns():
    storage = RolloutStorage(2, 3, (1,), torch.float32, (), torch.int64)
    for step in range(2):
        storage.insert(step, torch.ones(3, 1), torch.ones(3, dtype=torch.int64), torch.ones(3), torch.ones(3),
                       torch.ones(3), torch.ones(3), 0)
    storage.unwrite(torch.tensor([1]))
    assert storage.unwritten_steps() == 2
    assert torch.isnan(storage.rewards[:, 1]).all() and (storage.actions[:, 1] == -1).all()
    assert (storage.rewards[:, [0, 2]] == 1).all()
