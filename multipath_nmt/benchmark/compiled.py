"""``multipath-bench --compiled``: every system's training eager and with ``--compile-layers``
side by side in one run, the compile time apart.

Each system is built twice from the same flags and seed (same weights), the compiled one with
``--compile-layers BACKEND`` (:mod:`multipath_nmt.fairseq_patches.compile_layers`). The first
training step of the compiled trainer is its compile, reported as ``compile_s`` (wall seconds:
inductor compiles in worker processes, which the CPU clock of this process does not see); then
both take the same warm-up steps and are timed round-robin, each repeat's pair back to back, on
the benchmark's clock. A system's ratio is the median over repeats of compiled / eager tokens/s.
The loop reference (an implementation to compare with, not a system one trains) is left out.
"""
import time

from multipath_nmt.benchmark.batches import padded_batches, synthetic_batch
from multipath_nmt.benchmark.systems import build_trainer_from_argv, fairseq_flags, systems_for
from multipath_nmt.benchmark.timing import steps_per_measurement, summary, time_train_steps


def _build(data, size, system, device, precision_flags, extra):
    argv = [data, "-s", "src", "-t", "tgt", *fairseq_flags(size, system), *precision_flags,
            *(["--cpu"] if device == "cpu" else []), *extra]
    return build_trainer_from_argv(argv)


def _error_line(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]


def _build_pair(data, size, system, device, precision_flags, backend, padded, batches):
    """The eager and compiled trainers of a system, warmed up: ({mode: (trainer, samples)},
    compile seconds, seconds of one eager step)."""
    pair = {}
    for mode, extra in (("eager", []), ("compiled", ["--compile-layers", backend])):
        trainer, task = _build(data, size, system, device, precision_flags, extra)
        if padded:
            samples = padded_batches(task, trainer.model, size["batch"] * size["length"],
                                     batches, mean_length=size["length"])
        else:
            samples = [synthetic_batch(size, len(task.source_dictionary))]
        pair[mode] = (trainer, samples)
    trainer, samples = pair["compiled"]
    start = time.perf_counter()
    trainer.train_step([samples[0]])  # the compile (dynamic shapes: once per layer class)
    compile_s = time.perf_counter() - start
    for s in samples[1:]:
        trainer.train_step([s])
    for s in pair["eager"][1]:  # the same warm-up steps
        pair["eager"][0].train_step([s])
    step_s = {mode: samples[0]["ntokens"] / time_train_steps(trainer, samples, 1, device)
              for mode, (trainer, samples) in pair.items()}
    return pair, compile_s, step_s["eager"]


def compare(data, size, device, precision_flags, only=None, backend="inductor", padded=False,
            batches=8, log=print):
    """{system: row} of eager vs compiled training throughput (see the module docstring)."""
    systems = [s for s in systems_for(size)
               if (not only or s.name in only) and not s.loop_reference]
    built, rows = {}, {}
    for system in systems:
        row = rows[system.name] = dict(arch=system.arch, flags=system.flags, group=system.group,
                                       backend=backend)
        try:
            built[system.name], compile_s, step_s = _build_pair(
                data, size, system, device, precision_flags, backend, padded, batches)
        except Exception as error:  # noqa: BLE001 a failed system is a finding; measure the others
            row["error"] = _error_line(error)
            log(f"{system.name} failed: {row['error']}")
            continue
        row.update(compile_s=compile_s, steps_per_measurement=steps_per_measurement(size, step_s),
                   eager_tokens_per_s=[], compiled_tokens_per_s=[], ratio=[])
        log(f"{system.name}: compiled in {compile_s:.1f} s")
    for repeat in range(size["repeats"]):  # round-robin against drift
        for name, pair in built.items():
            row = rows[name]
            rates = {mode: time_train_steps(trainer, samples, row["steps_per_measurement"],
                                            device)
                     for mode, (trainer, samples) in pair.items()}
            row["eager_tokens_per_s"].append(rates["eager"])
            row["compiled_tokens_per_s"].append(rates["compiled"])
            row["ratio"].append(rates["compiled"] / rates["eager"])
        log(f"repeat {repeat + 1}/{size['repeats']} done")
    for name in built:
        for key in ("eager_tokens_per_s", "compiled_tokens_per_s", "ratio"):
            rows[name][key] = summary(rows[name][key])
    return rows


def markdown(rows):
    """The eager-vs-compiled table of :func:`compare`'s rows."""
    lines = ["| system | eager tokens/s | compiled tokens/s | compiled / eager (min-max) | "
             "compile s |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | failed: {row['error']} | | | |")
            continue
        ratio = row["ratio"]
        lines.append(
            f"| {name} | {row['eager_tokens_per_s']['median']:,.0f} | "
            f"{row['compiled_tokens_per_s']['median']:,.0f} | {ratio['median']:.2f}x "
            f"({ratio['min']:.2f}-{ratio['max']:.2f}) | {row['compile_s']:.0f} |")
    return "\n".join(lines)
