#!/usr/bin/env bash
# `make gpu-carry`: what a bare GPU machine (a CUDA torch and Python, no network, no fairseq)
# needs to run scripts/gpu-bench.sh and scripts/gpu-check.sh, written to .gpu-carry/ for the
# device tool's `carry` (at most 64 MiB with the working tree; docs/gpu.md):
# - fairseq-fixed's wheel for the device's Pythons (3.12 and 3.13), with the debug symbols of its
#   compiled extensions stripped; installed there with --no-deps, as its metadata pulls
#   torchaudio and scikit-learn (a plain install would fetch a torch for another CUDA);
# - the dependencies of fairseq and of the GPU tools that a CUDA torch image lacks (GPU_CARRY_REQS
#   below, pinned), as wheels for both Pythons; no torch, torchaudio, scikit-learn or numpy;
# - requirements.txt: what scripts/gpu-carry-install.sh installs from here with --no-index.
#   scripts/gpu-carry.sh [--out DIR]      (DIR: .gpu-carry)
# A fairseq wheel is taken from pip's wheel cache (or GPU_CARRY_WHEELS, a folder), else built
# with GPU_CARRY_BUILD_PYTHON_3_12 / _3_13: an interpreter of that version with torch installed
# (fairseq compiles against it: pip wheel --no-build-isolation). Needs pip and an index here.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"
out=.gpu-carry
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        *) echo "gpu-carry.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
python=${PYTHON:-python3}
FAIRSEQ_VERSION=0.12.3.1
PYTHONS=(3.12 3.13)
LIMIT_MIB=${GPU_CARRY_LIMIT_MIB:-56}
# fairseq's own needs and the GPU tools' imports, less what a CUDA torch image holds (torch and
# its dependencies, numpy): the versions make's venv runs
GPU_CARRY_REQS=(hydra-core==1.3.8 omegaconf==2.3.1 PyYAML==6.0.4 bitarray==3.12.3
                regex==2026.11.19 sacrebleu==2.6.0 portalocker==4.4.2 tabulate==0.10.0
                colorama==0.4.6 tqdm==4.70.1 packaging==26.4 lxml==6.1.3)
# omegaconf's pin, a source distribution only: one pure-Python wheel serves both Pythons
ANTLR=antlr4-python3-runtime==4.9.3
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$out"
mkdir -p "$out"

fairseq_wheel() {  # a fairseq-fixed wheel for cp$1 (e.g. 312): the cache's, a given one, or built
    local tag=cp$1 found="" builder_var="GPU_CARRY_BUILD_PYTHON_${2/./_}"
    for dir in ${GPU_CARRY_WHEELS:-} "$work/built"; do
        found=$(ls "$dir"/fairseq_fixed-$FAIRSEQ_VERSION-$tag-$tag-*.whl 2>/dev/null | head -1) || true
        [ -n "$found" ] && break
    done
    if [ -z "$found" ]; then
        found=$("$python" -m pip cache list --format abspath "fairseq_fixed-$FAIRSEQ_VERSION-$tag-*" 2>/dev/null | head -1) || true
    fi
    if [ -z "$found" ] && [ -n "${!builder_var:-}" ]; then
        echo "gpu-carry.sh: building fairseq-fixed for Python $2 with ${!builder_var} (minutes)" >&2
        "${!builder_var}" -m pip wheel -q --no-build-isolation --no-deps \
            "fairseq-fixed==$FAIRSEQ_VERSION" -w "$work/built" >&2
        found=$(ls "$work/built"/fairseq_fixed-$FAIRSEQ_VERSION-$tag-$tag-*.whl | head -1)
    fi
    if [ -z "$found" ]; then
        echo "gpu-carry.sh: no fairseq-fixed $FAIRSEQ_VERSION wheel for Python $2 in pip's cache" \
             "or GPU_CARRY_WHEELS; set $builder_var to a Python $2 with torch to build one" >&2
        exit 1
    fi
    echo "$found"
}

strip_wheel() {  # copy wheel $1 to $2 with its compiled extensions' debug symbols stripped
    # (most of fairseq's 22 MB), the RECORD's hashes and sizes written anew
    "$python" - "$1" "$2" "$work" <<'EOF'
import base64, hashlib, os, subprocess, sys, zipfile

source, target, work = sys.argv[1:]
files, record = {}, None
with zipfile.ZipFile(source) as wheel:
    for info in wheel.infolist():
        data = wheel.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            record = info.filename
            continue
        if info.filename.endswith(".so"):
            path = os.path.join(work, "strip.so")
            with open(path, "wb") as f:
                f.write(data)
            subprocess.run(["strip", "--strip-debug", path], check=True)
            with open(path, "rb") as f:
                data = f.read()
        files[info.filename] = (info, data)
lines = []
for name, (info, data) in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    lines.append(f"{name},sha256={digest},{len(data)}")
lines.append(f"{record},,")
with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as wheel:
    for name, (info, data) in files.items():
        wheel.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    wheel.writestr(record, "\n".join(lines) + "\n")
EOF
}

for version in "${PYTHONS[@]}"; do
    nodot=${version/./}
    wheel=$(fairseq_wheel "$nodot" "$version")
    strip_wheel "$wheel" "$out/$(basename "$wheel")"
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
        --implementation cp "${PLATFORMS[@]}" -d "$out" "${GPU_CARRY_REQS[@]}"
done
"$python" -m pip wheel -q --no-deps -w "$out" "$ANTLR"
{
    echo "# scripts/gpu-carry-install.sh installs these from this folder, --no-index --no-deps"
    echo "fairseq-fixed==$FAIRSEQ_VERSION"
    printf '%s\n' "$ANTLR" "${GPU_CARRY_REQS[@]}"
} > "$out/requirements.txt"
mib=$(du -sm "$out" | cut -f1)
if [ "$mib" -gt "$LIMIT_MIB" ]; then
    echo "gpu-carry.sh: $out holds $mib MiB, over $LIMIT_MIB MiB (the device tool's 64 MiB less" \
         "the working tree)" >&2
    exit 1
fi
echo "gpu-carry.sh: wrote $out ($mib MiB, $(ls "$out"/*.whl | wc -l) wheels)" >&2
