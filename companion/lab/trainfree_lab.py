"""Chapter 11's training-free extension on the lab's RoPE models: the evaluation, its settings and the job.

The methods live in :mod:`companion.trainfree` (which knows nothing of the lab); this module
runs them on a lab :class:`~companion.model.TinyDecoder` with a
:class:`~companion.rope.RotaryEmbedding` scheme: :func:`lab_forward` (the model's own blocks
with the attention replaced), :func:`lab_stream_nll` (the model reading a stream through a
:class:`~companion.trainfree.SinkCache`) and :func:`lab_bits_per_byte` (the windows and
figures of :func:`companion.lab.evaluate.bits_per_byte`, with a method).

Each method is run on the RoPE checkpoints of chapter 8's sweep at every evaluation length
(:func:`run_trainfree`), so its curve plots beside chapter 8's. The settings
(:func:`lab_settings`) keep every position RoPE sees inside the trained range
``0 .. train_len - 1``:

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

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import INT_DTYPES, check_file, check_has_data, check_positive_int, check_tensor
from ..model import TinyDecoder
from ..rope import RotaryEmbedding
from ..trainfree import (TRAINFREE_METHODS, ReRoPE, SelfExtend, SinkCache, _check_mode, _check_sink_args,
                         _stream_chunks, max_relative_position, two_region_attention)
from .corpus import load_corpus
from .evaluate import BLOCKS, LN2, _check_blocks, bits_per_byte, passkey_retrieval, window_bits
from .train import load_checkpoint

__all__ = ["LAB_METHOD_PARAMS", "LAB_TRAINFREE", "lab_forward", "lab_stream_nll", "lab_logits", "lab_bits_per_byte",
           "lab_settings", "run_trainfree", "PASSKEY_DEPTHS"]

#: The parameters of each method of :func:`lab_bits_per_byte`, with their defaults (sized for
#: the lab's models trained at 256 bytes); no other keyword is accepted.
LAB_METHOD_PARAMS: dict[str, dict[str, Any]] = {
    "rerope": {"window": 128},
    "leaky_rerope": {"window": 128, "leak": 4.0},
    "self_extend": {"window": 64, "group": 4},
    "sinks": {"n_sink": 4, "window": 192, "chunk": 32, "rerotate": True},
}

#: The configurations the job runs: name -> the method of :mod:`companion.trainfree`.
LAB_TRAINFREE: dict[str, str] = {
    "rerope": "rerope",
    "leaky_rerope": "leaky_rerope",
    "self_extend": "self_extend",
    "sinks": "sinks",
    "window_only": "sinks",
    "sinks_no_rerotate": "sinks",
}

#: The key depths of the retrieval test :func:`run_trainfree` runs (0: the key opens the window,
#: the farthest from the query; 1: it sits just before the query).
PASSKEY_DEPTHS = (0.0, 0.5, 1.0)

#: The shortest training length each configuration of :func:`lab_settings` can be sized for
#: (a window and a chunk of at least one token; Leaky ReRoPE needs ``w < train_len - 1``).
_MIN_TRAIN_LEN: dict[str, int] = {"rerope": 2, "leaky_rerope": 3, "self_extend": 2, "sinks": 6,
                                  "window_only": 4, "sinks_no_rerotate": 6}


# ----------------------------------------------------------------------------- the evaluation


def _check_lab_model(model: object) -> TinyDecoder:
    if not isinstance(model, TinyDecoder):
        raise TypeError(f"model must be a companion.model.TinyDecoder, got {type(model).__name__}")
    if not isinstance(model.scheme, RotaryEmbedding):
        raise TypeError(f"model.scheme must be a RotaryEmbedding (the lab's rope models), got "
                        f"{type(model.scheme).__name__}")
    return model


def _check_ids(idx: object, vocab: int) -> Tensor:
    """Require ``(batch, seq)`` integer token ids in ``[0, vocab)``; returns them as int32 or
    int64 (the dtypes an embedding takes; others are widened to int64)."""
    check_tensor(idx, "idx", 2)
    assert isinstance(idx, Tensor)
    check_has_data(idx, "idx")
    if idx.dtype not in INT_DTYPES:
        raise TypeError(f"idx must hold integer token ids (torch.int64 or torch.int32), got dtype {idx.dtype}")
    if idx.dtype not in (torch.int32, torch.int64):
        idx = idx.long()
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= vocab:
            raise IndexError(f"idx must hold token ids in [0, {vocab}) (the model's vocabulary), got "
                             f"{lo if lo < 0 else hi}")
    return idx


@torch.no_grad()
def lab_forward(model: Any, idx: Tensor, mode: ReRoPE | SelfExtend | None = None,
                cache: SinkCache | None = None, *, chunk: int = 256) -> Tensor:
    """Logits ``(batch, seq, vocab)`` of a lab :class:`~companion.model.TinyDecoder` with a
    :class:`~companion.rope.RotaryEmbedding` scheme, with a training-free method.

    Runs the model's own blocks (LayerNorms, q/k/v/o projections of its
    :class:`~companion.model.MultiHeadAttention`, MLP, final norm and head) with the
    attention replaced: ``mode`` (ReRoPE / Self-Extend, positions ``0 .. seq - 1``), or
    ``cache`` (a :class:`~companion.trainfree.SinkCache` of ``len(model.blocks)`` layers: the tokens continue the
    stream it holds), or neither (plain causal RoPE attention, the model's own function).

    Raises:
        TypeError: ``model`` not a lab RoPE model, ``idx`` not an integer tensor, ``mode`` or
            ``cache`` of the wrong type.
        ValueError: ``idx`` not 2-D, both ``mode`` and ``cache``, or a cache of another depth.
        IndexError: a token id outside ``[0, vocab_size)``.
    """
    model = _check_lab_model(model)
    if mode is not None and cache is not None:
        raise ValueError("pass mode or cache, not both")
    if mode is not None:
        _check_mode(mode)
    if cache is not None:
        if not isinstance(cache, SinkCache):
            raise TypeError(f"cache must be a SinkCache or None, got {type(cache).__name__}")
        if cache.n_layers != len(model.blocks):
            raise ValueError(f"cache has {cache.n_layers} layers, the model {len(model.blocks)}")
    idx = _check_ids(idx, model.tok.num_embeddings)
    rope = model.scheme
    x = model.tok(idx)
    n = idx.shape[1]
    for li, block in enumerate(model.blocks):
        attn = block.attn
        hx = block.ln1(x)
        q = attn._split(attn.q_proj(hx), attn.n_heads)
        k = attn._split(attn.k_proj(hx), attn.n_kv_heads)
        v = attn._split(attn.v_proj(hx), attn.n_kv_heads)
        if cache is not None:
            y = cache.attend(li, q, k, v, rope)
        elif mode is not None:
            y = two_region_attention(q, k, v, rope, mode, chunk=chunk)
        else:
            pos = torch.arange(n, device=idx.device)
            qr, kr = rope.rotate(q, k, pos, pos)
            y = F.scaled_dot_product_attention(qr, kr, v, is_causal=True, enable_gqa=True)
        x = x + attn.o_proj(y.transpose(1, 2).reshape(idx.shape[0], n, attn.d_model))
        x = x + block.mlp(block.ln2(x))
    return model.head(model.ln_f(x))


@torch.no_grad()
def lab_stream_nll(model: Any, idx: Tensor, n_sink: int = 4, window: int = 256, chunk: int = 64,
                   *, rerotate: bool = True) -> Tensor:
    """Per-token NLL ``(batch, seq - 1)`` (nats) of a lab TinyDecoder reading ``idx`` as a stream
    through a :class:`~companion.trainfree.SinkCache`, ``chunk`` tokens at a time (as
    :func:`companion.trainfree.stream_nll`). The loss
    is computed from float32 logits, as ``companion.lab.evaluate.bits_per_byte`` does.

    ``idx`` is checked as by :func:`lab_forward` (integer token ids inside the vocabulary:
    ``TypeError`` / ``IndexError`` otherwise) and must hold at least 2 tokens per row."""
    model = _check_lab_model(model)
    n_sink, window, rerotate = _check_sink_args(n_sink, window, rerotate)
    chunk = check_positive_int(chunk, "chunk")
    idx = _check_ids(idx, model.tok.num_embeddings)
    if idx.shape[1] < 2:
        raise ValueError(f"idx must hold at least 2 tokens per row, got {idx.shape[1]}")
    cache = SinkCache(len(model.blocks), n_sink, window, rerotate=rerotate)
    return _stream_chunks(lambda part: lab_forward(model, part, cache=cache), idx, chunk, float32=True)


def _method_params(method: str, params: dict[str, Any], context: str, also: Sequence[str]) -> dict[str, Any]:
    """``params`` over :data:`LAB_METHOD_PARAMS` ``[method]``'s defaults; an unknown key raises
    ``ValueError`` listing the allowed ones (and ``also``, the caller's own keywords)."""
    if not isinstance(method, str) or method not in LAB_METHOD_PARAMS:
        raise ValueError(f"method must be one of {list(TRAINFREE_METHODS)}, got {method!r}")
    defaults = LAB_METHOD_PARAMS[method]
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        extra = f" (and the evaluation's {list(also)})" if also else ""
        raise ValueError(f"{context} has unknown keys {unknown} for method {method!r}; allowed: "
                         f"{list(defaults)}{extra}")
    return {**defaults, **params}


def _two_region_mode(method: str, p: dict[str, Any]) -> ReRoPE | SelfExtend:
    return SelfExtend(p["window"], p["group"]) if method == "self_extend" else ReRoPE(p["window"], p.get("leak"))


def _lab_method(method: str, params: dict[str, Any], *, context: str = "params",
                also: Sequence[str] = ()) -> Callable[[Any, Tensor], Tensor]:
    """A function ``(model, rows) -> nll (rows, W)`` in nats for ``method`` with ``params``
    (keys of :data:`LAB_METHOD_PARAMS` ``[method]``, the rest at their defaults); an unknown
    key raises ``ValueError`` listing the allowed ones (and ``also``, the caller's own keywords)."""
    p = _method_params(method, params, context, also)
    if method == "sinks":
        n_sink, window, rerotate = _check_sink_args(p["n_sink"], p["window"], p["rerotate"])
        chunk = check_positive_int(p["chunk"], "chunk")
        return lambda model, rows: lab_stream_nll(model, rows, n_sink, window, chunk, rerotate=rerotate)
    logits_of = lab_logits(method, **p)

    def run(model: Any, rows: Tensor) -> Tensor:
        return F.cross_entropy(logits_of(model, rows[:, :-1]).transpose(1, 2), rows[:, 1:], reduction="none")

    return run


def lab_logits(method: str, **params: Any) -> Callable[[Any, Tensor], Tensor]:
    """A function ``(model, rows) -> logits`` (float32, ``(rows, W, vocab)``) of a lab RoPE
    model run with ``method`` (one of :data:`~companion.trainfree.TRAINFREE_METHODS`) and
    ``params`` (as :func:`lab_bits_per_byte`'s; defaults in :data:`LAB_METHOD_PARAMS`).

    ReRoPE and Self-Extend are :func:`lab_forward` with their mode. ``"sinks"`` reads each row
    as a stream through a fresh :class:`~companion.trainfree.SinkCache`, ``chunk`` tokens at a
    time, and returns the logits of every token: the logits :func:`lab_stream_nll` scores. It is
    what :func:`run_trainfree`'s retrieval test feeds
    :func:`companion.lab.evaluate.passkey_retrieval`.

    Raises:
        ValueError: an unknown ``method`` or parameter, or a bad parameter value.
    """
    p = _method_params(method, params, "lab_logits' keywords", ())
    if method == "sinks":
        n_sink, window, rerotate = _check_sink_args(p["n_sink"], p["window"], p["rerotate"])
        chunk = check_positive_int(p["chunk"], "chunk")

        @torch.no_grad()
        def stream(model: Any, rows: Tensor) -> Tensor:
            model = _check_lab_model(model)
            cache = SinkCache(len(model.blocks), n_sink, window, rerotate=rerotate)
            return torch.cat([lab_forward(model, rows[:, s:s + chunk], cache=cache).float()
                              for s in range(0, rows.shape[1], chunk)], dim=1)

        return stream
    mode = _two_region_mode(method, p)
    return lambda model, rows: lab_forward(model, rows, mode).float()


@torch.no_grad()
def lab_bits_per_byte(
    model: Any,
    data: np.ndarray,
    lengths: list[int] | tuple[int, ...],
    method: str,
    *,
    windows_per_length: int = 2048,
    blocks: int = 256,
    reach: int | None = None,
    tokens_per_batch: int = 1 << 14,
    **params: Any,
) -> dict[int, dict[str, Any]]:
    """``companion.lab.evaluate.bits_per_byte`` with a training-free method.

    The same windows (``windows_per_length`` windows ending at the same bytes at every
    length, after the first ``reach`` bytes of ``data``), the same batching and the same
    figures (``"all"``, ``"tail"`` and their per-block means ``"all_blocks"``,
    ``"tail_blocks"``), so the result compares with chapter 8's, window by window. The lab's
    tokens are bytes, so bits per token are bits per byte. ``method`` is one of
    :data:`~companion.trainfree.TRAINFREE_METHODS`; ``params``: ``window`` (and ``leak``) for ``rerope`` /
    ``leaky_rerope``, ``window`` and ``group`` for ``self_extend``, ``n_sink``, ``window``,
    ``chunk`` and ``rerotate`` for ``sinks`` (each window is one stream through a fresh cache),
    defaults in :data:`LAB_METHOD_PARAMS`; any other keyword raises ``ValueError``.
    """
    _check_lab_model(model)
    run = _lab_method(method, dict(params), context="lab_bits_per_byte's keywords",
                      also=("windows_per_length", "blocks", "reach", "tokens_per_batch"))
    tokens_per_batch = check_positive_int(tokens_per_batch, "tokens_per_batch")
    model.eval()

    def bits_fn(rows: Tensor, w: int) -> Tensor:
        per_batch = max(1, tokens_per_batch // w)
        return torch.cat([run(model, part) / LN2 for part in rows.split(per_batch)])

    return window_bits(bits_fn, data, lengths, windows_per_length=windows_per_length, blocks=blocks, reach=reach)


# ----------------------------------------------------------------------------- the job


def _smallest(fits, start: int = 1) -> int:
    g = start
    while not fits(g):
        g += 1
    return g


def lab_settings(name: str, train_len: int, length: int) -> dict[str, Any]:
    """The keyword arguments of :func:`lab_bits_per_byte` for ``name`` (a key of
    :data:`LAB_TRAINFREE`) at ``length`` tokens, for a model trained at ``train_len`` (see the
    module docstring; ``train_len`` must leave a window and a chunk of at least one token)."""
    if not isinstance(name, str) or name not in LAB_TRAINFREE:
        raise ValueError(f"name must be one of {list(LAB_TRAINFREE)}, got {name!r}")
    least = _MIN_TRAIN_LEN[name]
    train_len = check_positive_int(train_len, "train_len", minimum=least)
    length = check_positive_int(length, "length")
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


def _check_names(names: object) -> list[str]:
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"names must be a list of names of LAB_TRAINFREE (or None), got {type(names).__name__} "
                        f"{names!r}")
    names = list(names)
    unknown = [n for n in names if not isinstance(n, str) or n not in LAB_TRAINFREE]
    if unknown or not names:
        raise ValueError(f"names must be a non-empty list drawn from {list(LAB_TRAINFREE)}, got {names!r}")
    if len(set(names)) < len(names):
        raise ValueError(f"names must not repeat a configuration, got {names!r}")
    return names


def _passkey(model: TinyDecoder, data: np.ndarray, length: int, trials: int, seed: int,
             forward: Callable[[Tensor], Tensor] | None) -> dict[str, Any]:
    """One length of the retrieval test: per depth, the trials' gains and exact matches."""
    res = passkey_retrieval(model, data, [length], list(PASSKEY_DEPTHS), trials=trials, seed=seed, forward=forward)
    return {f"{d:g}": {"gain": [round(g, 4) for g in res["gain_trials"][0][j]], "exact": res["exact_trials"][0][j]}
            for j, d in enumerate(PASSKEY_DEPTHS)}


def run_trainfree(checkpoints: Sequence[str], multiples: Sequence[int], *, windows_per_length: int = 2048,
                  names: Sequence[str] | None = None, passkey_trials: int = 32, workers: int = 1) -> dict[str, Any]:
    """Evaluate every configuration of :data:`LAB_TRAINFREE` (or ``names``) on each checkpoint.

    Returns ``{"runs": [{"checkpoint", "seed", "train_len", "plain": {W: {...}},
    "plain_passkey": {W: {depth: {"gain", "exact"}}}, "methods": {name: {"settings": {W:
    kwargs}, "bpb": {W: {"all", "tail", "all_blocks", "tail_blocks"}}, "passkey": {W: {depth:
    {"gain", "exact"}}}, "seconds"}}}], "wall_seconds"}``; ``plain`` is RoPE as trained
    (chapter 8's numbers for the same model). The retrieval test is chapter 8's
    (:func:`~companion.lab.evaluate.passkey_retrieval`: ``passkey_trials`` trials per depth of
    :data:`PASSKEY_DEPTHS`, each trial's gain and exact match), run through each method
    (:func:`lab_logits`) with the same keys, windows and seed as the plain model, so that every
    trial pairs with the plain model's. ``workers > 1`` evaluates that many checkpoints at once,
    in processes of one thread each. Every argument is checked before the corpus or a
    checkpoint is loaded.

    Raises:
        TypeError: ``checkpoints`` not a non-empty list of paths, or a count not an int.
        FileNotFoundError, IsADirectoryError: a checkpoint that is missing or a folder.
        ValueError: a bad multiple, ``windows_per_length`` or name, or a file that is not
            a lab checkpoint (:func:`~companion.lab.train.load_checkpoint`).
    """
    if isinstance(checkpoints, (str, os.PathLike)) or not isinstance(checkpoints, Sequence) or not checkpoints:
        raise TypeError(f"checkpoints must be a non-empty list of paths, got {checkpoints!r}")
    for path in checkpoints:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"checkpoints must hold paths (str or os.PathLike), got {type(path).__name__} {path!r}")
    if isinstance(multiples, str) or not isinstance(multiples, Sequence) or not multiples:
        raise TypeError(f"multiples must be a non-empty list of ints, got {multiples!r}")
    multiples = [check_positive_int(m, f"multiples[{i}]") for i, m in enumerate(multiples)]
    if len(set(multiples)) < len(multiples):
        raise ValueError(f"multiples must not repeat a value, got {multiples}")
    windows_per_length = check_positive_int(windows_per_length, "windows_per_length")
    _check_blocks(BLOCKS, windows_per_length, "windows_per_length")  # the evaluations' bootstrap blocks
    passkey_trials = check_positive_int(passkey_trials, "passkey_trials")
    names = list(LAB_TRAINFREE) if names is None else _check_names(names)
    workers = check_positive_int(workers, "workers")
    for i, path in enumerate(checkpoints):
        check_file(path, f"checkpoints[{i}]", "a checkpoint written by companion.lab.train")
    t0 = time.perf_counter()
    jobs = [(str(path), list(multiples), windows_per_length, names, passkey_trials) for path in checkpoints]
    if workers > 1 and len(jobs) > 1:
        with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
            runs = pool.map(_trainfree_worker, jobs)
    else:
        runs = [_trainfree_one(*job) for job in jobs]
    return {"runs": runs, "multiples": list(multiples), "windows_per_length": windows_per_length,
            "blocks": BLOCKS, "passkey_trials": passkey_trials, "passkey_depths": list(PASSKEY_DEPTHS),
            "wall_seconds": time.perf_counter() - t0}


def _trainfree_worker(job: tuple) -> dict[str, Any]:
    torch.set_num_threads(1)
    return _trainfree_one(*job)


def _trainfree_one(path: str, multiples: list[int], windows_per_length: int, names: list[str],
                   passkey_trials: int) -> dict[str, Any]:
    """One checkpoint of :func:`run_trainfree` (its arguments checked there)."""
    corpus = load_corpus()
    model, ckpt = load_checkpoint(path)
    cfg = ckpt["config"]
    L = int(cfg["seq_len"])
    lengths = [m * L for m in multiples]
    seed = int(cfg["seed"])
    rec: dict[str, Any] = {"checkpoint": str(path), "seed": seed, "train_len": L,
                           "plain": {str(k): v for k, v in bits_per_byte(
                               model, corpus.val, lengths, windows_per_length=windows_per_length,
                               reach=max(lengths)).items()},
                           "plain_passkey": {str(W): _passkey(model, corpus.val, W, passkey_trials, seed, None)
                                             for W in lengths},
                           "methods": {}}
    for name in names:
        s0 = time.perf_counter()
        settings, bpb, keys = {}, {}, {}
        for W in lengths:
            kw = lab_settings(name, L, W)
            settings[str(W)] = kw
            bpb[str(W)] = lab_bits_per_byte(model, corpus.val, [W], LAB_TRAINFREE[name],
                                            windows_per_length=windows_per_length, reach=max(lengths), **kw)[W]
            logits_of = lab_logits(LAB_TRAINFREE[name], **kw)
            keys[str(W)] = _passkey(model, corpus.val, W, passkey_trials, seed,
                                    lambda rows, f=logits_of: f(model, rows))
        rec["methods"][name] = {"settings": settings, "bpb": bpb, "passkey": keys,
                                "seconds": time.perf_counter() - s0}
        far = [float(np.mean(keys[str(W)]["0"]["exact"])) for W in lengths]
        print(f"seed {seed} {name}: tail " + " ".join(f"{bpb[str(W)]['tail']:.2f}" for W in lengths)
              + "; farthest key exact " + " ".join(f"{x:.2f}" for x in far), flush=True)
    return rec
