"""Argument checks and run options shared by the package's command lines.

Every command line checks all of its arguments before it trains, loads or downloads
anything, and reports a bad one as the parser's usage error (exit status 2, the message
naming the flag, what it got and what is allowed), never as a traceback after minutes of
work. The rules themselves are the library's (a config dataclass, a ``check_*`` function);
:func:`usage_errors` turns their ``TypeError`` and ``ValueError`` into that usage error.

The run options are shared too: ``--quick`` (:func:`apply_quick`: a preset of small values for
a smoke run, which explicit flags override, and :func:`mark_quick_csv` for what it writes) and
progress lines on stderr that ``--quiet`` silences (:func:`say`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

from ._checks import check_positive_int

__all__ = ["usage_errors", "as_flags", "check_distinct", "check_seeds", "check_file_target", "check_folder_target",
           "check_existing_file", "check_run_flags", "SMOKE_RUN", "QUICK_HELP", "preset_text", "apply_quick",
           "mark_quick_csv", "say"]


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


# ----------------------------------------------------------------------------- --quick presets

#: What a ``--quick`` run says of itself, at its start and beside its results.
SMOKE_RUN = "SMOKE RUN (--quick): small settings to try the command, not a measurement"

#: The ``--help`` text of ``--quick`` (the command adds what its preset sets).
QUICK_HELP = ("a smoke run of about a minute: small settings for trying the command before the real run; "
              "explicit flags override them, and a file written records \"quick\": true")


def _option(key: str, value: object) -> str:
    """``key`` and ``value`` as they are written on a command line (``--steps 100``)."""
    shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return f"--{key.replace('_', '-')} {shown}"


def preset_text(preset: dict[str, object]) -> str:
    """The options of a preset, as a command line writes them (for ``--help``)."""
    return " ".join(_option(k, v) for k, v in preset.items())


def apply_quick(parser: argparse.ArgumentParser, command: argparse.ArgumentParser, argv: list[str],
                ns: argparse.Namespace, preset: dict[str, object]) -> argparse.Namespace:
    """With ``ns.quick``, parse ``argv`` again with ``preset`` as ``command``'s defaults, so that
    every flag given explicitly keeps its value and every other flag of the preset takes the
    preset's; print what the preset set (and what the command line kept) and :data:`SMOKE_RUN`.
    Without ``ns.quick``, return ``ns`` as it is.

    ``parser`` is the top-level parser and ``command`` the (sub)parser whose defaults the preset
    replaces (the same parser for a command without subcommands).
    """
    if not getattr(ns, "quick", False):
        return ns
    command.set_defaults(**preset)
    ns = parser.parse_args(argv)
    given = [k for k, v in preset.items() if getattr(ns, k) != v]
    applied = {k: v for k, v in preset.items() if k not in given}
    kept = f"; kept from the command line: {' '.join(_option(k, getattr(ns, k)) for k in given)}" if given else ""
    print(f"{SMOKE_RUN}.\n--quick set {preset_text(applied)}{kept}", flush=True)
    return ns


def mark_quick_csv(path: str | os.PathLike[str]) -> None:
    """Add ``"quick": true`` to the provenance line of a CSV written by
    :func:`companion.utils.save_csv` (``# provenance: {json}``, its first line), so that a smoke
    run's file cannot pass for a measurement."""
    path = Path(path)
    with open(path, newline="") as f:  # newline="": keep save_csv's CRLFs as they are
        text = f.read()
    first, end, rest = text.partition("\r\n")
    prefix = "# provenance: "
    if not first.startswith(prefix):
        raise ValueError(f"{path} is not a result CSV of save_csv (its first line must start with {prefix!r})")
    prov = json.loads(first[len(prefix):])
    prov["quick"] = True
    with open(path, "w", newline="") as f:
        f.write(prefix + json.dumps(prov, sort_keys=False) + end + rest)


def save_rows(out: str | os.PathLike[str], json_path: str | os.PathLike[str] | None, result: dict,
              fields: Sequence[str], *, command: str, quick: bool) -> None:
    """Store a run's ``result["rows"]`` as the CSV ``out`` (:func:`companion.utils.save_csv`)
    and, with ``json_path``, the rest of ``result`` as a JSON sidecar
    (:func:`companion.utils.save_result`); after ``--quick`` both record ``"quick": true``."""
    from .utils import save_csv, save_result

    save_csv(out, result["rows"], fields, command=command)
    if quick:
        mark_quick_csv(out)
    if json_path:
        side = {k: v for k, v in result.items() if k != "rows"}
        save_result(json_path, {**side, "quick": True} if quick else side, command=command)


def say(quiet: bool):  # noqa: ANN201 - a callable taking a string
    """A progress printer for a command line: each message a line on stderr, or nothing with
    ``quiet`` (``--quiet``). Results go to stdout; progress never does."""
    def progress(message: str) -> None:
        if not quiet:
            print(message, file=sys.stderr, flush=True)

    return progress
