"""Data-parallel learners under torchrun (paac, hts), launched for real on loopback: 2 ranks on half the env
columns each end with the parameters of one process on the whole batch, one rank equals a plain run bit for
bit, refusals are one line, Ctrl-C and a killed rank (``--max-restarts``) end in a checkpoint and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import conveyor
from conveyor.config import AlgoCfg, ArchCfg, ConfigError, EnvCfg, ModelCfg, RunCfg
from conveyor.distributed import Minibatches, check_config
from conveyor.learner import load_latest_checkpoint
from conveyor.storage.rollout import step_samples
from conveyor.procs import descendants
from tests.fault_env import HANGING_ID, alive, children, gone_within

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SMALL = ["--env", "CartPole-v1", "--num-envs", "8", "--num-workers", "1", "--torch-threads", "1", "--no-progress",
         "--log-interval-s", "0.5"]
PPO = ["--algo", "ppo", "--unroll", "16", "--ppo-epochs", "2", "--ppo-minibatches", "4", "--normalize-obs"]
TORCHRUN_ENV = {key: value for key, value in os.environ.items()
                if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def torchrun(out: Path, *flags: str, nproc: int = 2, launcher: tuple[str, ...] = (), **popen) -> subprocess.Popen:
    command = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), *launcher, "-m", "conveyor", "train",
               *SMALL, "--out", str(out), *flags]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=TORCHRUN_ENV,
                            **popen)


def finished(proc: subprocess.Popen, timeout: float = 300) -> str:
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout + stderr


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def max_param_difference(a: Path, b: Path) -> float:
    left, right = load_latest_checkpoint(a)[1]["model"], load_latest_checkpoint(b)[1]["model"]
    assert left.keys() == right.keys()
    return max(float((left[key].double() - right[key].double()).abs().max()) for key in left)


def paac_cfg(out: Path, algo: str, total_steps: int) -> RunCfg:
    if algo == "ppo":
        return RunCfg(env=EnvCfg(id="CartPole-v1", num_envs=8, num_workers=1), arch=ArchCfg(name="paac", unroll=16),
                      algo=AlgoCfg(name="ppo", ppo_epochs=2, ppo_minibatches=4), model=ModelCfg(normalize_obs=True),
                      total_steps=total_steps, out=str(out), progress=False, torch_threads=1)
    return RunCfg(env=EnvCfg(id="CartPole-v1", num_envs=8, num_workers=1), arch=ArchCfg(name="paac"),
                  total_steps=total_steps, out=str(out), progress=False, torch_threads=1)


@pytest.fixture(scope="module")
def a2c_runs(tmp_path_factory) -> dict[str, Path | str]:
    """The issue's command, shortened (PAAC A2C on CartPole, 8 envs in all): on 2 ranks of 4 envs, on 1 rank,
    and in one process without torchrun, which must not touch torch.distributed. Started together."""
    root = tmp_path_factory.mktemp("dp")
    # lr 2e-3 (the 16-env rate): with the 128-env preset's 1e-2, the ranks' rounding (their gradients are summed
    # in another order) grows into another sampled action within 800 steps
    flags = ("--arch", "paac", "--algo", "a2c", "--total-steps", "800", "--lr", "0.002")
    two, one = torchrun(root / "two-ranks", *flags), torchrun(root / "one-rank", *flags, nproc=1)
    code = ("import sys, torch, conveyor.cli; rc = conveyor.cli.main(sys.argv[1:]); "
            "print('distributed:', 'conveyor.distributed' in sys.modules, torch.distributed.is_initialized()); "
            "sys.exit(rc)")
    plain = subprocess.Popen([sys.executable, "-c", code, "train", *SMALL, *flags, "--out", str(root / "plain")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=TORCHRUN_ENV)
    logs = {name: finished(proc) for name, proc in (("two", two), ("one", one), ("plain", plain))}
    return {"two": root / "two-ranks", "one": root / "one-rank", "plain": root / "plain", "plain_log": logs["plain"]}


@pytest.fixture
def two_ranks(a2c_runs) -> Path:
    return a2c_runs["two"]


@pytest.mark.slow  # torchrun
def test_two_ranks_write_one_run_directory_with_equal_parameters(two_ranks):
    report = summary(two_ranks)
    assert report["env_steps"] == 800 and report["stop_reason"] == "total_steps reached"
    parallel = report["distributed"]
    assert parallel["world_size"] == 2 and parallel["backend"] == "gloo"
    assert parallel["param_sha256_per_rank"] == [report["param_sha256"]] * 2
    # Rank 0 alone wrote: one metrics.csv whose steps only go up, one checkpoint recording the world size. The
    # run's closing row may repeat the step of a periodic row that fell on the last step (a timing matter).
    steps = [int(line.split(",")[0]) for line in (two_ranks / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == sorted(steps) and len(set(steps[:-1])) == len(steps) - 1
    state = load_latest_checkpoint(two_ranks)[1]
    assert state["world_size"] == 2 and len(state["rank_states"]) == 2


@pytest.mark.slow  # torchrun
def test_a2c_on_two_ranks_equals_one_process_on_the_whole_batch(a2c_runs):
    assert "distributed: False False" in a2c_runs["plain_log"]  # no WORLD_SIZE: torch.distributed was not set up
    assert summary(a2c_runs["plain"])["episodes"] == summary(a2c_runs["two"])["episodes"]
    assert max_param_difference(a2c_runs["two"], a2c_runs["plain"]) < 1e-6


@pytest.mark.slow
def test_ppo_on_two_ranks_equals_one_process_on_the_whole_batch(tmp_path):
    # Minibatches of single steps drawn from all 8 x 16 steps, advantages normalized per minibatch, input
    # statistics updated from every rank's observations: all taken over the whole batch.
    proc = torchrun(tmp_path / "two", "--arch", "paac", *PPO, "--total-steps", "384")
    single = conveyor.train(paac_cfg(tmp_path / "one", "ppo", 384))
    finished(proc)
    assert summary(tmp_path / "two")["learner_version"] == single["learner_version"] == 3 * 2 * 4
    assert max_param_difference(tmp_path / "two", tmp_path / "one") < 1e-6


@pytest.mark.slow  # torchrun
def test_one_rank_under_torchrun_is_a_plain_run_bit_for_bit(a2c_runs):
    assert summary(a2c_runs["one"])["param_sha256"] == summary(a2c_runs["plain"])["param_sha256"]


@pytest.mark.slow  # torchrun
def test_resuming_with_another_world_size_is_one_line_naming_both(two_ranks):
    result = subprocess.run([sys.executable, "-m", "conveyor", "train", "--resume", str(two_ranks),
                             "--total-steps", "1600", "--no-progress"], capture_output=True, text=True,
                            env=TORCHRUN_ENV, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "world size 2" in lines[0] and "world size 1" in lines[0], result.stderr


def test_refused_under_torchrun_in_one_line_before_the_rendezvous(tmp_path):
    # WORLD_SIZE alone marks a torchrun rank; the refusal comes before any rendezvous is attempted.
    env = {**TORCHRUN_ENV, "WORLD_SIZE": "2", "RANK": "0"}
    result = subprocess.run([sys.executable, "-m", "conveyor", "train", "--arch", "ga3c", "--out",
                             str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--arch seed" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("change, message", [
    (dict(arch=ArchCfg(name="impact")), "--arch impact does not run under torchrun"),
    (dict(arch=ArchCfg(name="seed")), "--arch seed does not run under torchrun"),
    (dict(out=""), "pass --out DIR"),
    (dict(env=EnvCfg(id="CartPole-v1", num_envs=6, num_workers=2)), "multiple of 4"),
    (dict(device="cuda:1"), "--device cpu or cuda"),
])
def test_config_refusals(tmp_path, change, message):
    base = dict(env=EnvCfg(id="CartPole-v1", num_envs=8, num_workers=2), out=str(tmp_path), total_steps=100)
    with pytest.raises(ConfigError, match=message):
        check_config(RunCfg(**{**base, **change}), size=2)


class _Ranks:
    """What ``Minibatches`` reads of a ``DataParallel`` of ``size`` ranks, holding ``batches`` (one per rank)."""

    def __init__(self, batches: list[dict], rank: int):
        self.batches, self.rank, self.size = batches, rank, len(batches)
        self.env_offset = rank * batches[0]["rewards"].shape[1]

    def gather_columns(self, tensor):
        key = next(key for key, value in self.batches[self.rank].items() if value is tensor)
        return torch.cat([batch[key] for batch in self.batches], dim=1)


def test_each_rank_takes_its_steps_of_every_whole_batch_minibatch():
    T, B = 3, 4
    whole = {"rewards": torch.arange(T * B, dtype=torch.float32).reshape(T, B),
             "advantages": torch.randn(T, B), "valid": torch.rand(T, B) > 0.2}
    halves = [{key: value[:, r * 2:(r + 1) * 2].clone() for key, value in whole.items()} for r in range(2)]
    group = torch.randperm(T * B, generator=torch.Generator().manual_seed(0))[:7]
    expected = step_samples(whole, group)
    parts = []
    for rank in range(2):
        split = Minibatches(_Ranks(halves, rank), halves[rank], steps=True)  # type: ignore[arg-type]
        assert split.groups == T * B
        parts.append(split(group))
        moments = parts[-1]["advantage_moments"]
        valid = expected["valid"]
        mean = expected["advantages"][valid].mean()
        assert torch.allclose(moments, torch.stack([mean, (expected["advantages"][valid] - mean).pow(2).mean().sqrt()]))
    # Every step of the minibatch is on exactly one rank, once.
    assert sorted(torch.cat([part["rewards"][0] for part in parts]).tolist()) == sorted(expected["rewards"][0].tolist())


def rank_pids(torchrun_pid: int) -> dict[int, int]:
    """RANK -> pid of the ranks torchrun started."""
    ranks = {}
    for pid in children(torchrun_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((line[5:] for line in environ if line.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[int(rank)] = pid
    return ranks


def wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


TORCHRUN_STOP_GRACE_S = 30
"""How long torchrun waits for its ranks to exit once it has passed a signal on; then it SIGKILLs those left and
says so ("forcefully exiting"). The bound a rank's stop has by design under torchrun: how long a rank takes to
save, kill its env workers and exit depends on the machine's load."""


def interrupt(proc: subprocess.Popen) -> tuple[list[int], str]:
    """SIGINT to torchrun, which passes it on; both ranks must stop by themselves, within torchrun's grace (none
    killed by torchrun). Returns the env workers the ranks had (to check none outlives them) and torchrun's
    stderr."""
    ranks = rank_pids(proc.pid)
    assert sorted(ranks) == [0, 1]
    workers = [pid for rank in ranks.values() for pid in descendants(rank)]
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=TORCHRUN_STOP_GRACE_S + 120)[1]  # torchrun exits once its ranks are gone
    killed = "forcefully exiting" in stderr  # torchrun's word for a rank it SIGKILLed
    assert not killed, f"a rank outlasted torchrun's {TORCHRUN_STOP_GRACE_S} s grace: {stderr[-3000:]}"
    assert not [pid for pid in ranks.values() if alive(pid)]
    return workers, stderr


@pytest.mark.slow
def test_sigint_to_torchrun_stops_every_rank_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = torchrun(out, "--arch", "paac", "--algo", "a2c", "--total-steps", "100000000", "--target-return", "inf")
    wait_for(lambda: (out / "metrics.csv").is_file() and (out / "metrics.csv").read_text().count("\n") >= 3,
             "the run to log", proc)
    workers, _ = interrupt(proc)
    report = summary(out)
    assert report["stop_reason"] == "signal SIGINT"
    assert len(set(report["distributed"]["param_sha256_per_rank"])) == 1
    assert list((out / "checkpoints").glob("ckpt-*.pt"))
    assert gone_within(workers, 10), "an env worker outlived its rank"


@pytest.mark.slow
def test_sigint_to_torchrun_while_the_ranks_replay_a_resumed_runs_games_stops_them_at_once(tmp_path):
    """A signal stops a running job at the ranks' next shared update, but envs that still replay a resumed run's
    games have no step to keep in step: each rank kills them at once, says so in one line and exits 0."""
    out, marker = tmp_path / "run", tmp_path / "replaying"
    # shm: the replay must run in env worker processes, which a rank can kill (--env-backend auto would step this
    # one-worker run's envs in the rank itself, where a hung replay holds the rank until torchrun SIGKILLs it).
    flags = ["--arch", "paac", "--algo", "a2c", "--env", HANGING_ID, "--env-backend", "shm", "--target-return", "inf"]
    finished(torchrun(out, *flags, "--env-arg", "hang_at=1000000000", "--total-steps", "2400"))
    saved = {path.name: path.read_bytes() for path in (out / "checkpoints").glob("*.pt")}
    # Each rank's one env worker hangs in its replay (marker.0, marker.1): at 2400 steps of this seed's run, each
    # rank has an env 4 or more steps into its episode (a 4th step hangs; the API check's 3 steps do not).
    proc = torchrun(out, *flags, "--resume", str(out), "--total-steps", "4000", "--env-arg", "hang_at=4",
                    "--env-arg", f"marker={marker}", "--env-arg", "hangs=2")
    wait_for(lambda: Path(f"{marker}.0").exists() and Path(f"{marker}.1").exists(), "both ranks to replay", proc)
    workers, stderr = interrupt(proc)
    assert stderr.count("replaying the resumed run's games when the run was asked to stop") == 2, stderr[-3000:]
    frames = [line for line in stderr.splitlines() if line.lstrip().startswith('File "')]
    assert not [line for line in frames if "/conveyor/" in line], stderr[-3000:]  # torchrun's own may print
    assert {path.name: path.read_bytes() for path in (out / "checkpoints").glob("*.pt")} == saved
    assert gone_within(workers, 10), "an env worker outlived its rank"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["paac", "hts"])
def test_a_killed_rank_resumes_from_the_last_checkpoint_to_the_same_parameters(tmp_path, arch):
    flags = ["--arch", arch, "--algo", "a2c", "--total-steps", "6000", "--checkpoint-every", "1600"]
    uninterrupted = torchrun(tmp_path / "whole", *flags)
    finished(uninterrupted)
    out = tmp_path / "killed"
    proc = torchrun(out, *flags, launcher=("--max-restarts", "1"))
    wait_for(lambda: bool(list(out.glob("checkpoints/ckpt-*.pt"))), "a checkpoint", proc)
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
    log = finished(proc)
    assert "resuming from" in log
    assert summary(out)["param_sha256"] == summary(tmp_path / "whole")["param_sha256"]


@pytest.mark.slow
def test_hts_under_torchrun_repeats_its_hash_for_any_number_of_actors(tmp_path):
    flags = ["--arch", "hts", "--algo", "a2c", "--total-steps", "1600"]
    runs = [torchrun(tmp_path / f"actors-{actors}", *flags, "--num-actors", str(actors)) for actors in (1, 2)]
    for proc in runs:
        finished(proc)
    hashes = {summary(tmp_path / f"actors-{actors}")["param_sha256"] for actors in (1, 2)}
    assert len(hashes) == 1
