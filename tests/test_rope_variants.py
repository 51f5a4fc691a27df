"""xPos and p-RoPE (companion/rope_variants.py).

References are written here, independently of the package: a float64 transcription of
microsoft/torchscale's ``XPOS`` (torchscale/component/xpos_relative_position.py and the way its
MultiheadAttention calls it), and complex-number formulas for the scores.

Tolerances. ``U64 = 2**-53`` is the float64 unit roundoff. One rotated coordinate
``a c s - b s' s`` costs a few roundings (the angle ``p theta``, whose error is ``|p| theta U64``
radians, then cos/sin, the scale's ``pow``, two products and a sum), each relative to the
pair's magnitude times its scale; a dot product of ``d`` terms adds ``d U64`` of the sum of the
magnitudes. Each bound below is that sum with a factor 2 of margin, never a tuned number.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from companion.attention import NoPE, attention
from companion.rope import RotaryEmbedding, rope_frequencies
from companion.rope_variants import PRoPE, XPos, xpos_max_centered_position
from companion.scaling import compute_inv_freq
from helpers import rand

U64 = 2.0**-53
U32 = 2.0**-24


# ----------------------------------------------------------------------------- torchscale, transcribed


def ts_fixed_pos_embedding(scale):
    seq_len, dim = scale.shape
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, dtype=torch.float64) / dim))
    inp = torch.einsum("i , j -> i j", torch.arange(0, seq_len, dtype=torch.float64), inv_freq)
    return torch.sin(inp), torch.cos(inp)


def ts_rotate_every_two(x):
    x1, x2 = x[:, :, ::2], x[:, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def ts_duplicate_interleave(m):
    return m.reshape(-1, 1).repeat(1, 2).reshape(m.shape[0], -1)


def ts_xpos(x, head_dim, scale_base=512, offset=0, downscale=False):
    """torchscale's XPOS.forward on x of shape (batch * heads, length, head_dim), in float64."""
    zeta = (torch.arange(0, head_dim, 2, dtype=torch.float64) + 0.4 * head_dim) / (1.4 * head_dim)
    length = x.shape[1]
    min_pos = -(length + offset) // 2
    max_pos = length + offset + min_pos
    scale = zeta ** (torch.arange(min_pos, max_pos, 1, dtype=torch.float64) / scale_base)[:, None]
    sin, cos = ts_fixed_pos_embedding(scale)
    if scale.shape[0] > length:
        scale, sin, cos = scale[-length:], sin[-length:], cos[-length:]
    if downscale:
        scale = 1 / scale
    sin, cos = (ts_duplicate_interleave(t * scale) for t in (sin, cos))
    return x * cos + ts_rotate_every_two(x) * sin


def flat(x):
    """(batch, heads, seq, d) -> (batch * heads, seq, d), torchscale's layout."""
    return x.reshape(-1, x.shape[2], x.shape[3])


def rotation_bound(x, positions, scale_max, extra=8):
    """Per-element bound for one rotated coordinate against a float64 reference: the pair's
    magnitude |a| + |b| times the scale, times (angle error |p| U64 + about 8 roundings), x2."""
    p = positions.abs().max().item()
    return 2 * (p + extra) * U64 * 2 * x.abs().max().item() * scale_max


@pytest.mark.parametrize("length", [1, 2, 7, 16])
@pytest.mark.parametrize("head_dim", [8, 32])
def test_xpos_matches_torchscale_prefill(length, head_dim):
    q, k = rand(2, 3, length, head_dim, seed=1), rand(2, 3, length, head_dim, seed=2)
    pos = torch.arange(length)
    xp = XPos(head_dim)
    rq, rk = xp.rotate(q, k, pos, pos)
    tq = ts_xpos(flat(q), head_dim).reshape(q.shape)
    tk = ts_xpos(flat(k), head_dim, downscale=True).reshape(k.shape)
    s_max = 3.5 ** (length / 512)  # zeta_0 ** (-|n'| / gamma) with |n'| <= length
    torch.testing.assert_close(rq, tq, rtol=0, atol=rotation_bound(q, pos, s_max))
    torch.testing.assert_close(rk, tk, rtol=0, atol=rotation_bound(k, pos, s_max))
    # the check can fail: torchscale's scale is not the identity except at the centre
    if length > 2:
        assert (rq - ts_xpos(flat(q), head_dim, downscale=True).reshape(q.shape)).abs().max() > 1e-6


def test_xpos_matches_torchscale_decode_step():
    """torchscale decodes with keys at offset 0 (the whole cache) and the query at offset
    src_len - 1; the hook gets k_pos = arange(src_len) and q_pos = [src_len - 1]."""
    d, n = 16, 11
    q, k = rand(1, 2, 1, d, seed=3), rand(1, 2, n, d, seed=4)
    rq, rk = XPos(d).rotate(q, k, torch.tensor([n - 1]), torch.arange(n))
    tq = ts_xpos(flat(q), d, offset=n - 1).reshape(q.shape)
    tk = ts_xpos(flat(k), d, downscale=True).reshape(k.shape)
    s_max = 3.5 ** (n / 512)
    torch.testing.assert_close(rq, tq, rtol=0, atol=rotation_bound(q, torch.tensor([n]), s_max))
    torch.testing.assert_close(rk, tk, rtol=0, atol=rotation_bound(k, torch.tensor([n]), s_max))


def test_xpos_centre_rule():
    xp = XPos(8)
    for n, c in [(1, 1), (2, 1), (5, 3), (6, 3), (11, 6)]:
        assert xp.centre_for(torch.arange(n)) == c == -(-(n) // 2)  # -min_pos of torchscale
    assert XPos(8, center=-4).centre_for(torch.arange(9)) == -4
    assert xp.centre_for(torch.empty(0, dtype=torch.int64)) == 0


def xpos_score_reference(q, k, m, n, head_dim, base=10000.0, gamma=512.0):
    """q . k after xPos at query position m and key position n, from complex numbers in float64:
    sum_i zeta_i ** ((m - n) / gamma) * Re(zq_i conj(zk_i) e^{i (m - n) theta_i}), with the
    interleaved pairs zq_i = q[2i] + i q[2i+1]."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    theta = base ** (-2 * i / head_dim)
    zeta = (2 * i / head_dim + 0.4) / 1.4
    zq = torch.complex(q[..., 0::2], q[..., 1::2])
    zk = torch.complex(k[..., 0::2], k[..., 1::2])
    rope = (zq * zk.conj() * torch.exp(1j * (m - n) * theta)).real
    decay = zeta ** ((m - n) / gamma)
    magnitude = (zq.abs() * zk.abs() * decay).sum(-1)
    return (rope * decay).sum(-1), magnitude


def score_bound(magnitude, head_dim, *positions):
    """Rounding bound for a float64 score: (d + 8 + sum |p| (angle errors)) U64 per unit of
    magnitude, times 2."""
    return 2 * (head_dim + 8 + sum(abs(p) for p in positions)) * U64 * magnitude


@settings(max_examples=60, deadline=None)
@given(m=st.integers(0, 3000), n=st.integers(0, 3000), t=st.integers(0, 3000), seed=st.integers(0, 1000),
       head_dim=st.sampled_from([4, 16, 64]))
def test_xpos_score_is_relative_and_rope_times_decay(m, n, t, seed, head_dim):
    q, k = rand(1, 1, 1, head_dim, seed=seed), rand(1, 1, 1, head_dim, seed=seed + 1)
    xp = XPos(head_dim)

    def score(a, b):
        rq, rk = xp.rotate(q, k, torch.tensor([a]), torch.tensor([b]))
        return (rq * rk).sum().item()

    ref, mag = xpos_score_reference(q[0, 0, 0], k[0, 0, 0], m, n, head_dim)
    tol = score_bound(mag.item(), head_dim, m + t, n + t, m + t - n - t)
    assert abs(score(m, n) - ref.item()) <= tol
    assert abs(score(m + t, n + t) - ref.item()) <= tol


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_xpos_score_does_not_depend_on_the_centre(layout):
    d, lq, lk = 16, 6, 9
    q, k = rand(2, 2, lq, d, seed=5), rand(2, 2, lk, d, seed=6)
    qp, kp = torch.arange(lk - lq, lk), torch.arange(lk)
    outs = {c: XPos(d, layout=layout, center=c).rotate(q, k, qp, kp) for c in (None, 0, 17, -40)}
    scores = {c: rq @ rk.transpose(-1, -2) for c, (rq, rk) in outs.items()}
    # scale_q * scale_k = zeta ** ((n - m) / gamma) for any c; the rounding of each factor is
    # relative, so the bound is the score-magnitude bound with the largest |position - c|
    mag = (q.abs().sum(-1, keepdim=True) * k.abs().sum(-1).unsqueeze(-2)).max().item() * 3.5 ** (lk / 512)
    for c in (0, 17, -40):
        torch.testing.assert_close(scores[c], scores[None], rtol=0, atol=score_bound(mag, d, lk + 40))
        # the rotated queries themselves do depend on the centre (the test above can fail)
        assert (outs[c][0] - outs[None][0]).abs().max() > 1e-4


def test_xpos_half_layout_is_the_interleaved_one_permuted():
    from companion.rope import convert_layout

    d = 16
    q, k = rand(1, 2, 5, d, seed=7), rand(1, 1, 5, d, seed=8)
    pos = torch.arange(5)
    iq, ik = XPos(d).rotate(q, k, pos, pos)
    hq, hk = XPos(d, layout="half").rotate(convert_layout(q, "interleaved", "half"),
                                           convert_layout(k, "interleaved", "half"), pos, pos)
    # a permutation of coordinates commutes with the per-pair arithmetic: the same numbers
    assert torch.equal(convert_layout(iq, "interleaved", "half"), hq)
    assert torch.equal(convert_layout(ik, "interleaved", "half"), hk)


def test_xpos_gqa_decode_and_per_row_positions():
    d, h, hk = 8, 4, 2
    xp = XPos(d, center=5)
    q, k = rand(2, h, 7, d, seed=9), rand(2, hk, 7, d, seed=10)
    pos = torch.arange(7)
    rq, rk = xp.rotate(q, k, pos, pos)
    # GQA: each key head is rotated as if it stood alone (the scale only depends on position)
    rq1, rk1 = xp.rotate(q, k[:, :1].expand(2, h, 7, d), pos, pos)
    assert torch.equal(rk1[:, 0], rk[:, 0]) and torch.equal(rq1, rq)
    # decode: the last query alone equals the last row of the prefill, bit for bit
    dq, dk = xp.rotate(q[:, :, -1:], k, pos[-1:], pos)
    assert torch.equal(dq, rq[:, :, -1:]) and torch.equal(dk, rk)
    # per-row positions: each row as if rotated alone (a fixed centre makes that exact)
    rows = torch.stack((pos, pos + 3))
    pq, pk = xp.rotate(q, k, rows, rows)
    for b in range(2):
        sq, sk = xp.rotate(q[b:b + 1], k[b:b + 1], rows[b], rows[b])
        assert torch.equal(pq[b:b + 1], sq) and torch.equal(pk[b:b + 1], sk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_xpos_low_precision_uses_float32_tables(dtype):
    d = 16
    q, k = rand(1, 2, 9, d, seed=11), rand(1, 2, 9, d, seed=12)
    pos = torch.arange(9)
    ref_q, ref_k = XPos(d).rotate(q, k, pos, pos)
    lq, lk = XPos(d).rotate(q.to(dtype), k.to(dtype), pos, pos)
    assert lq.dtype == dtype and lk.dtype == dtype
    # input rounding (eps/2) + float32 arithmetic (a few U32, negligible for bf16/fp16) + the
    # output rounding (eps/2), relative to |a| + |b| times the scale (<= 1.01 here)
    eps = torch.finfo(dtype).eps
    bound = 2 * (eps + 16 * U32) * 2 * q.abs().max().item() * 1.01
    torch.testing.assert_close(lq.double(), ref_q, rtol=0, atol=bound)
    torch.testing.assert_close(lk.double(), ref_k, rtol=0, atol=bound)


def test_xpos_gradcheck():
    xp = XPos(8, layout="half")
    q = rand(1, 2, 4, 8, seed=13).requires_grad_()
    k = rand(1, 1, 5, 8, seed=14).requires_grad_()
    qp, kp = torch.tensor([1, 2, 3, 4]), torch.arange(5)
    assert torch.autograd.gradcheck(lambda a, b: xp.rotate(a, b, qp, kp), (q, k))


def test_xpos_in_reference_attention():
    d = 8
    q, k, v = rand(2, 2, 5, d, seed=15), rand(2, 1, 5, d, seed=16), rand(2, 1, 5, d, seed=17)
    out = attention(q, k, v, XPos(d), causal=True)
    rq, rk = XPos(d).rotate(q, k, torch.arange(5), torch.arange(5))
    assert torch.equal(out, attention(rq, rk, v, NoPE(), causal=True))


def test_xpos_range_limit():
    gamma = 512.0
    limit = xpos_max_centered_position(gamma)
    assert limit == math.floor(gamma * 126 * math.log(2) / math.log(3.5)) == 35694
    xp = XPos(8)
    # at the limit both scales of pair 0 are normal float32 numbers, as documented
    s_q = xp.scale(torch.tensor([-limit, limit]), 0).float()
    s_k = xp.scale(torch.tensor([-limit, limit]), 0, key=True).float()
    tiny = torch.finfo(torch.float32).tiny
    for s in (s_q, s_k):
        assert bool(torch.isfinite(s).all()) and bool((s >= tiny).all())
    # one step further along the same rule it is not: zeta_0 ** (-(limit + 1) / gamma) > 2**126
    assert (limit + 1) / gamma * math.log(3.5) > 126 * math.log(2)
    # the longest default-centred sequence is 2 * limit positions
    q = torch.zeros(1, 1, 1, 8)
    xp.rotate(q, torch.zeros(1, 1, 2 * limit, 8), torch.tensor([2 * limit - 1]), torch.arange(2 * limit))
    # two more: centre ceil(71390 / 2) = 35695, and key 0 is 35695 from it
    with pytest.raises(ValueError, match=r"k_pos holds position 0, 35695 from the centre 35695"):
        xp.rotate(q, torch.zeros(1, 1, 2 * limit + 2, 8), torch.tensor([2 * limit + 1]), torch.arange(2 * limit + 2))
    with pytest.raises(ValueError, match=r"q_pos holds position -40000.*beyond \|position - centre\| = 35694"):
        XPos(8, center=0).rotate(q, q, torch.tensor([-40000]), torch.tensor([0]))


@pytest.mark.parametrize("make, exc, match", [
    (lambda: XPos(7), ValueError, r"head_dim must be even"),
    (lambda: XPos(0), ValueError, r"head_dim must be >= 2"),
    (lambda: XPos(8.0), TypeError, r"head_dim must be an int"),
    (lambda: XPos(8, scale_base=0), ValueError, r"scale_base must be a finite number > 0"),
    (lambda: XPos(8, scale_base=-512), ValueError, r"scale_base must be a finite number > 0"),
    (lambda: XPos(8, scale_base=float("inf")), ValueError, r"scale_base"),
    # the package's one rule for a base (check_base): a finite number > 1
    (lambda: XPos(8, base=0), ValueError, r"base must be a finite number > 1, got 0"),
    (lambda: XPos(8, base=1), ValueError, r"base must be a finite number > 1, got 1"),
    (lambda: XPos(8, base=1.0), ValueError, r"base must be a finite number > 1, got 1.0"),
    (lambda: XPos(8, base=0.5), ValueError, r"base must be a finite number > 1, got 0.5"),
    (lambda: XPos(8, base=float("nan")), ValueError, r"base must be a finite number > 1, got nan"),
    (lambda: XPos(8, base="1e4"), TypeError, r"base must be a finite number > 1, got str"),
    (lambda: XPos(8, base=True), TypeError, r"base must be a finite number > 1, got bool"),
    (lambda: XPos(8, layout="neox"), ValueError, r"layout"),
    (lambda: XPos(8, center=1.5), TypeError, r"center must be an int or None"),
    (lambda: XPos(8, center=True), TypeError, r"center must be an int or None"),
    (lambda: PRoPE(8, p=1.5), ValueError, r"p must lie in \[0, 1\]"),
    (lambda: PRoPE(8, p=-0.1), ValueError, r"p must be a finite number >= 0"),
    (lambda: PRoPE(8, p=float("nan")), ValueError, r"\bp must be a finite number"),
    (lambda: PRoPE(8, p="half"), TypeError, r"\bp must be a finite number"),
    (lambda: PRoPE(9), ValueError, r"head_dim must be even"),
    (lambda: PRoPE(8, base=-1.0), ValueError, r"base must be a finite number > 1, got -1.0"),
    (lambda: PRoPE(8, base=1.0), ValueError, r"base must be a finite number > 1, got 1.0"),
])
def test_bad_construction(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_xpos_bad_rotate_input():
    xp = XPos(8)
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"q head_dim must equal XPos's head_dim 8, got 6"):
        xp.rotate(torch.zeros(1, 2, 3, 6), q, torch.arange(3), torch.arange(3))
    with pytest.raises(ValueError, match=r"k must have 4 dimensions"):
        xp.rotate(q, torch.zeros(2, 3, 8), torch.arange(3), torch.arange(3))
    with pytest.raises(TypeError, match=r"q must be a floating-point tensor"):
        xp.rotate(q.long(), q, torch.arange(3), torch.arange(3))
    with pytest.raises(ValueError, match=r"k_pos"):
        xp.rotate(q, q, torch.arange(3), torch.arange(4))
    with pytest.raises(TypeError, match=r"q_pos"):
        xp.rotate(q, q, torch.arange(3.0), torch.arange(3))


# ----------------------------------------------------------------------------- p-RoPE


def test_prope_keeps_the_highest_frequencies():
    d, base = 64, 10000.0
    pr = PRoPE(d, 0.75, base=base)
    full = rope_frequencies(d, base)
    k = int(0.75 * d // 2)
    assert pr.rotating_pairs == k == 24
    assert torch.equal(pr.inv_freq[:k], full[:k])  # the largest theta_i (i small) are kept
    assert torch.equal(pr.inv_freq[k:], torch.zeros(d // 2 - k))
    assert bool((full[:k].min() > full[k:].max()))  # ... and they are the highest ones
    # HuggingFace's rounding, float arithmetic included: 0.58 * 100 // 2 == 28, not 29
    assert PRoPE(100, 0.58).rotating_pairs == 28 and PRoPE(10, 0.3).rotating_pairs == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_prope_p1_is_rope_and_p0_is_nope_bit_for_bit(dtype, layout):
    d = 16
    q, k = rand(2, 4, 6, d, dtype=dtype, seed=20), rand(2, 2, 6, d, dtype=dtype, seed=21)
    qp, kp = torch.arange(3, 9), torch.tensor([[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7]])
    a = PRoPE(d, 1.0, layout=layout).rotate(q, k, qp, kp)
    b = RotaryEmbedding(d, layout=layout).rotate(q, k, qp, kp)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    z = PRoPE(d, 0.0, layout=layout).rotate(q, k, qp, kp)
    assert torch.equal(z[0], q) and torch.equal(z[1], k)
    assert not torch.equal(b[0], q)  # RoPE itself is not the identity here


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prope_formula(dtype):
    """Kept pairs rotate by p theta_i, the others stay put; against float64 complex numbers."""
    d, p = 16, 0.5
    q = rand(1, 2, 7, d, dtype=dtype, seed=22)
    pos = torch.arange(100, 107)
    rq, _ = PRoPE(d, p).rotate(q, q, pos, pos)
    h, kept = d // 2, int(p * d // 2)
    theta = 10000.0 ** (-2 * torch.arange(h, dtype=torch.float64) / d)
    theta[kept:] = 0
    z = torch.complex(q[..., :h].double(), q[..., h:].double()) * torch.exp(1j * pos[:, None].double() * theta)
    ref = torch.cat((z.real, z.imag), -1)
    u = U64 if dtype == torch.float64 else U32
    bound = 2 * (pos.max().item() + 8) * u * 2 * q.abs().max().item()
    torch.testing.assert_close(rq.double(), ref, rtol=0, atol=bound)
    # the zero-frequency pairs are untouched, exactly
    assert torch.equal(rq[..., kept:h], q[..., kept:h]) and torch.equal(rq[..., h + kept:], q[..., h + kept:])


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 5000), n=st.integers(0, 5000), t=st.integers(0, 5000), seed=st.integers(0, 1000),
       p=st.sampled_from([0.25, 0.5, 0.75]))
def test_prope_score_is_relative(m, n, t, seed, p):
    d = 32
    q, k = rand(1, 1, 1, d, seed=seed), rand(1, 1, 1, d, seed=seed + 1)
    pr = PRoPE(d, p)

    def score(a, b):
        rq, rk = pr.rotate(q, k, torch.tensor([a]), torch.tensor([b]))
        return (rq * rk).sum().item()

    mag = (q.abs() * k.abs()).sum().item() * 2
    assert abs(score(m, n) - score(m + t, n + t)) <= 2 * score_bound(mag, d, m + t, n + t)


def test_prope_gradcheck_and_attention():
    pr = PRoPE(8, 0.5)
    q = rand(1, 2, 4, 8, seed=23).requires_grad_()
    k = rand(1, 1, 4, 8, seed=24).requires_grad_()
    pos = torch.arange(4)
    assert torch.autograd.gradcheck(lambda a, b: pr.rotate(a, b, pos, pos), (q, k))
    assert PRoPE.hooks() == ("rotate",)


def test_prope_equals_the_proportional_config():
    d, prf, theta = 64, 0.25, 1e6
    cfg = {"rope_type": "proportional", "rope_theta": theta, "partial_rotary_factor": prf}
    via_config = RotaryEmbedding(d, rope_config=cfg)
    pr = PRoPE(d, prf, base=theta)
    assert torch.equal(via_config.inv_freq, pr.inv_freq)
    q, k = rand(1, 2, 5, d, dtype=torch.float32, seed=25), rand(1, 2, 5, d, dtype=torch.float32, seed=26)
    pos = torch.arange(40, 45)
    a, b = via_config.rotate(q, k, pos, pos), pr.rotate(q, k, pos, pos)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_prope_float64_recomputes_its_frequencies_and_custom_ones_stay():
    pr = PRoPE(16, 0.5)
    pos = torch.arange(3)
    cos64, _ = pr.cos_sin(pos, dtype=torch.float64)
    ref = rope_frequencies(16, 10000.0, dtype=torch.float64)
    ref[4:] = 0
    assert torch.equal(cos64, torch.cos(pos[:, None].double() * ref))
    pr.set_frequencies(torch.full((8,), 0.5))  # custom: used as given
    assert torch.equal(pr.cos_sin(pos, dtype=torch.float64)[0], torch.cos(pos[:, None].double() * 0.5).expand(3, 8))
    with pytest.raises(TypeError, match="PRoPE's frequencies are fixed"):
        pr.set_rope_config({"rope_type": "default", "rope_theta": 1e4})


def test_proportional_inv_freq_via_compute_inv_freq_is_prope():
    inv, att = compute_inv_freq({"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, 32)
    assert att == 1.0 and torch.equal(inv, PRoPE(32, 0.5).inv_freq)


def test_xpos_moves_with_the_module_like_any_scheme():
    """nn.Module.to/double/float recurse into the scheme (a method named _apply once shadowed
    torch's and broke model.double())."""
    from companion import TinyDecoder
    model = TinyDecoder(20, 16, 2, 1, scheme=XPos(8)).double()
    out = model(torch.randint(0, 20, (1, 5)))
    assert out.dtype == torch.float64 and torch.isfinite(out).all()
