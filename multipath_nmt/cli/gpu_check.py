"""The GPU check (scripts/gpu-check.sh): the per-family table, every architecture family trained
in-process through the command scripts/train.sh builds (the recipe's optimizer and precision,
--update-freq 2), its loss against fp32's over the same updates, host syncs, memory, speed and
fp16 beam search, on one GPU; the recipe leg, train.sh's own fairseq-train command for one GPU
(its update-freq and precision) run as fairseq-train for a few updates with a save, a validation
and a resume, against fp32; and the recipe's fairseq-train command on 2 GPUs where there are 2
(:mod:`multipath_nmt.benchmark.gpu_check`)."""
import logging
import sys
import warnings

from multipath_nmt import recipe
from multipath_nmt.benchmark import gpu_check
from multipath_nmt.cli import ToolParser


def build_parser():
    parser = ToolParser(description=__doc__)
    parser.add_argument("--data", metavar="DATA_BIN",
                        help="a fairseq data-bin with a joined dictionary: batches from its train "
                             "split, beam search on its valid split (default: synthetic "
                             "sentences of varied length)")
    parser.add_argument("--out", default="results/gpu-check",
                        help="folder for check.json and check.md")
    parser.add_argument("--size", choices=sorted(gpu_check.CHECK_SIZES), default="gpu",
                        help="'gpu' (d 512, 6+6 layers; the table: 20 updates of 2 x "
                             "4096-token micro-batches; the recipe leg: 4 updates, resumed to "
                             "8) is the check; 'tiny' runs the same code in seconds (tests)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu runs everything but the sync, memory and CUDA-event figures "
                             "and the 2-GPU run")
    parser.add_argument("--precision", choices=gpu_check.PRECISIONS, default="auto",
                        help="train.sh's --precision (auto: bf16 on GPUs that have it, else "
                             "fp16; fp32 on the CPU; fp16 needs CUDA); memory-efficient-fp16 is "
                             "fairseq's fp16 optimizer, whose loss scaler runs on the CPU too")
    parser.add_argument("--no-ddp", action="store_true",
                        help="skip the fairseq-train runs on 2 GPUs (run where 2 or more GPUs "
                             "are visible)")
    parser.add_argument("--only", nargs="+", metavar="SYSTEM",
                        help="check only these systems (names as in the report)")
    parser.add_argument("--no-table", action="store_true",
                        help="skip the per-family table (in-process training, syncs, memory, "
                             "speed, beam search): run the recipe leg alone")
    parser.add_argument("--no-recipe", action="store_true",
                        help="skip the recipe leg (train.sh's fairseq-train, saved, validated "
                             "and resumed)")
    parser.add_argument("--recipe-systems", nargs="+", metavar="SYSTEM",
                        help="the recipe leg's systems, or 'all' (default: "
                             f"{', '.join(repr(n) for n in gpu_check.RECIPE_SYSTEMS)}, those "
                             "among --only where it is given)")
    parser.add_argument("--commit", help="the commit measured, where the tree has no .git "
                                          "(recorded in check.json with the versions)")
    parser.add_argument("--recipe-jobs", type=int, metavar="N",
                        help="fairseq-train chains of the recipe leg run side by side "
                             "(default: all of them on CUDA, 1 on the CPU)")
    return parser


def main(argv=None):
    """Exit status 3 when the check ran and some system failed to run or failed a check
    (``scripts/gpu-check.sh`` tells that apart from a check that did not run)."""
    args = build_parser().parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"gpu-check: {recipe.no_cuda_device()}")
    if args.precision == "fp16" and args.device != "cuda":
        sys.exit("gpu-check: --precision fp16 needs --device cuda (float16 autocast and its loss "
                 "scaler are CUDA's); on the CPU use bf16, fp32 or memory-efficient-fp16")
    try:
        gpu_check.resolve_precision(args.precision, args.device)
    except recipe.RecipeError as error:
        sys.exit(f"gpu-check: {error}")
    known = [s.name for s in gpu_check.check_systems(gpu_check.CHECK_SIZES[args.size])]
    recipe_systems = known if args.recipe_systems == ["all"] else args.recipe_systems
    unknown = sorted(set(args.only or []).union(recipe_systems or []) - set(known))
    if unknown:
        sys.exit(f"gpu-check: unknown system(s) {unknown}; choose from {known}")
    if args.no_recipe:
        recipe_systems = []
    elif recipe_systems is None:
        recipe_systems = [name for name in gpu_check.RECIPE_SYSTEMS
                          if not args.only or name in args.only]
    if args.no_table and args.no_recipe:
        sys.exit("gpu-check: --no-table and --no-recipe leave nothing to run")
    if args.recipe_jobs is not None and args.recipe_jobs < 1:
        sys.exit(f"gpu-check: --recipe-jobs must be 1 or more, got {args.recipe_jobs}")
    logging.basicConfig(level=logging.WARNING, force=True)  # fairseq and hydra are chatty
    warnings.filterwarnings("ignore", module="hydra")
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    result = gpu_check.run_check(args.size, args.device, args.precision, args.data, args.only,
                                 log=log, ddp_gpus=0 if args.no_ddp or args.no_table else None,
                                 table=not args.no_table, recipe_systems=recipe_systems,
                                 recipe_jobs=args.recipe_jobs, commit=args.commit)
    gpu_check.write_reports(result, args.out)
    print(gpu_check.markdown_report(result))
    print(f"wrote {args.out}/check.json and check.md", file=sys.stderr)
    print(f"gpu-check: took {result['seconds']:.0f} s", file=sys.stderr)
    return 3 if gpu_check.failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())
