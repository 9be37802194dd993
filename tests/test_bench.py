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


@pytest.mark.parametrize("name,layer", [("ParameterNet (routed, both)", "RoutedLinear"),
                                        ("ParameterNet (dynamic, both)", "DynamicLinear")])
def test_parameternet_systems_build_the_mode_their_name_says(name, layer):
    from multipath_nmt import benchmark

    size = benchmark.SIZES["tiny"]
    system = next(s for s in benchmark.systems_for(size) if s.name == name)
    with benchmark.fake_data_dir(size["vocab"]) as data:
        trainer, _ = benchmark.build_trainer(data, benchmark.fairseq_flags(size, system), "cpu",
                                             False)
    kinds = {type(m).__name__ for m in trainer.model.encoder.modules()}
    assert layer in kinds and not {"RoutedLinear", "DynamicLinear"} - {layer} & kinds


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_keep_freed_memory_stops_page_faulting_large_tensors_in_anew():
    """A 64 MiB tensor freed and allocated again costs a fresh mmap and ~16k minor page faults
    every time with glibc's defaults; once freed memory stays in the heap, ten allocations fault
    in no more than one allocation's pages (the heap grows once, then is reused)."""
    probe = (
        "import resource, sys, torch\n"
        "from multipath_nmt.benchmark import keep_freed_memory\n"
        "if sys.argv[1] == 'keep': assert keep_freed_memory()\n"
        "torch.ones(16 << 20)\n"  # first allocation: always faults in
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(10): torch.ones(16 << 20)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")
    faults = {mode: int(run_cli([sys.executable, "-c", probe, mode]).stdout.split()[-1])
              for mode in ("default", "keep")}
    pages = (64 << 20) // 4096
    assert faults["default"] >= 9 * pages
    assert faults["keep"] <= pages + 64
