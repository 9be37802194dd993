"""The stage machinery of ``multipath-prepare`` (see :mod:`multipath_nmt.pipeline.prepare`): a
stage is a directory built in ``NAME.partial`` and renamed after its ``.done`` file (the stage's
parameters) is written, by one run at a time per work dir (:func:`work_dir_locked`); and the text
files the stages read and write, with the checks that name the file and the fix.
"""
import contextlib
import errno
import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

from sacremoses.corpus import NonbreakingPrefixes

from multipath_nmt.atomic_files import os_error_reason, unwritable_folder
from multipath_nmt.folder_locks import FolderLock

DONE = ".done"
LOCK = "multipath-prepare.lock"
SPLITS = ("train", "valid", "test")


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


@contextlib.contextmanager
def work_dir_locked(work_dir):
    """Hold the work dir's lock: a second run on it (the other direction of a WMT pair shares
    ``<pair>.work``) waits here, saying for whom, then finds the stages finished."""
    lock = FolderLock(Path(work_dir) / LOCK)
    lock.acquire(wait=True, on_wait=lambda holder: log(
        f"[lock] {work_dir} is in use by {holder}; waiting for it to finish"))
    try:
        yield
    finally:
        lock.release()


def check_output_folder(path, option):
    """Raise PrepareError, before any work, if no folder can be written at ``path`` (given by
    ``option``): a dangling symbolic link, a file, a path under a file, a read-only or full
    file system, no permission (:func:`multipath_nmt.atomic_files.unwritable_folder`)."""
    problem = unwritable_folder(path)
    if problem:
        raise PrepareError(f"{problem}; choose another {option}")


# errnos of a disk that is full (or a quota or file size limit reached): freeing space is the fix
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


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
        (partial / DONE).write_text(stamp, encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
    except PrepareError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except OSError as error:  # a write of the stage failed: a full disk, a file system gone read-only
        shutil.rmtree(partial, ignore_errors=True)
        where = f" ({error.filename})" if error.filename else ""
        fix = ("free disk space" if error.errno in _NO_SPACE
               else "check that you can write there")
        raise PrepareError(f"cannot write {final}: {os_error_reason(error)}{where}; its unfinished "
                           f"{partial} was removed: {fix} and run the same command again") from None
    return final


def stamp_of(path):
    """Identity of an input file for the .done parameters: a changed file triggers a rebuild."""
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def open_text(path):
    """UTF-8 text, gzipped or not; lines end at "\\n" only, like Perl's (a stray "\\r" stays in the line).
    A byte-order mark at the start is not read ("utf-8-sig"): it is no text of the first line, and
    the references written as DATA_BIN/test.raw.LANG would carry it into sacreBLEU and chrF."""
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="\n")
    return open(path, encoding="utf-8-sig", newline="\n")


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


def count_lines(path):
    """Number of "\n"-terminated lines of a file, counted on bytes."""
    lines = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            lines += block.count(b"\n")
    return lines
