"""A real headless Chromium loads the built site with the network blocked.

For the home page and every page in the table of contents it checks that MathJax typeset the formulas (the
DOM holds ``mjx-container`` elements, every math span was converted, no raw ``$$`` is left)
and that no asset failed to load (no failed request, no HTTP error, no console error, no
request that tried to leave the machine). Screenshots go to ``_build/screenshots/``.

The site is served from 127.0.0.1 by a thread of this process, like GitHub Pages would serve
it. Everything else is unreachable: the host resolver maps every name to nothing, a dead proxy
takes any non-loopback request, and a route handler aborts (and records) any request that is
not for the local server.

Run ``make book`` (or ``make test``) first. Without Chromium the test skips with a message,
except under ``CI=true`` where it must run.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import threading
from pathlib import Path

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


def _load(browser, server: str, page_path: str, shot: str) -> dict:
    """Open one page; return what the checks need."""
    problems: list[str] = []
    context = browser.new_context(viewport={"width": 1280, "height": 900})

    def guard(route):
        url = route.request.url
        if url.startswith(server) or url.startswith("data:"):
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


def test_pages_include_home_and_chapter_one():
    assert {"index.html", "book/intro.html", "chapters/01_why_position.html"} <= set(PAGES)
