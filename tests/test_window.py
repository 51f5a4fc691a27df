"""Sliding-window and chunked attention (issue 27): the ``window`` and ``chunk`` arguments of
the reference :func:`companion.attention.attention`, of :func:`companion.dispatch.fast_attention`
on each of its paths, and of the blockwise functions.

The convention is HuggingFace's (transformers' ``masking_utils``): with ``causal=True``, window
``W`` lets query ``i`` see keys ``i - W < j <= i`` (``sliding_window_overlay``: ``kv_idx > q_idx
- W``), chunk ``C`` the keys ``j <= i`` with ``j // C == i // C`` (``chunked_overlay``), by
position. The reference is checked against masks built from transformers' own mask functions
(when installed) and from the formula, every fast path against the reference, forward and
backward, with the tolerance of tests/test_dispatch.py (float64).
"""

from __future__ import annotations

import pytest
import torch

from companion import ALiBi, NoPE, RotaryEmbedding, ShawRelative, T5RelativeBias, TransformerXL, attention
from companion import blockwise, dispatch
from companion.blockwise import bias_attention, fused_bias_attention
from companion.dispatch import attention_path, fast_attention
from helpers import rand

B, H, D = 2, 4, 8


def bound(length: int, magnitude: float = 4.0) -> float:
    """tests/test_dispatch.py's ``C (d + 2 L) eps m``, float64."""
    return 8 * (D + 2 * length) * torch.finfo(torch.float64).eps * magnitude


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    """The visibility the docstrings state, written out: ``(q_len, k_len)`` bool."""
    i, j = q_pos[:, None], k_pos[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & (j > i - window)
    if chunk is not None:
        ok = ok & (j // chunk == i // chunk)
    return ok


def make(name: str):
    torch.manual_seed(0)
    return {"nope": NoPE, "rope": lambda: RotaryEmbedding(D), "alibi": lambda: ALiBi(H),
            "t5": lambda: T5RelativeBias(H, num_buckets=8, max_distance=20, bidirectional=False).double(),
            "xl": lambda: TransformerXL(H, D, init_std=0.5).double(),
            "shaw": lambda: ShawRelative(D, max_distance=3, init_std=0.5).double()}[name]()


def inputs(lq: int, lk: int, hk: int = H, seed: int = 0):
    q = rand(B, H, lq, D, seed=seed + 1).requires_grad_()
    k = rand(B, hk, lk, D, seed=seed + 2).requires_grad_()
    v = rand(B, hk, lk, D, seed=seed + 3).requires_grad_()
    return q, k, v


def outputs_and_grads(fn, scheme, q, k, v, **kw):
    params = [q, k, v] + [p for p in scheme.parameters() if p.requires_grad]
    out = fn(q, k, v, scheme, **kw)
    grads = torch.autograd.grad(out, params, rand(*out.shape, seed=9))
    return out.detach(), grads


# ----------------------------------------------------------------------------- the convention


@pytest.mark.parametrize("window, chunk", [(1, None), (5, None), (None, 4), (None, 1), (6, 4)])
def test_reference_equals_an_explicit_mask(window, chunk):
    """The reference with ``window``/``chunk`` equals the reference with the stated mask as
    ``attn_mask`` (bit for bit: the same logits are masked), decode positions included."""
    q, k, v = inputs(5, 23)
    k_pos = torch.arange(7, 30)
    q_pos = k_pos[-5:]
    got = attention(q, k, v, ALiBi(H), q_pos, k_pos, causal=True, window=window, chunk=chunk)
    want = attention(q, k, v, ALiBi(H), q_pos, k_pos, causal=True, attn_mask=allowed(q_pos, k_pos, window, chunk))
    assert torch.equal(got, want)
    if window == 1:  # each query sees itself only: its own value
        assert torch.allclose(got, v[:, :, -5:], rtol=0, atol=1e-15)


def test_the_convention_is_transformers():
    """The stated rule is transformers' sliding_window_causal_mask_function and
    chunked_causal_mask_function (no left padding), entry for entry."""
    mu = pytest.importorskip("transformers.masking_utils", reason="the hf extra is not installed")
    n = 19
    idx = torch.arange(n)
    b0 = torch.zeros((), dtype=torch.long)
    for w in (1, 3, 8):
        theirs = mu.sliding_window_causal_mask_function(w)(b0, b0, idx[:, None], idx[None, :])
        assert torch.equal(theirs, allowed(idx, idx, w, None))
    for c in (1, 4, 7):
        theirs = mu.chunked_causal_mask_function(c, torch.zeros(1, dtype=torch.long))(b0, b0, idx[:, None], idx[None, :])
        assert torch.equal(theirs, allowed(idx, idx, None, c))


@pytest.mark.parametrize("fn", [attention, fast_attention, attention_path, bias_attention, fused_bias_attention],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("kw, error, match", [
    (dict(window=0, causal=True), ValueError, r"window must be >= 1, got 0"),
    (dict(window=True, causal=True), TypeError, r"window must be an int, got bool"),
    (dict(window=2.0, causal=True), TypeError, r"window must be an int, got float"),
    (dict(chunk=-3, causal=True), ValueError, r"chunk must be >= 1, got -3"),
    (dict(chunk="4", causal=True), TypeError, r"chunk must be an int, got str"),
    (dict(window=4), ValueError, r"window=4 needs causal=True"),
    (dict(chunk=4, causal=False), ValueError, r"chunk=4 needs causal=True"),
])
def test_bad_window_or_chunk(fn, kw, error, match):
    q, k, v = inputs(6, 6)
    with pytest.raises(error, match=match):
        fn(q, k, v, **kw)


# ----------------------------------------------------------------------------- every path


# (q_len, k_len, kv_heads, k_pos start, mask)
SHAPES = {
    "self": (70, 70, H, 0, None),
    "offset-gqa": (70, 70, 2, 13, None),
    "decode": (6, 70, H, 5, None),
    "padding": (70, 70, H, 0, "padding"),
}
FORCINGS = {
    "default": {},
    "sdpa": dict(SDPA_BIAS_PAIRS=1 << 40, SDPA_GRAD_BIAS_PAIRS=1 << 40),
    "blockwise": dict(SDPA_BIAS_PAIRS=0, SDPA_GRAD_BIAS_PAIRS=0),
}


@pytest.mark.parametrize("forcing", list(FORCINGS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("window, chunk", [(9, None), (None, 16), (20, 16)], ids=["w9", "c16", "w20c16"])
@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5"])
def test_fast_attention_matches_the_reference(name, window, chunk, shape, forcing, monkeypatch):
    """Forward and backward (q, k, v and T5's table) on the path the dispatcher takes, with
    the thresholds forced to each side: the SDPA masks and the block path (which skips the
    key blocks outside the window or the chunk)."""
    for key, value in FORCINGS[forcing].items():
        monkeypatch.setattr(dispatch, key, value)
    lq, lk, hk, start, mask_kind = SHAPES[shape]
    scheme = make(name)
    q, k, v = inputs(lq, lk, hk)
    k_pos = torch.arange(start, start + lk)
    q_pos = k_pos[lk - lq:]
    mask = None
    if mask_kind == "padding":
        mask = torch.ones(B, 1, 1, lk, dtype=torch.bool)
        mask[0, ..., :11] = False
    kw = dict(q_pos=q_pos, k_pos=k_pos, causal=True, attn_mask=mask, window=window, chunk=chunk)
    path = attention_path(q, k, v, scheme, **kw)
    assert path != "sdpa-causal"  # is_causal alone ignores the window
    if forcing == "blockwise":
        assert path == "blockwise"
    ref, ref_grads = outputs_and_grads(attention, scheme, q, k, v, **kw)
    out, grads = outputs_and_grads(fast_attention, scheme, q, k, v, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=bound(lk))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=bound(lk) * max(1.0, float(r.abs().max())) * 2)
    full = attention(q, k, v, scheme, q_pos, k_pos, causal=True, attn_mask=mask).detach()
    assert float((full - ref).abs().max()) > 1e-3  # not vacuous: the window changes the result


@pytest.mark.parametrize("window, chunk", [(30, None), (None, 100), (300, 64)])
@pytest.mark.parametrize("name", ["xl", "shaw"])
def test_query_blocks_honour_the_window(name, window, chunk):
    """The score schemes' evaluation path (no gradient, blocks of QUERY_BLOCK queries, each
    against the keys from the window's start): the reference's output."""
    n = dispatch.QUERY_BLOCK * 2 + 37
    scheme = make(name)
    q, k, v = (t.detach() for t in inputs(n, n, 2))
    with torch.no_grad():
        kw = dict(causal=True, window=window, chunk=chunk, q_pos=torch.arange(3, 3 + n), k_pos=torch.arange(3, 3 + n))
        assert attention_path(q, k, v, scheme, **kw) == "query-blocks"
        out = fast_attention(q, k, v, scheme, **kw)
        ref = attention(q, k, v, scheme, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=bound(n, float(ref.abs().max()) + 4))


def test_the_block_path_skips_keys_outside_the_window(monkeypatch):
    """With a window W the block path's kernel calls get at most W + 2 blocks - 2 keys each
    (the blocks that hold any visible key), not every key up to the diagonal."""
    seen = []
    real = blockwise._FLASH_FWD

    def spy(q, k, v, *args, **kw):
        seen.append(k.shape[2])
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(blockwise, "_FLASH_FWD", spy)
    n, w, blk = 400, 50, 32
    q, k, v = (t.detach() for t in inputs(n, n))
    with torch.no_grad():
        out = fused_bias_attention(q, k, v, ALiBi(H), causal=True, window=w, block_size=blk)
        ref = attention(q, k, v, ALiBi(H), causal=True, window=w)
    torch.testing.assert_close(out, ref, rtol=0, atol=bound(n))
    assert len(seen) == -(-n // blk) and max(seen) <= w + 2 * blk - 2


def test_sdpa_paths_with_a_window(monkeypatch):
    """No bias: "sdpa-mask" (a bool mask) up to SDPA_BIAS_PAIRS pairs, the block path past
    them; a bias: "sdpa-bias" within its threshold. Never "sdpa-causal"."""
    q, k, v = (t.detach() for t in inputs(12, 12))
    monkeypatch.setattr(dispatch, "SDPA_BIAS_PAIRS", 144)
    for scheme in (NoPE(), RotaryEmbedding(D)):
        assert attention_path(q, k, v, scheme, causal=True) == "sdpa-causal"
        assert attention_path(q, k, v, scheme, causal=True, window=3) == "sdpa-mask"
        assert attention_path(q, k, v, scheme, causal=True, chunk=3) == "sdpa-mask"
    assert attention_path(q, k, v, ALiBi(H), causal=True, window=3) == "sdpa-bias"
    monkeypatch.setattr(dispatch, "SDPA_BIAS_PAIRS", 143)
    for scheme in (NoPE(), RotaryEmbedding(D), ALiBi(H)):
        assert attention_path(q, k, v, scheme, causal=True, window=3) == "blockwise"


def test_cache_keeps_windows_apart(monkeypatch):
    """Local and global layers may share one cache: each window gets its own mask."""
    monkeypatch.setattr(dispatch, "SDPA_BIAS_PAIRS", 1 << 20)
    q, k, v = (t.detach() for t in inputs(12, 12))
    cache: dict = {}
    scheme = ALiBi(H)
    outs = [fast_attention(q, k, v, scheme, causal=True, window=w, cache=cache) for w in (None, 3, None, 3)]
    assert len(cache) == 2
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    torch.testing.assert_close(outs[1], attention(q, k, v, scheme, causal=True, window=3), rtol=0, atol=bound(12))


@pytest.mark.parametrize("block", [16, (16, 16), 5])
def test_bias_attention_tiles_honour_the_window(block):
    """The explicit tile loop (bias_attention) with window and chunk, forward and backward."""
    scheme = make("t5")
    q, k, v = inputs(70, 70)
    for window, chunk in ((9, None), (None, 16), (20, 16)):
        kw = dict(causal=True, window=window, chunk=chunk)
        ref, ref_grads = outputs_and_grads(attention, scheme, q, k, v, **kw)
        out, grads = outputs_and_grads(lambda *a, **k_: bias_attention(*a, block_size=block, **k_), scheme, q, k, v,
                                       **kw)
        torch.testing.assert_close(out, ref, rtol=0, atol=bound(70))
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=0, atol=bound(70) * max(1.0, float(r.abs().max())) * 2)
