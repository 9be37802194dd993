"""Tokenized BLEU exactly as Moses' ``multi-bleu.perl`` prints it, plus detokenized sacreBLEU
against the references as released (SGML test sets extracted exactly as sacreBLEU extracts them).

``multi-bleu.perl`` reads bytes, not text: lines are ``chop``-ped (the last byte of an
unterminated final line is dropped), words are split on ASCII whitespace only and ``-lc``
lowercases ASCII only. We keep those semantics by working on ``bytes``. The n-gram statistics
come from sacreBLEU (``tokenize='none'``, no smoothing); since sacreBLEU splits on *Unicode*
whitespace, every byte-level word is first replaced by a whitespace-free id, which leaves the
counts unchanged. The final number is then computed in the script's own floating-point order
so that ``%.2f`` rounds the same way (a byte-order mark stays part of the first word there, as
in the script; sacreBLEU and chrF read the references without it, :func:`read_references`).
"""
import gzip
import math
import os
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence

import sacrebleu

# fairseq's scripts/compound_split_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g', written
# for text tokenized without -a, plus one alternative tried first at each position: a whole-word
# "@-@" (tokenizer.perl -a's hyphen token) becomes the one word "##AT##-##AT##" instead of
# "@ ##AT##-##AT## @".
_COMPOUND = re.compile(rb"(?<!\S)@-@(?!\S)|(\S)-(\S)")
_ATAT = b"##AT##-##AT##"
_GENERATE_LINE = re.compile(r"^([HTD])-(\d+)\t")
# sacreBLEU's FakeSGMLDataset._convert_format: a line starting "<seg " loses its markup.
_SGM_SEGMENT = re.compile(r"<seg.*?>(.*)</seg>.*?")


class ScoringError(ValueError):
    """Input that cannot be scored (missing file, line count mismatch, incomplete output)."""


def read_bytes(path) -> bytes:
    if not os.path.isfile(path):
        raise ScoringError(f"{path}: no such file; pass an existing hypothesis/reference file")
    with open(path, "rb") as f:
        return f.read()


def perl_lines(data: bytes) -> List[bytes]:
    """Lines as ``while(<FH>) { chop; ... }`` sees them (chop drops the last byte, newline or not)."""
    return [line[:-1] for line in _split_on_newline(data)]


def _split_on_newline(data: bytes) -> List[bytes]:
    """Split after every b"\\n" only (perl's $/), keeping the terminators."""
    parts = data.split(b"\n")
    lines = [p + b"\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _split_compound(match) -> bytes:
    if match.group(1) is None:  # a whole-word "@-@"
        return _ATAT
    return match.group(1) + b" " + _ATAT + b" " + match.group(2)


def compound_split(data: bytes) -> bytes:
    """The ``##AT##-##AT##`` compound-split rule on text tokenized with or without ``-a``; every
    output line ends with a newline.

    Without ``-a`` (``Software-Entwickler``) it is byte for byte fairseq's
    ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``. With ``-a`` the tokenizer has already
    split the compound (``Software @-@ Entwickler``); fairseq's rule alone would split the ``@-@``
    once more into ``@ ##AT##-##AT## @``, two extra words that hypothesis and reference share,
    which inflates BLEU. Here a whole-word ``@-@`` becomes the single word ``##AT##-##AT##``, so
    both tokenizations give ``Software ##AT##-##AT## Entwickler``. A hyphen that ``-a`` leaves in
    place (one not between two letters or digits, e.g. ``3.-5``) gets fairseq's rule, as it does
    without ``-a``; on ``-a`` text without such hyphens the rule only renames words, and BLEU is
    the same with or without it. (Only fairseq's own quirk stays: without ``-a`` it leaves the
    ``b-c`` of ``a-b-c`` unsplit, since matches do not overlap.)
    """
    chomped = (line[:-1] if line.endswith(b"\n") else line for line in _split_on_newline(data))
    return b"".join(_COMPOUND.sub(_split_compound, line) + b"\n" for line in chomped)


@dataclass
class MultiBleu:
    correct: List[int]
    total: List[int]
    hyp_len: int
    ref_len: int

    @property
    def precisions(self) -> List[float]:
        return [c / t if t else 0.0 for c, t in zip(self.correct, self.total)]

    @property
    def brevity_penalty(self) -> float:
        if self.hyp_len < self.ref_len:
            return math.exp(1 - self.ref_len / self.hyp_len)
        return 1.0

    @property
    def bleu(self) -> float:
        """BLEU in [0, 1]; a zero precision contributes log = -9999999999, i.e. BLEU 0, as in the script."""
        logs = [math.log(p) if p else -9999999999 for p in self.precisions]
        return self.brevity_penalty * math.exp((logs[0] + logs[1] + logs[2] + logs[3]) / 4)

    def __str__(self):
        p = self.precisions
        return ("BLEU = %.2f, %.1f/%.1f/%.1f/%.1f (BP=%.3f, ratio=%.3f, hyp_len=%d, ref_len=%d)" % (
            100 * self.bleu, 100 * p[0], 100 * p[1], 100 * p[2], 100 * p[3],
            self.brevity_penalty, self.hyp_len / self.ref_len, self.hyp_len, self.ref_len))


def multi_bleu(hyp_lines: Sequence[bytes], ref_streams: Sequence[Sequence[bytes]],
               lowercase: bool = False) -> MultiBleu:
    """multi-bleu.perl's statistics for byte lines (already chopped); one stream per reference."""
    for i, stream in enumerate(ref_streams):
        if len(stream) != len(hyp_lines):
            raise ScoringError(f"reference {i} has {len(stream)} lines but the hypothesis has "
                               f"{len(hyp_lines)}; score files of the same test set")
    ids = {}

    def as_ids(line: bytes) -> str:
        words = line.lower().split() if lowercase else line.split()  # ASCII-only, like perl on bytes
        return " ".join(ids.setdefault(w, str(len(ids))) for w in words)

    bleu = sacrebleu.BLEU(tokenize="none", smooth_method="none", force=True)
    score = bleu.corpus_score([as_ids(h) for h in hyp_lines],
                              [[as_ids(r) for r in stream] for stream in ref_streams])
    stats = MultiBleu(list(score.counts), list(score.totals), score.sys_len, score.ref_len)
    if stats.ref_len == 0:
        raise ScoringError("the references are empty (0 words); multi-bleu.perl gives no score")
    if stats.hyp_len == 0:
        raise ScoringError("the hypothesis is empty (0 words); multi-bleu.perl dies on it "
                           "(division by zero in the brevity penalty)")
    return stats


def reference_paths(stem) -> List[str]:
    """multi-bleu.perl's reference lookup: STEM0, STEM1, ... then STEM itself (or STEM.ref0...)."""
    stem = str(stem)
    if not os.path.exists(stem) and not os.path.exists(stem + "0") and os.path.exists(stem + ".ref0"):
        stem += ".ref"
    paths = []
    while os.path.exists(f"{stem}{len(paths)}"):
        paths.append(f"{stem}{len(paths)}")
    if os.path.exists(stem):
        paths.append(stem)
    if not paths:
        raise ScoringError(f"{stem}: reference file not found (looked for {stem} and {stem}0, "
                           f"{stem}1, ...)")
    return paths


def multi_bleu_files(hyp_path, ref_stem, lowercase=False, compound=False) -> MultiBleu:
    """``multi-bleu.perl [-lc] REF < HYP``, after the compound-split rule on both sides if asked."""
    def load(path):
        data = read_bytes(path)
        return perl_lines(compound_split(data) if compound else data)

    refs = [load(p) for p in reference_paths(ref_stem)]
    return multi_bleu(load(hyp_path), refs, lowercase=lowercase)


def read_generate_output(path, hyp_field: str = "H"):
    """Hypotheses and references from ``fairseq-generate`` output, sorted by sentence id.

    Refuses files the run did not finish (no final ``Generate ... with beam=`` line) and files
    with missing or unpaired ids. With ``--nbest`` > 1 the first (best) hypothesis is kept.
    """
    text = read_bytes(path).decode("utf-8", errors="surrogateescape")
    lines = text.split("\n")
    if not any(line.startswith("Generate ") and " with beam=" in line for line in lines[-3:]):
        raise ScoringError(f"{path}: no final 'Generate ... with beam=...' line, so "
                           "fairseq-generate did not finish (or ran without targets); re-run it")
    hyps, refs = {}, {}
    for line in lines:
        match = _GENERATE_LINE.match(line)
        if not match:
            continue
        kind, sid = match.group(1), int(match.group(2))
        fields = line.split("\t")
        if kind == "T":
            refs[sid] = "\t".join(fields[1:])
        elif kind == hyp_field and sid not in hyps:
            hyps[sid] = "\t".join(fields[2:])
    if not refs:
        raise ScoringError(f"{path}: no T- (reference) lines; generate with a target side")
    expected = set(range(max(refs) + 1))
    for name, found in (("reference (T-)", refs), (f"hypothesis ({hyp_field}-)", hyps)):
        missing = sorted(expected - set(found))
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise ScoringError(f"{path}: {len(missing)} sentence id(s) without a {name} line: "
                               f"{shown}; the file is incomplete, re-run fairseq-generate")
    order = sorted(expected)
    return [hyps[i] for i in order], [refs[i] for i in order]


def detokenize(lines: Sequence[str], lang: Optional[str]) -> List[str]:
    """Moses-detokenize tokenized lines for ``lang`` (sacremoses); unchanged when lang is None."""
    if lang is None:
        return list(lines)
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [detok.detokenize(line.split()) for line in lines]


def sgm_to_text(path):
    """The <seg> contents of an SGML dev/test set (``.sgm``, or ``.sgm.gz``), one per line, exactly
    as sacreBLEU extracts them (``FakeSGMLDataset._convert_format``): every line starting with
    ``<seg `` loses its markup and has its whitespace trimmed and collapsed; the text is otherwise as
    released (no entity unescaping, no punctuation normalization), so the lines equal
    ``sacrebleu -t TEST -l PAIR --echo ref``."""
    path = str(path)
    if not os.path.isfile(path):
        raise ScoringError(f"{path}: no such file; pass an existing .sgm test set")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8-sig", newline="\n") as f:  # a BOM is not text
        for line in f:
            if line.startswith("<seg "):
                yield re.sub(r"\s+", " ", _SGM_SEGMENT.sub(r"\1", line).strip())


# A UTF-8 byte-order mark: not text of the first line, but sacreBLEU and chrF would count it as
# a character of the first word (a perfect hypothesis then scores 99.50 and 99.87).
BOM = "\ufeff"


def read_references(path) -> List[str]:
    """Reference lines as released: an ``.sgm`` set extracted like sacreBLEU, or plain text split
    on "\n" only (multipath-prepare writes the extracted test sets as DATA_BIN/test.raw.LANG),
    without a byte-order mark at the start of the file."""
    if str(path).endswith((".sgm", ".sgm.gz")):
        return list(sgm_to_text(path))
    lines = read_bytes(path).decode("utf-8", "surrogateescape").removeprefix(BOM).split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def sacrebleu_score(hyps: Sequence[str], ref_streams: Sequence[Sequence[str]]):
    """Default (13a, mixed case) corpus sacreBLEU on detokenized text: (score, signature)."""
    bleu = sacrebleu.BLEU()
    return bleu.corpus_score(list(hyps), [list(r) for r in ref_streams]), bleu.get_signature()


def chrf_score(hyps: Sequence[str], ref_streams: Sequence[Sequence[str]]):
    """sacreBLEU's default chrF (character 6-grams, beta 2, no word n-grams) on detokenized
    text: (score, signature)."""
    chrf = sacrebleu.CHRF()
    return chrf.corpus_score(list(hyps), [list(r) for r in ref_streams]), chrf.get_signature()


@dataclass
class BleuScores:
    """The scores of one system output: ``multi_bleu`` on the tokenized text (``str()`` of it
    is the line multi-bleu.perl prints), and corpus sacreBLEU and chrF (0-100) on the
    detokenized text, each with its signature."""
    multi_bleu: MultiBleu
    sacrebleu: float
    signature: str
    chrf: float
    chrf_signature: str

    @property
    def bleu(self) -> float:
        """Tokenized BLEU in 0-100, unrounded (multi-bleu.perl prints it with two decimals)."""
        return 100 * self.multi_bleu.bleu


def score_files(hyp_path, ref_stem, raw_refs: Optional[Sequence] = None, compound=False,
                lowercase=False, lang: Optional[str] = None) -> BleuScores:
    """Score a tokenized hypothesis file against the references multi-bleu.perl finds for
    ``ref_stem``; sacreBLEU as :func:`score_translations` computes it."""
    stats = multi_bleu_files(hyp_path, ref_stem, lowercase=lowercase, compound=compound)
    ref_streams = [read_references(p) for p in reference_paths(ref_stem)]
    return score_translations(stats, read_references(hyp_path), ref_streams, raw_refs, lang)


def score_generate_output(path, hyp_field: str = "H", raw_refs: Optional[Sequence] = None,
                          compound=False, lowercase=False, lang: Optional[str] = None) -> BleuScores:
    """Score fairseq-generate output (its T- references, hypotheses from ``hyp_field`` lines);
    sacreBLEU as :func:`score_translations` computes it."""
    hyps, refs = read_generate_output(path, hyp_field)
    hyp_bytes = "".join(h + "\n" for h in hyps).encode("utf-8", "surrogateescape")
    ref_bytes = "".join(r + "\n" for r in refs).encode("utf-8", "surrogateescape")
    if compound:
        hyp_bytes, ref_bytes = compound_split(hyp_bytes), compound_split(ref_bytes)
    stats = multi_bleu(perl_lines(hyp_bytes), [perl_lines(ref_bytes)], lowercase=lowercase)
    return score_translations(stats, hyps, [refs], raw_refs, lang)


def score_translations(stats: MultiBleu, hyps: Sequence[str], ref_streams: Sequence[Sequence[str]],
                       raw_refs: Optional[Sequence] = None, lang: Optional[str] = None) -> BleuScores:
    """Add sacreBLEU and chrF to the multi-bleu ``stats`` of tokenized ``hyps``: the hypotheses
    Moses-detokenized for ``lang`` (as given without it) against ``raw_refs``, the reference
    files as released, or without them against the tokenized ``ref_streams`` detokenized (a
    score not comparable to published sacreBLEU)."""
    if raw_refs:
        raw_streams = [read_references(p) for p in raw_refs]
        for path, stream in zip(raw_refs, raw_streams):
            if len(stream) != len(hyps):
                raise ScoringError(f"--raw-ref {path} has {len(stream)} references but there are "
                                   f"{len(hyps)} hypotheses; give the released test set they translate")
    else:
        raw_streams = [detokenize(r, lang) for r in ref_streams]
    detokenized = detokenize(hyps, lang)
    sacre, signature = sacrebleu_score(detokenized, raw_streams)
    chrf, chrf_signature = chrf_score(detokenized, raw_streams)
    return BleuScores(stats, sacre.score, str(signature), chrf.score, str(chrf_signature))
