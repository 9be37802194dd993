#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on one CUDA GPU, in about 10 minutes, for every architecture family
# (stock transformer, multi-path, WideNet, MoE, EWA, ParameterNet): 50 fp16 training steps through
# fairseq's Trainer on padded, length-varied batches (finite losses, loss scale, skipped steps),
# synchronizing CUDA operations per step (torch.cuda.set_sync_debug_mode("warn")), peak memory,
# tokens/s against stock fairseq, and beam search in fp16 against fp32 on the same weights;
# then multipath-bench --device cuda --fp16.
#   scripts/gpu-check.sh [--out DIR] [--data DATA_BIN] [--only SYSTEM ...] [--no-bench]
# Writes DIR/check.json and DIR/check.md (DIR: results/gpu-check), and DIR/bench/bench.{json,md,png}.
# --data: a data-bin with a joined dictionary (batches from train, beam search on valid);
# default: synthetic sentences of varied length. --no-bench skips multipath-bench (about 4 of the
# 10 minutes). Other arguments go to `python -m multipath_nmt.cli.gpu_check` (see its --help).
# PYTHON selects the interpreter that has multipath_nmt installed (default: python).
set -euo pipefail
python=${PYTHON:-python}
out=results/gpu-check bench=1 device=cuda args=()
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --no-bench) bench=0; shift ;;
        --device) device=$2; args+=("$1" "$2"); shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
# Before fairseq is imported (it prints its own start-up lines): is there a GPU at all?
if [ "$device" = cuda ] && ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu-check.sh: no CUDA device is visible to PyTorch ($python); run it on a GPU machine" >&2
    exit 1
fi
status=0
"$python" -m multipath_nmt.cli.gpu_check --out "$out" "${args[@]}" || status=$?
# 3: the check ran and some system failed (the report says which); anything else: it did not run
# (no GPU, bad arguments) and its message says why
if [ "$status" -ne 0 ] && [ "$status" -ne 3 ]; then
    exit "$status"
fi
reports="$out/check.md"
if [ "$bench" = 1 ]; then
    "$python" -m multipath_nmt.cli.bench --device cuda --fp16 --out "$out/bench" || status=$?
    reports="$reports, $out/bench/bench.md"
fi
echo "gpu-check.sh: reports in $reports; exit status $status" >&2
exit "$status"
