"""Memory: glibc's heap kept for large CPU tensors while timing, and the peak memory of one
training step, measured in a fresh process so that no other system's allocations count."""
import ctypes
import json
import subprocess
import sys

import torch

from multipath_nmt.benchmark.batches import fake_data_dir, synthetic_batch
from multipath_nmt.benchmark.systems import build_trainer

# mallopt parameters of glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory():
    """Serve large CPU tensors from the heap instead of a fresh mmap per allocation.

    glibc maps every allocation above its mmap threshold (at most 32 MiB by default) anew, so
    each training step page-faults its large activations and gradients in again, a share of the
    step that grows with the activations (the harness times all systems this way, like a
    long-running trainer's warm allocator). Returns whether
    it applied (glibc only; CUDA memory is unaffected)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def without_peak_resets(trainer):
    """``trainer`` with CUDA's peak-memory counter left alone: fairseq's ``Trainer.train_step``
    reads and resets it after every update while it keeps a ``cuda_env`` (for its ``gb_free``
    log line), so a peak read after a few updates held only what outlives an update (weights,
    gradients, optimizer state: the base model's "transformer 6+6" row of
    ``docs/bench/gpu-bench-h200.md``), never the activations."""
    trainer.cuda_env = None
    return trainer


def peak_memory_of_step(flags, size, device, fp16, loop_reference=False):
    """Peak memory of one training step, measured in a fresh process (CPU: peak RSS, reset via
    /proc/self/clear_refs right before the step; CUDA: max_memory_allocated). The process is
    ``python -m multipath_nmt.benchmark --memory-probe SPEC``, which runs
    :func:`measure_peak_memory`."""
    cmd = [sys.executable, "-m", "multipath_nmt.benchmark", "--memory-probe",
           json.dumps({"flags": flags, "size": size, "device": device, "fp16": fp16,
                       "loop_reference": loop_reference})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]


def measure_peak_memory(spec):
    """The fresh process's side of :func:`peak_memory_of_step`: builds the system of ``spec``,
    trains one step to allocate optimizer state and caches, and returns the peak MiB of the
    next step."""
    size, device = spec["size"], spec["device"]
    if device == "cpu":
        keep_freed_memory()
    with fake_data_dir(size["vocab"]) as data:
        trainer, task = build_trainer(data, spec["flags"], device, spec["fp16"],
                                      spec["loop_reference"])
        sample = synthetic_batch(size, len(task.source_dictionary))
        trainer.train_step([sample])  # allocate optimizer state and caches
        if device == "cuda":
            without_peak_resets(trainer)
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        trainer.train_step([sample])
        if device == "cuda":
            return torch.cuda.max_memory_allocated() / 2 ** 20
        with open("/proc/self/status") as f:
            hwm = next(line for line in f if line.startswith("VmHWM:"))
        return int(hwm.split()[1]) / 1024
