"""conveyor.procs: children start with a JSON spec, are reaped within one grace period (killed past it), say
how they ended, die with their parent, and restarts are counted against one budget that stops with one line."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conveyor import procs
from conveyor.architectures.ga3c import agents
from conveyor.architectures.hts import state_buffer
from conveyor.config import EnvCfg
from conveyor.envs import vector
from conveyor.envs.shm_worker import WorkerSpec
from conveyor.errors import WorkerFailure
from conveyor.storage.shm import ArraySpec

PATIENCE_S = 120.0
"""How long a test waits for a child's answer before failing (a busy machine starts Python slowly)."""

# A child that reports what its prologue gave it, as JSON down the pipe its spec names.
_REPORTING_CHILD = """
import json, os, signal, sys
from conveyor.envs.shm_worker import WorkerSpec
from conveyor.procs import SINGLE_THREAD_VARS, child_prologue, parent_gone
spec = child_prologue(WorkerSpec)
report = {
    "index": spec.index, "env_cfg": type(spec.env_cfg).__name__, "env_id": spec.env_cfg.id,
    "env_args": spec.env_cfg.env_args, "episodes_type": type(spec.episodes).__name__, "episodes": spec.episodes,
    "array_specs": [[type(a).__name__, a.name, list(a.shape), type(a.shape).__name__, a.dtype]
                    for a in spec.array_specs],
    "sys_path": sys.path, "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
    "parent_gone": parent_gone(), "threads": {name: os.environ.get(name) for name in SINGLE_THREAD_VARS},
}
os.write(spec.reply_fd, json.dumps(report).encode())
"""

# A child that says it is ready, then waits for one byte on its command pipe and exits with that byte as
# its exit code; it ignores SIGTERM, and with an empty command it sleeps on.
_WAITING_CHILD = """
import os, signal, time
from conveyor.procs import child_prologue
spec = child_prologue()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.write(spec["ready_fd"], b"r")
os.close(spec["ready_fd"])
command = os.read(spec["command_fd"], 1)
if not command:
    time.sleep(600)
raise SystemExit(command[0])
"""


def read_until_eof(fd: int) -> bytes:
    """Everything written to the pipe ``fd`` until every writer has closed it."""
    data = b""
    while True:
        if not select.select([fd], [], [], PATIENCE_S)[0]:
            pytest.fail(f"no word from the child within {PATIENCE_S:.0f} s")
        chunk = os.read(fd, 65536)
        if not chunk:
            os.close(fd)
            return data
        data += chunk


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``Z``: a zombie), or ``gone``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def start_waiting_child() -> tuple[subprocess.Popen, int]:
    """A ``_WAITING_CHILD`` that has started (it said so); returns it and the write end of its command pipe."""
    ready_read, ready_write = os.pipe()
    command_read, command_write = os.pipe()
    process = procs.start_child(_WAITING_CHILD, {"ready_fd": ready_write, "command_fd": command_read},
                                (ready_write, command_read))
    os.close(ready_write)
    os.close(command_read)
    assert read_until_eof(ready_read) == b"r"
    return process, command_write


def test_a_child_gets_its_spec_as_json_with_the_parents_sys_path_and_ignores_ctrl_c(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(tmp_path))  # an env module's directory, say: the child must see it too
    reply_read, reply_write = os.pipe()
    cfg = EnvCfg(id="CartPole-v1", num_envs=4, num_workers=2, env_args=(("max_episode_steps", 50),))
    arrays = (ArraySpec("obs", (4, 3), np.dtype("float32").str), ArraySpec("reward", (4,), "float32"))
    spec = WorkerSpec(1, cfg, 7, 0.99, 2, 2, (5, 6), (), arrays, -1, -1, reply_write)
    process = procs.start_child(_REPORTING_CHILD, spec, (reply_write,))
    os.close(reply_write)
    report = json.loads(read_until_eof(reply_read))
    assert process.wait() == 0
    assert report["index"] == 1 and report["env_cfg"] == "EnvCfg" and report["env_id"] == "CartPole-v1"
    assert report["env_args"] == [["max_episode_steps", 50]]  # rebuilt as tuples: EnvCfg accepted them
    assert report["episodes_type"] == "tuple" and report["episodes"] == [5, 6]
    assert report["array_specs"] == [["ArraySpec", "obs", [4, 3], "tuple", "<f4"],
                                     ["ArraySpec", "reward", [4], "tuple", "float32"]]
    assert report["sys_path"][0] == str(tmp_path)
    assert report["sigint_ignored"] and not report["parent_gone"]
    assert report["threads"] == {name: os.environ.get(name, "1") for name in procs.SINGLE_THREAD_VARS}


def test_exit_reasons_name_the_signal_or_the_code():
    process, command_write = start_waiting_child()
    process.kill()
    process.wait()
    os.close(command_write)
    assert procs.exit_reason(process.returncode) == "killed by signal SIGKILL"
    assert procs.exit_reason(3) == "exit code 3"
    assert procs.exit_reason(None) == "still running"
    assert procs.exit_reason(-(signal.SIGRTMIN + 6)) == f"killed by signal {signal.SIGRTMIN + 6}"  # no name


def test_close_children_says_farewell_and_reaps_the_child_that_obeys():
    process, command_write = start_waiting_child()
    procs.close_children([process], [command_write], b"\x07")
    assert process.returncode == 7  # it read the farewell and exited by itself
    with pytest.raises(OSError):
        os.write(command_write, b"x")  # the command pipe is closed


def test_reap_kills_a_child_that_outlives_the_grace_period(monkeypatch):
    monkeypatch.setattr(procs, "CLOSE_GRACE_S", 0.2)
    process, command_write = start_waiting_child()  # it ignores SIGTERM and sleeps on without a command
    procs.terminate([process])
    procs.close_children([process], [command_write])
    assert process.returncode == -signal.SIGKILL
    assert procs.exit_reason(process.returncode) == "killed by signal SIGKILL"


@pytest.mark.parametrize("stuck", ["time.sleep(600)", "while True: pass",
                                   "os.kill(os.getpid(), signal.SIGSTOP)"])
def test_a_child_dies_with_its_parent_even_stuck_where_it_cannot_look(stuck):
    """A child starts a grandchild that arms its parent-death signal, says so, and gets stuck (in a C call, in
    Python code, stopped); the child exits. The grandchild must die: the pipe it holds reaches end of file."""
    grandchild = ("import os, signal, time\nfrom conveyor.procs import child_prologue\nspec = child_prologue()\n"
                  "os.write(spec['fd'], str(os.getpid()).encode())\nos.write(spec['ready'], b'r')\n"
                  f"{stuck}\n")
    child = ("import os\nfrom conveyor.procs import child_prologue, start_child\nspec = child_prologue()\n"
             "ready_read, ready_write = os.pipe()\n"
             f"start_child({grandchild!r}, {{'fd': spec['fd'], 'ready': ready_write}}, (spec['fd'], ready_write))\n"
             "os.close(ready_write)\nos.read(ready_read, 1)\n")
    news_read, news_write = os.pipe()
    process = procs.start_child(child, {"fd": news_write}, (news_write,))
    os.close(news_write)
    assert process.wait() == 0
    grandchild_pid = int(read_until_eof(news_read))  # end of file: the grandchild is exiting
    deadline = time.monotonic() + PATIENCE_S
    while process_state(grandchild_pid) not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_state(grandchild_pid) in ("gone", "Z")  # reaped, or dead and waiting for its reaper
    assert not procs.parent_gone()  # this process is no child started by start_child


def test_the_restart_budget_counts_restarts_then_stops_with_one_line(capsys):
    budget = procs.RestartBudget(2)
    death = "env worker 1 (pid 4242, envs 2-3) died (killed by signal SIGKILL)"
    budget.spend(death)
    budget.spend(death)
    assert budget.restarts == 2
    said = capsys.readouterr().err.splitlines()
    assert said == [f"conveyor: {death}; restarting it (1 of at most 2 restarts)",
                    f"conveyor: {death}; restarting it (2 of at most 2 restarts)"]
    with pytest.raises(WorkerFailure) as failure:
        budget.spend(death)
    assert str(failure.value) == (f"{death}; the run's 2 restarts reach max_restarts=2: raise --max-restarts or "
                                  "fix what kills it")
    assert budget.restarts == 2
    with pytest.raises(WorkerFailure, match=r"^agent 0 \(pid 1\) died \(exit code 1\); restarts are off "
                                            r"\(max_restarts=0\): raise --max-restarts or fix what kills it$"):
        procs.RestartBudget(0).spend("agent 0 (pid 1) died (exit code 1)")


@pytest.mark.parametrize("entry", [vector._WORKER_ENTRY, agents._AGENT_ENTRY, state_buffer._ENTRY])
def test_children_that_only_step_envs_start_without_importing_torch(entry):
    """Env workers, GA3C's agents and HTS's executors never run a network: torch's import would cost each
    a second and a half of CPU at start (eight agents: seconds before a CartPole run's first step)."""
    imports = entry.split(";")[0]
    probe = subprocess.run([sys.executable, "-c", f"import sys; {imports}; print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=PATIENCE_S)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "False", f"{imports} imports torch"


def test_a_relayed_signal_runs_its_callback_off_the_main_thread_even_while_the_main_thread_holds_its_lock():
    """``SignalRelay``: stop code that takes a lock the main thread holds when the signal lands (an Event's, grpc's)
    completes once the main thread lets go, where a handler in the main thread would wait for ever."""
    import threading

    lock, called = threading.Lock(), []
    done = threading.Event()

    def on_signal(signum: int) -> None:
        with lock:
            called.append((signum, threading.current_thread() is threading.main_thread()))
        done.set()

    previous = signal.getsignal(signal.SIGUSR1)
    relay = procs.SignalRelay([signal.SIGUSR1], on_signal)
    try:
        with lock:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.01)  # bytecodes run: the Python-level handler has its chance to run in here
            assert not called
        assert done.wait(30), "the relay never called back"
        assert called == [(signal.SIGUSR1, False)]
    finally:
        relay.close()
    assert signal.getsignal(signal.SIGUSR1) is previous
    assert signal.set_wakeup_fd(-1) == -1  # close() gave back the previous (no) wakeup fd
