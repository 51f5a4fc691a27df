"""Sphinx extension: keep the built site self-contained and free of script errors.

Jupyter Book 1.x always loads sphinx-thebe, whose inline configuration script ends up twice on
every page (a ``const`` declared twice is a page error) and which points at a CDN. The book has
no live-code cells, so the thebe scripts are dropped entirely. The theme's colour mode is set
explicitly, since an empty one makes the theme log a console error on load.

Pages that hold an interactive figure (:mod:`companion.interactive`, a ``div.pe-interactive``
in a cell's output) get Plotly.js, once, with ``defer``: the site serves it from
``plotly/`` (copied from npm by ``make book``, like MathJax), and pages without such a figure
do not load it.
"""

from __future__ import annotations

from typing import Any


def _drop_thebe(app: Any, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    kept, seen = [], set()
    for js in scripts:
        name = str(getattr(js, "filename", js) or "")
        body = str(getattr(js, "attributes", {}).get("body", ""))
        if "thebe" in name.lower() or "THEBE_JS_URL" in body:
            continue
        key = (name, body)
        if key in seen:
            continue
        seen.add(key)
        kept.append(js)
    scripts[:] = kept


#: Where the site serves Plotly.js, relative to its root (companion.interactive.PLOTLY_JS).
PLOTLY_JS = "plotly/plotly-cartesian.min.js"
INTERACTIVE_MARK = 'class="pe-interactive"'


def _add_plotly(app: Any, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    if INTERACTIVE_MARK not in str(context.get("body", "")):
        return
    from sphinx.builders.html._assets import _JavaScript

    scripts = context.setdefault("script_files", [])
    if not any(str(getattr(js, "filename", js)) == PLOTLY_JS for js in scripts):
        scripts.append(_JavaScript(PLOTLY_JS, defer="defer"))


def _default_mode(app: Any, config: Any) -> None:
    config.html_context = {**(config.html_context or {}), "default_mode": "auto"}


def setup(app: Any) -> dict[str, Any]:
    app.connect("config-inited", _default_mode)
    app.connect("html-page-context", _drop_thebe, priority=900)
    app.connect("html-page-context", _add_plotly, priority=901)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
