"""``conveyor tune``: hyperparameter search with Optuna (the optional ``tune`` extra, imported only here).

A study samples the search space (``tune_space.py``) with TPE and runs each trial as ``conveyor train`` in a
child process of its own (``trial_main``: ``conveyor.train`` with the trial's ``trial.toml`` as ``--config``),
``--jobs`` of them at once, each with its own seed (``--seed`` + the trial's number) and run directory
``trial-N`` in the study's folder (``--out``, default ``runs/tune/<study>``). While a trial runs, the tuner reads
its ``metrics.csv`` and reports the mean return of the last 100 episodes at ``REPORTS`` evenly spaced env
steps (the same steps for every trial) to Optuna's median pruner; a pruned trial gets SIGTERM, which stops
its run as any signal does (workers closed, summary written), in a session of its own so that a Ctrl-C at the
terminal reaches the tuner alone. The trial's value is the run's ``return_mean_last100`` at the end of
``--steps``, or with ``--objective time`` its wall-clock seconds to ``--target-return`` (``summary.json``'s
``wall_time_s``: the run's own clock, Python's start-up left out; a trial that never reaches it scores inf).

The study lives in its storage: by default ``study.db`` (SQLite) in the study's folder, else any URL Optuna
accepts (``postgresql://...``) or ``journal:PATH`` (a journal file, for machines that share a file system).
``--trials N`` counts the study's trials, whoever ran them, so the same command resumes an interrupted study
and several processes (machines) can share one. A trial stopped by Ctrl-C/SIGTERM, or (with an SQL storage,
whose heartbeats show it) by the death of the process that ran it, is marked failed and enqueued again with
the same parameters (``retry_of``): it counts once. A trial whose run fails counts as a failed trial.

At the end: a table of the best trials, ``history.png`` and ``importance.png`` (Optuna's matplotlib plots;
importances by PED-ANOVA, which needs no scikit-learn), and ``best.toml``, which ``conveyor train --config
best.toml`` runs as is.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

from conveyor.bench.child import kill_process_group, last_line, stop_child
from conveyor.cli import UsageError, config_from_flags, train_flag_types
from conveyor.config import RunCfg
from conveyor.errors import ConfigError
from conveyor.flag_file import read_flag_file, write_flag_file
from conveyor.hosts import usable_cpus
from conveyor.presets import ARCH_ALGOS, own_algo
from conveyor.procs import SignalRelay, die_with_parent
from conveyor.tune_space import Choice, Space, describe, read_space_file, space_for

PARENT_PID_ENV = "CONVEYOR_TUNE_PARENT_PID"
TRIAL_ENTRY = "from conveyor.tune import trial_main; trial_main()"
REPORTS = 10
"""Intermediate values per trial: at 1/10, 2/10, ... of ``--steps`` (the median pruner compares trials at
equal steps)."""
POLL_S = 0.5
"""How often a trial's ``metrics.csv`` is read."""
HEARTBEAT_S = 10
GRACE_S = 60
"""SQL storages: a running trial whose process has not beaten for this long is failed and enqueued again."""
TRIAL_ONLY: dict[str, Any] = {"progress": False, "log-interval-s": 1.0}
"""Train flags every trial runs with and ``best.toml`` leaves out: a row of metrics (a pruner report) a second."""
RETRY_OF = "retry_of"
STUDY_KEYS = ("arch", "algo", "env", "objective", "steps", "target_return")
INTERRUPTED = 130
BEST_SHOWN = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", default="paac", choices=tuple(ARCH_ALGOS), help="architecture (default: paac)")
    parser.add_argument("--algo", help="algorithm (default: the architecture's own)")
    parser.add_argument("--env", default="CartPole-v1", help="env id (default: CartPole-v1)")
    parser.add_argument("--trials", type=int, required=True, help="trials in the study, whoever runs them: the "
                        "same command resumes an interrupted study")
    parser.add_argument("--steps", type=int, required=True, help="env steps per trial (its --total-steps)")
    parser.add_argument("--jobs", type=int, default=0, help="trials at once in this process (default: as many "
                        "as the CPUs hold, by the run's processes)")
    parser.add_argument("--study", default="", help="study name (default: ARCH-ALGO-ENV)")
    parser.add_argument("--storage", default="", help="Optuna storage URL (postgresql://..., sqlite:///PATH) or "
                        "journal:PATH (default: sqlite in the study's folder)")
    parser.add_argument("--space", metavar="FILE", help="TOML file that changes the search space "
                        "(docs/tuning.md)")
    parser.add_argument("--config", metavar="FILE", help="TOML file of train flags every trial runs with "
                        "(as `conveyor train --config`); the sampled parameters override it")
    parser.add_argument("--objective", choices=("return", "time"), default="return",
                        help="return: mean return of the last 100 episodes at the end of --steps (maximised); "
                        "time: the run's wall-clock seconds to --target-return (minimised)")
    parser.add_argument("--target-return", type=float, help="--objective time: the return to reach (default: "
                        "the env's reward threshold)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed; trial N runs with seed + N")
    parser.add_argument("--out", default="", help="the study's folder (default: runs/tune/STUDY)")


def main(args: argparse.Namespace) -> int:
    optuna = import_optuna()
    algo = args.algo or own_algo(args.arch)
    if args.trials < 1 or args.steps < 1 or args.jobs < 0:
        raise ConfigError("--trials and --steps must be positive and --jobs >= 0: pass counts")
    fixed: dict[str, Any] = {"arch": args.arch, "algo": algo, "env": args.env, "total-steps": args.steps}
    if args.config:
        fixed = {**read_flag_file(args.config, set(train_flag_types())), **fixed}
    if args.objective == "time":
        fixed["target-return"] = target_return(fixed, args.target_return)
    elif args.target_return is not None:
        raise ConfigError("--target-return sets the goal of --objective time: drop it, or pass --objective time")
    else:
        fixed["target-return"] = math.inf  # every trial runs its whole budget: the value is where it ends
    base = build(fixed, "--config")
    space = space_for(args.arch, algo, base.env.family)
    if args.space:
        space = read_space_file(args.space, space, set(train_flag_types()))
    check_space(space, fixed, args.space or "the default space")
    name = args.study or f"{args.arch}-{algo}-{args.env.replace('/', '_').replace(':', '_')}"
    out = Path(args.out or Path("runs") / "tune" / name)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--out {out} cannot be created ({error.strerror}): pass a writable directory") from None
    url = args.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    storage = open_storage(optuna, url)
    attrs = {"arch": args.arch, "algo": algo, "env": args.env, "objective": args.objective, "steps": args.steps,
             "target_return": fixed["target-return"] if args.objective == "time" else None}
    study = open_study(optuna, storage, name, url, attrs, args.seed, out)
    jobs = args.jobs or max(1, usable_cpus() // trial_cpus(base))
    print(f"conveyor tune: study {name} in {url}: {args.trials} trials of {args.steps:,} steps, {jobs} at once, "
          f"into {out}; space: " + ", ".join(f"{k} {describe(v)}" for k, v in space.items()), flush=True)
    tuner = Tuner(optuna, study, space, fixed, out, args.trials, args.seed)
    interrupted = tuner.run(jobs)
    report(optuna, study, fixed, out)
    if interrupted:
        print("conveyor tune: interrupted; the same command resumes the study (a stopped trial runs again)",
              file=sys.stderr)
        return INTERRUPTED
    return 0


def import_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError("conveyor tune needs Optuna: pip install 'conveyor[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # ask/tell with a heartbeat: Optuna warns that only optimize beats it; Tuner.heartbeat does
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    return optuna


def build(flags: dict[str, Any], where: str) -> RunCfg:
    """The RunCfg of ``flags``; a value the train parser or the config refuses is a ConfigError naming ``where``."""
    try:
        return config_from_flags(flags)
    except (ConfigError, UsageError) as error:
        raise ConfigError(f"{where}: {error}") from None


def target_return(fixed: dict[str, Any], given: float | None) -> float:
    """``--objective time``'s goal: ``given``, else the env's reward threshold."""
    from conveyor.run import resolve_target_return

    goal = given if given is not None else resolve_target_return(build(fixed, "--config"))
    if goal is None or not math.isfinite(goal):
        raise ConfigError(f"--objective time needs a goal and {fixed['env']} has no reward threshold: pass "
                          "--target-return X")
    return float(goal)


def check_space(space: Space, fixed: dict[str, Any], where: str) -> None:
    """Refuse (one line) a parameter whose range reaches a value the config refuses: each end of a range, each
    choice, with the fixed flags and the presets for the rest."""
    for name, param in space.items():
        for value in param.ends():
            build({**fixed, name: as_flag_value(name, value)}, f"{where}: {name} = {value!r} is refused")


def as_flag_value(name: str, value: Any) -> Any:
    """A range's end as its flag's type (an integer flag's ``16.0`` as ``16``)."""
    return int(value) if train_flag_types().get(name) is int and isinstance(value, float) else value


def trial_cpus(cfg: RunCfg) -> int:
    """The CPUs one trial's run keeps busy: its learner and the processes that step its envs (an upper bound:
    ``--env-backend auto`` steps cheap envs in the learner's process)."""
    stepping = {"ga3c": cfg.arch.num_agents, "seed": max(1, cfg.arch.local_actors) * cfg.env.num_workers}
    return 1 + stepping.get(cfg.arch.name, cfg.env.num_workers)


# ---- storage and study ------------------------------------------------------------------------------------------
def open_storage(optuna: Any, url: str) -> Any:
    """The storage at ``url``; one that cannot be opened (no server, no driver, no such directory) is a
    ConfigError. SQL storages beat a heartbeat per running trial (``retry``: the dead process's trial again)."""
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
        with sqlite_schema_lock(url):
            return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                                              heartbeat_stale_trial_callback=retry)
    except Exception as error:  # sqlalchemy's and the drivers' errors have no common base but Exception
        reason = " ".join(str(error).split("\n")[0].split())
        raise ConfigError(f"--storage {url} cannot be opened ({type(error).__name__}: {reason}): check the URL, "
                          "that the server is up, and its driver (postgresql: pip install psycopg2)") from None


@contextlib.contextmanager
def sqlite_schema_lock(url: str) -> Iterator[None]:
    """For a SQLite file: one process at a time opens it (``DB.lock`` beside it, ``fcntl.flock``). Two tuners
    started together on a new file each found no tables and each created them ("table ... already exists")."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url == prefix:  # a server's URL, or SQLite in memory
        yield
        return
    fd = os.open(f"{url.removeprefix(prefix)}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def open_study(optuna: Any, storage: Any, name: str, url: str, attrs: dict[str, Any], seed: int, out: Path) -> Any:
    """The study ``name`` (created if new), refused in one line, untouched, when it was created for another
    arch/algo/env/objective/budget."""
    direction = "minimize" if attrs["objective"] == "time" else "maximize"
    study = optuna.create_study(storage=storage, study_name=name, direction=direction, load_if_exists=True,
                                sampler=optuna.samplers.TPESampler(seed=seed),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=5,
                                                                   n_warmup_steps=attrs["steps"] // 3))
    recorded = study.user_attrs
    if not recorded:
        if any(out.glob("trial-*")):
            raise ConfigError(f"{out} holds the trials of another study: pass another --out (or the --study and "
                              "--storage of that one)")
        for key, value in attrs.items():
            study.set_user_attr(key, value)
    elif any(recorded.get(key) != value for key, value in attrs.items()):
        was = ", ".join(f"{key} {recorded.get(key)}" for key in STUDY_KEYS)
        raise ConfigError(f"study {name} in {url} was created for {was}: pass another --study, or the same "
                          "--arch/--algo/--env/--objective/--steps/--target-return")
    return study


def retry(study: Any, trial: Any) -> None:
    """Enqueue ``trial``'s parameters again, for a trial that was stopped before its end (it counts once)."""
    study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})


def budget_used(optuna: Any, trials: list[Any]) -> int:
    """The study's trials that count against ``--trials``: all but the failed ones that run again."""
    again = {trial.user_attrs[RETRY_OF] for trial in trials if RETRY_OF in trial.user_attrs}
    return sum(1 for trial in trials if not (trial.state == optuna.trial.TrialState.FAIL and trial.number in again))


# ---- trials ----------------------------------------------------------------------------------------------------
class Tuner:
    """Runs the study's trials, ``jobs`` at a time (``run``), until ``--trials`` are used or a signal comes."""

    def __init__(self, optuna: Any, study: Any, space: Space, fixed: dict[str, Any], out: Path, trials: int,
                 seed: int) -> None:
        self.optuna, self.study, self.space, self.fixed = optuna, study, space, fixed
        self.out, self.trials, self.seed = out, trials, seed
        self.maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
        self.stop = threading.Event()
        self.lock = threading.Lock()  # one ask at a time, after the count
        self.errors: list[BaseException] = []

    def run(self, jobs: int) -> bool:
        """Run trials on ``jobs`` threads (each waits on its trial's process); True when a signal stopped them."""
        signalled = threading.Event()

        def on_signal(signum: int) -> None:
            signalled.set()
            self.stop.set()

        main = threading.current_thread() is threading.main_thread()
        relay = SignalRelay((signal.SIGINT, signal.SIGTERM), on_signal) if main else None
        threads = [threading.Thread(target=self.work, name=f"tune-job-{i}") for i in range(jobs)]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.5)
        finally:
            self.stop.set()
            for thread in threads:
                thread.join()
            if relay is not None:
                relay.close()
        if self.errors:
            raise self.errors[0]
        return signalled.is_set()

    def work(self) -> None:
        try:
            while (trial := self.next_trial()) is not None:
                self.run_trial(trial)
        except BaseException as error:  # a storage that fails: the other jobs stop too, the error is raised
            self.errors.append(error)
            self.stop.set()

    def next_trial(self) -> Any:
        """A new (or enqueued) trial, or None once the study's budget is used or a stop was asked for."""
        with self.lock:
            if self.stop.is_set():
                return None
            self.optuna.storages.fail_stale_trials(self.study)
            trials = self.study.get_trials(deepcopy=False)
            waiting = any(trial.state == self.optuna.trial.TrialState.WAITING for trial in trials)
            if not waiting and budget_used(self.optuna, trials) >= self.trials:  # a waiting retry has its slot
                return None
            trial = self.study.ask()
            self.heartbeat(trial)
            return trial

    def heartbeat(self, trial: Any) -> None:
        storage = self.study._storage  # Optuna's ask/tell API beats no heartbeat of its own (only optimize does)
        if self.optuna.storages._heartbeat.is_heartbeat_enabled(storage):
            storage.record_heartbeat(trial._trial_id)

    def params(self, trial: Any) -> dict[str, Any]:
        values = {}
        for name, param in self.space.items():
            if isinstance(param, Choice):
                values[name] = trial.suggest_categorical(name, list(param.values))
            elif train_flag_types().get(name) is int:
                values[name] = trial.suggest_int(name, int(param.low), int(param.high), log=param.log)
            else:
                values[name] = trial.suggest_float(name, float(param.low), float(param.high), log=param.log)
        return values

    def run_trial(self, trial: Any) -> None:
        state = self.optuna.trial.TrialState
        params = self.params(trial)
        run_dir = self.out / f"trial-{trial.number}"
        trial.set_user_attr("run_dir", str(run_dir))
        flags = {**self.fixed, **params, "seed": self.seed + trial.number}
        try:
            build(flags, f"trial {trial.number}")
        except ConfigError as error:  # a combination of values the config refuses
            self.finish(trial, state.FAIL, error=str(error))
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        write_flag_file(run_dir / "trial.toml", {**flags, **TRIAL_ONLY}, f"trial {trial.number} of study "
                        f"{self.study.study_name}: conveyor train --config trial.toml --out {run_dir}")
        with open(run_dir / "tune.log", "w") as log:
            child = subprocess.Popen([sys.executable, "-c", TRIAL_ENTRY, str(run_dir / "trial.toml"), str(run_dir)],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, PARENT_PID_ENV: str(os.getpid())})
        try:
            ending = self.watch(trial, child, run_dir)
        finally:
            kill_process_group(child)  # what a crashed run left
        summary = read_summary(run_dir)
        if summary is not None and not str(summary.get("stop_reason", "")).startswith("signal"):
            value = self.value(summary)
            if value is None:
                self.finish(trial, state.FAIL, error="no episode ended within --steps: raise --steps")
            else:
                self.finish(trial, state.COMPLETE, value=value)
        elif ending == "pruned":
            self.finish(trial, state.PRUNED)
        elif ending == "stopped":
            self.finish(trial, state.FAIL, error="stopped by a signal; it runs again")
            retry(self.study, trial)
        else:
            self.finish(trial, state.FAIL, error=f"the run failed: {last_line(run_dir / 'tune.log')}")

    def watch(self, trial: Any, child: subprocess.Popen, run_dir: Path) -> str:
        """Wait for the trial's run, reporting its returns; ``exited``, ``pruned`` or ``stopped`` (a signal)."""
        reports = Reports(run_dir / "metrics.csv", self.fixed["total-steps"])
        next_beat = time.monotonic() + HEARTBEAT_S
        while child.poll() is None:
            if self.stop.is_set():
                stop_child(child)
                return "stopped"
            if time.monotonic() >= next_beat:
                self.heartbeat(trial)
                next_beat += HEARTBEAT_S
            for step, value in reports.new():
                trial.report(value if self.maximize else -value, step)  # minimising time: a higher return is lower
                if trial.should_prune():
                    stop_child(child)
                    return "pruned"
            self.stop.wait(POLL_S)
        return "exited"

    def value(self, summary: dict[str, Any]) -> float | None:
        if not self.maximize:  # --objective time
            return float(summary["wall_time_s"]) if summary["stop_reason"] == "target_return reached" else math.inf
        value = summary.get("return_mean_last100")
        return None if value is None or not math.isfinite(value) else float(value)

    def finish(self, trial: Any, state: Any, value: float | None = None, error: str = "") -> None:
        if error:
            trial.set_user_attr("error", error)
        self.study.tell(trial, value, state=state)
        shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in trial.params.items())
        result = f"{value:.4g}" if value is not None else state.name.lower() + (f" ({error})" if error else "")
        print(f"trial {trial.number}: {result}; {shown}", flush=True)


class Reports:
    """The values a trial's run reports to the pruner: its last-100 mean return where ``metrics.csv`` first
    passes each of ``REPORTS - 1`` evenly spaced env-step marks (a mark passed before any episode ended
    reports nothing)."""

    def __init__(self, path: Path, steps: int) -> None:
        self.path = path
        self.marks = [steps * k // REPORTS for k in range(1, REPORTS)]
        self.rows_read = 0

    def new(self) -> Iterator[tuple[int, float]]:
        try:
            text = self.path.read_text()
        except OSError:
            return
        lines = text.split("\n")[:-1]  # complete lines only: the run may be writing the last one
        rows = list(csv.DictReader(lines))[self.rows_read:]
        self.rows_read += len(rows)
        for row in rows:
            steps, value = float(row["env_steps"]), float(row["return_mean_last100"] or "nan")
            while self.marks and steps >= self.marks[0]:
                mark = self.marks.pop(0)
                if math.isfinite(value):
                    yield mark, value


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def trial_main() -> None:
    """A trial's child process: ``conveyor train --config TRIAL_TOML --out RUN_DIR`` (argv: those two paths).
    In a session of its own, it hears no Ctrl-C; the tuner stops it with SIGTERM, and so does the kernel when
    the tuner dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(int(os.environ[PARENT_PID_ENV]), signal.SIGTERM)
    from conveyor.cli import main as cli_main

    sys.exit(cli_main(["train", "--config", sys.argv[1], "--out", sys.argv[2]]))


# ---- results -----------------------------------------------------------------------------------------------------
def report(optuna: Any, study: Any, fixed: dict[str, Any], out: Path) -> None:
    """Print the best trials; write ``best.toml``, ``history.png`` and ``importance.png`` into ``out``."""
    state = optuna.trial.TrialState
    trials = study.get_trials(deepcopy=False)
    counts = {name: sum(t.state == getattr(state, name) for t in trials) for name in ("COMPLETE", "PRUNED", "FAIL")}
    print(f"study {study.study_name}: {counts['COMPLETE']} complete, {counts['PRUNED']} pruned, "
          f"{counts['FAIL']} failed trials")
    done = [t for t in trials if t.state == state.COMPLETE and math.isfinite(t.value)]
    if not done:
        print("no trial has a result yet: nothing to write")
        return
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    done.sort(key=lambda t: -t.value if maximize else t.value)
    names = sorted({name for t in done for name in t.params})
    rows = [["trial", "value", *names]] + [[str(t.number), f"{t.value:.4g}", *(_cell(t.params.get(n)) for n in names)]
                                          for t in done[:BEST_SHOWN]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    best = done[0]
    kept = {k: v for k, v in fixed.items() if not (k == "target-return" and v == math.inf)}
    write_flag_file(out / "best.toml", {**kept, **best.params},
                    f"conveyor tune, study {study.study_name}: trial {best.number} ({out / f'trial-{best.number}'}), "
                    f"value {best.value:.6g}\nconveyor train --config {out / 'best.toml'}")
    print(f"best: trial {best.number}; conveyor train --config {out / 'best.toml'}")
    plot(optuna, study, out)


def _cell(value: Any) -> str:
    return "" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def plot(optuna: Any, study: Any, out: Path) -> None:
    """``history.png`` and ``importance.png``; a plot Optuna cannot draw (importances need two finished trials)
    is left out with one line saying why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from optuna.visualization import matplotlib as optuna_plots

    plots = [("history.png", optuna_plots.plot_optimization_history)]
    if len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))) >= 2:
        plots.append(("importance.png", optuna_plots.plot_param_importances))
    else:
        print("no importance.png: importances need two finished trials")
    for name, draw in plots:
        try:
            axes = draw(study)
            axes.figure.set_size_inches(8, 5)
            axes.figure.tight_layout()
            axes.figure.savefig(out / name, dpi=100)
        except (ValueError, RuntimeError, ZeroDivisionError) as error:
            print(f"no {name}: {error}")
        finally:
            plt.close("all")
