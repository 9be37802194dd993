"""What translate.sh does around fairseq-generate: the output folder checked before anything
runs, the decoder run with the stop signals passed on to it, and its output as hypotheses and
references in sentence order."""
import os
import re
import signal
import subprocess
import sys
from typing import List, Optional, Sequence

from multipath_nmt.recipe.archs import RecipeError

# Signals that stop translate.sh: passed on to fairseq-generate, which is waited for, and
# translate.sh then exits 128 + the signal's number (143 for a scheduler's SIGTERM).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
OUTPUT_SUFFIXES = (".generate.tmp", ".generate", ".hyp", ".ref")
ANOTHER = "give another OUT_PREFIX"


def _missing_folder(folder: str) -> str:
    """Why the folder ``folder``, which does not exist, cannot be made to hold the output."""
    if os.path.islink(folder):  # a symbolic link whose target is gone
        return (f"its folder {folder} is a symbolic link to {os.readlink(folder)}, which does not "
                f"exist; {ANOTHER}")
    above = os.path.dirname(os.path.abspath(folder))
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        return f"its folder {folder} cannot exist: {above} is a file, not a folder; {ANOTHER}"
    return f"its folder {folder} does not exist: create it (mkdir -p {folder}) or {ANOTHER}"


def _folder_problem(out: str, error: Optional[OSError]) -> Optional[str]:
    folder = os.path.dirname(out) or "."
    if not os.path.exists(folder):
        return _missing_folder(folder)
    if not os.path.isdir(folder):
        return f"its folder {folder} is a file, not a folder; {ANOTHER}"
    for suffix in OUTPUT_SUFFIXES:
        if os.path.isdir(out + suffix):
            return f"{out + suffix} is a folder, where translate.sh writes a file; {ANOTHER}"
    if error is not None:
        return f"cannot write in its folder {folder} ({error.strerror}); {ANOTHER}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write in its folder {folder} (permission denied); {ANOTHER}"
    return None


def output_problem(out_prefix, error: Optional[OSError] = None) -> Optional[str]:
    """Why translate.sh cannot write ``OUT_PREFIX.generate``, ``.hyp`` and ``.ref`` (one line
    that ends with what to do), or None: the folder is missing, a dangling symbolic link, a
    file, or not writable (``error``: what opening a file there raised, for a reason these
    checks cannot see, e.g. a read-only file system or an access rule that root is not exempt
    from)."""
    problem = _folder_problem(str(out_prefix), error)
    return f"OUT_PREFIX {out_prefix}: {problem}" if problem else None


def check_output_prefix(out_prefix) -> None:
    """:class:`RecipeError` (:func:`output_problem`) when translate.sh could not write its
    output files at ``out_prefix``: said before the decoder starts, not as a traceback after
    it."""
    problem = output_problem(out_prefix)
    if problem:
        raise RecipeError(problem)


def run_decoder(argv: Sequence[str], out_prefix) -> int:
    """Run fairseq-generate's command line ``argv`` with its output in ``OUT.generate.tmp``; its
    exit status, or 128 + N when translate.sh got the signal N of :data:`STOP_SIGNALS`: the
    signal is passed on to the decoder and the decoder waited for, so that nothing decodes on
    after translate.sh has exited (the partial output stays in ``OUT.generate.tmp``)."""
    partial = f"{out_prefix}.generate.tmp"
    try:
        output = open(partial, "wb")
    except OSError as error:
        raise RecipeError(output_problem(out_prefix, error)) from None
    stops: List[int] = []
    decoder: Optional[subprocess.Popen] = None

    def pass_on(signum, frame):
        stops.append(signum)
        if decoder is not None:
            decoder.send_signal(signum)

    # Installed before the decoder starts: a signal in between is passed on once it runs.
    previous = {signum: signal.signal(signum, pass_on) for signum in STOP_SIGNALS}
    try:
        with output:
            decoder = subprocess.Popen(list(argv), stdout=output)
            if stops:
                decoder.send_signal(stops[0])
            code = decoder.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if stops:
        name = signal.Signals(stops[0]).name
        print(f"translate.sh: {name}: fairseq-generate was stopped (its output so far is in "
              f"{partial}); exiting with status {128 + stops[0]}", file=sys.stderr, flush=True)
        return 128 + stops[0]
    return code


def finish_translation(out_prefix) -> int:
    """``OUT.generate.tmp`` (fairseq-generate's output) -> ``OUT.generate`` when its last line
    says that fairseq-generate finished, then the hypotheses (all of them with --nbest) and the
    references sorted by sentence id, as ``OUT.hyp`` and ``OUT.ref``; the number of hypotheses.
    Works on bytes, as the text is fairseq's and not ours to decode."""
    out = str(out_prefix)
    partial = out + ".generate.tmp"
    with open(partial, "rb") as f:
        lines = f.read().split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    if not lines or not re.match(rb"Generate .* with beam=", lines[-1]):
        raise RecipeError(f"fairseq-generate did not finish; partial output left in {partial}")
    os.replace(partial, out + ".generate")

    def by_id(kind: bytes, first_field: int) -> List[bytes]:
        # "H-<id>\t<score>\t<text>", "T-<id>\t<text>" in batch order; a stable sort by id
        fields = [line[2:].split(b"\t") for line in lines if line.startswith(kind + b"-")]
        fields.sort(key=lambda f: int(f[0]))
        return [b"\t".join(f[first_field:]) + b"\n" for f in fields]

    hypotheses = by_id(b"H", 2)
    for suffix, text in ((".hyp", hypotheses), (".ref", by_id(b"T", 1))):
        with open(out + suffix, "wb") as f:
            f.writelines(text)
    return len(hypotheses)
