"""The bibliography holds what the book cites, and the book cites only what it holds.

The book at every commit describes only what it contains: an entry of ``book/references.bib``
that no page cites is either a leftover or a promise of material that is not there yet.
Citations come from the chapters' markdown cells, the pages under ``book/`` and the package
docstrings that the API reference renders.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
CITE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]+)`|:cite(?::[a-z]+)?:`([^`]+)`")
ENTRY = re.compile(r"^@\w+\{([^,\s]+),", re.M)


def bib_keys() -> set[str]:
    return set(ENTRY.findall((ROOT / "book" / "references.bib").read_text()))


def cited_keys() -> dict[str, set[str]]:
    texts: dict[str, str] = {}
    for path in sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "book").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        texts[path.name] = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for path in sorted((ROOT / "book").glob("*.md")):
        texts[path.name] = path.read_text()
    for path in sorted((ROOT / "companion").rglob("*.py")):
        texts[str(path.relative_to(ROOT))] = path.read_text()
    cited: dict[str, set[str]] = {}
    for name, text in texts.items():
        for match in CITE.finditer(text):
            for key in (match.group(1) or match.group(2)).split(","):
                cited.setdefault(key.strip(), set()).add(name)
    return cited


def test_the_citation_pattern():
    found = {m.group(1) or m.group(2) for m in CITE.finditer(
        "see {cite}`a2020,b2021` and {cite:p}`c2022`; docstring :cite:`d2023`")}
    assert found == {"a2020,b2021", "c2022", "d2023"}


def test_every_entry_is_cited():
    uncited = sorted(bib_keys() - set(cited_keys()))
    assert not uncited, f"references.bib entries that nothing cites: {uncited}"


def test_every_citation_has_an_entry():
    missing = {key: sorted(where) for key, where in cited_keys().items() if key not in bib_keys()}
    assert not missing, f"cited keys missing from references.bib: {missing}"
