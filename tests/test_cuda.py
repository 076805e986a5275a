"""Every architecture and algorithm on a cuda learner, and checkpoints that resume on either device.

Skipped without a GPU (``make test`` never needs one). The runs take a few hundred steps with the options that
put extra state on the device (input statistics, a second trunk) switched on where the model allows them.
"""

import dataclasses

import gymnasium as gym
import numpy as np
import pytest
import torch

import conveyor
from conveyor.config import AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg
from conveyor.acting import GsdeNoise, policy_step, step_targets
from conveyor.learner import load_latest_checkpoint
from conveyor.models import frozen_copy, make_model
from conveyor.transfer import to_device, usable_device
from tests.test_telemetry import NORMALIZED, RUNS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a cuda device")

PENDULUM = EnvCfg(id="Pendulum-v1", num_envs=4, num_workers=2)
GSDE = ModelCfg(hidden=(16,), gsde=True, gsde_interval=4)

CUDA_RUNS = {
    **RUNS,
    "ga3c-a2c": dict(algo=AlgoCfg(name="a2c"), arch=ArchCfg(name="ga3c", num_agents=4, min_train_batch=4, unroll=5)),
    "impact-impala": dict(arch=ArchCfg(name="impact", preset="impala", worker_batch=16, buffer_batches=2)),
    "hts-a2c": dict(algo=AlgoCfg(name="a2c"), arch=ArchCfg(name="hts", sync_interval=5)),
    # A Gaussian policy: continuous actions sampled on the device.
    "paac-ppo-pendulum": dict(env=dataclasses.replace(PENDULUM, normalize_reward=True),
                              algo=AlgoCfg(name="ppo", ppo_minibatches=2), arch=ArchCfg(name="paac", unroll=16)),
    "impact-pendulum": dict(env=PENDULUM, algo=AlgoCfg(name="impact"), arch=ArchCfg(name="impact", worker_batch=16)),
    # gSDE: the noise table lives on the host and meets sigma and the features on the device, in every
    # architecture's acting path (PAAC's checkpoint also carries the per-env step counts).
    **{f"{arch}-{algo}-gsde": dict(env=PENDULUM, algo=AlgoCfg(name=algo), arch=arch_cfg, model=GSDE)
       for arch, algo, arch_cfg in (("paac", "a2c", ArchCfg(name="paac")),
                                    ("hts", "a2c", ArchCfg(name="hts", sync_interval=5)),
                                    ("ga3c", "a2c", ArchCfg(name="ga3c", num_agents=4, min_train_batch=4, unroll=5)),
                                    ("seed", "vtrace", ArchCfg(name="seed", local_actors=1, batch_size=4, unroll=8)),
                                    ("impact", "impact", ArchCfg(name="impact", worker_batch=16)))},
}


@pytest.mark.parametrize("name", list(CUDA_RUNS))
def test_trains_on_cuda_and_resumes_on_the_cpu_and_back(tmp_path, name):
    out = str(tmp_path / "run")
    cfg = RunCfg(**{**NORMALIZED, **CUDA_RUNS[name]}, total_steps=1000, log_interval_s=0.5, out=out, progress=False,
                 torch_threads=1, seed=1, device="cuda")
    on_cuda = conveyor.train(cfg)
    assert on_cuda["updates"] >= 1 and on_cuda["env_steps"] >= 1000
    saved = load_latest_checkpoint(tmp_path / "run")[1]
    assert all(tensor.device.type == "cpu" for tensor in saved["model"].values())  # loaded for any device
    on_cpu = conveyor.train(dataclasses.replace(cfg, device="cpu", total_steps=2000, resume=out))
    assert on_cpu["env_steps"] >= 2000 and on_cpu["learner_version"] > on_cuda["learner_version"]
    back = conveyor.train(dataclasses.replace(cfg, total_steps=3000, resume=out))
    assert back["env_steps"] >= 3000 and back["learner_version"] > on_cpu["learner_version"]


def test_atari_runs_learn_on_the_gpu_by_default_and_other_families_on_the_cpu():
    assert RunCfg(env=EnvCfg(id="ALE/Pong-v5")).device == "cuda"
    assert RunCfg(env=EnvCfg(id="CartPole-v1")).device == "cpu"
    count = torch.cuda.device_count()
    assert usable_device(f"cuda:{count - 1}") == torch.device("cuda", count - 1)
    with pytest.raises(ConfigError, match=f"torch sees {count} GPU"):
        usable_device(f"cuda:{count}")


def test_sampling_with_a_cpu_generator_serves_a_cuda_model():
    model_cfg = RunCfg(model=ModelCfg(hidden=(8,))).model
    for space in (gym.spaces.Discrete(3), gym.spaces.Box(-1, 1, (2,), np.float32)):
        model = make_model(model_cfg, gym.spaces.Box(-1, 1, (4,), np.float32), space)
        obs = torch.randn(1, 5, 4)
        on_cpu = model(obs).sample(generator=torch.Generator().manual_seed(0))
        on_cuda = model.cuda()(obs.cuda()).sample(generator=torch.Generator().manual_seed(0))
        assert on_cuda.device.type == "cuda"
        torch.testing.assert_close(on_cuda.cpu(), on_cpu, atol=1e-5, rtol=0)


def test_gsde_actions_on_a_cuda_model_equal_the_cpu_models():
    """The same envs, steps and seed act the same on either device (the noise is drawn on the host), across a
    redraw of the noise."""
    model = make_model(RunCfg(model=GSDE).model, gym.spaces.Box(-1, 1, (3,), np.float32),
                       gym.spaces.Box(-2, 2, (2,), np.float32))
    obs, envs = torch.randn(5, 3), np.array([4, 0, 7, 2, 9])
    on_cpu, on_cuda = GsdeNoise(3, interval=4), GsdeNoise(3, interval=4)
    expected = [policy_step(model, obs, gsde=on_cpu, envs=envs).actions for _ in range(6)]
    model.cuda()
    for step, actions in enumerate(expected):
        got = policy_step(model, obs.cuda(), gsde=on_cuda, envs=envs).actions
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), actions, atol=1e-5, rtol=0, msg=f"step {step}")


def test_a_frozen_copy_of_a_cuda_lstm_keeps_its_weights_in_one_cudnn_chunk():
    """A deep copy alone leaves them in separate tensors, and cuDNN compacts them at every call (R2D2's target)."""
    obs_space, action_space = gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(3)
    cfg = RunCfg(arch=ArchCfg(name="seed"), algo=AlgoCfg(name="vtrace"), model=ModelCfg(hidden=(16,), lstm_size=8))
    model = make_model(cfg.model, obs_space, action_space).cuda()
    frozen = frozen_copy(model)
    assert len({p.untyped_storage().data_ptr() for p in frozen.core.parameters()}) == 1
    obs, done = torch.randn(5, 2, 4, device="cuda"), torch.zeros(5, 2, device="cuda")
    torch.testing.assert_close(frozen(obs, done=done).params, model(obs, done=done).params)


def test_to_device_copies_what_the_array_held_at_the_call():
    data = np.arange(1 << 22, dtype=np.float32)
    torch.cuda._sleep(10**8)  # queued GPU work: the copy waits behind it, the host does not
    on_gpu = to_device(data, "cuda")
    data[:] = -1.0  # the caller reuses its buffer (a shared-memory obs slot) at once
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), torch.arange(1 << 22, dtype=torch.float32))


def test_an_acting_step_waits_for_the_gpu_only_to_read_the_actions():
    """Observations, rewards and the sampler's draw go to the GPU without a host sync (docs/design.md "GPU data
    path"); ``torch.cuda.set_sync_debug_mode("error")`` raises at any synchronizing call."""
    obs_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    model = make_model(RunCfg(model=ModelCfg(name="nature_cnn")).model, obs_space, gym.spaces.Discrete(6)).cuda()
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 256, (8, 4, 84, 84), dtype=np.uint8)
    rewards, done = rng.normal(size=8).astype(np.float32), np.zeros(8, bool)
    generator = torch.Generator().manual_seed(0)
    policy_step(model, to_device(obs, "cuda"), generator)  # warm-up: cuDNN picks its kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        act = policy_step(model, to_device(obs, "cuda"), generator, keep_graph=True)
        reward, discount = step_targets(model, rewards, done, done, None, 0.99, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert act.actions.cpu().shape == (8,)
    torch.testing.assert_close(reward.cpu(), torch.from_numpy(rewards))
    assert discount.cpu().tolist() == [pytest.approx(0.99)] * 8
