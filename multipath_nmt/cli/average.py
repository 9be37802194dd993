"""multipath-average: average fairseq checkpoints (fairseq's scripts/average_checkpoints.py options).

    multipath-average --inputs ckpt/checkpoint8.pt ckpt/checkpoint9.pt --output avg.pt
    multipath-average --inputs ckpt --num-epoch-checkpoints 5 --output ckpt/averaged.pt
    multipath-average --inputs ckpt --num-update-checkpoints 5 --checkpoint-upper-bound 50000 --output avg.pt
"""
import argparse
import sys

from multipath_nmt.averaging import AveragingError, average_checkpoints, last_n_checkpoints, save_atomically


def get_parser():
    parser = argparse.ArgumentParser(prog="multipath-average", description=__doc__.split("\n")[0],
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
    """Resolve the inputs like fairseq does, average them and write --output; returns the inputs."""
    inputs = args.inputs
    num = args.num_update_checkpoints if args.num_update_checkpoints is not None else args.num_epoch_checkpoints
    if num is not None:
        if len(inputs) != 1:
            raise AveragingError("--num-epoch-checkpoints/--num-update-checkpoints take one "
                                 f"directory as --inputs, got {len(inputs)} paths")
        inputs = last_n_checkpoints(inputs[0], num, update_based=args.num_update_checkpoints is not None,
                                    upper_bound=args.checkpoint_upper_bound)
    elif args.checkpoint_upper_bound is not None:
        raise AveragingError("--checkpoint-upper-bound needs --num-epoch-checkpoints or "
                             "--num-update-checkpoints")
    print(f"averaging {len(inputs)} checkpoints: {' '.join(inputs)}")
    state = average_checkpoints(inputs)
    save_atomically(state, args.output)
    print(f"wrote the averaged checkpoint to {args.output}")
    return inputs


def cli_main():
    args = get_parser().parse_args()
    try:
        average(args)
    except AveragingError as err:
        sys.exit(f"multipath-average: error: {err}")


if __name__ == "__main__":
    cli_main()
