"""Your own env (``--env MODULE:ID``) and network (``--model MODULE:CLASS``): they train under paac and impact,
the example env is learned, config.json keeps their names for --resume, and every broken env, failed import or
misfitting encoder is refused at start with one line and exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from conveyor.cli import main
from conveyor.config import ConfigError, EnvCfg, ModelCfg
from conveyor.envs import make_env
from examples.custom_env import Corridor
from examples.custom_model import MyEncoder

REPO = Path(__file__).resolve().parent.parent
CORRIDOR = "examples.custom_env:Corridor-v0"
ENCODER = "examples.custom_model:MyEncoder"
QUIET = ["--no-progress", "--log-interval-s", "60"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# -- your own env ---------------------------------------------------------------------------------------------


def test_example_env_is_learned_with_defaults(tmp_path, capsys):
    """The README's command, with a step budget: the presets of a discrete env (paac/a2c) walk the corridor in
    about 9 steps (a random walk needs about 81); the run stops at the registered reward_threshold, -10."""
    out = tmp_path / "run"
    assert main(["train", "--env", CORRIDOR, "--total-steps", "30000", "--out", str(out), *QUIET]) == 0
    summary = summary_of(out)
    assert summary["stop_reason"] == "target_return reached", summary["return_mean_last100"]
    assert summary["return_mean_last100"] >= -10 and summary["env_steps"] <= 30_000
    config = json.loads((out / "config.json").read_text())
    assert config["env"]["id"] == CORRIDOR  # as typed: a resumed run or a remote actor imports the module again


@pytest.mark.slow  # an IMPACT run (4 s); make test trains the example env under the default architecture
def test_env_and_model_of_your_own_under_impact(tmp_path, capsys):
    """IMPACT workers are processes of their own: each imports the env's module and builds the encoder."""
    out = tmp_path / "run"
    args = ["train", "--arch", "impact", "--env", CORRIDOR, "--model", ENCODER, "--hidden", "32",
            "--num-workers", "1", "--total-steps", "1000", "--out", str(out), *QUIET]
    assert main(args) == 0
    summary = summary_of(out)
    assert summary["env_steps"] >= 1000 and summary["restarts"] == 0
    config = json.loads((out / "config.json").read_text())
    assert config["env"]["id"] == CORRIDOR and config["model"]["name"] == ENCODER


def test_presets_of_an_env_of_your_own_from_the_conveyor_script():
    """The console script does not put the current directory on sys.path; conveyor adds it for MODULE:ID."""
    script = Path(sys.executable).parent / "conveyor"
    if not script.exists():
        script = shutil.which("conveyor")
    if script is None:
        pytest.skip("no conveyor script installed")
    proc = subprocess.run([str(script), "presets", "--env", CORRIDOR], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"# paac/a2c on {CORRIDOR} (family classic-discrete)"
    # no native vector env: the a2c classic-discrete 16 envs at 2e-3 (CartPole's 128 at 1e-2 need one)
    assert "env.num_envs = 16  preset(paac/a2c/classic-discrete)" in lines
    assert "algo.lr = 0.002  preset(paac/a2c/classic-discrete)" in lines


class BadDtype(Corridor):
    def _observe(self):
        return super()._observe().astype(np.float64)


class BadShape(Corridor):
    def _observe(self):
        return super()._observe()[:-1]


class ResetWithoutInfo(Corridor):
    def reset(self, *, seed=None, options=None):
        return super().reset(seed=seed, options=options)[0]


class FourValueStep(Corridor):
    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated or truncated, info


class ListObs(Corridor):
    def _observe(self):
        return super()._observe().tolist()


class DictObs(Corridor):
    def __init__(self):
        super().__init__()
        self.observation_space = gym.spaces.Dict({"cell": gym.spaces.Box(0.0, 1.0, (10,), np.float32)})

    def _observe(self):
        return {"cell": super()._observe()}


class TupleObs(Corridor):
    def __init__(self):
        super().__init__()
        self.observation_space = gym.spaces.Tuple((gym.spaces.Box(0.0, 1.0, (10,), np.float32),))

    def _observe(self):
        return (super()._observe(),)


class MultiDiscreteActions(Corridor):
    def __init__(self):
        super().__init__()
        self.action_space = gym.spaces.MultiDiscrete([2, 2])

    def step(self, action):
        return super().step(action[0])


BROKEN_ENVS = {
    BadDtype: "observations must be numpy arrays of the observation space's dtype and shape (float32, (10,)), but "
              "reset() returned an array of dtype float64 and shape (10,)",
    BadShape: "observations must be numpy arrays of the observation space's dtype and shape (float32, (10,)), but "
              "reset() returned an array of dtype float32 and shape (9,)",
    ListObs: "observations must be numpy arrays of the observation space's dtype and shape (float32, (10,)), but "
             "reset() returned a list",
    ResetWithoutInfo: "reset() must return (obs, info), but it returned an array of dtype float32 and shape (10,)",
    FourValueStep: "step() must return (obs, reward, terminated, truncated, info), but it returned 4 values",
    DictObs: "the observation space must be a Box, but it is Dict(",
    TupleObs: "the observation space must be a Box, but it is Tuple(",
    MultiDiscreteActions: "the action space must be Discrete or a 1-D Box, but it is MultiDiscrete(",
}
for _env_class in BROKEN_ENVS:
    gym.register(f"ConveyorTest/{_env_class.__name__}-v0", entry_point=_env_class, max_episode_steps=100)


@pytest.mark.parametrize("env_class", list(BROKEN_ENVS), ids=lambda cls: cls.__name__)
def test_an_env_that_breaks_the_api_is_refused_in_one_line(tmp_path, capsys, env_class):
    env_id = f"ConveyorTest/{env_class.__name__}-v0"
    assert main(["train", "--env", env_id, "--out", str(tmp_path / "run"), *QUIET]) == 2
    err = one_line_error(capsys)
    assert f"env {env_id!r} breaks conveyor's env API: " in err and BROKEN_ENVS[env_class] in err


def test_the_check_runs_before_any_worker_starts(tmp_path, capsys):
    """Under an architecture whose workers are processes of their own, the refusal is the run's, not a worker's."""
    env_id = "ConveyorTest/FourValueStep-v0"
    assert main(["train", "--arch", "impact", "--env", env_id, "--out", str(tmp_path / "run"), *QUIET]) == 2
    assert "returned 4 values" in one_line_error(capsys)


@pytest.mark.parametrize("env_id, message", [
    ("CartPol-v1", "unknown env id 'CartPol-v1' (Environment `CartPol` doesn't exist. Did you mean: `CartPole`?)"),
    ("no_such_module_here:Corridor-v0", "no module named 'no_such_module_here' (for --env "
                                        "'no_such_module_here:Corridor-v0'): check the spelling, and run from the "
                                        "directory that holds it or add that directory to PYTHONPATH"),
    ("examples.custom_env:Coridor-v0", "unknown env id 'examples.custom_env:Coridor-v0': importing "
                                       "'examples.custom_env' registered no env 'Coridor-v0'"),
])
def test_unknown_ids_and_modules_are_one_line(capsys, env_id, message):
    assert main(["presets", "--env", env_id]) == 2
    assert message in one_line_error(capsys)


def test_a_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_envs_module.py").write_text("import gymnasium\n\nSPEED = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "--env", "broken_envs_module:Fast-v0", "--out", str(tmp_path / "run")]) == 2
    err = one_line_error(capsys)
    assert ("importing 'broken_envs_module' (for --env 'broken_envs_module:Fast-v0') raised ZeroDivisionError: "
            f"division by zero at {tmp_path / 'broken_envs_module.py'}:3: fix the module") in err


def test_ids_of_an_installed_gymnasium_envs_entry_point(tmp_path, monkeypatch):
    """A package that offers its envs as a ``gymnasium.envs`` entry point named after their namespace (the gym 0.26
    plugin scheme, which gymnasium 1.x does not run) is loaded when one of its ids is first made."""
    dist = tmp_path / "corridor_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: corridor-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[gymnasium.envs]\nPluginCorridors = corridor_plugin_envs:register\n")
    (tmp_path / "corridor_plugin_envs.py").write_text(
        "import gymnasium\n\ndef register():\n"
        "    gymnasium.register('PluginCorridors/Corridor-v0', entry_point='examples.custom_env:Corridor',\n"
        "                       max_episode_steps=50)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env(EnvCfg(id="PluginCorridors/Corridor-v0", env_args=(("length", 4),)), seed=0)
    try:
        assert env.observation_space.shape == (4,) and env.spec.max_episode_steps == 50
    finally:
        env.close()


# -- your own network -----------------------------------------------------------------------------------------


def test_model_of_your_own_trains_is_recorded_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--env", CORRIDOR, "--model", ENCODER, "--total-steps", "800", "--target-return", "inf",
                 "--out", str(out), *QUIET]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["name"] == ENCODER and config["model"]["hidden"] == [64, 64]
    (checkpoint,) = (out / "checkpoints").glob("*.pt")
    weights = torch.load(checkpoint, weights_only=True)["model"]
    assert weights["encoder.net.2.weight"].shape == (64,)  # MyEncoder's LayerNorm, under conveyor's heads
    assert weights["policy_head.weight"].shape == (2, 64)
    first = summary_of(out)
    assert main(["train", "--resume", str(out), "--total-steps", "1600", *QUIET]) == 0
    resumed = summary_of(out)
    assert resumed["env_steps"] >= 1600 and resumed["learner_version"] > first["learner_version"]
    assert json.loads((out / "config.json").read_text())["model"]["name"] == ENCODER


def test_a_class_given_in_python_is_kept_as_its_import_path():
    assert ModelCfg(name=MyEncoder).name == ENCODER
    with pytest.raises(ConfigError, match="has no import path"):
        ModelCfg(name=lambda space: MyEncoder(space))
    with pytest.raises(ConfigError, match=r"unknown model 'nope': choose one of auto, mlp, .* \(or MODULE:CLASS"):
        ModelCfg(name="nope")
    with pytest.raises(ConfigError, match="'examples/custom_model.py:MyEncoder' is not MODULE:NAME"):
        ModelCfg(name="examples/custom_model.py:MyEncoder")


def test_the_encoder_is_built_with_the_keyword_arguments_it_takes():
    from conveyor.models import make_model

    space, actions = gym.spaces.Box(0.0, 1.0, (6,), np.float32), gym.spaces.Discrete(3)
    model = make_model(ModelCfg(name=ENCODER, hidden=(16, 8), lstm_size=5, normalize_obs=False,
                                separate_value_net=False), space, actions)
    assert model.encoder.out_features == 8 and model.core.input_size == 8 + 3 + 1
    out = model(torch.zeros(2, 4, 6))
    assert out.params.shape == (2, 4, 3) and out.value.shape == (2, 4)
    plain = make_model(ModelCfg(name=f"{__name__}:NoKeywords", hidden=(16,), lstm_size=0, normalize_obs=False,
                                separate_value_net=True), space, actions)
    assert plain.encoder.out_features == 7 and plain.value_encoder is not plain.encoder


class NoKeywords(nn.Module):
    """Takes no ``hidden``: conveyor passes it none."""

    def __init__(self, obs_space):
        super().__init__()
        self.linear = nn.Linear(obs_space.shape[0], 7)
        self.out_features = 7

    def forward(self, obs):
        return self.linear(obs)


class WrongOutput(NoKeywords):
    def forward(self, obs):
        return self.linear(obs).unsqueeze(1)


class NoOutFeatures(NoKeywords):
    def __init__(self, obs_space):
        super().__init__(obs_space)
        del self.out_features


class WrongConstructor(nn.Module):
    def __init__(self, obs_space, width):
        super().__init__()


class NotAModule:
    def __init__(self, obs_space):
        self.out_features = 3


@pytest.mark.parametrize("ref, message", [
    (f"{__name__}:WrongOutput", "returned [2, 1, 7] for observations [2, 10]: its forward must return features "
                                "[N, out_features] = [2, 7]"),
    (f"{__name__}:NoOutFeatures", "has out_features None: set self.out_features"),
    (f"{__name__}:WrongConstructor", "(obs_space) raised TypeError: WrongConstructor.__init__() missing 1 required "
                                     "positional argument: 'width'"),
    (f"{__name__}:NotAModule", "(obs_space) returned a NotAModule: it must be a torch.nn.Module"),
    ("examples.custom_model:NoEncoder", "module 'examples.custom_model' has no 'NoEncoder'"),
    ("no_such_nets_module:Encoder", "no module named 'no_such_nets_module'"),
])
def test_an_encoder_that_does_not_fit_is_refused_in_one_line(tmp_path, capsys, ref, message):
    """Before the run starts anything (no output dir)."""
    out = tmp_path / "run"
    assert main(["train", "--arch", "impact", "--env", CORRIDOR, "--model", ref, "--out", str(out), *QUIET]) == 2
    err = one_line_error(capsys)
    assert repr(ref) in err or f"encoder {ref}" in err
    assert message in err
    assert not out.exists()


def test_an_env_that_hangs_in_the_check_is_left_to_the_workers_timeout(monkeypatch, capsys):
    """The check runs where no worker timeout guards it: it gives up after its own limit, with one warning line."""
    from conveyor.envs import check
    from tests.fault_env import HANGING_ID

    monkeypatch.setattr(check, "PROBE_TIMEOUT_S", 0.5)
    cfg = EnvCfg(id=HANGING_ID, env_args=(("hang_at", 1), ("hang_s", 3.0)))
    check.check_env_api(cfg, seed=0)
    err = one_line_error(capsys)
    assert err == (f"conveyor: warning: env {HANGING_ID!r} took longer than 0.5 s to be made, reset and stepped 3 "
                   "times; starting without checking its API")
