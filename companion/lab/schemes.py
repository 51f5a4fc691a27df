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

**RoPE at other bases** is the family of names ``rope-b<base>`` (chapter 13): ``rope-b100``,
``rope-b3000``, ``rope-b1e5``, ``rope-b1e6``, ...; ``rope_base_name(base)`` spells a base's name
(integers below ``1e5`` in full, larger or fractional bases as ``<mantissa>e<exponent>``, the
shortest form that gives the base back; base 10000 is ``rope``). The base is part of the scheme
name, so it enters every checkpoint name, result record and table without a new config field,
and one sweep trains several bases side by side.

**Per-layer plans** (``LAYER_PLANS``): the hybrids of chapter 13 give each layer its own
position treatment (``companion.model.LayerPosition``), at equal parameters (positions,
windows and temperatures have none): ``rope-local-global`` (Gemma 2's pattern: sliding-window
RoPE layers, base 1e4, and global RoPE layers with base 1e6), ``irope`` (Llama 4's: chunked
RoPE layers and global NoPE layers) and ``irope-temp`` (the same with Llama 4's attention
temperature in the NoPE layers).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable

from .._checks import check_base, check_positive_int
from ..absolute import LearnedPositionalEmbedding, ScaledSinusoidalEmbedding
from ..alibi import ALiBi, alibi_slopes
from ..attention import NoPE, PositionScheme
from ..cope import CoPE
from ..learned_bias import FIRE, KerpleBias
from ..rope_variants import PRoPE, XPos
from ..model import AttentionTemperature, LayerPosition, nope_every
from ..relative import ShawRelative, T5RelativeBias, TransformerXL
from ..rope import RotaryEmbedding

__all__ = ["BUILTIN", "LABELS", "LAYER_PLANS", "NOPE_LAYERS", "WINDOWS", "SchemeShape", "build_scheme",
           "layer_plan_for", "nope_layers_for", "rope_base_name", "rope_base_of", "scheme_label", "window_for"]

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
    return PRoPE(s["head_dim"], p=0.75)  # the paper's setting: 6 of the lab's 8 pairs rotate


def _prope_short(s: SchemeShape) -> PositionScheme:
    # p = 3/8 keeps the pairs whose wavelength 2 pi / theta_i is at most the training length
    # (at head_dim 16, base 1e4: 6, 20 and 63 tokens for pairs 0-2; pair 3's is 199): every pair
    # that still rotates has turned fully in training, so no distance shows it a new angle.
    return PRoPE(s["head_dim"], p=0.375)


def _kerple_log(s: SchemeShape) -> PositionScheme:
    return KerpleBias(s["n_heads"], form="log")


def _kerple_power(s: SchemeShape) -> PositionScheme:
    return KerpleBias(s["n_heads"], form="power")


#: The lower bound of the learned ALiBi slopes: below the smallest of ALiBi's slopes for the
#: lab's 4 heads (2^-8), which KERPLE's default bound 0.01 would cut off.
ALIBI_LEARNED_EPS = 1e-3


def _alibi_learned(s: SchemeShape) -> PositionScheme:
    # ALiBi with learned slopes: KERPLE's power kernel -r1 |i - j|^r2 with the exponent frozen
    # at 1 and r1 starting at ALiBi's slopes. It is the control that separates "learned slopes"
    # from "KERPLE's kernel" when KERPLE is compared with ALiBi's fixed slopes.
    scheme = KerpleBias(s["n_heads"], form="power", r1=alibi_slopes(s["n_heads"]).tolist(), r2=1.0,
                        eps=ALIBI_LEARNED_EPS)
    scheme.r2.requires_grad_(False)
    return scheme


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
    "p-rope-0.375": _prope_short,
    "alibi-learned": _alibi_learned,
    "kerple-log": _kerple_log,
    "kerple-power": _kerple_power,
    "fire": _fire,
    "cope": _cope,
    "rope-nope": _rope,
    "rope-window-nope": _rope,
    "rope-local-global": _rope,
    "irope": _rope,
    "irope-temp": _rope,
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
    "p-rope": "p-RoPE (p = 3/4)",
    "p-rope-0.375": "p-RoPE (p = 3/8)",
    "alibi-learned": "ALiBi, learned slopes",
    "kerple-log": "Kerple (log)",
    "kerple-power": "Kerple (power)",
    "fire": "FIRE",
    "cope": "CoPE",
    "rope-nope": "RoPE + NoPE layers",
    "rope-window-nope": "windowed RoPE + global NoPE",
    "rope-local-global": "local RoPE + global RoPE 1e6",
    "irope": "chunked RoPE + global NoPE",
    "irope-temp": "chunked RoPE + global NoPE, temperature",
}


#: Built-in schemes whose model keeps some layers without positions (NoPE), as a function of the
#: number of layers: every 2nd layer for ``rope-nope`` (the lab model has 2; SmolLM3 and Llama 4
#: drop RoPE in every 4th of theirs).
NOPE_LAYERS: dict[str, Callable[[int], tuple[int, ...]]] = {
    "rope-nope": lambda n_layers: nope_every(n_layers, 2),
    "rope-window-nope": lambda n_layers: nope_every(n_layers, 2),
}


def nope_layers_for(name: str, n_layers: int) -> tuple[int, ...]:
    """The ``nope_layers`` of :class:`~companion.model.TinyDecoder` for the lab scheme ``name``."""
    plan = NOPE_LAYERS.get(name)
    return () if plan is None else plan(n_layers)


#: Built-in schemes whose position layers attend through a sliding window, as a function of the
#: training length: ``rope-window-nope`` is Llama 4's and Yang et al.'s hybrid (RoPE in local
#: layers, global layers without positions) with a window of half the training length, so that
#: the RoPE layers never see a distance they were not trained on, at any length.
WINDOWS: dict[str, Callable[[int], int]] = {
    "rope-window-nope": lambda train_len: max(1, train_len // 2),
}


def window_for(name: str, n_layers: int, train_len: int) -> tuple[int | None, tuple[int, ...]]:
    """The ``(window, window_layers)`` of :class:`~companion.model.TinyDecoder` for the lab scheme
    ``name``: the layers with positions (those not in :func:`nope_layers_for`) get the window;
    ``(None, ())`` for a scheme without one."""
    plan = WINDOWS.get(name)
    if plan is None:
        return None, ()
    nope = set(nope_layers_for(name, n_layers))
    return plan(train_len), tuple(i for i in range(n_layers) if i not in nope)


#: The RoPE base of the local layers of the chapter 13 hybrids (Gemma's ``rope_local_base_freq``)
#: and of their global RoPE layers (Gemma 3's ``rope_theta``).
LOCAL_BASE = 10_000.0
GLOBAL_BASE = 1_000_000.0

#: Llama 4's ``attn_scale``, the strength of its attention temperature.
LLAMA4_ATTN_SCALE = 0.1


def _local_extent(train_len: int) -> int:
    # half the training length: Gemma 2's window (4096 of its 8192-token context), and
    # rope-window-nope's, so that a local layer never sees a distance it was not trained on
    return max(1, train_len // 2)


def _gemma_plan(n_layers: int, train_len: int) -> tuple[LayerPosition, ...]:
    # Gemma 2's layer_types: sliding when (i + 1) % 2, else full (Gemma 3: (i + 1) % 6)
    w = _local_extent(train_len)
    return tuple(LayerPosition("shared", window=w) if (i + 1) % 2 else LayerPosition("rope", base=GLOBAL_BASE)
                 for i in range(n_layers))


def _irope_plan(n_layers: int, train_len: int, temperature: bool) -> tuple[LayerPosition, ...]:
    # Llama 4: no_rope_layers = int((i + 1) % interval != 0) (interval 4 there, 2 in the lab's
    # 2-layer model, as rope-nope); the RoPE layers attend in chunks, the NoPE layers globally,
    # with attn_temperature_tuning whose floor_scale equals the chunk (8192 both in its config)
    c = _local_extent(train_len)
    temp = AttentionTemperature("llama4", length=c, strength=LLAMA4_ATTN_SCALE) if temperature else None
    nope = set(nope_every(n_layers, 2))
    return tuple(LayerPosition("nope", temperature=temp) if i in nope else LayerPosition("shared", chunk=c)
                 for i in range(n_layers))


#: Built-in schemes with a per-layer position plan (``TinyDecoder(layers=...)``), as a function
#: of the number of layers and the training length; the model's shared scheme (the factory's,
#: RoPE base 1e4) serves the layers marked ``"shared"``. The local layers' window or chunk is
#: half the training length.
LAYER_PLANS: dict[str, Callable[[int, int], tuple[LayerPosition, ...]]] = {
    "rope-local-global": _gemma_plan,
    "irope": lambda n_layers, train_len: _irope_plan(n_layers, train_len, False),
    "irope-temp": lambda n_layers, train_len: _irope_plan(n_layers, train_len, True),
}


def layer_plan_for(name: str, n_layers: int, train_len: int) -> tuple[LayerPosition, ...] | None:
    """The ``layers`` of :class:`~companion.model.TinyDecoder` for the lab scheme ``name`` (see
    :data:`LAYER_PLANS`), or ``None`` for a scheme without a per-layer plan."""
    plan = LAYER_PLANS.get(name)
    return None if plan is None else plan(n_layers, train_len)


_ROPE_BASE = re.compile(r"rope-b([0-9]+(?:\.[0-9]+)?(?:e-?[0-9]+)?)")


def rope_base_name(base: float) -> str:
    """The lab scheme name of RoPE at ``base``: ``"rope"`` at 10000, else ``"rope-b<base>"``
    with an integer base below ``1e5`` written in full (``rope-b100``, ``rope-b3000``) and any
    other in the shortest ``<mantissa>e<exponent>`` form that gives it back (``rope-b1e5``,
    ``rope-b5e5``, ``rope-b1.5e0``).

    Raises:
        TypeError: ``base`` not a real number.
        ValueError: ``base`` not a finite number > 1.
    """
    b = check_base(base, "base")
    if b == 10000.0:
        return "rope"
    if b == int(b) and b < 1e5:
        return f"rope-b{int(b)}"
    for digits in range(1, 18):
        text = f"{b:.{digits - 1}e}"
        if float(text) == b:
            break
    mantissa, exponent = text.split("e")
    return f"rope-b{mantissa}e{int(exponent)}"


def rope_base_of(name: object) -> float | None:
    """The base of a ``rope-b<base>`` scheme name (10000 for ``"rope"``), or ``None`` for any
    other name.

    Raises:
        ValueError: a ``rope-b`` name that is not the canonical spelling of its base
            (:func:`rope_base_name`), naming the canonical one.
    """
    if name == "rope":
        return 10000.0
    if not isinstance(name, str) or not name.startswith("rope-b"):
        return None
    m = _ROPE_BASE.fullmatch(name)
    base = float(m.group(1)) if m else None
    if base is None or not math.isfinite(base) or base <= 1:
        raise ValueError(f"scheme {name!r}: a RoPE base name is 'rope-b<base>' with a base > 1, e.g. 'rope-b100' or "
                         f"'rope-b1e6'")
    canonical = rope_base_name(base)
    if canonical != name:
        raise ValueError(f"scheme {name!r}: base {base:g} is spelt {canonical!r} (one name per base, so that its "
                         f"checkpoints and results are found under one name)")
    return base


def _rope_at_base(base: float) -> Callable[[SchemeShape], PositionScheme]:
    return lambda s: RotaryEmbedding(s["head_dim"], base=base)


def scheme_label(name: str) -> str:
    """The display name of a built-in scheme (``"RoPE, base 1e+06"`` for ``rope-b1e6``), or the
    class name of ``module:ClassName``."""
    if name in LABELS:
        return LABELS[name]
    if isinstance(name, str) and name.startswith("rope-b"):
        base = rope_base_of(name)
        return f"RoPE, base {base:g}"
    return name.rsplit(":", 1)[-1]


def _check_scheme_name(name: object) -> str:
    """Require a lab scheme name: a key of :data:`BUILTIN`, a RoPE base name ``rope-b<base>``
    (:func:`rope_base_of`) or the form ``"package.module:ClassName"`` (checked by its form
    only: nothing is imported). Returns ``name``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: any other string (names are case-sensitive: ``"ROPE"`` is not ``"rope"``).
    """
    if not isinstance(name, str):
        raise TypeError(f"scheme must be a string (a built-in name or 'package.module:ClassName'), got "
                        f"{type(name).__name__} {name!r}")
    if name in BUILTIN or rope_base_of(name) is not None:
        return name
    module_name, colon, class_name = name.partition(":")
    if not (colon and module_name and all(part.isidentifier() for part in module_name.split("."))
            and class_name.isidentifier()):
        hint = f" (names are lower-case: did you mean {name.lower()!r}?)" if name.lower() in BUILTIN else ""
        raise ValueError(f"scheme must be a built-in name {sorted(BUILTIN)}, 'rope-b<base>' (RoPE at another base, "
                         f"e.g. 'rope-b1e6') or 'package.module:ClassName', got {name!r}{hint}")
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

    A ``rope-b<base>`` name (``rope_base_name(base)``) builds RoPE at that base.

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
    base = rope_base_of(name)
    if base is not None:
        return _rope_at_base(base)(shape)
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
