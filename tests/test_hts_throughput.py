"""HTS-RL's eq. 7 (``conveyor.architectures.hts.throughput``) against a Monte-Carlo simulation of the rounds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conveyor.architectures.hts.throughput import (expected_max, expected_time, round_time, steptime_round_time,
                                                   steptime_sps)


def simulated_time(num_states: int, num_envs: int, alpha: int, shape: float, rate: float, beta: float,
                   seed: int = 0) -> float:
    """The synchronization process step by step: every env draws each of its alpha step times, adds beta per
    step, and a round ends when the slowest env is done; the rounds' durations add up."""
    rng = np.random.default_rng(seed)
    rounds = num_states // (num_envs * alpha)
    steps = rng.gamma(shape, 1.0 / rate, size=(rounds, num_envs, alpha)) + beta
    return float(steps.sum(axis=2).max(axis=1).sum())


@pytest.mark.parametrize("num_envs, alpha, shape, mean_s, beta", [
    (16, 1, 1.0, 0.002, 0.0),  # exponential, synchronizing every step (PAAC's pattern)
    (16, 4, 1.0, 0.002, 0.0003),
    (16, 32, 1.0, 0.002, 0.0003),
    (16, 16, 0.5, 0.002, 0.0),  # gamma with shape < 1: more variance than exponential
    (16, 256, 0.5, 0.005, 0.0001),
    (8, 64, 2.0, 0.001, 0.0),
    (32, 512, 1.0, 0.002, 0.0),
])
def test_eq7_matches_a_simulation(num_envs, alpha, shape, mean_s, beta):
    rate = shape / mean_s
    num_states = num_envs * alpha * max(200, 40_000 // alpha)
    simulated = simulated_time(num_states, num_envs, alpha, shape, rate, beta)
    predicted = expected_time(num_states, num_envs, alpha, shape, rate, beta)
    assert predicted == pytest.approx(simulated, rel=0.02)


def test_one_env_is_its_mean():
    assert expected_max(1, 3.0, 2.0) == 1.5
    assert expected_time(100, 1, 10, 1.0, 1000.0, beta=0.001) == pytest.approx(100 * (0.001 + 0.001))


def test_exponential_max_is_close_to_the_harmonic_number():
    # E[max of n Exp(1)] = 1 + 1/2 + ... + 1/n exactly; the approximation (ln n + gamma_E) improves with n.
    for n, rel in ((4, 0.06), (8, 0.025), (16, 0.01), (64, 0.002)):
        assert expected_max(n, 1.0, 1.0) == pytest.approx(sum(1 / i for i in range(1, n + 1)), rel=rel)


def test_less_synchronization_and_less_variance_take_less_time():
    per_state = [round_time(16, alpha, 1.0, 500.0) / alpha for alpha in (1, 4, 16, 64, 512)]
    assert per_state == sorted(per_state, reverse=True)
    assert per_state[-1] < 1.1 * 0.002 < per_state[0] / 2  # alpha = 512 is nearly the mean; alpha = 1 is not
    shapes = [steptime_round_time(16, 8, "gamma", 0.002, k) for k in (0.25, 0.5, 1.0, 4.0)]
    assert shapes == sorted(shapes, reverse=True)
    assert steptime_round_time(16, 8, "constant", 0.002, beta=0.001, round_overhead=0.01) == pytest.approx(0.034)


def test_steptime_distributions():
    assert steptime_round_time(16, 8, "exponential", 0.002) == pytest.approx(round_time(16, 8, 1.0, 500.0))
    assert steptime_round_time(16, 8, "gamma", 0.002, 0.5) == pytest.approx(round_time(16, 8, 0.5, 250.0))
    assert steptime_sps(16, 8, "gamma", 0.002, 0.5) == pytest.approx(128 / round_time(16, 8, 0.5, 250.0))
    assert steptime_sps(16, 8, "constant", 0.002) == pytest.approx(8000.0)
    assert math.isfinite(steptime_sps(16, 8, "exponential", 0.0, beta=0.0001))
    with pytest.raises(ValueError):
        steptime_round_time(16, 8, "uniform", 0.002)
