"""Flash attention with an in-kernel ALiBi / T5 bias (companion.kernels) against references.

The Triton kernels run on this CPU through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1). The oracle is the dense reference companion.attention in float64 with
the ALiBi or T5 scheme; outputs and the gradients of q, k, v and the T5 table are compared.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from companion import attention
from companion.alibi import ALiBi, alibi_bias, alibi_slopes
from companion.kernels import MAX_ATTENTION_HEAD_DIM, flash_attention_with_bias, kernel_backend
from companion.relative import T5RelativeBias, t5_relative_position_bucket
from companion.utils import peak_tensor_bytes
from helpers import assert_within, assert_within_rounded, attention_error_bounds, attention_out_bound
from helpers import rand32 as rand

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = kernel_backend(torch.device("cpu"), "attention") == "triton-interpreter"


@pytest.fixture(autouse=True)
def _needs_the_interpreter(request):
    if not INTERPRETED and not request.node.name.startswith("test_benchmark"):
        pytest.skip("needs Triton, run with TRITON_INTERPRET=1")


if INTERPRETED:
    from companion.kernels.attention import kv_end, q_start

# Tolerances are derived from the arithmetic, entry by entry (see helpers.attention_error_bounds): every quantity
# the kernels compute is a sum of products, and a float sum of n terms carries an error of at
# most about n * u * (sum of the absolute values of its terms), u the unit roundoff. The bound
# therefore grows with the sizes involved (a T5 table-gradient entry sums up to q_len * k_len
# terms, an output entry k_len), and it stays right where the terms cancel: the far-offset
# bucket of T5's table collects whole rows of dS, which sum to almost zero.


def make_t5(heads, bidirectional, seed=0, num_buckets=32, max_distance=40):
    t5 = T5RelativeBias(heads, num_buckets, max_distance, bidirectional=bidirectional)
    with torch.no_grad():
        t5.relative_attention_bias.weight.copy_(rand(num_buckets, heads, seed=seed))
    return t5


def double_t5(t5):
    twin = T5RelativeBias(t5.num_heads, t5.num_buckets, t5.max_distance, t5.bidirectional).double()
    twin.load_state_dict(t5.state_dict())
    return twin


def check(shape, *, dtype=torch.float32, bias=None, causal=False, q_pos=None, k_pos=None, scale=None,
          t5=None, slopes=None, seed=0):
    """Run the kernel forward and backward, and the float64 dense oracle; compare everything."""
    b, h, hk, lq, lk, d = shape
    q = rand(b, h, lq, d, dtype=dtype, seed=seed).requires_grad_()
    k = rand(b, hk, lk, d, dtype=dtype, seed=seed + 1).requires_grad_()
    v = rand(b, hk, lk, d, dtype=dtype, seed=seed + 2).requires_grad_()
    kw = dict(causal=causal, q_pos=q_pos, k_pos=k_pos, scale=scale)
    params = [q, k, v]
    if bias == "alibi":
        out = flash_attention_with_bias(q, k, v, bias="alibi", alibi_slopes=slopes, **kw)
    elif bias == "t5":
        params.append(t5.table)
        out = flash_attention_with_bias(q, k, v, bias="t5", t5=t5, **kw)
    else:
        out = flash_attention_with_bias(q, k, v, **kw)
    assert out.dtype == dtype and out.shape == (b, h, lq, d)
    dout = rand(*out.shape, seed=seed + 3).to(dtype)
    grads = torch.autograd.grad(out, params, dout)

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    params64 = [q64, k64, v64]
    scheme, mask = None, None
    if bias == "alibi":
        if slopes is None:
            scheme = ALiBi(h)
        else:  # custom slopes: the same bias as an additive float mask
            qp = q_pos if q_pos is not None else torch.arange(max(lk - lq, 0), max(lk - lq, 0) + lq)
            kp = k_pos if k_pos is not None else torch.arange(lk)
            mask = alibi_bias(slopes, qp, kp).double()
    elif bias == "t5":
        scheme = double_t5(t5)
        params64.append(scheme.table)
    ref = attention(q64, k64, v64, scheme, q_pos, k_pos, causal=causal, scale=scale, attn_mask=mask)
    grads64 = torch.autograd.grad(ref, params64, dout.double())

    bounds = attention_error_bounds(q64, k64, v64, dout.double(), scheme, q_pos, k_pos, causal, scale, mask, dtype)
    names = ["out", "dq", "dk", "dv", "dtable"]
    for name, x, x64 in zip(names, (out, *grads), (ref, *grads64)):
        assert_within_rounded(x, x64, bounds[name], name)
    return out


# ----------------------------------------------------------------------------- the grid the issue asks


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [None, "alibi", "t5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_and_backward_match_the_dense_reference(head_dim, causal, bias, dtype):
    # 150 queries and 170 keys: no multiple of the 128/64 (forward) or 64 (backward) blocks.
    t5 = make_t5(2, bidirectional=not causal) if bias == "t5" else None
    check((1, 2, 2, 150, 170, head_dim), dtype=dtype, bias=bias, causal=causal, t5=t5)


@pytest.mark.parametrize("bias", ["alibi", "t5"])
def test_bfloat16(bias):
    t5 = make_t5(2, bidirectional=False) if bias == "t5" else None
    check((1, 2, 1, 70, 70, 64), dtype=torch.bfloat16, bias=bias, causal=True, t5=t5)


# ----------------------------------------------------------------------------- positions, shapes


def test_decoding_queries_are_the_last_positions():
    """q_len < k_len: queries default to the last positions (KV-cache decoding)."""
    check((2, 4, 2, 5, 133, 64), bias="alibi", causal=True)


def test_grouped_query_attention_with_t5():
    check((1, 4, 1, 66, 66, 64), bias="t5", causal=True, t5=make_t5(4, bidirectional=False))


def test_per_row_positions_left_padding():
    pos = torch.stack((torch.arange(90), (torch.arange(90) - 17).clamp(min=0)))
    check((2, 2, 2, 90, 90, 64), bias="t5", causal=True, q_pos=pos, k_pos=pos, t5=make_t5(2, False))
    check((2, 2, 2, 90, 90, 64), bias="alibi", causal=True, q_pos=pos, k_pos=pos)


def test_unsorted_positions_and_custom_slopes():
    """Positions that do not increase: no loop bounds can be derived, every tile is visited."""
    g = torch.Generator().manual_seed(3)
    qp, kp = torch.randperm(70, generator=g) + 10, torch.randperm(100, generator=g)
    check((1, 2, 2, 70, 100, 64), bias="alibi", causal=True, q_pos=qp, k_pos=kp,
          slopes=torch.tensor([0.3, 0.01]))
    check((1, 2, 2, 70, 100, 64), bias="t5", causal=True, q_pos=qp, k_pos=kp, t5=make_t5(2, True))


def test_rows_that_see_no_key_are_zero():
    """Queries before every key under the causal mask attend nothing: zero output, no NaN."""
    out = check((1, 2, 2, 40, 40, 64), bias="alibi", causal=True, q_pos=torch.arange(40),
                k_pos=torch.arange(40) + 10)
    assert torch.equal(out[:, :, :10], torch.zeros_like(out[:, :, :10]))
    assert torch.isfinite(out).all()


def test_t5_far_offsets_saturate_and_scale_one():
    """Every offset beyond max_distance: the clamped per-offset vector; T5's scale=1."""
    check((1, 2, 2, 33, 200, 128), bias="t5", q_pos=torch.arange(33) + 1000, k_pos=torch.arange(200),
          t5=make_t5(2, True), scale=1.0)


def test_t5_bucket_is_constant_beyond_max_distance():
    """The kernel clamps offsets to [-max_distance, max_distance]; exact only if the bucket
    function no longer changes beyond, which this checks on relative.py's own function."""
    for bidirectional in (True, False):
        for num_buckets, max_distance in ((32, 128), (8, 20), (32, 17), (6, 1000), (64, 64)):
            if max_distance <= (num_buckets // 2 if bidirectional else num_buckets) // 2:
                continue
            far = torch.arange(max_distance, 8 * max_distance + 50)
            for sign in (1, -1):
                b = t5_relative_position_bucket(sign * far, bidirectional, num_buckets, max_distance)
                assert (b == b[0]).all(), (bidirectional, num_buckets, max_distance, sign)


@pytest.mark.parametrize("bias", ["alibi", "t5"])
def test_default_and_explicit_positions_take_two_paths_to_one_result(bias):
    """Default positions are computed in the kernels (nothing loaded, loop bounds derived in
    place); explicit ones are loaded, with bounds from the host. Both must agree exactly."""
    t5 = make_t5(2, bidirectional=False, seed=8)
    kw = dict(bias=bias, causal=True, **({"t5": t5} if bias == "t5" else {}))
    results = []
    for explicit in (False, True):
        q, k, v = (rand(1, 2, n, 64, seed=s).requires_grad_() for s, n in ((9, 70), (10, 200), (11, 200)))
        pos = dict(q_pos=torch.arange(130, 200), k_pos=torch.arange(200)) if explicit else {}
        out = flash_attention_with_bias(q, k, v, **kw, **pos)
        results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_t5_tuple_form_equals_module_form():
    t5 = make_t5(2, bidirectional=True, seed=4)
    q, k, v = (rand(1, 2, 50, 64, seed=s) for s in (5, 6, 7))
    table = t5.table.detach().clone().requires_grad_()
    a = flash_attention_with_bias(q, k, v, bias="t5", t5=t5)
    b = flash_attention_with_bias(q, k, v, bias="t5", t5=(table, 32, 40, True))
    assert torch.equal(a, b)
    (ga,) = torch.autograd.grad(a.sum(), t5.table)
    (gb,) = torch.autograd.grad(b.sum(), table)
    # The two forms reduce dS over each bucket in another order, so the gradients are not
    # bit-equal; each is within attention_error_bounds' table bound of the float64 oracle.
    twin = double_t5(t5)
    q64, k64, v64 = (x.double() for x in (q, k, v))
    ref = attention(q64, k64, v64, twin)
    (g64,) = torch.autograd.grad(ref.sum(), twin.table)
    bound = attention_error_bounds(q64, k64, v64, torch.ones_like(ref), twin, None, None, False, None, None,
                                   torch.float32)["dtable"]
    for g in (ga, gb):
        assert_within_rounded(g, g64, bound, "dtable")


@settings(max_examples=8)
@given(lq=st.integers(1, 140), lk=st.integers(1, 140), causal=st.booleans(),
       bias=st.sampled_from([None, "alibi", "t5"]), seed=st.integers(0, 2**16))
def test_property_random_lengths(lq, lk, causal, bias, seed):
    t5 = make_t5(2, bidirectional=not causal, seed=seed) if bias == "t5" else None
    check((1, 2, 1, lq, lk, 16), bias=bias, causal=causal, t5=t5, seed=seed)


# ----------------------------------------------------------------------------- structure


def test_causal_loop_bounds():
    """The loops visit exactly the key blocks that hold a visible key (default positions)."""
    lq, lk = 200, 300
    qp, kp = torch.arange(lk - lq, lk)[None].int(), torch.arange(lk)[None].int()
    ends = kv_end(qp, kp, 64)[0].tolist()
    assert ends == [min(lk, lk - lq + 64 * (i + 1)) for i in range(4)]
    starts = q_start(qp, kp, 64, 32)[0].tolist()
    # key block j (keys 32j..32j+31) is first seen by query index 32j - 100, rounded down to 64
    assert starts == [max(0, 32 * j - 100) // 64 * 64 for j in range(10)]
    unsorted = torch.tensor([[3, 1, 2]]).int()
    assert kv_end(qp[:, :3], unsorted, 64).tolist() == [[3]]
    assert q_start(unsorted, kp[:, :3], 64, 32).tolist() == [[0]]


def test_host_memory_is_linear_in_length():
    """The host never builds an L x L bias: tensors it allocates stay far below one."""
    lq = lk = 512
    q, k, v = (rand(1, 2, lq, 16, seed=s) for s in range(3))
    t5 = make_t5(2, bidirectional=True)
    with torch.no_grad():
        peak, _ = peak_tensor_bytes(flash_attention_with_bias, q, k, v, bias="t5", t5=t5)
    one_bias = 2 * lq * lk * 4
    assert peak < one_bias / 8, (peak, one_bias)


# ----------------------------------------------------------------------------- errors


def test_errors():
    """The kernel's own arguments; the checks shared with the torch paths are in
    tests/test_validation_kernels.py, called on every backend."""
    q, k, v = rand(1, 2, 8, 64), rand(1, 2, 8, 64), rand(1, 2, 8, 64)
    with pytest.raises(ValueError, match="bias must be one of"):
        flash_attention_with_bias(q, k, v, bias="rope")
    with pytest.raises(ValueError, match="bias='t5' needs t5="):
        flash_attention_with_bias(q, k, v, bias="t5")
    with pytest.raises(ValueError, match="t5 is only used with bias='t5'"):
        flash_attention_with_bias(q, k, v, t5=make_t5(2, True))
    with pytest.raises(ValueError, match="alibi_slopes is only used"):
        flash_attention_with_bias(q, k, v, alibi_slopes=alibi_slopes(2))
    with pytest.raises(ValueError, match="alibi_slopes was built for 4 heads but the queries have 2"):
        flash_attention_with_bias(q, k, v, bias="alibi", alibi_slopes=alibi_slopes(4))
    with pytest.raises(TypeError, match="alibi_slopes must be a floating-point tensor"):
        flash_attention_with_bias(q, k, v, bias="alibi", alibi_slopes=torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="t5 table was built for 3 heads but the queries have 2"):
        flash_attention_with_bias(q, k, v, bias="t5", t5=(torch.zeros(32, 3), 32, 128, True))
    with pytest.raises(ValueError, match="t5 table must have shape \\(num_buckets, heads\\) = \\(32, 2\\)"):
        flash_attention_with_bias(q, k, v, bias="t5", t5=(torch.zeros(16, 2), 32, 128, True))
    with pytest.raises(TypeError, match="t5 must be a companion.relative.T5RelativeBias or a tuple"):
        flash_attention_with_bias(q, k, v, bias="t5", t5="t5")
    with pytest.raises(ValueError, match="max_distance"):
        flash_attention_with_bias(q, k, v, bias="t5", t5=(torch.zeros(32, 2), 32, 4, True))
    with pytest.raises(TypeError, match="num_buckets must be an int"):
        flash_attention_with_bias(q, k, v, bias="t5", t5=(torch.zeros(32, 2), "32", 128, True))
    with pytest.raises(TypeError, match="bidirectional must be a bool"):
        flash_attention_with_bias(q, k, v, bias="t5", t5=(torch.zeros(32, 2), 32, 128, "True"))
    with pytest.raises(TypeError, match="t5 table must be floating point"):
        flash_attention_with_bias(q, k, v, bias="t5", t5=(torch.zeros(32, 2, dtype=torch.long), 32, 128, True))


def test_inputs_the_kernel_does_not_take_go_to_the_reference():
    """A value dim other than head_dim, head_dim above the kernel's limit, positions beyond
    int32 differences (the reference), and a strided last dimension (copied): the result of
    the dense reference, not an error."""
    q, k = rand(1, 2, 8, 16), rand(1, 2, 8, 16)
    strided = rand(1, 2, 8, 32)[..., ::2]
    far = torch.arange(8) + 2**30
    big = rand(1, 1, 4, MAX_ATTENTION_HEAD_DIM * 2)
    for args, kw in (((q, k, rand(1, 2, 8, 8)), {}), ((strided, k, strided), {}), ((big, big, big), {}),
                     ((q, k, k), dict(q_pos=far, k_pos=far))):
        got = flash_attention_with_bias(*args, bias="alibi", causal=True, **kw)
        pos = dict(q_pos=kw.get("q_pos"), k_pos=kw.get("k_pos"))
        ref = attention(*(t.double() for t in args), ALiBi(args[0].shape[1]), causal=True, **pos)
        args64 = [t.double() for t in args]
        bound = attention_error_bounds(*args64, torch.ones_like(ref), ALiBi(args[0].shape[1]), pos["q_pos"], pos["k_pos"],
                             True, None, None, torch.float32)["out"]
        assert_within_rounded(got, ref, bound)


def test_float64_and_empty_take_the_reference_path():
    q = rand(1, 2, 9, 16, dtype=torch.float64)
    out = flash_attention_with_bias(q, q, q, bias="alibi", causal=True)
    ref = attention(q, q, q, ALiBi(2), causal=True)
    # the reference path is the blockwise bias_attention, the oracle the dense attention: two
    # float64 computations, each within its derived bound (u = 2**-53, online softmax over at
    # most 9 key blocks)
    bound = 2 * attention_out_bound(q, q, q, ALiBi(2), causal=True, dtype=torch.float64, blocks=9)
    assert_within(out, ref, bound)
    empty = rand(1, 2, 0, 16)
    assert flash_attention_with_bias(empty, rand(1, 2, 4, 16), rand(1, 2, 4, 16)).shape == (1, 2, 0, 16)


# ----------------------------------------------------------------------------- the GPU benchmark script


def test_benchmark_script_smoke(tmp_path):
    """benchmarks/gpu_kernels.py --smoke runs its non-CUDA code paths and writes its JSON."""
    spec = importlib.util.spec_from_file_location("gpu_kernels", ROOT / "benchmarks" / "gpu_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "bench.json"
    assert mod.main(["--smoke", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    data = payload["data"]
    assert {"command", "git_commit", "date_utc", "torch"} <= set(payload["provenance"])
    assert {"triton", "liger_kernel"} <= set(data["environment"])
    assert data["smoke"] is True and len(data["rope"]) == 2 and len(data["attention"]) == 2
    row = data["rope"][0]
    assert row["bytes"] == mod.rope_bytes(1, 48, 2, 1, 32, 4)
    # the smoke run is float32, where the fused kernel reproduces apply_rope bit for bit
    assert row["max_abs_err_vs_fp32"] == 0.0
    assert set(row["forward_ms"]) >= {"fused", "hf_eager", "copy"}
    att = data["attention"][0]
    assert set(att["forward_ms"]) == {"flash_alibi", "flash_t5", "sdpa_causal", "sdpa_bias_alibi", "sdpa_bias_t5"}
    # The script's first attention row: batch 1, 2 heads, 48 tokens of head dim 32, q, k, v drawn
    # in that order from a generator seeded 0. The flash kernel and SDPA (an online softmax
    # over at most 48 key blocks) are float32 computations, each within attention_out_bound.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 48, 32, generator=g) for _ in range(3))
    bound = 2 * attention_out_bound(q, k, v, ALiBi(2), causal=True, blocks=48)
    assert att["max_abs_err_alibi_vs_sdpa"] <= float(bound.max())
    # T5: the script's table comes from the global generator, so no bound is derived here
    assert att["max_abs_err_t5_vs_sdpa"] < 1e-5
    assert mod.attention_flops(1, 10, 2, 4) == 4 * 2 * 100 * 4 * 0.5
    assert set(data["summary"]) >= {"rope_at_least_80pct_of_copy", "attention_within_1_3x_of_sdpa_causal"}
