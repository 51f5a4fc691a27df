"""Fused rotary position embedding in Triton (:cite:`tillet2019triton`, :cite:`su2024roformer`).

One launch rotates the queries *and* the keys. A program owns ``BLOCK_S`` positions of one
batch row and a group of heads: it loads the ``BLOCK_S`` rows of the compact cos/sin tables
once, then streams every head of ``q`` and ``k`` in its group through registers, reading each
element once and writing it once. The tables are read once per (position block, batch row,
head group) instead of once per head, and nothing else touches memory.

The arithmetic is :func:`companion.rope.apply_rope`'s contract, so the results are equal bit
for bit in float32: ``a, b`` are loaded and widened to float32; ``a * c - b * s`` and
``b * c + a * s``, each product rounded, then one rounded sum; one cast on store. Compilers
like to contract ``a * c - b * s`` into a fused multiply-add (one rounding fewer), which
would break bit-equality, so the GPU launch passes ``enable_fp_fusion=False``.

The backward pass is the inverse rotation (the rotation by ``-angle``), which is the same
kernel with ``sin`` negated; the pass-through dimensions ``>= rotary_dim`` get the identity.

This module imports Triton; use it through :func:`companion.kernels.fused_rope`, which
validates the arguments and falls back to :func:`companion.rope.apply_rope` where Triton does
not run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .api import KernelRows

__all__ = ["INTERPRETED", "rope_kernel", "launch_rope", "FusedRope"]


@triton.jit
def _rotate_head(
    x_ptr, out_ptr, s_idx, stride_x, stride_out, c, s, mask, p1, p2, pass_idx, pass_mask,
    COPY_PASS: tl.constexpr,
):
    """Rotate the pairs of one head for BLOCK_S positions; copy the pass-through dims."""
    x_rows = x_ptr + s_idx[:, None] * stride_x
    o_rows = out_ptr + s_idx[:, None] * stride_out
    # Load in the input dtype, widen to float32 at once (also what the interpreter needs for bf16).
    a = tl.load(x_rows + p1[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_rows + p2[None, :], mask=mask, other=0.0).to(tl.float32)
    # The contract: four rounded products, one rounded difference and one rounded sum.
    a_new = a * c - b * s
    b_new = b * c + a * s
    tl.store(o_rows + p1[None, :], a_new.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_rows + p2[None, :], b_new.to(out_ptr.dtype.element_ty), mask=mask)
    if COPY_PASS:  # out of place with partial rotary: dims >= rotary_dim are copied unchanged
        keep = tl.load(x_rows + pass_idx[None, :], mask=pass_mask)
        tl.store(o_rows + pass_idx[None, :], keep, mask=pass_mask)


@triton.jit
def rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr,
    seq_len, n_q_heads, n_k_heads,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s,
    sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s,
    table_stride, pos_stride_b, pos_stride_s, row_stride_b, row_coef_s, row_base,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROTARY: tl.constexpr,
    HEAD_DIM: tl.constexpr, PASS_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr, COPY_PASS: tl.constexpr,
    INVERSE: tl.constexpr, BLOCK_S: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
):
    """Grid ``(cdiv(seq, BLOCK_S), batch, head groups)``; see the module docstring.

    The table row of position index ``s`` in batch row ``b`` is
    ``b * row_stride_b + s * row_coef_s + row_base (+ pos[b, s] if HAS_POS)``: this one
    formula covers rows ``0..seq-1``, a scalar offset, per-row offsets, per-row or shared
    positions, and tables already gathered per row.
    """
    pid_s = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    group = tl.program_id(2)
    s_idx = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = s_idx < seq_len
    i = tl.arange(0, HALF_PAD)
    mask = s_ok[:, None] & (i < HALF)[None, :]

    row = b * row_stride_b + s_idx * row_coef_s + row_base
    if HAS_POS:
        row += tl.load(pos_ptr + b * pos_stride_b + s_idx * pos_stride_s, mask=s_ok, other=0)
    t_off = row.to(tl.int64)[:, None] * table_stride + i[None, :]
    c = tl.load(cos_ptr + t_off, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t_off, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:  # rotation by -angle: the adjoint, for the backward pass
        s = -s

    if INTERLEAVED:  # pair i at (2i, 2i + 1): GPT-J / Meta
        p1 = 2 * i
        p2 = 2 * i + 1
    else:  # pair i at (i, i + HALF): GPT-NeoX / HuggingFace
        p1 = i
        p2 = i + HALF
    j = tl.arange(0, PASS_PAD)
    pass_idx = ROTARY + j
    pass_mask = s_ok[:, None] & (pass_idx < HEAD_DIM)[None, :]

    h0 = group * HEADS_PER_PROG
    for h in range(h0, tl.minimum(h0 + HEADS_PER_PROG, n_q_heads)):
        _rotate_head(q_ptr + b * sq_b + h * sq_h, qo_ptr + b * sqo_b + h * sqo_h, s_idx, sq_s, sqo_s,
                     c, s, mask, p1, p2, pass_idx, pass_mask, COPY_PASS)
    for h in range(h0, tl.minimum(h0 + HEADS_PER_PROG, n_k_heads)):
        _rotate_head(k_ptr + b * sk_b + h * sk_h, ko_ptr + b * sko_b + h * sko_h, s_idx, sk_s, sko_s,
                     c, s, mask, p1, p2, pass_idx, pass_mask, COPY_PASS)


#: True when Triton built this module's kernels for its interpreter (``TRITON_INTERPRET=1``).
INTERPRETED: bool = type(rope_kernel).__name__ == "InterpretedFunction"


def _launch_config(batch: int, seq: int, heads: int, half_pad: int, width: int) -> tuple[int, int, int]:
    """``(BLOCK_S, HEADS_PER_PROG, num_warps)``.

    On a GPU: tiles of about 2048 elements per head and enough programs to fill the machine
    (several per SM), so a program takes a few heads. The interpreter's cost grows with the
    number of programs, so it gets large tiles and every head in one program.
    """
    if INTERPRETED:
        return min(triton.next_power_of_2(max(seq, 1)), 128), heads, 1
    block_s = max(1, min(triton.next_power_of_2(max(seq, 1)), 2048 // half_pad))
    programs = triton.cdiv(seq, block_s) * batch
    heads_per_prog = heads
    while heads_per_prog > 1 and programs * triton.cdiv(heads, heads_per_prog) < 1024:
        heads_per_prog //= 2
    num_warps = 4 if block_s * width >= 2048 else 2
    return block_s, heads_per_prog, num_warps


def launch_rope(
    q: Tensor, k: Tensor, q_out: Tensor, k_out: Tensor, cos: Tensor, sin: Tensor,
    rows: KernelRows, *, layout: str, rotary_dim: int, inverse: bool = False,
) -> None:
    """Run ``rope_kernel`` once for ``q`` and ``k``.

    ``cos``/``sin`` are 2-D contiguous tables ``(rows, rotary_dim // 2)``; ``rows`` says which
    row each position reads (:class:`companion.kernels.api.KernelRows`). The last dimension
    of every 4-D tensor has stride 1 (the caller sends other tensors to the reference).
    """
    batch, hq, seq, d = q.shape
    hk = k.shape[1]
    half = rotary_dim // 2
    half_pad = triton.next_power_of_2(half)
    copy_pass = rotary_dim < d and (q_out.data_ptr() != q.data_ptr())
    pass_pad = triton.next_power_of_2(max(d - rotary_dim, 1))
    block_s, hpp, warps = _launch_config(batch, seq, max(hq, hk), half_pad, d)
    grid = (triton.cdiv(seq, block_s), batch, triton.cdiv(max(hq, hk), hpp))
    pos = rows.pos
    rope_kernel[grid](
        q, k, q_out, k_out, cos, sin, pos if pos is not None else cos,
        seq, hq, hk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos.stride(0), rows.pos_stride_b, rows.pos_stride_s,
        rows.row_stride_b, rows.row_coef_s, rows.row_base,
        HALF=half, HALF_PAD=half_pad, ROTARY=rotary_dim, HEAD_DIM=d, PASS_PAD=pass_pad,
        INTERLEAVED=layout == "interleaved", HAS_POS=pos is not None, COPY_PASS=copy_pass,
        INVERSE=inverse, BLOCK_S=block_s, HEADS_PER_PROG=hpp,
        num_warps=warps, enable_fp_fusion=False,
    )


class FusedRope(torch.autograd.Function):
    """Out-of-place fused RoPE of ``(q, k)``; the backward pass is the inverse rotation."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, rows: KernelRows,  # type: ignore[override]
                layout: str, rotary_dim: int) -> tuple[Tensor, Tensor]:
        """Rotate ``q`` and ``k`` into fresh tensors; save the tables for the backward pass."""
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        launch_rope(q, k, q_out, k_out, cos, sin, rows, layout=layout, rotary_dim=rotary_dim)
        ctx.save_for_backward(cos, sin, *(t for t in (rows.pos,) if t is not None))
        ctx.rows, ctx.layout, ctx.rotary_dim = rows, layout, rotary_dim
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out: Tensor, dk_out: Tensor):  # type: ignore[override]
        """Rotate the incoming gradients by the opposite angles (one launch for both)."""
        cos, sin = ctx.saved_tensors[:2]
        # The kernel needs a unit stride in the last dimension; incoming grads usually have it.
        dq_out = dq_out if dq_out.stride(-1) == 1 else dq_out.contiguous()
        dk_out = dk_out if dk_out.stride(-1) == 1 else dk_out.contiguous()
        dq, dk = torch.empty_like(dq_out), torch.empty_like(dk_out)
        launch_rope(dq_out, dk_out, dq, dk, cos, sin, ctx.rows, layout=ctx.layout,
                    rotary_dim=ctx.rotary_dim, inverse=True)
        return dq, dk, None, None, None, None, None
