"""Notebook maintenance: execute chapters in place, or build one from a MyST text source.

    python tools/nb.py execute chapters/01_why_position.ipynb [more.ipynb ...]
    python tools/nb.py from-md draft.md chapters/05_rope.ipynb [--execute]
    python tools/nb.py to-md chapters/05_rope.ipynb draft.md

``execute`` runs each notebook top to bottom in its own folder with the current Python's
kernel, stores the outputs (which the site renders and nbval checks) and prints the wall time.
``from-md`` converts a MyST-NB text notebook, where code cells are fenced as
```` ```{code-cell} ipython3 ```` blocks and everything else is markdown, into ``.ipynb``.
Cell metadata lines such as ``:tags: [hide-input]`` directly after the fence are honoured.
``to-md`` writes a notebook's sources back in that form (outputs are dropped), for editing a
chapter as text.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}
_FENCE = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


def from_md(text: str) -> nbformat.NotebookNode:
    """Parse MyST-NB text into a notebook (no outputs)."""
    cells = []
    pos = 0
    for m in _FENCE.finditer(text):
        md = text[pos : m.start()].strip("\n")
        if md.strip():
            cells.append(nbformat.v4.new_markdown_cell(md))
        body = m.group(1)
        meta: dict = {}
        lines = body.split("\n")
        while lines and lines[0].startswith(":") and ":" in lines[0][1:]:
            key, _, val = lines.pop(0)[1:].partition(":")
            val = val.strip()
            if val.startswith("[") and val.endswith("]"):
                meta[key.strip()] = [v.strip() for v in val[1:-1].split(",") if v.strip()]
            else:
                meta[key.strip()] = val
        if lines and not lines[0].strip():
            lines.pop(0)
        cells.append(nbformat.v4.new_code_cell("\n".join(lines).rstrip("\n"), metadata=meta))
        pos = m.end()
    tail = text[pos:].strip("\n")
    if tail.strip():
        cells.append(nbformat.v4.new_markdown_cell(tail))
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def to_md(nb: nbformat.NotebookNode) -> str:
    """The MyST-NB text of a notebook's cells (``from_md``'s inverse, outputs dropped)."""
    parts = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            meta = "".join(f":{k}: [{', '.join(v)}]\n" if isinstance(v, list) else f":{k}: {v}\n"
                           for k, v in cell.metadata.items()
                           if k == "tags" or (isinstance(v, str) and "\n" not in v and ":" not in k))
            parts.append(f"```{{code-cell}} ipython3\n{meta}{chr(10) if meta else ''}{cell.source}\n```")
        else:
            parts.append(cell.source)
    return "\n\n".join(parts) + "\n"


def execute(path: Path, timeout: int = 900) -> float:
    """Execute ``path`` in place; return the wall time in seconds."""
    nb = nbformat.read(path, as_version=4)
    nb.metadata["kernelspec"] = KERNELSPEC
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    t0 = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - t0
    for cell in nb.cells:  # keep diffs quiet: no per-run timestamps
        cell.get("metadata", {}).pop("execution", None)
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("execute", help="execute notebooks in place")
    ex.add_argument("notebooks", nargs="+", type=Path)
    ex.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    fm = sub.add_parser("from-md", help="convert MyST text to .ipynb")
    fm.add_argument("source", type=Path)
    fm.add_argument("target", type=Path)
    fm.add_argument("--execute", action="store_true")
    tm = sub.add_parser("to-md", help="write a notebook's sources as MyST text")
    tm.add_argument("source", type=Path)
    tm.add_argument("target", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "to-md":
        args.target.write_text(to_md(nbformat.read(args.source, as_version=4)))
        print(f"wrote {args.target}")
        return 0
    if args.cmd == "from-md":
        nbformat.write(from_md(args.source.read_text()), args.target)
        print(f"wrote {args.target}")
        if args.execute:
            print(f"{args.target}: executed in {execute(args.target):.1f} s")
        return 0
    for path in args.notebooks:
        print(f"{path}: executed in {execute(path, args.timeout):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
