"""Positions on 2-D and 3-D grids: image patches, video frames, and Qwen2-VL's M-RoPE.

A vision transformer cuts an image into an ``H x W`` grid of patches and a video into a
``T x H x W`` grid; a multimodal LLM interleaves such grids with text. A token's position is
then a tuple of integers, one per axis. This module gives every scheme of the book's grid
chapter, each a :class:`~companion.attention.PositionScheme` with
``position_axes = A > 1``, whose positions are int64 tensors ``(seq, A)`` (shared by the
batch) or ``(batch, seq, A)`` (per row):

* :class:`Sinusoidal2DEmbedding` (``embed``): MAE's fixed 2-D sin-cos table, half of the
  channels encoding the column and half the row;
* :class:`LearnedGridEmbedding` (``embed``): ViT's learned table, one vector per cell,
  resampled (bicubic) to run at another resolution;
* :class:`AxialRoPE` (``rotate``): a 1-D RoPE per axis on disjoint blocks of pairs (rope-vit's
  RoPE-Axial);
* :class:`MixedRoPE` (``rotate``): learned per-head frequencies that mix the axes, angle
  ``w_y y + w_x x`` (rope-vit's RoPE-Mixed);
* :class:`MRoPE` (``rotate``): Qwen2-VL's multimodal RoPE, sections of pairs for time,
  height and width (and Qwen3-VL's interleaved sections).

Conventions. Axes come in the order of the grid's shape: for an image ``(H, W)``, axis 0 is
the row (``y``) and axis 1 the column (``x``); for Qwen2-VL, ``(t, h, w)``. Tokens are
flattened row-major, last axis fastest (:func:`grid_positions`), as a ViT's patch sequence
and Qwen2-VL's vision tokens are. Angles and tables are computed in float32 or better, never
in the activations' dtype; the rotation is :func:`companion.rope.apply_rope`'s arithmetic.

Every rotary scheme here has one form: pair ``j`` turns by ``angle_j = sum_a pos[a] *
F[a, j]`` for a frequency matrix ``F`` (:func:`grid_rope_angles`), so the dot product of a
rotated query and key depends on the two positions only through their difference
``(dy, dx)`` (or ``(dt, dy, dx)``). Axial RoPE and M-RoPE give each pair one axis (each
column of ``F`` has one non-zero entry); RoPE-Mixed learns a dense ``F`` per head, so a pair
can turn along a diagonal direction.

The attention functions take these positions (:func:`companion.attention.attention`,
:func:`companion.dispatch.fast_attention`); with ``causal=True`` they mask by sequence
index, since grid positions have no order. :func:`qwen2vl_position_ids` builds Qwen2-VL's
positions for a prompt of text, images and videos.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import (
    INT_DTYPES,
    as_grid_positions,
    check_base,
    check_finite_number,
    check_float_dtype,
    check_float_tensor,
    check_int_tensor,
    check_positive_int,
    check_tensor,
)
from .attention import PositionScheme
from .rope import (
    _FP32_EXACT_INT,
    _rotate,
    check_inv_freq,
    check_layout,
    check_qk_head_dim,
    check_rotary_dim,
    check_scheme_device,
    rope_frequencies,
)

__all__ = [
    "GRID_SCHEMES",
    "grid_positions",
    "sinusoidal_2d_table",
    "Sinusoidal2DEmbedding",
    "LearnedGridEmbedding",
    "axial_rope_frequencies",
    "grid_rope_angles",
    "AxialRoPE",
    "MixedRoPE",
    "mrope_axis_of_pair",
    "mrope_cos_sin",
    "MRoPE",
    "qwen2vl_position_ids",
]


# ----------------------------------------------------------------------------- positions


def _grid_shape(shape: object, name: str = "shape", max_axes: int = 3) -> tuple[int, ...]:
    """A grid shape: a tuple (or list) of 1..``max_axes`` ints >= 1 (``ValueError`` otherwise)."""
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)) or not 1 <= len(shape) <= max_axes:
        raise ValueError(f"{name} must be a tuple of 1 to {max_axes} grid sizes, such as (H, W), got {shape!r}")
    sizes = []
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or int(s) < 1:
            raise ValueError(f"{name} must hold integer grid sizes >= 1, got {shape!r}")
        sizes.append(int(s))
    return tuple(sizes)


def grid_positions(shape: Sequence[int], *, device: torch.device | str | None = None) -> Tensor:
    """The positions of every cell of a grid, row-major: ``(prod(shape), len(shape))`` int64.

    ``grid_positions((2, 3))`` is ``[[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]``: token
    ``i`` of a flattened ``H x W`` image sits at row ``i // W``, column ``i % W``, the order of
    a ViT's patch sequence (:cite:`dosovitskiy2021vit`). A ``(T, H, W)`` shape gives video
    positions ``(t, h, w)``.

    Args:
        shape: 1 to 3 grid sizes, ints >= 1.
        device: where to build the tensor.

    Raises:
        ValueError: a size that is not an int >= 1 (``3.5``, ``0``, ``True``), or not 1 to 3
            of them.
    """
    sizes = _grid_shape(shape)
    axes = [torch.arange(s, device=device) for s in sizes]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(sizes))


# ----------------------------------------------------------------------------- embed schemes


def sinusoidal_2d_table(positions: Tensor, dim: int, base: float = 10000.0, *,
                        dtype: torch.dtype = torch.float32) -> Tensor:
    """MAE's fixed 2-D sin-cos position table for ``(row, col)`` positions.

    With ``q = dim // 4`` frequencies ``w_i = base ** (-i / q)``, ``i = 0 .. q - 1``, the
    ``dim`` channels of a cell at row ``y``, column ``x`` are::

        [sin(x w), cos(x w), sin(y w), cos(y w)]     (four blocks of q channels)

    the first half encoding the column and the second the row. This is
    ``get_2d_sincos_pos_embed`` of MAE (:cite:`he2022mae`) exactly (its ``meshgrid(grid_w,
    grid_h)`` puts the column first), which ViTs with fixed 2-D tables use. It is computed in
    float64, as MAE's numpy code is, and cast to ``dtype`` at the end.

    Args:
        positions: integer ``(..., 2)``, ``(row, col)`` (from :func:`grid_positions`).
        dim: channels, a positive multiple of 4.
        base: the ``10000`` of the formula, a finite number > 1.
        dtype: the floating dtype of the result (an integer dtype raises ``TypeError``).

    Returns:
        ``positions.shape[:-1] + (dim,)``.
    """
    pos = check_int_tensor(positions, "positions", what="grid positions")
    if pos.dim() < 1 or pos.shape[-1] != 2:
        raise ValueError(f"positions must have shape (..., 2), (row, col), got {tuple(pos.shape)}")
    check_positive_int(dim, "dim")
    if dim % 4:
        raise ValueError(f"dim must be a multiple of 4 (sin and cos for each of 2 axes), got {dim}")
    base = check_base(base)
    check_float_dtype(dtype)
    q = dim // 4
    omega = 1.0 / base ** (torch.arange(q, dtype=torch.float64, device=pos.device) / q)
    blocks = []
    for axis in (1, 0):  # column first, as MAE
        out = pos[..., axis].to(torch.float64).unsqueeze(-1) * omega
        blocks += [out.sin(), out.cos()]
    return torch.cat(blocks, dim=-1).to(dtype)


def _embed_grid(x: object, pos: object, dim: int, axes: int) -> Tensor:
    check_float_tensor(x, "x", 3)
    assert isinstance(x, Tensor)
    if x.shape[-1] != dim:
        raise ValueError(f"x must have last dimension {dim} (the scheme's d_model), got {x.shape[-1]}")
    return as_grid_positions(pos, "pos", x.shape[1], axes, x.shape[0], x.device)


class Sinusoidal2DEmbedding(PositionScheme):
    """The fixed 2-D sin-cos table added to patch embeddings (``embed`` hook), as in MAE.

    ``embed(x, pos) = x + T[pos]`` with :func:`sinusoidal_2d_table` (:cite:`he2022mae`); no
    parameters, any grid size. The table is computed in float64 and added in ``x``'s dtype.

    Args:
        d_model: model width, a multiple of 4.
        base: the ``10000`` of the formula.
    """

    position_axes = 2

    def __init__(self, d_model: int, base: float = 10000.0) -> None:
        super().__init__()
        self.d_model = check_positive_int(d_model, "d_model")
        if d_model % 4:
            raise ValueError(f"d_model must be a multiple of 4 (sin and cos for each of 2 axes), got {d_model}")
        self.base = check_base(base)

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """``x + table[pos]``; ``x`` ``(batch, seq, d_model)``, ``pos`` ``(seq, 2)`` or
        ``(batch, seq, 2)``."""
        pos = _embed_grid(x, pos, self.d_model, 2)
        return x + sinusoidal_2d_table(pos, self.d_model, self.base, dtype=torch.float64).to(x.dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, base={self.base:g}, " + super().extra_repr()


class LearnedGridEmbedding(PositionScheme):
    """A learned vector per grid cell, added to the patch embeddings (``embed`` hook), as in ViT.

    ``embed(x, pos) = x + table[pos[..., 0], pos[..., 1]]`` (:cite:`dosovitskiy2021vit`).
    The table has no rows beyond the grid it was trained on: a position outside it raises
    ``IndexError``. To run at another resolution, ViT, DeiT and MAE resample the table
    (:meth:`resized`, bicubic interpolation), which keeps every cell's vector near the one at
    the same *relative* place in the image, not the same patch offset.

    Args:
        grid: the grid size per axis, 1 to 3 ints >= 1 (``(H, W)`` for images).
        d_model: model width.
        init_std: the standard deviation of the initial table (ViT uses 0.02).
    """

    def __init__(self, grid: Sequence[int], d_model: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.grid = _grid_shape(grid, "grid")
        self.position_axes = len(self.grid)
        self.d_model = check_positive_int(d_model, "d_model")
        init_std = check_finite_number(init_std, "init_std", minimum=0.0)
        self.table = nn.Parameter(torch.randn(*self.grid, d_model) * init_std)

    def lookup(self, pos: Tensor) -> Tensor:
        """The table rows for integer grid positions ``(..., axes)``: ``(..., d_model)``."""
        pos = check_int_tensor(pos, "pos", what="grid positions")
        if pos.dim() < 1 or pos.shape[-1] != len(self.grid):
            raise ValueError(f"pos must have shape (..., {len(self.grid)}), got {tuple(pos.shape)}")
        for a, size in enumerate(self.grid):
            if pos.numel():
                lo, hi = int(pos[..., a].min()), int(pos[..., a].max())
                if lo < 0 or hi >= size:
                    bad = lo if lo < 0 else hi
                    raise IndexError(
                        f"pos on axis {a} must be in [0, {size}) (the table covers a grid of "
                        f"{self.grid}), got {bad}; use .resized(new_grid) for a larger grid"
                    )
        return self.table[tuple(pos[..., a] for a in range(len(self.grid)))]

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """``x + table[pos]``; ``x`` ``(batch, seq, d_model)``, ``pos`` ``(seq, axes)`` or
        ``(batch, seq, axes)``."""
        pos = _embed_grid(x, pos, self.d_model, len(self.grid))
        return x + self.lookup(pos).to(x.dtype)

    def resized(self, grid: Sequence[int]) -> LearnedGridEmbedding:
        """A copy whose table is resampled to ``grid`` (same number of axes).

        ``torch.nn.functional.interpolate`` with ``align_corners=False``: bicubic for 2 axes
        (what DeiT and MAE do to fine-tune at a new resolution), trilinear for 3, linear for
        1. The new table is a fresh parameter; the original is unchanged.
        """
        grid = _grid_shape(grid, "grid")
        if len(grid) != len(self.grid):
            raise ValueError(f"grid must have {len(self.grid)} axes like the table's {self.grid}, got {grid}")
        mode = {1: "linear", 2: "bicubic", 3: "trilinear"}[len(grid)]
        with torch.no_grad():
            t = self.table.movedim(-1, 0).unsqueeze(0)  # (1, d, *grid)
            new = F.interpolate(t, size=grid, mode=mode, align_corners=False)
            new = new.squeeze(0).movedim(0, -1).contiguous()
        out = LearnedGridEmbedding(grid, self.d_model, init_std=0.0).to(self.table.device, self.table.dtype)
        out.table = nn.Parameter(new, requires_grad=self.table.requires_grad)
        return out

    def extra_repr(self) -> str:
        return f"grid={self.grid}, d_model={self.d_model}, " + super().extra_repr()


# ----------------------------------------------------------------------------- rotary schemes


def axial_rope_frequencies(rotary_dim: int, n_axes: int = 2, base: float = 100.0, *,
                           dtype: torch.dtype = torch.float32,
                           device: torch.device | str | None = None) -> Tensor:
    """Axial RoPE's frequency matrix ``F``, ``(n_axes, rotary_dim // 2)``.

    The ``P = rotary_dim // 2`` pairs are split into ``n_axes`` equal blocks; block ``a``
    turns with axis ``a`` only, as a 1-D RoPE of dimension ``rotary_dim / n_axes``: pair
    ``j = a * (P / n_axes) + i`` has ``F[a, j] = base ** (-2 n_axes i / rotary_dim)`` and
    ``F[a', j] = 0`` for every other axis. For 2 axes this is rope-vit's RoPE-Axial,
    ``1 / theta ** (arange(0, d, 4)[: d // 4] / d)`` per axis (Heo et al.,
    :cite:`heo2024ropevit`), whose default ``base`` (theta) is 100.

    Raises:
        ValueError: ``rotary_dim // 2`` not a multiple of ``n_axes``.
    """
    check_positive_int(n_axes, "n_axes")
    check_positive_int(rotary_dim, "rotary_dim", minimum=2)
    if rotary_dim % 2 or (rotary_dim // 2) % n_axes:
        raise ValueError(
            f"rotary_dim must be even with rotary_dim // 2 a multiple of n_axes={n_axes} (each axis "
            f"gets the same number of pairs), got {rotary_dim}"
        )
    per_axis = rotary_dim // 2 // n_axes
    freq = rope_frequencies(2 * per_axis, base, device, dtype=dtype)
    out = torch.zeros(n_axes, rotary_dim // 2, dtype=dtype, device=device)
    for a in range(n_axes):
        out[a, a * per_axis:(a + 1) * per_axis] = freq
    return out


def grid_rope_angles(positions: Tensor, freqs: Tensor) -> Tensor:
    """Rotation angles ``angle[..., j] = sum_a pos[..., a] * freqs[..., a, j]``.

    The sum is taken axis by axis in order, each product rounded once, in ``freqs``' dtype
    widened to float32 at least (for two axes ``x * fx + y * fy``, rope-vit's
    ``freqs_x + freqs_y``). A zero entry of ``freqs`` adds an exact zero, so a one-hot matrix
    (axial RoPE, M-RoPE) gives exactly ``pos[axis(j)] * f_j``.

    Args:
        positions: integer ``(seq, A)`` or ``(batch, seq, A)``.
        freqs: ``(A, P)``, or ``(heads, A, P)`` for per-head frequencies.

    Returns:
        ``positions.shape[:-1] + (P,)`` for ``(A, P)`` frequencies (``(seq, P)`` or
        ``(batch, seq, P)``, as :func:`companion.rope.rope_cos_sin`); ``(heads, seq, P)`` or
        ``(batch, heads, seq, P)`` for per-head ones.
    """
    pos = check_int_tensor(positions, "positions", dims=(2, 3), what="grid positions")
    check_tensor(freqs, "freqs")
    if freqs.dim() not in (2, 3) or freqs.shape[-2] != pos.shape[-1]:
        raise ValueError(
            f"freqs must have shape (A, P) or (heads, A, P) with A = {pos.shape[-1]} axes like the "
            f"positions, got {tuple(freqs.shape)}"
        )
    work = torch.promote_types(freqs.dtype, torch.float32)
    if work == torch.float32 and pos.numel() and int(pos.abs().max()) >= _FP32_EXACT_INT:
        raise ValueError(f"positions must be < 2**24 for float32 angles, got {int(pos.abs().max())}")
    f = freqs.to(work)
    if f.dim() == 2:
        f = f.unsqueeze(0)  # (1, A, P)
    p = pos.to(work)
    if p.dim() == 2:
        p = p.unsqueeze(0)  # (1, seq, A)
    angle = None
    for a in range(pos.shape[-1]):
        term = p[:, None, :, a, None] * f[None, :, a, None, :]  # (b, heads, seq, P)
        angle = term if angle is None else angle + term
    assert angle is not None
    if freqs.dim() == 2:
        angle = angle.squeeze(1)
    return angle if pos.dim() == 3 else angle.squeeze(0)


class _GridRotary(PositionScheme):
    """Shared ``rotate`` of the grid RoPEs: angles from :meth:`_angles`, then the rotation of
    :func:`companion.rope.apply_rope` (``a' = a c - b s``, ``b' = b c + a s``)."""

    head_dim: int
    rotary_dim: int
    layout: str
    #: whether each head has its own frequencies (tables ``(..., heads, seq, P)``) or all
    #: heads share them (``(..., seq, P)``)
    per_head: bool = False
    #: the attribute holding the frequencies (the device the tables are built on)
    _freq_attr: str = "freqs"

    def _angles(self, pos: Tensor, dtype: torch.dtype) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _cos_sin(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        angle = self._angles(pos, dtype)
        return angle.cos(), angle.sin()

    def _table(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin shaped to broadcast against ``(batch, heads, seq, head_dim)``."""
        c, s = self._cos_sin(pos, dtype)
        if not self.per_head:
            c, s = c.unsqueeze(-3), s.unsqueeze(-3)     # a heads axis of 1
        if c.dim() == 3:
            c, s = c.unsqueeze(0), s.unsqueeze(0)       # a batch axis of 1
        return c, s

    def _check_qk(self, q: Tensor, k: Tensor) -> None:
        check_qk_head_dim(q, k, self.head_dim)
        if k.device != q.device:
            raise ValueError(f"k is on {k.device} but q is on {q.device}")
        check_scheme_device(q, "q", getattr(self, self._freq_attr), type(self).__name__)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate ``q`` at grid positions ``q_pos`` and ``k`` at ``k_pos`` (``(seq, A)`` or
        ``(batch, seq, A)``). float64 activations get float64 angles."""
        self._check_qk(q, k)
        a = self.position_axes
        q_pos = as_grid_positions(q_pos, "q_pos", q.shape[2], a, q.shape[0], q.device)
        k_pos = as_grid_positions(k_pos, "k_pos", k.shape[2], a, k.shape[0], k.device)
        dtype = torch.float64 if torch.float64 in (q.dtype, k.dtype) else torch.float32
        cq, sq = self._table(q_pos, dtype)
        if k_pos.shape == q_pos.shape and torch.equal(k_pos, q_pos) and cq.shape[1] in (1, k.shape[1]):
            ck, sk = cq, sq
        else:
            ck, sk = self._table(k_pos, dtype)
        return (_rotate(q, cq, sq, self.layout, self.rotary_dim, False),
                _rotate(k, ck, sk, self.layout, self.rotary_dim, False))

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, layout={self.layout!r}, "
                + super().extra_repr())


class AxialRoPE(_GridRotary):
    """RoPE-Axial: a 1-D RoPE per grid axis, each on its own block of pairs (``rotate`` hook).

    Pair ``j`` turns by ``pos[a] * F[a, j]`` for its one axis ``a``
    (:func:`axial_rope_frequencies`), so ``<R(p) q, R(p') k>`` depends only on ``p' - p``,
    and it is a sum of one function of ``dy`` and one of ``dx``: a pair never sees a
    diagonal direction. This is rope-vit's RoPE-Axial (Heo et al., :cite:`heo2024ropevit`)
    and the 2-D RoPE of many ViTs. rope-vit orders the axes ``(x, y)``, column first, and
    uses the interleaved layout: ``AxialRoPE(d, 2, base=100)`` with positions
    ``grid_positions((H, W)).flip(-1)`` is its ``compute_axial_cis`` + ``apply_rotary_emb``.

    Args:
        head_dim: per-head dimension of q and k.
        n_axes: grid axes, 1 to 3 (1 is plain RoPE on ``(seq, 1)`` positions).
        base: the RoPE base; rope-vit's axial models use 100.
        rotary_dim: rotated dimensions, ``<= head_dim`` with ``rotary_dim // 2`` a multiple of
            ``n_axes`` (default ``head_dim``); the rest pass through unchanged.
        layout: ``"interleaved"`` (pair ``j`` at ``2j, 2j + 1``, rope-vit) or ``"half"``.

    Raises:
        ValueError: an odd ``head_dim`` without ``rotary_dim`` (the message names ``head_dim``),
            a bad ``rotary_dim``, ``n_axes`` or ``layout``, or a ``base`` that is not a finite
            number > 1.
    """

    def __init__(self, head_dim: int, n_axes: int = 2, base: float = 100.0, *,
                 rotary_dim: int | None = None, layout: str = "interleaved") -> None:
        super().__init__()
        self.head_dim = check_positive_int(head_dim, "head_dim", minimum=2)
        if isinstance(n_axes, bool) or not isinstance(n_axes, int) or not 1 <= n_axes <= 3:
            raise ValueError(f"n_axes must be 1, 2 or 3, got {n_axes!r}")
        self.position_axes = n_axes
        if rotary_dim is None and head_dim % 2:
            raise ValueError(
                f"head_dim must be even when rotary_dim is not given (the whole head is rotated, in "
                f"pairs), got {head_dim}; pass an even rotary_dim < head_dim to rotate only part of it"
            )
        self.rotary_dim = check_rotary_dim(rotary_dim, head_dim)
        self.layout = check_layout(layout)
        self.base = check_base(base)
        freqs = axial_rope_frequencies(self.rotary_dim, n_axes, self.base)
        self.register_buffer("freqs", freqs, persistent=False)
        self.register_buffer("freqs64", axial_rope_frequencies(self.rotary_dim, n_axes, self.base,
                                                               dtype=torch.float64), persistent=False)

    def _angles(self, pos: Tensor, dtype: torch.dtype) -> Tensor:
        return grid_rope_angles(pos, self.freqs64 if dtype == torch.float64 else self.freqs)

    def extra_repr(self) -> str:
        return f"n_axes={self.position_axes}, base={self.base:g}, " + super().extra_repr()


class MixedRoPE(_GridRotary):
    """RoPE-Mixed: learned per-head frequencies that mix the two axes (``rotate`` hook).

    Head ``h``, pair ``j`` turns by ``angle = p_0 F[h, 0, j] + p_1 F[h, 1, j]`` for the
    position ``(p_0, p_1)``: a direction ``(F[h, 0, j], F[h, 1, j])`` in the plane and a
    speed, both learned. The dot product
    still depends only on ``(dy, dx)``, but a pair can now respond to a diagonal offset,
    which axial RoPE cannot (Heo et al., :cite:`heo2024ropevit`). rope-vit learns one matrix
    per layer; give each layer its own scheme.

    Initialisation (rope-vit's ``init_random_2d_freqs``, whose ``x`` is our axis 0 and ``y``
    our axis 1, the same mapping as :class:`AxialRoPE`'s): magnitudes ``m_i = base ** (-4 i /
    rotary_dim)`` for ``i < P / 2``; per head an angle ``phi ~ U[0, 2 pi)`` (0 when
    ``rotate_init=False``); the first ``P / 2`` pairs point along ``phi`` and the rest along
    ``phi + pi / 2``::

        F[h, 0] = cat(m cos(phi), m cos(phi + pi/2))
        F[h, 1] = cat(m sin(phi), m sin(phi + pi/2))

    With ``phi = 0`` the first half turns with axis 0 and the second with axis 1, which is
    :class:`AxialRoPE`'s frequency matrix with the same base, up to the float32
    ``cos(pi / 2) ~ -4e-8``. To reproduce rope-vit exactly, pass positions ``(x, y)`` =
    ``grid_positions((H, W)).flip(-1)``, as for :class:`AxialRoPE`.

    Args:
        head_dim: per-head dimension of q and k.
        num_heads: query heads; keys must have as many (each head has its own frequencies).
        base: rope-vit's mixed models use 10.
        rotary_dim: rotated dimensions, a multiple of 4, ``<= head_dim``.
        layout: ``"interleaved"`` (rope-vit) or ``"half"``.
        rotate_init: draw a random direction per head (rope-vit) or start axis-aligned.
        generator: the random source of the initial directions.
    """

    position_axes = 2
    per_head = True

    def __init__(self, head_dim: int, num_heads: int, base: float = 10.0, *,
                 rotary_dim: int | None = None, layout: str = "interleaved", rotate_init: bool = True,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.head_dim = check_positive_int(head_dim, "head_dim", minimum=2)
        self.num_heads = check_positive_int(num_heads, "num_heads")
        self.rotary_dim = check_rotary_dim(rotary_dim, head_dim)
        if self.rotary_dim % 4:
            raise ValueError(
                f"rotary_dim must be a multiple of 4 (two directions per frequency), got {self.rotary_dim}")
        self.layout = check_layout(layout)
        self.base = check_base(base)
        if not isinstance(rotate_init, bool):
            raise TypeError(f"rotate_init must be a bool, got {type(rotate_init).__name__}")
        r = self.rotary_dim
        mag = 1.0 / self.base ** (torch.arange(0, r, 4)[: r // 4].float() / r)
        rows = []
        for _ in range(self.num_heads):
            phi = (torch.rand(1, generator=generator) * 2 * math.pi if rotate_init
                   else torch.zeros(1))
            fx = torch.cat([mag * torch.cos(phi), mag * torch.cos(phi + math.pi / 2)])
            fy = torch.cat([mag * torch.sin(phi), mag * torch.sin(phi + math.pi / 2)])
            rows.append(torch.stack([fx, fy]))
        self.freqs = nn.Parameter(torch.stack(rows))  # (heads, 2, P)

    def scheme_heads(self) -> int:
        """The number of heads the frequencies are for."""
        return self.num_heads

    def _check_qk(self, q: Tensor, k: Tensor) -> None:
        super()._check_qk(q, k)
        if q.shape[1] != self.num_heads or k.shape[1] != self.num_heads:
            raise ValueError(
                f"MixedRoPE has frequencies for {self.num_heads} heads: q and k must both have "
                f"{self.num_heads} heads (each head turns its own way, so keys cannot be shared "
                f"by grouped-query heads), got {q.shape[1]} and {k.shape[1]}"
            )

    def _angles(self, pos: Tensor, dtype: torch.dtype) -> Tensor:
        f = self.freqs.to(torch.promote_types(self.freqs.dtype, dtype))
        return grid_rope_angles(pos, f)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, base={self.base:g}, " + super().extra_repr()


# ----------------------------------------------------------------------------- M-RoPE


def _check_section(mrope_section: object, pairs: int) -> tuple[int, int, int]:
    if isinstance(mrope_section, Tensor):
        mrope_section = mrope_section.tolist()
    if not isinstance(mrope_section, (tuple, list)) or len(mrope_section) != 3 or any(
            isinstance(s, bool) or not isinstance(s, numbers.Integral) or int(s) < 0 for s in mrope_section):
        raise ValueError(
            f"mrope_section must be 3 non-negative ints (pairs for t, h, w), got {mrope_section!r}")
    sec = tuple(int(s) for s in mrope_section)
    if sum(sec) != pairs:
        raise ValueError(
            f"mrope_section must sum to rotary_dim // 2 = {pairs} (one entry per pair), got "
            f"{list(sec)} which sums to {sum(sec)}")
    return sec  # type: ignore[return-value]


def _axis_of_pair(sec: tuple[int, int, int], interleaved: bool, device: torch.device | None = None) -> Tensor:
    pairs = sum(sec)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3, device=device), torch.tensor(sec, device=device))
    if 3 * sec[1] > pairs or 3 * sec[2] > pairs:
        raise ValueError(
            f"interleaved mrope_section needs 3 * s_h and 3 * s_w <= {pairs} pairs (h takes every "
            f"third pair from 1, w from 2), got {list(sec)}")
    axis = torch.zeros(pairs, dtype=torch.long, device=device)
    axis[1:3 * sec[1]:3] = 1
    axis[2:3 * sec[2]:3] = 2
    return axis


def mrope_axis_of_pair(mrope_section: Sequence[int], interleaved: bool = False) -> Tensor:
    """The axis (0 = t, 1 = h, 2 = w) each pair turns with, int64 ``(sum(mrope_section),)``.

    Qwen2-VL's sections are consecutive: ``s_t`` zeros, ``s_h`` ones, ``s_w`` twos.
    ``interleaved=True`` is Qwen3-VL's layout (``mrope_interleaved``): pairs ``1, 4, 7, ...``
    (the first ``s_h`` of them) turn with ``h``, pairs ``2, 5, 8, ...`` (``s_w``) with ``w``,
    and the rest with ``t``, so every axis gets fast and slow frequencies."""
    try:
        total = sum(int(s) for s in mrope_section)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        total = -1
    sec = _check_section(mrope_section, total)
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    return _axis_of_pair(sec, interleaved)


def mrope_cos_sin(positions: Tensor, inv_freq: Tensor, mrope_section: Sequence[int],
                  attention_factor: float = 1.0, *, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Compact M-RoPE tables: pair ``j`` turns by ``pos[axis(j)] * inv_freq[j]``.

    Qwen2-VL (Wang et al., :cite:`wang2024qwen2vl`) splits the ``P`` pairs of a head into
    three consecutive sections, ``mrope_section = (s_t, s_h, s_w)`` (``(16, 24, 24)`` for
    head dim 128): the first ``s_t`` pairs, which have the highest frequencies, turn with
    the time position, the next ``s_h`` with the row, the last ``s_w`` with the column.
    Each pair keeps its ordinary RoPE frequency ``inv_freq[j]``; only the coordinate that
    drives it changes. The arithmetic is HuggingFace's (``position_ids[..., None].float() *
    inv_freq``, then ``cos``/``sin``, times ``attention_factor``), so the tables equal its
    Qwen2-VL tables bit for bit: its full-width tables are ``cat((cos, cos), -1)``.

    Args:
        positions: integer ``(seq, 3)`` or ``(batch, seq, 3)``, ``(t, h, w)``
            (:func:`qwen2vl_position_ids`; HuggingFace's ``(3, batch, seq)`` is
            ``positions.permute(2, 0, 1)``).
        inv_freq: ``(P,)`` floating inverse frequencies (:func:`companion.rope.rope_frequencies`,
            or a scaled set from :func:`companion.scaling.compute_inv_freq`).
        mrope_section: 3 non-negative ints summing to ``P``.
        attention_factor: multiplies both tables (1 for Qwen2-VL).
        interleaved: Qwen3-VL's interleaved sections instead (:func:`mrope_axis_of_pair`),
            HuggingFace's ``Qwen3VLTextRotaryEmbedding`` arithmetic.

    Returns:
        ``(cos, sin)``, ``(seq, P)`` or ``(batch, seq, P)``, in float32 (float64 for float64
        ``inv_freq``).

    Raises:
        TypeError: float ``positions``, or an integer ``inv_freq``.
        ValueError: ``positions`` not ``(seq, 3)`` or ``(batch, seq, 3)``; ``inv_freq`` not 1-D
            or holding a NaN, an inf or a negative value (the rule of :class:`MRoPE`'s
            ``inv_freq``, ``companion.rope.check_inv_freq``); a bad ``mrope_section`` or
            ``attention_factor``.
    """
    pos = check_int_tensor(positions, "positions", dims=(2, 3), what="grid positions")
    if pos.shape[-1] != 3:
        raise ValueError(f"positions must have shape (seq, 3) or (batch, seq, 3), (t, h, w), got {tuple(pos.shape)}")
    check_tensor(inv_freq, "inv_freq", 1)
    check_inv_freq(inv_freq, inv_freq.shape[0])  # floating, finite, >= 0: MRoPE's rule
    sec = _check_section(mrope_section, inv_freq.shape[0])
    attention_factor = check_finite_number(attention_factor, "attention_factor")
    work = torch.promote_types(inv_freq.dtype, torch.float32)
    if work == torch.float32 and pos.numel() and int(pos.abs().max()) >= _FP32_EXACT_INT:
        raise ValueError(f"positions must be < 2**24 for float32 tables, got {int(pos.abs().max())}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    axis = _axis_of_pair(sec, interleaved, pos.device)
    angle = pos.to(inv_freq.device)[..., axis].to(work) * inv_freq.to(work)
    cos, sin = angle.cos(), angle.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


class MRoPE(_GridRotary):
    """Qwen2-VL's multimodal RoPE (``rotate`` hook, half layout, 3-D positions).

    Positions are ``(t, h, w)`` per token (:func:`qwen2vl_position_ids`); pair ``j`` turns by
    ``pos[axis(j)] * inv_freq[j]`` with the sections of :func:`mrope_cos_sin` (Wang et al.,
    :cite:`wang2024qwen2vl`). In float32 it equals HuggingFace's Qwen2-VL
    (``Qwen2VLRotaryEmbedding`` + ``apply_rotary_pos_emb``; ``apply_multimodal_rotary_pos_emb``
    in transformers 4) bit for bit. A text token has ``t = h = w``, and then every pair turns
    by ``p * inv_freq[j]``: M-RoPE on text-only positions is exactly 1-D RoPE, which is how
    Qwen2-VL keeps the LLM's text behaviour. The default positions are text positions.

    Args:
        head_dim: per-head dimension of q and k (128 in Qwen2-VL).
        mrope_section: pairs for ``(t, h, w)``, summing to ``rotary_dim // 2``.
        base: RoPE base, used when ``inv_freq`` is None (Qwen2-VL: 1e6).
        rotary_dim: rotated dimensions (default ``head_dim``).
        inv_freq: precomputed ``(rotary_dim // 2,)`` inverse frequencies instead of ``base``.
        attention_factor: multiplies both tables.
        interleaved: Qwen3-VL's interleaved sections (``mrope_interleaved``, sections such
            as ``(24, 20, 20)``) instead of Qwen2-VL's consecutive ones.
    """

    position_axes = 3
    _freq_attr = "inv_freq"

    def __init__(self, head_dim: int, mrope_section: Sequence[int] = (16, 24, 24), base: float = 10000.0, *,
                 rotary_dim: int | None = None, inv_freq: Tensor | None = None,
                 attention_factor: float = 1.0, interleaved: bool = False) -> None:
        super().__init__()
        self.head_dim = check_positive_int(head_dim, "head_dim", minimum=2)
        self.rotary_dim = check_rotary_dim(rotary_dim, head_dim)
        self.layout = "half"
        self.mrope_section = _check_section(mrope_section, self.rotary_dim // 2)
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
        self.interleaved = interleaved
        _axis_of_pair(self.mrope_section, interleaved)  # validates the interleaved sections
        self.attention_factor = check_finite_number(attention_factor, "attention_factor")
        if inv_freq is None:
            self.base: float | None = check_base(base)
            inv_freq = rope_frequencies(self.rotary_dim, self.base)
            inv64 = rope_frequencies(self.rotary_dim, self.base, dtype=torch.float64)
        else:
            check_inv_freq(inv_freq, self.rotary_dim // 2)
            self.base = None
            inv64 = inv_freq.to(torch.float64)
        self.register_buffer("inv_freq", inv_freq.detach().clone(), persistent=False)
        self.register_buffer("inv_freq64", inv64.detach().clone(), persistent=False)

    def default_positions(self, length: int, start: int, device: torch.device) -> Tensor:
        """Text positions: ``p = start .. start + length - 1`` on all three axes."""
        return torch.arange(start, start + length, device=device).unsqueeze(-1).expand(length, 3).contiguous()

    def _cos_sin(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv = self.inv_freq64 if dtype == torch.float64 else self.inv_freq
        return mrope_cos_sin(pos, inv, self.mrope_section, self.attention_factor, interleaved=self.interleaved)

    def extra_repr(self) -> str:
        freq = f"base={self.base:g}" if self.base is not None else "inv_freq=custom"
        inter = ", interleaved=True" if self.interleaved else ""
        return f"mrope_section={list(self.mrope_section)}{inter}, {freq}, " + super().extra_repr()


# ----------------------------------------------------------------------------- Qwen2-VL ids


def _grids(grid: object, name: str, merge: int) -> list[tuple[int, int, int]]:
    if grid is None:
        return []
    g = check_int_tensor(grid, name, what="grid sizes")
    if g.dim() == 1 and g.numel() == 3:
        g = g.unsqueeze(0)
    if g.dim() != 2 or g.shape[1] != 3:
        raise ValueError(f"{name} must have shape (n, 3), (t, h, w) per image or video, got {tuple(g.shape)}")
    out = []
    for t, h, w in g.tolist():
        if min(t, h, w) < 1:
            raise ValueError(f"{name} must hold sizes >= 1, got {(t, h, w)}")
        if h % merge or w % merge:
            raise ValueError(
                f"{name} h and w must be multiples of spatial_merge_size={merge} (the vision "
                f"encoder merges {merge} x {merge} patches into one token), got {(t, h, w)}")
        out.append((t, h // merge, w // merge))
    return out


def qwen2vl_position_ids(
    mm_token_type_ids: Tensor,
    image_grid_thw: Tensor | None = None,
    video_grid_thw: Tensor | None = None,
    *,
    spatial_merge_size: int = 2,
    attention_mask: Tensor | None = None,
    video_time_interval: float | Sequence[float] = 1.0,
) -> tuple[Tensor, Tensor]:
    """Qwen2-VL's M-RoPE positions for a prompt of text, images and videos.

    Rule (Wang et al., :cite:`wang2024qwen2vl`): a text token takes ``(p, p, p)`` and the
    next token ``p + 1``. An image or video of ``T x H' x W'`` tokens (``H' = h / m``,
    ``W' = w / m`` after the vision encoder merges ``m x m`` patches) starting at ``p`` gives
    the token at ``(t, y, x)`` the position ``(p + floor(t * interval), p + y, p + x)``,
    row-major; the next token starts one past the largest position of the block,
    ``p + max(floor((T - 1) interval), H' - 1, W' - 1) + 1``. So an image of ``H' x W'``
    tokens advances the position by only ``max(H', W')``: the positions after it are smaller
    than the token indices, which ``deltas`` records.

    Args:
        mm_token_type_ids: ``(batch, seq)`` or ``(seq,)`` ints: 0 text, 1 image, 2 video (the
            ``mm_token_type_ids`` of transformers 5). Consecutive tokens of one vision type
            are consumed grid by grid.
        image_grid_thw: ``(n_images, 3)`` ``(t, h, w)`` in patches before merging, in prompt
            order over the whole batch.
        video_grid_thw: ``(n_videos, 3)`` likewise.
        spatial_merge_size: ``m``, 2 in Qwen2-VL.
        attention_mask: optional ``(batch, seq)`` padding mask, integer 0/1 (what a
            HuggingFace tokenizer returns, ``1`` = a real token) or bool; padded tokens are
            skipped and get position 0. A floating-point mask raises ``TypeError``: HuggingFace's
            ``get_rope_index`` reads the mask with ``attention_mask == 1``, so an additive float
            mask (``0`` = keep, ``-inf`` = masked, the package's reading of a float mask) would
            silently drop every token; pass ``attention_mask.long()`` or ``.bool()``.
        video_time_interval: the temporal step per frame group: 1 in Qwen2-VL; Qwen2.5-VL uses
            ``tokens_per_second * second_per_grid_t``. One number (or 0-d tensor), or one per
            video. The offsets ``floor(t * interval)`` are computed in float32 with the
            interval rounded to float32, as HuggingFace computes them: pass its
            ``tokens_per_second * second_per_grid_ts[i]`` to reproduce its ids exactly.

    Returns:
        ``(positions, deltas)``: int64 ``(batch, seq, 3)`` (``(seq, 3)`` for 1-D input) and
        ``(batch,)`` (0-d) with ``deltas = max position + 1 - unpadded length``, the offset
        HuggingFace adds to the positions of generated tokens. HuggingFace's layout is
        ``positions.permute(2, 0, 1)``.

    Raises:
        TypeError: float ``mm_token_type_ids``, or a floating-point ``attention_mask``.
        ValueError: token types other than 0, 1, 2; vision tokens that do not match the
            grids (too few, too many, or a block that ends inside a grid); grids whose ``h``
            or ``w`` is not a multiple of ``spatial_merge_size``.
    """
    types = check_int_tensor(mm_token_type_ids, "mm_token_type_ids", dims=(1, 2), what="token types")
    single = types.dim() == 1
    if single:
        types = types.unsqueeze(0)
    if types.numel() and not bool(((types >= 0) & (types <= 2)).all()):
        raise ValueError("mm_token_type_ids must hold 0 (text), 1 (image) or 2 (video)")
    merge = check_positive_int(spatial_merge_size, "spatial_merge_size")
    grids = {1: _grids(image_grid_thw, "image_grid_thw", merge), 2: _grids(video_grid_thw, "video_grid_thw", merge)}
    names = {1: "image_grid_thw", 2: "video_grid_thw"}
    def interval(v: object) -> Tensor:
        if isinstance(v, Tensor):
            if v.numel() != 1 or not (v.is_floating_point() or v.dtype in (torch.int32, torch.int64)):
                raise TypeError(f"video_time_interval must be a number or a 0-d tensor, got {tuple(v.shape)} {v.dtype}")
            v = v.item()
        return torch.tensor(check_finite_number(v, "video_time_interval", minimum=0.0), dtype=torch.float32)

    if isinstance(video_time_interval, (list, tuple)) or (
            isinstance(video_time_interval, Tensor) and video_time_interval.dim() == 1):
        intervals = [interval(v) for v in video_time_interval]
        if len(intervals) != len(grids[2]):
            raise ValueError(f"video_time_interval has {len(intervals)} entries for {len(grids[2])} videos")
    else:
        intervals = [interval(video_time_interval)] * len(grids[2])
    b, n = types.shape
    if attention_mask is None:
        keep = torch.ones(b, n, dtype=torch.bool)
    else:
        check_tensor(attention_mask, "attention_mask")
        m = attention_mask if not single or attention_mask.dim() != 1 else attention_mask.unsqueeze(0)
        if m.dtype != torch.bool and m.dtype not in INT_DTYPES:
            raise TypeError(
                f"attention_mask must be a bool or integer 0/1 tensor (a tokenizer's padding mask, 1 = a "
                f"real token), got dtype {m.dtype}; a float mask could be an additive one (0 = keep), "
                f"which reads the other way round: pass attention_mask.long() or attention_mask.bool()"
            )
        if tuple(m.shape) != (b, n):
            raise ValueError(f"attention_mask must have shape {tuple(types.shape)}, got {tuple(attention_mask.shape)}")
        if m.dtype != torch.bool and not bool(((m == 0) | (m == 1)).all()):
            raise ValueError("attention_mask must hold 0/1 or bools (1 = a real token)")
        keep = m.to("cpu").bool()
    types_cpu = types.to("cpu")
    used = {1: 0, 2: 0}
    out = torch.zeros(b, n, 3, dtype=torch.long)
    deltas = torch.zeros(b, dtype=torch.long)
    for row in range(b):
        idx = torch.nonzero(keep[row]).flatten()
        kinds = types_cpu[row, idx].tolist()
        pos_rows: list[Tensor] = []
        p = 0
        i = 0
        while i < len(kinds):
            kind = kinds[i]
            j = i
            while j < len(kinds) and kinds[j] == kind:
                j += 1
            if kind == 0:
                ar = torch.arange(p, p + (j - i))
                pos_rows.append(ar.unsqueeze(-1).expand(-1, 3))
                p += j - i
            else:
                left = j - i
                while left > 0:
                    if used[kind] >= len(grids[kind]):
                        raise ValueError(
                            f"{names[kind]} has {len(grids[kind])} grids but the tokens of type {kind} "
                            f"need more (row {row})")
                    t, hh, ww = grids[kind][used[kind]]
                    iv = intervals[used[kind]] if kind == 2 else torch.tensor(1.0)
                    used[kind] += 1
                    size = t * hh * ww
                    if size > left:
                        raise ValueError(
                            f"{names[kind]} grid {used[kind] - 1} needs {size} tokens (t*h*w/"
                            f"{merge}**2) but only {left} tokens of type {kind} remain in row {row}")
                    tt = (torch.arange(t) * iv).long()      # float32, as HuggingFace computes it
                    g = torch.stack(torch.meshgrid(tt, torch.arange(hh), torch.arange(ww), indexing="ij"), -1)
                    block = g.reshape(-1, 3) + p
                    pos_rows.append(block)
                    p = int(block.max()) + 1
                    left -= size
            i = j
        if pos_rows:
            allpos = torch.cat(pos_rows)
            out[row, idx] = allpos
            deltas[row] = int(allpos.max()) + 1 - len(kinds)
    for kind in (1, 2):
        if used[kind] != len(grids[kind]):
            raise ValueError(
                f"{names[kind]} has {len(grids[kind])} grids but the tokens use {used[kind]}")
    out = out.to(types.device)
    deltas = deltas.to(types.device)
    return (out[0], deltas[0]) if single else (out, deltas)


#: Every scheme class of this module (all take grid positions), in the chapter's order.
GRID_SCHEMES: tuple[type[PositionScheme], ...] = (
    Sinusoidal2DEmbedding,
    LearnedGridEmbedding,
    AxialRoPE,
    MixedRoPE,
    MRoPE,
)
