"""What every architecture's run shares: output directory, seeding, the learner
with resume, stop conditions, signals, periodic checkpoints, the summary, and
tracking (W&B, videos during training, TensorBoard hparams: ``tracking.py``).

An architecture wires its own parts inside ``with Run(cfg) as run:`` and
returns ``run.finish(learner)``.

Under torchrun (``WORLD_SIZE`` set) the run is one rank of a data-parallel run
(``conveyor/distributed.py``, imported only then): it steps its share of the envs
(``env_cfg``, ``env_offset``), exchanges progress once per update
(``share_progress``), and only rank 0 writes the run directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import random
import signal
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from conveyor import algos, presets
from conveyor.config import ENV_BACKEND_CHOICE, RunCfg, check_resume, recorded_config
from conveyor.envs.inproc import BackendChoice, choose_backend
from conveyor.envs.native_vector import check_env_state, loads_natively
from conveyor.errors import ConfigError, StoppedWhileStarting, WorkerFailure
from conveyor.files import lock_run_dir, open_append, write_text_atomic
from conveyor.learner import Learner, LossFn, checkpoint_name, load_latest_checkpoint
from conveyor.procs import SignalRelay
from conveyor.telemetry import Telemetry
from conveyor.tracking import VideoCapture, WandbTracker, flat_config, import_wandb


ERRORS_LOG = "errors.log"
"""In a run's directory: the tracebacks behind the run's one-line worker errors (``Run._log_error``)."""


def prepare_out_dir(cfg: RunCfg) -> tuple[Path, int]:
    """Create (or reuse, on resume) the output directory, take its lock (``lock_run_dir``: before anything is
    written there, so that a second run on it writes nothing) and check it is writable (``conveyor train --resume
    DIR`` sets ``out`` to DIR: a resumed run writes only there). Returns the directory and the lock's descriptor."""
    if cfg.resume and not cfg.out:
        out = Path(cfg.resume)
    elif cfg.out:
        out = Path(cfg.out)
    else:
        env_name = cfg.env.id.replace("/", "_").replace(":", "_")  # MODULE:ID
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = Path("runs") / f"{cfg.arch.name}-{cfg.algo.name}-{env_name}-s{cfg.seed}-{stamp}"
    lock = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = lock_run_dir(out)
        (out / "checkpoints").mkdir(exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()  # created exclusively (never through a planted link), then gone
    except OSError as error:
        if lock is not None:
            os.close(lock)
        raise ConfigError(f"output dir {out} is not writable ({error.strerror}): pass --out a writable directory") from None
    return out, lock


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a run with its final checkpoint and summary: Ctrl-C, ``kill``, and a closed terminal or dropped SSH
connection (SIGHUP). Child processes ignore SIGINT and SIGHUP (``procs.child_prologue``): the run stops them."""


def leave_hung_up_terminal() -> None:
    """Point stdout and stderr at /dev/null where they are a terminal that has hung up: every write there fails
    (EIO), and the run still has its checkpoint and summary to write, and its children to stop."""
    for fd in (1, 2):
        try:
            termios.tcgetattr(fd)
        except termios.error as error:
            if error.args[0] == errno.EIO:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_target_return(cfg: RunCfg) -> float | None:
    """``cfg.target_return``, else the env's registered reward_threshold (None when it has none)."""
    if cfg.target_return is not None:
        return cfg.target_return
    from conveyor.envs.gym_api import registered_spec

    spec = registered_spec(cfg.env.id)  # MODULE:ID too
    return spec.reward_threshold if spec is not None else None


def resolve_env_backend(cfg: RunCfg, env_state: Any = None) -> tuple[RunCfg, BackendChoice | None]:
    """``cfg`` with ``--env-backend auto`` made ``vector``, ``inproc`` or ``shm`` (``choose_backend``: the env's
    native vector env, else from the env's step time, measured here once for the whole run), and the choice; a
    backend given explicitly stays, with None. ``env_state``: a resumed run's, whose kind ``vector`` alone loads
    (an action history: ``inproc`` or ``shm``)."""
    if cfg.env.backend != "auto":
        return cfg, None
    if cfg.arch.name == "paac" and cfg.arch.env_groups > 1:
        choice = BackendChoice("shm", math.nan, f"--env-groups {cfg.arch.env_groups} steps groups of worker processes")
    else:
        choice = choose_backend(cfg.env, cfg.seed, native=loads_natively(env_state))
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, backend=choice.backend)), choice


def checkpoint_steps(path: Path) -> int:
    """The env steps in a checkpoint's name, ``ckpt-<env steps>.pt``."""
    return int(path.stem.rpartition("-")[2])


class Run:
    """Context for one training run; see the module docstring."""

    def __init__(self, cfg: RunCfg):
        self.dist: Any = None  # under torchrun, this rank's distributed.DataParallel
        if "WORLD_SIZE" in os.environ:
            from conveyor.distributed import DataParallel

            self.dist = DataParallel(cfg)
            cfg = self.dist.restarted(cfg)
        self.writes = self.dist is None or self.dist.rank == 0
        # A resume reads and checks all it can before anything is written: its checkpoint (a bad one fails fast,
        # before any worker starts), the world size, and what it changes of the run (config.RESUME_MAY_CHANGE).
        self.resume_path: Path | None = None
        self.resume_state: dict[str, Any] = {}
        self._recorded_cfg: RunCfg | None = None
        if cfg.resume:
            self.resume_path, self.resume_state = load_latest_checkpoint(cfg.resume)
            self._check_world_size()
            self._recorded_cfg = recorded_config(cfg.resume)
            check_resume(self._recorded_cfg, cfg)
        cfg, self.env_backend = resolve_env_backend(cfg, self.resume_state.get("env_state"))
        if cfg.arch.name == "paac":  # make_vector_env rebuilds its envs from the checkpoint: check before writing
            check_env_state(cfg.env.backend, self.resume_state.get("env_state"))
        self.cfg = cfg
        """Whether this process writes the run directory (under torchrun, rank 0 alone)."""
        self.env_cfg = cfg.env if self.dist is None else self.dist.env_cfg(cfg.env)
        """The envs this process steps: all of them, or under torchrun its rank's share."""
        self.env_offset = 0 if self.dist is None else self.dist.env_offset
        """Global index of this process's first env (seeds: docs/design.md "Seeds")."""
        if cfg.wandb and self.writes:
            import_wandb()  # a missing package fails before anything is written
        self._dir_lock: int | None = None  # the run directory's lock, held by the process that writes it
        if self.writes:
            self.out, self._dir_lock = prepare_out_dir(cfg)
        else:
            self.out = Path(cfg.out)
        try:
            self._set_up(cfg)
        except BaseException:
            self._release_out_dir()
            raise

    def _set_up(self, cfg: RunCfg) -> None:
        """The rest of ``__init__``, once this process holds the run directory (a failure releases it)."""
        seed_everything(cfg.seed)
        torch.set_num_threads(cfg.learner_threads)
        # A resumed run rewrites its config.json once it has started (its first update or checkpoint): a resume
        # that fails before that leaves the file as it was, so the run stays resumable as it was.
        self._config_due = self.writes
        if not cfg.resume:
            self._write_config()
        # The checkpoints of this run that rotation may delete: never files it did not write (checkpoints/ may
        # link to a directory that holds other runs' checkpoints). Inherited when the run goes on in place.
        same_dir = bool(cfg.resume) and os.path.samefile(cfg.resume, self.out)
        self._own_checkpoints: list[str] = list(self.resume_state.get("run_checkpoints", [])) if same_dir else []
        self.telemetry = Telemetry(self.out, log_interval_s=cfg.log_interval_s, progress=cfg.progress,
                                   total_steps=cfg.total_steps, files=self.writes)
        self._pending_returns: list[np.ndarray] = []  # under torchrun: episodes not yet shared (share_progress)
        self._shared = np.zeros(3)  # env steps, dropped steps, restarts as of the last share_progress
        self._signal = 0  # the first signal this process got (under torchrun: shared at the next share_progress)
        self._peers_out_of_time = False  # under torchrun: a rank reached --time-limit-s at the last share_progress
        self.stop_event = threading.Event()
        self.stop_reason = ""
        # should_stop's checks and the records of threads that act on their own (record_served_*): one at a time
        self._stop_decision = threading.Lock()
        self.interrupted = threading.Event()  # a signal came: stop a video in flight rather than wait for it
        self._closers: list[Any] = []
        self._signal_relay: SignalRelay | None = None
        self._next_checkpoint = cfg.checkpoint_every or 0
        self._learner: Learner | None = None
        self._resume_state_fn: Any = None
        self._final_checkpoint: Path | None = None
        self.target_return = resolve_target_return(cfg)
        self.videos = VideoCapture(self.out, cfg.capture_video_every, self.telemetry) \
            if cfg.capture_video_every and self.writes else None
        self.wandb: WandbTracker | None = None
        if cfg.wandb and self.writes:
            try:
                self.wandb = WandbTracker.open(cfg, self.out, self._recorded())
            except BaseException:
                self.telemetry.close()
                raise
            self.telemetry.add_sink(self.wandb)

    # ---- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> "Run":
        if threading.current_thread() is threading.main_thread():
            self._signal_relay = SignalRelay(STOP_SIGNALS, self._on_signal)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, WorkerFailure) and exc.details and self.writes:
            self._log_error(exc)
        if isinstance(exc, StoppedWhileStarting) and self._signal:  # the CLI's exit code tells a hang-up apart
            exc.stop_reason = f"signal {signal.Signals(self._signal).name}"
        if isinstance(exc, WorkerFailure) and self._learner is not None and self.dist is None:
            # A dead worker loses at most its own unfinished data, never the learner's progress. (Under torchrun
            # a checkpoint needs every rank, and the others are elsewhere: the group resumes from the last one.)
            self.checkpoint(self._learner)
        for closer in reversed(self._closers):
            with contextlib.suppress(Exception):
                closer()
        if self.videos is not None:
            # After the closers, so that no env steps on while it plays (SEED's actors would). A finished run
            # records the final checkpoint's video when one is due; a signal or a failure stops the recording
            # in flight.
            if exc is None and self._final_checkpoint is not None:
                self.videos.record_final(self._final_checkpoint, checkpoint_steps(self._final_checkpoint),
                                         stop=self.interrupted.is_set)
            self.videos.stop()
        if self._signal_relay is not None:
            self._signal_relay.close()
        self.telemetry.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=0 if exc is None else 1)
        if self.dist is not None:
            self.dist.close()
        self._release_out_dir()

    def _release_out_dir(self) -> None:
        if self._dir_lock is not None:
            os.close(self._dir_lock)
            self._dir_lock = None

    def _log_error(self, failure: WorkerFailure) -> None:
        """Append ``failure``'s line and the traceback behind it to the run's ``errors.log``, and name that file in
        its line (the CLI prints the line alone)."""
        log = self.out / ERRORS_LOG
        try:
            with open_append(log, text=True) as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {failure}\n{failure.details.rstrip()}\n\n")
        except OSError as error:
            print(f"conveyor: warning: cannot append to {log} ({error.strerror})", file=sys.stderr)
            return
        failure.args = (f"{failure} (traceback in {log})",)

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            leave_hung_up_terminal()
        self.interrupted.set()
        self._signal = self._signal or signum
        if self.dist is None:  # else every rank stops at the same update: at the next share_progress
            self.request_stop(f"signal {signal.Signals(signum).name}")

    def asked_to_stop(self) -> bool:
        """A stop request, or a signal that under torchrun waits for the ranks' next shared update to stop the
        run: what ends envs that are still starting at once (no step ran, nothing to keep in step across ranks),
        and a step that hangs after the grace period."""
        return self.stop_event.is_set() or self.interrupted.is_set()

    def request_stop(self, reason: str) -> None:
        if not self.stop_event.is_set():
            self.stop_reason = reason
            self.stop_event.set()

    def closing(self, resource: Any) -> Any:
        """Close ``resource`` (anything with ``close()``) when the run ends, in reverse order."""
        self._closers.append(resource.close)
        return resource

    def timer(self, bucket: str) -> Any:
        return self.telemetry.timer(bucket)

    # ---- learner -------------------------------------------------------------------------
    def learner(self, model: nn.Module, loss_fn: LossFn, learner_cls: type[Learner] = Learner) -> Learner:
        """The run's learner (a ``learner_cls``, e.g. ``R2D2Learner``) minimising ``loss_fn`` (the architecture
        passes ``algos.make_loss(cfg)``, so the loss is visible where it is wired); restored from the latest
        checkpoint when ``cfg.resume`` is set."""
        if self.cfg.algo.name in algos.DISCRETE_ONLY and not model.policy.discrete:
            raise ConfigError(f"--algo {self.cfg.algo.name} needs a discrete action space, and {self.cfg.env.id} "
                              "has continuous actions: use --algo a2c, ppo, vtrace or impact")
        learner = learner_cls(model, loss_fn, self.cfg)
        warning = presets.target_sync_warning(self.cfg)  # here: once the model and the algorithm are known to fit
        if warning and self.writes:
            print(warning, file=sys.stderr)
        if self.resume_path:
            state = self.resume_state
            learner.restore(state, self.resume_path)
            self.telemetry.resume_from(state)
            self._next_checkpoint = self.telemetry.env_steps + (self.cfg.checkpoint_every or 0)
            if self.videos is not None:
                self.videos.start_at(self.telemetry.env_steps)
            if self._recorded_cfg is not None and self._recorded_cfg.algo.lr != self.cfg.algo.lr:
                learner.set_lr(self._scheduled_lr())  # the restored optimizer holds the recorded one
        if self.dist is not None:
            learner.data_parallel = self.dist
            self.dist.broadcast_([*learner.model.parameters(), *learner.model.buffers()])
            self._shared = self._counters()
        self._learner = learner
        return learner

    def _check_world_size(self) -> None:
        """Refuse (one line) a checkpoint written by a run of another world size; under torchrun, keep this
        rank's part of it (``rank_states``) as the architecture's resume state."""
        size = 1 if self.dist is None else self.dist.size
        saved = int(self.resume_state.get("world_size", 1))
        if saved != size:
            raise ConfigError(f"checkpoint {self.resume_path} was written by a run of world size {saved} and this "
                              f"run has world size {size}: resume it with {saved} rank(s) in all (torchrun "
                              "--nnodes x --nproc-per-node; 1: without torchrun)")
        if "rank_states" in self.resume_state:
            rank = 0 if self.dist is None else self.dist.rank
            self.resume_state = {**self.resume_state, **self.resume_state["rank_states"][rank]}

    def _recorded(self) -> dict[str, Any]:
        """What config.json records beside the fields (``RunCfg.to_json``): ``auto``'s backend choice."""
        return {} if self.env_backend is None else {ENV_BACKEND_CHOICE: self.env_backend._asdict()}

    def _write_config(self) -> None:
        """config.json, if this process writes the run directory and has not written it yet."""
        if not self._config_due:
            return
        self._config_due = False
        path = self.out / "config.json"
        try:
            write_text_atomic(path, self.cfg.to_json(self._recorded()))
        except OSError as error:
            raise ConfigError(f"cannot write {path} ({error.strerror or error}): pass --out a writable directory "
                              "with free space") from None

    def save_with_checkpoints(self, state_fn: Any) -> None:
        """Add ``state_fn()`` (a dict of tensors, lists and numbers) to every checkpoint: what an architecture
        needs beyond the learner to resume exactly (env history, sampler state, ...). A resumed run finds it in
        ``resume_state``."""
        self._resume_state_fn = state_fn

    # ---- per step ------------------------------------------------------------------------
    def record_env_step(self, num_envs: int, episode_returns: np.ndarray) -> None:
        self.telemetry.add_steps(num_envs)
        self.record_episodes(episode_returns)

    def record_episodes(self, episode_returns: np.ndarray) -> None:
        """One step of this process's envs: ``episode_returns [B]``, NaN where no episode ended. Under torchrun
        they wait for ``share_progress``, which records every rank's in env order."""
        if self.dist is None:
            self.telemetry.add_episodes(episode_returns)
        else:
            self._pending_returns.append(np.asarray(episode_returns, np.float64).copy())

    def record_served_steps(self, steps: int) -> None:
        """Env steps acted on a thread of their own (SEED's inference), counted until the run decides to stop.
        Later ones (actors stepping while the learner shuts down) are never trained on: they count as
        ``count/steps_after_stop`` instead."""
        with self._stop_decision:
            if self.stop_event.is_set():
                self.telemetry.count("steps_after_stop", steps)
            else:
                self.telemetry.add_steps(steps)

    def record_served_episodes(self, episode_returns: np.ndarray) -> None:
        """Episodes that ended on a thread of their own (SEED's inference), recorded until the run decides to
        stop, under the lock of that decision: an episode that ends after the return that stopped the run
        must not move summary.json's return away from it. Later ones count as ``count/episodes_after_stop``."""
        with self._stop_decision:
            if self.stop_event.is_set():
                self.telemetry.count("episodes_after_stop", int(np.count_nonzero(~np.isnan(episode_returns))))
            else:
                self.record_episodes(episode_returns)

    def _counters(self) -> np.ndarray:
        tel = self.telemetry
        return np.array([tel.env_steps, tel.dropped_steps, tel.restarts], np.float64)

    def share_progress(self) -> None:
        """Under torchrun: send every rank what this one recorded since the last call (env steps, episodes,
        dropped steps and restarts, a signal, the time limit) and take in theirs, so that every rank's counters,
        last-100 returns and stop decision are the same (collective: call it at the same point of every rank's
        loop, right after an update's env steps are recorded and before ``after_update``, ``should_stop`` or
        ``checkpoint_if_due`` read them; every rank has recorded as many steps of episodes). Without torchrun:
        nothing, the telemetry took them as they came."""
        if self.dist is None:
            return
        tel, cfg = self.telemetry, self.cfg
        out_of_time = bool(cfg.time_limit_s and tel.wall_time_s >= cfg.time_limit_s)
        returns = np.stack(self._pending_returns) if self._pending_returns else np.empty((0, self.env_cfg.num_envs))
        self._pending_returns = []
        mine = np.concatenate([[self._signal, out_of_time], self._counters() - self._shared, returns.reshape(-1)])
        ranks = self.dist.exchange(mine)
        for rank, theirs in enumerate(ranks):
            if rank != self.dist.rank:
                tel.add_steps(int(theirs[2]))
                tel.add_restart(int(theirs[3]), int(theirs[4]))
        width = self.env_cfg.num_envs  # every rank's
        for step in np.concatenate([theirs[5:].reshape(len(returns), width) for theirs in ranks], axis=1):
            tel.add_episodes(step)
        self._shared = self._counters()
        signals = [int(theirs[0]) for theirs in ranks if theirs[0]]
        if signals:
            self.request_stop(f"signal {signal.Signals(signals[0]).name}")
        self._peers_out_of_time = any(bool(theirs[1]) for theirs in ranks)

    def after_update(self, learner: Learner, metrics: dict[str, float], checkpoint: bool = True) -> None:
        """Record the update; write a periodic checkpoint when one is due (unless the architecture
        checkpoints at another point of its loop: ``checkpoint=False`` and ``checkpoint_if_due``)."""
        self.telemetry.add_update(metrics)
        self._write_config()  # a resumed run's, now that it has started
        if self.env_backend is not None and self.writes and self.cfg.progress and self.telemetry.updates == 1:
            # with the progress line, after the first update: a mistake found while the run sets up stays one
            # line, and --no-progress keeps a failure's line the only one (config.json records the choice)
            print(f"conveyor: env backend {self.env_backend.backend} (auto: {self.env_backend.reason})",
                  file=sys.stderr)
        if self.cfg.algo.lr_schedule == "linear":
            learner.set_lr(self._scheduled_lr())
        self.telemetry.gauge("skipped_updates", learner.skipped_updates)
        self.telemetry.maybe_log()
        if checkpoint:
            self.checkpoint_if_due(learner)

    def checkpoint_if_due(self, learner: Learner) -> None:
        """A periodic checkpoint when one is due; also one where a video is due (``--capture-video-every``),
        whose recording then starts."""
        steps = self.telemetry.env_steps
        periodic = bool(self.cfg.checkpoint_every) and steps >= self._next_checkpoint
        video = self.videos is not None and self.videos.due(steps) and not self.interrupted.is_set()
        if periodic or video:
            path = self.checkpoint(learner)
            if periodic:
                self._next_checkpoint += self.cfg.checkpoint_every
            if video:
                self.videos.record(path, checkpoint_steps(path))  # type: ignore[union-attr]

    def _scheduled_lr(self) -> float:
        """``--lr``, falling linearly to 0 at ``total_steps`` with ``--lr-schedule linear``."""
        if self.cfg.algo.lr_schedule == "linear":
            return self.cfg.algo.lr * max(0.0, 1.0 - self.telemetry.env_steps / self.cfg.total_steps)
        return self.cfg.algo.lr

    def should_stop(self) -> bool:
        cfg, tel = self.cfg, self.telemetry
        if self.stop_event.is_set():
            return True
        with self._stop_decision:
            if tel.env_steps >= cfg.total_steps:
                self.request_stop("total_steps reached")
            elif (self.target_return is not None and len(tel.returns) >= 100
                  and tel.return_mean_last100 >= self.target_return):
                self.request_stop("target_return reached")
            elif cfg.time_limit_s and (tel.wall_time_s >= cfg.time_limit_s if self.dist is None
                                       else self._peers_out_of_time):  # under torchrun, as share_progress found
                self.request_stop("time_limit_s reached")
        return self.stop_event.is_set()

    # ---- output --------------------------------------------------------------------------
    def checkpoint(self, learner: Learner, **extra: Any) -> Path:
        """Write ``checkpoints/ckpt-<env steps>.pt``, then delete this run's checkpoints beyond the newest
        ``keep_checkpoints`` (only ones it wrote: the list goes into each checkpoint)."""
        self._write_config()  # never a checkpoint beside a config.json that does not describe it
        tel = self.telemetry
        name = checkpoint_name(tel.env_steps)
        path = self.out / "checkpoints" / name
        if self._resume_state_fn is not None:
            extra = {**self._resume_state_fn(), **extra}
        if self.dist is not None:  # collective: every rank's envs go into rank 0's file
            extra = {"rank_states": self.dist.gather_states(extra)}
        names = [old for old in self._own_checkpoints if old != name] + [name]
        kept, rotated = names[-self.cfg.keep_checkpoints:], names[: -self.cfg.keep_checkpoints]
        if self.writes:
            learner.save(path, **tel.saved_counters(), **extra, run_checkpoints=kept,
                         world_size=1 if self.dist is None else self.dist.size)
            for old in rotated:
                (self.out / "checkpoints" / old).unlink(missing_ok=True)
        self._own_checkpoints = kept
        return path

    def finish(self, learner: Learner, **extra: Any) -> dict[str, Any]:
        """Final checkpoint (its video, when one is due, is recorded as the run closes), summary.json,
        TensorBoard hparams; returns the summary."""
        self._final_checkpoint = self.checkpoint(learner)
        if self.dist is not None:  # collective
            extra = {**extra, "distributed": self.dist.summary(learner.param_sha256())}
        if learner.skipped_updates and self.writes:
            print(f"conveyor: warning: {learner.skipped_updates} updates were skipped because their loss or "
                  "gradients were not finite (skipped_updates in summary.json): check the env's observations and "
                  "rewards for NaN/inf, or lower --lr", file=sys.stderr)
        self.telemetry.maybe_log(force=True)
        summary = self.telemetry.summary(
            arch=self.cfg.arch.name,
            algo=self.cfg.algo.name,
            env=self.cfg.env.id,
            seed=self.cfg.seed,
            param_sha256=learner.param_sha256(),
            learner_version=learner.version,
            stop_reason=self.stop_reason or "finished",
            skipped_updates=learner.skipped_updates,
            out=str(self.out),
            **extra,
        )
        self.telemetry.write_summary(summary)
        self.telemetry.write_hparams(flat_config(self.cfg))
        if self.wandb is not None:
            self.wandb.summary(summary)
        return summary
