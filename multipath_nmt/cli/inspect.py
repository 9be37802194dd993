"""multipath-inspect: learned path weights and path diversity of a trained checkpoint.

Prints, per layer and sublayer, the path weights alpha, the residual weight beta and the path
diversity |d| (Lin et al., 2022, Fig. 7), and for WideNet and pre-norm Transformer checkpoints
the divergence of the encoder blocks' LayerNorms (WideNet Eq. 9 per block); see
:mod:`multipath_nmt.analysis.inspect_report`.
"""
import sys

from multipath_nmt.analysis.inspect_report import inspect_checkpoint
from multipath_nmt.cli import ToolParser


def build_parser():
    parser = ToolParser(prog="multipath-inspect", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a fairseq checkpoint (e.g. checkpoint_best.pt)")
    parser.add_argument("--plot", metavar="PNG", help="also draw path diversity per layer here")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        sys.stdout.write(inspect_checkpoint(args.checkpoint, args.plot))
    except ValueError as error:
        sys.exit(f"multipath-inspect: {error}")


if __name__ == "__main__":
    main()
