"""The dispatcher (companion.dispatch): every path against the reference attention.

Every fast path must compute the reference's function, forward and backward (gradients of
q, k, v and of the scheme's own parameters), for every scheme of the package, with GQA,
causal and not, padding masks, per-row positions and q_len < k_len, in float64 and float32.

Tolerances come from the arithmetic. The paths differ from the reference only in the order
of their sums (SDPA's fused kernel, the tiles of the blockwise path, the online softmax's
rescaling). An output is a convex combination of values, reached through a dot product of
``d`` terms, an exponential and two sums of ``L`` terms; a sum of ``n`` terms of magnitude
at most ``m``, computed in another order, changes by at most about ``n * eps * m`` (every
partial sum rounds once, by half an ulp of at most the running total). So outputs agree to
``C * (d + 2 L) * eps * m``, with ``m`` the largest magnitude involved (values, logits,
upstream gradients: all about 1 to 4 here) and ``C = 8`` for the few-ulp error of each
``exp``/``log``/division along the way. That bound is the worst case, not a tuned fit.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import companion
from companion import (
    FIRE,
    SCHEMES,
    ALiBi,
    CoPE,
    KerpleBias,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    NoPE,
    PRoPE,
    RotaryEmbedding,
    ScaledSinusoidalEmbedding,
    ShawRelative,
    SinusoidalEmbedding,
    T5RelativeBias,
    TinyDecoder,
    TransformerXL,
    XPos,
    attention,
)
from companion import dispatch
from companion.dispatch import ATTENTION_PATHS, attention_path, block_size_for, fast_attention
from companion.lab.schemes import BUILTIN as LAB_SCHEMES
from companion.lab.schemes import build_scheme
from helpers import rand

H, D = 4, 8

ROOT = Path(dispatch.__file__).resolve().parents[1]  # the repository (pyproject, chapters/data)


def make_scheme(cls: type, heads: int = H, head_dim: int = D, seed: int = 0) -> companion.PositionScheme:
    """One instance of every scheme class, with random (not zero) parameters."""
    torch.manual_seed(seed)
    if cls is NoPE:
        s = NoPE()
    elif cls in (SinusoidalEmbedding, ScaledSinusoidalEmbedding):
        s = cls(16)
    elif cls is LearnedPositionalEmbedding:
        s = cls(64, 16)
    elif cls is ShawRelative:
        s = cls(head_dim, max_distance=3, init_std=0.5)
    elif cls is TransformerXL:
        s = cls(heads, head_dim, init_std=0.5)
    elif cls is T5RelativeBias:
        s = cls(heads, num_buckets=8, max_distance=12, bidirectional=False)
    elif cls is RotaryEmbedding:
        s = cls(head_dim)
    elif cls is ALiBi:
        s = cls(heads)
    elif cls is XPos:
        s = cls(head_dim, scale_base=16.0)  # a visible decay at these lengths
    elif cls is PRoPE:
        s = cls(head_dim, p=0.5)
    elif cls is KerpleBias:
        s = cls(heads, form="power" if seed % 2 else "log")
    elif cls is FIRE:
        s = cls(heads, init_L=5.5)  # queries on both sides of the threshold L
    elif cls is CoPE:
        s = cls(head_dim, npos=6, init_std=0.5)  # clamping happens at these lengths
    else:  # pragma: no cover - a scheme added to SCHEMES without a case here
        raise AssertionError(f"add {cls.__name__} to make_scheme")
    return s


def bound(dtype: torch.dtype, length: int, magnitude: float = 4.0, d: int = D) -> float:
    """The module docstring's ``C (d + 2 L) eps m``."""
    return 8 * (d + 2 * length) * torch.finfo(dtype).eps * magnitude


def grad_bound(grad: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, upstream: torch.Tensor,
               v: torch.Tensor) -> float:
    """The tolerance of one gradient. In the inputs' dtype: ``bound`` times its magnitude,
    twice (a gradient sums up to ``L`` products of the terms above). A parameter of another
    dtype (T5's float32 table beside float64 inputs) has its gradient summed in its own: both
    paths add the logits' gradients ``dS_ij`` of each bucket, rounded to float32, in float32 and
    in another order, each within ``(n + 1) u S`` of the exact sum (``n = batch * q_len *
    k_len`` terms at most, ``S = sum |dS_ij|``). With ``dS_ij = P_ij (dP_ij - D_i)``, ``|dP_ij|
    <= |do_i| |v_j|`` and ``sum_j P_ij = 1``, ``S <= 2 sum_i |do_i| max_j |v_j|``."""
    if grad.dtype == dtype:
        return bound(dtype, v.shape[2]) * max(1.0, float(ref.abs().max())) * 2
    u = torch.finfo(grad.dtype).eps / 2
    total = 2 * float(upstream.double().norm(dim=-1).sum()) * float(v.detach().double().norm(dim=-1).max())
    n = upstream.shape[0] * upstream.shape[2] * v.shape[2]
    return 2 * (n + 1) * u * total


# Each configuration: (b, lq, lk, kv_heads, causal, mask kind, positions kind); v_dim is D
# except in "v-dim" (values narrower than queries and keys).
CONFIGS = {
    "self-causal": (2, 9, 9, H, True, None, None),
    "self-bidirectional": (2, 9, 9, H, False, None, None),
    "gqa-causal": (2, 9, 9, 2, True, None, None),
    "mqa-bidirectional": (1, 7, 7, 1, False, None, None),
    "padding-causal": (2, 9, 9, H, True, "padding", None),
    "padding-bidirectional": (2, 9, 9, 2, False, "padding", None),
    "left-padding-per-row": (2, 9, 9, H, True, "padding", "per-row"),
    "decode-causal": (2, 3, 11, H, True, None, None),
    "decode-gqa-padding": (2, 3, 11, 2, True, "padding", None),
    "float-mask-causal": (2, 9, 9, H, True, "float", None),
    "int-mask-bidirectional": (2, 9, 9, H, False, "int", None),
    "shifted-positions": (2, 9, 9, H, True, None, "offset"),
    "more-queries-causal": (2, 11, 7, H, True, None, None),
    "v-dim": (2, 9, 9, 2, True, "padding", None),
}


def build_case(config: str, dtype: torch.dtype, seed: int = 0):
    """q, k, v (requiring grad), positions and mask for one configuration."""
    b, lq, lk, hk, causal, mask_kind, pos_kind = CONFIGS[config]
    q = rand(b, H, lq, D, dtype=dtype, seed=seed + 1).requires_grad_()
    k = rand(b, hk, lk, D, dtype=dtype, seed=seed + 2).requires_grad_()
    v = rand(b, hk, lk, 5 if config == "v-dim" else D, dtype=dtype, seed=seed + 3).requires_grad_()
    q_pos = k_pos = None
    keep = torch.ones(b, lk, dtype=torch.bool)
    keep[0, :2] = False  # row 0 is left-padded by two keys
    if pos_kind == "per-row":
        k_pos = (keep.long().cumsum(-1) - 1).clamp(min=0)  # positions_from_mask, pads at 0
        q_pos = k_pos[:, lk - lq:]
    elif pos_kind == "offset":
        k_pos = torch.arange(5, 5 + lk)
        q_pos = k_pos[lk - lq:]
    mask = None
    if mask_kind == "padding":
        mask = keep[:, None, None, :]
    elif mask_kind == "int":
        mask = keep[:, None, None, :].long()
    elif mask_kind == "float":
        mask = torch.where(keep, 0.0, float("-inf"))[:, None, None, :].to(dtype)
        mask = mask + 0.25 * rand(1, H, lq, lk, dtype=dtype, seed=seed + 4)
    return q, k, v, q_pos, k_pos, mask, causal


def run(fn, scheme, q, k, v, q_pos, k_pos, mask, causal, upstream):
    """Output and gradients (q, k, v, then the scheme's parameters) of one attention call."""
    params = [p for p in scheme.parameters() if p.requires_grad]
    for t in (q, k, v, *params):
        t.grad = None
    out = fn(q, k, v, scheme, q_pos, k_pos, causal=causal, attn_mask=mask)
    out.backward(upstream)
    grads = [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in (q, k, v, *params)]
    return out.detach(), grads


def check_against_reference(scheme, config, dtype, seed=0):
    q, k, v, q_pos, k_pos, mask, causal = build_case(config, dtype, seed)
    path = attention_path(q, k, v, scheme, q_pos, k_pos, causal=causal, attn_mask=mask)
    upstream = rand(q.shape[0], H, q.shape[2], v.shape[-1], dtype=dtype, seed=seed + 9)
    try:
        ref, ref_grads = run(attention, scheme, q, k, v, q_pos, k_pos, mask, causal, upstream)
    except ValueError as err:
        # the one scheme and case the reference refuses: Shaw's value term needs v_dim = head_dim
        if not (isinstance(scheme, ShawRelative) and config == "v-dim"):
            raise
        assert "v" in str(err)
        with pytest.raises(ValueError) as got:
            run(fast_attention, scheme, q, k, v, q_pos, k_pos, mask, causal, upstream)
        assert str(got.value) == str(err)
        return path
    out, grads = run(fast_attention, scheme, q, k, v, q_pos, k_pos, mask, causal, upstream)
    tol = bound(dtype, k.shape[2])
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=tol)
    names = ["q", "k", "v"] + [n for n, p in scheme.named_parameters() if p.requires_grad]
    for name, g, r in zip(names, grads, ref_grads):
        # A gradient sums up to L products of the terms above (a table entry: all pairs).
        torch.testing.assert_close(g, r, rtol=0, atol=grad_bound(g, r, dtype, upstream, v),
                                   msg=lambda m, name=name: f"grad of {name} ({path}): {m}")
    return path


ATTENTION_SCHEMES = [c for c in SCHEMES]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("cls", ATTENTION_SCHEMES, ids=lambda c: c.__name__)
def test_every_scheme_and_config_matches_the_reference(cls, config, dtype):
    check_against_reference(make_scheme(cls), config, dtype)


FORCINGS = {
    # SDPA's float mask for any bias, the blockwise path for any bias, or for any mask
    "sdpa": dict(SDPA_BIAS_PAIRS=1 << 40, SDPA_GRAD_BIAS_PAIRS=1 << 40),
    "blockwise-bias": dict(SDPA_BIAS_PAIRS=0, SDPA_GRAD_BIAS_PAIRS=0),
    "blockwise-masks": dict(SDPA_BIAS_PAIRS=0, SDPA_GRAD_BIAS_PAIRS=0, SDPA_MASK_BYTES=0),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("forcing", list(FORCINGS))
@pytest.mark.parametrize("cls", [NoPE, RotaryEmbedding, T5RelativeBias, ALiBi], ids=lambda c: c.__name__)
def test_forced_paths_match_the_reference(cls, forcing, config, dtype, monkeypatch):
    """The thresholds pick by length; forcing them runs each path at the test's small sizes."""
    for name, value in FORCINGS[forcing].items():
        monkeypatch.setattr(dispatch, name, value)
    path = check_against_reference(make_scheme(cls), config, dtype)
    if "bias" in cls.hooks():
        assert path == ("sdpa-bias" if forcing == "sdpa" else "blockwise")
    elif forcing == "blockwise-masks":
        causal, mask = CONFIGS[config][4], CONFIGS[config][5]
        assert path in ("sdpa-causal", "blockwise") if (causal or mask) else path == "sdpa-mask"


def test_the_cases_reach_every_path(monkeypatch):
    """The parametrized cases above (with the forcings of the next test) cover each path the
    dispatcher has."""
    seen = set()
    monkeypatch.setattr(dispatch, "SDPA_BIAS_PAIRS", 1 << 40)  # the "sdpa" forcing
    for cls in ATTENTION_SCHEMES:
        for config in CONFIGS:
            q, k, v, q_pos, k_pos, mask, causal = build_case(config, torch.float64)
            seen.add(attention_path(q, k, v, make_scheme(cls), q_pos, k_pos, causal=causal, attn_mask=mask))
    monkeypatch.setattr(dispatch, "SDPA_BIAS_PAIRS", 0)  # the "blockwise-bias" forcing
    q, k, v, *_ = build_case("self-causal", torch.float64)
    seen.add(attention_path(q, k, v, make_scheme(ALiBi), causal=True))
    # and the query blocks of long evaluations (tests at the end of this file)
    n = dispatch.QUERY_BLOCK + 1
    with torch.no_grad():
        seen.add(attention_path(*shapes(lq=n, lk=n), make_scheme(TransformerXL), causal=True))
    assert seen == set(ATTENTION_PATHS)


# ----------------------------------------------------------------------------- the choice


def shapes(b=1, lq=8, lk=8, hk=H, d=1, dtype=torch.float32):
    """Tensors for attention_path, which reads values only for the finiteness check."""
    return torch.zeros(b, H, lq, d, dtype=dtype), torch.zeros(b, hk, lk, d, dtype=dtype), torch.zeros(b, hk, lk, d, dtype=dtype)


def test_path_for_position_free_and_rotate_schemes():
    q, k, v = shapes()
    for scheme in (None, NoPE(), SinusoidalEmbedding(16), RotaryEmbedding(2)):
        assert attention_path(q, k, v, scheme, causal=True) == "sdpa-causal"
        assert attention_path(q, k, v, scheme, torch.arange(3, 11), torch.arange(3, 11), causal=True) == "sdpa-causal"
        assert attention_path(q, k, v, scheme, causal=False) == "sdpa-mask"
        assert attention_path(q, k, v, scheme, causal=True, attn_mask=torch.ones(8, 8, dtype=torch.bool)) == "sdpa-mask"
        assert attention_path(q, k, v, scheme, torch.zeros(1, 8, dtype=torch.long) + torch.arange(8),
                              torch.arange(8), causal=True) == "sdpa-mask"  # per-row positions
        assert attention_path(q, k, v, scheme, torch.arange(8), torch.arange(1, 9), causal=True) == "sdpa-mask"
    qd, kd, vd = shapes(lq=1, lk=8)  # decoding: the query is the last position, not the first
    assert attention_path(qd, kd, vd, NoPE(), causal=True) == "sdpa-mask"


def _stored_crossover(modes) -> int:
    """The longest stored length up to which the float mask's time is at most the best
    block's, geometric means over the stored shapes of ``modes``, from the shortest on:
    the rule of the module docstring, re-derived from the raw rows."""
    rows = companion.utils.load_result(dispatch.TILES_FILE)["data"]["rows"]
    lengths = sorted({r["length"] for r in rows if r["mode"] in modes and r["sdpa_bias"] is not None})
    best = 0
    for n in lengths:
        here = [r for r in rows if r["mode"] in modes and r["length"] == n and r["sdpa_bias"] is not None]
        mask = torch.tensor([r["sdpa_bias"] for r in here], dtype=torch.float64).log().mean()
        block = torch.tensor([min(r["blocks"].values()) for r in here], dtype=torch.float64).log().mean()
        if mask > block:
            break
        best = n
    return best


def test_bias_thresholds_come_from_the_stored_measurement():
    assert dispatch.SDPA_BIAS_PAIRS == _stored_crossover(("forward", "backward")) ** 2
    assert dispatch.SDPA_GRAD_BIAS_PAIRS == _stored_crossover(("bias-grad",)) ** 2


@pytest.mark.parametrize("pairs", [0, 1, 9, 128**2])
def test_path_for_bias_schemes_follows_the_thresholds(pairs, monkeypatch):
    """At most SDPA_BIAS_PAIRS (no gradient for the bias) or SDPA_GRAD_BIAS_PAIRS (T5's table)
    pairs: the float mask; one more: the block path."""
    monkeypatch.setattr(dispatch, "SDPA_BIAS_PAIRS", pairs)
    monkeypatch.setattr(dispatch, "SDPA_GRAD_BIAS_PAIRS", pairs)
    alibi, t5 = ALiBi(H), T5RelativeBias(H, bidirectional=False)
    n = max(1, int(pairs**0.5))
    within, longer = shapes(lq=n, lk=n), shapes(lq=n, lk=n + 1)
    for scheme in (alibi, t5):
        assert attention_path(*within, scheme, causal=True) == ("sdpa-bias" if pairs else "blockwise")
        assert attention_path(*longer, scheme, causal=True) == "blockwise"
    monkeypatch.setattr(dispatch, "SDPA_GRAD_BIAS_PAIRS", 0)  # the table's gradient decides
    if pairs:
        assert attention_path(*within, t5, causal=True) == "blockwise"
        with torch.no_grad():  # no gradient: the table is a constant bias, like ALiBi's
            assert attention_path(*within, t5, causal=True) == "sdpa-bias"
        t5.requires_grad_(False)
        assert attention_path(*within, t5, causal=True) == "sdpa-bias"


def test_path_respects_the_mask_budget(monkeypatch):
    monkeypatch.setattr(dispatch, "SDPA_BIAS_PAIRS", 64)  # these 8 x 8 biases take the float mask
    q, k, v = shapes(b=2)
    per_row = torch.arange(8).expand(2, 8)
    monkeypatch.setattr(dispatch, "SDPA_MASK_BYTES", 4 * H * 64 - 1)  # one float32 (H, 8, 8) mask, less 1
    assert attention_path(q, k, v, ALiBi(H), causal=True) == "blockwise"
    monkeypatch.setattr(dispatch, "SDPA_MASK_BYTES", 4 * H * 64)
    assert attention_path(q, k, v, ALiBi(H), causal=True) == "sdpa-bias"
    assert attention_path(q, k, v, ALiBi(H), per_row, per_row, causal=True) == "blockwise"  # (2, H, 8, 8)
    monkeypatch.setattr(dispatch, "SDPA_MASK_BYTES", 0)
    assert attention_path(q, k, v, NoPE(), causal=True) == "sdpa-causal"  # builds no mask
    assert attention_path(q, k, v, NoPE(), causal=False) == "sdpa-mask"  # nor does this
    assert attention_path(q, k, v, NoPE(), per_row, per_row, causal=True) == "blockwise"
    monkeypatch.setattr(dispatch, "SDPA_MASK_BYTES", 64)  # one (8, 8) bool mask
    shared_pad, row_pad = torch.ones(1, 1, 1, 8, dtype=torch.bool), torch.ones(2, 1, 1, 8, dtype=torch.bool)
    assert attention_path(q, k, v, NoPE(), causal=True, attn_mask=shared_pad) == "sdpa-mask"
    assert attention_path(q, k, v, NoPE(), causal=True, attn_mask=row_pad) == "blockwise"  # (2, 1, 8, 8)
    assert attention_path(q, k, v, NoPE(), causal=True, attn_mask=torch.zeros(1, 1, 1, 8)) == "blockwise"  # float32 additive


def test_path_reference_cases():
    q, k, v = shapes()
    assert attention_path(q, k, v, ShawRelative(1), causal=True) == "reference"
    assert attention_path(q, k, v, TransformerXL(H, 1), causal=True) == "reference"
    assert attention_path(q, k, v, NoPE(), causal=True, return_weights=True) == "reference"
    for bad in (float("nan"), float("inf"), float("-inf")):
        for which in range(3):
            t = [q.clone(), k.clone(), v.clone()]
            t[which][0, 0, 3, 0] = bad
            assert attention_path(*t, ALiBi(H), causal=True) == "reference"
    mask = torch.zeros(8, 8)
    assert attention_path(q, k, v, NoPE(), attn_mask=mask) == "sdpa-mask"
    assert attention_path(q, k, v, NoPE(), attn_mask=mask.fill_diagonal_(float("-inf"))) == "sdpa-mask"
    assert attention_path(q, k, v, NoPE(), attn_mask=mask.fill_diagonal_(float("inf"))) == "reference"
    assert attention_path(q, k, v, NoPE(), attn_mask=mask.fill_diagonal_(float("nan"))) == "reference"
    assert attention_path(*shapes(b=0), ALiBi(H), causal=True) == "reference"
    assert attention_path(*shapes(lq=0), NoPE(), causal=True) == "reference"


def test_block_size_rule():
    assert block_size_for(32, 512) == 64 and block_size_for(32, 2048) == 128
    assert block_size_for(8, 512) == 128 and block_size_for(8, 2048) == 256
    assert block_size_for(1, 16384) == 512 and block_size_for(10**6, 128) == 64
    for bh in (1, 3, 32, 1000):
        for length in (1, 512, 513, 4096):
            s = block_size_for(bh, length)
            assert s in (64, 128, 256, 512)
            assert s == 64 or bh * s * s <= (1 << 17 if length <= 512 else 1 << 19)


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("cls", [NoPE, RotaryEmbedding, ALiBi, T5RelativeBias], ids=lambda c: c.__name__)
@pytest.mark.parametrize("forcing", ["sdpa", "blockwise-bias"])
def test_a_query_that_sees_nothing_gets_zeros(cls, forcing, monkeypatch):
    """Row 0 may attend no key: zero output and zero gradients, as in the reference."""
    for name, value in FORCINGS[forcing].items():
        monkeypatch.setattr(dispatch, name, value)
    scheme = make_scheme(cls)
    q, k, v, *_ = build_case("self-bidirectional", torch.float64)
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool)
    mask[0, :, 4] = False
    upstream = rand(2, H, 9, D, seed=5)
    ref, ref_grads = run(attention, scheme, q, k, v, None, None, mask, True, upstream)
    out, grads = run(fast_attention, scheme, q, k, v, None, None, mask, True, upstream)
    assert torch.equal(out[0, :, 4], torch.zeros(H, D))
    torch.testing.assert_close(out, ref, rtol=0, atol=bound(torch.float64, 9))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=grad_bound(g, r, torch.float64, upstream, v))
    assert torch.equal(grads[0][0, :, 4], torch.zeros(H, D))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls", [NoPE, RotaryEmbedding, ALiBi, T5RelativeBias], ids=lambda c: c.__name__)
def test_half_precision_is_computed_in_float32(cls, dtype):
    """Both paths compute in float32 from the same half inputs and round once at the end, so
    they differ by at most one unit in the last place of the half result (plus the float32
    bound, far below it)."""
    scheme = make_scheme(cls)
    q, k, v, *_ = build_case("self-causal", torch.float32)
    q, k, v = (t.detach().to(dtype) for t in (q, k, v))
    with torch.no_grad():
        out = fast_attention(q, k, v, scheme, causal=True)
        ref = attention(q, k, v, scheme, causal=True)
    assert out.dtype == dtype
    ulp = torch.finfo(dtype).eps * float(ref.float().abs().max())  # one ulp at the largest output
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=ulp + bound(torch.float32, 9))


def test_non_finite_values_follow_the_reference_rule():
    """A NaN value that a query cannot see never reaches it (the reference path is taken)."""
    q, k, v, *_ = build_case("self-causal", torch.float64)
    v = v.detach().clone()
    v[0, 0, 5, 0] = float("nan")
    out = fast_attention(q.detach(), k.detach(), v, ALiBi(H), causal=True)
    assert not out[0, 0, :5].isnan().any() and out[0, 0, 5:, 0].isnan().all()
    ref = attention(q.detach(), k.detach(), v, ALiBi(H), causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


def test_return_weights_are_the_reference_weights():
    q, k, v, *_ = build_case("self-causal", torch.float64)
    out, w = fast_attention(q, k, v, ALiBi(H), causal=True, return_weights=True)
    ref, ref_w = attention(q, k, v, ALiBi(H), causal=True, return_weights=True)
    assert torch.equal(out, ref) and torch.equal(w, ref_w)


def test_cache_shares_one_mask_between_calls(monkeypatch):
    monkeypatch.setattr(dispatch, "SDPA_GRAD_BIAS_PAIRS", 81)  # the float mask for these 9 x 9
    scheme = make_scheme(T5RelativeBias)
    q, k, v, *_ = build_case("self-causal", torch.float64)
    cache: dict = {}
    a = fast_attention(q, k, v, scheme, causal=True, cache=cache)
    assert len(cache) == 1
    (mask,) = cache.values()
    b = fast_attention(q, k, v, scheme, causal=True, cache=cache)
    assert len(cache) == 1 and next(iter(cache.values())) is mask and torch.equal(a, b)
    (a + b).sum().backward()  # the shared mask's gradient reaches the table from both calls
    twice = scheme.table.grad.clone()
    scheme.table.grad = None
    fast_attention(q, k, v, scheme, causal=True).sum().backward()
    torch.testing.assert_close(twice, 2 * scheme.table.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("call", [
    pytest.param(lambda f, q, k, v: f(q, k, v, causal="False"), id="causal-str"),
    pytest.param(lambda f, q, k, v: f(q, k, v, ALiBi(3), causal=True), id="heads"),
    pytest.param(lambda f, q, k, v: f(q, k, v, q_pos=torch.arange(9.0)), id="float-positions"),
    pytest.param(lambda f, q, k, v: f(q, k, v, scale=0.0), id="scale"),
    pytest.param(lambda f, q, k, v: f(q, k, v, attn_mask=torch.ones(3, 3, dtype=torch.bool)), id="mask-shape"),
    pytest.param(lambda f, q, k, v: f(q, k, v, attn_mask=torch.full((9, 9), 2)), id="int-mask-2"),
    pytest.param(lambda f, q, k, v: f(q, k, v, "alibi"), id="scheme-type"),
    pytest.param(lambda f, q, k, v: f(q[0], k, v), id="q-3d"),
    pytest.param(lambda f, q, k, v: f(q, k, v, return_weights=1), id="return_weights-int"),
])
@pytest.mark.parametrize("fn", [fast_attention, attention_path], ids=["fast_attention", "attention_path"])
def test_errors_are_the_references(call, fn):
    q, k, v, *_ = build_case("self-causal", torch.float32)
    with pytest.raises(Exception) as want:
        call(attention, q, k, v)
    with pytest.raises(type(want.value)) as got:
        call(fn, q, k, v)
    assert str(got.value) == str(want.value)


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("cls", ATTENTION_SCHEMES, ids=lambda c: c.__name__)
def test_tiny_decoder_auto_equals_reference(cls, padding):
    """The same model with attention_impl "auto" and "reference": same loss, same gradients
    (float64; every parameter, the scheme's included)."""
    results = []
    idx = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(3))
    for impl in ("auto", "reference"):
        torch.manual_seed(0)
        model = TinyDecoder(50, 16, H, 2, scheme=make_scheme(cls, head_dim=4), attention_impl=impl).double()
        kw = {}
        if padding:
            mask = torch.ones(2, 12, dtype=torch.long)
            mask[0, :3] = 0
            kw = dict(attn_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        logits = model(idx, **kw)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_r, grads_r) = results
    tol = bound(torch.float64, 12, d=16)
    torch.testing.assert_close(loss_a, loss_r, rtol=0, atol=tol)
    assert grads_a.keys() == grads_r.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_r[name], rtol=0, atol=tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_multi_head_attention_impl_argument():
    x = rand(2, 6, 16, dtype=torch.float32)
    torch.manual_seed(0)
    auto = MultiHeadAttention(16, H, ALiBi(H))
    torch.manual_seed(0)
    ref = MultiHeadAttention(16, H, ALiBi(H), attention_impl="reference")
    assert auto.attention_impl == "auto" and ref.attention_impl == "reference"
    torch.testing.assert_close(auto(x, causal=True), ref(x, causal=True), rtol=0, atol=bound(torch.float32, 6))
    out, w = auto(x, causal=True, return_weights=True)  # always the reference
    out_r, w_r = ref(x, causal=True, return_weights=True)
    assert torch.equal(out, out_r) and torch.equal(w, w_r)
    with pytest.raises(TypeError, match="return_weights must be a bool"):
        auto(x, causal=True, return_weights=0)  # checked on the fast path too
    for bad in ("fast", None, "Auto"):
        with pytest.raises(ValueError, match="attention_impl must be one of"):
            MultiHeadAttention(16, H, attention_impl=bad)
        with pytest.raises(ValueError, match="attention_impl must be one of"):
            TinyDecoder(50, 16, H, 1, attention_impl=bad)


# ----------------------------------------------------------------------------- query blocks


QB = dispatch.QUERY_BLOCK


def test_query_block_size():
    assert QB == 256 and "query-blocks" in ATTENTION_PATHS


def test_path_query_blocks_rule(monkeypatch):
    """"query-blocks": a score hook, no gradient wanted, causal self-attention over
    consecutive 1-D positions with the same start, no mask, q_len = k_len > QUERY_BLOCK; none
    of the other paths otherwise changes."""
    n = QB + 1
    q, k, v = shapes(lq=n, lk=n)
    shaw, xl, alibi, t5 = ShawRelative(1), TransformerXL(H, 1), ALiBi(H), T5RelativeBias(H, bidirectional=False)
    with torch.no_grad():
        for scheme in (shaw, xl):  # a score hook: any length past the block
            assert attention_path(q, k, v, scheme, causal=True) == "query-blocks"
            assert attention_path(q, k, v, scheme, torch.arange(5, 5 + n), torch.arange(5, 5 + n),
                                  causal=True) == "query-blocks"  # consecutive from another start
            assert attention_path(*shapes(lq=QB, lk=QB), scheme, causal=True) == "reference"  # not past it
            assert attention_path(q, k, v, scheme, causal=False) == "reference"
            assert attention_path(q, k, v, scheme, causal=True, return_weights=True) == "reference"
            mask = torch.ones(n, n, dtype=torch.bool)
            mask[3, 1] = False
            assert attention_path(q, k, v, scheme, causal=True, attn_mask=mask) == "reference"
            assert attention_path(q, k, v, scheme, causal=True, attn_mask=torch.zeros(n, n)) == "reference"
            assert attention_path(*shapes(lq=n, lk=n + 1), scheme, causal=True) == "reference"  # q_len != k_len
            gaps = torch.arange(0, 2 * n, 2)
            assert attention_path(q, k, v, scheme, gaps, gaps, causal=True) == "reference"  # not consecutive
            assert attention_path(q, k, v, scheme, torch.arange(1, n + 1), torch.arange(n),
                                  causal=True) == "reference"  # another start for the queries
            rows = torch.arange(n).expand(1, n)
            assert attention_path(q, k, v, scheme, rows, rows, causal=True) == "reference"  # per-row positions
            bad = q.clone()
            bad[0, 0, 0, 0] = float("nan")
            assert attention_path(bad, k, v, scheme, causal=True) == "reference"
        # a bias hook never: the block path computes the same blocks through the fused kernel
        big = shapes(lq=513, lk=513)
        for scheme in (alibi, t5):
            for limit in (0, 513 * 513):
                monkeypatch.setattr(dispatch, "SDPA_BIAS_PAIRS", limit)
                assert attention_path(*big, scheme, causal=True) == ("sdpa-bias" if limit else "blockwise")
        # rotate or embed schemes have fused SDPA without any bias
        for scheme in (RotaryEmbedding(2), NoPE(), SinusoidalEmbedding(16)):
            assert attention_path(*big, scheme, causal=True) == "sdpa-causal"
        # a window or a chunk keeps the rule
        assert attention_path(q, k, v, xl, causal=True, window=5) == "query-blocks"
        assert attention_path(q, k, v, shaw, causal=True, chunk=64) == "query-blocks"
    monkeypatch.undo()
    # With grad mode on, a scheme parameter or an input that requires a gradient rules it out.
    assert attention_path(q, k, v, shaw, causal=True) == "reference"
    assert attention_path(q.clone().requires_grad_(), k, v, shaw.requires_grad_(False), causal=True) == "reference"
    shaw.requires_grad_(True)
    shaw.requires_grad_(False)
    assert attention_path(q, k, v, shaw, causal=True) == "query-blocks"
    assert attention_path(q, k.clone().requires_grad_(), v, shaw, causal=True) == "reference"


class GridBias(companion.PositionScheme):
    """A grid scheme (two position axes) with a bias hook: not for the query-blocks path."""

    position_axes = 2

    def bias(self, q_pos, k_pos):
        return -(q_pos[:, None, 0] - k_pos[None, :, 0]).abs().double()[None, None]


def test_path_query_blocks_not_for_grid_positions():
    n = QB + 1
    q, k, v = (t.double() for t in shapes(lq=n, lk=n))
    grid = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)], -1)
    with torch.no_grad():
        assert attention_path(q, k, v, GridBias(), grid, grid, causal=True) == "reference"


def _perturbed(name: str):
    """The lab's scheme ``name`` for 4 heads of 16 dimensions (``build_scheme``, float64); a
    scheme with a score hook gets parameters far from its small start (CoPE's table starts
    at zero), so that the score is a large part of the logits."""
    scheme = build_scheme(name, d_model=64, n_heads=4, max_len=2048, train_len=128).double()
    if "score" in scheme.hooks():
        g = torch.Generator().manual_seed(len(name))
        with torch.no_grad():
            for p in scheme.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return scheme


def _logit_magnitude(scheme, q, k, pos, scale) -> float:
    """A bound on |scale * (q_rot . k_rot + score) + bias| (Cauchy-Schwarz for the product)."""
    qr, kr = scheme.rotate(q, k, pos, pos) if "rotate" in scheme.hooks() else (q, k)
    m = scale * float(qr.norm(dim=-1).max()) * float(kr.norm(dim=-1).max())
    if "score" in scheme.hooks():
        m += scale * float(scheme.score(qr, kr, pos, pos).abs().max())
    if "bias" in scheme.hooks():
        m += float(scheme.bias(pos, pos).abs().max())
    return m


@pytest.mark.parametrize("length, start", [(QB + 1, 0), (QB + 1, 37), (600, 37)])
@pytest.mark.parametrize("name", list(LAB_SCHEMES))
def test_query_blocks_match_the_reference_for_every_lab_scheme(name, length, start, monkeypatch):
    """Causal self-attention without a gradient, as the lab evaluates at long lengths, for
    every built-in lab scheme at lengths that are not multiples of QUERY_BLOCK, positions from 0
    and from an offset (with grouped keys there), in float64: the reference's output to the
    module docstring's bound, with m the largest magnitude involved (values, outputs, logits)."""
    scheme = _perturbed(name)
    hk = H if start == 0 else 2
    q = rand(1, H, length, 16, seed=1)
    k = rand(1, hk, length, 16, seed=2)
    v = rand(1, hk, length, 16, seed=3)
    pos = torch.arange(start, start + length)
    hooks = scheme.hooks()
    with torch.no_grad():
        ref = attention(q, k, v, scheme, pos, pos, causal=True)
        plain = attention(q, k, v, None, causal=True)
        m = max(float(v.abs().max()), float(ref.abs().max()),
                _logit_magnitude(scheme, q, k.repeat_interleave(H // hk, 1), pos, 16 ** -0.5))
        tol = bound(torch.float64, length, magnitude=m, d=16)
        forcings = [{}] if "bias" not in hooks else [{}, {"SDPA_BIAS_PAIRS": 0}]
        for forcing in forcings:
            for key, value in forcing.items():
                monkeypatch.setattr(dispatch, key, value)
            path = attention_path(q, k, v, scheme, pos, pos, causal=True)
            assert (path == "query-blocks") == ("score" in hooks), (path, forcing)
            out = fast_attention(q, k, v, scheme, pos, pos, causal=True)
            assert out.dtype == ref.dtype and out.shape == ref.shape
            torch.testing.assert_close(out, ref, rtol=0, atol=tol, msg=lambda msg: f"{path}: {msg}")
            monkeypatch.undo()
    if "score" in hooks or "bias" in hooks:  # not vacuous: the scheme moves the output
        assert float((ref - plain).abs().max()) > 1e3 * tol


# ----------------------------------------------------------------------------- the stored tile sizes


def test_the_stored_measurement_has_provenance_and_ships_with_the_package():
    """companion/data/attention_tiles.json: written by save_result (command, commit, machine),
    flagged "quick" or not, and matched by pyproject's package-data (so the wheel has it)."""
    import tomllib

    payload = companion.utils.load_result(dispatch.TILES_FILE)
    prov, data = payload["provenance"], payload["data"]
    assert prov["command"].startswith("python benchmarks/attention_tiles_cpu.py")
    assert {"git_commit", "cpu_model", "torch"} <= prov.keys()
    assert isinstance(data["quick"], bool) and ("--quick" in prov["command"]) == data["quick"]
    assert {r["mode"] for r in data["rows"]} == set(dispatch.MODES)
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["companion"]
    package = ROOT / "companion"
    assert any(dispatch.TILES_FILE in package.glob(g) for g in globs)


def test_the_docstring_cites_the_stored_path_measurement():
    """The ratios the module docstring gives for ALiBi, T5, KERPLE and FIRE through
    fast_attention are the ranges of chapters/data/attention_paths_cpu.json (written by
    benchmarks/attention_paths_cpu.py), and that run met the targets the docstring's numbers
    support: at most 2.5x SDPA is_causal forward, 3x forward plus backward, 0.1 of the bias."""
    payload = companion.utils.load_result(ROOT / "chapters" / "data" / "attention_paths_cpu.json")
    data = payload["data"]
    assert payload["provenance"]["command"].startswith("python benchmarks/attention_paths_cpu.py")
    assert (data["config"]["batch"], data["config"]["heads"], data["config"]["head_dim"]) == (1, 8, 64)
    assert data["config"]["lengths"] == [8192, 16384] and data["config"]["threads"] == 2
    doc = " ".join(dispatch.__doc__.split())

    def span(labels, mode, key="over_sdpa"):
        vals = [r[key] for r in data["results"] if r["label"] in labels and r["mode"] == mode]
        assert len(vals) == 2 * len(labels)  # both lengths
        return min(vals), max(vals)

    fwd, bwd = span(("alibi", "t5"), "forward"), span(("alibi", "t5"), "backward")
    peak = max(span(("alibi", "t5"), m, "peak_over_bias")[1] for m in ("forward", "backward"))
    assert fwd[1] <= 2.5 and bwd[1] <= 3.0 and peak <= 0.1
    assert (f"take {fwd[0]:.2f} to {fwd[1]:.2f} times the time of SDPA ``is_causal`` without a bias forward, "
            f"and {bwd[0]:.2f} to {bwd[1]:.2f} times forward plus backward, with a peak extra memory of "
            f"at most {math.ceil(peak * 1000) / 1000:.3f} of the materialised float32 bias") in doc
    kf, kb = span(("kerple",), "forward"), span(("kerple",), "backward")
    assert f"KERPLE {kf[0]:.2f} to {kf[1]:.2f} and {kb[0]:.2f} to {kb[1]:.2f} times" in doc
    ff = span(("fire",), "forward") + span(("fire",), "backward")
    assert f"{min(ff):.2f} to {max(ff):.2f} times" in doc


def test_the_docstring_table_is_the_stored_measurement():
    """The table in the module docstring is tile_table()'s, regenerated from the stored file
    (python benchmarks/attention_tiles_cpu.py --write-docstring), not typed."""
    doc = dispatch.__doc__
    start = doc.index(".. begin tile table\n") + len(".. begin tile table\n")
    end = doc.index("\n.. end tile table")
    assert doc[start:end].strip("\n") == dispatch.tile_table()
    rows = companion.utils.load_result(dispatch.TILES_FILE)["data"]["rows"]
    for r in rows:  # every stored row's fastest block is in the table
        block = min(r["blocks"], key=lambda b: (r["blocks"][b], int(b)))
        assert f"{block}: {r['blocks'][block]:.2f}" in doc


SYNTHETIC = {"quick": True, "threads": 1, "rows": [
    {"mode": mode, "batch": 1, "heads": bh, "head_dim": d, "length": n, "sdpa_bias": None,
     "blocks": {"64": 1.0 + (best != 64), "128": 1.0 + (best != 128), "256": 1.0 + (best != 256)}}
    for mode in dispatch.MODES
    for (d, bh, n, best) in [(16, 8, 512, 64), (16, 8, 2048, 128), (64, 8, 512, 256), (16, 32, 512, 128)]]}


def test_fused_block_size_takes_the_nearest_measured_shape(monkeypatch):
    """Nearest head dim and batch * heads (base-2 logarithms), then the nearest length."""
    monkeypatch.setattr(dispatch, "_tiles", lambda: SYNTHETIC)
    for mode in dispatch.MODES:
        assert dispatch.fused_block_size(8, 512, 16, mode) == 64  # a stored shape
        assert dispatch.fused_block_size(10, 1000, 30, mode) == 64  # d 30 nearer 16, 10 nearer 8, 1000 nearer 512
        assert dispatch.fused_block_size(10, 1100, 30, mode) == 128  # 1100 nearer 2048 (log scale)
        assert dispatch.fused_block_size(8, 512, 40, mode) == 256  # d 40 nearer 64
        assert dispatch.fused_block_size(20, 100, 16, mode) == 128  # 20 nearer 32 than 8
    with pytest.raises(ValueError, match=r"mode must be one of \('forward', 'backward', 'bias-grad'\), got 'fwd'"):
        dispatch.fused_block_size(8, 512, 16, "fwd")
    monkeypatch.undo()
    for r in companion.utils.load_result(dispatch.TILES_FILE)["data"]["rows"]:  # the real file: its own rows
        block = min(r["blocks"], key=lambda b: (r["blocks"][b], int(b)))
        assert dispatch.fused_block_size(r["batch"] * r["heads"], r["length"], r["head_dim"], r["mode"]) == int(block)


def test_the_block_path_uses_the_measured_block(monkeypatch):
    """fast_attention's "blockwise" path asks fused_block_size for its shape and mode."""
    seen = []
    monkeypatch.setattr(dispatch, "fused_block_size", lambda *a: seen.append(a) or 16)
    monkeypatch.setattr(dispatch, "SDPA_BIAS_PAIRS", 0)
    monkeypatch.setattr(dispatch, "SDPA_GRAD_BIAS_PAIRS", 0)
    q, k, v, *_ = build_case("gqa-causal", torch.float64)
    with torch.no_grad():
        fast_attention(q, k, v, ALiBi(H), causal=True)
    fast_attention(q, k, v, ALiBi(H), causal=True)
    fast_attention(q, k, v, make_scheme(T5RelativeBias), causal=True)
    fast_attention(q, k, v, None, causal=True, window=3)
    assert seen == [(2 * H, 9, D, "forward", None, None), (2 * H, 9, D, "backward", None, None),
                    (2 * H, 9, D, "bias-grad", None, None), (2 * H, 9, D, "backward", 3, None)]


@pytest.mark.parametrize("mode", dispatch.MODES)
def test_a_window_caps_the_block(mode, monkeypatch):
    """A block of B queries sees up to w + B keys of a window or chunk of w: the block is the
    measured one, at most the largest power of two <= w / 2, at least 64."""
    monkeypatch.setattr(dispatch, "_tiles", lambda: SYNTHETIC)
    assert dispatch.fused_block_size(8, 512, 64, mode) == 256
    for w, want in ((10**6, 256), (512, 256), (511, 128), (300, 128), (256, 128), (255, 64), (128, 64), (1, 64)):
        assert dispatch.fused_block_size(8, 512, 64, mode, window=w) == want
        assert dispatch.fused_block_size(8, 512, 64, mode, chunk=w) == want
        assert dispatch.fused_block_size(8, 512, 64, mode, window=w, chunk=10**6) == want
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        dispatch.fused_block_size(8, 512, 64, mode, window=0)
