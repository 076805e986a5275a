"""Errors a run reports as one line (the CLI prints them without a traceback)."""

import traceback


def error_line(error: BaseException) -> str:
    """The last line of ``error``'s traceback, on one line: its type and message, e.g. ``ValueError: bad action``."""
    return " ".join(traceback.format_exception_only(error)[-1].split())


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the fix (exit code 2)."""


class WorkerFailure(RuntimeError):
    """A worker, executor, agent or actor process died, or envs raised more often than
    ``--max-env-errors``. The message names the part (index, pid, envs, exit reason); the run
    writes a checkpoint before it stops, so ``--resume`` continues from there. ``details``: the traceback behind
    it, if any (the run appends it to its ``errors.log``)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class WorkerDied(WorkerFailure):
    """A process died (killed, crashed), as opposed to one that reported an error it cannot get past: a
    process that hosts it may treat this as its own death, so that it is restarted in turn."""


class StoppedWhileStarting(RuntimeError):
    """The run was asked to stop (a signal) while its env workers were still starting: building their envs, or
    rebuilding a resumed run's games by replaying their actions, which can take a while on Atari. They are
    killed; no step ran, so there is nothing new to save and the run's last checkpoint stands (the exit code of a
    run stopped by that signal). ``stop_reason``: the signal, as the summary would name it (the run sets it)."""

    stop_reason = ""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, tampered with, or from another model (exit code 2). Here, not in
    ``learner.py``, so that the CLI catches it without importing torch (``conveyor actor`` never does)."""


class RunFailure(RuntimeError):
    """The run cannot go on, for a reason of its own rather than a worker's: updates that keep coming out
    non-finite (NaN/inf loss or gradients), a checkpoint that cannot be written (a full disk). The message
    names the cause and the fix (exit code 1)."""
