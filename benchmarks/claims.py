"""Each paper's testable claim, one command each: runs, per-run rows and a verdict computed from them.

    .venv/bin/python benchmarks/claims.py CLAIM [--quick] [--seeds N,N] [--out DIR] [--parts PART,PART]

CLAIM is one of ``conveyor.bench.claims.CLAIMS`` (paac, ga3c, seed, impact, hts); what each measures, and the rule
its verdict follows, is that module's ``Claim``. A full run writes ``benchmarks/results/claims/<claim>/runs.csv``
(one row per run, rewritten after every run), which ``conveyor report`` renders in the "Paper claims" section of
docs/results.md; ``--quick`` (minutes, a smoke run) writes under ``runs/claims-quick/`` instead, so a smoke run
never passes for the real one. Run directories (checkpoints, logs) go to ``runs/claims/`` (ignored by git).
The measuring code is the existing benchmark scripts' (``hts_steptime.train``, ``compare`` and ``eq7_row``,
``seed_inference.run_config``) and ``conveyor bench``'s child runner; this file only chooses the grids.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # the sibling scripts whose measuring code the claims reuse

from conveyor.bench import write_csv  # noqa: E402
from conveyor.bench.claims import CLAIMS, PART_NAMES, RESULTS_DIR, read_rows, rows_kept, verdict_line  # noqa: E402

Rows = Iterator[dict[str, Any]]


def _split(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's time split (fractions of its wall time) and policy lag from its summary."""
    split = summary.get("time_split_fraction") or {}
    lag = summary.get("policy_lag") or {}
    return {**{f"time_{bucket}": split.get(bucket) for bucket in ("env", "act", "learn", "wait")},
            "lag_mean": lag.get("mean")}


def _train_row(result: dict[str, Any]) -> dict[str, Any]:
    """``hts_steptime.train``'s result as a row's measured part."""
    if "error" in result:
        return {"status": "failed", "error": result["error"]}
    return {"status": "ok", "error": "", "sps": result["sps"], "window_s": result["window_s"], **_split(result)}


# ---- paac: time split and SPS vs n_e at fixed n_w (PAAC fig. 2, 3) -----------------------------------
def paac_rows(args: argparse.Namespace, work: Path) -> Rows:
    from hts_steptime import train

    envs, seconds, repeats = ((8, 32), 6.0, 1) if args.quick else ((4, 8, 16, 32, 64, 128), 20.0, 3)
    for repeat in range(repeats):
        for num_envs in envs:
            result = train("paac", "CartPole-v1", (), 2, None, seconds, work / f"ne{num_envs}-{repeat}",
                           num_envs=num_envs)
            yield {"env": "CartPole-v1", "num_envs": num_envs, "workers": 2, "repeat": repeat, **_train_row(result)}


# ---- ga3c: policy lag and TPS vs agents; autotune against the grid (GA3C sec. 5) ------------------------
def ga3c_rows(args: argparse.Namespace, work: Path) -> Rows:
    from hts_steptime import train

    agents, seconds = ((1, 4), 6.0) if args.quick else ((1, 2, 4, 8, 16, 32), 20.0)
    grid = [(count, 1, 1) for count in agents] + ([] if args.quick else [(16, 2, 1), (16, 1, 2), (16, 2, 2)])
    for count, predictors, trainers in grid:
        flags = ("--num-agents", str(count), "--num-predictors", str(predictors), "--num-trainers", str(trainers))
        result = train("ga3c", "CartPole-v1", (), None, None, seconds, work / f"a{count}-p{predictors}-t{trainers}",
                       algo="ga3c", num_envs=None, flags=flags)
        ga3c = result.get("ga3c") or {}
        yield {"part": "grid", "env": "CartPole-v1", "agents": count, "predictors": predictors, "trainers": trainers,
               "tps": ga3c.get("tps"), **_train_row(result)}
    autotune_s = 2 * seconds if args.quick else 120.0
    result = train("ga3c", "CartPole-v1", (), None, None, autotune_s, work / "autotune", algo="ga3c", num_envs=None,
                   flags=("--autotune", "--autotune-interval", f"{autotune_s / 12:g}"))
    ga3c = result.get("ga3c") or {}
    final = ga3c.get("final_counts") or {}
    yield {"part": "autotune", "env": "CartPole-v1", "agents": final.get("agents"),
           "predictors": final.get("predictors"), "trainers": final.get("trainers"), "tps": ga3c.get("tps"),
           **_train_row(result)}


# ---- seed: inference latency and SPS vs actors, against local inference (SEED fig. 4) --------------------
def seed_rows(args: argparse.Namespace, work: Path) -> Rows:
    import tempfile

    from hts_steptime import train
    from seed_inference import Config, run_config

    actors, envs_per_actor, seconds = ((1, 2), 4, 6.0) if args.quick else ((1, 2, 4, 8), 8, 20.0)
    with tempfile.TemporaryDirectory(prefix="claims-seed-") as sockets:
        for count in actors:
            row = run_config(Config("CartPole-v1", "unix", count, envs_per_actor), seconds, work / "seed",
                             Path(sockets))
            yield {"inference": "central (seed/vtrace)", "actors": count, "envs_per_actor": envs_per_actor,
                   "status": "failed" if "error" in row else "ok", "error": row.get("error", ""),
                   "sps": row.get("sps"), "latency_p50_ms": row.get("latency_p50_ms"),
                   "latency_p99_ms": row.get("latency_p99_ms"), "lag_mean": row.get("lag_mean")}
            # IMPACT's workers each hold the policy and act on their own envs: local inference, the same envs.
            result = train("impact", "CartPole-v1", (), count, None, seconds, work / f"local-a{count}",
                           algo="impact", num_envs=count * envs_per_actor)
            yield {"inference": "local (impact/impact)", "actors": count, "envs_per_actor": envs_per_actor,
                   **_train_row(result)}


# ---- impact: K (buffer reuse) and the surrogate's ratio at equal wall-clock on MinAtar (IMPACT fig. 4) -----
IMPACT_RUNS = (*((k, "impact") for k in (1, 2, 4, 8)), (2, "target"), (2, "worker"))
"""(K, ``--impact-ratio``) of each run of a seed: K = 1, 2, 4, 8 with IMPACT's own ratio R3 (fig. 4 b), then R1
(``target``) and R2 (``worker``) at K = 2, the paper's K for discrete tasks (fig. 4 a; sec. 4: "N = 1 and K = 2
works best")."""


def impact_rows(args: argparse.Namespace, work: Path) -> Rows:
    from conveyor.bench.child import execute
    from conveyor.bench.suites import BenchRun, learning_flags, run_name, train_config

    env_id, seconds = "MinAtar/Breakout-v1", (30.0 if args.quick else 600.0)
    for seed in args.seeds:
        for replay_times, ratio in IMPACT_RUNS:
            flags = (*learning_flags("impact", "impact", "", env_id, seed, 10**9), "--replay-times", str(replay_times),
                     "--impact-ratio", ratio, "--target-return", "inf")
            cfg = dataclasses.replace(train_config(flags), time_limit_s=seconds, progress=False)
            name = run_name("conveyor", "impact", f"impactK{replay_times}{ratio}", env_id, seed)
            row = execute(BenchRun(name, cfg, eval_episodes=0, flags=flags), work / name)
            yield {"env": env_id, "replay_times": replay_times, "impact_ratio": ratio, "seed": seed,
                   "time_limit_s": seconds,
                   **{key: row[key] for key in ("status", "error", "env_steps", "wall_time_s", "sps",
                                                "return_mean_last100")}, "flags": " ".join(flags)}


# ---- hts: sample efficiency at equal env steps; speed-up and eq. 7 (HTS-RL sec. 5, claim 1) ----------------
def hts_rows(args: argparse.Namespace, work: Path) -> Rows:
    """Part ``efficiency``: hts/a2c and paac/a2c with their presets, ``--target-return inf`` and a fixed env-step
    budget per env, through ``conveyor bench``'s child runner; the score is the last-100 mean return at the
    budget. Part ``speed``: ``hts_steptime``'s comparison and eq. 7 rows on gamma (k = 0.5) step times."""
    from conveyor.bench.child import execute
    from conveyor.bench.suites import BenchRun, learning_flags, run_name, train_config
    from hts_steptime import COMPARES, compare, eq7_row

    if "efficiency" in args.parts:
        budgets = {"CartPole-v1": 5_000, "conveyor/StepTime-v0": 6_400} if args.quick else \
            {"CartPole-v1": 25_000, "conveyor/StepTime-v0": 12_800}
        for env_id, steps in budgets.items():
            for seed in args.seeds:
                for arch in ("paac", "hts"):
                    flags = (*learning_flags(arch, "a2c", "", env_id, seed, steps), "--target-return", "inf")
                    cfg = dataclasses.replace(train_config(flags), time_limit_s=900.0, progress=False)
                    name = run_name("conveyor", arch, "a2c", env_id, seed)
                    row = execute(BenchRun(name, cfg, eval_episodes=0, flags=flags), work / name)
                    yield {"part": "efficiency", "env": env_id, "arch": arch, "algo": "a2c", "seed": seed,
                           "step_budget": steps, "status": row["status"], "error": row["error"],
                           "env_steps": row["env_steps"], "wall_time_s": row["wall_time_s"], "sps": row["sps"],
                           "return_mean_last100": row["return_mean_last100"], "flags": " ".join(flags)}
    if "speed" in args.parts:
        seconds, repeats, alphas = (4.0, 1, (64,)) if args.quick else (20.0, 3, (16, 64, 256))
        gamma = [config for config in COMPARES if config.name == "StepTime gamma k=0.5" and config.alpha == 32]
        for config in gamma:
            row = compare(config, seconds, repeats, work / "speed")
            yield {"part": "speed", "status": "ok" if "hts_error" not in row and "paac_error" not in row
                   else "failed", **row}
        for alpha in alphas:
            row = eq7_row("gamma k=0.5", alpha, seconds, work / "speed")
            yield {"part": "speed", "status": "failed" if "error" in row else "ok", **row}


RUNNERS: dict[str, Callable[[argparse.Namespace, Path], Rows]] = {
    "paac": paac_rows, "ga3c": ga3c_rows, "seed": seed_rows, "impact": impact_rows, "hts": hts_rows}
"""A claim run in parts (``PART_NAMES``) or for some of its seeds keeps, in runs.csv, the rows of the parts and
seeds it does not run (``rows_kept``)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("claim", choices=sorted(RUNNERS))
    parser.add_argument("--quick", action="store_true", help="a smoke run of minutes (results under runs/)")
    parser.add_argument("--seeds", type=lambda text: [int(part) for part in text.split(",")], default=None,
                        help="seeds (default: the claim's; --quick: 0)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where runs.csv goes (default: benchmarks/results/claims/CLAIM, with --quick "
                             "runs/claims-quick/CLAIM)")
    parser.add_argument("--parts", type=lambda text: tuple(text.split(",")), default=None,
                        help="hts: efficiency, speed or both (default: both)")
    args = parser.parse_args()
    claim = CLAIMS[args.claim]
    args.parts = args.parts or PART_NAMES.get(args.claim, ())
    if unknown := set(args.parts) - set(PART_NAMES.get(args.claim, ())):
        parser.error(f"--parts {','.join(sorted(unknown))}: claim {args.claim} has parts "
                     f"{', '.join(PART_NAMES.get(args.claim, ())) or 'none'}")
    if args.seeds is not None and not claim.seed_minutes:
        parser.error(f"--seeds: claim {args.claim} measures throughput and runs no seeds; leave --seeds out")
    args.seeds = args.seeds or ([0] if args.quick else list(claim.seeds))
    mode = "quick" if args.quick else "full"
    out = args.out or (ROOT / "runs" / "claims-quick" / args.claim if args.quick else ROOT / RESULTS_DIR / args.claim)
    work = ROOT / "runs" / "claims" / f"{args.claim}-{mode}"
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["benchmarks/claims.py", *sys.argv[1:]])
    minutes = claim.quick_minutes if args.quick else claim.expected_minutes(len(args.seeds))
    print(f"claim {args.claim} ({mode}): expect about {minutes:.0f} minutes on 2 busy cores; rows to "
          f"{out / 'runs.csv'}", flush=True)
    kept = rows_kept(read_rows(out / "runs.csv"), args.parts, args.seeds)
    rows: list[dict[str, Any]] = []
    for row in RUNNERS[args.claim](args, work):
        rows.append({"claim": args.claim, "mode": mode, "date": time.strftime("%Y-%m-%d"), "command": command,
                     "load": round(os.getloadavg()[0], 1), **row})
        print({key: value for key, value in rows[-1].items() if key not in ("command", "flags")}, flush=True)
        write_csv(out / "runs.csv", kept + rows)
    print(verdict_line(claim, claim.verdicts(kept + rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
