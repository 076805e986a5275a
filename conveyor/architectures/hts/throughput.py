"""HTS-RL's throughput model (Liu et al. 2020, section 4.2, claim 1 / eq. 7, proof in appendix A): the expected
time to collect K states with N envs that synchronize every alpha steps.

Assumptions (the paper's):

- one env step takes X ~ Gamma(k, lam) (shape k, rate lam: mean k / lam), i.i.d. over envs and steps; an
  exponential step time is k = 1 (``conveyor/StepTime-v0``: ``dist=exponential`` is k = 1, ``dist=gamma`` takes
  ``shape`` as k, ``dist=constant`` is the limit k -> infinity at the same mean);
- every step also waits a constant beta for its action (the paper's actor compute time; here whatever an env
  waits between posting its observation and reading its action: pipes, the actor's forward, other requests);
- between two synchronizations each env runs alpha steps on its own, and a synchronization waits for the
  slowest env; rounds are independent.

Derivation. K states take K / (N alpha) rounds. In a round env i spends S_i + alpha beta, where
S_i = X_1 + ... + X_alpha ~ Gamma(alpha k, lam) (a sum of i.i.d. gammas with one rate), and the round lasts
max_i S_i + alpha beta. Extreme-value theory (Gumbel domain, which the gamma is in) gives, with F the CDF of
Gamma(alpha k, lam) and gamma_E the Euler-Mascheroni constant,

    E[max of N] ~= F^-1(1 - 1/N) + gamma_E (F^-1(1 - 1/(e N)) - F^-1(1 - 1/N)),

so (eq. 7)

    E[T_K] ~= K / (N alpha) * (F^-1(1 - 1/N) + gamma_E (F^-1(1 - 1/(e N)) - F^-1(1 - 1/N)) + alpha beta)
           (+ K / (N alpha) * c, with ``round_overhead`` c: a fixed cost per synchronization, not in the paper,
             zero by default).

For N = 1 there is no maximum (F^-1(0) = 0 breaks the formula): E[max] is the mean alpha k / lam exactly.
The approximation improves with N: for one exponential step (E[max] = H_N mean steps exactly) it is 6 % low at
N = 4, 2.3 % at N = 8, 0.9 % at N = 16 (3.35 vs 3.38) and 0.2 % at N = 64, and sums of more steps (alpha k
larger) are closer to a normal variable, where it is tighter still relative to the round;
``tests/test_hts_throughput.py`` checks it against a Monte-Carlo simulation of the rounds;
``benchmarks/hts_steptime.py`` compares it with measured HTS runs (BENCHMARKS.md "hts-steptime").

Pure functions of floats; SciPy (a MinAtar dependency) inverts the gamma CDF and is imported on first use.
"""

from __future__ import annotations

import math

EULER_GAMMA = 0.5772156649015329


def gamma_quantile(p: float, shape: float, rate: float) -> float:
    """F^-1(p) of Gamma(shape, rate)."""
    from scipy.special import gammaincinv  # the inverse of the regularized lower incomplete gamma function

    return float(gammaincinv(shape, p)) / rate


def expected_max(n: int, shape: float, rate: float) -> float:
    """E[max of n i.i.d. Gamma(shape, rate)] by the extreme-value approximation above (exact for n = 1)."""
    if n < 1:
        raise ValueError(f"expected_max needs n >= 1, got {n}")
    if n == 1:
        return shape / rate
    b = gamma_quantile(1.0 - 1.0 / n, shape, rate)
    a = gamma_quantile(1.0 - 1.0 / (math.e * n), shape, rate) - b
    return b + EULER_GAMMA * a


def round_time(num_envs: int, alpha: int, shape: float, rate: float, beta: float = 0.0,
               round_overhead: float = 0.0) -> float:
    """Expected seconds of one synchronization round: N envs run alpha steps each (step time Gamma(shape,
    rate) seconds plus ``beta``), and the round waits for the slowest, plus ``round_overhead``. Constant step
    times (no variance) are ``steptime_round_time(dist="constant")``."""
    if alpha < 1:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    return expected_max(num_envs, alpha * shape, rate) + alpha * beta + round_overhead


def expected_time(num_states: int, num_envs: int, alpha: int, shape: float, rate: float, beta: float = 0.0,
                  round_overhead: float = 0.0) -> float:
    """Eq. 7: expected seconds to collect ``num_states`` (K) states with ``num_envs`` (N) envs synchronizing
    every ``alpha`` steps, step times Gamma(``shape``, ``rate``) seconds, ``beta`` seconds per step for the
    action and ``round_overhead`` seconds per synchronization."""
    rounds = num_states / (num_envs * alpha)
    return rounds * round_time(num_envs, alpha, shape, rate, beta, round_overhead)


def steptime_round_time(num_envs: int, alpha: int, dist: str, mean_s: float, shape: float = 1.0,
                        beta: float = 0.0, round_overhead: float = 0.0) -> float:
    """``round_time`` for ``conveyor/StepTime-v0``'s step-time distributions (``envs/step_time.py``): ``dist``
    ``exponential`` (k = 1), ``gamma`` (k = ``shape``) or ``constant`` (no variance: every env takes alpha
    times the mean), all of mean ``mean_s`` seconds."""
    if dist == "constant":
        return alpha * (mean_s + beta) + round_overhead
    if dist == "exponential":
        shape = 1.0
    elif dist != "gamma":
        raise ValueError(f"unknown step-time dist {dist!r}: exponential, gamma or constant")
    if mean_s <= 0.0:
        return alpha * beta + round_overhead
    return round_time(num_envs, alpha, shape, shape / mean_s, beta, round_overhead)


def steptime_sps(num_envs: int, alpha: int, dist: str, mean_s: float, shape: float = 1.0, beta: float = 0.0,
                 round_overhead: float = 0.0) -> float:
    """Predicted env steps per second, K / E[T_K] = N alpha / (expected round time)."""
    return num_envs * alpha / steptime_round_time(num_envs, alpha, dist, mean_s, shape, beta, round_overhead)
