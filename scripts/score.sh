#!/usr/bin/env bash
# Tokenized BLEU identical to multi-bleu.perl (line 1), detokenized sacreBLEU (line 2) and chrF (line 3) against the
# references as released (--raw-ref DATA_BIN/test.raw.LANG from multipath-prepare, or the official .sgm).
#   scripts/score.sh --sys HYP --ref REF [--raw-ref RAW] [--compound-split] [--lang de] [-lc]
#   scripts/score.sh --generate-output gen.out [--raw-ref RAW] [--compound-split] [--lang de]
# PYTHON selects the interpreter that has multipath_nmt installed (default: python).
set -euo pipefail
echo "score.sh: multipath-score $*" >&2
exec "${PYTHON:-python}" -m multipath_nmt.cli.score "$@"
