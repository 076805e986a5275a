"""R2D2: sum-tree, prioritized sequence replay, sequence builder, acting and the learner step."""

import copy
import math
import threading

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from conveyor import algos
from conveyor.config import AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg
from conveyor.models import make_model
from conveyor.models.heads import Categorical, ModelOut
from conveyor.architectures import run as run_architecture
from conveyor.cli import main
from conveyor.architectures.seed.r2d2 import R2D2Learner, R2D2Policy, ReplayLearning, actor_epsilons, epsilon_greedy, make_replay
from conveyor.storage.replay import SequenceReplay, check_replay_fits, replay_bytes_needed
from conveyor.storage.schema import UINT8_MARKER, FieldSpec
from conveyor.storage.sum_tree import SumTree
from conveyor.architectures.seed.batcher import EnvSteps
from conveyor.architectures.seed.inference import CentralInference

torch.set_num_threads(1)

OBS = gym.spaces.Box(-1, 1, (3,), np.float32)
ACTIONS = gym.spaces.Discrete(2)


def r2d2_cfg(**arch):
    arch = {"seq_len": 6, "burn_in": 2, "batch_size": 4, "replay_capacity": 16, "min_replay": 2, **arch}
    return RunCfg(env=EnvCfg(id="CartPole-v1", num_envs=2, num_workers=1),
                  model=ModelCfg(name="mlp", hidden=(8,), lstm_size=5),
                  algo=AlgoCfg(name="r2d2", lr=1e-3, gamma=0.9, n_step=2, max_grad_norm=80.0),
                  arch=ArchCfg(name="seed", **arch))


def small_model(cfg):
    return make_model(cfg.model, OBS, ACTIONS, dueling=True)


# ---- sum-tree --------------------------------------------------------------------------------

def test_sum_tree_sampling_frequencies_match_priorities():
    # Capacity 7 is not a power of two: the padding leaf (priority 0) must never come out either.
    priorities = np.array([1.0, 0.0, 2.0, 3.0, 0.5, 0.0, 6.0])
    tree = SumTree(len(priorities))
    tree.update(np.arange(len(priorities)), priorities)
    rng = np.random.default_rng(0)
    draws = np.concatenate([tree.sample(64, rng) for _ in range(300)])
    assert draws.max() < len(priorities)
    counts = np.bincount(draws, minlength=len(priorities))
    assert counts[priorities == 0].sum() == 0
    live = priorities > 0
    expected = priorities[live] / priorities.sum() * len(draws)
    chi_square = float(((counts[live] - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: the 0.1% critical value is 20.52; a sampler biased by one leaf's worth fails by far.
    assert chi_square < 20.52


def test_sum_tree_batched_update_keeps_exact_sums():
    tree = SumTree(10)
    rng = np.random.default_rng(1)
    reference = np.zeros(10)
    for _ in range(50):
        idx = rng.integers(0, 10, size=4)
        values = rng.random(4)
        tree.update(idx, values)
        for i, v in zip(idx, values):  # a repeated index keeps its last value, like numpy assignment
            reference[i] = v
    np.testing.assert_allclose(tree[np.arange(10)], reference)
    assert tree.total == pytest.approx(reference.sum(), rel=1e-12)
    leaves = tree.nodes[tree.first_leaf:]
    for level in range(tree.depth):  # every inner node is the sum of its children
        width = tree.first_leaf >> (level + 1)
        np.testing.assert_allclose(tree.nodes[width: 2 * width], leaves.reshape(width, -1).sum(1))


def test_sum_tree_find_skips_zero_leaves_at_the_edge():
    tree = SumTree(4)
    tree.update(np.arange(4), np.array([0.3, 0.3, 0.0, 0.0]))
    # A point at (just below) the total must land on the last positive leaf, not a zero one.
    assert tree.find(np.array([np.nextafter(tree.total, 0.0), 0.0, 0.3])).tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match="finite"):
        tree.update(np.array([0]), np.array([-1.0]))


# ---- replay -----------------------------------------------------------------------------------

def random_sequences(count, L=4, obs_shape=(3,), H=2, offset=0):
    return {
        "obs": torch.arange(count * (L + 1) * 3, dtype=torch.float32).view(count, L + 1, 3) + offset,
        "first": torch.zeros(count, L + 1, dtype=torch.bool),
        "prev_action": torch.zeros(count, L + 1, dtype=torch.int64),
        "prev_reward": torch.zeros(count, L + 1),
        "actions": torch.ones(count, L, dtype=torch.int64),
        "rewards": torch.arange(count, dtype=torch.float32).view(count, 1).expand(count, L) + offset,
        "discounts": torch.full((count, L), 0.9),
        "policy_version": torch.zeros(count, L, dtype=torch.int64),
        "state_h": torch.arange(count, dtype=torch.float32).view(count, 1).expand(count, H) + offset,
        "state_c": torch.zeros(count, H),
    }


def test_replay_starts_marked_and_returns_time_major_sequences():
    replay = SequenceReplay(40, 4, (3,), torch.uint8, 2)
    assert (replay.ring["frame"] == UINT8_MARKER).all() and (replay.ring["actions"] == -1).all()
    assert torch.isnan(replay.ring["rewards"]).all() and not replay.table["live"].any()
    replay = SequenceReplay(40, 4, (3,), torch.float32, 2)
    ids = replay.insert(random_sequences(3))
    assert ids.tolist() == [0, 1, 2] and len(replay) == 3
    batch = replay.sample(5, np.random.default_rng(0))
    assert batch["obs"].shape == (5, 5, 3) and batch["actions"].shape == (4, 5)
    assert batch["state_h"].shape == (5, 2) and batch["weights"].shape == (5,)
    # Each sampled column is one whole stored sequence: rewards and state name the same sequence id.
    assert torch.equal(batch["rewards"][0], batch["ids"].float())
    assert torch.equal(batch["state_h"][:, 0], batch["rewards"][0])


def test_importance_weights_are_normalized_by_their_max():
    replay = SequenceReplay(20, 4, (3,), torch.float32, 2, priority_exponent=0.9, importance_exponent=0.6)
    ids = replay.insert(random_sequences(4))
    raw = np.array([1.0, 2.0, 4.0, 8.0])
    replay.update_priorities(ids, raw)
    batch = replay.sample(64, np.random.default_rng(0))
    weights = batch["weights"].double().numpy()
    assert weights.max() == pytest.approx(1.0)
    probs = raw[batch["ids"].numpy()] ** 0.9 / (raw ** 0.9).sum()
    expected = (4 * probs) ** -0.6
    np.testing.assert_allclose(weights, expected / expected.max(), rtol=1e-6)


def test_replay_evicts_oldest_and_skips_priorities_of_evicted_ids():
    replay = SequenceReplay(20, 4, (3,), torch.float32, 2)  # 20 steps: 4 unrelated sequences of 5 observations
    old = replay.insert(random_sequences(3))
    replay.insert(random_sequences(3, offset=100))  # ids 3..5 overwrite the steps of ids 0 and 1
    assert len(replay) == 4 and replay.inserted == 6
    batch = replay.sample(200, np.random.default_rng(0))
    assert set(batch["ids"].tolist()) == {2, 3, 4, 5}
    assert set(batch["rewards"][0].tolist()) == {2, 100, 101, 102}
    # ids 0 and 1 are gone; only id 2 is still live.
    assert replay.update_priorities(old, np.array([5.0, 5.0, 7.0])) == 1
    assert replay.priorities_of(np.array([2]))[0] == pytest.approx(7.0 ** 0.9)
    assert replay.priorities_of(np.array([0, 1])).tolist() == [0.0, 0.0]
    assert replay.max_priority == 7.0
    # New sequences enter with the largest priority seen so far.
    new = replay.insert(random_sequences(1))
    assert replay.priorities_of(new)[0] == pytest.approx(7.0 ** 0.9)
    with pytest.raises(ValueError, match="finite"):
        replay.update_priorities(new, np.array([np.nan]))


def test_replay_that_cannot_fit_is_refused_with_the_bytes_needed():
    need = replay_bytes_needed(250_000, 80, 40, (4, 84, 84), torch.uint8, 4, 512)
    assert need <= 2 * 1024**3  # the Atari preset fits the default budget
    with pytest.raises(ConfigError, match=rf"replay needs {need:,} bytes .*replay_capacity 250000 steps x 7,101 bytes "
                                          r"\(seq_len 80.*replay_bytes 1,000,000"):
        check_replay_fits(250_000, 80, 40, (4, 84, 84), torch.uint8, 4, 512, budget_bytes=1_000_000)
    cfg = r2d2_cfg(replay_bytes=1000)
    with pytest.raises(ConfigError, match="replay_bytes 1,000"):
        make_replay(cfg, OBS, 5)
    with pytest.raises(ConfigError, match="min_replay"):
        make_replay(r2d2_cfg(min_replay=20), OBS, 5)
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        make_replay(r2d2_cfg(replay_capacity=6, min_replay=1), OBS, 5)
    replay = make_replay(r2d2_cfg(), OBS, 5)
    assert replay.overlap == 3 and replay.frame_stack == 1
    assert replay.nbytes == replay_bytes_needed(16, 6, 3, (3,), torch.float32, 1, 5)


# ---- acting -----------------------------------------------------------------------------------

def test_actor_epsilons_follow_the_seed_schedule():
    eps = actor_epsilons(8)
    assert eps[0] == pytest.approx(0.4) and eps[-1] == pytest.approx(0.4 ** 8)
    assert eps[3] == pytest.approx(0.4 ** (1 + 7 * 3 / 7))
    assert torch.all(eps[1:] < eps[:-1])
    assert actor_epsilons(1).tolist() == [pytest.approx(0.4)]
    q = torch.tensor([[0.0, 1.0]]).expand(2000, 2)
    greedy = epsilon_greedy(q, torch.zeros(2000))
    explore = epsilon_greedy(q, torch.ones(2000), torch.Generator().manual_seed(0))
    assert (greedy == 1).all() and 0.4 < (explore == 0).float().mean() < 0.6


def central_inference(cfg, epsilons, replay):
    """R2D2 acting as SEED wires it: the policy inside CentralInference, sequences into the replay."""
    learner = R2D2Learner(small_model(cfg), algos.make_loss(cfg), cfg)
    policy = R2D2Policy(learner, threading.Lock(), epsilons, seed=0)
    L = cfg.arch.seq_len
    inference = CentralInference(policy, FieldSpec((3,), torch.float32, "obs"), L, cfg.algo.gamma,
                                 lambda slot, sequence, stored: replay.add(sequence, slot, bool(sequence["continues"])),
                                 overlap=L // 2)
    return learner, policy, inference


def steps(slots, obs, reward, terminated, truncated=None, final_obs=None):
    k = len(slots)
    return EnvSteps(np.asarray(slots, np.int64), np.zeros(k, np.int64), np.asarray(obs, np.float32),
                    np.asarray(reward, np.float32), np.asarray(terminated, bool),
                    np.asarray(truncated if truncated is not None else [False] * k, bool),
                    np.asarray(final_obs if final_obs is not None else np.zeros((0, 3)), np.float32),
                    np.full(k, np.nan, np.float32))


def test_stored_recurrent_states_are_the_ones_the_actor_used():
    torch.manual_seed(0)
    cfg = r2d2_cfg(seq_len=4, burn_in=1)
    replay = SequenceReplay(200, 4, (3,), torch.float32, 5, overlap=2)
    learner, policy, inference = central_inference(cfg, torch.zeros(3), replay)  # greedy: actions are checkable
    used = []  # every (h, c) row the policy was fed
    act = policy.act

    def recording_act(inputs):
        used.extend(torch.cat([h, c]) for h, c in zip(*inputs.state))
        return act(inputs)

    policy.act = recording_act
    g = torch.Generator().manual_seed(1)
    for t in range(14):
        slots = [0, 1, 2] if t % 3 else [2, 0]  # batches of varying composition
        inference.process([steps(slots, torch.randn(len(slots), 3, generator=g), torch.randn(len(slots), generator=g),
                                 torch.rand(len(slots), generator=g) < 0.2)])
    assert replay.inserted >= 6
    batch = replay.sample(replay.inserted, np.random.default_rng(0))
    # Each stored start state is a state the policy was fed ...
    for b in range(batch["obs"].shape[1]):
        stored = torch.cat([batch["state_h"][b], batch["state_c"][b]])
        assert any(torch.equal(stored, s) for s in used)
    assert batch["first"].any() and (batch["state_h"].abs().sum(-1) > 0).any()
    # ... and replaying the sequence from it with the stored LSTM inputs reproduces every greedy action.
    state = (batch["state_h"].unsqueeze(0), batch["state_c"].unsqueeze(0))
    with torch.no_grad():
        out = learner.model(batch["obs"], state, batch["first"], batch["prev_action"], batch["prev_reward"])
    assert torch.equal(out.q[:-1].argmax(-1), batch["actions"])


def test_truncated_episodes_bootstrap_from_the_rescaled_q_of_the_final_observation():
    torch.manual_seed(0)
    cfg = r2d2_cfg(seq_len=2, burn_in=1)
    replay = SequenceReplay(8, 2, (3,), torch.float32, 5, overlap=1)
    learner, policy, inference = central_inference(cfg, torch.zeros(2), replay)
    inference.process([steps([0, 1], torch.zeros(2, 3), [0, 0], [False, False])])
    state = tuple(s[1:2].clone() for s in inference.state)
    last_action = inference.last_action[1:2].clone()
    final = torch.ones(1, 3)
    inference.process([steps([0, 1], torch.zeros(2, 3), [1, 1], [False, False], [False, True], final)])
    inference.process([steps([0, 1], torch.zeros(2, 3), [0, 0], [False, False])])
    assert replay.inserted == 2
    with torch.no_grad():
        q = learner.model(final.unsqueeze(0), tuple(s.unsqueeze(0) for s in state), None,
                          last_action.view(1, 1), torch.ones(1, 1)).q[0, 0]
    v = float(q.max())  # h^-1 by the textbook closed form
    inverse = math.copysign(((math.sqrt(1 + 4e-3 * (abs(v) + 1 + 1e-3)) - 1) / 2e-3) ** 2 - 1, v)
    # Step 0 of each sequence got the report of the second call; env 1's sequence restarts at obs 1.
    stored = replay.sequences(np.array([0, 1]))
    cut, kept = (1, 0) if stored["first"][1, 1] else (0, 1)
    assert stored["rewards"][0, cut].item() == pytest.approx(1.0 + 0.9 * inverse, rel=1e-4)
    assert stored["discounts"][0, cut].item() == 0.0
    assert stored["rewards"][0, kept].item() == 1.0
    assert stored["discounts"][0, kept].item() == pytest.approx(0.9)


# ---- learner --------------------------------------------------------------------------------

class TableQ(nn.Module):
    """Q(s, a) = scale_a * obs_a: hand-computable, with a parameter so gradients exist."""

    lstm_size = 1

    def __init__(self, scale):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(scale))

    def forward(self, obs, state=None, done=None, prev_action=None, prev_reward=None):
        q = obs[..., :2] * self.scale
        return ModelOut(Categorical(2), q, q.max(-1).values, state, q)


def test_target_computation_matches_a_hand_computed_case():
    cfg = r2d2_cfg(seq_len=3, burn_in=1)  # n = 2, gamma 0.9 in the discounts below
    learner = R2D2Learner(TableQ([1.0, 1.0]), algos.make_loss(cfg), cfg)
    learner.target_model.scale.data = torch.tensor([2.0, 3.0])
    # One sequence: obs s_0..s_3 (s_0 is burn-in); learning steps t = 1, 2 with rewards 1, 2.
    obs = torch.tensor([[9.0, 9.0], [1.0, 0.0], [0.5, 2.0], [4.0, 1.0]]).view(4, 1, 2)
    batch = {"obs": obs, "first": torch.zeros(4, 1, dtype=torch.bool), "prev_action": torch.zeros(4, 1).long(),
             "prev_reward": torch.zeros(4, 1), "actions": torch.tensor([[1], [0], [1]]),
             "rewards": torch.tensor([[5.0], [1.0], [2.0]]), "discounts": torch.full((3, 1), 0.9),
             "policy_version": torch.zeros(3, 1).long(), "state_h": torch.zeros(1, 1), "state_c": torch.zeros(1, 1),
             "weights": torch.ones(1)}
    learn = learner.learning_batch(batch)
    assert torch.equal(learn["target_q"][:, 0], torch.tensor([[2.0, 0.0], [1.0, 6.0], [8.0, 3.0]]))

    def h(x):
        return math.copysign(math.sqrt(abs(x) + 1) - 1, x) + 1e-3 * x

    def h_inv(y):
        return math.copysign(((math.sqrt(1 + 4e-3 * (abs(y) + 1 + 1e-3)) - 1) / 2e-3) ** 2 - 1, y)

    # t=1 (s_1, a=0): 2 steps, bootstrap at s_3 with a* = argmax online Q(s_3) = 0 -> target Q 8.
    target_1 = h(1.0 + 0.9 * 2.0 + 0.81 * h_inv(8.0))
    # t=2 (s_2, a=1): 1 step left, bootstrap at s_3 -> 8.
    target_2 = h(2.0 + 0.9 * h_inv(8.0))
    delta = [target_1 - 1.0, target_2 - 2.0]  # online Q(s_1, 0) = 1, Q(s_2, 1) = 2
    metrics, priorities = learner.learn(batch)
    expected_loss = 0.5 * (delta[0] ** 2 + delta[1] ** 2) / 2
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-5)
    expected_priority = 0.9 * max(map(abs, delta)) + 0.1 * sum(map(abs, delta)) / 2
    assert priorities.item() == pytest.approx(expected_priority, rel=1e-5)


def learner_batch(cfg, B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = cfg.arch.seq_len
    return {"obs": torch.randn(L + 1, B, 3, generator=g), "first": torch.zeros(L + 1, B, dtype=torch.bool),
            "prev_action": torch.randint(2, (L + 1, B), generator=g), "prev_reward": torch.randn(L + 1, B, generator=g),
            "actions": torch.randint(2, (L, B), generator=g), "rewards": torch.randn(L, B, generator=g),
            "discounts": torch.full((L, B), 0.9), "policy_version": torch.zeros(L, B, dtype=torch.int64),
            "state_h": torch.randn(B, 5, generator=g), "state_c": torch.randn(B, 5, generator=g),
            "weights": torch.ones(B)}


def test_burn_in_takes_no_gradient():
    torch.manual_seed(0)
    cfg = r2d2_cfg(seq_len=6, burn_in=2)
    learner = R2D2Learner(small_model(cfg), algos.make_loss(cfg), cfg)
    batch = learner_batch(cfg)
    batch["obs"].requires_grad_(True)
    learn = learner.learning_batch(batch)
    assert not learn["state"][0].requires_grad and not learn["target_q"].requires_grad
    loss, _ = learner.loss_fn(learner.forward(learn), learn)
    loss.backward()
    # The loss depends on the burn-in steps only through the (detached) state: no gradient reaches them.
    assert batch["obs"].grad[:2].abs().sum() == 0
    assert batch["obs"].grad[2:].abs().sum() > 0
    # And the burn-in changed the starting state of the learning part.
    assert not torch.equal(learn["state"][0][0], batch["state_h"])


def test_target_network_syncs_every_interval_and_checkpoints(tmp_path):
    torch.manual_seed(0)
    cfg = r2d2_cfg(target_update=3)
    learner = R2D2Learner(small_model(cfg), algos.make_loss(cfg), cfg)
    batch = learner_batch(cfg)

    def same():
        return all(torch.equal(a, b) for a, b in zip(learner.model.state_dict().values(),
                                                     learner.target_model.state_dict().values()))

    initial = copy.deepcopy(learner.target_model.state_dict())
    for version in range(1, 4):
        metrics, priorities = learner.learn(batch)
        assert priorities.shape == (3,) and math.isfinite(metrics["loss"])
        assert same() == (version == 3)
    assert not all(torch.equal(initial[k], v) for k, v in learner.target_model.state_dict().items())
    learner.learn(batch)
    learner.save(tmp_path / "ckpt.pt")
    other = R2D2Learner(small_model(cfg), algos.make_loss(cfg), cfg)
    other.load(tmp_path / "ckpt.pt")
    assert other.version == 4
    for a, b in zip(other.target_model.state_dict().values(), learner.target_model.state_dict().values()):
        assert torch.equal(a, b)


# ---- replay ratio ---------------------------------------------------------------------------

def test_replay_ratio_paces_learner_and_actors_without_deadlock():
    cfg = r2d2_cfg(seq_len=4, burn_in=1, replay_capacity=64, min_replay=8, batch_size=4)
    replay = SequenceReplay(64, 4, (3,), torch.float32, 2)
    learner = R2D2Learner(small_model(cfg), algos.make_loss(cfg), cfg)
    learning = ReplayLearning(learner, None, replay, min_replay=8, batch_size=4, lock=threading.Lock(), seed=0,
                              replay_ratio=2.0)
    sequence = {key: value[0] for key, value in random_sequences(1).items()}
    sequence["continues"] = torch.tensor(False)
    assert learning.get(timeout_s=0.01) is None  # nothing stored yet
    violations = []

    def actor():
        for _ in range(200):
            learning.sink(0, sequence, lambda: None)
            fresh = replay.inserted - 8
            if 2.0 * (fresh - 1) > learning.sampled + ReplayLearning.AHEAD_UPDATES * 4:  # inserted while too far ahead
                violations.append(fresh)

    thread = threading.Thread(target=actor)
    thread.start()
    while thread.is_alive():
        batch = learning.get(timeout_s=0.05)
        if batch is not None:
            assert learning.sampled <= 2.0 * (replay.inserted - 8) + 4  # the learner never outruns the data
    thread.join()
    assert not violations and replay.inserted == 200
    # Samples per insert settle at the ratio: 2 * 192 inserts allow 384 + 4 samples, the sink kept within 2 updates.
    assert 2.0 * 192 - 3 * 4 <= learning.sampled <= 2.0 * 192 + 4
    # A sink waiting for the learner gives up when the run closes.
    blocked = threading.Thread(target=lambda: [learning.sink(0, sequence, lambda: None) for _ in range(50)])
    blocked.start()
    blocked.join(timeout=0.5)
    assert blocked.is_alive()
    learning.close()
    blocked.join(timeout=5)
    assert not blocked.is_alive() and learning.get(timeout_s=1.0) is None


def test_replay_that_cannot_fit_memory_exits_2_with_the_bytes_needed(capsys, tmp_path):
    assert main(["train", "--arch", "seed", "--algo", "r2d2", "--env", "CartPole-v1", "--replay-bytes", "100000",
                 "--replay-capacity", "10000", "--seq-len", "80", "--burn-in", "40", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "replay needs" in err and "replay_capacity 10000 steps" in err and "replay_bytes 100,000" in err
    assert len(err.splitlines()) == 1


# ---- end to end -------------------------------------------------------------------------------

@pytest.mark.slow  # 30-60 s; make test runs R2D2 end to end in test_replay.py and test_telemetry.py
def test_seed_r2d2_learns_cartpole(tmp_path):
    """`conveyor train --arch seed --algo r2d2` on CartPole with two local actor processes.

    Scaled down from SEED table 8 so it solves in well under a minute on 2 cores: a 64-unit MLP and
    a 64-unit LSTM (CartPole needs no memory; the LSTM is there to exercise burn-in and stored
    states); 20-step sequences with 5 burn-in steps (15 learning steps > n = 5, overlapping by 10);
    learning after 50 sequences and a target sync every 100 updates instead of 2500 (runs last a few
    hundred updates); Adam at lr 1e-3 instead of 1e-4 (small net, few updates); replay ratio 2
    sequences sampled per sequence inserted (1.9 is where the unthrottled run settled; fixing it
    makes updates per env step independent of machine load). Typically solves in 40-70k steps,
    300-400 updates; the step budget leaves room for slower seeds, the time limit only guards a hang.
    """
    cfg = RunCfg(env=EnvCfg(id="CartPole-v1", num_envs=8, num_workers=1),
                 model=ModelCfg(name="mlp", hidden=(64,), lstm_size=64),
                 algo=AlgoCfg(name="r2d2", lr=1e-3),
                 arch=ArchCfg(name="seed", local_actors=2, seq_len=20, burn_in=5, batch_size=32, min_replay=50,
                              replay_capacity=20_000, replay_bytes=64 * 1024**2, target_update=100, replay_ratio=2.0),
                 total_steps=250_000, target_return=195.0, time_limit_s=240, torch_threads=1, progress=False,
                 out=str(tmp_path / "run"), seed=0)
    summary = run_architecture(cfg)
    assert summary["stop_reason"] == "target_return reached", summary["stop_reason"]
    assert summary["return_mean_last100"] >= 195
    assert summary["learner_version"] >= 100 and summary["gauges"]["replay_sequences"] >= 50
    lag = summary["policy_lag"]
    assert sum(lag["histogram"].values()) == summary["updates"] * 32 * 20  # every replayed step's version
    assert summary["time_split"]["learn"] > 0 and summary["time_split"]["env"] > 0


@pytest.mark.parametrize("given, clip", [(None, 80.0), (40.0, 40.0), (10.0, 10.0)])
def test_r2d2_clips_gradients_at_80_unless_told_otherwise(given, clip):
    """The r2d2 preset clips at 80 (SEED table 8); an explicit value wins, even PAAC's 40 (the base preset's)."""
    cfg = RunCfg(algo=AlgoCfg(name="r2d2", max_grad_norm=given), arch=ArchCfg(name="seed"),
                 model=ModelCfg(name="mlp", lstm_size=5))
    assert R2D2Learner(small_model(cfg), algos.make_loss(cfg), cfg).max_grad_norm == clip


@pytest.mark.slow
def test_seed_r2d2_runs_on_pong(tmp_path):
    """Pong end to end on CPU: Nature CNN, LSTM 512 (defaults), short sequences so updates come quickly."""
    cfg = RunCfg(env=EnvCfg(id="ALE/Pong-v5", num_envs=2, num_workers=1),
                 algo=AlgoCfg(name="r2d2", gamma=0.997),
                 arch=ArchCfg(name="seed", local_actors=2, seq_len=20, burn_in=5, batch_size=4, min_replay=8,
                              replay_capacity=640, replay_ratio=1.0),
                 total_steps=10**9, target_return=math.inf, time_limit_s=90, torch_threads=1, progress=False,
                 out=str(tmp_path / "run"), seed=0)
    summary = run_architecture(cfg)
    assert summary["stop_reason"] == "time_limit_s reached"
    assert summary["updates"] >= 1 and summary["env_steps"] > 0
    assert summary["gauges"]["replay_sequences"] >= 8
