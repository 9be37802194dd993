#!/usr/bin/env bash
# The GPU check (docs/gpu.md), on one CUDA GPU, in two legs:
# - the per-family table: every architecture family (stock transformer, multi-path, WideNet, MoE,
#   EWA, ParameterNet) trained in-process (fairseq's Trainer) from the command scripts/train.sh
#   builds (recipe.train_command: --optimizer adam_fused, the recipe's lr and criterion, and
#   train.sh's precision: --precision auto is --amp --bf16 on GPUs with bfloat16, else --amp; but
#   --update-freq 2, not train.sh's 8 or 16 on one GPU), at the check's model size with a short
#   --warmup-updates, 20 updates on padded, length-varied batches: finite losses, a falling loss,
#   loss scale and skipped updates, synchronizing CUDA operations per update
#   (torch.cuda.set_sync_debug_mode("warn")), peak memory, tokens/s against stock fairseq, the
#   same updates in fp32 (same seed and batches: the last losses' gap must be within 10% of fp32's
#   loss fall), and beam search in fp16 against fp32 on the same weights;
# - the recipe leg: the fairseq-train command `scripts/train.sh --dry-run` prints for one GPU (its
#   --update-freq and precision) run as fairseq-train itself for K updates with a save and a
#   validation, then resumed from checkpoint_last.pt to 2K updates, in train.sh's precision and in
#   fp32 (same rule for the gap); by default for stock and multi-path 6 x 4.
# Where 2 or more GPUs are visible, the recipe's fairseq-train command on 2 GPUs (DDP, 20
# updates): its exit status and whether its loss fell. Each system's memory is freed before the
# next, a failing system does not stop the others, and the time each took is reported. Then
# multipath-bench --device cuda --precision (the same precision).
#   scripts/gpu-check.sh [--out DIR] [--data DATA_BIN] [--only SYSTEM ...] [--precision P]
#                        [--no-table] [--no-recipe] [--recipe-systems SYSTEM ...|all]
#                        [--no-ddp] [--no-bench] [--commit SHA]
# Writes DIR/check.json and DIR/check.md (DIR: results/gpu-check), and DIR/bench/bench.{json,md,png}.
# --data: a data-bin with a joined dictionary (batches from train, beam search on valid, the
# recipe leg and the 2-GPU runs on train and valid); default: synthetic sentences of varied
# length. --no-bench skips multipath-bench. Other arguments go to `python -m
# multipath_nmt.cli.gpu_check` (see its --help).
# Time on one H200: docs/bench/gpu-check-h200.md (the table) and gpu-check-recipe-h200.md.
# Exit status: 0 when every system passed, 3 when one failed to run or failed a check (check.md
# says which and why), anything else when the check did not run. The last line says how long it
# took. PYTHON selects the interpreter (default: python); where it has no fairseq (a bare GPU
# machine), fairseq is installed offline from .gpu-carry/ (make gpu-carry;
# scripts/gpu-carry-install.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"
python=${PYTHON:-python}
out=results/gpu-check bench=1 device=cuda precision=auto args=()
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --no-bench) bench=0; shift ;;
        --device) device=$2; args+=("$1" "$2"); shift 2 ;;
        --precision) precision=$2; args+=("$1" "$2"); shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
# Before fairseq is imported (it prints its own start-up lines): is there a GPU at all?
if [ "$device" = cuda ] && ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu-check.sh: no CUDA device is visible to PyTorch ($python); run it on a GPU machine" >&2
    exit 1
fi
# a bare GPU machine: fairseq from .gpu-carry/ (make gpu-carry), offline
source "$(dirname "${BASH_SOURCE[0]}")/gpu-carry-install.sh"
status=0
"$python" -m multipath_nmt.cli.gpu_check --out "$out" "${args[@]}" || status=$?
# 3: the check ran and some system failed (the report says which); anything else: it did not run
# (no GPU, bad arguments) and its message says why
if [ "$status" -ne 0 ] && [ "$status" -ne 3 ]; then
    exit "$status"
fi
reports="$out/check.md"
if [ "$bench" = 1 ]; then
    # memory-efficient-fp16 is the check's CPU stand-in for a loss scaler, not a train.sh precision
    if [ "$precision" = memory-efficient-fp16 ]; then
        precision=$([ "$device" = cuda ] && echo fp16 || echo fp32)
    fi
    "$python" -m multipath_nmt.cli.bench --device "$device" --precision "$precision" \
        --out "$out/bench" || status=$?
    reports="$reports, $out/bench/bench.md"
fi
echo "gpu-check.sh: reports in $reports; exit status $status; took $SECONDS s" >&2
exit "$status"
