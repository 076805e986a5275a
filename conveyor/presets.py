"""Presets: the value of every config field a run leaves unset, by architecture, algorithm and env family.

A preset field is one whose dataclass default is ``None`` (``BASE`` lists them
all). ``RunCfg.__post_init__`` calls ``resolve``, which fills each None from
the first of these layers that names the field, most specific first:

1. ``--preset NAME`` (IMPACT comparison presets: they fix fields, and an
   explicit value that contradicts one is refused);
2. ``PRESET_FAMILY[(NAME, family)]`` (tuned values of a ``--preset`` run,
   which flags override as any other preset value);
3. ``ARCH_ALGO_FAMILY[(arch, algo, family)]`` (one architecture's run of an algorithm);
4. ``ALGO_FAMILY[(algo, family)]``;
5. ``FAMILY[family]``;
6. ``ALGO[algo]``;
7. ``BASE``.

The algorithm itself, when not given, is the architecture's own
(first in ``ARCH_ALGOS``) or the one ``--preset`` runs. A value may be a ``Derived``:
computed from the config once every plain value is in (IMPACT's target network:
``target_update = buffer_batches * replay_times``). Explicit values, from flags or Python, always
win, even when they equal the preset's.

Env families: ``atari`` (``ALE/...``, ``...NoFrameskip-v4``), ``minatar``
(``MinAtar/...``), ``mujoco`` (the gymnasium entry point lives in a ``mujoco``
module), else ``classic-discrete`` or ``classic-continuous`` by the action
space (conveyor's own envs, ``conveyor/StepTime-v0``, are classic-discrete; so
is an env of your own, ``MODULE:ID``, with a Discrete action space). A config
is no place to build an env, so ``resolve`` takes the family as given:
``RunCfg`` passes ``EnvCfg.family``, which it fills from ``id_family`` where
the id tells it (every id above but your own); for the rest,
``conveyor.envs.gym_api.env_family`` builds the env once (``conveyor train``
does so before it builds the config; in Python, pass ``EnvCfg(family=...)``).

Every value cites its source in a ``# source:`` comment on its line (a test
checks): a paper table, a reference configuration (seed_rl, rl-baselines3-zoo
``hyperparams/*.yml``, CleanRL), or "tuned here" with the run that chose it.
``conveyor presets`` prints these tables; ``conveyor presets --arch A --algo L
--env E [train flags]`` prints a run's resolved config and where each value
came from (``cli.py`` formats both, beside the command). What a run's sizing asks of the
machine (CPUs, a GPU, torchrun's ranks) is in ``hosts.py``.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any, Callable

import conveyor.hosts as hosts
from conveyor.errors import ConfigError
from conveyor.imports import is_ref

# IMPACT paper comparison presets (`--preset`): the arch fields and the algorithm each one fixes.
IMPACT_PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "impact": ({"use_target_network": True}, "impact"),
    "appo": ({"replay_times": 1, "use_target_network": False}, "impact"),
    "impala": ({"replay_times": 1, "use_target_network": False}, "vtrace"),
}


def is_atari_id(env_id: str) -> bool:
    return env_id.startswith("ALE/") or env_id.endswith("NoFrameskip-v4")


MINATAR_PREFIX = "MinAtar/"


def is_minatar_id(env_id: str) -> bool:
    return env_id.startswith(MINATAR_PREFIX)


FAMILIES = ("classic-discrete", "classic-continuous", "atari", "mujoco", "minatar")
OWN_ENVS_PREFIX = "conveyor/"
"""The namespace of conveyor's own envs (``conveyor/StepTime-v0``, ``conveyor/Memory-v0``): all act discretely."""

GYMNASIUM_CONTINUOUS: dict[str, bool | tuple[str, bool]] = {
    "gymnasium.envs.classic_control.cartpole:CartPoleEnv": False,
    "gymnasium.envs.classic_control.acrobot:AcrobotEnv": False,
    "gymnasium.envs.classic_control.mountain_car:MountainCarEnv": False,
    "gymnasium.envs.classic_control.continuous_mountain_car:Continuous_MountainCarEnv": True,
    "gymnasium.envs.classic_control.pendulum:PendulumEnv": True,
    "gymnasium.envs.box2d.bipedal_walker:BipedalWalker": True,
    "gymnasium.envs.box2d.lunar_lander:LunarLander": ("continuous", False),
    "gymnasium.envs.box2d.car_racing:CarRacing": ("continuous", True),
}
"""gymnasium's own envs outside MuJoCo, by entry point: whether their actions are continuous (a Box), or the
constructor keyword that says so and its default (``LunarLanderContinuous-v3`` registers ``continuous=True``;
``--env-arg continuous=true`` does too). A test builds each to check."""


def id_family(env_id: str, env_args: tuple[tuple[str, Any], ...] = ()) -> str | None:
    """The preset family of ``env_id`` (see the module docstring) where the id tells it without building the
    env: Atari and MinAtar ids, conveyor's own envs, gymnasium's MuJoCo envs and those of ``GYMNASIUM_CONTINUOUS``
    (with ``env_args``); None for any other (``conveyor.envs.gym_api.env_family`` builds it to find out)."""
    if is_atari_id(env_id):
        return "atari"
    if is_minatar_id(env_id):
        return "minatar"
    if env_id.startswith(OWN_ENVS_PREFIX):
        return "classic-discrete"
    if is_ref(env_id):
        return None
    import gymnasium as gym  # here: a config of an Atari or MinAtar id, or the preset tables, need none of it

    spec = gym.registry.get(env_id)
    entry = spec.entry_point if spec is not None else None
    if not isinstance(entry, str):
        return None
    if entry.startswith("gymnasium.envs.mujoco."):
        return "mujoco"
    continuous = GYMNASIUM_CONTINUOUS.get(entry)
    if isinstance(continuous, tuple):
        keyword, default = continuous
        continuous = {**spec.kwargs, **dict(env_args)}.get(keyword, default)
    if continuous is None:
        return None
    return "classic-continuous" if continuous else "classic-discrete"


CARTPOLE_VECTOR_ENV = "gymnasium.envs.classic_control.cartpole:CartPoleVectorEnv"
NATIVE_VECTOR_ENVS = {CARTPOLE_VECTOR_ENV: ("max_episode_steps", "sutton_barto_reward")}
"""The native vector envs (a registry spec's ``vector_entry_point``) that the ``vector`` backend steps
(``conveyor.envs.native_vector``), each with the ``env_args`` its constructor takes. Kept here because presets
size batches by them: there a step costs each env about a microsecond, so a larger batch costs little more."""


def native_vector_entry(env_id: str) -> str:
    """The entry point of ``env_id``'s native vector env when the ``vector`` backend steps it (from the registry's
    spec: no env is built, no module imported), else ""."""
    if is_atari_id(env_id) or is_minatar_id(env_id) or is_ref(env_id):
        return ""
    import gymnasium as gym

    return spec_native_vector_entry(gym.registry.get(env_id))


def spec_native_vector_entry(spec: Any) -> str:
    """The vector entry point of a registry ``spec`` (None: no spec) when the ``vector`` backend steps it, else
    ""."""
    entry = spec.vector_entry_point if spec is not None else None
    return entry if isinstance(entry, str) and entry in NATIVE_VECTOR_ENVS else ""


SECTIONS = ("env", "model", "algo", "arch")


@dataclass(frozen=True)
class Derived:
    """A preset value computed from the partly resolved config: ``fn(cfg)``, with ``cfg.env.num_envs`` etc.
    holding explicit and plain preset values. ``text`` says how, for ``conveyor presets``."""

    text: str
    fn: Callable[[Any], Any]

    def __repr__(self) -> str:
        return self.text


# Which algorithms each architecture runs (a pair outside this table is refused: ``RunCfg``), its own first: the
# algorithm when --algo is not given (``own_algo``). The sources cite the architecture's own algorithm.
ARCH_ALGOS: dict[str, tuple[str, ...]] = {
    "paac": ("a2c", "ppo"),  # source: PAAC paper (Clemente et al. 2017), algorithm 1
    "ga3c": ("ga3c", "a2c"),  # source: GA3C paper (Babaeizadeh et al. 2017), eq. 5
    "seed": ("vtrace", "r2d2"),  # source: SEED RL paper (Espeholt et al. 2020), section 3.1
    "impact": ("impact", "vtrace"),  # source: IMPACT paper (Luo et al. 2020), section 3
    "hts": ("a2c", "ppo"),  # source: HTS-RL paper (Liu et al. 2020), section 5 (A2C and PPO)
}


def own_algo(arch: str) -> str:
    """The architecture's own algorithm: the one a run without --algo runs (first in ``ARCH_ALGOS``)."""
    return ARCH_ALGOS[arch][0]


BASE: dict[str, Any] = {
    "total_steps": 500_000,  # source: tuned here: `conveyor train` solves CartPole-v1 in ~170k steps; 3x headroom
    "env.num_envs": 16,  # source: tuned here: 16 envs on the 2 default workers (README, paac: default job)
    "env.num_workers": Derived("up to 2, a divisor of num_envs (a torchrun rank's share)",  # source: tuned here:
                               lambda c: hosts.env_workers(hosts.rank_envs(c), 2)),  # cheap envs step fastest
    # on 2 workers (README, the default job)
    "device": "cpu",  # source: SB3 docs, PPO: "meant to be run primarily on the CPU" without a CNN policy
    "env.normalize_reward": False,  # source: PAAC, IMPALA, SEED train on raw (clipped) rewards
    "model.name": "auto",  # source: SB3/CleanRL MLP for vectors; Nature CNN for frames (Mnih et al. 2015)
    "model.hidden": (64, 64),  # source: SB3 and CleanRL MLP policies: two layers of 64
    "model.lstm_size": 0,  # source: feed-forward, as in PAAC, GA3C, IMPACT and HTS-RL
    "model.normalize_obs": False,  # source: PAAC, IMPALA, SEED feed raw observations
    "model.normalize_values": False,  # source: PAAC, IMPALA, SEED, CleanRL and SB3 regress raw returns
    "model.separate_value_net": False,  # source: one trunk, two heads (A3C, Mnih et al. 2016; PAAC)
    "model.log_std_init": -0.5,  # source: tuned here: the Pendulum and HalfCheetah rows of BENCHMARKS.md (SB3: 0.0)
    "model.weight_init": "orthogonal",  # source: CleanRL ppo.py / SB3 ortho_init (gains sqrt 2, 0.01, 1)
    "model.gsde": False,  # source: PAAC, GA3C, IMPALA, IMPACT, HTS-RL explore with a state-independent std
    "model.gsde_interval": 8,  # source: rl-zoo a2c.yml Pendulum-v1 n_steps 8: SB3 draws W once per rollout
    "algo.gamma": 0.99,  # source: PAAC section 5.1, GA3C, IMPALA, IMPACT table 1
    "algo.lr": 3e-4,  # source: CleanRL ppo_continuous_action.py learning_rate (every algorithm sets its own)
    "algo.lr_schedule": "constant",  # source: PAAC section 5.1, GA3C, SEED table 8, IMPACT table 1: a fixed lr
    "algo.optimizer": "adam",  # source: CleanRL / SB3 PPO, SEED table 8 (R2D2), IMPACT (RLlib Adam)
    "algo.rmsprop_eps": 1e-5,  # source: HTS-RL table A4 (A2C RMSProp eps 1e-5); rl-zoo a2c.yml atari eps 1e-5
    "algo.adam_eps": 1e-5,  # source: CleanRL ppo.py / SB3 PPO Adam eps 1e-5
    "algo.max_grad_norm": 40.0,  # source: PAAC section 5.1 (gradient clipping at 40)
    "algo.entropy_coef": 0.01,  # source: PAAC beta 0.01; IMPACT table 1; HTS-RL table A4
    "algo.value_coef": 0.5,  # source: IMPALA baseline cost 0.5; HTS-RL table A4; SB3 vf_coef 0.5
    "algo.gae_lambda": 0.95,  # source: PPO paper table 3; CleanRL ppo.py gae_lambda 0.95
    "algo.ppo_epochs": 4,  # source: CleanRL ppo_atari.py update_epochs 4
    "algo.ppo_minibatches": 4,  # source: CleanRL ppo_atari.py num_minibatches 4
    "algo.clip": 0.2,  # source: PPO paper section 6.1 (epsilon 0.2)
    "algo.n_step": 5,  # source: SEED table 8 (n-steps 5)
    "algo.exploration_eps": 0.4,  # source: SEED table 8: i-th actor of N uses 0.4 ** (1 + 7 i / (N - 1))
    "algo.normalize_advantages": True,  # source: CleanRL ppo.py norm_adv; SB3 PPO normalize_advantage
    "arch.unroll": 5,  # source: PAAC section 5.1 and GA3C section 3: t_max = 5
    "arch.env_groups": 1,  # source: tuned here: BENCHMARKS.md "PAAC env groups": 2 groups were no faster on the
    # 2-core CPU on any env measured (Pong 0.74x, StepTime 0.99x, CartPole 0.80x the SPS), so no family turns them on
    "arch.sync_interval": 5,  # source: HTS-RL table A4: A2C unroll 5 (one update per swap of alpha steps)
    "arch.num_agents": 16,  # source: GA3C section 5.1: N_A in {16, 32, 64, 128}, 16 the smallest (A3C's 16 agents)
    "arch.min_train_batch": 20,  # source: GA3C figure 7: best with a minimum training batch of 20-40
    "arch.batch_size": 32,  # source: IMPALA batch 32 (HTS-RL table A4)
    "arch.seq_len": 80,  # source: seed_rl gcp/train_atari.sh: unroll_length 80 (R2D2)
    "arch.burn_in": 40,  # source: SEED table 8: 40 burn-in steps
    "arch.replay_capacity": 400_000,  # source: SEED table 8 holds 1e5 sequences; 1e4 of 40 new steps (4e5 steps) here
    "arch.min_replay": 500,  # source: SEED table 8: 5000 of 1e5 sequences (5%), here 5% of the capacity
    "arch.replay_ratio": 0.75,  # source: SEED table 8 (replay ratio 0.75)
    "arch.worker_batch": 50,  # source: IMPACT table 1: sample batch size 50
    "arch.buffer_batches": 4,  # source: IMPACT table 1: N = 4
    "arch.replay_times": 2,  # source: IMPACT table 1: K = 2
    "arch.use_target_network": True,  # source: IMPACT section 3 (target network for the surrogate ratio)
    "arch.target_update": Derived("buffer_batches * replay_times",  # source: IMPACT section 4.1.1: t_target = N * K
                                  lambda c: c.arch.buffer_batches * c.arch.replay_times),
}

ALGO: dict[str, dict[str, Any]] = {
    "a2c": {
        "algo.optimizer": "rmsprop",  # source: PAAC section 5.1 (RMSProp); HTS-RL table A4
        "algo.lr": 7e-4,  # source: HTS-RL table A4 (A2C lr 0.0007); SB3 A2C default learning_rate
    },
    "ppo": {
        "algo.lr": 2.5e-4,  # source: PPO paper table 5 (Atari 2.5e-4); CleanRL ppo_atari.py
        "algo.max_grad_norm": 0.5,  # source: CleanRL ppo.py max_grad_norm 0.5; SB3 PPO default
        "algo.clip": 0.1,  # source: PPO paper table 5 (Atari epsilon 0.1); CleanRL ppo_atari.py clip_coef 0.1
        "arch.unroll": 128,  # source: PPO paper table 5 (horizon 128); CleanRL ppo_atari.py num_steps 128
        "arch.sync_interval": 128,  # source: as unroll (HTS-RL: one update per swap of alpha steps)
    },
    "vtrace": {
        "algo.lr": 6e-4,  # source: IMPALA paper (Espeholt et al. 2018) Atari lr 0.0006 (RMSProp; Adam here)
        "arch.unroll": 20,  # source: IMPALA unroll length 20 (HTS-RL table A4)
    },
    "impact": {
        "algo.lr": 5e-4,  # source: issue 15: Pong -20 -> +6.9 in 2.78M steps with lr 5e-4 (IMPACT table 1: 1e-4)
    },
    "r2d2": {
        "algo.lr": 1e-4,  # source: SEED table 8: Adam lr 1e-4
        "algo.adam_eps": 1e-3,  # source: SEED table 8: Adam epsilon 1e-3
        "algo.max_grad_norm": 80.0,  # source: SEED table 8: gradient norm clipping 80
        "model.lstm_size": 64,  # source: tuned here: tests/test_r2d2.py CartPole run (SEED: 512 on Atari)
        "arch.target_update": 2500,  # source: SEED table 8: target network update interval 2500 updates
    },
    "ga3c": {
        "algo.optimizer": "rmsprop",  # source: GA3C section 3, eq. 3 (non-centered RMSProp)
        "algo.lr": 3e-4,  # source: GA3C figure 6: learning rates 0.0003 and 0.0001
    },
}

FAMILY: dict[str, dict[str, Any]] = {
    "classic-discrete": {  # GA3C's agents each step one env: fewer, and smaller training batches, on cheap envs
        "arch.num_agents": 8,  # source: tuned here: tests/test_ga3c.py CartPole run (8 agents)
        "arch.min_train_batch": 8,  # source: tuned here: tests/test_ga3c.py CartPole run (8 segments)
    },
    "atari": {
        "total_steps": 10_000_000,  # source: rl-zoo a2c.yml / ppo.yml atari n_timesteps 1e7
        "algo.lr_schedule": "linear",  # source: A3C (Mnih et al. 2016) and IMPALA experiment.py anneal lr to 0;
        # OpenAI baselines a2c lrschedule='linear'; PPO paper table 5 (alpha 1 -> 0); CleanRL anneal_lr. Measured
        # here: a Pong fork at 7.21M steps, BENCHMARKS.md "lr decay in the Atari presets" (GA3C, R2D2 keep theirs)
        "env.num_envs": 32,  # source: PAAC section 5.1: n_e = 32
        "env.num_workers": Derived("up to the CPUs (per SEED actor, rank)",  # source: tuned here: Pong steps as
                                   lambda c: hosts.env_workers(hosts.rank_envs(c), hosts.cpus_per_env_host(c))),
        # fast as its env processes: 1,906 SPS on 2 (2-core CPU), 4,280 on 8 and 5,974 with 64 envs on 16 (16-core H200
        # machine); issue 15's cuda Pong runs: 32 envs on 16 workers (BENCHMARKS.md "env limit")
        "device": Derived("cuda where torch sees a GPU",  # source: CleanRL ppo_atari.py --cuda True (the GPU when
                          lambda c: hosts.accelerator()),  # there is one); SB3 device "auto"
    },
    "classic-continuous": {
        "algo.gamma": 0.9,  # source: rl-zoo ppo.yml Pendulum-v1 gamma 0.9
        "algo.entropy_coef": 0.0,  # source: rl-zoo ppo.yml Pendulum-v1 ent_coef 0.0
        "algo.max_grad_norm": 0.5,  # source: SB3 PPO / A2C default max_grad_norm 0.5 (rl-zoo Pendulum)
    },
    "mujoco": {
        "total_steps": 1_000_000,  # source: rl-zoo ppo.yml HalfCheetah-v3 n_timesteps 1e6
        "algo.entropy_coef": 0.0,  # source: CleanRL ppo_continuous_action.py ent_coef 0.0
        "algo.max_grad_norm": 0.5,  # source: CleanRL ppo_continuous_action.py max_grad_norm 0.5
    },
    "minatar": {
        "total_steps": 5_000_000,  # source: MinAtar paper (Young & Tian 2019), experiments: 5M frames per run
        "model.name": "minatar_cnn",  # source: MinAtar paper (Young & Tian 2019), experiments: conv 16 3x3/1, fc 128
    },
}

# Actor-critic on continuous control: running observation and reward normalization, separate policy and value
# networks (SB3 / rl-zoo `normalize: true` with MlpPolicy; CleanRL ppo_continuous_action.py).
CONTINUOUS_CONTROL: dict[str, Any] = {
    "env.normalize_reward": Derived("unless backend == envpool",  # source: CleanRL ppo_continuous_action.py
                                    lambda c: c.env.backend != "envpool"),  # NormalizeReward
    "model.normalize_obs": True,  # source: CleanRL ppo_continuous_action.py NormalizeObservation; rl-zoo normalize
    "model.separate_value_net": Derived("without an LSTM core",  # source: CleanRL ppo_continuous_action.py:
                                       lambda c: not c.model.lstm_size),  # separate actor and critic MLPs
}

ALGO_FAMILY: dict[tuple[str, str], dict[str, Any]] = {
    ("a2c", "atari"): {  # not PAAC section 5.1's lr = 0.0007 * n_e with RMSProp eps 0.1: on conveyor's mean loss,
        # with torch's eps outside the root, its steps are ~30x smaller; Pong stayed at -20.4 (uniform policy)
        # for 1.44M steps where these values reached -17.1 (BENCHMARKS.md "paac/a2c on Pong").
        "algo.lr": 7e-4,  # source: HTS-RL table A4 (A2C on Atari, Kostrikov's torch A2C); measured here on Pong
        "algo.rmsprop_eps": 1e-5,  # source: HTS-RL table A4 (RMSProp eps 1e-5, torch's RMSprop); rl-zoo a2c.yml
    },
    ("a2c", "classic-discrete"): {
        "algo.lr": 2e-3,  # source: tuned here: paac/a2c with 16 envs solved CartPole-v1 in ~170k steps (hts/a2c's)
        "env.normalize_reward": Derived("unless backend == envpool",  # source: rl-zoo a2c.yml Acrobot-v1 normalize:
                                        lambda c: c.env.backend != "envpool"),  # true; measured here: paac/a2c
        # Acrobot-v1 seed 0 reached -100 at 168k steps with it and stayed at -500 (the policy's entropy gone) to
        # 600k without it at lr 1e-2, 3e-3 and 1e-3; CartPole-v1 is as fast with it (docs/benchmarks-log.md
        # "Fastest to a trained agent, round 3")
    },
    ("a2c", "classic-continuous"): {  # rl-zoo's A2C recipe for Pendulum-v1, gSDE and PyTorch's init included
        **CONTINUOUS_CONTROL,
        "env.num_envs": 8,  # source: rl-zoo a2c.yml Pendulum-v1 n_envs 8
        "arch.unroll": 8,  # source: rl-zoo a2c.yml Pendulum-v1 n_steps 8
        "arch.sync_interval": 8,  # source: as unroll (HTS: alpha = unroll)
        "model.gsde": True,  # source: rl-zoo a2c.yml Pendulum-v1 use_sde True
        "model.weight_init": "torch",  # source: rl-zoo a2c.yml Pendulum-v1 ortho_init False
        "model.log_std_init": -2.0,  # source: rl-zoo a2c.yml Pendulum-v1 log_std_init -2
        "algo.value_coef": 0.4,  # source: rl-zoo a2c.yml Pendulum-v1 vf_coef 0.4
        "algo.gae_lambda": 0.9,  # source: rl-zoo a2c.yml Pendulum-v1 gae_lambda 0.9 (unused by A2C's n-step returns)
    },
    ("a2c", "mujoco"): {
        **CONTINUOUS_CONTROL,
        "arch.unroll": 8,  # source: rl-zoo a2c.yml HalfCheetahBulletEnv-v0 n_steps 8
        "algo.lr": 9.6e-4,  # source: rl-zoo a2c.yml HalfCheetahBulletEnv-v0 learning_rate lin_0.00096
        "algo.value_coef": 0.4,  # source: rl-zoo a2c.yml HalfCheetahBulletEnv-v0 vf_coef 0.4
    },
    ("ppo", "classic-discrete"): {  # rl-zoo's CartPole recipe with fewer epochs: soonest to 475 in wall-clock
        # (paac/ppo CartPole seeds 0-1: 164k/178k steps in 36/42 s on the loaded 2-core CPU, where the earlier
        # 16 x 5 steps with 4 x 4 minibatches, 16 gradient steps per 80 env steps, took 200k/180k in 344/197 s:
        # BENCHMARKS.md "Fastest to a trained agent")
        "env.num_envs": 16,  # source: tuned here: as above (rl-zoo ppo.yml CartPole-v1: 8 envs x 32 steps)
        "arch.unroll": 32,  # source: rl-zoo ppo.yml CartPole-v1 n_steps 32
        "arch.sync_interval": 32,  # source: as unroll (HTS alpha = unroll)
        "algo.ppo_epochs": 4,  # source: tuned here: as above (rl-zoo ppo.yml CartPole-v1 n_epochs 20: 5x the updates)
        "algo.ppo_minibatches": 2,  # source: rl-zoo ppo.yml CartPole-v1 batch_size 256 (here 512 steps / 2)
        "algo.lr": 1e-3,  # source: rl-zoo ppo.yml CartPole-v1 learning_rate lin_0.001 (constant here)
        "algo.gamma": 0.98,  # source: rl-zoo ppo.yml CartPole-v1 gamma 0.98
        "algo.gae_lambda": 0.8,  # source: rl-zoo ppo.yml CartPole-v1 gae_lambda 0.8
        "algo.entropy_coef": 0.0,  # source: rl-zoo ppo.yml CartPole-v1 ent_coef 0.0
        "algo.clip": 0.2,  # source: rl-zoo ppo.yml CartPole-v1 clip_range lin_0.2 (constant here)
        "algo.max_grad_norm": 40.0,  # source: tuned here: as above (PAAC's clip; SB3's 0.5 not measured)
    },
    ("ppo", "classic-continuous"): {
        **CONTINUOUS_CONTROL,
        "arch.unroll": 64,  # source: rl-zoo ppo.yml Pendulum-v1: 4 envs x 1024 steps; here 16 x 64 per update
        "arch.sync_interval": 64,  # source: as unroll (HTS: alpha = unroll)
        "algo.ppo_epochs": 10,  # source: rl-zoo ppo.yml Pendulum-v1 n_epochs 10
        "algo.ppo_minibatches": 16,  # source: rl-zoo ppo.yml Pendulum-v1 batch_size 64 (SB3 default): 16 x 64
        "algo.gae_lambda": 0.95,  # source: rl-zoo ppo.yml Pendulum-v1 gae_lambda 0.95
        "algo.lr": 3e-4,  # source: CleanRL ppo_continuous_action.py 3e-4; tuned here: Pendulum seed 1 at 300k: paac
        # -401, hts -281 (rl-zoo's 1e-3, made for gSDE: -492, -365; approx KL 0.26 per rollout)
        "algo.clip": 0.2,  # source: rl-zoo ppo.yml Pendulum-v1 clip_range 0.2
    },
    ("ppo", "mujoco"): {
        **CONTINUOUS_CONTROL,
        "env.num_envs": 32,  # source: CleanRL ppo_continuous_action.py: 2048 steps per update (here 32 envs x 64)
        "arch.unroll": 64,  # source: CleanRL ppo_continuous_action.py num_steps 2048 (32 x 64)
        "arch.sync_interval": 64,  # source: as unroll (HTS: alpha = unroll)
        "algo.ppo_epochs": 10,  # source: CleanRL ppo_continuous_action.py update_epochs 10
        "algo.ppo_minibatches": 32,  # source: CleanRL ppo_continuous_action.py num_minibatches 32
        "algo.lr": 3e-4,  # source: CleanRL ppo_continuous_action.py learning_rate 3e-4
        "algo.clip": 0.2,  # source: CleanRL ppo_continuous_action.py clip_coef 0.2
    },
    ("ppo", "atari"): {
        "env.num_envs": 8,  # source: CleanRL ppo_atari.py num_envs 8; rl-zoo ppo.yml atari n_envs 8
        # Sample Factory's Atari recipe is this batch with frames and value targets standardized; it reached Pong's 0
        # in 0.80M steps where these presets without them were at -15.1 at 1.15M. With them paac/ppo reached 0 in
        # 0.91M steps, 2,341.8 s, where paac/a2c took 3,387.6 s and Sample Factory 5,085.9 s (the race on Pong,
        # BENCHMARKS.md; docs/benchmarks-log.md "Pong at 2.17x")
        "model.normalize_obs": True,  # source: Sample Factory sf_examples/atari/atari_params.py normalize_input
        "model.normalize_values": True,  # source: Sample Factory sf_examples/atari/atari_params.py normalize_returns
    },
    ("vtrace", "atari"): {
        "algo.lr": 6e-4,  # source: IMPALA Atari lr 0.0006; Adam (the issue 15 RMSProp eps 0.1 stalled Pong)
        "arch.batch_size": 8,  # source: tuned here: 160 steps per update, as PAAC's 32 x 5 (IMPALA's 32 x 20 made
        # 1,709 updates in 1.09M Pong steps and left the policy uniform, -20.4; with 8: -17.4 at 1.67M, seed 1;
        # BENCHMARKS.md, 2026-11-26)
    },
    ("vtrace", "classic-discrete"): {
        "env.num_envs": 8,  # source: tuned here: README seed example, 2 local actors x 8 envs
        "arch.unroll": 5,  # source: tuned here: seed/vtrace CartPole seed 1: 475 at 230k (unroll 20: 279 at 300k)
        "arch.batch_size": 16,  # source: tuned here: with unroll 5, 80 steps per update as PAAC's 16 x 5
        "algo.lr": 2e-3,  # source: tuned here: README seed example (--optimizer adam --lr 0.002)
    },
    ("vtrace", "classic-continuous"): {  # rl-zoo's A2C recipe for Pendulum-v1 (a2c.yml): V-trace on 8-step unrolls
        # is A2C's n-step return with importance weights, and it learns only with gSDE and PyTorch's default init
        # (Adam 1e-3, unroll 20, no gSDE: ~-1000; SB3 A2C with orthogonal init: -1023; BENCHMARKS.md, 2026-11-26)
        **CONTINUOUS_CONTROL,
        "env.num_envs": 8,  # source: tuned here: as on classic-discrete (2 local actors x 8 envs; rl-zoo A2C: 8)
        "arch.batch_size": 8,  # source: tuned here: as on classic-discrete
        "arch.unroll": 8,  # source: rl-zoo a2c.yml Pendulum-v1 n_steps 8
        "model.gsde": True,  # source: rl-zoo a2c.yml Pendulum-v1 use_sde True
        "model.weight_init": "torch",  # source: rl-zoo a2c.yml Pendulum-v1 ortho_init False
        "model.log_std_init": -1.5,  # source: tuned here: rl-zoo a2c.yml's -2 left seeds 2 and 8 of 1-9 below -400
        # at 300k (-359 +- 302); with -1.5 each of seeds 1-14 swings up: -242 +- 49 (BENCHMARKS.md, 2026-11-26)
        "algo.optimizer": "rmsprop",  # source: rl-zoo a2c.yml Pendulum-v1 use_rms_prop True (eps 1e-5, BASE)
        "algo.lr": 7e-4,  # source: rl-zoo a2c.yml Pendulum-v1 learning_rate lin_7e-4 (constant here)
        "algo.value_coef": 0.4,  # source: rl-zoo a2c.yml Pendulum-v1 vf_coef 0.4
    },
    ("vtrace", "minatar"): {  # IMPALA's 32 x 20 steps per update made 1,560 updates in the matrix's 1M steps:
        # Asterix 0.7 / 0.9 and Seaquest 1.0 / 0.9 (seeds 1 / 2: random play), where paac/a2c's 80 steps made 12,500
        "arch.unroll": 5,  # source: tuned here: seed/vtrace MinAtar/Asterix-v1 at 1M: 13.2 / 11.7 (seeds 1 / 2), with
        # batch 8 of 20-step unrolls 2.1 / 2.3 (docs/benchmarks-log.md, 2026-12-02)
        "arch.batch_size": 16,  # source: tuned here: with unroll 5, 80 steps per update as PAAC's 16 x 5
    },
    ("vtrace", "mujoco"): {
        **CONTINUOUS_CONTROL,
        "algo.lr": 1.5e-5,  # source: IMPACT table 2: IMPALA lr 1.5e-5 on continuous control
        "algo.gamma": 0.995,  # source: IMPACT table 2: IMPALA discount 0.995
    },
    ("impact", "atari"): {
        "arch.worker_batch": 64,  # source: issue 15: Pong -20 -> +6.9 in 2.78M steps with worker_batch 64
    },
    ("impact", "classic-discrete"): {
        "env.num_envs": 8,  # source: tuned here: tests/test_impact.py CartPole run (8 envs, 2 workers)
        "arch.worker_batch": 32,  # source: tuned here: tests/test_impact.py CartPole run
        "arch.replay_times": 4,  # source: tuned here: impact CartPole-v1 seeds 0-2 reached 475 at 125k-139k steps
        # in 28-31 s of the run with K = 4, with K = 2 at 152k-201k in 28-36 s, and with K = 8 in 40-76 s from the
        # command (the race); IMPACT section 4: K = 2 works best on discrete tasks (benchmarks/preset_sweep.py,
        # benchmarks/results/preset_sweep.csv; docs/benchmarks-log.md "Fastest to a trained agent, round 3")
        "algo.lr": 1e-3,  # source: rl-zoo ppo.yml CartPole-v1 learning_rate 1e-3 (tests/test_impact.py)
        "algo.gamma": 0.98,  # source: rl-zoo ppo.yml CartPole-v1 gamma 0.98 (tests/test_impact.py)
        "algo.gae_lambda": 0.8,  # source: rl-zoo ppo.yml CartPole-v1 gae_lambda 0.8 (tests/test_impact.py)
        "env.normalize_reward": Derived("unless backend == envpool",  # source: rl-zoo ppo.yml Acrobot-v1 normalize:
                                        lambda c: c.env.backend != "envpool"),  # true; measured here: impact
        # Acrobot-v1 seed 0 reached -100 at 24k steps with it, and CartPole-v1 seed 0 475 in 29 s with it, 39 s
        # without (docs/benchmarks-log.md "Fastest to a trained agent, round 3")
    },
    ("impact", "classic-continuous"): {
        **CONTINUOUS_CONTROL,
        "env.num_envs": 8,  # source: tuned here: tests/test_impact.py Pendulum run (8 envs, 2 workers)
        "arch.worker_batch": 50,  # source: tuned here: tests/test_impact.py Pendulum run
        "arch.replay_times": 16,  # source: tuned here: tests/test_impact.py Pendulum run (K = 16)
        "algo.lr": 3e-4,  # source: CleanRL ppo_continuous_action.py 3e-4, as the PPO preset; tuned here: impact
        # Pendulum seeds 1-5 at 300k: -200, -342, -197, -208, -168 (rl-zoo's 1e-3, made for gSDE: -202, -399, -274;
        # 3e-4 annealed linearly to 0: -359, -236, -225)
    },
    ("impact", "mujoco"): {
        **CONTINUOUS_CONTROL,
        "arch.buffer_batches": 16,  # source: IMPACT table 2: N = 16
        "arch.replay_times": 20,  # source: IMPACT table 2: K = 20
        "algo.lr": 3e-4,  # source: IMPACT table 2: lr 3e-4
        "algo.gamma": 0.995,  # source: IMPACT table 2: discount 0.995
        "algo.gae_lambda": 0.995,  # source: IMPACT table 2: lambda 0.995
        "algo.clip": 0.4,  # source: IMPACT table 2: clip 0.4
    },
    ("r2d2", "atari"): {
        "model.lstm_size": 512,  # source: SEED table 8 / R2D2: LSTM 512
        "algo.gamma": 0.997,  # source: SEED table 8: discount 0.997
        "arch.batch_size": 64,  # source: SEED table 8: training batch size 64
        "arch.replay_capacity": 250_000,  # source: SEED table 8 holds 1e5 sequences; 250k steps of one frame fit 2 GiB
        "arch.min_replay": 312,  # source: SEED table 8: 5% of the capacity (312 sequences of 40 new steps) first
        "algo.lr_schedule": "constant",  # source: seed_rl atari/r2d2_main.py create_optimizer: a fixed lr
    },
    ("r2d2", "classic-discrete"): {
        "env.num_envs": 8,  # source: tuned here: tests/test_r2d2.py CartPole run (2 local actors x 8 envs)
        "model.hidden": (64,),  # source: tuned here: tests/test_r2d2.py CartPole run
        "algo.lr": 1e-3,  # source: tuned here: tests/test_r2d2.py CartPole run
        "arch.seq_len": 20,  # source: tuned here: tests/test_r2d2.py CartPole run
        "arch.burn_in": 5,  # source: tuned here: tests/test_r2d2.py CartPole run
        "arch.min_replay": 50,  # source: tuned here: tests/test_r2d2.py CartPole run
        "arch.replay_capacity": 20_000,  # source: tuned here: tests/test_r2d2.py CartPole run (2000 sequences)
        "arch.replay_ratio": 8.0,  # source: tuned here: seed/r2d2 CartPole-v1 seed 1: 475 at 294k (2.0: 113 at 300k)
        "algo.exploration_eps": 0.1,  # source: tuned here: as replay_ratio; rl-zoo dqn.yml CartPole-v1 final eps 0.04
        "arch.target_update": 100,  # source: tuned here: tests/test_r2d2.py CartPole run (syncs every 100 updates)
        "algo.adam_eps": 1e-5,  # source: tuned here: seed/r2d2 CartPole-v1 seeds 1-4: 475 at 127k/219k/259k/211k
        # (SEED's 1e-3, sized for Atari's value-rescaled TD errors, exceeds sqrt(v) of CartPole's gradients once the
        # TD errors fall to ~0.03 and damps every step: 294k/149k/203k, seed 4 178 at 300k)
    },
    ("r2d2", "minatar"): {  # the base (Atari) values made 574 updates in 1M steps: return 0.77 (random 0.3)
        "algo.lr": 2.5e-4,  # source: MinAtar paper (Young & Tian 2019), DQN step size 0.00025
        "arch.seq_len": 20,  # source: tuned here: as classic-discrete; seed/r2d2 MinAtar/Breakout-v1 seed 1: 2.55 at
        # 279k steps (900 s, 6,894 updates) with this group
        "arch.burn_in": 5,  # source: tuned here: as classic-discrete (seq_len 20)
        "arch.min_replay": 250,  # source: tuned here: 2,500 steps before learning (MinAtar paper DQN: 5,000 frames)
        "arch.replay_ratio": 8.0,  # source: tuned here: as classic-discrete (one update per 40 env steps)
        "algo.exploration_eps": 0.1,  # source: MinAtar paper DQN final epsilon 0.1
        "arch.target_update": 100,  # source: tuned here: as classic-discrete
        "algo.adam_eps": 1e-5,  # source: tuned here: seed/r2d2 MinAtar/Breakout-v1 at 300k: 8.7 / 7.6 (seeds 1 / 2);
        # SEED's 1e-3: 2.55 at 279k / 0.0. The grad norm is 0.02-0.07, so 1e-3 exceeds sqrt(v), as on CartPole
    },
    ("ga3c", "atari"): {
        "env.num_envs": 32,  # source: PAAC section 5.1 n_e = 32 (GA3C acts with num_agents envs)
        "arch.num_agents": 32,  # source: GA3C section 5.1: N_A in {16, 32, 64, 128} on Pong
        "algo.lr_schedule": "constant",  # source: GA3C Config.py LEARNING_RATE_START = LEARNING_RATE_END = 0.0003
    },
    ("ga3c", "minatar"): {
        "algo.lr": 7e-4,  # source: tuned here: ga3c/ga3c MinAtar/Asterix-v1 at 1M: 10.3 / 12.8 (seeds 1 / 2) where GA3C's
        # 3e-4 gave 1.7 / 1.7 (docs/benchmarks-log.md, 2026-12-02); HTS-RL table A4's A2C lr 0.0007, as paac/a2c's
    },
    ("ga3c", "classic-discrete"): {
        "algo.lr": 3e-3,  # source: tuned here: ga3c/ga3c CartPole-v1 seed 1: 475 at 174k steps (tests/test_ga3c.py lr)
    },
}

def _recurrent_vtrace(cfg: Any, key: str, feed_forward: Any) -> Any:
    """seed/vtrace's classic-discrete ``key``: ``feed_forward`` without an LSTM core, else vtrace/classic-discrete's."""
    return ALGO_FAMILY[("vtrace", "classic-discrete")][key] if cfg.model.lstm_size else feed_forward


# Where one architecture's run of an algorithm wants other values than the others' (a layer above ALGO_FAMILY).
ARCH_ALGO_FAMILY: dict[tuple[str, str, str], dict[str, Any]] = {
    ("paac", "a2c", "classic-discrete"): {  # soonest to 475 in wall-clock: fewer, larger updates (PAAC fig. 3's
        # n_e axis). On the vector backend (CartPole's env steps cost little) paac/a2c CartPole-v1 seeds 0-8 with
        # 128 envs at lr 1e-2 reach 475 at 156k-278k steps, median 4.4 s of the run (3.5-6.1 s), where 64 envs at
        # 6e-3 (seeds 0-4) took 142k-226k steps and a median 7.7 s, 64 at 1e-2 7.0 s, 128 at 6e-3 6.3 s, 96 at 1e-2
        # 5.0 s (seeds 5-8), 128 at 1.3e-2 missed with seed 5; 256 envs took 356k-550k steps
        # (benchmarks/preset_sweep.py, benchmarks/results/preset_sweep.csv; docs/benchmarks-log.md "Fastest to a
        # trained agent, round 2"). On single envs 16 envs at lr 2e-3 took 2x 64's time.
        # Where the envs are stepped one by one (Acrobot: 115 us a step), the env's time grows with the batch and
        # sample efficiency decides: the a2c/classic-discrete 16 envs at 2e-3 (paac/a2c Acrobot-v1 seeds 0-2 with
        # 128 at 1e-2: -100 at 107k-168k steps, 17-24 s of the run; docs/benchmarks-log.md "Fastest to a trained
        # agent, round 3").
        "env.num_envs": Derived("128 where the vector backend steps the env (CartPole), else 16",  # source: here
                                lambda cfg: 128 if native_vector_entry(cfg.env.id) else 16),  # tuned: as above
        "algo.lr": Derived("1e-2 where the vector backend steps the env, else 2e-3",  # source: tuned here: as
                           lambda cfg: 1e-2 if native_vector_entry(cfg.env.id)  # above (the lr grows with the
                           else ALGO_FAMILY[("a2c", "classic-discrete")]["algo.lr"]),  # batch, PAAC 5.1: 0.0007 n_e)
    },
    ("paac", "ppo", "classic-continuous"): {  # rl-zoo's PPO recipe for Pendulum-v1 (ppo.yml), its 4,096 steps a
        # batch and 10 epochs, in fewer, larger steps for wall-clock. Flag for flag (4 envs x 1024, 64 minibatches,
        # lr 1e-3) seeds 0-1 crossed -250 at 57k-61k steps in 57-68 s of the command, 70% of it in 640 Adam steps
        # of 64 samples a batch; 16 envs x 256 (one batched forward acts for 4x the envs), 16 minibatches of 256
        # and lr 2e-3 took 61k-74k steps in 21-27 s (seeds 0-2, twice), where 4 envs with 16 minibatches at 2e-3
        # took 38-44 s, 8 envs x 512 26-30 s, 32 x 128 20-31 s (benchmarks/preset_sweep.py,
        # benchmarks/results/preset_sweep.csv; docs/benchmarks-log.md "Fastest to a trained agent, round 5"). The
        # ppo/classic-continuous values (16 envs x 64, lr 3e-4, normalized observations and rewards, no gSDE) took
        # 200k-354k steps, 181-317 s (round 4)
        "env.num_envs": 16,  # source: tuned here (rl-zoo ppo.yml Pendulum-v1: n_envs 4), as above
        "arch.unroll": 256,  # source: tuned here: rl-zoo's 4,096 steps a batch over 16 envs (n_steps 1024 x 4)
        "algo.ppo_minibatches": 16,  # source: tuned here: 256 samples each (rl-zoo batch_size 64), as above
        "algo.lr": 2e-3,  # source: tuned here with the larger minibatches (rl-zoo learning_rate 1e-3), as above
        "model.gsde": True,  # source: rl-zoo ppo.yml Pendulum-v1 use_sde True
        "model.gsde_interval": 4,  # source: rl-zoo ppo.yml Pendulum-v1 sde_sample_freq 4
        "model.log_std_init": 0.0,  # source: SB3 ActorCriticPolicy log_std_init 0.0 (rl-zoo sets none for Pendulum)
        "model.normalize_obs": False,  # source: rl-zoo ppo.yml Pendulum-v1: no normalize
        "env.normalize_reward": False,  # source: rl-zoo ppo.yml Pendulum-v1: no normalize
        "algo.value_coef": 1.0,  # source: SB3 PPO vf_coef 0.5 on the squared error; conveyor's value loss is half it
    },
    ("hts", "ppo", "classic-continuous"): {  # `conveyor tune --arch hts --algo ppo --env Pendulum-v1 --trials 24
        # --steps 300000` (benchmarks/results/tune/hts-ppo-Pendulum-v1): its best trial, 22 (-169.3), rounded to 3
        # digits, beat ppo/classic-continuous's values on seeds 100-104 by IQM -172.7 [-190.1, -165.0] against -333.9 [-651.0, -240.7]
        # (P(tuned > preset) 1.00 [1.00, 1.00]; benchmarks/tune_evidence.py, docs/tuning.md). Its 32 envs x 128-step rounds also
        # step ~12x faster than 16 x 64 on the 2-core CPU (6k against 0.5k env steps/s): HTS's actor thread makes one
        # forward per batch of ready envs, and larger rounds batch more. Minibatches, clip and GAE lambda are the
        # preset's (the study kept them).
        "env.num_envs": 32,  # source: conveyor tune study hts-ppo-Pendulum-v1, trial 22 (as above)
        "arch.sync_interval": 128,  # source: conveyor tune study hts-ppo-Pendulum-v1, trial 22 (as above)
        "algo.ppo_epochs": 4,  # source: conveyor tune study hts-ppo-Pendulum-v1, trial 22 (as above)
        "algo.lr": 8.04e-4,  # source: conveyor tune study hts-ppo-Pendulum-v1, trial 22 (as above)
        "algo.gamma": 0.95,  # source: conveyor tune study hts-ppo-Pendulum-v1, trial 22 (as above)
        "algo.entropy_coef": 8.16e-3,  # source: conveyor tune study hts-ppo-Pendulum-v1, trial 22 (as above)
        "model.log_std_init": 0.313,  # source: conveyor tune study hts-ppo-Pendulum-v1, trial 22 (as above)
    },
    ("hts", "a2c", "classic-discrete"): {
        "env.normalize_reward": False,  # source: HTS-RL section 4 (determinism): the executors' envs keep the
        # statistics, which a checkpoint does not hold, so a resumed run would not reach the uninterrupted one's
        # parameters (tests/test_exact_resume.py); rewards stay the env's, as in the paper
    },
    ("seed", "vtrace", "classic-discrete"): {  # soonest to 475 in wall-clock: each of the 2 local actors steps
        # 128 envs (num_envs is per actor) and sends them in one round trip to the inference server, not 8.
        # seed/vtrace CartPole-v1 seeds 0-2: 475 at 324k/436k/393k steps in 34/43/37 s of the run (9.5k-10.6k SPS),
        # where the vtrace/classic-discrete 8 envs, batch 16, lr 2e-3 took 210k steps in 112 s (1.9k SPS); 32
        # envs, batch 32, 2e-3: 73 s; 64/64/3e-3: 56 s; 64/32/3e-3: 39 s (seed 0; benchmarks/preset_sweep.py,
        # benchmarks/results/preset_sweep.csv; docs/benchmarks-log.md "Fastest to a trained agent, round 2")
        # A recurrent core keeps vtrace/classic-discrete's 8 envs, batch 16, lr 2e-3, with which an LSTM learns
        # conveyor/Memory-v0 within 6,000 steps (tests/test_recurrent_actor_critic.py); 256 envs take 23 steps each.
        "env.num_envs": Derived("128 without an LSTM core, else vtrace/classic-discrete's",  # source: tuned here
                                lambda cfg: _recurrent_vtrace(cfg, "env.num_envs", 128)),
        "arch.batch_size": Derived("64 without an LSTM core, else vtrace/classic-discrete's",  # source: tuned here
                                   lambda cfg: _recurrent_vtrace(cfg, "arch.batch_size", 64)),
        "algo.lr": Derived("4e-3 without an LSTM core, else vtrace/classic-discrete's",  # source: tuned here
                           lambda cfg: _recurrent_vtrace(cfg, "algo.lr", 4e-3)),
        "total_steps": 1_000_000,  # source: tuned here: seeds 0-2 reach 475 at 324k-467k steps (race: 367k-467k),
        # close to the base's 500k, where one default run of 2026-12-04 (seed 0; SEED's actors are asynchronous)
        # stopped at 367.8; the runs that reach stop there, and 1M steps take about 50 s here
    },
}

# The comparison presets use each batch once (K = 1), so on cheap envs they want smaller worker batches than
# `impact` with its K = 8: more updates per env step, each from fewer steps.
PRESET_FAMILY: dict[tuple[str, str], dict[str, Any]] = {
    ("impala", "classic-discrete"): {
        "arch.worker_batch": 10,  # source: tuned here: --preset impala CartPole seed 1: 475 at 227k (50: 249 at 300k)
    },
    ("appo", "classic-discrete"): {
        "arch.worker_batch": 10,  # source: tuned here: --preset appo CartPole seeds 1-3: 475 at 153k/197k/176k
        # (32, the impact/classic-discrete value: 475 at 292k, then 323 and 460 at 300k)
    },
}

def layers(preset: str, arch: str, algo: str, family: str) -> list[tuple[str, dict[str, Any]]]:
    """The table layers that apply to a run (``preset`` "" without ``--preset``) below the preset's fixed
    fields, most specific first, as (layer name, values)."""
    return [(f"--preset {preset}/{family}", PRESET_FAMILY.get((preset, family), {})),
            (f"{arch}/{algo}/{family}", ARCH_ALGO_FAMILY.get((arch, algo, family), {})),
            (f"{algo}/{family}", ALGO_FAMILY.get((algo, family), {})),
            (family, FAMILY.get(family, {})),
            (algo, ALGO.get(algo, {})),
            ("base", BASE)]


@dataclass(frozen=True)
class Resolved:
    """What ``resolve`` hands ``RunCfg.__post_init__``: the ``RunCfg`` fields to set (whole sub-configs for
    ``env``/``model``/``algo``/``arch``) and, per ``section.field`` the preset filled, the layer it came from."""

    fields: dict[str, Any]
    sources: dict[str, str]


def _given(cfg: Any) -> dict[str, Any]:
    """Every preset field of ``cfg`` as ``section.field`` (``total_steps`` for RunCfg's own) -> its value."""
    values = {}
    for key in BASE:
        section, _, name = key.rpartition(".")
        values[key] = getattr(getattr(cfg, section) if section else cfg, name)
    return values


def resolve(cfg: Any, family: str | None) -> Resolved:
    """Fill every None preset field of ``cfg`` (a ``RunCfg`` under construction) from the tables of env family
    ``family`` (see the module docstring); None, a family not known, is refused once a field needs it."""
    values = _given(cfg)
    sources: dict[str, str] = {}
    arch, algo_name = cfg.arch.name, cfg.algo.name
    forced: dict[str, Any] = {}
    if cfg.arch.preset:
        fixed, preset_algo = IMPACT_PRESETS[cfg.arch.preset]
        forced = {f"arch.{name}": value for name, value in fixed.items()}
        if algo_name not in (None, preset_algo):
            raise ConfigError(f"--preset {cfg.arch.preset} runs --algo {preset_algo}, but --algo {algo_name} "
                              "was given: drop one of the two")
        if algo_name is None:
            algo_name, sources["algo.name"] = preset_algo, f"--preset {cfg.arch.preset}"
    for key, value in forced.items():
        if values[key] is not None and values[key] != value:
            raise ConfigError(f"--preset {cfg.arch.preset} sets {key.partition('.')[2]} to {value!r}, but it was "
                              f"given as {values[key]!r}: drop one of the two")
    if algo_name is None:
        algo_name, sources["algo.name"] = own_algo(arch), arch
    missing = [key for key, value in values.items() if value is None]
    if missing:
        if family is None:
            raise ConfigError(f"the presets of env {cfg.env.id!r} depend on its family, which its id does not tell: "
                              f"pass EnvCfg(family=...), one of {', '.join(FAMILIES)} (conveyor.envs.gym_api."
                              f"env_family({cfg.env.id!r}) builds the env once to find it, as conveyor train does)")
        table = [(f"--preset {cfg.arch.preset}", forced), *layers(cfg.arch.preset, arch, algo_name, family)]
        for key in missing:
            sources[key], values[key] = next((name, layer[key]) for name, layer in table if key in layer)
        view = _view(cfg, values, algo_name)
        for key in missing:
            if isinstance(values[key], Derived):
                values[key] = values[key].fn(view)
                section, _, name = key.rpartition(".")
                setattr(getattr(view, section) if section else view, name, values[key])
    fields: dict[str, Any] = {}
    for section in SECTIONS:
        changes = {key.partition(".")[2]: value for key, value in values.items()
                   if key.startswith(section + ".") and key in sources}
        if section == "algo" and "algo.name" in sources:
            changes["name"] = algo_name
        if changes:
            fields[section] = dataclasses.replace(getattr(cfg, section), **changes)
    fields.update({key: value for key, value in values.items() if "." not in key and key in sources})
    return Resolved(fields, sources)


def _view(cfg: Any, values: dict[str, Any], algo_name: str) -> types.SimpleNamespace:
    """A read-only-by-convention copy of ``cfg`` with ``values`` filled in, for ``Derived`` functions."""
    view = types.SimpleNamespace(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    for section in SECTIONS:
        sub = getattr(cfg, section)
        setattr(view, section, types.SimpleNamespace(**{f.name: getattr(sub, f.name) for f in dataclasses.fields(sub)}))
    view.algo.name = algo_name
    for key, value in values.items():
        section, _, name = key.rpartition(".")
        setattr(getattr(view, section) if section else view, name, value)
    return view


# ---- target-network sanity ------------------------------------------------------------------------------

def expected_updates(cfg: Any) -> float | None:
    """About how many learner updates ``cfg.total_steps`` env steps make, for runs with a target network
    (IMPACT with ``use_target_network``, R2D2); None for others, and for R2D2 with ``replay_ratio`` 0
    (the learner then runs as fast as it can)."""
    arch = cfg.arch
    if cfg.algo.name == "impact" and arch.name == "impact" and arch.use_target_network:
        batch_steps = arch.worker_batch * cfg.env.envs_per_worker  # one worker batch, used K times
        return cfg.total_steps / batch_steps * arch.replay_times
    if cfg.algo.name == "r2d2" and arch.replay_ratio:
        sequences = cfg.total_steps / (arch.seq_len - arch.seq_len // 2)  # sequences overlap by half
        return max(0.0, sequences - arch.min_replay) * arch.replay_ratio / arch.batch_size
    return None


def target_sync_warning(cfg: Any) -> str | None:
    """A one-line warning when ``cfg.total_steps`` can never reach the first target-network sync."""
    updates = expected_updates(cfg)
    if updates is None or updates >= cfg.arch.target_update:
        return None
    return (f"conveyor: warning: {cfg.total_steps:,} env steps make about {updates:,.0f} updates, fewer than "
            f"--target-update {cfg.arch.target_update}: the target network will never sync; lower --target-update "
            "or raise --total-steps")
