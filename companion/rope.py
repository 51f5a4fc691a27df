"""Rotary position embedding (RoPE): frequencies, cos/sin tables, the rotation, layouts.

RoPE (Su et al., :cite:`su2024roformer`) rotates each pair of query/key coordinates by an
angle proportional to the token's position, so that the dot product of a rotated query at
position ``m`` and a rotated key at position ``n`` depends on the positions only through
``m - n``. With ``r = rotary_dim`` (even, ``<= head_dim``) and ``h = r // 2`` pairs, pair ``i``
turns at the inverse frequency ``theta_i = base ** (-2 i / r)``, by the angle ``p * theta_i``
at position ``p``.

Two memory layouts put the two coordinates of a pair in different places; both are in wide use
and they are not interchangeable (loading one model's weights with the other's function
silently corrupts it):

==================  =========================================  ===============================
layout              pair ``i`` lives at                         used by
==================  =========================================  ===============================
``"half"``          ``(x[i], x[i + h])``                       GPT-NeoX, HuggingFace
                                                               ``rotate_half``
``"interleaved"``   ``(x[2 i], x[2 i + 1])``                   GPT-J, Meta's Llama
                                                               (``view_as_complex``)
==================  =========================================  ===============================

A model converts exactly between them by permuting the rows of ``W_q`` and ``W_k`` within each
head (:func:`convert_qk_weight`). Dimensions ``>= rotary_dim`` pass through unchanged (partial
rotary, as in GPT-NeoX with ``rotary_pct = 0.25``, :cite:`black2022gptneox`).

Tables. This module works with *compact* tables: ``cos`` and ``sin`` of width ``h`` (one column
per pair), the same for both layouts, as FlashAttention's rotary kernel does
(:cite:`dao2022flashattention`). HuggingFace's tables have width ``r`` and hold every column
twice (``cat(freqs, freqs)``); ``cos_hf[..., :h]`` is the compact table. Tables are float32 (or
float64) and never in the activations' dtype.

The exact arithmetic of :func:`apply_rope` (the contract that a fused kernel reproduces bit for
bit in float32) is spelled out in its docstring.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._checks import (
    as_positions,
    check_base,
    check_bool,
    check_choice,
    check_device,
    check_finite_number,
    check_float_dtype,
    check_float_tensor,
    check_has_data,
    check_int_tensor,
    check_position_range,
    check_positive_int,
    check_tensor,
    has_internal_overlap,
    shares_memory,
)
from .attention import PositionScheme

__all__ = [
    "LAYOUTS",
    "TableRows",
    "RopeArgs",
    "rope_frequencies",
    "rope_cos_sin",
    "rotate_half",
    "rope_rotate",
    "apply_rope",
    "check_layout",
    "check_rotary_dim",
    "check_rope_tables",
    "rope_table_rows",
    "check_rope_args",
    "check_qk_head_dim",
    "check_inv_freq",
    "check_scheme_device",
    "RotaryEmbedding",
    "positions_from_mask",
    "layout_permutation",
    "convert_layout",
    "convert_qk_weight",
]

#: The two pair layouts, half-split (GPT-NeoX, HuggingFace) and interleaved (GPT-J, Meta).
LAYOUTS: tuple[str, ...] = ("half", "interleaved")

#: float32 holds every integer exactly only up to 2**24; larger positions need float64 angles.
_FP32_EXACT_INT = 2**24

#: The dtypes angles and tables are computed in.
_TABLE_DTYPES = (torch.float32, torch.float64)

# The fast path works on slices of the sequence of about this many elements (1 MiB of float32),
# so that its temporaries stay in the CPU cache and are reused rather than freshly allocated
# (large fresh allocations cost page faults). Larger slices mean fewer calls, and fewer
# thread-pool synchronisations, which matters on a busy machine; see benchmarks/rope_cpu.py.
_CHUNK_ELEMS = 1 << 18


# ----------------------------------------------------------------------------- validation
#
# The public checks below are the whole validation of a RoPE call. apply_rope, rope_rotate and
# companion.kernels.fused_rope all go through them, so every backend accepts the same input
# and rejects it with the same message.


class TableRows(NamedTuple):
    """Which rows of a compact cos/sin table one call reads (from :func:`rope_table_rows`).

    Sequence index ``s`` of batch row ``b`` reads row ``start + s``, or ``positions[s]`` /
    ``positions[b, s]`` when ``positions`` is set (int64 ``(seq,)`` or ``(batch, seq)``).
    ``gathered`` means the tables are already ``(batch or 1, seq, rotary_dim // 2)``: row
    ``s`` of table ``b`` (or of table 0).
    """

    start: int = 0
    positions: Tensor | None = None
    gathered: bool = False


class RopeArgs(NamedTuple):
    """A validated RoPE call (from :func:`check_rope_args`)."""

    layout: str
    rotary_dim: int
    rows: TableRows
    inplace: bool


def check_layout(layout: object, name: str = "layout") -> str:
    """Require one of :data:`LAYOUTS` (``ValueError`` naming ``name`` otherwise)."""
    return check_choice(layout, name, LAYOUTS)  # type: ignore[return-value]


def check_rotary_dim(rotary_dim: object, head_dim: int) -> int:
    """Require an even ``rotary_dim`` in ``[2, head_dim]``; ``None`` means ``head_dim``."""
    if rotary_dim is None:
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"rotary_dim must be an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim < 2:
        raise ValueError(f"rotary_dim must be an even int in [2, head_dim={head_dim}], got {rotary_dim}")
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even (coordinates are rotated in pairs), got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be <= head_dim ({head_dim}), got {rotary_dim}")
    return rotary_dim


def _check_table_dtype(dtype: object, name: str) -> torch.dtype:
    check_float_dtype(dtype, name)
    if dtype not in _TABLE_DTYPES:
        raise ValueError(f"{name} must be torch.float32 or torch.float64, got {dtype}")
    return dtype  # type: ignore[return-value]


def _check_activation(x: object, name: str) -> Tensor:
    """A 4-D floating-point tensor ``(batch, heads, seq, head_dim)`` that holds data (a
    ``meta`` tensor is refused under its own name, before any table is built for it)."""
    return check_float_tensor(x, name, 4)


def check_scheme_device(x: Tensor, name: str, buffer: Tensor, scheme: str) -> None:
    """Require ``x`` on the device of a scheme's ``buffer`` (its frequencies): the scheme
    builds its cos/sin tables there, so ``ValueError`` names ``x``, both devices and the
    ``.to`` call that fixes it (rather than a complaint about tables the caller never passed)."""
    if x.device != buffer.device:
        raise ValueError(
            f"{name} is on {x.device} but this {scheme}'s frequencies are on {buffer.device}; "
            f"move the scheme to {name}'s device with .to({str(x.device)!r})"
        )


def check_inv_freq(inv_freq: object, pairs: int, name: str = "inv_freq") -> Tensor:
    """Require inverse frequencies for ``pairs`` rotated pairs: a floating ``(pairs,)`` tensor
    of finite values ``>= 0``. 0 is allowed: a pair with zero frequency does not rotate
    (p-RoPE, Gemma 4's ``proportional`` type); NaN, inf and negative values raise
    ``ValueError`` naming the first bad entry. Every scheme that takes custom frequencies
    (:class:`RotaryEmbedding`, :class:`companion.grid.MRoPE`) checks them here."""
    check_tensor(inv_freq, name, 1)
    assert isinstance(inv_freq, Tensor)
    if inv_freq.shape != (pairs,):
        raise ValueError(f"{name} must have shape (rotary_dim // 2,) = ({pairs},), got {tuple(inv_freq.shape)}")
    if not inv_freq.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {inv_freq.dtype}")
    check_has_data(inv_freq, name)
    bad = ~torch.isfinite(inv_freq) | (inv_freq < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name} must hold finite values > 0 (or 0 for a pair that does not rotate), got "
            f"{inv_freq[i].item()} at index {i}"
        )
    return inv_freq


def check_qk_head_dim(q: object, k: object, head_dim: int) -> None:
    """Require 4-D floating ``q`` and ``k`` whose last dimension is a scheme's ``head_dim``
    (``ValueError`` naming both otherwise); the first check of every ``rotate`` hook."""
    _check_activation(q, "q")
    _check_activation(k, "k")
    assert isinstance(q, Tensor) and isinstance(k, Tensor)
    if q.shape[-1] != head_dim or k.shape[-1] != head_dim:
        raise ValueError(
            f"q and k head_dim must equal this scheme's head_dim {head_dim}, got "
            f"{q.shape[-1]} and {k.shape[-1]}"
        )


def _check_inplace(xs: dict[str, Tensor], cos: Tensor, sin: Tensor) -> None:
    """An in-place rotation of ``xs`` must not need gradients, nor write one element twice."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*xs.values(), cos, sin)):
        raise ValueError("inplace=True is not differentiable: pass inplace=False when gradients are needed")
    for name, x in xs.items():
        if has_internal_overlap(x):
            raise ValueError(
                f"{name} has elements that share memory (an expanded or stride-0 view), so "
                f"inplace=True would rotate them more than once; use inplace=False or pass "
                f"{name}.contiguous()"
            )
    if len(xs) == 2 and shares_memory(*xs.values()):
        names = " and ".join(xs)
        raise ValueError(f"{names} share memory; use inplace=False or pass distinct tensors")


def _last_dim(x: object) -> int:
    """The size of the last dimension of a tensor ``x`` of at least one dimension."""
    check_tensor(x, "x")
    if x.dim() == 0:  # type: ignore[union-attr]
        raise ValueError("x must have at least 1 dimension (the feature dimension is the last), got a 0-d tensor")
    return x.shape[-1]  # type: ignore[union-attr]


def _table_positions(positions: object) -> Tensor:
    """Positions for a table: an int ``n`` (a numpy int too) means ``arange(n)``, else
    integers of any shape (a 0-d tensor is one position)."""
    if isinstance(positions, numbers.Integral) and not isinstance(positions, (bool, torch.Tensor)):
        return torch.arange(check_positive_int(int(positions), "positions", minimum=0))
    return check_int_tensor(positions, "positions")


def check_rope_tables(cos: object, sin: object, rotary_dim: int, device: torch.device, x_name: str = "x") -> None:
    """Require compact tables for ``rotary_dim``, on the activations' device.

    2-D ``(table_len, rotary_dim // 2)`` or 3-D ``(batch or 1, seq, rotary_dim // 2)``, one
    floating dtype for both. A HuggingFace-width table (``rotary_dim`` columns) gets a hint.
    """
    check_tensor(cos, "cos")
    check_tensor(sin, "sin")
    assert isinstance(cos, Tensor) and isinstance(sin, Tensor)
    r = rotary_dim
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != sin.dtype or not cos.dtype.is_floating_point:
        raise TypeError(f"cos and sin must share a floating dtype, got {cos.dtype} and {sin.dtype}")
    if cos.dim() not in (2, 3) or cos.shape[-1] != r // 2:
        hint = (
            f"; a HuggingFace-style table of width {r} holds each column twice: pass cos[..., :{r // 2}]"
            if cos.dim() in (2, 3) and cos.shape[-1] == r else ""
        )
        raise ValueError(
            f"cos/sin must have shape (table_len, rotary_dim // 2) or (batch, seq, rotary_dim // 2) "
            f"with rotary_dim // 2 = {r // 2}, got {tuple(cos.shape)}{hint}"
        )
    if cos.device != device:
        raise ValueError(f"cos/sin are on {cos.device} but {x_name} is on {device}")


def rope_table_rows(
    cos: Tensor, batch: int, seq: int, positions: Tensor | Sequence[int] | None,
    offset: int | Tensor | None, device: torch.device,
) -> TableRows:
    """Validate ``positions``/``offset`` against the (checked) table ``cos``; say which rows
    this call reads. See :func:`apply_rope` for the forms; positions outside the table raise
    ``IndexError``."""
    if cos.dim() == 3:
        if positions is not None or offset is not None:
            raise ValueError(
                "cos/sin of shape (batch, seq, rotary_dim // 2) are already gathered per row: "
                "pass positions=None and offset=None (or pass 2-D tables indexed by position)"
            )
        if cos.shape[0] not in (1, batch) or cos.shape[1] != seq:
            raise ValueError(
                f"gathered cos/sin must have shape ({batch} or 1, {seq}, rotary_dim // 2), "
                f"got {tuple(cos.shape)}"
            )
        return TableRows(gathered=True)
    table_len = cos.shape[0]
    if positions is not None:
        if offset is not None:
            raise ValueError("pass either positions or offset, not both")
        pos = as_positions(positions, "positions", seq, batch, device)
        check_position_range(pos, "positions", 0, table_len)
        return TableRows(positions=pos)
    if isinstance(offset, Tensor):
        off = check_int_tensor(offset, "offset", dims=(0, 1), what="offsets")
        if off.dim() == 1:
            if off.shape != (batch,):
                raise ValueError(f"offset tensor must have shape ({batch},), got {tuple(off.shape)}")
            pos = off.to(device).unsqueeze(-1) + torch.arange(seq, device=device)
            check_position_range(pos, "offset + arange(seq)", 0, table_len)
            return TableRows(positions=pos)
        offset = int(off)
    if isinstance(offset, numbers.Integral) and not isinstance(offset, bool):
        offset = int(offset)  # a numpy int
    if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)):
        raise TypeError(
            f"offset must be an int or an integer tensor of shape ({batch},), got {type(offset).__name__}"
        )
    start = offset or 0
    if start < 0:
        raise IndexError(f"offset must be >= 0, got {start}")
    if start + seq > table_len:
        raise IndexError(
            f"offset + seq = {start} + {seq} must be <= the table length {table_len} "
            "(build longer cos/sin tables)"
        )
    return TableRows(start=start)


def check_rope_args(
    q: object, k: object, cos: object, sin: object, *, layout: object = "half",
    rotary_dim: object = None, positions: Tensor | Sequence[int] | None = None,
    offset: int | Tensor | None = None, inplace: object = False,
) -> RopeArgs:
    """Validate the arguments of :func:`apply_rope` (and of the fused kernel, which takes the
    same ones); see :func:`apply_rope`. ``q`` and ``k`` may differ in dtype and heads, not in
    batch, sequence, head_dim or device. In place, ``q`` and ``k`` must not share memory (the
    shared elements would be rotated twice) and must have no repeated elements."""
    _check_activation(q, "q")
    _check_activation(k, "k")
    assert isinstance(q, Tensor) and isinstance(k, Tensor)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k head_dim {k.shape[-1]} must equal q head_dim {q.shape[-1]}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must share batch and seq for shared positions, got q {tuple(q.shape)} and "
            f"k {tuple(k.shape)}; rotate them separately with rope_rotate"
        )
    if k.device != q.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}")
    layout = check_layout(layout)
    r = check_rotary_dim(rotary_dim, q.shape[-1])
    check_bool(inplace, "inplace")
    check_rope_tables(cos, sin, r, q.device, "q")
    assert isinstance(cos, Tensor) and isinstance(sin, Tensor)
    rows = rope_table_rows(cos, q.shape[0], q.shape[2], positions, offset, q.device)
    if inplace:
        _check_inplace({"q": q, "k": k}, cos, sin)
    return RopeArgs(layout, r, rows, bool(inplace))


# ----------------------------------------------------------------------------- frequencies, tables


def rope_frequencies(
    dim: int, base: float = 10000.0, device: torch.device | str | None = None, *,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Inverse frequencies ``theta_i = base ** (-2 i / dim)`` for ``i = 0 .. dim/2 - 1``.

    Computed exactly as HuggingFace's default RoPE and Meta's ``precompute_freqs_cis`` do
    (``1 / base ** (arange(0, dim, 2) / dim)`` in float32), so the values match theirs bit for
    bit (:cite:`su2024roformer`). ``dim`` is the number of rotated dimensions (``rotary_dim``),
    not necessarily ``head_dim``: GPT-NeoX's partial rotary uses ``rotary_dim``.

    Args:
        dim: rotated dimensions, a positive even int.
        base: the RoPE base ("theta"), a finite number > 1 (at 1 every pair would turn at
            frequency 1); 10000 in the paper, 500000 in Llama 3.
        device: where to build the tensor.
        dtype: ``torch.float32`` (HuggingFace's values, the default) or ``torch.float64``
            (the same formula evaluated in float64, for float64 tables).

    Returns:
        tensor of shape ``(dim // 2,)`` in ``dtype``, decreasing from 1.
    """
    check_positive_int(dim, "dim", minimum=2)
    if dim % 2:
        raise ValueError(f"dim must be even (coordinates are rotated in pairs), got {dim}")
    base = check_base(base)
    dtype = _check_table_dtype(dtype, "dtype")
    device = None if device is None else check_device(device)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(dtype) / dim
    return 1.0 / (base**exponent)


def rope_cos_sin(
    positions: Tensor | Sequence[int] | int,
    inv_freq: Tensor,
    *,
    attention_scaling: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Compact cos/sin tables: ``cos[..., i] = s * cos(p * theta_i)``, likewise ``sin``.

    ``p`` runs over ``positions`` (any shape; an int ``n`` means ``arange(n)``) and ``theta`` over
    ``inv_freq``; ``s`` is ``attention_scaling`` (1 for plain RoPE; YaRN's attention factor
    multiplies both tables, as in HuggingFace). The result has shape
    ``positions.shape + (len(inv_freq),)``: one column per pair, for either layout.

    Arithmetic, in ``compute_dtype`` (``w``): ``angle = w(p) * w(theta)`` (one rounding), then
    ``cos(angle) * s`` and ``sin(angle) * s``; the tables are returned in ``w``. With the
    default ``w = float32`` this is bit for bit HuggingFace's arithmetic (Meta's angles are
    the same; its ``torch.polar`` evaluates cos/sin to within one ulp of these). The float32
    angle error grows with the position: up to ``p * theta * 2**-24`` radians, 0.03 rad at
    ``p = 10**6``. ``compute_dtype=torch.float64`` gives float64 tables accurate at any
    position (positions are int64, never rounded before the multiply); cast them with
    ``.float()`` for float32 arithmetic in :func:`apply_rope` (as :class:`RotaryEmbedding`
    does) and they stay within float32 rounding of the exact values. ``inv_freq`` is used at
    its own precision (widening it to float64 is exact).

    Raises:
        ValueError: a float32 computation with ``|p| >= 2**24`` (float32 cannot represent every
            such integer; pass ``compute_dtype=torch.float64``); an ``attention_scaling`` that
            is not a finite number > 0.
    """
    check_tensor(inv_freq, "inv_freq", 1)
    if not inv_freq.dtype.is_floating_point:
        raise TypeError(f"inv_freq must be a floating-point tensor, got dtype {inv_freq.dtype}")
    _check_table_dtype(compute_dtype, "compute_dtype")
    attention_scaling = check_finite_number(attention_scaling, "attention_scaling")
    pos = _table_positions(positions).to(inv_freq.device)
    if compute_dtype == torch.float32 and pos.numel() and int(pos.abs().max()) >= _FP32_EXACT_INT:
        raise ValueError(
            f"positions must be < 2**24 = {_FP32_EXACT_INT} for compute_dtype=torch.float32 "
            f"(got {int(pos.abs().max())}); pass compute_dtype=torch.float64"
        )
    angle = pos.to(compute_dtype).unsqueeze(-1) * inv_freq.to(compute_dtype)
    cos, sin = angle.cos(), angle.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos, sin


# ----------------------------------------------------------------------------- the rotation


def rotate_half(x: Tensor) -> Tensor:
    """HuggingFace's ``rotate_half``: ``cat(-x2, x1)`` for the halves ``x1, x2`` of the last dim.

    With full-width tables (``cat(freqs, freqs)``), ``x * cos + rotate_half(x) * sin`` is the
    half-layout RoPE of GPT-NeoX and HuggingFace (:cite:`black2022gptneox`). Kept for teaching
    and for interoperability; :func:`apply_rope` computes the same numbers without the
    concatenation.
    """
    d = _last_dim(x)
    if d % 2:
        raise ValueError(f"x's last dimension must be even, got {d}")
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _pair_views(x: Tensor, layout: str, r: int) -> tuple[Tensor, Tensor]:
    """The first and second coordinates of every pair, as views ``(..., r // 2)``."""
    if layout == "half":
        return x[..., : r // 2], x[..., r // 2 : r]
    return x[..., 0:r:2], x[..., 1:r:2]


def _gather_rows(cos: Tensor, sin: Tensor, rows: TableRows, seq: int) -> tuple[Tensor, Tensor]:
    """The table rows of this call, shaped to broadcast against ``(batch, heads, seq, h)``."""
    if rows.gathered:
        return cos.unsqueeze(1), sin.unsqueeze(1)
    if rows.positions is None:
        return cos[rows.start : rows.start + seq], sin[rows.start : rows.start + seq]
    c, s = cos[rows.positions], sin[rows.positions]  # (seq, h) or (batch, seq, h)
    return (c, s) if rows.positions.dim() == 1 else (c.unsqueeze(1), s.unsqueeze(1))


def _rotate(x: Tensor, c: Tensor, s: Tensor, layout: str, r: int, inplace: bool) -> Tensor:
    """Rotate validated ``x`` by the gathered rows ``c``, ``s`` (see :func:`apply_rope`)."""
    work = torch.promote_types(torch.promote_types(x.dtype, c.dtype), torch.float32)
    c, s = c.to(work), s.to(work)
    if torch.is_grad_enabled() and (x.requires_grad or c.requires_grad or s.requires_grad):
        return _rotate_autograd(x, c, s, layout, r, work)
    return _rotate_fast(x, c, s, layout, r, work, inplace)


def _rotate_autograd(x: Tensor, c: Tensor, s: Tensor, layout: str, r: int, work: torch.dtype) -> Tensor:
    """Out-of-place, differentiable version of the rotation (same roundings as the fast path)."""
    x1, x2 = (t.to(work) for t in _pair_views(x, layout, r))
    y1 = (x1 * c - x2 * s).to(x.dtype)
    y2 = (x2 * c + x1 * s).to(x.dtype)
    rot = torch.cat((y1, y2), dim=-1) if layout == "half" else torch.stack((y1, y2), dim=-1).flatten(-2)
    return rot if r == x.shape[-1] else torch.cat((rot, x[..., r:]), dim=-1)


def _pairs(x: Tensor, layout: str, r: int) -> Tensor:
    """View the rotated dims of ``x`` with an explicit pair axis.

    ``"half"``: ``(..., 2, h)``, the pair axis second to last; ``"interleaved"``: ``(..., h, 2)``.
    Index 0 along the pair axis is the first coordinate ``a``, index 1 the second ``b``.
    """
    h = r // 2
    return x[..., :r].unflatten(-1, (2, h) if layout == "half" else (h, 2))


@torch.no_grad()
def _rotate_fast(x: Tensor, c: Tensor, s: Tensor, layout: str, r: int, work: torch.dtype,
                 inplace: bool) -> Tensor:
    """The same arithmetic, in cache-sized slices of the sequence, with no full-size temporary.

    Per slice, with the pair axis made explicit (:func:`_pairs`), ``y = x * c`` multiplies both
    coordinates by ``c`` in one call; the scratch ``t`` holds ``(b * (-s), a * s)``; then
    ``y += t``. Since ``b * (-s)`` is exactly ``-(b * s)``, this is ``a * c - b * s`` and
    ``b * c + a * s`` with the same single roundings as the formula (no fused multiply-add:
    ``torch.addcmul`` fuses on AVX-512 CPUs, so it is not used). In place, ``t`` is computed
    before ``x`` is overwritten. The slices keep the temporaries in the CPU cache.
    """
    out = x if inplace else torch.empty_like(x)
    b, heads, seq, d = x.shape
    h = r // 2
    pair_dim = -2 if layout == "half" else -1
    # tables with a broadcast pair axis: c for both coordinates, (-s, s) for the cross term
    c = c.unsqueeze(pair_dim)
    neg_s, s = (-s).unsqueeze(pair_dim), s.unsqueeze(pair_dim)
    rows = max(1, min(seq, _CHUNK_ELEMS // max(1, b * heads * r)))
    same = x.dtype == work
    pair_shape = (2, h) if layout == "half" else (h, 2)
    scratch = torch.empty(b, heads, rows, *pair_shape, dtype=work, device=x.device)
    result = scratch if same else torch.empty_like(scratch)
    for j in range(0, seq, rows):
        n = min(rows, seq - j)
        xv, ov = _pairs(x[:, :, j : j + n], layout, r), _pairs(out[:, :, j : j + n], layout, r)
        cj, nsj, sj = (t[..., j : j + n, :, :] for t in (c, neg_s, s))
        if not same:  # half precision in: float32 arithmetic, one cast on store
            xv = xv.to(work)
        t = scratch[:, :, :n]
        a, bb = xv.select(pair_dim, 0), xv.select(pair_dim, 1)
        torch.mul(bb, nsj.select(pair_dim, 0), out=t.select(pair_dim, 0))
        torch.mul(a, sj.select(pair_dim, 0), out=t.select(pair_dim, 1))
        if same:
            torch.mul(xv, cj, out=ov)
            ov.add_(t)
        else:
            y = result[:, :, :n]
            torch.mul(xv, cj, out=y)
            y.add_(t)
            ov.copy_(y)
        if r < d and not inplace:
            out[:, :, j : j + n, r:].copy_(x[:, :, j : j + n, r:])
    return out


def rope_rotate(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    layout: str = "half",
    rotary_dim: int | None = None,
    positions: Tensor | Sequence[int] | None = None,
    offset: int | Tensor | None = None,
    inplace: bool = False,
) -> Tensor:
    """Rotate one tensor ``x`` of shape ``(batch, heads, seq, head_dim)``; see :func:`apply_rope`.

    Use it when queries and keys sit at different positions (the ``rotate`` hook of
    :class:`RotaryEmbedding`); :func:`apply_rope` is the same for a ``(q, k)`` pair.
    """
    _check_activation(x, "x")
    layout = check_layout(layout)
    b, _, seq, d = x.shape
    r = check_rotary_dim(rotary_dim, d)
    check_bool(inplace, "inplace")
    check_rope_tables(cos, sin, r, x.device, "x")
    rows = rope_table_rows(cos, b, seq, positions, offset, x.device)
    if inplace:
        _check_inplace({"x": x}, cos, sin)  # type: ignore[arg-type]
    c, s = _gather_rows(cos, sin, rows, seq)
    return _rotate(x, c, s, layout, r, inplace)


def apply_rope(
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
    """Apply rotary position embedding to queries and keys (:cite:`su2024roformer`).

    For each pair ``i < r/2`` (``r = rotary_dim``, default ``head_dim``) with coordinates
    ``(a, b)`` (``(x[i], x[i + r/2])`` in the ``"half"`` layout, ``(x[2i], x[2i+1])`` in the
    ``"interleaved"`` one) at position ``p``, with ``c = cos[p, i]`` and ``s = sin[p, i]``::

        a' = a * c - b * s
        b' = b * c + a * s

    Dimensions ``>= r`` are copied unchanged (partial rotary, GPT-NeoX).

    Exact arithmetic (what a fused kernel must reproduce bit for bit in float32). The working
    dtype ``w`` is the promotion of ``x.dtype``, ``cos.dtype`` and float32 (float32 for
    float32/bf16/fp16 inputs with float32 tables). ``a, b, c, s`` are converted to ``w``; each of
    the four products is rounded to ``w``; then one rounded subtraction (``a'``) and one rounded
    addition (``b'``); no fused multiply-add; then one cast to ``x.dtype``. In the ``"half"``
    layout this equals HuggingFace's ``q * cos + rotate_half(q) * sin`` bit for bit in float32.
    (The fast CPU path computes ``a * c + b * (-s)``, the same number, since negation is
    exact. A Triton kernel must be launched with ``enable_fp_fusion=False``, or the
    compiler may contract a product and a sum into one FMA, which rounds once instead of twice.)

    Tables and positions. ``cos``/``sin`` are compact float32 tables (from :func:`rope_cos_sin`):

    * 2-D ``(table_len, r // 2)``, a table indexed by position. Rows are picked by
      ``positions`` (int tensor ``(seq,)`` or ``(batch, seq)``: per-row positions for left
      padding), or by ``offset`` (int, or int tensor ``(batch,)``: rows
      ``offset + arange(seq)``, for KV-cache decoding), or by neither (rows ``0 .. seq - 1``).
    * 3-D ``(batch or 1, seq, r // 2)``, rows already gathered for this call (what
      ``RotaryEmbedding.cos_sin(position_ids)`` returns); then no positions or offset.

    Args:
        q: queries ``(batch, heads, seq, head_dim)``.
        k: keys ``(batch, kv_heads, seq, head_dim)``: same batch, sequence and head dims.
        cos, sin: compact tables as above, on q's device.
        layout: ``"half"`` (GPT-NeoX, HuggingFace) or ``"interleaved"`` (GPT-J, Meta).
        rotary_dim: rotated dimensions, even, ``<= head_dim`` (default ``head_dim``).
        positions: integer positions, see above.
        offset: starting position(s), see above.
        inplace: write the result into ``q`` and ``k`` (not differentiable).

    Returns:
        ``(q_rotated, k_rotated)`` in the input dtypes (``q`` and ``k`` themselves if inplace).
    """
    args = check_rope_args(q, k, cos, sin, layout=layout, rotary_dim=rotary_dim, positions=positions,
                           offset=offset, inplace=inplace)
    c, s = _gather_rows(cos, sin, args.rows, q.shape[2])
    return (_rotate(q, c, s, args.layout, args.rotary_dim, args.inplace),
            _rotate(k, c, s, args.layout, args.rotary_dim, args.inplace))


# ----------------------------------------------------------------------------- the scheme


def _parse_rope_config(rope_config: Mapping[str, Any], head_dim: int, rotary_dim: int | None,
                       max_position_embeddings: int | None):  # -> companion.scaling.RopeSpec
    """Parse a scaling config for a scheme whose ``rotary_dim`` may be given (or ``None``)."""
    from .scaling import parse_rope_config

    fraction = 1.0 if rotary_dim is None or rotary_dim == head_dim else rotary_dim / head_dim
    spec = parse_rope_config(rope_config, head_dim, max_position_embeddings=max_position_embeddings,
                             partial_rotary_factor=fraction)
    if rotary_dim is not None and spec.dim != rotary_dim:
        raise ValueError(
            f"rotary_dim={rotary_dim} disagrees with the config's rotary dimension {spec.dim} "
            f"(int(head_dim * partial_rotary_factor)); pass one of them"
        )
    return spec


class RotaryEmbedding(PositionScheme):
    """RoPE as a position scheme: the ``rotate`` hook, with a cos/sin cache that grows on demand.

    ``rotate(q, k, q_pos, k_pos)`` rotates queries at ``q_pos`` and keys at ``k_pos`` (int64,
    ``(seq,)`` or ``(batch, seq)``) with :func:`rope_rotate`, reading rows of a compact float32
    table. The table covers positions ``0 .. L-1`` and doubles when a larger position arrives,
    up to ``max_cached_positions``; beyond that (or for negative positions) rows are computed
    directly, with the same arithmetic, so the result never depends on the cache.

    Precision follows the input: float32, float16 and bfloat16 activations get float32 tables
    (HuggingFace's arithmetic, bit for bit), float64 activations get float64 tables computed
    from float64 frequencies (``base ** (-2 i / r)`` in float64; custom ``inv_freq`` at its own
    precision), not cached. ``compute_dtype`` fixes the dtype of the angles instead.

    Args:
        head_dim: per-head dimension of q and k.
        rotary_dim: rotated dimensions (even, ``<= head_dim``; default ``head_dim``). GPT-NeoX
            uses ``int(head_dim * rotary_pct)``; its frequencies use ``rotary_dim``.
        base: RoPE base, used when ``inv_freq`` is None.
        inv_freq: precomputed inverse frequencies ``(rotary_dim // 2,)``, overriding ``base``
            (what a scaling method such as YaRN or Llama-3 produces).
        attention_scaling: factor multiplying both tables (HuggingFace's ``attention_scaling``,
            YaRN's attention factor); 1 for plain RoPE.
        rope_config: a context-extension config instead of ``base``/``inv_freq``: a
            HuggingFace ``rope_parameters`` or ``rope_scaling`` dict (``{"rope_type": "yarn",
            "rope_theta": 10000, "factor": 4, ...}``), computed by
            :func:`companion.scaling.compute_inv_freq`, attention factor included. Dynamic
            types follow the length of each call as HuggingFace's forward pass does:
            ``dynamic`` recomputes the base when ``max(position) + 1`` exceeds the longest
            length seen so far, and returns to the original frequencies when it drops below
            ``max_position_embeddings``; ``longrope`` takes its long factors when
            ``max(position) + 1`` exceeds ``original_max_position_embeddings``, its short ones
            otherwise. A partial ``rotary_dim`` is ``partial_rotary_factor`` there.
        max_position_embeddings: the model's ``max_position_embeddings``, for ``rope_config``
            (dynamic NTK's reference length, and the default of
            ``original_max_position_embeddings``).
        layout: ``"half"`` or ``"interleaved"``.
        compute_dtype: the dtype of the angles, ``torch.float32`` or ``torch.float64``; the
            default ``None`` means the wider of float32 and the activations' dtype.
        max_cached_positions: the cache never grows past this many rows.
        device: where to build the buffers.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        rotary_dim: int | None = None,
        base: float = 10000.0,
        inv_freq: Tensor | None = None,
        attention_scaling: float = 1.0,
        layout: str = "half",
        compute_dtype: torch.dtype | None = None,
        max_cached_positions: int = 1 << 16,
        device: torch.device | str | None = None,
        rope_config: Mapping[str, Any] | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(head_dim, "head_dim", minimum=2)
        self.head_dim = head_dim
        self.rope_spec = None
        if rope_config is not None:
            if inv_freq is not None or attention_scaling != 1.0:
                raise ValueError("pass rope_config, or inv_freq and attention_scaling, not both")
            check_rotary_dim(rotary_dim, head_dim)
            self.rope_spec = _parse_rope_config(rope_config, head_dim, rotary_dim, max_position_embeddings)
            rotary_dim = self.rope_spec.dim
        elif max_position_embeddings is not None:
            raise ValueError("max_position_embeddings is read only with a rope_config")
        self.rotary_dim = check_rotary_dim(rotary_dim, head_dim)
        self.layout = check_layout(layout)
        self.compute_dtype = None if compute_dtype is None else _check_table_dtype(compute_dtype, "compute_dtype")
        self.max_cached_positions = check_positive_int(max_cached_positions, "max_cached_positions", 0)
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("cos_cached", torch.empty(0, self.rotary_dim // 2), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0, self.rotary_dim // 2), persistent=False)
        if self.rope_spec is not None:
            self._apply_spec(device)
            return
        base_given = inv_freq is None
        if base_given:
            inv_freq = rope_frequencies(self.rotary_dim, base, device=device)
        self.set_frequencies(inv_freq, attention_scaling)  # type: ignore[arg-type]
        #: the base the frequencies come from, or None for custom ``inv_freq``
        self.base: float | None = float(base) if base_given else None

    def _apply_spec(self, device: torch.device | str | None = None) -> None:
        from .scaling import spec_inv_freq

        spec = self.rope_spec
        inv_freq, factor = spec_inv_freq(spec)
        if device is not None:
            inv_freq = inv_freq.to(check_device(device))
        self.set_frequencies(inv_freq, factor)
        self._original_inv_freq = self.inv_freq
        # HuggingFace's dynamic_rope_update state: the longest length the frequencies are for
        self._seq_len_cached = spec.max_position_embeddings
        self._long_inv_freq: Tensor | None = None
        # Plain RoPE from a config keeps its base, so float64 tables recompute it in float64.
        self.base = spec.theta if spec.rope_type == "default" else None

    @property
    def rope_config(self) -> dict[str, Any] | None:
        """The normalised config this scheme was built from (a copy), or ``None``."""
        return None if self.rope_spec is None else copy.deepcopy(self.rope_spec.params)

    def set_rope_config(self, rope_config: Mapping[str, Any] | None, max_position_embeddings: int | None = None) -> None:
        """Rebuild the frequencies and tables from a (new) scaling config; see the class doc.

        The tables are computed when a config is applied; editing the dict afterwards (or the
        one :attr:`rope_config` returns) changes nothing until this is called. ``None`` goes
        back to plain RoPE with the current base, if known.
        """
        if rope_config is None:
            theta = self.rope_spec.theta if self.rope_spec is not None else self.base
            if theta is None:
                raise ValueError("rope_config=None needs a known base; this scheme has custom frequencies")
            rope_config = {"rope_type": "default", "rope_theta": theta}
        self.rope_spec = _parse_rope_config(rope_config, self.head_dim, self.rotary_dim, max_position_embeddings)
        self._apply_spec(self.inv_freq.device)

    def _follow_length(self, seq_len: int) -> None:
        """Dynamic types: update the frequencies for a call that reaches ``seq_len`` (HF's rule)."""
        spec = self.rope_spec
        from .scaling import spec_inv_freq

        if spec.rope_type == "dynamic":
            original = spec.max_position_embeddings
            if seq_len > self._seq_len_cached:  # growth: the base for this length
                inv_freq, factor = spec_inv_freq(spec, torch.tensor(seq_len))
                self.set_frequencies(inv_freq.to(self.inv_freq.device), factor)
                self._seq_len_cached = seq_len
            elif seq_len < original and self._seq_len_cached > original:  # back to the original
                self.set_frequencies(self._original_inv_freq, self.attention_scaling)
                self._seq_len_cached = original
        elif spec.rope_type == "longrope":
            long = seq_len > spec.params["original_max_position_embeddings"]
            if long and self._long_inv_freq is None:
                inv_freq, _ = spec_inv_freq(spec, spec.params["original_max_position_embeddings"] + 1)
                self._long_inv_freq = inv_freq.to(self.inv_freq.device)
            wanted = self._long_inv_freq if long else self._original_inv_freq
            if wanted is not self.inv_freq:
                self.set_frequencies(wanted, self.attention_scaling)

    def set_frequencies(self, inv_freq: Tensor, attention_scaling: float = 1.0) -> None:
        """Replace the inverse frequencies and scaling factor, and empty the cache.

        For scaling methods that change the frequencies at run time (dynamic NTK). The
        frequencies are then custom: float64 tables use them as given (see the class doc).
        """
        h = self.rotary_dim // 2
        check_inv_freq(inv_freq, h)
        attention_scaling = check_finite_number(attention_scaling, "attention_scaling")
        self.base = None
        device = self.inv_freq.device if self.inv_freq.numel() else inv_freq.device
        inv_freq = inv_freq.detach()
        self.inv_freq = inv_freq if inv_freq.device == device else inv_freq.to(device)
        self.attention_scaling = float(attention_scaling)
        self.cos_cached = torch.empty(0, h, device=device)
        self.sin_cached = torch.empty(0, h, device=device)

    @property
    def cached_positions(self) -> int:
        """Number of rows (positions ``0 .. n-1``) currently in the cache."""
        return self.cos_cached.shape[0]

    def _tables(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """Tables in ``dtype`` (float32 or float64), from angles in ``compute_dtype`` or ``dtype``."""
        angles = self.compute_dtype or dtype
        inv_freq = self.inv_freq
        if angles == dtype == torch.float64 and self.base is not None:
            inv_freq = rope_frequencies(self.rotary_dim, self.base, inv_freq.device, dtype=torch.float64)
        cos, sin = rope_cos_sin(positions, inv_freq, attention_scaling=self.attention_scaling,
                                compute_dtype=angles)
        return cos.to(dtype), sin.to(dtype)

    def _grow(self, length: int) -> None:
        if length <= self.cached_positions:
            return
        new = min(max(length, 2 * self.cached_positions, 256), self.max_cached_positions)
        cos, sin = self._tables(torch.arange(new, device=self.inv_freq.device))
        self.cos_cached, self.sin_cached = cos, sin

    def cos_sin(
        self, positions: Tensor | Sequence[int] | int, *, dtype: torch.dtype = torch.float32,
    ) -> tuple[Tensor, Tensor]:
        """Compact tables for integer ``positions`` (any shape): shape ``positions.shape + (r // 2,)``.

        An int ``n`` means positions ``0 .. n-1``, which gives a 2-D table for
        :func:`apply_rope`'s ``positions``/``offset`` arguments. float32 rows come from the
        cache, which grows on demand; ``dtype=torch.float64`` computes float64 rows (what
        :meth:`rotate` uses for float64 activations).
        """
        dtype = _check_table_dtype(dtype, "dtype")
        pos = _table_positions(positions).to(self.inv_freq.device)
        if pos.numel() == 0:
            empty = torch.empty(*pos.shape, self.rotary_dim // 2, dtype=dtype, device=pos.device)
            return empty, empty.clone()
        lo, hi = int(pos.min()), int(pos.max())
        if dtype == torch.float64 or lo < 0 or hi >= self.max_cached_positions:
            return self._tables(pos, dtype)
        self._grow(hi + 1)
        return self.cos_cached[pos], self.sin_cached[pos]

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate ``q`` at ``q_pos`` and ``k`` at ``k_pos``; positions ``(seq,)`` or ``(batch, seq)``.

        float64 ``q`` or ``k`` are rotated with float64 tables (see the class doc)."""
        check_qk_head_dim(q, k, self.head_dim)
        check_scheme_device(q, "q", self.inv_freq, type(self).__name__)
        check_scheme_device(k, "k", self.inv_freq, type(self).__name__)
        q_pos = as_positions(q_pos, "q_pos", q.shape[2], q.shape[0], q.device)
        k_pos = as_positions(k_pos, "k_pos", k.shape[2], k.shape[0], k.device)
        if self.rope_spec is not None and self.rope_spec.is_dynamic:
            reach = [int(p.max()) + 1 for p in (q_pos, k_pos) if p.numel()]
            if reach:
                self._follow_length(max(reach))
        kw = dict(layout=self.layout, rotary_dim=self.rotary_dim)
        dtype = torch.float64 if torch.float64 in (q.dtype, k.dtype) else torch.float32
        # (seq,) positions give (seq, r/2) rows, read by rope_rotate as a table from row 0;
        # (batch, seq) positions give gathered (batch, seq, r/2) rows.
        cq, sq = self.cos_sin(q_pos, dtype=dtype)
        q = rope_rotate(q, cq, sq, **kw)  # type: ignore[arg-type]
        if k_pos is q_pos or (k_pos.shape == q_pos.shape and torch.equal(k_pos, q_pos)):
            ck, sk = cq, sq
        else:
            ck, sk = self.cos_sin(k_pos, dtype=dtype)
        k = rope_rotate(k, ck, sk, **kw)  # type: ignore[arg-type]
        return q, k

    def extra_repr(self) -> str:
        freq = f"base={self.base:g}" if self.base is not None else "inv_freq=custom"
        if self.rope_spec is not None and self.rope_spec.rope_type != "default":
            freq = f"rope_type={self.rope_spec.rope_type!r}, base={self.rope_spec.theta:g}"
        extra = f", attention_scaling={self.attention_scaling:g}" if self.attention_scaling != 1.0 else ""
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, {freq}{extra}, "
            f"layout={self.layout!r}, cached_positions={self.cached_positions}"
        )


# ----------------------------------------------------------------------------- positions, layouts


def positions_from_mask(attention_mask: Tensor, pad_position: int = 1) -> Tensor:
    """Per-row positions for a padded batch: ``cumsum(mask) - 1``, pads set to ``pad_position``.

    The HuggingFace convention for batched generation with left padding: the first real token
    of every row gets position 0 however much padding precedes it. Pad slots are masked out of
    attention anyway; HuggingFace fills them with 1, the default here.

    Args:
        attention_mask: ``(batch, seq)``, 1/True for real tokens, 0/False for padding.
        pad_position: the position given to pad slots (>= 0).

    Returns:
        int64 positions ``(batch, seq)``.
    """
    check_tensor(attention_mask, "attention_mask", 2)
    check_has_data(attention_mask, "attention_mask")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise TypeError(f"attention_mask must be bool or integer, got dtype {attention_mask.dtype}")
    m = attention_mask.long()
    if m.numel() and not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("attention_mask must hold only 0/1 (or False/True)")
    check_positive_int(pad_position, "pad_position", minimum=0)
    pos = m.cumsum(-1) - 1
    return pos.masked_fill(m == 0, pad_position)


def layout_permutation(head_dim: int, src: str, dst: str, rotary_dim: int | None = None) -> Tensor:
    """Index ``perm`` with ``x_dst = x_src[..., perm]`` for one head of ``head_dim`` dims.

    Interleaved to half: ``perm = [0, 2, 4, .., r-2, 1, 3, .., r-1]`` followed by the
    pass-through dims ``r .. head_dim-1``; half to interleaved is its inverse
    ``[0, h, 1, h+1, ..]``. Rotating in one layout and converting equals converting and
    rotating in the other (the permutation conjugates one rotation into the other).
    """
    check_positive_int(head_dim, "head_dim", minimum=2)
    src, dst = check_layout(src, "src"), check_layout(dst, "dst")
    r = check_rotary_dim(rotary_dim, head_dim)
    idx = torch.arange(head_dim)
    if src == dst:
        return idx
    to_half = torch.cat((idx[0:r:2], idx[1:r:2], idx[r:]))
    if dst == "half":
        return to_half
    return torch.argsort(to_half)


def convert_layout(x: Tensor, src: str, dst: str, rotary_dim: int | None = None) -> Tensor:
    """Re-order the last dimension of ``x`` (per head) from layout ``src`` to ``dst``."""
    perm = layout_permutation(_last_dim(x), src, dst, rotary_dim).to(x.device)
    return x[..., perm]


def convert_qk_weight(weight: Tensor, n_heads: int, src: str, dst: str, rotary_dim: int | None = None) -> Tensor:
    """Permute the rows of a q or k projection so a model runs in the other RoPE layout.

    ``weight`` is an ``nn.Linear`` weight ``(n_heads * head_dim, d_in)`` or a bias
    ``(n_heads * head_dim,)``. The rows of each head are re-ordered by
    :func:`layout_permutation`; a model whose ``W_q`` and ``W_k`` are converted computes the
    same attention scores with the ``dst`` rotation as the original with the ``src`` one.
    Converting Meta's interleaved Llama checkpoints to HuggingFace's half layout is the case
    ``src="interleaved", dst="half"``. Values (``W_v``) and the output projection are unchanged.
    """
    check_tensor(weight, "weight")
    check_positive_int(n_heads, "n_heads")
    if weight.dim() not in (1, 2):
        raise ValueError(f"weight must be 1-D (bias) or 2-D (n_heads * head_dim, d_in), got {tuple(weight.shape)}")
    rows = weight.shape[0]
    if rows % n_heads:
        raise ValueError(f"weight has {rows} rows, not a multiple of n_heads ({n_heads})")
    head_dim = rows // n_heads
    perm = layout_permutation(head_dim, src, dst, rotary_dim).to(weight.device)
    w = weight.reshape(n_heads, head_dim, *weight.shape[1:])
    return w[:, perm].reshape(weight.shape)
