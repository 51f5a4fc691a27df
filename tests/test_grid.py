"""Positions on 2-D and 3-D grids (companion/grid.py, chapter 12).

Every reference below is written here from a published definition, not taken from companion:

* MAE's ``get_2d_sincos_pos_embed`` (numpy, float64, meshgrid in numpy's default ``'xy'``
  order, so the first half of the channels encodes the column);
* F.interpolate on the ``(1, d_model, *grid)`` view of a learned table (DeiT/MAE's resize);
* 2-D / 3-D RoPE as complex numbers in float64: pair ``j`` is ``z_j = a_j + i b_j`` and the
  rotation multiplies it by ``exp(i theta_j)``;
* rope-vit's ``compute_axial_cis`` + ``apply_rotary_emb`` and ``init_random_2d_freqs``
  (float32, the same torch ops);
* HuggingFace's Qwen2-VL M-RoPE: v4's ``Qwen2VLRotaryEmbedding`` +
  ``apply_multimodal_rotary_pos_emb`` and v5's compact form (float32, the same torch ops);
* Qwen2-VL's position ids, written out by hand.

Tolerances (``U32 = 2**-24`` and ``U64 = 2**-53`` are the unit roundoffs).

Rotation, float32 against the exact float64 formula. For a pair ``(a, b)`` rotated by
``theta = sum_a p_a f_a``, with ``Theta = sum_a |p_a f_a|``: a float32 frequency is within
``2 U32`` (relative) of the exact one (a correctly rounded cast or a 1-ulp ``pow``); the angle
costs one rounding per product and per sum, so ``|theta~ - theta| <= 4 U32 Theta`` at most;
cos/sin add one ulp, ``<= 2 U32``; the products ``a c``, ``b s`` and their sum add
``U32 (|a| + |b|)`` each at most. So each coordinate is within
``(|a| + |b|) U32 (4 Theta + 4)``; the tests use ``(|a| + |b|) U32 (4 Theta + 6)``.
Dimensions past ``rotary_dim`` get a zero tolerance: they must be copied bit for bit.

Norms: a rotation by float32 tables whose ``c^2 + s^2`` is within ``4 U32`` of 1 (each within
one ulp, ``2 U32`` relative) changes a pair's norm ``rho`` by at most ``2 U32 rho``; the
roundings of each coordinate add ``2 U32 rho`` (Cauchy-Schwarz on ``|a c| + |b s|``), so
``sqrt(2) * 2 U32 rho`` for the pair: ``< 5 U32 rho`` in all, tested at ``6 U32``.

The relative identity, float64: each rotated vector is within ``u (6 Theta + 6) |x|``
(the per-pair bound above with ``|a| + |b| <= sqrt(2) rho``), a dot product of ``D`` terms
adds ``D u |q| |k|``; two such scores differ by at most twice
``u |q| |k| (12 Theta + 12 + D)``.

Attention, reference against the fused paths: the two differ only in the order of their sums
(``D`` terms per logit, two sums of ``L`` terms in the softmax and its weighted sum), each
partial sum rounding once by at most ``eps`` times the running magnitude ``m``; with a few ulps
for each ``exp`` and division, ``8 (D + 2 L) eps m``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import companion
from companion import (
    AxialRoPE,
    LearnedGridEmbedding,
    MixedRoPE,
    MRoPE,
    RotaryEmbedding,
    Sinusoidal2DEmbedding,
    attention,
    axial_rope_frequencies,
    fast_attention,
    grid_positions,
    grid_rope_angles,
    mrope_cos_sin,
    qwen2vl_position_ids,
    sinusoidal_2d_table,
)
from companion.rope import rope_frequencies
from helpers import U32, U64, assert_within, hf_inv_freq, hf_rotate_half, pair_index, rotation_tol
from helpers import rand_f32 as rand

EPS32 = torch.finfo(torch.float32).eps


def randint(high, shape, seed=0, low=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g)


def shuffled(pos, seed=0):
    """The rows of ``pos`` in a random order (grid positions out of sequence order)."""
    g = torch.Generator().manual_seed(seed)
    return pos[torch.randperm(pos.shape[0], generator=g)]


# ============================================================================ 1. grid_positions


def test_grid_positions_exact_values():
    assert torch.equal(grid_positions((2, 3)), torch.tensor([[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]))
    # (T, H, W) = (2, 2, 3): the last axis fastest, then the middle one
    assert torch.equal(
        grid_positions((2, 2, 3)),
        torch.tensor([
            [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 1, 2],
            [1, 0, 0], [1, 0, 1], [1, 0, 2], [1, 1, 0], [1, 1, 1], [1, 1, 2],
        ]),
    )
    assert torch.equal(grid_positions((5,)), torch.tensor([[0], [1], [2], [3], [4]]))
    for shape in ((2, 3), (2, 2, 3), (5,)):
        assert grid_positions(shape).dtype == torch.int64


@pytest.mark.parametrize("shape", [(3, 4, 5), (7, 2), (1, 1), (6,)])
def test_grid_positions_are_row_major(shape):
    """Token ``n`` sits at numpy's ``unravel_index(n, shape)`` (C order, last axis fastest)."""
    n = math.prod(shape)
    want = np.stack(np.unravel_index(np.arange(n), shape), axis=-1)
    got = grid_positions(shape)
    assert got.shape == (n, len(shape)) and got.dtype == torch.int64
    assert torch.equal(got, torch.from_numpy(want.astype(np.int64)))


@pytest.mark.parametrize("shape", [3.5, True, "4", None, (), (3.5,), (0,), (2, -1), (True, 2), ("4",),
                                   (2, 0), (2, 2.0), (2, 2, 2, 2)])
def test_grid_positions_bad_shape(shape):
    with pytest.raises(ValueError, match="shape"):
        grid_positions(shape)


# ============================================================================ 2. sinusoidal_2d_table vs MAE


def mae_1d_sincos(embed_dim, pos, base=10000.0):
    """MAE's get_1d_sincos_pos_embed_from_grid, numpy float64: ``[sin(pos w), cos(pos w)]``."""
    omega = np.arange(embed_dim // 2, dtype=np.float64)
    omega /= embed_dim / 2.0
    omega = 1.0 / base**omega
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def mae_2d_sincos(embed_dim, grid_hw, base=10000.0):
    """MAE's get_2d_sincos_pos_embed for an (H, W) grid, without the cls token."""
    h, w = grid_hw
    grid_h = np.arange(h, dtype=np.float32)
    grid_w = np.arange(w, dtype=np.float32)
    grid = np.meshgrid(grid_w, grid_h)  # numpy's 'xy': two (H, W) arrays, grid[0] = column
    grid = np.stack(grid, axis=0).reshape(2, 1, h, w)
    emb_a = mae_1d_sincos(embed_dim // 2, grid[0], base)  # MAE calls it emb_h; it is the column
    emb_b = mae_1d_sincos(embed_dim // 2, grid[1], base)
    return np.concatenate([emb_a, emb_b], axis=1)  # (H * W, embed_dim), row-major tokens


@pytest.mark.parametrize("grid", [(4, 4), (3, 5)])
@pytest.mark.parametrize("dim", [16, 64])
def test_sinusoidal_2d_table_is_mae(grid, dim):
    """float32 tables equal MAE's float64 table cast to float32, bit for bit (both compute in
    float64; a one-ulp float64 difference survives the cast to float32 with probability about
    2**-29 per entry)."""
    want = torch.from_numpy(mae_2d_sincos(dim, grid)).float()
    got = sinusoidal_2d_table(grid_positions(grid), dim)
    assert got.dtype == torch.float32 and got.shape == (math.prod(grid), dim)
    assert torch.equal(got, want)


def test_sinusoidal_2d_table_first_half_is_the_column():
    """On a (1, 5) grid only the column changes: the second half (rows) is constant."""
    t = sinusoidal_2d_table(grid_positions((1, 5)), 16)
    assert not torch.equal(t[0, :8], t[1, :8])
    assert torch.equal(t[:, 8:], t[:1, 8:].expand(5, -1))


def test_sinusoidal_2d_table_float64_and_shapes():
    """float64: within rounding of MAE's float64 values. The two may take ``w_i`` as
    ``base**(-i/q)`` or ``1 / base**(i/q)`` (2 ulps apart), so the angle ``p w`` differs by
    ``4 U64 p``, and sin/cos add an ulp each: ``(4 p_max + 4) U64``."""
    grid = (6, 7)
    want = torch.from_numpy(mae_2d_sincos(32, grid, base=100.0))
    got = sinusoidal_2d_table(grid_positions(grid), 32, base=100.0, dtype=torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=(4 * 6 + 4) * U64)
    # any leading shape: (batch, seq, 2) gives (batch, seq, dim)
    pos = torch.stack([grid_positions(grid), shuffled(grid_positions(grid), 1)])
    t = sinusoidal_2d_table(pos, 32, base=100.0)
    assert t.shape == (2, 42, 32)
    assert torch.equal(t[1], sinusoidal_2d_table(pos[1], 32, base=100.0))
    assert torch.equal(t[0], want.float())


@pytest.mark.parametrize("dim", [2, 6, 10, 30])
def test_sinusoidal_2d_table_dim_multiple_of_4(dim):
    with pytest.raises(ValueError, match="dim"):
        sinusoidal_2d_table(grid_positions((2, 2)), dim)


def test_sinusoidal_2d_table_bad_positions():
    with pytest.raises(ValueError, match="positions"):
        sinusoidal_2d_table(grid_positions((2, 2, 2)), 16)
    with pytest.raises(TypeError):
        sinusoidal_2d_table(grid_positions((2, 2)).float(), 16)


# ============================================================================ 3. Sinusoidal2DEmbedding


def test_sinusoidal_2d_embedding_adds_the_table():
    emb = Sinusoidal2DEmbedding(16)
    assert Sinusoidal2DEmbedding.hooks() == ("embed",) and emb.hooks() == ("embed",)
    assert emb.position_axes == 2
    x = rand(2, 12, 16)
    table = torch.from_numpy(mae_2d_sincos(16, (3, 4))).float()
    pos = grid_positions((3, 4))
    assert torch.equal(emb.embed(x, pos), x + table)
    # per-row positions: row 1 reads the grid in another order
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    rows = torch.stack([pos, pos[perm]])
    out = emb.embed(x, rows)
    assert torch.equal(out[0], x[0] + table)
    assert torch.equal(out[1], x[1] + table[perm])


def test_sinusoidal_2d_embedding_dtypes():
    """float64 x: a float64 table (within the MAE bound of the float64 test, plus the add's
    rounding ``U64 |x + t|``); bfloat16 x: the float32 table cast to bf16, added in bf16."""
    emb = Sinusoidal2DEmbedding(16)
    pos = grid_positions((3, 4))
    x64 = rand(1, 12, 16, dtype=torch.float64)
    want = x64 + torch.from_numpy(mae_2d_sincos(16, (3, 4)))
    out = emb.embed(x64, pos)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=0, atol=(4 * 3 + 4) * U64 + U64 * float(want.abs().max()))
    xb = rand(1, 12, 16, dtype=torch.bfloat16)
    outb = emb.embed(xb, pos)
    assert outb.dtype == torch.bfloat16
    assert torch.equal(outb, xb + sinusoidal_2d_table(pos, 16).to(torch.bfloat16))


def test_sinusoidal_2d_embedding_bad_positions():
    emb = Sinusoidal2DEmbedding(16)
    x = rand(1, 6, 16)
    with pytest.raises(ValueError, match="pos"):
        emb.embed(x, torch.arange(6))
    with pytest.raises(ValueError, match="pos"):
        emb.embed(x, grid_positions((2, 2)))  # 4 positions for 6 tokens
    with pytest.raises(TypeError):
        emb.embed(x, grid_positions((2, 3)).float())
    with pytest.raises(ValueError, match="d_model|x"):
        emb.embed(rand(1, 6, 8), grid_positions((2, 3)))


# ============================================================================ 4. LearnedGridEmbedding


def test_learned_grid_gathers_table_row_col():
    torch.manual_seed(0)
    emb = LearnedGridEmbedding((3, 4), 8)
    assert emb.hooks() == ("embed",) and emb.position_axes == 2
    assert emb.table.shape == (3, 4, 8) and emb.table.requires_grad
    pos = shuffled(grid_positions((3, 4)), 2)
    x = rand(2, 12, 8)
    out = emb.embed(x, pos)
    with torch.no_grad():
        for n in range(12):
            r, c = int(pos[n, 0]), int(pos[n, 1])
            assert torch.equal(out[:, n], x[:, n] + emb.table[r, c])
    # per-row positions
    rows = torch.stack([pos, grid_positions((3, 4))])
    out = emb.embed(x, rows)
    with torch.no_grad():
        assert torch.equal(out[1], x[1] + emb.table.reshape(12, 8))


def test_learned_grid_3d_gather():
    torch.manual_seed(1)
    emb = LearnedGridEmbedding((2, 3, 4), 4)
    assert emb.position_axes == 3 and emb.table.shape == (2, 3, 4, 4)
    pos = shuffled(grid_positions((2, 3, 4)), 4)
    x = rand(1, 24, 4)
    out = emb.embed(x, pos)
    with torch.no_grad():
        for n in range(24):
            t, h, w = (int(v) for v in pos[n])
            assert torch.equal(out[0, n], x[0, n] + emb.table[t, h, w])


def test_learned_grid_init_std():
    """8 * 8 * 64 = 4096 N(0, 0.02^2) entries: the sample std is within 0.02 / sqrt(2 * 4096)
    = 2.2e-4 (one standard error) of 0.02; 0.0015 is about 7 of them."""
    torch.manual_seed(0)
    emb = LearnedGridEmbedding((8, 8), 64)
    assert abs(float(emb.table.detach().std()) - 0.02) < 0.0015
    emb = LearnedGridEmbedding((8, 8), 64, init_std=0.5)
    assert abs(float(emb.table.detach().std()) - 0.5) < 0.5 * 0.075


@pytest.mark.parametrize("bad", [[[3, 0]], [[0, 4]], [[-1, 0]], [[0, -1]]])
def test_learned_grid_out_of_range(bad):
    emb = LearnedGridEmbedding((3, 4), 8)
    with pytest.raises(IndexError, match="pos"):
        emb.embed(rand(1, 1, 8), torch.tensor(bad))


def test_learned_grid_wrong_axes():
    emb = LearnedGridEmbedding((3, 4), 8)
    with pytest.raises(ValueError, match="pos"):
        emb.embed(rand(1, 4, 8), grid_positions((1, 2, 2)))
    with pytest.raises(ValueError, match="pos"):
        emb.embed(rand(1, 4, 8), torch.arange(4))


def test_learned_grid_gradient_reaches_table():
    """Each table entry gets the number of times it is read, times the batch size."""
    emb = LearnedGridEmbedding((3, 4), 8)
    pos = torch.tensor([[0, 0], [0, 0], [2, 3], [1, 2]])
    emb.embed(rand(2, 4, 8), pos).sum().backward()
    want = torch.zeros(3, 4, 8)
    want[0, 0] = 4.0
    want[2, 3] = 2.0
    want[1, 2] = 2.0
    assert torch.equal(emb.table.grad, want)


def test_learned_grid_resized_same_size_is_identity():
    """Bicubic with align_corners=False at the same size samples source coordinate
    ``(i + 0.5) * 1 - 0.5 = i`` exactly, where the cubic kernel's four weights are
    ``(0, 1, 0, 0)`` exactly (A = -0.75: each weight polynomial at t = 0 or 1 evaluates to an
    exact 0 or 1 in float32), so the result is the table itself up to at most a rounding of
    a zero-weighted term: 1e-6 is about 50 float32 ulps of the table's largest entries
    (about 0.1) and far below a shifted or blurred table."""
    torch.manual_seed(0)
    emb = LearnedGridEmbedding((5, 7), 8)
    same = emb.resized((5, 7))
    assert isinstance(same, LearnedGridEmbedding) and same is not emb
    assert same.table.shape == (5, 7, 8)
    assert torch.allclose(same.table, emb.table, rtol=0, atol=1e-6)


def interpolate_table(table, size, mode):
    """The documented convention: channels first, interpolate, channels last again."""
    a = table.dim() - 1
    x = table.detach().permute(a, *range(a)).unsqueeze(0)
    y = F.interpolate(x, size=size, mode=mode, align_corners=False)[0]
    return y.permute(*range(1, a + 1), 0)


def test_learned_grid_resized_larger_follows_interpolate():
    """Same function on the same data; if the module orders its loops or memory differently, a
    bicubic output is 16 products and sums, whose weights have ``sum |w| <= 1.375 ** 2`` (A =
    -0.75), so two evaluation orders differ by at most ``2 * 16 * 1.9 * eps * max|table|``,
    under ``64 eps max|table|``. align_corners=True would keep the corners exactly; here
    they move by much more than that bound."""
    torch.manual_seed(0)
    emb = LearnedGridEmbedding((3, 4), 8)
    big = emb.resized((6, 10))
    assert big.table.shape == (6, 10, 8) and big.grid == (6, 10) and big.position_axes == 2
    assert emb.table.shape == (3, 4, 8)  # the original is unchanged
    want = interpolate_table(emb.table, (6, 10), "bicubic")
    tol = 64 * EPS32 * float(emb.table.detach().abs().max())
    torch.testing.assert_close(big.table.detach(), want, rtol=0, atol=tol)
    corners = big.table.detach()[[0, 0, -1, -1], [0, -1, 0, -1]]
    old = emb.table.detach()[[0, 0, -1, -1], [0, -1, 0, -1]]
    assert float((corners - old).abs().max()) > 100 * tol
    assert big.table.requires_grad  # a new trainable table


def test_learned_grid_resized_3d_and_1d():
    torch.manual_seed(2)
    e3 = LearnedGridEmbedding((2, 3, 4), 4)
    r3 = e3.resized((4, 3, 8))
    tol = 64 * EPS32 * float(e3.table.detach().abs().max())
    torch.testing.assert_close(r3.table.detach(), interpolate_table(e3.table, (4, 3, 8), "trilinear"), rtol=0, atol=tol)
    e1 = LearnedGridEmbedding((5,), 4)
    r1 = e1.resized((9,))
    torch.testing.assert_close(r1.table.detach(), interpolate_table(e1.table, (9,), "linear"), rtol=0, atol=tol)
    with pytest.raises(ValueError, match="grid"):
        e3.resized((4, 4))


# ============================================================================ 5. AxialRoPE


def complex_rotate(x, angles, layout, r):
    """Rotate ``x (..., seq, D)`` as complex numbers ``z_j = a_j + i b_j`` times
    ``exp(i angles_j)``, in float64; ``angles`` broadcasts to ``(..., seq, r/2)``."""
    x = x.double()
    ia, ib = pair_index(layout, r)
    z = torch.complex(x[..., ia], x[..., ib]) * torch.polar(torch.ones_like(angles), angles)
    out = x.expand(*z.shape[:-1], x.shape[-1]).clone()
    out[..., ia] = z.real
    out[..., ib] = z.imag
    return out


def axial_freqs_ref(r, n_axes, base):
    """Pair j on axis j // (r/2/A), frequency base ** (-2 A i / r), zero on the other axes."""
    pairs = r // 2
    per = pairs // n_axes
    f = torch.zeros(n_axes, pairs, dtype=torch.float64)
    for j in range(pairs):
        a, i = divmod(j, per)
        f[a, j] = base ** (-2 * n_axes * i / r)
    return f


def grid_angles_ref(pos, freqs):
    """Exact ``theta = sum_a p_a f_a`` and ``Theta = sum_a |p_a f_a|`` in float64; ``freqs``
    ``(A, P)`` gives ``(..., seq, P)``, ``(H, A, P)`` gives ``(..., H, seq, P)``."""
    p = pos.double()
    f = freqs.double()
    if f.dim() == 2:
        return torch.einsum("...sa,ap->...sp", p, f), torch.einsum("...sa,ap->...sp", p.abs(), f.abs())
    return torch.einsum("...sa,hap->...hsp", p, f), torch.einsum("...sa,hap->...hsp", p.abs(), f.abs())


def heads_view(angles, per_row):
    """Angles ``(seq, P)`` / ``(batch, seq, P)`` as broadcastable to ``(batch, heads, seq, P)``."""
    return angles.unsqueeze(1) if per_row else angles


@pytest.mark.parametrize("r,n_axes,base", [(16, 2, 100.0), (24, 3, 100.0), (32, 2, 10000.0), (12, 3, 10.0), (8, 1, 100.0)])
def test_axial_rope_frequencies(r, n_axes, base):
    """float32 values within the 2 U32 of a rounded float32 pow; exact zeros off the axis."""
    got = axial_rope_frequencies(r, n_axes, base)
    want = axial_freqs_ref(r, n_axes, base)
    assert got.shape == (n_axes, r // 2)
    assert torch.equal(got == 0, want == 0)
    torch.testing.assert_close(got.double(), want, rtol=2 * U32, atol=0)


def test_axial_frequencies_2d_match_rope_vit():
    """rope-vit: ``1 / theta ** (arange(0, dim, 4)[: dim // 4].float() / dim)`` per axis."""
    dim = 32
    fx = 1.0 / (100.0 ** (torch.arange(0, dim, 4)[: dim // 4].float() / dim))
    got = axial_rope_frequencies(dim, 2, 100.0)
    torch.testing.assert_close(got[0, : dim // 4], fx, rtol=2 * U32, atol=0)
    torch.testing.assert_close(got[1, dim // 4:], fx, rtol=2 * U32, atol=0)


AXIAL_CASES = [
    # head_dim, n_axes, rotary_dim, grid
    (16, 2, None, (3, 4)),
    (24, 3, None, (2, 3, 2)),
    (32, 2, 16, (4, 3)),
    (12, 3, None, (3, 2, 2)),
]


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("head_dim,n_axes,rotary_dim,grid", AXIAL_CASES)
@pytest.mark.parametrize("per_row", [False, True])
def test_axial_rope_vs_complex_formula(layout, head_dim, n_axes, rotary_dim, grid, per_row):
    scheme = AxialRoPE(head_dim, n_axes, base=100.0, rotary_dim=rotary_dim, layout=layout)
    r = rotary_dim or head_dim
    assert scheme.position_axes == n_axes and scheme.rotary_dim == r and scheme.head_dim == head_dim
    assert scheme.layout == layout and scheme.hooks() == ("rotate",)
    assert scheme.freqs.shape == (n_axes, r // 2)
    seq = math.prod(grid)
    base_pos = grid_positions(grid) * 5  # larger positions, so that the angles wrap around
    q_pos = torch.stack([base_pos, shuffled(base_pos, 1)]) if per_row else base_pos
    k_pos = torch.stack([shuffled(base_pos, 2), base_pos]) if per_row else shuffled(base_pos, 3)
    q, k = rand(2, 3, seq, head_dim, seed=1), rand(2, 1, seq, head_dim, seed=2)
    q2, k2 = scheme.rotate(q, k, q_pos, k_pos)
    assert q2.dtype == torch.float32 and q2.shape == q.shape and k2.shape == k.shape
    freqs = axial_freqs_ref(r, n_axes, 100.0)
    for x, x2, pos in ((q, q2, q_pos), (k, k2, k_pos)):
        theta, big = (heads_view(t, per_row) for t in grid_angles_ref(pos, freqs))
        assert_within(x2, complex_rotate(x, theta, layout, r), rotation_tol(x, big, layout, r))
        # the dimensions past rotary_dim are copied bit for bit
        assert torch.equal(x2[..., r:], x[..., r:])


def rope_vit_axial_cis(dim, end_x, end_y, theta=100.0):
    """rope-vit's compute_axial_cis (float32 ops as written there)."""
    freqs_x = 1.0 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].float() / dim))
    freqs_y = 1.0 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].float() / dim))
    t = torch.arange(end_x * end_y, dtype=torch.float32)
    t_x = (t % end_x).float()
    t_y = torch.div(t, end_x, rounding_mode="floor").float()
    freqs_x = torch.outer(t_x, freqs_x)
    freqs_y = torch.outer(t_y, freqs_y)
    cis_x = torch.polar(torch.ones_like(freqs_x), freqs_x)
    cis_y = torch.polar(torch.ones_like(freqs_y), freqs_y)
    return torch.cat([cis_x, cis_y], dim=-1)


def rope_vit_apply(x, freqs_cis):
    """rope-vit's apply_rotary_emb on x (batch, heads, N, head_dim)."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    f = freqs_cis.view(1, 1, *freqs_cis.shape)  # reshape_for_broadcast: (N, D/2) -> (1, 1, N, D/2)
    return torch.view_as_real(x_ * f).flatten(3).type_as(x)


@pytest.mark.parametrize("head_dim,grid", [(16, (3, 5)), (64, (4, 6))])
def test_axial_rope_is_rope_vit_with_flipped_positions(head_dim, grid):
    """rope-vit's axis x is the column (t % W) and comes first. Both sides are float32, each
    within :func:`rotation_tol` of the exact rotation, so within twice that of each other.
    Without the flip (rows and columns swapped, H != W) the two disagree by O(1)."""
    h, w = grid
    q = rand(2, 2, h * w, head_dim, seed=5)
    want = rope_vit_apply(q, rope_vit_axial_cis(head_dim, end_x=w, end_y=h))
    scheme = AxialRoPE(head_dim, 2, base=100.0)
    pos = grid_positions(grid).flip(-1)  # (col, row) = rope-vit's (x, y)
    got, _ = scheme.rotate(q, q, pos, pos)
    _, big = grid_angles_ref(pos, axial_freqs_ref(head_dim, 2, 100.0))
    tol = 2 * rotation_tol(q, big, "interleaved", head_dim)
    assert_within(got, want.double(), tol)
    wrong, _ = scheme.rotate(q, q, grid_positions(grid), grid_positions(grid))
    assert float((wrong - want).abs().max()) > 0.1


def test_axial_rope_partial_rotary_copies_the_rest():
    scheme = AxialRoPE(48, 2, rotary_dim=16, layout="half")
    q = rand(1, 2, 12, 48, seed=7)
    pos = grid_positions((3, 4)) * 11
    q2, k2 = scheme.rotate(q, q.clone(), pos, pos)
    assert torch.equal(q2[..., 16:], q[..., 16:])
    assert not torch.equal(q2[..., :16], q[..., :16])
    assert torch.equal(q2, k2)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.integers(1, 200), layout=st.sampled_from(["interleaved", "half"]),
       n_axes=st.sampled_from([2, 3]))
def test_axial_rope_preserves_pair_norms(seed, scale, layout, n_axes):
    """Each pair's norm is kept within 6 U32 (module docstring)."""
    hd = 24
    scheme = AxialRoPE(hd, n_axes, layout=layout)
    grid = (2, 3) if n_axes == 2 else (2, 2, 2)
    pos = grid_positions(grid) * scale
    q = rand(1, 2, pos.shape[0], hd, seed=seed)
    q2, _ = scheme.rotate(q, q, pos, pos)
    ia, ib = pair_index(layout, hd)
    rho = q.double()[..., ia].hypot(q.double()[..., ib])
    rho2 = q2.double()[..., ia].hypot(q2.double()[..., ib])
    assert bool(((rho2 - rho).abs() <= 6 * U32 * rho).all())


# ============================================================================ 6. the 2-D relative property


def score_pair(scheme, q, k, p1, p2, s):
    """Scores ``<R(p1) q, R(p2) k>`` and ``<R(p1 + s) q, R(p2 + s) k>`` per head, in one call
    (sequence index 0 holds the unshifted pair, index 1 the shifted one)."""
    q_pos = torch.stack([p1, p1 + s])
    k_pos = torch.stack([p2, p2 + s])
    seq_q = q.expand(-1, -1, 2, -1)
    seq_k = k.expand(-1, -1, 2, -1)
    with torch.no_grad():
        q2, k2 = scheme.rotate(seq_q, seq_k, q_pos, k_pos)
    dots = (q2 * k2).sum(-1)  # (1, heads, 2)
    return dots[..., 0], dots[..., 1], q_pos, k_pos


def relative_tol(q, k, theta_max, dim):
    """The module docstring's ``2 u |q| |k| (12 Theta + 12 + D)`` in float64."""
    return 2 * U64 * float(q.norm(dim=-1).max() * k.norm(dim=-1).max()) * (12 * theta_max + 12 + dim)


positions_2d = st.tuples(st.integers(0, 400), st.integers(0, 400))
positions_3d = st.tuples(st.integers(0, 400), st.integers(0, 400), st.integers(0, 400))


def check_relative(scheme, p1, p2, s, seed, freqs_for_bound):
    d = scheme.head_dim
    heads = scheme.scheme_heads() or 2
    q = rand(1, heads, 1, d, dtype=torch.float64, seed=seed)
    k = rand(1, heads, 1, d, dtype=torch.float64, seed=seed + 1)
    p1, p2, s = (torch.tensor(v) for v in (p1, p2, s))
    a, b, q_pos, k_pos = score_pair(scheme, q, k, p1, p2, s)
    theta_max = max(float(grid_angles_ref(pp, freqs_for_bound)[1].max()) for pp in (q_pos, k_pos))
    tol = relative_tol(q, k, theta_max, d)
    assert float((a - b).abs().max()) <= tol


@settings(max_examples=60, deadline=None)
@given(p1=positions_2d, p2=positions_2d, s=positions_2d, seed=st.integers(0, 1000),
       layout=st.sampled_from(["interleaved", "half"]))
def test_relative_axial_2d(p1, p2, s, seed, layout):
    scheme = AxialRoPE(16, 2, layout=layout).double()
    check_relative(scheme, p1, p2, s, seed, scheme.freqs)


@settings(max_examples=50, deadline=None)
@given(p1=positions_3d, p2=positions_3d, s=positions_3d, seed=st.integers(0, 1000))
def test_relative_axial_3d(p1, p2, s, seed):
    scheme = AxialRoPE(24, 3).double()
    check_relative(scheme, p1, p2, s, seed, scheme.freqs)


@settings(max_examples=50, deadline=None)
@given(p1=positions_2d, p2=positions_2d, s=positions_2d, seed=st.integers(0, 1000))
def test_relative_mixed(p1, p2, s, seed):
    scheme = MixedRoPE(16, 3, generator=torch.Generator().manual_seed(seed)).double()
    check_relative(scheme, p1, p2, s, seed, scheme.freqs.detach())


@settings(max_examples=50, deadline=None)
@given(p1=positions_3d, p2=positions_3d, s=positions_3d, seed=st.integers(0, 1000))
def test_relative_mrope(p1, p2, s, seed):
    scheme = MRoPE(32, (4, 6, 6), base=10000.0).double()
    # M-RoPE as a frequency matrix: pair j on axis(j) with HF's inv_freq
    inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    f = torch.zeros(3, 16, dtype=torch.float64)
    f[0, :4], f[1, 4:10], f[2, 10:] = inv[:4], inv[4:10], inv[10:]
    check_relative(scheme, p1, p2, s, seed, f)


def test_relative_check_can_fail():
    """The bound is tight enough to fail: the same check on float32 rotations (angles
    rounded at 2**-24, not 2**-53) breaks it by orders of magnitude, and a shift of the query
    alone changes the score by O(1)."""
    p1, p2, s = torch.tensor([300, 17]), torch.tensor([5, 399]), torch.tensor([250, 333])
    scheme = AxialRoPE(16, 2).double()
    q = rand(1, 2, 1, 16, dtype=torch.float64, seed=1)
    k = rand(1, 2, 1, 16, dtype=torch.float64, seed=2)
    a, b, q_pos, k_pos = score_pair(scheme, q, k, p1, p2, s)
    theta_max = max(float(grid_angles_ref(pp, scheme.freqs)[1].max()) for pp in (q_pos, k_pos))
    tol = relative_tol(q, k, theta_max, 16)
    assert float((a - b).abs().max()) <= tol
    a32, b32, _, _ = score_pair(AxialRoPE(16, 2), q.float(), k.float(), p1, p2, s)
    assert float((a32 - b32).abs().max()) > 100 * tol
    with torch.no_grad():
        q2, k2 = scheme.rotate(q, k, p1[None], p2[None])
        q3, k3 = scheme.rotate(q, k, (p1 + s)[None], p2[None])
    assert float(((q2 * k2).sum(-1) - (q3 * k3).sum(-1)).abs().max()) > 1e-3


# ============================================================================ 7. MixedRoPE


def rope_vit_init_random_2d_freqs(dim, num_heads, theta=10.0, rotate=True, generator=None):
    """rope-vit's init_random_2d_freqs, float32, as (heads, 2, dim // 2) (ours: head first)."""
    freqs_x, freqs_y = [], []
    mag = 1 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].float() / dim))
    for _ in range(num_heads):
        angles = torch.rand(1, generator=generator) * 2 * torch.pi if rotate else torch.zeros(1)
        fx = torch.cat([mag * torch.cos(angles), mag * torch.cos(torch.pi / 2 + angles)], dim=-1)
        fy = torch.cat([mag * torch.sin(angles), mag * torch.sin(torch.pi / 2 + angles)], dim=-1)
        freqs_x.append(fx)
        freqs_y.append(fy)
    freqs = torch.stack([torch.stack(freqs_x, dim=0), torch.stack(freqs_y, dim=0)], dim=0)  # (2, H, P)
    return freqs.transpose(0, 1), mag


@pytest.mark.parametrize("head_dim,heads,rotary_dim", [(16, 4, None), (64, 6, None), (32, 2, 16)])
def test_mixed_rope_init_is_rope_vit(head_dim, heads, rotary_dim):
    """The same seeded draws give the same angles. Tolerance: rope-vit rounds the angle
    ``2 pi u`` to float32 (``2 pi U32`` rad, so ``6.3 U32`` in cos/sin), then cos/sin (1 ulp,
    ``2 U32``), ``mag`` (``2 U32`` relative) and the product (``U32``): ``12 U32 mag`` against
    an exact evaluation, 16 tested. A different draw would be off by O(mag)."""
    r = rotary_dim or head_dim
    want, mag = rope_vit_init_random_2d_freqs(r, heads, 10.0, True, torch.Generator().manual_seed(42))
    scheme = MixedRoPE(head_dim, heads, rotary_dim=rotary_dim, generator=torch.Generator().manual_seed(42))
    got = scheme.freqs.detach()
    assert isinstance(scheme.freqs, torch.nn.Parameter) and got.shape == (heads, 2, r // 2)
    assert scheme.scheme_heads() == heads and scheme.position_axes == 2 and scheme.hooks() == ("rotate",)
    mag2 = torch.cat([mag, mag]).double()
    assert_within(got, want.double(), (16 * U32 * mag2).expand_as(got))
    # different heads got different angles
    assert not torch.allclose(got[0], got[1])


def test_mixed_rope_rotate_init_false_is_axis_aligned():
    """Angle 0: axis 0 drives the first half of the pairs, axis 1 the second half. The
    off-axis entries are ``mag cos(pi/2)`` (exactly ``mag sin 0 = 0`` for axis 1), zero to
    float32's ``|cos(fl(pi/2))| = 4.4e-8`` (1e-7 tested)."""
    scheme = MixedRoPE(16, 3, rotate_init=False)
    f = scheme.freqs.detach().double()
    mag = 10.0 ** (-4 * torch.arange(4, dtype=torch.float64) / 16)
    for h in range(3):
        torch.testing.assert_close(f[h, 0, :4], mag, rtol=4 * U32, atol=0)
        torch.testing.assert_close(f[h, 1, 4:], mag, rtol=4 * U32, atol=0)
        assert bool((f[h, 0, 4:].abs() <= 1e-7 * mag).all())
        assert bool((f[h, 1, :4].abs() <= 1e-7 * mag).all())


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_mixed_rope_axis_aligned_is_axial_rope(layout):
    """With ``rotate_init=False`` RoPE-Mixed starts as RoPE-Axial with the same base: pairs
    ``< P/2`` turn with axis 0, the rest with axis 1. The only difference is the off-axis
    entries ``mag cos(pi/2)`` (``|cos(fl(pi/2))| <= 4.4e-8``, 1e-7 taken), an angle error
    of at most ``1e-7 mag_j |p_0|`` on the second half of the pairs."""
    hd, heads = 16, 2
    mixed = MixedRoPE(hd, heads, base=10.0, rotate_init=False, layout=layout)
    pos = grid_positions((3, 4)) * 9
    q = rand(1, heads, 12, hd, seed=11)
    got, _ = mixed.rotate(q, q, pos, pos)
    axial = axial_freqs_ref(hd, 2, 10.0)
    theta, big = grid_angles_ref(pos, axial)
    off_axis = axial.flip(0)  # mag_j on the axis that pair j does not follow
    angle_err = 1e-7 * grid_angles_ref(pos, off_axis)[1]
    assert_within(got, complex_rotate(q, theta, layout, hd), rotation_tol(q, big, layout, hd, angle_err))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("per_row", [False, True])
def test_mixed_rope_per_head_angles(layout, per_row):
    """Head h, pair j turns by ``p0 freqs[h, 0, j] + p1 freqs[h, 1, j]`` (the scheme's own
    parameter values, exactly: the frequency term of the bound is a margin)."""
    heads, hd = 3, 16
    scheme = MixedRoPE(hd, heads, layout=layout, generator=torch.Generator().manual_seed(9))
    pos = grid_positions((3, 4)) * 7
    q_pos = torch.stack([pos, shuffled(pos, 5)]) if per_row else pos
    k_pos = torch.stack([shuffled(pos, 6), pos]) if per_row else shuffled(pos, 7)
    q, k = rand(2, heads, 12, hd, seed=3), rand(2, heads, 12, hd, seed=4)
    q2, k2 = scheme.rotate(q, k, q_pos, k_pos)
    freqs = scheme.freqs.detach()
    for x, x2, p in ((q, q2, q_pos), (k, k2, k_pos)):
        theta, big = grid_angles_ref(p, freqs)  # (heads, seq, P) or (batch, heads, seq, P)
        assert_within(x2, complex_rotate(x, theta, layout, hd), rotation_tol(x, big, layout, hd))


def test_mixed_rope_gradients_gradcheck():
    """float64, small shapes: the gradient w.r.t. freqs, q and k is the finite-difference one."""

    class Rotate(torch.nn.Module):
        def __init__(self, scheme):
            super().__init__()
            self.scheme = scheme

        def forward(self, q, k, q_pos, k_pos):
            return self.scheme.rotate(q, k, q_pos, k_pos)

    scheme = MixedRoPE(8, 2, generator=torch.Generator().manual_seed(1)).double()
    wrapper = Rotate(scheme)
    q_pos = torch.tensor([[0, 1], [2, 3], [1, 1]])
    k_pos = torch.tensor([[3, 0], [1, 2], [2, 2]])
    freqs = scheme.freqs.detach().clone().requires_grad_(True)
    q = rand(1, 2, 3, 8, dtype=torch.float64, seed=1).requires_grad_(True)
    k = rand(1, 2, 3, 8, dtype=torch.float64, seed=2).requires_grad_(True)

    def f(freqs, q, k):
        return torch.func.functional_call(wrapper, {"scheme.freqs": freqs}, (q, k, q_pos, k_pos))

    assert torch.autograd.gradcheck(f, (freqs, q, k))


def test_mixed_rope_gradient_reaches_freqs_in_attention():
    scheme = MixedRoPE(16, 2, generator=torch.Generator().manual_seed(0))
    pos = grid_positions((2, 3))
    q, k, v = rand(1, 2, 6, 16, seed=1), rand(1, 2, 6, 16, seed=2), rand(1, 2, 6, 16, seed=3)
    for fn in (attention, fast_attention):
        scheme.freqs.grad = None
        fn(q, k, v, scheme, pos, pos).square().sum().backward()
        g = scheme.freqs.grad
        assert g is not None and g.shape == scheme.freqs.shape and float(g.abs().max()) > 0


def test_mixed_rope_head_count():
    scheme = MixedRoPE(16, 4)
    pos = grid_positions((2, 3))
    q, k, v = rand(1, 2, 6, 16), rand(1, 2, 6, 16), rand(1, 2, 6, 16)
    for fn in (attention, fast_attention):
        with pytest.raises(ValueError, match="head"):
            fn(q, k, v, scheme, pos, pos)
    with pytest.raises(ValueError, match="head"):
        scheme.rotate(q, k, pos, pos)
    # each head turns its keys its own way, so grouped-query keys cannot be shared
    q4 = rand(1, 4, 6, 16)
    with pytest.raises(ValueError, match="head"):
        scheme.rotate(q4, k, pos, pos)


# ============================================================================ 8. MRoPE vs HuggingFace


def hf_qwen2vl_cos_sin(position_ids, inv_freq, attention_scaling=1.0):
    """Qwen2VLRotaryEmbedding.forward: position_ids (3, B, S) -> (3, B, S, dim) tables."""
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def hf_apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """v4's apply_multimodal_rotary_pos_emb."""
    mrope_section = list(mrope_section) * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    return (q * cos) + (hf_rotate_half(q) * sin), (k * cos) + (hf_rotate_half(k) * sin)


def hf_v5_compact(position_ids, inv_freq, mrope_section):
    """v5's form: compact (3, B, S, P) angles, split by section, chunk i from axis i."""
    freqs = position_ids[..., None].float() * inv_freq
    f = torch.cat([c[i % 3] for i, c in enumerate(freqs.split(list(mrope_section), dim=-1))], dim=-1)
    return f.cos(), f.sin()


def random_thw(batch, seq, seed, high=60):
    return randint(high, (3, batch, seq), seed)


@pytest.mark.parametrize("head_dim,section,base", [(128, (16, 24, 24), 1e6), (64, (8, 12, 12), 10000.0)])
def test_mrope_equals_huggingface_v4(head_dim, section, base):
    scheme = MRoPE(head_dim, section, base)
    assert scheme.position_axes == 3 and scheme.hooks() == ("rotate",)
    ids = random_thw(2, 10, seed=head_dim)
    q, k = rand(2, 4, 10, head_dim, seed=1), rand(2, 2, 10, head_dim, seed=2)
    cos, sin = hf_qwen2vl_cos_sin(ids, hf_inv_freq(head_dim, base))
    want_q, want_k = hf_apply_multimodal_rotary_pos_emb(q, k, cos, sin, section)
    pos = ids.permute(1, 2, 0)  # (B, S, 3)
    got_q, got_k = scheme.rotate(q, k, pos, pos)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # shared (seq, 3) positions are row 0 for every batch row
    got_q, _ = scheme.rotate(q, k, pos[0], pos[0])
    cos0, sin0 = hf_qwen2vl_cos_sin(ids[:, :1].expand(-1, 2, -1), hf_inv_freq(head_dim, base))
    want_q, _ = hf_apply_multimodal_rotary_pos_emb(q, k, cos0, sin0, section)
    assert torch.equal(got_q, want_q)


def test_mrope_custom_inv_freq_and_attention_factor():
    inv = hf_inv_freq(64, 5e5) * torch.linspace(1.0, 0.25, 32)
    scheme = MRoPE(64, (8, 12, 12), inv_freq=inv, attention_factor=0.8)
    ids = random_thw(1, 9, seed=4)
    q = rand(1, 2, 9, 64, seed=5)
    cos, sin = hf_qwen2vl_cos_sin(ids, inv, attention_scaling=0.8)
    want, _ = hf_apply_multimodal_rotary_pos_emb(q, q, cos, sin, (8, 12, 12))
    got, _ = scheme.rotate(q, q, ids.permute(1, 2, 0), ids.permute(1, 2, 0))
    assert torch.equal(got, want)


@pytest.mark.parametrize("section", [(16, 24, 24), (8, 12, 12), (0, 32, 32), (64, 0, 0)])
def test_mrope_cos_sin_is_huggingface_v5(section):
    p = sum(section)
    inv = hf_inv_freq(2 * p, 1e6)
    ids = random_thw(2, 7, seed=p)
    cos_hf, sin_hf = hf_v5_compact(ids, inv, section)
    cos, sin = mrope_cos_sin(ids.permute(1, 2, 0), inv, section)
    assert cos.dtype == torch.float32 and cos.shape == (2, 7, p)
    assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)
    # the full-width v4 tables are cat(compact, compact)
    cos4, sin4 = hf_qwen2vl_cos_sin(ids, inv)
    sec2 = list(section) * 2
    sel_cos = torch.cat([m[i % 3] for i, m in enumerate(cos4.split(sec2, dim=-1))], dim=-1)
    sel_sin = torch.cat([m[i % 3] for i, m in enumerate(sin4.split(sec2, dim=-1))], dim=-1)
    assert torch.equal(torch.cat((cos, cos), -1), sel_cos) and torch.equal(torch.cat((sin, sin), -1), sel_sin)
    # shared positions (seq, 3) give (seq, P); attention_factor multiplies both tables
    c0, s0 = mrope_cos_sin(ids.permute(1, 2, 0)[0], inv, section, attention_factor=0.7)
    assert c0.shape == (7, p)
    assert torch.equal(c0, cos[0] * 0.7) and torch.equal(s0, sin[0] * 0.7)


def test_mrope_bf16_within_one_rounding():
    """bf16 in: float32 arithmetic, one cast on store. So the result is the float32 rotation
    of the (exactly upcast) bf16 inputs, rounded once to bf16: within ``2**-8`` (bf16's unit
    roundoff, 8 significant bits) of it, relatively."""
    scheme = MRoPE(64, (8, 12, 12))
    ids = random_thw(2, 8, seed=6).permute(1, 2, 0)
    qb = rand(2, 2, 8, 64, dtype=torch.bfloat16, seed=7)
    got, _ = scheme.rotate(qb, qb, ids, ids)
    ref, _ = scheme.rotate(qb.float(), qb.float(), ids, ids)
    assert got.dtype == torch.bfloat16
    err = (got.float() - ref).abs()
    assert bool((err <= 2.0**-8 * ref.abs()).all())


# ============================================================================ 9. MRoPE on text = RoPE


def text3(pos):
    return pos.unsqueeze(-1).expand(*pos.shape, 3).contiguous()


@pytest.mark.parametrize("head_dim,section,base", [(128, (16, 24, 24), 1e6), (64, (8, 12, 12), 10000.0)])
def test_mrope_text_positions_equal_rope(head_dim, section, base):
    mrope = MRoPE(head_dim, section, base)
    rope = RotaryEmbedding(head_dim, base=base)
    q, k = rand(2, 4, 9, head_dim, seed=1), rand(2, 2, 9, head_dim, seed=2)
    # shared positions
    p = torch.arange(9)
    a, b = mrope.rotate(q, k, text3(p), text3(p))
    c, d = rope.rotate(q, k, p, p)
    assert torch.equal(a, c) and torch.equal(b, d)
    # per-row positions (left padding: row 1 starts 3 later)
    pr = torch.stack([torch.arange(9), torch.arange(9) + 3])
    a, b = mrope.rotate(q, k, text3(pr), text3(pr))
    c, d = rope.rotate(q, k, pr, pr)
    assert torch.equal(a, c) and torch.equal(b, d)
    # KV-cache decoding: 2 new queries after 7 cached keys
    qd = q[:, :, :2]
    qp, kp = torch.arange(7, 9), torch.arange(9)
    a, b = mrope.rotate(qd, k, text3(qp), text3(kp))
    c, d = rope.rotate(qd, k, qp, kp)
    assert torch.equal(a, c) and torch.equal(b, d)


def test_mrope_default_positions_are_text():
    mrope = MRoPE(64, (8, 12, 12))
    dp = mrope.default_positions(5, 3, torch.device("cpu"))
    assert dp.dtype == torch.int64 and torch.equal(dp, text3(torch.arange(3, 8)))
    rope = RotaryEmbedding(64)
    q, k, v = rand(1, 2, 6, 64, seed=1), rand(1, 2, 6, 64, seed=2), rand(1, 2, 6, 64, seed=3)
    for causal in (False, True):
        assert torch.equal(attention(q, k, v, mrope, causal=causal), attention(q, k, v, rope, causal=causal))
    # decoding: 2 queries after 6 keys default to text positions 4, 5
    assert torch.equal(attention(q[:, :, :2], k, v, mrope, causal=True), attention(q[:, :, :2], k, v, rope, causal=True))


def test_2d_schemes_have_no_default_positions():
    q, k, v = rand(1, 2, 6, 16), rand(1, 2, 6, 16), rand(1, 2, 6, 16)
    for scheme in (AxialRoPE(16), MixedRoPE(16, 2)):
        with pytest.raises(ValueError):
            scheme.default_positions(6, 0, torch.device("cpu"))
        for fn in (attention, fast_attention):
            with pytest.raises(ValueError):
                fn(q, k, v, scheme)


# ============================================================================ 10. attention integration


def grid_schemes():
    return [
        ("axial", AxialRoPE(16, 2), 2),
        ("axial3", AxialRoPE(24, 3), 3),
        ("mixed", MixedRoPE(16, 4, generator=torch.Generator().manual_seed(0)), 2),
        ("mrope", MRoPE(16, (2, 3, 3)), 3),
    ]


def attn_bound(q, k, v, scale):
    """``8 (D + 2 L) eps m``, ``m`` the largest of the values, the logits and 1 (``k`` may
    have fewer heads: grouped-query attention repeats each)."""
    q, k = q.detach(), k.detach().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q.double() @ k.double().transpose(-1, -2)).abs().max() * scale
    m = max(float(v.abs().max()), float(logits), 1.0)
    return 8 * (q.shape[-1] + 2 * k.shape[-2]) * EPS32 * m


@pytest.mark.parametrize("name,scheme,axes", grid_schemes(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_and_fast_attention_agree(name, scheme, axes, per_row, causal):
    d = scheme.head_dim
    grid = (3, 4) if axes == 2 else (2, 2, 3)
    pos = grid_positions(grid) * 3
    q_pos = torch.stack([pos, shuffled(pos, 1)]) if per_row else pos
    k_pos = torch.stack([shuffled(pos, 2), pos]) if per_row else shuffled(pos, 3)
    kv = 4 if name == "mixed" else 2  # per-head frequencies: no grouped-query keys
    q, k, v = rand(2, 4, 12, d, seed=1), rand(2, kv, 12, d, seed=2), rand(2, kv, 12, d, seed=3)
    ref = attention(q, k, v, scheme, q_pos, k_pos, causal=causal)
    fast = fast_attention(q, k, v, scheme, q_pos, k_pos, causal=causal)
    qr, kr = scheme.rotate(q, k, q_pos, k_pos)
    torch.testing.assert_close(fast, ref, rtol=0, atol=attn_bound(qr, kr, v, d**-0.5))


def index_mask(q_len, k_len):
    """Key j visible to query i iff ``j <= i + max(k_len - q_len, 0)``: aligned at the end for
    decoding (queries are the last tokens), at the start when there are more queries than
    keys, as the package's 1-D default positions do (queries ``arange(q_len)``, keys
    ``arange(k_len)``)."""
    i = torch.arange(q_len).unsqueeze(-1)
    j = torch.arange(k_len)
    return j <= i + max(k_len - q_len, 0)


@pytest.mark.parametrize("name,scheme,axes", grid_schemes(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("q_len,k_len", [(12, 12), (3, 12), (1, 12)])
def test_causal_grid_masks_by_index(name, scheme, axes, q_len, k_len):
    """Shuffled grid positions: a mask by position would differ from the mask by index."""
    d = scheme.head_dim
    grid = (3, 4) if axes == 2 else (2, 2, 3)
    k_pos = shuffled(grid_positions(grid), 4)
    q_pos = k_pos[k_len - q_len:]
    q, k, v = rand(1, 4, q_len, d, seed=1), rand(1, 4, k_len, d, seed=2), rand(1, 4, k_len, d, seed=3)
    mask = index_mask(q_len, k_len)
    ref = attention(q, k, v, scheme, q_pos, k_pos, causal=True)
    explicit = attention(q, k, v, scheme, q_pos, k_pos, attn_mask=mask)
    assert torch.equal(ref, explicit)
    full = attention(q, k, v, scheme, q_pos, k_pos)
    if q_len > 1:
        assert not torch.allclose(ref, full)
    qr, kr = scheme.rotate(q, k, q_pos, k_pos)
    fast = fast_attention(q, k, v, scheme, q_pos, k_pos, causal=True)
    torch.testing.assert_close(fast, ref, rtol=0, atol=attn_bound(qr, kr, v, d**-0.5))


@pytest.mark.parametrize("q_len,k_len", [(6, 4), (4, 4), (2, 4)])
def test_causal_grid_mask_is_the_sequence_mask(q_len, k_len):
    """The grid mask by index is the 1-D causal mask with default positions (NoPE): the
    same weights for every shape, more queries than keys included (query i then sees keys
    ``j <= i``)."""
    scheme = AxialRoPE(16, 2)
    q_pos, k_pos = shuffled(grid_positions((2, 3)))[:q_len], grid_positions((2, 2))
    q, k, v = rand(1, 2, q_len, 16, seed=1), rand(1, 2, k_len, 16, seed=2), rand(1, 2, k_len, 16, seed=3)
    _, w_grid = attention(q, k, v, scheme, q_pos, k_pos, causal=True, return_weights=True)
    _, w_seq = attention(q, k, v, None, causal=True, return_weights=True)
    assert torch.equal(w_grid > 0, w_seq > 0)
    assert torch.equal(w_grid[0, 0] > 0, index_mask(q_len, k_len))


@pytest.mark.parametrize("fn", [attention, fast_attention])
def test_attention_grid_position_errors(fn):
    scheme = AxialRoPE(16, 2)
    q, k, v = rand(1, 2, 6, 16), rand(1, 2, 6, 16), rand(1, 2, 6, 16)
    pos = grid_positions((2, 3))
    with pytest.raises(ValueError, match="q_pos"):
        fn(q, k, v, scheme, torch.arange(6), pos)
    with pytest.raises(ValueError, match="k_pos"):
        fn(q, k, v, scheme, pos, torch.arange(6))
    with pytest.raises(ValueError, match="q_pos"):
        fn(q, k, v, scheme, grid_positions((1, 2, 3)), pos)
    with pytest.raises(ValueError, match="k_pos"):
        fn(q, k, v, scheme, pos, grid_positions((2, 2)))
    with pytest.raises(ValueError, match="q_pos"):
        fn(q, k, v, scheme, torch.stack([pos, pos, pos]), pos)  # 3 rows for a batch of 1
    with pytest.raises(TypeError):
        fn(q, k, v, scheme, pos.float(), pos)
    with pytest.raises(TypeError):
        fn(q, k, v, scheme, pos, pos.double())


# ============================================================================ 11. qwen2vl_position_ids


def test_qwen2vl_image_example_by_hand():
    """text x3, an image of grid (t, h, w) = (1, 4, 6) patches, text x2.

    With merge 2 the image is (1, 2, 3) = 6 tokens. Text: (0,0,0), (1,1,1), (2,2,2); the image
    starts at p = 3: t = 3, h = 3 + {0, 1}, w = 3 + {0, 1, 2}, row-major; its largest position
    is 5, so the text continues at 6 (= 3 + max(1, 2, 3)): (6,6,6), (7,7,7). The largest
    position is 7 and there are 11 tokens: delta = 7 + 1 - 11 = -3.
    """
    types = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]])
    pos, deltas = qwen2vl_position_ids(types, image_grid_thw=torch.tensor([[1, 4, 6]]))
    want = torch.tensor([[
        [0, 0, 0], [1, 1, 1], [2, 2, 2],
        [3, 3, 3], [3, 3, 4], [3, 3, 5],
        [3, 4, 3], [3, 4, 4], [3, 4, 5],
        [6, 6, 6], [7, 7, 7],
    ]])
    assert pos.dtype == torch.int64 and torch.equal(pos, want)
    assert deltas.shape == (1,) and deltas.tolist() == [-3]


def test_qwen2vl_video_intervals_by_hand():
    """text x2, a video of grid (4, 4, 4): merged (4, 2, 2) = 16 tokens, text x1.

    Text (0,0,0), (1,1,1); the video starts at p = 2 with t = 2 + floor(t_i * interval),
    h = 2 + h_i, w = 2 + w_i, w fastest, then h, then t. Interval 1: t = 2..5, largest 5, the
    text after it at 6; 19 tokens, delta 6 + 1 - 19 = -12. Interval 2: t = 2, 4, 6, 8, the
    text at 9, delta 9 + 1 - 19 = -9. Interval 0.5: t = 2, 2, 3, 3, largest position 3, the
    text at 4, delta 4 + 1 - 19 = -14.
    """
    types = torch.tensor([[0, 0] + [2] * 16 + [0]])
    grid = torch.tensor([[4, 4, 4]])

    def block(ts):
        return [[t, 2 + h, 2 + w] for t in ts for h in (0, 1) for w in (0, 1)]

    cases = {1.0: ([2, 3, 4, 5], 6, -12), 2.0: ([2, 4, 6, 8], 9, -9), 0.5: ([2, 2, 3, 3], 4, -14)}
    for interval, (ts, nxt, delta) in cases.items():
        pos, deltas = qwen2vl_position_ids(types, video_grid_thw=grid, video_time_interval=interval)
        want = torch.tensor([[[0, 0, 0], [1, 1, 1]] + block(ts) + [[nxt, nxt, nxt]]])
        assert torch.equal(pos, want), interval
        assert deltas.tolist() == [delta], interval
    # the interval-1 block written out in full, to check block() itself
    assert block([2, 3, 4, 5])[:6] == [[2, 2, 2], [2, 2, 3], [2, 3, 2], [2, 3, 3], [3, 2, 2], [3, 2, 3]]


def test_qwen2vl_image_and_video_in_one_row():
    """text, image (1, 4, 4) -> (1, 2, 2) = 4 tokens at p = 1: (1,1,1) (1,1,2) (1,2,1) (1,2,2),
    largest 2; text at 3; video (2, 4, 4) -> (2, 2, 2) = 8 tokens at p = 4, t = 4, 5, largest 5;
    text at 6. 15 tokens, delta 6 + 1 - 15 = -8."""
    types = torch.tensor([[0, 1, 1, 1, 1, 0] + [2] * 8 + [0]])
    pos, deltas = qwen2vl_position_ids(types, torch.tensor([[1, 4, 4]]), torch.tensor([[2, 4, 4]]))
    want = torch.tensor([[
        [0, 0, 0],
        [1, 1, 1], [1, 1, 2], [1, 2, 1], [1, 2, 2],
        [3, 3, 3],
        [4, 4, 4], [4, 4, 5], [4, 5, 4], [4, 5, 5], [5, 4, 4], [5, 4, 5], [5, 5, 4], [5, 5, 5],
        [6, 6, 6],
    ]])
    assert torch.equal(pos, want) and deltas.tolist() == [-8]


def test_qwen2vl_batch_consumes_grids_in_order_with_left_padding():
    """Row 0: 2 pads, then the image example (grid (1, 4, 6)); row 1: text x5, an image of grid
    (1, 2, 12) -> (1, 1, 6) = 6 tokens at p = 5: (5, 5, 5..10), then text at 11, 12. The grids
    are consumed in order: row 0's first. Padded entries are 0; the rest are the unpadded
    row's positions. deltas: row 0, largest 7 + 1 - 11 unpadded tokens = -3; row 1,
    12 + 1 - 13 = 0. (This is transformers 5's rule, which counts the unpadded tokens and
    leaves pads at 0; transformers 4's get_rope_index filled pads with 1 and subtracted the
    padded length, 13 for row 0, giving -5.)"""
    types = torch.tensor([
        [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0],
    ])
    mask = torch.tensor([[0, 0] + [1] * 11, [1] * 13])
    grids = torch.tensor([[1, 4, 6], [1, 2, 12]])
    pos, deltas = qwen2vl_position_ids(types, grids, attention_mask=mask)
    row0 = [[0, 0, 0]] * 2 + [
        [0, 0, 0], [1, 1, 1], [2, 2, 2],
        [3, 3, 3], [3, 3, 4], [3, 3, 5], [3, 4, 3], [3, 4, 4], [3, 4, 5],
        [6, 6, 6], [7, 7, 7],
    ]
    row1 = [[0, 0, 0], [1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4],
            [5, 5, 5], [5, 5, 6], [5, 5, 7], [5, 5, 8], [5, 5, 9], [5, 5, 10],
            [11, 11, 11], [12, 12, 12]]
    assert torch.equal(pos, torch.tensor([row0, row1]))
    assert deltas.tolist() == [-3, 0]
    # the padded row equals the same row without padding, shifted
    alone, d_alone = qwen2vl_position_ids(types[:1, 2:], grids[:1])
    assert torch.equal(pos[0, 2:], alone[0]) and d_alone.tolist() == [-3]


def test_qwen2vl_text_only():
    types = torch.zeros(2, 5, dtype=torch.int64)
    pos, deltas = qwen2vl_position_ids(types)
    assert torch.equal(pos, text3(torch.arange(5)).expand(2, -1, -1))
    assert deltas.tolist() == [0, 0]


def test_qwen2vl_positions_feed_mrope():
    """HF's layout is (3, batch, seq): positions.permute(2, 0, 1); MRoPE takes ours directly."""
    types = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]])
    pos, _ = qwen2vl_position_ids(types, torch.tensor([[1, 4, 6]]))
    scheme = MRoPE(64, (8, 12, 12), 1e6)
    q = rand(1, 2, 11, 64, seed=8)
    cos, sin = hf_qwen2vl_cos_sin(pos.permute(2, 0, 1), hf_inv_freq(64, 1e6))
    want, _ = hf_apply_multimodal_rotary_pos_emb(q, q, cos, sin, (8, 12, 12))
    got, _ = scheme.rotate(q, q, pos, pos)
    assert torch.equal(got, want)


@pytest.mark.parametrize("types,image,video,name", [
    ([[0, 1, 1, 1, 1, 1, 0]], [[1, 4, 6]], None, "image_grid_thw"),        # 5 tokens, grid needs 6
    ([[0, 1, 1, 1, 1, 1, 1, 1, 0]], [[1, 4, 6]], None, "image_grid_thw"),  # 7 tokens
    ([[0, 1, 1, 1, 1, 0]], None, None, "image_grid_thw"),                  # no grid at all
    ([[0, 1, 1, 1, 1, 0]], [[1, 4, 4], [1, 4, 4]], None, "image_grid_thw"),  # a grid left over
    ([[0, 2, 2, 2, 0]], None, [[2, 4, 4]], "video_grid_thw"),              # 3 tokens, grid needs 8
    ([[0, 2, 2, 0]], None, None, "video_grid_thw"),
])
def test_qwen2vl_mismatch(types, image, video, name):
    types = torch.tensor(types)
    image = None if image is None else torch.tensor(image)
    video = None if video is None else torch.tensor(video)
    with pytest.raises(ValueError, match=name):
        qwen2vl_position_ids(types, image, video)


def test_qwen2vl_bad_token_types():
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        qwen2vl_position_ids(torch.tensor([[0, 3, 0]]))


# ============================================================================ 12. validation


@pytest.mark.parametrize("section", [(16, 24, 20), (-4, 20, 16), (16, 48), (8, 8, 8, 8), (32, 32, 1)])
def test_mrope_section_errors(section):
    with pytest.raises(ValueError, match="mrope_section"):
        MRoPE(128, section)
    with pytest.raises(ValueError, match="mrope_section"):
        mrope_cos_sin(grid_positions((1, 2, 2)), hf_inv_freq(128, 1e6), section)


def test_mrope_partial_rotary():
    """rotary_dim 32 of head_dim 64: sections sum to 16; the other 32 dims are copied."""
    scheme = MRoPE(64, (4, 6, 6), rotary_dim=32)
    ids = random_thw(1, 5, seed=9)
    q = rand(1, 2, 5, 64, seed=10)
    got, _ = scheme.rotate(q, q, ids.permute(1, 2, 0), ids.permute(1, 2, 0))
    assert torch.equal(got[..., 32:], q[..., 32:])
    cos, sin = hf_qwen2vl_cos_sin(ids, hf_inv_freq(32, 10000.0))
    want, _ = hf_apply_multimodal_rotary_pos_emb(q[..., :32], q[..., :32], cos, sin, (4, 6, 6))
    assert torch.equal(got[..., :32], want)
    with pytest.raises(ValueError, match="mrope_section"):
        MRoPE(64, (8, 12, 12), rotary_dim=32)


@pytest.mark.parametrize("args,kwargs", [
    ((16, 3), {}),                    # 8 pairs, not divisible by 3 axes
    ((18, 2), {}),                    # 9 pairs for 2 axes
    ((32, 2), {"rotary_dim": 6}),     # 3 pairs for 2 axes
    ((32, 2), {"rotary_dim": 7}),     # odd
    ((32, 2), {"rotary_dim": 40}),    # > head_dim
])
def test_axial_rotary_dim_errors(args, kwargs):
    with pytest.raises(ValueError, match="rotary_dim"):
        AxialRoPE(*args, **kwargs)


@pytest.mark.parametrize("r,n_axes", [(16, 3), (18, 2), (6, 2), (7, 1)])
def test_axial_frequencies_rotary_dim_errors(r, n_axes):
    with pytest.raises(ValueError, match="rotary_dim"):
        axial_rope_frequencies(r, n_axes)


@pytest.mark.parametrize("head_dim,rotary_dim", [(10, None), (16, 6), (16, 2)])
def test_mixed_rotary_dim_errors(head_dim, rotary_dim):
    """MixedRoPE needs an even number of pairs (rotary_dim % 4 == 0)."""
    with pytest.raises(ValueError, match="rotary_dim"):
        MixedRoPE(head_dim, 2, rotary_dim=rotary_dim)


@pytest.mark.parametrize("scheme,good,bad", [
    (AxialRoPE(16, 2), (2, 3), (1, 2, 3)),
    (AxialRoPE(24, 3), (1, 2, 3), (2, 3)),
    (MixedRoPE(16, 2), (2, 3), (1, 2, 3)),
    (MRoPE(16, (2, 3, 3)), (1, 2, 3), (2, 3)),
], ids=["axial2", "axial3", "mixed", "mrope"])
def test_rotate_wrong_axes(scheme, good, bad):
    q = rand(1, 2, 6, scheme.head_dim)
    good, bad = grid_positions(good), grid_positions(bad)
    with pytest.raises(ValueError, match="q_pos|positions"):
        scheme.rotate(q, q, bad, good)
    with pytest.raises(ValueError, match="k_pos|positions"):
        scheme.rotate(q, q, good, bad)
    with pytest.raises(ValueError, match="q_pos|positions"):
        scheme.rotate(q, q, torch.arange(6), good)
    with pytest.raises(TypeError):
        scheme.rotate(q, q, good.float(), good)


def test_grid_rope_angles_exact_arithmetic():
    """float32, axis by axis: ``((p0 f0) + (p1 f1)) + (p2 f2)``, each step rounded once, so a
    float32 transcription of that order is equal bit for bit."""
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 300, (2, 7, 3), generator=g)
    freqs = torch.rand(3, 5, generator=g)
    want = pos[..., 0, None].float() * freqs[0]
    want = want + pos[..., 1, None].float() * freqs[1]
    want = want + pos[..., 2, None].float() * freqs[2]
    got = grid_rope_angles(pos, freqs)
    assert got.dtype == torch.float32 and got.shape == (2, 7, 5)
    assert torch.equal(got, want)
    assert torch.equal(grid_rope_angles(pos[0], freqs), want[0])
    # per-head frequencies (heads, A, P): angles (..., heads, seq, P)
    fh = torch.rand(4, 3, 5, generator=g)
    got = grid_rope_angles(pos, fh)
    assert got.shape == (2, 4, 7, 5)
    wh = pos[:, None, :, 0, None].float() * fh[None, :, None, 0]
    wh = wh + pos[:, None, :, 1, None].float() * fh[None, :, None, 1]
    wh = wh + pos[:, None, :, 2, None].float() * fh[None, :, None, 2]
    assert torch.equal(got, wh)
    assert grid_rope_angles(pos[0], fh).shape == (4, 7, 5)
    # float64 frequencies: float64 angles
    assert grid_rope_angles(pos, freqs.double()).dtype == torch.float64


def test_grid_rope_angles_errors():
    with pytest.raises(ValueError, match="positions|freqs"):
        grid_rope_angles(grid_positions((2, 3)), torch.rand(3, 4))
    with pytest.raises(TypeError):
        grid_rope_angles(grid_positions((2, 3)).float(), torch.rand(2, 4))


def test_reexported_from_companion():
    for name in ("grid_positions", "sinusoidal_2d_table", "Sinusoidal2DEmbedding", "LearnedGridEmbedding",
                 "axial_rope_frequencies", "grid_rope_angles", "AxialRoPE", "MixedRoPE", "mrope_cos_sin",
                 "MRoPE", "qwen2vl_position_ids"):
        assert getattr(companion, name) is getattr(companion.grid, name)


# ----------------------------------------------------------------------------- Qwen3-VL interleaved


def qwen3vl_tables(position_ids: torch.Tensor, head_dim: int, section, base: float):
    """HuggingFace's Qwen3-VL interleaved M-RoPE tables, transcribed op for op (float32):
    the angles of all three coordinates, then the h and w columns ``offset::3`` (up to
    ``3 * s``) copied over the t ones; full width ``cat(f, f)``. position_ids (3, B, S)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = position_ids[..., None].float() * inv
    out = []
    for fn in (torch.cos, torch.sin):
        f = fn(freqs)
        thw = f[0].clone()
        for dim, offset in ((1, 1), (2, 2)):
            idx = slice(offset, section[dim] * 3, 3)
            thw[..., idx] = f[dim, ..., idx]
        out.append(torch.cat((thw, thw), dim=-1))
    return out


@pytest.mark.parametrize("head_dim, section", [(128, (24, 20, 20)), (64, (12, 10, 10))])
def test_interleaved_mrope_equals_qwen3vl_arithmetic(head_dim, section):
    g = torch.Generator().manual_seed(7)
    pos = torch.randint(0, 3000, (2, 11, 3), generator=g)
    cos_hf, sin_hf = qwen3vl_tables(pos.permute(2, 0, 1), head_dim, section, 5e5)
    c, s = companion.mrope_cos_sin(pos, companion.rope_frequencies(head_dim, 5e5), section, interleaved=True)
    assert torch.equal(torch.cat((c, c), -1), cos_hf) and torch.equal(torch.cat((s, s), -1), sin_hf)
    q = torch.randn(2, 3, 11, head_dim, generator=g)
    ours = companion.MRoPE(head_dim, section, 5e5, interleaved=True).rotate(q, q, pos, pos)[0]
    half = torch.cat((-q[..., head_dim // 2:], q[..., : head_dim // 2]), dim=-1)
    theirs = q * cos_hf.unsqueeze(1) + half * sin_hf.unsqueeze(1)
    assert torch.equal(ours, theirs)
    # and it is a different layout from Qwen2-VL's consecutive sections
    assert not torch.equal(ours, companion.MRoPE(head_dim, section, 5e5).rotate(q, q, pos, pos)[0])


def test_interleaved_axis_of_pair_and_text_positions():
    axis = companion.mrope_axis_of_pair((24, 20, 20), interleaved=True)
    assert axis[:6].tolist() == [0, 1, 2, 0, 1, 2] and axis[60:].tolist() == [0, 0, 0, 0]
    assert [int((axis == a).sum()) for a in range(3)] == [24, 20, 20]
    # text-only positions still give plain RoPE, bit for bit
    q = torch.randn(1, 2, 9, 128, generator=torch.Generator().manual_seed(1))
    text = torch.arange(9)
    m = companion.MRoPE(128, (24, 20, 20), 5e5, interleaved=True).rotate(q, q, text[:, None].expand(9, 3), text[:, None].expand(9, 3))
    r = companion.RotaryEmbedding(128, base=5e5).rotate(q, q, text, text)
    assert torch.equal(m[0], r[0])


def test_interleaved_mrope_validation():
    with pytest.raises(ValueError, match="interleaved mrope_section needs 3 \\* s_h"):
        companion.MRoPE(16, (0, 4, 4), interleaved=True)      # 3 * 4 > 8 pairs
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        companion.MRoPE(16, (2, 3, 3), interleaved=1)
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        companion.mrope_axis_of_pair((2, 3, 3), interleaved="yes")


@pytest.mark.parametrize("name,scheme,axes", grid_schemes(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("path", ["sdpa-mask", "blockwise"])
def test_grid_schemes_on_every_fast_path_with_masks_and_gradients(name, scheme, axes, path, monkeypatch):
    """A padding mask with causal=True, float64, forward and backward (q, k, v and MixedRoPE's
    frequencies): fast_attention's SDPA path and its blockwise path (forced by a zero mask
    budget; it tiles by sequence order) agree with the reference."""
    from companion import dispatch

    if path == "blockwise":
        monkeypatch.setattr(dispatch, "SDPA_MASK_BYTES", 0)
    scheme = scheme.double()
    d = scheme.head_dim
    grid = (3, 4) if axes == 2 else (2, 2, 3)
    pos = shuffled(grid_positions(grid), 5)
    kv = 4 if name == "mixed" else 2
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[0, :3] = False
    mask = keep[:, None, None, :]
    results = []
    for fn in (attention, fast_attention):
        q = rand(2, 4, 12, d, seed=1, dtype=torch.float64).requires_grad_()
        k = rand(2, kv, 12, d, seed=2, dtype=torch.float64).requires_grad_()
        v = rand(2, kv, 12, d, seed=3, dtype=torch.float64).requires_grad_()
        for p in scheme.parameters():
            p.grad = None
        out = fn(q, k, v, scheme, pos, pos, causal=True, attn_mask=mask)
        out.backward(rand(2, 4, 12, d, seed=9, dtype=torch.float64))
        grads = [q.grad, k.grad, v.grad] + [p.grad.clone() for p in scheme.parameters()]
        results.append((out.detach(), grads))
    assert dispatch.attention_path(q, k, v, scheme, pos, pos, causal=True, attn_mask=mask) == path
    (ref, ref_g), (fast, fast_g) = results
    # float64: the module docstring's 8 (D + 2 L) eps m with m <= 16 here, for outputs and grads
    tol = 8 * (d + 2 * 12) * torch.finfo(torch.float64).eps * 16
    torch.testing.assert_close(fast, ref, rtol=0, atol=tol)
    for g, r in zip(fast_g, ref_g):
        torch.testing.assert_close(g, r, rtol=0, atol=tol * max(1.0, float(r.abs().max())))


# ============================================================================ issue 29, round 2


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_dtypes_are_refused(dtype):
    """An integer 2-D table truncates sin and cos to 0 and 1; an integer x would get it added."""
    pos = grid_positions((2, 3))
    with pytest.raises(TypeError, match=rf"dtype must be a floating-point torch.dtype .*got {dtype}"):
        sinusoidal_2d_table(pos, 16, dtype=dtype)
    x = torch.zeros(1, 6, 16, dtype=dtype)
    for scheme in (Sinusoidal2DEmbedding(16), LearnedGridEmbedding((2, 3), 16)):
        with pytest.raises(TypeError, match=rf"x must be a floating-point tensor, got dtype {dtype}"):
            scheme.embed(x, pos)


@pytest.mark.parametrize("base", [1, 0.5, float("nan")])
def test_grid_bases_follow_the_one_rule(base):
    pos = grid_positions((2, 3))
    for make in (lambda: sinusoidal_2d_table(pos, 16, base), lambda: Sinusoidal2DEmbedding(16, base),
                 lambda: AxialRoPE(8, 2, base), lambda: MixedRoPE(8, 2, base), lambda: MRoPE(8, (2, 1, 1), base),
                 lambda: axial_rope_frequencies(8, 2, base)):
        with pytest.raises(ValueError, match=r"base must be a finite number > 1, got"):
            make()


def test_mrope_refuses_nan_frequencies_as_rotary_embedding_does():
    inv = torch.tensor([1.0, float("nan"), 0.01, 0.001])
    msg = r"inv_freq must hold finite values > 0 \(or 0 for a pair that does not rotate\), got nan at index 1"
    with pytest.raises(ValueError, match=msg):
        MRoPE(8, (2, 1, 1), inv_freq=inv)
    with pytest.raises(ValueError, match=msg):
        RotaryEmbedding(8, inv_freq=inv)


@pytest.mark.parametrize("make", [lambda: AxialRoPE(8, 2), lambda: MixedRoPE(8, 2), lambda: MRoPE(8, (2, 1, 1))])
def test_grid_rotate_names_the_device_and_meta_tensors(make):
    scheme = make()
    q = rand(1, 2, 5, 8)
    pos = torch.zeros(5, scheme.position_axes, dtype=torch.long)
    name = type(scheme).__name__
    with pytest.raises(ValueError, match=rf"q is on cpu but this {name}'s frequencies are on meta; move the scheme"):
        scheme.to("meta").rotate(q, q, pos, pos)
    with pytest.raises(ValueError, match=r"q is a meta tensor \(a shape without data\)"):
        make().rotate(q.to("meta"), q.to("meta"), pos, pos)


# ----------------------------------------------------------------------------- bad input (issue 29)


def test_axial_rope_odd_head_dim_names_head_dim():
    """Without rotary_dim the whole head rotates: an odd head_dim is refused naming head_dim (not
    the rotary_dim it defaults to); with an even rotary_dim the odd head_dim is valid (the last
    dimension passes through)."""
    with pytest.raises(ValueError, match=r"head_dim must be even when rotary_dim is not given.*got 7"):
        AxialRoPE(7)
    scheme = AxialRoPE(7, 2, rotary_dim=4)
    q = rand(1, 1, 3, 7, seed=1)
    pos = grid_positions((1, 3))
    qr, _ = scheme.rotate(q, q, pos, pos)
    assert torch.equal(qr[..., 4:], q[..., 4:])  # beyond rotary_dim: unchanged
    with pytest.raises(ValueError, match=r"rotary_dim must be even"):
        AxialRoPE(8, 2, rotary_dim=5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_mrope_cos_sin_refuses_non_finite_or_negative_inv_freq(bad):
    """The rule MRoPE applies to its inv_freq (companion.rope.check_inv_freq): finite and >= 0."""
    inv = rope_frequencies(8, 1e4)
    inv[2] = bad
    pos = torch.zeros(3, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"inv_freq must hold finite values > 0 .* at index 2"):
        mrope_cos_sin(pos, inv, (2, 1, 1))
    with pytest.raises(ValueError, match=r"inv_freq must hold finite values"):
        MRoPE(8, (2, 1, 1), inv_freq=inv)
    # a zero frequency (a pair that does not rotate) is valid, as for MRoPE
    inv[2] = 0.0
    cos, sin = mrope_cos_sin(pos + 5, inv, (2, 1, 1))
    assert torch.equal(cos[:, 2], torch.ones(3)) and torch.equal(sin[:, 2], torch.zeros(3))


def test_qwen2vl_position_ids_refuses_a_float_attention_mask():
    """HuggingFace's get_rope_index reads the mask as ``attention_mask == 1`` (a tokenizer's int64
    0/1 mask); a float mask may be an additive one (0 = keep), which would read the other way
    round, so it is refused whatever it holds. Int and bool masks give the same positions."""
    types = torch.tensor([0, 0, 1, 1, 1, 1, 0])
    grids = torch.tensor([[1, 4, 4]])
    for mask in (torch.ones(7), torch.zeros(7), torch.ones(7, dtype=torch.float64), torch.ones(7).half()):
        with pytest.raises(TypeError, match=r"attention_mask must be a bool or integer 0/1 tensor.*got dtype torch\.float"):
            qwen2vl_position_ids(types, grids, attention_mask=mask)
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1])
    by_int = qwen2vl_position_ids(types, grids, attention_mask=mask)
    by_bool = qwen2vl_position_ids(types, grids, attention_mask=mask.bool())
    by_int32 = qwen2vl_position_ids(types, grids, attention_mask=mask.int())
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(by_int, by_bool, by_int32))
    # the padded token gets 0, the rest are the unpadded row's: text 0, the 2 x 2 image at 1, text 3
    assert by_int[0].tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1], [1, 1, 2], [1, 2, 1], [1, 2, 2], [3, 3, 3]]
    with pytest.raises(ValueError, match=r"attention_mask must hold 0/1"):
        qwen2vl_position_ids(types, grids, attention_mask=torch.full((7,), 2))
