"""Attention masks as HuggingFace users pass them, on every path that takes a mask.

A tokenizer's ``attention_mask`` is ``(batch, seq)``; torch reads a 2-D mask as ``(q_len,
k_len)``. Where the shape cannot tell the two apart (``batch = q_len``) the mask is refused
with both 4-D forms; a ``(batch, k_len)`` mask is refused with the conversion; a float mask
of only 0.0 and 1.0 (a keep-mask in the wrong dtype) is refused. Valid masks give the result
of removing the masked keys by hand. See the book page *Conventions and errors*.
"""

from __future__ import annotations

import math

import pytest
import torch

from companion import (
    FIRE,
    ALiBi,
    KerpleBias,
    MixedRoPE,
    MultiHeadAttention,
    NoPE,
    RotaryEmbedding,
    ShawRelative,
    T5RelativeBias,
    TinyDecoder,
    attention,
    bias_attention,
    dispatch,
    fast_attention,
    grid_positions,
)
from companion.dispatch import attention_path
from helpers import rand

H, D = 2, 8

AMBIGUOUS = (r"attn_mask has shape \(4, 4\), which is both \(batch, k_len\), a HuggingFace padding mask, "
             r"and \(q_len, k_len\).*batch = q_len = 4 cannot tell them apart.*"
             r"attn_mask\[:, None, None, :\] for a \(batch, k_len\) padding mask.*"
             r"attn_mask\[None, None\] for a \(q_len, k_len\) mask")
FLOAT_KEEP = (r"attn_mask is a float mask holding only 0.0 and 1.0, which looks like a keep-mask.*"
              r"pass a bool mask \(attn_mask.bool\(\), True = attend\) or an additive float mask with -inf")


def hf_message(b, lq, lk):
    return (rf"attn_mask has shape \({b}, {lk}\) = \(batch, k_len\), which looks like a HuggingFace "
            rf"padding mask.*read as \(q_len, k_len\) = \({lq}, {lk}\); pass attn_mask\[:, None, None, :\]")


def qkv(b, lq, lk=None, seed=0):
    lk = lq if lk is None else lk
    return rand(b, H, lq, D, seed=seed), rand(b, H, lk, D, seed=seed + 1), rand(b, H, lk, D, seed=seed + 2)


def seeded(cls, *args):
    """``cls(*args)`` with the same random initial parameters on every call."""
    torch.manual_seed(0)
    return cls(*args)


# Every function and dispatcher path that takes an attn_mask: (function, scheme factory, the
# path fast_attention must take with a padding mask, dispatcher constants to force it). The
# dispatcher's "sdpa-causal" and "query-blocks" paths take no attn_mask (a mask sends the
# call elsewhere); the validation runs before any path is chosen.
ENTRIES = {
    "attention": (attention, NoPE, None, {}),
    "attention-alibi": (attention, lambda: ALiBi(H), None, {}),
    "bias_attention": (lambda q, k, v, scheme, q_pos, k_pos, **kw: bias_attention(
        q, k, v, scheme, q_pos=q_pos, k_pos=k_pos, block_size=2, **kw), lambda: ALiBi(H), None, {}),
    "fast-sdpa-mask": (fast_attention, lambda: RotaryEmbedding(D), "sdpa-mask", {}),
    "fast-sdpa-bias": (fast_attention, lambda: ALiBi(H), "sdpa-bias", {}),
    "fast-blockwise": (fast_attention, lambda: ALiBi(H), "blockwise", {"SDPA_BIAS_PAIRS": 0}),
    "fast-reference": (fast_attention, lambda: seeded(ShawRelative, D), "reference", {}),
}


def call(entry, q, k, v, mask, q_pos=None, k_pos=None, causal=False):
    fn, make_scheme, _, forcing = ENTRIES[entry]
    with pytest.MonkeyPatch.context() as mp:
        for name, value in forcing.items():
            mp.setattr(dispatch, name, value)
        return fn(q, k, v, make_scheme(), q_pos, k_pos, causal=causal, attn_mask=mask)


def padding(b=3, lk=5):
    """Row 0 left-padded by two keys, row 1 right-padded by one, the others unpadded."""
    keep = torch.ones(b, lk, dtype=torch.bool)
    keep[0, :2] = False
    if b > 1:
        keep[1, -1] = False
    return keep


# ----------------------------------------------------------------------------- bad 2-D masks


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_ambiguous_2d_mask_is_refused(entry, dtype):
    q, k, v = qkv(4, 4)  # batch = q_len = k_len: (4, 4) is (batch, k_len) and (q_len, k_len)
    mask = padding(4, 4).to(dtype)
    with pytest.raises(ValueError, match=AMBIGUOUS):
        call(entry, q, k, v, mask)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
@pytest.mark.parametrize("lq", [5, 1], ids=["prefill", "decode"])
def test_batch_by_keys_2d_mask_is_refused_as_a_padding_mask(entry, dtype, lq):
    q, k, v = qkv(3, lq, 5)
    with pytest.raises(ValueError, match=hf_message(3, lq, 5)):
        call(entry, q, k, v, padding(3, 5).to(dtype))


@pytest.mark.parametrize("entry", ENTRIES)
def test_batch_one_2d_mask_reads_the_same_both_ways(entry):
    """(1, k_len) is (batch, k_len) and a broadcast (q_len, k_len) row: one result, accepted."""
    for lq in (5, 1):
        q, k, v = qkv(1, lq, 5)
        keep = padding(1, 5)
        got = call(entry, q, k, v, keep)
        torch.testing.assert_close(got, call(entry, q, k, v, keep[:, None, None, :]), rtol=0, atol=0)


@pytest.mark.parametrize("entry", ENTRIES)
def test_3d_batch_mask_gets_the_conversion(entry):
    q, k, v = qkv(3, 5)
    mask = torch.ones(3, 5, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"a 3-D mask is read as \(heads, q_len, k_len\): pass attn_mask\[:, None\]"):
        call(entry, q, k, v, mask)


# ----------------------------------------------------------------------------- float masks


FLOAT_KEEP_MASKS = {
    "padding-4d": lambda: padding().double()[:, None, None, :],
    "query-key-2d": lambda: torch.eye(5, dtype=torch.float64) + torch.ones(5, 5).triu(1).double(),
    "all-ones": lambda: torch.ones(1, 1, 5, 5, dtype=torch.float32),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("mask", FLOAT_KEEP_MASKS)
def test_float_zero_one_mask_is_refused(entry, mask):
    q, k, v = qkv(3, 5)
    with pytest.raises(ValueError, match=FLOAT_KEEP):
        call(entry, q, k, v, FLOAT_KEEP_MASKS[mask]())


@pytest.mark.parametrize("entry", ENTRIES)
def test_additive_float_masks_are_accepted(entry):
    q, k, v = qkv(3, 5)
    plain = call(entry, q, k, v, None)
    # all zeros: a valid additive mask that changes nothing
    torch.testing.assert_close(call(entry, q, k, v, torch.zeros(3, 1, 1, 5, dtype=torch.float64)), plain,
                               rtol=0, atol=1e-12)
    # 1.0 on kept keys, -inf on padded ones: not a 0/1 mask; a constant per row cancels in the
    # softmax, so it equals the bool mask
    keep = padding()[:, None, None, :]
    shifted = torch.full(keep.shape, float("-inf"), dtype=torch.float64).masked_fill(keep, 1.0)
    torch.testing.assert_close(call(entry, q, k, v, shifted), call(entry, q, k, v, keep), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- valid masks


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("form", ["bool", "int64", "additive"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_4d_padding_mask_equals_removing_the_keys(entry, form, causal):
    b, n = 3, 5
    q, k, v = qkv(b, n)
    keep = padding(b, n)
    mask = {"bool": keep, "int64": keep.long(),
            "additive": torch.zeros(b, n, dtype=torch.float64).masked_fill(~keep, float("-inf"))}[form]
    mask = mask[:, None, None, :]
    pos = torch.arange(n)
    expected_path = ENTRIES[entry][2]
    if expected_path is not None:  # the case really runs on that dispatcher path
        with pytest.MonkeyPatch.context() as mp:
            for name, value in ENTRIES[entry][3].items():
                mp.setattr(dispatch, name, value)
            assert attention_path(q, k, v, ENTRIES[entry][1](), pos, pos, causal=causal, attn_mask=mask) == expected_path
    got = call(entry, q, k, v, mask, pos, pos, causal=causal)
    for r in range(b):
        row = keep[r]
        by_hand = call(entry, q[r:r + 1], k[r:r + 1, :, row], v[r:r + 1, :, row], None, pos, pos[row], causal=causal)
        # float64, at most 5 keys per softmax: rounding is ~1e-15
        torch.testing.assert_close(got[r:r + 1], by_hand, rtol=0, atol=1e-12)
    # the mask matters: row 0's first keys are padding
    assert not torch.allclose(got[0], call(entry, q, k, v, None, pos, pos, causal=causal)[0], atol=1e-3)


@pytest.mark.parametrize("entry", ENTRIES)
def test_query_key_2d_mask_keeps_torchs_reading(entry):
    """A (q_len, k_len) 2-D mask with batch != q_len is read as torch reads it: mask[None, None]."""
    q, k, v = qkv(3, 5)
    keep = rand(5, 5, seed=7) > -0.3
    keep[:, 0] = True
    got = call(entry, q, k, v, keep)
    assert torch.equal(got, call(entry, q, k, v, keep[None, None]))
    assert not torch.allclose(got, call(entry, q, k, v, None), atol=1e-3)
    if entry == "attention":  # NoPE: exactly torch's scaled_dot_product_attention
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- the module


def mha_by_hand(mha, x, keep):
    """Self-attention of ``mha`` (NoPE) with the padded keys removed, written out."""
    b, n, dm = x.shape
    split = lambda t: t.view(b, n, H, dm // H).transpose(1, 2)  # noqa: E731
    q, k, v = split(mha.q_proj(x)), split(mha.k_proj(x)), split(mha.v_proj(x))
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(dm // H)
    weights = logits.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1)
    return mha.o_proj((weights @ v).transpose(1, 2).reshape(b, n, dm))


@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_multi_head_attention_masks(impl):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, H, attention_impl=impl).double()
    x = rand(3, 5, 16)
    keep = padding(3, 5)
    with pytest.raises(ValueError, match=hf_message(3, 5, 5)):
        mha(x, attn_mask=keep)
    with pytest.raises(ValueError, match=AMBIGUOUS):
        mha(rand(4, 4, 16), attn_mask=padding(4, 4).long())
    with pytest.raises(ValueError, match=FLOAT_KEEP):
        mha(x, attn_mask=keep.double()[:, None, None, :])
    with torch.no_grad():
        torch.testing.assert_close(mha(x, attn_mask=torch.zeros(5, 5, dtype=torch.float64)), mha(x),
                                   rtol=0, atol=1e-12)
        got = mha(x, attn_mask=keep[:, None, None, :])
        torch.testing.assert_close(got, mha_by_hand(mha, x, keep), rtol=0, atol=1e-12)
        assert not torch.allclose(got[0], mha(x)[0], atol=1e-3)
        square = rand(5, 5, seed=3) > -0.3
        square[:, 0] = True
        assert torch.equal(mha(x, attn_mask=square), mha(x, attn_mask=square[None, None]))


def test_tiny_decoder_refuses_a_float_keep_mask():
    """TinyDecoder reads a 2-D mask as (batch, seq) itself; a 4-D mask follows the rules above."""
    model = TinyDecoder(20, d_model=16, n_heads=H, n_layers=1)
    idx = torch.randint(0, 20, (3, 5))
    with pytest.raises(ValueError, match=FLOAT_KEEP):
        model(idx, attn_mask=padding(3, 5).float()[:, None, None, :])


# ----------------------------------------------------------------------------- the layout mistake


@pytest.mark.parametrize("fn", [attention, fast_attention], ids=["attention", "fast_attention"])
def test_batch_seq_heads_layout_is_caught_by_schemes_that_know_their_head_count(fn):
    """q in (batch, seq, heads, dim) reads seq as the head count: schemes with per-head state
    refuse it (seq != heads), as do positions or a padding mask of length seq."""
    b, s, h, d = 2, 10, 4, 16
    q = rand(b, s, h, d).float()
    heads_error = rf"was built for {h} heads but the queries have {s} heads"
    for scheme, pos in ((ALiBi(h), None), (T5RelativeBias(h), None), (KerpleBias(h), None), (FIRE(h), None),
                        (MixedRoPE(d, h), grid_positions((2, 2)))):
        with pytest.raises(ValueError, match=heads_error):
            fn(q, q, q, scheme, pos, pos, causal=True)
    with pytest.raises(ValueError, match=r"q_pos must have shape \(4,\) or \(2, 4\), got \(10,\)"):
        fn(q, q, q, RotaryEmbedding(d), torch.arange(s), torch.arange(s))
    with pytest.raises(ValueError, match=r"attn_mask shape \(2, 1, 1, 10\) must broadcast"):
        fn(q, q, q, RotaryEmbedding(d), attn_mask=torch.ones(b, 1, 1, s, dtype=torch.bool))
