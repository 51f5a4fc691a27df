"""Tests for companion.cope: CoPE against a naive loop, gradients, properties, bad input.

The oracle is :func:`naive_cope`, written here from the paper's definitions with Python
floats (one query, one key at a time), so it shares no code with the vectorised version:

    g_it = sigmoid(q_i . k_t / sqrt(d)) if k_pos[t] <= q_pos[i] else 0
    p_ij = min(sum_{t >= j} g_it, npos - 1)
    z_ij = (1 - w) q_i . e[floor p_ij] + w q_i . e[ceil p_ij],   w = p_ij - floor p_ij
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from companion.attention import NoPE, attention
from companion.cope import CoPE, cope_gates, cope_interpolate, cope_positions, cope_score
from companion.model import TinyDecoder
from helpers import rand

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps


def naive_cope(q, k, table, q_pos, k_pos, return_positions=False):
    """The triple loop (batch x head, query, key) of the module docstring, in Python floats."""
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    npos = table.shape[0]
    q, k, table = q.tolist(), k.tolist(), table.tolist()
    out = torch.zeros(b, h, lq, lk, dtype=torch.float64)
    pos_out = torch.zeros(b, h, lq, lk, dtype=torch.float64)
    for bi in range(b):
        qp = (q_pos[bi] if q_pos.dim() == 2 else q_pos).tolist()
        kp = (k_pos[bi] if k_pos.dim() == 2 else k_pos).tolist()
        for hi in range(h):
            kh = hi // (h // hk)  # GQA: query head hi reads key head hi // group
            for i in range(lq):
                qi = q[bi][hi][i]
                for j in range(lk):
                    p = 0.0
                    for t in range(j, lk):
                        if kp[t] <= qp[i]:
                            dot = sum(a * c for a, c in zip(qi, k[bi][kh][t]))
                            p += 1.0 / (1.0 + math.exp(-dot / math.sqrt(d)))
                    p = min(p, npos - 1)
                    lo, hi_ = math.floor(p), math.ceil(p)
                    w = p - lo
                    z_lo = sum(a * c for a, c in zip(qi, table[lo]))
                    z_hi = sum(a * c for a, c in zip(qi, table[hi_]))
                    out[bi, hi, i, j] = (1 - w) * z_lo + w * z_hi
                    pos_out[bi, hi, i, j] = p
    return (out, pos_out) if return_positions else out


# The float64 tolerance: each z_ij is at most lk sigmoids plus two d-term dot products and
# a few multiplications; every operation has a relative error <= eps, and the vectorised
# and naive forms sum in different orders, so |error| <= C (lk + d) eps M with M the
# largest |q_i . e_n| (plus |q_i . k_t| / sqrt(d) for the gates, which are Lipschitz 1/4 and
# feed z through |q_i . (e[n+1] - e[n])| <= 2M). C = 16 covers the constant factors.
def tol64(q, table, lk):
    m = max(1.0, float((q @ table.T).abs().max()), float(q.abs().max()) ** 2)
    return 16 * (lk + q.shape[-1]) * EPS64 * m


CASES = {
    # name: (batch, heads, kv_heads, q_len, k_len, npos, positions kind)
    "self": (2, 3, 3, 6, 6, 8, None),
    "decode": (2, 2, 2, 3, 8, 10, None),
    "single-query": (1, 2, 2, 1, 7, 9, None),
    "more-queries": (1, 2, 2, 7, 4, 6, None),
    "gqa": (2, 4, 2, 5, 5, 7, None),
    "per-row-left-padding": (2, 2, 2, 6, 6, 8, "per-row"),
    "gapped-positions": (1, 2, 2, 5, 5, 7, "gapped"),
    "clamped": (1, 2, 2, 9, 9, 3, None),
}


def build(case, seed=0):
    b, h, hk, lq, lk, npos, kind = CASES[case]
    d = 4
    q = rand(b, h, lq, d, seed=seed + 1, scale=1.5)
    k = rand(b, hk, lk, d, seed=seed + 2, scale=1.5)
    table = rand(npos, d, seed=seed + 3)
    start = max(lk - lq, 0)
    q_pos, k_pos = torch.arange(start, start + lq), torch.arange(lk)
    if kind == "per-row":
        k_pos = torch.tensor([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])  # row 0: two pads at 0
        q_pos = k_pos[:, lk - lq:]
    elif kind == "gapped":
        k_pos = torch.tensor([0, 3, 4, 9, 20])
        q_pos = torch.tensor([1, 4, 9, 10, 30])
    return q, k, table, q_pos, k_pos


@pytest.mark.parametrize("case", list(CASES))
def test_score_matches_the_naive_loop(case):
    q, k, table, q_pos, k_pos = build(case)
    want, want_pos = naive_cope(q, k, table, q_pos, k_pos, return_positions=True)
    got = cope_score(q, k, table, q_pos, k_pos)
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=tol64(q, table, k.shape[2]))
    if case == "clamped":  # the case must really clamp: some count exceeds npos - 1 = 2
        raw = cope_positions(cope_gates(q, k, q_pos, k_pos))
        assert float(raw.max()) > table.shape[0] - 1
        assert float(want_pos.max()) == table.shape[0] - 1
    else:
        assert float(want_pos.max()) < table.shape[0] - 1  # nothing clamped


def test_scheme_score_equals_the_function_and_accepts_gqa_keys():
    q, k, table, q_pos, k_pos = build("gqa")
    s = CoPE(4, table.shape[0]).double()
    with torch.no_grad():
        s.table.copy_(table)
    assert torch.equal(s.score(q, k, q_pos, k_pos), cope_score(q, k, table, q_pos, k_pos))
    # attention repeats key heads before the hook: the hook gives the same with them repeated
    k_rep = k.repeat_interleave(2, dim=1)
    assert torch.equal(s.score(q, k_rep, q_pos, k_pos), s.score(q, k, q_pos, k_pos))


def test_attention_adds_the_term_inside_the_scale():
    """softmax((q k^T + z) / sqrt(d)) v, as the authors' ContextPosSelfAttn computes it."""
    q, k, table, q_pos, k_pos = build("decode")
    v = rand(*k.shape, seed=7)
    s = CoPE(4, table.shape[0]).double()
    with torch.no_grad():
        s.table.copy_(table)
    out = attention(q, k, v, s, q_pos, k_pos, causal=True)
    z = naive_cope(q, k, table, q_pos, k_pos)
    logits = (q @ k.transpose(-1, -2) + z) / math.sqrt(4)
    logits = logits.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    want = torch.softmax(logits, -1) @ v
    # softmax is 1-Lipschitz in the logits (sup norm) and |v| <= max|v|: the output error is
    # at most 2 max|v| times the logit error, plus the final matmul's k_len eps max|v|.
    vmax = float(v.abs().max())
    tol = 2 * vmax * tol64(q, table, k.shape[2]) + 4 * k.shape[2] * EPS64 * vmax
    torch.testing.assert_close(out, want, rtol=0, atol=tol)


def test_zero_table_is_nope():
    """The default (the authors' zero start) adds exactly 0: the attention is NoPE's."""
    q, k, _, q_pos, k_pos = build("self")
    v = rand(*k.shape, seed=5)
    s = CoPE(4, 8).double()
    assert torch.equal(s.table, torch.zeros(8, 4, dtype=torch.float64))
    assert torch.equal(attention(q, k, v, s, q_pos, k_pos, causal=True),
                       attention(q, k, v, NoPE(), q_pos, k_pos, causal=True))


def test_float32_against_the_float64_loop():
    q, k, table, q_pos, k_pos = build("per-row-left-padding")
    s = CoPE(4, table.shape[0])  # float32 table
    with torch.no_grad():
        s.table.copy_(table.float())
    got = s.score(q.float(), k.float(), q_pos, k_pos)
    assert got.dtype == torch.float32
    want = naive_cope(q.float().double(), k.float().double(), s.table.double(), q_pos, k_pos)
    # Same bound as tol64 with float32's eps; each gate's logit error (d eps |q||k|) moves
    # p by up to lk times that, hence the extra factor lk.
    lk, d = k.shape[2], q.shape[-1]
    m = max(1.0, float((q @ table.T).abs().max()), float(q.abs().max()) ** 2)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=16 * lk * (lk + d) * EPS32 * m)


def test_gradcheck_q_k_table():
    q, k, table, q_pos, k_pos = build("decode", seed=3)
    q, k, table = (t.clone().requires_grad_() for t in (q, k, table))
    assert torch.autograd.gradcheck(lambda a, b, t: cope_score(a, b, t, q_pos, k_pos), (q, k, table))


def test_gradcheck_clamped_and_per_row():
    for case in ("clamped", "per-row-left-padding"):
        q, k, table, q_pos, k_pos = build(case, seed=11)
        q, k, table = (t.clone().requires_grad_() for t in (q, k, table))
        assert torch.autograd.gradcheck(lambda a, b, t: cope_score(a, b, t, q_pos, k_pos), (q, k, table))


def test_gradient_reaches_keys_only_through_the_gates():
    """The score depends on k only through the gates: a key's gradient is nonzero (the
    counting path is differentiable), and the clamped region passes no gradient."""
    q, k, table, q_pos, k_pos = build("self")
    k = k.clone().requires_grad_()
    cope_score(q, k, table, q_pos, k_pos).sum().backward()
    assert float(k.grad.abs().min(dim=-1).values.max()) > 0
    # with npos = 1 every position is clamped to 0: no gradient to the keys at all
    k.grad = None
    cope_score(q, k, table[:1], q_pos, k_pos).sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))


def test_future_keys_have_zero_gates_and_do_not_leak():
    q, k, table, q_pos, k_pos = build("self")
    gates = cope_gates(q, k, q_pos, k_pos)
    future = k_pos[None, :] > q_pos[:, None]
    assert torch.equal(gates[..., future], torch.zeros_like(gates[..., future]))
    assert bool((gates[..., ~future] > 0).all())
    # changing a future key changes nothing a query may see (its own and earlier keys)
    k2 = k.clone()
    k2[:, :, -1] += 5.0
    z1, z2 = cope_score(q, k, table, q_pos, k_pos), cope_score(q, k2, table, q_pos, k_pos)
    assert torch.equal(z1[..., :-1, :], z2[..., :-1, :])
    assert not torch.equal(z1[..., -1, :], z2[..., -1, :])  # the last query sees the key


def test_positions_count_keys_not_position_gaps():
    """Integer positions matter only through causality: gaps between them change nothing."""
    q, k, table, _, _ = build("self")
    dense = cope_score(q, k, table, torch.arange(6), torch.arange(6))
    gapped = cope_score(q, k, table, torch.tensor([0, 2, 7, 8, 20, 21]), torch.tensor([0, 2, 7, 8, 20, 21]))
    assert torch.equal(dense, gapped)


def test_positions_helper_all_ones_is_relative_position():
    """All visible gates 1: p_ij = i - j + 1 for j <= i (tokens j..i counted), 0 after."""
    n = 7
    gates = torch.ones(n, n, dtype=torch.float64).tril()
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    want = torch.where(j <= i, i - j + 1, 0).double()
    assert torch.equal(cope_positions(gates), want)
    assert torch.equal(cope_positions(gates, npos=4), want.clamp(max=3))


@given(st.lists(st.booleans(), min_size=1, max_size=12))
def test_positions_helper_counts_separators(flags):
    """Gates that fire on separators only: p_{last, j} is the number of separators from key j
    to the end (an independent loop)."""
    gates = torch.tensor(flags, dtype=torch.float64)[None, :]
    got = cope_positions(gates)[0].tolist()
    want = [sum(flags[j:]) for j in range(len(flags))]
    assert got == want


def test_saturated_gates_reduce_to_a_relative_embedding():
    """Huge positive q . k (every gate rounds to 1 in float64) gives z_ij = q_i . e[i - j + 1]."""
    n, d, npos = 6, 4, 10
    q = torch.ones(1, 1, n, d, dtype=torch.float64) * 10.0  # q . k / sqrt(d) = 200: sigmoid = 1.0
    k = torch.ones(1, 1, n, d, dtype=torch.float64) * 10.0
    q = q * torch.linspace(1.0, 2.0, n, dtype=torch.float64)[:, None]
    table = rand(npos, d, seed=4)
    pos = torch.arange(n)
    gates = cope_gates(q, k, pos, pos)
    assert torch.equal(gates[0, 0], torch.ones(n, n, dtype=torch.float64).tril())
    z = cope_score(q, k, table, pos, pos)[0, 0]
    for i in range(n):
        for j in range(i + 1):
            want = q[0, 0, i] @ table[i - j + 1]
            # one d-term dot product, summed in another order by the batched matmul: a few
            # float64 roundings of |q| . |e| (a bit-for-bit test failed with scalar kernels)
            tol = 4 * d * EPS64 * float(q[0, 0, i].abs() @ table[i - j + 1].abs())
            assert abs(float(z[i, j]) - float(want)) <= tol


def test_interpolation_is_linear_between_rows():
    q = rand(1, 1, 1, 3, seed=2)
    table = rand(4, 3, seed=3)
    p = torch.tensor([0.0, 0.25, 1.0, 2.5, 3.0], dtype=torch.float64).view(1, 1, 1, 5)
    got = cope_interpolate(q, table, p)[0, 0, 0]
    rows = (q[0, 0, 0] @ table.T).tolist()
    want = [rows[0], 0.75 * rows[0] + 0.25 * rows[1], rows[1], 0.5 * rows[2] + 0.5 * rows[3], rows[3]]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=8 * EPS64 * max(map(abs, rows)))


def test_tiny_decoder_trains_the_table():
    torch.manual_seed(0)
    s = CoPE(8, 6)
    model = TinyDecoder(11, d_model=16, n_heads=2, n_layers=2, scheme=s)
    idx = torch.randint(0, 11, (2, 9))
    model.loss(idx, idx).backward()
    assert s.table.grad is not None and float(s.table.grad.abs().max()) > 0


# ----------------------------------------------------------------------------- bad input


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="npos must be >= 1"):
        CoPE(4, 0)
    with pytest.raises(TypeError, match="npos must be an int"):
        CoPE(4, 2.0)
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        CoPE(0, 4)
    with pytest.raises(ValueError, match="init_std must be a finite number >= 0"):
        CoPE(4, 4, init_std=-1.0)
    with pytest.raises(ValueError, match="npos must be >= 1"):
        cope_positions(torch.ones(2, 2), npos=0)


def test_bad_score_inputs():
    q, k, table, q_pos, k_pos = build("self")
    s = CoPE(4, 8).double()
    with pytest.raises(ValueError, match="q head_dim 3 must equal the scheme's head_dim 4"):
        s.score(q[..., :3], k[..., :3], q_pos, k_pos)
    with pytest.raises(ValueError, match="k head_dim 3 must equal q head_dim 4"):
        cope_score(q, k[..., :3], table, q_pos, k_pos)
    with pytest.raises(ValueError, match=r"table must have shape \(npos, head_dim\) with head_dim 4"):
        cope_score(q, k, table[:, :3], q_pos, k_pos)
    with pytest.raises(ValueError, match="k_pos must be non-decreasing"):
        s.score(q, k, q_pos, torch.tensor([0, 1, 3, 2, 4, 5]))
    with pytest.raises(ValueError, match="k_pos must be non-decreasing"):
        s.score(q, k, q_pos, torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 5, 4]]))
    with pytest.raises(ValueError, match=r"q_pos must have shape \(6,\) or \(2, 6\)"):
        s.score(q, k, torch.arange(5), k_pos)
    with pytest.raises(ValueError, match=r"k_pos must have shape \(6,\) or \(2, 6\)"):
        s.score(q, k, q_pos, torch.zeros(3, 6, dtype=torch.long))
    with pytest.raises(TypeError, match="q_pos must hold integers"):
        s.score(q, k, q_pos.double(), k_pos)
    with pytest.raises(TypeError, match="k must have q's dtype"):
        s.score(q, k.float(), q_pos, k_pos)
    with pytest.raises(ValueError, match=r"q heads \(3\) must be a multiple of k heads \(2\)"):
        s.score(q, k[:, :2], q_pos, k_pos)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        s.score(q[0], k, q_pos, k_pos)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, npos - 1\]"):
        cope_interpolate(q, table, torch.full((2, 3, 6, 6), 8.0, dtype=torch.float64))


# ----------------------------------------------------------------------------- NaN (issue 29)


def test_nan_follows_the_attention_rule_instead_of_a_message_about_positions():
    """A NaN query used to fail with "positions must lie in [0, npos - 1] ... got [nan, nan]",
    about positions the caller never passed. Now NaN follows the package's rule: a NaN query
    makes only its own output NaN, a NaN key reaches only the queries that see it (keys after a
    query have a gate of exactly 0), and the rest equals the clean result."""
    q, k, table, q_pos, k_pos = build("self")
    s = CoPE(4, table.shape[0]).double()
    with torch.no_grad():
        s.table.copy_(table)
    v = rand(*k.shape, seed=9)
    clean = attention(q, k, v, s, q_pos=q_pos, k_pos=k_pos, causal=True)
    bad_q = q.clone()
    bad_q[0, 1, 2, 0] = float("nan")
    out = attention(bad_q, k, v, s, q_pos=q_pos, k_pos=k_pos, causal=True)
    nan = out.isnan().any(-1)
    assert nan[0, 1, 2] and int(nan.sum()) == 1
    torch.testing.assert_close(out.nan_to_num(), clean.masked_fill(nan[..., None], 0.0), rtol=0, atol=0)
    z = cope_score(bad_q, k, table, q_pos, k_pos)
    assert bool(z[0, 1, 2].isnan().all()) and int(z.isnan().sum()) == z.shape[-1]
    bad_k = k.clone()
    bad_k[1, :, 3, 0] = float("nan")  # key 3 of row 1: seen by queries 3, 4, 5 only
    out = attention(q, bad_k, v, s, q_pos=q_pos, k_pos=k_pos, causal=True)
    nan = out.isnan().any(-1)
    assert bool(nan[1, :, 3:].all()) and int(nan.sum()) == 3 * q.shape[1]
    torch.testing.assert_close(out[:, :, :3], clean[:, :, :3], rtol=0, atol=0)
    torch.testing.assert_close(out[0], clean[0], rtol=0, atol=0)
    gates = cope_gates(q, bad_k, q_pos, k_pos)
    assert bool((gates[1, :, :3, 3] == 0).all())  # the queries before it: exactly 0


def test_interpolating_nan_positions_says_so():
    q, _, table, _, _ = build("self")
    p = torch.full((2, 3, 6, 6), 1.5, dtype=torch.float64)
    p[1, 0, 4, 2] = float("nan")
    with pytest.raises(ValueError, match=r"positions must lie in \[0, npos - 1\] = \[0, 7\], got NaN at index "
                                         r"\(1, 0, 4, 2\) \(1 of 216 entries are NaN\)"):
        cope_interpolate(q, table, p)
