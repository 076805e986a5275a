"""Run telemetry: episode returns, policy lag, time split, throughput.

One ``Telemetry`` per run writes ``metrics.csv`` (a row per log interval, one
header: ``MetricsCsv``), TensorBoard events, a console progress line, and
``summary.json``; each row also goes to the sinks added with ``add_sink``
(W&B: ``conveyor/tracking.py``), and at the end the config goes to TensorBoard
as hparams (``write_hparams``). The key
names of ``summary.json`` are an interface read by ``conveyor bench`` and
``conveyor eval``: ``env_steps``, ``wall_time_s``, ``sps``, ``episodes``,
``return_mean_last100``, ``policy_lag`` {``mean``, ``max``, ``histogram``},
``param_sha256``, ``time_split`` and ``restarts``.

Thread-safe: async architectures report from several threads.
"""

from __future__ import annotations

import collections
import csv
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conveyor.files import atomic_write, open_append
from conveyor.returns_file import read_returns

# The time-split buckets every architecture reports (PAAC paper fig. 2).
TIME_BUCKETS = ("env", "act", "learn", "wait")


def mean_return(returns: collections.deque[float]) -> float:
    """The mean of ``returns`` (NaN when empty), correctly rounded: ``math.fsum`` over the deque, where
    ``np.mean`` would first copy it into an array (7 us against 0.7, and runs ask at every update)."""
    return math.fsum(returns) / len(returns) if returns else float("nan")


class _Timer:
    """``Telemetry.timer``'s context manager: a class rather than a generator, as it runs several times per env
    step. The bucket is a torch.profiler range too while a profile runs (benchmarks/profile_pong_step.py), and
    only then: a range costs ~10 us, a tenth of a CartPole step of 16 envs."""

    __slots__ = ("telemetry", "bucket", "start", "range")

    def __init__(self, telemetry: Telemetry, bucket: str) -> None:
        self.telemetry, self.bucket = telemetry, bucket
        self.range: Any = None

    def __enter__(self) -> None:
        if torch.autograd._profiler_enabled():
            self.range = torch.profiler.record_function(self.bucket)
            self.range.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc_info: Any) -> None:
        self.telemetry.add_time(self.bucket, time.perf_counter() - self.start)
        if self.range is not None:
            self.range.__exit__(*exc_info)


class Telemetry:
    def __init__(self, out_dir: Path, *, log_interval_s: float = 2.0, progress: bool = True,
                 total_steps: int = 0, tensorboard: bool = True, start_steps: int = 0, start_episodes: int = 0,
                 files: bool = True):
        """``files=False`` keeps every count and writes nothing (no file, no console line): the ranks other
        than 0 of a run under torchrun."""
        self.out_dir = Path(out_dir)
        self.files = files
        self.log_interval_s = log_interval_s
        self.progress = progress and files and sys.stderr.isatty()
        self.total_steps = total_steps
        self.start_time = time.perf_counter()
        self._lock = threading.Lock()
        self.env_steps = start_steps
        self._start_steps = start_steps
        self.episodes = start_episodes
        self.updates = 0
        self.restarts = 0
        self.dropped_steps = 0
        self.env_errors = 0
        self.returns: collections.deque[float] = collections.deque(maxlen=100)
        self._returns_mean: float | None = None  # of ``returns``; None: not taken since they changed
        self.return_curve: list[tuple[int, float, float]] = []  # (env_steps, wall_s, return) per episode
        self.lag_histogram: collections.Counter[int] = collections.Counter()
        self.time_split = {bucket: 0.0 for bucket in TIME_BUCKETS}
        self.counters: collections.Counter[str] = collections.Counter()
        self.gauges: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}
        self._last_log_time = self.start_time
        self._last_log_steps = start_steps
        self._output_lock = threading.Lock()  # one writer of metrics.csv, TensorBoard and sinks at a time
        self._sinks: list[Any] = []
        self._once: dict[str, float] = {}  # values for the next row only (add_eval)
        self._media: dict[str, Path] = {}  # files that go to the sinks with the next row
        self._csv = MetricsCsv(self.out_dir / "metrics.csv") if files else None
        self._tb = None
        if tensorboard and files:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tb"))

    def resume_from(self, state: dict[str, Any]) -> None:
        """Continue the counters a checkpoint saved (``saved_counters()``; its last-100 returns stop a run at its
        target); SPS counts only the steps taken from here."""
        env_steps = int(state.get("env_steps", 0))
        earlier = self._curve_before(env_steps)  # read before taking the lock: file I/O
        with self._lock:
            self.env_steps = self._start_steps = self._last_log_steps = env_steps
            self.episodes = int(state.get("episodes", 0))
            self.restarts = int(state.get("restarts", 0))
            self.dropped_steps = int(state.get("dropped_steps", 0))
            self.returns.extend(state.get("recent_returns", []))
            self._returns_mean = None
            self.return_curve[:0] = earlier

    def _curve_before(self, env_steps: int) -> list[tuple[int, float, float]]:
        """The episodes the run's ``returns.csv`` holds up to ``env_steps`` (the checkpoint's): ``write_summary``
        rewrites the file, so a resumed run carries its earlier segments' episodes over (their wall times are
        those of their own segment). Later rows are episodes the resumed run steps again."""
        if not self.files:
            return []
        try:
            curve = read_returns(self.out_dir / "returns.csv")
        except ValueError:  # a file cut short (a crash while it was written) costs its curve, not the resume
            return []
        return [(int(steps), float(wall), float(ret)) for steps, wall, ret in curve if steps <= env_steps]

    def saved_counters(self) -> dict[str, Any]:
        """What a checkpoint keeps of the telemetry (``resume_from`` reads it back)."""
        with self._lock:
            return {"env_steps": self.env_steps, "episodes": self.episodes, "wall_time_s": self.wall_time_s,
                    "restarts": self.restarts, "dropped_steps": self.dropped_steps,
                    "recent_returns": list(self.returns)}

    # ---- recording -----------------------------------------------------------------------
    def add_restart(self, dropped_steps: int = 0, restarts: int = 1) -> None:
        """``restarts`` dead worker processes were restarted; ``dropped_steps`` transitions they had
        half-written were discarded (never counted in ``env_steps``, never trained on)."""
        with self._lock:
            self.restarts += restarts
            self.dropped_steps += dropped_steps

    def timer(self, bucket: str) -> _Timer:
        """``with telemetry.timer(bucket):`` adds the block's wall time to ``time_split[bucket]``."""
        return _Timer(self, bucket)

    def add_time(self, bucket: str, seconds: float) -> None:
        """Add time measured elsewhere (e.g. by agent processes) to a time-split bucket."""
        with self._lock:
            self.time_split[bucket] += seconds

    def add_steps(self, steps: int) -> None:
        with self._lock:
            self.env_steps += steps

    def add_episodes(self, episode_returns: np.ndarray) -> None:
        """Record finished episodes; ``episode_returns`` may hold NaN for envs that did not finish."""
        finished = episode_returns[~np.isnan(episode_returns)]
        if not len(finished):
            return
        now = time.perf_counter() - self.start_time
        with self._lock:
            for value in finished.tolist():
                self.returns.append(value)
                self.return_curve.append((self.env_steps, now, value))
            self.episodes += len(finished)
            self._returns_mean = None

    def add_lag(self, learner_version: int, policy_versions: np.ndarray | torch.Tensor) -> None:
        """Record lag = learner version minus the version that chose each action (an array or a tensor on
        any device)."""
        if isinstance(policy_versions, torch.Tensor):
            policy_versions = policy_versions.cpu().numpy()
        lags = learner_version - np.asarray(policy_versions).reshape(-1)
        if len(lags) and lags.min() == lags.max():  # one version acted (a synchronous rollout): no sort
            values, counts = lags[:1], np.array([len(lags)])
        else:
            values, counts = np.unique(lags, return_counts=True)
        with self._lock:
            for lag, count in zip(values.tolist(), counts.tolist()):
                self.lag_histogram[int(lag)] += int(count)

    def add_update(self, metrics: dict[str, float]) -> None:
        with self._lock:
            self.updates += 1
            self.last_metrics = metrics

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    def gauge(self, name: str, value: float) -> None:
        with self._lock:
            self.gauges[name] = float(value)

    def add_eval(self, values: dict[str, float], media: dict[str, Path] | None = None) -> None:
        """Write a row now holding ``values`` (an evaluation's ``eval/return``, ...), which later rows do not
        repeat; ``media`` (name -> video file) goes to the sinks with it."""
        with self._lock:
            self._once.update(values)
            self._media.update(media or {})
        self.maybe_log(force=True)

    def add_sink(self, sink: Any) -> None:
        """Send every row to ``sink.log(row, media)`` too, after metrics.csv and TensorBoard."""
        self._sinks.append(sink)

    # ---- derived -------------------------------------------------------------------------
    @property
    def wall_time_s(self) -> float:
        return time.perf_counter() - self.start_time

    @property
    def return_mean_last100(self) -> float:
        """Taken again only after new episodes: runs ask at every update (``Run.should_stop``)."""
        with self._lock:
            if self._returns_mean is None:
                self._returns_mean = mean_return(self.returns)
            return self._returns_mean

    def lag_summary(self) -> dict[str, Any]:
        with self._lock:
            hist = dict(sorted(self.lag_histogram.items()))
        total = sum(hist.values())
        mean = sum(k * v for k, v in hist.items()) / total if total else 0.0
        return {"mean": mean, "max": max(hist) if hist else 0, "histogram": {str(k): v for k, v in hist.items()}}

    # ---- output --------------------------------------------------------------------------
    def maybe_log(self, force: bool = False) -> None:
        if not force and time.perf_counter() - self._last_log_time < self.log_interval_s:
            return
        with self._output_lock:  # made and written in one order (threads log too): env_steps never goes back
            now = time.perf_counter()
            with self._lock:
                interval_sps = (self.env_steps - self._last_log_steps) / max(now - self._last_log_time, 1e-9)
                self._last_log_time, self._last_log_steps = now, self.env_steps
                row: dict[str, float] = {
                    "env_steps": self.env_steps,
                    "wall_time_s": now - self.start_time,
                    "sps": interval_sps,
                    "episodes": self.episodes,
                    "updates": self.updates,
                    "return_mean_last100": mean_return(self.returns),
                    **{f"time_{k}": v for k, v in self.time_split.items()},
                    **{f"loss/{k}": v for k, v in self.last_metrics.items()},
                    **self.gauges,
                    **{f"count/{k}": v for k, v in self.counters.items()},
                    **self._once,
                }
                media, self._once, self._media = self._media, {}, {}
            lag = self.lag_summary()
            row["lag_mean"], row["lag_max"] = lag["mean"], lag["max"]
            if self._csv is not None:
                self._csv.write(row)
            if self._tb is not None:
                for key, value in row.items():
                    if key != "env_steps" and isinstance(value, (int, float)) and math.isfinite(value):
                        self._tb.add_scalar(key, value, int(row["env_steps"]))
            for sink in self._sinks:
                sink.log(row, media)
        if self.progress:
            self._print_progress(row)

    def _print_progress(self, row: dict[str, float]) -> None:
        done = row["env_steps"] / self.total_steps if self.total_steps else 0.0
        width = 24
        bar = "#" * int(width * min(done, 1.0))
        ret = row["return_mean_last100"]
        sys.stderr.write(
            f"\r[{bar:<{width}}] {int(row['env_steps']):>10,d} steps  {row['sps']:>8.0f} SPS  "
            f"return {ret:>8.2f}  lag {row['lag_mean']:.2f}/{int(row['lag_max'])}  {row['wall_time_s']:>6.1f}s "
        )
        sys.stderr.flush()

    def summary(self, **extra: Any) -> dict[str, Any]:
        wall = self.wall_time_s
        total_time = sum(self.time_split.values()) or 1.0
        summary = {
            "env_steps": self.env_steps,
            "wall_time_s": wall,
            "sps": (self.env_steps - self._start_steps) / max(wall, 1e-9),
            "episodes": self.episodes,
            "updates": self.updates,
            "return_mean_last100": self.return_mean_last100,
            "policy_lag": self.lag_summary(),
            "time_split": {k: v for k, v in self.time_split.items()},
            "time_split_fraction": {k: v / total_time for k, v in self.time_split.items()},
            "restarts": self.restarts,
            "dropped_steps": self.dropped_steps,
            "env_errors": self.env_errors,
            "counters": dict(self.counters),
            "gauges": dict(self.gauges),
            "last_metrics": dict(self.last_metrics),
        }
        summary.update(extra)
        return summary

    def write_summary(self, summary: dict[str, Any]) -> None:
        if not self.files:
            return
        write_json_atomic(self.out_dir / "summary.json", summary)
        curve = np.array(self.return_curve, dtype=np.float64).reshape(-1, 3)
        with atomic_write(self.out_dir / "returns.csv", text=True) as f:
            np.savetxt(f, curve, delimiter=",", header="env_steps,wall_time_s,return", comments="",
                       fmt=["%d", "%.3f", "%.3f"])

    def write_hparams(self, hparams: dict[str, Any], metric: str = "return_mean_last100") -> None:
        """The run's config values as TensorBoard hparams (the HPARAMS tab), with the scalar ``metric`` as their
        metric: the hparams plugin shows its last value, the one the final row wrote."""
        if self._tb is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        with self._output_lock:
            writer = self._tb.file_writer
            for summary in hparams_summaries(hparams, {metric: self.return_mean_last100}):
                writer.add_summary(summary, self.env_steps)
            self._tb.flush()

    def close(self) -> None:
        if self.progress:
            sys.stderr.write("\n")
        if self._tb is not None:
            self._tb.close()


class MetricsCsv:
    """``metrics.csv``: one header line, then a row per log interval with a cell for every column.

    The columns are the keys in the order first seen. A key that first appears after rows were written (a loss
    metric after a warm-up, a new counter) widens the table: the file is rewritten once (temp file, rename) with
    the wider header and those earlier rows empty in the new columns, so a reader (``pandas.read_csv``,
    ``csv.DictReader``) sees one schema at any moment. A resumed run appends to the file it finds.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.columns: list[str] = []
        if self.path.is_file() and not self.path.is_symlink():  # a planted link is replaced at the first write
            self.columns, rows = read_metrics(self.path)
            with open(self.path, newline="") as f:
                if next(csv.reader(f), []) != self.columns:  # written with several header blocks: make it one
                    self._rewrite(rows)

    def write(self, row: dict[str, float]) -> None:
        if self.path.is_symlink():  # planted since the last row: replaced (rows written so far went with the file)
            self.columns = []
        new = [key for key in row if key not in self.columns]
        if new:
            rows = read_metrics(self.path)[1] if self.columns else []
            self.columns += new
            self._rewrite(rows)
        with open_append(self.path, text=True) as f:
            csv.DictWriter(f, self.columns).writerow(row)

    def _rewrite(self, rows: list[dict[str, str]]) -> None:
        with atomic_write(self.path, text=True) as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            writer.writerows(rows)


def read_metrics(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The columns and rows of a ``metrics.csv``; cells a row lacks are empty strings. Files written before the
    schema was fixed (a new header block wherever a key appeared) are read block by block."""
    columns: list[str] = []
    rows: list[dict[str, str]] = []
    header: list[str] = []
    with open(path, newline="") as f:
        for cells in csv.reader(f):
            if cells and cells[0] == "env_steps":
                header = cells
                columns += [key for key in header if key not in columns]
            elif cells:
                rows.append(dict(zip(header, cells)))
    return columns, [{key: row.get(key, "") for key in columns} for row in rows]


def write_json_atomic(path: Path, data: Any) -> None:
    with atomic_write(path, text=True) as f:
        json.dump(data, f, indent=2, sort_keys=True, default=_json_default)


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    return str(value)
