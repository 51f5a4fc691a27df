"""companion.blockwise.fused_bias_attention: the fused-kernel block path against the reference.

The path calls torch's fused CPU attention kernel once per block of queries (and once per
key run with ``block_size=(block_q, block_k)``, merged by log-sum-exp), with a bias that
depends only on ``k - q`` read from one vector over the offsets through strided views of the
reversed queries; other biases (FIRE, per-row positions) one tile per call. Its backward
pass is torch's fused backward kernel, or, when a bias parameter needs a gradient, an
explicit recomputation whose logits' gradient is summed along the offsets.

Every case runs in float32 (or float16/bfloat16) and is compared with the float64 reference
:func:`companion.attention.attention` within the entry-wise rounding-error bounds of
:func:`helpers.attention_error_bounds` (forward and backward, the table gradient of T5 and
of a learned relative table included). Parameters without such a bound (KERPLE's, FIRE's) are
compared in float64, to the bound of tests/test_dispatch.py. Sizes are small but never a
multiple of the blocks (``L = 70``, blocks of 16: five query blocks, the last partial).
"""

from __future__ import annotations

import copy

import pytest
import torch

from companion import FIRE, ALiBi, KerpleBias, T5RelativeBias, attention
from companion import blockwise
from companion.blockwise import _Plan, fused_bias_attention
from companion.attention import _prologue
from helpers import TableBias, assert_within_rounded, attention_error_bounds, rand

B, H, D, L = 2, 4, 16, 70


def make(name: str) -> torch.nn.Module | None:
    """A float64 scheme with parameters away from their start (a wrong gradient shows)."""
    torch.manual_seed(3)
    if name == "none":
        return None
    scheme = {
        "alibi": lambda: ALiBi(H),
        "t5": lambda: T5RelativeBias(H, num_buckets=8, max_distance=20, bidirectional=True),
        "table": lambda: TableBias(H, max_dist=9),
        "kerple": lambda: KerpleBias(H, form="log"),
        "fire": lambda: FIRE(H, init_L=30.0),
    }[name]().double()
    with torch.no_grad():
        for p in scheme.parameters():
            p.add_(0.3 * rand(p.numel(), seed=11).view(p.shape))
    return scheme


# (q_len, k_len, kv_heads, causal, mask, positions)
CONFIGS = {
    "causal": (L, L, H, True, None, None),
    "bidirectional": (L, L, H, False, None, None),
    "gqa": (L, L, 2, True, None, None),
    "decode": (5, L, H, True, None, None),
    "chunk-of-queries": (37, L, 2, True, None, None),
    "padding": (L, L, H, True, "padding", None),
    "float-mask": (L, L, H, False, "float", None),
    "shifted": (L, L, H, True, None, "shifted"),
    "per-row": (L, L, H, True, "padding", "per-row"),
}


def case(config: str, dtype: torch.dtype, seed: int = 0):
    """q, k, v (float64, requiring grad), positions, mask and causal flag of a configuration."""
    lq, lk, hk, causal, mask_kind, pos_kind = CONFIGS[config]
    q, k, v = (rand(B, n, length, D, seed=seed + i).requires_grad_()
               for i, (n, length) in enumerate([(H, lq), (hk, lk), (hk, lk)], start=1))
    keep = torch.ones(B, lk, dtype=torch.bool)
    keep[0, :6] = False  # row 0 is left-padded
    q_pos = k_pos = None
    if pos_kind == "shifted":
        k_pos = torch.arange(40, 40 + lk)
        q_pos = k_pos[lk - lq:]
    elif pos_kind == "per-row":
        k_pos = (keep.long().cumsum(-1) - 1).clamp(min=0)
        q_pos = k_pos[:, lk - lq:]
    mask = None
    if mask_kind == "padding":
        mask = keep[:, None, None, :]
    elif mask_kind == "float":
        mask = torch.where(keep, 0.0, float("-inf"))[:, None, None, :].double() + 0.5 * rand(1, H, lq, lk, seed=9)
    return q, k, v, q_pos, k_pos, mask, causal


def grads_of(fn, inputs):
    out = fn()
    dout = rand(*out.shape, seed=17)
    return out, torch.autograd.grad(out, inputs, dout.to(out.dtype)), dout


@pytest.mark.parametrize("block", [16, (16, 32), (64, 16)], ids=["16", "16x32", "64x16"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", ["alibi", "t5", "table", "kerple", "fire", "none"])
def test_float32_matches_the_float64_reference(name, config, block):
    """Output and gradients of q, k, v (and of T5's or a learned table) in float32, against
    the float64 reference, within the derived bounds (``blocks``: the key runs merged, each
    an online softmax of the kernel's)."""
    scheme = make(name)
    q64, k64, v64, q_pos, k_pos, mask, causal = case(config, torch.float64)
    table = getattr(scheme, "table", None)
    q, k, v = (t.detach().float().requires_grad_() for t in (q64, k64, v64))
    mask32 = None if mask is None or mask.dtype == torch.bool else mask.float()
    mask32 = mask if mask32 is None else mask32
    extra = [] if table is None else [table]
    out, grads, dout = grads_of(lambda: fused_bias_attention(q, k, v, scheme, causal=causal, q_pos=q_pos, k_pos=k_pos,
                                                             attn_mask=mask32, block_size=block), [q, k, v, *extra])
    assert out.dtype == torch.float32
    ref, ref_grads, _ = grads_of(lambda: attention(q64, k64, v64, scheme, q_pos, k_pos, causal=causal, attn_mask=mask),
                                 [q64, k64, v64, *extra])
    runs = -(-k64.shape[2] // 16)  # at most this many runs and kernel blocks are merged per row
    bounds = attention_error_bounds(q64, k64, v64, dout.double(), scheme, q_pos, k_pos, causal, None, mask,
                                     torch.float32, blocks=runs)
    for name_, x, x64 in zip(["out", "dq", "dk", "dv", "dtable"], (out, *grads), (ref, *ref_grads)):
        assert_within_rounded(x, x64, bounds[name_], name_)
    if scheme is not None:  # not vacuous: the bias moves the output
        plain = attention(q64.detach(), k64.detach(), v64.detach(), None, q_pos, k_pos, causal=causal, attn_mask=mask)
        assert float((plain - ref.detach()).abs().max()) > 1e3 * float(bounds["out"].max())


def f64_bound(length: int, magnitude: float) -> float:
    """tests/test_dispatch.py's ``C (d + 2 L) eps m`` in float64."""
    return 8 * (D + 2 * length) * torch.finfo(torch.float64).eps * magnitude


@pytest.mark.parametrize("config", ["causal", "bidirectional", "decode", "padding", "per-row"])
@pytest.mark.parametrize("name", ["t5", "kerple", "fire", "table"])
def test_bias_parameter_gradients_are_exact(name, config):
    """In float64: the gradients of every bias parameter (T5's table, KERPLE's, FIRE's MLP and
    its L), through the explicit backward pass (a summed band or per-call tiles)."""
    scheme = make(name)
    q, k, v, q_pos, k_pos, mask, causal = case(config, torch.float64)
    params = [q, k, v, *scheme.parameters()]
    out, grads, _ = grads_of(lambda: fused_bias_attention(q, k, v, scheme, causal=causal, q_pos=q_pos, k_pos=k_pos,
                                                          attn_mask=mask, block_size=(16, 32)), params)
    ref, ref_grads, _ = grads_of(lambda: attention(q, k, v, scheme, q_pos, k_pos, causal=causal, attn_mask=mask), params)
    m = max(4.0, float(ref.detach().abs().max()))
    torch.testing.assert_close(out, ref, rtol=0, atol=f64_bound(L, m))
    for g, r in zip(grads, ref_grads):
        # a parameter's gradient sums the logits' gradient over up to batch * L * L pairs
        torch.testing.assert_close(g, r, rtol=0, atol=f64_bound(B * L * L, m) * max(1.0, float(r.abs().max())))
    assert any(float(g.abs().max()) > 0 for g in grads[3:])  # not vacuous


@pytest.mark.parametrize("name", ["alibi", "t5", "fire", "none"])
def test_a_query_that_may_see_nothing_gets_zeros(name):
    """A query whose keys are all masked (here row 0's query 30, by a padding-style mask),
    and queries whose positions precede every key: zero output and zero gradients, as in the
    reference; the other queries as the reference."""
    scheme = make(name)
    q, k, v, *_ = case("bidirectional", torch.float64)
    mask = torch.ones(B, 1, L, L, dtype=torch.bool)
    mask[0, :, 30] = False
    params = [q, k, v]
    out, grads, _ = grads_of(lambda: fused_bias_attention(q, k, v, scheme, causal=True, attn_mask=mask,
                                                          block_size=(16, 32)), params)
    ref, ref_grads, _ = grads_of(lambda: attention(q, k, v, scheme, causal=True, attn_mask=mask), params)
    assert torch.equal(out[0, :, 30], torch.zeros(H, D)) and torch.equal(grads[0][0, :, 30], torch.zeros(H, D))
    torch.testing.assert_close(out, ref, rtol=0, atol=f64_bound(L, 4.0))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=f64_bound(L, 4.0) * max(1.0, float(r.abs().max())) * 2)
    # every query before every key: nothing to see anywhere
    early = fused_bias_attention(q, k, v, scheme, causal=True, q_pos=torch.arange(L), k_pos=torch.arange(L, 2 * L),
                                 block_size=16)
    assert torch.equal(early, torch.zeros_like(early))
    (g,) = torch.autograd.grad(early.sum(), [q])
    assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["alibi", "t5"])
def test_half_precision_inputs_are_computed_in_float32(name, dtype):
    """fp16/bf16 inputs: float32 arithmetic, the result rounded once to the input dtype; within
    the bounds for a computation in that dtype (which also allow rounding P and dS to it)."""
    scheme = make(name)
    q64, k64, v64, _, _, _, _ = case("gqa", torch.float64)
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))  # the rounded inputs, exactly
    extra = [scheme.table] if name == "t5" else []
    out, grads, dout = grads_of(lambda: fused_bias_attention(q, k, v, scheme, causal=True, block_size=(16, 32)),
                                [q, k, v, *extra])
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads[:3])
    ref, ref_grads, _ = grads_of(lambda: attention(q64, k64, v64, scheme, causal=True), [q64, k64, v64, *extra])
    bounds = attention_error_bounds(q64, k64, v64, dout.double(), scheme, None, None, True, None, None, dtype,
                                    blocks=5)
    for name_, x, x64 in zip(["out", "dq", "dk", "dv", "dtable"], (out, *grads), (ref, *ref_grads)):
        assert_within_rounded(x, x64, bounds[name_], name_)


def test_fallback_paths_compute_the_same(monkeypatch):
    """Where the fused kernel does not apply (switched off here; v_dim != head_dim; a NaN),
    the explicit tile loop gives the reference's result, NaN rule included."""
    scheme = make("t5")
    q, k, v, *_ = case("causal", torch.float64)
    ref = attention(q, k, v, scheme, causal=True)
    got = fused_bias_attention(q, k, v, scheme, causal=True, block_size=16)
    monkeypatch.setattr(blockwise, "USE_FUSED", False)
    off = fused_bias_attention(q, k, v, scheme, causal=True, block_size=16)
    monkeypatch.undo()
    for x in (got, off):
        torch.testing.assert_close(x, ref, rtol=0, atol=f64_bound(L, 4.0))
    narrow = v[..., :5]
    torch.testing.assert_close(fused_bias_attention(q, k, narrow, scheme, causal=True, block_size=16),
                               attention(q, k, narrow, scheme, causal=True), rtol=0, atol=f64_bound(L, 4.0))
    bad = v.detach().clone()
    bad[0, 0, 40, 0] = float("nan")
    out = fused_bias_attention(q.detach(), k.detach(), bad, scheme, causal=True, block_size=16)
    assert not out[0, 0, :40].isnan().any() and out[0, 0, 40:, 0].isnan().all()


def test_the_offsets_vector_is_the_bias_seen_backwards():
    """The index arithmetic of the band: for every run, the strided view of the offsets'
    vector equals the bias tile of its positions with the causal and window masks, rows in
    reverse order (an independent construction: the scheme's bias at the run's positions)."""
    scheme = make("t5")
    q, k, v, *_ = case("decode", torch.float64)
    k_pos = torch.arange(11, 11 + L)
    q_pos = k_pos[-5:]
    for window in (None, 9):
        pro = _prologue(q, k, v, scheme, q_pos, k_pos, causal=True, window=window)
        plan = _Plan(scheme.bias, pro, 2, 16)
        runs = plan.runs(2)
        assert plan.banded and len(runs) > 1
        diag = plan.diagonal(runs, torch.float64)
        for run in runs:
            qs, qe, ks, ke = plan.span(run)
            qp, kp = q_pos[qs:qe], k_pos[ks:ke]
            want = scheme.bias(qp, kp).detach()
            hidden = (kp[None] > qp[:, None]) | (kp[None] <= qp[:, None] - (window or 10**9))
            want = want.masked_fill(hidden, float("-inf")).flip(-2)
            assert torch.equal(plan.diagonal_view(run, *diag)[0].detach(), want)


def test_kernel_blocks_merge_exactly():
    """The same function for every block shape: one call per query block, or key runs of 16
    merged by their log-sum-exps (float64, to rounding)."""
    scheme = make("alibi")
    q, k, v, *_ = case("causal", torch.float64)
    outs = [fused_bias_attention(q, k, v, scheme, causal=True, block_size=bs) for bs in (70, 7, (16, 16), (8, None))]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=f64_bound(L, 4.0))


def test_measured_block_sizes_by_default(monkeypatch):
    """block_size=None: the dispatcher's measured choice for the call's shape and mode."""
    seen = []
    from companion import dispatch

    real = dispatch.fused_block_size
    monkeypatch.setattr(dispatch, "fused_block_size", lambda *a: seen.append(a) or real(*a))
    scheme = make("t5")
    q, k, v, *_ = case("gqa", torch.float64)
    with torch.no_grad():
        fused_bias_attention(q, k, v, scheme, causal=True)
    fused_bias_attention(q, k, v, copy.deepcopy(scheme).requires_grad_(False), causal=True)
    fused_bias_attention(q, k, v, scheme, causal=True)
    fused_bias_attention(q, k, v, scheme, causal=True, window=9, chunk=30)
    assert seen == [(B * H, L, D, "forward", None, None), (B * H, L, D, "backward", None, None),
                    (B * H, L, D, "bias-grad", None, None), (B * H, L, D, "bias-grad", 9, 30)]


@pytest.mark.parametrize("bad, error, match", [
    (0, ValueError, r"block_size must be >= 1, got 0"),
    (True, TypeError, r"block_size must be an int, got bool"),
    ((16,), ValueError, r"block_size must be an int or a pair \(block_q, block_k\)"),
    ((16, 0), ValueError, r"block_size\[1\] must be >= 1, got 0"),
    ((None, 16), TypeError, r"block_size\[0\] must be an int, got NoneType"),
    (2.5, TypeError, r"block_size must be an int, got float"),
])
def test_block_size_errors(bad, error, match):
    q, k, v, *_ = case("causal", torch.float64)
    with pytest.raises(error, match=match):
        fused_bias_attention(q, k, v, make("alibi"), causal=True, block_size=bad)


def test_errors_name_the_function():
    q, k, v, *_ = case("causal", torch.float64)
    from companion import ShawRelative

    with pytest.raises(ValueError, match=r"fused_bias_attention honours only the bias hook, but ShawRelative"):
        fused_bias_attention(q, k, v, ShawRelative(D, max_distance=3), causal=True)
    with pytest.raises(ValueError, match=r"window=4 needs causal=True"):
        fused_bias_attention(q, k, v, make("alibi"), window=4)
