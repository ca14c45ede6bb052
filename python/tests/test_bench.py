"""The benchmark module runs end to end (tiny sizes): every path, every figure."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "save_load.py"

# Tiny sizes and one repetition: a run of every path whose figures are checked to be
# there, not compared, so it runs beside another test (not `serial`); the figures of
# docs/BENCHMARKS.md come from `python python/benchmarks/save_load.py` run alone.


def test_the_bench_reports_every_figure_for_the_three_paths(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--tensors",
            "3",
            "--rows",
            "96",
            "--cols",
            "64",
            "--reps",
            "1",
            "--small-tensors",
            "20",
            "--small-rows",
            "8",
            "--small-cols",
            "4",
            "--profile",
            "--dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, "\n".join(
        line for line in done.stderr.splitlines() if not line.startswith("W1")
    )[-6000:]
    report = json.loads(done.stdout)
    assert set(report["paths"]) == {"native", "plugin", "dcp"}
    for path, figures in report["paths"].items():
        for key in ("stall_s", "staged_s", "durable_s", "load_s", "reshard_load_s"):
            assert figures[key]["median"] > 0, (path, key)
        assert figures["peak_rss_mib"] >= figures["state_rss_mib"] > 0, path
    # Loads from local disk copy nothing on the ckpt paths.
    assert report["paths"]["native"]["load_copied_mib"]["max"] == 0
    assert report["paths"]["native"]["reshard_copied_mib"]["max"] == 0
    # --profile: where the stall went, the parts within the whole.
    for path in ("native", "plugin"):
        figures = report["paths"][path]
        parts = figures["stall_prepare_s"]["median"] + figures["stall_library_s"]["median"]
        assert 0 < parts <= figures["stall_s"]["max"] * 1.0001, (path, figures)
    assert report["paths"]["plugin"]["stall_dcp_own_s"]["median"] >= 0
    assert report["paths"]["plugin"]["durable_dcp_plan_s"]["median"] > 0
    assert report["paths"]["plugin"]["durable_wait_commit_s"]["median"] > 0
    assert 0 < report["paths"]["plugin"]["staged_copy_s"]["median"]
    plugin = report["paths"]["plugin"]
    assert 0 < plugin["load_read_data_s"]["median"] <= plugin["load_s"]["max"]
    assert "stall_prepare_s" not in report["paths"]["dcp"]
    assert report["memcpy_s"]["median"] > 0
    assert report["stall_alone_s"]["median"] > 0
    assert report["paths"]["native"]["raw_read_s"]["median"] > 0
    # The small-tensor state, every path.
    assert report["small"]["workload"]["tensors"] == 20
    for path, figures in report["small"]["paths"].items():
        for key in ("stall_s", "durable_s", "load_s"):
            assert figures[key]["median"] > 0, (path, key)
    assert set(report["small"]["paths"]) == {"native", "plugin", "dcp"}
    spec = importlib.util.spec_from_file_location("save_load", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    text = bench.render(report)
    assert "stall: preparing the save" in text and "Small tensors: 20" in text, text
