"""The GPU check (scripts/gpu-check.sh): fp16 training, host syncs, memory, speed and fp16 beam
search of every architecture family on one GPU, in about 10 minutes
(:mod:`multipath_nmt.benchmark.gpu_check`)."""
import argparse
import logging
import sys
import warnings

from multipath_nmt.benchmark import gpu_check


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", metavar="DATA_BIN",
                        help="a fairseq data-bin with a joined dictionary: batches from its train "
                             "split, beam search on its valid split (default: synthetic "
                             "sentences of varied length)")
    parser.add_argument("--out", default="results/gpu-check",
                        help="folder for check.json and check.md")
    parser.add_argument("--size", choices=sorted(gpu_check.CHECK_SIZES), default="gpu",
                        help="'gpu' (d 512, 6+6 layers, 4096-token batches, 50 steps) is the "
                             "check; 'tiny' runs the same code in seconds (tests)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu runs everything but the sync, memory and CUDA-event figures")
    parser.add_argument("--precision", choices=sorted(gpu_check.PRECISIONS), default="fp16",
                        help="fairseq's training precision (fp16 needs CUDA; "
                             "memory-efficient-fp16 runs on the CPU too)")
    parser.add_argument("--only", nargs="+", metavar="SYSTEM",
                        help="check only these systems (names as in the report)")
    return parser


def main(argv=None):
    """Exit status 3 when the check ran and some system failed (``scripts/gpu-check.sh`` tells
    that apart from a check that did not run)."""
    args = build_parser().parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"gpu-check: no CUDA device is visible to PyTorch {torch.__version__} "
                 f"(CUDA build: {torch.version.cuda or 'none'}); run it on a GPU machine")
    if args.precision == "fp16" and args.device != "cuda":
        sys.exit("gpu-check: --precision fp16 needs --device cuda (fairseq's fp16 optimizer); "
                 "use --precision memory-efficient-fp16 on the CPU")
    known = [s.name for s in gpu_check.check_systems(gpu_check.CHECK_SIZES[args.size])]
    unknown = sorted(set(args.only or []) - set(known))
    if unknown:
        sys.exit(f"gpu-check: unknown system(s) {unknown}; choose from {known}")
    logging.basicConfig(level=logging.WARNING, force=True)  # fairseq and hydra are chatty
    warnings.filterwarnings("ignore", module="hydra")
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    result = gpu_check.run_check(args.size, args.device, args.precision, args.data, args.only,
                                 log=log)
    gpu_check.write_reports(result, args.out)
    print(gpu_check.markdown_report(result))
    print(f"wrote {args.out}/check.json and check.md", file=sys.stderr)
    return 3 if any("error" in r for r in result["systems"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
