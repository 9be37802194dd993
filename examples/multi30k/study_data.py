"""The Multi30k study's data (see study.py): Multi30k's text files, optionally their first lines
only, prepared into a data-bin by the library's ``prepare_corpus`` (what ``multipath-prepare
corpus`` runs).
"""
import gzip
from pathlib import Path
from typing import List, Optional

from study_systems import BPE_MERGES, DEFAULT_TARGET, SOURCE, SPLITS, StudyError, log, pair_name

from multipath_nmt.atomic_files import write_text_atomically
from multipath_nmt.pipeline.prepare import PrepareError, prepare_corpus


def find_text(prefix: Path, lang: str) -> Path:
    for path in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if path.is_file():
            return path
    raise FileNotFoundError(f"{prefix}.{lang}[.gz]")


def check_multi30k(data_dir: Path, target: str = DEFAULT_TARGET) -> None:
    missing = []
    for stem in SPLITS.values():
        for lang in (SOURCE, target):
            try:
                find_text(data_dir / stem, lang)
            except FileNotFoundError as err:
                missing.append(str(err))
    if missing:
        raise StudyError(
            f"Multi30k not found in {data_dir}: missing {', '.join(missing)}. Download "
            f"data/task1/raw/{{train,val,test_2016_flickr}}.{{{SOURCE},{target}}}.gz from "
            "https://github.com/multi30k/dataset and pass the folder with --data DIR")


def _read_lines(path: Path, limit: Optional[int]) -> List[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    lines = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(lines) == limit:
                break
            lines.append(line)
    return lines


def subsample(data_dir: Path, out_dir: Path, max_train: Optional[int],
              max_eval: Optional[int], target: str = DEFAULT_TARGET) -> Path:
    """The first lines of each split as plain text under ``out_dir`` (for quick runs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, stem in SPLITS.items():
        limit = max_train if split == "train" else max_eval
        for lang in (SOURCE, target):
            path = out_dir / f"{stem}.{lang}"
            if not path.exists():
                write_text_atomically(
                    path, "".join(_read_lines(find_text(data_dir / stem, lang), limit)))
    return out_dir


def data_tag(max_train: Optional[int], max_eval: Optional[int],
             target: str = DEFAULT_TARGET) -> str:
    """The prepared data's folder name: ``full`` or ``trainN-evalM`` for En-De (the names of the
    committed runs), prefixed with the pair for another target (``en-fr-full``)."""
    tag = "full" if max_train is None and max_eval is None else \
        f"train{max_train or 'all'}-eval{max_eval or 'all'}"
    return tag if target == DEFAULT_TARGET else f"{SOURCE}-{target}-{tag}"


def prepare(data_dir: Path, work: Path, max_train: Optional[int], max_eval: Optional[int],
            workers: int, target: str = DEFAULT_TARGET) -> Path:
    """Multi30k En-``target`` -> ``work/<tag>/data-bin`` as multipath-prepare corpus writes it
    (restartable; its progress goes to stderr)."""
    check_multi30k(data_dir, target)
    tag = data_tag(max_train, max_eval, target)
    root = work / tag
    subsampled = max_train is not None or max_eval is not None
    text = (subsample(data_dir, root / "text", max_train, max_eval, target) if subsampled
            else data_dir)
    data_bin = root / "data-bin"
    if (data_bin / f"dict.{SOURCE}.txt").is_file():  # prepare_corpus renames it into place
        log(f"{data_bin} already prepared")
        return data_bin
    log(f"preparing Multi30k {pair_name(target)} from {data_dir} (BPE {BPE_MERGES} merges) -> "
        f"{data_bin}")
    try:
        prepare_corpus(SOURCE, target, text / SPLITS["train"], text / SPLITS["valid"],
                       text / SPLITS["test"], data_bin, bpe_merges=BPE_MERGES, workers=workers)
    except PrepareError as err:
        raise StudyError(f"preparing {data_bin}: {err}") from err
    return data_bin


def dictionary_size(data_bin: Path) -> int:
    from fairseq.data import Dictionary
    return len(Dictionary.load(str(data_bin / f"dict.{SOURCE}.txt")))
