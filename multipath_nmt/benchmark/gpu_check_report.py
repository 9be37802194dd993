"""The GPU check's report (see :mod:`multipath_nmt.benchmark.gpu_check`): check.md, a table of
every system's figures and verdict, and check.json.
"""
import json
import os

from multipath_nmt.atomic_files import write_text_atomically
from multipath_nmt.benchmark.gpu_check_setup import DDP_GPUS


def failed(result):
    """Whether any system of a check, in the per-family table or in the recipe leg, failed to
    run or failed a check (exit status 3)."""
    rows = [*result["systems"].values(), *((result.get("recipe") or {}).get("systems") or {})
            .values()]
    return any("error" in r or r.get("failed_checks") for r in rows)


def _number(value, form):
    return "" if value is None else format(value, form)


def markdown_report(result):
    systems = result["systems"]
    flags = " ".join(result.get("precision_flags", [])) or "no precision flags"
    env = result.get("environment")
    versions = (f" (torch {env['torch']}, CUDA {env['cuda']}, driver {env.get('driver')}, "
                f"fairseq {env['fairseq']}, Python {env['python']}; commit {env['commit']})"
                if env else "")
    lines = [
        f"Machine: {result['machine']}{versions}; device {result['device']}, "
        f"{result['precision']} (`{flags}`); size `{result['size']}` "
        f"{json.dumps(result['shape'])}; batches: "
        f"{result['data'] or 'synthetic, length-varied'}. Speed is `scripts/gpu-bench.sh`'s "
        "(BENCHMARKS.md), not the check's: the few steps it times follow its sync-counted "
        "ones and are no measure of speed.", "",
    ]
    if result.get("table") is False:
        lines += ["The per-family table: not run (--no-table).", ""]
    elif "update_freq" in result:
        lines += [
            "The per-family table: every system trains in-process (fairseq's `Trainer`, no "
            "epoch loop, validation or save) from the command `recipe.train_command` builds for "
            "train.sh's arguments (`--optimizer adam_fused`, the recipe's learning rate and "
            f"criterion, the precision above, but `--update-freq {result['update_freq']}`, where "
            "train.sh runs 8 or 16 on one GPU: the recipe leg below runs that), at the "
            f"check's model size and with `--warmup-updates {result['lr_warmup_updates']}` "
            "instead of the recipe's 8,000 or 16,000, so that the loss can fall within the "
            "check's updates; each system's command is `command` in check.json. Of its "
            f"{result['shape']['steps']} updates, the first {result['shape']['warmup_steps']} "
            f"warm up, the next {result['shape'].get('sync_steps', 0)} count the synchronizations "
            "and the rest are timed (the timing stays in check.json). fp32: the same "
            "updates from the same seed on the same batches in fp32; the gap (last loss minus "
            "fp32's, base 2) passes within "
            f"{100 * result['max_gap_of_fall']:.0f}% of the loss fall fp32 reached. "
            + (f"fairseq-train on {result['ddp_gpus']} GPUs: the recipe's command, DDP, "
               f"{result['shape']['ddp_updates']} updates." if result["ddp_gpus"] else
               "fairseq-train on 2 GPUs: not run (fewer than 2 GPUs visible, or --no-ddp)."),
            "", f"The check took {result['seconds']:.0f} s.", ""]
    if systems or result.get("table") is not False:
        lines += table_lines(result)
    lines += recipe_lines(result)
    return "\n".join(lines) + "\n"


def table_lines(result):
    """The per-family table and what follows it (sync sources, failed 2-GPU runs' output,
    attention call sites)."""
    from multipath_nmt.benchmark.attention_calls import format_attention_calls

    systems = result["systems"]
    ddp_gpus = result.get("ddp_gpus") or DDP_GPUS
    lines = [
        "| system | loss finite | loss first -> last | skipped steps (overflows) | loss scale "
        "start -> lowest -> end | sync warnings per step | peak MiB "
        "| beam fp16 = fp32 | BLEU fp16 vs fp32 | loss falls | fp32 first -> last | gap vs "
        f"fp32 (of its fall) | fairseq-train on {ddp_gpus} GPUs | seconds | verdict |",
        "|" + "---|" * 15,
    ]
    for name, r in systems.items():
        if "error" in r:
            lines.append(f"| {name} | **failed: {r['error'][:200]}** |" + " |" * 11
                         + f" {_number(r.get('seconds'), '.0f')} | **failed** |")
            continue
        scales = [s for s in r["loss_scales"] if s is not None]
        scale = (f"{r['initial_loss_scale']:g} -> {min(scales):g} -> {scales[-1]:g}"
                 if scales else "(no scaler)")
        losses = (f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}" if r["losses"] else "")
        syncs = _number(r["sync_warnings_per_step"], ".1f")
        memory = _number(r["peak_memory_mib"], ".0f")
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
    return lines


def _losses(points):
    return ", ".join(f"{update}: {loss:.3f}" for update, loss in points)


def _chain(chain, updates):
    """One chain's cells: exit statuses, where the resume started, losses, valid losses."""
    first, resume = chain["run"], chain["resume"]
    exits = f"{first['exit_status']}, " + ("not run" if resume is None
                                           else str(resume["exit_status"]))
    loaded = resume and resume["loaded"]
    started = ("" if resume is None else "**fresh start**" if not loaded
               else f"{os.path.basename(loaded['path'])} @ {loaded['updates']}")
    losses = sorted(first["losses"] + (resume["losses"] if resume else []))
    at_k = [loss for update, loss in losses if update == updates]
    trail = (f"{losses[0][1]:.3f} -> {_number(at_k[0] if at_k else None, '.3f') or '?'} -> "
             f"{losses[-1][1]:.3f}" if losses else "")
    valid = _losses(sorted(first["valid"] + (resume["valid"] if resume else [])))
    return exits, started, trail, valid


def recipe_lines(result):
    """The recipe leg's table (the second one of check.md) and the failed runs' output."""
    leg = result.get("recipe")
    if not leg:
        return ["", "The recipe leg: not run (--no-recipe, or none of its systems among --only)."]
    k = leg["updates"]
    lines = [
        "", "The recipe leg: the fairseq-train command that `scripts/train.sh --dry-run` prints "
        f"for {'one GPU' if leg['gpus'] else 'the CPU'} (its `--update-freq` and precision "
        "flags, optimizer, learning rate and criterion), run as fairseq-train itself (epoch "
        "loop, validation, checkpoint saves), with only the data-bin (synthetic train and "
        "valid splits unless --data), the model size (the check's), `--max-tokens "
        f"{leg['max_tokens']}`, `--max-update {k}`, `--warmup-updates "
        f"{leg['lr_warmup_updates']}`, `--save-interval-updates` and "
        f"`--validate-interval-updates {leg['interval']}`, `--seed 1` and a JSON log of every "
        f"update changed (`dry_run_command` and `command` in check.json). Each run then resumes "
        f"with `--max-update {2 * k}`: it must load checkpoint_last.pt at update {k} and log "
        f"updates {k + 1} to {2 * k}. The same in fp32; the gap (last loss minus fp32's, base "
        f"2) passes within {100 * result['max_gap_of_fall']:.0f}% of fp32's loss fall. "
        "Synthetic data: one epoch ends between the two runs' ends, so that the resume starts "
        "inside an epoch and crosses its end. The chains (a precision's run and resume) ran "
        f"{leg['jobs']} at a time; the leg took {leg['seconds']:.0f} s.", "",
        "| system | update-freq; precision flags | exit (run, resume) | resumed from | loss "
        f"first -> {k} -> last | valid losses (update: loss) | epochs | fp32 exit (run, "
        f"resume) | fp32 resumed from | fp32 loss first -> {k} -> last | fp32 valid losses | gap vs "
        "fp32 (of its fall) | seconds | verdict |",
        "|" + "---|" * 14,
    ]
    for name, r in leg["systems"].items():
        if "error" in r:
            lines.append(f"| {name} | **failed: {r['error'][:300]}** |" + " |" * 11
                         + " **failed** |")
            continue
        chains = r["chains"]
        mixed = next(label for label in chains if label != "fp32") if len(chains) > 1 \
            else next(iter(chains))
        exits, started, trail, valid = _chain(chains[mixed], k)
        epochs = sorted({e for c in chains.values() for run in (c["run"], c["resume"]) if run
                         for e in run["epochs"]})
        fp32 = _chain(chains["fp32"], k) if mixed != "fp32" else ("",) * 4
        gap = r.get("vs_fp32")
        if gap:
            share = gap["gap_share_of_fp32_fall"]
            gap = (f"{gap['gap']:+.3f} ("
                   + ("fp32 did not fall" if share is None else f"{100 * share:.1f}% of it")
                   + ")")
        elif mixed == "fp32":
            gap = "(trained in fp32)"
        checks = r["failed_checks"]
        verdict = "pass" if not checks else "**fail: " + "; ".join(checks) + "**"
        flags = " ".join(r["precision_flags"]) or "fp32"
        lines.append(
            f"| {name} | {r['update_freq']}; `{flags}` | {exits} | {started} | {trail} | {valid} "
            f"| {', '.join(map(str, epochs))}"
            + (f" ({r['updates_per_epoch']} updates each)" if r.get("updates_per_epoch") else "")
            + f" | {fp32[0]} | {fp32[1]} | "
            f"{fp32[2]} | {fp32[3]} | {gap or ''} | "
            f"{_number(r.get('seconds'), '.0f')} | {verdict} |")
    for name, r in leg["systems"].items():
        for label, chain in (r.get("chains") or {}).items():
            for part in ("run", "resume"):
                run = chain[part]
                if run and run.get("output_tail"):
                    lines += ["", f"Recipe leg, {name}, {label} {part}: `{run['command']}`; the "
                              "end of its output:", "", "```", run["output_tail"].rstrip("\n"),
                              "```"]
    return lines


def write_reports(result, out_dir):
    """check.json and check.md in ``out_dir`` (each written atomically, like bench's)."""
    os.makedirs(out_dir, exist_ok=True)
    write_text_atomically(os.path.join(out_dir, "check.json"), json.dumps(result, indent=1))
    write_text_atomically(os.path.join(out_dir, "check.md"), markdown_report(result))
