"""What a run does when its numbers, its files or its disk go bad (issue 21): non-finite updates are skipped and,
when they persist, stop the run with one line; checkpoints are never written from non-finite parameters, written
through exclusively created temp files, rotated only among the run's own, and a resumed run falls back to the
newest one that loads; a resumed copy writes only into itself; a broken config.json or a malicious checkpoint is
one line, never a traceback or a torch warning."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import math
import shutil
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import conveyor.files
from conveyor.cli import main
from conveyor.config import AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg
from conveyor.errors import RunFailure
from conveyor.learner import (MAX_BAD_BATCHES, CheckpointError, Learner, load_checkpoint, load_latest_checkpoint,
                              save_checkpoint)
from conveyor.models import make_model
from conveyor.run import Run
from conveyor.telemetry import MetricsCsv, write_json_atomic
from tests.fault_env import NAN_ID

OBS = gym.spaces.Box(-1, 1, (4,), np.float32)
TINY_RUN = ["--num-envs", "2", "--num-workers", "1", "--unroll", "5", "--torch-threads", "1", "--no-progress",
            "--target-return", "inf"]


def value_loss(out, batch):
    value = out.value.pow(2).mean()
    return value, {"value_loss": value.detach()}


def make_learner(normalize_obs=False, loss=value_loss):
    cfg = RunCfg(algo=AlgoCfg(name="a2c", lr=0.01, optimizer="adam"),
                 model=ModelCfg(hidden=(8,), normalize_obs=normalize_obs))
    return Learner(make_model(cfg.model, OBS, gym.spaces.Discrete(2)), loss, cfg)


def nan_batch(T=3, B=2):
    return {"obs": torch.full((T + 1, B, 4), math.nan), "rewards": torch.zeros(T, B)}


def good_batch(T=3, B=2):
    return {"obs": torch.randn(T + 1, B, 4), "rewards": torch.zeros(T, B)}


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


# ---- row 1: non-finite updates ------------------------------------------------------------------------------
def test_nonfinite_loss_skips_the_update_and_persisting_ones_stop_the_run():
    learner = make_learner()
    before, optimizer_before = learner.param_sha256(), learner.optimizer.state_dict()
    metrics = learner.update(nan_batch())
    assert math.isnan(metrics["loss"])
    assert learner.param_sha256() == before and learner.version == 0 and learner.skipped_updates == 1
    assert learner.nonfinite  # R2D2 writes no priorities back for such a batch
    assert learner.optimizer.state_dict() == optimizer_before  # no step: Adam's moments were not even created
    learner.update(good_batch())  # a good batch in between: the count of bad batches in a row starts over
    assert learner.version == 1 and not learner.nonfinite
    for _ in range(MAX_BAD_BATCHES - 1):
        learner.update(nan_batch())
    with pytest.raises(RunFailure) as failure:
        learner.update(nan_batch())
    message = one_line(str(failure.value))
    assert f"{MAX_BAD_BATCHES} batches in a row" in message
    assert "non-finite loss (nan; terms value_loss) from a batch whose obs held NaN/inf" in message
    assert learner.version == 1 and learner.skipped_updates == MAX_BAD_BATCHES + 1


def test_nonfinite_gradient_is_named_and_skipped():
    def infinite_gradient(out, batch):
        value = out.value.mean()
        value.register_hook(lambda grad: grad * math.inf)
        return value, {}

    learner = make_learner(loss=infinite_gradient)
    before = learner.param_sha256()
    for _ in range(MAX_BAD_BATCHES - 1):
        learner.update(good_batch())
    with pytest.raises(RunFailure, match=r"non-finite gradient norm \((nan|inf)\), so their updates were skipped"):
        learner.update(good_batch())
    assert learner.param_sha256() == before


def test_a_bad_batch_counts_once_however_many_steps_run_on_it():
    learner = make_learner()
    for _ in range(MAX_BAD_BATCHES - 1):  # PPO: 2 epochs x 2 minibatches, 4 skipped steps per batch
        learner.update_epochs(nan_batch(B=4), epochs=2, minibatches=2, generator=torch.Generator().manual_seed(0))
    assert learner.skipped_updates == 4 * (MAX_BAD_BATCHES - 1) and learner.version == 0
    with pytest.raises(RunFailure):
        learner.update_epochs(nan_batch(B=4), epochs=2, minibatches=2)


def test_nonfinite_observations_never_reach_the_input_statistics():
    learner = make_learner(normalize_obs=True)
    learner.update(nan_batch())
    learner.observe(torch.full((5, 4), math.inf))
    assert learner.obs_normalizer.count.item() == 0
    learner.update(good_batch())
    assert all(bool(torch.isfinite(buffer).all()) for buffer in learner.model.buffers())


def test_no_checkpoint_is_written_from_nonfinite_parameters(tmp_path):
    learner = make_learner()
    learner.save(tmp_path / "ckpt-000000000001.pt")
    with torch.no_grad():
        next(learner.model.parameters())[0] = math.nan
    with pytest.raises(RunFailure, match="are not finite, so checkpoint .*ckpt-000000000002.pt was not written"):
        learner.save(tmp_path / "ckpt-000000000002.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000000001.pt"]


def test_env_returning_nan_stops_paac_with_one_line_and_healthy_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--env", NAN_ID, "--env-arg", "nan_after=60", *TINY_RUN, "--total-steps", "100000",
                 "--checkpoint-every", "40", "--keep-checkpoints", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert one_line(err).startswith("conveyor: run failed: 5 batches in a row gave a non-finite loss")
    assert "from a batch whose obs" in err and "check the env's observations" in err
    checkpoints = sorted((out / "checkpoints").glob("ckpt-*.pt"))
    assert len(checkpoints) == 2
    for path in checkpoints:  # written while updates were skipped: the parameters stayed finite
        model = load_checkpoint(path)["model"]
        assert all(bool(torch.isfinite(t).all()) for t in model.values() if t.is_floating_point())


# ---- row 2: a resumed copy writes only into itself ---------------------------------------------------------
def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *TINY_RUN, "--total-steps", "60", "--out", str(out)]) == 0
    return out


def test_resumed_copy_writes_only_into_the_copy(finished_run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    original = snapshot(finished_run)
    assert main(["train", "--resume", str(copy), "--total-steps", "120"]) == 0
    assert snapshot(finished_run) == original
    assert json.loads((copy / "summary.json").read_text())["out"] == str(copy)
    assert json.loads((copy / "config.json").read_text())["out"] == str(copy)
    assert len(list((copy / "checkpoints").glob("ckpt-*.pt"))) == 2
    capsys.readouterr()
    assert main(["train", "--resume", str(copy), "--out", str(tmp_path / "elsewhere")]) == 2
    assert "continues that run in place: drop --out" in one_line(capsys.readouterr().err)


def test_failed_resume_leaves_config_json_as_it_was(finished_run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    config = (copy / "config.json").read_bytes()
    # A model the checkpoint does not fit (config.RESUME_MAY_CHANGE): refused before config.json is touched.
    assert main(["train", "--resume", str(copy), "--hidden", "7", "--total-steps", "120"]) == 2
    assert "--hidden" in one_line(capsys.readouterr().err)
    assert (copy / "config.json").read_bytes() == config
    for path in (copy / "checkpoints").glob("ckpt-*.pt"):
        path.write_bytes(b"garbage")
    assert main(["train", "--resume", str(copy), "--total-steps", "120"]) == 2
    assert "no usable checkpoint" in one_line(capsys.readouterr().err)
    assert (copy / "config.json").read_bytes() == config


# ---- row 8: temp files created exclusively ------------------------------------------------------------------
def test_writes_never_follow_a_link_planted_at_a_temp_name(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    # The names the writers used to use, and a symlink at config.json itself.
    for name in ("checkpoints/.ckpt-000000000001.pt.tmp", ".config.json.tmp", "summary.json.tmp",
                 ".metrics.csv.tmp", "config.json"):
        (out / name).symlink_to(victim)
    save_checkpoint(out / "checkpoints" / "ckpt-000000000001.pt", {"model": {"w": torch.ones(2)}})
    write_json_atomic(out / "summary.json", {"a": 1})
    conveyor.files.write_text_atomic(out / "config.json", "{}")
    metrics = MetricsCsv(out / "metrics.csv")
    metrics.write({"a": 1})
    metrics.write({"a": 2, "b": 3})  # a new column: the file is rewritten through a temp file
    assert victim.read_text() == "precious"
    assert not (out / "config.json").is_symlink() and (out / "config.json").read_text() == "{}"
    # Even a link at the very name a writer draws is refused (O_EXCL), never written through.
    monkeypatch.setattr(conveyor.files.secrets, "token_hex", lambda n: "guessed")
    (out / ".summary.json.guessed.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_json_atomic(out / "summary.json", {"a": 2})
    assert victim.read_text() == "precious" and json.loads((out / "summary.json").read_text()) == {"a": 1}


# ---- row 9: rotation deletes only the run's own checkpoints -------------------------------------------------
def checkpoint_at(run: Run, learner: Learner, env_steps: int) -> None:
    run.telemetry.env_steps = env_steps
    run.checkpoint(learner)


def test_rotation_deletes_only_checkpoints_the_run_wrote(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    foreign = [shared / f"ckpt-{steps:012d}.pt" for steps in (5, 15)]  # older: the newest is the run's own
    for path in foreign:
        save_checkpoint(path, {"model": {}})
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").symlink_to(shared)  # checkpoints/ on another disk, beside other runs' files
    cfg = RunCfg(out=str(out), keep_checkpoints=2, progress=False, model=ModelCfg(hidden=(8,)))

    def own() -> list[str]:
        return sorted(p.name for p in shared.iterdir() if p not in foreign)

    with Run(cfg) as run:
        learner = run.learner(make_model(cfg.model, OBS, gym.spaces.Discrete(2)), value_loss)
        for steps in (10, 20, 30):
            checkpoint_at(run, learner, steps)
    assert own() == ["ckpt-000000000020.pt", "ckpt-000000000030.pt"]
    # A resumed run goes on rotating its own checkpoints (the list lives in each checkpoint), never the others.
    with Run(dataclasses.replace(cfg, resume=str(out))) as run:
        learner = run.learner(make_model(cfg.model, OBS, gym.spaces.Discrete(2)), value_loss)
        for steps in (40, 50):
            checkpoint_at(run, learner, steps)
    assert own() == ["ckpt-000000000040.pt", "ckpt-000000000050.pt"]
    assert all(path.is_file() for path in foreign)


# ---- row 10: a full disk ------------------------------------------------------------------------------------
def fill_the_disk(monkeypatch):
    """``torch.save`` into a file on disk writes a little, then fails as a full disk does."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, io.BufferedWriter):
            f.write(b"partial")
            f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_full_disk_is_one_line_naming_the_directory_and_the_space_needed(tmp_path, monkeypatch):
    fill_the_disk(monkeypatch)
    learner = make_learner()
    with pytest.raises(RunFailure) as failure:
        learner.save(tmp_path / "checkpoints" / "ckpt-000000000001.pt")
    message = one_line(str(failure.value))
    assert f"no space left for checkpoint ckpt-000000000001.pt in {tmp_path / 'checkpoints'}" in message
    assert "MiB free, it needs" in message and "continue with --resume" in message
    assert list((tmp_path / "checkpoints").iterdir()) == []  # the partial temp file is gone


def test_full_disk_during_a_run_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    fill_the_disk(monkeypatch)
    out = tmp_path / "run"
    assert main(["train", *TINY_RUN, "--total-steps", "40", "--out", str(out)]) == 1
    assert one_line(capsys.readouterr().err).startswith("conveyor: run failed: no space left for checkpoint")
    assert list((out / "checkpoints").iterdir()) == []


def test_resume_ignores_stray_temp_files(tmp_path, capsys):
    checkpoints = tmp_path / "checkpoints"
    save_checkpoint(checkpoints / "ckpt-000000000010.pt", {"model": {"w": torch.ones(1)}})
    (checkpoints / ".ckpt-000000000020.pt.tmp").write_bytes(b"half a checkpoint")
    (checkpoints / ".ckpt-000000000020.pt.0123456789abcdef.tmp").write_bytes(b"half a checkpoint")
    path, state = load_latest_checkpoint(tmp_path)
    assert path.name == "ckpt-000000000010.pt" and capsys.readouterr().err == ""


# ---- row 11: fall back to the newest checkpoint that loads -------------------------------------------------
def test_resume_falls_back_to_the_newest_valid_checkpoint(tmp_path, capsys):
    checkpoints = tmp_path / "checkpoints"
    for steps in (10, 20, 30):
        save_checkpoint(checkpoints / f"ckpt-{steps:012d}.pt", {"model": {"w": torch.full((100,), steps)}})
    truncated = checkpoints / "ckpt-000000000030.pt"
    truncated.write_bytes(truncated.read_bytes()[:200])
    (checkpoints / "ckpt-000000000040.pt").mkdir()
    path, state = load_latest_checkpoint(tmp_path)
    assert path.name == "ckpt-000000000020.pt" and state["model"]["w"][0] == 20
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert "skipped checkpoint" in lines[0] and "ckpt-000000000040.pt: it is not a file" in lines[0]
    assert "ckpt-000000000030.pt: it is corrupt" in lines[1] and "using ckpt-000000000020.pt" in lines[1]
    for name in ("ckpt-000000000010.pt", "ckpt-000000000020.pt"):
        (checkpoints / name).write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as failure:
        load_latest_checkpoint(tmp_path)
    message = one_line(str(failure.value))
    assert "no usable checkpoint" in message and "the newest, ckpt-000000000040.pt, is not a file" in message
    assert "and so do the 3 older ones" in message


# ---- row 12: a broken config.json ---------------------------------------------------------------------------
@pytest.mark.parametrize("edit, message", [
    (lambda cfg: {**cfg, "seed": "abc"}, "seed must be int, got 'abc'"),
    (lambda cfg: {**cfg, "algo": {**cfg["algo"], "lr": math.nan}}, "lr must be a finite number, got nan"),
    (lambda cfg: {**cfg, "algo": {**cfg["algo"], "lr": math.inf}}, "lr must be a finite number, got inf"),
    (lambda cfg: {**cfg, "model": {**cfg["model"], "hidden": 64}}, "hidden must be a list or null, got 64"),
    (lambda cfg: {**cfg, "algo": "a2c"}, "is not a conveyor config"),
    (lambda cfg: {**cfg, "colour": "blue"}, "unknown config field colour"),
    (lambda cfg: json.dumps(cfg)[:100], "is not a readable JSON file"),
])
def test_broken_config_json_is_one_line_and_exit_2(tmp_path, capsys, edit, message):
    cfg = edit(json.loads(RunCfg(out=str(tmp_path)).to_json()))
    (tmp_path / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert message in one_line(capsys.readouterr().err)


def test_nonfinite_floats_are_refused_anywhere_in_the_config(capsys):
    with pytest.raises(ConfigError, match="gamma must be a finite number, got nan"):
        AlgoCfg(gamma=math.nan)
    with pytest.raises(ConfigError, match="time_limit_s must be a finite number, got inf"):
        RunCfg(time_limit_s=math.inf)
    with pytest.raises(ConfigError, match="autotune_interval must be a finite number"):
        ArchCfg(autotune_interval=-math.inf)
    with pytest.raises(ConfigError, match="target_return must be a finite number, got nan"):
        RunCfg(target_return=math.nan)
    with pytest.raises(ConfigError, match="num_envs must be int or null, got True"):
        EnvCfg(num_envs=True)
    assert RunCfg(target_return=math.inf).target_return == math.inf  # documented: never stop early
    assert main(["train", "--lr", "nan"]) == 2
    assert "lr must be a finite number, got nan" in one_line(capsys.readouterr().err)


# ---- row 14: a malicious checkpoint -------------------------------------------------------------------------
class Payload:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled!')",))


@pytest.mark.parametrize("write", [
    lambda path: torch.save({"model": Payload()}, path),
    lambda path: path.write_bytes(__import__("pickle").dumps({"model": Payload()}, protocol=4)),
])
def test_malicious_checkpoint_is_refused_in_one_clean_line(tmp_path, capsys, write):
    (tmp_path / "config.json").write_text(RunCfg(out=str(tmp_path)).to_json())
    path = tmp_path / "checkpoints" / "ckpt-000000000001.pt"
    path.parent.mkdir()
    write(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError) as failure:
            load_checkpoint(path)
    assert not caught
    message = one_line(str(failure.value))
    assert "a weights-only load refused it: " in message and message.endswith("or start a new run")
    assert "weights_only` set to `False`" not in message  # torch's advice to unpickle it anyway is dropped
    assert main(["train", "--resume", str(tmp_path)]) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith("conveyor: error: no usable checkpoint") and "a weights-only load refused it" in err
