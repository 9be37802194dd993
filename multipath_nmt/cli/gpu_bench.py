"""The GPU benchmark (scripts/gpu-bench.sh): training and beam-search speed of every architecture
family on one GPU against stock fairseq 0.12 on the same card
(:mod:`multipath_nmt.benchmark.gpu_bench`)."""
import sys

from multipath_nmt import recipe
from multipath_nmt.benchmark import gpu_bench
from multipath_nmt.cli import ToolParser


def build_parser():
    parser = ToolParser(description=__doc__)
    parser.add_argument("--out", default="results/gpu-bench",
                        help="folder for gpu-bench.json and gpu-bench.md")
    parser.add_argument("--size", choices=sorted(gpu_bench.SIZES), default="gpu",
                        help="'gpu' (d 512, 6+6 layers; 4096-token micro-batches, 2 per update, "
                             "and train.sh's one-card micro-batch) is the benchmark; 'tiny' runs "
                             "the same code in seconds (tests)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu shows the report's form (no memory column; the anchor in fp32)")
    parser.add_argument("--precision", choices=["auto", *recipe.PRECISIONS], default="auto",
                        help="train.sh's --precision for every row but the anchor (auto: bf16 "
                             "on GPUs that have it, else fp16; fp32 on the CPU)")
    parser.add_argument("--only", nargs="+", metavar="ROW", help="run only these rows")
    parser.add_argument("--compile-backend", default="inductor",
                        help="the torch.compile backend of the --compile-layers rows")
    parser.add_argument("--budget-s", type=float,
                        help="start no row after this many seconds (default: the size's, "
                             "300 s for 'gpu')")
    parser.add_argument("--commit", help="the commit measured, where the tree has no .git")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"gpu-bench: {recipe.no_cuda_device()}")
    try:
        precision = recipe.choose_precision(args.precision, int(args.device == "cuda"))
    except recipe.RecipeError as error:
        sys.exit(f"gpu-bench: {error}")
    known = gpu_bench.row_names(gpu_bench.SIZES[args.size])
    unknown = sorted(set(args.only or []) - set(known))
    if unknown:
        sys.exit(f"gpu-bench: unknown row(s) {unknown}; choose from {known}")
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    result = gpu_bench.run(args.size, args.device, precision, args.only, args.compile_backend,
                           args.commit, args.budget_s, log=log,
                           on_row=lambda partial: gpu_bench.write_reports(partial, args.out))
    gpu_bench.write_reports(result, args.out)
    print(gpu_bench.markdown_report(result))
    print(f"wrote {args.out}/gpu-bench.json and gpu-bench.md", file=sys.stderr)
    return gpu_bench.exit_status(result)


if __name__ == "__main__":
    sys.exit(main())
