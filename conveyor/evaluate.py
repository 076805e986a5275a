"""Evaluation protocols over a run's checkpoints (HTS-RL, Liu et al. 2020, section 5).

Each checkpoint is one *policy*. Every policy plays ``episodes`` evaluation
episodes (10 in the protocol) in fresh envs, and three numbers come out:

- **final metric**: the mean over the last 100 evaluation episodes, i.e. 10
  episodes for each of the last 10 policies of training (Henderson et al.,
  Colas et al.).
- **final time metric**: the final metric of training cut at a wall-time
  limit: only the policies whose checkpoint ``wall_time_s`` is within the
  limit count.
- **required time metric**: the wall time until the running evaluation mean
  (the episodes of the most recent 10 policies) first reaches a target.
  Before 10 policies exist the window holds all of them.

The protocol math lives in the small pure functions ``window_mean``,
``final_metric``, ``final_time_metric``, ``running_means`` and
``required_time``; ``evaluate_run`` plays the episodes and writes
``eval.json``. Evaluation envs use no-op starts on Atari (up to
``noop_max``), unclipped rewards and no episodic life, so a return is the
game score. Actions are sampled from the policy; Q heads (R2D2) act greedily
with epsilon ``EVAL_EPSILON``. Episode ``j`` of every policy starts from the
same env seed and every policy uses the same action-sampling seed, so
policies are compared on common random numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from conveyor.config import RunCfg, check_seeds, parse_env_arg, read_config_file
from conveyor.errors import ConfigError
from conveyor.envs import EPISODE_KEY, make_env

WINDOW = 10
"""Policies in the protocol's window (x 10 episodes each = the last 100 evaluation episodes)."""
NOOP_MAX = 30
"""Atari: up to this many no-op actions start each evaluation episode (Mnih et al. 2015's protocol)."""
EVAL_EPSILON = 1e-3
"""Exploration of greedy Q-head policies during evaluation."""
EVAL_SEED_OFFSET = 1_000_000
"""Evaluation env seeds start here (plus the run's seed), away from the seeds training used."""
MAX_EPISODE_STEPS = 108_000
"""Agent steps after which an evaluation episode is cut (its partial return counts)."""


@dataclass(frozen=True)
class PolicyEval:
    """The evaluation episodes of one policy (checkpoint), in training order."""

    checkpoint: str
    env_steps: int
    wall_time_s: float
    version: int
    returns: tuple[float, ...]

    @property
    def mean(self) -> float:
        return float(np.mean(self.returns)) if self.returns else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "returns": list(self.returns), "mean": self.mean}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PolicyEval":
        return cls(str(data["checkpoint"]), int(data["env_steps"]), float(data["wall_time_s"]),
                   int(data["version"]), tuple(float(r) for r in data["returns"]))


# ---- protocol math (pure; policies in training order) ---------------------------------------
def window_mean(policies: Sequence[PolicyEval], window: int = WINDOW) -> float:
    """Mean over every episode of the last ``window`` policies; NaN when there are none."""
    episodes = [r for policy in list(policies)[-window:] for r in policy.returns]
    return float(np.mean(episodes)) if episodes else math.nan


def final_metric(policies: Sequence[PolicyEval], window: int = WINDOW) -> float:
    """The final metric: the mean of the last ``window`` policies' episodes (10 x 10 = 100 episodes)."""
    return window_mean(policies, window)


def final_time_metric(policies: Sequence[PolicyEval], time_limit_s: float, window: int = WINDOW) -> float:
    """The final metric of training stopped at ``time_limit_s``: only policies saved by then count."""
    return window_mean([p for p in policies if p.wall_time_s <= time_limit_s], window)


def running_means(policies: Sequence[PolicyEval], window: int = WINDOW) -> list[float]:
    """The running evaluation mean after each policy (over the most recent ``window`` policies)."""
    return [window_mean(policies[: i + 1], window) for i in range(len(policies))]


def required_time(policies: Sequence[PolicyEval], target: float, window: int = WINDOW) -> PolicyEval | None:
    """The first policy at which the running evaluation mean reaches ``target`` (its ``wall_time_s`` is the
    required time metric); None when it never does."""
    for policy, mean in zip(policies, running_means(policies, window)):
        if mean >= target:
            return policy
    return None


def protocol_metrics(policies: Sequence[PolicyEval], *, window: int = WINDOW, time_limit_s: float | None = None,
                     target: float | None = None) -> dict[str, Any]:
    """The three metrics as the ``eval.json`` fields (``None`` where a limit or target is not given)."""
    metrics: dict[str, Any] = {
        "final_metric": _finite_or_none(final_metric(policies, window)),
        "final_metric_policies": min(len(policies), window),
        "final_time_metric": None,
        "required_time_metric": None,
    }
    if time_limit_s is not None:
        within = [p for p in policies if p.wall_time_s <= time_limit_s]
        metrics["final_time_metric"] = {"time_limit_s": time_limit_s,
                                        "value": _finite_or_none(window_mean(within, window)),
                                        "policies": min(len(within), window)}
    if target is not None:
        reached = required_time(policies, target, window)
        metrics["required_time_metric"] = {
            "target": target,
            "reached": reached is not None,
            "wall_time_s": reached.wall_time_s if reached else None,
            "env_steps": reached.env_steps if reached else None,
            "checkpoint": reached.checkpoint if reached else None,
        }
    return metrics


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


# ---- acting ----------------------------------------------------------------------------------
class Agent(Protocol):
    """What plays evaluation episodes: conveyor models here; peers (bench) bring their own."""

    def reset(self, num_envs: int, seed: int) -> None: ...

    def act(self, obs: np.ndarray, prev_reward: np.ndarray) -> np.ndarray: ...


class ModelAgent:
    """Acts with a conveyor model: samples from its policy, or greedy with ``epsilon`` for Q heads.

    A recurrent core carries its state, previous action and previous reward
    across the steps of a batch of episodes.
    """

    def __init__(self, model: nn.Module, epsilon: float = EVAL_EPSILON):
        self.model = model.eval()
        self.epsilon = epsilon
        self.generator = torch.Generator()
        self.state: Any = None
        self.prev_action: torch.Tensor | None = None

    def reset(self, num_envs: int, seed: int) -> None:
        self.generator.manual_seed(seed)
        self.state = self.model.initial_state(num_envs)
        self.prev_action = None

    @torch.no_grad()
    def act(self, obs: np.ndarray, prev_reward: np.ndarray) -> np.ndarray:
        model = self.model
        kwargs: dict[str, Any] = {}
        if model.lstm_size:  # no previous action at the start: the core reads zeros
            previous = None if self.prev_action is None else self.prev_action.unsqueeze(0)
            kwargs = {"prev_action": previous,
                      "prev_reward": torch.as_tensor(prev_reward, dtype=torch.float32).unsqueeze(0)}
        out = model(torch.as_tensor(obs).unsqueeze(0), self.state, **kwargs)
        self.state = out.state
        if out.q is not None:
            q = out.q[0]
            greedy = q.argmax(-1)
            explore = torch.rand(q.shape[0], generator=self.generator) < self.epsilon
            random = torch.randint(q.shape[-1], (q.shape[0],), generator=self.generator)
            actions = torch.where(explore, random, greedy)
        else:
            actions = out.policy.sample(out.params[0], None, self.generator)
        self.prev_action = actions
        return actions.numpy()


def play_episodes(agent: Agent, envs: Sequence[Any], seeds: Sequence[int], action_seed: int,
                  max_episode_steps: int = MAX_EPISODE_STEPS) -> list[float]:
    """One episode in each env (reset with its seed), acting in one batch; returns the episode returns."""
    first = [env.reset(seed=int(seed))[0] for env, seed in zip(envs, seeds)]
    obs = np.stack(first)
    returns = np.zeros(len(envs))
    last_reward = np.zeros(len(envs), dtype=np.float32)
    running = np.ones(len(envs), dtype=bool)
    agent.reset(len(envs), action_seed)
    for _ in range(max_episode_steps):
        if not running.any():
            break
        actions = agent.act(obs, last_reward)
        for i in np.flatnonzero(running):
            next_obs, reward, terminated, truncated, info = envs[i].step(actions[i])
            returns[i] += float(reward)
            last_reward[i] = float(reward)
            obs[i] = next_obs
            if terminated or truncated:
                running[i] = False
                if EPISODE_KEY in info:  # the real, unclipped return where the env reports one
                    returns[i] = float(info[EPISODE_KEY]["r"])
    return returns.tolist()


def eval_env_cfg(cfg: RunCfg, noop_max: int) -> Any:
    """The run's env settings for evaluation: no-op starts, unclipped rewards, real episodes."""
    return dataclasses.replace(cfg.env, noop_max=noop_max, clip_rewards=False, episodic_life=False)


def make_eval_envs(cfg: RunCfg, episodes: int, noop_max: int, seed: int) -> list[Any]:
    env_cfg = eval_env_cfg(cfg, noop_max)
    return [make_env(env_cfg, seed + i) for i in range(episodes)]


def evaluate_agents(policies: Sequence[tuple[PolicyEval, Agent]], envs: Sequence[Any], seed: int,
                    max_episode_steps: int = MAX_EPISODE_STEPS) -> list[PolicyEval]:
    """Play one episode per env for each policy; returns the policies with their evaluation returns."""
    seeds = [seed + i for i in range(len(envs))]
    return [dataclasses.replace(policy, returns=tuple(play_episodes(agent, envs, seeds, seed, max_episode_steps)))
            for policy, agent in policies]


# ---- a run directory ---------------------------------------------------------------------------
def load_run_config(run_dir: Path, env_args: tuple[tuple[str, Any], ...] = ()) -> RunCfg:
    """The run's ``config.json``, with ``env_args`` (``(key, value)`` pairs) in place of the same keys of its env
    constructor arguments."""
    config_file = Path(run_dir) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"no config.json in {run_dir}: pass the --out DIR of a conveyor run")
    cfg = RunCfg.from_dict(read_config_file(config_file))
    return dataclasses.replace(cfg, env=cfg.env.with_env_args(env_args)) if env_args else cfg


def model_for_checkpoint(cfg: RunCfg, observation_space: Any, action_space: Any,
                         state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """The run's model, shaped like the checkpoint.

    An architecture may pick a dueling head or a recurrent core that the
    config leaves implicit (R2D2), so both are read off the state dict's keys.
    """
    from conveyor.models import make_model

    dueling = any(key.startswith("advantage.") for key in state_dict)
    hidden_weights = state_dict.get("core.weight_hh_l0")
    lstm_size = int(hidden_weights.shape[1]) if hidden_weights is not None else 0
    model_cfg = dataclasses.replace(cfg.model, lstm_size=lstm_size)
    return make_model(model_cfg, observation_space, action_space, dueling=dueling)


def default_target(cfg: RunCfg) -> float | None:
    """The run's finite target return, else the env's registered reward threshold, else None."""
    if cfg.target_return is not None and math.isfinite(cfg.target_return):
        return cfg.target_return
    from conveyor.envs.gym_api import registered_spec

    spec = registered_spec(cfg.env.id)  # MODULE:ID too
    threshold = spec.reward_threshold if spec is not None else None
    return float(threshold) if threshold is not None else None


def evaluate_run(run_dir: Path | str, *, episodes: int = 10, noop_max: int = NOOP_MAX, window: int = WINDOW,
                 time_limit_s: float | None = None, target: float | None = None, seed: int | None = None,
                 max_episode_steps: int = MAX_EPISODE_STEPS, env_args: tuple[tuple[str, Any], ...] = (),
                 checkpoints: Sequence[str | int] = ()) -> dict[str, Any]:
    """Evaluate the checkpoints of ``run_dir``; writes and returns ``eval.json``.

    ``checkpoints``: which ones (each ``latest``, an env-step count or a ``.pt`` path, as ``conveyor enjoy
    --checkpoint`` takes); none: every checkpoint. ``target`` None uses ``default_target`` of the run's config.
    ``env_args`` replace those keys of the run's env constructor arguments (an evaluation protocol other than
    training's: ``repeat_action_probability`` 0 plays Atari v5 without sticky actions, as the scores published
    before Machado et al. 2018 were played).
    """
    from conveyor.learner import CheckpointError, CheckpointGone, checkpoint_file, load_checkpoint

    run_dir = Path(run_dir)
    if episodes <= 0 or window <= 0 or noop_max < 0:
        raise ConfigError(f"--episodes ({episodes}) and --window ({window}) must be positive and --noop-max "
                          f"({noop_max}) >= 0")
    if target is not None and not math.isfinite(target):
        raise ConfigError(f"--target {target} is not a finite return: pass a number, or leave it out for the "
                          "run's target return")
    cfg = load_run_config(run_dir, env_args)
    paths = sorted(run_dir.glob("checkpoints/ckpt-*.pt"))
    if not paths:
        raise CheckpointError(f"no checkpoints in {run_dir}/checkpoints: train with --checkpoint-every N "
                              "to keep the policies evaluation needs")
    named = {checkpoint_file(run_dir, checkpoint) for checkpoint in checkpoints} - {None}
    if checkpoints:  # `latest`: the newest file (one that does not load is an error here, as without the choice)
        paths = sorted(named | ({paths[-1]} if "latest" in {str(checkpoint) for checkpoint in checkpoints} else set()))
    seed = EVAL_SEED_OFFSET + cfg.seed if seed is None else seed
    check_seeds(seed, episodes)
    target = default_target(cfg) if target is None else target
    envs = make_eval_envs(cfg, episodes, noop_max, seed)
    try:
        model: nn.Module | None = None
        policies: list[PolicyEval] = []
        rotated = []
        while paths:
            path = paths.pop(0)
            try:
                state = load_checkpoint(path)
            except CheckpointGone:  # a run still training rotated it away: one it listed, not one named
                if path in named:
                    raise
                rotated.append(path.name)
                newest = max(run_dir.glob("checkpoints/ckpt-*.pt"), default=None)
                done = {*rotated, *(policy.checkpoint for policy in policies)}
                if not paths and newest is not None and newest.name not in done:
                    paths.append(newest)  # the newest one listed is gone: the newest still there stands in
                continue
            if model is None:
                model = model_for_checkpoint(cfg, envs[0].observation_space, envs[0].action_space, state["model"])
            try:
                model.load_state_dict(state["model"])
            except RuntimeError as error:
                raise CheckpointError(f"checkpoint {path} does not fit the model of {run_dir}/config.json "
                                      f"({str(error).splitlines()[0]})") from None
            policy = PolicyEval(path.name, int(state.get("env_steps", 0)), float(state.get("wall_time_s", 0.0)),
                                int(state.get("version", 0)), ())
            policies += evaluate_agents([(policy, ModelAgent(model))], envs, seed, max_episode_steps)
    finally:
        for env in envs:
            env.close()
    if rotated:
        print(f"conveyor: {len(rotated)} checkpoint(s) ({', '.join(rotated)}) were deleted by the run writing "
              f"{run_dir} (--keep-checkpoints rotation) before they could be evaluated: skipped", file=sys.stderr)
    if not policies:
        raise CheckpointError(f"every checkpoint of {run_dir} was rotated away while it was evaluated: evaluate "
                              "once the run has ended, or train with a larger --keep-checkpoints")
    result = eval_result(run_dir, cfg.env.id, policies, episodes=episodes, noop_max=noop_max, window=window,
                         seed=seed, time_limit_s=time_limit_s, target=target, env_args=env_args)
    write_eval(run_dir, result)
    return result


def eval_result(run_dir: Path, env_id: str, policies: Sequence[PolicyEval], *, episodes: int, noop_max: int,
                window: int, seed: int, time_limit_s: float | None, target: float | None,
                env_args: tuple[tuple[str, Any], ...] = ()) -> dict[str, Any]:
    """The ``eval.json`` contents (policies in training order, then the protocol metrics); ``env_args``: the
    evaluation's overrides of the run's env constructor arguments."""
    ordered = sorted(policies, key=lambda p: (p.env_steps, p.wall_time_s))
    return {
        "run": str(run_dir),
        "env": env_id,
        "episodes_per_policy": episodes,
        "window": window,
        "noop_max": noop_max,
        "env_args": dict(env_args),
        "eval_seed": seed,
        "epsilon_q": EVAL_EPSILON,
        "policies": [p.to_dict() for p in ordered],
        "running_mean": [_finite_or_none(m) for m in running_means(ordered, window)],
        **protocol_metrics(ordered, window=window, time_limit_s=time_limit_s, target=target),
    }


def write_eval(run_dir: Path, result: dict[str, Any]) -> Path:
    from conveyor.telemetry import write_json_atomic

    path = Path(run_dir) / "eval.json"
    write_json_atomic(path, result)
    return path


def load_eval(run_dir: Path | str) -> tuple[dict[str, Any], list[PolicyEval]]:
    """``eval.json`` of a run and its policies (raises ConfigError when it is missing or malformed)."""
    path = Path(run_dir) / "eval.json"
    try:
        data = json.loads(path.read_text())
        return data, [PolicyEval.from_dict(p) for p in data["policies"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"cannot read {path} ({error}): run `conveyor eval --run {run_dir}` first") from None


def format_table(result: dict[str, Any]) -> str:
    """The evaluation as a text table: one row per policy, then the three metrics."""
    fmt = _fmt
    lines = [f"{'policy':<24} {'env steps':>12} {'wall s':>9} {'version':>8} {'mean':>9} {'running':>9}"]
    for policy, running in zip(result["policies"], result["running_mean"]):
        lines.append(f"{policy['checkpoint']:<24} {policy['env_steps']:>12,d} {policy['wall_time_s']:>9.1f} "
                     f"{policy['version']:>8d} {fmt(policy['mean']):>9} {fmt(running):>9}")
    window, episodes = result["window"], result["episodes_per_policy"]
    lines.append(f"final metric ({result['final_metric_policies']} of the last {window} policies x {episodes} "
                 f"episodes): {fmt(result['final_metric'])}")
    timed = result["final_time_metric"]
    if timed is not None:
        lines.append(f"final time metric (policies within {timed['time_limit_s']:.1f}s: {timed['policies']}): "
                     f"{fmt(timed['value'])}")
    required = result["required_time_metric"]
    if required is not None:
        reached = (f"{required['wall_time_s']:.1f}s ({required['env_steps']:,d} env steps)" if required["reached"]
                   else "not reached")
        lines.append(f"required time metric (running mean >= {required['target']:g}): {reached}")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}"


# ---- `conveyor eval` ---------------------------------------------------------------------------
def add_env_arg_argument(parser: argparse.ArgumentParser) -> None:
    """``--env-arg KEY=VALUE`` of ``conveyor eval`` and ``conveyor enjoy``: play in other env settings."""
    parser.add_argument("--env-arg", dest="env_args", action="append", default=[], type=parse_env_arg,
                        metavar="KEY=VALUE",
                        help="replace one of the run's env constructor arguments (repeatable); e.g. "
                             "repeat_action_probability=0 plays Atari v5 without sticky actions, the protocol of "
                             "the Atari scores published before 2018")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, type=Path, metavar="DIR", help="the run's --out directory")
    parser.add_argument("--checkpoint", dest="checkpoints", action="append", default=[], metavar="N",
                        help="evaluate only this checkpoint (repeatable): latest, an env-step count of a file in "
                             "DIR/checkpoints, or a path to a .pt file (default: every checkpoint)")
    parser.add_argument("--episodes", type=int, default=10, help="evaluation episodes per policy (default: 10)")
    parser.add_argument("--noop-max", type=int, default=NOOP_MAX,
                        help=f"Atari: up to this many no-op actions at the start of each episode (default: {NOOP_MAX})")
    parser.add_argument("--window", type=int, default=WINDOW,
                        help="policies in the final metric and the running mean (default: 10)")
    parser.add_argument("--time-limit-s", type=float, default=None, metavar="S",
                        help="wall-time limit of the final time metric (default: not computed)")
    parser.add_argument("--target", type=float, default=None, metavar="R",
                        help="target of the required time metric (default: the run's target return, else the "
                             "env's reward threshold)")
    parser.add_argument("--seed", type=int, default=None,
                        help=f"first evaluation env seed (default: {EVAL_SEED_OFFSET:,} + the run's seed)")
    add_env_arg_argument(parser)
    parser.add_argument("--max-episode-steps", type=int, default=MAX_EPISODE_STEPS,
                        help=f"cut evaluation episodes after this many agent steps (default: {MAX_EPISODE_STEPS})")


def main(args: argparse.Namespace) -> int:
    result = evaluate_run(args.run, episodes=args.episodes, noop_max=args.noop_max, window=args.window,
                          time_limit_s=args.time_limit_s, target=args.target, seed=args.seed,
                          max_episode_steps=args.max_episode_steps, env_args=tuple(args.env_args),
                          checkpoints=tuple(args.checkpoints))
    print(format_table(result))
    print(f"written: {Path(args.run) / 'eval.json'}")
    return 0
