"""multipath-prepare: Moses/BPE/clean semantics, sgm extraction as sacreBLEU's, the WMT download
(resumed, checksummed) and --raw-dir paths against a local HTTP server, the sizes against Table 1,
restartable stages, bad-input errors, and prepare-corpus.sh on Multi30k."""
import dataclasses
import errno
import functools
import gzip
import hashlib
import http.server
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading

import pytest
from conftest import ROOT, clean_env, run_cli, script_env, start_command
from helpers.processes import kill_tree
from helpers.signals import alive
from fairseq.data import Dictionary, data_utils
from sacrebleu.dataset.fake_sgml import FakeSGMLDataset
from sacremoses import MosesPunctNormalizer, MosesTokenizer

from multipath_nmt.cli.prepare import main
from multipath_nmt.pipeline import prepare
from multipath_nmt.pipeline.prepare import (
    PrepareError, clean_pair, compare_with_table1, extract_members, fetch, mirror_url, moses_tokenize,
    prepare_corpus, prepare_wmt, sgm_to_text,
)
from multipath_nmt.pipeline.stages import LOCK
from multipath_nmt.pipeline.synthetic import generate
from multipath_nmt.pipeline.wmt import ARCHIVES, PAIRS, TASKS, Archive


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


def test_sgm_to_text_equals_sacrebleus_extraction(tmp_path):
    """Entities stay as released, whitespace (also non-breaking, tabs, CR) is trimmed and collapsed,
    curly quotes are not normalized, and odd lines are handled as sacreBLEU handles them."""
    sgm = tmp_path / "t.sgm"
    sgm.write_text('<refset setid="x">\n<doc docid="d" genre="news">\n'
                   '<seg id="1"> AT&amp;T  earns &lt;1% </seg>\n'
                   '<seg id="2">&#8364;5 &quot;q&quot; \u201cquoted\u201d\ttab\u00a0nbsp\r</seg>\r\n'
                   '<seg id="3">split\nover lines</seg>\n'
                   '  <seg id="4">indented: not a segment line</seg>\n'
                   '<seg id="5"></seg>\n'
                   '<seg id="6">two</seg><seg id="7">on one line</seg>\n</doc>\n</refset>\n', encoding="utf-8")
    out = tmp_path / "sacrebleu.txt"
    FakeSGMLDataset._convert_format(FakeSGMLDataset, str(sgm), str(out))
    expected = out.read_text(encoding="utf-8").split("\n")[:-1]
    assert list(sgm_to_text(sgm)) == expected
    assert expected[:2] == ["AT&amp;T earns &lt;1%", "&#8364;5 &quot;q&quot; \u201cquoted\u201d tab nbsp"]
    # like sacreBLEU: a segment split over lines keeps its markup and loses its second line, an
    # indented one is dropped, two on one line come out as one
    assert expected[2:] == ['<seg id="3">split', "", 'two</seg><seg id="7">on one line']


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
    # newstestB2016 brings En-Fi's valid to Table 1's 8,870 (1,500 + 1,370 + 3,000 + 3,000)
    assert [e.xx for e in PAIRS["wmt17_en_fi"].valid][-1] == "dev/newstestB2016-enfi-ref.fi.sgm"
    assert ("un_v1_en_ru", "en-ru/UNv1.0.en-ru.{lang}") in [(c.archive, c.member) for c in PAIRS["wmt17_en_ru"].train]
    assert [(p.table1.train, p.table1.valid, p.table1.test) for p in PAIRS.values()] == [
        (4_500_000, 3000, 3003), (35_000_000, 26_000, 3003), (5_900_000, 8171, 3004),
        (2_600_000, 8870, 3002), (4_500_000, 2003, 2001), (25_000_000, 8819, 3001)]
    # every archive that can be downloaded has its published checksum, except those named here
    unpinned = sorted(name for name, a in ARCHIVES.items() if a.checksum is None and not a.manual)
    assert unpinned == ["un_v1_en_ru"]
    assert ARCHIVES["un_v1_en_ru"].reference[:2] == (
        2_453_705_236, "f998570e7d60b87bf8648e50e854f150493eff4d7cf1133cf4781811bbe96566")
    assert ARCHIVES["wmt14_dev"].checksum == ("md5", "88ba3fc60b2278d59277122e1c7dd6e7")
    assert ARCHIVES["wmt17_dev"].checksum == ("md5", "9b1aa63c1cf49dccdd20b962fe313989")


def _members(template, *pairs):
    """``template`` filled in for each (xx, yy, lang) of ``pairs``."""
    return {template.format(xx=xx, yy=yy, lang=lang) for xx, yy in pairs for lang in (xx, yy)}


# The members of each archive, by URL, as public preparation code names them (not guessed):
# tensorflow/datasets' WMT builders (datasets/wmt/wmt_utils.py, _TRAIN_SUBSETS / _DEV_SUBSETS),
# sockeye's autopilot (contrib/autopilot/tasks.py, RAW_FILES and TASKS), sacreBLEU's dataset
# table (sacrebleu/dataset/__init__.py), tensor2tensor's translate_ende.py and mtdata's
# index/statmt.py (the WMT dev sets, which each year's dev.tgz carries on). Only the pairs these
# sources name are listed, so an archive that lacks a language (the WMT18 copies of Europarl v8
# and Rapid 2016 have no Latvian) has none of its members here.
STATMT, DATA17 = "http://www.statmt.org", "http://data.statmt.org/wmt17/translation-task"
UNV1 = "https://www.un.org/dgacm/sites/www.un.org.dgacm/files/files/UNCORPUS/UNv1.0.en-ru.tar.gz"
PUBLIC_MEMBERS = {
    # tfds europarl_v7 (cs, de, es, fr), sockeye europarl_v7
    f"{STATMT}/wmt13/training-parallel-europarl-v7.tgz":
        _members("training/europarl-v7.{xx}-en.{lang}", *[(x, "en") for x in ("cs", "de", "es", "fr")]),
    # tfds commoncrawl (cs, de, es, fr, ru), sockeye common_crawl_wmt13
    f"{STATMT}/wmt13/training-parallel-commoncrawl.tgz":
        _members("commoncrawl.{xx}-en.{lang}", *[(x, "en") for x in ("cs", "de", "es", "fr", "ru")]),
    # tfds multiun (es, fr), sockeye un_wmt13
    f"{STATMT}/wmt13/training-parallel-un.tgz": _members("un/undoc.2000.{xx}-en.{lang}", ("es", "en"), ("fr", "en")),
    # tfds newscommentary_v9 (cs, de, fr, ru), sockeye news_commentary_v9
    f"{STATMT}/wmt14/training-parallel-nc-v9.tgz":
        _members("training/news-commentary-v9.{xx}-en.{lang}", *[(x, "en") for x in ("cs", "de", "fr", "ru")]),
    # tfds newscommentary_v12 (cs, de, ru, zh), sockeye news_commentary_v12
    f"{DATA17}/training-parallel-nc-v12.tgz":
        _members("training/news-commentary-v12.{xx}-en.{lang}", *[(x, "en") for x in ("cs", "de", "ru", "zh")]),
    # tfds gigafren, sockeye giga_fren_wmt10
    f"{STATMT}/wmt10/training-giga-fren.tar": {"giga-fren.release2.fixed.fr.gz", "giga-fren.release2.fixed.en.gz"},
    # tfds wikiheadlines_fi, wikiheadlines_ru; sockeye wiki_headlines_wmt15
    f"{STATMT}/wmt15/wiki-titles.tgz": {"wiki/fi-en/titles.fi-en", "wiki/ru-en/wiki.ru-en"},
    # sockeye europarl_v8 (the WMT17 copy) in its wmt17_{en,fi,lv}_* tasks
    f"{DATA17}/training-parallel-ep-v8.tgz": _members("training/europarl-v8.{xx}-en.{lang}", ("fi", "en"), ("lv", "en")),
    # tfds europarl_v8_18 (the WMT18 copy): et, fi
    "http://data.statmt.org/wmt18/translation-task/training-parallel-ep-v8.tgz":
        _members("training/europarl-v8.{xx}-en.{lang}", ("et", "en"), ("fi", "en")),
    # sockeye rapid_eu_2016 (the WMT17 copy) in its wmt17_de_en, wmt17_fi_en and wmt17_lv_en tasks
    f"{DATA17}/rapid2016.tgz": _members("rapid2016.{xx}-{yy}.{lang}", ("de", "en"), ("en", "fi"), ("en", "lv")),
    # tfds rapid_2016 (the WMT18 copy): de, et, fi
    "http://data.statmt.org/wmt18/translation-task/rapid2016.tgz":
        _members("rapid2016.{xx}-{yy}.{lang}", ("de", "en"), ("en", "et"), ("en", "fi")),
    # tfds leta_v1, dcep_v1, onlinebooks_v1; sockeye leta_v1, dcep_lv_en_v1, books_lv_en_v1
    f"{DATA17}/leta.v1.tgz": {"LETA-lv-en/leta.lv", "LETA-lv-en/leta.en"},
    f"{DATA17}/dcep.lv-en.v1.tgz": {"dcep.en-lv/dcep.lv", "dcep.en-lv/dcep.en"},
    f"{DATA17}/books.lv-en.v1.tgz": {"farewell/farewell.lv", "farewell/farewell.en"},
    # tfds yandexcorpus, uncorpus_v1
    "https://translate.yandex.ru/corpus/1mcorpus.zip": {"corpus.en_ru.1m.ru", "corpus.en_ru.1m.en"},
    UNV1: {"en-ru/UNv1.0.en-ru.ru", "en-ru/UNv1.0.en-ru.en"},
    # newstest2013: sockeye wmt14_{en,de,fr}_* dev sets; newstest2012: WMT14 preparation scripts on
    # GitHub (one derived from tensorflow/nmt's wmt16_en_de.sh reads src.en and ref.de, another ref.fr)
    f"{STATMT}/wmt14/dev.tgz": {"dev/newstest2013-src.en.sgm", "dev/newstest2013-ref.de.sgm",
                                "dev/newstest2013-ref.fr.sgm", "dev/newstest2012-src.en.sgm",
                                "dev/newstest2012-ref.de.sgm", "dev/newstest2012-ref.fr.sgm"},
    # sacreBLEU wmt14/full
    f"{STATMT}/wmt14/test-full.tgz": {f"test-full/newstest2014-{xx}en-{side}.sgm" for xx in ("de", "fr")
                                      for side in ("src.en", f"ref.{xx}", f"src.{xx}", "ref.en")},
    # Each year's dev.tgz carries the earlier years' sets on, under their test-release names.
    # newstest2014-deen (English side): tensor2tensor, from this archive; newstest2014-ruen: its
    # WMT14 test-release name (sacreBLEU wmt14 en-ru); newstest2015/2016 en-de, en-fi, en-ru:
    # mtdata (WMT20 dev.tgz), sockeye (2016 en-de and en-fi, this archive); newsdev2015 en-fi:
    # mtdata; newstestB2016: tfds (WMT19 dev.tgz); newsdev2017 en-lv: sacreBLEU wmt17/dev, sockeye
    f"{DATA17}/dev.tgz": {
        "dev/newstest2014-deen-src.en.sgm", "dev/newstest2014-deen-ref.de.sgm",
        "dev/newstest2014-ruen-src.en.sgm", "dev/newstest2014-ruen-ref.ru.sgm",
        *[f"dev/{s}-en{xx}-{side}.sgm" for s in ("newstest2015", "newstest2016") for xx in ("de", "fi", "ru")
          for side in ("src.en", f"ref.{xx}")],
        "dev/newsdev2015-enfi-src.en.sgm", "dev/newsdev2015-enfi-ref.fi.sgm",
        "dev/newstestB2016-enfi-src.en.sgm", "dev/newstestB2016-enfi-ref.fi.sgm",
        "dev/newsdev2017-enlv-src.en.sgm", "dev/newsdev2017-enlv-ref.lv.sgm"},
    # sacreBLEU wmt17
    f"{DATA17}/test.tgz": {f"test/newstest2017-en{xx}-{side}.sgm" for xx in ("de", "fi", "lv", "ru")
                           for side in ("src.en", f"ref.{xx}")},
}


def test_every_member_is_in_the_archive_it_names():
    """Every member a direction reads is one that public references name for the archive at that URL."""
    for pair in PAIRS.values():
        for name, members in prepare._pair_members(pair).items():
            url = ARCHIVES[name].url
            assert url in PUBLIC_MEMBERS, f"{pair.name}: no public member list for {url}"
            missing = sorted(set(members) - PUBLIC_MEMBERS[url])
            assert not missing, f"{pair.name}: {url} is not known to hold {missing}"
    # the Latvian corpora come from the WMT17 copies: the WMT18 ones under the same names have no Latvian
    lv = prepare._pair_members(PAIRS["wmt17_en_lv"])
    for name, member in (("europarl_v8", "training/europarl-v8.lv-en.lv"), ("rapid2016", "rapid2016.en-lv.lv")):
        assert member in lv[name] and "/wmt17/" in ARCHIVES[name].url
        assert member not in PUBLIC_MEMBERS[ARCHIVES[name].url.replace("/wmt17/", "/wmt18/")]
    assert ARCHIVES["europarl_v8"].checksum == ("md5", "07b77f254d189a5bfb7b43b7fc489716")
    assert ARCHIVES["rapid2016"].checksum == ("md5", "17a3a1846433ad26acb95da02f93af93")


def test_sizes_compared_with_table1():
    pair = PAIRS["wmt14_en_fr"]
    report, warnings = compare_with_table1(pair, {"train": (40_836_876, 35_762_532), "valid": (6003, 6003),
                                                  "test": (3003, 3003)})
    assert report == ("train 40,836,876 -> 35,762,532 after cleaning (Table 1: 35,000,000); "
                      "valid 6,003 (Table 1: 26,000); test 3,003 (Table 1: 3,003)")
    assert len(warnings) == 1 and warnings[0].startswith(
        "wmt14_en_fr valid has 6,003 sentence pairs, 77% below the paper's Table 1 (26,000): Table 1 gives 26K, "
        "but the paper's text names newstest2012 + newstest2013")
    # within 10% of Table 1 before or after cleaning is no warning; beyond it, the reason is given
    ru = PAIRS["wmt17_en_ru"]
    assert compare_with_table1(ru, {"train": (27_400_000, 24_100_000), "valid": (8819, 8819),
                                    "test": (3001, 3001)})[1] == []
    warnings = compare_with_table1(ru, {"train": (2_600_000, 2_400_000), "valid": (8819, 8819),
                                        "test": (3001, 3001)})[1]
    assert warnings == ["wmt17_en_ru train has 2,400,000 sentence pairs, 90% below the paper's Table 1 "
                        "(25,000,000): clean-corpus-n drops training pairs with a length ratio above 1.5 or "
                        "more than 250 subwords"]


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


class ReleaseHandler(http.server.BaseHTTPRequestHandler):
    """Serves the files under ``root`` with HTTP Range support (``bytes=N-``). ``requests`` records
    (path, Range header); ``drops`` maps a path to a byte count: its next response announces the
    whole length but the connection is closed after that many bytes (a dropped connection)."""

    def __init__(self, *args, root, requests, drops, **kwargs):
        self.root, self.requests, self.drops = root, requests, drops
        super().__init__(*args, **kwargs)

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.requests.append((self.path, self.headers.get("Range")))
        path = self.root / self.path.lstrip("/")
        if self.path.startswith("/status/"):   # /status/CODE answers CODE
            self.send_error(int(self.path.rsplit("/", 1)[1]))
            return
        if not path.is_file():
            self.send_error(404, "File not found")
            return
        data = path.read_bytes()
        start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-")) if self.headers["Range"] else 0
        if start >= len(data) > 0:
            self.send_error(416, "Range Not Satisfiable")
            return
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        body = data[start:]
        drop = self.drops.pop(self.path, None)
        self.wfile.write(body if drop is None else body[:drop])
        self.close_connection = True


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A release server on 127.0.0.1: (base URL, root folder, requests, drops)."""
    root = tmp_path_factory.mktemp("served")
    requests, drops = [], {}
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(ReleaseHandler, root=root, requests=requests, drops=drops))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", root, requests, drops
    httpd.shutdown()
    thread.join(timeout=10)
    httpd.server_close()


@pytest.fixture
def mirror(fake_release, server, monkeypatch):
    """The fake release served under /release, its archives' checksums pinned (the WMT14 dev archive
    by md5, like the real one); yields (mirror URL, requests since the test started)."""
    url, root, requests, _ = server
    if not (root / "release").exists():
        shutil.copytree(fake_release / "mirror", root / "release")
    for name in PAIRS["wmt14_en_de"].archives():
        archive = ARCHIVES[name]
        data = (root / "release" / archive.url.split("/", 3)[3]).read_bytes()
        if name != "wmt14_dev":
            monkeypatch.setitem(ARCHIVES, name, dataclasses.replace(
                archive, sha256=hashlib.sha256(data).hexdigest(), md5=None))
        else:
            assert archive.checksum[0] == "md5"
            monkeypatch.setitem(ARCHIVES, name, dataclasses.replace(archive, md5=hashlib.md5(data).hexdigest()))
    monkeypatch.setattr(prepare, "RETRY_WAIT", 0.0)
    requests.clear()
    return url + "/release", requests


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
    log = capfd.readouterr().err
    paths = ["/release/" + ARCHIVES[a].url.split("/", 3)[3] for a in PAIRS["wmt14_en_de"].archives()]
    test_full = "/release/wmt14/test-full.tgz"
    # the stale .part is resumed, fails its checksum, is deleted and fetched again from byte 0
    assert sorted(requests, key=str) == sorted([(p, None) for p in paths] + [(test_full, "bytes=15-")], key=str)
    assert requests.index((test_full, "bytes=15-")) < requests.index((test_full, None))
    assert "test-full.tgz is damaged (its sha256 is" in log
    assert not stale.exists() and (work / "downloads" / "test-full.tgz").is_file()
    # references as released: the entity stays, and the tokenizer sees it as tokenizer.perl would
    assert (work / "raw" / "test.en").read_text(encoding="utf-8").startswith("AT&amp;T grows by 3.5 percent.\n")
    assert (work / "tok" / "test.de").read_text(encoding="utf-8").startswith(
        "AT &amp; amp ; T wächst um 3,5 Prozent .\n")
    assert (out / "test.raw.de").read_text(encoding="utf-8") == (work / "raw" / "test.de").read_text(encoding="utf-8")
    sizes = dataset_sizes(out, "en", "de")
    assert sizes["test"] == N_TEST and sizes["valid"] == N_VALID   # valid and test keep every sentence
    assert 0.9 * N_TRAIN * 3 <= sizes["train"] <= N_TRAIN * 3
    assert (f"wmt14_en_de sizes (sentence pairs): train {N_TRAIN * 3} -> {sizes['train']} after cleaning "
            f"(Table 1: 4,500,000); valid {N_VALID} (Table 1: 3,000); test {N_TEST} (Table 1: 3,003)") in log
    assert f"warning: wmt14_en_de valid has {N_VALID} sentence pairs, 99% below the paper's Table 1 (3,000)" in log
    assert ("wmt14_en_de training size: Table 1's 4.5M matches this selection before cleaning (about 4.5M "
            "pairs); the 1.5 length-ratio filter is expected to leave about 3.9-4.0M.") in log
    assert "Google's preprocessed WMT16 En-De release" in log
    assert (out / "bpecodes").read_text().startswith("#version: 0.2\n")
    assert "@-@" in (out / "dict.en.txt").read_text(encoding="utf-8")

    # The other direction: nothing downloaded, every text stage reused, only binarization runs.
    capfd.readouterr()
    n_requests = len(requests)
    reverse = prepare_wmt("wmt14_de_en", out=tmp_path / "data-bin" / "wmt14_de_en", mirror=url, workers=1,
                          bpe_merges=200)
    log = capfd.readouterr().err
    assert len(requests) == n_requests and "wmt14_de_en sizes (sentence pairs): train" in log
    for stage in ("raw", "tok", "bpe", "clean"):
        assert f"finished earlier, skipping: {work / stage}" in log
    assert (reverse / "train.de-en.de.bin").is_file()
    assert dataset_sizes(reverse, "de", "en") == sizes
    assert (reverse / "dict.de.txt").read_text() == (out / "dict.de.txt").read_text()


@pytest.mark.slow
def test_wmt_from_raw_dir_needs_no_network(tmp_path, fake_release, mirror):
    _, requests = mirror   # pins the fake archives' checksums; nothing may be requested
    out = prepare_wmt("wmt14_de_en", out=tmp_path / "wmt14_de_en", raw_dir=fake_release / "flat", workers=1,
                      bpe_merges=200)
    assert requests == []
    downloads = sorted(p.name for p in (tmp_path / "wmt14_en_de.work" / "downloads").iterdir())
    assert downloads == sorted(ARCHIVES[a].filename + ".verified" for a in PAIRS["wmt14_en_de"].archives())
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

    learn_bpe = prepare.learn_bpe
    monkeypatch.setattr(prepare, "learn_bpe", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(**corpus_args(small_corpus, out))
    assert (work / "tok" / ".done").is_file()
    assert not (work / "bpe").exists() and not out.exists()      # nothing half-done looks finished
    assert (work / "bpe.partial").is_dir() and not (work / "bpe.partial" / ".done").exists()

    monkeypatch.setattr(prepare, "learn_bpe", learn_bpe)
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


@pytest.mark.process
def test_two_runs_on_one_work_dir_take_turns(small_corpus, tmp_path):
    """A second multipath-prepare on the work dir of a running one waits for it, saying for whom,
    then skips the text stages the first finished (as the two WMT directions of a pair do)."""
    work = tmp_path / "shared.work"

    def command(out):
        return [sys.executable, "-m", "multipath_nmt.cli.prepare", *corpus_argv(small_corpus, out),
                "--work-dir", work]

    first = subprocess.Popen(command(tmp_path / "a"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=clean_env())
    for line in first.stdout:  # the first run holds the lock once it builds its first stage
        if line.startswith("[raw] building"):
            break
    holder = first.pid
    os.kill(holder, signal.SIGSTOP)  # and keeps it until the second has started
    resume = threading.Timer(60, os.kill, (holder, signal.SIGCONT))  # should the second not wait
    resume.start()
    second = start_command(command(tmp_path / "b"))
    second_log = [second.stdout.readline()]
    os.kill(holder, signal.SIGCONT)
    resume.cancel()
    second_log += second.stdout.readlines()
    statuses = second.wait(), first.wait(timeout=300)  # both waited for before any assertion
    first_log = first.stdout.read()
    assert statuses == (0, 0), (first_log, "".join(second_log))
    assert second_log[0].startswith(f"[lock] {work} is in use by pid {holder} on {socket.gethostname()}, "
                                    "started "), second_log
    assert second_log[0].endswith("; waiting for it to finish\n")
    second_log = "".join(second_log)
    for stage in ("raw", "tok", "bpe", "clean"):
        assert f"finished earlier, skipping: {work / stage}" in second_log
    assert dataset_sizes(tmp_path / "a", "en", "de") == dataset_sizes(tmp_path / "b", "en", "de")
    assert dataset_sizes(tmp_path / "b", "en", "de")["test"] == 30
    assert not (work / LOCK).exists()  # a run that ends removes its lock file


def test_parallel_files_cut_short_are_refused_not_truncated(small_corpus, tmp_path):
    """The clean stage reads the BPE files of both languages together: one line fewer in one of
    them (an outside hand, a disk error) stops it instead of dropping sentence pairs."""
    out, work = tmp_path / "out", tmp_path / "out.work"
    prepare_corpus(**corpus_args(small_corpus, out))
    cut = work / "bpe" / "test.de"
    cut.write_text("".join(cut.read_text(encoding="utf-8").splitlines(True)[:-1]), encoding="utf-8")
    shutil.rmtree(work / "clean")
    with pytest.raises(PrepareError) as refused:
        prepare_corpus(**corpus_args(small_corpus, out))
    assert str(refused.value).startswith(f"parallel files have different line counts: "
                                         f"{work / 'bpe' / 'test.en'} has 30 lines but {cut} has 29; ")
    assert not (work / "clean").exists()


# ------------------------------------------------------------------------------ bad inputs

def run_main(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    assert exit_info.value.code != 0
    return capsys.readouterr().err


def corpus_argv(text, out, src="en", tgt="de"):
    return ["corpus", "--src", src, "--tgt", tgt, "--train", text / "train", "--valid", text / "valid",
            "--test", text / "test", "--out", out, "--workers", "1", "--bpe-merges", "50"]


def test_fairseq_preprocess_logs_on_stderr_into_its_own_folder_and_restores_logging(tmp_path, capfd):
    """The binarize stage's fairseq-preprocess runs in this process: its log goes to stderr
    (stdout stays free) and into its destdir's preprocess.log, and only there; afterwards the
    root logger is as it was (fairseq_cli.preprocess points it at stdout when first imported)."""
    import logging

    root = logging.getLogger()
    before = list(root.handlers), root.level
    (tmp_path / "text.en").write_text("a b c\n")
    for run in ("one", "two"):
        prepare.fairseq_preprocess(["--only-source", "--source-lang", "en", "--trainpref",
                                    str(tmp_path / "text"), "--destdir", str(tmp_path / run)])
        assert (list(root.handlers), root.level) == before
    out, err = capfd.readouterr()
    assert out == "" and err.count("| INFO | fairseq_cli.preprocess | Wrote preprocessed data to") == 2
    for run in ("one", "two"):
        log = (tmp_path / run / "preprocess.log").read_text()
        assert log.count("Namespace(") == 1 and f"destdir='{tmp_path / run}'" in log


def test_a_failed_fairseq_preprocess_stops_the_stage_with_one_line(small_corpus, tmp_path, monkeypatch, capsys):
    import fairseq_cli.preprocess

    def disk_full(args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fairseq_cli.preprocess, "main", disk_full)
    err = run_main(corpus_argv(small_corpus, tmp_path / "bin"), capsys)
    assert err.splitlines()[-1] == ("multipath-prepare: error: fairseq-preprocess failed: OSError: "
                                    "[Errno 28] No space left on device")
    assert not (tmp_path / "bin").exists()


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


def _one_line_before_any_work(err):
    # one line, and no stage started ("[raw] building ...")
    assert "Traceback" not in err and "building" not in err, err
    return err.strip()


def test_out_under_a_file_is_refused_in_one_line_before_any_work(small_corpus, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    out = tmp_path / "file" / "bin"
    err = _one_line_before_any_work(run_main(corpus_argv(small_corpus, out), capsys))
    assert err == (f"multipath-prepare: error: cannot create {out}: {tmp_path / 'file'} is a file, "
                   "not a folder; choose another --out")


def test_out_that_is_a_dangling_symlink_is_refused_in_one_line_before_any_work(small_corpus, tmp_path,
                                                                               capsys):
    out = tmp_path / "bin"
    out.symlink_to(tmp_path / "gone")
    err = _one_line_before_any_work(run_main(corpus_argv(small_corpus, out), capsys))
    assert err == (f"multipath-prepare: error: {out} is a symbolic link to {tmp_path / 'gone'}, "
                   "which does not exist; choose another --out")
    assert not (tmp_path / "bin.work").exists()


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES], ids=["read-only", "no-permission"])
def test_out_that_cannot_be_written_is_refused_in_one_line_before_any_work(small_corpus, tmp_path, capsys,
                                                                           monkeypatch, code):
    """A read-only file system or a folder without write permission, simulated: the tests run as
    root, for whom chmod does not forbid writing, so os.mkdir fails under ``ro/`` as the kernel
    would. What this covers is the probe and its message, not a real read-only mount."""
    (tmp_path / "ro").mkdir()
    real_mkdir = os.mkdir

    def refusing_mkdir(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro") + os.sep):
            raise OSError(code, os.strerror(code), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refusing_mkdir)
    out = tmp_path / "ro" / "bin"
    err = _one_line_before_any_work(run_main(corpus_argv(small_corpus, out), capsys))
    assert err == (f"multipath-prepare: error: cannot write {out}: {os.strerror(code)} (errno {code}); "
                   "choose another --out")


def test_a_full_disk_while_tokenizing_stops_the_stage_with_one_line(small_corpus, tmp_path, capsys,
                                                                    monkeypatch):
    """ENOSPC at the first write of the tokenize stage, simulated in map_file (where the stage
    writes): one line naming the stage, the unfinished stage folder removed, the raw stage kept."""
    def disk_full(src, dst, *args, **kwargs):
        with open(dst, "w", encoding="utf-8") as out:
            out.write("a partial line")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(prepare, "map_file", disk_full)
    work = tmp_path / "bin.work"
    err = run_main(corpus_argv(small_corpus, tmp_path / "bin"), capsys)
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"multipath-prepare: error: cannot write {work / 'tok'}: No space left on device (errno 28); "
        f"its unfinished {work / 'tok.partial'} was removed: free disk space and run the same command "
        "again")
    assert not (work / "tok.partial").exists() and not (work / "tok").exists()
    assert (work / "raw" / ".done").is_file()


def test_unknown_task(capsys, tmp_path):
    err = run_main(["wmt", "wmt15_en_de", "--out", tmp_path / "x"], capsys)
    assert "unknown task 'wmt15_en_de'; choose one of: wmt14_en_de, wmt14_de_en" in err
    err = run_main(["wmt", "wmt14_en_de", "--out", tmp_path / "x", "--raw-dir", tmp_path / "nowhere"], capsys)
    assert f"--raw-dir {tmp_path / 'nowhere'} is not a directory" in err


@pytest.mark.process
def test_prepare_wmt_script_exits_non_zero_on_an_unknown_task(tmp_path):
    proc = run_cli(["bash", ROOT / "scripts" / "prepare-wmt.sh", "wmt16_en_ro", "--out", tmp_path / "x"],
                   check=False, env=script_env())
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


def test_manual_archive_explains_where_to_get_it(tmp_path, capsys, server):
    err = run_main(["wmt", "wmt17_ru_en", "--out", tmp_path / "x", "--raw-dir", tmp_path], capsys)
    assert "1mcorpus.zip not found" in err and "https://translate.yandex.ru/corpus" in err
    # with --mirror it is tried there, and a mirror without it gives the same explanation
    with pytest.raises(PrepareError, match=r"download failed: .*/corpus/1mcorpus.zip: HTTP Error 404.*"
                                           r"needs a licence agreement: download 1mcorpus.zip from"):
        fetch(ARCHIVES["yandex_1m"], tmp_path / "downloads", mirror=server[0])
    with pytest.raises(PrepareError, match=r"UNv1.0.en-ru.tar.gz.00: HTTP Error 404.*download "
                                           r"UNv1.0.en-ru.tar.gz.00, .01 and .02"):
        fetch(ARCHIVES["un_v1_en_ru"], tmp_path / "downloads", mirror=server[0])


# ------------------------------------------------------------------ resumed, checked downloads

def served_archive(server, name, data, **checksum):
    """``data`` served as /files/NAME, and an Archive pointing at it."""
    url, root, _, _ = server
    (root / "files").mkdir(exist_ok=True)
    (root / "files" / name).write_bytes(data)
    return Archive(f"{url}/files/{name}", **checksum)


def test_download_resumes_after_a_dropped_connection(tmp_path, server, monkeypatch, capsys):
    monkeypatch.setattr(prepare, "RETRY_WAIT", 0.0)
    _, _, requests, drops = server
    data = bytes(range(256)) * 12_000                      # 3 MB
    archive = served_archive(server, "big.tgz", data, sha256=hashlib.sha256(data).hexdigest())
    drops["/files/big.tgz"] = 1_000_000
    requests.clear()
    path = fetch(archive, tmp_path)
    assert path == tmp_path / "big.tgz" and path.read_bytes() == data
    assert requests == [("/files/big.tgz", None), ("/files/big.tgz", "bytes=1000000-")]
    err = capsys.readouterr().err
    assert "interrupted" in err and "resuming big.tgz.part at 1.0 MB" in err and "(100%)" in err
    assert not (tmp_path / "big.tgz.part").exists()


def test_server_errors_are_retried_client_errors_are_not(tmp_path, server, monkeypatch):
    monkeypatch.setattr(prepare, "RETRY_WAIT", 0.0)
    monkeypatch.setattr(prepare, "DOWNLOAD_RETRIES", 3)
    url, _, requests, _ = server
    requests.clear()
    with pytest.raises(PrepareError, match="download failed: .*/status/503: HTTP Error 503"):
        fetch(Archive(f"{url}/status/503"), tmp_path)
    assert requests == [("/status/503", None)] * 3
    requests.clear()
    with pytest.raises(PrepareError, match="download failed: .*/status/403: HTTP Error 403"):
        fetch(Archive(f"{url}/status/403"), tmp_path)
    assert requests == [("/status/403", None)]


def test_complete_part_file_is_checked_not_downloaded_again(tmp_path, server):
    """A run killed after the last byte but before the rename: the server answers 416 to the Range."""
    _, _, requests, _ = server
    data = b"complete\n" * 500
    archive = served_archive(server, "done.tgz", data, sha256=hashlib.sha256(data).hexdigest())
    (tmp_path / "done.tgz.part").write_bytes(data)
    requests.clear()
    assert fetch(archive, tmp_path).read_bytes() == data
    assert requests == [("/files/done.tgz", f"bytes={len(data)}-")]


def test_damaged_download_is_deleted_fetched_again_and_never_returned(tmp_path, server, monkeypatch, capsys):
    _, _, requests, _ = server
    data = b"the release\n" * 1000
    archive = served_archive(server, "a.tgz", data, md5=hashlib.md5(data).hexdigest())
    (tmp_path / "a.tgz.part").write_bytes(b"garbage")  # a .part from another file
    requests.clear()
    assert fetch(archive, tmp_path).read_bytes() == data
    assert requests == [("/files/a.tgz", "bytes=7-"), ("/files/a.tgz", None)]
    assert "a.tgz is damaged (its md5 is" in capsys.readouterr().err

    # a server whose file is not the pinned one: two attempts, then an error and nothing kept
    wrong = dataclasses.replace(archive, md5="0" * 32)
    with pytest.raises(PrepareError, match=r"b.tgz downloaded twice and still damaged: its md5 is [0-9a-f]{32}, "
                                           r"the release's is 0{32}"):
        fetch(dataclasses.replace(wrong, url=served_archive(server, "b.tgz", data).url), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tgz"]


def test_archive_without_checksum_must_read_to_its_end(tmp_path, server):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        add_member(tar, "dev/a.sgm", bytes(range(256)) * 4000)
    whole = buffer.getvalue()
    assert fetch(served_archive(server, "ok.tgz", whole), tmp_path).read_bytes() == whole
    with pytest.raises(PrepareError, match="cut.tgz downloaded twice and still damaged: it does not read as an archive"):
        fetch(served_archive(server, "cut.tgz", whole[:len(whole) // 2]), tmp_path)
    assert not (tmp_path / "cut.tgz").exists() and not (tmp_path / "cut.tgz.part").exists()


def test_unpinned_archive_is_compared_with_a_reference_copy_and_used_either_way(tmp_path, server, capsys):
    """The UN corpus has no published checksum: the joined pieces are compared with the copy
    tensorflow/datasets pins, the result is said in one line, and a good archive is used either way."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        add_member(tar, "en-ru/UNv1.0.en-ru.en", b"one\n" * 5000)
    data = buffer.getvalue()
    pieces = [data[:100], data[100:200], data[200:]]
    for i, piece in enumerate(pieces):
        served_archive(server, f"UNref.tar.gz.{i:02d}", piece)
    url = server[0]
    parts = tuple(f"{url}/files/UNref.tar.gz.{i:02d}" for i in range(3))
    same = Archive(f"{url}/files/UNref.tar.gz", parts=parts,
                   reference=(len(data), hashlib.sha256(data).hexdigest(), "the pinned copy"))
    capsys.readouterr()
    assert fetch(same, tmp_path / "a").read_bytes() == data
    assert f"UNref.tar.gz matches the pinned copy: same size ({len(data):,} bytes) and sha256" in capsys.readouterr().err
    for reference, difference in (((len(data), "0" * 64, "the pinned copy"), f"same size ({len(data):,} bytes) but "
                                   f"sha256 {hashlib.sha256(data).hexdigest()}, not {'0' * 64}"),
                                  ((2_453_705_236, "f" * 64, "the pinned copy"), f"{len(data):,} bytes, not 2,453,705,236")):
        other = dataclasses.replace(same, reference=reference)
        folder = tmp_path / str(reference[0]) / reference[1][:1]
        assert fetch(other, folder).read_bytes() == data       # used: it reads to its end
        log = capsys.readouterr().err
        assert f"UNref.tar.gz does NOT match the pinned copy: {difference}. No checksum is published" in log
        assert "damaged" not in log
    assert prepare.compare_with_reference(tmp_path / "a" / "UNref.tar.gz", ARCHIVES["un_v1_en_ru"]) == (
        f"UNv1.0.en-ru.tar.gz does NOT match tensorflow/datasets' copy (uncorpus_v1): {len(data):,} bytes, not "
        "2,453,705,236. No checksum is published for this release and it reads to its end, so it is used; it is "
        "not the copy others pinned")


def test_split_archive_downloaded_in_parts_or_taken_from_raw_dir(tmp_path, server, capsys):
    url, root, _, _ = server
    data = bytes(range(256)) * 300
    pieces = [data[:30_000], data[30_000:60_000], data[60_000:]]
    for i, piece in enumerate(pieces):
        served_archive(server, f"UN.tar.gz.{i:02d}", piece)
    archive = Archive(f"{url}/files/UN.tar.gz", parts=tuple(f"{url}/files/UN.tar.gz.{i:02d}" for i in range(3)),
                              sha256=hashlib.sha256(data).hexdigest())
    assert fetch(archive, tmp_path / "dl").read_bytes() == data
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == ["UN.tar.gz"]

    raw = tmp_path / "raw"
    raw.mkdir()
    for i, piece in enumerate(pieces):
        (raw / f"UN.tar.gz.{i:02d}").write_bytes(piece)
    capsys.readouterr()
    joined = fetch(archive, tmp_path / "dl2", raw_dir=raw)
    assert joined == tmp_path / "dl2" / "UN.tar.gz" and joined.read_bytes() == data
    assert "checking the sha256 of UN.tar.gz.part" in capsys.readouterr().err
    fetch(archive, tmp_path / "dl2", raw_dir=raw)   # joined and checked once
    assert "checking the sha256" not in capsys.readouterr().err
    assert sorted(p.name for p in raw.iterdir()) == ["UN.tar.gz.00", "UN.tar.gz.01", "UN.tar.gz.02"]  # kept

    (raw / "UN.tar.gz").write_bytes(data[:-1])      # a whole file in --raw-dir wins, and is checked
    with pytest.raises(PrepareError, match=f"{raw / 'UN.tar.gz'} is not the release this task expects: its sha256"):
        fetch(archive, tmp_path / "dl2", raw_dir=raw)
    (raw / "UN.tar.gz").unlink()
    (raw / "UN.tar.gz.01").write_bytes(b"x")        # damaged pieces: refused, and nothing joined is kept
    with pytest.raises(PrepareError, match="UN.tar.gz.00, UN.tar.gz.01, UN.tar.gz.02 in .* do not join into the "
                                           "release this task expects: its sha256"):
        fetch(archive, tmp_path / "dl3", raw_dir=raw)
    assert list((tmp_path / "dl3").iterdir()) == []


# ------------------------------------------------------------------------------- Multi30k

@pytest.mark.slow
@pytest.mark.process
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
                    "--out", out, "--bpe-merges", "200", "--workers", "1"], env=script_env())
    assert "== multipath-prepare corpus --src en" in proc.stderr
    bpe = tmp_path / "data-bin" / "multi30k.work" / "bpe"
    kept = sum(clean_pair(a, b) is not None for a, b in zip(prepare.read_lines(bpe / "train.en"),
                                                            prepare.read_lines(bpe / "train.de")))
    assert dataset_sizes(out, "en", "de") == {"train": kept, "valid": 500, "test": 500}  # only train is cleaned
    assert 400 < kept < 500
    assert (out / "bpecodes").read_text() == (bpe / "codes").read_text()
    with gzip.open(sample / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as raw_test:
        assert (out / "test.raw.de").read_text(encoding="utf-8") == raw_test.read()


# ------------------------------------------------------------------ kill -9 at random moments

PREPARE_STAGES = ("raw", "tokenize", "bpe", "clean", "binarize")


def _tree(folder):
    """Every file under ``folder``: relative path -> bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _writers_into(folder):
    """Processes (other than the test's) that could still write into ``folder``: those whose
    command line names it (an orphan started as a command of its own), and those with a file or
    their working directory inside it (an orphan forked from the killed run, whose command line is
    its parent's)."""
    inside = str(folder) + os.sep
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                named = str(folder).encode() in f.read()
            fds = os.listdir(f"/proc/{pid}/fd")
            paths = [os.readlink(f"/proc/{pid}/cwd")]
            for fd in fds:
                try:
                    paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:  # closed meanwhile
                    continue
        except OSError:  # gone, or not ours to read
            continue
        if named or any((path + os.sep).startswith(inside) for path in paths):
            found.append(int(pid))
    return found


def _run_and_kill(command, stage_label=None, delay=0.0, timeout=300):
    """Start ``command``; once its log says ``[stage_label] building`` (or, for
    ``download``, ``[download] URL``), wait ``delay`` seconds and SIGKILL the main process only
    (its children are not signalled, as with ``kill -9 PID``), and return as soon as it is gone,
    as a shell or a scheduler would. Returns: ``stage`` (whose build was under way at the end),
    ``killed``, ``events`` ((seconds from the start, stage) of each stage's log line) and
    ``log``."""
    import time
    import types

    started = time.monotonic()
    proc = start_command(command)
    run = types.SimpleNamespace(stage=None, killed=False, events=[], log=[])
    kill_at = []

    def read():  # until every writer of the pipe is gone: orphans included
        for line in proc.stdout:
            run.log.append(line)
            if line.startswith("[") and ("] building " in line or line.startswith("[download] http")):
                run.stage = line[1:line.index("]")]
                run.events.append((time.monotonic() - started, run.stage))
                if run.stage == stage_label and not kill_at:
                    kill_at.append(time.monotonic() + delay)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while alive(proc.pid):
        if kill_at and time.monotonic() >= kill_at[0]:
            os.kill(proc.pid, signal.SIGKILL)
            break
        if time.monotonic() - started > timeout:
            kill_tree(proc.pid)
            proc.wait()
            pytest.fail(f"{command} took more than {timeout} s")
        time.sleep(0.005)
    run.killed = proc.wait() == -signal.SIGKILL
    if not run.killed:
        reader.join(timeout=30)
        run.events.append((time.monotonic() - started, "end"))
    assert proc.returncode in (0, -signal.SIGKILL), f"{command} exited {proc.returncode}:\n{''.join(run.log)}"
    return run


def _no_process_writes_into(folder):
    """A child killed with its parent needs a moment to go; then nothing may name ``folder``."""
    import time

    for _ in range(20):
        if not _writers_into(folder):
            return True
        time.sleep(0.05)
    return False


TETHERED_FAMILY = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])  # tethered.py alone: no torch to import
import tethered
if sys.argv[2] == "tethered":
    tethered.tether_children()
if os.fork() == 0:
    if os.fork() == 0:
        os.write(1, b"%d\n" % os.getpid())  # one write each: the two lines do not interleave
        time.sleep(30)
        os._exit(0)
    os.write(1, b"%d\n" % os.getpid())
    time.sleep(30)
    os._exit(0)
time.sleep(30)
"""


@pytest.mark.parametrize("tethered", [True, False], ids=["tethered", "untethered"])
@pytest.mark.process
def test_a_parent_killed_with_sigkill_takes_its_tethered_children_and_grandchildren_along(tethered):
    """tether_children(): once the parent is killed with SIGKILL (nothing is sent to the others),
    its forked child and that child's forked grandchild end within a second; untethered, both
    live on."""
    import time

    parent = subprocess.Popen([sys.executable, "-c", TETHERED_FAMILY, ROOT / "multipath_nmt" / "pipeline",
                               "tethered" if tethered else "untethered"], stdout=subprocess.PIPE, text=True)
    family = sorted(int(parent.stdout.readline()) for _ in range(2))
    try:
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 1
        while any(map(alive, family)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [alive(pid) for pid in family] == [not tethered] * 2
    finally:
        for pid in filter(alive, family):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.process
def test_kill_9_at_random_moments_then_rerun_gives_the_same_bytes(tmp_path):
    """multipath-prepare corpus (2 workers) is killed with SIGKILL at a random moment of each
    stage in turn, each time the same command is run again; the last run finishes, and every file
    it leaves (data-bin and work dir) is byte-identical to an uninterrupted run's."""
    import random
    import sys

    text = tmp_path / "text"
    text.mkdir()
    for split, pairs in generate({"train": 1500, "valid": 100, "test": 100}, seed=11).items():
        for column, lang in enumerate(("en", "de")):
            (text / f"{split}.{lang}").write_text("".join(p[column] + "\n" for p in pairs), encoding="utf-8")
    folder = tmp_path / "bin"
    out = folder / "syn"
    command = [sys.executable, "-m", "multipath_nmt.cli.prepare", *corpus_argv(text, out)[:-4],
               "--workers", "2", "--bpe-merges", "300"]

    run = _run_and_kill(command)
    assert not run.killed and [stage for _, stage in run.events] == [*PREPARE_STAGES, "end"]
    durations = {stage: after - t for (t, stage), (after, _) in zip(run.events, run.events[1:])}
    reference = _tree(folder)
    shutil.rmtree(folder)

    rng = random.Random(20240633)
    killed_in = []
    for attempt in range(3):  # a kill that lands late can miss a stage of milliseconds (raw, clean)
        for label in PREPARE_STAGES + ("binarize", "tokenize"):
            run = _run_and_kill(command, label, rng.uniform(0, durations[label]))
            assert _no_process_writes_into(folder), \
                f"killed in {run.stage}: processes still write into {folder}: {_writers_into(folder)}"
            if not run.killed:  # it found the label's stage built by an earlier run: all is built
                break
            killed_in.append(run.stage)
        assert not _run_and_kill(command).killed  # the last run finishes
        after = _tree(folder)
        assert sorted(after) == sorted(reference)
        assert [name for name in reference if after[name] != reference[name]] == []
        if len(set(killed_in)) >= 4:
            break
        shutil.rmtree(folder)  # and once more from the start
    assert len(set(killed_in)) >= 4, (killed_in, durations)  # the kills landed in most stages

class SlowReleaseHandler(ReleaseHandler):
    """The release server's handler, sending at most 64 KB every 10 ms: a download of a few MB takes
    long enough to be killed in the middle."""

    def setup(self):
        super().setup()
        raw = self.wfile

        class Paced:
            def write(self, data):
                import time

                for start in range(0, len(data), 1 << 16):
                    raw.write(data[start:start + (1 << 16)])
                    time.sleep(0.01)
                return len(data)

            def __getattr__(self, name):
                return getattr(raw, name)

        self.wfile = Paced()


def _without_mtimes(files):
    """The .done files record each input's mtime; a download's is the moment it finished."""
    import re

    return {name: re.sub(rb'"mtime_ns": \d+', b'"mtime_ns": 0', data) if name.endswith(".done") else data
            for name, data in files.items()}


@pytest.mark.slow
@pytest.mark.process
def test_kill_9_during_downloads_then_rerun_gives_the_same_bytes(tmp_path, fake_release):
    """multipath-prepare wmt through a slow mirror, killed with SIGKILL in the middle of downloads
    and extractions, then run again: the same files, byte for byte, as an uninterrupted run (the
    .done files differ only in the download times they record)."""
    import random
    import sys

    served = tmp_path / "served"
    shutil.copytree(fake_release / "mirror", served)
    padding = random.Random(0).randbytes(3 << 20)  # incompressible: each archive is a 3 MB download
    for path in served.rglob("*.tgz"):
        with tarfile.open(path) as tar:
            members = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
        with tarfile.open(path, "w:gz") as tar:
            for name, data in members + [("unrelated/padding.bin", padding)]:
                add_member(tar, name, data)
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(SlowReleaseHandler, root=served, requests=[], drops={}))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        folder = tmp_path / "bin"
        command = [sys.executable, ROOT / "tests" / "helpers" / "prepare_wmt_from_mirror.py", url, served,
                   folder / "wmt14_en_de", 2]
        run = _run_and_kill(command)
        assert not run.killed
        downloads = [after - t for (t, stage), (after, _) in zip(run.events, run.events[1:])
                     if stage == "download"]
        assert len(downloads) == 5
        reference = _without_mtimes(_tree(folder))
        shutil.rmtree(folder)

        rng = random.Random(33)
        killed_in, resumed = [], 0
        for _ in range(6):  # each run is killed at a random moment after its first download began
            run = _run_and_kill(command, "download", rng.uniform(0, 1.5 * max(downloads)))
            killed_in.append(run.stage if run.killed else "finished")
            resumed += sum("  resuming " in line for line in run.log)
            assert _no_process_writes_into(folder)
        assert killed_in.count("download") >= 2, (killed_in, downloads)

        run = _run_and_kill(command)
        resumed += sum("  resuming " in line for line in run.log)
        assert resumed, "no download was resumed from a partial file"
        after = _without_mtimes(_tree(folder))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert sorted(after) == sorted(reference)
    assert [name for name in reference if after[name] != reference[name]] == []
