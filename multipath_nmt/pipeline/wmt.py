"""The 12 WMT directions of the paper's Table 1: where each archive lives and which members hold the text.

Training corpora follow fairseq's ``examples/translation/prepare-wmt14en2de.sh --icml17`` and
``prepare-wmt14en2fr.sh`` for WMT14, and the WMT17 constrained-task releases for WMT17. Member
paths are as laid out inside the statmt.org archives. Both directions of a pair share one text
copy, so every table entry is written once per pair, English first.
"""
from dataclasses import dataclass, field

STATMT = "http://www.statmt.org"
DATA_STATMT = "http://data.statmt.org"


@dataclass(frozen=True)
class Archive:
    """A downloadable file; ``manual`` explains how to get one that cannot be fetched by URL."""
    url: str
    manual: str = ""

    @property
    def filename(self):
        return self.url.rsplit("/", 1)[-1]


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
class Pair:
    name: str          # also the shared work directory name, e.g. wmt14_en_de
    xx: str            # the non-English language
    train: tuple
    valid: tuple
    test: EvalSet
    sizes: dict = field(default_factory=dict)  # approximate sentence pairs, printed when preparing

    @property
    def langs(self):
        return ("en", self.xx)

    def archives(self):
        names = [c.archive for c in self.train] + [e.archive for e in self.valid] + [self.test.archive]
        return list(dict.fromkeys(names))


ARCHIVES = {
    "europarl_v7": Archive(f"{STATMT}/wmt13/training-parallel-europarl-v7.tgz"),
    "europarl_v8": Archive(f"{DATA_STATMT}/wmt17/translation-task/training-parallel-ep-v8.tgz"),
    "commoncrawl": Archive(f"{STATMT}/wmt13/training-parallel-commoncrawl.tgz"),
    "un_wmt13": Archive(f"{STATMT}/wmt13/training-parallel-un.tgz"),
    "nc_v9": Archive(f"{STATMT}/wmt14/training-parallel-nc-v9.tgz"),
    "nc_v12": Archive(f"{DATA_STATMT}/wmt17/translation-task/training-parallel-nc-v12.tgz"),
    "giga_fren": Archive(f"{STATMT}/wmt10/training-giga-fren.tar"),
    "wiki_titles_wmt15": Archive(f"{STATMT}/wmt15/wiki-titles.tgz"),
    "rapid2016": Archive(f"{DATA_STATMT}/wmt17/translation-task/rapid2016.tgz"),
    "leta_v1": Archive(f"{DATA_STATMT}/wmt17/translation-task/leta.v1.tgz"),
    "dcep_lv_en": Archive(f"{DATA_STATMT}/wmt17/translation-task/dcep.lv-en.v1.tgz"),
    "books_lv_en": Archive(f"{DATA_STATMT}/wmt17/translation-task/books.lv-en.v1.tgz"),
    "yandex_1m": Archive(
        "https://translate.yandex.ru/corpus/1mcorpus.zip",
        manual="the Yandex 1M En-Ru corpus needs a licence agreement: download 1mcorpus.zip from "
               "https://translate.yandex.ru/corpus?lang=en and pass its folder as --raw-dir"),
    "wmt14_dev": Archive(f"{STATMT}/wmt14/dev.tgz"),
    "wmt14_test": Archive(f"{STATMT}/wmt14/test-full.tgz"),
    "wmt17_dev": Archive(f"{DATA_STATMT}/wmt17/translation-task/dev.tgz"),
    "wmt17_test": Archive(f"{DATA_STATMT}/wmt17/translation-task/test.tgz"),
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

PAIRS = {p.name: p for p in (
    Pair("wmt14_en_de", "de",
         train=(Corpus("europarl_v7", "training/europarl-v7.de-en.{lang}"),
                Corpus("commoncrawl", "commoncrawl.de-en.{lang}"),
                Corpus("nc_v9", "training/news-commentary-v9.de-en.{lang}")),
         valid=(EvalSet("wmt14_dev", "dev/newstest2013-src.en.sgm", "dev/newstest2013-ref.de.sgm"),),
         test=EvalSet("wmt14_test", "test-full/newstest2014-deen-src.en.sgm",
                      "test-full/newstest2014-deen-ref.de.sgm"),
         sizes={"train": "4.5M", "valid": "3,000 (newstest2013)", "test": "3,003 (newstest2014, full)"}),
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
         sizes={"train": "40.8M (about 36M after cleaning)", "valid": "6,003 (newstest2012+2013)",
                "test": "3,003 (newstest2014, full)"}),
    Pair("wmt17_en_de", "de",
         train=(Corpus("europarl_v7", "training/europarl-v7.de-en.{lang}"),
                Corpus("commoncrawl", "commoncrawl.de-en.{lang}"),
                Corpus("nc_v12", "training/news-commentary-v12.de-en.{lang}"),
                Corpus("rapid2016", "rapid2016.de-en.{lang}")),
         valid=(_NEWSTEST2014_DEV["de"],) + _newstest17_dev("de", ("newstest2015", "newstest2016")),
         test=_newstest2017("de"),
         sizes={"train": "5.9M", "valid": "about 8,000 (newstest2014-2016)", "test": "3,004 (newstest2017)"}),
    Pair("wmt17_en_fi", "fi",
         train=(Corpus("europarl_v8", "training/europarl-v8.fi-en.{lang}"),
                Corpus("wiki_titles_wmt15", "wiki/fi-en/titles.fi-en", bitext_langs=("fi", "en")),
                Corpus("rapid2016", "rapid2016.en-fi.{lang}")),
         valid=_newstest17_dev("fi", ("newsdev2015", "newstest2015", "newstest2016")),
         test=_newstest2017("fi"),
         sizes={"train": "2.6M", "valid": "5,870 (newsdev2015, newstest2015-2016)",
                "test": "3,002 (newstest2017)"}),
    Pair("wmt17_en_lv", "lv",
         train=(Corpus("europarl_v8", "training/europarl-v8.lv-en.{lang}"),
                Corpus("rapid2016", "rapid2016.en-lv.{lang}"),
                Corpus("leta_v1", "LETA-lv-en/leta.{lang}"),
                Corpus("dcep_lv_en", "dcep.en-lv/dcep.{lang}"),
                Corpus("books_lv_en", "farewell/farewell.{lang}")),
         valid=_newstest17_dev("lv", ("newsdev2017",)),
         test=_newstest2017("lv"),
         sizes={"train": "4.5M", "valid": "2,003 (newsdev2017)", "test": "2,001 (newstest2017)"}),
    Pair("wmt17_en_ru", "ru",
         train=(Corpus("commoncrawl", "commoncrawl.ru-en.{lang}"),
                Corpus("nc_v12", "training/news-commentary-v12.ru-en.{lang}"),
                Corpus("wiki_titles_wmt15", "wiki/ru-en/wiki.ru-en", bitext_langs=("ru", "en")),
                Corpus("yandex_1m", "corpus.en_ru.1m.{lang}")),
         valid=(_NEWSTEST2014_DEV["ru"],) + _newstest17_dev("ru", ("newstest2015", "newstest2016")),
         test=_newstest2017("ru"),
         sizes={"train": "2.6M (without the UN corpus)", "valid": "about 8,600 (newstest2014-2016)",
                "test": "3,001 (newstest2017)"}),
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
