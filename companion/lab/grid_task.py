"""Resolution extrapolation on a 2-D grid: "where is the partner?"

Each example is a ``G x G`` grid of tokens, read row-major as a ViT reads its patches (``G *
G`` tokens, positions :func:`companion.grid_positions` ``((G, G))``). Every cell is empty
(token 0) except one *marker* (1), one *target* (2) and ``n_distractors`` *distractors* (3).
The target sits at an offset ``(dr, dc)`` from the marker with ``dr, dc`` uniform in ``[-K,
K]``, not both 0, both cells inside the grid; the distractors fill other cells at random, so
that attention must pick the target, not "anything that is not empty". For example, with
``G = 5``, ``K = 2``, the marker ``M`` at (1, 1) and the target ``T`` at (3, 0)::

    . . . . .
    . M . D .        answer: (dr, dc) = (+2, -1)
    . . . . .
    T . . . D
    . . . . .

The model reads its output at the marker's token and predicts ``dr`` and ``dc`` with two
``(2K + 1)``-way classifiers; an example is right when both are. Chance is ``1 / ((2K + 1)^2
- 1)`` (the offsets are exactly uniform, see :func:`make_batch`), ``1/48`` for ``K = 3``.

The experiment trains at ``G = 8`` and evaluates at ``G = 8, 12, 16, 24`` with the same
offsets: a larger grid holds absolute positions never seen in training but only relative
offsets that were. That is *resolution extrapolation* as Heo et al. :cite:`heo2024ropevit`
measure it for ViTs (more patches of the same size). The offsets are counted in patches and
the content does not grow with the grid, so the task favours encodings that keep patch
offsets (the RoPEs with integer positions) and penalises, by construction, every practice
that keeps *relative places* in the image instead: the resized learned table, position
interpolation and normalised coordinates below all shrink a 3-patch offset at ``G = 24`` to
one patch of the training grid. They are here because they are what vision models do at a
new resolution, not because this task can reward them. The schemes (:func:`build_scheme`):

* ``"learned"``: :class:`~companion.grid.LearnedGridEmbedding` ``((8, 8), d_model)``; at a
  test grid ``G != 8`` its table is resampled to ``(G, G)`` (bicubic,
  :meth:`~companion.grid.LearnedGridEmbedding.resized`), what DeiT and MAE do, since it has
  no rows beyond 8;
* ``"sincos-2d"``: :class:`~companion.grid.Sinusoidal2DEmbedding` (MAE's table);
* ``"axial"``: :class:`~companion.grid.AxialRoPE` ``(head_dim, 2, base=100)``, rope-vit's
  axial frequencies;
* ``"mixed"``: :class:`~companion.grid.MixedRoPE` ``(head_dim, n_heads, base=10)``, learned
  frequencies, one scheme per layer as rope-vit does;
* ``"nope"``: :class:`~companion.attention.NoPE`, the floor: a bidirectional encoder
  without positions is permutation-equivariant and cannot tell one offset from another;
* ``"axial-b10"`` and ``"mixed-b100"``: the two RoPEs with each other's base. rope-vit's
  defaults differ (axial 100, mixed 10), and at an offset of 23 patches the slowest pair of
  a head of 16 turns ``23 * 10 ** -0.75 = 4.1`` rad at base 10 against ``23 * 100 ** -0.75
  = 0.73`` rad at base 100; with both bases run for both schemes, mixing the axes and the
  base are separate factors. At a shared base the two start from the same frequency
  magnitudes (``base ** (-4 i / head_dim)``), and a mixed head at angle 0 *is* the axial one;
* ``"axial-norm"``: normalised coordinates, DINOv3's RoPE (Simeoni et al., 2025): each axis
  of a ``G``-grid is mapped to patch centres ``c = 2 (p + 1/2) / G - 1`` in ``(-1, 1)``, and
  pair ``i`` of an axis turns by ``2 pi c 100 ** (-4 i / head_dim)`` (half layout, row pairs
  first): with head dim 16, one patch of the 8 x 8 training grid turns the fastest pair by
  ``pi / 2`` and the slowest by ``pi / 63``, and the whole image (``c`` from -1 to 1) turns
  the slowest by ``4 pi / 31.6 = 0.4`` rad, far less than a turn. NaViT (Dehghani et al., 2023) normalises
  coordinates to ``[0, 1)`` the same way for its learned factorised tables. At every test
  grid the coordinates are normalised to that grid (see below for why this equals position
  interpolation). DINOv3 also trains with random shifts and rescalings of the coordinates
  (HuggingFace's ``pos_embed_rescale = 2``: a log-uniform factor in ``[1/2, 2]``); this
  scheme does not, so it measures the normalisation alone.

**Position interpolation** (:cite:`chen2023extending`; FiT, Lu et al. 2024, applies this
family of training-free rescalings to a 2-D RoPE per axis, with its NTK and YaRN variants): at
a test grid ``G`` the integer positions are scaled by ``G_train / G``, so that the test grid
spans the training grid's range. Every run of a RoPE with integer positions (``"axial"``,
``"mixed"`` and their other-base twins) is also scored that way, on the same held-out grids
(``interpolated_accuracy``): :meth:`TinyGridEncoder.for_grid` with ``interpolate_from``. A
RoPE angle is a position times a frequency, so scaling the positions by ``s`` is scaling the
frequencies by ``s`` (:func:`scale_positions`, what HuggingFace's linear scaling does to
``inv_freq``): the rotary functions of :mod:`companion.grid` take integer positions only, and
need no fractional ones. Normalised coordinates are the same map plus a shift, ``c = 2 p / G +
(1 / G - 1)``, and a shift of every position adds the same angle to a query and a key, which
cancels in their dot product: so ``"axial-norm"`` is axial RoPE whose frequencies are scaled
by ``4 pi / G``, and at a test grid it is position interpolation of its own training grid,
exactly.

The model is :class:`TinyGridEncoder`, a small bidirectional ViT-style encoder. The command
line trains every scheme with several seeds and stores the accuracies per grid size, the
number right out of the number scored (:func:`pack_hits` stores which ones; the held-out
grids are the same for every scheme and seed, :func:`eval_batch`, and each run stores their
:func:`batch_digest`), the loss curves and the times with provenance::

    python -m companion.lab.grid_task --out chapters/data/12_grid.json

:func:`reduced_run` is the notebook's version: one seed, fewer held-out examples.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import numbers
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_finite_number, check_positive_int, check_tensor
from .._cli import check_distinct, check_run_flags, usage_errors
from ..attention import NoPE, PositionScheme
from ..dispatch import fast_attention
from ..grid import AxialRoPE, LearnedGridEmbedding, MixedRoPE, Sinusoidal2DEmbedding, grid_positions
from ..utils import save_result
from .data import as_generator

__all__ = [
    "EMPTY",
    "MARKER",
    "TARGET",
    "DISTRACTOR",
    "GRIDS",
    "GridTask",
    "GridBatch",
    "make_batch",
    "eval_batch",
    "batch_digest",
    "SCHEMES",
    "NORMALIZED",
    "build_scheme",
    "scale_positions",
    "TinyGridEncoder",
    "TrainSettings",
    "example_hits",
    "accuracy",
    "pack_hits",
    "unpack_hits",
    "train_and_eval",
    "run_all",
    "summarize",
    "STEPS",
    "SEEDS",
    "PER_LAYER",
    "REDUCED",
    "reduced_run",
    "main",
]

#: The tokens of a grid cell.
EMPTY, MARKER, TARGET, DISTRACTOR = 0, 1, 2, 3

#: The grid sizes the experiment evaluates (it trains at the first).
GRIDS: tuple[int, ...] = (8, 12, 16, 24)

#: Optimiser steps of a run (the chapter's recipe, with :class:`TrainSettings`' defaults).
STEPS = 1000

#: Seeds of every scheme in the command line's default run: five, so that a comparison of two
#: schemes can be checked seed by seed (the chapter compares axial and mixed RoPE, at their
#: own bases and at each other's, head to head).
SEEDS: tuple[int, ...] = (0, 1, 2, 3, 4)

#: Seed of the held-out set of grid size ``G`` is ``EVAL_SEED + G``; training batches come
#: from the run's own seed (a small int), so no held-out grid is drawn from a training stream.
EVAL_SEED = 3_000_000


@dataclass(frozen=True)
class GridTask:
    """The parameters of the "where is the partner?" task (see the module docstring).

    Args:
        grid: the side ``G`` of the square grid, ``>= max_offset + 1`` (so that every offset
            fits).
        max_offset: ``K >= 1``; ``dr, dc`` range over ``[-K, K]``.
        n_distractors: distractor cells (``>= 0``), with ``2 + n_distractors <= G * G``.
    """

    grid: int = 8
    max_offset: int = 3
    n_distractors: int = 2

    def __post_init__(self) -> None:
        check_positive_int(self.grid, "grid")
        check_positive_int(self.max_offset, "max_offset")
        check_positive_int(self.n_distractors, "n_distractors", 0)
        if self.grid < self.max_offset + 1:
            raise ValueError(f"grid ({self.grid}) must be >= max_offset + 1 = {self.max_offset + 1}, "
                             "so that every offset fits in the grid")
        if 2 + self.n_distractors > self.grid * self.grid:
            raise ValueError(f"n_distractors ({self.n_distractors}) must leave room in a "
                             f"{self.grid} x {self.grid} grid: at most {self.grid * self.grid - 2}")

    @property
    def vocab_size(self) -> int:
        """4: empty, marker, target, distractor."""
        return 4

    @property
    def n_classes(self) -> int:
        """``2K + 1``, the values of ``dr`` (and of ``dc``)."""
        return 2 * self.max_offset + 1

    @property
    def seq_len(self) -> int:
        """``G * G`` tokens."""
        return self.grid * self.grid

    @property
    def chance(self) -> float:
        """``1 / ((2K + 1)^2 - 1)``: the accuracy of a model that knows no offset."""
        return 1.0 / (self.n_classes ** 2 - 1)

    def at(self, grid: int) -> "GridTask":
        """The same task on a ``grid x grid`` grid (same offsets, same distractors)."""
        return replace(self, grid=grid)


class GridBatch(NamedTuple):
    """A batch of the task.

    ``tokens`` ``(batch, G * G)`` int64, row-major; ``marker`` and ``target`` ``(batch, 2)``
    their (row, column); ``offset`` ``(batch, 2)`` = ``target - marker`` = ``(dr, dc)``;
    ``labels`` ``(batch, 2)`` = ``offset + K``, the class indices in ``[0, 2K]``;
    ``marker_index`` ``(batch,)`` the marker's index in the sequence, ``row * G + col``.
    """

    tokens: Tensor
    marker: Tensor
    target: Tensor
    offset: Tensor
    labels: Tensor
    marker_index: Tensor


def make_batch(batch_size: int, generator: torch.Generator | int, task: GridTask = GridTask()) -> GridBatch:
    """Draw ``batch_size`` grids of ``task``.

    The offset is drawn first, uniformly among the ``(2K + 1)^2 - 1`` nonzero ones; then the
    marker uniformly among the cells from which that offset stays inside the grid (row in
    ``[max(0, -dr), G - 1 - max(0, dr)]``, column likewise); then the distractors uniformly
    among the other cells, all distinct. So the labels are exactly uniform, and chance is
    :attr:`GridTask.chance`.

    Args:
        batch_size: grids (>= 1).
        generator: a ``torch.Generator`` (advanced by the call) or an int seed (>= 0). The
            same seed gives the same batch on every machine (torch's CPU generator is
            portable).
        task: the task parameters.

    Returns:
        A :class:`GridBatch`.
    """
    check_positive_int(batch_size, "batch_size")
    if not isinstance(task, GridTask):
        raise TypeError(f"task must be a GridTask, got {type(task).__name__}")
    g = as_generator(generator)
    b, k, side, n = batch_size, task.max_offset, task.grid, task.seq_len
    width = task.n_classes
    centre = (width * width) // 2
    pick = torch.randint(0, width * width - 1, (b,), generator=g)
    pick = pick + (pick >= centre).long()  # skip the offset (0, 0)
    offset = torch.stack([pick // width - k, pick % width - k], -1)
    low = (-offset).clamp(min=0)
    high = side - 1 - offset.clamp(min=0)  # inclusive
    # uniform integers in [low, high]: float64 uniforms, floored, clamped (u < 1 always, the
    # clamp only guards the product's rounding)
    u = torch.rand((b, 2), generator=g, dtype=torch.float64)
    marker = torch.minimum(low + (u * (high - low + 1).double()).floor().long(), high)
    target = marker + offset
    marker_index = marker[:, 0] * side + marker[:, 1]
    target_index = target[:, 0] * side + target[:, 1]
    tokens = torch.full((b, n), EMPTY, dtype=torch.int64)
    rows = torch.arange(b)
    tokens[rows, marker_index] = MARKER
    tokens[rows, target_index] = TARGET
    if task.n_distractors:
        score = torch.rand((b, n), generator=g)
        score[rows, marker_index] = 2.0  # uniforms are < 1: these two sort last
        score[rows, target_index] = 2.0
        cells = score.argsort(dim=-1, stable=True)[:, : task.n_distractors]
        tokens[rows[:, None], cells] = DISTRACTOR
    return GridBatch(tokens, marker, target, offset, offset + k, marker_index)


def eval_batch(task: GridTask, size: int = 1000) -> GridBatch:
    """The held-out set of ``task``'s grid size: :func:`make_batch` with seed
    ``EVAL_SEED + task.grid``, the same for every scheme and run."""
    if not isinstance(task, GridTask):
        raise TypeError(f"task must be a GridTask, got {type(task).__name__}")
    return make_batch(size, EVAL_SEED + task.grid, task)


def batch_digest(batch: GridBatch) -> str:
    """The SHA-256 (hex) of a batch's tokens, marker indices and labels, as little-endian
    int64: two batches with the same digest hold the same grids in the same order. Each run
    stores the digest of its held-out grids, so that a reader of the stored result can check
    that every scheme and seed was scored on the same examples (what paired comparisons
    need)."""
    if not isinstance(batch, GridBatch):
        raise TypeError(f"batch must be a GridBatch, got {type(batch).__name__}")
    digest = hashlib.sha256()
    for t in (batch.tokens, batch.marker_index, batch.labels):
        digest.update(np.ascontiguousarray(t.detach().cpu().numpy(), dtype="<i8").tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- schemes


def _learned(head_dim: int, n_heads: int, d_model: int, grid: int) -> PositionScheme:
    return LearnedGridEmbedding((grid, grid), d_model)


def _sincos(head_dim: int, n_heads: int, d_model: int, grid: int) -> PositionScheme:
    return Sinusoidal2DEmbedding(d_model)


def _axial(head_dim: int, n_heads: int, d_model: int, grid: int) -> PositionScheme:
    return AxialRoPE(head_dim, 2, base=100.0)


def _mixed(head_dim: int, n_heads: int, d_model: int, grid: int) -> PositionScheme:
    return MixedRoPE(head_dim, n_heads, base=10.0)


def _nope(head_dim: int, n_heads: int, d_model: int, grid: int) -> PositionScheme:
    return NoPE()


def _axial_b10(head_dim: int, n_heads: int, d_model: int, grid: int) -> PositionScheme:
    return AxialRoPE(head_dim, 2, base=10.0)


def _mixed_b100(head_dim: int, n_heads: int, d_model: int, grid: int) -> PositionScheme:
    return MixedRoPE(head_dim, n_heads, base=100.0)


def _axial_norm(head_dim: int, n_heads: int, d_model: int, grid: int) -> PositionScheme:
    # DINOv3: angle 2 pi c f with c = 2 (p + 1/2) / G - 1; the shift cancels, the scale is 4 pi / G
    return scale_positions(AxialRoPE(head_dim, 2, base=100.0, layout="half"), 4 * math.pi / grid)


#: The schemes this task compares, ``name -> factory(head_dim, n_heads, d_model, grid)``.
SCHEMES: dict[str, Callable[[int, int, int, int], PositionScheme]] = {
    "learned": _learned,
    "sincos-2d": _sincos,
    "axial": _axial,
    "mixed": _mixed,
    "nope": _nope,
    "axial-b10": _axial_b10,
    "mixed-b100": _mixed_b100,
    "axial-norm": _axial_norm,
}

#: Schemes built once per layer (rope-vit learns each layer's mixed frequencies); the others
#: are one instance shared by all layers.
PER_LAYER: frozenset[str] = frozenset({"mixed", "mixed-b100"})

#: Schemes whose positions are normalised to the grid they read: at every test grid they are
#: scored with ``interpolate_from`` the training grid (:meth:`TinyGridEncoder.for_grid`).
NORMALIZED: frozenset[str] = frozenset({"axial-norm"})

#: The grid RoPEs whose positions :func:`scale_positions` can scale.
_GRID_ROPES = (AxialRoPE, MixedRoPE)


def build_scheme(name: str, d_model: int = 64, n_heads: int = 4, grid: int = 8) -> PositionScheme:
    """A fresh scheme by name (one of :data:`SCHEMES`), for a model of width ``d_model`` with
    ``n_heads`` heads (head dim ``d_model // n_heads``) trained on ``grid x grid`` grids:
    ``LearnedGridEmbedding((grid, grid), d_model)``, ``Sinusoidal2DEmbedding(d_model)``,
    ``AxialRoPE(head_dim, 2, base=100.0)``, ``MixedRoPE(head_dim, n_heads, base=10.0)`` (its
    random init angles come from torch's global generator), ``NoPE()``, the same RoPEs at each
    other's base (``"axial-b10"``, ``"mixed-b100"``), or ``"axial-norm"``:
    ``scale_positions(AxialRoPE(head_dim, 2, base=100.0, layout="half"), 4 * pi / grid)``,
    DINOv3's RoPE on coordinates normalised to the ``grid x grid`` grid (see the module
    docstring)."""
    if not isinstance(name, str) or name not in SCHEMES:
        raise ValueError(f"name must be one of {tuple(SCHEMES)}, got {name!r}")
    check_positive_int(d_model, "d_model")
    check_positive_int(n_heads, "n_heads")
    check_positive_int(grid, "grid")
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
    return SCHEMES[name](d_model // n_heads, n_heads, d_model, grid)


def scale_positions(scheme: PositionScheme, factors: float | Sequence[float]) -> PositionScheme:
    """A copy of a grid RoPE that reads every position ``p`` on axis ``a`` as ``factors[a] * p``.

    An :class:`~companion.grid.AxialRoPE` or :class:`~companion.grid.MixedRoPE` turns pair
    ``j`` by ``sum_a p_a F[a, j]`` (:func:`companion.grid.grid_rope_angles`), so scaled
    positions ``s_a p_a`` give the angles of the frequency matrix with row ``a`` scaled by
    ``s_a``: the copy has those frequencies (computed in float64, the float32 ones rounded
    from them, a row with factor 1 kept bit for bit; a mixed RoPE's learned float32 matrix
    times ``s_a``, rounded once), and takes
    the same integer positions as the original. This is how HuggingFace's linear RoPE scaling
    applies position interpolation (``inv_freq / factor``), per axis. With ``factors =
    G_train / G`` it is position interpolation at a ``G x G`` test grid
    (:cite:`chen2023extending`); with ``2 / G`` (times ``2 pi``) it is the scale of
    normalised coordinates ``2 (p + 1/2) / G - 1``, whose shift adds the same angle to every
    query and key and so leaves every score unchanged.

    Args:
        scheme: an :class:`~companion.grid.AxialRoPE` or a :class:`~companion.grid.MixedRoPE`
            (left unchanged; a mixed RoPE's copy is a fresh parameter, trainable as the
            original).
        factors: one finite number > 0 for every axis, or one per axis
            (``scheme.position_axes`` of them).

    Returns:
        The scaled copy, of the same class.

    Raises:
        TypeError: ``scheme`` is not a grid RoPE; a factor that is not a number.
        ValueError: a factor that is not finite and > 0, or not one per axis.
    """
    if not isinstance(scheme, _GRID_ROPES):
        raise TypeError(f"scheme must be an AxialRoPE or a MixedRoPE (a grid RoPE whose angles are positions "
                        f"times frequencies), got {type(scheme).__name__}")
    axes = scheme.position_axes
    if isinstance(factors, numbers.Real) and not isinstance(factors, bool):
        factors = (factors,) * axes
    if not isinstance(factors, (tuple, list)) or len(factors) != axes:
        raise ValueError(f"factors must be one number or {axes} of them (one per axis of the scheme), got {factors!r}")
    scale = torch.tensor([check_finite_number(f, "factors") for f in factors], dtype=torch.float64)[:, None]
    out = copy.deepcopy(scheme)
    with torch.no_grad():
        if isinstance(out, AxialRoPE):
            scale = scale.to(out.freqs64.device)
            out.freqs64.mul_(scale)
            out.freqs.copy_(torch.where(scale == 1.0, out.freqs, out.freqs64.float()))  # a factor 1 keeps the row
        else:
            out.freqs.copy_(out.freqs.double() * scale.to(out.freqs.device))
    return out


# ----------------------------------------------------------------------------- the model


def _axes(scheme: PositionScheme) -> int:
    return int(getattr(scheme, "position_axes", 1))


class _Block(nn.Module):
    """A pre-LayerNorm encoder block: bidirectional attention with a scheme, then an MLP.

    With ``query`` (``(batch,)`` token indices) only those tokens' outputs are computed,
    ``(batch, 1, d_model)``: queries at those tokens attend to every token. Each output of a
    bidirectional block depends only on its own query, so this is the full block's output at
    those tokens (up to rounding), at a fraction of the cost; the last block uses it.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(self, x: Tensor, scheme: PositionScheme, pos: Tensor, query: Tensor | None = None,
                window: int | None = None) -> Tensor:
        b, n, d = x.shape
        h = self.ln1(x)
        k, v = self.kv_proj(h).view(b, n, 2, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if query is None:
            q_pos = pos
        else:
            rows = torch.arange(b, device=x.device)
            x, h = x[rows, query][:, None], h[rows, query][:, None]  # (batch, 1, d)
            q_pos = pos[query][:, None]  # per-row positions, (batch, 1) or (batch, 1, 2)
        m = x.shape[1]
        q = self.q_proj(h).view(b, m, self.n_heads, self.head_dim).transpose(1, 2)
        mask = None
        if window is not None:  # keys within Chebyshev distance `window` of the query (2-D pos)
            near = (q_pos.unsqueeze(-2) - pos.unsqueeze(-3)).abs().amax(-1) <= window
            mask = near[None, None] if near.dim() == 2 else near.unsqueeze(1)  # (1, 1, q, k) or (batch, 1, 1, k)
        out = fast_attention(q, k, v, scheme, q_pos, pos, attn_mask=mask)  # bidirectional
        x = x + self.proj(out.transpose(1, 2).reshape(b, m, d))
        return x + self.mlp(self.ln2(x))


class TinyGridEncoder(nn.Module):
    """A small bidirectional ViT-style encoder over a grid of tokens, with two offset heads.

    Token embedding, the scheme's ``embed`` (:class:`~companion.grid.LearnedGridEmbedding`,
    :class:`~companion.grid.Sinusoidal2DEmbedding`; the identity for the others), ``n_layers``
    pre-LayerNorm blocks whose attention is
    ``companion.fast_attention(q, k, v, scheme, pos, pos)`` (non-causal), a final LayerNorm,
    and two linear heads read at the marker's token: the logits of ``dr`` and of ``dc``. Only
    the marker's output is read, so the last block computes it alone (its query against every
    key): the same function as the full block at that token, to rounding, at about half the
    cost of a block.

    Args:
        scheme_factory: a callable with no arguments that returns a fresh
            :class:`~companion.attention.PositionScheme`.
        vocab: token ids (4 for :class:`GridTask`).
        d_model, n_heads, n_layers: width, heads per layer, blocks.
        mlp: the MLP's hidden width as a multiple of ``d_model``.
        n_classes: outputs of each head (``2K + 1``).
        per_layer: build one scheme per layer (``scheme_factory`` is called ``n_layers``
            times) instead of one shared by all; ``None`` (default) means per layer exactly
            when the scheme is a :class:`~companion.grid.MixedRoPE` (rope-vit learns each
            layer's frequencies). The ``embed`` hook is applied once, with the first layer's
            scheme.

    Every ``nn.Linear`` and ``nn.Embedding`` is initialised ``N(0, 0.02)`` with zero biases,
    as in :class:`companion.model.TinyDecoder`, from torch's global generator; a learned
    table initialises itself (``N(0, 0.02)`` too) and mixed frequencies keep rope-vit's init.
    Seed with ``torch.manual_seed`` before building. Float32.

    ``forward(tokens, shape, marker_index)``: ``tokens`` ``(batch, H * W)`` int, row-major
    on the grid ``shape = (H, W)``; ``marker_index`` ``(batch,)`` the token to read. Returns
    logits ``(batch, 2, n_classes)`` (``[:, 0]`` for ``dr``, ``[:, 1]`` for ``dc``). Schemes
    with ``position_axes == 2`` get :func:`~companion.grid.grid_positions` ``(shape)``; NoPE
    gets the sequence index (it ignores it).
    """

    def __init__(self, scheme_factory: Callable[[], PositionScheme], vocab: int = 4, d_model: int = 64,
                 n_heads: int = 4, n_layers: int = 2, mlp: int = 4, n_classes: int = 7,
                 per_layer: bool | None = None) -> None:
        super().__init__()
        if isinstance(scheme_factory, PositionScheme) or not callable(scheme_factory):
            raise TypeError(f"scheme_factory must be a callable returning a fresh PositionScheme "
                            f"(e.g. lambda: AxialRoPE(16)), got {type(scheme_factory).__name__}")
        for name, value in (("vocab", vocab), ("d_model", d_model), ("n_heads", n_heads),
                            ("n_layers", n_layers), ("mlp", mlp), ("n_classes", n_classes)):
            check_positive_int(value, name)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        if per_layer is not None and not isinstance(per_layer, bool):
            raise TypeError(f"per_layer must be a bool or None, got {type(per_layer).__name__}")
        first = self._checked(scheme_factory(), n_heads)
        if per_layer is None:
            per_layer = isinstance(first, MixedRoPE)
        self.per_layer = per_layer
        built = [first] + [self._checked(scheme_factory(), n_heads) for _ in range(n_layers - 1)] if per_layer else [first]
        self.schemes = nn.ModuleList(built)
        self.tok = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, mlp * d_model) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.heads = nn.Linear(d_model, 2 * n_classes)
        self.n_classes = n_classes
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    @staticmethod
    def _checked(scheme: object, n_heads: int) -> PositionScheme:
        if not isinstance(scheme, PositionScheme):
            raise TypeError(f"scheme_factory must return a PositionScheme, got {type(scheme).__name__}")
        if _axes(scheme) not in (1, 2):
            raise ValueError(f"the scheme must take 1-D or 2-D positions, got position_axes = {_axes(scheme)}")
        scheme.check_heads(n_heads)
        return scheme

    def scheme_for(self, layer: int) -> PositionScheme:
        """The scheme of block ``layer``."""
        return self.schemes[layer if self.per_layer else 0]

    def for_grid(self, shape: tuple[int, int], *, interpolate_from: tuple[int, int] | None = None) -> "TinyGridEncoder":
        """The model to evaluate on ``shape`` grids: ``self`` if nothing needs changing, else a
        copy whose :class:`~companion.grid.LearnedGridEmbedding` tables are resampled to
        ``shape`` (:meth:`~companion.grid.LearnedGridEmbedding.resized`) and, with
        ``interpolate_from = (H_train, W_train)``, whose grid RoPEs read each position on axis
        0 as ``p * H_train / H`` and on axis 1 as ``p * W_train / W`` (:func:`scale_positions`):
        position interpolation, so that the ``shape`` grid spans the range of the training
        grid's positions.

        Raises:
            ValueError: a bad ``shape`` or ``interpolate_from``, or ``interpolate_from`` for a
                model without a grid RoPE (:class:`~companion.grid.AxialRoPE`,
                :class:`~companion.grid.MixedRoPE`).
        """
        shape = _check_shape(shape)
        factors = None
        if interpolate_from is not None:
            train = _check_shape(interpolate_from, "interpolate_from")
            if not any(isinstance(s, _GRID_ROPES) for s in self.schemes):
                raise ValueError(f"interpolate_from needs a model with a grid RoPE (AxialRoPE or MixedRoPE), "
                                 f"got a {type(self.schemes[0]).__name__}")
            if train != shape:
                factors = (train[0] / shape[0], train[1] / shape[1])
        resize = [isinstance(s, LearnedGridEmbedding) and tuple(s.table.shape[:-1]) != shape for s in self.schemes]
        if not any(resize) and factors is None:
            return self
        clone = copy.deepcopy(self)
        clone.schemes = nn.ModuleList(
            s.resized(shape) if r else scale_positions(s, factors) if factors and isinstance(s, _GRID_ROPES) else s
            for s, r in zip(clone.schemes, resize))
        return clone

    def forward(self, tokens: Tensor, shape: tuple[int, int], marker_index: Tensor, *,
                offset: int = 0, window: int | None = None) -> Tensor:
        """Logits ``(batch, 2, n_classes)``; see the class docstring.

        Two diagnostics: ``offset`` adds ``(offset, offset)`` to every grid position (the grid
        is then the far corner of a larger frame: the same relative offsets at absolute
        positions never seen in training; a learned table must cover the frame, see
        :meth:`for_grid`), and ``window`` lets each query attend only keys within Chebyshev
        distance ``window`` (every other key masked), for 2-D schemes.
        """
        check_tensor(tokens, "tokens", 2)
        check_positive_int(offset, "offset", 0)
        if window is not None:
            check_positive_int(window, "window", 0)
        shape = _check_shape(shape)
        b, n = tokens.shape
        if n != shape[0] * shape[1]:
            raise ValueError(f"tokens must hold shape[0] * shape[1] = {shape[0] * shape[1]} tokens per row "
                             f"for a {shape} grid, got {n}")
        check_tensor(marker_index, "marker_index", 1)
        if marker_index.shape[0] != b:
            raise ValueError(f"marker_index must have shape ({b},), got {tuple(marker_index.shape)}")
        if marker_index.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"marker_index must hold integer token indices, got dtype {marker_index.dtype}")
        if b and (int(marker_index.min()) < 0 or int(marker_index.max()) >= n):
            raise IndexError(f"marker_index must lie in [0, {n}), got [{int(marker_index.min())}, "
                             f"{int(marker_index.max())}]")
        if tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"tokens must hold integer token ids, got dtype {tokens.dtype}")
        vocab = self.tok.num_embeddings
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            raise IndexError(f"tokens must lie in [0, {vocab}), got [{int(tokens.min())}, {int(tokens.max())}]")
        grid_pos = grid_positions(shape, device=tokens.device) + offset
        seq_pos = torch.arange(n, device=tokens.device)
        first = self.schemes[0]
        if window is not None and _axes(first) != 2:
            raise ValueError("window needs a scheme with 2-D positions")
        x = first.embed(self.tok(tokens), grid_pos if _axes(first) == 2 else seq_pos)
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            scheme = self.scheme_for(i)
            # the last block computes the marker's output only (see _Block)
            x = block(x, scheme, grid_pos if _axes(scheme) == 2 else seq_pos, marker_index if i == last else None,
                      window)
        return self.heads(self.ln_f(x[:, 0])).view(b, 2, self.n_classes)


def _check_shape(shape: object, name: str = "shape") -> tuple[int, int]:
    if not isinstance(shape, (tuple, list)) or len(shape) != 2:
        raise ValueError(f"{name} must be a (rows, columns) pair of ints, got {shape!r}")
    return (check_positive_int(shape[0], name), check_positive_int(shape[1], name))


# ----------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainSettings:
    """The model and optimiser of :func:`train_and_eval` (defaults: the chapter's recipe).

    A :class:`TinyGridEncoder` of width ``d_model``, ``n_heads`` heads, ``n_layers`` blocks,
    MLP ``mlp * d_model``; AdamW (no weight decay) at a peak learning rate ``lr`` with
    ``warmup`` linear steps and cosine decay to 0; ``batch_size`` fresh grids per step; the
    loss is the sum of the two heads' cross-entropies; the gradient norm is clipped at
    ``grad_clip`` (0: no clipping).

    Args:
        eval_size: held-out grids per grid size.
        log_every: the loss curve holds the mean training loss of every ``log_every`` steps.
    """

    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    mlp: int = 4
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 100
    grad_clip: float = 1.0
    eval_size: int = 1000
    log_every: int = 50

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "n_layers", "mlp", "batch_size", "eval_size", "log_every"):
            check_positive_int(getattr(self, name), name)
        check_positive_int(self.warmup, "warmup", 0)
        check_finite_number(self.lr, "lr")
        check_finite_number(self.grad_clip, "grad_clip", minimum=0)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")


def example_hits(model: TinyGridEncoder, batch: GridBatch, side: int, chunk: int = 250, *, offset: int = 0,
                 window: int | None = None, interpolate_from: int | None = None) -> Tensor:
    """Which heads the model gets right on each grid of ``batch`` (grids of side ``side``):
    bool ``(batch, 2)``, column 0 the row offset ``dr``, column 1 the column offset ``dc``.

    Runs without gradients in chunks of ``chunk`` grids, on :meth:`TinyGridEncoder.for_grid`
    with the frame ``side + offset`` (and ``interpolate_from = (i, i)`` for
    ``interpolate_from = i``: position interpolation from an ``i x i`` training grid).
    ``offset`` and ``window`` are the diagnostics of :meth:`TinyGridEncoder.forward`.
    """
    if not isinstance(batch, GridBatch):
        raise TypeError(f"batch must be a GridBatch, got {type(batch).__name__}")
    check_positive_int(side, "side")
    check_positive_int(chunk, "chunk")
    if batch.tokens.shape[1] != side * side:
        raise ValueError(f"batch holds {batch.tokens.shape[1]} tokens per grid, not side * side = {side * side}")
    check_positive_int(offset, "offset", 0)
    train = None if interpolate_from is None else (check_positive_int(interpolate_from, "interpolate_from"),) * 2
    net = model.for_grid((side + offset, side + offset), interpolate_from=train)
    was_training = net.training
    net.eval()
    right = []
    with torch.no_grad():
        for start in range(0, batch.tokens.shape[0], chunk):
            sl = slice(start, start + chunk)
            pred = net(batch.tokens[sl], (side, side), batch.marker_index[sl], offset=offset,
                       window=window).argmax(-1)
            right.append(pred == batch.labels[sl])
    model.train(was_training)
    return torch.cat(right)


def accuracy(model: TinyGridEncoder, batch: GridBatch, side: int, chunk: int = 250, *,
             offset: int = 0, window: int | None = None, interpolate_from: int | None = None) -> dict[str, float]:
    """The fraction of ``batch`` (grids of side ``side``) whose offset the model gets right:
    ``{"both": both heads right, "dr": the row head right, "dc": the column head right}``,
    from :func:`example_hits` (same arguments)."""
    hit = example_hits(model, batch, side, chunk, offset=offset, window=window,
                       interpolate_from=interpolate_from)
    both = hit.all(-1).double()
    hit = hit.double()
    return {"both": float(both.mean()), "dr": float(hit[:, 0].mean()), "dc": float(hit[:, 1].mean())}


def pack_hits(hits: Tensor | Sequence[bool]) -> str:
    """Per-example right/wrong flags as a hex string, 8 examples a byte, the first example in
    the high bit (``numpy.packbits``), the last byte padded with zero bits: 250 characters for
    1000 examples. :func:`unpack_hits` reads it back.

    Raises:
        TypeError: ``hits`` is not a 1-D sequence or tensor of bools.
    """
    try:
        flags = np.asarray(hits.detach().cpu() if isinstance(hits, Tensor) else hits)
    except (TypeError, ValueError) as exc:  # ragged nesting
        raise TypeError(f"hits must be a 1-D sequence of bools, got a ragged {type(hits).__name__}") from exc
    if flags.dtype != np.bool_ or flags.ndim != 1:
        raise TypeError(f"hits must be a 1-D sequence of bools, got {flags.ndim}-D {flags.dtype}")
    return np.packbits(flags).tobytes().hex()


def unpack_hits(text: str, n: int) -> np.ndarray:
    """The ``n`` flags that :func:`pack_hits` wrote as ``text``: a bool array ``(n,)``.

    Raises:
        TypeError: ``text`` is not a string, ``n`` not an int.
        ValueError: ``text`` is not hex, its length is not that of ``n`` flags
            (``2 ceil(n / 8)`` characters), or a padding bit is set.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a hex string from pack_hits, got {type(text).__name__}")
    check_positive_int(n, "n", 0)
    if len(text) != 2 * math.ceil(n / 8):
        raise ValueError(f"text must hold 2 * ceil(n / 8) = {2 * math.ceil(n / 8)} hex characters for n = {n} "
                         f"flags, got {len(text)}")
    try:
        raw = bytes.fromhex(text)
    except ValueError as exc:
        raise ValueError(f"text must be a hex string from pack_hits, got {text[:40]!r}") from exc
    flags = np.unpackbits(np.frombuffer(raw, dtype=np.uint8)).astype(bool)
    if flags[n:].any():
        raise ValueError(f"text sets padding bits past n = {n} flags: it holds more flags, or is not from pack_hits")
    return flags[:n]


def _build_model(scheme_name: str, task: GridTask, s: TrainSettings) -> TinyGridEncoder:
    return TinyGridEncoder(lambda: build_scheme(scheme_name, s.d_model, s.n_heads, task.grid),
                           vocab=task.vocab_size, d_model=s.d_model, n_heads=s.n_heads, n_layers=s.n_layers,
                           mlp=s.mlp, n_classes=task.n_classes, per_layer=scheme_name in PER_LAYER)


def _check_grids(grids: object) -> tuple[int, ...]:
    if isinstance(grids, (str, bytes)) or not isinstance(grids, Sequence) or not grids:
        raise TypeError(f"grids must be a non-empty sequence of ints, got {grids!r}")
    return tuple(check_positive_int(g, "grids") for g in grids)


def train_and_eval(scheme_name: str, seed: int, steps: int = STEPS, *, task: GridTask = GridTask(),
                   grids: Sequence[int] = GRIDS, settings: TrainSettings = TrainSettings(),
                   return_model: bool = False) -> dict[str, Any] | tuple[dict[str, Any], TinyGridEncoder]:
    """Train one scheme on ``task`` (its grid size) and measure held-out accuracy on each of
    ``grids``.

    The model's initial weights come from ``torch.manual_seed(seed)`` (this sets torch's
    global seed), the training batches from a generator seeded with ``seed``, the held-out
    sets from :func:`eval_batch` (``settings.eval_size`` grids each), so all schemes and
    seeds are scored on the same grids. Deterministic for a given machine, thread count and
    numeric configuration.

    Args:
        scheme_name: one of :data:`SCHEMES`.
        seed: an int >= 0.
        steps: optimiser steps (>= 1).
        task: the training task.
        grids: the grid sides to evaluate (each must be ``>= task.max_offset + 1``).
        settings: model and optimiser (:class:`TrainSettings`).
        return_model: also return the trained model.

    Returns:
        A dict: ``scheme``, ``seed``, ``steps``, ``train_seconds`` and ``eval_seconds`` (wall
        clock, machine dependent), ``loss_curve`` (``{"step": [...], "loss": [...]}``, the
        mean loss of each ``log_every`` steps, ``step`` the last step of the window, from 1),
        ``final_loss`` (mean of the last ``log_every`` steps), ``accuracy`` (``{str(G):
        accuracy(...)["both"]}``), ``axis_accuracy`` (``{str(G): {"dr": ..., "dc": ...}}``),
        ``shifted_accuracy`` (``{str(G): ...}`` for ``G > task.grid``: the training-size grids
        placed at offset ``G - task.grid``, the far corner of a ``G x G`` frame) and
        ``window_accuracy`` (``{str(G): ...}``: the ``G`` grids with attention limited to keys
        within Chebyshev distance ``task.grid - 1``), both empty for schemes without 2-D
        positions, ``interpolated_accuracy`` (``{str(G): ...}`` for ``G > task.grid``: the
        ``G`` grids with position interpolation from ``task.grid``, for the grid RoPEs with
        integer positions; empty for the others, and for :data:`NORMALIZED` schemes, whose
        every score is interpolated), ``chance``, and the ``task`` and ``settings`` as dicts.
        Per evaluation ``kind`` (``"full"`` for ``accuracy``, ``"shifted"``, ``"window"``,
        ``"interpolated"``), with the grid keys of its accuracy: ``correct`` (``{kind:
        {str(G): examples with both heads right}}``), ``evaluated`` (likewise, the examples
        scored) and ``hits`` (likewise, :func:`pack_hits` of the per-example flags, in the
        order of :func:`eval_batch`; the shifted grids are those of ``eval_batch`` at
        ``task.grid``); and ``eval_digest`` (``{str(G): batch_digest(eval_batch(...))}``, the
        identity of the held-out grids).
    """
    if not isinstance(scheme_name, str) or scheme_name not in SCHEMES:
        raise ValueError(f"scheme_name must be one of {tuple(SCHEMES)}, got {scheme_name!r}")
    check_positive_int(seed, "seed", 0)
    check_positive_int(steps, "steps")
    if not isinstance(task, GridTask):
        raise TypeError(f"task must be a GridTask, got {type(task).__name__}")
    if not isinstance(settings, TrainSettings):
        raise TypeError(f"settings must be a TrainSettings, got {type(settings).__name__}")
    grids = _check_grids(grids)
    tests = {g: task.at(g) for g in grids}  # GridTask validates each size
    s = settings
    torch.manual_seed(seed)
    model = _build_model(scheme_name, task, s)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    shape = (task.grid, task.grid)
    losses: list[float] = []
    curve: dict[str, list] = {"step": [], "loss": []}
    start = time.perf_counter()
    for step in range(steps):
        lr = s.lr * min(1.0, (step + 1) / max(s.warmup, 1)) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = make_batch(s.batch_size, gen, task)
        logits = model(batch.tokens, shape, batch.marker_index)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()) * 2  # sum of the two heads
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if s.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % s.log_every == 0 or step + 1 == steps:
            window = losses[-((step % s.log_every) + 1):]
            curve["step"].append(step + 1)
            curve["loss"].append(sum(window) / len(window))
    train_seconds = time.perf_counter() - start
    start = time.perf_counter()
    interp = task.grid if scheme_name in NORMALIZED else None  # normalised coordinates: every grid
    kinds = ("full", "shifted", "window", "interpolated")
    hits: dict[str, dict[str, Tensor]] = {kind: {} for kind in kinds}
    batches = {g: eval_batch(t, s.eval_size) for g, t in tests.items()}
    for g in grids:
        hits["full"][str(g)] = example_hits(model, batches[g], g, interpolate_from=interp)
    # Diagnostics at the larger grids, for 2-D schemes: the training grid shifted to the far
    # corner of a G x G frame (new absolute positions, nothing else new), the G x G grid with
    # attention limited to keys within the training grid's largest offset (G_train - 1), and
    # for grid RoPEs on integer positions the G x G grid with position interpolation.
    if _axes(model.schemes[0]) == 2:
        base = eval_batch(task, s.eval_size)
        rope = isinstance(model.schemes[0], _GRID_ROPES) and interp is None
        for g in grids:
            if g > task.grid:
                hits["shifted"][str(g)] = example_hits(model, base, task.grid, offset=g - task.grid,
                                                       interpolate_from=interp)
                hits["window"][str(g)] = example_hits(model, batches[g], g, window=task.grid - 1,
                                                      interpolate_from=interp)
                if rope:
                    hits["interpolated"][str(g)] = example_hits(model, batches[g], g, interpolate_from=task.grid)
    eval_seconds = time.perf_counter() - start
    both = {kind: {g: h.all(-1) for g, h in by.items()} for kind, by in hits.items()}

    def rate(kind: str) -> dict[str, float]:
        return {g: float(b.double().mean()) for g, b in both[kind].items()}

    tail = losses[-s.log_every:]
    result = {
        "scheme": scheme_name,
        "seed": seed,
        "steps": steps,
        "train_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "loss_curve": curve,
        "final_loss": sum(tail) / len(tail),
        "accuracy": rate("full"),
        "axis_accuracy": {g: {"dr": float(h[:, 0].double().mean()), "dc": float(h[:, 1].double().mean())}
                          for g, h in hits["full"].items()},
        "shifted_accuracy": rate("shifted"),
        "window_accuracy": rate("window"),
        "interpolated_accuracy": rate("interpolated"),
        "correct": {kind: {g: int(b.sum()) for g, b in by.items()} for kind, by in both.items()},
        "evaluated": {kind: {g: int(b.numel()) for g, b in by.items()} for kind, by in both.items()},
        "hits": {kind: {g: pack_hits(b) for g, b in by.items()} for kind, by in both.items()},
        "eval_digest": {str(g): batch_digest(b) for g, b in batches.items()},
        "chance": task.chance,
        "task": asdict(task),
        "settings": asdict(s),
    }
    return (result, model) if return_model else result


# ----------------------------------------------------------------------------- runs


def run_all(schemes: Sequence[str], seeds: Sequence[int], steps: int = STEPS, *, task: GridTask = GridTask(),
            grids: Sequence[int] = GRIDS, settings: TrainSettings = TrainSettings(),
            log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """:func:`train_and_eval` for every scheme and seed, in that order."""
    runs = []
    for name in schemes:
        for seed in seeds:
            res = train_and_eval(name, seed, steps, task=task, grids=grids, settings=settings)
            runs.append(res)
            if log is not None:
                accs = ", ".join(f"G={g}: {a:.3f}" for g, a in res["accuracy"].items())
                log(f"{name} seed {seed}: {accs} ({res['train_seconds']:.1f} s + {res['eval_seconds']:.1f} s)")
    return runs


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per scheme (in first-seen order) and grid size, the mean, minimum and maximum accuracy
    over its runs: ``{scheme: {"seeds": n, "by_grid": {str(G): {"mean", "min", "max"}},
    "shifted": {...}, "window": {...}, "interpolated": {...}}}``, the last three from the
    diagnostics (``shifted_accuracy``, ``window_accuracy``, ``interpolated_accuracy``; empty
    for schemes without them, and for runs stored before a diagnostic existed)."""
    def stats(vals: list[float]) -> dict[str, float]:
        return {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals)}

    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["scheme"] for r in runs):
        mine = [r for r in runs if r["scheme"] == name]
        entry: dict[str, Any] = {"seeds": len(mine)}
        for key, field in (("by_grid", "accuracy"), ("shifted", "shifted_accuracy"), ("window", "window_accuracy"),
                           ("interpolated", "interpolated_accuracy")):
            grids = mine[0].get(field, {})
            entry[key] = {g: stats([r[field][g] for r in mine]) for g in grids}
        out[name] = entry
    return out


#: The notebook's reduced run: seed 0 of every scheme, :data:`STEPS` cut to 400 and 300
#: held-out grids per size, with :class:`TrainSettings`' defaults otherwise (about 10 to 15 s
#: per scheme on 2 CPU threads, the RoPEs with integer positions the slowest: they are also
#: scored with position interpolation). The command line stores it too (``data["reduced"]``), so that the
#: notebook compares its rerun with the stored reduced run, and the stored reduced run with
#: the full one. Fewer steps leave the slower schemes short of their plateau at ``G = 8``.
REDUCED: dict[str, Any] = {"seeds": (0,), "steps": 400, "eval_size": 300}


def reduced_run(schemes: Sequence[str] = tuple(SCHEMES), *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """:func:`run_all` with :data:`REDUCED` for ``schemes`` on :data:`GRIDS`; returns
    ``{"seeds", "steps", "eval_size", "runs", "summary": summarize(runs)}``."""
    settings = replace(TrainSettings(), eval_size=REDUCED["eval_size"])
    runs = run_all(schemes, REDUCED["seeds"], REDUCED["steps"], settings=settings, log=log)
    return {"seeds": list(REDUCED["seeds"]), "steps": REDUCED["steps"], "eval_size": REDUCED["eval_size"],
            "runs": runs, "summary": summarize(runs)}


def _check_flags(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Every flag of :func:`main`, before any work; a bad one is ``parser.error`` naming it."""
    check_run_flags(parser, ns)
    with usage_errors(parser, "--grids"):
        least = GridTask().max_offset + 1  # the task's rule: every offset fits in the grid
        for g in ns.grids:
            if check_positive_int(g, "grids") < least:
                raise ValueError(f"grids must be >= max_offset + 1 = {least}, so that every offset fits in the "
                                 f"grid, got {g}")
        check_distinct(ns.grids, "grids")
    with usage_errors(parser, "--eval-size"):
        check_positive_int(ns.eval_size, "eval_size")


def main(argv: list[str] | None = None) -> int:
    """``python -m companion.lab.grid_task --out FILE [--schemes ...] [--seeds ...] [--steps N]
    [--grids G ...] [--eval-size N] [--threads T] [--skip-reduced]``: run :func:`run_all`,
    then :func:`reduced_run` (unless ``--skip-reduced``), and store the runs, their
    :func:`summarize` and the reduced run with :func:`companion.utils.save_result`. The
    defaults are the chapter's run: every scheme of :data:`SCHEMES` with the five
    :data:`SEEDS`. The stored ``data`` also holds ``eval_seed`` (:data:`EVAL_SEED`) and
    ``eval_digest`` (``{str(G): batch_digest(eval_batch(...))}``), which every run's own
    ``eval_digest`` must equal.

    Every flag is checked before any training: a bad one (``--steps 0``, ``--threads 0``, a
    negative or repeated seed, a grid side below ``max_offset + 1`` or repeated,
    ``--eval-size 0``, a repeated scheme, an ``--out`` that is an existing folder) is the
    parser's usage error (exit status 2) naming the flag."""
    p = argparse.ArgumentParser(prog="python -m companion.lab.grid_task", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result JSON path (required)")
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES),
                   help="position schemes to train (default: all of them)")
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS),
                   help=f"seeds of every scheme (default: {' '.join(map(str, SEEDS))})")
    p.add_argument("--steps", type=int, default=STEPS, help=f"training steps per run (default: {STEPS})")
    p.add_argument("--grids", nargs="+", type=int, default=list(GRIDS),
                   help=f"grid sides evaluated; the models train at {GridTask().grid} (default: {' '.join(map(str, GRIDS))})")
    p.add_argument("--eval-size", type=int, default=TrainSettings().eval_size,
                   help=f"held-out grids per grid size (default: {TrainSettings().eval_size})")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.add_argument("--skip-reduced", action="store_true",
                   help="do not run and store the notebook's reduced run (default: run it)")
    ns = p.parse_args(argv)
    _check_flags(p, ns)
    torch.set_num_threads(ns.threads)
    settings = replace(TrainSettings(), eval_size=ns.eval_size)
    argv_list = sys.argv[1:] if argv is None else list(argv)
    start = time.perf_counter()
    runs = run_all(ns.schemes, ns.seeds, ns.steps, grids=ns.grids, settings=settings,
                   log=lambda line: print(line, flush=True))
    data = {"task": asdict(GridTask()), "grids": list(ns.grids), "settings": asdict(settings),
            "steps": ns.steps, "threads": ns.threads, "total_seconds": time.perf_counter() - start,
            "eval_seed": EVAL_SEED,
            "eval_digest": {str(g): batch_digest(eval_batch(GridTask().at(g), ns.eval_size)) for g in ns.grids},
            "summary": summarize(runs), "runs": runs}
    if not ns.skip_reduced:
        start = time.perf_counter()
        data["reduced"] = reduced_run(ns.schemes, log=lambda line: print("reduced: " + line, flush=True))
        data["reduced"]["total_seconds"] = time.perf_counter() - start
    command = "python -m companion.lab.grid_task " + " ".join(shlex.quote(a) for a in argv_list)
    print(save_result(ns.out, data, command=command))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
