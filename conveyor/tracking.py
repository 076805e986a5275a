"""Tracking beyond ``metrics.csv``: Weights & Biases (``--wandb PROJECT``) and videos recorded during training
(``--capture-video-every N``). Both live in the learner's process only (``Run`` owns them); no worker, actor
or agent process imports this module.

``WandbTracker`` is a sink of ``Telemetry``: every row that goes to ``metrics.csv`` and TensorBoard goes to
W&B too (x axis ``env_steps``), with the videos that came with it; the run's config (``config.json``'s
content) is the W&B run's config, ``summary.json``'s scalars its summary. The W&B run id is kept in
``<out>/wandb-run-id``, so ``--resume DIR`` continues the same W&B run (``resume="allow"``; W&B ignores
resuming in offline mode: the continuation is then a second ``offline-run-*`` directory with the same id).
W&B's own files go to ``<out>/wandb/``. ``WANDB_MODE=offline`` logs without a network or a login.

``VideoCapture``: when a checkpoint at or past each multiple of N env steps is written (``Run`` forces one
there), ``python -m conveyor enjoy --run OUT --checkpoint <held copy> --episodes 1 --video
OUT/videos/step-<steps>.mp4`` plays one evaluation episode in a child process while the training loop goes
on (only the run's end waits for it; Ctrl-C stops it). At most one plays at a time: a video falling due
meanwhile is skipped (``count/videos_skipped``). The checkpoint it reads is held as a hard link (a copy across
filesystems) under ``videos/``, so rotation cannot delete it mid-play. When it ends, its return and length go
into the next metrics row as ``eval/return``, ``eval/length`` and ``eval/env_steps`` (the checkpoint's
steps), and the video to W&B as ``eval/video``.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import signal
import string
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from conveyor.config import RunCfg
from conveyor.errors import ConfigError
from conveyor.files import write_text_atomic
from conveyor.learner import checkpoint_name
from conveyor.procs import SINGLE_THREAD_VARS
from conveyor.telemetry import Telemetry

WANDB_RUN_ID_FILE = "wandb-run-id"
"""Where a run directory keeps the id of its W&B run (a resumed run continues it)."""
INSTALL_HINT = "pip install 'conveyor[wandb]'"
VIDEO_DIR = "videos"
EPISODE_LINE = re.compile(r"^episode 1: return (\S+), length (\d+)", re.MULTILINE)
"""The line ``conveyor enjoy`` prints for the episode it played (``conveyor.enjoy.play``)."""
STOP_GRACE_S = 5.0


def config_values(cfg: RunCfg, recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config as ``config.json`` holds it (nested dicts, tuples as lists; ``recorded``: ``RunCfg.to_json``'s)."""
    return json.loads(cfg.to_json(recorded))


def flat_config(cfg: RunCfg) -> dict[str, Any]:
    """``config.json``'s values by ``section.field`` (``env.id``, ``seed``), as TensorBoard hparams: numbers and
    strings as they are, booleans and lists as text, None left out."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}{key}.", item)
        elif value is None:
            return
        elif isinstance(value, bool) or isinstance(value, list):
            flat[prefix[:-1]] = json.dumps(value)
        elif isinstance(value, (int, float, str)):
            flat[prefix[:-1]] = value
        else:
            flat[prefix[:-1]] = str(value)

    walk("", config_values(cfg))
    return flat


def _warn(message: str) -> None:
    print(f"conveyor: warning: {message}", file=sys.stderr)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ---- Weights & Biases ---------------------------------------------------------------------------
def import_wandb() -> Any:
    """The ``wandb`` module; a ConfigError naming the install command when it cannot be imported."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(f"--wandb needs the wandb package, which is not installed: {INSTALL_HINT} "
                          "(or drop --wandb)") from None
    return wandb


class WandbTracker:
    """One W&B run for one conveyor run (see the module docstring); made by ``open``."""

    def __init__(self, wandb: Any, run: Any):
        self._wandb = wandb
        self.run = run
        self._failed = False

    @classmethod
    def open(cls, cfg: RunCfg, out: Path, recorded: dict[str, Any] | None = None) -> "WandbTracker":
        """The W&B run of ``cfg``'s run in ``out``; its config is config.json's (``recorded`` included)."""
        wandb = import_wandb()
        id_file = out / WANDB_RUN_ID_FILE
        run_id = ""
        if cfg.resume and id_file.is_file():
            run_id = id_file.read_text().strip()
        if not run_id:  # as W&B makes them: 8 lowercase letters and digits
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            write_text_atomic(id_file, run_id + "\n")
        try:
            run = wandb.init(project=cfg.wandb, entity=cfg.wandb_entity or None, group=cfg.wandb_group or None,
                             name=cfg.wandb_name or out.resolve().name, dir=str(out), id=run_id,
                             resume="allow" if cfg.resume else None, config=config_values(cfg, recorded),
                             allow_val_change=True, job_type="train")
        except Exception as error:  # wandb raises its own errors (no network, not logged in, a bad project)
            raise ConfigError(f"wandb.init failed ({_first_line(error)}): run `wandb login`, or set "
                              "WANDB_MODE=offline to log without a network") from None
        run.define_metric("env_steps")
        run.define_metric("*", step_metric="env_steps")
        return cls(wandb, run)

    def _safely(self, what: str, action: Callable[[], None]) -> None:
        """W&B trouble never stops training: the first failure is reported, and logging stops."""
        if self._failed:
            return
        try:
            action()
        except Exception as error:
            self._failed = True
            _warn(f"W&B {what} failed ({_first_line(error)}); training goes on without W&B")

    def log(self, row: dict[str, float], media: dict[str, Path]) -> None:
        """A metrics row (non-finite values left out, as in TensorBoard) and the videos that came with it."""
        def action() -> None:
            data: dict[str, Any] = {key: value for key, value in row.items()
                                    if isinstance(value, (int, float)) and math.isfinite(value)}
            for key, path in media.items():
                data[key] = self._wandb.Video(str(path), format="mp4")
            self.run.log(data)

        self._safely("logging", action)

    def summary(self, summary: dict[str, Any]) -> None:
        """``summary.json``'s scalars (numbers and strings) into the W&B run's summary."""
        scalars = {key: value for key, value in summary.items()
                   if isinstance(value, str) or (isinstance(value, (int, float)) and math.isfinite(value))}
        self._safely("summary", lambda: self.run.summary.update(scalars))

    def finish(self, exit_code: int = 0) -> None:
        failed, self._failed = self._failed, False  # finish even after a failed log
        self._safely("finish", lambda: self.run.finish(exit_code=exit_code))
        self._failed = failed


# ---- videos during training -----------------------------------------------------------------------
class VideoCapture:
    """Evaluation episodes recorded every ``every`` env steps (see the module docstring)."""

    def __init__(self, out: Path, every: int, telemetry: Telemetry):
        self.out = Path(out).resolve()
        self.every = every
        self.telemetry = telemetry
        self.dir = self.out / VIDEO_DIR
        self.next_steps = every
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.skipped_steps = -1
        """The env steps of the last video skipped (one was playing then)."""
        self.disabled = False
        """Set when ``conveyor enjoy`` refused a video (exit code 2): the next ones would fail the same way."""

    def start_at(self, env_steps: int) -> None:
        """A resumed run: the next video at the first multiple of ``every`` after ``env_steps``."""
        self.next_steps = (env_steps // self.every + 1) * self.every

    def due(self, env_steps: int) -> bool:
        return not self.disabled and env_steps >= self.next_steps

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def record(self, checkpoint: Path, env_steps: int) -> None:
        """Play the checkpoint ``checkpoint`` (written at ``env_steps``) into ``videos/step-<env_steps>.mp4`` in
        the background; skipped (and counted) while another recording plays."""
        self.next_steps = (env_steps // self.every + 1) * self.every
        if self.busy:
            self.telemetry.count("videos_skipped")
            self.skipped_steps = env_steps
            return
        self._stopping = False
        self.dir.mkdir(exist_ok=True)
        held = self.dir / f".{checkpoint_name(env_steps)}"
        held.unlink(missing_ok=True)
        try:
            os.link(checkpoint, held)  # rotation unlinks the checkpoint's name; this one keeps its data
        except OSError:
            shutil.copyfile(checkpoint, held)
        video = self.dir / f"step-{env_steps:012d}.mp4"
        command = [sys.executable, "-m", "conveyor", "enjoy", "--run", str(self.out), "--checkpoint", str(held),
                   "--episodes", "1", "--video", str(video)]
        env = dict(os.environ)
        for name in SINGLE_THREAD_VARS:  # one core's worth of work beside training
            env.setdefault(name, "1")
        package_root = str(Path(__file__).resolve().parent.parent)  # the same conveyor, installed or not
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH", "")]))
        try:  # its own process group: a Ctrl-C reaches the learner, which stops it (``stop``)
            self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, env=env, process_group=0)
        except OSError as error:
            held.unlink(missing_ok=True)
            self.telemetry.count("video_failures")
            _warn(f"the video of step {env_steps} could not start ({error}); training goes on")
            return
        self._thread = threading.Thread(target=self._watch, args=(self._process, env_steps, held, video),
                                        name="conveyor-video", daemon=True)
        self._thread.start()

    def _watch(self, process: subprocess.Popen, env_steps: int, held: Path, video: Path) -> None:
        stdout, stderr = process.communicate()
        held.unlink(missing_ok=True)
        if self._stopping:
            return
        match = EPISODE_LINE.search(stdout)
        if process.returncode or match is None or not video.is_file():
            lines = (stderr or stdout).strip().splitlines()
            self.telemetry.count("video_failures")
            then = "training goes on"
            if process.returncode == 2:  # refused (an env that cannot render): every later one would be too
                self.disabled = True
                then = "no more videos in this run (drop --capture-video-every); training goes on"
            _warn(f"the video of step {env_steps} failed (conveyor enjoy exited with {process.returncode}: "
                  f"{lines[-1] if lines else 'no output'}); {then}")
            return
        self.telemetry.count("videos")
        self.telemetry.add_eval({"eval/return": float(match.group(1)), "eval/length": int(match.group(2)),
                                 "eval/env_steps": env_steps}, {"eval/video": video})

    def record_final(self, checkpoint: Path, env_steps: int, stop: Callable[[], bool] = lambda: False) -> None:
        """At the run's end: record the final checkpoint when its video is due, or was skipped for one still
        playing, after waiting for that one; then wait for it to end (stopping it if ``stop()`` turns true)."""
        if self.due(env_steps) or self.skipped_steps == env_steps:
            self.wait(stop)
            if stop() or self.disabled:
                return
            if self.skipped_steps == env_steps:
                self.telemetry.count("videos_skipped", -1)  # recorded after all
                self.skipped_steps = -1
            self.record(checkpoint, env_steps)
        self.wait(stop)

    def wait(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Wait for the recording in flight to end; stop it if ``stop()`` turns true meanwhile."""
        while self.busy:
            if stop():
                self.stop()
                return
            self._thread.join(0.2)  # type: ignore[union-attr]

    def stop(self) -> None:
        """Stop a recording in flight (its process group: enjoy and its ffmpeg), leaving no partial files."""
        process, thread = self._process, self._thread
        if thread is None or not thread.is_alive() or process is None:
            return
        self._stopping = True
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        thread.join(STOP_GRACE_S)
        if thread.is_alive():
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            thread.join()
        for partial in self.dir.glob(".step-*.partial.*"):
            partial.unlink(missing_ok=True)
