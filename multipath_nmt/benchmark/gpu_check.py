"""The GPU check behind ``scripts/gpu-check.sh``: a tool of its own that builds on the benchmark's
systems, batches, clock and FLOP counting (nothing else in the package depends on it).

For every architecture family (stock transformer, multi-path, WideNet, MoE, EWA, ParameterNet) it
trains a few dozen fp16 steps through fairseq's own ``Trainer`` on padded, length-varied batches
(fairseq's own batching and collater, from a data-bin or from synthetic sentences), and reports:
whether every loss was finite, the loss scale (start, lowest, end) and the skipped (overflowed)
steps, the synchronizing CUDA operations that ``torch.cuda.set_sync_debug_mode("warn")`` reports,
the peak ``torch.cuda.max_memory_allocated``, tokens/s against stock fairseq, and how beam search
in fp16 agrees with beam search in fp32 on the same weights.

Everything except the three CUDA calls (the sync debug mode, the peak-memory counters and CUDA
events) runs on the CPU too, which is how the tests check it: ``--device cpu --precision
memory-efficient-fp16`` goes through fairseq's fp16 optimizer, loss scaler and overflow handling.
"""
import collections
import contextlib
import copy
import json
import math
import os
import warnings

import torch

from multipath_nmt.atomic_files import write_text_atomically
from multipath_nmt.benchmark.batches import fake_data_dir, padded_batches
from multipath_nmt.benchmark.flops import (
    gemm_peak_flops,
    model_gemm_shapes,
    training_flops_per_token,
)
from multipath_nmt.benchmark.report import machine_description
from multipath_nmt.benchmark.systems import System, build_trainer, fairseq_flags, systems_for
from multipath_nmt.benchmark.timing import elapsed_seconds

# "gpu" is the size the check is made for: about 10 minutes on one GPU for all systems; "tiny"
# runs the same code on the CPU in seconds (the tests). ``steps`` training steps per system, the
# first ``warmup_steps`` neither timed nor counted for syncs (allocator, cuBLAS heuristics).
CHECK_SIZES = {
    "tiny": dict(dim=64, ffn=256, heads=4, vocab=1000, base_layers=2, decoder_layers=1,
                 max_tokens=256, mean_length=12, steps=6, warmup_steps=2, beam_sentences=8,
                 gemm_repeats=2),
    "gpu": dict(dim=512, ffn=2048, heads=8, vocab=32000, base_layers=6, decoder_layers=6,
                max_tokens=4096, mean_length=28, steps=50, warmup_steps=10, beam_sentences=256,
                gemm_repeats=20),
}
PRECISIONS = {"fp16": ["--fp16"], "memory-efficient-fp16": ["--memory-efficient-fp16"],
              "fp32": []}
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


def check_flags(size, system, precision):
    """fairseq-train flags of a system at a check size (arguments later on the line win)."""
    return [*fairseq_flags(size, system), f"--decoder-layers={size['decoder_layers']}",
            f"--max-tokens={size['max_tokens']}", *PRECISIONS[precision]]


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


def train_and_watch(trainer, batches, steps, warmup_steps, device, count_syncs=None):
    """``steps`` training steps through fairseq's Trainer, cycling over ``batches``. Every step:
    skipped or not (fairseq skips the update when the fp16 gradients overflow and halves the
    loss scale), its loss and the loss scale after it. After the first ``warmup_steps``: the time,
    the tokens, and (``count_syncs``, a ``SyncWarnings``-like context) the synchronizations."""
    scaler = getattr(trainer.optimizer, "scaler", None)  # fairseq's fp16 optimizers only
    scale = (lambda: scaler.loss_scale) if scaler is not None else (lambda: None)
    log = dict(initial_loss_scale=scale(), losses=[], loss_scales=[], skipped=0, overflows=0)

    def step(index):
        before = scale()
        output = trainer.train_step([batches[index % len(batches)]])
        log["skipped"] += output is None  # an overflow, or an out-of-memory batch
        log["overflows"] += before is not None and scale() < before
        if output is not None:
            log["losses"].append(float(output["loss"]))
        log["loss_scales"].append(scale())

    for index in range(warmup_steps):
        step(index)
    timed = range(warmup_steps, steps)
    tokens = sum(batches[index % len(batches)]["ntokens"] for index in timed)
    syncs = count_syncs() if count_syncs else contextlib.nullcontext()
    if device == "cuda":
        trainer.cuda_env = None  # else fairseq resets the peak-memory counter at every step
        torch.cuda.reset_peak_memory_stats()

    def timed_steps():
        with syncs:  # the steps only, not the clock's own synchronization
            for index in timed:
                step(index)

    seconds = elapsed_seconds(timed_steps, 1, device)
    log.update(
        steps=steps, timed_steps=len(timed), tokens_per_s=tokens / seconds,
        losses_finite=bool(log["losses"]) and all(map(math.isfinite, log["losses"])),
        peak_memory_mib=torch.cuda.max_memory_allocated() / 2 ** 20 if device == "cuda" else None,
        sync_warnings_per_step=syncs.total / len(timed) if count_syncs else None,
        sync_warning_lines=dict(list(syncs.by_line.items())[:5]) if count_syncs else None)
    return log


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


def compare_precisions(trainer, task, samples, attention_calls=None):
    """Beam search with the trainer's model as it is (fp16 after ``--fp16``) against a float32
    copy of the same weights. ``attention_calls``: a dict that receives, for the first model's
    beam search, what each attention call site passes to SDPA (``multipath_nmt.attention``)."""
    from multipath_nmt.attention import attention_calls as record_attention_calls

    model = trainer.model
    samples = [trainer._prepare_sample(sample)[0] for sample in samples]
    float32 = copy.deepcopy(model).float()
    hypotheses = {}

    def translate():
        hypotheses.update(translations(model, task, samples))

    if attention_calls is None:
        translate()
    else:
        attention_calls.update(record_attention_calls(model, translate))
    return compare_translations(hypotheses, translations(float32, task, samples))


def run_check(size_name="gpu", device="cuda", precision="fp16", data=None, only=None,
              log=print, count_syncs=None):
    """Check every system; returns the result dict ``markdown_report`` renders. ``data``: a
    data-bin (joined dictionary) whose train and valid splits give the batches."""
    from fairseq.data import data_utils

    size = CHECK_SIZES[size_name]
    if count_syncs is None and device == "cuda":
        count_syncs = SyncWarnings
    systems = [s for s in check_systems(size) if not only or s.name in only]
    results = {}
    with contextlib.ExitStack() as stack:
        data_dir = data or stack.enter_context(fake_data_dir(size["vocab"]))
        languages = data_utils.infer_language_pair(data_dir) if data else ("src", "tgt")
        for system in systems:
            flags = [*check_flags(size, system, precision), "-s", languages[0], "-t",
                     languages[1]]
            try:
                results[system.name] = check_one(size, data_dir, flags, device, data is not None,
                                                 count_syncs)
            except Exception as error:  # a failed system is a finding; check the others
                results[system.name] = {"error": f"{type(error).__name__}: {error}"}
            log(f"{system.name}: {json.dumps(results[system.name])[:300]}")
    return {"size": size_name, "shape": size, "device": device, "precision": precision,
            "data": data, "machine": machine_description(device),
            "systems": results}


def check_one(size, data_dir, flags, device, from_data_bin, count_syncs):
    trainer, task = build_trainer(data_dir, flags, device, fp16=False)
    batches = padded_batches(task, trainer.model, size["max_tokens"], size["steps"],
                             size["mean_length"],
                             split="train" if from_data_bin else None, seed=1)
    attention = {"training": {}, "inference": {}}
    shapes = model_gemm_shapes(trainer, batches[0], attention["training"])
    dtype = next(trainer.model.parameters()).dtype
    peak, best_shape = gemm_peak_flops(shapes, device, dtype, size["gemm_repeats"])
    flops = training_flops_per_token(trainer, batches[0])
    result = train_and_watch(trainer, batches, size["steps"], size["warmup_steps"], device,
                             count_syncs)
    result.update(params=sum(p.numel() for p in trainer.model.parameters()),
                  gemm_peak_flops=peak, gemm_peak_shape=best_shape,
                  train_flops_per_token=flops, mfu=flops * result["tokens_per_s"] / peak,
                  padding=1 - sum(b["ntokens"] for b in batches)
                  / sum(b["target"].numel() for b in batches))
    held_out = padded_batches(task, trainer.model, size["max_tokens"], math.ceil(
        size["beam_sentences"] * size["mean_length"] / size["max_tokens"]) + 1,
        size["mean_length"], split="valid" if from_data_bin else None, seed=2)
    sentences, samples = 0, []
    for batch in held_out:
        if sentences >= size["beam_sentences"]:
            break
        samples.append(batch)
        sentences += batch["nsentences"]
    result["beam_fp16_vs_fp32"] = compare_precisions(trainer, task, samples,
                                                     attention["inference"])
    result["attention_calls"] = attention
    return result


def markdown_report(result):
    from multipath_nmt.attention import format_attention_calls

    systems = result["systems"]
    stock = systems.get(STOCK, {}).get("tokens_per_s")
    lines = [
        f"Machine: {result['machine']}; device {result['device']}, {result['precision']}; size "
        f"`{result['size']}` {json.dumps(result['shape'])}; batches: "
        f"{result['data'] or 'synthetic, length-varied'}. MFU: measured training FLOPs per "
        "token x tokens/s / the best rate this device reached on the model's own matrix "
        "products (`gemm_peak_flops` in check.json).", "",
        "| system | loss finite | loss first -> last | skipped steps (overflows) | loss scale "
        "start -> lowest -> end | sync warnings per step | peak MiB | tokens/s | vs stock | MFU "
        "| beam fp16 = fp32 | BLEU fp16 vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in systems.items():
        if "error" in r:
            lines.append(f"| {name} | **failed: {r['error'][:200]}** |" + " |" * 10)
            continue
        scales = [s for s in r["loss_scales"] if s is not None]
        scale = (f"{r['initial_loss_scale']:g} -> {min(scales):g} -> {scales[-1]:g}"
                 if scales else "(no scaler)")
        losses = (f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}" if r["losses"] else "")
        syncs = "" if r["sync_warnings_per_step"] is None else f"{r['sync_warnings_per_step']:.1f}"
        memory = "" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:.0f}"
        versus = f"{r['tokens_per_s'] / stock:.2f}x" if stock else ""
        beam = r["beam_fp16_vs_fp32"]
        lines.append(
            f"| {name} | {'yes' if r['losses_finite'] else '**no**'} | {losses} | "
            f"{r['skipped']} of {r['steps']} ({r['overflows']}) | {scale} | {syncs} | {memory} | "
            f"{r['tokens_per_s']:.0f} | {versus} | {100 * r['mfu']:.1f}% | "
            f"{100 * beam['identical']:.0f}% of "
            f"{beam['sentences']} | {beam['bleu']:.1f} |")
    sources = [f"- {name}: {count} at `{line}`" for name, r in systems.items()
               for line, count in (r.get("sync_warning_lines") or {}).items()]
    if sources:
        lines += ["", "Where the synchronizations come from (top lines per system):", "",
                  *sources]
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
