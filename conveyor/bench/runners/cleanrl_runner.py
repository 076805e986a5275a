"""CleanRL's PPO in a race run: a standalone script for CleanRL's own virtual environment.

``external.run_external`` starts it as ``.peers/cleanrl/bin/python -I
cleanrl_runner.py ARGS`` (isolated: conveyor is not installed there): numpy,
gym 0.23.1, gymnasium 0.28.1, torch, cleanrl 1.2.0, and for Atari
stable-baselines3 1.2.0 (its Atari wrappers) and ale-py 0.8.1. It runs one of
CleanRL's published single-file scripts as is (``--script``: ``ppo``, its
discrete-action PPO, whose defaults are its CartPole-v1 settings,
``ppo_continuous_action``, whose defaults are its MuJoCo settings, or
``ppo_atari``, whose defaults are its Atari settings), with ``runpy`` as
``__main__`` and only ``--env-id`` and ``--seed`` on its command line, so its
own defaults, budget and learning-rate annealing hold.

The race watches the script through the one wrapper every env of CleanRL's
passes through, ``RecordEpisodeStatistics`` (gym's in ``ppo`` and
``ppo_atari``, gymnasium's in ``ppo_continuous_action``, applied before any
reward normalization or clipping): the runner puts a subclass in its place
that gives each finished episode's raw return to ``race_watch.RaceWatch``: it
reads every episode, where the script's own printout shows one per vector
step. The same wrapper counts env steps (all envs together: the script's
``global_step``), except in ``ppo_atari``, where it sits under SB3's
``MaxAndSkipEnv`` and sees every frame: there a subclass of that wrapper
counts the agent's steps (4 frames each), as conveyor's Atari runs do. When
the mean of the last ``--window`` reaches ``--threshold``, or a cap is
reached, the counting wrapper raises ``RaceStop`` out of the script's loop.
``returns.csv`` and ``cleanrl_result.json`` are ``RaceWatch.write``'s.

``ppo_atari`` makes its envs with ``gym.make(env_id)`` and wraps them in
gym 0.23's step API (four values, ``reset`` returning the observation); the
ALE with wheels for this Python, ale-py 0.8.1, registers ``ALE/`` ids with gym
but steps with the five values of gym 0.26. The runner's ``gym.make`` gives
the script, for an ``ALE/`` id, that env with ``frameskip=1`` (the skipping is
the script's ``MaxAndSkipEnv(skip=4)``, as in CleanRL's ``NoFrameskip-v4``
runs; the v5 id keeps its sticky actions) behind ``OldStepApi``, which folds
``terminated or truncated`` into gym 0.23's ``done`` and marks a truncation
``TimeLimit.truncated``; its ``np_random`` is gym 0.23's generator (with the
``randint`` that SB3 1.2.0's ``NoopResetEnv`` calls), on the same stream.
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

SCRIPTS = {"ppo": "gym", "ppo_continuous_action": "gymnasium", "ppo_atari": "gym"}
"""CleanRL's scripts the race runs, and the env package each makes its envs with."""
RESULT_FILE = "cleanrl_result.json"


class RaceStop(BaseException):
    """Raised out of the script's env step when the race has its answer (BaseException: no handler of the
    script's can take it for its own)."""


class StepCounter:
    """Env steps of all the script's envs together (its ``global_step``), told to ``watch`` after each with the
    episodes that ended in it."""

    def __init__(self, watch: RaceWatch) -> None:
        self.watch, self.steps, self.ended = watch, 0, []

    def episode_ended(self, episode_return: float) -> None:
        self.ended.append(episode_return)

    def after_step(self) -> None:
        self.steps += 1
        for episode_return in self.ended:
            self.watch.episode(episode_return, self.steps)
        self.ended.clear()
        reason = self.watch.stop_reason(self.steps)
        if reason:
            raise RaceStop(reason)


def watched_statistics(base: type, counter: StepCounter, counts_steps: bool = True) -> type:
    """``base`` (a ``RecordEpisodeStatistics``) that tells ``counter`` of each finished episode, and of each step
    where ``counts_steps`` (where no wrapper above it stands for several of its steps)."""

    class RaceEpisodeStatistics(base):  # type: ignore[misc, valid-type]
        def step(self, action: Any) -> Any:
            result = super().step(action)
            info = result[-1]
            if "episode" in info:
                value = info["episode"]["r"]
                counter.episode_ended(float(value[0] if hasattr(value, "__len__") else value))
            if counts_steps:
                counter.after_step()
            return result

    return RaceEpisodeStatistics


def counted_steps(base: type, counter: StepCounter) -> type:
    """``base`` (a wrapper whose step is one agent step, SB3's ``MaxAndSkipEnv``) that tells ``counter`` of each."""

    class RaceCountedSteps(base):  # type: ignore[misc, valid-type]
        def step(self, action: Any) -> Any:
            result = super().step(action)
            counter.after_step()
            return result

    return RaceCountedSteps


def old_api_make(gym: Any) -> Any:
    """gym 0.23's ``gym.make``, except that an ``ALE/`` id gives ale-py 0.8.1's env with ``frameskip=1`` in gym
    0.23's step API (see the module's docstring)."""
    make = gym.make

    class OldStepApi(gym.Wrapper):
        def reset(self, **kwargs: Any) -> Any:
            return self.env.reset(**kwargs)[0]

        def step(self, action: Any) -> Any:
            observation, reward, terminated, truncated, info = self.env.step(action)
            if truncated and not terminated:
                info["TimeLimit.truncated"] = True
            return observation, reward, terminated or truncated, info

    def make_old_api(env_id: str, **kwargs: Any) -> Any:
        if not env_id.startswith("ALE/"):
            return make(env_id, **kwargs)
        import numpy as np
        from ale_py.env.gym import AtariEnv

        class GymEraAtariEnv(AtariEnv):
            def seed(self, seed: int | None = None) -> Any:
                seeds = super().seed(seed)
                # the same stream in gym 0.23's generator, whose randint SB3 1.2.0's NoopResetEnv calls
                self.np_random = gym.utils.seeding.RandomNumberGenerator(np.random.PCG64(seeds[0]))
                return seeds

        return OldStepApi(GymEraAtariEnv(**{**gym.spec(env_id).kwargs, **kwargs, "frameskip": 1}))

    return make_old_api


def main(argv: list[str]) -> int:
    parser = race_arguments(__doc__.splitlines()[0])
    parser.add_argument("--script", choices=sorted(SCRIPTS), required=True)
    args = parser.parse_args(argv)
    import importlib
    import importlib.metadata

    import torch
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (the script's imports, before the clock)

    env_package = importlib.import_module(SCRIPTS[args.script])
    atari = args.script == "ppo_atari"
    if atari:
        from stable_baselines3.common import atari_wrappers  # the script's import, before the clock too
    watch = RaceWatch.from_args(args, SCRIPT_START_UNIX, run_start_unix=time.time())
    counter = StepCounter(watch)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)  # the script writes its TensorBoard files to runs/ under the working directory
    env_package.wrappers.RecordEpisodeStatistics = watched_statistics(
        env_package.wrappers.RecordEpisodeStatistics, counter, counts_steps=not atari)
    if atari:
        atari_wrappers.MaxAndSkipEnv = counted_steps(atari_wrappers.MaxAndSkipEnv, counter)
        env_package.make = old_api_make(env_package)
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
