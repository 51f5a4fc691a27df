"""The lab's corpus: the Python standard library's own source, read as bytes.

Real text that every Python installation carries, so the experiments need no download and no
tokenizer: the vocabulary is the 256 byte values, and a model's loss in bits per byte can be
compared with any compressor's. The corpus is the ``*.py`` files under the running
interpreter's standard-library directory (``sysconfig.get_paths()["stdlib"]``), leaving out
every ``test``/``tests`` directory (the test suites are large, repetitive and full of
deliberately odd code), ``site-packages`` (whatever the user installed) and ``__pycache__``.

Files are assigned to the training or the validation split by a hash of their path relative
to the standard-library root, so the split is the same on every machine with the same Python
version, and a file never contributes to both splits. Another Python version ships other
files and gives another corpus: :attr:`Corpus.info` records the version, file counts and byte
counts, and every lab result stores it in its provenance.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._checks import check_finite_number

__all__ = ["Corpus", "load_corpus", "stdlib_files", "EXCLUDED_DIRS"]

#: Directory names skipped anywhere under the standard-library root.
EXCLUDED_DIRS: frozenset[str] = frozenset({"test", "tests", "site-packages", "__pycache__"})


def stdlib_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The corpus files: ``*.py`` under ``root`` (default: this interpreter's stdlib), sorted.

    Paths are returned relative to ``root``, in sorted order, with :data:`EXCLUDED_DIRS`
    pruned at every depth.
    """
    base = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not base.is_dir():
        raise ValueError(f"root must be an existing directory, got {str(base)!r}")
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                found.append((Path(dirpath) / name).relative_to(base))
    return sorted(found, key=lambda p: p.as_posix())


def split_of(relative_path: Path, val_fraction: float) -> str:
    """``"val"`` or ``"train"`` for a file, from the SHA-256 of its POSIX relative path.

    The first 8 bytes of the digest, read as an integer and divided by ``2**64``, give a
    number uniform in ``[0, 1)``; the file is a validation file when it is below
    ``val_fraction``. It depends on nothing but the path.
    """
    digest = hashlib.sha256(relative_path.as_posix().encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "val" if u < val_fraction else "train"


@dataclass(frozen=True)
class Corpus:
    """Training and validation bytes (``uint8`` arrays) and where they came from."""

    train: np.ndarray
    val: np.ndarray
    info: dict = field(default_factory=dict)


def load_corpus(
    root: str | os.PathLike[str] | None = None,
    *,
    val_fraction: float = 0.1,
) -> Corpus:
    """Read the corpus and split it by file.

    Each split is its files' bytes concatenated in sorted path order, one newline between
    files.

    Args:
        root: the directory to read (default: the running interpreter's standard library).
        val_fraction: expected fraction of files in the validation split, in ``(0, 1)``.

    Returns:
        A :class:`Corpus` whose ``info`` holds the Python version and implementation, the
        root, the excluded directory names, the split rule, and the file and byte counts of
        each split.
    """
    val_fraction = check_finite_number(val_fraction, "val_fraction")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    base = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    files = stdlib_files(base)
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    for rel in files:
        parts[split_of(rel, val_fraction)].append((base / rel).read_bytes())
    if not parts["train"] or not parts["val"]:
        raise ValueError(
            f"root {str(base)!r} has {len(files)} .py files, too few to give both a training "
            f"and a validation split at val_fraction = {val_fraction}"
        )
    arrays = {k: np.frombuffer(b"\n".join(v), dtype=np.uint8) for k, v in parts.items()}
    info = {
        "source": "stdlib *.py" if root is None else "*.py",
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "root": str(base),
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "split": f"sha256(relative path)[:8] / 2**64 < {val_fraction} -> val",
        "files": {k: len(v) for k, v in parts.items()},
        "bytes": {k: int(a.size) for k, a in arrays.items()},
    }
    return Corpus(train=arrays["train"], val=arrays["val"], info=info)
