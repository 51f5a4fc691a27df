"""The prose speaks to readers: no project scaffolding, no promises of chapters not written.

Readers cannot follow "seed claim 3", "source article `000`" or a "fact-check appendix" that
does not exist, and the book at every commit describes only what it contains. The source
articles are cited as the sources they are (``book/references.bib``), their claims stated in
the book's own words. This test reads the markdown of every chapter and book page.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]

SCAFFOLDING = {
    "internal claim numbers": r"\bseed claims?\s*\d|\bclaims? \d+ (?:in|of) the",
    "source files by number": r"source articles? `?0\d\d",
    "an appendix that does not exist": r"fact[- ]check(?:ing)? (?:appendix|list)",
    "project acceptance language": r"acceptance (?:benchmark|criteri|test)|\btargets? met\b",
    # "the coming chapters" of chapter 1 are chapters that exist; nothing promises more.
    "promises of later chapters": r"(?:next|later) chapters?|coming next",
}


def pages() -> dict[str, str]:
    texts = {}
    for path in sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "book").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        texts[path.name] = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for path in sorted((ROOT / "book").glob("*.md")):
        texts[path.name] = path.read_text()
    texts["README.md"] = (ROOT / "README.md").read_text()
    return texts


@pytest.mark.parametrize("kind", sorted(SCAFFOLDING))
def test_no_scaffolding_in_the_prose(kind):
    pattern = re.compile(SCAFFOLDING[kind], re.I)
    hits = [
        (name, text[max(m.start() - 40, 0):m.end() + 40].replace("\n", " "))
        for name, text in pages().items()
        for m in pattern.finditer(text)
    ]
    assert not hits, f"{kind}: {hits}"


@pytest.mark.parametrize("text, kind", [
    ("as seed claim 4 says", "internal claim numbers"),
    ("claim 7 in the book's fact-check list", "internal claim numbers"),
    ("the source article `000` is right", "source files by number"),
    ("the fact-check appendix covers it", "an appendix that does not exist"),
    ("the acceptance benchmark of the package", "project acceptance language"),
    ("the scaling methods of the next chapters", "promises of later chapters"),
    ("as the later chapter shows", "promises of later chapters"),
])
def test_the_patterns_catch_the_old_sentences(text, kind):
    assert re.search(SCAFFOLDING[kind], text, re.I)
