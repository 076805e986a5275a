"""Learner: update and version counter, atomic checkpoints, refusal of corrupt or foreign files."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from conveyor.config import AlgoCfg, ModelCfg, RunCfg
from conveyor.learner import CheckpointError, Learner, load_checkpoint, load_latest_checkpoint, save_checkpoint
from conveyor.models import make_model

OBS = gym.spaces.Box(-1, 1, (4,), np.float32)


def squared_value_loss(out, batch):
    loss = out.value.pow(2).mean()
    return loss, {"value": loss.detach()}


def make_learner(hidden=(8,)):
    cfg = RunCfg(algo=AlgoCfg(name="a2c", lr=0.01, optimizer="adam"), model=ModelCfg(hidden=hidden))
    model = make_model(cfg.model, OBS, gym.spaces.Discrete(2))
    return Learner(model, squared_value_loss, cfg)


def test_update_steps_parameters_and_counts_versions():
    learner = make_learner()
    batch = {"obs": torch.randn(3, 2, 4)}
    before = learner.param_sha256()
    metrics = learner.update(batch)
    assert learner.version == 1
    assert learner.param_sha256() != before
    assert {"loss", "grad_norm", "value"} <= set(metrics)


@pytest.mark.parametrize("steps", [False, True])
def test_update_epochs_covers_every_step_once_per_epoch(steps):
    """Each epoch's minibatches partition the batch: env columns, or with ``steps`` single steps of T x B."""
    T, B, epochs, minibatches = 3, 4, 2, 4
    seen = []

    def recording_loss(out, batch):
        seen.append(batch["rewards"].flatten().tolist())  # rewards[t, b] = t * B + b names the step
        return squared_value_loss(out, batch)

    learner = make_learner()
    learner.loss_fn = recording_loss
    batch = {"obs": torch.randn(T + 1, B, 4), "rewards": torch.arange(T * B, dtype=torch.float32).view(T, B)}
    learner.update_epochs(batch, epochs, minibatches, torch.Generator().manual_seed(0), steps=steps)
    assert learner.version == epochs * minibatches
    for epoch in range(epochs):
        groups = seen[epoch * minibatches:(epoch + 1) * minibatches]
        assert sorted(step for group in groups for step in group) == list(range(T * B))
        if steps:  # single steps drawn from all of T x B, an equal share per minibatch
            assert all(len(group) == T * B // minibatches for group in groups)
        else:  # whole env columns in time order
            assert all(group == sorted(group) and len({step % B for step in group}) == 1 for group in groups)
    with pytest.raises(ValueError, match="at least as many steps"):
        learner.update_epochs(batch, 1, T * B + 1, steps=True)


def test_checkpoint_round_trip(tmp_path):
    learner = make_learner()
    learner.update({"obs": torch.randn(3, 2, 4)})
    learner.save(tmp_path / "checkpoints" / "ckpt-000000000010.pt", env_steps=10)
    other = make_learner()
    state = other.load(load_latest_checkpoint(tmp_path)[0])
    assert other.param_sha256() == learner.param_sha256()
    assert other.version == 1 and state["env_steps"] == 10
    # The optimizer state came back too: the next update is identical.
    batch = {"obs": torch.randn(3, 2, 4)}
    learner.update(batch)
    other.update(batch)
    assert other.param_sha256() == learner.param_sha256()


def test_checkpoint_write_is_atomic_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"model": {"w": torch.ones(2)}})
    save_checkpoint(path, {"model": {"w": torch.zeros(2)}})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.zeros(2))


def test_truncated_checkpoint_is_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"model": {"w": torch.ones(1000)}})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path)


def test_pickled_object_checkpoint_is_refused_not_executed(tmp_path):
    class Payload:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled!')",))

    path = tmp_path / "evil.pt"
    torch.save({"model": Payload()}, path)
    with pytest.raises(CheckpointError, match="corrupt or not a conveyor checkpoint"):
        load_checkpoint(path)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    make_learner(hidden=(8,)).save(tmp_path / "checkpoints" / "ckpt-1.pt")
    with pytest.raises(CheckpointError, match="does not fit this model"):
        make_learner(hidden=(16,)).load(tmp_path / "checkpoints" / "ckpt-1.pt")


def test_missing_checkpoints_are_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoints"):
        load_latest_checkpoint(tmp_path)
