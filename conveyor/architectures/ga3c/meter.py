"""GA3C's throughput meter: the numbers the paper tunes and reports (TPS, PPS, frames/s), queue lengths, agent waits.

Read by the main loop of ``run.py`` (``sample`` about 10 times a second) and by the autotuner
(``tps_since_decision``); its ``summary`` is the run summary's ``ga3c`` block.
"""

from __future__ import annotations

import time
from typing import Any

from conveyor.architectures.ga3c.queues import Channels
from conveyor.config import RunCfg
from conveyor.errors import WorkerFailure
from conveyor.run import Run


class Meter:
    """GA3C's throughput numbers: TPS, PPS, frames/s, prediction batch size, queue lengths, agent waits.

    ``sample()`` (main thread, ~10 Hz) reads the queue lengths and the agents'
    shared counters, moves the agents' env and wait time into the time split,
    and refreshes the gauges that metrics.csv records each log interval.
    """

    def __init__(self, run: Run, channels: Channels, cfg: RunCfg):
        self.run, self.channels, self.cfg = run, channels, cfg
        self.frame_skip = cfg.env.frame_skip if cfg.env.is_atari else 1
        self.queue_sums = {"prediction_queue": 0.0, "training_queue": 0.0}
        self.samples = 0
        self.agent_time = {"env": 0.0, "wait": 0.0}
        self.last = self._totals()
        self.decision = self.last

    def _totals(self) -> dict[str, float]:
        tel = self.run.telemetry
        return {"time": time.perf_counter(), "updates": tel.updates, "predictions": tel.counters["predictions"],
                "batches": tel.counters["predict_batches"], "steps": int(self.channels["steps"].sum())}

    def sample(self) -> None:
        tel, channels = self.run.telemetry, self.channels
        lengths = {"prediction_queue": len(channels.requests), "training_queue": channels.queued_segments()}
        for name, length in lengths.items():
            self.queue_sums[name] += length
            tel.gauge(name, length)
        self.samples += 1
        for bucket, name in (("env", "env_time_s"), ("wait", "wait_time_s")):
            total = float(channels[name].sum())
            tel.add_time(bucket, total - self.agent_time[bucket])
            self.agent_time[bucket] = total
        tel.env_errors = int(channels["env_errors"].sum())
        if tel.env_errors > self.cfg.env.max_env_errors:
            raise WorkerFailure(f"{tel.env_errors} env errors in GA3C agents exceed max_env_errors="
                               f"{self.cfg.env.max_env_errors}; see the tracebacks above")
        now = self._totals()
        elapsed = now["time"] - self.last["time"]
        if elapsed >= 1.0:
            rates = self._rates(self.last, now)
            for name in ("tps", "pps", "fps", "predict_batch"):
                tel.gauge(name, rates[name])
            self.last = now

    def _rates(self, old: dict[str, float], new: dict[str, float]) -> dict[str, float]:
        elapsed = max(new["time"] - old["time"], 1e-9)
        batches = new["batches"] - old["batches"]
        return {"tps": (new["updates"] - old["updates"]) / elapsed,
                "pps": (new["predictions"] - old["predictions"]) / elapsed,
                "fps": (new["steps"] - old["steps"]) * self.frame_skip / elapsed,
                "predict_batch": (new["predictions"] - old["predictions"]) / batches if batches else 0.0}

    def seconds_since_decision(self) -> float:
        return time.perf_counter() - self.decision["time"]

    def tps_since_decision(self) -> float:
        now = self._totals()
        tps = self._rates(self.decision, now)["tps"]
        self.decision = now
        return tps

    def summary(self) -> dict[str, Any]:
        steps = float(self.channels["steps"].sum())
        start = {"time": self.run.telemetry.start_time, "updates": 0, "predictions": 0, "batches": 0, "steps": 0}
        rates = self._rates(start, self._totals())
        rates["predict_batch_mean"] = rates.pop("predict_batch")
        return {**rates,
                **{f"{name}_mean": total / max(self.samples, 1) for name, total in self.queue_sums.items()},
                "agent_wait_ms_mean": 1000 * self.agent_time["wait"] / steps if steps else 0.0,
                "segments_per_update": self.cfg.arch.min_train_batch}
