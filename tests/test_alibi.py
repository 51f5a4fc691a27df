"""ALiBi slopes and bias, and the blockwise bias attention, against independent references."""

import math
from functools import partial

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from companion import PositionScheme, attention
from companion.alibi import ALIBI_FORMS, ALiBi, alibi_bias, alibi_slopes, bias_attention

from helpers import TableBias, rand_native as rand
from helpers import qkv as _qkv

qkv = partial(_qkv, b=2, h=4, lq=13, lk=13, d=8)

HEAD_COUNTS = [8, 12, 16, 32, 40]


# ----------------------------------------------------------------------------- independent slopes


def paper_get_slopes(n):
    """A transcription of the paper's reference rule (ofirpress/attention_with_linear_biases,
    fairseq/models/transformer.py): geometric for a power of two, else the closest lower
    power of two plus every other slope of twice that many heads."""

    def power_of_two(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + paper_get_slopes(2 * closest)[0::2][: n - closest]


def hf_style_slopes(n):
    """HuggingFace's build_alibi_tensor formulation: base ** powers (written independently)."""
    closest = 2 ** math.floor(math.log2(n))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base**p for p in range(1, closest + 1)]
    if closest != n:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra**p for p in range(1, 1 + 2 * min(closest, n - closest), 2)]
    return slopes


@pytest.mark.parametrize("n", HEAD_COUNTS + list(range(1, 8)) + [24, 48, 64, 96, 100])
def test_slopes_equal_paper_reference(n):
    # The reference builds torch.Tensor(get_slopes(n)): float32 rounding of the double values.
    expected = torch.tensor(paper_get_slopes(n), dtype=torch.float32)
    got = alibi_slopes(n)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert torch.equal(got, expected)


def test_slopes_equal_both_references_for_every_head_count_to_300():
    for n in range(1, 301):
        got = alibi_slopes(n)
        assert torch.equal(got, torch.tensor(paper_get_slopes(n), dtype=torch.float32)), n
        torch.testing.assert_close(
            got.double(), torch.tensor(hf_style_slopes(n), dtype=torch.float64), rtol=1e-7, atol=0
        )


@pytest.mark.parametrize("n", HEAD_COUNTS + [1, 3, 5, 6, 7, 20, 80])
def test_slopes_equal_huggingface_formulation(n):
    torch.testing.assert_close(
        alibi_slopes(n).double(), torch.tensor(hf_style_slopes(n), dtype=torch.float64),
        rtol=1e-7, atol=0,
    )


def test_slopes_literal_values():
    assert alibi_slopes(8).tolist() == [1 / 2**h for h in range(1, 9)]
    assert alibi_slopes(1).tolist() == [2.0**-8]
    assert alibi_slopes(2).tolist() == [2.0**-4, 2.0**-8]
    assert alibi_slopes(16).tolist()[:4] == pytest.approx([2**-0.5, 2**-1, 2**-1.5, 2**-2], rel=1e-7)
    # 12 heads: the 8-head slopes, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (odd 16-head slopes).
    s12 = alibi_slopes(12).tolist()
    assert s12[:8] == alibi_slopes(8).tolist()
    assert s12[8:] == pytest.approx([2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5], rel=1e-7)
    # 40 heads: the 32-head slopes, then 2^(-h/8) for h = 1, 3, ..., 15.
    s40 = alibi_slopes(40).tolist()
    assert s40[32:] == pytest.approx([2 ** (-h / 8) for h in range(1, 16, 2)], rel=1e-7)


def test_max_bias_generalises_the_exponent():
    torch.testing.assert_close(
        alibi_slopes(4, max_bias=4.0), torch.tensor([2.0**-1, 2.0**-2, 2.0**-3, 2.0**-4])
    )
    assert torch.equal(alibi_slopes(12, max_bias=8), alibi_slopes(12))


@given(n=st.integers(1, 300))
def test_slopes_properties(n):
    s = alibi_slopes(n).double()
    closest = 2 ** (n.bit_length() - 1)
    assert s.shape == (n,) and bool(((s > 0) & (s < 1)).all())
    # The first `closest` slopes are geometric with ratio 2^(-8/closest).
    ratio = s[1:closest] / s[: closest - 1]
    torch.testing.assert_close(ratio, torch.full_like(ratio, 2.0 ** (-8 / closest)), rtol=1e-6, atol=0)
    # Every slope lies in [2^-8, 2^(-8 / (2 * closest))]: the extras interleave.
    assert float(s.min()) >= 2.0**-8 * (1 - 1e-7)
    assert float(s.max()) <= 2.0 ** (-8 / (2 * closest)) * (1 + 1e-7)


# ----------------------------------------------------------------------------- the bias


def test_symmetric_bias_is_minus_slope_times_distance():
    s = ALiBi(4)
    qp, kp = torch.tensor([0, 3, 7]), torch.arange(9)
    bias = s.bias(qp, kp)
    assert bias.shape == (4, 3, 9) and bias.dtype == torch.float32
    for h in range(4):
        for a, i in enumerate(qp.tolist()):
            for j in kp.tolist():
                assert float(bias[h, a, j]) == pytest.approx(-float(s.slopes[h]) * abs(i - j))


def test_causal_form_folds_the_mask():
    pos = torch.arange(6)
    sym = alibi_bias(alibi_slopes(2), pos, pos, form="symmetric")
    cau = alibi_bias(alibi_slopes(2), pos, pos, form="causal")
    lower = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    assert torch.equal(cau[:, lower], sym[:, lower])
    assert bool(torch.isneginf(cau[:, ~lower]).all())
    assert bool((sym[:, ~lower] < 0).all())  # the symmetric form is finite everywhere


def test_bias_forms_give_identical_causal_attention():
    """Symmetric -m|i-j|, causal m(j-i) and the paper/BLOOM key-only m*j differ by a constant
    per query row on the entries a causal mask keeps, so softmax makes them identical."""

    class KeyOnly(PositionScheme):  # the fairseq / BLOOM implementation trick
        def __init__(self, n):
            super().__init__()
            self.slopes = alibi_slopes(n)

        def bias(self, q_pos, k_pos):
            return (self.slopes[:, None, None] * k_pos.to(torch.float32)).expand(-1, len(q_pos), -1)

    q, k, v = qkv()
    ref = attention(q, k, v, ALiBi(4), causal=True)
    torch.testing.assert_close(attention(q, k, v, ALiBi(4, form="causal"), causal=True), ref)
    torch.testing.assert_close(attention(q, k, v, ALiBi(4, form="causal")), ref)  # mask in the bias
    torch.testing.assert_close(attention(q, k, v, KeyOnly(4), causal=True), ref)
    # Without a causal mask the symmetric form is a different (encoder) attention.
    assert not torch.allclose(attention(q, k, v, ALiBi(4)), ref)


def test_per_row_positions_shape():
    qp = torch.tensor([[0, 1, 2], [5, 6, 7]])
    bias = ALiBi(3).bias(qp, qp)
    assert bias.shape == (2, 3, 3, 3)
    torch.testing.assert_close(bias[0], bias[1])  # only differences matter


def test_slopes_stay_float32_after_module_cast():
    s = ALiBi(12).to(torch.bfloat16)
    assert s.slopes.dtype == torch.float32
    assert s.bias(torch.arange(3), torch.arange(3)).dtype == torch.float32
    assert s.hooks() == ("bias",)


# ----------------------------------------------------------------------------- blockwise attention


CASES = [  # (lq, lk, block_size): lengths that are and are not multiples of the block
    (13, 13, 4), (16, 16, 4), (13, 13, (3, 5)), (5, 13, 4), (1, 13, (2, 3)), (13, 13, 64), (7, 7, 1),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk,block", CASES)
def test_blockwise_matches_dense_alibi(causal, lq, lk, block):
    q, k, v = qkv(lq=lq, lk=lk)
    s = ALiBi(4)
    ref = attention(q, k, v, s, causal=causal)
    out = bias_attention(q, k, v, s.bias, causal=causal, block_size=block)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_matches_dense_table_bias_and_grads(causal):
    q, k, v = qkv(lq=11, lk=11, requires_grad=True)
    s_ref, s_blk = TableBias(4), TableBias(4)
    ref = attention(q, k, v, s_ref, causal=causal)
    out = bias_attention(q, k, v, s_blk, causal=causal, block_size=(3, 4))
    torch.testing.assert_close(out, ref)
    g = rand(*ref.shape, seed=5)
    grads_ref = torch.autograd.grad(ref, (q, k, v, s_ref.table), g)
    grads_blk = torch.autograd.grad(out, (q, k, v, s_blk.table), g)
    for a, b in zip(grads_blk, grads_ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk,block", [(7, 7, 3), (3, 7, (2, 3)), (6, 6, 4)])
def test_gradcheck_alibi(causal, lq, lk, block):
    q, k, v = qkv(b=1, h=2, lq=lq, lk=lk, d=3, requires_grad=True)
    s = ALiBi(2)
    assert torch.autograd.gradcheck(
        lambda q, k, v: bias_attention(q, k, v, s.bias, causal=causal, block_size=block), (q, k, v)
    )


def test_gradcheck_bias_parameters():
    q, k, v = qkv(b=2, h=2, lq=5, lk=6, d=3, requires_grad=True)
    table = rand(2, 7, seed=9, requires_grad=True)

    def bias_fn(qp, kp):
        return table[:, (kp[None, :] - qp[:, None]).clamp(-3, 3) + 3]

    def f(q, k, v, table):
        return bias_attention(q, k, v, bias_fn, causal=True, block_size=(2, 4), bias_params=[table])

    assert torch.autograd.gradcheck(f, (q, k, v, table))


def test_kv_cache_step_equals_last_rows_of_full():
    q, k, v = qkv(lq=9, lk=9)
    full = bias_attention(q, k, v, ALiBi(4).bias, causal=True, block_size=4)
    step = bias_attention(q[:, :, -2:], k, v, ALiBi(4).bias, causal=True, block_size=4)
    torch.testing.assert_close(step, full[:, :, -2:])


def test_grouped_query_attention():
    q, k, v = qkv(h=6, hk=2)
    s = ALiBi(6)
    ref = attention(q, k, v, s, causal=True)
    torch.testing.assert_close(bias_attention(q, k, v, s, causal=True, block_size=5), ref)


def test_per_row_positions_match_dense():
    q, k, v = qkv(b=2, lq=8, lk=8)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 1, 2, 3, 4, 5]])
    s = ALiBi(4)
    ref = attention(q, k, v, s, pos, pos, causal=True)
    out = bias_attention(q, k, v, s.bias, causal=True, block_size=3, q_pos=pos, k_pos=pos)
    torch.testing.assert_close(out, ref)


def test_causal_form_alone_masks_and_fully_masked_rows_are_zero():
    q, k, v = qkv(lq=6, lk=6, requires_grad=True)
    sym = bias_attention(q, k, v, ALiBi(4).bias, causal=True, block_size=4)
    cau = bias_attention(q, k, v, ALiBi(4, form="causal").bias, block_size=4)
    torch.testing.assert_close(cau, sym)
    # Queries at positions before every key attend nothing: zero output, finite gradients.
    out = bias_attention(q, k, v, ALiBi(4).bias, causal=True, block_size=4,
                         q_pos=torch.arange(6), k_pos=torch.arange(3, 9))
    ref = attention(q, k, v, ALiBi(4), torch.arange(6), torch.arange(3, 9), causal=True)
    torch.testing.assert_close(out, ref)
    assert bool((out[:, :, :3] == 0).all())
    out.square().sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_runs_in_float32(dtype):
    q, k, v = qkv(dtype=torch.float32)
    out = bias_attention(q.to(dtype), k.to(dtype), v.to(dtype), ALiBi(4).bias, causal=True, block_size=4)
    assert out.dtype == dtype
    ref = attention(q, k, v, ALiBi(4), causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_no_bias_matches_sdpa():
    q, k, v = qkv()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(bias_attention(q, k, v, causal=True, block_size=5), ref)


def test_tiles_are_small_and_future_tiles_skipped():
    """The bias function only ever sees one tile, and a causal call never asks for a tile
    that lies entirely in the future: a structural check that nothing is L x L."""
    seen = []
    s = ALiBi(2)

    def spy(qp, kp):
        seen.append((int(qp[0]), len(qp), int(kp[0]), len(kp)))
        return s.bias(qp, kp)

    q, k, v = qkv(h=2, lq=20, lk=20)
    bias_attention(q, k, v, spy, causal=True, block_size=(4, 8))
    assert max(n for _, n, _, _ in seen) <= 4 and max(n for _, _, _, n in seen) <= 8
    assert all(k0 <= q0 + nq - 1 for q0, nq, k0, _ in seen)  # no fully-future tile
    # 5 query tiles x 3 key tiles = 15, of which the visible ones are the first
    # ceil((q_end)/8) key tiles of each query tile: 1 + 1 + 2 + 2 + 3 = 9; +1 validation call.
    assert len(seen) == 9 + 1
    seen.clear()
    bias_attention(q, k, v, spy, causal=False, block_size=(4, 8))
    assert len(seen) == 15 + 1


class RelativeTable(TableBias):
    """The same table, declared relative: bias_attention may reuse one tile per diagonal."""

    relative_bias = True


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk,block", [(20, 20, 4), (19, 23, (4, 4)), (7, 23, (3, 5)), (20, 20, (4, 8))])
def test_relative_bias_reuse_matches_dense_with_grads(causal, lq, lk, block):
    q, k, v = qkv(lq=lq, lk=lk, requires_grad=True)
    s_ref, s_rel = TableBias(4), RelativeTable(4)
    ref = attention(q, k, v, s_ref, causal=causal)
    out = bias_attention(q, k, v, s_rel, causal=causal, block_size=block)
    torch.testing.assert_close(out, ref)
    g = rand(*ref.shape, seed=5)
    for a, b in zip(torch.autograd.grad(out, (q, k, v, s_rel.table), g),
                    torch.autograd.grad(ref, (q, k, v, s_ref.table), g)):
        torch.testing.assert_close(a, b)


def test_relative_bias_is_computed_once_per_diagonal():
    calls = []
    s = ALiBi(2)

    def spy(qp, kp):
        calls.append((len(qp), len(kp)))
        return s.bias(qp, kp)

    q, k, v = qkv(h=2, lq=20, lk=20)
    ref = bias_attention(q, k, v, spy, causal=True, block_size=4)
    n_plain = len(calls)
    calls.clear()
    spy.relative_bias = True
    out = bias_attention(q, k, v, spy, causal=True, block_size=4)
    torch.testing.assert_close(out, ref)
    assert n_plain == 15 + 1  # 5 x 5 tiles, 15 visible, plus the validation call
    assert len(calls) == 5 + 1  # one per diagonal offset 0, -4, -8, -12, -16
    # Positions that do not count up by one disable the reuse (the tiles differ).
    calls.clear()
    pos = torch.arange(0, 40, 2)
    out = bias_attention(q, k, v, spy, causal=True, block_size=4, q_pos=pos, k_pos=pos)
    torch.testing.assert_close(out, attention(q, k, v, ALiBi(2), pos, pos, causal=True))
    assert len(calls) == 15 + 1


@given(
    lq=st.integers(1, 12), extra=st.integers(0, 6), bq=st.integers(1, 7), bk=st.integers(1, 7),
    causal=st.booleans(), seed=st.integers(0, 1000),
)
def test_blockwise_property(lq, extra, bq, bk, causal, seed):
    lk = lq + extra
    q, k, v = (rand(1, 2, n, 4, seed=seed + i) for i, n in enumerate((lq, lk, lk)))
    s = TableBias(2, max_dist=3)
    ref = attention(q, k, v, s, causal=causal).detach()
    rel = RelativeTable(2, max_dist=3)
    with torch.no_grad():
        out = bias_attention(q, k, v, s.bias, causal=causal, block_size=(bq, bk))
        out_rel = bias_attention(q, k, v, rel.bias, causal=causal, block_size=(bq, bk))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out_rel, ref)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("n", [0, -3])
def test_bad_head_count(n):
    with pytest.raises(ValueError, match="n_heads must be >= 1"):
        alibi_slopes(n)
    with pytest.raises(ValueError, match="n_heads must be >= 1"):
        ALiBi(n)


def test_bad_argument_types_and_values():
    with pytest.raises(TypeError, match="n_heads must be an int"):
        alibi_slopes(8.0)
    with pytest.raises(TypeError, match="n_heads must be an int"):
        alibi_slopes(True)
    with pytest.raises(ValueError, match="max_bias must be a finite number > 0"):
        alibi_slopes(8, max_bias=0)
    with pytest.raises(ValueError, match="form must be one of"):
        ALiBi(8, form="decoder")
    assert ALIBI_FORMS == ("symmetric", "causal")


@pytest.mark.parametrize("block", [0, -1, (4, 0), (0, 4)])
def test_bad_block_size(block):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"block_size(\[\d\])? must be >= 1"):
        bias_attention(q, k, v, ALiBi(4).bias, block_size=block)


def test_bad_block_size_shape_and_type():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="pair"):
        bias_attention(q, k, v, block_size=(4, 4, 4))
    with pytest.raises(TypeError, match="block_size must be an int"):
        bias_attention(q, k, v, block_size=4.0)


def test_bias_fn_wrong_shape():
    q, k, v = qkv(lq=13, lk=13)
    whole = ALiBi(4).bias(torch.arange(13), torch.arange(13))
    with pytest.raises(ValueError, match=r"bias_fn returned shape \(4, 13, 13\) for a tile of 4 query"):
        bias_attention(q, k, v, lambda qp, kp: whole, block_size=4)
    with pytest.raises(ValueError, match="must broadcast to"):
        bias_attention(q, k, v, lambda qp, kp: whole[:3, :4, :4], block_size=4)
    with pytest.raises(ValueError, match="ALiBi was built for 3 heads but the queries have 4 heads"):
        bias_attention(q, k, v, ALiBi(3).bias, block_size=4)  # 3 heads for a 4-head input


def test_bias_fn_wrong_type():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="floating-point tensor or None"):
        bias_attention(q, k, v, lambda qp, kp: kp[None, :] - qp[:, None])
    with pytest.raises(TypeError, match="bias_fn must be callable"):
        bias_attention(q, k, v, 3.0)


def test_scheme_with_other_hooks_is_rejected():
    class Rot(PositionScheme):
        def rotate(self, q, k, q_pos, k_pos):
            return q, k

        def bias(self, q_pos, k_pos):
            return None

    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"only the bias hook.*\['rotate'\]"):
        bias_attention(q, k, v, Rot())


def test_trainable_closure_without_bias_params_is_rejected():
    q, k, v = qkv()
    w = torch.ones(4, 1, 1, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="bias_params"):
        bias_attention(q, k, v, lambda qp, kp: w * (kp[None, :] - qp[:, None]).double())


def test_bad_shapes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        bias_attention(q[0], k, v)
    with pytest.raises(ValueError, match="head_dim"):
        bias_attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="multiple of k heads"):
        bias_attention(q, k[:, :3], v[:, :3])
    with pytest.raises(TypeError, match="q_pos must hold integers"):
        bias_attention(q, k, v, q_pos=torch.arange(13.0))
