"""multipath-params: parameters and forward FLOPs of every architecture of this plug-in
(:mod:`multipath_nmt.params`)."""
import sys
from pathlib import Path

from multipath_nmt.cli import ToolParser
from multipath_nmt.params import architecture_table, data_bin_dictionaries, format_markdown


def build_parser():
    parser = ToolParser(prog="multipath-params",
                                     description="parameters and forward FLOPs of every architecture of this plug-in")
    parser.add_argument("--dict-size", type=int, default=34880,
                        help="joined (shared) dictionary size, or the source one with "
                             "--tgt-dict-size, special symbols included (default: 34880, the "
                             "paper's WMT14 En-De)")
    parser.add_argument("--tgt-dict-size", type=int,
                        help="target dictionary size: separate dictionaries, no embedding shared "
                             "(the paper's WMT14 En-Fr: --dict-size 43616 --tgt-dict-size 43616)")
    parser.add_argument("--data-bin", type=Path,
                        help="take the dictionary sizes and the embedding sharing from this "
                             "fairseq data-bin, as scripts/train.sh does (replaces the sizes)")
    parser.add_argument("--arch", action="append",
                        help="only this architecture (repeatable; default: all of this plug-in)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.data_bin is not None:
            args.dict_size, args.tgt_dict_size = data_bin_dictionaries(args.data_bin)
        rows = architecture_table(args.dict_size, args.arch, args.tgt_dict_size)
    except ValueError as error:
        sys.exit(f"multipath-params: {error}")
    sys.stdout.write(format_markdown(rows, args.dict_size, args.tgt_dict_size))


if __name__ == "__main__":
    main()
