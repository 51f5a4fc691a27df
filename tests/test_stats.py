"""Tests for companion.lab.stats: bootstrap intervals checked against exact resampling
distributions and the normal approximation, the 2-D (rows, units) form, paired differences,
seeding, the Wilson interval against an independent high-precision evaluation, per-seed checks,
the Interval helpers, block means and bad arguments.

Every tolerance below is derived in a comment (floating-point rounding bounds, or the Monte
Carlo error of an empirical quantile from B resamples); none was tuned to make a test pass.
"""

from __future__ import annotations

import decimal
import itertools
import math
from dataclasses import FrozenInstanceError
from fractions import Fraction

import numpy as np
import pytest

from companion.lab.stats import (
    Interval,
    SeedCheck,
    block_means,
    bootstrap_ci,
    check_seeds,
    failing_seeds,
    paired_bootstrap_ci,
    proportion_ci,
)

EPS = np.finfo(np.float64).eps  # 2.22e-16, the spacing of doubles at 1

# Two-sided normal quantiles z_{1-a/2}, written out (standard tables) rather than taken from the
# same stdlib call the module uses. The module's NormalDist values differ from these by at most
# a few ulps (~5e-16), far inside every tolerance that uses them.
Z90 = 1.6448536269514722
Z95 = 1.959963984540054
Z99 = 2.5758293035489004

B = 4000  # the default number of resamples


# --------------------------------------------------------------------------------------------
# helpers


def exact_resampled_mean_distribution(values) -> dict[Fraction, Fraction]:
    """The exact distribution of the mean of a bootstrap resample of ``values``, by enumerating
    all n**n equally likely index tuples (only for tiny n)."""
    vals = [Fraction(v) for v in values]
    n = len(vals)
    dist: dict[Fraction, Fraction] = {}
    for idx in itertools.product(range(n), repeat=n):
        m = sum((vals[i] for i in idx), Fraction(0)) / n
        dist[m] = dist.get(m, Fraction(0)) + Fraction(1, n**n)
    return dist


def bootstrap_quantile(dist: dict[Fraction, Fraction], q: float, resamples: int, min_sd: float = 5.0) -> float:
    """The value np.quantile(means, q) must return when ``means`` are ``resamples`` draws from the
    discrete distribution ``dist``, provided q is not near a jump of its CDF.

    np.quantile (linear) interpolates sorted[floor(h)] and sorted[ceil(h)], h = (resamples-1) q.
    Both equal the atom v_j when count(means <= v_{j-1}) <= floor(h) and count(means <= v_j)
    >= ceil(h) + 1. Each count is Binomial(resamples, F), F the exact CDF at that atom, with
    standard deviation sqrt(resamples F (1-F)). We require both conditions to hold with a margin
    of ``min_sd`` such standard deviations (a chance below 3e-7 per side for 5 sd that any seed
    breaks them), and fail loudly if the chosen level is too close to a jump: then the
    comparison would not be a fair test of the bootstrap."""
    atoms = sorted(dist)
    h = (resamples - 1) * q
    lo_pos, hi_pos = math.floor(h), math.ceil(h) + 1
    cdf = 0.0
    prev_cdf = 0.0
    for v in atoms:
        cdf = prev_cdf + float(dist[v])
        if cdf * resamples > h:
            break
        prev_cdf = cdf
    if prev_cdf > 0:
        sd = math.sqrt(resamples * prev_cdf * (1 - prev_cdf))
        assert (lo_pos - resamples * prev_cdf) / sd >= min_sd, "level too close to a jump below"
    if cdf < 1 - 1e-12:
        sd = math.sqrt(resamples * cdf * (1 - cdf))
        assert (resamples * cdf - hi_pos) / sd >= min_sd, "level too close to a jump above"
    return float(v)


def mean_rounding_bound(x) -> float:
    """A (generous) bound on the rounding error of a float64 mean of ``x``: recursive summation
    of n terms errs by at most about n * eps * sum|x|/n = n * eps * mean|x| (numpy's pairwise
    summation is better still), plus one rounding for the division."""
    x = np.asarray(x, dtype=np.float64).ravel()
    return (x.size + 1) * EPS * float(np.abs(x).max())


def wilson_reference(k: int, n: int, z: float) -> tuple[float, float]:
    """Wilson's interval evaluated independently of the module's closed form: the set of p with
    |k/n - p| <= z sqrt(p (1-p) / n). Squaring gives the quadratic
    (1 + z^2/n) p^2 - (2 k/n + z^2/n) p + (k/n)^2 <= 0, whose two roots are the bounds. The
    roots are computed in 50-digit decimal arithmetic, so the discriminant's cancellation (near
    k = 0 or k = n) costs nothing, and the result is exact to double precision."""
    with decimal.localcontext() as ctx:
        ctx.prec = 50
        D = decimal.Decimal
        zd = D(z)  # exact conversion of the float
        p = D(k) / D(n)
        z2n = zd * zd / D(n)
        a = 1 + z2n
        b = 2 * p + z2n
        c = p * p
        root = (b * b - 4 * a * c).sqrt()
        return float((b - root) / (2 * a)), float((b + root) / (2 * a))


# Absolute tolerance for the module's float evaluation of Wilson's formula against the exact
# roots: its ~20 operations each round with relative error <= eps/2 on operands of magnitude
# <= 1 + z^2/n <= 1 + 2.58^2 < 8 (n >= 1, confidence <= 99%), so the absolute error is below
# 20 * 8 * eps/2 = 80 eps; a z that differs from ours by a few ulps moves a bound by a few eps
# more (d bound / d z <= 1). 128 eps = 2.8e-14 covers both.
WILSON_TOL = 128 * EPS


# --------------------------------------------------------------------------------------------
# 1. hand-computed bootstrap cases


@pytest.mark.parametrize("seed", range(5))
def test_two_values_exact_intervals(seed):
    # values [0, 1]: a resample picks index 0 or 1 twice, so its mean is 0, 0.5 or 1 with
    # probabilities 1/4, 1/2, 1/4 (CDF jumps at 0.25 and 0.75).
    # 90%: quantiles 0.05 and 0.95 sit inside the atoms at 0 and 1 -> exactly [0, 1].
    # 40%: quantiles 0.3 and 0.7 sit inside the atom at 0.5 -> exactly [0.5, 0.5].
    # With B = 4000 the number of resampled means equal to 0 is Binomial(4000, 1/4): mean 1000,
    # sd sqrt(4000 * 1/4 * 3/4) = 27.4. The 30% quantile's position is 0.3 * 3999 = 1199.7, i.e.
    # 7.3 sd above 1000, so no seed realistically moves a jump onto it (same for 70% by
    # symmetry, and the 5%/95% positions are ~29 sd inside the end atoms).
    wide = bootstrap_ci([0.0, 1.0], confidence=0.9, seed=seed)
    assert (wide.low, wide.high) == (0.0, 1.0)
    narrow = bootstrap_ci([0.0, 1.0], confidence=0.4, seed=seed)
    assert (narrow.low, narrow.high) == (0.5, 0.5)
    assert wide.estimate == narrow.estimate == 0.5
    assert wide.units == narrow.units == 2
    assert wide.confidence == 0.9 and narrow.confidence == 0.4


def test_two_values_quantiles_match_exact_distribution():
    # the helper reproduces the hand computation above from the enumerated distribution
    dist = exact_resampled_mean_distribution([0, 1])
    assert dist == {Fraction(0): Fraction(1, 4), Fraction(1, 2): Fraction(1, 2), Fraction(1): Fraction(1, 4)}
    assert [bootstrap_quantile(dist, q, B) for q in (0.05, 0.95, 0.3, 0.7)] == [0.0, 1.0, 0.5, 0.5]


@pytest.mark.parametrize("confidence", [0.6, 0.98])
def test_three_values_match_enumerated_distribution(confidence):
    # values [0, 0, 3]: the resampled mean is K, the number of times index 2 is drawn, so
    # K ~ Binomial(3, 1/3): P = 8/27, 12/27, 6/27, 1/27 at 0, 1, 2, 3, CDF 0.296, 0.741, 0.963, 1.
    # Enumerating all 27 index triples gives the same (checked below). Levels chosen away from the
    # jumps (checked to >= 5 binomial sd by bootstrap_quantile):
    #   60%: quantiles 0.2 -> 0 and 0.8 -> 2, so [0, 2];
    #   98%: quantiles 0.01 -> 0 and 0.99 -> 3, so [0, 3].
    dist = exact_resampled_mean_distribution([0, 0, 3])
    assert dist == {Fraction(0): Fraction(8, 27), Fraction(1): Fraction(12, 27),
                    Fraction(2): Fraction(6, 27), Fraction(3): Fraction(1, 27)}
    a = 1 - confidence
    expected = (bootstrap_quantile(dist, a / 2, B), bootstrap_quantile(dist, 1 - a / 2, B))
    assert expected == {0.6: (0.0, 2.0), 0.98: (0.0, 3.0)}[confidence]  # the hand values above
    for seed in range(3):
        ci = bootstrap_ci([0.0, 0.0, 3.0], confidence=confidence, seed=seed)
        assert (ci.low, ci.high) == expected
        assert ci.estimate == 1.0


@pytest.mark.parametrize("confidence", [0.5, 0.8])
def test_thirty_values_match_binomial_distribution(confidence):
    # 27 zeros and 3 tens: the resampled mean is 10 K / 30 with K ~ Binomial(30, 1/10) (K counts
    # the draws that hit a ten). Too many resamples to enumerate, but the distribution is exact.
    # Each resampled mean is an integer sum divided by 30, correctly rounded, which is exactly
    # float(Fraction(10 K, 30)), so the comparison is exact.
    values = [0.0] * 27 + [10.0] * 3
    p = Fraction(1, 10)
    dist = {Fraction(10 * k, 30): math.comb(30, k) * p**k * (1 - p) ** (30 - k) for k in range(31)}
    assert sum(dist.values()) == 1
    a = 1 - confidence
    expected = (bootstrap_quantile(dist, a / 2, B), bootstrap_quantile(dist, 1 - a / 2, B))
    ci = bootstrap_ci(values, confidence=confidence, seed=3)
    assert (ci.low, ci.high) == expected
    assert ci.estimate == 1.0 and ci.units == 30


@pytest.mark.parametrize("values, constant", [
    ([0.75] * 8, 0.75),              # dyadic: every sum and mean is exact
    ([-3.5], -3.5),                  # a single unit
    ([[2.25] * 5, [2.25] * 5], 2.25),  # 2-D
])
def test_constant_values_give_a_degenerate_interval(values, constant):
    for resample_rows in (False, True):
        ci = bootstrap_ci(values, resample_rows=resample_rows)
        assert (ci.estimate, ci.low, ci.high) == (constant, constant, constant)


def test_constant_non_dyadic_value_degenerate_up_to_rounding():
    # every resample of ten 0.1s is the same array, summed the same way, so all resampled
    # means are bit-identical and the interval is a point; its value is 0.1 up to the rounding
    # of a 10-term mean.
    ci = bootstrap_ci([0.1] * 10)
    assert ci.low == ci.high
    tol = mean_rounding_bound([0.1] * 10)
    assert ci.low == pytest.approx(0.1, abs=tol)
    assert ci.estimate == pytest.approx(0.1, abs=tol)


# --------------------------------------------------------------------------------------------
# 2. large-sample normal approximation


def test_large_sample_matches_normal_approximation():
    n = 4000
    x = np.random.default_rng(20240611).normal(loc=3.0, scale=2.0, size=n)
    ci = bootstrap_ci(x)  # 95%, B = 4000
    assert ci.estimate == pytest.approx(math.fsum(x) / n, abs=mean_rounding_bound(x))
    assert ci.units == n
    # The bootstrap distribution of the mean has variance s0^2 / n exactly (s0: the sample's
    # standard deviation with ddof=0) and, for n = 4000 normal draws, is normal to within a
    # skewness of ~skew(x)/sqrt(n) ~ 1e-3 (Cornish-Fisher shift ~3e-4 sigma, negligible).
    sigma = x.std() / math.sqrt(n)
    # Monte Carlo error of the empirical q-quantile from B draws: sqrt(q(1-q)/B) / f(x_q), with
    # f the N(0, sigma^2) density at the quantile, phi(1.96)/sigma = 0.0584/sigma. For
    # q = 0.025, B = 4000: sqrt(0.025*0.975/4000)/0.0584 = 0.042 sigma per endpoint. Centre and
    # half-width are (high +- low)/2 of two almost independent endpoints (correlation
    # q/(1-q) = 0.026), so each has sd ~ 0.042/sqrt(2) = 0.030 sigma. We allow 4 sd = 0.12 sigma.
    # (Using the 90% quantiles by mistake would give 1.645 sigma, 0.31 sigma off: caught.)
    q = 0.025
    phi = math.exp(-Z95**2 / 2) / math.sqrt(2 * math.pi)
    endpoint_sd = math.sqrt(q * (1 - q) / B) / phi * sigma
    tol = 4 * endpoint_sd / math.sqrt(2)
    assert tol < 0.13 * sigma  # the derivation above, as numbers
    centre, half = (ci.low + ci.high) / 2, (ci.high - ci.low) / 2
    assert centre == pytest.approx(x.mean(), abs=tol)
    assert half == pytest.approx(Z95 * sigma, abs=tol)


def test_affine_equivariance_same_seed():
    # The percentile bootstrap draws indices independently of the values, so with the same seed
    # the resampled means of y = c*x + d are c*(those of x) + d, and linear interpolation of
    # quantiles commutes with an affine map; for c < 0 the ends swap. Differences are rounding
    # only: each resampled mean errs by <= mean_rounding_bound, on both sides.
    x = np.random.default_rng(5).exponential(size=60)
    c, d = -2.5, 7.0
    y = c * x + d
    cx, cy = bootstrap_ci(x, seed=9), bootstrap_ci(y, seed=9)
    tol = 4 * (mean_rounding_bound(y) + abs(c) * mean_rounding_bound(x))
    assert cy.low == pytest.approx(c * cx.high + d, abs=tol)
    assert cy.high == pytest.approx(c * cx.low + d, abs=tol)
    assert cy.estimate == pytest.approx(c * cx.estimate + d, abs=tol)


def test_intervals_nest_across_confidence_and_stay_in_data_range():
    # The resampled means do not depend on the confidence (same seed), and quantiles are
    # monotone in the level, so a higher confidence gives a superset; every resampled mean lies
    # in [min x, max x] (up to a mean's rounding).
    x = np.random.default_rng(8).lognormal(size=40)
    cis = [bootstrap_ci(x, confidence=c, seed=1) for c in (0.5, 0.8, 0.95, 0.99)]
    for inner, outer in zip(cis, cis[1:]):
        assert outer.low <= inner.low <= inner.high <= outer.high
    assert cis[-1].low < cis[0].low and cis[0].high < cis[-1].high  # strictly wider, continuous data
    tol = mean_rounding_bound(x)
    assert x.min() - tol <= cis[-1].low and cis[-1].high <= x.max() + tol


def test_minimum_resamples_and_chunk_boundaries():
    # 100 is the smallest allowed count; 257 and 513 straddle the 256-resample chunks. Each
    # must fill every resample: with values [0, 1] the 99% interval is [0, 1] exactly (the
    # 0.5% / 99.5% quantiles sit inside the end atoms of mass 1/4, 5.3 sd even for B = 100:
    # count of zeros ~ Binomial(100, 1/4) = 25 +- 4.3, and the 0.005 quantile needs >= 2).
    dist = exact_resampled_mean_distribution([0, 1])
    for resamples in (100, 257, 513):
        expected = (bootstrap_quantile(dist, 0.005, resamples), bootstrap_quantile(dist, 0.995, resamples))
        ci = bootstrap_ci([0.0, 1.0], confidence=0.99, resamples=resamples)
        assert (ci.low, ci.high) == expected == (0.0, 1.0)


# --------------------------------------------------------------------------------------------
# 3. the 2-D (rows, units) form


def test_2d_estimate_is_mean_over_everything_and_units_are_columns():
    arr = np.random.default_rng(1).normal(size=(3, 40)) + np.array([[0.0], [5.0], [-2.0]])
    ci = bootstrap_ci(arr)
    assert ci.estimate == pytest.approx(math.fsum(arr.ravel()) / arr.size, abs=mean_rounding_bound(arr))
    assert ci.units == 40
    ci_rows = bootstrap_ci(arr, resample_rows=True)
    assert ci_rows.estimate == ci.estimate and ci_rows.units == 40


def test_2d_interval_equals_1d_interval_of_row_mean_same_seed():
    # Units are resampled jointly across rows, so a resampled mean over (rows, resampled units)
    # is the mean over the resampled units of the per-unit row means: the 2-D interval is the 1-D
    # interval of arr.mean(0), drawn from the same generator state, bit for bit.
    rng = np.random.default_rng(2)
    base = rng.normal(size=50)
    # perfectly correlated rows (a row is base scaled and shifted) and a generic array
    correlated = np.stack([base, 2 * base + 1, 0.5 * base - 3])
    generic = rng.normal(size=(4, 50))
    for arr in (correlated, generic):
        two_d = bootstrap_ci(arr, seed=7)
        one_d = bootstrap_ci(arr.mean(0), seed=7)
        assert (two_d.low, two_d.high) == (one_d.low, one_d.high)
        assert two_d.estimate == pytest.approx(one_d.estimate, abs=2 * mean_rounding_bound(arr))


def test_2d_per_row_constant_shifts_but_does_not_widen():
    # Adding c_r to row r adds mean(c) to every unit's row mean, so every resampled mean moves by
    # mean(c): the interval shifts by mean(c) and keeps its width, up to rounding of means of
    # values of magnitude <= max|arr| (bound below, applied to both ends of the width).
    rng = np.random.default_rng(3)
    base = rng.normal(size=(3, 50))
    c = np.array([0.0, 10.0, -4.0])
    shifted = base + c[:, None]
    ci0, ci1 = bootstrap_ci(base, seed=4), bootstrap_ci(shifted, seed=4)
    tol = 4 * mean_rounding_bound(shifted)
    assert ci1.low == pytest.approx(ci0.low + c.mean(), abs=tol)
    assert ci1.high == pytest.approx(ci0.high + c.mean(), abs=tol)
    assert (ci1.high - ci1.low) == pytest.approx(ci0.high - ci0.low, abs=2 * tol)


def test_2d_units_are_resampled_jointly_not_per_row():
    # Row 1 is 1 - row 0 on every unit, so every unit's row mean is exactly 1/2 (dyadic values:
    # no rounding) and a joint resample always has mean 1/2: the interval is the point 1/2.
    # Resampling each row's units independently would instead give a wide interval, like the
    # 1-D interval of row 0 alone.
    row = np.random.default_rng(4).integers(0, 64, size=30) / 8.0
    arr = np.stack([row, 1.0 - row])
    ci = bootstrap_ci(arr)
    assert (ci.estimate, ci.low, ci.high) == (0.5, 0.5, 0.5)
    alone = bootstrap_ci(row)
    assert alone.high - alone.low > 1.0  # sd(row) ~ 2.3, se ~ 0.42: a 95% width ~ 1.6


def test_resample_rows_adds_between_row_variation():
    # Four seeds (rows) scored on the same 50 units: three agree and one is offset by 30, on top
    # of a common unit effect `base`. With fixed rows the interval only reflects `base`: a width
    # ~ 2 * 1.96 * sigma_base, sigma_base = sd(base)/sqrt(50) ~ 0.14. Resampling the rows too
    # adds mean(c*) = 30 K / 4, K ~ Binomial(4, 1/4) the number of draws of the offset row
    # (P = 81, 108, 54, 12, 1 over 256; enumerated below). The 2.5% quantile sits in the atom
    # at 0 and the 97.5% in the atom at 22.5 (K = 3), both >= 5 binomial sd from a jump
    # (checked by bootstrap_quantile): a width of 22.5. The unit part, drawn independently of
    # the rows, blurs each end by ~N(0, sigma_base^2) (a fixed-row bootstrap mean), placed by
    # where the level falls inside the atom (a blur quantile of 0.08 and 0.55 here, i.e.
    # -1.4 and +0.1 sigma_base); we allow 4 sigma_base per end and 8 for the width.
    rng = np.random.default_rng(6)
    base = rng.normal(size=50)
    c = np.array([0.0, 0.0, 0.0, 30.0])
    arr = base[None, :] + c[:, None]
    fixed = bootstrap_ci(arr, seed=2)
    two_stage = bootstrap_ci(arr, seed=2, resample_rows=True)
    assert fixed.estimate == two_stage.estimate

    dist = exact_resampled_mean_distribution(c)  # mean(c*) over 4 resampled rows
    assert dist[Fraction(0)] == Fraction(81, 256) and dist[Fraction(45, 2)] == Fraction(12, 256)
    lo, hi = bootstrap_quantile(dist, 0.025, B), bootstrap_quantile(dist, 0.975, B)
    assert (lo, hi) == (0.0, 22.5)
    sigma_base = base.std() / math.sqrt(50)
    assert two_stage.low == pytest.approx(lo + base.mean(), abs=4 * sigma_base)
    assert two_stage.high == pytest.approx(hi + base.mean(), abs=4 * sigma_base)
    assert two_stage.high - two_stage.low == pytest.approx(hi - lo, abs=8 * sigma_base)
    # fixed rows: the offset row moves every resampled mean by mean(c) = 7.5 and nothing else,
    # so the width is the normal approximation's. Its Monte Carlo error is ~1.5% (the 0.030 sigma
    # per half-width of section 2, relative to 1.96 sigma) and the non-normality of a mean of 50
    # normal draws is smaller still; 10% is ~6 of those standard errors.
    assert fixed.high - fixed.low == pytest.approx(2 * Z95 * sigma_base, rel=0.10)
    assert two_stage.high - two_stage.low > 10 * (fixed.high - fixed.low)  # ~22.5 vs ~0.55


# --------------------------------------------------------------------------------------------
# 4. paired differences


@pytest.mark.parametrize("shape", [(60,), (3, 60)])
def test_paired_equals_bootstrap_of_difference(shape):
    rng = np.random.default_rng(10)
    a, b = rng.normal(size=shape), rng.normal(size=shape)
    kwargs = dict(confidence=0.9, resamples=500, seed=5)
    assert paired_bootstrap_ci(a, b, **kwargs) == bootstrap_ci(a - b, **kwargs)
    assert paired_bootstrap_ci(a, b) == bootstrap_ci(a - b)
    if len(shape) == 2:
        kwargs["resample_rows"] = True
        assert paired_bootstrap_ci(a, b, **kwargs) == bootstrap_ci(a - b, **kwargs)


def test_paired_is_much_tighter_with_a_shared_unit_component():
    # a = common + 0.5 + noise_a, b = common + noise_b, common ~ N(0, 10^2) per unit (the text's
    # difficulty), noises ~ N(0, 0.1^2), n = 200 units. Separate 95% widths ~ 2*1.96*10/sqrt(200)
    # = 2.8; the paired width ~ 2*1.96*sqrt(0.02)/sqrt(200) = 0.039, a ratio ~ 70. The sample
    # sds of 200 draws are within ~15% of the truth (3 sd of s/sigma ~ 3/sqrt(400)), so the
    # ratio exceeds 50; we require 20. The paired interval sits ~50 standard errors above 0,
    # while the separate intervals overlap (0.5 is far less than their half-widths ~1.4).
    rng = np.random.default_rng(11)
    n = 200
    common = rng.normal(scale=10.0, size=n)
    a = common + 0.5 + rng.normal(scale=0.1, size=n)
    b = common + rng.normal(scale=0.1, size=n)
    paired = paired_bootstrap_ci(a, b)
    ia, ib = bootstrap_ci(a), bootstrap_ci(b)
    # the estimate is mean(a - b); it differs from mean(a) - mean(b) only by the rounding of the
    # three means (and of the subtraction, inside the first bound)
    rounding = mean_rounding_bound(a - b) + mean_rounding_bound(a) + mean_rounding_bound(b)
    assert paired.estimate == pytest.approx(a.mean() - b.mean(), abs=rounding)
    assert paired.high - paired.low < min(ia.high - ia.low, ib.high - ib.low) / 20
    assert paired.above(0.0) and paired.excludes(0.0)
    assert ia.low < ib.high and ib.low < ia.high  # separately, indistinguishable
    assert not Interval(0.0, ia.low - ib.high, ia.high - ib.low, 0.95, n).excludes(0.0)


def test_paired_shape_mismatch_and_bad_inputs():
    with pytest.raises(ValueError, match=r"a and b .*\(1, 3\) and \(1, 4\)"):
        paired_bootstrap_ci([1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="a and b"):
        paired_bootstrap_ci(np.zeros((2, 5)), np.zeros((3, 5)))
    with pytest.raises(ValueError, match="^a must be finite"):
        paired_bootstrap_ci([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError, match="^b must be finite"):
        paired_bootstrap_ci([1.0, 2.0], [float("inf"), 2.0])
    with pytest.raises(TypeError, match="^b must be an array of numbers"):
        paired_bootstrap_ci([1.0, 2.0], ["x", "y"])
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap_ci([1.0, 2.0], [0.0, 1.0], confidence=1.0)


# --------------------------------------------------------------------------------------------
# 5. seeding


def test_same_seed_same_interval_other_seed_differs():
    x = np.random.default_rng(12).normal(size=50)
    one = bootstrap_ci(x, seed=11)
    np.random.seed(123)  # the global generator must play no part
    two = bootstrap_ci(x, seed=11)
    assert one == two and (one.low, one.high) == (two.low, two.high)
    assert bootstrap_ci(x) == bootstrap_ci(x, seed=0)  # the default seed is 0
    # another seed: with 50 continuous values there are ~1e84 distinct resamples, so two
    # independent runs of 4000 resamples giving the same two quantiles is a probability-zero event
    other = bootstrap_ci(x, seed=12)
    assert other.low != one.low and other.high != one.high
    arr = np.random.default_rng(13).normal(size=(3, 50))
    assert bootstrap_ci(arr, seed=4, resample_rows=True) == bootstrap_ci(arr, seed=4, resample_rows=True)
    assert bootstrap_ci(arr, seed=4, resample_rows=True) != bootstrap_ci(arr, seed=5, resample_rows=True)


# --------------------------------------------------------------------------------------------
# 6. proportion_ci (Wilson)


def test_wilson_zero_and_all_successes_closed_forms():
    # At k = 0 the quadratic's roots are 0 and (z^2/n)/(1 + z^2/n) = z^2/(n + z^2); at k = n they
    # are n/(n + z^2) and 1 (each side within WILSON_TOL of the module's float evaluation).
    n, z2 = 32, Z95**2
    zero = proportion_ci(0, n)
    assert zero.estimate == 0.0 and zero.units == n and zero.confidence == 0.95
    assert zero.high == pytest.approx(z2 / (n + z2), abs=WILSON_TOL)
    assert zero.low == pytest.approx(0.0, abs=WILSON_TOL)
    assert zero.high > 0.1  # not a point, unlike the normal interval p +- z sqrt(p(1-p)/n) = [0, 0]
    full = proportion_ci(n, n)
    assert full.estimate == 1.0
    assert full.low == pytest.approx(n / (n + z2), abs=WILSON_TOL)
    assert full.high == pytest.approx(1.0, abs=WILSON_TOL)


@pytest.mark.parametrize("k, n, confidence, z", [
    (0, 32, 0.95, Z95), (32, 32, 0.95, Z95), (7, 32, 0.95, Z95), (1, 1, 0.95, Z95),
    (0, 1, 0.99, Z99), (13, 20, 0.9, Z90), (50, 100, 0.99, Z99), (3, 1000, 0.95, Z95),
])
def test_wilson_matches_independent_high_precision_roots(k, n, confidence, z):
    ci = proportion_ci(k, n, confidence=confidence)
    lo, hi = wilson_reference(k, n, z)
    assert ci.low == pytest.approx(lo, abs=WILSON_TOL)
    assert ci.high == pytest.approx(hi, abs=WILSON_TOL)
    assert ci.estimate == k / n and ci.units == n and ci.confidence == confidence


def test_wilson_mirror_symmetry_and_shrinkage_to_one_half():
    # k successes and n-k successes are the same data with the labels swapped:
    # [low, high](k) = [1 - high, 1 - low](n - k), up to WILSON_TOL rounding on each side.
    # The centre (p + z^2/2n)/(1 + z^2/n) is a weighted average of p and 1/2 (weights 1, z^2/n),
    # so it lies between them.
    for n in (1, 2, 7, 32, 101):
        for k in range(n + 1):
            ci, mirror = proportion_ci(k, n), proportion_ci(n - k, n)
            assert ci.low == pytest.approx(1 - mirror.high, abs=2 * WILSON_TOL)
            assert ci.high == pytest.approx(1 - mirror.low, abs=2 * WILSON_TOL)
            assert 0.0 <= ci.low < ci.high <= 1.0
            centre, p = (ci.low + ci.high) / 2, k / n
            assert min(p, 0.5) - WILSON_TOL <= centre <= max(p, 0.5) + WILSON_TOL
            # a larger z widens the interval (exactly; each float bound errs by <= WILSON_TOL)
            wider = proportion_ci(k, n, confidence=0.99)
            assert wider.low <= ci.low + 2 * WILSON_TOL and ci.high <= wider.high + 2 * WILSON_TOL


def test_wilson_approaches_normal_interval_for_large_n():
    # Wilson: centre c = (p + z^2/2n)/(1 + z^2/n), half h = z sqrt(A + z^2/4n^2)/(1 + z^2/n),
    # A = p(1-p)/n; normal: p +- h0, h0 = z sqrt(A). Then
    #   |c - p| = z^2 |1 - 2p| / (2n (1 + z^2/n)) <= z^2/(2n),
    #   |h - h0| <= z (z^2/4n^2) / (2 sqrt A) + h0 z^2/n   (sqrt(A+e) - sqrt(A) <= e / 2 sqrt A),
    # so each end differs by at most their sum (plus WILSON_TOL rounding).
    n, k = 1_000_000, 300_000
    p, z = k / n, Z95
    A = p * (1 - p) / n
    h0 = z * math.sqrt(A)
    bound = z**2 / (2 * n) + z * (z**2 / (4 * n**2)) / (2 * math.sqrt(A)) + h0 * z**2 / n + WILSON_TOL
    assert bound < 0.01 * h0  # the bound is tight enough for this to say something
    ci = proportion_ci(k, n)
    assert ci.low == pytest.approx(p - h0, abs=bound)
    assert ci.high == pytest.approx(p + h0, abs=bound)
    # and at small n the two really differ (so the agreement above is a large-n effect)
    small = proportion_ci(3, 10)
    p_s, h_s = 0.3, Z95 * math.sqrt(0.3 * 0.7 / 10)
    assert abs(small.low - (p_s - h_s)) > 0.05


def test_wilson_interval_always_contains_the_observed_rate():
    # p = k/n satisfies |k/n - p| <= z sqrt(p(1-p)/n) trivially, so every Wilson interval
    # contains the estimate; at k = 0 the exact lower bound is 0 and at k = n the upper is 1.
    # A claim like "the rate is 0 within noise" relies on not proportion_ci(0, n).excludes(0).
    bad = []
    for n in range(1, 101):
        for k in (0, n):
            ci = proportion_ci(k, n)
            if ci.excludes(ci.estimate):
                bad.append((k, n, ci.low, ci.high))
    assert not bad, bad[:6]


def test_proportion_ci_bad_arguments():
    with pytest.raises(ValueError, match="trials"):
        proportion_ci(0, 0)
    with pytest.raises(ValueError, match="trials"):
        proportion_ci(0, -3)
    with pytest.raises(ValueError, match=r"successes must lie in \[0, trials\]"):
        proportion_ci(5, 4)
    with pytest.raises(ValueError, match="successes"):
        proportion_ci(-1, 4)
    with pytest.raises(TypeError, match="trials"):
        proportion_ci(1, 4.0)
    with pytest.raises(TypeError, match="successes"):
        proportion_ci(True, 4)
    # counts from NumPy sums are ints too
    assert proportion_ci(np.int64(3), np.int64(10)) == proportion_ci(3, 10)
    for confidence in (0, 1, 1.5, -0.2, float("nan")):
        with pytest.raises(ValueError, match="confidence"):
            proportion_ci(1, 4, confidence=confidence)
    with pytest.raises(TypeError, match="confidence"):
        proportion_ci(1, 4, confidence="0.95")


# --------------------------------------------------------------------------------------------
# 7. check_seeds / failing_seeds / SeedCheck


def test_check_seeds_sequence_of_bools_and_numpy_bools():
    result = check_seeds([True, False, True, np.True_, np.False_])
    assert result.passed == (0, 2, 3) and result.failed == (1, 4)
    assert not result.holds and result.n == 5
    assert str(result) == "3 of 5 seeds (not seeds 1, 4)"
    assert failing_seeds([True, False, True, np.True_, np.False_]) == [1, 4]
    all_pass = check_seeds((True,) * 5)  # a tuple is a sequence too
    assert all_pass.holds and all_pass.n == 5 and all_pass.failed == ()
    assert str(all_pass) == "every seed (5 of 5)"
    assert failing_seeds(np.array([True, True])) == []  # numpy array of bools: np.bool_ items


def test_check_seeds_mapping_with_callable_claim_keeps_order():
    losses = {11: 0.9, 7: 0.2, 3: 0.8, 42: 0.6, 5: 0.1}
    seen = []

    def claim(v):
        seen.append(v)
        return v > 0.5

    result = check_seeds(losses, claim)
    assert seen == [0.9, 0.2, 0.8, 0.6, 0.1]  # once per seed, in the mapping's order
    assert result.passed == (11, 3, 42) and result.failed == (7, 5)
    assert str(result) == "3 of 5 seeds (not seeds 7, 5)"
    assert failing_seeds(losses, claim) == [7, 5]
    # a claim giving numpy bools (a comparison of numpy scalars)
    result = check_seeds({s: np.float64(v) for s, v in losses.items()}, lambda v: v > 0.15)
    assert result.failed == (5,) and str(result) == "4 of 5 seeds (not seed 5)"


def test_seedcheck_str_forms_and_holds():
    assert str(SeedCheck((0, 1, 2, 4), (3,))) == "4 of 5 seeds (not seed 3)"
    assert str(SeedCheck((0, 2, 3), (1, 4))) == "3 of 5 seeds (not seeds 1, 4)"
    assert str(SeedCheck((0, 1, 2, 3, 4), ())) == "every seed (5 of 5)"
    assert str(SeedCheck((), ("a", "b"))) == "0 of 2 seeds (not seeds a, b)"
    assert SeedCheck((1,), ()).holds and not SeedCheck((), (1,)).holds
    assert not SeedCheck((), ()).holds  # no seeds is not evidence
    assert SeedCheck((1, 2), (3,)).n == 3
    assert str(check_seeds([True, True, True, False, True])) == "4 of 5 seeds (not seed 3)"


def test_check_seeds_errors():
    for empty in ([], {}, ()):
        with pytest.raises(ValueError, match="per_seed"):
            check_seeds(empty)
        with pytest.raises(ValueError, match="per_seed"):
            failing_seeds(empty, bool)
    with pytest.raises(TypeError, match="bool.*float.*seed 0"):
        check_seeds([0.7, 0.2], lambda v: v * 1.0)
    with pytest.raises(TypeError, match="bool.*ndarray"):
        check_seeds([1.0, 2.0], lambda v: np.array([v > 0]))
    with pytest.raises(TypeError, match="bool.*int.*seed 'b'"):
        check_seeds({"a": True, "b": 1})  # precomputed values must be bools, not 1/0
    with pytest.raises(TypeError, match="bool"):
        failing_seeds([0.0], lambda v: None)


# --------------------------------------------------------------------------------------------
# 8. Interval helpers


def test_interval_helpers():
    ci = Interval(1.0, 0.5, 2.0, 0.95, 10)
    assert ci.excludes() and ci.excludes(0.0) and ci.excludes(2.0001) and ci.excludes(-1.0)
    assert not ci.excludes(1.0) and not ci.excludes(0.5) and not ci.excludes(2.0)  # closed ends
    assert ci.above() and ci.above(0.4999) and not ci.above(0.5)  # strict
    assert ci.below(2.5) and not ci.below(2.0) and not ci.below()
    neg = Interval(-1.0, -2.0, -0.25, 0.9, 4)
    assert neg.below() and not neg.above() and neg.excludes()
    straddle = Interval(0.1, -0.2, 0.3, 0.95, 4)
    assert not straddle.excludes() and not straddle.above() and not straddle.below()
    with pytest.raises(FrozenInstanceError):
        ci.low = 0.0  # type: ignore[misc]


def test_interval_format_and_str():
    ci = Interval(0.123456, -1.4, 2.75, 0.95, 10)
    assert ci.format(3) == "0.123 [-1.400, 2.750]"
    assert ci.format(0) == "0 [-1, 3]"
    assert ci.format() == str(ci) == "0.12 [-1.40, 2.75]"
    assert f"{ci}" == "0.12 [-1.40, 2.75]"


# --------------------------------------------------------------------------------------------
# 9. block_means


def test_block_means_by_hand():
    # arange(12) in 3 blocks: means of 0..3, 4..7, 8..11 = 1.5, 5.5, 9.5
    assert block_means(np.arange(12), 3).tolist() == [1.5, 5.5, 9.5]
    # 2-D: along the last axis, row by row: (0+1+2)/3, (3+4+5)/3, (10+11+12)/3, (13+14+15)/3
    arr = np.array([np.arange(6), np.arange(10, 16)])
    out = block_means(arr, 2)
    assert out.shape == (2, 2) and out.tolist() == [[1.0, 4.0], [11.0, 14.0]]
    assert block_means([1.0, 2.0, 4.0], 3).tolist() == [1.0, 2.0, 4.0]  # one per block: identity
    assert block_means(arr, 1).tolist() == [[2.5], [12.5]]
    assert block_means([2, 4, 6, 8], 2).dtype == np.float64


def test_block_means_mean_equals_overall_mean():
    # equal block sizes: the mean of the block means is the overall mean (up to rounding of two
    # nested means of the same values)
    x = np.random.default_rng(14).normal(size=(3, 120))
    for blocks in (1, 4, 30, 120):
        bm = block_means(x, blocks)
        assert bm.shape == (3, blocks)
        assert bm.mean() == pytest.approx(x.mean(), abs=4 * mean_rounding_bound(x))
        assert bm.mean(-1) == pytest.approx(x.mean(-1), abs=4 * mean_rounding_bound(x))


def test_block_bootstrap_respects_correlated_neighbours():
    # 20 files of 20 windows each; a window's value is its file's effect (sd 1) plus noise
    # (sd 0.1). Treating the 400 windows as independent gives a standard error ~ 1/sqrt(400)
    # = 0.05; the 20 file effects give the honest ~ 1/sqrt(20) = 0.22, a ratio ~ sqrt(20) = 4.5.
    # The sample sd of 20 effects is within a factor (1 +- 3/sqrt(38)) of 1 at 3 sd, so the
    # ratio exceeds 4.5 * 0.5 > 2; we require 2.
    rng = np.random.default_rng(15)
    effects = rng.normal(size=20)
    x = np.repeat(effects, 20) + rng.normal(scale=0.1, size=400)
    naive = bootstrap_ci(x)
    blocked = bootstrap_ci(block_means(x, 20))
    assert blocked.units == 20 and naive.units == 400
    assert blocked.estimate == pytest.approx(naive.estimate, abs=4 * mean_rounding_bound(x))
    assert blocked.high - blocked.low > 2 * (naive.high - naive.low)


def test_block_means_errors():
    for blocks in (5, 7, 13):  # do not divide 12
        with pytest.raises(ValueError, match=rf"blocks \({blocks}\) must divide .*\(12\)"):
            block_means(np.arange(12), blocks)
    for blocks in (0, -1):
        with pytest.raises(ValueError, match="blocks must be >= 1"):
            block_means(np.arange(12), blocks)
    with pytest.raises(TypeError, match="blocks must be an int"):
        block_means(np.arange(12), 3.0)
    with pytest.raises(ValueError, match="blocks"):
        block_means([], 1)
    with pytest.raises(ValueError, match="blocks"):
        block_means(3.0, 1)  # a scalar has no axis to split


# --------------------------------------------------------------------------------------------
# 10. bad input to bootstrap_ci


@pytest.mark.parametrize("values, match", [
    ([], r"values must hold at least one row and one unit"),
    (np.zeros((2, 0)), r"values must hold at least one row and one unit"),
    (np.zeros((0, 3)), r"values must hold at least one row and one unit"),
    (np.zeros((2, 3, 4)), r"values must be 1-D \(units\) or 2-D \(rows, units\), got shape \(2, 3, 4\)"),
    (3.0, r"values must be 1-D"),
    ([1.0, float("nan"), 2.0], r"values must be finite, got 1 non-finite"),
    ([float("inf"), 1.0, -float("inf")], r"values must be finite, got 2 non-finite"),
    ([[1.0, 2.0], [3.0, float("nan")]], r"values must be finite"),
])
def test_bootstrap_bad_values(values, match):
    with pytest.raises(ValueError, match=match):
        bootstrap_ci(values)


@pytest.mark.parametrize("values", [["a", "b"], "abc", {}, [1 + 2j], [[1.0, 2.0], [3.0]], object()])
def test_bootstrap_non_numeric_values(values):
    with pytest.raises(TypeError, match="values must be an array of numbers"):
        bootstrap_ci(values)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(confidence=0), ValueError, "confidence"),
    (dict(confidence=1), ValueError, r"confidence must lie in \(0, 1\)"),
    (dict(confidence=1.5), ValueError, r"confidence must lie in \(0, 1\)"),
    (dict(confidence=-0.5), ValueError, "confidence"),
    (dict(confidence=float("nan")), ValueError, "confidence"),
    (dict(confidence="0.9"), TypeError, "confidence"),
    (dict(confidence=True), TypeError, "confidence"),
    (dict(resamples=99), ValueError, "resamples must be >= 100"),
    (dict(resamples=0), ValueError, "resamples"),
    (dict(resamples=1000.0), TypeError, "resamples must be an int"),
    (dict(seed=-1), ValueError, "seed must be >= 0"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(seed=None), TypeError, "seed"),
])
def test_bootstrap_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        bootstrap_ci([1.0, 2.0, 3.0], **kwargs)


def test_non_numeric_values_are_type_errors():
    # numeric strings are not numbers, whatever NumPy would make of them; nor is None, nor a
    # ragged nesting
    for bad in (["1", "2"], None, [[1.0, 2.0], [3.0]]):
        with pytest.raises(TypeError, match="values must be an array of numbers"):
            bootstrap_ci(bad)
    with pytest.raises(TypeError, match="values must be an array of numbers"):
        block_means(["a", "b"], 1)


def test_interval_format_digits_must_be_an_int_at_least_zero():
    ci = Interval(0.123456, -1.4, 2.75, 0.95, 10)
    with pytest.raises(ValueError, match="digits must be >= 0, got -1"):
        ci.format(-1)
    for bad in (1.5, "2", True, None):
        with pytest.raises(TypeError, match="digits must be an int"):
            ci.format(bad)
    assert ci.format(np.int64(3)) == "0.123 [-1.400, 2.750]"  # a NumPy int is an int


def test_bootstrap_resample_rows_must_be_a_bool():
    values = [[1.0, 2.0, 4.0, 3.0], [10.0, 11.5, 12.0, 13.0]]  # rows far apart: resampling them widens
    for bad in ("yes", "False", 1, 0, None):
        with pytest.raises(TypeError, match="resample_rows must be a bool"):
            bootstrap_ci(values, resample_rows=bad)
    # True and False (NumPy's bools too) are what they were: the two-stage and the unit bootstrap
    assert bootstrap_ci(values, resample_rows=np.bool_(True)) == bootstrap_ci(values, resample_rows=True)
    assert bootstrap_ci(values, resample_rows=np.bool_(False)) == bootstrap_ci(values) == bootstrap_ci(
        np.mean(values, 0))
    assert bootstrap_ci(values, resample_rows=True) != bootstrap_ci(values)


def test_check_seeds_claim_must_be_callable():
    with pytest.raises(TypeError, match=r"claim must be a function .* or None, got str 'x > 0'"):
        check_seeds([1.0], "x > 0")
    with pytest.raises(TypeError, match="claim must be a function"):
        check_seeds({0: True}, True)
    assert check_seeds([1.0, -1.0], lambda x: x > 0) == SeedCheck((0,), (1,))
