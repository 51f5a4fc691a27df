"""Memory-lean attention for any additive position bias, one tile at a time.

:func:`bias_attention` computes ``softmax(scale * q k^T + bias(q_pos, k_pos)) v`` for any
additive-bias scheme (ALiBi, T5's bucketed bias, a learned table) without ever holding the
``L x L`` logits or bias. It works one ``(query block, key block)`` tile at a time inside an
online-softmax loop (Milakov and Gimelshein, :cite:`milakov2018online`; Rabe and Staats,
:cite:`rabe2021self`; Dao et al., :cite:`dao2022flashattention`), asking the scheme for the
bias of one tile at a time. Its extra memory is one ``block_q x block_k`` logits tile per
(batch, head) pair plus ``O(L x head_dim)`` for the output and a re-laid-out copy of ``q``
and ``k``; a causal call skips key tiles that lie entirely in the future.

A naive implementation materialises a ``heads x L x L`` bias tensor: 8 GiB in float32 for 8
heads at ``L = 16384``. This one never does. It serves every bias scheme (ALiBi in
:mod:`companion.alibi`, T5 in :mod:`companion.relative`), the CPU path of
:func:`companion.kernels.flash_attention_with_bias`, and the bias path of the dispatcher
:func:`companion.dispatch.fast_attention`. Its arguments are validated by the same prologue
as the reference :func:`companion.attention.attention`.

The pieces: ``_Plan`` holds what the forward and backward loops share (tiles, positions, the
bias function, masks); ``_Tiles`` lays ``q`` and ``k`` out once so every tile product is a
dense batched GEMM; ``_forward`` is the online-softmax loop; ``_BiasAttention`` is the
autograd function whose backward recomputes each tile (FlashAttention-2's recomputation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ._checks import check_positive_int, check_tensor, contiguous_start
from ._checks import nonfinite_flags, restore_nonfinite, zero_nonfinite
from .attention import PositionScheme, _prologue, causal_mask

__all__ = ["BiasFn", "bias_attention"]

#: The type of a bias function ``bias_fn(q_pos_tile, k_pos_tile)``, which returns a tensor
#: that broadcasts to ``(batch, heads, tile_q, tile_k)``, or ``None``.
BiasFn = Callable[[Tensor, Tensor], "Tensor | None"]


def _block_sizes(block_size: object) -> tuple[int, int]:
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"block_size must be an int or a pair (block_q, block_k), got {block_size!r}")
        return (check_positive_int(block_size[0], "block_size[0]"),
                check_positive_int(block_size[1], "block_size[1]"))
    bs = check_positive_int(block_size, "block_size")
    return bs, bs


def _is_relative(bias_fn: object) -> bool:
    """Whether ``bias_fn`` declares that its bias depends only on ``k_pos - q_pos``: the
    function, or the module it is a bound method of, has ``relative_bias = True``."""
    owner = getattr(bias_fn, "__self__", bias_fn)
    return bool(getattr(bias_fn, "relative_bias", False) or getattr(owner, "relative_bias", False))


def _bias_parameters(bias_fn: object) -> list[Tensor]:
    """Trainable tensors a bias function depends on, found through its module."""
    owner = bias_fn if isinstance(bias_fn, nn.Module) else getattr(bias_fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return [p for p in owner.parameters() if p.requires_grad]
    return []


class _Plan:
    """Everything the forward and backward loops share: tiles, positions, the bias."""

    def __init__(self, bias_fn: BiasFn | None, causal: bool, scale: float, bq: int, bk: int,
                 q_pos: Tensor, k_pos: Tensor, shape: tuple[int, int, int, int],
                 allowed: Tensor | None = None, additive: Tensor | None = None,
                 nonfinite: bool = False) -> None:
        self.bias_fn, self.causal, self.scale, self.shape = bias_fn, causal, scale, shape
        # attn_mask as 4-D broadcastable views (True = attend / added to the logits), and
        # whether q, k or v hold a non-finite value (then -inf biases must mask, see _forward).
        self.allowed = None if allowed is None else _as4d(allowed)
        self.additive = None if additive is None else _as4d(additive)
        self.nonfinite = nonfinite
        lq, lk = q_pos.shape[-1], k_pos.shape[-1]
        self.q_pos, self.k_pos = q_pos, k_pos
        self.q_blocks = [(s, min(s + bq, lq)) for s in range(0, lq, bq)]
        self.k_blocks = [(s, min(s + bk, lk)) for s in range(0, lk, bk)]
        if causal:
            # Per block, over the batch too: the earliest and latest position.
            self.q_lo = [int(q_pos[..., s:e].min()) for s, e in self.q_blocks]
            self.q_hi = [int(q_pos[..., s:e].max()) for s, e in self.q_blocks]
            self.k_lo = [int(k_pos[..., s:e].min()) for s, e in self.k_blocks]
            self.k_hi = [int(k_pos[..., s:e].max()) for s, e in self.k_blocks]

        self.relative = (_is_relative(bias_fn) and contiguous_start(q_pos) is not None
                         and contiguous_start(k_pos) is not None)

    def visible(self, qi: int, ki: int) -> bool:
        """False when every key of block ``ki`` is in the future of every query of ``qi``."""
        return not self.causal or self.k_lo[ki] <= self.q_hi[qi]

    def schedule(self) -> list[list[tuple[int, int]]]:
        """The visible tiles, in groups that share one bias tile.

        For a bias that depends only on ``k_pos - q_pos`` (``relative_bias``) and positions
        that are shared and consecutive, two tiles of the same shape whose first key minus
        first query position agree have identical biases: each such diagonal of tiles is
        one group, and its bias is computed once. Otherwise every tile is its own group.
        """
        tiles = [(qi, ki) for qi in range(len(self.q_blocks)) for ki in range(len(self.k_blocks))
                 if self.visible(qi, ki)]
        if not self.relative:
            return [[t] for t in tiles]
        q0, k0 = int(self.q_pos[0]), int(self.k_pos[0])
        groups: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        for qi, ki in tiles:
            (qs, qe), (ks, ke) = self.q_blocks[qi], self.k_blocks[ki]
            groups.setdefault((k0 + ks - q0 - qs, qe - qs, ke - ks), []).append((qi, ki))
        return list(groups.values())

    def bias(self, qi: int, ki: int) -> Tensor | None:
        """The bias tile for query block ``qi`` and key block ``ki``, shape-checked, as
        returned by ``bias_fn`` (broadcastable to ``(batch, heads, tile_q, tile_k)``)."""
        if self.bias_fn is None:
            return None
        (qs, qe), (ks, ke) = self.q_blocks[qi], self.k_blocks[ki]
        tile = self.bias_fn(self.q_pos[..., qs:qe], self.k_pos[..., ks:ke])
        if tile is None:
            return None
        if not isinstance(tile, Tensor) or not tile.is_floating_point():
            got = tile.dtype if isinstance(tile, Tensor) else type(tile).__name__
            raise TypeError(f"bias_fn must return a floating-point tensor or None, got {got}")
        b, h = self.shape[:2]
        want = (b, h, qe - qs, ke - ks)
        try:
            ok = torch.broadcast_shapes(tile.shape, want) == want
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"bias_fn returned shape {tuple(tile.shape)} for a tile of {qe - qs} query and "
                f"{ke - ks} key positions; it must broadcast to (batch, heads, q_len, k_len) = "
                f"{want}. A bias function gets the positions of one tile, not the whole sequence"
            )
        return tile

    def bias3d(self, qi: int, ki: int, dtype: torch.dtype) -> Tensor | None:
        """The bias tile as a ``(batch * heads, tile_q, tile_k)``-broadcastable tensor."""
        tile = self.bias(qi, ki)
        if tile is None:
            return None
        b, h = self.shape[:2]
        tile = tile.to(dtype)
        if tile.dim() <= 2 or (tile.dim() == 3 and (b == 1 or tile.shape[0] == 1)):
            return tile  # broadcasts against (b * h, tile_q, tile_k) as it is
        tq, tk = tile.shape[-2:]
        full = tile.expand(b, h, tq, tk)
        return full[0] if b == 1 else full.reshape(b * h, tq, tk)

    def mask(self, qi: int, ki: int) -> Tensor | None:
        """Boolean ``True`` = masked, broadcastable to ``(batch * heads, tile_q, tile_k)``
        viewed as ``(batch, heads, ...)``, or ``None`` if the tile needs no mask."""
        (qs, qe), (ks, ke) = self.q_blocks[qi], self.k_blocks[ki]
        hidden = None
        if self.causal and self.k_hi[ki] > self.q_lo[qi]:  # else every key is in the past
            hidden = ~causal_mask(self.q_pos[..., qs:qe], self.k_pos[..., ks:ke])
            hidden = hidden if hidden.dim() == 2 else hidden.unsqueeze(1)
        if self.allowed is not None:
            blocked = ~_tile(self.allowed, qs, qe, ks, ke)
            hidden = blocked if hidden is None else hidden | blocked
        return hidden

    def add_mask(self, qi: int, ki: int) -> Tensor | None:
        """The additive ``attn_mask`` of one tile, ``(batch | 1, heads | 1, tile_q, tile_k)``."""
        if self.additive is None:
            return None
        (qs, qe), (ks, ke) = self.q_blocks[qi], self.k_blocks[ki]
        return _tile(self.additive, qs, qe, ks, ke)


def _as4d(mask: Tensor) -> Tensor:
    """View a mask that broadcasts to ``(batch, heads, q, k)`` with exactly 4 dimensions."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _tile(mask: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """One tile of a 4-D broadcastable mask; broadcast (size-1) axes stay size 1."""
    rows = mask if mask.shape[-2] == 1 else mask[..., qs:qe, :]
    return rows if rows.shape[-1] == 1 else rows[..., ks:ke]


class _Tiles:
    """Contiguous ``(batch * heads, ...)`` tiles of the scaled queries and transposed keys,
    laid out once so every tile product is a dense batched GEMM."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> None:
        b, h, lq, d = q.shape
        self.b, self.h = b, h
        self.q = [(q[:, :, s:e] * plan.scale).reshape(b * h, e - s, d) for s, e in plan.q_blocks]
        self.kt = [k[:, :, s:e].transpose(-1, -2).reshape(b * h, d, e - s) for s, e in plan.k_blocks]
        self.v = v.reshape(b * h, v.shape[2], v.shape[3])

    def logits(self, plan: _Plan, qi: int, ki: int, tile: Tensor | None,
               out: Tensor | None = None) -> Tensor:
        """``scale * q k^T + tile`` for one tile, ``(batch * heads, tile_q, tile_k)``, with
        masked entries at ``-inf``; written into ``out`` when given."""
        q, kt = self.q[qi], self.kt[ki]
        kw = {} if out is None else {"out": out}
        s = torch.bmm(q, kt, **kw) if tile is None else torch.baddbmm(tile, q, kt, **kw)
        s4 = s.view(self.b, self.h, *s.shape[1:])
        add = plan.add_mask(qi, ki)
        if add is not None:
            s4.add_(add.to(s.dtype))
        if plan.nonfinite:
            # nan + -inf is nan: a -inf bias or mask entry must hide a non-finite logit too.
            if tile is not None:
                s.masked_fill_(tile == float("-inf"), float("-inf"))
            if add is not None:
                s4.masked_fill_(add == float("-inf"), float("-inf"))
        hidden = plan.mask(qi, ki)
        if hidden is not None:
            s4.masked_fill_(hidden, float("-inf"))
        return s


# exp() of a shifted logit below about -87 (float32) returns a denormal or 0, and on x86 CPUs
# that case runs 10 to 40 times slower than the normal one (measured on the book's machine,
# also for -inf inputs); a GEMM that reads denormals slows down as much. With ALiBi's long
# distances and the causal mask, a large share of every tile lands there. So the shifted
# logits are clamped to _EXP_FLOOR before exp (all results stay normal numbers), and results
# below _ZERO_BELOW are then set to exactly 0: masked entries get weight 0 as they must, and
# entries whose true weight is below ~1e-37 of the row maximum (far below float32's
# resolution) are dropped.
_EXP_FLOOR = {torch.float64: -700.0}
_ZERO_BELOW = {torch.float64: 1e-300}


def _exp_(s: Tensor) -> Tensor:
    """In-place ``exp`` of shifted logits (all ``<= 0`` or ``-inf``), fast and denormal-free."""
    s.clamp_(min=_EXP_FLOOR.get(s.dtype, -87.0)).exp_()
    return torch.nn.functional.threshold_(s, _ZERO_BELOW.get(s.dtype, 1e-37), 0.0)


def _forward(q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> tuple[Tensor, Tensor]:
    """Online-softmax forward. Returns the output and the row log-sum-exp (``+inf`` for rows
    that may attend nothing, so that the backward's ``exp(s - lse)`` is 0 there)."""
    b, h, lq, _ = q.shape
    dv = v.shape[-1]
    tiles = _Tiles(q, k, v, plan)
    # Non-finite values are kept out of the matmuls (0 * nan = nan would reach queries that
    # cannot see them) and added back for the queries that do see them, as in attention().
    flags = nonfinite_flags(tiles.v) if plan.nonfinite else None
    if flags is not None:
        tiles.v = zero_nonfinite(tiles.v)
        seen = q.new_zeros(b * h, lq, flags.shape[-1])
    # Running state of every query row: maximum, normaliser, unnormalised output.
    row_max = q.new_full((b * h, lq), float("-inf"))
    row_sum = q.new_zeros(b * h, lq)
    acc = q.new_zeros(b * h, lq, dv)
    buffers: dict[tuple[int, int], Tensor] = {}  # one logits buffer per tile shape
    for group in plan.schedule():
        bias = plan.bias3d(*group[0], q.dtype)
        for qi, ki in group:
            (qs, qe), (ks, ke) = plan.q_blocks[qi], plan.k_blocks[ki]
            key = (qe - qs, ke - ks)
            if key not in buffers:
                buffers[key] = q.new_empty(b * h, *key)
            s = tiles.logits(plan, qi, ki, bias, out=buffers[key])
            if flags is not None:
                seen[:, qs:qe].baddbmm_((s != float("-inf")).to(s.dtype), flags[:, ks:ke])
            old_max = row_max[:, qs:qe]
            new_max = torch.maximum(old_max, s.amax(dim=-1))
            # A row with no finite logit yet keeps max -inf; shift by 0 instead (exp -> 0).
            safe = new_max.masked_fill(new_max == float("-inf"), 0.0)
            _exp_(s.sub_(safe.unsqueeze(-1)))
            alpha = torch.exp(old_max - safe)
            row_sum[:, qs:qe].mul_(alpha).add_(s.sum(dim=-1))
            acc[:, qs:qe].mul_(alpha.unsqueeze(-1)).baddbmm_(s, tiles.v[:, ks:ke])
            old_max.copy_(new_max)
    empty = row_sum == 0
    out = acc.div_(row_sum.masked_fill(empty, 1.0).unsqueeze(-1))
    lse = torch.where(empty, float("inf"), row_max.masked_fill(empty, 0.0) + row_sum.masked_fill(empty, 1.0).log())
    if flags is not None:
        out = restore_nonfinite(out, seen)
    return out.view(b, h, lq, dv), lse.view(b, h, lq)


def _sum_to_shape(grad: Tensor, shape: torch.Size) -> Tensor:
    """Reduce a broadcast gradient back to ``shape``."""
    lead = grad.dim() - len(shape)
    if lead:
        grad = grad.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


class _BiasAttention(torch.autograd.Function):
    """Blockwise attention with the standard recomputation backward (FlashAttention-2 style):
    only the output and one log-sum-exp per row are saved; each tile's probabilities are
    recomputed from ``q, k`` and the bias function in the backward pass."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: _Plan, *params: Tensor) -> Tensor:  # type: ignore[override]
        out, lse = _forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse, *params)
        ctx.plan = plan
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, *params = ctx.saved_tensors
        plan: _Plan = ctx.plan
        b, h, lq, d = q.shape
        lk, dv_ = k.shape[2], v.shape[3]
        want_params = [p for p, need in zip(params, ctx.needs_input_grad[4:]) if need]
        tiles = _Tiles(q, k, v, plan)
        dq = q.new_zeros(b * h, lq, d)
        dk = q.new_zeros(b * h, lk, d)
        dv = q.new_zeros(b * h, lk, dv_)
        dparams = [torch.zeros_like(p) for p in want_params]
        dout = dout.to(q.dtype).reshape(b * h, lq, dv_)
        lse = lse.reshape(b * h, lq)
        delta = (dout * out.reshape(b * h, lq, dv_)).sum(dim=-1)  # D_i = sum_d dO_id O_id
        for group in plan.schedule():
            bias = plan.bias3d(*group[0], q.dtype)
            dbias = None  # dL/d(bias tile), summed over the group's tiles
            for qi, ki in group:
                (qs, qe), (ks, ke) = plan.q_blocks[qi], plan.k_blocks[ki]
                p = tiles.logits(plan, qi, ki, bias)
                _exp_(p.sub_(lse[:, qs:qe].unsqueeze(-1)))  # the tile's probabilities
                do = dout[:, qs:qe]
                dv[:, ks:ke].baddbmm_(p.transpose(-1, -2), do)
                ds = torch.bmm(do, tiles.v[:, ks:ke].transpose(-1, -2))
                ds.sub_(delta[:, qs:qe].unsqueeze(-1)).mul_(p)  # dL/d(logit)
                if want_params:
                    dbias = ds if dbias is None else dbias.add_(ds)
                dq[:, qs:qe].baddbmm_(ds, tiles.kt[ki].transpose(-1, -2), alpha=plan.scale)
                dk[:, ks:ke].baddbmm_(ds.transpose(-1, -2), tiles.q[qi])
            if dbias is not None:
                with torch.enable_grad():
                    tile = plan.bias(*group[0])
                if tile is not None and tile.requires_grad:
                    g4 = dbias.view(b, h, *dbias.shape[1:])
                    grads = torch.autograd.grad(
                        tile, want_params, _sum_to_shape(g4, tile.shape).to(tile.dtype),
                        allow_unused=True,
                    )
                    for total, g in zip(dparams, grads):
                        if g is not None:
                            total.add_(g)
        it = iter(dparams)
        grad_params = [next(it) if need else None for need in ctx.needs_input_grad[4:]]
        return (dq.view(b, h, lq, d), dk.view(b, h, lk, d), dv.view(b, h, lk, dv_), None, *grad_params)


def bias_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias_fn: BiasFn | PositionScheme | None = None,
    *,
    causal: bool = False,
    block_size: int | tuple[int, int] = 512,
    scale: float | None = None,
    q_pos: Tensor | Sequence[int] | None = None,
    k_pos: Tensor | Sequence[int] | None = None,
    bias_params: Sequence[Tensor] | None = None,
    attn_mask: Tensor | None = None,
) -> Tensor:
    """Attention with an additive position bias, computed tile by tile: never ``L x L``.

    Computes ``softmax(scale * q k^T + bias(q_pos, k_pos)) v``, the same result as
    :func:`~companion.attention.attention` with a scheme whose ``bias`` hook is ``bias_fn``, but with
    the bias produced one ``(block_q, block_k)`` tile at a time inside an online-softmax loop
    (:cite:`milakov2018online`, :cite:`rabe2021self`, :cite:`dao2022flashattention`). Extra
    memory is ``O(batch * heads * block_q * block_k)`` plus ``O(batch * heads * L * head_dim)``
    (the output and a tiled copy of ``q`` and ``k``); the ``L x L`` logits and bias never
    exist.

    It runs many small tensor operations per tile, each a parallel region on CPU. On a machine
    oversubscribed by other processes, every region waits for a descheduled thread, and this
    path slows down far more than a single fused kernel; there, ``torch.set_num_threads(1)``
    is often faster. With ``causal=True`` a key tile whose earliest position is after
    every query position of the query tile is skipped without being computed (about half the
    work for self-attention), and only tiles that straddle the diagonal are masked.

    The backward pass is a ``torch.autograd.Function`` that saves only the output and one
    log-sum-exp per row and recomputes each tile (FlashAttention-2's recomputation). If the
    bias has trainable parameters (T5's table), they get gradients too: they are found from
    ``bias_fn`` when it is an ``nn.Module`` or a bound method of one (``scheme.bias``), or
    passed in ``bias_params``.

    Args:
        q: ``(batch, heads, q_len, head_dim)``.
        k: ``(batch, kv_heads, k_len, head_dim)``; ``heads`` a multiple of ``kv_heads``.
        v: ``(batch, kv_heads, k_len, v_dim)``.
        bias_fn: ``bias_fn(q_pos_tile, k_pos_tile)`` returns the bias of one tile,
            broadcastable to ``(batch, heads, tile_q, tile_k)``, or ``None``. Any scheme's
            ``bias`` method qualifies (``ALiBi(8).bias``); a :class:`~companion.attention.PositionScheme` that uses
            only the ``bias`` hook may be passed directly. ``None``: no bias.
        causal: mask keys whose position is later than the query's (by position, so
            ``q_len < k_len`` KV-cache decoding and per-row positions work). A ``bool``.
        block_size: tile size, an int or ``(block_q, block_k)``, each ``>= 1``. The default
            512 keeps one float32 logits tile at 1 MiB per (batch, head) pair. With many
            (batch, head) pairs smaller tiles run faster on CPU; the dispatcher's choice
            is :func:`companion.dispatch.block_size_for`.
        scale: logit scale, a finite number > 0, default ``1 / sqrt(head_dim)``; it
            multiplies ``q k^T`` only.
        q_pos, k_pos: integer positions as in :func:`~companion.attention.attention` (default: keys at
            ``arange(k_len)``, queries the last ``q_len`` of them).
        bias_params: trainable tensors the bias depends on, if ``bias_fn`` is a plain
            function that closes over them.
        attn_mask: optional mask broadcastable to ``(batch, heads, q_len, k_len)``, with the
            conventions of :func:`~companion.attention.attention` (bool ``True`` = attend;
            integer 1 = attend, 0 = masked; floating = added to the logits). It is sliced
            per tile; a padding mask ``(batch, 1, 1, k_len)`` costs no ``L x L`` memory.

    Returns:
        ``(batch, heads, q_len, v_dim)`` in ``q``'s dtype; the math runs in float32 for
        half-precision input. A query that may attend no key gets a zero output. NaN and
        inf follow :func:`~companion.attention.attention` exactly, for every ``block_size``:
        a non-finite key or value reaches only the queries that may attend it.

    A scheme (or a scheme's bound ``bias`` method) built for another number of heads than
    ``q`` has raises ``ValueError``, as in :func:`~companion.attention.attention`.
    """
    bq, bkk = _block_sizes(block_size)
    if bias_params is not None and (isinstance(bias_params, Tensor) or not isinstance(bias_params, (list, tuple))):
        raise TypeError(
            f"bias_params must be a list or tuple of tensors, got {type(bias_params).__name__}"
            + ("; wrap a single tensor as [tensor]" if isinstance(bias_params, Tensor) else "")
        )
    params = list(bias_params or [])
    owner = bias_fn if isinstance(bias_fn, PositionScheme) else getattr(bias_fn, "__self__", None)
    pro = _prologue(q, k, v, owner if isinstance(owner, PositionScheme) else None, q_pos, k_pos,
                    causal=causal, scale=scale, attn_mask=attn_mask)
    if isinstance(bias_fn, PositionScheme):
        extra = set(bias_fn.hooks()) - {"bias"}
        if extra:
            raise ValueError(
                f"bias_attention honours only the bias hook, but {type(bias_fn).__name__} also "
                f"uses {sorted(extra)}; use companion.attention for it"
            )
        params += _bias_parameters(bias_fn)
        bias_fn = bias_fn.bias
    elif bias_fn is not None:
        if not callable(bias_fn):
            raise TypeError(f"bias_fn must be callable or None, got {type(bias_fn).__name__}")
        params += _bias_parameters(bias_fn)
    for i, p in enumerate(params):
        check_tensor(p, f"bias_params[{i}]")
    b, h, lq, _, _, lk = pro[:6]
    if lq == 0 or lk == 0:
        return q.new_zeros(b, h, lq, v.shape[-1])
    qw, kw, vw = pro.operands(q, k, v)
    nonfinite = not all(bool(torch.isfinite(t).all()) for t in (qw, kw, vw))
    plan = _Plan(bias_fn, pro.causal, pro.scale, bq, bkk, pro.q_pos, pro.k_pos, (b, h, lq, lk),
                 pro.allowed, pro.additive, nonfinite)
    # Validate the bias of the first tile up front, with a clear message.
    first = plan.bias(0, 0)
    if first is not None and first.requires_grad and torch.is_grad_enabled() and not params:
        raise ValueError(
            "bias_fn returns a tensor that requires grad, but its parameters are unknown: pass "
            "them as bias_params=[...] (or make bias_fn a module or a module's bound method)"
        )
    needs_grad = torch.is_grad_enabled() and (
        qw.requires_grad or kw.requires_grad or vw.requires_grad or any(p.requires_grad for p in params)
    )
    if needs_grad:
        out = _BiasAttention.apply(qw, kw, vw, plan, *params)
    else:
        with torch.no_grad():
            out, _ = _forward(qw, kw, vw, plan)
    return out.to(q.dtype)
