"""``conveyor tune`` (Optuna) and ``conveyor train --config FILE``: a study completes and resumes after Ctrl-C
with no trial lost or run twice, a pruned trial's run stops cleanly, two tuners share one storage, best.toml
runs as a config, and bad input gives one line and exit code 2 with the study untouched."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.cli import build_parser, config_from_args, config_from_flags, main
from conveyor.config import flag_name, flat_fields
from conveyor.presets import ARCH_ALGOS
from conveyor.flag_file import read_flag_file, write_flag_file

optuna = pytest.importorskip("optuna")

from conveyor.tune import (PARENT_PID_ENV, RETRY_OF, Tuner, budget_used, import_optuna, open_study,  # noqa: E402
                           retry)
from conveyor.tune_space import Choice, Range, space_for  # noqa: E402

import_optuna()  # as `conveyor tune` does: Optuna's warnings about its experimental parts off

pytestmark = [pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning"),
              pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")]
SMALL = ["--arch", "paac", "--env", "CartPole-v1"]


def tune_command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "conveyor", "tune", *SMALL, "--out", str(out), "--jobs", "1", *extra]


def trials_of(storage: str, name: str = "paac-a2c-CartPole-v1") -> list:
    if storage.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        storage = optuna.storages.JournalStorage(JournalFileBackend(storage.removeprefix("journal:")))
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def processes_of_this_tuner() -> list[int]:
    """Live processes started (at any depth) by a tuner in this process: they carry its pid in their env."""
    mark = f"{PARENT_PID_ENV}={os.getpid()}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    found.append(int(entry))
            except OSError:
                pass
    return found


# ---- the default search spaces ------------------------------------------------------------------------------------
FAMILY_ENVS = ("CartPole-v1", "Pendulum-v1", "MinAtar/Breakout-v1", "HalfCheetah-v5", "ALE/Pong-v5")
"""One env of each family a preset table names: classic-discrete, classic-continuous, minatar, mujoco, atari."""


def preset_value(cfg, flag: str):
    """The value ``cfg`` holds for train flag ``flag`` (``num-envs`` -> ``env.num_envs``)."""
    for key, value in flat_fields(cfg).items():
        section, _, name = key.rpartition(".")
        if flag_name(section or None, name) == "--" + flag:
            return value
    raise KeyError(flag)


@pytest.mark.parametrize("arch", sorted(ARCH_ALGOS))
def test_every_default_search_space_holds_the_presets_values(arch):
    """A study can sample the presets' own values (it may find nothing better, but it starts from them), on
    every algorithm of ``arch`` and one env of each family: a log range from rl-zoo's 1e-8 floor counts an
    entropy coefficient of 0 as inside."""
    outside = []
    for algo in ARCH_ALGOS[arch]:
        for env in FAMILY_ENVS:
            try:
                cfg = config_from_flags({"arch": arch, "algo": algo, "env": env})
            except Exception:  # the pair does not run there (R2D2 on MuJoCo's continuous actions, ...)
                continue
            for flag, param in space_for(arch, algo, cfg.env.family).items():
                value = preset_value(cfg, flag)
                if isinstance(param, Choice):
                    inside = value in param.values
                else:
                    inside = param.low <= value <= param.high or (value == 0 and param.log and param.low <= 1e-8)
                if not inside:
                    outside.append(f"{arch}/{algo} on {env}: {flag} = {value!r} outside {param}")
    assert not outside, "\n".join(outside)


def test_continuous_actions_add_the_initial_log_std_and_the_family_ranges_replace_their_names():
    pendulum = space_for("seed", "vtrace", "classic-continuous")
    assert pendulum["log-std-init"] == Range(-4.0, 1.0)
    assert pendulum["entropy-coef"] == Range(0.0, 0.01) and 8 in pendulum["unroll"].values
    assert "log-std-init" not in space_for("seed", "r2d2", "classic-continuous")  # no Gaussian policy
    assert "log-std-init" not in space_for("paac", "ppo", "classic-discrete")
    assert "num-envs" not in space_for("ga3c", "ga3c", "atari")  # GA3C's agents step one env each
    assert space_for("hts", "ppo", "atari")["lr"] == Range(1e-5, 1e-3, log=True)


# ---- --config ---------------------------------------------------------------------------------------------------
def test_config_file_sits_between_flags_and_presets(tmp_path, capsys):
    path = tmp_path / "best.toml"
    path.write_text('lr = 0.0012\nnum-envs = 32\nhidden = [32, 32]\nprogress = false\n'
                    'env-arg = {sutton_barto_reward = true}\n')
    args = build_parser().parse_args(["train", "--config", str(path), "--num-envs", "8"])
    cfg = config_from_args(args)
    assert cfg.algo.lr == 0.0012 and cfg.model.hidden == (32, 32) and cfg.progress is False
    assert cfg.env.num_envs == 8, "a flag on the command line wins over the file"
    assert cfg.env.env_args == (("sutton_barto_reward", True),)
    assert cfg.algo.gamma == 0.99, "what the file leaves out comes from the presets"

    assert main(["presets", "--config", str(path)]) == 0
    shown = capsys.readouterr().out
    assert f"algo.lr = 0.0012  config({path}) over preset(paac/a2c/classic-discrete) 0.01" in shown
    assert "algo.gamma = 0.99  preset(base)" in shown


@pytest.mark.parametrize("text, message", [
    ("foo = 1\n", "unknown key 'foo'"),
    ('lr = "fast"\n', "argument --lr: invalid float value"),
    ("lr = -1.0\n", "lr must be positive"),
    ("lr = \n", "is not TOML"),
])
def test_bad_config_file_is_one_line_and_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_flag_file_round_trips_every_kind_of_value(tmp_path):
    flags = {"arch": "seed", "algo": "vtrace", "env": "Pendulum-v1", "lr": 0.0012520653814999472, "num-envs": 16,
             "hidden": [64, 32], "normalize-reward": False, "target-return": math.inf, "entropy-coef": 1e-05,
             "env-arg": {"g": 9.81}}
    write_flag_file(tmp_path / "best.toml", flags, "a header\nof two lines")
    read = read_flag_file(tmp_path / "best.toml", set(flags))
    cfg = config_from_flags(read)
    assert (cfg.arch.name, cfg.algo.name, cfg.env.id) == ("seed", "vtrace", "Pendulum-v1")
    assert cfg.algo.lr == flags["lr"] and cfg.algo.entropy_coef == 1e-05 and cfg.env.num_envs == 16
    assert cfg.model.hidden == (64, 32) and cfg.env.normalize_reward is False and cfg.target_return == math.inf
    assert cfg.env.env_args == (("g", 9.81),)


# ---- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("space, storage, message", [
    ("[learning-rate]\nlow = 0.001\nhigh = 0.01\n", "", "unknown parameter 'learning-rate'"),
    ("[lr]\nlow = -0.01\nhigh = 0.01\n", "", "lr = -0.01 is refused"),
    ("[num-envs]\nchoices = [16, 0]\n", "", "num-envs = 0 is refused"),
    ("[lr]\nlow = 0.01\nhigh = 0.001\n", "", "low <= high"),
    ("", "sqlite:////nonexistent-dir/sub/study.db", "cannot be opened"),
    ("", "postgresql://tuner@localhost:1/study", "cannot be opened"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, space, storage, message):
    args = ["tune", *SMALL, "--trials", "2", "--steps", "1000", "--out", str(tmp_path / "study")]
    if space:
        (tmp_path / "space.toml").write_text(space)
        args += ["--space", str(tmp_path / "space.toml")]
    if storage:
        args += ["--storage", storage]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not list((tmp_path / "study").glob("trial-*")), "no trial ran"


def test_study_of_another_env_is_refused_and_kept(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    attrs = {"arch": "paac", "algo": "a2c", "env": "CartPole-v1", "objective": "return", "steps": 1000,
             "target_return": None}
    study = open_study(optuna, storage, "mine", storage, attrs, 0, tmp_path / "a")
    trial = study.ask()
    trial.suggest_float("lr", 1e-4, 1e-2, log=True)
    study.tell(trial, 100.0)
    code = main(["tune", "--arch", "paac", "--env", "Acrobot-v1", "--trials", "2", "--steps", "1000", "--study",
                 "mine", "--storage", storage, "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "was created for arch paac, algo a2c, env CartPole-v1" in err
    kept = optuna.load_study(study_name="mine", storage=storage)
    assert [t.value for t in kept.get_trials()] == [100.0] and kept.user_attrs["env"] == "CartPole-v1"


# ---- studies (real runs: each trial is a `conveyor train` process) ------------------------------------------------
@pytest.mark.slow  # 8 s of real trials; make test keeps the study's bookkeeping above
def test_one_trial_study_writes_best_toml_that_train_runs(tmp_path, capsys):
    out = tmp_path / "study"
    assert main(["tune", *SMALL, "--trials", "1", "--steps", "2000", "--jobs", "1", "--out", str(out)]) == 0
    shown = capsys.readouterr().out
    (trial,) = trials_of(f"sqlite:///{(out / 'study.db').resolve()}")
    assert trial.state.name == "COMPLETE" and f"trial 0: {trial.value:.4g}" in shown
    assert "best: trial 0" in shown and (out / "history.png").stat().st_size
    assert "no importance.png" in shown, "importances need two finished trials: said, not drawn"
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(out / "best.toml")]))
    ran = json.loads((out / "trial-0" / "config.json").read_text())
    assert cfg.algo.lr == ran["algo"]["lr"] == trial.params["lr"] and cfg.total_steps == 2000
    assert cfg.env.num_envs == trial.params["num-envs"] and cfg.algo.entropy_coef == trial.params["entropy-coef"]
    assert not processes_of_this_tuner()


def test_a_trial_whose_tuner_died_runs_again_once(tmp_path):
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=1, grace_period=1,
                                         heartbeat_stale_trial_callback=retry)
    study = optuna.create_study(storage=storage, direction="maximize")
    dead = study.ask()
    lr = dead.suggest_float("lr", 1e-4, 1e-2, log=True)
    storage.record_heartbeat(dead._trial_id)  # its tuner beat once, then was killed (SIGKILL: no goodbye)
    tuner = Tuner(optuna, study, {"lr": Range(1e-4, 1e-2, log=True)}, {}, tmp_path, 1, 0)
    deadline = time.monotonic() + 30
    while (trial := tuner.next_trial()) is None:  # the dead trial holds the only slot until its heartbeat is stale
        assert time.monotonic() < deadline, "the dead trial was never failed"
        time.sleep(0.2)
    assert tuner.params(trial) == {"lr": lr} and trial.user_attrs[RETRY_OF] == dead.number
    assert budget_used(optuna, study.get_trials()) == 1
    study.tell(trial, 1.0)
    assert tuner.next_trial() is None, "the study's one trial is done"


@pytest.mark.slow
def test_study_completes_resumes_after_sigint_and_best_toml_runs(tmp_path):
    out = tmp_path / "study"
    # 300k steps: trial 1 must still be running when it is interrupted (CartPole steps at 10k-50k SPS here)
    command = tune_command(out, "--trials", "4", "--steps", "300000")
    tuner = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "trial-1" / "metrics.csv"  # trial 1 is running: interrupt it
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert tuner.poll() is None, tuner.communicate()
        assert time.monotonic() < deadline, "trial 1 never started"
        time.sleep(0.2)
    tuner.send_signal(signal.SIGINT)
    stdout, stderr = tuner.communicate(timeout=120)
    assert tuner.returncode == 130, stderr
    assert "the same command resumes the study" in stderr and "Traceback" not in stderr
    assert not processes_of_this_tuner()
    storage = f"sqlite:///{(out / 'study.db').resolve()}"
    stopped = {t.number: t for t in trials_of(storage)}
    assert stopped[0].state.name == "COMPLETE" and stopped[1].state.name == "FAIL"
    assert json.loads((out / "trial-1" / "summary.json").read_text())["stop_reason"] == "signal SIGTERM"

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    trials = trials_of(storage)
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == 4 and budget_used(optuna, trials) == 4
    assert [t.number for t in trials if t.state.name == "FAIL"] == [1], "only the interrupted trial failed"
    again = [t for t in trials if t.user_attrs.get(RETRY_OF) == 1]
    assert len(again) == 1 and again[0].params == stopped[1].params, "the interrupted trial ran again, once"
    assert complete[0].params == stopped[0].params, "trial 0 did not run twice"
    for trial in complete:
        summary = json.loads((Path(trial.user_attrs["run_dir"]) / "summary.json").read_text())
        assert summary["stop_reason"] == "total_steps reached" and summary["seed"] == trial.number
        assert summary["return_mean_last100"] == pytest.approx(trial.value)
    assert (out / "history.png").stat().st_size and (out / "importance.png").stat().st_size

    best = max(complete, key=lambda t: t.value)
    args = build_parser().parse_args(["train", "--config", str(out / "best.toml")])
    cfg = config_from_args(args)
    ran = json.loads((Path(best.user_attrs["run_dir"]) / "config.json").read_text())
    assert cfg.algo.lr == ran["algo"]["lr"] == best.params["lr"]
    assert cfg.env.num_envs == ran["env"]["num_envs"] and cfg.arch.unroll == ran["arch"]["unroll"]
    assert cfg.total_steps == 300000 and cfg.target_return is None, "best.toml stops at the env's threshold"


@pytest.mark.slow
def test_pruned_trial_stops_its_run_and_leaves_no_process(tmp_path):
    shared_memory_before = set(os.listdir("/dev/shm"))
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.ThresholdPruner(lower=1e9))
    fixed = {"arch": "paac", "algo": "a2c", "env": "CartPole-v1", "total-steps": 300_000,
             "target-return": math.inf, "env-backend": "shm"}
    interrupted = Tuner(optuna, study, {"lr": Range(1e-3, 2e-3)}, fixed, tmp_path, 1, 0).run(1)
    assert not interrupted
    (trial,) = study.get_trials()
    assert trial.state.name == "PRUNED" and trial.intermediate_values
    summary = json.loads((tmp_path / "trial-0" / "summary.json").read_text())
    assert summary["stop_reason"] == "signal SIGTERM" and summary["env_steps"] < 300_000
    assert not processes_of_this_tuner(), "a process of the pruned run outlived it"
    assert set(os.listdir("/dev/shm")) <= shared_memory_before


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_tuners_share_one_storage(tmp_path, kind):
    """Tuner a is held (SIGSTOP) from the moment it runs its first trial until b runs one: both share the study
    whatever the load, where a tuner slow to start could otherwise find every trial taken."""
    storage = f"sqlite:///{tmp_path / 'shared.db'}" if kind == "sqlite" else f"journal:{tmp_path / 'shared.log'}"

    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen(tune_command(tmp_path / name, "--trials", "4", "--steps", "3000", "--storage", storage),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for_a_trial_of(name: str, tuner: subprocess.Popen) -> None:
        deadline = time.monotonic() + 300
        while not any((tmp_path / name).glob("trial-*")):
            assert tuner.poll() is None and time.monotonic() < deadline, f"tuner {name} ran no trial"
            time.sleep(0.05)

    first = start("a")
    wait_for_a_trial_of("a", first)
    first.send_signal(signal.SIGSTOP)  # for seconds: well within the SQL storage's 60 s heartbeat grace
    try:
        second = start("b")
        wait_for_a_trial_of("b", second)
    finally:
        first.send_signal(signal.SIGCONT)
    for tuner in (first, second):
        stdout, stderr = tuner.communicate(timeout=600)
        assert tuner.returncode == 0, stderr
    trials = trials_of(storage)
    assert all(t.state.name == "COMPLETE" for t in trials)
    assert 4 <= len(trials) <= 5, "a trial past --trials only where both asked at the same moment"
    run_dirs = [Path(t.user_attrs["run_dir"]) for t in trials]
    assert {d.parent.name for d in run_dirs} == {"a", "b"}, "both tuners ran trials"
    assert sorted(run_dirs) == sorted(tmp_path.glob("*/trial-*")), "each trial ran once, in its own directory"
    assert all((d / "summary.json").is_file() for d in run_dirs)
