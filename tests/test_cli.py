"""CLI and config: every bad input is one line on stderr and exit code 2, never a traceback."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conveyor import load_policy
from conveyor.cli import config_from_args, build_parser, main
from conveyor.config import ArchCfg, ConfigError, EnvCfg, RunCfg
from conveyor.transfer import usable_device


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "conveyor.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--arch", "nope"], "unknown arch 'nope'"),
    (["--algo", "nope"], "unknown algo 'nope'"),
    (["--arch", "seed", "--algo", "a2c"], "does not run --algo a2c"),
    (["--num-envs", "6", "--num-workers", "4"], "not divisible by num_workers"),
    (["--num-envs", "0"], "num_envs must be positive"),
    (["--unroll", "-1"], "unroll must be positive"),
    (["--total-steps", "0"], "total_steps must be positive"),
    (["--env-arg", "novalue"], "KEY=VALUE"),
    (["--lr", "abc"], "invalid float value"),
    (["--device", "tpu"], "unknown device"),
    (["--gamma", "1.5"], "gamma must lie in [0, 1]"),
    (["--max-restarts", "-1"], "max_restarts must be >= 0"),
    (["--arch", "ga3c", "--algo", "ga3c", "--env", "Pendulum-v1"], "--algo ga3c needs a discrete action space"),
    (["--arch", "seed", "--algo", "r2d2", "--env", "Pendulum-v1"], "dueling Q head needs a discrete action space"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_unknown_env_id_exits_2_without_traceback(tmp_path):
    proc = run_cli("train", "--env", "NoSuchEnv-v9", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert "unknown env id 'NoSuchEnv-v9'" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_an_env_whose_package_is_missing_names_the_install_command_and_exits_2(tmp_path):
    """HalfCheetah where ``import mujoco`` fails (as on a machine without it): gymnasium's install hint, one line."""
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['mujoco'] = None; from conveyor.cli import "
                           f"main; sys.exit(main(['train', '--env', 'HalfCheetah-v5', '--out', {str(tmp_path)!r}]))"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "env 'HalfCheetah-v5' needs a package this Python lacks" in proc.stderr
    assert "gymnasium[mujoco]" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_out_dir_nonroot(tmp_path):
    tmp_path.chmod(0o500)
    assert main(["train", "--out", str(tmp_path / "run")]) == 2


def test_unwritable_out_dir(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["train", "--out", str(blocker / "run")]) == 2
    assert "is not writable" in capsys.readouterr().err


def test_corrupt_checkpoint_on_resume_exits_2(capsys, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text(RunCfg(out=str(run_dir)).to_json())
    (run_dir / "checkpoints" / "ckpt-000000000001.pt").write_bytes(b"garbage")
    assert main(["train", "--resume", str(run_dir)]) == 2
    assert "corrupt" in capsys.readouterr().err


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@NO_GPU
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_cuda_device_without_a_gpu_exits_2_before_the_run_starts(capsys, tmp_path, device):
    assert main(["train", "--device", device, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--device {device}" in err and "pass --device cpu" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@NO_GPU
def test_a_cuda_run_resumed_without_a_gpu_names_the_flag_that_moves_it(capsys, tmp_path):
    """A run whose preset chose cuda (Atari on a GPU machine) recorded it in config.json: continued on a machine
    without one, it stops with the fix before touching the run directory's files."""
    (tmp_path / "config.json").write_text(RunCfg(device="cuda", total_steps=100, out=str(tmp_path)).to_json())
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "pass --device cpu" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json"]


@NO_GPU
def test_acting_on_a_cuda_device_without_a_gpu_is_a_config_error(tmp_path):
    """``load_policy`` (``conveyor enjoy --device``) checks the device as training does."""
    (tmp_path / "config.json").write_text(RunCfg(out=str(tmp_path)).to_json())
    with pytest.raises(ConfigError, match="pass --device cpu"):
        load_policy(tmp_path, device="cuda")


def test_a_gpu_index_past_the_gpus_torch_sees_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert usable_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match="torch sees 2 GPU"):
        usable_device("cuda:2")
    with pytest.raises(ConfigError, match="unknown device"):
        usable_device("cuda:x")


def test_resume_of_a_dir_without_config_exits_2(capsys, tmp_path):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_flags_map_to_config_fields():
    args = build_parser().parse_args(["train", "--arch", "hts", "--algo", "ppo", "--env", "conveyor/StepTime-v0",
                                      "--env-arg", "dist=gamma", "--env-arg", "mean_ms=0.5", "--num-envs", "8",
                                      "--num-workers", "2", "--unroll", "7", "--hidden", "32,32", "--lr", "0.001",
                                      "--target-return", "none", "--no-progress", "--sync-interval", "9"])
    cfg = config_from_args(args)
    assert (cfg.arch.name, cfg.arch.unroll, cfg.arch.sync_interval) == ("hts", 7, 9)
    assert (cfg.env.id, cfg.env.num_envs, cfg.env.num_workers, cfg.env.env_args) == (
        "conveyor/StepTime-v0", 8, 2, (("dist", "gamma"), ("mean_ms", 0.5)))
    assert cfg.model.hidden == (32, 32) and cfg.algo.lr == 0.001 and cfg.algo.name == "ppo"
    assert cfg.target_return is None and cfg.progress is False


@pytest.mark.parametrize("flag", ["--env-backend", "--backend"])
def test_the_env_backend_flag_and_its_alias(flag):
    assert config_from_args(build_parser().parse_args(["train", flag, "inproc"])).env.backend == "inproc"
    assert config_from_args(build_parser().parse_args(["train"])).env.backend == "auto"
    with pytest.raises(ConfigError, match="unknown env backend 'nope': choose one of auto, shm, inproc, envpool, vector"):
        config_from_args(build_parser().parse_args(["train", flag, "nope"]))


def test_resume_uses_the_earlier_config_with_overrides(tmp_path):
    (tmp_path / "config.json").write_text(RunCfg(seed=7, total_steps=100, env=EnvCfg(num_envs=4)).to_json())
    cfg = config_from_args(build_parser().parse_args(["train", "--resume", str(tmp_path), "--total-steps", "200"]))
    assert cfg.seed == 7 and cfg.env.num_envs == 4 and cfg.total_steps == 200
    assert cfg.resume == str(tmp_path)


def test_config_json_round_trip():
    cfg = RunCfg(env=EnvCfg(env_args=(("a", 1),)), arch=ArchCfg(name="impact"), algo=RunCfg().algo.__class__(name="impact"))
    assert RunCfg.from_dict(json.loads(cfg.to_json())) == cfg


def test_config_is_frozen():
    with pytest.raises(Exception):
        RunCfg().seed = 3  # type: ignore[misc]
    with pytest.raises(ConfigError):
        ArchCfg(burn_in=80, seq_len=80)


def test_docs_configuration_reference_is_current():
    """docs/configuration.md's table is generated by conveyor.cli.config_reference(); regenerate it when a field
    changes."""
    from pathlib import Path

    from conveyor.cli import config_reference

    page = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert config_reference() in page
