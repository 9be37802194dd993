"""multipath-ctranslate2: run a dense model with CTranslate2 (docs/serving.md).

    multipath-ctranslate2 convert CHECKPOINT DATA_BIN OUT_DIR [--quantization int8]
    multipath-ctranslate2 translate OUT_DIR --input test.bpe.en --beam 4 > test.hyp

convert: CTranslate2's fairseq converter on a checkpoint of fairseq's transformer (the pre-norm,
deep and wide baselines, an EWA model folded by multipath-convert-ewa); multi-path, WideNet,
ParameterNet and MoE models are refused with the reason. translate: subword-tokenized sentences,
one a line, to the best hypothesis of each (tokens, as fairseq-generate's H- lines), with
fairseq-generate's search settings; sentences/s on stderr.
"""
import argparse
import os
import sys

from multipath_nmt.atomic_files import os_error_reason
from multipath_nmt.cli import ToolParser
from multipath_nmt.serving import convert_to_ctranslate2, ctranslate2_model_problem, translate

QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                 "bfloat16", "float32")


def build_parser():
    parser = ToolParser(prog="multipath-ctranslate2",
                                     description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 1)[1])
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="fairseq checkpoint -> CTranslate2 model folder")
    convert.add_argument("checkpoint", help="fairseq checkpoint (.pt)")
    convert.add_argument("data_bin", help="the data-bin with the model's dictionaries")
    convert.add_argument("output_dir", help="the CTranslate2 model folder to write")
    convert.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                         help="weights' type in the model folder (default: float32)")
    convert.add_argument("--source-lang", help="if the checkpoint does not record it")
    convert.add_argument("--target-lang", help="if the checkpoint does not record it")
    convert.add_argument("--force", action="store_true", help="overwrite output_dir")
    run = commands.add_parser("translate", help="translate tokenized sentences")
    run.add_argument("model_dir", help="a folder written by convert")
    run.add_argument("--input", default="-", help="one tokenized sentence a line (default: stdin)")
    run.add_argument("--beam", type=int, default=5, help="beam size (fairseq-generate's default: 5)")
    run.add_argument("--lenpen", type=float, default=1.0,
                     help="length penalty: scores divided by length ** lenpen (default: 1)")
    run.add_argument("--max-len-b", type=int, default=200,
                     help="at most this many tokens per hypothesis (default: 200)")
    run.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    run.add_argument("--compute-type", default="default",
                     help="CTranslate2's compute type: float32, int8, ... (default: the model's)")
    run.add_argument("--threads", type=int, default=0, help="CPU threads (0: CTranslate2 picks)")
    run.add_argument("--remove-bpe", nargs="?", const="@@ ", default=None,
                     help="remove this subword marker from the output (default when given: '@@ ')")
    return parser


def _translate(args):
    problem = ctranslate2_model_problem(args.model_dir)  # before reading the input
    if problem:
        sys.exit(f"multipath-ctranslate2: error: {problem}")
    try:
        source = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    except OSError as err:
        sys.exit(f"multipath-ctranslate2: error: cannot read --input {args.input}: "
                 f"{os_error_reason(err)}")
    with source:
        sentences = [line.split() for line in source]
    result = translate(args.model_dir, sentences, beam=args.beam, lenpen=args.lenpen,
                       max_len_b=args.max_len_b, batch_size=args.batch_size,
                       compute_type=args.compute_type, threads=args.threads)
    for tokens in result.hypotheses:
        line = " ".join(tokens)
        if args.remove_bpe:
            line = (line + " ").replace(args.remove_bpe, "").rstrip()
        print(line)
    print(f"multipath-ctranslate2: {len(sentences)} sentences in {result.seconds:.2f} s "
          f"({result.sentences_per_second:.1f} sentences/s), beam {args.beam}, "
          f"compute type {args.compute_type}", file=sys.stderr)


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.command == "convert":
            if os.path.exists(args.output_dir) and not args.force:
                sys.exit(f"multipath-ctranslate2: error: {args.output_dir} exists (--force "
                         "overwrites it)")
            convert_to_ctranslate2(args.checkpoint, args.data_bin, args.output_dir,
                                   quantization=args.quantization, source_lang=args.source_lang,
                                   target_lang=args.target_lang, force=args.force)
            print(f"wrote {args.output_dir}")
        else:
            _translate(args)
    except ValueError as err:  # NotServable, CheckpointError, FolderNotWritten, the converter's
        sys.exit(f"multipath-ctranslate2: error: {err}")


if __name__ == "__main__":
    main()
