"""multipath-export-hf: a fairseq checkpoint to a Hugging Face transformers model folder
(docs/serving.md).

    multipath-export-hf CHECKPOINT OUT_DIR --data-bin DATA_BIN [--bpe-codes CODES]

Dense models (the pre-norm, deep and wide baselines, a folded EWA model) become
M2M100ForConditionalGeneration, multi-path models M2M100 with the package's multi-path encoder
layers as remote code; other families are refused with the reason. Load the folder with
AutoModelForSeq2SeqLM.from_pretrained(OUT_DIR, trust_remote_code=True); with --bpe-codes,
AutoTokenizer.from_pretrained(OUT_DIR) turns raw text into the model's ids.
"""
import argparse
import os
import sys

from multipath_nmt.cli import ToolParser
from multipath_nmt.hf_export import export_to_transformers


def build_parser():
    parser = ToolParser(prog="multipath-export-hf",
                                     description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 1)[1])
    parser.add_argument("checkpoint", help="fairseq checkpoint (.pt)")
    parser.add_argument("output_dir", help="the transformers model folder to write")
    parser.add_argument("--data-bin", required=True,
                        help="the data-bin with the model's dictionaries")
    parser.add_argument("--bpe-codes", help="subword-nmt's BPE codes of the data-bin: also "
                                            "write the tokenizer (raw text -> ids)")
    parser.add_argument("--source-lang", help="if the checkpoint does not record it")
    parser.add_argument("--target-lang", help="if the checkpoint does not record it")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output_dir (once the new folder is complete)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if os.path.exists(args.output_dir) and not args.force:
        sys.exit(f"multipath-export-hf: error: {args.output_dir} exists (--force replaces it)")
    if args.bpe_codes and not os.path.isfile(args.bpe_codes):
        sys.exit(f"multipath-export-hf: error: --bpe-codes {args.bpe_codes} is not a file")
    try:
        export_to_transformers(args.checkpoint, args.data_bin, args.output_dir,
                               bpe_codes=args.bpe_codes, source_lang=args.source_lang,
                               target_lang=args.target_lang, force=args.force)
    except ImportError as err:
        sys.exit(f"multipath-export-hf: error: {err.name or err} is not installed: "
                 "pip install transformers")
    except ValueError as err:  # NotExportable, CheckpointError, FolderNotWritten
        sys.exit(f"multipath-export-hf: error: {err}")
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main()
