"""What ``--resume DIR`` may change of a run, and config values checked alike from flags and config.json (issue 51,
rows 3, 4, 5, 10): a change that cannot work is refused in one line naming the flag and the recorded value before
anything is written; the allowed ones (``config.RESUME_MAY_CHANGE``) run, ``--lr`` included; a resumed run
rewrites config.json only once it has started; sizes and seeds are bounded; torchrun ranks started with other
flags all stop with one line naming the first differing one."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from conveyor.cli import build_parser, config_from_args, main
from conveyor.config import RESUME_MAY_CHANGE, ConfigError, EnvCfg, RunCfg, flat_fields
from conveyor.learner import load_latest_checkpoint
from conveyor.models import make_model
from conveyor.run import Run
from tests.test_distributed import TORCHRUN, TORCHRUN_ENV

TINY_RUN = ["--num-envs", "4", "--num-workers", "1", "--unroll", "5", "--torch-threads", "1", "--no-progress",
            "--target-return", "inf", "--hidden", "16", "--env-backend", "inproc"]  # resumes on shm (auto: vector)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *TINY_RUN, "--total-steps", "60", "--out", str(out)]) == 0
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


# ---- rows 4 and 5: a change that cannot work is refused before anything is written -----------------------------
@pytest.mark.parametrize("flags, recorded", [
    (["--num-envs", "32"], "--num-envs 4"),
    (["--num-envs", "2"], "--num-envs 4"),
    (["--algo", "ppo"], "--algo a2c"),
    (["--arch", "hts"], "--arch paac"),
    (["--arch", "impact", "--algo", "impact"], "--algo a2c"),  # the first in field order
    (["--hidden", "7"], "--hidden 16"),
    (["--env", "Acrobot-v1"], "--env CartPole-v1"),
    (["--seed", "3"], "--seed 0"),
    (["--gamma", "0.9"], "--gamma 0.99"),
])
def test_a_resume_that_cannot_work_is_one_line_and_writes_nothing(run_copy, capsys, flags, recorded):
    before = snapshot(run_copy)
    assert main(["train", "--resume", str(run_copy), *flags, "--total-steps", "120"]) == 2
    line = one_line(capsys.readouterr().err)
    assert recorded in line and "cannot change on resume" in line, line
    assert snapshot(run_copy) == before  # config.json above all: the run stays resumable as it was
    assert main(["train", "--resume", str(run_copy), "--total-steps", "120"]) == 0


def test_a_python_resume_is_held_to_the_same_rule(run_copy):
    recorded = RunCfg.from_dict(json.loads((run_copy / "config.json").read_text()))
    before = snapshot(run_copy)
    changed = dataclasses.replace(recorded, env=dataclasses.replace(recorded.env, num_envs=8), resume=str(run_copy),
                                  out=str(run_copy))
    with pytest.raises(ConfigError, match="--num-envs 4 .*cannot change on resume"):
        Run(changed)
    assert snapshot(run_copy) == before


def test_allowed_changes_run_and_a_new_lr_reaches_the_optimizer(run_copy):
    assert main(["train", "--resume", str(run_copy), "--total-steps", "120", "--lr", "0.0005", "--num-workers", "2",
                 "--env-backend", "shm", "--log-interval-s", "1", "--keep-checkpoints", "3"]) == 0
    path, state = load_latest_checkpoint(run_copy)
    assert path.name == "ckpt-000000000120.pt"
    assert [group["lr"] for group in state["optimizer"]["param_groups"]] == [0.0005]
    config = json.loads((run_copy / "config.json").read_text())
    assert config["algo"]["lr"] == 0.0005 and config["env"]["num_workers"] == 2 and config["total_steps"] == 120


def test_a_resume_keeps_the_recorded_env_args_it_does_not_override(tmp_path):
    recorded = RunCfg(env=EnvCfg(env_args=(("a", 1), ("b", "x"))), total_steps=100)
    (tmp_path / "config.json").write_text(recorded.to_json())
    cfg = config_from_args(build_parser().parse_args(["train", "--resume", str(tmp_path), "--env-arg", "b=y"]))
    assert cfg.env.env_args == (("a", 1), ("b", "y"))


def test_the_rule_is_one_table_of_real_fields():
    assert RESUME_MAY_CHANGE <= set(flat_fields(RunCfg()))
    assert not {"env.id", "env.num_envs", "arch.name", "algo.name", "model.hidden", "seed"} & RESUME_MAY_CHANGE


def test_a_resumed_run_rewrites_config_json_only_once_it_has_started(run_copy):
    """A resume that fails after its checkpoint is restored and before its first update or checkpoint leaves
    config.json as it was."""
    config = (run_copy / "config.json").read_bytes()
    recorded = RunCfg.from_dict(json.loads(config))
    resumed = dataclasses.replace(recorded, resume=str(run_copy), out=str(run_copy), total_steps=10_000)
    space = gym.spaces.Box(-1, 1, (4,), np.float32)
    with pytest.raises(RuntimeError, match="a failure while starting"):
        with Run(resumed) as run:
            run.learner(make_model(recorded.model, space, gym.spaces.Discrete(2)), lambda out, batch: {})
            raise RuntimeError("a failure while starting")
    assert (run_copy / "config.json").read_bytes() == config


# ---- row 10: config values checked alike from flags and config.json ---------------------------------------------
@pytest.mark.parametrize("data, message", [
    ({"model": {"hidden": [400000]}}, "hidden sizes must be at most 16384"),
    ({"model": {"hidden": [64, 400000]}}, "hidden sizes must be at most 16384"),
    ({"model": {"lstm_size": 100000}}, "lstm_size must be at most 16384"),
    ({"env": {"num_envs": 10**6}}, "num_envs must be at most 65536"),
    ({"env": {"num_workers": 5000}}, "num_workers must be at most 1024"),
    ({"arch": {"name": "ga3c", "num_agents": 5000}}, "num_agents must be at most 1024"),
    ({"seed": 2**32}, r"seed must lie in \[0, 2\*\*32\)"),
    ({"seed": -1}, "seed must be >= 0"),
    ({"env": {"env_args": [["max_episode_steps", -5]]}}, "max_episode_steps=-5 must be a positive integer"),
    ({"env": {"env_args": [["max_episode_steps", "abc"]]}}, "max_episode_steps=\"abc\" must be a positive"),
    ({"env": {"env_args": [["max_episode_steps", True]]}}, "max_episode_steps=true must be a positive"),
])
def test_sizes_seeds_and_episode_limits_are_bounded(data, message):
    with pytest.raises(ConfigError, match=message):
        RunCfg.from_dict(data)
    assert RunCfg.from_dict({"seed": 2**32 - 1, "env": {"env_args": [["max_episode_steps", 9]]}}).seed == 2**32 - 1


@pytest.mark.parametrize("flags, message", [
    (["--seed", str(2**32)], "seed must lie in [0, 2**32)"),
    (["--hidden", "400000"], "hidden sizes must be at most 16384"),
    (["--env-arg", "max_episode_steps=-5"], "must be a positive integer"),
    (["--env-arg", "max_episode_steps=abc"], "must be a positive integer"),
])
def test_bad_values_on_the_command_line_are_one_line(tmp_path, capsys, flags, message):
    assert main(["train", *flags, "--out", str(tmp_path / "run")]) == 2
    assert message in one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("section, key, value, message", [
    ("model", "hidden", [400000], "hidden sizes must be at most 16384"),
    (None, "seed", 2**32, "seed must lie in [0, 2**32)"),
    ("env", "env_args", [["max_episode_steps", -5]], "must be a positive integer"),
])
def test_bad_values_in_config_json_are_one_line(run_copy, capsys, section, key, value, message):
    config = json.loads((run_copy / "config.json").read_text())
    (config[section] if section else config)[key] = value
    (run_copy / "config.json").write_text(json.dumps(config))
    assert main(["train", "--resume", str(run_copy), "--total-steps", "120"]) == 2
    assert message in one_line(capsys.readouterr().err)


# ---- row 3: torchrun ranks started with other flags -------------------------------------------------------------
RANK_ONE_FLAGS = ("import os, sys; from conveyor.cli import main; "
                  "sys.exit(main(sys.argv[1:] + (os.environ['EXTRA'].split() if os.environ['RANK'] == '1' else [])))")


@pytest.mark.slow
def test_torchrun_ranks_started_with_other_flags_all_stop_with_one_line(tmp_path):
    """Rank 1 alone gets another --lr, --seed or --num-envs (a gloo SIGABRT before): every rank stops before any
    file is written, each with at most one line naming the flag and rank 0's value, and none hangs."""
    cases = {"lr": ("--lr 0.01", "another --lr than rank 0's 0.002"),
             "seed": ("--seed 5", "another --seed than rank 0's 0"),
             "num-envs": ("--num-envs 16", "another --num-envs than rank 0's 8")}
    procs = {}
    for name, (extra, _) in cases.items():
        out = tmp_path / name
        command = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--no-python", sys.executable, "-c",
                   RANK_ONE_FLAGS, "train", "--env", "CartPole-v1", "--num-envs", "8", "--num-workers", "1",
                   "--torch-threads", "1", "--no-progress", "--lr", "0.002", "--total-steps", "400", "--out", str(out)]
        procs[name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env={**TORCHRUN_ENV, "EXTRA": extra})
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode != 0
        lines = [line for line in stderr.splitlines() if line.startswith("conveyor:")]
        assert 1 <= len(lines) <= 2 and all(cases[name][1] in line and "rank 1 of 2" in line for line in lines), \
            stderr[-3000:]
        frames = [line for line in stderr.splitlines() if line.lstrip().startswith('File "')]
        assert not [line for line in frames if "/conveyor/" in line], stderr[-3000:]  # torchrun's own may print
        assert "SIGABRT" not in stderr and "terminate called" not in stderr, stderr[-3000:]
        assert not (tmp_path / name).exists()
