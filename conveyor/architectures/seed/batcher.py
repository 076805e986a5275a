"""SEED's batching module: requests from many actor streams, one call for all of them.

Stream threads ``submit`` a request of some env rows and wait on the
returned ``Pending``; one inference thread takes requests in arrival order
until ``max_rows`` rows are gathered, every actor it expects has a request
waiting (``expected_rows``), or ``timeout_s`` has passed since the first,
and calls ``process(requests) -> replies`` once for all of them; each
waiter gets its own reply. ``call_soon(fn)`` runs ``fn`` on the inference
thread in order with the requests (stream clean-up uses it, so a slot is
never released while one of its steps is still queued). ``close()`` ends the
inference thread after the batch in hand; requests still queued then, or
submitted later, finish with an error ("the learner is shutting down").

Stalls: a batch never waits longer than ``timeout_s``, whoever is missing.
When a batch closes on its deadline with fewer rows than expected,
``on_timeout()`` runs (on the inference thread, before that batch is
processed; counted as ``batch_timeouts``): SEED's server marks every stream
that has no request waiting as late and leaves it out of ``expected_rows``
until it sends again, so a stalled actor costs one timeout, not one per
batch (``server``).

SEED's ``process`` is ``inference.CentralInference.process``.
This module stays free of torch, like everything an actor imports.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

# ---- generic batching ------------------------------------------------------------------------


class Pending:
    """A submitted request: ``wait`` for it, then read ``result`` (or ``error``)."""

    __slots__ = ("request", "rows", "submitted", "result", "error", "_done")

    def __init__(self, request: Any, rows: int) -> None:
        self.request = request
        self.rows = rows
        self.submitted = time.perf_counter()
        self.result: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self._done.set()


class Batcher:
    """Gathers requests from many threads into one ``process`` call (see the module docstring)."""

    def __init__(self, process: Callable[[list[Any]], list[Any]], max_rows: int, timeout_s: float, *,
                 expected_rows: Callable[[], int] | None = None, on_timeout: Callable[[], None] | None = None,
                 stats: InferenceStats | None = None, name: str = "seed-inference") -> None:
        self.process = process
        self.max_rows = max_rows
        self.timeout_s = timeout_s
        self.expected_rows = expected_rows
        """Rows worth waiting for (all open streams' envs but the late ones); None: wait for the timeout."""
        self.on_timeout = on_timeout
        """Called when a batch closed on its deadline short of ``expected_rows`` (see the module docstring)."""
        self.stats = stats
        self.failure: BaseException | None = None
        self._items: collections.deque[Pending | Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, request: Any, rows: int) -> Pending:
        pending = Pending(request, rows)
        with self._cond:
            if self._closed:
                pending.finish(error=RuntimeError("the learner is shutting down"))
                return pending
            self._items.append(pending)
            self._cond.notify()
        return pending

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the inference thread after every request submitted before it."""
        with self._cond:
            self._items.append(fn)
            self._cond.notify()

    def _next(self) -> tuple[list[Pending], bool] | Callable[[], None] | None:
        """The next control call, or the next batch and whether it closed on its deadline; None once closed."""
        with self._cond:
            while not self._items:
                if self._closed:
                    return None
                self._cond.wait(0.1)
            if self._closed:
                return None  # requests still queued are refused below; an empty batch here would spin forever
            if not isinstance(self._items[0], Pending):
                return self._items.popleft()
            deadline = time.perf_counter() + self.timeout_s
            batch: list[Pending] = []
            rows = 0
            timed_out = False
            while not self._closed:
                while self._items and isinstance(self._items[0], Pending) and (
                        not batch or rows + self._items[0].rows <= self.max_rows):
                    item = self._items.popleft()
                    batch.append(item)  # type: ignore[arg-type]
                    rows += item.rows  # type: ignore[union-attr]
                if self._items or rows >= self.max_rows:
                    break  # full, or a control call or an oversized request waits behind this batch
                if self.expected_rows is not None and rows >= self.expected_rows():
                    break  # every expected actor is waiting: a longer wait only adds latency
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    timed_out = True
                    break
                self._cond.wait(remaining)
            return batch, timed_out

    def _loop(self) -> None:
        while True:
            item = self._next()
            if item is None:
                break
            if not isinstance(item, tuple):
                try:
                    item()
                except BaseException as error:  # noqa: BLE001 - surfaced through .failure
                    self.failure = self.failure or error
                continue
            batch, timed_out = item
            try:
                if timed_out:
                    if self.stats is not None:
                        self.stats.count("batch_timeouts")
                    if self.on_timeout is not None:
                        self.on_timeout()
                results = self.process([pending.request for pending in batch])
            except BaseException as error:  # noqa: BLE001 - every waiter hears of it; the run reads .failure
                self.failure = self.failure or error
                for pending in batch:
                    pending.finish(error=error)
                continue
            done = time.perf_counter()
            for pending, result in zip(batch, results):
                pending.finish(result)
            if self.stats is not None:
                self.stats.add_batch(sum(p.rows for p in batch), [done - p.submitted for p in batch])
        with self._cond:  # wake whoever still waits
            for pending in self._items:
                if isinstance(pending, Pending):
                    pending.finish(error=RuntimeError("the learner is shutting down"))
            self._items.clear()

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the inference thread failed: {self.failure!r}") from self.failure

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10.0)


# ---- statistics ------------------------------------------------------------------------------

LATENCY_WINDOW = 100_000


class InferenceStats:
    """Thread-safe counters of the inference path; ``summary()`` goes into summary.json under ``inference``.

    ``latency`` is what an actor waits for its actions (send to reply, network included: the SEED
    paper's table 13 end-to-end inference latency), reported by the actors; ``server_latency`` is
    the part spent queued and computing inside the learner. ``counters`` (``count``) hold, among
    others: ``unrolls``, ``partial_unrolls_dropped`` and ``dropped_steps`` (acted steps lost with
    them: streams that ended, discontinuities), ``discontinuities``, ``batch_timeouts``,
    ``streams_closed_idle``, ``episodes_resumed``, ``episodes_cut`` and ``episode_returns_recovered``
    (reconnects: ``inference.CentralInference``) and the ``refused_*`` reasons.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batch_rows: collections.Counter[int] = collections.Counter()
        self.latency: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self.server_latency: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self.counters: collections.Counter[str] = collections.Counter()
        self.actors_connected = 0
        self.actors_connected_max = 0
        self.envs_connected = 0
        self.env_time_s = 0.0

    def add_batch(self, rows: int, latencies: list[float]) -> None:
        with self._lock:
            self.batch_rows[rows] += 1
            self.server_latency.extend(latencies)

    def add_actor_latency(self, seconds: float) -> None:
        with self._lock:
            self.latency.append(seconds)

    def add_env_time(self, seconds: float) -> None:
        with self._lock:
            self.env_time_s += seconds

    def take_env_time(self) -> float:
        """Actor env-stepping seconds reported since the last call (for the run's time split)."""
        with self._lock:
            seconds, self.env_time_s = self.env_time_s, 0.0
        return seconds

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    def connected(self, actors: int, envs: int) -> None:
        with self._lock:
            self.actors_connected += actors
            self.envs_connected += envs
            self.actors_connected_max = max(self.actors_connected_max, self.actors_connected)

    @property
    def mean_batch(self) -> float:
        with self._lock:
            total = sum(self.batch_rows.values())
            return sum(k * v for k, v in self.batch_rows.items()) / total if total else 0.0

    def summary(self) -> dict[str, Any]:
        with self._lock:
            latency = np.array(self.latency, dtype=np.float64) * 1000.0
            server = np.array(self.server_latency, dtype=np.float64) * 1000.0
            hist = dict(sorted(self.batch_rows.items()))
            counters = dict(self.counters)
            connected, connected_max = self.actors_connected, self.actors_connected_max

        def quantiles(values: np.ndarray) -> dict[str, float]:
            if not len(values):
                return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
            return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
                    "mean": float(values.mean())}

        forwards = sum(hist.values())
        return {
            "inference_batch": {"mean": sum(k * v for k, v in hist.items()) / forwards if forwards else 0.0,
                                "forwards": forwards, "histogram": {str(k): v for k, v in hist.items()}},
            "inference_latency_ms": quantiles(latency),
            "server_latency_ms": quantiles(server),
            "actors_connected": connected,
            "actors_connected_max": connected_max,
            **counters,
        }


@dataclass
class EnvSteps:
    """One actor step after validation: the request ``CentralInference`` batches (see ``Step`` in
    seed.proto)."""

    env_ids: np.ndarray  # int64 [k]
    run_ids: np.ndarray  # int64 [k]
    obs: np.ndarray  # [k, *obs_shape]
    reward: np.ndarray  # float32 [k]
    terminated: np.ndarray  # bool [k]
    truncated: np.ndarray  # bool [k]
    final_obs: np.ndarray  # [m, *obs_shape], rows truncated & ~terminated in order
    episode_return: np.ndarray  # float [k], NaN where no episode ended
    actor: str = ""  # the stream's actor name (its Hello's); '' for an unnamed stream
    stream_start: bool = False  # the first Step of its stream (may continue the actor's earlier stream)
