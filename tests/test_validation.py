"""Bad input never passes silently (issue 11): a table-driven audit of the public callables.

One test per class of bad input. Each case asserts the exception type and a regex on the
message that names the argument, or, for a valid edge case, the correct result. The cases
for ``companion.rope`` and ``companion.kernels`` live with those modules' tests.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import companion
from companion import (
    ALiBi,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    NoPE,
    ScaledSinusoidalEmbedding,
    ShawRelative,
    SinusoidalEmbedding,
    T5RelativeBias,
    TinyDecoder,
    TransformerXL,
    alibi_bias,
    alibi_slopes,
    attention,
    bias_attention,
    causal_mask,
    load_result,
    relative_positions,
    save_result,
    shaw_score,
    shaw_values,
    sinusoidal_encoding,
    sinusoidal_relative_table,
    sinusoidal_table,
    t5_relative_position_bucket,
    transformer_xl_score,
)
from companion._checks import check_finite_number, normalize_mask
from companion.relative import shaw_relative_index, shaw_score_naive, shaw_values_naive
from helpers import U64, assert_within, attention_out_bound


def qkv(b=2, h=4, lq=6, lk=6, d=8, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, h, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, h, lk, dv or d, generator=g, dtype=dtype)
    return q, k, v


def raises(exc, pattern, fn):
    with pytest.raises(exc, match=pattern):
        fn()


# ----------------------------------------------------------------------------- masks

# Every attention entry point with an attn_mask, as fn(q, k, v, mask) on (2, 4, 6, 8) inputs.
MASK_PATHS = {
    "attention": lambda q, k, v, m: attention(q, k, v, causal=True, attn_mask=m),
    "bias_attention-1": lambda q, k, v, m: bias_attention(q, k, v, ALiBi(4), causal=True, attn_mask=m, block_size=1),
    "bias_attention-4": lambda q, k, v, m: bias_attention(q, k, v, ALiBi(4), causal=True, attn_mask=m, block_size=4),
    "bias_attention-64": lambda q, k, v, m: bias_attention(q, k, v, None, causal=True, attn_mask=m, block_size=64),
}


def _padding(dtype):
    """Row 0 has its first two keys padded (left padding), row 1 none: (2, 1, 1, 6)."""
    keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    keep[0, ..., :2] = False
    return keep.to(dtype)


@pytest.mark.parametrize("path", MASK_PATHS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8])
def test_integer_mask_is_read_as_one_equals_attend(path, dtype):
    fn = MASK_PATHS[path]
    q, k, v = qkv()
    want = fn(q, k, v, _padding(torch.bool))
    got = fn(q, k, v, _padding(dtype))
    # exact: the integer mask is turned into the same bool mask before any arithmetic
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The mask matters: without it the padded row differs by far more than two computations of
    # one attention may (helpers.attention_out_bound, about 1e-6 here).
    bound = attention_out_bound(q, k, v, causal=True, blocks=6)
    assert (fn(q, k, v, None)[0, :, 2:] - want[0, :, 2:]).abs().max() > 100 * 2 * bound.max()


def test_integer_mask_matches_the_bool_mask_in_the_models():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4)
    x = torch.randn(2, 6, 16)
    mask = _padding(torch.int64)
    # exact here and below: the integer mask becomes the same bool mask before any arithmetic
    torch.testing.assert_close(mha(x, attn_mask=mask), mha(x, attn_mask=mask.bool()), rtol=0, atol=0)
    model = TinyDecoder(20, d_model=16, n_heads=4, n_layers=1)
    idx = torch.randint(0, 20, (2, 6))
    hf = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # a tokenizer's attention_mask
    pos = (hf.cumsum(-1) - 1).clamp(min=0)
    want = model(idx, pos, attn_mask=hf.bool()[:, None, None, :])
    torch.testing.assert_close(model(idx, pos, attn_mask=hf), want, rtol=0, atol=0)
    torch.testing.assert_close(model(idx, pos, attn_mask=hf.to(torch.uint8)), want, rtol=0, atol=0)
    # without the mask the padded row's logits differ by O(1): far above float32 rounding
    assert (model(idx, pos)[0, 2:] - want[0, 2:]).abs().max() > 1e-2


BAD_MASKS = [
    pytest.param(torch.full((2, 1, 1, 6), 2), ValueError, r"attn_mask is an integer mask.*value 2.*pass a bool mask", id="int-2"),
    pytest.param(-torch.ones(2, 1, 1, 6, dtype=torch.int64), ValueError, r"attn_mask .*value -1.*float additive mask", id="int-minus1"),
    pytest.param(torch.ones(3, 1, 1, 6, dtype=torch.bool), ValueError, r"attn_mask shape \(3, 1, 1, 6\) must broadcast to \(batch, heads, q_len, k_len\) = \(2, 4, 6, 6\)", id="batch-3"),
    pytest.param(torch.ones(6, 5, dtype=torch.bool), ValueError, r"attn_mask shape \(6, 5\) must broadcast", id="k_len-5"),
    pytest.param(torch.ones(1, 2, 4, 6, 6, dtype=torch.bool), ValueError, r"attn_mask must have at most 4 dimensions", id="5-d"),
    pytest.param(torch.ones(6, 6, dtype=torch.complex64), TypeError, r"attn_mask must be a bool, integer or floating tensor", id="complex"),
    pytest.param([[True] * 6] * 6, TypeError, r"attn_mask must be a torch.Tensor, got list", id="list"),
]


@pytest.mark.parametrize("path", MASK_PATHS)
@pytest.mark.parametrize("mask, exc, pattern", BAD_MASKS)
def test_bad_masks_raise_the_same_error_on_every_path(path, mask, exc, pattern):
    q, k, v = qkv()
    raises(exc, pattern, lambda: MASK_PATHS[path](q, k, v, mask))


def test_bad_masks_in_the_models():
    mha = MultiHeadAttention(16, 4)
    x = torch.randn(2, 6, 16)
    raises(ValueError, r"attn_mask .*value 2", lambda: mha(x, attn_mask=torch.full((2, 1, 1, 6), 2)))
    model = TinyDecoder(20, d_model=16, n_heads=4, n_layers=1)
    idx = torch.randint(0, 20, (2, 6))
    raises(ValueError, r"attn_mask .*value 3", lambda: model(idx, attn_mask=torch.full((2, 6), 3)))
    raises(ValueError, r"2-D attn_mask is a \(batch, seq\) padding mask.*expected shape \(2, 6\), got \(6, 6\)",
           lambda: model(idx, attn_mask=torch.ones(6, 6, dtype=torch.bool)))


def test_normalize_mask_contract():
    allowed, additive = normalize_mask(torch.tensor([[1, 0]], dtype=torch.uint8), (1, 1, 1, 2))
    assert additive is None and allowed.dtype == torch.bool and allowed.tolist() == [[True, False]]
    allowed, additive = normalize_mask(torch.zeros(1, 2), (1, 1, 1, 2))
    assert allowed is None and additive.dtype == torch.float32
    assert normalize_mask(None, (1, 1, 1, 2)) == (None, None)
    assert normalize_mask(torch.zeros(0, 2, dtype=torch.int64), (1, 1, 0, 2))[0].shape == (0, 2)


# ----------------------------------------------------------------------------- head counts

HEAD_SCHEMES = [
    pytest.param(lambda: ALiBi(1), r"ALiBi was built for 1 heads but the queries have 4 heads", id="alibi-1"),
    pytest.param(lambda: ALiBi(8), r"ALiBi was built for 8 heads but the queries have 4 heads", id="alibi-8"),
    pytest.param(lambda: T5RelativeBias(num_heads=1), r"T5RelativeBias was built for 1 heads .* 4 heads", id="t5-1"),
    pytest.param(lambda: T5RelativeBias(num_heads=2), r"T5RelativeBias was built for 2 heads .* 4 heads", id="t5-2"),
    pytest.param(lambda: TransformerXL(2, 8), r"TransformerXL was built for 2 heads .* 4 heads", id="txl-2"),
]

HEAD_PATHS = {
    "attention": lambda s, q, k, v: attention(q, k, v, s, causal=True),
    "bias_attention-scheme": lambda s, q, k, v: bias_attention(q, k, v, s, causal=True, block_size=4),
    "bias_attention-method": lambda s, q, k, v: bias_attention(q, k, v, s.bias, causal=True, block_size=4),
    "MultiHeadAttention": lambda s, q, k, v: MultiHeadAttention(32, 4, s),
    "TinyDecoder": lambda s, q, k, v: TinyDecoder(10, d_model=32, n_heads=4, scheme=s),
}


@pytest.mark.parametrize("path", HEAD_PATHS)
@pytest.mark.parametrize("make, pattern", HEAD_SCHEMES)
def test_scheme_head_count_must_equal_query_heads(path, make, pattern):
    scheme = make()
    if path.startswith("bias_attention") and isinstance(scheme, TransformerXL):
        pytest.skip("bias_attention takes bias-only schemes")
    q, k, v = qkv()
    raises(ValueError, pattern, lambda: HEAD_PATHS[path](scheme, q, k, v))


def test_matching_head_counts_still_work():
    q, k, v = qkv()
    for scheme in (ALiBi(4), T5RelativeBias(num_heads=4)):
        ref = attention(q, k, v, scheme, causal=True)
        # two float32 computations (dense; blockwise over 2 key blocks), each within
        # helpers.attention_out_bound of the exact attention
        bound = 2 * attention_out_bound(q, k, v, scheme.double(), causal=True, blocks=2)
        assert_within(bias_attention(q, k, v, scheme, causal=True, block_size=4), ref, bound)


# ----------------------------------------------------------------------------- positions

P3 = torch.arange(3)
FLOAT_POSITIONS = {
    "float32": torch.arange(3.0),
    "bfloat16": torch.arange(254, 257).to(torch.bfloat16),
    "None": None,
    "list of floats": [0.0, 1.5, 2.0],
    "list of strings": ["a", "b"],
    "bool tensor": torch.tensor([True, False]),
    "bool": True,
}

# fn(bad) for a callable whose position argument is `name`
POSITION_CALLS = {
    "causal_mask.q_pos": (lambda p: causal_mask(p, P3), "q_pos"),
    "causal_mask.k_pos": (lambda p: causal_mask(P3, p), "k_pos"),
    "alibi_bias": (lambda p: alibi_bias(alibi_slopes(4), p, P3), "q_pos"),
    "ALiBi.bias": (lambda p: ALiBi(4).bias(P3, p), "k_pos"),
    "relative_positions": (lambda p: relative_positions(p, P3), "q_pos"),
    "shaw_relative_index": (lambda p: shaw_relative_index(P3, p, 2), "k_pos"),
    "T5RelativeBias.bias": (lambda p: T5RelativeBias(2).bias(p, P3), "q_pos"),
    "t5_relative_position_bucket": (lambda p: t5_relative_position_bucket(p), "relative_position"),
    "sinusoidal_encoding": (lambda p: sinusoidal_encoding(p, 8), "positions"),
    "sinusoidal_relative_table": (lambda p: sinusoidal_relative_table(p, 8), "distances"),
    "LearnedPositionalEmbedding.lookup": (lambda p: LearnedPositionalEmbedding(8, 4).lookup(p), "pos"),
}


@pytest.mark.parametrize("call", POSITION_CALLS)
@pytest.mark.parametrize("bad", FLOAT_POSITIONS)
def test_positions_must_be_integers(call, bad):
    fn, name = POSITION_CALLS[call]
    raises(TypeError, rf"^{name} must (hold integers|be an integer tensor)", lambda: fn(FLOAT_POSITIONS[bad]))


POSITION_ARGS = [
    pytest.param(lambda: attention(*qkv(), q_pos=torch.arange(6.0)), TypeError, r"q_pos must hold integers", id="attention-float"),
    pytest.param(lambda: attention(*qkv(), k_pos=[0.5] * 6), TypeError, r"k_pos must hold integers", id="attention-list"),
    pytest.param(lambda: bias_attention(*qkv(), q_pos=torch.arange(6.0)), TypeError, r"q_pos must hold integers", id="bias_attention-float"),
    pytest.param(lambda: TinyDecoder(10, 16, 4, 1)(torch.zeros(1, 3, dtype=torch.long), torch.arange(3.0)), TypeError, r"position_ids must hold integers", id="TinyDecoder-float"),
    pytest.param(lambda: SinusoidalEmbedding(4).embed(torch.zeros(1, 3, 4), torch.arange(3.0)), TypeError, r"pos must hold integers", id="embed-float"),
    pytest.param(lambda: causal_mask(torch.zeros(2, 2, 3, dtype=torch.long), P3), ValueError, r"q_pos must have shape \(seq,\) or \(batch, seq\), got \(2, 2, 3\)", id="causal_mask-3d"),
    pytest.param(lambda: causal_mask(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long)), ValueError, r"per-row batch sizes must match, got 2 and 3", id="causal_mask-batches"),
    pytest.param(lambda: alibi_bias(alibi_slopes(4), torch.zeros(1, 1, 3, dtype=torch.long), P3), ValueError, r"q_pos must have shape", id="alibi_bias-3d"),
    pytest.param(lambda: LearnedPositionalEmbedding(8, 4).lookup([8]), IndexError, r"pos must be < 8 \(the table has 8 rows", id="lookup-beyond"),
    pytest.param(lambda: sinusoidal_relative_table(torch.zeros(2, 2, dtype=torch.long), 8), ValueError, r"distances must have shape \(seq,\)", id="distances-2d"),
]


@pytest.mark.parametrize("fn, exc, pattern", POSITION_ARGS)
def test_position_arguments(fn, exc, pattern):
    raises(exc, pattern, fn)


def test_bf16_positions_cannot_unmask_the_future():
    """The issue's example: bf16 positions around 256 round 257 down to 256."""
    pos = torch.arange(250, 260)
    assert torch.equal(causal_mask(pos, pos), torch.ones(10, 10, dtype=torch.bool).tril())
    assert torch.equal(causal_mask(pos.tolist(), pos.tolist()), causal_mask(pos, pos))  # lists of ints


# ----------------------------------------------------------------------------- shapes, edge sizes

SHAPE_CASES = [
    pytest.param(lambda: MultiHeadAttention(16, 4)(torch.randn(2, 5, 12)), ValueError, r"x must have last dimension d_model = 16, got shape \(2, 5, 12\)", id="mha-width"),
    pytest.param(lambda: MultiHeadAttention(16, 4)(torch.randn(5, 16)), ValueError, r"x must have 3 dimensions", id="mha-2d"),
    pytest.param(lambda: shaw_score(torch.randn(1, 2, 5, 4), torch.randn(7, 4), shaw_relative_index(P3, torch.arange(5), 3)), ValueError, r"index must have shape .*q_len = 5, got \(3, 5\)", id="shaw_score-fewer-queries"),
    pytest.param(lambda: shaw_score_naive(torch.randn(1, 2, 5, 4), torch.randn(7, 4), shaw_relative_index(P3, torch.arange(5), 3)), ValueError, r"index must have shape", id="shaw_score_naive-fewer-queries"),
    pytest.param(lambda: shaw_values(torch.rand(1, 2, 5, 5), torch.randn(7, 4), shaw_relative_index(torch.arange(5), P3, 3)), ValueError, r"index must have shape .*k_len = 5, got \(5, 3\)", id="shaw_values-keys"),
    pytest.param(lambda: shaw_values(torch.rand(1, 2, 5, 5), torch.randn(3, 7, 4), shaw_relative_index(torch.arange(5), torch.arange(5), 3)), ValueError, r"table_v has 3 heads, the queries have 2", id="shaw_values-heads"),
    pytest.param(lambda: shaw_values_naive(torch.rand(1, 2, 5, 5), torch.randn(3, 7, 4), shaw_relative_index(torch.arange(5), torch.arange(5), 3)), ValueError, r"table_v has 3 heads", id="shaw_values_naive-heads"),
    pytest.param(lambda: shaw_score(torch.randn(2, 2, 5, 4), torch.randn(7, 4), torch.zeros(3, 5, 5, dtype=torch.long)), ValueError, r"index must have shape .*batch = 2", id="shaw_score-batch"),
    pytest.param(lambda: transformer_xl_score(torch.randn(1, 2, 4, 3), torch.randn(2, 2, 4, 3), torch.randn(2, 4, 3), torch.randn(2, 3), torch.randn(2, 3)), ValueError, r"k must have q's batch, heads and head_dim", id="txl-k-batch"),
    pytest.param(lambda: transformer_xl_score(torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3), [[0.0]], torch.randn(2, 3), torch.randn(2, 3)), TypeError, r"r must be a torch.Tensor", id="txl-r-list"),
    pytest.param(lambda: TransformerXL(4, 8).score(*qkv()[:2], torch.arange(5), torch.arange(6)), ValueError, r"q_pos and k_pos must have q_len = 6 and k_len = 6 entries", id="txl-positions"),
]


@pytest.mark.parametrize("fn, exc, pattern", SHAPE_CASES)
def test_wrong_shapes(fn, exc, pattern):
    raises(exc, pattern, fn)


@pytest.mark.parametrize("b, n", [(0, 5), (2, 0), (0, 0)])
def test_empty_batches_and_sequences(b, n):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, ALiBi(4))
    assert mha(torch.randn(b, n, 16), causal=True).shape == (b, n, 16)
    model = TinyDecoder(20, d_model=16, n_heads=4, n_layers=1, scheme=T5RelativeBias(4))
    assert model(torch.zeros(b, n, dtype=torch.long)).shape == (b, n, 20)
    q, k, v = qkv(b=b, lq=n, lk=n)
    assert attention(q, k, v, ALiBi(4), causal=True).shape == (b, 4, n, 8)
    assert bias_attention(q, k, v, ALiBi(4), causal=True).shape == (b, 4, n, 8)


@pytest.mark.parametrize("naive", [False, True])
def test_shaw_with_value_width_other_than_head_width(naive):
    """attention allows v_dim != head_dim; Shaw's a^V then has v_dim columns."""
    torch.manual_seed(0)
    s = ShawRelative(4, max_distance=2, v_dim=6, naive=naive, init_std=1.0).double()
    q, k, v = qkv(b=1, h=2, lq=5, lk=5, d=4, dv=6, dtype=torch.float64)
    out = attention(q, k, v, s, causal=True)
    assert out.shape == (1, 2, 5, 6)
    # float64 reference, written out term by term (Shaw et al., eqs. 3-5)
    rel = (torch.arange(5)[None, :] - torch.arange(5)[:, None]).clamp(-2, 2) + 2
    ak, av = s.table_k[rel], s.table_v[rel]  # (5, 5, 4), (5, 5, 6)
    logits = (q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, ak)) / 2.0
    logits = logits.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
    w = logits.softmax(-1)
    want = w @ v + torch.einsum("bhij,ijd->bhid", w, av)
    # Float64, both sides: a logit sums 2 * 4 products (q.k and q.a^K) and is scaled, off by at
    # most 10 U64 L_ij with L = |q|.|k| + |q|.|a^K| (over 2); softmax turns that into a relative
    # error of 2 max_j 10 U64 L_ij + 4 U64 on each weight; the output sums 2 * 5 terms of
    # w (|v| + |a^V|) (10 U64 more). Twice that between the two sides.
    with torch.no_grad():
        mag = (q.abs() @ k.abs().transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q.abs(), ak.abs())) / 2.0
        R = U64 * (2 * 10 * mag.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), 0).amax(-1, keepdim=True) + 4)
        vmag = w @ v.abs() + torch.einsum("bhij,ijd->bhid", w, av.abs())
    assert_within(out, want, 2 * vmag * (R + 10 * U64))


def test_score_values_of_the_wrong_width_is_named():
    s = ShawRelative(8, 2)  # a^V is 8 wide, the values 6
    q, k, v = qkv(dv=6)
    raises(ValueError, r"ShawRelative.score_values returned shape \(2, 4, 6, 8\).*\(batch, heads, q_len, v_dim\)",
           lambda: attention(q, k, v, s))


# ----------------------------------------------------------------------------- numeric arguments

NAN, INF = float("nan"), float("inf")
NUMERIC_CASES = [
    pytest.param(lambda: attention(*qkv(), scale=NAN), ValueError, r"scale must be a finite number > 0, got nan", id="attention-scale-nan"),
    pytest.param(lambda: attention(*qkv(), scale=INF), ValueError, r"scale must be a finite number > 0", id="attention-scale-inf"),
    pytest.param(lambda: attention(*qkv(), scale=0.0), ValueError, r"scale must be a finite number > 0, got 0.0", id="attention-scale-0"),
    pytest.param(lambda: attention(*qkv(), scale="1"), TypeError, r"scale must be a finite number > 0, got str", id="attention-scale-str"),
    pytest.param(lambda: bias_attention(*qkv(), scale=NAN), ValueError, r"scale must be a finite number > 0", id="bias_attention-scale-nan"),
    pytest.param(lambda: bias_attention(*qkv(), scale=-1.0), ValueError, r"scale must be a finite number > 0", id="bias_attention-scale-neg"),
    pytest.param(lambda: attention(*qkv(), causal="False"), TypeError, r"causal must be a bool \(True or False\), got str 'False'", id="attention-causal-str"),
    pytest.param(lambda: bias_attention(*qkv(), causal="False"), TypeError, r"causal must be a bool", id="bias_attention-causal-str"),
    pytest.param(lambda: bias_attention(*qkv(), causal=1), TypeError, r"causal must be a bool", id="bias_attention-causal-int"),
    pytest.param(lambda: MultiHeadAttention(16, 4)(torch.randn(1, 3, 16), causal="False"), TypeError, r"causal must be a bool", id="mha-causal-str"),
    pytest.param(lambda: attention(*qkv(), return_weights="yes"), TypeError, r"return_weights must be a bool", id="return_weights-str"),
    pytest.param(lambda: TinyDecoder(10, d_ff=0), ValueError, r"d_ff must be >= 1, got 0", id="TinyDecoder-d_ff-0"),
    pytest.param(lambda: TinyDecoder(10, d_ff=64.0), TypeError, r"d_ff must be an int", id="TinyDecoder-d_ff-float"),
    pytest.param(lambda: TinyDecoder(10, d_model=0), ValueError, r"d_model must be >= 1", id="TinyDecoder-d_model-0"),
    pytest.param(lambda: TinyDecoder(10, tie_weights="no"), TypeError, r"tie_weights must be a bool", id="TinyDecoder-tie-str"),
    pytest.param(lambda: MultiHeadAttention(16, 4, bias="no"), TypeError, r"bias must be a bool", id="mha-bias-str"),
    pytest.param(lambda: MultiHeadAttention(16, 4, scheme="alibi"), TypeError, r"scheme must be a companion PositionScheme", id="mha-scheme-str"),
    pytest.param(lambda: ShawRelative(8, init_std=NAN), ValueError, r"init_std must be a finite number >= 0, got nan", id="shaw-init_std-nan"),
    pytest.param(lambda: ShawRelative(8, init_std="0.02"), TypeError, r"init_std must be a finite number >= 0, got str", id="shaw-init_std-str"),
    pytest.param(lambda: ShawRelative(8, init_std=-0.1), ValueError, r"init_std must be a finite number >= 0", id="shaw-init_std-neg"),
    pytest.param(lambda: ShawRelative(8, naive="False"), TypeError, r"naive must be a bool", id="shaw-naive-str"),
    pytest.param(lambda: ShawRelative(8, v_dim=0), ValueError, r"v_dim must be >= 1", id="shaw-v_dim-0"),
    pytest.param(lambda: TransformerXL(2, 4, init_std=INF), ValueError, r"init_std must be a finite number >= 0", id="txl-init_std-inf"),
    pytest.param(lambda: TransformerXL(2, 4, base="abc"), TypeError, r"base must be a finite number > 1, got str 'abc'", id="txl-base-str"),
    pytest.param(lambda: TransformerXL(2, 4, base=INF), ValueError, r"base must be a finite number > 1, got inf", id="txl-base-inf"),
    pytest.param(lambda: TransformerXL(2, 4, bidirectional="yes"), TypeError, r"bidirectional must be a bool", id="txl-bidirectional-str"),
    pytest.param(lambda: sinusoidal_relative_table(P3, 8, base=INF), ValueError, r"base must be a finite number > 1, got inf", id="rel-table-base-inf"),
    pytest.param(lambda: sinusoidal_relative_table(P3, 8, base="abc"), TypeError, r"base must be a finite number > 1", id="rel-table-base-str"),
    pytest.param(lambda: sinusoidal_relative_table(P3, 8, base=NAN), ValueError, r"base must be a finite number > 1, got nan", id="rel-table-base-nan"),
    pytest.param(lambda: sinusoidal_encoding(P3, 8, base="abc"), TypeError, r"base must be a finite number > 1", id="encoding-base-str"),
    pytest.param(lambda: sinusoidal_table(4, 8, base=1.0), ValueError, r"base must be a finite number > 1, got 1.0", id="table-base-1"),
    pytest.param(lambda: ScaledSinusoidalEmbedding(8, init_scale=NAN), ValueError, r"init_scale must be a finite number, got nan", id="scaled-init_scale-nan"),
    pytest.param(lambda: LearnedPositionalEmbedding(8, 4, init_std=NAN), ValueError, r"init_std must be a finite number >= 0", id="learned-init_std-nan"),
    pytest.param(lambda: LearnedPositionalEmbedding(8, 4, init_std="0.02"), TypeError, r"init_std must be a finite number >= 0", id="learned-init_std-str"),
    pytest.param(lambda: alibi_slopes(4, max_bias=NAN), ValueError, r"max_bias must be a finite number > 0, got nan", id="slopes-max_bias-nan"),
    pytest.param(lambda: ALiBi(4, max_bias="8"), TypeError, r"max_bias must be a finite number > 0, got str", id="alibi-max_bias-str"),
    pytest.param(lambda: ALiBi(4, form=None), ValueError, r"form must be one of \('symmetric', 'causal'\)", id="alibi-form-none"),
    pytest.param(lambda: T5RelativeBias(4, bidirectional="True"), TypeError, r"bidirectional must be a bool", id="t5-bidirectional-str"),
]


@pytest.mark.parametrize("fn, exc, pattern", NUMERIC_CASES)
def test_bad_numeric_and_flag_arguments(fn, exc, pattern):
    raises(exc, pattern, fn)


@pytest.mark.parametrize(
    "value, kwargs, ok",
    [(2, {}, True), (np.float32(0.5), {}, True), (0, {"minimum": 0}, True), (1.0, {"above": 1}, False),
     (-3.0, {"positive": False}, True), (True, {}, False), (None, {}, False), (torch.tensor(1.0), {}, False)],
)
def test_check_finite_number(value, kwargs, ok):
    if ok:
        assert check_finite_number(value, "x", **kwargs) == float(value)
    else:
        with pytest.raises((TypeError, ValueError), match=r"^x must be a finite number"):
            check_finite_number(value, "x", **kwargs)


# ----------------------------------------------------------------------------- dtypes

DTYPE_CASES = [
    pytest.param(lambda: sinusoidal_relative_table(P3, 8, dtype=torch.int64), TypeError, r"dtype must be a floating-point torch.dtype", id="rel-table-int64"),
    pytest.param(lambda: sinusoidal_encoding(P3, 8, dtype=torch.int32), TypeError, r"dtype must be a floating-point torch.dtype", id="encoding-int32"),
    pytest.param(lambda: sinusoidal_table(4, 8, dtype="float16"), TypeError, r"dtype must be a floating-point torch.dtype, got the string 'float16'; pass torch.float16", id="table-str"),
    pytest.param(lambda: MultiHeadAttention(16, 4)(torch.randn(1, 3, 16, dtype=torch.bfloat16)), TypeError, r"x has dtype torch.bfloat16 but the layer's weights are torch.float32", id="mha-bf16"),
    pytest.param(lambda: TinyDecoder(10, 16, 4, 1).loss(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3)), TypeError, r"targets must hold integer token ids", id="loss-float-targets"),
    pytest.param(lambda: TinyDecoder(10, 16, 4, 1).loss(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)), ValueError, r"targets must have idx's shape \(1, 3\)", id="loss-target-shape"),
    pytest.param(lambda: TinyDecoder(10, 16, 4, 1).loss(torch.zeros(1, 3, dtype=torch.long), torch.full((1, 3), 10)), IndexError, r"targets must lie in \[0, 10\) or be -100", id="loss-target-range"),
    pytest.param(lambda: attention(*(t.long() for t in qkv())), ValueError, r"q, k, v must share a floating dtype", id="attention-int"),
    pytest.param(lambda: alibi_bias(torch.tensor([1, 2]), P3, P3), TypeError, r"slopes must be a floating-point tensor", id="slopes-int"),
    pytest.param(lambda: shaw_score(torch.randn(1, 2, 3, 4), torch.ones(5, 4, dtype=torch.long), shaw_relative_index(P3, P3, 2)), TypeError, r"table_k must be a floating-point tensor", id="shaw-table-int"),
]


@pytest.mark.parametrize("fn, exc, pattern", DTYPE_CASES)
def test_bad_dtypes(fn, exc, pattern):
    raises(exc, pattern, fn)


# ----------------------------------------------------------------------------- index tensors

Q = torch.randn(1, 2, 3, 4)
TABLE = torch.randn(5, 4)  # K = 2
INDEX_CASES = [
    pytest.param(lambda f: f(Q, TABLE, torch.full((3, 3), 5)), IndexError, r"index must hold table rows in \[0, 5\) \(the table has 5 rows\), got values in \[5, 5\]", id="beyond"),
    pytest.param(lambda f: f(Q, TABLE, torch.full((3, 3), -1)), IndexError, r"index must hold table rows in \[0, 5\)", id="negative"),
    pytest.param(lambda f: f(Q, TABLE, torch.zeros(3, 3)), TypeError, r"index must hold integers", id="float"),
    pytest.param(lambda f: f(Q, TABLE, None), TypeError, r"index must be an integer tensor", id="none"),
]


@pytest.mark.parametrize("fn, exc, pattern", INDEX_CASES)
@pytest.mark.parametrize("op", ["score", "score_naive", "values", "values_naive"])
def test_bad_index_tensors_never_reach_gather(op, fn, exc, pattern):
    f = {
        "score": shaw_score,
        "score_naive": shaw_score_naive,
        "values": lambda q, t, i: shaw_values(torch.rand(1, 2, 3, 3), t, i),
        "values_naive": lambda q, t, i: shaw_values_naive(torch.rand(1, 2, 3, 3), t, i),
    }[op]
    raises(exc, pattern, lambda: fn(f))


# ----------------------------------------------------------------------------- aliasing


def test_the_same_tensor_as_q_k_and_v():
    x = qkv()[0]
    for fn in (lambda a, b, c: attention(a, b, c, ALiBi(4), causal=True),
               lambda a, b, c: bias_attention(a, b, c, ALiBi(4), causal=True, block_size=4)):
        before = x.clone()
        # exact: the same computation on equal values (aliasing must not change it)
        torch.testing.assert_close(fn(x, x, x), fn(x.clone(), x.clone(), x.clone()), rtol=0, atol=0)
        assert torch.equal(x, before)  # inputs untouched


# ----------------------------------------------------------------------------- NaN propagation

NAN_PATHS = {
    "attention": lambda q, k, v, **kw: attention(q, k, v, ALiBi(2), **kw),
    **{f"bias_attention-{bs}": (lambda bs: lambda q, k, v, **kw: bias_attention(q, k, v, ALiBi(2), block_size=bs, **kw))(bs)
       for bs in (1, 3, 4, 16, (2, 5))},
}


@pytest.mark.parametrize("path", NAN_PATHS)
@pytest.mark.parametrize("where", ["v", "k"])
def test_nan_reaches_only_the_queries_that_see_it(path, where):
    q, k, v = qkv(b=1, h=2, lq=9, lk=9, dtype=torch.float64)
    j = 4
    {"v": v, "k": k}[where][0, :, j, 0] = NAN
    out = NAN_PATHS[path](q, k, v, causal=True)
    bad = out.isnan().any(-1)[0, 0]
    assert bad.tolist() == [i >= j for i in range(9)]  # causal: queries 0..3 cannot see key 4
    # the unaffected queries equal the result without the NaN key: two float64 computations
    # (dense; blockwise over at most 9 key blocks), each within attention_out_bound
    clean = NAN_PATHS["attention"](q, k.nan_to_num(), v.nan_to_num(), causal=True)
    bound = 2 * attention_out_bound(q, k.nan_to_num(), v.nan_to_num(), ALiBi(2).double(), causal=True,
                                    dtype=torch.float64, blocks=9)
    assert_within(out[..., :j, :], clean[..., :j, :], bound[..., :j, :])


@pytest.mark.parametrize("path", NAN_PATHS)
def test_masked_nan_never_arrives(path):
    q, k, v = qkv(b=2, h=2, lq=6, lk=6, dtype=torch.float64)
    v[0, :, 1] = NAN
    k[1, :, 2] = INF
    keep = torch.ones(2, 1, 1, 6, dtype=torch.int64)
    keep[0, ..., 1] = 0
    keep[1, ..., 2] = 0
    out = NAN_PATHS[path](q, k, v, attn_mask=keep)
    assert bool(torch.isfinite(out).all())
    additive = torch.zeros(2, 1, 1, 6, dtype=torch.float64).masked_fill(keep == 0, -INF)
    # two float64 computations of the attention over the kept keys (the masked ones get weight
    # exactly 0), each within attention_out_bound (masked inputs zeroed for the bound)
    kept = keep.bool()[:, :, 0, :, None]
    clean = [t.masked_fill(~kept, 0) for t in (k, v)]
    bound = 2 * attention_out_bound(q, *clean, ALiBi(2).double(), mask=additive, dtype=torch.float64, blocks=6)
    assert_within(NAN_PATHS[path](q, k, v, attn_mask=additive), out, bound)
    # an infinite value that a query sees gives inf, not a silent finite number
    v2 = qkv(b=2, h=2, lq=6, lk=6, dtype=torch.float64)[2]
    v2[0, :, 3, 0] = INF
    assert bool((NAN_PATHS[path](q, k.nan_to_num(posinf=0.0), v2, causal=True)[0, :, 3:, 0] == INF).all())


# ----------------------------------------------------------------------------- files


def test_save_result_serialises_tensors_and_numpy(tmp_path):
    data = {"t": torch.tensor([1.5, 2.0]), "a": np.arange(3), "s": np.float32(0.25), "i": np.int64(7),
            "z": torch.tensor(3), "nested": [torch.ones(2, 2)]}
    path = save_result(tmp_path / "r.json", data, command="test")
    got = load_result(path)["data"]
    assert got == {"t": [1.5, 2.0], "a": [0, 1, 2], "s": 0.25, "i": 7, "z": 3, "nested": [[[1.0, 1.0], [1.0, 1.0]]]}


def test_result_file_errors(tmp_path):
    raises(TypeError, r"save_result cannot serialise a object in data",
           lambda: save_result(tmp_path / "x.json", {"bad": object()}))
    assert not (tmp_path / "x.json").exists()
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    raises(ValueError, r"broken.json is not valid JSON", lambda: load_result(broken))
    other = tmp_path / "other.json"
    other.write_text(json.dumps([1, 2]))
    raises(ValueError, r"other.json is not a result file", lambda: load_result(other))


def test_load_position_table_errors(tmp_path):
    from safetensors.torch import save_file

    from companion.pretrained import load_position_table

    good = tmp_path / "t.safetensors"
    save_file({"w": torch.randn(4, 3)}, str(good))
    assert load_position_table(good, "w", dtype=torch.float64).dtype == torch.float64
    raises(IsADirectoryError, r"is a directory", lambda: load_position_table(tmp_path, "w"))
    pickle = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.randn(4, 3)}, pickle)
    raises(ValueError, r"pytorch_model.bin is not a safetensors file.*reads only the .safetensors format",
           lambda: load_position_table(pickle, "w"))
    raises(TypeError, r"got the string 'float16'; pass torch.float16",
           lambda: load_position_table(good, "w", dtype="float16"))
    raises(TypeError, r"dtype must be a floating-point torch.dtype", lambda: load_position_table(good, "w", dtype=torch.int64))
    raises(FileNotFoundError, r"does not exist", lambda: load_position_table(tmp_path / "missing.safetensors"))


def test_every_public_callable_is_covered():
    """The audit names every public callable of the modules it covers (rope and kernels
    have their own)."""
    covered = {
        "ALiBi", "LearnedPositionalEmbedding", "MultiHeadAttention", "NoPE", "ScaledSinusoidalEmbedding",
        "ShawRelative", "SinusoidalEmbedding", "T5RelativeBias", "TinyDecoder", "TransformerXL", "alibi_bias",
        "alibi_slopes", "attention", "attention_path", "bias_attention", "causal_mask", "fast_attention",
        "load_result", "relative_positions",
        "save_result", "shaw_score", "shaw_values", "sinusoidal_encoding", "sinusoidal_relative_table",
        "sinusoidal_table", "t5_relative_position_bucket", "transformer_xl_score",
    }
    elsewhere = {  # tested in test_rope.py, test_scaling.py, test_model_utils.py, test_absolute.py, test_relative.py,
        # and chapter 11's test_rope_variants.py, test_learned_bias.py, test_cope.py, and
        # chapter 12's test_grid.py, and the fused bias kernel's test_fused_bias.py
        "fused_bias_attention",
        "CoPE", "FIRE", "KerpleBias", "PRoPE", "XPos",
        "GRID_SCHEMES", "AxialRoPE", "LearnedGridEmbedding", "MixedRoPE", "MRoPE", "Sinusoidal2DEmbedding",
        "axial_rope_frequencies", "grid_positions", "grid_rope_angles", "mrope_axis_of_pair", "mrope_cos_sin",
        "qwen2vl_position_ids", "sinusoidal_2d_table",
        "HOOKS", "LAYOUTS", "PositionScheme", "ROPE_TYPES", "RotaryEmbedding", "SCHEMES", "apply_rope",
        "compute_inv_freq", "parse_rope_config", "rope_parameters_from_legacy", "convert_layout",
        "convert_qk_weight", "layout_permutation", "peak_tensor_bytes", "positions_from_mask", "provenance",
        "rel_shift", "rope_cos_sin", "rope_frequencies", "rope_rotate", "rotate_half", "seed_everything",
        "sinusoidal_frequencies", "sinusoidal_wavelengths",
    }
    assert set(companion.__all__) == covered | elsewhere
    assert NoPE().check_heads(7) is None  # a scheme without heads fits any count


# ----------------------------------------------------------------------------- found by tools/audit_inputs.py
#
# The independent audit's cases that were silent or cryptic before they were fixed, one table
# per class. Each case asserts the exception and a message naming the argument.

HUGE = 2**70
META_MASK = torch.empty(6, 6, dtype=torch.bool, device="meta")

AUDIT_ERRORS = [
    # numbers: an int beyond float's range, a size beyond int64 (alibi_slopes used to hang)
    pytest.param(lambda: attention(*qkv(), scale=10**400), ValueError, r"scale must be a finite number > 0, got an int too large for a float", id="scale-10**400"),
    pytest.param(lambda: bias_attention(*qkv(), scale=10**400), ValueError, r"scale must be a finite number > 0", id="bias_attention-scale-10**400"),
    pytest.param(lambda: alibi_slopes(4, max_bias=10**400), ValueError, r"max_bias must be a finite number > 0", id="max_bias-10**400"),
    pytest.param(lambda: sinusoidal_table(4, 8, base=10**400), ValueError, r"base must be a finite number > 1", id="base-10**400"),
    pytest.param(lambda: ShawRelative(4, init_std=10**400), ValueError, r"init_std must be a finite number >= 0", id="init_std-10**400"),
    pytest.param(lambda: alibi_slopes(HUGE), ValueError, r"n_heads must be < 2\*\*63 \(an int64\), got 1180591620717411303424", id="alibi_slopes-n_heads-huge"),
    pytest.param(lambda: ALiBi(HUGE), ValueError, r"n_heads must be < 2\*\*63", id="ALiBi-n_heads-huge"),
    pytest.param(lambda: ShawRelative(HUGE), ValueError, r"head_dim must be < 2\*\*63", id="Shaw-head_dim-huge"),
    pytest.param(lambda: ShawRelative(4, HUGE), ValueError, r"max_distance must be < 2\*\*63", id="Shaw-max_distance-huge"),
    pytest.param(lambda: LearnedPositionalEmbedding(HUGE, 4), ValueError, r"n_positions must be < 2\*\*63", id="learned-n_positions-huge"),
    pytest.param(lambda: TinyDecoder(HUGE, 8, 2, 1), ValueError, r"vocab_size must be < 2\*\*63", id="TinyDecoder-vocab-huge"),
    pytest.param(lambda: t5_relative_position_bucket(P3, True, 32, HUGE), ValueError, r"max_distance must be < 2\*\*63", id="t5-max_distance-huge"),
    pytest.param(lambda: sinusoidal_relative_table(P3, HUGE), ValueError, r"dim must be < 2\*\*63", id="rel-table-dim-huge"),
    pytest.param(lambda: companion.seed_everything(2**64), ValueError, r"seed must be a non-negative int below 2\*\*64", id="seed-2**64"),
    # meta tensors (a shape without data) never reach a copy or an .item()
    pytest.param(lambda: attention(*qkv(), attn_mask=META_MASK), ValueError, r"attn_mask is a meta tensor \(a shape without data\)", id="attention-meta-mask"),
    pytest.param(lambda: bias_attention(*qkv(), attn_mask=META_MASK.long()), ValueError, r"attn_mask is a meta tensor", id="bias_attention-meta-mask"),
    pytest.param(lambda: attention(*(t.to("meta") for t in qkv())), ValueError, r"q is a meta tensor", id="attention-meta-qkv"),
    pytest.param(lambda: bias_attention(*(t.to("meta") for t in qkv())), ValueError, r"q is a meta tensor", id="bias_attention-meta-qkv"),
    pytest.param(lambda: LearnedPositionalEmbedding(8, 4).lookup(torch.zeros(3, dtype=torch.long, device="meta")), ValueError, r"pos is a meta tensor", id="lookup-meta"),
    pytest.param(lambda: causal_mask(P3, torch.zeros(3, dtype=torch.long, device="meta")), ValueError, r"k_pos is a meta tensor", id="causal_mask-meta"),
    # shapes: head_dim 0 used to divide by zero
    pytest.param(lambda: attention(*qkv(d=0)), ValueError, r"q head_dim must be >= 1", id="attention-head_dim-0"),
    pytest.param(lambda: bias_attention(*qkv(d=0)), ValueError, r"q head_dim must be >= 1", id="bias_attention-head_dim-0"),
    # flags and arguments that were never checked
    pytest.param(lambda: LearnedPositionalEmbedding.from_pretrained(torch.zeros(4, 2), freeze="False"), TypeError, r"freeze must be a bool \(True or False\), got str 'False'", id="from_pretrained-freeze-str"),
    pytest.param(lambda: LearnedPositionalEmbedding.from_pretrained(torch.zeros(4, 2), freeze=0), TypeError, r"freeze must be a bool", id="from_pretrained-freeze-0"),
    pytest.param(lambda: LearnedPositionalEmbedding(4, 2, generator="abc"), TypeError, r"generator must be a torch.Generator or None, got str", id="learned-generator-str"),
    pytest.param(lambda: alibi_slopes(4, device="gpu"), ValueError, r"device must be a device such as 'cpu', 'cuda' or 'cuda:0', got 'gpu'", id="alibi_slopes-device-gpu"),
    pytest.param(lambda: alibi_slopes(4, device=3), TypeError, r"device must be a torch.device, a device string", id="alibi_slopes-device-int"),
    pytest.param(lambda: bias_attention(*qkv(), lambda a, b: None, bias_params=torch.zeros(2, 2, requires_grad=True)), TypeError, r"bias_params must be a list or tuple of tensors, got Tensor; wrap a single tensor as \[tensor\]", id="bias_params-tensor"),
    pytest.param(lambda: companion.peak_tensor_bytes("zeros", 4), TypeError, r"fn must be callable, got str", id="peak_tensor_bytes-str"),
    # masks: a float (batch, seq) mask in TinyDecoder would be added to the logits as 0/1
    pytest.param(lambda: TinyDecoder(20, 16, 4, 1)(torch.zeros(2, 6, dtype=torch.long), attn_mask=torch.ones(2, 6)), TypeError, r"a 2-D attn_mask is a \(batch, seq\) padding mask.*must be bool or integer, got dtype torch.float32", id="TinyDecoder-float-2d-mask"),
]


@pytest.mark.parametrize("fn, exc, pattern", AUDIT_ERRORS)
def test_audit_errors(fn, exc, pattern):
    raises(exc, pattern, fn)


AUDIT_VALID = [
    # an empty list is a list of ints (torch reads [] as float32)
    pytest.param(lambda: causal_mask([], [0, 1]), torch.zeros(0, 2, dtype=torch.bool), id="causal_mask-empty-list"),
    pytest.param(lambda: sinusoidal_encoding([], 4), torch.zeros(0, 4), id="sinusoidal_encoding-empty-list"),
    pytest.param(lambda: alibi_bias(alibi_slopes(2), [], [0]), torch.zeros(2, 0, 1), id="alibi_bias-empty-list"),
    # bias_params as a tuple, huge but valid sizes and scales
    pytest.param(lambda: bias_attention(*qkv(b=1, h=2, lq=3, lk=3), None, bias_params=()),
                 attention(*qkv(b=1, h=2, lq=3, lk=3)), id="bias_params-empty-tuple"),
    pytest.param(lambda: companion.seed_everything(2**64 - 1).initial_seed(), 2**64 - 1, id="seed-2**64-1"),
]


@pytest.mark.parametrize("fn, want", AUDIT_VALID)
def test_audit_valid_edge_inputs(fn, want):
    got = fn()
    if isinstance(want, torch.Tensor) and want.is_floating_point() and want.numel():
        # the one non-empty float case: blockwise and dense float32 attention, each within
        # helpers.attention_out_bound of the exact attention (one key block)
        bound = 2 * attention_out_bound(*qkv(b=1, h=2, lq=3, lk=3))
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_within(got, want, bound)
    elif isinstance(want, torch.Tensor):  # empty or bool: exact
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        assert got == want


def test_loss_takes_int32_targets():
    torch.manual_seed(0)
    model = TinyDecoder(10, 8, 2, 1)
    idx = torch.zeros(1, 3, dtype=torch.long)
    targets = torch.tensor([[1, 2, -100]])
    # exact: int32 targets are widened to int64 before the loss, the same computation
    torch.testing.assert_close(model.loss(idx, targets.int()), model.loss(idx, targets), rtol=0, atol=0)


def test_from_pretrained_freeze_flag():
    assert not LearnedPositionalEmbedding.from_pretrained(torch.zeros(4, 2), freeze=True).weight.requires_grad
    assert LearnedPositionalEmbedding.from_pretrained(torch.zeros(4, 2), freeze=False).weight.requires_grad


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_results_files_odd_data(tmp_path):
    nested = torch.nested.nested_tensor([torch.ones(2), torch.zeros(1)])
    path = save_result(tmp_path / "r.json", {"nested": nested, "nan": float("nan"), "inf": [float("inf")]})
    got = load_result(path)["data"]
    assert got["nested"] == [[1.0, 1.0], [0.0]] and math.isnan(got["nan"]) and got["inf"] == [math.inf]
    circular: list = []
    circular.append(circular)
    cases = [
        (lambda: save_result(tmp_path / "k.json", {1: "a"}), TypeError, r"save_result needs string keys in data .*got the int key 1 in data; use str\(key\)"),
        (lambda: save_result(tmp_path / "k.json", {"a": [{(1, 2): 3}]}), TypeError, r"got the tuple key \(1, 2\) in data\['a'\]\[0\]"),
        (lambda: save_result(tmp_path / "c.json", circular), ValueError, r"save_result cannot serialise data: Circular reference"),
        (lambda: save_result(tmp_path, {"a": 1}), IsADirectoryError, r"path .* is a directory"),
        (lambda: save_result(None, {"a": 1}), TypeError, r"path must be a path \(a str or a pathlib.Path\), got NoneType"),
        (lambda: save_result(tmp_path / "r.json" / "x.json", {"a": 1}), NotADirectoryError, r"path .* lies under .*r.json, which is a file"),
        (lambda: save_result(tmp_path / "x.json", 1, command=object()), TypeError, r"command must be a str or None, got object"),
        (lambda: load_result(tmp_path), IsADirectoryError, r"path .* is a directory"),
        (lambda: load_result(tmp_path / "missing.json"), FileNotFoundError, r"path .*missing.json does not exist"),
        (lambda: load_result(3), TypeError, r"path must be a path"),
    ]
    for fn, exc, pattern in cases:
        raises(exc, pattern, fn)
    assert not (tmp_path / "k.json").exists() and not (tmp_path / "c.json").exists() and not (tmp_path / "x.json").exists()
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    raises(ValueError, r"binary.json is not valid JSON", lambda: load_result(binary))


def test_pretrained_argument_types(tmp_path):
    from safetensors.torch import save_file

    from companion import pretrained

    good = tmp_path / "t.safetensors"
    save_file({"w": torch.randn(4, 3)}, str(good))
    cached = pretrained.cached_model_path(tmp_path)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"x")
    no_wheels = dict(no_index=True, find_links=str(tmp_path))
    cases = [
        (lambda: pretrained.load_position_table(good, 5), TypeError, r"key must be the str name of a tensor in the file, got int"),
        (lambda: pretrained.load_position_table(good, "w", expected_shape=4), TypeError, r"expected_shape must be a pair of ints"),
        (lambda: pretrained.load_position_table(good, "w", expected_shape="43"), TypeError, r"expected_shape must be a pair of ints"),
        (lambda: pretrained.load_position_table(good, "w", expected_shape=(4, 3, 1)), TypeError, r"expected_shape must be a pair of ints"),
        (lambda: pretrained.load_position_table(None), TypeError, r"path must be a path"),
        (lambda: pretrained.cached_model_path(5), TypeError, r"cache must be a path"),
        (lambda: pretrained.find_model(5), TypeError, r"cache must be a path"),
        (lambda: pretrained.fetch(tmp_path, force="False", **no_wheels), TypeError, r"force must be a bool"),
        (lambda: pretrained.fetch(tmp_path, no_index="yes"), TypeError, r"no_index must be a bool"),
        (lambda: pretrained.fetch(tmp_path, expected_sha256=5, **no_wheels), TypeError, r"expected_sha256 must be a str or None"),
    ]
    for fn, exc, pattern in cases:
        raises(exc, pattern, fn)
    assert pretrained.load_position_table(good, "w", expected_shape=[4, 3]).shape == (4, 3)
    assert pretrained.fetch(tmp_path, force=False, **no_wheels) == cached  # cached: pip never runs
