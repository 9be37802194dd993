#!/usr/bin/env bash
# Train with the paper's recipe on fairseq-train and the multipath_nmt plug-in.
#   scripts/train.sh DATA_BIN SAVE_DIR --arch ARCH [--batch-tokens N] [--max-tokens N]
#                    [--embeddings auto|shared|separate] [--precision auto|bf16|fp16|fp32]
#                    [--save-interval-minutes M]
#                    [--nnodes N --rdzv-endpoint HOST:PORT [--rdzv-id ID]]
#                    [--dry-run] [fairseq-train args...]
#
# One process (a GPU or the CPU): fairseq-train. More GPUs: torchrun (python -m
# torch.distributed.run), one fairseq-train per GPU, run inside this script's process, which
# passes SIGTERM, SIGINT and SIGUSR1 on to every worker and exits 128 + the signal's number once
# they have stopped and saved (143 for SIGTERM, as one process). Several nodes: the same command
# on each with --nnodes N --rdzv-endpoint HOST:PORT (a c10d rendezvous at one of them;
# docs/troubleshooting.md has the SLURM form).
#
# Recipe (multipath_nmt/recipe/; docs/fidelity.md traces each item to the paper): Adam
# (0.9, 0.997) as --optimizer adam_fused (fairseq's Adam update in one fused kernel),
# inverse_sqrt, label smoothing 0.1, attention and activation dropout 0.1, 20 epochs (--max-epoch 20
# unless --max-epoch, --max-update or --stop-time-hours is given; EWA archs need --max-update),
# epoch checkpoints (last 10 kept), checkpoint_last.pt about every 10 minutes on GPUs
# (--save-interval-minutes M, 0 for epoch ends only; the arithmetic is in
# docs/troubleshooting.md), and one precision for every
# arch (--precision auto: --amp --bf16 on GPUs with bfloat16, --amp on older GPUs, fp32 on the
# CPU; --precision bf16|fp16|fp32 to choose; docs/gpu.md says why).
#   base (transformer_prenorm/transformer):  lr 0.001, 8000 warmup,  32,768 tokens per update
#   deep/multi-path/wide/WideNet/EWA/ParameterNet/MoE:  lr 0.002, 16000 warmup, 65,536 tokens per update
# Each arch's recipe is its row in the arch table (ARCHS, multipath_nmt/arch_table.py); an arch
# without a row is refused in one line (add a row for a new arch).
# Tokens per update = max-tokens x GPUs x update-freq: the paper's 4,096 / 8,192 tokens, read
# as per GPU (docs/fidelity.md), on 8 GPUs, kept exactly on any GPU count that divides it
# (max-tokens, default 4096, is a cap, lowered where needed; e.g. 3 GPUs are refused with a
# value that works). Without a GPU: 4,096 /
# 8,192 (one GPU's share). --batch-tokens N asks for N tokens per update instead; an explicit
# --update-freq replaces the arithmetic (max-tokens x workers x update-freq, as given).
# Embeddings (--embeddings auto): all shared for a joined dictionary (the paper's En-De), nothing
# shared for En-Fr (Table 3's sizes) or when the source and target dictionaries differ.
# WideNet/EWA/ParameterNet/MoE archs use label_smoothed_cross_entropy_with_moe.
# Every extra argument is passed on after the recipe, so it overrides it (fairseq keeps the
# last occurrence of a flag), e.g. --max-epoch 40, --lr 0.0007.
# --compile-layers [BACKEND] (a flag of the plug-in, passed on like any other) compiles every
# encoder and decoder layer with torch.compile for training. It costs a compile at the start (10-40 s
# per layer class on 2 CPU cores), so never for a few minutes' run; for long runs measure first
# (multipath-bench --compiled): on a 2-core CPU, 0.81-0.86x eager's speed (dynamic ParameterNet 1.10x).
#
# Environment: MAX_TOKENS (or --max-tokens N) caps max-tokens; MULTIPATH_NMT_NUM_GPUS overrides
# the detected GPU count per node (0 = CPU); MULTIPATH_NMT_BF16=0|1 whether the GPUs have bfloat16;
# MULTIPATH_NMT_DDP_ON_CPU=1 makes those GPUs CPU processes over gloo (the tests' stand-in);
# PYTHON selects the interpreter with multipath_nmt installed
# (default: python). --dry-run prints the command only.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"
if [ $# -lt 2 ]; then
    echo "usage: $0 DATA_BIN SAVE_DIR --arch ARCH [--batch-tokens N] [--dry-run] [fairseq-train args...]" >&2
    exit 1
fi
source "$(dirname "${BASH_SOURCE[0]}")/run-recipe.sh"
run_recipe train.sh "$@"
