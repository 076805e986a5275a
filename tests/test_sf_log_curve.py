"""``benchmarks/sf_log_curve.py``: a Sample Factory log read back as a learning curve, on a hand-written log."""

from __future__ import annotations

import datetime
import json

from tests.benchmark_scripts import load_benchmark_script

sf_log_curve = load_benchmark_script("sf_log_curve")

# Sample Factory's own lines (colour codes included), a report every 10 s from 12:00:00, local time.
REPORTS = [("12:00:05", "nan", 0, None), ("12:00:15", "600.0", 4096, "-21.000"), ("12:00:25", "680.0", 8192, "-20.500"),
           ("12:05:15", "700.0", 200704, "-19.250"), ("12:05:25", "688.0", 204800, "-19.200")]


def sf_log() -> str:
    lines = []
    for clock, sps, frames, reward in REPORTS:
        lines.append(f"\x1b[36m[2026-12-04 {clock},735][25475] Fps is (10 sec: 819.2, 60 sec: 750.9, 300 sec: "
                     f"{sps}). Total num frames: {frames}. Throughput: 0: 177.1. Samples: 17408.\x1b[0m")
        if reward is not None:  # no episode has ended yet at the first report
            lines.append(f"\x1b[36m[2026-12-04 {clock},736][25475] Avg episode reward: [(0, '{reward}')]\x1b[0m")
        lines.append(f"[2026-12-04 {clock},739][25512] Saving checkpoint_000000272_{frames}.pth...")
    return "\n".join(lines) + "\n"


def test_the_curve_pairs_each_report_with_its_return_in_agent_steps_from_the_spawn(tmp_path, capsys):
    spawned = datetime.datetime.fromisoformat("2026-12-04 12:00:00").timestamp() - 5.0  # 5 s of start-up
    rows = sf_log_curve.curve(sf_log(), spawned, frameskip=4, every_s=300.0)
    # The first report without a return is left out; of the rest, the first of each 300 s and the last.
    assert rows == [{"wall_s": 20, "env_steps": 1024, "sps_300s": 150.0, "return_mean_last100": -21.0},
                    {"wall_s": 320, "env_steps": 50176, "sps_300s": 175.0, "return_mean_last100": -19.25},
                    {"wall_s": 330, "env_steps": 51200, "sps_300s": 172.0, "return_mean_last100": -19.2}]
    run = tmp_path / "run"
    run.mkdir()
    (run / "bench_spec.json").write_text(json.dumps({"spawned_unix": spawned}))
    (run / "bench.log").write_text(sf_log())
    assert sf_log_curve.main([str(run), "--every", "10"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "wall_s,env_steps,sps_300s,return_mean_last100" and len(out) == 1 + 4
    assert out[2] == "30,2048,170.0,-20.5"
