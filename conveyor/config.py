"""Typed run configuration.

Every knob of a run lives in one frozen dataclass tree: ``RunCfg`` holds an
``EnvCfg``, ``ModelCfg``, ``AlgoCfg`` and ``ArchCfg``. Each field has a
docstring (the string literal under it); ``__post_init__`` validates, and
derived values are properties. Nothing mutates a config at run time: use
``dataclasses.replace`` to make a new one.

A field whose default is ``None`` (``preset`` in ``--help`` and the README) takes
its value from ``conveyor/presets.py`` for the run's architecture,
algorithm and env family: ``RunCfg.__post_init__`` fills every such None
and records where each value came from (``RunCfg.preset_sources``); a
value given explicitly always wins. Sub-configs on their own are partial
and check only the values they hold; a constructed ``RunCfg`` holds no None
in a preset field.

Invalid values raise ``ConfigError`` with a one-line message that names the
field and the fix; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import conveyor.presets as presets
from conveyor.errors import ConfigError
from conveyor.imports import check_ref, is_ref, object_ref
from conveyor.presets import ARCH_ALGOS, FAMILIES, IMPACT_PRESETS, is_atari_id, is_minatar_id

ARCHS = tuple(ARCH_ALGOS)
"""The architectures: ``presets.ARCH_ALGOS``'s keys (that one table also says which algorithms each runs, its own
first, the default of --algo; ``SharedFields.check_in_run`` refuses a pair outside it)."""
ALGOS = ("a2c", "ppo", "vtrace", "impact", "r2d2", "ga3c")
MODELS = ("auto", "mlp", "nips_cnn", "nature_cnn", "impala_resnet", "minatar_cnn")
WEIGHT_INITS = ("orthogonal", "torch")
ENV_BACKENDS = ("auto", "shm", "inproc", "envpool", "vector")
ENV_BACKEND_CHOICE = "env_backend_choice"
"""config.json's record of what ``--env-backend auto`` chose at the run's start (backend, measured step time in
microseconds, reason); not a field."""
LAUNCHERS = ("process", "ray")
RAY_STRATEGIES = ("pack", "spread", "strict_spread")
OPTIMIZERS = ("rmsprop", "adam")
LR_SCHEDULES = ("constant", "linear")
IMPACT_RATIOS = ("target", "worker", "impact")

RECURRENT_ALGOS = ("vtrace", "impact", "r2d2")
"""Algorithms whose architectures carry an LSTM core's state per env while acting (``--lstm-size``)."""


INFINITY_MEANS_NEVER = ("target_return",)
"""Float fields whose documented ``inf`` means "never"; every other float must be finite."""

SEED_LIMIT = 2**32
"""Seeds lie in [0, 2**32): numpy's and the envs' seeding take no more."""


def check_seeds(first: int, count: int = 1) -> None:
    """Refuse the seeds ``first`` to ``first + count - 1`` (a run's; an evaluation's, one per episode) unless all
    lie in [0, 2**32), with one line naming --seed and the values that fit."""
    fits = f"pass a --seed from 0 to {SEED_LIMIT - count}"
    if not 0 <= first < SEED_LIMIT:
        raise ConfigError(f"seed must lie in [0, 2**32), got {first}: {fits}")
    if first + count > SEED_LIMIT:
        raise ConfigError(f"seeds must lie in [0, 2**32), and seed {first} with {count} episodes (one seed each) "
                          f"reaches {first + count - 1}: {fits}")


MAX_WIDTH = 16384
"""Largest MLP layer or LSTM core: a layer of n units after one of n holds n x n weights (1 GiB of float32 here;
a width of 400000 asked for 640 GB)."""
MAX_ENVS = 65536
"""Most envs of a run (each has its rows in every rollout)."""
MAX_PROCESSES = 1024
"""Most worker processes or threads of one kind (env workers, agents, actors, predictors, trainers)."""

FLAG_NAMES = {
    ("env", "id"): "--env",
    ("env", "backend"): "--env-backend",
    ("env", "env_args"): "--env-arg",
    ("env", "family"): "--env-family",
    ("model", "name"): "--model",
    ("algo", "name"): "--algo",
    ("algo", "lr"): "--lr",
    ("arch", "name"): "--arch",
}
"""``conveyor train`` flags whose names differ from their field's (the rest are ``--field-name``)."""


def flag_name(section: str | None, name: str) -> str:
    """The ``conveyor train`` flag of field ``name`` of ``section`` (None: a ``RunCfg`` field)."""
    return FLAG_NAMES.get((section, name)) or "--" + name.replace("_", "-")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is tuple:
        return "a list"
    return getattr(hint, "__name__", str(hint))


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the annotated type ``hint`` (a bool is no number; an int is a float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(item, args[0]) for item in value)
        return len(value) == len(args) and all(_fits(item, arg) for item, arg in zip(value, args))
    return isinstance(value, hint)


def _typed(obj: Any) -> None:
    """Every field holds its annotated type (a config file or a Python caller can pass anything) and every float
    is finite (NaN passes every range check), ``inf`` allowed only where it means "never"."""
    for name, hint in _field_types(type(obj)).items():
        value = getattr(obj, name)
        if not _fits(value, hint):
            raise ConfigError(f"{name} must be {_type_name(hint)}, got {value!r}: fix the flag or config.json")
        if isinstance(value, float) and not math.isfinite(value) and not (
                name in INFINITY_MEANS_NEVER and value == math.inf):
            raise ConfigError(f"{name} must be a finite number, got {value}: fix the flag or config.json")


# Checks skip None: a preset field left unset is checked once the preset has filled it.
def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}: pass a value > 0")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")


def _choice(name: str, value: str, choices: tuple[str, ...], more: str = "") -> None:
    if value is not None and value not in choices:
        raise ConfigError(f"unknown {name} {value!r}: choose one of {', '.join(choices)}{more}")


def _at_most(obj: Any, limit: int, why: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value > limit:
            raise ConfigError(f"{name} must be at most {limit} ({why}), got {value}: pass a smaller value")


def _unit_interval(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name} must lie in [0, 1], got {value}")


def parse_env_arg(text: str) -> tuple[str, Any]:
    """``--env-arg KEY=VALUE`` as ``(key, value)``: VALUE read as JSON (numbers, booleans), else as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--env-arg wants KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # a bare string such as dist=exponential
    return key, value


def merged_env_args(env_args: tuple[tuple[str, Any], ...],
                    overrides: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """``env_args`` with ``overrides`` (``(key, value)`` pairs) in place of the same keys."""
    keys = {key for key, _ in overrides}
    return (*((k, v) for k, v in env_args if k not in keys), *overrides)


@dataclass(frozen=True)
class EnvCfg:
    id: str = "CartPole-v1"
    """A gymnasium id (``CartPole-v1``, ``ALE/Pong-v5``, ``HalfCheetah-v5``, ``MinAtar/Breakout-v1``),
    ``conveyor/StepTime-v0``, or ``MODULE:ID`` for an env of your own (importing ``MODULE`` registers ``ID``)."""
    family: str | None = None
    """The env family whose presets the run takes: classic-discrete, classic-continuous, atari, mujoco, minatar.
    ``RunCfg`` fills it where the id tells it (Atari, MinAtar, conveyor's own and gymnasium's envs; a family that
    contradicts the id is refused); ``conveyor train`` builds an env of your own once to find it
    (``conveyor.envs.gym_api.env_family``: its action space, its entry point's module); in Python, give it for an
    env of your own whose config leaves a preset field unset."""
    num_envs: int | None = None
    """n_e: envs stepped in lockstep (or, in async architectures, envs per actor/worker group)."""
    num_workers: int | None = None
    """n_w: worker processes that step the envs; each owns num_envs / num_workers of them. Preset: up to 2; on
    Atari up to the CPUs this process may use (shared among SEED's local actors); a divisor of num_envs."""
    backend: str = "auto"
    """Vectorized stepping backend: ``shm`` (worker processes over shared memory), ``inproc`` (the envs one after
    another in the process that acts: no round trip, for envs that step in microseconds), ``envpool`` (C++
    threads), ``vector`` (gymnasium's own vectorized env, CartPole's: all envs in a few numpy operations in the
    process that acts; only the vector env's own env_args), or ``auto``: ``vector`` where
    the env has one and the config allows it, else ``inproc`` or ``shm`` from the env's step time measured at the
    start of the run (the choice is printed and recorded in config.json; ``--env-groups`` > 1 needs ``shm``)."""
    env_args: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments passed to the env constructor (``--env-arg KEY=VALUE``)."""
    frame_stack: int = 4
    """Atari: frames stacked into one observation."""
    noop_max: int = 30
    """Atari: up to this many no-op actions after each reset."""
    frame_skip: int = 4
    """Atari: env steps per agent step (max-pooled over the last two frames)."""
    episodic_life: bool = False
    """Atari: treat a lost life as terminal for learning (returns stay per real episode)."""
    clip_rewards: bool = True
    """Atari: clip training rewards to their sign (reported returns are unclipped)."""
    normalize_reward: bool | None = None
    """Scale training rewards by a running std of each env's discounted return (discount: the run's gamma), clipped
    to [-10, 10] (gymnasium ``NormalizeReward``; the ``vector`` backend's own ``RewardScale`` does the same);
    reported returns stay in env units. Not with ``envpool``."""
    max_env_errors: int = 10
    """An env that raises is reset and logged up to this many times per run, then the run stops."""
    max_restarts: int = 10
    """Worker processes (env workers, executors, agents, actors, IMPACT workers) that die are restarted, their
    envs re-seeded, up to this many times per run; one more death stops the run with an error (0: never)."""
    env_step_timeout_s: float = 60.0
    """A worker whose env spends longer than this in one call (make, reset, step), or that does not take up a
    command for this long (stopped, stuck), is killed as hung and restarted like a dead one (0: wait forever)."""

    def __post_init__(self) -> None:
        _typed(self)
        _positive(self, "num_envs", "num_workers", "frame_stack", "frame_skip", "max_env_errors")
        _non_negative(self, "noop_max", "max_restarts", "env_step_timeout_s")
        _at_most(self, MAX_ENVS, "envs of one run", "num_envs")
        _at_most(self, MAX_PROCESSES, "processes of one kind", "num_workers")
        steps = self.kwargs.get("max_episode_steps")  # gymnasium.make's own keyword, not the env's
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0):
            raise ConfigError(f"--env-arg max_episode_steps={json.dumps(steps)} must be a positive integer (the "
                              "steps after which an episode is cut off): pass e.g. max_episode_steps=500")
        _choice("env backend", self.backend, ENV_BACKENDS)
        _choice("env family", self.family, FAMILIES)
        if self.normalize_reward and self.backend == "envpool":
            raise ConfigError("normalize_reward runs in conveyor's own env loop, not in envpool: use --env-backend "
                              "auto, shm, inproc or vector, or drop --normalize-reward")
        if self.num_envs is not None and self.num_workers is not None and self.num_envs % self.num_workers:
            raise ConfigError(
                f"num_envs ({self.num_envs}) is not divisible by num_workers ({self.num_workers}): "
                "choose num_envs as a multiple of num_workers"
            )

    @property
    def envs_per_worker(self) -> int:
        return self.num_envs // self.num_workers

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.env_args)

    def with_env_args(self, overrides: tuple[tuple[str, Any], ...]) -> EnvCfg:
        """These settings with ``overrides`` (``(key, value)`` pairs) in place of the same keys of ``env_args``."""
        return dataclasses.replace(self, env_args=merged_env_args(self.env_args, overrides))

    @property
    def is_atari(self) -> bool:
        return is_atari_id(self.id)

    @property
    def is_minatar(self) -> bool:
        return is_minatar_id(self.id)


@dataclass(frozen=True)
class ModelCfg:
    name: str | None = None
    """Encoder: ``mlp``, ``nips_cnn``, ``nature_cnn``, ``impala_resnet``, ``minatar_cnn``; ``auto`` picks mlp for
    vectors, nature_cnn for images; or your own, ``MODULE:CLASS`` (in Python also the class itself), built as
    ``CLASS(obs_space, **kwargs)`` with an ``out_features`` attribute (README "Your own env and model")."""
    hidden: tuple[int, ...] | None = None
    """MLP hidden layer sizes."""
    lstm_size: int | None = None
    """Width of an LSTM core after the encoder, 0 for none: r2d2 needs one; vtrace (seed, impact) and impact
    may have one, replayed from each unroll's start state; a2c, ppo and ga3c run feed-forward models."""
    normalize_obs: bool | None = None
    """Standardize observations at the model's input by running per-feature mean/std statistics, updated by the
    learner after each update and sent to actors with the weights: float vectors clipped to [-10, 10] (SB3's
    ``VecNormalize``), uint8 frames scaled to [0, 1] first and clipped to [-5, 5] (Sample Factory's
    ``normalize_input``)."""
    normalize_values: bool | None = None
    """The value head predicts returns standardized by running statistics of the value targets, updated once per
    batch before its epochs; the model's values stay in env units, and the value loss is taken in standardized
    units, targets clipped to [-5, 5] (Sample Factory's ``normalize_returns``, rl_games' ``normalize_value``).
    PPO only (the algorithm whose targets are fixed before its update)."""
    separate_value_net: bool | None = None
    """Give the value head its own encoder (same architecture) instead of sharing the policy's; no LSTM core."""
    log_std_init: float | None = None
    """Initial log standard deviation of a Gaussian policy (continuous actions; a learned parameter per action
    dimension, independent of the observation). With ``gsde``, the initial log of every entry of sigma."""
    weight_init: str | None = None
    """How the built-in encoders' and the heads' linear and conv layers start: ``orthogonal`` (gain sqrt 2 in
    the encoder, 0.01 on the policy head, 1 on the value head; zero biases), or ``torch``: PyTorch's default
    (uniform, scaled by fan-in) as SB3 with ``ortho_init=False``. An encoder of your own keeps its own init."""
    gsde: bool | None = None
    """Generalized state-dependent exploration (Raffin et al. 2022; continuous actions only): the policy's std
    depends on the state, std(s)^2 = phi(s)^2 @ sigma^2 with phi(s) the policy trunk's features (no gradient
    into them) and sigma ``[features, A]`` learned; acting adds phi(s) @ W with one matrix W ~ N(0, sigma^2) per
    env, held for ``gsde_interval`` steps of that env, so exploration is smooth in time instead of white noise."""
    gsde_interval: int | None = None
    """With ``gsde``: the env steps each env keeps its noise matrix W before drawing a new one (SB3's
    ``sde_sample_freq``; its on-policy default draws once per rollout)."""

    def __post_init__(self) -> None:
        if callable(self.name):  # a class or factory given in Python: kept as its import path (config.json is JSON)
            object.__setattr__(self, "name", object_ref(self.name, "ModelCfg.name"))
        _typed(self)
        if self.name is not None and is_ref(self.name):
            # Imported where a model is built (make_model), not here: GA3C agents read the config and import no torch.
            check_ref(self.name, f"--model {self.name!r}")
        else:
            _choice("model", self.name, MODELS, " (or MODULE:CLASS, an encoder of your own)")
        _choice("weight_init", self.weight_init, WEIGHT_INITS)
        _positive(self, "gsde_interval")
        if self.hidden is not None and (not self.hidden or any(h <= 0 for h in self.hidden)):
            raise ConfigError(f"hidden sizes must be positive, got {self.hidden}")
        if self.hidden is not None and max(self.hidden) > MAX_WIDTH:
            raise ConfigError(f"hidden sizes must be at most {MAX_WIDTH} (a layer of n units holds n x n weights), "
                              f"got {self.hidden}: pass smaller --hidden sizes")
        _non_negative(self, "lstm_size")
        _at_most(self, MAX_WIDTH, "its weights grow with its square", "lstm_size")
        if self.separate_value_net and self.lstm_size:
            raise ConfigError(f"separate_value_net does not support a recurrent core (lstm_size {self.lstm_size}; "
                              "r2d2 always has one): drop --separate-value-net or set --lstm-size 0")


@dataclass(frozen=True)
class AlgoCfg:
    name: str | None = None
    """Loss: ``a2c``, ``ppo``, ``vtrace``, ``impact``, ``r2d2``, ``ga3c`` (the preset: the architecture's own)."""
    gamma: float | None = None
    """Discount factor."""
    lr: float | None = None
    """Learning rate."""
    lr_schedule: str | None = None
    """``constant``, or ``linear``: the learning rate falls linearly from ``lr`` to 0 at ``total_steps``, set
    after each update from the env steps so far (CleanRL's ``anneal_lr``)."""
    optimizer: str | None = None
    """``rmsprop`` or ``adam``."""
    rmsprop_alpha: float = 0.99
    """RMSProp smoothing constant (PAAC, GA3C)."""
    rmsprop_eps: float | None = None
    """RMSProp epsilon (added outside the square root, as torch does)."""
    adam_eps: float | None = None
    """Adam epsilon."""
    max_grad_norm: float | None = None
    """Global gradient-norm clip, 0 for none."""
    entropy_coef: float | None = None
    """Weight of the entropy bonus."""
    value_coef: float | None = None
    """Weight of the value loss."""
    gae_lambda: float | None = None
    """lambda of GAE (PPO) and of V-trace GAE-lambda (IMPACT)."""
    ppo_epochs: int | None = None
    """PPO: passes over each rollout."""
    ppo_minibatches: int | None = None
    """PPO: minibatches per pass: single steps drawn from all of T x B (feed-forward models), or env columns in
    time order (recurrent ones)."""
    clip: float | None = None
    """PPO / IMPACT surrogate clip epsilon."""
    clip_rho: float = 1.0
    """V-trace rho-bar."""
    clip_c: float = 1.0
    """V-trace c-bar."""
    clip_pg_rho: float = 1.0
    """V-trace clip on the policy-gradient importance weight."""
    impact_rho: float = 2.0
    """IMPACT: worker-ratio bound rho in pi_learner / max(pi_target, pi_worker / rho)."""
    impact_ratio: str = "impact"
    """IMPACT ablation: ``target`` (R1), ``worker`` (R2) or ``impact`` (R3)."""
    kl_coef: float = 0.0
    """IMPACT: weight of the optional KL(target || learner) penalty."""
    ga3c_eps: float = 1e-6
    """GA3C eq. 5: epsilon in log(pi + eps) and in the entropy."""
    n_step: int | None = None
    """R2D2: n of the n-step double-Q target."""
    eta: float = 0.9
    """R2D2: priority mix eta * max|delta| + (1 - eta) * mean|delta|."""
    priority_exponent: float = 0.9
    """R2D2: prioritized-replay exponent alpha."""
    importance_exponent: float = 0.6
    """R2D2: importance-sampling exponent beta."""
    value_rescale_eps: float = 1e-3
    """R2D2: epsilon of the value rescaling h(x)."""
    exploration_eps: float | None = None
    """R2D2: epsilon-greedy exploration of the most exploring env slot; slot i of N acts with
    ``exploration_eps ** (1 + 7 i / (N - 1))``."""
    normalize_advantages: bool | None = None
    """PPO: normalize advantages per minibatch."""

    def __post_init__(self) -> None:
        _typed(self)
        _choice("algo", self.name, ALGOS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("lr schedule", self.lr_schedule, LR_SCHEDULES)
        _choice("impact ratio", self.impact_ratio, IMPACT_RATIOS)
        _unit_interval(self, "gamma", "gae_lambda", "eta", "exploration_eps")
        _non_negative(self, "max_grad_norm", "entropy_coef", "value_coef", "kl_coef")
        _positive(self, "lr", "ppo_epochs", "ppo_minibatches", "clip", "clip_rho", "clip_c", "clip_pg_rho",
                  "impact_rho", "ga3c_eps", "n_step", "adam_eps", "rmsprop_eps")


class _ArchSection:
    """One architecture's (or a shared concern's) slice of ``ArchCfg``: its fields, declared by a frozen dataclass
    that derives from this, and their checks. ``ArchCfg`` derives from every section, so the outside sees one flat
    dataclass (flags, config.json's ``arch.*`` keys); each section validates only what it declares."""

    def check(self: Any) -> None:
        """Refuse bad values of this section's fields (``self`` is the whole ``ArchCfg``), in one line each."""

    def check_in_run(self: Any, cfg: RunCfg) -> None:
        """Refuse what this section's fields cannot do with the rest of ``cfg`` (resolved: no preset field None)."""


@dataclass(frozen=True)
class SharedFields(_ArchSection):
    """Every architecture's: which one runs, and its unroll."""

    name: str = "paac"
    """Architecture: ``paac``, ``ga3c``, ``seed``, ``impact``, ``hts``."""
    unroll: int | None = None
    """t_max: steps per env in one rollout/unroll (SEED: unroll length; IMPACT uses worker_batch)."""

    def check(self: Any) -> None:
        _choice("arch", self.name, ARCHS)
        _positive(self, "unroll")

    def check_in_run(self: Any, cfg: RunCfg) -> None:
        if cfg.algo.name not in ARCH_ALGOS[self.name]:
            raise ConfigError(f"--arch {self.name} does not run --algo {cfg.algo.name}: "
                              f"choose one of {', '.join(ARCH_ALGOS[self.name])}")


@dataclass(frozen=True)
class PaacFields(_ArchSection):
    """PAAC's (``--arch paac``; other architectures ignore them)."""

    env_groups: int | None = None
    """PAAC: groups the env workers are cut into, stepped in turn so that one group's envs step while the policy
    runs on the next group's observations (Sample Factory's double-buffered sampling); 1 steps all at once. The
    actions of a seeded run do not change (docs/design.md "PAAC env groups"). Must divide num_workers."""

    def check(self: Any) -> None:
        _positive(self, "env_groups")

    def check_in_run(self: Any, cfg: RunCfg) -> None:
        if self.name == "paac" and self.env_groups > 1:  # other architectures ignore it
            if cfg.env.backend not in ("shm", "auto"):
                raise ConfigError(f"--env-groups {self.env_groups} steps groups of the shm backend's worker "
                                  "processes: pass --env-groups 1 or --env-backend shm")
            if cfg.env.num_workers % self.env_groups:
                raise ConfigError(f"--env-groups {self.env_groups} must divide --num-workers "
                                  f"{cfg.env.num_workers} (each group steps whole workers): pass a divisor of it")


@dataclass(frozen=True)
class HtsFields(_ArchSection):
    """HTS-RL's (``--arch hts``)."""

    num_actors: int = 1
    """HTS: actor threads that batch whatever observations are waiting."""
    sync_interval: int | None = None
    """HTS alpha: steps per env between storage swaps (one update per swap)."""

    def check(self: Any) -> None:
        _positive(self, "num_actors", "sync_interval")
        _at_most(self, MAX_PROCESSES, "processes or threads of one kind", "num_actors")


@dataclass(frozen=True)
class Ga3cFields(_ArchSection):
    """GA3C's (``--arch ga3c``)."""

    num_agents: int | None = None
    """GA3C N_A: agent processes (each owns one env)."""
    num_predictors: int = 1
    """GA3C N_P: predictor threads."""
    num_trainers: int = 1
    """GA3C N_T: trainer threads."""
    min_train_batch: int | None = None
    """GA3C: trainers group experiences until this many t_max segments."""
    max_predict_batch: int = 128
    """GA3C: most requests one predictor batches."""
    autotune: bool = False
    """GA3C: adjust N_P, N_T, N_A at run time to maximise TPS."""
    autotune_interval: float = 10.0
    """GA3C: seconds between autotune decisions."""

    def check(self: Any) -> None:
        _positive(self, "num_agents", "num_predictors", "num_trainers", "min_train_batch", "max_predict_batch",
                  "autotune_interval")
        _at_most(self, MAX_PROCESSES, "processes or threads of one kind", "num_agents", "num_predictors",
                 "num_trainers")


@dataclass(frozen=True)
class SeedFields(_ArchSection):
    """SEED RL's inference server and its actors (``--arch seed``)."""

    inference_batch: int = 32
    """SEED: most requests in one batched forward."""
    inference_timeout_ms: float = 2.0
    """SEED: longest wait for a fuller inference batch."""
    local_actors: int = 2
    """SEED: actor processes started by ``conveyor train`` itself; 0 waits for ``conveyor actor`` processes."""
    listen: str = "localhost:0"
    """SEED: server address (host:port, port 0 picks one; or unix:PATH)."""
    token_file: str = ""
    """SEED: file holding the actor token (else CONVEYOR_TOKEN; else a random one for local actors)."""
    tls_cert: str = ""
    """SEED: PEM certificate for TLS (with tls_key)."""
    tls_key: str = ""
    """SEED: PEM private key for TLS (with tls_cert)."""
    max_message_bytes: int = 16 * 1024 * 1024
    """SEED: largest accepted gRPC message."""
    max_actor_envs: int = 256
    """SEED: most env slots one actor (one stream) may take; an actor asking for more is refused."""
    actor_idle_timeout_s: float = 30.0
    """SEED: seconds the learner waits for an actor's Hello or next step before it ends the stream and frees its
    env slots (a live actor reconnects)."""

    def check(self: Any) -> None:
        _positive(self, "inference_batch", "inference_timeout_ms", "max_message_bytes", "max_actor_envs",
                  "actor_idle_timeout_s")
        _non_negative(self, "local_actors")
        _at_most(self, MAX_PROCESSES, "processes or threads of one kind", "local_actors")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if self.name == "seed" and self.launcher == "ray" and not self.local_actors:
            raise ConfigError("--launcher ray starts the run's actors as Ray actors: pass --local-actors N > 0 "
                              "(actors you start yourself need no launcher)")

    def check_in_run(self: Any, cfg: RunCfg) -> None:
        if self.name == "seed" and self.local_actors and cfg.env.num_envs > self.max_actor_envs:
            raise ConfigError(f"local actors with --num-envs {cfg.env.num_envs} would be refused by "
                              f"--max-actor-envs {self.max_actor_envs}: raise --max-actor-envs or lower --num-envs")


@dataclass(frozen=True)
class LauncherFields(_ArchSection):
    """Where SEED's actors and IMPACT's workers run (``--arch seed``, ``--arch impact``)."""

    launcher: str = "process"
    """SEED actors and IMPACT workers: ``process`` (child processes of this run) or ``ray`` (Ray actors, on this
    host or a cluster's nodes; needs ``pip install 'conveyor[ray]'``)."""
    ray_address: str = "local"
    """``--launcher ray``: ``local`` starts a one-node Ray for this run, bound to loopback; ``auto`` joins the
    cluster ``ray start`` made on this host; ``HOST:PORT`` joins the cluster whose head listens there."""
    ray_strategy: str = "spread"
    """``--launcher ray``: how actors spread over nodes (Ray placement-group strategies): ``pack`` fills nodes
    in turn, ``spread`` spreads where it can, ``strict_spread`` needs a node per actor."""

    def check(self: Any) -> None:
        _choice("launcher", self.launcher, LAUNCHERS)
        _choice("ray_strategy", self.ray_strategy, RAY_STRATEGIES)
        if self.launcher == "ray" and self.name in ("paac", "hts"):
            raise ConfigError(f"--arch {self.name} steps its envs beside one learner; --launcher ray places SEED "
                              "actors and IMPACT workers: to spread paac or hts over machines run data-parallel "
                              "learners with `torchrun --nproc_per_node N -m conveyor train ...`")
        if self.launcher == "ray" and self.name == "ga3c":
            raise ConfigError("--arch ga3c runs its agents beside the predictors in one process; --launcher ray "
                              "places actors for --arch seed (central batched inference, GA3C's design over a "
                              "network) or IMPACT workers: use --arch seed")


@dataclass(frozen=True)
class SeedLearnerFields(_ArchSection):
    """SEED's learner: its batches (V-trace and R2D2) and, with ``--algo r2d2`` (which runs under ``--arch seed``),
    its sequences and prioritized replay."""

    batch_size: int | None = None
    """Learner batch size in unrolls/sequences (SEED, R2D2)."""
    seq_len: int | None = None
    """R2D2: stored sequence length (including burn-in)."""
    burn_in: int | None = None
    """R2D2: leading steps of each sequence that only warm the LSTM state."""
    replay_bytes: int = 2 * 1024**3
    """R2D2: replay memory budget in bytes, checked at start."""
    replay_capacity: int | None = None
    """R2D2: env steps held in replay (each frame is stored once; about ``seq_len / 2`` steps per sequence)."""
    min_replay: int | None = None
    """R2D2: sequences stored before learning starts."""
    replay_ratio: float | None = None
    """R2D2: sequences sampled per sequence inserted (with sequences overlapping by half, each step is replayed twice
    that often). The learner waits for new data and the actors for the learner; 0 lets both run free."""
    checkpoint_replay: bool = True
    """R2D2: write the replay (frames zlib-compressed) and its sampler state into checkpoints, so ``--resume``
    goes on learning without refilling it; ``--no-checkpoint-replay`` for replays too big to write each time."""

    def check(self: Any) -> None:
        _positive(self, "batch_size", "seq_len", "replay_bytes", "replay_capacity", "min_replay")
        _non_negative(self, "burn_in", "replay_ratio")
        if self.burn_in is not None and self.seq_len is not None and self.burn_in >= self.seq_len:
            raise ConfigError(f"burn_in ({self.burn_in}) must be smaller than seq_len ({self.seq_len}): lower "
                              "--burn-in or raise --seq-len")


@dataclass(frozen=True)
class ImpactFields(_ArchSection):
    """IMPACT's (``--arch impact``): its workers' batches, the circular buffer, the target network, the paper's
    comparison presets."""

    worker_batch: int | None = None
    """IMPACT: steps per env in one worker batch (S)."""
    buffer_batches: int | None = None
    """IMPACT: N, batches in the circular buffer."""
    replay_times: int | None = None
    """IMPACT: K, times each batch is used before replacement."""
    broadcast_interval: int = 1
    """IMPACT: learner updates between weight broadcasts to workers."""
    use_target_network: bool | None = None
    """IMPACT: attach target-network log-probs; off with K=1 gives APPO."""
    preset: str = ""
    """IMPACT comparison preset: ``impact``, ``appo`` (K=1, no target network) or ``impala`` (same, algo vtrace)."""

    def check(self: Any) -> None:
        _choice("preset", self.preset or None, tuple(IMPACT_PRESETS))
        if self.preset and self.name != "impact":
            raise ConfigError(f"--preset {self.preset} is an IMPACT comparison preset: use it with --arch impact")
        _positive(self, "worker_batch", "buffer_batches", "replay_times", "broadcast_interval")

    def check_in_run(self: Any, cfg: RunCfg) -> None:
        if self.name == "impact" and cfg.algo.kl_coef > 0 and not self.use_target_network:
            raise ConfigError("--kl-coef penalises KL(target || learner) and needs the target network: "
                              "drop --no-use-target-network or set --kl-coef 0")


@dataclass(frozen=True)
class TargetNetworkFields(_ArchSection):
    """A target network's, shared by IMPACT and R2D2."""

    target_update: int | None = None
    """Updates between target-network syncs (IMPACT, R2D2)."""

    def check(self: Any) -> None:
        _positive(self, "target_update")


# The sections in field order: a dataclass lists its last base's fields first, so ArchCfg names them backwards.
@dataclass(frozen=True)
class ArchCfg(TargetNetworkFields, ImpactFields, SeedLearnerFields, LauncherFields, SeedFields, Ga3cFields,
              HtsFields, PaacFields, SharedFields):
    """The architecture's settings: one flat dataclass (flags ``--num-agents``, config.json keys ``arch.*``) made
    of the sections ``ARCH_SECTIONS``, each declaring and checking its own fields."""

    def __post_init__(self) -> None:
        _typed(self)
        self.check()

    def check(self) -> None:
        """Every section's ``check``, in field order."""
        for section in ARCH_SECTIONS:
            section.check(self)

    def check_in_run(self, cfg: RunCfg) -> None:
        """Every section's ``check_in_run`` (``RunCfg.__post_init__`` calls it once the presets are filled in)."""
        for section in ARCH_SECTIONS:
            section.check_in_run(self, cfg)


ARCH_SECTIONS: tuple[type[_ArchSection], ...] = tuple(reversed(ArchCfg.__bases__))
"""``ArchCfg``'s sections, in field order."""


@dataclass(frozen=True)
class RunCfg:
    env: EnvCfg = field(default_factory=EnvCfg)
    """Environment settings."""
    model: ModelCfg = field(default_factory=ModelCfg)
    """Network settings."""
    algo: AlgoCfg = field(default_factory=AlgoCfg)
    """Loss and optimizer settings."""
    arch: ArchCfg = field(default_factory=ArchCfg)
    """Architecture settings."""
    total_steps: int | None = None
    """Env steps (summed over envs) after which training stops."""
    target_return: float | None = None
    """Stop early once the mean return of the last 100 episodes reaches this; None uses the env's registered
    reward_threshold (CartPole-v1: 475) where it has one; ``inf`` never stops early."""
    time_limit_s: float = 0.0
    """Stop after this many seconds of wall time; 0 means no limit."""
    seed: int = 0
    """Seed of every generator (envs, parameters, action sampling)."""
    out: str = ""
    """Output directory; empty means runs/<arch>-<algo>-<env>-<seed>-<time>."""
    resume: str = ""
    """Directory of an earlier run whose latest checkpoint to continue."""
    device: str | None = None
    """Torch device for the learner (``cpu``, ``cuda``, ``cuda:1``). Preset: ``cuda`` on Atari where torch sees a
    GPU, else ``cpu`` (the MLPs of the other families run faster on the CPU)."""
    log_interval_s: float = 2.0
    """Seconds between metrics.csv rows and console updates."""
    checkpoint_every: int = 0
    """Env steps between checkpoints; 0 writes only the final one."""
    keep_checkpoints: int = 10
    """Periodic checkpoints kept on disk (evaluation uses the last 10)."""
    progress: bool = True
    """Show the console progress line."""
    torch_threads: int = 0
    """Intra-op threads of the learner's torch; 0 picks them by model and architecture (``learner_threads``)."""
    wandb: str = ""
    """Weights & Biases project to log the metrics rows, the config and the videos to; empty: off.
    Needs ``pip install 'conveyor[wandb]'``; with ``WANDB_MODE=offline`` it logs without a network."""
    wandb_entity: str = ""
    """With ``--wandb``: the W&B user or team that owns the project; empty: your default entity."""
    wandb_group: str = ""
    """With ``--wandb``: the W&B group of the run (e.g. the seeds of one setting); empty: none."""
    wandb_name: str = ""
    """With ``--wandb``: the W&B run's display name; empty: the output directory's name."""
    capture_video_every: int = 0
    """Env steps between evaluation episodes recorded during training; 0: off.
    Each is ``conveyor enjoy`` of the checkpoint written there, into ``videos/step-<steps>.mp4`` (and W&B)."""

    def __post_init__(self) -> None:
        _typed(self)
        told = presets.id_family(self.env.id, self.env.env_args)
        if self.env.family is None and told is not None:  # frozen: set during construction only
            object.__setattr__(self, "env", dataclasses.replace(self.env, family=told))
        elif told not in (None, self.env.family):
            raise ConfigError(f"env {self.env.id!r} is of family {told}, not {self.env.family}: drop --env-family")
        resolved = presets.resolve(self, self.env.family)
        for name, value in resolved.fields.items():  # frozen: set during construction only
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_preset_sources", resolved.sources)
        _positive(self, "total_steps", "log_interval_s", "keep_checkpoints")
        _non_negative(self, "time_limit_s", "checkpoint_every", "seed", "torch_threads", "capture_video_every")
        check_seeds(self.seed)
        if self.algo.name == "r2d2" and not self.model.lstm_size:
            raise ConfigError("--algo r2d2 runs a recurrent Q network: pass --lstm-size > 0 (or leave it to the "
                              "preset)")
        if self.algo.name not in RECURRENT_ALGOS and self.model.lstm_size:
            # PAAC, HTS and GA3C act step by step without carrying a core's state (SEED's inference and IMPACT's
            # workers carry it per env), so a recurrent model there would learn from unrolls it never acted with.
            raise ConfigError(f"--algo {self.algo.name} runs feed-forward models (a recurrent core runs with "
                              "--algo vtrace under --arch seed or impact, --algo impact, --algo r2d2): "
                              "drop --lstm-size")
        if self.model.normalize_values and self.algo.name != "ppo":
            raise ConfigError("--normalize-values standardizes value targets fixed before the update, PPO's, not "
                              f"those of --algo {self.algo.name}: drop --normalize-values or use --algo ppo")
        self.arch.check_in_run(self)
        if not (self.device == "cpu" or self.device.startswith("cuda") or self.device == "mps"):
            raise ConfigError(f"unknown device {self.device!r}: use cpu, cuda or cuda:N")

    @property
    def preset_sources(self) -> dict[str, str]:
        """``section.field`` -> the preset layer that filled it (``conveyor presets`` names the layers), for every
        field this config took from the preset; a config rebuilt from resolved values (``from_dict``,
        ``dataclasses.replace``) holds them explicitly and has none."""
        return dict(self._preset_sources)  # type: ignore[attr-defined]

    @property
    def small_model(self) -> bool:
        """Whether the model is one of the small ones, ``mlp`` and ``minatar_cnn``, whose forward and backward cost
        PyTorch's fixed per-op overhead more than arithmetic (``learner_threads``; PAAC A2C runs its learner's own
        forward rather than backpropagating through the acting ones). An encoder of your own (``MODULE:CLASS``)
        counts as ``auto``'s pick: ``nature_cnn`` for Atari frames, ``mlp`` for vectors."""
        model = self.model.name
        if model == "auto" or is_ref(model):
            model = "nature_cnn" if self.env.is_atari else "mlp"
        return model in ("mlp", "minatar_cnn")

    @property
    def learner_threads(self) -> int:
        """``torch_threads``, else: one for the small models (``small_model``: their matmuls are too small to
        split; a second OpenMP thread spinning beside busy env workers made the default CartPole job 2.7x slower
        on a loaded 2-core machine); for the larger CNNs every core for paac (its env workers idle while the
        learner computes) and half the cores for the asynchronous architectures (envs step while the learner
        computes; oversubscribed OpenMP threads spin, measured 8x slower Nature-CNN forwards)."""
        if self.torch_threads:
            return self.torch_threads
        if self.small_model:
            return 1
        cores = os.cpu_count() or 1
        return cores if self.arch.name == "paac" else max(1, cores // 2)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, recorded: dict[str, Any] | None = None) -> str:
        """config.json's text: the fields, and ``recorded``, facts of the run's start kept beside them
        (``ENV_BACKEND_CHOICE``), which ``from_dict`` passes over."""
        return json.dumps({**self.to_dict(), **(recorded or {})}, indent=2, sort_keys=True, default=str)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunCfg":
        """Rebuild a config written by ``to_dict`` (tuples come back from JSON lists); an unknown field is a
        ConfigError."""
        parts = {"env": EnvCfg, "model": ModelCfg, "algo": AlgoCfg, "arch": ArchCfg}
        data = {key: value for key, value in data.items() if key != ENV_BACKEND_CHOICE}
        _known(cls, data, "")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in parts:
                sub = dict(value)
                _known(parts[key], sub, f"{key}.")
                if isinstance(sub.get("env_args"), list) and all(isinstance(kv, list) for kv in sub["env_args"]):
                    sub["env_args"] = tuple(tuple(kv) for kv in sub["env_args"])
                if isinstance(sub.get("hidden"), list):
                    sub["hidden"] = tuple(sub["hidden"])
                kwargs[key] = parts[key](**sub)
            else:
                kwargs[key] = value
        return cls(**kwargs)


def _known(cls: type, data: dict[str, Any], prefix: str) -> None:
    unknown = sorted(set(data) - {fld.name for fld in dataclasses.fields(cls)})
    if unknown:
        raise ConfigError(f"unknown config field {', '.join(prefix + name for name in unknown)}: remove it from "
                          "config.json")


def flat_fields(cfg: RunCfg) -> dict[str, Any]:
    """Every field of ``cfg`` as ``section.field`` (a ``RunCfg`` field: its own name) -> value, in field order."""
    out: dict[str, Any] = {}
    for fld in dataclasses.fields(cfg):
        value = getattr(cfg, fld.name)
        if dataclasses.is_dataclass(value):
            out.update((f"{fld.name}.{sub.name}", getattr(value, sub.name)) for sub in dataclasses.fields(value))
        else:
            out[fld.name] = value
    return out


RESUME_MAY_CHANGE = frozenset({
    # when it stops
    "total_steps", "target_return", "time_limit_s",
    # where it runs: another machine, more or fewer workers, other ports (which process steps an env changes
    # nothing of its seed, its history or the sampler's draws)
    "device", "torch_threads", "env.num_workers", "env.backend", "arch.env_groups", "arch.num_actors",
    "arch.num_predictors", "arch.num_trainers", "arch.max_predict_batch", "arch.inference_batch",
    "arch.inference_timeout_ms", "arch.local_actors", "arch.listen", "arch.token_file", "arch.tls_cert",
    "arch.tls_key", "arch.max_message_bytes", "arch.max_actor_envs", "arch.actor_idle_timeout_s", "arch.launcher",
    "arch.ray_address", "arch.ray_strategy", "arch.replay_bytes", "arch.checkpoint_replay",
    # faults: the limits, and env keywords (a fault to inject, a longer episode); an env whose spaces they change
    # no longer fits the checkpoint, one that no longer replays its history is refused at replay
    "env.max_env_errors", "env.max_restarts", "env.env_step_timeout_s", "env.env_args",
    # output
    "out", "resume", "log_interval_s", "checkpoint_every", "keep_checkpoints", "progress", "wandb", "wandb_entity",
    "wandb_group", "wandb_name", "capture_video_every",
    # the learning rate, set on the restored optimizer (which would otherwise keep the checkpoint's)
    "algo.lr",
})
"""The fields (``flat_fields`` keys) that ``--resume DIR`` may set to other values than the run's config.json
records. Every other one is the run: its envs (id, number, wrappers), model, algorithm and its other
hyperparameters, the architecture's batches, the seed; a checkpoint holds state shaped by them, so a change is
refused (``check_resume``) before the resumed run writes anything."""


def flag_value(value: Any) -> str:
    """A field's value as its flag takes it: ``--hidden 64,64`` (a tuple, or the list JSON makes of it)."""
    if isinstance(value, (tuple, list)) and value and all(isinstance(item, int) for item in value):
        return ",".join(map(str, value))
    return str(value)


def check_resume_change(key: str, recorded: Any, value: Any, run_dir: str) -> None:
    """Refuse field ``key`` (``section.field``) set to ``value`` where the run in ``run_dir`` recorded ``recorded``,
    unless ``RESUME_MAY_CHANGE`` holds it: one line naming the flag and the recorded value."""
    if key in RESUME_MAY_CHANGE or value == recorded:
        return
    section, _, name = key.rpartition(".")
    flag = flag_name(section or None, name)
    raise ConfigError(f"--resume {run_dir}: that run was trained with {flag} {flag_value(recorded)} (its "
                      f"config.json), and {flag} cannot change on resume (got {flag_value(value)}): drop it, or "
                      "start a new run with --out (a resume may change when it stops, where it runs, its outputs "
                      "and --lr)")


def check_resume(recorded: RunCfg, cfg: RunCfg) -> None:
    """Refuse (``check_resume_change``) the first field where ``cfg``, resuming a run, leaves what that run's
    config, ``recorded``, holds and ``RESUME_MAY_CHANGE`` does not allow it."""
    before = flat_fields(recorded)
    for key, value in flat_fields(cfg).items():
        check_resume_change(key, before[key], value, cfg.resume)


def recorded_config(run_dir: Path | str) -> RunCfg:
    """The config of the run in ``run_dir``, from its ``config.json``; a ConfigError when there is none or it is
    broken."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.json there; pass the --out DIR of an earlier run")
    return RunCfg.from_dict(read_config_file(path))


ADDED_FIELDS: dict[str, dict[str, Any]] = {"model": {"weight_init": "orthogonal", "gsde": False}}
"""What a run whose ``config.json`` predates a field ran with (``read_config_file`` fills them in): such a run
resumes and loads as it was trained, whatever the presets pick today."""


def read_toml_file(flag: str, path: Path | str) -> dict[str, Any]:
    """The TOML file at ``path``, given as ``flag`` (``--config``, ``--space``); one that cannot be read or is not
    TOML is a one-line ``ConfigError``."""
    import tomllib  # here: every `conveyor` command imports this module, few read a TOML file

    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise ConfigError(f"{flag} {path}: cannot read it ({reason}): pass a readable TOML file") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{flag} {path} is not TOML ({error}): fix the file") from None


def read_config_file(path: Path | str) -> dict[str, Any]:
    """A run's ``config.json`` as ``RunCfg.from_dict`` takes it, with the ``ADDED_FIELDS`` it predates; a
    ConfigError names what is wrong with the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path} is not a readable JSON file ({error}): restore it, or start a new run") from None
    sections = ("env", "model", "algo", "arch")
    if not isinstance(data, dict) or not all(isinstance(data.get(name, {}), dict) for name in sections):
        raise ConfigError(f"{path} is not a conveyor config (a JSON object with the sections "
                          f"{', '.join(sections)}): restore it, or start a new run")
    for section, fields in ADDED_FIELDS.items():
        data[section] = {**fields, **data.get(section, {})}
    return data


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (for --help and the docs), those of the classes it
    derives from (``ArchCfg``'s sections) included."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_module_field_docs(klass.__module__).get(klass.__qualname__, {}))
    return docs


@functools.lru_cache(maxsize=None)
def _module_field_docs(module: str) -> dict[str, dict[str, str]]:
    """Per class of ``module`` (its source parsed once: ``inspect.getsource`` per class took a tenth of a
    second of every ``conveyor`` command's start), the docstring under each annotated field."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return {}
    with open(spec.origin, encoding="utf-8") as file:
        tree = ast.parse(file.read())
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            fields = docs[node.name] = {}
            for field, nxt in zip(node.body, node.body[1:]):
                if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                        and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                    fields[field.target.id] = str(nxt.value.value)
    return docs
