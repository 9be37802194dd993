"""The 12 WMT directions of the paper's Table 1: where each archive lives, its pinned checksum,
which members hold the text, and the sizes Table 1 reports.

Training corpora follow fairseq's ``examples/translation/prepare-wmt14en2de.sh --icml17`` and
``prepare-wmt14en2fr.sh`` for WMT14, and the WMT17 constrained-task releases for WMT17 (the
corpora the WMT17 translation-task page and sockeye's autopilot list per pair). Member paths are
as laid out inside the released archives (``tests/test_prepare.py`` checks every one against the
names public preparation scripts use). Both directions of a pair share one text copy, so every
table entry is written once per pair, English first.

Checksums are the published ones: sha256 from tensorflow/datasets' ``url_checksums``
(``wmt13_translate.txt``, ``wmt14_translate.txt``, ``wmt17_translate.txt``), md5 from sacreBLEU's
dataset table for the test archives, and md5 from sockeye's autopilot (``contrib/autopilot/tasks.py``)
for the WMT17 copies of Europarl v8 and Rapid 2016 and for the two dev archives (sacreBLEU's
``wmt17/dev`` pins the same md5 for the WMT17 one). ``None`` means no published checksum was
found; such an archive is only checked for being a readable archive with the expected members.
"""
from dataclasses import dataclass, field
from typing import Optional

STATMT = "http://www.statmt.org"
DATA_STATMT = "http://data.statmt.org"
UN_CORPUS = "https://www.un.org/dgacm/sites/www.un.org.dgacm/files/files/UNCORPUS"


@dataclass(frozen=True)
class Archive:
    """A downloadable file.

    ``parts``: URLs of the pieces a release is split into, joined in order into ``filename``
    (``url`` is then only the name of the joined file). ``sha256``/``md5``: the published checksum
    of the (joined) file, or None. ``manual``: why and how to fetch it by hand when it is behind a
    licence page (no automatic download then). ``page``: where to get it by hand when a download
    fails. ``reference``: for a file without a published checksum, (size in bytes, sha256, whose)
    of a copy someone else pinned; the file is compared with it and the result reported, never
    required.
    """
    url: str
    sha256: Optional[str] = None
    md5: Optional[str] = None
    parts: tuple = ()
    manual: str = ""
    page: str = ""
    reference: Optional[tuple] = None

    @property
    def filename(self):
        return self.url.rsplit("/", 1)[-1]

    @property
    def checksum(self):
        """(algorithm, hex digest) or None when no checksum is published."""
        if self.sha256:
            return "sha256", self.sha256
        if self.md5:
            return "md5", self.md5
        return None


@dataclass(frozen=True)
class Corpus:
    """Parallel text inside an archive: one member per language (``{lang}`` in ``member``) or a
    single ``a ||| b`` bitext member whose column order is ``bitext_langs``."""
    archive: str
    member: str
    bitext_langs: tuple = ()


@dataclass(frozen=True)
class EvalSet:
    """An SGML dev/test set: the English member and the other language's member."""
    archive: str
    en: str
    xx: str


@dataclass(frozen=True)
class Table1:
    """Sentence counts of the paper's Table 1 for one pair, and why ours may differ. ``variant``:
    which count or release Table 1's training size matches, printed after every preparation."""
    train: int
    valid: int
    test: int
    notes: dict = field(default_factory=dict)  # split -> the known reason for a gap
    variant: str = ""


@dataclass(frozen=True)
class Pair:
    name: str          # also the shared work directory name, e.g. wmt14_en_de
    xx: str            # the non-English language
    train: tuple
    valid: tuple
    test: EvalSet
    table1: Table1

    @property
    def langs(self):
        return ("en", self.xx)

    def archives(self):
        names = [c.archive for c in self.train] + [e.archive for e in self.valid] + [self.test.archive]
        return list(dict.fromkeys(names))


ARCHIVES = {
    "europarl_v7": Archive(f"{STATMT}/wmt13/training-parallel-europarl-v7.tgz",
                           sha256="0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7"),
    # Europarl v8 and Rapid 2016 as the WMT17 page serves them, with Latvian. The WMT18 copies
    # under the same names hold other pairs (tensorflow/datasets lists et and fi for both, and de
    # for Rapid) and no Latvian. md5: sockeye's autopilot.
    "europarl_v8": Archive(f"{DATA_STATMT}/wmt17/translation-task/training-parallel-ep-v8.tgz",
                           md5="07b77f254d189a5bfb7b43b7fc489716"),
    "commoncrawl": Archive(f"{STATMT}/wmt13/training-parallel-commoncrawl.tgz",
                           sha256="c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5"),
    "un_wmt13": Archive(f"{STATMT}/wmt13/training-parallel-un.tgz",
                        sha256="29141b5c1eba149a94f7a59d3b1a834b2e47fe0f8758d68dcd77a3d3f497ee47"),
    "nc_v9": Archive(f"{STATMT}/wmt14/training-parallel-nc-v9.tgz",
                     sha256="cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485"),
    "nc_v12": Archive(f"{DATA_STATMT}/wmt17/translation-task/training-parallel-nc-v12.tgz",
                      sha256="2b45f30ef1d550d302fd17dd3a5cbe19134ccc4c2cf50c2dae534aee600101a2"),
    "giga_fren": Archive(f"{STATMT}/wmt10/training-giga-fren.tar",
                         sha256="3ff8319f6919393520559bfbc7ad6a747ec81b3abc7be9993b338d4b017b4d9a"),
    "wiki_titles_wmt15": Archive(f"{STATMT}/wmt15/wiki-titles.tgz",
                                 sha256="cd7cf81dbc99ef00b57e3106a4731b54cebcb7cff19088913cdab1c8114d3660"),
    "rapid2016": Archive(f"{DATA_STATMT}/wmt17/translation-task/rapid2016.tgz",
                         md5="17a3a1846433ad26acb95da02f93af93"),
    "leta_v1": Archive(f"{DATA_STATMT}/wmt17/translation-task/leta.v1.tgz",
                       sha256="af3f1a4cbeb503a231856baa9f1fb06c628d43ebb78b6f35a4f71e0a53f60e49"),
    "dcep_lv_en": Archive(f"{DATA_STATMT}/wmt17/translation-task/dcep.lv-en.v1.tgz",
                          sha256="871df6e7c96dc878f73a3864a8a2300c1c43725b3d24a7fdb560735e584bf515"),
    "books_lv_en": Archive(f"{DATA_STATMT}/wmt17/translation-task/books.lv-en.v1.tgz",
                           sha256="0eb70ad3e8420b131ddd29d1988d1055c72c13cef3768975a1c1a8f7662f361b"),
    "yandex_1m": Archive(
        "https://translate.yandex.ru/corpus/1mcorpus.zip",
        manual="the Yandex 1M En-Ru corpus needs a licence agreement: download 1mcorpus.zip from "
               "https://translate.yandex.ru/corpus?lang=en and pass its folder as --raw-dir"),
    # The UN Parallel Corpus v1.0 (Ziemski et al., 2016), en-ru bitext, released in three pieces
    # to be joined with cat. No checksum is published for the pieces or the joined file;
    # tensorflow/datasets pins its own copy of the joined archive (from its storage bucket), and
    # the joined pieces are compared with that copy and the result reported.
    "un_v1_en_ru": Archive(
        f"{UN_CORPUS}/UNv1.0.en-ru.tar.gz",
        parts=tuple(f"{UN_CORPUS}/UNv1.0.en-ru.tar.gz.{i:02d}" for i in range(3)),
        reference=(2_453_705_236, "f998570e7d60b87bf8648e50e854f150493eff4d7cf1133cf4781811bbe96566",
                   "tensorflow/datasets' copy (uncorpus_v1)"),
        page="the UN Parallel Corpus v1.0 is distributed from https://www.un.org/dgacm/en/content/uncorpus "
             "(it has moved before, and its older site asked for a registration): download "
             "UNv1.0.en-ru.tar.gz.00, .01 and .02 (or their concatenation UNv1.0.en-ru.tar.gz) and pass "
             "their folder as --raw-dir"),
    "wmt14_dev": Archive(f"{STATMT}/wmt14/dev.tgz", md5="88ba3fc60b2278d59277122e1c7dd6e7"),
    "wmt14_test": Archive(f"{STATMT}/wmt14/test-full.tgz", md5="a8cd784e006feb32ac6f3d9ec7eb389a"),
    "wmt17_dev": Archive(f"{DATA_STATMT}/wmt17/translation-task/dev.tgz", md5="9b1aa63c1cf49dccdd20b962fe313989"),
    "wmt17_test": Archive(f"{DATA_STATMT}/wmt17/translation-task/test.tgz", md5="86a1724c276004aa25455ae2a04cef26"),
}


def _newstest17_dev(xx, names):
    return tuple(EvalSet("wmt17_dev", f"dev/{n}-en{xx}-src.en.sgm", f"dev/{n}-en{xx}-ref.{xx}.sgm")
                 for n in names)


def _newstest2017(xx):
    return EvalSet("wmt17_test", f"test/newstest2017-en{xx}-src.en.sgm",
                   f"test/newstest2017-en{xx}-ref.{xx}.sgm")


# newstest2014 exists only as the "deen"/"ruen" release in the WMT17 dev archive.
_NEWSTEST2014_DEV = {
    xx: EvalSet("wmt17_dev", f"dev/newstest2014-{xx}en-src.en.sgm", f"dev/newstest2014-{xx}en-ref.{xx}.sgm")
    for xx in ("de", "ru")
}

_TRAIN_CLEANING = "clean-corpus-n drops training pairs with a length ratio above 1.5 or more than 250 subwords"

PAIRS = {p.name: p for p in (
    Pair("wmt14_en_de", "de",
         train=(Corpus("europarl_v7", "training/europarl-v7.de-en.{lang}"),
                Corpus("commoncrawl", "commoncrawl.de-en.{lang}"),
                Corpus("nc_v9", "training/news-commentary-v9.de-en.{lang}")),
         valid=(EvalSet("wmt14_dev", "dev/newstest2013-src.en.sgm", "dev/newstest2013-ref.de.sgm"),),
         test=EvalSet("wmt14_test", "test-full/newstest2014-deen-src.en.sgm",
                      "test-full/newstest2014-deen-ref.de.sgm"),
         table1=Table1(4_500_000, 3000, 3003, notes={"train": _TRAIN_CLEANING}, variant=(
             "Table 1's 4.5M matches this selection before cleaning (about 4.5M pairs); the 1.5 "
             "length-ratio filter is expected to leave about 3.9-4.0M. The authors' group's "
             "Transformer-deep scripts train on Google's preprocessed WMT16 En-De release instead "
             "(wmt16_en_de.tar.gz; the scripts published with it build it from Europarl v7, Common Crawl "
             "and News Commentary v11, tokenized without -a, 1-80 words per sentence), about 4.5M pairs "
             "after its own cleaning; it is served from Google Drive, which this pipeline does not "
             "download (see examples/wmt/README.md)"))),
    Pair("wmt14_en_fr", "fr",
         train=(Corpus("europarl_v7", "training/europarl-v7.fr-en.{lang}"),
                Corpus("commoncrawl", "commoncrawl.fr-en.{lang}"),
                Corpus("un_wmt13", "un/undoc.2000.fr-en.{lang}"),
                Corpus("nc_v9", "training/news-commentary-v9.fr-en.{lang}"),
                Corpus("giga_fren", "giga-fren.release2.fixed.{lang}.gz")),
         valid=(EvalSet("wmt14_dev", "dev/newstest2012-src.en.sgm", "dev/newstest2012-ref.fr.sgm"),
                EvalSet("wmt14_dev", "dev/newstest2013-src.en.sgm", "dev/newstest2013-ref.fr.sgm")),
         test=EvalSet("wmt14_test", "test-full/newstest2014-fren-src.en.sgm",
                      "test-full/newstest2014-fren-ref.fr.sgm"),
         table1=Table1(35_000_000, 26_000, 3003, notes={
             "train": "the release has about 40.8M pairs; " + _TRAIN_CLEANING,
             "valid": "Table 1 gives 26K, but the paper's text names newstest2012 + newstest2013 "
                      "(6,003), which we use; 26K matches fairseq's prepare-wmt14en2fr.sh, which holds "
                      "out every 1,333rd training pair instead (see examples/wmt/README.md)"})),
    Pair("wmt17_en_de", "de",
         train=(Corpus("europarl_v7", "training/europarl-v7.de-en.{lang}"),
                Corpus("commoncrawl", "commoncrawl.de-en.{lang}"),
                Corpus("nc_v12", "training/news-commentary-v12.de-en.{lang}"),
                Corpus("rapid2016", "rapid2016.de-en.{lang}")),
         valid=(_NEWSTEST2014_DEV["de"],) + _newstest17_dev("de", ("newstest2015", "newstest2016")),
         test=_newstest2017("de"),
         table1=Table1(5_900_000, 8171, 3004, notes={"train": _TRAIN_CLEANING})),
    Pair("wmt17_en_fi", "fi",
         train=(Corpus("europarl_v8", "training/europarl-v8.fi-en.{lang}"),
                Corpus("wiki_titles_wmt15", "wiki/fi-en/titles.fi-en", bitext_langs=("fi", "en")),
                Corpus("rapid2016", "rapid2016.en-fi.{lang}")),
         # newstestB2016 is newstest2016's English with a second Finnish translation.
         valid=_newstest17_dev("fi", ("newsdev2015", "newstest2015", "newstest2016", "newstestB2016")),
         test=_newstest2017("fi"),
         table1=Table1(2_600_000, 8870, 3002, notes={"train": _TRAIN_CLEANING})),
    Pair("wmt17_en_lv", "lv",
         train=(Corpus("europarl_v8", "training/europarl-v8.lv-en.{lang}"),
                Corpus("rapid2016", "rapid2016.en-lv.{lang}"),
                Corpus("leta_v1", "LETA-lv-en/leta.{lang}"),
                Corpus("dcep_lv_en", "dcep.en-lv/dcep.{lang}"),
                Corpus("books_lv_en", "farewell/farewell.{lang}")),
         valid=_newstest17_dev("lv", ("newsdev2017",)),
         test=_newstest2017("lv"),
         table1=Table1(4_500_000, 2003, 2001, notes={"train": _TRAIN_CLEANING})),
    Pair("wmt17_en_ru", "ru",
         train=(Corpus("commoncrawl", "commoncrawl.ru-en.{lang}"),
                Corpus("nc_v12", "training/news-commentary-v12.ru-en.{lang}"),
                Corpus("wiki_titles_wmt15", "wiki/ru-en/wiki.ru-en", bitext_langs=("ru", "en")),
                Corpus("yandex_1m", "corpus.en_ru.1m.{lang}"),
                Corpus("un_v1_en_ru", "en-ru/UNv1.0.en-ru.{lang}")),
         valid=(_NEWSTEST2014_DEV["ru"],) + _newstest17_dev("ru", ("newstest2015", "newstest2016")),
         test=_newstest2017("ru"),
         table1=Table1(25_000_000, 8819, 3001, notes={"train": _TRAIN_CLEANING})),
)}


def _directions():
    table = {}
    for pair in PAIRS.values():
        year = pair.name.split("_")[0]
        table[f"{year}_en_{pair.xx}"] = (pair, "en", pair.xx)
        table[f"{year}_{pair.xx}_en"] = (pair, pair.xx, "en")
    return table


# task name -> (pair, source language, target language); the 12 directions of the paper.
TASKS = _directions()
