#!/usr/bin/env bash
# Translate a binarized test set with our decoding defaults (beam 4, lenpen 0.6, --remove-bpe).
#   scripts/translate.sh DATA_BIN CHECKPOINT OUT_PREFIX [--fp32] [--dry-run] [fairseq-generate args...]
# Writes OUT_PREFIX.generate (full fairseq-generate output), OUT_PREFIX.hyp and OUT_PREFIX.ref
# (hypotheses and references sorted by sentence id). Extra args come last and override the
# defaults (e.g. --gen-subset valid --beam 5). With CUDA it decodes in fp16 (--fp16, as the models
# are trained; --fp32 keeps fp32), without CUDA on the CPU in fp32. --dry-run prints the command.
# PYTHON selects the interpreter that has multipath_nmt installed (default: python);
# MULTIPATH_NMT_NUM_GPUS overrides the detected GPU count (0 = CPU).
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 DATA_BIN CHECKPOINT OUT_PREFIX [fairseq-generate args...]" >&2
    exit 1
fi
data_bin=$1 checkpoint=$2 out=$3
shift 3
python=${PYTHON:-python}
dry_run=0 fp32=0 extra=()
for arg in "$@"; do
    case $arg in
        --dry-run) dry_run=1 ;;
        --fp32) fp32=1 ;;
        *) extra+=("$arg") ;;
    esac
done
[ -f "$checkpoint" ] || { echo "translate.sh: $checkpoint: no such checkpoint" >&2; exit 1; }
# One interpreter start: the plug-in folder (found without importing fairseq) and the GPU count.
read -r gpus user_dir < <("$python" -c 'import importlib.util as u, os
n = os.environ.get("MULTIPATH_NMT_NUM_GPUS")
if n is None:
    import torch
    n = torch.cuda.device_count()
print(n, u.find_spec("multipath_nmt").submodule_search_locations[0])') || true
if [ -z "${user_dir:-}" ]; then
    echo "translate.sh: $python cannot import torch and multipath_nmt; activate their environment or set PYTHON" >&2
    exit 1
fi
if ! [[ $gpus =~ ^[0-9]+$ ]]; then
    echo "translate.sh: MULTIPATH_NMT_NUM_GPUS must be a number, got '$gpus'" >&2
    exit 1
fi
if [ "$gpus" = 0 ]; then
    echo "translate.sh: no CUDA device, decoding on the CPU"
    device=(--cpu)
elif [ "$fp32" = 1 ]; then
    echo "translate.sh: decoding on the GPU in fp32 (--fp32)"
    device=()
else
    echo "translate.sh: decoding on the GPU in fp16 (--fp16)"
    device=(--fp16)
fi
cmd=("$python" -m fairseq_cli.generate "$data_bin" --user-dir "$user_dir" --path "$checkpoint"
     --gen-subset test --beam 4 --lenpen 0.6 --remove-bpe --max-tokens 4096 "${device[@]}" "${extra[@]}")
echo "translate.sh: $(printf '%q ' "${cmd[@]}")> $out.generate"
if [ "$dry_run" = 1 ]; then
    exit 0
fi
"${cmd[@]}" > "$out.generate.tmp"
if ! tail -n 1 "$out.generate.tmp" | grep -q '^Generate .* with beam='; then
    echo "translate.sh: fairseq-generate did not finish; partial output left in $out.generate.tmp" >&2
    exit 1
fi
mv "$out.generate.tmp" "$out.generate"
# Lines are "H-<id>\t<score>\t<text>" and "T-<id>\t<text>" in batch order; sort them by id.
grep '^H-' "$out.generate" | cut -c3- | sort -s -n -k1,1 | cut -f3- > "$out.hyp"
grep '^T-' "$out.generate" | cut -c3- | sort -s -n -k1,1 | cut -f2- > "$out.ref"
echo "translate.sh: wrote $out.generate, $out.hyp ($(wc -l < "$out.hyp") lines) and $out.ref"
