"""``scripts/gpu-bench.sh``: training and beam-search speed on one GPU against stock fairseq 0.12
on the same card, in one run.

Every row is a fairseq ``Trainer`` built from a whole fairseq-train command line (fairseq's own
parser, task, model, criterion and optimizer) in a process of its own, so that the anchor can
run without the plug-in's patches, a row's memory and compiled code never reach the next, and a
row that fails is a finding while the others still run. The rows, at the paper's d 512 sizes
(6 + 6 layers, FFN 2048, 8 heads, a 32,000-type joined dictionary), in the order they run, the
rows that decide the targets first (:func:`_order`; a row not started within the time budget is
reported "not run", with an exit status of its own):

1. the anchor: stock fairseq 0.12's ``transformer`` (pre-norm, 6 + 6) with ``--fp16`` and
   ``--optimizer adam``, under ``MULTIPATH_NMT_PATCHES=off``: what a fairseq user runs, at
   4,096-token micro-batches, 2 per update;
2. the base model, Deep24 and multi-path 6 x 4 (Table 2's pair of equal size) as
   ``scripts/train.sh`` trains them (``recipe.train_command``: its precision, ``adam_fused``,
   the plug-in) at train.sh's micro-batch for one card (``recipe.memory_model``) and the
   recipe's tokens per update; base and multi-path 6 x 4 with a ``torch.profiler`` summary of 3
   updates (:mod:`multipath_nmt.benchmark.profile`); each then decodes with beam 4 as
   ``scripts/translate.sh`` does (fp16 weights on a GPU, lenpen 0.6, batches of 4,096 tokens),
   every hypothesis held to the batch's mean length (an untrained model's lengths would be
   arbitrary);
3. the anchor at the base model's one-card micro-batch;
4. train.sh's base model at 4,096-token micro-batches, 2 per update;
5. ``--compile-layers`` for the base model and multi-path 6 x 4 at their one-card micro-batch;
6. the rest: Deep24 and multi-path 6 x 4 at 4,096-token micro-batches, then WideNet, EWA,
   routed and dynamic ParameterNet.

A 4,096-token row's update is 2 micro-batches (fairseq's batching and collater over
length-varied synthetic sentences), as train.sh's command asked for 8,192 tokens per update
before it sized the micro-batch for the card. The clock
(:func:`multipath_nmt.benchmark.timing.time_update_windows`) times whole updates with CUDA events
and synchronizes once per window; tokens/s is the median of the windows with their min-max. The
step split (forward + backward against the update), the host syncs and the kernel launches of an
update are measured in passes of their own, after the timed windows. MFU is the measured training
FLOPs per token (counted on at most 4,096 tokens: :func:`flop_batch_shape`) x tokens/s over the
matrix-multiply rate this card reached in the same run, in the row's compute dtype.
"""
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time

import torch

from multipath_nmt import recipe
from multipath_nmt.benchmark.batches import fake_data_dir, padded_batches, synthetic_batch
from multipath_nmt.benchmark.flops import matmul_peak_flops, training_flops_per_token
from multipath_nmt.benchmark.gpu_check_setup import check_command, model_flags
from multipath_nmt.benchmark.memory import without_peak_resets
from multipath_nmt.benchmark.micro_batch import update_profile
from multipath_nmt.benchmark.bench_report import environment, median_range
from multipath_nmt.benchmark.systems import System, build_trainer_from_argv, systems_for
from multipath_nmt.benchmark.timing import ForwardBackwardClock, summary, time_update_windows
from multipath_nmt.fairseq_patches.wrapping import patches_of

SIZES = {
    # the paper's base dimensions; ``budget_s``: rows are started while the run is younger
    "gpu": dict(dim=512, ffn=2048, heads=8, vocab=32000, base_layers=6, decoder_layers=6,
                max_tokens=4096, mean_length=28, batches=16, warmup_updates=4, windows=4,
                window_seconds=0.8, min_window_updates=3, beam_batches=6, beam_windows=3,
                matmul_n=8192, budget_s=300, row_timeout_s=120, card_update_tokens=None,
                card_mib=None, loss_check=(65536, 34880)),
    # the same code on the CPU in seconds: the report's form (tests)
    "tiny": dict(dim=64, ffn=256, heads=4, vocab=1000, base_layers=2, decoder_layers=1,
                 max_tokens=256, mean_length=12, batches=4, warmup_updates=1, windows=3,
                 window_seconds=0.0, min_window_updates=1, beam_batches=2, beam_windows=3,
                 matmul_n=256, budget_s=600, row_timeout_s=300, card_update_tokens=1024,
                 card_mib=4096, loss_check=(256, 1000)),
}
UPDATE_FREQ = 2
ANCHOR = "anchor: fairseq transformer 6+6, --fp16, adam"
BASE = "transformer 6+6"
DEEP = "deep 24+6"
MULTIPATH = "multi-path 6x4+6"
COMPILED = ", --compile-layers"
# train.sh's micro-batch for one card of the GPU measured (the anchor: the base model's)
ONE_CARD = ", one-card micro-batch"
MFU_NOTE = ("MFU counts the FLOPs of non-padding tokens only: the FLOPs per token of a batch "
            "without padding (every sentence of the mean length) x the non-padding target "
            "tokens trained per second, over the matrix-multiply rate measured in the run.")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROFILED_UPDATES = 3
NOT_RUN = "not run"
# the exit statuses of scripts/gpu-bench.sh (:func:`exit_status`); anything else: it did not run
EXIT_FAILED = 3
EXIT_NOT_RUN = 4
# the memory model's target: a measured peak at most this share of its estimate. The planner
# fills half of what the card leaves (recipe/memory_model.py's MARGIN), so a model that is 2x
# too low runs out of memory; 1.25 fails the target while the card still has room.
PEAK_OVER_ESTIMATE_MAX = 1.25
COUNTERS_SKIPPED = ("not counted: the dispatch-mode counters see a compiled layer's eager ops, "
                    "not its compiled kernels")


def _bench_systems(size):
    """The line-up's systems at this size, by the names of this benchmark's rows."""
    L = size["base_layers"]
    by_name = {s.name: s for s in systems_for(size)}
    # train.sh's Deep24 arch (its recipe: 65,536 tokens per update), 4 L encoder layers
    deep = System(DEEP.replace("24", str(4 * L)), "transformer_deep24_wmt_en_de",
                  [f"--encoder-layers={4 * L}"], group="baselines")
    return {
        BASE: by_name["stock prenorm L"],
        DEEP: deep,
        MULTIPATH: by_name["multi-path L x 4 (full)"],
        "WideNet (shared attn + MoE E4 k2)": by_name["WideNet (shared attn + MoE E4 k2)"],
        "EWA (E4, every-2)": by_name["EWA (E4, every-2)"],
        "ParameterNet (routed, both)": by_name["ParameterNet (routed, both)"],
        "ParameterNet (dynamic, both)": by_name["ParameterNet (dynamic, both)"],
    }


def anchor_argv(data_dir, size, device, max_tokens=None, update_freq=UPDATE_FREQ):
    """Stock fairseq's command for the base pre-norm Transformer: its own ``transformer`` arch,
    ``--fp16`` (fairseq's FP16Optimizer) and ``--optimizer adam``, the same model size, dropout,
    batch and loss as train.sh's base row (``max_tokens`` x ``update_freq``, default the size's
    micro-batch x 2). On the CPU, where fairseq's fp16 cannot run, fp32."""
    max_tokens = size["max_tokens"] if max_tokens is None else max_tokens
    return [
        data_dir, "-s", "src", "-t", "tgt",
        "--arch", "transformer_wmt_en_de", "--encoder-normalize-before",
        "--decoder-normalize-before", "--share-all-embeddings",
        f"--encoder-layers={size['base_layers']}",
        *model_flags(size, System("", "")),
        "--attention-dropout", "0.1", "--activation-dropout", "0.1",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.001",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", str(max_tokens), "--update-freq", str(update_freq),
        "--max-update", "100000", "--seed", "1", "--no-progress-bar",
        *(["--fp16"] if device == "cuda" else ["--cpu"]),
    ]


def _order(systems):
    """The rows in the order they run, as (name, system, kind): the rows that decide the
    targets first, so that a run cut short by its time budget still answers them. 1. the anchor
    at the size's micro-batch; 2. base, Deep24 and multi-path 6 x 4 at their one-card
    micro-batch (these decode too); 3. the anchor at base's one-card micro-batch; 4. base at
    the size's micro-batch; 5. compiled base and multi-path 6 x 4 at their one-card
    micro-batch; 6. the rest: Deep24 and multi-path 6 x 4 at the size's micro-batch, then the
    routed families."""
    names = list(systems)
    return [(ANCHOR, BASE, "anchor"),
            *((name + ONE_CARD, name, "one_card") for name in (BASE, DEEP, MULTIPATH)),
            (ANCHOR + ONE_CARD, BASE, "anchor_one_card"),
            (BASE, BASE, "micro"),
            *((name + ONE_CARD + COMPILED, name, "compiled") for name in (BASE, MULTIPATH)),
            (DEEP, DEEP, "micro"), (MULTIPATH, MULTIPATH, "micro"),
            *((name, name, "micro") for name in names[3:])]


def row_names(size):
    """The rows of :func:`rows`, in their order, without building their commands."""
    return [name for name, _, _ in _order(_bench_systems(size))]


def one_card_plan(data_dir, size, system, device):
    """train.sh's batch for one card (``recipe.batch_plan`` under the micro-batch that
    ``recipe.memory_model`` sizes for the card's memory: the GPU's, or the size's ``card_mib``
    on the CPU) and the memory model's estimate of the row's peak MiB. The tokens per update
    are the recipe's, or the size's ``card_update_tokens``."""
    from pathlib import Path

    from multipath_nmt.recipe import memory_model

    dictionaries = recipe.dictionary_files(Path(data_dir), "src", "tgt")
    estimate = memory_model.estimate(system.arch, dictionaries, True, model_flags(size, system))
    card_mib = memory_model.gpu_memory_mib()[0] if device == "cuda" else size["card_mib"]
    plan = recipe.batch_plan(recipe.recipe_for_arch(system.arch), 1,
                             estimate.max_tokens(card_mib), batch_tokens=size["card_update_tokens"])
    return plan, estimate


def rows(data_dir, size, device, precision, compile_backend="inductor"):
    """[(name, spec)]: each row's fairseq-train command line (``argv``, what fairseq's parser
    takes), environment, compute dtype and what is measured, in the order they run
    (:func:`_order`). The one-card rows run train.sh's micro-batch for one card with the
    recipe's tokens per update (the anchor at the base model's); the others the size's
    micro-batch (4,096 tokens), 2 per update. The one-card rows of base, Deep24 and multi-path
    6 x 4 are profiled (``profile``: :mod:`multipath_nmt.benchmark.profile`) and decode."""
    systems = _bench_systems(size)

    def train_sh(system, extra=()):
        command = check_command(data_dir, data_dir, size_for_check(size), system, precision,
                                int(device == "cuda"), extra=list(extra), updates=100000)
        return command.argv[3:]  # after "python -m fairseq_cli.train"

    anchor_dtype = "fp16" if device == "cuda" else "fp32"
    plans = {name: one_card_plan(data_dir, size, systems[name], device)
             for name in (BASE, DEEP, MULTIPATH)}

    def planned(name, max_tokens):
        return plans[name][1].peak_mib(max_tokens)

    def one_card(name):
        plan = plans[name][0]
        return ["--max-tokens", str(plan.max_tokens), "--batch-tokens", str(plan.global_batch)]

    anchor_env = {"MULTIPATH_NMT_PATCHES": "off"}
    out = []
    for name, system, kind in _order(systems):
        if kind == "anchor":
            spec = dict(argv=anchor_argv(data_dir, size, device), env=anchor_env,
                        dtype=anchor_dtype, planned_peak_mib=planned(BASE, size["max_tokens"]))
        elif kind == "anchor_one_card":
            plan = plans[BASE][0]
            spec = dict(argv=anchor_argv(data_dir, size, device, plan.max_tokens,
                                         plan.update_freq),
                        env=anchor_env, dtype=anchor_dtype,
                        planned_peak_mib=planned(BASE, plan.max_tokens))
        elif kind == "one_card":
            spec = dict(argv=train_sh(systems[system], one_card(system)), env={},
                        dtype=precision, beam=True, profile=system in (BASE, MULTIPATH),
                        planned_peak_mib=planned(system, plans[system][0].max_tokens))
        elif kind == "compiled":
            spec = dict(argv=train_sh(systems[system], [*one_card(system), "--compile-layers",
                                                        compile_backend]),
                        env={}, dtype=precision, compiled=True)
        else:
            spec = dict(argv=train_sh(systems[system]), env={}, dtype=precision,
                        planned_peak_mib=(planned(system, size["max_tokens"])
                                          if system in plans else None))
        out.append((name, spec))
    return out


def size_for_check(size):
    """This benchmark's size in the shape ``gpu_check_setup.check_command`` reads."""
    return dict(size, steps=100000, lr_warmup_updates=4000)


# --- one row, in its own process ---------------------------------------------------------------

def build_row_trainer(spec):
    """The Trainer and task of a row's command, with CUDA's peak counter kept over the update
    (:func:`multipath_nmt.benchmark.memory.without_peak_resets`)."""
    trainer, task = build_trainer_from_argv(spec["argv"])
    return without_peak_resets(trainer), task


def measure_row(spec, size, device):
    """Everything measured for one row (see the module docstring); runs in the row's process.
    ``phases_s``: the seconds each phase of the row took, so that a run says where its time
    went (a row on a GPU spends most of it outside the timed windows)."""
    phases = {}
    clock = [time.perf_counter()]

    def phase(name):
        now = time.perf_counter()
        phases[name] = now - clock[0]
        clock[0] = now

    trainer, task = build_row_trainer(spec)
    update_freq = trainer.cfg.optimization.update_freq[0]
    max_tokens = trainer.cfg.dataset.max_tokens
    # about as many tokens as the size's batches of max_tokens, in at least 4 batch shapes
    count = max(4, update_freq, size["batches"] * size["max_tokens"] // max_tokens)
    samples = padded_batches(task, trainer.model, max_tokens, count, size["mean_length"], seed=1)
    cycle = itertools.cycle(samples)
    tokens = [0]
    phase("build")

    def update():
        micro_batches = [next(cycle) for _ in range(update_freq)]
        tokens[0] += sum(b["ntokens"] for b in micro_batches)
        trainer.train_step(micro_batches)

    # the FLOPs of a non-padding token: a batch of mean-length sentences, without padding
    unpadded = synthetic_batch(flop_batch_shape(size, max_tokens), len(task.source_dictionary))
    flops = training_flops_per_token(trainer, unpadded)
    phase("flops")
    update()  # the first update builds the optimizer state, and compiles under --compile-layers
    phase("first_update")
    # Every batch once before the clock (their shapes' kernels, allocator blocks; compiled:
    # their graphs): on an H200 the first timed window still ran at a third of the others'
    # pace after 5 warm-up updates of 16 batches (the 2026-11-27 run, docs/history.md).
    warmup = max(size["warmup_updates"], math.ceil(len(samples) / update_freq))
    for _ in range(warmup * (2 if spec.get("compiled") else 1)):
        update()
    phase("warmup")
    [probe] = time_update_windows(update, 1, 2, device)
    per_window = max(size["min_window_updates"], math.ceil(size["window_seconds"] / (probe / 2)))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rates = []
    for _ in range(size["windows"]):
        tokens[0] = 0
        [seconds] = time_update_windows(update, 1, per_window, device)
        rates.append(tokens[0] / seconds)
    row = dict(update_freq=update_freq, max_tokens=max_tokens,
               planned_peak_mib=spec.get("planned_peak_mib"),
               params=sum(p.numel() for p in trainer.model.parameters()),
               train_flops_per_token=flops, first_update_s=phases["first_update"],
               updates_per_window=per_window, tokens_per_s=summary(rates))
    phase("timed_windows")
    if device == "cuda":
        row.update(cuda_memory_figures())
    # the untimed passes: the step split, then one update's host syncs and kernel launches
    split = ForwardBackwardClock(trainer, device)
    split.active = True
    [seconds] = time_update_windows(update, 1, per_window, device)
    split.active = False
    row["forward_backward_ms"] = 1e3 * split.seconds / per_window
    row["update_ms"] = 1e3 * seconds / per_window - row["forward_backward_ms"]
    phase("step_split")
    if spec.get("compiled"):
        # torch.compile runs a compiled function eagerly while a dispatch mode is active, so
        # the counters would count the eager layers' ops (tests/test_gpu_bench.py)
        row["counters"] = COUNTERS_SKIPPED
    else:
        row.update(update_profile(update))
    phase("syncs_and_launches")
    # which of the plug-in's patches this process runs under (none for the anchor)
    row["patched_train_step"] = list(patches_of(type(trainer).train_step))
    if spec.get("profile"):
        from multipath_nmt.benchmark.profile import profile_updates

        try:
            row["profile"] = profile_updates(update, PROFILED_UPDATES, device)
        except Exception as error:  # noqa: BLE001 the row's other figures stand; this is its finding
            row["profile"] = {"error": f"{type(error).__name__}: {str(error).strip()[:300]}"}
        phase("profile")
    if spec.get("beam"):
        row["beam_sentences_per_s"] = beam_sentences_per_s(trainer, task, size, device)
        phase("beam")
    row["phases_s"] = phases
    return row


def flop_batch_shape(size, max_tokens):
    """The batch the FLOPs per token are counted on: mean-length sentences, without padding,
    filling at most the size's micro-batch (4,096 tokens on a GPU) even where the row trains a
    larger one. The count runs in fp32 without autocast (FlopCounterMode counts the same FLOPs
    in any dtype), so on the whole one-card micro-batch (65,520 tokens for Deep24 and
    multi-path) its activations and fp32 log-probabilities could run out of memory before the
    first update. FLOPs grow linearly with the number of sentences of one length, so the count
    per token of this batch is the count per token of the row's own batches of that length
    (``tests/test_gpu_bench.py``)."""
    tokens = min(max_tokens, size["max_tokens"])
    return dict(batch=max(1, tokens // size["mean_length"]), length=size["mean_length"])


def cuda_memory_figures():
    """CUDA's caching allocator over the timed windows: the allocated peak, the peak it held
    from the driver (``max_memory_reserved``: what an out-of-memory error compares against the
    card), and how often it had to free its cache and retry an allocation (``num_alloc_retries``:
    nonzero means the peak pressed against the card) or failed (``num_ooms``)."""
    stats = torch.cuda.memory_stats()
    return {"peak_memory_mib": torch.cuda.max_memory_allocated() / 2 ** 20,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2 ** 20,
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "ooms": stats.get("num_ooms", 0)}


def beam_sentences_per_s(trainer, task, size, device):
    """Beam 4 as ``scripts/translate.sh`` decodes (fp16 weights on a GPU, lenpen 0.6, batches
    of up to the size's micro-batch, 4,096 tokens, whatever the row trained on), every
    hypothesis held to ``mean_length`` tokens: the sentences/s of each window of
    ``beam_batches`` batches."""
    from fairseq import utils
    from fairseq.sequence_generator import SequenceGenerator

    model = trainer.model
    model.eval()
    if device == "cuda":
        model.half()
    length = size["mean_length"]
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=4, len_penalty=0.6,
                                  max_len_a=0, max_len_b=length, min_len=length)
    batches = [utils.move_to_cuda(b) if device == "cuda" else b for b in padded_batches(
        task, model, size["max_tokens"], size["beam_batches"], length, seed=2)]
    cycle = itertools.cycle(batches)
    sentences = [0]

    def decode():
        batch = next(cycle)
        sentences[0] += batch["nsentences"]
        generator.generate([model], batch)

    with torch.no_grad():
        for _ in range(2):  # warm-up (fairseq's TorchScript helpers specialise on first calls)
            decode()
        rates = []
        for _ in range(size["beam_windows"]):
            sentences[0] = 0
            [seconds] = time_update_windows(decode, 1, len(batches), device)
            rates.append(sentences[0] / seconds)
    return summary(rates)


def _row_main(spec_path, out_path):
    """``python -m multipath_nmt.benchmark.gpu_bench SPEC OUT``: one row (what :func:`run`
    starts for each); writes its figures, or its error, to OUT as JSON."""
    import logging
    import warnings

    logging.basicConfig(level=logging.WARNING, force=True)
    warnings.filterwarnings("ignore")
    with open(spec_path) as f:
        job = json.load(f)
    started_s = time.time() - job["spawned_at"]  # the interpreter and this module's imports
    try:
        result = measure_row(job["spec"], job["size"], job["device"])
        result["phases_s"] = {"process_start": started_s, **result["phases_s"]}
    except Exception as error:  # noqa: BLE001 the parent reports it as the row's finding
        lines = str(error).strip().splitlines()
        result = {"error": f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]}
    with open(out_path, "w") as f:
        json.dump(result, f)


# --- the whole run -----------------------------------------------------------------------------

def run(size_name="gpu", device="cuda", precision="bf16", only=None, compile_backend="inductor",
        commit=None, budget_s=None, log=print, on_row=None):
    """Run every row (``only``: these names) in a process of its own; returns the result dict
    that :func:`markdown_report` renders. A row not started within ``budget_s`` of the run's
    start is reported as not run. ``on_row(result)``: called with the result so far after each
    row (the CLI writes the reports then, so a run stopped by its lease keeps its rows)."""
    start = time.perf_counter()
    size = SIZES[size_name]
    budget_s = size["budget_s"] if budget_s is None else budget_s
    dtypes = sorted({"fp16" if device == "cuda" else "fp32", precision})
    peaks = {d: matmul_peak_flops(device, DTYPES[d], size["matmul_n"]) for d in dtypes}
    log(f"matrix-multiply rate: {', '.join(f'{d} {r / 1e12:.1f} TFLOP/s' for d, r in peaks.items())}")
    results = {}
    machine = environment(device, commit)
    loss_check = {}  # after the rows, so that nothing it does reaches them

    def result(rows_so_far):
        return {"size": size_name, "shape": size, "device": device, "precision": precision,
                "update_freq": UPDATE_FREQ, "environment": machine,
                "matmul_peak_flops": peaks, "loss_past_int32": loss_check,
                "command": shlex.join(sys.argv),
                "rows": dict(rows_so_far), "seconds": time.perf_counter() - start}

    with fake_data_dir(size["vocab"]) as data, tempfile.TemporaryDirectory() as work:
        lineup = [(n, s) for n, s in rows(data, size, device, precision, compile_backend)
                  if not only or n in only]
        for index, (name, spec) in enumerate(lineup):
            left = budget_s - (time.perf_counter() - start)
            command = shlex.join(["fairseq-train", *spec["argv"]])
            env_words = " ".join(f"{k}={v}" for k, v in spec["env"].items())
            row = {"command": f"{env_words} {command}".strip(), "dtype": spec["dtype"]}
            if left <= 0:
                row.update(error=f"{NOT_RUN}: the time budget of {budget_s:.0f} s was spent",
                           not_run=True)
            else:
                row.update(_run_row(spec, size, device, work, index,
                                    min(size["row_timeout_s"], left + 30)))
            if "tokens_per_s" in row:
                row["mfu"] = (row["train_flops_per_token"] * row["tokens_per_s"]["median"]
                              / peaks[spec["dtype"]])
            results[name] = row
            log(f"{name}: {json.dumps(row)[:240]}")
            if on_row:
                on_row(result(results))
    loss_check.update(loss_past_int32(size, device))
    log(f"fairseq's loss past 2^31 elements: {json.dumps(loss_check)}")
    return result(results)


def loss_past_int32(size, device):
    """fairseq's label-smoothed loss over the size's ``loss_check`` (tokens, types) logits in
    bf16, at once and in chunks (:func:`multipath_nmt.benchmark.large_vocab.check`); on the
    GPU 65,536 x 34,880, past 2^31 elements, in the parent process after the rows. Its error,
    if it fails, is the finding."""
    from multipath_nmt.benchmark import large_vocab

    tokens, types = size["loss_check"]
    try:
        return large_vocab.check(tokens, types, device)
    except Exception as error:  # noqa: BLE001 reported as the check's finding
        if device == "cuda":
            torch.cuda.empty_cache()
        return {"tokens": tokens, "types": types,
                "error": f"{type(error).__name__}: {str(error).strip()[:300]}"}


def _run_row(spec, size, device, work, index, timeout):
    spec_path = os.path.join(work, f"row{index}.json")
    out_path = os.path.join(work, f"row{index}.out.json")
    with open(spec_path, "w") as f:
        json.dump({"spec": spec, "size": size, "device": device, "spawned_at": time.time()}, f)
    started = time.perf_counter()
    try:
        finished = subprocess.run(
            [sys.executable, "-m", "multipath_nmt.benchmark.gpu_bench", spec_path, out_path],
            env={**os.environ, **spec["env"]}, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s", "seconds": timeout}
    row = {"seconds": time.perf_counter() - started}
    if os.path.exists(out_path):
        with open(out_path) as f:
            row.update(json.load(f))
    else:
        tail = (finished.stderr.strip().splitlines() or ["no output"])[-1]
        row["error"] = f"exit status {finished.returncode}: {tail[:300]}"
    return row


def exit_status(result):
    """The run's exit status: :data:`EXIT_FAILED` when a row that was started failed (an error,
    a crash, a timeout), else :data:`EXIT_NOT_RUN` when the time budget left rows unstarted,
    else 0 (a failed loss check past 2^31 elements counts as a failed row). A budget-starved run
    is told apart from a crashed row."""
    rows_ = result["rows"].values()
    if any("error" in row and not row.get("not_run") for row in rows_) \
            or "error" in result.get("loss_past_int32", {}):
        return EXIT_FAILED
    return EXIT_NOT_RUN if any(row.get("not_run") for row in rows_) else 0


# --- the report --------------------------------------------------------------------------------

def _ratio(rows_, name, other, key="tokens_per_s"):
    a, b = rows_.get(name, {}).get(key), rows_.get(other, {}).get(key)
    if not a or not b:
        return None
    return a["median"] / b["median"]


def targets(result):
    """The targets of issues 56 and 47, as ratios measured in this run: (text, value, needed,
    met)."""
    r = result["rows"]
    out = []

    def target(text, value, needed, higher_is_better=True):
        if value is not None:
            out.append((text, value, (">=" if higher_is_better else "<=") + f" {needed}",
                        value >= needed if higher_is_better else value <= needed))

    # issue 56: train.sh's one-card micro-batch against stock fairseq as its users run it
    target(f"{BASE + ONE_CARD} tokens/s vs the anchor", _ratio(r, BASE + ONE_CARD, ANCHOR), 3.0)
    for name in (BASE + ONE_CARD, MULTIPATH + ONE_CARD):
        if "mfu" in r.get(name, {}):
            target(f"{name}: MFU", r[name]["mfu"], 0.2)
    target(f"{MULTIPATH + ONE_CARD} vs {DEEP + ONE_CARD}, training tokens/s",
           _ratio(r, MULTIPATH + ONE_CARD, DEEP + ONE_CARD), 1.0)
    target(f"{BASE} (train.sh) tokens/s vs the anchor", _ratio(r, BASE, ANCHOR), 1.0)
    target(f"{ANCHOR + ONE_CARD} tokens/s vs the anchor", _ratio(r, ANCHOR + ONE_CARD, ANCHOR),
           1.0)
    check = result.get("loss_past_int32", {})
    if "relative_difference" in check:
        what = f"fairseq's loss over {check['tokens']:,} x {check['types']:,} logits"
        target(f"{what}, at once vs in chunks below 2^31: relative difference",
               check["relative_difference"], 1e-4, higher_is_better=False)
        for part in ("loss", "grad"):
            target(f"{what}: the last 1,024 rows' {part} vs in chunks, largest difference",
                   check[f"last_rows_{part}_max_difference"], 1e-6, higher_is_better=False)
    # the memory model (recipe/memory_model.py): a measured peak within PEAK_OVER_ESTIMATE_MAX
    # of the estimate, well short of the 2x at which the planned micro-batch runs out of
    # memory, and above half of it (a peak without the activations would be far below); and no
    # allocation retried after the allocator freed its cache (the card's memory was pressed)
    for name, row in r.items():
        if row.get("peak_memory_mib") and row.get("planned_peak_mib"):
            share = row["peak_memory_mib"] / row["planned_peak_mib"]
            target(f"{name}: peak MiB / the memory model's estimate", share,
                   PEAK_OVER_ESTIMATE_MAX, higher_is_better=False)
            target(f"{name}: peak MiB / the memory model's estimate", share, 0.5)
        if "alloc_retries" in row:
            target(f"{name}: the allocator's retries", row["alloc_retries"], 0,
                   higher_is_better=False)
    target(f"{MULTIPATH} vs {DEEP}, training tokens/s", _ratio(r, MULTIPATH, DEEP), 1.0)
    for suffix in (ONE_CARD, ""):
        target(f"{MULTIPATH + suffix} vs {DEEP + suffix}, beam sentences/s",
               _ratio(r, MULTIPATH + suffix, DEEP + suffix, "beam_sentences_per_s"), 0.95)
    target(f"{MULTIPATH + ONE_CARD}: --compile-layers vs eager tokens/s",
           _ratio(r, MULTIPATH + ONE_CARD + COMPILED, MULTIPATH + ONE_CARD), 1.2)
    launches = {n: row.get("kernel_launches_per_update") for n, row in r.items()}
    for suffix in (ONE_CARD, ""):
        if launches.get(MULTIPATH + suffix) and launches.get(DEEP + suffix):
            target(f"kernel launches per update, {MULTIPATH + suffix} vs {DEEP + suffix}",
                   launches[MULTIPATH + suffix] / launches[DEEP + suffix], 1.0,
                   higher_is_better=False)
    # Host syncs against stock fairseq's transformer trained as train.sh trains it: the
    # anchor's count is not comparable (on an H200, 2026-11-27 and -28, the counter saw none of the
    # per-layer padding reads of fairseq's encoder in the anchor's process, which every row
    # runs, so it undercounts there; gpu-bench-h200.json keeps its raw figure).
    base_syncs = r.get(BASE, {}).get("host_syncs_per_update")
    if base_syncs is not None:
        # fairseq reads whether a batch has padding once per encoder layer: Deep24 has its
        # own count, every other row has the base model's 6 layers
        for name, row in r.items():
            if not name.startswith((ANCHOR, BASE, DEEP)) and ONE_CARD not in name \
                    and "host_syncs_per_update" in row:
                target(f"host syncs per update, {name}, more than {BASE}'s {base_syncs}",
                       row["host_syncs_per_update"] - base_syncs, 0, higher_is_better=False)
    return out


def _count(value):
    return "n/a" if value is None else f"{value:,}"


def markdown_report(result):
    env = result["environment"]
    peaks = ", ".join(f"{d} {rate / 1e12:.1f} TFLOP/s" for d, rate
                      in result["matmul_peak_flops"].items())
    anchor = result["rows"].get(ANCHOR, {}).get("tokens_per_s")
    lines = [
        f"Device: {env['device']}" + (f" (driver {env['driver']}, CUDA {env['cuda']}, cuDNN "
                                      f"{env['cudnn']})" if result["device"] == "cuda" else "")
        + f"; torch {env['torch']}, fairseq {env['fairseq']}, Python {env['python']}; commit "
        f"{env['commit']}; size `{result['size']}` (d {result['shape']['dim']}; "
        f"{result['shape']['max_tokens']}-token micro-batches, {result['update_freq']} per "
        f"update except in the one-card rows); train.sh precision {result['precision']}; "
        f"matrix-multiply rate measured in this run ({result['shape']['matmul_n']}^3): {peaks}. "
        f"{result['seconds']:.0f} s.", "",
        "| row | dtype | micro-batch x update-freq | tokens/s median [min-max] | vs anchor | MFU "
        "| peak MiB (model's estimate) [reserved, retries] | ms per update: fwd+bwd + update | host syncs / update | "
        "kernel launches / update | beam sent/s | first update s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["rows"].items():
        if "error" in row:
            lines.append(f"| {name} | {row['dtype']} | {row['error']} | | | | | | | | | |")
            continue
        rate = row["tokens_per_s"]
        versus = f"{rate['median'] / anchor['median']:.2f}x" if anchor else ""
        memory = f"{row['peak_memory_mib']:,.0f}" if "peak_memory_mib" in row else ""
        if row.get("planned_peak_mib"):
            memory += f" ({row['planned_peak_mib']:,.0f})"
        if "peak_reserved_mib" in row:
            memory += f" [{row['peak_reserved_mib']:,.0f}, {row['alloc_retries']}]"
        beam = (median_range(row["beam_sentences_per_s"], ",.1f") if "beam_sentences_per_s" in row
                else "")
        lines.append(
            f"| {name} | {row['dtype']} | {row['max_tokens']:,} x {row['update_freq']} | "
            f"{median_range(rate, ',.0f')} | {versus} | {100 * row['mfu']:.1f}% "
            f"| {memory} | {row['forward_backward_ms']:.1f} + {row['update_ms']:.1f} | "
            f"{'' if name.startswith(ANCHOR) else row.get('host_syncs_per_update', 'n/a')} | "
            f"{_count(row.get('kernel_launches_per_update'))} | {beam} | "
            f"{row['first_update_s']:.1f} |")
    check = result.get("loss_past_int32")
    if check:
        lines += ["", f"fairseq's label-smoothed loss over {check['tokens']:,} x "
                  f"{check['types']:,} bf16 logits (multipath_nmt/benchmark/large_vocab.py), at "
                  "once and in chunks below 2^31 elements: " + (
                      check["error"] if "error" in check else
                      f"relative difference {check['relative_difference']:.2e}, the last rows' "
                      f"losses {check['last_rows_loss_max_difference']:.2e} and gradients "
                      f"{check['last_rows_grad_max_difference']:.2e} apart.")]
    lines += ["", MFU_NOTE, "Peak MiB: CUDA's peak allocation over the timed windows, which "
              "fairseq's per-update reset no longer empties (activations included); in brackets "
              "the estimate of train.sh's memory model (multipath_nmt/recipe/memory_model.py) "
              "for that micro-batch; in square brackets the peak the allocator reserved from the "
              "driver (max_memory_reserved) and its retries after freeing its cache "
              "(num_alloc_retries).",
              "The anchor's host syncs are left out: its process counted none of the padding "
              "reads of fairseq's encoder that every row makes (it undercounts there; the raw "
              "figure is in the JSON). The rows are compared with the base model's instead.",
              "The compiled rows' host syncs and kernel launches are n/a: torch.compile runs "
              "layers eagerly while a dispatch-mode counter is active, so those counters would "
              "count the eager layers.",
              "", "| target | measured | needed | met |", "|---|---|---|---|"]
    for text, value, needed, met in targets(result):
        lines.append(f"| {text} | {value:.3f} | {needed} | {'yes' if met else '**no**'} |")
    phased = {n: r["phases_s"] for n, r in result["rows"].items() if "phases_s" in r}
    if phased:
        names = list(dict.fromkeys(k for p in phased.values() for k in p))  # every row's
        lines += ["", "Where each row's seconds went (its process; the timed windows are one "
                  "phase):", "", "| row | " + " | ".join(names) + " | row total |",
                  "|---|" + "---|" * (len(names) + 1)]
        lines += [f"| {n} | " + " | ".join(f"{p.get(k, 0):.1f}" for k in names)
                  + f" | {result['rows'][n]['seconds']:.1f} |" for n, p in phased.items()]
    lines += ["", "Commands (fairseq-train's arguments; the data-bin is a dictionaries-only "
              "folder, batches are synthetic):", ""]
    lines += [f"- {name}: `{row['command']}`" for name, row in result["rows"].items()]
    return "\n".join(lines) + "\n"


def write_reports(result, out):
    from multipath_nmt.atomic_files import write_text_atomically

    os.makedirs(out, exist_ok=True)
    write_text_atomically(os.path.join(out, "gpu-bench.json"), json.dumps(result, indent=1))
    write_text_atomically(os.path.join(out, "gpu-bench.md"), markdown_report(result))
    profiled = {name: row["profile"] for name, row in result["rows"].items() if "profile" in row}
    if profiled:
        from multipath_nmt.benchmark.profile import markdown

        write_text_atomically(os.path.join(out, "profile.md"), markdown(profiled))


if __name__ == "__main__":
    _row_main(*sys.argv[1:])
