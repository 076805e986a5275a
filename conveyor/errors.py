"""Errors a run reports as one line (the CLI prints them without a traceback)."""


class WorkerFailure(RuntimeError):
    """A worker, executor, agent or actor process died, or envs raised more often than
    ``--max-env-errors``. The message names the part (index, pid, envs, exit reason); the run
    writes a checkpoint before it stops, so ``--resume`` continues from there."""
