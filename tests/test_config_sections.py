"""ArchCfg's per-architecture sections: the flat face the outside reads stays as it was, and each section refuses
its own bad values in one line."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest

import conveyor.presets as presets
from conveyor.bench.suites import SUITE_ALGOS
from conveyor.config import (ARCH_SECTIONS, ARCHS, MAX_PROCESSES, AlgoCfg, ArchCfg, ConfigError, EnvCfg, Ga3cFields,
                             HtsFields, ImpactFields, LauncherFields, PaacFields, RunCfg, SeedFields,
                             SeedLearnerFields, SharedFields, TargetNetworkFields, field_docs, flag_name)

ARCH_FIELDS_BEFORE_SECTIONS = [
    "name", "unroll", "env_groups", "num_actors", "sync_interval", "num_agents", "num_predictors", "num_trainers",
    "min_train_batch", "max_predict_batch", "autotune", "autotune_interval", "inference_batch",
    "inference_timeout_ms", "local_actors", "listen", "token_file", "tls_cert", "tls_key", "max_message_bytes",
    "max_actor_envs", "actor_idle_timeout_s", "launcher", "ray_address", "ray_strategy", "batch_size", "seq_len",
    "burn_in", "replay_bytes", "replay_capacity", "min_replay", "replay_ratio", "checkpoint_replay", "worker_batch",
    "buffer_batches", "replay_times", "broadcast_interval", "use_target_network", "preset", "target_update",
]
"""``dataclasses.fields(ArchCfg)`` as it was when ArchCfg was one class of flat fields (captured before the split)."""

ARCH_FLAGS_BEFORE_SECTIONS = [
    "--arch", "--unroll", "--env-groups", "--num-actors", "--sync-interval", "--num-agents", "--num-predictors",
    "--num-trainers", "--min-train-batch", "--max-predict-batch", "--autotune", "--autotune-interval",
    "--inference-batch", "--inference-timeout-ms", "--local-actors", "--listen", "--token-file", "--tls-cert",
    "--tls-key", "--max-message-bytes", "--max-actor-envs", "--actor-idle-timeout-s", "--launcher", "--ray-address",
    "--ray-strategy", "--batch-size", "--seq-len", "--burn-in", "--replay-bytes", "--replay-capacity",
    "--min-replay", "--replay-ratio", "--checkpoint-replay", "--worker-batch", "--buffer-batches", "--replay-times",
    "--broadcast-interval", "--use-target-network", "--preset", "--target-update",
]


def test_the_fields_their_order_flags_and_config_keys_are_those_of_the_flat_class():
    names = [fld.name for fld in dataclasses.fields(ArchCfg)]
    assert names == ARCH_FIELDS_BEFORE_SECTIONS
    assert [flag_name("arch", name) for name in names] == ARCH_FLAGS_BEFORE_SECTIONS
    assert list(RunCfg().to_dict()["arch"]) == ARCH_FIELDS_BEFORE_SECTIONS
    # every field sits in exactly one section, the sections in field order
    assert [fld.name for section in ARCH_SECTIONS for fld in dataclasses.fields(section)] == names
    assert set(field_docs(ArchCfg)) == set(names) and all(field_docs(ArchCfg).values())


def test_a_config_json_of_the_flat_class_loads_back():
    cfg = RunCfg(arch=ArchCfg(name="seed", local_actors=1, inference_batch=8), algo=AlgoCfg(name="vtrace"))
    data = cfg.to_dict()
    assert RunCfg.from_dict(data) == cfg
    assert RunCfg.from_dict(data).arch.inference_batch == 8


def test_one_architecture_to_algorithms_table():
    assert ARCHS == tuple(presets.ARCH_ALGOS)
    assert SUITE_ALGOS == {arch: algos[0] for arch, algos in presets.ARCH_ALGOS.items()}  # the suites run the own


def arch(**fields: Any) -> Callable[[], Any]:
    return lambda: ArchCfg(**fields)


def run(**fields: Any) -> Callable[[], Any]:
    return lambda: RunCfg(**fields)


BAD = [
    (SharedFields, arch(name="dqn"), "unknown arch 'dqn'"),
    (SharedFields, arch(unroll=0), "unroll must be positive"),
    (SharedFields, run(arch=ArchCfg(name="seed"), algo=AlgoCfg(name="a2c")), "--arch seed does not run --algo a2c"),
    (PaacFields, arch(env_groups=0), "env_groups must be positive"),
    (PaacFields, run(env=EnvCfg(num_envs=8, num_workers=2), arch=ArchCfg(env_groups=3)),
     "--env-groups 3 must divide --num-workers 2"),
    (PaacFields, run(env=EnvCfg(backend="inproc"), arch=ArchCfg(env_groups=2)), "--env-groups 1 or --env-backend shm"),
    (HtsFields, arch(name="hts", sync_interval=0), "sync_interval must be positive"),
    (HtsFields, arch(num_actors=MAX_PROCESSES + 1), f"num_actors must be at most {MAX_PROCESSES}"),
    (Ga3cFields, arch(num_agents=0), "num_agents must be positive"),
    (Ga3cFields, arch(autotune_interval=-1.0), "autotune_interval must be positive"),
    (SeedFields, arch(inference_batch=0), "inference_batch must be positive"),
    (SeedFields, arch(local_actors=-1), "local_actors must be >= 0"),
    (SeedFields, arch(tls_cert="cert.pem"), "TLS needs both --tls-cert and --tls-key"),
    (SeedFields, arch(name="seed", launcher="ray", local_actors=0), "pass --local-actors N > 0"),
    (SeedFields, run(env=EnvCfg(num_envs=300), arch=ArchCfg(name="seed")),
     "would be refused by --max-actor-envs 256"),
    (LauncherFields, arch(launcher="mpi"), "unknown launcher 'mpi'"),
    (LauncherFields, arch(ray_strategy="scatter"), "unknown ray_strategy 'scatter'"),
    (LauncherFields, arch(name="hts", launcher="ray"), "torchrun --nproc_per_node"),
    (LauncherFields, arch(name="ga3c", launcher="ray"), "use --arch seed"),
    (SeedLearnerFields, arch(seq_len=0), "seq_len must be positive"),
    (SeedLearnerFields, arch(seq_len=10, burn_in=10), "burn_in (10) must be smaller than seq_len (10)"),
    (SeedLearnerFields, arch(replay_ratio=-1.0), "replay_ratio must be >= 0"),
    (ImpactFields, arch(name="impact", preset="rainbow"), "unknown preset 'rainbow'"),
    (ImpactFields, arch(name="paac", preset="appo"), "use it with --arch impact"),
    (ImpactFields, arch(name="impact", replay_times=0), "replay_times must be positive"),
    (ImpactFields, run(arch=ArchCfg(name="impact", use_target_network=False), algo=AlgoCfg(kl_coef=0.1)),
     "--kl-coef penalises KL(target || learner)"),
    (TargetNetworkFields, arch(target_update=0), "target_update must be positive"),
]


@pytest.mark.parametrize("section, build, message", BAD, ids=[f"{s.__name__}-{m}" for s, _, m in BAD])
def test_each_section_refuses_its_own_bad_values_in_one_line(section, build, message):
    with pytest.raises(ConfigError) as caught:
        build()
    text = str(caught.value)
    assert message in text and len(text.splitlines()) == 1
    raisers = {entry.frame.code.raw.co_qualname for entry in caught.traceback}
    assert raisers & {f"{section.__name__}.check", f"{section.__name__}.check_in_run"}, raisers


def test_every_section_check_passes_the_defaults_of_every_architecture():
    for name in ARCHS:
        cfg = RunCfg(arch=ArchCfg(name=name))
        assert cfg.algo.name == presets.own_algo(name)
        for section in ARCH_SECTIONS:
            section.check(cfg.arch)
            section.check_in_run(cfg.arch, cfg)
