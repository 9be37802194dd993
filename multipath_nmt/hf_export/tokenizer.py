"""The tokenizer of an exported model: transformers' own ``FSMTTokenizer`` (Moses + BPE, loaded by
``AutoTokenizer`` without remote code) over the fairseq dictionary and subword-nmt's codes.

What it shares with ``multipath-prepare`` (multipath_nmt/pipeline/text.py): sacremoses'
punctuation normalizer, tokenizer.perl with ``-a`` and escaping, no lowercasing, BPE merges
applied by rank with ``</w>`` closing each word (subword-nmt's codes format 0.2), </s> after the
source. Where they differ, on characters a corpus seldom holds: FSMT first applies
replace-unicode-punctuation.perl (``multipath-prepare`` does not), and deletes non-printing
characters where ``multipath-prepare`` turns them into spaces; subword-nmt's glossaries are
not applied. FSMT's vocabulary writes a word-final piece as ``piece</w>`` and an inner one as
``piece`` where fairseq's dictionary has ``piece`` and ``piece@@``: :func:`fsmt_vocabulary`
renames them, ids unchanged.
"""
import json
import os
import tempfile
from pathlib import Path

BPE_MARK = "@@"


def fsmt_vocabulary(dictionary):
    """fairseq's dictionary as FSMT's vocabulary: ``piece@@`` -> ``piece``, ``piece`` ->
    ``piece</w>``, the special symbols as they are; the ids are the dictionary's."""
    specials = set(dictionary.symbols[:dictionary.nspecial])
    vocabulary = {}
    for index, symbol in enumerate(dictionary.symbols):
        if symbol in specials or symbol.startswith("madeupword"):
            name = symbol
        elif symbol.endswith(BPE_MARK):
            name = symbol[:-len(BPE_MARK)]
        else:
            name = symbol + "</w>"
        vocabulary.setdefault(name, index)
    return vocabulary


def bpe_merges(bpe_codes):
    """The merges of subword-nmt's codes file ``bpe_codes`` (its lines but ``#version``); raises
    :class:`~multipath_nmt.hf_export.NotExportable` (one line) for a file that is not codes: a
    gzipped one, one that is not UTF-8 text, a line that is not two symbols."""
    from multipath_nmt.hf_export import NotExportable

    content = Path(bpe_codes).read_bytes()
    if content.startswith(b"\x1f\x8b"):
        raise NotExportable(f"--bpe-codes {bpe_codes} is gzipped: gunzip it (subword-nmt's codes "
                            "are plain text)")
    try:
        codes = content.decode("utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise NotExportable(
            f"--bpe-codes {bpe_codes} is not UTF-8 text (byte {error.start}): give "
            "subword-nmt's codes (multipath-prepare's data-bin/bpecodes)") from None
    merges = []
    for number, line in enumerate(codes, 1):
        if line.startswith("#version"):
            continue
        if len(line.strip(" ").split(" ")) != 2:  # as subword-nmt's apply_bpe reads a line
            raise NotExportable(f"--bpe-codes {bpe_codes}: line {number} is not a merge ('A B'): "
                                "give subword-nmt's codes (multipath-prepare's data-bin/bpecodes)")
        merges.append(line)
    return merges


def save_tokenizer(out_dir, dictionary, merges, source_lang, target_lang):
    """Write FSMTTokenizer's files for ``dictionary`` and the BPE ``merges`` (:func:`bpe_merges`;
    or the path of subword-nmt's codes file) into ``out_dir``."""
    from transformers import FSMTTokenizer

    if isinstance(merges, (str, os.PathLike)):
        merges = bpe_merges(merges)
    vocabulary = json.dumps(fsmt_vocabulary(dictionary), ensure_ascii=False)
    with tempfile.TemporaryDirectory(prefix="multipath-export-hf-") as scratch:
        vocab_file, merges_file = Path(scratch, "vocab.json"), Path(scratch, "merges.txt")
        vocab_file.write_text(vocabulary, encoding="utf-8")
        merges_file.write_text("\n".join(merges) + "\n", encoding="utf-8")
        tokenizer = FSMTTokenizer(langs=[source_lang, target_lang],
                                  src_vocab_file=str(vocab_file), tgt_vocab_file=str(vocab_file),
                                  merges_file=str(merges_file), model_max_length=1024)
        tokenizer.save_pretrained(out_dir)
