"""Typed run configuration.

Every knob of a run lives in one frozen dataclass tree: ``RunCfg`` holds an
``EnvCfg``, ``ModelCfg``, ``AlgoCfg`` and ``ArchCfg``. Each field has a
docstring (the string literal under it); ``__post_init__`` validates, and
derived values are properties. Nothing mutates a config at run time: use
``dataclasses.replace`` to make a new one.

Invalid values raise ``ConfigError`` with a one-line message that names the
field and the fix; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

ARCHS = ("paac", "ga3c", "seed", "impact", "hts")
ALGOS = ("a2c", "ppo", "vtrace", "impact", "r2d2", "ga3c")
MODELS = ("auto", "mlp", "nips_cnn", "nature_cnn", "impala_resnet")
ENV_BACKENDS = ("shm", "envpool")
OPTIMIZERS = ("rmsprop", "adam")
IMPACT_RATIOS = ("target", "worker", "impact")
# IMPACT paper comparison presets (`--preset`): the arch fields and the algorithm each one fixes.
IMPACT_PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "impact": ({"use_target_network": True}, "impact"),
    "appo": ({"replay_times": 1, "use_target_network": False}, "impact"),
    "impala": ({"replay_times": 1, "use_target_network": False}, "vtrace"),
}

# Which algorithms each architecture can run. A pair outside this table is refused.
ARCH_ALGOS: dict[str, tuple[str, ...]] = {
    "paac": ("a2c", "ppo"),
    "ga3c": ("ga3c", "a2c"),
    "seed": ("vtrace", "r2d2"),
    "impact": ("impact", "vtrace"),
    "hts": ("a2c", "ppo"),
}


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the fix."""


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}: pass a value > 0")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {name} {value!r}: choose one of {', '.join(choices)}")


def _unit_interval(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name} must lie in [0, 1], got {value}")


@dataclass(frozen=True)
class EnvCfg:
    id: str = "CartPole-v1"
    """A gymnasium id (``CartPole-v1``, ``ALE/Pong-v5``, ``HalfCheetah-v5``) or ``conveyor/StepTime-v0``."""
    num_envs: int = 16
    """n_e: envs stepped in lockstep (or, in async architectures, envs per actor/worker group)."""
    num_workers: int = 2
    """n_w: worker processes that step the envs; each owns num_envs / num_workers of them."""
    backend: str = "shm"
    """Vectorized stepping backend: ``shm`` (our shared-memory workers) or ``envpool`` (C++ threads)."""
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
    max_env_errors: int = 10
    """An env that raises is reset and logged up to this many times per run, then the run stops."""
    max_restarts: int = 10
    """Worker processes (env workers, executors, agents, actors, IMPACT workers) that die are restarted, their
    envs re-seeded, up to this many times per run; one more death stops the run with an error (0: never)."""

    def __post_init__(self) -> None:
        _positive(self, "num_envs", "num_workers", "frame_stack", "frame_skip", "max_env_errors")
        _non_negative(self, "noop_max", "max_restarts")
        _choice("env backend", self.backend, ENV_BACKENDS)
        if self.num_envs % self.num_workers:
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

    @property
    def is_atari(self) -> bool:
        return self.id.startswith("ALE/") or self.id.endswith("NoFrameskip-v4")


@dataclass(frozen=True)
class ModelCfg:
    name: str = "auto"
    """Encoder: ``mlp``, ``nips_cnn``, ``nature_cnn``, ``impala_resnet``; ``auto`` picks mlp for vectors, nature_cnn for images."""
    hidden: tuple[int, ...] = (64, 64)
    """MLP hidden layer sizes."""
    lstm_size: int = 0
    """Width of an LSTM core after the encoder; 0 means no recurrent core (R2D2 then uses 512 on Atari, 64 elsewhere)."""

    def __post_init__(self) -> None:
        _choice("model", self.name, MODELS)
        if not self.hidden or any(h <= 0 for h in self.hidden):
            raise ConfigError(f"hidden sizes must be positive, got {self.hidden}")
        _non_negative(self, "lstm_size")


@dataclass(frozen=True)
class AlgoCfg:
    name: str = "a2c"
    """Loss: ``a2c``, ``ppo``, ``vtrace``, ``impact``, ``r2d2``, ``ga3c``."""
    gamma: float = 0.99
    """Discount factor."""
    lr: float = 0.0
    """Learning rate; 0 means the algorithm's default (``learning_rate``; A2C on Atari: 0.0007 * num_envs, PAAC)."""
    optimizer: str = ""
    """``rmsprop`` or ``adam``; empty means the algorithm's default."""
    rmsprop_alpha: float = 0.99
    """RMSProp smoothing constant (PAAC, GA3C)."""
    rmsprop_eps: float = 0.0
    """RMSProp epsilon; 0 means 0.1 on Atari (PAAC paper) and 1e-5 elsewhere."""
    adam_eps: float = 1e-5
    """Adam epsilon."""
    max_grad_norm: float = 40.0
    """Global gradient-norm clip (PAAC: 40; r2d2 clips at 80 while this is left at its default); 0 disables."""
    entropy_coef: float = 0.01
    """Weight of the entropy bonus."""
    value_coef: float = 0.5
    """Weight of the value loss."""
    gae_lambda: float = 0.95
    """lambda of GAE (PPO) and of V-trace GAE-lambda (IMPACT)."""
    ppo_epochs: int = 4
    """PPO: passes over each rollout."""
    ppo_minibatches: int = 4
    """PPO: minibatches per pass (split over envs, so time order is kept)."""
    clip: float = 0.2
    """PPO / IMPACT surrogate clip epsilon (IMPACT paper discrete: 0.3)."""
    clip_rho: float = 1.0
    """V-trace rho-bar."""
    clip_c: float = 1.0
    """V-trace c-bar."""
    clip_pg_rho: float = 1.0
    """V-trace clip on the policy-gradient importance weight."""
    impact_rho: float = 2.0
    """IMPACT: worker-ratio bound rho in pi_learner / max(pi_target, pi_worker / rho)."""
    kl_coef: float = 0.0
    """IMPACT: weight of the optional KL(target || learner) penalty."""
    ga3c_eps: float = 1e-6
    """GA3C eq. 5: epsilon in log(pi + eps) and in the entropy."""
    n_step: int = 5
    """R2D2: n of the n-step double-Q target."""
    eta: float = 0.9
    """R2D2: priority mix eta * max|delta| + (1 - eta) * mean|delta|."""
    priority_exponent: float = 0.9
    """R2D2: prioritized-replay exponent alpha."""
    importance_exponent: float = 0.6
    """R2D2: importance-sampling exponent beta."""
    value_rescale_eps: float = 1e-3
    """R2D2: epsilon of the value rescaling h(x)."""
    normalize_advantages: bool = True
    """PPO: normalize advantages per minibatch."""

    def __post_init__(self) -> None:
        _choice("algo", self.name, ALGOS)
        if self.optimizer:
            _choice("optimizer", self.optimizer, OPTIMIZERS)
        _unit_interval(self, "gamma", "gae_lambda", "eta")
        _non_negative(self, "lr", "max_grad_norm", "entropy_coef", "value_coef", "kl_coef")
        _positive(self, "ppo_epochs", "ppo_minibatches", "clip", "clip_rho", "clip_c", "clip_pg_rho",
                  "impact_rho", "ga3c_eps", "n_step", "adam_eps")
        _non_negative(self, "rmsprop_eps")

    @property
    def learning_rate(self) -> float:
        """The explicit ``lr``, else the algorithm's default."""
        if self.lr:
            return self.lr
        return {"a2c": 2e-3, "ppo": 2.5e-4, "vtrace": 6e-4, "impact": 5e-4, "r2d2": 1e-4, "ga3c": 3e-4}[self.name]

    @property
    def optimizer_name(self) -> str:
        if self.optimizer:
            return self.optimizer
        return "rmsprop" if self.name in ("a2c", "ga3c", "vtrace") else "adam"


@dataclass(frozen=True)
class ArchCfg:
    name: str = "paac"
    """Architecture: ``paac``, ``ga3c``, ``seed``, ``impact``, ``hts``."""
    unroll: int = 5
    """t_max: steps per env in one rollout/unroll (SEED: unroll length; IMPACT uses worker_batch)."""
    # hts
    num_actors: int = 1
    """HTS: actor threads that batch whatever observations are waiting."""
    sync_interval: int = 5
    """HTS alpha: steps per env between storage swaps (one update per swap)."""
    # ga3c
    num_agents: int = 16
    """GA3C N_A: agent processes (each owns one env)."""
    num_predictors: int = 1
    """GA3C N_P: predictor threads."""
    num_trainers: int = 1
    """GA3C N_T: trainer threads."""
    min_train_batch: int = 20
    """GA3C: trainers group experiences until this many t_max segments (paper: 20-40)."""
    max_predict_batch: int = 128
    """GA3C: most requests one predictor batches."""
    autotune: bool = False
    """GA3C: adjust N_P, N_T, N_A at run time to maximise TPS."""
    autotune_interval: float = 10.0
    """GA3C: seconds between autotune decisions."""
    # seed
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
    batch_size: int = 32
    """Learner batch size in unrolls/sequences (SEED, R2D2)."""
    seq_len: int = 80
    """R2D2: stored sequence length (including burn-in)."""
    burn_in: int = 40
    """R2D2: leading steps of each sequence that only warm the LSTM state."""
    replay_bytes: int = 2 * 1024**3
    """R2D2: replay memory budget in bytes, checked at start."""
    replay_capacity: int = 10000
    """R2D2: sequences held in replay."""
    min_replay: int = 500
    """R2D2: sequences stored before learning starts."""
    replay_ratio: float = 0.75
    """R2D2: sequences sampled per sequence inserted (SEED table 8: 0.75; with sequences overlapping by half, each step
    is replayed 1.5 times). The learner waits for new data and the actors for the learner; 0 lets both run free."""
    # impact
    worker_batch: int = 64
    """IMPACT: steps per env in one worker batch (S)."""
    buffer_batches: int = 4
    """IMPACT: N, batches in the circular buffer."""
    replay_times: int = 2
    """IMPACT: K, times each batch is used before replacement."""
    broadcast_interval: int = 1
    """IMPACT: learner updates between weight broadcasts to workers."""
    impact_ratio: str = "impact"
    """IMPACT ablation: ``target`` (R1), ``worker`` (R2) or ``impact`` (R3)."""
    use_target_network: bool = True
    """IMPACT: attach target-network log-probs; off with K=1 gives APPO."""
    preset: str = ""
    """IMPACT comparison preset: ``impact``, ``appo`` (K=1, no target network) or ``impala`` (same, algo vtrace)."""
    # shared
    target_update: int = 0
    """Updates between target-network syncs; 0 means the architecture's default (IMPACT: N*K; R2D2: 2500)."""

    def __post_init__(self) -> None:
        _choice("arch", self.name, ARCHS)
        _choice("impact ratio", self.impact_ratio, IMPACT_RATIOS)
        if self.preset:
            self._apply_preset()
        _positive(self, "unroll", "num_actors", "sync_interval", "num_agents", "num_predictors",
                  "num_trainers", "min_train_batch", "max_predict_batch", "autotune_interval",
                  "inference_batch", "inference_timeout_ms", "max_message_bytes",
                  "batch_size", "seq_len", "replay_bytes", "replay_capacity", "min_replay",
                  "worker_batch", "buffer_batches", "replay_times", "broadcast_interval")
        _non_negative(self, "burn_in", "target_update", "local_actors", "replay_ratio")
        if self.burn_in >= self.seq_len:
            raise ConfigError(f"burn_in ({self.burn_in}) must be smaller than seq_len ({self.seq_len})")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")

    def _apply_preset(self) -> None:
        _choice("preset", self.preset, tuple(IMPACT_PRESETS))
        if self.name != "impact":
            raise ConfigError(f"--preset {self.preset} is an IMPACT comparison preset: use it with --arch impact")
        for name, value in IMPACT_PRESETS[self.preset][0].items():
            _set_preset_field(self, self.preset, name, value)

    @property
    def target_update_interval(self) -> int:
        if self.target_update:
            return self.target_update
        return self.buffer_batches * self.replay_times if self.name == "impact" else 2500


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
    total_steps: int = 500_000
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
    device: str = "cpu"
    """Torch device for the learner (``cpu``, ``cuda``, ``cuda:1``)."""
    log_interval_s: float = 2.0
    """Seconds between metrics.csv rows and console updates."""
    checkpoint_every: int = 0
    """Env steps between checkpoints; 0 writes only the final one."""
    keep_checkpoints: int = 10
    """Periodic checkpoints kept on disk (evaluation uses the last 10)."""
    progress: bool = True
    """Show the console progress line."""
    torch_threads: int = 0
    """Intra-op threads of the learner's torch; 0 picks them by architecture (``learner_threads``)."""

    def __post_init__(self) -> None:
        _positive(self, "total_steps", "log_interval_s", "keep_checkpoints")
        _non_negative(self, "time_limit_s", "checkpoint_every", "seed", "torch_threads")
        if self.arch.preset:
            algo_name = IMPACT_PRESETS[self.arch.preset][1]
            if self.algo.name not in (algo_name, _default(AlgoCfg, "name")):
                raise ConfigError(f"--preset {self.arch.preset} runs --algo {algo_name}, but --algo {self.algo.name} "
                                  "was given: drop one of the two")
            object.__setattr__(self, "algo", dataclasses.replace(self.algo, name=algo_name))
        if self.arch.name == "impact" and self.algo.kl_coef > 0 and not self.arch.use_target_network:
            raise ConfigError("--kl-coef penalises KL(target || learner) and needs the target network: "
                              "drop --no-use-target-network or set --kl-coef 0")
        if self.algo.name not in ARCH_ALGOS[self.arch.name]:
            raise ConfigError(
                f"--arch {self.arch.name} does not run --algo {self.algo.name}: "
                f"choose one of {', '.join(ARCH_ALGOS[self.arch.name])}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda") or self.device == "mps"):
            raise ConfigError(f"unknown device {self.device!r}: use cpu, cuda or cuda:N")

    @property
    def learner_threads(self) -> int:
        """``torch_threads``, else every core for paac (its env workers idle while the learner computes)
        and half the cores for the asynchronous architectures (envs step while the learner computes;
        oversubscribed OpenMP threads spin, measured 8x slower Nature-CNN forwards)."""
        if self.torch_threads:
            return self.torch_threads
        cores = os.cpu_count() or 1
        return cores if self.arch.name == "paac" else max(1, cores // 2)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunCfg":
        """Rebuild a config written by ``to_dict`` (tuples come back from JSON lists)."""
        parts = {"env": EnvCfg, "model": ModelCfg, "algo": AlgoCfg, "arch": ArchCfg}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in parts:
                sub = dict(value)
                if "env_args" in sub:
                    sub["env_args"] = tuple(tuple(kv) for kv in sub["env_args"])
                if "hidden" in sub:
                    sub["hidden"] = tuple(sub["hidden"])
                kwargs[key] = parts[key](**sub)
            else:
                kwargs[key] = value
        return cls(**kwargs)


def _default(cls: type, name: str) -> Any:
    return cls.__dataclass_fields__[name].default  # type: ignore[attr-defined]


def _set_preset_field(cfg: Any, preset: str, name: str, value: Any) -> None:
    """Set a field a preset fixes (frozen dataclass, so during construction only). A value that is neither
    the preset's nor the default was chosen explicitly and contradicts the preset: refuse it."""
    current = getattr(cfg, name)
    if current not in (value, _default(type(cfg), name)):
        raise ConfigError(f"--preset {preset} sets {name} to {value!r}, but it was given as {current!r}: "
                          "drop one of the two")
    object.__setattr__(cfg, name, value)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (for --help and the README)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)  # type: ignore[attr-defined]
    return docs
