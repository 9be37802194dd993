"""A synthetic English->German-like parallel corpus, small enough for a tiny model to learn on CPU.

A hand-written grammar produces raw (untokenized) sentence pairs showing what makes real
translation non-trivial, so that tokenization, BPE and compound splitting all matter:
  * reordering: verb-second after a fronted adverb, verb-final in subordinate clauses, the
    participle at the end of perfect-tense clauses, verb-first questions;
  * agreement: German articles and adjective endings by gender and case (nominative subject,
    accusative object, dative indirect object and after mit/von), strong endings after "ein"/names;
  * hyphenated compounds: English adjectives like "state-of-the-art", German nouns like
    "Software-Entwickler" and "E-Mail-Adresse" (split by the Moses -a rule and multi-bleu's
    ##AT##-##AT## compound split);
  * numbers: thousands separators 1,250 vs 1.250 and decimals 3.5 vs 3,5;
  * punctuation and casing: the German comma before "dass"/"weil", question marks, possessive
    "Anna's" vs "Annas", sentence-initial capitals and capitalized German nouns.
The output is deterministic for a seed and every English sentence occurs once in all splits.
"""
import random
from dataclasses import dataclass
from pathlib import Path

from multipath_nmt.atomic_files import write_text_atomically

LANGS = ("en", "de")
SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Noun:
    en: str
    en_plural: str
    de: str
    de_plural: str
    gender: str  # m, f or n
    animate: bool = False


@dataclass(frozen=True)
class Verb:
    en: str          # 3rd person singular present
    en_base: str
    en_participle: str
    de: str          # 3rd person singular present
    de_participle: str


NOUNS = (
    Noun("man", "men", "Mann", "Männer", "m", True),
    Noun("woman", "women", "Frau", "Frauen", "f", True),
    Noun("child", "children", "Kind", "Kinder", "n", True),
    Noun("teacher", "teachers", "Lehrer", "Lehrer", "m", True),
    Noun("company", "companies", "Firma", "Firmen", "f", True),
    Noun("user", "users", "Nutzer", "Nutzer", "m", True),
    Noun("software developer", "software developers", "Software-Entwickler", "Software-Entwickler", "m", True),
    Noun("dog", "dogs", "Hund", "Hunde", "m"),
    Noun("car", "cars", "Auto", "Autos", "n"),
    Noun("book", "books", "Buch", "Bücher", "n"),
    Noun("city", "cities", "Stadt", "Städte", "f"),
    Noun("house", "houses", "Haus", "Häuser", "n"),
    Noun("computer", "computers", "Computer", "Computer", "m"),
    Noun("letter", "letters", "Brief", "Briefe", "m"),
    Noun("bicycle", "bicycles", "Fahrrad", "Fahrräder", "n"),
    Noun("key", "keys", "Schlüssel", "Schlüssel", "m"),
    Noun("idea", "ideas", "Idee", "Ideen", "f"),
    Noun("report", "reports", "Bericht", "Berichte", "m"),
    Noun("door", "doors", "Tür", "Türen", "f"),
    Noun("e-mail address", "e-mail addresses", "E-Mail-Adresse", "E-Mail-Adressen", "f"),
    Noun("online shop", "online shops", "Online-Shop", "Online-Shops", "m"),
    Noun("open-source project", "open-source projects", "Open-Source-Projekt", "Open-Source-Projekte", "n"),
    Noun("T-shirt", "T-shirts", "T-Shirt", "T-Shirts", "n"),
)
ADJECTIVES = (
    ("old", "alt"), ("new", "neu"), ("small", "klein"), ("big", "groß"), ("good", "gut"),
    ("red", "rot"), ("young", "jung"), ("cheap", "billig"), ("fast", "schnell"), ("famous", "berühmt"),
    ("well-known", "bekannt"), ("state-of-the-art", "hochmodern"), ("long-term", "langfristig"),
    ("high-quality", "hochwertig"), ("user-friendly", "benutzerfreundlich"), ("up-to-date", "aktuell"),
)
VERBS = (
    Verb("sees", "see", "seen", "sieht", "gesehen"),
    Verb("buys", "buy", "bought", "kauft", "gekauft"),
    Verb("finds", "find", "found", "findet", "gefunden"),
    Verb("sells", "sell", "sold", "verkauft", "verkauft"),
    Verb("builds", "build", "built", "baut", "gebaut"),
    Verb("tests", "test", "tested", "testet", "getestet"),
    Verb("needs", "need", "needed", "braucht", "gebraucht"),
    Verb("visits", "visit", "visited", "besucht", "besucht"),
    Verb("recommends", "recommend", "recommended", "empfiehlt", "empfohlen"),
    Verb("repairs", "repair", "repaired", "repariert", "repariert"),
)
DITRANSITIVE = (
    Verb("gives", "give", "given", "gibt", "gegeben"),
    Verb("shows", "show", "shown", "zeigt", "gezeigt"),
    Verb("sends", "send", "sent", "schickt", "geschickt"),
)
NAMES = ("Anna", "Peter", "Maria", "Paul", "Laura", "Martin")  # none ends in s: German "Annas"
ADVERBS = (("today", "heute"), ("tomorrow", "morgen"), ("now", "jetzt"), ("often", "oft"),
           ("on Monday", "am Montag"), ("in the morning", "am Morgen"), ("unfortunately", "leider"))
MATRIX = (("I know", "ich weiß"), ("we believe", "wir glauben"), ("she says", "sie sagt"),
          ("he thinks", "er denkt"), ("it is clear", "es ist klar"), ("the report says", "der Bericht sagt"))
PREPOSITIONS = (("with", "mit", "dat"), ("from", "von", "dat"), ("for", "für", "acc"), ("without", "ohne", "acc"))

DEFINITE = {"nom": {"m": "der", "f": "die", "n": "das"}, "acc": {"m": "den", "f": "die", "n": "das"},
            "dat": {"m": "dem", "f": "der", "n": "dem"}}
INDEFINITE = {"nom": {"m": "ein", "f": "eine", "n": "ein"}, "acc": {"m": "einen", "f": "eine", "n": "ein"},
              "dat": {"m": "einem", "f": "einer", "n": "einem"}}
# Adjective endings after a definite article (weak) and after ein/a name (mixed).
WEAK_ENDING = {"nom": {"m": "e", "f": "e", "n": "e"}, "acc": {"m": "en", "f": "e", "n": "e"},
               "dat": {"m": "en", "f": "en", "n": "en"}}
MIXED_ENDING = {"nom": {"m": "er", "f": "e", "n": "es"}, "acc": {"m": "en", "f": "e", "n": "es"},
                "dat": {"m": "en", "f": "en", "n": "en"}}


def english_article(next_word):
    """"a" or "an" by the sound of the next word ("an up-to-date", but "a user")."""
    vowel_sound = next_word[0].lower() in "aeiou" and not next_word.lower().startswith("use")
    return "an" if vowel_sound else "a"


def format_number(n, lang):
    """1250 -> "1,250" (en) / "1.250" (de)."""
    text = f"{n:,}"
    return text.replace(",", ".") if lang == "de" else text


def format_decimal(tenths, lang):
    text = f"{tenths // 10}.{tenths % 10}"
    return text.replace(".", ",") if lang == "de" else text


def sentence(words, end):
    """Words to a raw sentence: punctuation attached, the first letter capitalized."""
    text = " ".join(words).replace(" ,", ",") + end
    return text[0].upper() + text[1:]


class Grammar:
    """Sentence-pair generator; every method returns (english words, german words)."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def noun_phrase(self, case, animate=False):
        rng = self.rng
        if animate and rng.random() < 0.15:
            name = rng.choice(NAMES)
            return [name], [name]
        noun = rng.choice([n for n in NOUNS if n.animate] if animate else NOUNS)
        adjective = rng.choice(ADJECTIVES) if rng.random() < 0.45 else None
        kind = rng.choices(("definite", "indefinite", "possessive"), (0.6, 0.3, 0.1))[0]
        en_words = ([adjective[0]] if adjective else []) + [noun.en]
        if kind == "definite":
            en_det, de_det, ending = "the", DEFINITE[case][noun.gender], WEAK_ENDING[case][noun.gender]
        elif kind == "indefinite":
            en_det, de_det, ending = english_article(en_words[0]), INDEFINITE[case][noun.gender], \
                MIXED_ENDING[case][noun.gender]
        else:
            name = rng.choice(NAMES)
            en_det, de_det, ending = f"{name}'s", f"{name}s", MIXED_ENDING[case][noun.gender]
        de_words = ([adjective[1] + ending] if adjective else []) + [noun.de]
        return [en_det] + en_words, [de_det] + de_words

    def counted_phrase(self):
        """Object with a number: "1,250 new cars" / "1.250 neue Autos" (accusative plural)."""
        rng = self.rng
        n = rng.choice((rng.randint(2, 12), rng.randint(13, 999), rng.randint(1000, 999_999)))
        noun = rng.choice(NOUNS)
        adjective = rng.choice(ADJECTIVES) if rng.random() < 0.4 else None
        en = [format_number(n, "en")] + ([adjective[0]] if adjective else []) + [noun.en_plural]
        de = [format_number(n, "de")] + ([adjective[1] + "e"] if adjective else []) + [noun.de_plural]
        return en, de

    def object_phrase(self):
        return self.counted_phrase() if self.rng.random() < 0.15 else self.noun_phrase("acc")

    def prepositional_phrase(self):
        if self.rng.random() < 0.65:
            return [], []
        en_prep, de_prep, case = self.rng.choice(PREPOSITIONS)
        en, de = self.noun_phrase(case)
        return [en_prep] + en, [de_prep] + de

    def clause(self, order):
        """Subject, verb, object and optional PP; ``order`` is main, fronted, perfect, subordinate or question."""
        rng = self.rng
        (s_en, s_de), verb = self.noun_phrase("nom", animate=True), rng.choice(VERBS)
        (o_en, o_de), (p_en, p_de) = self.object_phrase(), self.prepositional_phrase()
        if order == "main":
            return s_en + [verb.en] + o_en + p_en, s_de + [verb.de] + o_de + p_de
        if order == "fronted":
            a_en, a_de = rng.choice(ADVERBS)
            return [a_en] + s_en + [verb.en] + o_en + p_en, [a_de, verb.de] + s_de + o_de + p_de
        if order == "perfect":
            return (s_en + ["has", verb.en_participle] + o_en + p_en,
                    s_de + ["hat"] + o_de + p_de + [verb.de_participle])
        if order == "subordinate":
            return s_en + [verb.en] + o_en + p_en, s_de + o_de + p_de + [verb.de]
        if order == "question":
            if rng.random() < 0.5:
                return ["does"] + s_en + [verb.en_base] + o_en + p_en, [verb.de] + s_de + o_de + p_de
            return (["has"] + s_en + [verb.en_participle] + o_en + p_en,
                    ["hat"] + s_de + o_de + p_de + [verb.de_participle])
        raise ValueError(order)

    def pair(self):
        rng = self.rng
        kind = rng.choices(("main", "fronted", "perfect", "that", "because", "question", "ditransitive",
                            "year", "percent"), (16, 12, 12, 14, 8, 10, 10, 9, 9))[0]
        if kind in ("main", "fronted", "perfect"):
            en, de = self.clause(kind)
            return sentence(en, "."), sentence(de, ".")
        if kind == "question":
            en, de = self.clause("question")
            return sentence(en, "?"), sentence(de, "?")
        if kind == "that":
            (m_en, m_de), (c_en, c_de) = rng.choice(MATRIX), self.clause("subordinate")
            return sentence([m_en, "that"] + c_en, "."), sentence([m_de, ",", "dass"] + c_de, ".")
        if kind == "because":
            (s_en, s_de), (c_en, c_de) = self.noun_phrase("nom", animate=True), self.clause("subordinate")
            return (sentence(s_en + ["is", "happy", "because"] + c_en, "."),
                    sentence(s_de + ["ist", "froh", ",", "weil"] + c_de, "."))
        if kind == "ditransitive":
            (s_en, s_de), verb = self.noun_phrase("nom", animate=True), rng.choice(DITRANSITIVE)
            (i_en, i_de), (o_en, o_de) = self.noun_phrase("dat", animate=True), self.noun_phrase("acc")
            return sentence(s_en + [verb.en] + i_en + o_en, "."), sentence(s_de + [verb.de] + i_de + o_de, ".")
        if kind == "year":
            (s_en, s_de), verb = self.noun_phrase("nom", animate=True), rng.choice(VERBS)
            (o_en, o_de), year = self.counted_phrase(), str(rng.randint(1990, 2030))
            return (sentence(s_en + ["has", verb.en_participle] + o_en + ["in", year], "."),
                    sentence(s_de + ["hat", "im", "Jahr", year] + o_de + [verb.de_participle], "."))
        s_en, s_de = self.noun_phrase("nom", animate=True)
        tenths = rng.randint(1, 999)
        return (sentence(s_en + ["grows", "by", format_decimal(tenths, "en"), "percent"], "."),
                sentence(s_de + ["wächst", "um", format_decimal(tenths, "de"), "Prozent"], "."))


def generate(sizes, seed=1):
    """{split: [(en, de), ...]} with ``sizes[split]`` distinct pairs per split, none shared between splits."""
    grammar, seen, corpus = Grammar(seed), set(), {}
    for split in SPLITS:
        pairs = []
        while len(pairs) < sizes[split]:
            en, de = grammar.pair()
            if en not in seen:
                seen.add(en)
                pairs.append((en, de))
        corpus[split] = pairs
    return corpus


def write_corpus(out, train=20000, valid=500, test=500, seed=1):
    """Write ``out/{train,valid,test}.{en,de}``, each file atomically."""
    for name, n in (("train", train), ("valid", valid), ("test", test)):
        if n < 1:
            raise ValueError(f"--{name} must be at least 1, got {n}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = generate({"train": train, "valid": valid, "test": test}, seed)
    for split, pairs in corpus.items():
        for column, lang in enumerate(LANGS):
            write_text_atomically(out / f"{split}.{lang}", "".join(pair[column] + "\n" for pair in pairs))
    return out
