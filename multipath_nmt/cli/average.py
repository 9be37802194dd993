"""multipath-average: average fairseq checkpoints (fairseq's scripts/average_checkpoints.py options).

    multipath-average --inputs ckpt/checkpoint8.pt ckpt/checkpoint9.pt --output avg.pt
    multipath-average --inputs ckpt --num-epoch-checkpoints 5 --output ckpt/averaged.pt
    multipath-average --inputs ckpt --num-update-checkpoints 5 --checkpoint-upper-bound 50000 --output avg.pt
"""
import argparse
import sys

from multipath_nmt.averaging import AveragingError, average_checkpoints, save_atomically, select_checkpoints
from multipath_nmt.cli import ToolParser


def build_parser():
    parser = ToolParser(prog="multipath-average", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 1)[1])
    parser.add_argument("--inputs", required=True, nargs="+",
                        help="checkpoint files, or one directory with --num-*-checkpoints")
    parser.add_argument("--output", required=True, metavar="FILE",
                        help="where to write the averaged checkpoint (written atomically)")
    count = parser.add_mutually_exclusive_group()
    count.add_argument("--num-epoch-checkpoints", type=int,
                       help="average the last N checkpointE.pt files of the --inputs directory")
    count.add_argument("--num-update-checkpoints", type=int,
                       help="average the last N checkpoint_E_U.pt files of the --inputs directory")
    parser.add_argument("--checkpoint-upper-bound", type=int,
                        help="ignore checkpoints after this epoch (or update, with "
                             "--num-update-checkpoints)")
    return parser


def average(args):
    """Average the checkpoints parsed ``args`` name and write --output; returns the inputs.
    Raises :class:`AveragingError`."""
    inputs = select_checkpoints(args.inputs, args.num_epoch_checkpoints, args.num_update_checkpoints,
                                args.checkpoint_upper_bound)
    print(f"averaging {len(inputs)} checkpoints: {' '.join(inputs)}")
    save_atomically(average_checkpoints(inputs), args.output)
    print(f"wrote the averaged checkpoint to {args.output}")
    return inputs


def main(argv=None):
    try:
        average(build_parser().parse_args(argv))
    except AveragingError as err:
        sys.exit(f"multipath-average: error: {err}")


if __name__ == "__main__":
    main()
