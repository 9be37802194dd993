"""multipath-convert-ewa IN OUT: fold an EWA model into a stock fairseq ``transformer`` checkpoint
(:mod:`multipath_nmt.ewa.folding`)."""
import os
import sys

from multipath_nmt.checkpoint_io import CheckpointError
from multipath_nmt.cli import ToolParser
from multipath_nmt.ewa.folding import NotAnEWACheckpoint, convert_ewa_checkpoint


def build_parser():
    parser = ToolParser(
        prog="multipath-convert-ewa",
        description="Fold an EWA moe_transformer checkpoint into a stock fairseq transformer "
                    "checkpoint (each EWA MoE becomes the mean of its experts).")
    parser.add_argument("input", help="EWA checkpoint (moe_transformer, --encoder-ffn ewa)")
    parser.add_argument("output", help="where to write the stock transformer checkpoint")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        sys.exit(f"multipath-convert-ewa: the folder of {args.output} does not exist")
    try:
        convert_ewa_checkpoint(args.input, args.output)
    except (NotAnEWACheckpoint, CheckpointError) as err:
        sys.exit(f"multipath-convert-ewa: {err}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
