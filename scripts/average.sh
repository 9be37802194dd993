#!/usr/bin/env bash
# Average the last N epoch checkpoints of a training run (the paper averages the last 5).
#   scripts/average.sh SAVE_DIR [N] [OUTPUT]      (defaults: N=5, OUTPUT=SAVE_DIR/checkpoint_avg.pt)
# Any further arguments go to multipath-average (e.g. --checkpoint-upper-bound 30).
# PYTHON selects the interpreter that has multipath_nmt installed (default: python).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"
if [ $# -lt 1 ]; then
    echo "usage: $0 SAVE_DIR [N] [OUTPUT] [multipath-average options]" >&2
    exit 1
fi
save_dir=$1
num=${2:-5}
output=${3:-$save_dir/checkpoint_avg.pt}
shift $(( $# < 3 ? $# : 3 ))
echo "average.sh: averaging the last $num epoch checkpoints of $save_dir into $output"
exec "${PYTHON:-python}" -m multipath_nmt.cli.average --inputs "$save_dir" \
    --num-epoch-checkpoints "$num" --output "$output" "$@"
