"""Peer frameworks in a bench run: stable-baselines3 A2C / PPO doing the same work as a conveyor run.

``run_sb3`` trains SB3 A2C or PPO with a run config's env, model and
hyperparameters and writes the files a conveyor run writes (summary.json,
returns.csv, metrics.csv and, with evaluation episodes, eval.json), so the
bench report treats both alike. The policy is conveyor's own encoder as
SB3's shared features extractor with linear policy and value heads (SB3
``net_arch`` empty), initialized as conveyor does (orthogonal; heads 0.01
and 1), optimized by the learner's own optimizer. Envs come from
``conveyor.envs.make_env``, stepped in-process (``DummyVecEnv``). Time
split: ``env`` is vector-env stepping, ``act`` the policy forward while
collecting, ``learn`` SB3's ``train()``. Lag is recorded as in PAAC (the
acting version against the version at the start of each update): 0.

stable-baselines3 is the optional group ``bench``; this module is imported
only inside a peer run's child process, and without SB3 ``run_sb3`` raises
``PeerUnavailable`` (the run becomes a ``skipped`` row).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conveyor.bench.suites import PeerUnavailable
from conveyor.config import RunCfg
from conveyor.errors import ConfigError
from conveyor.telemetry import Telemetry

try:
    import stable_baselines3 as sb3
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
    from stable_baselines3.common.vec_env import DummyVecEnv, VecEnvWrapper
except ImportError:  # the classes below are then never built: run_sb3 stops first
    sb3 = None
    BaseCallback = BaseFeaturesExtractor = VecEnvWrapper = object  # type: ignore[assignment,misc]


def run_sample_factory(cfg: RunCfg, run_dir: Path, eval_episodes: int) -> None:
    if importlib.util.find_spec("sample_factory") is None:
        raise PeerUnavailable("Sample Factory is not installed (pip install sample-factory)")
    raise PeerUnavailable("Sample Factory is installed, but conveyor has no APPO runner for it yet")


class ConveyorEncoder(BaseFeaturesExtractor):
    """conveyor's encoder for the run's env and model config, as SB3's features extractor (a fresh copy per
    SB3 policy; SB3 passes ``encoder`` and ``features`` from ``features_extractor_kwargs``)."""

    def __init__(self, observation_space: Any, encoder: torch.nn.Module, features: int) -> None:
        super().__init__(observation_space, features)
        self.encoder = copy.deepcopy(encoder)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.encoder(obs.float())


class TimedVecEnv(VecEnvWrapper):
    """The SB3 vector env with its stepping time in the run's ``env`` bucket."""

    def __init__(self, venv: Any, telemetry: Telemetry) -> None:
        super().__init__(venv)
        self.telemetry = telemetry

    def reset(self) -> Any:
        return self.venv.reset()

    def step_wait(self) -> Any:
        with self.telemetry.timer("env"):
            return self.venv.step_wait()


def conveyor_optimizer(params: Any, lr: float, cfg: RunCfg) -> torch.optim.Optimizer:
    """SB3's ``optimizer_class``: the learner's own optimizer and settings (``lr`` is the same)."""
    from conveyor.learner import make_optimizer

    return make_optimizer(params, cfg)


def make_sb3_model(cfg: RunCfg, venv: Any, reference: Any) -> tuple[Any, int]:
    """SB3 A2C or PPO with ``cfg``'s hyperparameters on ``venv`` and an encoder like ``reference``'s;
    returns the model and how many optimizer steps one ``train()`` call makes."""
    algo = cfg.algo
    policy_kwargs: dict[str, Any] = {
        "features_extractor_class": ConveyorEncoder,
        "features_extractor_kwargs": {"encoder": reference.encoder, "features": reference.value_head.in_features},
        "net_arch": {"pi": [], "vf": []},
        "optimizer_class": conveyor_optimizer, "optimizer_kwargs": {"cfg": cfg},
    }
    if not reference.policy.discrete:
        policy_kwargs["log_std_init"] = cfg.model.log_std_init
    if cfg.model.weight_init != "orthogonal":
        policy_kwargs["ortho_init"] = False
    common = {"learning_rate": algo.lr, "n_steps": cfg.arch.unroll, "gamma": algo.gamma,
              "ent_coef": algo.entropy_coef, "vf_coef": algo.value_coef,
              "max_grad_norm": algo.max_grad_norm or math.inf, "policy_kwargs": policy_kwargs, "seed": cfg.seed,
              "device": "cpu", "verbose": 0}
    if cfg.model.gsde:  # SB3 redraws every sde_sample_freq steps of the rollout and at its start
        common.update(use_sde=True, sde_sample_freq=cfg.model.gsde_interval)
    if algo.name == "a2c":
        return sb3.A2C("MlpPolicy", venv, gae_lambda=1.0, normalize_advantage=False, **common), 1
    samples = cfg.arch.unroll * cfg.env.num_envs
    batch_size = samples // algo.ppo_minibatches
    model = sb3.PPO("MlpPolicy", venv, batch_size=batch_size, n_epochs=algo.ppo_epochs, gae_lambda=algo.gae_lambda,
                    clip_range=algo.clip, normalize_advantage=algo.normalize_advantages, **common)
    return model, algo.ppo_epochs * math.ceil(samples / batch_size)


class PeerRecorder:
    """The conveyor side of an SB3 run: steps, episodes, lag and time split into the run's telemetry, the
    learner version, and the policy snapshots kept for evaluation (one every ``checkpoint_every`` steps)."""

    def __init__(self, cfg: RunCfg, telemetry: Telemetry, model: Any, updates_per_train: int) -> None:
        self.cfg, self.telemetry, self.model = cfg, telemetry, model
        self.updates_per_train = updates_per_train
        self.version = 0
        self.snapshots: list[tuple[Any, dict[str, torch.Tensor]]] = []  # (PolicyEval, policy state)
        self.next_snapshot = cfg.checkpoint_every
        self.stop_reason = "total_steps reached"
        self.sb3_train, self.policy_forward = model.train, model.policy.forward

    def instrument(self) -> None:
        """Route SB3's updates and collection forwards through the timed versions below."""
        self.model.train = self.train
        self.model.policy.forward = self.forward

    def restore_forward(self) -> None:
        self.model.policy.forward = self.policy_forward

    def train(self) -> None:
        samples = self.cfg.arch.unroll * self.cfg.env.num_envs
        self.telemetry.add_lag(self.version, np.full(samples, self.version))
        with self.telemetry.timer("learn"):
            self.sb3_train()
        self.version += self.updates_per_train
        self.telemetry.add_update({})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.telemetry.timer("act"):
            return self.policy_forward(*args, **kwargs)

    def snapshot(self) -> None:
        from conveyor.evaluate import PolicyEval

        tel = self.telemetry
        policy = PolicyEval(f"snapshot-{tel.env_steps:012d}", tel.env_steps, tel.wall_time_s, self.version, ())
        state = {k: v.detach().clone() for k, v in self.model.policy.state_dict().items()}
        self.snapshots.append((policy, state))
        del self.snapshots[: max(0, len(self.snapshots) - self.cfg.keep_checkpoints)]

    def on_step(self, infos: list[dict[str, Any]]) -> bool:
        """After each vector step: record it; False stops SB3's ``learn`` (the wall-time limit)."""
        from conveyor.envs import EPISODE_KEY

        tel, cfg = self.telemetry, self.cfg
        tel.add_steps(cfg.env.num_envs)
        tel.add_episodes(np.array([info[EPISODE_KEY]["r"] if EPISODE_KEY in info else np.nan for info in infos],
                                  dtype=np.float64))
        tel.maybe_log()
        if cfg.checkpoint_every and tel.env_steps >= self.next_snapshot:
            self.snapshot()
            self.next_snapshot += cfg.checkpoint_every
        if cfg.time_limit_s and tel.wall_time_s >= cfg.time_limit_s:
            self.stop_reason = "time_limit_s reached"
            return False
        return True

    def finish(self) -> None:
        """A snapshot of the final policy, unless the last one is already of it."""
        if not self.snapshots or self.snapshots[-1][0].env_steps != self.telemetry.env_steps:
            self.snapshot()


class RecorderCallback(BaseCallback):
    """SB3's per-step callback, handing each step to the ``PeerRecorder``."""

    def __init__(self, recorder: PeerRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def _on_step(self) -> bool:
        return self.recorder.on_step(self.locals["infos"])


class SB3Agent:
    """An SB3 policy in ``conveyor.evaluate``'s agent interface (sampled actions, seeded per evaluation)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def reset(self, num_envs: int, seed: int) -> None:
        torch.manual_seed(seed)

    def act(self, obs: np.ndarray, prev_reward: np.ndarray) -> np.ndarray:
        return self.model.policy.predict(obs, deterministic=False)[0]


def run_sb3(cfg: RunCfg, run_dir: Path, eval_episodes: int) -> None:
    """Train stable-baselines3 A2C or PPO with ``cfg``'s env, model and hyperparameters; write the same
    files a conveyor run writes and, with ``eval_episodes``, evaluate the kept snapshots (eval.json)."""
    if sb3 is None:
        raise PeerUnavailable("stable-baselines3 is not installed (pip install -e '.[bench]')")
    from conveyor.envs import make_env
    from conveyor.learner import param_sha256
    from conveyor.models import make_model
    from conveyor.run import prepare_out_dir, seed_everything

    if cfg.algo.name not in ("a2c", "ppo"):
        raise ConfigError(f"the stable-baselines3 peer runs a2c or ppo, not {cfg.algo.name}")
    out, _lock = prepare_out_dir(cfg)  # the run directory's lock: held until this bench child exits
    (out / "config.json").write_text(cfg.to_json())
    seed_everything(cfg.seed)
    torch.set_num_threads(cfg.torch_threads or max(1, os.cpu_count() or 1))
    telemetry = Telemetry(out, log_interval_s=cfg.log_interval_s, progress=False, total_steps=cfg.total_steps)
    env_fns = [lambda i=i: make_env(cfg.env, cfg.seed + i) for i in range(cfg.env.num_envs)]
    probe = env_fns[0]()
    reference = make_model(cfg.model, probe.observation_space, probe.action_space)
    probe.close()
    venv = TimedVecEnv(DummyVecEnv(env_fns), telemetry)
    model, updates_per_train = make_sb3_model(cfg, venv, reference)
    recorder = PeerRecorder(cfg, telemetry, model, updates_per_train)
    recorder.instrument()
    try:
        model.learn(total_timesteps=cfg.total_steps, callback=RecorderCallback(recorder))
    finally:
        venv.close()
    recorder.finish()
    telemetry.maybe_log(force=True)
    summary = telemetry.summary(arch="sb3", algo=cfg.algo.name, env=cfg.env.id, seed=cfg.seed,
                                param_sha256=param_sha256(model.policy), learner_version=recorder.version,
                                stop_reason=recorder.stop_reason, out=str(out), framework="stable-baselines3",
                                framework_version=sb3.__version__)
    telemetry.write_summary(summary)
    telemetry.close()
    if eval_episodes:
        recorder.restore_forward()
        evaluate_snapshots(cfg, out, model, recorder.snapshots, eval_episodes)


def evaluate_snapshots(cfg: RunCfg, out: Path, model: Any, snapshots: list[tuple[Any, dict[str, torch.Tensor]]],
                       eval_episodes: int) -> None:
    """``conveyor eval``'s protocols over the kept SB3 policies (loaded into ``model`` in turn): eval.json."""
    from conveyor.evaluate import (EVAL_SEED_OFFSET, NOOP_MAX, WINDOW, default_target, eval_result, evaluate_agents,
                                   make_eval_envs, write_eval)

    seed = EVAL_SEED_OFFSET + cfg.seed
    envs = make_eval_envs(cfg, eval_episodes, noop_max=NOOP_MAX, seed=seed)
    try:
        evaluated = []
        for policy, state in snapshots:
            model.policy.load_state_dict(state)
            evaluated += evaluate_agents([(policy, SB3Agent(model))], envs, seed)
    finally:
        for env in envs:
            env.close()
    write_eval(out, eval_result(out, cfg.env.id, evaluated, episodes=eval_episodes, noop_max=NOOP_MAX, window=WINDOW,
                                seed=seed, time_limit_s=None, target=default_target(cfg)))
