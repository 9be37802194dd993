#!/usr/bin/env bash
# Prepare your own raw parallel text (PREFIX.L1 / PREFIX.L2, plain or .gz) into a fairseq data-bin.
# Usage: scripts/prepare-corpus.sh --src L1 --tgt L2 --train PREFIX --valid PREFIX --test PREFIX
#            --out DATA_BIN_DIR [--bpe-merges N] [--workers N]
# Intermediate text goes to DATA_BIN_DIR.work next to DATA_BIN_DIR; rerunning skips finished stages.
set -euo pipefail
if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    exec multipath-prepare corpus --help
fi
echo "== multipath-prepare corpus $*" >&2
exec multipath-prepare corpus "$@"
