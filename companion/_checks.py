"""Input validation shared by every module.

Every public function in :mod:`companion` checks its arguments with these helpers, so that
bad input fails early with a message that names the argument and the allowed range, rather
than with a shape error from deep inside torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_tensor(x: object, name: str, ndim: int | None = None) -> torch.Tensor:
    """Require ``x`` to be a tensor, optionally with ``ndim`` dimensions."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_positive_int(value: object, name: str, minimum: int = 1) -> int:
    """Require an integer ``value >= minimum`` (bools are rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def as_positions(
    pos: torch.Tensor | Sequence[int] | None,
    name: str,
    length: int,
    batch: int | None = None,
    device: torch.device | None = None,
    default_start: int = 0,
) -> torch.Tensor:
    """Validate integer positions and return them as an ``int64`` tensor.

    Positions are either shared by the batch, shape ``(length,)``, or given per row, shape
    ``(batch, length)`` (left padding, packed sequences). ``None`` means
    ``arange(default_start, default_start + length)``. Floating-point positions are
    rejected on purpose: a position computed in bf16 or fp16 is silently rounded (bf16 holds
    every integer only up to 256), so positions must be integers from the start.
    """
    if pos is None:
        return torch.arange(default_start, default_start + length, device=device)
    if not isinstance(pos, torch.Tensor):
        try:
            pos = torch.as_tensor(pos)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name} must be an integer tensor or a sequence of ints") from exc
    if pos.dtype not in _INT_DTYPES:
        raise TypeError(
            f"{name} must hold integers (torch.int64 or torch.int32), got dtype {pos.dtype}; "
            "positions are never floating point"
        )
    shapes = f"({length},)" + (f" or ({batch}, {length})" if batch is not None else "")
    if pos.dim() == 1:
        ok = pos.shape[0] == length
    elif pos.dim() == 2 and batch is not None:
        ok = pos.shape == (batch, length)
    else:
        ok = False
    if not ok:
        raise ValueError(f"{name} must have shape {shapes}, got {tuple(pos.shape)}")
    if device is not None and pos.device != device:
        pos = pos.to(device)
    return pos.long()


def check_position_range(pos: torch.Tensor, name: str, low: int = 0, high: int | None = None) -> None:
    """Require ``low <= pos < high`` (``high=None``: no upper limit)."""
    if pos.numel() == 0:
        return
    lo, hi = int(pos.min()), int(pos.max())
    if lo < low:
        raise IndexError(f"{name} must be >= {low}, got a position {lo}")
    if high is not None and hi >= high:
        raise IndexError(
            f"{name} must be < {high} (the table has {high} rows, positions 0..{high - 1}), "
            f"got a position {hi}"
        )


def check_qkv(q: object, k: object, v: object) -> tuple[int, int, int, int, int, int]:
    """Validate attention inputs; return ``(batch, heads, q_len, head_dim, kv_heads, k_len)``.

    ``q`` is ``(batch, heads, q_len, head_dim)``, ``k`` is ``(batch, kv_heads, k_len,
    head_dim)`` with ``heads`` a multiple of ``kv_heads`` (grouped-query attention), ``v`` is
    ``(batch, kv_heads, k_len, v_dim)``; all three share one floating dtype.
    """
    check_tensor(q, "q", 4)
    check_tensor(k, "k", 4)
    check_tensor(v, "v", 4)
    b, h, lq, d = q.shape
    bk, hk, lk, dk = k.shape
    if bk != b:
        raise ValueError(f"k batch size {bk} must equal q batch size {b}")
    if dk != d:
        raise ValueError(f"k head_dim {dk} must equal q head_dim {d}")
    if hk < 1 or h % hk:
        raise ValueError(f"q heads ({h}) must be a multiple of k heads ({hk})")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v shape {tuple(v.shape)} must match k in (batch, heads, seq) = {tuple(k.shape[:3])}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share a floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return b, h, lq, d, hk, lk
