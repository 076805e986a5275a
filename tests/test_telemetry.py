"""metrics.csv keeps one schema (a header line, every row with every column), for every architecture."""

import csv
import math

import numpy as np
import pandas
import pytest
import torch

import conveyor
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.learner import load_latest_checkpoint
from conveyor.telemetry import Telemetry, read_metrics


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def read_rows(path):
    """The rows as ``csv.DictReader`` gives them, after checking that every line has the header's cells."""
    lines = list(csv.reader(path.open(newline="")))
    header = lines[0]
    assert len(set(header)) == len(header)
    assert all(len(cells) == len(header) for cells in lines[1:]), "a row with another number of cells"
    assert header not in lines[1:], "a second header block"
    return header, list(csv.DictReader(path.open(newline="")))


def test_a_late_key_widens_the_table_and_earlier_rows_stay_aligned(tmp_path):
    telemetry = Telemetry(tmp_path, tensorboard=False, progress=False)
    telemetry.add_steps(10)
    telemetry.maybe_log(force=True)
    telemetry.add_update({"value_loss": 0.5})  # appears only after the first row
    telemetry.gauge("queue", 3)
    telemetry.add_steps(10)
    telemetry.maybe_log(force=True)
    telemetry.close()
    header, rows = read_rows(tmp_path / "metrics.csv")
    assert header[0] == "env_steps" and header[-2:] == ["loss/value_loss", "queue"]
    assert [row["env_steps"] for row in rows] == ["10", "20"]
    assert (rows[0]["loss/value_loss"], rows[1]["loss/value_loss"]) == ("", "0.5")
    assert rows[0]["updates"] == "0" and rows[1]["updates"] == "1"
    assert [row["queue"] for row in rows] == ["", "3.0"]
    assert not list(tmp_path.glob(".metrics.csv*"))  # the rewrite's temp file is gone


def test_a_resumed_run_appends_under_the_same_header(tmp_path):
    first = Telemetry(tmp_path, tensorboard=False, progress=False)
    first.add_update({"loss": 1.0})
    first.maybe_log(force=True)
    first.close()
    resumed = Telemetry(tmp_path, tensorboard=False, progress=False, start_steps=100)
    resumed.add_update({"loss": 2.0, "kl": 0.1})
    resumed.maybe_log(force=True)
    resumed.close()
    header, rows = read_rows(tmp_path / "metrics.csv")
    assert [row["env_steps"] for row in rows] == ["0", "100"]
    assert [row["loss/loss"] for row in rows] == ["1.0", "2.0"]
    assert [row["loss/kl"] for row in rows] == ["", "0.1"]


def test_a_resumed_run_keeps_the_episodes_of_its_earlier_segments_in_returns_csv(tmp_path):
    first = Telemetry(tmp_path, tensorboard=False, progress=False)
    for steps, episode_return in ((100, 1.0), (200, 2.0), (300, 3.0)):
        first.add_steps(100)
        first.add_episodes(np.array([episode_return, np.nan]))
    checkpoint = first.saved_counters() | {"env_steps": 200}  # saved at 200: episode 3 is stepped again
    first.write_summary(first.summary())
    first.close()
    resumed = Telemetry(tmp_path, tensorboard=False, progress=False)
    resumed.resume_from(checkpoint)
    resumed.add_steps(100)
    resumed.add_episodes(np.array([np.nan, 4.0]))
    resumed.write_summary(resumed.summary())
    resumed.close()
    curve = np.loadtxt(tmp_path / "returns.csv", delimiter=",", skiprows=1, ndmin=2)
    assert curve[:, 0].tolist() == [100, 200, 300] and curve[:, 2].tolist() == [1.0, 2.0, 4.0]


def test_a_file_with_several_header_blocks_is_made_one_table(tmp_path):
    # As conveyor wrote metrics.csv before its schema was fixed: a new header block where a key appeared.
    (tmp_path / "metrics.csv").write_text("env_steps,sps\n1,5.0\nenv_steps,sps,lag_mean\n2,6.0,0.5\n")
    assert read_metrics(tmp_path / "metrics.csv") == (
        ["env_steps", "sps", "lag_mean"],
        [{"env_steps": "1", "sps": "5.0", "lag_mean": ""}, {"env_steps": "2", "sps": "6.0", "lag_mean": "0.5"}])
    telemetry = Telemetry(tmp_path, tensorboard=False, progress=False, start_steps=3)
    telemetry.close()
    header, rows = read_rows(tmp_path / "metrics.csv")
    assert header == ["env_steps", "sps", "lag_mean"] and [row["lag_mean"] for row in rows] == ["", "0.5"]


def test_lag_is_recorded_from_tensors_as_from_arrays(tmp_path):
    telemetry = Telemetry(tmp_path, tensorboard=False, progress=False)
    telemetry.add_lag(5, torch.tensor([[5, 4], [3, 5]]))
    telemetry.add_lag(5, np.array([5]))
    telemetry.close()
    assert telemetry.lag_summary()["histogram"] == {"0": 3, "1": 1, "2": 1}


# One short run per architecture, with the model and env options of the continuous presets switched on
# (separate trunks where the model has no recurrent core), logging often so that keys appear mid-run.
NORMALIZED = dict(env=EnvCfg(id="CartPole-v1", num_envs=4, num_workers=2, normalize_reward=True),
                  model=ModelCfg(hidden=(16,), normalize_obs=True, separate_value_net=True))
RUNS = {
    "paac-a2c": dict(algo=AlgoCfg(name="a2c"), arch=ArchCfg(name="paac")),
    "paac-ppo": dict(algo=AlgoCfg(name="ppo", ppo_minibatches=2), arch=ArchCfg(name="paac", unroll=16)),
    "ga3c": dict(algo=AlgoCfg(name="ga3c"), arch=ArchCfg(name="ga3c", num_agents=4, min_train_batch=4, unroll=5)),
    "seed-vtrace": dict(algo=AlgoCfg(name="vtrace"), arch=ArchCfg(name="seed", local_actors=1, batch_size=4,
                                                                  unroll=10)),
    "seed-r2d2": dict(algo=AlgoCfg(name="r2d2"), model=ModelCfg(hidden=(16,), lstm_size=8, normalize_obs=True),
                      arch=ArchCfg(name="seed", local_actors=1, seq_len=10, burn_in=2, batch_size=4, min_replay=8,
                                   replay_capacity=200, replay_ratio=1.0)),
    "impact": dict(algo=AlgoCfg(name="impact"), arch=ArchCfg(name="impact", worker_batch=16, buffer_batches=2,
                                                             replay_times=2)),
    "hts-ppo": dict(algo=AlgoCfg(name="ppo", ppo_minibatches=2), arch=ArchCfg(name="hts", sync_interval=8)),
}


# make test keeps paac-a2c (3 s); the others (5-8 s each) run in make test-slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] * (name != "paac-a2c"))
                                  for name in RUNS])
def test_every_architecture_writes_one_metrics_table_and_trains_its_input_statistics(tmp_path, name):
    cfg = RunCfg(**{**NORMALIZED, **RUNS[name]}, total_steps=3000, log_interval_s=0.05, out=str(tmp_path / "run"),
                 progress=False, torch_threads=1, seed=1)
    summary = conveyor.train(cfg)
    assert summary["updates"] >= 1
    header, rows = read_rows(tmp_path / "run" / "metrics.csv")
    assert {"env_steps", "wall_time_s", "return_mean_last100", "lag_mean", "lag_max"} <= set(header)
    assert len(rows) >= 2
    for row in rows:
        assert None not in row and None not in row.values()  # no cells beyond the header, none missing
        assert math.isfinite(float(row["env_steps"])) and math.isfinite(float(row["sps"]))
        if int(row["updates"]):
            assert math.isfinite(float(row["lag_mean"])), row
    assert [int(row["env_steps"]) for row in rows] == sorted(int(row["env_steps"]) for row in rows)
    # pandas reads the same table: one header, numeric columns, the lag where updates happened.
    frame = pandas.read_csv(tmp_path / "run" / "metrics.csv")
    assert list(frame.columns) == header and len(frame) == len(rows)
    assert frame["env_steps"].dtype.kind == "i" and frame["env_steps"].is_monotonic_increasing
    for column in ("sps", "lag_mean", "lag_max", "return_mean_last100"):
        assert frame[column].dtype.kind in "if", column  # numbers, never strings from shifted cells
    trained = frame[frame["updates"] > 0]
    assert len(trained) and trained["lag_mean"].notna().all() and (trained["lag_max"] < 10_000).all()
    assert frame["env_steps"].max() <= summary["env_steps"]
    # Returns stay in env units with normalize_reward: a CartPole episode scores 1 per step, 8 at least.
    assert summary["return_mean_last100"] >= 8.0 and summary["episodes"] > 0
    # The learner folded the observations into the model's statistics; the checkpoint carries them.
    model = load_latest_checkpoint(tmp_path / "run")[1]["model"]
    assert float(model["obs_normalizer.count"]) > 0
    assert (model["obs_normalizer.var"] != 1.0).all() and (model["obs_normalizer.mean"] != 0.0).all()
