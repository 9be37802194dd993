"""What the GPU check measures on one trainer (see :mod:`multipath_nmt.benchmark.gpu_check`):
the updates through fairseq's Trainer with their losses, loss scales, skipped updates, host
synchronizations and tokens/s; mixed precision's losses against fp32's; beam search in one
precision against another.
"""
import collections
import contextlib
import copy
import math
import warnings

import torch

from multipath_nmt.benchmark.timing import elapsed_seconds
from multipath_nmt.benchmark.memory import without_peak_resets

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
                    update_freq=1, sync_steps=0):
    """``steps`` updates through fairseq's Trainer, each of ``update_freq`` micro-batches of
    ``batches`` (cycled) in one ``train_step``, as fairseq-train's ``--update-freq`` does. Every
    update: skipped or not (fairseq skips the update when the fp16 gradients overflow and halves
    the loss scale), its loss and the loss scale after it. After the first ``warmup_steps``, the
    next ``sync_steps`` count the synchronizations (``count_syncs``, a ``SyncWarnings``-like
    context; else they only train), and the steps after them are timed. Apart, so that counting
    (a Python warning per sync) does not weigh on the clock: timed while counted, bf16 steps
    ran at a fraction of their speed (docs/history.md, 2026-11-27)."""
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

    if not warmup_steps + sync_steps < steps:
        raise ValueError(f"no step left to time: {steps} steps, {warmup_steps} to warm up, "
                         f"{sync_steps} to count synchronizations")
    for index in range(warmup_steps):
        step(index)
    if device == "cuda":
        without_peak_resets(trainer)
        torch.cuda.reset_peak_memory_stats()
    counted = range(warmup_steps, warmup_steps + sync_steps)
    syncs = count_syncs() if count_syncs else contextlib.nullcontext()
    with syncs:
        for index in counted:
            step(index)
    timed = range(counted.stop, steps)
    tokens = sum(sample["ntokens"] for index in timed for sample in samples(index))

    def timed_steps():
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
        sync_steps=len(counted) if count_syncs else 0,
        sync_warnings_per_step=syncs.total / len(counted) if count_syncs and counted else None,
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
    the other (token ids as words; orders with no n-gram in the hypotheses left out, as
    sacreBLEU's sentence BLEU does: an untrained model's hypotheses can be a word or two, which
    plain BLEU scores 0 even when they are identical, as in the first GPU run)."""
    from sacrebleu.metrics import BLEU

    if hypotheses.keys() != references.keys():
        raise ValueError("the two translations cover different sentences")
    ids = sorted(hypotheses)
    identical = sum(hypotheses[i] == references[i] for i in ids) / len(ids)
    words = lambda tokens: " ".join(map(str, tokens))  # noqa: E731
    bleu = BLEU(tokenize="none", effective_order=True).corpus_score(
        [words(hypotheses[i]) for i in ids], [[words(references[i]) for i in ids]])
    return {"sentences": len(ids), "identical": identical, "bleu": bleu.score}


def compare_precisions(trainer, task, samples, attention_calls=None, dtype=None):
    """Beam search with the trainer's model (a ``dtype`` copy of it where given: float16 as
    ``scripts/translate.sh`` decodes on a GPU; else as it is) against a float32 copy of the same
    weights. ``attention_calls``: a dict that receives, for the first model's beam search, what
    each attention call site passes to SDPA (``multipath_nmt.benchmark.attention_calls``)."""
    from multipath_nmt.benchmark.attention_calls import attention_calls as record_attention_calls

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
