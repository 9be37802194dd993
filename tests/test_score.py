"""multipath-score prints exactly the line of the real multi-bleu.perl, sacreBLEU against the
references as released (extracted from .sgm like sacreBLEU does), and refuses bad input."""
import io
import random
import shutil
import subprocess

import pytest
import sacrebleu
from sacrebleu.dataset.fake_sgml import FakeSGMLDataset
from sacremoses import MosesPunctNormalizer, MosesTokenizer

from conftest import ROOT, run_cli, script_env
from helpers import in_process

from multipath_nmt import scoring
from multipath_nmt.cli.score import build_parser, score

MULTI_BLEU = ROOT / "tests" / "fixtures" / "multi-bleu.perl"
needs_perl = pytest.mark.skipif(shutil.which("perl") is None, reason="perl not installed")

# (hypothesis file content, [reference file contents]) as bytes, exactly as written to disk.
CASES = {
    "identical": (b"a b c d e\nthe cat sat on the mat .\n", [b"a b c d e\nthe cat sat on the mat .\n"]),
    "brevity_penalty": (b"the cat\non the mat\n", [b"the cat sat\non the mat today , dear\n"]),
    "empty_hypothesis_lines": (b"\nthe cat sat on the mat\n\n", [b"a b\nthe cat sat on the mat\nc d e\n"]),
    "zero_4gram_matches": (b"a b c x d e f\n", [b"a b c d e f g\n"]),
    "zero_all_matches": (b"x y z\n", [b"a b c\n"]),
    "clipping": (b"the the the the the the the\n", [b"the cat is on the mat\n"]),
    "repeated_spaces_tabs": (b"  the   cat\tsat  on \t the mat  \n", [b"the cat  sat on the   mat\n"]),
    "longer_than_reference": (b"the cat sat on the red mat in the house\n", [b"the cat sat on the mat\n"]),
    "multiple_refs_closest_tie": (b"a b c d\ne f g h i\n",
                                  [b"a b c\ne f g h i j\n", b"a b c d e\ne f g h\n"]),
    "unicode": ("Grüße aus Köln , „ sagte “ er – ja\nÄrger über 5 € — naïve café\n".encode(),
                ["Grüße aus Köln , „ sagte “ sie – ja\nÄrger über 5 € – naive café\n".encode()]),
    # U+00A0 (no-break space) and U+3000 are not whitespace for perl on bytes: they stay inside words.
    "unicode_whitespace": ("a\u00a0b c\u3000d e\n".encode(), ["a\u00a0b c d e\n".encode()]),
    "no_final_newline": (b"the cat sat on the mat\nit is here", [b"the cat sat on the mat\nit is here"]),
    "crlf": (b"the cat sat\r\non the mat\r\n", [b"the cat sat\non the mat\n"]),
    "hyphens_without_split": (b"a well @-@ known rich-text format\n", [b"a well-known rich-text format\n"]),
}


def _write(folder, hyp, refs):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hyp").write_bytes(hyp)
    if len(refs) == 1:
        (folder / "ref").write_bytes(refs[0])
    else:
        for i, ref in enumerate(refs):
            (folder / f"ref{i}").write_bytes(ref)
    return folder / "hyp", folder / "ref"


# fairseq's scripts/compound_split_bleu.sh, for text tokenized without -a
FAIRSEQ_SPLIT = r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"
# the same in one pass, with a whole-word "@-@" (tokenizer.perl -a) turned into one ##AT##-##AT## word
BOTH_SPLIT = r"s{(?<!\S)\@-\@(?!\S)|(\S)-(\S)}{defined $1 ? qq{$1 ##AT##-##AT## $2} : q{##AT##-##AT##}}ge"


def _perl_split(data, expression):
    return subprocess.run(["perl", "-ple", expression], input=data, capture_output=True, check=True).stdout


def _perl(hyp, ref, *flags, compound=False):
    """multi-bleu.perl [-lc] ref < hyp, after a compound-split perl one-liner if asked: ``compound``
    is FAIRSEQ_SPLIT, BOTH_SPLIT, or True for FAIRSEQ_SPLIT."""
    if compound:
        expression = FAIRSEQ_SPLIT if compound is True else compound
        refs = [p for p in sorted(ref.parent.glob(ref.name + "*"))]
        for path in [hyp, *refs]:
            path.write_bytes(_perl_split(path.read_bytes(), expression))
    with open(hyp, "rb") as stdin:
        proc = subprocess.run(["perl", MULTI_BLEU, *flags, ref], stdin=stdin, capture_output=True)
    return proc


def _ours(hyp, ref, *flags):
    args = build_parser().parse_args(["--sys", str(hyp), "--ref", str(ref), *flags])
    out = io.StringIO()
    score(args, out=out)
    return out.getvalue().splitlines()


@needs_perl
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("lowercase", [False, True])
def test_first_line_equals_multi_bleu_perl(tmp_path, name, lowercase):
    hyp, ref = _write(tmp_path, *CASES[name])
    flags = ["-lc"] if lowercase else []
    expected = _perl(hyp, ref, *flags)
    assert expected.returncode == 0, expected.stderr
    assert _ours(hyp, ref, *flags)[0] == expected.stdout.decode().rstrip("\n")


@needs_perl
@pytest.mark.parametrize("name", ["hyphens_without_split", "unicode", "identical", "multiple_refs_closest_tie",
                                  "crlf", "no_final_newline", "empty_hypothesis_lines"])
def test_compound_split_equals_perl_pipeline(tmp_path, name):
    hyp, ref = _write(tmp_path / "ours", *CASES[name])
    ours = _ours(hyp, ref, "--compound-split")[0]
    hyp, ref = _write(tmp_path / "perl", *CASES[name])
    assert ours == _perl(hyp, ref, compound=BOTH_SPLIT).stdout.decode().rstrip("\n")
    texts = [CASES[name][0], *CASES[name][1]]
    if not any(b"@-@" in t for t in texts):  # text tokenized without -a: exactly fairseq's script
        hyp, ref = _write(tmp_path / "fairseq", *CASES[name])
        assert ours == _perl(hyp, ref, compound=FAIRSEQ_SPLIT).stdout.decode().rstrip("\n")


def test_compound_split_rule():
    # Matches do not overlap: in "a-b-c" the "b" is consumed by the first match (as in perl).
    assert scoring.compound_split(b"a well-known rich-text-format a-b-c - x\n-y a-\nz") == (
        b"a well ##AT##-##AT## known rich ##AT##-##AT## text ##AT##-##AT## format "
        b"a ##AT##-##AT## b-c - x\n-y a-\nz\n")
    # tokenizer.perl -a's hyphen is already a word: it becomes one ##AT##-##AT## word, not three
    assert scoring.compound_split(b"Software @-@ Entwickler\n@-@ a @-@\tb\nx@-@y 3.-5") == (
        b"Software ##AT##-##AT## Entwickler\n##AT##-##AT## a ##AT##-##AT##\tb\n"
        b"x@ ##AT##-##AT## @y 3. ##AT##-##AT## 5\n")


# Raw German with hyphenated compounds (none with a one-letter middle part: fairseq's rule leaves
# the "b-c" of "a-b-c" unsplit, -a does not).
COMPOUND_REFS = ["Der Software-Entwickler nutzt eine state-of-the-art E-Mail-Adresse.",
                 "Die U-Bahn-Station liegt 3.-5. Mai im Nord-Süd-Tunnel, sagte der Ex-Minister.",
                 "Das Open-Source-Projekt hat 1-2 Mitarbeiter und kein Know-how."]
COMPOUND_HYPS = ["Der Software-Entwickler nutzt eine moderne E-Mail-Adresse.",
                 "Die Bahn-Station liegt im Nord-Tunnel, sagte der Minister.",
                 "Das Open-Source-Projekt hat 2 Mitarbeiter und wenig Know-how."]


@needs_perl
def test_compound_split_on_both_tokenizations(tmp_path):
    """The same German text tokenized with and without -a scores the same after --compound-split:
    without -a exactly as fairseq's compound_split_bleu.sh; with -a as multi-bleu.perl after the
    rule that turns each @-@ word into one ##AT##-##AT## word, which gives the score of the
    tokenized text itself once the hyphens -a leaves ("3.-5.") are gone; and not as fairseq's rule
    on -a text, which splits each @-@ again into @ ##AT##-##AT## @ and adds matching words."""
    normalizer, tokenizer = MosesPunctNormalizer("de"), MosesTokenizer("de")
    to_file = lambda lines: "".join(line + "\n" for line in lines).encode()  # noqa: E731
    lines, texts = {}, {}
    for name, aggressive in (("plain", False), ("a", True)):
        tok = [[tokenizer.tokenize(normalizer.normalize(s), escape=True, aggressive_dash_splits=aggressive,
                                   return_str=True) for s in side] for side in (COMPOUND_HYPS, COMPOUND_REFS)]
        texts[name] = [to_file(side) for side in tok]
        hyp, ref = _write(tmp_path / name, *texts[name][:1], texts[name][1:])
        lines[name] = _ours(hyp, ref, "--compound-split")[0]
    assert b"@-@" in texts["a"][1] and b"@-@" not in texts["plain"][1]
    assert [scoring.compound_split(t) for t in texts["a"]] == [scoring.compound_split(t) for t in texts["plain"]]
    assert lines["a"] == lines["plain"]
    assert lines["plain"] == _perl(*_write(tmp_path / "fs", texts["plain"][0], texts["plain"][1:]),
                                   compound=FAIRSEQ_SPLIT).stdout.decode().rstrip("\n")
    assert lines["a"] == _perl(*_write(tmp_path / "both", texts["a"][0], texts["a"][1:]),
                               compound=BOTH_SPLIT).stdout.decode().rstrip("\n")
    without = [t.replace(b"3.-5 .", b"3 .") for t in texts["a"]]   # the one hyphen -a leaves
    hyp, ref = _write(tmp_path / "a-only", without[0], without[1:])
    assert _ours(hyp, ref, "--compound-split")[0] == _perl(hyp, ref).stdout.decode().rstrip("\n")
    twice = _perl(*_write(tmp_path / "twice", texts["a"][0], texts["a"][1:]), compound=FAIRSEQ_SPLIT)
    assert float(twice.stdout.split()[2][:-1]) > float(lines["a"].split()[2][:-1])  # the inflated score


@needs_perl
@pytest.mark.parametrize("seed", range(12))
def test_random_corpora_equal_multi_bleu_perl(tmp_path, seed):
    """Random near-miss translations over a small vocabulary: every count and rounding path."""
    rng = random.Random(seed)
    vocab = ["the", "a", "cat", "Cat", "mat", "sat", "on", ",", ".", "über", "x-y", "&amp;"]
    n_refs = rng.choice([1, 1, 2, 3])
    refs = [[] for _ in range(n_refs)]
    hyps = []
    for _ in range(rng.randint(1, 25)):
        base = [rng.choice(vocab) for _ in range(rng.randint(1, 15))]
        for stream in refs:
            stream.append(" ".join(w if rng.random() < 0.8 else rng.choice(vocab) for w in base))
        hyp = [w for w in base if rng.random() < 0.9] + [rng.choice(vocab)] * rng.randint(0, 2)
        hyps.append(" ".join(w if rng.random() < 0.75 else rng.choice(vocab) for w in hyp))
    if not any(hyps):
        hyps[0] = "the"
    to_file = lambda lines: "".join(line + "\n" for line in lines).encode()  # noqa: E731
    hyp, ref = _write(tmp_path, to_file(hyps), [to_file(s) for s in refs])
    assert _ours(hyp, ref)[0] == _perl(hyp, ref).stdout.decode().rstrip("\n")
    hyp, ref = _write(tmp_path / "cs", to_file(hyps), [to_file(s) for s in refs])
    ours = _ours(hyp, ref, "--compound-split")[0]
    assert ours == _perl(hyp, ref, compound=True).stdout.decode().rstrip("\n")


@needs_perl
def test_real_german_text_equals_multi_bleu_perl(multi30k, tmp_path):
    """Multi30k test_2016 German, Moses-tokenized with -a (@-@), against two perturbed 'systems'."""
    import gzip

    from sacremoses import MosesTokenizer

    tokenize = MosesTokenizer(lang="de").tokenize
    with gzip.open(multi30k / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        refs = [tokenize(line.strip(), aggressive_dash_splits=True, return_str=True) for line in f]
    rng = random.Random(0)
    vocab = sorted({w for r in refs[:50] for w in r.split()})

    def perturb(line):  # drop, replace and swap words
        words = [w if rng.random() > 0.1 else rng.choice(vocab) for w in line.split() if rng.random() > 0.1]
        if len(words) > 3 and rng.random() < 0.3:
            i = rng.randrange(len(words) - 1)
            words[i], words[i + 1] = words[i + 1], words[i]
        return " ".join(words)

    hyps = [perturb(r) for r in refs]
    second_ref = [perturb(r) for r in refs]
    to_file = lambda lines: "".join(line + "\n" for line in lines).encode()  # noqa: E731
    lines = {}
    for folder, ref_streams in (("one", [refs]), ("two", [refs, second_ref])):
        for flags in ([], ["--compound-split"]):
            hyp, ref = _write(tmp_path / folder / "-".join(flags), to_file(hyps), [to_file(r) for r in ref_streams])
            ours = _ours(hyp, ref, *flags)[0]
            assert ours == _perl(hyp, ref, compound=BOTH_SPLIT if flags else False).stdout.decode().rstrip("\n")
            lines[folder, bool(flags)] = ours
        # on -a text the rule only renames the @-@ words (every hyphen here is one), so BLEU is unchanged
        assert lines[folder, True] == lines[folder, False]


def test_exact_numbers_and_sacrebleu_line(tmp_path):
    hyp, ref = _write(tmp_path, b"the cat sat on the mat\n", [b"the cat sat on the red mat\n"])
    first, second, third = _ours(hyp, ref)
    # p = 6/6, 4/5, 3/4, 2/3; BP = exp(1 - 7/6); BLEU = BP * exp(mean(log p))
    assert first == "BLEU = 67.32, 100.0/80.0/75.0/66.7 (BP=0.846, ratio=0.857, hyp_len=6, ref_len=7)"
    assert second.startswith("sacreBLEU = 67.32 | nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|")
    # sacreBLEU's default chrF: character 1- to 6-gram F-score with beta 2
    assert third == (f"chrF2 = 73.07 | nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|"
                     f"version:{sacrebleu.__version__}")


def test_sacrebleu_detokenizes_for_lang(tmp_path):
    hyp, ref = _write(tmp_path, b"Das ist &quot; gut &quot; .\n", [b'Das ist " gut " .\n'])
    args = build_parser().parse_args(["--sys", str(hyp), "--ref", str(ref), "--lang", "de"])
    out = io.StringIO()
    score(args, out=out)
    assert out.getvalue().splitlines()[1].startswith("sacreBLEU = 100.00 |")
    assert scoring.detokenize(["a well @-@ known &quot;x&quot; ."], "en") == ['a well-known "x".']


# A German newstest-like reference set as released: an entity, curly quotes, a non-breaking space,
# a tab and padding, all kept by sacreBLEU's extraction (and changed by Moses tokenization).
RAW_REFS = ["AT&amp;T meldet \u201eRekordgewinne\u201c f\u00fcr 2014.", "Der Preis stieg um 5\u00a0%  auf 3,50 \u20ac.",
            "Sie sagte: \u201aNein\u2018 \u2013 und ging.", "  Ein  ganz\tnormaler Satz.  "]
HYPS_TOKENIZED = ["AT &amp; T meldet &quot; Rekordgewinne &quot; für 2014 .", "Der Preis stieg um 5 % auf 3,50 € .",
                  "Sie sagte : &apos; Nein &apos; - und ging .", "Ein ganz normaler Satz ."]


def _released_sgm(path):
    segs = "".join(f'<seg id="{i}">{line}</seg>\n' for i, line in enumerate(RAW_REFS, 1))
    path.write_text(f'<refset setid="newstest2014" srclang="any" trglang="de">\n<doc sysid="ref" docid="d1" '
                    f'genre="news" origlang="en">\n<p>\n{segs}</p>\n</doc>\n</refset>\n', encoding="utf-8")
    return path


def test_sacrebleu_uses_the_released_references(tmp_path):
    """Line 2 with --raw-ref equals sacreBLEU on sacreBLEU's own extraction of the .sgm (what
    ``sacrebleu -t wmt14/full -l en-de`` scores against), from the .sgm or from test.raw.de; the
    tokenized line 1 uses the pipeline-tokenized references (T- lines), as before."""
    sgm = _released_sgm(tmp_path / "newstest2014-deen-ref.de.sgm")
    extracted = tmp_path / "sacrebleu.de"
    FakeSGMLDataset._convert_format(FakeSGMLDataset, str(sgm), str(extracted))
    sacrebleu_refs = extracted.read_text(encoding="utf-8").split("\n")[:-1]
    assert sacrebleu_refs[0] == "AT&amp;T meldet \u201eRekordgewinne\u201c f\u00fcr 2014."   # as released
    (tmp_path / "test.raw.de").write_text("".join(line + "\n" for line in scoring.sgm_to_text(sgm)), encoding="utf-8")

    normalizer, tokenizer = MosesPunctNormalizer("de"), MosesTokenizer("de")
    tokenized_refs = [tokenizer.tokenize(normalizer.normalize(r), escape=True, aggressive_dash_splits=True,
                                         return_str=True) for r in RAW_REFS]
    gen = tmp_path / "gen.out"
    gen.write_text("".join(f"T-{i}\t{r}\nH-{i}\t-0.3\t{h}\n" for i, (r, h) in enumerate(zip(tokenized_refs, HYPS_TOKENIZED)))
                   + "Generate test with beam=4: BLEU4 = 1.00\n", encoding="utf-8")
    expected = sacrebleu.corpus_bleu(scoring.detokenize(HYPS_TOKENIZED, "de"), [sacrebleu_refs])
    expected_chrf = sacrebleu.corpus_chrf(scoring.detokenize(HYPS_TOKENIZED, "de"), [sacrebleu_refs])
    lines = {}
    for raw in (sgm, tmp_path / "test.raw.de", None):
        argv = ["--generate-output", str(gen), "--compound-split", "--lang", "de"]
        argv += ["--raw-ref", str(raw)] if raw else []
        out = io.StringIO()
        stats = score(build_parser().parse_args(argv), out=out)
        lines[raw] = out.getvalue().splitlines()
        assert stats.ref_len == sum(len(scoring.compound_split(r.encode()).split()) for r in tokenized_refs)
    for raw in (sgm, tmp_path / "test.raw.de"):
        assert lines[raw][1] == (f"sacreBLEU = {expected.score:.2f} | nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|"
                                 f"version:{sacrebleu.__version__} | references as released (--raw-ref), "
                                 "hypotheses Moses-detokenized for 'de'")
        assert lines[raw][0] == lines[None][0]
        assert lines[raw][2].startswith(f"chrF2 = {expected_chrf.score:.2f} | nrefs:1|")
    assert "not comparable to published sacreBLEU, pass --raw-ref" in lines[None][1]
    assert lines[None][1].split(" | ")[0] != lines[sgm][1].split(" | ")[0]  # the altered references score otherwise

    with pytest.raises(scoring.ScoringError, match="--raw-ref .*short.de has 1 references but there are 4 hypotheses"):
        (tmp_path / "short.de").write_text("eins\n", encoding="utf-8")
        score(build_parser().parse_args(["--generate-output", str(gen), "--raw-ref", str(tmp_path / "short.de")]),
              out=io.StringIO())


def _generate_output(ids, finished=True, empty_hyp_id=None):
    lines = []
    for i in ids:  # fairseq-generate prints sentences in batch order, not id order
        hyp = "" if i == empty_hyp_id else f"word{i} rich-text"
        lines += [f"S-{i}\tsrc{i}", f"T-{i}\tword{i} rich-text", f"H-{i}\t-0.5\t{hyp}",
                  f"D-{i}\t-0.5\t{hyp}", f"P-{i}\t-0.1 -0.2"]
    if finished:
        lines.append("Generate test with beam=4: BLEU4 = 100.00, 100.0/100.0/100.0/100.0 (BP=1.000)")
    return "\n".join(lines) + "\n"


def test_generate_output_sorted_by_id_and_scored(tmp_path):
    gen = tmp_path / "gen.out"
    gen.write_text(_generate_output([2, 0, 3, 1], empty_hyp_id=3))
    hyps, refs = scoring.read_generate_output(gen)
    assert refs == [f"word{i} rich-text" for i in range(4)]
    assert hyps == ["word0 rich-text", "word1 rich-text", "word2 rich-text", ""]
    out = io.StringIO()
    stats = score(build_parser().parse_args(["--generate-output", str(gen), "--compound-split"]), out=out)
    assert stats.hyp_len == 12 and stats.ref_len == 16  # 4 words per line after ##AT## splitting
    gen.write_text(_generate_output([1, 0]).replace("D-1\t-0.5\tword1 rich-text", "D-1\t-0.5\tdetok"))
    assert scoring.read_generate_output(gen, hyp_field="D")[0] == ["word0 rich-text", "detok"]


@pytest.mark.parametrize("content,message", [
    (_generate_output([0, 1, 2], finished=False), "did not finish"),
    (_generate_output([0, 2]), "without a reference (T-) line: 1"),
    (_generate_output([0, 1]).replace("H-1\t", "X-1\t"), "without a hypothesis (H-) line: 1"),
])
def test_incomplete_generate_output_refused(tmp_path, content, message):
    gen = tmp_path / "gen.out"
    gen.write_text(content)
    with pytest.raises(scoring.ScoringError, match=message.replace("(", r"\(").replace(")", r"\)")):
        scoring.read_generate_output(gen)


@pytest.mark.parametrize("hyp,ref,message", [
    (b"a b\n", b"a b\nc d\n", "reference 0 has 2 lines but the hypothesis has 1"),
    (b"\n\n", b"a\nb\n", "hypothesis is empty"),
    (b"a\nb\n", b"\n\n", "references are empty"),
])
def test_bad_input_refused(tmp_path, hyp, ref, message):
    hyp_path, ref_path = _write(tmp_path, hyp, [ref])
    with pytest.raises(scoring.ScoringError, match=message):
        _ours(hyp_path, ref_path)


@needs_perl
def test_perl_also_fails_on_empty_hypothesis(tmp_path):
    hyp, ref = _write(tmp_path, b"\n\n", [b"a\nb\n"])
    assert _perl(hyp, ref).returncode != 0


def test_console_script_errors(tmp_path):
    proc = in_process.console_script("multipath-score", ["--sys", tmp_path / "nope", "--ref",
                                                         tmp_path / "nope"])
    assert proc.returncode != 0 and proc.stdout == ""
    assert "nope: reference file not found" in proc.stderr
    hyp, ref = _write(tmp_path, b"a b c d\n", [b"a b c d\n"])
    with pytest.raises(scoring.ScoringError, match="nope: no such file"):
        _ours(tmp_path / "nope", ref)


@pytest.mark.process  # the script passes its arguments to $PYTHON's multipath_nmt.cli.score
def test_score_sh_scores(tmp_path):
    hyp, ref = _write(tmp_path, b"a b c d\n", [b"a b c d\n"])
    proc = run_cli(["bash", ROOT / "scripts" / "score.sh", "--sys", hyp, "--ref", ref],
                   env=script_env())
    assert proc.stdout.splitlines()[0] == \
        "BLEU = 100.00, 100.0/100.0/100.0/100.0 (BP=1.000, ratio=1.000, hyp_len=4, ref_len=4)"


def test_a_byte_order_mark_at_the_start_of_a_raw_reference_costs_nothing(tmp_path):
    """A released reference file saved with a UTF-8 byte-order mark (some editors and Windows
    tools write one) scores a perfect hypothesis 100 with --raw-ref, as without the mark: the
    mark is not text of the first sentence (it was sacreBLEU 99.50, chrF2 99.87)."""
    refs = ["Das ist gut.", 'Sie sagte: "Nein".']
    tokenized = ["Das ist gut .", "Sie sagte : &quot; Nein &quot; ."]
    gen = tmp_path / "gen.out"
    gen.write_text("".join(f"T-{i}\t{t}\nH-{i}\t-0.1\t{t}\n" for i, t in enumerate(tokenized))
                   + "Generate test with beam=4: BLEU4 = 100.00\n", encoding="utf-8")
    raw = tmp_path / "test.raw.de"
    raw.write_bytes(b"\xef\xbb\xbf" + "".join(r + "\n" for r in refs).encode())
    assert scoring.read_references(raw) == refs
    scores = scoring.score_generate_output(gen, raw_refs=[raw], lang="de")
    assert (round(scores.sacrebleu, 2), round(scores.chrf, 2)) == (100.0, 100.0)
    # the same through --sys/--ref: the hypothesis file with a mark as well
    hyp = tmp_path / "hyp"
    hyp.write_bytes(b"\xef\xbb\xbf" + "".join(t + "\n" for t in tokenized).encode())
    (tmp_path / "ref").write_text("".join(t + "\n" for t in tokenized), encoding="utf-8")
    scores = scoring.score_files(hyp, tmp_path / "ref", raw_refs=[raw], lang="de")
    assert (round(scores.sacrebleu, 2), round(scores.chrf, 2)) == (100.0, 100.0)


def test_multipath_prepare_reads_its_text_without_a_byte_order_mark(tmp_path):
    """multipath-prepare reads every input (plain or gzipped) without a leading byte-order mark,
    so that the references it writes as DATA_BIN/test.raw.LANG have none for other scorers
    either; a mark later in a line is text and stays."""
    import gzip

    from multipath_nmt.pipeline.stages import read_lines

    text = "\ufeffDas ist gut.\nSie sagte: \ufeffNein.\n"
    (tmp_path / "test.de").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "test.de.gz", "wt", encoding="utf-8") as f:
        f.write(text)
    for name in ("test.de", "test.de.gz"):
        assert list(read_lines(tmp_path / name)) == ["Das ist gut.", "Sie sagte: \ufeffNein."]


@pytest.mark.slow
def test_multipath_prepare_writes_raw_references_without_a_byte_order_mark(tmp_path):
    from multipath_nmt.pipeline.synthetic import generate

    for split, pairs in generate({"train": 150, "valid": 20, "test": 20}, seed=5).items():
        for column, lang in enumerate(("en", "de")):
            (tmp_path / f"{split}.{lang}").write_bytes(
                b"\xef\xbb\xbf" + "".join(p[column] + "\n" for p in pairs).encode())
    out = tmp_path / "bin"
    proc = in_process.console_script("multipath-prepare", [
        "corpus", "--src", "en", "--tgt", "de", "--bpe-merges", "60", "--workers", "1", "--out",
        out, *[arg for s in ("train", "valid", "test") for arg in (f"--{s}", tmp_path / s)]])
    assert proc.returncode == 0, proc.stderr
    expected = "".join(p[1] + "\n" for p in generate({"train": 150, "valid": 20, "test": 20},
                                                     seed=5)["test"])
    assert (out / "test.raw.de").read_text(encoding="utf-8") == expected
