"""multipath-bench at a tiny size: every report is written and the figures are consistent."""
import json
import sys

import pytest

from conftest import run_cli


@pytest.mark.slow
def test_bench_tiny_writes_consistent_reports(tmp_path):
    systems = ["stock prenorm L", "stock deep 4L", "multi-path L x 4 (full)"]
    run_cli([sys.executable, "-m", "multipath_nmt.cli.bench", "--size", "tiny", "--no-memory",
             "--out", tmp_path, "--only", *systems])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert list(result["systems"]) == systems
    peak = result["matmul_peak_flops"]
    for name, row in result["systems"].items():
        rate = row["tokens_per_s"]
        assert rate["min"] <= rate["median"] <= rate["max"]
        assert row["mfu"] == pytest.approx(row["train_flops_per_token"] * rate["median"] / peak)
    deep, multipath = result["systems"]["stock deep 4L"], result["systems"]["multi-path L x 4 (full)"]
    # Same parameter budget: 4 paths x L layers vs 4L layers (PathNorm and weights are tiny).
    assert multipath["params"] == pytest.approx(deep["params"], rel=0.02)
    assert set(result["layers"]["paths"]) == {"2", "4", "8"}
    targets = {row["target"] for row in result["targets"]}
    assert {1, 3, 4, 5, 6} <= targets  # target 2 needs the plain system, not measured here
    markdown = (tmp_path / "bench.md").read_text()
    assert "| 1. multi-path L x 4 tokens/s vs deep 4L" in markdown
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_fp16_on_cpu_and_unknown_systems(tmp_path):
    proc = run_cli([sys.executable, "-m", "multipath_nmt.cli.bench", "--fp16"], check=False)
    assert proc.returncode == 2 and "--fp16 needs --device cuda" in proc.stderr
    proc = run_cli([sys.executable, "-m", "multipath_nmt.cli.bench", "--only", "nope"],
                   check=False)
    assert proc.returncode == 2 and "unknown system(s) ['nope']" in proc.stderr
