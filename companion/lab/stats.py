"""The statistics behind the lab's claims: bootstrap intervals and per-seed checks.

An experimental claim in the book ("X beats Y at 8x", "Z stays flat") is as strong as its
evidence, and two kinds of variation can overturn it:

* **the text**: a metric is a mean over evaluation *units* (windows, or blocks of
  neighbouring windows) of the validation split, and another stretch of text gives another
  mean. :func:`bootstrap_ci` resamples the units with replacement (a percentile bootstrap,
  :cite:`efron1993bootstrap`) and gives an interval for the mean; :func:`paired_bootstrap_ci`
  does the same for the difference of two metrics scored on the *same* units, which is far
  tighter than comparing two separate intervals, because the difficulty of the text cancels.
* **the seed**: whether a tiny model learns a mechanism (an induction head, say) can depend
  on its initialisation. :func:`check_seeds` applies a claim to every seed and reports which
  seeds fail, so a notebook can assert that a claim holds on every seed, or state it as
  "k of n seeds", with the exceptions printed.

:func:`proportion_ci` is the Wilson score interval :cite:`wilson1927probable` for a rate of
successes (passkey exact match over trials), which stays sensible at 0 or n successes,
where a bootstrap collapses to a point.

Every interval is seeded, so a notebook that prints one prints the same digits on every run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from .._checks import check_bool, check_finite_number, check_positive_int

__all__ = ["Interval", "SeedCheck", "bootstrap_ci", "paired_bootstrap_ci", "proportion_ci", "check_seeds",
           "failing_seeds", "block_means"]

#: Resamples drawn per chunk (bounds the memory of the index array to a few MB).
_CHUNK = 256


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided confidence interval ``[low, high]``.

    ``units`` is the number of units resampled (windows, blocks, trials), ``confidence`` the
    nominal coverage (0.95 for a 95% interval).
    """

    estimate: float
    low: float
    high: float
    confidence: float
    units: int

    def excludes(self, value: float = 0.0) -> bool:
        """Whether ``value`` lies outside the interval (for 0: a difference that is not noise)."""
        return not self.low <= value <= self.high

    def above(self, value: float = 0.0) -> bool:
        """Whether the whole interval lies above ``value``."""
        return self.low > value

    def below(self, value: float = 0.0) -> bool:
        """Whether the whole interval lies below ``value``."""
        return self.high < value

    def format(self, digits: int = 2) -> str:
        """``"estimate [low, high]"`` rounded to ``digits`` decimals.

        Raises:
            TypeError: ``digits`` is not an int (a bool, a float, a string).
            ValueError: ``digits`` is negative.
        """
        digits = _count(digits, "digits", 0)
        return f"{self.estimate:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"

    def __str__(self) -> str:
        return self.format()


@dataclass(frozen=True)
class SeedCheck:
    """The seeds on which a claim holds (``passed``) and those on which it does not (``failed``)."""

    passed: tuple[Hashable, ...]
    failed: tuple[Hashable, ...]

    @property
    def holds(self) -> bool:
        """True when the claim holds on every seed (and there is at least one)."""
        return bool(self.passed) and not self.failed

    @property
    def n(self) -> int:
        """The number of seeds checked."""
        return len(self.passed) + len(self.failed)

    def __str__(self) -> str:
        if not self.failed:
            return f"every seed ({self.n} of {self.n})"
        names = ", ".join(str(s) for s in self.failed)
        return f"{len(self.passed)} of {self.n} seeds (not seed{'s' if len(self.failed) > 1 else ''} {names})"


def _check_confidence(confidence: float) -> float:
    c = check_finite_number(confidence, "confidence")
    if not 0 < c < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    return c


def _numeric(values: Any, name: str) -> np.ndarray:
    """``values`` as a float64 array; anything but numbers (strings, None, ragged lists) is a TypeError."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:  # ragged nesting
        raise TypeError(f"{name} must be an array of numbers, got a ragged {type(values).__name__}") from exc
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be an array of numbers, got {type(values).__name__} of dtype {arr.dtype}")
    return arr.astype(np.float64)


def _count(value: Any, name: str, minimum: int) -> int:
    """An int count (NumPy integers too, as a sum of trials gives), at least ``minimum``."""
    if isinstance(value, np.integer) and not isinstance(value, np.bool_):
        value = int(value)
    return check_positive_int(value, name, minimum)


def _as_units(values: Any, name: str) -> np.ndarray:
    """``values`` as a float64 array of shape ``(rows, units)`` (a 1-D input is one row)."""
    arr = _numeric(values, name)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 1-D (units) or 2-D (rows, units), got shape {arr.shape}")
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{name} must hold at least one row and one unit, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} must be finite, got {int((~np.isfinite(arr)).sum())} non-finite value(s)")
    return arr


def bootstrap_ci(
    values: Any,
    *,
    confidence: float = 0.95,
    resamples: int = 4000,
    seed: int = 0,
    resample_rows: bool = False,
) -> Interval:
    """Percentile-bootstrap interval for the mean of ``values`` over its units.

    ``values`` is 1-D, one value per unit, or 2-D, ``(rows, units)``: several rows (seeds)
    scored on the same units. For 2-D input the estimate is the mean over rows and units,
    and the units are resampled *jointly* for every row (unit ``j`` is the same text in
    every row), so the interval reflects the variation of the text at fixed rows. With
    ``resample_rows=True`` the rows are resampled too (a two-stage bootstrap), which adds
    the variation between seeds; with few rows that interval is itself rough.

    The interval is ``[q_{a/2}, q_{1-a/2}]`` of ``resamples`` resampled means, ``a = 1 -
    confidence``, drawn from a generator seeded with ``seed``.

    Raises:
        ValueError: empty, non-finite or more than 2-D ``values``; ``confidence`` outside
            ``(0, 1)``; ``resamples`` below 100; a negative ``seed``.
        TypeError: ``values`` that are not numbers, or ``resample_rows`` that is not a bool
            (``"yes"`` or ``1``).
    """
    arr = _as_units(values, "values")
    c = _check_confidence(confidence)
    check_positive_int(resamples, "resamples", 100)
    check_positive_int(seed, "seed", 0)
    if not isinstance(resample_rows, np.bool_):
        check_bool(resample_rows, "resample_rows")
    resample_rows = bool(resample_rows)
    rows, n = arr.shape
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    # per-unit sums over rows: with fixed rows a resample needs only these
    unit_means = arr.mean(0)
    for start in range(0, resamples, _CHUNK):
        b = min(_CHUNK, resamples - start)
        idx = rng.integers(0, n, size=(b, n))
        if resample_rows:
            ridx = rng.integers(0, rows, size=(b, rows))
            # mean over resampled rows of the mean over resampled units, in one gather
            picked = arr[ridx[:, :, None], idx[:, None, :]]
            means[start:start + b] = picked.mean(axis=(1, 2))
        else:
            means[start:start + b] = unit_means[idx].mean(1)
    a = 1 - c
    low, high = np.quantile(means, [a / 2, 1 - a / 2])
    return Interval(float(arr.mean()), float(low), float(high), c, n)


def paired_bootstrap_ci(a: Any, b: Any, **kwargs: Any) -> Interval:
    """Interval for ``mean(a) - mean(b)``, two metrics scored on the same units.

    ``a`` and ``b`` have the same shape, 1-D ``(units,)`` or 2-D ``(rows, units)`` (for
    example two schemes, each with its seeds, on the same windows; or one scheme at two
    lengths, on windows that end at the same bytes). Unit ``j`` of ``a`` and of ``b`` is
    resampled together, so what the two share (the difficulty of the text) cancels.
    Keyword arguments are those of :func:`bootstrap_ci`.

    Raises:
        ValueError: ``a`` and ``b`` of different shapes, or as :func:`bootstrap_ci`.
    """
    x, y = _as_units(a, "a"), _as_units(b, "b")
    if x.shape != y.shape:
        raise ValueError(f"a and b must be scored on the same units (same shape), got {x.shape} and {y.shape}")
    return bootstrap_ci(x - y, **kwargs)


def proportion_ci(successes: int, trials: int, *, confidence: float = 0.95) -> Interval:
    """Wilson score interval for a rate of ``successes`` in ``trials`` independent trials.

    With ``z`` the normal quantile of ``1 - a/2`` and ``p = successes / trials``, the interval
    is ``(p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)``. Unlike the normal
    approximation it stays inside ``[0, 1]`` and is not a point at 0 or n successes.

    Raises:
        ValueError: ``trials`` below 1, ``successes`` outside ``[0, trials]``, or
            ``confidence`` outside ``(0, 1)``.
    """
    n = _count(trials, "trials", 1)
    k = _count(successes, "successes", 0)
    if k > n:
        raise ValueError(f"successes must lie in [0, trials] = [0, {n}], got {k}")
    c = _check_confidence(confidence)
    z = NormalDist().inv_cdf(1 - (1 - c) / 2)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at 0 or n successes the exact bound is 0 or 1; centre -+ half only rounds to it
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return Interval(p, low, high, c, n)


def check_seeds(per_seed: Mapping[Hashable, Any] | Sequence[Any],
                claim: Callable[[Any], bool] | None = None) -> SeedCheck:
    """Apply ``claim`` to each seed's value and report where it holds.

    ``per_seed`` maps a seed to its value (a sequence is indexed by position: seeds 0, 1,
    ...). ``claim`` turns a value into a bool; without it the values must already be bools
    (numpy bools included).

    Raises:
        ValueError: no seeds.
        TypeError: a ``claim`` that is neither callable nor None (a string such as
            ``"x > 0"``), or a claim (or value) that does not give a bool.
    """
    if claim is not None and not callable(claim):
        raise TypeError(f"claim must be a function of one seed's value that returns a bool, or None, "
                        f"got {type(claim).__name__} {claim!r:.60}")
    items = list(per_seed.items()) if isinstance(per_seed, Mapping) else list(enumerate(per_seed))
    if not items:
        raise ValueError("per_seed must hold at least one seed")
    passed, failed = [], []
    for seed, value in items:
        verdict = claim(value) if claim is not None else value
        if not isinstance(verdict, (bool, np.bool_)):
            raise TypeError(f"the claim must give a bool for each seed, got {type(verdict).__name__} for seed {seed!r}")
        (passed if verdict else failed).append(seed)
    return SeedCheck(tuple(passed), tuple(failed))


def failing_seeds(per_seed: Mapping[Hashable, Any] | Sequence[Any],
                  claim: Callable[[Any], bool] | None = None) -> list[Hashable]:
    """The seeds on which ``claim`` fails (empty when it holds on every seed); see :func:`check_seeds`."""
    return list(check_seeds(per_seed, claim).failed)


def block_means(values: Any, blocks: int) -> np.ndarray:
    """Means of ``blocks`` equal runs of consecutive entries along the last axis.

    Neighbouring evaluation windows come from the same file of the corpus, so their losses
    are correlated; a bootstrap over blocks of neighbours does not count
    them as independent evidence (the block bootstrap of :cite:`kunsch1989jackknife`). The last axis must be a multiple of ``blocks``.

    Raises:
        ValueError: ``blocks`` below 1 or not dividing the last axis.
    """
    arr = _numeric(values, "values")
    check_positive_int(blocks, "blocks")
    n = arr.shape[-1] if arr.ndim else 0
    if n == 0 or n % blocks:
        raise ValueError(f"blocks ({blocks}) must divide the number of values along the last axis ({n})")
    return arr.reshape(*arr.shape[:-1], blocks, n // blocks).mean(-1)
