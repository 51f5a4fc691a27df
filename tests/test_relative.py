"""Relative position encodings: Shaw et al., Transformer-XL (rel_shift) and T5 buckets."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from companion import TinyDecoder, attention
from companion.relative import (
    ShawRelative,
    T5RelativeBias,
    TransformerXL,
    rel_shift,
    relative_positions,
    shaw_relative_index,
    shaw_score,
    shaw_score_naive,
    shaw_values,
    shaw_values_naive,
    sinusoidal_relative_table,
    t5_relative_position_bucket,
    transformer_xl_score,
)
from helpers import (U32, U64, assert_within, attention_error_bounds, attention_out_bound, pow_bound,
                     softmax_attention_bounds)
from helpers import rand_native as rand


# ============================================================================ T5 buckets


def t5_bucket_scalar(relative_position, bidirectional, num_buckets, max_distance):
    """Plain-Python transcription of mesh-tensorflow's _relative_position_bucket (one int)."""
    n = -relative_position
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if n < 0:
            bucket += num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("num_buckets", [32, 128])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_match_original_for_every_distance(num_buckets, bidirectional):
    rel = torch.arange(-4096, 4097)
    ours = t5_relative_position_bucket(rel, bidirectional, num_buckets, 128).tolist()
    ref = [t5_bucket_scalar(r, bidirectional, num_buckets, 128) for r in range(-4096, 4097)]
    mismatches = [(r, a, b) for r, a, b in zip(range(-4096, 4097), ours, ref) if a != b]
    assert not mismatches, mismatches[:10]


def test_t5_buckets_known_values():
    # T5 defaults: 32 buckets, max_distance 128; 16 buckets per direction, 8 exact.
    b = lambda r, bd=True: int(t5_relative_position_bucket(torch.tensor(r), bd))  # noqa: E731
    assert [b(r) for r in (0, -1, -7, -8, -15, -16, -127, -128, -10**6)] == [0, 1, 7, 8, 9, 10, 15, 15, 15]
    assert [b(r) for r in (1, 7, 8, 16, 128)] == [17, 23, 24, 26, 31]
    assert [b(r, False) for r in (5, 0, -1, -15, -16, -32, -127, -128)] == [0, 0, 1, 15, 16, 21, 31, 31]
    assert t5_relative_position_bucket(torch.tensor([-3], dtype=torch.int32)).dtype == torch.int64


@given(
    bidirectional=st.booleans(),
    num_buckets=st.integers(4, 300),
    extra=st.integers(1, 2000),
    rel=st.lists(st.integers(-10**7, 10**7), min_size=1, max_size=40),
)
def test_t5_buckets_match_scalar_for_random_configs(bidirectional, num_buckets, extra, rel):
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    max_distance = max_exact + extra
    ours = t5_relative_position_bucket(torch.tensor(rel), bidirectional, num_buckets, max_distance).tolist()
    assert ours == [t5_bucket_scalar(r, bidirectional, num_buckets, max_distance) for r in rel]


@given(
    bidirectional=st.booleans(),
    num_buckets=st.sampled_from([4, 8, 32, 33, 64, 128, 320]),
    max_distance=st.integers(200, 5000),
    sign=st.sampled_from([-1, 1]),
    a=st.integers(0, 20000),
    b=st.integers(0, 20000),
)
def test_t5_buckets_monotone_in_distance_and_in_range(bidirectional, num_buckets, max_distance, sign, a, b):
    lo, hi = min(a, b), max(a, b)
    buckets = t5_relative_position_bucket(torch.tensor([sign * lo, sign * hi]), bidirectional,
                                          num_buckets, max_distance)
    assert 0 <= int(buckets.min()) and int(buckets.max()) < num_buckets
    assert buckets[0] <= buckets[1]  # farther on the same side never gets a smaller bucket
    if bidirectional:
        half = num_buckets // 2
        assert all((x >= half) == (r > 0) for x, r in zip(buckets.tolist(), (sign * lo, sign * hi)))
    elif sign > 0:
        assert buckets.tolist() == [0, 0]  # causal: every future key shares bucket 0


def test_t5_bias_shapes_and_values():
    torch.manual_seed(0)
    s = T5RelativeBias(num_heads=4, num_buckets=32, max_distance=128, bidirectional=True)
    q_pos, k_pos = torch.arange(3, 8), torch.arange(9)
    out = s.bias(q_pos, k_pos)
    assert out.shape == (4, 5, 9)
    buckets = t5_relative_position_bucket(k_pos[None, :] - q_pos[:, None])
    # exact: both sides copy table entries (a strided Toeplitz view vs an indexed gather)
    assert torch.equal(out, s.table[buckets].permute(2, 0, 1))
    per_row = torch.stack([q_pos, q_pos + 2])
    out2 = s.bias(per_row, torch.stack([k_pos, k_pos + 2]))
    assert out2.shape == (2, 4, 5, 9)
    # exact: the pairwise path gathers the same table entries for the same buckets
    assert torch.equal(out2[0], out)
    assert torch.equal(out2[1], out)  # shifting both by 2 changes nothing, not even a bit
    assert s.bias(per_row, k_pos).shape == (2, 4, 5, 9)
    assert s.table.shape == (32, 4) and s.table is s.relative_attention_bias.weight
    assert s.hooks() == ("bias",)


@given(lq=st.integers(1, 40), lk=st.integers(1, 40), q0=st.integers(-300, 300), k0=st.integers(-300, 300),
       bidirectional=st.booleans())
def test_t5_toeplitz_path_equals_pairwise_path(lq, lk, q0, k0, bidirectional):
    torch.manual_seed(0)
    s = T5RelativeBias(3, 32, 128, bidirectional)
    q_pos, k_pos = torch.arange(q0, q0 + lq), torch.arange(k0, k0 + lk)
    fast = s.bias(q_pos, k_pos)
    slow = s.bias(q_pos[None], k_pos[None])[0]  # per-row positions take the pairwise path
    assert fast.shape == (3, lq, lk) and fast.is_contiguous()
    assert torch.equal(fast, slow)


def test_t5_toeplitz_path_gradient():
    torch.manual_seed(0)
    a, b = T5RelativeBias(2, bidirectional=False).double(), T5RelativeBias(2, bidirectional=False).double()
    b.load_state_dict(a.state_dict())
    w = torch.randn(2, 7, 9, dtype=torch.float64)
    pos_q, pos_k = torch.arange(2, 9), torch.arange(9)
    (a.bias(pos_q, pos_k) * w).sum().backward()
    (b.bias(pos_q[None], pos_k[None])[0] * w).sum().backward()
    # Entry (c, h) of either gradient is the float64 sum of w[h, i, j] over the n_c pairs in
    # bucket c, in two orders (per offset, then per bucket; or pair by pair): any order of a
    # sum of n terms is within (n - 1) U64 sum |w| of the exact sum, so the two differ by at
    # most 2 (n_c - 1) U64 sum_{bucket c} |w|.
    buckets = t5_relative_position_bucket(pos_k[None, :] - pos_q[:, None], False).flatten()
    n = torch.bincount(buckets, minlength=32).double()
    abs_sum = torch.zeros(32, 2, dtype=torch.float64).index_add_(0, buckets, w.abs().flatten(1).T)
    assert_within(a.table.grad, b.table.grad, 2 * (n - 1).clamp(min=0)[:, None] * U64 * abs_sum)


def test_t5_bias_as_blockwise_bias_fn():
    """Slicing positions into blocks gives the matching slices of the full bias."""
    s = T5RelativeBias(3, bidirectional=False)
    pos = torch.arange(40)
    full = s.bias(pos, pos)
    for i0 in range(0, 40, 16):
        for j0 in range(0, 40, 16):
            blk = s.bias(pos[i0:i0 + 16], pos[j0:j0 + 16])
            # exact: a block's Toeplitz view copies the same table entries as the full one's
            assert torch.equal(blk, full[:, i0:i0 + 16, j0:j0 + 16])


def test_t5_attention_matches_sdpa_with_scale_one():
    s = T5RelativeBias(3).double()
    q, k, v = (rand(2, 3, 6, 8, seed=i) for i in range(3))
    pos = torch.arange(6)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=s.bias(pos, pos), scale=1.0)
    # two float64 computations of the same attention, each within helpers.attention_out_bound:
    # the dense reference (one key block), SDPA (whichever kernel: an online softmax over at
    # most 6 key blocks)
    bound = (attention_out_bound(q, k, v, s, scale=1.0, dtype=torch.float64)
             + attention_out_bound(q, k, v, s, scale=1.0, dtype=torch.float64, blocks=6))
    assert_within(attention(q, k, v, s, scale=1.0), ref, bound)


def test_t5_bias_is_shared_across_layers():
    torch.manual_seed(0)
    s = T5RelativeBias(4, bidirectional=False)
    base = sum(p.numel() for p in TinyDecoder(50, 32, 4, n_layers=3).parameters())
    model = TinyDecoder(50, 32, 4, n_layers=3, scheme=s)
    assert sum(p.numel() for p in model.parameters()) == base + 32 * 4  # once, not per layer
    assert all(b.attn.scheme is s for b in model.blocks)
    idx = torch.randint(0, 50, (2, 12))
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    assert s.table.grad is not None and s.table.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(max_distance=-5), ValueError, r"max_distance must be >= 1, got -5"),
        (dict(max_distance=0), ValueError, r"max_distance must be >= 1, got 0"),
        (dict(num_buckets=3), ValueError, r"num_buckets must be >= 4 for bidirectional=True"),
        (dict(num_buckets=1, bidirectional=False), ValueError, r"num_buckets must be >= 2 for bidirectional=False"),
        (dict(num_buckets=64, max_distance=16), ValueError, r"max_distance \(16\) must exceed the exact region, max_exact = 16"),
        (dict(num_buckets=32.0), TypeError, "num_buckets must be an int"),
        (dict(bidirectional=1), TypeError, "bidirectional must be a bool"),
    ],
)
def test_t5_bad_arguments(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        t5_relative_position_bucket(torch.arange(3), **kwargs)
    if "bidirectional" not in kwargs or isinstance(kwargs["bidirectional"], bool):
        with pytest.raises(exc, match=message):
            T5RelativeBias(2, **kwargs)


def test_t5_rejects_float_positions():
    with pytest.raises(TypeError, match="relative_position must hold integers"):
        t5_relative_position_bucket(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="q_pos must hold integers"):
        T5RelativeBias(2).bias(torch.arange(3.0), torch.arange(3))


# ============================================================================ Shaw


def pair_rows(table, idx):
    """``table``'s row ``idx_ij`` for every (query, key), by plain indexing: ``(batch or 1,
    heads or 1, q_len, k_len, width)`` for a ``(rows, width)`` or ``(heads, rows, width)`` table
    and a ``(q_len, k_len)`` or ``(batch, q_len, k_len)`` index."""
    t = table if table.dim() == 3 else table[None]
    return t[:, idx if idx.dim() == 3 else idx[None]].movedim(1, 0)


def shaw_bounds(s, q, k, v, dout=None):
    """Bounds for one float64 computation of causal Shaw attention (default positions, every
    form: the efficient and naive hooks, the paper's loops) against the exact result, through
    helpers.softmax_attention_bounds with the pairwise keys ``k_j + a^K_ij`` and values
    ``v_j + a^V_ij``; with ``dout``, also for the gradients of ``q``, ``table_k``, ``table_v``.

    Roundings counted (u = U64; b, h, L, d, K: batch, heads, length, head dim, clip distance):

    * logits: ``q.k`` and ``q.a^K`` (d terms each; the loops: ``k + a^K`` then d terms), their
      sum, the scale: ``(d + 2) u`` times ``scale |q_i|.(|k_j| + |a^K_ij|)``;
    * output: ``P @ v`` (L terms) plus Shaw's values (the efficient form sums the weights per
      table row, at most L terms, then 2K + 1 rows; the naive form L terms), and their sum:
      ``L + 2K + 2``;
    * ``dP``: ``dout.v`` and ``dout.a^V`` (d_v terms each) and their sum: ``d_v + 1``;
    * ``dq_i = scale sum_j dS_ij (k_j + a^K_ij)``: the scale, ``dS @ k`` (L terms), Shaw's part
      (per table row at most L terms, then 2K + 1 rows) and their sum: ``L + 2K + 3``;
    * a table row's gradient sums its bucket over batch, heads and pairs: the efficient form
      per query row (at most L terms) then over ``b h L`` rows, the naive form over ``b h``
      then over at most ``L^2`` pairs: ``b h L + L^2`` terms, plus the scale for ``table_k``.
    """
    u = U64
    b, h, L, d = q.shape
    K, rows = s.max_distance, 2 * s.max_distance + 1
    pos = torch.arange(L)
    idx = (pos[None, :] - pos[:, None]).clamp(-K, K) + K  # Shaw's table row of key j for query i
    q, k, v = (t.detach() for t in (q, k, v))
    with torch.no_grad():
        _, P = attention(q, k, v, s, causal=True, return_weights=True)
    key_abs = k.abs()[:, :, None] + pair_rows(s.table_k.detach().abs(), idx)  # (b, h, L, L, d)
    val_abs = v.abs()[:, :, None] + pair_rows(s.table_v.detach().abs(), idx)
    scale = d**-0.5
    logit_abs = scale * (q.abs()[..., None, :] * key_abs).sum(-1)
    bounds = softmax_attention_bounds(P, logit_abs, (d + 2) * u * logit_abs, val_abs, out_terms=L + 2 * K + 2,
                                      u=u, dout=dout, dp_terms=v.shape[-1] + 1)
    if dout is None:
        return bounds
    R, T, E = bounds["R"], bounds["T"], bounds["E"]
    terms = b * h * L + L * L + 1

    def per_row(W):  # sum W (b, h, L, L, width) over each table row's pairs
        return torch.zeros(rows, W.shape[-1], dtype=W.dtype).index_add_(0, idx.flatten(), W.sum((0, 1)).flatten(0, 1))

    bounds["dq"] = scale * ((E + (L + 2 * K + 3) * u * T)[..., None] * key_abs).sum(-2)
    bounds["dtable_k"] = per_row(scale * (E + terms * u * T)[..., None] * q.abs()[..., None, :])
    bounds["dtable_v"] = per_row((P * (R + terms * u))[..., None] * dout.abs()[..., None, :])
    return bounds


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_shaw_efficient_equals_naive(per_row, per_head):
    b, h, lq, lk, d, K = 2, 3, 7, 10, 5, 3
    q, w = rand(b, h, lq, d, seed=1), rand(b, h, lq, lk, seed=2).softmax(-1)
    shape = (h, 2 * K + 1, d) if per_head else (2 * K + 1, d)
    tk, tv = rand(*shape, seed=3), rand(*shape, seed=4)
    q_pos, k_pos = torch.arange(3, 3 + lq), torch.arange(lk)
    if per_row:
        q_pos, k_pos = torch.stack([q_pos, q_pos * 2]), torch.stack([k_pos, k_pos.flip(0)])
    idx = shaw_relative_index(q_pos, k_pos, K)
    # The same products, summed in other orders (float64, u = U64): the score is a d-term dot
    # product on both sides, 2 d U64 sum_d |q| |a^K| apart; the efficient values sum the weights
    # per table row (at most lk terms) and then 2K + 1 rows, the naive ones lk terms:
    # (2 lk + 2K + 1) U64 sum_j |w| |a^V| apart.
    score_tol = 2 * d * U64 * (q.abs()[..., None, :] * pair_rows(tk.abs(), idx)).sum(-1)
    assert_within(shaw_score(q, tk, idx), shaw_score_naive(q, tk, idx), score_tol)
    values_tol = (2 * lk + 2 * K + 1) * U64 * (w.abs()[..., None] * pair_rows(tv.abs(), idx)).sum(-2)
    assert_within(shaw_values(w, tv, idx), shaw_values_naive(w, tv, idx), values_tol)


def test_shaw_index_clips_both_ways():
    idx = shaw_relative_index(torch.arange(6), torch.arange(6), 2)
    assert idx[0].tolist() == [2, 3, 4, 4, 4, 4] and idx[5].tolist() == [0, 0, 0, 0, 1, 2]


def test_shaw_attention_matches_the_paper_formula():
    """e_ij = q_i.(k_j + a^K_ij)/sqrt(d), z_i = sum_j a_ij (v_j + a^V_ij), written as loops."""
    torch.manual_seed(0)
    s = ShawRelative(4, max_distance=2, init_std=1.0).double()
    q, k, v = (rand(1, 2, 5, 4, seed=i) for i in range(3))
    out = attention(q, k, v, s, causal=True)
    ref = torch.zeros_like(out)
    for h in range(2):
        for i in range(5):
            rel = [max(-2, min(2, j - i)) + 2 for j in range(i + 1)]
            e = torch.stack([q[0, h, i] @ (k[0, h, j] + s.table_k[r]) for j, r in zip(range(i + 1), rel)]) / 2.0
            a = e.softmax(0)
            ref[0, h, i] = sum(a[j] * (v[0, h, j] + s.table_v[r]) for j, r in zip(range(i + 1), rel))
    # two float64 computations, each within shaw_bounds (the loops round no more than the hooks)
    assert_within(out, ref, 2 * shaw_bounds(s, q, k, v)["out"])


def test_shaw_scheme_naive_and_efficient_agree_with_gradients():
    torch.manual_seed(0)
    fast = ShawRelative(8, max_distance=3, init_std=0.5).double()
    slow = ShawRelative(8, max_distance=3, naive=True).double()
    slow.load_state_dict(fast.state_dict())
    q, k, v = (rand(2, 2, 9, 8, seed=i).requires_grad_() for i in range(3))
    dout = rand(2, 2, 9, 8, seed=3)  # one cotangent for both, so that the bounds below apply
    outs = []
    for s in (fast, slow):
        out = attention(q, k, v, s, causal=True)
        grads = torch.autograd.grad(out, [q, s.table_k, s.table_v], dout)
        outs.append((out, *grads))
    # two float64 computations of the same function, each within shaw_bounds
    bounds = shaw_bounds(fast, q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dtable_k", "dtable_v"), *outs):
        assert_within(a, b, 2 * bounds[name])
    assert fast.hooks() == ("score",)


def test_shaw_gradcheck():
    s = ShawRelative(3, max_distance=2, init_std=0.5).double()
    q = rand(1, 2, 4, 3, seed=5).requires_grad_()
    w = rand(1, 2, 4, 6, seed=6).softmax(-1).requires_grad_()
    idx = shaw_relative_index(torch.arange(2, 6), torch.arange(6), 2)
    assert torch.autograd.gradcheck(lambda a, t: shaw_score(a, t, idx), (q, s.table_k))
    assert torch.autograd.gradcheck(lambda a, t: shaw_values(a, t, idx), (w, s.table_v))


def test_shaw_bad_input():
    with pytest.raises(ValueError, match="max_distance must be >= 1, got -1"):
        ShawRelative(8, max_distance=-1)
    with pytest.raises(ValueError, match="max_distance must be >= 1, got -3"):
        shaw_relative_index(torch.arange(3), torch.arange(3), -3)
    with pytest.raises(ValueError, match="q head_dim 4 must equal the scheme's head_dim 8"):
        attention(*(torch.zeros(1, 1, 3, 4) for _ in range(3)), ShawRelative(8))
    with pytest.raises(ValueError, match=r"table_k must have shape \(2K\+1, head_dim\)"):
        shaw_score(torch.zeros(1, 1, 3, 4), torch.zeros(5, 3), torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="per-row batch sizes must match"):
        relative_positions(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long))


# ============================================================================ rel_shift


def rel_shift_reference(x):
    """Index-level statement of rel_shift, including the spill-over of the reshape."""
    q, w = x.shape[-2:]
    out = torch.empty_like(x)
    for i in range(q):
        for j in range(w):
            c = q + j - i  # column in the zero-padded row i (column 0 is the pad)
            row = i
            if c > w:  # past the end of row i: the reshape reads on into row i + 1
                c -= w + 1
                row += 1
            out[..., i, j] = 0.0 if c == 0 else x[..., row, c - 1]
    return out


def test_rel_shift_exhaustive_small_sizes():
    """All q_len 1..12 and memory 0..12 (width q_len + memory), as XL uses it, and the gather."""
    for q in range(1, 13):
        for mem in range(13):
            w = q + mem
            x = torch.arange(2 * q * w, dtype=torch.float64).view(2, q, w) + 1
            y = rel_shift(x)
            torch.testing.assert_close(y, rel_shift_reference(x), rtol=0, atol=0)
            i = torch.arange(q)[:, None]
            j = torch.arange(w)[None, :]
            valid = j <= i + mem
            gathered = x.gather(-1, (j + q - 1 - i).clamp(0, w - 1).expand(2, q, w))
            assert torch.equal(y[:, valid], gathered[:, valid])
            # the distance it recovers: column c of XL's table holds distance w - 1 - c
            dist = (w - 1 - (j + q - 1 - i))
            assert torch.equal(dist.expand(q, w)[valid], (mem + i - j).expand(q, w)[valid])


def test_rel_shift_wider_tables_and_bad_input():
    for q in range(1, 6):
        for w in range(q, q + 8):
            x = rand(3, q, w, seed=q * 10 + w)
            torch.testing.assert_close(rel_shift(x), rel_shift_reference(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        rel_shift(torch.zeros(4))


# ============================================================================ Transformer-XL


def test_sinusoidal_relative_table_layout():
    d = torch.tensor([5, 0, -2])
    table = sinusoidal_relative_table(d, 8)
    inv_freq = 1 / (10000 ** (torch.arange(0.0, 8, 2.0) / 8))  # the authors' float32 form
    ang = d.float()[:, None] * inv_freq[None]
    # The package computes in float64 and rounds once (U32 |value| <= U32); the float32 form's
    # frequencies are within pow_bound(10000) (relative), its angle rounds once more (U32), so
    # the angle is off by Theta (pow_bound + U32), Theta = |d| w_k; sin/cos to one ulp, 2 U32.
    theta = (d.double()[:, None] * (10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8))).abs()
    tol = theta * (pow_bound(10000.0) + U32) + 3 * U32 + U64 * (theta + 4)  # + the float64 path's own
    assert_within(table, torch.cat([ang.sin(), ang.cos()], -1), tol.repeat(1, 2))
    assert table.dtype == torch.float32
    with pytest.raises(ValueError, match="dim must be even"):
        sinusoidal_relative_table(d, 7)
    with pytest.raises(TypeError, match="distances must hold integers"):
        sinusoidal_relative_table(torch.tensor([1.5]), 8)


def xl_reference(q, k, s, q_pos, k_pos):
    """The four terms of Dai et al., one (i, j) at a time: returns terms (b)+(c)+(d)."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    out = torch.zeros(b, h, lq, lk, dtype=q.dtype)
    for i in range(lq):
        for j in range(lk):
            dist = int(q_pos[i] - k_pos[j])
            if dist < 0 and not s.bidirectional:
                out[:, :, i, j] = (k[:, :, j] * s.u).sum(-1)
                continue
            r = s.relative_keys(torch.tensor([dist]))[:, 0]  # (h, d)
            out[:, :, i, j] = ((q[:, :, i] + s.v) * r).sum(-1) + (k[:, :, j] * s.u).sum(-1)
    return out


def xl_score_parts(s, q, k):
    """Magnitude bounds of Transformer-XL's position and content terms: ``|q_i + v| . w``
    ``(batch, heads, q_len, 1)``, where ``w = sum_n |W_R[:, n]|`` bounds ``|W_R R_{i-j}|``
    entry-wise since ``|R| <= 1`` (sines and cosines), and ``|k_j| . |u|`` ``(batch, heads, 1, k_len)``."""
    h, d = s.num_heads, s.head_dim
    w = s.r_proj.weight.detach().abs().sum(-1).view(h, d)
    position = (q.detach() + s.v.detach()[:, None]).abs() @ w[..., None]
    content = (k.detach().abs() @ s.u.detach().abs()[..., None]).transpose(-1, -2)
    return position, content


def xl_score_tol(s, q, k):
    """How far two float64 computations of ``s.score`` (the shift or gather path, or the
    four-term loops) may differ. Each computes ``q + v`` and the sinusoid angles alike (one
    correctly rounded operation each: the same numbers), then: ``R``, sin/cos to one ulp
    (``2 U64`` absolute, ``|R| <= 1``); ``r = W_R R`` (``d_r`` terms), so ``r`` is within
    ``(d_r + 2) U64 w``; the position term (``d`` terms) within ``(d + d_r + 2) U64 |q + v|.w``,
    the content term within ``d U64 |k|.|u|``, their sum one more: ``(d + d_r + 3) U64`` times
    the magnitudes of :func:`xl_score_parts` per computation; masking is exact."""
    position, content = xl_score_parts(s, q, k)
    return 2 * (s.head_dim + s.d_r + 3) * U64 * (position + content)


def xl_attention_bound(s, q, k, v):
    """Bound for one float64 computation of causal Transformer-XL attention (default
    positions) against the exact result, through helpers.softmax_attention_bounds: the score
    within ``(d + d_r + 3) U64`` (:func:`xl_score_tol`), ``q.k`` within ``d U64 |q|.|k|``, their
    sum and the scale two more roundings: the logit within ``(d + d_r + 5) U64`` times its
    magnitude ``scale (|q|.|k| + |q + v|.w + |k|.|u|)``; the output ``P @ v``, ``k_len`` terms."""
    q, k, v = (t.detach() for t in (q, k, v))
    with torch.no_grad():
        _, P = attention(q, k, v, s, causal=True, return_weights=True)
    position, content = xl_score_parts(s, q, k)
    logit_abs = s.head_dim**-0.5 * (q.abs() @ k.abs().transpose(-1, -2) + position + content)
    err = (s.head_dim + s.d_r + 5) * U64 * logit_abs
    return softmax_attention_bounds(P, logit_abs, err, v.abs()[:, :, None], out_terms=k.shape[2], u=U64)["out"]


@pytest.mark.parametrize("mem", [0, 1, 3])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_xl_score_matches_four_term_formula(mem, bidirectional):
    torch.manual_seed(0)
    s = TransformerXL(2, 4, d_r=6, bidirectional=bidirectional, init_std=1.0).double()
    lq = 5
    q, k = rand(2, 2, lq, 4, seed=1), rand(2, 2, lq + mem, 4, seed=2)
    q_pos, k_pos = torch.arange(mem, mem + lq), torch.arange(lq + mem)
    assert_within(s.score(q, k, q_pos, k_pos), xl_reference(q, k, s, q_pos, k_pos), xl_score_tol(s, q, k))
    assert s.hooks() == ("score",)


@given(lq=st.integers(1, 9), lk=st.integers(1, 9), q0=st.integers(-4, 12), k0=st.integers(0, 6),
       bidirectional=st.booleans())
def test_xl_shift_path_equals_gather_path(lq, lk, q0, k0, bidirectional):
    torch.manual_seed(0)
    s = TransformerXL(2, 4, bidirectional=bidirectional, init_std=1.0).double()
    q, k = rand(2, 2, lq, 4, seed=lq), rand(2, 2, lk, 4, seed=lk + 20)
    q_pos, k_pos = torch.arange(q0, q0 + lq), torch.arange(k0, k0 + lk)
    fast = s.score(q, k, q_pos, k_pos)
    slow = s._score_gather(q, k, q_pos.expand(2, lq), k_pos.expand(2, lk))
    # not exact by construction: the paths project other sets of distances (matrix products
    # of other shapes), so each entry is within xl_score_tol
    assert_within(fast, slow, xl_score_tol(s, q, k))


def test_xl_per_row_positions_left_padding():
    torch.manual_seed(0)
    s = TransformerXL(2, 4, init_std=1.0).double()
    q, k = rand(2, 2, 6, 4, seed=1), rand(2, 2, 6, 4, seed=2)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])
    both = s.score(q, k, pos, pos)  # per-row positions: the gather path; one row: the shift path
    tol = xl_score_tol(s, q, k)
    assert_within(both[0:1], s.score(q[0:1], k[0:1], pos[0], pos[0]), tol[0:1])
    assert_within(both[1:2, :, 2:, 2:], s.score(q[1:2, :, 2:], k[1:2, :, 2:], pos[1, 2:], pos[1, 2:]),
                  tol[1:2, :, 2:, 2:])


def test_xl_function_equals_scheme_and_memory_recurrence():
    torch.manual_seed(0)
    s = TransformerXL(2, 4, init_std=1.0).double()
    lq, mem = 5, 4
    q, k, v = rand(1, 2, lq, 4, seed=1), rand(1, 2, lq + mem, 4, seed=2), rand(1, 2, lq + mem, 4, seed=3)
    r = s.relative_keys(torch.arange(lq + mem - 1, -1, -1))
    direct = transformer_xl_score(q, k, r, s.u, s.v, mem_len=mem)
    # exact: the shift path projects the same distances (lq + mem - 1 down to 0) and then runs
    # the same product, rel_shift, mask and content term as the function
    assert torch.equal(direct, s.score(q, k, torch.arange(mem, mem + lq), torch.arange(lq + mem)))
    # a segment with a memory of cached keys equals the last rows of the unsegmented sequence
    q_all = torch.cat([rand(1, 2, mem, 4, seed=9), q], dim=2)
    full = attention(q_all, k, v, s, causal=True)
    seg = attention(q, k, v, s, causal=True)  # default q_pos: the last lq key positions
    # the same exact rows, computed with matrices of other shapes: each within xl_attention_bound
    assert_within(seg, full[:, :, mem:], 2 * xl_attention_bound(s, q, k, v))


def test_xl_bad_input():
    q, k = torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 6, 3)
    r, u = torch.zeros(2, 6, 3), torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"k_len \(6\) must equal q_len \(4\) when mem_len is not given"):
        transformer_xl_score(q, k, r, u, u)
    with pytest.raises(ValueError, match=r"k_len \(6\) must equal q_len \+ mem_len = 4 \+ 1"):
        transformer_xl_score(q, k, r, u, u, mem_len=1)
    with pytest.raises(ValueError, match="mem_len must be a non-negative int"):
        transformer_xl_score(q, k, r, u, u, mem_len=-2)
    with pytest.raises(ValueError, match=r"r must have shape \(heads, k_len, head_dim\)"):
        transformer_xl_score(q, k, r[:, :5], u, u, mem_len=2)
    with pytest.raises(ValueError, match="d_r must be even"):
        TransformerXL(2, 3, d_r=5)
    with pytest.raises(ValueError, match="q must have 2 heads of dim 3"):
        TransformerXL(2, 3).score(torch.zeros(1, 2, 4, 5), torch.zeros(1, 2, 4, 5), torch.arange(4), torch.arange(4))


# ============================================================================ all schemes


@pytest.mark.parametrize("make", [
    lambda: ShawRelative(8, 4, init_std=0.5),
    lambda: TransformerXL(2, 8, init_std=0.5),
    lambda: T5RelativeBias(2, bidirectional=False),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(make, dtype):
    torch.manual_seed(0)
    s = make()
    q, k, v = (rand(1, 2, 7, 8, dtype=torch.float32, seed=i) for i in range(3))
    low = [t.to(dtype) for t in (q, k, v)]
    out = attention(*low, s, causal=True)
    assert out.dtype == dtype
    # exact: attention's math runs in float32 for half-precision inputs (the inputs widened
    # exactly, the scheme's float32 terms added as they are), and the result is rounded once
    ref = attention(*(t.float() for t in low), s, causal=True)
    assert torch.equal(out, ref.to(dtype))


@pytest.mark.parametrize("make", [
    lambda: ShawRelative(8, 4),
    lambda: TransformerXL(4, 8),
    lambda: T5RelativeBias(4, bidirectional=False),
])
def test_schemes_train_inside_tiny_decoder(make):
    torch.manual_seed(0)
    model = TinyDecoder(20, 32, 4, n_layers=2, scheme=make())
    idx = torch.randint(0, 20, (2, 10))
    loss = model.loss(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.scheme.parameters())


def test_relative_schemes_are_translation_invariant():
    """Shifting every position by the same amount leaves each scheme's output unchanged."""
    torch.manual_seed(0)
    q, k, v = (rand(1, 2, 6, 8, seed=i) for i in range(3))
    for s in (ShawRelative(8, 2, init_std=1.0), TransformerXL(2, 8, init_std=1.0),
              T5RelativeBias(2, bidirectional=False)):
        s = s.double()
        a = attention(q, k, v, s, torch.arange(6), torch.arange(6), causal=True)
        b = attention(q, k, v, s, torch.arange(100, 106), torch.arange(100, 106), causal=True)
        # exact: each scheme sees only k_pos - q_pos (the same Shaw rows, XL distances, T5
        # offsets) and the causal mask is the same, so every operation repeats bit for bit
        assert torch.equal(a, b)


# ============================================================================ measurement


def test_t5_bias_drives_the_blockwise_bias_attention():
    """T5RelativeBias.bias as the bias_fn of companion.alibi.bias_attention (tiles of 16)."""
    alibi = pytest.importorskip("companion.alibi")
    torch.manual_seed(0)
    s = T5RelativeBias(3, bidirectional=False).double()
    q, k, v = (rand(2, 3, 37, 8, seed=i) for i in range(3))
    dout = rand(2, 3, 37, 8, seed=3)  # one cotangent for both, so that the bounds below apply
    ref = attention(q, k, v, s, causal=True, scale=1.0)
    (grad_ref,) = torch.autograd.grad(ref, s.table, dout)
    out = alibi.bias_attention(q, k, v, s.bias, causal=True, block_size=16, scale=1.0)
    (grad,) = torch.autograd.grad(out, s.table, dout)
    # two float64 computations, each within helpers.attention_error_bounds: the dense
    # reference (one key block) and the blockwise one (an online softmax over 3 key tiles)
    bounds = [attention_error_bounds(q, k, v, dout, s, None, None, True, 1.0, None, torch.float64, blocks)
              for blocks in (1, 3)]
    assert_within(out, ref, bounds[0]["out"] + bounds[1]["out"])
    assert_within(grad, grad_ref, bounds[0]["dtable"] + bounds[1]["dtable"])
