"""Contextual position encoding (CoPE): positions that count what the model decides to count.

Golovneva et al. :cite:`golovneva2024cope` replace the token index by a *contextual*
position. Every query ``i`` decides, for every key ``t`` it may see, whether ``t`` counts,
with a gate in ``(0, 1)``; the position of key ``j`` relative to query ``i`` is the number of
counted keys from ``j`` up to the query:

.. math::

    g_{it} = \\sigma\\!\\left(\\frac{q_i \\cdot k_t}{\\sqrt{d}}\\right) [\\text{pos}_t \\le \\text{pos}_i],
    \\qquad
    p_{ij} = \\min\\Big(\\sum_{t=j}^{i} g_{it},\\; n_{pos} - 1\\Big).

Positions are fractional, so the position embedding is interpolated between the two
neighbouring rows of a learned table ``e`` (``npos`` rows of ``head_dim``):

.. math::

    z_{ij} = (1 - w)\\, q_i \\cdot e[\\lfloor p_{ij} \\rfloor] + w\\, q_i \\cdot e[\\lceil p_{ij} \\rceil],
    \\qquad w = p_{ij} - \\lfloor p_{ij} \\rfloor,

and the attention logit is ``(q_i . k_j + z_ij) / sqrt(d)``. If every gate is 1, ``p_ij =
i - j + 1`` (the number of tokens from ``j`` to ``i``, both included) and CoPE is a relative
position embedding; if the gates fire only on separators, ``p_ij`` counts sentences.

Conventions matched (the authors' code, facebookresearch/RAM ``projects/cope``,
``ContextPosSelfAttn`` with its defaults):

* the gate logits are ``q . k / sqrt(head_dim)``: the authors divide by ``sqrt(head_dim)``
  *before* the sigmoid; the gates use the same keys as attention (no separate key
  projection, no value gates);
* the interpolated term ``z`` is added to ``q . k`` *before* the ``1/sqrt(head_dim)``
  scale, which is exactly where :func:`companion.attention.attention` adds a ``score``
  term, so :meth:`CoPE.score` returns ``z`` itself with no scale absorbed (the authors'
  ``--cope-nodiv`` option, adding ``z`` after the scale, is not reproduced: it would be
  ``z * sqrt(head_dim)`` here);
* positions are clamped above at ``npos - 1`` (the authors' default is ``npos = block size
  + 1``); the interpolation weight ``w`` carries the gradient, ``floor`` and ``ceil`` none;
* the table is stored as ``(npos, head_dim)``; the authors' ``pos_emb`` parameter is
  ``(1, head_dim, npos)``, so ``table = pos_emb[0].T``. One table is shared by all heads of
  a layer, as there. The authors start it at zero, which is ``init_std = 0`` here.

CoPE is **causal only**: the count runs from key ``j`` forward to the query, over the keys the
query may see (``k_pos <= q_pos``); the gates of future keys are zero by construction, so a
future key gets position 0. Use it with ``causal=True`` (the authors' decoder always masks).
Unlike the authors' code, the hook sees no padding mask: a padding key counts like any other
key for the keys *before* it (with left padding nothing real lies before the padding, so the
real tokens are unaffected).

Integer positions matter only through causality: CoPE counts keys, not position
differences, so positions ``0, 1, 2`` and ``0, 5, 9`` give the same logits. Keys must be
in non-decreasing position order (``ValueError`` otherwise), so that "keys ``j .. i``" in
index order are the keys between ``j`` and the query in position.

NaN and inf follow the package's rule for attention (a query sees only the non-finite values
of the keys it may attend): a key after the query has a gate of exactly 0 whatever its values,
so a NaN there never reaches the query; a NaN query, or a NaN key the query sees, makes the
affected ``z_ij`` NaN (so the query's attention output is NaN), not an error.

Memory: this is the naive form. It builds ``(batch, heads, q_len, k_len)`` gates, positions
and two gathers, plus ``(batch, heads, q_len, npos)`` per-row logits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ._checks import (
    check_finite_number,
    check_position_pair,
    check_positive_int,
    check_tensor,
)
from .attention import PositionScheme

__all__ = ["cope_gates", "cope_positions", "cope_interpolate", "cope_score", "CoPE"]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_qk(q: object, k: object) -> tuple[Tensor, Tensor]:
    """``q`` ``(batch, heads, q_len, d)`` and ``k`` ``(batch, kv_heads, k_len, d)``, one
    floating dtype, ``heads`` a multiple of ``kv_heads``. Returns ``k`` with each head
    repeated ``heads // kv_heads`` times, as :func:`companion.attention.attention` does for
    grouped-query attention (``repeat_interleave`` on the heads axis)."""
    q = check_tensor(q, "q", 4)
    k = check_tensor(k, "k", 4)
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got dtype {q.dtype}")
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k batch size {k.shape[0]} must equal q batch size {q.shape[0]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k head_dim {k.shape[-1]} must equal q head_dim {q.shape[-1]}")
    h, hk = q.shape[1], k.shape[1]
    if hk < 1 or h % hk:
        raise ValueError(f"q heads ({h}) must be a multiple of k heads ({hk})")
    if q.shape[-1] < 1:
        raise ValueError(f"q head_dim must be >= 1, got shape {tuple(q.shape)}")
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
    return q, k


def _check_positions(q_pos: object, k_pos: object, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """Integer positions of ``q_len`` and ``k_len`` entries (shared or per row with ``q``'s
    batch), keys in non-decreasing order. Returns both as int64 on ``q``'s device."""
    q_pos, k_pos = check_position_pair(q_pos, k_pos)
    b, lq, lk = q.shape[0], q.shape[-2], k.shape[-2]
    for name, pos, length in (("q_pos", q_pos, lq), ("k_pos", k_pos, lk)):
        if pos.shape[-1] != length or (pos.dim() == 2 and pos.shape[0] != b):
            raise ValueError(
                f"{name} must have shape ({length},) or ({b}, {length}) for q of shape "
                f"{tuple(q.shape)} and k of shape {tuple(k.shape)}, got {tuple(pos.shape)}"
            )
    if k_pos.shape[-1] > 1:
        step = k_pos[..., 1:] - k_pos[..., :-1]
        if bool((step < 0).any()):
            where = int((step < 0).nonzero()[0, -1])
            raise ValueError(
                f"k_pos must be non-decreasing along the keys (CoPE counts keys from j to the "
                f"query in index order), but k_pos[..., {where + 1}] < k_pos[..., {where}]"
            )
    return q_pos.to(q.device), k_pos.to(q.device)


def _visible(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``k_pos[j] <= q_pos[i]`` as ``(1 or batch, 1, q_len, k_len)``, ready to broadcast over
    heads."""
    seen = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    return seen.unsqueeze(0).unsqueeze(0) if seen.dim() == 2 else seen.unsqueeze(1)


def cope_gates(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """CoPE's gates ``g_ij = sigmoid(q_i . k_j / sqrt(d)) [k_pos_j <= q_pos_i]``.

    The ``1/sqrt(d)`` (``d = head_dim``) inside the sigmoid is the authors' (facebookresearch/RAM,
    ``ContextPosSelfAttn``; Golovneva et al. :cite:`golovneva2024cope` write the gate
    without it). Keys after the query get a gate of exactly 0, even if ``q . k`` is NaN.

    Args:
        q: queries ``(batch, heads, q_len, d)``, floating.
        k: keys ``(batch, kv_heads, k_len, d)``, ``q``'s dtype; ``heads`` a multiple of
            ``kv_heads`` (each key head is repeated, as in grouped-query attention).
        q_pos, k_pos: integer positions ``(len,)`` or ``(batch, len)``; ``k_pos``
            non-decreasing.

    Returns:
        ``(batch, heads, q_len, k_len)`` in float64 for float64 inputs, else float32.

    Raises:
        TypeError: non-floating ``q``, ``k`` of another dtype, float positions.
        ValueError: shapes that do not fit; keys out of position order.
    """
    q, k = _check_qk(q, k)
    q_pos, k_pos = _check_positions(q_pos, k_pos, q, k)
    work = _work_dtype(q.dtype)
    logits = q.to(work) @ k.to(work).transpose(-1, -2) / math.sqrt(q.shape[-1])
    zero = torch.zeros((), dtype=work, device=logits.device)
    return torch.where(_visible(q_pos, k_pos), torch.sigmoid(logits), zero)


def cope_positions(gates: Tensor, npos: int | None = None) -> Tensor:
    """Contextual positions from gates: ``p_ij = min(sum_{t >= j} g_it, npos - 1)``.

    A suffix sum along the last (key) axis: with the gates of keys after the query at zero
    (:func:`cope_gates`), ``sum_{t >= j}`` is ``sum_{t = j .. i}``, the number of counted keys
    from ``j`` to the query. All gates 1 give ``p_ij = i - j + 1`` for ``j <= i`` (a relative
    position, counting both ends).

    Args:
        gates: ``(..., q_len, k_len)``, floating, values in ``[0, 1]`` (not checked: any real
            gates give the suffix sum).
        npos: clamp positions at ``npos - 1`` (an int >= 1); ``None`` does not clamp.

    Returns:
        A tensor of ``gates``' shape and dtype.
    """
    check_tensor(gates, "gates")
    if not gates.is_floating_point():
        raise TypeError(f"gates must be a floating-point tensor, got dtype {gates.dtype}")
    if gates.dim() < 2:
        raise ValueError(f"gates must have at least 2 dimensions (..., q_len, k_len), got shape {tuple(gates.shape)}")
    positions = gates.flip(-1).cumsum(-1).flip(-1)
    if npos is not None:
        check_positive_int(npos, "npos")
        positions = positions.clamp(max=npos - 1)
    return positions


def cope_interpolate(q: Tensor, table: Tensor, positions: Tensor) -> Tensor:
    """``q_i . e[p_ij]`` with ``e`` linearly interpolated between integer rows.

    ``z_ij = (1 - w) q_i . e[floor(p_ij)] + w q_i . e[ceil(p_ij)]``, ``w = p_ij -
    floor(p_ij)``. Computes ``q @ table^T`` once, ``(batch, heads, q_len, npos)``, then
    gathers both neighbours (as the authors do). The gradient reaches ``q``, ``table`` and
    ``positions`` (through ``w``).

    Args:
        q: ``(batch, heads, q_len, head_dim)``, floating.
        table: ``(npos, head_dim)``, floating.
        positions: ``(batch, heads, q_len, k_len)`` in ``[0, npos - 1]`` (from
            :func:`cope_positions` with the same ``npos``).

    Returns:
        ``(batch, heads, q_len, k_len)`` in float64 for float64 ``q``, else float32.

    Raises:
        ValueError: shapes that do not fit, or positions outside ``[0, npos - 1]`` (NaN
            included: :func:`cope_score` passes a NaN position through as a NaN ``z``).
    """
    check_tensor(q, "q", 4)
    check_tensor(table, "table", 2)
    check_tensor(positions, "positions", 4)
    if not (q.is_floating_point() and table.is_floating_point() and positions.is_floating_point()):
        raise TypeError("q, table and positions must be floating-point tensors")
    npos, d = table.shape
    if d != q.shape[-1]:
        raise ValueError(f"table must have shape (npos, head_dim) with head_dim {q.shape[-1]}, got {tuple(table.shape)}")
    if npos < 1:
        raise ValueError(f"table must have at least one row, got shape {tuple(table.shape)}")
    if positions.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"positions must have q's (batch, heads, q_len) = {tuple(q.shape[:3])}, got {tuple(positions.shape)}"
        )
    nan = positions.detach().isnan()
    if bool(nan.any()):
        where = tuple(int(i) for i in nan.nonzero()[0])
        raise ValueError(
            f"positions must lie in [0, npos - 1] = [0, {npos - 1}], got NaN at index {where} "
            f"({int(nan.sum())} of {positions.numel()} entries are NaN)"
        )
    if positions.numel() and not (float(positions.detach().min()) >= 0 and float(positions.detach().max()) <= npos - 1):
        raise ValueError(
            f"positions must lie in [0, npos - 1] = [0, {npos - 1}], got "
            f"[{float(positions.min())}, {float(positions.max())}]"
        )
    work = _work_dtype(q.dtype)
    positions = positions.to(work)
    per_row = q.to(work) @ table.to(work).transpose(-1, -2)  # (b, h, q_len, npos)
    lo, hi = positions.detach().floor().long(), positions.detach().ceil().long()
    w = positions - lo.to(work)
    return (1 - w) * per_row.gather(-1, lo) + w * per_row.gather(-1, hi)


def cope_score(q: Tensor, k: Tensor, table: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """CoPE's logit term ``z_ij`` (added to ``q_i . k_j`` before the ``1/sqrt(d)`` scale).

    :func:`cope_gates`, then :func:`cope_positions` clamped at ``npos - 1 = len(table) - 1``,
    then :func:`cope_interpolate` (Golovneva et al. :cite:`golovneva2024cope`).

    Args:
        q, k, q_pos, k_pos: as in :func:`cope_gates`.
        table: ``(npos, head_dim)``, floating.

    Returns:
        ``(batch, heads, q_len, k_len)`` in ``q``'s dtype (computed in float32, or float64
        for float64 inputs). A NaN query, or a NaN key the query sees, gives NaN entries
        (those whose count includes it); keys after the query never reach it.
    """
    gates = cope_gates(q, k, q_pos, k_pos)
    check_tensor(table, "table", 2)
    if table.shape[-1] != q.shape[-1]:
        raise ValueError(f"table must have shape (npos, head_dim) with head_dim {q.shape[-1]}, got {tuple(table.shape)}")
    positions = cope_positions(gates, table.shape[0])
    nan = positions.isnan()
    if bool(nan.any()):  # a NaN gate: interpolate the rest, then put the NaN back where it was
        zero = torch.zeros((), dtype=positions.dtype, device=positions.device)
        z = cope_interpolate(q, table, torch.where(nan, zero, positions))
        return torch.where(nan, torch.full((), float("nan"), dtype=z.dtype, device=z.device), z).to(q.dtype)
    return cope_interpolate(q, table, positions).to(q.dtype)


class CoPE(PositionScheme):
    """Contextual position encoding :cite:`golovneva2024cope` (``score`` hook).

    ``logit_ij = (q_i . k_j + z_ij) / sqrt(d)`` with ``z_ij`` the interpolated ``q_i .
    e[p_ij]``, ``p_ij = min(sum_{t=j..i} sigmoid(q_i . k_t / sqrt(d)), npos - 1)`` (see the
    module docstring for the full formula and the conventions of the authors' code, which
    this matches). Causal only: use it with ``causal=True``; keys must be in non-decreasing
    position order. Works for ``q_len != k_len`` (decoding: the queries are the last keys),
    per-row positions, grouped-query keys, float32 and float64.

    Args:
        head_dim: query/key head dimension (>= 1).
        npos: rows of the position table (>= 1); positions are clamped at ``npos - 1``. The
            authors default to the block size + 1 (every count a causal query can reach); a
            smaller ``npos`` saturates large counts, which is what lets a counting model
            generalise to longer inputs.
        init_std: standard deviation of the normal initialisation of the table, a finite
            number >= 0; the default 0 is the authors' zero start (the scheme then starts as
            NoPE and learns its table).

    Attributes:
        table: ``nn.Parameter`` ``(npos, head_dim)``; row ``n`` is the embedding of
            contextual position ``n``, shared by all heads.
    """

    def __init__(self, head_dim: int, npos: int, *, init_std: float = 0.0) -> None:
        super().__init__()
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.npos = check_positive_int(npos, "npos")
        init_std = check_finite_number(init_std, "init_std", minimum=0)
        self.table = nn.Parameter(torch.randn(npos, head_dim) * init_std)

    def score(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``z_ij``, the interpolated ``q_i . e[p_ij]``, as ``(batch, heads, q_len, k_len)``.

        Added to ``q @ k^T`` before the ``1/sqrt(d)`` scale by
        :func:`companion.attention.attention`. ``k`` may have fewer heads than ``q``
        (repeated as in grouped-query attention). Raises ``ValueError`` for a ``head_dim``
        other than the scheme's, and as :func:`cope_gates` documents.
        """
        check_tensor(q, "q", 4)
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"q head_dim {q.shape[-1]} must equal the scheme's head_dim {self.head_dim}")
        return cope_score(q, k, self.table, q_pos, k_pos)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, npos={self.npos}, " + super().extra_repr()
