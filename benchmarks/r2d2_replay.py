"""R2D2 on SEED: replay insert/sample throughput, learner updates/s, and env SPS on Pong.

Four measurements, each printed as it finishes and written to the ``r2d2-replay`` section of
``docs/benchmarks-log.md`` and to ``benchmarks/results/r2d2_replay.csv``:

1. sum-tree: batched priority updates and stratified samples of 64 leaves at capacity 100,000;
2. replay (``SequenceReplay``, each frame stored once) on Atari-shaped streams (SEED table 8: 80-step
   sequences of 4x84x84 uint8 stacks overlapping by 40, LSTM 512), ``--streams`` env slots each adding
   consecutive sequences with ``continues`` after its first, as the inference thread's sink does: bytes per
   stored env step (the replay's ``nbytes`` / capacity) against the former replay that stored every sequence
   whole (``former_bytes_per_step``); ``add`` of one sequence once the ring has wrapped (sequences/s, MB/s of
   distinct frames written); ``sample`` of a training batch plus its priority write-back, as the training
   thread does (sequences/s, MB/s of rebuilt stacked observations);
3. learner: ``R2D2Learner.learn`` updates/s on the Atari model (Nature CNN, LSTM 512, dueling head;
   80-step sequences with 40 burn-in) and on the CartPole model of ``tests/test_r2d2.py``;
4. runs: the CartPole configuration of the CI learning test to mean return 195 (env steps, seconds,
   updates), and ``conveyor train --arch seed --algo r2d2 --env ALE/Pong-v5`` for a fixed wall time:
   steady-state env steps per second (from ``metrics.csv``, after start-up), with the SEED replay
   ratio 0.75 (learner and actors paced together) and with ``--replay-ratio 0`` (both free-running).

    .venv/bin/python benchmarks/r2d2_replay.py                      # about 5 minutes on 2 loaded CPU cores
    .venv/bin/python benchmarks/r2d2_replay.py --capacity 250000    # the replay at the Atari preset's size (1.8 GB)
    .venv/bin/python benchmarks/r2d2_replay.py --device cuda --learner-batch 64
    .venv/bin/python benchmarks/r2d2_replay.py --quick --no-markdown   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

from conveyor import algos
from conveyor.config import AlgoCfg, ArchCfg, EnvCfg, ModelCfg, RunCfg
from conveyor.models import make_model
from conveyor.bench import publish_results
from conveyor.architectures.seed.r2d2 import R2D2Learner
from conveyor.storage.replay import SequenceReplay, replay_bytes_needed
from conveyor.storage.sum_tree import SumTree
from seed_inference import steady_sps  # benchmarks/ is on sys.path when this script runs

ROOT = Path(__file__).resolve().parent.parent
SECTION = "r2d2-replay"
STARTUP_S = 15.0  # actors import, build Atari envs and connect; replay fills to --min-replay
ATARI_OBS = (4, 84, 84)  # SEED table 8: 4 stacked 84x84 grayscale frames, 80-step sequences, LSTM 512
ATARI_SEQ, ATARI_OVERLAP, ATARI_LSTM = 80, 40, 512


def timed(fn: Callable[[], Any], min_seconds: float, min_calls: int = 3) -> tuple[float, int]:
    """Seconds per call of ``fn`` (after one warm-up call), over at least ``min_seconds`` and ``min_calls``."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls, calls


def sequences(count: int, seq_len: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype, lstm: int,
              num_actions: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    L = seq_len
    obs = (torch.randint(0, 256, (count, L + 1, *obs_shape), generator=g, dtype=torch.uint8)
           if obs_dtype == torch.uint8 else torch.randn(count, L + 1, *obs_shape, generator=g))
    return {"obs": obs, "first": torch.rand(count, L + 1, generator=g) < 0.01,
            "prev_action": torch.randint(num_actions, (count, L + 1), generator=g),
            "prev_reward": torch.randn(count, L + 1, generator=g),
            "actions": torch.randint(num_actions, (count, L), generator=g),
            "rewards": torch.randn(count, L, generator=g), "discounts": torch.full((count, L), 0.997),
            "policy_version": torch.zeros(count, L, dtype=torch.int64),
            "state_h": torch.randn(count, lstm, generator=g), "state_c": torch.randn(count, lstm, generator=g)}


def bench_sum_tree(seconds: float) -> list[dict[str, Any]]:
    tree = SumTree(100_000)
    rng = np.random.default_rng(0)
    tree.update(np.arange(100_000), rng.random(100_000))
    idx, values = rng.integers(0, 100_000, 64), rng.random(64)
    update_s, _ = timed(lambda: tree.update(idx, values), seconds)
    sample_s, _ = timed(lambda: tree.sample(64, rng), seconds)
    return [{"part": "sum-tree update", "shape": "64 leaves of 100,000", "per_s": 1 / update_s, "unit": "batches/s",
             "ms": update_s * 1e3},
            {"part": "sum-tree sample", "shape": "64 leaves of 100,000", "per_s": 1 / sample_s, "unit": "batches/s",
             "ms": sample_s * 1e3}]


def former_bytes_per_step(seq_len: int, overlap: int, obs_shape: tuple[int, ...], lstm: int) -> float:
    """Bytes per env step of the former replay, which stored every sequence whole (uint8 observations):
    per sequence ``(L + 1)`` stacked observations ``prod(obs_shape)`` bytes each, ``first`` / ``prev_action`` /
    ``prev_reward`` (bool, int64, float32: 13 bytes) for each of them, ``actions`` / ``rewards`` / ``discounts`` /
    ``policy_version`` (int64, float32, float32, int64: 24 bytes) for each of the ``L`` transitions, and the LSTM
    state ``(h, c)`` in float32; a sequence brings ``L - overlap`` new env steps (its sum-tree leaf aside)."""
    L = seq_len
    per_sequence = (L + 1) * int(np.prod(obs_shape)) + (L + 1) * (1 + 8 + 4) + L * (8 + 4 + 4 + 8) + 2 * lstm * 4
    return per_sequence / (L - overlap)


def atari_streams(streams: int, pool: int = 16, seed: int = 0) -> Callable[[int], tuple[dict[str, torch.Tensor], bool]]:
    """``next_sequence(stream)``: the stream's next Atari-shaped sequence (contiguous ``obs [81, 4, 84, 84]`` uint8
    stacks, oldest frame first, as ``PartialUnrolls`` hands them to the sink) and its ``continues`` flag.

    A stream's ``n``-th sequence starts ``n * 40`` frames into a random frame timeline (period ``pool * 40``), so
    consecutive sequences share 41 observations as the real ones do; ``pool`` sequences are built up front and
    streams start at different points of it. No episode starts inside (Atari episodes are thousands of steps)."""
    K, L, new = ATARI_OBS[0], ATARI_SEQ, ATARI_SEQ - ATARI_OVERLAP
    g = torch.Generator().manual_seed(seed)
    period = torch.randint(0, 256, (pool * new, *ATARI_OBS[1:]), generator=g, dtype=torch.uint8)
    frames = torch.cat([period, period[: L + K]])  # the timeline repeats: continuity across the wrap
    built = [{"obs": frames[j * new: j * new + L + K].unfold(0, K, 1).permute(0, 3, 1, 2).contiguous(),
              "first": torch.zeros(L + 1, dtype=torch.bool),
              "prev_action": torch.randint(6, (L + 1,), generator=g), "prev_reward": torch.randn(L + 1, generator=g),
              "actions": torch.randint(6, (L,), generator=g), "rewards": torch.randn(L, generator=g),
              "discounts": torch.full((L,), 0.997), "policy_version": torch.zeros(L, dtype=torch.int64),
              "state_h": torch.randn(ATARI_LSTM, generator=g), "state_c": torch.randn(ATARI_LSTM, generator=g)}
             for j in range(pool)]
    counts = [0] * streams

    def next_sequence(stream: int) -> tuple[dict[str, torch.Tensor], bool]:
        n = counts[stream]
        counts[stream] += 1
        return built[(n + stream * pool // max(1, streams)) % pool], n > 0

    return next_sequence


def bench_replay(capacity: int, streams: int, batch: int, seconds: float) -> list[dict[str, Any]]:
    """The R2D2 replay on Atari-shaped streams: memory per stored env step, ``add`` (steady state, the ring
    wrapping and evicting) and ``sample`` + priority write-back of a training batch."""
    K, L, overlap = ATARI_OBS[0], ATARI_SEQ, ATARI_OVERLAP
    replay = SequenceReplay(capacity, L, ATARI_OBS, torch.uint8, ATARI_LSTM, overlap=overlap, frame_stack=K)
    next_sequence = atari_streams(streams)
    frame_mb = int(np.prod(ATARI_OBS[1:])) / 1e6
    adds = iter(range(10**12))

    def add() -> None:
        stream = next(adds) % streams
        sequence, continues = next_sequence(stream)
        replay.add(sequence, stream, continues)

    filling = time.perf_counter()
    while replay.written < capacity + L:  # past one wrap-around: adds below evict as they write
        add()
    fill_s = time.perf_counter() - filling
    written = replay.written
    add_s, add_calls = timed(add, seconds)
    frames_per_add = (replay.written - written) / (add_calls + 1)  # timed() makes one warm-up call
    rng = np.random.default_rng(0)

    def sample_and_update() -> None:
        drawn = replay.sample(batch, rng)
        replay.update_priorities(drawn["ids"], np.abs(rng.standard_normal(batch)))

    sample_s, _ = timed(sample_and_update, seconds)
    obs_mb = (L + 1) * int(np.prod(ATARI_OBS)) / 1e6
    after = replay.nbytes / capacity
    before = former_bytes_per_step(L, overlap, ATARI_OBS, ATARI_LSTM)
    preset = 250_000
    shape = (f"{streams} streams, {L}-step sequences overlapping {overlap}, 4x84x84 u8, LSTM {ATARI_LSTM}, "
             f"capacity {capacity:,} steps")
    return [{"part": "replay memory per stored env step", "shape": shape, "per_s": after, "unit": "bytes",
             "bytes_before": before,
             "note": (f"{replay.nbytes / 1e6:,.0f} MB in all, {len(replay):,} sequences live; the former "
                      f"whole-sequence replay: {before:,.0f} bytes per step ({before / after:.1f}x); Atari preset "
                      f"({preset:,} steps): "
                      f"{replay_bytes_needed(preset, L, overlap, ATARI_OBS, torch.uint8, K, ATARI_LSTM) / 1e9:.2f} GB "
                      f"instead of {preset * before / 1e9:.1f} GB")},
            {"part": "replay add (1 sequence)", "shape": shape, "per_s": 1 / add_s, "unit": "sequences/s",
             "mb_s": frames_per_add * frame_mb / add_s, "ms": add_s * 1e3,
             "mb_of": f"distinct frames written ({frames_per_add:.0f} new frames per sequence)",
             "note": f"filling {replay.capacity:,} steps took {fill_s:.1f} s"},
            {"part": f"replay sample + priorities (batch {batch})", "shape": shape, "per_s": batch / sample_s,
             "unit": "sequences/s", "mb_s": batch * obs_mb / sample_s, "ms": sample_s * 1e3,
             "mb_of": f"rebuilt stacked observations ({obs_mb:.2f} MB per sequence)"}]


def bench_learner(name: str, cfg: RunCfg, obs_space: gym.spaces.Box, num_actions: int, batch: int,
                  seconds: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make_model(cfg.model, obs_space, gym.spaces.Discrete(num_actions), dueling=True)
    learner = R2D2Learner(model, algos.make_loss(cfg), cfg)
    L, device = cfg.arch.seq_len, learner.device
    data = sequences(batch, L, tuple(obs_space.shape), torch.from_numpy(obs_space.sample()).dtype,
                     cfg.model.lstm_size, num_actions)
    time_major = {key: (value if key.startswith("state_") else value.transpose(0, 1).contiguous()).to(device)
                  for key, value in data.items()}
    time_major["weights"] = torch.ones(batch, device=device)

    def update() -> None:
        learner.learn(time_major)
        if device.type == "cuda":
            torch.cuda.synchronize()

    update_s, calls = timed(update, seconds)
    return {"part": f"learner update ({name}, {cfg.device})",
            "shape": f"batch {batch} x {L} steps ({cfg.arch.burn_in} burn-in), LSTM {cfg.model.lstm_size}",
            "per_s": 1 / update_s, "unit": "updates/s", "ms": update_s * 1e3,
            "steps_s": batch * (L - cfg.arch.burn_in) / update_s}


def train_row(part: str, shape: str, args: list[str], run_dir: Path, timeout_s: float) -> dict[str, Any]:
    """One ``conveyor train --arch seed --algo r2d2`` run in a child process, summarized as a table row."""
    command = [sys.executable, "-m", "conveyor.cli", "train", "--arch", "seed", "--algo", "r2d2", *args,
               "--log-interval-s", "1", "--no-progress", "--out", str(run_dir)]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    row: dict[str, Any] = {"part": part, "shape": shape, "unit": "env steps/s", "wall_s": time.perf_counter() - started}
    if proc.returncode != 0:
        row["error"] = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return row
    summary = json.loads((run_dir / "summary.json").read_text())
    split = summary["time_split"]
    total = sum(split.values()) or 1.0
    row.update(per_s=steady_sps(run_dir / "metrics.csv"), updates=summary["updates"],
               lag_mean=summary["policy_lag"]["mean"], env_steps=summary["env_steps"],
               run_s=summary["wall_time_s"], stop=summary["stop_reason"], ret=summary["return_mean_last100"],
               split=" / ".join(f"{100 * split[k] / total:.0f}" for k in ("env", "act", "learn", "wait")))
    return row


def bench_pong(ratio: float, seconds: float, actors: int, envs: int, batch: int, device: str,
               out: Path) -> dict[str, Any]:
    args = ["--env", "ALE/Pong-v5", "--local-actors", str(actors), "--num-envs", str(envs), "--num-workers", "1",
            "--replay-capacity", "16000", "--min-replay", "20", "--batch-size", str(batch),  # 400 sequences' steps
            "--replay-ratio", str(ratio),
            "--gamma", "0.997", "--target-return", "inf", "--total-steps", str(10**9),
            "--time-limit-s", str(STARTUP_S + seconds), "--device", device]
    return train_row(f"env SPS, Pong, replay ratio {ratio:g}",
                     f"{actors} actors x {envs} envs, batch {batch}, 80-step sequences, {device}", args,
                     out / f"pong-ratio{ratio:g}", STARTUP_S + seconds + 180)


def bench_cartpole(device: str, out: Path) -> dict[str, Any]:
    """The configuration of ``tests/test_r2d2.py::test_seed_r2d2_learns_cartpole``, to mean return 195."""
    args = ["--env", "CartPole-v1", "--model", "mlp", "--hidden", "64", "--lstm-size", "64", "--seq-len", "20",
            "--burn-in", "5", "--min-replay", "50", "--replay-capacity", "20000", "--replay-ratio", "2",
            "--target-update", "100", "--lr", "1e-3", "--batch-size", "32", "--local-actors", "2", "--num-envs", "8",
            "--num-workers", "1", "--total-steps", "250000", "--target-return", "195", "--time-limit-s", "300",
            "--torch-threads", "1", "--device", device]
    return train_row("CartPole to return 195 (CI test config)", "2 actors x 8 envs, batch 32, 20-step sequences",
                     args, out / "cartpole", 420)


def markdown(rows: list[dict[str, Any]], command: str, load: float, device: str) -> str:
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else "none used"
    lines = [
        f"Command: `{command}`.",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (mean load average "
        f"{load:.1f}: expect noise), GPU: {gpu}; Python {platform.python_version()}, torch {torch.__version__}; "
        f"date: {time.strftime('%Y-%m-%d')}.",
        "",
        "Replay: one thread, as on the learner (`add` runs on the inference thread, `sample` on the training "
        "thread); each frame is stored once, so `add` writes the 40 new frames of a sequence that continues its "
        "stream and `sample` rebuilds the 4-frame stacks by a gather. The former replay stored every sequence "
        "whole (81 stacked observations, their per-step fields and the LSTM state per 40 new env steps: "
        "`former_bytes_per_step` in the script). Learner: one update on a ready batch. The runs: `conveyor train` "
        "with local actors; the learner, the inference forward pass and the actors share the cores, so on CPU the "
        "rates are "
        "compute-bound (with replay ratio 0.75 and batch 8 one update needs 10.7 new sequences = 427 env steps).",
        "",
        "| measurement | shape | rate | ms per call | notes |",
        "|---|---|---:|---:|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['part']} | {row['shape']} | failed | | {row['error'][:120]} |")
            continue
        notes = []
        if "mb_s" in row:
            notes.append(f"{row['mb_s']:,.0f} MB/s" + (f" of {row['mb_of']}" if "mb_of" in row else ""))
        if "note" in row:
            notes.append(row["note"])
        if "steps_s" in row:
            notes.append(f"{row['steps_s']:,.0f} learning steps/s")
        if "updates" in row:
            notes.append(f"{row['stop']} after {row['env_steps']:,} env steps, {row['run_s']:.0f} s, "
                         f"{row['updates']} updates (return {row['ret']:.1f}); lag mean {row['lag_mean']:.0f}; "
                         f"time split env/act/learn/wait {row['split']} %")
        ms = f"{row['ms']:.2f}" if "ms" in row else ""
        lines.append(f"| {row['part']} | {row['shape']} | {row['per_s']:,.1f} {row['unit']} | {ms} | "
                     f"{'; '.join(notes)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per micro-benchmark")
    parser.add_argument("--pong-seconds", type=float, default=60.0, help="measured seconds per Pong run")
    parser.add_argument("--capacity", type=int, default=50_000,
                        help="replay capacity in env steps (Atari: about 7.2 kB each; the preset holds 250,000)")
    parser.add_argument("--streams", type=int, default=16, help="replay: env slots adding sequences in turn")
    parser.add_argument("--learner-batch", type=int, default=8, help="sequences per learner update (SEED: 64)")
    parser.add_argument("--device", default="cpu", help="learner device (cpu, cuda)")
    parser.add_argument("--actors", type=int, default=2, help="Pong: local actor processes")
    parser.add_argument("--envs", type=int, default=4, help="Pong: envs per actor")
    parser.add_argument("--quick", action="store_true", help="short measurements (smoke run)")
    parser.add_argument("--out", default="runs/bench-r2d2", help="Pong run directories")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite the docs/benchmarks-log.md section")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.pong_seconds, args.capacity = 0.5, 10.0, 4_000
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    rows: list[dict[str, Any]] = []
    loads: list[float] = []

    def record(new: list[dict[str, Any]]) -> None:
        for row in new:
            rows.append(row)
            loads.append(os.getloadavg()[0])
            print(json.dumps(row, default=str), flush=True)

    record(bench_sum_tree(args.seconds))
    record(bench_replay(args.capacity, args.streams, 64, args.seconds))
    atari = RunCfg(env=EnvCfg(id="ALE/Pong-v5"), model=ModelCfg(name="nature_cnn", lstm_size=512),
                   algo=AlgoCfg(name="r2d2", gamma=0.997), arch=ArchCfg(name="seed", seq_len=80, burn_in=40),
                   device=args.device)
    record([bench_learner("Atari", atari, gym.spaces.Box(0, 255, ATARI_OBS, np.uint8), 6, args.learner_batch,
                          args.seconds)])
    cartpole = RunCfg(model=ModelCfg(name="mlp", hidden=(64,), lstm_size=64), algo=AlgoCfg(name="r2d2", lr=1e-3),
                      arch=ArchCfg(name="seed", seq_len=20, burn_in=5), device=args.device)
    record([bench_learner("CartPole test", cartpole, gym.spaces.Box(-5, 5, (4,), np.float32), 2, 32, args.seconds)])
    record([bench_cartpole(args.device, Path(args.out))])
    for ratio in (0.75, 0.0):
        record([bench_pong(ratio, args.pong_seconds, args.actors, args.envs, args.learner_batch, args.device,
                           Path(args.out))])

    command = " ".join(["benchmarks/r2d2_replay.py", *sys.argv[1:]])
    table = markdown(rows, command, sum(loads) / len(loads), args.device)
    publish_results(ROOT, SECTION, rows, table, markdown=not args.no_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
