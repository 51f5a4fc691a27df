"""The public entry points of :mod:`companion.kernels`: validation, then dispatch.

Each function checks its arguments the same way on every backend (so a call that fails on a
laptop fails the same way on a GPU), then runs the Triton kernel or the torch reference that
:func:`companion.kernels._dispatch.backend` picks for the tensors' device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import (
    nonfinite_flags,
    restore_nonfinite,
    zero_nonfinite,
    check_choice,
    check_device,
    check_scheme_heads,
    check_tensor,
)
from ..alibi import alibi_bias
from ..alibi import alibi_slopes as alibi_slopes_fn
from ..attention import _prologue
from ..blockwise import bias_attention
from ..relative import T5RelativeBias, t5_relative_position_bucket
from ..relative import check_bucket_args as check_t5_bucket_args  # relative.py's own validator
from ..rope import TableRows, apply_rope, check_rope_args
from . import _dispatch

__all__ = [
    "MAX_ATTENTION_HEAD_DIM",
    "MAX_ROPE_HEAD_DIM",
    "KERNEL_DTYPES",
    "KernelRows",
    "AttentionMeta",
    "fused_rope",
    "flash_attention_with_bias",
    "kernel_backend",
]

#: The largest head_dim the fused RoPE kernel takes (a program holds whole rows in registers);
#: wider heads take the torch reference.
MAX_ROPE_HEAD_DIM = 1024
#: The largest head_dim the attention kernel takes (q, k, v tiles of this width sit in SRAM);
#: wider heads take the torch reference.
MAX_ATTENTION_HEAD_DIM = 256
#: Activation dtypes the kernels run; float64 goes to the torch reference on every device.
KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def kernel_backend(x: Tensor | torch.device | str, op: str = "rope") -> str:
    """Which backend runs ``op`` (``"rope"`` or ``"attention"``) for a tensor on this device.

    ``"triton"`` (CUDA), ``"triton-interpreter"`` (CPU with ``TRITON_INTERPRET=1`` set before
    the kernels are first used) or ``"torch"`` (the reference). Informational: the entry
    points choose by themselves. A few cases always take the reference whatever the device:
    float64 data, tables that require a gradient, empty tensors, head dims above the
    kernel's limit, a last dimension that is not contiguous.
    """
    return _dispatch.backend(check_device(x, "x"), op)


def _unit_stride(*xs: Tensor) -> bool:
    """Whether every tensor has stride 1 in its last dimension (what the kernels load)."""
    return all(x.shape[-1] <= 1 or x.stride(-1) == 1 for x in xs)


# ============================================================================ RoPE


class KernelRows(NamedTuple):
    """The table row the RoPE kernel reads for sequence index ``s`` of batch row ``b``:
    ``b * row_stride_b + s * row_coef_s + row_base (+ pos[b * pos_stride_b + s * pos_stride_s])``."""

    pos: Tensor | None = None
    pos_stride_b: int = 0
    pos_stride_s: int = 0
    row_stride_b: int = 0
    row_coef_s: int = 1
    row_base: int = 0

    @classmethod
    def of(cls, rows: TableRows, cos: Tensor, batch: int, seq: int) -> KernelRows:
        """The kernel's form of the rows :func:`companion.rope.rope_table_rows` validated."""
        if rows.gathered:
            return cls(row_stride_b=seq if cos.shape[0] == batch and batch > 1 else 0)
        pos = rows.positions
        if pos is None:
            return cls(row_base=rows.start)
        return cls(pos=pos, pos_stride_b=pos.stride(0) if pos.dim() == 2 else 0,
                   pos_stride_s=pos.stride(-1), row_coef_s=0)


def fused_rope(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    layout: str = "half",
    rotary_dim: int | None = None,
    positions: Tensor | Sequence[int] | None = None,
    offset: int | Tensor | None = None,
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of ``q`` and ``k`` in one fused kernel (:cite:`su2024roformer`).

    The same function as :func:`companion.rope.apply_rope` (same arguments, same results:
    bit for bit in float32, and in float16/bfloat16 the same float32 arithmetic with one
    cast), computed on CUDA by one Triton launch for both tensors (:cite:`tillet2019triton`).
    For a pair ``(a, b)`` at position ``p``, ``c = cos[p, i]``, ``s = sin[p, i]``::

        a' = a * c - b * s,    b' = b * c + a * s

    The backward pass is the inverse rotation (``s -> -s``), also one launch.

    Backends (chosen from the device, never by the caller): CUDA runs the Triton kernel; CPU
    runs it through Triton's interpreter if ``TRITON_INTERPRET=1`` was set before the kernels
    were first used, otherwise :func:`~companion.rope.apply_rope`. float64 data or tables,
    tables that require a gradient, ``head_dim > 1024`` and a last dimension that is not
    contiguous always take :func:`~companion.rope.apply_rope`. Validation is
    :func:`companion.rope.check_rope_args` on every backend: whatever ``apply_rope`` accepts,
    this accepts, and it rejects the rest with the same error.

    Args:
        q: ``(batch, heads, seq, head_dim)``, float32/float16/bfloat16 (float64: reference).
        k: ``(batch, kv_heads, seq, head_dim)``, same batch, seq and head_dim as ``q`` (its
            dtype may differ).
        cos, sin: compact tables, ``(table_len, rotary_dim // 2)`` indexed by position, or
            ``(batch or 1, seq, rotary_dim // 2)`` already gathered (from
            :func:`companion.rope.rope_cos_sin` or ``RotaryEmbedding.cos_sin``).
        layout: ``"half"`` (GPT-NeoX, HuggingFace) or ``"interleaved"`` (GPT-J, Meta).
        rotary_dim: rotated dimensions (even, ``<= head_dim``); the rest pass through.
        positions: integer positions ``(seq,)`` or ``(batch, seq)`` (per-row, left padding).
        offset: int, or int tensor ``(batch,)``: rows ``offset + arange(seq)`` (decoding).
        inplace: write into ``q`` and ``k`` (not differentiable).

    Returns:
        ``(q_rotated, k_rotated)``, in the input dtype (``q`` and ``k`` themselves if inplace).

    Raises:
        TypeError: non-float data; bad table dtypes; float positions; a flag that is not a bool.
        ValueError: shapes; an odd or too large ``rotary_dim``; an inplace call that needs
            grad, or whose ``q`` and ``k`` share memory.
        IndexError: positions or offsets outside the table.
    """
    args = check_rope_args(q, k, cos, sin, layout=layout, rotary_dim=rotary_dim, positions=positions,
                           offset=offset, inplace=inplace)
    grad_tables = torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    use_ref = (
        _dispatch.backend(q.device, "rope") == "torch"
        or q.dtype not in KERNEL_DTYPES
        or k.dtype not in KERNEL_DTYPES
        or cos.dtype == torch.float64
        or grad_tables
        or q.numel() == 0
        or k.numel() == 0
        or q.shape[-1] > MAX_ROPE_HEAD_DIM
        or not _unit_stride(q, k)
    )
    if use_ref:
        return apply_rope(q, k, cos, sin, layout=args.layout, rotary_dim=args.rotary_dim,
                          positions=positions, offset=offset, inplace=args.inplace)
    kern = _dispatch.module("rope")
    rows = KernelRows.of(args.rows, cos, q.shape[0], q.shape[2])
    table_c, table_s = (t.reshape(-1, t.shape[-1]).contiguous() for t in (cos, sin))
    r = args.rotary_dim
    if args.inplace:
        kern.launch_rope(q, k, q, k, table_c, table_s, rows, layout=args.layout, rotary_dim=r)
        return q, k
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return kern.FusedRope.apply(q, k, table_c, table_s, rows, args.layout, r)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    kern.launch_rope(q, k, q_out, k_out, table_c, table_s, rows, layout=args.layout, rotary_dim=r)
    return q_out, k_out


# ============================================================================ attention

#: The position biases :func:`flash_attention_with_bias` computes inside the kernel.
BIASES: tuple[str | None, ...] = (None, "alibi", "t5")

_POS_LIMIT = 2**30  # the kernels hold positions, and their differences, in int32


class T5Spec(NamedTuple):
    """The T5 bias of one call, from a module or from the tuple form."""

    table: Tensor
    num_buckets: int
    max_distance: int
    bidirectional: bool
    module: T5RelativeBias | None


def _t5_spec(t5: object, heads: int, device: torch.device) -> T5Spec:
    """Validate ``t5`` (a module or ``(table, num_buckets, max_distance, bidirectional)``) for
    ``heads`` query heads: the head check of every other attention path, T5's bucket checks."""
    if isinstance(t5, T5RelativeBias):
        spec = T5Spec(t5.table, t5.num_buckets, t5.max_distance, t5.bidirectional, t5)
        check_scheme_heads(t5.num_heads, heads, type(t5).__name__)
    elif isinstance(t5, (tuple, list)) and len(t5) == 4:
        spec = T5Spec(*t5, module=None)
        check_tensor(spec.table, "t5 table", 2)
        check_t5_bucket_args(spec.bidirectional, spec.num_buckets, spec.max_distance)
        if not spec.table.dtype.is_floating_point:
            raise TypeError(f"t5 table must be floating point, got dtype {spec.table.dtype}")
        if spec.table.shape[0] != spec.num_buckets:
            raise ValueError(f"t5 table must have shape (num_buckets, heads) = ({spec.num_buckets}, "
                             f"{heads}), got {tuple(spec.table.shape)}")
        check_scheme_heads(spec.table.shape[1], heads, "the t5 table")
    else:
        raise TypeError(
            "t5 must be a companion.relative.T5RelativeBias or a tuple (table, num_buckets, "
            f"max_distance, bidirectional), got {type(t5).__name__}"
        )
    if spec.table.device != device:
        raise ValueError(f"the t5 table is on {spec.table.device} but q is on {device}")
    return spec


def _alibi_slopes(slopes: object, heads: int, device: torch.device) -> Tensor:
    """Custom ALiBi slopes ``(heads,)`` as float32 on ``device``, or the default ones."""
    if slopes is None:
        return _cached(_slopes_cache, (heads, device), lambda: alibi_slopes_fn(heads, device=device))
    check_tensor(slopes, "alibi_slopes", 1)
    assert isinstance(slopes, Tensor)
    if not slopes.dtype.is_floating_point:
        raise TypeError(f"alibi_slopes must be a floating-point tensor, got dtype {slopes.dtype}")
    if slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "alibi_slopes requires grad, but flash_attention_with_bias gives the slopes no "
            "gradient; pass alibi_slopes.detach(), or learn them with companion.bias_attention "
            "and bias_params=[slopes]"
        )
    check_scheme_heads(slopes.shape[0], heads, "alibi_slopes")
    return slopes.detach().to(device=device, dtype=torch.float32).contiguous()


def _position_range(pos: Tensor | None, default_start: int,
                    length: int) -> tuple[Tensor | None, int, int]:
    """``(positions or None, lowest, highest)`` of positions the prologue validated. None
    stands for the default ``arange(default_start, default_start + length)``, whose range
    needs no device sync."""
    if pos is None:
        return None, default_start, default_start + length - 1
    if not pos.numel():
        return pos, 0, -1
    lo, hi = (int(x) for x in torch.aminmax(pos))
    return pos, lo, hi


@dataclass(frozen=True)
class AttentionMeta:
    """The non-tensor arguments of one attention launch (see ``FlashBiasAttention``)."""

    #: int32 ``(1 or batch, len)`` positions, or both None for the default contiguous
    #: positions ``q0 + i`` and ``k0 + j``, which the kernels compute instead of loading
    q_pos: Tensor | None
    k_pos: Tensor | None
    q0: int
    k0: int
    #: 0 none, 1 ALiBi, 2 T5 (the index in :data:`BIASES`)
    bias: int
    #: float32 ``(heads,)`` ALiBi slopes, or None
    slopes: Tensor | None
    #: the clamped offset range of the T5 per-offset vector
    t5_lo: int
    t5_hi: int
    causal: bool
    scale: float


_CACHE_LIMIT = 64
_slopes_cache: dict[tuple[int, torch.device], Tensor] = {}
_bucket_cache: dict[tuple, Tensor] = {}


def _cached(cache: dict, key: tuple, make) -> Tensor:
    """A small memo for per-call host tensors (default slopes, T5 buckets of an offset range),
    so that a call launches no extra kernels to rebuild them."""
    if key not in cache:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = make()
    return cache[key]


def _reference_attention(q: Tensor, k: Tensor, v: Tensor, kind: str | None, slopes: Tensor | None,
                         t5: T5Spec | None, causal: bool, scale: float, q_pos: Tensor | None,
                         k_pos: Tensor | None) -> Tensor:
    """The torch path: :func:`companion.blockwise.bias_attention` with the matching bias."""
    kw = dict(causal=causal, scale=scale, q_pos=q_pos, k_pos=k_pos)
    if kind is None:
        return bias_attention(q, k, v, None, **kw)
    if kind == "alibi":
        def alibi_fn(qp: Tensor, kp: Tensor) -> Tensor:
            return alibi_bias(slopes, qp, kp)  # type: ignore[arg-type]
        alibi_fn.relative_bias = True  # type: ignore[attr-defined]
        return bias_attention(q, k, v, alibi_fn, **kw)
    assert t5 is not None
    table, num_buckets, max_distance, bidirectional, module = t5
    if module is not None:
        return bias_attention(q, k, v, module, **kw)

    def t5_fn(qp: Tensor, kp: Tensor) -> Tensor:
        rel = kp.unsqueeze(-2) - qp.unsqueeze(-1)
        values = table[t5_relative_position_bucket(rel, bidirectional, num_buckets, max_distance)]
        return values.movedim(-1, -3)
    t5_fn.relative_bias = True  # type: ignore[attr-defined]
    return bias_attention(q, k, v, t5_fn, bias_params=[table] if table.requires_grad else None, **kw)


def flash_attention_with_bias(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bias: str | None = None,
    alibi_slopes: Tensor | None = None,
    t5: T5RelativeBias | tuple[Tensor, int, int, bool] | None = None,
    causal: bool = False,
    scale: float | None = None,
    q_pos: Tensor | Sequence[int] | None = None,
    k_pos: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """Attention with a position bias computed inside a flash-attention kernel, never ``L x L``.

    Computes ``softmax(scale * q k^T + bias) v`` (FlashAttention-2's algorithm,
    :cite:`dao2022flashattention`, :cite:`dao2024flashattention2`; online softmax,
    :cite:`milakov2018online`), where the bias of query ``i`` and key ``j`` is:

    * ``bias=None``: none;
    * ``bias="alibi"``: ``-m_h * |k_pos[j] - q_pos[i]|`` (:cite:`press2022train`), slopes
      ``alibi_slopes`` (default :func:`companion.alibi.alibi_slopes` ``(heads)``);
    * ``bias="t5"``: ``table[bucket(k_pos[j] - q_pos[i]), h]`` (:cite:`raffel2020exploring`),
      T5's buckets exactly (:func:`companion.relative.t5_relative_position_bucket`). ``t5`` is
      a :class:`companion.relative.T5RelativeBias` or ``(table, num_buckets, max_distance,
      bidirectional)`` with ``table`` of shape ``(num_buckets, heads)``. The table gets a
      gradient. T5 itself does not scale its logits: pass ``scale=1.0`` to reproduce it.

    ``causal=True`` masks keys later than the query (``k_pos > q_pos``); with ALiBi this is
    the decoder form of the paper. The forward pass saves one log-sum-exp per query row; the
    backward pass recomputes each tile (gradients for ``q``, ``k``, ``v`` and the T5 table).

    Backends (chosen from the device): CUDA runs the Triton kernels; CPU runs them through
    Triton's interpreter if ``TRITON_INTERPRET=1`` was set before the kernels were first
    used, otherwise :func:`companion.blockwise.bias_attention` (the blockwise torch path, same
    result). float64, ``head_dim > 256``, a value dim other than ``head_dim`` and positions
    outside ``(-2**30, 2**30)`` always take the torch path; a last dimension that is not
    contiguous is copied for the kernel. The arguments are validated by the same checks as
    :func:`companion.attention.attention` and :func:`companion.blockwise.bias_attention`
    (``companion._checks``), on every backend: a scheme (``t5``, ``alibi_slopes``) must be
    built for exactly ``heads`` heads.

    Args:
        q: ``(batch, heads, q_len, head_dim)``, float32/float16/bfloat16.
        k: ``(batch, kv_heads, k_len, head_dim)``, same dtype; ``heads`` a multiple of
            ``kv_heads`` (grouped-query attention).
        v: ``(batch, kv_heads, k_len, v_dim)``, same dtype.
        bias: ``None``, ``"alibi"`` or ``"t5"``.
        alibi_slopes: ``(heads,)`` slopes for ``bias="alibi"``. They get no gradient, so a
            tensor that requires grad raises ``ValueError`` (pass ``.detach()``).
        t5: the T5 bias for ``bias="t5"``, see above, for ``heads`` heads.
        causal: mask the future by position (a bool).
        scale: logit scale, a finite number > 0; default ``1 / sqrt(head_dim)``.
        q_pos, k_pos: integer positions ``(len,)`` or ``(batch, len)``; default keys at
            ``arange(k_len)`` and queries the last ``q_len`` of them (decoding).

    Returns:
        ``(batch, heads, q_len, v_dim)`` in ``q``'s dtype; a query that may attend no key
        gets zeros.
    """
    check_choice(bias, "bias", BIASES)
    pro = _prologue(q, k, v, None, q_pos, k_pos, causal=causal, scale=scale, materialize=False)
    b, h, lq, d, hk, lk = pro[:6]
    causal, scale, q0 = pro.causal, pro.scale, pro.q_start
    if bias != "alibi" and alibi_slopes is not None:
        raise ValueError("alibi_slopes is only used with bias='alibi'")
    if bias != "t5" and t5 is not None:
        raise ValueError("t5 is only used with bias='t5'")
    slopes = _alibi_slopes(alibi_slopes, h, q.device) if bias == "alibi" else None
    spec = None
    if bias == "t5":
        if t5 is None:
            raise ValueError("bias='t5' needs t5=T5RelativeBias(...) or "
                             "(table, num_buckets, max_distance, bidirectional)")
        spec = _t5_spec(t5, h, q.device)
    q_pos, q_lo, q_hi = _position_range(pro.q_pos, q0, lq)
    k_pos, k_lo, k_hi = _position_range(pro.k_pos, 0, lk)

    use_ref = (_dispatch.backend(q.device, "attention") == "torch" or q.dtype not in KERNEL_DTYPES
               or q.numel() == 0 or k.numel() == 0 or d > MAX_ATTENTION_HEAD_DIM or v.shape[-1] != d
               or min(q_lo, k_lo) <= -_POS_LIMIT or max(q_hi, k_hi) >= _POS_LIMIT)
    if use_ref:
        return _reference_attention(q, k, v, bias, slopes, spec, causal, scale, q_pos, k_pos)

    kern = _dispatch.module("attention")
    q, k, v = (t if _unit_stride(t) else t.contiguous() for t in (q, k, v))
    pos = (None, None)
    if q_pos is not None or k_pos is not None:  # positions given: the kernels load them
        qp = torch.arange(q0, q0 + lq, device=q.device) if q_pos is None else q_pos
        kp = torch.arange(lk, device=q.device) if k_pos is None else k_pos
        pos = tuple((p if p.dim() == 2 else p[None]).int().contiguous() for p in (qp, kp))
    vec = q.new_zeros(1, dtype=torch.float32)
    lo = hi = 0
    if spec is not None:
        table, num_buckets, max_distance, bidirectional, _ = spec
        # Every offset k_pos - q_pos that occurs, clamped to [-max_distance, max_distance]:
        # beyond that distance the bucket is the last one of its direction and never changes.
        lo, hi = (min(max(x, -max_distance), max_distance) for x in (k_lo - q_hi, k_hi - q_lo))
        buckets = _cached(
            _bucket_cache, (q.device, lo, hi, num_buckets, max_distance, bidirectional),
            lambda: t5_relative_position_bucket(torch.arange(lo, hi + 1, device=q.device), bidirectional,
                                                num_buckets, max_distance))
        vec = table[buckets].t().float().contiguous()  # (heads, offsets): differentiable
    flags = nonfinite_flags(v)
    if flags is not None:  # the rule of the torch paths: a query sees only its visible keys' NaN/inf
        v = zero_nonfinite(v)
    meta = AttentionMeta(q_pos=pos[0], k_pos=pos[1], q0=q0, k0=0, bias=BIASES.index(bias), slopes=slopes,
                         t5_lo=lo, t5_hi=hi, causal=causal, scale=scale)
    out = kern.FlashBiasAttention.apply(q, k, v, vec, meta)
    if flags is not None:
        out = restore_nonfinite(out, _visible_counts(flags, h, lq, causal, q_pos, k_pos, q0))
    return out


def _visible_counts(flags: Tensor, heads: int, lq: int, causal: bool, q_pos: Tensor | None,
                    k_pos: Tensor | None, q0: int) -> Tensor:
    """``(batch, heads, q_len, F)``: per query, the sum of ``flags`` ``(batch, kv_heads, k_len,
    F)`` over the keys it may attend, without an ``L x L`` mask: causal visibility is
    ``k_pos <= q_pos``, so the keys sorted by position give it as a prefix sum."""
    b, hk, lk, width = flags.shape
    f = flags.float().repeat_interleave(heads // hk, dim=1)
    if not causal:
        return f.sum(2, keepdim=True).expand(b, heads, lq, width)
    qp = torch.arange(q0, q0 + lq, device=f.device) if q_pos is None else q_pos
    kp = torch.arange(lk, device=f.device) if k_pos is None else k_pos
    qp, kp = qp.expand(b, lq).contiguous(), kp.expand(b, lk)
    k_sorted, order = kp.sort(-1)
    f = f.gather(2, order[:, None, :, None].expand(b, heads, lk, width))
    prefix = torch.cat((f.new_zeros(b, heads, 1, width), f.cumsum(2)), dim=2)
    seen = torch.searchsorted(k_sorted.contiguous(), qp, right=True)  # keys with k_pos <= q_pos
    return prefix.gather(2, seen[:, None, :, None].expand(b, heads, lq, width))
