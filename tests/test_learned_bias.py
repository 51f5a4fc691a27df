"""KERPLE and FIRE (companion.learned_bias) against independent formulas, gradients, and the
blockwise attention path.

Tolerances. float64 comparisons of elementwise formulas (log1p, pow, a product) against the
same formula in Python's ``math`` differ by a few roundings of each operation: a relative
``8 * eps64`` covers them with margin. Where a matrix product enters (FIRE's MLP, attention)
the bound grows with the length of the sums and is derived next to each test.
"""

import math
from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from companion import attention, bias_attention
from companion.blockwise import _is_relative
from companion.learned_bias import FIRE, KERPLE_FORMS, KerpleBias

from helpers import qkv as _qkv
from helpers import rand

qkv = partial(_qkv, b=2, h=4, lq=11, lk=11, d=8, requires_grad=True, draw=rand)

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps


# ============================================================================ independent formulas


def kerple_loops(form, r1, r2, q_pos, k_pos):
    """KERPLE written from the paper, one entry at a time in Python floats (float64)."""
    q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
    per_row = q_pos.ndim == 2 or k_pos.ndim == 2
    rows = max(q_pos.shape[0] if q_pos.ndim == 2 else 1, k_pos.shape[0] if k_pos.ndim == 2 else 1)
    qs = [q_pos[b] if q_pos.ndim == 2 else q_pos for b in range(rows)]
    ks = [k_pos[b] if k_pos.ndim == 2 else k_pos for b in range(rows)]
    out = np.zeros((rows, len(r1), len(qs[0]), len(ks[0])))
    for b in range(rows):
        for h in range(len(r1)):
            for i, qi in enumerate(qs[b]):
                for j, kj in enumerate(ks[b]):
                    d = abs(int(qi) - int(kj))
                    if form == "log":
                        out[b, h, i, j] = -r1[h] * math.log(1.0 + r2[h] * d)
                    else:
                        out[b, h, i, j] = -r1[h] * (d ** r2[h] if d else 0.0)
    return out if per_row else out[0]


def fire_numpy(fire, q_pos, k_pos):
    """FIRE written from the paper in numpy float64: returns (bias, x, hidden pre-activations,
    layer weights) so that tests can also derive rounding bounds from the intermediate sizes."""
    w1 = fire.mlp[0].weight.detach().double().numpy()[:, 0]  # (hidden,)
    b1 = fire.mlp[0].bias.detach().double().numpy()
    w2 = fire.mlp[2].weight.detach().double().numpy()  # (heads, hidden)
    b2 = fire.mlp[2].bias.detach().double().numpy()
    c = abs(fire.c.item())
    L = abs(fire.L_multiplier.item() * fire.init_L.item())
    q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
    i = q_pos.astype(np.float64)[..., :, None]
    j = k_pos.astype(np.float64)[..., None, :]
    x = np.log(c * np.abs(i - j) + 1.0) / (np.log(c * np.maximum(L, i) + 1.0) + fire.eps)
    pre = x[..., None] * w1 + b1  # (..., q, k, hidden)
    out = np.maximum(pre, 0.0) @ w2.T + b2  # (..., q, k, heads)
    return np.moveaxis(out, -1, -3), x, pre, (w1, b1, w2, b2)


# ============================================================================ KERPLE: values


@pytest.mark.parametrize("form", KERPLE_FORMS)
@pytest.mark.parametrize("case", ["square", "decode", "more-queries", "per-row", "gapped"])
def test_kerple_equals_loops(form, case):
    torch.manual_seed(1)
    s = KerpleBias(3, form=form).double()
    q_pos, k_pos = {
        "square": (torch.arange(9), torch.arange(9)),
        "decode": (torch.tensor([7, 8]), torch.arange(9)),
        "more-queries": (torch.arange(9), torch.arange(4)),
        "per-row": (torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]]), torch.tensor([[0, 1, 2, 3], [3, 5, 6, 8]])),
        "gapped": (torch.tensor([3, 10, 100]), torch.tensor([0, 50, 101, 4000])),
    }[case]
    got = s.bias(q_pos, k_pos)
    want = kerple_loops(form, s.r1.tolist(), s.r2.tolist(), q_pos.numpy(), k_pos.numpy())
    assert got.dtype == torch.float64 and tuple(got.shape) == want.shape
    # Elementwise: a product, a log1p or pow, another product: a few roundings.
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=8 * EPS64, atol=0)


@pytest.mark.parametrize("form", KERPLE_FORMS)
def test_kerple_float32_within_rounding_of_float64(form):
    torch.manual_seed(2)
    s = KerpleBias(4, form=form)  # float32 parameters
    q_pos, k_pos = torch.arange(3000, 3040), torch.arange(0, 4000, 37)
    got = s.bias(q_pos, k_pos)
    assert got.dtype == torch.float32
    want = kerple_loops(form, s.r1.tolist(), s.r2.tolist(), q_pos.numpy(), k_pos.numpy())
    # float32, the parameters and the integer distances exact: r2 * d (1 rounding, and log1p's
    # condition number y / ((1 + y) log1p(y)) is <= 1), or d ** r2 from exact inputs; log1p
    # and pow within 1 ulp (<= 2 eps relative); the product by r1 (1 rounding). That is
    # <= 5 eps32 relative; 8 eps32 leaves margin.
    rtol = 8 * EPS32
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=rtol, atol=0)


def test_kerple_half_module_computes_in_float32():
    s = KerpleBias(2, r1=0.5, r2=0.25).half()
    assert s.bias(torch.arange(4), torch.arange(4)).dtype == torch.float32


def test_kerple_power_with_r2_one_and_fixed_r1_is_alibi_shaped():
    s = KerpleBias(2, form="power", r1=[0.5, 0.25], r2=1.0).double()
    got = s.bias(torch.arange(6), torch.arange(6))
    d = (torch.arange(6)[None, :] - torch.arange(6)[:, None]).abs().double()
    assert torch.equal(got, torch.stack([-0.5 * d, -0.25 * d]))


# ============================================================================ KERPLE: properties


@given(st.integers(0, 3), st.integers(-10**6, 10**6), st.lists(st.integers(-500, 500), min_size=1, max_size=6),
       st.lists(st.integers(-500, 500), min_size=1, max_size=6), st.sampled_from(KERPLE_FORMS))
def test_kerple_depends_only_on_distance(seed, shift, qs, ks, form):
    """Shift invariance and symmetry, exactly: equal integer distances give identical floats."""
    torch.manual_seed(seed)
    s = KerpleBias(2, form=form)
    q, k = torch.tensor(qs), torch.tensor(ks)
    base = s.bias(q, k)
    assert torch.equal(s.bias(q + shift, k + shift), base)
    # Symmetry b(i, j) = b(j, i), and a function of |i - j| alone: every entry equals the bias
    # of the pair (0, |i - j|). Computed at other shapes, where torch's vectorised log1p/pow
    # may take another code path: each result within 5 eps32 relative of the exact value
    # (see test_kerple_float32_within_rounding_of_float64), so two agree within 10 eps32.
    tol = dict(rtol=10 * EPS32, atol=0)
    torch.testing.assert_close(s.bias(k, q), base.transpose(-1, -2), **tol)
    dist = (q[:, None] - k[None, :]).abs()
    table = s.bias(torch.tensor([0]), torch.arange(int(dist.max()) + 1))[:, 0]  # (heads, max + 1)
    torch.testing.assert_close(base, table[:, dist], **tol)


def test_kerple_is_declared_relative():
    assert KerpleBias.relative_bias is True and _is_relative(KerpleBias(2).bias)


def test_kerple_zero_distance_is_zero_and_bias_decreases():
    torch.manual_seed(3)
    for form in KERPLE_FORMS:
        b = KerpleBias(4, form=form).bias(torch.tensor([0]), torch.arange(50))[:, 0]
        assert torch.equal(b[:, 0], torch.zeros(4))
        assert bool((b[:, 1:] < b[:, :-1]).all()), form  # strictly decreasing in the distance


# ============================================================================ KERPLE: parameters


def test_kerple_default_init_matches_reference_distributions():
    # The reference: bias_p ~ 2 U[0, 1), bias_a ~ U[0, 1), projected to >= eps (and bias_p
    # <= 2 for the power form). log: r1 = bias_p, r2 = bias_a; power: r1 = bias_a, r2 = bias_p.
    torch.manual_seed(0)
    draws = torch.rand(4000)
    torch.manual_seed(0)
    log = KerpleBias(2000, form="log")
    assert torch.equal(log.r1.data, (2 * draws[:2000]).clamp(min=0.01))
    assert torch.equal(log.r2.data, draws[2000:].clamp(min=0.01))
    torch.manual_seed(0)
    power = KerpleBias(2000, form="power")
    assert torch.equal(power.r1.data, draws[:2000].clamp(min=0.01))
    assert torch.equal(power.r2.data, (2 * draws[2000:]).clamp(min=0.01, max=2))
    for s in (log, power):
        assert s.r1.dtype == s.r2.dtype == torch.float32 and s.r1.shape == (2000,)
        low = float(torch.tensor(0.01))  # 0.01 rounded to float32
        assert s.r1.min().item() == low and s.r2.min().item() == low  # 4000 draws: some clamped


def test_kerple_explicit_init():
    s = KerpleBias(3, r1=[1.0, 2.0, 3.0], r2=0.5)
    assert s.r1.tolist() == [1.0, 2.0, 3.0] and s.r2.tolist() == [0.5] * 3
    assert KerpleBias(2, form="power", r2=2).r2.tolist() == [2.0, 2.0]  # the bound is inclusive
    assert KerpleBias(2, r1=torch.tensor([0.5, 0.25])).r1.tolist() == [0.5, 0.25]


def test_kerple_clamp_in_forward_and_project():
    s = KerpleBias(2, form="power", r1=1.0, r2=1.0).double()
    with torch.no_grad():
        s.r1[0] = -3.0  # as if an optimiser step crossed the bound
        s.r2[1] = 2.5
    low = float(torch.tensor(0.01))  # the bound, eps rounded to float32
    r1, r2 = s.kernel_parameters()
    assert r1.tolist() == [low, 1.0] and r2.tolist() == [1.0, 2.0]
    b = s.bias(torch.tensor([4]), torch.tensor([0]))
    assert b.flatten().tolist() == [-low * 4.0, -1.0 * 16.0]
    b.sum().backward()
    # Past a bound the clamped kernel is flat in that parameter: gradient 0 (not NaN).
    assert s.r1.grad[0].item() == 0.0 and s.r2.grad[1].item() == 0.0
    assert s.r1.grad[1].item() == -16.0 and s.r2.grad[0].item() != 0.0
    assert s.project_() is s
    assert s.r1.tolist() == [low, 1.0] and s.r2.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("form", KERPLE_FORMS)
def test_kerple_gradcheck_parameters(form):
    # Values inside the bounds: at a bound the clamp has a kink, where a central difference
    # cannot match the one-sided derivative.
    s = KerpleBias(3, form=form, r1=[0.3, 1.1, 1.9], r2=[0.05, 0.7, 1.6]).double()
    q_pos, k_pos = torch.tensor([[0, 3, 5], [2, 6, 9]]), torch.tensor([[0, 1, 5, 7], [2, 3, 6, 9]])
    params = [s.r1, s.r2]
    assert torch.autograd.gradcheck(lambda *_: s.bias(q_pos, k_pos), params)


def test_kerple_power_gradient_finite_at_zero_distance():
    s = KerpleBias(2, form="power", r1=0.5, r2=[0.3, 1.7]).double()
    s.bias(torch.arange(5), torch.arange(5)).sum().backward()
    assert bool(torch.isfinite(s.r1.grad).all() and torch.isfinite(s.r2.grad).all())


# ============================================================================ KERPLE: bad input


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(n_heads=0), ValueError, "n_heads must be >= 1"),
    (dict(n_heads=2.0), TypeError, "n_heads must be an int"),
    (dict(n_heads=2, form="linear"), ValueError, "form must be one of"),
    (dict(n_heads=2, r1=0.0), ValueError, r"r1 must be >= eps = 0.01 .*got 0.0"),
    (dict(n_heads=2, r1=-1.0), ValueError, r"r1 must be >= eps"),
    (dict(n_heads=2, r2=[0.5, -0.5]), ValueError, r"r2 must be >= eps"),
    (dict(n_heads=2, form="power", r2=2.5), ValueError, r"r2 must be in \[eps, 2\] = \[0.01, 2\]"),
    (dict(n_heads=2, form="power", r2=0.0), ValueError, r"r2 must be in \[eps, 2\]"),
    (dict(n_heads=2, r1=float("nan")), ValueError, "r1 must be"),
    (dict(n_heads=2, r1=float("inf")), ValueError, "r1 must be"),
    (dict(n_heads=2, r1=[0.5, 0.5, 0.5]), ValueError, r"r1 must have one value per head \(2\)"),
    (dict(n_heads=2, r2="0.5"), TypeError, "r2 must be a number or a sequence"),
    (dict(n_heads=2, r2=[0.5, None]), TypeError, "r2 must hold numbers"),
    (dict(n_heads=2, eps=0.0), ValueError, "eps must be a finite number > 0"),
    (dict(n_heads=2, form="power", eps=3.0), ValueError, "eps must be <= 2"),
])
def test_kerple_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        KerpleBias(**kwargs)


def test_kerple_bad_positions_and_heads():
    s = KerpleBias(2)
    with pytest.raises(TypeError, match="q_pos must hold integers"):
        s.bias(torch.arange(3.0), torch.arange(3))
    with pytest.raises(ValueError, match="per-row batch sizes must match"):
        s.bias(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long))
    q, k, v = qkv(h=4)
    with pytest.raises(ValueError, match="KerpleBias was built for 2 heads"):
        attention(q, k, v, s)
    assert s.scheme_heads() == 2


# ============================================================================ FIRE: values


def fire_bound(x, pre, weights, eps):
    """Rounding bound of FIRE's output, per entry, for arithmetic with unit roundoff ``eps``
    on inputs ``x`` and a float64 reference.

    * ``x`` itself: log1p(c d) and log1p(c max(L, i)) each carry about 3 roundings (product,
      log1p, and the +eps), the division one more: relative error <= 8 eps; it moves the
      output by at most ``Lip * 8 eps |x|`` with ``Lip = sum_k |w2_hk w1_k|``.
    * the first layer ``w1 x + b1``: 2 roundings per unit, weighted by ``|w2|``.
    * the second layer, a sum of ``hidden + 1`` terms: ``(hidden + 1) eps sum_k |w2_hk h_k|``.
    Doubled for margin.
    """
    w1, b1, w2, b2 = weights
    hidden = np.maximum(pre, 0.0)
    lip = np.abs(w2) @ np.abs(w1)  # (heads,)
    layer1 = (np.abs(x[..., None] * w1) + np.abs(b1)) @ np.abs(w2).T  # (..., q, k, heads)
    layer2 = hidden @ np.abs(w2).T + np.abs(b2)
    n = len(w1) + 1
    bound = lip * 8 * eps * np.abs(x)[..., None] + 2 * eps * layer1 + n * eps * layer2
    return np.moveaxis(2 * bound, -1, -3)


@pytest.mark.parametrize("case", ["below-L", "across-L", "decode", "per-row", "mixed", "more-queries"])
def test_fire_equals_numpy(case):
    torch.manual_seed(5)
    s = FIRE(3, hidden=16, init_L=6.5).double()
    q_pos, k_pos = {
        "below-L": (torch.arange(6), torch.arange(6)),
        "across-L": (torch.arange(14), torch.arange(14)),
        "decode": (torch.tensor([20, 21]), torch.arange(22)),
        "per-row": (torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 2, 3, 4, 5, 6]]),
                    torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 2, 3, 4, 5, 6]])),
        "mixed": (torch.arange(3, 12), torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0] * 4 + list(range(8))])),
        "more-queries": (torch.arange(9), torch.arange(4)),
    }[case]
    got = s.bias(q_pos, k_pos)
    want, x, pre, weights = fire_numpy(s, q_pos.numpy(), k_pos.numpy())
    assert got.dtype == torch.float64 and tuple(got.shape) == want.shape
    err = np.abs(got.detach().numpy() - want)
    assert bool((err <= fire_bound(x, pre, weights, EPS64)).all()), err.max()


def test_fire_float32_within_rounding_of_float64():
    torch.manual_seed(6)
    s = FIRE(4, init_L=100.5)  # float32 parameters, the paper's hidden width 32
    q_pos, k_pos = torch.arange(0, 3000, 41), torch.arange(0, 3000, 29)
    got = s.bias(q_pos, k_pos)
    assert got.dtype == torch.float32
    want, x, pre, weights = fire_numpy(s, q_pos.numpy(), k_pos.numpy())
    err = np.abs(got.detach().numpy().astype(np.float64) - want)
    assert bool((err <= fire_bound(x, pre, weights, EPS32)).all()), err.max()


def test_fire_defaults_follow_the_paper():
    s = FIRE(8)
    assert isinstance(s.mlp[1], torch.nn.ReLU)
    assert tuple(s.mlp[0].weight.shape) == (32, 1) and tuple(s.mlp[2].weight.shape) == (8, 32)
    assert s.c.item() == pytest.approx(0.1, rel=1e-7) and s.L_multiplier.item() == 1.0
    assert s.init_L.item() == 512.0 and s.threshold.item() == 512.0 and s.eps == 1e-6
    assert {n for n, _ in s.named_parameters()} == {
        "c", "L_multiplier", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"}
    assert "init_L" in s.state_dict() and s.scheme_heads() == 8


def test_fire_half_module_computes_in_float32():
    s = FIRE(2).half()
    assert s.bias(torch.arange(4), torch.arange(4)).dtype == torch.float32


# ============================================================================ FIRE: properties


def fixed_fire(init_L=40.5):
    """A FIRE whose head 0 is f(x) = x (one active unit) and head 1 f(x) = 2 relu(x - 0.25):
    strictly increasing on [0, 1], so different inputs give different biases."""
    s = FIRE(2, hidden=2, init_L=init_L).double()
    with torch.no_grad():
        s.mlp[0].weight.copy_(torch.tensor([[1.0], [1.0]]))
        s.mlp[0].bias.copy_(torch.tensor([0.0, -0.25]))
        s.mlp[2].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        s.mlp[2].bias.zero_()
    return s


def f_of_zero(s):
    w1, b1 = s.mlp[0].weight.detach()[:, 0], s.mlp[0].bias.detach()
    w2, b2 = s.mlp[2].weight.detach(), s.mlp[2].bias.detach()
    return w2.double() @ torch.relu(b1.double()) + b2.double(), (w2.abs().double() @ torch.relu(b1.double()) + b2.abs().double())


@given(st.integers(0, 5), st.lists(st.integers(0, 10**6), min_size=1, max_size=8))
def test_fire_diagonal_is_f_of_zero(seed, positions):
    torch.manual_seed(seed)
    s = FIRE(3, hidden=8, init_L=20.5).double()
    pos = torch.tensor(positions)
    diag = s.bias(pos, pos).diagonal(dim1=-2, dim2=-1)  # (heads, n)
    want, size = f_of_zero(s)
    # x = log1p(0) / norm = 0 exactly; f(0) is a sum of hidden + 1 terms.
    tol = (s.hidden + 1) * EPS64 * size
    assert bool(((diag - want[:, None]).abs() <= tol[:, None]).all())


@given(st.integers(0, 5), st.integers(0, 40), st.integers(0, 40), st.integers(0, 40))
def test_fire_is_relative_below_threshold(seed, i1, i2, d):
    """For query positions <= L the normaliser is psi(L): b(i, i - d) is the same for all i."""
    torch.manual_seed(seed)
    s = FIRE(3, hidden=8, init_L=40.5).double()  # L = 40.5: every i in [0, 40] is below it
    b1 = s.bias(torch.tensor([i1]), torch.tensor([i1 - d]))[:, 0, 0]
    b2 = s.bias(torch.tensor([i2]), torch.tensor([i2 - d]))[:, 0, 0]
    # Identical inputs x; the only freedom is the MLP's summation order: hidden + 1 terms.
    _, _, pre, (w1, b1w, w2, b2w) = fire_numpy(s, np.array([i1]), np.array([i1 - d]))
    size = np.maximum(pre, 0)[0, 0] @ np.abs(w2).T + np.abs(b2w)
    assert bool(((b1 - b2).abs().detach().numpy() <= 2 * (s.hidden + 1) * EPS64 * size).all())


@given(st.integers(41, 10**5), st.integers(1, 10**5), st.integers(1, 40))
def test_fire_is_not_relative_past_threshold(i, gap, d):
    """Past L the query's own position normalises: b(i, i - d) != b(i + gap, i + gap - d)."""
    s = fixed_fire(init_L=40.5)
    x = s.mlp_input(torch.tensor([i, i + gap]), torch.tensor([i - d, i + gap - d]))
    b = s.bias(torch.tensor([i, i + gap]), torch.tensor([i - d, i + gap - d]))
    near, far = b[0, 0, 0], b[0, 1, 1]  # head 0 is f(x) = x
    assert near.item() == x[0, 0].item() and far.item() == x[1, 1].item()
    # x = log(1 + c d) / log(1 + c i) strictly decreases in i: the relative gap is at least
    # about 1 / ((i + gap) log(c (i + gap))) > 1e-6, far above float64 rounding.
    assert far.item() < near.item() * (1 - 1e-7)


def test_fire_threshold_boundary():
    s = fixed_fire(init_L=10.0)
    # i = 10 (= L) and i = 5 share the normaliser psi(L); i = 11 does not.
    x = s.mlp_input(torch.tensor([5, 10, 11]), torch.tensor([2, 7, 8]))
    assert x[0, 0].item() == x[1, 1].item()
    assert x[2, 2].item() < x[1, 1].item()
    c = s.c.item()  # 0.1 rounded to float32
    assert x[1, 1].item() == pytest.approx(math.log1p(c * 3) / (math.log1p(c * 10) + 1e-6), rel=8 * EPS64)


def test_fire_future_keys_use_the_distance():
    s = fixed_fire()
    b = s.bias(torch.tensor([5]), torch.tensor([2, 8]))  # d = 3 both sides
    assert torch.equal(b[..., 0], b[..., 1])


def test_fire_is_not_declared_relative():
    assert not getattr(FIRE, "relative_bias", False) and not _is_relative(FIRE(2).bias)


@pytest.mark.parametrize("rows", [(0, 5), (3, 9), (8, 13)])
@pytest.mark.parametrize("cols", [(0, 13), (2, 7), (9, 13)])
def test_fire_tile_is_block_of_full_bias(rows, cols):
    """What blockwise attention relies on: the bias of a sub-range of positions is the matching
    block of the full bias (same elementwise inputs; the MLP's matmul may sum in another
    order for another shape: hidden + 1 terms)."""
    torch.manual_seed(7)
    s = FIRE(2, hidden=8, init_L=6.5).double()
    pos = torch.arange(13) + 100
    full = s.bias(pos, pos)
    tile = s.bias(pos[rows[0]:rows[1]], pos[cols[0]:cols[1]])
    _, _, pre, (_, _, w2, b2) = fire_numpy(s, pos.numpy(), pos.numpy())
    size = np.moveaxis(np.maximum(pre, 0) @ np.abs(w2).T + np.abs(b2), -1, -3)
    tol = 2 * (s.hidden + 1) * EPS64 * size[:, rows[0]:rows[1], cols[0]:cols[1]]
    assert bool(((tile - full[:, rows[0]:rows[1], cols[0]:cols[1]]).abs().detach().numpy() <= tol).all())


def test_fire_decode_uses_query_position():
    torch.manual_seed(8)
    s = FIRE(2, hidden=8, init_L=3.5).double()
    full = s.bias(torch.arange(12), torch.arange(12))
    last = s.bias(torch.tensor([11]), torch.arange(12))  # one new query at position 11
    assert torch.allclose(last[:, 0], full[:, 11], rtol=0, atol=1e-13)
    # and it differs from the bias the same query would get at index 0 (position 0)
    assert not torch.allclose(last[:, 0, :1], s.bias(torch.tensor([0]), torch.tensor([-11]))[:, 0], atol=1e-6)


# ============================================================================ FIRE: gradients


def fire_params(s):
    return [s.c, s.L_multiplier, *s.mlp.parameters()]


def test_fire_gradcheck_parameters():
    torch.manual_seed(9)
    s = FIRE(2, hidden=6, init_L=4.5).double()
    q_pos, k_pos = torch.tensor([0, 2, 4, 7, 9]), torch.tensor([0, 1, 3, 5, 7, 9])  # both sides of L
    assert torch.autograd.gradcheck(lambda *_: s.bias(q_pos, k_pos), fire_params(s))


def test_fire_gradcheck_through_both_attention_paths():
    torch.manual_seed(10)
    s = FIRE(2, hidden=6, init_L=4.5).double()
    q, k, v = qkv(b=1, h=2, lq=7, lk=7, d=4)
    params = fire_params(s)

    def ref(*_):
        return attention(q, k, v, s, causal=True)

    def blk(*_):
        return bias_attention(q, k, v, s, causal=True, block_size=(3, 2))

    assert torch.autograd.gradcheck(ref, params)
    assert torch.autograd.gradcheck(blk, params)
    assert torch.autograd.gradcheck(lambda q_: bias_attention(q_, k, v, s, causal=True, block_size=3), (q,))


def grads(fn, q, k, v, params):
    out = fn()
    g = rand(*out.shape, seed=99)
    tensors = [q, k, v, *params]
    return out, torch.autograd.grad(out, tensors, g, allow_unused=True)


SCHEMES = {
    "fire": lambda: FIRE(4, hidden=8, init_L=5.5).double(),
    "kerple-log": lambda: KerpleBias(4, form="log").double(),
    "kerple-power": lambda: KerpleBias(4, form="power").double(),
}
CASES = {
    # (b, lq, lk, kv heads, positions)
    "self": (2, 11, 11, 4, None),
    "decode": (2, 3, 11, 4, None),
    "gqa": (1, 9, 9, 2, None),
    "per-row": (2, 9, 9, 4, "per-row"),
    "shifted": (2, 9, 9, 4, "offset"),
}


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("case", CASES)
def test_blockwise_equals_reference_with_gradients(name, case):
    torch.manual_seed(11)
    s = SCHEMES[name]()
    b, lq, lk, hk, pos_kind = CASES[case]
    q, k, v = qkv(b=b, h=4, lq=lq, lk=lk, d=8, hk=hk)
    kw = {}
    if pos_kind == "per-row":
        kw = dict(q_pos=torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5, 6], list(range(9))]),
                  k_pos=torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5, 6], list(range(9))]))
    elif pos_kind == "offset":
        kw = dict(q_pos=torch.arange(9) + 30, k_pos=torch.arange(9) + 30)
    params = list(s.parameters())
    ref, g_ref = grads(lambda: attention(q, k, v, s, causal=True, **kw), q, k, v, params)
    blk, g_blk = grads(lambda: bias_attention(q, k, v, s, causal=True, block_size=(4, 3), **kw), q, k, v, params)
    # Both compute softmax sums of <= lk terms of size <= max |logit| and products with
    # head_dim terms; like tests/test_dispatch.py, the bound is C (d + 2 L) eps m with m the
    # magnitude of the compared quantity (at least 1), C = 8.
    for a, r in zip((blk.detach(), *g_blk), (ref.detach(), *g_ref)):
        assert r is not None and a is not None
        m = max(1.0, r.abs().max().item())
        assert (a - r).abs().max().item() <= 8 * (8 + 2 * lk) * EPS64 * m
    # Every parameter gets a gradient, not identically zero (so the comparison above can
    # fail) - except FIRE's threshold when every query is past it: max(L, i) = i does not
    # depend on L there, and its gradient is exactly 0 on both paths.
    named = dict(zip([n for n, _ in s.named_parameters()], g_ref[3:]))
    queries_past_L = case in ("decode", "shifted")  # positions 8..10 and 30..38 > L = 5.5
    for n, g in named.items():
        if name == "fire" and n == "L_multiplier" and queries_past_L:
            assert g.item() == 0.0 and dict(zip(named, g_blk[3:]))[n].item() == 0.0
        else:
            assert bool(g.abs().sum() > 0), n


def test_fire_gradients_reach_c_and_L_in_both_paths():
    torch.manual_seed(12)
    s = FIRE(2, hidden=8, init_L=5.5).double()
    q, k, v = qkv(b=1, h=2, lq=10, lk=10, d=4)
    for fn in (lambda: attention(q, k, v, s, causal=True),
               lambda: bias_attention(q, k, v, s, causal=True, block_size=4)):
        s.zero_grad()
        fn().square().sum().backward()
        assert s.c.grad.abs().item() > 0 and s.L_multiplier.grad.abs().item() > 0
        assert all(p.grad is not None for p in s.mlp.parameters())


def test_fire_float32_attention_paths_agree():
    torch.manual_seed(13)
    s = FIRE(4)
    q, k, v = qkv(b=1, h=4, lq=33, lk=33, d=16, dtype=torch.float32)
    ref = attention(q, k, v, s, causal=True)
    blk = bias_attention(q, k, v, s, causal=True, block_size=8)
    m = max(1.0, ref.abs().max().item())
    assert (ref - blk).abs().max().item() <= 8 * (16 + 2 * 33) * EPS32 * m


# ============================================================================ FIRE: bad input


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(n_heads=0), ValueError, "n_heads must be >= 1"),
    (dict(n_heads=2, hidden=0), ValueError, "hidden must be >= 1"),
    (dict(n_heads=2, hidden=3.0), TypeError, "hidden must be an int"),
    (dict(n_heads=2, init_c=0.0), ValueError, "init_c must be a finite number > 0"),
    (dict(n_heads=2, init_c=float("nan")), ValueError, "init_c must be a finite number > 0"),
    (dict(n_heads=2, init_L=-512.0), ValueError, "init_L must be a finite number > 0"),
    (dict(n_heads=2, init_L="512"), TypeError, "init_L must be a finite number"),
    (dict(n_heads=2, eps=-1e-6), ValueError, "eps must be a finite number >= 0"),
])
def test_fire_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FIRE(**kwargs)


def test_fire_bad_positions_and_heads():
    s = FIRE(2)
    with pytest.raises(TypeError, match="k_pos must hold integers"):
        s.bias(torch.arange(3), torch.arange(3.0))
    with pytest.raises(ValueError, match="q_pos must have shape"):
        s.bias(torch.zeros(1, 2, 3, dtype=torch.long), torch.arange(3))
    q, k, v = qkv(h=4)
    with pytest.raises(ValueError, match="FIRE was built for 2 heads"):
        bias_attention(q, k, v, s)
    with pytest.raises(TypeError, match="position scheme, not a layer"):
        s(torch.arange(3))
