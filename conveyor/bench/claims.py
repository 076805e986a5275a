"""The papers' testable claims (issue 48): what each measures, the rule its verdict follows, its results table.

``benchmarks/claims.py CLAIM`` runs a claim and writes ``benchmarks/results/claims/<claim>/runs.csv``, one row
per run; ``conveyor report`` renders every claim's verdict from those rows (``claims_section``), so the page
and the data cannot disagree. A verdict is ``holds``, ``does not hold`` or ``inconclusive``, with the numbers it
rests on; a claim with no full run yet says so, with the command that produces it.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from conveyor.bench.stats import CONFIDENCE, probability_of_improvement

RESULTS_DIR = Path("benchmarks") / "results" / "claims"
"""Per claim, ``<claim>/runs.csv``; relative to the repository root."""
NOTES_FILE = "notes.md"
"""Beside a claim's ``runs.csv``: what is known of why its findings read as they do (a finding that does not hold
here, with its reason), written by hand after a full run and shown under the claim's table."""
HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
NON_INFERIORITY = 0.3
"""hts: sample efficiency is kept when P(hts > paac) is at least this at the low end of its CI (a run of
HTS scores above a run of PAAC at least 3 times in 10): a margin, since 10 seeds cannot show equality."""
EQ7_TOLERANCE = 0.25
"""hts: eq. 7 predicts a round time within this relative error of the measured one."""
MIN_RUNS = 3
"""Fewer runs of either side than this make a probability of improvement's verdict inconclusive: with one or
two runs its bootstrap interval says nothing."""
GROWTH_BAND = (0.9, 1.1)
"""A quantity grows with a setting when its median at the largest setting is above 1.1 times that at the
smallest, and does not when below 0.9 times: a band for run-to-run noise on a shared machine."""
AUTOTUNE_SHARE = 0.9
"""ga3c: autotune holds when its whole run's TPS is at least this share of the best grid point's."""

Row = dict[str, Any]
PART_NAMES = {"hts": ("efficiency", "speed")}
"""The parts of a claim run in parts (``benchmarks/claims.py --parts``); a row's ``part`` names its part."""


@dataclass(frozen=True)
class Finding:
    """One line of a claim's table: what was tested, the verdict, the numbers it rests on."""

    what: str
    verdict: str
    numbers: str
    seeds: str


@dataclass(frozen=True)
class Claim:
    """A paper's claim: what it says, how its rows are judged, its default seeds and expected durations."""

    name: str
    paper: str
    statement: str
    verdicts: Callable[[Sequence[Row]], list[Finding]]
    """The claim's findings from its ``runs.csv`` rows (values as CSV strings or as the runner's numbers)."""
    rule: str
    """How ``verdicts`` decides, as the page states it."""
    seeds: tuple[int, ...]
    """The seeds of a full run; a claim whose ``seed_minutes`` is 0 runs no seeds (it measures throughput)."""
    full_minutes: int
    """A full run's expected minutes on 2 shared cores, with its default ``seeds``."""
    quick_minutes: int
    seed_minutes: float = 0.0
    """The part of ``full_minutes`` that each seed takes."""

    @property
    def command(self) -> str:
        return f"benchmarks/claims.py {self.name}"

    def expected_minutes(self, seed_count: int) -> float:
        """A full run's expected minutes with ``seed_count`` seeds."""
        return self.full_minutes + self.seed_minutes * (seed_count - len(self.seeds))


def _num(value: Any) -> float:
    """A CSV cell as a float (NaN when empty or not a number)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _ok(rows: Sequence[Row], **match: Any) -> list[Row]:
    return [row for row in rows if row.get("status", "ok") == "ok"
            and all(str(row.get(key)) == str(value) for key, value in match.items())]


def _finite(values: Sequence[Any]) -> np.ndarray:
    numbers = np.array([_num(value) for value in values], dtype=float)
    return numbers[np.isfinite(numbers)]


def _seeds(rows: Sequence[Row]) -> str:
    seeds = sorted({int(row["seed"]) for row in rows if str(row.get("seed", "")).isdigit()})
    return ", ".join(map(str, seeds)) if seeds else "-"


# ---- hts ----------------------------------------------------------------------------------------
def improvement_verdict(estimate: float, low: float, high: float, runs: int = MIN_RUNS) -> str:
    """Non-inferiority of X against Y from P(X > Y) and its CI: fails when the CI lies below 0.5 (Y better),
    holds when its low end reaches ``NON_INFERIORITY``, else (or with fewer than ``MIN_RUNS`` runs of either)
    inconclusive."""
    if runs < MIN_RUNS:
        return INCONCLUSIVE
    if high < 0.5:
        return FAILS
    return HOLDS if low >= NON_INFERIORITY else INCONCLUSIVE


def hts_verdicts(rows: Sequence[Row]) -> list[Finding]:
    findings = []
    efficiency = _ok(rows, part="efficiency")
    tasks = []
    for env in dict.fromkeys(row["env"] for row in efficiency):
        scores = {arch: _finite([row["return_mean_last100"] for row in efficiency if row["env"] == env
                                 and row["arch"] == arch]) for arch in ("hts", "paac")}
        if len(scores["hts"]) and len(scores["paac"]):
            budget = max(int(_num(row["step_budget"])) for row in efficiency if row["env"] == env)
            tasks.append((env, scores["hts"], scores["paac"], budget))
    for env, hts, paac, budget in tasks:
        estimate, low, high = probability_of_improvement([hts], [paac])
        findings.append(Finding(
            f"sample efficiency, {env}: last-100 mean return at {budget:,} env steps",
            improvement_verdict(estimate, low, high, min(len(hts), len(paac))),
            f"P(hts > paac) {estimate:.2f} [{low:.2f}, {high:.2f}]; mean return hts {hts.mean():.1f}, "
            f"paac {paac.mean():.1f} ({len(hts)} and {len(paac)} runs)",
            _seeds([row for row in efficiency if row["env"] == env])))
    if len(tasks) > 1:
        estimate, low, high = probability_of_improvement([task[1] for task in tasks], [task[2] for task in tasks])
        findings.append(Finding(f"sample efficiency, {' and '.join(task[0] for task in tasks)} pooled",
                                improvement_verdict(estimate, low, high, min(min(len(task[1]), len(task[2]))
                                                                             for task in tasks)),
                                f"P(hts > paac) {estimate:.2f} [{low:.2f}, {high:.2f}]", _seeds(efficiency)))
    for row in _ok(rows, part="speed", table="compare"):
        ratio = _num(row["hts_sps"]) / _num(row["paac_sps"])
        findings.append(Finding(f"speed-up, {row['config']}, alpha {row['alpha']}", _above(ratio, 1.0, 1.0),
                                f"HTS / PAAC SPS {ratio:.2f} (medians {_num(row['hts_sps']):,.0f} / "
                                f"{_num(row['paac_sps']):,.0f}; runs {row['hts_runs']} / {row['paac_runs']})", "-"))
    for row in _ok(rows, part="speed", table="eq7"):
        error = _num(row["error_pct"]) / 100
        findings.append(Finding(f"eq. 7, {row['config']}, alpha {row['alpha']}", _above(-abs(error), -EQ7_TOLERANCE,
                                                                                     -EQ7_TOLERANCE),
                                f"measured {_num(row['sps']):,.0f} SPS, predicted {_num(row['predicted_sps']):,.0f} "
                                f"(round time error {error:+.0%}; holds within {EQ7_TOLERANCE:.0%})", "-"))
    return findings


# ---- paac, ga3c, seed, impact ----------------------------------------------------------------------
def _above(value: float, holds_above: float, fails_below: float) -> str:
    """``value`` against its thresholds: holds when above ``holds_above`` (or equal, for a zero band), does not
    hold when below ``fails_below``, inconclusive between them or when it is not a number."""
    if not math.isfinite(value):
        return INCONCLUSIVE
    if value > holds_above or (value == holds_above == fails_below):
        return HOLDS
    return FAILS if value < fails_below else INCONCLUSIVE


def _medians(rows: Sequence[Row], key: str, value: str) -> dict[float, float]:
    """Per value of ``key`` (in increasing order), the median of ``value`` over the rows that have it."""
    groups: dict[float, list[float]] = {}
    for row in rows:
        measured = _num(row.get(value))
        if math.isfinite(measured):
            groups.setdefault(_num(row[key]), []).append(measured)
    return {point: statistics.median(groups[point]) for point in sorted(groups)}


def _series(medians: dict[float, float], digits: int = 0) -> str:
    return ", ".join(f"{point:g}: {value:,.{digits}f}" for point, value in medians.items())


def growth_finding(what: str, medians: dict[float, float], digits: int = 0) -> Finding:
    """"Grows from the smallest to the largest setting": the ratio of their medians, holds above 1.1, does not
    hold below 0.9 (a 10 % band for run-to-run noise on a shared machine)."""
    if len(medians) < 2:
        return Finding(what, INCONCLUSIVE, "fewer than two settings measured", "-")
    values = list(medians.values())
    ratio = values[-1] / values[0] if values[0] else math.nan
    return Finding(what, _above(ratio, GROWTH_BAND[1], GROWTH_BAND[0]),
                   f"largest / smallest {ratio:.2f}; medians {_series(medians, digits)}", "-")


def paac_verdicts(rows: Sequence[Row]) -> list[Finding]:
    ok = _ok(rows)
    sps = growth_finding("SPS grows with n_e at n_w = 2 (fig. 3)", _medians(ok, "num_envs", "sps"))
    learn = _medians(ok, "num_envs", "time_learn")
    env = _medians(ok, "num_envs", "time_env")
    if len(learn) < 2:
        return [sps]
    first, last = next(iter(learn)), next(reversed(learn))
    split = ", ".join(f"{point:g}: env {env.get(point, math.nan):.0%} learn {share:.0%}"
                      for point, share in learn.items())
    share = Finding("the learner's share of a step falls as n_e grows (fig. 2: batching amortizes it)",
                    _above(learn[first] - learn[last], 0.02, -0.02), split, "-")
    return [sps, share]


def ga3c_verdicts(rows: Sequence[Row]) -> list[Finding]:
    grid = [row for row in _ok(rows, part="grid") if str(row["predictors"]) == "1" and str(row["trainers"]) == "1"]
    findings = [growth_finding("policy lag grows with the agent count (sec. 5)", _medians(grid, "agents", "lag_mean"),
                               1),
                growth_finding("TPS grows with the agent count (sec. 5)",
                               _medians(grid, "agents", "tps"), 1)]
    tuned = _ok(rows, part="autotune")
    every = [row for row in _ok(rows, part="grid") if math.isfinite(_num(row["tps"]))]
    if tuned and every:
        best = max(every, key=lambda row: _num(row["tps"]))
        ratio = _num(tuned[0]["tps"]) / _num(best["tps"])
        findings.append(Finding(
            "autotune's (agents, predictors, trainers) reaches the grid's best TPS (sec. 5)",
            _above(ratio, AUTOTUNE_SHARE, AUTOTUNE_SHARE * 0.8),
            f"autotune ({tuned[0]['agents']}, {tuned[0]['predictors']}, {tuned[0]['trainers']}) TPS "
            f"{_num(tuned[0]['tps']):.1f} over the whole run; grid best ({best['agents']}, {best['predictors']}, "
            f"{best['trainers']}) {_num(best['tps']):.1f}; ratio {ratio:.2f} (holds from {AUTOTUNE_SHARE:g})", "-"))
    return findings


def seed_verdicts(rows: Sequence[Row]) -> list[Finding]:
    ok = _ok(rows)
    central = [row for row in ok if str(row["inference"]).startswith("central")]
    local = [row for row in ok if str(row["inference"]).startswith("local")]
    growth = growth_finding("central inference: SPS grows with the actor count (fig. 4)",
                            _medians(central, "actors", "sps"))
    latency = _series(_medians(central, "actors", "latency_p50_ms"), 2) or "-"
    findings = [Finding(growth.what, growth.verdict, f"{growth.numbers}; latency p50 ms by actors {latency}", "-")]
    central_sps, local_sps = _medians(central, "actors", "sps"), _medians(local, "actors", "sps")
    common = sorted(set(central_sps) & set(local_sps))
    if common:
        ratio = central_sps[common[-1]] / local_sps[common[-1]]
        findings.append(Finding(f"central inference outruns local inference at {common[-1]:g} actors (fig. 4)",
                                _above(ratio, GROWTH_BAND[1], GROWTH_BAND[0]),
                                f"SPS central / local {ratio:.2f} ({central_sps[common[-1]]:,.0f} / "
                                f"{local_sps[common[-1]]:,.0f})", "-"))
    return findings


def impact_verdicts(rows: Sequence[Row]) -> list[Finding]:
    """K > 1 against K = 1 over the runs with IMPACT's ratio (R3), then R3 against R1 and R2 at K = 2."""
    ok = [row for row in _ok(rows) if row.get("impact_ratio", "impact") == "impact"]
    return [_reuse_finding(ok), *_ratio_findings(_ok(rows))]


RATIO_NAMES = {"impact": "R3 (impact)", "target": "R1 (target)", "worker": "R2 (worker)"}


def _ratio_findings(rows: Sequence[Row]) -> list[Finding]:
    """IMPACT's ratio R3 = pi / max(pi_target, beta pi_worker) against R1 = pi / pi_target and R2 = pi / pi_worker
    at K = 2 (fig. 4 a): P(R3 > R1), P(R3 > R2)."""
    at_k2 = [row for row in rows if int(_num(row.get("replay_times"))) == 2]
    scores = {ratio: _finite([row["return_mean_last100"] for row in at_k2
                              if row.get("impact_ratio", "impact") == ratio]) for ratio in RATIO_NAMES}
    if not any(len(scores[ratio]) for ratio in ("target", "worker")):
        return []  # a table from before the ratio runs: only the K finding
    findings = []
    for other in ("target", "worker"):
        what = f"{RATIO_NAMES['impact']} beats {RATIO_NAMES[other]} at K = 2 (fig. 4 a)"
        runs = min(len(scores["impact"]), len(scores[other]))
        means = (f"mean last-100 return R3 {scores['impact'].mean():.2f}, {RATIO_NAMES[other].split()[0]} "
                 f"{scores[other].mean():.2f} ({len(scores['impact'])} and {len(scores[other])} runs)"
                 if runs else "no runs of one side")
        if not runs:
            findings.append(Finding(what, INCONCLUSIVE, means, _seeds(at_k2)))
            continue
        estimate, low, high = probability_of_improvement([scores["impact"]], [scores[other]])
        verdict = INCONCLUSIVE if runs < MIN_RUNS else HOLDS if low > 0.5 else FAILS if high < 0.5 else INCONCLUSIVE
        findings.append(Finding(what, verdict, f"P(R3 > {RATIO_NAMES[other].split()[0]}) {estimate:.2f} "
                                               f"[{low:.2f}, {high:.2f}]; {means}", _seeds(at_k2)))
    return findings


def _reuse_finding(ok: Sequence[Row]) -> Finding:
    by_k = {k: _finite([row["return_mean_last100"] for row in ok if int(_num(row["replay_times"])) == k])
            for k in sorted({int(_num(row["replay_times"])) for row in ok})}
    means = ", ".join(f"K={k}: {scores.mean():.2f} ({len(scores)})" for k, scores in by_k.items() if len(scores))
    reuse = [scores for k, scores in by_k.items() if k > 1 and len(scores)]
    if 1 not in by_k or not len(by_k[1]) or not reuse:
        return Finding("K > 1 beats K = 1 at equal wall-clock (fig. 4)", INCONCLUSIVE, means or "no runs", "-")
    best_k = max((k for k in by_k if k > 1 and len(by_k[k])), key=lambda k: by_k[k].mean())
    estimate, low, high = probability_of_improvement([by_k[best_k]], [by_k[1]])
    runs = min(len(by_k[best_k]), len(by_k[1]))
    verdict = INCONCLUSIVE if runs < MIN_RUNS else HOLDS if low > 0.5 else FAILS if high < 0.5 else INCONCLUSIVE
    seconds = max(_num(row["time_limit_s"]) for row in ok)
    return Finding(f"K > 1 beats K = 1 at equal wall-clock ({seconds:g} s per run; fig. 4 b)", verdict,
                   f"P(K={best_k} > K=1) {estimate:.2f} [{low:.2f}, {high:.2f}]; mean last-100 return {means}",
                   _seeds(ok))


CLAIMS: dict[str, Claim] = {claim.name: claim for claim in (
    Claim("paac", "PAAC (Clemente et al. 2017), fig. 2 and 3",
          "at a fixed number of workers, more envs per step raise SPS, and the learner's share of a step shrinks",
          paac_verdicts, "SPS: the median at the largest n_e over that at the smallest holds above 1.1 and does "
          "not below 0.9; the learner's share must fall by 2 points", (0,), 12, 3),
    Claim("ga3c", "GA3C (Babaeizadeh et al. 2017), sec. 5",
          "more agents raise TPS up to a point and raise the policy lag; autotune finds (agents, predictors, "
          "trainers) as good as the best of a grid", ga3c_verdicts,
          "lag and TPS: the median at the most agents over that at the fewest, holds above 1.1, does not below 0.9; "
          f"autotune's TPS over the grid's best holds from {AUTOTUNE_SHARE:g}", (0,), 15, 3),
    Claim("seed", "SEED RL (Espeholt et al. 2020), fig. 4",
          "central inference scales SPS with the actor count at low latency, beyond actor-side (local) inference",
          seed_verdicts, "SPS growth as for ga3c; central / local SPS at the most actors holds above 1.1, does not "
          "below 0.9 (local: impact/impact, whose workers each act with their own copy of the policy)", (0,), 8, 3),
    Claim("impact", "IMPACT (Luo et al. 2020), fig. 4",
          "reusing each batch K > 1 times (the circular buffer) learns more than K = 1 at equal wall-clock, and "
          "IMPACT's clipped target-worker ratio R3 more than R1 (target) and R2 (worker), on MinAtar Breakout",
          impact_verdicts,
          f"P(the best K > 1 scores above K = 1), P(R3 > R1), P(R3 > R2): each holds when its 95% CI lies above "
          f"0.5, does not when below, with at least {MIN_RUNS} runs each", (0, 1, 2), 185, 3, seed_minutes=61.5),
    Claim("hts", "HTS-RL (Liu et al. 2020), sec. 5 and claim 1 (eq. 7)",
          "hts/a2c keeps paac/a2c's sample efficiency at equal env steps, and is faster where step times vary a "
          "lot, by about what eq. 7 predicts", hts_verdicts,
          "sample efficiency (non-inferiority; 10 seeds cannot show equality): P(hts > paac) does not hold when its "
          f"95% CI lies below 0.5, holds when its low end is at least {NON_INFERIORITY:g}, with at least {MIN_RUNS} "
          "runs each; speed-up: HTS / PAAC SPS above 1; eq. 7: the round-time error within "
          f"{EQ7_TOLERANCE:.0%}", tuple(range(10)), 20, 4, seed_minutes=1.5),
)}
"""Every claim, in the page's order. Minutes: expected duration on 2 shared cores (hts: 1.5 a seed for efficiency
+ 5 for speed, 2026-11-28; impact: six 600 s runs and their start-ups a seed)."""


def read_rows(path: Path) -> list[Row]:
    """A claim's ``runs.csv`` (none when it does not exist)."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def rows_kept(rows: Sequence[Row], parts: Sequence[str], seeds: Sequence[int]) -> list[Row]:
    """The rows of a claim's ``runs.csv`` that a new invocation running ``parts`` (empty: the claim has none) and
    ``seeds`` does not replace: rows of the other parts, and rows whose seed is not run. A row without a seed
    (a speed or grid measurement) is replaced whenever its part runs. So a claim of hours runs a seed at a time,
    across sessions, and its verdicts count every seed run so far."""
    run_seeds = {str(seed) for seed in seeds}
    return [row for row in rows
            if (parts and row.get("part") not in parts) or str(row.get("seed", "")) not in run_seeds | {""}]


def _seeds_not_run(claim: Claim, rows: Sequence[Row]) -> list[int]:
    """The claim's default seeds that its seeded rows do not have yet (none when its rows carry no seed)."""
    seeded = {int(row["seed"]) for row in rows if str(row.get("seed", "")).isdigit()}
    return [seed for seed in claim.seeds if seeded and seed not in seeded]


def verdict_line(claim: Claim, findings: Sequence[Finding]) -> str:
    return "\n".join(f"{claim.name}: {finding.what}: {finding.verdict.upper()} ({finding.numbers})"
                     for finding in findings) or f"{claim.name}: no finished runs: inconclusive"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def claims_section(claims_dir: Path) -> str:
    """The "Paper claims" section of the results page: per claim, its verdicts from the full run's rows in
    ``claims_dir/<claim>/runs.csv``, or the command that produces them."""
    lines = [
        "## Paper claims", "",
        "Each paper's testable claim, tested by one command (`benchmarks/claims.py CLAIM`, see "
        "docs/benchmarks.md) whose per-run rows are in `benchmarks/results/claims/CLAIM/runs.csv`. A verdict is "
        f"*{HOLDS}*, *{FAILS}* or *{INCONCLUSIVE}*, computed from those rows by `conveyor/bench/claims.py` by the "
        "rule each claim states. P(X > Y): the probability of improvement with its "
        f"{CONFIDENCE:.0%} bootstrap interval, as in the section above. Only full runs count: a `--quick` smoke "
        "run writes under `runs/`.",
    ]
    for claim in CLAIMS.values():
        rows = [row for row in read_rows(claims_dir / claim.name / "runs.csv") if row.get("mode") == "full"]
        lines += ["", f"### {claim.name}: {claim.paper}", "", f"Claim: {claim.statement}. Verdict: {claim.rule}.",
                  ""]
        if not rows:
            lines.append(f"No full run yet: `{claim.command}` produces it (about {claim.full_minutes} minutes "
                         "on 2 shared cores).")
            continue
        commands = sorted({row["command"] for row in rows})
        dates = sorted({row["date"] for row in rows})
        lines += [f"Command: {', '.join(f'`{command}`' for command in commands)}; "
                  f"{len(rows)} rows; dates {dates[0]}{f' to {dates[-1]}' if len(dates) > 1 else ''}.", "",
                  "| tested | verdict | numbers [95% CI] | seeds |", "|---|---|---|---|"]
        lines += [f"| {_cell(finding.what)} | **{finding.verdict}** | {_cell(finding.numbers)} | {finding.seeds} |"
                  for finding in claim.verdicts(rows)]
        if seeds := _seeds_not_run(claim, rows):
            listed = ",".join(map(str, seeds))
            lines += ["", f"Not run yet: seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} "
                          f"(`{claim.command} --seeds {listed}`)."]
        missing = [part for part in PART_NAMES.get(claim.name, ())
                   if not any(row.get("part") == part for row in rows)]
        if missing:
            lines += ["", f"Not run yet: part {', '.join(missing)} (`{claim.command} --parts {','.join(missing)}`)."]
        notes = claims_dir / claim.name / NOTES_FILE
        if notes.is_file():
            lines += ["", f"Why (`{RESULTS_DIR.as_posix()}/{claim.name}/{NOTES_FILE}`): {notes.read_text().strip()}"]
    return "\n".join(lines) + "\n"
