"""Helpers shared by the test files: seeded random tensors, HuggingFace's RoPE formulas written
out, a learned-bias test scheme, and derived rounding-error bounds.

Imported as ``from helpers import rand``: pytest's default ``prepend`` import mode puts
``tests/`` (the folder of tests/conftest.py, which has no ``__init__.py``) on ``sys.path``, as
for tests/lab_user_scheme.py, under ``pytest tests`` and under pytest-xdist workers alike.

Nothing here comes from companion: a convention slip in the package cannot hide behind a
shared helper.

Random tensors. Three generators, kept apart because tests depend on their exact values:

* :func:`rand`: a standard normal drawn in float64, times ``scale``, cast to ``dtype``
  (float64 by default); :func:`rand_f32` is the same draw cast to float32 by default;
* :func:`rand_native`: drawn in ``dtype`` itself (for float64 the same numbers as :func:`rand`,
  for float32 other numbers);
* :func:`rand32`: drawn in float32 (torch's default dtype), then cast to ``dtype``.

Unit roundoffs (half the machine epsilon): ``U32 = 2**-24``, ``U64 = 2**-53``,
``U_FP16 = 2**-11``, ``U_BF16 = 2**-8``. A correctly rounded operation has relative error at
most ``u``; a library function accurate to one ulp (cos, sin, exp, pow) at most ``2 u``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from companion.attention import PositionScheme, attention

U32 = 2.0**-24
U64 = 2.0**-53
U_FP16 = 2.0**-11
U_BF16 = 2.0**-8


# ----------------------------------------------------------------------------- random tensors


def rand(*shape, dtype=torch.float64, seed=0, scale=1.0, requires_grad=False):
    """A seeded standard normal drawn in float64, times ``scale``, cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)
    return x.requires_grad_(requires_grad)


def rand_f32(*shape, dtype=torch.float32, seed=0):
    """:func:`rand`'s float64 draw, cast to float32 unless told otherwise."""
    return rand(*shape, dtype=dtype, seed=seed)


def rand_native(*shape, dtype=torch.float64, seed=0, requires_grad=False):
    """A seeded standard normal drawn directly in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


def rand32(*shape, dtype=torch.float32, seed=0):
    """A seeded standard normal drawn in float32, then cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def qkv(*, b, h, lq, lk, d, hk=None, dtype=torch.float64, seed=0, requires_grad=False, draw=rand_native):
    """``q (b, h, lq, d)``, ``k, v (b, hk, lk, d)`` drawn by ``draw`` with seeds ``seed + 1``,
    ``seed + 2``, ``seed + 3``. Each test file binds its own default shape with
    ``functools.partial``."""
    hk = h if hk is None else hk
    return tuple(draw(*shape, dtype=dtype, seed=seed + i).requires_grad_(requires_grad)
                 for i, shape in ((1, (b, h, lq, d)), (2, (b, hk, lk, d)), (3, (b, hk, lk, d))))


# ----------------------------------------------------------------------------- HuggingFace's RoPE


def hf_inv_freq(dim, base=10000.0):
    """HuggingFace's _compute_default_rope_parameters / Meta's precompute_freqs_cis, float32."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def hf_cos_sin(position_ids, inv_freq, attention_scaling=1.0):
    """HuggingFace's LlamaRotaryEmbedding.forward: full-width tables cat(freqs, freqs), float32."""
    inv = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    pos = position_ids[:, None, :].float()
    freqs = (inv @ pos).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply(q, k, cos, sin):
    """HuggingFace's apply_rotary_pos_emb with unsqueeze_dim=1."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + hf_rotate_half(q) * sin, k * cos + hf_rotate_half(k) * sin


# ----------------------------------------------------------------------------- a learned-bias scheme


class TableBias(PositionScheme):
    """A T5-like learned bias per (head, clipped relative position ``k - q``), the table drawn
    by :func:`rand_native` with ``seed``."""

    def __init__(self, heads, max_dist=5, seed=7):
        super().__init__()
        self.max_dist = max_dist
        self.table = nn.Parameter(rand_native(heads, 2 * max_dist + 1, seed=seed))

    def bias(self, q_pos, k_pos):
        rel = (k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)).clamp(-self.max_dist, self.max_dist)
        out = self.table[:, rel + self.max_dist]  # (heads, q, k) or (heads, batch, q, k)
        return out if rel.dim() == 2 else out.movedim(0, 1)


# ----------------------------------------------------------------------------- bounds: RoPE


def pow_bound(base, u=U32):
    """Relative error of a float32 ``1 / b ** fl(2 i / d)`` against ``b ** (-2 i / d)``.

    fl(2 i / d) = e (1 + d1): b ** (e d1) = 1 + e ln(b) d1, at most ln(b) U (e < 1);
    b rounded to float32: e U <= U; pow accurate to 1 ulp: 2 U; the reciprocal: U.
    """
    return (math.log(base) + 4) * u


def pair_index(layout, r):
    """Indices of the first and second coordinate of each rotated pair."""
    if layout == "interleaved":
        return torch.arange(0, r, 2), torch.arange(1, r, 2)
    return torch.arange(r // 2), torch.arange(r // 2, r)


def rotation_tol(x, theta_abs, layout, r, angle_err=0.0, *, u=U32, per_angle=4, const=6):
    """Per-coordinate bound ``(|a| + |b|) (u (per_angle Theta + const) + angle_err)`` on a
    rotated pair ``(a, b)`` of ``x`` against the exact rotation, ``Theta`` (``theta_abs``,
    broadcasting to ``(..., r/2)``) the magnitude of the angle; zero past ``r`` (copied
    dimensions). tests/test_grid.py derives the default ``4 Theta + 6`` for angles that are
    sums of products; a single product ``p theta`` costs ``Theta + 4`` (one rounding of the
    angle, 2 u for cos/sin, 2 u for the two products and the sum)."""
    x = x.double().abs()
    ia, ib = pair_index(layout, r)
    per_pair = (x[..., ia] + x[..., ib]) * (u * (per_angle * theta_abs + const) + angle_err)
    tol = torch.zeros(*per_pair.shape[:-1], x.shape[-1], dtype=torch.float64)
    tol[..., ia] = per_pair
    tol[..., ib] = per_pair
    return tol


def assert_within(got, want, tol):
    """Every entry of ``got`` within its entry of ``tol`` of ``want`` (compared in float64)."""
    err = (got.detach().double() - want.detach().double()).abs()
    excess = err - tol
    assert bool((excess <= 0).all()), (
        f"max error {float(err.max()):.3e}, worst excess over the bound {float(excess.max()):.3e}")


# ----------------------------------------------------------------------------- bounds: attention


def attention_error_bounds(q, k, v, dout, scheme, q_pos, k_pos, causal, scale, mask, dtype, blocks=1):
    """Entry-wise rounding-error bounds for one computation of attention's output and
    gradients (flash attention, the dense reference, or the blockwise one), against the exact
    result.

    Standard forward error analysis (worst case, Higham's gamma_n = n u), evaluated on the
    float64 oracle's magnitudes. The computation runs in float32 (unit roundoff ``u``; float64
    for float64 inputs) and, for fp16/bf16 inputs, rounds P and dS to the input dtype (unit
    roundoff ``u_lo``) before the matrix products that produce out, dV, dK and dQ, as
    FlashAttention does:

    * logits ``s_ij = scale q_i.k_j + b_ij`` are off by at most ``u (d scale |q_i|.|k_j| + |b_ij|)``;
      softmax turns that into a relative error of ``P_ij`` of at most
      ``R_i = u (2 max_j (d scale |q_i|.|k_j| + |b_ij|) + 4)``;
    * an online softmax over ``blocks`` key blocks rescales its running sums once per block by
      ``exp(m_old - m_new)`` (2 u for the exp, u for the subtraction of the running maxima,
      whose changes add up to at most the logits' range, u for the product), in the numerator
      and the denominator: ``R_i`` grows by ``u (6 blocks + 4 max_j |s_ij|)`` when ``blocks > 1``;
    * a sum of ``n`` terms adds ``n u`` times the sum of their absolute values;
    * ``dS_ij = P_ij (dP_ij - D_i)``, with ``dP_ij = do_i.v_j`` (``d`` terms) and
      ``D_i = sum_j P_ij dP_ij``, is bounded by ``T_ij = P_ij (|do_i|.|v_j| + sum_j P_ij |do_i|.|v_j|)``
      and off by at most ``E_ij = T_ij (2 R_i + u (d + k_len + 2))``;
    * rounding P or dS to fp16/bf16 adds ``u_lo`` relative, or half the subnormal spacing
      ``eta`` absolute where an entry underflows.

    The T5 table gradient sums float32 dS over each bucket. The final rounding of each result
    to its own dtype is not included (:func:`assert_within_rounded` adds it). Returns a dict of
    tensors shaped like ``out, dq, dk, dv, dtable``.
    """
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    group = h // hk
    u = U64 if dtype == torch.float64 else U32
    low = dtype not in (torch.float32, torch.float64)
    info = torch.finfo(dtype)
    u_lo = info.eps / 2 if low else 0.0
    eta = info.smallest_normal * info.eps / 2 if low else 0.0
    scale = d**-0.5 if scale is None else scale
    q_pos = torch.arange(max(lk - lq, 0), max(lk - lq, 0) + lq) if q_pos is None else q_pos
    k_pos = torch.arange(lk) if k_pos is None else k_pos
    with torch.no_grad():
        _, P = attention(q, k, v, scheme, q_pos, k_pos, causal=causal, scale=scale, attn_mask=mask,
                         return_weights=True)
    kr, vr = k.detach().repeat_interleave(group, 1), v.detach().repeat_interleave(group, 1)
    Q, K, V, G = q.detach().abs(), kr.abs(), vr.abs(), dout.abs()
    bias = torch.zeros(1, dtype=torch.float64)
    table = None
    if scheme is not None:
        table = getattr(scheme, "table", None)
        bias = scheme.bias(q_pos, k_pos).detach().double()
    if mask is not None:
        bias = bias + mask.double().masked_fill(~torch.isfinite(mask.double()), 0)
    logit_mag = d * scale * (Q @ K.transpose(-1, -2)) + bias.abs()  # (b, h, lq, lk)
    R = u * (2 * logit_mag.amax(-1, keepdim=True) + 4)  # (b, h, lq, 1)
    if blocks > 1:
        R = R + u * (6 * blocks + 4 * logit_mag.amax(-1, keepdim=True))
    A = G @ V.transpose(-1, -2)  # |do_i|.|v_j|
    D_abs = (P * A).sum(-1, keepdim=True)
    T = P * (A + D_abs)
    E = T * (2 * R + u * (d + lk + 2))  # dS in float32
    E_lo = E + u_lo * T + eta  # dS as the operand of the dQ and dK products
    ungroup = lambda t: t.unflatten(1, (hk, group)).sum(2)  # noqa: E731  (GQA: sum over the group)
    bounds = {
        "out": (P @ V) * (R + u_lo + u * lk) + eta * V.sum(-2, keepdim=True),
        "dv": ungroup(P.transpose(-1, -2) @ (G * (R + u_lo + u * lq)) + eta * G.sum(-2, keepdim=True)),
        "dq": scale * ((E_lo + u * lk * T) @ K),
        "dk": ungroup(scale * ((E_lo + u * lq * T).transpose(-1, -2) @ Q)),
    }
    if table is not None:
        # Each table entry sums dS over its bucket (at most q_len * k_len terms). The bucket sum
        # of a weight W is the gradient of sum(W * bias) with respect to the table.
        W = (E + u * lq * lk * T).sum(0)
        with torch.enable_grad():
            bounds["dtable"] = torch.autograd.grad((scheme.bias(q_pos, k_pos) * W).sum(), table)[0]
    return bounds


def attention_out_bound(q, k, v, scheme=None, *, causal=False, q_pos=None, k_pos=None, scale=None, mask=None,
                        dtype=torch.float32, blocks=1):
    """:func:`attention_error_bounds`' output bound for one computation in ``dtype`` (float32
    math for fp16/bf16), plus the rounding of the result to ``dtype``, on float64 copies of
    ``q, k, v``. Two computations of the same attention differ by at most the sum of their
    two bounds."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    with torch.no_grad():
        ref = attention(q, k, v, scheme, q_pos, k_pos, causal=causal, scale=scale, attn_mask=mask)
    out = attention_error_bounds(q, k, v, torch.ones_like(ref), scheme, q_pos, k_pos, causal, scale, mask,
                                 dtype, blocks)["out"]
    return out + torch.finfo(dtype).eps / 2 * ref.abs()


def assert_within_rounded(x, x64, bound, name="output"):
    """Every entry of ``x`` is within its derived bound of the float64 oracle ``x64``, plus
    the final rounding of ``x`` to its own dtype."""
    err = (x.double() - x64).abs()
    info = torch.finfo(x.dtype)
    bound = bound + info.eps / 2 * x64.abs() + info.smallest_normal * info.eps / 2  # subnormal spacing / 2
    worst = (err - bound).argmax() if err.numel() else None
    assert (err <= bound).all(), (
        f"{name}: error {float(err.flatten()[worst]):.3g} > its bound {float(bound.flatten()[worst]):.3g} "
        f"(largest error {float(err.max()):.3g})"
    )


# ----------------------------------------------------------------------------- bounds: softmax attention, any logits


def softmax_attention_bounds(P, logit_abs, logit_err, val_abs, *, out_terms, u, dout=None, dp_terms=0):
    """Entry-wise rounding-error bounds for one computation of ``out_i = sum_j P_ij V_ij`` with
    ``P_i = softmax(s_i)`` computed by ``torch.softmax`` (and, given ``dout``, of the softmax
    backward ``dS_ij = P_ij (dP_ij - sum_j P_ij dP_ij)``, ``dP_ij = dout_i . V_ij``), against
    the exact result, for logits and values of any structure (a ``score`` hook's pairwise
    keys and values, whose magnitudes :func:`attention_error_bounds` does not see).

    Worst-case first-order analysis (Higham's gamma_n = n u), evaluated on the float64
    oracle's magnitudes. The caller bounds its own logits and values:

    * ``P`` ``(..., q_len, k_len)``: the weights (float64 oracle); masked keys have ``P = 0``;
    * ``logit_abs >= |s_ij|`` and ``logit_err >= |fl(s_ij) - s_ij|``, ``(..., q_len, k_len)``;
    * ``val_abs >= |V_ij|`` entry-wise, broadcasting to ``(..., q_len, k_len, v_dim)``;
    * ``out_terms``: roundings per term ``P_ij V_ij`` of the output (forming ``V_ij``, the
      products, the sums), ``dp_terms`` those of ``dP_ij`` (relative to ``|dout_i|.|V_ij|``).

    The softmax: perturbing the logits by at most ``D_i = max_j logit_err`` moves each weight
    by a factor in ``exp(+-2 D_i)``; subtracting the row maximum rounds by at most
    ``u (|s_ij| + |m_i|) <= 2 u max_j logit_abs``, a logit perturbation again (times 2); exp
    (one ulp, 2 u) in numerator and denominator, 4 u; the denominator's sum of ``k_len``
    terms, ``(k_len - 1) u``; the division (or a reciprocal and a product), 2 u. So
    ``R_i = 2 D_i + u (4 max_j logit_abs + k_len + 5)``, and
    ``|out_i - exact| <= (R_i + out_terms u) sum_j P_ij |V_ij|``.

    The backward (as in :func:`attention_error_bounds`): with ``A_ij = |dout_i|.|V_ij|``,
    ``|dS_ij| <= T_ij = P_ij (A_ij + sum_j P_ij A_ij)`` and the computed ``dS`` is off by at most
    ``E_ij = T_ij (2 R_i + u (dp_terms + k_len + 2))`` (``P``'s error twice, ``dP``'s, the row
    sum of ``k_len`` products, the difference and the product).

    Returns a dict of ``R`` ``(..., q_len, 1)`` and ``out`` ``(..., q_len, v_dim)``, and with
    ``dout`` also ``T`` and ``E`` ``(..., q_len, k_len)``.
    """
    k_len = P.shape[-1]
    R = 2 * logit_err.amax(-1, keepdim=True) + u * (4 * logit_abs.amax(-1, keepdim=True) + k_len + 5)
    bounds = {"R": R, "out": (P[..., None] * val_abs).sum(-2) * (R + out_terms * u)}
    if dout is not None:
        A = (dout.detach().abs()[..., None, :] * val_abs).sum(-1)
        T = P * (A + (P * A).sum(-1, keepdim=True))
        bounds.update(T=T, E=T * (2 * R + u * (dp_terms + k_len + 2)))
    return bounds
