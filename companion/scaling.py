"""RoPE context extension: every scaling method, as a config mapped to ``(inv_freq, attention_factor)``.

A RoPE model trained at length ``L`` has seen only the rotation angles ``p * theta_i`` for
``p < L``. Each method below changes the inverse frequencies ``theta_i`` (and sometimes the
magnitude of the cos/sin tables) so that a longer context reuses angles the model knows:

================  ==========================================================================
``rope_type``     what it does to ``theta_i = b ** (-2 i / d)`` (``s`` = ``factor``)
================  ==========================================================================
``default``       nothing (plain RoPE)
``linear``        Position Interpolation: ``theta_i / s`` for every pair
                  (:cite:`chen2023extending`)
``ntk``           NTK-aware base change: ``b' = b * s ** (d / (d - 2))``, so the highest
                  frequency is unchanged and the lowest is divided by exactly ``s``
                  (:cite:`bloc97ntk2023`); not a HuggingFace type
``dynamic``       Dynamic NTK: the NTK base recomputed from the current length ``n``,
                  ``b * (s n / M - (s - 1)) ** (d / (d - 2))`` with ``n = max(n, M)``
``yarn``          NTK-by-parts: pairs that turn fewer than ``beta_slow`` times over the
                  original length are interpolated, pairs that turn more than ``beta_fast``
                  times are kept, a linear ramp in between; plus an attention factor
                  ``0.1 ln s + 1`` on cos and sin (:cite:`peng2024yarn`)
``llama3``        Llama 3.1: wavelengths above ``L / low_freq_factor`` divided by ``s``,
                  below ``L / high_freq_factor`` kept, smoothed in between
``longrope``      per-pair factors found by search, ``short_factor`` up to the original
                  length and ``long_factor`` beyond it, and the attention factor
                  ``sqrt(1 + ln s / ln L)`` (:cite:`ding2024longrope`)
``proportional``  Gemma 4's partial rotary over the whole head: the first
                  ``int(partial_rotary_factor * d // 2)`` pairs keep ``theta_i`` (exponents
                  over ``d = head_dim``, not over the rotated width), the other pairs get
                  frequency 0 (they do not rotate); all divided by ``factor`` (default 1).
                  This is p-RoPE (:cite:`barbero2025round`), see
                  ``companion.rope_variants.PRoPE``
================  ==========================================================================

Conventions are HuggingFace transformers v5's (``modeling_rope_utils.py``), which real
checkpoints' ``config.json`` files are written for; every function reproduces its float32
arithmetic operation for operation, so the frequencies agree bit for bit. The config is a dict
in either spelling: the v5 ``rope_parameters`` form (``{"rope_type": "yarn", "rope_theta":
1e6, "factor": 4.0, ...}``) or the older ``rope_scaling`` form (``"type"`` instead of
``"rope_type"``; ``rope_theta`` was a separate config attribute then, so put it in the dict:
:func:`rope_parameters_from_legacy` is the entry for legacy configs). A scaled config without
``rope_theta`` raises ``ValueError`` rather than computing with HuggingFace's default base 10000:
it is almost always an old ``rope_scaling`` dict whose model kept its base outside it (500000
for Llama 3.1), and 10000 would give every frequency the wrong value.

Where HuggingFace only logs a warning, this module raises ``ValueError`` naming the key: an
unknown type, a missing required key, ``factor < 1``, LongRoPE factor lists of the wrong
length, ``beta_fast < beta_slow``, ``high_freq_factor <= low_freq_factor``. Unknown extra keys
give a :class:`UserWarning`, as HuggingFace's do. Two details differ from HuggingFace on
purpose, both for input HuggingFace itself mishandles: an odd rotary dimension is rejected
(HuggingFace rounds the pair count up), and a dict whose ``type`` and ``rope_type`` disagree is
rejected (HuggingFace silently takes ``rope_type``).

``ntk`` (static NTK-aware) is no HuggingFace type: HuggingFace expresses it as a default RoPE
with ``rope_theta`` set to the enlarged base, which is exactly what this module computes.
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ._checks import check_base, check_bool, check_finite_number, check_positive_int

__all__ = [
    "ROPE_TYPES",
    "ROPE_SCALING_FUNCTIONS",
    "DYNAMIC_TYPES",
    "DEFAULT_THETA",
    "RopeSpec",
    "parse_rope_config",
    "rope_parameters_from_legacy",
    "compute_inv_freq",
    "yarn_get_mscale",
    "yarn_correction_range",
    "ntk_base",
    "dynamic_ntk_base",
    "llama_cpp_rope_args",
    "proportional_rope_angles",
]

#: HuggingFace's default RoPE base, used (with a warning) when a plain ``rope_type="default"``
#: config has no ``rope_theta`` (a scaled config without one is an error).
DEFAULT_THETA = 10000.0

# Keys each type requires and accepts (besides "rope_type"/"type", "rope_theta" and
# "partial_rotary_factor", which every type accepts). HuggingFace v5's validation lists.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "ntk": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "proportional": (),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": (),
    "ntk": (),
    "dynamic": (),
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "llama3": (),
    "longrope": ("attention_factor", "factor"),
    "proportional": ("factor",),
}
_COMMON = ("rope_type", "type", "rope_theta", "partial_rotary_factor")

#: Every ``rope_type`` this module computes, in the chapter's order.
ROPE_TYPES: tuple[str, ...] = tuple(_REQUIRED)

#: Types whose frequencies depend on the current sequence length (recomputed as it changes).
DYNAMIC_TYPES: tuple[str, ...] = ("dynamic", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """A validated config (from :func:`parse_rope_config`).

    ``params`` is the normalised v5 ``rope_parameters`` dict (``rope_type`` and ``rope_theta``
    always present, ``original_max_position_embeddings`` filled in where the type uses it);
    ``dim`` is the rotary dimension ``int(head_dim * partial_rotary_factor)`` (for
    ``proportional``, ``head_dim``: its rotation covers the whole head, with zero frequencies);
    ``max_position_embeddings`` is the model's (``None`` if not given).
    """

    rope_type: str
    theta: float
    dim: int
    max_position_embeddings: int | None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def is_dynamic(self) -> bool:
        """Whether the frequencies depend on the current sequence length."""
        return self.rope_type in DYNAMIC_TYPES


# ----------------------------------------------------------------------------- parsing


def _number(params: Mapping[str, Any], key: str, *, minimum: float | None = None, above: float | None = None,
            where: str = "rope_config") -> float:
    """``params[key]`` as a float, checked by :func:`check_finite_number`; the message names
    ``where[key]``, the value and its type, and the range. ``key == "rope_theta"`` is a base
    (:func:`check_base`, > 1)."""
    value, name = params[key], f"{where}[{key!r}]"
    try:
        if key == "rope_theta":
            return check_base(value, name)
        return check_finite_number(value, name, minimum=minimum, above=above)
    except TypeError as exc:  # a string or None where a number belongs: a bad config, so ValueError
        raise ValueError(str(exc)) from None


def _length(params: Mapping[str, Any], key: str) -> int:
    value = params[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON writers sometimes store 4096 as 4096.0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"rope_config[{key!r}] must be a positive int, got {value!r}")
    try:
        return check_positive_int(int(value), f"rope_config[{key!r}]")
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _factor_list(params: Mapping[str, Any], key: str, pairs: int) -> list[float]:
    value = params[key]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ValueError(f"rope_config[{key!r}] must be a list of {pairs} numbers, got {type(value).__name__}")
    values = list(value.tolist() if isinstance(value, Tensor) else value)
    if len(values) != pairs:
        raise ValueError(
            f"rope_config[{key!r}] must have length rotary_dim / 2 = {pairs} (one factor per rotated "
            f"pair), got {len(values)}"
        )
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"rope_config[{key!r}][{i}] must be a finite number > 0, got {v!r}")
    return [float(v) for v in values]


def _rotary_dim(head_dim: object, partial_rotary_factor: object) -> int:
    check_positive_int(head_dim, "head_dim", minimum=2)
    prf = check_finite_number(partial_rotary_factor, "partial_rotary_factor")
    if prf > 1:
        raise ValueError(f"partial_rotary_factor must lie in (0, 1], got {partial_rotary_factor!r}")
    dim = int(head_dim * prf)  # type: ignore[operator]
    if dim < 2 or dim % 2:
        raise ValueError(
            f"the rotary dimension int(head_dim * partial_rotary_factor) = int({head_dim} * {prf:g}) = {dim} "
            f"must be an even int >= 2 (coordinates are rotated in pairs)"
        )
    return dim


def _proportional_dim(head_dim: object, partial_rotary_factor: object) -> int:
    """``proportional`` rotates the whole head: ``head_dim`` must be even, the factor in [0, 1].

    ``0`` is allowed, as in HuggingFace: no pair rotates (every frequency is 0), which is
    p-RoPE with ``p = 0`` (:class:`companion.rope_variants.PRoPE`), i.e. NoPE."""
    check_positive_int(head_dim, "head_dim", minimum=2)
    if head_dim % 2:  # type: ignore[operator]
        raise ValueError(
            f"head_dim must be even for rope_type='proportional' (its rotation covers the whole head, "
            f"in pairs), got {head_dim}"
        )
    prf = check_finite_number(partial_rotary_factor, "partial_rotary_factor", minimum=0.0)
    if prf > 1:
        raise ValueError(
            f"partial_rotary_factor must lie in [0, 1] for rope_type='proportional', got {partial_rotary_factor!r}"
        )
    return head_dim  # type: ignore[return-value]


def rope_parameters_from_legacy(rope_scaling: Mapping[str, Any] | None, rope_theta: float | None = None) -> dict[str, Any]:
    """Convert an old ``rope_scaling`` dict (transformers < 5) to the v5 ``rope_parameters`` form.

    In the old form the type was under ``"type"`` (later ``"rope_type"``) and ``rope_theta``
    was a separate attribute of the model config; v5 moves ``rope_theta`` inside the dict.
    ``rope_scaling=None`` (no scaling) gives ``{"rope_type": "default", "rope_theta": ...}``.
    A ``rope_theta`` already in the dict must agree with the argument.

    This is the one entry for a legacy config: pass the model config's ``rope_theta`` with
    its ``rope_scaling``, ``rope_parameters_from_legacy(config["rope_scaling"],
    config["rope_theta"])``. The old dict alone has no base, and :func:`compute_inv_freq`
    refuses a scaled config without one.

    Raises:
        TypeError: ``rope_scaling`` is not a dict or ``None``, or ``rope_theta`` not a number.
        ValueError: ``type`` and ``rope_type`` disagree, ``rope_theta`` is not a finite number
            > 1, or the dict holds another ``rope_theta``.
    """
    if rope_scaling is not None and not isinstance(rope_scaling, Mapping):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    out = dict(rope_scaling or {})
    legacy = out.pop("type", None)
    if legacy is not None:
        if out.get("rope_type", legacy) != legacy:
            raise ValueError(f"rope_scaling has type={legacy!r} and rope_type={out['rope_type']!r}; they must agree")
        out["rope_type"] = legacy
    out.setdefault("rope_type", "default")
    if rope_theta is not None:
        theta = check_base(rope_theta, "rope_theta")
        if "rope_theta" in out and _number(out, "rope_theta", where="rope_scaling") != theta:
            raise ValueError(f"rope_scaling holds rope_theta={out['rope_theta']!r} but rope_theta={rope_theta!r} was passed")
        out["rope_theta"] = rope_theta
    return {"rope_type": out.pop("rope_type"), **out}


def parse_rope_config(
    rope_config: Mapping[str, Any] | None, head_dim: int, *, max_position_embeddings: int | None = None,
    partial_rotary_factor: float = 1.0,
) -> RopeSpec:
    """Validate a config in either spelling and normalise it (see the module doc).

    ``None`` means plain RoPE with HuggingFace's default base. A ``rope_type="default"`` config
    without ``rope_theta`` falls back to :data:`DEFAULT_THETA` with a warning; a scaled one
    (any other type) raises ``ValueError``: in the old ``rope_scaling`` form the base lived
    outside the dict, and 10000 would silently give a Llama 3.1 config (base 500000) wrong
    frequencies. Convert legacy configs with :func:`rope_parameters_from_legacy`. A missing
    ``original_max_position_embeddings`` falls back to ``max_position_embeddings``, as in
    HuggingFace; a missing ``factor`` of YaRN or LongRoPE is ``max_position_embeddings /
    original_max_position_embeddings``. ``partial_rotary_factor`` may be given here or in the
    dict (v5 keeps it there), not both with different values.

    Raises:
        TypeError: ``rope_config`` is not a dict.
        ValueError: an unknown type, a missing or bad key (named), a scaled config without
            ``rope_theta``, or a bad rotary dimension.
    """
    if rope_config is None:
        rope_config = {"rope_type": "default", "rope_theta": DEFAULT_THETA}
    if not isinstance(rope_config, Mapping):
        raise TypeError(f"rope_config must be a dict (HuggingFace's rope_parameters or rope_scaling), got {type(rope_config).__name__}")
    params: dict[str, Any] = copy.deepcopy(dict(rope_config))
    legacy = params.pop("type", None)
    rope_type = params.get("rope_type", legacy if legacy is not None else "default")
    if legacy is not None and rope_type != legacy:
        raise ValueError(f"rope_config has type={legacy!r} and rope_type={rope_type!r}; they must agree (v5 uses rope_type)")
    if not isinstance(rope_type, str) or rope_type not in _REQUIRED:
        raise ValueError(f"rope_config['rope_type'] must be one of {list(ROPE_TYPES)}, got {rope_type!r}")
    params["rope_type"] = rope_type

    if max_position_embeddings is not None:
        check_positive_int(max_position_embeddings, "max_position_embeddings")
    # proportional allows 0 (no pair rotates, as in HuggingFace); other types need a rotary dim >= 2
    least = 0.0 if rope_type == "proportional" else None
    partial_rotary_factor = check_finite_number(partial_rotary_factor, "partial_rotary_factor", minimum=least)
    if "partial_rotary_factor" in params:
        in_dict = _number(params, "partial_rotary_factor", minimum=least)
        if partial_rotary_factor != 1.0 and float(partial_rotary_factor) != in_dict:
            raise ValueError(
                f"partial_rotary_factor={partial_rotary_factor!r} disagrees with "
                f"rope_config['partial_rotary_factor']={params['partial_rotary_factor']!r}"
            )
        partial_rotary_factor = in_dict
    if rope_type == "proportional":
        dim = _proportional_dim(head_dim, partial_rotary_factor)
    else:
        dim = _rotary_dim(head_dim, partial_rotary_factor)
    if float(partial_rotary_factor) != 1.0:
        params["partial_rotary_factor"] = float(partial_rotary_factor)  # v5 keeps it in the dict
    if rope_type in ("ntk", "dynamic") and dim < 4:
        raise ValueError(
            f"rope_type={rope_type!r} needs a rotary dimension of at least 4 (its base is b * s ** (d / (d - 2))), "
            f"got int(head_dim * partial_rotary_factor) = {dim}"
        )

    if "rope_theta" not in params and rope_type != "default":
        raise ValueError(
            f"rope_config has rope_type={rope_type!r} but no 'rope_theta' (the RoPE base); HuggingFace's "
            f"default {DEFAULT_THETA:g} would be used, which is wrong for most scaled models (Llama 3.1's "
            f"base is 500000): a scaled dict without its base is usually an old rope_scaling dict, whose "
            f"model config kept rope_theta outside it. Convert it with "
            f"companion.scaling.rope_parameters_from_legacy(config['rope_scaling'], config['rope_theta']), "
            f"or put 'rope_theta' in the dict ({DEFAULT_THETA:g} if the model really uses that base)")
    if "rope_theta" not in params:
        warnings.warn(
            f"rope_config has no 'rope_theta'; using HuggingFace's default {DEFAULT_THETA:g}. In the old "
            f"rope_scaling form rope_theta was a separate config attribute: pass it inside the dict "
            f"(companion.scaling.rope_parameters_from_legacy)", UserWarning, stacklevel=2)
        params["rope_theta"] = DEFAULT_THETA
    theta = _number(params, "rope_theta")

    known = set(_COMMON) | set(_REQUIRED[rope_type]) | set(_OPTIONAL[rope_type])
    unknown = sorted(set(params) - known)
    if unknown:
        warnings.warn(f"rope_config for rope_type={rope_type!r} has unrecognised keys {unknown}; they are ignored",
                      UserWarning, stacklevel=2)

    uses_original = "original_max_position_embeddings" in _REQUIRED[rope_type]
    if uses_original and params.get("original_max_position_embeddings") is None:
        if max_position_embeddings is None:
            raise ValueError(
                f"rope_config for rope_type={rope_type!r} needs 'original_max_position_embeddings' (the "
                f"pretraining length), or pass max_position_embeddings to default it"
            )
        params["original_max_position_embeddings"] = max_position_embeddings
    if uses_original:
        params["original_max_position_embeddings"] = _length(params, "original_max_position_embeddings")

    derivable = rope_type in ("yarn", "longrope")
    if params.get("factor") is None and ("factor" in _REQUIRED[rope_type] or derivable):
        if derivable and max_position_embeddings is not None:
            derived = max_position_embeddings / params["original_max_position_embeddings"]
            if derived < 1:
                raise ValueError(
                    f"rope_config has no 'factor', and the one derived from the lengths, max_position_embeddings / "
                    f"original_max_position_embeddings = {max_position_embeddings} / "
                    f"{params['original_max_position_embeddings']}, is below 1; give 'factor' (>= 1)"
                )
            params["factor"] = derived
        elif derivable:
            raise ValueError(
                f"rope_config for rope_type={rope_type!r} needs 'factor', or max_position_embeddings to derive "
                f"it as max_position_embeddings / original_max_position_embeddings"
            )
        else:
            raise ValueError(f"rope_config for rope_type={rope_type!r} needs the key 'factor' (the scale s >= 1)")
    missing = [key for key in _REQUIRED[rope_type] if params.get(key) is None]
    if missing:
        raise ValueError(f"rope_config for rope_type={rope_type!r} is missing the required key(s) {missing}")
    if "factor" in params and params["factor"] is not None:
        _number(params, "factor", minimum=1.0)

    if rope_type == "dynamic" and max_position_embeddings is None:
        raise ValueError("rope_type='dynamic' needs max_position_embeddings (the length the model was trained at)")
    if rope_type == "yarn":
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if params.get(key) is not None:
                _number(params, key, minimum=0.0)
        if (params.get("beta_fast") or 32) < (params.get("beta_slow") or 1):
            raise ValueError(
                f"rope_config['beta_fast'] must be >= rope_config['beta_slow'] (defaults 32 and 1), got "
                f"{params.get('beta_fast')!r} and {params.get('beta_slow')!r}"
            )
        if "truncate" in params and not isinstance(params["truncate"], bool):
            raise ValueError(f"rope_config['truncate'] must be a bool, got {params['truncate']!r}")
    if rope_type in ("yarn", "longrope") and params.get("attention_factor") is not None:
        _number(params, "attention_factor")
    if rope_type == "llama3":
        low, high = _number(params, "low_freq_factor"), _number(params, "high_freq_factor")
        if high <= low:
            raise ValueError(
                f"rope_config['high_freq_factor'] must be > rope_config['low_freq_factor'], got {high:g} and {low:g}"
            )
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            params[key] = _factor_list(params, key, dim // 2)
    return RopeSpec(rope_type, theta, dim, max_position_embeddings, params)


# ----------------------------------------------------------------------------- the methods
#
# Each function reproduces HuggingFace's float32 arithmetic operation for operation (the same
# operations on the same dtypes in the same order), so that the frequencies agree bit for bit.


def _exponents(dim: int) -> Tensor:
    """``2 i / d`` for ``i = 0 .. d/2 - 1``, in float32."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _plain(base: float | Tensor, dim: int) -> Tensor:
    return 1.0 / (base ** _exponents(dim))


def _check_ntk_dim(dim: object) -> int:
    """``dim`` of the NTK bases: an even int >= 4 (the exponent ``d / (d - 2)`` divides by
    ``d - 2``, and a rotary dimension is even: coordinates are rotated in pairs)."""
    check_positive_int(dim, "dim", minimum=4)
    if dim % 2:  # type: ignore[operator]
        raise ValueError(f"dim must be an even int >= 4 (the rotary dimension; coordinates are rotated in pairs), got {dim}")
    return dim  # type: ignore[return-value]


def _check_rotary_dim(dim: object, name: str = "dim") -> int:
    """An even int >= 2 (a rotary dimension: coordinates are rotated in pairs)."""
    check_positive_int(dim, name, minimum=2)
    if dim % 2:  # type: ignore[operator]
        raise ValueError(f"{name} must be an even int >= 2 (coordinates are rotated in pairs), got {dim}")
    return dim  # type: ignore[return-value]


def ntk_base(base: float, factor: float, dim: int) -> float:
    """The NTK-aware base ``b * s ** (d / (d - 2))`` (see the chapter for the derivation).

    It keeps ``theta_0 = 1`` and divides the lowest frequency ``theta_{d/2-1}`` by exactly ``s``.
    ``base`` is a finite number > 1 (:func:`companion._checks.check_base`).

    Raises:
        TypeError: ``base`` or ``factor`` is not a real number (a string, a bool, ``None``), or
            ``dim`` is not an int (a float such as ``8.0``, a bool).
        ValueError: ``base`` is not finite and > 1, ``factor`` is not finite and >= 1, or
            ``dim`` is not an even int >= 4 (the exponent divides by ``d - 2``).
    """
    check_base(base)
    check_finite_number(factor, "factor", minimum=1.0)
    _check_ntk_dim(dim)
    return base * factor ** (dim / (dim - 2))


def _check_dynamic_seq_len(seq_len: object) -> int | Tensor:
    """``seq_len`` of :func:`dynamic_ntk_base`: an int >= 0 or a 0-d integer tensor >= 0."""
    if isinstance(seq_len, Tensor):
        if seq_len.dtype.is_floating_point or seq_len.dtype.is_complex or seq_len.dtype == torch.bool:
            raise TypeError(
                f"seq_len must be an int or a 0-d integer tensor (a length: max(position) + 1), got a "
                f"{seq_len.dtype} tensor"
            )
        if seq_len.dim() != 0:
            raise ValueError(f"seq_len must be an int or a 0-d integer tensor, got a tensor of shape {tuple(seq_len.shape)}")
        if int(seq_len) < 0:
            raise ValueError(f"seq_len must be >= 0, got {int(seq_len)}")
        return seq_len
    if isinstance(seq_len, numbers.Integral) and not isinstance(seq_len, bool):
        seq_len = int(seq_len)
    return check_positive_int(seq_len, "seq_len", minimum=0)


def dynamic_ntk_base(base: float, factor: float, dim: int, seq_len: int | Tensor, max_position_embeddings: int) -> float | Tensor:
    """Dynamic NTK's base at the current length: ``b * (s n / M - (s - 1)) ** (d / (d - 2))``, ``n = max(seq_len, M)``.

    At ``n <= M`` this is ``b`` (plain RoPE). Note that at ``n = s M`` the effective NTK scale is
    ``s**2 - s + 1``, not ``s``: ``factor`` here is a rate, not the target extension.
    A 0-d integer tensor ``seq_len`` (what HuggingFace's forward pass passes) is computed with
    tensor arithmetic, in float32, as HuggingFace does. ``base`` is a finite number > 1.

    Raises:
        TypeError: ``base`` or ``factor`` is not a real number, ``dim`` or
            ``max_position_embeddings`` is not an int, or ``seq_len`` is neither an int nor an
            integer tensor (a float, a string, a float tensor).
        ValueError: ``base`` is not finite and > 1, ``factor`` not finite and >= 1, ``dim`` not
            an even int >= 4, ``max_position_embeddings`` < 1, ``seq_len`` < 0 or a tensor that
            is not 0-d.
    """
    check_base(base)
    check_finite_number(factor, "factor", minimum=1.0)
    _check_ntk_dim(dim)
    check_positive_int(max_position_embeddings, "max_position_embeddings")
    seq_len = _check_dynamic_seq_len(seq_len)
    if isinstance(seq_len, Tensor):
        n = torch.maximum(seq_len, torch.tensor(max_position_embeddings, dtype=seq_len.dtype, device=seq_len.device))
    else:
        n = max(seq_len, max_position_embeddings)
    return base * ((factor * n / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``).

    Raises:
        TypeError: ``scale`` or ``mscale`` is not a real number (a string, a bool, ``None``).
        ValueError: ``scale`` is not finite and > 0, or ``mscale`` not finite and >= 0.
    """
    check_finite_number(scale, "scale")
    check_finite_number(mscale, "mscale", minimum=0.0)
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original_max_position_embeddings: int,
                          truncate: bool = True) -> tuple[float, float]:
    """The pair indices ``(low, high)`` between which YaRN's ramp runs.

    Pair ``i`` turns ``L / (2 pi) * theta_i`` times over the original length ``L``; the index at
    which it turns ``r`` times is ``d ln(L / (2 pi r)) / (2 ln b)``. ``low`` is that index for
    ``beta_fast`` rotations and ``high`` for ``beta_slow``; with ``truncate`` they are floored and
    ceiled; then clamped to ``[0, d - 1]`` (HuggingFace's and YaRN's bound, ``d``, not ``d/2``).
    ``base`` is a finite number > 1 (at 1 the index divides by ``ln b = 0``).

    Raises:
        TypeError: a beta or ``base`` is not a real number, ``dim`` or
            ``original_max_position_embeddings`` is not an int, ``truncate`` is not a bool.
        ValueError: a beta is not finite and > 0, ``beta_fast < beta_slow`` (equal is allowed:
            the ramp then has width 0), ``dim`` is not an even int >= 2, ``base`` is not finite
            and > 1, or ``original_max_position_embeddings`` < 1.
    """
    check_finite_number(beta_fast, "beta_fast")
    check_finite_number(beta_slow, "beta_slow")
    if beta_fast < beta_slow:
        raise ValueError(
            f"beta_fast must be >= beta_slow (the ramp runs from beta_fast rotations down to beta_slow), got "
            f"beta_fast={beta_fast!r} and beta_slow={beta_slow!r}"
        )
    _check_rotary_dim(dim)
    check_base(base)
    check_positive_int(original_max_position_embeddings, "original_max_position_embeddings")
    check_bool(truncate, "truncate")

    def index(rotations: float) -> float:
        return (dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = index(beta_fast), index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _default(spec: RopeSpec, seq_len: int | Tensor | None) -> tuple[Tensor, float]:
    return _plain(spec.theta, spec.dim), 1.0


def _linear(spec: RopeSpec, seq_len: int | Tensor | None) -> tuple[Tensor, float]:
    inv_freq = _plain(spec.theta, spec.dim)
    inv_freq /= spec.params["factor"]
    return inv_freq, 1.0


def _ntk(spec: RopeSpec, seq_len: int | Tensor | None) -> tuple[Tensor, float]:
    return _plain(ntk_base(spec.theta, spec.params["factor"], spec.dim), spec.dim), 1.0


def _dynamic(spec: RopeSpec, seq_len: int | Tensor | None) -> tuple[Tensor, float]:
    m = spec.max_position_embeddings
    assert m is not None  # parse_rope_config requires it
    n = m if seq_len is None else seq_len
    return _plain(dynamic_ntk_base(spec.theta, spec.params["factor"], spec.dim, n, m), spec.dim), 1.0


def _yarn(spec: RopeSpec, seq_len: int | Tensor | None) -> tuple[Tensor, float]:
    p, dim, base = spec.params, spec.dim, spec.theta
    factor = p["factor"]
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek's form: 1.0 exactly when the two are equal
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    low, high = yarn_correction_range(p.get("beta_fast") or 32, p.get("beta_slow") or 1, dim, base,
                                      p["original_max_position_embeddings"], p.get("truncate", True))
    wavelength_scale = base ** _exponents(dim)  # 1 / theta_i
    keep = 1.0 / wavelength_scale  # extrapolation: the original frequencies
    squeeze = 1.0 / (factor * wavelength_scale)  # interpolation: divided by s
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the weight of the original frequency: 1 below low, 0 above high
    return squeeze * (1 - kept) + keep * kept, float(attention_factor)


def _llama3(spec: RopeSpec, seq_len: int | Tensor | None) -> tuple[Tensor, float]:
    p = spec.params
    factor, low_ff, high_ff = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    context = p["original_max_position_embeddings"]
    inv_freq = _plain(spec.theta, spec.dim)
    wavelen = 2 * math.pi / inv_freq
    long_wave, short_wave = context / low_ff, context / high_ff
    # Longer than context / low_freq_factor: interpolate by s. Shorter than context /
    # high_freq_factor: keep. Between the two, boundaries included: blend by the rotation count.
    scaled = torch.where(wavelen > long_wave, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < short_wave) & ~(wavelen > long_wave)
    return torch.where(in_band, blended, scaled), 1.0


def _longrope(spec: RopeSpec, seq_len: int | Tensor | None) -> tuple[Tensor, float]:
    p = spec.params
    original = p["original_max_position_embeddings"]
    factor = p["factor"]
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = bool(seq_len) and seq_len > original  # type: ignore[operator]
    ext = torch.tensor(p["long_factor"] if long else p["short_factor"], dtype=torch.float32)
    return 1.0 / (ext * spec.theta ** _exponents(spec.dim)), float(attention_factor)


def proportional_rope_angles(head_dim: int, partial_rotary_factor: float) -> int:
    """The number of rotating pairs of ``proportional`` RoPE: ``int(partial_rotary_factor * head_dim // 2)``.

    HuggingFace's expression, float arithmetic included (``0.58 * 100 // 2`` is 28, since
    ``0.58 * 100`` is ``57.99999999999999`` in floating point), which is also the pseudocode of
    p-RoPE (:cite:`barbero2025round`, ``rope_angles = int(rope_percentage * head_dim // 2)``).

    Raises:
        TypeError: ``head_dim`` is not an int, or ``partial_rotary_factor`` not a real number.
        ValueError: ``head_dim`` is not an even int >= 2 (the rotation covers the whole head, in
            pairs), or ``partial_rotary_factor`` is not a finite number in [0, 1].
    """
    _check_rotary_dim(head_dim, "head_dim")
    check_finite_number(partial_rotary_factor, "partial_rotary_factor", minimum=0.0)
    if partial_rotary_factor > 1:
        raise ValueError(f"partial_rotary_factor must lie in [0, 1], got {partial_rotary_factor!r}")
    return int(partial_rotary_factor * head_dim // 2)


def _proportional(spec: RopeSpec, seq_len: int | Tensor | None) -> tuple[Tensor, float]:
    # transformers v5, modeling_rope_utils.py, _compute_proportional_rope_parameters (Gemma 4),
    # read in a copy of the v5 source: rope_angles = int(partial_rotary_factor * head_dim // 2);
    # inv_freq_rotated = 1 / base ** (arange(0, 2 * rope_angles, 2) / head_dim) (denominator
    # head_dim, not the rotated width); then head_dim // 2 - rope_angles zeros; all divided by
    # factor = rope_parameters.get("factor", 1.0); attention factor 1.0. Same float32 operations.
    p, head_dim = spec.params, spec.dim
    rope_angles = proportional_rope_angles(head_dim, p.get("partial_rotary_factor", 1.0))
    exponents = torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (spec.theta ** exponents)
    nope_angles = head_dim // 2 - rope_angles
    if nope_angles > 0:
        inv_freq = torch.cat((inv_freq, torch.zeros(nope_angles, dtype=torch.float32)))
    factor = p.get("factor")
    inv_freq /= 1.0 if factor is None else factor
    return inv_freq, 1.0


#: One function per method, keyed by ``rope_type``, each mapping ``(spec, seq_len)`` to
#: ``(inv_freq, attention_factor)``; HuggingFace's ``ROPE_INIT_FUNCTIONS`` plays the same role.
ROPE_SCALING_FUNCTIONS: dict[str, Callable[[RopeSpec, int | Tensor | None], tuple[Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "ntk": _ntk,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
    "proportional": _proportional,
}
assert tuple(ROPE_SCALING_FUNCTIONS) == ROPE_TYPES


def _check_seq_len(seq_len: object) -> int | Tensor | None:
    if seq_len is None:
        return None
    if isinstance(seq_len, Tensor):
        if seq_len.dim() != 0 or seq_len.dtype.is_floating_point or seq_len.dtype.is_complex or seq_len.dtype == torch.bool:
            raise ValueError(f"seq_len must be an int or a 0-d integer tensor, got a {seq_len.dtype} tensor of shape {tuple(seq_len.shape)}")
        if int(seq_len) < 1:
            raise ValueError(f"seq_len must be >= 1, got {int(seq_len)}")
        return seq_len.cpu()
    if isinstance(seq_len, numbers.Integral) and not isinstance(seq_len, bool):
        seq_len = int(seq_len)
    return check_positive_int(seq_len, "seq_len")


def compute_inv_freq(rope_config: dict, head_dim: int, *,
    max_position_embeddings: int | None = None, seq_len: int | None = None,
    partial_rotary_factor: float = 1.0) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor of a RoPE scaling config, as HuggingFace v5 computes them.

    Args:
        rope_config: a ``rope_parameters`` (v5) or ``rope_scaling`` dict; see the module doc
            for the types and :func:`parse_rope_config` for the defaults.
        head_dim: the per-head dimension; ``int(head_dim * partial_rotary_factor)`` is rotated.
        max_position_embeddings: the model's ``config.max_position_embeddings``. Dynamic NTK
            needs it (its reference length); YaRN, Llama-3 and LongRoPE default
            ``original_max_position_embeddings`` to it, and YaRN and LongRoPE derive a missing
            ``factor`` from the two.
        seq_len: the current sequence length (``max(position) + 1``). Dynamic NTK uses
            ``max(seq_len, max_position_embeddings)`` (``None``: the latter, plain RoPE);
            LongRoPE takes its long factors when ``seq_len > original_max_position_embeddings``
            and its short ones otherwise (``None`` included). The other types ignore it. A 0-d
            integer tensor is computed in tensor arithmetic, as HuggingFace's forward pass does.
        partial_rotary_factor: the rotated fraction of ``head_dim`` (or put it in the dict).

    Returns:
        ``(inv_freq, attention_factor)``: float32 ``(rotary_dim // 2,)`` on the CPU
        (``(head_dim // 2,)`` for ``proportional``, whose last pairs have frequency 0), and the
        factor that multiplies both cos and sin tables (1.0 except for YaRN and LongRoPE).

    Raises:
        TypeError: ``rope_config`` is not a dict.
        ValueError: as :func:`parse_rope_config`; a scaled config without ``rope_theta``
            (an old ``rope_scaling`` dict: convert it with :func:`rope_parameters_from_legacy`,
            passing the model's ``rope_theta``), or a bad ``seq_len``.
    """
    spec = parse_rope_config(rope_config, head_dim, max_position_embeddings=max_position_embeddings,
                             partial_rotary_factor=partial_rotary_factor)
    return ROPE_SCALING_FUNCTIONS[spec.rope_type](spec, _check_seq_len(seq_len))


def spec_inv_freq(spec: RopeSpec, seq_len: int | Tensor | None = None) -> tuple[Tensor, float]:
    """:func:`compute_inv_freq` for an already parsed :class:`RopeSpec` (no re-validation)."""
    return ROPE_SCALING_FUNCTIONS[spec.rope_type](spec, _check_seq_len(seq_len))


# ----------------------------------------------------------------------------- llama.cpp


def llama_cpp_rope_args(rope_config: Mapping[str, Any], head_dim: int, *, max_position_embeddings: int | None = None,
                        partial_rotary_factor: float = 1.0) -> dict[str, Any]:
    """The llama.cpp command-line options that express the same RoPE as a HuggingFace config.

    llama.cpp names things differently (``common/arg.cpp``, ``ggml_rope_ext``):

    * ``--rope-freq-base`` is ``rope_theta`` (for static NTK, the enlarged base);
    * ``--rope-freq-scale`` is ``1 / factor`` (a multiplier on positions, not a divisor);
    * ``--rope-scaling`` is ``none``, ``linear`` or ``yarn``;
    * YaRN's ``--yarn-orig-ctx``, ``--yarn-beta-fast`` and ``--yarn-beta-slow`` are HF's
      ``original_max_position_embeddings``, ``beta_fast`` and ``beta_slow``;
      ``--yarn-ext-factor`` (1.0 for YaRN) weighs the ramp, 0 turning YaRN into plain PI;
      ``--yarn-attn-factor`` *multiplies* llama.cpp's own ``1 + 0.1 ln s``, so HF's
      ``attention_factor`` ``a`` corresponds to ``a / (1 + 0.1 ln s)``. llama.cpp always
      truncates the correction range, as HF's default ``truncate=True`` does.
    * Llama-3 and LongRoPE have no option: the converter to GGUF stores per-pair divisors in a
      ``rope_freqs`` tensor for Llama-3 (``inv_freq = theta_i / rope_freqs[i]``, returned
      under ``"rope_freqs"``) and two, ``rope_factors_short`` and ``rope_factors_long``, for
      LongRoPE, whose attention factor goes in the GGUF key ``rope.scaling.attn_factor``.
      Dynamic NTK has no llama.cpp equivalent: the function returns ``None``; nor has
      ``proportional`` here (its zero frequencies have no option): ``None`` too.
    """
    spec = parse_rope_config(rope_config, head_dim, max_position_embeddings=max_position_embeddings,
                             partial_rotary_factor=partial_rotary_factor)
    p, t = spec.params, spec.rope_type
    if t == "default":
        return {"--rope-scaling": "none", "--rope-freq-base": spec.theta}
    if t == "linear":
        return {"--rope-scaling": "linear", "--rope-freq-base": spec.theta, "--rope-freq-scale": 1.0 / p["factor"]}
    if t == "ntk":
        return {"--rope-scaling": "none", "--rope-freq-base": ntk_base(spec.theta, p["factor"], spec.dim)}
    if t in ("dynamic", "proportional"):
        return None  # type: ignore[return-value]
    if t == "yarn":
        inv_freq, attention = _yarn(spec, None)
        return {
            "--rope-scaling": "yarn", "--rope-freq-base": spec.theta, "--rope-freq-scale": 1.0 / p["factor"],
            "--yarn-orig-ctx": p["original_max_position_embeddings"], "--yarn-ext-factor": 1.0,
            "--yarn-beta-fast": float(p.get("beta_fast") or 32), "--yarn-beta-slow": float(p.get("beta_slow") or 1),
            "--yarn-attn-factor": attention / yarn_get_mscale(p["factor"]),
        }
    if t == "llama3":
        inv_freq, _ = _llama3(spec, None)
        return {"--rope-scaling": "none", "--rope-freq-base": spec.theta,
                "rope_freqs": (_plain(spec.theta, spec.dim) / inv_freq).tolist()}
    _, attention = _longrope(spec, None)
    return {"--rope-scaling": "none", "--rope-freq-base": spec.theta,
            "rope_factors_short": list(p["short_factor"]), "rope_factors_long": list(p["long_factor"]),
            "--yarn-orig-ctx": p["original_max_position_embeddings"], "rope.scaling.attn_factor": attention}
