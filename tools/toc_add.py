"""Add a chapter to _toc.yml's "Chapters" part, keeping chapters in file-name order.

    python tools/toc_add.py chapters/05_rope

Safe to run from several processes at once (it holds a lock while it edits).
"""

from __future__ import annotations

import fcntl
import re
import sys
from pathlib import Path

TOC = Path(__file__).resolve().parents[1] / "_toc.yml"


def add(entry: str) -> bool:
    entry = entry.removesuffix(".ipynb").removesuffix(".md")
    if not re.fullmatch(r"chapters/[\w\-]+", entry):
        raise SystemExit(f"expected chapters/<name>, got {entry!r}")
    with open(TOC.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lines = TOC.read_text().splitlines()
        if any(line.strip() == f"- file: {entry}" for line in lines):
            return False
        idx = [i for i, line in enumerate(lines) if line.strip().startswith("- file: chapters/")]
        if not idx:
            raise SystemExit("no chapters part in _toc.yml")
        indent = lines[idx[0]][: len(lines[idx[0]]) - len(lines[idx[0]].lstrip())]
        pos = next((i for i in idx if lines[i].strip()[len("- file: "):] > entry), idx[-1] + 1)
        lines.insert(pos, f"{indent}- file: {entry}")
        TOC.write_text("\n".join(lines) + "\n")
    return True


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(("added " if add(arg) else "already listed: ") + arg)
