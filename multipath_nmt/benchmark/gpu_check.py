"""The GPU check behind ``scripts/gpu-check.sh``: a tool of its own that builds on the benchmark's
systems, batches, clock and FLOP counting (nothing else in the package depends on it).

For every architecture family (stock transformer, multi-path, WideNet, MoE, EWA, ParameterNet) it
trains in-process from the command that ``scripts/train.sh`` builds: ``recipe.train_command`` turns
train.sh's arguments (the arch, ``--precision``, the batch) into fairseq-train's command line,
so the optimizer is ``adam_fused``, the precision is the recipe's (``--amp --bf16`` or ``--amp``,
fp32 weights), every update is 2 micro-batches (``--update-freq 2``), and the learning rate and
criterion are the recipe's for the arch. Only these differ from a real run (besides the
update-freq, which train.sh makes 8 or 16 on one GPU): the model size (the
check's, below), ``--warmup-updates`` (a few updates instead of the recipe's 8,000/16,000, so
that the loss can fall within the check's updates), ``--max-update`` (the check's updates, over
which EWA's schedule runs), and ``--seed 1``. fairseq's own ``Trainer``
is built in-process from that command line (``systems.build_trainer_from_argv``) and trained on
padded, length-varied batches (fairseq's own batching and collater, from a data-bin or from
synthetic sentences), the update-freq micro-batches per ``train_step``. Per system it reports:

- whether every loss was finite and whether the loss fell (last update's below the first's);
- the loss scale (start, lowest, end) and the skipped (overflowed) updates;
- the synchronizing CUDA operations that ``torch.cuda.set_sync_debug_mode("warn")`` reports,
  the peak ``torch.cuda.max_memory_allocated``, tokens/s against stock fairseq, and MFU;
- the same updates run again in fp32 (same command with ``--precision fp32``, same seed, same
  batches): the last losses' gap, which passes within :data:`MAX_GAP_OF_FALL` of the loss fall
  that fp32 reached;
- beam search in fp16 (as ``scripts/translate.sh`` decodes on a GPU) against fp32, same weights;
- with 2 or more GPUs visible, the recipe's real fairseq-train command on 2 GPUs (DDP, a
  subprocess, a few updates): its exit status and whether its loss fell;
- the seconds it took.

Each system's trainer is dropped and its memory freed before the next one is built, and a system
that fails is reported and the others still run.

Everything except the three CUDA calls (the sync debug mode, the peak-memory counters and CUDA
events) runs on the CPU too, which is how the tests check it: ``--device cpu --precision bf16``
trains in bfloat16 autocast as on a GPU, and ``--precision memory-efficient-fp16`` (not a
train.sh precision: fairseq's fp16 optimizer, added to the recipe's fp32 command) goes through a
loss scaler and its overflow handling. The fairseq-train run on 2 GPUs is tested as two gloo
processes under ``torchrun`` (the ``launch`` argument of :func:`ddp_leg`).

This is the per-family table. It trains in-process with ``--update-freq 2``, not train.sh's 8 or
16 on one GPU, and runs no epoch loop, validation, save or resume: the recipe leg
(``gpu_check_recipe``) runs train.sh's fairseq-train command itself, for stock and multi-path by
default.

This module runs the check (:func:`run_check`, system by system); its parts sit beside it:
``gpu_check_setup`` (sizes, precisions, systems, the fairseq-train command), ``gpu_check_training``
(the updates and what is measured on them, fp32 and beam search compared), ``gpu_check_ddp`` (the
run on 2 GPUs), ``gpu_check_recipe`` (the recipe leg) and ``gpu_check_report`` (check.md and
check.json).
"""
import contextlib
import gc
import json
import math
import shlex
import sys
import tempfile
import time

import torch

from multipath_nmt.benchmark.batches import fake_data_dir, padded_batches
from multipath_nmt.benchmark.flops import (
    gemm_peak_flops,
    model_gemm_shapes,
    training_flops_per_token,
)
# The parts of the check live in the modules beside this one; their names are imported here
# too, where the CLI and the tests use them (and the tests replace ``build_trainer_from_argv``,
# ``train_and_watch`` and ``ddp_leg`` on this module: their callers stay here).
from multipath_nmt.benchmark.gpu_check_ddp import (  # noqa: F401
    ddp_command, ddp_data_dir, ddp_leg, train_losses, write_synthetic_train_split,
)
from multipath_nmt.benchmark.gpu_check_recipe import (  # noqa: F401
    CHANGED_FLAGS, RECIPE_SYSTEMS, RecipeLegError, leg_command, read_run_log, recipe_leg,
    train_sh_dry_run,
)
from multipath_nmt.benchmark.gpu_check_report import (  # noqa: F401
    _number, failed, markdown_report, write_reports,
)
from multipath_nmt.benchmark.gpu_check_setup import (  # noqa: F401
    CHECK_SIZES, CPU_STAND_INS, DDP_GPUS, PRECISIONS, STOCK, UPDATE_FREQ, check_command,
    check_systems, model_flags, precision_flags, resolve_precision, train_sh_arguments,
)
from multipath_nmt.benchmark.gpu_check_training import (  # noqa: F401
    MAX_GAP_OF_FALL, SyncWarnings, compare_losses, compare_precisions, compare_translations,
    compute_dtype, halvings, loss_scale_reader, train_and_watch, translations,
)
from multipath_nmt.benchmark.bench_report import environment, machine_description
from multipath_nmt.benchmark.systems import build_trainer_from_argv


def check_one(size, argv, device, from_data_bin, count_syncs):
    """Build the trainer of one fairseq-train command line (``argv``: what fairseq's parser
    takes) and measure it; returns (result, the micro-batches it trained on). The trainer is
    gone when this returns."""
    trainer, task = build_trainer_from_argv(argv)
    update_freq = trainer.cfg.optimization.update_freq[0]
    max_tokens = trainer.cfg.dataset.max_tokens
    batches = padded_batches(task, trainer.model, max_tokens, size["steps"] * update_freq,
                             size["mean_length"],
                             split="train" if from_data_bin else None, seed=1)
    attention = {"training": {}, "inference": {}}
    shapes = model_gemm_shapes(trainer, batches[0], attention["training"])
    peak, best_shape = gemm_peak_flops(shapes, device, compute_dtype(trainer.cfg),
                                       size["gemm_repeats"])
    flops = training_flops_per_token(trainer, batches[0])
    result = train_and_watch(trainer, batches, size["steps"], size["warmup_steps"], device,
                             count_syncs, update_freq, size["sync_steps"])
    result.update(params=sum(p.numel() for p in trainer.model.parameters()),
                  max_tokens=max_tokens, gemm_peak_flops=peak, gemm_peak_shape=best_shape,
                  train_flops_per_token=flops, mfu=flops * result["tokens_per_s"] / peak,
                  padding=1 - sum(b["ntokens"] for b in batches)
                  / sum(b["target"].numel() for b in batches))
    held_out = padded_batches(task, trainer.model, max_tokens, math.ceil(
        size["beam_sentences"] * size["mean_length"] / max_tokens) + 1,
        size["mean_length"], split="valid" if from_data_bin else None, seed=2)
    sentences, samples = 0, []
    for batch in held_out:
        if sentences >= size["beam_sentences"]:
            break
        samples.append(batch)
        sentences += batch["nsentences"]
    result["beam_fp16_vs_fp32"] = compare_precisions(trainer, task, samples,
                                                     attention["inference"], torch.float16)
    result["attention_calls"] = attention
    return result, batches


def fp32_reference(size, argv, batches, device):
    """The same updates in fp32 (``argv``: the fp32 command line of the same system and seed)
    on the same micro-batches: their losses and tokens/s."""
    trainer, _ = build_trainer_from_argv(argv)
    log = train_and_watch(trainer, batches, size["steps"], size["warmup_steps"], device,
                          update_freq=trainer.cfg.optimization.update_freq[0],
                          sync_steps=size["sync_steps"])  # the same steps timed
    return {key: log[key] for key in ("losses", "losses_finite", "loss_fell", "tokens_per_s")}


def release_memory(device):
    """Free what a finished system left: its reference cycles, and on CUDA the cached blocks."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def failed_checks(result):
    """What a system's figures fail: finite losses, a falling loss, mixed precision against
    fp32, the fairseq-train run on 2 GPUs."""
    found = []
    if not result["losses_finite"]:
        found.append("a loss was not finite")
    if not result["loss_fell"]:
        found.append("the loss did not fall")
    versus = result.get("vs_fp32")
    if versus and not versus["passed"]:
        found.append("fp32's loss did not fall" if versus["gap_share_of_fp32_fall"] is None
                      else f"the last loss is {versus['gap']:+.3f} from fp32's "
                           f"({100 * versus['gap_share_of_fp32_fall']:.0f}% of its fall)")
    ddp = result.get("ddp")
    if ddp and ddp["exit_status"] != 0:
        found.append(f"fairseq-train on {ddp['gpus']} GPUs exited with {ddp['exit_status']}")
    elif ddp and not ddp["loss_fell"]:
        found.append(f"fairseq-train on {ddp['gpus']} GPUs: the loss did not fall")
    return found


def check_system(size, system, data_dir, precision, device, from_data_bin, count_syncs,
                 languages, ddp_gpus=0, ddp_data=None):
    """Everything the check does for one system (see the module's docstring); raises where
    the in-process training fails."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as save_dir:
        gpus = int(device == "cuda")
        command = check_command(data_dir, save_dir, size, system, precision, gpus, languages)
        result, batches = check_one(size, command.argv[3:], device, from_data_bin, count_syncs)
        result["command"] = shlex.join(command.argv)
        release_memory(device)
        if precision != "fp32":
            fp32 = check_command(data_dir, save_dir, size, system, "fp32", gpus, languages)
            result["fp32"] = fp32_reference(size, fp32.argv[3:], batches, device)
            result["vs_fp32"] = compare_losses(result["losses"], result["fp32"]["losses"])
            release_memory(device)
    if ddp_gpus:
        result["ddp"] = ddp_leg(ddp_data, size, system, precision, ddp_gpus, languages)
    result["failed_checks"] = failed_checks(result)
    return result


def run_check(size_name="gpu", device="cuda", precision="auto", data=None, only=None,
              log=print, count_syncs=None, ddp_gpus=None, bf16=None, table=True,
              recipe_systems=None, recipe_jobs=None, commit=None):
    """Check every system; returns the result dict ``markdown_report`` renders. ``data``: a
    data-bin (joined dictionary) whose train and valid splits give the batches. ``ddp_gpus``:
    GPUs for the fairseq-train runs (default: 2 where 2 or more are visible, else none).
    ``bf16``: whether the GPU has bfloat16, for ``--precision auto`` (default: it is asked).
    ``table``: whether to run the per-family table; ``recipe_systems``: the systems of the
    recipe leg (none: no recipe leg; the CLI's default is ``RECIPE_SYSTEMS``), run with
    ``recipe_jobs`` chains side by side (default: all of them on CUDA, one per core on the
    CPU). ``commit``: the commit measured, recorded with the versions (default: the checkout's)."""
    from fairseq.data import data_utils

    start = time.perf_counter()
    size = CHECK_SIZES[size_name]
    trained_in = resolve_precision(precision, device, bf16)
    if count_syncs is None and device == "cuda":
        count_syncs = SyncWarnings
    if ddp_gpus is None:
        ddp_gpus = DDP_GPUS if device == "cuda" and torch.cuda.device_count() >= DDP_GPUS else 0
    every = check_systems(size)
    systems = [s for s in every if table and (not only or s.name in only)]
    results, leg = {}, None
    with contextlib.ExitStack() as stack:
        data_dir = data or stack.enter_context(fake_data_dir(size["vocab"]))
        languages = data_utils.infer_language_pair(data_dir) if data else ("src", "tgt")
        ddp_data = (stack.enter_context(ddp_data_dir(data, size, languages, ddp_gpus))
                    if ddp_gpus else None)
        for system in systems:
            system_start = time.perf_counter()
            try:
                results[system.name] = check_system(
                    size, system, data_dir, trained_in, device, data is not None, count_syncs,
                    languages, ddp_gpus, ddp_data)
            except Exception as error:  # noqa: BLE001 a failed system is a finding; check the others
                results[system.name] = {"error": f"{type(error).__name__}: {error}"}
            release_memory(device)  # the failed system's trainer too (its traceback is gone)
            results[system.name]["seconds"] = time.perf_counter() - system_start
            log(f"{system.name}: {json.dumps(results[system.name])[:300]}")
        if recipe_systems:
            leg = recipe_leg(recipe_systems, every, size, trained_in, device, data_dir,
                             data, languages, recipe_jobs,
                             bf16=True if device == "cuda" and trained_in == "bf16" else None,
                             log=log)
    return {"size": size_name, "shape": size, "device": device, "precision": trained_in,
            "precision_asked": precision,
            "precision_flags": precision_flags(trained_in),
            "update_freq": UPDATE_FREQ, "lr_warmup_updates": size["lr_warmup_updates"],
            "max_gap_of_fall": MAX_GAP_OF_FALL, "ddp_gpus": ddp_gpus,
            "data": data, "machine": machine_description(device),
            "environment": environment(device, commit), "command": shlex.join(sys.argv),
            "systems": results,
            "table": table, "recipe": leg,
            "seconds": time.perf_counter() - start}
