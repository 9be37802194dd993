"""Time the optimizer step alone, ``--optimizer adam`` against ``adam_fused``, round-robin.

    python -m multipath_nmt.optim.update_timing [--arch A] [--repeats R] [--steps S]

Each optimizer gets a fairseq Trainer of ``multipath-bench``'s default size (d 256, FFN 1024,
4 heads, 8000 words, 1 decoder layer) and one training step on its synthetic batch, which leaves
the gradients and the Adam state in place; then ``trainer.optimizer.step()`` is timed S times
per repeat, the optimizers taking turns so that drift of a shared machine falls on all of them.
The clock is ``multipath-bench``'s (CPU time of the process, all its threads).
"""
import argparse
import statistics


def time_optimizer_steps(arch, optimizers, repeats, steps, train_step=False, log=print):
    """{optimizer: [seconds per step, one per repeat]} plus the number of parameter tensors;
    with ``train_step`` the whole training step (forward, backward, update) is timed."""
    from multipath_nmt import benchmark

    size = benchmark.SIZES["default"]
    benchmark.keep_freed_memory()
    trainers, batches = {}, {}
    with benchmark.fake_data_dir(size["vocab"]) as data:
        for name in optimizers:
            flags = benchmark.fairseq_flags(size, benchmark.System(name, arch))
            trainer, task = benchmark.build_trainer(data, [*flags, f"--optimizer={name}"],
                                                    "cpu", fp16=False)
            batches[name] = [benchmark.synthetic_batch(size, len(task.source_dictionary))]
            trainer.train_step(batches[name])
            trainers[name] = trainer
    tensors = sum(1 for p in trainers[optimizers[0]].model.parameters() if p.grad is not None)
    seconds = {name: [] for name in optimizers}
    for repeat in range(repeats):
        for name, trainer in trainers.items():
            start = benchmark.clock("cpu")
            for _ in range(steps):
                if train_step:
                    trainer.train_step(batches[name])
                else:
                    trainer.optimizer.step()
            seconds[name].append((benchmark.clock("cpu") - start) / steps)
        log(f"repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{name} {1e3 * s[-1]:.1f} ms" for name, s in seconds.items()))
    return seconds, tensors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="transformer_deep24_wmt_en_de")
    parser.add_argument("--optimizers", nargs="+", default=["adam", "adam_fused"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per repeat")
    parser.add_argument("--train-step", action="store_true",
                        help="time the whole training step (forward, backward, update)")
    args = parser.parse_args(argv)
    seconds, tensors = time_optimizer_steps(args.arch, args.optimizers, args.repeats, args.steps,
                                            args.train_step)
    first = statistics.median(seconds[args.optimizers[0]])
    what = "training step" if args.train_step else "optimizer step"
    print(f"{args.arch}: {tensors} parameter tensors; {what}, median (min-max) over "
          f"{args.repeats} repeats of {args.steps} steps:")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"  {name}: {1e3 * median:.1f} ms ({1e3 * min(values):.1f}-{1e3 * max(values):.1f})"
              f", {first / median:.2f}x")


if __name__ == "__main__":
    main()
