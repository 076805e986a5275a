"""CleanRL's PPO in a race run: a standalone script for CleanRL's own virtual environment.

``external.run_external`` starts it as ``.peers/cleanrl/bin/python -I
cleanrl_runner.py ARGS`` (isolated: conveyor is not installed there): numpy,
gym 0.23.1, gymnasium 0.28.1, torch and cleanrl 1.2.0. It runs one of
CleanRL's published single-file scripts as is (``--script``: ``ppo``, its
discrete-action PPO, whose defaults are its CartPole-v1 settings, or
``ppo_continuous_action``, whose defaults are its MuJoCo settings), with
``runpy`` as ``__main__`` and only ``--env-id`` and ``--seed`` on its command
line, so its own defaults, budget and learning-rate annealing hold.

The race watches the script through the one wrapper every env of CleanRL's
passes through, ``RecordEpisodeStatistics`` (gym's in ``ppo``, gymnasium's in
``ppo_continuous_action``, applied before any reward normalization): the
runner puts a subclass in its place that counts env steps (all envs together:
the script's ``global_step``) and gives each finished episode's raw return to
``race_watch.RaceWatch``: it reads every episode, where the script's own
printout shows one per vector step. When the mean of the last ``--window``
reaches ``--threshold``, or a cap is reached, the wrapper raises ``RaceStop``
out of the script's loop. ``returns.csv`` and ``cleanrl_result.json`` are
``RaceWatch.write``'s.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SCRIPT_START_UNIX = time.time()
"""When this script started: ``--time-limit-s`` is what was left of the race's time cap then."""
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by path with -I: its sibling race_watch
from race_watch import RaceWatch, race_arguments  # noqa: E402

SCRIPTS = {"ppo": "gym", "ppo_continuous_action": "gymnasium"}
"""CleanRL's scripts the race runs, and the env package each makes its envs with."""
RESULT_FILE = "cleanrl_result.json"


class RaceStop(BaseException):
    """Raised out of the script's env step when the race has its answer (BaseException: no handler of the
    script's can take it for its own)."""


class StepCounter:
    """Env steps of all the script's envs together (its ``global_step``), told to ``watch`` after each."""

    def __init__(self, watch: RaceWatch) -> None:
        self.watch, self.steps = watch, 0

    def after_step(self, episode_return: float | None) -> None:
        self.steps += 1
        if episode_return is not None:
            self.watch.episode(episode_return, self.steps)
        reason = self.watch.stop_reason(self.steps)
        if reason:
            raise RaceStop(reason)


def watched_statistics(base: type, counter: StepCounter) -> type:
    """``base`` (a ``RecordEpisodeStatistics``) that tells ``counter`` of each step and each finished episode."""

    class RaceEpisodeStatistics(base):  # type: ignore[misc, valid-type]
        def step(self, action: Any) -> Any:
            result = super().step(action)
            info = result[-1]
            value = info["episode"]["r"] if "episode" in info else None
            counter.after_step(None if value is None else float(value[0] if hasattr(value, "__len__") else value))
            return result

    return RaceEpisodeStatistics


def main(argv: list[str]) -> int:
    parser = race_arguments(__doc__.splitlines()[0])
    parser.add_argument("--script", choices=sorted(SCRIPTS), required=True)
    args = parser.parse_args(argv)
    import importlib
    import importlib.metadata

    import torch
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (the script's imports, before the clock)

    env_package = importlib.import_module(SCRIPTS[args.script])
    watch = RaceWatch.from_args(args, SCRIPT_START_UNIX, run_start_unix=time.time())
    counter = StepCounter(watch)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)  # the script writes its TensorBoard files to runs/ under the working directory
    env_package.wrappers.RecordEpisodeStatistics = watched_statistics(
        env_package.wrappers.RecordEpisodeStatistics, counter)
    sys.argv = [f"{args.script}.py", f"--env-id={args.env}", f"--seed={args.seed}"]
    status = 0
    try:
        runpy.run_module(f"cleanrl.{args.script}", run_name="__main__", alter_sys=True)
    except RaceStop:
        pass
    except Exception as error:  # the script failed: recorded, and the race says so
        traceback.print_exc()
        watch.ended, status = f"error: {type(error).__name__}", 1
    watch.write(out, RESULT_FILE, counter.steps, status=status,
                framework_version=importlib.metadata.version("cleanrl"),
                device="cuda" if torch.cuda.is_available() else "cpu")
    sys.stdout.flush()
    sys.stderr.flush()
    # A stopped script leaves its SummaryWriter and envs open; their threads must not hold the exit.
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
