"""Does a tuned configuration beat the preset? Seeds of each, side by side, and the IQM of their final returns.

    .venv/bin/python benchmarks/tune_evidence.py STUDY_DIR [--seeds 100,101,102,103,104] [--out DIR]

STUDY_DIR is a finished ``conveyor tune`` study's folder (its ``best.toml`` and ``study.db``). For each seed,
one after the other so that both arms see the same machine, this runs

- *tuned*: ``conveyor train --config STUDY_DIR/best.toml --seed N --target-return inf``;
- *preset*: the same fixed flags (arch, algo, env, ``--total-steps``, the study's ``--config`` flags) without
  the sampled values, so the presets choose them.

Both arms run the study's whole budget, as its trials did (``--target-return inf``), and a run's score is the
study's objective: the mean return of its last 100 training episodes at the end. The seeds default to 100-104,
none of which a trial of a study of up to 100 trials ran with (trial N runs with seed N), so the best trial's
lucky seed is not counted again. Run directories go to ``runs/tune-evidence/<study>/`` (git-ignored); a run
that finished is not run again, so the same command resumes.

OUT (default ``benchmarks/results/tune/<study>``) receives what is committed: each run's small curve
(``conveyor report``'s export: ``tuned/`` and ``preset/``), the study's ``best.toml``, ``history.png`` and
``importance.png``, ``trials.csv`` (every trial: state, value, values), and ``evidence.json`` with
``evidence.md``: per arm the interquartile mean of the final returns with its 95% stratified bootstrap
interval, P(tuned > preset) with its interval, and the verdict of issue 50's rule: the preset takes the tuned
values when their IQM is higher.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from conveyor.bench import stats
from conveyor.bench.aggregate import RunRecord, export_run, find_runs
from conveyor.bench.report import BUDGET_STOP
from conveyor.cli import train_flag_types
from conveyor.files import write_text_atomic
from conveyor.flag_file import flag_tokens, read_flag_file

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("tuned", "preset")
STUDY_FILES = ("best.toml", "history.png", "importance.png")
DEFAULT_SEEDS = "100,101,102,103,104"


def compare(tuned: Sequence[float], preset: Sequence[float], reps: int = stats.BOOTSTRAP_REPS) -> dict[str, Any]:
    """Per arm the IQM of the final returns with its 95% stratified bootstrap interval, P(tuned > preset) with
    its interval, and whether the tuned values win (their IQM is higher)."""
    result: dict[str, Any] = {}
    for arm, finals in zip(ARMS, (tuned, preset)):
        value, low, high = stats.stratified_bootstrap([np.asarray(finals, dtype=float)], stats.pooled_iqm, reps)
        result[arm] = {"finals": [float(f) for f in finals], "iqm": float(np.squeeze(value)),
                       "low": float(np.squeeze(low)), "high": float(np.squeeze(high))}
    value, low, high = stats.probability_of_improvement([np.asarray(tuned, float)], [np.asarray(preset, float)],
                                                        reps)
    result["p_tuned_above_preset"] = {"value": value, "low": low, "high": high}
    result["tuned_wins"] = result["tuned"]["iqm"] > result["preset"]["iqm"]
    return result


def arm_flags(best: dict[str, Any], sampled: set[str]) -> dict[str, dict[str, Any]]:
    """The flags of each arm: ``best.toml`` as it is, and without its sampled values."""
    return {"tuned": dict(best), "preset": {k: v for k, v in best.items() if k not in sampled}}


def load_study(study_dir: Path) -> Any:
    """The study in ``study_dir/study.db``."""
    from conveyor.tune import import_optuna

    optuna = import_optuna()
    url = f"sqlite:///{(study_dir / 'study.db').resolve()}"
    names = optuna.get_all_study_names(storage=url)
    if len(names) != 1:
        sys.exit(f"{study_dir / 'study.db'} holds {len(names)} studies: pass the folder of one study")
    return optuna.load_study(study_name=names[0], storage=url)


def trials_csv(trials: Sequence[Any]) -> str:
    """Every trial of the study: its number, state, value and sampled values."""
    names = sorted({name for trial in trials for name in trial.params})
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=["trial", "state", "value", *names], lineterminator="\n")
    writer.writeheader()
    writer.writerows({"trial": t.number, "state": t.state.name, "value": "" if t.value is None else f"{t.value:.6g}",
                      **{n: t.params.get(n, "") for n in names}} for t in trials)
    return text.getvalue()


def run_arm(flags: dict[str, Any], seed: int, run_dir: Path) -> RunRecord:
    """The finished run of ``flags`` with ``seed`` in ``run_dir``: run now unless it finished before."""
    summary = run_dir / "summary.json"
    if not (summary.exists() and json.loads(summary.read_text()).get("stop_reason") == BUDGET_STOP):
        shutil.rmtree(run_dir, ignore_errors=True)  # a run stopped halfway starts again, whole
        command = [sys.executable, "-m", "conveyor", "train", *flag_tokens(flags), f"--seed={seed}",
                   "--target-return=inf", "--no-progress", f"--out={run_dir}"]
        print("run: conveyor " + " ".join(command[3:]), flush=True)
        started = time.monotonic()
        if subprocess.run(command, cwd=ROOT).returncode != 0:
            sys.exit(f"the run in {run_dir} failed: see its log, then run this command again")
        print(f"  {time.monotonic() - started:.0f} s", flush=True)
    (record,) = find_runs([run_dir])
    return record


def page(study: str, flags: dict[str, dict[str, Any]], result: dict[str, Any], best_trial: int, date: str,
         command: str) -> str:
    tuned_only = {k: v for k, v in flags["tuned"].items() if k not in flags["preset"]}
    p = result["p_tuned_above_preset"]
    verdict = ("the tuned values win: the preset takes them, with this study as its source"
               if result["tuned_wins"] else "the preset stays: the tuned values do not beat it")
    lines = [f"# Study {study}: the best trial against the preset", "",
             f"`{command}`, {date}. Each run: `conveyor train` with the study's budget "
             f"({flags['preset'].get('total-steps', 0):,} env steps), scored as the study scored its trials "
             "(the mean return of the last 100 training episodes at the end).", "",
             "| arm | values | final returns | IQM [95% CI] |", "|---|---|---|---:|"]
    for arm, values in (("tuned", f"trial {best_trial}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float)
                                                                      else f"{k} {v}" for k, v in tuned_only.items())),
                        ("preset", "the presets' values (`conveyor presets`)")):
        row = result[arm]
        lines.append(f"| {arm} | {values} | {', '.join(f'{f:.1f}' for f in row['finals'])} | "
                     f"{row['iqm']:.1f} [{row['low']:.1f}, {row['high']:.1f}] |")
    lines += ["", f"P(tuned > preset) = {p['value']:.2f} [{p['low']:.2f}, {p['high']:.2f}]; seeds "
              f"{', '.join(map(str, result['seeds']))}. Verdict: {verdict}.", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study_dir", type=Path, help="a finished `conveyor tune` study's folder")
    parser.add_argument("--seeds", default=DEFAULT_SEEDS, help=f"seeds of both arms (default {DEFAULT_SEEDS})")
    parser.add_argument("--out", type=Path, help="what is committed (default benchmarks/results/tune/<study>)")
    parser.add_argument("--runs", type=Path, default=Path("runs/tune-evidence"), help="run directories' root")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    if not (args.study_dir / "best.toml").exists():
        parser.error(f"{args.study_dir} has no best.toml: pass a `conveyor tune` study's folder, after its trials")
    study = load_study(args.study_dir)
    best_trial = study.best_trial
    best = read_flag_file(args.study_dir / "best.toml", set(train_flag_types()))
    if any(best.get(name) != value for name, value in best_trial.params.items()):
        parser.error(f"{args.study_dir / 'best.toml'} is not the best trial's ({best_trial.number}): run the study's "
                 "`conveyor tune` command again, which rewrites it")
    flags = arm_flags(best, set(best_trial.params))
    out = args.out or ROOT / "benchmarks" / "results" / "tune" / study.study_name
    finals: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for seed in seeds:
        for arm in ARMS:
            record = run_arm(flags[arm], seed, args.runs / study.study_name / arm / f"seed-{seed}")
            export_run(record, out / arm)
            finals[arm].append(record.final)
            print(f"  {arm} seed {seed}: {record.final:.1f}", flush=True)
    result = {"study": study.study_name, "seeds": seeds, "best_trial": best_trial.number, "flags": flags,
              **compare(finals["tuned"], finals["preset"])}
    for name in STUDY_FILES:
        if (args.study_dir / name).exists():
            shutil.copyfile(args.study_dir / name, out / name)
    write_text_atomic(out / "trials.csv", trials_csv(study.get_trials(deepcopy=False)))
    write_text_atomic(out / "evidence.json", json.dumps(result, indent=1) + "\n")
    command = "benchmarks/tune_evidence.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = page(study.study_name, flags, result, best_trial.number, time.strftime("%Y-%m-%d"), command)
    write_text_atomic(out / "evidence.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
