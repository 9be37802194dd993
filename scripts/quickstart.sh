#!/usr/bin/env bash
# The main job, end to end on the CPU (about 4.5 minutes on 2 cores):
# synthetic En->De-like corpus -> prepare (Moses tokenization, joint BPE, binarize) -> train a
# small Multi-Path Transformer -> average the last epoch checkpoints -> translate -> score.
#   scripts/quickstart.sh [WORK_DIR]        (default: work/quickstart)
# Rerunning reuses the corpus and data-bin; training resumes from checkpoint_last.pt.
# Smaller runs (the tests): QUICKSTART_TRAIN_PAIRS (default 20000), QUICKSTART_TEST_PAIRS (500),
# QUICKSTART_EPOCHS (5), QUICKSTART_AVERAGE (epoch checkpoints to average, 3).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"
if [[ $# -gt 1 || ${1:-} == -* ]]; then
    echo "quickstart.sh: error: it takes one WORK_DIR and no options, got: $* (--help says more)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
work=${1:-work/quickstart}
train_pairs=${QUICKSTART_TRAIN_PAIRS:-20000}
test_pairs=${QUICKSTART_TEST_PAIRS:-500}
epochs=${QUICKSTART_EPOCHS:-5}
average=${QUICKSTART_AVERAGE:-3}
mkdir -p "$work"
step() { echo; echo "== quickstart: $*"; }

step "1/6 synthetic corpus -> $work/raw"
if [ ! -f "$work/raw/test.de" ]; then
    multipath-make-corpus --out "$work/raw" --train "$train_pairs" --valid 500 \
        --test "$test_pairs" --seed 1
else
    echo "already there"
fi

step "2/6 prepare: Moses tokenization, joint BPE (4000 merges), fairseq-preprocess -> $work/data-bin"
scripts/prepare-corpus.sh --src en --tgt de --train "$work/raw/train" --valid "$work/raw/valid" \
    --test "$work/raw/test" --out "$work/data-bin" --bpe-merges 4000 --workers 2

step "3/6 train a small multi-path model (3 encoder layers x 2 paths, PathNorm, learnable weights)"
scripts/train.sh "$work/data-bin" "$work/checkpoints" --arch multipath_transformer_wmt_en_de \
    --encoder-layers 3 --decoder-layers 2 --encoder-paths 2 \
    --encoder-embed-dim 128 --decoder-embed-dim 128 \
    --encoder-ffn-embed-dim 256 --decoder-ffn-embed-dim 256 \
    --encoder-attention-heads 4 --decoder-attention-heads 4 \
    --dropout 0.1 --max-tokens 2048 --update-freq 1 --lr 0.003 --warmup-updates 200 \
    --max-epoch "$epochs" --num-workers 0 --seed 1 --no-progress-bar --log-format simple \
    --log-interval 50 --keep-last-epochs 5 2>&1 | tee -a "$work/train.log"

step "4/6 average the last $average epoch checkpoints -> $work/checkpoints/checkpoint_avg.pt"
scripts/average.sh "$work/checkpoints" "$average" "$work/checkpoints/checkpoint_avg.pt"

step "5/6 translate the test set (beam 4, lenpen 0.6, --remove-bpe) -> $work/test.hyp"
scripts/translate.sh "$work/data-bin" "$work/checkpoints/checkpoint_avg.pt" "$work/test" \
    --batch-size 128

step "6/6 score: tokenized multi-bleu with compound splitting, then sacreBLEU and chrF against the raw references"
multipath-score --generate-output "$work/test.generate" --compound-split --lang de \
    --raw-ref "$work/data-bin/test.raw.de" \
    | tee "$work/score.txt"
multipath-plot-log "$work/train.log" --labels "multi-path 3x2" --out "$work/curves.png"

echo
echo "== quickstart done. Everything is in $work/:"
echo "   raw/ (corpus), data-bin/ and data-bin.work/ (prepared data), checkpoints/,"
echo "   test.generate / test.hyp / test.ref (translations), score.txt, curves.png, train.log"
