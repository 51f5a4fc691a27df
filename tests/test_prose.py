"""The prose speaks to readers: no project scaffolding, no promises of chapters not written.

Readers cannot follow "seed claim 3", "source article `000`" or a "fact-check appendix" that
does not exist, and the book at every commit describes only what it contains. The source
articles are cited as the sources they are (``book/references.bib``), their claims stated in
the book's own words. Nor does the prose talk about the machinery that checks the book (issue
33): ``make test``, the test suite, CI, nbval's markers, the load of the machine that ran it, or
which outputs are "not checked". The pages on running the book and on the package may name
them (``CHECKS_MAY_BE_NAMED``). This test reads the markdown of every chapter and book page.
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
    # issue 33: the checks stay, out of sight
    "the machinery that checks the book": (r"make test|test suite|(?i:continuous integration)|NBVAL"
                                           r"|\b(?:in|outside|under|by|as|what) CI\b|\bCI (?:re-?runs|runs|checks)"),
    "the machine's load and the checks' own bookkeeping":
        r"shared machine|machine is shared|load average|output is not (?:checked|compared)|"
        r"(?:nothing|no ordering) is asserted|shared the (?:machine|\w+ cores)|other (?:jobs|work) (?:shared|ran)",
    # the book's experiments ran on 2-core servers (their provenance says so), not on a laptop
    "a machine the provenance does not show": r"\blaptops?\b",
}

#: The kinds that issue 33 added, and the pages that may name the machinery: running the
#: book, the package and its conventions, and the repository's README.
ISSUE_33_KINDS = {"the machinery that checks the book", "the machine's load and the checks' own bookkeeping"}
CHECKS_MAY_BE_NAMED = {"running.md", "package.md", "conventions.md", "api.md", "README.md"}


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
    pattern = re.compile(SCAFFOLDING[kind], 0 if kind in ISSUE_33_KINDS else re.I)
    excused = CHECKS_MAY_BE_NAMED if kind in ISSUE_33_KINDS else set()
    hits = [
        (name, text[max(m.start() - 40, 0):m.end() + 40].replace("\n", " "))
        for name, text in pages().items() if name not in excused
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
    ("`make test` verifies the outputs", "the machinery that checks the book"),
    ("the test suite checks this table", "the machinery that checks the book"),
    ("Continuous integration re-runs every notebook", "the machinery that checks the book"),
    ("outside CI it is skipped", "the machinery that checks the book"),
    ("cells marked NBVAL_IGNORE_OUTPUT", "the machinery that checks the book"),
    ("the machine is shared with other jobs", "the machine's load and the checks' own bookkeeping"),
    ("Timings on a shared machine vary", "the machine's load and the checks' own bookkeeping"),
    ("other jobs shared the machine for part of the time", "the machine's load and the checks' own bookkeeping"),
    ("the passes shared the two cores with other work", "the machine's load and the checks' own bookkeeping"),
    ("The whole experiment runs on a laptop CPU.", "a machine the provenance does not show"),
    ("so this cell's output is not checked, and no ordering is asserted",
     "the machine's load and the checks' own bookkeeping"),
])
def test_the_patterns_catch_the_old_sentences(text, kind):
    assert re.search(SCAFFOLDING[kind], text, 0 if kind in ISSUE_33_KINDS else re.I)


@pytest.mark.parametrize("text", ["a CIFAR image", "a 95% CI of the gap", "a suite of tests",
                                  "the weights load lazily", "tests of significance"])
def test_the_new_patterns_spare_ordinary_words(text):
    assert not any(re.search(SCAFFOLDING[kind], text) for kind in ISSUE_33_KINDS)
