"""Race peers that cannot share conveyor's environment: Sample Factory APPO, CleanRL PPO.

Sample Factory 2.1.1 needs gymnasium < 1.0 and numpy < 2 (conveyor pins
gymnasium 1.4 and numpy 2.4), so it gets a virtual environment of its own,
``.peers/sample-factory`` (``CONVEYOR_PEERS_DIR`` moves ``.peers``), built by
``make peers`` (``python -m conveyor.bench.external build``): the same Python,
torch 2.13.0 from the local CPU wheel that pip's ``find-links`` holds (the
build stops if pip picked any other torch), and ``SF_REQUIREMENTS``. ale-py
0.8.1 ships no ROMs: a race run points its ``ALE_PY_ROM_DIR`` at the ROMs of
conveyor's own ale-py. ``run_external`` runs ``sf_runner.py`` there and turns
what it wrote into a conveyor run's ``summary.json`` (``returns.csv`` it
writes itself) and the race's clock. Which of Sample Factory's published
settings each env gets: ``SF_RECIPES``; other envs are skipped rows.

CleanRL is recorded as skipped (``CLEANRL_SKIP``): its only PyPI release is
too old to install here, and its current single-file scripts are not
packaged.
"""

from __future__ import annotations

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

PEERS = (("sample-factory", "appo"), ("cleanrl", "ppo"))
"""(framework, algorithm) of the race's peers outside conveyor's environment."""
PEERS_DIR_ENV = "CONVEYOR_PEERS_DIR"
SF_VENV_NAME = "sample-factory"
SF_VERSION = "2.1.1"
SF_REQUIREMENTS = (f"sample-factory=={SF_VERSION}", "gymnasium==0.29.1", "numpy==1.26.4", "ale-py==0.8.1",
                   "shimmy[atari]==0.2.1")
"""Sample Factory's venv beside torch (shimmy registers ale-py 0.8's ``ALE/`` ids with gymnasium 0.29)."""
TORCH_PIN = "torch==2.13.0"
SF_RECIPES = {
    "CartPole-v1": "gym",  # sf_examples/train_gym_env.py: its docstring's CartPole-v1 command line
    "Acrobot-v1": "gym",  # the same example's settings (Sample Factory publishes none for Acrobot)
    "Pendulum-v1": "mujoco",  # sf_examples.mujoco: its continuous-control recipe (none for Pendulum itself)
    "ALE/Pong-v5": "atari",  # sf_examples.atari: its Atari recipe (atari_pong)
}
SF_RECIPE_TEXT = {
    "gym": "Sample Factory 2.1.1 APPO, sf_examples/train_gym_env.py's CartPole-v1 command line",
    "mujoco": "Sample Factory 2.1.1 APPO, sf_examples.mujoco's recipe (mujoco_override_defaults)",
    "atari": ("Sample Factory 2.1.1 APPO, sf_examples.atari's recipe (atari_override_defaults, its wrappers; "
              "v5 sticky actions, frameskip 4 in its wrapper)"),
}
CLEANRL_SKIP = ("CleanRL: its only PyPI release, cleanrl 0.4.8 (2020), imports gym.wrappers.Monitor, which gym "
                "removed in 0.22 (pip resolves gym 0.26.2), and gym 0.21.0 does not build with current setuptools "
                "(invalid extras_require); its maintained single-file ppo.py is not on PyPI and this machine "
                "reaches PyPI only")
SF_TERMINATE_GRACE_S = 60.0


def peers_dir() -> Path:
    """Where the peers' virtual environments live: ``$CONVEYOR_PEERS_DIR``, else ``.peers`` at the repository."""
    if os.environ.get(PEERS_DIR_ENV):
        return Path(os.environ[PEERS_DIR_ENV])
    return Path(__file__).resolve().parents[2] / ".peers"


def sf_python() -> Path:
    return peers_dir() / SF_VENV_NAME / "bin" / "python"


def skip_reason(framework: str, env_id: str) -> str:
    """Why ``framework`` cannot race on ``env_id`` here ("" when it can)."""
    if framework == "cleanrl":
        return CLEANRL_SKIP
    if env_id not in SF_RECIPES:
        return (f"Sample Factory publishes no recipe for {env_id} (its conv encoders are built for 84x84 frames, "
                "MinAtar's are 10x10)" if env_id.startswith("MinAtar/") else
                f"no Sample Factory recipe for {env_id} in this suite")
    if not sf_python().is_file():
        return f"Sample Factory's venv {sf_python().parent.parent} is not built (make peers)"
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


def build_sample_factory_venv(log: Any = print) -> Path:
    """Create ``.peers/sample-factory`` with torch 2.13.0 (the local CPU wheel) and ``SF_REQUIREMENTS``;
    returns its python. Torch goes in first, alone, and must come out as this venv's own torch build."""
    import torch

    target = peers_dir() / SF_VENV_NAME
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
    _run([*pip, TORCH_PIN, *SF_REQUIREMENTS], log)
    check = ("import sample_factory, gymnasium, numpy, torch; "
             "print(gymnasium.__version__, numpy.__version__, torch.__version__)")
    log(f"{target}: gymnasium, numpy, torch = {_run([str(python), '-c', check], log).strip()}")
    return python


# ---- a race run -----------------------------------------------------------------------------------------
def run_external(framework: str, algo: str, cfg: Any, run_dir: Path, goal: RaceGoal, spawned_unix: float) -> None:
    """A peer's race run in its child: Sample Factory's runner in its venv; writes summary.json and the clock."""
    from conveyor.bench.suites import RACE_WINDOW as WINDOW
    from conveyor.bench.suites import write_race_clock as write_clock

    reason = skip_reason(framework, cfg.env.id)
    if reason:
        raise PeerUnavailable(reason)
    recipe = SF_RECIPES[cfg.env.id]
    out = run_dir / "sample-factory"
    env = dict(os.environ)
    roms = conveyor_rom_dir()
    if roms is not None:
        env["ALE_PY_ROM_DIR"] = str(roms)
    left = goal.time_limit_s - (time.time() - spawned_unix)
    command = [str(sf_python()), "-I", str(Path(__file__).with_name("sf_runner.py")), "--env", cfg.env.id,
               "--recipe", recipe, "--seed", str(cfg.seed), "--threshold", str(goal.threshold), "--window",
               str(WINDOW), "--max-steps", str(goal.max_steps), "--time-limit-s", f"{left:.3f}", "--out", str(out)]
    print("$ " + " ".join(command), flush=True)
    runner = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
    try:
        returncode = runner.wait(timeout=max(1.0, left) + SF_TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        runner.terminate()
        returncode = runner.wait(timeout=SF_TERMINATE_GRACE_S)
    except BaseException:
        runner.terminate()
        raise
    result_file = out / "sf_result.json"
    if not result_file.is_file():
        write_clock(run_dir, spawned_unix, None)
        raise RuntimeError(f"Sample Factory's runner exited with {returncode} and wrote no result (see bench.log)")
    result = json.loads(result_file.read_text())
    write_clock(run_dir, spawned_unix, float(result["run_start_unix"]))
    (run_dir / "returns.csv").write_text((out / "returns.csv").read_text())
    wall = float(result["wall_time_s"])
    summary = {"env_steps": result["env_steps"], "wall_time_s": wall,
               "sps": result["env_steps"] / max(wall, 1e-9), "episodes": result["episodes"],
               "return_mean_last100": result["return_mean_last100"], "stop_reason": result["stop_reason"],
               "arch": framework, "algo": algo, "env": cfg.env.id, "seed": cfg.seed, "out": str(run_dir),
               "framework": "sample-factory", "framework_version": result["framework_version"],
               "recipe": SF_RECIPE_TEXT[recipe], "device": result["device"]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if returncode:
        raise RuntimeError(f"Sample Factory's runner exited with {returncode} (see bench.log)")


def main(argv: list[str]) -> int:
    if argv != ["build"]:
        print("usage: python -m conveyor.bench.external build  (Sample Factory's venv under .peers/; make peers)",
              file=sys.stderr)
        return 2
    try:
        python = build_sample_factory_venv()
    except RuntimeError as error:
        print(f"conveyor: {error}", file=sys.stderr)
        return 1
    print(f"Sample Factory's venv is ready: {python}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
