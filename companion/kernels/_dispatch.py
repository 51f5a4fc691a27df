"""Backend choice for the fused operations: Triton on GPU, Triton's interpreter, or torch.

Callers never pick a backend. Each public entry point of :mod:`companion.kernels` asks
:func:`backend` which implementation runs for its tensors:

==============================================  ==========================================
tensors                                         backend
==============================================  ==========================================
CUDA, Triton installed                          ``"triton"`` (compiled kernels; the
                                                interpreter instead if the kernels were
                                                loaded with ``TRITON_INTERPRET=1``)
CPU, Triton installed, ``TRITON_INTERPRET=1``   ``"triton-interpreter"`` (the same kernels,
set before the kernels were first loaded        run by Triton's NumPy interpreter)
anything else                                   ``"torch"`` (the reference implementations)
==============================================  ==========================================

The Triton modules (:mod:`companion.kernels.rope`, :mod:`companion.kernels.attention`) are
imported lazily, on the first call that needs them, so ``import companion.kernels`` works
without Triton installed. Triton decides when it decorates a kernel whether the kernel is
compiled or interpreted (from ``TRITON_INTERPRET``); the dispatch therefore asks the loaded
kernel what it is rather than re-reading the variable, so the two can never disagree.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

from .._checks import check_choice, check_device

__all__ = ["BACKENDS", "backend", "triton_available"]

#: The possible answers of :func:`backend`.
BACKENDS: tuple[str, ...] = ("triton", "triton-interpreter", "torch")

_modules: dict[str, ModuleType] = {}


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken install, or sys.modules["triton"] = None
        return False


def _load(name: str) -> ModuleType | None:
    """Import ``companion.kernels.<name>`` (a Triton module) once; None if Triton is missing."""
    if name not in _modules:
        if not triton_available():
            return None
        try:
            _modules[name] = importlib.import_module(f"{__package__}.{name}")
        except ImportError:
            return None
    return _modules[name]


def _interpreting(module: ModuleType) -> bool:
    """Whether the module's kernels were built by Triton's interpreter."""
    return bool(getattr(module, "INTERPRETED", False))


def backend(device: torch.device | str, op: str = "rope") -> str:
    """The backend that runs operation ``op`` (``"rope"`` or ``"attention"``) on ``device``.

    See the module docstring for the rules. Loading the Triton module is part of the answer:
    the first call for a device that may use Triton imports it.
    """
    check_choice(op, "op", ("rope", "attention"))
    dev = check_device(device)
    if dev.type == "cuda":
        mod = _load(op)
        if mod is None:
            return "torch"
        return "triton-interpreter" if _interpreting(mod) else "triton"
    if dev.type == "cpu" and (os.environ.get("TRITON_INTERPRET", "0") == "1" or op in _modules):
        mod = _load(op)
        if mod is not None and _interpreting(mod):
            return "triton-interpreter"
    return "torch"


def module(op: str) -> ModuleType:
    """The loaded Triton module for ``op`` (only called after :func:`backend` chose Triton)."""
    mod = _load(op)
    assert mod is not None, "backend() chose Triton, so the module is loaded"
    return mod
