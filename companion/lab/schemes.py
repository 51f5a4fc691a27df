"""The schemes the lab trains, by name, and how to bring your own.

A lab scheme is built from the model's shape by a factory; :func:`build_scheme` takes either
a built-in name from :data:`BUILTIN` or ``"package.module:ClassName"``, the import path of a
user's own :class:`~companion.attention.PositionScheme` subclass. A user's class is called with
those of the following keyword arguments its constructor names (and nothing else):

==============  ==============================================================================
``d_model``     the model width (what an ``embed`` scheme adds to)
``n_heads``     the number of attention heads (per-head state: slopes, tables)
``head_dim``    ``d_model // n_heads`` (what a ``rotate`` or ``score`` scheme acts on)
``max_len``     the longest sequence the experiment will evaluate (a table's size)
``train_len``   the training length
==============  ==============================================================================

so ``python -m companion.lab sweep --schemes rope alibi mypkg.enc:MyScheme`` trains and
evaluates a new encoding beside the baselines with no other code.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable

from .._checks import check_positive_int
from ..absolute import LearnedPositionalEmbedding, ScaledSinusoidalEmbedding
from ..alibi import ALiBi
from ..attention import NoPE, PositionScheme
from ..cope import CoPE
from ..learned_bias import FIRE, KerpleBias
from ..rope_variants import PRoPE, XPos
from ..model import nope_every
from ..relative import ShawRelative, T5RelativeBias, TransformerXL
from ..rope import RotaryEmbedding

__all__ = ["BUILTIN", "LABELS", "NOPE_LAYERS", "SchemeShape", "build_scheme", "nope_layers_for", "scheme_label"]

#: The rms per dimension of the added sinusoids at initialisation. A sinusoidal table has rms
#: ``sqrt(1/2)`` per dimension, which would swamp token embeddings initialised at 0.02;
#: scaled down to about the embeddings' size, the model can still raise the learned gain.
SINUSOID_RMS = 0.02


class SchemeShape(dict):
    """The keyword arguments a scheme factory may use (a ``dict`` with the keys above)."""


def _nope(s: SchemeShape) -> PositionScheme:
    return NoPE()


def _sinusoidal(s: SchemeShape) -> PositionScheme:
    return ScaledSinusoidalEmbedding(s["d_model"], init_scale=SINUSOID_RMS * math.sqrt(2.0))


def _learned(s: SchemeShape) -> PositionScheme:
    # Rows up to max_len exist so that long evaluations run; rows past the training length
    # are never trained and keep their N(0, 0.02) start.
    return LearnedPositionalEmbedding(s["max_len"], s["d_model"])


def _shaw(s: SchemeShape) -> PositionScheme:
    return ShawRelative(s["head_dim"], max_distance=16)


def _xl(s: SchemeShape) -> PositionScheme:
    return TransformerXL(s["n_heads"], s["head_dim"])


def _t5(s: SchemeShape) -> PositionScheme:
    return T5RelativeBias(s["n_heads"], num_buckets=32, max_distance=128, bidirectional=False)


def _rope(s: SchemeShape) -> PositionScheme:
    return RotaryEmbedding(s["head_dim"])


def _alibi(s: SchemeShape) -> PositionScheme:
    return ALiBi(s["n_heads"])


def _xpos(s: SchemeShape) -> PositionScheme:
    return XPos(s["head_dim"])  # torchscale's scale_base 512


def _prope(s: SchemeShape) -> PositionScheme:
    return PRoPE(s["head_dim"], p=0.75)  # 6 of the lab's 8 pairs rotate


def _kerple_log(s: SchemeShape) -> PositionScheme:
    return KerpleBias(s["n_heads"], form="log")


def _kerple_power(s: SchemeShape) -> PositionScheme:
    return KerpleBias(s["n_heads"], form="power")


def _fire(s: SchemeShape) -> PositionScheme:
    # The threshold starts at the training length: every training query normalises by
    # psi(L), and a longer evaluation maps its distances back into the trained range [0, 1].
    return FIRE(s["n_heads"], init_L=float(s["train_len"]))


def _cope(s: SchemeShape) -> PositionScheme:
    # Counts saturate at train_len - 1: the table has a row for every count training reaches.
    return CoPE(s["head_dim"], npos=s["train_len"])


#: Built-in scheme factories, in the book's chapter order.
BUILTIN: dict[str, Callable[[SchemeShape], PositionScheme]] = {
    "nope": _nope,
    "sinusoidal": _sinusoidal,
    "learned": _learned,
    "shaw": _shaw,
    "xl": _xl,
    "t5": _t5,
    "rope": _rope,
    "alibi": _alibi,
    "xpos": _xpos,
    "p-rope": _prope,
    "kerple-log": _kerple_log,
    "kerple-power": _kerple_power,
    "fire": _fire,
    "cope": _cope,
    "rope-nope": _rope,
}

#: Display names for figures and tables.
LABELS: dict[str, str] = {
    "nope": "NoPE",
    "sinusoidal": "sinusoidal",
    "learned": "learned",
    "shaw": "Shaw",
    "xl": "Transformer-XL",
    "t5": "T5 bias",
    "rope": "RoPE",
    "alibi": "ALiBi",
    "xpos": "xPos",
    "p-rope": "p-RoPE",
    "kerple-log": "Kerple (log)",
    "kerple-power": "Kerple (power)",
    "fire": "FIRE",
    "cope": "CoPE",
    "rope-nope": "RoPE + NoPE layers",
}


#: Built-in schemes whose model keeps some layers without positions (NoPE), as a function of the
#: number of layers: every 2nd layer for ``rope-nope`` (the lab model has 2; SmolLM3 and Llama 4
#: drop RoPE in every 4th of theirs).
NOPE_LAYERS: dict[str, Callable[[int], tuple[int, ...]]] = {
    "rope-nope": lambda n_layers: nope_every(n_layers, 2),
}


def nope_layers_for(name: str, n_layers: int) -> tuple[int, ...]:
    """The ``nope_layers`` of :class:`~companion.model.TinyDecoder` for the lab scheme ``name``."""
    plan = NOPE_LAYERS.get(name)
    return () if plan is None else plan(n_layers)


def scheme_label(name: str) -> str:
    """The display name of a built-in scheme, or the class name of ``module:ClassName``."""
    return LABELS.get(name, name.rsplit(":", 1)[-1])


def _check_scheme_name(name: object) -> str:
    """Require a lab scheme name: a key of :data:`BUILTIN` or the form
    ``"package.module:ClassName"`` (checked by its form only: nothing is imported). Returns
    ``name``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: any other string (names are case-sensitive: ``"ROPE"`` is not ``"rope"``).
    """
    if not isinstance(name, str):
        raise TypeError(f"scheme must be a string (a built-in name or 'package.module:ClassName'), got "
                        f"{type(name).__name__} {name!r}")
    if name in BUILTIN:
        return name
    module_name, colon, class_name = name.partition(":")
    if not (colon and module_name and all(part.isidentifier() for part in module_name.split("."))
            and class_name.isidentifier()):
        hint = f" (names are lower-case: did you mean {name.lower()!r}?)" if name.lower() in BUILTIN else ""
        raise ValueError(f"scheme must be a built-in name {sorted(BUILTIN)} or 'package.module:ClassName', "
                         f"got {name!r}{hint}")
    return name


def _import_class(spec: str) -> type:
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"scheme {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, PositionScheme)):
        raise ValueError(
            f"scheme {spec!r}: {module_name}.{class_name} must be a subclass of "
            f"companion.PositionScheme, got {type(cls).__name__ if cls is not None else 'nothing'}"
        )
    return cls


def build_scheme(name: str, *, d_model: int, n_heads: int, max_len: int, train_len: int) -> PositionScheme:
    """Build the scheme ``name`` (a key of :data:`BUILTIN`, or ``"module:ClassName"``).

    ``d_model``, ``n_heads``, ``max_len`` and ``train_len`` are ints >= 1, with ``d_model`` a
    multiple of ``n_heads`` (each head gets ``d_model // n_heads`` dimensions).

    Raises:
        TypeError: ``name`` not a string, or a size that is not an int.
        ValueError: an unknown name, a module that does not import, or a class that is not
            a :class:`~companion.attention.PositionScheme`, or whose constructor needs an
            argument the lab does not provide; a size below 1, or ``d_model`` not a multiple
            of ``n_heads``.
    """
    _check_scheme_name(name)
    for size_name, value in (("d_model", d_model), ("n_heads", n_heads), ("max_len", max_len),
                             ("train_len", train_len)):
        check_positive_int(value, size_name)
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads}): each head gets "
                         f"d_model // n_heads dimensions")
    shape = SchemeShape(d_model=d_model, n_heads=n_heads, head_dim=d_model // n_heads,
                        max_len=max_len, train_len=train_len)
    if name in BUILTIN:
        return BUILTIN[name](shape)
    cls = _import_class(name)
    params = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in shape.items() if k in params}
    missing = [p.name for p in params.values()
               if p.default is inspect.Parameter.empty and p.name not in kwargs
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise ValueError(
            f"scheme {name!r}: the constructor needs {missing}, but the lab passes only "
            f"{sorted(shape)} (by name); give the others defaults"
        )
    return cls(**kwargs)
