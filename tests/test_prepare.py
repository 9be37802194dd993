"""multipath-prepare: Moses/BPE/clean semantics, the WMT download and --raw-dir paths against a local
HTTP server, restartable stages, bad-input errors, and prepare-corpus.sh on Multi30k."""
import functools
import gzip
import http.server
import io
import shutil
import tarfile
import threading
from pathlib import Path

import pytest
from conftest import ROOT, run_cli
from fairseq.data import Dictionary, data_utils
from sacremoses import MosesPunctNormalizer, MosesTokenizer

from multipath_nmt.cli.prepare import cli_main
from multipath_nmt.pipeline import prepare
from multipath_nmt.pipeline.prepare import (
    PrepareError, clean_pair, extract_members, mirror_url, moses_tokenize, prepare_corpus, prepare_wmt,
    sgm_to_text,
)
from multipath_nmt.pipeline.synthetic import generate
from multipath_nmt.pipeline.wmt import ARCHIVES, PAIRS, TASKS


# ------------------------------------------------------------------------------- unit level

def tok(line, lang="en"):
    return moses_tokenize(line, MosesPunctNormalizer(lang), MosesTokenizer(lang))


@pytest.mark.parametrize("raw, expected", [
    # tokenizer.perl -a: hyphens between word characters become @-@
    ("A state-of-the-art system.", "A state @-@ of @-@ the @-@ art system ."),
    ("Der Software-Entwickler kommt.", "Der Software @-@ Entwickler kommt ."),
    # default escaping of & < > " ' | [ ]
    ('AT&T said "<b>" [x] a|b', "AT &amp; T said &quot; &lt; b &gt; &quot; &#91; x &#93; a &#124; b"),
    ("it's Anna's", "it &apos;s Anna &apos;s"),
    # digits keep their separators; a final period is split off
    ("They sold 1,250 cars for 3.5 million.", "They sold 1,250 cars for 3.5 million ."),
    # normalize-punctuation.perl: curly quotes to ASCII, and for English '",' becomes ',"'
    ("\u201cHello\u201d, she said.", "&quot; Hello , &quot; she said ."),
    # remove-non-printing-char.perl: a zero-width space becomes a space, not a glue
    ("zero\u200bwidth", "zero width"),
])
def test_moses_preprocessing_matches_the_perl_scripts(raw, expected):
    assert tok(raw) == expected


def test_german_number_normalization():
    assert tok("Sie verkauften 1.250 Autos.", "de") == "Sie verkauften 1.250 Autos ."


def test_parallel_tokenization_keeps_the_line_order(tmp_path):
    lines = [f"Line {i}: state-of-the-art & \u201cquoted\u201d." for i in range(600)]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    for workers in (1, 3):
        prepare.map_file(tmp_path / "in.en", tmp_path / f"out{workers}", prepare._tokenize_chunk,
                         prepare._init_tokenizer, ("en",), workers, "tokenize", chunk_lines=50)
    expected = [tok(line) for line in lines]
    assert (tmp_path / "out3").read_text(encoding="utf-8").splitlines() == expected
    assert (tmp_path / "out1").read_text(encoding="utf-8").splitlines() == expected


@pytest.mark.parametrize("a, b, expected", [
    ("a b c", "x y z", ("a b c", "x y z")),
    ("  a   b ", "x\ty", ("a b", "x y")),                 # whitespace collapsed and trimmed
    ("a b c d", "x y", None),                             # ratio 2 > 1.5
    ("a b c", "x y", ("a b c", "x y")),                   # ratio exactly 1.5 is kept
    ("", "x", None),                                      # empty side
    ("a | b", "x y", ("a b", "x y")),                     # pipes are removed before counting
    (" ".join(["w"] * 251), " ".join(["v"] * 250), None),  # more than 250 tokens
    (" ".join(["w"] * 250), " ".join(["v"] * 250), (" ".join(["w"] * 250), " ".join(["v"] * 250))),
    ("a " + "x" * 1001, "b c", None),                     # a word longer than 1000 characters
])
def test_clean_pair_follows_clean_corpus_n(a, b, expected):
    assert clean_pair(a, b) == expected


def test_sgm_to_text_like_input_from_sgm(tmp_path):
    sgm = tmp_path / "t.sgm"
    sgm.write_text('<srcset setid="x">\n<doc docid="d">\n<seg id="1"> AT&amp;T  earns &lt;1% </seg>\n'
                   '<seg id="2">split\nover lines</seg>\n<seg id="3">&#8364;5 &quot;q&quot;</seg>\n</doc>\n',
                   encoding="utf-8")
    assert list(sgm_to_text(sgm)) == ["AT&T earns <1%", "split over lines", '\u20ac5 "q"']


def test_run_stage_skips_same_parameters_and_rebuilds_changed_ones(tmp_path):
    builds = []

    def build(tmp):
        builds.append(tmp.name)
        (tmp / "f").write_text(str(len(builds)))

    stage = tmp_path / "bpe"
    for merges in (10, 10, 20):
        prepare.run_stage(stage, "bpe", {"merges": merges}, build)
    assert builds == ["bpe.partial", "bpe.partial"] and (stage / "f").read_text() == "2"
    assert (stage / ".done").read_text() == '{"merges": 20}' and not (tmp_path / "bpe.partial").exists()


def test_mirror_replaces_the_host():
    url = ARCHIVES["europarl_v7"].url
    assert mirror_url(url, "http://127.0.0.1:9/m/") == "http://127.0.0.1:9/m/wmt13/training-parallel-europarl-v7.tgz"
    assert mirror_url(url, None) == url


def test_task_table_has_the_twelve_directions():
    assert sorted(TASKS) == sorted(f"{y}_{a}_{b}" for y, xx in (
        ("wmt14", "de"), ("wmt14", "fr"), ("wmt17", "de"), ("wmt17", "fi"), ("wmt17", "lv"), ("wmt17", "ru"))
        for a, b in (("en", xx), (xx, "en")))
    for task, (pair, src, tgt) in TASKS.items():
        assert {src, tgt} == set(pair.langs) and pair.archives()
        assert all(name in ARCHIVES for name in pair.archives())
    assert TASKS["wmt14_de_en"][0] is TASKS["wmt14_en_de"][0]  # both directions share one pair
    assert [e.en for e in PAIRS["wmt14_en_fr"].valid] == ["dev/newstest2012-src.en.sgm", "dev/newstest2013-src.en.sgm"]


def test_extract_reads_gzipped_and_bitext_members(tmp_path):
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as tar:
        add_member(tar, "giga-fren.release2.fixed.en.gz", gzip.compress(b"one\ntwo\n"))
        add_member(tar, "wiki/fi-en/titles.fi-en", "Helsinki ||| Helsinki\nkissa ||| cat\n".encode())
    extract_members(archive, ["giga-fren.release2.fixed.en.gz", "wiki/fi-en/titles.fi-en"], tmp_path / "x")
    assert list(prepare.read_lines(tmp_path / "x/giga-fren.release2.fixed.en.gz")) == ["one", "two"]
    corpus = PAIRS["wmt17_en_fi"].train[1]
    (tmp_path / "x" / corpus.archive / "wiki/fi-en").mkdir(parents=True)
    shutil.copy(tmp_path / "x/wiki/fi-en/titles.fi-en", tmp_path / "x" / corpus.archive / corpus.member)
    assert list(prepare._corpus_lines(tmp_path / "x", corpus, "en")) == ["Helsinki", "cat"]
    assert list(prepare._corpus_lines(tmp_path / "x", corpus, "fi")) == ["Helsinki", "kissa"]
    with pytest.raises(PrepareError, match="has no member missing.txt"):
        extract_members(archive, ["missing.txt"], tmp_path / "y")


# ------------------------------------------------------------------ a fake statmt.org release

N_TRAIN, N_VALID, N_TEST = 150, 40, 50


def add_member(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def sgm(lines, lang):
    segs = "".join(f'<seg id="{i}">{line}</seg>\n' for i, line in enumerate(lines, 1))
    return f'<refset setid="x" srclang="any" trglang="{lang}">\n<doc docid="d" genre="news">\n{segs}</doc>\n</refset>\n'.encode()


@pytest.fixture(scope="module")
def fake_release(tmp_path_factory):
    """statmt.org-like archives for WMT14 En-De under their URL paths (mirror root) and flat (raw dir)."""
    root = tmp_path_factory.mktemp("statmt")
    pair = PAIRS["wmt14_en_de"]
    corpus = generate({"train": N_TRAIN * len(pair.train), "valid": N_VALID, "test": N_TEST}, seed=7)
    members = prepare._pair_members(pair)
    contents = {}
    for i, c in enumerate(pair.train):
        pairs = corpus["train"][i * N_TRAIN:(i + 1) * N_TRAIN]
        for column, lang in enumerate(pair.langs):
            contents[c.archive, c.member.format(lang=lang)] = "".join(p[column] + "\n" for p in pairs).encode()
    # an entity in the SGML markup that must come out unescaped
    test_pairs = [("AT&amp;T grows by 3.5 percent.", "AT&amp;T wächst um 3,5 Prozent.")] + corpus["test"][1:]
    for e, pairs in ((pair.valid[0], corpus["valid"]), (pair.test, test_pairs)):
        contents[e.archive, e.en] = sgm([p[0] for p in pairs], "en")
        contents[e.archive, e.xx] = sgm([p[1] for p in pairs], "de")
    flat = root / "flat"
    flat.mkdir()
    for archive_name, names in members.items():
        url_path = root / "mirror" / ARCHIVES[archive_name].url.split("/", 3)[3]
        url_path.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(url_path, "w:gz") as tar:
            add_member(tar, "unrelated/europarl-v7.fr-en.en", b"not needed\n")
            for name in names:
                add_member(tar, name, contents[archive_name, name])
        shutil.copy(url_path, flat / url_path.name)
    return root


@pytest.fixture(scope="module")
def mirror(fake_release):
    """http.server on 127.0.0.1 serving the fake release; ``requests`` lists the paths fetched."""
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(fake_release / "mirror")))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    thread.join(timeout=10)
    server.server_close()


def dataset_sizes(data_bin, src, tgt):
    dictionary = Dictionary.load(str(data_bin / f"dict.{src}.txt"))
    return {split: len(data_utils.load_indexed_dataset(str(data_bin / f"{split}.{src}-{tgt}.{src}"), dictionary))
            for split in ("train", "valid", "test")}


@pytest.mark.slow
def test_wmt_download_through_mirror_then_reverse_direction_reuses_text(tmp_path, mirror, capfd):
    url, requests = mirror
    work = tmp_path / "data-bin" / "wmt14_en_de.work"
    (work / "downloads").mkdir(parents=True)
    stale = work / "downloads" / "test-full.tgz.part"  # a download killed midway
    stale.write_bytes(b"half an archive")

    out = prepare_wmt("wmt14_en_de", out=tmp_path / "data-bin" / "wmt14_en_de", mirror=url, workers=1,
                      bpe_merges=200)
    assert sorted(requests) == sorted("/" + ARCHIVES[a].url.split("/", 3)[3] for a in PAIRS["wmt14_en_de"].archives())
    assert not stale.exists() and (work / "downloads" / "test-full.tgz").is_file()
    assert (work / "raw" / "test.en").read_text(encoding="utf-8").startswith("AT&T grows by 3.5 percent.\n")
    assert (work / "tok" / "test.de").read_text(encoding="utf-8").startswith("AT &amp; T wächst um 3,5 Prozent .\n")
    sizes = dataset_sizes(out, "en", "de")
    assert sizes["test"] == N_TEST                      # the test split keeps every sentence
    assert 0.9 * N_TRAIN * 3 <= sizes["train"] <= N_TRAIN * 3 and 0 < sizes["valid"] <= N_VALID
    assert (out / "bpecodes").read_text().startswith("#version: 0.2\n")
    assert "@-@" in (out / "dict.en.txt").read_text(encoding="utf-8")

    # The other direction: nothing downloaded, every text stage reused, only binarization runs.
    capfd.readouterr()
    n_requests = len(requests)
    reverse = prepare_wmt("wmt14_de_en", out=tmp_path / "data-bin" / "wmt14_de_en", mirror=url, workers=1,
                          bpe_merges=200)
    log = capfd.readouterr().err
    assert len(requests) == n_requests
    for stage in ("raw", "tok", "bpe", "clean"):
        assert f"finished earlier, skipping: {work / stage}" in log
    assert (reverse / "train.de-en.de.bin").is_file()
    assert dataset_sizes(reverse, "de", "en") == sizes
    assert (reverse / "dict.de.txt").read_text() == (out / "dict.de.txt").read_text()


@pytest.mark.slow
def test_wmt_from_raw_dir_needs_no_network(tmp_path, fake_release):
    out = prepare_wmt("wmt14_de_en", out=tmp_path / "wmt14_de_en", raw_dir=fake_release / "flat", workers=1,
                      bpe_merges=200)
    assert not (tmp_path / "wmt14_en_de.work" / "downloads").exists()
    assert dataset_sizes(out, "de", "en")["test"] == N_TEST


# --------------------------------------------------------------------------- restartability

@pytest.fixture
def small_corpus(tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    corpus = generate({"train": 200, "valid": 30, "test": 30}, seed=3)
    for split, pairs in corpus.items():
        for column, lang in enumerate(("en", "de")):
            (text / f"{split}.{lang}").write_text("".join(p[column] + "\n" for p in pairs), encoding="utf-8")
    # gzipped input is accepted when the plain file is absent
    with gzip.open(text / "test.de.gz", "wt", encoding="utf-8") as f:
        f.write((text / "test.de").read_text(encoding="utf-8"))
    (text / "test.de").unlink()
    return text


def corpus_args(text, out, **extra):
    return dict(src="en", tgt="de", train=text / "train", valid=text / "valid", test=text / "test", out=out,
                bpe_merges=100, workers=1, **extra)


@pytest.mark.slow
def test_interrupted_stage_restarts_and_finished_stages_are_skipped(small_corpus, tmp_path, monkeypatch, capfd):
    out = tmp_path / "bin" / "syn"
    work = tmp_path / "bin" / "syn.work"

    def killed(infile, outfile, num_symbols):
        outfile.write("#version: 0.2\nt h\n")
        raise KeyboardInterrupt("killed while learning BPE")

    monkeypatch.setattr(prepare, "learn_bpe", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(**corpus_args(small_corpus, out))
    assert (work / "tok" / ".done").is_file()
    assert not (work / "bpe").exists() and not out.exists()      # nothing half-done looks finished
    assert (work / "bpe.partial").is_dir() and not (work / "bpe.partial" / ".done").exists()

    monkeypatch.undo()
    capfd.readouterr()
    prepare_corpus(**corpus_args(small_corpus, out))
    log = capfd.readouterr().err
    assert f"removing the unfinished {work / 'bpe.partial'}" in log
    assert f"finished earlier, skipping: {work / 'tok'}" in log
    assert not (work / "bpe.partial").exists()
    assert len((work / "bpe" / "codes").read_text().splitlines()) > 50
    assert dataset_sizes(out, "en", "de")["test"] == 30

    # A second run skips every stage and rewrites nothing.
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    prepare_corpus(**corpus_args(small_corpus, out))
    log = capfd.readouterr().err
    for stage in ("raw", "tok", "bpe", "clean"):
        assert f"finished earlier, skipping: {work / stage}" in log
    assert f"finished earlier, skipping: {out}" in log
    assert stamps == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------ bad inputs

def run_main(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main([str(a) for a in argv])
    assert exit_info.value.code != 0
    return capsys.readouterr().err


def corpus_argv(text, out, src="en", tgt="de"):
    return ["corpus", "--src", src, "--tgt", tgt, "--train", text / "train", "--valid", text / "valid",
            "--test", text / "test", "--out", out, "--workers", "1", "--bpe-merges", "50"]


def test_different_line_counts(small_corpus, tmp_path, capsys):
    with open(small_corpus / "valid.de", "a", encoding="utf-8") as f:
        f.write("Ein Satz zu viel.\n")
    err = run_main(corpus_argv(small_corpus, tmp_path / "out"), capsys)
    assert (f"parallel files have different line counts: {small_corpus / 'valid.en'} has 30 lines but "
            f"{small_corpus / 'valid.de'} has 31") in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.work" / "raw").exists()
    assert not (tmp_path / "out.work" / "raw.partial").exists()


def test_empty_input(small_corpus, tmp_path, capsys):
    (small_corpus / "valid.en").write_text("")
    (small_corpus / "valid.de").write_text("")
    err = run_main(corpus_argv(small_corpus, tmp_path / "out"), capsys)
    assert f"input file is empty: {small_corpus / 'valid.en'}" in err


def test_missing_input(small_corpus, tmp_path, capsys):
    (small_corpus / "train.de").unlink()
    err = run_main(corpus_argv(small_corpus, tmp_path / "out"), capsys)
    assert f"input file not found: {small_corpus / 'train.de'} (nor train.de.gz); --train takes a PREFIX" in err


def test_unknown_language_code(small_corpus, tmp_path, capsys):
    err = run_main(corpus_argv(small_corpus, tmp_path / "out", tgt="xx"), capsys)
    assert "unknown language code 'xx': the Moses tokenizer knows" in err
    err = run_main(corpus_argv(small_corpus, tmp_path / "out", tgt="en"), capsys)
    assert "source and target language are the same (en)" in err


def test_out_dir_that_is_not_ours_is_left_alone(small_corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    monkeypatch.setattr(prepare, "process_text", lambda raw, work_dir, out, *a: prepare.run_stage(
        out, "binarize", {}, lambda tmp: None))
    err = run_main(corpus_argv(small_corpus, out), capsys)
    assert f"{out} exists but was not written by multipath-prepare" in err
    assert (out / "precious.txt").read_text() == "keep me"


def test_unknown_task(capsys, tmp_path):
    err = run_main(["wmt", "wmt15_en_de", "--out", tmp_path / "x"], capsys)
    assert "unknown task 'wmt15_en_de'; choose one of: wmt14_en_de, wmt14_de_en" in err
    err = run_main(["wmt", "wmt14_en_de", "--out", tmp_path / "x", "--raw-dir", tmp_path / "nowhere"], capsys)
    assert f"--raw-dir {tmp_path / 'nowhere'} is not a directory" in err


def test_prepare_wmt_script_exits_non_zero_on_an_unknown_task(tmp_path):
    proc = run_cli(["bash", ROOT / "scripts" / "prepare-wmt.sh", "wmt16_en_ro", "--out", tmp_path / "x"],
                   check=False)
    assert proc.returncode == 1
    assert "== multipath-prepare wmt wmt16_en_ro" in proc.stderr
    assert "multipath-prepare: error: unknown task 'wmt16_en_ro'; choose one of:" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_failed_download_names_the_url_and_the_fix(tmp_path, mirror, capsys):
    url, _ = mirror
    err = run_main(["wmt", "wmt17_en_lv", "--out", tmp_path / "x", "--mirror", url + "/missing"], capsys)
    assert (f"download failed: {url}/missing/wmt17/translation-task/training-parallel-ep-v8.tgz: HTTP Error 404"
            in err)
    assert "pass its folder as --raw-dir" in err
    assert not list((tmp_path / "wmt17_en_lv.work" / "downloads").iterdir())  # no .part left behind


def test_manual_archive_explains_where_to_get_it(tmp_path, capsys):
    err = run_main(["wmt", "wmt17_ru_en", "--out", tmp_path / "x", "--raw-dir", tmp_path], capsys)
    assert "1mcorpus.zip not found" in err and "https://translate.yandex.ru/corpus" in err


# ------------------------------------------------------------------------------- Multi30k

@pytest.mark.slow
def test_prepare_corpus_script_on_multi30k(multi30k, tmp_path):
    """prepare-corpus.sh on the first 500 lines of each Multi30k split (gzipped inputs)."""
    sample = tmp_path / "m30k"
    sample.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            with gzip.open(multi30k / f"{split}.{lang}.gz", "rt", encoding="utf-8") as src, \
                    gzip.open(sample / f"{split}.{lang}.gz", "wt", encoding="utf-8") as dst:
                dst.writelines(line for _, line in zip(range(500), src))
    out = tmp_path / "data-bin" / "multi30k"
    proc = run_cli(["bash", ROOT / "scripts" / "prepare-corpus.sh", "--src", "en", "--tgt", "de",
                    "--train", sample / "train", "--valid", sample / "val", "--test", sample / "test_2016_flickr",
                    "--out", out, "--bpe-merges", "200", "--workers", "1"])
    assert "== multipath-prepare corpus --src en" in proc.stderr
    bpe = tmp_path / "data-bin" / "multi30k.work" / "bpe"
    kept = {split: sum(clean_pair(a, b) is not None for a, b in zip(prepare.read_lines(bpe / f"{split}.en"),
                                                                    prepare.read_lines(bpe / f"{split}.de")))
            for split in ("train", "valid")}
    assert dataset_sizes(out, "en", "de") == {**kept, "test": 500}
    assert min(kept.values()) > 400
    assert (out / "bpecodes").read_text() == (bpe / "codes").read_text()
