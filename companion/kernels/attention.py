"""Flash attention with a position bias computed inside the kernel, in Triton.

Forward (:cite:`dao2022flashattention`, :cite:`dao2024flashattention2`): a program owns
``BLOCK_M`` queries of one (batch, head) and walks over the keys ``BLOCK_N`` at a time with an
online softmax (:cite:`milakov2018online`). For each tile it computes the logits
``scale * q k^T``, adds the position bias *for that tile only*, from the positions it has
just loaded, and folds the tile into a running maximum, normaliser and output. The
``L x L`` logits, probabilities and bias never exist in memory. Two biases:

* ALiBi (:cite:`press2022train`): ``-m_h * |k_pos - q_pos|`` from the head's slope; one
  subtraction, one absolute value and one multiply per logit.
* T5 buckets (:cite:`raffel2020exploring`): the host buckets every *offset* ``k_pos - q_pos``
  that can occur (clamped to ``[-max_distance, max_distance]``, beyond which the bucket no
  longer changes) with :func:`companion.relative.t5_relative_position_bucket`, and looks the
  table up once: a vector of at most ``2 * max_distance + 1`` values per head. The kernel
  gathers from it by offset, so the bias is bit for bit T5's, and its memory is ``O(1)`` in
  the sequence length.

The kernel saves one log-sum-exp per query row (in base 2, since it works with ``exp2``).
The backward pass (FlashAttention-2's recomputation) runs two kernels: one per key block
for ``dK, dV`` (and the T5 offset gradient), one per query block for ``dQ``; both recompute
the probabilities of each tile from ``q, k``, the bias and the saved log-sum-exp. The T5
gradient is summed per offset with float32 atomics (so its last bits depend on the order of
the additions), then scattered onto the buckets by autograd on the host.

Causal masking is by position (``k_pos <= q_pos``), like
:func:`companion.attention.attention`; when the positions increase along the sequence (the
usual case) the host computes, per block, how far the loops must go, so key blocks entirely
in the future are never visited.

The math is float32 throughout (every load is widened at once: Triton's interpreter gets
bfloat16 wrong otherwise). On a GPU the two matrix products take their operands in the
input dtype (fp16/bf16 tensor cores with float32 accumulation, as FlashAttention does);
float32 inputs multiply in full IEEE float32.

Use it through :func:`companion.kernels.flash_attention_with_bias`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .api import AttentionMeta

__all__ = ["INTERPRETED", "attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel", "FlashBiasAttention"]

BIAS_NONE, BIAS_ALIBI, BIAS_T5 = 0, 1, 2
LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(base, offs_rows, stride_row, offs_d, rows_ok, d_ok, DOT_F32: tl.constexpr):
    """Rows ``offs_rows`` of one head, ``(rows, D_PAD)``, widened to float32 at once (the
    interpreter gets bfloat16 wrong otherwise); back in the input dtype for the tensor cores
    unless ``DOT_F32`` (exact: the values came from that dtype)."""
    x = tl.load(base + offs_rows[:, None] * stride_row + offs_d[None, :],
                mask=rows_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    if not DOT_F32:
        x = x.to(base.dtype.element_ty)
    return x


@triton.jit
def _positions(POS, stride_b, b, offs, ok, start, CONTIG: tl.constexpr):
    """Positions of rows ``offs``: ``start + offs`` when the positions are the default
    contiguous ones (nothing to load), otherwise loaded (shared or per batch row)."""
    if CONTIG:
        pos = start + offs
    else:
        pos = tl.load(POS + b * stride_b + offs, mask=ok, other=0)
    return pos


@triton.jit
def _causal_kv_end(KV_END, kve_b, b, pid_m, q_len, k_len, q0, k0,
                   BLOCK_M: tl.constexpr, CONTIG: tl.constexpr):
    """How many keys query block ``pid_m`` must visit under the causal mask."""
    if CONTIG:  # the block's last query is at q0 + min(end, q_len) - 1; key j is at k0 + j
        last = q0 + tl.minimum((pid_m + 1) * BLOCK_M, q_len) - 1
        end = tl.minimum(tl.maximum(last - k0 + 1, 0), k_len)
    else:
        end = tl.load(KV_END + b * kve_b + pid_m)  # computed on the host (see kv_end)
    return end


@triton.jit
def _tile_logits(q, kt, qp, kp, valid, scale_log2, slope_log2, t5_row, t5_lo, t5_hi,
                 BIAS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """Logits of one tile in base-2 units, ``log2(e) * (scale * q k^T + bias)``, ``-inf`` where
    masked. ``qp``/``kp`` are the tile's query/key positions."""
    s = tl.dot(q, kt, input_precision=PREC) * scale_log2
    rel = kp[None, :] - qp[:, None]  # k_pos - q_pos, exact in int32
    if BIAS == 1:  # ALiBi: -m_h * |j - i|
        s -= slope_log2 * tl.abs(rel).to(tl.float32)
    if BIAS == 2:  # T5: the table value of the offset's bucket, gathered from the per-offset vector
        idx = tl.minimum(tl.maximum(rel, t5_lo), t5_hi) - t5_lo
        s += tl.load(t5_row + idx, mask=valid, other=0.0) * 1.4426950408889634
    if CAUSAL:
        valid = valid & (rel <= 0)
    return tl.where(valid, s, float("-inf")), valid


@triton.jit
def _query_stats(LSE, DELTA, bh, offs_m, m_ok, q_len):
    """The saved log-sum-exp (base 2) and ``D = rowsum(dO * O)`` of query rows."""
    row = bh.to(tl.int64) * q_len + offs_m
    lse = tl.load(LSE + row, mask=m_ok, other=float("inf"))  # +inf: probability 0
    delta = tl.load(DELTA + row, mask=m_ok, other=0.0)
    return lse, delta


@triton.jit
def _tile_grads(q, kt, v, do, lse, delta, qp, kp, valid, scale_log2, slope_log2, t5_row, t5_lo, t5_hi,
                BIAS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """Recompute one tile's probabilities ``P`` and the logits' gradient ``dS = P (dP - D)``."""
    s, valid = _tile_logits(q, kt, qp, kp, valid, scale_log2, slope_log2, t5_row, t5_lo, t5_hi,
                            BIAS, CAUSAL, PREC)
    p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    return p, p * (dp - delta[:, None]), valid


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE, QPOS, KPOS, KV_END, SLOPES, T5VEC,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
    sqp_b, skp_b, kve_b,
    n_heads, group, q_len, k_len, scale_log2, t5_lo, t5_hi, t5_n, q0, k0,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BIAS: tl.constexpr, CAUSAL: tl.constexpr, CONTIG: tl.constexpr, DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    """Grid ``(cdiv(q_len, BLOCK_M), batch * heads)``: one query block of one head."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = bh % n_heads
    hk = h // group  # the key/value head this query head reads (grouped-query attention)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM

    q = _load_rows(Q + b * sq_b + h * sq_h, offs_m, sq_s, offs_d, m_ok, d_ok, DOT_F32)
    qp = _positions(QPOS, sqp_b, b, offs_m, m_ok, q0, CONTIG)
    slope_log2 = tl.load(SLOPES + h).to(tl.float32) * 1.4426950408889634
    t5_row = T5VEC + h * t5_n

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row maximum (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running normaliser
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)  # running unnormalised output
    kv_end = k_len
    if CAUSAL:  # keys beyond are in the future of every query of the block
        kv_end = _causal_kv_end(KV_END, kve_b, b, pid_m, q_len, k_len, q0, k0, BLOCK_M, CONTIG)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k_len
        k = _load_rows(K + b * sk_b + hk * sk_h, offs_n, sk_s, offs_d, n_ok, d_ok, DOT_F32)
        v = _load_rows(V + b * sv_b + hk * sv_h, offs_n, sv_s, offs_d, n_ok, d_ok, DOT_F32)
        kp = _positions(KPOS, skp_b, b, offs_n, n_ok, k0, CONTIG)
        s, valid = _tile_logits(q, tl.trans(k), qp, kp, m_ok[:, None] & n_ok[None, :], scale_log2,
                                slope_log2, t5_row, t5_lo, t5_hi, BIAS, CAUSAL, PREC)
        # Online softmax: rescale what was accumulated by 2^(m_old - m_new), add this tile.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    empty = l_i == 0.0  # a query that may attend no key: output 0, log-sum-exp +inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + bh.to(tl.int64) * q_len + offs_m, lse, mask=m_ok)


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, KPOS, Q_START, SLOPES, T5VEC, DT5,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
    sdk_b, sdk_h, sdk_s,
    sqp_b, skp_b, qs_b,
    n_heads, group, q_len, k_len, scale, scale_log2, t5_lo, t5_hi, t5_n, q0, k0,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BIAS: tl.constexpr, CAUSAL: tl.constexpr, CONTIG: tl.constexpr, DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    """Grid ``(cdiv(k_len, BLOCK_N), batch * heads)``: ``dK, dV`` of one key block of one query
    head (summed over the heads of a group on the host), and the T5 offset gradient."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = bh % n_heads
    hk = h // group
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    n_ok = offs_n < k_len
    d_ok = offs_d < HEAD_DIM

    k = _load_rows(K + b * sk_b + hk * sk_h, offs_n, sk_s, offs_d, n_ok, d_ok, DOT_F32)
    v = _load_rows(V + b * sv_b + hk * sv_h, offs_n, sv_s, offs_d, n_ok, d_ok, DOT_F32)
    kt = tl.trans(k)
    kp = _positions(KPOS, skp_b, b, offs_n, n_ok, k0, CONTIG)
    slope_log2 = tl.load(SLOPES + h).to(tl.float32) * 1.4426950408889634
    t5_row = T5VEC + h * t5_n
    dt5_row = DT5 + h * t5_n

    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    q_start = 0
    if CAUSAL:  # earlier queries see none of these keys
        if CONTIG:  # the first query at or after this block's first key, k0 + pid_n * BLOCK_N
            q_start = tl.maximum(k0 + pid_n * BLOCK_N - q0, 0) // BLOCK_M * BLOCK_M
        else:
            q_start = tl.load(Q_START + b * qs_b + pid_n)  # computed on the host (see q_start)
    for start_m in range(q_start, q_len, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        q = _load_rows(Q + b * sq_b + h * sq_h, offs_m, sq_s, offs_d, m_ok, d_ok, DOT_F32)
        do = _load_rows(DO + b * sdo_b + h * sdo_h, offs_m, sdo_s, offs_d, m_ok, d_ok, DOT_F32)
        lse, delta = _query_stats(LSE, DELTA, bh, offs_m, m_ok, q_len)
        qp = _positions(QPOS, sqp_b, b, offs_m, m_ok, q0, CONTIG)
        p, ds, valid = _tile_grads(q, kt, v, do, lse, delta, qp, kp, m_ok[:, None] & n_ok[None, :],
                                   scale_log2, slope_log2, t5_row, t5_lo, t5_hi, BIAS, CAUSAL, PREC)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
        if BIAS == 2:  # dL/d(bias) = ds, summed per offset
            rel = tl.minimum(tl.maximum(kp[None, :] - qp[:, None], t5_lo), t5_hi)
            low = valid & (rel == t5_lo)
            high = valid & (rel == t5_hi) & (rel != t5_lo)
            inner = valid & (rel != t5_lo) & (rel != t5_hi)
            # Saturated offsets (beyond +-max_distance, most of a long sequence) land on the two
            # end entries: reduce them in registers first, one atomic each.
            tl.atomic_add(dt5_row, tl.sum(tl.sum(tl.where(low, ds, 0.0), 1), 0))
            tl.atomic_add(dt5_row + (t5_hi - t5_lo), tl.sum(tl.sum(tl.where(high, ds, 0.0), 1), 0))
            tl.atomic_add(dt5_row + (rel - t5_lo), ds, mask=inner)

    out_off = b * sdk_b + h * sdk_h + offs_n[:, None] * sdk_s + offs_d[None, :]
    nd_mask = n_ok[:, None] & d_ok[None, :]
    tl.store(DK + out_off, (dk * scale).to(DK.dtype.element_ty), mask=nd_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=nd_mask)


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QPOS, KPOS, KV_END, SLOPES, T5VEC,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
    sdq_b, sdq_h, sdq_s,
    sqp_b, skp_b, kve_b,
    n_heads, group, q_len, k_len, scale, scale_log2, t5_lo, t5_hi, t5_n, q0, k0,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BIAS: tl.constexpr, CAUSAL: tl.constexpr, CONTIG: tl.constexpr, DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    """Grid ``(cdiv(q_len, BLOCK_M), batch * heads)``: ``dQ`` of one query block of one head."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = bh % n_heads
    hk = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM

    q = _load_rows(Q + b * sq_b + h * sq_h, offs_m, sq_s, offs_d, m_ok, d_ok, DOT_F32)
    do = _load_rows(DO + b * sdo_b + h * sdo_h, offs_m, sdo_s, offs_d, m_ok, d_ok, DOT_F32)
    lse, delta = _query_stats(LSE, DELTA, bh, offs_m, m_ok, q_len)
    qp = _positions(QPOS, sqp_b, b, offs_m, m_ok, q0, CONTIG)
    slope_log2 = tl.load(SLOPES + h).to(tl.float32) * 1.4426950408889634
    t5_row = T5VEC + h * t5_n

    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = k_len
    if CAUSAL:
        kv_end = _causal_kv_end(KV_END, kve_b, b, pid_m, q_len, k_len, q0, k0, BLOCK_M, CONTIG)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k_len
        k = _load_rows(K + b * sk_b + hk * sk_h, offs_n, sk_s, offs_d, n_ok, d_ok, DOT_F32)
        v = _load_rows(V + b * sv_b + hk * sv_h, offs_n, sv_s, offs_d, n_ok, d_ok, DOT_F32)
        kp = _positions(KPOS, skp_b, b, offs_n, n_ok, k0, CONTIG)
        _, ds, _ = _tile_grads(q, tl.trans(k), v, do, lse, delta, qp, kp, m_ok[:, None] & n_ok[None, :],
                               scale_log2, slope_log2, t5_row, t5_lo, t5_hi, BIAS, CAUSAL, PREC)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    tl.store(DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


#: True when Triton built this module's kernels for its interpreter (``TRITON_INTERPRET=1``).
INTERPRETED: bool = type(attn_fwd_kernel).__name__ == "InterpretedFunction"


# ============================================================================ host side


def _fwd_config(d_pad: int) -> dict:
    """Block sizes and launch options of the forward kernel (the interpreter uses the same
    blocks: its cost grows with the number of programs, not with the tile size)."""
    if d_pad <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if d_pad <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)


def _bwd_config(d_pad: int) -> dict:
    """The dK/dV program keeps two float32 ``BLOCK_N x D_PAD`` accumulators: 8 warps for wide
    heads keep them in registers."""
    if d_pad <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    if d_pad <= 128:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=1)


def _block_reduce(pos: Tensor, block: int, fill: int, reduce: str) -> Tensor:
    """Per-block max (or min) of positions ``(rows, L)`` -> ``(rows, cdiv(L, block))``."""
    rows, length = pos.shape
    pad = (-length) % block
    if pad:
        pos = torch.cat((pos, pos.new_full((rows, pad), fill)), dim=1)
    blocks = pos.view(rows, -1, block)
    return blocks.amax(-1) if reduce == "max" else blocks.amin(-1)


def _sorted_rows(pos: Tensor) -> bool:
    return pos.shape[1] < 2 or bool((pos[:, 1:] >= pos[:, :-1]).all())


def kv_end(q_pos: Tensor, k_pos: Tensor, block_m: int) -> Tensor:
    """For each (row, query block): how many keys the loop must visit under the causal mask.

    When the key positions increase along the sequence, that is the number of keys at or
    before the block's latest query position (a binary search); otherwise every key.
    Returns int32 ``(rows, cdiv(q_len, block_m))``, ``rows`` the larger batch of the two.
    """
    rows = max(q_pos.shape[0], k_pos.shape[0])
    q_pos, k_pos = q_pos.expand(rows, -1), k_pos.expand(rows, -1).contiguous()
    q_hi = _block_reduce(q_pos, block_m, torch.iinfo(torch.int32).min, "max")
    if not _sorted_rows(k_pos):
        return torch.full_like(q_hi, k_pos.shape[1]).int()
    return torch.searchsorted(k_pos, q_hi.contiguous(), right=True).int()


def q_start(q_pos: Tensor, k_pos: Tensor, block_m: int, block_n: int) -> Tensor:
    """For each (row, key block): the first query index (a multiple of ``block_m``) whose block
    may see a key of the block under the causal mask (0 unless the query positions increase).
    """
    rows = max(q_pos.shape[0], k_pos.shape[0])
    q_pos, k_pos = q_pos.expand(rows, -1).contiguous(), k_pos.expand(rows, -1)
    k_lo = _block_reduce(k_pos, block_n, torch.iinfo(torch.int32).max, "min")
    if not _sorted_rows(q_pos):
        return torch.zeros_like(k_lo).int()
    first = torch.searchsorted(q_pos, k_lo.contiguous(), right=False)
    return (first // block_m * block_m).int()


def _slopes(meta: AttentionMeta, heads: int, device: torch.device) -> Tensor:
    """ALiBi's slopes, or zeros when there is no ALiBi (the kernels always read one per head)."""
    return meta.slopes if meta.slopes is not None else torch.zeros(heads, device=device)


def _common(q: Tensor, k: Tensor, dtype: torch.dtype) -> dict:
    """Launch options shared by the three kernels."""
    d = q.shape[-1]
    # Matrix-product operands: float32 for float32 data (IEEE, no TF32 rounding); the input
    # dtype for fp16/bf16 (tensor cores). The interpreter multiplies bf16 wrongly, so there
    # bf16 data multiplies in float32; fp16 takes the GPU's path, so the tests exercise it.
    dot_f32 = dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)
    return dict(HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)), DOT_F32=dot_f32,
                PREC="ieee" if dot_f32 else "tf32")


class FlashBiasAttention(torch.autograd.Function):
    """Flash attention with an in-kernel ALiBi or T5 bias; gradients for q, k, v and the T5
    per-offset vector (from which autograd scatters the table gradient onto the buckets).

    ``meta`` (:class:`companion.kernels.api.AttentionMeta`) holds the non-tensor arguments:
    the bias kind, the ALiBi slopes, the T5 offset range, ``causal``, ``scale`` and the
    positions.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, t5_vec: Tensor,  # type: ignore[override]
                meta: AttentionMeta) -> Tensor:
        """Run the forward kernel; save the inputs, the output and the row log-sum-exp."""
        out, lse = _forward(q, k, v, t5_vec, meta)
        ctx.save_for_backward(q, k, v, t5_vec, out, lse)
        ctx.meta = meta
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # type: ignore[override]
        """Recompute the tiles: gradients of q, k, v and of the T5 per-offset vector."""
        q, k, v, t5_vec, out, lse = ctx.saved_tensors
        dq, dk, dv, dvec = _backward(q, k, v, t5_vec, out, lse, dout, ctx.meta,
                                     want_vec=ctx.needs_input_grad[3])
        return dq, dk, dv, dvec, None


def _batch_stride(t: Tensor) -> int:
    """Stride of the batch axis of a ``(1 or batch, n)`` tensor, 0 when shared."""
    return t.stride(0) if t.shape[0] > 1 else 0


def _position_args(meta: AttentionMeta, device: torch.device, causal_tables: tuple[int, int, int] | None):
    """``(q_pos, k_pos, kv_end table, q_start table)`` for a launch. With the default
    contiguous positions, the kernels compute everything and get a dummy in each slot."""
    if meta.q_pos is None:
        dummy = torch.zeros(1, 1, dtype=torch.int32, device=device)
        return dummy, dummy, dummy, dummy
    qp, kp = meta.q_pos, meta.k_pos
    if not (meta.causal and causal_tables):
        return qp, kp, qp, qp
    block_m_end, block_m_start, block_n_start = causal_tables
    return qp, kp, kv_end(qp, kp, block_m_end), q_start(qp, kp, block_m_start, block_n_start)


def _forward(q: Tensor, k: Tensor, v: Tensor, t5_vec: Tensor, meta: AttentionMeta) -> tuple[Tensor, Tensor]:
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    opts = _common(q, k, q.dtype)
    cfg = _fwd_config(opts["D_PAD"])
    qp, kp, ends, _ = _position_args(meta, q.device, (cfg["BLOCK_M"], 1, 1))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, lq, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(lq, cfg["BLOCK_M"]), b * h)
    attn_fwd_kernel[grid](
        q, k, v, out, lse, qp, kp, ends, _slopes(meta, h, q.device), t5_vec,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        _batch_stride(qp), _batch_stride(kp), _batch_stride(ends),
        h, h // hk, lq, lk, meta.scale * LOG2E, meta.t5_lo, meta.t5_hi, t5_vec.shape[-1],
        meta.q0, meta.k0,
        BIAS=meta.bias, CAUSAL=meta.causal, CONTIG=meta.q_pos is None, **opts, **cfg,
    )
    return out, lse


def _backward(q: Tensor, k: Tensor, v: Tensor, t5_vec: Tensor, out: Tensor, lse: Tensor,
              dout: Tensor, meta: AttentionMeta, want_vec: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    group = h // hk
    opts = _common(q, k, q.dtype)
    cfg = _bwd_config(opts["D_PAD"])
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    # D_i = sum_d dO_id O_id, one float per query row (FlashAttention-2's preprocessing step)
    delta = (dout.float() * out.float()).sum(-1).contiguous()
    qp, kp, ends, starts = _position_args(meta, q.device, (bm, bm, bn))
    slopes = _slopes(meta, h, q.device)
    # Grouped-query attention: dK, dV per query head in float32, summed over each group below.
    grad_dtype = k.dtype if group == 1 else torch.float32
    dk = torch.empty(b, h, lk, d, device=q.device, dtype=grad_dtype)
    dv = torch.empty(b, h, lk, d, device=q.device, dtype=grad_dtype)
    dq = torch.empty_like(q)
    dvec = torch.zeros_like(t5_vec, dtype=torch.float32)
    common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
              v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2))
    tail = (h, group, lq, lk, meta.scale, meta.scale * LOG2E, meta.t5_lo, meta.t5_hi,
            t5_vec.shape[-1], meta.q0, meta.k0)
    flags = dict(BIAS=meta.bias, CAUSAL=meta.causal, CONTIG=meta.q_pos is None, **opts, **cfg)
    attn_bwd_dkdv_kernel[(triton.cdiv(lk, bn), b * h)](
        q, k, v, dout, lse, delta, dk, dv, qp, kp, starts, slopes, t5_vec, dvec,
        *common, dk.stride(0), dk.stride(1), dk.stride(2),
        _batch_stride(qp), _batch_stride(kp), _batch_stride(starts), *tail, **flags,
    )
    attn_bwd_dq_kernel[(triton.cdiv(lq, bm), b * h)](
        q, k, v, dout, lse, delta, dq, qp, kp, ends, slopes, t5_vec,
        *common, dq.stride(0), dq.stride(1), dq.stride(2),
        _batch_stride(qp), _batch_stride(kp), _batch_stride(ends), *tail, **flags,
    )
    if group > 1:
        dk = dk.view(b, hk, group, lk, d).sum(2).to(k.dtype)
        dv = dv.view(b, hk, group, lk, d).sum(2).to(v.dtype)
    return dq, dk, dv, (dvec.to(t5_vec.dtype) if want_vec else None)
