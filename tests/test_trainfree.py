"""companion.trainfree: ReRoPE, Leaky ReRoPE, Self-Extend and attention sinks; and their
evaluation on the lab's TinyDecoder (companion.lab.trainfree_lab).

Every method is checked against a dense formula written here, in float64 on small sizes with
grouped-query heads: the full ``L x L`` logits from the *relative* positions of the method
(``min(i - j, w)``, ``w + (i - j - w) / k``, ``i // G - j // G + w - w // G``), through the
RoPE identity ``q_rot(a) . k_rot(b) = sum_p c_p (q1 k1 + q2 k2) + s_p (q1 k2 - q2 k1)`` with
``c_p, s_p = cos, sin((a - b) theta_p)``; and, for the sink cache, against a token-by-token
loop that appends, attends and trims as StreamingLLM's evaluation does. Inference only:
everything runs under ``torch.no_grad()``.
"""

import math

import numpy as np
import pytest
import torch

from companion import trainfree as tf
from companion.attention import attention
from companion.lab import trainfree_lab as tl
from companion.lab.evaluate import bits_per_byte
from companion.model import TinyDecoder
from companion.rope import RotaryEmbedding


# Tolerance of float64 against the dense float64 formula. Logits are sums of d <= 16 products
# of O(1) entries (|q|, |k| ~ 4), so each carries an error of a few d * 2**-53 * |q||k| ~ 1e-13;
# the softmax and the sum over <= 64 values add a few more roundings of O(1) numbers. 1e-11
# is ~100x that, and ~1e5x below the smallest real difference between the methods below.
TOL64 = 1e-11

# The lab's losses are float32 cross entropies of float32 logits (as bits_per_byte computes
# them). Logits equal to ~1e-13 in float64 can round to neighbouring float32 values, and a
# float32 log-softmax over 256 classes of logits ~10 carries a few u32 * (|logit| + log 256)
# ~ 1e-6 nats; 1e-5 is a 10x margin.
BITS32 = 1e-5


def _inv_freq64(rope: RotaryEmbedding) -> torch.Tensor:
    """The float64 frequencies the rope uses for float64 inputs (recomputed from the base)."""
    r = rope.rotary_dim
    if rope.base is not None:
        return rope.base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    return rope.inv_freq.double()


def _pairs(x: torch.Tensor, layout: str, r: int):
    if layout == "half":
        return x[..., : r // 2], x[..., r // 2 : r]
    return x[..., 0:r:2], x[..., 1:r:2]


def dense_relative(q, k, v, rope, rel, *, q_start=None):
    """softmax(scale * logits + causal) v with logits[i, j] = q_i . R(rel[i, j]) k_j, in float64.

    ``rel`` is the (q_len, k_len) matrix of relative positions (float64); the queries are the
    last q_len keys. GQA: query head h reads key head h // (heads // kv_heads)."""
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    g = h // hk
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    r, s = rope.rotary_dim, rope.attention_scaling
    q1, q2 = _pairs(q, rope.layout, r)
    k1, k2 = _pairs(kk, rope.layout, r)
    angle = rel[..., None] * _inv_freq64(rope)  # (lq, lk, r/2)
    c, sn = angle.cos() * s * s, angle.sin() * s * s
    dot = torch.einsum("bhip,bhjp->bhijp", q1, k1) + torch.einsum("bhip,bhjp->bhijp", q2, k2)
    cross = torch.einsum("bhip,bhjp->bhijp", q1, k2) - torch.einsum("bhip,bhjp->bhijp", q2, k1)
    logits = (dot * c + cross * sn).sum(-1)
    if r < d:  # unrotated dimensions
        logits = logits + q[..., r:] @ kk[..., r:].transpose(-1, -2)
    logits = logits / math.sqrt(d)
    start = lk - lq if q_start is None else q_start
    i = torch.arange(start, start + lq)[:, None]
    j = torch.arange(lk)[None, :]
    logits = logits.masked_fill(j > i, float("-inf"))
    return torch.softmax(logits, -1) @ vv


def rel_matrix(method, lq, lk, *, w, leak=None, group=None):
    """The relative positions of the brief's formulas, for queries = the last lq of lk keys."""
    i = torch.arange(lk - lq, lk, dtype=torch.float64)[:, None]
    j = torch.arange(lk, dtype=torch.float64)[None, :]
    diff = i - j
    if method == "plain":
        far = diff
    elif method == "rerope":
        far = torch.full_like(diff, float(w))
    elif method == "leaky_rerope":
        far = w + (diff - w) / leak
    elif method == "self_extend":
        far = torch.floor(i / group) - torch.floor(j / group) + w - w // group
    else:
        raise AssertionError(method)
    return torch.where(diff < w, diff, far)


def _mode(method, w, leak=4.0, group=3):
    if method == "rerope":
        return tf.ReRoPE(w)
    if method == "leaky_rerope":
        return tf.ReRoPE(w, leak)
    return tf.SelfExtend(w, group)


def _qkv(b=2, h=4, hk=2, lq=40, lk=40, d=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hk, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hk, lk, d, generator=g, dtype=dtype)
    return q, k, v


ROPES = {
    "half": lambda: RotaryEmbedding(16, base=100.0),
    "interleaved": lambda: RotaryEmbedding(16, base=100.0, layout="interleaved"),
    # partial rotary, custom frequencies and an attention factor (as YaRN's)
    "partial": lambda: RotaryEmbedding(16, rotary_dim=8, inv_freq=torch.tensor([1.0, 0.3, 0.05, 0.01]),
                                       attention_scaling=1.25),
}


@pytest.fixture(autouse=True)
def _no_grad():
    """Inference only."""
    with torch.no_grad():
        yield


@pytest.fixture(params=["fused", "matmul"])
def impl(request, monkeypatch):
    """Both code paths: torch's fused CPU kernel with log-sum-exp merging, and explicit masked
    matrix products (what runs where the kernel does not exist)."""
    if request.param == "fused":
        assert tf._flash_op() is not None, "this torch has no fused CPU attention with log-sum-exp"
    monkeypatch.setattr(tf, "USE_FLASH", request.param == "fused")
    return request.param


# ----------------------------------------------------------------------------- two regions


@pytest.mark.parametrize("rope_name", list(ROPES))
@pytest.mark.parametrize("method", ["rerope", "leaky_rerope", "self_extend"])
@pytest.mark.parametrize("w", [1, 5, 12])
def test_two_region_against_the_dense_relative_formula(method, rope_name, w, impl):
    rope = ROPES[rope_name]()
    q, k, v = _qkv()
    mode = _mode(method, w)
    rel = rel_matrix(method, 40, 40, w=w, leak=4.0, group=3)
    want = dense_relative(q, k, v, rope, rel)
    got = tf.two_region_attention(q, k, v, rope, mode, chunk=7)
    assert got.dtype == torch.float64 and got.shape == (2, 4, 40, 16)
    assert (got - want).abs().max().item() < TOL64
    # not vacuous: plain RoPE differs by far more than the tolerance
    plain = dense_relative(q, k, v, rope, rel_matrix("plain", 40, 40, w=w))
    assert (plain - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("method", ["rerope", "leaky_rerope", "self_extend"])
def test_two_region_queries_are_the_last_keys(method, impl):
    rope = ROPES["half"]()
    q, k, v = _qkv(lq=9, lk=30)
    rel = rel_matrix(method, 9, 30, w=6, leak=2.5, group=4)
    want = dense_relative(q, k, v, rope, rel)
    got = tf.two_region_attention(q, k, v, rope, _mode(method, 6, leak=2.5, group=4), chunk=4)
    assert (got - want).abs().max().item() < TOL64


@pytest.mark.parametrize("method", ["rerope", "leaky_rerope", "self_extend"])
def test_two_region_chunk_size_invariance(method, impl):
    rope = ROPES["interleaved"]()
    q, k, v = _qkv(lq=33, lk=33)
    mode = _mode(method, 8)
    outs = [tf.two_region_attention(q, k, v, rope, mode, chunk=c) for c in (1, 2, 5, 8, 33, 100)]
    for o in outs[1:]:  # the same sums over other blocks: float64 rounding only
        assert (o - outs[0]).abs().max().item() < TOL64


@pytest.mark.parametrize("method", ["rerope", "leaky_rerope", "self_extend"])
@pytest.mark.parametrize("rope_name", list(ROPES))
def test_window_at_least_the_length_is_plain_rope(method, rope_name, impl):
    """With w >= L every pair is a neighbour: plain causal RoPE attention (the package's
    reference attention with the rope as its scheme)."""
    rope = ROPES[rope_name]()
    q, k, v = _qkv(lq=20, lk=20)
    plain = attention(q, k, v, rope, causal=True)
    for w in (20, 21, 1000):
        got = tf.two_region_attention(q, k, v, rope, _mode(method, w), chunk=6)
        assert (got - plain).abs().max().item() < TOL64


def test_self_extend_group_one_is_plain_rope():
    rope = ROPES["half"]()
    q, k, v = _qkv(lq=25, lk=25)
    plain = attention(q, k, v, rope, causal=True)
    got = tf.two_region_attention(q, k, v, rope, tf.SelfExtend(4, 1))
    assert (got - plain).abs().max().item() < TOL64


def test_leaky_rerope_far_positions_are_fractional_and_continuous():
    mode = tf.ReRoPE(8, 3.0)
    i = torch.arange(30)
    fq, fk = mode.far_positions(i, i)
    assert fq.dtype == fk.dtype == torch.float64
    rel = fq[:, None] - fk[None, :]
    diff = (i[:, None] - i[None, :]).double()
    # the far branch is w + (i - j - w) / k everywhere, so it meets the near one at i - j = w
    assert torch.allclose(rel, 8 + (diff - 8) / 3.0, rtol=0, atol=1e-12)
    fq, fk = tf.SelfExtend(8, 4).far_positions(i, i)
    assert fq.dtype == fk.dtype == torch.int64
    assert torch.equal(fq[:, None] - fk[None, :], i[:, None] // 4 - i[None, :] // 4 + 6)
    # at i - j = w the far branch gives exactly w when G divides w, and w - 1 or w otherwise
    # (6 // 4 = 1: i // 4 - (i - 6) // 4 is 1 or 2, plus 6 - 1)
    i = torch.arange(8, 40)
    assert set((i // 4 - (i - 8) // 4 + 8 - 2).tolist()) == {8}
    fq, fk = tf.SelfExtend(6, 4).far_positions(i, i - 6)
    assert set((fq - fk).tolist()) == {6, 7}


def test_float32_inputs_against_float64(impl):
    """float32 activations: float32 tables and matrix products, softmax in float32. Logits of
    16 terms with |q||k| ~ 16 carry errors ~ 16 * 16 * 2**-24 ~ 3e-4 (relative 1e-5 of the
    sum of |terms|); after softmax and the value sum the outputs (O(1)) differ from float64 by
    well under 1e-4 (bound 1e-3, 10x margin)."""
    rope = ROPES["half"]()
    q, k, v = _qkv(lq=30, lk=30)
    for method in ("rerope", "leaky_rerope", "self_extend"):
        mode = _mode(method, 7)
        want = tf.two_region_attention(q, k, v, rope, mode)
        got = tf.two_region_attention(q.float(), k.float(), v.float(), rope, mode)
        assert got.dtype == torch.float32
        assert (got.double() - want).abs().max().item() < 1e-3


def test_max_relative_position_against_a_brute_force():
    for mode in (tf.ReRoPE(5), tf.ReRoPE(5, 3.0), tf.SelfExtend(6, 4), tf.SelfExtend(8, 4), tf.SelfExtend(3, 5)):
        for n in (1, 2, 4, 5, 6, 7, 30, 101):
            method = mode.name
            rel = rel_matrix(method, n, n, w=mode.window, leak=getattr(mode, "leak", None),
                             group=getattr(mode, "group", None))
            causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
            assert tf.max_relative_position(mode, n) == pytest.approx(float(rel[causal].max()), abs=1e-12), (mode, n)
    # the documented SmolLM2 defaults at 16384 stay below 8192
    assert tf.max_relative_position(tf.ReRoPE(4096), 16384) == 4096
    assert tf.max_relative_position(tf.ReRoPE(4096, 4.0), 16384) == 4096 + 12287 / 4 == 7167.75
    assert tf.max_relative_position(tf.SelfExtend(2048, 4), 16384) == 16383 // 4 + 2048 - 512 == 5631


def test_rope_tables_integer_positions_are_the_model_tables():
    rope = RotaryEmbedding(16, base=10000.0)
    pos = torch.arange(50)
    c, s = tf.rope_tables(rope, pos)
    c2, s2 = rope.cos_sin(pos)
    assert torch.equal(c, c2) and torch.equal(s, s2)
    # fractional positions: float64 angles, cast once; at integers they agree with float32's
    # angles to the float32 angle rounding (|p theta| < 50, so < 50 * 2**-24 rad)
    cf, sf = tf.rope_tables(rope, pos.double())
    assert cf.dtype == torch.float32
    assert (cf - c).abs().max().item() < 50 * 2**-23 and (sf - s).abs().max().item() < 50 * 2**-23
    c64, _ = tf.rope_tables(rope, torch.tensor([2.5]), torch.float64)
    assert c64.dtype == torch.float64
    assert torch.allclose(c64[0], torch.cos(2.5 * _inv_freq64(rope)), rtol=0, atol=1e-15)


def test_two_region_rejects_bad_input():
    rope = ROPES["half"]()
    q, k, v = _qkv(lq=4, lk=4)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        tf.ReRoPE(0)
    with pytest.raises(TypeError, match="window must be an int"):
        tf.ReRoPE(2.0)
    with pytest.raises(ValueError, match=r"leak must be a finite number > 1, got 1\.0"):
        tf.ReRoPE(4, 1.0)
    with pytest.raises(ValueError, match="leak must be a finite number > 1"):
        tf.ReRoPE(4, 0.5)
    with pytest.raises(ValueError, match="leak must be a finite number > 1"):
        tf.ReRoPE(4, float("inf"))
    with pytest.raises(ValueError, match="window must be >= 1, got -3"):
        tf.SelfExtend(-3, 2)
    with pytest.raises(ValueError, match="group must be >= 1, got 0"):
        tf.SelfExtend(4, 0)
    mode = tf.ReRoPE(2)
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        tf.two_region_attention(q, k, v, rope, mode, chunk=0)
    with pytest.raises(TypeError, match="mode must be a ReRoPE or SelfExtend"):
        tf.two_region_attention(q, k, v, rope, "rerope")
    with pytest.raises(TypeError, match="rope must be a companion.rope.RotaryEmbedding"):
        tf.two_region_attention(q, k, v, None, mode)
    with pytest.raises(ValueError, match=r"q_len \(8\) must be <= k_len \(4\)"):
        tf.two_region_attention(torch.cat((q, q), 2), k, v, rope, mode)
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of k heads \(3\)"):
        tf.two_region_attention(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1), rope, mode)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        tf.two_region_attention(q, k, v, rope, mode, scale=0.0)
    with pytest.raises(ValueError, match="length must be >= 1, got 0"):
        tf.max_relative_position(mode, 0)


def test_two_region_rejects_a_rope_built_for_another_head_dim():
    """A rope built for 8 dims on 16-dim heads would rotate half of each head and pass the
    rest through; rope.rotate refuses it, and so does every path here. (A partial rotation is
    a rope *built* with rotary_dim < head_dim: ROPES["partial"], checked against the dense
    formula above, which leaves the dims past rotary_dim unrotated.)"""
    narrow = RotaryEmbedding(8, base=100.0)
    q, k, v = _qkv(lq=6, lk=6)
    message = r"rope was built for head_dim 8 \(rotary_dim 8\), but q and k have head_dim 16"
    with pytest.raises(ValueError, match="must equal this scheme's head_dim 8, got 16"):
        narrow.rotate(q, k, torch.arange(6), torch.arange(6))  # the rope's own rule
    with pytest.raises(ValueError, match=message):
        tf.two_region_attention(q, k, v, narrow, tf.ReRoPE(2))
    with pytest.raises(ValueError, match=message):
        tf.sink_attention(q, k, v, narrow, positions=torch.arange(6))
    with pytest.raises(ValueError, match=message):
        tf.SinkCache(1).attend(0, q, k, v, narrow)


def _dynamic_rope():
    """Dynamic NTK over 16 native positions: its base grows with the length of a pass."""
    return RotaryEmbedding(16, rope_config={"rope_type": "dynamic", "rope_theta": 100.0, "factor": 2.0},
                           max_position_embeddings=16)


@pytest.mark.parametrize("method", ["rerope", "leaky_rerope", "self_extend"])
def test_two_region_follows_a_dynamic_ntk_rope_as_its_own_attention_does(method, impl):
    """A length-dependent rope_config: the frequencies are those rope.rotate picks for the
    pass (positions 0 .. 39, beyond the 16 native ones), for both branches."""
    q, k, v = _qkv(lq=40, lk=40)
    plain = attention(q, k, v, _dynamic_rope(), causal=True)  # rope.rotate's rule, a fresh rope
    rope = _dynamic_rope()
    native = rope.inv_freq.clone()
    wide = tf.two_region_attention(q, k, v, rope, _mode(method, 40))
    assert (wide - plain).abs().max().item() < TOL64
    assert not torch.equal(rope.inv_freq, native)  # not vacuous: the base did change
    stale = attention(q, k, v, RotaryEmbedding(16, inv_freq=native), causal=True)
    assert (stale - plain).abs().max().item() > 1e-3
    # a narrow window: the dense formula with the frequencies of the whole pass
    rope = _dynamic_rope()
    got = tf.two_region_attention(q, k, v, rope, _mode(method, 6), chunk=7)
    want = dense_relative(q, k, v, rope, rel_matrix(method, 40, 40, w=6, leak=4.0, group=3))
    assert (got - want).abs().max().item() < TOL64


# ----------------------------------------------------------------------------- attention sinks


def dense_chunk(q, k, v, rope, keys_idx, q_idx, key_pos, q_pos):
    """softmax over the visible keys (stream indices keys_idx) of one query q_idx, with RoPE at
    key_pos / q_pos, through the dense relative formula (float64)."""
    kk, vv = k[:, :, keys_idx], v[:, :, keys_idx]
    qq = q[:, :, [q_idx]]
    rel = (torch.tensor([float(q_pos)])[:, None] - torch.tensor(key_pos, dtype=torch.float64)[None, :])
    # no causal masking: every listed key is visible (dense_relative masks j > i by index,
    # so put the query "after" all keys)
    return dense_relative(qq, kk, vv, rope, rel, q_start=len(keys_idx))


def streaming_loop(q, k, v, rope, n_sink, window, rerotate=True):
    """StreamingLLM's evaluation, one token at a time: append the token to the cache, attend,
    then trim the cache to the first n_sink and the last window tokens."""
    n = q.shape[2]
    cache: list[int] = []
    outs = []
    for t in range(n):
        cache.append(t)
        key_pos = list(range(len(cache))) if rerotate else cache
        q_pos = len(cache) - 1 if rerotate else t
        outs.append(dense_chunk(q, k, v, rope, list(cache), t, key_pos, q_pos))
        if len(cache) > n_sink + window:
            cache = cache[:n_sink] + cache[len(cache) - window:]
    return torch.cat(outs, dim=2)


def streaming_chunks(q, k, v, rope, n_sink, window, chunk, rerotate=True):
    """The chunked definition: the queries of a chunk see the trimmed cache of the earlier
    chunks and the causal part of their chunk; keys at their index in that list."""
    n = q.shape[2]
    cache: list[int] = []
    outs = []
    for s in range(0, n, chunk):
        part = list(range(s, min(s + chunk, n)))
        for c, t in enumerate(part):
            visible = cache + part[: c + 1]
            key_pos = list(range(len(visible))) if rerotate else visible
            q_pos = len(visible) - 1 if rerotate else t
            outs.append(dense_chunk(q, k, v, rope, visible, t, key_pos, q_pos))
        cache = cache + part
        if len(cache) > n_sink + window:
            cache = cache[:n_sink] + cache[len(cache) - window:]
    return torch.cat(outs, dim=2)


def run_cache(q, k, v, rope, n_sink, window, chunk, rerotate=True):
    cache = tf.SinkCache(1, n_sink, window, rerotate=rerotate)
    outs = []
    for s in range(0, q.shape[2], chunk):
        outs.append(cache.attend(0, q[:, :, s:s + chunk], k[:, :, s:s + chunk], v[:, :, s:s + chunk], rope))
    return torch.cat(outs, dim=2), cache


@pytest.mark.parametrize("n_sink,window", [(4, 6), (0, 5), (1, 1), (3, 40)])
@pytest.mark.parametrize("rerotate", [True, False])
def test_sinks_chunk_one_is_the_token_by_token_loop(n_sink, window, rerotate):
    rope = ROPES["partial"]()
    q, k, v = _qkv(b=1, lq=24, lk=24)
    want = streaming_loop(q, k, v, rope, n_sink, window, rerotate)
    got, cache = run_cache(q, k, v, rope, n_sink, window, 1, rerotate)
    assert (got - want).abs().max().item() < TOL64
    assert cache.length == 24
    kept = list(range(min(n_sink, 24))) + list(range(max(n_sink, 24 - window), 24))
    assert cache.cached_positions().tolist() == kept


@pytest.mark.parametrize("chunk", [2, 5, 7, 24])
@pytest.mark.parametrize("rerotate", [True, False])
def test_sinks_chunked_against_the_dense_definition(chunk, rerotate, impl):
    rope = ROPES["interleaved"]()
    q, k, v = _qkv(lq=24, lk=24)
    want = streaming_chunks(q, k, v, rope, 2, 6, chunk, rerotate)
    got, _ = run_cache(q, k, v, rope, 2, 6, chunk, rerotate)
    assert (got - want).abs().max().item() < TOL64
    if chunk > 1 and rerotate:  # the chunked stream is not StreamingLLM's token loop
        loop = streaming_loop(q, k, v, rope, 2, 6, rerotate)
        assert (got - loop).abs().max().item() > 1e-3


def test_sinks_without_rerotation_see_true_distances():
    """rerotate=False: the relative position of every visible key is its true distance; with
    rerotation, the sinks sit right before the recent window."""
    rope = ROPES["half"]()
    q, k, v = _qkv(b=1, lq=20, lk=20)
    a, _ = run_cache(q, k, v, rope, 2, 4, 3, rerotate=False)
    b, _ = run_cache(q, k, v, rope, 2, 4, 3, rerotate=True)
    # the first n_sink + window + 1 tokens see no eviction: identical either way
    assert (a[:, :, :7] - b[:, :, :7]).abs().max().item() < TOL64
    assert (a[:, :, 7:] - b[:, :, 7:]).abs().max().item() > 1e-3


@pytest.mark.parametrize("chunk", [1, 4, 20])
def test_sinks_with_a_window_at_least_the_length_are_plain(chunk, impl):
    rope = ROPES["half"]()
    q, k, v = _qkv(lq=20, lk=20)
    plain = attention(q, k, v, rope, causal=True)
    for n_sink, window in ((0, 20), (4, 16), (4, 100)):
        got, _ = run_cache(q, k, v, rope, n_sink, window, chunk)
        assert (got - plain).abs().max().item() < TOL64


def test_sink_attention_functional_form():
    rope = ROPES["half"]()
    q, k, v = _qkv(b=1, lq=10, lk=10)
    pos = torch.arange(10)
    past = dict(past_k=k[:, :, :6], past_v=v[:, :, :6], past_pos=pos[:6])
    out = tf.sink_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], rope, positions=pos[6:], **past)
    full = attention(q, k, v, rope, causal=True)[:, :, 6:]  # nothing evicted: plain
    assert (out - full).abs().max().item() < TOL64
    with pytest.raises(ValueError, match=r"positions must have shape \(4,\)"):
        tf.sink_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], rope, positions=pos[5:], **past)
    with pytest.raises(ValueError, match="past_k, past_v and past_pos"):
        tf.sink_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], rope, positions=pos[6:], past_k=k[:, :, :6])
    with pytest.raises(TypeError, match="rerotate must be a bool"):
        tf.sink_attention(q, k, v, rope, positions=pos, rerotate=1)


def test_sink_cache_rejects_bad_input():
    with pytest.raises(ValueError, match="n_sink must be >= 0, got -1"):
        tf.SinkCache(2, -1, 8)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        tf.SinkCache(2, 4, 0)
    with pytest.raises(ValueError, match="n_layers must be >= 1, got 0"):
        tf.SinkCache(0, 4, 8)
    with pytest.raises(TypeError, match="rerotate must be a bool"):
        tf.SinkCache(2, 4, 8, rerotate="no")
    cache = tf.SinkCache(2, 4, 8)
    assert cache.capacity == 12 and cache.length == 0
    q, k, v = _qkv(lq=3, lk=3)
    with pytest.raises(IndexError, match=r"layer must lie in \[0, 2\), got 2"):
        cache.attend(2, q, k, v, ROPES["half"]())
    with pytest.raises(IndexError, match=r"layer must lie in \[0, 2\), got -1"):
        cache.attend(-1, q, k, v, ROPES["half"]())
    for layer, kind in ((True, "bool"), (0.0, "float")):
        with pytest.raises(TypeError, match=rf"layer must be an int in \[0, 2\), got {kind}"):
            cache.attend(layer, q, k, v, ROPES["half"]())
    assert cache.length == 0  # nothing entered the cache
    with pytest.raises(TypeError, match="rope must be a companion.rope.RotaryEmbedding"):
        cache.attend(0, q, k, v, None)


def run_cache_last(q, k, v, rope, n_sink, window, chunk, n_q):
    """run_cache with only the queries of the last n_q tokens of each chunk."""
    cache = tf.SinkCache(1, n_sink, window)
    outs = []
    for s in range(0, q.shape[2], chunk):
        e = min(s + chunk, q.shape[2])
        a = max(s, e - n_q)
        outs.append(cache.attend(0, q[:, :, a:e], k[:, :, s:e], v[:, :, s:e], rope))
    return outs


@pytest.mark.parametrize("n_q", [0, 1, 3])
def test_sinks_with_fewer_queries_than_keys_are_the_last_tokens(n_q, impl):
    """Queries of the last n_q tokens of each chunk: the rows of those tokens in the full run,
    which the dense chunked definition checks."""
    rope = ROPES["partial"]()
    q, k, v = _qkv(lq=24, lk=24)
    want = streaming_chunks(q, k, v, rope, 2, 6, 5)  # every token's query
    outs = run_cache_last(q, k, v, rope, 2, 6, 5, n_q)
    for s, out in zip(range(0, 24, 5), outs):
        e = min(s + 5, 24)
        rows = want[:, :, max(s, e - n_q):e]
        assert out.shape == rows.shape
        if n_q:
            assert (out - rows).abs().max().item() < TOL64


def test_sink_attention_with_fewer_queries_than_keys(impl):
    rope = ROPES["interleaved"]()
    q, k, v = _qkv(b=1, lq=12, lk=12)
    pos = torch.arange(12)
    past = dict(past_k=k[:, :, :5], past_v=v[:, :, :5], past_pos=pos[:5])
    full = attention(q, k, v, rope, causal=True)  # nothing evicted: plain
    for rerotate in (True, False):
        got = tf.sink_attention(q[:, :, 9:], k[:, :, 5:], v[:, :, 5:], rope, positions=pos[5:], rerotate=rerotate,
                                **past)
        assert (got - full[:, :, 9:]).abs().max().item() < TOL64
        first = tf.sink_attention(q[:, :, 4:7], k[:, :, :7], v[:, :, :7], rope, positions=pos[:7], rerotate=rerotate)
        assert (first - full[:, :, 4:7]).abs().max().item() < TOL64
    with pytest.raises(ValueError, match=r"q_len \(8\) must be <= the chunk's k_len \(7\)"):
        tf.sink_attention(q[:, :, 4:], k[:, :, 5:], v[:, :, 5:], rope, positions=pos[5:], **past)
    with pytest.raises(ValueError, match=r"q_len \(4\) must be <= the chunk's k_len \(3\)"):
        tf.SinkCache(1).attend(0, q[:, :, :4], k[:, :, :3], v[:, :, :3], rope)


def test_sink_positions_must_be_integers():
    rope = ROPES["half"]()
    q, k, v = _qkv(b=1, lq=6, lk=6)
    pos = torch.arange(6)
    with pytest.raises(TypeError, match=r"positions must hold integers .* got dtype torch.float32"):
        tf.sink_attention(q, k, v, rope, positions=pos.float(), rerotate=False)
    with pytest.raises(TypeError, match=r"past_pos must hold integers .* got dtype torch.float64"):
        tf.sink_attention(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], rope, positions=pos[3:], past_k=k[:, :, :3],
                          past_v=v[:, :, :3], past_pos=pos[:3].double(), rerotate=False)
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        tf.sink_attention(q, k, v, rope, positions=None)
    # a list of ints or an int32 tensor is the same as int64
    want = tf.sink_attention(q, k, v, rope, positions=pos, rerotate=False)
    for other in (list(range(6)), pos.int()):
        assert torch.equal(tf.sink_attention(q, k, v, rope, positions=other, rerotate=False), want)


def test_sink_cache_follows_a_dynamic_ntk_rope():
    """One chunk with nothing evicted: the plain attention of the same length-dependent rope."""
    q, k, v = _qkv(lq=40, lk=40)
    plain = attention(q, k, v, _dynamic_rope(), causal=True)
    got, _ = run_cache(q, k, v, _dynamic_rope(), 4, 64, 40)
    assert (got - plain).abs().max().item() < TOL64


def test_sink_cache_rejects_a_chunk_unlike_the_cache():
    rope = ROPES["half"]()
    q, k, v = _qkv(b=2, lq=4, lk=4)
    cache = tf.SinkCache(1)
    cache.attend(0, q, k, v, rope)
    with pytest.raises(ValueError, match=r"the keys cached for layer 0 \(shape \(2, 2, 4, 16\).* and the chunk's k "
                                         r"\(shape \(1, 2, 4, 16\).* must agree in batch"):
        cache.attend(0, q[:1], k[:1], v[:1], rope)
    with pytest.raises(ValueError, match=r"past_v .*torch.float32.* and the chunk's v .*torch.float64"):
        tf.sink_attention(q, k, v, rope, positions=torch.arange(4, 8), past_k=k, past_v=v.float(),
                          past_pos=torch.arange(4))
    with pytest.raises(ValueError, match="past_k, past_v and past_pos must be given together"):
        tf.sink_attention(q, k, v, rope, positions=torch.arange(4, 8), past_v=v)


# ----------------------------------------------------------------------------- the lab's TinyDecoder


@pytest.fixture(scope="module")
def lab_model():
    torch.manual_seed(0)
    model = TinyDecoder(256, d_model=32, n_heads=4, n_layers=2, scheme=RotaryEmbedding(8, base=100.0),
                        n_kv_heads=2).double().eval()
    with torch.no_grad():
        for p in model.parameters():  # a random model far from uniform predictions
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_lab_forward_plain_and_wide_windows_equal_the_model(lab_model):
    idx = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = lab_model(idx)
        assert (tl.lab_forward(lab_model, idx) - ref).abs().max().item() < TOL64
        for mode in (tf.ReRoPE(30), tf.ReRoPE(40, 2.0), tf.SelfExtend(30, 4)):
            assert (tl.lab_forward(lab_model, idx, mode) - ref).abs().max().item() < TOL64
        # not vacuous: a small window changes the logits
        assert (tl.lab_forward(lab_model, idx, tf.ReRoPE(4)) - ref).abs().max().item() > 1e-4
        # the sink stream with nothing evicted is the plain model; the nll is a cross entropy of
        # the same logits, so it agrees to the same rounding
        nll32 = torch.nn.functional.cross_entropy(ref[:, :-1].float().transpose(1, 2), idx[:, 1:], reduction="none")
        for chunk in (1, 7, 29):
            s = tl.lab_stream_nll(lab_model, idx, 4, 26, chunk)
            assert s.shape == (2, 29) and s.dtype == torch.float32
            assert (s - nll32).abs().max().item() <= BITS32
        assert (tl.lab_stream_nll(lab_model, idx, 2, 8, 4) - nll32).abs().max().item() > 1e-4


def test_lab_bits_per_byte_matches_the_lab_evaluation(lab_model):
    data = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    lengths = [16, 32]
    # one block per window, so the block means compare the windows one by one
    kw = dict(windows_per_length=8, blocks=8, tokens_per_batch=128)
    ref = bits_per_byte(lab_model, data, lengths, **kw)
    assert ref == bits_per_byte(lab_model, data, lengths, reach=32, **kw)  # reach: max(lengths) by default
    wide = {"rerope": {"window": 64}, "leaky_rerope": {"window": 64, "leak": 2.0},
            "self_extend": {"window": 64, "group": 4}, "sinks": {"n_sink": 4, "window": 64, "chunk": 8}}
    for method, params in wide.items():
        got = tl.lab_bits_per_byte(lab_model, data, lengths, method, **kw, **params)
        assert set(got) == set(ref)
        for w in lengths:
            assert set(got[w]) == {"all", "tail", "all_blocks", "tail_blocks"}
            for key in ("all", "tail"):
                assert got[w][key] == pytest.approx(ref[w][key], abs=BITS32), (method, w, key)
            for key in ("all_blocks", "tail_blocks"):  # window for window (a mean of per-position
                assert len(got[w][key]) == 8  # losses each within BITS32 is within BITS32)
                assert got[w][key] == pytest.approx(ref[w][key], abs=BITS32), (method, w, key)
            # one length at a time, with the reach of the joint call: the same windows
            single = tl.lab_bits_per_byte(lab_model, data, [w], method, reach=max(lengths), **kw, **params)
            assert single == {w: got[w]}, (method, w)
    # without the reach a single length's windows end elsewhere (the comparison can tell)
    alone = tl.lab_bits_per_byte(lab_model, data, [16], "rerope", window=64, **kw)
    assert max(abs(a - b) for a, b in zip(alone[16]["all_blocks"], ref[16]["all_blocks"])) > 1e-3
    narrow = tl.lab_bits_per_byte(lab_model, data, lengths, "rerope", windows_per_length=8, blocks=8, window=4)
    assert abs(narrow[32]["all"] - ref[32]["all"]) > 1e-5
    assert max(abs(a - b) for a, b in zip(narrow[32]["all_blocks"], ref[32]["all_blocks"])) > 1e-5
    with pytest.raises(ValueError, match="method must be one of"):
        tl.lab_bits_per_byte(lab_model, data, lengths, "yarn")
    with pytest.raises(ValueError, match=r"blocks \(3\) must divide windows_per_length \(8\)"):
        tl.lab_bits_per_byte(lab_model, data, lengths, "rerope", windows_per_length=8, blocks=3, window=64)
    with pytest.raises(ValueError, match="reach"):
        tl.lab_bits_per_byte(lab_model, data, lengths, "rerope", windows_per_length=8, blocks=8, reach=16,
                             window=64)


def test_lab_forward_rejects_other_models(lab_model):
    with pytest.raises(TypeError, match="model must be a companion.model.TinyDecoder"):
        tl.lab_forward(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long))
    nope = TinyDecoder(16, d_model=8, n_heads=2, n_layers=1)
    with pytest.raises(TypeError, match="model.scheme must be a RotaryEmbedding"):
        tl.lab_forward(nope, torch.zeros(1, 2, dtype=torch.long))
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="pass mode or cache, not both"):
        tl.lab_forward(lab_model, idx, tf.ReRoPE(2), tf.SinkCache(2))
    with pytest.raises(ValueError, match="cache has 3 layers, the model 2"):
        tl.lab_forward(lab_model, idx, cache=tf.SinkCache(3))
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        tl.lab_stream_nll(lab_model, idx, 4, 8, 0)
    with pytest.raises(ValueError, match="n_sink must be >= 0, got -2"):
        tl.lab_stream_nll(lab_model, idx, -2, 8, 2)


def test_lab_bits_per_byte_rejects_unknown_keywords(lab_model):
    """A misspelt keyword must not fall back to the default silently."""
    assert list(tl.LAB_METHOD_PARAMS) == list(tf.TRAINFREE_METHODS)
    data = np.zeros(600, dtype=np.uint8)
    kw = dict(windows_per_length=2, blocks=1)
    cases = [("rerope", {"windw": 64}, r"\['windw'\] for method 'rerope'; allowed: \['window'\]"),
             ("rerope", {"leak": 2.0}, r"\['leak'\] for method 'rerope'; allowed: \['window'\]"),
             ("leaky_rerope", {"leek": 2.0}, r"\['leek'\] for method 'leaky_rerope'; allowed: \['window', 'leak'\]"),
             ("self_extend", {"groups": 2}, r"\['groups'\] for method 'self_extend'; allowed: \['window', 'group'\]"),
             ("sinks", {"n_sinks": 2, "rerotation": False},
              r"\['n_sinks', 'rerotation'\] for method 'sinks'; allowed: \['n_sink', 'window', 'chunk', 'rerotate'\]"),
             ("rerope", {"block": 1}, r"\['block'\] .* \(and the evaluation's \['windows_per_length', 'blocks'")]
    for method, params, message in cases:
        with pytest.raises(ValueError, match="lab_bits_per_byte's keywords has unknown keys " + message):
            tl.lab_bits_per_byte(lab_model, data, [16], method, **kw, **params)
    with pytest.raises(ValueError, match=r"method must be one of \['rerope', 'leaky_rerope', 'self_extend', "
                                         r"'sinks'\], got 'ReRoPE'"):
        tl.lab_bits_per_byte(lab_model, data, [16], "ReRoPE", **kw)
    with pytest.raises(ValueError, match="tokens_per_batch must be >= 1, got 0"):
        tl.lab_bits_per_byte(lab_model, data, [16], "rerope", tokens_per_batch=0, **kw)
    # the sink parameters are checked when the method is built, before any window is read
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        tl.lab_bits_per_byte(lab_model, data, [16], "sinks", chunk=0, **kw)
    with pytest.raises(TypeError, match="rerotate must be a bool"):
        tl.lab_bits_per_byte(lab_model, data, [16], "sinks", rerotate="no", **kw)


def test_lab_settings_are_valid_keywords_and_reject_bad_input():
    for name, method in tl.LAB_TRAINFREE.items():
        for train_len in (tl._MIN_TRAIN_LEN[name], 8, 128):
            for length in (1, train_len, 4 * train_len):
                kw = tl.lab_settings(name, train_len, length)
                tl._lab_method(method, kw)  # every setting is a valid keyword set of its method
        with pytest.raises(ValueError, match=f"train_len must be >= {tl._MIN_TRAIN_LEN[name]}, got "
                                             f"{tl._MIN_TRAIN_LEN[name] - 1}"):
            tl.lab_settings(name, tl._MIN_TRAIN_LEN[name] - 1, 64)
    with pytest.raises(ValueError, match=r"name must be one of \['rerope', .*'sinks_no_rerotate'\], got 'sink'"):
        tl.lab_settings("sink", 128, 256)
    with pytest.raises(ValueError, match="length must be >= 1, got 0"):
        tl.lab_settings("rerope", 128, 0)
    with pytest.raises(TypeError, match="train_len must be an int"):
        tl.lab_settings("rerope", 128.0, 256)


def test_run_trainfree_checks_every_argument_before_loading(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("nothing may be loaded before the arguments are checked")

    monkeypatch.setattr(tl, "load_corpus", refuse)
    monkeypatch.setattr(tl, "load_checkpoint", refuse)
    ckpt = [str(tmp_path / "rope.pt")]
    with pytest.raises(ValueError, match=r"names must be a non-empty list drawn from \['rerope', .*got \['sink'\]"):
        tl.run_trainfree(ckpt, [1, 2], names=["sink"])
    with pytest.raises(ValueError, match="names must not repeat"):
        tl.run_trainfree(ckpt, [1, 2], names=["rerope", "rerope"])
    with pytest.raises(TypeError, match="names must be a list"):
        tl.run_trainfree(ckpt, [1, 2], names="rerope")
    with pytest.raises(ValueError, match=r"multiples\[1\] must be >= 1, got 0"):
        tl.run_trainfree(ckpt, [1, 0])
    with pytest.raises(ValueError, match=r"multiples must not repeat a value, got \[1, 2, 1\]"):
        tl.run_trainfree(ckpt, [1, 2, 1])
    with pytest.raises(ValueError, match="windows_per_length must be >= 1, got 0"):
        tl.run_trainfree(ckpt, [1], windows_per_length=0)
    with pytest.raises(ValueError, match=r"blocks \(256\) must divide windows_per_length \(1000\)"):
        tl.run_trainfree(ckpt, [1], windows_per_length=1000)
    with pytest.raises(TypeError, match="checkpoints must be a non-empty list of paths"):
        tl.run_trainfree(ckpt[0], [1])
    with pytest.raises(TypeError, match="checkpoints must hold paths"):
        tl.run_trainfree([0], [1])


# ----------------------------------------------------------------------------- bad input and edge cases (issue 29)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method", ["rerope", "leaky_rerope", "self_extend"])
def test_two_region_with_a_value_head_size_unlike_the_queries(method, dtype, impl):
    """v may have another head size than q and k (valid attention input: out is (.., d_v)); the
    fused CPU kernel needs one size, so this takes the explicit path. Checked against the dense
    float64 formula, with grouped-query heads, for both settings of USE_FLASH."""
    rope = ROPES["partial"]()
    q, k, _ = _qkv(lq=20, lk=26)
    v = torch.randn(2, 2, 26, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    want = dense_relative(q, k, v, rope, rel_matrix(method, 20, 26, w=4, leak=4.0, group=3))
    got = tf.two_region_attention(q.to(dtype), k.to(dtype), v.to(dtype), rope, _mode(method, 4), chunk=6)
    assert got.shape == (2, 4, 20, 5) and got.dtype == dtype
    tol = TOL64 if dtype == torch.float64 else 1e-4
    assert (got.double() - want).abs().max().item() < tol


def test_sinks_with_a_value_head_size_unlike_the_queries(impl):
    """The same for the sink cache and sink_attention with a past (the fused path needs one head
    size): the chunked dense definition, with v of head size 5 for q and k of 16."""
    rope = ROPES["interleaved"]()
    q, k, _ = _qkv(lq=24, lk=24)
    v = torch.randn(2, 2, 24, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    want = streaming_chunks(q, k, v, rope, 2, 6, 5)
    got, _ = run_cache(q, k, v, rope, 2, 6, 5)
    assert got.shape == (2, 4, 24, 5)
    assert (got - want).abs().max().item() < TOL64
    pos = torch.arange(12)
    out = tf.sink_attention(q[:, :, 6:12], k[:, :, 6:12], v[:, :, 6:12], rope, positions=pos[6:],
                            past_k=k[:, :, :6], past_v=v[:, :, :6], past_pos=pos[:6])
    full = attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], rope, causal=True)[:, :, 6:]  # nothing evicted
    assert (out - full).abs().max().item() < TOL64


def test_sink_cache_cached_positions_checks_the_layer():
    cache = tf.SinkCache(2, 1, 2)
    for layer in (-1, 2, 5):
        with pytest.raises(IndexError, match=rf"layer must lie in \[0, 2\), got {layer}"):
            cache.cached_positions(layer)
    for layer, kind in ((True, "bool"), (0.0, "float"), ("0", "str"), (None, "NoneType")):
        with pytest.raises(TypeError, match=rf"layer must be an int in \[0, 2\), got {kind}"):
            cache.cached_positions(layer)
    assert cache.cached_positions(1).tolist() == [] and cache.cached_positions().dtype == torch.int64
    q, k, v = _qkv(b=1, lq=4, lk=4)
    cache.attend(1, q, k, v, ROPES["half"]())
    assert cache.cached_positions(1).tolist() == [0, 2, 3] and cache.cached_positions(0).tolist() == []


def test_sink_cache_first_chunk_with_fewer_queries_than_keys():
    """The audit's case: a first chunk of 4 keys with the queries of its last 2 tokens. Valid and
    documented (q holds the queries of the chunk's *last* C_q tokens): token 2 sees keys 0..2,
    token 3 keys 0..3, rotated at their index; the cache then keeps the sink and the window."""
    rope = ROPES["half"]()
    q, k, v = _qkv(b=1, h=2, hk=2, lq=4, lk=4, d=16)
    cache = tf.SinkCache(1, 1, 2)
    got = cache.attend(0, q[:, :, :2], k, v, rope)
    # independent: rows 2 and 3 of the dense causal formula, with the given queries in those rows
    qq = torch.cat((torch.zeros_like(q[:, :, :2]), q[:, :, :2]), dim=2)
    rel = (torch.arange(4.0)[:, None] - torch.arange(4.0)[None, :])
    want = dense_relative(qq, k, v, rope, rel)[:, :, 2:]
    assert got.shape == (1, 2, 2, 16)
    assert (got - want).abs().max().item() < TOL64
    assert cache.cached_positions(0).tolist() == [0, 2, 3] and cache.length == 4


def test_stream_nll_refuses_a_lab_model():
    torch.manual_seed(0)
    lab = TinyDecoder(256, 16, 2, 1, scheme=RotaryEmbedding(8)).eval()
    ids = torch.randint(0, 256, (1, 12))
    with pytest.raises(TypeError, match=r"model must be a companion\.llama\.LlamaModel, got TinyDecoder; "
                                        r"for the lab's TinyDecoder use companion\.lab\.trainfree_lab\.lab_stream_nll"):
        tf.stream_nll(lab, ids)
    with pytest.raises(TypeError, match=r"model must be a companion\.llama\.LlamaModel, got str$"):
        tf.stream_nll("model", ids)
    # the lab's own stream evaluation takes it
    assert tl.lab_stream_nll(lab, ids, 4, 16, 4).shape == (1, 11)
