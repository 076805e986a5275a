"""Suite-wide guard: a test leaves no SEED inference thread running behind it.

A leaked inference thread that kept looping slowed every later test of its pytest worker (CI once timed out
an unrelated IMPACT test at 300 s that takes 18 s alone); failing the test that leaked it names the culprit."""

from __future__ import annotations

import threading
import time

import pytest

WATCHED_PREFIX = "seed-inference"
GRACE_S = 30.0  # Batcher.close joins for 10 s; a run's close on a loaded machine may take a while longer


@pytest.fixture(autouse=True)
def no_inference_thread_outlives_its_test():
    before = {thread.ident for thread in threading.enumerate()}
    yield

    def leaked() -> list[str]:
        return [thread.name for thread in threading.enumerate()
                if thread.ident not in before and thread.name.startswith(WATCHED_PREFIX) and thread.is_alive()]

    deadline = time.monotonic() + GRACE_S
    while leaked() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leaked(), f"threads still running after the test: {leaked()} (close the Batcher)"
