"""Raw parallel text to a fairseq data-bin: the Moses + subword-nmt recipe of fairseq's
``examples/translation/prepare-wmt14en2de.sh``, in Python, restartable stage by stage.

Stages, each a directory of the work dir (``OUT.work`` next to the data-bin ``OUT``; for WMT the
pair's ``<pair>.work`` so both directions share it):

  downloads/          (WMT) archives fetched with urllib (resumed with HTTP Range requests after a
                      dropped connection, checked against the pinned checksum), or taken from ``--raw-dir``
  extract/<archive>/  (WMT) the archive members the pair needs
  raw/                {train,valid,test}.{L1,L2}: line-aligned text (SGML sets: the <seg> contents as
                      released, extracted like sacreBLEU)
  tok/                normalize-punctuation.perl + remove-non-printing-char.perl + tokenizer.perl -a
  bpe/                joint subword-nmt codes learned on train L1+L2, applied to every split
  clean/              clean-corpus-n.perl -ratio 1.5 on train (1..250 subwords); valid and test kept whole
  OUT                 fairseq-preprocess --joined-dictionary, the BPE codes as ``bpecodes`` and the raw
                      test text as ``test.raw.{L1,L2}`` (the references sacreBLEU scores against)

A stage is built in ``NAME.partial`` and renamed to ``NAME`` after its ``.done`` file (holding
the stage's parameters) is written, so a finished-looking directory is always complete. A rerun
skips stages whose ``.done`` matches, rebuilds those whose parameters changed, and throws away
any ``.partial`` left by an interrupted run. One run at a time works in a work dir: a second one
(the other direction of a WMT pair, say) waits for the first, naming it, then skips what it built.

This module runs the stages for a user's corpus (:func:`prepare_corpus`) and a WMT direction
(:func:`prepare_wmt`) and downloads the WMT archives; the pieces sit beside it:
:mod:`~multipath_nmt.pipeline.stages` (the stage directories and the text files),
:mod:`~multipath_nmt.pipeline.text` (Moses, cleaning, the worker pools),
:mod:`~multipath_nmt.pipeline.tethered` (the child processes that die with multipath-prepare) and
:mod:`~multipath_nmt.pipeline.archives` (checking, joining and extracting the WMT releases,
Table 1's sizes).
"""
import http.client
import io
import logging
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from itertools import chain
from pathlib import Path

from subword_nmt.learn_bpe import learn_bpe

from multipath_nmt.atomic_files import write_text_atomically
# The stages, the text processing and the WMT archives live in the modules beside this one; their
# names are imported here too, where the CLI, the study and the tests import them from.
from multipath_nmt.pipeline.archives import (  # noqa: F401
    TABLE1_TOLERANCE, _archive_members, _corpus_lines, _from_raw_dir, _join, _pair_members,
    archive_problem, compare_with_reference, compare_with_table1, extract_members, file_digest,
    mirror_url,
)
from multipath_nmt.pipeline.stages import (  # noqa: F401
    DONE, SPLITS, PrepareError, Progress, check_languages, check_output_folder, check_parallel,
    count_lines, log, open_text, read_lines, run_stage, stamp_of, work_dir_locked, write_lines, write_to,
)
from multipath_nmt.pipeline.text import (  # noqa: F401
    CHUNK_LINES, CLEAN_MAX, CLEAN_MAX_WORD_LENGTH, CLEAN_MIN, CLEAN_RATIO,
    NON_PRINTING, _bpe_chunk, _chunks, _init_bpe, _init_tokenizer,
    _tokenize_chunk, clean_pair, map_file, moses_tokenize, remove_non_printing,
)
from multipath_nmt.pipeline.tethered import tether_children
from multipath_nmt.pipeline.wmt import ARCHIVES, TASKS
from multipath_nmt.scoring import sgm_to_text

# Consecutive failed attempts (no byte received) before a download gives up, and the wait per
# failure. The download reads them from this module at each call (the tests and
# tests/helpers/prepare_wmt_from_mirror.py set them here), so it lives here, not in archives.py.
DOWNLOAD_RETRIES, RETRY_WAIT = 5, 2.0


# ------------------------------------------------------------------------ the common stages

# fairseq-preprocess's log lines, as its command prints them
FAIRSEQ_LOG_FORMAT = logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                                       "%Y-%m-%d %H:%M:%S")


def fairseq_preprocess(args):
    """``fairseq-preprocess ARGS`` in this process, as its command runs it, with its log on stderr
    (stdout stays free, as in every stage) and its ``--workers`` dying with this process
    (:func:`~multipath_nmt.pipeline.tethered.tether_children`). A failure raises PrepareError."""
    from fairseq import options

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    import fairseq_cli.preprocess  # its first import points the root logger at stdout: undone here

    root.handlers[:] = handlers
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setFormatter(FAIRSEQ_LOG_FORMAT)
    root.addHandler(to_stderr)
    root.setLevel(logging.INFO)
    file_handlers = len(fairseq_cli.preprocess.logger.handlers)
    tether_children()
    try:
        fairseq_cli.preprocess.main(options.get_preprocessing_parser().parse_args(args))
    except Exception as error:
        raise PrepareError(f"fairseq-preprocess failed: {type(error).__name__}: {error}") from error
    finally:
        for handler in fairseq_cli.preprocess.logger.handlers[file_handlers:]:  # its preprocess.log
            fairseq_cli.preprocess.logger.removeHandler(handler)
            handler.close()
        root.removeHandler(to_stderr)
        root.setLevel(level)


def process_text(raw_text, work_dir, out, langs, src, tgt, bpe_merges, workers, raw_params):
    """raw/ -> tok/ -> bpe/ -> clean/ -> OUT (binarized for the direction src -> tgt)."""
    work_dir = Path(work_dir)
    tok_params = {"stage": "tok", "langs": langs, "raw": raw_params}

    def tokenize(tmp):
        for split in SPLITS:
            for lang in langs:
                map_file(raw_text / f"{split}.{lang}", tmp / f"{split}.{lang}", _tokenize_chunk,
                         _init_tokenizer, (lang,), workers, f"tokenize {split}.{lang}")

    tok = run_stage(work_dir / "tok", "tokenize", tok_params, tokenize)

    bpe_params = {"stage": "bpe", "merges": bpe_merges, "tok": tok_params}

    def apply_bpe(tmp):
        log(f"  learning {bpe_merges} joint BPE merges on train.{langs[0]} + train.{langs[1]}")
        codes = io.StringIO()
        learn_bpe(chain(*(read_lines(tok / f"train.{lang}") for lang in langs)), codes, bpe_merges)
        write_text_atomically(tmp / "codes", codes.getvalue())
        for split in SPLITS:
            for lang in langs:
                map_file(tok / f"{split}.{lang}", tmp / f"{split}.{lang}", _bpe_chunk, _init_bpe,
                         (str(tmp / "codes"),), workers, f"apply BPE {split}.{lang}")

    bpe = run_stage(work_dir / "bpe", "bpe", bpe_params, apply_bpe)

    clean_params = {"stage": "clean", "ratio": CLEAN_RATIO, "min": CLEAN_MIN, "max": CLEAN_MAX,
                    "cleaned": ["train"], "bpe": bpe_params}

    def clean(tmp):
        a, b = langs
        for split in SPLITS:
            paths = bpe / f"{split}.{a}", bpe / f"{split}.{b}"
            # zip() alone would cut the longer file short without a word
            check_parallel(*paths, *map(count_lines, paths))
            pairs = zip(*map(read_lines, paths), strict=True)
            if split == "train":  # valid and test keep every sentence: Table 1 counts the whole sets
                pairs = filter(None, (clean_pair(x, y) for x, y in pairs))
            kept = 0
            with open(tmp / f"{split}.{a}", "w", encoding="utf-8") as out_a, \
                    open(tmp / f"{split}.{b}", "w", encoding="utf-8") as out_b:
                for x, y in pairs:
                    out_a.write(x + "\n")
                    out_b.write(y + "\n")
                    kept += 1
            log(f"  {split}: kept {kept:,} sentence pairs")
            if kept == 0:
                raise PrepareError(f"no {split} sentence pair is left after cleaning {bpe / split}.{{{a},{b}}} "
                                   f"(1..{CLEAN_MAX} subwords, length ratio <= {CLEAN_RATIO}); check that the "
                                   "input files are really translations of each other")

    clean_dir = run_stage(work_dir / "clean", "clean", clean_params, clean)

    binarize_params = {"stage": "binarize", "src": src, "tgt": tgt, "clean": clean_params, "raw_test": True}

    def binarize(tmp):
        args = ["--source-lang", src, "--target-lang", tgt,
                "--trainpref", str(clean_dir / "train"), "--validpref", str(clean_dir / "valid"),
                "--testpref", str(clean_dir / "test"), "--destdir", str(tmp), "--joined-dictionary",
                "--workers", str(workers)]
        log("  " + " ".join(["fairseq-preprocess", *args]))
        fairseq_preprocess(args)
        shutil.copyfile(bpe / "codes", tmp / "bpecodes")
        for lang in langs:  # the references as released, for sacreBLEU (multipath-score --raw-ref)
            shutil.copyfile(raw_text / f"test.{lang}", tmp / f"test.raw.{lang}")

    result = run_stage(Path(out), "binarize", binarize_params, binarize)
    log(f"data-bin ready: {result} ({src} -> {tgt}); text stages in {work_dir}")
    return result


# ------------------------------------------------------------------------------ user corpora

def find_input(prefix, lang, option):
    plain, gz = Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")
    if plain.is_file():
        return plain
    if gz.is_file():
        return gz
    raise PrepareError(f"input file not found: {plain} (nor {gz.name}); {option} takes a PREFIX and the "
                       f"files must be PREFIX.LANG or PREFIX.LANG.gz for both --src and --tgt")


def prepare_corpus(src, tgt, train, valid, test, out, bpe_merges=32000, workers=1, work_dir=None):
    """Raw parallel text PREFIX.{src,tgt}[.gz] for train/valid/test -> fairseq data-bin ``out``."""
    check_languages(src, tgt)
    out, given_work_dir = Path(out), work_dir
    work_dir = Path(work_dir) if work_dir else out.with_name(out.name + ".work")
    prefixes = {"train": train, "valid": valid, "test": test}
    inputs = {(split, lang): find_input(prefixes[split], lang, f"--{split}") for split in SPLITS
              for lang in (src, tgt)}
    check_output_folder(out, "--out")
    check_output_folder(work_dir, "--work-dir" if given_work_dir else "--out or --work-dir")
    langs = (src, tgt)
    raw_params = {"stage": "raw", "inputs": {f"{s}.{lang}": stamp_of(p) for (s, lang), p in inputs.items()}}

    def copy_raw(tmp):
        for split in SPLITS:
            counts = [write_lines(tmp / f"{split}.{lang}", read_lines(inputs[split, lang])) for lang in langs]
            check_parallel(inputs[split, src], inputs[split, tgt], *counts)
            log(f"  {split}: {counts[0]:,} sentence pairs")

    with work_dir_locked(work_dir):
        raw = run_stage(work_dir / "raw", "raw", raw_params, copy_raw)
        return process_text(raw, work_dir, out, langs, src, tgt, bpe_merges, workers, raw_params)


# ------------------------------------------------------------------------------------- WMT

def _content_range_total(response):
    """The full size from ``Content-Range: bytes A-B/TOTAL`` (0 when unknown)."""
    total = response.headers.get("Content-Range", "").rpartition("/")[2]
    return int(total) if total.isdigit() else 0


def download(url, part, label):
    """Fetch ``url`` into ``part``, resuming from what ``part`` already holds with an HTTP Range
    request, also after a connection dropped midway; gives up after DOWNLOAD_RETRIES attempts in a
    row that receive nothing. HTTP errors other than server errors (404, 403, ...) raise at once."""
    failures = 0
    while True:
        have = part.stat().st_size if part.is_file() else 0
        request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                if have and response.status == 206:
                    total, mode = _content_range_total(response), "ab"
                    log(f"  resuming {part.name} at {have / (1 << 20):,.1f} MB")
                else:  # a fresh download, or a server that ignores Range: start over
                    total, mode, have = int(response.headers.get("Content-Length") or 0), "wb", 0
                progress = Progress(label, total, unit="MB", scale=1 << 20)
                progress.count = have
                with open(part, mode) as out:
                    while block := response.read(1 << 20):
                        out.write(block)
                        progress.update(len(block))
                progress.close()
            size = part.stat().st_size
            if total and size < total:
                raise ConnectionError(f"the connection closed after {size:,} of {total:,} bytes")
            return
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            if isinstance(e, urllib.error.HTTPError) and e.code < 500:
                if e.code == 416 and have:  # nothing left after byte `have`: the file is complete
                    return
                raise
            received = part.stat().st_size if part.is_file() else 0
            failures = 0 if received > have else failures + 1
            if failures >= DOWNLOAD_RETRIES:
                raise
            log(f"  download of {url} interrupted ({e}); resuming at {received:,} bytes")
            time.sleep(RETRY_WAIT * failures)


def _download_checked(archive, urls, target):
    """Download ``urls`` (one file, or the parts of one) into ``target`` and check it; a file that
    fails the check is deleted and fetched once more from scratch, and never returned."""
    for attempt in (1, 2):
        pieces = []
        for url in urls:
            piece = target.with_name(url.rsplit("/", 1)[-1] + ".part")
            log(f"[download] {url} -> {piece}")
            try:
                download(url, piece, f"download {piece.name[:-5]}")
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                how = archive.manual or archive.page or (f"else download {archive.filename} yourself and "
                                                         "pass its folder as --raw-dir")
                raise PrepareError(f"download failed: {url}: {e}; check the network or --mirror; {how}") from None
            pieces.append(piece)
        checked = pieces[0]
        if len(pieces) > 1:
            checked = _join(pieces, target.with_name(target.name + ".part"))
            for piece in pieces:
                piece.unlink()
        problem = archive_problem(checked, archive)
        if problem is None:
            os.replace(checked, target)
            return target
        checked.unlink()
        if attempt == 1:
            log(f"[download] {target.name} is damaged ({problem}); deleted, downloading it again")
    raise PrepareError(f"{target.name} downloaded twice and still damaged: {problem}; the server does not "
                       f"serve the pinned release (check --mirror), or download it yourself and pass its "
                       "folder as --raw-dir")


def fetch(archive, downloads, raw_dir=None, mirror=None):
    """The local path of ``archive``: from --raw-dir, an earlier download, or a fresh download
    (resumable, checked against the pinned checksum, fetched again when damaged)."""
    if raw_dir and (found := _from_raw_dir(archive, raw_dir, downloads)):
        return found
    target = Path(downloads) / archive.filename
    if target.is_file():  # only a checked download is renamed to its final name
        log(f"[download] finished earlier, skipping: {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    urls = [mirror_url(url, mirror) for url in (archive.parts or (archive.url,))]
    return _download_checked(archive, urls, target)


def prepare_wmt(task, out=None, raw_dir=None, mirror=None, workers=1, bpe_merges=32000, work_dir=None):
    """One of the 12 WMT directions of the paper -> fairseq data-bin ``out`` (default data-bin/TASK)."""
    if task not in TASKS:
        raise PrepareError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    if raw_dir and not Path(raw_dir).is_dir():
        raise PrepareError(f"--raw-dir {raw_dir} is not a directory; give the folder holding the archives")
    pair, src, tgt = TASKS[task]
    log(f"{task}: {src} -> {tgt}, sentence pairs in the paper's Table 1: " +
        ", ".join(f"{split} {getattr(pair.table1, split):,}" for split in SPLITS))
    out = Path(out or Path("data-bin") / task)
    check_output_folder(out, "--out")
    check_output_folder(work_dir or out.parent / f"{pair.name}.work",
                        "--work-dir" if work_dir else "--out or --work-dir")
    work_dir = Path(work_dir) if work_dir else out.parent / f"{pair.name}.work"
    extract = work_dir / "extract"
    downloads = work_dir / "downloads"
    for archive_name in pair.archives():  # before any long download, say what the user must fetch
        archive = ARCHIVES[archive_name]
        if archive.manual and not mirror and not any(
                (folder / archive.filename).is_file() for folder in (Path(raw_dir or downloads), downloads)):
            where = f"--raw-dir {raw_dir}" if raw_dir else "no --raw-dir given"
            raise PrepareError(f"{archive.filename} not found ({where}): {archive.manual}")
    with work_dir_locked(work_dir):
        extract_params = {}
        for archive_name, members in _pair_members(pair).items():
            path = fetch(ARCHIVES[archive_name], downloads, raw_dir, mirror)
            params = {"stage": "extract", "archive": stamp_of(path), "members": sorted(members)}
            run_stage(extract / archive_name, f"extract {path.name}", params,
                      lambda tmp, path=path, members=members: extract_members(path, members, tmp))
            extract_params[archive_name] = params

        raw_params = {"stage": "raw", "pair": pair.name, "extract": extract_params}

        def collect_raw(tmp):
            en, xx = pair.langs
            outputs = {(split, lang): open(tmp / f"{split}.{lang}", "w", encoding="utf-8")
                       for split in SPLITS for lang in pair.langs}
            try:
                for corpus in pair.train:
                    counts = [write_to(outputs["train", lang], _corpus_lines(extract, corpus, lang))
                              for lang in pair.langs]
                    names = [extract / corpus.archive / corpus.member.format(lang=lang) for lang in pair.langs]
                    check_parallel(*names, *counts)
                    log(f"  train += {counts[0]:,} sentence pairs from {corpus.archive}")
                for split, sets in (("valid", pair.valid), ("test", (pair.test,))):
                    for evalset in sets:
                        paths = [extract / evalset.archive / evalset.en, extract / evalset.archive / evalset.xx]
                        counts = [write_to(outputs[split, lang], sgm_to_text(p)) for lang, p in zip((en, xx), paths)]
                        check_parallel(*paths, *counts)
                        log(f"  {split} += {counts[0]:,} sentence pairs from {evalset.en}")
            finally:
                for f in outputs.values():
                    f.close()

        raw = run_stage(work_dir / "raw", "raw", raw_params, collect_raw)
        result = process_text(raw, work_dir, out, pair.langs, src, tgt, bpe_merges, workers, raw_params)
        counts = {split: (count_lines(raw / f"{split}.en"), count_lines(work_dir / "clean" / f"{split}.en"))
                  for split in SPLITS}
        report, warnings = compare_with_table1(pair, counts)
        log(f"{task} sizes (sentence pairs): {report}")
        if pair.table1.variant:
            log(f"{task} training size: {pair.table1.variant}")
        for warning in warnings:
            log(f"warning: {warning}")
        return result
