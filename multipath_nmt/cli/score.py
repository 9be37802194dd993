"""multipath-score: tokenized BLEU identical to multi-bleu.perl, then detokenized sacreBLEU.

    multipath-score --sys HYP --ref REF [--raw-ref RAW] [--compound-split] [--lang de] [-lc]
    multipath-score --generate-output gen.out [--raw-ref RAW] [--compound-split] [--lang de]

Line 1 is exactly what ``multi-bleu.perl [-lc] REF < HYP`` prints on the tokenized text (after
the ``##AT##-##AT##`` compound-split rule on both sides with --compound-split: fairseq's
compound_split_bleu.sh on text tokenized without ``-a``; on ``-a`` text, whose compounds are
already split, each ``@-@`` word becomes one ``##AT##-##AT##`` word instead of being split
again, so both tokenizations score alike). Line 2 is corpus sacreBLEU (13a) with its signature, of the
hypotheses Moses-detokenized for --lang against --raw-ref: the references as released
(DATA_BIN/test.raw.LANG written by multipath-prepare, or the official .sgm itself), which is what
``sacrebleu -t wmt14/full -l en-de`` scores against. Without --raw-ref the references are the
detokenized tokenized ones, and line 2 says it is not comparable to published sacreBLEU.
The scores come from :mod:`multipath_nmt.scoring`.
"""
import sys

from multipath_nmt import scoring
from multipath_nmt.cli import ToolParser


def build_parser():
    parser = ToolParser(prog="multipath-score", description=__doc__.split("\n")[0])
    parser.add_argument("--sys", help="hypothesis file, one tokenized sentence per line")
    parser.add_argument("--ref", help="tokenized reference file; like multi-bleu.perl, REF0, REF1, ... "
                                      "are read as multiple references when they exist")
    parser.add_argument("--generate-output", metavar="FILE",
                        help="score fairseq-generate output (T- references, hypotheses by id) "
                             "instead of --sys/--ref")
    parser.add_argument("--hyp-field", choices=["H", "D"], default="H",
                        help="hypothesis lines of --generate-output: H (tokenized, default) or "
                             "D (detokenized with fairseq-generate --tokenizer)")
    parser.add_argument("--raw-ref", nargs="+", metavar="RAW",
                        help="the references as released, for sacreBLEU: DATA_BIN/test.raw.LANG from "
                             "multipath-prepare, or the official .sgm (extracted like sacreBLEU does); "
                             "one file per reference")
    parser.add_argument("--compound-split", action="store_true",
                        help="split hyphenated compounds on both sides of the tokenized BLEU first: "
                             "s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g (fairseq's compound_split_bleu.sh), "
                             "with each @-@ word of tokenizer.perl -a text made one ##AT##-##AT## word "
                             "instead, so text tokenized with or without -a scores alike")
    parser.add_argument("-lc", "--lowercase", action="store_true",
                        help="lowercase (ASCII, as multi-bleu.perl -lc does)")
    parser.add_argument("--lang", help="target language: Moses-detokenize the hypotheses (and, without "
                                       "--raw-ref, the references) with sacremoses before sacreBLEU")
    return parser


def score(args, out=None) -> scoring.MultiBleu:
    """Print the multi-bleu line, the sacreBLEU line and the chrF line of parsed ``args`` to ``out`` (default:
    stdout); returns the multi-bleu statistics. Raises :class:`~multipath_nmt.scoring.ScoringError`."""
    options = dict(raw_refs=args.raw_ref, compound=args.compound_split, lowercase=args.lowercase,
                   lang=args.lang)
    if args.generate_output:
        scores = scoring.score_generate_output(args.generate_output, args.hyp_field, **options)
    elif args.sys and args.ref:
        scores = scoring.score_files(args.sys, args.ref, **options)
    else:
        raise scoring.ScoringError("give --sys HYP and --ref REF, or --generate-output FILE")
    if args.raw_ref:
        how = "references as released (--raw-ref)"
    else:
        how = ("references detokenized from the tokenized ones: not comparable to published sacreBLEU, "
               "pass --raw-ref")
    how += (f", hypotheses Moses-detokenized for '{args.lang}'" if args.lang
            else ", hypotheses as given (pass --lang to detokenize tokenized text)")
    print(scores.multi_bleu, file=out)
    print(f"sacreBLEU = {scores.sacrebleu:.2f} | {scores.signature} | {how}", file=out)
    print(f"chrF2 = {scores.chrf:.2f} | {scores.chrf_signature}", file=out)
    return scores.multi_bleu


def main(argv=None):
    try:
        score(build_parser().parse_args(argv))
    except scoring.ScoringError as err:
        sys.exit(f"multipath-score: error: {err}")


if __name__ == "__main__":
    main()
