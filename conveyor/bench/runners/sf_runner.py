"""Sample Factory APPO in a race run: a standalone script for Sample Factory's own virtual environment.

``external.run_external`` starts it as ``.peers/sample-factory/bin/python -I
sf_runner.py ARGS`` (isolated: this folder is not on ``sys.path``, and
conveyor is not installed there): numpy, gymnasium 0.29 and Sample Factory
2.1.1 only. It trains APPO with one of Sample Factory's own published
settings (``--recipe``):

* ``gym``: the command line in the docstring of ``sf_examples/train_gym_env.py``
  (its CartPole-v1 example);
* ``mujoco``: ``sf_examples.mujoco.mujoco_params.mujoco_override_defaults``
  (its continuous-control recipe);
* ``atari``: ``sf_examples.atari.atari_params.atari_override_defaults`` and
  its env chain (``sf_examples.atari.atari_utils.make_atari_env``: the same
  wrappers), on ``ALE/...-v5`` made with ``frameskip=1`` (the wrapper skips
  4) and the v5 sticky actions, as conveyor trains.

Each finished episode's return (the real game's, from
``RecordEpisodeStatistics``, on Atari; the summed raw reward elsewhere) goes
to ``race_watch.RaceWatch``; when the mean of the last ``--window`` reaches
``--threshold``, or a cap is reached, the run stops. Env steps are agent steps
(Sample Factory's frame counts divided by the frame skip where it counts
frames). ``returns.csv`` and ``sf_result.json`` are ``RaceWatch.write``'s.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

SCRIPT_START_UNIX = time.time()
"""When this script started: ``--time-limit-s`` is what was left of the race's time cap then."""
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by path with -I: its sibling race_watch
from race_watch import RaceWatch, race_arguments  # noqa: E402

RESULT_FILE = "sf_result.json"
# The train_gym_env.py example's command line (CartPole-v1), less its --experiment and --env.
GYM_EXAMPLE_ARGS = ("--algo=APPO", "--use_rnn=False", "--num_envs_per_worker=20", "--policy_workers_per_policy=2",
                    "--recurrence=1", "--with_vtrace=False", "--batch_size=512", "--reward_scale=0.1",
                    "--save_every_sec=10", "--experiment_summaries_interval=10")


def make_plain(full_env_name, cfg=None, env_config=None, render_mode=None):
    """A classic env as ``sf_examples/train_gym_env.py`` makes it (module level: Sample Factory's workers are
    spawned, and pickle the function by name)."""
    import gymnasium as gym

    return gym.make(full_env_name, render_mode=render_mode)


def make_atari(full_env_name, cfg=None, env_config=None, render_mode=None):
    """The chain of ``sf_examples.atari.atari_utils.make_atari_env``, on the v5 id without its own frame skip."""
    import gymnasium as gym
    from sample_factory.envs.env_wrappers import (ClipRewardEnv, EpisodicLifeEnv, FireResetEnv, MaxAndSkipEnv,
                                                  NoopResetEnv, NumpyObsWrapper)

    env = gym.make(full_env_name, render_mode=render_mode, frameskip=1)
    env = gym.wrappers.RecordEpisodeStatistics(env)
    env = NoopResetEnv(env, noop_max=30)
    env = MaxAndSkipEnv(env, skip=cfg.env_frameskip)
    env = EpisodicLifeEnv(env)
    if "FIRE" in env.unwrapped.get_action_meanings():
        env = FireResetEnv(env)
    env = ClipRewardEnv(env)
    env = gym.wrappers.ResizeObservation(env, (84, 84))
    env = gym.wrappers.GrayScaleObservation(env)
    env = gym.wrappers.FrameStack(env, cfg.env_framestack)
    return NumpyObsWrapper(env)


def main(argv: list[str]) -> int:
    parser = race_arguments(__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=("gym", "mujoco", "atari"), required=True)
    args = parser.parse_args(argv)
    import numpy as np
    import torch
    from sample_factory.algo.utils.misc import EPISODIC
    from sample_factory.cfg.arguments import parse_full_cfg, parse_sf_args
    from sample_factory.envs.env_utils import register_env
    from sample_factory.train import make_runner

    watch = RaceWatch.from_args(args, SCRIPT_START_UNIX, run_start_unix=time.time())
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    name = args.env
    register_env(name, make_atari if args.recipe == "atari" else make_plain)
    device = "gpu" if torch.cuda.is_available() else "cpu"
    argv_sf = [f"--env={name}", "--experiment=sf", f"--train_dir={out}", f"--seed={args.seed}", f"--device={device}"]
    if args.recipe == "gym":
        argv_sf = [*GYM_EXAMPLE_ARGS, *argv_sf]
    else:
        argv_sf = ["--algo=APPO", *argv_sf]
    parser, partial = parse_sf_args(argv=argv_sf)
    if args.recipe == "atari":
        from sf_examples.atari.atari_params import atari_override_defaults

        atari_override_defaults(partial.env, parser)
    elif args.recipe == "mujoco":
        from sf_examples.mujoco.mujoco_params import mujoco_override_defaults

        mujoco_override_defaults(partial.env, parser)
    cfg = parse_full_cfg(parser, argv_sf)
    # Frames per agent step in Sample Factory's env-step counts.
    skip = cfg.env_frameskip if (args.recipe == "atari" and cfg.summaries_use_frameskip) else 1
    # The recipe's own train_for_env_steps stays (its linear lr decay runs over it); the race's cap is below.
    cfg, runner = make_runner(cfg)

    def steps_now() -> int:
        return int(sum(runner.env_steps.values()) // skip) if runner.env_steps else 0

    def on_episodes(runner_, msg, policy_id) -> None:
        stats = msg[EPISODIC]
        key = "RecordEpisodeStatistics_reward" if args.recipe == "atari" else "reward"
        if key not in stats:  # Atari: a lost life, not the end of the game
            return
        values = stats[key]
        values = values.tolist() if hasattr(values, "tolist") else values  # batched sampling: a tensor
        steps = steps_now()
        for value in np.atleast_1d(np.asarray(values, dtype=np.float64)).tolist():
            watch.episode(value, steps)
        if not runner_.stopped and watch.stop_reason(steps):
            runner_._stop_training()  # what Sample Factory itself calls at the end of its budget

    def race_on_clock(runner_) -> None:
        # Sample Factory 2.1.1 never counts its total_train_seconds up, so --train_for_seconds cannot stop it:
        # a timer on the runner's event loop stops it at the race's time cap (and at the step cap between episodes).
        if not runner_.stopped and watch.stop_reason(steps_now()):
            runner_._stop_training()

    import types

    from signal_slot.signal_slot import Timer

    # A slot must be a method of an event-loop object (signal_slot looks it up by name): the runner's.
    runner.race_on_clock = types.MethodType(race_on_clock, runner)
    clock = Timer(runner.event_loop, 0.5)
    clock.timeout.connect(runner.race_on_clock)
    runner.timers.append(clock)  # stopped with Sample Factory's own timers
    runner.register_episodic_stats_handler(on_episodes)
    status = runner.init()
    if status == 0:
        status = runner.run()
    import sample_factory

    watch.write(out, RESULT_FILE, steps_now(), status=int(status),
                framework_version=getattr(sample_factory, "__version__", "2.1.1"), device=device,
                frameskip_in_counts=skip)
    return 0 if status == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
