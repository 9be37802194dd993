#!/usr/bin/env bash
# Export a trained model to a Hugging Face transformers folder (docs/serving.md).
#   scripts/export-hf.sh CHECKPOINT OUT_DIR DATA_BIN [multipath-export-hf options, e.g. --bpe-codes CODES]
# PYTHON selects the interpreter that has multipath_nmt installed (default: python).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"
if [ $# -lt 3 ]; then
    echo "usage: $0 CHECKPOINT OUT_DIR DATA_BIN [multipath-export-hf options]" >&2
    exit 1
fi
checkpoint=$1 out=$2 data_bin=$3
shift 3
exec "${PYTHON:-python}" -m multipath_nmt.cli.export_hf "$checkpoint" "$out" \
    --data-bin "$data_bin" "$@"
