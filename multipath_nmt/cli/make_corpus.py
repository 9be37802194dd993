"""multipath-make-corpus: write the synthetic En->De-like quickstart corpus (see pipeline/synthetic.py)."""

from multipath_nmt.cli import ToolParser, positive_int
from multipath_nmt.pipeline.synthetic import write_corpus


def build_parser():
    parser = ToolParser(
        prog="multipath-make-corpus",
        description="Write a synthetic English->German-like parallel corpus (reordering, agreement, "
                    "hyphenated compounds, numbers, punctuation, casing) as raw text "
                    "OUT/{train,valid,test}.{en,de}, deterministic for a seed.")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--train", type=positive_int, default=20000, help="training sentence pairs (default: 20000)")
    parser.add_argument("--valid", type=positive_int, default=500, help="validation sentence pairs (default: 500)")
    parser.add_argument("--test", type=positive_int, default=500, help="test sentence pairs (default: 500)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    out = write_corpus(args.out, train=args.train, valid=args.valid, test=args.test, seed=args.seed)
    print(f"wrote {args.train} / {args.valid} / {args.test} sentence pairs to {out}/{{train,valid,test}}.{{en,de}}")


if __name__ == "__main__":
    main()
