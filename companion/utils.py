"""Reproducibility helpers: seeding and result files with provenance.

Every experiment result under ``chapters/data/`` is written by :func:`save_result`, which
stores next to the data the command that produced it, the git commit, library versions, the
date and the machine, so a figure in the book can always be traced to the run behind it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import random
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._checks import check_file, check_path

__all__ = ["seed_everything", "provenance", "numeric_config", "cpu_model", "save_result", "load_result", "save_csv", "load_csv", "peak_tensor_bytes",
           "SCHEDULING_FLAGS", "shown_command"]


def seed_everything(seed: int = 0) -> torch.Generator:
    """Seed Python's ``random``, NumPy and torch, and return a seeded ``torch.Generator``.

    Notebooks call this at the top so that every printed number reproduces exactly on the
    pinned stack. The returned generator is for code that wants its own stream.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be a non-negative int below 2**64 (what torch.manual_seed takes), got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def _git_commit(cwd: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd, capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


#: Environment variables that change floating-point results on the same machine; recorded in
#: every provenance so that a stored number can be traced to the numeric configuration.
NUMERIC_ENV_VARS: tuple[str, ...] = (
    "ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "OPENBLAS_CORETYPE", "TRITON_INTERPRET",
)


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, ``sysctl`` on macOS), or ``None``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=10
            )
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or None


def _torch_build_setting(key: str) -> str | None:
    config = torch.__config__.show()
    marker = f"{key}="
    if marker not in config:
        return None
    return config.split(marker, 1)[1].split(",", 1)[0].strip() or None


def numeric_config() -> dict[str, Any]:
    """What decides float rounding here: CPU, torch's vector kernels, BLAS and threads.

    Two machines that agree on every field compute the same float32 results with the pinned
    stack; a difference in any of them (another CPU, ``ATEN_CPU_CAPABILITY``, ``MKL_CBWR``,
    the thread count) may change the last bits, which training then amplifies.
    """
    return {
        "cpu_model": cpu_model(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": _torch_build_setting("BLAS_INFO"),
        "mkl_available": torch.backends.mkl.is_available(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "env": {name: os.environ[name] for name in NUMERIC_ENV_VARS if name in os.environ},
    }


def provenance(command: str | None = None) -> dict[str, Any]:
    """Describe the run: command, git commit, versions, UTC date, machine and numeric config.

    The numeric configuration (:func:`numeric_config`: CPU model, torch's CPU capability, the
    BLAS library, thread counts and the environment variables that change rounding) is what
    a reader needs to know to tell whether their machine should reproduce a stored number
    bit for bit, or only to the precision the book prints.
    """
    info: dict[str, Any] = {
        "command": command,
        "git_commit": _git_commit(Path(__file__).resolve().parent),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        **numeric_config(),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
    return info


def _to_json(obj: Any) -> Any:
    """``json.dumps`` fallback: tensors and numpy arrays become (nested) lists, numpy and
    0-d tensor scalars Python numbers; anything else raises ``TypeError`` naming its type."""
    if isinstance(obj, torch.Tensor):
        if obj.is_nested:  # a list of tensors of different shapes
            return [t.detach().cpu().tolist() for t in obj.unbind()]
        return obj.detach().cpu().tolist()
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.tolist()
    raise TypeError(
        f"save_result cannot serialise a {type(obj).__name__} in data; use numbers, strings, "
        f"lists, dicts, torch tensors or numpy arrays"
    )


def _check_keys(obj: Any, where: str = "data", seen: frozenset[int] = frozenset()) -> None:
    """Every dict key in ``data`` must be a ``str``: JSON object keys are strings, so an int
    key ``1`` would be read back as ``"1"`` and a tuple key cannot be written at all. A
    container met again inside itself is left to ``json``'s circular-reference error."""
    if id(obj) in seen:
        return
    seen = seen | {id(obj)}
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"save_result needs string keys in data (JSON object keys are strings, so "
                    f"{key!r} would not come back as written), got the {type(key).__name__} key "
                    f"{key!r} in {where}; use str(key)"
                )
            _check_keys(value, f"{where}[{key!r}]", seen)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _check_keys(value, f"{where}[{i}]", seen)


def _dumps(obj: Any, depth: int = 0) -> str:
    """Indented JSON in which a list of numbers, strings or lists of them sits on one line:
    readable and diffable for records, compact for the long arrays of per-block values."""
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = (f"{inner}{json.dumps(k)}: {_dumps(v, depth + 1)}" for k, v in obj.items())
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(v, dict) for v in obj):
        return "[\n" + ",\n".join(inner + _dumps(v, depth + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj)


def save_result(path: str | os.PathLike[str], data: Any, command: str | None = None) -> Path:
    """Write ``{"provenance": ..., "data": data}`` as indented JSON and return the path.

    Records are indented one key per line; lists without records in them (the per-block and
    per-trial values, say) are written on one line.

    Torch tensors (nested ones too) and numpy arrays in ``data`` are written as (nested)
    lists, numpy scalars as Python numbers; ``nan`` and ``inf`` are written as JSON's
    ``NaN``/``Infinity`` extension and read back by :func:`load_result`. Dict keys must be
    strings. ``command`` is a string or ``None``. Nothing is written if ``data`` cannot be
    serialised (``TypeError``, or ``ValueError`` for a circular reference); ``path`` must be
    a file path, not a folder (``IsADirectoryError``).
    """
    path = check_path(path)
    if command is not None and not isinstance(command, str):
        raise TypeError(f"command must be a str or None, got {type(command).__name__}")
    if path.is_dir():
        raise IsADirectoryError(f"path {path} is a directory; pass the path of a .json file")
    _check_keys(data)
    payload = {"provenance": provenance(command), "data": data}
    try:
        text = _dumps(json.loads(json.dumps(payload, default=_to_json))) + "\n"
    except ValueError as exc:  # json's "Circular reference detected"
        raise ValueError(f"save_result cannot serialise data: {exc}") from exc
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"path {path} lies under {parent}, which is a file, not a folder")
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def load_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a file written by :func:`save_result`; returns the whole payload.

    Raises ``FileNotFoundError`` or ``IsADirectoryError`` for a missing file or a folder, and
    ``ValueError`` naming the file if it is not UTF-8 JSON or not a result file.
    """
    path = check_file(path, what="a result .json file")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON, so not a result file: {exc}") from exc
    if not isinstance(payload, dict) or "data" not in payload or "provenance" not in payload:
        raise ValueError(f"{path} is not a result file (expected keys 'provenance' and 'data')")
    return payload


def peak_tensor_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """Run ``fn(*args, **kwargs)`` and measure the peak bytes of tensors it keeps alive.

    Every tensor storage created by a torch operator during the call is recorded (through a
    ``TorchDispatchMode``) with its size, and released when the storage dies; the peak of
    the running sum is returned with ``fn``'s result. Storages that existed before the call
    (inputs, parameters, and views of them) are not counted; scratch memory that an operator
    allocates and frees internally is not seen. Run under ``torch.no_grad()`` to measure
    inference. Returns ``(peak_bytes, result)``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _Tracker(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, tuple[Any, int]] = {}
            self.current = 0
            self.peak = 0

        def _sweep(self) -> None:
            dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
            for key in dead:
                self.current -= self.live.pop(key)[1]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            self._sweep()
            inputs = {
                t.untyped_storage().data_ptr()
                for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
            }
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in inputs or key in self.live or storage.nbytes() == 0:
                    continue
                self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            return out

    tracker = _Tracker()
    with tracker:
        result = fn(*args, **kwargs)
    return tracker.peak, result


def save_csv(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]], fieldnames: Sequence[str],
             command: str | None = None) -> Path:
    """Write ``rows`` as CSV, preceded by ``# provenance: {json}`` (see :func:`provenance`).

    Every row must have exactly the keys ``fieldnames``. Read it back with :func:`load_csv`.
    """
    import csv
    import io

    path = check_path(path)
    fieldnames = list(fieldnames)
    for i, row in enumerate(rows):
        if set(row) != set(fieldnames):
            raise ValueError(f"rows[{i}] has keys {sorted(row)}, expected {sorted(fieldnames)}")
    buf = io.StringIO()
    # RFC 4180's CRLF line ends: csv then quotes any value holding a line break or a CR
    buf.write("# provenance: " + json.dumps(provenance(command), sort_keys=False) + "\r\n")
    writer = csv.DictWriter(buf, fieldnames=fieldnames, lineterminator="\r\n")
    writer.writeheader()
    writer.writerows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:  # newline="": write the CRLFs as they are
        f.write(buf.getvalue())
    return path


def load_csv(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """Read a file written by :func:`save_csv`: ``(provenance, rows)``, values as strings."""
    import csv

    path = check_file(path, what="a result .csv file")
    import io

    with open(path, newline="") as f:  # newline="": line breaks inside quoted values survive
        text = f.read()
    first, _, rest = text.partition("\n")
    first = first.rstrip("\r")
    prefix = "# provenance: "
    if not first.startswith(prefix):
        raise ValueError(f"{path} is not a result CSV (its first line must start with {prefix!r})")
    prov = json.loads(first[len(prefix):])
    return prov, list(csv.DictReader(io.StringIO(rest, newline="")))


#: Flags of the benchmark scripts that only schedule a run (wait until the machine is idle):
#: they do not change what is measured, and a page that shows a stored command leaves them out.
SCHEDULING_FLAGS = ("--max-load", "--wait-s")


def shown_command(command: str) -> str:
    """``command`` without the :data:`SCHEDULING_FLAGS` and their values.

    Raises:
        TypeError: ``command`` is not a string.
    """
    if not isinstance(command, str):
        raise TypeError(f"command must be a string, got {type(command).__name__}")
    words, kept = command.split(), []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in SCHEDULING_FLAGS:
            skip = True
        elif not any(word.startswith(flag + "=") for flag in SCHEDULING_FLAGS):
            kept.append(word)
    return " ".join(kept)
