"""A multi-head attention layer and a tiny decoder-only language model that take any scheme.

Small enough to read in one sitting (in the spirit of nanoGPT), and the model every
experiment in the book trains: swap the ``scheme`` and nothing else changes. One scheme
instance is shared by all layers, as T5 shares its relative bias; ``embed`` is applied once
to the token embeddings, ``rotate``/``bias``/``score`` inside every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import as_positions, check_bool, check_choice, check_positive_int, check_tensor
from .attention import NoPE, PositionScheme, attention
from .dispatch import fast_attention

__all__ = ["ATTENTION_IMPLS", "MultiHeadAttention", "TinyDecoder", "nope_every"]

#: The values ``attention_impl`` takes, ``"auto"`` (:func:`companion.dispatch.fast_attention`,
#: the fastest correct path per scheme) or ``"reference"`` (:func:`companion.attention.attention`).
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "reference")


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
    ) -> None:
        super().__init__()
        check_positive_int(d_model, "d_model")
        check_positive_int(n_heads, "n_heads")
        check_bool(bias, "bias")
        self.window = None if window is None else check_positive_int(window, "window")
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
        if self.attention_impl == "reference" or return_weights:
            res = attention(
                q, k, v, self.scheme, pos, pos,
                causal=causal, attn_mask=attn_mask, return_weights=return_weights, window=self.window,
            )
        else:
            res = fast_attention(q, k, v, self.scheme, pos, pos, causal=causal, attn_mask=attn_mask,
                                 cache=cache, window=self.window)
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


def _check_scheme(scheme: object, n_heads: int) -> PositionScheme:
    """``None`` means NoPE; a scheme must be a PositionScheme that fits ``n_heads`` heads."""
    scheme = NoPE() if scheme is None else scheme
    if not isinstance(scheme, PositionScheme):
        raise TypeError(f"scheme must be a companion PositionScheme or None, got {type(scheme).__name__}")
    scheme.check_heads(n_heads)
    return scheme


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, scheme: PositionScheme,
                 n_kv_heads: int | None, attention_impl: str = "auto", window: int | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, scheme, n_kv_heads, attention_impl=attention_impl,
                                       window=window)
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
        self.blocks = nn.ModuleList(
            _Block(d_model, n_heads, d_ff, nope if i in self.nope_layers else self.scheme, n_kv_heads,
                   attention_impl, window if i in self.window_layers else None) for i in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok.weight
        self.apply(self._init)

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
        caches: dict[tuple[int, int | None], dict] = {}
        for block in self.blocks:
            x = block(x, pos, attn_mask, caches.setdefault((id(block.attn.scheme), block.attn.window), {}))
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
