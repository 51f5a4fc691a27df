"""Memory-lean attention for any additive position bias, one block at a time.

Two functions compute ``softmax(scale * q k^T + bias(q_pos, k_pos)) v`` for any
additive-bias scheme (ALiBi, T5's bucketed bias, KERPLE, FIRE, a learned table) without ever
holding the ``L x L`` logits or bias, both with the causal mask, a sliding ``window`` or
``chunk`` of keys (whose hidden key blocks they skip) and an ``attn_mask``:

* :func:`bias_attention` works one ``(query block, key block)`` tile at a time inside an
  online-softmax loop (Milakov and Gimelshein, :cite:`milakov2018online`; Rabe and Staats,
  :cite:`rabe2021self`; Dao et al., :cite:`dao2022flashattention`), asking the scheme for the
  bias of one tile at a time. Its extra memory is one ``block_q x block_k`` logits tile per
  (batch, head) pair plus ``O(L x head_dim)`` for the output and a re-laid-out copy of ``q``
  and ``k``. It runs on any device and keeps the reference's rule for NaN and infinite values.
* ``fused_bias_attention`` calls torch's fused CPU attention kernel once per block of
  queries, over the keys the block may see, with the bias as the kernel's float mask, and
  merges calls by their log-sum-exps, the design of
  :func:`companion.trainfree.two_region_attention`. A bias of the offset ``k - q`` alone is
  one vector per head and every block's mask a strided view of it. It is the dispatcher's
  ``"blockwise"`` path, at close to the fused kernel's own speed, and falls back to
  :func:`bias_attention` where the kernel does not apply.

A naive implementation materialises a ``heads x L x L`` bias tensor: 8 GiB in float32 for 8
heads at ``L = 16384``. These never do. They serve every bias scheme (ALiBi in
:mod:`companion.alibi`, T5 in :mod:`companion.relative`), the CPU path of
:func:`companion.kernels.flash_attention_with_bias`, and the bias path of the dispatcher
:func:`companion.dispatch.fast_attention`. Their arguments are validated by the same prologue
as the reference :func:`companion.attention.attention`.

The pieces: ``_Plan`` holds what the forward and backward loops share (blocks, runs of key
blocks, positions, the bias function, masks, the offsets' vector); ``_Tiles`` lays ``q`` and
``k`` out once so every tile product is a dense batched GEMM; ``_forward`` is the
online-softmax loop and ``_fused_forward`` the fused path's calls; ``_BlockAttention`` is the
autograd function of both, whose backward recomputes each tile or run (FlashAttention-2's
recomputation).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ._checks import check_positive_int, check_tensor, contiguous_start
from ._checks import nonfinite_flags, restore_nonfinite, zero_nonfinite
from .attention import PositionScheme, _Prologue, _prologue, _visibility

__all__ = ["BiasFn", "bias_attention", "fused_bias_attention"]

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
    """Whether ``bias_fn``'s bias depends only on ``k_pos - q_pos``: the function, or the
    module it is a bound method of, has ``relative_bias = True`` (ALiBi, T5, KERPLE)."""
    owner = getattr(bias_fn, "__self__", bias_fn)
    return bool(getattr(bias_fn, "relative_bias", False) or getattr(owner, "relative_bias", False))


def _bias_parameters(bias_fn: object) -> list[Tensor]:
    """Trainable tensors a bias function depends on, found through its module."""
    owner = bias_fn if isinstance(bias_fn, nn.Module) else getattr(bias_fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return [p for p in owner.parameters() if p.requires_grad]
    return []


class _Plan:
    """Everything the forward and backward loops share: blocks, positions, the bias, masks.

    Queries are cut into blocks of ``bq`` and keys into blocks of ``bk``. A *run*
    ``(qi, ka, kb)`` is query block ``qi`` against the key blocks ``ka .. kb - 1``, one
    contiguous range of keys: :func:`bias_attention` computes one run per key block (a tile),
    :func:`fused_bias_attention` joins neighbouring visible key blocks into one run, one call
    of the fused kernel.
    """

    def __init__(self, bias_fn: BiasFn | None, pro: _Prologue, bq: int, bk: int,
                 nonfinite: bool = False) -> None:
        assert pro.q_pos is not None and pro.k_pos is not None
        assert pro.q_order is not None and pro.k_order is not None
        self.bias_fn, self.causal, self.scale = bias_fn, pro.causal, pro.scale
        self.window, self.chunk = pro.window, pro.chunk
        self.shape = (pro.batch, pro.heads, pro.q_len, pro.k_len)
        # attn_mask as 4-D broadcastable views (True = attend / added to the logits), and
        # whether q, k or v hold a non-finite value (then -inf biases must mask, see _forward).
        self.allowed = None if pro.allowed is None else _as4d(pro.allowed)
        self.additive = None if pro.additive is None else _as4d(pro.additive)
        self.nonfinite = nonfinite
        lq, lk = pro.q_len, pro.k_len
        # positions for the bias; the causal order (the same, but sequence indices for a grid)
        self.q_pos, self.k_pos = pro.q_pos, pro.k_pos
        self.q_order, self.k_order = pro.q_order, pro.k_order
        self.q_blocks = [(s, min(s + bq, lq)) for s in range(0, lq, bq)]
        self.k_blocks = [(s, min(s + bk, lk)) for s in range(0, lk, bk)]
        if self.causal:
            # Per block, over the batch too: the earliest and latest position.
            self.q_lo = [int(self.q_order[..., s:e].min()) for s, e in self.q_blocks]
            self.q_hi = [int(self.q_order[..., s:e].max()) for s, e in self.q_blocks]
            self.k_lo = [int(self.k_order[..., s:e].min()) for s, e in self.k_blocks]
            self.k_hi = [int(self.k_order[..., s:e].max()) for s, e in self.k_blocks]
        # consecutive positions shared by the batch: offsets k - q are the same along diagonals
        self.q0, self.k0 = contiguous_start(self.q_order), contiguous_start(self.k_order)
        consecutive = self.q0 is not None and self.k0 is not None
        self.relative = (consecutive and _is_relative(bias_fn) and contiguous_start(self.q_pos) is not None
                         and contiguous_start(self.k_pos) is not None)
        # one vector over the offsets k - q (see diagonal()) holds the whole bias and the
        # causal and window masks; the fused path keeps it here for its forward pass
        self.banded = consecutive and (bias_fn is None or self.relative) and (bias_fn is not None or self.causal)
        self.diag: tuple[Tensor, int] | None = None

    def visible(self, qi: int, ki: int) -> bool:
        """False when the rules (causal, window, chunk) hide every key of block ``ki`` from
        every query of block ``qi``."""
        if not self.causal:
            return True
        q_lo, q_hi, k_lo, k_hi = self.q_lo[qi], self.q_hi[qi], self.k_lo[ki], self.k_hi[ki]
        if k_lo > q_hi:
            return False  # every key in the future
        w, c = self.window, self.chunk
        if w is not None and k_hi <= q_lo - w:
            return False  # every key out of the window
        return c is None or (k_hi // c >= q_lo // c and k_lo // c <= q_hi // c)

    def open(self, qi: int, ka: int, kb: int) -> bool:
        """True when the rules hide no key of the run from any of its queries."""
        if not self.causal:
            return True
        q_lo, q_hi = self.q_lo[qi], self.q_hi[qi]
        k_lo, k_hi = min(self.k_lo[ka:kb]), max(self.k_hi[ka:kb])
        w, c = self.window, self.chunk
        return (k_hi <= q_lo and (w is None or k_lo > q_hi - w)
                and (c is None or k_lo // c == k_hi // c == q_lo // c == q_hi // c))

    def runs(self, max_blocks: int | None = 1) -> list[tuple[int, int, int]]:
        """The runs ``(qi, ka, kb)`` that cover every visible tile, by query block: each
        stretch of consecutive visible key blocks, cut into runs of at most ``max_blocks``
        blocks (``None``: no limit)."""
        out = []
        for qi in range(len(self.q_blocks)):
            start = None
            for ki in range(len(self.k_blocks) + 1):
                vis = ki < len(self.k_blocks) and self.visible(qi, ki)
                if vis and start is None:
                    start = ki
                if start is not None and (not vis or (max_blocks is not None and ki - start == max_blocks)):
                    out.append((qi, start, ki))
                    start = ki if vis else None
        return out

    def span(self, run: tuple[int, int, int]) -> tuple[int, int, int, int]:
        """``(qs, qe, ks, ke)``: the query and key index ranges of a run."""
        qi, ka, kb = run
        return (*self.q_blocks[qi], self.k_blocks[ka][0], self.k_blocks[kb - 1][1])

    def schedule(self, runs: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
        """The runs in groups that share one bias tile.

        For a bias that depends only on ``k_pos - q_pos`` (``relative_bias``) and positions
        that are shared and consecutive, two runs of the same shape whose first key minus
        first query position agree have identical biases: each such diagonal of tiles is
        one group, and its bias is computed once. Otherwise every run is its own group.
        """
        if not self.relative:
            return [[r] for r in runs]
        groups: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
        for run in runs:
            qs, qe, ks, ke = self.span(run)
            groups.setdefault((self.offset(run), qe - qs, ke - ks), []).append(run)
        return list(groups.values())

    def offset(self, run: tuple[int, int, int]) -> int:
        """First key position minus first query position of a run (consecutive positions)."""
        assert self.q0 is not None and self.k0 is not None
        qs, _, ks, _ = self.span(run)
        return self.k0 + ks - self.q0 - qs

    def _checked(self, tile: object, rows: int, cols: int) -> Tensor | None:
        """A bias tile as ``bias_fn`` returned it, checked: ``None`` or a floating tensor that
        broadcasts to ``(batch, heads, rows, cols)``."""
        if tile is None:
            return None
        if not isinstance(tile, Tensor) or not tile.is_floating_point():
            got = tile.dtype if isinstance(tile, Tensor) else type(tile).__name__
            raise TypeError(f"bias_fn must return a floating-point tensor or None, got {got}")
        b, h = self.shape[:2]
        want = (b, h, rows, cols)
        try:
            ok = torch.broadcast_shapes(tile.shape, want) == want
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"bias_fn returned shape {tuple(tile.shape)} for a tile of {rows} query and "
                f"{cols} key positions; it must broadcast to (batch, heads, q_len, k_len) = "
                f"{want}. A bias function gets the positions of one tile, not the whole sequence"
            )
        return tile

    def bias(self, run: tuple[int, int, int]) -> Tensor | None:
        """The bias tile of a run, shape-checked, as returned by ``bias_fn`` (broadcastable
        to ``(batch, heads, tile_q, tile_k)``)."""
        if self.bias_fn is None:
            return None
        qs, qe, ks, ke = self.span(run)
        return self._checked(self.bias_fn(self.q_pos[..., qs:qe], self.k_pos[..., ks:ke]), qe - qs, ke - ks)

    def bias3d(self, run: tuple[int, int, int], dtype: torch.dtype) -> Tensor | None:
        """The bias tile as a ``(batch * heads, tile_q, tile_k)``-broadcastable tensor."""
        tile = self.bias(run)
        if tile is None:
            return None
        b, h = self.shape[:2]
        tile = tile.to(dtype)
        if tile.dim() <= 2 or (tile.dim() == 3 and (b == 1 or tile.shape[0] == 1)):
            return tile  # broadcasts against (b * h, tile_q, tile_k) as it is
        tq, tk = tile.shape[-2:]
        full = tile.expand(b, h, tq, tk)
        return full[0] if b == 1 else full.reshape(b * h, tq, tk)

    def mask(self, run: tuple[int, int, int], banded: bool = False) -> Tensor | None:
        """Boolean ``True`` = masked, broadcastable to ``(batch, heads, tile_q, tile_k)``,
        or ``None`` if the run needs no mask. ``banded``: the causal and window rules are
        in the band already (only the chunk and ``attn_mask`` are added here)."""
        qs, qe, ks, ke = self.span(run)
        hidden = None
        if self.causal and not self.open(*run) and not (banded and self.chunk is None):
            vis = _visibility(self.q_order[..., qs:qe], self.k_order[..., ks:ke], True,
                              None if banded else self.window, self.chunk)
            assert vis is not None
            hidden = ~(vis if vis.dim() == 2 else vis.unsqueeze(1))
        if self.allowed is not None:
            blocked = ~_tile(self.allowed, qs, qe, ks, ke)
            hidden = blocked if hidden is None else hidden | blocked
        return hidden

    def add_mask(self, run: tuple[int, int, int]) -> Tensor | None:
        """The additive ``attn_mask`` of one run, ``(batch | 1, heads | 1, tile_q, tile_k)``."""
        if self.additive is None:
            return None
        qs, qe, ks, ke = self.span(run)
        return _tile(self.additive, qs, qe, ks, ke)

    def diagonal(self, runs: list[tuple[int, int, int]], dtype: torch.dtype,
                 floor: Tensor | None = None) -> tuple[Tensor, int]:
        """The bias and the causal and window masks of every run at once, as a function of
        the offset ``k - q`` alone (:attr:`banded`: consecutive shared positions and a
        ``relative_bias``, or no bias): ``(diag, lowest)``.

        ``diag[..., n]`` is the logit term at offset ``lowest + n`` (``-inf`` where the causal
        mask or the window hides that offset), ``(batch | 1, heads | 1, width)`` with ``width
        <= q_len + k_len``, from one call of ``bias_fn`` over the visible offsets. With the
        queries in reverse order, the term of reversed row ``r`` and key column ``t`` of a run
        is ``diag[..., base + r + t]``: every run's mask is a strided view of ``diag``
        (:meth:`diagonal_view`), and no ``q_len x k_len`` or ``block_q x k_len`` tile of it is
        ever stored. ``floor`` (per head) raises the finite entries below it (see
        :func:`_floor`).
        """
        assert self.q0 is not None and self.k0 is not None
        spans = [self.span(r) for r in runs]
        lowest = min(self.k0 + ks - self.q0 - qe + 1 for _, qe, ks, _ in spans)
        highest = max(self.k0 + ke - 1 - self.q0 - qs for qs, _, _, ke in spans)
        first, last = lowest, highest  # the offsets the rules let through
        if self.causal:
            last = min(last, 0)
            if self.window is not None:
                first = max(first, 1 - self.window)
        device = self.q_order.device
        part = torch.zeros(1, 1, max(0, last - first + 1), dtype=dtype, device=device)
        if self.bias_fn is not None and first <= last:
            p = self.q0 + self.shape[2] - 1  # the last query: keys p + offset are real positions
            qp = torch.arange(p, p + 1, device=device)
            kp = torch.arange(p + first, p + last + 1, device=device)
            bias = self._checked(self.bias_fn(qp, kp), 1, last - first + 1)
            if bias is not None:
                part = _floored(_as4d(bias).to(dtype), floor)[:, :, 0]
        if (first, last) == (lowest, highest):
            return part.contiguous(), lowest
        diag = torch.full((*part.shape[:2], highest - lowest + 1), float("-inf"), dtype=dtype, device=device)
        if first <= last:
            diag[..., first - lowest : last - lowest + 1] = part
        return diag, lowest

    def diagonal_view(self, run: tuple[int, int, int], diag: Tensor, lowest: int) -> Tensor:
        """The ``(batch | 1, heads | 1, tile_q, tile_k)`` term of a run, its query rows in
        reverse order, as a strided view of :meth:`diagonal`'s ``diag`` (no copy)."""
        assert self.q0 is not None and self.k0 is not None
        qs, qe, ks, ke = self.span(run)
        base = self.k0 + ks - self.q0 - qe + 1 - lowest
        return diag.as_strided((diag.shape[0], diag.shape[1], qe - qs, ke - ks),
                               (diag.stride(0), diag.stride(1), 1, 1), diag.storage_offset() + base)

    def fused_mask(self, run: tuple[int, int, int], diag: tuple[Tensor, int] | None, dtype: torch.dtype,
                   floor: Tensor | None = None, bias: Tensor | None = None) -> Tensor | None:
        """The float ``attn_mask`` of a run for the fused kernel (bias, masks, ``-inf`` where
        hidden), 4-D, or ``None`` if nothing is added. With ``diag`` (:meth:`diagonal`) the
        rows are in reverse order and the bias and causal terms a view of it; otherwise the
        rows are in order and the bias is ``bias`` (default: :meth:`bias`, raised to
        ``floor``)."""
        qs, qe, ks, ke = self.span(run)
        if diag is not None:
            m: Tensor | None = self.diagonal_view(run, *diag)
        else:
            bias = self.bias(run) if bias is None else bias
            m = None if bias is None else _floored(_as4d(bias).to(dtype), floor)
        add = self.add_mask(run)
        hidden = self.mask(run, banded=diag is not None)
        if diag is not None:
            add, hidden = _reversed_rows(add), _reversed_rows(hidden)
        if add is not None:
            m = add.to(dtype) if m is None else m + add.to(dtype)
        if hidden is not None:
            if m is None:
                m = torch.zeros(1, 1, qe - qs, ke - ks, dtype=dtype, device=hidden.device)
            m = m.masked_fill(hidden, float("-inf"))
        return None if m is None else _as4d(m)


def _reversed_rows(mask: Tensor | None) -> Tensor | None:
    """A 4-D mask tile with its query rows in reverse order (a row-broadcast one as it is)."""
    return mask if mask is None or mask.shape[-2] == 1 else mask.flip(-2)


def _as4d(mask: Tensor) -> Tensor:
    """View a mask that broadcasts to ``(batch, heads, q, k)`` with exactly 4 dimensions."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _tile(mask: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """One tile of a 4-D broadcastable mask; broadcast (size-1) axes stay size 1."""
    rows = mask if mask.shape[-2] == 1 else mask[..., qs:qe, :]
    return rows if rows.shape[-1] == 1 else rows[..., ks:ke]


class _Tiles:
    """The scaled queries and transposed keys as ``(batch * heads, ...)`` matrices, laid out
    once; every run's product is a batched GEMM on views of them."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> None:
        b, h, lq, d = q.shape
        self.b, self.h = b, h
        self.q = (q * plan.scale).reshape(b * h, lq, d)
        self.kt = k.transpose(-1, -2).reshape(b * h, d, k.shape[2])
        self.v = v.reshape(b * h, v.shape[2], v.shape[3])

    def logits(self, plan: _Plan, run: tuple[int, int, int], tile: Tensor | None,
               out: Tensor | None = None) -> Tensor:
        """``scale * q k^T + tile`` for one run, ``(batch * heads, tile_q, tile_k)``, with
        masked entries at ``-inf``; written into ``out`` when given."""
        qs, qe, ks, ke = plan.span(run)
        q, kt = self.q[:, qs:qe], self.kt[:, :, ks:ke]
        kw = {} if out is None else {"out": out}
        s = torch.bmm(q, kt, **kw) if tile is None else torch.baddbmm(tile, q, kt, **kw)
        s4 = s.view(self.b, self.h, *s.shape[1:])
        add = plan.add_mask(run)
        if add is not None:
            s4.add_(add.to(s.dtype))
        if plan.nonfinite:
            # nan + -inf is nan: a -inf bias or mask entry must hide a non-finite logit too.
            if tile is not None:
                s.masked_fill_(tile == float("-inf"), float("-inf"))
            if add is not None:
                s4.masked_fill_(add == float("-inf"), float("-inf"))
        hidden = plan.mask(run)
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


def _forward(q: Tensor, k: Tensor, v: Tensor, plan: _Plan,
             runs: list[tuple[int, int, int]]) -> tuple[Tensor, Tensor]:
    """Online-softmax forward over ``runs``. Returns the output and the row log-sum-exp
    (``+inf`` for rows that may attend nothing, so that the backward's ``exp(s - lse)`` is 0
    there)."""
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
    for group in plan.schedule(runs):
        bias = plan.bias3d(group[0], q.dtype)
        for run in group:
            qs, qe, ks, ke = plan.span(run)
            key = (qe - qs, ke - ks)
            if key not in buffers:
                buffers[key] = q.new_empty(b * h, *key)
            s = tiles.logits(plan, run, bias, out=buffers[key])
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


def _add_bias_grads(totals: list[Tensor], tile: Tensor | None, dlogits: Tensor, params: list[Tensor]) -> None:
    """Add ``d loss / d params`` through one bias ``tile`` (computed with grad) to ``totals``,
    given ``dlogits``, the gradient of the logits it was added to (4-D, broadcast over it)."""
    if tile is None or not tile.requires_grad:
        return
    grads = torch.autograd.grad(tile, params, _sum_to_shape(dlogits, tile.shape).to(tile.dtype), allow_unused=True)
    for total, g in zip(totals, grads):
        if g is not None:
            total.add_(g)


def _param_grads(needs: Sequence[bool], dparams: list[Tensor]) -> list[Tensor | None]:
    """The gradients of the bias parameters, ``None`` for those that need none."""
    it = iter(dparams)
    return [next(it) if need else None for need in needs]


def _tile_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, plan: _Plan,
                   runs: list[tuple[int, int, int]], params: list[Tensor]) -> tuple[Tensor, ...]:
    """The tile loop's backward pass (FlashAttention-2's recomputation): ``dq, dk, dv`` and
    the gradients of ``params``, each tile's probabilities recomputed from ``q, k`` and the
    bias function."""
    b, h, lq, d = q.shape
    lk, dv_ = k.shape[2], v.shape[3]
    tiles = _Tiles(q, k, v, plan)
    dq = q.new_zeros(b * h, lq, d)
    dk = q.new_zeros(b * h, lk, d)
    dv = q.new_zeros(b * h, lk, dv_)
    dparams = [torch.zeros_like(p) for p in params]
    dout = dout.reshape(b * h, lq, dv_)
    lse = lse.reshape(b * h, lq)
    delta = (dout * out.reshape(b * h, lq, dv_)).sum(dim=-1)  # D_i = sum_d dO_id O_id
    for group in plan.schedule(runs):
        bias = plan.bias3d(group[0], q.dtype)
        dbias = None  # dL/d(bias tile), summed over the group's tiles
        for run in group:
            qs, qe, ks, ke = plan.span(run)
            p = tiles.logits(plan, run, bias)
            _exp_(p.sub_(lse[:, qs:qe].unsqueeze(-1)))  # the tile's probabilities
            do = dout[:, qs:qe]
            dv[:, ks:ke].baddbmm_(p.transpose(-1, -2), do)
            ds = torch.bmm(do, tiles.v[:, ks:ke].transpose(-1, -2))
            ds.sub_(delta[:, qs:qe].unsqueeze(-1)).mul_(p)  # dL/d(logit)
            if params:
                dbias = ds if dbias is None else dbias.add_(ds)
            dq[:, qs:qe].baddbmm_(ds, tiles.kt[:, :, ks:ke].transpose(-1, -2), alpha=plan.scale)
            dk[:, ks:ke].baddbmm_(ds.transpose(-1, -2), tiles.q[:, qs:qe])
        if dbias is not None:
            with torch.enable_grad():
                tile = plan.bias(group[0])
            _add_bias_grads(dparams, tile, dbias.view(b, h, *dbias.shape[1:]), params)
    return (dq.view(b, h, lq, d), dk.view(b, h, lk, d), dv.view(b, h, lk, dv_), *dparams)


class _BlockAttention(torch.autograd.Function):
    """The autograd function of both block paths: the forward (the tile loop's online softmax,
    or the fused kernel's calls with ``fused``) saves only the output and one log-sum-exp per
    row; the backward recomputes each tile or run: the tile loop's (:func:`_tile_backward`),
    torch's fused backward kernel when no bias parameter needs a gradient, or explicitly
    (:func:`_explicit_backward`, which the bias parameters' gradient needs)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: _Plan, runs: list, fused: bool,  # type: ignore[override]
                *params: Tensor) -> Tensor:
        out, lse = _fused_forward(q, k, v, plan, runs, plan.diag) if fused else _forward(q, k, v, plan, runs)
        ctx.save_for_backward(q, k, v, out, lse, *params)
        ctx.plan, ctx.runs, ctx.fused = plan, runs, fused
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, *params = ctx.saved_tensors
        needs = ctx.needs_input_grad[6:]
        want = [p for p, need in zip(params, needs) if need]
        args = (q, k, v, out, lse, dout.to(q.dtype), ctx.plan, ctx.runs)
        if not ctx.fused:
            dq, dk, dv, *dparams = _tile_backward(*args, want)
        elif want:
            dq, dk, dv, *dparams = _explicit_backward(*args, want)
        else:
            (dq, dk, dv), dparams = _fused_backward_kernel(*args), []
        return (dq, dk, dv, None, None, None, *_param_grads(needs, dparams))


# ----------------------------------------------------------------------------- the fused path

#: torch's fused CPU attention kernel, which also returns each row's log-sum-exp
#: (``aten::_scaled_dot_product_flash_attention_for_cpu``), and its backward; ``None`` if this
#: torch lacks them.
_FLASH_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

#: Let :func:`fused_bias_attention` call torch's fused CPU kernel where it applies (the tests
#: switch it off to check the fallback, the tile loop of :func:`bias_attention`).
USE_FUSED = True

#: How far below its row's log-sum-exp (in logits) the backward pass may raise a tiny bias
#: entry (:func:`_floor`): such an entry had, and keeps, a weight below ``e**-50 = 2e-22`` of
#: its row's total, far below float32's resolution (``6e-8``).
_FLOOR_MARGIN = 50.0


def _floor(q: Tensor, k: Tensor, lse: Tensor, scale: float) -> Tensor | None:
    """A per-head floor for the bias in the fused backward pass, ``(1, heads, 1, 1)``, or
    ``None`` (float64, where the problem below does not arise).

    torch's fused backward recomputes ``P = exp(s - lse)``; for a steep bias (ALiBi's far
    keys, say) ``s - lse`` falls below ``-87``, where float32's ``exp`` returns denormals, and
    on x86 every operation on those runs 10 to 40 times slower (measured here: the whole
    backward three times slower). So finite bias entries below ``F_h = min_i (lse_i - c_i) -
    50`` are raised to ``F_h``, with ``c_i = scale |q_i| max_j |k_j|`` bounding the content
    logit of row ``i``: an entry below ``F_h`` has a weight below ``exp(b + c_i - lse_i) <
    e**-50`` before and after (exact to float32's resolution), and ``s - lse`` stays normal
    wherever ``2 c_i + lse_i - min (lse - c)`` is below about 37. ``-inf`` entries stay masked.
    """
    if q.dtype != torch.float32:
        return None
    c = scale * q.norm(dim=-1) * k.norm(dim=-1).amax(dim=(0, 2)).view(1, -1, 1)
    return ((lse - c).amin(dim=(0, 2)) - _FLOOR_MARGIN).view(1, -1, 1, 1)


def _floored(bias: Tensor, floor: Tensor | None) -> Tensor:
    """``bias`` (4-D) with its finite entries raised to ``floor`` (per head, see :func:`_floor`)."""
    if floor is None:
        return bias
    if bias.shape[1] == 1:
        floor = floor.amin().view(1, 1, 1, 1)
    return torch.where(torch.isneginf(bias), bias, torch.maximum(bias, floor))


#: The most ``batch * heads * tile_q * tile_k`` entries one logits tile of the explicit
#: backward pass (a bias parameter's gradient) holds: 8 MiB in float32. A run of more keys is
#: cut into pieces of whole key blocks (the backward needs no merging: every piece's
#: probabilities come from the final log-sum-exp).
_TILE_ENTRIES = 1 << 21


def _pieces(plan: _Plan, runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``runs`` cut into runs of at most :data:`_TILE_ENTRIES` logits (at least one key block)."""
    b, h = plan.shape[:2]
    out = []
    for qi, ka, kb in runs:
        qs, qe = plan.q_blocks[qi]
        grain = plan.k_blocks[0][1] - plan.k_blocks[0][0]
        step = max(1, _TILE_ENTRIES // max(1, b * h * (qe - qs) * grain))
        out += [(qi, s, min(s + step, kb)) for s in range(ka, kb, step)]
    return out


def _rows(x: Tensor, qs: int, qe: int, flip: bool) -> Tensor:
    """Query rows ``qs:qe`` of ``x`` (dimension 2), in reverse order with ``flip`` (a copy of
    the block only: the fused path reverses one block at a time, never a whole tensor)."""
    block = x[:, :, qs:qe]
    return block.flip(2) if flip else block


def _add_antidiagonals(total: Tensor, base: int, ds: Tensor) -> None:
    """``total[..., base + m] += sum_{r + t = m} ds[..., r, t]`` (summed over the batch or the
    heads where ``total`` has one): the gradient of :meth:`_Plan.diagonal`'s ``diag`` from a
    run's logits gradient ``ds``, whose row ``r`` and column ``t`` read ``diag[..., base + r +
    t]``. Each row is padded with ``n`` zeros so that a view with row stride ``c + n - 1`` lines
    the anti-diagonals up in columns."""
    bb, hh = total.shape[:2]
    g = _sum_to_shape(ds, torch.Size((bb, hh, *ds.shape[-2:])))
    n, c = g.shape[-2:]
    pad = g.new_empty(bb, hh, n, c + n)
    pad[..., :c] = g
    pad[..., c:] = 0.0
    lined = pad.as_strided((bb, hh, n, c + n - 1), (hh * n * (c + n), n * (c + n), c + n - 1, 1))
    total[..., base : base + c + n - 1] += lined.sum(dim=-2)


def _fused_forward(q: Tensor, k: Tensor, v: Tensor, plan: _Plan, runs: list[tuple[int, int, int]],
                   diag: tuple[Tensor, int] | None) -> tuple[Tensor, Tensor]:
    """One fused-kernel call per run, the queries of a block in reverse order when ``diag``
    is given (see :meth:`_Plan.diagonal`); a query block's runs merged by their log-sum-exps.
    Returns the output and each row's log-sum-exp (0 for a row that attends nothing, whose
    output is 0, as the kernel gives them), in the queries' order."""
    assert _FLASH_FWD is not None
    b, h, lq, _ = q.shape
    flip = diag is not None
    out = q.new_empty(b, h, lq, v.shape[-1])
    lse = q.new_empty(b, h, lq)
    neg = float("-inf")
    seen = set()
    for qi, group in itertools.groupby(runs, key=lambda r: r[0]):  # the runs of one query block
        mine = list(group)
        seen.add(qi)
        qs, qe = plan.q_blocks[qi]
        qb = _rows(q, qs, qe, flip)
        acc_o = acc_l = None
        for run in mine:
            ks, ke = plan.span(run)[2:]
            m = plan.fused_mask(run, diag, q.dtype)
            o, l = _FLASH_FWD(qb, k[:, :, ks:ke], v[:, :, ks:ke], 0.0, False, attn_mask=m, scale=plan.scale)
            if len(mine) == 1:
                acc_o, acc_l = o, l
                break
            if m is not None:  # the kernel gives a row it hides entirely lse 0: it must weigh nothing
                l = l.masked_fill(torch.isneginf(m).all(dim=-1), neg)
            if acc_o is None or acc_l is None:
                acc_o, acc_l = o, l
                continue
            total = torch.logaddexp(acc_l, l)
            safe = total.masked_fill(total == neg, 0.0)
            acc_o = acc_o * torch.exp(acc_l - safe).unsqueeze(-1) + o * torch.exp(l - safe).unsqueeze(-1)
            acc_l = total
        assert acc_o is not None and acc_l is not None
        acc_l = acc_l.masked_fill(acc_l == neg, 0.0)
        out[:, :, qs:qe] = acc_o.flip(2) if flip else acc_o
        lse[:, :, qs:qe] = acc_l.flip(2) if flip else acc_l
    for qi in set(range(len(plan.q_blocks))) - seen:  # a block that may attend no key
        qs, qe = plan.q_blocks[qi]
        out[:, :, qs:qe] = 0.0
        lse[:, :, qs:qe] = 0.0
    return out, lse


def _fused_backward_kernel(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                           plan: _Plan, runs: list[tuple[int, int, int]]) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` by torch's fused backward kernel, one call per run (no bias parameter
    needs a gradient), the queries of a block reversed as in the forward pass."""
    assert _FLASH_BWD is not None
    floor = _floor(q, k, lse, plan.scale)
    diag = plan.diagonal(runs, q.dtype, floor) if plan.banded else None
    flip = diag is not None
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for run in runs:
        qs, qe, ks, ke = plan.span(run)
        m = plan.fused_mask(run, diag, q.dtype, floor)
        gq, gk, gv = _FLASH_BWD(_rows(dout, qs, qe, flip), _rows(q, qs, qe, flip), k[:, :, ks:ke], v[:, :, ks:ke],
                                _rows(out, qs, qe, flip), _rows(lse.unsqueeze(-1), qs, qe, flip).squeeze(-1),
                                0.0, False, attn_mask=m, scale=plan.scale)
        dq[:, :, qs:qe] += gq.flip(2) if flip else gq
        dk[:, :, ks:ke] += gk
        dv[:, :, ks:ke] += gv
    return dq, dk, dv


def _explicit_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, plan: _Plan,
                       runs: list[tuple[int, int, int]], params: list[Tensor]) -> tuple[Tensor, ...]:
    """``dq, dk, dv`` and the gradients of ``params`` (the bias's), recomputing each run's
    probabilities explicitly (the fused kernel does not return the logits' gradient, which
    the bias parameters need), the queries of a block reversed as in the forward pass where
    the bias is the offsets' vector. The logits' gradient goes into that vector's
    (anti-diagonal sums) or each tile's, and through one ``autograd.grad`` to the
    parameters."""
    with torch.enable_grad():
        diag = plan.diagonal(runs, q.dtype) if plan.banded else None
    flip = diag is not None
    fixed = None if diag is None else (diag[0].detach(), diag[1])
    ddiag = None if fixed is None else torch.zeros_like(fixed[0])
    dparams = [torch.zeros_like(p) for p in params]
    b, h, lq, d = q.shape
    lk, dv_ = k.shape[2], v.shape[3]
    # (batch * heads, ...) matrices: every product below is one batched GEMM (baddbmm_ into a
    # slice runs far slower than a GEMM and an add on this CPU)
    k3, v3 = k.reshape(b * h, lk, d), v.reshape(b * h, lk, dv_)
    neg_delta = -(dout * out).sum(dim=-1, keepdim=True)  # -D_i = -sum_d dO_id O_id
    dq, dk, dv = torch.zeros_like(q), k3.new_zeros(b * h, lk, d), k3.new_zeros(b * h, lk, dv_)
    for run in _pieces(plan, runs):
        qs, qe, ks, ke = plan.span(run)
        n = qe - qs
        tile = None
        if diag is None:
            with torch.enable_grad():
                tile = plan.bias(run)
        m = plan.fused_mask(run, fixed, q.dtype, bias=None if tile is None else tile.detach())
        qb = _rows(q, qs, qe, flip).reshape(b * h, n, d)
        do = _rows(dout, qs, qe, flip).reshape(b * h, n, dv_)
        # p = exp(scale q k^T + m - lse): the run's probabilities
        neg_lse = -_rows(lse.unsqueeze(-1), qs, qe, flip).reshape(b * h, n, 1)
        p = torch.baddbmm(neg_lse, qb, k3[:, ks:ke].transpose(1, 2), alpha=plan.scale)
        if m is not None:
            p.view(b, h, n, ke - ks).add_(m)
        _exp_(p)
        dv[:, ks:ke] += torch.bmm(p.transpose(1, 2), do)
        ds = torch.baddbmm(_rows(neg_delta, qs, qe, flip).reshape(b * h, n, 1), do, v3[:, ks:ke].transpose(1, 2))
        ds.mul_(p)  # dL/d(logit)
        del p
        gq = torch.bmm(ds, k3[:, ks:ke]).view(b, h, n, d)
        dq[:, :, qs:qe].add_(gq.flip(2) if flip else gq, alpha=plan.scale)
        dk[:, ks:ke].add_(torch.bmm(ds.transpose(1, 2), qb), alpha=plan.scale)
        ds4 = ds.view(b, h, n, ke - ks)
        if ddiag is not None and fixed is not None:
            assert plan.q0 is not None and plan.k0 is not None
            _add_antidiagonals(ddiag, plan.k0 + ks - plan.q0 - qe + 1 - fixed[1], ds4)
        else:
            _add_bias_grads(dparams, tile, ds4, params)
    if diag is not None and ddiag is not None:
        _add_bias_grads(dparams, diag[0], ddiag, params)
    return (dq, dk.view(b, h, lk, d), dv.view(b, h, lk, dv_), *dparams)


# ----------------------------------------------------------------------------- entry points


def _setup(q: Tensor, k: Tensor, v: Tensor, bias_fn: object, bias_params: object, causal: object,
           window: object, chunk: object, scale: object, q_pos: object, k_pos: object,
           attn_mask: object, name: str = "bias_attention") -> tuple[_Prologue, BiasFn | None, list[Tensor]]:
    """The argument checks both entry points share (``name``, the one called): the prologue,
    the bias function (a scheme's ``bias``) and its trainable parameters."""
    if bias_params is not None and (isinstance(bias_params, Tensor) or not isinstance(bias_params, (list, tuple))):
        raise TypeError(
            f"bias_params must be a list or tuple of tensors, got {type(bias_params).__name__}"
            + ("; wrap a single tensor as [tensor]" if isinstance(bias_params, Tensor) else "")
        )
    params = list(bias_params or [])
    owner = bias_fn if isinstance(bias_fn, PositionScheme) else getattr(bias_fn, "__self__", None)
    pro = _prologue(q, k, v, owner if isinstance(owner, PositionScheme) else None, q_pos, k_pos,  # type: ignore[arg-type]
                    causal=causal, scale=scale, attn_mask=attn_mask, window=window, chunk=chunk)  # type: ignore[arg-type]
    if isinstance(bias_fn, PositionScheme):
        extra = set(bias_fn.hooks()) - {"bias"}
        if extra:
            raise ValueError(
                f"{name} honours only the bias hook, but {type(bias_fn).__name__} also "
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
    return pro, bias_fn, params  # type: ignore[return-value]


def _run(fused: bool, plan: _Plan, runs: list[tuple[int, int, int]], q: Tensor, qw: Tensor, kw: Tensor,
         vw: Tensor, params: list[Tensor], probe: tuple[int, int, int]) -> Tensor:
    """Check the bias on the run ``probe`` (or, on the fused path over a band, the offsets'
    vector :meth:`_Plan.diagonal`, kept for the forward pass), with a clear message up front;
    then run the fused or the explicit path, under autograd if anything needs a gradient."""
    if fused and plan.banded:
        diag = plan.diagonal(runs, qw.dtype)
        first: Tensor | None = diag[0]
        plan.diag = (diag[0].detach(), diag[1])
    else:
        first = plan.bias(probe)
    if first is not None and first.requires_grad and torch.is_grad_enabled() and not params:
        raise ValueError(
            "bias_fn returns a tensor that requires grad, but its parameters are unknown: pass "
            "them as bias_params=[...] (or make bias_fn a module or a module's bound method)"
        )
    needs_grad = torch.is_grad_enabled() and (
        qw.requires_grad or kw.requires_grad or vw.requires_grad or any(p.requires_grad for p in params)
    )
    if needs_grad:
        out = _BlockAttention.apply(qw, kw, vw, plan, runs, fused, *params)
    else:
        with torch.no_grad():
            if fused:
                out = _fused_forward(qw, kw, vw, plan, runs, plan.diag)[0]
            else:
                out = _forward(qw, kw, vw, plan, runs)[0]
    return out.to(q.dtype)


def _grad_mode(q: Tensor, k: Tensor, v: Tensor, params: Sequence[Tensor]) -> str:
    """What a call will differentiate, the key of the measured tile sizes
    (:func:`companion.dispatch.fused_block_size`): ``"bias-grad"`` (a bias parameter needs a
    gradient, T5's table), ``"backward"`` (``q``, ``k`` or ``v`` does) or ``"forward"``."""
    if not torch.is_grad_enabled():
        return "forward"
    if any(p.requires_grad for p in params):
        return "bias-grad"
    return "backward" if q.requires_grad or k.requires_grad or v.requires_grad else "forward"


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
    window: int | None = None,
    chunk: int | None = None,
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
    is often faster. On CPU, ``companion.blockwise.fused_bias_attention`` computes the same
    function through torch's fused attention kernel, several times faster; the dispatcher
    :func:`companion.dispatch.fast_attention` uses it. With ``causal=True`` a key tile whose
    earliest position is after every query position of the query tile is skipped without
    being computed (about half the work for self-attention), as is a tile outside the
    ``window`` or the ``chunk``, and only tiles that straddle a boundary are masked.

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
            (batch, head) pairs smaller tiles run faster on CPU.
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
        window, chunk: a sliding window (query ``i`` sees keys ``i - window < j <= i``) or
            chunked attention (keys of the query's chunk, ``j // chunk == i // chunk``), as in
            :func:`~companion.attention.attention`: an int ``>= 1`` or ``None``, with
            ``causal=True`` only.

    Returns:
        ``(batch, heads, q_len, v_dim)`` in ``q``'s dtype; the math runs in float32 for
        half-precision input. A query that may attend no key gets a zero output. NaN and
        inf follow :func:`~companion.attention.attention` exactly, for every ``block_size``:
        a non-finite key or value reaches only the queries that may attend it.

    A scheme (or a scheme's bound ``bias`` method) built for another number of heads than
    ``q`` has raises ``ValueError``, as in :func:`~companion.attention.attention`.
    """
    bq, bkk = _block_sizes(block_size)
    pro, bias_fn, params = _setup(q, k, v, bias_fn, bias_params, causal, window, chunk, scale, q_pos, k_pos,
                                  attn_mask)
    b, h, lq, _, _, lk = pro[:6]
    if lq == 0 or lk == 0:
        return q.new_zeros(b, h, lq, v.shape[-1])
    qw, kw, vw = pro.operands(q, k, v)
    nonfinite = not _all_finite(qw, kw, vw)
    plan = _Plan(bias_fn, pro, bq, bkk, nonfinite)
    # the bias of the first tile is checked up front, with a clear message
    return _run(False, plan, plan.runs(1), q, qw, kw, vw, params, (0, 0, 1))


def _all_finite(*xs: Tensor) -> bool:
    """Whether every entry of every tensor is finite: one sum per tensor (a NaN or an
    infinity makes it non-finite), and the entry-wise test only when a sum is not finite
    (it may overflow)."""
    return all(math.isfinite(float(x.detach().sum())) or bool(torch.isfinite(x).all()) for x in xs)


def _fused_block_sizes(block_size: object) -> tuple[int, int | None] | None:
    """``block_size`` of :func:`fused_bias_attention`, validated; ``None``: the measured choice."""
    if block_size is None:
        return None
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"block_size must be an int or a pair (block_q, block_k), got {block_size!r}")
        bk = block_size[1]
        return (check_positive_int(block_size[0], "block_size[0]"),
                None if bk is None else check_positive_int(bk, "block_size[1]"))
    return check_positive_int(block_size, "block_size"), None


def _fused(q: Tensor, k: Tensor, v: Tensor, pro: _Prologue, bias_fn: BiasFn | None, params: list[Tensor],
           bq: int, bk: int | None, finite: bool | None = None) -> Tensor:
    """:func:`fused_bias_attention` after its checks (the dispatcher calls it with its own
    prologue): ``block_q = bq`` queries per call, at most ``bk`` keys (``None``: all it may
    see); ``finite``: whether ``q, k, v`` are known to be finite (``None``: check)."""
    b, h, lq, d, _, lk = pro[:6]
    if b * lq * lk == 0:
        return q.new_zeros(b, h, lq, v.shape[-1])
    qw, kw, vw = pro.operands(q, k, v)
    if finite is None:
        finite = _all_finite(qw, kw, vw)
    fused = (USE_FUSED and _FLASH_FWD is not None and _FLASH_BWD is not None and q.device.type == "cpu"
             and v.shape[-1] == d and finite)
    if not fused:  # the explicit tile loop, with its own measured tiles
        from .dispatch import block_size_for  # the dispatcher holds the measured rules

        tile = block_size_for(b * h, max(lq, lk))
        plan = _Plan(bias_fn, pro, tile, tile, not finite)
        return _run(False, plan, plan.runs(1), q, qw, kw, vw, params, (0, 0, 1))
    grain = bq if bk is None else min(bq, bk)  # key blocks: the resolution of the skipping
    plan = _Plan(bias_fn, pro, bq, grain)
    if bk is None and bias_fn is not None and not plan.banded:
        bk = max(1, _TILE_ENTRIES // (b * h * bq))  # each call computes its own bias tile: bound its size
        if bk < grain:
            grain = bk
            plan = _Plan(bias_fn, pro, bq, grain)
    runs = plan.runs(None if bk is None else max(1, bk // grain))
    if not runs:  # the rules hide every key from every query: zeros, through the tile loop's autograd
        return _run(False, plan, runs, q, qw, kw, vw, params, (0, 0, 1))
    qi, ka, _ = runs[0]
    return _run(True, plan, runs, q, qw, kw, vw, params, (qi, ka, ka + 1))


def fused_bias_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias_fn: BiasFn | PositionScheme | None = None,
    *,
    causal: bool = False,
    block_size: int | tuple[int, int | None] | None = None,
    scale: float | None = None,
    q_pos: Tensor | Sequence[int] | None = None,
    k_pos: Tensor | Sequence[int] | None = None,
    bias_params: Sequence[Tensor] | None = None,
    attn_mask: Tensor | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> Tensor:
    """:func:`bias_attention`'s function through torch's fused attention kernel, block by block.

    The queries go ``block_q`` at a time. Each block makes one call of torch's fused CPU
    attention kernel (the FlashAttention algorithm, :cite:`dao2022flashattention`) over the
    keys it may see, the causal mask, the ``window`` and the ``chunk`` skipping the others,
    with the block's bias, masks and ``-inf`` for hidden keys as the kernel's float mask; with
    ``block_k`` given, the keys go in calls of at most ``block_k`` (rounded down to a multiple
    of ``min(block_q, block_k)``) and the calls merge exactly through the log-sum-exp the
    kernel returns (``out = sum_c exp(lse_c - lse) out_c``), as in
    :func:`companion.trainfree.two_region_attention`. A bias computed per call (below) gets
    ``block_k = 2**21 / (batch * heads * block_q)`` by default, which bounds its tile.

    For a bias that depends only on ``k_pos - q_pos`` (``relative_bias``: ALiBi, T5, KERPLE)
    over consecutive positions shared by the batch, or no bias, the bias and the causal and
    window masks are one vector over the offsets ``k - q`` per head (``q_len + k_len``
    entries), computed once per pass; with the queries taken in reverse order, every
    block's mask is a strided view of it (row ``r``, key ``t`` reads entry ``base + r + t``),
    so no ``block_q x k_len`` tile is stored or copied. Otherwise (FIRE, per-row positions)
    each call computes its own bias tile.

    The backward pass recomputes each call: with torch's fused backward kernel when no bias
    parameter needs a gradient (there, bias entries whose weight is below ``e**-50`` of their
    row's are raised to that level, which keeps float32's ``exp`` out of its slow denormal
    range and changes no result beyond rounding), and explicitly otherwise, since the
    gradient of a bias parameter (T5's table, KERPLE's, FIRE's) needs the gradient of the
    logits, which the fused kernel does not return; that gradient is summed along the
    offsets (or per tile) and taken through one ``autograd.grad`` to the parameters, exactly.

    Where the fused kernel does not apply (not a CPU tensor, ``v_dim != head_dim``, a NaN or
    infinite value in ``q``, ``k`` or ``v``, or a torch without the kernel), the call runs
    :func:`bias_attention`'s explicit tile loop instead, with the dispatcher's tiles
    (``companion.dispatch.block_size_for``), which keeps the reference's rule for non-finite
    values.

    Args:
        q, k, v, bias_fn, causal, scale, q_pos, k_pos, bias_params, attn_mask, window, chunk:
            as in :func:`bias_attention`.
        block_size: ``block_q`` (an int ``>= 1``: queries per call, each call over all the
            keys its block may see), ``(block_q, block_k)`` (at most ``block_k`` keys per
            call; ``block_k`` ``None`` for no limit), or ``None`` for the tile sizes the
            dispatcher measured (``companion.dispatch.fused_block_size``, which also takes
            the window and the chunk into account).

    Returns:
        ``(batch, heads, q_len, v_dim)`` in ``q``'s dtype (float32 math for half-precision
        input); a query that may attend no key gets a zero output and zero gradients.

    Raises:
        TypeError, ValueError: as :func:`bias_attention`.
    """
    blocks = _fused_block_sizes(block_size)
    pro, bias_fn, params = _setup(q, k, v, bias_fn, bias_params, causal, window, chunk, scale, q_pos, k_pos,
                                  attn_mask, "fused_bias_attention")
    b, h, lq, d, _, lk = pro[:6]
    if blocks is None and b * h * lq * lk == 0:
        blocks = (1, None)  # nothing to compute
    elif blocks is None:
        from .dispatch import fused_block_size  # the measured tile sizes live with the dispatcher

        blocks = (fused_block_size(b * h, max(lq, lk), d, _grad_mode(q, k, v, params), pro.window, pro.chunk),
                  None)
    return _fused(q, k, v, pro, bias_fn, params, *blocks)
