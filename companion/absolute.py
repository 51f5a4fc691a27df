"""Absolute position encodings: the sinusoidal table and the learned table.

Both add a vector that depends only on a token's position to its embedding, so both are
schemes that use the ``embed`` hook of :class:`~companion.attention.PositionScheme`.

The sinusoidal encoding of Vaswani et al. (:cite:`vaswani2017attention`) fills column ``j``
of the row for position ``p`` with::

    angle(p, j) = p / base ** (2 * (j // 2) / dim)
    PE[p, j]    = sin(angle)  if j is even
                  cos(angle)  if j is odd

so columns ``2i`` and ``2i + 1`` form a sin/cos pair that turns at angular frequency
``omega_i = base ** (-2i / dim)`` radians per position, with wavelength ``2 pi / omega_i``.
Pair 0 (the first two columns) is the *fastest*, wavelength ``2 pi``; the last pair is the
slowest, wavelength close to ``2 pi * base``. The columns are interleaved ``sin, cos, sin,
cos, ...`` exactly as in HuggingFace's ``create_sinusoidal_embeddings`` (DistilBERT, XLM).

**Odd ``dim``.** The same formula is applied to every column index, so for odd ``dim`` the
last column ``dim - 1`` (an even index) is a sine with the next frequency
``omega_{(dim-1)/2} = base ** (-(dim - 1) / dim)``, and it has no cosine partner. This is
what the column formula above gives literally, and what ``create_sinusoidal_embeddings``
produces for odd ``dim``.

**Numerics.** Angles are computed in float64 from integer positions and cast to the
requested dtype only at the end. In float16, only the integers up to 2048 are exact; in
bfloat16 only those up to 256 (see chapter 2).

The learned table (BERT, :cite:`devlin2019bert`; GPT-2, :cite:`radford2019language`) is a
trainable ``(n_positions, dim)`` matrix whose row ``p`` is added at position ``p``. It has
no row for a position at or beyond ``n_positions``: asking for one raises ``IndexError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ._checks import (
    as_positions,
    check_base,
    check_bool,
    check_finite_number,
    check_float_dtype,
    check_float_tensor,
    check_int_tensor,
    check_position_range,
    check_positive_int,
    check_tensor,
)
from .attention import PositionScheme

__all__ = [
    "sinusoidal_frequencies",
    "sinusoidal_wavelengths",
    "sinusoidal_encoding",
    "sinusoidal_table",
    "SinusoidalEmbedding",
    "ScaledSinusoidalEmbedding",
    "LearnedPositionalEmbedding",
]


def sinusoidal_frequencies(dim: int, base: float = 10000.0) -> Tensor:
    """Angular frequency of every column: ``omega_j = base ** (-2 * (j // 2) / dim)``.

    Returns a float64 tensor of shape ``(dim,)``: the two columns of a sin/cos pair share a
    frequency. Radians per position (Vaswani et al., :cite:`vaswani2017attention`).
    """
    check_positive_int(dim, "dim")
    base = check_base(base)
    pair = torch.div(torch.arange(dim, dtype=torch.int64), 2, rounding_mode="floor")
    return torch.pow(torch.tensor(base, dtype=torch.float64), -(2.0 * pair.double()) / dim)


def sinusoidal_wavelengths(dim: int, base: float = 10000.0) -> Tensor:
    """Wavelength in positions of every frequency pair: ``2 pi * base ** (2i / dim)``.

    Float64, shape ``(ceil(dim / 2),)``; entry ``i`` belongs to columns ``2i`` and ``2i + 1``
    (for odd ``dim`` the last entry belongs to the lone sine column ``dim - 1``). Strictly
    increasing: pair 0 is the fastest.
    """
    return 2.0 * math.pi / sinusoidal_frequencies(dim, base)[0::2]


def sinusoidal_encoding(
    positions: Tensor | Sequence[int],
    dim: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Sinusoidal encodings of arbitrary integer positions, shape ``positions.shape + (dim,)``.

    ``PE[p, 2i] = sin(p * omega_i)``, ``PE[p, 2i+1] = cos(p * omega_i)``,
    ``omega_i = base ** (-2i / dim)`` (Vaswani et al., :cite:`vaswani2017attention`).
    Any integers are accepted, negative ones included (the formula is defined for all of
    them). Computed in float64, cast to ``dtype`` at the end.
    """
    check_positive_int(dim, "dim")
    check_float_dtype(dtype)
    positions = check_int_tensor(positions, "positions")
    omega = sinusoidal_frequencies(dim, base).to(positions.device)
    angle = positions.to(torch.float64).unsqueeze(-1) * omega
    out = torch.empty_like(angle)
    out[..., 0::2] = torch.sin(angle[..., 0::2])
    out[..., 1::2] = torch.cos(angle[..., 1::2])
    return out.to(dtype)


def sinusoidal_table(
    n_positions: int,
    dim: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The ``(n_positions, dim)`` sinusoidal table for positions ``0 .. n_positions - 1``.

    Row ``p`` is :func:`sinusoidal_encoding` of ``p``: columns ``sin, cos, sin, cos, ...``
    with ``omega_i = base ** (-2i / dim)`` (:cite:`vaswani2017attention`). Odd ``dim``: the
    last column is a sine at the next frequency (see the module docstring). Computed in
    float64, cast to ``dtype`` at the end.
    """
    check_positive_int(n_positions, "n_positions")
    check_positive_int(dim, "dim")
    return sinusoidal_encoding(torch.arange(n_positions), dim, base, dtype)


def _embed_positions(x: Tensor, pos: Tensor | Sequence[int] | None, dim: int) -> Tensor:
    """Validate a floating ``x`` ``(batch, seq, dim)`` and its positions; return int64 positions.

    An integer ``x`` raises ``TypeError``: the float encoding added in its dtype would be
    truncated (``sin`` and ``cos`` to 0 and 1)."""
    check_float_tensor(x, "x", 3)
    if x.shape[-1] != dim:
        raise ValueError(f"x must have last dimension {dim} (the scheme's dim), got {x.shape[-1]}")
    b, n, _ = x.shape
    return as_positions(pos, "pos", n, b, x.device)


class SinusoidalEmbedding(PositionScheme):
    """Adds the fixed sinusoidal encoding to token embeddings (``embed`` hook).

    ``embed(x, pos) = x + PE[pos]`` with :func:`sinusoidal_encoding`; no parameters, no
    length limit. Positions must be ``>= 0``. The encoding is computed in float64 for the
    positions asked for and cast to ``x``'s dtype (Vaswani et al.,
    :cite:`vaswani2017attention`).

    Args:
        dim: model width ``d_model`` (any positive int; odd is allowed).
        base: the ``10000`` of the formula; sets the longest wavelength (about
            ``2 pi * base`` positions).
    """

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim = check_positive_int(dim, "dim")
        self.base = check_base(base)

    def encoding(self, pos: Tensor) -> Tensor:
        """The (unscaled) encoding of integer positions ``pos``, float64."""
        return sinusoidal_encoding(pos, self.dim, self.base, torch.float64)

    def embed(self, x: Tensor, pos: Tensor | Sequence[int] | None = None) -> Tensor:
        pos = _embed_positions(x, pos, self.dim)
        check_position_range(pos, "pos", 0)
        return x + self.encoding(pos).to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}, " + super().extra_repr()


class ScaledSinusoidalEmbedding(SinusoidalEmbedding):
    """Sinusoidal encoding times one learned scalar gain: ``x + g * PE[pos]``.

    The sinusoidal table is fixed; only ``g`` (a single parameter shared by all positions and
    columns) is trained, so the network can choose how loud position is relative to the token
    embeddings. Since ``||PE(p)||^2 = dim / 2`` for even ``dim``, the default starting gain
    ``dim ** -0.5`` gives the added vector the norm ``sqrt(1/2)`` whatever the width. This
    follows the ``ScaledSinusoidalEmbedding`` of the x-transformers library (same form, same
    starting gain); we do not attribute it to a paper.

    Args:
        dim: model width.
        base: the sinusoid base.
        init_scale: starting value of the gain (default ``dim ** -0.5``).
    """

    def __init__(self, dim: int, base: float = 10000.0, init_scale: float | None = None) -> None:
        super().__init__(dim, base)
        init = self.dim**-0.5 if init_scale is None else check_finite_number(init_scale, "init_scale", positive=False)
        self.scale = nn.Parameter(torch.tensor(init, dtype=torch.float32))

    def embed(self, x: Tensor, pos: Tensor | Sequence[int] | None = None) -> Tensor:
        pos = _embed_positions(x, pos, self.dim)
        check_position_range(pos, "pos", 0)
        pe = self.encoding(pos).to(self.scale.dtype) * self.scale
        return x + pe.to(x.dtype)


class LearnedPositionalEmbedding(PositionScheme):
    """A trainable ``(n_positions, dim)`` table whose row ``p`` is added at position ``p``.

    ``embed(x, pos) = x + W[pos]``, as in BERT (:cite:`devlin2019bert`) and GPT-2
    (:cite:`radford2019language`). Rows start as ``Normal(0, init_std)`` (``0.02`` is the
    ``initializer_range`` of HuggingFace's BERT and GPT-2 configs). A row receives gradient
    only from the tokens that sit at its position, so rows for positions never seen in
    training keep their initial values (chapter 3). Positions must lie in
    ``[0, n_positions)``; anything else raises ``IndexError`` naming the limit.

    Args:
        n_positions: number of rows, i.e. the longest sequence the table can encode.
        dim: model width.
        init_std: standard deviation of the initial rows.
        generator: optional ``torch.Generator`` for the initial values.
    """

    def __init__(
        self,
        n_positions: int,
        dim: int,
        init_std: float = 0.02,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.n_positions = check_positive_int(n_positions, "n_positions")
        self.dim = check_positive_int(dim, "dim")
        init_std = check_finite_number(init_std, "init_std", minimum=0)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.weight = nn.Parameter(torch.empty(n_positions, dim))
        nn.init.normal_(self.weight, mean=0.0, std=init_std, generator=generator)

    @classmethod
    def from_pretrained(cls, table: Tensor, freeze: bool = True) -> LearnedPositionalEmbedding:
        """Wrap an existing ``(n_positions, dim)`` table, e.g. a BERT checkpoint's
        ``embeddings.position_embeddings.weight`` (see :mod:`companion.pretrained`)."""
        check_tensor(table, "table", 2)
        check_bool(freeze, "freeze")
        if not table.dtype.is_floating_point:
            raise TypeError(f"table must be floating point, got dtype {table.dtype}")
        n, d = table.shape
        if n < 1 or d < 1:
            raise ValueError(f"table must have at least one row and one column, got {tuple(table.shape)}")
        module = cls(n, d, init_std=0.0)
        module.weight = nn.Parameter(table.detach().clone(), requires_grad=not freeze)
        return module

    def lookup(self, pos: Tensor | Sequence[int]) -> Tensor:
        """Rows ``W[pos]`` for integer positions of any shape; ``IndexError`` outside the table."""
        pos = check_int_tensor(pos, "pos").to(self.weight.device)
        check_position_range(pos, "pos", 0, self.n_positions)
        return self.weight[pos]

    def embed(self, x: Tensor, pos: Tensor | Sequence[int] | None = None) -> Tensor:
        pos = _embed_positions(x, pos, self.dim)
        return x + self.lookup(pos).to(x.dtype)

    def extra_repr(self) -> str:
        return f"n_positions={self.n_positions}, dim={self.dim}, " + super().extra_repr()
