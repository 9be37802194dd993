#!/usr/bin/env bash
# The GPU benchmark (BENCHMARKS.md, "On a GPU"): on one CUDA GPU, training tokens/s of stock
# fairseq 0.12 (the anchor: its transformer, pre-norm 6+6, --fp16, --optimizer adam, without the
# plug-in's patches) and of the base, Deep24 and multi-path 6x4 models through the command
# scripts/train.sh runs (its precision, adam_fused, the plug-in) at 4,096-token micro-batches and
# at train.sh's micro-batch for one card of this GPU (the anchor too, at the base model's), then
# --compile-layers and the routed families, and beam-4 decoding as scripts/translate.sh runs it.
# Each row in a process of its own; rows start within 300 s and stop at 120 s, so one call ends
# within 8 minutes.
#   scripts/gpu-bench.sh [--out DIR] [--only ROW ...] [--precision P] [--commit SHA]
#                        [--device cpu --size tiny]   (the report's form, on the CPU)
# Writes DIR/gpu-bench.json (device, driver, torch and CUDA versions, commit, every row's
# command and figures) and DIR/gpu-bench.md generated from it (DIR: results/gpu-bench).
# Exit status: 0 when every row ran, 3 when one failed (its row says why), anything else when
# the benchmark did not run. PYTHON selects the interpreter that has multipath_nmt installed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"
python=${PYTHON:-python}
device=cuda
for ((i = 1; i <= $#; i++)); do
    [ "${!i}" = --device ] && { j=$((i + 1)); device=${!j}; }
done
if [ "$device" = cuda ] && ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu-bench.sh: no CUDA device is visible to PyTorch ($python); run it on a GPU machine" >&2
    exit 1
fi
status=0
"$python" -m multipath_nmt.cli.gpu_bench "$@" || status=$?
echo "gpu-bench.sh: exit status $status; took $SECONDS s" >&2
exit "$status"
