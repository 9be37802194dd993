"""multipath-score: tokenized BLEU identical to multi-bleu.perl, then detokenized sacreBLEU.

    multipath-score --sys HYP --ref REF [--raw-ref RAW] [--compound-split] [--lang de] [-lc]
    multipath-score --generate-output gen.out [--raw-ref RAW] [--compound-split] [--lang de]

Line 1 is exactly what ``multi-bleu.perl [-lc] REF < HYP`` prints on the tokenized text (after
the ``##AT##-##AT##`` rule on both sides with --compound-split: fairseq's compound_split_bleu.sh,
the usual WMT En-De convention). Line 2 is corpus sacreBLEU (13a) with its signature, of the
hypotheses Moses-detokenized for --lang against --raw-ref: the references as released
(DATA_BIN/test.raw.LANG written by multipath-prepare, or the official .sgm itself), which is what
``sacrebleu -t wmt14/full -l en-de`` scores against. Without --raw-ref the references are the
detokenized tokenized ones, and line 2 says it is not comparable to published sacreBLEU.
"""
import argparse
import sys

from multipath_nmt import scoring


def get_parser():
    parser = argparse.ArgumentParser(prog="multipath-score", description=__doc__.split("\n")[0])
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
                        help="apply s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g to both sides of the tokenized "
                             "BLEU first (fairseq's compound_split_bleu.sh, the usual WMT En-De convention)")
    parser.add_argument("-lc", "--lowercase", action="store_true",
                        help="lowercase (ASCII, as multi-bleu.perl -lc does)")
    parser.add_argument("--lang", help="target language: Moses-detokenize the hypotheses (and, without "
                                       "--raw-ref, the references) with sacremoses before sacreBLEU")
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
        hyps = scoring.read_references(args.sys)
        ref_streams = [scoring.read_references(p) for p in scoring.reference_paths(args.ref)]
    print(stats, file=out)
    detok_hyps = scoring.detokenize(hyps, args.lang)
    if args.raw_ref:
        raw_streams = [scoring.read_references(p) for p in args.raw_ref]
        for path, stream in zip(args.raw_ref, raw_streams):
            if len(stream) != len(hyps):
                raise scoring.ScoringError(f"--raw-ref {path} has {len(stream)} references but there are "
                                           f"{len(hyps)} hypotheses; give the released test set they translate")
        how = "references as released (--raw-ref)"
    else:
        raw_streams = [scoring.detokenize(r, args.lang) for r in ref_streams]
        how = ("references detokenized from the tokenized ones: not comparable to published sacreBLEU, "
               "pass --raw-ref")
    how += (f", hypotheses Moses-detokenized for '{args.lang}'" if args.lang
            else ", hypotheses as given (pass --lang to detokenize tokenized text)")
    sacre, signature = scoring.sacrebleu_score(detok_hyps, raw_streams)
    print(f"sacreBLEU = {sacre.score:.2f} | {signature} | {how}", file=out)
    return stats


def cli_main():
    args = get_parser().parse_args()
    try:
        score(args)
    except scoring.ScoringError as err:
        sys.exit(f"multipath-score: error: {err}")


if __name__ == "__main__":
    cli_main()
