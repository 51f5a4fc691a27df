"""Long-context evaluation of a pretrained Llama (chapter 10): perplexity by position and passkey.

Two experiments, both on a :class:`companion.llama.LlamaModel` with a chapter-9 scaling
config installed by :meth:`~companion.llama.LlamaModel.set_rope_config`, and no fine-tuning:

* **Perplexity by position.** :func:`token_stream` tokenizes the lab corpus's held-out
  standard-library files (``companion.lab.load_corpus``, validation split) into
  one stream; window ``w`` is tokens ``[w * L, (w + 1) * L)`` of it. :func:`evaluate_window`
  runs one causal pass per method over a window and sums the per-token loss in buckets of
  target positions, so that the first half, the second half, the last 1024 tokens, or a
  curve of loss against position, all come from the same stored rows
  (:func:`summarize`). By causality the first half of a pass of ``L`` tokens scores its
  tokens exactly as a pass of ``L / 2`` tokens would, for every method whose frequencies do
  not depend on the length; Dynamic NTK is the exception, it sets its base from the whole
  pass (``max(position) + 1``, HuggingFace's rule without a cache).
* **Passkey retrieval** (:cite:`mohtashami2023landmark`). :func:`passkey_prompt` hides a
  five-digit key at a given depth inside repeated filler sentences, in the model's chat
  format (:func:`companion.llama.render_chat`), and the model answers greedily after
  ``"The pass key is"`` (:func:`passkey_trial`).

The command line writes both with provenance::

    python -m companion.longctx ppl --length 16384 --windows 2 --out chapters/data/10_ppl.csv
    python -m companion.longctx passkey --lengths 8192 16384 --out chapters/data/10_passkey.csv

A pass of 16384 tokens takes minutes on two cores, so both commands report each window and
pass on stderr (``--quiet``: nothing), and take ``--quick``, a smoke run of about a minute
(:data:`QUICK_PPL`, :data:`QUICK_PASSKEY`: 512 tokens) whose files record ``"quick": true``.

Methods (:data:`METHODS`) are named as in chapter 9's lab: ``none`` (plain RoPE), ``pi``
(linear), ``ntk`` (NTK-aware base change), ``dynamic`` (Dynamic NTK), ``yarn`` (with its
attention factor) and ``llama3``, each at ``factor`` over the native context.

The training-free methods of :mod:`companion.trainfree` (:data:`~companion.trainfree.TRAINFREE_METHODS`) run on
plain RoPE through the same ``ppl`` command, with the same windows, buckets, CSV fields and
JSON sidecar: ``rerope``, ``leaky_rerope``, ``self_extend`` (one prefill pass each, with
:meth:`~companion.llama.LlamaModel.attention_mode`) and ``sinks`` (the window read as a
stream through a :class:`~companion.trainfree.SinkCache`, :func:`~companion.trainfree.stream_nll`)::

    python -m companion.longctx ppl --length 16384 --windows 3 \
        --methods rerope leaky_rerope self_extend sinks \
        --out chapters/data/10_trainfree.csv --json chapters/data/10_trainfree.json

Their parameters (:data:`TRAINFREE_DEFAULTS`, flags ``--rerope-window``, ``--leak``,
``--se-window``, ``--se-group``, ``--sinks``, ``--sink-window``, ``--chunk``,
``--no-rerotate``) default to settings for SmolLM2-135M (8192 trained positions) at 16384
tokens whose largest relative position stays below 8192 (:func:`trainfree_reach`):
ReRoPE ``w = 4096`` reaches 4096; Leaky ReRoPE ``w = 4096, k = 4`` reaches
``4096 + 12287 / 4 = 7167.75``; Self-Extend ``w = 2048, G = 4`` reaches
``16383 // 4 + 2048 - 512 = 5631``; 4 sinks, a window of 7168 and chunks of 512 put the
cache's positions at ``0 .. 4 + 7168 + 512 - 1 = 7683``. In those rows the ``rope_config``
column holds the method's parameters (:func:`trainfree_config`) and ``seconds`` the wall time
of the pass, as for the scaling methods.

**The second edition's measures** (issue 28) are the subcommands ``docs``, ``context`` and
``retrieval`` (:mod:`companion.longctx_runs`): single long documents
(:mod:`companion.longctx_docs`), the value of the context beyond the native window on the same
tokens, and passkey retrieval scored by log-probability in the classic and the chat format
(:mod:`companion.passkey`), on SmolLM2-135M or Gemma 3 270M, resumable with ``--cache``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ._cli import QUICK_HELP, SMOKE_RUN, apply_quick, mark_quick_csv, preset_text, say
from ._checks import check_base, check_bool, check_finite_number, check_int_tensor, check_positive_int
from .trainfree import TRAINFREE_METHODS, ReRoPE, SelfExtend, max_relative_position, stream_nll

__all__ = [
    "METHODS",
    "TRAINFREE_METHODS",
    "TRAINFREE_DEFAULTS",
    "trainfree_config",
    "trainfree_reach",
    "trainfree_nll",
    "FILLER",
    "method_config",
    "token_stream",
    "window",
    "evaluate_window",
    "summarize",
    "passkey_prompt",
    "passkey_trial",
    "QUICK_PPL",
    "QUICK_PASSKEY",
    "main",
]

#: The scaling methods of the experiment, in the order the chapter reports them.
METHODS: tuple[str, ...] = ("none", "pi", "ntk", "dynamic", "yarn", "llama3")

#: Default parameters of the training-free methods (sized for SmolLM2-135M at 16384 tokens;
#: see the module doc): the names of the ``ppl`` command's flags.
TRAINFREE_DEFAULTS: dict[str, Any] = {
    "rerope_window": 4096, "leak": 4.0, "se_window": 2048, "se_group": 4,
    "sinks": 4, "sink_window": 7168, "chunk": 512, "rerotate": True,
}

#: The filler of the passkey prompt (in the style of Mohtashami and Jaggi's test), repeated.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "

#: What ``ppl --quick`` sets (each overridden by an explicit flag): one window of 512 tokens,
#: plain RoPE and YaRN; a smoke run of about a minute on 2 cores (a pass of 16384 tokens takes
#: minutes).
QUICK_PPL: dict[str, Any] = {"length": 512, "windows": 1, "bucket": 128, "methods": ["none", "yarn"]}
#: What ``passkey --quick`` sets: one prompt of 512 tokens, the key in the middle.
QUICK_PASSKEY: dict[str, Any] = {"lengths": [512], "depths": [0.5]}

PPL_FIELDS = ("window", "window_start", "tokens", "method", "rope_config", "bucket_start",
              "bucket_end", "nll_sum", "count", "seconds")
PASSKEY_FIELDS = ("tokens", "prompt_tokens", "method", "depth", "key", "answer", "correct", "seconds")


def method_config(method: str, factor: float, original: int, base: float) -> dict[str, Any] | None:
    """The chapter-9 scaling config of ``method`` at ``factor`` over ``original`` positions.

    ``None`` for ``"none"`` (plain RoPE with ``base``). The others are the configs of
    chapter 9's lab (``companion.lab.extend.method_config``), HuggingFace-style dicts for
    :func:`companion.scaling.compute_inv_freq`: ``linear`` (PI), ``ntk`` (base
    ``b * s**(d / (d - 2))``), ``dynamic`` (Dynamic NTK, relative to ``original``), ``yarn``
    (HF's defaults ``beta_fast = 32``, ``beta_slow = 1``, attention factor
    ``0.1 ln s + 1``) and ``llama3`` (``low_freq_factor = 1``, ``high_freq_factor = 4``, as
    in Llama 3.1).

    Raises:
        ValueError: an unknown ``method``, ``factor < 1``, ``original < 1``, or ``base`` not a
            finite number ``> 1`` (the base of RoPE's frequency ladder).
        TypeError: ``factor``, ``original`` or ``base`` of the wrong type (a string, a bool).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    factor = check_finite_number(factor, "factor")
    if factor < 1.0:
        raise ValueError(f"factor must be >= 1, got {factor}")
    original = check_positive_int(original, "original")
    base = check_base(base, "base")
    if method == "none":
        return None
    from .lab.extend import method_config as lab_method_config  # chapter 9's configs, one definition

    return lab_method_config(method, factor, original, head_dim=0, base=base)  # head_dim: LongRoPE only


#: For each training-free method, its config's keys and the :data:`TRAINFREE_DEFAULTS` key
#: (the ``ppl`` flag, ``_`` for ``-``) each comes from.
_CONFIG_KEYS: dict[str, dict[str, str]] = {
    "rerope": {"window": "rerope_window"},
    "leaky_rerope": {"window": "rerope_window", "leak": "leak"},
    "self_extend": {"window": "se_window", "group": "se_group"},
    "sinks": {"n_sink": "sinks", "window": "sink_window", "chunk": "chunk", "rerotate": "rerotate"},
}


def _check_trainfree_method(method: object, name: str = "method") -> str:
    if not isinstance(method, str) or method not in TRAINFREE_METHODS:
        raise ValueError(f"{name} must be one of {list(TRAINFREE_METHODS)}, got {method!r}")
    return method


#: The check of each config key: ``(value, name) -> value``.
_CONFIG_CHECKS: dict[str, Any] = {
    "window": check_positive_int, "group": check_positive_int, "chunk": check_positive_int,
    "leak": lambda x, name: check_finite_number(x, name, above=1.0),
    "n_sink": lambda x, name: check_positive_int(x, name, minimum=0), "rerotate": check_bool,
}


def _build_config(method: str, values: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """The stored config ``{"method": method, key: value}``, each value checked under ``names[key]``."""
    return {"method": method, **{key: _CONFIG_CHECKS[key](values[key], names[key]) for key in _CONFIG_KEYS[method]}}


def trainfree_config(method: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The parameters of a training-free ``method`` (one of :data:`~companion.trainfree.TRAINFREE_METHODS`), as stored.

    ``params`` overrides :data:`TRAINFREE_DEFAULTS` (same keys). Returns ``{"method": ...}``
    plus ``window`` for ``rerope``; ``window``, ``leak`` for ``leaky_rerope``; ``window``,
    ``group`` for ``self_extend``; ``n_sink``, ``window``, ``chunk``, ``rerotate`` for
    ``sinks``. Bad values raise ``ValueError`` naming the key (``rerope_window >= 1``,
    ``leak > 1``, ``se_window >= 1``, ``se_group >= 1``, ``sinks >= 0``, ``sink_window >= 1``,
    ``chunk >= 1``).
    """
    _check_trainfree_method(method)
    p = dict(TRAINFREE_DEFAULTS)
    if params is not None:
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be a mapping of {sorted(p)} (or None), got {type(params).__name__}")
        unknown = sorted(map(str, set(params) - set(p)))
        if unknown:
            raise ValueError(f"params has unknown keys {unknown}; known: {sorted(p)}")
        p.update(params)
    names = _CONFIG_KEYS[method]
    return _build_config(method, {key: p[flag] for key, flag in names.items()}, names)


def _check_config(config: object) -> dict[str, Any]:
    """A stored training-free config (:func:`trainfree_config`'s form), checked: a mapping with
    ``"method"`` and exactly that method's keys, each value in range (``ValueError`` naming it)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping from trainfree_config, got {type(config).__name__}")
    method = _check_trainfree_method(config.get("method"), "config['method']")
    keys = _CONFIG_KEYS[method]
    got = sorted(map(str, set(config) - {"method"}))
    if got != sorted(keys):
        raise ValueError(f"config for method {method!r} must have the keys {['method', *keys]} (as "
                         f"trainfree_config returns), got {sorted(map(str, config))}")
    return _build_config(method, config, {key: f"config[{key!r}]" for key in keys})


def _trainfree_mode(config: Mapping[str, Any]) -> ReRoPE | SelfExtend:
    if config["method"] == "self_extend":
        return SelfExtend(config["window"], config["group"])
    return ReRoPE(config["window"], config.get("leak"))


def trainfree_reach(config: Mapping[str, Any], length: int) -> float:
    """The largest relative position RoPE sees in a pass of ``length`` tokens with ``config``
    (from :func:`trainfree_config`): :func:`companion.trainfree.max_relative_position` for the
    two-region methods; for ``sinks`` with ``rerotate``, the largest position inside the cache,
    ``min(length, n_sink + window + chunk) - 1``; without ``rerotate``, ``length - 1``."""
    config = _check_config(config)
    length = check_positive_int(length, "length")
    if config["method"] != "sinks":
        return max_relative_position(_trainfree_mode(config), length)
    if not config["rerotate"]:
        return float(length - 1)
    return float(min(length, config["n_sink"] + config["window"] + config["chunk"]) - 1)


def trainfree_nll(model: Any, ids: Tensor, config: Mapping[str, Any]) -> Tensor:
    """Per-token NLL ``(batch, seq - 1)`` of ``ids`` with a training-free ``config``
    (:func:`trainfree_config`), on the model's installed RoPE: one prefill pass with
    :meth:`~companion.llama.LlamaModel.attention_mode` for the two-region methods,
    :func:`companion.trainfree.stream_nll` for ``sinks``."""
    config = _check_config(config)
    if config["method"] == "sinks":
        return stream_nll(model, ids, config["n_sink"], config["window"], config["chunk"],
                          rerotate=config["rerotate"])
    with model.attention_mode(_trainfree_mode(config)):
        return model.token_nll(ids)


def token_stream(tokenizer: Any, root: str | None = None) -> tuple[list[int], dict[str, Any]]:
    """Token ids of the lab corpus's validation split (held-out stdlib files), and its info.

    The split is ``companion.lab.load_corpus``'s (files concatenated in sorted
    path order), decoded as UTF-8 (invalid bytes replaced) and encoded with ``tokenizer``
    (a ``tokenizers.Tokenizer``). ``info`` is the corpus info plus the token count and the
    SHA-256 of the ids, so that a stored result can tell whether it was computed on the
    same tokens.
    """
    from .lab.corpus import load_corpus

    corpus = load_corpus(root)
    text = corpus.val.tobytes().decode("utf-8", errors="replace")
    ids = tokenizer.encode(text).ids
    info = dict(corpus.info, tokens=len(ids), ids_sha256=_ids_sha256(ids))
    return ids, info


def _ids_sha256(ids: Sequence[int]) -> str:
    return hashlib.sha256(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes()).hexdigest()


def window(stream: Sequence[int], index: int, length: int) -> Tensor:
    """Window ``index`` of ``length`` tokens: ``stream[index * length : (index + 1) * length]``,
    as a ``(1, length)`` int64 tensor; an ``IndexError`` if the stream is too short."""
    index = check_positive_int(index, "index", minimum=0)
    length = check_positive_int(length, "length", minimum=2)
    if (index + 1) * length > len(stream):
        raise IndexError(
            f"window index {index} of length {length} needs {(index + 1) * length} tokens; the stream "
            f"has {len(stream)}, so index must lie in [0, {len(stream) // length - 1}]"
        )
    return torch.tensor([list(stream[index * length:(index + 1) * length])], dtype=torch.int64)


def _bucket_rows(nll: Tensor, bucket: int, first: int = 1) -> list[tuple[int, int, float, int]]:
    """``(start, end, nll_sum, count)`` over target positions ``[start, end)``; ``nll[i]`` is
    the loss of target position ``i + first``. Buckets start at the multiples of ``bucket``:
    from 0 for a whole pass (``first = 1``; position 0 has no target, so the first bucket
    counts ``bucket - 1``), else from ``first`` rounded down to one. Sums are in float64."""
    n = nll.numel() + first
    out = []
    for start in range(0 if first == 1 else first // bucket * bucket, n, bucket):
        end = min(start + bucket, n)
        part = nll[max(start - first, 0):end - first].double()  # targets max(start, first) .. end - 1
        out.append((start, end, float(part.sum()), int(part.numel())))
    return out


def evaluate_window(
    model: Any,
    ids: Tensor,
    methods: Sequence[str] = METHODS,
    *,
    factor: float = 2.0,
    bucket: int = 256,
    window_index: int = 0,
    window_start: int = 0,
    progress: Any = None,
    trainfree: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One causal pass per method over ``ids`` ``(1, L)``: the loss summed in position buckets.

    Each method's config comes from :func:`method_config` with the model's native context
    and base, and is installed with ``model.set_rope_config``; plain RoPE is restored at the
    end. A method of :data:`~companion.trainfree.TRAINFREE_METHODS` runs on plain RoPE with
    :func:`trainfree_nll` and the parameters :func:`trainfree_config` ``(method, trainfree)``,
    which its rows store in the ``rope_config`` column. Returns rows with the keys of
    ``PPL_FIELDS``; ``seconds`` is the pass's wall time. ``progress`` (a callable taking a
    string, or ``None``) reports each pass; anything else raises ``TypeError`` before the
    first pass.
    """
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be a (1, L) tensor, got {getattr(ids, 'shape', type(ids).__name__)}")
    bucket = check_positive_int(bucket, "bucket")
    if progress is not None and not callable(progress):
        raise TypeError(
            f"progress must be a callable taking a string (such as print) or None, got "
            f"{type(progress).__name__} {progress!r}"
        )
    methods = list(methods)
    for m in methods:
        if m not in METHODS and m not in TRAINFREE_METHODS:
            raise ValueError(f"methods must be drawn from {list(METHODS) + list(TRAINFREE_METHODS)}, got {m!r}")
    if len(set(methods)) < len(methods):  # its rows would be summed twice by summarize
        raise ValueError(f"methods must not repeat a method, got {methods}")
    configs = {m: trainfree_config(m, trainfree) for m in methods if m in TRAINFREE_METHODS}
    cfg = model.config
    rows = []
    try:
        for m in methods:
            if m in configs:
                rope_config = configs[m]
                model.set_rope_config(None)
                t0 = time.perf_counter()
                nll = trainfree_nll(model, ids, rope_config)[0]
            else:
                rope_config = method_config(m, factor, cfg.context_length, cfg.rope_base)
                model.set_rope_config(rope_config)
                t0 = time.perf_counter()
                nll = model.token_nll(ids)[0]
            sec = time.perf_counter() - t0
            if progress is not None:
                progress(f"window {window_index} {m}: {sec:.1f} s, ppl {math.exp(float(nll.double().mean())):.3f}")
            for start, end, total, count in _bucket_rows(nll, bucket):
                rows.append({
                    "window": window_index, "window_start": window_start, "tokens": ids.shape[1],
                    "method": m, "rope_config": json.dumps(rope_config, sort_keys=True),
                    "bucket_start": start, "bucket_end": end, "nll_sum": repr(total),
                    "count": count, "seconds": round(sec, 2),
                })
    finally:
        model.set_rope_config(None)
    return rows


#: The keys :func:`summarize` reads from a row, and how it reads each.
_SUMMARY_KEYS: dict[str, Any] = {
    "window": int, "method": str, "tokens": int, "bucket_start": int, "nll_sum": float, "count": int,
    "seconds": float,
}


def _check_rows(rows: object) -> list[Mapping[str, Any]]:
    """Bucket rows for :func:`summarize`: mappings holding every key of ``_SUMMARY_KEYS``, each
    value readable as that key's type (``ValueError`` naming the row and the key otherwise)."""
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
        raise TypeError(f"rows must be a sequence of bucket rows (mappings), got {type(rows).__name__}")
    for i, r in enumerate(rows):
        if not isinstance(r, Mapping):
            raise TypeError(f"rows[{i}] must be a mapping (a bucket row), got {type(r).__name__}")
        missing = [key for key in _SUMMARY_KEYS if key not in r]
        if missing:
            raise ValueError(
                f"rows[{i}] lacks the key(s) {missing}; bucket rows (as evaluate_window returns or "
                f"the CSV stores them) have the keys {list(PPL_FIELDS)}"
            )
        for key, kind in _SUMMARY_KEYS.items():
            if kind is str:
                continue
            try:
                kind(r[key])
            except (TypeError, ValueError):
                raise ValueError(f"rows[{i}][{key!r}] must be a number, got {r[key]!r}") from None
    return list(rows)


def summarize(rows: Sequence[Mapping[str, Any]], last: int = 1024) -> dict[tuple[int, str], dict[str, float]]:
    """Perplexities per ``(window, method)`` from bucket rows (as stored or as computed).

    Returns ``{"first_half", "second_half", "last", "all", "seconds"}`` for each pair: the
    halves split the target positions at ``tokens / 2``, and ``last`` is the final ``last``
    positions; every boundary must fall on a bucket edge.

    Raises:
        TypeError: ``rows`` not a sequence of mappings, or ``last`` not an int.
        ValueError: ``last < 1``, a row without one of the keys ``window``, ``method``,
            ``tokens``, ``bucket_start``, ``nll_sum``, ``count``, ``seconds`` (or with a
            value that is not a number), or a boundary that is not a bucket edge.
    """
    last = check_positive_int(last, "last")
    rows = _check_rows(rows)
    groups: dict[tuple[int, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((int(r["window"]), str(r["method"])), []).append(r)
    out = {}
    for key, rs in groups.items():
        n = int(rs[0]["tokens"])
        edges = {int(r["bucket_start"]) for r in rs} | {n}
        half = n // 2
        for name, value in (("tokens / 2", half), ("tokens - last", n - last)):
            if value not in edges:
                raise ValueError(f"{name} = {value} is not a bucket edge of window {key[0]} ({key[1]})")

        def ppl(lo: int, hi: int, rs=rs) -> float:
            total = sum(float(r["nll_sum"]) for r in rs if lo <= int(r["bucket_start"]) < hi)
            count = sum(int(r["count"]) for r in rs if lo <= int(r["bucket_start"]) < hi)
            return math.exp(total / count)

        out[key] = {"first_half": ppl(0, half), "second_half": ppl(half, n), "last": ppl(n - last, n),
                    "all": ppl(0, n), "seconds": float(rs[0]["seconds"])}
    return out


def passkey_prompt(
    tokenizer: Any,
    template: str,
    n_tokens: int,
    depth: float,
    key: int,
) -> list[int]:
    """Token ids of a passkey prompt of about ``n_tokens`` tokens with ``key`` at ``depth``.

    The user turn explains the task, repeats :data:`FILLER` and states the key (twice, in
    the classic wording) after a fraction ``depth`` in ``[0, 1]`` of the filler; the
    assistant's turn starts with ``"The pass key is"``. The number of filler repetitions is
    the largest that keeps the prompt within ``n_tokens``.
    """
    from .passkey import _fit, prompt_text

    n_tokens = check_positive_int(n_tokens, "n_tokens")
    depth = check_finite_number(depth, "depth", positive=False)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    key = check_positive_int(key, "key")
    return _fit(tokenizer, lambda units: prompt_text("chat", units, depth, key, template), n_tokens, 0, "n_tokens")[0]


def passkey_trial(model: Any, tokenizer: Any, ids: Sequence[int], key: int, max_new_tokens: int = 8) -> tuple[str, bool]:
    """Greedy answer to a passkey prompt: ``(answer text, correct)``; correct means the first
    number in the answer is ``key``.

    ``ids`` is the prompt (a sequence of token ids, as :func:`passkey_prompt` returns, or a
    1-D integer tensor) and ``key`` an int ``>= 1``.

    Raises:
        TypeError: ``ids`` not integers (floats, say), or ``key`` not an int (the string
            ``"12345"`` would never equal the number read from the answer).
        ValueError: ``ids`` not 1-D, or ``key < 1``.
    """
    key = check_positive_int(key, "key")
    prompt = check_int_tensor(ids, "ids", dims=(1,), what="token ids")[None]
    out = model.generate(prompt, max_new_tokens)
    answer = tokenizer.decode(out[0, prompt.shape[1]:].tolist())
    found = re.search(r"\d+", answer)
    return answer, bool(found and int(found.group()) == key)


# ----------------------------------------------------------------------------- command line


def _load(layout: str = "half") -> tuple[Any, Any, dict[str, Any]]:
    from .llama import build_model, gguf_tokenizer, read_gguf
    from .pretrained import smollm2_gguf_path

    config, weights, fields = read_gguf(smollm2_gguf_path())
    return build_model(config, weights, layout), gguf_tokenizer(fields), fields


def _json_sidecar(path: str | None, data: dict[str, Any], command: str) -> None:
    if path:
        from .utils import save_result

        save_result(path, data, command=command)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _trainfree_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ppl`` flags of the training-free methods, as :data:`TRAINFREE_DEFAULTS` keys."""
    return {"rerope_window": args.rerope_window, "leak": args.leak, "se_window": args.se_window,
            "se_group": args.se_group, "sinks": args.sinks, "sink_window": args.sink_window,
            "chunk": args.chunk, "rerotate": not args.no_rerotate}


def _check_common_args(args: argparse.Namespace) -> None:
    """The flags both commands share: ``--threads``, ``--factor``, ``--out`` and the method lists."""
    if args.threads is not None:
        check_positive_int(args.threads, "--threads")
    check_finite_number(args.factor, "--factor", minimum=1.0)
    for flag, path in (("--out", args.out), ("--json", getattr(args, "json", None))):
        if path is not None and (not path or Path(path).is_dir()):
            raise ValueError(f"{flag} must be a file path, got {'the folder ' if path else ''}{path!r}")
    for key in ("methods", "native_methods"):
        chosen = getattr(args, key, None) or []
        if len(set(chosen)) < len(chosen):
            raise ValueError(f"{_flag(key)} must not repeat a method, got {' '.join(chosen)}")


def _check_ppl_args(args: argparse.Namespace) -> None:
    """Every ``ppl`` flag, before anything is loaded (``ValueError``/``TypeError`` naming it)."""
    _check_common_args(args)
    check_positive_int(args.windows, "--windows")
    check_positive_int(args.length, "--length", minimum=2)
    check_positive_int(args.bucket, "--bucket")
    if args.length % (2 * args.bucket):
        raise ValueError(f"--length must be a multiple of 2 * --bucket = {2 * args.bucket}, so that the halves "
                         f"fall on bucket edges; got --length {args.length}")
    _check_trainfree_args(args)


def _check_trainfree_args(args: argparse.Namespace) -> None:
    """The training-free methods' flags (:func:`_add_trainfree_flags`), every method's, chosen or
    not: a bad value never passes (``ValueError``/``TypeError`` naming the flag)."""
    flags = _trainfree_flags(args)
    for method, names in _CONFIG_KEYS.items():
        _build_config(method, {key: flags[name] for key, name in names.items()},
                      {key: _flag(name) for key, name in names.items()})


def _check_passkey_args(args: argparse.Namespace) -> None:
    """Every ``passkey`` flag, before anything is loaded (``ValueError``/``TypeError`` naming it)."""
    _check_common_args(args)
    for n in args.lengths:
        check_positive_int(n, "--lengths")
    for depth in args.depths:
        if not (math.isfinite(depth) and 0.0 <= depth <= 1.0):
            raise ValueError(f"--depths must lie in [0, 1], got {depth}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _save_rows(args: argparse.Namespace, rows: list[dict[str, Any]], fields: Sequence[str], command: str) -> None:
    """The CSV of ``--out``, with ``"quick": true`` in its provenance after ``--quick``."""
    from .utils import save_csv

    save_csv(args.out, rows, fields, command=command)
    if args.quick:
        mark_quick_csv(args.out)


def _cmd_ppl(args: argparse.Namespace, command: str, error: Any) -> int:
    progress = say(args.quiet)
    trainfree = _trainfree_flags(args)
    configs = {m: trainfree_config(m, trainfree) for m in args.methods if m in TRAINFREE_METHODS}
    model, tok, _ = _load()
    stream, info = token_stream(tok)
    if args.windows * args.length > len(stream):
        error(f"--windows {args.windows} of --length {args.length} need {args.windows * args.length} tokens; "
              f"the corpus stream has {len(stream)}, so --windows must be <= {len(stream) // args.length}")
    passes = args.windows * len(args.methods)
    progress(f"ppl: {args.windows} window(s) x {len(args.methods)} method(s) = {passes} pass(es) of {args.length} "
             f"tokens on SmolLM2-135M (a pass of 16384 tokens takes minutes on 2 cores"
             f"{'' if args.quick else '; --quick for a smoke run'})")
    rows: list[dict[str, Any]] = []
    windows = []
    t0 = time.perf_counter()
    done = 0

    def report(message: str) -> None:  # after each pass: the count, the time so far and the time left
        nonlocal done
        done += 1
        spent = time.perf_counter() - t0
        progress(f"  {message}  [pass {done}/{passes}, {_duration(spent)} so far, "
                 f"about {_duration(spent / done * (passes - done))} left]")

    for w in range(args.windows):
        progress(f"window {w} ({w + 1} of {args.windows}): tokens {w * args.length} .. {(w + 1) * args.length - 1}")
        ids = window(stream, w, args.length)
        windows.append({"index": w, "start": w * args.length, "ids_sha256": _ids_sha256(ids[0].tolist()),
                        "text_head": tok.decode(ids[0, :24].tolist())})
        rows += evaluate_window(model, ids, args.methods, factor=args.factor, bucket=args.bucket,
                                window_index=w, window_start=w * args.length, progress=report,
                                trainfree=trainfree)
        _save_rows(args, rows, PPL_FIELDS, command)  # after every window: a partial run survives
    total = time.perf_counter() - t0
    data = {"corpus": info, "windows": windows, "length": args.length, "factor": args.factor,
            "methods": list(args.methods), "bucket": args.bucket, "seconds": total}
    if args.quick:
        data["quick"] = True
    if configs:
        data["trainfree"] = {m: dict(c, reach=trainfree_reach(c, args.length)) for m, c in configs.items()}
        data["seconds_per_pass"] = {m: [r["seconds"] for r in rows if r["method"] == m and r["bucket_start"] == 0]
                                    for m in args.methods}
    _json_sidecar(args.json, data, command)
    if args.quick:
        print(f"{SMOKE_RUN}: {args.out} records \"quick\": true in its provenance")
    last = min(1024, args.length // 2) // args.bucket * args.bucket
    for (w, m), s in sorted(summarize(rows, last=last).items()):
        print(f"window {w} {m:8s} first half {s['first_half']:9.3f}  second half {s['second_half']:9.3f}  "
              f"last {last} {s['last']:9.3f}  ({s['seconds']:.0f} s)")
    return 0


def _cmd_passkey(args: argparse.Namespace, command: str, error: Any) -> int:
    model, tok, fields = _load()
    template = fields["tokenizer.chat_template"]
    for n in args.lengths:  # the one check that needs the tokenizer: room for the prompt itself
        try:
            passkey_prompt(tok, template, n, 0.0, 99999)
        except ValueError as exc:
            error(f"--lengths {n}: {exc}")
    prompts = len(args.lengths) * len(args.depths)
    say(args.quiet)(f"passkey: {prompts} prompt(s) of {' '.join(map(str, args.lengths))} tokens on SmolLM2-135M, each "
                    f"answered by every method of its length (a prompt of 16384 tokens takes minutes on 2 cores"
                    f"{'' if args.quick else '; --quick for a smoke run'})")
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    native = model.config.context_length
    for n in args.lengths:
        methods = args.methods if n > native else args.native_methods
        for depth in args.depths:
            key = rng.randint(10000, 99999)
            ids = passkey_prompt(tok, template, n, depth, key)
            for m in methods:
                model.set_rope_config(method_config(m, args.factor, native, model.config.rope_base))
                t = time.perf_counter()
                answer, ok = passkey_trial(model, tok, ids, key)
                sec = time.perf_counter() - t
                print(f"{n} {m:8s} depth {depth:.2f} key {key}: {answer!r} {'ok' if ok else 'WRONG'} ({sec:.0f} s)")
                rows.append({"tokens": n, "prompt_tokens": len(ids), "method": m, "depth": depth, "key": key,
                             "answer": answer, "correct": int(ok), "seconds": round(sec, 2)})
                _save_rows(args, rows, PASSKEY_FIELDS, command)
    model.set_rope_config(None)
    if args.quick:
        print(f"{SMOKE_RUN}: {args.out} records \"quick\": true in its provenance")
    return 0


def _add_trainfree_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the training-free methods' parameters (:data:`TRAINFREE_DEFAULTS`)."""
    d = TRAINFREE_DEFAULTS
    p.add_argument("--rerope-window", type=int, default=d["rerope_window"],
                   help=f"ReRoPE / Leaky ReRoPE neighbour window w (default: {d['rerope_window']})")
    p.add_argument("--leak", type=float, default=d["leak"], help=f"Leaky ReRoPE's factor k > 1 (default: {d['leak']})")
    p.add_argument("--se-window", type=int, default=d["se_window"],
                   help=f"Self-Extend neighbour window w (default: {d['se_window']})")
    p.add_argument("--se-group", type=int, default=d["se_group"], help=f"Self-Extend group size G (default: {d['se_group']})")
    p.add_argument("--sinks", type=int, default=d["sinks"],
                   help=f"attention sinks kept, 0 = a plain sliding window (default: {d['sinks']})")
    p.add_argument("--sink-window", type=int, default=d["sink_window"],
                   help=f"recent tokens kept with the sinks (default: {d['sink_window']})")
    p.add_argument("--chunk", type=int, default=d["chunk"], help=f"tokens per step of the sink stream (default: {d['chunk']})")
    p.add_argument("--no-rerotate", action="store_true",
                   help="sinks: keep keys at their absolute positions, no rotation inside the cache "
                        "(default: rotate them to their cache positions)")


def _add_run_flags(parser: argparse.ArgumentParser, preset: dict[str, Any]) -> None:
    """``--quick`` (the ``preset``) and ``--quiet``."""
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_HELP}; sets {preset_text(preset)} (default: off, the real run)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr, only the results (default: a line per window and per pass)")


def main(argv: list[str] | None = None) -> int:
    """``python -m companion.longctx ppl|passkey|docs|context|retrieval``: run the chapter-10 experiments.

    Every flag is checked before the model, the tokenizer or the corpus is loaded, and the two
    checks that need them (enough stream for ``--windows``, room for the prompt in each of
    ``--lengths``) run before the first pass; a bad flag ends in the command's usage error
    (exit status 2, the message naming the flag), never in a traceback."""
    parser = argparse.ArgumentParser(prog="python -m companion.longctx", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ppl", help="perplexity by position over non-overlapping windows")
    p.add_argument("--length", type=int, default=16384,
                   help="tokens per window, a multiple of 2 * --bucket (default: 16384, twice the native context)")
    p.add_argument("--windows", type=int, default=2,
                   help="non-overlapping windows of the held-out stream; each costs one pass per method, "
                        "minutes at 16K on 2 cores (default: 2)")
    p.add_argument("--methods", nargs="+", choices=METHODS + TRAINFREE_METHODS, default=list(METHODS),
                   help="scaling methods and/or training-free ones (default: every scaling method)")
    p.add_argument("--factor", type=float, default=2.0, help="scaling factor s >= 1 of the scaling methods (default: 2)")
    p.add_argument("--bucket", type=int, default=256, help="tokens per stored loss bucket (default: 256)")
    _add_trainfree_flags(p)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--out", required=True, help="CSV file of the bucketed losses, with provenance (required)")
    p.add_argument("--json", default=None,
                   help="a JSON sidecar: corpus info, windows, total time (default: none)")
    _add_run_flags(p, QUICK_PPL)
    k = sub.add_parser("passkey", help="passkey retrieval in the chat format")
    k.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384],
                   help="prompt lengths in tokens (default: 8192 16384)")
    k.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9],
                   help="where the key sits in the filler, 0 = start, 1 = end (default: 0.1 0.5 0.9)")
    k.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="methods at lengths beyond the native context (default: every scaling method)")
    k.add_argument("--native-methods", nargs="+", choices=METHODS, default=["none"],
                   help="methods at lengths within the native context (default: none)")
    k.add_argument("--factor", type=float, default=2.0, help="scaling factor s >= 1 (default: 2)")
    k.add_argument("--seed", type=int, default=0, help="seed of the random keys (default: 0)")
    k.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    k.add_argument("--out", required=True, help="CSV file of the trials, with provenance (required)")
    _add_run_flags(k, QUICK_PASSKEY)
    from .longctx_runs import add_commands  # the second edition's measures (documents, context, retrieval)

    commands = {"ppl": (p, _check_ppl_args, _cmd_ppl, QUICK_PPL), "passkey": (k, _check_passkey_args, _cmd_passkey,
                                                                               QUICK_PASSKEY), **add_commands(sub)}
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    command_parser, check, run, preset = commands[args.cmd]
    args = apply_quick(parser, command_parser, argv, args, preset)
    try:  # every flag before any work: a bad one is a usage error (exit status 2), not a traceback
        check(args)
    except (TypeError, ValueError) as exc:
        command_parser.error(str(exc))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    command = "python -m companion.longctx " + " ".join(argv)
    return run(args, command, command_parser.error)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
