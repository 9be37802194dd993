"""The benchmark's clock and what is timed on it: training steps (split into the task's forward +
backward and the update), beam search, and the summary of repeated measurements."""
import itertools
import math
import statistics
import time

import torch

from multipath_nmt.benchmark.batches import synthetic_batch


def clock(device):
    """The benchmark's clock. On the CPU, the CPU time of this process (all its threads): other
    jobs on a shared machine then slow the figures far less than they slow the wall clock, and
    the matmul peak is measured the same way, so MFU stays consistent. On CUDA, wall time."""
    return time.process_time() if device == "cpu" else time.perf_counter()


def synchronize(device):
    """Wait for the device's queue, so that the clock reads after the work, not after its launch."""
    if device == "cuda":
        torch.cuda.synchronize()


def elapsed_seconds(fn, repeats, device):
    """Seconds for ``repeats`` calls of ``fn``: CUDA events around the calls on a GPU (the
    device's own clock); on the CPU, ``multipath-bench``'s clock (this process's CPU time)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start = clock(device)
    for _ in range(repeats):
        fn()
    return clock(device) - start


def summary(values):
    """Median and min-max of repeated measurements, with the values themselves."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def steps_per_measurement(size, step_seconds):
    """Training steps timed together: at least ``size["steps"]`` and ``measure_seconds``."""
    return max(size["steps"], math.ceil(size["measure_seconds"] / step_seconds))


class ForwardBackwardClock:
    """Counts the clock a trainer spends in its task's forward + backward (``task.train_step``,
    which fairseq's ``Trainer.train_step`` calls once per batch). The rest of a training step is
    the update: gradient norm, optimizer step and the plug-in's after-step hooks (EWA's
    averaging), whose cost grows with the parameters, not with the FLOPs per token.

    It counts only while ``active``: on a GPU it synchronizes before and after every
    micro-batch, which lowers the throughput of a host-bound model, so the split is measured in
    a pass of its own, never in the timed steps."""

    def __init__(self, trainer, device):
        self.seconds = 0.0
        self.active = False
        task_step = trainer.task.train_step

        def timed_task_step(*args, **kwargs):
            if not self.active:
                return task_step(*args, **kwargs)
            synchronize(device)
            start = clock(device)
            try:
                return task_step(*args, **kwargs)
            finally:
                synchronize(device)
                self.seconds += clock(device) - start

        trainer.task.train_step = timed_task_step


def time_update_windows(update, windows, updates_per_window, device):
    """Seconds of each of ``windows`` windows of ``updates_per_window`` calls of ``update`` (one
    whole update: its micro-batches' forward and backward, and the optimizer step). On CUDA the
    device's own clock, CUDA events recorded around each window, and one synchronization per
    window, after it: the host queues work as in training, and a window's time includes the
    kernels still running when the host has finished it. On the CPU, ``clock``'s."""
    seconds = []
    synchronize(device)  # the work queued before the first window is not its
    for _ in range(windows):
        if device == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            for _ in range(updates_per_window):
                update()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            start = clock(device)
            for _ in range(updates_per_window):
                update()
            seconds.append(clock(device) - start)
    return seconds


def tokens_of_steps(samples, steps):
    """The tokens ``steps`` training steps see, cycling over ``samples`` from the first."""
    return sum(samples[index % len(samples)]["ntokens"] for index in range(steps))


def time_train_steps(trainer, samples, steps, device):
    """Tokens/s of ``steps`` training steps (one micro-batch each), cycling over ``samples``
    from the first, in one window of :func:`time_update_windows`."""
    cycle = itertools.cycle(samples)
    [seconds] = time_update_windows(lambda: trainer.train_step([next(cycle)]), 1, steps, device)
    return tokens_of_steps(samples, steps) / seconds


def beam_search_timer(trainer, task, size, device):
    """A function that times one translation of a fixed batch by fairseq's SequenceGenerator
    (beam 4, every hypothesis forced to the same length) and returns its sentences/s."""
    from fairseq.sequence_generator import SequenceGenerator

    model = trainer.model
    n = size["beam_sentences"]
    sample = synthetic_batch(dict(size, batch=n), len(task.source_dictionary), seed=1)
    sample = trainer._prepare_sample(sample)[0]
    length = size["length"]
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=4,
                                  max_len_a=0, max_len_b=length, min_len=length)

    def sentences_per_s():
        model.eval()
        with torch.no_grad():
            synchronize(device)
            start = clock(device)
            generator.generate([model], sample)
            synchronize(device)
            rate = n / (clock(device) - start)
        model.train()
        return rate

    for _ in range(2):  # warm-up (fairseq's TorchScript helpers specialise on first calls)
        sentences_per_s()
    return sentences_per_s
