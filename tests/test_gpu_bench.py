"""scripts/gpu-bench.sh and its clock, on the CPU: whole updates timed in windows with one
synchronization each, the step split and the counters in passes of their own, the anchor run
without the plug-in's patches, and the report's form (``--device cpu --size tiny``)."""
import json
import subprocess

import pytest
import torch

from conftest import script_env
from multipath_nmt.benchmark import gpu_bench, timing
from multipath_nmt.benchmark.kernels import KernelLaunchCounter


class FakeEvent:
    """Stands in for ``torch.cuda.Event``: logs what the clock does with it."""
    log = []

    def __init__(self, enable_timing):
        assert enable_timing

    def record(self):
        self.log.append("record")

    def synchronize(self):
        self.log.append("event sync")

    def elapsed_time(self, other):
        return 250.0  # ms


def test_cuda_windows_synchronize_once_each_after_the_updates(monkeypatch):
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(timing, "synchronize", lambda device: FakeEvent.log.append("sync"))
    seconds = timing.time_update_windows(lambda: FakeEvent.log.append("update"), 3, 2, "cuda")
    assert seconds == [0.25, 0.25, 0.25]
    window = ["record", "update", "update", "record", "event sync"]
    assert FakeEvent.log == ["sync", *window * 3]


class FakeTask:
    def train_step(self, *args):
        FakeEvent.log.append("micro-batch")


class FakeTrainer:
    def __init__(self):
        self.task = FakeTask()


def test_step_split_synchronizes_only_in_its_own_pass(monkeypatch):
    FakeEvent.log = []
    monkeypatch.setattr(timing, "synchronize", lambda device: FakeEvent.log.append("sync"))
    trainer = FakeTrainer()
    split = timing.ForwardBackwardClock(trainer, "cuda")
    trainer.task.train_step()
    assert FakeEvent.log == ["micro-batch"] and split.seconds == 0.0
    split.active = True
    trainer.task.train_step()
    assert FakeEvent.log == ["micro-batch", "sync", "micro-batch", "sync"]


def test_kernel_counter_skips_views_and_allocations():
    x = torch.randn(4, 4)
    with KernelLaunchCounter() as kernels:
        y = x.t()  # a view
        z = y @ x  # mm
        z.view(16).sum()  # a view, then sum
        torch.empty(3)  # an allocation, no kernel
    assert kernels.total == 2
    assert dict(kernels.by_op) == {"mm": 1, "sum": 1}


def test_unknown_row_is_refused_in_one_line():
    from multipath_nmt.cli import gpu_bench as cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["--device", "cpu", "--size", "tiny", "--only", "nonsense"])
    assert str(stop.value).startswith("gpu-bench: unknown row(s) ['nonsense']; choose from ")


def test_rows_past_the_budget_are_reported_not_run():
    result = gpu_bench.run("tiny", "cpu", "fp32", only=[gpu_bench.ANCHOR], budget_s=0,
                           log=lambda m: None)
    assert result["rows"][gpu_bench.ANCHOR]["error"] == \
        "not run: the time budget of 0 s was spent"
    assert f"| {gpu_bench.ANCHOR} | fp32 | not run" in gpu_bench.markdown_report(result)


def test_the_rows_that_decide_the_targets_run_first():
    """A run cut short by its budget has answered the targets: the anchor at 4,096; base, Deep24
    and multi-path 6 x 4 at their one-card micro-batch; the anchor at base's; base at 4,096; the
    compiled rows at the one-card micro-batch; then the rest."""
    g = gpu_bench
    assert g.row_names(g.SIZES["gpu"]) == [
        g.ANCHOR, g.BASE + g.ONE_CARD, g.DEEP + g.ONE_CARD, g.MULTIPATH + g.ONE_CARD,
        g.ANCHOR + g.ONE_CARD, g.BASE, g.BASE + g.ONE_CARD + g.COMPILED,
        g.MULTIPATH + g.ONE_CARD + g.COMPILED, g.DEEP, g.MULTIPATH,
        "WideNet (shared attn + MoE E4 k2)", "EWA (E4, every-2)", "ParameterNet (routed, both)",
        "ParameterNet (dynamic, both)"]


def test_one_card_rows_decode_and_profile_and_the_compiled_rows_run_the_one_card_batch():
    from multipath_nmt.benchmark.batches import fake_data_dir

    g = gpu_bench
    size = g.SIZES["tiny"]
    with fake_data_dir(size["vocab"]) as data:
        specs = dict(g.rows(data, size, "cpu", "fp32", "aot_eager"))
    assert list(specs) == g.row_names(size)
    assert {n for n, s in specs.items() if s.get("beam")} == \
        {name + g.ONE_CARD for name in (g.BASE, g.DEEP, g.MULTIPATH)}
    assert {n for n, s in specs.items() if s.get("profile")} == \
        {g.BASE + g.ONE_CARD, g.MULTIPATH + g.ONE_CARD}
    for name in (g.BASE, g.MULTIPATH):
        compiled = specs[name + g.ONE_CARD + g.COMPILED]
        assert compiled["compiled"]
        assert compiled["argv"] == specs[name + g.ONE_CARD]["argv"] + \
            ["--compile-layers", "aot_eager"]


@pytest.mark.parametrize("rows, status", [
    ({"a": {}, "b": {}}, 0),
    ({"a": {}, "b": {"error": "not run: the time budget of 0 s was spent", "not_run": True}}, 4),
    ({"a": {"error": "did not finish in 120 s"}, "b": {}}, 3),
    ({"a": {"error": "RuntimeError: boom"}, "b": {"error": "not run: ...", "not_run": True}}, 3),
])
def test_a_budget_starved_run_exits_apart_from_a_crashed_row(rows, status):
    assert gpu_bench.exit_status({"rows": rows}) == status


def test_the_cli_exits_4_when_the_budget_left_rows_unstarted(tmp_path):
    from multipath_nmt.cli import gpu_bench as cli

    status = cli.main(["--device", "cpu", "--size", "tiny", "--only", gpu_bench.ANCHOR,
                       "--budget-s", "0", "--out", str(tmp_path)])
    assert status == gpu_bench.EXIT_NOT_RUN == 4
    row = json.loads((tmp_path / "gpu-bench.json").read_text())["rows"][gpu_bench.ANCHOR]
    assert row["not_run"] and row["error"].startswith("not run: ")
    # the loss check past 2^31 elements (at the tiny size: small) runs after the rows, always
    check = json.loads((tmp_path / "gpu-bench.json").read_text())["loss_past_int32"]
    assert check["relative_difference"] < 1e-6 and check["tokens"] == 256


def test_flops_are_counted_on_at_most_the_sizes_micro_batch():
    """The one-card micro-batch (65,520 tokens for Deep24 and multi-path) is not counted whole
    in fp32: the count runs on at most 4,096 tokens of the same sentence length."""
    gpu = gpu_bench.SIZES["gpu"]
    for max_tokens in (4096, 32760, 65520):
        shape = gpu_bench.flop_batch_shape(gpu, max_tokens)
        assert shape == {"batch": 4096 // 28, "length": 28}
        assert shape["batch"] * shape["length"] <= 4096
    assert gpu_bench.flop_batch_shape(gpu, 1000) == {"batch": 1000 // 28, "length": 28}


def test_a_rows_flops_per_token_are_those_of_its_whole_batch(monkeypatch):
    """measure_row counts on a batch of at most the size's micro-batch (here the tiny size's
    256 tokens, while the row trains 1,024-token micro-batches), and that count per token is
    the count per token of a batch of the row's micro-batch: FLOPs are linear in the number of
    sentences of one length."""
    from multipath_nmt.benchmark import flops as flop_counts
    from multipath_nmt.benchmark.batches import fake_data_dir, synthetic_batch
    from multipath_nmt.benchmark.systems import build_trainer_from_argv

    size = gpu_bench.SIZES["tiny"]
    counted = []

    class Counted(Exception):
        pass

    def count(trainer, sample):
        counted.append(sample["ntokens"])
        raise Counted

    monkeypatch.setattr(gpu_bench, "training_flops_per_token", count)
    with fake_data_dir(size["vocab"]) as data:
        argv = gpu_bench.anchor_argv(data, size, "cpu", max_tokens=1024, update_freq=1)
        with pytest.raises(Counted):
            gpu_bench.measure_row({"argv": argv}, size, "cpu")
        assert counted == [256 // 12 * 12]
        trainer, task = build_trainer_from_argv(argv)
        per_token = [flop_counts.training_flops_per_token(trainer, synthetic_batch(
            dict(batch=batch, length=size["mean_length"]), len(task.source_dictionary)))
            for batch in (1024 // 12, 256 // 12)]
    assert per_token[0] == pytest.approx(per_token[1], rel=1e-9)


def test_the_memory_figures_and_a_target_that_catches_a_wrong_model_before_an_oom(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2 ** 30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 4 * 2 ** 30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: {"num_alloc_retries": 2})
    figures = gpu_bench.cuda_memory_figures()
    assert figures == {"peak_memory_mib": 3072, "peak_reserved_mib": 4096, "alloc_retries": 2,
                       "ooms": 0}
    # 1.5x the estimate: the planner's half of the card still holds it, but the model is wrong
    row = dict(figures, planned_peak_mib=2048)
    met = {(text, needed): ok for text, _, needed, ok in gpu_bench.targets({"rows": {"r": row}})}
    assert met == {("r: peak MiB / the memory model's estimate", "<= 1.25"): False,
                   ("r: peak MiB / the memory model's estimate", ">= 0.5"): True,
                   ("r: the allocator's retries", "<= 0"): False}


def test_the_profile_names_what_limits_an_update():
    """The CPU dry run of the profile: a toy update with a matrix product, a log-softmax over a
    'vocabulary' and a scalar read; the summary's figures and categories, and its markdown."""
    from multipath_nmt.benchmark import profile

    weight = torch.randn(64, 500, requires_grad=True)
    x = torch.randn(128, 64)

    def update():
        loss = -torch.log_softmax(x @ weight, dim=-1)[:, 0].sum()
        loss.backward()
        loss.item()  # what fairseq's logging does

    summary = profile.profile_updates(update, 3, "cpu")
    json.dumps(summary)  # it goes into gpu-bench.json
    assert summary["updates"] == 3 and summary["wall_ms_per_update"] > 0
    assert summary["kernel_launches_per_update"] is None  # no CUDA kernels on the CPU
    assert summary["scalar_reads_per_update"] == 1
    assert {"matrix products", "loss over the vocabulary"} <= set(summary["shares"])
    assert sum(summary["shares"].values()) == pytest.approx(1.0)
    names = [t["name"] for t in summary["top"]]
    assert "aten::mm" in names and "aten::_log_softmax" in names
    assert profile.category("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn") == \
        "matrix products"
    assert profile.category("void cunn_SoftMaxForward<8, float, float, float>") == \
        "loss over the vocabulary"
    assert profile.category("void pytorch_flash::flash_fwd_kernel<>") == "attention"
    assert profile.category("void at::native::vectorized_elementwise_kernel<4>") == "elementwise"
    text = profile.markdown({"toy": summary, "failed": {"error": "RuntimeError: no CUPTI"}})
    assert "## toy" in text and "| loss over the vocabulary | " in text
    assert "## failed\n\nThe profile failed: RuntimeError: no CUPTI" in text


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bench")
    rows = [gpu_bench.ANCHOR, gpu_bench.BASE, gpu_bench.DEEP, gpu_bench.MULTIPATH,
            *(name + gpu_bench.ONE_CARD for name in (gpu_bench.BASE, gpu_bench.DEEP,
                                                     gpu_bench.MULTIPATH, gpu_bench.ANCHOR)),
            gpu_bench.BASE + gpu_bench.ONE_CARD + gpu_bench.COMPILED]
    finished = subprocess.run(
        ["bash", "scripts/gpu-bench.sh", "--device", "cpu", "--size", "tiny", "--out", str(out),
         "--commit", "0123abc", "--compile-backend", "aot_eager", "--only", *rows],
        capture_output=True, text=True, timeout=600,
        env=script_env())
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert (out / "profile.md").exists()
    return json.loads((out / "gpu-bench.json").read_text()), (out / "gpu-bench.md").read_text()


@pytest.mark.slow
def test_anchor_is_stock_fairseq_and_the_rows_train_sh_commands(tiny_bench):
    result, _ = tiny_bench
    rows = dict(result["rows"])  # popped below; the module's fixture is shared
    anchor = rows[gpu_bench.ANCHOR]
    assert anchor["command"].startswith("MULTIPATH_NMT_PATCHES=off fairseq-train ")
    assert "--user-dir" not in anchor["command"] and "--optimizer adam " in anchor["command"]
    assert anchor["patched_train_step"] == []  # no patch of the plug-in in its process
    compiled = rows.pop(gpu_bench.BASE + gpu_bench.ONE_CARD + gpu_bench.COMPILED)
    assert compiled["command"] == \
        rows[gpu_bench.BASE + gpu_bench.ONE_CARD]["command"] + " --compile-layers aot_eager"
    assert (compiled["max_tokens"], compiled["update_freq"]) == (1024, 1)
    for name in (gpu_bench.BASE, gpu_bench.DEEP, gpu_bench.MULTIPATH):
        assert "--optimizer adam_fused" in rows[name]["command"], name
        assert rows[name]["patched_train_step"], name
    # one card (the tiny size: 1,024 tokens per update on a 4 GB card): one micro-batch that
    # holds the whole update, for the anchor too; the other rows 2 of the size's 256 tokens
    one_card = {name: rows[name] for name in rows if name.endswith(gpu_bench.ONE_CARD)}
    for name in (gpu_bench.BASE, gpu_bench.DEEP, gpu_bench.MULTIPATH, gpu_bench.ANCHOR):
        card = rows.pop(name + gpu_bench.ONE_CARD)
        assert (card["max_tokens"], card["update_freq"]) == (1024, 1), name
        assert "--max-tokens 1024 --update-freq 1 " in card["command"], name
        assert card["command"].replace("--max-tokens 1024 --update-freq 1 ", "") == \
            rows[name]["command"].replace("--max-tokens 256 --update-freq 2 ", ""), name
        assert card["planned_peak_mib"] > rows[name]["planned_peak_mib"] > 0, name
    for name, row in one_card.items():
        phases = row["phases_s"]
        decodes = not name.startswith(gpu_bench.ANCHOR)
        profiled = name.startswith((gpu_bench.BASE, gpu_bench.MULTIPATH))
        assert list(phases)[-2:] == (["profile", "beam"] if profiled else
                                     ["syncs_and_launches", "beam"] if decodes else
                                     ["step_split", "syncs_and_launches"]), name
        assert ("profile" in row) == profiled, name
        if profiled:
            assert row["profile"]["updates"] == 3 and row["profile"]["top"], name
    for name, row in rows.items():
        assert (row["max_tokens"], row["update_freq"]) == (256, gpu_bench.UPDATE_FREQ), name
        assert len(row["tokens_per_s"]["values"]) == 3, name  # the tiny size's windows
        assert row["tokens_per_s"]["min"] <= row["tokens_per_s"]["median"] \
            <= row["tokens_per_s"]["max"]
        assert row["forward_backward_ms"] > 0 and row["update_ms"] > 0, name
        phases = row["phases_s"]  # where the row's process spent its time, in order
        assert list(phases) == ["process_start", "build", "flops", "first_update", "warmup",
                                "timed_windows", "step_split", "syncs_and_launches"], name
        assert all(s > 0 for s in phases.values()) and sum(phases.values()) < row["seconds"]
    assert {n for n, r in one_card.items() if "beam_sentences_per_s" in r} == \
        {name + gpu_bench.ONE_CARD for name in (gpu_bench.BASE, gpu_bench.DEEP,
                                                gpu_bench.MULTIPATH)}
    assert not any("beam_sentences_per_s" in r for r in rows.values())
    assert result["environment"]["commit"] == "0123abc"
    assert set(result["matmul_peak_flops"]) == {"fp32"}


@pytest.mark.slow
def test_cpu_proxies_point_where_the_targets_ask(tiny_bench):
    result, report = tiny_bench
    rows = result["rows"]
    # the multi-path model has a quarter of Deep's encoder layers: fewer kernels per update
    assert rows[gpu_bench.MULTIPATH]["kernel_launches_per_update"] < \
        rows[gpu_bench.DEEP]["kernel_launches_per_update"]
    # the plug-in adds no host sync to fairseq's on the models of the anchor's depth
    assert rows[gpu_bench.BASE]["host_syncs_per_update"] == \
        rows[gpu_bench.MULTIPATH]["host_syncs_per_update"] == \
        rows[gpu_bench.ANCHOR]["host_syncs_per_update"]
    table = [line for line in report.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| row | dtype | micro-batch x update-freq | tokens/s median "
                               "[min-max] | vs anchor | MFU |")
    assert gpu_bench.MFU_NOTE in report
    one_card = gpu_bench.BASE + gpu_bench.ONE_CARD
    assert f"| {one_card} | fp32 | 1,024 x 1 | " in report
    assert f"| {one_card} tokens/s vs the anchor | " in report and "| >= 3.0 |" in report
    assert f"| {one_card}: MFU | " in report
    assert f"| {gpu_bench.MULTIPATH} vs {gpu_bench.DEEP}, training tokens/s |" in report
    assert f"| kernel launches per update, {gpu_bench.MULTIPATH} vs {gpu_bench.DEEP} |" in report
    assert "| row | process_start | build | flops | first_update | warmup | timed_windows |" \
        in report
    # every row's phases, though the first row (the anchor) neither profiles nor decodes
    assert "| syncs_and_launches | profile | beam | row total |" in report
    # a compiled row reports no counts: the counters would have seen its eager layers
    compiled_name = gpu_bench.BASE + gpu_bench.ONE_CARD + gpu_bench.COMPILED
    compiled = rows[compiled_name]
    assert "kernel_launches_per_update" not in compiled and "host_syncs_per_update" not in compiled
    assert compiled["counters"] == gpu_bench.COUNTERS_SKIPPED
    line = next(printed for printed in report.splitlines()
                if printed.startswith(f"| {compiled_name} |"))
    assert line.split(" | ")[8:10] == ["n/a", "n/a"]


def test_a_compiled_function_runs_eagerly_under_the_kernel_counter():
    """Why the compiled rows report no counts: under a dispatch mode torch.compile runs the
    function's eager ops, the counter sees exactly what eager launches, never the compiled
    kernels."""
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
    compiled = torch.compile(layer.forward, backend="aot_eager", dynamic=True)
    x = torch.randn(4, 8)
    compiled(x).sum().backward()  # compiled outside the counter
    counts = []
    for forward in (compiled, layer.forward):
        with KernelLaunchCounter() as kernels:
            forward(x).sum().backward()
        counts.append(dict(kernels.by_op))
    assert counts[0] == counts[1] and counts[0]["addmm"] == 1


@pytest.mark.slow
def test_proxies_count_kernels_and_syncs_of_a_whole_update(tmp_path, monkeypatch):
    """``multipath-bench --proxies``: the CPU proxies of a GPU's pace, with targets 7 and 8."""
    from multipath_nmt import benchmark
    from multipath_nmt.benchmark import harness

    # the host floor's windows as the command times them, each of a few updates: what is
    # checked here is their count and report, not the times (a benchmark's job)
    monkeypatch.setitem(harness.HOST_FLOOR, "window_seconds", 0.01)

    only = ["stock prenorm L", "stock deep 4L", "multi-path L x 4 (full)",
            "multi-path L x 4 (+cheap features)", "ParameterNet (routed, both)"]
    threads = torch.get_num_threads()
    result = benchmark.run_proxies("tiny", only=only, log=lambda m: None)
    systems = result["systems"]
    L = benchmark.SIZES["tiny"]["base_layers"]
    # fairseq reads whether the source has padding once per encoder layer and once in the
    # decoder; the trainer's update adds its own reads (loss, sample size, gradient norm...)
    assert systems["stock prenorm L"]["host_syncs"] == L + 1
    assert systems["stock deep 4L"]["host_syncs"] == 4 * L + 1
    trainer_reads = (systems["stock prenorm L"]["host_syncs_per_update"]
                     - systems["stock prenorm L"]["host_syncs"])
    for name in only:
        row = systems[name]
        # routed ParameterNet's statistics stay in fairseq's meters until a log line: no read
        assert row["host_syncs_per_update"] == row["host_syncs"] + trainer_reads, name
    assert systems["multi-path L x 4 (full)"]["kernel_launches_per_update"] < \
        systems["stock deep 4L"]["kernel_launches_per_update"]
    report = benchmark.write_proxies_report(result, str(tmp_path))
    saved = json.loads((tmp_path / "proxies.json").read_text())
    assert saved["commit"] and [t["target"] for t in saved["targets"]][:2] == [7, 7]
    assert "| 7. kernel launches per update, multi-path L x 4 vs deep 4L |" in report
    assert "| 8. host syncs per update, ParameterNet (routed, both), more than stock's" in report
    # the host's floor: every system timed at d 16; stock at 4 times the width too
    floor = saved["host_floor"]
    assert floor["dim"] == 16 and floor["check"]["dim"] == 8 and floor["threads"] == 1
    for name in only:
        ms = systems[name]["host_ms_per_update"]
        assert 0 < ms["min"] <= ms["median"] <= ms["max"] and len(ms["values"]) == 7, name
    assert "| 7. host ms per update at the host's floor, multi-path L x 4 vs deep 4L |" in report
    assert "host floor ms per update | vs stock |" in report
    assert "stock prenorm L at d 8: " in report and torch.get_num_threads() == threads


class FakeCudaEnvironment:
    total_memory_in_GB = 141.0


def test_a_rows_peak_is_not_reset_inside_the_update(monkeypatch):
    """fairseq's Trainer.train_step reads and resets CUDA's peak-memory counter after every update
    while it keeps a cuda_env, so a peak read over timed updates held only what outlives an
    update (993 MiB for the base model on an H200), not its activations. A row's trainer leaves
    the counter alone. Real fairseq trainers on the CPU, left by their constructor as on a GPU
    (``cuda``, a ``cuda_env``), with a fake counter: fairseq's own trainer resets it once per
    update, a row's trainer never."""
    from fairseq import utils
    from fairseq.trainer import Trainer

    from multipath_nmt.benchmark.batches import fake_data_dir, padded_batches
    from multipath_nmt.benchmark.systems import build_trainer_from_argv

    init = Trainer.__init__

    def init_as_on_a_gpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.cuda, self.cuda_env = True, FakeCudaEnvironment()

    resets = []
    monkeypatch.setattr(Trainer, "__init__", init_as_on_a_gpu)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: resets.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 2 ** 30)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(utils, "move_to_cuda", lambda sample, device=None: sample)
    size = gpu_bench.SIZES["tiny"]
    with fake_data_dir(size["vocab"]) as data:
        spec = {"argv": gpu_bench.anchor_argv(data, size, "cpu")}
        for build, expected in ((lambda: build_trainer_from_argv(spec["argv"]), ["reset"] * 2),
                                (lambda: gpu_bench.build_row_trainer(spec), [])):
            trainer, task = build()
            batches = padded_batches(task, trainer.model, size["max_tokens"], 2,
                                     size["mean_length"])
            resets.clear()
            for batch in batches:
                trainer.train_step([batch])
            assert resets == expected


def test_the_loss_check_past_2_31_elements_finds_rows_a_wrapped_index_would_break(monkeypatch):
    """large_vocab.check runs fairseq's label-smoothed loss over one tokens x types tensor and in
    chunks below the limit: equal on a correct kernel; a log-softmax that goes wrong past a
    (here small) element count, as one with a 32-bit index past 2^31 would, is caught in the
    last rows."""
    from fairseq import utils

    from multipath_nmt.benchmark import large_vocab

    fine = large_vocab.check(600, 50, "cpu", chunk_elements=100 * 50)
    assert fine["relative_difference"] < 1e-6
    assert fine["last_rows_loss_max_difference"] == fine["last_rows_grad_max_difference"] == 0
    log_softmax = utils.log_softmax

    def wrapping(x, dim):
        out = log_softmax(x, dim)
        if x.numel() > 200 * 50:  # the "limit": rows past it read the first rows' entries
            out = torch.cat([out[:200], out[:len(out) - 200]])
        return out

    monkeypatch.setattr(utils, "log_softmax", wrapping)
    broken = large_vocab.check(600, 50, "cpu", chunk_elements=100 * 50)
    assert broken["last_rows_loss_max_difference"] > 0.1
    assert broken["last_rows_grad_max_difference"] > 0


def test_the_gpu_sizes_loss_check_is_past_2_31_elements():
    tokens, types = gpu_bench.SIZES["gpu"]["loss_check"]
    assert tokens * types > 2 ** 31 and types == 34880 and tokens == 65536
