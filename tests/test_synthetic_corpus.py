"""The synthetic quickstart corpus: deterministic, aligned, and showing the phenomena it promises."""
import re

import pytest

from multipath_nmt.cli.make_corpus import main
from multipath_nmt.pipeline.synthetic import NOUNS, english_article, format_decimal, format_number, generate

SIZES = {"train": 3000, "valid": 200, "test": 200}


@pytest.fixture(scope="module")
def corpus():
    return generate(SIZES, seed=5)


def read(folder):
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(folder.iterdir())}


def test_cli_is_deterministic_for_a_seed(tmp_path):
    for name, seed in (("a", 11), ("b", 11), ("c", 12)):
        main(["--out", str(tmp_path / name), "--train", "300", "--valid", "20", "--test", "20",
                  "--seed", str(seed)])
    a, b, c = read(tmp_path / "a"), read(tmp_path / "b"), read(tmp_path / "c")
    assert sorted(a) == [f"{s}.{lang}" for s in ("test", "train", "valid") for lang in ("de", "en")]
    assert a == b and a != c
    for split, n in (("train", 300), ("valid", 20), ("test", 20)):
        assert a[f"{split}.en"].count("\n") == a[f"{split}.de"].count("\n") == n


def test_sizes_no_empty_lines_and_no_sentence_shared_between_splits(corpus):
    assert {split: len(pairs) for split, pairs in corpus.items()} == SIZES
    english = [en for pairs in corpus.values() for en, _ in pairs]
    assert len(set(english)) == len(english)
    for pairs in corpus.values():
        for en, de in pairs:
            assert en.strip() and de.strip() and "\n" not in en + de
            assert en == en.strip() and de == de.strip()


def test_reordering(corpus):
    pairs = corpus["train"]
    subordinate = [de for _, de in pairs if ", dass " in de or ", weil " in de]
    perfect = [(en, de) for en, de in pairs if " has " in en and not en.startswith("Has ")]
    questions = [(en, de) for en, de in pairs if en.startswith("Does ")]
    assert len(subordinate) > 0.15 * len(pairs) and len(perfect) > 0.1 * len(pairs) and len(questions) > 100
    verbs = {"sieht", "kauft", "findet", "verkauft", "baut", "testet", "braucht", "besucht", "empfiehlt", "repariert"}
    # verb-final subordinate clauses, participle-final perfect, verb-first questions
    assert all(de.rstrip(".").split()[-1] in verbs for de in subordinate)
    assert all(de.rstrip(".").split()[-1].startswith(("ge", "verkauft", "besucht", "empfohlen", "repariert"))
               for _, de in perfect)
    assert all(de.split()[0] in {v.capitalize() for v in verbs} for _, de in questions)
    fronted = [de for en, de in pairs if en.startswith(("Today ", "Tomorrow "))]
    assert fronted and all(de.split()[1] in verbs for de in fronted)  # verb-second


def test_agreement(corpus):
    german = " ".join(de for _, de in corpus["train"])
    counts = {form: len(re.findall(rf"\b{form}\b", german)) for form in
              ("der", "die", "das", "den", "dem", "einen", "einem", "einer")}
    assert all(n > 50 for n in counts.values()), counts
    # accusative masculine object after a verb: "den ... Hund", never "der Hund" there
    assert re.search(r"\bden (\w+en )?Hund\b", german)
    assert re.search(r"\bein(?:er|em|en)? (\w+(?:er|es|en|e) )?\w+", german)
    # adjective endings by gender after "ein": "ein neuer Hund" (m), "ein neues Auto" (n)
    assert re.search(r"\bEin \w+er (Mann|Lehrer|Nutzer|Software-Entwickler)\b", german)
    assert re.search(r"\bein \w+es (Auto|Buch|Haus|Fahrrad|Kind)\b", german)


def test_compounds_numbers_punctuation_and_casing(corpus):
    pairs = corpus["train"]
    english, german = [en for en, _ in pairs], [de for _, de in pairs]
    assert sum("state-of-the-art" in en for en in english) > 20
    assert sum(bool(re.search(r"\b[A-Z][\w]*-[A-Z][\w]*", de)) for de in german) > 0.1 * len(pairs)
    assert sum("Software-Entwickler" in de for de in german) > 50
    thousands = [(en, de) for en, de in pairs if re.search(r"\d,\d{3}\b", en)]
    assert len(thousands) > 100
    for en, de in thousands:
        numbers_en = re.findall(r"\d[\d,.]*\d|\d", en)
        assert [n.replace(",", ".") for n in numbers_en if "," in n] == [n for n in re.findall(r"\d[\d,.]*\d|\d", de)
                                                                      if "." in n]
    assert any(re.search(r"\b\d+\.\d percent", en) for en in english)
    assert any(re.search(r"\b\d+,\d Prozent", de) for de in german)
    assert all(s[0].isupper() and s[-1] in ".?" for s in english + german)
    assert sum(de.endswith("?") for de in german) > 100
    nouns_de = {n.de for n in NOUNS}
    assert all(w[0].isupper() for de in german for w in de.rstrip(".?").split() if w in nouns_de)
    assert any("Anna's" in en for en in english) and any("Annas" in de for de in german)


def test_formatting_helpers():
    assert format_number(1250, "en") == "1,250" and format_number(1250, "de") == "1.250"
    assert format_number(999999, "de") == "999.999" and format_number(12, "de") == "12"
    assert format_decimal(35, "en") == "3.5" and format_decimal(35, "de") == "3,5"
    assert [english_article(w) for w in ("old", "user", "up-to-date", "e-mail", "car")] == ["an", "a", "an", "an", "a"]
