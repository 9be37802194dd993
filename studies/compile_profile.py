"""Where ``--compile-layers`` loses on the CPU (BENCHMARKS.md, "Eager vs compiled training").

Two measurements on the benchmark's default size, fp32:

1. One training step of a system (default: multi-path L x 4, the issue's 6x4), eager and compiled
   with inductor, under torch.profiler with inductor's kernel profiling on. Self CPU time per step
   in four parts: matrix products (mm, bmm, addmm, baddbmm and CPU flash attention, which
   inductor leaves to ATen), inductor's kernels that write or read the ReLU masks saved for the
   backward (their names hold ``threshold_backward``), the rest of inductor's kernels, the rest.
2. That mask on its own: ``x <= 0`` over one FFN activation of the 6x4 model (1,024 tokens x 4
   paths x FFN 1,024), eager against inductor's kernel, one thread.

    .venv/bin/python studies/compile_profile.py ["multi-path L x 4 (full)"]
"""
import statistics
import sys

import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile

from multipath_nmt.benchmark.batches import fake_data_dir, synthetic_batch
from multipath_nmt.benchmark.systems import (SIZES, build_trainer_from_argv, fairseq_flags,
                                             systems_for)
from multipath_nmt.benchmark.timing import elapsed_seconds

PRODUCTS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
STEPS = 5


def step_parts(trainer, sample):
    """Self CPU milliseconds per training step, by part (see the module docstring)."""
    for _ in range(3):  # compile, then warm up
        trainer.train_step([sample])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            trainer.train_step([sample])
    parts = dict.fromkeys(("matrix products", "inductor: ReLU masks", "inductor: other kernels",
                           "everything else"), 0.0)
    for event in prof.key_averages():
        if event.key in PRODUCTS:
            part = "matrix products"
        elif "cpp_fused" in event.key:
            part = ("inductor: ReLU masks" if "threshold_backward" in event.key
                    else "inductor: other kernels")
        else:
            part = "everything else"
        parts[part] += event.self_cpu_time_total / 1000 / STEPS
    return parts


def mask_milliseconds(elements):
    """Median milliseconds of ``x <= 0`` over ``elements`` floats on the benchmark's clock:
    (eager, inductor)."""
    x = torch.randn(elements)
    compiled = torch.compile(lambda t: t <= 0)
    result = []
    for fn in (lambda t: t <= 0, compiled):
        elapsed_seconds(lambda: fn(x), 3, "cpu")  # compile, warm up
        result.append(1000 * statistics.median(
            elapsed_seconds(lambda: fn(x), 1, "cpu") for _ in range(20)))
    return result


def main(name="multi-path L x 4 (full)"):
    torch._inductor.config.cpp.enable_kernel_profile = True
    size = SIZES["default"]
    system = next(s for s in systems_for(size) if s.name == name)
    with fake_data_dir(size["vocab"]) as data:
        argv = [data, "-s", "src", "-t", "tgt", *fairseq_flags(size, system), "--cpu"]
        rows = {}
        for mode, extra in (("eager", []), ("compiled", ["--compile-layers"])):
            trainer, task = build_trainer_from_argv(argv + extra)
            rows[mode] = step_parts(trainer, synthetic_batch(size, len(task.source_dictionary)))
    print(f"{name}: self CPU ms per training step, {torch.get_num_threads()} threads")
    print("| part | eager | compiled |\n|---|---|---|")
    for part in rows["eager"]:
        print(f"| {part} | {rows['eager'][part]:.0f} | {rows['compiled'][part]:.0f} |")
    print(f"| total | {sum(rows['eager'].values()):.0f} | {sum(rows['compiled'].values()):.0f} |")
    torch.set_num_threads(1)
    elements = size["batch"] * size["length"] * 4 * size["ffn"]
    eager, compiled = mask_milliseconds(elements)
    print(f"x <= 0 over {elements:,} floats, 1 thread: eager {eager:.1f} ms, inductor "
          f"{compiled:.1f} ms")


if __name__ == "__main__":
    main(*sys.argv[1:])
