"""A minimal Llama forward pass in torch, loaded from a GGUF file (SmolLM2-135M, chapter 10).

The architecture is Llama's (:cite:`touvron2023llama`): token embeddings, then ``n_layers``
pre-norm blocks ::

    h = x + Attention(RMSNorm(x))        # grouped-query attention, RoPE on q and k
    x = h + SwiGLU(RMSNorm(h))           # w2(silu(w1 h) * w3 h)

then a final RMSNorm and the LM head, here tied to the embeddings. RoPE is
:class:`companion.rope.RotaryEmbedding`, one instance shared by every layer, so any scaling
config of chapter 9 (:mod:`companion.scaling`) can be installed with
:meth:`LlamaModel.set_rope_config`. Prefill uses
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, which never builds an
``L x L`` matrix in Python; generation uses a :class:`KVCache`.

Training-free length extension (:mod:`companion.trainfree`): :meth:`LlamaModel.set_attention_mode`
(or the context manager :meth:`LlamaModel.attention_mode`) replaces the prefill attention of
every layer by ReRoPE, Leaky ReRoPE or Self-Extend (``token_nll`` then scores with it), and
:func:`companion.trainfree.stream_nll` reads a long stream through an attention-sink cache (StreamingLLM).

Attention temperature and entropy (chapter 13): :meth:`LlamaModel.set_attention_temperature`
multiplies the queries of chosen layers by a :class:`companion.model.AttentionTemperature`
of their position, and :meth:`LlamaModel.attention_entropy` measures how spread each head's
attention is over the keys for the last queries of a prefill.

Weights come from a GGUF file through the ``gguf`` package (every tensor dequantized to
float32) and the tokenizer from the GGUF metadata through the ``tokenizers`` library
(byte-level BPE from the stored tokens and merges). The model file itself is cached by
:mod:`companion.pretrained` (``python -m companion.pretrained fetch``).

**The weight layout.** llama.cpp's converter permutes the rows of each head of ``W_q`` and
``W_k`` (HuggingFace's half-split order) into the interleaved (adjacent pairs) order that
its RoPE kernel rotates. :func:`load_gguf` offers both correct ways back:
``layout="interleaved"`` keeps the GGUF rows and rotates adjacent pairs; ``layout="half"``
converts the rows with :func:`companion.rope.convert_qk_weight` and rotates HuggingFace's
halves. Both compute the same logits. Mixing them (GGUF rows, half rotation) is the layout
pitfall of the RoPE chapter: :func:`build_model` with ``convert_qk=False`` builds that wrong
model on purpose.
"""

from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import (
    check_base,
    check_bool,
    check_file,
    check_finite_number,
    check_float_tensor,
    check_positive_int,
)
from .model import AttentionTemperature
from .rope import RotaryEmbedding, check_layout, convert_qk_weight
from .trainfree import ReRoPE, SelfExtend, SinkCache

__all__ = [
    "LlamaConfig",
    "RMSNorm",
    "Attention",
    "FeedForward",
    "Block",
    "KVCache",
    "LlamaModel",
    "read_gguf",
    "gguf_metadata",
    "gguf_tokenizer",
    "render_chat",
    "generate_chat",
    "stream_chat",
    "build_model",
    "load_gguf",
]

# GGUF tensor names -> the names of this module's parameters (Meta's naming).
_BLOCK_NAMES = {
    "attn_norm": "attention_norm",
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}
_TOP_NAMES = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}


@dataclass(frozen=True)
class LlamaConfig:
    """The hyper-parameters of a Llama model, as stored in GGUF metadata (``llama.*`` keys).

    Raises:
        TypeError: a field of the wrong type (a string or a bool where an int belongs).
        ValueError: a size below 1, ``n_heads`` not a multiple of ``n_kv_heads``, an odd
            ``head_dim``, ``rope_base <= 1``, ``norm_eps <= 0``, or a ``bos_id`` / ``eos_id``
            outside ``[0, vocab_size)`` (a special token must be a token of the vocabulary).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    head_dim: int
    rope_base: float
    norm_eps: float
    context_length: int
    bos_id: int | None = None
    eos_id: int | None = None
    tie_embeddings: bool = True
    name: str = ""
    chat_template: str | None = None

    def __post_init__(self) -> None:
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim",
                      "head_dim", "context_length"):
            check_positive_int(getattr(self, field), field)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        check_base(self.rope_base, "rope_base")
        check_finite_number(self.norm_eps, "norm_eps")
        for field in ("bos_id", "eos_id"):
            value = getattr(self, field)
            if value is not None:
                check_positive_int(value, field, minimum=0)
                if value >= self.vocab_size:
                    raise ValueError(
                        f"{field} must lie in [0, {self.vocab_size}) (a token id of the vocabulary of "
                        f"vocab_size {self.vocab_size}), got {value}"
                    )
        check_bool(self.tie_embeddings, "tie_embeddings")
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__} {self.name!r}")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise TypeError(f"chat_template must be a str or None, got {type(self.chat_template).__name__}")

    def __repr__(self) -> str:
        """Every field, with the chat template shortened to its length (SmolLM2's is hundreds
        of characters of Jinja2, which would bury the sizes)."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "chat_template" and value is not None:
                parts.append(f"chat_template=<{len(value)} characters of Jinja2>")
            else:
                parts.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], tie_embeddings: bool = True) -> LlamaConfig:
        """Build from a ``{key: value}`` dict of GGUF metadata (see :func:`read_gguf`).

        Raises:
            TypeError: ``fields`` is not a mapping.
            ValueError: an architecture other than ``"llama"``, or a missing or bad key (the
                message names the key).
        """
        if not isinstance(fields, Mapping):
            raise TypeError(
                f"fields must be a mapping of GGUF metadata keys to values (as read_gguf returns), "
                f"got {type(fields).__name__}"
            )
        arch = fields.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"only the 'llama' GGUF architecture is supported, got {arch!r}")

        def need(key: str) -> Any:
            if key not in fields:
                raise ValueError(f"GGUF metadata lacks {key!r}")
            return fields[key]

        def count(key: str, default: Any = None) -> int:
            """A size from the metadata: an int >= 1 (``ValueError`` naming the key otherwise)."""
            value = need(key) if default is None else fields.get(key, default)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"GGUF metadata {key!r} must be an int >= 1, got {type(value).__name__} {value!r}")
            return int(value)

        def number(key: str, default: float | None = None) -> float:
            """A real number from the metadata (``ValueError`` naming the key otherwise)."""
            value = need(key) if default is None else fields.get(key, default)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"GGUF metadata {key!r} must be a number, got {type(value).__name__} {value!r}")
            return float(value)

        n_heads = count("llama.attention.head_count")
        dim = count("llama.embedding_length")
        if "llama.vocab_size" in fields:
            vocab = count("llama.vocab_size")
        else:
            vocab = len(need("tokenizer.ggml.tokens"))
        return cls(
            vocab_size=vocab,
            dim=dim,
            n_layers=count("llama.block_count"),
            n_heads=n_heads,
            n_kv_heads=count("llama.attention.head_count_kv", n_heads),
            hidden_dim=count("llama.feed_forward_length"),
            head_dim=count("llama.rope.dimension_count", max(dim // n_heads, 1)),
            rope_base=number("llama.rope.freq_base", 10000.0),
            norm_eps=number("llama.attention.layer_norm_rms_epsilon"),
            context_length=count("llama.context_length"),
            bos_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_id=fields.get("tokenizer.ggml.eos_token_id"),
            tie_embeddings=tie_embeddings,
            name=str(fields.get("general.name", "")),
            chat_template=fields.get("tokenizer.chat_template"),
        )


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (Llama's norm).

    Computed in float32 at least (float64 inputs stay float64), then cast back.

    Raises:
        TypeError: ``dim`` not an int, or ``eps`` not a real number (a string, a bool).
        ValueError: ``dim < 1``, or ``eps`` not a finite number ``> 0`` (``eps = 0`` divides
            an all-zero row by zero).
    """

    def __init__(self, dim: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        check_positive_int(dim, "dim")
        check_finite_number(eps, "eps")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: Tensor) -> Tensor:
        """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension, computed in float32 or wider."""
        work = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(work)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(work)).to(x.dtype)


class KVCache:
    """Rotated keys and values of the tokens seen so far, one ``(batch, kv_heads, seq, head_dim)``
    pair per layer. :attr:`length` is the position of the next token.

    Each layer's keys and values live in a preallocated buffer whose capacity doubles when it
    fills, so a generation step copies only its own token (appending with ``torch.cat``
    would copy the whole cache at every step, 30 layers x 16K positions on SmolLM2).
    :meth:`update` returns views of the filled part.
    """

    def __init__(self, n_layers: int) -> None:
        self.n_layers = check_positive_int(n_layers, "n_layers")
        self._keys: list[Tensor | None] = [None] * n_layers
        self._values: list[Tensor | None] = [None] * n_layers
        self._filled = [0] * n_layers

    @property
    def length(self) -> int:
        """Number of cached positions (0 when empty)."""
        return self._filled[-1]

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on, in every layer: the next token then sits
        at position ``length``.

        A rollback for scoring several continuations of one prompt (the passkey measure of
        :mod:`companion.passkey` scores each candidate answer after the same cached prompt):
        the buffers keep their capacity and the next :meth:`update` overwrites the forgotten
        positions, so views returned before the call must not be used after it.

        Raises:
            TypeError: ``length`` not an int.
            ValueError: ``length`` outside ``[0, self.length]`` (a cache cannot grow by
                truncation).
        """
        length = check_positive_int(length, "length", minimum=0)
        if length > self.length:
            raise ValueError(f"length must lie in [0, {self.length}] (the cached positions), got {length}")
        self._filled = [min(n, length) for n in self._filled]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``, ``v`` for ``layer`` and return all keys and values of that layer.

        ``layer`` is an int in ``[0, n_layers)``: a negative index (which a list would read
        from the end) or one past the end raises ``IndexError`` naming the range.

        ``k`` is a floating tensor ``(batch, kv_heads, seq, head_dim)`` and ``v`` one
        ``(batch, kv_heads, seq, v_dim)`` of the same dtype and device; after the first
        chunk of a layer, later chunks must keep its batch size, head count, head
        dimensions, dtype and device.

        Raises:
            TypeError: ``layer`` not an int; ``k`` or ``v`` not a floating tensor, or of
                another dtype than ``k`` (or than the cache).
            IndexError: ``layer`` outside ``[0, n_layers)``.
            ValueError: ``k`` or ``v`` not 4-D, ``v`` of another batch size, head count or
                length than ``k``, or a chunk that does not match the layer's cached keys.
        """
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
            raise TypeError(f"layer must be an int in [0, {self.n_layers}), got {type(layer).__name__} {layer!r}")
        if not 0 <= layer < self.n_layers:
            raise IndexError(
                f"layer must be in [0, {self.n_layers}) (the cache has {self.n_layers} layers, "
                f"0..{self.n_layers - 1}), got {layer}"
            )
        layer = int(layer)
        buf_k, buf_v = self._keys[layer], self._values[layer]
        self._check_chunk(layer, k, v, buf_k, buf_v)
        n, t = self._filled[layer], k.shape[2]
        if buf_k is None or n + t > buf_k.shape[2]:
            capacity = max(n + t, 256, 0 if buf_k is None else 2 * buf_k.shape[2])
            shape = (k.shape[0], k.shape[1], capacity, k.shape[3])
            new_k, new_v = k.new_empty(shape), v.new_empty(shape[:3] + (v.shape[3],))
            if n:
                new_k[:, :, :n] = buf_k[:, :, :n]
                new_v[:, :, :n] = buf_v[:, :, :n]
            self._keys[layer], self._values[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, :, n:n + t] = k
        buf_v[:, :, n:n + t] = v
        self._filled[layer] = n + t
        return buf_k[:, :, :n + t], buf_v[:, :, :n + t]

    @staticmethod
    def _check_chunk(layer: int, k: object, v: object, buf_k: Tensor | None, buf_v: Tensor | None) -> None:
        """``k``, ``v`` of one chunk, against each other and against the layer's buffers."""
        check_float_tensor(k, "k", 4)
        check_float_tensor(v, "v", 4)
        assert isinstance(k, Tensor) and isinstance(v, Tensor)
        if v.shape[:3] != k.shape[:3]:
            raise ValueError(
                f"v shape {tuple(v.shape)} must match k shape {tuple(k.shape)} in (batch, kv_heads, seq)"
            )
        if v.dtype != k.dtype or v.device != k.device:
            raise TypeError(f"v must have k's dtype and device ({k.dtype}, {k.device}), got {v.dtype}, {v.device}")
        if buf_k is None or buf_v is None:
            return
        for name, x, buf in (("k", k, buf_k), ("v", v, buf_v)):
            for axis, what in ((0, "batch size"), (1, "kv_heads"), (3, "head_dim")):
                if x.shape[axis] != buf.shape[axis]:
                    raise ValueError(
                        f"{name} {what} {x.shape[axis]} must equal the {what} {buf.shape[axis]} of the "
                        f"chunks already cached for layer {layer}, got {name} shape {tuple(x.shape)}"
                    )
            if x.dtype != buf.dtype or x.device != buf.device:
                raise TypeError(
                    f"{name} must have the dtype and device of the chunks already cached for layer {layer} "
                    f"({buf.dtype}, {buf.device}), got {x.dtype}, {x.device}"
                )


def _check_config(cfg: object, name: str) -> LlamaConfig:
    if not isinstance(cfg, LlamaConfig):
        raise TypeError(f"{name} must be a LlamaConfig, got {type(cfg).__name__}")
    return cfg


def _check_layer(cfg: object, layer: object) -> int:
    """``layer`` of a model of ``cfg.n_layers`` blocks: an int in ``[0, n_layers)``."""
    _check_config(cfg, "cfg")
    assert isinstance(cfg, LlamaConfig)
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
        raise TypeError(f"layer must be an int in [0, {cfg.n_layers}), got {type(layer).__name__} {layer!r}")
    if not 0 <= layer < cfg.n_layers:
        raise IndexError(
            f"layer must lie in [0, {cfg.n_layers}) (the config has {cfg.n_layers} layers), got {layer}"
        )
    return int(layer)


class Attention(nn.Module):
    """Grouped-query attention (``n_kv_heads`` key/value heads shared by ``n_heads`` query heads)
    with RoPE on q and k, no biases, as in Llama 2/3.

    ``mode`` (``None``, or a :class:`~companion.trainfree.ReRoPE` /
    :class:`~companion.trainfree.SelfExtend` installed by
    :meth:`LlamaModel.set_attention_mode`) replaces the prefill attention; a
    :class:`~companion.trainfree.SinkCache` as ``cache`` runs StreamingLLM attention.

    ``cfg`` must be a :class:`LlamaConfig` (``TypeError``) and ``layer`` an int in
    ``[0, cfg.n_layers)`` (``IndexError`` outside it)."""

    def __init__(self, cfg: LlamaConfig, layer: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.layer = _check_layer(cfg, layer)
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, device=device)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, device=device)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, device=device)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, device=device)
        self.mode: ReRoPE | SelfExtend | None = None
        self.temperature: AttentionTemperature | None = None
        self.probe = 0  # > 0: record the attention entropy of this many last queries (prefill only)
        self.entropy: Tensor | None = None

    def forward(self, x: Tensor, rope: RotaryEmbedding, start: int, cache: KVCache | SinkCache | None) -> Tensor:
        """Attention for ``x`` ``(batch, seq, dim)`` at positions ``start ..``, extending ``cache`` if given."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        if self.temperature is not None:  # tau of each query's position, computed in float32
            tau = self.temperature.scales(torch.arange(start, start + t, device=x.device), torch.float32)
            q = q * tau.to(q.dtype)[:, None]
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if isinstance(cache, SinkCache):  # StreamingLLM: unrotated keys, rotated inside the cache
            y = cache.attend(self.layer, q, k, v, rope)
            return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        if self.mode is not None:  # a training-free prefill (LlamaModel.hidden checks start == 0)
            y = self.mode.attend(q, k, v, rope)
            return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        pos = torch.arange(start, start + t, device=x.device)
        q, k = rope.rotate(q, k, pos, pos)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        if self.probe:
            self.entropy = self._entropy(q[:, :, -self.probe:], k, start + t - min(self.probe, t))
        # enable_gqa: query head h reads key/value head h // (n_heads // n_kv_heads), without
        # materialising the repeated keys (bit-identical to repeat_interleave on CPU)
        if start == 0:  # the queries are positions 0 .. t-1 of the keys: plain causal
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # t new queries after `start` cached keys: query i sees keys 0 .. start + i
            mask = None
            if t > 1:
                k_pos = torch.arange(k.shape[2], device=x.device)
                mask = k_pos[None, :] <= pos[:, None]  # (t, start + t), not L x L
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def _entropy(self, q: Tensor, k: Tensor, first: int) -> Tensor:
        """Mean entropy in bits ``(batch, n_heads)`` of the attention of queries ``q`` (at
        positions ``first ..``) over the causal prefix of keys ``k``, in float32."""
        group = self.n_heads // self.n_kv_heads
        kk = k.float().repeat_interleave(group, dim=1)
        scores = q.float() @ kk.transpose(-1, -2) / self.head_dim ** 0.5  # (b, h, probe, keys)
        q_pos = torch.arange(first, first + q.shape[2], device=q.device)
        visible = torch.arange(k.shape[2], device=q.device)[None, :] <= q_pos[:, None]
        logp = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        ent = -(logp.exp() * logp.masked_fill(~visible, 0.0)).sum(-1) / torch.log(torch.tensor(2.0))
        return ent.mean(-1)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``. ``cfg`` must be a :class:`LlamaConfig` (``TypeError``
    otherwise)."""

    def __init__(self, cfg: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        _check_config(cfg, "cfg")
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False, device=device)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False, device=device)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False, device=device)

    def forward(self, x: Tensor) -> Tensor:
        """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm Llama block: attention and SwiGLU, each inside a residual.

    Raises:
        TypeError: ``cfg`` not a :class:`LlamaConfig`, or ``layer`` not an int.
        IndexError: ``layer`` outside ``[0, cfg.n_layers)``.
    """

    def __init__(self, cfg: LlamaConfig, layer: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        _check_layer(cfg, layer)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        self.attention = Attention(cfg, layer, device)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        self.feed_forward = FeedForward(cfg, device)

    def forward(self, x: Tensor, rope: RotaryEmbedding, start: int, cache: KVCache | SinkCache | None) -> Tensor:
        """One pre-norm block: ``h = x + attention(norm(x))``, then ``h + feed_forward(norm(h))``."""
        h = x + self.attention(self.attention_norm(x), rope, start, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaModel(nn.Module):
    """A Llama decoder (:cite:`touvron2023llama`) with a shared :class:`~companion.rope.RotaryEmbedding`.

    Args:
        config: the :class:`LlamaConfig`.
        layout: the RoPE layout, ``"half"`` (HuggingFace) or ``"interleaved"`` (Meta, GGUF);
            the q/k weights must be in the same layout (see :func:`build_model`).
        rope_config: ``None`` for plain RoPE with ``config.rope_base``, or a scaling config of
            :mod:`companion.scaling` (a HuggingFace-style dict); ``rope_theta`` defaults to
            ``config.rope_base`` and ``max_position_embeddings`` is ``config.context_length``.
        device: where to create the weights (``"meta"`` to fill them by assignment).
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        layout: str = "half",
        rope_config: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.layout = check_layout(layout)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim, device=device)
        self.layers = nn.ModuleList(Block(config, i, device) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, device)
        self.output = None
        if not config.tie_embeddings:
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False, device=device)
        self.rope = RotaryEmbedding(config.head_dim, base=config.rope_base, layout=self.layout)
        self._attention_mode: ReRoPE | SelfExtend | None = None
        if rope_config is not None:
            self.set_rope_config(rope_config)

    @property
    def current_attention_mode(self) -> ReRoPE | SelfExtend | None:
        """The training-free prefill attention installed by :meth:`set_attention_mode` (or ``None``)."""
        return self._attention_mode

    def set_attention_mode(self, mode: ReRoPE | SelfExtend | None) -> None:
        """Install a training-free prefill attention in every layer, or ``None`` for plain SDPA.

        ``mode`` is a :class:`~companion.trainfree.ReRoPE` (ReRoPE or Leaky ReRoPE) or a
        :class:`~companion.trainfree.SelfExtend`; it combines with the installed RoPE
        frequencies (:meth:`set_rope_config`). With a mode, :meth:`hidden` and
        :meth:`token_nll` run one prefill pass at positions ``0 ..`` with
        :func:`companion.trainfree.two_region_attention`; a :class:`KVCache` (hence
        :meth:`generate`) is refused. Attention sinks are :func:`companion.trainfree.stream_nll` instead.
        """
        if mode is not None and not isinstance(mode, (ReRoPE, SelfExtend)):
            raise TypeError(f"mode must be a ReRoPE, a SelfExtend or None, got {type(mode).__name__}")
        self._attention_mode = mode
        for block in self.layers:
            block.attention.mode = mode

    @contextlib.contextmanager
    def attention_mode(self, mode: ReRoPE | SelfExtend | None) -> Iterator[LlamaModel]:
        """Context manager: :meth:`set_attention_mode` ``(mode)`` inside, the previous mode after."""
        previous = self._attention_mode
        self.set_attention_mode(mode)
        try:
            yield self
        finally:
            self.set_attention_mode(previous)

    def set_attention_temperature(self, temperature: AttentionTemperature | None,
                                  layers: Sequence[int] | None = None) -> None:
        """Multiply the queries of ``layers`` (default: every layer) by ``temperature`` of each
        query's position (:class:`companion.model.AttentionTemperature`; ``None`` removes it),
        which multiplies their attention logits; the other layers are left as they are.

        Raises:
            TypeError: ``temperature`` not an ``AttentionTemperature`` or ``None``; ``layers``
                not a sequence of ints.
            IndexError: a layer outside ``[0, n_layers)``.
            ValueError: a repeated layer.
        """
        if temperature is not None and not isinstance(temperature, AttentionTemperature):
            raise TypeError(f"temperature must be an AttentionTemperature or None, got {type(temperature).__name__}")
        n = self.config.n_layers
        if layers is None:
            chosen = list(range(n))
        else:
            if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
                raise TypeError(f"layers must be a sequence of layer indices, got {type(layers).__name__}")
            chosen = []
            for layer in layers:
                if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
                    raise TypeError(f"layers must hold ints, got {layer!r}")
                if not 0 <= int(layer) < n:
                    raise IndexError(f"layers must lie in [0, {n}), got {int(layer)}")
                chosen.append(int(layer))
            if len(set(chosen)) < len(chosen):
                raise ValueError(f"layers must not repeat a layer, got {chosen}")
        for i in chosen:
            self.layers[i].attention.temperature = temperature

    @property
    def attention_temperatures(self) -> list[AttentionTemperature | None]:
        """The temperature of each layer (``None`` where there is none)."""
        return [block.attention.temperature for block in self.layers]

    @torch.no_grad()
    def attention_entropy(self, ids: Tensor, last: int = 64, *,
                          return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Attention entropy in bits ``(n_layers, n_heads)`` of one prefill of ``ids`` ``(1, n)``:
        for each layer and query head, the entropy of the attention weights over the visible
        keys, averaged over the ``last`` queries (with the installed RoPE and temperatures,
        computed in float32). ``log2(p + 1)`` bits is the most a query at position ``p`` can
        have (uniform weights); 0 is all weight on one key. With ``return_hidden``, also the
        pass's final hidden states ``(1, n, dim)`` (what :meth:`hidden` returns), so that one
        pass gives the losses too.

        Raises:
            TypeError, ValueError: bad ``ids`` (as :meth:`hidden`), ``ids`` of another batch
                size than 1, or ``last`` outside ``[1, n]``.
            ValueError: a training-free attention mode is installed (its prefill is another
                attention; set it to ``None`` first).
        """
        ids = self._check_ids(ids)
        check_bool(return_hidden, "return_hidden")
        if ids.shape[0] != 1:
            raise ValueError(f"ids must be one sequence (1, n), got shape {tuple(ids.shape)}")
        n = ids.shape[1]
        last = check_positive_int(last, "last")
        if last > n:
            raise ValueError(f"last must lie in [1, {n}] (the sequence's length), got {last}")
        if self._attention_mode is not None:
            raise ValueError(f"attention mode {self._attention_mode.name!r} is installed; attention_entropy "
                             f"measures plain attention: call set_attention_mode(None) first")
        blocks = [block.attention for block in self.layers]
        try:
            for a in blocks:
                a.probe, a.entropy = last, None
            h = self.hidden(ids)  # each layer's probe records its entropy on the way
            entropy = torch.stack([a.entropy[0] for a in blocks])
            return (entropy, h) if return_hidden else entropy
        finally:
            for a in blocks:
                a.probe, a.entropy = 0, None

    def set_rope_config(self, rope_config: Mapping[str, Any] | None) -> None:
        """Install a RoPE scaling config (chapter 9) in every layer, or ``None`` for plain RoPE.

        ``rope_theta`` defaults to the model's base, and the reference length
        (``max_position_embeddings``) is the model's native context.
        """
        if rope_config is not None:
            if not isinstance(rope_config, Mapping):
                raise TypeError(f"rope_config must be a mapping or None, got {type(rope_config).__name__}")
            rope_config = dict(rope_config)
            rope_config.setdefault("rope_theta", self.config.rope_base)
            self.rope.set_rope_config(rope_config, max_position_embeddings=self.config.context_length)
        else:
            self.rope.set_rope_config({"rope_type": "default", "rope_theta": self.config.rope_base})

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

    def hidden(self, ids: Tensor, cache: KVCache | SinkCache | None = None) -> Tensor:
        """Final normed hidden states ``(batch, seq, dim)``; the tokens sit at positions
        ``cache.length ..`` (0 without a cache), and the cache is extended in place. A
        :class:`~companion.trainfree.SinkCache` continues its stream with StreamingLLM
        attention (positions inside the cache, see :mod:`companion.trainfree`)."""
        ids = self._check_ids(ids)
        if cache is not None:
            if not isinstance(cache, (KVCache, SinkCache)):
                raise TypeError(f"cache must be a KVCache, a trainfree.SinkCache or None, got {type(cache).__name__}")
            if self._attention_mode is not None:
                raise ValueError(
                    f"attention mode {self._attention_mode.name!r} runs a prefill pass only, without a "
                    f"cache; call set_attention_mode(None) first"
                )
            if cache.n_layers != self.config.n_layers:
                raise ValueError(f"cache has {cache.n_layers} layers, the model {self.config.n_layers}")
        start = 0 if cache is None else cache.length
        x = self.tok_embeddings(ids).to(self.norm.weight.dtype)
        for block in self.layers:
            x = block(x, self.rope, start, cache)
        return self.norm(x)

    def logits(self, h: Tensor) -> Tensor:
        """The LM head on hidden states: ``h @ E^T`` (tied) or the separate output matrix."""
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(h, weight)

    def forward(self, ids: Tensor, cache: KVCache | None = None) -> Tensor:
        """Logits ``(batch, seq, vocab)`` for integer ``ids`` ``(batch, seq)``."""
        return self.logits(self.hidden(ids, cache))

    @torch.no_grad()
    def token_nll(self, ids: Tensor, chunk: int = 512) -> Tensor:
        """Per-token negative log-likelihood ``(batch, seq - 1)`` of ``ids[:, 1:]`` (nats).

        The LM head runs ``chunk`` positions at a time, so the ``(seq, vocab)`` logits are
        never held whole; perplexity is ``exp(mean)``.
        """
        check_positive_int(chunk, "chunk")
        ids = self._check_ids(ids)
        if ids.shape[1] < 2:
            raise ValueError(f"ids must hold at least 2 tokens per row for a next-token loss, got {ids.shape[1]}")
        h = self.hidden(ids)[:, :-1]
        target = ids[:, 1:]
        out = []
        for s in range(0, h.shape[1], chunk):
            logits = self.logits(h[:, s:s + chunk])
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            out.append(F.cross_entropy(logits.transpose(1, 2), target[:, s:s + chunk], reduction="none"))
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def generate(
        self,
        ids: Tensor,
        max_new_tokens: int,
        greedy: bool = True,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        stop_at_eos: bool = True,
    ) -> Tensor:
        """Continue ``ids`` ``(batch, seq)`` by up to ``max_new_tokens`` tokens with a KV cache.

        Greedy (argmax) by default, else sampling at ``temperature`` (a finite number > 0,
        checked in both modes) with ``generator``.
        With ``stop_at_eos``, generation stops once every row has produced
        ``config.eos_id`` (rows that finished early keep generating until then). Returns
        ``(batch, seq + n)``.
        """
        ids = self._check_ids(ids)
        steps = self.generate_steps(ids, max_new_tokens, greedy, temperature=temperature, generator=generator,
                                    stop_at_eos=stop_at_eos)
        return torch.cat([ids, *(nxt[:, None] for nxt in steps)], dim=1)

    def generate_steps(
        self,
        ids: Tensor,
        max_new_tokens: int,
        greedy: bool = True,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        stop_at_eos: bool = True,
    ) -> Iterator[Tensor]:
        """:meth:`generate` one step at a time: an iterator of each step's new tokens
        ``(batch,)``, each yielded as soon as it is chosen (a streaming token iterator).

        The arguments, the tokens and the stopping rule are :meth:`generate`'s, which is
        ``ids`` followed by this iterator's tokens. The arguments are checked here, before
        the first step.
        """
        ids = self._check_ids(ids)
        check_positive_int(max_new_tokens, "max_new_tokens", minimum=0)
        check_bool(greedy, "greedy")
        check_bool(stop_at_eos, "stop_at_eos")
        temperature = check_finite_number(temperature, "temperature")
        return self._steps(ids, max_new_tokens, greedy, temperature, generator, stop_at_eos)

    def _steps(self, ids: Tensor, max_new_tokens: int, greedy: bool, temperature: float,
               generator: torch.Generator | None, stop_at_eos: bool) -> Iterator[Tensor]:
        cache = KVCache(self.config.n_layers)
        step = ids
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for _ in range(max_new_tokens):
            with torch.no_grad():
                last = self.logits(self.hidden(step, cache)[:, -1]).float()
                if greedy:
                    nxt = last.argmax(-1)
                else:
                    probs = torch.softmax(last / temperature, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            yield nxt
            step = nxt[:, None]
            if stop_at_eos and self.config.eos_id is not None:
                done |= nxt == self.config.eos_id
                if bool(done.all()):
                    break


# ----------------------------------------------------------------------------- GGUF reading


def _gguf():  # noqa: ANN202 - the module
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - gguf is in the pretrained extra
        raise ImportError("companion.llama needs gguf: pip install 'pe-companion[pretrained]'") from exc
    return gguf


def _gguf_reader(path: object):  # noqa: ANN202 - gguf.GGUFReader
    """Open a GGUF file; every error names the path (``gguf`` says only "GGUF magic invalid")."""
    path = check_file(path, what="a .gguf model file")
    gguf = _gguf()
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, EOFError, IndexError, KeyError) as exc:
        raise ValueError(
            f"path {path} is not a readable GGUF file ({type(exc).__name__}: {exc}); pass the path "
            f"of a .gguf model file"
        ) from exc


def _field_value(field: Any) -> Any:
    """A GGUF metadata field as a Python value (str, number, bool, or list of them)."""
    return field.contents()


def _string_list(fields: Mapping[str, Any], key: str, what: str) -> list[str]:
    """The list of strings stored under GGUF metadata ``key`` (``ValueError`` naming it otherwise)."""
    if key not in fields:
        raise ValueError(f"GGUF metadata lacks {key!r} ({what}); a byte-level BPE tokenizer needs it")
    value = fields[key]
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"GGUF metadata {key!r} must be a list of strings ({what}), got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise ValueError(
                f"GGUF metadata {key!r} must be a list of strings ({what}), got {type(item).__name__} "
                f"{item!r} at index {i}"
            )
    return list(value)


def gguf_tokenizer(fields: Mapping[str, Any]):  # noqa: ANN201 - tokenizers.Tokenizer
    """A ``tokenizers.Tokenizer`` from GGUF tokenizer metadata (``tokenizer.ggml.*``).

    Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE): the vocabulary is the stored
    token list, the merges the stored ``"left right"`` pairs, and tokens of type CONTROL or
    USER_DEFINED become special tokens (never split, e.g. ``<|im_start|>``). The
    pre-tokenizer for ``pre == "smollm"`` is GPT-2's byte-level regex with every digit split
    off on its own (as SmolLM2's own ``tokenizer.json`` does); ``"gpt2"`` and ``"default"``
    are plain GPT-2. No BOS is added (``add_bos_token`` is false for SmolLM2).

    Raises:
        TypeError: ``fields`` is not a mapping.
        ValueError: an unsupported tokenizer model or pre-tokenizer, a missing or malformed
            ``tokenizer.ggml.tokens`` or ``tokenizer.ggml.merges`` (the message names the
            key), or duplicate tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if not isinstance(fields, Mapping):
        raise TypeError(
            f"fields must be a mapping of GGUF metadata keys to values (as gguf_metadata returns), "
            f"got {type(fields).__name__}"
        )
    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only the byte-level BPE tokenizer model 'gpt2' is supported, got {model!r}")
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in ("smollm", "gpt2", "default"):
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: 'smollm', 'gpt2', 'default'")
    tokens = _string_list(fields, "tokenizer.ggml.tokens", "the vocabulary, one string per token id")
    merge_lines = _string_list(fields, "tokenizer.ggml.merges", "the BPE merges, 'left right' strings")
    for i, m in enumerate(merge_lines):
        if " " not in m:
            raise ValueError(
                f"GGUF metadata 'tokenizer.ggml.merges' must hold 'left right' strings, got {m!r} at index {i}"
            )
    merges = [tuple(m.split(" ", 1)) for m in merge_lines]
    types = list(fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF token list has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    control, user_defined = 3, 4  # llama.cpp's token types
    special = [t for t, ty in zip(tokens, types) if ty in (control, user_defined)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def gguf_metadata(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The metadata fields of a GGUF file as Python values, without reading its tensors.

    ``path`` defaults to the cached SmolLM2-135M-Instruct file. The chat template, for
    :func:`render_chat`, is ``fields["tokenizer.chat_template"]``.
    """
    if path is None:
        from .pretrained import smollm2_gguf_path

        path = smollm2_gguf_path()
    reader = _gguf_reader(path)
    return {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def render_chat(
    template: str,
    messages: list[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Render ``messages`` (``{"role": ..., "content": ...}`` dicts) with a model's chat template.

    ``template`` is the Jinja2 source stored in the GGUF metadata (``tokenizer.chat_template``,
    the same text as HuggingFace's ``tokenizer_config.json``), rendered in Jinja2's sandbox as
    ``transformers`` does. With ``add_generation_prompt`` the text ends with the header of the
    assistant's turn, ready for generation. Encode the result with the GGUF tokenizer, whose
    special tokens (``<|im_start|>``) are never split.

    Raises:
        TypeError: ``template`` not a string, ``messages`` not a list or tuple, or
            ``add_generation_prompt`` not a bool.
        ValueError: an empty ``template``, a template that is not valid Jinja2 (the message
            gives Jinja's reason and line), an empty ``messages``, or a message without
            string ``role`` and ``content``.
    """
    if not isinstance(template, str):
        raise TypeError(
            f"template must be a non-empty string (the GGUF tokenizer.chat_template), got "
            f"{type(template).__name__}"
        )
    if not template:
        raise ValueError("template must be a non-empty string (the GGUF tokenizer.chat_template)")
    if not isinstance(messages, (list, tuple)):
        raise TypeError(
            f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a mapping with string 'role' and 'content', got {m!r}")
    check_bool(add_generation_prompt, "add_generation_prompt")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        compiled = env.from_string(template)
    except TemplateSyntaxError as exc:
        raise ValueError(
            f"template is not a valid Jinja2 chat template: {exc.message} (line {exc.lineno})"
        ) from exc
    return compiled.render(
        messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt
    )


def _chat_prompt(
    model: LlamaModel,
    tokenizer: Any,
    messages: list[Mapping[str, str]],
    max_new_tokens: int,
    temperature: float,
    template: str | None,
) -> tuple[Tensor, dict[str, Any]]:
    """The checked arguments of a chat: the prompt's ids ``(1, n)`` and the keywords of
    :meth:`LlamaModel.generate` (greedy at temperature 0)."""
    if not isinstance(model, LlamaModel):
        raise TypeError(f"model must be a companion.llama.LlamaModel, got {type(model).__name__}")
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(f"tokenizer must be a tokenizers.Tokenizer (as load_gguf returns), got {type(tokenizer).__name__}")
    if template is None:
        template = model.config.chat_template
        if template is None:
            raise ValueError("template must be given: the model's config has no chat_template (its GGUF file "
                             "stores none); pass the Jinja2 template of the model's chat format")
    temperature = check_finite_number(temperature, "temperature", minimum=0)
    check_positive_int(max_new_tokens, "max_new_tokens", minimum=0)
    ids = torch.tensor([tokenizer.encode(render_chat(template, messages)).ids], dtype=torch.long)
    greedy = temperature == 0
    return ids, {"max_new_tokens": max_new_tokens, "greedy": greedy, "temperature": 1.0 if greedy else temperature}


def generate_chat(
    model: LlamaModel,
    tokenizer: Any,
    messages: list[Mapping[str, str]],
    max_new_tokens: int = 128,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    template: str | None = None,
) -> str:
    """The model's reply to a conversation, as text.

    ``messages`` (``{"role": ..., "content": ...}`` dicts) are rendered with the model's chat
    template (:func:`render_chat`, with the generation prompt), encoded with ``tokenizer``,
    continued by :meth:`LlamaModel.generate` and the new tokens decoded (special tokens such
    as the end-of-turn ``<|im_end|>`` dropped). Generation stops at the model's
    end-of-sequence token or after ``max_new_tokens`` tokens::

        model, tokenizer = load_gguf()
        generate_chat(model, tokenizer, [{"role": "user", "content": "What is 2 + 2?"}])

    Args:
        model: a :class:`LlamaModel` (from :func:`load_gguf`).
        tokenizer: its ``tokenizers.Tokenizer`` (from :func:`load_gguf` or :func:`gguf_tokenizer`).
        messages: the conversation, a non-empty list of ``{"role", "content"}`` dicts.
        max_new_tokens: the most tokens of the reply, an int >= 0.
        temperature: 0 (the default) for greedy decoding, or a finite number > 0 to sample
            at that temperature.
        generator: the ``torch.Generator`` of the sampling (``None``: torch's global one).
        template: a Jinja2 chat template (default: ``model.config.chat_template``, the one
            the GGUF file stores).

    Returns:
        The reply's text. For the reply piece by piece, as it is generated, use
        :func:`stream_chat`, whose pieces concatenate to this text.

    Raises:
        TypeError: ``model`` not a :class:`LlamaModel`, ``tokenizer`` without ``encode`` and
            ``decode``, or a number of the wrong type.
        ValueError: ``temperature`` negative or not finite, ``max_new_tokens < 0``, no
            template (neither given nor in the config), or messages :func:`render_chat`
            refuses.
    """
    ids, kw = _chat_prompt(model, tokenizer, messages, max_new_tokens, temperature, template)
    out = model.generate(ids, kw.pop("max_new_tokens"), kw.pop("greedy"), generator=generator, **kw)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist())


def stream_chat(
    model: LlamaModel,
    tokenizer: Any,
    messages: list[Mapping[str, str]],
    max_new_tokens: int = 128,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    template: str | None = None,
) -> Iterator[str]:
    """:func:`generate_chat`, streamed: an iterator of text pieces, each yielded as soon as its
    tokens are generated (:meth:`LlamaModel.generate_steps`)::

        for piece in stream_chat(model, tokenizer, [{"role": "user", "content": "Hi"}]):
            print(piece, end="", flush=True)

    The pieces concatenate to :func:`generate_chat`'s text for the same arguments (and, when
    sampling, a generator in the same state). A token that ends inside a multi-byte UTF-8
    character decodes to a replacement character until the character's last byte arrives,
    so nothing is yielded while the text decoded so far ends in one; the rest comes at the
    end. The arguments are :func:`generate_chat`'s, checked when ``stream_chat`` is called.

    Returns:
        An iterator of the reply's text pieces (never empty strings).

    Raises:
        TypeError, ValueError: as :func:`generate_chat`.
    """
    ids, kw = _chat_prompt(model, tokenizer, messages, max_new_tokens, temperature, template)
    steps = model.generate_steps(ids, kw.pop("max_new_tokens"), kw.pop("greedy"), generator=generator, **kw)
    return _pieces(tokenizer, steps)


def _pieces(tokenizer: Any, steps: Iterator[Tensor]) -> Iterator[str]:
    """The new text each token of a one-row generation adds (see :func:`stream_chat`)."""
    reply: list[int] = []
    shown = 0
    for nxt in steps:
        reply.append(int(nxt[0]))
        text = tokenizer.decode(reply)
        if len(text) > shown and not text.endswith("\ufffd"):
            yield text[shown:]
            shown = len(text)
    text = tokenizer.decode(reply)
    if len(text) > shown:
        yield text[shown:]


def read_gguf(path: str | os.PathLike[str]) -> tuple[LlamaConfig, dict[str, Tensor], dict[str, Any]]:
    """Read a Llama GGUF file: ``(config, weights, fields)``.

    ``weights`` maps this module's parameter names to float32 tensors, every tensor
    dequantized with ``gguf.quants.dequantize`` and reshaped to torch's ``(out, in)`` order
    (GGUF lists dimensions innermost first). The q/k rows are left in GGUF's interleaved
    order. ``fields`` holds the metadata as Python values.
    """
    reader = _gguf_reader(path)
    path = Path(path)
    gguf = _gguf()
    fields = {name: _field_value(field) for name, field in reader.fields.items()
              if not name.startswith("GGUF.")}
    weights: dict[str, Tensor] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
            name = f"layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
        elif len(parts) == 2 and parts[0] in _TOP_NAMES:
            name = f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
        else:
            raise ValueError(f"unexpected tensor {t.name!r} in {path.name}")
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF ne order is reversed
        array = array.reshape(shape).astype("float32", copy=False)
        if not array.flags.writeable:  # float32 tensors are read-only views of the mapped file
            array = array.copy()
        weights[name] = torch.from_numpy(array)
    config = LlamaConfig.from_gguf_fields(fields, tie_embeddings="output.weight" not in weights)
    return config, weights, fields


def _names(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _check_weights(weights: Mapping[Any, Any], expected: Mapping[str, Tensor]) -> None:
    """``weights`` against the model's state dict: the same names, floating tensors, the same shapes."""
    missing = [k for k in expected if k not in weights]
    if missing:
        raise ValueError(
            f"weights lack {len(missing)} tensor(s) the model needs: {_names(missing)} "
            f"(the names are this module's, as read_gguf returns them)"
        )
    unexpected = [str(k) for k in weights if k not in expected]
    if unexpected:
        raise ValueError(
            f"weights hold {len(unexpected)} tensor(s) the model does not have: {_names(unexpected)} "
            f"(a config of fewer layers, or a tied embedding with an output matrix?)"
        )
    for name, want in expected.items():
        w = weights[name]
        if not isinstance(w, Tensor) or not w.is_floating_point():
            got = f"dtype {w.dtype}" if isinstance(w, Tensor) else type(w).__name__
            raise TypeError(f"weights[{name!r}] must be a floating-point tensor, got {got}")
        if w.shape != want.shape:
            raise ValueError(
                f"weights[{name!r}] has shape {tuple(w.shape)}, but the config needs {tuple(want.shape)}"
            )


def build_model(
    config: LlamaConfig,
    weights: Mapping[str, Tensor],
    layout: str = "half",
    *,
    rope_config: Mapping[str, Any] | None = None,
    convert_qk: bool | None = None,
) -> LlamaModel:
    """A :class:`LlamaModel` from GGUF-ordered ``weights`` (as :func:`read_gguf` returns them).

    ``layout="interleaved"`` uses the q/k rows as stored and rotates adjacent pairs;
    ``layout="half"`` permutes each head's rows with
    ``convert_qk_weight(w, n_heads, "interleaved", "half")`` (``n_kv_heads`` for ``W_k``) and
    rotates halves. ``convert_qk`` overrides that choice: ``False`` with ``"half"`` is the
    wrong model of the layout pitfall (GGUF rows, half rotation). Other tensors are shared
    with ``weights``, not copied; the model is in eval mode without gradients.

    Raises:
        TypeError: ``config`` not a :class:`LlamaConfig`, ``weights`` not a mapping of names
            to floating-point tensors, or ``convert_qk`` not a bool or ``None``.
        ValueError: a bad ``layout``, or ``weights`` that lack a tensor the model needs, hold
            one it does not have, or hold one of another shape (the message names them).
    """
    _check_config(config, "config")
    layout = check_layout(layout)
    if convert_qk is None:
        convert_qk = layout == "half"
    check_bool(convert_qk, "convert_qk")
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"weights must be a mapping of parameter names to tensors (as read_gguf returns), "
            f"got {type(weights).__name__}"
        )
    model = LlamaModel(config, layout=layout, rope_config=rope_config, device="meta")
    _check_weights(weights, model.state_dict())
    state = dict(weights)
    if convert_qk:
        src, dst = ("interleaved", "half") if layout == "half" else ("half", "interleaved")
        for i in range(config.n_layers):
            for key, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads)):
                name = f"layers.{i}.attention.{key}.weight"
                state[name] = convert_qk_weight(state[name], heads, src, dst)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def load_gguf(
    path: str | os.PathLike[str] | None = None,
    layout: str = "half",
    *,
    rope_config: Mapping[str, Any] | None = None,
):  # noqa: ANN201 - (LlamaModel, tokenizers.Tokenizer)
    """Load a Llama GGUF file: ``(LlamaModel, tokenizer)``, every weight in float32.

    ``path`` defaults to the cached SmolLM2-135M-Instruct file
    (:func:`companion.pretrained.smollm2_gguf_path`, which raises ``FileNotFoundError`` with
    the fetch command if it is missing). ``layout`` is the RoPE layout of the model (see
    :func:`build_model`); both give the same logits. ``rope_config`` installs a chapter-9
    scaling config.
    """
    if path is None:
        from .pretrained import smollm2_gguf_path

        path = smollm2_gguf_path()
    config, weights, fields = read_gguf(path)
    return build_model(config, weights, layout, rope_config=rope_config), gguf_tokenizer(fields)
