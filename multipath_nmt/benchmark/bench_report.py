"""The report of ``multipath-bench``: its targets (BENCHMARKS.md) as measured ratios, and
the result as bench.json, bench.md (a markdown table) and bench.png (tokens/s and MFU per system),
each written atomically."""
import importlib.metadata
import json
import os
import platform
import subprocess

import torch

from multipath_nmt.atomic_files import write_atomically, write_text_atomically


def git_commit():
    """The commit of the checkout this package runs from, or None (an installed copy, a tree
    without .git): what a result file records beside its command."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment(device, commit=None):
    """Where the figures come from: device, driver, versions, commit."""
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "fairseq": version("fairseq-fixed") or version("ve-fairseq") or version("fairseq"),
            "cpu_cores": os.cpu_count(), "commit": commit or git_commit()}
    if device == "cuda":
        info.update(device=torch.cuda.get_device_name(),
                    gpus=torch.cuda.device_count(),
                    cudnn=torch.backends.cudnn.version(), driver=_nvidia_driver())
    else:
        info["device"] = f"CPU ({platform.processor() or platform.machine()})"
    return info


def _nvidia_driver():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return None


def machine_description(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def _ratio(result, name, other, key="tokens_per_s"):
    systems = result["systems"]
    if name not in systems or other not in systems or key not in systems[name] \
            or key not in systems[other]:
        return None
    return systems[name][key]["median"] / systems[other][key]["median"]


def evaluate_targets(result):
    """The targets (BENCHMARKS.md's CPU table), as measured ratios from this one run."""
    rows = []

    def target(number, text, value, threshold, higher_is_better=True):
        if value is None:
            return
        met = value >= threshold if higher_is_better else value <= threshold
        rows.append(dict(target=number, text=text, value=value, threshold=threshold, met=met))

    target(1, "multi-path L x 4 tokens/s vs deep 4L (same parameters)",
           _ratio(result, "multi-path L x 4 (full)", "stock deep 4L"), 1.0)
    target(2, "PathNorm + learnable weights + cheap features tokens/s vs plain multi-path",
           _ratio(result, "multi-path L x 4 (+cheap features)", "multi-path L x 4 (plain)"), 0.95)
    paths = result["layers"]["paths"]
    for n, row in sorted(paths.items(), key=lambda kv: int(kv[0])):
        target(3, f"batched vs loop reference, {n} paths (one encoder layer, fwd+bwd)",
               row["speedup"], 1.0 if int(n) <= 2 else 1.05)
    target(3, "batched vs loop reference, 4 paths (whole model, training step)",
           _ratio(result, "multi-path L x 4 (full)", "multi-path L x 4 (loop reference)"), 1.05)
    systems = result["systems"]
    stock = systems.get("stock prenorm L")
    if stock and "mfu" in stock:
        # the toolkit's architectures; the other fairseq transformers (deep, wider FFN) and the
        # loop reference are yardsticks, their MFU is shown in the table
        for name, row in systems.items():
            if row["arch"] != stock["arch"] and not row.get("loop_reference") and "mfu" in row:
                target(4, f"MFU of {name} vs stock fairseq", row["mfu"] / stock["mfu"], 0.95)
    target(5, "MoE router + dispatch + combine, fraction of the experts' time",
           result["layers"]["moe"]["routing_overhead_fraction"], 0.15, higher_is_better=False)
    target(6, "beam search sentences/s, multi-path L x 4 vs deep 4L (same decoder and parameters)",
           _ratio(result, "multi-path L x 4 (full)", "stock deep 4L", "beam_sentences_per_s"),
           0.95)
    rows += proxy_targets(systems)
    return rows


def proxy_targets(systems):
    """Targets 7 and 8, on the CPU proxies of a GPU's pace (the kernel launches and host syncs
    of one whole update, counted on any device): rows as :func:`evaluate_targets`'s."""
    rows = []
    launches = {name: row.get("kernel_launches_per_update") for name, row in systems.items()}

    def target(number, text, value, threshold):
        if value is not None:
            rows.append(dict(target=number, text=text, value=value, threshold=threshold,
                             met=value <= threshold))

    def launch_ratio(name, other):
        return (launches[name] / launches[other]
                if launches.get(name) and launches.get(other) else None)

    target(7, "kernel launches per update, multi-path L x 4 vs deep 4L",
           launch_ratio("multi-path L x 4 (full)", "stock deep 4L"), 1.0)
    target(7, "kernel launches per update, cheap features vs the same model without them",
           launch_ratio("multi-path L x 4 (+cheap features)", "multi-path L x 4 (full)"), 1.1)
    floors = {name: row["host_ms_per_update"]["median"] for name, row in systems.items()
              if "host_ms_per_update" in row}
    if "multi-path L x 4 (full)" in floors and "stock deep 4L" in floors:
        target(7, "host ms per update at the host's floor, multi-path L x 4 vs deep 4L",
               floors["multi-path L x 4 (full)"] / floors["stock deep 4L"], 1.0)
    stock = systems.get("stock prenorm L") or {}
    stock_syncs = stock.get("host_syncs_per_update")
    for name, row in systems.items():
        # fairseq reads whether a batch has padding once per encoder layer: only the systems
        # with stock's L encoder layers can match its count
        if (stock_syncs is not None and "host_syncs_per_update" in row
                and row["flags"][:1] == stock["flags"][:1] and name != "stock prenorm L"):
            target(8, f"host syncs per update, {name}, more than stock's {stock_syncs}",
                   row["host_syncs_per_update"] - stock_syncs, 0)
    return rows


def proxies_markdown(result):
    """``multipath-bench --proxies``: every system's kernel launches and host syncs per update,
    and targets 7 and 8."""
    floor = result.get("host_floor")
    lines = [f"Kernel launches and host syncs of one whole training update (forward, loss, "
             f"backward, optimizer; `multipath_nmt/benchmark/kernels.py`, "
             f"`multipath_nmt/host_syncs.py`), size `{result['size']}`, {result['device']}, "
             f"{result['precision']}: `{result['command']}`; commit {result['commit']}; "
             f"{result['machine']}."]
    if floor:
        lines.append(
            f"Host floor: ms per whole update of each system with its layers at d {floor['dim']}, "
            f"FFN {floor['ffn']}, {floor['batch']} sentences of {floor['length']} tokens (kernels "
            f"nearly free: the host's own time), {floor.get('threads', 1)} thread, median "
            f"[min-max] of {floor['windows']} windows.")
        check = floor.get("check")
        if check:
            base = result["systems"][check["system"]]["host_ms_per_update"]["median"]
            checked = check["host_ms_per_update"]["median"]
            lines.append(f"{check['system']} at d {check['dim']}: {checked:.1f} ms, "
                         f"{checked / base:.2f}x its time at d {floor['dim']}.")
    lines += ["", "| group | system | kernel launches per update | vs stock | host syncs per update "
              "| host syncs per micro-batch | host floor ms per update | vs stock |",
              "|---|---|---|---|---|---|---|---|"]
    stock_row = result["systems"].get("stock prenorm L", {})
    stock = stock_row.get("kernel_launches_per_update")
    stock_ms = stock_row.get("host_ms_per_update", {}).get("median")
    for name, r in result["systems"].items():
        if "error" in r:
            lines.append(f"| {r['group']} | {name} | **failed: {r['error']}** | | | | | |")
            continue
        launches = r["kernel_launches_per_update"]
        versus = f"{launches / stock:.2f}x" if stock else ""
        ms = r.get("host_ms_per_update")
        host = (f"{median_range(ms, '.1f')} | {ms['median'] / stock_ms:.2f}x" if ms and stock_ms
                else (median_range(ms, '.1f') + " |" if ms else " |"))
        lines.append(f"| {r['group']} | {name} | {launches:,} | {versus} | "
                     f"{r['host_syncs_per_update']} | {r['host_syncs']} | {host} |")
    lines += ["", "| target | measured | needed | met |", "|---|---|---|---|"]
    for row in proxy_targets(result["systems"]):
        lines.append(f"| {row['target']}. {row['text']} | {row['value']:.3f} | "
                     f"<= {row['threshold']} | {'yes' if row['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def median_range(summary, spec=".0f"):
    """A timing summary as "median [min-max]", each number formatted with ``spec``."""
    return f"{summary['median']:{spec}} [{summary['min']:{spec}}-{summary['max']:{spec}}]"


def markdown_report(result):
    lines = [
        f"Machine: {result['machine']}; device {result['device']}, {result['dtype']}; "
        f"size `{result['size']}` {json.dumps(result['shape'])}; "
        f"matmul peak {result['matmul_peak_flops'] / 1e9:.1f} GFLOP/s"
        f" on {result['peak']}; training on {result['batches']}.",
        "",
        ("Rates are per second of this process's CPU time (all threads; see `clock()`), so other "
         "load on the machine changes them far less than wall time." if result["device"] == "cpu"
         else "Rates are per second of wall time."),
        *([] if not result.get("heap_allocator") else [
            "", "Large CPU tensors come from glibc's heap, not a fresh mmap per allocation "
            "(`keep_freed_memory()`), for every system alike."]),
        "",
        f"Command: `{result['command']}`",
        "",
        "\"stock\" rows are fairseq's own Transformer in this process, where the plug-in's "
        "patches are installed (`multipath_nmt/fairseq_patches`); among them, fairseq's "
        "attention calls `scaled_dot_product_attention`.",
        "",
        f"Training rates: median [min-max] over {result['shape']['repeats']} round-robin repeats, "
        f"each measurement at least {result['shape']['steps']} step(s) and "
        f"{result['shape']['measure_seconds']:g} s of the clock (`steps_per_measurement` in "
        "bench.json).",
        "",
        "| group | system | params | active | train MFLOP/token | tokens/s median [min-max] "
        "| vs | MFU | step ms: fwd+bwd + update | host syncs per micro-batch "
        "| saved for backward MiB | beam sent/s | peak MiB | host syncs per update "
        "| kernel launches per update |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["systems"].items():
        if "error" in r:
            lines.append(f"| {r['group']} | {name} | **failed: {r['error']}** |" + " |" * 12)
            continue
        ratio = _ratio(result, name, r["compare_to"]) if r["compare_to"] else None
        versus = "" if ratio is None else f"{ratio:.2f}x {r['compare_to']}"  # None: not measured
        beam = median_range(r["beam_sentences_per_s"], ".1f") if "beam_sentences_per_s" in r \
            else ""
        memory = (f"{r['peak_memory_mib']:.0f}" if "peak_memory_mib" in r else
                  "**probe failed**" if "peak_memory_error" in r else "")
        lines.append(
            f"| {r['group']} | {name} | {r['params'] / 1e6:.2f}M | {r['active_params'] / 1e6:.2f}M "
            f"| {r['train_flops_per_token'] / 1e6:.1f} | {median_range(r['tokens_per_s'])} | {versus} "
            f"| {100 * r['mfu']:.1f}% | {1e3 * r['forward_backward_s']['median']:.0f} + "
            f"{1e3 * r['update_s']['median']:.0f} | {r['host_syncs']} | "
            f"{r['saved_for_backward_mib']:.1f} | {beam} | {memory} | "
            f"{r.get('host_syncs_per_update', '')} | {r.get('kernel_launches_per_update', '')} |")
    lines += ["", "| paths | batched tokens/s | reference tokens/s | speed-up |",
              "|---|---|---|---|"]
    for n, row in result["layers"]["paths"].items():
        lines.append(f"| {n} | {row['batched_tokens_per_s']:.0f} | "
                     f"{row['reference_tokens_per_s']:.0f} | {row['speedup']:.2f}x |")
    moe = result["layers"]["moe"]
    lines += ["", f"MoE layer (E 4, k 2, C 1.2, capacity {moe['capacity']}): whole layer "
              f"{1e3 * moe['layer_s']['median']:.2f} ms, experts alone "
              f"{1e3 * moe['experts_s']['median']:.2f} ms per fwd+bwd."]
    routed = result["layers"]["parameternet_routed_ffn"]
    ms = {key: 1e3 * routed[f"{key}_s"]["median"] for key in ("routed", "dense", "dense_on_slots")}
    lines += ["", f"ParameterNet routed FFN (both projections, E 4, C 1.2): {ms['routed']:.1f} "
              f"ms per fwd+bwd; a dense FFN {ms['dense']:.1f} ms on the {routed['tokens']} tokens, "
              f"{ms['dense_on_slots']:.1f} ms on {routed['slots']} rows (the capacity slots): "
              f"routing, dispatch and combine take {ms['routed'] - ms['dense_on_slots']:.1f} ms.",
              "", "| target | measured | needed | met |", "|---|---|---|---|"]
    for row in evaluate_targets(result):
        sign = "<=" if row["target"] in (5, 7, 8) else ">="
        lines.append(f"| {row['target']}. {row['text']} | {row['value']:.3f} | "
                     f"{sign} {row['threshold']} | {'yes' if row['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def plot_report(result, out):
    """Tokens/s (median, min-max) and MFU per system, as a PNG into ``out`` (a path or a binary
    file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in result["systems"].items() if "error" not in r]
    rates = [result["systems"][n]["tokens_per_s"] for n in names]
    medians = [r["median"] for r in rates]
    errors = [[m - r["min"] for m, r in zip(medians, rates)],
              [r["max"] - m for m, r in zip(medians, rates)]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(names) + 1.5), sharey=True)
    left.barh(names, medians, xerr=errors, color="tab:blue")
    left.set_xlabel("training tokens/s (median, min-max)")
    right.barh(names, [100 * result["systems"][n]["mfu"] for n in names], color="tab:orange")
    right.set_xlabel("MFU (%)")
    left.invert_yaxis()
    fig.suptitle(f"multipath-bench, {result['device']} {result['dtype']}, size {result['size']}")
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)


def write_reports(result, out_dir):
    """bench.json, bench.md and bench.png in ``out_dir`` (each written atomically); returns the
    result with its evaluated targets, as bench.json holds it."""
    os.makedirs(out_dir, exist_ok=True)
    result = dict(result, targets=evaluate_targets(result))
    write_text_atomically(os.path.join(out_dir, "bench.json"), json.dumps(result, indent=1))
    write_text_atomically(os.path.join(out_dir, "bench.md"), markdown_report(result))
    write_atomically(os.path.join(out_dir, "bench.png"), lambda out: plot_report(result, out))
    return result


def write_compiled_report(result, out_dir):
    """A ``--compiled`` run's result as compiled.json and compiled.md in ``out_dir``."""
    from multipath_nmt.benchmark.compiled import markdown

    os.makedirs(out_dir, exist_ok=True)
    write_text_atomically(os.path.join(out_dir, "compiled.json"),
                          json.dumps(result, indent=2) + "\n")
    table = (f"Eager vs `--compile-layers {result['backend']}`, {result['device']} "
             f"({result['machine']}), {result['precision']}, size {result['size']}, "
             f"{result['batches']}: `{result['command']}`\n\n{markdown(result['compiled'])}\n")
    write_text_atomically(os.path.join(out_dir, "compiled.md"), table)
    return table


def write_proxies_report(result, out_dir):
    """A ``--proxies`` run's result, with its targets, as proxies.json and proxies.md in
    ``out_dir``; returns the Markdown."""
    os.makedirs(out_dir, exist_ok=True)
    result = dict(result, targets=proxy_targets(result["systems"]))
    write_text_atomically(os.path.join(out_dir, "proxies.json"), json.dumps(result, indent=1))
    table = proxies_markdown(result)
    write_text_atomically(os.path.join(out_dir, "proxies.md"), table)
    return table
