"""Checks of a fairseq data-bin before anything trains or translates on it: every failure is one line.

fairseq 0.12 finds a damaged data-bin late and says so with a traceback from deep inside its
data loading: a truncated ``.bin`` fails when the first sentence past the cut is batched
(``ValueError: offset must be non-negative and no greater than buffer length``), a truncated
``.idx`` with ``AttributeError: 'MMapIndexedDataset' object has no attribute '_bin_buffer_mmap'``,
source and target files of different lengths with an ``AssertionError``, a token id past the
dictionary with an ``IndexError`` in the embedding, and a missing or malformed dictionary with a
``FileNotFoundError``, ``ValueError`` or ``RuntimeError``. The functions here read the files
themselves, with numpy memory maps and without fairseq (``.importlinter`` keeps this module free
of fairseq and torch), and raise one :class:`DataBinError` whose message is one line: the file,
what is wrong with it, and the command that rebuilds the data-bin.

* :func:`check_dictionary` parses ``dict.<lang>.txt`` as fairseq's ``Dictionary.add_from_file``
  does and returns its number of entries (the four special symbols included).
* :func:`check_indexed_file` checks one ``<prefix>.idx`` / ``<prefix>.bin`` pair: the index
  header (fairseq's ``MMIDIDX`` format, or the older ``TNTIDX`` one), its length against its
  number of sentences, every offset against the sizes before it, the ``.bin`` size against the
  index (so a ``.bin`` of another dtype or another file is caught), and every token id against
  the dictionary.
* :func:`check_split` checks a split as fairseq's ``load_langpair_dataset`` finds it (``train``,
  then ``train1``, ``train2``, ... when combined; either language order in the file names), both
  sides, and that they have as many sentences.
* :func:`rebuild_advice` reads the data-bin's ``.done`` (written by ``multipath-prepare``) and
  gives the ``multipath-prepare`` command that rebuilds it.
* :func:`sentence_too_long` names the file and line of a valid or test sentence longer than the
  model's positions (fairseq's ``Size of sample #N is invalid`` exception said neither).

A check reads each file once, sequentially: about the speed of reading the files (see
docs/troubleshooting.md for a measured WMT-sized data-bin).
"""
import json
import os
import shlex
import struct

import numpy as np

# fairseq/data/indexed_dataset.py: the dtype codes of both index formats.
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.double, 8: np.uint16, 9: np.uint32, 10: np.uint64}
MMAP_MAGIC = b"MMIDIDX\x00\x00"   # MMapIndexedDataset (fairseq-preprocess' default, --dataset-impl mmap)
LEGACY_MAGIC = b"TNTIDX\x00\x00"  # IndexedDataset (--dataset-impl lazy / cached)
HUFFMAN_MAGIC = b"HUFFIDX\x00"    # HuffmanMMapIndexedDataset: not checked here
_MMAP_HEADER = struct.Struct("<9sQBQ")      # magic, version, dtype code, number of sentences
_LEGACY_HEADER = struct.Struct("<8sQQQQQ")  # magic, version, dtype code, element size, len, sizes
SPECIAL_SYMBOLS = 4  # <s> <pad> </s> <unk>: what fairseq's Dictionary() starts with
_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
_CHUNK = 1 << 26     # tokens per block when scanning a .bin for its largest id


class DataBinError(ValueError):
    """A data-bin that cannot be used; the message is one line that starts with the file."""

    def __init__(self, path, message, advice=None):
        path = str(path)
        super().__init__(f"{path}: {message}" + (f"; {advice}" if advice else ""))
        self.path = path


def rebuild_advice(folder):
    """How to rebuild the data-bin ``folder``: the ``multipath-prepare`` command that wrote it,
    read from the ``.done`` file it leaves there, or a general sentence when there is none."""
    folder = str(folder)
    command = _prepare_command(folder)
    if command is None:
        return (f"rebuild the data-bin {folder} with the multipath-prepare (corpus or wmt) or "
                "fairseq-preprocess command that wrote it")
    aside = shlex.quote(folder.rstrip("/") + ".damaged")
    # The .done of the data-bin says it is finished: move it aside (nothing is deleted) so that
    # multipath-prepare builds it again from the text stages it kept in its work dir.
    return f"rebuild it: mv {shlex.quote(folder)} {aside} && {command}"


def _prepare_command(folder):
    try:
        with open(os.path.join(folder, ".done"), encoding="utf-8") as f:
            params = json.load(f)
        src, tgt = params["src"], params["tgt"]
        bpe = params["clean"]["bpe"]
        merges = bpe["merges"]
        raw = bpe["tok"]["raw"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    out = shlex.quote(folder)
    merges = "" if merges == 32000 else f" --bpe-merges {merges}"
    if isinstance(raw, dict) and raw.get("pair"):
        year = str(raw["pair"]).split("_")[0]
        return f"multipath-prepare wmt {year}_{src}_{tgt} --out {out}{merges}"
    inputs = raw.get("inputs") if isinstance(raw, dict) else None
    if not isinstance(inputs, dict):
        return None
    prefixes = []
    for split in ("train", "valid", "test"):
        entry = inputs.get(f"{split}.{src}")
        path = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(path, str):
            return None
        for ending in (f".{src}.gz", f".{src}"):
            if path.endswith(ending):
                prefixes.append(f"--{split} {shlex.quote(path[:-len(ending)])}")
                break
        else:
            return None
    return f"multipath-prepare corpus --src {src} --tgt {tgt} {' '.join(prefixes)} --out {out}{merges}"


# --- dictionaries --------------------------------------------------------------------------

def check_dictionary(path, advice=None):
    """The number of entries of the fairseq dictionary ``path`` (the 4 special symbols
    included), or :class:`DataBinError` where fairseq's ``Dictionary.load`` would fail."""
    path = str(path)
    advice = advice if advice is not None else rebuild_advice(os.path.dirname(path) or ".")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        folder = os.path.dirname(path) or "."
        others = _dictionaries_in(folder)
        found = f"the folder has {', '.join(others)}" if others else "the folder has no dict.*.txt"
        if not os.path.isdir(folder):
            raise DataBinError(folder, "no such data-bin directory: check the path given to "
                                       "fairseq") from None
        raise DataBinError(path, f"no such dictionary ({found}): check --source-lang and "
                                 "--target-lang", advice) from None
    except OSError as err:
        raise DataBinError(path, f"cannot be read ({err.strerror})", advice) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise DataBinError(path, f"line {line} is not UTF-8 text", advice) from None
    # fairseq reads the file in text mode (universal newlines) with readlines() and rstrip()s
    # each line
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines[-1] == "":
        lines.pop()
    seen = set(_SPECIALS)
    entries = SPECIAL_SYMBOLS
    for number, line in enumerate(lines, 1):
        fields = line.rstrip().rsplit(" ", 1)
        problem = None
        if len(fields) != 2:
            problem = "is not '<token> <count>'"
        else:
            word, field = fields
            overwrite = field == "#fairseq:overwrite"
            if overwrite:
                parts = word.rsplit(" ", 1)
                if len(parts) != 2:
                    problem = "is not '<token> <count> #fairseq:overwrite'"
                else:
                    word, field = parts
            if problem is None:
                try:
                    int(field)
                except ValueError:
                    problem = f"has the count {field!r}, not a whole number"
            if problem is None and word in seen and not overwrite:
                problem = f"repeats the token {word!r} (without the #fairseq:overwrite flag)"
        if problem:
            shown = line if len(line) <= 60 else line[:57] + "..."
            raise DataBinError(path, f"line {number} ({shown!r}) {problem}: the dictionary is "
                                     "damaged", advice)
        seen.add(word)
        entries += 1
    return entries


def _dictionaries_in(folder):
    try:
        return sorted(n for n in os.listdir(folder) if n.startswith("dict.") and n.endswith(".txt"))
    except OSError:
        return []


# --- indexed files ---------------------------------------------------------------------------

def _file_size(path):
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def check_indexed_file(prefix, dictionary_size=None, dictionary=None, advice=None):
    """Check ``prefix.idx`` and ``prefix.bin`` against each other (and every token id against a
    dictionary of ``dictionary_size`` entries, named ``dictionary`` in messages). Returns the
    number of sentences; raises :class:`DataBinError`. A format these checks do not read (the
    Huffman one) returns None."""
    prefix = str(prefix)
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    advice = advice if advice is not None else rebuild_advice(os.path.dirname(prefix) or ".")
    idx_size, bin_size = _file_size(idx), _file_size(bin_)
    if idx_size is None:
        raise DataBinError(idx, f"missing (its data file {os.path.basename(bin_)} is there)", advice)
    if bin_size is None:
        raise DataBinError(bin_, f"missing (its index {os.path.basename(idx)} is there)", advice)
    with open(idx, "rb") as f:
        head = f.read(max(_MMAP_HEADER.size, _LEGACY_HEADER.size))
    if head.startswith(MMAP_MAGIC[:8]):
        return _check_mmap(idx, bin_, idx_size, bin_size, head, dictionary_size, dictionary, advice)
    if head.startswith(LEGACY_MAGIC):
        return _check_legacy(idx, bin_, idx_size, bin_size, head, dictionary_size, dictionary, advice)
    if head.startswith(HUFFMAN_MAGIC):
        return None
    if not head:
        raise DataBinError(idx, "empty (0 bytes): its write was interrupted", advice)
    raise DataBinError(idx, f"not a fairseq index (it starts with {head[:8]!r}, not "
                            f"{MMAP_MAGIC[:7]!r})", advice)


def _dtype(idx, code, advice):
    dtype = DTYPES.get(code)
    if dtype is None:
        raise DataBinError(idx, f"damaged header: unknown dtype code {code}", advice)
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        raise DataBinError(idx, f"its tokens are {dtype.name}, not integers: this is not a "
                                "fairseq-preprocess data-bin of token ids", advice)
    return dtype


def _check_mmap(idx, bin_, idx_size, bin_size, head, dictionary_size, dictionary, advice):
    if idx_size < _MMAP_HEADER.size:
        raise DataBinError(idx, f"truncated: {idx_size} bytes, shorter than the "
                                f"{_MMAP_HEADER.size}-byte header", advice)
    magic, version, code, count = _MMAP_HEADER.unpack(head[:_MMAP_HEADER.size])
    if magic != MMAP_MAGIC or version != 1:
        raise DataBinError(idx, f"damaged header (version {version}, expected 1)", advice)
    dtype = _dtype(idx, code, advice)
    expected = _MMAP_HEADER.size + 12 * count  # int32 size + int64 offset per sentence
    if idx_size != expected:
        kind = "truncated" if idx_size < expected else "too long"
        raise DataBinError(idx, f"{kind}: {idx_size:,} bytes, but its header counts {count:,} "
                                f"sentences, which take {expected:,} bytes", advice)
    if count == 0:
        sizes = np.zeros(0, np.int32)
        pointers = np.zeros(0, np.int64)
    else:
        sizes = np.memmap(idx, np.int32, "r", offset=_MMAP_HEADER.size, shape=(count,))
        pointers = np.memmap(idx, np.int64, "r", offset=_MMAP_HEADER.size + 4 * count,
                             shape=(count,))
    _check_sizes(idx, sizes, advice)
    ends = np.cumsum(sizes, dtype=np.int64)
    starts = np.concatenate(([0], ends[:-1])) * dtype.itemsize
    if not np.array_equal(starts, pointers):
        for itemsize in (1, 2, 4, 8):
            if itemsize != dtype.itemsize and np.array_equal(starts // dtype.itemsize * itemsize,
                                                             pointers):
                raise DataBinError(idx, f"damaged header: it says the tokens are {dtype.name} "
                                        f"({dtype.itemsize} bytes each), but its offsets are those "
                                        f"of {itemsize}-byte tokens", advice)
        i = int(np.flatnonzero(starts != pointers)[0])
        raise DataBinError(idx, f"damaged: sentence {i} starts at byte {int(pointers[i]):,} of "
                                f"{os.path.basename(bin_)}, but the sizes before it put it at "
                                f"byte {int(starts[i]):,}", advice)
    tokens = int(ends[-1]) if count else 0
    _check_data_size(idx, bin_, bin_size, tokens, dtype, count, advice)
    offsets = np.concatenate(([0], ends))
    _check_token_ids(bin_, dtype, tokens, offsets, dictionary_size, dictionary, advice)
    return count


def _check_legacy(idx, bin_, idx_size, bin_size, head, dictionary_size, dictionary, advice):
    if idx_size < _LEGACY_HEADER.size:
        raise DataBinError(idx, f"truncated: {idx_size} bytes, shorter than the "
                                f"{_LEGACY_HEADER.size}-byte header", advice)
    _, version, code, element_size, count, n_sizes = _LEGACY_HEADER.unpack(head[:_LEGACY_HEADER.size])
    if version != 1:
        raise DataBinError(idx, f"damaged header (version {version}, expected 1)", advice)
    dtype = _dtype(idx, code, advice)
    expected = _LEGACY_HEADER.size + 8 * (2 * (count + 1) + n_sizes)
    if idx_size != expected:
        kind = "truncated" if idx_size < expected else "too long"
        raise DataBinError(idx, f"{kind}: {idx_size:,} bytes, but its header counts {count:,} "
                                f"sentences, which take {expected:,} bytes", advice)
    longs = np.memmap(idx, np.int64, "r", offset=_LEGACY_HEADER.size, shape=(2 * (count + 1) + n_sizes,))
    data_offsets = np.asarray(longs[count + 1:2 * (count + 1)])
    if data_offsets[0] != 0 or np.any(np.diff(data_offsets) < 0):
        raise DataBinError(idx, "damaged: its offsets do not grow from 0", advice)
    tokens = int(data_offsets[-1])
    if element_size != dtype.itemsize:
        raise DataBinError(idx, f"damaged header: element size {element_size} for "
                                f"{dtype.name}", advice)
    _check_data_size(idx, bin_, bin_size, tokens, dtype, count, advice)
    # IndexedDatasetBuilder stores id + 1 (Lua indexing); fairseq reads it back with
    # fix_lua_indexing=True
    _check_token_ids(bin_, dtype, tokens, data_offsets, dictionary_size, dictionary, advice, shift=1)
    return count


def _check_sizes(idx, sizes, advice):
    if len(sizes) and int(sizes.min()) < 0:
        i = int(np.argmin(sizes))
        raise DataBinError(idx, f"damaged: sentence {i} has a negative length ({int(sizes[i])})",
                           advice)


def _check_data_size(idx, bin_, bin_size, tokens, dtype, count, advice):
    expected = tokens * dtype.itemsize
    if bin_size != expected:
        kind = "truncated" if bin_size < expected else "longer than its index says"
        raise DataBinError(bin_, f"{kind}: {bin_size:,} bytes, but its index "
                                 f"{os.path.basename(idx)} describes {count:,} sentences of "
                                 f"{tokens:,} {dtype.name} tokens ({expected:,} bytes)", advice)


def _check_token_ids(bin_, dtype, tokens, offsets, dictionary_size, dictionary, advice, shift=0):
    """Every stored value minus ``shift`` is an id of the dictionary."""
    if not tokens or dictionary_size is None:
        return
    low_ok, high_ok = shift, dictionary_size - 1 + shift
    # Nothing to read when every value of the dtype is a valid id.
    if dtype.kind == "u" and shift == 0 and np.iinfo(dtype).max <= high_ok:
        return
    data = np.memmap(bin_, dtype, "r", shape=(tokens,))
    for start in range(0, tokens, _CHUNK):
        block = data[start:start + _CHUNK]
        if int(block.min()) >= low_ok and int(block.max()) <= high_ok:
            continue
        position = start + int(np.flatnonzero((block < low_ok) | (block > high_ok))[0])
        bad = int(data[position]) - shift
        sentence = int(np.searchsorted(offsets, position, side="right")) - 1
        where = f" {dictionary}" if dictionary else ""
        raise DataBinError(bin_, f"token id {bad} (sentence {sentence}) is not in the "
                                 f"dictionary{where}, which has {dictionary_size:,} entries: "
                                 "the data-bin and its dictionary do not belong together", advice)


# --- splits ------------------------------------------------------------------------------------

def _exists(prefix):
    return any(os.path.exists(prefix + ending) for ending in (".idx", ".bin"))


def split_prefixes(folder, split, src, tgt, combine=True):
    """The file prefixes (without the language) of ``split`` in ``folder`` as fairseq's
    ``load_langpair_dataset`` finds them: ``split``, then ``split1``, ``split2``, ... when
    ``combine``; each ``<split>.<src>-<tgt>.`` or ``<split>.<tgt>-<src>.``."""
    prefixes = []
    k = 0
    while True:
        split_k = split + (str(k) if k > 0 else "")
        for a, b in ((src, tgt), (tgt, src)):
            prefix = os.path.join(str(folder), f"{split_k}.{a}-{b}.")
            if _exists(prefix + src):
                prefixes.append(prefix)
                break
        else:
            return prefixes
        if not combine:
            return prefixes
        k += 1


def check_split(folder, split, src, tgt, dictionary_sizes=None, combine=True,
                need_target=True, what=None):
    """Check every file of ``split`` in the data-bin ``folder`` (see :func:`split_prefixes`):
    each ``.idx``/``.bin`` pair, the token ids against ``dictionary_sizes`` (a dict lang ->
    entries; read from the data-bin's ``dict.<lang>.txt`` when None) and that the source and
    target sides have as many sentences. Returns the number of sentence pairs. ``what`` names
    the option that chose the split in the message for a split that is not there."""
    folder = str(folder)
    advice = rebuild_advice(folder)
    if not os.path.isdir(folder):
        raise DataBinError(folder, "no such data-bin directory: check the path given to fairseq")
    prefixes = split_prefixes(folder, split, src, tgt, combine)
    if not prefixes:
        names = f"{split}.{src}-{tgt}.{src}.idx"
        if tgt is not None:
            names += f" or {split}.{tgt}-{src}.{src}.idx"
        chosen = f" ({what})" if what else ""
        raise DataBinError(folder, f"the data-bin has no {split} split{chosen}: no {names}", advice)
    langs = [src] + ([tgt] if tgt is not None else [])
    if dictionary_sizes is None:
        dictionary_sizes = {lang: check_dictionary(os.path.join(folder, f"dict.{lang}.txt"), advice)
                            for lang in langs}
    total = 0
    for prefix in prefixes:
        counts = {}
        for lang in langs:
            if lang == tgt and not _exists(prefix + lang):
                if need_target:
                    raise DataBinError(prefix + lang + ".idx",
                                       f"missing: the {split} split has its {src} side "
                                       f"({os.path.basename(prefix + src)}.idx) but not its {tgt} "
                                       "side", advice)
                continue
            counts[lang] = check_indexed_file(
                prefix + lang, dictionary_sizes.get(lang),
                os.path.join(folder, f"dict.{lang}.txt"), advice)
        if len(counts) == 2 and None not in counts.values() and counts[src] != counts[tgt]:
            raise DataBinError(prefix + tgt + ".idx",
                               f"{counts[tgt]:,} sentences, but its source side "
                               f"{os.path.basename(prefix + src)}.idx has {counts[src]:,}: the "
                               "two sides are not aligned", advice)
        total += counts.get(src) or 0
    return total


# --- sentences longer than the model's positions ---------------------------------------------

def sentence_count(prefix):
    """The number of sentences ``prefix.idx`` says it indexes (its header), or None for a format
    not read here."""
    with open(str(prefix) + ".idx", "rb") as f:
        head = f.read(max(_MMAP_HEADER.size, _LEGACY_HEADER.size))
    if head.startswith(MMAP_MAGIC[:8]) and len(head) >= _MMAP_HEADER.size:
        return _MMAP_HEADER.unpack(head[:_MMAP_HEADER.size])[3]
    if head.startswith(LEGACY_MAGIC) and len(head) >= _LEGACY_HEADER.size:
        return _LEGACY_HEADER.unpack(head[:_LEGACY_HEADER.size])[4]
    return None


def locate_sentence(folder, split, src, tgt, lang, index):
    """(the ``.idx`` file of ``lang``, the sentence's number in it) for sentence ``index`` of
    ``split`` as fairseq numbers the sentences of its shards (``split``, ``split1``, ...: one
    after the other); None when the files do not hold that many."""
    for prefix in split_prefixes(folder, split, src, tgt, combine=True):
        count = sentence_count(prefix + lang)
        if count is None:
            return None
        if index < count:
            return prefix + lang + ".idx", index
        index -= count
    return None


def sentence_too_long(folder, split, src, tgt, side, index, length, limit, longer=1):
    """The :class:`DataBinError` for sentence ``index`` of ``split`` (as fairseq numbers them),
    whose ``side`` ("source" or "target") has ``length`` tokens (its ``</s>`` included, as
    fairseq counts), more than the model's ``limit`` positions; ``longer``: how many sentences
    of the split are too long. Its line names the file, the sentence and its line in the text
    fairseq-preprocess binarized (one sentence a line, in order), and the limit."""
    lang = src if side == "source" else tgt
    found = locate_sentence(folder, split, src, tgt, lang, index)
    path, number = found if found else (os.path.join(str(folder), f"{split} ({lang})"), index)
    others = f"; {longer - 1:,} more of the {split} split too" if longer > 1 else ""
    return DataBinError(path, f"sentence {number} (line {number + 1} of the text it was binarized "
                              f"from) has {length:,} tokens with its </s>, more than the model's "
                              f"{limit:,} {side} positions (--max-{side}-positions){others}: "
                              "shorten or remove it and binarize again, or pass "
                              "--skip-invalid-size-inputs-valid-test to leave such sentences out")
