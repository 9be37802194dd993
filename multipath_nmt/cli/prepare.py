"""multipath-prepare: WMT directions or a user's parallel text -> fairseq data-bin (see pipeline/prepare.py)."""
import os
import sys

from multipath_nmt.cli import ToolParser, positive_int
from multipath_nmt.pipeline.prepare import PrepareError, prepare_corpus, prepare_wmt
from multipath_nmt.pipeline.wmt import TASKS


def build_parser():
    parser = ToolParser(
        prog="multipath-prepare",
        description="Normalize, Moses-tokenize (-a), clean, joint-BPE and binarize parallel text into a "
                    "fairseq data-bin directory. Every stage is restartable: rerunning skips finished stages.")
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub):
        sub.add_argument("--bpe-merges", type=positive_int, default=32000,
                         help="number of joint BPE merge operations (default: 32000)")
        sub.add_argument("--workers", type=positive_int, default=min(4, os.cpu_count() or 1),
                         help="processes for tokenization, BPE and fairseq-preprocess (default: min(4, CPUs))")
        sub.add_argument("--work-dir", default=None,
                         help="where the intermediate text stages go (default: OUT.work next to OUT; "
                              "for WMT, <pair>.work next to OUT so both directions share it)")

    wmt = commands.add_parser(
        "wmt", help="download and prepare one of the paper's 12 WMT directions",
        description="Download (resumable, checksummed), extract, tokenize, clean, BPE-encode and binarize one "
                    "of the 12 WMT directions of the paper's Table 1, then print its sizes next to Table 1's.")
    wmt.add_argument("task", help=f"one of: {', '.join(TASKS)}")
    wmt.add_argument("--out", default=None, help="the data-bin directory to write (default: data-bin/TASK)")
    wmt.add_argument("--raw-dir", default=None,
                     help="folder with archives you already have (same file names as the download URLs; "
                          "a split release such as the UN corpus also as its .00, .01, ... parts); each is "
                          "checked against its pinned checksum")
    wmt.add_argument("--mirror", default=None,
                     help="replace the scheme and host of every download URL with this one, e.g. "
                          "http://localhost:8000 serves /wmt13/training-parallel-europarl-v7.tgz; archives "
                          "behind a licence page are looked for there too")
    common(wmt)

    corpus = commands.add_parser("corpus", help="prepare your own raw parallel text PREFIX.L1 / PREFIX.L2")
    corpus.add_argument("--src", required=True, help="source language code, e.g. en")
    corpus.add_argument("--tgt", required=True, help="target language code, e.g. de")
    for split in ("train", "valid", "test"):
        corpus.add_argument(f"--{split}", required=True, metavar="PREFIX",
                            help=f"{split} text: PREFIX.SRC and PREFIX.TGT (or PREFIX.SRC.gz / PREFIX.TGT.gz)")
    corpus.add_argument("--out", required=True, help="the data-bin directory to write")
    common(corpus)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.command == "wmt":
            prepare_wmt(args.task, out=args.out, raw_dir=args.raw_dir, mirror=args.mirror,
                        workers=args.workers, bpe_merges=args.bpe_merges, work_dir=args.work_dir)
        else:
            prepare_corpus(args.src, args.tgt, args.train, args.valid, args.test, args.out,
                           bpe_merges=args.bpe_merges, workers=args.workers, work_dir=args.work_dir)
    except PrepareError as e:
        print(f"multipath-prepare: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
