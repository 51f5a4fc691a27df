"""The public entry points of :mod:`companion.kernels`: validation, then dispatch.

Each function checks its arguments the same way on every backend (so a call that fails on a
laptop fails the same way on a GPU), then runs the Triton kernel or the torch reference that
:func:`companion.kernels._dispatch.backend` picks for the tensors' device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .._checks import as_positions, check_tensor
from ..alibi import alibi_bias, bias_attention
from ..alibi import alibi_slopes as alibi_slopes_fn
from ..relative import T5RelativeBias, t5_relative_position_bucket
from ..rope import _check_layout, _check_rotary_dim, _check_tables, _table_rows, apply_rope
from . import _dispatch

__all__ = [
    "MAX_ATTENTION_HEAD_DIM",
    "MAX_ROPE_HEAD_DIM",
    "KERNEL_DTYPES",
    "fused_rope",
    "flash_attention_with_bias",
    "kernel_backend",
]

#: The largest head_dim the fused RoPE kernel takes (a program holds whole rows in registers).
MAX_ROPE_HEAD_DIM = 1024
#: The largest head_dim the attention kernel takes (q, k, v tiles of this width sit in SRAM).
MAX_ATTENTION_HEAD_DIM = 256
#: Activation dtypes the kernels run; float64 goes to the torch reference on every device.
KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def kernel_backend(x: Tensor | torch.device | str, op: str = "rope") -> str:
    """Which backend runs ``op`` (``"rope"`` or ``"attention"``) for a tensor on this device.

    ``"triton"`` (CUDA), ``"triton-interpreter"`` (CPU with ``TRITON_INTERPRET=1`` set before
    the kernels are first used) or ``"torch"`` (the reference). Informational: the entry
    points choose by themselves. A few cases always take the reference whatever the device:
    float64 data, tables that require a gradient, empty tensors.
    """
    device = x.device if isinstance(x, Tensor) else x
    return _dispatch.backend(device, op)


# ============================================================================ RoPE


def _check_unit_stride(x: Tensor, name: str) -> None:
    if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride 1), got strides "
            f"{tuple(x.stride())}; the fused kernels load whole rows: pass {name}.contiguous()"
        )


def _rope_args(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: object,
               rotary_dim: object) -> int:
    """Validate everything but positions; return ``rotary_dim``.

    The checks shared with :func:`companion.rope.apply_rope` are the same functions, so both
    paths reject the same input with the same message; the rest are the kernel's own limits.
    """
    check_tensor(q, "q", 4)
    check_tensor(k, "k", 4)
    if not q.dtype.is_floating_point:
        raise TypeError(f"q must be a floating-point tensor, got dtype {q.dtype}")
    if k.dtype != q.dtype:
        raise TypeError(f"k dtype {k.dtype} must equal q dtype {q.dtype} (one fused launch rotates both)")
    if k.device != q.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"k head_dim {k.shape[-1]} must equal q head_dim {d}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must share batch and seq, got q {tuple(q.shape)} and k {tuple(k.shape)}; "
            "rotate them separately with companion.rope.rope_rotate"
        )
    if d > MAX_ROPE_HEAD_DIM:
        raise ValueError(f"head_dim must be <= {MAX_ROPE_HEAD_DIM} for the fused RoPE kernel, got {d}")
    _check_unit_stride(q, "q")
    _check_unit_stride(k, "k")
    _check_layout(layout)
    r = _check_rotary_dim(rotary_dim, d)
    _check_tables(cos, sin, r, q.device, "q")
    return r


def _kernel_rows(cos: Tensor, batch: int, seq: int, positions: Tensor | Sequence[int] | None,
                 offset: int | Tensor | None, device: torch.device) -> dict:
    """Describe, for the kernel, which table row each ``(b, s)`` reads:
    ``row = b * row_stride_b + s * row_coef_s + row_base (+ pos[b, s])``.

    Validation is :func:`companion.rope._table_rows`, the one ``apply_rope`` uses."""
    rows = dict(pos=None, pos_stride_b=0, pos_stride_s=0, row_stride_b=0, row_coef_s=1, row_base=0)
    kind, spec = _table_rows(cos, batch, seq, positions, offset, device)
    if kind == "gathered":
        rows["row_stride_b"] = seq if cos.shape[0] == batch and batch > 1 else 0
    elif kind == "positions":
        rows.update(pos=spec, pos_stride_b=spec.stride(0) if spec.dim() == 2 else 0,
                    pos_stride_s=spec.stride(-1), row_coef_s=0)
    elif kind == "offset":
        rows["row_base"] = spec
    else:  # "offsets": one start per batch row
        rows.update(pos=spec, pos_stride_b=spec.stride(0))
    return rows


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
    were first used, otherwise :func:`~companion.rope.apply_rope`. float64 data or tables, and
    tables that require a gradient, always take :func:`~companion.rope.apply_rope`.

    Args:
        q: ``(batch, heads, seq, head_dim)``, float32/float16/bfloat16 (float64: reference),
            last dimension contiguous, ``head_dim <= 1024``.
        k: ``(batch, kv_heads, seq, head_dim)``, same dtype, batch, seq and head_dim as ``q``.
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
        TypeError: ``k``'s dtype differs from ``q``'s; non-float data; bad table dtypes.
        ValueError: shapes; a ``head_dim`` above 1024; a last dimension that is not
            contiguous; an odd or too large ``rotary_dim``; an inplace call that needs grad.
        IndexError: positions or offsets outside the table.
    """
    r = _rope_args(q, k, cos, sin, layout, rotary_dim)
    batch, _, seq, _ = q.shape
    rows = _kernel_rows(cos, batch, seq, positions, offset, q.device)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if inplace and (needs_grad or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))):
        raise ValueError("inplace=True is not differentiable: pass inplace=False when gradients are needed")
    use_ref = (
        _dispatch.backend(q.device, "rope") == "torch"
        or q.dtype not in KERNEL_DTYPES
        or cos.dtype == torch.float64
        or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
        or q.numel() == 0
        or k.numel() == 0
    )
    if use_ref:
        return apply_rope(q, k, cos, sin, layout=layout, rotary_dim=r, positions=positions,
                          offset=offset, inplace=inplace)
    kern = _dispatch.module("rope")
    table_c, table_s = (t.reshape(-1, t.shape[-1]).contiguous() for t in (cos, sin))
    if inplace:
        kern.launch_rope(q, k, q, k, table_c, table_s, rows, layout=layout, rotary_dim=r)
        return q, k
    if needs_grad:
        return kern.FusedRope.apply(q, k, table_c, table_s, rows, layout, r)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    kern.launch_rope(q, k, q_out, k_out, table_c, table_s, rows, layout=layout, rotary_dim=r)
    return q_out, k_out


# ============================================================================ attention

#: The position biases :func:`flash_attention_with_bias` computes inside the kernel.
BIASES: tuple[str | None, ...] = (None, "alibi", "t5")

_POS_LIMIT = 2**30  # int32 positions with int32 differences


def _t5_spec(t5: object, heads: int) -> tuple[Tensor, int, int, bool, T5RelativeBias | None]:
    """``(table, num_buckets, max_distance, bidirectional, module or None)`` from ``t5``."""
    if isinstance(t5, T5RelativeBias):
        return t5.table, t5.num_buckets, t5.max_distance, t5.bidirectional, t5
    if not isinstance(t5, (tuple, list)) or len(t5) != 4:
        raise TypeError(
            "t5 must be a companion.relative.T5RelativeBias or a tuple (table, num_buckets, "
            f"max_distance, bidirectional), got {type(t5).__name__}"
        )
    table, num_buckets, max_distance, bidirectional = t5
    check_tensor(table, "t5 table", 2)
    # Validates the three settings with relative.py's own checks and messages.
    t5_relative_position_bucket(torch.zeros(1, dtype=torch.long), bidirectional, num_buckets, max_distance)
    if table.shape != (num_buckets, heads):
        raise ValueError(
            f"t5 table must have shape (num_buckets, heads) = ({num_buckets}, {heads}), got {tuple(table.shape)}"
        )
    if not table.dtype.is_floating_point:
        raise TypeError(f"t5 table must be floating point, got dtype {table.dtype}")
    return table, num_buckets, max_distance, bidirectional, None


def _attention_positions(pos: object, name: str, length: int, batch: int, device: torch.device,
                         default_start: int) -> tuple[Tensor | None, int, int]:
    """``(positions or None, lowest, highest)``. None stands for the default
    ``arange(default_start, default_start + length)``, whose range needs no device sync."""
    if pos is None:
        return None, default_start, default_start + length - 1
    p = as_positions(pos, name, length, batch, device)
    if not p.numel():
        return p, 0, -1
    lo, hi = (int(x) for x in torch.aminmax(p))
    if lo <= -_POS_LIMIT or hi >= _POS_LIMIT:
        raise ValueError(f"{name} must lie in (-2**30, 2**30) for the attention kernel, got "
                         f"a position {hi if hi >= _POS_LIMIT else lo}")
    return p, lo, hi


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
                         t5: tuple, causal: bool, scale: float, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """The torch path: :func:`companion.alibi.bias_attention` with the matching bias."""
    kw = dict(causal=causal, scale=scale, q_pos=q_pos, k_pos=k_pos)
    if kind is None:
        return bias_attention(q, k, v, None, **kw)
    if kind == "alibi":
        def alibi_fn(qp: Tensor, kp: Tensor) -> Tensor:
            return alibi_bias(slopes, qp, kp)  # type: ignore[arg-type]
        alibi_fn.relative_bias = True  # type: ignore[attr-defined]
        return bias_attention(q, k, v, alibi_fn, **kw)
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
    used, otherwise :func:`companion.alibi.bias_attention` (the blockwise torch path, same
    result). float64 always takes the torch path.

    Args:
        q: ``(batch, heads, q_len, head_dim)``, float32/float16/bfloat16, ``head_dim <= 256``,
            last dimension contiguous.
        k, v: ``(batch, kv_heads, k_len, head_dim)``, same dtype; ``heads`` a multiple of
            ``kv_heads`` (grouped-query attention).
        bias: ``None``, ``"alibi"`` or ``"t5"``.
        alibi_slopes: ``(heads,)`` slopes for ``bias="alibi"``.
        t5: the T5 bias for ``bias="t5"``, see above.
        causal: mask the future by position.
        scale: logit scale, default ``1 / sqrt(head_dim)``.
        q_pos, k_pos: integer positions ``(len,)`` or ``(batch, len)`` in ``(-2**30, 2**30)``;
            default keys at ``arange(k_len)`` and queries the last ``q_len`` of them (decoding).

    Returns:
        ``(batch, heads, q_len, head_dim)`` in ``q``'s dtype; a query that may attend no key
        gets zeros.
    """
    check_tensor(q, "q", 4)
    check_tensor(k, "k", 4)
    check_tensor(v, "v", 4)
    if not q.dtype.is_floating_point:
        raise TypeError(f"q must be a floating-point tensor, got dtype {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must equal q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    if k.shape[0] != b:
        raise ValueError(f"k batch size {k.shape[0]} must equal q batch size {b}")
    if k.shape[-1] != d:
        raise ValueError(f"k head_dim {k.shape[-1]} must equal q head_dim {d}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)} (the kernel "
                         "needs the value dim equal to head_dim)")
    if hk < 1 or h % hk:
        raise ValueError(f"q heads ({h}) must be a multiple of k heads ({hk})")
    if d > MAX_ATTENTION_HEAD_DIM:
        raise ValueError(f"head_dim must be <= {MAX_ATTENTION_HEAD_DIM} for the attention kernel, got {d}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_unit_stride(t, name)
    if bias not in BIASES:
        raise ValueError(f"bias must be one of {BIASES}, got {bias!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    scale = float(scale)
    if bias != "alibi" and alibi_slopes is not None:
        raise ValueError("alibi_slopes is only used with bias='alibi'")
    if bias != "t5" and t5 is not None:
        raise ValueError("t5 is only used with bias='t5'")
    slopes = None
    if bias == "alibi":
        if alibi_slopes is None:
            slopes = _cached(_slopes_cache, (h, q.device), lambda: alibi_slopes_fn(h, device=q.device))
        else:
            slopes = alibi_slopes
            check_tensor(slopes, "alibi_slopes", 1)
            if slopes.shape != (h,) or not slopes.dtype.is_floating_point:
                raise ValueError(f"alibi_slopes must be a float tensor of shape (heads,) = ({h},), got "
                                 f"{tuple(slopes.shape)} {slopes.dtype}")
            slopes = slopes.detach().to(device=q.device, dtype=torch.float32).contiguous()
    spec: tuple = ()
    if bias == "t5":
        if t5 is None:
            raise ValueError("bias='t5' needs t5=T5RelativeBias(...) or "
                             "(table, num_buckets, max_distance, bidirectional)")
        spec = _t5_spec(t5, h)
        if spec[0].device != q.device:
            raise ValueError(f"the t5 table is on {spec[0].device} but q is on {q.device}")
    q0 = max(lk - lq, 0)
    q_pos, q_lo, q_hi = _attention_positions(q_pos, "q_pos", lq, b, q.device, q0)
    k_pos, k_lo, k_hi = _attention_positions(k_pos, "k_pos", lk, b, q.device, 0)

    use_ref = (_dispatch.backend(q.device, "attention") == "torch" or q.dtype not in KERNEL_DTYPES
               or q.numel() == 0 or k.numel() == 0)
    if use_ref:
        return _reference_attention(q, k, v, bias, slopes, spec, causal, scale, q_pos, k_pos)

    kern = _dispatch.module("attention")
    meta = dict(q_pos=None, k_pos=None, q0=q0, k0=0, bias=0, slopes=slopes, t5_lo=0, t5_hi=0,
                causal=causal, scale=scale)
    if q_pos is not None or k_pos is not None:  # positions given: the kernels load them
        if q_pos is None:
            q_pos = torch.arange(q0, q0 + lq, device=q.device)
        if k_pos is None:
            k_pos = torch.arange(lk, device=q.device)
        meta["q_pos"] = (q_pos if q_pos.dim() == 2 else q_pos[None]).int().contiguous()
        meta["k_pos"] = (k_pos if k_pos.dim() == 2 else k_pos[None]).int().contiguous()
    vec = q.new_zeros(1, dtype=torch.float32)
    if bias == "alibi":
        meta["bias"] = 1
    elif bias == "t5":
        table, num_buckets, max_distance, bidirectional, _ = spec
        # Every offset k_pos - q_pos that occurs, clamped to [-max_distance, max_distance]:
        # beyond that distance the bucket is the last one of its direction and never changes.
        lo, hi = (min(max(x, -max_distance), max_distance) for x in (k_lo - q_hi, k_hi - q_lo))
        buckets = _cached(
            _bucket_cache, (q.device, lo, hi, num_buckets, max_distance, bidirectional),
            lambda: t5_relative_position_bucket(torch.arange(lo, hi + 1, device=q.device), bidirectional,
                                                num_buckets, max_distance))
        vec = table[buckets].t().float().contiguous()  # (heads, offsets): differentiable
        meta.update(bias=2, t5_lo=lo, t5_hi=hi)
    return kern.FlashBiasAttention.apply(q, k, v, vec, meta)
