"""A multi-head attention layer and a tiny decoder-only language model that take any scheme.

Small enough to read in one sitting (in the spirit of nanoGPT), and the model every
experiment in the book trains: swap the ``scheme`` and nothing else changes. One scheme
instance is shared by all layers, as T5 shares its relative bias; ``embed`` is applied once
to the token embeddings, ``rotate``/``bias``/``score`` inside every layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import (as_positions, check_base, check_bool, check_choice, check_finite_number, check_positive_int,
                      check_tensor)
from .attention import NoPE, PositionScheme, attention
from .dispatch import fast_attention

__all__ = ["ATTENTION_IMPLS", "TEMPERATURE_FORMS", "AttentionTemperature", "LayerPosition", "MultiHeadAttention",
           "TinyDecoder", "nope_every"]

#: The values ``attention_impl`` takes, ``"auto"`` (:func:`companion.dispatch.fast_attention`,
#: the fastest correct path per scheme) or ``"reference"`` (:func:`companion.attention.attention`).
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "reference")


#: The forms of :class:`AttentionTemperature` (see there).
TEMPERATURE_FORMS: tuple[str, ...] = ("llama4", "log-n", "log-n-all", "constant")


@dataclass(frozen=True)
class AttentionTemperature:
    """A temperature on a layer's attention logits, ``tau(p)`` per query position ``p``.

    The layer multiplies each query by ``tau`` of its position before attention (after the
    projection; RoPE's rotation is linear, so before or after it is the same), which multiplies
    the content logits ``q . k`` (and a ``score`` hook's term) by ``tau``, not a ``bias`` hook's
    term. ``p`` is the query's position (``position_ids``), from 0. Forms:

    * ``"llama4"``: ``tau(p) = 1 + strength * ln(1 + floor((p + 1) / length))``, Llama 4's
      ``attn_temperature_tuning`` of its NoPE layers (transformers' ``Llama4TextAttention``:
      ``log1p(floor((positions + 1) / floor_scale)) * attn_scale + 1``, with ``attn_scale =
      strength`` (0.1 in its config) and ``floor_scale = length`` (8192)); 1 below position
      ``length - 1``, then a step at every multiple of ``length``. The floor is an integer
      division here (transformers divides in float32; the two agree below ``2**24`` positions).
    * ``"log-n"``: ``tau(p) = max(1, ln(p + 1) / ln(length))``: log-n scaling (Chiang and
      Cholak, 2022, multiply the logits by ``ln n``, ``n`` the number of keys a query sees,
      ``p + 1`` in causal attention), normalised so that a model trained at ``length`` is
      unchanged up to it and sharpens past it (a training-free form).
    * ``"log-n-all"``: ``tau(p) = ln(p + 1) / ln(length)`` at every position (0 at ``p =
      0``, whose query sees one key): the same scaling in training as well.
    * ``"constant"``: ``tau = strength`` at every position: YaRN's ``(0.1 ln s + 1)**2`` (its
      factor multiplies both ``q`` and ``k``) or LongRoPE's ``1 + ln s / ln L`` at one scale
      ``s`` (:cite:`peng2024yarn`, :cite:`ding2024longrope`).

    Args:
        form: one of :data:`TEMPERATURE_FORMS`.
        length: ``"llama4"``'s ``floor_scale`` (an int >= 1), or the training length ``L`` of
            the ``"log-n"`` forms (an int >= 2, so that ``ln L > 0``); unused by ``"constant"``.
        strength: ``"llama4"``'s ``attn_scale`` (a finite number >= 0), or ``"constant"``'s
            ``tau`` (a finite number > 0); unused by the ``"log-n"`` forms.

    Raises:
        TypeError, ValueError: naming the field, what it got and what is allowed.
    """

    form: str
    length: int = 8192
    strength: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.form, str):
            raise TypeError(f"form must be one of {list(TEMPERATURE_FORMS)}, got {type(self.form).__name__} "
                            f"{self.form!r}")
        check_choice(self.form, "form", TEMPERATURE_FORMS)
        check_positive_int(self.length, "length", 2 if self.form.startswith("log-n") else 1)
        if self.form == "constant":
            check_finite_number(self.strength, "strength")
        else:
            check_finite_number(self.strength, "strength", minimum=0)

    def scales(self, pos: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """``tau`` at the integer positions ``pos`` (any shape), in ``dtype`` (float32 or
        float64; the logarithms are taken in it).

        Raises:
            TypeError: ``pos`` not an integer tensor, or ``dtype`` not float32/float64.
            ValueError: a negative position.
        """
        if not isinstance(pos, Tensor) or pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
            raise TypeError(f"pos must be an integer tensor of positions, got "
                            f"{type(pos).__name__ if not isinstance(pos, Tensor) else pos.dtype}")
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        if pos.numel() and int(pos.min()) < 0:
            raise ValueError(f"pos must hold positions >= 0, got {int(pos.min())}")
        p = pos.to(torch.int64)
        if self.form == "constant":
            return torch.full(p.shape, float(self.strength), dtype=dtype, device=p.device)
        if self.form == "llama4":
            steps = torch.div(p + 1, self.length, rounding_mode="floor").to(dtype)
            return 1.0 + float(self.strength) * torch.log1p(steps)
        tau = torch.log((p + 1).to(dtype)) / math.log(self.length)
        return tau.clamp(min=1.0) if self.form == "log-n" else tau


#: The per-layer schemes a :class:`LayerPosition` names.
LAYER_SCHEMES: tuple[str, ...] = ("shared", "nope", "rope")


@dataclass(frozen=True)
class LayerPosition:
    """One layer's position treatment in a per-layer plan (``TinyDecoder(layers=...)``).

    Args:
        scheme: ``"shared"`` (the model's ``scheme``, the default), ``"nope"`` (no positions),
            ``"rope"`` (a :class:`~companion.rope.RotaryEmbedding` of this layer's own, with
            ``base`` or ``rope_config``), or a :class:`~companion.attention.PositionScheme`
            instance (used as is; its parameters train with the model).
        base: the RoPE base of a ``"rope"`` layer (default 10000), a finite number > 1.
        rope_config: instead of ``base``, a HuggingFace ``rope_parameters`` dict for a
            ``"rope"`` layer (``{"rope_type": "proportional", "partial_rotary_factor": 0.25,
            "rope_theta": 1e6}``, Gemma 4's global layers), computed by
            :func:`companion.scaling.compute_inv_freq`.
        window: a local layer's sliding window (each query sees its ``window`` latest keys,
            itself included: Gemma's and HuggingFace's ``sliding_window``), an int >= 1, or
            ``None``.
        chunk: a local layer's chunk (query ``i`` sees the keys ``j <= i`` with ``j // chunk
            == i // chunk``: Llama 4's ``attention_chunk_size``), an int >= 1, or ``None``.
            A layer with neither ``window`` nor ``chunk`` is global.
        temperature: an :class:`AttentionTemperature`, or ``None``.

    Layers whose ``"rope"`` settings are equal share one ``RotaryEmbedding`` (one table).

    Raises:
        TypeError, ValueError: naming the field, what it got and what is allowed.
    """

    scheme: Any = "shared"
    base: float | None = None
    rope_config: Mapping[str, Any] | None = None
    window: int | None = None
    chunk: int | None = None
    temperature: AttentionTemperature | None = None

    def __post_init__(self) -> None:
        if isinstance(self.scheme, str):
            check_choice(self.scheme, "scheme", LAYER_SCHEMES)
        elif not isinstance(self.scheme, PositionScheme):
            raise TypeError(f"scheme must be one of {list(LAYER_SCHEMES)} or a companion PositionScheme, got "
                            f"{type(self.scheme).__name__} {self.scheme!r}")
        if self.scheme != "rope" and (self.base is not None or self.rope_config is not None):
            raise ValueError(f"base and rope_config belong to a 'rope' layer, got scheme={self.scheme!r}")
        if self.base is not None and self.rope_config is not None:
            raise ValueError("pass base or rope_config (which holds its rope_theta), not both")
        if self.base is not None:
            check_base(self.base, "base")
        if self.rope_config is not None and not isinstance(self.rope_config, Mapping):
            raise TypeError(f"rope_config must be a dict of rope parameters, got {type(self.rope_config).__name__}")
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None:
                check_positive_int(value, name)
        if self.temperature is not None and not isinstance(self.temperature, AttentionTemperature):
            raise TypeError(f"temperature must be an AttentionTemperature or None, got "
                            f"{type(self.temperature).__name__}")

    @property
    def local(self) -> bool:
        """Whether the layer attends through a window or chunks."""
        return self.window is not None or self.chunk is not None

    def _rope_key(self) -> tuple:
        cfg = None if self.rope_config is None else repr(sorted(self.rope_config.items()))
        return (10000.0 if self.base is None and cfg is None else self.base, cfg)


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention with a position scheme (no dropout, no KV cache).

    Args:
        d_model: model width; must be a multiple of ``n_heads``.
        n_heads: number of query heads.
        scheme: position scheme used inside attention; ``None`` means :class:`~companion.attention.NoPE`.
        n_kv_heads: key/value heads for grouped-query attention (default ``n_heads``).
        bias: whether the projections have biases.
        attention_impl: ``"auto"`` (default): :func:`companion.dispatch.fast_attention`, which
            picks torch's fused attention or the blockwise path when the scheme allows
            (:func:`companion.dispatch.attention_path`); ``"reference"``:
            :func:`companion.attention.attention`. Both compute the same function; a call
            with ``return_weights=True`` always takes the reference.
        window: sliding-window attention: with ``causal=True`` each query sees only the
            ``window`` latest keys, itself included (``i - window < j <= i``, the convention of
            Mistral, Gemma and HuggingFace's ``sliding_window``); an int ``>= 1`` or ``None``
            (default: every earlier key). A windowed call must be causal.
        chunk: chunked attention (Llama 4's local layers, HuggingFace's
            ``attention_chunk_size``): with ``causal=True`` query ``i`` sees the keys ``j <= i``
            with ``j // chunk == i // chunk`` (by position); an int ``>= 1`` or ``None``
            (default). A chunked call must be causal; with ``window`` too, a key must pass both.
        temperature: an ``AttentionTemperature`` (this module): each query is multiplied by
            its ``tau(position)`` before attention; ``None`` (default): none.

    ``forward(x)`` requires ``x`` of shape ``(batch, seq, d_model)`` in the layer's dtype (a
    bf16 ``x`` for fp32 weights raises ``TypeError``: cast the input or the module);
    ``batch = 0`` and ``seq = 0`` are allowed. ``attn_mask`` follows
    :func:`~companion.attention.attention` (bool, integer 1/0, or float additive).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        scheme: PositionScheme | None = None,
        n_kv_heads: int | None = None,
        bias: bool = False,
        attention_impl: str = "auto",
        window: int | None = None,
        chunk: int | None = None,
        temperature: AttentionTemperature | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(d_model, "d_model")
        check_positive_int(n_heads, "n_heads")
        check_bool(bias, "bias")
        self.window = None if window is None else check_positive_int(window, "window")
        self.chunk = None if chunk is None else check_positive_int(chunk, "chunk")
        self.temperature = _check_temperature(temperature)
        self.attention_impl = check_choice(attention_impl, "attention_impl", ATTENTION_IMPLS)
        n_kv_heads = n_heads if n_kv_heads is None else check_positive_int(n_kv_heads, "n_kv_heads")
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.d_model = d_model
        self.scheme = _check_scheme(scheme, n_heads)
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)

    def _split(self, x: Tensor, heads: int) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, heads, self.head_dim).transpose(1, 2)

    def _check_input(self, x: object) -> Tensor:
        check_tensor(x, "x", 3)
        assert isinstance(x, Tensor)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x must have last dimension d_model = {self.d_model}, got shape {tuple(x.shape)}")
        weight = self.q_proj.weight
        if x.dtype != weight.dtype:
            raise TypeError(
                f"x has dtype {x.dtype} but the layer's weights are {weight.dtype}; cast one to "
                f"the other (x.to({weight.dtype}) or module.to({x.dtype}))"
            )
        return x

    def forward(
        self,
        x: Tensor,
        pos: Tensor | None = None,
        *,
        causal: bool = False,
        attn_mask: Tensor | None = None,
        return_weights: bool = False,
        cache: dict | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x``: ``(batch, seq, d_model)``; ``pos``: ``(seq,)`` or ``(batch, seq)``.

        ``cache``: a dict shared by layers that see the same positions, mask and scheme in
        one forward pass, so that the attention mask and bias are built once (see
        :func:`companion.dispatch.fast_attention`); ``None`` builds them per call.
        """
        x = self._check_input(x)
        return_weights = check_bool(return_weights, "return_weights")
        b, n, _ = x.shape
        pos = as_positions(pos, "pos", n, b, x.device)
        q = self._split(self.q_proj(x), self.n_heads)
        k = self._split(self.k_proj(x), self.n_kv_heads)
        v = self._split(self.v_proj(x), self.n_kv_heads)
        if self.window is not None and not check_bool(causal, "causal"):
            raise ValueError(f"this layer has a sliding window (window={self.window}), which needs causal=True")
        if self.chunk is not None and not check_bool(causal, "causal"):
            raise ValueError(f"this layer attends in chunks (chunk={self.chunk}), which needs causal=True")
        temperature = _check_temperature(self.temperature)  # an attribute: may have been set since
        if temperature is not None:
            work = torch.float64 if q.dtype == torch.float64 else torch.float32
            tau = temperature.scales(pos, work)  # (seq,) or (batch, seq)
            tau = tau[None, None, :, None] if tau.dim() == 1 else tau[:, None, :, None]
            q = (q.to(work) * tau).to(q.dtype)
        local = {} if self.chunk is None else {"chunk": self.chunk}
        if self.attention_impl == "reference" or return_weights:
            res = attention(
                q, k, v, self.scheme, pos, pos,
                causal=causal, attn_mask=attn_mask, return_weights=return_weights, window=self.window, **local,
            )
        else:
            res = fast_attention(q, k, v, self.scheme, pos, pos, causal=causal, attn_mask=attn_mask,
                                 cache=cache, window=self.window, **local)
        out, weights = res if return_weights else (res, None)
        out = self.o_proj(out.transpose(1, 2).reshape(b, n, self.d_model))
        return (out, weights) if return_weights else out


def nope_every(n_layers: int, interval: int) -> tuple[int, ...]:
    """The layers that are NoPE when every ``interval``-th layer drops its positions.

    Layer ``i`` (from 0) is NoPE when ``(i + 1) % interval == 0``: with ``interval = 4`` the
    4th, 8th, ... layers, the pattern of Llama 4's and SmolLM3's ``no_rope_layers``
    (``int((i + 1) % 4 != 0)`` per layer, 1 = RoPE). Pass the result as ``nope_layers``
    to :class:`TinyDecoder`.
    """
    check_positive_int(n_layers, "n_layers")
    check_positive_int(interval, "interval")
    return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)


def _check_nope_layers(nope_layers: object, n_layers: int, name: str = "nope_layers") -> tuple[int, ...]:
    """A sequence of distinct layer indices in ``[0, n_layers)``, returned sorted (``name``
    names the argument in the errors)."""
    if isinstance(nope_layers, (str, bytes)) or not isinstance(nope_layers, Sequence):
        raise TypeError(f"{name} must be a sequence of layer indices, got {type(nope_layers).__name__}")
    out = []
    for i in nope_layers:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"{name} must hold ints, got {i!r}")
        if not 0 <= i < n_layers:
            raise IndexError(f"{name} entries must lie in [0, {n_layers}) (n_layers = {n_layers}), got {i}")
        out.append(i)
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must not repeat a layer, got {list(nope_layers)}")
    return tuple(sorted(out))


def _check_temperature(temperature: object) -> AttentionTemperature | None:
    if temperature is not None and not isinstance(temperature, AttentionTemperature):
        raise TypeError(f"temperature must be an AttentionTemperature or None, got {type(temperature).__name__}")
    return temperature


def _check_scheme(scheme: object, n_heads: int) -> PositionScheme:
    """``None`` means NoPE; a scheme must be a PositionScheme that fits ``n_heads`` heads."""
    scheme = NoPE() if scheme is None else scheme
    if not isinstance(scheme, PositionScheme):
        raise TypeError(f"scheme must be a companion PositionScheme or None, got {type(scheme).__name__}")
    scheme.check_heads(n_heads)
    return scheme


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, scheme: PositionScheme,
                 n_kv_heads: int | None, attention_impl: str = "auto", window: int | None = None,
                 chunk: int | None = None, temperature: AttentionTemperature | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, scheme, n_kv_heads, attention_impl=attention_impl,
                                       window=window, chunk=chunk, temperature=temperature)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(self, x: Tensor, pos: Tensor, attn_mask: Tensor | None, cache: dict | None = None) -> Tensor:
        x = x + self.attn(self.ln1(x), pos, causal=True, attn_mask=attn_mask, cache=cache)
        return x + self.mlp(self.ln2(x))


class TinyDecoder(nn.Module):
    """A pre-LayerNorm decoder-only Transformer language model with a pluggable scheme.

    Args:
        vocab_size: number of token ids.
        d_model: width of the residual stream.
        n_heads: attention heads per layer.
        n_layers: number of blocks.
        scheme: position scheme shared by all layers (``None``: :class:`~companion.attention.NoPE`).
        d_ff: hidden width of the MLP (default ``4 * d_model``).
        n_kv_heads: key/value heads for grouped-query attention (default ``n_heads``).
        tie_weights: share the token embedding with the output head.
        nope_layers: indices of layers that use no position scheme at all (NoPE) while the
            others use ``scheme``: the hybrid of SmolLM3 and Llama 4, whose configs give a
            per-layer ``no_rope_layers`` list (1 = RoPE, 0 = NoPE); convert it with
            ``[i for i, r in enumerate(no_rope_layers) if not r]``, or build the every-k-th
            pattern with :func:`nope_every`. ``embed`` still acts once, below the first
            layer. Default: none.
        attention_impl: the attention of every layer, ``"auto"`` (the fastest correct path,
            :func:`companion.dispatch.fast_attention`) or ``"reference"``; see
            :class:`MultiHeadAttention`.
        window, window_layers: sliding-window attention of ``window`` keys (see
            :class:`MultiHeadAttention`) in the layers ``window_layers`` (default: every
            layer), the others attending to every earlier key: the local/global pattern of
            Gemma 2 and 3, and with ``nope_layers`` Llama 4's (local RoPE layers, global
            layers without positions). ``window_layers`` needs a ``window``. Default: no window.
        layers: a per-layer position plan instead of ``nope_layers``, ``window`` and
            ``window_layers``: one ``LayerPosition`` (this module) per layer, naming its scheme
            (the shared ``scheme``, NoPE, RoPE with its own base or ``rope_config``, or a scheme
            instance), its window or chunk (local) or neither (global), and an optional
            ``AttentionTemperature``. Layers with equal RoPE settings share one
            ``RotaryEmbedding``; ``scheme``'s ``embed`` still acts once, below the first layer.
            Default ``None``: the shared scheme with ``nope_layers`` and ``window``.

    Every ``nn.Linear`` and ``nn.Embedding`` is initialised as ``N(0, 0.02)`` with zero
    biases (GPT-2 style), *including those inside the scheme* (a learned position table, T5's
    bucket table, Transformer-XL's projection), so that all schemes start on an equal footing.
    Buffers (a sinusoidal table, RoPE's frequencies) are left untouched.

    A scheme with per-head state must be built for ``n_heads`` heads (``ValueError``
    otherwise, at construction).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        scheme: PositionScheme | None = None,
        d_ff: int | None = None,
        n_kv_heads: int | None = None,
        tie_weights: bool = True,
        attention_impl: str = "auto",
        nope_layers: Sequence[int] = (),
        window: int | None = None,
        window_layers: Sequence[int] | None = None,
        layers: Sequence[LayerPosition] | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(vocab_size, "vocab_size")
        check_positive_int(d_model, "d_model")
        check_positive_int(n_heads, "n_heads")
        check_positive_int(n_layers, "n_layers")
        check_bool(tie_weights, "tie_weights")
        check_choice(attention_impl, "attention_impl", ATTENTION_IMPLS)
        self.scheme = _check_scheme(scheme, n_heads)
        self.nope_layers = _check_nope_layers(nope_layers, n_layers)
        window = None if window is None else check_positive_int(window, "window")
        if window_layers is None:
            self.window_layers = tuple(range(n_layers)) if window is not None else ()
        else:
            self.window_layers = _check_nope_layers(window_layers, n_layers, "window_layers")
            if self.window_layers and window is None:
                raise ValueError("window_layers needs a window (the number of keys each query of those layers sees)")
        self.window = window
        nope = NoPE()
        self.tok = nn.Embedding(vocab_size, d_model)
        d_ff = 4 * d_model if d_ff is None else check_positive_int(d_ff, "d_ff")
        #: the per-layer plan (a tuple of ``LayerPosition``), or ``None`` for a model built
        #: from ``nope_layers`` and ``window``
        self.layer_plan = None if layers is None else self._check_plan(layers, n_layers)
        if self.layer_plan is None:
            self.blocks = nn.ModuleList(
                _Block(d_model, n_heads, d_ff, nope if i in self.nope_layers else self.scheme, n_kv_heads,
                       attention_impl, window if i in self.window_layers else None) for i in range(n_layers)
            )
        else:
            schemes = self._plan_schemes(self.layer_plan, d_model // n_heads, nope)
            self.blocks = nn.ModuleList(
                _Block(d_model, n_heads, d_ff, _check_scheme(scheme, n_heads), n_kv_heads, attention_impl, lp.window,
                       lp.chunk, lp.temperature) for lp, scheme in zip(self.layer_plan, schemes)
            )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok.weight
        self.apply(self._init)

    def _check_plan(self, layers: object, n_layers: int) -> tuple[LayerPosition, ...]:
        """A sequence of ``n_layers`` :class:`LayerPosition`, with no ``nope_layers`` or window."""
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
            raise TypeError(f"layers must be a sequence of LayerPosition (one per layer), got {type(layers).__name__}")
        plan = tuple(layers)
        for i, lp in enumerate(plan):
            if not isinstance(lp, LayerPosition):
                raise TypeError(f"layers[{i}] must be a LayerPosition, got {type(lp).__name__}")
        if len(plan) != n_layers:
            raise ValueError(f"layers must hold one LayerPosition per layer, n_layers = {n_layers}, got {len(plan)}")
        if self.nope_layers or self.window is not None:
            raise ValueError("layers is a whole per-layer plan: pass it without nope_layers, window or window_layers "
                             "(a LayerPosition holds its layer's scheme, window and chunk)")
        return plan

    def _plan_schemes(self, plan: tuple[LayerPosition, ...], head_dim: int, nope: NoPE) -> list[PositionScheme]:
        """Each layer's scheme; equal ``"rope"`` settings share one ``RotaryEmbedding``."""
        from .rope import RotaryEmbedding

        ropes: dict[tuple, PositionScheme] = {}
        out: list[PositionScheme] = []
        for lp in plan:
            if isinstance(lp.scheme, PositionScheme):
                out.append(lp.scheme)
            elif lp.scheme == "shared":
                out.append(self.scheme)
            elif lp.scheme == "nope":
                out.append(nope)
            else:
                key = lp._rope_key()
                if key not in ropes:
                    if lp.rope_config is not None:
                        ropes[key] = RotaryEmbedding(head_dim, rope_config=dict(lp.rope_config))
                    else:
                        ropes[key] = RotaryEmbedding(head_dim, base=10000.0 if lp.base is None else lp.base)
                out.append(ropes[key])
        return out

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(
        self,
        idx: Tensor,
        position_ids: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """Return next-token logits ``(batch, seq, vocab)`` for token ids ``idx`` ``(batch, seq)``.

        ``position_ids`` default to ``arange(seq)``; pass ``(batch, seq)`` ids for left
        padding, together with a key-padding ``attn_mask``. A 2-D ``attn_mask`` is read as
        HuggingFace's ``attention_mask``: shape ``(batch, seq)``, ``1``/``True`` = a real
        token, ``0``/``False`` = padding (what a tokenizer returns). Any other mask follows
        :func:`~companion.attention.attention` (broadcastable to ``(batch, heads, seq, seq)``:
        bool, integer 1/0, or float additive). The causal mask is always applied.
        """
        check_tensor(idx, "idx", 2)
        b, n = idx.shape
        if idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"idx must hold integer token ids, got dtype {idx.dtype}")
        vocab = self.tok.num_embeddings
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= vocab):
            raise IndexError(f"idx must lie in [0, {vocab}), got [{int(idx.min())}, {int(idx.max())}]")
        pos = as_positions(position_ids, "position_ids", n, b, idx.device)
        if isinstance(attn_mask, Tensor) and attn_mask.dim() == 2:
            if attn_mask.is_floating_point():
                raise TypeError(
                    f"a 2-D attn_mask is a (batch, seq) padding mask, HuggingFace's attention_mask "
                    f"(1 = token, 0 = padding), so it must be bool or integer, got dtype "
                    f"{attn_mask.dtype}: a float one would be added to the logits and leave the "
                    f"padding visible; pass attention_mask.bool(), or a 4-D float additive mask"
                )
            if attn_mask.shape != (b, n):
                raise ValueError(
                    f"a 2-D attn_mask is a (batch, seq) padding mask, HuggingFace's attention_mask: "
                    f"expected shape {(b, n)}, got {tuple(attn_mask.shape)}"
                )
            attn_mask = attn_mask[:, None, None, :]
        x = self.scheme.embed(self.tok(idx), pos)
        # one set of positions and masks; the layers that share a scheme share its mask and bias
        caches: dict[tuple[int, int | None, int | None], dict] = {}
        for block in self.blocks:
            key = (id(block.attn.scheme), block.attn.window, block.attn.chunk)
            x = block(x, pos, attn_mask, caches.setdefault(key, {}))
        return self.head(self.ln_f(x))

    def loss(self, idx: Tensor, targets: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Mean next-token cross-entropy; ``targets`` has ``idx``'s shape (-100 is ignored).

        ``targets`` are integer token ids in ``[0, vocab_size)`` or ``-100``.
        """
        check_tensor(targets, "targets")
        if targets.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"targets must hold integer token ids (torch.int64), got dtype {targets.dtype}")
        if isinstance(idx, Tensor) and targets.shape != idx.shape:
            raise ValueError(f"targets must have idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
        vocab = self.tok.num_embeddings
        bad = (targets != -100) & ((targets < 0) | (targets >= vocab))
        if bool(bad.any()):
            raise IndexError(f"targets must lie in [0, {vocab}) or be -100 (ignored), got {int(targets[bad][0])}")
        logits = self(idx, position_ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten().long(), ignore_index=-100)
