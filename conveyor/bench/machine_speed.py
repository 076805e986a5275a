"""The machine's speed at a moment: a fixed CPU workload timed just before each race run.

The race compares wall-clock times that were measured minutes, hours or days apart on a shared machine, whose
speed moves with its neighbours' load (on the project's 2-core VM, paac/a2c and SB3 A2C both raced MinAtar
SpaceInvaders about 2x faster one afternoon than with the same code and seeds the night before). Each race row therefore records
``machine_speed``: iterations per second of the same small training step, on one torch thread, timed in the
bench's parent process right before the run's child is spawned (outside the run's clock). The race's table
shows it per contender and says when the rows of one env ran at speeds too far apart to be compared side by
side (``race.SPEED_SPREAD``).

The workload is what bounds the cheap envs' contenders: Python dispatch and small-tensor kernels. One step is
the forward of a 4-64-64-2 MLP on a batch of 80, a squared loss, backward and an Adam step.
"""

from __future__ import annotations

import statistics
import time

BATCH, WIDTH = 80, 64
WARMUP_STEPS = 20
REPEATS = 5


def machine_speed(seconds: float = 1.0) -> float:
    """Training steps per second of the workload on one torch thread: the median of ``REPEATS`` timings of
    ``seconds / REPEATS`` each, after ``WARMUP_STEPS`` untimed steps. The caller's torch thread count is
    restored."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                                    torch.nn.Tanh(), torch.nn.Linear(WIDTH, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        inputs = torch.randn(BATCH, 4, generator=generator)

        def step() -> None:
            loss = model(inputs).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        for _ in range(WARMUP_STEPS):
            step()
        rates = []
        for _ in range(REPEATS):
            steps, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds / REPEATS:
                step()
                steps += 1
            rates.append(steps / elapsed)
        return float(statistics.median(rates))
    finally:
        torch.set_num_threads(threads)
