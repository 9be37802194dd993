"""Time the optimizer step of ``multipath-bench``'s systems, ``--optimizer adam`` against
``adam_fused``, round-robin.

    python -m multipath_nmt.benchmark.update_timing [--systems NAME ... | --all-systems]
        [--repeats R] [--steps S] [--train-step]

Each (system, optimizer) gets a fairseq Trainer of ``multipath-bench``'s default size (d 256,
FFN 1024, 4 heads, 8000 words, 1 decoder layer, the system's own flags) and one training step on
its synthetic batch, which leaves the gradients and the Adam state in place; then
``trainer.optimizer.step()`` (or, with ``--train-step``, the whole training step) is timed S
times per repeat, everything taking turns so that drift of a shared machine falls on all alike.
The clock is ``multipath-bench``'s (CPU time of the process, all its threads). The default
system, "stock deep 4L", is the 24-layer baseline (``transformer_deep24_wmt_en_de``).
"""
import argparse
import statistics


def time_optimizer_steps(systems, optimizers, repeats, steps, train_step=False, log=print):
    """{(system, optimizer): [seconds per step, one per repeat]} and {system: parameter
    tensors}."""
    from multipath_nmt.benchmark.batches import fake_data_dir, synthetic_batch
    from multipath_nmt.benchmark.memory import keep_freed_memory
    from multipath_nmt.benchmark.systems import SIZES, build_trainer, fairseq_flags
    from multipath_nmt.benchmark.timing import clock

    size = SIZES["default"]
    keep_freed_memory()
    trainers, batches, tensors = {}, {}, {}
    with fake_data_dir(size["vocab"]) as data:
        for system in systems:
            for name in optimizers:
                flags = [*fairseq_flags(size, system), f"--optimizer={name}"]
                trainer, task = build_trainer(data, flags, "cpu", fp16=False)
                batch = [synthetic_batch(size, len(task.source_dictionary))]
                trainer.train_step(batch)
                trainers[system.name, name], batches[system.name, name] = trainer, batch
            tensors[system.name] = sum(1 for p in trainer.model.parameters() if p.grad is not None)
    seconds = {key: [] for key in trainers}
    for repeat in range(repeats):
        for key, trainer in trainers.items():
            start = clock("cpu")
            for _ in range(steps):
                if train_step:
                    trainer.train_step(batches[key])
                else:
                    trainer.optimizer.step()
            seconds[key].append((clock("cpu") - start) / steps)
        log(f"repeat {repeat + 1}/{repeats} done")
    return seconds, tensors


def main(argv=None):
    from multipath_nmt.benchmark.systems import SIZES, systems_for

    lineup = {s.name: s for s in systems_for(SIZES["default"])
              if not s.loop_reference}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", choices=list(lineup), default=["stock deep 4L"],
                        metavar="NAME", help=f"multipath-bench systems: {', '.join(lineup)}")
    parser.add_argument("--all-systems", action="store_true")
    parser.add_argument("--optimizers", nargs="+", default=["adam", "adam_fused"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--train-step", action="store_true",
                        help="time the whole training step (forward, backward, update)")
    args = parser.parse_args(argv)
    systems = list(lineup.values()) if args.all_systems else [lineup[n] for n in args.systems]
    seconds, tensors = time_optimizer_steps(systems, args.optimizers, args.repeats, args.steps,
                                            args.train_step)
    what = "training step" if args.train_step else "optimizer step"
    print(f"{what} in ms, median (min-max) over {args.repeats} repeats of {args.steps} steps")
    print(f"| system | tensors | {' | '.join(args.optimizers)} | speed-up |")
    print(f"|---|---|{'---|' * len(args.optimizers)}---|")
    for system in systems:
        cells, medians = [], []
        for name in args.optimizers:
            values = seconds[system.name, name]
            medians.append(statistics.median(values))
            cells.append(f"{1e3 * medians[-1]:.1f} ({1e3 * min(values):.1f}-"
                         f"{1e3 * max(values):.1f})")
        print(f"| {system.name} | {tensors[system.name]} | {' | '.join(cells)} | "
              f"{medians[0] / medians[-1]:.2f}x |")


if __name__ == "__main__":
    main()
