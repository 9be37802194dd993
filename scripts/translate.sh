#!/usr/bin/env bash
# Translate a binarized test set with our decoding defaults (beam 4, lenpen 0.6, --remove-bpe).
#   scripts/translate.sh DATA_BIN CHECKPOINT OUT_PREFIX [--fp32] [--dry-run] [fairseq-generate args...]
# Writes OUT_PREFIX.generate (full fairseq-generate output), OUT_PREFIX.hyp and OUT_PREFIX.ref
# (hypotheses and references sorted by sentence id). Extra args come last and override the
# defaults (e.g. --gen-subset valid --beam 5). With CUDA it decodes in fp16 (--fp16, as the models
# are trained; --fp32 keeps fp32), without CUDA on the CPU in fp32. --dry-run prints the command.
# OUT_PREFIX's folder must exist and be writable (else one line, status 1, before anything runs).
# SIGTERM (SIGINT) is passed on to fairseq-generate, which is waited for: exit 143 (130), its
# output so far left in OUT_PREFIX.generate.tmp.
# PYTHON selects the interpreter that has multipath_nmt installed (default: python);
# MULTIPATH_NMT_NUM_GPUS overrides the detected GPU count (0 = CPU).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"
if [ $# -lt 3 ]; then
    echo "usage: $0 DATA_BIN CHECKPOINT OUT_PREFIX [fairseq-generate args...]" >&2
    exit 1
fi
source "$(dirname "${BASH_SOURCE[0]}")/run-recipe.sh"
run_recipe translate.sh "$@"
