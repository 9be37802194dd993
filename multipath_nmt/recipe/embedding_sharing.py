"""What train.sh reads from a data-bin: its dictionaries, and from them which embeddings are
shared (Table 2's En-De: all; Table 3's En-Fr: none, docs/fidelity.md has the arithmetic)."""
import filecmp
from pathlib import Path
from typing import List, Optional, Sequence

from multipath_nmt.recipe.archs import RecipeError

# Table 3's En-Fr sizes need unshared embeddings (docs/fidelity.md).
UNSHARED_LANGUAGE_PAIRS = ({"en", "fr"},)


def dictionary_files(data_bin: Path, source_lang: Optional[str] = None,
                     target_lang: Optional[str] = None) -> List[Path]:
    """The source and target dictionaries of a fairseq data-bin (languages, when not given,
    from the ``train.SRC-TGT.*`` files as fairseq infers them, else from the ``dict.*.txt``)."""
    pairs = sorted(p.name.split(".")[1] for p in data_bin.glob("train.*-*.*.idx"))
    if source_lang and target_lang:
        langs = [source_lang, target_lang]
    elif pairs:
        langs = pairs[0].split("-", 1)
    else:
        langs = sorted(p.name[len("dict."):-len(".txt")] for p in data_bin.glob("dict.*.txt"))
        if not langs:
            raise RecipeError(f"{data_bin} has no dict.*.txt: give the data-bin folder written "
                              f"by fairseq-preprocess")
        if len(langs) > 2:
            raise RecipeError(f"{data_bin} has dictionaries for {', '.join(langs)}: pass "
                              f"--source-lang and --target-lang")
    files = [data_bin / f"dict.{lang}.txt" for lang in langs]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise RecipeError(f"no dictionary {', '.join(missing)}")
    return files


def embedding_sharing(dictionaries: Sequence[Path], choice: str = "auto") -> List[str]:
    """fairseq flags for the embeddings: ``--share-all-embeddings`` (one matrix; needs a joined
    dictionary) or nothing (encoder input, decoder input and output projection unshared).

    ``auto``: nothing shared for En-Fr (Table 3's sizes), shared for a joined dictionary
    (Table 2's), nothing shared when the dictionaries differ."""
    joined = len(dictionaries) < 2 or filecmp.cmp(*dictionaries[:2], shallow=False)
    langs = {Path(d).name[len("dict."):-len(".txt")] for d in dictionaries}
    if choice == "shared":
        if not joined:
            raise RecipeError(f"--embeddings shared needs a joined dictionary, but "
                              f"{' and '.join(map(str, dictionaries))} differ (binarize with "
                              f"fairseq-preprocess --joined-dictionary, or --embeddings separate)")
        return ["--share-all-embeddings"]
    if choice == "separate":
        return []
    if choice != "auto":
        raise RecipeError(f"--embeddings must be auto, shared or separate, got {choice!r}")
    if langs in UNSHARED_LANGUAGE_PAIRS or not joined:
        return []
    return ["--share-all-embeddings"]
