"""Bad input to RoPE and the kernels: every backend of an op raises the same error.

Each op with more than one backend is called on each of them with the same bad input, and the
test expects one exception type and one message pattern that names the argument:

* RoPE: :func:`companion.rope.apply_rope` (torch) and :func:`companion.kernels.fused_rope`
  (the Triton kernel, run by Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1);
* attention: :func:`companion.attention` (dense), :func:`companion.bias_attention`
  (blockwise) and :func:`companion.kernels.flash_attention_with_bias` (Triton).

One test per class of input (positions, shapes, dtypes, numeric arguments, flags, head counts,
masks, aliasing, float64 accuracy, backend parity on valid edge cases), each a table.
Shapes stay small: the interpreter's cost grows with the number of programs.
"""

import math

import numpy as np
import pytest
import torch

from companion import ALiBi, T5RelativeBias, attention, bias_attention
from companion.kernels import flash_attention_with_bias, fused_rope, kernel_backend
from companion.rope import (
    RotaryEmbedding,
    apply_rope,
    convert_layout,
    convert_qk_weight,
    layout_permutation,
    positions_from_mask,
    rope_cos_sin,
    rope_frequencies,
    rope_rotate,
    rotate_half,
)
from helpers import assert_within, attention_out_bound
from helpers import rand32 as rand

INTERPRETED = kernel_backend(torch.device("cpu"), "attention") == "triton-interpreter"
NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------------- backends

ROPE = {"apply_rope": apply_rope, "fused_rope": fused_rope}


def _dense(q, k, v, *, bias=None, heads=None, causal=False, scale=None, q_pos=None, k_pos=None):
    return attention(q, k, v, _scheme(bias, heads or q.shape[1]), q_pos, k_pos, causal=causal, scale=scale)


def _blockwise(q, k, v, *, bias=None, heads=None, causal=False, scale=None, q_pos=None, k_pos=None):
    return bias_attention(q, k, v, _scheme(bias, heads or q.shape[1]), causal=causal, scale=scale,
                          q_pos=q_pos, k_pos=k_pos, block_size=4)


def _flash(q, k, v, *, bias=None, heads=None, causal=False, scale=None, q_pos=None, k_pos=None):
    scheme = _scheme(bias, heads or q.shape[1])
    kw = dict(causal=causal, scale=scale, q_pos=q_pos, k_pos=k_pos)
    if bias == "alibi":
        return flash_attention_with_bias(q, k, v, bias="alibi", alibi_slopes=scheme.slopes, **kw)
    if bias == "t5":
        return flash_attention_with_bias(q, k, v, bias="t5", t5=scheme, **kw)
    return flash_attention_with_bias(q, k, v, **kw)


def _scheme(bias, heads):
    if bias == "alibi":
        return ALiBi(heads)
    if bias == "t5":
        torch.manual_seed(0)
        return T5RelativeBias(heads, 32, 40)
    return None


ATTENTION = {"attention": _dense, "bias_attention": _blockwise, "flash": _flash}

needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs Triton, run with TRITON_INTERPRET=1")


def _qkv(b=1, h=4, lq=8, lk=8, d=16, hk=None):
    return rand(b, h, lq, d), rand(b, hk or h, lk, d, seed=1), rand(b, hk or h, lk, d, seed=2)


def _tables(n=16, d=16):
    return rope_cos_sin(n, rope_frequencies(d))


# ----------------------------------------------------------------------------- positions

Q, K = rand(1, 4, 8, 16), rand(1, 4, 8, 16, seed=1)
COS, SIN = _tables()

ROPE_POSITIONS = [
    (dict(positions=torch.arange(8.0)), TypeError, r"positions must hold integers"),
    (dict(positions=torch.arange(8).bfloat16()), TypeError, r"positions must hold integers .*never floating"),
    (dict(positions=torch.ones(8, dtype=torch.bool)), TypeError, r"positions must hold integers"),
    (dict(positions=[None] * 8), TypeError, r"positions must be an integer tensor or a sequence of ints"),
    (dict(positions="abc"), TypeError, r"positions must be an integer tensor or a sequence of ints"),
    (dict(positions=torch.arange(7)), ValueError, r"positions must have shape \(8,\) or \(1, 8\)"),
    (dict(positions=torch.arange(8) + 9), IndexError, r"positions must be < 16 .*got a position 16"),
    (dict(positions=torch.arange(8) - 1), IndexError, r"positions must be >= 0, got a position -1"),
    (dict(offset=1.0), TypeError, r"offset must be an int or an integer tensor of shape \(1,\), got float"),
    (dict(offset="1"), TypeError, r"offset must be an int or an integer tensor"),
    (dict(offset=True), TypeError, r"offset must be an int or an integer tensor .*got bool"),
    (dict(offset=torch.tensor([1.0])), TypeError, r"offset must hold integers"),
    (dict(offset=-1), IndexError, r"offset must be >= 0"),
    (dict(offset=9), IndexError, r"offset \+ seq = 9 \+ 8 must be <= the table length 16"),
    (dict(offset=torch.tensor([9])), IndexError, r"offset \+ arange\(seq\) must be < 16"),
    (dict(offset=torch.tensor([0, 0])), ValueError, r"offset tensor must have shape \(1,\)"),
    (dict(offset=0, positions=torch.arange(8)), ValueError, r"either positions or offset"),
]

ATTENTION_POSITIONS = [
    (dict(q_pos=torch.arange(8.0)), TypeError, r"q_pos must hold integers"),
    (dict(k_pos=torch.arange(8).half()), TypeError, r"k_pos must hold integers"),
    (dict(q_pos=[None] * 8), TypeError, r"q_pos must be an integer tensor or a sequence of ints"),
    (dict(q_pos="x"), TypeError, r"q_pos must be an integer tensor"),
    (dict(k_pos=torch.arange(7)), ValueError, r"k_pos must have shape \(8,\) or \(1, 8\)"),
    (dict(q_pos=torch.zeros(2, 8, dtype=torch.long)), ValueError, r"q_pos must have shape"),
]


@pytest.mark.parametrize("backend", ROPE)
@pytest.mark.parametrize("kw, exc, pattern", ROPE_POSITIONS)
def test_rope_positions(backend, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ROPE[backend](Q, K, COS, SIN, **kw)


@needs_interpreter
@pytest.mark.parametrize("backend", ATTENTION)
@pytest.mark.parametrize("kw, exc, pattern", ATTENTION_POSITIONS)
def test_attention_positions(backend, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ATTENTION[backend](*_qkv(), bias="alibi", causal=True, **kw)


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: rope_cos_sin(None, rope_frequencies(8)), TypeError, r"positions must be an integer tensor .*got None"),
    (lambda: rope_cos_sin(torch.arange(3.0), rope_frequencies(8)), TypeError, r"positions must hold integers"),
    (lambda: rope_cos_sin(8.0, rope_frequencies(8)), TypeError, r"positions must hold integers"),
    (lambda: rope_cos_sin(-1, rope_frequencies(8)), ValueError, r"positions must be >= 0"),
    (lambda: RotaryEmbedding(8).cos_sin(None), TypeError, r"positions must be an integer tensor"),
    (lambda: RotaryEmbedding(8).cos_sin(torch.arange(3.0)), TypeError, r"positions must hold integers"),
    (lambda: RotaryEmbedding(8).rotate(Q[..., :8], K[..., :8], torch.arange(8.0), torch.arange(8)),
     TypeError, r"q_pos must hold integers"),
    (lambda: RotaryEmbedding(8).cos_sin(torch.tensor([2**24])), ValueError,
     r"positions must be < 2\*\*24 .*compute_dtype=torch.float64"),
])
def test_table_positions(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ----------------------------------------------------------------------------- shapes

ROPE_SHAPES = [
    ((Q[0], K), ValueError, r"q must have 4 dimensions"),
    ((Q, K[0]), ValueError, r"k must have 4 dimensions"),
    (([1.0], K), TypeError, r"q must be a torch.Tensor, got list"),
    ((Q, rand(1, 4, 9, 16)), ValueError, r"q and k must share batch and seq"),
    ((Q, rand(2, 4, 8, 16)), ValueError, r"q and k must share batch and seq"),
    ((Q, rand(1, 4, 8, 8)), ValueError, r"k head_dim 8 must equal q head_dim 16"),
    ((Q, K, torch.cat((COS, COS), -1), torch.cat((SIN, SIN), -1)), ValueError,
     r"HuggingFace-style table of width 16 .*cos\[\.\.\., :8\]"),
    ((Q, K, COS, SIN[:4]), ValueError, r"cos and sin must have the same shape"),
    ((Q, K, COS[None, :7], SIN[None, :7]), ValueError, r"gathered cos/sin must have shape \(1 or 1, 8"),
    ((Q, K, COS[0], SIN[0]), ValueError, r"cos/sin must have shape \(table_len, rotary_dim // 2\)"),
    ((Q, K, None, SIN), TypeError, r"cos must be a torch.Tensor, got NoneType"),
]


@pytest.mark.parametrize("backend", ROPE)
@pytest.mark.parametrize("args, exc, pattern", ROPE_SHAPES)
def test_rope_shapes(backend, args, exc, pattern):
    q, k, cos, sin = (*args, COS, SIN) if len(args) == 2 else args
    with pytest.raises(exc, match=pattern):
        ROPE[backend](q, k, cos, sin)


ATTENTION_SHAPES = [
    ((Q[0], K, K), ValueError, r"q must have 4 dimensions"),
    ((Q, K, "v"), TypeError, r"v must be a torch.Tensor, got str"),
    ((Q, rand(2, 4, 8, 16), rand(2, 4, 8, 16)), ValueError, r"k batch size 2 must equal q batch size 1"),
    ((Q, rand(1, 3, 8, 16), rand(1, 3, 8, 16)), ValueError, r"q heads \(4\) must be a multiple of k heads \(3\)"),
    ((Q, rand(1, 4, 8, 8), rand(1, 4, 8, 8)), ValueError, r"k head_dim 8 must equal q head_dim 16"),
    ((Q, K, rand(1, 4, 7, 16)), ValueError, r"v shape \(1, 4, 7, 16\) must match k"),
]


@needs_interpreter
@pytest.mark.parametrize("backend", ATTENTION)
@pytest.mark.parametrize("args, exc, pattern", ATTENTION_SHAPES)
def test_attention_shapes(backend, args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ATTENTION[backend](*args, causal=True)


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: rotate_half(torch.tensor(1.0)), ValueError, r"x must have at least 1 dimension"),
    (lambda: convert_layout(torch.tensor(1.0), "half", "interleaved"), ValueError, r"x must have at least 1 dimension"),
    (lambda: rotate_half(torch.ones(3)), ValueError, r"x's last dimension must be even, got 3"),
    (lambda: rotate_half([1.0, 2.0]), TypeError, r"x must be a torch.Tensor"),
    (lambda: rope_rotate(Q[0], COS, SIN), ValueError, r"x must have 4 dimensions"),
    (lambda: RotaryEmbedding(8).rotate(Q, K, torch.arange(8), torch.arange(8)), ValueError,
     r"head_dim must equal this scheme's head_dim 8"),
])
def test_helper_shapes(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ----------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("backend", ROPE)
@pytest.mark.parametrize("args, exc, pattern", [
    ((Q.long(), K.long(), COS, SIN), TypeError, r"q must be a floating-point tensor, got dtype torch.int64"),
    ((Q, K.int(), COS, SIN), TypeError, r"k must be a floating-point tensor, got dtype torch.int32"),
    ((Q, K, COS.long(), SIN.long()), TypeError, r"cos and sin must share a floating dtype"),
    ((Q, K, COS, SIN.double()), TypeError, r"cos and sin must share a floating dtype"),
])
def test_rope_dtypes(backend, args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ROPE[backend](*args)


@needs_interpreter
@pytest.mark.parametrize("backend", ATTENTION)
@pytest.mark.parametrize("args, exc, pattern", [
    ((Q.long(), K.long(), K.long()), ValueError, r"q, k, v must share a floating dtype, got torch.int64"),
    ((Q, K.half(), K), ValueError, r"q, k, v must share a floating dtype, got torch.float32, torch.float16"),
    ((Q, K, K.bfloat16()), ValueError, r"q, k, v must share a floating dtype"),
])
def test_attention_dtypes(backend, args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ATTENTION[backend](*args)


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: rope_cos_sin(4, rope_frequencies(8), compute_dtype=torch.bfloat16), ValueError,
     r"compute_dtype must be torch.float32 or torch.float64"),
    (lambda: rope_cos_sin(4, rope_frequencies(8), compute_dtype="float64"), TypeError,
     r"compute_dtype must be a floating-point torch.dtype, got the string 'float64'; pass torch.float64"),
    (lambda: rope_cos_sin(4, torch.arange(4)), TypeError, r"inv_freq must be a floating-point tensor"),
    (lambda: RotaryEmbedding(8, compute_dtype=torch.int64), TypeError, r"compute_dtype must be a floating-point"),
    (lambda: rope_frequencies(8, dtype=torch.float16), ValueError, r"dtype must be torch.float32 or torch.float64"),
    (lambda: RotaryEmbedding(8).cos_sin(4, dtype=torch.bfloat16), ValueError, r"dtype must be torch.float32 or"),
    (lambda: positions_from_mask(torch.ones(1, 3)), TypeError, r"attention_mask must be bool or integer"),
])
def test_table_dtypes(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ----------------------------------------------------------------------------- numeric arguments

SCALES = [
    (NAN, ValueError, r"scale must be a finite number > 0, got nan"),
    (INF, ValueError, r"scale must be a finite number > 0, got inf"),
    (-INF, ValueError, r"scale must be a finite number > 0"),
    (0.0, ValueError, r"scale must be a finite number > 0, got 0.0"),
    (-1.0, ValueError, r"scale must be a finite number > 0"),
    ("0.5", TypeError, r"scale must be a finite number > 0, got str '0.5'"),
    (True, TypeError, r"scale must be a finite number > 0, got bool"),
    (torch.tensor(0.5), TypeError, r"scale must be a finite number > 0, got Tensor"),
]


@needs_interpreter
@pytest.mark.parametrize("backend", ATTENTION)
@pytest.mark.parametrize("scale, exc, pattern", SCALES)
def test_attention_scale(backend, scale, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ATTENTION[backend](*_qkv(), bias="t5", scale=scale)


@pytest.mark.parametrize("call", [
    lambda s: rope_cos_sin(8, rope_frequencies(8), attention_scaling=s),
    lambda s: RotaryEmbedding(8, attention_scaling=s),
    lambda s: RotaryEmbedding(8).set_frequencies(rope_frequencies(8), s),
], ids=["rope_cos_sin", "RotaryEmbedding", "set_frequencies"])
@pytest.mark.parametrize("value, exc, pattern", [
    (NAN, ValueError, r"attention_scaling must be a finite number > 0, got nan"),
    (0, ValueError, r"attention_scaling must be a finite number > 0, got 0"),
    (-2.0, ValueError, r"attention_scaling must be a finite number > 0"),
    ("x", TypeError, r"attention_scaling must be a finite number > 0, got str 'x'"),
    (None, TypeError, r"attention_scaling must be a finite number > 0, got NoneType"),
])
def test_attention_scaling(call, value, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(value)


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: rope_frequencies(8, base="abc"), TypeError, r"base must be a finite number > 1, got str 'abc'"),
    (lambda: RotaryEmbedding(8, base="10000"), TypeError, r"base must be a finite number > 1, got str"),
    (lambda: rope_frequencies(8, base=INF), ValueError, r"base must be a finite number > 1, got inf"),
    (lambda: RotaryEmbedding(8, base=NAN), ValueError, r"base must be a finite number > 1, got nan"),
    (lambda: rope_frequencies(8, base=0), ValueError, r"base must be a finite number > 1"),
    (lambda: rope_frequencies("8"), TypeError, r"dim must be an int, got str"),
    (lambda: rope_frequencies(7), ValueError, r"dim must be even"),
    (lambda: RotaryEmbedding("16"), TypeError, r"head_dim must be an int, got str"),
    (lambda: RotaryEmbedding(16, rotary_dim="8"), TypeError, r"rotary_dim must be an int or None, got str"),
    (lambda: RotaryEmbedding(16, rotary_dim=7), ValueError, r"rotary_dim must be even"),
    (lambda: RotaryEmbedding(16, max_cached_positions=-1), ValueError, r"max_cached_positions must be >= 0"),
    (lambda: RotaryEmbedding(16, inv_freq=-torch.ones(8)), ValueError, r"inv_freq must hold finite values > 0"),
    (lambda: positions_from_mask(torch.ones(1, 3, dtype=torch.long), pad_position="1"), TypeError,
     r"pad_position must be an int"),
])
def test_numeric_arguments(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize("backend", ROPE)
@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(rotary_dim="8"), TypeError, r"rotary_dim must be an int or None, got str"),
    (dict(rotary_dim=8.0), TypeError, r"rotary_dim must be an int or None, got float"),
    (dict(rotary_dim=7), ValueError, r"rotary_dim must be even"),
    (dict(rotary_dim=0), ValueError, r"rotary_dim must be an even int in \[2, head_dim=16\]"),
    (dict(rotary_dim=18), ValueError, r"rotary_dim must be <= head_dim \(16\)"),
    (dict(layout="neox"), ValueError, r"layout must be one of \('half', 'interleaved'\), got 'neox'"),
    (dict(layout=None), ValueError, r"layout must be one of"),
])
def test_rope_numeric_and_choice_arguments(backend, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ROPE[backend](Q, K, COS, SIN, **kw)


# ----------------------------------------------------------------------------- flags and devices

BAD_FLAGS = [("False", "str 'False'"), (1, "int 1"), (None, "NoneType None"), (torch.tensor(True), "Tensor")]


@needs_interpreter
@pytest.mark.parametrize("backend", ATTENTION)
@pytest.mark.parametrize("value, shown", BAD_FLAGS)
def test_attention_causal_flag(backend, value, shown):
    with pytest.raises(TypeError, match=rf"causal must be a bool \(True or False\), got {shown}"):
        ATTENTION[backend](*_qkv(), bias="alibi", causal=value)


@pytest.mark.parametrize("backend", ROPE)
@pytest.mark.parametrize("value, shown", BAD_FLAGS)
def test_rope_inplace_flag(backend, value, shown):
    q, k = Q.clone(), K.clone()
    with pytest.raises(TypeError, match=rf"inplace must be a bool \(True or False\), got {shown}"):
        ROPE[backend](q, k, COS, SIN, inplace=value)
    assert torch.equal(q, Q) and torch.equal(k, K)  # nothing written


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: kernel_backend("gpu"), ValueError, r"x must be a device such as 'cpu', 'cuda' or 'cuda:0', got 'gpu'"),
    (lambda: kernel_backend(3), TypeError, r"x must be a torch.device, a device string .*got int"),
    (lambda: kernel_backend(None), TypeError, r"x must be a torch.device.*got NoneType"),
    (lambda: kernel_backend("cpu", "flash"), ValueError, r"op must be one of \('rope', 'attention'\), got 'flash'"),
    (lambda: rope_frequencies(8, device="gpu"), ValueError, r"device must be a device such as 'cpu'"),
    (lambda: RotaryEmbedding(8, device="gpu"), ValueError, r"device must be a device such as 'cpu'"),
])
def test_devices(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_kernel_backend_accepts_tensors_devices_and_strings():
    expected = "triton-interpreter" if INTERPRETED else "torch"
    assert kernel_backend(torch.zeros(1), "attention") == kernel_backend("cpu", "attention") == expected
    assert kernel_backend(torch.device("cpu"), "attention") == expected


# ----------------------------------------------------------------------------- head counts


@needs_interpreter
@pytest.mark.parametrize("backend", ATTENTION)
@pytest.mark.parametrize("bias, heads, name", [
    ("t5", 2, "T5RelativeBias"),  # the flash kernel used to read heads 2-3 past the table's end
    ("t5", 1, "T5RelativeBias"),  # broadcast one table to every head
    ("t5", 8, "T5RelativeBias"),
    ("alibi", 1, "ALiBi|alibi_slopes"),  # broadcast one slope (1/256) to every head
    ("alibi", 8, "ALiBi|alibi_slopes"),
])
def test_scheme_head_counts(backend, bias, heads, name):
    with pytest.raises(ValueError, match=rf"({name}) was built for {heads} heads but the queries have 4 heads"):
        ATTENTION[backend](*_qkv(h=4), bias=bias, heads=heads, causal=True)


@needs_interpreter
def test_t5_tuple_head_count():
    q, k, v = _qkv(h=4)
    with pytest.raises(ValueError, match=r"the t5 table was built for 2 heads but the queries have 4 heads"):
        flash_attention_with_bias(q, k, v, bias="t5", t5=(torch.zeros(32, 2), 32, 128, True))


@needs_interpreter
@pytest.mark.parametrize("backend", ATTENTION)
def test_grouped_query_heads_are_the_query_heads(backend):
    """With 4 query heads and 2 key heads, a scheme for 4 heads is right and one for 2 is not."""
    q, k, v = _qkv(h=4, hk=2)
    assert ATTENTION[backend](q, k, v, bias="t5", heads=4).shape == (1, 4, 8, 16)
    with pytest.raises(ValueError, match=r"was built for 2 heads but the queries have 4"):
        ATTENTION[backend](q, k, v, bias="t5", heads=2)


# ----------------------------------------------------------------------------- masks (padding masks for positions)


@pytest.mark.parametrize("mask, expected", [
    (torch.tensor([[0, 0, 1, 1, 1]]), [[1, 1, 0, 1, 2]]),
    (torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.uint8), [[1, 1, 0, 1, 2]]),
    (torch.tensor([[False, True, True]]), [[1, 0, 1]]),
])
def test_padding_masks_by_the_huggingface_convention(mask, expected):
    assert positions_from_mask(mask).tolist() == expected


@pytest.mark.parametrize("mask, exc, pattern", [
    (torch.tensor([[0, 2, 1]]), ValueError, r"attention_mask must hold only 0/1"),
    (torch.tensor([[0.0, 1.0]]), TypeError, r"attention_mask must be bool or integer, got dtype torch.float32"),
    (torch.tensor([0, 1]), ValueError, r"attention_mask must have 2 dimensions"),
    ([[1, 1]], TypeError, r"attention_mask must be a torch.Tensor, got list"),
])
def test_padding_mask_errors(mask, exc, pattern):
    with pytest.raises(exc, match=pattern):
        positions_from_mask(mask)


# ----------------------------------------------------------------------------- aliasing


def _aliased(kind):
    """``(q, k)`` that share memory in some way, from a fresh buffer."""
    x = rand(1, 4, 8, 16)
    if kind == "same tensor":
        return x, x
    if kind == "overlapping heads":
        buf = rand(1, 6, 8, 16)
        return buf[:, :4], buf[:, 2:]
    if kind == "same memory, other view":
        return x, x.view(1, 4, 8, 16)
    raise AssertionError(kind)


@pytest.mark.parametrize("backend", ROPE)
@pytest.mark.parametrize("kind", ["same tensor", "overlapping heads", "same memory, other view"])
def test_inplace_q_and_k_sharing_memory(backend, kind):
    q, k = _aliased(kind)
    before = q.clone()
    with pytest.raises(ValueError, match=r"q and k share memory; use inplace=False or pass distinct tensors"):
        ROPE[backend](q, k, COS, SIN, inplace=True)
    assert torch.equal(q, before)  # rejected before anything is written


@pytest.mark.parametrize("backend", ROPE)
@pytest.mark.parametrize("which", ["q", "k"])
def test_inplace_tensor_with_repeated_elements(backend, which):
    expanded = rand(1, 1, 8, 16).expand(1, 4, 8, 16)
    q, k = (expanded, K.clone()) if which == "q" else (Q.clone(), expanded)
    with pytest.raises(ValueError, match=rf"{which} has elements that share memory .*inplace=False"):
        ROPE[backend](q, k, COS, SIN, inplace=True)


def test_rope_rotate_inplace_repeated_elements():
    with pytest.raises(ValueError, match=r"x has elements that share memory"):
        rope_rotate(rand(1, 1, 8, 16).expand(2, 4, 8, 16), COS, SIN, inplace=True)


@pytest.mark.parametrize("backend", ROPE)
def test_views_of_one_buffer_that_do_not_overlap(backend):
    """q and k as interleaved slices of one fused qkv projection are fine in place, and so is
    the same tensor twice out of place: the result is the rotation of each."""
    qkv = rand(1, 8, 3, 4, 16)  # (batch, seq, 3, heads, head_dim)
    q, k, _ = (t.transpose(1, 2) for t in qkv.unbind(2))
    want = apply_rope(q.clone(), k.clone(), COS, SIN)
    got = ROPE[backend](q, k, COS, SIN, inplace=True)
    assert got[0] is q and got[1] is k
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])
    x = rand(1, 4, 8, 16)
    qo, ko = ROPE[backend](x, x, COS, SIN)
    assert torch.equal(qo, ko) and torch.equal(qo, apply_rope(x, x.clone(), COS, SIN)[0])


# ----------------------------------------------------------------------------- float64 accuracy


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("start", [1000, 9992])
def test_float64_rotate_is_float64_accurate(layout, start):
    """RotaryEmbedding.rotate on float64 q, k against an independent float64 reference.

    Reference: theta_i = base ** (-2 i / r) and cos, sin from Python's math (each within about
    one ulp). Both sides' theta carry a relative error of at most ``(ln(base) + 3) * eps`` from
    rounding the exponent and the power, about 12 eps, so together 25 eps; the angle p * theta
    adds 1 eps, so the angle differs by at most ``26 * eps * p * theta`` (theta <= 1), plus one
    ulp in each of cos and sin. A rotated coordinate ``a c - b s`` then differs by at most
    ``(|a| + |b|) * (26 eps p + 2 eps) + 4 eps max|x|``. float32 tables are off by ~1e-4 here.
    """
    eps = torch.finfo(torch.float64).eps
    head_dim, base = 16, 10000.0
    rope = RotaryEmbedding(head_dim, layout=layout)
    q, k = rand(1, 2, 8, head_dim, dtype=torch.float64), rand(1, 2, 8, head_dim, dtype=torch.float64, seed=1)
    pos = torch.arange(start, start + 8)
    qr, kr = rope.rotate(q, k, pos, pos)
    assert qr.dtype == kr.dtype == torch.float64
    h = head_dim // 2
    theta = [base ** (-2 * i / head_dim) for i in range(h)]
    c = torch.tensor([[math.cos(int(p) * t) for t in theta] for p in pos], dtype=torch.float64)
    s = torch.tensor([[math.sin(int(p) * t) for t in theta] for p in pos], dtype=torch.float64)
    for x, got in ((q, qr), (k, kr)):
        a, b = (x[..., :h], x[..., h:]) if layout == "half" else (x[..., 0::2], x[..., 1::2])
        ref = torch.cat((a * c - b * s, b * c + a * s), -1) if layout == "half" else \
            torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)
        xmax = float(x.abs().max())
        bound = 2 * xmax * (26 * eps * (start + 7) + 2 * eps) + 4 * eps * xmax
        err = float((got - ref).abs().max())
        assert err <= bound, (err, bound)
    # float32 tables (the old default) miss this bound by orders of magnitude: the test can fail
    c32, s32 = rope.cos_sin(pos)
    q32 = rope_rotate(q, c32, s32, layout=layout)
    assert float((q32 - qr).abs().max()) > 1000 * bound


def test_float32_tables_stay_huggingface_bit_exact():
    """The float32 path is unchanged: tables equal HuggingFace's formula bit for bit."""
    rope = RotaryEmbedding(16)
    pos = torch.arange(3000, 3008)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    freqs = pos[:, None].float() * inv[None]
    c, s = rope.cos_sin(pos)
    assert c.dtype == torch.float32 and torch.equal(c, freqs.cos()) and torch.equal(s, freqs.sin())


# ----------------------------------------------------------------------------- backend parity on valid edge cases


@needs_interpreter
@pytest.mark.parametrize("bias", [None, "alibi", "t5"])
@pytest.mark.parametrize("what", ["nan value", "inf value", "nan key"])
def test_nonfinite_key_reaches_only_the_queries_that_see_it(bias, what):
    """One non-finite key or value at position 5 of a causal call: every backend gives NaN/inf
    exactly to the queries at positions >= 5 and the same finite values to the others."""
    q, k, v = _qkv(h=2)
    if what == "nan key":
        k[:, :, 5] = NAN
    else:
        v[:, :, 5, 3] = NAN if what == "nan value" else INF
    outs = {name: f(q, k, v, bias=bias, causal=True).double() for name, f in ATTENTION.items()}
    ref = outs["attention"]
    # Queries 0..4 see keys 0..4 only (causal, default positions 0..7): each backend's float32
    # result there is within helpers.attention_out_bound of the exact attention over those 5
    # keys (masked keys add exact zeros; an online softmax over at most 5 blocks), and so is
    # the dense reference: two bounds apart.
    scheme = _scheme(bias, 2)
    q5, k5, v5 = (t[:, :, :5] for t in (q, k, v))
    bound = 2 * attention_out_bound(q5, k5, v5, None if scheme is None else scheme.double(), causal=True, blocks=5)
    for name, out in outs.items():
        bad_rows = (~torch.isfinite(out)).any(-1)
        assert bad_rows[..., 5:].all() and not bad_rows[..., :5].any(), name
        assert_within(out[..., :5, :], ref[..., :5, :], bound)
        assert torch.equal(out.isnan(), ref.isnan()), name


@pytest.mark.parametrize("backend", ROPE)
def test_rope_mixed_dtypes_and_empty(backend):
    """k in another dtype than q, and an empty sequence, are accepted by both backends alike."""
    qo, ko = ROPE[backend](Q, K.half(), COS, SIN)
    want = apply_rope(Q, K.half(), COS, SIN)
    assert ko.dtype == torch.float16 and torch.equal(qo, want[0]) and torch.equal(ko, want[1])
    e = rand(1, 4, 0, 16)
    assert all(t.shape == e.shape for t in ROPE[backend](e, e, COS, SIN))


# ----------------------------------------------------------------------------- found by tools/audit_inputs.py

HUGE = 2**70


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: rope_cos_sin(HUGE, rope_frequencies(8)), ValueError, r"positions must be < 2\*\*63"),
    (lambda: RotaryEmbedding(8).cos_sin(HUGE), ValueError, r"positions must be < 2\*\*63"),
    (lambda: RotaryEmbedding(HUGE), ValueError, r"head_dim must be < 2\*\*63"),
    (lambda: rope_frequencies(HUGE), ValueError, r"dim must be < 2\*\*63"),
    (lambda: rope_frequencies(8, base=10**400), ValueError, r"base must be a finite number > 1, got an int too large"),
    (lambda: rope_cos_sin(4, rope_frequencies(8), attention_scaling=10**400), ValueError, r"attention_scaling must be a finite number > 0"),
    (lambda: positions_from_mask(torch.ones(1, 3, dtype=torch.long), HUGE), ValueError, r"pad_position must be < 2\*\*63"),
    (lambda: positions_from_mask(torch.ones(1, 3, dtype=torch.long, device="meta")), ValueError, r"attention_mask is a meta tensor"),
    (lambda: layout_permutation(8, "Half", "half"), ValueError, r"^src must be one of \('half', 'interleaved'\), got 'Half'"),
    (lambda: layout_permutation(8, "half", "interleave"), ValueError, r"^dst must be one of \('half', 'interleaved'\), got 'interleave'"),
    (lambda: convert_layout(Q, "half", None), ValueError, r"^dst must be one of"),
    (lambda: convert_qk_weight(torch.zeros(32, 4), 2, "", "half"), ValueError, r"^src must be one of"),
])
def test_audit_rope_errors(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_numpy_int_means_a_count_or_an_offset():
    """An int n means arange(n) for a table; a numpy int is an int (it gave one row before)."""
    inv = rope_frequencies(8)
    for n in (np.int64(5), np.int32(5)):  # exact: a numpy int is read as the int 5, the same call
        torch.testing.assert_close(rope_cos_sin(n, inv), rope_cos_sin(5, inv), rtol=0, atol=0)
        torch.testing.assert_close(RotaryEmbedding(8).cos_sin(n), RotaryEmbedding(8).cos_sin(5), rtol=0, atol=0)
    assert rope_cos_sin(torch.tensor(3), inv)[0].shape == (4,)  # a 0-d tensor is one position


@pytest.mark.parametrize("backend", ROPE)
def test_rope_numpy_int_offset(backend):
    want = apply_rope(Q, K, COS, SIN, offset=3)
    got = ROPE[backend](Q, K, COS, SIN, offset=np.int64(3))
    # exact: the offset is read as the int 3 and the kernel reproduces apply_rope bit for bit
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_interpreter
@pytest.mark.parametrize("backend", ATTENTION)
@pytest.mark.parametrize("make, pattern", [
    (lambda: _qkv(d=0), r"q head_dim must be >= 1"),
    (lambda: tuple(t.to("meta") for t in _qkv()), r"q is a meta tensor"),
    (lambda: (_qkv()[0], _qkv()[1].to("meta"), _qkv()[2]), r"k is a meta tensor|one device"),
])
def test_attention_head_dim_zero_and_meta(backend, make, pattern):
    with pytest.raises(ValueError, match=pattern):
        ATTENTION[backend](*make(), causal=True)


@needs_interpreter
def test_alibi_slopes_that_require_grad_are_refused():
    """The kernel gives custom slopes no gradient: refuse rather than drop it silently."""
    q, k, v = _qkv(h=2)
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    with pytest.raises(ValueError, match=r"alibi_slopes requires grad, but flash_attention_with_bias gives the slopes no gradient"):
        flash_attention_with_bias(q, k, v, bias="alibi", alibi_slopes=slopes)
    with torch.no_grad():
        out = flash_attention_with_bias(q, k, v, bias="alibi", alibi_slopes=slopes)
    # bit-equal: the same kernel on the same inputs and the same slope values
    assert torch.equal(out, flash_attention_with_bias(q, k, v, bias="alibi", alibi_slopes=slopes.detach()))
