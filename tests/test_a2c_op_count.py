"""benchmarks/a2c_op_count.py: the work of an A2C loop per env step, counted (torch ops, Python calls)."""

from __future__ import annotations

import threading

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tests.benchmark_scripts import load_benchmark_script


def test_top_level_ops_count_calls_from_python_and_autograd_on_one_thread_only():
    op_count = load_benchmark_script("a2c_op_count")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x = torch.randn(16, 4)
    other = threading.Thread(target=lambda: [torch.sigmoid(x) for _ in range(3)])
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        with record_function(op_count.MARKER):
            torch.empty(0)
        model(x).sum().backward()
        other.start()
        other.join()
    events = profiler.events()
    thread = next(event.thread for event in events if event.name == op_count.MARKER)
    ops = op_count.top_level_ops(events, thread)
    # each linear once, not the t/addmm it runs; the backward's ops (autograd's engine runs them on this thread)
    assert ops["aten::linear"] == 2 and ops["aten::tanh"] == 1 and ops["aten::sum"] >= 1
    assert ops["aten::tanh_backward"] == 1 and ops["aten::mm"] >= 2
    assert "aten::addmm" not in ops and "aten::sigmoid" not in ops  # nested; the other thread's


def test_per_step_is_the_difference_over_the_extra_steps_of_all_envs():
    op_count = load_benchmark_script("a2c_op_count")
    small = {"ops": {"aten::linear": 100, "aten::tanh": 40}, "python_calls": 1_000, "c_calls": 500}
    large = {"ops": {"aten::linear": 260, "aten::tanh": 40, "aten::mm": 8}, "python_calls": 1_800, "c_calls": 900}
    # 1,280 more env steps of 16 envs: 80 steps of all of them
    counts = op_count.per_step(small, large, 1_280)
    assert counts["torch_ops"] == 2.1 and counts["python_calls"] == 10.0 and counts["c_calls"] == 5.0
    assert counts["top_ops"] == {"aten::linear": 2.0, "aten::mm": 0.1, "aten::tanh": 0.0}


def test_the_minimal_loop_is_counted_on_its_thread():
    op_count = load_benchmark_script("a2c_op_count")
    counts = op_count.count("minimal", 80)
    assert counts["ops"]["aten::linear"] >= 5 * 4  # 5 acting forwards of a 3-linear body and 2 heads, at least
    assert counts["python_calls"] > 0 and counts["c_calls"] > 0
