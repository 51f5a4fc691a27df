"""The attention dispatcher: the fastest correct path for each scheme.

Every attention path of the package is in one of three modules: the reference
:func:`companion.attention.attention` (all four hooks, the ``L x L`` logits materialised),
the memory-lean :func:`companion.blockwise.bias_attention` (a bias, one tile at a time) and
this module, which picks between them and torch's fused
``torch.nn.functional.scaled_dot_product_attention`` (SDPA) by the hooks a scheme overrides
(:meth:`~companion.attention.PositionScheme.hooks`). :func:`fast_attention` computes the
same function as the reference; :func:`attention_path` names the path it takes:

==================  =======================================================================
path                when
==================  =======================================================================
``"reference"``     ``return_weights=True``; a scheme with the ``score`` hook (Shaw,
                    Transformer-XL), or a grid scheme with a ``bias`` hook; a NaN or infinite value in ``q``, ``k`` or ``v``; a
                    floating ``attn_mask`` holding NaN or ``+inf``; an empty batch or
                    sequence
``"sdpa-causal"``   no ``bias`` hook (NoPE, the ``embed`` schemes, RoPE after ``rotate``),
                    ``causal=True``, no ``attn_mask``, and query and key positions that are
                    consecutive and start at the same position (self-attention): SDPA with
                    ``is_causal=True``
``"sdpa-mask"``     no ``bias`` hook otherwise: SDPA with a mask built from the positions
                    (``k_pos <= q_pos`` when causal) and ``attn_mask``, or none
``"sdpa-bias"``     a ``bias`` hook (ALiBi, T5) at short lengths: ``q_len * k_len <=``
                    :data:`SDPA_BIAS_PAIRS` (a bias without a gradient) or
                    :data:`SDPA_GRAD_BIAS_PAIRS` (with one, T5's table), and a ``(batch | 1,
                    heads, q_len, k_len)`` float mask (bias, ``attn_mask``, ``-inf`` where
                    masked) within :data:`SDPA_MASK_BYTES`: SDPA with that mask
``"blockwise"``     a ``bias`` hook otherwise, or a mask over the budget:
                    :func:`~companion.blockwise.bias_attention`, the bias and the masks one
                    tile at a time, with tiles sized by :func:`block_size_for`
``"query-blocks"``  before all of the above except ``"reference"`` for non-finite inputs:
                    no gradient wanted (``torch.no_grad``, or no input or scheme parameter
                    that requires one), causal self-attention over consecutive 1-D
                    positions, no ``attn_mask``, ``q_len = k_len`` above
                    :data:`QUERY_BLOCK`, and a ``score`` hook, or a ``bias`` hook past
                    :data:`SDPA_BIAS_PAIRS`: the queries in blocks of :data:`QUERY_BLOCK`,
                    each against only the keys the causal mask lets it see (see below)
==================  =======================================================================

The thresholds were measured on the book's machine by ``benchmarks/attention_paths_cpu.py``
(one thread, batch 8, 4 heads, head dim 16, causal, forward plus backward, ``L = 128 ..
2048``; the times below are multiples of SDPA with ``is_causal`` at the same length):

==========================  =====  =====  =====  =====  =====
``L``                         128    256    512   1024   2048
==========================  =====  =====  =====  =====  =====
ALiBi, SDPA float mask       1.07   1.30   1.21   1.74   2.13
ALiBi, blockwise             2.68   2.14   1.59   1.46   1.62
T5, SDPA float mask          2.56   3.19   3.34   4.42   5.97
T5, blockwise                2.98   2.45   1.81   1.51   1.71
==========================  =====  =====  =====  =====  =====

* A bias without a gradient (ALiBi) is fastest as an SDPA float mask up to ``L = 512``;
  at ``L = 1024`` the two paths are within about 15% of each other (which one wins varies
  from run to run: 1.60 against 1.71 in a second run), and from ``L = 2048`` on the
  blockwise path wins, where building and reading the ``L x L`` mask costs more than the
  tiles. Past ``512 ** 2`` pairs the blockwise path is taken, which also never holds the
  mask.
* A bias with a gradient (T5's table) makes SDPA fall back to its unfused math kernel,
  which builds several ``L x L`` tensors per head; the blockwise path is faster from
  ``L = 256`` on.
* SDPA's fused kernel needs a 4-D mask: a 3-D ``(heads, L, L)`` one runs about five times
  slower, so every mask is given four dimensions.
* The blockwise path is fastest with small tiles here (at ``L = 512``, tiles of 64 take a
  third of the time of one ``512 x 512`` tile): see :func:`block_size_for`.

**Evaluation at long lengths** (the lab's, chapter 8) wants no gradient, and there a simpler
path wins: the query positions in blocks of :data:`QUERY_BLOCK`, each block against the keys
up to its last position (the causal mask hides the rest, so the work halves), with one fused
SDPA call per block whose float mask is the block's bias (and, for a ``score`` hook without
a value term, Transformer-XL's, the block's score times the scale), or the reference on the
block for a scheme with a value term (Shaw). ``benchmarks/eval_attention_cpu.py`` measures it
against the path taken before (blockwise for a bias, the reference for a score): forward only,
the lab's schemes, batch 8, 4 heads, head dim 16, one thread, ``L = 2048``, as multiples of SDPA
``is_causal`` without a bias (0.18 s), one run of ``--lengths 2048 --repeats 3`` on a loaded
2-core machine:

==============  =====  =====  ==========  =====  =====  =====  =====
scheme          ALiBi  T5     Kerple log  FIRE   Shaw   T-XL   CoPE
==============  =====  =====  ==========  =====  =====  =====  =====
query-blocks    1.34   1.79   1.59        2.49   10.2   7.2    22.0
before          2.01   2.07   2.08        3.40   21.5   25.0   85.6
speedup         1.50   1.15   1.31        1.36   2.11   3.48   3.89
==============  =====  =====  ==========  =====  =====  =====  =====

Precision follows the reference: float16 and bfloat16 inputs are computed in float32 and
the output cast back; float32 and float64 run in their own dtype. On the SDPA paths a
query that may attend no key gets a zero output and zero gradients, as in the reference
(torch's CPU kernels do this, and the tests check it; other devices are not checked). NaN and infinite values take the
reference, whose rule (a query sees only the non-finite values of the keys it may attend)
SDPA does not keep.

A layer stack that shares one scheme and one set of positions (the model's blocks) can pass
the same ``cache`` dict to every call, so the mask and bias are built once per forward pass
and shared (their gradients, T5's, add up over the layers). The dict must be fresh for every
new set of positions, masks or scheme state: :class:`companion.model.TinyDecoder` makes one
per forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_bool, contiguous_start
from .attention import (
    PositionScheme,
    _as_scheme,
    _check_hook_shape,
    _Prologue,
    _prologue,
    _rotate_checked,
    attention,
    causal_mask,
)
from .blockwise import _as4d, bias_attention

__all__ = [
    "ATTENTION_PATHS",
    "SDPA_BIAS_PAIRS",
    "SDPA_GRAD_BIAS_PAIRS",
    "SDPA_MASK_BYTES",
    "QUERY_BLOCK",
    "attention_path",
    "block_size_for",
    "fast_attention",
]

#: The paths :func:`attention_path` can name, from the most to the least specialised.
ATTENTION_PATHS: tuple[str, ...] = ("sdpa-causal", "sdpa-mask", "sdpa-bias", "blockwise", "query-blocks",
                                    "reference")

#: Queries per block on the ``"query-blocks"`` path (see the module docstring).
QUERY_BLOCK = 256

#: The largest mask (in bytes) the SDPA paths build; a larger one takes the blockwise path,
#: which never holds an ``L x L`` tensor. 256 MiB is a float32 mask of 4 heads at ``L = 4096``.
SDPA_MASK_BYTES = 1 << 28

#: The most ``q_len * k_len`` pairs for which a bias without a gradient (ALiBi) takes the
#: SDPA float mask rather than the blockwise path, ``512 ** 2`` (measured, see the module
#: docstring).
SDPA_BIAS_PAIRS = 1 << 18

#: The same limit for a bias with a gradient (T5's table), ``128 ** 2``, since SDPA's math
#: kernel is faster at ``L = 128`` and the blockwise path from ``L = 256`` on.
SDPA_GRAD_BIAS_PAIRS = 1 << 14


def block_size_for(batch_heads: int, length: int) -> int:
    """The tile size the dispatcher gives :func:`~companion.blockwise.bias_attention`.

    The largest power of two ``s`` in ``[64, 512]`` whose ``batch_heads * s * s`` logits
    tile holds at most ``2**17`` entries (``length <= 512``) or ``2**19`` (longer): at ``L =
    512`` with batch 8 and 4 heads, tiles of 64 (forward plus backward 1.5 times SDPA's
    causal time) against 128 (1.8 times) and 512 (4.7 times); at ``L = 2048``, 128 (1.6
    times) against 64 (2.0) and 256 (2.1). Larger tiles cost more in allocations and cache
    misses than they save in fewer, larger matrix products.

    Args:
        batch_heads: ``batch * heads``, at least 1.
        length: the longer of ``q_len`` and ``k_len``.

    Returns:
        The tile size, a power of two from 64 to 512.
    """
    budget = (1 << 17) if length <= 512 else (1 << 19)
    size = 512
    while size > 64 and batch_heads * size * size > budget:
        size //= 2
    return size


def _bias_needs_grad(scheme: PositionScheme) -> bool:
    """Whether the scheme's bias will carry a gradient (trainable parameters, grad mode on)."""
    return torch.is_grad_enabled() and any(p.requires_grad for p in scheme.parameters())


def _finite(*xs: Tensor) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in xs)


def _choose(pro: _Prologue, scheme: PositionScheme, q: Tensor, k: Tensor, v: Tensor,
            return_weights: bool) -> str:
    """The path for validated arguments (see the module docstring for the rules)."""
    hooks = scheme.hooks()
    if return_weights or 0 in (pro.batch, pro.q_len, pro.k_len):
        return "reference"
    if not _finite(q, k, v):
        return "reference"
    add = pro.additive
    if add is not None and bool((torch.isnan(add) | torch.isposinf(add)).any()):
        return "reference"
    assert pro.q_order is not None and pro.k_order is not None
    if _query_blocks_apply(pro, scheme, hooks, q, k, v):
        return "query-blocks"
    if "score" in hooks:
        return "reference"
    if scheme.position_axes > 1 and "bias" in hooks:
        return "reference"  # the blockwise path tiles 1-D positions only
    per_row = pro.q_order.dim() == 2 or pro.k_order.dim() == 2
    pairs = pro.q_len * pro.k_len
    if "bias" in hooks:
        if _mask_bytes(pro, per_row, with_bias=True) > SDPA_MASK_BYTES:
            return "blockwise"
        limit = SDPA_GRAD_BIAS_PAIRS if _bias_needs_grad(scheme) else SDPA_BIAS_PAIRS
        return "sdpa-bias" if pairs <= limit else "blockwise"
    if pro.causal and pro.allowed is None and add is None and not per_row:
        start = contiguous_start(pro.q_order)
        if start is not None and start == contiguous_start(pro.k_order):
            return "sdpa-causal"
    if _mask_bytes(pro, per_row, with_bias=False) > SDPA_MASK_BYTES:
        return "blockwise"
    return "sdpa-mask"


def _wants_grad(scheme: PositionScheme, *xs: Tensor) -> bool:
    """Whether autograd will record this call (grad mode on and something requires a grad)."""
    return torch.is_grad_enabled() and (any(x.requires_grad for x in xs)
                                        or any(p.requires_grad for p in scheme.parameters()))


def _query_blocks_apply(pro: _Prologue, scheme: PositionScheme, hooks: tuple[str, ...],
                        q: Tensor, k: Tensor, v: Tensor) -> bool:
    """The ``"query-blocks"`` rule of the module docstring."""
    if not pro.causal or pro.allowed is not None or pro.additive is not None or scheme.position_axes > 1:
        return False
    if pro.q_len != pro.k_len or pro.q_len <= QUERY_BLOCK or pro.q_order.dim() != 1 or pro.k_order.dim() != 1:
        return False
    if "score" not in hooks and not ("bias" in hooks and pro.q_len * pro.k_len > SDPA_BIAS_PAIRS):
        return False
    start = contiguous_start(pro.q_order)
    if start is None or start != contiguous_start(pro.k_order):
        return False
    return not _wants_grad(scheme, q, k, v)


def _query_blocks(q: Tensor, k: Tensor, v: Tensor, scheme: PositionScheme, pro: _Prologue) -> Tensor:
    """The ``"query-blocks"`` path: causal self-attention, queries in blocks of :data:`QUERY_BLOCK`.

    Block ``[a, e)`` attends to keys ``[0, e)``, which hold every key its queries may see.
    A scheme with a value term (``score_values``, Shaw) runs the reference on each block;
    any other gets one SDPA call per block with the float mask ``scale * score + bias``
    (``-inf`` above the diagonal), which is what the reference adds to ``scale * q k^T``.
    Rotation is per position, so rotating a block with its own positions rotates it as the
    whole sequence would.
    """
    assert pro.q_pos is not None and pro.k_pos is not None
    hooks = scheme.hooks()
    with_values = "score" in hooks and type(scheme).score_values is not PositionScheme.score_values
    if not with_values and "rotate" in hooks:
        q, k = _rotate_checked(scheme, q, k, pro.q_pos, pro.k_pos)
    qw, kw, vw = pro.operands(q, k, v)
    b, h, n = pro.batch, pro.heads, pro.q_len
    outs = []
    for a in range(0, n, QUERY_BLOCK):
        e = min(n, a + QUERY_BLOCK)
        qp, kp = pro.q_pos[a:e], pro.k_pos[:e]
        if with_values:
            # the reference rotates (if the scheme does) with the block's own positions
            outs.append(attention(q[:, :, a:e], k[:, :, :e], v[:, :, :e], scheme, qp, kp, causal=True,
                                  scale=pro.scale).to(pro.work))
            continue
        want = (b, h, e - a, e)
        tile = torch.zeros((), dtype=pro.work, device=q.device)
        if "score" in hooks:
            extra = scheme.score(qw[:, :, a:e], kw[:, :, :e], qp, kp)
            _check_hook_shape(extra, want, scheme, "score", "(batch, heads, q_len, k_len)")
            tile = extra.to(pro.work) * pro.scale
        if "bias" in hooks:
            bias = scheme.bias(qp, kp)
            _check_hook_shape(bias, want, scheme, "bias", "(batch, heads, q_len, k_len)")
            tile = tile + bias.to(pro.work)
        tile = _as4d(tile).masked_fill(~causal_mask(pro.q_order[a:e], pro.k_order[:e]), float("-inf"))
        outs.append(F.scaled_dot_product_attention(qw[:, :, a:e], kw[:, :, :e], vw[:, :, :e], attn_mask=tile,
                                                   scale=pro.scale))
    return torch.cat(outs, dim=2).to(q.dtype)


def _mask_bytes(pro: _Prologue, per_row: bool, with_bias: bool) -> int:
    """The size of the mask :func:`_sdpa_mask` would build: the broadcast of the causal mask
    ``(batch | 1, 1, q_len, k_len)``, the bias ``(batch | 1, heads, q_len, k_len)`` and
    ``attn_mask``; bool unless a bias or a float mask is part of it; 0 if there is none."""
    rows = pro.batch if per_row else 1
    shapes = [tuple(_as4d(m).shape) for m in (pro.allowed, pro.additive) if m is not None]
    if pro.causal:
        shapes.append((rows, 1, pro.q_len, pro.k_len))
    if with_bias:
        shapes.append((rows, pro.heads, pro.q_len, pro.k_len))
    if not shapes:
        return 0
    floating = with_bias or pro.additive is not None
    itemsize = torch.finfo(pro.work).bits // 8 if floating else 1
    return math.prod(torch.broadcast_shapes(*shapes)) * itemsize


def _visible(pro: _Prologue) -> Tensor | None:
    """Bool ``True`` = attend, 4-D, from the causal mask and a bool ``attn_mask``; or None."""
    assert pro.q_order is not None and pro.k_order is not None
    vis = None
    if pro.causal:
        c = causal_mask(pro.q_order, pro.k_order)
        vis = _as4d(c if c.dim() == 2 else c.unsqueeze(1))
    if pro.allowed is not None:
        allowed = _as4d(pro.allowed)
        vis = allowed if vis is None else vis & allowed
    return vis


def _sdpa_mask(path: str, pro: _Prologue, scheme: PositionScheme) -> Tensor | None:
    """The ``attn_mask`` SDPA gets on ``path``: bool, float (bias, additive, ``-inf``) or None."""
    assert pro.q_pos is not None and pro.k_pos is not None
    vis = _visible(pro)
    terms = []
    if path == "sdpa-bias":
        bias = scheme.bias(pro.q_pos, pro.k_pos)
        if bias is not None:
            want = (pro.batch, pro.heads, pro.q_len, pro.k_len)
            _check_hook_shape(bias, want, scheme, "bias", "(batch, heads, q_len, k_len)")
            terms.append(_as4d(bias.to(pro.work)))
    if pro.additive is not None:
        terms.append(_as4d(pro.additive.to(pro.work)))
    if not terms:
        return vis
    total = terms[0] if len(terms) == 1 else terms[0] + terms[1]
    total = _as4d(total)
    if vis is not None:
        total = total.masked_fill(~vis, float("-inf"))
    return total


def attention_path(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scheme: PositionScheme | None = None,
    q_pos: Tensor | Sequence[int] | None = None,
    k_pos: Tensor | Sequence[int] | None = None,
    *,
    causal: bool = False,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> str:
    """The path :func:`fast_attention` takes for these arguments, one of :data:`ATTENTION_PATHS`.

    Validates the arguments exactly as :func:`fast_attention` does, then applies the rules
    of the module docstring; computes no attention.

    Args:
        q, k, v, scheme, q_pos, k_pos, causal, attn_mask, scale, return_weights: as in
            :func:`fast_attention`.

    Returns:
        ``"sdpa-causal"``, ``"sdpa-mask"``, ``"sdpa-bias"``, ``"blockwise"``,
        ``"query-blocks"`` or ``"reference"``.

    Raises:
        TypeError, ValueError: as :func:`companion.attention.attention` documents.
    """
    scheme = _as_scheme(scheme)
    pro = _prologue(q, k, v, scheme, q_pos, k_pos, causal=causal, scale=scale, attn_mask=attn_mask)
    return _choose(pro, scheme, q, k, v, check_bool(return_weights, "return_weights"))


def fast_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scheme: PositionScheme | None = None,
    q_pos: Tensor | Sequence[int] | None = None,
    k_pos: Tensor | Sequence[int] | None = None,
    *,
    causal: bool = False,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
    cache: dict | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with any scheme, by the fastest correct path: the reference's result.

    Computes what :func:`companion.attention.attention` computes, ``softmax(scale * (q k^T +
    score) + bias) v + score_values`` after ``rotate`` (Vaswani et al.,
    :cite:`vaswani2017attention`), with the same arguments, defaults, errors and
    masked-row rule, but through torch's fused ``scaled_dot_product_attention`` (the
    FlashAttention algorithm on CPU, :cite:`dao2022flashattention`) or the blockwise
    :func:`~companion.blockwise.bias_attention` whenever the scheme allows: see the module
    docstring, and :func:`attention_path` for the choice. Results agree with the reference
    to rounding (the summation order differs), forward and backward, gradients of scheme
    parameters (T5's table) included.

    Args:
        q: queries, ``(batch, heads, q_len, head_dim)``.
        k: keys, ``(batch, kv_heads, k_len, head_dim)``; ``heads`` a multiple of ``kv_heads``.
        v: values, ``(batch, kv_heads, k_len, v_dim)``.
        scheme: the position scheme; ``None`` means :class:`~companion.attention.NoPE`.
        q_pos, k_pos: integer positions, ``(len,)`` or ``(batch, len)``; defaults as in
            :func:`~companion.attention.attention` (keys ``arange(k_len)``, queries the last
            ``q_len`` of them); ``(len, A)`` or ``(batch, len, A)`` for a grid scheme.
        causal: mask keys whose position is later than the query's (by sequence index for
            a grid scheme, as in :func:`~companion.attention.attention`). A ``bool``.
        attn_mask: bool (``True`` = attend), integer (1 = attend, 0 = masked) or floating
            (added to the logits) mask, broadcastable to ``(batch, heads, q_len, k_len)``.
        scale: logit scale, a finite number > 0; default ``1 / sqrt(head_dim)``.
        return_weights: also return the attention weights (always the reference path).
        cache: optional dict shared by calls with the same scheme, positions, mask, causal
            flag, shapes and dtype (the layers of one forward pass), so that the mask and
            bias are built once; ``None`` builds them per call.

    Returns:
        The output ``(batch, heads, q_len, v_dim)`` in ``q``'s dtype (and the weights if
        asked). Half-precision inputs are computed in float32.

    Raises:
        TypeError: a wrong type (float positions, ``causal="False"``, a scheme that is not a
            :class:`~companion.attention.PositionScheme`).
        ValueError: bad shapes, values or masks; a scheme built for another number of heads.
    """
    scheme = _as_scheme(scheme)
    pro = _prologue(q, k, v, scheme, q_pos, k_pos, causal=causal, scale=scale, attn_mask=attn_mask)
    return_weights = check_bool(return_weights, "return_weights")
    path = _choose(pro, scheme, q, k, v, return_weights)
    if path == "reference":
        return attention(q, k, v, scheme, pro.q_pos, pro.k_pos, causal=pro.causal,
                         attn_mask=attn_mask, scale=pro.scale, return_weights=return_weights)
    if path == "query-blocks":
        return _query_blocks(q, k, v, scheme, pro)
    assert pro.q_pos is not None and pro.k_pos is not None
    if "rotate" in scheme.hooks():
        q, k = _rotate_checked(scheme, q, k, pro.q_pos, pro.k_pos)
    if path == "blockwise":
        bias_fn = scheme.bias if "bias" in scheme.hooks() else None
        block = block_size_for(pro.batch * pro.heads, max(pro.q_len, pro.k_len))
        # a grid scheme has no bias here (see _choose): the tiles need only the causal order
        return bias_attention(q, k, v, bias_fn, causal=pro.causal, block_size=block, scale=pro.scale,
                              q_pos=pro.q_order, k_pos=pro.k_order, attn_mask=attn_mask)
    qw, kw, vw = pro.operands(q, k, v)
    if path == "sdpa-causal":
        out = F.scaled_dot_product_attention(qw, kw, vw, is_causal=True, scale=pro.scale)
        return out.to(q.dtype)
    key = (path, pro.work, q.device)
    if cache is not None and key in cache:
        mask = cache[key]
    else:
        mask = _sdpa_mask(path, pro, scheme)
        if cache is not None:
            cache[key] = mask
    out = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=mask, scale=pro.scale)
    return out.to(q.dtype)
