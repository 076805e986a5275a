"""Tracking (``conveyor/tracking.py``): W&B logging (offline: the run's transaction log read back), videos
recorded during training (``--capture-video-every``: PAAC, and SEED with its actor process), TensorBoard
hparams, and ``--wandb`` without the package. Two tiny training runs, one video each."""

from __future__ import annotations

import csv
import json
import math
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conveyor.cli import main
from conveyor.telemetry import Telemetry
from conveyor.tracking import VideoCapture
from tests.videos import video_size_and_frames

torch.set_num_threads(1)

TINY_CARTPOLE = ["--env", "CartPole-v1", "--num-envs", "4", "--num-workers", "1", "--hidden", "16",
                 "--torch-threads", "1", "--no-progress", "--log-interval-s", "0.2", "--seed", "0"]


@pytest.fixture(scope="module")
def wandb_env(tmp_path_factory):
    """Offline and silent W&B whose own files (cache, config, debug logs) stay in a temp dir; the current
    directory is an empty temp dir, to see that nothing lands in it. At the end W&B's service process
    (``wandb-core``, which outlives a run for the next one) is stopped: tests that run later in this process
    assert that no child process is left."""
    wandb = pytest.importorskip("wandb")
    home = tmp_path_factory.mktemp("wandb-home")
    cwd = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        for name in ("CACHE", "CONFIG", "DATA", "ARTIFACT"):
            patch.setenv(f"WANDB_{name}_DIR", str(home / name.lower()))
        patch.chdir(cwd)
        yield cwd
        wandb.teardown()


@pytest.fixture(scope="module")
def paac_run(wandb_env):
    out = wandb_env / "paac"
    assert main(["train", *TINY_CARTPOLE, "--total-steps", "400", "--out", str(out), "--wandb", "conveyor-tests",
                 "--wandb-group", "tiny", "--capture-video-every", "400"]) == 0
    return out


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (``run-<id>.wandb``), read with W&B's own protobuf classes. The file
    is a 7-byte header (``:W&B``, magic, version), then LevelDB-log chunks in 32 KiB blocks: 4 bytes CRC, 2 bytes
    length, 1 byte type (1 full, 2 first, 3 middle, 4 last; a block's tail under 7 bytes is padding)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, payload, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero fill to the block's end
            pos += block - pos % block
            continue
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(payload))
            payload = b""
    return records


def finished_records(path: Path, timeout_s: float = 60.0) -> list:
    """The records of a finished W&B run's log. W&B's service buffers the file and may write it out just after
    ``run.finish()`` returns (a loaded machine showed it): wait for its last record, ``exit``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = wandb_records(path)
            if any(record.WhichOneof("record_type") == "exit" for record in records):
                return records
        except Exception:  # a chunk being written
            pass
        assert time.monotonic() < deadline, f"{path} holds no exit record after {timeout_s:.0f} s"
        time.sleep(0.2)


def wandb_run(run_dir: Path) -> tuple[Path, list]:
    """The one offline W&B run directory of a conveyor run, and its records."""
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, offline  # one W&B run: the learner's (workers never init W&B)
    return offline[0], finished_records(next(offline[0].glob("run-*.wandb")))


def history_rows(records: list) -> list[dict[str, object]]:
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row: dict[str, object] = {}
            for item in record.history.item:
                *path, key = item.nested_key or [item.key]  # a video's fields: ["eval/video", "path"]
                place = row
                for part in path:
                    place = place.setdefault(part, {})  # type: ignore[assignment]
                place[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def check_video(run_dir: Path) -> dict[str, str]:
    """The run's one video matches the eval row that reported it (a frame at the reset, one per step); returns
    that row."""
    videos = sorted((run_dir / "videos").iterdir())
    assert [video.name for video in videos] == [videos[0].name], "one video, no held checkpoint or partial file"
    evals = [row for row in read_metrics(run_dir) if row.get("eval/return")]
    assert len(evals) == 1
    row = evals[0]
    steps, length = int(row["eval/env_steps"]), int(row["eval/length"])
    assert videos[0].name == f"step-{steps:012d}.mp4"
    assert float(row["eval/return"]) == length  # CartPole: 1 per step
    assert video_size_and_frames(videos[0]) == ((600, 400), length + 1) and length > 0
    assert int(float(row["count/videos"])) == 1
    return row


# ---- W&B ------------------------------------------------------------------------------------------
@pytest.mark.slow  # the W&B offline run with videos (module fixture paac_run)
def test_wandb_offline_run_holds_the_metrics_rows_and_the_config(paac_run, wandb_env):
    offline, records = wandb_run(paac_run)
    run_id = (paac_run / "wandb-run-id").read_text().strip()
    assert offline.name.endswith(f"-{run_id}")
    assert all((path / "config.json").is_file() for path in wandb_env.iterdir())  # only run dirs: W&B's are in them

    kinds = [record.WhichOneof("record_type") for record in records]
    assert "run" in kinds, kinds
    run = records[kinds.index("run")].run
    assert (run.run_id, run.project, run.run_group, run.display_name) == (run_id, "conveyor-tests", "tiny", "paac")
    config = {update.key: json.loads(update.value_json) for update in run.config.update}
    for record in records:
        if record.WhichOneof("record_type") == "config":
            config.update({update.key: json.loads(update.value_json) for update in record.config.update})
    config_json = json.loads((paac_run / "config.json").read_text())
    assert {key: value for key, value in config.items() if not key.startswith("_")} == config_json
    assert config["wandb"] == "conveyor-tests" and config["env"]["id"] == "CartPole-v1"

    # Every metrics.csv row, value for value (W&B leaves out the empty and non-finite cells, as TensorBoard).
    history, rows = history_rows(records), read_metrics(paac_run)
    assert len(history) == len(rows) >= 3
    for logged, row in zip(history, rows):
        for key, cell in row.items():
            if cell and math.isfinite(float(cell)):
                assert logged[key] == pytest.approx(float(cell)), key
            else:
                assert key not in logged, key
    # The video came with its eval row, copied into the W&B run's files.
    (eval_row,) = [logged for logged in history if "eval/return" in logged]
    assert eval_row["eval/video"]["_type"] == "video-file"
    assert (offline / "files" / eval_row["eval/video"]["path"]).stat().st_size > 0
    summary = json.loads((paac_run / "summary.json").read_text())
    final = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            final.update({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                          for item in record.summary.update})
    assert final["param_sha256"] == summary["param_sha256"] and final["stop_reason"] == "total_steps reached"


@pytest.mark.slow  # the W&B offline run with videos (module fixture paac_run)
def test_a_resumed_run_continues_the_same_wandb_run(paac_run, wandb_env):
    resumed = wandb_env / "resumed"
    shutil.copytree(paac_run, resumed)
    try:
        assert main(["train", "--resume", str(resumed), "--total-steps", "480", "--capture-video-every", "0"]) == 0
        runs = sorted((resumed / "wandb").glob("offline-run-*"))
        run_id = (resumed / "wandb-run-id").read_text().strip()
        assert run_id == (paac_run / "wandb-run-id").read_text().strip()
        # Offline, W&B writes the continuation as a second offline run with the same id.
        assert len(runs) == 2 and all(run.name.endswith(f"-{run_id}") for run in runs)
        steps = [row["env_steps"] for row in history_rows(finished_records(next(runs[1].glob("run-*.wandb"))))]
        assert steps and min(steps) >= 400 and max(steps) == 480
    finally:
        shutil.rmtree(resumed)


def test_wandb_without_the_package_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    out = tmp_path / "run"
    assert main(["train", *TINY_CARTPOLE, "--total-steps", "40", "--out", str(out), "--wandb", "p"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'conveyor[wandb]'" in err, err
    assert not out.exists()  # refused before anything was written


# ---- videos during training ------------------------------------------------------------------------
@pytest.mark.slow  # the W&B offline run with videos (module fixture paac_run)
def test_paac_records_a_video_and_its_eval_return(paac_run):
    row = check_video(paac_run)
    assert int(row["eval/env_steps"]) == 400


@pytest.mark.slow
def test_seed_records_a_video_from_a_checkpoint_that_rotation_removed(wandb_env):
    out = wandb_env / "seed"
    try:
        assert main(["train", "--arch", "seed", "--algo", "vtrace", "--env", "CartPole-v1", "--num-envs", "2",
                     "--num-workers", "1", "--local-actors", "1", "--hidden", "16", "--batch-size", "4",
                     "--unroll", "10", "--torch-threads", "1", "--no-progress", "--log-interval-s", "0.2",
                     "--total-steps", "740", "--checkpoint-every", "40", "--keep-checkpoints", "1",
                     "--capture-video-every", "500", "--out", str(out), "--wandb", "conveyor-tests"]) == 0
        row = check_video(out)
        steps = int(row["eval/env_steps"])
        # Acted steps lead the learner's by at most the unroll queue (8 unrolls), the prefetched and the trained
        # batch (4 each) and the actor's partial unrolls, about 190 steps: one update moves env_steps by at most
        # ~230. So the first update past 500 comes before 740 (a later checkpoint rotates it away) and the run
        # stops before 1000 (no second video), on any machine; 300 within 400 steps failed on a loaded one.
        assert 500 <= steps < 740
        kept = [path.name for path in (out / "checkpoints").iterdir()]
        assert len(kept) == 1 and f"ckpt-{steps:012d}.pt" not in kept  # rotated away while held for the video
        offline, records = wandb_run(out)  # one W&B run: the learner's, not the actor process's
        assert any("eval/video" in logged for logged in history_rows(records))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_a_video_due_while_one_plays_is_skipped_and_counted(tmp_path):
    telemetry = Telemetry(tmp_path, tensorboard=False, progress=False)
    videos = VideoCapture(tmp_path, 100, telemetry)
    playing = threading.Event()
    videos._thread = threading.Thread(target=playing.wait)  # stands in for a recording in flight
    videos._thread.start()
    try:
        assert videos.due(250)
        videos.record(tmp_path / "ckpt-000000000250.pt", 250)
        assert telemetry.counters["videos_skipped"] == 1 and videos.skipped_steps == 250
        assert not videos.due(299) and videos.due(300)
    finally:
        playing.set()
        telemetry.close()


# ---- TensorBoard hparams ---------------------------------------------------------------------------
@pytest.mark.slow  # the W&B offline run with videos (module fixture paac_run)
def test_tensorboard_hparams_hold_the_config_with_the_final_return_as_metric(paac_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(paac_run / "tb"))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    config = json.loads((paac_run / "config.json").read_text())
    assert hparams["env.id"].string_value == "CartPole-v1" and hparams["seed"].number_value == 0
    assert hparams["algo.lr"].number_value == pytest.approx(config["algo"]["lr"])
    assert hparams["capture_video_every"].number_value == 400 and hparams["model.hidden"].string_value == "[16]"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [metric.name.tag for metric in experiment.metric_infos] == ["return_mean_last100"]
    summary = json.loads((paac_run / "summary.json").read_text())
    final = events.Scalars("return_mean_last100")[-1]
    assert final.step == summary["env_steps"] and final.value == pytest.approx(summary["return_mean_last100"])
    assert [event.value for event in events.Scalars("eval/return")] == [float(check_video(paac_run)["eval/return"])]
