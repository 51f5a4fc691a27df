"""How the book's pages present themselves (issue 33): picture first, one visual language, no
scaffolding on the page.

These tests read the committed notebooks and their stored outputs, nothing is executed, so they
are cheap. What they check, on every chapter and appendix (and, for the rules about cells, on
every notebook of the book):

* **Picture first.** The first figure of a chapter comes before its first display formula, and
  each method section listed in ``METHOD_SECTIONS`` opens with its picture: the first code cell
  of the section that shows an output shows a figure, and it comes before the section's first
  display formula.
* **One colour map.** Every stored figure carries, in its output metadata, the label and
  colour of each artist its legends can name (``companion.plotting.record_figure_styles``,
  called in each notebook's first cell). A label that names a scheme or a scaling method
  (``companion.plotting.named_style_keys``) must be drawn in that key's colour from
  ``companion.plotting``. This catches a hard-coded ``"C1"`` or ``"#123456"`` given to a
  named curve however the code computed it. Its limits: an artist without a legend label
  (a curve named only in the title, a text annotation, a heatmap) is not checked, nor is a
  scheme's colour lent to a curve that names no scheme.
* **No scaffolding.** No code cell carries an ``NBVAL`` comment: the markers are cell tags
  (``tests/test_portability.py`` checks that each tagged cell says why in its metadata). A
  visible code cell is not made of asserts or imports alone, does not build a figure (that
  code is hidden with ``hide-input``), and does not print result keys of the project's own
  bookkeeping. No visible output prints a column of ``True`` (two lines in a row ending in
  ``True`` or ``False``), and no visible output line is longer than 77 characters.

Every chapter and appendix follows every rule; no page is excused.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest
from matplotlib.colors import to_hex

from companion.plotting import FIGURE_STYLES_KEY, named_style_keys, style_key_colour

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "book").glob("*.ipynb"))
#: The pages the picture-first rule covers: every chapter and appendix.
CHAPTERS_AND_APPENDICES = [p for p in NOTEBOOKS if p.parent.name == "chapters" or p.name.startswith("appendix_")]

#: The sections that introduce a method, by the start of their "## " heading. Each must open
#: with its picture.
METHOD_SECTIONS: dict[str, list[str]] = {
    "05_rope.ipynb": ["Two dimensions", "$d$ dimensions"],
    "06_alibi.ipynb": ["The definition", "The slopes", "Attention that never builds", "ALiBi in encoders"],
    "09_rope_scaling.ipynb": ["Position Interpolation", "NTK-aware", "YaRN", "Llama 3", "LongRoPE"],
    "11_newer_encodings.ipynb": ["xPos", "p-RoPE", "Kerple", "FIRE", "CoPE", "NoPE layers",
                                 "Training-free extension"],
}

HIDDEN_INPUT = {"remove-input", "hide-input", "remove-cell"}
HIDDEN_OUTPUT = {"remove-output", "hide-output", "remove-cell"}
MAX_OUTPUT_LINE = 77
DISPLAY_MATH = re.compile(r"\$\$|\\begin\{(?:equation|align|gather|multline|eqnarray)|^[`:]{3,}\{math\}", re.M)
HEADING = re.compile(r"^(#{1,6})\s+(.*)$", re.M)
COLUMN_OF_TRUE = re.compile(r"(?:^.*\b(?:True|False)[ \t]*$\n?){2,}", re.M)
BOOKKEEPING = re.compile(r"\btargets_met\b|\bacceptance\b|NBVAL")
FIGURE_CODE = re.compile(r"\bplt\.(?:subplots|figure|subplot)\(")


def _pages(paths):
    """Parametrize over pages, each named by its file."""
    return [pytest.param(p, id=p.name) for p in paths]


def tags(cell) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def image_output(cell) -> bool:
    if cell.cell_type != "code" or tags(cell) & HIDDEN_OUTPUT:
        return False
    return any(k.startswith("image/") for o in cell.get("outputs", []) for k in o.get("data", {}))


def visible_text(cell) -> str:
    """The text a reader sees under a code cell: streams and plain-text results."""
    if cell.cell_type != "code" or tags(cell) & HIDDEN_OUTPUT:
        return ""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            data = out.get("data", {})
            if not any(k.startswith("image/") or k in ("text/html", "text/markdown") for k in data):
                parts.append(data.get("text/plain", ""))
    return "".join(parts)


def events(path: Path) -> list[tuple[str, object, int]]:
    """The page in reading order: ("heading", (level, text)), ("formula", None), ("figure", None)
    and ("output", None) for a code cell whose visible output is not a figure; with cell index."""
    found = []
    nb = nbformat.read(path, as_version=4)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            pieces = HEADING.split(cell.source)  # text, level, title, text, level, title, ...
            for k, piece in enumerate(pieces):
                if k % 3 == 1:
                    found.append(("heading", (len(piece), pieces[k + 1].strip()), index))
                elif k % 3 == 0:
                    if re.search(r"!\[|^[`:]{3,}\{(?:figure|image)\}", piece, re.M):
                        found.append(("figure", None, index))
                    if DISPLAY_MATH.search(piece):
                        found.append(("formula", None, index))
        elif image_output(cell):
            found.append(("figure", None, index))
        elif visible_text(cell).strip() or (not tags(cell) & HIDDEN_OUTPUT and any(
                k in ("text/html", "text/markdown", "text/latex")
                for o in cell.get("outputs", []) for k in o.get("data", {}))):
            found.append(("output", None, index))
    return found


def first(found, kind):
    return next((i for i, (k, _, _) in enumerate(found) if k == kind), None)


@pytest.mark.parametrize("path", _pages(CHAPTERS_AND_APPENDICES))
def test_first_figure_comes_before_the_first_display_formula(path):
    found = events(path)
    figure, formula = first(found, "figure"), first(found, "formula")
    if path.parent.name == "chapters":
        assert figure is not None, f"{path.name}: a chapter without a figure"
    if formula is not None:
        assert figure is not None and figure < formula, (
            f"{path.name}: the first display formula (cell {found[formula][2]}) comes before the "
            f"first figure ({'none' if figure is None else 'cell ' + str(found[figure][2])})")


METHOD_CASES = [pytest.param(name, start, id=f"{name}-{start}")
                for name, starts in METHOD_SECTIONS.items() for start in starts]


@pytest.mark.parametrize("name, start", METHOD_CASES)
def test_each_method_section_opens_with_its_picture(name, start):
    found = events(ROOT / "chapters" / name)
    heads = [i for i, (k, v, _) in enumerate(found) if k == "heading" and v[0] == 2 and v[1].startswith(start)]
    assert len(heads) == 1, f"{name}: {len(heads)} '## {start}...' sections"
    end = next((i for i in range(heads[0] + 1, len(found))
                if found[i][0] == "heading" and found[i][1][0] <= 2), len(found))
    section = found[heads[0]:end]
    figure, formula, output = first(section, "figure"), first(section, "formula"), first(section, "output")
    assert figure is not None, f"{name}, '{start}': no figure in the section"
    assert output is None or figure < output, (
        f"{name}, '{start}': the section shows the output of cell {section[output][2]} before its picture")
    assert formula is None or figure < formula, (
        f"{name}, '{start}': the section's first display formula (cell {section[formula][2]}) comes "
        f"before its picture (cell {section[figure][2]})")


def test_the_picture_rule_itself(tmp_path):
    """events() sees a formula before a figure, in a markdown cell that holds several sections
    too; a figure in a cell tagged remove-output is not seen."""
    figure = nbformat.v4.new_code_cell("plot()", outputs=[nbformat.v4.new_output(
        "display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})])
    printed = nbformat.v4.new_code_cell("print(1)", outputs=[nbformat.v4.new_output("stream", text="1\n")])

    def order(*cells):
        path = tmp_path / "page.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=list(cells)), path)
        return [kind for kind, _, _ in events(path)]

    md = nbformat.v4.new_markdown_cell
    assert order(md("# T\n\n## A\n\n$$x$$\n\n## B"), figure) == ["heading", "heading", "formula", "heading", "figure"]
    assert order(md("## A"), figure, md("$$x$$")) == ["heading", "figure", "formula"]
    assert order(md("## A"), printed, figure) == ["heading", "output", "figure"]
    hidden = nbformat.v4.new_code_cell("plot()", metadata={"tags": ["remove-output"]}, outputs=figure.outputs)
    assert order(md("## A"), hidden, md("\\begin{align}x\\end{align}")) == ["heading", "formula"]


def test_method_sections_exist_on_the_listed_pages():
    assert set(METHOD_SECTIONS) <= {p.name for p in CHAPTERS_AND_APPENDICES}


def figure_records(path: Path):
    """(cell index, styles or None) for every visible figure of the page."""
    nb = nbformat.read(path, as_version=4)
    for index, cell in enumerate(nb.cells):
        if image_output(cell):
            for out in cell.get("outputs", []):
                mimes = [k for k in out.get("data", {}) if k.startswith("image/")]
                if mimes:
                    meta = out.get("metadata", {}).get(mimes[0], {})
                    yield index, meta.get(FIGURE_STYLES_KEY) if isinstance(meta, dict) else None


def colour_errors(records) -> list[str]:
    """The entries whose label names a scheme or method but whose colour is not the map's."""
    errors = []
    for record in records:
        keys = named_style_keys(record["label"])
        allowed = {style_key_colour(k) for k in keys}
        if keys and to_hex(record["color"]).lower() not in allowed:
            errors.append(f"{record['label']!r} drawn in {record['color']}, the map says "
                          + " or ".join(f"{k} {style_key_colour(k)}" for k in keys))
    return errors


@pytest.mark.parametrize("path", _pages(NOTEBOOKS))
def test_figures_draw_named_schemes_in_the_map_colours(path):
    problems = []
    for index, styles in figure_records(path):
        if styles is None:
            problems.append(f"cell {index}: the figure records no styles (call record_figure_styles())")
        else:
            problems += [f"cell {index}: {e}" for e in colour_errors(styles)]
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_the_colour_check_catches_hard_coded_colours():
    """The check itself: a default-cycle colour or a literal hex for a named curve fails, the
    map's colour passes, and so does an unnamed curve in any colour."""
    from companion.plotting import METHOD_STYLES, SCHEME_COLORS

    def record(label, color):
        return {"label": label, "color": color, "marker": "", "linestyle": "-"}

    assert colour_errors([record("RoPE", SCHEME_COLORS["rope"])]) == []
    assert colour_errors([record("YaRN, s = 4", METHOD_STYLES["yarn"]["color"])]) == []
    assert colour_errors([record("RoPE", "C1")]) and colour_errors([record("RoPE", "#123456")])
    assert colour_errors([record("PI", SCHEME_COLORS["rope"])])  # chapter 9's old default cycle
    assert colour_errors([record("p-RoPE", SCHEME_COLORS["rope"])])  # not RoPE's colour
    assert colour_errors([record("head 3", "#123456")]) == []


@pytest.mark.parametrize("path", _pages(NOTEBOOKS))
def test_no_nbval_comment_in_any_cell(path):
    nb = nbformat.read(path, as_version=4)
    hits = [(i, line.strip()) for i, c in enumerate(nb.cells) if c.cell_type == "code"
            for line in c.source.splitlines() if line.strip().startswith("#") and "NBVAL" in line]
    assert not hits, f"{path.name}: NBVAL comments (use the cell tags nbval-ignore-output etc.): {hits}"


def cell_problems(cell) -> list[str]:
    """What a visible code cell must not be or do."""
    if cell.cell_type != "code" or tags(cell) & HIDDEN_INPUT:
        return []
    problems = []
    try:
        body = ast.parse(cell.source).body
    except SyntaxError:
        body = []
    if body and all(isinstance(s, ast.Assert) for s in body):
        problems.append("asserts only (hide it, or fold it into a visible sentence)")
    if body and all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in body):
        problems.append("imports only (hide it)")
    if FIGURE_CODE.search(cell.source):
        problems.append("builds a figure (hide the plotting code with hide-input)")
    if BOOKKEEPING.search(cell.source):
        problems.append(f"shows bookkeeping: {BOOKKEEPING.search(cell.source).group(0)!r}")
    return problems


def output_problems(cell) -> list[str]:
    text = visible_text(cell)
    problems = []
    column = COLUMN_OF_TRUE.search(text)
    if column:
        problems.append(f"prints a column of True/False: {column.group(0).strip()[:120]!r}")
    long = [line for line in text.splitlines() if len(line) > MAX_OUTPUT_LINE]
    if long:
        problems.append(f"{len(long)} output lines longer than {MAX_OUTPUT_LINE} characters, "
                        f"up to {max(map(len, long))}: {long[0][:80]!r}")
    return problems


@pytest.mark.parametrize("path", _pages(NOTEBOOKS))
def test_visible_cells_show_the_idea_not_the_scaffolding(path):
    nb = nbformat.read(path, as_version=4)
    report = [f"cell {i}: {p}" for i, c in enumerate(nb.cells) for p in cell_problems(c) + output_problems(c)]
    assert not report, f"{path.name}:\n" + "\n".join(report)


@pytest.mark.parametrize("source, problem", [
    ("assert x == 1\nassert y", "asserts only"),
    ("import math\nfrom torch import nn", "imports only"),
    ("fig, ax = plt.subplots()\nax.plot(x)", "builds a figure"),
    ("assert data['targets_met']", "bookkeeping"),
    ("print(x)\nassert x", None),
])
def test_the_cell_rules_themselves(source, problem):
    found = cell_problems(nbformat.v4.new_code_cell(source))
    assert any(problem in p for p in found) if problem else found == []


@pytest.mark.parametrize("text, flagged", [
    ("a < 1e-12: True\nb < 1e-12: True\n", True),
    ("dtype float32 half True\nfloat16 half False\n", True),
    ("a < 1e-12: True\nthe rest: 4.5\n", False),
    ("one line only: True\n", False),
])
def test_the_column_rule_itself(text, flagged):
    assert bool(COLUMN_OF_TRUE.search(text)) is flagged
