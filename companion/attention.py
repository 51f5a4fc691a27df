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

import torch
from torch import Tensor, nn

from ._checks import as_positions, check_qkv, check_tensor

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
    """

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
    """
    return k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)


def _heads_view(mask: Tensor) -> Tensor:
    """Give a ``(q, k)`` or ``(batch, q, k)`` mask a heads axis so it broadcasts."""
    return mask if mask.dim() == 2 else mask.unsqueeze(1)


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
            ``arange(k_len)``.
        causal: mask keys whose position is later than the query's (by position, not index).
        attn_mask: optional mask broadcastable to ``(batch, heads, q_len, k_len)``: boolean
            (``True`` = attend) or floating (added to the logits).
        scale: logit scale; default ``1 / sqrt(head_dim)``. T5 uses ``1.0``.
        return_weights: also return the attention weights.

    Returns:
        The output ``(batch, heads, q_len, v_dim)`` in ``q``'s dtype, and the weights if
        asked. Math runs in float32 for half-precision inputs. A query that may attend no
        key at all gets all-zero weights and a zero output (not NaN).
    """
    b, h, lq, d, hk, lk = check_qkv(q, k, v)
    scheme = NoPE() if scheme is None else scheme
    if not isinstance(scheme, PositionScheme):
        raise TypeError(f"scheme must be a companion PositionScheme, got {type(scheme).__name__}")
    q_pos = as_positions(q_pos, "q_pos", lq, b, q.device, default_start=max(lk - lq, 0))
    k_pos = as_positions(k_pos, "k_pos", lk, b, q.device)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    q, k = scheme.rotate(q, k, q_pos, k_pos)
    if q.shape != (b, h, lq, d) or k.shape != (b, hk, lk, d):
        raise ValueError(f"{type(scheme).__name__}.rotate must preserve the shapes of q and k")
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)

    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    logits = qw @ kw.transpose(-1, -2)
    extra = scheme.score(qw, kw, q_pos, k_pos)
    if extra is not None:
        logits = logits + extra.to(work)
    logits = logits * scale
    pos_bias = scheme.bias(q_pos, k_pos)
    if pos_bias is not None:
        try:
            logits = logits + pos_bias.to(work)
        except RuntimeError as exc:
            raise ValueError(
                f"{type(scheme).__name__}.bias returned shape {tuple(pos_bias.shape)}, which does "
                f"not broadcast to (batch, heads, q_len, k_len) = {(b, h, lq, lk)}"
            ) from exc

    allowed = None
    if causal:
        allowed = _heads_view(causal_mask(q_pos, k_pos))
    if attn_mask is not None:
        check_tensor(attn_mask, "attn_mask")
        try:
            torch.broadcast_shapes(attn_mask.shape, logits.shape)
        except RuntimeError as exc:
            raise ValueError(
                f"attn_mask shape {tuple(attn_mask.shape)} must broadcast to "
                f"(batch, heads, q_len, k_len) = {(b, h, lq, lk)}"
            ) from exc
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask if allowed is None else allowed & attn_mask
        else:
            logits = logits + attn_mask.to(work)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, torch.finfo(work).min)
    weights = torch.softmax(logits, dim=-1)
    if allowed is not None:
        # A row with no allowed key would otherwise be uniform over masked keys.
        weights = weights * allowed.any(dim=-1, keepdim=True)
    out = weights @ vw
    extra_v = scheme.score_values(weights, q_pos, k_pos)
    if extra_v is not None:
        out = out + extra_v.to(work)
    out = out.to(q.dtype)
    if return_weights:
        return out, weights.to(q.dtype)
    return out
