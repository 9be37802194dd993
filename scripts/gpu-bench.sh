#!/usr/bin/env bash
# The GPU benchmark (BENCHMARKS.md, "On a GPU"): on one CUDA GPU, training tokens/s of stock
# fairseq 0.12 (the anchor: its transformer, pre-norm 6+6, --fp16, --optimizer adam, without the
# plug-in's patches) and of the base, Deep24 and multi-path 6x4 models through the command
# scripts/train.sh runs (its precision, adam_fused, the plug-in), the rows that decide the
# targets first: the anchor at 4,096-token micro-batches; base, Deep24 and multi-path 6x4 at
# train.sh's micro-batch for one card of this GPU (base and multi-path with a torch.profiler
# summary of 3 updates; the three decode with beam 4 as scripts/translate.sh does); the anchor at
# base's; base at 4,096; --compile-layers at the one-card micro-batch; then the rest (Deep24 and
# multi-path at 4,096, the routed families). Each row in a process of its own; rows start within
# 300 s and stop at 120 s, so one call ends within 8 minutes (docs/gpu.md: the one-call command).
#   scripts/gpu-bench.sh [--out DIR] [--only ROW ...] [--precision P] [--commit SHA]
#                        [--device cpu --size tiny]   (the report's form, on the CPU)
# Writes DIR/gpu-bench.json (device, driver, torch and CUDA versions, commit, every row's
# command and figures), DIR/gpu-bench.md generated from it and DIR/profile.md, the profiled
# rows' summaries (DIR: results/gpu-bench).
# Where PYTHON has no fairseq (a bare GPU machine), it is installed offline from .gpu-carry/
# (make gpu-carry; scripts/gpu-carry-install.sh).
# Exit status: 0 when every row ran, 3 when one failed (its row says why), 4 when none failed
# but the time budget left rows not run, anything else when the benchmark did not run. PYTHON
# selects the interpreter (default: python).
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
# a bare GPU machine: fairseq from .gpu-carry/ (make gpu-carry), offline
source "$(dirname "${BASH_SOURCE[0]}")/gpu-carry-install.sh"
status=0
"$python" -m multipath_nmt.cli.gpu_bench "$@" || status=$?
echo "gpu-bench.sh: exit status $status; took $SECONDS s" >&2
exit "$status"
