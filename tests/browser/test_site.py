"""A real headless Chromium loads the built site with the network blocked.

For the home page and every page in the table of contents it checks that MathJax typeset the formulas (the
DOM holds ``mjx-container`` elements, every math span was converted, no raw ``$$`` is left)
and that no asset failed to load (no failed request, no HTTP error, no console error, no
request that tried to leave the machine). On the chapter pages it also checks that no code
cell's output runs off its column: every ``pre``, table and image inside a ``div.cell_output``
must show its whole width (``scrollWidth <= clientWidth + 1``, no hidden horizontal scroll)
and end inside the article column (``article.bd-article``), at the 1280 x 900 viewport of
these tests, where the column holds about 85 characters of output in the font size that
``_static/outputs.css`` sets (a longer line wraps there instead of scrolling); a
failure names the page, the notebook cell and the line that is too long, and says how many
characters fit. Screenshots go to ``_build/screenshots/``.

The site is served from 127.0.0.1 by a thread of this process, like GitHub Pages would serve
it. Everything else is unreachable: the host resolver maps every name to nothing, a dead proxy
takes any non-loopback request, and a route handler aborts (and records) any request that is
not for the local server.

Run ``make book`` (or ``make test``) first. Without Chromium the test skips with a message,
except under ``CI=true`` where it must run.

One check needs no browser: it reads the built HTML of every chapter and appendix and requires
that the page does not name the machinery that checks the book (``make test``, NBVAL, CI, the
test suite) and that no code cell's output block prints a column of True or False (issue 33;
the rules for the notebooks themselves are in ``tests/test_presentation.py``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import html.parser
import http.server
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

pytestmark = pytest.mark.browser


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"browser test cannot run under CI=true: {reason}")
    pytest.skip(f"browser test skipped: {reason}")


def _find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _toc_pages() -> list[str]:
    """Every page in the table of contents, relative to the site root."""
    toc = (ROOT / "_toc.yml").read_text()
    root = re.search(r"^root:\s*(\S+)", toc, re.M).group(1)
    return [f"{m}.html" for m in [root, *re.findall(r"file:\s*(\S+)", toc)]]


@pytest.fixture(scope="module")
def server():
    if not (SITE / "index.html").exists():
        pytest.fail(f"{SITE / 'index.html'} does not exist: run `make book` first")
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture(scope="module")
def browser():
    exe = _find_chromium()
    if exe is None:
        _unavailable("no chromium found (Debian/Ubuntu: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[test]')")
    with sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=exe,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                "--proxy-server=http://127.0.0.1:9",
            ],
        )
        yield b
        b.close()


# Every output element of every code cell (``div.cell``, in page order): whether it hides part of
# its width behind a horizontal scroll bar, or sticks out of the article column.
_OVERFLOW_JS = """() => {
    const column = document.querySelector('article.bd-article');
    const right = column ? column.getBoundingClientRect().right : Infinity;
    const found = [];
    document.querySelectorAll('div.cell').forEach((cell, index) => {
        cell.querySelectorAll('div.cell_output pre, div.cell_output table, div.cell_output img')
            .forEach(el => {
                const box = el.getBoundingClientRect();
                const hidden = el.scrollWidth - el.clientWidth;
                const outside = box.right - right;
                if (hidden > 1 || outside > 1) {
                    const lines = (el.innerText || '').split('\\n');
                    const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), '');
                    // How many characters of this element's font fit in its visible width.
                    const style = getComputedStyle(el);
                    const probe = document.createElement('span');
                    probe.textContent = 'x'.repeat(100);
                    el.appendChild(probe);  // inherits the element's font
                    const charWidth = probe.getBoundingClientRect().width / 100;
                    probe.remove();
                    const inner = el.clientWidth - parseFloat(style.paddingLeft)
                        - parseFloat(style.paddingRight);
                    found.push({cell: index, tag: el.tagName.toLowerCase(), hidden: hidden,
                                outside: Math.round(outside), chars: longest.length,
                                fits: Math.floor(inner / charWidth), line: longest.slice(0, 70)});
                }
            });
    });
    return found;
}"""


def _code_cells(page_path: str) -> list[int]:
    """Notebook indices of the code cells a chapter page renders as ``div.cell``, in order."""
    nb_path = ROOT / Path(page_path).with_suffix(".ipynb")
    if not nb_path.exists():
        return []
    nb = nbformat.read(nb_path, as_version=4)
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
            and "remove-cell" not in c.get("metadata", {}).get("tags", [])]


_LOADED: dict[str, dict] = {}


def _load(browser, server: str, page_path: str, shot: str) -> dict:
    """Open one page (once per test session); return what the checks need."""
    if page_path not in _LOADED:
        _LOADED[page_path] = _open(browser, server, page_path, shot)
    return _LOADED[page_path]


def _offline_page(browser, server: str, page_path: str, requested: list[str] | None = None):
    """``(context, page, problems)``: the page loaded with every request outside the local
    server aborted and recorded in ``problems``, with failed requests, HTTP errors, console
    errors and page errors; the local URLs requested go to ``requested``."""
    problems: list[str] = []
    context = browser.new_context(viewport={"width": 1280, "height": 900})

    def guard(route):
        url = route.request.url
        if url.startswith(server) or url.startswith("data:"):
            if requested is not None:
                requested.append(url)
            route.continue_()
        else:
            problems.append(f"request left the machine: {url}")
            route.abort()

    context.route("**/*", guard)
    page = context.new_page()
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.url} ({r.failure})"))
    page.on(
        "response",
        lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None,
    )
    page.on(
        "console",
        lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    # "networkidle" also lets the root index.html follow its redirect to the intro page.
    page.goto(f"{server}/{page_path}", wait_until="networkidle")
    return context, page, problems


def _open(browser, server: str, page_path: str, shot: str) -> dict:
    context, page, problems = _offline_page(browser, server, page_path)
    if page.evaluate("() => document.querySelectorAll('.math').length > 0"):
        # A page with formulas must load MathJax and finish typesetting.
        page.wait_for_function(
            "() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=30_000
        )
        page.evaluate("() => MathJax.startup.promise")
    page.wait_for_load_state("networkidle")
    info = page.evaluate(
        """() => {
            const math = Array.from(document.querySelectorAll('.math'));
            return {
                containers: document.querySelectorAll('mjx-container').length,
                math_spans: math.length,
                untypeset: math.filter(e => !e.querySelector('mjx-container')).length,
                raw_dollars: (document.body.innerText.match(/\\$\\$/g) || []).length,
                raw_brackets: (document.body.innerText.match(/\\\\\\[|\\\\\\(/g) || []).length,
                title: document.title,
            };
        }"""
    )
    info["overflow"] = page.evaluate(_OVERFLOW_JS)
    info["column_width"] = page.evaluate(
        "() => { const c = document.querySelector('article.bd-article');"
        " return c ? Math.round(c.getBoundingClientRect().width) : null; }"
    )
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / shot), full_page=False)
    context.close()
    info["problems"] = problems
    return info


PAGES = ["index.html", *_toc_pages()]


@pytest.mark.parametrize("page_path", PAGES)
def test_page_loads_offline_and_typesets_math(browser, server, page_path):
    shot = page_path.replace("/", "_").replace(".html", ".png")
    info = _load(browser, server, page_path, shot)
    assert info["problems"] == [], "\n".join(info["problems"])
    if page_path.startswith("chapters/"):
        assert info["math_spans"] > 0, f"{page_path}: a chapter page without any formula?"
    if info["math_spans"]:
        assert info["containers"] > 0, f"{page_path}: no mjx-container, MathJax did not typeset"
    assert info["untypeset"] == 0, f"{page_path}: {info['untypeset']} math elements left as TeX"
    assert info["raw_dollars"] == 0, f"{page_path}: raw $$ left in the rendered text"
    assert info["raw_brackets"] == 0, f"{page_path}: raw \\( or \\[ left in the rendered text"


CHAPTER_PAGES = [p for p in PAGES if p.startswith("chapters/")]


@pytest.mark.parametrize("page_path", CHAPTER_PAGES)
def test_chapter_outputs_fit_their_column(browser, server, page_path):
    shot = page_path.replace("/", "_").replace(".html", ".png")
    info = _load(browser, server, page_path, shot)
    assert info["column_width"], f"{page_path}: no article.bd-article column found"
    cells = _code_cells(page_path)
    report = []
    for o in info["overflow"]:
        where = f"cell [{cells[o['cell']]}]" if o["cell"] < len(cells) else f"code cell #{o['cell']} of the page"
        report.append(
            f"{page_path} {where}: <{o['tag']}> hides {o['hidden']} px behind a scroll bar,"
            f" ends {o['outside']} px right of the {info['column_width']} px column;"
            f" longest line {o['chars']} chars (room for {o['fits']}): {o['line']!r}"
        )
    assert not report, "outputs wider than their column:\n" + "\n".join(report)


def test_chapter_pages_are_checked_for_overflow():
    assert "chapters/07_kernels.html" in CHAPTER_PAGES and len(CHAPTER_PAGES) >= 7


def test_pages_include_home_and_chapter_one():
    assert {"index.html", "book/intro.html", "chapters/01_why_position.html"} <= set(PAGES)


# --- No scaffolding on the rendered page (issue 33) -------------------------------------------
# Read from the built HTML itself (no browser needed): the text of a chapter or appendix page,
# collapsed cells included, and the text of each code cell's output block.

sys.path.insert(0, str(ROOT / "tests"))  # the book-wide rules: tests/test_presentation.py
from test_presentation import COLUMN_OF_TRUE  # noqa: E402

_SCAFFOLDING_ON_PAGE = re.compile(r"make test|NBVAL|\bin CI\b|test suite")


class _PageText(html.parser.HTMLParser):
    """All text of a page outside <script> and <style>, and the text of each div.cell_output."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.text: list[str] = []
        self.outputs: list[list[str]] = []
        self._skip = 0
        self._div_depth = 0
        self._output_at: list[int] = []  # div depths at which an open cell_output started

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif tag == "div":
            self._div_depth += 1
            if "cell_output" in (dict(attrs).get("class") or "").split():
                self._output_at.append(self._div_depth)
                self.outputs.append([])

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1
        elif tag == "div":
            if self._output_at and self._output_at[-1] == self._div_depth:
                self._output_at.pop()
            self._div_depth -= 1

    def handle_data(self, data):
        if not self._skip:
            self.text.append(data)
            if self._output_at:
                self.outputs[-1].append(data)


def _page_problems(source: str) -> list[str]:
    parsed = _PageText()
    parsed.feed(source)
    text = "".join(parsed.text)
    problems = [f"says {m.group(0)!r}: ...{text[max(m.start() - 50, 0):m.end() + 30]!r}..."
                for m in _SCAFFOLDING_ON_PAGE.finditer(text)]
    for index, output in enumerate(parsed.outputs):
        column = COLUMN_OF_TRUE.search("".join(output))
        if column:
            problems.append(f"output block {index} prints a column of True/False: {column.group(0).strip()[:100]!r}")
    return problems


READER_PAGES = [p for p in PAGES if p.startswith("chapters/") or p.startswith("book/appendix_")]


@pytest.mark.parametrize("page_path", READER_PAGES)
def test_rendered_pages_show_no_scaffolding(page_path):
    """No chapter or appendix page, as built, names `make test`, NBVAL, CI or the test suite, or
    shows a column of True (the pages on running the book and on the package may name them)."""
    path = SITE / page_path
    if not path.exists():
        pytest.fail(f"{path} does not exist: run `make book` first")
    problems = _page_problems(path.read_text(encoding="utf-8"))
    assert not problems, f"{page_path}:\n" + "\n".join(problems)


def test_the_page_check_itself():
    clean = '<div class="cell_output docutils container"><pre>a: True\nb: 4.0\n</pre></div><p>text</p>'
    assert _page_problems(clean) == []
    assert _page_problems('<div class="cell_output"><div><pre>a: True\nb: False\n</pre></div></div>')
    assert _page_problems("<p>run <code>make test</code> first</p>")
    assert _page_problems("<pre># NBVAL_IGNORE_OUTPUT: timing</pre>")
    assert _page_problems("<script>var x = 'make test';</script>") == []
    # a column outside any output block (prose, code) is not an output's column
    assert _page_problems("<pre>x = True\ny = False\n</pre>") == []


# --- Interactive figures (issue 34) -----------------------------------------------------------
# Each page that holds a companion.interactive figure is opened with the network blocked; the
# test moves a slider or picks an option as a reader would (keyboard on the range input,
# select_option on the menu) and checks the value the page shows against a value computed
# here from the formula, independently of the package, and that the chart's data changed.

INTERACTIVE = {
    "chapters/05_rope.html": ["rope-clock", "score-distance"],
    "chapters/09_rope_scaling.html": ["scaling-methods"],
    "chapters/11_newer_encodings.html": ["position-biases"],
}
PLOTLY_PATH = "plotly/plotly-cartesian.min.js"


def _figure_blocks(source: str) -> dict[str, int]:
    """``figure id -> bytes of its HTML block`` for every interactive figure in a built page."""
    found = {}
    for m in re.finditer(r'<div class="pe-interactive" id="pe-([a-z0-9-]+)"', source):
        end = source.find("})();</script></div>", m.start())
        assert end > 0, f"figure {m.group(1)}: its block does not end with the figure script"
        found[m.group(1)] = end + len("})();</script></div>") - m.start()
    return found


def test_interactive_figures_are_where_the_book_says_and_within_budget():
    """Read from the built HTML: exactly the listed pages hold interactive figures, each figure
    adds at most 1 MB to its page, and only those pages load Plotly.js, once."""
    from companion.interactive import MAX_FIGURE_BYTES, PLOTLY_JS

    assert PLOTLY_JS == PLOTLY_PATH
    assert (SITE / PLOTLY_PATH).is_file(), f"{SITE / PLOTLY_PATH} missing: make book copies it from npm"
    seen = {}
    for page in PAGES:
        source = (SITE / page).read_text(encoding="utf-8")
        blocks = _figure_blocks(source)
        loads = len(re.findall(r'<script[^>]*src="[^"]*' + re.escape(PLOTLY_PATH), source))
        if blocks:
            seen[page] = sorted(blocks)
            assert loads == 1, f"{page}: Plotly.js referenced {loads} times (once per page)"
            for fid, size in blocks.items():
                assert size <= MAX_FIGURE_BYTES, f"{page} figure {fid}: {size:,} bytes > {MAX_FIGURE_BYTES:,}"
                assert "data:image/png;base64," in source, f"{page}: no static fallback image"
        else:
            assert loads == 0, f"{page} has no interactive figure but loads Plotly.js"
    assert seen == {page: sorted(ids) for page, ids in INTERACTIVE.items()}


def _open_interactive(browser, server: str, page_path: str):
    requested: list[str] = []
    context, page, problems = _offline_page(browser, server, page_path, requested)
    plotly_loads = [url for url in requested if PLOTLY_PATH in url]
    ids = INTERACTIVE[page_path]
    page.wait_for_function(
        "() => { const figs = Array.from(document.querySelectorAll('.pe-interactive[data-state]'));"
        f" return figs.length === {len(ids)} && figs.every(f => f.querySelector('.pe-plot .main-svg')); }}",
        timeout=30_000)
    return context, page, problems, plotly_loads


@contextlib.contextmanager
def _interactive(browser, server: str, page_path: str):
    """The page with its figures drawn, and the Plotly.js requests; on leaving, no request left
    the machine and the page logged no error."""
    context, page, problems, loads = _open_interactive(browser, server, page_path)
    try:
        yield page, loads
        assert problems == [], "\n".join(problems)
    finally:
        context.close()


def _all_y(page, fid: str) -> list:
    return page.evaluate(f"() => document.querySelector('#pe-{fid} .pe-plot').data.map(t => Array.from(t.y))")


def _trace_y(page, fid: str, index: int) -> list:
    return page.evaluate(f"() => Array.from(document.querySelector('#pe-{fid} .pe-plot').data[{index}].y)")


def _readout(page, fid: str) -> str:
    return page.locator(f"#pe-{fid} .pe-readout").inner_text()


def _step_slider(page, fid: str, control: str, target_label: str, key: str = "ArrowRight") -> None:
    slider = page.locator(f"#pe-{fid} input[data-control={control}]")
    shown = page.locator(f"#pe-{fid} input[data-control={control}] + output")
    for _ in range(40):
        if shown.inner_text() == target_label:
            return
        slider.press(key)
    raise AssertionError(f"{fid}: the {control} slider never showed {target_label!r} (shows {shown.inner_text()!r})")


def test_chapter5_figures_respond_offline(browser, server):
    with _interactive(browser, server, "chapters/05_rope.html") as (page, loads):
        # RoPE's clock at base 500000: count the pairs that turn within L = 4096, from the formula
        before = _trace_y(page, "rope-clock", 1)
        _step_slider(page, "rope-clock", "base", "500,000")
        wl = [2 * math.pi * 500000.0 ** (2 * i / 128) for i in range(64)]
        full = sum(w <= 4096 for w in wl)
        text = _readout(page, "rope-clock")
        assert f"{full} of 64 pairs turn fully" in text and f"{wl[-1]:,.0f} positions" in text, text
        after = _trace_y(page, "rope-clock", 1)
        assert after != before and abs(after[-1] / wl[-1] - 1) < 1e-3
        # score against distance at base 10^6: the first distance where sum_i cos(r theta_i) < 0
        before = _trace_y(page, "score-distance", 0)
        _step_slider(page, "score-distance", "base", "1,000,000")
        theta = [1e6 ** (-2 * i / 128) for i in range(64)]
        first = next(r for r in range(1, 32769) if sum(math.cos(r * t) for t in theta) < 0)
        assert f"r = {first:,}" in _readout(page, "score-distance"), _readout(page, "score-distance")
        assert _trace_y(page, "score-distance", 0) != before
        assert len(loads) == 1, f"Plotly.js loaded {len(loads)} times on a page with two figures"


def test_chapter9_scaling_figure_responds_offline(browser, server):
    with _interactive(browser, server, "chapters/09_rope_scaling.html") as (page, _):
        fid = "scaling-methods"
        before = _all_y(page, fid)
        page.locator(f"#pe-{fid} select[data-control=config]").select_option(label="Llama 3.1 8B")
        page.locator(f"#pe-{fid} select[data-control=method]").select_option(label="Llama 3 scaling")
        _step_slider(page, fid, "factor", "8")
        # Llama 3.1: wavelengths below L / 4 kept, above L slowed by the full factor (L = 8192)
        wl = [2 * math.pi * 500000.0 ** (2 * i / 128) for i in range(64)]
        kept, full = sum(w < 8192 / 4 for w in wl), sum(w > 8192 for w in wl)
        text = _readout(page, fid)
        assert f"{kept} of 64 pairs kept, {full} slowed by the full 8x" in text, text
        assert "attention factor 1.0000" in text and text.startswith("Llama 3.1 8B"), text
        assert _all_y(page, fid) != before
        # the lab model has LongRoPE factors only up to s = 8: the factor slider stops there
        page.locator(f"#pe-{fid} select[data-control=config]").select_option(label="the lab model (chapter 8)")
        page.locator(f"#pe-{fid} select[data-control=method]").select_option(label="LongRoPE (searched)")
        slider = page.locator(f"#pe-{fid} input[data-control=factor]")
        slider.press("End")
        assert page.locator(f"#pe-{fid} input[data-control=factor] + output").inner_text() == "8"
        assert "LongRoPE" in _readout(page, fid) and "s = 8," in _readout(page, fid)


def test_chapter11_bias_figure_responds_offline(browser, server):
    with _interactive(browser, server, "chapters/11_newer_encodings.html") as (page, _):
        fid = "position-biases"
        before = _trace_y(page, fid, 1)
        _step_slider(page, fid, "heads", "12")
        page.locator(f"#pe-{fid} input[data-control=head]").press("End")
        # the ALiBi paper's rule for 12 heads: 8 slopes of 8 heads, then 2^(-8h/16) for h = 1, 3, 5, 7
        slopes = [2 ** (-8 * h / 8) for h in range(1, 9)] + [2 ** (-8 * h / 16) for h in (1, 3, 5, 7)]
        text = _readout(page, fid)
        assert text.startswith("ALiBi, head 12 of 12") and f"slope m = {slopes[11]:.6g}" in text, text
        assert _trace_y(page, fid, 1) != before
        # fewer heads: the head slider moves down to the last head there is
        _step_slider(page, fid, "heads", "4", key="ArrowLeft")
        assert _readout(page, fid).startswith("ALiBi, head 4 of 4"), _readout(page, fid)
        page.locator(f"#pe-{fid} select[data-control=scheme]").select_option(label="FIRE")
        assert _readout(page, fid).startswith("FIRE, head 4 of 4"), _readout(page, fid)
        assert len(page.evaluate(f"() => document.querySelector('#pe-{fid} .pe-plot').data")) == 3
