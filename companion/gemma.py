"""Gemma 3 in torch, loaded from a GGUF file (Gemma 3 270M): local and global attention layers.

The text architecture is Gemma 3's (Gemma Team, 2025; HuggingFace's ``Gemma3ForCausalLM``,
llama.cpp's ``gemma3``): token embeddings scaled by ``sqrt(dim)``, then ``n_layers`` blocks ::

    h = x + PostAttnNorm(Attention(InputNorm(x)))         # GQA, QK-norm, RoPE on q and k
    x = h + PostFFNNorm(GeGLU(PreFFNNorm(h)))             # down(gelu_tanh(gate h) * up h)

then a final RMSNorm and the LM head tied to the embeddings. Every norm is an RMSNorm over
the last dimension, computed in float32, multiplied by ``(1 + w)``; attention normalises
each head's query and key by an RMSNorm over ``head_dim`` (the QK-norm) before RoPE, and
scales the logits by ``query_pre_attn_scalar ** -0.5`` (``head_dim`` for the 270M model).

**Two kinds of layer.** Most layers are *local*: a query at position ``i`` sees the keys at
``i - W + 1 .. i`` only (the sliding window, ``W = 512``), and its RoPE has base 10,000.
Every ``sliding_window_pattern``-th layer (layers 5, 11, 17 of 18, i.e.
``(i + 1) % 6 == 0``) is *global*: plain causal attention, RoPE base 1,000,000. Each kind
has its own :class:`companion.rope.RotaryEmbedding`; a RoPE scaling config (chapter 9,
:func:`companion.scaling.compute_inv_freq`) goes to the global layers only, as HuggingFace
and llama.cpp apply Gemma 3's ``rope_scaling``, or to every layer
(:meth:`GemmaModel.set_rope_config`).

Attention runs through :func:`companion.dispatch.fast_attention` (torch's fused SDPA): a
global layer's prefill with ``is_causal``, a local layer's in blocks of queries, each
against the ``W - 1`` keys before it and its own, so a 16K pass never builds a 16K x 16K
mask (:func:`sliding_window_attention`).

**The GGUF file.** llama.cpp's converter stores every norm weight as ``1 + w`` (HuggingFace
keeps ``w`` and adds the 1 in the forward pass): :func:`read_gguf` returns them as stored,
and :class:`GemmaModel` multiplies by its norm weights as they are; :func:`build_model`
adds the 1 for weights in HuggingFace's convention (``norm_offset=1.0``), and
:func:`norms_look_shifted` tells the two apart on a bfloat16-trained checkpoint. Gemma's
q/k rows are not permuted by the converter (its RoPE is llama.cpp's NeoX type): they are
used as stored, with half-split rotation. Tensors are dequantized to float32 with the
``gguf`` package (Q4_K, Q5_0, Q6_K, Q8_0, F32 in the 270M file).

**The tokenizer** (:func:`gguf_tokenizer`) is the SentencePiece vocabulary of the GGUF
(``tokenizer.ggml.model == "llama"``) rebuilt as a ``tokenizers.Tokenizer`` that gives
llama.cpp's ids: spaces written as ``U+2581``, pieces merged by score with byte fallback,
the user-defined pieces (runs of newlines, spaces, tabs) and control tokens split off first,
and ``<bos>`` prepended when the metadata says ``add_bos_token``.

The file is cached by :mod:`companion.pretrained` (``python -m companion.pretrained fetch
--model gemma3``).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import check_base, check_bool, check_finite_number, check_positive_int
from .dispatch import fast_attention
from .llama import KVCache, RMSNorm, _check_weights, _gguf
from .rope import RotaryEmbedding

__all__ = [
    "GemmaConfig",
    "GemmaAttention",
    "GemmaMLP",
    "GemmaBlock",
    "GemmaModel",
    "sliding_window_attention",
    "norms_look_shifted",
    "read_gguf",
    "gguf_tokenizer",
    "build_model",
    "load_gguf",
]

#: The layer kinds, as HuggingFace's ``layer_types`` names them.
LAYER_TYPES = ("sliding_attention", "full_attention")

# GGUF tensor names -> this module's parameter names (HuggingFace's, without "model.").
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}

#: Queries per block of a local layer's attention (see :func:`sliding_window_attention`).
QUERY_BLOCK = 512


@dataclass(frozen=True)
class GemmaConfig:
    """The hyper-parameters of a Gemma 3 text model, as stored in GGUF metadata (``gemma3.*``).

    ``sliding_window`` ``None`` makes every layer global; ``sliding_window_pattern`` ``p``
    makes layer ``i`` global when ``(i + 1) % p == 0`` (llama.cpp's ``set_swa_pattern``,
    HuggingFace's ``layer_types``), ``p = 1`` every layer. ``layer_types`` (a tuple of
    ``"sliding_attention"`` / ``"full_attention"``, one per layer) overrides the pattern.
    ``query_pre_attn_scalar`` ``None`` means ``head_dim``.

    Raises:
        TypeError: a field of the wrong type (a string or a bool where a number belongs).
        ValueError: a size below 1, ``n_heads`` not a multiple of ``n_kv_heads``, an odd
            ``head_dim``, a RoPE base ``<= 1``, ``norm_eps`` or ``query_pre_attn_scalar`` or
            ``final_logit_softcapping`` not finite and ``> 0``, ``layer_types`` of another
            length than ``n_layers`` or with another name, or a ``bos_id`` / ``eos_id``
            outside ``[0, vocab_size)``.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    head_dim: int
    norm_eps: float
    context_length: int
    rope_base: float = 1_000_000.0
    rope_local_base: float = 10_000.0
    sliding_window: int | None = 512
    sliding_window_pattern: int = 6
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    layer_types: tuple[str, ...] | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = True
    tie_embeddings: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "head_dim",
                     "context_length", "sliding_window_pattern"):
            check_positive_int(getattr(self, name), name)
        if self.sliding_window is not None:
            check_positive_int(self.sliding_window, "sliding_window")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        check_base(self.rope_base, "rope_base")
        check_base(self.rope_local_base, "rope_local_base")
        check_finite_number(self.norm_eps, "norm_eps")
        for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                check_finite_number(getattr(self, name), name)
        if self.layer_types is not None:
            if isinstance(self.layer_types, str) or not isinstance(self.layer_types, (tuple, list)):
                raise TypeError(f"layer_types must be a tuple of str or None, got {type(self.layer_types).__name__}")
            if len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"layer_types must hold one entry per layer ({self.n_layers}), got {len(self.layer_types)}"
                )
            for i, t in enumerate(self.layer_types):
                if t not in LAYER_TYPES:
                    raise ValueError(f"layer_types[{i}] must be one of {LAYER_TYPES}, got {t!r}")
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in ("bos_id", "eos_id"):
            value = getattr(self, name)
            if value is not None:
                check_positive_int(value, name, minimum=0)
                if value >= self.vocab_size:
                    raise ValueError(f"{name} must lie in [0, {self.vocab_size}), got {value}")
        check_bool(self.add_bos, "add_bos")
        check_bool(self.tie_embeddings, "tie_embeddings")
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__} {self.name!r}")

    @property
    def types(self) -> tuple[str, ...]:
        """One of ``LAYER_TYPES`` per layer (the pattern's, unless ``layer_types`` is given)."""
        if self.layer_types is not None:
            return self.layer_types
        if self.sliding_window is None:
            return ("full_attention",) * self.n_layers
        p = self.sliding_window_pattern
        return tuple("full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(self.n_layers))

    def is_global(self, layer: int) -> bool:
        """Whether ``layer`` (an int in ``[0, n_layers)``) attends to every earlier key."""
        return self.types[_check_layer(self, layer)] == "full_attention"

    @property
    def scale(self) -> float:
        """The attention logit scale ``query_pre_attn_scalar ** -0.5`` (default ``head_dim ** -0.5``)."""
        scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(scalar) ** -0.5

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], tie_embeddings: bool = True) -> GemmaConfig:
        """Build from a ``{key: value}`` dict of GGUF metadata (see :func:`read_gguf`).

        Reads the ``gemma3.*`` keys llama.cpp reads. Keys llama.cpp does not store for the
        270M model take llama.cpp's values: the local RoPE base 10,000
        (``gemma3.rope.freq_base_swa`` if present), the pattern 6
        (``gemma3.attention.sliding_window_pattern``, an int or one bool per layer, ``True``
        for a local layer), no logit soft-capping (``gemma3.final_logit_softcapping``) and
        ``query_pre_attn_scalar = key_length`` (``dim / n_heads`` for the 62-layer 27B model).

        Raises:
            TypeError: ``fields`` is not a mapping.
            ValueError: an architecture other than ``"gemma3"``, or a missing or bad key (the
                message names the key).
        """
        if not isinstance(fields, Mapping):
            raise TypeError(
                f"fields must be a mapping of GGUF metadata keys to values (as read_gguf returns), "
                f"got {type(fields).__name__}"
            )
        arch = fields.get("general.architecture")
        if arch != "gemma3":
            raise ValueError(f"only the 'gemma3' GGUF architecture is supported here, got {arch!r}")

        def need(key: str) -> Any:
            if key not in fields:
                raise ValueError(f"GGUF metadata lacks {key!r}")
            return fields[key]

        def count(key: str, default: Any = None, minimum: int = 1) -> int:
            value = need(key) if default is None else fields.get(key, default)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
                raise ValueError(
                    f"GGUF metadata {key!r} must be an int >= {minimum}, got {type(value).__name__} {value!r}"
                )
            return int(value)

        def number(key: str, default: float | None = None) -> float:
            value = need(key) if default is None else fields.get(key, default)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"GGUF metadata {key!r} must be a number, got {type(value).__name__} {value!r}")
            return float(value)

        p = "gemma3."
        n_heads = count(p + "attention.head_count")
        dim = count(p + "embedding_length")
        n_layers = count(p + "block_count")
        head_dim = count(p + "attention.key_length", max(dim // n_heads, 1))
        if count(p + "attention.value_length", head_dim) != head_dim:
            raise ValueError("GGUF metadata 'gemma3.attention.value_length' must equal key_length")
        window = count(p + "attention.sliding_window", 0, minimum=0) or None
        pattern, layer_types = 6, None
        key = p + "attention.sliding_window_pattern"
        if key in fields:
            value = fields[key]
            if isinstance(value, (list, tuple)):
                if len(value) != n_layers or not all(isinstance(v, bool) for v in value):
                    raise ValueError(f"GGUF metadata {key!r} must be an int or {n_layers} bools, got {value!r}")
                layer_types = tuple(LAYER_TYPES[0] if v else LAYER_TYPES[1] for v in value)
            else:
                pattern = count(key)
        cap = fields.get(p + "final_logit_softcapping")
        if cap is not None:
            cap = number(p + "final_logit_softcapping") or None
        vocab = len(need("tokenizer.ggml.tokens")) if p + "vocab_size" not in fields else count(p + "vocab_size")
        return cls(
            vocab_size=vocab,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=count(p + "attention.head_count_kv", n_heads),
            hidden_dim=count(p + "feed_forward_length"),
            head_dim=head_dim,
            norm_eps=number(p + "attention.layer_norm_rms_epsilon"),
            context_length=count(p + "context_length"),
            rope_base=number(p + "rope.freq_base", 1_000_000.0),
            rope_local_base=number(p + "rope.freq_base_swa", 10_000.0),
            sliding_window=window,
            sliding_window_pattern=pattern,
            # llama.cpp's rule: dim / n_heads for the 27B model (62 layers), key_length otherwise
            query_pre_attn_scalar=float(dim // n_heads if n_layers == 62 else head_dim),
            final_logit_softcapping=cap,
            layer_types=layer_types,
            bos_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_id=fields.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", True)),
            tie_embeddings=tie_embeddings,
            name=str(fields.get("general.name", "")),
        )


def _check_config(cfg: object, name: str = "cfg") -> GemmaConfig:
    if not isinstance(cfg, GemmaConfig):
        raise TypeError(f"{name} must be a GemmaConfig, got {type(cfg).__name__}")
    return cfg


def _check_layer(cfg: GemmaConfig, layer: object) -> int:
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
        raise TypeError(f"layer must be an int in [0, {cfg.n_layers}), got {type(layer).__name__} {layer!r}")
    if not 0 <= layer < cfg.n_layers:
        raise IndexError(f"layer must lie in [0, {cfg.n_layers}) (the config has {cfg.n_layers} layers), got {layer}")
    return int(layer)


# ----------------------------------------------------------------------------- attention


def sliding_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int | None,
    *,
    scale: float | None = None,
    block: int = QUERY_BLOCK,
) -> Tensor:
    """Causal attention of the last ``q_len`` positions over ``k_len`` keys, optionally windowed.

    The keys and values sit at positions ``0 .. k_len - 1`` and the queries at the last
    ``q_len`` of them (a prefill, or new tokens after a KV cache). Query ``i`` sees key
    ``j`` when ``i - window < j <= i`` (``window`` keys, itself included: HuggingFace's
    ``sliding_window`` and llama.cpp's ``n_swa``); ``window=None`` is plain causal attention.
    Windowed, the queries go in blocks of ``block``, each through
    :func:`companion.dispatch.fast_attention` with the keys it may see and a ``(block,
    block + window - 1)`` mask; plain causal prefill is SDPA's ``is_causal``. Grouped-query
    attention: ``kv_heads`` may divide ``heads``.

    Args:
        q: ``(batch, heads, q_len, head_dim)``; k: ``(batch, kv_heads, k_len, head_dim)``;
            v: ``(batch, kv_heads, k_len, v_dim)``, with ``q_len <= k_len``.
        window: an int ``>= 1`` or ``None``.
        scale: the logit scale (default ``1 / sqrt(head_dim)``).
        block: queries per block, an int ``>= 1``.

    Returns:
        ``(batch, heads, q_len, v_dim)``.

    Raises:
        TypeError: ``window`` or ``block`` not an int, or tensors of a wrong type.
        ValueError: ``window`` or ``block`` below 1, ``q_len > k_len``, or shapes that do not
            fit (as :func:`companion.dispatch.fast_attention` reports them).
    """
    if window is not None:
        check_positive_int(window, "window")
    check_positive_int(block, "block")
    if not all(isinstance(x, Tensor) for x in (q, k, v)):
        bad = next(n for n, x in (("q", q), ("k", k), ("v", v)) if not isinstance(x, Tensor))
        raise TypeError(f"{bad} must be a torch.Tensor")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D (batch, heads, seq, head_dim), got {tuple(q.shape)}, {tuple(k.shape)}")
    t, n = q.shape[2], k.shape[2]
    if t > n:
        raise ValueError(f"q_len ({t}) must not exceed k_len ({n}): the queries are the last keys' positions")
    start = n - t
    if window is None or window >= n:
        return fast_attention(q, k, v, causal=True, scale=scale)
    out = []
    for s in range(0, t, block):
        e = min(s + block, t)
        q_lo, q_hi = start + s, start + e  # absolute query positions [q_lo, q_hi)
        k_lo = max(0, q_lo - window + 1)
        q_pos = torch.arange(q_lo, q_hi, device=q.device)
        k_pos = torch.arange(k_lo, q_hi, device=q.device)
        diff = q_pos[:, None] - k_pos[None, :]
        mask = (diff >= 0) & (diff < window)
        out.append(fast_attention(q[:, :, s:e], k[:, :, k_lo:q_hi], v[:, :, k_lo:q_hi], q_pos=q_pos, k_pos=k_pos,
                                  attn_mask=mask[None, None], scale=scale))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


class GemmaAttention(nn.Module):
    """Gemma 3 attention: GQA, QK-norm over ``head_dim``, RoPE, scale ``query_pre_attn_scalar ** -0.5``,
    a sliding window on local layers.

    ``cfg`` must be a :class:`GemmaConfig` (``TypeError``) and ``layer`` an int in
    ``[0, cfg.n_layers)`` (``IndexError`` outside it)."""

    def __init__(self, cfg: GemmaConfig, layer: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        _check_config(cfg)
        self.layer = _check_layer(cfg, layer)
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.is_global = cfg.is_global(layer)
        self.window = None if self.is_global else cfg.sliding_window
        self.scale = cfg.scale
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, device=device)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, device=device)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, device=device)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, device=device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device)

    def forward(self, x: Tensor, rope: RotaryEmbedding, start: int, cache: KVCache | None) -> Tensor:
        """Attention for ``x`` ``(batch, seq, dim)`` at positions ``start ..``, extending ``cache`` if given."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        pos = torch.arange(start, start + t, device=x.device)
        q, k = rope.rotate(q, k, pos, pos)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
            if self.window is not None and k.shape[2] > t + self.window:  # older keys are out of every window
                k, v = k[:, :, -(t + self.window):], v[:, :, -(t + self.window):]
        y = sliding_window_attention(q, k, v, self.window, scale=self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class GemmaMLP(nn.Module):
    """GeGLU: ``down(gelu_tanh(gate x) * up x)``. ``cfg`` must be a :class:`GemmaConfig`."""

    def __init__(self, cfg: GemmaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        _check_config(cfg)
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False, device=device)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False, device=device)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False, device=device)

    def forward(self, x: Tensor) -> Tensor:
        """``down(gelu_tanh(gate x) * up x)``."""
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaBlock(nn.Module):
    """One Gemma 3 block: a norm before and after attention and before and after the MLP.

    Raises:
        TypeError: ``cfg`` not a :class:`GemmaConfig`, or ``layer`` not an int.
        IndexError: ``layer`` outside ``[0, cfg.n_layers)``.
    """

    def __init__(self, cfg: GemmaConfig, layer: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer, device)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        self.pre_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        self.post_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        self.mlp = GemmaMLP(cfg, device)

    def forward(self, x: Tensor, rope: RotaryEmbedding, start: int, cache: KVCache | None) -> Tensor:
        """``h = x + post_norm(attn(norm(x)))``, then ``h + post_norm(mlp(pre_norm(h)))``."""
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, start, cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


_ROPE_LAYERS = ("global", "all")


class GemmaModel(nn.Module):
    """A Gemma 3 text decoder with one :class:`~companion.rope.RotaryEmbedding` per layer kind.

    The norm weights are used as they are (``x_normed * weight``): they hold ``1 + w``, as the
    GGUF file stores them (see :func:`build_model` for HuggingFace's ``w``).

    Args:
        config: the :class:`GemmaConfig`.
        rope_config: ``None`` for plain RoPE, or a scaling config of :mod:`companion.scaling`
            (a HuggingFace-style dict), installed by :meth:`set_rope_config` on the layers
            ``rope_layers`` names.
        rope_layers: ``"global"`` (HuggingFace's and llama.cpp's rule for Gemma 3) or ``"all"``.
        device: where to create the weights (``"meta"`` to fill them by assignment).
    """

    def __init__(
        self,
        config: GemmaConfig,
        *,
        rope_config: Mapping[str, Any] | None = None,
        rope_layers: str = "global",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = _check_config(config, "config")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim, device=device)
        self.layers = nn.ModuleList(GemmaBlock(config, i, device) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, device)
        self.lm_head = None
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False, device=device)
        self.rope_global = RotaryEmbedding(config.head_dim, base=config.rope_base, layout="half")
        self.rope_local = RotaryEmbedding(config.head_dim, base=config.rope_local_base, layout="half")
        self.rope_layers = "global"
        self.set_rope_config(rope_config, rope_layers)

    def rope_for(self, layer: int) -> RotaryEmbedding:
        """The :class:`~companion.rope.RotaryEmbedding` of ``layer`` (its kind's)."""
        return self.rope_global if self.config.is_global(layer) else self.rope_local

    def set_rope_config(self, rope_config: Mapping[str, Any] | None, layers: str = "global") -> None:
        """Install a RoPE scaling config (chapter 9) on the global layers or on all, or ``None``.

        ``layers="global"`` scales the global layers' RoPE and leaves the local layers' plain
        (Gemma 3's ``rope_scaling`` in HuggingFace; llama.cpp's ``--rope-freq-base`` and
        ``--rope-freq-scale`` also reach only the global layers); ``"all"`` scales both kinds.
        ``rope_theta`` defaults to each kind's own base (1,000,000 global, 10,000 local; a
        ``rope_theta`` in the dict is used for every layer it is installed on), and the
        reference length (``max_position_embeddings``) is ``config.context_length``. The
        frequencies come from :func:`companion.scaling.compute_inv_freq`'s rules.

        Raises:
            TypeError: ``rope_config`` not a mapping or ``None``, ``layers`` not a str.
            ValueError: ``layers`` not ``"global"`` or ``"all"``, or a bad config (as
                :func:`companion.scaling.parse_rope_config` reports it).
        """
        if not isinstance(layers, str):
            raise TypeError(f"layers must be 'global' or 'all', got {type(layers).__name__} {layers!r}")
        if layers not in _ROPE_LAYERS:
            raise ValueError(f"layers must be 'global' or 'all', got {layers!r}")
        if rope_config is not None and not isinstance(rope_config, Mapping):
            raise TypeError(f"rope_config must be a mapping or None, got {type(rope_config).__name__}")
        cfg = self.config
        for rope, base, scaled in ((self.rope_global, cfg.rope_base, True),
                                   (self.rope_local, cfg.rope_local_base, layers == "all")):
            if rope_config is not None and scaled:
                params = dict(rope_config)
                params.setdefault("rope_theta", base)
                rope.set_rope_config(params, max_position_embeddings=cfg.context_length)
            else:
                rope.set_rope_config({"rope_type": "default", "rope_theta": base})
        self.rope_layers = layers

    def _check_ids(self, ids: object) -> Tensor:
        if not isinstance(ids, Tensor):
            raise TypeError(f"ids must be a torch.Tensor of token ids, got {type(ids).__name__}")
        if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise TypeError(f"ids must be an integer tensor, got dtype {ids.dtype}")
        if ids.dim() != 2:
            raise ValueError(f"ids must be 2-D (batch, seq), got shape {tuple(ids.shape)}")
        if ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ValueError(f"ids must hold at least one token, got shape {tuple(ids.shape)}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"ids must lie in [0, {self.config.vocab_size}), got values in [{lo}, {hi}]")
        return ids.long()

    def _check_cache(self, cache: object) -> None:
        if cache is None:
            return
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a companion.llama.KVCache or None, got {type(cache).__name__}")
        if cache.n_layers != self.config.n_layers:
            raise ValueError(f"cache has {cache.n_layers} layers, the model {self.config.n_layers}")

    def embed(self, ids: Tensor) -> Tensor:
        """Token embeddings times ``sqrt(dim)`` (in the weights' dtype, as HuggingFace)."""
        w = self.embed_tokens.weight
        return self.embed_tokens(ids) * torch.tensor(self.config.dim ** 0.5, dtype=w.dtype)

    def hidden(self, ids: Tensor, cache: KVCache | None = None) -> Tensor:
        """Final normed hidden states ``(batch, seq, dim)``; the tokens sit at positions
        ``cache.length ..`` (0 without a cache), and the cache is extended in place."""
        ids = self._check_ids(ids)
        self._check_cache(cache)
        start = 0 if cache is None else cache.length
        x = self.embed(ids)
        for i, block in enumerate(self.layers):
            x = block(x, self.rope_for(i), start, cache)
        return self.norm(x)

    def logits(self, h: Tensor) -> Tensor:
        """The LM head on hidden states (``h @ E^T`` when tied), soft-capped if the config says so."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        out = F.linear(h, weight)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out

    def forward(self, ids: Tensor, cache: KVCache | None = None) -> Tensor:
        """Logits ``(batch, seq, vocab)`` for integer ``ids`` ``(batch, seq)``."""
        return self.logits(self.hidden(ids, cache))

    @torch.no_grad()
    def token_nll(self, ids: Tensor, chunk: int = 512) -> Tensor:
        """Per-token negative log-likelihood ``(batch, seq - 1)`` of ``ids[:, 1:]`` (nats).

        The sequence goes through the model ``chunk`` tokens at a time with a
        :class:`~companion.llama.KVCache` (memory grows with ``chunk``, not with the
        length), and the LM head runs 128 positions at a time (the vocabulary has 262,144
        entries). Include the BOS token (``config.bos_id``) at the start of ``ids``: Gemma is
        trained with it. Perplexity is ``exp(mean)``.

        Raises:
            TypeError: ``ids`` not an integer tensor, ``chunk`` not an int.
            ValueError: ``ids`` not 2-D, with fewer than 2 tokens a row or out of the
                vocabulary; ``chunk < 1``.
        """
        check_positive_int(chunk, "chunk")
        ids = self._check_ids(ids)
        if ids.shape[1] < 2:
            raise ValueError(f"ids must hold at least 2 tokens per row for a next-token loss, got {ids.shape[1]}")
        cache = KVCache(self.config.n_layers)
        n = ids.shape[1] - 1  # positions with a target
        out = []
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = self.hidden(ids[:, s:e], cache)
            for a in range(0, e - s, 128):
                logits = self.logits(h[:, a:a + 128])
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                target = ids[:, s + a + 1:s + a + 1 + logits.shape[1]]
                out.append(F.cross_entropy(logits.transpose(1, 2), target, reduction="none"))
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def generate(self, ids: Tensor, max_new_tokens: int, *, stop_at_eos: bool = True) -> Tensor:
        """Greedy continuation of ``ids`` ``(batch, seq)`` by up to ``max_new_tokens`` tokens
        with a KV cache; with ``stop_at_eos``, stops once every row has produced
        ``config.eos_id``. Returns ``(batch, seq + n)``.

        Raises:
            TypeError: ``ids`` not an integer tensor, ``max_new_tokens`` not an int,
                ``stop_at_eos`` not a bool.
            ValueError: bad ``ids`` (as :meth:`token_nll`), ``max_new_tokens < 0``.
        """
        ids = self._check_ids(ids)
        check_positive_int(max_new_tokens, "max_new_tokens", minimum=0)
        check_bool(stop_at_eos, "stop_at_eos")
        cache = KVCache(self.config.n_layers)
        out, step = ids, ids
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for _ in range(max_new_tokens):
            nxt = self.logits(self.hidden(step, cache)[:, -1]).argmax(-1)
            out = torch.cat((out, nxt[:, None]), dim=1)
            step = nxt[:, None]
            if stop_at_eos and self.config.eos_id is not None:
                done |= nxt == self.config.eos_id
                if bool(done.all()):
                    break
        return out


# ----------------------------------------------------------------------------- GGUF


def _norm_names(config: GemmaConfig) -> list[str]:
    names = ["norm.weight"]
    for i in range(config.n_layers):
        names += [f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm",
                                                     "pre_feedforward_layernorm", "post_feedforward_layernorm",
                                                     "self_attn.q_norm", "self_attn.k_norm")]
    return names


def norms_look_shifted(weights: Mapping[str, Tensor]) -> bool:
    """Whether the norm weights look stored as ``1 + w`` (llama.cpp's converter) rather than ``w``.

    Gemma is trained in bfloat16, so a raw ``w`` lies on the bfloat16 grid, while ``1 + w``
    computed in float32 often does not (its low bits hold ``w``'s). The answer is whether
    ``weight - 1`` lies on the grid for more entries than ``weight`` itself, over every
    tensor whose name ends in ``norm.weight``. (The mean is no guide: Gemma's learned ``w``
    are far from 0, the 270M model's input norms average about 13.) Inconclusive, and then
    ``False``, for a checkpoint saved in float32 from float32 training.

    Raises:
        TypeError: ``weights`` not a mapping of names to floating tensors.
        ValueError: no tensor named ``...norm.weight``.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a mapping of parameter names to tensors, got {type(weights).__name__}")
    raw = shifted = total = 0
    for name, w in weights.items():
        if not str(name).endswith("norm.weight"):
            continue
        if not isinstance(w, Tensor) or not w.is_floating_point():
            raise TypeError(f"weights[{name!r}] must be a floating-point tensor, got {type(w).__name__}")
        w = w.detach().float()
        raw += int((w.to(torch.bfloat16).float() == w).sum())
        shifted += int(((w - 1).to(torch.bfloat16).float() == (w - 1)).sum())
        total += w.numel()
    if total == 0:
        raise ValueError("weights hold no norm weight (no name ends in 'norm.weight')")
    return shifted > raw


_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
            12: "<f8"}  # GGUF value types (7 is bool); 8 is a string, 9 an array


class _Header:
    """A GGUF file's metadata and tensor table, parsed with ``struct`` and ``numpy``.

    ``gguf.GGUFReader`` builds its fields one numpy view at a time, which takes about 30 s
    for Gemma's 262,144-entry vocabulary (three lists of that length); this parses the same
    header in about a second. The values are what ``ReaderField.contents()`` returns (a
    float32 as a Python float, a bool as a bool, an array as a list).
    """

    def __init__(self, path: Path) -> None:
        import struct

        with open(path, "rb") as fh:
            head = fh.read(24)
            if len(head) < 24 or head[:4] != b"GGUF":
                raise ValueError("not a GGUF file (no GGUF magic)")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
            size = os.fstat(fh.fileno()).st_size
        self.buf = memoryview(__import__("numpy").memmap(path, mode="r", dtype="uint8"))
        self.off = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._u(4))
        self.tensors = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._u(8) for _ in range(self._u(4))]
            self.tensors.append((name, dims, self._u(4), self._u(8)))
        align = self.fields.get("general.alignment", 32)
        self.data_offset = self.off + (-self.off) % align
        self.size = size

    def _u(self, n: int) -> int:
        value = int.from_bytes(self.buf[self.off:self.off + n], "little")
        if self.off + n > len(self.buf):
            raise ValueError("the GGUF header is truncated")
        self.off += n
        return value

    def _string(self) -> str:
        n = self._u(8)
        if self.off + n > len(self.buf):
            raise ValueError("the GGUF header is truncated")
        text = bytes(self.buf[self.off:self.off + n]).decode("utf-8")
        self.off += n
        return text

    def _value(self, kind: int) -> Any:
        import numpy as np

        if kind == 8:
            return self._string()
        if kind == 9:
            sub, n = self._u(4), self._u(8)
            if sub == 8:
                return [self._string() for _ in range(n)]
            if sub == 9:
                return [self._value(9) for _ in range(n)]
            if sub not in _SCALARS:
                raise ValueError(f"unknown GGUF value type {sub}")
            dt = np.dtype(_SCALARS[sub])
            arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.off)
            self.off += n * dt.itemsize
            return [bool(x) for x in arr] if sub == 7 else arr.tolist()
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        dt = np.dtype(_SCALARS[kind])
        value = np.frombuffer(self.buf, dtype=dt, count=1, offset=self.off)[0]
        self.off += dt.itemsize
        return bool(value) if kind == 7 else value.item()

    def tensor_data(self, dims: list[int], kind: int, offset: int):  # noqa: ANN201 - numpy array
        """The raw data of one tensor, shaped as ``gguf.GGUFReader`` shapes it."""
        import numpy as np

        gguf = _gguf()
        qtype = gguf.GGMLQuantizationType(kind)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = math.prod(dims)
        shape = tuple(reversed(dims))
        start = self.data_offset + offset
        plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64}.get(qtype.name)
        if plain is not None:
            return qtype, np.frombuffer(self.buf, dtype=plain, count=n, offset=start).reshape(shape)
        nbytes = n * type_size // block
        data = np.frombuffer(self.buf, dtype=np.uint8, count=nbytes, offset=start)
        return qtype, data.reshape(gguf.quant_shape_to_byte_shape(shape, qtype))


def _read_header(path: object) -> tuple[Path, _Header]:
    from ._checks import check_file

    path = check_file(path, what="a .gguf model file")
    try:
        return path, _Header(path)
    except (ValueError, UnicodeDecodeError, OSError, IndexError) as exc:
        raise ValueError(
            f"path {path} is not a readable GGUF file ({type(exc).__name__}: {exc}); pass the path "
            f"of a .gguf model file"
        ) from exc


def _dequantize(qtype: Any, data: Any) -> Tensor:
    """A float32 tensor from GGUF data: Q8_0 in torch (ten times faster), the rest by ``gguf``."""
    import numpy as np

    gguf = _gguf()
    if qtype == gguf.GGMLQuantizationType.Q8_0:  # blocks of an fp16 scale and 32 int8
        rows = data.shape[:-1]
        blocks = torch.from_numpy(np.array(data, copy=True)).reshape(-1, 34)  # the file's map is read-only
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        out = blocks[:, 2:].contiguous().view(torch.int8).float() * scale
        return out.reshape(*rows, -1)
    array = gguf.quants.dequantize(data, qtype).astype("float32", copy=False)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)


def read_gguf(path: str | os.PathLike[str]) -> tuple[GemmaConfig, dict[str, Tensor], dict[str, Any]]:
    """Read a Gemma 3 GGUF file: ``(config, weights, fields)``.

    ``weights`` maps this module's parameter names (HuggingFace's) to float32 tensors, each
    dequantized with ``gguf.quants.dequantize`` and reshaped to torch's ``(out, in)`` order;
    the norm weights are as stored, ``1 + w``. ``fields`` holds the metadata as Python values.

    Raises:
        TypeError: ``path`` not a str or path.
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, not the ``gemma3`` architecture, or a tensor this module
            does not know (the message names it).
    """
    path, header = _read_header(path)
    fields = header.fields
    if fields.get("general.architecture") != "gemma3":
        raise ValueError(
            f"path {path} holds a {fields.get('general.architecture')!r} model; read_gguf reads 'gemma3' "
            f"(companion.llama.read_gguf reads 'llama')"
        )
    weights: dict[str, Tensor] = {}
    for tname, dims, kind, offset in header.tensors:
        parts = tname.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
            name = f"layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
        elif len(parts) == 2 and parts[0] in _TOP_NAMES:
            name = f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
        else:
            raise ValueError(f"unexpected tensor {tname!r} in {path.name}")
        try:
            qtype, data = header.tensor_data(dims, kind, offset)
        except ValueError as exc:
            raise ValueError(f"tensor {tname!r} of {path.name} cannot be read: {exc}") from exc
        weights[name] = _dequantize(qtype, data).reshape(tuple(reversed(dims)))
    config = GemmaConfig.from_gguf_fields(fields, tie_embeddings="lm_head.weight" not in weights)
    return config, weights, fields


def build_model(
    config: GemmaConfig,
    weights: Mapping[str, Tensor],
    *,
    norm_offset: float = 0.0,
    rope_config: Mapping[str, Any] | None = None,
    rope_layers: str = "global",
) -> GemmaModel:
    """A :class:`GemmaModel` from ``weights`` named as :func:`read_gguf` returns them.

    ``norm_offset`` is added to every norm weight: ``0.0`` for GGUF weights (already
    ``1 + w``), ``1.0`` for HuggingFace's raw ``w`` (its ``Gemma3RMSNorm`` multiplies by
    ``1 + w``). The other tensors are shared with ``weights``, not copied; the model is in
    eval mode without gradients.

    Raises:
        TypeError: ``config`` not a :class:`GemmaConfig`, ``weights`` not a mapping of names
            to floating-point tensors, ``norm_offset`` not a number.
        ValueError: ``weights`` that lack a tensor the model needs, hold one it does not have
            or hold one of another shape (the message names them); ``norm_offset`` not finite.
    """
    _check_config(config, "config")
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"weights must be a mapping of parameter names to tensors (as read_gguf returns), "
            f"got {type(weights).__name__}"
        )
    if isinstance(norm_offset, bool) or not isinstance(norm_offset, numbers.Real):
        raise TypeError(f"norm_offset must be a number (0.0 for GGUF weights, 1.0 for HuggingFace's), "
                        f"got {type(norm_offset).__name__} {norm_offset!r}")
    if not math.isfinite(norm_offset):
        raise ValueError(f"norm_offset must be a finite number (0.0 for GGUF weights, 1.0 for HuggingFace's), "
                         f"got {norm_offset!r}")
    model = GemmaModel(config, rope_config=rope_config, rope_layers=rope_layers, device="meta")
    _check_weights(weights, model.state_dict())
    state = dict(weights)
    if norm_offset:
        for name in _norm_names(config):
            state[name] = state[name] + norm_offset
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


# ----------------------------------------------------------------------------- tokenizer

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def gguf_tokenizer(fields: Mapping[str, Any]):  # noqa: ANN201 - tokenizers.Tokenizer
    """A ``tokenizers.Tokenizer`` that tokenizes as llama.cpp's SentencePiece (SPM) tokenizer.

    For ``tokenizer.ggml.model == "llama"`` (SentencePiece BPE): each space becomes
    ``U+2581`` (no space is prepended unless ``tokenizer.ggml.add_space_prefix``), and
    llama.cpp's rule, merging the adjacent pair whose concatenation is the vocabulary piece
    of the highest score (ties: leftmost), is a BPE whose merges are every split ``(a, b)`` of
    every piece into two pieces, ranked by the piece's score; characters without a piece fall
    back to the ``<0xXX>`` byte tokens. This equals llama.cpp's rule exactly when the NORMAL
    pieces' scores are distinct (Gemma's 255,474 are); pieces of equal score are ranked by
    token id, where llama.cpp would merge the leftmost pair of either. The USER_DEFINED pieces (Gemma's runs of newlines,
    spaces and tabs) are split off before, as llama.cpp always does, and so are the CONTROL
    tokens (``<start_of_turn>``: llama.cpp's ``parse_special=True``). With
    ``tokenizer.ggml.add_bos_token`` (true for Gemma), ``encode`` prepends ``<bos>``
    (``add_special_tokens=False`` does not).

    Raises:
        TypeError: ``fields`` is not a mapping.
        ValueError: another tokenizer model, missing or malformed ``tokenizer.ggml.tokens``,
            ``scores`` or ``token_type`` (the message names the key), duplicate pieces, or
            fewer than the 256 byte tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    if not isinstance(fields, Mapping):
        raise TypeError(
            f"fields must be a mapping of GGUF metadata keys to values (as read_gguf returns), "
            f"got {type(fields).__name__}"
        )
    model = fields.get("tokenizer.ggml.model")
    if model != "llama":
        raise ValueError(f"only the SentencePiece tokenizer model 'llama' is supported here, got {model!r}")
    tokens = fields.get("tokenizer.ggml.tokens")
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (list, tuple)) or not tokens:
        raise ValueError("GGUF metadata 'tokenizer.ggml.tokens' must be a non-empty list of strings")
    if not all(isinstance(t, str) for t in tokens):
        raise ValueError("GGUF metadata 'tokenizer.ggml.tokens' must be a list of strings")
    n = len(tokens)
    scores = fields.get("tokenizer.ggml.scores", [0.0] * n)
    types = fields.get("tokenizer.ggml.token_type", [_NORMAL] * n)
    for key, values, kind in (("scores", scores, numbers.Real), ("token_type", types, numbers.Integral)):
        if not isinstance(values, (list, tuple)) or len(values) != n or not all(
                isinstance(x, kind) and not isinstance(x, bool) for x in values):
            raise ValueError(f"GGUF metadata 'tokenizer.ggml.{key}' must be a list of {n} numbers, one per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != n:
        raise ValueError("the GGUF token list has duplicate tokens")
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise ValueError(f"the vocabulary lacks {len(missing)} byte-fallback token(s), e.g. {missing[0]!r}")
    ranked = []
    for i, t in enumerate(tokens):
        if types[i] != _NORMAL or len(t) < 2:
            continue
        for j in range(1, len(t)):
            if t[:j] in vocab and t[j:] in vocab:
                ranked.append((-float(scores[i]), i, vocab[t[:j]], (t[:j], t[j:])))
    ranked.sort()
    merges = [pair for *_, pair in ranked]
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < n else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=False, byte_fallback=True))
    steps = []
    if fields.get("tokenizer.ggml.add_space_prefix", False):
        steps.append(normalizers.Prepend("\u2581"))
    steps.append(normalizers.Replace(" ", "\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    if fields.get("tokenizer.ggml.add_bos_token", False) and isinstance(bos_id, int) and 0 <= bos_id < n:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, bos_id)]
        )
    return tok


def load_gguf(
    path: str | os.PathLike[str] | None = None,
    *,
    rope_config: Mapping[str, Any] | None = None,
    rope_layers: str = "global",
):  # noqa: ANN201 - (GemmaModel, tokenizers.Tokenizer)
    """Load a Gemma 3 GGUF file: ``(GemmaModel, tokenizer)``, every weight in float32.

    ``path`` defaults to the cached Gemma 3 270M file
    (:func:`companion.pretrained.gemma3_gguf_path`, which raises ``FileNotFoundError`` with
    the fetch command if it is missing). ``rope_config`` and ``rope_layers`` install a
    chapter-9 scaling config (:meth:`GemmaModel.set_rope_config`).
    """
    if path is None:
        from .pretrained import gemma3_gguf_path

        path = gemma3_gguf_path()
    config, weights, fields = read_gguf(path)
    model = build_model(config, weights, rope_config=rope_config, rope_layers=rope_layers)
    return model, gguf_tokenizer(fields)
