"""Argument checks shared by the package's command lines.

Every command line checks all of its arguments before it trains, loads or downloads
anything, and reports a bad one as the parser's usage error (exit status 2, the message
naming the flag, what it got and what is allowed), never as a traceback after minutes of
work. The rules themselves are the library's (a config dataclass, a ``check_*`` function);
:func:`usage_errors` turns their ``TypeError`` and ``ValueError`` into that usage error.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

from ._checks import check_positive_int

__all__ = ["usage_errors", "as_flags", "check_distinct", "check_seeds", "check_file_target", "check_folder_target",
           "check_existing_file", "check_run_flags"]


def as_flags(text: str, configs: Sequence[type]) -> str:
    """``text`` with every field name of the dataclasses ``configs`` written as its option
    (``steps`` as ``--steps``, ``d_model`` as ``--d-model``)."""
    for cls in configs:
        for f in fields(cls):
            text = re.sub(rf"(?<![\w-]){re.escape(f.name)}(?![\w-])", "--" + f.name.replace("_", "-"), text)
    return text


@contextmanager
def usage_errors(parser: argparse.ArgumentParser, flag: str | None = None,
                 configs: Sequence[type] = ()) -> Iterator[None]:
    """Turn a ``TypeError`` or ``ValueError`` raised inside the block into ``parser.error``.

    The message is ``"argument FLAG: <the error>"``, or without ``flag`` the error with the
    field names of the dataclasses ``configs`` written as options (:func:`as_flags`), so
    that an error from a config's own checks names the flags it is about.
    """
    try:
        yield
    except (TypeError, ValueError) as exc:
        text = as_flags(str(exc), configs)
        parser.error(text if flag is None else f"argument {flag}: {text}")


def check_distinct(values: Sequence[object], name: str) -> list:
    """Require no value twice in ``values`` (a repeated scheme, seed or method would run, and
    be stored, twice). Returns ``values`` as a list."""
    values = list(values)
    repeated = sorted({repr(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{name} must not repeat a value, got {values} (repeated: {', '.join(repeated)})")
    return values


def check_seeds(seeds: Sequence[int], name: str) -> list[int]:
    """Require seeds that are ints >= 0, none twice. Returns them as a list."""
    for seed in seeds:
        check_positive_int(seed, name, 0)
    return check_distinct(seeds, name)


def check_file_target(path: str | os.PathLike[str] | None, name: str) -> None:
    """Require an output file path that is not an existing folder (``None`` passes)."""
    if path is not None and Path(path).is_dir():
        raise ValueError(f"{name} must be a file path, got the existing folder {str(path)!r}")


def check_folder_target(path: str | os.PathLike[str] | None, name: str) -> None:
    """Require a folder path that is not an existing file (``None`` passes)."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"{name} must be a folder, got the existing file {str(path)!r}")


def check_existing_file(path: str | os.PathLike[str], name: str) -> Path:
    """Require an existing file (not a folder); return it as a ``Path``."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{name} must be a file, got the folder {str(path)!r}")
    if not p.is_file():
        raise ValueError(f"{name} must be an existing file, got {str(path)!r}, which does not exist")
    return p


def check_run_flags(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """The flags the experiment scripts share (``--schemes`` with no repeat, ``--seeds``,
    ``--steps`` and ``--threads`` >= 1, ``--out`` not a folder), each a usage error naming it."""
    with usage_errors(parser, "--schemes"):
        check_distinct(ns.schemes, "schemes")
    with usage_errors(parser, "--seeds"):
        check_seeds(ns.seeds, "seeds")
    for flag in ("steps", "threads"):
        with usage_errors(parser, "--" + flag):
            check_positive_int(getattr(ns, flag), flag)
    with usage_errors(parser, "--out"):
        check_file_target(ns.out, "out")
