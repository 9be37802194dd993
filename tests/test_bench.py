"""multipath-bench (multipath_nmt.benchmark) at a tiny size: every report is written and the
figures are consistent; and its pieces one by one."""
import json
import sys

import pytest
from conftest import clean_env
from helpers import in_process
from multipath_nmt.cli import bench as bench_cli
from helpers.processes import run_subprocess

from multipath_nmt import recipe

# Host syncs of one micro-batch at the tiny size (2 layers), padded or not: fairseq's own reads of
# the padding mask, L + 1 for L layers in fairseq's encoder loop (BENCHMARKS.md); the plug-in makes
# none (WideNet's shared encoder is its own loop: 2). Exact, so that a new sync fails here.
HOST_SYNCS = {
    "stock prenorm L": 3, "stock deep 4L": 9, "multi-path L x 4 (full)": 3,
    "multi-path L x 4 (+cheap features)": 3, "multi-path L x 4 (loop reference)": 3,
    "multi-path L x 4 (plain)": 3, "multi-path 2L x 2 (full)": 5,
    "WideNet (shared attn + MoE E4 k2)": 2, "dense, FFN x2 (WideNet's active FLOPs)": 3,
    "EWA (E4, every-2)": 3, "ParameterNet (routed, both)": 3, "ParameterNet (dynamic, both)": 3,
}


@pytest.mark.slow
def test_bench_compiled_times_eager_and_compiled_side_by_side(tmp_path):
    """--compiled: each system's eager and --compile-layers trainers timed in one run, the
    ratio per repeat, the compile time apart; compiled.json and compiled.md written."""
    systems = ["stock prenorm L", "multi-path L x 4 (full)"]
    proc = in_process.call(bench_cli.main, ["--size", "tiny", "--compiled", "aot_eager", "--out",
                                            tmp_path, "--only", *systems])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    result = json.loads((tmp_path / "compiled.json").read_text())
    assert list(result["compiled"]) == systems and result["backend"] == "aot_eager"
    for name, row in result["compiled"].items():
        assert "error" not in row, row
        assert row["compile_s"] > 0
        assert len(row["ratio"]["values"]) == 2  # the tiny size's repeats
        for ratio, eager, compiled in zip(row["ratio"]["values"],
                                          row["eager_tokens_per_s"]["values"],
                                          row["compiled_tokens_per_s"]["values"]):
            assert ratio == pytest.approx(compiled / eager)
        assert f"| {name} |" in out
    assert (tmp_path / "compiled.md").read_text().strip() in out.strip()


@pytest.mark.slow
def test_bench_tiny_writes_consistent_reports(tmp_path):
    # "+cheap features" is judged against the plain system, which --only leaves out here
    systems = ["stock prenorm L", "stock deep 4L", "multi-path L x 4 (full)",
               "multi-path L x 4 (+cheap features)"]
    proc = in_process.call(bench_cli.main, ["--size", "tiny", "--no-memory", "--out", tmp_path,
                                            "--only", *systems])
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "bench.json").read_text())
    assert list(result["systems"]) == systems
    peak = result["matmul_peak_flops"]
    for name, row in result["systems"].items():
        rate = row["tokens_per_s"]
        assert rate["min"] <= rate["median"] <= rate["max"]
        assert row["mfu"] == pytest.approx(row["train_flops_per_token"] * rate["median"] / peak)
        assert row["steps_per_measurement"] == 1  # the tiny size sets no minimum time
        # the step splits into the task's forward + backward and the update, repeat by repeat
        tokens = 8 * 12  # the tiny size's batch x length
        for forward_backward, update, rate in zip(row["forward_backward_s"]["values"],
                                                  row["update_s"]["values"], rate["values"]):
            assert 0 < forward_backward < tokens / rate
            assert update == pytest.approx(tokens / rate - forward_backward)
        assert isinstance(row["host_syncs"], int) and row["host_syncs"] == HOST_SYNCS[name]
        assert sum(row["host_syncs_by_op"].values()) == row["host_syncs"]
        assert row["saved_for_backward_mib"] > 0
    deep, multipath = result["systems"]["stock deep 4L"], result["systems"]["multi-path L x 4 (full)"]
    # Same parameter budget: 4 paths x L layers vs 4L layers (PathNorm and weights are tiny).
    assert multipath["params"] == pytest.approx(deep["params"], rel=0.02)
    assert set(result["layers"]["paths"]) == {"2", "4", "8"}
    routed = result["layers"]["parameternet_routed_ffn"]
    assert (routed["tokens"], routed["slots"]) == (96, 4 * 29)  # 4 x ceil(1.2 * 96 / 4)
    targets = {row["target"] for row in result["targets"]}
    assert {1, 3, 4, 5, 6} <= targets  # target 2 needs the plain system, not measured here
    markdown = (tmp_path / "bench.md").read_text()
    assert "| 1. multi-path L x 4 tokens/s vs deep 4L" in markdown
    assert "| step ms: fwd+bwd + update | host syncs per micro-batch | saved for backward MiB |" \
        in markdown
    assert "ParameterNet routed FFN (both projections, E 4, C 1.2): " in markdown
    cheap_row = next(line for line in markdown.splitlines()
                     if "| multi-path L x 4 (+cheap features) |" in line)
    assert cheap_row.split("|")[7].strip() == ""  # its "vs" cell: the plain system was not run
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_every_system_reports_host_syncs_and_saved_bytes_of_one_micro_batch():
    """multipath-bench's per-system host-sync count (``HostSyncCounter`` over the task's
    train_step: forward, criterion, backward) and saved-for-backward bytes, at the tiny size."""
    from multipath_nmt.benchmark.batches import fake_data_dir, synthetic_batch
    from multipath_nmt.benchmark.micro_batch import micro_batch_profile
    from multipath_nmt.benchmark.systems import SIZES, build_trainer, fairseq_flags, systems_for
    from multipath_nmt.modules.moe import pop_all_routing_stats

    size = SIZES["tiny"]
    profiles = {}
    with fake_data_dir(size["vocab"]) as data:
        for system in systems_for(size):
            trainer, task = build_trainer(data, fairseq_flags(size, system), "cpu", False,
                                          system.loop_reference)
            sample = synthetic_batch(size, len(task.source_dictionary))
            profiles[system.name] = micro_batch_profile(trainer, sample)
            # the extra pass leaves no gradients and no routing statistics behind
            assert all(p.grad is None for p in trainer.model.parameters())
            assert pop_all_routing_stats(trainer.model) == []
    assert set(profiles) == set(HOST_SYNCS)  # a new system gets its expected count above
    for name, profile in profiles.items():
        assert isinstance(profile["host_syncs"], int), name
        assert profile["host_syncs"] == HOST_SYNCS[name], name
        assert sum(profile["host_syncs_by_op"].values()) == profile["host_syncs"], name
        assert sum(profile["host_syncs_by_site"].values()) == profile["host_syncs"], name
    saved = {name: profile["saved_for_backward_mib"] for name, profile in profiles.items()}
    # four times the encoder layers keep more activations for the backward
    assert saved["stock deep 4L"] > 1.5 * saved["stock prenorm L"] > 0


def test_fast_systems_are_timed_over_as_long_a_window_as_slow_ones():
    from multipath_nmt.benchmark.timing import steps_per_measurement

    size = dict(steps=3, measure_seconds=6.0)  # as the default size
    assert steps_per_measurement(size, 2.5) == 3  # 7.5 s: the minimum number of steps
    assert steps_per_measurement(size, 0.85) == 8  # 6.8 s, where 3 steps were 2.55 s
    assert steps_per_measurement(size, 2.0) == 3
    assert steps_per_measurement(dict(steps=1, measure_seconds=0.0), 0.01) == 1  # as tiny


def test_bench_refuses_fp16_on_cpu_and_unknown_systems(tmp_path):
    proc = in_process.call(bench_cli.main, ["--fp16"])
    assert proc.returncode == 2 and "--fp16 needs --device cuda" in proc.stderr
    proc = in_process.call(bench_cli.main, ["--only", "nope"])
    assert proc.returncode == 2 and "unknown system(s) ['nope']" in proc.stderr


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_bench_trains_in_train_shs_precision(precision, monkeypatch):
    """--precision adds the recipe's flags to every system (bf16 and fp16 are autocast over
    fp32 weights, --amp, as train.sh trains), not fairseq's all-fp16 --fp16."""
    from multipath_nmt import recipe
    from multipath_nmt.benchmark import harness

    built = []

    def build_trainer(data, flags, device, fp16, loop_reference=False):
        built.append((flags, fp16))
        raise RuntimeError("stop here")

    monkeypatch.setattr(harness, "build_trainer", build_trainer)
    monkeypatch.setattr(harness, "layer_benchmarks", lambda *args, **kwargs: {})
    monkeypatch.setattr(harness, "matmul_peak_flops", lambda *args: 1.0)  # fp16 is slow on CPUs
    result = harness.run("tiny", "cpu", precision, only=["stock prenorm L"], padded=True,
                         log=lambda message: None)
    assert result["systems"]["stock prenorm L"]["error"] == "RuntimeError: stop here"
    [(flags, fp16)] = built
    expected = recipe.PRECISIONS[precision]
    assert flags[len(flags) - len(expected):] == expected  # last: they win
    assert not fp16 and "--fp16" not in flags


@pytest.mark.slow
def test_a_failing_system_is_reported_and_the_others_measured(tmp_path, monkeypatch):
    """EWA crashed on CUDA (its token groups were made on the CPU): multipath-bench --device cuda
    lost its whole report. A system that fails to build, train or have its memory probed is now a
    row that says so."""
    from multipath_nmt import benchmark
    from multipath_nmt.benchmark import harness

    real_build, real_probe = harness.build_trainer, harness.peak_memory_of_step

    def build_trainer(data, flags, *args):
        if "--arch" in flags and "ewa_transformer_wmt_en_de" in flags:
            raise RuntimeError("Expected all tensors to be on the same device\nbut found cpu")
        return real_build(data, flags, *args)

    def peak_memory_of_step(flags, *args):
        if "--parameternet-mode=dynamic" in flags:
            raise RuntimeError("memory probe failed:\nKilled")
        return real_probe(flags, *args)

    monkeypatch.setattr(harness, "build_trainer", build_trainer)
    monkeypatch.setattr(harness, "peak_memory_of_step", peak_memory_of_step)
    systems = ["stock prenorm L", "EWA (E4, every-2)", "ParameterNet (dynamic, both)"]
    result = benchmark.write_reports(
        benchmark.run("tiny", "cpu", only=systems, log=lambda message: None), tmp_path)
    rows = result["systems"]
    assert rows["EWA (E4, every-2)"]["error"] == "RuntimeError: but found cpu"
    assert rows["ParameterNet (dynamic, both)"]["peak_memory_error"] == "RuntimeError: Killed"
    assert rows["ParameterNet (dynamic, both)"]["tokens_per_s"]["median"] > 0
    assert rows["stock prenorm L"]["peak_memory_mib"] > 0
    report = (tmp_path / "bench.md").read_text()
    assert "| MoE | EWA (E4, every-2) | **failed: RuntimeError: but found cpu** |" in report
    assert "| **probe failed** |" in report


def test_bench_precision_defaults_to_train_shs():
    """Like train.sh, --precision auto unless asked: bf16 on a GPU with bfloat16 (the first
    GPU run, which called multipath-bench --device cuda directly, timed fp32 under the old
    fp32 default)."""
    from multipath_nmt import recipe
    from multipath_nmt.cli.bench import build_parser

    args = build_parser().parse_args(["--device", "cuda"])
    assert args.precision == "auto"
    assert recipe.choose_precision(args.precision, gpus=1, bf16=True) == "bf16"
    assert recipe.choose_precision(args.precision, gpus=0) == "fp32"


def test_bench_precision_flags_are_checked_before_anything_runs():
    proc = in_process.call(bench_cli.main, ["--precision", "fp16"])
    assert proc.returncode == 2 and "--precision fp16 needs --device cuda" in proc.stderr
    proc = in_process.call(bench_cli.main, ["--fp16", "--precision", "bf16"])
    assert proc.returncode == 2 and "--fp16 and --precision bf16 contradict" in proc.stderr


def test_bench_refuses_cuda_without_a_gpu_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = in_process.call(bench_cli.main, ["--device", "cuda"])
    ours = [line for line in proc.stderr.splitlines() if not line.startswith("INFO:fairseq")]
    assert proc.returncode == 1 and ours == [
        f"multipath-bench: --device cuda: {recipe.no_cuda_device()}"]


def test_measurements_cycle_over_the_batches_from_the_first():
    from multipath_nmt.benchmark.timing import tokens_of_steps

    batches = [{"ntokens": 3}, {"ntokens": 5}, {"ntokens": 7}]
    assert [tokens_of_steps(batches, steps) for steps in (1, 3, 4, 7)] == [3, 15, 18, 33]


@pytest.mark.slow
def test_bench_padded_mode_runs_on_the_cpu(tmp_path):
    """The CUDA mode's batches (padded, length-varied, fairseq's batching) and peak (the models'
    own matrix products), on the CPU at the tiny size."""
    from multipath_nmt import benchmark

    systems = ["stock prenorm L", "WideNet (shared attn + MoE E4 k2)"]
    result = benchmark.run("tiny", "cpu", only=systems, memory=False, padded=True,
                           log=lambda message: None)
    result = benchmark.write_reports(result, tmp_path)
    assert result["batches"] == "8 padded, length-varied batches of up to 96 tokens"
    assert result["peak"] == "the best of the models' own matrix products"
    assert result["matmul_peak_flops"] > 0
    for name, row in result["systems"].items():
        steps = row["steps_per_measurement"]
        assert steps == 1
        assert 0 < row["train_flops_per_token"]
        assert isinstance(row["host_syncs"], int) and row["host_syncs"] == HOST_SYNCS[name]
        assert 0 < row["tokens_per_step"] < 96  # the first batch's real tokens, not its padding
        for forward_backward, update, rate in zip(row["forward_backward_s"]["values"],
                                                  row["update_s"]["values"],
                                                  row["tokens_per_s"]["values"]):
            assert forward_backward + update == pytest.approx(row["tokens_per_step"] / rate)
    assert "training on 8 padded, length-varied batches of up to 96 tokens" in (
        tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("name,layer", [("ParameterNet (routed, both)", "RoutedLinear"),
                                        ("ParameterNet (dynamic, both)", "DynamicLinear")])
def test_parameternet_systems_build_the_mode_their_name_says(name, layer):
    from multipath_nmt.benchmark.batches import fake_data_dir
    from multipath_nmt.benchmark.systems import SIZES, build_trainer, fairseq_flags, systems_for

    size = SIZES["tiny"]
    system = next(s for s in systems_for(size) if s.name == name)
    with fake_data_dir(size["vocab"]) as data:
        trainer, _ = build_trainer(data, fairseq_flags(size, system), "cpu", False)
    kinds = {type(m).__name__ for m in trainer.model.encoder.modules()}
    assert layer in kinds and not {"RoutedLinear", "DynamicLinear"} - {layer} & kinds


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
@pytest.mark.process  # fresh interpreters: this process's heap is the suite's
def test_keep_freed_memory_stops_page_faulting_large_tensors_in_anew():
    """A 64 MiB tensor freed and allocated again costs a fresh mmap and ~16k minor page faults
    every time with glibc's defaults; once freed memory stays in the heap, ten allocations fault
    in no more than one allocation's pages (the heap grows once, then is reused)."""
    probe = (
        "import resource, sys, torch\n"
        "from multipath_nmt.benchmark.memory import keep_freed_memory\n"
        "if sys.argv[1] == 'keep': assert keep_freed_memory()\n"
        "torch.ones(16 << 20)\n"  # first allocation: always faults in
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(10): torch.ones(16 << 20)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")
    # fresh interpreters: this process's heap and mmap threshold are the suite's
    faults = {mode: int(run_subprocess([sys.executable, "-c", probe, mode], clean_env()).stdout.split()[-1])
              for mode in ("default", "keep")}
    pages = (64 << 20) // 4096
    assert faults["default"] >= 9 * pages
    assert faults["keep"] <= pages + 64


def test_loop_reference_system_is_the_same_model_with_reference_layers():
    """The whole-model target-3 comparison is fair only if both systems compute the same
    function: same loss and same gradients, through the loop-over-modules layers."""
    import copy

    import torch

    from multipath_nmt.benchmark.batches import fake_data_dir, synthetic_batch
    from multipath_nmt.benchmark.systems import (
        SIZES,
        build_trainer,
        fairseq_flags,
        systems_for,
        use_loop_reference,
    )
    from multipath_nmt.testing.multipath_reference import ReferenceMultiPathEncoderLayer

    size = SIZES["tiny"]
    system = next(s for s in systems_for(size) if s.name == "multi-path L x 4 (loop reference)")
    assert system.loop_reference and system.compare_to == "multi-path L x 4 (full)"
    with fake_data_dir(size["vocab"]) as data:
        trainer, task = build_trainer(data, fairseq_flags(size, system), "cpu", False)
    batched = trainer.model.eval()
    reference = copy.deepcopy(batched)
    use_loop_reference(reference, trainer.cfg.model)
    reference.eval()  # the new layers start in training mode, as modules do
    assert all(isinstance(layer, ReferenceMultiPathEncoderLayer)
               for layer in reference.encoder.layers)
    sample = synthetic_batch(size, len(task.source_dictionary))
    losses = []
    for model in (batched, reference):
        loss, _, _ = trainer.criterion(model, sample)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for layer, ref_layer in zip(batched.encoder.layers, reference.encoder.layers):
        grads = ref_layer.batched_gradients()
        for name, param in layer.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-5)


def test_gemm_shapes_records_every_product_of_forward_and_backward():
    import torch

    from multipath_nmt.benchmark.flops import GemmShapes

    linear = torch.nn.Linear(8, 16)
    x = torch.randn(5, 8, requires_grad=True)
    y = torch.randn(3, 4, 6)
    with GemmShapes() as shapes:
        linear(x).sum().backward()
        torch.bmm(y, torch.randn(3, 6, 2))
    assert shapes.counts == {(1, 5, 8, 16): 1,  # forward: addmm
                             (1, 5, 16, 8): 1,  # gradient of x: grad_out @ W
                             (1, 16, 5, 8): 1,  # gradient of W: grad_out^T @ x
                             (3, 4, 6, 2): 1}


def test_gemm_peak_is_the_best_rate_over_the_models_own_shapes(monkeypatch):
    import torch

    from multipath_nmt.benchmark import flops

    timed = []

    def one_second(fn, repeats, device):
        fn()
        timed.append(repeats)
        return 1.0

    monkeypatch.setattr(flops, "elapsed_seconds", one_second)
    peak, shape = flops.gemm_peak_flops([(1, 4, 8, 16), (2, 4, 8, 4)], "cpu", torch.float32,
                                        repeats=3)
    assert timed == [3, 3]
    assert (peak, shape) == (2 * 4 * 8 * 16 * 3, (1, 4, 8, 16))  # 2 FLOPs per multiply-add
