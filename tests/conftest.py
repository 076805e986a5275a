"""Suite-wide guards: a test leaves no SEED inference thread and no child process running behind it.

A leaked inference thread that kept looping slowed every later test of its pytest worker (CI once timed out
an unrelated IMPACT test at 300 s that takes 18 s alone); a trainer left running by a failed soak test failed
eleven later fault tests of its worker, which count this process's children. Failing the test that leaked names
the culprit; killing what it left keeps the failure its own."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.fault_env import children

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


@pytest.fixture(autouse=True)
def no_child_process_outlives_its_test():
    before = set(children())
    yield
    deadline = time.monotonic() + GRACE_S  # a run's workers exit as its close returns; give a loaded machine time
    while set(children()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: command for pid, command in children().items() if pid not in before}
    for pid in left:
        try:  # its whole group where it leads one (a trainer started in a session of its own), else itself
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass  # it exited, or its Popen reaped it, while we looked
    assert not left, f"child processes still running after the test, now killed: {left}"
