"""Per-line text processing of ``multipath-prepare`` (see :mod:`multipath_nmt.pipeline.prepare`):
the Moses scripts (sacremoses ports), clean-corpus-n.perl, and the worker pools that run them and
subword-nmt's BPE over a file in chunks, each worker dying with the process that started it
(:mod:`multipath_nmt.pipeline.tethered`).
"""
import multiprocessing
from itertools import islice

import regex
from sacremoses import MosesPunctNormalizer, MosesTokenizer
from subword_nmt.apply_bpe import BPE

from multipath_nmt.pipeline.stages import Progress, read_lines
from multipath_nmt.pipeline.tethered import tether_children

CHUNK_LINES = 2000
# clean-corpus-n.perl arguments used by fairseq's WMT scripts: -ratio 1.5 CORPUS L1 L2 OUT 1 250
CLEAN_RATIO, CLEAN_MIN, CLEAN_MAX, CLEAN_MAX_WORD_LENGTH = 1.5, 1, 250, 1000
# remove-non-printing-char.perl replaces every \p{C} character with a space (sacremoses'
# post_remove_control_chars deletes it instead, which would glue the neighbouring words).
NON_PRINTING = regex.compile(r"\p{C}")


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


def _init_tokenizer(lang):
    _worker["normalizer"] = MosesPunctNormalizer(lang)
    _worker["tokenizer"] = MosesTokenizer(lang)


def _tokenize_chunk(lines):
    return [moses_tokenize(line, _worker["normalizer"], _worker["tokenizer"]) for line in lines]


def _init_bpe(codes_path):
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
            tether_children()
            # fork, whatever the platform's default (forkserver from Python 3.14): the
            # workers inherit the lifeline of tether_children
            with multiprocessing.get_context("fork").Pool(workers, initializer=init,
                                                          initargs=init_args) as pool:
                for chunk in pool.imap(func, _chunks(read_lines(src), chunk_lines), chunksize=1):
                    write(chunk)
        else:
            init(*init_args)
            for chunk in _chunks(read_lines(src), chunk_lines):
                write(func(chunk))
    progress.close()
