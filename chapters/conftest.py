"""nbval comment markers must carry a reason: ``# NBVAL_IGNORE_OUTPUT: timing on a shared CPU``.

nbval itself recognises a marker only when the comment is exactly its name, so a reason on the
same line would silently turn the marker off. This plugin, loaded by pytest for every notebook
under ``chapters/``, accepts ``# NBVAL_NAME: reason`` and rejects a bare ``# NBVAL_NAME``: an
ignored output with no stated reason is a quiet opt-out (DESIGN.md section 4). The static
check of the committed notebooks is ``tests/test_portability.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import nbval.plugin as _nbval

#: ``# NBVAL_NAME: a reason of at least two words``
MARKER = re.compile(r"^#\s*(NBVAL_[A-Z_]+)\s*(?::\s*(.*?))?\s*$")


def parse_marker(line: str) -> tuple[str, str] | None:
    """``(marker, reason)`` if ``line`` is an nbval marker comment, else ``None``.

    Raises ``ValueError`` for a marker with no reason, or a reason of a single word.
    """
    match = MARKER.match(line.strip())
    if match is None or match.group(1) not in _nbval.comment_markers:
        return None
    marker, reason = match.group(1), (match.group(2) or "").strip()
    if len(reason.split()) < 2:
        raise ValueError(
            f"'{line.strip()}': an nbval marker must say why on the same line, "
            f"for example '# {marker}: timing on a shared machine'"
        )
    return marker, reason


_find_comment_markers = _nbval.find_comment_markers


def _find_reasoned_markers(cellsource: str) -> Iterator[tuple[str, bool]]:
    markers = [parse_marker(line) for line in cellsource.splitlines()]
    yield from _find_comment_markers("\n".join(f"# {m[0]}" for m in markers if m is not None))


_nbval.find_comment_markers = _find_reasoned_markers
