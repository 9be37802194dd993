"""The GPU check (scripts/gpu-check.sh, multipath_nmt/benchmark/gpu_check.py): everything in it
that does not need CUDA, run on the CPU (bfloat16 autocast as train.sh's --precision bf16; fairseq's
fp16 optimizer and loss scaler through --memory-efficient-fp16; the fairseq-train run on 2 GPUs as
two gloo processes); and the padded batches it trains on (multipath_nmt/benchmark/batches.py)."""
import json
import math
import os
import re
import shlex
import socket
import sys
import types
import warnings
import weakref

import pytest
import torch

from conftest import ROOT, clean_env, run_cli, script_env
from helpers import in_process
from multipath_nmt.cli import gpu_check as gpu_check_cli
from multipath_nmt import recipe
from multipath_nmt.benchmark import gpu_check
from multipath_nmt.benchmark.batches import fake_data_dir, padded_batches
from multipath_nmt.benchmark.bench_report import git_commit
from multipath_nmt.benchmark.systems import build_trainer_from_argv

TINY = gpu_check.CHECK_SIZES["tiny"]


def system_named(name):
    return next(s for s in gpu_check.check_systems(TINY) if s.name == name)


def tiny_trainer(data, system_name=gpu_check.STOCK, precision="fp32", extra=(),
                 languages=("src", "tgt")):
    """The trainer the check builds for a system: from the recipe's command on the CPU."""
    command = gpu_check.check_command(data, data, TINY, system_named(system_name), precision, 0,
                                      languages, extra)
    return build_trainer_from_argv(command.argv[3:])


def last_value(argv, flag):
    """A flag's value as fairseq reads it: the last one on the command line wins."""
    index = len(argv) - 1 - argv[::-1].index(flag)
    return argv[index + 1]


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
    trainer, task = tiny_trainer(str(toy_data_bin), languages=("en", "de"))
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
        modes, step_modes = [], []

        def step_with_one_sync(samples):  # and the sync-debug mode it ran under
            step_modes.append(modes[-1] if modes else "default")
            warnings.warn(gpu_check.SyncWarnings.MESSAGE)
            return real_step(samples)

        trainer.train_step = step_with_one_sync
        log = gpu_check.train_and_watch(trainer, batches, steps=6, warmup_steps=2, device="cpu",
                                        count_syncs=lambda: gpu_check.SyncWarnings(modes.append),
                                        sync_steps=2)
    assert log["initial_loss_scale"] == 4096 and log["skipped"] >= 1
    scales = log["loss_scales"]
    assert all(later <= earlier for earlier, later in zip(scales, scales[1:]))
    assert log["skipped"] == log["overflows"] == math.log2(4096 / scales[-1])
    assert len(log["losses"]) == 6 - log["skipped"] and log["losses_finite"]
    # after the warm-up, 2 steps counted under the sync-debug mode, then 2 timed without it
    assert (log["sync_steps"], log["timed_steps"], log["sync_warnings_per_step"]) == (2, 2, 1.0)
    assert step_modes == ["default"] * 2 + ["warn"] * 2 + ["default"] * 2
    assert modes == ["warn", "default"]
    assert 0 < log["tokens_per_s"] and log["peak_memory_mib"] is None  # CUDA only
    assert list(log["sync_warning_lines"].values()) == [2]


def test_fp32_training_has_no_loss_scale():
    with fake_data_dir(TINY["vocab"]) as data:
        trainer, task = tiny_trainer(data)
        batches = padded_batches(task, trainer.model, 256, 3, mean_length=12)
        log = gpu_check.train_and_watch(trainer, batches, steps=3, warmup_steps=1, device="cpu")
    assert log["loss_scales"] == [None] * 3 and log["skipped"] == log["overflows"] == 0
    assert log["sync_warnings_per_step"] is None


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_attention_calls_are_recorded_in_the_training_autocast(precision, dtype):
    """The training phase of the attention table comes from model_gemm_shapes' pass: under
    train.sh's bf16 autocast it must see bf16 activations, as training does (the first GPU run
    recorded fp32 ones, so flash attention was refused at every call site)."""
    from multipath_nmt.benchmark.flops import model_gemm_shapes

    with fake_data_dir(TINY["vocab"]) as data:
        trainer, task = tiny_trainer(data, precision=precision)
        batch = padded_batches(task, trainer.model, 256, 1, mean_length=12)[0]
        seen = []
        trainer.model.encoder.layers[0].fc1.register_forward_hook(
            lambda module, args, out: seen.append(out.dtype))
        calls = {}
        model_gemm_shapes(trainer, batch, calls)
    assert seen and set(seen) == {dtype}
    assert calls["encoder self-attn"]  # recorded in that same pass


def test_compare_translations():
    same = gpu_check.compare_translations({0: [5, 6, 7, 2], 1: [8, 2]},
                                          {1: [8, 2], 0: [5, 6, 7, 2]})
    assert same == {"sentences": 2, "identical": 1.0, "bleu": pytest.approx(100.0)}
    # an untrained model's hypotheses: no 3-grams, identical, so 100 (plain BLEU: 0)
    short = {0: [2], 1: [8, 2]}
    assert gpu_check.compare_translations(short, dict(short))["bleu"] == pytest.approx(100.0)
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
    assert ("| WideNet | yes | 9.500 -> 8.250 | 2 of 50 (2) | 128 -> 32 -> 64 | 3.5 | 2048 "
            "| 88% of 256 | 97.2 |") in text
    assert "20000" not in text and "41.2%" not in text  # speed is gpu-bench's, not the check's
    assert "| EWA | **failed: RuntimeError: CUDA out of memory** |" in text
    assert "- WideNet: 40 at `/x/moe.py:10`" in text


@pytest.mark.parametrize("cuda", [None, "13.0"])
def test_no_cuda_device_tells_a_cpu_only_build_from_a_cuda_build_without_a_gpu(monkeypatch, cuda):
    """Most Linux installs of PyTorch are CUDA builds, GPU or not: the refusal says which build
    this is, and what to do about it."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert recipe.no_cuda_device() == {
        None: f"no CUDA device is visible to PyTorch {torch.__version__}, a CPU-only build; run "
              "it on a GPU machine with a CUDA build of PyTorch",
        "13.0": f"no CUDA device is visible to PyTorch {torch.__version__} (built for CUDA 13.0); "
                "run it on a GPU machine"}[cuda]


@pytest.mark.process  # gpu-check.sh's own check, before any Python of ours
def test_the_script_refuses_cuda_without_a_gpu_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_cli(["bash", ROOT / "scripts" / "gpu-check.sh"], check=False,
                   env=clean_env(PYTHON=sys.executable))
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"gpu-check.sh: no CUDA device is visible to PyTorch ({sys.executable}); run it on a GPU "
        "machine"]


def test_cli_refuses_cuda_without_a_gpu_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = in_process.call(gpu_check_cli.main, [])
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"gpu-check: {recipe.no_cuda_device()}"
    proc = in_process.call(gpu_check_cli.main, ["--device", "cpu", "--precision", "fp16"])
    assert proc.returncode == 1 and "--precision fp16 needs --device cuda" in proc.stderr
    proc = in_process.call(gpu_check_cli.main, ["--device", "cpu", "--precision", "fp32", "--only",
                                                "nope"])
    assert proc.returncode == 1 and "unknown system(s) ['nope']" in proc.stderr


@pytest.mark.slow
@pytest.mark.process  # the script's own summary line
def test_gpu_check_script_runs_on_the_cpu_at_the_tiny_size(tmp_path):
    systems = [gpu_check.STOCK, "WideNet (shared attn + MoE E4 k2)"]
    proc = run_cli(["bash", ROOT / "scripts" / "gpu-check.sh", "--no-bench", "--device", "cpu",
                    "--precision", "memory-efficient-fp16", "--size", "tiny", "--out", tmp_path,
                    "--only", *systems], env=script_env())
    result = json.loads((tmp_path / "check.json").read_text())
    assert list(result["systems"]) == systems
    assert result["precision_flags"] == ["--memory-efficient-fp16"] and result["ddp_gpus"] == 0
    # where the figures come from: versions, commit and the command
    env = result["environment"]
    assert env["torch"] == torch.__version__ and env["commit"] == git_commit() and env["fairseq"]
    assert result["command"].endswith("--only " + shlex.join(systems))
    for row in result["systems"].values():
        assert "error" not in row and row["losses_finite"]
        # train.sh's command, fairseq's fp16 optimizer added; fp32 reached over the same updates
        assert re.search(r"--optimizer adam_fused .* --update-freq 2 .* --cpu .* "
                         r"--memory-efficient-fp16$", row["command"])
        assert row["failed_checks"] == [] and row["loss_fell"] and row["vs_fp32"]["passed"]
        assert 0 < row["seconds"] < result["seconds"]
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
    # the build's CUDA version (None for a CPU build, PyPI's CUDA build says its own), no driver
    assert (f"torch {torch.__version__}, CUDA {torch.version.cuda}, driver None"
            in report.splitlines()[0])
    assert f"The check took {result['seconds']:.0f} s." in report
    assert f"gpu-check: took {result['seconds']:.0f} s" in proc.stderr
    assert re.search(r"gpu-check.sh: reports in .*; exit status 0; took \d+ s$", proc.stderr)
    assert f"Attention call sites of {gpu_check.STOCK}: " in report
    assert "| call site | phase | mask passed to SDPA | fused kernels it allows |" in report
    # the recipe leg: its systems among --only, train.sh's fp32 command + the fp16 stand-in
    leg = result["recipe"]
    assert list(leg["systems"]) == [gpu_check.STOCK]
    row = leg["systems"][gpu_check.STOCK]
    assert row["failed_checks"] == [] and row["vs_fp32"]["passed"], row
    assert row["precision_flags"] == ["--cpu", "--memory-efficient-fp16"]
    assert "The recipe leg: the fairseq-train command that `scripts/train.sh --dry-run`" in report


def test_the_check_trains_through_the_command_train_sh_runs(tmp_path):
    """Each system's trainer is built from ``recipe.train_command``'s own command line: fused
    Adam, 2 micro-batches of max-tokens per update, the recipe's lr, train.sh's precision; only
    the model size, a short warm-up and the seed are the check's. On 2 GPUs the same command
    trains on each GPU's share of a batch twice as large."""
    system = system_named("multi-path L x 4 (full)")  # the deep/multi-path recipe
    with fake_data_dir(TINY["vocab"]) as data:
        command = gpu_check.check_command(data, tmp_path, TINY, system, "bf16", 0)
        assert command == recipe.train_command(
            data, tmp_path, gpu_check.train_sh_arguments(TINY, system, "bf16"), gpus=0)
        argv = command.argv
        assert argv[1:4] == ["-m", "fairseq_cli.train", data]
        assert [last_value(argv, flag) for flag in (
            "--optimizer", "--update-freq", "--max-tokens", "--lr", "--warmup-updates",
            "--max-update")] == ["adam_fused", "2", "256", "0.002",
                                 str(TINY["lr_warmup_updates"]), str(TINY["steps"])]
        assert "--amp --bf16 --cpu" in shlex.join(argv)
        trainer, _ = build_trainer_from_argv(argv[3:])
        cfg = trainer.cfg
        assert cfg.optimization.update_freq == [2] and cfg.dataset.max_tokens == 256
        assert cfg.common.amp and cfg.common.bf16 and cfg.common.cpu
        assert cfg.lr_scheduler.warmup_updates == TINY["lr_warmup_updates"]
        assert cfg.criterion._name == "label_smoothed_cross_entropy"
        assert type(trainer.optimizer).__name__ == "AMPOptimizer"
        assert type(trainer.optimizer.fp32_optimizer).__name__ == "FairseqAdamFused"
        assert next(trainer.model.parameters()).dtype == torch.float32  # autocast: fp32 weights
        assert gpu_check.compute_dtype(cfg) == torch.bfloat16
        # the same seed gives the same weights, as in fairseq-train
        again, _ = build_trainer_from_argv(argv[3:])
        for ours, theirs in zip(trainer.model.parameters(), again.model.parameters()):
            assert torch.equal(ours, theirs)
        ddp = gpu_check.ddp_command(data, tmp_path, TINY, system, "bf16", 2, bf16=True).argv
        for other in gpu_check.check_systems(TINY):  # the recipe takes them all (EWA: a length)
            gpu_check.check_command(data, tmp_path, TINY, other, "bf16", 0)
    assert [last_value(ddp, flag) for flag in (
        "--distributed-world-size", "--update-freq", "--max-tokens", "--max-update",
        "--log-format", "--log-interval")] == ["2", "2", "256", str(TINY["ddp_updates"]),
                                               "json", "1"]
    assert "--cpu" not in ddp and "--amp --bf16" in shlex.join(ddp)
    assert {"--disable-validation", "--no-save"} <= set(ddp)


def test_precision_auto_is_train_shs():
    assert gpu_check.resolve_precision("auto", "cuda", bf16=True) == "bf16"
    assert gpu_check.resolve_precision("auto", "cuda", bf16=False) == "fp16"
    assert gpu_check.resolve_precision("auto", "cpu") == "fp32"
    assert gpu_check.resolve_precision("memory-efficient-fp16", "cpu") == "memory-efficient-fp16"
    with pytest.raises(recipe.RecipeError, match="needs a CUDA GPU"):
        gpu_check.resolve_precision("fp16", "cpu")
    assert gpu_check.precision_flags("bf16") == ["--amp", "--bf16"]
    assert gpu_check.precision_flags("memory-efficient-fp16") == ["--memory-efficient-fp16"]


def test_amp_loss_scale_is_read_without_a_sync_and_overflows_are_halvings():
    """--amp keeps its loss scale in a device tensor: it is read as a copy (no sync inside the
    timed steps) and made a number afterwards; every overflow halves it."""
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=100)
    read = gpu_check.loss_scale_reader(types.SimpleNamespace(scaler=scaler))
    assert read() == 8.0  # the initial scale, before the first scaled backward
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler.scale(weight.sum()).backward()
    before = read()
    assert torch.is_tensor(before) and float(before) == 8.0
    weight.grad.fill_(math.inf)
    scaler.step(optimizer)
    scaler.update()
    assert float(read()) == 4.0 and float(before) == 8.0  # a copy, not the scaler's own tensor
    assert torch.equal(weight, torch.ones(2))  # the overflowed update was skipped
    assert gpu_check.halvings([8.0, 8.0, 4.0, 1.0, 2.0, None]) == 3
    disabled = torch.amp.GradScaler("cpu", enabled=False)  # bf16: nothing is scaled
    assert gpu_check.loss_scale_reader(types.SimpleNamespace(scaler=disabled))() is None
    assert gpu_check.loss_scale_reader(types.SimpleNamespace())() is None


def test_mixed_precision_passes_within_a_tenth_of_fp32s_loss_fall():
    close = gpu_check.compare_losses([11.0, 10.5, 10.02], [11.0, 10.4, 10.0])
    assert close["passed"] and close["gap"] == pytest.approx(0.02)
    assert close["relative_gap"] == pytest.approx(0.002)
    assert close["gap_share_of_fp32_fall"] == pytest.approx(0.02)
    # e.g. updates 3x too small: half of fp32's fall is missing
    slow = gpu_check.compare_losses([11.0, 10.8, 10.5], [11.0, 10.4, 10.0])
    assert not slow["passed"] and slow["gap_share_of_fp32_fall"] == pytest.approx(0.5)
    assert not gpu_check.compare_losses([11.0, 10.0], [11.0, 11.2])["passed"]  # nothing to reach
    row = dict(losses_finite=True, loss_fell=True, vs_fp32=slow,
               ddp=dict(gpus=2, exit_status=0, loss_fell=False))
    assert gpu_check.failed_checks(row) == [
        "the last loss is +0.500 from fp32's (50% of its fall)",
        "fairseq-train on 2 GPUs: the loss did not fall"]
    row.update(losses_finite=False, loss_fell=False, vs_fp32=close,
               ddp=dict(gpus=2, exit_status=1, loss_fell=True))
    assert gpu_check.failed_checks(row) == [
        "a loss was not finite", "the loss did not fall", "fairseq-train on 2 GPUs exited with 1"]


@pytest.mark.slow
def test_a_failing_system_is_reported_the_next_is_checked_and_nothing_stays_alive(monkeypatch):
    """The first system fails in the middle of its training; the check goes on with the next,
    which trains in bf16 autocast through train.sh's command, 2 micro-batches per update, and then
    in fp32 on the same batches; its fairseq-train run on 2 GPUs (a stand-in here) fails. No
    trainer or model of a finished run is alive when the next one is built or the log line of its
    system is written."""
    trainers, alive = [], []

    def live():
        return [ref for pair in trainers for ref in pair if ref() is not None]

    def build(argv):
        alive.extend(live())
        trainer, task = build_trainer_from_argv(argv)
        trainers.append((weakref.ref(trainer), weakref.ref(trainer.model)))
        return trainer, task

    micro_batches = []
    real_train_and_watch = gpu_check.train_and_watch

    def train_and_watch(trainer, batches, steps, warmup_steps, device, count_syncs=None,
                        update_freq=1, sync_steps=0):
        real_step = trainer.train_step

        def step(samples):
            micro_batches.append(len(samples))
            return real_step(samples)

        trainer.train_step = step
        if trainer.cfg.model.arch == "transformer_prenorm_wmt_en_de":
            trainer.train_step(batches[:update_freq])
            raise RuntimeError("injected failure")
        return real_train_and_watch(trainer, batches, steps, warmup_steps, device, count_syncs,
                                    update_freq, sync_steps)

    legs = []

    def ddp_leg(data_dir, size, system, precision, gpus, languages):
        legs.append((system.name, precision, gpus, sorted(os.listdir(data_dir))))
        return dict(command="fairseq-train ...", gpus=gpus, exit_status=1, seconds=1.0,
                    updates=0, loss_first=None, loss_last=None, loss_fell=False)

    monkeypatch.setattr(gpu_check, "build_trainer_from_argv", build)
    monkeypatch.setattr(gpu_check, "train_and_watch", train_and_watch)
    monkeypatch.setattr(gpu_check, "ddp_leg", ddp_leg)
    logged = []
    other = "MoE (E4 k2, every 2nd layer)"
    result = gpu_check.run_check("tiny", "cpu", "bf16", only=[gpu_check.STOCK, other],
                                 ddp_gpus=2, log=lambda line: logged.append(live()))
    failed, row = result["systems"][gpu_check.STOCK], result["systems"][other]
    assert set(failed) == {"error", "seconds"}
    assert failed["error"] == "RuntimeError: injected failure"
    assert len(trainers) == 3  # the failed system, then the next one in bf16 and in fp32
    assert alive == [] and logged == [[], []] and live() == []
    assert micro_batches == [2] * (1 + 2 * TINY["steps"])
    assert "error" not in row and row["update_freq"] == 2 and row["loss_scales"] == [None] * 6
    assert "--optimizer adam_fused" in row["command"] and "--amp --bf16" in row["command"]
    assert len(row["fp32"]["losses"]) == TINY["steps"] and row["fp32"]["loss_fell"]
    assert row["vs_fp32"]["passed"] and row["vs_fp32"]["gap_share_of_fp32_fall"] < 0.05
    assert row["failed_checks"] == ["fairseq-train on 2 GPUs exited with 1"]  # all else passed
    assert legs == [(other, "bf16", 2, ["dict.src.txt", "dict.tgt.txt", "train.src-tgt.src.bin",
                                        "train.src-tgt.src.idx", "train.src-tgt.tgt.bin",
                                        "train.src-tgt.tgt.idx"])]
    assert 0 < failed["seconds"] and 0 < row["seconds"]
    assert failed["seconds"] + row["seconds"] <= result["seconds"]
    assert gpu_check.failed(result)
    report = gpu_check.markdown_report(result)
    assert f"| {gpu_check.STOCK} | **failed: RuntimeError: injected failure** |" in report
    assert "| **fail: fairseq-train on 2 GPUs exited with 1** |" in report
    assert f"The check took {result['seconds']:.0f} s." in report
    assert "--warmup-updates 2` instead of the recipe's" in report
    assert all(line.count("|") == 16 for line in report.splitlines()
               if line.startswith(f"| {gpu_check.STOCK}") or line.startswith(f"| {other}"))


def fake_fairseq_train(lines, status):
    """A command line that prints ``lines`` like fairseq-train and exits with ``status``."""
    script = f"import sys\nfor line in {lines!r}:\n    print(line)\nsys.exit({status})"
    return lambda argv: [sys.executable, "-c", script]


def test_fairseq_train_leg_reports_its_exit_status_losses_and_output(tmp_path):
    lines = [f'2025-01-01 00:00:0{n} | INFO | train_inner | {{"epoch": 1, "update": 0.{n}, '
             f'"loss": "{loss}", "num_updates": "{n}"}}' for n, loss in ((2, 9.9), (1, 9.5))]
    with fake_data_dir(TINY["vocab"]) as data:
        leg = gpu_check.ddp_leg(data, TINY, system_named(gpu_check.STOCK), "bf16", 0,
                                launch=fake_fairseq_train([*lines, "Traceback: boom"], 1))
    assert (leg["exit_status"], leg["updates"], leg["loss_first"], leg["loss_last"],
            leg["loss_fell"]) == (1, 2, 9.5, 9.9, False)
    assert leg["output_tail"].endswith("Traceback: boom\n") and leg["seconds"] > 0
    assert leg["command"].startswith(shlex.join([sys.executable, "-c"]))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_fairseq_train_leg_runs_the_recipes_command_as_two_gloo_processes():
    """What the check runs on 2 GPUs, on the CPU: the recipe's fairseq-train command on the
    synthetic data-bin, under torchrun with 2 gloo processes instead of fairseq's 2 CUDA ones."""
    def torchrun(argv):
        return [argv[0], "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *argv[1:],
                "--distributed-world-size", "2", "--distributed-backend", "gloo"]

    with gpu_check.ddp_data_dir(None, TINY, ("src", "tgt"), 2) as data:
        leg = gpu_check.ddp_leg(data, TINY, system_named(gpu_check.STOCK), "bf16", 0,
                                launch=torchrun, timeout=300)
    assert leg["exit_status"] == 0, leg.get("output_tail")
    assert leg["updates"] == TINY["ddp_updates"] and leg["loss_fell"]
    assert re.search(r"-m fairseq_cli\.train .* --optimizer adam_fused .* --update-freq 2 .* "
                     r"--amp --bf16 --cpu .* --distributed-world-size 2", leg["command"])
    assert "output_tail" not in leg


# The recipe leg (multipath_nmt/benchmark/gpu_check_recipe.py): train.sh's own fairseq-train
# command, run, saved, validated and resumed.

from multipath_nmt.benchmark import gpu_check_recipe  # noqa: E402

MULTI_PATH = "multi-path L x 4 (full)"


def flag_tokens(words):
    """A fairseq-train argv's flags after the data-bin: (flag, value or None) in order."""
    tokens, index = [], 0
    while index < len(words):
        flag = words[index]
        takes_value = index + 1 < len(words) and not words[index + 1].startswith("-")
        tokens.append((flag, words[index + 1] if takes_value else None))
        index += 2 if takes_value else 1
    return tokens


@pytest.mark.parametrize("gpus, update_freqs, precision_flags", [
    (1, {gpu_check.STOCK: "8", MULTI_PATH: "16"}, ["--amp", "--bf16"]),
    (0, {gpu_check.STOCK: "1", MULTI_PATH: "2"}, ["--amp", "--bf16", "--cpu"]),
])
def test_recipe_leg_runs_train_shs_dry_run_command_with_only_the_listed_changes(
        gpus, update_freqs, precision_flags, monkeypatch):
    """What `scripts/train.sh --dry-run` prints for one GPU (a dry run needs none) or the CPU,
    with only CHANGED_FLAGS' values, the data-bin and the appended model size changed: its
    update-freq (8 and 16 on one GPU of 6 GB, which holds micro-batches of 4,096 tokens of both
    archs at their full size with this 1,000-type dictionary), precision flags, optimizer, lr
    and criterion kept."""
    monkeypatch.setenv("MULTIPATH_NMT_GPU_MEMORY_MIB", "6144")
    systems = [system_named(name) for name in update_freqs]
    with fake_data_dir(TINY["vocab"]) as dictionaries, \
            gpu_check_recipe.recipe_data(None, dictionaries, TINY,
                                         TINY["recipe_updates"]) as data_for:
        for system in systems:
            commands = gpu_check_recipe.system_commands(system, TINY, "bf16", gpus,
                                                        dictionaries, data_for, bf16=True)
            assert list(commands) == ["bf16", "fp32"]
            for precision, (dry_run, argv, epoch) in commands.items():
                assert dry_run[1:4] == ["-m", "fairseq_cli.train", dictionaries]
                assert argv[:3] == dry_run[:3] and argv[3] != dictionaries
                assert os.path.exists(os.path.join(argv[3], "valid.src-tgt.src.idx"))
                assert TINY["recipe_updates"] < epoch < 2 * TINY["recipe_updates"]
                dry, ours = flag_tokens(dry_run[4:]), flag_tokens(argv[4:])
                assert [flag for flag, _ in ours[:len(dry)]] == [flag for flag, _ in dry]
                changed = {flag for (flag, old), (_, new) in zip(dry, ours) if old != new}
                assert changed <= set(gpu_check_recipe.CHANGED_FLAGS)
                appended = ours[len(dry):]
                model = gpu_check.model_flags(TINY, system)
                # on a GPU train.sh saves every N updates already: the leg sets its interval
                assert ("--save-interval-updates" in dict(dry)) == bool(gpus)
                assert [f for f, _ in appended[:-len(model)]] == [
                    *([] if gpus else ["--save-interval-updates"]),
                    "--validate-interval-updates", "--seed", "--log-format", "--log-interval"]
                assert argv[-len(model):] == model
                # train.sh's own: update-freq, precision, optimizer, lr, criterion
                for flag in ("--update-freq", "--optimizer", "--lr", "--criterion",
                             "--distributed-world-size" if gpus else "--cpu"):
                    assert gpu_check_recipe.flag_value(argv, flag) == \
                        gpu_check_recipe.flag_value(dry_run, flag)
                assert last_value(argv, "--update-freq") == update_freqs[system.name]
                flags = [w for w in argv if w in gpu_check_recipe.PRECISION_FLAGS]
                assert flags == [w for w in dry_run if w in gpu_check_recipe.PRECISION_FLAGS]
                assert flags == (precision_flags if precision == "bf16"
                                 else precision_flags[2:])
                assert [last_value(argv, f) for f in (
                    "--max-tokens", "--max-update", "--warmup-updates", "--save-interval-updates",
                    "--validate-interval-updates")] == [
                    str(TINY[k]) for k in ("recipe_max_tokens", "recipe_updates",
                                           "recipe_lr_warmup_updates", "recipe_interval",
                                           "recipe_interval")]


def fake_fairseq_runs(resume_from=None, fail=None):
    """A stand-in for gpu_check_recipe.run_fairseq_train that writes the log fairseq-train would:
    one train_inner line per update, a validation every --validate-interval-updates, and on a
    resume the line of the checkpoint_last.pt it loads. ``resume_from``: the update a resume
    says it loaded (default: the saved one); ``fail``: (run name, exit status) to fail."""
    calls = []

    def run(argv, log_path, timeout):
        save_dir = last_value(argv, "--save-dir")
        name = os.path.basename(log_path)[:-len(".log")]
        calls.append((name, argv))
        last = os.path.join(save_dir, "checkpoint_last.pt")
        start = 0
        lines = []
        if os.path.exists(last):
            with open(last) as f:
                start = int(f.read()) if resume_from is None else resume_from
            lines.append(f"x | INFO | fairseq.trainer | Loaded checkpoint {last} (epoch 1 @ "
                         f"{start} updates)")
        every = int(last_value(argv, "--validate-interval-updates"))
        end = int(last_value(argv, "--max-update"))
        for update in range(start + 1, end + 1):
            lines.append(f'x | INFO | train_inner | {{"epoch": 1, "loss": "{10 - update / 10}", '
                         f'"num_updates": "{update}"}}')
            if update % every == 0 or update == end:
                lines.append(f'x | INFO | valid | {{"epoch": 1, "valid_loss": '
                             f'"{10.5 - update / 10}", "valid_num_updates": "{update}"}}')
        with open(log_path, "w") as log:
            log.write("\n".join(lines) + "\n")
        if fail and fail[0] == name:
            return fail[1]
        with open(last, "w") as f:
            f.write(str(end))
        return 0

    run.calls = calls
    return run


def test_the_recipe_leg_resumes_at_update_k_and_compares_with_fp32(monkeypatch):
    fake = fake_fairseq_runs()
    monkeypatch.setattr(gpu_check_recipe, "run_fairseq_train", fake)
    k = TINY["recipe_updates"]
    with fake_data_dir(TINY["vocab"]) as dictionaries:
        leg = gpu_check.recipe_leg([gpu_check.STOCK], gpu_check.check_systems(TINY), TINY,
                                   "bf16", "cpu", dictionaries, log=lambda line: None)
    row = leg["systems"][gpu_check.STOCK]
    assert row["failed_checks"] == [] and row["vs_fp32"]["passed"]
    assert row["update_freq"] == "1" and row["precision_flags"] == ["--amp", "--bf16", "--cpu"]
    by_save_dir = {}
    for name, argv in fake.calls:  # the two chains ran side by side
        by_save_dir.setdefault(last_value(argv, "--save-dir"), []).append((name, argv))
    assert len(by_save_dir) == 2
    for (first_name, first), (resume_name, resume) in by_save_dir.values():
        # the resume: the same command in the same save dir, only --max-update doubled
        assert (first_name, resume_name) == ("run", "resume")
        assert resume == gpu_check_recipe.set_flag(first, "--max-update", 2 * k)
    for chain in row["chains"].values():
        assert chain["resume"]["loaded"]["updates"] == k
        assert [u for u, _ in chain["run"]["losses"] + chain["resume"]["losses"]] == \
            list(range(1, 2 * k + 1))
    report = gpu_check.markdown_report(dict(
        machine="CPU", device="cpu", precision="bf16", size="tiny", shape={}, data=None,
        systems={}, table=False, recipe=leg, max_gap_of_fall=gpu_check.MAX_GAP_OF_FALL))
    assert "The per-family table: not run (--no-table)." in report
    assert (f"| {gpu_check.STOCK} | 1; `--amp --bf16 --cpu` | 0, 0 | checkpoint_last.pt @ {k} "
            f"| 9.900 -> 9.600 -> 9.200 |") in report
    assert "| +0.000 (0.0% of it) | " in report and report.rstrip().endswith("| pass |")


@pytest.mark.parametrize("fake, failure", [
    (dict(resume_from=0), "bf16 resume did not start from checkpoint_last.pt at update 4"),
    (dict(fail=("resume", 1)), "bf16 resume exited with 1"),
    (dict(fail=("run", 2)), "bf16 run exited with 2 (not resumed)"),
    (dict(fail=("resume", None)), "bf16 resume ran past its time limit and was killed after"),
])
def test_a_failed_recipe_run_is_reported_and_exits_3(monkeypatch, tmp_path, capsys, fake,
                                                     failure):
    monkeypatch.setattr(gpu_check_recipe, "run_fairseq_train", fake_fairseq_runs(**fake))
    status = gpu_check_cli.main(["--device", "cpu", "--precision", "bf16", "--size", "tiny",
                                 "--no-table", "--recipe-systems", gpu_check.STOCK,
                                 "--out", str(tmp_path)])
    assert status == 3
    row = json.loads((tmp_path / "check.json").read_text())["recipe"]["systems"][
        gpu_check.STOCK]
    assert failure in "; ".join(row["failed_checks"])
    assert f"**fail: {failure}" in (tmp_path / "check.md").read_text()


def test_a_recipe_chain_that_breaks_or_a_train_sh_that_refuses_is_a_failed_row(monkeypatch):
    def broken(argv, log_path, timeout):
        raise OSError("disk full")

    monkeypatch.setattr(gpu_check_recipe, "run_fairseq_train", broken)
    monkeypatch.setattr(gpu_check_recipe, "TRAIN_SH", str(ROOT / "scripts" / "train.sh"))
    systems = gpu_check.check_systems(TINY)
    with fake_data_dir(TINY["vocab"]) as dictionaries:
        leg = gpu_check.recipe_leg([gpu_check.STOCK], systems, TINY, "bf16", "cpu",
                                   dictionaries, log=lambda line: None)
        assert leg["systems"][gpu_check.STOCK] == {
            "error": "bf16: OSError: disk full; fp32: OSError: disk full"}
        monkeypatch.setattr(gpu_check_recipe, "TRAIN_SH", str(ROOT / "scripts" / "nope.sh"))
        leg = gpu_check.recipe_leg([gpu_check.STOCK], systems, TINY, "bf16", "cpu",
                                   dictionaries, log=lambda line: None)
    error = leg["systems"][gpu_check.STOCK]["error"]
    assert error.startswith("RecipeLegError: bash ") and "printed no fairseq-train command" in error
    assert gpu_check.failed(dict(systems={}, recipe=leg))
    report = gpu_check.markdown_report(dict(
        machine="CPU", device="cpu", precision="bf16", size="tiny", shape={}, data=None,
        systems={}, table=False, recipe=leg, max_gap_of_fall=gpu_check.MAX_GAP_OF_FALL))
    assert f"| {gpu_check.STOCK} | **failed: RecipeLegError: bash " in report


def test_recipe_leg_switches(tmp_path):
    proc = in_process.call(gpu_check_cli.main, ["--device", "cpu", "--no-table", "--no-recipe"])
    assert proc.returncode == 1 and "leave nothing to run" in proc.stderr
    proc = in_process.call(gpu_check_cli.main, ["--device", "cpu", "--recipe-systems", "nope"])
    assert proc.returncode == 1 and "unknown system(s) ['nope']" in proc.stderr


@pytest.mark.slow
def test_the_recipe_leg_runs_fairseq_train_saves_validates_and_resumes(tmp_path):
    """The real thing on the CPU: train.sh's fairseq-train for stock, K updates with saves and
    validations, resumed from checkpoint_last.pt at update K across an epoch's end, in bf16
    autocast and in fp32."""
    proc = in_process.call(gpu_check_cli.main, [
        "--device", "cpu", "--precision", "bf16", "--size", "tiny", "--out", tmp_path,
        "--no-table", "--recipe-systems", gpu_check.STOCK])
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "check.json").read_text())
    assert result["systems"] == {} and result["table"] is False
    k = TINY["recipe_updates"]
    row = result["recipe"]["systems"][gpu_check.STOCK]
    assert row["failed_checks"] == [], row
    dry_run = shlex.split(row["dry_run_command"])
    argv = shlex.split(row["command"])
    assert last_value(argv, "--update-freq") == last_value(dry_run, "--update-freq")
    assert row["precision_flags"] == ["--amp", "--bf16", "--cpu"]
    assert row["precision_flags"] == [w for w in dry_run
                                      if w in gpu_check_recipe.PRECISION_FLAGS]
    for chain in row["chains"].values():
        first, resume = chain["run"], chain["resume"]
        assert first["exit_status"] == resume["exit_status"] == 0
        assert first["loaded"] is None
        assert os.path.basename(resume["loaded"]["path"]) == "checkpoint_last.pt"
        assert resume["loaded"]["updates"] == k
        assert [u for u, _ in first["losses"]] == list(range(1, k + 1))
        assert [u for u, _ in resume["losses"]] == list(range(k + 1, 2 * k + 1))
        assert first["valid"] and resume["valid"]
        assert resume["epochs"] == [1, 2]  # resumed inside epoch 1, crossed its end
    assert row["vs_fp32"]["passed"] and row["loss_fell"]
    report = (tmp_path / "check.md").read_text()
    assert f"| {gpu_check.STOCK} | 1; `--amp --bf16 --cpu` | 0, 0 | checkpoint_last.pt @ {k} |" \
        in report
    assert re.search(r"gpu-check: took \d+ s$", proc.stderr)
