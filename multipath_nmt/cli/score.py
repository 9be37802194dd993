"""multipath-score: tokenized BLEU identical to multi-bleu.perl, then detokenized sacreBLEU.

    multipath-score --sys HYP --ref REF [--compound-split] [--lang de] [-lc]
    multipath-score --generate-output gen.out [--compound-split] [--lang de]

Line 1 is exactly what ``multi-bleu.perl [-lc] REF < HYP`` prints (after the ``##AT##-##AT##``
rule on both sides with --compound-split, the paper's En-De protocol). Line 2 is corpus
sacreBLEU (13a) with its signature, on text Moses-detokenized for --lang when given.
"""
import argparse
import sys

from multipath_nmt import scoring


def get_parser():
    parser = argparse.ArgumentParser(prog="multipath-score", description=__doc__.split("\n")[0])
    parser.add_argument("--sys", help="hypothesis file, one tokenized sentence per line")
    parser.add_argument("--ref", help="reference file; like multi-bleu.perl, REF0, REF1, ... "
                                      "are read as multiple references when they exist")
    parser.add_argument("--generate-output", metavar="FILE",
                        help="score fairseq-generate output (T- references, hypotheses by id) "
                             "instead of --sys/--ref")
    parser.add_argument("--hyp-field", choices=["H", "D"], default="H",
                        help="hypothesis lines of --generate-output: H (tokenized, default) or "
                             "D (detokenized with fairseq-generate --tokenizer)")
    parser.add_argument("--compound-split", action="store_true",
                        help="apply s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g to both sides first "
                             "(fairseq's compound_split_bleu.sh, the WMT En-De protocol)")
    parser.add_argument("-lc", "--lowercase", action="store_true",
                        help="lowercase (ASCII, as multi-bleu.perl -lc does)")
    parser.add_argument("--lang", help="target language: Moses-detokenize hypotheses and "
                                       "references with sacremoses before sacreBLEU")
    return parser


def score(args, out=sys.stdout):
    """Print the multi-bleu line and the sacreBLEU line; returns the multi-bleu statistics."""
    if args.generate_output:
        hyps, refs = scoring.read_generate_output(args.generate_output, args.hyp_field)
        ref_streams = [refs]
        hyp_bytes = "".join(h + "\n" for h in hyps).encode("utf-8", "surrogateescape")
        ref_bytes = "".join(r + "\n" for r in refs).encode("utf-8", "surrogateescape")
        if args.compound_split:
            hyp_bytes, ref_bytes = scoring.compound_split(hyp_bytes), scoring.compound_split(ref_bytes)
        stats = scoring.multi_bleu(scoring.perl_lines(hyp_bytes), [scoring.perl_lines(ref_bytes)],
                                   lowercase=args.lowercase)
    else:
        if not args.sys or not args.ref:
            raise scoring.ScoringError("give --sys HYP and --ref REF, or --generate-output FILE")
        stats = scoring.multi_bleu_files(args.sys, args.ref, lowercase=args.lowercase,
                                         compound=args.compound_split)
        hyps = _text_lines(args.sys)
        ref_streams = [_text_lines(p) for p in scoring.reference_paths(args.ref)]
    print(stats, file=out)
    sacre, signature = scoring.sacrebleu_score(
        scoring.detokenize(hyps, args.lang), [scoring.detokenize(r, args.lang) for r in ref_streams])
    how = (f"Moses-detokenized for '{args.lang}'" if args.lang
           else "text as given; pass --lang to detokenize tokenized text")
    print(f"sacreBLEU = {sacre.score:.2f} | {signature} | {how}", file=out)
    return stats


def _text_lines(path):
    """Lines split on "\\n" only, as multi-bleu.perl splits them (str.splitlines also splits on U+2028...)."""
    lines = scoring.read_bytes(path).decode("utf-8", "surrogateescape").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def cli_main():
    args = get_parser().parse_args()
    try:
        score(args)
    except scoring.ScoringError as err:
        sys.exit(f"multipath-score: error: {err}")


if __name__ == "__main__":
    cli_main()
