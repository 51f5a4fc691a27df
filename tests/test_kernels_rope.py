"""The fused RoPE kernel (companion.kernels.fused_rope) against the references.

tests/conftest.py sets TRITON_INTERPRET=1 before anything imports companion, so on this CPU
the Triton kernel itself runs, through Triton's interpreter. The references are
companion.rope.apply_rope (whose exact float32 arithmetic the kernel must reproduce bit for
bit) and an independent transcription of HuggingFace's ``q * cos + rotate_half(q) * sin``.
Dispatch without the interpreter, and without Triton at all, is tested in subprocesses.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from companion.kernels import MAX_ROPE_HEAD_DIM, fused_rope, kernel_backend
from companion.rope import apply_rope, rope_cos_sin, rope_frequencies
from helpers import U32, U_FP16, assert_within, rotation_tol
from helpers import rand32 as rand

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = kernel_backend(torch.device("cpu")) == "triton-interpreter"


@pytest.fixture(autouse=True)
def _needs_the_interpreter(request):
    """Kernel tests need Triton (TRITON_INTERPRET=1 is set by tests/conftest.py); the
    dispatch tests run in subprocesses and need neither."""
    if not INTERPRETED and not request.node.name.startswith("test_dispatch"):
        pytest.skip("needs Triton, run with TRITON_INTERPRET=1")


def tables(n, rotary_dim, base=10000.0):
    return rope_cos_sin(n, rope_frequencies(rotary_dim, base))


def hf_half_rope(x, cos, sin, r):
    """HuggingFace's formula on the first r dims, written out here: full-width tables."""
    c, s = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    xr = x[..., :r].float()
    rot = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), -1)
    return torch.cat(((xr * c + rot * s).to(x.dtype), x[..., r:]), -1)


def truncate_to_bf16(x32):
    """float32 -> bfloat16 by dropping the low 16 bits (what Triton's interpreter does)."""
    return (x32.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


POSITION_MODES = ["none", "int_offset", "tensor_offset", "shared_positions", "row_positions",
                  "gathered", "gathered_shared"]


def position_kwargs(mode, batch, seq, table_len, cos, sin, seed=0):
    """(cos, sin, kwargs) for one way of choosing the table rows."""
    g = torch.Generator().manual_seed(seed)
    if mode == "none":
        return cos, sin, {}
    if mode == "int_offset":
        return cos, sin, {"offset": table_len - seq}
    if mode == "tensor_offset":
        return cos, sin, {"offset": torch.randint(0, table_len - seq + 1, (batch,), generator=g)}
    if mode == "shared_positions":
        return cos, sin, {"positions": torch.randint(0, table_len, (seq,), generator=g)}
    if mode == "row_positions":
        return cos, sin, {"positions": torch.randint(0, table_len, (batch, seq), generator=g)}
    pos = torch.randint(0, table_len, (batch if mode == "gathered" else 1, seq), generator=g)
    return cos[pos], sin[pos], {}


# ----------------------------------------------------------------------------- forward, exact


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, None), (80, None), (128, None), (128, 32), (80, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_equals_apply_rope_bit_for_bit(layout, head_dim, rotary_dim, dtype):
    batch, seq, table_len = 2, 37, 50  # seq is no multiple of any block size
    r = rotary_dim or head_dim
    q = rand(batch, 4, seq, head_dim, dtype=dtype, seed=1)
    k = rand(batch, 2, seq, head_dim, dtype=dtype, seed=2)  # grouped-query: fewer key heads
    cos0, sin0 = tables(table_len, r)
    for i, mode in enumerate(POSITION_MODES):
        cos, sin, kw = position_kwargs(mode, batch, seq, table_len, cos0, sin0, seed=i)
        ours = fused_rope(q, k, cos, sin, layout=layout, rotary_dim=rotary_dim, **kw)
        ref = apply_rope(q, k, cos, sin, layout=layout, rotary_dim=rotary_dim, **kw)
        for a, b in zip(ours, ref):
            assert a.dtype == dtype and a.shape == b.shape
            assert torch.equal(a, b), (mode, float((a.float() - b.float()).abs().max()))


@pytest.mark.parametrize("rotary_dim", [None, 64])
def test_half_layout_equals_huggingface_formula(rotary_dim):
    q, k = rand(1, 3, 150, 128, seed=3), rand(1, 3, 150, 128, seed=4)  # 150 > one 128-row block
    r = rotary_dim or 128
    cos, sin = tables(150, r)
    qo, ko = fused_rope(q, k, cos, sin, rotary_dim=rotary_dim)
    assert torch.equal(qo, hf_half_rope(q, cos, sin, r))
    assert torch.equal(ko, hf_half_rope(k, cos, sin, r))
    if rotary_dim:
        assert torch.equal(qo[..., r:], q[..., r:])


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_bfloat16_is_the_float32_result_cast_once(layout):
    q, k = rand(2, 2, 40, 64, dtype=torch.bfloat16, seed=5), rand(2, 1, 40, 64, dtype=torch.bfloat16, seed=6)
    cos, sin = tables(40, 64)
    exact = apply_rope(q.float(), k.float(), cos, sin, layout=layout)  # the float32 arithmetic
    ours = fused_rope(q, k, cos, sin, layout=layout)
    interpreted = kernel_backend(q) == "triton-interpreter"
    for a, e in zip(ours, exact):
        # The float32 arithmetic is exact; only the final cast differs: the interpreter casts
        # float32 -> bf16 by truncation, a GPU rounds to nearest even.
        assert torch.equal(a, truncate_to_bf16(e) if interpreted else e.to(torch.bfloat16))
        if interpreted:  # the two casts differ here, so the check above discriminates
            assert not torch.equal(truncate_to_bf16(e), e.to(torch.bfloat16))


@settings(max_examples=12)
@given(
    batch=st.integers(1, 3), heads=st.integers(1, 3), kv_heads=st.integers(1, 3), seq=st.integers(1, 70),
    half=st.integers(1, 40), extra=st.integers(0, 9), layout=st.sampled_from(["half", "interleaved"]),
    mode=st.sampled_from(POSITION_MODES), seed=st.integers(0, 2**16),
)
def test_forward_property(batch, heads, kv_heads, seq, half, extra, layout, mode, seed):
    r = 2 * half
    d = r + extra
    table_len = seq + 5
    q, k = rand(batch, heads, seq, d, seed=seed), rand(batch, kv_heads, seq, d, seed=seed + 1)
    cos, sin, kw = position_kwargs(mode, batch, seq, table_len, *tables(table_len, r), seed=seed)
    ours = fused_rope(q, k, cos, sin, layout=layout, rotary_dim=r, **kw)
    ref = apply_rope(q, k, cos, sin, layout=layout, rotary_dim=r, **kw)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


# ----------------------------------------------------------------------------- backward


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, None), (80, 40), (128, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["int_offset", "row_positions"])
def test_backward_equals_autograd_of_apply_rope(layout, head_dim, rotary_dim, dtype, mode):
    batch, seq = 2, 45
    cos, sin, kw = position_kwargs(mode, batch, seq, 60, *tables(60, rotary_dim or head_dim))
    grads = []
    for fn in (fused_rope, apply_rope):
        q = rand(batch, 4, seq, head_dim, dtype=dtype, seed=7).requires_grad_()
        k = rand(batch, 2, seq, head_dim, dtype=dtype, seed=8).requires_grad_()
        qo, ko = fn(q, k, cos, sin, layout=layout, rotary_dim=rotary_dim, **kw)
        upstream = (rand(*qo.shape, dtype=dtype, seed=9), rand(*ko.shape, dtype=dtype, seed=10))
        dq, dk = torch.autograd.grad((qo, ko), (q, k), upstream)
        grads.append((dq, dk))
    for a, b, g in zip(*grads, upstream):
        assert a.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(a, b)
        else:
            # Each side rotates the upstream pair (g_a, g_b) back in float32 (two products and a
            # sum, in another order): the float32 results x, y are each within
            # 2 U32 (|g_a| + |g_b|) of the exact product, 4 U32 (|g_a| + |g_b|) apart; rounding
            # each to fp16 adds U_FP16 |x| + U_FP16 |y| <= U_FP16 (1 + 2 U_FP16) (|a| + |b|).
            r = rotary_dim or head_dim
            tol = (rotation_tol(g, 0.0, layout, r, u=U32, per_angle=0, const=4)
                   + U_FP16 * (1 + 2 * U_FP16) * (a.double().abs() + b.double().abs()))
            assert_within(a, b, tol)


def test_backward_is_the_inverse_rotation():
    """Rotating by +angle forward then pulling a gradient back rotates it by -angle: with
    g = rope(x), the gradient of <rope(x), g> w.r.t. x is x itself (up to float32 rounding)."""
    q = rand(1, 2, 33, 64, seed=11).requires_grad_()
    k = rand(1, 2, 33, 64, seed=12).requires_grad_()
    cos, sin = tables(40, 64)
    qo, ko = fused_rope(q, k, cos, sin, offset=7)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (qo.detach(), ko.detach()))
    # Forward and backward use the same float32 tables c, s: R^T R = (c^2 + s^2) I with
    # |c^2 + s^2 - 1| <= 4 U32 (each entry within one ulp). Per coordinate of a pair (a, b):
    # the forward's two products and sum add 2 U32 (|a| + |b|), which R^T carries into
    # 4 U32 (|a| + |b|); R^T R adds 4 U32 (|a| + |b|); the backward's own roundings
    # 2 U32 (|a'| + |b'|) <= 2 sqrt(2) U32 (1 + 2 U32) (|a| + |b|). In all < 12 U32 (|a| + |b|).
    for grad, x in ((dq, q), (dk, k)):
        assert_within(grad, x, rotation_tol(x, 0.0, "half", 64, u=U32, per_angle=0, const=12))


def test_gradient_of_only_q_and_noncontiguous_rows():
    """k without grad; q a transposed (batch, seq, heads, dim) view: strides are honoured."""
    base = rand(2, 30, 4, 64, seed=13)
    q = base.transpose(1, 2).requires_grad_()
    assert not q.is_contiguous()
    k = rand(2, 4, 30, 64, seed=14)
    cos, sin = tables(30, 64)
    qo, ko = fused_rope(q, k, cos, sin, layout="interleaved")
    rq, rk = apply_rope(q.detach(), k, cos, sin, layout="interleaved")
    assert torch.equal(qo, rq) and torch.equal(ko, rk)
    (dq,) = torch.autograd.grad(qo.sum(), q)
    (dref,) = torch.autograd.grad(apply_rope(q, k, cos, sin, layout="interleaved")[0].sum(), q)
    assert torch.equal(dq, dref)


def test_table_gradients_take_the_reference_path():
    q, k = rand(1, 2, 10, 32, seed=15), rand(1, 2, 10, 32, seed=16)
    cos, sin = tables(10, 32)
    cos.requires_grad_()
    qo, _ = fused_rope(q, k, cos, sin)
    (gc,) = torch.autograd.grad(qo.sum(), cos)
    (gr,) = torch.autograd.grad(apply_rope(q, k, cos, sin)[0].sum(), cos)
    assert torch.equal(gc, gr)


# ----------------------------------------------------------------------------- in place, float64


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_inplace(layout, dtype):
    q, k = rand(2, 3, 21, 80, dtype=dtype, seed=17), rand(2, 1, 21, 80, dtype=dtype, seed=18)
    cos, sin = tables(30, 40)
    ref = apply_rope(q, k, cos, sin, layout=layout, rotary_dim=40, offset=torch.tensor([0, 9]))
    qi, ki = q.clone(), k.clone()
    out = fused_rope(qi, ki, cos, sin, layout=layout, rotary_dim=40, offset=torch.tensor([0, 9]), inplace=True)
    assert out[0] is qi and out[1] is ki
    assert torch.equal(qi, ref[0]) and torch.equal(ki, ref[1])
    assert torch.equal(qi[..., 40:], q[..., 40:])  # pass-through dims untouched


def test_float64_takes_the_reference_path():
    q, k = rand(1, 2, 9, 16, dtype=torch.float64), rand(1, 2, 9, 16, dtype=torch.float64, seed=1)
    cos, sin = rope_cos_sin(9, rope_frequencies(16), compute_dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(fused_rope(q, k, cos, sin), apply_rope(q, k, cos, sin)))


def test_empty_sequence():
    q, k = rand(1, 2, 0, 16), rand(1, 2, 0, 16)
    cos, sin = tables(4, 16)
    qo, ko = fused_rope(q, k, cos, sin)
    assert qo.shape == q.shape and ko.shape == k.shape


def test_what_apply_rope_takes_fused_rope_takes():
    """Mixed q/k dtypes (one launch), a head_dim above the kernel's limit and a strided last
    dimension (the reference) give apply_rope's result bit for bit, in and out of place."""
    q, k = rand(1, 2, 8, 64), rand(1, 2, 8, 64)
    cos, sin = tables(8, 64)
    strided = rand(1, 2, 8, 128)[..., ::2]
    big = MAX_ROPE_HEAD_DIM + 2
    cases = [(q, k.half(), cos, sin), (strided, k, cos, sin), (q, strided, cos, sin),
             (rand(1, 1, 2, big), rand(1, 1, 2, big), *tables(2, big))]
    for inplace in (False, True):
        for qq, kk, c, s in cases:
            want = apply_rope(qq.clone(), kk.clone(), c, s)
            got = fused_rope(qq.clone(), kk.clone(), c, s, inplace=inplace)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and torch.equal(g, w)


# ----------------------------------------------------------------------------- errors


def test_errors():
    q, k = rand(1, 2, 8, 64), rand(1, 2, 8, 64)
    cos, sin = tables(8, 64)
    with pytest.raises(TypeError, match="q must be a floating-point"):
        fused_rope(q.long(), k.long(), cos, sin)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        fused_rope(q, k, cos, sin, rotary_dim=63)
    with pytest.raises(ValueError, match=r"rotary_dim must be <= head_dim \(64\)"):
        fused_rope(q, k, cos, sin, rotary_dim=66)
    with pytest.raises(TypeError, match="rotary_dim must be an int"):
        fused_rope(q, k, cos, sin, rotary_dim=32.0)
    with pytest.raises(ValueError, match="layout must be one of"):
        fused_rope(q, k, cos, sin, layout="neox")
    with pytest.raises(ValueError, match="holds each column twice"):
        fused_rope(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    with pytest.raises(ValueError, match="q and k must share batch and seq"):
        fused_rope(q, rand(1, 2, 9, 64), *tables(9, 64))
    with pytest.raises(ValueError, match="k head_dim 32 must equal q head_dim 64"):
        fused_rope(q, rand(1, 2, 8, 32), cos, sin)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        fused_rope(q[0], k, cos, sin)
    with pytest.raises(IndexError, match="offset \\+ seq = 3 \\+ 8 must be <= the table length 8"):
        fused_rope(q, k, cos, sin, offset=3)
    with pytest.raises(IndexError, match="offset must be >= 0"):
        fused_rope(q, k, cos, sin, offset=-1)
    with pytest.raises(IndexError, match="positions must be < 8"):
        fused_rope(q, k, cos, sin, positions=torch.arange(8) + 1)
    with pytest.raises(IndexError, match="offset \\+ arange\\(seq\\) must be < 8"):
        fused_rope(q, k, cos, sin, offset=torch.tensor([1]))
    with pytest.raises(ValueError, match="offset tensor must have shape \\(1,\\)"):
        fused_rope(q, k, cos, sin, offset=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="either positions or offset"):
        fused_rope(q, k, cos, sin, offset=0, positions=torch.arange(8))
    with pytest.raises(TypeError, match="positions must hold integers"):
        fused_rope(q, k, cos, sin, positions=torch.arange(8.0))
    with pytest.raises(ValueError, match="already gathered"):
        fused_rope(q, k, cos[None], sin[None], offset=0)
    with pytest.raises(ValueError, match="inplace=True is not differentiable"):
        fused_rope(q.clone().requires_grad_(), k, cos, sin, inplace=True)


# ----------------------------------------------------------------------------- dispatch


def _run(code: str, env_extra: dict[str, str] | None = None, drop_interpret: bool = True) -> str:
    import os

    env = {key: v for key, v in os.environ.items() if not (drop_interpret and key == "TRITON_INTERPRET")}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_dispatch_on_cpu_without_the_interpreter_uses_the_torch_reference():
    out = _run("""
        import torch
        from companion.kernels import fused_rope, flash_attention_with_bias, kernel_backend
        from companion.rope import apply_rope, rope_cos_sin, rope_frequencies
        from companion.alibi import bias_attention, ALiBi
        q, k, v = (torch.randn(1, 2, 20, 32) for _ in range(3))
        cos, sin = rope_cos_sin(20, rope_frequencies(32))
        a, b = fused_rope(q, k, cos, sin), apply_rope(q, k, cos, sin)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        o = flash_attention_with_bias(q, k, v, bias="alibi", causal=True)
        r = bias_attention(q, k, v, ALiBi(2).bias, causal=True)
        # bit-equal: the torch path is bias_attention with alibi_bias(alibi_slopes(2), ...),
        # the very values ALiBi(2).bias gives, at the same default block size (the diagonal
        # tile reuse it enables recomputes the same numbers)
        assert torch.equal(o, r)
        import sys
        print(kernel_backend(q), kernel_backend(q, "attention"), "triton" in sys.modules)
    """)
    assert out.split() == ["torch", "torch", "False"]  # and Triton was never imported


def test_dispatch_without_triton_installed():
    out = _run("""
        import sys
        sys.modules["triton"] = None  # as if Triton were not installed
        import torch
        import companion.kernels as K
        from companion.rope import rope_cos_sin, rope_frequencies
        q = torch.randn(1, 2, 5, 8)
        cos, sin = rope_cos_sin(5, rope_frequencies(8))
        K.fused_rope(q, q.clone(), cos, sin)
        K.flash_attention_with_bias(q, q, q, bias="alibi")
        print(K.kernel_backend(q), K.kernel_backend(q, "attention"))
    """, env_extra={"TRITON_INTERPRET": "1"}, drop_interpret=False)
    assert out.split() == ["torch", "torch"]
