# Sourced by scripts/gpu-bench.sh and scripts/gpu-check.sh after $python is set: on a machine
# whose $python has no fairseq (a bare GPU machine: a CUDA torch, no network), install it from
# .gpu-carry/ (`make gpu-carry`, carried by the device tool; docs/gpu.md) with --no-index and
# --no-deps into GPU_CARRY_SITE (default /tmp/multipath-nmt-site), only the requirements that
# $python lacks, and put that folder and the checkout on PYTHONPATH (the rows' processes inherit
# it). Where fairseq is found already, nothing is done. GPU_CARRY_CHECK: the import that proves the
# install (default: fairseq and multipath_nmt).
carry_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
carry_finds() {  # whether $python finds top-level module $1 from any folder: found, not imported
    # (fairseq's import takes seconds), the current folder left out of the search
    "$python" -c 'import importlib.util, os, sys
sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
sys.exit(importlib.util.find_spec(sys.argv[1]) is None)' "$1" 2>/dev/null
}
if ! carry_finds multipath_nmt; then
    export PYTHONPATH="$carry_root${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! carry_finds fairseq; then
    carry=${GPU_CARRY:-$carry_root/.gpu-carry}
    if [ ! -f "$carry/requirements.txt" ]; then
        echo "$(basename "$0"): $python has no fairseq and $carry has no wheels: run" \
             "\`make gpu-carry\` where pip works and carry .gpu-carry (docs/gpu.md)" >&2
        exit 1
    fi
    carry_site=${GPU_CARRY_SITE:-/tmp/multipath-nmt-site}
    # the requirements $python does not have yet (fairseq always: it did not import)
    carry_missing=$("$python" - "$carry/requirements.txt" <<'EOF'
import importlib.metadata, sys

for line in open(sys.argv[1]):
    requirement = line.split("#")[0].strip()
    if not requirement:
        continue
    name = requirement.split("==")[0]
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        print(requirement)
    else:
        if name == "fairseq-fixed":
            print(requirement)
EOF
)
    echo "$(basename "$0"): installing from $carry into $carry_site:" $carry_missing >&2
    # shellcheck disable=SC2086  # one requirement a word
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --upgrade --target "$carry_site" --find-links "$carry" \
        $carry_missing || exit 1
    export PYTHONPATH="$carry_site:$PYTHONPATH"
    "$python" -c "${GPU_CARRY_CHECK:-import fairseq, multipath_nmt}" || exit 1
fi
