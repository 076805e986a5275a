"""Rollout storage markers and env-column minibatches."""

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
