"""stable-baselines3 with rl-baselines3-zoo's tuned hyperparameters: a contender of the race (``race.py``).

``zoo_recipe(algo, env_id)`` reads rl-zoo's ``hyperparams/{a2c,ppo,dqn}.yml``
from the installed ``rl_zoo3`` package's data (found through its
distribution metadata: ``rl_zoo3`` is installed with ``--no-deps`` and never
imported, see docs/benchmarks.md) and translates the env's entry into SB3
constructor arguments, as rl-zoo's ``ExperimentManager`` does: ``n_envs``
envs, ``n_timesteps`` as ``learn``'s total (what its ``lin_`` schedules
anneal over), ``lin_X`` as a schedule from X down to 0, ``policy_kwargs``
strings evaluated (a small evaluator that knows ``dict``, ``nn.*`` and
``RMSpropTFLike`` only), ``normalize`` as ``VecNormalize`` (with the
algorithm's gamma, as rl-zoo passes it), ``env_wrapper`` and ``frame_stack``
as rl-zoo applies them. An env without an entry of its own takes the
``atari`` entry on ALE ids (as rl-zoo does) and on MinAtar ids (no recipe of
their own anywhere); the recipe's ``notes`` say what had to change there.

``run_zoo`` trains such a recipe in a race run's child: it records each
finished episode (the ``Monitor`` return, before any normalization or
clipping) in conveyor's telemetry, so the run writes ``summary.json`` and
``returns.csv`` like a conveyor run, and stops as soon as the mean of the
last 100 episodes reaches the race's threshold, or at its step or time cap.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.bench.suites import PeerUnavailable, RaceGoal
from conveyor.presets import is_atari_id, is_minatar_id

ZOO_ALGOS = ("a2c", "ppo", "dqn")
ZOO_DISTRIBUTION = "rl_zoo3"
SCHEDULE_KEYS = ("learning_rate", "clip_range", "clip_range_vf")
# rl-zoo keys that configure the experiment rather than the SB3 model.
EXPERIMENT_KEYS = ("n_envs", "n_timesteps", "policy", "normalize", "env_wrapper", "frame_stack")
# rl-zoo keys this translation does not handle (none of the race's entries has them): refused, not dropped.
UNHANDLED_KEYS = ("callback", "vec_env_wrapper", "env_kwargs", "monitor_kwargs", "replay_buffer_class",
                  "replay_buffer_kwargs", "noise_type", "noise_std")
NOT_INSTALLED = "rl_zoo3 is not installed (make bench-deps: pip install --no-deps rl_zoo3, see docs/benchmarks.md)"
SB3_NOT_INSTALLED = "stable-baselines3 is not installed (make bench-deps)"


def zoo_version() -> str | None:
    """The installed rl_zoo3's version, None when it is not installed."""
    try:
        return importlib.metadata.version(ZOO_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def zoo_file(algo: str) -> Path:
    """rl-zoo's ``hyperparams/<algo>.yml`` in the installed package; ``PeerUnavailable`` without rl_zoo3."""
    try:
        distribution = importlib.metadata.distribution(ZOO_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise PeerUnavailable(NOT_INSTALLED) from None
    path = Path(str(distribution.locate_file(f"rl_zoo3/hyperparams/{algo}.yml")))
    if not path.is_file():
        raise PeerUnavailable(f"rl_zoo3 {distribution.version} has no hyperparams/{algo}.yml")
    return path


@functools.cache
def _read_table(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text())


def zoo_entry(algo: str, env_id: str, path: Path | None = None) -> tuple[str, dict[str, Any]] | None:
    """``(key, hyperparameters)`` of rl-zoo's entry for ``env_id`` in ``<algo>.yml`` (or the file at ``path``):
    the env's own, else ``atari`` for ALE and MinAtar ids; None when there is none."""
    table = _read_table(path or zoo_file(algo))
    if env_id in table:
        return env_id, dict(table[env_id])
    if (is_atari_id(env_id) or is_minatar_id(env_id)) and "atari" in table:
        return "atari", dict(table["atari"])
    return None


@dataclass(frozen=True)
class LinearSchedule:
    """rl-zoo's ``lin_X``: X times SB3's ``progress_remaining`` (1 at the start, 0 at ``n_timesteps``)."""

    initial: float

    def __call__(self, progress_remaining: float) -> float:
        return progress_remaining * self.initial


@dataclass(frozen=True)
class ZooRecipe:
    """An rl-zoo entry as SB3 arguments: ``model_class(policy, venv, **kwargs)`` on ``n_envs`` envs,
    ``learn(n_timesteps)``; the venv wrapped in ``VecNormalize(**normalize)`` when that is not None."""

    algo: str
    env_id: str
    key: str
    n_envs: int
    n_timesteps: int
    policy: str
    kwargs: dict[str, Any]
    normalize: dict[str, Any] | None = None
    env_wrapper: Any = None
    frame_stack: int | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def source(self) -> str:
        """Where the settings come from, for the race's table."""
        entry = "its own entry" if self.key == self.env_id else f"the `{self.key}` entry"
        text = f"rl-zoo {zoo_version() or '?'} {self.algo}.yml, {entry}"
        return text + (f" ({'; '.join(self.notes)})" if self.notes else "")


# ---- policy_kwargs and normalize strings ------------------------------------------------------------
def _namespace(name: str) -> Any:
    """What a name in an rl-zoo kwargs string stands for (imported on first use)."""
    if name in ("nn", "th"):
        import torch

        return torch.nn if name == "nn" else torch
    if name == "RMSpropTFLike":
        from stable_baselines3.common.sb2_compat.rmsprop_tf_like import RMSpropTFLike

        return RMSpropTFLike
    raise ValueError(f"rl-zoo kwargs name {name!r} is unknown to this translation")


def eval_kwargs(text: str) -> Any:
    """An rl-zoo kwargs string (``"dict(net_arch=[256, 256], activation_fn=nn.ReLU)"``) as a value: literals,
    lists, tuples, dicts, ``dict(...)`` calls and the names of ``_namespace``; nothing else is evaluated."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [value(item) for item in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if isinstance(node, ast.Dict):
            return {value(k): value(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
            return {keyword.arg: value(keyword.value) for keyword in node.keywords}
        if isinstance(node, ast.Name):
            return _namespace(node.id)
        if isinstance(node, ast.Attribute):
            return getattr(value(node.value), node.attr)
        raise ValueError(f"rl-zoo kwargs {text!r}: cannot evaluate {ast.dump(node)}")

    return value(ast.parse(text, mode="eval").body)


def _schedule(value: Any) -> Any:
    if isinstance(value, str):
        kind, _, initial = value.partition("_")
        if kind != "lin":
            raise ValueError(f"rl-zoo schedule {value!r}: only lin_X is known")
        return LinearSchedule(float(initial))
    return float(value)  # rl-zoo's ConstantSchedule (negative values: left to SB3, e.g. no clipping)


def translate(algo: str, env_id: str, key: str, entry: dict[str, Any]) -> ZooRecipe:
    """rl-zoo's hyperparameters ``entry`` (the ``key`` entry of ``<algo>.yml``) for ``env_id`` as a ``ZooRecipe``."""
    hyper = dict(entry)
    unhandled = sorted(set(hyper) & set(UNHANDLED_KEYS))
    if unhandled:
        raise ValueError(f"rl-zoo {algo}.yml {key}: keys {unhandled} are not translated")
    n_envs = int(hyper.pop("n_envs", 1))
    n_timesteps = int(float(hyper.pop("n_timesteps")))
    policy = str(hyper.pop("policy"))
    normalize: dict[str, Any] | None = None
    raw = hyper.pop("normalize", False)
    if isinstance(raw, str):
        raw = eval_kwargs(raw)
    if raw:
        normalize = dict(raw) if isinstance(raw, dict) else {}
        if "gamma" in hyper:  # rl-zoo normalizes returns with the algorithm's discount
            normalize["gamma"] = hyper["gamma"]
    env_wrapper = hyper.pop("env_wrapper", None)
    frame_stack = hyper.pop("frame_stack", None)
    for name in SCHEDULE_KEYS:
        if name in hyper:
            hyper[name] = _schedule(hyper[name])
    if isinstance(hyper.get("policy_kwargs"), str):
        hyper["policy_kwargs"] = eval_kwargs(hyper["policy_kwargs"])
    if isinstance(hyper.get("train_freq"), list):
        hyper["train_freq"] = tuple(hyper["train_freq"])
    notes: list[str] = []
    if is_minatar_id(env_id) and key == "atari":
        # MinAtar states are 10x10xC: ALE's frame preprocessing does not apply, and NatureCNN needs >= 36x36.
        notes.append("MinAtar has no rl-zoo entry: the atari entry's hyperparameters without its AtariWrapper "
                     f"and frame stack, {policy} replaced by MlpPolicy (NatureCNN needs frames of 36x36 or more)")
        env_wrapper, frame_stack, policy = None, None, "MlpPolicy"
    elif env_id.startswith("ALE/") and key == "atari":
        notes.append(f"{env_id} made with frameskip=1 so that AtariWrapper's skip of 4 is the only one, sticky "
                     "actions kept as conveyor trains")
    return ZooRecipe(algo, env_id, key, n_envs, n_timesteps, policy, hyper, normalize, env_wrapper, frame_stack,
                     tuple(notes))


def zoo_recipe(algo: str, env_id: str) -> ZooRecipe | None:
    """The race's SB3 settings for ``algo`` on ``env_id`` from the installed rl-zoo; None when it has none."""
    found = zoo_entry(algo, env_id)
    return None if found is None else translate(algo, env_id, *found)


# ---- the child side --------------------------------------------------------------------------------
def _import_path(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _wrapper_class(spec: Any) -> Any:
    """rl-zoo's ``env_wrapper``: a dotted class name, ``{name: kwargs}``, or a list of those applied in order."""
    if spec is None:
        return None
    specs = spec if isinstance(spec, list) else [spec]
    wrappers = []
    for item in specs:
        name, kwargs = (next(iter(item.items())) if isinstance(item, dict) else (item, None))
        wrappers.append((_import_path(name), kwargs or {}))

    def wrap(env: Any) -> Any:
        for cls, kwargs in wrappers:
            env = cls(env, **kwargs)
        return env

    return wrap


def make_gym_env(env_id: str, render_mode: str | None = None) -> Any:
    """``env_id`` as gymnasium makes it, as rl-zoo would (ALE ids with frameskip=1, see ``translate``)."""
    import gymnasium as gym

    if is_minatar_id(env_id):
        from conveyor.envs.minatar import register_minatar

        register_minatar()
        return gym.make(env_id, render_mode=render_mode)
    if is_atari_id(env_id):
        import ale_py

        gym.register_envs(ale_py)
        return gym.make(env_id, render_mode=render_mode, **({"frameskip": 1} if env_id.startswith("ALE/") else {}))
    return gym.make(env_id, render_mode=render_mode)


def make_zoo_venv(recipe: ZooRecipe, seed: int) -> Any:
    """The recipe's vector env: rl-zoo's ``create_envs`` (``make_vec_env`` with ``Monitor`` below the wrapper,
    ``DummyVecEnv``, then ``VecNormalize``, ``VecFrameStack`` and ``VecTransposeImage`` where they apply)."""
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.preprocessing import is_image_space, is_image_space_channels_first
    from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack, VecNormalize, VecTransposeImage

    venv = make_vec_env(lambda: make_gym_env(recipe.env_id), n_envs=recipe.n_envs, seed=seed,
                        wrapper_class=_wrapper_class(recipe.env_wrapper), vec_env_cls=DummyVecEnv)
    if recipe.normalize is not None:
        venv = VecNormalize(venv, **recipe.normalize)
    if recipe.frame_stack:
        venv = VecFrameStack(venv, recipe.frame_stack)
    space = venv.observation_space
    if is_image_space(space) and not is_image_space_channels_first(space):
        venv = VecTransposeImage(venv)
    return venv


def run_zoo(algo: str, cfg: Any, run_dir: Path, goal: RaceGoal, spawned_unix: float) -> dict[str, Any]:
    """Train rl-zoo's ``algo`` recipe for ``cfg.env.id`` with ``cfg.seed`` until the race's goal or a cap; writes
    the race's clock, summary.json and returns.csv into ``run_dir``; returns the summary. SB3 and torch keep
    their defaults (torch's thread count too, as rl-zoo's ``train.py`` without ``--num-threads``)."""
    import numpy as np

    try:
        import stable_baselines3 as sb3
        from stable_baselines3.common.callbacks import BaseCallback
    except ImportError:
        raise PeerUnavailable(SB3_NOT_INSTALLED) from None
    from conveyor.bench.report import TARGET_STOP, TIME_STOP
    from conveyor.bench.suites import RACE_WINDOW as WINDOW
    from conveyor.bench.suites import write_race_clock as write_clock
    from conveyor.procs import SignalRelay
    from conveyor.run import STOP_SIGNALS
    from conveyor.telemetry import Telemetry

    recipe = zoo_recipe(algo, cfg.env.id)
    if recipe is None:
        raise PeerUnavailable(f"rl-zoo {zoo_version()} has no {algo} entry for {cfg.env.id}")
    telemetry = Telemetry(run_dir, log_interval_s=cfg.log_interval_s, progress=False, total_steps=goal.max_steps,
                          tensorboard=False)
    # The run's clock (returns.csv's wall times) started with the telemetry: its start in unix time.
    write_clock(run_dir, spawned_unix, time.time() - (time.perf_counter() - telemetry.start_time))
    stop = {"reason": "total_steps reached"}  # learn() ran through the recipe's n_timesteps

    class RaceCallback(BaseCallback):
        """Each vector step into the telemetry; False (SB3 stops) at the threshold or a cap."""

        def _on_step(self) -> bool:
            infos = self.locals["infos"]
            telemetry.add_steps(len(infos))
            telemetry.add_episodes(np.array([info["episode"]["r"] if "episode" in info else np.nan
                                             for info in infos], dtype=np.float64))
            telemetry.maybe_log()
            if signals:
                stop["reason"] = f"signal {signal.Signals(signals[0]).name}"
            elif len(telemetry.returns) >= WINDOW and telemetry.return_mean_last100 >= goal.threshold:
                stop["reason"] = TARGET_STOP
            elif telemetry.env_steps >= goal.max_steps:
                stop["reason"] = "race step cap reached"
            elif time.time() - spawned_unix >= goal.time_limit_s:
                stop["reason"] = TIME_STOP
            else:
                return True
            return False

    model_class = {"a2c": sb3.A2C, "ppo": sb3.PPO, "dqn": sb3.DQN}[algo]
    # Ctrl-C, the bench's timeout (SIGTERM) or a hang-up stop SB3 at its next step and the run writes its
    # summary and returns, as a conveyor run does: a long Pong race stopped from outside keeps its curve.
    signals: list[int] = []
    relay = SignalRelay(STOP_SIGNALS, signals.append) if threading.current_thread() is threading.main_thread() \
        else None
    venv = make_zoo_venv(recipe, cfg.seed)
    try:
        model = model_class(recipe.policy, venv, seed=cfg.seed, verbose=0, **recipe.kwargs)
        model.learn(total_timesteps=recipe.n_timesteps, callback=RaceCallback())
    finally:
        venv.close()
        if relay is not None:
            relay.close()
    telemetry.maybe_log(force=True)
    summary = telemetry.summary(arch="sb3", algo=algo, env=cfg.env.id, seed=cfg.seed, stop_reason=stop["reason"],
                                out=str(run_dir), framework="stable-baselines3", framework_version=sb3.__version__,
                                recipe=recipe.source, n_envs=recipe.n_envs, n_timesteps=recipe.n_timesteps)
    telemetry.write_summary(summary)
    telemetry.close()
    return summary
