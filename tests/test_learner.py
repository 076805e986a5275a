"""Learner: update and version counter, atomic checkpoints, refusal of corrupt or foreign files."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from conveyor.config import AlgoCfg, ModelCfg, RunCfg
from conveyor.learner import CheckpointError, Learner, latest_checkpoint, load_checkpoint, save_checkpoint
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


def test_checkpoint_round_trip(tmp_path):
    learner = make_learner()
    learner.update({"obs": torch.randn(3, 2, 4)})
    learner.save(tmp_path / "checkpoints" / "ckpt-000000000010.pt", env_steps=10)
    other = make_learner()
    state = other.load(latest_checkpoint(tmp_path))
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
        latest_checkpoint(tmp_path)
