"""RoPE context extension (companion/scaling.py) and its wiring into RotaryEmbedding.

Every method is checked against a float64 formula written here from the papers (Chen et al.
2023 for Position Interpolation, bloc97's NTK-aware base, Peng et al. 2024 for YaRN, the
Llama 3.1 release for its rule, Ding et al. 2024 for LongRoPE), never against the package's
own helpers, so a slip in companion/scaling.py cannot hide behind a shared function.

Tolerances. The package computes in float32 (HuggingFace's arithmetic). ``U = 2**-24`` is the
float32 unit roundoff: a correctly rounded operation has relative error <= U, an operation
accurate to 1 ulp (torch's vectorised ``pow``) <= 2 U. Each bound below adds the errors of the
operations the package performs, with the amplification each one suffers (a rounded exponent
``e`` in ``b ** e`` costs ``e ln b`` times its own error; a blend between ``theta`` and
``theta / s`` turns an absolute error in its weight into a relative one ``s`` times larger).
The float64 references carry errors near 2**-53 times the same factors, about 1e-9 of the
float32 bounds; they are ignored.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from companion.rope import RotaryEmbedding, rope_cos_sin, rope_rotate
from companion.scaling import (
    DEFAULT_THETA,
    ROPE_TYPES,
    compute_inv_freq,
    dynamic_ntk_base,
    llama_cpp_rope_args,
    ntk_base,
    parse_rope_config,
    proportional_rope_angles,
    rope_parameters_from_legacy,
    yarn_correction_range,
    yarn_get_mscale,
)
from helpers import U32 as U
from helpers import U64, pow_bound
from helpers import rand32 as rand

# Unexpected warnings are failures; tests that expect one catch it with pytest.warns.
pytestmark = pytest.mark.filterwarnings("error::UserWarning")


# ----------------------------------------------------------------------------- float64 references


def ref_theta(base, d):
    """theta_i = b ** (-2 i / d), i = 0 .. d/2 - 1 (Su et al.), in float64."""
    i = np.arange(d // 2, dtype=np.float64)
    return base ** (-2.0 * i / d)


def ref_ntk_base(base, s, d):
    """The NTK-aware base b * s ** (d / (d - 2))."""
    return base * s ** (d / (d - 2))


def ref_dynamic_base(base, s, d, seq_len, m):
    """Dynamic NTK: b * (s n / M - (s - 1)) ** (d / (d - 2)), n = max(seq_len, M); None -> M."""
    n = m if seq_len is None else max(seq_len, m)
    return base * ((s * n / m) - (s - 1)) ** (d / (d - 2))


def ref_yarn_range(d, base, length, beta_fast, beta_slow, truncate):
    """YaRN's ramp ends: the pair index that turns beta times over the original length L."""
    def index(beta):
        return d * math.log(length / (2 * math.pi * beta)) / (2 * math.log(base))

    low, high = index(beta_fast), index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    return low, high


def ref_yarn(base, d, s, length, beta_fast=32.0, beta_slow=1.0, truncate=True):
    """theta'_i = theta_i / s * r(i) + theta_i * (1 - r(i)), r the clamped linear ramp."""
    low, high = ref_yarn_range(d, base, length, beta_fast, beta_slow, truncate)
    theta = ref_theta(base, d)
    r = np.clip((np.arange(d // 2) - low) / (high - low), 0.0, 1.0)
    return theta / s * r + theta * (1 - r), (low, high)


def ref_llama3(base, d, s, low_ff, high_ff, length):
    """Llama 3.1: w = 2 pi / theta; w > L/low -> theta/s; w < L/high -> theta; else blend."""
    theta = ref_theta(base, d)
    w = 2 * math.pi / theta
    sm = (length / w - low_ff) / (high_ff - low_ff)
    blend = (1 - sm) * theta / s + sm * theta
    out = np.where(w > length / low_ff, theta / s, np.where(w < length / high_ff, theta, blend))
    return out, sm


def ref_yarn_attention(s, mscale=None, mscale_all_dim=None):
    def get(m):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    if mscale and mscale_all_dim:
        return get(mscale) / get(mscale_all_dim)
    return get(1.0)


# ----------------------------------------------------------------------------- bounds


def dynamic_tensor_bound(base, s, d, n, m):
    """The dynamic base from a 0-d tensor seq_len, in float32 tensor arithmetic, then pow_bound.

    q = fl(fl(s) * n) / M: 3 roundings, 3 U q; x = q - fl(s - 1): the cancellation leaves an
    absolute error 3 U q + U (s - 1) + U x on x >= 1; x ** fl(p) (p = d/(d-2) <= 2 rounded):
    p eps_x + p ln(x) U + 2 U; times fl(b): 2 U. Then theta = b' ** -e: e eps_b <= eps_b, plus
    the exponent rounding, pow and reciprocal, (ln b' + 3) U (b' is already float32).
    """
    n = max(n, m)
    q = s * n / m
    x = q - (s - 1)
    p = d / (d - 2)
    eps_x = (3 * q + (s - 1)) * U / x + U
    eps_b = p * eps_x + p * math.log(x) * U + 4 * U
    return eps_b + (math.log(base * x**p) + 3) * U


def yarn_bound(base, d, s, low, high):
    """Per-pair relative bound for YaRN's float32 blend.

    keep = 1 / b**e and squeeze = 1 / (fl(s) * b**e): pow_bound + 2 U (Ef). The ramp
    fl(fl(i - fl(low)) / fl(high - low)): low rounded to float32 costs U |low| / |high - low|
    absolute when low is not a float32 number (truncate=False), the subtraction, the
    conversion of high - low and the division 3 U r <= 3 U; kept = 1 - r and 1 - kept add U each.
    So each weight is off by at most D = 5 U + U |low| / |high - low| (low inexact). The result
    R = theta/s * r + theta * (1 - r) >= theta / s, so a weight error costs at most D on the
    theta/s term and s D on the theta term; two products and a sum add 3 U.
    """
    low_exact = float(np.float32(low)) == low
    dw = 5 * U + (0.0 if low_exact else U * abs(low) / abs(high - low))
    return pow_bound(base) + 2 * U + 3 * U + (s + 1) * dw


def llama3_bounds(base, d, s, low_ff, high_ff, length):
    """Per-pair relative bound for the Llama-3 rule, and the exact smooth factor.

    Out of the band: theta or fl(theta / fl(s)): pow_bound + 2 U. In the band the weight
    c = (L / w - low) / (high - low) is computed from w = fl(fl(2 pi) / theta^): relative
    error eps_w = pow_bound + 2 U on w, + U for L / w; so y = L / w is off by y eps_w, low
    rounded to float32 by U low, and the subtraction, the conversion of high - low and the
    division add 3 U |c|: dc = (y eps_w + U low) / (high - low) + 3 U max(|c|, 1). The blend
    theta ((1 - c) / s + c) >= theta / s changes by theta (1 - 1/s) dc, relatively (s - 1) dc;
    its own roundings (1 - c, theta / fl(s), two products, a sum) add 5 U. A pair within dc of
    a band edge may fall on either side in float32; by continuity the other rule differs there
    by at most (s - 1) dc as well, so such pairs get the band's bound.
    """
    theta = ref_theta(base, d)
    y = length / (2 * math.pi / theta)
    c = (y - low_ff) / (high_ff - low_ff)
    eps_w = pow_bound(base) + 3 * U
    dc = (y * eps_w + U * low_ff) / (high_ff - low_ff) + 3 * U * np.maximum(np.abs(c), 1)
    near = (c >= -dc) & (c <= 1 + dc)
    band = pow_bound(base) + 5 * U + (s - 1) * dc
    return np.where(near, band, pow_bound(base) + 2 * U), c


def assert_rel(got, want, tol, what=""):
    """|got - want| <= tol * want elementwise (want > 0, float64); tol a number or an array."""
    assert got.dtype == torch.float32, what
    got64 = got.double().numpy()
    assert got64.shape == want.shape, what
    rel = np.abs(got64 - want) / want
    ok = rel <= tol
    assert ok.all(), (
        f"{what}: worst relative error {rel.max():.3g} (bound {np.broadcast_to(tol, rel.shape)[rel.argmax()]:.3g}) "
        f"at pair {int(rel.argmax())}"
    )


# ----------------------------------------------------------------------------- strategies

bases = st.floats(2.0, 7.0).map(lambda e: 10.0**e)  # log-uniform over 100 .. 1e7
factors = st.floats(1.0, 64.0)
lengths = st.integers(16, 1 << 17)


@st.composite
def rotary(draw, min_dim=2):
    """(head_dim, partial_rotary_factor, rotary_dim) with an even rotary_dim >= min_dim."""
    head_dim = 2 * draw(st.integers(2, 128))
    partial = draw(st.sampled_from([1.0, 0.5, 0.25]))
    d = int(head_dim * partial)
    assume(d % 2 == 0 and d >= min_dim)
    return head_dim, partial, d


def inv(cfg, head_dim, partial=1.0, **kw):
    return compute_inv_freq(cfg, head_dim, partial_rotary_factor=partial, **kw)


# ----------------------------------------------------------------------------- 1. the methods


@given(base=bases, rot=rotary(), in_dict=st.booleans())
def test_default_is_plain_rope(base, rot, in_dict):
    head_dim, partial, d = rot
    cfg = {"rope_type": "default", "rope_theta": base}
    if in_dict:
        got, att = compute_inv_freq({**cfg, "partial_rotary_factor": partial}, head_dim)
    else:
        got, att = inv(cfg, head_dim, partial)
    assert got.shape == (d // 2,) and att == 1.0
    assert_rel(got, ref_theta(base, d), pow_bound(base), "default")


@given(base=bases, rot=rotary(), s=factors)
def test_linear_divides_every_frequency(base, rot, s):
    head_dim, partial, d = rot
    got, att = inv({"rope_type": "linear", "rope_theta": base, "factor": s}, head_dim, partial)
    assert att == 1.0
    # pow_bound, then the division by fl(s): one rounding of s and one of the quotient
    assert_rel(got, ref_theta(base, d) / s, pow_bound(base) + 2 * U, "linear")


@given(base=bases, rot=rotary(min_dim=4), s=factors)
def test_ntk_keeps_the_highest_and_divides_the_lowest_by_s(base, rot, s):
    head_dim, partial, d = rot
    b_new = ref_ntk_base(base, s, d)
    # float64: the two defining properties of the NTK-aware base, exactly up to rounding
    # (each side is a few float64 pows, each costing about ln(base) * 2**-53)
    lowest_new, lowest_old = b_new ** (-(d - 2) / d), base ** (-(d - 2) / d)
    assert math.isclose(lowest_new, lowest_old / s, rel_tol=(2 * math.log(b_new) + 8) * U64)
    assert math.isclose(ntk_base(base, s, d), b_new, rel_tol=(math.log(s) * 2 + 4) * U64)

    got, att = inv({"rope_type": "ntk", "rope_theta": base, "factor": s}, head_dim, partial)
    assert att == 1.0
    assert got[0].item() == 1.0  # b' ** 0: the highest frequency is untouched, bit for bit
    assert_rel(got[-1:], np.array([lowest_old / s]), pow_bound(b_new), "ntk lowest = lowest / s")
    assert_rel(got, ref_theta(b_new, d), pow_bound(b_new), "ntk")


@given(base=bases, rot=rotary(min_dim=4), s=factors, m=st.integers(16, 8192), data=st.data())
def test_dynamic_ntk(base, rot, s, m, data):
    head_dim, partial, d = rot
    cfg = {"rope_type": "dynamic", "rope_theta": base, "factor": s}
    plain = inv({"rope_type": "default", "rope_theta": base}, head_dim, partial)[0]
    # seq_len None or <= M: the reference length M, so exactly the default frequencies
    short = data.draw(st.integers(1, m))
    for n in (None, short, m):
        got, att = inv(cfg, head_dim, partial, max_position_embeddings=m, seq_len=n)
        assert att == 1.0 and torch.equal(got, plain), n
    # longer: the base of that length (Python int: the base is computed in float64)
    n = data.draw(st.integers(m + 1, 64 * m))
    b_new = ref_dynamic_base(base, s, d, n, m)
    got, _ = inv(cfg, head_dim, partial, max_position_embeddings=m, seq_len=n)
    assert_rel(got, ref_theta(b_new, d), pow_bound(b_new), "dynamic, int seq_len")
    # a 0-d tensor (HuggingFace's forward pass): the same formula in float32 tensor arithmetic
    for nt in (n, short):
        got, _ = inv(cfg, head_dim, partial, max_position_embeddings=m, seq_len=torch.tensor(nt))
        b_ref = ref_dynamic_base(base, s, d, nt, m)
        assert_rel(got, ref_theta(b_ref, d), dynamic_tensor_bound(base, s, d, nt, m), "dynamic, tensor seq_len")
    assert math.isclose(dynamic_ntk_base(base, s, d, n, m), b_new, rel_tol=1e-12)


@given(base=bases, rot=rotary(), s=factors, length=lengths, data=st.data())
def test_yarn_ramp_and_attention_factor(base, rot, s, length, data):
    head_dim, partial, d = rot
    cfg = {"rope_type": "yarn", "rope_theta": base, "factor": s, "original_max_position_embeddings": length}
    beta_fast, beta_slow = 32.0, 1.0
    if data.draw(st.booleans(), label="explicit betas"):
        beta_slow = data.draw(st.floats(0.25, 4.0), label="beta_slow")
        beta_fast = beta_slow * data.draw(st.sampled_from([1.0]) | st.floats(1.0, 64.0), label="ratio")
        cfg.update(beta_fast=beta_fast, beta_slow=beta_slow)
    truncate = data.draw(st.sampled_from([None, True, False]), label="truncate")
    if truncate is not None:
        cfg["truncate"] = truncate
    truncate = True if truncate is None else truncate
    want, (low, high) = ref_yarn(base, d, s, length, beta_fast, beta_slow, truncate)
    got, att = inv(cfg, head_dim, partial)
    assert_rel(got, want, yarn_bound(base, d, s, low, high), "yarn")
    # 0.1 ln s + 1, evaluated in float64 by both sides (a few roundings of 2**-53)
    assert math.isclose(att, 0.1 * math.log(s) + 1, rel_tol=8 * U64)
    # the package's correction range, before the +0.001, is the one written above
    pkg_low, pkg_high = yarn_correction_range(beta_fast, beta_slow, d, base, length, truncate)
    assert pkg_low == low and (pkg_high == high or pkg_high + 0.001 == high)


def test_yarn_ramp_regions_on_a_known_config():
    # Llama-2-like: d = 128, b = 1e4, L = 4096: pair i turns L theta_i / (2 pi) times over L.
    # beta_fast = 32 turns at index 128 ln(4096 / (64 pi)) / (2 ln 1e4) = 20.94 -> low = 20;
    # beta_slow = 1 at 128 ln(4096 / (2 pi)) / (2 ln 1e4) = 45.00 -> high = 46.
    cfg = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 4096}
    got, _ = compute_inv_freq(cfg, 128)
    assert yarn_correction_range(32, 1, 128, 1e4, 4096) == (20, 46)
    theta = ref_theta(1e4, 128)
    tol = yarn_bound(1e4, 128, 8.0, 20, 46)
    assert_rel(got[:21], theta[:21], tol, "kept below low")  # r = 0 up to i = low
    assert_rel(got[46:], theta[46:] / 8, tol, "interpolated above high")
    r = (np.arange(21, 46) - 20) / 26
    assert_rel(got[21:46], theta[21:46] * (r / 8 + 1 - r), tol, "ramp")


def test_yarn_equal_ends_get_a_ramp_of_width_0_001():
    # beta_fast = beta_slow and truncate=False give low == high: the ramp would divide by zero,
    # so high gets + 0.001. Choose beta so that the common index is 10 - 0.0004: then pair 10
    # sits 0.0004 past low and gets r = 0.0004 / 0.001 = 0.4; pairs <= 9 keep, >= 11 divide.
    d, base, length, s, idx = 64, 1e4, 4096, 8.0, 10 - 0.0004
    beta = length / (2 * math.pi * math.exp(idx * 2 * math.log(base) / d))
    cfg = {"rope_type": "yarn", "rope_theta": base, "factor": s, "original_max_position_embeddings": length,
           "beta_fast": beta, "beta_slow": beta, "truncate": False}
    want, (low, high) = ref_yarn(base, d, s, length, beta, beta, truncate=False)
    assert math.isclose(low, idx, rel_tol=1e-12) and math.isclose(high - low, 0.001, rel_tol=1e-9)
    theta = ref_theta(base, d)
    assert math.isclose(want[10], theta[10] * (0.4 / s + 0.6), rel_tol=1e-9)
    got, _ = compute_inv_freq(cfg, d)
    # low = 9.9996 is no float32 number: its rounding, U * 10 / 0.001 in r, dominates the bound
    assert_rel(got, want, yarn_bound(base, d, s, low, high), "yarn, low == high")
    # truncated instead, low == high is an integer: the ramp is 0 at it and 1 after it
    _, (tlow, thigh) = ref_yarn(base, d, s, length, beta, beta, truncate=True)
    got_t, _ = compute_inv_freq({**cfg, "truncate": True}, d)
    assert (tlow, thigh) == (9, 10) and torch.isfinite(got_t).all()
    assert_rel(got_t, ref_yarn(base, d, s, length, beta, beta)[0], yarn_bound(base, d, s, 9, 10), "truncated")


@pytest.mark.parametrize("s", [1.0, 1.5, 4.0, 40.0])
def test_yarn_attention_factor_forms(s):
    base = {"rope_type": "yarn", "rope_theta": 1e4, "factor": s, "original_max_position_embeddings": 4096}
    tol = 16 * U64  # two float64 expressions of a handful of roundings each
    # DeepSeek's mscale / mscale_all_dim ratio
    _, att = compute_inv_freq({**base, "mscale": 0.707, "mscale_all_dim": 1.3}, 64)
    assert math.isclose(att, ref_yarn_attention(s, 0.707, 1.3), rel_tol=tol)
    want = (0.1 * 0.707 * math.log(s) + 1) / (0.1 * 1.3 * math.log(s) + 1)
    assert math.isclose(att, want, rel_tol=tol)
    # DeepSeek-V3 sets both to 1.0: the ratio is exactly 1 (x / x)
    assert compute_inv_freq({**base, "mscale": 1.0, "mscale_all_dim": 1.0}, 64)[1] == 1.0
    # mscale alone, or with mscale_all_dim = 0: the plain 0.1 ln s + 1 (mscale is ignored)
    plain = 0.1 * math.log(s) + 1
    for extra in ({"mscale": 0.707}, {"mscale": 0.707, "mscale_all_dim": 0}, {"mscale_all_dim": 0.707}):
        assert math.isclose(compute_inv_freq({**base, **extra}, 64)[1], plain, rel_tol=tol), extra
    # an explicit attention_factor wins over everything
    att = compute_inv_freq({**base, "attention_factor": 0.37, "mscale": 0.707, "mscale_all_dim": 1.3}, 64)[1]
    assert att == 0.37
    assert math.isclose(yarn_get_mscale(s, 0.707), 0.1 * 0.707 * math.log(s) + 1, rel_tol=tol)


def test_yarn_uses_the_original_length_not_max_position_embeddings():
    cfg = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "original_max_position_embeddings": 2048}
    a = compute_inv_freq(cfg, 64, max_position_embeddings=8192)
    b = compute_inv_freq(cfg, 64, max_position_embeddings=100_000)
    c = compute_inv_freq(cfg, 64)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0], c[0]) and a[1] == b[1] == c[1]
    # and L really matters: another original length gives other frequencies
    other = compute_inv_freq({**cfg, "original_max_position_embeddings": 8192}, 64)[0]
    assert not torch.equal(a[0], other)


def test_yarn_factor_defaults_to_the_length_ratio():
    cfg = {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 4096}
    got, att = compute_inv_freq(cfg, 64, max_position_embeddings=32768)
    want, watt = compute_inv_freq({**cfg, "factor": 8.0}, 64)
    assert torch.equal(got, want) and att == watt
    assert math.isclose(att, 0.1 * math.log(8) + 1, rel_tol=8 * U64)
    # original_max_position_embeddings omitted: max_position_embeddings, so s = 1
    got1, att1 = compute_inv_freq({"rope_type": "yarn", "rope_theta": 1e4}, 64, max_position_embeddings=4096)
    assert att1 == 1.0
    assert_rel(got1, ref_theta(1e4, 64), pow_bound(1e4) + 8 * U, "yarn with s = 1 is plain RoPE")


@given(base=bases, rot=rotary(), s=factors, length=st.integers(256, 1 << 17),
       low_ff=st.floats(0.5, 4.0), gap=st.floats(0.25, 16.0))
def test_llama3_rule(base, rot, s, length, low_ff, gap):
    head_dim, partial, d = rot
    high_ff = low_ff + gap
    cfg = {"rope_type": "llama3", "rope_theta": base, "factor": s, "low_freq_factor": low_ff,
           "high_freq_factor": high_ff, "original_max_position_embeddings": length}
    got, att = inv(cfg, head_dim, partial)
    assert att == 1.0
    want, _ = ref_llama3(base, d, s, low_ff, high_ff, length)
    tol, _ = llama3_bounds(base, d, s, low_ff, high_ff, length)
    assert_rel(got, want, tol, "llama3")


def test_llama3_1_config():
    # Meta's Llama 3.1 release: theta 5e5, factor 8, low 1, high 4, original 8192, d = 128
    cfg = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    got, _ = compute_inv_freq(cfg, 128)
    theta = ref_theta(5e5, 128)
    w = 2 * math.pi / theta
    short, long = w < 8192 / 4, w > 8192 / 1
    assert short.sum() > 0 and long.sum() > 0 and (~short & ~long).sum() > 0  # all three regions
    tol, _ = llama3_bounds(5e5, 128, 8.0, 1.0, 4.0, 8192)
    assert_rel(got[torch.from_numpy(short)], theta[short], tol[short], "kept")
    assert_rel(got[torch.from_numpy(long)], theta[long] / 8, tol[long], "divided by 8")
    want, _ = ref_llama3(5e5, 128, 8.0, 1.0, 4.0, 8192)
    assert_rel(got, want, tol, "llama 3.1")


def _boundary_config(which, s=8.0, length=8192):
    """A config in which pair 0 (theta_0 = 1, float32 wavelength W = fl(2 pi)) sits exactly on
    one band edge as the package computes it: fl(L / W) is chosen as low_freq_factor (long
    edge) or high_freq_factor (short edge), the other factor half or twice it (exact)."""
    y = float(np.float32(length) / np.float32(2 * math.pi))  # float32 division, as torch does
    low, high = (y, 2 * y) if which == "long" else (y / 2, y)
    return {"rope_type": "llama3", "rope_theta": 1e4, "factor": s, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": length}


def test_llama3_band_edges_are_continuous():
    # On the long edge the blend weight is (y - y) / (2y - y) = 0 exactly, so the blend is
    # theta / s, the same number as the out-of-band rule: pair 0 is 1/8 whichever side the
    # float32 comparison puts it (the edge belongs to the band, but the two rules agree there,
    # so no output can tell). Every other pair has w > W, out of the band: theta / s, so the
    # whole table equals Position Interpolation bit for bit.
    got, _ = compute_inv_freq(_boundary_config("long"), 64)
    assert got[0].item() == 0.125
    assert torch.equal(got, compute_inv_freq({"rope_type": "linear", "rope_theta": 1e4, "factor": 8.0}, 64)[0])
    # On the short edge the weight is (y - y/2) / (y - y/2) = 1 exactly: theta, as the kept rule
    got, _ = compute_inv_freq(_boundary_config("short"), 64)
    assert got[0].item() == 1.0
    # Moving the edge by 1e-4 relative, to either side, moves pair 0's weight by dc (computed
    # below in float64; it is 0 on the side where the pair leaves the band) and its value by
    # (1 - 1/s) dc, no more: the rule is continuous. Float32 rounding: the weight, from
    # y - fl(low) over high - low with y / (high - low) <= 2, is off by at most 6 U, the blend
    # near its edge value (<= 1) by 5 U more: 12 U in all.
    s = 8.0
    for which in ("long", "short"):
        cfg = _boundary_config(which, s)
        y = cfg["low_freq_factor" if which == "long" else "high_freq_factor"]  # fl(L / W)
        key = "low_freq_factor" if which == "long" else "high_freq_factor"
        edge = 1 / s if which == "long" else 1.0
        for nudge in (1 - 1e-4, 1 + 1e-4):
            moved = {**cfg, key: cfg[key] * nudge}
            low, high = moved["low_freq_factor"], moved["high_freq_factor"]
            c = min(max((y - low) / (high - low), 0.0), 1.0)
            dc = c if which == "long" else 1 - c
            assert 0 <= dc < 2.1e-4
            got = compute_inv_freq(moved, 64)[0][0].item()
            assert abs(got - edge) <= (1 - 1 / s) * dc + 12 * U, (which, nudge)
            assert abs(got - edge) >= (1 - 1 / s) * dc - 12 * U, (which, nudge)  # and it does move


@given(base=bases, rot=rotary(), length=st.integers(256, 1 << 17), seed=st.integers(0, 2**32 - 1),
       factor=st.none() | factors, data=st.data())
def test_longrope_factors_and_attention(base, rot, length, seed, factor, data):
    head_dim, partial, d = rot
    rng = np.random.default_rng(seed)
    short = rng.uniform(1.0, 2.0, d // 2)
    long = rng.uniform(4.0, 64.0, d // 2)  # disjoint from short: the bound tells them apart
    cfg = {"rope_type": "longrope", "rope_theta": base, "short_factor": short.tolist(),
           "long_factor": long.tolist(), "original_max_position_embeddings": length}
    m = data.draw(st.integers(length, 64 * length), label="max_position_embeddings")
    if factor is not None:
        cfg["factor"] = factor
    s = factor if factor is not None else m / length
    theta = ref_theta(base, d)
    tol = pow_bound(base) + 2 * U  # pow_bound, then the factor's rounding to float32 and the product
    below = data.draw(st.integers(1, length), label="seq_len <= original")
    above = data.draw(st.integers(length + 1, 1 << 20), label="seq_len > original")
    for n in (None, length, below, torch.tensor(length)):
        got, att = inv(cfg, head_dim, partial, max_position_embeddings=m, seq_len=n)
        assert_rel(got, theta / short, tol, f"short factors at seq_len={n}")
    for n in (length + 1, above, torch.tensor(length + 1)):
        got, att = inv(cfg, head_dim, partial, max_position_embeddings=m, seq_len=n)
        assert_rel(got, theta / long, tol, f"long factors at seq_len={n}")
    want = 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(length))
    assert math.isclose(att, want, rel_tol=8 * U64)
    # an explicit attention_factor wins
    assert inv({**cfg, "attention_factor": 0.81}, head_dim, partial, max_position_embeddings=m)[1] == 0.81


def test_longrope_factor_one_has_no_attention_correction():
    cfg = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
           "original_max_position_embeddings": 4096}
    assert compute_inv_freq({**cfg, "factor": 1.0}, 8)[1] == 1.0
    assert compute_inv_freq(cfg, 8, max_position_embeddings=4096)[1] == 1.0  # derived s = 1
    # the derived factor is max_position_embeddings / original: 131072 / 4096 = 32 (Phi-3)
    att = compute_inv_freq(cfg, 8, max_position_embeddings=131072)[1]
    assert math.isclose(att, math.sqrt(1 + math.log(32) / math.log(4096)), rel_tol=8 * U64)


# ----------------------------------------------------------------------------- 2. config parsing

M = 8192
CONFIGS = {
    "default": {"rope_type": "default", "rope_theta": 5e5},
    "linear": {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
    "ntk": {"rope_type": "ntk", "rope_theta": 5e5, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "original_max_position_embeddings": 2048,
             "beta_fast": 16.0, "beta_slow": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 2048},
    "longrope": {"rope_type": "longrope", "rope_theta": 5e5, "short_factor": [1.0 + i / 16 for i in range(16)],
                 "long_factor": [2.0 + i for i in range(16)], "original_max_position_embeddings": 2048},
    # no partial_rotary_factor here: the parametrized tests below add their own
    "proportional": {"rope_type": "proportional", "rope_theta": 5e5, "factor": 2.0},
}
assert tuple(CONFIGS) == ROPE_TYPES


def same(a, b):
    return torch.equal(a[0], b[0]) and a[1] == b[1]


def test_legacy_and_v5_forms_agree():
    theta = 5e5
    v5 = {"rope_type": "linear", "rope_theta": theta, "factor": 4}
    legacy = {"type": "linear", "factor": 4}
    converted = rope_parameters_from_legacy(legacy, theta)
    assert converted == {"rope_type": "linear", "factor": 4, "rope_theta": theta}
    assert same(compute_inv_freq(converted, 64), compute_inv_freq(v5, 64))
    assert same(compute_inv_freq({**legacy, "rope_theta": theta}, 64), compute_inv_freq(v5, 64))
    assert same(compute_inv_freq({**legacy, "rope_type": "linear", "rope_theta": theta}, 64),
                compute_inv_freq(v5, 64))
    assert parse_rope_config(converted, 64) == parse_rope_config(v5, 64)
    assert parse_rope_config({**legacy, "rope_theta": theta}, 64) == parse_rope_config(v5, 64)
    # no rope_scaling at all: plain RoPE
    assert rope_parameters_from_legacy(None, theta) == {"rope_type": "default", "rope_theta": theta}
    # linear by 4 is theta / 4, which differs from the default: the comparison above can fail
    assert not same(compute_inv_freq(v5, 64), compute_inv_freq({"rope_type": "default", "rope_theta": theta}, 64))


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_params_reparse_to_the_same_spec(rope_type):
    spec = parse_rope_config(CONFIGS[rope_type], 32, max_position_embeddings=M)
    assert spec.rope_type == rope_type and spec.dim == 32 and spec.theta == 5e5
    again = parse_rope_config(spec.params, 32, max_position_embeddings=M)
    assert again == spec
    assert same(compute_inv_freq(spec.params, 32, max_position_embeddings=M, seq_len=M + 1),
                compute_inv_freq(CONFIGS[rope_type], 32, max_position_embeddings=M, seq_len=M + 1))


def test_params_reparse_keeps_an_argument_partial_factor():
    spec = parse_rope_config(CONFIGS["yarn"], 64, partial_rotary_factor=0.5)
    assert spec.dim == 32
    assert parse_rope_config(spec.params, 64) == spec


@pytest.mark.parametrize("rope_type", ["yarn", "llama3", "longrope"])
def test_original_length_defaults_to_max_position_embeddings(rope_type):
    cfg = {k: v for k, v in CONFIGS[rope_type].items() if k != "original_max_position_embeddings"}
    snapshot = {k: list(v) if isinstance(v, list) else v for k, v in cfg.items()}
    spec = parse_rope_config(cfg, 32, max_position_embeddings=M)
    assert cfg == snapshot  # the defaults go into spec.params, not into the caller's dict
    assert spec.params["original_max_position_embeddings"] == M
    explicit = {**cfg, "original_max_position_embeddings": M}
    for n in (None, M, M + 1):
        assert same(compute_inv_freq(cfg, 32, max_position_embeddings=M, seq_len=n),
                    compute_inv_freq(explicit, 32, max_position_embeddings=M, seq_len=n))
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        parse_rope_config(cfg, 32)


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_partial_factor_in_the_dict_or_as_argument(rope_type):
    cfg = CONFIGS[rope_type]  # head_dim 64 * 0.5 = 32 rotated dims: longrope's 16 factors fit
    a = compute_inv_freq(cfg, 64, partial_rotary_factor=0.5, max_position_embeddings=M, seq_len=M + 1)
    b = compute_inv_freq({**cfg, "partial_rotary_factor": 0.5}, 64, max_position_embeddings=M, seq_len=M + 1)
    # proportional returns head_dim // 2 frequencies (zeros past the rotating pairs)
    assert a[0].shape == ((32,) if rope_type == "proportional" else (16,)) and same(a, b)
    # the same value in both places is fine; different values are an error
    compute_inv_freq({**cfg, "partial_rotary_factor": 0.5}, 64, partial_rotary_factor=0.5, max_position_embeddings=M)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        compute_inv_freq({**cfg, "partial_rotary_factor": 0.5}, 64, partial_rotary_factor=0.25,
                         max_position_embeddings=M)


def test_missing_rope_theta_of_a_plain_config_warns_and_uses_10000():
    with pytest.warns(UserWarning, match="rope_theta"):
        got = compute_inv_freq({"rope_type": "default"}, 32)
    assert DEFAULT_THETA == 10000.0
    assert same(got, compute_inv_freq({"rope_type": "default", "rope_theta": 10000.0}, 32))
    with pytest.warns(UserWarning, match="rope_theta"):
        spec = parse_rope_config({}, 32)  # no type either: plain RoPE
    assert spec.theta == 10000.0 and spec.params["rope_theta"] == 10000.0
    assert parse_rope_config(None, 32).theta == 10000.0  # None: plain RoPE, no warning


@pytest.mark.parametrize("rope_type", [t for t in ROPE_TYPES if t != "default"])
@pytest.mark.parametrize("spelling", ["rope_type", "type"])
def test_missing_rope_theta_of_a_scaled_config_is_an_error(rope_type, spelling):
    """A scaled dict without its base is an old rope_scaling dict (the base was a separate
    config attribute): 10000 would give a Llama 3.1 config (base 500000) wrong frequencies."""
    cfg = {k: v for k, v in CONFIGS[rope_type].items() if k not in ("rope_theta", "rope_type")}
    cfg[spelling] = rope_type
    with pytest.raises(ValueError, match=r"rope_type='%s' but no 'rope_theta'.*default 10000 would be used"
                       r".*rope_parameters_from_legacy\(config\['rope_scaling'\], config\['rope_theta'\]\)" % rope_type):
        compute_inv_freq(cfg, 32, max_position_embeddings=M)
    # the legacy helper with the model's base is the fix, and gives the v5 config's values
    fixed = rope_parameters_from_legacy(cfg, 5e5)
    assert same(compute_inv_freq(fixed, 32, max_position_embeddings=M, seq_len=M + 1),
                compute_inv_freq(CONFIGS[rope_type], 32, max_position_embeddings=M, seq_len=M + 1))


def test_a_legacy_llama31_config_gets_its_own_base():
    """The issue's case: Llama 3.1's config.json, rope_scaling without rope_theta (500000)."""
    config = {"rope_theta": 500000.0, "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    with pytest.raises(ValueError, match="rope_theta"):
        compute_inv_freq(config["rope_scaling"], 128)
    inv, _ = compute_inv_freq(rope_parameters_from_legacy(config["rope_scaling"], config["rope_theta"]), 128)
    # the highest frequency is kept by llama3: 1 for any base; the next one is base ** (-2 / 128)
    assert float(inv[0]) == 1.0
    assert math.isclose(float(inv[1]), 500000.0 ** (-2 / 128), rel_tol=pow_bound(500000.0))
    assert not math.isclose(float(inv[1]), 10000.0 ** (-2 / 128), rel_tol=1e-3)


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_unknown_keys_warn_and_are_ignored(rope_type):
    cfg = CONFIGS[rope_type]
    with pytest.warns(UserWarning, match="my_custom_key"):
        got = compute_inv_freq({**cfg, "my_custom_key": 3}, 32, max_position_embeddings=M)
    assert same(got, compute_inv_freq(cfg, 32, max_position_embeddings=M))


# ----------------------------------------------------------------------------- 3. errors


YARN = CONFIGS["yarn"]
LLAMA3 = CONFIGS["llama3"]
LONG = {**CONFIGS["longrope"], "factor": 4.0}

BAD = [
    ({"rope_type": "su", "rope_theta": 1e4}, {}, ValueError, r"rope_config\['rope_type'\] must be one of.*'su'"),
    ({"rope_type": "linear", "rope_theta": 1e4}, {}, ValueError, r"rope_type='linear' needs the key 'factor'"),
    ({"rope_type": "ntk", "rope_theta": 1e4}, {}, ValueError, r"rope_type='ntk' needs the key 'factor'"),
    ({"rope_type": "dynamic", "rope_theta": 1e4}, {"max_position_embeddings": M}, ValueError,
     r"rope_type='dynamic' needs the key 'factor'"),
    ({k: v for k, v in LLAMA3.items() if k != "factor"}, {}, ValueError, r"rope_type='llama3' needs the key 'factor'"),
    ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, {}, ValueError,
     r"dynamic.*needs max_position_embeddings"),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": 0.5}, {}, ValueError, r"rope_config\['factor'\].*>= 1"),
    ({**YARN, "factor": 0.99}, {}, ValueError, r"rope_config\['factor'\].*>= 1"),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": float("nan")}, {}, ValueError, r"rope_config\['factor'\]"),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": "4"}, {}, ValueError, r"rope_config\['factor'\]"),
    ({**LONG, "short_factor": [1.0] * 15}, {}, ValueError, r"rope_config\['short_factor'\].*length.* 16.*got 15"),
    ({**LONG, "long_factor": [1.0] * 32}, {}, ValueError, r"rope_config\['long_factor'\].*length.* 16.*got 32"),
    (LONG, {"partial_rotary_factor": 0.5}, ValueError,
     r"rope_config\['short_factor'\].*length rotary_dim / 2 = 8.*got 16"),  # a partial rotary dim is counted
    ({**LONG, "short_factor": [1.0] * 3 + [0.0] + [1.0] * 12}, {}, ValueError,
     r"rope_config\['short_factor'\]\[3\].*> 0"),
    ({**LONG, "long_factor": [-2.0] + [1.0] * 15}, {}, ValueError, r"rope_config\['long_factor'\]\[0\].*> 0"),
    ({**LONG, "long_factor": [float("nan")] * 16}, {}, ValueError, r"rope_config\['long_factor'\]\[0\]"),
    ({**LONG, "long_factor": "1.0"}, {}, ValueError, r"rope_config\['long_factor'\] must be a list of 16"),
    ({**LLAMA3, "high_freq_factor": 1.0}, {}, ValueError, r"high_freq_factor.*> .*low_freq_factor"),
    ({**LLAMA3, "high_freq_factor": 0.5}, {}, ValueError, r"high_freq_factor.*> .*low_freq_factor"),
    ({**YARN, "beta_fast": 1.0, "beta_slow": 2.0}, {}, ValueError, r"beta_fast.*>= .*beta_slow"),
    ({**YARN, "beta_fast": None, "beta_slow": 33.0}, {}, ValueError, r"beta_fast.*>= .*beta_slow"),  # default 32
    ({"type": "linear", "rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}, {}, ValueError,
     r"type='linear' and rope_type='yarn'"),
    ({"rope_type": "default", "rope_theta": 1e4}, {"partial_rotary_factor": 0.5, "head_dim": 10}, ValueError,
     r"int\(10 \* 0\.5\) = 5 must be an even"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, {"head_dim": 10}, ValueError,
     r"int\(10 \* 0\.5\) = 5 must be an even"),
    ({"rope_type": "default", "rope_theta": 1e4}, {"partial_rotary_factor": 1.5}, ValueError,
     r"partial_rotary_factor must lie in \(0, 1\]"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 2.0}, {}, ValueError,
     r"partial_rotary_factor must lie in \(0, 1\]"),
    ({"rope_type": "default", "rope_theta": 0.5}, {}, ValueError, r"rope_config\['rope_theta'\] must be a finite number > 1, got 0.5"),
    ({**YARN, "truncate": "False"}, {}, ValueError, r"rope_config\['truncate'\] must be a bool"),
    ({**YARN, "original_max_position_embeddings": 2048.5}, {}, ValueError,
     r"rope_config\['original_max_position_embeddings'\] must be a positive int"),
    # a string (or None, or a list) in a number's place: named, with what it got and what is allowed
    # (once "'>' not supported" or "could not convert string to float" without the key)
    ({"rope_type": "default", "rope_theta": "1e4"}, {}, ValueError,
     r"rope_config\['rope_theta'\] must be a finite number > 1, got str '1e4'"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, {"partial_rotary_factor": "abc"},
     TypeError, r"partial_rotary_factor must be a finite number > 0, got str 'abc'"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": "abc"}, {"partial_rotary_factor": 0.5},
     ValueError, r"rope_config\['partial_rotary_factor'\] must be a finite number > 0, got str 'abc'"),
    ({**YARN, "beta_fast": "32"}, {}, ValueError, r"rope_config\['beta_fast'\] must be a finite number >= 0, got str '32'"),
    ({**YARN, "mscale": [1.0], "mscale_all_dim": 1.0}, {}, ValueError,
     r"rope_config\['mscale'\] must be a finite number >= 0, got list \[1.0\]"),
    ({**YARN, "attention_factor": "1"}, {}, ValueError, r"rope_config\['attention_factor'\] must be a finite number > 0, got str"),
    ({**LLAMA3, "low_freq_factor": "1"}, {}, ValueError, r"rope_config\['low_freq_factor'\] must be a finite number > 0, got str '1'"),
    ({**YARN, "original_max_position_embeddings": "4096"}, {}, ValueError,
     r"rope_config\['original_max_position_embeddings'\] must be a positive int, got '4096'"),
    ({"rope_type": ["yarn"], "rope_theta": 1e4}, {}, ValueError, r"rope_config\['rope_type'\] must be one of .*got \['yarn'\]"),
]


@pytest.mark.parametrize("cfg,kw,exc,match", BAD, ids=[f"{i}-{b[3][:30]}" for i, b in enumerate(BAD)])
def test_bad_configs_name_the_key(cfg, kw, exc, match):
    kw = dict(kw)
    head_dim = kw.pop("head_dim", 32)
    with pytest.raises(exc, match=match):
        compute_inv_freq(cfg, head_dim, **kw)


def test_legacy_rope_theta_and_the_base_helpers_take_one_base_rule():
    """rope_theta, in or beside a legacy dict, and the base of ntk_base, dynamic_ntk_base and
    yarn_correction_range follow the package's one rule for a base: a finite number > 1."""
    with pytest.raises(ValueError, match=r"rope_scaling\['rope_theta'\] must be a finite number > 1, got str 'abc'"):
        rope_parameters_from_legacy({"type": "linear", "factor": 2.0, "rope_theta": "abc"}, 1e4)
    with pytest.raises(TypeError, match=r"rope_theta must be a finite number > 1, got str '1e4'"):
        rope_parameters_from_legacy({"type": "linear", "factor": 2.0}, "1e4")
    with pytest.raises(ValueError, match=r"rope_theta must be a finite number > 1, got 1.0"):
        rope_parameters_from_legacy({"type": "linear", "factor": 2.0}, 1.0)
    assert rope_parameters_from_legacy({"type": "linear", "factor": 2.0, "rope_theta": 1e4}, 1e4)["rope_theta"] == 1e4
    for call in (lambda b: ntk_base(b, 2.0, 32), lambda b: dynamic_ntk_base(b, 2.0, 32, 100, 50),
                 lambda b: yarn_correction_range(32, 1, 32, b, 2048)):
        for bad in (1, 1.0, 0.5, float("nan")):
            with pytest.raises(ValueError, match=r"base must be a finite number > 1, got"):
                call(bad)
        with pytest.raises(TypeError, match=r"base must be a finite number > 1, got str"):
            call("1e4")
        call(1e4)


@pytest.mark.parametrize("cfg,key", [
    (LLAMA3, "low_freq_factor"), (LLAMA3, "high_freq_factor"), (LONG, "short_factor"), (LONG, "long_factor"),
])
def test_missing_required_keys_are_named(cfg, key):
    # (at commit d47d848 these raised KeyError from inside the method)
    with pytest.raises(ValueError, match=f"rope_type='{cfg['rope_type']}'.*{key}"):
        compute_inv_freq({k: v for k, v in cfg.items() if k != key}, 32)


@pytest.mark.parametrize("seq_len,exc,match", [
    (0, ValueError, r"seq_len must be >= 1, got 0"),
    (-5, ValueError, r"seq_len must be >= 1, got -5"),
    (4.0, TypeError, r"seq_len must be an int"),
    (True, TypeError, r"seq_len must be an int"),
    (torch.tensor([5]), ValueError, r"seq_len must be an int or a 0-d integer tensor.*shape \(1,\)"),
    (torch.tensor(5.0), ValueError, r"seq_len must be an int or a 0-d integer tensor.*float32"),
    (torch.tensor(0), ValueError, r"seq_len must be >= 1, got 0"),
])
def test_bad_seq_len(seq_len, exc, match):
    cfg = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(exc, match=match):
        compute_inv_freq(cfg, 32, max_position_embeddings=64, seq_len=seq_len)
    with pytest.raises(exc, match=match):  # every type checks it, not only the dynamic ones
        compute_inv_freq(CONFIGS["linear"], 32, seq_len=seq_len)


@pytest.mark.parametrize("cfg", [[("rope_type", "linear")], "linear", 4.0])
def test_rope_config_must_be_a_dict(cfg):
    with pytest.raises(TypeError, match="rope_config must be a dict"):
        compute_inv_freq(cfg, 32)
    with pytest.raises(TypeError, match="rope_config must be a dict"):
        RotaryEmbedding(32, rope_config=cfg)


@pytest.mark.parametrize("rope_type", ["ntk", "dynamic"])
def test_ntk_needs_at_least_two_pairs(rope_type):
    with pytest.raises(ValueError, match="rotary"):
        compute_inv_freq({"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}, 2, max_position_embeddings=16)


# ----------------------------------------------------------------------------- 4. RotaryEmbedding


def reference_tables(emb, inv_freq, attention):
    """compute_inv_freq + rope_cos_sin at the scheme's cache length (same length, same kernels)."""
    return rope_cos_sin(emb.cached_positions, inv_freq, attention_scaling=attention)


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_scheme_tables_are_compute_inv_freq_tables(rope_type):
    cfg = CONFIGS[rope_type]
    emb = RotaryEmbedding(32, rope_config=cfg, max_position_embeddings=M)
    inv_freq, attention = compute_inv_freq(cfg, 32, max_position_embeddings=M)
    assert torch.equal(emb.inv_freq, inv_freq) and emb.attention_scaling == attention
    pos = torch.tensor([0, 3, 17, 99])
    cos, sin = emb.cos_sin(pos)
    rc, rs = reference_tables(emb, inv_freq, attention)
    assert torch.equal(cos, rc[pos]) and torch.equal(sin, rs[pos])
    q, k = rand(2, 3, 4, 32, seed=1), rand(2, 1, 4, 32, seed=2)
    rq, rk = emb.rotate(q, k, pos, pos)
    assert torch.equal(rq, rope_rotate(q, rc, rs, positions=pos))
    assert torch.equal(rk, rope_rotate(k, rc, rs, positions=pos))
    if rope_type == "yarn":  # the attention factor is in the tables: cos^2 + sin^2 = a^2
        assert attention > 1
        # cos and sin to 1 ulp (2 U) times a (U): 3 U each, 6 U squared, two more roundings: 8 U
        torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, attention**2), rtol=8 * U, atol=0)


def test_scheme_with_partial_rotary_from_the_config():
    cfg = {**CONFIGS["yarn"], "partial_rotary_factor": 0.25}
    emb = RotaryEmbedding(64, rope_config=cfg)
    assert emb.rotary_dim == 16
    assert torch.equal(emb.inv_freq, compute_inv_freq(cfg, 64)[0])
    emb2 = RotaryEmbedding(64, rotary_dim=16, rope_config=CONFIGS["yarn"])
    assert torch.equal(emb2.inv_freq, emb.inv_freq)
    RotaryEmbedding(64, rotary_dim=16, rope_config=cfg)  # agreeing: fine


def _call(emb, n, seed=0, last_only=False, keys_only=False):
    """One rotate call whose largest position is n - 1: a prefill, one decoding step
    (last_only: the query at n - 1 alone) or a call whose keys reach further than its four
    queries (keys_only)."""
    if keys_only:
        q, k = rand(1, 2, 4, emb.head_dim, seed=seed), rand(1, 2, n, emb.head_dim, seed=seed + 1)
        return emb.rotate(q, k, torch.arange(4), torch.arange(n))
    if last_only:
        q, k = rand(1, 2, 1, emb.head_dim, seed=seed), rand(1, 2, n, emb.head_dim, seed=seed + 1)
        return emb.rotate(q, k, torch.tensor([n - 1]), torch.arange(n))
    q = rand(1, 2, n, emb.head_dim, seed=seed)
    return emb.rotate(q, q, torch.arange(n), torch.arange(n))


def test_dynamic_scheme_follows_the_length():
    cfg = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}
    m = 64
    emb = RotaryEmbedding(32, rope_config=cfg, max_position_embeddings=m)
    original = emb.inv_freq.clone()
    assert torch.equal(original, compute_inv_freq(cfg, 32, max_position_embeddings=m)[0])

    def at(n):
        return compute_inv_freq(cfg, 32, max_position_embeddings=m, seq_len=torch.tensor(n))[0]

    for n in (1, 17, m):  # never beyond M: nothing changes
        _call(emb, n)
        assert torch.equal(emb.inv_freq, original), n
    rq, _ = _call(emb, 150, seed=3)
    grown = at(150)
    assert not torch.equal(grown, original)
    assert torch.equal(emb.inv_freq, grown)
    c, s = reference_tables(emb, grown, 1.0)  # the output uses the grown frequencies
    q = rand(1, 2, 150, 32, seed=3)
    assert torch.equal(rq, rope_rotate(q, c, s))
    _call(emb, 100)  # M < 100 < 150: HuggingFace only grows
    assert torch.equal(emb.inv_freq, grown)
    _call(emb, 171, last_only=True)  # one decoding step at position 170 grows again
    assert torch.equal(emb.inv_freq, at(171))
    _call(emb, m)  # n = M is not below M: still the grown frequencies
    assert torch.equal(emb.inv_freq, at(171))
    _call(emb, m - 1)  # below M: back to the original, exactly
    assert torch.equal(emb.inv_freq, original)
    c, s = emb.cos_sin(m)
    rc, rs = reference_tables(emb, original, 1.0)
    assert torch.equal(c, rc[:m]) and torch.equal(s, rs[:m])
    _call(emb, 150)
    assert torch.equal(emb.inv_freq, grown)
    _call(emb, 190, keys_only=True)  # the keys' positions count too
    assert torch.equal(emb.inv_freq, at(190))


def test_longrope_scheme_switches_at_the_original_length():
    cfg = {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32,
           "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [3.0 + i for i in range(8)]}
    emb = RotaryEmbedding(16, rope_config=cfg)
    short, att = compute_inv_freq(cfg, 16, seq_len=32)
    long, att_long = compute_inv_freq(cfg, 16, seq_len=33)
    assert att == att_long > 1 and not torch.equal(short, long)
    assert torch.equal(emb.inv_freq, short) and emb.attention_scaling == att
    for n, want, last_only in ((32, short, False), (33, long, False), (32, short, False),
                               (33, long, True), (1, short, False), (500, long, True), (31, short, True),
                               (33, long, "keys"), (32, short, "keys")):
        _call(emb, n, last_only=last_only is True, keys_only=last_only == "keys")
        assert torch.equal(emb.inv_freq, want), n
        assert emb.attention_scaling == att, n
    # the last call (31 positions) left the short factors; cos_sin itself never switches
    c, s = emb.cos_sin(40)
    rc, rs = reference_tables(emb, short, att)
    assert torch.equal(c, rc[:40]) and torch.equal(s, rs[:40])


def test_mutating_the_config_changes_nothing_until_set_rope_config():
    cfg = {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32,
           "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    frozen = {**cfg, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    emb = RotaryEmbedding(16, rope_config=cfg)
    before = emb.cos_sin(10)
    cfg["long_factor"][0] = 50.0  # the long factors are computed lazily: a shared list would leak
    cfg["factor"] = 64.0
    returned = emb.rope_config
    assert returned == {**frozen, "rope_type": "longrope"}
    returned["long_factor"][1] = 70.0
    returned["short_factor"][1] = 70.0
    _call(emb, 40)
    assert torch.equal(emb.inv_freq, compute_inv_freq(frozen, 16, seq_len=40)[0])
    _call(emb, 10)
    after = emb.cos_sin(10)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert emb.rope_config == {**frozen, "rope_type": "longrope"}
    # dynamic: the factor is read again at growth time
    dyn = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    emb = RotaryEmbedding(16, rope_config=dyn, max_position_embeddings=16)
    dyn["factor"] = 8.0
    _call(emb, 40)
    want = compute_inv_freq({**dyn, "factor": 2.0}, 16, max_position_embeddings=16, seq_len=torch.tensor(40))[0]
    assert torch.equal(emb.inv_freq, want)
    # set_rope_config does change the tables
    emb.set_rope_config(CONFIGS["yarn"])
    inv_freq, attention = compute_inv_freq(CONFIGS["yarn"], 16)
    assert torch.equal(emb.inv_freq, inv_freq) and emb.attention_scaling == attention
    c, s = emb.cos_sin(10)
    rc, rs = reference_tables(emb, inv_freq, attention)
    assert torch.equal(c, rc[:10]) and torch.equal(s, rs[:10])
    emb.set_rope_config(None)  # back to plain RoPE with the config's base
    assert torch.equal(emb.inv_freq, compute_inv_freq({"rope_type": "default", "rope_theta": 5e5}, 16)[0])


def test_scheme_bad_combinations():
    inv_freq = compute_inv_freq(CONFIGS["linear"], 32)[0]
    with pytest.raises(ValueError, match="pass rope_config, or inv_freq and attention_scaling, not both"):
        RotaryEmbedding(32, rope_config=CONFIGS["linear"], inv_freq=inv_freq)
    with pytest.raises(ValueError, match="pass rope_config, or inv_freq and attention_scaling, not both"):
        RotaryEmbedding(32, rope_config=CONFIGS["linear"], attention_scaling=1.5)
    with pytest.raises(ValueError, match="max_position_embeddings is read only with a rope_config"):
        RotaryEmbedding(32, max_position_embeddings=4096)
    half = {**CONFIGS["linear"], "partial_rotary_factor": 0.5}
    # rotary_dim 16 = 0.5 * 32 argues with the dict's 0.25 ...
    with pytest.raises(ValueError, match="disagrees"):
        RotaryEmbedding(32, rotary_dim=16, rope_config={**half, "partial_rotary_factor": 0.25})
    # ... and rotary_dim = head_dim with the dict's 0.5
    with pytest.raises(ValueError, match=r"rotary_dim=32 disagrees with the config's rotary dimension 16"):
        RotaryEmbedding(32, rotary_dim=32, rope_config=half)
    with pytest.raises(ValueError, match="dynamic.*needs max_position_embeddings"):
        RotaryEmbedding(32, rope_config=CONFIGS["dynamic"])


# ----------------------------------------------------------------------------- 5. llama.cpp


def test_llama_cpp_args():
    lin = llama_cpp_rope_args(CONFIGS["linear"], 64)
    assert lin["--rope-scaling"] == "linear" and lin["--rope-freq-scale"] == 1 / 4.0
    assert lin["--rope-freq-base"] == 5e5
    for d, s in ((64, 4.0), (128, 3.0), (32, 10.0)):
        ntk = llama_cpp_rope_args({"rope_type": "ntk", "rope_theta": 5e5, "factor": s}, d)
        assert ntk["--rope-scaling"] == "none"
        # one float64 pow and a product: error about (ln s + 2) * 2**-53
        assert math.isclose(ntk["--rope-freq-base"], 5e5 * s ** (d / (d - 2)), rel_tol=8 * U64)
        # a default RoPE at that base is the ntk RoPE (HuggingFace's spelling of it)
        as_default = compute_inv_freq({"rope_type": "default", "rope_theta": ntk["--rope-freq-base"]}, d)
        assert same(as_default, compute_inv_freq({"rope_type": "ntk", "rope_theta": 5e5, "factor": s}, d))
    assert llama_cpp_rope_args(CONFIGS["dynamic"], 64, max_position_embeddings=M) is None
    assert llama_cpp_rope_args(CONFIGS["default"], 64) == {"--rope-scaling": "none", "--rope-freq-base": 5e5}


@pytest.mark.parametrize("extra", [{}, {"mscale": 0.707, "mscale_all_dim": 1.3}, {"attention_factor": 1.7}])
def test_llama_cpp_yarn_attention_factor(extra):
    cfg = {**CONFIGS["yarn"], **extra}
    args = llama_cpp_rope_args(cfg, 64)
    s = cfg["factor"]
    _, attention = compute_inv_freq(cfg, 64)
    # llama.cpp multiplies --yarn-attn-factor by its own 1 + 0.1 ln s
    assert math.isclose(args["--yarn-attn-factor"] * (1 + 0.1 * math.log(s)), attention, rel_tol=8 * U64)
    assert args["--rope-scaling"] == "yarn" and args["--rope-freq-scale"] == 1 / s
    assert args["--yarn-orig-ctx"] == 2048
    assert (args["--yarn-beta-fast"], args["--yarn-beta-slow"]) == (16.0, 2.0)


@pytest.mark.parametrize("d", [64, 128])
def test_llama_cpp_llama3_rope_freqs(d):
    cfg = CONFIGS["llama3"]
    args = llama_cpp_rope_args(cfg, d)
    divisors = np.array(args["rope_freqs"])
    assert divisors.shape == (d // 2,)
    got = compute_inv_freq(cfg, d)[0]
    theta = ref_theta(5e5, d)
    # d_i = fl(theta^_i / inv_i), theta^_i off by pow_bound: theta_i / d_i = inv_i within pow_bound + U
    assert_rel(got, theta / divisors, pow_bound(5e5) + U, "theta / rope_freqs")
    assert args["--rope-freq-base"] == 5e5 and args["--rope-scaling"] == "none"
    # the divisors are 1 for the kept pairs and s for the interpolated ones, a blend between
    w = 2 * math.pi / theta
    assert np.allclose(divisors[w < 2048 / 4], 1.0, rtol=4 * U, atol=0)
    assert np.allclose(divisors[w > 2048 / 1], 8.0, rtol=4 * U, atol=0)


def test_llama_cpp_longrope():
    args = llama_cpp_rope_args({**CONFIGS["longrope"], "factor": 16.0}, 32)
    assert args["rope_factors_short"] == CONFIGS["longrope"]["short_factor"]
    assert args["rope_factors_long"] == CONFIGS["longrope"]["long_factor"]
    assert math.isclose(args["rope.scaling.attn_factor"], math.sqrt(1 + math.log(16) / math.log(2048)),
                        rel_tol=8 * U64)


# ----------------------------------------------------------------------------- proportional (Gemma 4)


def hf_proportional(head_dim, base, partial_rotary_factor=1.0, factor=1.0):
    """transformers v5's _compute_proportional_rope_parameters, transcribed (float32, same ops)."""
    rope_angles = int(partial_rotary_factor * head_dim // 2)
    inv_freq_rotated = 1.0 / (base ** (torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).to(dtype=torch.float)
                                       / head_dim))
    nope_angles = head_dim // 2 - rope_angles
    if nope_angles > 0:
        inv_freq = torch.cat((inv_freq_rotated, torch.zeros(nope_angles, dtype=torch.float32)), dim=0)
    else:
        inv_freq = inv_freq_rotated
    inv_freq /= factor
    return inv_freq


@given(head_dim=st.sampled_from([2, 8, 10, 64, 100, 256, 512]), prf=st.floats(0.01, 1.0),
       base=st.sampled_from([1e4, 5e5, 1e6]), factor=st.floats(1.0, 16.0), in_dict=st.booleans())
def test_proportional_is_hf_bit_for_bit(head_dim, prf, base, factor, in_dict):
    cfg = {"rope_type": "proportional", "rope_theta": base, "factor": factor}
    if in_dict:
        got, att = compute_inv_freq({**cfg, "partial_rotary_factor": prf}, head_dim)
    else:
        got, att = compute_inv_freq(cfg, head_dim, partial_rotary_factor=prf)
    want = hf_proportional(head_dim, base, prf, factor)
    assert got.shape == (head_dim // 2,) and got.dtype == torch.float32 and att == 1.0
    assert torch.equal(got, want)
    # against the float64 formula: theta_i / s for the first int(prf * d // 2) pairs, then zeros.
    # Errors: the exponent 2i/d (U) amplified by e ln b <= ln b, the pow (2 U), 1/x (U), / s (U)
    k = int(prf * head_dim // 2)
    ref = np.concatenate((ref_theta(base, head_dim)[:k] / factor, np.zeros(head_dim // 2 - k)))
    np.testing.assert_allclose(got.double().numpy(), ref, rtol=(4 + math.log(base)) * U, atol=0)
    assert int((got > 0).sum()) == k


def test_proportional_defaults_and_a_known_config():
    # Gemma 4's global layers: head_dim 512, rope_theta 1e6, partial_rotary_factor 0.25
    cfg = {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
    inv, att = compute_inv_freq(cfg, 512)
    assert inv.shape == (256,) and int((inv > 0).sum()) == 64 and att == 1.0
    assert torch.equal(inv, hf_proportional(512, 1e6, 0.25))
    # no partial_rotary_factor: 1.0, every pair rotates (plain RoPE, bit for bit); factor: linear
    plain = {"rope_type": "proportional", "rope_theta": 1e6}
    assert same(compute_inv_freq(plain, 64), compute_inv_freq({"rope_type": "default", "rope_theta": 1e6}, 64))
    assert same(compute_inv_freq({**plain, "factor": 4.0}, 64),
                compute_inv_freq({"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}, 64))
    # int(prf * d // 2) need not be even: 64 * 0.3 = 19.2 rotated "dims" is fine here (9 pairs),
    # while the default type rejects an odd rotary dimension
    assert int((compute_inv_freq({**plain, "partial_rotary_factor": 0.3}, 64)[0] > 0).sum()) == 9
    with pytest.raises(ValueError, match="must be an even int"):
        compute_inv_freq({"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.3}, 64)
    assert llama_cpp_rope_args(cfg, 512) is None


def test_proportional_scheme_rotates_the_whole_head():
    d = 32
    cfg = {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "factor": 2.0}
    emb = RotaryEmbedding(d, rope_config=cfg)
    assert emb.rotary_dim == d and emb.rope_config["partial_rotary_factor"] == 0.5
    assert torch.equal(emb.inv_freq, hf_proportional(d, 1e4, 0.5, 2.0))
    q = rand(1, 2, 5, d, seed=3)
    pos = torch.arange(10, 15)
    rq, _ = emb.rotate(q, q, pos, pos)
    h, k = d // 2, 8
    # half layout: pairs (i, i + 16); pairs 8..15 have frequency 0 and stay exactly as they were
    assert torch.equal(rq[..., k:h], q[..., k:h]) and torch.equal(rq[..., h + k:], q[..., h + k:])
    assert not torch.equal(rq[..., :k], q[..., :k])
    # the same as p-RoPE with p = partial_rotary_factor, frequencies divided by the factor
    from companion.rope_variants import PRoPE

    pr = PRoPE(d, 0.5)
    assert pr.rotating_pairs == k and torch.equal(emb.inv_freq, pr.inv_freq / 2.0)
    emb1 = RotaryEmbedding(d, rope_config={**cfg, "factor": 1.0})
    assert torch.equal(emb1.rotate(q, q, pos, pos)[0], pr.rotate(q, q, pos, pos)[0])


def test_proportional_differs_from_gpt_neox_partial_rotary():
    d, prf, base = 64, 0.5, 1e4
    prop, _ = compute_inv_freq({"rope_type": "proportional", "rope_theta": base, "partial_rotary_factor": prf}, d)
    neox, _ = compute_inv_freq({"rope_type": "default", "rope_theta": base, "partial_rotary_factor": prf}, d)
    # the same number of rotating pairs ...
    assert int((prop > 0).sum()) == neox.numel() == 16
    # ... with different frequencies: base ** (-2i / 64) against base ** (-2i / 32), so the
    # lowest kept frequency is base ** (-30 / 64) = 0.0133 for proportional, base ** (-30 / 32) =
    # 1.78e-4 for GPT-NeoX (which keeps the whole range of RoPE's frequencies in fewer pairs)
    np.testing.assert_allclose(prop[15].item(), base ** (-30 / 64), rtol=(4 + math.log(base)) * U)
    np.testing.assert_allclose(neox[15].item(), base ** (-30 / 32), rtol=(4 + math.log(base)) * U)
    assert bool((prop[1:16] > neox[1:] * 1.1).all())  # every kept pair but the first turns faster
    assert prop[0] == neox[0] == 1.0
    # and different dims: NeoX rotates dims 0..31 (pairs (i, i + 16)), proportional pairs (i, i + 32)
    q = rand(1, 1, 3, d, seed=4)
    pos = torch.tensor([5, 6, 7])
    rn, _ = RotaryEmbedding(d, rotary_dim=32, base=base).rotate(q, q, pos, pos)
    rp, _ = RotaryEmbedding(d, rope_config={"rope_type": "proportional", "rope_theta": base,
                                            "partial_rotary_factor": prf}).rotate(q, q, pos, pos)
    assert torch.equal(rn[..., 32:], q[..., 32:]) and not torch.equal(rp[..., 32:48], q[..., 32:48])
    assert torch.equal(rp[..., 16:32], q[..., 16:32]) and not torch.equal(rn[..., 16:32], q[..., 16:32])


@pytest.mark.parametrize("cfg, kw, exc, match", [
    ({"partial_rotary_factor": -0.25}, {}, ValueError, r"rope_config\['partial_rotary_factor'\] must be a finite number >= 0"),
    ({}, {"partial_rotary_factor": -0.25}, ValueError, r"partial_rotary_factor must be a finite number >= 0, got -0.25"),
    ({"partial_rotary_factor": 1.5}, {}, ValueError, r"partial_rotary_factor must lie in \[0, 1\] for rope_type='proportional'"),
    ({"partial_rotary_factor": "0.5"}, {}, ValueError, r"rope_config\['partial_rotary_factor'\] must be a finite number >= 0, got str '0.5'"),
    ({}, {"partial_rotary_factor": "0.5"}, TypeError, r"partial_rotary_factor must be a finite number >= 0, got str '0.5'"),
    ({}, {"partial_rotary_factor": 2.0}, ValueError, r"partial_rotary_factor must lie in \[0, 1\]"),
    ({"factor": 0.5}, {}, ValueError, r"rope_config\['factor'\].*>= 1"),
    ({"factor": float("nan")}, {}, ValueError, r"rope_config\['factor'\]"),
    ({}, {"head_dim": 33}, ValueError, r"head_dim must be even for rope_type='proportional'"),
    ({"rope_theta": 1.0}, {}, ValueError, r"rope_config\['rope_theta'\] must be a finite number > 1, got 1.0"),
])
def test_proportional_bad_configs_name_the_key(cfg, kw, exc, match):
    kw = {"head_dim": 64, **kw}
    with pytest.raises(exc, match=match):
        compute_inv_freq({"rope_type": "proportional", "rope_theta": 1e4, **cfg}, kw.pop("head_dim"), **kw)


def test_proportional_accepts_a_zero_factor_as_p_rope_with_p_zero():
    """partial_rotary_factor = 0 is valid for proportional (HuggingFace computes it: no pair
    rotates), and equals PRoPE(p=0): every frequency 0, so the rotation is the identity."""
    from companion.rope_variants import PRoPE

    for d in (8, 64):
        want = PRoPE(d, 0.0).inv_freq
        assert torch.equal(want, torch.zeros(d // 2))
        in_dict, att = compute_inv_freq({"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.0}, d)
        as_kw, _ = compute_inv_freq({"rope_type": "proportional", "rope_theta": 1e4}, d, partial_rotary_factor=0.0)
        assert att == 1.0 and torch.equal(in_dict, want) and torch.equal(as_kw, want)
        assert torch.equal(in_dict, hf_proportional(d, 1e4, 0.0))
    emb = RotaryEmbedding(8, rope_config={"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.0})
    q = rand(1, 2, 5, 8, seed=5)
    pos = torch.arange(3, 8)
    assert torch.equal(emb.rotate(q, q, pos, pos)[0], q)
    assert torch.equal(emb.rotate(q, q, pos, pos)[0], PRoPE(8, 0.0).rotate(q, q, pos, pos)[0])
    # the other types still need a rotary dimension of at least 2
    with pytest.raises(ValueError, match=r"rope_config\['partial_rotary_factor'\] must be a finite number > 0, got 0.0"):
        compute_inv_freq({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0}, 8)
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be a finite number > 0, got 0.0"):
        compute_inv_freq({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, 8, partial_rotary_factor=0.0)


def test_proportional_scheme_needs_the_whole_head():
    cfg = {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    RotaryEmbedding(32, rotary_dim=32, rope_config=cfg)  # the whole head: fine
    with pytest.raises(ValueError, match="rotary_dim=16 disagrees"):
        RotaryEmbedding(32, rotary_dim=16, rope_config=cfg)


# ----------------------------------------------------------------------------- the helpers' own arguments
#
# The helpers below compute_inv_freq check their arguments themselves (TypeError for a wrong
# type, ValueError for a bad value, the message naming the argument); a config dict's bad key
# is still a ValueError naming the key (test_bad_configs_name_the_key).

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("call, exc, match", [
    # ntk_base(base, factor, dim): factor >= 1, dim an even int >= 4 (the exponent is d / (d - 2))
    (lambda: ntk_base(1e4, 0.5, 8), ValueError, r"factor must be a finite number >= 1, got 0.5"),
    (lambda: ntk_base(1e4, NAN, 8), ValueError, r"factor must be a finite number >= 1, got nan"),
    (lambda: ntk_base(1e4, INF, 8), ValueError, r"factor must be a finite number >= 1, got inf"),
    (lambda: ntk_base(1e4, "4", 8), TypeError, r"factor must be a finite number >= 1, got str '4'"),
    (lambda: ntk_base(1e4, True, 8), TypeError, r"factor must be a finite number >= 1, got bool"),
    (lambda: ntk_base(1e4, 4.0, 2), ValueError, r"dim must be >= 4, got 2"),
    (lambda: ntk_base(1e4, 4.0, 0), ValueError, r"dim must be >= 4, got 0"),
    (lambda: ntk_base(1e4, 4.0, 7), ValueError, r"dim must be an even int >= 4.*got 7"),
    (lambda: ntk_base(1e4, 4.0, 8.0), TypeError, r"dim must be an int, got float"),
    (lambda: ntk_base(1e4, 4.0, True), TypeError, r"dim must be an int, got bool"),
    # dynamic_ntk_base(base, factor, dim, seq_len, max_position_embeddings)
    (lambda: dynamic_ntk_base(1e4, 2.0, 8, 32, 0), ValueError, r"max_position_embeddings must be >= 1, got 0"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 8, 32, 16.0), TypeError, r"max_position_embeddings must be an int"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 8, 1.5, 16), TypeError, r"seq_len must be an int, got float"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 8, "32", 16), TypeError, r"seq_len must be an int, got str"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 8, True, 16), TypeError, r"seq_len must be an int, got bool"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 8, None, 16), TypeError, r"seq_len must be an int, got NoneType"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 8, -1, 16), ValueError, r"seq_len must be >= 0, got -1"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 8, torch.tensor(32.0), 16), TypeError,
     r"seq_len must be an int or a 0-d integer tensor .*got a torch.float32 tensor"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 8, torch.tensor(True), 16), TypeError, r"seq_len .*torch.bool"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 8, torch.tensor([32]), 16), ValueError, r"seq_len .*0-d.*shape \(1,\)"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 8, torch.tensor(-1), 16), ValueError, r"seq_len must be >= 0, got -1"),
    (lambda: dynamic_ntk_base(1e4, 0.5, 8, 32, 16), ValueError, r"factor must be a finite number >= 1"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 2, 32, 16), ValueError, r"dim must be >= 4, got 2"),
    (lambda: dynamic_ntk_base(1e4, 2.0, 9, 32, 16), ValueError, r"dim must be an even int >= 4.*got 9"),
    # yarn_get_mscale(scale, mscale): scale finite > 0 (<= 1 gives 1), mscale finite >= 0
    (lambda: yarn_get_mscale(NAN), ValueError, r"scale must be a finite number > 0, got nan"),
    (lambda: yarn_get_mscale(INF), ValueError, r"scale must be a finite number > 0, got inf"),
    (lambda: yarn_get_mscale(0.0), ValueError, r"scale must be a finite number > 0, got 0.0"),
    (lambda: yarn_get_mscale("4"), TypeError, r"scale must be a finite number > 0, got str '4'"),
    (lambda: yarn_get_mscale(None), TypeError, r"scale must be a finite number > 0, got NoneType"),
    (lambda: yarn_get_mscale(4.0, NAN), ValueError, r"mscale must be a finite number >= 0, got nan"),
    (lambda: yarn_get_mscale(4.0, -1.0), ValueError, r"mscale must be a finite number >= 0, got -1.0"),
    (lambda: yarn_get_mscale(4.0, "1"), TypeError, r"mscale must be a finite number >= 0, got str '1'"),
    # yarn_correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings, truncate)
    (lambda: yarn_correction_range(32, 1, 64, 1e4, 0), ValueError, r"original_max_position_embeddings must be >= 1, got 0"),
    (lambda: yarn_correction_range(32, 1, 64, 1e4, 4096.0), TypeError, r"original_max_position_embeddings must be an int"),
    (lambda: yarn_correction_range(0, 1, 64, 1e4, 4096), ValueError, r"beta_fast must be a finite number > 0, got 0"),
    (lambda: yarn_correction_range(32, -1, 64, 1e4, 4096), ValueError, r"beta_slow must be a finite number > 0, got -1"),
    (lambda: yarn_correction_range(32, NAN, 64, 1e4, 4096), ValueError, r"beta_slow must be a finite number > 0, got nan"),
    (lambda: yarn_correction_range("32", 1, 64, 1e4, 4096), TypeError, r"beta_fast must be a finite number > 0, got str"),
    (lambda: yarn_correction_range(1, 32, 64, 1e4, 4096), ValueError, r"beta_fast must be >= beta_slow.*beta_fast=1 and beta_slow=32"),
    (lambda: yarn_correction_range(32, 1, 0, 1e4, 4096), ValueError, r"dim must be >= 2, got 0"),
    (lambda: yarn_correction_range(32, 1, 63, 1e4, 4096), ValueError, r"dim must be an even int >= 2.*got 63"),
    (lambda: yarn_correction_range(32, 1, 64.0, 1e4, 4096), TypeError, r"dim must be an int, got float"),
    (lambda: yarn_correction_range(32, 1, 64, 1e4, 4096, "no"), TypeError, r"truncate must be a bool .*got str 'no'"),
    (lambda: yarn_correction_range(32, 1, 64, 1e4, 4096, 1), TypeError, r"truncate must be a bool .*got int 1"),
    # proportional_rope_angles(head_dim, partial_rotary_factor): an even head_dim >= 2, a factor in [0, 1]
    (lambda: proportional_rope_angles(8, -0.5), ValueError, r"partial_rotary_factor must be a finite number >= 0, got -0.5"),
    (lambda: proportional_rope_angles(8, 1.5), ValueError, r"partial_rotary_factor must lie in \[0, 1\], got 1.5"),
    (lambda: proportional_rope_angles(8, NAN), ValueError, r"partial_rotary_factor must be a finite number >= 0, got nan"),
    (lambda: proportional_rope_angles(8, "0.5"), TypeError, r"partial_rotary_factor must be a finite number"),
    (lambda: proportional_rope_angles("8", 0.5), TypeError, r"head_dim must be an int, got str"),
    (lambda: proportional_rope_angles(0, 0.5), ValueError, r"head_dim must be >= 2, got 0"),
    (lambda: proportional_rope_angles(7, 0.5), ValueError, r"head_dim must be an even int >= 2.*got 7"),
    (lambda: proportional_rope_angles(8.0, 0.5), TypeError, r"head_dim must be an int, got float"),
])
def test_scaling_helpers_check_their_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_scaling_helpers_valid_edges_are_unchanged():
    """The checks refuse nothing the formulas define: factor 1, the smallest dims, seq_len 0,
    equal betas, a 0-d integer tensor seq_len of any integer dtype; and the values are the
    formulas' (written out here in Python floats, the same operations)."""
    assert ntk_base(1e4, 1.0, 8) == 1e4
    assert ntk_base(1e4, 4.0, 4) == 1e4 * 4.0 ** (4 / 2)
    assert ntk_base(1e4, 4, 8) == 1e4 * 4 ** (8 / 6)  # an int factor, as a config may hold it
    assert dynamic_ntk_base(1e4, 2.0, 8, 0, 16) == 1e4  # n = max(0, M) = M: plain RoPE
    assert dynamic_ntk_base(1e4, 2.0, 8, 16, 16) == 1e4
    assert dynamic_ntk_base(1e4, 2.0, 8, 32, 16) == 1e4 * ((2.0 * 32 / 16) - (2.0 - 1)) ** (8 / 6)
    assert dynamic_ntk_base(1e4, 2.0, 8, np.int64(32), 16) == dynamic_ntk_base(1e4, 2.0, 8, 32, 16)
    for dtype in (torch.int64, torch.int32):
        n = torch.tensor(32, dtype=dtype)
        want = 1e4 * ((2.0 * torch.maximum(n, torch.tensor(16, dtype=dtype)) / 16) - 1.0) ** (8 / 6)
        got = dynamic_ntk_base(1e4, 2.0, 8, n, 16)
        assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    assert float(dynamic_ntk_base(1e4, 2.0, 8, torch.tensor(0), 16)) == 1e4
    assert yarn_get_mscale(1.0) == 1.0 and yarn_get_mscale(0.5) == 1.0
    assert yarn_get_mscale(4.0, 0.0) == 1.0  # mscale 0: 0.1 * 0 * ln 4 + 1
    assert yarn_get_mscale(4, 1) == 0.1 * 1 * math.log(4) + 1.0
    # equal betas are allowed (the ramp gets width 0.001 in the method): low = floor, high = ceil
    idx = 64 * math.log(4096 / (4 * 2 * math.pi)) / (2 * math.log(1e4))
    assert yarn_correction_range(4.0, 4.0, 64, 1e4, 4096) == (math.floor(idx), math.ceil(idx))
    assert yarn_correction_range(4.0, 4.0, 64, 1e4, 4096, False) == (idx, idx)
    assert yarn_correction_range(32, 1, 2, 1e4, 1) == (0, 0)  # the smallest dim and length: clamped
    assert proportional_rope_angles(2, 1.0) == 1 and proportional_rope_angles(2, 0.0) == 0
    assert proportional_rope_angles(100, 0.58) == 28 and proportional_rope_angles(8, 1) == 4


def test_a_config_still_reports_its_bad_key_not_the_helper_argument():
    """The config path validates first and names the dict's key (a ValueError), before any helper
    sees the value."""
    with pytest.raises(ValueError, match=r"rope_config\['factor'\] must be a finite number >= 1"):
        compute_inv_freq({"rope_type": "ntk", "rope_theta": 1e4, "factor": 0.5}, 8)
    with pytest.raises(ValueError, match=r"rope_config\['truncate'\] must be a bool"):
        compute_inv_freq({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 16,
                          "truncate": "no"}, 8)
    with pytest.raises(ValueError, match=r"rope_config\['beta_fast'\] must be >= rope_config\['beta_slow'\]"):
        compute_inv_freq({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 16,
                          "beta_fast": 1.0, "beta_slow": 2.0}, 8)
