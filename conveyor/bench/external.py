"""Race peers that cannot share conveyor's environment: Sample Factory APPO, CleanRL PPO.

Each gets a virtual environment of its own under ``.peers/`` (``CONVEYOR_PEERS_DIR`` moves ``.peers``), built
by ``make peers`` (``python -m conveyor.bench.external build``): the same Python, torch 2.13.0 from the local
CPU wheel that pip's ``find-links`` holds (the build stops if pip picked any other torch), then the peer's
pinned requirements:

* Sample Factory 2.1.1 needs gymnasium < 1.0 and numpy < 2 (conveyor pins gymnasium 1.4 and numpy 2.4):
  ``.peers/sample-factory`` (``SAMPLE_FACTORY``). ale-py 0.8.1 ships no ROMs: a race run points its
  ``ALE_PY_ROM_DIR`` at the ROMs of conveyor's own ale-py.
* CleanRL 1.2.0, its last PyPI release, carries the single-file scripts (``cleanrl/ppo.py``, ...) but declares
  Python < 3.11 only because of its Poetry lock; it goes in with ``--no-deps --ignore-requires-python`` beside
  what its PPO scripts import: gym 0.23.1 for ``ppo.py``, gymnasium 0.28.1 for ``ppo_continuous_action.py``,
  tensorboard, and for ``ppo_atari.py`` stable-baselines3 1.2.0 (the version CleanRL 1.2.0's lock pins: its
  Atari wrappers speak gym 0.23), opencv and ale-py 0.8.1, the oldest ALE with wheels for this Python (ROMs as
  for Sample Factory; its runner hands the env to the script in gym 0.23's step API) (``CLEANRL``).

Each peer is one ``ExternalPeer`` of ``PEERS``: its venv's requirements, its runner, and which of its published
settings (its recipes) each env gets.

``run_external`` runs the peer's runner (``conveyor/bench/runners/``: ``sf_runner.py``, ``cleanrl_runner.py``)
in its venv and turns what it wrote into a conveyor run's ``summary.json`` (``returns.csv`` it writes itself) and
the race's clock. Envs without a recipe are skipped rows saying why.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path
from typing import Any

from conveyor.bench.suites import PeerUnavailable, RaceGoal

PEERS_DIR_ENV = "CONVEYOR_PEERS_DIR"
TORCH_PIN = "torch==2.13.0"
TERMINATE_GRACE_S = 60.0
RUNNERS = Path(__file__).with_name("runners")
"""The runners' folder: standalone scripts that the peers' own Pythons run by path."""


def peers_dir() -> Path:
    """Where the peers' virtual environments live: ``$CONVEYOR_PEERS_DIR``, else ``.peers`` at the repository."""
    if os.environ.get(PEERS_DIR_ENV):
        return Path(os.environ[PEERS_DIR_ENV])
    return Path(__file__).resolve().parents[2] / ".peers"


@dataclasses.dataclass(frozen=True)
class ExternalPeer:
    """A race peer with a venv of its own and a runner in ``RUNNERS``."""

    framework: str
    """Its name in run names, tables and ``.peers/`` (``sample-factory``)."""
    label: str
    """Its name in messages (``Sample Factory``)."""
    algo: str
    """The algorithm it races with."""
    requirements: tuple[str, ...]
    """What pip installs into its venv beside torch."""
    no_deps: tuple[str, ...]
    """What pip installs after those, without dependencies."""
    imports: str
    """Comma-separated modules that must import once the venv is built."""
    runner: str
    """The runner script's file name in ``RUNNERS``."""
    recipe_flag: str
    """The runner's argument that names the recipe."""
    result_name: str
    """The file the runner writes its result to."""
    recipes: dict[str, str]
    """Env id -> the recipe the peer publishes for it (or the nearest one)."""
    recipe_text: dict[str, str]
    """Recipe -> how the race's settings column describes it."""
    minatar_reason: str
    """Why it has no MinAtar recipe, after "<peer> publishes no recipe for <env id>"."""

    def python(self) -> Path:
        return peers_dir() / self.framework / "bin" / "python"


SF_VERSION = "2.1.1"
SAMPLE_FACTORY = ExternalPeer(
    framework="sample-factory", label="Sample Factory", algo="appo",
    # shimmy registers ale-py 0.8's ``ALE/`` ids with gymnasium 0.29
    requirements=(f"sample-factory=={SF_VERSION}", "gymnasium==0.29.1", "numpy==1.26.4", "ale-py==0.8.1",
                  "shimmy[atari]==0.2.1"),
    no_deps=(), imports="sample_factory, gymnasium", runner="sf_runner.py", recipe_flag="--recipe",
    result_name="sf_result.json",
    recipes={
        "CartPole-v1": "gym",  # sf_examples/train_gym_env.py: its docstring's CartPole-v1 command line
        "Acrobot-v1": "gym",  # the same example's settings (Sample Factory publishes none for Acrobot)
        "Pendulum-v1": "mujoco",  # sf_examples.mujoco: its continuous-control recipe (none for Pendulum itself)
        "ALE/Pong-v5": "atari",  # sf_examples.atari: its Atari recipe (atari_pong)
    },
    recipe_text={
        "gym": f"Sample Factory {SF_VERSION} APPO, sf_examples/train_gym_env.py's CartPole-v1 command line",
        "mujoco": f"Sample Factory {SF_VERSION} APPO, sf_examples.mujoco's recipe (mujoco_override_defaults)",
        "atari": (f"Sample Factory {SF_VERSION} APPO, sf_examples.atari's recipe (atari_override_defaults, its "
                  "wrappers; v5 sticky actions, frameskip 4 in its wrapper)"),
    },
    minatar_reason=" (its conv encoders are built for 84x84 frames, MinAtar's are 10x10)")
CLEANRL_VERSION = "1.2.0"
CLEANRL = ExternalPeer(
    framework="cleanrl", label="CleanRL", algo="ppo",
    # gym 0.23's classic-control envs import pygame, whose pinned 2.1.0 has no wheel for Python 3.11; SB3 1.2.0
    # needs pandas and matplotlib, pinned here to the last releases for numpy 1.26
    requirements=("gym==0.23.1", "gymnasium==0.28.1", "numpy==1.26.4", "pygame==2.6.1", "tensorboard==2.21.0",
                  "stable-baselines3==1.2.0", "ale-py==0.8.1", "opencv-python-headless==4.10.0.84",
                  "pandas==2.2.3", "matplotlib==3.9.4"),
    no_deps=(f"cleanrl=={CLEANRL_VERSION}",),
    imports="gym, gymnasium, tensorboard, cv2, ale_py, stable_baselines3.common.atari_wrappers, cleanrl.ppo",
    runner="cleanrl_runner.py", recipe_flag="--script", result_name="cleanrl_result.json",
    recipes={
        "CartPole-v1": "ppo",  # ppo.py's defaults are its CartPole-v1 settings (500k steps)
        "Acrobot-v1": "ppo",  # CleanRL's benchmark runs ppo.py on Acrobot-v1 with the same defaults
        "Pendulum-v1": "ppo_continuous_action",  # its defaults are its MuJoCo settings (none for Pendulum itself)
        "ALE/Pong-v5": "ppo_atari",  # its defaults are its Atari settings (its benchmark runs them on Pong)
    },
    recipe_text={
        "ppo": (f"CleanRL {CLEANRL_VERSION} cleanrl/ppo.py as published, its defaults (4 envs x 128 steps, 500k "
                "steps)"),
        "ppo_continuous_action": (f"CleanRL {CLEANRL_VERSION} cleanrl/ppo_continuous_action.py as published, its "
                                  "defaults (its MuJoCo settings: 1 env x 2048 steps, 1M steps)"),
        "ppo_atari": (f"CleanRL {CLEANRL_VERSION} cleanrl/ppo_atari.py as published, its defaults (8 envs x 128 "
                      "steps, 10M steps) and SB3 1.2.0's Atari wrappers; v5 sticky actions, frameskip 4 in its "
                      "wrapper"),
    },
    minatar_reason=(": ppo.py makes gym 0.23 envs and feeds its MLP flat observations, MinAtar's ids are "
                    "gymnasium's and its states 10x10xC"))
PEERS = {peer.framework: peer for peer in (SAMPLE_FACTORY, CLEANRL)}
"""The race's peers outside conveyor's environment, by framework name."""


def skip_reason(framework: str, env_id: str) -> str:
    """Why ``framework`` cannot race on ``env_id`` here ("" when it can)."""
    peer = PEERS[framework]
    if env_id not in peer.recipes:
        return (f"{peer.label} publishes no recipe for {env_id}{peer.minatar_reason}"
                if env_id.startswith("MinAtar/") else f"no {peer.label} recipe for {env_id} in this suite")
    python = peer.python()
    if not python.is_file():
        return f"{framework}'s venv {python.parent.parent} is not built (make peers)"
    return ""


def conveyor_rom_dir() -> Path | None:
    """conveyor's ale-py ROM folder (Pong is there), for ale-py 0.8.1, which ships none."""
    spec = importlib.util.find_spec("ale_py")
    if spec is None or not spec.submodule_search_locations:
        return None
    roms = Path(list(spec.submodule_search_locations)[0]) / "roms"
    return roms if roms.is_dir() else None


# ---- the venv ---------------------------------------------------------------------------------------------
def _run(command: list[str], log: Any) -> str:
    log("$ " + " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done.stdout


def build_venv(name: str, requirements: tuple[str, ...], imports: str, no_deps: tuple[str, ...] = (),
               log: Any = print) -> Path:
    """Create ``.peers/<name>`` with torch 2.13.0 (the local CPU wheel), then ``requirements`` and ``no_deps``
    (these without their dependencies); returns its python. Torch goes in first, alone, and must come out as
    this venv's own torch build; ``imports`` (comma-separated modules) must import at the end."""
    import torch

    target = peers_dir() / name
    python = target / "bin" / "python"
    if not python.is_file():
        log(f"creating {target}")
        venv.EnvBuilder(with_pip=True, clear=False).create(target)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, "--only-binary", ":all:", TORCH_PIN], log)
    built = _run([str(python), "-c", "import torch; print(torch.__version__)"], log).strip()
    if built != torch.__version__:
        raise RuntimeError(f"{target} got torch {built}, not conveyor's {torch.__version__}: remove it and check "
                           "pip's find-links")
    _run([*pip, TORCH_PIN, *requirements], log)
    if no_deps:
        _run([*pip, "--no-deps", "--ignore-requires-python", *no_deps], log)
    _run([str(python), "-c", f"import {imports}"], log)
    log(f"{target}: torch {built}, {', '.join((*requirements, *no_deps))}")
    return python


def build_peers(log: Any = print) -> list[Path]:
    """Every external peer's venv (``make peers``)."""
    return [build_venv(peer.framework, peer.requirements, peer.imports, peer.no_deps, log=log)
            for peer in PEERS.values()]


# ---- a race run -----------------------------------------------------------------------------------------
def runner_command(framework: str, env_id: str) -> tuple[list[str], str, str]:
    """The peer's runner in its venv (less the race's arguments), its result file's name and its recipe text."""
    peer = PEERS[framework]
    recipe = peer.recipes[env_id]
    return ([str(peer.python()), "-I", str(RUNNERS / peer.runner), peer.recipe_flag, recipe], peer.result_name,
            peer.recipe_text[recipe])


def run_external(framework: str, algo: str, cfg: Any, run_dir: Path, goal: RaceGoal, spawned_unix: float) -> None:
    """A peer's race run in its child: the peer's runner in its venv; writes summary.json and the clock."""
    from conveyor.bench.suites import RACE_WINDOW as WINDOW
    from conveyor.bench.suites import write_race_clock as write_clock

    reason = skip_reason(framework, cfg.env.id)
    if reason:
        raise PeerUnavailable(reason)
    runner_args, result_name, recipe_text = runner_command(framework, cfg.env.id)
    out = run_dir / framework
    env = dict(os.environ)
    roms = conveyor_rom_dir()
    if roms is not None:
        env["ALE_PY_ROM_DIR"] = str(roms)
    left = goal.time_limit_s - (time.time() - spawned_unix)
    command = [*runner_args, "--env", cfg.env.id, "--seed", str(cfg.seed), "--threshold", str(goal.threshold),
               "--window", str(WINDOW), "--max-steps", str(goal.max_steps), "--time-limit-s", f"{left:.3f}",
               "--out", str(out)]
    print("$ " + " ".join(command), flush=True)
    runner = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
    try:
        returncode = runner.wait(timeout=max(1.0, left) + TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        runner.terminate()
        returncode = runner.wait(timeout=TERMINATE_GRACE_S)
    except BaseException:
        runner.terminate()
        raise
    result_file = out / result_name
    if not result_file.is_file():
        write_clock(run_dir, spawned_unix, None)
        raise RuntimeError(f"{framework}'s runner exited with {returncode} and wrote no result (see bench.log)")
    result = json.loads(result_file.read_text())
    write_clock(run_dir, spawned_unix, float(result["run_start_unix"]))
    (run_dir / "returns.csv").write_text((out / "returns.csv").read_text())
    wall = float(result["wall_time_s"])
    summary = {"env_steps": result["env_steps"], "wall_time_s": wall,
               "sps": result["env_steps"] / max(wall, 1e-9), "episodes": result["episodes"],
               "return_mean_last100": result["return_mean_last100"], "stop_reason": result["stop_reason"],
               "arch": framework, "algo": algo, "env": cfg.env.id, "seed": cfg.seed, "out": str(run_dir),
               "framework": framework, "framework_version": result["framework_version"],
               "recipe": recipe_text, "device": result["device"]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if returncode:
        raise RuntimeError(f"{framework}'s runner exited with {returncode} (see bench.log)")


def main(argv: list[str]) -> int:
    if argv != ["build"]:
        print("usage: python -m conveyor.bench.external build  (the peers' venvs under .peers/; make peers)",
              file=sys.stderr)
        return 2
    try:
        pythons = build_peers()
    except RuntimeError as error:
        print(f"conveyor: {error}", file=sys.stderr)
        return 1
    print("the peers' venvs are ready: " + ", ".join(str(python) for python in pythons))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
