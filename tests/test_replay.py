"""R2D2's frame replay: each frame stored once, stacks rebuilt exactly, eviction, memory, checkpoints."""

import dataclasses
import io
import threading

import gymnasium as gym
import numpy as np
import pytest
import torch

from conveyor.architectures import run as run_architecture
from conveyor.architectures.seed.r2d2 import ReplayLearning
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.envs import env_spaces
from conveyor.envs.atari import make_atari
from conveyor.learner import load_latest_checkpoint
from conveyor.run import Run
from conveyor.storage.replay import SequenceReplay, replay_bytes_needed, sequence_slots, step_bytes
from conveyor.storage.schema import FieldSpec
from conveyor.storage.unrolls import PartialUnrolls

H = 3  # LSTM size
FIELDS = {
    "obs": None,  # set per test: the stacked observation
    "first": FieldSpec((), torch.bool, "obs"),
    "prev_action": FieldSpec((), torch.int64, "obs"),
    "prev_reward": FieldSpec((), torch.float32, "obs"),
    "actions": FieldSpec((), torch.int64),
    "rewards": FieldSpec((), torch.float32),
    "discounts": FieldSpec((), torch.float32),
    "policy_version": FieldSpec((), torch.int64),
    "state_h": FieldSpec((H,), torch.float32, "start"),
    "state_c": FieldSpec((H,), torch.float32, "start"),
}


class Counter(gym.Env):
    """Frames [2, 2] uint8 that spell the running count of steps over all episodes (each frame unique);
    episodes of 1 to ``longest`` steps."""

    def __init__(self, seed: int, longest: int = 12):
        self.observation_space = gym.spaces.Box(0, 255, (2, 2), np.uint8)
        self.action_space = gym.spaces.Discrete(3)
        self.rng = np.random.default_rng(seed)
        self.count, self.longest, self.left = seed * 10**6, longest, 0

    def _frame(self):
        self.count += 1
        return np.frombuffer(self.count.to_bytes(4, "little"), np.uint8).reshape(2, 2).copy()

    def reset(self, *, seed=None, options=None):
        self.left = int(self.rng.integers(1, self.longest + 1))
        return self._frame(), {}

    def step(self, action):
        self.left -= 1
        return self._frame(), float(self.rng.normal()), self.left == 0 and self.count % 2 == 0, self.left == 0, {}


def drive(envs, replay, seq_len, overlap, steps, cut_at=(), seed=0):
    """Acts in every env with random actions for ``steps`` steps, cutting the stream into sequences as SEED's
    inference does (``PartialUnrolls``) into ``replay``; returns {id: the sequence handed over (cloned)}.
    ``cut_at``: (step, slot) where the slot's stream is dropped mid-episode (an actor lost), restarting it
    there with ``first`` set on a stack that is not a reset stack."""
    obs_space = envs[0].observation_space
    fields = {**FIELDS, "obs": FieldSpec(obs_space.shape, torch.uint8, "obs")}
    handed = {}

    def sink(slot, unroll):
        sequence = {key: value.clone() for key, value in unroll.items()}
        handed[replay.add(sequence, slot, bool(unroll["continues"]))] = sequence

    unrolls = PartialUnrolls(seq_len, fields, sink, overlap=overlap, initial_slots=len(envs))
    rng = np.random.default_rng(seed)
    obs = [env.reset(seed=i)[0] for i, env in enumerate(envs)]
    first = [True] * len(envs)
    prev_action, prev_reward = [0] * len(envs), [0.0] * len(envs)
    for t in range(steps):
        for slot, env in enumerate(envs):
            if (t, slot) in cut_at:
                unrolls.reset(torch.tensor([slot]))
                first[slot], prev_action[slot], prev_reward[slot] = True, 0, 0.0
            index = torch.tensor([slot])
            unrolls.write("obs", index, torch.from_numpy(np.asarray(obs[slot])).unsqueeze(0))
            unrolls.write("first", index, torch.tensor([first[slot]]))
            unrolls.write("prev_action", index, torch.tensor([prev_action[slot]]))
            unrolls.write("prev_reward", index, torch.tensor([prev_reward[slot]]))
            for key in ("state_h", "state_c"):
                unrolls.write(key, index, torch.randn(1, H))
            unrolls.emit_full(index)
            action = int(rng.integers(env.action_space.n))
            unrolls.write("actions", index, torch.tensor([action]))
            unrolls.write("policy_version", index, torch.tensor([t]))
            unrolls.advance(index)
            obs[slot], reward, terminated, truncated, _ = env.step(action)
            unrolls.write("rewards", index, torch.tensor([reward]), offset=-1)
            unrolls.write("discounts", index, torch.tensor([0.9 * (1 - terminated)]), offset=-1)
            first[slot] = terminated or truncated
            if first[slot]:
                obs[slot] = env.reset()[0]
            prev_action[slot], prev_reward[slot] = (0, 0.0) if first[slot] else (action, reward)
    return handed


def assert_stored_exactly(replay, handed):
    """Every live sequence comes back exactly as it was handed over (stacks rebuilt bit for bit)."""
    live = [i for i in handed if replay.priorities_of(np.array([i]))[0] > 0]
    assert len(live) == len(replay) > 0
    stored = replay.sequences(np.array(live))
    for b, i in enumerate(live):
        for key, value in handed[i].items():
            if key == "continues":
                continue
            got = stored[key][b] if key.startswith("state") else stored[key][:, b]
            assert torch.equal(got, value), (i, key)
    return live


def stacked(seed, longest=12):
    return gym.wrappers.FrameStackObservation(Counter(seed, longest), 4)


@pytest.mark.parametrize("overlap", [0, 2, 5])
def test_a_large_replay_keeps_every_sequence_and_writes_each_frame_once(overlap):
    L, envs = 10, [stacked(1), stacked(2), stacked(3)]
    replay = SequenceReplay(100_000, L, (4, 2, 2), torch.uint8, H, overlap=overlap, frame_stack=4)
    handed = drive(envs, replay, L, overlap, steps=200, cut_at={(77, 1), (150, 2)})
    assert len(handed) > 30 and len(assert_stored_exactly(replay, handed)) == len(handed)  # nothing lost
    # Nothing duplicated: a stream segment writes 3 padding frames and L + 1 observations once, then L - overlap.
    segments = 3 + 2  # one per env, one more per cut
    assert replay.written == segments * (3 + L + 1) + (len(handed) - segments) * (L - overlap)


def test_ring_wrap_around_evicts_what_it_overwrites_and_never_samples_it():
    L, overlap = 10, 5
    envs = [stacked(1), stacked(2)]
    replay = SequenceReplay(97, L, (4, 2, 2), torch.uint8, H, overlap=overlap, frame_stack=4)
    handed = drive(envs, replay, L, overlap, steps=300, cut_at={(120, 0)})
    assert replay.written > 5 * replay.capacity  # wrapped around several times
    live = assert_stored_exactly(replay, handed)
    # Live exactly when none of its frames was overwritten.
    oldest = replay.table["oldest"][torch.tensor(live) % replay.slots]
    assert (oldest >= replay.written - replay.capacity).all()
    evicted = [i for i in handed if i not in live]
    assert evicted and (replay.priorities_of(np.array(evicted)) == 0).all()
    ids = replay.sample(4096, np.random.default_rng(0))["ids"].numpy()
    assert set(ids.tolist()) <= set(live)
    assert replay.update_priorities(np.array(evicted), np.ones(len(evicted))) == 0
    # Sampling stays proportional to priority among the live ones.
    replay.update_priorities(np.array(live), np.where(np.array(live) % 2, 4.0, 1.0))
    ids = replay.sample(20_000, np.random.default_rng(1))["ids"].numpy()
    odd = np.mean(ids % 2)
    weights = np.where(np.array(live) % 2, 4.0 ** 0.9, 1.0)
    assert odd == pytest.approx(weights[np.array(live) % 2 == 1].sum() / weights.sum(), abs=0.02)


def test_stacks_rebuilt_from_atari_frames_equal_the_observations_the_env_produced():
    """Pong through conveyor's own Atari wrappers (their frame stack pads a reset with its first frame), short
    episodes so resets fall inside sequences, a ring that wraps around."""
    cfg = EnvCfg(id="ALE/Pong-v5", noop_max=2)
    envs = [gym.wrappers.TimeLimit(make_atari(cfg), 23), gym.wrappers.TimeLimit(make_atari(cfg), 31)]
    L, overlap = 8, 4
    replay = SequenceReplay(150, L, (4, 84, 84), torch.uint8, H, overlap=overlap, frame_stack=4)
    handed = drive(envs, replay, L, overlap, steps=160, cut_at={(90, 1)})
    assert replay.written > replay.capacity
    live = assert_stored_exactly(replay, handed)
    assert any(handed[i]["first"][1:].any() for i in live)  # episode starts inside rebuilt sequences


def test_memory_per_stored_step_before_and_after():
    """Atari (4x84x84 uint8, seq_len 80 overlapping by 40, LSTM 512): one frame per step instead of about eight."""
    before = (81 * 4 * 84 * 84 + 81 * (1 + 8 + 4) + 80 * (8 + 4 + 4 + 8) + 2 * 512 * 4) / 40  # whole sequences
    after = replay_bytes_needed(250_000, 80, 40, (4, 84, 84), torch.uint8, 4, 512) / 250_000
    assert step_bytes((4, 84, 84), torch.uint8, 4) == 84 * 84 + 45
    assert round(before) == 57_330 and 7_101 < after < 7_300 and before / after > 7.5
    assert replay_bytes_needed(250_000, 80, 40, (4, 84, 84), torch.uint8, 4, 512) < 2 * 1024**3
    small = SequenceReplay(1000, 10, (4, 2, 2), torch.uint8, H, overlap=5, frame_stack=4)
    assert small.nbytes == replay_bytes_needed(1000, 10, 5, (4, 2, 2), torch.uint8, 4, H)
    assert small.slots == sequence_slots(1000, 10, 5) == 201


def test_stacks_that_do_not_pad_with_the_first_frame_are_refused():
    replay = SequenceReplay(100, 4, (2, 2, 2), torch.uint8, H, frame_stack=2)
    sequence = {"obs": torch.arange(40, dtype=torch.uint8).view(5, 2, 2, 2), "first": torch.tensor([1, 0, 1, 0, 0]).bool(),
                "prev_action": torch.zeros(5, dtype=torch.int64), "prev_reward": torch.zeros(5),
                "actions": torch.zeros(4, dtype=torch.int64), "rewards": torch.zeros(4), "discounts": torch.zeros(4),
                "policy_version": torch.zeros(4, dtype=torch.int64), "state_h": torch.zeros(H), "state_c": torch.zeros(H)}
    with pytest.raises(ValueError, match="first frame repeated"):
        replay.add(sequence)


def same(a, b):
    return torch.allclose(a, b, equal_nan=True) if a.is_floating_point() else torch.equal(a, b)


def roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_round_trips_through_a_weights_only_checkpoint():
    L, overlap = 10, 5
    replay = SequenceReplay(97, L, (4, 2, 2), torch.uint8, H, overlap=overlap, frame_stack=4)
    handed = drive([stacked(1), stacked(2)], replay, L, overlap, steps=150)
    replay.update_priorities(np.array(list(handed)[-5:]), np.arange(5) + 2.0)
    restored = SequenceReplay(97, L, (4, 2, 2), torch.uint8, H, overlap=overlap, frame_stack=4)
    restored.load_state_dict(roundtrip(replay.state_dict()))
    for key in replay.ring:
        assert same(replay.ring[key], restored.ring[key]), key
    for key in replay.table:
        assert same(replay.table[key], restored.table[key]), key
    assert (replay.written, replay.inserted, len(replay), replay.max_priority) == (
        restored.written, restored.inserted, len(restored), restored.max_priority)
    a, b = replay.sample(64, np.random.default_rng(3)), restored.sample(64, np.random.default_rng(3))
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.slow
def test_a_resumed_r2d2_run_restores_its_replay_and_sampler(tmp_path):
    """Train a few thousand CartPole steps, stop; a run resumed from that checkpoint starts with the same replay
    contents, sampler RNG state and sample count."""
    arch = dict(name="seed", local_actors=1, seq_len=10, burn_in=2, batch_size=8, min_replay=10, replay_capacity=3000,
                replay_ratio=1.0, target_update=50)
    cfg = RunCfg(env=EnvCfg(id="CartPole-v1", num_envs=4, num_workers=1),
                 model=ModelCfg(name="mlp", hidden=(16,), lstm_size=8), algo=AlgoCfg(name="r2d2"),
                 arch=ArchCfg(**arch), total_steps=3000, time_limit_s=120, torch_threads=1, progress=False,
                 out=str(tmp_path / "run"), seed=0)
    summary = run_architecture(cfg)
    assert summary["updates"] > 0
    # Every replayed step's acting version is in the lag histogram: updates x batch 8 x sequence length 10.
    assert sum(summary["policy_lag"]["histogram"].values()) == summary["updates"] * 8 * 10
    _, saved = load_latest_checkpoint(tmp_path / "run")
    assert saved["replay"]["inserted"] > 10 and saved["replay_sampled"] > 0
    resumed_cfg = dataclasses.replace(cfg, resume=str(tmp_path / "run"), out=str(tmp_path / "resumed"))
    obs_space, action_space = env_spaces(cfg.env, cfg.seed)
    with Run(resumed_cfg) as run:
        learning = ReplayLearning.build(run, obs_space, action_space, threading.Lock(), 4)
        replay = learning.replay
        assert (replay.written, replay.inserted, len(replay)) == (
            saved["replay"]["written"], saved["replay"]["inserted"], saved["replay"]["size"])
        held = min(replay.written, replay.capacity)
        assert torch.equal(replay.ring["actions"][:held], saved["replay"]["ring"]["actions"])
        assert torch.equal(replay.table["stamps"], saved["replay"]["table"]["stamps"])
        assert learning.rng.bit_generator.state == saved["replay_rng"] and learning.sampled == saved["replay_sampled"]
        # It samples on where the stopped run would have: the same draws from the same RNG state.
        expected = np.random.default_rng()
        expected.bit_generator.state = saved["replay_rng"]
        assert torch.equal(learning.replay.sample(8, learning.rng)["ids"], replay.sample(8, expected)["ids"])
        again = roundtrip(learning.state_dict())
        assert torch.equal(again["replay"]["frames_zlib"], saved["replay"]["frames_zlib"])
        learning.close()
