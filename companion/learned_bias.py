"""Learned additive biases beyond T5's buckets: KERPLE's kernels and FIRE's MLP.

Both are ``bias`` schemes: a content-free term added to each attention logit, like ALiBi
(:mod:`companion.alibi`) and T5 (:mod:`companion.relative`), but with a few learned
parameters per head instead of fixed slopes or a bucket table.

* :class:`KerpleBias` (Chi et al., :cite:`chi2022kerple`): a conditionally positive definite
  kernel of the distance, ``-r1 log(1 + r2 |i - j|)`` or ``-r1 |i - j|^r2``, with two
  positive parameters per head. It depends only on ``|i - j|``: a relative bias.
* :class:`FIRE` (Li et al., :cite:`li2024fire`): a small MLP ``f`` applied to the distance
  after a learned log transform and a normalisation by the query's own position,
  ``f(psi(i - j) / psi(max(L, i)))``. The normaliser makes it *not* relative: it depends on
  the query position ``i`` too (once ``i`` exceeds the learned threshold ``L``).

Either bias is a pure function of the two position tensors, so
:func:`companion.blockwise.bias_attention` can ask for it one tile at a time, and the
gradients of every parameter flow through both that path and the reference
:func:`companion.attention.attention`. Everything is computed in float32 or better (float64
if the module was cast to float64), never in a half-precision input dtype.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import check_choice, check_finite_number, check_position_pair, check_positive_int
from .attention import PositionScheme

__all__ = ["KERPLE_FORMS", "KerpleBias", "FIRE"]

#: The kernel forms of :class:`KerpleBias`.
KERPLE_FORMS: tuple[str, ...] = ("log", "power")


def _work_dtype(param: Tensor) -> torch.dtype:
    """float32 or better: float64 parameters compute in float64, everything else in float32."""
    return torch.promote_types(param.dtype, torch.float32)


def _distances(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``|k_pos[j] - q_pos[i]|`` as int64: ``(q_len, k_len)`` or ``(batch, q_len, k_len)``."""
    return (k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)).abs_()


# ============================================================================ KERPLE


def _initial_values(value: object, name: str, n_heads: int, low: float, high: float | None,
                    scale: float, form: str) -> Tensor:
    """The initial ``(n_heads,)`` float32 values of one KERPLE parameter.

    ``None``: the reference implementation's draw, ``scale * U[0, 1)`` per head, projected
    into ``[low, high]`` as the reference's first forward pass does. A number or a sequence
    of ``n_heads`` numbers: each must be finite and in ``[low, high]``.
    """
    rule = f"in [eps, 2] = [{low:g}, {high:g}]" if high is not None else f">= eps = {low:g}"
    why = " (the exponent of |i - j|)" if high is not None else " (KERPLE's parameters are positive)"
    if value is None:
        return (torch.rand(n_heads) * scale).clamp_(min=low, max=high)
    if isinstance(value, Tensor):
        if value.dim() > 1 or not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"{name} must be a number or a sequence of {n_heads} numbers, got a "
                            f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}")
        items: list[object] = [float(x) for x in value.detach().cpu().reshape(-1).tolist()]
        if value.dim() == 0:
            items = items * n_heads
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        items = [value] * n_heads
    elif isinstance(value, Sequence) and not isinstance(value, str):
        items = list(value)
    else:
        raise TypeError(f"{name} must be a number or a sequence of {n_heads} numbers, got "
                        f"{type(value).__name__}")
    if len(items) != n_heads:
        raise ValueError(f"{name} must have one value per head ({n_heads}), got {len(items)}")
    out = []
    for x in items:
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise TypeError(f"{name} must hold numbers, got {type(x).__name__} {x!r}")
        x = float(x)
        if not (x == x and abs(x) != float("inf")) or x < low or (high is not None and x > high):
            raise ValueError(f"{name} must be {rule} for form={form!r}{why}, got {x!r}")
        out.append(x)
    return torch.tensor(out, dtype=torch.float32)


class KerpleBias(PositionScheme):
    """KERPLE's kernelized relative position bias (Chi et al., :cite:`chi2022kerple`).

    With ``d = |i - j|`` the distance between query position ``i`` and key position ``j`` and
    two learned positive parameters per head ``h``:

    * ``form="log"`` (the paper's best): ``b_h(i, j) = -r1_h log(1 + r2_h d)``;
    * ``form="power"``: ``b_h(i, j) = -r1_h d^{r2_h}`` with ``0 < r2_h <= 2`` (``r2 = 1``
      with fixed ``r1`` is ALiBi).

    Both are shift-invariant and symmetric in ``i - j``, so ``relative_bias = True``. A causal
    model only ever sees keys at or before the query (``d = i - j``); for keys after it
    (bidirectional use) the bias is the same kernel of ``|i - j|``, so an encoder gets a
    symmetric bias. (The reference code writes distance 0, bias 0, for future keys, which
    the causal mask removes; under a causal mask the two agree entry by entry.)

    **Conventions matched** (the authors' Megatron code, chijames/KERPLE,
    ``ParallelKerpleLog`` and ``ParallelKerplePower``):

    * Parameter roles. The reference calls them ``bias_p`` and ``bias_a``; its log kernel is
      ``-bias_p log(1 + bias_a d)``, its power kernel ``-bias_a d^bias_p``. So for
      ``"log"``: ``r1 = bias_p``, ``r2 = bias_a``; for ``"power"``: ``r1 = bias_a``,
      ``r2 = bias_p``. Both are one value per head; the reference stores them as
      ``(heads, 1, 1)``, here they are ``(n_heads,)``.
    * Initialisation (``r1=None`` / ``r2=None``): as the reference, ``bias_p ~ 2 U[0, 1)``
      and ``bias_a ~ U[0, 1)`` per head, drawn from torch's global generator.
    * Positivity: the reference keeps ``bias_a, bias_p >= eps = 0.01`` and, for the power
      exponent, ``bias_p <= 2``, by clamping. Same ``eps`` and bounds here.

    **Deliberate difference: how the bounds are kept.** The reference clamps the parameters'
    ``.data`` *in place* inside every forward pass (a projection step hidden in the forward
    pass). Here :meth:`bias` never mutates state (it must be a pure function of the
    positions: :func:`~companion.blockwise.bias_attention` calls it once per tile, in the
    forward pass and again in the backward recomputation). It uses ``clamp(r, eps[, 2])``
    out of place instead, which gives the same bias values, and the true derivative of the
    clamped kernel: exact inside the bounds, 0 past them. Clamping rather than a softplus
    keeps the parameters equal to the paper's ``r1, r2`` (readable, and the reference's
    trained values load as they are, reshaped to ``(n_heads,)``) and the forward values
    identical to the reference's. The
    initial values are projected into the bounds as the reference's first forward does, and
    :meth:`project_` performs the reference's in-place projection; call it after each
    optimiser step to reproduce the reference's projected training exactly (otherwise a
    parameter that an update pushes past a bound gets no gradient from the bias until
    another term moves it back).

    Args:
        n_heads: number of (query) heads, ``>= 1``.
        form: one of :data:`KERPLE_FORMS`, ``"log"`` (default) or ``"power"``.
        r1, r2: initial values, a number or a sequence of ``n_heads`` numbers, or ``None``
            for the reference's random draw. Each must be ``>= eps``; ``r2 <= 2`` for
            ``"power"``. Anything else raises ``ValueError`` naming the argument.
        eps: the lower bound of both parameters, a finite number ``> 0`` (the reference's
            ``0.01``); ``<= 2`` for ``"power"``.

    Attributes:
        r1, r2: ``(n_heads,)`` float32 parameters (raw; :meth:`kernel_parameters` gives the
            clamped values the bias uses).
    """

    #: The bias depends only on ``k_pos - q_pos`` (through ``|i - j|``):
    #: :func:`~companion.blockwise.bias_attention` may reuse one tile per diagonal of tiles.
    relative_bias = True

    def __init__(self, n_heads: int, *, form: str = "log", r1: float | Sequence[float] | None = None,
                 r2: float | Sequence[float] | None = None, eps: float = 1e-2) -> None:
        super().__init__()
        self.n_heads = check_positive_int(n_heads, "n_heads")
        self.form = check_choice(form, "form", KERPLE_FORMS)
        self.eps = check_finite_number(eps, "eps")
        self.r2_max = 2.0 if form == "power" else None
        if self.r2_max is not None and self.eps > self.r2_max:
            raise ValueError(f"eps must be <= 2 for form='power' (r2 lies in [eps, 2]), got {eps!r}")
        # The lower bound as a float32 number (0.01 rounds to 0.0099999998): a parameter
        # stored at the bound in float32 and cast to float64 must not fall below a float64
        # bound, where the clamp would cut its gradient.
        self._low = float(torch.tensor(self.eps, dtype=torch.float32))
        # The reference's scales: bias_p ~ 2 U[0, 1), bias_a ~ U[0, 1).
        scale1, scale2 = (2.0, 1.0) if form == "log" else (1.0, 2.0)
        self.r1 = nn.Parameter(_initial_values(r1, "r1", n_heads, self.eps, None, scale1, form))
        self.r2 = nn.Parameter(_initial_values(r2, "r2", n_heads, self.eps, self.r2_max, scale2, form))

    def scheme_heads(self) -> int:
        """``n_heads``: one ``(r1, r2)`` pair per query head."""
        return self.n_heads

    def kernel_parameters(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """The clamped ``(r1, r2)`` the bias uses, ``(n_heads,)`` each: ``r1 >= eps``,
        ``r2 >= eps`` (and ``<= 2`` for ``"power"``). Differentiable (out-of-place clamp).
        ``dtype`` defaults to float32 or better (float64 parameters stay float64)."""
        dtype = _work_dtype(self.r1) if dtype is None else dtype
        r1 = self.r1.to(dtype).clamp(min=self._low)
        r2 = self.r2.to(dtype).clamp(min=self._low, max=self.r2_max)
        return r1, r2

    @torch.no_grad()
    def project_(self) -> KerpleBias:
        """Clamp ``r1, r2`` into their bounds in place, as the reference does in every forward
        pass (here: call it after an optimiser step). Returns ``self``."""
        self.r1.clamp_(min=self._low)
        self.r2.clamp_(min=self._low, max=self.r2_max)
        return self

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The KERPLE bias for integer positions.

        ``-r1_h log(1 + r2_h |i - j|)`` (``"log"``) or ``-r1_h |i - j|^{r2_h}``
        (``"power"``), with ``i = q_pos``, ``j = k_pos``, in float32 (float64 if the module
        is float64). Positions are integer tensors (or lists of ints), ``(len,)`` or
        ``(batch, len)``; float positions raise ``TypeError``.

        Returns:
            ``(n_heads, q_len, k_len)`` for shared positions, ``(batch, n_heads, q_len,
            k_len)`` if either position tensor is per row.
        """
        q_pos, k_pos = check_position_pair(q_pos, k_pos)
        dist = _distances(q_pos, k_pos)
        r1, r2 = self.kernel_parameters()
        r1, r2 = r1.to(dist.device), r2.to(dist.device)
        if dist.dim() == 2:
            r1, r2 = r1.view(-1, 1, 1), r2.view(-1, 1, 1)
        else:
            dist = dist.unsqueeze(1)
            r1, r2 = r1.view(1, -1, 1, 1), r2.view(1, -1, 1, 1)
        d = dist.to(r1.dtype)  # exact: distances are integers below 2**24 in float32
        if self.form == "log":
            return -r1 * torch.log1p(r2 * d)
        # d ** r2 at d = 0 is 0 for r2 > 0; torch's pow backward gives the exponent a zero
        # (not NaN) gradient there.
        return -r1 * torch.pow(d, r2)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, form={self.form!r}, eps={self.eps:g}, " + super().extra_repr()


# ============================================================================ FIRE


class FIRE(PositionScheme):
    """FIRE: functional interpolation for relative positions (Li et al., :cite:`li2024fire`).

    With ``i`` the query position, ``j`` the key position, ``psi(x) = log(c x + 1)`` and a
    small MLP ``f: R -> R^{n_heads}``::

        b(i, j) = f( psi(i - j) / psi(max(L, i)) )

    ``c > 0`` and the threshold ``L > 0`` are learned. For ``i <= L`` the normaliser is the
    constant ``psi(L)`` and the bias depends only on ``i - j`` (a relative bias); past
    ``L`` it is normalised by the query's own position, ``psi(i)``, so the MLP's input stays
    in ``[0, 1]`` at any length ("progressive interpolation"). So the bias is **not**
    relative and the class has no ``relative_bias``. ``i`` is the query's true position
    (``q_pos``): in KV-cache decoding the normaliser of the one new query uses its real
    position, not its index in the query block.

    Keys after the query (``j > i``) are removed by the causal mask, which is the setting
    of the paper. Their value is defined all the same, as ``f(psi(|i - j|) / psi(max(L,
    i)))``: the listing below takes the absolute value of ``c (i - j)``, so a bidirectional
    use gets the same function of the distance on both sides.

    **Conventions matched** (the paper's Section 3 and the PyTorch listing in its
    appendix):

    * ``f`` is ``Linear(1, hidden) -> ReLU -> Linear(hidden, n_heads)`` with ``hidden = 32``
      and torch's default ``nn.Linear`` initialisation, stored as ``self.mlp`` (an
      ``nn.Sequential``, so the state-dict keys are ``mlp.0.*`` and ``mlp.2.*``);
    * ``c`` is one learned scalar, initialised to ``0.1``, used as ``|c|``;
    * the threshold is ``L = |L_multiplier * init_L|`` with a fixed ``init_L = 512`` (a
      buffer) and a learned scalar ``L_multiplier`` initialised to 1: learning ``L`` through
      a multiplier of order 1 gives it a gradient step on the scale of the other parameters
      instead of 512 times smaller. ``max(L, i)`` lets short sequences keep a fine
      resolution (the paper's "thresholding the normaliser");
    * the normaliser is ``psi(max(L, i)) + eps`` with ``eps = 1e-6`` (it is ``>= psi(L) > 0``
      anyway unless ``L`` or ``c`` collapse to 0).

    ``psi`` is computed as ``log1p(c x)``, the same function with a more accurate small-``x``
    end. One instance may be shared by every layer (the paper's FIRE-S) or one made per
    layer (FIRE).

    **Cost.** The MLP runs on every (query, key) pair: the full bias holds ``n_heads x
    q_len x k_len`` values plus a ``hidden x q_len x k_len`` hidden layer, which is why the
    blockwise path, which asks for one tile at a time, matters much more here than for ALiBi
    (see ``benchmarks/fire_cpu.py``).

    Args:
        n_heads: number of (query) heads, ``>= 1`` (the MLP's output width).
        hidden: the MLP's hidden width, ``>= 1`` (32 in the paper).
        init_c: initial ``c``, a finite number ``> 0`` (0.1).
        init_L: the threshold's scale ``init_L``, a finite number ``> 0`` (512; the paper
            ties it to the training length).
        eps: added to the normaliser, a finite number ``>= 0`` (1e-6).

    Attributes:
        mlp: the MLP ``f``.
        c: scalar parameter (used as ``|c|``).
        L_multiplier: scalar parameter; :attr:`threshold` is ``|L_multiplier * init_L|``.
        init_L: scalar buffer.
    """

    def __init__(self, n_heads: int, *, hidden: int = 32, init_c: float = 0.1, init_L: float = 512.0,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.n_heads = check_positive_int(n_heads, "n_heads")
        self.hidden = check_positive_int(hidden, "hidden")
        init_c = check_finite_number(init_c, "init_c")
        init_L = check_finite_number(init_L, "init_L")
        self.eps = check_finite_number(eps, "eps", minimum=0)
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, n_heads))
        self.c = nn.Parameter(torch.tensor(init_c, dtype=torch.float32))
        self.L_multiplier = nn.Parameter(torch.tensor(1.0, dtype=torch.float32))
        self.register_buffer("init_L", torch.tensor(init_L, dtype=torch.float32))

    def scheme_heads(self) -> int:
        """``n_heads``: the MLP has one output per query head."""
        return self.n_heads

    @property
    def threshold(self) -> Tensor:
        """The learned threshold ``L = |L_multiplier * init_L|`` (a 0-d tensor, with grad)."""
        return (self.L_multiplier * self.init_L).abs()

    def mlp_input(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The MLP's input ``psi(|i - j|) / (psi(max(L, i)) + eps)`` for integer positions,
        ``(q_len, k_len)`` or ``(batch, q_len, k_len)``, in float32 or better."""
        q_pos, k_pos = check_position_pair(q_pos, k_pos)
        work = _work_dtype(self.c)
        device = k_pos.device
        c = self.c.to(device=device, dtype=work).abs()
        L = (self.L_multiplier.to(device=device, dtype=work) * self.init_L.to(device=device, dtype=work)).abs()
        dist = _distances(q_pos, k_pos).to(work)  # exact below 2**24 in float32
        norm = torch.log1p(c * torch.maximum(q_pos.to(work), L)) + self.eps  # (..., q_len)
        return torch.log1p(c * dist) / norm.unsqueeze(-1)

    def mlp_forward(self, x: Tensor) -> Tensor:
        """``f(x)`` for a tensor of MLP inputs: shape ``x.shape + (n_heads,)``, computed in
        ``x``'s dtype (the parameters are cast to it, so float16 weights still run in
        float32)."""
        lin1, lin2 = self.mlp[0], self.mlp[2]
        w1, b1 = lin1.weight.to(x.dtype), lin1.bias.to(x.dtype)
        w2, b2 = lin2.weight.to(x.dtype), lin2.bias.to(x.dtype)
        # ReLU in place: the hidden layer (hidden x the input's size) exists once, not twice.
        return F.linear(torch.relu_(F.linear(x.unsqueeze(-1), w1, b1)), w2, b2)

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The FIRE bias ``f(psi(|i - j|) / psi(max(L, i)))`` for integer positions.

        ``i = q_pos`` (the queries' true positions), ``j = k_pos``. Positions are integer
        tensors (or lists of ints), ``(len,)`` or ``(batch, len)``; float positions raise
        ``TypeError``. A pure function of the two tensors: any sub-range of positions gives
        the matching block of the full bias (what the blockwise path relies on).

        Returns:
            ``(n_heads, q_len, k_len)`` for shared positions, ``(batch, n_heads, q_len,
            k_len)`` if either position tensor is per row; float32 (float64 if the module is
            float64).
        """
        out = self.mlp_forward(self.mlp_input(q_pos, k_pos))  # (..., q_len, k_len, heads)
        return out.movedim(-1, -3).contiguous()

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, hidden={self.hidden}, eps={self.eps:g}, "
                + super().extra_repr())
