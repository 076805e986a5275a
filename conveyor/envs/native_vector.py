"""The ``vector`` backend: gymnasium's own vectorized env (a registry spec's ``vector_entry_point``) stepped in the
process that acts.

``CartPoleVectorEnv`` (CartPole-v0 and -v1) steps all its envs in a few numpy operations, where ``inproc`` steps
one Python env after another (``EnvWorker``): on the default job (64 envs) a step of all of them costs about as
much as two of ``inproc``'s single env steps. ``presets.NATIVE_VECTOR_ENVS`` lists the vector envs conveyor knows how to
step; the others (the phys2d Jax ones among them) take ``inproc`` or ``shm``.

Auto-reset: gymnasium's vector env resets a finished env at its *next* step (``AutoresetMode.NEXT_STEP``), which
returns the first observation with reward 0 and ignores that step's action. conveyor's storage expects the
reset in the same step (``StepResult``): right after each step, the finished envs are reset here, in place (a
new state drawn uniformly in ``[low, high]``, as ``CartPoleEnv.reset`` draws it; the step counters restart), and
``prev_done`` is cleared, so the env's next step resets nothing and wastes no action. ``final_obs`` holds the
finished episodes' last observations; episode returns (the sum of the rewards) and lengths are counted here.
gymnasium is pinned: ``tests/test_vector_backend.py`` holds the adapter against gymnasium's single
``CartPoleEnv``, so a changed env fails there.

Seeds: as on ``inproc`` and ``shm``, episode k of env i (its global index: ``env_offset`` plus its row) starts
from ``reset(seed=episode_seed(seed, i, k))``'s draw, made here with the generator that seed gives the single
env (``_start_episodes``). So an env's episodes do not depend on how the envs are batched or split over
data-parallel ranks, and they start where ``inproc``'s and ``shm``'s start; the steps that follow are the vector
env's numpy physics, the single env's formulas in the same order (``tests/test_vector_backend.py`` finds the
two equal to the bit on the project's machines; numpy's array and scalar sin/cos may differ in the last bit on
others), so a seeded run on ``vector`` takes the same actions as on ``inproc`` wherever they agree.

Resume: a checkpoint's ``env_state`` holds the env's own state (``NativeEnvRecord.state``: physics state, step
counters, each env's next episode index, the reset bounds, the episode return and length counters), not an
action history (``EnvHistory``), so a run made on this backend resumes on it alone, and one made on ``inproc``
or ``shm`` on those (``check_env_state`` says so in one line).

``normalize_reward``: ``RewardScale`` does for all envs at once what gymnasium's ``NormalizeReward`` and
``ClipReward`` do for each of ``inproc``'s and ``shm``'s envs (``make_env``), in the same float64 operations, so
the training rewards are theirs to the bit; its statistics go into checkpoints with the env's state.

What it cannot do (``native_vector_refusal``; ``auto`` then picks ``inproc`` or ``shm``): ``env_args`` other
than the vector env's own keywords (``NATIVE_VECTOR_ENVS``), ``--env-groups`` > 1. The vector env's numpy code
raises no env errors and has no worker to restart.
"""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils import seeding

from conveyor.config import EnvCfg
from conveyor.errors import ConfigError
from conveyor.envs.gym_api import registered_spec
from conveyor.envs.make import NORMALIZED_REWARD_CLIP, episode_seed
from conveyor.envs.vector_api import InProcessBackend, StepResult
from conveyor.presets import NATIVE_VECTOR_ENVS, spec_native_vector_entry

NATIVE_STATE_KIND = "native_vector"
"""``env_state["kind"]`` of a checkpoint made on this backend (an ``EnvHistory``'s state has no ``kind``)."""


def native_entry_point(cfg: EnvCfg) -> str:
    """The vector entry point of ``cfg.id``'s registry spec when this backend steps it, else "" (a ``MODULE:ID``
    env's too, once its module registered it: unlike ``presets.native_vector_entry``)."""
    return spec_native_vector_entry(registered_spec(cfg.id))


def native_vector_refusal(cfg: EnvCfg) -> str:
    """Why the ``vector`` backend cannot run ``cfg`` (one line naming the flag and the fix), or "" when it can."""
    entry = native_entry_point(cfg)
    if not entry:
        return (f"env {cfg.id!r} has no native vector env that conveyor steps (gymnasium's vector_entry_point: "
                "CartPole-v0 and -v1): use --env-backend auto, inproc or shm")
    unknown = sorted(set(cfg.kwargs) - set(NATIVE_VECTOR_ENVS[entry]))
    if unknown:
        return (f"--env-arg {', '.join(unknown)}: the native vector env {entry} takes only "
                f"{', '.join(NATIVE_VECTOR_ENVS[entry])}: drop it, or use --env-backend auto, inproc or shm")
    return ""


def is_native_state(env_state: dict[str, Any] | None) -> bool:
    """Whether a checkpoint's ``env_state`` was made on the ``vector`` backend (else: an ``EnvHistory``'s)."""
    return isinstance(env_state, dict) and env_state.get("kind") == NATIVE_STATE_KIND


def loads_natively(env_state: dict[str, Any] | None) -> bool:
    """Whether the ``vector`` backend can start from a run's ``env_state``: none (a new run), or one of its own."""
    return env_state is None or is_native_state(env_state)


def check_env_state(backend: str, env_state: dict[str, Any] | None) -> None:
    """Refuse in one line to rebuild envs on ``backend`` from a checkpoint's ``env_state`` made on a backend that
    stores envs the other way (the native vector env's own state, or an action history)."""
    if env_state is None or (backend == "vector") == is_native_state(env_state):
        return
    if backend == "vector":
        raise ConfigError("the checkpoint's envs were stepped by --env-backend inproc or shm (it holds their action "
                          "history, which the native vector env cannot replay): resume with --env-backend inproc "
                          "or shm")
    raise ConfigError(f"the checkpoint's envs were stepped by --env-backend vector (it holds the native vector "
                      f"env's own state, which {backend} cannot load): resume with --env-backend vector")


class RewardScale:
    """Each env's training reward divided by the running std of its ``gamma``-discounted reward sum and clipped to
    +-``NORMALIZED_REWARD_CLIP``: gymnasium's ``NormalizeReward`` (epsilon 1e-8, its ``RunningMeanStd`` with
    count 1e-4 to start) and ``ClipReward``, as ``make_env`` wraps each env of ``inproc`` and ``shm``, for B envs
    in one set of array operations. Every env steps once a step, so their counts are one number; the rest is
    per env, the wrapper's float64 formulas term for term (a batch of one: zero batch variance)."""

    EPSILON = 1e-8

    def __init__(self, batch: int, gamma: float) -> None:
        self.gamma = float(gamma)
        self.discounted = np.zeros(batch)
        """[B] the wrapper's ``discounted_reward``: decays by gamma, cut where an episode terminates (not where it
        is truncated: the wrapper carries it into the next episode)."""
        self.mean, self.var, self.count = np.zeros(batch), np.ones(batch), 1e-4

    def __call__(self, reward: np.ndarray, terminated: np.ndarray) -> np.ndarray:
        """The training rewards ``[B]`` for one step's env ``reward`` and ``terminated`` ``[B]``."""
        self.discounted = self.discounted * self.gamma * (1 - terminated) + reward.astype(np.float64)
        delta = self.discounted - self.mean
        total = self.count + 1
        self.mean = self.mean + delta * 1 / total
        self.var = (self.var * self.count + 0.0 + np.square(delta) * self.count * 1 / total) / total
        self.count = total
        return np.clip(reward / np.sqrt(self.var + self.EPSILON), -NORMALIZED_REWARD_CLIP, NORMALIZED_REWARD_CLIP)

    def state(self) -> dict[str, Any]:
        import torch

        return {"discounted": torch.from_numpy(self.discounted.copy()), "mean": torch.from_numpy(self.mean.copy()),
                "var": torch.from_numpy(self.var.copy()), "count": float(self.count)}

    def restore(self, state: dict[str, Any]) -> None:
        self.discounted, self.mean, self.var = (state[key].numpy().copy() for key in ("discounted", "mean", "var"))
        self.count = float(state["count"])


class NativeEnvRecord:
    """``NativeVectorEnv.history``: what a checkpoint stores to rebuild the envs (``state``), and how
    (``restore``)."""

    def __init__(self, venv: NativeVectorEnv) -> None:
        self._venv = venv

    def state(self) -> dict[str, Any]:
        """Tensors, strings, floats and dicts (loadable with ``weights_only=True``)."""
        import torch  # here: the backend itself needs no torch

        venv = self._venv
        env = venv.env
        return {
            "kind": NATIVE_STATE_KIND,
            "entry_point": venv.entry_point,
            "state": torch.from_numpy(np.array(env.state, np.float64)),
            "steps": torch.from_numpy(env.steps.astype(np.int64)),
            "next_episode": torch.from_numpy(venv.next_episode.copy()),
            "reset_bounds": [float(env.low), float(env.high)],
            "episode_return": torch.from_numpy(venv.running_return.copy()),
            "episode_length": torch.from_numpy(venv.running_length.copy()),
            "reward_scale": None if venv.reward_scale is None else venv.reward_scale.state(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Put the envs where ``state`` (``state()`` of an earlier run) left them."""
        venv = self._venv
        env = venv.env
        shape = tuple(state["state"].shape)
        if state["entry_point"] != venv.entry_point or shape != (4, venv.num_envs):
            raise ConfigError(f"the checkpoint holds {shape[-1]} envs of {state['entry_point']}, this run steps "
                              f"{venv.num_envs} of {venv.entry_point}: resume with the run's own --env and "
                              "--num-envs")
        env.reset(seed=0)  # builds the env's arrays and RNG; every one of them is replaced below
        env.state = state["state"].numpy().astype(np.float64)
        env.steps = state["steps"].numpy().astype(env.steps.dtype)
        env.prev_done = np.zeros(venv.num_envs, bool)
        env.low, env.high = state["reset_bounds"]
        venv.next_episode[:] = state["next_episode"].numpy()
        venv.running_return[:] = state["episode_return"].numpy()
        venv.running_length[:] = state["episode_length"].numpy()
        if (state.get("reward_scale") is None) != (venv.reward_scale is None):
            raise ConfigError("the checkpoint's envs were stepped with" + ("out" if venv.reward_scale else "") +
                              " normalize_reward: resume with the run's own --normalize-reward setting")
        if venv.reward_scale is not None:
            venv.reward_scale.restore(state["reward_scale"])


class NativeVectorEnv(InProcessBackend):
    """``cfg.num_envs`` envs in one gymnasium vector env, stepped in this process with same-step auto-reset (see
    the module docstring); the ``VectorEnv`` protocol."""

    def __init__(self, cfg: EnvCfg, seed: int, *, gamma: float | None = None, copy: bool = True,
                 env_state: dict[str, Any] | None = None, env_offset: int = 0) -> None:
        """``env_offset``: the global index of env 0 here (a data-parallel rank's share of a run's envs);
        ``gamma``: the run's discount, which ``cfg.normalize_reward`` needs (without it, as in ``make_env``, the
        rewards stay as they are)."""
        super().__init__()
        refusal = native_vector_refusal(cfg)
        if refusal:
            raise ConfigError(refusal)
        check_env_state("vector", env_state)
        self.cfg = cfg
        self.entry_point = native_entry_point(cfg)
        self.seed = seed
        self.first = env_offset
        """The global index of env 0 here (episode seeds)."""
        self.num_envs = batch = cfg.num_envs
        self.copy = copy
        self.restarts = 0  # nothing to restart: the envs live and die with this process
        self.env_errors = 0  # numpy physics: no env raises per step
        self.env = gym.make_vec(registered_spec(cfg.id).id, num_envs=batch,  # type: ignore[union-attr]
                                vectorization_mode="vector_entry_point", **cfg.kwargs)
        """The gymnasium vector env (its ``state`` and ``steps`` go into checkpoints)."""
        self.single_observation_space = self.env.single_observation_space
        self.single_action_space = self.env.single_action_space
        self._views = StepResult.buffers(batch, self.single_observation_space)  # restarted stays False: no worker
        self._actions = np.zeros((batch, *self.single_action_space.shape), self.single_action_space.dtype)
        self._actions_shape = self._actions.shape
        self.running_return = np.zeros(batch)
        """[B] float64: the return of each env's running episode so far."""
        self.running_length = np.zeros(batch, np.int64)
        """[B] its steps so far."""
        self.next_episode = np.zeros(batch, np.int64)
        """[B] the index of the episode each env starts next (its seed: ``episode_seed``)."""
        self.reward_scale = RewardScale(batch, gamma) if cfg.normalize_reward and gamma is not None else None
        """The training rewards' scaling (``normalize_reward``), else None."""
        self.history = NativeEnvRecord(self)
        self._pending_state = env_state
        self._seeded = False

    def reset(self) -> np.ndarray:
        """Start every env on its next episode (a resumed run's: where that run stopped); the first
        observations."""
        self._check_open()
        if self._pending_state is not None:
            self.history.restore(self._pending_state)
            self._pending_state = None
        else:
            if not self._seeded:
                self.env.reset(seed=self.seed)  # builds the env's arrays; every state is drawn below
            self._start_episodes(np.arange(self.num_envs))
            self.running_return[:] = 0.0
            self.running_length[:] = 0
        obs = self.env.state.T.astype(np.float32)
        self._seeded = True
        views = self._views
        views.obs[:] = obs
        views.reward[:] = 0.0
        views.terminated[:] = views.truncated[:] = False
        views.episode_return[:] = np.nan
        views.episode_length[:] = 0
        return views.obs.copy() if self.copy else views.obs

    def _take(self, actions: Any) -> None:
        if not self._seeded:
            raise RuntimeError("step_async() called before reset()")
        self._actions[...] = actions

    def _step(self) -> StepResult:
        """Step every env and reset the finished ones."""
        env, views = self.env, self._views
        obs, reward, terminated, truncated, _ = env.step(self._actions)
        views.obs[:] = obs
        views.reward[:] = reward if self.reward_scale is None else self.reward_scale(reward, terminated)
        views.terminated[:] = terminated
        views.truncated[:] = truncated
        self.running_return += reward
        self.running_length += 1
        views.episode_return[:] = np.nan
        views.episode_length[:] = 0
        done = terminated | truncated
        if done.any():
            views.final_obs[done] = obs[done]
            views.episode_return[done] = self.running_return[done]
            views.episode_length[done] = self.running_length[done]
            self.running_return[done] = 0.0
            self.running_length[done] = 0
            self._start_episodes(np.flatnonzero(done))
            views.obs[done] = env.state[:, done].T
        env.prev_done[:] = False
        if self.copy:
            return StepResult(*(array.copy() for array in views))
        return views

    def _start_episodes(self, envs: np.ndarray) -> None:
        """Start the next episode of each env of ``envs`` (rows): its state drawn as ``CartPoleEnv.reset(seed=
        episode_seed(seed, i, k))`` draws it, from the generator that seed gives the single env."""
        env = self.env
        for row in envs.tolist():
            rng, _ = seeding.np_random(episode_seed(self.seed, self.first + row, int(self.next_episode[row])))
            env.state[:, row] = rng.uniform(low=env.low, high=env.high, size=(4,))
        self.next_episode[envs] += 1
        env.steps[envs] = 0

    def _release(self) -> None:
        self.env.close()


def measure_native_step_us(cfg: EnvCfg, seed: int, *, rounds: int = 5, steps: int = 40) -> float:
    """The wall-clock of one env's share of a step of the native vector env of ``cfg`` (a step of all
    ``cfg.num_envs`` envs, resets included, over their count), in microseconds: the fastest of ``rounds`` rounds
    of ``steps`` steps on actions drawn beforehand, after one round of warm-up."""
    with NativeVectorEnv(cfg, seed, copy=False) as venv:
        venv.reset()
        actions = np.random.default_rng(seed).integers(0, venv.single_action_space.n, (steps, venv.num_envs))
        best = np.inf
        for round_ in range(rounds + 1):
            start = time.perf_counter()
            for action in actions:
                venv.step(action)
            if round_:  # round 0 warms up
                best = min(best, time.perf_counter() - start)
    return float(best / steps / venv.num_envs * 1e6)
