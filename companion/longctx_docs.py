"""Single long documents and the value of context on the same tokens (chapter 10, second edition).

Chapter 10's first edition compared the halves of 16K windows cut from a stream of
concatenated files: different text in each half, and little to read across 8K. This module
measures what a context-extension method buys on *the same tokens* of *one document*:

* **Documents** (:func:`long_documents`): the standard library's files (the lab corpus's
  split, ``companion.lab.corpus``) that are at least ``min_tokens`` tokens long with the
  model's tokenizer, longest first, each with its token count and the SHA-256 of its ids
  (:meth:`Document.record`, :func:`documents_record`). A window is a document's first
  tokens (:meth:`Document.head`), never a concatenation.
* **The same-token measure** (:func:`same_token_rows`). With ``T`` the native context
  (8192 for SmolLM2-135M), the tokens ``[T, 2T)`` of a document are scored twice:

  - by each method in one pass over the document's first ``2T`` tokens
    (:func:`method_nll`: a scaling config of :func:`companion.longctx.method_config`, or a
    training-free method through :func:`companion.longctx.trainfree_nll`), so token ``t``
    sees all ``t`` tokens before it;
  - by plain RoPE with a sliding context of ``T`` tokens at native positions
    (:func:`sliding_nll`), the model as trained, which cannot read beyond ``T``.

  Their difference, per method, is what the method buys from the tokens beyond the native
  window (or what it costs, where it breaks the model). :func:`context_value` puts a
  two-stage paired bootstrap interval on it (documents, then buckets of positions,
  :func:`companion.lab.stats.paired_bootstrap_ci`) from the stored rows alone. The control
  at ``T = 2048`` (4K against 2K) uses the same documents' first 4096 tokens: lengths the
  model certainly handles, where the extra context must help, or cost nothing.

**The sliding baseline is block-sliding.** An exact sliding window of ``T`` tokens scores
each token in its own pass (the ``T`` tokens ending at it): ``T`` passes of ``T`` tokens. With
blocks of ``S`` tokens, the targets ``[e - S, e)`` are scored together in one pass over the
``T`` tokens ``[e - T, e)``, so a token sees between ``T - S`` and ``T - 1`` earlier tokens
(the exact window: ``T - 1``), at a cost of ``T / S`` passes of ``T`` tokens per document.
The baseline sees up to ``S - 1`` tokens fewer than the exact window, so it is slightly
worse, and the value of context measured against it slightly larger than against the exact
window: by the value of the context between ``T - S`` and ``T`` tokens back, which the
4K/2K control and a run at a smaller ``S`` bound. ``S = 1`` is the exact window (tested).
The default ``S = T / 8`` (1024 at 8K) costs eight 8K passes per document, shared by every
method.

Both SmolLM2-135M (:class:`companion.llama.LlamaModel`) and Gemma 3 270M
(:class:`companion.gemma.GemmaModel`, whose scaling configs go to its global layers, or to
every layer with ``rope_layers="all"``) run here; the training-free methods need the Llama
model's attention hooks.
"""

from __future__ import annotations

import contextlib
import fnmatch
import numbers
import sysconfig
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_bool, check_finite_number, check_positive_int
from .longctx import METHODS, _bucket_rows, _ids_sha256, method_config, trainfree_config, trainfree_nll
from .trainfree import TRAINFREE_METHODS

__all__ = [
    "Document",
    "long_documents",
    "documents_record",
    "applied_method",
    "frozen_length",
    "tail_nll",
    "sliding_nll",
    "method_nll",
    "same_token_rows",
    "bucket_differences",
    "context_value",
    "far_repeats",
    "SAME_TOKEN_FIELDS",
    "SLIDING",
    "SPLITS",
    "ROPE_LAYERS",
]

#: The method name of the baseline rows, plain RoPE with a sliding context of ``T`` tokens.
SLIDING = "sliding"
#: The lab corpus's splits a document may come from (``"all"``: both).
SPLITS = ("val", "train", "all")
#: Where a Gemma model takes a scaling config (:meth:`companion.gemma.GemmaModel.set_rope_config`).
ROPE_LAYERS = ("global", "all")
#: The columns of the same-token measure's CSV.
SAME_TOKEN_FIELDS = ("model", "document", "ids_sha256", "context", "tokens", "method", "rope_config", "rope_layers",
                     "factor", "bucket_start", "bucket_end", "nll_sum", "count", "seconds", "cpu_seconds")
#: Positions per piece of the LM head (Gemma's vocabulary has 262,144 entries).
_HEAD_CHUNK = 256


# ----------------------------------------------------------------------------- documents


@dataclass(frozen=True)
class Document:
    """One file of the corpus as token ids: its path (POSIX, relative to the standard
    library's root), split, size in bytes and ``ids`` (what the tokenizer gives, ``<bos>``
    included for a tokenizer that adds it)."""

    path: str
    split: str
    bytes: int
    ids: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """The number of token ids."""
        return len(self.ids)

    @property
    def ids_sha256(self) -> str:
        """SHA-256 of the ids as little-endian int64 (as :func:`companion.longctx.token_stream`)."""
        return _ids_sha256(self.ids)

    def record(self) -> dict[str, Any]:
        """``{"path", "split", "bytes", "tokens", "ids_sha256"}``: the provenance of the document."""
        return {"path": self.path, "split": self.split, "bytes": self.bytes, "tokens": self.tokens,
                "ids_sha256": self.ids_sha256}

    def head(self, length: int) -> Tensor:
        """The first ``length`` ids as a ``(1, length)`` int64 tensor.

        Raises:
            TypeError: ``length`` not an int.
            ValueError: ``length < 2``.
            IndexError: ``length`` beyond the document (the message gives its length).
        """
        length = check_positive_int(length, "length", minimum=2)
        if length > self.tokens:
            raise IndexError(f"length must be at most the document's {self.tokens} tokens ({self.path}), got {length}")
        return torch.tensor([self.ids[:length]], dtype=torch.int64)


def long_documents(
    tokenizer: Any,
    min_tokens: int = 16384,
    *,
    split: str = "val",
    root: str | Path | None = None,
    val_fraction: float = 0.1,
    exclude: Sequence[str] = (),
) -> list[Document]:
    """The corpus files of at least ``min_tokens`` tokens, longest first (ties by path).

    The files and their split are the lab corpus's (``companion.lab.corpus.stdlib_files``,
    ``companion.lab.corpus.split_of`` with ``val_fraction``): ``split="val"`` is the
    held-out split, ``"train"`` the other, ``"all"`` both. Each file is decoded as UTF-8
    (invalid bytes replaced, as :func:`companion.longctx.token_stream` does) and encoded with
    ``tokenizer`` (a ``tokenizers.Tokenizer``). A file whose text has fewer than
    ``min_tokens - 1`` UTF-8 bytes is skipped without tokenizing it: a token covers at least
    one byte (byte-level BPE and SentencePiece with byte fallback alike), plus one for a
    ``<bos>``. ``exclude`` lists ``fnmatch`` patterns of paths to leave out (``"encodings/*"``:
    the generated code-page tables).

    With Python 3.11's standard library and SmolLM2's tokenizer, 8 held-out files reach
    16384 tokens (``pydoc_data/topics.py``, 171,511; ``subprocess.py``, 20,421; ...; four of
    them are generated code-page tables, ``encodings/cp*.py``); ``split="all"`` gives 54.

    Raises:
        TypeError: ``tokenizer`` without ``encode``, or ``min_tokens`` not an int.
        ValueError: ``min_tokens < 2``, ``split`` not one of :data:`SPLITS`, ``val_fraction``
            outside ``(0, 1)``, or ``root`` not a folder.
    """
    from .lab.corpus import split_of, stdlib_files

    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"tokenizer must be a tokenizers.Tokenizer (with encode), got {type(tokenizer).__name__}")
    min_tokens = check_positive_int(min_tokens, "min_tokens", minimum=2)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    val_fraction = check_finite_number(val_fraction, "val_fraction")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    if isinstance(exclude, str) or not all(isinstance(x, str) for x in exclude):
        raise TypeError(f"exclude must be a sequence of fnmatch patterns (strings), got {exclude!r}")
    base = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    docs = []
    for rel in stdlib_files(base):
        where = split_of(rel, val_fraction)
        if (split != "all" and where != split) or any(fnmatch.fnmatch(rel.as_posix(), x) for x in exclude):
            continue
        raw = (base / rel).read_bytes()
        text = raw.decode("utf-8", errors="replace")
        if len(text.encode("utf-8")) + 1 < min_tokens:
            continue
        ids = tokenizer.encode(text).ids
        if len(ids) >= min_tokens:
            docs.append(Document(rel.as_posix(), where, len(raw), tuple(ids)))
    return sorted(docs, key=lambda d: (-d.tokens, d.path))


def documents_record(docs: Sequence[Document], *, min_tokens: int, split: str, tokenizer: str,
                     root: str | Path | None = None, val_fraction: float = 0.1,
                     exclude: Sequence[str] = ()) -> dict[str, Any]:
    """The provenance of a document set: the corpus (Python version, root, split rule), the
    selection (``min_tokens``, ``split``, the ``tokenizer``'s name) and each document's
    :meth:`Document.record`, in order."""
    import platform

    from .lab.corpus import EXCLUDED_DIRS

    return {
        "source": "stdlib *.py", "python_version": platform.python_version(),
        "root": str(Path(sysconfig.get_paths()["stdlib"] if root is None else root)),
        "excluded_dirs": sorted(EXCLUDED_DIRS), "split_rule": f"sha256(relative path)[:8] / 2**64 < {val_fraction} -> val",
        "split": split, "min_tokens": min_tokens, "tokenizer": tokenizer, "exclude": list(exclude),
        "documents": [d.record() for d in docs],
    }


# ----------------------------------------------------------------------------- methods on a model


def _is_gemma(model: Any) -> bool:
    from .gemma import GemmaModel
    from .llama import LlamaModel

    if isinstance(model, GemmaModel):
        return True
    if isinstance(model, LlamaModel):
        return False
    raise TypeError(f"model must be a companion.llama.LlamaModel or a companion.gemma.GemmaModel, "
                    f"got {type(model).__name__}")


def _check_method(method: object) -> str:
    if not isinstance(method, str) or (method not in METHODS and method not in TRAINFREE_METHODS):
        raise ValueError(f"method must be one of {list(METHODS) + list(TRAINFREE_METHODS)}, got {method!r}")
    return method


@contextlib.contextmanager
def applied_method(model: Any, method: str, *, factor: float = 2.0, rope_layers: str = "global",
                   trainfree: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any] | None]:
    """Context manager: ``method`` installed on ``model``; yields its config as stored.

    A scaling method (:data:`companion.longctx.METHODS`) installs
    :func:`companion.longctx.method_config` at ``factor`` over the model's native context
    (``config.context_length``) and base; on a Gemma model without ``rope_theta``, so that
    each kind of layer keeps its own base, on the layers ``rope_layers`` names. A
    training-free method (:data:`companion.trainfree.TRAINFREE_METHODS`, Llama only) leaves
    plain RoPE installed and yields :func:`companion.longctx.trainfree_config` ``(method,
    trainfree)``: run it with :func:`companion.longctx.trainfree_nll` (or
    :mod:`companion.passkey`). Plain RoPE is restored on exit, also after an error.

    Raises:
        TypeError: ``model`` neither model.
        ValueError: an unknown method, a training-free method on Gemma, ``rope_layers`` not
            one of :data:`ROPE_LAYERS` (or ``"all"`` on the Llama model, which has one RoPE),
            or a bad ``factor`` or ``trainfree``.
    """
    gemma = _is_gemma(model)
    method = _check_method(method)
    if rope_layers not in ROPE_LAYERS:
        raise ValueError(f"rope_layers must be one of {list(ROPE_LAYERS)}, got {rope_layers!r}")
    if not gemma and rope_layers != "global":
        raise ValueError("rope_layers must be 'global' for a Llama model (one RoPE for every layer); 'all' is "
                         "Gemma's ablation")
    cfg = model.config
    if method in TRAINFREE_METHODS:
        if gemma:
            raise ValueError(f"method {method!r} is a training-free method, which needs companion.llama's attention "
                             f"hooks; on a Gemma model use one of {list(METHODS)}")
        config = trainfree_config(method, trainfree)
        install: dict[str, Any] | None = None
    else:
        config = method_config(method, factor, cfg.context_length, cfg.rope_base)
        if gemma and config is not None:
            config.pop("rope_theta")
        install = config
    try:
        if gemma:
            model.set_rope_config(install, rope_layers)
        else:
            model.set_rope_config(install)
        yield config
    finally:
        model.set_rope_config(None)


def _ropes(model: Any) -> list[Any]:
    from .rope import RotaryEmbedding

    return [m for m in model.modules() if isinstance(m, RotaryEmbedding)]


@contextlib.contextmanager
def frozen_length(model: Any, length: int) -> Iterator[None]:
    """Context manager: every length-dependent RoPE of ``model`` (``dynamic``, ``longrope``)
    fixed at the frequencies a single pass of ``length`` tokens would use.

    Dynamic NTK sets its base from ``max(position) + 1`` of each call, growing only
    (HuggingFace's rule), so a pass cut into chunks, or a prompt whose prefix comes from a
    cache, would rotate its first tokens with other frequencies than one pass over the whole
    does. Inside this context the rope holds the frequencies (and attention factor) that
    :meth:`companion.rope.RotaryEmbedding.rotate` computes for a call reaching ``length``,
    as a fixed table; other ropes are left as they are. The configs are reinstalled on exit.

    Raises:
        TypeError: ``length`` not an int.
        ValueError: ``length < 1``.
    """
    length = check_positive_int(length, "length")
    saved = []
    try:
        for rope in _ropes(model):
            spec = rope.rope_spec
            if spec is None or not spec.is_dynamic:
                continue
            params, mpe = rope.rope_config, spec.max_position_embeddings
            saved.append((rope, params, mpe))
            rope.set_rope_config(params, max_position_embeddings=mpe)  # a fresh state, then the pass's rule
            rope._follow_length(length)
            inv_freq, factor = rope.inv_freq, rope.attention_scaling
            rope.set_rope_config({"rope_type": "default", "rope_theta": spec.theta})
            rope.set_frequencies(inv_freq, factor)
        yield
    finally:
        for rope, params, mpe in saved:
            rope.set_rope_config(params, max_position_embeddings=mpe)


# ----------------------------------------------------------------------------- per-token losses


def _check_ids(ids: object, name: str = "ids") -> Tensor:
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"{name} must be a (1, n) tensor of token ids, got {getattr(ids, 'shape', type(ids).__name__)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {ids.dtype}")
    return ids.long()


def _head_nll(model: Any, h: Tensor, targets: Tensor) -> Tensor:
    """NLL of ``targets`` ``(n,)`` from hidden states ``h`` ``(1, n, dim)``, the LM head in pieces."""
    out = []
    for a in range(0, h.shape[1], _HEAD_CHUNK):
        logits = model.logits(h[:, a:a + _HEAD_CHUNK])[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        out.append(F.cross_entropy(logits, targets[a:a + logits.shape[0]], reduction="none"))
    return torch.cat(out)


@torch.no_grad()
def tail_nll(model: Any, ids: Tensor, first: int, *, chunk: int | None = None) -> Tensor:
    """Per-token NLL ``(n - first,)`` of the targets ``ids[0, first:]``, in one pass over ``ids``.

    Target ``t`` is predicted from ``ids[0, :t]`` at positions ``0 .. t - 1`` with whatever
    RoPE the model has installed; the LM head runs only on the positions that predict a
    target (``first - 1 .. n - 2``). ``chunk=None`` is one prefill call; an int feeds the pass
    ``chunk`` tokens at a time through a :class:`companion.llama.KVCache` (memory bounded by
    the chunk, the same losses to rounding; wrap it in :func:`frozen_length` for a
    length-dependent RoPE).

    Raises:
        TypeError: integer arguments of another type, float ``ids``.
        ValueError: ``ids`` not ``(1, n)``, ``first`` outside ``[1, n - 1]``, ``chunk < 1``.
    """
    from .llama import KVCache

    ids = _check_ids(ids)
    n = ids.shape[1]
    first = check_positive_int(first, "first")
    if first > n - 1:
        raise ValueError(f"first must lie in [1, {n - 1}] (a target after the first token), got {first}")
    if chunk is None:
        h = model.hidden(ids[:, :n - 1])[:, first - 1:]
    else:
        chunk = check_positive_int(chunk, "chunk")
        cache = KVCache(model.config.n_layers)
        parts = []
        for s in range(0, n - 1, chunk):
            e = min(s + chunk, n - 1)
            part = model.hidden(ids[:, s:e], cache)
            if e > first - 1:
                parts.append(part[:, max(first - 1 - s, 0):])
        h = torch.cat(parts, dim=1)
    return _head_nll(model, h, ids[0, first:])


@torch.no_grad()
def sliding_nll(model: Any, ids: Tensor, lo: int, hi: int, context: int, block: int, *,
                keep: int = 0, chunk: int | None = None) -> Tensor:
    """Per-token NLL ``(hi - lo,)`` of the targets ``ids[0, lo:hi]`` with a block-sliding context.

    The targets go in blocks ``[a, e)`` of ``block`` tokens (``a = lo, lo + block, ...``);
    each block is scored by :func:`tail_nll` in one pass over ``ids[0, max(0, e - context):e]``
    at positions ``0 ..``, so target ``t`` sees the ``min(t, context - (e - t))`` tokens
    before it: between ``context - block`` and ``context - 1`` once ``t >= context``
    (``block = 1``: exactly ``context - 1``, the exact sliding window). Runs with the RoPE
    the model has installed (plain, for the baseline of :func:`same_token_rows`).

    ``keep`` tokens at the start of ``ids`` stay in every pass: a pass is then
    ``ids[0, :keep]`` followed by the last ``context - keep`` tokens up to ``e`` (still
    ``context`` tokens, at positions ``0 ..``). ``keep=1`` keeps a ``<bos>`` token: a model
    trained with one at the start of every sequence (Gemma) does worse on a pass that starts
    without it, and that loss is not the loss of the far context.

    Raises:
        TypeError: integer arguments of another type.
        ValueError: ``ids`` not ``(1, n)``; not ``1 <= lo < hi <= n``; ``context < 2``;
            ``block`` outside ``[1, context - 1]`` (each target needs a token before it in
            its pass); ``keep`` outside ``[0, min(lo, context - block - 1)]`` (the kept tokens
            lie before every target and leave each target a token before it besides them).
    """
    ids = _check_ids(ids)
    n = ids.shape[1]
    lo, hi = check_positive_int(lo, "lo"), check_positive_int(hi, "hi")
    if not lo < hi <= n:
        raise ValueError(f"lo and hi must satisfy 1 <= lo < hi <= {n} (the length of ids), got lo {lo}, hi {hi}")
    context = check_positive_int(context, "context", minimum=2)
    block = check_positive_int(block, "block")
    if block > context - 1:
        raise ValueError(f"block must lie in [1, context - 1] = [1, {context - 1}], got {block}")
    if isinstance(keep, bool) or not isinstance(keep, int):
        raise TypeError(f"keep must be an int, got {type(keep).__name__} {keep!r}")
    top = min(lo, context - block - 1)
    if not 0 <= keep <= top:
        raise ValueError(f"keep must lie in [0, min(lo, context - block - 1)] = [0, {top}], got {keep}")
    out = []
    for a in range(lo, hi, block):
        e = min(a + block, hi)
        s = max(0, e - context)
        if keep and s > 0:  # the kept tokens, then the last context - keep tokens up to e
            s += keep
            out.append(tail_nll(model, torch.cat([ids[:, :keep], ids[:, s:e]], dim=1), keep + a - s, chunk=chunk))
        else:
            out.append(tail_nll(model, ids[:, s:e], a - s, chunk=chunk))
    return torch.cat(out)


@torch.no_grad()
def method_nll(model: Any, ids: Tensor, method: str, *, factor: float = 2.0, rope_layers: str = "global",
               trainfree: Mapping[str, Any] | None = None, chunk: int | None = None,
               first: int = 1) -> tuple[Tensor, dict[str, Any] | None]:
    """Per-token NLL ``(n - first,)`` of ``ids[0, first:]`` in one pass of ``n`` tokens with
    ``method``, and the method's stored config (:func:`applied_method`).

    A scaling method runs :func:`tail_nll` (``chunk`` as there) with its frequencies fixed at
    the pass's length (:func:`frozen_length`: what a single pass computes for Dynamic NTK); a
    training-free one :func:`companion.longctx.trainfree_nll`. Plain RoPE is restored after.

    Raises:
        TypeError, ValueError: as :func:`applied_method` and :func:`tail_nll`.
    """
    ids = _check_ids(ids)
    first = check_positive_int(first, "first")
    if first > ids.shape[1] - 1:
        raise ValueError(f"first must lie in [1, {ids.shape[1] - 1}] (a target after the first token), got {first}")
    with applied_method(model, method, factor=factor, rope_layers=rope_layers, trainfree=trainfree) as config:
        if method in TRAINFREE_METHODS:
            return trainfree_nll(model, ids, config)[0, first - 1:].float(), config
        with frozen_length(model, ids.shape[1]):
            return tail_nll(model, ids, first, chunk=chunk), config


def _model_name(model: Any) -> str:
    return str(getattr(model.config, "name", "")) or type(model).__name__


def same_token_rows(
    model: Any,
    document: Document,
    context: int,
    methods: Sequence[str],
    *,
    factor: float = 2.0,
    block: int | None = None,
    bucket: int = 512,
    rope_layers: str = "global",
    trainfree: Mapping[str, Any] | None = None,
    chunk: int | None = None,
    baseline: bool = True,
    targets: str = "all",
    keep_bos: bool = True,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """The same-token measure on one document: rows of bucketed losses (:data:`SAME_TOKEN_FIELDS`).

    The window is the document's first ``2 * context`` tokens. With ``baseline``, the
    targets ``[context, 2 context)`` are scored by :func:`sliding_nll` (plain RoPE, a sliding
    context of ``context`` tokens in blocks of ``block``, default ``context // 8``), in rows
    of method :data:`SLIDING`; with ``keep_bos``, when the document starts with the model's
    BOS token (``model.config.bos_id``: Gemma's tokenizer adds ``<bos>``, SmolLM2's adds
    nothing), every pass of the baseline keeps it (``keep=1``, recorded as ``"keep": 1`` in
    the rows' ``rope_config``), as every pass of the methods has it; then each of ``methods`` scores every target of one pass over
    the window (:func:`method_nll`), in rows of its name; with ``targets="measured"`` only
    the targets ``[context, 2 context)`` (the LM head is half of a Gemma pass's cost, its
    vocabulary having 262,144 entries; the first half, where a method can only lose, is then
    not stored). Buckets of ``bucket`` target
    positions (``context`` a multiple of it); ``nll_sum`` in float64, written with ``repr``;
    ``seconds`` and ``cpu_seconds`` (process time, all threads) are the wall and CPU time of
    the method's pass (or of the whole sliding baseline), the same on each of its rows.
    ``progress`` is a callable taking a string (or ``None``).

    Raises:
        TypeError: ``document`` not a :class:`Document`, ``progress`` not callable, integers
            of another type.
        ValueError: ``context < 2``; ``bucket`` not dividing ``context``; a document shorter
            than ``2 * context`` tokens; repeated or unknown methods; and as
            :func:`method_nll`, :func:`sliding_nll`.
    """
    if not isinstance(document, Document):
        raise TypeError(f"document must be a Document (from long_documents), got {type(document).__name__}")
    context = check_positive_int(context, "context", minimum=2)
    bucket = check_positive_int(bucket, "bucket")
    if context % bucket:
        raise ValueError(f"bucket must divide context ({context}), so that [context, 2 context) is whole buckets; "
                         f"got {bucket}")
    block = max(context // 8, 1) if block is None else check_positive_int(block, "block")
    if document.tokens < 2 * context:
        raise ValueError(f"document {document.path} has {document.tokens} tokens; the measure at context {context} "
                         f"needs 2 * context = {2 * context}")
    methods = [_check_method(m) for m in methods]
    if len(set(methods)) < len(methods):
        raise ValueError(f"methods must not repeat a method, got {methods}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable taking a string, or None, got {type(progress).__name__}")
    if targets not in ("all", "measured"):
        raise ValueError(f"targets must be 'all' or 'measured', got {targets!r}")
    keep = _kept_bos(model, document, check_bool(keep_bos, "keep_bos"))
    first = 1 if targets == "all" else context
    ids = document.head(2 * context)
    common = {"model": _model_name(model), "document": document.path, "ids_sha256": document.ids_sha256,
              "context": context, "tokens": 2 * context, "factor": factor, "rope_layers": rope_layers}
    rows: list[dict[str, Any]] = []

    def add(method: str, config: Any, nll: Tensor, first: int, wall: float, cpu: float) -> None:
        for start, end, total, count in _bucket_rows(nll, bucket, first):
            rows.append(dict(common, method=method, rope_config=_json(config), bucket_start=start, bucket_end=end,
                             nll_sum=repr(total), count=count, seconds=round(wall, 2), cpu_seconds=round(cpu, 2)))
        if progress is not None:
            progress(f"{document.path} {method}: {wall:.1f} s ({cpu:.0f} CPU s), nll "
                     f"{float(nll[-context:].double().mean()):.4f} on [{context}, {2 * context})")

    if baseline:
        t, c = time.perf_counter(), time.process_time()
        with applied_method(model, "none", rope_layers=rope_layers):
            nll = sliding_nll(model, ids, context, 2 * context, context, block, keep=keep, chunk=chunk)
        config = {"block": block, "context": context} | ({"keep": keep} if keep else {})
        add(SLIDING, config, nll, context, time.perf_counter() - t, time.process_time() - c)
    for m in methods:
        t, c = time.perf_counter(), time.process_time()
        nll, config = method_nll(model, ids, m, factor=factor, rope_layers=rope_layers, trainfree=trainfree,
                                 chunk=chunk, first=first)
        add(m, config, nll, first, time.perf_counter() - t, time.process_time() - c)
    return rows


def _kept_bos(model: Any, document: Document, keep_bos: bool = True) -> int:
    """How many tokens the sliding baseline keeps in every pass: 1 when ``keep_bos`` and the
    document starts with the model's BOS token (``model.config.bos_id``), else 0. The one rule,
    for :func:`same_token_rows` and for the cache key of ``python -m companion.longctx context``."""
    bos = getattr(getattr(model, "config", None), "bos_id", None)
    return int(keep_bos and bos is not None and document.ids[0] == bos)


def _json(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True)


def far_repeats(ids: Sequence[int], context: int, lo: int, hi: int, *, n: int = 8) -> np.ndarray:
    """Which targets ``t`` in ``[lo, hi)`` only a reader of more than ``context`` tokens can copy.

    Target ``t`` is a *far repeat* when the ``n``-gram ``ids[t - n + 1 : t + 1]`` (the target
    and the ``n - 1`` tokens before it) occurred earlier, ending more than ``context`` tokens
    before ``t`` (at some ``e < t - context``), and nowhere in the last ``context`` tokens
    (no occurrence ending in ``[t - context, t)``). A model with a sliding window of
    ``context`` tokens sees the ``n - 1`` tokens before ``t`` but not the earlier passage that
    continued them with ``t``; a model that reads the whole document can copy it. This is
    where the value of the far context (:func:`context_value`) should come from. Returns a
    boolean array of length ``hi - lo``. Pure token arithmetic, no model: a dictionary of
    each ``n``-gram's latest end position, so linear in ``hi`` on average.

    Raises:
        TypeError: integer arguments of another type, or ``ids`` not a sequence of ints.
        ValueError: ``context < 1``, ``n < 1``, or not ``n - 1 <= lo < hi <= len(ids)``.
    """
    if isinstance(ids, (str, bytes)) or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool)
                                                for i in ids):
        raise TypeError("ids must be a sequence of int token ids")
    ids = [int(i) for i in ids]
    context = check_positive_int(context, "context")
    n = check_positive_int(n, "n")
    lo = check_positive_int(lo, "lo", minimum=0)
    hi = check_positive_int(hi, "hi", minimum=0)
    if not n - 1 <= lo < hi <= len(ids):
        raise ValueError(f"lo and hi must satisfy n - 1 = {n - 1} <= lo < hi <= {len(ids)} (the length of ids), "
                         f"got lo {lo}, hi {hi}")
    last: dict[tuple[int, ...], int] = {}  # each n-gram's latest end so far
    out = np.zeros(hi - lo, dtype=bool)
    for e in range(n - 1, hi):
        gram = tuple(ids[e - n + 1:e + 1])
        prev = last.get(gram)
        if e >= lo and prev is not None:
            out[e - lo] = prev < e - context  # the latest earlier occurrence is out of reach
        last[gram] = e
    return out


# ----------------------------------------------------------------------------- statistics


def _rows_value(row: Mapping[str, Any], key: str, kind: type) -> Any:
    try:
        return kind(row[key])
    except KeyError:
        raise ValueError(f"a row lacks the key {key!r}; same-token rows have the keys {list(SAME_TOKEN_FIELDS)}") from None
    except (TypeError, ValueError):
        raise ValueError(f"row[{key!r}] must be a {kind.__name__}, got {row[key]!r}") from None


def _bucket_means(rows: Sequence[Mapping[str, Any]], method: str, context: int) -> dict[str, dict[int, float]]:
    """``{document: {bucket_start: mean nll}}`` over the targets ``[context, 2 context)``."""
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        if str(r.get("method")) != method or _rows_value(r, "context", int) != context:
            continue
        start = _rows_value(r, "bucket_start", int)
        if start < context:
            continue
        doc = str(_rows_value(r, "document", str))
        if start in out.setdefault(doc, {}):
            raise ValueError(f"document {doc!r} has two rows of method {method!r} for bucket {start} at context "
                             f"{context} (rows of two runs mixed?)")
        out[doc][start] = _rows_value(r, "nll_sum", float) / _rows_value(r, "count", int)
    return out


def bucket_differences(
    rows: Sequence[Mapping[str, Any]], method: str, context: int, *, baseline: str = SLIDING
) -> tuple[list[str], list[int], np.ndarray, np.ndarray]:
    """``(documents, bucket_starts, base, meth)``: the mean NLL per document and bucket.

    From stored rows (:func:`same_token_rows`, or the CSV's strings), over the targets
    ``[context, 2 context)``: ``base[i, j]`` and ``meth[i, j]`` are the mean NLL (nats per
    token) of ``baseline`` and of ``method`` on document ``documents[i]``, bucket
    ``bucket_starts[j]``, so ``base - meth`` is what the method's full window buys (positive
    when it helps). :func:`context_value` puts an interval on it; a figure averages it over
    the documents.

    Raises:
        ValueError: no rows for ``method`` or ``baseline`` at ``context``, documents or
            buckets that the two do not share, two rows for one bucket, or a row without the
            needed keys.
    """
    context = check_positive_int(context, "context", minimum=2)
    base, meth = _bucket_means(rows, baseline, context), _bucket_means(rows, method, context)
    for name, got in ((baseline, base), (method, meth)):
        if not got:
            raise ValueError(f"rows hold no bucket of method {name!r} at context {context} in [{context}, {2 * context})")
    if sorted(base) != sorted(meth):
        raise ValueError(f"{method!r} and {baseline!r} must be scored on the same documents, got {sorted(meth)} and "
                         f"{sorted(base)}")
    docs = sorted(base)
    buckets = sorted(base[docs[0]])
    for d in docs:
        if sorted(base[d]) != buckets or sorted(meth[d]) != buckets:
            raise ValueError(f"document {d!r}: {method!r} and {baseline!r} must have the buckets {buckets}")
    a = np.array([[base[d][b] for b in buckets] for d in docs])
    b = np.array([[meth[d][k] for k in buckets] for d in docs])
    return docs, buckets, a, b


def context_value(
    rows: Sequence[Mapping[str, Any]],
    method: str,
    context: int,
    *,
    baseline: str = SLIDING,
    confidence: float = 0.95,
    resamples: int = 4000,
    seed: int = 0,
) -> dict[str, Any]:
    """What ``method``'s full window buys over ``baseline`` on the targets ``[context, 2 context)``.

    From stored rows (:func:`same_token_rows`, or the CSV's strings): for each document and
    bucket (:func:`bucket_differences`), the mean NLL of the baseline minus that of ``method`` (nats per token; positive
    when the method predicts the same tokens better, i.e. when the context beyond the native
    window helps). Returns ``{"interval": Interval, "per_document": {path: mean}, "documents",
    "buckets"}``: the interval is :func:`companion.lab.stats.paired_bootstrap_ci` with the
    documents as rows and the buckets as units, both resampled (``resample_rows=True``: a
    two-stage bootstrap, so the spread between documents counts).

    Raises:
        ValueError: no rows for ``method`` or ``baseline`` at ``context``, documents or
            buckets that the two do not share, or a row without the needed keys.
    """
    from .lab.stats import paired_bootstrap_ci

    docs, buckets, a, b = bucket_differences(rows, method, context, baseline=baseline)
    interval = paired_bootstrap_ci(a, b, confidence=confidence, resamples=resamples, seed=seed, resample_rows=True)
    return {"interval": interval, "per_document": {d: float((a[i] - b[i]).mean()) for i, d in enumerate(docs)},
            "documents": len(docs), "buckets": len(buckets)}

