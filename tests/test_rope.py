"""RoPE: conventions checked against independent transcriptions of HuggingFace, Meta, GPT-NeoX
and GPT-J, properties (relative identity, norms, layouts, offsets), accuracy, errors.

The reference functions below are written here from the published formulas, not imported from
companion, so a convention slip in companion/rope.py cannot hide behind a shared helper.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import companion.rope as rope_mod
from companion import attention
from companion.rope import (
    LAYOUTS,
    RotaryEmbedding,
    apply_rope,
    convert_layout,
    convert_qk_weight,
    layout_permutation,
    positions_from_mask,
    rope_cos_sin,
    rope_frequencies,
    rope_rotate,
    rotate_half,
)
from helpers import (U32, U64, assert_within, attention_out_bound, hf_apply, hf_cos_sin, hf_inv_freq, hf_rotate_half,
                     pow_bound, rotation_tol)
from helpers import rand_f32 as rand


# ----------------------------------------------------------------------------- reference transcriptions


def meta_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def meta_apply(xq, xk, freqs_cis):
    """Meta llama apply_rotary_emb; xq, xk are (batch, seq, heads, head_dim)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


def neox_apply(q, k, position_ids, rotary_pct, base=10000.0):
    """GPT-NeoX: rotate only the first int(head_dim * rotary_pct) dims, half-split inside them."""
    r = int(q.shape[-1] * rotary_pct)
    cos, sin = hf_cos_sin(position_ids, hf_inv_freq(r, base))
    qr, kr = hf_apply(q[..., :r], k[..., :r], cos, sin)
    return torch.cat((qr, q[..., r:]), -1), torch.cat((kr, k[..., r:]), -1)


def gptj_apply(x, position_ids, rotary_dim, base=10000.0):
    """GPT-J: interleaved pairs rotated by rotate_every_two, tables duplicated by repeat_interleave."""
    inv = hf_inv_freq(rotary_dim, base)
    ang = position_ids[..., None].float() * inv
    sin = ang.sin().repeat_interleave(2, dim=-1)[:, None]
    cos = ang.cos().repeat_interleave(2, dim=-1)[:, None]
    xr = x[..., :rotary_dim]
    x1, x2 = xr[..., ::2], xr[..., 1::2]
    every_two = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return torch.cat((xr * cos + every_two * sin, x[..., rotary_dim:]), -1)


def scalar_rope(x, positions, inv_freq, layout, rotary_dim):
    """Float64 loop transcription of the definition: a 2x2 rotation per pair, angle p * theta_i."""
    x = np.asarray(x, dtype=np.float64)
    out = x.copy()
    h = rotary_dim // 2
    b, nh, s, _ = x.shape
    for bi in range(b):
        for t in range(s):
            p = positions[bi][t] if np.ndim(positions) == 2 else positions[t]
            for i in range(h):
                ang = float(p) * float(inv_freq[i])
                c, sn = math.cos(ang), math.sin(ang)
                ia, ib = (i, i + h) if layout == "half" else (2 * i, 2 * i + 1)
                a, bb = x[bi, :, t, ia], x[bi, :, t, ib]
                out[bi, :, t, ia] = a * c - bb * sn
                out[bi, :, t, ib] = bb * c + a * sn
    return torch.from_numpy(out)


def table64(n, dim, base=10000.0):
    return rope_cos_sin(n, rope_frequencies(dim, base).double(), compute_dtype=torch.float64)


def rot64(x, positions, layout="half"):
    """Float64 rotation through the package with float64 tables (for property tests)."""
    d = x.shape[-1]
    inv = rope_frequencies(d).double()
    ang = torch.as_tensor(positions, dtype=torch.float64)[..., None] * inv
    return rope_rotate(x, ang.cos(), ang.sin(), layout=layout)


# ----------------------------------------------------------------------------- conventions


@pytest.mark.parametrize("dim,base", [(128, 10000.0), (64, 500000.0), (16, 10000), (80, 1e6)])
def test_frequencies_match_hf_bitwise(dim, base):
    ours = rope_frequencies(dim, base)
    assert ours.dtype == torch.float32 and ours.shape == (dim // 2,)
    assert torch.equal(ours, hf_inv_freq(dim, base))
    exact = base ** (-np.arange(0, dim, 2) / dim)
    np.testing.assert_allclose(ours.numpy(), exact, rtol=pow_bound(base), atol=0)  # helpers.pow_bound


def test_cos_sin_match_hf_tables_bitwise():
    inv = rope_frequencies(64)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 1, 0, 1, 2, 3], [100, 2000, 4095, 7, 8, 70000]])
    for scale in (1.0, 0.7, 1.2079):
        cos, sin = rope_cos_sin(pos, inv, attention_scaling=scale)
        hc, hs = hf_cos_sin(pos, inv, scale)
        assert cos.dtype == torch.float32 and cos.shape == (3, 6, 32)
        assert torch.equal(torch.cat((cos, cos), -1), hc)
        assert torch.equal(torch.cat((sin, sin), -1), hs)
    c, s = rope_cos_sin(10, inv)  # an int means arange
    assert torch.equal(c, rope_cos_sin(torch.arange(10), inv)[0])


def test_cos_sin_match_meta_polar():
    cos, sin = rope_cos_sin(300, rope_frequencies(128))
    f = meta_freqs_cis(128, 300)
    # same float32 angles bit for bit; torch.polar evaluates cos/sin by another routine than
    # Tensor.cos/sin: each within one ulp of the cos/sin of that float32 angle, an ulp being at
    # most 2**-24 = U32 for |values| < 1, so the tables agree to 2 U32
    meta_angles = torch.outer(torch.arange(300), hf_inv_freq(128)).float()
    assert torch.equal(meta_angles, torch.arange(300).float()[:, None] * rope_frequencies(128))
    torch.testing.assert_close(cos, f.real, rtol=0, atol=2 * U32)
    torch.testing.assert_close(sin, f.imag, rtol=0, atol=2 * U32)


@pytest.mark.parametrize("hk", [4, 2, 1])
def test_half_layout_matches_hf_bitwise(hk):
    q, k = rand(2, 4, 9, 32, seed=1), rand(2, hk, 9, 32, seed=2)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [1, 1, 1, 0, 1, 2, 3, 4, 5]])
    inv = rope_frequencies(32)
    hc, hs = hf_cos_sin(pos, inv)
    ref = hf_apply(q, k, hc, hs)
    table_c, table_s = rope_cos_sin(64, inv)
    fast = apply_rope(q, k, table_c, table_s, positions=pos)
    gathered = apply_rope(q, k, *rope_cos_sin(pos, inv))
    slow = apply_rope(q.clone().requires_grad_(), k, table_c, table_s, positions=pos)
    qi, ki = q.clone(), k.clone()
    apply_rope(qi, ki, table_c, table_s, positions=pos, inplace=True)
    for got in (fast, gathered, (slow[0].detach(), slow[1]), (qi, ki)):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_rotate_half_matches_hf():
    x = rand(2, 3, 5, 8)
    assert torch.equal(rotate_half(x), hf_rotate_half(x))
    assert torch.equal(rotate_half(rotate_half(x)), -x)


def test_interleaved_matches_meta_complex():
    b, s, nh, d = 2, 11, 4, 64
    xq, xk = rand(b, s, nh, d, seed=3), rand(b, s, nh, d, seed=4)
    rq, rk = meta_apply(xq, xk, meta_freqs_cis(d, s))
    cos, sin = rope_cos_sin(s, rope_frequencies(d))
    oq, ok = apply_rope(xq.transpose(1, 2), xk.transpose(1, 2), cos, sin, layout="interleaved")
    # Same float32 angles; Meta's tables (torch.polar) are within 2 U32 of ours (see
    # test_cos_sin_match_meta_polar), which moves a coordinate of the pair (a, b) by at most
    # 2 U32 (|a| + |b|); each side's two products and a sum (torch's complex64 product may
    # fuse them) add at most 2 U32 (|a| + |b|). So 6 U32 (|a| + |b|) per coordinate.
    for got, ref, x in ((oq, rq, xq), (ok, rk, xk)):
        assert_within(got.transpose(1, 2), ref, rotation_tol(x, 0.0, "interleaved", d, per_angle=0, const=6))


def test_gpt_neox_partial_rotary_matches_bitwise():
    q, k = rand(2, 4, 7, 64, seed=5), rand(2, 4, 7, 64, seed=6)
    pos = torch.arange(3, 10).expand(2, 7)
    ref = neox_apply(q, k, pos, rotary_pct=0.25)
    scheme = RotaryEmbedding(64, rotary_dim=16)
    got = scheme.rotate(q, k, pos, pos)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.equal(got[0][..., 16:], q[..., 16:])  # pass-through dims untouched


def test_gpt_j_interleaved_partial_matches_bitwise():
    x = rand(2, 3, 6, 32, seed=7)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [9, 10, 11, 12, 13, 14]])
    cos, sin = rope_cos_sin(32, rope_frequencies(8))
    got = rope_rotate(x, cos, sin, layout="interleaved", rotary_dim=8, positions=pos)
    assert torch.equal(got, gptj_apply(x, pos, 8))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dim", [None, 6])
def test_matches_scalar_definition_float64(layout, rotary_dim):
    x = rand(2, 2, 5, 10, dtype=torch.float64, seed=8)
    r = rotary_dim or 10
    pos = [[0, 3, 7, 100, 5000], [1, 2, 3, 4, 65535]]
    inv = rope_frequencies(r).double()
    got = rope_rotate(x, *rope_cos_sin(torch.tensor(pos), inv, compute_dtype=torch.float64),
                      layout=layout, rotary_dim=rotary_dim)
    ref = scalar_rope(x, pos, inv.numpy(), layout, r)
    # Compared in float64 at a float64 bound: each side rounds the angle p theta once
    # (U64 Theta), evaluates cos/sin to one ulp (2 U64) and rotates with two products and a
    # sum (2 U64 (|a| + |b|)): (|a| + |b|) U64 (Theta + 4) each, twice that between them.
    # The copied dimensions past rotary_dim must agree bit for bit.
    theta = (torch.tensor(pos, dtype=torch.float64)[..., None] * inv).abs()[:, None]  # (2, 1, 5, r/2)
    assert_within(got, ref, 2 * rotation_tol(x, theta, layout, r, u=U64, per_angle=1, const=4))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_round_once(layout, dtype):
    x = rand(1, 2, 40, 16, seed=9).to(dtype)
    cos, sin = rope_cos_sin(40, rope_frequencies(16))
    got = rope_rotate(x, cos, sin, layout=layout)
    want = rope_rotate(x.float(), cos, sin, layout=layout).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_fast_path_slices_equal_autograd_path(monkeypatch, layout, rotary_dim):
    monkeypatch.setattr(rope_mod, "_CHUNK_ELEMS", 64)  # many small slices, a ragged last one
    x = rand(2, 3, 23, 16, seed=10)
    cos, sin = rope_cos_sin(30, rope_frequencies(rotary_dim or 16))
    kw = dict(layout=layout, rotary_dim=rotary_dim, offset=torch.tensor([0, 5]))
    slow = rope_rotate(x.clone().requires_grad_(), cos, sin, **kw).detach()
    assert torch.equal(rope_rotate(x, cos, sin, **kw), slow)
    xi = x.clone()
    assert rope_rotate(xi, cos, sin, inplace=True, **kw) is xi
    assert torch.equal(xi, slow)


def test_weight_conversion_matches_hf_conversion_script():
    """HuggingFace's convert_llama_weights_to_hf permutes Meta's W_q rows per head like this."""
    n_heads, head_dim, d_in = 4, 16, 24
    w = rand(n_heads * head_dim, d_in, seed=11)

    def permute(w, n_heads, dim1, dim2):
        return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)

    conv = convert_qk_weight(w, n_heads, "interleaved", "half")
    assert torch.equal(conv, permute(w, n_heads, n_heads * head_dim, d_in))
    assert torch.equal(convert_qk_weight(conv, n_heads, "half", "interleaved"), w)
    bias = rand(n_heads * head_dim, seed=12)
    assert torch.equal(convert_qk_weight(bias, n_heads, "interleaved", "half"),
                       convert_layout(bias.view(n_heads, head_dim), "interleaved", "half").reshape(-1))


@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_converted_weights_give_identical_scores(rotary_dim):
    n_heads, head_dim, d_in, s = 2, 16, 20, 12
    wq, wk = rand(n_heads * head_dim, d_in, dtype=torch.float64, seed=13), rand(
        n_heads * head_dim, d_in, dtype=torch.float64, seed=14)
    x = rand(1, s, d_in, dtype=torch.float64, seed=15)
    r = rotary_dim or head_dim
    cos, sin = table64(s, r)

    def project(w):
        return (x @ w.T).view(1, s, n_heads, head_dim).transpose(1, 2)

    def scores(wq, wk, layout):
        q, k = apply_rope(project(wq), project(wk), cos, sin, layout=layout, rotary_dim=rotary_dim)
        return q @ k.transpose(-1, -2)

    meta = scores(wq, wk, "interleaved")
    hf = scores(*(convert_qk_weight(w, n_heads, "interleaved", "half", rotary_dim) for w in (wq, wk)), "half")
    wrong = scores(wq, wk, "half")
    # Float64 bound on each side's score against the exact one, in Meta's layout (the converted
    # side permutes the same coordinates). M = |x| |W|^T bounds a projected coordinate, off by
    # d_in U64 M; a rotated coordinate of the pair (a, b) is at most M_a + M_b (the pair sum P),
    # off by U64 (d_in + Theta + 4) P (the projection carried through the rotation, plus the
    # rotation's own (Theta + 4)); the dot product of head_dim terms adds head_dim U64 P_q.P_k.
    # So U64 (2 (d_in + Theta + 4) + head_dim) P_q . P_k per side, twice that between them.
    def pair_sum(m):
        out = m.clone()
        out[..., 0:r:2] = out[..., 1:r:2] = m[..., 0:r:2] + m[..., 1:r:2]
        return out

    pq, pk = (pair_sum((x.abs() @ w.abs().T).view(1, s, n_heads, head_dim).transpose(1, 2)) for w in (wq, wk))
    theta = float(s - 1)  # positions < s, inv_freq <= 1
    bound = 2 * U64 * (2 * (d_in + theta + 4) + head_dim) * (pq @ pk.transpose(-1, -2))
    assert_within(hf, meta, bound)
    assert (wrong - meta).abs().max() > 1.0  # the unconverted checkpoint is badly wrong


# ----------------------------------------------------------------------------- properties

positions_st = st.integers(min_value=0, max_value=10_000)


@given(m=positions_st, n=positions_st, shift=st.integers(0, 10_000), seed=st.integers(0, 2**16),
       layout=st.sampled_from(LAYOUTS))
def test_relative_identity(m, n, shift, seed, layout):
    q, k = rand(1, 1, 1, 16, dtype=torch.float64, seed=seed), rand(1, 1, 1, 16, dtype=torch.float64, seed=seed + 1)
    s1 = (rot64(q, [m], layout) * rot64(k, [n], layout)).sum()
    s2 = (rot64(q, [m + shift], layout) * rot64(k, [n + shift], layout)).sum()
    # q^T R_{n-m} k, rotating k alone by the difference (may be negative)
    s3 = (q * rot64(k, [n - m], layout)).sum()
    # Float64: a rotation by angles p theta_i (theta_i <= 1, so Theta <= p) moves each
    # coordinate of a pair (a, b) by (|a| + |b|) U64 (Theta + 4) (one rounding of the angle, an
    # ulp of cos/sin, two products and a sum), the whole vector by 2 U64 (p + 4) |x|; a score
    # of 16 terms adds 16 U64 |q| |k|. s1 - s2: four rotations by m, n, m + shift, n + shift and
    # two dot products; s1 - s3 (k alone, by |n - m| <= m + n) is smaller.
    tol = U64 * (4 * (m + n + shift) + 4 * 8 + 2 * 16 + 1) * float(q.norm() * k.norm())
    assert abs(float(s1 - s2)) <= tol and abs(float(s1 - s3)) <= tol


@given(p=st.integers(0, 100_000), seed=st.integers(0, 2**16), layout=st.sampled_from(LAYOUTS),
       r=st.sampled_from([2, 8, 16]))
def test_norm_preserved(p, seed, layout, r):
    x = rand(1, 2, 1, 16, dtype=torch.float64, seed=seed)
    cos, sin = table64(p + 1, r)
    y = rope_rotate(x, cos, sin, layout=layout, rotary_dim=r, positions=[p])
    # Float64: tables with c^2 + s^2 within 4 U64 of 1 and the pair's roundings change each
    # pair's norm by < 5 U64 (tests/test_grid.py's derivation), so |y| by < 5 U64 |x|; each of
    # the two computed norms (16 squares, a sum, a sqrt) adds (16 / 2 + 1) U64.
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=(5 + 2 * (16 // 2 + 1)) * U64, atol=0)
    assert torch.equal(y[..., r:], x[..., r:])


@given(d=st.sampled_from([2, 4, 8, 64, 128]), seed=st.integers(0, 2**16), data=st.data())
def test_layout_round_trip_and_conjugation(d, seed, data):
    r = data.draw(st.sampled_from([v for v in (2, 4, 8, 32, d) if v <= d]))
    x = rand(1, 2, 5, d, seed=seed)
    there = convert_layout(x, "half", "interleaved", r)
    assert torch.equal(convert_layout(there, "interleaved", "half", r), x)
    perm = layout_permutation(d, "half", "interleaved", r)
    assert torch.equal(torch.sort(perm).values, torch.arange(d))
    # rotating then converting == converting then rotating in the other layout, bit for bit
    cos, sin = rope_cos_sin(5, rope_frequencies(r))
    a = convert_layout(rope_rotate(x, cos, sin, layout="half", rotary_dim=r), "half", "interleaved", r)
    b = rope_rotate(there, cos, sin, layout="interleaved", rotary_dim=r)
    assert torch.equal(a, b)


@given(t=st.integers(0, 60), n=st.integers(1, 4), seed=st.integers(0, 2**16), layout=st.sampled_from(LAYOUTS))
def test_offset_decoding_equals_full_sequence(t, n, seed, layout):
    total = t + n
    q, k = rand(2, 2, total, 8, seed=seed), rand(2, 1, total, 8, seed=seed + 1)
    cos, sin = rope_cos_sin(70, rope_frequencies(8))
    fq, fk = apply_rope(q, k, cos, sin, layout=layout)
    sq, sk = apply_rope(q[:, :, t:], k[:, :, t:], cos, sin, layout=layout, offset=t)
    assert torch.equal(sq, fq[:, :, t:]) and torch.equal(sk, fk[:, :, t:])
    # per-row offsets: row 1 started 3 tokens later
    off = torch.tensor([t, t + 3])
    rq, _ = apply_rope(q[:, :, t:], k[:, :, t:], cos, sin, layout=layout, offset=off)
    assert torch.equal(rq[0], fq[0, :, t:])
    pos = (off[:, None] + torch.arange(n))
    pq, _ = apply_rope(q[:, :, t:], k[:, :, t:], cos, sin, layout=layout, positions=pos)
    assert torch.equal(pq, rq)


# ----------------------------------------------------------------------------- accuracy


def test_float32_accuracy_up_to_one_million():
    """Stated tolerance. Reference: float64 angles p * theta_i with the same float32 theta_i.

    Per coordinate, relative to the norm rho of its pair (a, b), with Theta = p theta:

    * float32 tables (HuggingFace's arithmetic): the angle rounded once to float32 moves the
      pair by at most U32 Theta rho (a rotation error: a dc - b ds = -e (a sin + b cos));
      cos/sin to one ulp, 2 U32 (|a c| + |b s|) <= 2 U32 rho; rounding x to float32 (carried
      through the rotation) U32 rho; the two products and the sum 2 U32 rho: U32 (Theta + 5);
    * float64 tables: the same in float64, U64 (Theta + 4), plus the tables and x rounded to
      float32 (2 U32 rho) and the float32 rotation (2 U32 rho): 4 U32 + U64 (Theta + 4);
    * the float64 reference itself is within U64 (Theta + 4) sqrt(2) of the exact rotation.
    """
    d = 64
    inv = rope_frequencies(d)
    pos = torch.tensor([0, 1, 4095, 65_536, 123_457, 500_001, 999_999, 1_000_000])
    x = rand(1, 2, len(pos), d, dtype=torch.float64, seed=16)
    ang = pos.double()[:, None] * inv.double()
    ref = rope_rotate(x, ang.cos(), ang.sin())
    pair_norm = torch.sqrt(x[..., : d // 2] ** 2 + x[..., d // 2 :] ** 2).repeat(1, 1, 1, 2)
    theta = ang.repeat(1, 2)
    ref_err = 2 * U64 * (theta + 4)
    for compute, bound in (
        (torch.float32, U32 * (theta + 5) + ref_err),
        (torch.float64, 4 * U32 + U64 * (theta + 4) + ref_err),
    ):
        cos, sin = rope_cos_sin(pos, inv, compute_dtype=compute)
        got = rope_rotate(x.float(), cos.float(), sin.float()).double()
        err = (got - ref).abs() / pair_norm
        assert bool((err <= bound).all()), f"{compute}: worst excess {(err - bound).max():.3g}"
    # and the float32 tables really are inaccurate out there (the bound is not vacuous)
    cos32, _ = rope_cos_sin(pos, inv)
    assert (cos32[-1].double() - ang[-1].cos()).abs().max() > 1e-3


def test_float32_positions_beyond_2_24_need_float64():
    inv = rope_frequencies(8)
    with pytest.raises(ValueError, match="2\\*\\*24.*float64"):
        rope_cos_sin(torch.tensor([2**24 + 1]), inv)
    c, _ = rope_cos_sin(torch.tensor([2**24 + 1]), inv, compute_dtype=torch.float64)
    # the angle (2**24 + 1) * 1.0 is exact in float64; torch and math each evaluate its cosine
    # to within one float64 ulp (<= 2**-53 = U64 below 1)
    assert abs(float(c[0, 0]) - math.cos(2**24 + 1)) <= 2 * U64


# ----------------------------------------------------------------------------- the scheme


def test_cache_grows_and_never_changes_results():
    scheme = RotaryEmbedding(32, max_cached_positions=5000)
    assert scheme.cached_positions == 0
    c1, s1 = scheme.cos_sin(torch.tensor([3, 10]))
    n1 = scheme.cached_positions
    assert n1 >= 11
    c2, _ = scheme.cos_sin(torch.tensor([[n1 + 1, 0]]))
    assert scheme.cached_positions >= 2 * n1  # doubled
    big = torch.tensor([4999, 7000, -3])  # beyond the cap and negative: computed directly
    c3, s3 = scheme.cos_sin(big)
    assert scheme.cached_positions <= 5000
    for pos, c in ((torch.tensor([3, 10]), c1), (torch.tensor([[n1 + 1, 0]]), c2), (big, c3)):
        assert torch.equal(c, rope_cos_sin(pos, rope_frequencies(32))[0])
    assert scheme.state_dict() == {}  # buffers are derived, not weights


def test_scheme_overrides_and_scaling():
    inv = rope_frequencies(16, 10000.0) / 4  # what Position Interpolation by 4 produces
    scheme = RotaryEmbedding(16, inv_freq=inv, attention_scaling=1.25)
    assert "inv_freq=custom" in repr(scheme) and "attention_scaling=1.25" in repr(scheme)
    q, k = rand(1, 2, 8, 16, seed=17), rand(1, 2, 8, 16, seed=18)
    pos = torch.arange(8)
    rq, rk = scheme.rotate(q, k, pos * 4, pos * 4)
    # Float32 (u = U32): the scaled tables are 1.25 cos, 1.25 sin within 3 U32 (cos/sin to one
    # ulp, the product by 1.25), so c^2 + s^2 = 1.25^2 (1 + 6 U32) and a pair's exact rotation
    # by them has norm 1.25 |x_pair| (1 + 3 U32); its four products and two sums move the pair
    # by at most sqrt(2) 2 U32 |(c, s)| |x_pair| < 3 U32 (1.25 |x_pair|): |rq| is within 6 U32 of
    # 1.25 |q| relatively. Each computed norm (16 squares, a sum, a sqrt) adds (16 / 2 + 1) U32,
    # the product by 1.25 one U32.
    torch.testing.assert_close(rq.norm(dim=-1), 1.25 * q.norm(dim=-1), rtol=(6 + 2 * (16 // 2 + 1) + 1) * U32, atol=0)
    plain = RotaryEmbedding(16)
    pq, _ = plain.rotate(q, k, pos, pos)  # frequency theta/4 at position 4p: the angle of p
    # Both float32 angles within U32 Theta of p theta (Theta = p theta): the tables differ by
    # 2 U32 Theta + 4 U32 (two evaluations to one ulp), the scaling by 1.25 rounds once (U32);
    # each side's products and sum 2 U32 (|a| + |b|), the division by 1.25 U32 (|a| + |b|).
    theta = pos.double()[:, None] * rope_frequencies(16).double()
    assert_within(rq / 1.25, pq, rotation_tol(q, theta, "half", 16, per_angle=2, const=10))
    scheme.cos_sin(100)
    scheme.set_frequencies(rope_frequencies(16))
    assert scheme.cached_positions == 0 and scheme.attention_scaling == 1.0
    assert torch.equal(scheme.rotate(q, k, pos, pos)[0], plain.rotate(q, k, pos, pos)[0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_cache_decoding_through_attention(layout):
    scheme = RotaryEmbedding(16, layout=layout)
    q, k, v = rand(1, 2, 9, 16, seed=19), rand(1, 2, 9, 16, seed=20), rand(1, 2, 9, 16, seed=21)
    full = attention(q, k, v, scheme, causal=True)
    # decode the last token: its query alone, against all keys; default q_pos = last position
    step = attention(q[:, :, -1:], k, v, scheme, causal=True)
    # Both rotate the same rows at the same positions (bit-equal rotated q, k); they differ only
    # in the float32 attention arithmetic: each within helpers.attention_out_bound.
    qr, kr = scheme.rotate(q, k, torch.arange(9), torch.arange(9))
    bound = (attention_out_bound(qr, kr, v, causal=True)[:, :, -1:]
             + attention_out_bound(qr[:, :, -1:], kr, v, causal=True))
    assert_within(step, full[:, :, -1:], bound)


def test_left_padding_gives_the_unpadded_result():
    scheme = RotaryEmbedding(8)
    s, pad = 6, 3
    q, k, v = rand(1, 2, s, 8, seed=22), rand(1, 2, s, 8, seed=23), rand(1, 2, s, 8, seed=24)
    alone = attention(q, k, v, scheme, causal=True)
    mask = torch.tensor([[1] * s, [0] * pad + [1] * (s - pad)])
    pos = positions_from_mask(mask)
    assert pos.tolist() == [[0, 1, 2, 3, 4, 5], [1, 1, 1, 0, 1, 2]]

    def padded(t):
        return torch.cat((t, torch.cat((torch.zeros(1, 2, pad, 8), t[:, :, : s - pad]), 2)))

    key_ok = mask.bool()[:, None, None, :]
    out = attention(padded(q), padded(k), padded(v), scheme, pos, pos, causal=True, attn_mask=key_ok)
    # The same rotated q, k at the same positions; masked keys get weight exp(lowest) = 0
    # exactly; so the float32 attention arithmetic alone differs, each side within
    # helpers.attention_out_bound (the padded row has the same k_len, 6).
    qr, kr = scheme.rotate(q, k, torch.arange(s), torch.arange(s))
    bound = 2 * attention_out_bound(qr, kr, v, causal=True)[0]
    assert_within(out[0], alone[0], bound)
    assert_within(out[1, :, pad:], alone[0, :, : s - pad], bound[:, : s - pad])


def test_positions_from_mask_matches_hf():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 0, 1]])
    ref = mask.long().cumsum(-1) - 1
    ref.masked_fill_(mask == 0, 1)
    assert torch.equal(positions_from_mask(mask), ref)
    assert torch.equal(positions_from_mask(mask.bool(), pad_position=0)[0], torch.tensor([0, 0, 0, 1, 2]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients(layout):
    x = rand(1, 2, 4, 8, dtype=torch.float64, seed=25).requires_grad_()
    cos, sin = table64(6, 6)
    fn = lambda t: rope_rotate(t, cos, sin, layout=layout, rotary_dim=6, offset=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    # the gradient of a rotation is the inverse rotation
    g = rand(1, 2, 4, 8, dtype=torch.float64, seed=26)
    (grad,) = torch.autograd.grad(fn(x), x, g)
    # exact: autograd's gradient of (a c - b s, b c + a s) is (g_a c + g_b s, g_b c + (-g_a) s), the
    # same two products and one sum per coordinate as rotating g by (c, -s) (negation is exact,
    # a sum commutes), and the copied dimensions pass g through
    assert torch.equal(grad, rope_rotate(g, cos, -sin, layout=layout, rotary_dim=6, offset=2))


# ----------------------------------------------------------------------------- bad input


def test_errors():
    q, k = rand(1, 2, 4, 8), rand(1, 2, 4, 8)
    cos, sin = rope_cos_sin(10, rope_frequencies(8))
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        apply_rope(q, k, cos, sin, rotary_dim=5)
    with pytest.raises(ValueError, match="rotary_dim must be <= head_dim \\(8\\)"):
        apply_rope(q, k, cos, sin, rotary_dim=10)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        RotaryEmbedding(8, rotary_dim=3)
    with pytest.raises(ValueError, match="rotary_dim must be <= head_dim"):
        RotaryEmbedding(8, rotary_dim=16)
    with pytest.raises(TypeError, match="positions must hold integers"):
        apply_rope(q, k, cos, sin, positions=torch.arange(4.0))
    with pytest.raises(TypeError, match="positions must hold integers"):
        rope_cos_sin(torch.tensor([0.5, 1.5]), rope_frequencies(8))
    with pytest.raises(TypeError, match="q_pos must hold integers"):
        RotaryEmbedding(8).rotate(q, k, torch.arange(4.0), torch.arange(4))
    with pytest.raises(ValueError, match="k head_dim 6 must equal q head_dim 8"):
        apply_rope(q, rand(1, 2, 4, 6), cos, sin)
    with pytest.raises(ValueError, match="head_dim must equal this scheme's head_dim 8"):
        RotaryEmbedding(8).rotate(q, rand(1, 2, 4, 6), torch.arange(4), torch.arange(4))
    for bad in ("neox", "HALF", None):
        with pytest.raises(ValueError, match="layout must be one of \\('half', 'interleaved'\\)"):
            apply_rope(q, k, cos, sin, layout=bad)
    with pytest.raises(ValueError, match="layout must be one of"):
        RotaryEmbedding(8, layout="gptj")
    with pytest.raises(ValueError, match="src must be one of \\('half', 'interleaved'\\)"):
        convert_qk_weight(rand(16, 4), 2, "meta", "half")


def test_more_errors():
    q, k = rand(1, 2, 4, 8), rand(1, 2, 4, 8)
    cos, sin = rope_cos_sin(10, rope_frequencies(8))
    with pytest.raises(IndexError, match="positions must be < 10"):
        apply_rope(q, k, cos, sin, positions=torch.tensor([0, 1, 2, 10]))
    with pytest.raises(IndexError, match="offset \\+ seq = 7 \\+ 4 must be <= the table length 10"):
        apply_rope(q, k, cos, sin, offset=7)
    with pytest.raises(IndexError, match="offset must be >= 0"):
        apply_rope(q, k, cos, sin, offset=-1)
    with pytest.raises(TypeError, match="offset must hold integers"):
        apply_rope(q, k, cos, sin, offset=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="either positions or offset"):
        apply_rope(q, k, cos, sin, positions=torch.arange(4), offset=0)
    full = torch.cat((cos, cos), -1)
    with pytest.raises(ValueError, match="HuggingFace-style table of width 8.*cos\\[\\.\\.\\., :4\\]"):
        apply_rope(q, k, full, full)
    with pytest.raises(ValueError, match="inplace=True is not differentiable"):
        apply_rope(q.clone().requires_grad_(), k, cos, sin, inplace=True)
    with pytest.raises(ValueError, match="q and k must share batch and seq"):
        apply_rope(q, rand(1, 2, 3, 8), cos, sin)
    with pytest.raises(ValueError, match="must have 4 dimensions"):
        rope_rotate(q[0], cos, sin)
    with pytest.raises(ValueError, match="dim must be even"):
        rope_frequencies(7)
    with pytest.raises(ValueError, match="base must be a finite number > 1, got -1.0"):
        rope_frequencies(8, base=-1.0)
    with pytest.raises(ValueError, match="compute_dtype must be torch.float32 or torch.float64"):
        rope_cos_sin(4, rope_frequencies(8), compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="inv_freq must have shape \\(rotary_dim // 2,\\) = \\(4,\\)"):
        RotaryEmbedding(8, inv_freq=torch.ones(3))
    with pytest.raises(ValueError, match="attention_scaling must be a finite number > 0"):
        RotaryEmbedding(8, attention_scaling=0.0)
    with pytest.raises(ValueError, match="attention_mask must hold only 0/1"):
        positions_from_mask(torch.tensor([[0, 2]]))
    with pytest.raises(TypeError, match="attention_mask must be bool or integer"):
        positions_from_mask(torch.tensor([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="not a multiple of n_heads"):
        convert_qk_weight(rand(10, 4), 3, "interleaved", "half")
    with pytest.raises(ValueError, match="already gathered per row"):
        apply_rope(q, k, cos[None, :4], sin[None, :4], offset=1)


# ----------------------------------------------------------------------------- issue 29, round 2


@pytest.mark.parametrize("base", [1, 1.0, 0.5])
def test_a_base_of_one_or_less_is_refused_everywhere(base):
    """base = 1 gave all-ones frequencies (every pair turning alike); base < 1 reverses the
    ladder. One rule (companion._checks.check_base) for every function that takes a base."""
    from companion.absolute import SinusoidalEmbedding, sinusoidal_table
    from companion.grid import AxialRoPE, MixedRoPE, MRoPE, Sinusoidal2DEmbedding, sinusoidal_2d_table
    from companion.scaling import compute_inv_freq

    msg = rf"base must be a finite number > 1, got {base}"
    for make in (lambda: rope_frequencies(8, base), lambda: RotaryEmbedding(8, base=base),
                 lambda: sinusoidal_table(4, 8, base), lambda: SinusoidalEmbedding(8, base),
                 lambda: sinusoidal_2d_table(torch.zeros(3, 2, dtype=torch.long), 8, base),
                 lambda: Sinusoidal2DEmbedding(8, base), lambda: AxialRoPE(8, 2, base),
                 lambda: MixedRoPE(8, 2, base), lambda: MRoPE(8, (2, 1, 1), base)):
        with pytest.raises(ValueError, match=msg):
            make()
    with pytest.raises(ValueError, match=rf"rope_config\['rope_theta'\] must be a finite number > 1, got {base}"):
        compute_inv_freq({"rope_type": "default", "rope_theta": base}, 8)


def test_custom_frequencies_share_one_check():
    """RotaryEmbedding and MRoPE validate custom inv_freq with one function (MRoPE accepted NaN)."""
    from companion.grid import MRoPE

    for bad, shown in ((float("nan"), "nan"), (float("inf"), "inf"), (-1.0, "-1.0")):
        inv = torch.tensor([1.0, 0.1, bad, 0.001])
        for make in (lambda: RotaryEmbedding(8, inv_freq=inv), lambda: MRoPE(8, (2, 1, 1), inv_freq=inv),
                     lambda: RotaryEmbedding(8).set_frequencies(inv)):
            with pytest.raises(ValueError, match=rf"inv_freq must hold finite values > 0 \(or 0 for a pair that "
                                                 rf"does not rotate\), got {shown} at index 2"):
                make()
    for make in (lambda inv: RotaryEmbedding(8, inv_freq=inv), lambda inv: MRoPE(8, (2, 1, 1), inv_freq=inv)):
        with pytest.raises(ValueError, match=r"inv_freq must have shape \(rotary_dim // 2,\) = \(4,\), got \(3,\)"):
            make(torch.ones(3))
        with pytest.raises(TypeError, match=r"inv_freq must be a floating-point tensor, got dtype torch.int64"):
            make(torch.ones(4, dtype=torch.long))
        make(torch.tensor([1.0, 0.1, 0.0, 0.0]))  # zero: a pair that does not rotate (p-RoPE)


def test_rotate_names_what_the_caller_passed():
    """A RotaryEmbedding on another device than q, or a meta q, used to fail with a message
    about cos/sin tables (or "positions") that the caller never passed."""
    q, k = rand(1, 2, 4, 8), rand(1, 2, 4, 8)
    pos = torch.arange(4)
    on_meta = RotaryEmbedding(8).to("meta")
    with pytest.raises(ValueError, match=r"q is on cpu but this RotaryEmbedding's frequencies are on meta; "
                                         r"move the scheme to q's device with .to\('cpu'\)"):
        on_meta.rotate(q, k, pos, pos)
    with pytest.raises(ValueError, match=r"q is on cpu but this RotaryEmbedding's frequencies are on meta"):
        attention(q, k, k, on_meta)
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"k is a meta tensor \(a shape without data\)"):
        rope.rotate(q, k.to("meta"), pos, pos)
    with pytest.raises(ValueError, match=r"q is a meta tensor \(a shape without data\)"):
        rope.rotate(q.to("meta"), k.to("meta"), pos, pos)
    with pytest.raises(ValueError, match=r"x is a meta tensor"):
        rope_rotate(q.to("meta"), *rope.cos_sin(4))
    with pytest.raises(TypeError, match=r"q must be a floating-point tensor, got dtype torch.int64"):
        rope.rotate(q.long(), k.long(), pos, pos)
