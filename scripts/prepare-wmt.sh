#!/usr/bin/env bash
# Download and prepare one of the paper's 12 WMT directions into a fairseq data-bin.
# Usage: scripts/prepare-wmt.sh TASK [--raw-dir DIR] [--mirror URL] [--workers N] [--bpe-merges N] [--out DIR]
# TASK: wmt14_{en_de,de_en,en_fr,fr_en}, wmt17_{en_de,de_en,en_fi,fi_en,en_lv,lv_en,en_ru,ru_en}.
# Downloads resume after a dropped connection and are checked against pinned checksums; rerunning
# skips finished stages; the sizes are printed next to Table 1's. See examples/wmt/README.md.
set -euo pipefail
if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    exec multipath-prepare wmt --help
fi
echo "== multipath-prepare wmt $*" >&2
exec multipath-prepare wmt "$@"
