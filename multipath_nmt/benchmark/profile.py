"""What limits a row's MFU: ``torch.profiler`` over a few whole training updates, kept as a
summary (the trace itself is not written): the top kernels by device time (on the CPU: the top
ATen ops by their own host time), the wall time of an update against the time the device was
busy, kernel launches, host syncs and scalar reads, and the share of the time in each of the
costs that stand in the way of MFU:

- ``loss over the vocabulary``: fairseq's fp32 log-softmax and its backward over the whole
  target vocabulary (``log_softmax``, ``nll_loss``, the softmax kernels outside attention);
- ``matrix products``: the GEMMs (the three Q/K/V projections are three of them per attention);
- ``attention``: SDPA's fused kernels;
- ``elementwise``: unfused pointwise kernels (casts, adds, dropout masks, layer norms);
- ``optimizer``: the fused Adam and the gradient norm's multi-tensor kernels;
- ``other``.

``scalar_reads_per_update`` counts ``aten::_local_scalar_dense`` (a tensor read on the host:
fairseq's per-layer ``has_pads`` read and the ``.item()`` calls of its logging), each of which
waits for the device.
"""
import time

import torch

TOP = 15
CATEGORIES = (
    # (CUDA's cunn_SoftMax kernels: with attention in SDPA's fused kernels, the loss's)
    ("loss over the vocabulary", ("log_softmax", "nll_loss", "softmaxforward",
                                  "softmaxbackward")),
    ("attention", ("flash", "fmha", "efficient_attention", "scaled_dot_product", "attention")),
    ("matrix products", ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "aten::addmm",
                         "aten::bmm", "aten::baddbmm", "cublas")),
    ("optimizer", ("multi_tensor", "adam", "foreach", "norm_kernel")),
    ("elementwise", ("elementwise", "aten::add", "aten::mul", "aten::div", "aten::sub",
                     "aten::copy_", "aten::_to_copy", "aten::native_layer_norm", "layer_norm",
                     "aten::dropout", "aten::native_dropout", "bernoulli", "aten::relu",
                     "aten::gelu", "aten::fill_",
                     "aten::where", "aten::masked_fill", "reduce_kernel", "aten::sum")),
)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def category(name):
    """Which of :data:`CATEGORIES` a kernel or ATen op belongs to (by its name), else
    ``other``."""
    lowered = name.lower()
    for label, words in CATEGORIES:
        if any(word in lowered for word in words):
            return label
    return "other"


def _self_device_us(event):
    for attribute in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attribute, None)
        if value is not None:
            return value
    return 0.0


def profile_updates(update, updates, device):
    """Profile ``updates`` calls of ``update()`` (whole training updates) and return the summary
    of the module docstring (a dict that JSON writes; :func:`markdown` renders it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(updates):
            update()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
    if kernels:
        timed = [(e.key, e.count, _self_device_us(e)) for e in kernels]
        what = "kernels by device time"
    else:  # the CPU: the ATen ops by their own host time
        timed = [(e.key, e.count, e.self_cpu_time_total) for e in events
                 if e.key.startswith("aten::")]
        what = "ATen ops by their own host time"
    busy_us = sum(us for _, _, us in timed)
    counts = {e.key: e.count for e in events}
    shares = {}
    for name, _, us in timed:
        shares[category(name)] = shares.get(category(name), 0.0) + us
    top = sorted(timed, key=lambda item: -item[2])[:TOP]
    return {
        "updates": updates, "device": device, "top_what": what,
        "wall_ms_per_update": 1e3 * wall / updates,
        # the device's busy time (on the CPU: the ATen ops' own host time) per update
        "busy_ms_per_update": busy_us / 1e3 / updates,
        "busy_share_of_wall": busy_us / 1e6 / wall if wall else None,
        "kernel_launches_per_update": (sum(counts.get(n, 0) for n in LAUNCHES) / updates
                                       if kernels else None),
        "syncs_per_update": sum(c for n, c in counts.items() if "Synchronize" in n) / updates,
        "scalar_reads_per_update": counts.get("aten::_local_scalar_dense", 0) / updates,
        "shares": {k: v / busy_us for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}
        if busy_us else {},
        "top": [{"name": name[:120], "calls_per_update": count / updates,
                 "ms_per_update": us / 1e3 / updates, "share": us / busy_us if busy_us else 0.0,
                 "category": category(name)} for name, count, us in top],
    }


def markdown(rows):
    """The profiled rows' summaries (``{row name: profile_updates(...)}``) as markdown."""
    lines = ["# What limits MFU: torch.profiler over whole training updates", ""]
    for name, p in rows.items():
        if "error" in p:
            lines += [f"## {name}", "", f"The profile failed: {p['error']}", ""]
            continue
        busy = p["busy_share_of_wall"]
        launches = p["kernel_launches_per_update"]
        lines += [
            f"## {name}", "",
            f"{p['updates']} updates on {p['device']}: {p['wall_ms_per_update']:.1f} ms of wall "
            f"time per update, {p['busy_ms_per_update']:.1f} ms busy "
            f"({'device' if launches is not None else 'ATen ops on the host'}"
            f"{f', {100 * busy:.0f}% of the wall time' if busy is not None else ''}); "
            f"kernel launches per update: {'n/a' if launches is None else f'{launches:,.0f}'}; "
            f"syncs per update: {p['syncs_per_update']:.0f}; scalar reads (has_pads, .item()) "
            f"per update: {p['scalar_reads_per_update']:.0f}.", "",
            "| cost | share of the busy time |", "|---|---|",
            *(f"| {k} | {100 * v:.1f}% |" for k, v in p["shares"].items()), "",
            f"Top {len(p['top'])} {p['top_what']}:", "",
            "| name | category | calls / update | ms / update | share |", "|---|---|---|---|---|",
            *(f"| `{t['name']}` | {t['category']} | {t['calls_per_update']:.0f} | "
              f"{t['ms_per_update']:.2f} | {100 * t['share']:.1f}% |" for t in p["top"]), ""]
    return "\n".join(lines)
