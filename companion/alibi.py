"""ALiBi: slopes, the bias, and the scheme.

ALiBi (Press, Smith and Lewis, :cite:`press2022train`) adds no position vector anywhere. It
adds a fixed penalty to each attention logit, proportional to the distance between query
``i`` and key ``j``, with one slope ``m_h`` per head::

    logits[h, i, j] = scale * q_i . k_j  -  m_h * |i - j|

The slopes form a geometric sequence, ``m_h = 2^(-8 h / n)`` for ``h = 1..n`` heads when
``n`` is a power of two (:func:`alibi_slopes` also covers other head counts, exactly as the
paper's reference code and HuggingFace's BLOOM/Falcon do).

A naive implementation materialises a ``heads x L x L`` bias tensor: 8 GiB in float32 for
8 heads at ``L = 16384``. The memory-lean attention that never does, one tile at a time, is
:func:`companion.blockwise.bias_attention`; it serves every bias scheme (T5's too), not
ALiBi alone. It is re-exported here, so ``companion.alibi.bias_attention`` keeps working.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import (
    check_choice,
    check_device,
    check_finite_number,
    check_position_pair,
    check_positive_int,
    check_tensor,
)
from .attention import PositionScheme
from .blockwise import bias_attention

__all__ = ["ALIBI_FORMS", "ALiBi", "alibi_bias", "alibi_slopes", "bias_attention"]

#: The bias forms :class:`ALiBi` can return (see :func:`alibi_bias`).
ALIBI_FORMS: tuple[str, ...] = ("symmetric", "causal")


# ----------------------------------------------------------------------------- slopes


def alibi_slopes(
    n_heads: int,
    *,
    max_bias: float = 8.0,
    device: torch.device | str | None = None,
) -> Tensor:
    """The per-head ALiBi slopes ``m_1 .. m_n`` as a float32 tensor of shape ``(n_heads,)``.

    For ``n`` a power of two, the geometric sequence ``m_h = 2^(-max_bias * h / n)``,
    ``h = 1..n`` (the paper uses ``max_bias = 8``: 8 heads give ``1/2, 1/4, ..., 1/256``).

    For other ``n`` the paper's reference code (and HuggingFace's ``build_alibi_tensor``)
    takes the ``c`` slopes of the closest lower power of two ``c = 2^floor(log2 n)``, then
    fills the remaining ``n - c`` heads with every other slope of ``2c`` heads, starting with
    the first: ``2^(-max_bias * h / (2c))`` for ``h = 1, 3, 5, ...``. Those interleave between
    the first ``c`` slopes, so the sequence stays within ``[2^-max_bias, 2^(-max_bias/2c)]``
    but is no longer sorted (Press et al., :cite:`press2022train`).

    ``max_bias`` generalises the paper's 8 as llama.cpp and MPT do. The exponents are
    computed in float64 and the result rounded once to float32.
    """
    check_positive_int(n_heads, "n_heads")
    max_bias = check_finite_number(max_bias, "max_bias")
    device = None if device is None else check_device(device)
    closest = 1 << (n_heads.bit_length() - 1)  # largest power of two <= n_heads
    exps = [max_bias * h / closest for h in range(1, closest + 1)]
    exps += [max_bias * h / (2 * closest) for h in range(1, 2 * (n_heads - closest), 2)]
    return torch.tensor([2.0 ** -e for e in exps], dtype=torch.float64).to(
        device=device, dtype=torch.float32
    )


def alibi_bias(
    slopes: Tensor, q_pos: Tensor, k_pos: Tensor, *, form: str = "symmetric"
) -> Tensor:
    """ALiBi's logit bias for the given integer positions, in float32.

    * ``form="symmetric"``: ``-m_h * |j - i|``. Right for bidirectional (encoder) attention,
      and, combined with a causal mask, for decoders.
    * ``form="causal"``: ``m_h * (j - i)`` where ``j <= i`` and ``-inf`` where ``j > i``: the
      decoder form, with the causal mask folded in (as in the paper's fairseq code).

    Where a causal mask is applied the two agree entry by entry (``j <= i`` gives
    ``-|j - i| = j - i``). The paper's code and HuggingFace's BLOOM go one step further and
    add ``m_h * j`` alone: that differs from ``m_h * (j - i)`` by ``m_h * i``, a constant in
    each query row, which softmax ignores.

    Args:
        slopes: ``(heads,)`` floating slopes, e.g. from :func:`alibi_slopes`.
        q_pos, k_pos: integer positions (tensors or lists of ints), ``(len,)`` or
            ``(batch, len)``; float positions raise ``TypeError``.
        form: one of :data:`ALIBI_FORMS`.

    Returns:
        ``(heads, q_len, k_len)`` for shared positions, ``(batch, heads, q_len, k_len)`` if
        either position tensor is per row.
    """
    check_tensor(slopes, "slopes", 1)
    if not slopes.is_floating_point():
        raise TypeError(f"slopes must be a floating-point tensor, got dtype {slopes.dtype}")
    check_choice(form, "form", ALIBI_FORMS)
    q_pos, k_pos = check_position_pair(q_pos, k_pos)
    rel = k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)  # j - i, int64, (q, k) or (b, q, k)
    m = slopes.to(device=rel.device, dtype=torch.float32)
    if rel.dim() == 2:
        m = m.view(-1, 1, 1)
    else:
        rel = rel.unsqueeze(1)
        m = m.view(1, -1, 1, 1)
    # Distances are exact in int64; one (q, k) cast to float32, then a float multiply per head.
    if form == "symmetric":
        return torch.mul(m, rel.abs_().neg_().to(torch.float32))
    out = torch.mul(m, rel.to(torch.float32))
    return out.masked_fill_((rel > 0).expand_as(out), float("-inf"))


class ALiBi(PositionScheme):
    """ALiBi as a position scheme: the ``bias`` hook only (Press et al., :cite:`press2022train`).

    ``bias(q_pos, k_pos)`` returns the ``symmetric`` form ``-m_h * |j - i|`` by default: it
    is correct for encoders, and for decoders once the causal mask is applied (the reference
    :func:`~companion.attention.attention` with ``causal=True``, or
    :func:`~companion.blockwise.bias_attention`).
    ``form="causal"`` returns ``m_h * (j - i)`` with ``-inf`` above the diagonal, so the bias
    alone makes attention causal. On every entry a causal mask keeps, both forms are equal,
    so they give identical causal attention (see :func:`alibi_bias`).

    The slopes are kept in float32 regardless of ``module.to(dtype)``: they are recomputed
    from ``n_heads`` and ``max_bias``, not stored as a castable buffer.

    Args:
        n_heads: number of (query) heads, ``>= 1``. Attention with another number of query
            heads raises ``ValueError`` (see :meth:`~companion.attention.PositionScheme.check_heads`).
        form: ``"symmetric"`` (default) or ``"causal"``.
        max_bias: the exponent scale of :func:`alibi_slopes` (the paper: 8).
    """

    #: The bias depends only on ``k_pos - q_pos``: :func:`~companion.blockwise.bias_attention`
    #: may compute one tile per diagonal of tiles and reuse it.
    relative_bias = True

    def __init__(self, n_heads: int, *, form: str = "symmetric", max_bias: float = 8.0) -> None:
        super().__init__()
        check_positive_int(n_heads, "n_heads")
        check_choice(form, "form", ALIBI_FORMS)
        self.n_heads = n_heads
        self.form = form
        self.max_bias = check_finite_number(max_bias, "max_bias")
        self._slopes = alibi_slopes(n_heads, max_bias=self.max_bias)

    @property
    def slopes(self) -> Tensor:
        """The ``(n_heads,)`` float32 slopes."""
        return self._slopes

    def scheme_heads(self) -> int:
        """``n_heads``: one slope per query head."""
        return self.n_heads

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """ALiBi bias for integer positions; see :func:`alibi_bias` for shapes and forms."""
        device = k_pos.device if isinstance(k_pos, Tensor) else self._slopes.device
        if self._slopes.device != device:
            self._slopes = self._slopes.to(device)
        return alibi_bias(self._slopes, q_pos, k_pos, form=self.form)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, form={self.form!r}, max_bias={self.max_bias:g}"
