"""Chapter 11's training-free extension on the lab's RoPE models: settings and the job.

Each method of :mod:`companion.trainfree` is run on the RoPE checkpoints of chapter 8's
sweep at every evaluation length, with the same windows and figures as
:func:`companion.lab.evaluate.bits_per_byte`, so its curve plots beside chapter 8's. The
settings keep every position RoPE sees inside the trained range ``0 .. train_len - 1``:

* ReRoPE: a neighbour window ``w = train_len // 2``; far pairs sit at relative position ``w``.
* Leaky ReRoPE: the same ``w``, and per length the smallest integer leak ``k`` whose largest
  relative position ``w + (n - w) / k`` is at most ``train_len - 1``.
* Self-Extend: the same ``w``, and per length the smallest group ``G`` whose largest relative
  position ``n // G + w - w // G`` is at most ``train_len - 1`` (the paper picks ``G`` for
  its target length the same way).
* Attention sinks: ``n_sink = 4`` first tokens and a recent window, read in chunks of
  ``train_len // 4``, sized so that the largest position inside the cache,
  ``n_sink + window + chunk - 1``, is ``train_len - 1``; and the two ablations, no sinks
  (``n_sink = 0``, a longer window, the same cache size) and no re-rotation (keys keep their
  stream positions).

At lengths up to ``train_len`` every method is plain RoPE (tested in ``tests/test_trainfree.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..trainfree import ReRoPE, SelfExtend, lab_bits_per_byte, max_relative_position
from .corpus import load_corpus
from .evaluate import bits_per_byte
from .train import load_checkpoint

__all__ = ["LAB_TRAINFREE", "lab_settings", "run_trainfree"]

#: The configurations the job runs: name -> the method of :mod:`companion.trainfree`.
LAB_TRAINFREE: dict[str, str] = {
    "rerope": "rerope",
    "leaky_rerope": "leaky_rerope",
    "self_extend": "self_extend",
    "sinks": "sinks",
    "window_only": "sinks",
    "sinks_no_rerotate": "sinks",
}


def _smallest(fits, start: int = 1) -> int:
    g = start
    while not fits(g):
        g += 1
    return g


def lab_settings(name: str, train_len: int, length: int) -> dict[str, Any]:
    """The keyword arguments of :func:`companion.trainfree.lab_bits_per_byte` for ``name`` at
    ``length`` tokens, for a model trained at ``train_len`` (see the module docstring)."""
    if name not in LAB_TRAINFREE:
        raise ValueError(f"name must be one of {list(LAB_TRAINFREE)}, got {name!r}")
    top = train_len - 1
    w = train_len // 2
    if name == "rerope":
        return {"window": w}
    if name == "leaky_rerope":
        k = _smallest(lambda k: max_relative_position(ReRoPE(w, float(k)), length) <= top, 2)
        return {"window": w, "leak": float(k)}
    if name == "self_extend":
        g = _smallest(lambda g: max_relative_position(SelfExtend(w, g), length) <= top)
        return {"window": w, "group": g}
    chunk = train_len // 4
    if name == "sinks":
        return {"n_sink": 4, "window": train_len - 4 - chunk, "chunk": chunk}
    if name == "window_only":
        return {"n_sink": 0, "window": train_len - chunk, "chunk": chunk}
    return {"n_sink": 4, "window": train_len - 4 - chunk, "chunk": chunk, "rerotate": False}


def run_trainfree(checkpoints: Sequence[str], multiples: Sequence[int], *, windows_per_length: int = 2048,
                  names: Sequence[str] | None = None) -> dict[str, Any]:
    """Evaluate every configuration of :data:`LAB_TRAINFREE` (or ``names``) on each checkpoint.

    Returns ``{"runs": [{"checkpoint", "seed", "train_len", "plain": {W: {...}},
    "methods": {name: {"settings": {W: kwargs}, "bpb": {W: {"all", "tail"}}, "seconds"}}}],
    "wall_seconds"}``; ``plain`` is RoPE as trained (chapter 8's numbers for the same model).
    """
    names = list(LAB_TRAINFREE) if names is None else list(names)
    corpus = load_corpus()
    t0 = time.perf_counter()
    runs = []
    for path in checkpoints:
        model, ckpt = load_checkpoint(path)
        cfg = ckpt["config"]
        L = int(cfg["seq_len"])
        lengths = [m * L for m in multiples]
        rec: dict[str, Any] = {"checkpoint": str(path), "seed": cfg["seed"], "train_len": L,
                               "plain": {str(k): v for k, v in bits_per_byte(
                                   model, corpus.val, lengths, windows_per_length=windows_per_length).items()},
                               "methods": {}}
        for name in names:
            s0 = time.perf_counter()
            settings, bpb = {}, {}
            for W in lengths:
                kw = lab_settings(name, L, W)
                settings[str(W)] = kw
                bpb[str(W)] = lab_bits_per_byte(model, corpus.val, [W], LAB_TRAINFREE[name],
                                                windows_per_length=windows_per_length, reach=max(lengths), **kw)[W]
            rec["methods"][name] = {"settings": settings, "bpb": bpb, "seconds": time.perf_counter() - s0}
            print(f"seed {cfg['seed']} {name}: " + " ".join(f"{bpb[str(W)]['tail']:.2f}" for W in lengths),
                  flush=True)
        runs.append(rec)
    return {"runs": runs, "multiples": list(multiples), "windows_per_length": windows_per_length,
            "wall_seconds": time.perf_counter() - t0}
