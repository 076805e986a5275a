"""Thread helpers for architectures whose learner process runs several kinds of threads (GA3C)."""

from __future__ import annotations

import threading
from typing import Callable

from conveyor.run import Run

_JOIN_TIMEOUT_S = 30.0


def locked(lock: threading.Lock, stop: threading.Event) -> bool:
    """Acquire ``lock``, giving up (False) once ``stop`` is set."""
    while not lock.acquire(timeout=0.1):
        if stop.is_set():
            return False
    return True


class ThreadGroup:
    """Threads running ``target(stop_event, serial)``, resized at run time; an error stops the run."""

    def __init__(self, name: str, target: Callable[[threading.Event, int], None], run: Run):
        self.name, self.target, self.run = name, target, run
        self.threads: list[tuple[threading.Thread, threading.Event]] = []
        self.retiring: list[threading.Thread] = []
        self.started = 0
        self.error: BaseException | None = None

    def __len__(self) -> int:
        return len(self.threads)

    def resize(self, count: int) -> None:
        """Start threads, or ask the newest to stop after their current batch (without waiting)."""
        while len(self.threads) < count:
            stop = threading.Event()
            thread = threading.Thread(target=self._main, args=(stop, self.started), daemon=True,
                                      name=f"{self.name}-{self.started}")
            thread.start()
            self.threads.append((thread, stop))
            self.started += 1
        while len(self.threads) > count:
            thread, stop = self.threads.pop()
            stop.set()
            self.retiring.append(thread)
        self.retiring = [t for t in self.retiring if t.is_alive()]

    def _main(self, stop: threading.Event, serial: int) -> None:
        try:
            self.target(stop, serial)
        except BaseException as error:
            self.error = self.error or error
            self.run.request_stop(f"{self.name} failed: {error!r}")

    def close(self) -> None:
        self.resize(0)
        for thread in self.retiring:
            thread.join(_JOIN_TIMEOUT_S)
