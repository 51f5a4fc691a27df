"""Relative position encodings: Shaw et al., Transformer-XL and T5's bucketed bias.

All three make attention depend on the *offset* between a query and a key instead of on
their absolute positions, but they put that offset into attention in different places of
the four-hook design (:mod:`companion.attention`):

==========================  ==========  =====================================================
scheme                      hook        what the offset changes
==========================  ==========  =====================================================
:class:`ShawRelative`       ``score``   a learned key vector ``a^K`` per clipped offset (in the
                                        logits) and a learned value vector ``a^V`` (in the
                                        output, through ``score_values``)
:class:`TransformerXL`      ``score``   a sinusoidal table ``R`` of offsets, projected, plus
                                        two global biases ``u`` and ``v``
:class:`T5RelativeBias`     ``bias``    one learned scalar per (bucket, head); buckets are
                                        exact for small offsets and logarithmic beyond
==========================  ==========  =====================================================

Sign conventions (both are the originals'):

* Shaw and T5 use ``relative_position = key_position - query_position`` ("memory minus
  query"): a key in the past has a negative relative position.
* Transformer-XL indexes its table by the *distance* ``query_position - key_position``,
  non-negative for the past.

Positions are integer tensors ``(seq,)`` (shared by the batch) or ``(batch, seq)`` (per row).

The efficient Shaw form never builds an ``(q_len, k_len, head_dim)`` tensor: it computes
``q @ table^T`` into ``(..., q_len, 2k+1)`` and gathers, and for the values it sums the
attention weights per clipped offset (``(..., q_len, 2k+1)``) before one small matmul.
:func:`shaw_score_naive` and :func:`shaw_values_naive` build the big tensor, for proofs and
for the memory comparison in chapter 4.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ._checks import (
    check_bool,
    check_finite_number,
    check_float_dtype,
    check_int_tensor,
    check_position_pair,
    check_positive_int,
    check_tensor,
    contiguous_start,
)
from .attention import PositionScheme

__all__ = [
    "relative_positions",
    "shaw_relative_index",
    "shaw_score",
    "shaw_values",
    "shaw_score_naive",
    "shaw_values_naive",
    "ShawRelative",
    "sinusoidal_relative_table",
    "rel_shift",
    "transformer_xl_score",
    "TransformerXL",
    "t5_relative_position_bucket",
    "T5RelativeBias",
]

def relative_positions(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``k_pos[j] - q_pos[i]``: the key's position relative to the query ("memory minus query").

    Returns ``(q_len, k_len)`` for 1-D positions, ``(batch, q_len, k_len)`` if either is per
    row. A key in the query's past gets a negative value (the convention of Shaw et al.
    :cite:`shaw2018self` and of T5 :cite:`raffel2020exploring`).
    """
    q_pos, k_pos = check_position_pair(q_pos, k_pos)
    return k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)


def _check_index(index: object, target: Tensor, rows: int, k_len: int | None = None) -> Tensor:
    """Validate a table-row index for ``target`` ``(batch, heads, q_len, ...)``: an integer
    ``(q_len, k_len)`` or ``(batch, q_len, k_len)`` tensor with values in ``[0, rows)``
    (``k_len`` checked when given). Returns it as int64 on ``target``'s device, so that no
    bad index reaches ``gather``, ``scatter_add`` or table indexing (where a negative one
    would silently wrap around)."""
    index = check_int_tensor(index, "index", what="table rows")
    b, _, lq = target.shape[:3]
    want = f"(q_len, k_len) or (batch, q_len, k_len) with batch = {b}, q_len = {lq}" + (
        "" if k_len is None else f", k_len = {k_len}")
    ok = index.dim() in (2, 3) and index.shape[-2] == lq and (k_len is None or index.shape[-1] == k_len)
    if ok and index.dim() == 3:
        ok = index.shape[0] == b
    if not ok:
        raise ValueError(f"index must have shape {want}, got {tuple(index.shape)}")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows):
        raise IndexError(
            f"index must hold table rows in [0, {rows}) (the table has {rows} rows), got "
            f"values in [{int(index.min())}, {int(index.max())}]"
        )
    return index.to(target.device)


def _expand_index(index: Tensor, target: Tensor) -> Tensor:
    """View a validated ``(q, k)`` or ``(b, q, k)`` index as ``(b, h, q, k)`` without copying."""
    b, h = target.shape[0], target.shape[1]
    if index.dim() == 2:
        return index.expand(b, h, *index.shape)
    return index.unsqueeze(1).expand(b, h, *index.shape[1:])


# ============================================================================ Shaw et al. 2018


def shaw_relative_index(q_pos: Tensor, k_pos: Tensor, max_distance: int) -> Tensor:
    """Row of the Shaw table for each (query, key): ``clip(k_pos - q_pos, -K, K) + K``.

    ``K = max_distance``; the table has ``2K + 1`` rows, row ``K`` is offset 0, row 0 is
    "``K`` or more tokens in the past" (Shaw et al. :cite:`shaw2018self`, eq. 7).
    Returns int64 ``(q_len, k_len)`` or ``(batch, q_len, k_len)``.
    """
    check_positive_int(max_distance, "max_distance")
    return relative_positions(q_pos, k_pos).clamp(-max_distance, max_distance) + max_distance


def _check_table(table: Tensor, name: str, x: Tensor, width: int | None, what: str) -> None:
    """A Shaw table is floating, ``(2K+1, width)`` or ``(heads, 2K+1, width)`` with the heads
    of ``x`` ``(batch, heads, ...)``; ``width=None`` accepts any width."""
    check_tensor(table, name)
    if table.dim() not in (2, 3) or table.shape[-1] != (width or table.shape[-1]):
        need = "" if width is None else f" with {what} {width}"
        raise ValueError(
            f"{name} must have shape (2K+1, {what}) or (heads, 2K+1, {what}){need}, got {tuple(table.shape)}"
        )
    if not table.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {table.dtype}")
    if table.dim() == 3 and table.shape[0] != x.shape[1]:
        raise ValueError(f"{name} has {table.shape[0]} heads, the queries have {x.shape[1]}")


def _shaw_inputs(x: Tensor, x_name: str, table: Tensor, t_name: str, index: Tensor,
                 values: bool) -> Tensor:
    """Validate the inputs of the Shaw terms; return the index."""
    check_tensor(x, x_name, 4)
    if not x.is_floating_point():
        raise TypeError(f"{x_name} must be a floating-point tensor, got dtype {x.dtype}")
    if values:
        _check_table(table, t_name, x, None, "v_dim")
        return _check_index(index, x, table.shape[-2], k_len=x.shape[-1])
    _check_table(table, t_name, x, x.shape[-1], "head_dim")
    return _check_index(index, x, table.shape[-2])


def shaw_score(q: Tensor, table_k: Tensor, index: Tensor) -> Tensor:
    """Shaw's logit term ``q_i . a^K[index_ij]`` without an ``(L, L, d)`` tensor.

    Computes ``s = q @ table_k^T`` of shape ``(batch, heads, q_len, 2K+1)`` (one dot product
    per query and clipped offset), then gathers ``s[..., i, index_ij]``. Memory is
    ``O(batch * heads * q_len * (2K+1))`` plus the output, instead of
    ``O(q_len * k_len * head_dim)`` (Shaw et al. :cite:`shaw2018self`, section 3.3).

    Args:
        q: queries ``(batch, heads, q_len, head_dim)``.
        table_k: ``(2K+1, head_dim)`` shared by the heads (the paper), or
            ``(heads, 2K+1, head_dim)``.
        index: table rows from :func:`shaw_relative_index`, ``(q_len, k_len)`` or
            ``(batch, q_len, k_len)``, integers in ``[0, 2K+1)``; its ``q_len`` must be
            ``q``'s.

    Returns:
        ``(batch, heads, q_len, k_len)``, to be added to ``q k^T`` before the scale.

    Raises:
        TypeError: a non-integer ``index``.
        ValueError: shapes that do not fit.
        IndexError: an index outside the table.
    """
    index = _shaw_inputs(q, "q", table_k, "table_k", index, values=False)
    per_offset = q @ table_k.to(q.dtype).transpose(-1, -2)  # (b, h, q_len, 2K+1)
    return per_offset.gather(-1, _expand_index(index, q))


def shaw_values(weights: Tensor, table_v: Tensor, index: Tensor) -> Tensor:
    """Shaw's value term ``sum_j w_ij a^V[index_ij]`` without an ``(L, L, d)`` tensor.

    Regroups the sum by table row: ``sum_c (sum_{j: index_ij = c} w_ij) a^V_c``. The inner
    sums are one ``scatter_add`` into ``(batch, heads, q_len, 2K+1)``, followed by a matmul
    with the ``(2K+1, d)`` table.

    Args:
        weights: attention weights ``(batch, heads, q_len, k_len)``.
        table_v: ``(2K+1, v_dim)`` or ``(heads, 2K+1, v_dim)``; ``v_dim`` need not equal
            the query head dim.
        index: as in :func:`shaw_score`, with exactly ``weights``' ``(q_len, k_len)``.

    Returns:
        ``(batch, heads, q_len, v_dim)``, added to ``weights @ v``.
    """
    index = _shaw_inputs(weights, "weights", table_v, "table_v", index, values=True)
    rows = table_v.shape[-2]
    b, h, lq, _ = weights.shape
    per_offset = weights.new_zeros(b, h, lq, rows).scatter_add_(-1, _expand_index(index, weights), weights)
    return per_offset @ table_v.to(weights.dtype)


def _gathered(table: Tensor, index: Tensor) -> tuple[Tensor, str]:
    """``table[index]`` as a big tensor, and its einsum subscripts (for the naive forms)."""
    if table.dim() == 2:
        big = table[index]  # (q, k, d) or (b, q, k, d)
        return big, ("ijd" if index.dim() == 2 else "bijd")
    big = table[:, index]  # (h, q, k, d) or (h, b, q, k, d)
    return big, ("hijd" if index.dim() == 2 else "hbijd")


def shaw_score_naive(q: Tensor, table_k: Tensor, index: Tensor) -> Tensor:
    """Reference for :func:`shaw_score`: materialises ``a^K_ij`` as ``(q_len, k_len, d)``."""
    index = _shaw_inputs(q, "q", table_k, "table_k", index, values=False)
    big, sub = _gathered(table_k.to(q.dtype), index)
    return torch.einsum(f"bhid,{sub}->bhij", q, big)


def shaw_values_naive(weights: Tensor, table_v: Tensor, index: Tensor) -> Tensor:
    """Reference for :func:`shaw_values`: materialises ``a^V_ij`` as ``(q_len, k_len, d)``."""
    index = _shaw_inputs(weights, "weights", table_v, "table_v", index, values=True)
    big, sub = _gathered(table_v.to(weights.dtype), index)
    return torch.einsum(f"bhij,{sub}->bhid", weights, big)


class ShawRelative(PositionScheme):
    """Shaw et al. relative position representations :cite:`shaw2018self` (``score`` hook).

    ``e_ij = q_i . (k_j + a^K_ij) / sqrt(d)`` and ``z_i = sum_j w_ij (v_j + a^V_ij)``, with
    ``a^K_ij = table_k[clip(j - i, -K, K) + K]`` and likewise ``a^V``: ``2K + 1`` learned
    vectors each, shared by all heads of a layer, as in the paper.

    Args:
        head_dim: query/key head dimension.
        max_distance: the clipping distance ``K`` (>= 1); offsets beyond share a vector.
        naive: use the ``(L, L, d)`` reference forms (for tests and memory comparisons).
        init_std: standard deviation of the normal initialisation of both tables, a finite
            number >= 0.
        v_dim: value head dimension (default ``head_dim``); :func:`~companion.attention.attention`
            allows values of another width than queries and keys.

    Attributes:
        table_k: ``nn.Parameter`` ``(2K+1, head_dim)``; table_v: ``(2K+1, v_dim)``. Row
        ``K + r`` holds the vector for relative position ``r = key - query``.
    """

    def __init__(self, head_dim: int, max_distance: int = 16, *, naive: bool = False,
                 init_std: float = 0.02, v_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.max_distance = check_positive_int(max_distance, "max_distance")
        self.v_dim = head_dim if v_dim is None else check_positive_int(v_dim, "v_dim")
        self.naive = check_bool(naive, "naive")
        init_std = check_finite_number(init_std, "init_std", minimum=0)
        rows = 2 * max_distance + 1
        self.table_k = nn.Parameter(torch.randn(rows, head_dim) * init_std)
        self.table_v = nn.Parameter(torch.randn(rows, self.v_dim) * init_std)

    def _index(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return shaw_relative_index(q_pos, k_pos, self.max_distance)

    def score(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``q_i . a^K_ij`` as ``(batch, heads, q_len, k_len)``."""
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"q head_dim {q.shape[-1]} must equal the scheme's head_dim {self.head_dim}")
        fn = shaw_score_naive if self.naive else shaw_score
        return fn(q, self.table_k, self._index(q_pos, k_pos))

    def score_values(self, weights: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``sum_j w_ij a^V_ij`` as ``(batch, heads, q_len, v_dim)``."""
        fn = shaw_values_naive if self.naive else shaw_values
        return fn(weights, self.table_v, self._index(q_pos, k_pos))

    def extra_repr(self) -> str:
        v_dim = "" if self.v_dim == self.head_dim else f"v_dim={self.v_dim}, "
        return (f"head_dim={self.head_dim}, max_distance={self.max_distance}, {v_dim}"
                f"naive={self.naive}, " + super().extra_repr())


# ============================================================================ Transformer-XL


def sinusoidal_relative_table(
    distances: Tensor | Sequence[int], dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Transformer-XL's sinusoid table ``R``: row ``n`` is ``[sin(d_n w) | cos(d_n w)]``.

    ``w_k = base^(-2k/dim)`` for ``k = 0 .. dim/2 - 1``; the sines fill the first half of
    the row and the cosines the second (Dai et al. :cite:`dai2019transformerxl`, the layout
    of the authors' ``PositionalEmbedding``). Angles are computed in float64 and the result
    cast to ``dtype``. Returns ``(len(distances), dim)``.

    ``distances`` is a 1-D integer tensor (or list of ints), ``dim`` a positive even int,
    ``base`` a finite number > 1 and ``dtype`` a floating dtype.
    """
    check_positive_int(dim, "dim")
    if dim % 2:
        raise ValueError(f"dim must be even (sines and cosines come in pairs), got {dim}")
    base = check_finite_number(base, "base", above=1)
    check_float_dtype(dtype)
    d = check_int_tensor(distances, "distances", dims=(1,), what="distances")
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = d.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(dtype)


def rel_shift(x: Tensor) -> Tensor:
    """Transformer-XL's relative shift of the last two axes, by a pad-and-reshape.

    For ``x`` of shape ``(..., q, W)`` it returns ``y`` of the same shape with
    ``y[..., i, j] = x[..., i, j + q - 1 - i]`` wherever ``j <= W - q + i``: row ``i`` is
    shifted left by ``q - 1 - i``. It pads one zero column on the left, reinterprets the
    ``q * (W + 1)`` numbers as ``(W + 1, q)``, drops the first ``q`` of them and reads the
    rest as ``(q, W)`` (one copy, no index tensor). Entries with ``j > W - q + i`` are
    spill-over from row ``i + 1`` (or the zero pad); Transformer-XL masks them causally.
    Proof and exhaustive check: chapter 4.
    """
    check_tensor(x, "x")
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dimensions (..., q_len, width), got shape {tuple(x.shape)}")
    *lead, q, w = x.shape
    padded = torch.cat([x.new_zeros(*lead, q, 1), x], dim=-1)  # (..., q, W + 1)
    return padded.view(*lead, w + 1, q)[..., 1:, :].reshape(*lead, q, w)


def transformer_xl_score(
    q: Tensor, k: Tensor, r: Tensor, u: Tensor, v: Tensor, *, mem_len: int | None = None
) -> Tensor:
    """Transformer-XL's position terms (b) + (c) + (d), with the ``rel_shift`` trick.

    With ``A_ij = q_i.k_j + q_i.r_{i-j} + u.k_j + v.r_{i-j}`` (Dai et al.
    :cite:`dai2019transformerxl`, eq. 3 after the projections), this returns the last three
    terms; the attention adds ``q_i.k_j``. Queries are the last ``q_len`` of the
    ``k_len = mem_len + q_len`` keys (a memory of ``mem_len`` cached keys precedes them).

    Args:
        q: queries ``(batch, heads, q_len, d)``.
        k: keys ``(batch, heads, k_len, d)``, memory first.
        r: projected relative embeddings ``(heads, k_len, d)`` for the distances
            ``k_len - 1, k_len - 2, ..., 0`` in that (descending) order, as in the paper's
            code.
        u, v: the global content and position biases, ``(heads, d)``.
        mem_len: memory length; ``None`` means no memory, and then ``k_len`` must equal
            ``q_len``.

    Returns:
        ``(batch, heads, q_len, k_len)``; entries for future keys (``j > i + mem_len``),
        which a causal mask removes, are 0.
    """
    check_tensor(q, "q", 4)
    check_tensor(k, "k", 4)
    for name, t in (("r", r), ("u", u), ("v", v)):
        check_tensor(t, name)
    if not (q.is_floating_point() and k.dtype == q.dtype):
        raise ValueError(f"q and k must share a floating dtype, got {q.dtype} and {k.dtype}")
    if k.shape[0] != q.shape[0] or k.shape[1] != q.shape[1] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k must have q's batch, heads and head_dim {(q.shape[0], q.shape[1], q.shape[-1])}, "
            f"got shape {tuple(k.shape)}"
        )
    lq, lk = q.shape[-2], k.shape[-2]
    if mem_len is None:
        if lk != lq:
            raise ValueError(
                f"k_len ({lk}) must equal q_len ({lq}) when mem_len is not given; for a "
                f"Transformer-XL memory pass mem_len = k_len - q_len = {lk - lq}"
            )
        mem_len = 0
    if isinstance(mem_len, bool) or not isinstance(mem_len, int) or mem_len < 0:
        raise ValueError(f"mem_len must be a non-negative int, got {mem_len!r}")
    if lk != lq + mem_len:
        raise ValueError(f"k_len ({lk}) must equal q_len + mem_len = {lq} + {mem_len}")
    h, d = q.shape[1], q.shape[-1]
    if r.shape != (h, lk, d):
        raise ValueError(f"r must have shape (heads, k_len, head_dim) = {(h, lk, d)}, got {tuple(r.shape)}")
    if u.shape != (h, d) or v.shape != (h, d):
        raise ValueError(f"u and v must have shape (heads, head_dim) = {(h, d)}, got {tuple(u.shape)}, {tuple(v.shape)}")
    position = rel_shift((q + v.to(q.dtype)[:, None]) @ r.to(q.dtype).transpose(-1, -2))
    future = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(mem_len + 1)
    position = position.masked_fill(future, 0.0)
    content_bias = (k @ u.to(k.dtype)[..., None]).transpose(-1, -2)  # (b, h, 1, k_len)
    return position + content_bias


class TransformerXL(PositionScheme):
    """Transformer-XL relative attention :cite:`dai2019transformerxl` (``score`` hook).

    Adds ``q_i . W_R R_{i-j} + u . k_j + v . W_R R_{i-j}`` to ``q_i . k_j``, where
    ``R`` is :func:`sinusoidal_relative_table` of the distance ``i - j`` (query minus key
    position), ``W_R`` a learned projection and ``u, v`` learned per-head vectors. Works with
    a memory: pass keys for ``mem_len + q_len`` positions and queries for the last ``q_len``
    (the reference attention's default positions do exactly that). Use ``causal=True``:
    with ``bidirectional=False`` (the original) distances below 0 have no embedding, and the
    score is 0 there. ``bidirectional=True`` embeds negative distances as well (as XLNet).

    For contiguous 1-D positions it uses :func:`rel_shift`; for anything else (per-row or
    gapped positions) an equivalent gather.

    Args:
        num_heads: heads.
        head_dim: head dimension.
        d_r: width of the sinusoid table (even; default ``num_heads * head_dim``).
        base: sinusoid base (10000 in the paper), a finite number > 1.
        bidirectional: embed negative distances too.
        init_std: standard deviation of the initial ``u`` and ``v``, a finite number >= 0.

    Attributes:
        u: ``(num_heads, head_dim)`` parameter, the global content bias.
        v: ``(num_heads, head_dim)`` parameter, the global position bias.
        r_proj: ``nn.Linear(d_r, num_heads * head_dim, bias=False)``, the paper's ``W_{k,R}``.
    """

    def __init__(self, num_heads: int, head_dim: int, d_r: int | None = None, *,
                 base: float = 10000.0, bidirectional: bool = False, init_std: float = 0.02) -> None:
        super().__init__()
        self.num_heads = check_positive_int(num_heads, "num_heads")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.d_r = num_heads * head_dim if d_r is None else check_positive_int(d_r, "d_r")
        if self.d_r % 2:
            raise ValueError(f"d_r must be even, got {self.d_r}")
        self.base = check_finite_number(base, "base", above=1)
        self.bidirectional = check_bool(bidirectional, "bidirectional")
        init_std = check_finite_number(init_std, "init_std", minimum=0)
        self.u = nn.Parameter(torch.randn(num_heads, head_dim) * init_std)
        self.v = nn.Parameter(torch.randn(num_heads, head_dim) * init_std)
        self.r_proj = nn.Linear(self.d_r, num_heads * head_dim, bias=False)

    def relative_keys(self, distances: Tensor) -> Tensor:
        """``W_R R_d`` for each distance: ``(num_heads, len(distances), head_dim)``."""
        table = sinusoidal_relative_table(distances, self.d_r, self.base, dtype=self.r_proj.weight.dtype)
        return self.r_proj(table).view(-1, self.num_heads, self.head_dim).transpose(0, 1)

    def scheme_heads(self) -> int:
        """``num_heads``: ``u``, ``v`` and the projection are per head."""
        return self.num_heads

    def _check(self, q: Tensor) -> None:
        if q.shape[1] != self.num_heads or q.shape[-1] != self.head_dim:
            raise ValueError(
                f"q must have {self.num_heads} heads of dim {self.head_dim}, got shape {tuple(q.shape)}"
            )

    def score(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Terms (b) + (c) + (d) as ``(batch, heads, q_len, k_len)``."""
        self._check(q)
        q_pos, k_pos = check_position_pair(q_pos, k_pos)
        if q_pos.shape[-1] != q.shape[-2] or k_pos.shape[-1] != k.shape[-2]:
            raise ValueError(
                f"q_pos and k_pos must have q_len = {q.shape[-2]} and k_len = {k.shape[-2]} "
                f"entries, got shapes {tuple(q_pos.shape)} and {tuple(k_pos.shape)}"
            )
        q0, k0 = contiguous_start(q_pos), contiguous_start(k_pos)
        lq, lk = q.shape[-2], k.shape[-2]
        if q0 is not None and k0 is not None and (self.bidirectional or q0 >= k0):
            return self._score_shift(q, k, q0 - k0)
        return self._score_gather(q, k, q_pos, k_pos)

    def _score_shift(self, q: Tensor, k: Tensor, offset: int) -> Tensor:
        # distance(i, j) = offset + i - j; column c of the table holds offset + lq - 1 - c.
        lq, lk = q.shape[-2], k.shape[-2]
        full = lq + lk - 1
        width = full if self.bidirectional else min(lq + offset, full)
        cols = max(width, lk)
        top = offset + lq - 1
        r = self.relative_keys(torch.arange(top, top - width, -1, device=q.device))
        position = (q + self.v.to(q.dtype)[:, None]) @ r.to(q.dtype).transpose(-1, -2)
        if cols > width:
            position = torch.cat([position, position.new_zeros(*position.shape[:-1], cols - width)], -1)
        position = rel_shift(position)[..., :lk]
        if not self.bidirectional:
            future = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(offset + 1)
            position = position.masked_fill(future, 0.0)
        return position + (k @ self.u.to(k.dtype)[..., None]).transpose(-1, -2)

    def _score_gather(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        dist = -relative_positions(q_pos, k_pos)  # query minus key
        if not self.bidirectional:
            past = dist >= 0
            dist = dist.clamp(min=0)
        hi, lo = int(dist.max()), int(dist.min())
        r = self.relative_keys(torch.arange(hi, lo - 1, -1, device=q.device))
        position = (q + self.v.to(q.dtype)[:, None]) @ r.to(q.dtype).transpose(-1, -2)
        position = position.gather(-1, _expand_index(hi - dist, q))
        if not self.bidirectional:
            position = position * _expand_index(past, q).to(position.dtype)
        return position + (k @ self.u.to(k.dtype)[..., None]).transpose(-1, -2)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, d_r={self.d_r}, "
                f"bidirectional={self.bidirectional}, " + super().extra_repr())


# ============================================================================ T5


def check_bucket_args(bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """Validate T5 bucket arguments; return ``max_exact``."""
    check_bool(bidirectional, "bidirectional")
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int):
        raise TypeError(f"num_buckets must be an int, got {type(num_buckets).__name__}")
    check_positive_int(max_distance, "max_distance")
    smallest = 4 if bidirectional else 2
    if num_buckets < smallest:
        raise ValueError(
            f"num_buckets must be >= {smallest} for bidirectional={bidirectional} (at least one "
            f"exact bucket per direction), got {num_buckets}"
        )
    half = num_buckets // 2 if bidirectional else num_buckets
    max_exact = half // 2
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance ({max_distance}) must exceed the exact region, max_exact = {max_exact} "
            f"(num_buckets={num_buckets}, bidirectional={bidirectional}); the logarithmic buckets "
            f"cover distances max_exact .. max_distance"
        )
    return max_exact


def t5_relative_position_bucket(
    relative_position: Tensor,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Tensor:
    """T5's bucket for each relative position (``key - query``), exactly as the original.

    With ``n = -relative_position`` (how far back the key is):

    * bidirectional: half the buckets per sign; keys after the query (``n < 0``) use
      buckets ``num_buckets // 2 ..``, and ``n <- |n|``. Causal: ``n <- max(n, 0)``
      (future keys share bucket 0 with offset 0).
    * with ``B`` buckets for this sign and ``E = B // 2``: ``n < E`` gets bucket ``n``;
      otherwise ``E + int(log(n / E) / log(max_distance / E) * (B - E))`` (float32 math,
      truncated toward zero), clamped to ``B - 1``.

    Matches mesh-tensorflow's ``_relative_position_bucket`` (Raffel et al.
    :cite:`raffel2020exploring`) and HuggingFace's ``T5Attention._relative_position_bucket``
    including the float32 logarithm and the truncation, so a real T5 checkpoint's
    ``relative_attention_bias`` table can be used as is. Same argument order and defaults.

    Returns:
        int64 buckets in ``[0, num_buckets)``, shaped like ``relative_position``.
    """
    max_exact = check_bucket_args(bidirectional, num_buckets, max_distance)
    n = -check_int_tensor(relative_position, "relative_position", what="relative positions")
    if bidirectional:
        half = num_buckets // 2
        bucket = (n < 0).long() * half
        n = n.abs()
    else:
        half = num_buckets
        bucket = torch.zeros_like(n)
        n = n.clamp(min=0)
    # float32, in the original's order of operations; the clamp only avoids log(0) in the
    # entries that the `where` below discards anyway.
    scaled = torch.log(n.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (scaled * (half - max_exact)).long()).clamp(max=half - 1)
    return bucket + torch.where(n < max_exact, n, large)


class T5RelativeBias(PositionScheme):
    """T5's relative position bias :cite:`raffel2020exploring` (``bias`` hook).

    ``bias[h, i, j] = table[bucket(k_pos[j] - q_pos[i]), h]``: one learned scalar per bucket
    and head, added to the logits. T5 computes it once and shares it across all layers of a
    stack (the first layer owns the table); share one instance of this scheme between
    layers, as :class:`companion.model.TinyDecoder` does. T5 does not scale its logits by
    ``1/sqrt(d)``: call the attention with ``scale=1.0`` to reproduce it.

    Args:
        num_heads: heads.
        num_buckets: buckets (32 in T5).
        max_distance: distance where the last bucket begins (128 in T5).
        bidirectional: ``True`` for an encoder, ``False`` for a causal decoder.

    Attributes:
        relative_attention_bias: ``nn.Embedding(num_buckets, num_heads)``, named and shaped
            as in HuggingFace T5, so a checkpoint's
            ``...SelfAttention.relative_attention_bias.weight`` loads directly. :attr:`table`
            is its weight, ``(num_buckets, num_heads)``, for kernels.
    """

    #: The bias depends only on ``k_pos - q_pos``, so :func:`companion.blockwise.bias_attention`
    #: may compute one tile per diagonal of tiles and reuse it.
    relative_bias = True

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True) -> None:
        super().__init__()
        self.num_heads = check_positive_int(num_heads, "num_heads")
        check_bucket_args(bidirectional, num_buckets, max_distance)
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)

    @property
    def table(self) -> Tensor:
        """The learned table, ``(num_buckets, num_heads)`` (the embedding's weight)."""
        return self.relative_attention_bias.weight

    def scheme_heads(self) -> int:
        """``num_heads``: one table column per query head."""
        return self.num_heads

    def buckets(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Bucket of each (query, key): ``(q_len, k_len)`` or ``(batch, q_len, k_len)``."""
        return t5_relative_position_bucket(
            relative_positions(q_pos, k_pos), self.bidirectional, self.num_buckets, self.max_distance
        )

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``(heads, q_len, k_len)`` for 1-D positions, ``(batch, heads, q_len, k_len)`` per row.

        Usable directly as the ``bias_fn(q_pos_block, k_pos_block)`` of a blockwise attention.
        For contiguous 1-D positions (the usual case, and every block of it) the bias is
        Toeplitz: it buckets only the ``q_len + k_len - 1`` distinct offsets and lays the looked-up
        values out with a strided view, instead of bucketing ``q_len * k_len`` pairs.
        """
        q_pos, k_pos = check_position_pair(q_pos, k_pos)
        q0, k0 = contiguous_start(q_pos), contiguous_start(k_pos)
        if q0 is None or k0 is None:
            values = self.relative_attention_bias(self.buckets(q_pos, k_pos))  # (..., q, k, heads)
            return values.movedim(-1, -3)
        lq, lk = q_pos.numel(), k_pos.numel()
        # offset (k0 + j) - (q0 + i) = lowest + (j - i + lq - 1), lowest = k0 - q0 - (lq - 1)
        lowest = k0 - q0 - (lq - 1)
        offsets = torch.arange(lowest, lowest + lq + lk - 1, device=q_pos.device)
        per_offset = self.relative_attention_bias(
            t5_relative_position_bucket(offsets, self.bidirectional, self.num_buckets, self.max_distance)
        ).t().contiguous()  # (heads, lq + lk - 1), contiguous so the copy below streams
        # window s of length lk starts at offset index s; row i needs window lq - 1 - i
        return per_offset.unfold(-1, lk, 1).flip(-2).contiguous()

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, "
                f"max_distance={self.max_distance}, bidirectional={self.bidirectional}, " + super().extra_repr())
