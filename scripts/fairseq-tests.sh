#!/usr/bin/env bash
# fairseq's own test suite, run twice: plain, and with the plug-in's patches installed (pytest
# loads multipath_nmt as a plugin: `-p multipath_nmt`, the import that --user-dir does, which
# calls multipath_nmt.fairseq_patches.install()). Prints both pytest summaries and the tests
# whose outcome differs; exits 1 if a test passes only without the plug-in (docs/fairseq-tests.md).
#
#   scripts/fairseq-tests.sh FAIRSEQ_CHECKOUT [TEST_FILE ...]
#
# FAIRSEQ_CHECKOUT: fairseq's sources at the commit installed (3f0f20f2 for fairseq-fixed
# 0.12.3.1: README, "Which fairseq"):
#   git clone https://github.com/facebookresearch/fairseq && git -C fairseq checkout 3f0f20f2
# Only its tests/ folder is used, copied to a scratch folder, so that the installed fairseq (with
# its compiled extensions) is imported, not the checkout's sources.
# TEST_FILE: file names in tests/ (e.g. test_export.py); default: every tests/test_*.py but
# test_binaries.py (see docs/fairseq-tests.md).
# Environment: PYTHON (default: this repository's .venv/bin/python, else python3), OUT (a folder
# for the two logs and the outcome lists; default: a new temporary folder, printed).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"

if [[ $# -lt 1 || ! -d "$1/tests" ]]; then
    echo "usage: $0 FAIRSEQ_CHECKOUT [TEST_FILE ...]  (a fairseq checkout with a tests/ folder)" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKOUT="$(cd "$1" && pwd)"
shift
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x "$ROOT/.venv/bin/python" ]] && PYTHON="$ROOT/.venv/bin/python"
fi
OUT="${OUT:-$(mktemp -d -t fairseq-tests.XXXXXX)}"
mkdir -p "$OUT"
WORK="$(mktemp -d -t fairseq-tests-src.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
cp -r "$CHECKOUT/tests" "$WORK/tests"

FILES=()
if [[ $# -gt 0 ]]; then
    for name in "$@"; do FILES+=("tests/${name#tests/}"); done
else
    # test_binaries.py trains about fifty models (half an hour a run on two cores) and one of
    # its C extensions ends the pytest process part-way on this setup: give it by name to run it
    for path in "$WORK"/tests/test_*.py; do
        name="$(basename "$path")"
        [[ "$name" == test_binaries.py ]] || FILES+=("tests/$name")
    done
fi

run() {  # run LABEL [pytest flags]: pytest over FILES, log in $OUT/LABEL.log
    local label="$1"
    shift
    echo "== $label: ${#FILES[@]} test files" >&2
    (cd "$WORK" && nice "$PYTHON" -m pytest -q -rA -p no:cacheprovider \
        --continue-on-collection-errors "$@" "${FILES[@]}") >"$OUT/$label.log" 2>&1 || true
}
run plain
# MULTIPATH_NMT_PATCHES=on: an inherited "off" would install no patch and compare nothing
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" MULTIPATH_NMT_PATCHES=on run plug-in -p multipath_nmt

"$PYTHON" - "$OUT" <<'EOF'
"""Each test's outcome from pytest's -rA summary; a test passes when it has a PASSED line and
no FAILED, ERROR or SUBFAILED one (a failing subtest fails its test)."""
import re
import sys
from pathlib import Path

out = Path(sys.argv[1])
LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SUBPASSED|SUBFAILED)(?:\(.*?\))? (\S+)")


def outcomes(label):
    text = (out / f"{label}.log").read_text(errors="replace").splitlines()
    seen = {}
    for line in text:
        match = LINE.match(line)
        if match:
            seen.setdefault(match.group(2), set()).add(match.group(1))
    summary = next((l.strip("= ") for l in reversed(text) if re.search(r"\d+ (passed|failed)", l)),
                   "(no pytest summary: see the log)")
    passed = {t for t, kinds in seen.items()
              if "PASSED" in kinds and not kinds & {"FAILED", "ERROR", "SUBFAILED"}}
    (out / f"{label}.passed").write_text("".join(f"{t}\n" for t in sorted(passed)))
    return summary, passed


plain_summary, plain = outcomes("plain")
plugin_summary, plugin = outcomes("plug-in")
print(f"plain:   {plain_summary}")
print(f"plug-in: {plugin_summary}")
only_plain, only_plugin = sorted(plain - plugin), sorted(plugin - plain)
print(f"passing: {len(plain)} plain, {len(plugin)} with the plug-in; "
      f"{len(only_plain)} only plain, {len(only_plugin)} only with the plug-in")
for title, tests in (("passes only without the plug-in (a regression)", only_plain),
                     ("passes only with the plug-in", only_plugin)):
    for test in tests:
        print(f"  {title}: {test}")
print(f"logs: {out}/plain.log, {out}/plug-in.log")
sys.exit(1 if only_plain else 0)
EOF
