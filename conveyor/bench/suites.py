"""The suites of ``conveyor bench``: which runs, with which budgets.

A suite is a list of ``BenchRun``s. ``quick``, ``atari``, ``mujoco`` and
``peers`` give every run a fixed budget of env steps and evaluate its
checkpoints afterwards. ``learning`` (issue 15's matrix) asks whether the
defaults learn: each run is exactly the ``conveyor train`` command a user
would type, ``--arch/--algo/--env/--seed/--total-steps`` (and ``--preset``
for IMPACT's comparison presets), so the presets decide everything else; its
report measures return against each env's threshold (``LEARNING_ENVS``) and
quotes published numbers (``REFERENCES``); where those were played in another
protocol than training's env (Pong: no sticky actions), each run's final
policy is evaluated in it too. ``race`` (``race.py``) races every contender
to a return threshold against the clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.errors import ConfigError
from conveyor.presets import ARCH_ALGOS, own_algo
from conveyor.envs import STEP_TIME_ID

FRAMEWORKS = ("conveyor", "sb3", "sample-factory", "cleanrl")
# The algorithm each architecture runs in the suites: on discrete actions its own (``presets.ARCH_ALGOS``, the one
# architecture -> algorithms table); on continuous actions PPO for paac and hts and A2C for ga3c.
SUITE_ALGOS = {arch: own_algo(arch) for arch in ARCH_ALGOS}
SUITE_ALGOS_CONTINUOUS = {**SUITE_ALGOS, "paac": "ppo", "ga3c": "a2c", "hts": "ppo"}
START_AND_EVAL_GRACE_S = 240.0
"""Seconds a child gets beyond its training time limit, for start-up and evaluation."""


class PeerUnavailable(RuntimeError):
    """A peer framework that is not installed; the run is recorded as skipped (raised by ``peers.py``,
    ``zoo.py`` and ``external.py`` in a run's child; here so the child needs none of them to catch it)."""


@dataclass(frozen=True)
class RaceGoal:
    """What a race run (``conveyor bench --suite race``, ``race.py``) runs for: the mean return of the last 100
    training episodes at which it stops, and its caps, counted from the moment its process is spawned."""

    threshold: float
    max_steps: int
    time_limit_s: float


RACE_WINDOW = 100
"""Episodes in the mean that must reach a race's threshold (as ``conveyor train --target-return``)."""
RACE_CLOCK_FILE = "race_clock.json"
SPEC_FILE = "bench_spec.json"
"""A bench run's spec (config, race goal, spawn time, machine speed), written by the parent for its child."""


def write_race_clock(run_dir: Path, spawned_unix: float, run_start_unix: float | None) -> None:
    """A race run's ``race_clock.json`` (written by its child): when its process was spawned and when the run's
    own clock (``returns.csv``'s wall times) started, both unix time; None when the run never started."""
    clock = {"spawned_unix": spawned_unix, "run_start_unix": run_start_unix,
             "startup_s": None if run_start_unix is None else run_start_unix - spawned_unix}
    (run_dir / RACE_CLOCK_FILE).write_text(json.dumps(clock, indent=2))


@dataclass(frozen=True)
class BenchRun:
    """One run of a suite: a config (for peers: the settings they match) and how many evaluation episodes."""

    name: str
    cfg: RunCfg
    framework: str = "conveyor"
    eval_episodes: int = 10
    """Evaluation episodes per policy; 0 skips evaluation (e.g. the step-time env, where only speed matters)."""
    eval_env_args: tuple[tuple[str, Any], ...] = ()
    """Env constructor arguments the evaluation replaces (``conveyor eval --env-arg``): another protocol."""
    eval_checkpoints: tuple[str, ...] = ()
    """The checkpoints evaluated (``conveyor eval --checkpoint``); empty: every one the run kept."""
    algo_label: str = ""
    """The algorithm's name in tables when it is not ``cfg.algo.name`` (a peer's own name for it, a preset)."""
    flags: tuple[str, ...] = ()
    """The ``conveyor train`` flags ``cfg`` was built from (learning runs), for ``--list`` and the report."""
    skip_reason: str = ""
    """Why the run cannot start here (its env's package is missing); it becomes a ``skipped`` row."""
    race: RaceGoal | None = None
    """A race run: it stops at the goal's threshold, and its child records its clock (``race.py``)."""

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise ConfigError(f"unknown framework {self.framework!r}: choose one of {', '.join(FRAMEWORKS)}")
        if (self.eval_env_args or self.eval_checkpoints) and self.framework != "conveyor":
            raise ConfigError(f"bench run {self.name}: eval_env_args and eval_checkpoints need conveyor's "
                              "evaluation (the peers evaluate every snapshot in their training env)")
        if not self.cfg.time_limit_s:
            raise ConfigError(f"bench run {self.name} needs a wall-time cap: set time_limit_s")

    @property
    def timeout_s(self) -> float:
        return self.cfg.time_limit_s + max(START_AND_EVAL_GRACE_S, 0.5 * self.cfg.time_limit_s)

    @property
    def arch_label(self) -> str:
        return self.cfg.arch.name if self.framework == "conveyor" else self.framework

    @property
    def label(self) -> str:
        return f"{self.arch_label}/{self.algo_label or self.cfg.algo.name} {self.cfg.env.id} s{self.cfg.seed}"


@dataclass(frozen=True)
class EnvBudget:
    """An env of a suite with its budget: env steps, a wall-time cap, evaluation episodes, the model."""

    env: EnvCfg
    total_steps: int
    time_limit_s: float
    eval_episodes: int = 10
    model: ModelCfg = ModelCfg()


@dataclass(frozen=True)
class LearningEnv:
    """An env of the learning suite: its step budget, the return that counts as learned, the runs on it."""

    id: str
    total_steps: int
    threshold: float | None
    """Mean return of the last 100 episodes that counts as learned; None: no threshold (curves only)."""
    time_limit_s: float
    """Wall-time cap of each run: a guard against a run that hangs, far above the expected time."""
    runs: tuple[tuple[str, str, str], ...]
    """(arch, algo, preset) per row; an empty algo leaves it to the preset."""
    package: str = ""
    """The module that provides the env; without it the env's rows are skipped."""
    eval_episodes: int = 0
    """Episodes each run's final policy plays after training, in the protocol of the env's published scores;
    0: none (the training curve is already comparable with them)."""
    eval_env_args: tuple[tuple[str, Any], ...] = ()
    """How that protocol's env differs from training's (``conveyor eval --env-arg``)."""


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    runs: tuple[BenchRun, ...]
    learning_envs: tuple[LearningEnv, ...] = ()
    """For the learning suite: the envs its report measures against their thresholds."""
    race_envs: tuple[Any, ...] = ()
    """For the race suite: its ``race.RaceEnv``s (threshold and caps per env)."""


def run_name(framework: str, arch: str, algo: str, env_id: str, seed: int) -> str:
    who = arch if framework == "conveyor" else framework
    return f"{who}-{algo}-{env_id.replace('/', '_')}-s{seed}"


def bench_cfg(budget: EnvBudget, arch: ArchCfg, algo: AlgoCfg, seed: int, **fields: Any) -> RunCfg:
    """A fixed-budget run: never stops early on a return, and keeps 10 policies for evaluation."""
    return RunCfg(env=budget.env, model=budget.model, algo=algo, arch=arch, seed=seed,
                  total_steps=budget.total_steps, time_limit_s=budget.time_limit_s, target_return=math.inf,
                  checkpoint_every=max(1, budget.total_steps // 10), keep_checkpoints=10, progress=False, **fields)


def arch_matrix(archs: dict[str, str], budgets: Sequence[EnvBudget], seeds: Sequence[int],
                **fields: Any) -> tuple[BenchRun, ...]:
    """Every (env, architecture with its algorithm, seed), env by env."""
    return tuple(
        BenchRun(run_name("conveyor", arch, algo, budget.env.id, seed),
                 bench_cfg(budget, ArchCfg(name=arch), AlgoCfg(name=algo), seed, **fields),
                 eval_episodes=budget.eval_episodes)
        for budget in budgets for arch, algo in archs.items() for seed in seeds)


# ---- fixed-budget suites -------------------------------------------------------------------------
def quick_suite(seeds: Sequence[int] = (0,)) -> Suite:
    budgets = [
        EnvBudget(EnvCfg(id="CartPole-v1", num_envs=16, num_workers=2), total_steps=60_000, time_limit_s=30.0),
        EnvBudget(EnvCfg(id=STEP_TIME_ID, num_envs=16, num_workers=2,
                         env_args=(("dist", "exponential"), ("mean_ms", 1.0))),
                  total_steps=20_000, time_limit_s=25.0, eval_episodes=0),
    ]
    return Suite("quick", "all five architectures on CartPole-v1 (60k env steps, 30 s cap) and "
                 "conveyor/StepTime-v0 (exponential 1 ms steps; 20k env steps, 25 s cap); 16 envs, 2 env workers, "
                 "one learner thread", arch_matrix(SUITE_ALGOS, budgets, seeds, torch_threads=1, log_interval_s=1.0))


def atari_suite(seeds: Sequence[int] = (0,)) -> Suite:
    budgets = [EnvBudget(EnvCfg(id=env_id, num_envs=32, num_workers=8), total_steps=10_000_000,
                         time_limit_s=3 * 3600.0) for env_id in ("ALE/Pong-v5", "ALE/Breakout-v5")]
    return Suite("atari", "all five architectures on Pong and Breakout (10M env steps, 3 h cap; 32 envs, "
                 "8 env workers)", arch_matrix(SUITE_ALGOS, budgets, seeds, log_interval_s=10.0))


def mujoco_suite(seeds: Sequence[int] = (0,)) -> Suite:
    budgets = [EnvBudget(EnvCfg(id="HalfCheetah-v5", num_envs=16, num_workers=4), total_steps=1_000_000,
                         time_limit_s=3600.0)]
    return Suite("mujoco", "all five architectures on HalfCheetah-v5 with their continuous-action algorithms "
                 "(1M env steps, 1 h cap; 16 envs, 4 env workers)",
                 arch_matrix(SUITE_ALGOS_CONTINUOUS, budgets, seeds, log_interval_s=5.0))


def peers_suite(seeds: Sequence[int] = (0,)) -> Suite:
    env = EnvCfg(id="CartPole-v1", num_envs=8, num_workers=2)
    budget = EnvBudget(env, total_steps=100_000, time_limit_s=90.0, model=ModelCfg(hidden=(64, 64)))
    pairs = [  # (framework, arch settings, algorithm settings): each conveyor row with the peer doing the same
        ("conveyor", ArchCfg(name="paac", unroll=5), AlgoCfg(name="a2c")),
        ("sb3", ArchCfg(name="paac", unroll=5), AlgoCfg(name="a2c")),
        ("conveyor", ArchCfg(name="paac", unroll=32), AlgoCfg(name="ppo")),
        ("sb3", ArchCfg(name="paac", unroll=32), AlgoCfg(name="ppo")),
        # APPO = IMPACT without the target network, each batch used once.
        ("conveyor", ArchCfg(name="impact", replay_times=1, use_target_network=False), AlgoCfg(name="impact")),
        ("sample-factory", ArchCfg(name="impact", replay_times=1, use_target_network=False), AlgoCfg(name="impact")),
    ]
    runs = []
    for framework, arch, algo in pairs:
        algo_label = "appo" if framework == "sample-factory" else ""
        for seed in seeds:
            runs.append(BenchRun(run_name(framework, arch.name, algo_label or algo.name, env.id, seed),
                                 bench_cfg(budget, arch, algo, seed, torch_threads=1, log_interval_s=1.0),
                                 framework=framework, algo_label=algo_label))
    return Suite("peers", "conveyor vs stable-baselines3 A2C and PPO (and Sample Factory APPO where installed) on "
                 "CartPole-v1: same MLP (64, 64) with linear policy and value heads, 8 envs, same n-steps "
                 "(A2C 5, PPO 32), learning rates, optimizers, clipping and loss weights; 100k env steps, 90 s cap",
                 tuple(runs))


# ---- the learning suite --------------------------------------------------------------------------
# Each discrete-action architecture with its own algorithm (MinAtar, Pong).
DISCRETE_RUNS = (("paac", "a2c", ""), ("ga3c", "ga3c", ""), ("seed", "vtrace", ""), ("impact", "impact", ""),
                 ("hts", "a2c", ""))
# MinAtar adds SEED's R2D2 (its Atari agent); on Pong a CPU affords it too few updates (BENCHMARKS.md).
MINATAR_RUNS = (*DISCRETE_RUNS, ("seed", "r2d2", ""))
HOUR = 3600.0
# Pong's budget depends on the hardware: what a GPU learner gets through in a few hours, else a CPU's share.
PONG_STEPS = {"cpu": 2_000_000, "cuda": 10_000_000}
# The Pong scores of REFERENCES were played without sticky actions (ALE/Pong-v5 has them, Machado et al. 2018),
# averaged over 30 episodes: PAAC table 1 ("averaged over 30 runs with up to 30 no-op actions start condition"),
# GA3C table 3 ("the average score on 30 games"). ``conveyor eval`` plays up to 30 no-ops by default.
PUBLISHED_ATARI_PROTOCOL = {"eval_episodes": 30, "eval_env_args": (("repeat_action_probability", 0.0),)}
LEARNING_ENVS = (
    LearningEnv("CartPole-v1", 300_000, 475.0, HOUR, runs=(
        ("paac", "a2c", ""), ("paac", "ppo", ""), ("ga3c", "ga3c", ""), ("seed", "vtrace", ""), ("seed", "r2d2", ""),
        ("impact", "impact", ""), ("impact", "", "appo"), ("impact", "", "impala"), ("hts", "a2c", ""),
        ("hts", "ppo", ""))),
    LearningEnv("Pendulum-v1", 300_000, -250.0, HOUR, runs=(
        ("paac", "ppo", ""), ("hts", "ppo", ""), ("impact", "impact", ""), ("seed", "vtrace", ""))),
    LearningEnv("HalfCheetah-v5", 1_000_000, 1500.0, 3 * HOUR, package="mujoco", runs=(
        ("paac", "ppo", ""), ("impact", "impact", ""))),
    LearningEnv("MinAtar/Breakout-v1", 1_000_000, None, 3 * HOUR, package="minatar", runs=MINATAR_RUNS),
    LearningEnv("MinAtar/SpaceInvaders-v1", 1_000_000, None, 3 * HOUR, package="minatar", runs=MINATAR_RUNS),
    LearningEnv("ALE/Pong-v5", PONG_STEPS["cpu"], None, 6 * HOUR, package="ale_py", runs=DISCRETE_RUNS,
                **PUBLISHED_ATARI_PROTOCOL),
)
QUICK_ENVS = ("CartPole-v1",)
LEARNING_FLAGS = frozenset({"--arch", "--algo", "--preset", "--env", "--seed", "--total-steps"})
"""The only train flags a learning run passes: whatever else it uses, the presets chose."""

# Published numbers to hold the learning suite against, by (env, row label); an env's ``None`` entry is said
# for rows without one of their own. Sources: rl-baselines3-zoo ``benchmark.md`` (one run per entry,
# deterministic evaluation except Atari), CleanRL's documentation (3 seeds), the papers in the seeds.
REFERENCES: dict[tuple[str, str | None], str] = {
    ("CartPole-v1", "a2c"): "500.0 ± 0.0: rl-baselines3-zoo benchmark (SB3 A2C, 500k steps)",
    ("CartPole-v1", "ppo"): ("500.0 ± 0.0: rl-baselines3-zoo benchmark (SB3 PPO, 100k steps); "
                             "490.04 ± 6.12: CleanRL ppo.py (500k steps, 3 seeds)"),
    ("CartPole-v1", None): "none published: the GA3C, SEED RL and IMPACT papers report Atari, DMLab and MuJoCo only",
    ("Pendulum-v1", "ppo"): "-172.2 ± 104.2: rl-baselines3-zoo benchmark (SB3 PPO, 100k steps)",
    ("Pendulum-v1", "vtrace"): ("none published as a score: RLlib's tuned IMPALA example (tuned_examples/impala/"
                                "pendulum_impala.py) budgets 5M env steps for a mean of -200; its older "
                                "pendulum-impala.yaml stopped at -700 within 500k; the one-pass peer, SB3 A2C with "
                                "rl-baselines3-zoo's tuned Pendulum-v1 recipe, measured here at 300k steps "
                                "(benchmarks/sb3_a2c_pendulum.py, seeds 1-3): -272 ± 54 with gSDE, -1032 without "
                                "(seed 1)"),
    ("Pendulum-v1", None): "none published: the SEED RL and IMPACT papers report no Pendulum number",
    ("HalfCheetah-v5", "ppo"): ("5819.1 ± 663.5: rl-baselines3-zoo benchmark (SB3 PPO, HalfCheetah-v3, 1M steps); "
                                "1442.6 ± 46.0: CleanRL ppo_continuous_action.py (HalfCheetah-v4, 1M steps, "
                                "3 seeds)"),
    ("HalfCheetah-v5", None): "none published as a number: IMPACT paper figure 5 (HalfCheetah) shows curves only",
    ("MinAtar/Breakout-v1", None): ("none published as a number: the MinAtar paper (Young & Tian 2019) shows "
                                    "DQN and AC(lambda) learning curves over 5M frames, no table"),
    ("MinAtar/SpaceInvaders-v1", None): ("none published as a number: the MinAtar paper (Young & Tian 2019) "
                                         "shows DQN and AC(lambda) learning curves over 5M frames, no table"),
    ("ALE/Pong-v5", "paac/a2c"): ("20.6 (arch_nips) / 20.9 (arch_nature): PAAC paper table 1 "
                                  "(115M steps, best of 3 actors, 30 no-op starts, no sticky actions)"),
    ("ALE/Pong-v5", "ga3c/ga3c"): "18: GA3C paper table 3 (1 day on a GPU, no sticky actions)",
    ("ALE/Pong-v5", "seed/vtrace"): ("21.0: SEED RL paper table A.3.2 (its Atari agent is R2D2; "
                                     "no V-trace Atari number there)"),
    ("ALE/Pong-v5", "hts/a2c"): ("17.3 ± 3.2: rl-baselines3-zoo benchmark (SB3 A2C, PongNoFrameskip-v4: no sticky "
                                 "actions, 10M steps)"),
    ("ALE/Pong-v5", None): "none published as a number: IMPACT paper figure 6 (Pong) shows curves only",
}


def reference(env_id: str, label: str) -> str:
    """The published number for a learning row (``arch/algo``), by row, else by algorithm, else the env's note."""
    algo = label.partition("/")[2]
    return (REFERENCES.get((env_id, label)) or REFERENCES.get((env_id, algo))
            or REFERENCES.get((env_id, None)) or "none published")


def learning_flags(arch: str, algo: str, preset: str, env_id: str, seed: int, total_steps: int) -> tuple[str, ...]:
    """The ``conveyor train`` command line of a learning run."""
    flags = ["--arch", arch]
    if algo:
        flags += ["--algo", algo]
    if preset:
        flags += ["--preset", preset]
    return (*flags, "--env", env_id, "--seed", str(seed), "--total-steps", str(total_steps))


@functools.cache
def _train_parser() -> argparse.ArgumentParser:
    """``conveyor train``'s flags (built once: reading the field docs takes a fifth of a second)."""
    from conveyor.cli import add_train_arguments

    parser = argparse.ArgumentParser(prog="conveyor train")
    add_train_arguments(parser)
    return parser


def train_config(flags: Sequence[str]) -> RunCfg:
    """The config ``conveyor train FLAGS`` runs with (the CLI's own parsing and preset resolution)."""
    from conveyor.cli import config_from_args

    return config_from_args(_train_parser().parse_args(list(flags)))


def learning_suite(seeds: Sequence[int] | None = None, *, quick: bool = False, budget_scale: float = 1.0,
                   device: str = "cpu") -> Suite:
    """Issue 15's matrix: does each architecture learn each env with nothing but the presets?

    ``quick``: CartPole-v1 only. ``budget_scale`` multiplies the step budgets (a smoke run of the suite's
    machinery; the thresholds are then out of reach; the wall-time guards stay, a busy machine is slow).
    ``device``: where Pong's learners will run (``--device``, applied to the runs by the caller, else the Atari
    preset's); on cuda Pong gets ``PONG_STEPS["cuda"]``.
    """
    if not 0 < budget_scale <= 1:
        raise ConfigError(f"--budget-scale {budget_scale:g} must be in (0, 1]: it shortens the learning suite")
    seeds = tuple(seeds or ((1,) if quick else (1, 2, 3)))
    envs = [env for env in LEARNING_ENVS if not quick or env.id in QUICK_ENVS]
    if device.startswith("cuda"):
        envs = [dataclasses.replace(env, total_steps=PONG_STEPS["cuda"]) if env.id == "ALE/Pong-v5" else env
                for env in envs]
    envs = [dataclasses.replace(env, total_steps=max(1000, round(env.total_steps * budget_scale))) for env in envs]
    runs = []
    for env in envs:
        missing = env.package and importlib.util.find_spec(env.package) is None
        skip_reason = f"{env.package} is not installed (pip install {env.package})" if missing else ""
        for arch, algo, preset in env.runs:
            for seed in seeds:
                flags = learning_flags(arch, algo, preset, env.id, seed, env.total_steps)
                # Bench plumbing only: a wall-time guard, no progress line; learning settings stay the presets'.
                cfg = dataclasses.replace(train_config(flags), time_limit_s=env.time_limit_s, progress=False)
                runs.append(BenchRun(run_name("conveyor", arch, preset or algo, env.id, seed), cfg,
                                     eval_episodes=env.eval_episodes, eval_env_args=env.eval_env_args,
                                     eval_checkpoints=("latest",) if env.eval_episodes else (),
                                     algo_label=preset, flags=flags, skip_reason=skip_reason))
    scope = "CartPole-v1" if quick else "CartPole-v1, Pendulum-v1, HalfCheetah-v5, MinAtar Breakout and " \
                                        "SpaceInvaders, Pong"
    return Suite("learning-quick" if quick else "learning",
                 f"does each architecture learn with its presets alone ({scope}); every run is `conveyor train` "
                 "with only --arch/--algo (or --preset)/--env/--seed/--total-steps", tuple(runs), tuple(envs))


SUITES: dict[str, Callable[[Sequence[int]], Suite]] = {
    "quick": quick_suite, "atari": atari_suite, "mujoco": mujoco_suite, "peers": peers_suite,
    "learning": learning_suite,
}
"""The fixed-budget and learning suites; ``conveyor bench`` adds ``race`` (``race.py``)."""
