"""The GPU check's report (see :mod:`multipath_nmt.benchmark.gpu_check`): check.md, a table of
every system's figures and verdict, and check.json.
"""
import json
import os

from multipath_nmt.atomic_files import write_text_atomically
from multipath_nmt.benchmark.gpu_check_setup import DDP_GPUS, STOCK


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
            "check's updates; each system's command is `command` in check.json. Of its "
            f"{result['shape']['steps']} updates, the first {result['shape']['warmup_steps']} "
            f"warm up, the next {result['shape'].get('sync_steps', 0)} count the synchronizations "
            "and the rest are timed (tokens/s, MFU). fp32: the same "
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
