"""Two relatives of RoPE that use the ``rotate`` hook: xPos and p-RoPE.

* :class:`XPos` (Sun et al., :cite:`sun2023xpos`) multiplies RoPE by a per-pair exponential
  that grows for queries and shrinks for keys, so that the score decays with the distance
  ``m - n``, faster for the high-frequency pairs. It matches microsoft/torchscale's ``XPOS``.
* :class:`PRoPE` (Barbero et al., :cite:`barbero2025round`) keeps only the highest
  frequencies of RoPE; the lowest ones are set to zero, so those pairs do not rotate and carry
  content without position. ``p = 1`` is RoPE, ``p = 0`` is NoPE. It is HuggingFace's
  ``proportional`` rope type (Gemma 4) with ``factor = 1``, see :mod:`companion.scaling`.

Both compute their angles and scales in float32 (float64 for float64 activations), never in
the activations' dtype, and cast only the rotated result.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from ._checks import as_positions, check_base, check_finite_number, check_positive_int, check_tensor
from .attention import PositionScheme
from .rope import RotaryEmbedding, check_layout, rope_cos_sin, rope_frequencies, rope_rotate
from .scaling import proportional_rope_angles

__all__ = ["XPos", "PRoPE", "xpos_max_centered_position"]

#: ``-ln`` of float32's smallest normal number, ``126 ln 2``: a scale ``e**x`` and its reciprocal
#: are both normal float32 numbers exactly when ``|x| <= 126 ln 2``.
_FP32_NORMAL_LOG = 126 * math.log(2.0)

#: ``ln(1 / zeta_0) = ln(1.4 / 0.4) = ln 3.5``: pair 0 has the smallest zeta, ``2 / 7``, for any
#: head_dim, so its scale leaves the float32 range first.
_LOG_INV_ZETA0 = math.log(3.5)


def _check_head_dim(head_dim: object) -> int:
    check_positive_int(head_dim, "head_dim", minimum=2)
    if head_dim % 2:  # type: ignore[operator]
        raise ValueError(f"head_dim must be even (coordinates are rotated in pairs), got {head_dim}")
    return head_dim  # type: ignore[return-value]


def _check_qk(q: object, k: object, head_dim: int, scheme: str) -> None:
    for name, x in (("q", q), ("k", k)):
        check_tensor(x, name, 4)
        if not x.dtype.is_floating_point:  # type: ignore[union-attr]
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")  # type: ignore[union-attr]
        if x.shape[-1] != head_dim:  # type: ignore[union-attr]
            raise ValueError(f"{name} head_dim must equal {scheme}'s head_dim {head_dim}, got {x.shape[-1]}")  # type: ignore[union-attr]
    if k.device != q.device:  # type: ignore[union-attr]
        raise ValueError(f"k is on {k.device} but q is on {q.device}")  # type: ignore[union-attr]


def xpos_max_centered_position(scale_base: float = 512.0) -> int:
    """The largest ``|n'|`` (centred position) :class:`XPos` accepts: ``floor(gamma * 126 ln 2 / ln 3.5)``.

    Pair 0 has ``zeta_0 = 0.4 / 1.4 = 2 / 7`` for every head_dim, the smallest zeta, so its
    scale ``zeta_0 ** (n' / gamma)`` is the first to leave float32's range: beyond this bound the
    query scale (for ``n' < 0``) or the key scale ``zeta_0 ** (-n' / gamma)`` (for ``n' > 0``)
    exceeds ``2**126``, and the other one falls below float32's smallest normal number
    ``2**-126`` (it becomes subnormal, then 0, near ``2**-149``; 1 / scale overflows to inf
    near ``2**128``). For ``gamma = scale_base = 512`` the bound is 35694, so a sequence
    centred by the default rule (``ceil(L / 2)``) may have at most ``L = 71388`` positions.
    """
    gamma = check_finite_number(scale_base, "scale_base")
    return math.floor(gamma * _FP32_NORMAL_LOG / _LOG_INV_ZETA0)


class XPos(PositionScheme):
    """xPos (Sun et al., :cite:`sun2023xpos`): RoPE times a per-pair exponential decay.

    With ``d = head_dim``, ``h = d / 2`` pairs, ``theta_i = base ** (-2 i / d)`` (RoPE's
    frequencies, :func:`companion.rope.rope_frequencies`), ``zeta_i = (2 i / d + 0.4) / 1.4`` in
    ``[2/7, 1)`` and ``gamma = scale_base``, pair ``i`` of a query at position ``n`` and of a key
    at position ``m`` become::

        q_i' = zeta_i ** ( n' / gamma) * R(n theta_i) q_i
        k_i' = zeta_i ** (-m' / gamma) * R(m theta_i) k_i

    where ``R`` is RoPE's 2x2 rotation and ``n' = n - c``, ``m' = m - c`` are the positions
    *centred* by ``c``. The score is RoPE's, pair by pair, times ``zeta_i ** ((n - m) / gamma)``:
    a decay with the distance ``n - m`` that does not depend on ``c`` (only the rounding does),
    strongest for pair 0 (the highest frequency, ``zeta_0 = 2/7``) and nearly absent for the last
    pairs (``zeta -> 1``).

    Conventions (microsoft/torchscale's ``XPOS``, ``torchscale/component/xpos_relative_position.py``):

    * the angles use the *uncentred* positions ``n``, the scales the centred ones;
    * the centre: torchscale's scales run over ``arange(min_pos, max_pos)`` with
      ``min_pos = -(length + offset) // 2`` (Python's floor division), i.e. the positions
      ``0 .. N - 1`` (``N = length + offset``) are centred by ``c = ceil(N / 2)``; its attention
      passes the keys with offset 0 and, while decoding, the queries with ``offset = k_len - 1``,
      so both use ``ceil(k_len / 2)``. Here ``c = ceil((max(k_pos) + 1) / 2)`` from the
      positions given to the hook, which is that value for keys ``0 .. k_len - 1`` (one ``c``
      for the whole batch, also for per-row positions); pass ``center=`` to fix it instead;
    * queries get the scale, keys its reciprocal (torchscale's ``downscale=True``); both cos
      and sin are multiplied by the scale;
    * ``layout="interleaved"``: pairs ``(x[2i], x[2i+1])`` (torchscale's ``rotate_every_two``,
      the default); ``"half"``: ``(x[i], x[i+h])`` (HuggingFace's order).

    Precision and range. Angles are float32 (HuggingFace's arithmetic) or float64 for float64
    activations; the scales are computed in float64 and cast to that dtype. The scale grows
    exponentially with ``|n'|``: positions whose centred value exceeds
    :func:`xpos_max_centered_position` (35694 for ``gamma = 512``, i.e. sequences of about 71K
    tokens with the default centre) raise ``ValueError``, since the scale or its reciprocal
    would leave float32's normal range (inf or 0 a little further). Half-precision activations
    overflow much earlier: ``q' = scale * q`` exceeds float16's 65504 for ``|q| = 1`` once
    ``|n'| > gamma ln 65504 / ln 3.5``, about 4.5K for ``gamma = 512``; bfloat16 has float32's
    range.

    Args:
        head_dim: per-head dimension of q and k, even.
        base: RoPE base, a finite number > 1 (torchscale fixes 10000), the package's one rule
            for a base (:func:`companion._checks.check_base`).
        scale_base: ``gamma``, a finite number > 0 (torchscale's default 512).
        layout: ``"interleaved"`` (torchscale) or ``"half"`` (HuggingFace).
        center: a fixed integer centre ``c``, or ``None`` for torchscale's rule above.

    Raises:
        TypeError: ``head_dim`` is not an int, ``base`` or ``scale_base`` not a real number (a
            string, a bool, ``None``), ``center`` neither an int nor ``None``.
        ValueError: ``head_dim`` is not an even int >= 2, ``base`` is not finite and > 1
            (``base = 1`` turns every pair alike, ``base < 1`` reverses the ladder),
            ``scale_base`` not finite and > 0, or ``layout`` unknown.
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, scale_base: float = 512.0,
                 layout: str = "interleaved", center: int | None = None) -> None:
        super().__init__()
        self.head_dim = _check_head_dim(head_dim)
        self.base = check_base(base)
        self.scale_base = check_finite_number(scale_base, "scale_base")
        self.layout = check_layout(layout)
        if center is not None:
            if isinstance(center, bool) or not isinstance(center, numbers.Integral):
                raise TypeError(f"center must be an int or None, got {type(center).__name__} {center!r}")
            center = int(center)
        self.center = center
        #: the largest accepted ``|position - centre|`` (see :func:`xpos_max_centered_position`)
        self.max_centered_position = xpos_max_centered_position(self.scale_base)

    def zeta(self, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> Tensor:
        """``zeta_i = (2 i + 0.4 d) / (1.4 d)``, ``i = 0 .. d/2 - 1`` (torchscale's expression)."""
        d = self.head_dim
        return (torch.arange(0, d, 2, dtype=dtype, device=device) + 0.4 * d) / (1.4 * d)

    def centre_for(self, k_pos: Tensor) -> int:
        """The centre ``c`` used for keys at ``k_pos``: ``center`` if set, else ``ceil((max(k_pos) + 1) / 2)``.

        ``0`` for empty ``k_pos``. This is torchscale's ``-min_pos`` for keys ``0 .. L - 1``.
        """
        if self.center is not None:
            return self.center
        if k_pos.numel() == 0:
            return 0
        length = int(k_pos.max()) + 1
        return -((-length) // 2)  # ceil(length / 2), also for negative lengths

    def scale(self, pos: Tensor, centre: int, *, key: bool = False) -> Tensor:
        """float64 scales ``zeta_i ** (+-(pos - centre) / gamma)``, shape ``pos.shape + (d/2,)``.

        The sign is ``+`` for queries, ``-`` for keys (``key=True``). Raises ``ValueError`` naming
        the offending position when ``|pos - centre|`` exceeds :attr:`max_centered_position`.
        """
        rel = pos.to(torch.int64) - centre
        if rel.numel():
            worst = int(rel.abs().max())
            if worst > self.max_centered_position:
                bad = int(pos.reshape(-1)[rel.abs().reshape(-1).argmax()])
                raise ValueError(
                    f"{'k_pos' if key else 'q_pos'} holds position {bad}, {worst} from the centre {centre}: "
                    f"xPos scales zeta ** (+-(position - centre) / scale_base) leave float32's normal range "
                    f"beyond |position - centre| = {self.max_centered_position} (scale_base={self.scale_base:g}); "
                    f"use shorter sequences, a larger scale_base or a centre closer to the positions"
                )
        exponent = rel.to(torch.float64) / self.scale_base
        if key:
            exponent = -exponent
        return self.zeta(torch.float64, pos.device) ** exponent.unsqueeze(-1)

    def _xpos_one(self, x: Tensor, pos: Tensor, centre: int, key: bool, work: torch.dtype) -> Tensor:
        if pos.numel() == 0:
            return x.clone()
        scale = self.scale(pos, centre, key=key).to(work)
        inv_freq = rope_frequencies(self.head_dim, self.base, x.device, dtype=work)
        cos, sin = rope_cos_sin(pos, inv_freq, compute_dtype=work)
        # (seq, h) tables are read from row 0; (batch, seq, h) ones are per-row gathered rows
        return rope_rotate(x, cos * scale, sin * scale, layout=self.layout)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Apply xPos to ``q`` at ``q_pos`` and ``k`` at ``k_pos`` (see the class doc).

        ``q`` is ``(batch, heads, q_len, head_dim)``, ``k`` ``(batch, kv_heads, k_len,
        head_dim)`` (any number of key heads, for GQA); positions are int64 ``(seq,)`` or
        ``(batch, seq)``. Both are centred by :meth:`centre_for` ``(k_pos)``. float64 inputs
        are computed in float64, others in float32 and cast back.
        """
        _check_qk(q, k, self.head_dim, type(self).__name__)
        q_pos = as_positions(q_pos, "q_pos", q.shape[2], q.shape[0], q.device)
        k_pos = as_positions(k_pos, "k_pos", k.shape[2], k.shape[0], k.device)
        work = torch.float64 if torch.float64 in (q.dtype, k.dtype) else torch.float32
        centre = self.centre_for(k_pos if k_pos.numel() else q_pos)
        return self._xpos_one(q, q_pos, centre, False, work), self._xpos_one(k, k_pos, centre, True, work)

    def extra_repr(self) -> str:
        centre = "ceil((max(k_pos) + 1) / 2)" if self.center is None else str(self.center)
        return (f"head_dim={self.head_dim}, base={self.base:g}, scale_base={self.scale_base:g}, "
                f"layout={self.layout!r}, center={centre}")


def _check_p(p: object) -> float:
    value = check_finite_number(p, "p", minimum=0.0)
    if value > 1:
        raise ValueError(f"p must lie in [0, 1] (the fraction of frequencies kept), got {p!r}")
    return value


class PRoPE(RotaryEmbedding):
    """p-RoPE (Barbero et al., :cite:`barbero2025round`): RoPE with its lowest frequencies removed.

    Of RoPE's ``h = head_dim / 2`` frequencies ``theta_i = base ** (-2 i / head_dim)``
    (decreasing in ``i``), the first ``k = int(p * head_dim // 2)`` -- the *highest* ones,
    ``i < k`` -- are kept; the other ``h - k`` (the lowest) are set to 0, so those pairs are not
    rotated (the identity, for finite inputs: ``a * 1 - b * 0``). The exponents keep the
    denominator ``head_dim`` (not ``2 k``): the kept frequencies are exactly RoPE's. The
    rotation spans the whole head, with the zero-frequency pairs where the layout puts pairs
    ``i >= k`` (in ``"half"``, dims ``k .. h-1`` and ``h + k .. d-1``).

    Rounding: ``int(p * head_dim // 2)``, HuggingFace's expression for its ``proportional``
    type, float arithmetic included (:func:`companion.scaling.proportional_rope_angles`); the
    paper's pseudocode has the same line (``rope_angles = int(rope_percentage * head_dim // 2)``).
    ``p = 1`` gives RoPE and ``p = 0`` NoPE, bit for bit. This equals
    ``RotaryEmbedding(head_dim, rope_config={"rope_type": "proportional",
    "partial_rotary_factor": p, "rope_theta": base})`` in float32; in float64 this class
    recomputes its frequencies in float64, as ``RotaryEmbedding(base=...)`` does.

    It differs from GPT-NeoX's partial rotary (``rotary_dim = p * head_dim``), which rotates the
    first ``rotary_dim`` dims with ``base ** (-2 i / rotary_dim)``: the same number of rotating
    pairs, but spread over all of RoPE's range of frequencies, the lowest included.

    Everything else is :class:`companion.rope.RotaryEmbedding`'s (cache, layouts, precision).

    Args:
        head_dim: per-head dimension of q and k, even.
        p: the fraction of frequencies kept, in ``[0, 1]``.
        base: RoPE base, a finite number > 1 (:func:`companion._checks.check_base`).
        layout: ``"half"`` (HuggingFace, Gemma) or ``"interleaved"``.
        compute_dtype, max_cached_positions, device: as for ``RotaryEmbedding``.
    """

    def __init__(self, head_dim: int, p: float = 0.75, *, base: float = 10000.0, layout: str = "half",
                 compute_dtype: torch.dtype | None = None, max_cached_positions: int = 1 << 16,
                 device: torch.device | str | None = None) -> None:
        _check_head_dim(head_dim)
        p = _check_p(p)
        base = check_base(base)
        super().__init__(head_dim, base=base, layout=layout, compute_dtype=compute_dtype,
                         max_cached_positions=max_cached_positions, device=device)
        #: the fraction of frequencies kept
        self.p = p
        #: the number of pairs that rotate, ``int(p * head_dim // 2)``
        self.rotating_pairs = proportional_rope_angles(head_dim, p)
        #: the RoPE base the kept frequencies come from
        self.p_base = base
        self.set_frequencies(self._frequencies(torch.float32, self.inv_freq.device))
        self._exact = True  # frequencies from p and base: float64 tables recompute them in float64

    def _frequencies(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        inv_freq = rope_frequencies(self.head_dim, self.p_base, device, dtype=dtype)
        inv_freq[self.rotating_pairs:] = 0.0
        return inv_freq

    def set_frequencies(self, inv_freq: Tensor, attention_scaling: float = 1.0) -> None:
        """Replace the frequencies (see ``RotaryEmbedding.set_frequencies``); they are then custom:
        float64 tables use them as given instead of recomputing p-RoPE's in float64."""
        super().set_frequencies(inv_freq, attention_scaling)
        self._exact = False

    def set_rope_config(self, rope_config: object, max_position_embeddings: int | None = None) -> None:
        """Not supported: p-RoPE's frequencies are fixed by ``p`` and ``base`` (``TypeError``).

        Use ``RotaryEmbedding(head_dim, rope_config={"rope_type": "proportional", ...})`` for a
        config-driven p-RoPE.
        """
        raise TypeError(
            "PRoPE's frequencies are fixed by p and base; for a config use RotaryEmbedding(head_dim, "
            "rope_config={'rope_type': 'proportional', 'partial_rotary_factor': p, ...})"
        )

    def _tables(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        # RotaryEmbedding._tables, except that float64 tables recompute p-RoPE's frequencies
        # (with their zeros) in float64, where the parent would recompute plain RoPE's.
        angles = self.compute_dtype or dtype
        inv_freq = self.inv_freq
        if angles == dtype == torch.float64 and self._exact:
            inv_freq = self._frequencies(torch.float64, inv_freq.device)
        cos, sin = rope_cos_sin(positions, inv_freq, attention_scaling=self.attention_scaling, compute_dtype=angles)
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, p={self.p:g}, rotating_pairs={self.rotating_pairs} of "
                f"{self.head_dim // 2}, base={self.p_base:g}, layout={self.layout!r}, "
                f"cached_positions={self.cached_positions}")
