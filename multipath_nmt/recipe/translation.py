"""What translate.sh does with fairseq-generate's output: hypotheses and references in sentence
order."""
import os
import re
from typing import List

from multipath_nmt.recipe.archs import RecipeError

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
