"""The GPU check (scripts/gpu-check.sh, multipath_nmt/benchmark/gpu_check.py): everything in it
that does not need CUDA, run on the CPU (fairseq's fp16 optimizer through --memory-efficient-fp16);
and the padded batches it trains on (multipath_nmt/benchmark/batches.py)."""
import json
import math
import sys
import warnings

import pytest
import torch

from conftest import ROOT, clean_env, run_cli
from multipath_nmt.benchmark import gpu_check
from multipath_nmt.benchmark.batches import fake_data_dir, padded_batches
from multipath_nmt.benchmark.systems import build_trainer

TINY = gpu_check.CHECK_SIZES["tiny"]


def tiny_trainer(data, system_name=gpu_check.STOCK, precision="fp32", extra=()):
    system = next(s for s in gpu_check.check_systems(TINY) if s.name == system_name)
    flags = [*gpu_check.check_flags(TINY, system, precision), *extra]
    return build_trainer(data, flags, "cpu", False)


def test_every_architecture_family_is_checked():
    systems = gpu_check.check_systems(TINY)
    archs = {s.arch for s in systems}
    assert archs == {"transformer_prenorm_wmt_en_de", "multipath_transformer",
                     "widenet_transformer_wmt_en_de", "moe_transformer_wmt_en_de",
                     "ewa_transformer_wmt_en_de", "parameternet_transformer_wmt_en_de"}
    assert systems[0].name == gpu_check.STOCK  # the yardstick of tokens/s
    modes = [flag for s in systems for flag in s.flags if flag.startswith("--parameternet-mode")]
    assert sorted(modes) == ["--parameternet-mode=dynamic", "--parameternet-mode=routed"]


def test_synthetic_batches_are_padded_length_varied_fairseq_batches():
    with fake_data_dir(TINY["vocab"]) as data:
        trainer, task = tiny_trainer(data)
        batches = padded_batches(task, trainer.model, 256, 6, mean_length=12, seed=1)
        again = padded_batches(task, trainer.model, 256, 6, mean_length=12, seed=1)
    pad, eos = task.source_dictionary.pad(), task.source_dictionary.eos()
    assert len(batches) == 6
    lengths = set()
    for batch, same in zip(batches, again):
        torch.testing.assert_close(batch["net_input"]["src_tokens"],
                                   same["net_input"]["src_tokens"])
        src, src_lengths = batch["net_input"]["src_tokens"], batch["net_input"]["src_lengths"]
        for tokens in (src, batch["target"]):
            assert tokens.numel() <= 256  # fairseq's max-tokens rule: sentences x longest
        for row, length in zip(src, src_lengths.tolist()):  # the source is left-padded
            assert (row[:len(row) - length] == pad).all() and (row[len(row) - length:] != pad).all()
            assert row[-1] == eos
        assert batch["ntokens"] == (batch["target"] != pad).sum().item()
        lengths.update(src_lengths.tolist())
    assert len(lengths) >= 10  # lengths vary, within and across batches
    padded = sum((b["target"] == pad).sum().item() for b in batches)
    assert padded > 0


def test_batches_from_a_data_bin_and_a_clear_error_when_it_is_too_small(toy_data_bin):
    trainer, task = build_trainer(
        str(toy_data_bin), [*gpu_check.check_flags(TINY, gpu_check.check_systems(TINY)[0], "fp32"),
                            "-s", "en", "-t", "de"], "cpu", False)
    batches = padded_batches(task, trainer.model, 64, 3, split="valid")
    assert len(batches) == 3
    valid = task.dataset("valid")
    for batch in batches:
        for sentence_id, target in zip(batch["id"].tolist(), batch["target"]):
            expected = valid[sentence_id]["target"]
            assert target[:len(expected)].tolist() == expected.tolist()  # right-padded target
    with pytest.raises(ValueError, match=r"valid: \d+ batches of 64 tokens, the check needs 1000"):
        padded_batches(task, trainer.model, 64, 1000, split="valid")


def test_sync_warnings_are_counted_by_line_and_other_warnings_still_shown():
    modes = []
    with pytest.warns(DeprecationWarning, match="unrelated"):
        with gpu_check.SyncWarnings(set_mode=modes.append) as syncs:
            for _ in range(2):
                warnings.warn("called a synchronizing CUDA operation (function operator())")
            warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("unrelated", DeprecationWarning)
    assert modes == ["warn", "default"]
    assert syncs.total == 3
    assert sorted(syncs.by_line.values()) == [1, 2]
    assert all(line.startswith(__file__) for line in syncs.by_line)


def test_fp16_bookkeeping_skipped_steps_halve_the_loss_scale():
    """fairseq's fp16 optimizer on the CPU: at a loss scale of 4096 the first steps' gradients
    overflow; each overflow skips its update and halves the scale (the scale window of 2^14
    steps lets it grow back only much later)."""
    with fake_data_dir(TINY["vocab"]) as data:
        trainer, task = tiny_trainer(data, precision="memory-efficient-fp16",
                                     extra=["--fp16-init-scale=4096"])
        batches = padded_batches(task, trainer.model, 256, 6, mean_length=12)
        real_step = trainer.train_step

        def step_with_one_sync(samples):
            warnings.warn(gpu_check.SyncWarnings.MESSAGE)
            return real_step(samples)

        trainer.train_step = step_with_one_sync
        modes = []
        log = gpu_check.train_and_watch(trainer, batches, steps=6, warmup_steps=2, device="cpu",
                                        count_syncs=lambda: gpu_check.SyncWarnings(modes.append))
    assert log["initial_loss_scale"] == 4096 and log["skipped"] >= 1
    scales = log["loss_scales"]
    assert all(later <= earlier for earlier, later in zip(scales, scales[1:]))
    assert log["skipped"] == log["overflows"] == math.log2(4096 / scales[-1])
    assert len(log["losses"]) == 6 - log["skipped"] and log["losses_finite"]
    # only the 4 steps after the warm-up are timed and counted
    assert (log["timed_steps"], log["sync_warnings_per_step"], modes) == (4, 1.0, ["warn",
                                                                              "default"])
    assert 0 < log["tokens_per_s"] and log["peak_memory_mib"] is None  # CUDA only
    assert list(log["sync_warning_lines"].values()) == [4]


def test_fp32_training_has_no_loss_scale():
    with fake_data_dir(TINY["vocab"]) as data:
        trainer, task = tiny_trainer(data)
        batches = padded_batches(task, trainer.model, 256, 3, mean_length=12)
        log = gpu_check.train_and_watch(trainer, batches, steps=3, warmup_steps=1, device="cpu")
    assert log["loss_scales"] == [None] * 3 and log["skipped"] == log["overflows"] == 0
    assert log["sync_warnings_per_step"] is None


def test_compare_translations():
    same = gpu_check.compare_translations({0: [5, 6, 7, 2], 1: [8, 2]},
                                          {1: [8, 2], 0: [5, 6, 7, 2]})
    assert same == {"sentences": 2, "identical": 1.0, "bleu": pytest.approx(100.0)}
    one_off = gpu_check.compare_translations({0: [5, 6, 7, 8, 9, 2], 1: [8, 2]},
                                             {0: [5, 6, 7, 8, 4, 2], 1: [8, 2]})
    assert one_off["identical"] == 0.5 and 0 < one_off["bleu"] < 100
    with pytest.raises(ValueError, match="different sentences"):
        gpu_check.compare_translations({0: [2]}, {1: [2]})


def test_beam_search_against_a_float32_copy_of_the_same_weights():
    """The comparison's plumbing: a float32 model against its own float32 copy agrees exactly
    (same sentences, same samples); the half-precision model runs the same beam search."""
    with fake_data_dir(TINY["vocab"]) as data:
        trainer, task = tiny_trainer(data)
        samples = padded_batches(task, trainer.model, 256, 2, mean_length=12, seed=2)
        result = gpu_check.compare_precisions(trainer, task, samples)
        sentences = sum(s["nsentences"] for s in samples)
        assert result == {"sentences": sentences, "identical": 1.0, "bleu": pytest.approx(100.0)}
        trainer.model.half()
        half = gpu_check.compare_precisions(trainer, task, samples)
    assert half["sentences"] == sentences and 0 <= half["identical"] <= 1


def test_report_shows_each_figure_and_failures():
    row = dict(losses=[9.5, 8.25], losses_finite=True, skipped=2, overflows=2, steps=50,
               initial_loss_scale=128, loss_scales=[64.0, 32.0, 64.0], sync_warnings_per_step=3.5,
               peak_memory_mib=2048.4, tokens_per_s=20000.0, mfu=0.4125,
               beam_fp16_vs_fp32={"sentences": 256, "identical": 0.875, "bleu": 97.25},
               sync_warning_lines={"/x/moe.py:10": 40})
    result = {"machine": "GPU X", "device": "cuda", "precision": "fp16", "size": "gpu",
              "shape": {}, "data": None,
              "systems": {gpu_check.STOCK: dict(row, tokens_per_s=25000.0),
                          "WideNet": row, "EWA": {"error": "RuntimeError: CUDA out of memory"}}}
    text = gpu_check.markdown_report(result)
    assert ("| WideNet | yes | 9.500 -> 8.250 | 2 of 50 (2) | 128 -> 32 -> 64 | 3.5 | 2048 | 20000 "
            "| 0.80x | 41.2% | 88% of 256 | 97.2 |") in text
    assert "| EWA | **failed: RuntimeError: CUDA out of memory** |" in text
    assert "- WideNet: 40 at `/x/moe.py:10`" in text


def test_cli_refuses_cuda_without_a_gpu_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_cli(["bash", ROOT / "scripts" / "gpu-check.sh"], check=False,
                   env=clean_env(PYTHON=sys.executable))
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"gpu-check.sh: no CUDA device is visible to PyTorch ({sys.executable}); run it on a GPU "
        "machine"]
    proc = run_cli([sys.executable, "-m", "multipath_nmt.cli.gpu_check"], check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (  # after fairseq's start-up lines
        f"gpu-check: no CUDA device is visible to PyTorch {torch.__version__} (CUDA build: "
        "none); run it on a GPU machine")
    proc = run_cli([sys.executable, "-m", "multipath_nmt.cli.gpu_check", "--device", "cpu"],
                   check=False)
    assert proc.returncode == 1 and "--precision fp16 needs --device cuda" in proc.stderr
    proc = run_cli([sys.executable, "-m", "multipath_nmt.cli.gpu_check", "--device", "cpu",
                    "--precision", "fp32", "--only", "nope"], check=False)
    assert proc.returncode == 1 and "unknown system(s) ['nope']" in proc.stderr


@pytest.mark.slow
def test_gpu_check_script_runs_on_the_cpu_at_the_tiny_size(tmp_path):
    systems = [gpu_check.STOCK, "WideNet (shared attn + MoE E4 k2)"]
    run_cli(["bash", ROOT / "scripts" / "gpu-check.sh", "--no-bench", "--device", "cpu",
             "--precision", "memory-efficient-fp16", "--size", "tiny", "--out", tmp_path,
             "--only", *systems], env=clean_env(PYTHON=sys.executable))
    result = json.loads((tmp_path / "check.json").read_text())
    assert list(result["systems"]) == systems
    for row in result["systems"].values():
        assert "error" not in row and row["losses_finite"]
        assert row["steps"] == TINY["steps"] and row["initial_loss_scale"] == 128
        assert 0 < row["padding"] < 0.5 and row["gemm_peak_flops"] > 0
        assert row["mfu"] == pytest.approx(row["train_flops_per_token"] * row["tokens_per_s"]
                                           / row["gemm_peak_flops"])
        assert row["beam_fp16_vs_fp32"]["sentences"] >= TINY["beam_sentences"]
        # every attention call site, in training and in beam search (flash: None on the CPU)
        training, inference = (row["attention_calls"][phase] for phase in ("training",
                                                                           "inference"))
        assert any("decoder" in site for site in training) and training.keys() == inference.keys()
    report = (tmp_path / "check.md").read_text()
    assert f"| {gpu_check.STOCK} | yes |" in report
    assert f"Attention call sites of {gpu_check.STOCK}: " in report
    assert "| call site | phase | mask passed to SDPA | fused kernels it allows |" in report
