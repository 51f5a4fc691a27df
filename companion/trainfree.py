"""Training-free length extension at inference: ReRoPE, Leaky ReRoPE, Self-Extend, attention sinks.

Each method changes only how a RoPE model's attention reads positions; no weight changes. The
functional core works on one layer's *unrotated* queries ``q`` ``(batch, heads, q_len, d)`` and
keys/values ``k``, ``v`` ``(batch, kv_heads, k_len, d)`` (grouped-query attention: query head
``h`` reads key/value head ``h // (heads // kv_heads)``, as ``enable_gqa`` and
``repeat_interleave`` do), and rotates them itself with the model's
:class:`~companion.rope.RotaryEmbedding` (its frequencies, layout and attention scaling).

**Two-region methods** (:func:`two_region_attention`). A query at position ``i`` and a key at
``j <= i`` are *neighbours* when ``i - j < w``; neighbours get plain RoPE (relative position
``i - j``), the others a *far* rotation whose relative position stays inside the trained range:

=================  ==============================================  ============================
method             far relative position (``i - j >= w``)          far rotation (query, key)
=================  ==============================================  ============================
ReRoPE             ``w``                                           ``(w, 0)``
Leaky ReRoPE       ``w + (i - j - w) / k``                         ``((i + w (k-1)) / k, j / k)``
Self-Extend        ``i // G - j // G + w - w // G``                ``(i // G + w - w // G, j // G)``
=================  ==============================================  ============================

The logit is ``where(i - j < w, q_rot(i) . k_rot(j), q_far(i) . k_far(j))``, scaled by
``1 / sqrt(d)``, then causal softmax. Conventions matched:

* ReRoPE and Leaky ReRoPE as in Su's ``bojone/rerope`` patches (:cite:`su2023rerope`): the
  neighbour test is ``|i - j| < window`` (strict), the far query of ReRoPE is rotated at
  ``window`` and its key not at all, Leaky ReRoPE's far branch is linear interpolation by the
  factor ``k`` (``leak``) with the query offset by ``window * (k - 1)``. At ``i - j = w`` both
  branches give relative position ``w``, so the map is continuous. Not included: the patches'
  optional ``log(i + 1) / log(training_length)`` query scaling (a separate trick, off here).
* Self-Extend as in ``datamllab/LongLM`` (:cite:`jin2024selfextend`): neighbour window
  ``w`` (``group_size_2``), group size ``G`` (``group_size_1``), neighbours when
  ``i - j < w`` (its mask keeps the last ``w`` keys), grouped key positions ``j // G`` and
  query positions ``i // G + w - w // G`` so that the two regions meet at ``i - j = w``.
  LongLM's prefill writes the shift as ``w - w / G`` (a float), its decode path as
  ``w - w // G``; the two agree when ``G`` divides ``w`` (every published setting), and this
  module uses the integer form.

The largest relative position a method produces over ``L`` tokens is
:func:`max_relative_position`; for SmolLM2-135M (8192 trained positions) at ``L = 16384``:
ReRoPE ``w = 4096`` gives 4096, Leaky ReRoPE ``w = 4096, k = 4`` gives 7167.75, Self-Extend
``w = 2048, G = 4`` gives 5631, all below 8191.

Efficiency: the queries are processed ``chunk`` at a time; for a chunk ``[s, e)`` the
neighbour logits are computed only for keys ``(s - w, e)`` and the far logits only for keys
``[0, e - w)``, so the total work is about one causal attention plus ``chunk * w`` (not two
full ones), and the largest temporary is ``heads * chunk * (k_len + chunk)`` logits; no
``L x L`` matrix is built.

**Attention sinks** (StreamingLLM, :cite:`xiao2024streamingllm`, :class:`SinkCache`). The cache
keeps the first ``n_sink`` tokens of the stream and the ``window`` most recent ones, with keys
stored *unrotated*; at each step every key is rotated at its index *inside* the cache
(``0 .. n_sink + window - 1``) and the new queries after them, as the ``pos_shift`` patches of
``mit-han-lab/streaming-llm`` do. ``rerotate=False`` keeps every key and query at its
original absolute position instead (the relative distances are then the true ones, and the
sinks drift beyond the trained range); ``n_sink=0`` is a plain sliding window.

A long stream is processed in chunks of ``C`` tokens: the queries of a chunk see the cache and
the causal part of the chunk, then the cache is trimmed back to ``n_sink + window`` tokens. So
the ``c``-th token of a chunk (``c = 0 .. C - 1``) sees the sinks, the ``window`` most recent
tokens before the chunk and the ``c`` earlier tokens of the chunk, plus itself: between
``window`` and ``window + C - 1`` preceding tokens (once the stream is longer than the
cache). ``C = 1`` is exact StreamingLLM (one token at a time, ``window`` recent tokens and
itself); the largest position inside the cache is ``n_sink + window + C - 1``.

Everything here is inference only (run it under ``torch.no_grad()``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_bool, check_finite_number, check_int_tensor, check_positive_int, check_qkv, check_tensor
from .rope import RotaryEmbedding, rope_frequencies, rope_rotate

__all__ = [
    "TRAINFREE_METHODS",
    "ReRoPE",
    "SelfExtend",
    "max_relative_position",
    "rope_tables",
    "two_region_attention",
    "sink_attention",
    "SinkCache",
    "stream_nll",
]

#: The training-free methods, as named on the ``python -m companion.longctx ppl`` command line.
TRAINFREE_METHODS: tuple[str, ...] = ("rerope", "leaky_rerope", "self_extend", "sinks")


def _check_rope(rope: object, head_dim: int | None = None) -> RotaryEmbedding:
    """Require a :class:`~companion.rope.RotaryEmbedding`, built for ``head_dim`` if given.

    A rope built for a narrower head would rotate only the first ``rope.rotary_dim``
    dimensions of each head and pass the rest through (``rope.rotate`` refuses such heads
    too). A partial rotation is a rope *built* with ``rotary_dim < head_dim``, which this
    module applies exactly as ``rope.rotate`` does."""
    if not isinstance(rope, RotaryEmbedding):
        raise TypeError(f"rope must be a companion.rope.RotaryEmbedding, got {type(rope).__name__}")
    if head_dim is not None and rope.head_dim != head_dim:
        raise ValueError(
            f"rope was built for head_dim {rope.head_dim} (rotary_dim {rope.rotary_dim}), but q and k have "
            f"head_dim {head_dim}; build RotaryEmbedding({head_dim}, ...) (with rotary_dim=... for a partial "
            f"rotation)"
        )
    return rope


def _follow_length(rope: RotaryEmbedding, length: int) -> None:
    """Apply the rope's length rule for a pass whose positions reach ``length - 1``.

    A ``rope_config`` whose frequencies depend on the length (``dynamic``, ``longrope``)
    updates them in ``rope.rotate`` from ``max(position) + 1`` of the call (HuggingFace's
    rule); the methods here read the rope's tables directly, so they apply the same rule
    first, with the largest position of the plain-RoPE positions of the pass."""
    spec = rope.rope_spec
    if spec is not None and spec.is_dynamic and length > 0:
        rope._follow_length(length)


@dataclass(frozen=True)
class ReRoPE:
    """ReRoPE (``leak=None``) or Leaky ReRoPE (``leak = k > 1``) with neighbour window ``window``.

    Relative position ``i - j`` for ``i - j < window``; beyond it ``window`` (ReRoPE) or
    ``window + (i - j - window) / k`` (Leaky ReRoPE), as in :cite:`su2023rerope` (see the
    module doc for the conventions).

    Args:
        window: the neighbour window ``w``, an int >= 1.
        leak: ``None`` (ReRoPE), or the interpolation factor ``k``, a finite number > 1.
    """

    window: int
    leak: float | None = None

    def __post_init__(self) -> None:
        check_positive_int(self.window, "window")
        if self.leak is not None:
            object.__setattr__(self, "leak", check_finite_number(self.leak, "leak", above=1.0))

    @property
    def name(self) -> str:
        """``"rerope"`` or ``"leaky_rerope"``."""
        return "rerope" if self.leak is None else "leaky_rerope"

    def far_positions(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The far branch's rotation positions of queries at ``q_pos`` and keys at ``k_pos``
        (int64): ``(w, 0)`` for ReRoPE (int64), ``((i + w (k - 1)) / k, j / k)`` in float64
        for Leaky ReRoPE."""
        w = self.window
        if self.leak is None:
            return torch.full_like(q_pos, w), torch.zeros_like(k_pos)
        k = self.leak
        return (q_pos.double() + w * (k - 1.0)) / k, k_pos.double() / k

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: RotaryEmbedding, **kw: Any) -> Tensor:
        """:func:`two_region_attention` with this method."""
        return two_region_attention(q, k, v, rope, self, **kw)


@dataclass(frozen=True)
class SelfExtend:
    """Self-Extend (:cite:`jin2024selfextend`): neighbour window ``window``, group size ``group``.

    Relative position ``i - j`` for ``i - j < window``; beyond it
    ``i // group - j // group + window - window // group`` (see the module doc).

    Args:
        window: the neighbour window ``w`` (LongLM's ``group_size_2``), an int >= 1.
        group: the group size ``G`` (LongLM's ``group_size_1``), an int >= 1 (1 is plain RoPE).
    """

    window: int
    group: int

    def __post_init__(self) -> None:
        check_positive_int(self.window, "window")
        check_positive_int(self.group, "group")

    @property
    def name(self) -> str:
        """``"self_extend"``."""
        return "self_extend"

    def far_positions(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The far branch's rotation positions (int64): ``i // G + w - w // G`` and ``j // G``."""
        g, w = self.group, self.window
        return torch.div(q_pos, g, rounding_mode="floor") + (w - w // g), torch.div(k_pos, g, rounding_mode="floor")

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: RotaryEmbedding, **kw: Any) -> Tensor:
        """:func:`two_region_attention` with this method."""
        return two_region_attention(q, k, v, rope, self, **kw)


def _check_mode(mode: object) -> ReRoPE | SelfExtend:
    if not isinstance(mode, (ReRoPE, SelfExtend)):
        raise TypeError(f"mode must be a ReRoPE or SelfExtend, got {type(mode).__name__}")
    return mode


def max_relative_position(mode: ReRoPE | SelfExtend, length: int) -> float:
    """The largest relative position that ``mode`` feeds RoPE over ``length`` tokens.

    Plain RoPE would give ``length - 1``. With ``w = mode.window`` and ``n = length - 1``:
    ``n`` if ``n < w`` (every pair is a neighbour); otherwise ``w`` (ReRoPE),
    ``w + (n - w) / k`` (Leaky ReRoPE), ``max(w - 1, n // G + w - w // G)`` (Self-Extend, the
    far branch is largest at ``i = n, j = 0``).
    """
    _check_mode(mode)
    n = check_positive_int(length, "length") - 1
    w = mode.window
    if n < w:
        return float(n)
    if isinstance(mode, SelfExtend):
        return float(max(w - 1, n // mode.group + w - w // mode.group))
    if mode.leak is None:
        return float(w)
    return w + (n - w) / mode.leak


def rope_tables(rope: RotaryEmbedding, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Compact cos/sin tables ``(n, rotary_dim // 2)`` of ``rope`` at 1-D ``positions``.

    Integer positions read ``rope.cos_sin`` (the model's own tables, bit for bit what
    ``rope.rotate`` uses). Fractional (floating) positions, as Leaky ReRoPE's, get angles
    ``p * theta`` computed in float64 from float64 positions (never the activations' dtype),
    times ``rope.attention_scaling``, then cast to ``dtype`` (float32 or float64).
    """
    _check_rope(rope)
    check_tensor(positions, "positions", 1)
    if not positions.dtype.is_floating_point:
        return rope.cos_sin(positions, dtype=dtype)
    inv_freq = rope.inv_freq
    if dtype == torch.float64 and rope.base is not None:  # as rope.rotate does for float64
        inv_freq = rope_frequencies(rope.rotary_dim, rope.base, inv_freq.device, dtype=torch.float64)
    angle = positions.to(inv_freq.device, torch.float64)[:, None] * inv_freq.double()
    cos, sin = angle.cos() * rope.attention_scaling, angle.sin() * rope.attention_scaling
    return cos.to(dtype), sin.to(dtype)


def _rotate_at(rope: RotaryEmbedding, x: Tensor, positions: Tensor) -> Tensor:
    """Rotate ``x`` ``(batch, heads, seq, d)``; sequence index ``s`` at ``positions[s]``."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if positions.numel() and bool((positions == positions[0]).all()):  # one position (ReRoPE's far q)
        cos, sin = rope_tables(rope, positions[:1], dtype)
        cos, sin = cos.expand(positions.numel(), -1), sin.expand(positions.numel(), -1)
    else:
        cos, sin = rope_tables(rope, positions, dtype)
    return rope_rotate(x, cos, sin, layout=rope.layout, rotary_dim=rope.rotary_dim)


def _scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else check_finite_number(scale, "scale")


def _flash_op() -> Any:
    """torch's CPU flash attention that also returns the log-sum-exp of each query's logits
    (``aten::_scaled_dot_product_flash_attention_for_cpu``), or ``None`` if this torch lacks it,
    or if :data:`USE_FLASH` is off."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None) if USE_FLASH else None


#: Use torch's fused CPU attention kernel when it exists (the tests also switch it off, to
#: check the plain matrix-product path that every device runs).
USE_FLASH = True


@torch.no_grad()
def two_region_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rope: RotaryEmbedding,
    mode: ReRoPE | SelfExtend,
    *,
    scale: float | None = None,
    chunk: int = 512,
) -> Tensor:
    """Causal attention with ReRoPE, Leaky ReRoPE or Self-Extend positions (see the module doc).

    ``q`` ``(batch, heads, q_len, d)``, ``k`` ``(batch, kv_heads, k_len, d)`` and ``v``
    ``(batch, kv_heads, k_len, d_v)`` are *unrotated*; the keys sit at positions
    ``0 .. k_len - 1`` and the queries are the last ``q_len`` of them (``q_len <= k_len``).
    The logit of query ``i`` and key ``j <= i`` is ``scale * q_rot(i) . k_rot(j)`` when
    ``i - j < w`` and ``scale * q_far(i) . k_far(j)`` otherwise (``mode.far_positions``).

    Exact and block-sparse: queries go ``chunk`` at a time; for a block ``[i0, i1)`` the
    neighbour logits are computed for keys ``[i0 - w + 1, i1)`` only and the far logits for
    keys ``[0, i1 - w)`` only, each with its own mask, so the work is one causal attention plus
    ``chunk`` keys per query, and no ``L x L`` matrix exists. On the CPU the two blocks run on
    torch's fused attention kernel, which returns each row's log-sum-exp, and are combined
    exactly through it (``out = sum_b exp(lse_b - lse) out_b``); elsewhere, explicit masked
    logits of one block at a time (also on the CPU when ``d_v != d``: the fused kernel needs
    one head size). Arithmetic in float32 or wider.

    Args:
        q, k, v: as above, one floating dtype.
        rope: the model's :class:`~companion.rope.RotaryEmbedding`, built for head_dim ``d``
            (``ValueError`` otherwise; a partial ``rotary_dim`` rotates as ``rope.rotate`` does).
            A length-dependent ``rope_config`` (``dynamic``, ``longrope``) first follows the
            length ``k_len``, as ``rope.rotate`` over positions ``0 .. k_len - 1`` would.
        mode: a :class:`ReRoPE` or :class:`SelfExtend`.
        scale: the logit scale, default ``1 / sqrt(d)``.
        chunk: queries per block, an int >= 1 (the result does not depend on it beyond rounding).

    Returns:
        ``(batch, heads, q_len, d_v)`` in ``q``'s dtype.
    """
    b, h, lq, d, hk, lk = check_qkv(q, k, v)
    _check_rope(rope, d)
    mode = _check_mode(mode)
    chunk = check_positive_int(chunk, "chunk")
    scale = _scale(scale, d)
    if lq > lk:
        raise ValueError(f"q_len ({lq}) must be <= k_len ({lk}): the queries are the last q_len keys")
    _follow_length(rope, lk)  # a length-dependent rope: the frequencies of plain RoPE over 0 .. lk - 1
    w, g, dv = mode.window, h // hk, v.shape[-1]
    start = lk - lq
    dev = q.device
    k_pos = torch.arange(lk, device=dev)
    q_pos = k_pos[start:]
    work = torch.promote_types(q.dtype, torch.float32)
    # torch's fused CPU kernel needs one head size for q, k and v: a v of another size (valid
    # attention input) takes the explicit path below
    op = _flash_op() if dev.type == "cpu" and dv == d else None

    def keys(x: Tensor) -> Tensor:
        """Key/value heads in the working dtype; for the fused kernel (no GQA) one per query head."""
        x = x.to(work)
        if op is None:
            return x
        return x.repeat_interleave(g, dim=1) if g > 1 else x.contiguous()

    def queries(x: Tensor) -> Tensor:
        """Queries in the working dtype; grouped ``(b, kv_heads, g, q_len, d)`` for matrix products."""
        x = x.to(work)
        return x if op is not None else x.view(b, hk, g, lq, d)

    qn, kn, vw = queries(_rotate_at(rope, q, q_pos)), keys(_rotate_at(rope, k, k_pos)), keys(v)
    far = lk - 1 >= w  # some pair (i = lk - 1, j = 0) is not a neighbour
    if far:
        fq, fk = mode.far_positions(q_pos, k_pos)
        qf, kf = queries(_rotate_at(rope, q, fq)), keys(_rotate_at(rope, k, fk))
    out = torch.empty(b, h, lq, dv, dtype=work, device=dev)
    neg = float("-inf")
    for s in range(0, lq, chunk):
        e = min(s + chunk, lq)
        c = e - s
        i = q_pos[s:e]
        i0, i1 = start + s, start + e  # absolute query positions [i0, i1)
        lo = max(0, i0 - w + 1)  # neighbour keys [lo, i1)
        nf = max(0, i1 - w) if far else 0  # far keys [0, nf)
        if op is not None:
            # additive masks from triangles: row a is query i0 + a, column jj key lo + jj (near)
            # or jj (far); near needs i - w < j <= i, far j <= i - w
            mask_n = torch.full((c, i1 - lo), neg, dtype=work, device=dev).triu_(i0 - lo + 1)
            if i0 - w - lo >= -c:  # some key j <= i - w inside [lo, i1)
                mask_n += torch.full_like(mask_n, neg).tril_(i0 - w - lo)
            y, lse = op(qn[:, :, s:e], kn[:, :, lo:i1], vw[:, :, lo:i1], 0.0, False, attn_mask=mask_n, scale=scale)
            if nf:
                mask_f = torch.full((c, nf), neg, dtype=work, device=dev).triu_(i0 - w + 1)
                yf, lf = op(qf[:, :, s:e], kf[:, :, :nf], vw[:, :, :nf], 0.0, False, attn_mask=mask_f, scale=scale)
                # a query with no far key (i < w) gets lse 0 from the kernel; it must weigh nothing
                lf[..., : max(0, w - i0)] = neg
                total = torch.logaddexp(lse, lf)
                y = y * torch.exp(lse - total).unsqueeze(-1) + yf * torch.exp(lf - total).unsqueeze(-1)
            out[:, :, s:e] = y
            continue
        # explicit logits, query head h = kv head h // g (grouped, without copying the keys)
        diff_n = i[:, None] - k_pos[None, lo:i1]
        near_ok = (diff_n >= 0) & (diff_n < w)
        far_ok = (i[:, None] - k_pos[None, :nf]) >= w
        qc = qn[:, :, :, s:e].reshape(b, hk, g * c, d)
        logits = [torch.matmul(qc, kn[:, :, lo:i1].transpose(-1, -2))]
        masks = [near_ok]
        if nf:
            qfc = qf[:, :, :, s:e].reshape(b, hk, g * c, d)
            logits.insert(0, torch.matmul(qfc, kf[:, :, :nf].transpose(-1, -2)))
            masks.insert(0, far_ok)
        lg = torch.cat(logits, dim=-1).view(b, hk, g, c, -1)
        lg.mul_(scale).masked_fill_(~torch.cat(masks, dim=-1), neg)
        p = torch.softmax(lg, dim=-1).view(b, hk, g * c, -1)
        y = torch.matmul(p[..., nf:], vw[:, :, lo:i1])
        if nf:
            y += torch.matmul(p[..., :nf], vw[:, :, :nf])
        out[:, :, s:e] = y.view(b, h, c, dv)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------- attention sinks


@torch.no_grad()
def sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rope: RotaryEmbedding,
    *,
    past_k: Tensor | None = None,
    past_v: Tensor | None = None,
    past_pos: Tensor | None = None,
    positions: Tensor,
    rerotate: bool = True,
    scale: float | None = None,
) -> Tensor:
    """One chunk of StreamingLLM attention over a cache of unrotated keys (:cite:`xiao2024streamingllm`).

    ``k``, ``v`` ``(batch, kv_heads, C, d)``: the chunk's unrotated keys and values, at
    absolute stream positions ``positions`` (integers, ``(C,)``); ``q`` ``(batch, heads, C_q, d)``
    with ``C_q <= C``: the queries of the *last* ``C_q`` tokens of the chunk (``C_q = C``: every
    token's). ``past_k``, ``past_v`` ``(batch, kv_heads, m, d)``: the cached unrotated keys and
    values (``None``: empty), at absolute positions ``past_pos`` (integers, ``(m,)``). The
    chunk's token ``c`` sees all ``m`` cached keys and chunk keys ``0 .. c``. With ``rerotate``
    the keys are rotated at ``0 .. m + C - 1`` (their index in ``cat(past, chunk)``) and token
    ``c``'s query at ``m + c``; without, everything at its absolute position. A
    length-dependent ``rope_config`` follows ``max(rotation position) + 1``, as ``rope.rotate``
    does. Returns ``(batch, heads, C_q, d_v)``.
    """
    check_qkv(q, k, v)
    _check_rope(rope, q.shape[-1])
    check_bool(rerotate, "rerotate")
    positions = check_int_tensor(positions, "positions", dims=(1,)).to(k.device)
    c = k.shape[2]
    if positions.shape[0] != c:
        raise ValueError(f"positions must have shape ({c},) (one per key of the chunk), got {tuple(positions.shape)}")
    if past_k is None and past_v is None and past_pos is None:
        return _sink_core(q, k, v, rope, 0, positions, rerotate, scale)
    if past_k is None or past_v is None or past_pos is None:
        raise ValueError("past_k, past_v and past_pos must be given together (or none of them)")
    keys, values = _append(past_k, past_v, k, v, "past_k", "past_v")
    m = past_k.shape[2]
    past_pos = check_int_tensor(past_pos, "past_pos", dims=(1,)).to(k.device)
    if past_pos.shape[0] != m:
        raise ValueError(f"past_pos must have shape ({m},) (one per cached key), got {tuple(past_pos.shape)}")
    return _sink_core(q, keys, values, rope, m, torch.cat((past_pos, positions)), rerotate, scale)


def _append(past_k: object, past_v: object, k: Tensor, v: Tensor, k_name: str, v_name: str) -> tuple[Tensor, Tensor]:
    """``cat(past, chunk)`` along the sequence, after checking that the cached keys/values
    match the chunk's batch, heads, head dim, dtype and device (``torch.cat`` would promote a
    dtype silently, or fail with a shape error of its own)."""
    for name, kind, past, new in ((k_name, "k", past_k, k), (v_name, "v", past_v, v)):
        check_tensor(past, name, 4)
        if (past.shape[:2], past.shape[3], past.dtype, past.device) != (
                new.shape[:2], new.shape[3], new.dtype, new.device):
            raise ValueError(
                f"{name} (shape {tuple(past.shape)}, {past.dtype}, {past.device}) and the chunk's {kind} (shape "
                f"{tuple(new.shape)}, {new.dtype}, {new.device}) must agree in batch, heads, head dim, dtype "
                f"and device"
            )
    if past_k.shape[2] != past_v.shape[2]:
        raise ValueError(f"{k_name} and {v_name} must hold as many tokens, got {past_k.shape[2]} and {past_v.shape[2]}")
    return torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)


def _sink_core(q: Tensor, keys: Tensor, values: Tensor, rope: RotaryEmbedding, m: int, k_abs: Tensor,
               rerotate: bool, scale: float | None, tables: dict | None = None) -> Tensor:
    """Attention of the last ``c = q_len`` tokens of the chunk ``keys[m:]`` (``kc`` tokens) over
    ``keys`` (``m`` cached ones first), keys at absolute positions ``k_abs``; chunk token ``t``
    sees the cache and chunk tokens ``0 .. t``. ``tables`` memoises the cos/sin of a step
    (every layer of a chunk rotates at the same positions)."""
    b, h, c, d = q.shape
    n = keys.shape[2]
    kc = n - m
    if c > kc:
        raise ValueError(f"q_len ({c}) must be <= the chunk's k_len ({kc}): the queries are the chunk's last "
                         f"q_len tokens")
    if c == 0:
        return q.new_zeros(b, h, 0, values.shape[-1])
    off = kc - c  # the queries are chunk tokens off .. kc - 1
    scale = _scale(scale, d)
    k_rot_pos = torch.arange(n, device=q.device) if rerotate else k_abs
    _follow_length(rope, int(k_rot_pos.max()) + 1)
    dtype = torch.float64 if torch.float64 in (q.dtype, keys.dtype) else torch.float32
    # the frequencies are part of the key: a length-dependent rope may have changed them
    key = (n, m, dtype, None if rerotate else int(k_abs[-1]), id(rope), id(rope.inv_freq), rope.attention_scaling)
    if tables is not None and key in tables:
        cos, sin = tables[key][:2]
    else:
        cos, sin = rope_tables(rope, k_rot_pos, dtype)
        if tables is not None:
            tables.clear()
            tables[key] = cos, sin, rope, rope.inv_freq  # the references keep the ids in the key unique
    kw = dict(layout=rope.layout, rotary_dim=rope.rotary_dim)
    qr = rope_rotate(q, cos[n - c:], sin[n - c:], **kw)
    kr = rope_rotate(keys, cos, sin, **kw)
    dev = q.device
    # chunk token off + a (query row a) sees chunk keys 0 .. off + a
    chunk_ok = torch.arange(kc, device=dev)[None, :] <= torch.arange(off, kc, device=dev)[:, None]
    # the fused CPU kernel needs one head size for q, k and v (a v of another size: SDPA below)
    op = _flash_op() if dev.type == "cpu" and m and c > 1 and values.shape[-1] == d else None
    if op is not None:
        # the cache (every key visible) and the chunk (causal) on the fused kernel, combined
        # exactly through their log-sum-exps; every row sees at least one key of each part
        work = torch.promote_types(q.dtype, torch.float32)
        g = q.shape[1] // keys.shape[1]
        qw, kw_, vw = qr.to(work), kr.to(work), values.to(work)
        if g > 1:
            kw_, vw = kw_.repeat_interleave(g, dim=1), vw.repeat_interleave(g, dim=1)
        y1, l1 = op(qw, kw_[:, :, :m], vw[:, :, :m], 0.0, False, scale=scale)
        if off == 0:
            y2, l2 = op(qw, kw_[:, :, m:], vw[:, :, m:], 0.0, True, scale=scale)
        else:
            mask = torch.zeros(c, kc, dtype=work, device=dev).masked_fill_(~chunk_ok, float("-inf"))
            y2, l2 = op(qw, kw_[:, :, m:], vw[:, :, m:], 0.0, False, attn_mask=mask, scale=scale)
        total = torch.logaddexp(l1, l2)
        y = y1 * torch.exp(l1 - total).unsqueeze(-1) + y2 * torch.exp(l2 - total).unsqueeze(-1)
        return y.to(q.dtype)
    if c == 1:  # one query, the chunk's last token, sees every key
        return F.scaled_dot_product_attention(qr, kr, values, scale=scale, enable_gqa=True)
    if m == 0 and off == 0:
        return F.scaled_dot_product_attention(qr, kr, values, is_causal=True, scale=scale, enable_gqa=True)
    mask = torch.cat((torch.ones(c, m, dtype=torch.bool, device=dev), chunk_ok), dim=1)
    return F.scaled_dot_product_attention(qr, kr, values, attn_mask=mask, scale=scale, enable_gqa=True)


def _check_sink_args(n_sink: object, window: object, rerotate: object) -> tuple[int, int, bool]:
    return (check_positive_int(n_sink, "n_sink", minimum=0), check_positive_int(window, "window"),
            check_bool(rerotate, "rerotate"))


class SinkCache:
    """A StreamingLLM cache (:cite:`xiao2024streamingllm`): the first ``n_sink`` tokens and the
    ``window`` most recent ones, keys stored unrotated, one entry per layer.

    :meth:`attend` runs :func:`sink_attention` for one layer's chunk and then trims that layer
    to ``n_sink + window`` tokens (dropping the oldest non-sink ones). Every layer sees the
    same chunks, so the layers hold the same positions. :attr:`length` is the number of
    stream tokens seen (the absolute position of the next one). See the module doc for what
    each token sees with chunks of ``C`` tokens.

    Args:
        n_layers: number of layers, an int >= 1.
        n_sink: sink tokens kept, an int >= 0 (0: a plain sliding window).
        window: recent tokens kept, an int >= 1.
        rerotate: rotate keys at their index in the cache (StreamingLLM) instead of their
            original absolute position.
    """

    def __init__(self, n_layers: int, n_sink: int = 4, window: int = 1024, *, rerotate: bool = True) -> None:
        self.n_layers = check_positive_int(n_layers, "n_layers")
        self.n_sink, self.window, self.rerotate = _check_sink_args(n_sink, window, rerotate)
        self._k: list[Tensor | None] = [None] * n_layers
        self._v: list[Tensor | None] = [None] * n_layers
        self._pos: list[Tensor | None] = [None] * n_layers
        self._seen = [0] * n_layers
        self._tables: dict = {}  # the cos/sin of the current step, shared by the layers

    @property
    def capacity(self) -> int:
        """``n_sink + window``: the tokens kept between chunks."""
        return self.n_sink + self.window

    @property
    def length(self) -> int:
        """Stream tokens seen so far (by the last layer)."""
        return self._seen[-1]

    def _check_layer(self, layer: object) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int in [0, {self.n_layers}), got {type(layer).__name__} {layer!r}")
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer must lie in [0, {self.n_layers}), got {layer}")
        return layer

    def cached_positions(self, layer: int = 0) -> Tensor:
        """The absolute stream positions held for ``layer`` (int64), empty before the first chunk.

        Raises:
            TypeError: ``layer`` is not an int (a bool or a float included).
            IndexError: ``layer`` is outside ``[0, n_layers)`` (negative included).
        """
        pos = self._pos[self._check_layer(layer)]
        return torch.empty(0, dtype=torch.int64) if pos is None else pos.clone()

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: RotaryEmbedding,
               scale: float | None = None) -> Tensor:
        """Attention of one chunk's unrotated ``q``, ``k``, ``v`` for ``layer``, then trim the cache.

        ``k``, ``v`` ``(batch, kv_heads, C, d)`` are the chunk's ``C`` new tokens (they all enter
        the cache); ``q`` ``(batch, heads, C_q, d)``, ``C_q <= C``, the queries of its *last*
        ``C_q`` tokens (as :func:`sink_attention`). Returns ``(batch, heads, C_q, d_v)``.

        Raises:
            TypeError: ``layer`` is not an int (a bool or a float included), or bad ``q``,
                ``k``, ``v`` or ``rope`` types.
            IndexError: ``layer`` is outside ``[0, n_layers)``.
            ValueError: bad shapes, or a chunk unlike the cached keys and values.
        """
        self._check_layer(layer)  # TypeError for a bool or a float, IndexError out of range
        check_qkv(q, k, v)
        _check_rope(rope, q.shape[-1])
        c = k.shape[2]
        seen = self._seen[layer]
        positions = torch.arange(seen, seen + c, device=k.device)
        if self._k[layer] is None:
            m, keys, values, pos = 0, k, v, positions
        else:
            m = self._k[layer].shape[2]
            keys, values = _append(self._k[layer], self._v[layer], k, v, f"the keys cached for layer {layer}",
                                   f"the values cached for layer {layer}")
            pos = torch.cat((self._pos[layer], positions))
        out = _sink_core(q, keys, values, rope, m, pos, self.rerotate, scale, self._tables)
        n = keys.shape[2]
        if n > self.capacity:
            keep = torch.cat((torch.arange(self.n_sink, device=k.device),
                              torch.arange(n - self.window, n, device=k.device)))
            keys, values, pos = keys[:, :, keep], values[:, :, keep], pos[keep]
        self._k[layer], self._v[layer], self._pos[layer] = keys, values, pos
        self._seen[layer] = seen + c
        return out


def _stream_chunks(
    step: Callable[[Tensor], Tensor], ids: Tensor, chunk: int, float32: bool = False,
) -> Tensor:
    """Per-token NLL ``(batch, seq - 1)`` of ``ids[:, 1:]``: ``step(ids[:, s:e])`` returns the
    logits of one chunk (the cache is inside ``step``). The loss is computed in float32 or
    wider (``float32``: exactly float32, as the lab's evaluation does)."""
    out = []
    n = ids.shape[1]
    for s in range(0, n - 1, chunk):
        e = min(s + chunk, n - 1)  # the last token has no target; it is never fed
        logits = step(ids[:, s:e])
        logits = logits.float() if float32 else logits.to(torch.promote_types(logits.dtype, torch.float32))
        out.append(F.cross_entropy(logits.transpose(1, 2), ids[:, s + 1:e + 1], reduction="none"))
    return torch.cat(out, dim=1)


@torch.no_grad()
def stream_nll(model: Any, ids: Tensor, n_sink: int = 4, window: int = 1024, chunk: int = 256,
               *, rerotate: bool = True) -> Tensor:
    """Per-token NLL ``(batch, seq - 1)`` of ``ids[:, 1:]`` (nats) for a
    :class:`companion.llama.LlamaModel` reading ``ids`` as a stream through a :class:`SinkCache`.

    The stream is fed ``chunk`` tokens at a time (see the module doc: each token sees the
    sinks and between ``window`` and ``window + chunk - 1`` preceding tokens; ``chunk=1`` is
    exact StreamingLLM). With ``n_sink + window >= seq`` nothing is evicted and the result is
    the plain model's, to rounding.

    Raises:
        TypeError: ``model`` is not a ``companion.llama.LlamaModel`` (the lab's
            :class:`companion.model.TinyDecoder` has its own,
            ``companion.lab.trainfree_lab.lab_stream_nll``), or float ``ids``.
        ValueError: a bad ``n_sink``, ``window`` or ``chunk``, or fewer than 2 tokens per row.
    """
    from .llama import LlamaModel  # not at the top: companion.llama imports this module

    if not isinstance(model, LlamaModel):
        hint = ""
        if type(model).__name__ == "TinyDecoder":
            hint = "; for the lab's TinyDecoder use companion.lab.trainfree_lab.lab_stream_nll"
        raise TypeError(f"model must be a companion.llama.LlamaModel, got {type(model).__name__}{hint}")
    n_sink, window, rerotate = _check_sink_args(n_sink, window, rerotate)
    chunk = check_positive_int(chunk, "chunk")
    ids = model._check_ids(ids)
    if ids.shape[1] < 2:
        raise ValueError(f"ids must hold at least 2 tokens per row for a next-token loss, got {ids.shape[1]}")
    cache = SinkCache(model.config.n_layers, n_sink, window, rerotate=rerotate)
    return _stream_chunks(lambda part: model.logits(model.hidden(part, cache)), ids, chunk)
