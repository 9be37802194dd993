#!/usr/bin/env bash
# Multi30k En-De: does width beat depth at equal parameters? Prepares the data, trains 9 systems
# for the same time each, averages, translates, scores and writes a table, JSON and plot.
#   examples/multi30k/study.sh [--budget-minutes M] [--seeds N] [--data DIR] [--results DIR]
#                              [--work DIR] [--systems a,b] [--max-train-lines N] [--max-eval-lines N]
# Defaults: 8 minutes per system (about 90 minutes on 2 cores), 1 seed, data from $MULTI30K_DIR
# or data/multi30k, work/multi30k, results/multi30k. Rerunning skips finished systems.
# PYTHON selects the interpreter with multipath_nmt installed (default: python).
set -euo pipefail
echo "== study.sh: ${PYTHON:-python} -m multipath_nmt.study $*"
exec "${PYTHON:-python}" -m multipath_nmt.study "$@"
