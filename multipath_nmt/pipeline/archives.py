"""The WMT releases as files, for ``multipath-prepare wmt`` (see
:mod:`multipath_nmt.pipeline.prepare`, which downloads them): mirrors, checksums, archives that
must read to their end, pieces joined, ``--raw-dir``, the members a pair needs and their text, and
the prepared sizes next to the paper's Table 1.
"""
import gzip
import hashlib
import json
import os
import shutil
import tarfile
import urllib.parse
import zipfile
from pathlib import Path

from multipath_nmt.pipeline.stages import SPLITS, PrepareError, log, read_lines, stamp_of

# A prepared split whose size is off Table 1's by more than this fraction is reported.
TABLE1_TOLERANCE = 0.10


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
        paths = [corpus.member] if corpus.bitext_langs else [corpus.member.format(lang=lang) for lang in pair.langs]
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
