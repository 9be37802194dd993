"""The GPU check behind ``scripts/gpu-check.sh``: a tool of its own that builds on the benchmark's
systems, batches, clock and FLOP counting (nothing else in the package depends on it).

For every architecture family (stock transformer, multi-path, WideNet, MoE, EWA, ParameterNet) it
trains through the command that ``scripts/train.sh`` runs: ``recipe.train_command`` turns
train.sh's arguments (the arch, ``--precision``, the batch) into fairseq-train's command line,
so the optimizer is ``adam_fused``, the precision is the recipe's (``--amp --bf16`` or ``--amp``,
fp32 weights), every update is 2 micro-batches (``--update-freq 2``), and the learning rate and
criterion are the recipe's for the arch. Only these differ from a real run: the model size (the
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
"""
import collections
import contextlib
import copy
import gc
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
import types
import warnings

import torch

from multipath_nmt import recipe
from multipath_nmt.atomic_files import write_text_atomically
from multipath_nmt.benchmark.batches import fake_data_dir, padded_batches, synthetic_dataset
from multipath_nmt.benchmark.flops import (
    gemm_peak_flops,
    model_gemm_shapes,
    training_flops_per_token,
)
from multipath_nmt.benchmark.report import machine_description
from multipath_nmt.benchmark.systems import System, build_trainer_from_argv, systems_for
from multipath_nmt.benchmark.timing import elapsed_seconds
from multipath_nmt.training_log import PlotLogError, parse_log

# "gpu" is the size the check is made for; "tiny" runs the same code on the CPU in seconds (the
# tests). The gpu size was estimated at about 10 minutes on one GPU when a step was one batch in
# fp16; each system now trains 4 times the tokens (2 micro-batches per update, then again in
# fp32), plus the 2-GPU runs: the check reports its own time, not yet measured on a GPU. ``steps`` updates per system (each of
# UPDATE_FREQ micro-batches of up to ``max_tokens``), the first ``warmup_steps`` neither timed nor
# counted for syncs (allocator, cuBLAS heuristics). ``lr_warmup_updates`` replaces the recipe's
# --warmup-updates; ``ddp_updates`` is the length of the fairseq-train run on 2 GPUs.
CHECK_SIZES = {
    "tiny": dict(dim=64, ffn=256, heads=4, vocab=1000, base_layers=2, decoder_layers=1,
                 max_tokens=256, mean_length=12, steps=6, warmup_steps=2, lr_warmup_updates=2,
                 beam_sentences=8, gemm_repeats=2, ddp_updates=4),
    "gpu": dict(dim=512, ffn=2048, heads=8, vocab=32000, base_layers=6, decoder_layers=6,
                max_tokens=4096, mean_length=28, steps=50, warmup_steps=10,
                lr_warmup_updates=10, beam_sentences=256, gemm_repeats=20, ddp_updates=20),
}
# train.sh's micro-batches per update: its default batch is max-tokens x GPUs x 2 for the deep
# recipe (the check asks for that batch with --batch-tokens, for every arch)
UPDATE_FREQ = 2
# --precision: train.sh's (``auto`` as train.sh picks it), and memory-efficient-fp16, fairseq's
# fp16 optimizer and loss scaler added to the recipe's fp32 command: not what train.sh runs, but
# the one loss scaler that runs on the CPU, for the tests.
PRECISIONS = ("auto", *recipe.PRECISIONS, "memory-efficient-fp16")
CPU_STAND_INS = {"memory-efficient-fp16": ("fp32", ["--memory-efficient-fp16"])}
# Mixed precision passes when its last loss is within this share of the loss fall that fp32
# reached over the same updates, from the same weights, on the same batches. A working autocast
# changes the trajectory only by rounding (bf16 keeps 8 bits of mantissa, fp16 11; the fp32 master
# weights and Adam state are the same): at the tiny size on the CPU, bf16 ended 0.1-0.2% of fp32's
# fall away (0.001 bits of about 0.7). A precision bug that slows learning, like fairseq 0.12's
# --amp unscaling every gradient twice (Adam then took steps about 3x too small for small
# gradients), loses a large share of the fall. A share of the fall rather than of the loss: the
# loss of synthetic (random) tokens starts near log2(vocab) and falls by a few percent of itself
# in so few updates (6% at the tiny size), so a 1% gap in the loss could be a sixth of all that
# was learned. Not yet measured on a GPU.
MAX_GAP_OF_FALL = 0.1
DDP_GPUS = 2
STOCK = "stock prenorm L"


def check_systems(size):
    """One system per architecture family, built like ``multipath-bench``'s."""
    by_name = {s.name: s for s in systems_for(size)}
    moe = System(
        "MoE (E4 k2, every 2nd layer)", "moe_transformer_wmt_en_de",
        [f"--encoder-layers={size['base_layers']}"],
        criterion="label_smoothed_cross_entropy_with_moe", compare_to=STOCK, group="MoE")
    names = [STOCK, "multi-path L x 4 (full)", "WideNet (shared attn + MoE E4 k2)", None,
             "EWA (E4, every-2)", "ParameterNet (routed, both)", "ParameterNet (dynamic, both)"]
    return [moe if name is None else by_name[name] for name in names]


def model_flags(size, system):
    """fairseq-train's flags for the model size of the check (the recipe sets none of them)."""
    return [
        f"--encoder-embed-dim={size['dim']}", f"--decoder-embed-dim={size['dim']}",
        f"--encoder-ffn-embed-dim={size['ffn']}", f"--decoder-ffn-embed-dim={size['ffn']}",
        f"--encoder-attention-heads={size['heads']}",
        f"--decoder-attention-heads={size['heads']}",
        f"--decoder-layers={size['decoder_layers']}", "--dropout=0.1", *system.flags,
    ]


def train_sh_arguments(size, system, precision, languages=("src", "tgt"), workers=1,
                       updates=None):
    """train.sh's arguments for one system: its arch and precision, a batch of UPDATE_FREQ
    micro-batches of ``max_tokens`` per worker, the check's model size, its length (``updates``,
    default: the check's ``steps``; EWA's schedule runs over it), a short learning-rate warm-up
    and a fixed seed (fairseq flags after the recipe's override them)."""
    recipe_precision, extra = CPU_STAND_INS.get(precision, (precision, []))
    return ["--arch", system.arch, "--precision", recipe_precision,
            "--max-tokens", str(size["max_tokens"]),
            "--batch-tokens", str(UPDATE_FREQ * size["max_tokens"] * workers),
            "-s", languages[0], "-t", languages[1], *model_flags(size, system),
            "--max-update", str(updates or size["steps"]),
            "--warmup-updates", str(size["lr_warmup_updates"]), "--seed", "1",
            "--no-progress-bar", *extra]


def check_command(data_dir, save_dir, size, system, precision, gpus, languages=("src", "tgt"),
                  extra=(), bf16=None, updates=None):
    """``recipe.train_command`` for one system: the fairseq-train command train.sh would run on
    ``gpus`` GPUs (0: the CPU), at the check's size. ``extra``: more fairseq-train flags."""
    return recipe.train_command(
        data_dir, save_dir, [*train_sh_arguments(size, system, precision, languages,
                                                 max(gpus, 1), updates), *extra],
        gpus=gpus, bf16=bf16)


def precision_flags(precision):
    """fairseq-train's flags for one of :data:`PRECISIONS` (after ``auto`` is resolved)."""
    base, extra = CPU_STAND_INS.get(precision, (precision, []))
    return [*recipe.PRECISIONS[base], *extra]


def resolve_precision(precision, device, bf16=None):
    """The precision the check trains in: ``auto`` as train.sh picks it (bf16 on GPUs that have
    it, else fp16; fp32 on the CPU); a request this device cannot run raises RecipeError."""
    if precision in CPU_STAND_INS:
        return precision
    return recipe.choose_precision(precision, int(device == "cuda"), bf16)


class SyncWarnings:
    """Counts the synchronizing CUDA operations ``torch.cuda.set_sync_debug_mode("warn")`` warns
    about inside the block, in all and by the Python line that caused them. Other warnings are
    shown as usual. ``set_mode`` is ``torch.cuda.set_sync_debug_mode`` (a fake in the tests)."""

    MESSAGE = "called a synchronizing CUDA operation"

    def __init__(self, set_mode=None):
        self.set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self.total, self.by_line = 0, {}

    def __enter__(self):
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")
        self.set_mode("warn")
        return self

    def __exit__(self, *exc):
        self.set_mode("default")
        self._catcher.__exit__(*exc)
        syncs = [w for w in self._caught if self.MESSAGE in str(w.message)]
        for w in self._caught:
            if w not in syncs:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.total = len(syncs)
        self.by_line = dict(collections.Counter(f"{w.filename}:{w.lineno}"
                                                for w in syncs).most_common())
        return False


def loss_scale_reader(optimizer):
    """A function that reads the optimizer's loss scale without synchronizing: fairseq's fp16
    optimizers keep it as a Python number, ``--amp``'s GradScaler as a device tensor (read as a
    copy, which ``float`` turns into a number after the timed steps). None where nothing is
    scaled (fp32; bf16, whose GradScaler is disabled)."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None:
        return lambda: None
    if hasattr(scaler, "loss_scale"):  # fairseq's DynamicLossScaler
        return lambda: scaler.loss_scale
    if not scaler.is_enabled():
        return lambda: None

    def read():
        scale = getattr(scaler, "_scale", None)  # None before the first scaled backward
        return scaler.get_scale() if scale is None else scale.detach().clone()

    return read


def halvings(scales):
    """How often a loss scale series (start first) was halved: one overflow each (``--amp``
    may retry a batch at a halved scale within one update)."""
    return sum(round(math.log2(earlier / later)) for earlier, later in zip(scales, scales[1:])
               if earlier is not None and later is not None and later < earlier)


def train_and_watch(trainer, batches, steps, warmup_steps, device, count_syncs=None,
                    update_freq=1):
    """``steps`` updates through fairseq's Trainer, each of ``update_freq`` micro-batches of
    ``batches`` (cycled) in one ``train_step``, as fairseq-train's ``--update-freq`` does. Every
    update: skipped or not (fairseq skips the update when the fp16 gradients overflow and halves
    the loss scale), its loss and the loss scale after it. After the first ``warmup_steps``: the
    time, the tokens, and (``count_syncs``, a ``SyncWarnings``-like context) the
    synchronizations."""
    scale = loss_scale_reader(trainer.optimizer)
    initial = scale()
    log = dict(initial_loss_scale=None if initial is None else float(initial), losses=[],
               loss_scales=[], skipped=0, update_freq=update_freq)

    def samples(index):
        return [batches[(index * update_freq + i) % len(batches)] for i in range(update_freq)]

    def step(index):
        output = trainer.train_step(samples(index))
        log["skipped"] += output is None  # an overflow, or an out-of-memory batch
        if output is not None:
            log["losses"].append(float(output["loss"]))
        log["loss_scales"].append(scale())

    for index in range(warmup_steps):
        step(index)
    timed = range(warmup_steps, steps)
    tokens = sum(sample["ntokens"] for index in timed for sample in samples(index))
    syncs = count_syncs() if count_syncs else contextlib.nullcontext()
    if device == "cuda":
        trainer.cuda_env = None  # else fairseq resets the peak-memory counter at every step
        torch.cuda.reset_peak_memory_stats()

    def timed_steps():
        with syncs:  # the steps only, not the clock's own synchronization
            for index in timed:
                step(index)

    seconds = elapsed_seconds(timed_steps, 1, device)
    log["loss_scales"] = [None if s is None else float(s) for s in log["loss_scales"]]
    log.update(
        steps=steps, timed_steps=len(timed), tokens_per_s=tokens / seconds,
        overflows=halvings([log["initial_loss_scale"], *log["loss_scales"]]),
        losses_finite=bool(log["losses"]) and all(map(math.isfinite, log["losses"])),
        loss_fell=len(log["losses"]) > 1 and log["losses"][-1] < log["losses"][0],
        peak_memory_mib=torch.cuda.max_memory_allocated() / 2 ** 20 if device == "cuda" else None,
        sync_warnings_per_step=syncs.total / len(timed) if count_syncs else None,
        sync_warning_lines=dict(list(syncs.by_line.items())[:5]) if count_syncs else None)
    return log


def compare_losses(mixed, fp32):
    """The last losses of a mixed-precision run and of fp32 over the same updates: the gap
    (mixed - fp32, base 2), relative to fp32's last loss and as a share of the loss fall fp32
    reached, and whether it passes (within MAX_GAP_OF_FALL of that fall; fp32's loss must have
    fallen, or there is nothing to reach)."""
    fall = fp32[0] - fp32[-1]
    gap = mixed[-1] - fp32[-1]
    share = abs(gap) / fall if fall > 0 else None
    return dict(fp32_first=fp32[0], fp32_last=fp32[-1], mixed_last=mixed[-1], gap=gap,
                relative_gap=gap / fp32[-1], gap_share_of_fp32_fall=share,
                passed=share is not None and share <= MAX_GAP_OF_FALL)


def translations(model, task, samples, beam=4):
    """Sentence id -> best hypothesis (token ids) of fairseq's SequenceGenerator."""
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([model], task.target_dictionary, beam_size=beam,
                                  max_len_a=1.2, max_len_b=10, len_penalty=0.6)
    model.eval()
    out = {}
    with torch.no_grad():
        for sample in samples:
            for sentence_id, hypos in zip(sample["id"].tolist(),
                                          generator.generate([model], sample)):
                out[sentence_id] = hypos[0]["tokens"].tolist()
    model.train()
    return out


def compare_translations(hypotheses, references):
    """How far one precision's beam search (``hypotheses``) is from another's (``references``),
    both sentence id -> token ids: the share of identical hypotheses, and BLEU of one against
    the other (token ids as words)."""
    import sacrebleu

    if hypotheses.keys() != references.keys():
        raise ValueError("the two translations cover different sentences")
    ids = sorted(hypotheses)
    identical = sum(hypotheses[i] == references[i] for i in ids) / len(ids)
    words = lambda tokens: " ".join(map(str, tokens))  # noqa: E731
    bleu = sacrebleu.corpus_bleu([words(hypotheses[i]) for i in ids],
                                 [[words(references[i]) for i in ids]], tokenize="none")
    return {"sentences": len(ids), "identical": identical, "bleu": bleu.score}


def compare_precisions(trainer, task, samples, attention_calls=None, dtype=None):
    """Beam search with the trainer's model (a ``dtype`` copy of it where given: float16 as
    ``scripts/translate.sh`` decodes on a GPU; else as it is) against a float32 copy of the same
    weights. ``attention_calls``: a dict that receives, for the first model's beam search, what
    each attention call site passes to SDPA (``multipath_nmt.attention``)."""
    from multipath_nmt.attention import attention_calls as record_attention_calls

    model = trainer.model if dtype is None else copy.deepcopy(trainer.model).to(dtype)
    samples = [trainer._prepare_sample(sample)[0] for sample in samples]
    float32 = copy.deepcopy(trainer.model).float()
    hypotheses = {}

    def translate():
        hypotheses.update(translations(model, task, samples))

    if attention_calls is None:
        translate()
    else:
        attention_calls.update(record_attention_calls(model, translate))
    return compare_translations(hypotheses, translations(float32, task, samples))


def compute_dtype(cfg):
    """The dtype of the matrix products under a fairseq config's precision."""
    if cfg.common.bf16:
        return torch.bfloat16
    if cfg.common.fp16 or cfg.common.memory_efficient_fp16 or cfg.common.amp:
        return torch.float16
    return torch.float32


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
                             count_syncs, update_freq)
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
                          update_freq=trainer.cfg.optimization.update_freq[0])
    return {key: log[key] for key in ("losses", "losses_finite", "loss_fell", "tokens_per_s")}


def release_memory(device):
    """Free what a finished system left: its reference cycles, and on CUDA the cached blocks."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def write_synthetic_train_split(data_dir, languages, sentences, mean_length, seed=3):
    """A binarized ``train`` split of synthetic sentence pairs (``batches.synthetic_dataset``)
    in a data dir that has the dictionaries (``batches.fake_data_dir``), for fairseq-train."""
    from fairseq.data import Dictionary, indexed_dataset

    dictionary = Dictionary.load(os.path.join(data_dir, f"dict.{languages[0]}.txt"))
    task = types.SimpleNamespace(
        source_dictionary=dictionary, target_dictionary=dictionary,
        cfg=types.SimpleNamespace(left_pad_source=True, left_pad_target=False))
    dataset = synthetic_dataset(task, sentences, mean_length, seed)
    source, target = languages
    for lang, column in ((source, dataset.src), (target, dataset.tgt)):
        prefix = os.path.join(data_dir, f"train.{source}-{target}.{lang}")
        builder = indexed_dataset.make_builder(prefix + ".bin", impl="mmap",
                                               vocab_size=len(dictionary))
        for tokens in column:
            builder.add_item(tokens)
        builder.finalize(prefix + ".idx")


def ddp_command(data_dir, save_dir, size, system, precision, gpus, languages=("src", "tgt"),
                bf16=None):
    """The recipe's fairseq-train command on ``gpus`` GPUs (fairseq starts one process per GPU,
    DDP): ``ddp_updates`` updates logged one by one as JSON, no validation, no checkpoint."""
    return check_command(
        data_dir, save_dir, size, system, precision, gpus, languages,
        ["--log-format", "json", "--log-interval", "1", "--disable-validation", "--no-save"],
        bf16=bf16, updates=size["ddp_updates"])


def train_losses(log_path):
    """The per-update losses of a fairseq-train log (``train_inner`` lines), in update order."""
    try:
        return [loss for _, loss in sorted(parse_log(log_path).train_inner)]
    except PlotLogError:
        return []


def ddp_leg(data_dir, size, system, precision, gpus, languages=("src", "tgt"), launch=None,
            timeout=600):
    """Run :func:`ddp_command` as a subprocess; returns its command, exit status, losses and
    whether they fell, and the seconds it took. ``launch``: the command line -> the one to run
    (the tests start two gloo processes on the CPU with ``torchrun`` this way)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-ddp-") as save_dir:
        command = ddp_command(data_dir, save_dir, size, system, precision, gpus, languages)
        argv = launch(command.argv) if launch else command.argv
        log_path = os.path.join(save_dir, "train.log")
        start = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                status = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                status = None
        seconds = time.perf_counter() - start
        losses = train_losses(log_path)
        with open(log_path, errors="replace") as log:
            tail = log.read()[-3000:]
    result = dict(command=shlex.join(argv), gpus=gpus, exit_status=status, seconds=seconds,
                  updates=len(losses), loss_first=losses[0] if losses else None,
                  loss_last=losses[-1] if losses else None,
                  loss_fell=len(losses) > 1 and losses[-1] < losses[0])
    if status != 0 or not result["loss_fell"]:
        result["output_tail"] = tail
    return result


def failed_checks(result):
    """What a system's figures fail: finite losses, a falling loss, mixed precision against
    fp32, the fairseq-train run on 2 GPUs."""
    failed = []
    if not result["losses_finite"]:
        failed.append("a loss was not finite")
    if not result["loss_fell"]:
        failed.append("the loss did not fall")
    versus = result.get("vs_fp32")
    if versus and not versus["passed"]:
        failed.append("fp32's loss did not fall" if versus["gap_share_of_fp32_fall"] is None
                      else f"the last loss is {versus['gap']:+.3f} from fp32's "
                           f"({100 * versus['gap_share_of_fp32_fall']:.0f}% of its fall)")
    ddp = result.get("ddp")
    if ddp and ddp["exit_status"] != 0:
        failed.append(f"fairseq-train on {ddp['gpus']} GPUs exited with {ddp['exit_status']}")
    elif ddp and not ddp["loss_fell"]:
        failed.append(f"fairseq-train on {ddp['gpus']} GPUs: the loss did not fall")
    return failed


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


@contextlib.contextmanager
def ddp_data_dir(data, size, languages, gpus):
    """A data-bin for the fairseq-train runs: ``data`` if given, else synthetic sentences
    enough for ``ddp_updates`` updates on ``gpus`` GPUs, written beside the dictionaries of
    ``batches.fake_data_dir``."""
    if data:
        yield data
        return
    with fake_data_dir(size["vocab"]) as folder:
        tokens = size["ddp_updates"] * max(gpus, 1) * UPDATE_FREQ * size["max_tokens"]
        write_synthetic_train_split(folder, languages, math.ceil(tokens / size["mean_length"]),
                                    size["mean_length"])
        yield folder


def run_check(size_name="gpu", device="cuda", precision="auto", data=None, only=None,
              log=print, count_syncs=None, ddp_gpus=None, bf16=None):
    """Check every system; returns the result dict ``markdown_report`` renders. ``data``: a
    data-bin (joined dictionary) whose train and valid splits give the batches. ``ddp_gpus``:
    GPUs for the fairseq-train runs (default: 2 where 2 or more are visible, else none).
    ``bf16``: whether the GPU has bfloat16, for ``--precision auto`` (default: it is asked)."""
    from fairseq.data import data_utils

    start = time.perf_counter()
    size = CHECK_SIZES[size_name]
    trained_in = resolve_precision(precision, device, bf16)
    if count_syncs is None and device == "cuda":
        count_syncs = SyncWarnings
    if ddp_gpus is None:
        ddp_gpus = DDP_GPUS if device == "cuda" and torch.cuda.device_count() >= DDP_GPUS else 0
    systems = [s for s in check_systems(size) if not only or s.name in only]
    results = {}
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
            except Exception as error:  # a failed system is a finding; check the others
                results[system.name] = {"error": f"{type(error).__name__}: {error}"}
            release_memory(device)  # the failed system's trainer too (its traceback is gone)
            results[system.name]["seconds"] = time.perf_counter() - system_start
            log(f"{system.name}: {json.dumps(results[system.name])[:300]}")
    return {"size": size_name, "shape": size, "device": device, "precision": trained_in,
            "precision_asked": precision,
            "precision_flags": precision_flags(trained_in),
            "update_freq": UPDATE_FREQ, "lr_warmup_updates": size["lr_warmup_updates"],
            "max_gap_of_fall": MAX_GAP_OF_FALL, "ddp_gpus": ddp_gpus,
            "data": data, "machine": machine_description(device), "systems": results,
            "seconds": time.perf_counter() - start}


def failed(result):
    """Whether any system of a check failed to run or failed a check (exit status 3)."""
    return any("error" in r or r.get("failed_checks") for r in result["systems"].values())


def _number(value, form):
    return "" if value is None else format(value, form)


def markdown_report(result):
    from multipath_nmt.attention import format_attention_calls

    systems = result["systems"]
    stock = systems.get(STOCK, {}).get("tokens_per_s")
    ddp_gpus = result.get("ddp_gpus") or DDP_GPUS
    flags = " ".join(result.get("precision_flags", [])) or "no precision flags"
    lines = [
        f"Machine: {result['machine']}; device {result['device']}, {result['precision']} "
        f"(`{flags}`); size `{result['size']}` {json.dumps(result['shape'])}; batches: "
        f"{result['data'] or 'synthetic, length-varied'}. MFU: measured training FLOPs per "
        "token x tokens/s / the best rate this device reached on the model's own matrix "
        "products (`gemm_peak_flops` in check.json).", "",
    ]
    if "update_freq" in result:
        lines += [
            "Every system trains through the fairseq-train command that `scripts/train.sh` runs "
            "(`recipe.train_command`: `--optimizer adam_fused`, the recipe's learning rate and "
            f"criterion, `--update-freq {result['update_freq']}`, the precision above), at the "
            f"check's model size and with `--warmup-updates {result['lr_warmup_updates']}` "
            "instead of the recipe's 8,000 or 16,000, so that the loss can fall within the "
            "check's updates; each system's command is `command` in check.json. fp32: the same "
            "updates from the same seed on the same batches in fp32; the gap (last loss minus "
            "fp32's, base 2) passes within "
            f"{100 * result['max_gap_of_fall']:.0f}% of the loss fall fp32 reached. "
            + (f"fairseq-train on {result['ddp_gpus']} GPUs: the recipe's command, DDP, "
               f"{result['shape']['ddp_updates']} updates." if result["ddp_gpus"] else
               "fairseq-train on 2 GPUs: not run (fewer than 2 GPUs visible, or --no-ddp)."),
            "", f"The check took {result['seconds']:.0f} s.", ""]
    lines += [
        "| system | loss finite | loss first -> last | skipped steps (overflows) | loss scale "
        "start -> lowest -> end | sync warnings per step | peak MiB | tokens/s | vs stock | MFU "
        "| beam fp16 = fp32 | BLEU fp16 vs fp32 | loss falls | fp32 first -> last | gap vs "
        f"fp32 (of its fall) | fairseq-train on {ddp_gpus} GPUs | seconds | verdict |",
        "|" + "---|" * 18,
    ]
    for name, r in systems.items():
        if "error" in r:
            lines.append(f"| {name} | **failed: {r['error'][:200]}** |" + " |" * 14
                         + f" {_number(r.get('seconds'), '.0f')} | **failed** |")
            continue
        scales = [s for s in r["loss_scales"] if s is not None]
        scale = (f"{r['initial_loss_scale']:g} -> {min(scales):g} -> {scales[-1]:g}"
                 if scales else "(no scaler)")
        losses = (f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}" if r["losses"] else "")
        syncs = _number(r["sync_warnings_per_step"], ".1f")
        memory = _number(r["peak_memory_mib"], ".0f")
        versus = f"{r['tokens_per_s'] / stock:.2f}x" if stock else ""
        beam = r["beam_fp16_vs_fp32"]
        fell = {True: "yes", False: "**no**", None: ""}[r.get("loss_fell")]
        fp32, gap = r.get("fp32"), r.get("vs_fp32")
        fp32 = (f"{fp32['losses'][0]:.3f} -> {fp32['losses'][-1]:.3f}" if fp32 and fp32["losses"]
                else "(trained in fp32)" if "loss_fell" in r else "")
        if gap:
            share = gap["gap_share_of_fp32_fall"]
            gap = (f"{gap['gap']:+.3f} ({100 * gap['relative_gap']:+.2f}%; "
                   + ("fp32 did not fall" if share is None else f"{100 * share:.1f}% of it")
                   + ")")
        ddp = r.get("ddp")
        if ddp:
            ddp = (f"exit {ddp['exit_status']}, {ddp['updates']} updates, "
                   + ("" if ddp["loss_first"] is None
                      else f"{ddp['loss_first']:.3f} -> {ddp['loss_last']:.3f}, ")
                   + f"{ddp['seconds']:.0f} s")
        checks = r.get("failed_checks")
        verdict = ("" if checks is None else "pass" if not checks
                   else "**fail: " + "; ".join(checks) + "**")
        lines.append(
            f"| {name} | {'yes' if r['losses_finite'] else '**no**'} | {losses} | "
            f"{r['skipped']} of {r['steps']} ({r['overflows']}) | {scale} | {syncs} | {memory} | "
            f"{r['tokens_per_s']:.0f} | {versus} | {100 * r['mfu']:.1f}% | "
            f"{100 * beam['identical']:.0f}% of "
            f"{beam['sentences']} | {beam['bleu']:.1f} | {fell} | {fp32} | {gap or ''} | "
            f"{ddp or ''} | {_number(r.get('seconds'), '.0f')} | {verdict} |")
    sources = [f"- {name}: {count} at `{line}`" for name, r in systems.items()
               for line, count in (r.get("sync_warning_lines") or {}).items()]
    if sources:
        lines += ["", "Where the synchronizations come from (top lines per system):", "",
                  *sources]
    for name, r in systems.items():
        if r.get("ddp", {}).get("output_tail"):
            lines += ["", f"fairseq-train on {r['ddp']['gpus']} GPUs for {name}: "
                      f"`{r['ddp']['command']}`; the end of its output:", "", "```",
                      r["ddp"]["output_tail"].rstrip("\n"), "```"]
    for name, r in systems.items():
        if r.get("attention_calls"):
            lines += ["", f"Attention call sites of {name}: the mask each passes to SDPA, on the "
                      "first batch (training) and in beam search (inference):", "",
                      *format_attention_calls(r["attention_calls"])]
    return "\n".join(lines) + "\n"


def write_reports(result, out_dir):
    """check.json and check.md in ``out_dir`` (each written atomically, like bench's)."""
    os.makedirs(out_dir, exist_ok=True)
    write_text_atomically(os.path.join(out_dir, "check.json"), json.dumps(result, indent=1))
    write_text_atomically(os.path.join(out_dir, "check.md"), markdown_report(result))
