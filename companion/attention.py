"""The position-scheme protocol and the reference attention.

There are exactly four places where position information can enter scaled dot-product
attention, and every encoding in the book uses one or more of them:

============  ======================================  ==========================================
hook          what it changes                         schemes
============  ======================================  ==========================================
``embed``     adds a vector to the token embeddings   sinusoidal, learned, scaled sinusoidal
``rotate``    transforms queries and keys             RoPE and its scaling methods, xPos
``bias``      adds a content-free term to the logits  ALiBi, T5 buckets
``score``     content-dependent logit (and value)     Shaw, Transformer-XL
              terms
============  ======================================  ==========================================

A scheme is a :class:`PositionScheme`, a small ``torch.nn.Module`` that overrides the hooks it
needs; the others stay identities. :func:`attention` is the single reference implementation
that honours all four, and it is what every faster path in the package is tested against.

With ``s = scheme``, queries ``q``, keys ``k``, values ``v`` (layout
``(batch, heads, seq, head_dim)``) and integer positions, the reference computes::

    q, k   = s.rotate(q, k, q_pos, k_pos)
    logits = scale * (q @ k^T + s.score(q, k, q_pos, k_pos)) + s.bias(q_pos, k_pos)
    w      = softmax(logits masked by causal / attn_mask)
    out    = w @ v + s.score_values(w, q_pos, k_pos)

The ``score`` term sits inside the scale because Shaw et al. and Transformer-XL scale their
whole logit by ``1/sqrt(d)``; the ``bias`` term sits outside because ALiBi and T5 add it to
the final logit. ``embed`` acts earlier, on the residual stream, and is applied by the model
(:class:`companion.model.TinyDecoder`), not inside attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ._checks import (
    check_positive_int,
    nonfinite_flags,
    restore_nonfinite,
    zero_nonfinite,
    broadcasts_to,
    as_grid_positions,
    as_positions,
    check_bool,
    check_finite_number,
    check_position_pair,
    check_qkv,
    check_scheme_heads,
    normalize_mask,
)

__all__ = ["HOOKS", "PositionScheme", "NoPE", "attention", "causal_mask"]

#: The four hooks, in the order they act in a forward pass.
HOOKS: tuple[str, ...] = ("embed", "rotate", "bias", "score")


class PositionScheme(nn.Module):
    """Base class of every position scheme: four hooks, all identities by default.

    Subclasses override the hooks they need. Shapes:

    * ``embed(x, pos)``: ``x`` is ``(batch, seq, d_model)``; returns the same shape.
    * ``rotate(q, k, q_pos, k_pos)``: ``q`` is ``(batch, heads, q_len, head_dim)``, ``k``
      is ``(batch, kv_heads, k_len, head_dim)``; returns ``(q, k)`` with the same shapes.
    * ``bias(q_pos, k_pos)``: returns a tensor that broadcasts to
      ``(batch, heads, q_len, k_len)``, or ``None``.
    * ``score(q, k, q_pos, k_pos)``: returns a logit term of shape
      ``(batch, heads, q_len, k_len)`` (added before the ``1/sqrt(d)`` scale), or ``None``.
      Its companion ``score_values(weights, q_pos, k_pos)`` returns a term added to the
      attention output, ``(batch, heads, q_len, v_dim)``, or ``None`` (Shaw's ``a^V``).

    Positions are ``int64`` tensors of shape ``(seq,)`` (shared by the batch) or
    ``(batch, seq)`` (per row, for left padding or packed sequences).

    A scheme with per-head state (ALiBi's slopes, T5's table, Transformer-XL's biases)
    reports its head count through :meth:`scheme_heads`; every attention path calls
    :meth:`check_heads` with the number of query heads before using the scheme, so a scheme
    built for the wrong number of heads raises ``ValueError`` instead of broadcasting.
    """

    #: The number of coordinates per token, 1 for a sequence (positions ``(seq,)`` or
    #: ``(batch, seq)``) and ``A > 1`` for a scheme on a grid (:mod:`companion.grid`), whose
    #: positions are ``(seq, A)`` or ``(batch, seq, A)``, one integer per axis.
    position_axes: int = 1

    def default_positions(self, length: int, start: int, device: torch.device) -> Tensor:
        """The positions the attention functions use when none are given: ``arange(start,
        start + length)`` for a sequence scheme. A grid scheme has no default grid, so it raises
        ``ValueError`` (:class:`companion.grid.MRoPE` overrides it with text positions)."""
        if self.position_axes == 1:
            return torch.arange(start, start + length, device=device)
        a = self.position_axes
        raise ValueError(
            f"{type(self).__name__} takes grid positions: pass q_pos and k_pos of shape (seq, {a}) "
            f"or (batch, seq, {a}) (companion.grid_positions builds them for a grid)"
        )

    def scheme_heads(self) -> int | None:
        """The number of heads the scheme was built for, or ``None`` if it fits any count."""
        return None

    def check_heads(self, q_heads: int) -> None:
        """Raise ``ValueError`` unless the scheme fits ``q_heads`` query heads exactly."""
        heads = self.scheme_heads()
        if heads is not None:
            check_scheme_heads(heads, q_heads, type(self).__name__)

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """Add position information to token embeddings ``x``. Default: unchanged."""
        return x

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Transform queries and keys by their positions. Default: unchanged."""
        return q, k

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """Return an additive, content-free logit bias. Default: none."""
        return None

    def score(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """Return a content-dependent logit term (before scaling). Default: none."""
        return None

    def score_values(self, weights: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """Return a term added to the attention output (part of the ``score`` hook)."""
        return None

    @classmethod
    def hooks(cls) -> tuple[str, ...]:
        """The hooks this scheme class overrides, in :data:`HOOKS` order.

        Works on the class or an instance: ``ALiBi.hooks() == ("bias",)``.
        """
        used = []
        for name in HOOKS:
            if getattr(cls, name) is not getattr(PositionScheme, name):
                used.append(name)
            elif name == "score" and cls.score_values is not PositionScheme.score_values:
                used.append(name)
        return tuple(used)

    def forward(self, *args: object, **kwargs: object) -> None:
        """Schemes are not called directly; this raises ``TypeError`` with a pointer."""
        raise TypeError(
            f"{type(self).__name__} is a position scheme, not a layer: pass it to "
            "companion.attention(...) or call one of its hooks (embed, rotate, bias, score)"
        )

    def extra_repr(self) -> str:
        return f"hooks={self.hooks()}"


class NoPE(PositionScheme):
    """No position information at all: every hook is the identity.

    The baseline of every experiment in the book. A bidirectional NoPE attention layer is
    permutation-equivariant; a causal one can still infer position from the mask
    (Kazemnejad et al., :cite:`kazemnejad2023nope`).
    """


def causal_mask(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Boolean mask, ``True`` where query ``i`` may attend key ``j``: ``k_pos[j] <= q_pos[i]``.

    Defined by positions rather than by indices, so it stays right for KV-cache decoding
    (queries are the last tokens), and for per-row positions. Shape ``(q_len, k_len)`` for
    shared positions, ``(batch, q_len, k_len)`` if either argument is per row.

    Positions must be integer tensors (or lists of ints), ``(len,)`` or ``(batch, len)``:
    float positions raise ``TypeError``, since a float position (bf16 near 256, say) can
    round past its neighbour and let a query see a future key.
    """
    q_pos, k_pos = check_position_pair(q_pos, k_pos)
    return k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)


def _check_local(window: object, chunk: object, causal: bool) -> tuple[int | None, int | None]:
    """Validate ``window`` and ``chunk`` (each ``None`` or an int ``>= 1``, only with
    ``causal=True``); returns them."""
    for name, value in (("window", window), ("chunk", chunk)):
        if value is None:
            continue
        check_positive_int(value, name)
        if not causal:
            raise ValueError(
                f"{name}={value} needs causal=True: a {'sliding window' if name == 'window' else 'chunk'} "
                f"limits how far back a query sees (keys at or before it), so it is defined for causal "
                f"attention only; pass causal=True, or an attn_mask for another pattern"
            )
    return window, chunk  # type: ignore[return-value]


def _visibility(q_pos: Tensor, k_pos: Tensor, causal: bool, window: int | None = None,
                chunk: int | None = None) -> Tensor | None:
    """Bool ``True`` = attend from the causal mask, the sliding ``window`` and the ``chunk``
    (validated int positions), ``(q_len, k_len)`` or ``(batch, q_len, k_len)``; ``None``
    without ``causal``. Query ``i`` sees key ``j`` iff ``j <= i``, ``i - window < j`` and
    ``j // chunk == i // chunk`` (each rule where given)."""
    if not causal:
        return None
    qp, kp = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    vis = kp <= qp
    if window is not None:
        vis = vis & (kp > qp - window)
    if chunk is not None:
        vis = vis & (torch.div(kp, chunk, rounding_mode="floor") == torch.div(qp, chunk, rounding_mode="floor"))
    return vis


def _check_hook_shape(term: object, want: tuple[int, ...], scheme: PositionScheme, hook: str,
                      names: str) -> None:
    """A ``bias``/``score``/``score_values`` term must be a tensor that broadcasts to ``want``."""
    if not isinstance(term, Tensor):
        raise TypeError(f"{type(scheme).__name__}.{hook} must return a tensor or None, got {type(term).__name__}")
    if not broadcasts_to(term.shape, want):
        raise ValueError(
            f"{type(scheme).__name__}.{hook} returned shape {tuple(term.shape)}, which does not "
            f"broadcast to {names} = {want}"
        )


def _rotate_checked(scheme: PositionScheme, q: Tensor, k: Tensor, q_pos: Tensor,
                   k_pos: Tensor) -> tuple[Tensor, Tensor]:
    """``scheme.rotate(q, k, q_pos, k_pos)``, which must preserve the shapes of ``q`` and ``k``
    (``ValueError`` otherwise)."""
    q2, k2 = scheme.rotate(q, k, q_pos, k_pos)
    if q2.shape != q.shape or k2.shape != k.shape:
        raise ValueError(f"{type(scheme).__name__}.rotate must preserve the shapes of q and k")
    return q2, k2


def _heads_view(mask: Tensor) -> Tensor:
    """Give a ``(q, k)`` or ``(batch, q, k)`` mask a heads axis so it broadcasts."""
    return mask if mask.dim() == 2 else mask.unsqueeze(1)


class _Prologue(NamedTuple):
    """What every attention path validates and defaults before it computes (see
    :func:`_prologue`): the sizes, the flags, the positions, the scale and the mask."""

    batch: int
    heads: int
    q_len: int
    head_dim: int
    kv_heads: int
    k_len: int
    causal: bool
    #: the logit scale: the argument, validated, or ``1 / sqrt(head_dim)``
    scale: float
    #: int64 positions on ``q``'s device (``None`` only with ``materialize=False``, for the
    #: default ``arange(q_start, q_start + q_len)`` / ``arange(k_len)``)
    q_pos: Tensor | None
    k_pos: Tensor | None
    #: the first default query position: ``max(k_len - q_len, 0)`` (KV-cache decoding)
    q_start: int
    #: ``attn_mask`` split by :func:`~companion._checks.normalize_mask`: bool ``True`` =
    #: attend, or a floating term added to the logits (at most one is not ``None``)
    allowed: Tensor | None
    additive: Tensor | None
    #: the dtype the math runs in: float32 for float16/bfloat16 inputs, else the input's
    work: torch.dtype
    #: the positions that order the tokens for the causal mask: ``q_pos``/``k_pos`` for a
    #: sequence scheme; the sequence indices ``arange(q_start, q_start + q_len)`` /
    #: ``arange(k_len)`` for a grid scheme, whose positions have no total order
    q_order: Tensor | None = None
    k_order: Tensor | None = None
    #: the sliding window and the chunk size (``None``: none), validated (causal only)
    window: int | None = None
    chunk: int | None = None

    def visible(self) -> Tensor | None:
        """Bool ``True`` = attend from ``causal``, ``window`` and ``chunk`` over
        :attr:`q_order` / :attr:`k_order`, ``(q_len, k_len)`` or ``(batch, q_len, k_len)``;
        ``None`` when not causal."""
        assert self.q_order is not None and self.k_order is not None
        return _visibility(self.q_order, self.k_order, self.causal, self.window, self.chunk)

    def operands(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q, k, v`` in the work dtype, with every key/value head repeated
        ``heads // kv_heads`` times (grouped-query attention). The cast comes first, so that
        the backward pass sums a key head's gradients over its group in the work dtype and
        rounds a half-precision gradient once."""
        q, k, v = q.to(self.work), k.to(self.work), v.to(self.work)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        return q, k, v


def _prologue(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scheme: PositionScheme | None = None,
    q_pos: Tensor | Sequence[int] | None = None,
    k_pos: Tensor | Sequence[int] | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    attn_mask: Tensor | None = None,
    materialize: bool = True,
    window: int | None = None,
    chunk: int | None = None,
) -> _Prologue:
    """The checks and defaults every attention path shares, in one place.

    :func:`attention`, :func:`companion.blockwise.bias_attention`,
    :func:`companion.dispatch.fast_attention` and
    :func:`companion.kernels.flash_attention_with_bias` all start here, so one bad argument
    gets one error whichever path it is given to: the shapes, dtypes and devices of ``q, k,
    v`` (:func:`~companion._checks.check_qkv`), the scheme's head count
    (:meth:`PositionScheme.check_heads`), ``causal``, the positions (defaults: keys at
    ``arange(k_len)``, queries the last ``q_len`` of them), the scale (default ``1 /
    sqrt(head_dim)``) and the mask (:func:`~companion._checks.normalize_mask`).

    Args:
        q, k, v: as in :func:`attention`.
        scheme: checked for ``heads`` query heads if given (not type-checked here).
        q_pos, k_pos: integer positions or ``None``.
        causal: must be a ``bool``.
        scale: ``None`` or a finite number > 0.
        attn_mask: ``None`` or a mask as in :func:`attention`.
        materialize: build the default positions (``False``: leave them ``None``, for a
            caller that computes them itself).
        window, chunk: ``None`` or an int ``>= 1``, only with ``causal=True``.

    Returns:
        A :class:`_Prologue`; its :meth:`~_Prologue.operands` gives the GQA-repeated ``q, k,
        v`` in the work dtype.

    Raises:
        TypeError, ValueError: as :func:`attention` documents.
    """
    b, h, lq, d, hk, lk = check_qkv(q, k, v)
    if scheme is not None:
        scheme.check_heads(h)
    causal = check_bool(causal, "causal")
    window, chunk = _check_local(window, chunk, causal)
    q_start = max(lk - lq, 0)
    axes = 1 if scheme is None else scheme.position_axes
    if axes == 1:
        if q_pos is not None or materialize:
            q_pos = as_positions(q_pos, "q_pos", lq, b, q.device, default_start=q_start)
        if k_pos is not None or materialize:
            k_pos = as_positions(k_pos, "k_pos", lk, b, q.device)
        q_order, k_order = q_pos, k_pos
    else:
        assert scheme is not None
        q_pos = (scheme.default_positions(lq, q_start, q.device) if q_pos is None
                 else as_grid_positions(q_pos, "q_pos", lq, axes, b, q.device))
        k_pos = (scheme.default_positions(lk, 0, q.device) if k_pos is None
                 else as_grid_positions(k_pos, "k_pos", lk, axes, b, q.device))
        q_order = torch.arange(q_start, q_start + lq, device=q.device)
        k_order = torch.arange(lk, device=q.device)
    scale = 1.0 / math.sqrt(d) if scale is None else check_finite_number(scale, "scale")
    allowed, additive = normalize_mask(attn_mask, (b, h, lq, lk), device=q.device)
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    return _Prologue(b, h, lq, d, hk, lk, causal, scale, q_pos, k_pos, q_start, allowed, additive, work,
                     q_order, k_order, window, chunk)


def _as_scheme(scheme: object, name: str = "scheme") -> PositionScheme:
    """``None`` means :class:`NoPE`; anything else must be a :class:`PositionScheme`."""
    if scheme is None:
        return NoPE()
    if not isinstance(scheme, PositionScheme):
        raise TypeError(f"{name} must be a companion PositionScheme, got {type(scheme).__name__}")
    return scheme


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scheme: PositionScheme | None = None,
    q_pos: Tensor | Sequence[int] | None = None,
    k_pos: Tensor | Sequence[int] | None = None,
    *,
    causal: bool = False,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
    window: int | None = None,
    chunk: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference scaled dot-product attention that honours every position hook.

    ``softmax(scale * (q k^T + score) + bias) v + score_values``, after ``rotate``
    (Vaswani et al., :cite:`vaswani2017attention`). Written for clarity and as the oracle
    for the fast paths, not for speed: it materialises the ``(q_len, k_len)`` logits.

    Args:
        q: queries, ``(batch, heads, q_len, head_dim)``.
        k: keys, ``(batch, kv_heads, k_len, head_dim)``; ``heads`` must be a multiple of
            ``kv_heads`` (grouped-query attention repeats each key head).
        v: values, ``(batch, kv_heads, k_len, v_dim)``.
        scheme: the position scheme; ``None`` means :class:`NoPE`.
        q_pos: integer query positions, ``(q_len,)`` or ``(batch, q_len)``. Default:
            the last ``q_len`` of the key positions, ``arange(k_len - q_len, k_len)``, which
            is right for KV-cache decoding; ``arange(q_len)`` if ``q_len > k_len``.
        k_pos: integer key positions, ``(k_len,)`` or ``(batch, k_len)``. Default
            ``arange(k_len)``. A grid scheme (``scheme.position_axes = A > 1``, see
            :mod:`companion.grid`) takes ``(len, A)`` or ``(batch, len, A)`` grid positions
            instead, defaulting to :meth:`PositionScheme.default_positions`.
        causal: mask keys whose position is later than the query's (by position, not
            index). Must be a ``bool``. For a grid scheme, whose positions have no order, the
            mask is by sequence index, as for the default positions: query ``i`` sees key
            ``j`` iff ``j <= i + max(k_len - q_len, 0)`` (as Qwen2-VL's causal mask over
            M-RoPE positions).
        attn_mask: optional mask broadcastable to ``(batch, heads, q_len, k_len)``: boolean
            (``True`` = attend), integer (HuggingFace's ``1`` = attend, ``0`` = masked; any
            other value raises ``ValueError``) or floating (added to the logits; ``-inf``
            removes a key). See :func:`companion._checks.normalize_mask`.
        scale: logit scale, a finite number > 0; default ``1 / sqrt(head_dim)``. T5 uses
            ``1.0``.
        return_weights: also return the attention weights.
        window: sliding-window attention (Mistral, Gemma, HuggingFace's
            ``sliding_window``): query ``i`` sees only the ``window`` keys ``j`` with ``i -
            window < j <= i``, itself included (by position, as ``causal``). An int ``>=
            1`` or ``None`` (no window); it needs ``causal=True`` (``ValueError``
            otherwise).
        chunk: chunked attention (Llama 4's local layers, HuggingFace's
            ``attention_chunk_size``): query ``i`` sees only the keys ``j <= i`` of its own
            chunk, ``j // chunk == i // chunk`` (positions floor-divided by ``chunk``). An
            int ``>= 1`` or ``None``; needs ``causal=True``. With ``window`` too, a key must
            pass both. Both rules are those of transformers' ``sliding_window_overlay`` and
            ``chunked_overlay`` (``masking_utils``), which count cache indices from the first
            real token of a left-padded row: per-row positions that start at 0 there (as
            :func:`companion.rope.positions_from_mask` gives) make them the same.

    Returns:
        The output ``(batch, heads, q_len, v_dim)`` in ``q``'s dtype, and the weights if
        asked. Math runs in float32 for half-precision inputs. A query that may attend no
        key at all gets all-zero weights and a zero output (not NaN).

    A query's output depends only on the keys it may attend: a NaN or infinite key or value
    that a query cannot see (causal mask, ``attn_mask``, a ``-inf`` bias) never reaches it,
    and one it can see makes its output NaN (or inf). torch's
    ``scaled_dot_product_attention`` gives no such guarantee (``0 * nan`` in its
    ``weights @ v`` spreads one NaN value to every query);
    :func:`companion.blockwise.bias_attention` gives the same one as this function.

    Raises:
        TypeError: a wrong type (float positions, ``causal="False"``, a string ``scale``).
        ValueError: bad shapes, values or masks; a scheme built for another number of heads.
    """
    scheme = _as_scheme(scheme)
    pro = _prologue(q, k, v, scheme, q_pos, k_pos, causal=causal, scale=scale, attn_mask=attn_mask,
                    window=window, chunk=chunk)
    return_weights = check_bool(return_weights, "return_weights")
    b, h, lq, d, hk, lk = pro[:6]
    causal, scale, q_pos, k_pos, allowed, additive, work = (
        pro.causal, pro.scale, pro.q_pos, pro.k_pos, pro.allowed, pro.additive, pro.work)

    q, k = _rotate_checked(scheme, q, k, q_pos, k_pos)
    qw, kw, vw = pro.operands(q, k, v)
    logits = qw @ kw.transpose(-1, -2)
    extra = scheme.score(qw, kw, q_pos, k_pos)
    if extra is not None:
        _check_hook_shape(extra, (b, h, lq, lk), scheme, "score", "(batch, heads, q_len, k_len)")
        logits = logits + extra.to(work)
    logits = logits * scale
    pos_bias = scheme.bias(q_pos, k_pos)
    if pos_bias is not None:
        _check_hook_shape(pos_bias, (b, h, lq, lk), scheme, "bias", "(batch, heads, q_len, k_len)")
        logits = logits + pos_bias.to(work)

    if additive is not None:
        logits = logits + additive.to(work)
    # Masked keys get the lowest finite logit, not -inf, so that a row with no visible key
    # has a finite softmax and finite gradients. Keys are masked by the causal mask (with the
    # window and the chunk), a bool/int mask, and -inf entries of the bias or of an additive
    # mask (whatever the content logit: inf + -inf is NaN, so those entries are overwritten too).
    lowest = torch.finfo(work).min
    hidden = [m for m in (
        None if allowed is None else ~allowed,
        None if not causal else ~_heads_view(pro.visible()),
    ) if m is not None]
    for term in (pos_bias, additive):
        if term is not None:
            neg_inf = torch.isneginf(term)
            if bool(neg_inf.any()):  # otherwise no mask the size of the bias stays alive
                hidden.append(neg_inf)
            del neg_inf
    maybe_masked = bool(hidden)
    if hidden:
        blocked = hidden.pop()
        while hidden:
            blocked = blocked | hidden.pop()
        logits = logits.masked_fill(blocked, lowest)
        del blocked  # no (q_len, k_len) mask stays alive through the softmax
    weights = torch.softmax(logits, dim=-1)
    if maybe_masked and lk > 0:
        # A row with no visible key would otherwise be uniform over masked keys: zero it.
        weights = weights.masked_fill(logits.amax(dim=-1, keepdim=True) <= lowest, 0.0)
    visible = None
    flags = nonfinite_flags(vw)
    if flags is None:
        out = weights @ vw
    else:
        # 0 * nan = nan: a masked key's NaN value would reach every query through the
        # matmul. Multiply finite values only, then add the non-finite ones back for the
        # queries that see them.
        out = weights @ zero_nonfinite(vw)
        if maybe_masked:
            visible = logits > lowest  # only on this rare path: a (q_len, k_len) mask per head
        seen = flags.sum(-2, keepdim=True) if visible is None else visible.to(work) @ flags
        out = restore_nonfinite(out, seen.expand(*out.shape[:-1], seen.shape[-1]))
    extra_v = scheme.score_values(weights, q_pos, k_pos)
    if extra_v is not None:
        _check_hook_shape(extra_v, tuple(out.shape), scheme, "score_values", "(batch, heads, q_len, v_dim)")
        out = out + extra_v.to(work)
    out = out.to(q.dtype)
    if return_weights:
        return out, weights.to(q.dtype)
    return out
