"""The docs name files, modules and tests that exist: a move or a rename that leaves a document
pointing at nothing fails here, not in a reader's hands."""
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *ROOT.glob("docs/*.md"),
                    *ROOT.glob("examples/*/README.md")])
# A repository path with a suffix: multipath_nmt/..., tests/..., scripts/..., examples/..., docs/...
FILE = re.compile(r"(?<![\w./-])((?:multipath_nmt|tests|scripts|examples|docs)/[\w./-]*\.(?:py|sh|md|json|png))\b")
# Paths in fairseq's own repository that the docs cite
FAIRSEQ_FILES = {"examples/translation/prepare-wmt14en2de.sh"}
# A test named as path::function (parametrize ids cut off)
TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
# A dotted module of the package, e.g. multipath_nmt.fairseq_patches.numerics
MODULE = re.compile(r"(?<![\w./-])(multipath_nmt(?:\.[a-z_]+)+)")
# A Markdown link or image to a file of the repository, relative to the document: [x](path#anchor)
LINK = re.compile(r"\]\((?![a-z]+:)([^)#\s]+)(?:#[^)\s]*)?\)")


def _references(pattern):
    found = set()
    for document in DOCUMENTS:
        for match in pattern.finditer(document.read_text(encoding="utf-8")):
            found.add((document.relative_to(ROOT).as_posix(), match.groups()))
    return sorted(found)


def _importable_prefix(dotted):
    """The module part of ``a.b.c.name``: the longest importable prefix, and the rest."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        return module, parts[end:]
    return None, parts


def test_every_file_named_in_the_docs_exists():
    missing = [f"{doc}: {path}" for doc, (path,) in _references(FILE)
               if not (ROOT / path).exists() and path not in FAIRSEQ_FILES]
    assert missing == []


def test_every_test_named_in_the_docs_exists():
    missing = []
    for doc, (path, name) in _references(TEST):
        source = ROOT / path
        if not source.exists() or not re.search(rf"^def {name}\b", source.read_text(), re.M):
            missing.append(f"{doc}: {path}::{name}")
    assert missing == []


def test_every_module_named_in_the_docs_imports():
    missing = []
    for doc, (dotted,) in _references(MODULE):
        module, rest = _importable_prefix(dotted)
        target = module
        for attribute in rest:
            target = getattr(target, attribute, None)
        if module is None or target is None:
            missing.append(f"{doc}: {dotted}")
    assert missing == []


def test_every_relative_link_in_the_docs_resolves():
    # links resolve from the document's folder, so a moved figure breaks them where FILE cannot see
    missing = [f"{doc}: {path}" for doc, (path,) in _references(LINK)
               if not (ROOT / doc).parent.joinpath(path).exists()]
    assert missing == []


@pytest.mark.parametrize("pattern", [FILE, TEST, MODULE, LINK],
                         ids=["files", "tests", "modules", "links"])
def test_the_docs_name_something(pattern):
    # guards the patterns themselves: an edit that matches nothing would make the checks vacuous
    assert _references(pattern)
