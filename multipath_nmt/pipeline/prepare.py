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
any ``.partial`` left by an interrupted run.
"""
import gzip
import hashlib
import http.client
import io
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from itertools import chain, islice
from pathlib import Path

import regex
from sacremoses import MosesPunctNormalizer, MosesTokenizer
from sacremoses.corpus import NonbreakingPrefixes
from subword_nmt.apply_bpe import BPE
from subword_nmt.learn_bpe import learn_bpe

from multipath_nmt.atomic_files import write_text_atomically
from multipath_nmt.pipeline.wmt import ARCHIVES, TASKS
from multipath_nmt.scoring import sgm_to_text

DONE = ".done"
SPLITS = ("train", "valid", "test")
CHUNK_LINES = 2000
# clean-corpus-n.perl arguments used by fairseq's WMT scripts: -ratio 1.5 CORPUS L1 L2 OUT 1 250
CLEAN_RATIO, CLEAN_MIN, CLEAN_MAX, CLEAN_MAX_WORD_LENGTH = 1.5, 1, 250, 1000
# remove-non-printing-char.perl replaces every \p{C} character with a space (sacremoses'
# post_remove_control_chars deletes it instead, which would glue the neighbouring words).
NON_PRINTING = regex.compile(r"\p{C}")
# Consecutive failed attempts (no byte received) before a download gives up, and the wait per failure.
DOWNLOAD_RETRIES, RETRY_WAIT = 5, 2.0
# A prepared split whose size is off Table 1's by more than this fraction is reported.
TABLE1_TOLERANCE = 0.10


class PrepareError(Exception):
    """Bad input or a failed step; the message names the file and the fix."""


def log(message):
    print(message, file=sys.stderr, flush=True)


class Progress:
    """A counter printed on stderr at most every ``interval`` seconds, and once at the end."""

    def __init__(self, label, total=0, unit="lines", scale=1, interval=2.0):
        self.label, self.total, self.unit, self.scale, self.interval = label, total, unit, scale, interval
        self.count, self.last = 0, time.monotonic()

    def update(self, n):
        self.count += n
        if time.monotonic() - self.last >= self.interval:
            self._print()

    def _print(self):
        self.last = time.monotonic()
        done = f"{self.count / self.scale:,.0f}" if self.scale == 1 else f"{self.count / self.scale:,.1f}"
        if self.total:
            log(f"  {self.label}: {done} / {self.total / self.scale:,.1f} {self.unit} "
                f"({100 * self.count / self.total:.0f}%)")
        else:
            log(f"  {self.label}: {done} {self.unit}")

    def close(self):
        self._print()


# ---------------------------------------------------------------------------- stages and files

def run_stage(final, label, params, build):
    """Build directory ``final`` with ``build(tmp_dir)`` unless it is finished with ``params``."""
    final = Path(final)
    marker = final / DONE
    stamp = json.dumps(params, sort_keys=True, default=str)
    if marker.is_file():
        if marker.read_text(encoding="utf-8") == stamp:
            log(f"[{label}] finished earlier, skipping: {final}")
            return final
        log(f"[{label}] parameters or inputs changed, rebuilding: {final}")
    elif final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise PrepareError(f"{final} exists but was not written by multipath-prepare (it has no {DONE}); "
                           "remove it or choose another output directory")
    partial = final.with_name(final.name + ".partial")
    if partial.exists():
        log(f"[{label}] removing the unfinished {partial} of an interrupted run")
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    log(f"[{label}] building {final}")
    try:
        build(partial)
    except PrepareError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    (partial / DONE).write_text(stamp, encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    return final


def stamp_of(path):
    """Identity of an input file for the .done parameters: a changed file triggers a rebuild."""
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def open_text(path):
    """UTF-8 text, gzipped or not; lines end at "\\n" only, like Perl's (a stray "\\r" stays in the line)."""
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="\n")
    return open(path, encoding="utf-8", newline="\n")


def read_lines(path):
    number = 0
    with open_text(path) as f:
        try:
            for number, line in enumerate(f, 1):
                yield line[:-1] if line.endswith("\n") else line
        except UnicodeDecodeError as e:
            raise PrepareError(f"{path} is not UTF-8 text (after line {number}): {e}; "
                               "convert it, e.g. iconv -f LATIN1 -t UTF-8") from None
        except (OSError, EOFError) as e:
            raise PrepareError(f"cannot read {path}: {e}; the file is damaged, replace it") from None


def write_to(out, lines):
    count = 0
    for line in lines:
        out.write(line + "\n")
        count += 1
    return count


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        return write_to(out, lines)


def check_parallel(path_a, path_b, count_a, count_b):
    for path, count in ((path_a, count_a), (path_b, count_b)):
        if count == 0:
            raise PrepareError(f"input file is empty: {path}; give a file with one sentence per line")
    if count_a != count_b:
        raise PrepareError(f"parallel files have different line counts: {path_a} has {count_a:,} lines but "
                           f"{path_b} has {count_b:,}; they must be aligned line by line (line i of one "
                           "file is the translation of line i of the other)")


def check_languages(*langs):
    known = sorted({code for code in NonbreakingPrefixes().available_langs.values()})
    for lang in langs:
        if lang not in known:
            raise PrepareError(f"unknown language code {lang!r}: the Moses tokenizer knows {', '.join(known)}; "
                               "use the ISO 639-1 code of the language (e.g. en, de, fr)")
    if len(set(langs)) != len(langs):
        raise PrepareError(f"source and target language are the same ({langs[0]}); give two different codes")


# ------------------------------------------------------------------- per-line text processing

def remove_non_printing(line):
    return NON_PRINTING.sub(" ", line)


def moses_tokenize(line, normalizer, tokenizer):
    """normalize-punctuation.perl | remove-non-printing-char.perl | tokenizer.perl -a (escaping on)."""
    line = remove_non_printing(normalizer.normalize(line))
    return tokenizer.tokenize(line, escape=True, aggressive_dash_splits=True, return_str=True)


def clean_pair(a, b, ratio=CLEAN_RATIO, min_len=CLEAN_MIN, max_len=CLEAN_MAX,
               max_word_length=CLEAN_MAX_WORD_LENGTH):
    """clean-corpus-n.perl on one sentence pair: the cleaned pair, or None when it is dropped."""
    a = " ".join(a.replace("|", "").split())
    b = " ".join(b.replace("|", "").split())
    if not a or not b:
        return None
    words_a, words_b = a.split(" "), b.split(" ")
    if not (min_len <= len(words_a) <= max_len and min_len <= len(words_b) <= max_len):
        return None
    if len(words_a) / len(words_b) > ratio or len(words_b) / len(words_a) > ratio:
        return None
    if max(map(len, words_a)) > max_word_length or max(map(len, words_b)) > max_word_length:
        return None
    return a, b


_worker = {}

# After a kill -9 of multipath-prepare, none of its children may go on writing into a stage's
# .partial folder while the next run removes and rebuilds it: each is SIGKILLed when its parent
# dies (Linux's PR_SET_PDEATHSIG; elsewhere nothing is done). fairseq-preprocess runs through
# this bootstrap (argv: our pid, the module, its arguments), which does the same for every
# process it forks (its --workers).
DIE_WITH_PARENT = """
import ctypes, os, runpy, signal, sys
try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    prctl = None
def arm(parent):
    if prctl is not None:
        prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call
            os._exit(1)
arm(int(sys.argv[1]))
forking = {}
os.register_at_fork(before=lambda: forking.update(pid=os.getpid()),
                    after_in_child=lambda: arm(forking["pid"]))
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _in_pool_worker():
    """A worker of our own pools (tokenize, BPE) dies with multipath-prepare, as above."""
    parent = multiprocessing.parent_process()
    if parent is not None and sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent.pid:
            os._exit(1)


def _init_tokenizer(lang):
    _in_pool_worker()
    _worker["normalizer"] = MosesPunctNormalizer(lang)
    _worker["tokenizer"] = MosesTokenizer(lang)


def _tokenize_chunk(lines):
    return [moses_tokenize(line, _worker["normalizer"], _worker["tokenizer"]) for line in lines]


def _init_bpe(codes_path):
    _in_pool_worker()
    with open(codes_path, encoding="utf-8") as codes:
        _worker["bpe"] = BPE(codes)


def _bpe_chunk(lines):
    return [_worker["bpe"].process_line(line) for line in lines]


def _chunks(lines, size):
    lines = iter(lines)
    while chunk := list(islice(lines, size)):
        yield chunk


def map_file(src, dst, func, init, init_args, workers, label, chunk_lines=CHUNK_LINES):
    """Write ``func`` of each chunk of lines of ``src`` to ``dst`` in order, over ``workers`` processes."""
    progress = Progress(label)
    with open(dst, "w", encoding="utf-8", newline="\n") as out:
        def write(chunk):
            out.writelines(line + "\n" for line in chunk)
            progress.update(len(chunk))

        if workers > 1:
            with multiprocessing.Pool(workers, initializer=init, initargs=init_args) as pool:
                for chunk in pool.imap(func, _chunks(read_lines(src), chunk_lines), chunksize=1):
                    write(chunk)
        else:
            init(*init_args)
            for chunk in _chunks(read_lines(src), chunk_lines):
                write(func(chunk))
    progress.close()


# ------------------------------------------------------------------------ the common stages

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
            pairs = zip(read_lines(bpe / f"{split}.{a}"), read_lines(bpe / f"{split}.{b}"))
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
        log("  " + " ".join([sys.executable, "-m", "fairseq_cli.preprocess", *args]))
        cmd = [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), "fairseq_cli.preprocess", *args]
        proc = subprocess.run(cmd, stdout=2)  # its log is progress too: keep stdout free, like every stage
        if proc.returncode != 0:
            raise PrepareError(f"fairseq-preprocess failed with exit code {proc.returncode} (its log is above)")
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
    out = Path(out)
    work_dir = Path(work_dir) if work_dir else out.with_name(out.name + ".work")
    prefixes = {"train": train, "valid": valid, "test": test}
    inputs = {(split, lang): find_input(prefixes[split], lang, f"--{split}") for split in SPLITS
              for lang in (src, tgt)}
    langs = (src, tgt)
    raw_params = {"stage": "raw", "inputs": {f"{s}.{l}": stamp_of(p) for (s, l), p in inputs.items()}}

    def copy_raw(tmp):
        for split in SPLITS:
            counts = [write_lines(tmp / f"{split}.{lang}", read_lines(inputs[split, lang])) for lang in langs]
            check_parallel(inputs[split, src], inputs[split, tgt], *counts)
            log(f"  {split}: {counts[0]:,} sentence pairs")

    raw = run_stage(work_dir / "raw", "raw", raw_params, copy_raw)
    return process_text(raw, work_dir, out, langs, src, tgt, bpe_merges, workers, raw_params)


# ------------------------------------------------------------------------------------- WMT

def mirror_url(url, mirror):
    """``url`` with its scheme and host replaced by ``mirror`` (which may carry a path prefix)."""
    if not mirror:
        return url
    return mirror.rstrip("/") + urllib.parse.urlsplit(url).path


def file_digest(path, algorithm):
    """Hex digest of a file, read in 1 MB blocks."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def archive_problem(path, archive):
    """Why ``path`` is not ``archive`` as released: a checksum mismatch, or (when no checksum is
    published) an archive that does not read to its end; None when it is fine."""
    if archive.checksum:
        algorithm, expected = archive.checksum
        log(f"  checking the {algorithm} of {path.name}")
        found = file_digest(path, algorithm)
        return None if found == expected else f"its {algorithm} is {found}, the release's is {expected}"
    log(f"  no published checksum for {path.name}: reading it through to check it is complete")
    try:
        for _, f in _archive_members(path, archive.filename):
            while f.read(1 << 20):
                pass
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError, PrepareError) as e:
        return f"it does not read as an archive ({e})"
    if archive.reference:
        log("  " + compare_with_reference(path, archive))
    return None


def compare_with_reference(path, archive):
    """Whether ``path`` is the copy that ``archive.reference`` (size, sha256, whose) describes, as a
    sentence to log. Never an error: the reference is someone else's copy, not a published checksum."""
    size, sha256, whose = archive.reference
    found = path.stat().st_size
    if found == size:
        digest = file_digest(path, "sha256")
        if digest == sha256:
            return f"{archive.filename} matches {whose}: same size ({size:,} bytes) and sha256 ({sha256})"
        difference = f"same size ({size:,} bytes) but sha256 {digest}, not {sha256}"
    else:
        difference = f"{found:,} bytes, not {size:,}"
    return (f"{archive.filename} does NOT match {whose}: {difference}. No checksum is published for this "
            "release and it reads to its end, so it is used; it is not the copy others pinned")


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


def _join(pieces, joined):
    """``cat pieces > joined`` (a release split into pieces, like the UN corpus)."""
    log(f"  joining {', '.join(p.name for p in pieces)} into {joined.name}")
    with open(joined, "wb") as out:
        for piece in pieces:
            with open(piece, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    return joined


def _from_raw_dir(archive, raw_dir, downloads):
    """The archive in --raw-dir (whole, or as its parts, joined into downloads/), checked once per
    file version; None when --raw-dir does not hold it."""
    raw_dir = Path(raw_dir)
    path = raw_dir / archive.filename
    part_names = [url.rsplit("/", 1)[-1] for url in archive.parts]
    if not path.is_file():
        if not part_names or not all((raw_dir / n).is_file() for n in part_names):
            return None
        path = Path(downloads) / archive.filename
        if path.is_file():  # only a checked join gets its final name
            log(f"[download] joined earlier, skipping: {path}")
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        joined = _join([raw_dir / n for n in part_names], path.with_name(path.name + ".part"))
        problem = archive_problem(joined, archive)
        if problem:
            joined.unlink()
            raise PrepareError(f"{', '.join(part_names)} in {raw_dir} do not join into the release this task "
                               f"expects: {problem}; replace them with the files from {archive.parts[0]} ...")
        os.replace(joined, path)
        log(f"[download] joined {', '.join(part_names)} from {raw_dir} into {path}")
        return path
    log(f"[download] using {path}")
    verified = Path(downloads) / (archive.filename + ".verified")
    stamp = json.dumps(stamp_of(path), sort_keys=True)
    if verified.is_file() and verified.read_text(encoding="utf-8") == stamp:
        return path
    problem = archive_problem(path, archive)
    if problem:
        raise PrepareError(f"{path} is not the release this task expects: {problem}; replace it with the "
                           f"file from {archive.url}")
    verified.parent.mkdir(parents=True, exist_ok=True)
    verified.write_text(stamp, encoding="utf-8")
    return path


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


def _archive_members(path, name=None):
    """(name, binary file object) for each regular file of a tar/tgz/zip/gz archive, streamed; the
    type is taken from ``name`` (default: the file's name)."""
    name = name or path.name
    if name.endswith(".zip"):
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not info.is_dir():
                    with z.open(info) as f:
                        yield info.filename, f
    elif name.endswith((".tgz", ".tar.gz", ".tar")):
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if member.isfile():
                    yield member.name, tar.extractfile(member)
    elif name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            yield name[:-3], f
    else:
        raise PrepareError(f"unknown archive type: {path}; expected .tgz, .tar, .zip or .gz")


def extract_members(archive_path, members, dest):
    """Copy ``members`` (paths as in the release, matched with or without a leading folder) to ``dest``."""
    wanted = set(members)
    try:
        for name, f in _archive_members(archive_path):
            name = name.removeprefix("./")
            match = next((m for m in wanted if name == m or name.endswith("/" + m)), None)
            if match is None:
                continue
            target = dest / match
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                shutil.copyfileobj(f, out, 1 << 20)
            log(f"  {archive_path.name}: {name}")
            wanted.discard(match)
            if not wanted:
                break
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as e:
        raise PrepareError(f"cannot read archive {archive_path}: {e}; it is damaged or incomplete, "
                           "delete it and run again") from None
    if wanted:
        raise PrepareError(f"{archive_path} has no member {', '.join(sorted(wanted))}; it is not the release "
                           f"this task expects, delete it and download it again")


def _pair_members(pair):
    members = {}
    for corpus in pair.train:
        paths = [corpus.member] if corpus.bitext_langs else [corpus.member.format(lang=l) for l in pair.langs]
        members.setdefault(corpus.archive, []).extend(paths)
    for evalset in (*pair.valid, pair.test):
        members.setdefault(evalset.archive, []).extend([evalset.en, evalset.xx])
    return members


def _corpus_lines(extract, corpus, lang):
    if corpus.bitext_langs:
        path = extract / corpus.archive / corpus.member
        column = corpus.bitext_langs.index(lang)
        for number, line in enumerate(read_lines(path), 1):
            fields = line.split("|||")
            if len(fields) != 2:
                raise PrepareError(f"{path} line {number} is not 'source ||| target'; the archive is not the "
                                   "expected release, delete it and download it again")
            yield fields[column].strip()
    else:
        yield from read_lines(extract / corpus.archive / corpus.member.format(lang=lang))


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
    work_dir = Path(work_dir) if work_dir else out.parent / f"{pair.name}.work"
    extract = work_dir / "extract"
    downloads = work_dir / "downloads"
    for archive_name in pair.archives():  # before any long download, say what the user must fetch
        archive = ARCHIVES[archive_name]
        if archive.manual and not mirror and not any(
                (folder / archive.filename).is_file() for folder in (Path(raw_dir or downloads), downloads)):
            where = f"--raw-dir {raw_dir}" if raw_dir else "no --raw-dir given"
            raise PrepareError(f"{archive.filename} not found ({where}): {archive.manual}")
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


def count_lines(path):
    """Number of "\n"-terminated lines of a file, counted on bytes."""
    lines = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            lines += block.count(b"\n")
    return lines


def compare_with_table1(pair, counts):
    """The prepared sizes next to Table 1's, and a warning per split off by more than
    TABLE1_TOLERANCE, with the known reason. ``counts``: split -> (pairs before cleaning, pairs kept).
    Table 1 does not say whether it counts before or after cleaning, so a split is within Table 1
    when either count is."""
    report, warnings = [], []
    for split in SPLITS:
        before, kept = counts[split]
        expected = getattr(pair.table1, split)
        shown = f"{kept:,}" if kept == before else f"{before:,} -> {kept:,} after cleaning"
        report.append(f"{split} {shown} (Table 1: {expected:,})")
        if min(abs(before - expected), abs(kept - expected)) > TABLE1_TOLERANCE * expected:
            gap = (kept - expected) / expected
            reason = pair.table1.notes.get(split, "reason unknown: check the archives and the log above")
            warnings.append(f"{pair.name} {split} has {kept:,} sentence pairs, {abs(gap):.0%} "
                            f"{'below' if gap < 0 else 'above'} the paper's Table 1 ({expected:,}): {reason}")
    return "; ".join(report), warnings
