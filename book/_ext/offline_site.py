"""Sphinx extension: keep the built site self-contained and free of script errors.

Jupyter Book 1.x always loads sphinx-thebe, whose inline configuration script ends up twice on
every page (a ``const`` declared twice is a page error) and which points at a CDN. The book has
no live-code cells, so the thebe scripts are dropped entirely. The theme's colour mode is set
explicitly, since an empty one makes the theme log a console error on load.
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


def _default_mode(app: Any, config: Any) -> None:
    config.html_context = {**(config.html_context or {}), "default_mode": "auto"}


def setup(app: Any) -> dict[str, Any]:
    app.connect("config-inited", _default_mode)
    app.connect("html-page-context", _drop_thebe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
