"""Statistics over seeds and envs (Agarwal et al. 2021, "Deep Reinforcement Learning at the Edge of the
Statistical Precipice"): interquartile mean, stratified bootstrap confidence intervals, probability of
improvement and performance profiles, with the definitions of ``rliable`` 1.2.0.

Written in NumPy rather than imported from rliable: rliable's bootstrap subclasses ``arch`` < 8, whose import
fails under pandas 3 (it calls a private pandas decorator whose signature changed), and arch 8 dropped the
``random_state`` keyword rliable passes; tests/test_report.py checks these functions against rliable's.

A task is an env; its scores are one row per run (seed). Resampling is stratified: each bootstrap replicate
draws every task's runs with replacement from that task's own runs, as rliable's ``StratifiedBootstrap`` does
(with equal run counts, the same draws from the same ``RandomState`` seed). ``RandomState``: NumPy keeps its
stream fixed across releases, so a committed results page regenerates byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

CONFIDENCE = 0.95
BOOTSTRAP_REPS = 2000
"""rliable's default number of bootstrap replicates."""
BOOTSTRAP_SEED = 0
"""Every estimate draws from a fresh ``RandomState(BOOTSTRAP_SEED)``: a number does not change when other
arch/algos or envs join the data."""


def iqm(scores: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Interquartile mean: the mean of the middle half after dropping ``int(n / 4)`` values from each end
    (``scipy.stats.trim_mean(scores, 0.25)``, rliable's ``aggregate_iqm``); all values pooled when ``axis``
    is None."""
    values = np.asarray(scores, dtype=float)
    if axis is None:
        values, axis = values.reshape(-1), 0
    values = np.sort(values, axis=axis)
    count = values.shape[axis]
    cut = int(0.25 * count)
    return np.take(values, np.arange(cut, count - cut), axis=axis).mean(axis=axis)


def _run_indices(rng: np.random.RandomState, counts: Sequence[int], reps: int) -> list[np.ndarray]:
    """Per task, ``[reps, runs]``: each replicate's resampled run indices, drawn in rliable's order (per
    replicate, equal counts: one ``[runs, tasks]`` draw, as ``StratifiedBootstrap.update_indices``; else one
    draw per task). Equal counts take every replicate's draw in one call: ``RandomState`` makes bounded
    integers one after another from one stream, so a ``[reps, runs, tasks]`` draw holds the same numbers as
    ``reps`` draws of ``[runs, tasks]`` (tests/test_report.py checks)."""
    if len(set(counts)) == 1:
        drawn = rng.randint(0, counts[0], size=(reps, counts[0], len(counts)))
        return [drawn[:, :, task] for task in range(len(counts))]
    drawn = [[rng.randint(0, count, size=count) for count in counts] for _ in range(reps)]
    return [np.stack([replicate[task] for replicate in drawn]) for task in range(len(counts))]


def stratified_bootstrap(tasks: Sequence[np.ndarray], statistic: Callable[[np.ndarray], np.ndarray],
                         reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED,
                         confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(estimate, low, high)`` of ``statistic`` with its percentile confidence interval.

    ``tasks``: per task, ``[runs, values]`` (or ``[runs]``): each run's values, e.g. its final score or its
    score at each of several points. ``statistic`` maps the pooled runs of all tasks, ``[replicates, runs,
    values]``, to ``[replicates, outputs]``; the estimate is its value on the data itself."""
    matrices = [np.asarray(task, dtype=float).reshape(len(task), -1) for task in tasks]
    if not matrices or any(len(matrix) == 0 for matrix in matrices):
        raise ValueError("every task needs at least one run")
    estimate = statistic(np.concatenate(matrices)[None])[0]
    indices = _run_indices(np.random.RandomState(seed), [len(matrix) for matrix in matrices], reps)
    replicates = np.concatenate([matrix[index] for matrix, index in zip(matrices, indices)], axis=1)
    values = statistic(replicates)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(values, [tail, 100 - tail], axis=0)
    return estimate, low, high


def pooled_iqm(pooled: np.ndarray) -> np.ndarray:
    """``[replicates, runs, values]`` -> ``[replicates, values]``: the IQM over runs (and tasks) per value."""
    return iqm(pooled, axis=1)


def profile_statistic(taus: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """The score distribution at ``taus``: the fraction of runs (all tasks pooled) scoring above each tau
    (rliable's ``create_performance_profile`` with ``use_score_distribution``). Input ``[replicates, runs, 1]``."""
    return lambda pooled: (pooled[:, :, :1] > np.asarray(taus)[None, None, :]).mean(axis=1)


def improvement(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """P(X > Y) + P(X = Y) / 2 for one task: the Mann-Whitney U statistic over ``n_x * n_y``, rliable's
    ``probability_of_improvement`` (which returns 0.5 for identical scores, as this does). ``x``, ``y``:
    ``[..., runs]``; the leading axes are kept."""
    above = (x[..., :, None] > y[..., None, :]).mean(axis=(-2, -1))
    tied = (x[..., :, None] == y[..., None, :]).mean(axis=(-2, -1))
    return above + 0.5 * tied


def probability_of_improvement(tasks_x: Sequence[np.ndarray], tasks_y: Sequence[np.ndarray],
                               reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED,
                               confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """``(estimate, low, high)``: the probability that a run of X scores above a run of Y on the same task,
    averaged over tasks, with a percentile interval from resampling each task's runs of X and of Y
    independently (rliable's ``StratifiedIndependentBootstrap``)."""
    pairs = [(np.asarray(x, dtype=float), np.asarray(y, dtype=float)) for x, y in zip(tasks_x, tasks_y, strict=True)]
    estimate = float(np.mean([improvement(x, y) for x, y in pairs]))
    rng = np.random.RandomState(seed)
    per_task = np.zeros((reps, len(pairs)))
    for task, (x, y) in enumerate(pairs):
        x_runs = x[rng.randint(0, len(x), size=(reps, len(x)))]
        y_runs = y[rng.randint(0, len(y), size=(reps, len(y)))]
        per_task[:, task] = improvement(x_runs, y_runs)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(per_task.mean(axis=1), [tail, 100 - tail])
    return estimate, float(low), float(high)


def normalized(score: np.ndarray | float, random: float, reference: float) -> np.ndarray:
    """``(score - random) / (reference - random)``: 0 is a uniform-random policy, 1 the reference score."""
    return (np.asarray(score, dtype=float) - random) / (reference - random)
