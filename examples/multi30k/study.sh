#!/usr/bin/env bash
# Multi30k En-De: does width beat depth at equal parameters? Prepares the data, trains the systems
# for the same number of updates (or the same time) with one or more seeds, averages, translates,
# scores, tests every system against the deep model (paired bootstrap) and writes a table, JSON
# and plots.
#   examples/multi30k/study.sh [--budget-updates U | --budget-minutes M] [--seeds N]
#                              [--device auto|cpu|cuda] [--parallel K] [--data DIR] [--results DIR]
#                              [--work DIR] [--systems a,b] [--max-train-lines N] [--max-eval-lines N]
# Defaults: 6000 updates per system and seed (provisional, see README), 1 seed, the 7 systems of
# the paper's ablation with the dense references, data from $MULTI30K_DIR or data/multi30k,
# work/multi30k, results/multi30k. Rerunning skips finished runs.
# PYTHON selects the interpreter with multipath_nmt installed (default: python).
set -euo pipefail
study=$(dirname "$0")/study.py
echo "== study.sh: ${PYTHON:-python} $study $*"
exec "${PYTHON:-python}" "$study" "$@"
