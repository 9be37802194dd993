"""The measurement of ``multipath-bench``: every system built, profiled once, then timed
round-robin, so that drifts of a noisy machine hit all of them alike; figures are medians over
repeats with their min-max spread."""
import shlex
import sys

import torch

from multipath_nmt import recipe
from multipath_nmt.benchmark.batches import fake_data_dir, padded_batches, synthetic_batch
from multipath_nmt.benchmark.flops import (
    gemm_peak_flops,
    matmul_peak_flops,
    model_gemm_shapes,
    training_flops_per_token,
)
from multipath_nmt.benchmark.layers import layer_benchmarks
from multipath_nmt.benchmark.memory import keep_freed_memory, peak_memory_of_step
from multipath_nmt.benchmark.micro_batch import micro_batch_profile, update_profile
from multipath_nmt.benchmark.bench_report import git_commit, machine_description
from multipath_nmt.benchmark.systems import SIZES, build_trainer, fairseq_flags, systems_for
from multipath_nmt.benchmark.timing import (
    ForwardBackwardClock,
    beam_search_timer,
    steps_per_measurement,
    summary,
    time_train_steps,
    time_update_windows,
    tokens_of_steps,
)

PADDED_BATCHES = 8  # the padded mode's batches per system, cycled through by every measurement
# The dtype of the matrix products under each of train.sh's precisions (``recipe.PRECISIONS``:
# bf16 and fp16 autocast over fp32 weights): the matmul peaks and the single layers run in it.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def run(size_name="default", device="cpu", precision="fp32", only=None, memory=True, padded=None,
        log=print):
    """Measure every system; returns the result dict that ``write_reports`` renders.

    ``precision``: one of train.sh's (``recipe.PRECISIONS``); its fairseq flags are added to every
    system's (bf16 and fp16 are autocast, ``--amp``, as train.sh trains).

    ``padded`` (the default on CUDA): train on padded, length-varied fairseq batches of about
    batch x length tokens instead of one full-length batch, and judge MFU against the best rate
    the device reaches on the measured models' own matrix products instead of a 1024^3 matmul
    (a GPU's rate depends on the shapes far more than a CPU's)."""
    size = SIZES[size_name]
    padded = device == "cuda" if padded is None else padded
    systems = [s for s in systems_for(size) if not only or s.name in only]
    precision_flags = recipe.PRECISIONS[precision]
    dtype = DTYPES[precision]
    heap_allocator = device == "cpu" and keep_freed_memory()
    if not padded:
        peak = matmul_peak_flops(device, dtype)
        log(f"matmul peak ({dtype}): {peak / 1e9:.1f} GFLOP/s")
    gemm_shapes = set()
    results = {}
    with fake_data_dir(size["vocab"]) as data:
        built = {}
        for system in systems:
            try:
                built[system.name], results[system.name] = _build_and_warm_up(
                    system, data, size, device, precision_flags, padded, gemm_shapes)
            except Exception as error:  # noqa: BLE001 a failed system is a finding; measure the others
                results[system.name] = _failed(system, error)
                log(f"{system.name} failed: {results[system.name]['error']}")
                continue
            r = results[system.name]
            log(f"built {system.name}: {r['params'] / 1e6:.2f}M params, "
                f"{r['train_flops_per_token'] / 1e6:.1f} MFLOP/token (fwd+bwd), "
                f"{r['steps_per_measurement']} steps per measurement, "
                f"{r['host_syncs']} host syncs per micro-batch")
        systems = [s for s in systems if s.name in built]
        if padded and not gemm_shapes:  # every system failed
            peak = matmul_peak_flops(device, dtype)
        elif padded:
            peak, best_shape = gemm_peak_flops(gemm_shapes, device, dtype, repeats=20)
            log(f"peak over the models' {len(gemm_shapes)} matrix product shapes ({dtype}): "
                f"{peak / 1e9:.1f} GFLOP/s at (batch, m, k, n) = {best_shape}")
        for repeat in range(size["repeats"]):  # round-robin against drift
            for system in systems:
                trainer, _, samples, forward_backward = built[system.name]
                steps = results[system.name]["steps_per_measurement"]
                forward_backward.seconds = 0.0
                # Where synchronizing is free (the CPU) the split is read in the timed steps;
                # on a GPU it synchronizes every micro-batch, so it gets a pass of its own.
                forward_backward.active = device != "cuda"
                rate = time_train_steps(trainer, samples, steps, device)
                if not forward_backward.active:
                    forward_backward.active = True
                    time_train_steps(trainer, samples, steps, device)
                forward_backward.active = False
                results[system.name]["tokens_per_s"].append(rate)
                results[system.name]["forward_backward_s"].append(
                    forward_backward.seconds / steps)
            log(f"repeat {repeat + 1}/{size['repeats']} done")
        for system in systems:
            r = results[system.name]
            # per repeat, so the update's share is not the difference of two unrelated medians
            tokens = r["tokens_per_step"]
            r["update_s"] = summary([tokens / rate - forward_backward for rate, forward_backward
                                     in zip(r["tokens_per_s"], r["forward_backward_s"])])
            for key in ("tokens_per_s", "forward_backward_s"):
                r[key] = summary(r[key])
            r["mfu"] = r["train_flops_per_token"] * r["tokens_per_s"]["median"] / peak
        timers = {system.name: beam_search_timer(*built[system.name][:2], size, device)
                  for system in systems if system.group in ("baselines", "multi-path")}
        beam_rates = {name: [] for name in timers}
        for _ in range(size["repeats"]):  # round-robin, like the training steps
            for name, timer in timers.items():
                beam_rates[name].append(timer())
        for name, rates in beam_rates.items():
            results[name]["beam_sentences_per_s"] = summary(rates)
        del built
    # one layer is cheap to time, and its targets (3 and 5) compare close figures: more repeats
    layers = layer_benchmarks(size, device, dtype, 3 * size["repeats"], log=log)
    if memory:
        for system in systems:
            try:
                results[system.name]["peak_memory_mib"] = peak_memory_of_step(
                    [*fairseq_flags(size, system), *precision_flags], size, device, False,
                    system.loop_reference)
            except Exception as error:  # noqa: BLE001 the other figures of the system stand
                results[system.name]["peak_memory_error"] = _error_line(error)
                log(f"{system.name}: memory probe failed: {_error_line(error)}")
    return {
        "size": size_name, "shape": size, "device": device,
        "dtype": str(dtype).replace("torch.", ""), "precision": precision,
        "precision_flags": precision_flags,
        "machine": machine_description(device), "matmul_peak_flops": peak,
        "batches": (f"{PADDED_BATCHES} padded, length-varied batches of up to "
                    f"{size['batch'] * size['length']} tokens" if padded
                    else "one full-length batch"),
        "peak": ("the best of the models' own matrix products" if padded
                 else "a 1024 x 1024 x 1024 matmul"),
        "heap_allocator": heap_allocator,
        "command": shlex.join(["multipath-bench", *sys.argv[1:]]), "systems": results,
        "layers": layers,
    }


# The host's floor: each system at this shape (the size's layers, d 16, 2 sentences of 8 tokens)
# does almost no arithmetic per kernel, so an update's time is the host's own work (Python,
# fairseq's trainer, autograd, the dispatcher): the pace a GPU cannot beat once the host sets it.
# On one thread: with more, OpenMP's start of each tiny op adds to every kernel a cost that a
# GPU's host thread does not pay. ``check_dim``: stock timed again at half the width; about
# the same time says the kernels cost nearly nothing at d 16.
HOST_FLOOR = dict(dim=16, ffn=32, heads=2, batch=2, length=8, warmup=3, windows=7,
                  window_seconds=0.5, check_dim=8, threads=1)


def run_proxies(size_name="default", device="cpu", precision="fp32", only=None, log=print):
    """``multipath-bench --proxies``: every system built and warmed up as :func:`run` builds it,
    then counted: its host syncs per micro-batch and the host syncs and kernel launches of one
    whole update (counts, not times, so they hold on a loaded machine); then the host's time
    per update at :data:`HOST_FLOOR`'s shape (a time: read it on an idle machine). The CPU
    proxies of a GPU's pace."""
    size = SIZES[size_name]
    systems = [s for s in systems_for(size) if not only or s.name in only]
    results = {}
    with fake_data_dir(size["vocab"]) as data:
        for system in systems:
            try:
                _, row = _build_and_warm_up(system, data, size, device,
                                            recipe.PRECISIONS[precision], False, set(),
                                            timed=False)
                row["host_ms_per_update"] = host_floor_ms(system, data, size, device,
                                                          recipe.PRECISIONS[precision])
            except Exception as error:  # noqa: BLE001 a failed system is a finding; count the others
                row = _failed(system, error)
            results[system.name] = row
            log(f"{system.name}: {row.get('kernel_launches_per_update')} kernel launches, "
                f"{row.get('host_syncs_per_update')} host syncs per update, host floor "
                f"{row.get('host_ms_per_update', {}).get('median', float('nan')):.1f} ms")
        check = next((s for s in systems if s.name == "stock prenorm L"), None)
        floor_check = None
        if check and "host_ms_per_update" in results[check.name]:
            narrow = host_floor_ms(check, data, size, device, recipe.PRECISIONS[precision],
                                   dim=HOST_FLOOR["check_dim"])
            floor_check = dict(system=check.name, dim=HOST_FLOOR["check_dim"],
                               host_ms_per_update=narrow)
    return {"size": size_name, "shape": size, "device": device, "precision": precision,
            "machine": machine_description(device), "commit": git_commit(),
            "command": shlex.join(["multipath-bench", *sys.argv[1:]]), "systems": results,
            "host_floor": dict(HOST_FLOOR, check=floor_check)}


def host_floor_ms(system, data, size, device, precision_flags, dim=None):
    """Milliseconds per whole update (one micro-batch) of ``system`` at :data:`HOST_FLOOR`'s
    shape (``dim``: another width): the median of its windows, with min-max."""
    floor = dict(size, **{k: HOST_FLOOR[k] for k in ("dim", "ffn", "heads", "batch", "length")})
    if dim:
        floor.update(dim=dim, ffn=2 * dim, heads=min(floor["heads"], dim))
    trainer, task = build_trainer(data, [*fairseq_flags(floor, system), *precision_flags],
                                  device, False, system.loop_reference)
    sample = synthetic_batch(floor, len(task.source_dictionary))
    update = lambda: trainer.train_step([sample])  # noqa: E731
    threads = torch.get_num_threads()
    torch.set_num_threads(HOST_FLOOR["threads"])
    try:
        for _ in range(HOST_FLOOR["warmup"]):
            update()
        [probe] = time_update_windows(update, 1, 3, device)
        per_window = max(3, round(HOST_FLOOR["window_seconds"] / (probe / 3)))
        seconds = time_update_windows(update, HOST_FLOOR["windows"], per_window, device)
    finally:
        torch.set_num_threads(threads)
    return summary([1e3 * s / per_window for s in seconds])


def _error_line(error):
    """The last line of an error's message, with its type: what a report row can show."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]


def _failed(system, error):
    return dict(arch=system.arch, flags=system.flags, group=system.group,
                compare_to=system.compare_to, loop_reference=system.loop_reference,
                error=_error_line(error))


def _build_and_warm_up(system, data, size, device, precision_flags, padded, gemm_shapes,
                       timed=True):
    """A system's trainer built, profiled and warmed up: (what the timing loops need, its row).
    ``timed=False``: the counts alone, no timing of its steps."""
    flags = [*fairseq_flags(size, system), *precision_flags]
    trainer, task = build_trainer(data, flags, device, False, system.loop_reference)
    if padded:
        samples = padded_batches(task, trainer.model, size["batch"] * size["length"],
                                 PADDED_BATCHES, mean_length=size["length"])
        gemm_shapes.update(model_gemm_shapes(trainer, samples[0]))
    else:
        samples = [synthetic_batch(size, len(task.source_dictionary))]
    sample = samples[0]
    flops = sum(training_flops_per_token(trainer, s) * s["ntokens"]
                for s in samples) / tokens_of_steps(samples, len(samples))
    profile = micro_batch_profile(trainer, sample)
    for s in samples:  # warm-up: optimizer state, allocator, caches
        trainer.train_step([s])
    profile.update(update_profile(lambda: trainer.train_step([sample])))
    if not timed:
        return None, dict(arch=system.arch, flags=system.flags, group=system.group, **profile)
    steps = steps_per_measurement(
        size, sample["ntokens"] / time_train_steps(trainer, samples, 1, device))
    params = sum(p.numel() for p in trainer.model.parameters())
    inactive = sum(m.inactive_parameter_count() for m in trainer.model.modules()
                   if hasattr(m, "inactive_parameter_count"))
    row = dict(arch=system.arch, flags=system.flags, group=system.group,
               compare_to=system.compare_to, loop_reference=system.loop_reference, params=params,
               active_params=params - inactive, train_flops_per_token=flops, **profile,
               steps_per_measurement=steps,
               tokens_per_step=tokens_of_steps(samples, steps) / steps,
               tokens_per_s=[], forward_backward_s=[])
    return (trainer, task, samples, ForwardBackwardClock(trainer, device)), row


def run_compiled(size_name="default", device="cpu", precision="fp32", only=None,
                 backend="inductor", padded=None, log=print):
    """``multipath-bench --compiled``: every system's training eager and with
    ``--compile-layers BACKEND`` side by side (:mod:`multipath_nmt.benchmark.compiled`); returns
    the result dict that ``write_compiled_report`` writes."""
    from multipath_nmt.benchmark.compiled import compare

    size = SIZES[size_name]
    padded = device == "cuda" if padded is None else padded
    with fake_data_dir(size["vocab"]) as data:
        rows = compare(data, size, device, recipe.PRECISIONS[precision], only, backend, padded,
                       PADDED_BATCHES, log)
    return {
        "size": size_name, "shape": size, "device": device, "precision": precision,
        "precision_flags": recipe.PRECISIONS[precision], "backend": backend,
        "machine": machine_description(device),
        "batches": (f"{PADDED_BATCHES} padded, length-varied batches of up to "
                    f"{size['batch'] * size['length']} tokens" if padded
                    else "one full-length batch"),
        "command": shlex.join(["multipath-bench", *sys.argv[1:]]), "compiled": rows,
    }
