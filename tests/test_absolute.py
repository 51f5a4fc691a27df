"""Sinusoidal and learned absolute position encodings (companion.absolute)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from companion import TinyDecoder, attention
from companion.absolute import (
    LearnedPositionalEmbedding,
    ScaledSinusoidalEmbedding,
    SinusoidalEmbedding,
    sinusoidal_encoding,
    sinusoidal_frequencies,
    sinusoidal_table,
    sinusoidal_wavelengths,
)


def numpy_table(n, d, base=10000.0):
    """Independent transcription of Vaswani et al. section 3.5, one scalar at a time."""
    out = np.empty((n, d))
    for p in range(n):
        for i in range(0, d, 2):
            angle = p / base ** (i / d)  # i = 2 * (pair index)
            out[p, i] = math.sin(angle)
            if i + 1 < d:
                out[p, i + 1] = math.cos(angle)
    return out


def block_rotation(k, d, base):
    """M_k: block-diagonal 2x2 rotations built from the offset k alone (lone sine: 1x1 is not
    enough for odd d, so callers use even d)."""
    m = np.zeros((d, d))
    for i in range(0, d, 2):
        w = base ** (-i / d)
        c, s = math.cos(w * k), math.sin(w * k)
        # [sin(a+b), cos(a+b)] = [[cos b, sin b], [-sin b, cos b]] @ [sin a, cos a]
        m[i : i + 2, i : i + 2] = [[c, s], [-s, c]]
    return m


# --- the table against independent formulas ----------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 3, 7, 8, 64, 65])
@pytest.mark.parametrize("base", [100.0, 10000.0, 1e6])
def test_table_matches_numpy_formula(d, base):
    got = sinusoidal_table(50, d, base, dtype=torch.float64).numpy()
    np.testing.assert_allclose(got, numpy_table(50, d, base), rtol=0, atol=1e-12)


def test_table_matches_huggingface_distilbert_formula():
    # create_sinusoidal_embeddings: angle[p, j] = p / 10000 ** (2 * (j // 2) / dim),
    # sin on even columns, cos on odd ones, for any dim (odd included).
    for d in (6, 7):
        ang = np.array([[p / np.power(10000, 2 * (j // 2) / d) for j in range(d)] for p in range(40)])
        ref = np.empty_like(ang)
        ref[:, 0::2] = np.sin(ang[:, 0::2])
        ref[:, 1::2] = np.cos(ang[:, 1::2])
        np.testing.assert_allclose(sinusoidal_table(40, d, dtype=torch.float64).numpy(), ref, atol=1e-12)


def test_first_row_and_first_pair():
    t = sinusoidal_table(3, 4, dtype=torch.float64)
    assert t[0].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert t[1, 0] == pytest.approx(math.sin(1.0), abs=1e-15)
    assert t[1, 1] == pytest.approx(math.cos(1.0), abs=1e-15)


def test_computed_in_float64_and_cast_at_the_end():
    ref = sinusoidal_table(4096, 64, dtype=torch.float64)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = sinusoidal_table(4096, 64, dtype=dtype)
        assert got.dtype == dtype
        assert torch.equal(got, ref.to(dtype))


def test_odd_dim_last_column_is_a_sine_at_the_next_frequency():
    d, base = 7, 10000.0
    t = sinusoidal_table(100, d, base, dtype=torch.float64)
    w = base ** (-(d - 1) / d)
    p = torch.arange(100, dtype=torch.float64)
    assert torch.allclose(t[:, -1], torch.sin(p * w), atol=1e-14, rtol=0)
    assert sinusoidal_frequencies(d, base)[-1].item() == pytest.approx(w, rel=1e-15)
    assert sinusoidal_wavelengths(d, base).shape == (4,)


def test_wavelengths_increase_from_2pi():
    lam = sinusoidal_wavelengths(512)
    assert lam[0].item() == pytest.approx(2 * math.pi)
    assert torch.all(lam[1:] > lam[:-1])
    assert lam[-1].item() == pytest.approx(2 * math.pi * 10000 ** (510 / 512))


def test_encoding_of_any_positions_and_shapes():
    pos = torch.tensor([[0, 5, 9], [-3, 2, 100]])
    enc = sinusoidal_encoding(pos, 6, dtype=torch.float64)
    assert enc.shape == (2, 3, 6)
    table = sinusoidal_table(101, 6, dtype=torch.float64)
    assert torch.equal(enc[1, 2], table[100])
    # negative positions follow the same formula: sin is odd, cos even
    assert torch.allclose(enc[1, 0, 0::2], -table[3, 0::2]) and torch.allclose(enc[1, 0, 1::2], table[3, 1::2])


# --- identities (hypothesis) ---------------------------------------------------------------

dims = st.integers(1, 48).map(lambda h: 2 * h)
positions = st.integers(0, 100_000)
bases = st.sampled_from([10.0, 500.0, 10000.0, 1e6])


@given(p=positions, k=st.integers(-5000, 5000), d=dims, base=bases)
def test_shift_is_a_block_rotation_that_depends_on_k_only(p, k, d, base):
    pe = sinusoidal_encoding([p, p + k], d, base, torch.float64).numpy()
    np.testing.assert_allclose(block_rotation(k, d, base) @ pe[0], pe[1], rtol=0, atol=1e-9)


@given(p=positions, q=positions, s=st.integers(0, 10_000), d=dims, base=bases)
def test_dot_product_depends_only_on_offset(p, q, s, d, base):
    pe = sinusoidal_encoding([p, q, p + s, q + s], d, base, torch.float64)
    omega = sinusoidal_frequencies(d, base)[0::2]
    closed = torch.cos(omega * (p - q)).sum()
    assert torch.dot(pe[0], pe[1]).item() == pytest.approx(closed.item(), abs=1e-8)
    assert torch.dot(pe[2], pe[3]).item() == pytest.approx(closed.item(), abs=1e-8)


@given(p=positions, d=dims, base=bases)
def test_each_pair_has_mean_square_one_half(p, d, base):
    pe = sinusoidal_encoding([p], d, base, torch.float64)[0]
    pair_ms = (pe[0::2] ** 2 + pe[1::2] ** 2) / 2
    assert torch.allclose(pair_ms, torch.full_like(pair_ms, 0.5), atol=1e-14)
    assert (pe**2).mean().item() == pytest.approx(0.5, abs=1e-14)


# --- schemes ----------------------------------------------------------------------------------


def test_sinusoidal_scheme_adds_the_table_in_x_dtype():
    s = SinusoidalEmbedding(8)
    assert s.hooks() == ("embed",)
    assert list(s.parameters()) == []
    x = torch.randn(2, 5, 8)
    assert torch.equal(s.embed(x), x + sinusoidal_table(5, 8))
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 0, 1, 2, 3]])  # per-row (left padding)
    out = s.embed(torch.zeros(2, 5, 8, dtype=torch.bfloat16), pos)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, sinusoidal_table(8, 8, dtype=torch.float64)[pos].to(torch.bfloat16))


def test_sinusoidal_scheme_in_a_model():
    torch.manual_seed(0)
    model = TinyDecoder(vocab_size=11, d_model=16, n_heads=2, n_layers=1, scheme=SinusoidalEmbedding(16))
    idx = torch.randint(0, 11, (2, 9))
    assert model(idx).shape == (2, 9, 11)
    # embed acts before attention only: the attention hooks stay identities
    q = torch.randn(1, 2, 4, 8)
    assert torch.allclose(attention(q, q, q, SinusoidalEmbedding(16)), attention(q, q, q))


def test_scaled_sinusoidal_has_one_learned_gain():
    s = ScaledSinusoidalEmbedding(16)
    params = list(s.parameters())
    assert len(params) == 1 and params[0].numel() == 1
    assert s.scale.item() == pytest.approx(16**-0.5)
    x = torch.zeros(1, 6, 16)
    out = s.embed(x)
    assert torch.allclose(out[0], 16**-0.5 * sinusoidal_table(6, 16), atol=1e-7)
    # with the default gain the added vector has norm sqrt(1/2) at every position
    assert torch.allclose(out[0].norm(dim=-1), torch.full((6,), 0.5**0.5), atol=1e-6)
    out.sum().backward()
    expected = sinusoidal_table(6, 16, dtype=torch.float64).sum().item()
    assert s.scale.grad.item() == pytest.approx(expected, rel=1e-6)
    assert ScaledSinusoidalEmbedding(16, init_scale=2.0).scale.item() == 2.0


def test_learned_table_lookup_and_init():
    g = torch.Generator().manual_seed(0)
    emb = LearnedPositionalEmbedding(128, 64, generator=g)
    assert emb.weight.shape == (128, 64)
    assert emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    x = torch.randn(3, 10, 64)
    assert torch.equal(emb.embed(x), x + emb.weight[:10])
    pos = torch.randint(0, 128, (3, 10))
    assert torch.equal(emb.embed(x, pos), x + torch.nn.functional.embedding(pos, emb.weight))
    g2 = torch.Generator().manual_seed(0)
    assert torch.equal(LearnedPositionalEmbedding(128, 64, generator=g2).weight, emb.weight)


def test_learned_rows_get_gradient_only_where_positions_occur():
    emb = LearnedPositionalEmbedding(32, 4)
    pos = torch.tensor([[0, 1, 2, 7], [2, 3, 4, 7]])
    out = emb.embed(torch.zeros(2, 4, 4), pos)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    used = torch.zeros(32, dtype=torch.bool)
    used[pos.flatten()] = True
    assert torch.count_nonzero(emb.weight.grad[~used]) == 0
    assert torch.all(emb.weight.grad[used].abs().sum(-1) > 0)
    expected = torch.zeros(32, 4).index_add_(0, pos.flatten(), upstream.flatten(0, 1))
    assert torch.allclose(emb.weight.grad, expected)


def test_from_pretrained_wraps_a_table():
    table = torch.randn(6, 3, dtype=torch.float64)
    emb = LearnedPositionalEmbedding.from_pretrained(table)
    assert emb.n_positions == 6 and emb.dim == 3
    assert torch.equal(emb.weight, table) and not emb.weight.requires_grad
    assert emb.weight.data_ptr() != table.data_ptr()
    assert LearnedPositionalEmbedding.from_pretrained(table, freeze=False).weight.requires_grad
    out = emb.embed(torch.zeros(1, 6, 3))
    assert out.dtype == torch.float32


def test_learned_scheme_in_a_model_raises_beyond_its_rows():
    model = TinyDecoder(vocab_size=7, d_model=8, n_heads=2, n_layers=1, scheme=LearnedPositionalEmbedding(16, 8))
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, 7)
    with pytest.raises(IndexError, match=r"pos must be < 16 \(the table has 16 rows, positions 0..15\), got a position 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, -4])
def test_bad_dim(dim):
    with pytest.raises(ValueError, match="dim must be >= 1"):
        sinusoidal_table(4, dim)
    with pytest.raises(ValueError, match="dim must be >= 1"):
        SinusoidalEmbedding(dim)
    with pytest.raises(ValueError, match="dim must be >= 1"):
        LearnedPositionalEmbedding(4, dim)


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_positions must be >= 1"):
        sinusoidal_table(0, 4)
    with pytest.raises(ValueError, match="n_positions must be >= 1"):
        LearnedPositionalEmbedding(0, 4)
    with pytest.raises(TypeError, match="dim must be an int"):
        sinusoidal_table(4, 4.0)
    with pytest.raises(TypeError, match="dim must be an int"):
        sinusoidal_table(4, True)
    with pytest.raises(ValueError, match="base must be a finite number > 1"):
        sinusoidal_table(4, 4, base=1.0)
    with pytest.raises(ValueError, match="base must be a finite number > 1"):
        SinusoidalEmbedding(4, base=float("inf"))
    with pytest.raises(TypeError, match="dtype must be a floating-point"):
        sinusoidal_table(4, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match="positions must hold integers"):
        sinusoidal_encoding(torch.tensor([1.5]), 4)
    with pytest.raises(ValueError, match="init_std must be"):
        LearnedPositionalEmbedding(4, 4, init_std=-1.0)
    with pytest.raises(ValueError, match="table must have 2 dimensions"):
        LearnedPositionalEmbedding.from_pretrained(torch.zeros(3))
    with pytest.raises(TypeError, match="table must be floating point"):
        LearnedPositionalEmbedding.from_pretrained(torch.zeros(3, 2, dtype=torch.long))


@pytest.mark.parametrize("scheme", [SinusoidalEmbedding(4), LearnedPositionalEmbedding(8, 4)])
def test_embed_errors(scheme):
    with pytest.raises(ValueError, match="x must have last dimension 4"):
        scheme.embed(torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="x must have 3 dimensions"):
        scheme.embed(torch.zeros(3, 4))
    with pytest.raises(IndexError, match="pos must be >= 0, got a position -1"):
        scheme.embed(torch.zeros(1, 2, 4), torch.tensor([-1, 0]))
    with pytest.raises(TypeError, match="pos must hold integers"):
        scheme.embed(torch.zeros(1, 2, 4), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"pos must have shape \(2,\) or \(1, 2\)"):
        scheme.embed(torch.zeros(1, 2, 4), torch.tensor([0, 1, 2]))


def test_learned_out_of_range_names_the_limit():
    emb = LearnedPositionalEmbedding(512, 4)
    with pytest.raises(IndexError, match=r"pos must be < 512 \(the table has 512 rows, positions 0..511\), got a position 600"):
        emb.lookup([0, 600])
    with pytest.raises(IndexError, match="pos must be >= 0"):
        emb.lookup(torch.tensor([-2]))
    with pytest.raises(TypeError, match="pos must hold integers"):
        emb.lookup(torch.tensor([1.0]))
    assert emb.lookup([511]).shape == (1, 4)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_dtypes_are_refused(dtype):
    """An integer table truncates sin and cos to 0 and 1, and an integer x would get the
    truncated encoding added: both raise TypeError naming the argument."""
    with pytest.raises(TypeError, match=rf"dtype must be a floating-point torch.dtype .*got {dtype}"):
        sinusoidal_table(4, 8, dtype=dtype)
    with pytest.raises(TypeError, match=rf"dtype must be a floating-point torch.dtype .*got {dtype}"):
        sinusoidal_encoding([0, 1], 8, dtype=dtype)
    x = torch.zeros(1, 3, 8, dtype=dtype)
    for scheme in (SinusoidalEmbedding(8), ScaledSinusoidalEmbedding(8), LearnedPositionalEmbedding(4, 8)):
        with pytest.raises(TypeError, match=rf"x must be a floating-point tensor, got dtype {dtype}"):
            scheme.embed(x)
    assert SinusoidalEmbedding(8).embed(torch.zeros(1, 3, 8, dtype=torch.float16)).dtype == torch.float16
