"""multipath-bench: every architecture side by side on the same synthetic batches
(:mod:`multipath_nmt.benchmark`)."""
import logging
import sys
import warnings

from multipath_nmt import benchmark, recipe
from multipath_nmt.cli import ToolParser


def build_parser():
    parser = ToolParser(prog="multipath-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(benchmark.SIZES), default="default",
                        help="model and batch size; 'default' takes about 8.5 minutes on 2 idle "
                             "CPU cores, 'tiny' is for tests")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["auto", *recipe.PRECISIONS], default="auto",
                        help="train.sh's precision, the same for every system: bf16 (--amp "
                             "--bf16) and fp16 (--amp) autocast over fp32 weights; auto (the "
                             "default, as train.sh's) is bf16 on GPUs that have it, else fp16, "
                             "and fp32 on the CPU; fp16 needs --device cuda")
    parser.add_argument("--fp16", action="store_true",
                        help="the same as --precision fp16 (fairseq's --amp, as train.sh trains; "
                             "no longer fairseq's all-fp16 --fp16)")
    parser.add_argument("--only", nargs="+", metavar="SYSTEM",
                        help="measure only these systems (names as in the table)")
    parser.add_argument("--padded", action="store_true",
                        help="train on padded, length-varied batches and judge MFU against the "
                             "models' own matrix products (always on with --device cuda)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the per-system peak-memory probes (one process each)")
    parser.add_argument("--compiled", nargs="?", const="inductor", metavar="BACKEND",
                        help="instead of the full report: time every system's training eager "
                             "and with fairseq-train's --compile-layers BACKEND (default "
                             "inductor) side by side, the compile time apart; writes "
                             "compiled.json and compiled.md")
    parser.add_argument("--proxies", action="store_true",
                        help="instead of the full report: count every system's kernel launches "
                             "and host syncs per update, and time its update at d 16 on one "
                             "thread (the host's floor): the CPU proxies of a GPU's pace, about "
                             "3 minutes; writes proxies.json and proxies.md")
    parser.add_argument("--out", default="results/bench",
                        help="folder for bench.json, bench.md and bench.png")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fp16:
        if args.precision not in ("auto", "fp16"):  # auto: the default, not asked for
            parser.error(f"--fp16 and --precision {args.precision} contradict each other")
        args.precision = "fp16"
    if args.precision == "fp16" and args.device != "cuda":
        given = "--fp16" if args.fp16 else "--precision fp16"
        parser.error(f"{given} needs --device cuda: float16 autocast and its loss scaler are "
                     "CUDA's (on the CPU: --precision bf16 or fp32)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit(f"multipath-bench: --device cuda: {recipe.no_cuda_device()}")
    try:
        args.precision = recipe.choose_precision(args.precision, int(args.device == "cuda"))
    except recipe.RecipeError as error:
        parser.error(str(error))
    known = {s.name for s in benchmark.systems_for(benchmark.SIZES[args.size])}
    unknown = sorted(set(args.only or []) - known)
    if unknown:
        parser.error(f"unknown system(s) {unknown}; choose from {sorted(known)}")
    logging.basicConfig(level=logging.WARNING, force=True)  # fairseq and hydra are chatty
    warnings.filterwarnings("ignore", module="hydra")
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    if args.proxies:
        result = benchmark.run_proxies(args.size, args.device, args.precision, args.only,
                                       log=log)
        print(benchmark.write_proxies_report(result, args.out))
        print(f"wrote {args.out}/proxies.json, proxies.md", file=sys.stderr)
        return
    if args.compiled:
        result = benchmark.run_compiled(args.size, args.device, args.precision, args.only,
                                        args.compiled, padded=args.padded or None, log=log)
        print(benchmark.write_compiled_report(result, args.out))
        print(f"wrote {args.out}/compiled.json, compiled.md", file=sys.stderr)
        return
    result = benchmark.run(args.size, args.device, args.precision, args.only,
                           memory=not args.no_memory, padded=args.padded or None, log=log)
    result = benchmark.write_reports(result, args.out)
    print(benchmark.markdown_report(result))
    print(f"wrote {args.out}/bench.json, bench.md, bench.png", file=sys.stderr)


if __name__ == "__main__":
    main()
