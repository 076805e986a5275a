"""benchmarks/profile_race.py: a race contender's CPU profile under py-spy, summarized as a small text file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "profile_race.py"
MAIN = 'process 7:"/v/bin/python -m conveyor train --arch paac --algo a2c --env CartPole-v1 --out /t/run"'
# a child's stack starts with its parent's process frame; its command line holds ';' (python -c "...; main()")
WORKER = MAIN + ';process 9:"/v/bin/python -c import sys; main()"'
RAW = "\n".join([
    f"{MAIN};<module> (conveyor/__main__.py:3);train (conveyor/api.py:40);step (conveyor/envs/vector.py:10) 30",
    f"{MAIN};<module> (conveyor/__main__.py:3);train (conveyor/api.py:40);update (conveyor/learner.py:5) 50",
    f"{WORKER};<module> (<string>:1);main (conveyor/envs/shm_worker.py:70);step (minatar/environment.py:9) 16",
    f"{WORKER};<module> (<string>:1);_find_and_load (<frozen importlib._bootstrap>:1176) 4",
    'process 7:"" 0',  # py-spy could not read the command line, and the stack is empty
])


def test_stacks_are_counted_by_process_self_and_call_tree():
    profile = load_benchmark_script("profile_race")
    stacks = profile.parse_raw(RAW)
    assert [(root, pid, count) for root, pid, _, count in stacks] == [(7, 7, 30), (7, 7, 50), (7, 9, 16),
                                                                      (7, 9, 4), (7, 7, 0)]
    assert stacks[-1][2] == [] and stacks[2][2][0] == "<module> (<string>:1)"
    lines = [line.strip() for line in profile.summarize(stacks, rows=5)]
    assert lines[0] == "samples: 100"
    # the worker is named by where most of its stacks enter past the interpreter's start-up
    assert "80.0%  pid 7 main" in lines and "20.0%  pid 9 child: main (envs/shm_worker.py)" in lines
    # the main process: update 50 of its 80 samples, step 30; train is in every one of its stacks
    main_self = lines.index("main: functions by self samples, % of the process kind's 80:")
    assert lines[main_self + 1:main_self + 3] == ["62.5%  update (conveyor/learner.py)",
                                                  "37.5%  step (envs/vector.py)"]
    assert "100.0%  train (conveyor/api.py)" in lines
    assert "80.0%  step (minatar/environment.py)" in lines  # the worker's own table


def test_the_loop_is_counted_by_line_and_callee_in_the_main_process_only():
    profile = load_benchmark_script("profile_race")
    loop = "<module> (conveyor/__main__.py:3);run (conveyor/architectures/paac/run.py"
    raw = "\n".join([
        f"{MAIN};{loop}:147);update (conveyor/learner.py:177);backward (torch/_tensor.py:623) 6",
        f"{MAIN};{loop}:147);update (conveyor/learner.py:178) 2",
        f"{MAIN};{loop}:124);insert (conveyor/storage/rollout.py:54) 1",
        f"{MAIN};{loop}:130) 1",
        f"{MAIN};<module> (conveyor/__main__.py:3);_find_and_load (<frozen importlib._bootstrap>:1176) 5",
        f"{WORKER};{loop}:147);update (conveyor/learner.py:177) 9",  # not the main process: left out
    ])
    lines = [line.strip() for line in profile.loop_lines(profile.parse_raw(raw), "paac", rows=5)]
    assert lines[1] == "the loop (architectures/paac/run.py) by line and the function it calls, % of its 10 samples:"
    assert lines[2:] == ["80.0%  line 147: update (conveyor/learner.py)",
                         "10.0%  line 124: insert (storage/rollout.py)", "10.0%  line 130: (the line itself)"]
    assert profile.loop_lines(profile.parse_raw(raw), "seed", rows=5) == []


def test_a_stack_without_its_process_frame_is_refused():
    profile = load_benchmark_script("profile_race")
    with pytest.raises(ValueError, match="--subprocesses"):
        profile.parse_raw("<module> (x.py:1);f (x.py:2) 3")


def test_a_frame_name_that_holds_a_newline_continues_its_stack():
    """py-spy, sampling an import, can read a module's docstring as a function name: its lines are one stack."""
    profile = load_benchmark_script("profile_race")
    raw = 'process 7:"python x.py";<module> (x.py:1);Heads.\nThe second line. (heads.py:1) 2\nprocess 7:"python x.py";f (x.py:2) 3'
    stacks = profile.parse_raw(raw)
    assert [(root, pid, count) for root, pid, _, count in stacks] == [(7, 7, 2), (7, 7, 3)]
    assert stacks[0][2] == ["<module> (x.py:1)", "Heads. The second line. (heads.py:1)"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None,
                    reason="py-spy is not installed (make bench-deps)")
def test_a_short_cartpole_run_is_profiled_with_its_time_split(tmp_path):
    out = tmp_path / "profile.txt"
    done = subprocess.run([sys.executable, str(SCRIPT), "--arch", "paac", "--algo", "a2c", "--env", "CartPole-v1",
                           "--seconds", "5", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "time split (the run's own telemetry, wall-clock): env" in text
    assert " main\n" in text and "main: functions by self samples" in text
    assert "the loop (architectures/paac/run.py) by line" in text and "outside it" in text
