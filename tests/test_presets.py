"""Presets: every field a run leaves unset is filled from conveyor/presets.py, and explicit values always win."""

import ast
import dataclasses
import inspect
import json
import subprocess
import sys

import gymnasium as gym
import pytest
from gymnasium.envs.classic_control.pendulum import PendulumEnv

from conveyor import hosts, presets
from conveyor.cli import build_parser, config_from_args, main
from conveyor.config import (ARCH_ALGOS, AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg, check_resume,
                             recorded_config)
from conveyor.envs import MEMORY_ID, STEP_TIME_ID
from conveyor.envs.gym_api import built_family, env_family
from tests.fault_env import TAGGED_FAMILY, TAGGED_ID

FAMILY_ENVS = {"classic-discrete": "CartPole-v1", "classic-continuous": "Pendulum-v1", "atari": "ALE/Pong-v5",
               "mujoco": "HalfCheetah-v5", "minatar": "MinAtar/Breakout-v1"}
SECTION_TYPES = {"env": EnvCfg, "model": ModelCfg, "algo": AlgoCfg, "arch": ArchCfg}
SWING_ID = "PresetsTest/Swing-v0"
"""An env of one's own with continuous actions (Pendulum under another id, its entry point a class)."""
if SWING_ID not in gym.registry:
    gym.register(SWING_ID, entry_point=PendulumEnv, max_episode_steps=200)


def preset_values(cfg):
    return {key: getattr(getattr(cfg, key.rpartition(".")[0]) if "." in key else cfg, key.rpartition(".")[2])
            for key in presets.BASE}


def test_batches_grow_where_the_vector_backend_steps_the_envs():
    """paac/a2c's classic-discrete preset: 128 envs at lr 1e-2 where gymnasium's native vector env steps them
    (CartPole), the a2c 16 at 2e-3 where one env after another is stepped; explicit flags win."""
    assert presets.native_vector_entry("CartPole-v1") == presets.CARTPOLE_VECTOR_ENV
    assert presets.native_vector_entry("Acrobot-v1") == presets.native_vector_entry("ALE/Pong-v5") == ""
    sized = {env_id: (cfg.env.num_envs, cfg.algo.lr) for env_id in ("CartPole-v1", "Acrobot-v1", STEP_TIME_ID)
             for cfg in [RunCfg(env=EnvCfg(id=env_id), arch=ArchCfg(name="paac"))]}
    assert sized == {"CartPole-v1": (128, 1e-2), "Acrobot-v1": (16, 2e-3), STEP_TIME_ID: (16, 2e-3)}
    given = RunCfg(env=EnvCfg(id="CartPole-v1", num_envs=16), arch=ArchCfg(name="paac"), algo=AlgoCfg(lr=7e-4))
    assert (given.env.num_envs, given.algo.lr) == (16, 7e-4)


def test_env_families():
    assert [presets.id_family(env_id) for env_id in FAMILY_ENVS.values()] == list(FAMILY_ENVS)
    assert [env_family(env_id) for env_id in FAMILY_ENVS.values()] == list(FAMILY_ENVS)
    assert presets.id_family("PongNoFrameskip-v4") == "atari"
    assert presets.id_family(STEP_TIME_ID) == presets.id_family(MEMORY_ID) == "classic-discrete"
    assert presets.id_family("LunarLander-v3") == "classic-discrete"
    assert presets.id_family("LunarLander-v3", (("continuous", True),)) == "classic-continuous"
    assert presets.id_family("LunarLanderContinuous-v3") == "classic-continuous"
    assert presets.id_family(TAGGED_ID) is None and env_family(TAGGED_ID) == TAGGED_FAMILY
    assert presets.id_family(SWING_ID) is None and env_family(SWING_ID) == "classic-continuous"


TOLD_BY_ID = sorted(env_id for env_id, spec in gym.registry.items()
                    if spec.entry_point in presets.GYMNASIUM_CONTINUOUS or env_id.startswith(presets.OWN_ENVS_PREFIX))


@pytest.mark.parametrize("env_id, env_args", [*((env_id, ()) for env_id in TOLD_BY_ID), ("HalfCheetah-v5", ()),
                                              ("LunarLander-v3", (("continuous", True),)),
                                              ("CarRacing-v3", (("continuous", False),))])
def test_the_family_an_id_tells_is_the_built_envs(env_id, env_args):
    """``id_family`` knows without a build what building the env shows (its action space, its entry point)."""
    try:
        built = built_family(env_id, env_args)
    except ConfigError as error:  # Box2D or MuJoCo not installed here
        pytest.skip(str(error))
    assert presets.id_family(env_id, env_args) == built


def test_a_config_builds_no_env_and_an_env_of_your_own_is_given_its_family(monkeypatch):
    """RunCfg takes the family its id tells or the one it is given, never building an env; one of your own
    without a family is refused in one line naming the fix, unless every preset field is given (an old
    config.json); the CLI, above the env layer, builds it once to find its family."""
    acrobot = RunCfg(env=EnvCfg(id="Acrobot-v1"))  # classic-discrete, without CartPole's native vector env

    def no_build(*args, **kwargs):
        raise AssertionError("a config built an env")

    monkeypatch.setattr(gym, "make", no_build)
    assert {family: RunCfg(env=EnvCfg(id=env_id)).env.family for family, env_id in FAMILY_ENVS.items()} == {
        family: family for family in FAMILY_ENVS}
    tagged = RunCfg(env=EnvCfg(id=TAGGED_ID, family=TAGGED_FAMILY))
    assert preset_values(tagged) == preset_values(acrobot) and tagged.preset_sources == acrobot.preset_sources
    with pytest.raises(ConfigError, match=r"depend on its family.*pass EnvCfg\(family=\.\.\.\)") as refused:
        RunCfg(env=EnvCfg(id=TAGGED_ID))
    assert "\n" not in str(refused.value)
    recorded = tagged.to_dict()
    del recorded["env"]["family"]
    assert preset_values(RunCfg.from_dict(recorded)) == preset_values(tagged)
    with pytest.raises(ConfigError, match="env 'CartPole-v1' is of family classic-discrete, not atari"):
        RunCfg(env=EnvCfg(id="CartPole-v1", family="atari"))
    with pytest.raises(ConfigError, match="unknown env family 'discrete'"):
        EnvCfg(family="discrete")
    monkeypatch.undo()
    for env_id, family in ((TAGGED_ID, TAGGED_FAMILY), (SWING_ID, "classic-continuous")):
        cfg = config_from_args(build_parser().parse_args(["train", "--env", env_id]))
        assert (cfg.env.family, cfg.algo.lr) == (family, RunCfg(env=EnvCfg(id=env_id, family=family)).algo.lr)


def test_a_run_recorded_before_the_family_field_resumes(tmp_path):
    """A config.json without ``env.family`` (an env of your own, every preset value recorded) resumes: nothing
    builds the env to find a family that no preset field needs, and the resume check passes."""
    run = tmp_path / "run"
    run.mkdir()
    recorded = RunCfg(env=EnvCfg(id=TAGGED_ID, family=TAGGED_FAMILY), out=str(run)).to_dict()
    del recorded["env"]["family"]
    (run / "config.json").write_text(json.dumps(recorded))
    cfg = config_from_args(build_parser().parse_args(["train", "--resume", str(run), "--total-steps", "9"]))
    assert cfg.env.family is None and cfg.total_steps == 9
    check_resume(recorded_config(run), cfg)


def test_preset_fields_are_exactly_the_fields_that_default_to_none():
    """BASE names every preset field once; every other field has a concrete default (target_return's None is
    a value of its own: the env's reward threshold), or one the env fills (env.family: the tables' key)."""
    none_fields = {f.name for f in dataclasses.fields(RunCfg) if f.default is None} - {"target_return"}
    for section, cls in SECTION_TYPES.items():
        none_fields |= {f"{section}.{f.name}" for f in dataclasses.fields(cls) if f.default is None}
    assert none_fields == set(presets.BASE) | {"algo.name", "env.family"}


@pytest.mark.parametrize("family", presets.FAMILIES)
@pytest.mark.parametrize("arch, algo", [(arch, algo) for arch, algos in ARCH_ALGOS.items() for algo in algos])
def test_every_run_resolves_without_none(arch, algo, family):
    cfg = RunCfg(env=EnvCfg(id=FAMILY_ENVS[family]), arch=ArchCfg(name=arch), algo=AlgoCfg(name=algo))
    assert cfg.algo.name == algo
    assert [key for key, value in preset_values(cfg).items() if value is None] == []
    assert set(cfg.preset_sources) == set(presets.BASE)


def test_table_keys_name_real_fields_families_and_pairs():
    for layer in [presets.BASE, *presets.ALGO.values(), *presets.FAMILY.values(), *presets.ALGO_FAMILY.values(),
                  *presets.ARCH_ALGO_FAMILY.values(), *presets.PRESET_FAMILY.values()]:
        assert set(layer) <= set(presets.BASE)
    all_algos = {algo for algos in ARCH_ALGOS.values() for algo in algos}
    assert set(presets.ALGO) <= all_algos and set(presets.FAMILY) <= set(presets.FAMILIES)
    assert all(algo in all_algos and family in presets.FAMILIES for algo, family in presets.ALGO_FAMILY)
    assert all(algo in ARCH_ALGOS[arch] and family in presets.FAMILIES for arch, algo, family in presets.ARCH_ALGO_FAMILY)
    assert all(preset in presets.IMPACT_PRESETS and family in presets.FAMILIES
               for preset, family in presets.PRESET_FAMILY)
    assert ARCH_ALGOS is presets.ARCH_ALGOS  # one table: the pairs config.py refuses and the default algorithm
    assert {arch: presets.own_algo(arch) for arch in ARCH_ALGOS} == {
        "paac": "a2c", "ga3c": "ga3c", "seed": "vtrace", "impact": "impact", "hts": "a2c"}


LAYERS = [  # most specific first: (source name, table, key), for --arch impact --preset appo on CartPole
    ("--preset appo/classic-discrete", "PRESET_FAMILY", ("appo", "classic-discrete")),
    ("impact/impact/classic-discrete", "ARCH_ALGO_FAMILY", ("impact", "impact", "classic-discrete")),
    ("impact/classic-discrete", "ALGO_FAMILY", ("impact", "classic-discrete")),
    ("classic-discrete", "FAMILY", "classic-discrete"),
    ("impact", "ALGO", "impact"),
]


def test_the_most_specific_layer_wins(monkeypatch):
    monkeypatch.setitem(presets.BASE, "algo.value_coef", 9.0)
    for rank, (_, table, key) in enumerate(LAYERS):
        layer = getattr(presets, table)
        monkeypatch.setitem(layer, key, {**layer.get(key, {}), "algo.value_coef": float(rank)})
    for rank, (name, table, key) in enumerate(LAYERS):
        cfg = RunCfg(arch=ArchCfg(name="impact", preset="appo"))
        assert (cfg.algo.value_coef, cfg.preset_sources["algo.value_coef"]) == (float(rank), name)
        layer = getattr(presets, table)
        monkeypatch.setitem(layer, key, {k: v for k, v in layer[key].items() if k != "algo.value_coef"})
    cfg = RunCfg(arch=ArchCfg(name="impact", preset="appo"))
    assert (cfg.algo.value_coef, cfg.preset_sources["algo.value_coef"]) == (9.0, "base")


def test_a_comparison_presets_tuned_values_are_its_own_and_yield_to_flags():
    """`--preset appo` on CartPole takes its own worker batch; `impact` (same loss, K = 8) keeps its; a flag wins."""
    appo = RunCfg(arch=ArchCfg(name="impact", preset="appo"))
    assert (appo.arch.worker_batch, appo.preset_sources["arch.worker_batch"]) == (10, "--preset appo/classic-discrete")
    assert RunCfg(arch=ArchCfg(name="impact")).arch.worker_batch == 32
    assert RunCfg(arch=ArchCfg(name="impact", preset="appo", worker_batch=32)).arch.worker_batch == 32
    assert RunCfg(env=EnvCfg(id="Pendulum-v1"), arch=ArchCfg(name="impact", preset="appo")).arch.worker_batch == 50


def test_explicit_values_win_even_when_they_equal_the_base_preset():
    """`--max-grad-norm 40` with r2d2 stays 40: the r2d2 preset (80) fills only what was not given."""
    cfg = config_from_args(build_parser().parse_args(
        ["train", "--arch", "seed", "--algo", "r2d2", "--max-grad-norm", "40", "--gamma", "0.99"]))
    assert cfg.algo.max_grad_norm == 40.0 and cfg.algo.gamma == 0.99
    assert "algo.max_grad_norm" not in cfg.preset_sources and "algo.gamma" not in cfg.preset_sources
    assert RunCfg(arch=ArchCfg(name="seed"), algo=AlgoCfg(name="r2d2")).algo.max_grad_norm == 80.0


def test_derived_values_see_the_resolved_config():
    """IMPACT's target interval is N * K of the resolved arch, whichever of the two were given or preset."""
    impact = RunCfg(arch=ArchCfg(name="impact"))
    assert impact.arch.target_update == impact.arch.buffer_batches * impact.arch.replay_times
    given = RunCfg(arch=ArchCfg(name="impact", buffer_batches=3, replay_times=5))
    assert given.arch.target_update == 15 and given.preset_sources["arch.target_update"] == "base"
    # A2C on Atari: HTS-RL's lr and RMSProp eps with PAAC's n_e (PAAC's own lr / eps pair stalled Pong).
    pong = RunCfg(env=EnvCfg(id="ALE/Pong-v5"))
    assert (pong.env.num_envs, pong.algo.lr, pong.algo.optimizer, pong.algo.rmsprop_eps) == (
        32, 7e-4, "rmsprop", 1e-5)


def test_python_api_gets_the_preset():
    cfg = RunCfg(env=EnvCfg(id="Pendulum-v1"), algo=AlgoCfg(name="ppo"))
    assert (cfg.algo.gamma, cfg.algo.entropy_coef, cfg.model.normalize_obs, cfg.env.normalize_reward) == (
        0.9, 0.0, False, False)
    assert cfg.preset_sources["algo.gamma"] == "classic-continuous"
    assert cfg.preset_sources["model.normalize_obs"] == "paac/ppo/classic-continuous"  # rl-zoo's PPO Pendulum recipe
    hts = RunCfg(env=EnvCfg(id="Pendulum-v1"), arch=ArchCfg(name="hts"), algo=AlgoCfg(name="ppo"))
    assert (hts.model.normalize_obs, hts.env.normalize_reward) == (True, True)


def test_algorithm_defaults_to_the_architectures_own_and_impact_presets_fix_theirs():
    cfg = RunCfg(arch=ArchCfg(name="seed"))
    assert (cfg.algo.name, cfg.preset_sources["algo.name"]) == ("vtrace", "seed")
    impala = RunCfg(arch=ArchCfg(name="impact", preset="impala"))
    assert (impala.algo.name, impala.arch.replay_times, impala.arch.use_target_network) == ("vtrace", 1, False)
    assert impala.preset_sources["arch.replay_times"] == "--preset impala"
    assert RunCfg(arch=ArchCfg(name="impact", preset="appo", replay_times=1)).arch.replay_times == 1
    with pytest.raises(ConfigError, match="--preset appo sets replay_times to 1"):
        RunCfg(arch=ArchCfg(name="impact", preset="appo", replay_times=3))
    with pytest.raises(ConfigError, match="--preset impala runs --algo vtrace"):
        RunCfg(arch=ArchCfg(name="impact", preset="impala"), algo=AlgoCfg(name="impact"))


def test_r2d2_needs_a_recurrent_core():
    assert RunCfg(arch=ArchCfg(name="seed"), algo=AlgoCfg(name="r2d2")).model.lstm_size == 64
    pong = RunCfg(env=EnvCfg(id="ALE/Pong-v5"), arch=ArchCfg(name="seed"), algo=AlgoCfg(name="r2d2"))
    assert pong.model.lstm_size == 512
    with pytest.raises(ConfigError, match="pass --lstm-size > 0"):
        RunCfg(arch=ArchCfg(name="seed"), algo=AlgoCfg(name="r2d2"), model=ModelCfg(lstm_size=0))


@pytest.mark.parametrize("arch, algo", [("paac", "a2c"), ("paac", "ppo"), ("hts", "a2c"), ("ga3c", "ga3c")])
def test_actor_critics_refuse_a_recurrent_core(arch, algo):
    # Their acting is step by step with no core state carried, so a recurrent model would not act as it learns
    # (SEED and IMPACT carry it: tests/test_recurrent_actor_critic.py).
    with pytest.raises(ConfigError, match="runs feed-forward models .* drop --lstm-size"):
        RunCfg(arch=ArchCfg(name=arch), algo=AlgoCfg(name=algo), model=ModelCfg(lstm_size=8))


@pytest.mark.parametrize("cfg", [
    RunCfg(),
    RunCfg(env=EnvCfg(id="Pendulum-v1", env_args=(("g", 9.81),)), arch=ArchCfg(name="impact")),
    RunCfg(env=EnvCfg(id="ALE/Pong-v5"), arch=ArchCfg(name="seed"), algo=AlgoCfg(name="r2d2")),
], ids=["default", "impact-pendulum", "r2d2-pong"])
def test_resolved_config_round_trips_as_explicit_values(cfg):
    again = RunCfg.from_dict(cfg.to_dict())
    assert again == cfg and again.preset_sources == {}


def test_presets_command_prints_the_tables(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "# base" in out and "  a2c/atari:" in out and "arch.target_update = buffer_batches * replay_times" in out


def test_r2d2_keeps_seeds_adam_eps_only_for_atari_sized_td_errors():
    """SEED's Adam eps 1e-3 is sized for Atari's value-rescaled TD errors; on CartPole and MinAtar the gradients'
    sqrt(v) falls below it and it damps every step (BENCHMARKS.md), so those families take 1e-5."""
    eps = {family: RunCfg(env=EnvCfg(id=FAMILY_ENVS[family]), arch=ArchCfg(name="seed"),
                          algo=AlgoCfg(name="r2d2")).algo.adam_eps for family in ("classic-discrete", "minatar", "atari")}
    assert eps == {"classic-discrete": 1e-5, "minatar": 1e-5, "atari": 1e-3}


def test_atari_actor_critics_anneal_the_lr_and_ga3c_r2d2_keep_theirs_fixed():
    """A3C, IMPALA, baselines' A2C and PPO anneal the lr to 0 on Atari; GA3C's and seed_rl's R2D2 configs hold
    it fixed, and so does every other family (BENCHMARKS.md: the Pong fork at 7.21M)."""
    pairs = [("paac", "a2c"), ("hts", "ppo"), ("seed", "vtrace"), ("impact", "impact"), ("ga3c", "ga3c"),
             ("seed", "r2d2")]
    schedule = {(algo, family): RunCfg(env=EnvCfg(id=FAMILY_ENVS[family]), arch=ArchCfg(name=arch),
                                       algo=AlgoCfg(name=algo)).algo.lr_schedule
                for arch, algo in pairs for family in ("atari", "minatar")}
    assert schedule == {**{(algo, "atari"): "linear" for algo in ("a2c", "ppo", "vtrace", "impact")},
                        **{(algo, "atari"): "constant" for algo in ("ga3c", "r2d2")},
                        **{(algo, "minatar"): "constant" for _, algo in pairs}}
    explicit = RunCfg(env=EnvCfg(id="ALE/Pong-v5"), arch=ArchCfg(name="paac"), algo=AlgoCfg(name="a2c",
                      lr_schedule="constant"))
    assert explicit.algo.lr_schedule == "constant"


def test_presets_command_explains_a_run(capsys):
    assert main(["presets", "--arch", "seed", "--algo", "r2d2", "--env", "CartPole-v1", "--max-grad-norm", "40"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# seed/r2d2 on CartPole-v1 (family classic-discrete)"
    assert "algo.max_grad_norm = 40.0  explicit" in lines
    assert "arch.target_update = 100  preset(r2d2/classic-discrete)" in lines
    assert "algo.adam_eps = 1e-05  preset(r2d2/classic-discrete)" in lines
    assert "model.lstm_size = 64  preset(r2d2)" in lines
    assert "seed = 0  default" in lines and "arch.name = 'seed'  explicit" in lines


def test_unknown_env_id_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "conveyor.cli", "presets", "--env", "NoSuchEnv-v9"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown env id 'NoSuchEnv-v9'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_every_table_value_cites_its_source():
    """Each entry of every table (a key with a plain or Derived value) carries `# source:` on its line."""
    source = inspect.getsource(presets)
    lines = source.splitlines()
    tables = {"ARCH_ALGOS", "BASE", "ALGO", "FAMILY", "CONTINUOUS_CONTROL", "ALGO_FAMILY", "ARCH_ALGO_FAMILY",
              "PRESET_FAMILY"}
    found = set()
    uncited = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign) and node.target.id in tables:  # type: ignore[union-attr]
            found.add(node.target.id)  # type: ignore[union-attr]
            for table in ast.walk(node.value):  # type: ignore[arg-type]
                if isinstance(table, ast.Dict):
                    for key, value in zip(table.keys, table.values):
                        if key is not None and not isinstance(value, ast.Dict):
                            if "# source: " not in lines[key.lineno - 1]:
                                uncited.append(lines[key.lineno - 1].strip())
    assert found == tables and uncited == []


def test_warns_when_the_target_network_can_never_sync():
    r2d2 = RunCfg(arch=ArchCfg(name="seed"), algo=AlgoCfg(name="r2d2"), total_steps=2_000)
    # 2k steps / 10 new steps per sequence = 200 sequences, 150 after min_replay 50, x ratio 8 / batch 32: 37.5
    assert presets.expected_updates(r2d2) == pytest.approx(150 * 8 / 32)
    assert "the target network will never sync" in presets.target_sync_warning(r2d2)
    assert presets.target_sync_warning(dataclasses.replace(r2d2, total_steps=100_000)) is None
    impact = RunCfg(arch=ArchCfg(name="impact", target_update=1000), total_steps=10_000)
    # 8 envs on 2 workers: one batch is 32 steps x 4 envs, used K = 4 times
    assert presets.expected_updates(impact) == pytest.approx(10_000 / 128 * 4)
    assert presets.target_sync_warning(impact).startswith("conveyor: warning: 10,000 env steps make about 312")
    assert presets.target_sync_warning(RunCfg()) is None  # no target network


@pytest.mark.slow  # an IMPACT run's start-up (5 s); target_sync_warning itself is checked above in make test
def test_the_warning_is_one_line_on_stderr_at_start(capsys, tmp_path):
    assert main(["train", "--arch", "impact", "--total-steps", "500", "--target-update", "1000", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "--target-update 1000" in warnings[0]


def test_learner_threads_one_for_small_models_and_by_architecture_for_large_cnns(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    threads = {(arch, env): RunCfg(env=EnvCfg(id=env), arch=ArchCfg(name=arch)).learner_threads
               for arch in ("paac", "seed") for env in ("CartPole-v1", "ALE/Pong-v5", "MinAtar/Breakout-v1")}
    assert threads == {("paac", "CartPole-v1"): 1, ("paac", "ALE/Pong-v5"): 8, ("paac", "MinAtar/Breakout-v1"): 1,
                       ("seed", "CartPole-v1"): 1, ("seed", "ALE/Pong-v5"): 4, ("seed", "MinAtar/Breakout-v1"): 1}
    assert RunCfg(model=ModelCfg(name="nature_cnn"), env=EnvCfg(id="CartPole-v1")).learner_threads == 8
    assert RunCfg(torch_threads=3).learner_threads == 3


def test_env_workers_are_the_largest_divisor_of_the_envs_up_to_the_bound():
    assert [hosts.env_workers(envs, 2) for envs in (1, 2, 3, 16)] == [1, 2, 1, 2]
    assert [hosts.env_workers(32, most) for most in (1, 2, 6, 16, 64)] == [1, 2, 4, 16, 32]


def test_an_odd_env_count_alone_gets_workers_that_divide_it():
    cfg = RunCfg(env=EnvCfg(num_envs=3))
    assert cfg.env.num_workers == 1 and cfg.preset_sources["env.num_workers"] == "base"


def test_atari_steps_its_envs_on_every_cpu_and_learns_on_the_gpu_where_there_is_one(monkeypatch):
    """On a 16-CPU machine with a GPU, Atari runs spread 32 envs over 16 workers (8 per local SEED actor, which
    each run their own) and learn on cuda; the other families keep 2 workers and the CPU; flags win."""
    monkeypatch.setattr(hosts, "usable_cpus", lambda: 16)
    monkeypatch.setattr(hosts, "accelerator", lambda: "cuda")
    pong = {arch: RunCfg(env=EnvCfg(id="ALE/Pong-v5"), arch=ArchCfg(name=arch)) for arch in ARCH_ALGOS}
    assert {arch: cfg.env.num_workers for arch, cfg in pong.items()} == {
        "paac": 16, "ga3c": 16, "seed": 8, "impact": 16, "hts": 16}
    assert {cfg.device for cfg in pong.values()} == {"cuda"}
    remote = RunCfg(env=EnvCfg(id="ALE/Pong-v5"), arch=ArchCfg(name="seed", local_actors=0))
    assert remote.env.num_workers == 16
    for env_id in ("CartPole-v1", "Pendulum-v1", "MinAtar/Breakout-v1"):
        cfg = RunCfg(env=EnvCfg(id=env_id))
        assert (cfg.env.num_workers, cfg.device) == (2, "cpu"), env_id
    explicit = RunCfg(env=EnvCfg(id="ALE/Pong-v5", num_workers=4), device="cpu")
    assert (explicit.env.num_workers, explicit.device) == (4, "cpu")
    assert "env.num_workers" not in explicit.preset_sources and "device" not in explicit.preset_sources
    monkeypatch.setattr(hosts, "usable_cpus", lambda: 1)
    assert RunCfg(env=EnvCfg(id="ALE/Pong-v5")).env.num_workers == 2


def test_torchrun_ranks_each_split_their_share_of_the_envs_over_their_share_of_the_cpus(monkeypatch):
    """Under torchrun (two ranks on this 16-CPU machine) each rank steps half the envs on its own workers: the
    preset splits each half over half the CPUs, and the batch still splits into ranks x workers."""
    from conveyor.distributed import check_config

    monkeypatch.setattr(hosts, "usable_cpus", lambda: 16)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    pong = RunCfg(env=EnvCfg(id="ALE/Pong-v5"), out="run")
    assert pong.env.num_workers == 8
    check_config(pong, 2)
    six = RunCfg(env=EnvCfg(num_envs=6), out="run")
    assert six.env.num_workers == 1  # 3 envs per rank
    check_config(six, 2)


def test_hts_ppo_on_pendulum_runs_the_values_its_tune_study_found():
    """`conveyor tune` trial 22 beat ppo/classic-continuous's values on 5 new seeds (docs/tuning.md)."""
    cfg = RunCfg(env=EnvCfg(id="Pendulum-v1"), arch=ArchCfg(name="hts"), algo=AlgoCfg(name="ppo"))
    assert (cfg.env.num_envs, cfg.arch.sync_interval, cfg.algo.ppo_epochs, cfg.algo.ppo_minibatches) == (32, 128, 4, 16)
    assert (cfg.algo.lr, cfg.algo.gamma, cfg.algo.entropy_coef, cfg.model.log_std_init) == (8.04e-4, 0.95, 8.16e-3, 0.313)
    assert (cfg.algo.clip, cfg.algo.gae_lambda, cfg.algo.max_grad_norm) == (0.2, 0.95, 0.5)
    assert cfg.preset_sources["env.num_envs"] == "hts/ppo/classic-continuous"
    paac = RunCfg(env=EnvCfg(id="Pendulum-v1"), arch=ArchCfg(name="paac"), algo=AlgoCfg(name="ppo"))
    assert paac.env.num_envs == 16 and paac.algo.lr == 2e-3  # PAAC keeps its own recipe
