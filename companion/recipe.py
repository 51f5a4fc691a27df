"""The long-context recipe: how a RoPE base is chosen for a context length, and attention temperature.

Three questions that today's long-context models answer with a number (chapter 13):

**Which pairs turn fully in training** (Liu et al., :cite:`liu2024scaling`). RoPE's pair ``i``
turns at frequency ``theta_i = base ** (-2 i / d)``, a wavelength of ``2 pi base ** (2 i / d)``
positions. The pairs whose wavelength is shorter than the training length ``L`` complete at
least one full turn in training; the others see only an arc of their circle, and a longer
context shows them angles they never saw. :func:`critical_dimension` counts the dimensions of
the first kind, ``d_extra = 2 ceil((d / 2) log_base(L / (2 pi)))`` (92 of a Llama 2 head's 128
at ``L = 4096``); :func:`extrapolation_bound` is the wavelength of the first pair past it,
``T_extra = 2 pi base ** (d_extra / d)``, the length up to which a model fine-tuned with a
larger base keeps those pairs inside a single turn; :func:`critical_base` inverts it.

**How large a base a context needs** (Men et al., :cite:`men2024base`). For random queries and
keys whose components are independent with variance ``sigma**2``, a key equal to the query plus
zero-mean noise scores, on average, ``2 sigma**2 B(m)`` more than a random key at distance
``m``, with ``B(m) = sum_i cos(m theta_i)``: attention prefers similar tokens at distance ``m``
only while ``B(m) >= 0``. :func:`base_lower_bound` is the smallest base (on a fine geometric
grid) with ``B(m) >= 0`` for every distance ``m < L``; :func:`longest_context` is the converse,
the longest context a base allows. :func:`abf_base` is the lab's rule for raising the base
before a fine-tune at a longer length (ABF, :cite:`xiong2023effective`).

**Temperature.** Log-n scaling multiplies the logits of a query that sees ``n`` keys by ``ln n``
(Chiang and Cholak, 2022); normalised to the training length, ``ln n / ln L`` (
:func:`logn_logit_scale`). LongRoPE's attention factor ``sqrt(1 + ln s / ln L)`` multiplies
both queries and keys, so the logits by ``1 + ln s / ln L = ln(s L) / ln L``
(:func:`longrope_logit_scale`): exactly log-n scaling at ``n = s L``. YaRN's ``0.1 ln s + 1``
multiplies both as well, the logits by its square (:func:`yarn_logit_scale`), an empirical fit
of the same growth. The per-position forms, Llama 4's included, are
``companion.model.AttentionTemperature``.

The published recipes (:func:`published_recipes`) and the local/global layer patterns of
today's models (:func:`local_global_models`) are data with their sources,
``companion/data/long_context_recipes.json``.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources
from typing import Any

import numpy as np

from ._checks import check_base, check_finite_number, check_positive_int
from .scaling import yarn_get_mscale

__all__ = ["critical_dimension", "extrapolation_bound", "critical_base", "decay_sum", "longest_context",
           "longest_context_of",
           "base_lower_bound", "abf_base", "logn_logit_scale", "longrope_logit_scale", "yarn_logit_scale",
           "published_recipes", "local_global_models"]


def _head_dim(head_dim: object) -> int:
    d = check_positive_int(head_dim, "head_dim", 2)
    if d % 2:
        raise ValueError(f"head_dim must be even (RoPE turns coordinates in pairs), got {d}")
    return d


def critical_dimension(head_dim: int, train_len: int, base: float = 10000.0) -> int:
    """The number of a head's dimensions whose pair completes a full turn within ``train_len``
    positions: ``2 ceil((d / 2) log_base(train_len / (2 pi)))``, clipped to ``[0, d]``
    (:cite:`liu2024scaling`'s critical dimension; 92 for Llama 2: ``d = 128``, ``L = 4096``,
    base 10000).

    Pair ``i`` (from 0) has wavelength ``2 pi base ** (2 i / d)``, shorter than ``L`` exactly
    when ``i < (d / 2) log_base(L / (2 pi))``; the count of such ``i`` is the ceiling.

    Raises:
        TypeError: a size that is not an int, or a base that is not a real number.
        ValueError: an odd ``head_dim`` or one below 2, ``train_len`` below 1, ``base`` not a
            finite number > 1.
    """
    d = _head_dim(head_dim)
    L = check_positive_int(train_len, "train_len")
    b = check_base(base)
    x = (d / 2) * math.log(L / (2 * math.pi)) / math.log(b)
    return 2 * min(d // 2, max(0, math.ceil(x)))


def extrapolation_bound(head_dim: int, train_len: int, base: float, pretrain_base: float | None = None) -> float:
    """Liu et al.'s extrapolation bound ``T_extra = 2 pi base ** (d_extra / d)``: the
    wavelength, at ``base``, of the first pair past the critical dimension ``d_extra`` of
    pretraining (:func:`critical_dimension` at ``train_len`` and ``pretrain_base``, default
    ``base``). With a raised base and a fine-tune, that pair stays within one turn up to
    ``T_extra`` positions (:cite:`liu2024scaling`). ``inf`` when every pair turns fully in
    pretraining (``d_extra = d``: the bound of a base this small is not set by that pair).

    Raises:
        TypeError, ValueError: as :func:`critical_dimension`.
    """
    d = _head_dim(head_dim)
    b = check_base(base)
    extra = critical_dimension(d, train_len, b if pretrain_base is None else check_base(pretrain_base, "pretrain_base"))
    if extra >= d:
        return math.inf
    return 2 * math.pi * b ** (extra / d)


def critical_base(target_len: int, train_len: int, base: float = 10000.0) -> float:
    """The base whose :func:`extrapolation_bound` reaches ``target_len`` for a model pretrained
    at ``train_len`` with ``base``, with the critical dimension taken unrounded:
    ``base ** (ln(target / 2 pi) / ln(train_len / 2 pi))`` (``2 pi b' ** x = target`` with
    ``x = log_base(train_len / 2 pi)``; independent of the head size). Llama 2 at 32768:
    about 1.9e5 (Xiong et al. chose 5e5).

    Raises:
        TypeError: a length that is not an int, a base that is not a real number.
        ValueError: ``train_len`` at most ``2 pi`` (every pair's wavelength exceeds it) or
            ``target_len`` below ``train_len``; ``base`` not a finite number > 1.
    """
    T = check_positive_int(target_len, "target_len")
    L = check_positive_int(train_len, "train_len")
    b = check_base(base)
    if L <= 2 * math.pi:
        raise ValueError(f"train_len must exceed 2 pi (the shortest wavelength), got {L}")
    if T < L:
        raise ValueError(f"target_len must be at least train_len ({L}), got {T}")
    return b ** (math.log(T / (2 * math.pi)) / math.log(L / (2 * math.pi)))


def decay_sum(distances: Any, base: float, head_dim: int = 128) -> np.ndarray:
    """Men et al.'s ``B(m) = sum_{i < d/2} cos(m base ** (-2 i / d))`` at each distance ``m``
    (float64): the mean advantage, in units of ``2 sigma**2``, of a key similar to the query
    over a random key at distance ``m`` (:cite:`men2024base`).

    Raises:
        TypeError, ValueError: distances that are not real numbers, or a bad ``base`` or
            ``head_dim``.
    """
    d = _head_dim(head_dim)
    b = check_base(base)
    m = np.asarray(distances)
    if m.dtype == object or not (np.issubdtype(m.dtype, np.integer) or np.issubdtype(m.dtype, np.floating)):
        raise TypeError(f"distances must be real numbers, got dtype {m.dtype}")
    theta = b ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    return np.cos(np.multiply.outer(m.astype(np.float64), theta)).sum(-1)


def _first_negative(base: float, d: int, length: int) -> int:
    """The first distance ``m < length`` with ``B(m) < 0``, or ``length``.

    ``B(m0 + j) = Re sum_i e^(i j theta_i) e^(i m0 theta_i)``: one table of ``e^(i j theta)``
    for ``j < chunk`` and one of ``e^(i m0 theta)`` for the chunk starts give every ``B`` in a
    block as two matrix products (each factor from cos/sin of an exact float64 product, so the
    error is a few ulps per term, as for ``cos(m theta)`` directly); blocks double until the
    first negative value, so a base that fails early costs little."""
    return _first_negative_of(base ** (-np.arange(0, d, 2, dtype=np.float64) / d), length)


def _first_negative_of(theta: np.ndarray, length: int) -> int:
    """:func:`_first_negative` for any frequencies ``theta`` (float64, one per pair)."""
    chunk = max(16, int(math.isqrt(length)))
    j = np.arange(chunk, dtype=np.float64)[:, None] * theta
    tc, ts = np.cos(j), np.sin(j)
    start, starts_per_block = 0, 1
    while start < length:
        m0 = start + chunk * np.arange(starts_per_block, dtype=np.float64)
        m0 = m0[m0 < length]
        a = np.multiply.outer(theta, m0)  # (pairs, starts)
        f = tc @ np.cos(a) - ts @ np.sin(a)  # (chunk, starts): B(m0 + j)
        f = f.T.reshape(-1)[: length - start]
        neg = np.flatnonzero(f < 0)
        if neg.size:
            return start + int(neg[0])
        start += chunk * len(m0)
        starts_per_block *= 2
    return length


def longest_context(base: float, head_dim: int = 128, *, limit: int = 1 << 24) -> int:
    """The longest context ``L`` (at most ``limit``) in which ``B(m) >= 0`` for every distance
    ``m < L`` (:func:`decay_sum`): the first distance with ``B(m) < 0``, or ``limit``.

    Raises:
        TypeError, ValueError: a bad ``base``, ``head_dim`` or ``limit`` (an int >= 1).
    """
    return _first_negative(check_base(base), _head_dim(head_dim), check_positive_int(limit, "limit"))


def longest_context_of(inv_freq: Any, *, limit: int = 1 << 24) -> int:
    """:func:`longest_context` for any RoPE frequencies ``inv_freq`` (one per pair, radians
    per position), such as a scaled model's (:func:`companion.scaling.compute_inv_freq`):
    the first distance ``m < limit`` with ``sum_i cos(m inv_freq[i]) < 0``, or ``limit``.
    Computed in float64 whatever the input's dtype.

    Raises:
        TypeError: ``inv_freq`` not real numbers (a tensor or array-like), ``limit`` not an int.
        ValueError: ``inv_freq`` empty, not 1-D, or holding a value that is not finite and
            > 0; ``limit < 1``.
    """
    if hasattr(inv_freq, "detach"):
        inv_freq = inv_freq.detach().cpu().double().numpy()
    f = np.asarray(inv_freq)
    if f.dtype == object or not (np.issubdtype(f.dtype, np.integer) or np.issubdtype(f.dtype, np.floating)):
        raise TypeError(f"inv_freq must be real numbers, got dtype {f.dtype}")
    if f.ndim != 1 or f.size == 0:
        raise ValueError(f"inv_freq must be a non-empty 1-D array (one frequency per pair), got shape {f.shape}")
    f = f.astype(np.float64)
    if not np.all(np.isfinite(f) & (f > 0)):
        raise ValueError(f"inv_freq must hold finite frequencies > 0, got {f[~(np.isfinite(f) & (f > 0))][:3].tolist()}")
    return _first_negative_of(f, check_positive_int(limit, "limit"))


@functools.lru_cache(maxsize=256)
def _bound(length: int, d: int, rel_step: float, max_base: float) -> float:
    k, ratio = 1, 1.0 + rel_step
    while True:
        b = ratio ** k
        if b > max_base:
            raise ValueError(f"no base up to max_base = {max_base:g} keeps B(m) >= 0 for every distance below "
                             f"length = {length} at head_dim = {d} (pair 0 turns at frequency 1 whatever the base, "
                             f"so a head with few pairs may need a huge base, or none)")
        if _first_negative(b, d, length) >= length:
            return b
        k += 1


def base_lower_bound(length: int, head_dim: int = 128, *, rel_step: float = 1e-3, max_base: float = 1e12) -> float:
    """Men et al.'s lower bound on the RoPE base for a context of ``length`` tokens: the
    smallest base ``b`` with ``B(m) >= 0`` for every distance ``m < length``
    (:func:`decay_sum`, :cite:`men2024base`), searched on the geometric grid ``(1 +
    rel_step) ** k``, ``k = 1, 2, ...``.

    The bases that satisfy the condition do not form an interval: at ``d = 128``, ``L = 4096``
    it holds on a window about 17 wide at 26,953 to 26,970, fails at 27,000 and 28,000, holds
    at 28,700 and 29,000 and fails again at 30,000. A base above the bound is therefore not
    guaranteed to satisfy it (Men et al.'s bound is a necessary condition); check a chosen base
    with :func:`longest_context`. The grid returns the first base that satisfies it, so a
    window narrower than ``rel_step`` can be missed; the 4K value above sits in such a narrow
    window (the grid happens to hit it, as the paper's and Su's searches did). The paper's table (``d = 128``)
    gives 4.3e3, 2.7e4, 8.4e4 and 2.1e6 at 1K, 4K, 8K and 64K; at 2K, 16K and 32K smaller bases
    than its 1.6e4, 3.1e5 and 6.4e5 already satisfy the condition (1.2e4, 2.3e5, 6.3e5 on this
    grid, as Su Jianlin's brute-force search also finds).

    Cost: each grid base evaluates ``B`` until its first negative value, so about ``length *
    head_dim`` multiply-adds for each of the few hundred bases just below the bound (seconds at
    ``length = 128K``, ``head_dim = 128``; results are cached).

    Raises:
        TypeError, ValueError: ``length`` or ``head_dim`` not an int (``length >= 1``,
            ``head_dim`` even, >= 2), ``rel_step`` not a finite number in ``(0, 0.1]``,
            ``max_base`` not a finite number > 1; no base up to ``max_base`` satisfies the
            condition (a single pair, ``head_dim = 2``, never does past ``length = 2``).
    """
    L = check_positive_int(length, "length")
    d = _head_dim(head_dim)
    step = check_finite_number(rel_step, "rel_step")
    if step > 0.1:
        raise ValueError(f"rel_step must lie in (0, 0.1] (the grid's relative spacing), got {step}")
    return _bound(L, d, float(step), check_base(max_base, "max_base"))


def _round_up(x: float) -> float:
    """``x`` rounded up to one significant digit (56,417 -> 60,000)."""
    scale = 10.0 ** math.floor(math.log10(x))
    return math.ceil(x / scale - 1e-12) * scale


def abf_base(target_len: int, head_dim: int, base: float = 10000.0) -> float:
    """The lab's base for ABF (adjusted base frequency, Xiong et al.'s continued pretraining
    with a raised base, :cite:`xiong2023effective`) before a fine-tune at ``target_len``: Men
    et al.'s condition at the target (``B(m) >= 0`` for every distance ``m < target_len``,
    :func:`decay_sum`) decides it. ``base`` itself if it already satisfies the condition;
    otherwise the smallest number with one significant digit (``6e4``, ``2e5``) at or above
    both ``base`` and :func:`base_lower_bound` that satisfies it (the bases that do are not an
    interval, so each candidate is checked).

    Men et al.'s bound at the target length is the scale of the published choices: Llama 2's
    extension to 32K chose 5e5 (the bound at ``d = 128``: 6.3e5), Code Llama's to 16K 1e6
    (2.3e5), Qwen2.5's to 32K 1e6 (6.3e5). For the lab's head (``d = 16``) trained at 128
    bytes with base 1e4, 4x (512 bytes) gives 6e4.

    Raises:
        TypeError, ValueError: as :func:`base_lower_bound`, and ``base`` not a finite number > 1.
    """
    b = check_base(base)
    L = check_positive_int(target_len, "target_len")
    d = _head_dim(head_dim)
    if _first_negative(b, d, L) >= L:  # the base already keeps similar tokens ahead to the target
        return b
    candidate = _round_up(max(b, base_lower_bound(L, d)))
    while _first_negative(candidate, d, L) < L:
        candidate = _round_up(candidate + 10.0 ** math.floor(math.log10(candidate)))
    return candidate


def logn_logit_scale(n: float, train_len: int) -> float:
    """Log-n scaling's factor on the logits of a query that sees ``n`` keys, normalised to the
    training length: ``ln n / ln train_len`` (Chiang and Cholak, 2022).

    Raises:
        TypeError, ValueError: ``n`` not a finite number >= 1, ``train_len`` not an int >= 2.
    """
    n = check_finite_number(n, "n", minimum=1)
    L = check_positive_int(train_len, "train_len", 2)
    return math.log(n) / math.log(L)


def longrope_logit_scale(factor: float, train_len: int) -> float:
    """LongRoPE's attention factor squared, ``1 + ln s / ln L`` (1 for ``s <= 1``): it
    multiplies both queries and keys by ``sqrt(1 + ln s / ln L)`` (HuggingFace's default
    ``attention_factor``), so the logits by this, which is :func:`logn_logit_scale` at ``n = s
    L`` (:cite:`ding2024longrope`).

    Raises:
        TypeError, ValueError: ``factor`` not a finite number > 0, ``train_len`` not an int >= 2.
    """
    s = check_finite_number(factor, "factor")
    L = check_positive_int(train_len, "train_len", 2)
    return 1.0 if s <= 1 else 1.0 + math.log(s) / math.log(L)


def yarn_logit_scale(factor: float) -> float:
    """YaRN's attention factor squared, ``(0.1 ln s + 1) ** 2`` (1 for ``s <= 1``): the factor
    multiplies both queries and keys, so the logits by its square (:cite:`peng2024yarn`).

    Raises:
        TypeError, ValueError: ``factor`` not a finite number > 0.
    """
    return yarn_get_mscale(check_finite_number(factor, "factor")) ** 2


@functools.lru_cache(maxsize=1)
def _recipes_data() -> dict[str, Any]:
    text = resources.files("companion").joinpath("data/long_context_recipes.json").read_text(encoding="utf-8")
    return json.loads(text)


def published_recipes() -> list[dict[str, Any]]:
    """The published long-context recipes, one dict per model or method, with their sources:
    ``model``, ``pretrain_context``, ``target_context``, ``base_before``, ``base_after``,
    ``scaling``, ``finetune_tokens``, ``pretrain_tokens``, ``fraction`` (fine-tune tokens as
    a fraction of pretraining, where both are published), ``sources`` (each ``{"ref",
    "where", "says"}``) and ``notes``. A number that could not be checked against its paper or
    config is ``None``, with the reason in ``unverified``. A copy: editing it changes nothing.
    """
    return json.loads(json.dumps(_recipes_data()["recipes"]))


def local_global_models() -> list[dict[str, Any]]:
    """The local/global layer patterns of today's models, one dict per model family, checked
    against transformers' configuration and modeling code: ``model``, ``layers`` (the pattern),
    ``local`` (window or chunk, RoPE base), ``global`` (position treatment), ``temperature``,
    ``sinks``, ``sources`` and ``notes``. A copy."""
    return json.loads(json.dumps(_recipes_data()["local_global"]))
