#!/usr/bin/env bash
# Train with the paper's recipe on fairseq-train and the multipath_nmt plug-in.
#   scripts/train.sh DATA_BIN SAVE_DIR --arch ARCH [--dry-run] [fairseq-train args...]
#
# Recipe: Adam (0.9, 0.997), inverse_sqrt, label smoothing 0.1, shared embeddings, epoch
# checkpoints (last 10 kept), fp16 on CUDA.
#   base (transformer_prenorm/transformer/wide):  lr 0.001, 8000 warmup,  4096 tokens per update
#   deep/multi-path/WideNet/EWA/ParameterNet/MoE:  lr 0.002, 16000 warmup, 8192 tokens per update
# tokens per update = max-tokens x update-freq x GPUs; --update-freq is computed from the GPU
# count. WideNet/EWA/ParameterNet/MoE archs use label_smoothed_cross_entropy_with_moe.
# Every extra argument is passed on after the recipe, so it overrides it (fairseq keeps the
# last occurrence of a flag), e.g. --max-update 100000, --max-epoch 40, --lr 0.0007.
#
# Environment: MAX_TOKENS (default 4096, or --max-tokens N) sets max-tokens;
# MULTIPATH_NMT_NUM_GPUS overrides the detected GPU count (0 = CPU); PYTHON selects the
# interpreter with multipath_nmt installed (default: python). --dry-run prints the command only.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 DATA_BIN SAVE_DIR --arch ARCH [--dry-run] [fairseq-train args...]" >&2
    exit 1
fi
data_bin=$1 save_dir=$2
shift 2
python=${PYTHON:-python}
arch="" dry_run=0 max_tokens=${MAX_TOKENS:-4096} extra=()
while [ $# -gt 0 ]; do
    case $1 in
        --arch|-a) arch=${2:?--arch needs a value}; shift 2 ;;
        --arch=*) arch=${1#*=}; shift ;;
        --max-tokens) max_tokens=${2:?--max-tokens needs a value}; shift 2 ;;
        --max-tokens=*) max_tokens=${1#*=}; shift ;;
        --dry-run) dry_run=1; shift ;;
        *) extra+=("$1"); shift ;;
    esac
done
die() { echo "train.sh: error: $*" >&2; exit 1; }
[ -n "$arch" ] || die "--arch ARCH is required (e.g. transformer_prenorm_wmt_en_de, multipath_transformer_wmt_en_de)"
[[ $max_tokens =~ ^[1-9][0-9]*$ ]] || die "max-tokens must be a positive integer, got '$max_tokens'"
compgen -G "$data_bin/dict.*.txt" > /dev/null \
    || die "$data_bin has no dict.*.txt: give the data-bin folder written by fairseq-preprocess"

case $arch in
    *deep*|multipath*|widenet*|ewa*|parameternet*|moe*)
        recipe="deep/multi-path" lr=0.002 warmup=16000 tokens_per_update=8192 ;;
    *)  recipe="base" lr=0.001 warmup=8000 tokens_per_update=4096 ;;
esac
case $arch in
    widenet*|ewa*|parameternet*|moe*) criterion=label_smoothed_cross_entropy_with_moe ;;
    *) criterion=label_smoothed_cross_entropy ;;
esac

# One interpreter start: the GPU count (unless given) and the plug-in folder, found without
# importing fairseq.
read -r detected_gpus user_dir < <("$python" -c 'import importlib.util as u, os
n = os.environ.get("MULTIPATH_NMT_NUM_GPUS")
if n is None:
    import torch
    n = torch.cuda.device_count()
print(n, u.find_spec("multipath_nmt").submodule_search_locations[0])') || true
[ -n "${user_dir:-}" ] || die "$python cannot import torch and multipath_nmt; activate their environment or set PYTHON"
gpus=$detected_gpus
[[ $gpus =~ ^[0-9]+$ ]] || die "MULTIPATH_NMT_NUM_GPUS must be a number, got '$gpus'"

workers=$(( gpus > 0 ? gpus : 1 ))
update_freq=$(( (tokens_per_update + max_tokens * workers - 1) / (max_tokens * workers) ))
if [ "$gpus" -gt 0 ]; then
    device=(--fp16 --distributed-world-size "$gpus")
    echo "train.sh: $gpus GPU(s), fp16"
else
    device=(--cpu)
    echo "train.sh: no CUDA device found, training in fp32 on the CPU (--cpu, no --fp16)"
fi
echo "train.sh: $recipe recipe for $arch: lr $lr, $warmup warmup updates, $tokens_per_update tokens per update" \
     "~ $max_tokens max-tokens x $update_freq update-freq x $workers worker(s) = $(( max_tokens * update_freq * workers ))"

cmd=("$python" -m fairseq_cli.train "$data_bin" --user-dir "$user_dir" --arch "$arch"
     --share-all-embeddings
     --optimizer adam --adam-betas "(0.9, 0.997)" --clip-norm 0.0
     --lr "$lr" --lr-scheduler inverse_sqrt --warmup-updates "$warmup" --warmup-init-lr 1e-07
     --criterion "$criterion" --label-smoothing 0.1
     --max-tokens "$max_tokens" --update-freq "$update_freq"
     --save-dir "$save_dir" --keep-last-epochs 10
     "${device[@]}" "${extra[@]}")
echo "train.sh: $(printf '%q ' "${cmd[@]}")"
if [ "$dry_run" = 1 ]; then
    exit 0
fi
mkdir -p "$save_dir"
exec "${cmd[@]}"
