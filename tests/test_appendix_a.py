"""Appendix A's claims: each verdict sits under the heading of its claim, and the stored table
holds every verdict the cells recorded.

These read the committed notebook and its stored outputs (nothing is executed), so they are
cheap. They catch a claim renumbered in its heading but not in its ``record(...)`` call (or
the reverse), a claim of the first sixteen dropped, a verdict outside the four allowed, and a
verdict table stored from an older run than the cells' printed records.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "appendix_a_claims.ipynb"
ALLOWED = ("true", "false", "partly true", "unsourced")
HEADING = re.compile(r"^## Claim (\d+)\b", re.M)
RECORD_CALL = re.compile(r"^record\(\s*\"?(\d+[a-z]?)\"?\s*,", re.M)
PRINTED = re.compile(r"^claim (\d+[a-z]?) \([^)]*\): (TRUE|FALSE|PARTLY TRUE|UNSOURCED):", re.M)
TABLE_ROW = re.compile(r"^\| (\d+[a-z]?) \|.*\| \*\*(true|false|partly true|unsourced)\*\* \|", re.M)


@pytest.fixture(scope="module")
def notebook():
    return nbformat.read(PAGE, as_version=4)


def records_under_headings(nb) -> list[tuple[int, str]]:
    """(number of the last '## Claim N' heading above, label) for every record(...) call."""
    found, current = [], None
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for number in HEADING.findall(cell.source):
                current = int(number)
        elif cell.cell_type == "code":
            found += [(current, label) for label in RECORD_CALL.findall(cell.source)]
    return found


def printed_verdicts(nb) -> list[tuple[str, str]]:
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    return [(label, verdict.lower()) for label, verdict in PRINTED.findall(text)]


def stored_table(nb) -> list[tuple[str, str]]:
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            data = out.get("data", {})
            if out.get("metadata", {}).get("scrapbook", {}).get("name") == "verdict_table" or (
                    "application/papermill.record/text/markdown" in data
                    and "| # | claim |" in data["application/papermill.record/text/markdown"]):
                return TABLE_ROW.findall(data["application/papermill.record/text/markdown"])
    raise AssertionError("no stored verdict table")


def test_each_record_sits_under_its_own_claim_heading(notebook):
    pairs = records_under_headings(notebook)
    assert pairs, "no record(...) calls found"
    wrong = [(heading, label) for heading, label in pairs if heading != int(re.match(r"\d+", label).group())]
    assert not wrong, f"record(...) labels under another claim's heading: {wrong}"


def test_labels_are_unique_in_order_and_cover_the_first_sixteen(notebook):
    labels = [label for _, label in records_under_headings(notebook)]
    assert len(set(labels)) == len(labels), labels
    numbers = [int(re.match(r"\d+", x).group()) for x in labels]
    assert numbers == sorted(numbers)
    assert set(range(1, 17)) <= set(numbers)


def test_the_stored_table_matches_the_printed_records(notebook):
    printed = printed_verdicts(notebook)
    table = stored_table(notebook)
    assert [label for _, label in records_under_headings(notebook)] == [label for label, _ in printed]
    assert table == printed, "the stored verdict table and the cells' printed verdicts differ"
    assert {verdict for _, verdict in table} <= set(ALLOWED)


def test_the_verdicts_are_not_all_one_way(notebook):
    """The appendix checks claims the articles get right as well as wrong."""
    verdicts = [v for _, v in stored_table(notebook)]
    assert verdicts.count("true") >= 3 and verdicts.count("false") >= 3
