"""Input validation shared by every module.

Every public function in :mod:`companion` checks its arguments with these helpers, so that
bad input fails early with a message that names the argument and the allowed range, rather
than with a shape error from deep inside torch. One rule, one message: the torch reference,
the blockwise path and the Triton kernels all validate through the same functions here, so
that no two backends of one op can disagree about what is allowed.

Error types (see the book page *Conventions and errors*):

* ``TypeError``: the argument has the wrong type (a string where a number goes, a float
  tensor where positions go, a ``bool`` flag given as ``"False"``);
* ``ValueError``: the right type with a bad value or shape (``nan``, ``0``, a mask that
  does not broadcast, a scheme built for another head count);
* ``IndexError``: a position outside a table's range.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from pathlib import Path

import torch

#: Integer dtypes accepted for positions and index tensors (``bool`` is not one of them).
INT_DTYPES: tuple[torch.dtype, ...] = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

#: Every size, count and position fits an int64; a larger Python int can never be valid.
INT64_LIMIT = 2**63


def check_has_data(x: torch.Tensor, name: str) -> torch.Tensor:
    """Require a tensor that holds values: a ``meta`` tensor (shape only) raises ``ValueError``
    naming ``name`` (torch would fail later with "Cannot copy out of meta tensor")."""
    if x.is_meta:
        raise ValueError(
            f"{name} is a meta tensor (a shape without data); pass a tensor on a real device "
            f"such as 'cpu' or 'cuda'"
        )
    return x


def check_tensor(x: object, name: str, ndim: int | None = None) -> torch.Tensor:
    """Require ``x`` to be a tensor, optionally with ``ndim`` dimensions."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_positive_int(value: object, name: str, minimum: int = 1) -> int:
    """Require an integer ``minimum <= value < 2**63`` (bools are rejected; no size, count or
    position of a tensor reaches 2**63, and torch fails on larger ints with an overflow)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value >= INT64_LIMIT:
        raise ValueError(f"{name} must be < 2**63 (an int64), got {value}")
    return value


def check_bool(value: object, name: str) -> bool:
    """Require a real ``bool`` (``"False"``, ``0`` or ``None`` are rejected: ``"False"`` is
    truthy, so accepting it would silently switch the flag on)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return value


def check_finite_number(
    value: object,
    name: str,
    *,
    positive: bool = True,
    minimum: float | None = None,
    above: float | None = None,
) -> float:
    """Require a finite real number in range; return it as a ``float``.

    The range is ``value > above`` if ``above`` is given, else ``value >= minimum`` if
    ``minimum`` is given, else ``value > 0`` when ``positive`` (the default), else any finite
    number. Strings, bools, ``None`` and tensors raise ``TypeError``; ``nan``, ``inf`` and
    values out of range raise ``ValueError``. The message names ``name`` and the range.
    """
    if above is not None:
        rule, ok = f"> {above:g}", lambda x: x > above
    elif minimum is not None:
        rule, ok = f">= {minimum:g}", lambda x: x >= minimum
    elif positive:
        rule, ok = "> 0", lambda x: x > 0
    else:
        rule, ok = "", lambda x: True
    wanted = f"a finite number {rule}".rstrip()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {wanted}, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        raise ValueError(f"{name} must be {wanted}, got an int too large for a float: {value!r}") from None
    if not math.isfinite(number) or not ok(number):
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return number


def check_float_dtype(dtype: object, name: str = "dtype") -> torch.dtype:
    """Require a floating-point ``torch.dtype`` (tables are never built in an integer dtype:
    ``sin`` and ``cos`` would be truncated to 0 and 1). A string such as ``"float16"``
    raises ``TypeError`` saying to pass ``torch.float16``."""
    if isinstance(dtype, str):
        raise TypeError(
            f"{name} must be a floating-point torch.dtype, got the string {dtype!r}; "
            f"pass torch.{dtype.removeprefix('torch.')} instead"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"{name} must be a floating-point torch.dtype (torch.float32, torch.float64, "
            f"torch.float16, torch.bfloat16), got {dtype!r}"
        )
    return dtype


def check_choice(value: object, name: str, choices: Sequence[object]) -> object:
    """Require ``value`` to be one of ``choices``."""
    if not any(value == c and type(value) is type(c) for c in choices):
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_int_tensor(
    x: object,
    name: str,
    *,
    dims: Sequence[int] | None = None,
    what: str = "positions",
) -> torch.Tensor:
    """Validate an integer tensor (positions, distances, indices); return it as ``int64``.

    Accepts an integer tensor or anything ``torch.as_tensor`` turns into one (a list of
    ints, a numpy integer array). ``None``, floating-point, complex or bool values raise
    ``TypeError`` naming ``name``: a position computed in bf16 or fp16 is silently rounded
    (bf16 holds every integer only up to 256), so positions must be integers from the start.
    ``dims``, if given, lists the allowed numbers of dimensions (``ValueError`` otherwise).
    Does not change the device.
    """
    if x is None:
        raise TypeError(f"{name} must be an integer tensor of {what}, got None")
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an integer tensor of {what}, got bool")
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(
                f"{name} must be an integer tensor or a sequence of ints, got {type(x).__name__}"
            ) from exc
        if x.numel() == 0 and x.is_floating_point():  # torch reads [] as float32
            x = x.long()
    check_has_data(x, name)
    if x.dtype not in INT_DTYPES:
        raise TypeError(
            f"{name} must hold integers (torch.int64 or torch.int32), got dtype {x.dtype}; "
            f"{what} are never floating point"
        )
    if dims is not None and x.dim() not in tuple(dims):
        shapes = {0: "()", 1: "(seq,)", 2: "(batch, seq)"}
        allowed = " or ".join(shapes.get(d, f"{d}-D") for d in dims)
        raise ValueError(f"{name} must have shape {allowed}, got {tuple(x.shape)}")
    return x.long()


def check_position_pair(q_pos: object, k_pos: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate query and key positions for a ``(q_len, k_len)`` table (masks, biases,
    relative positions): integer tensors (or lists of ints), ``(len,)`` or ``(batch, len)``,
    per-row batch sizes equal. Returns both as ``int64``, ``q_pos`` moved to ``k_pos``'s
    device."""
    q_pos = check_int_tensor(q_pos, "q_pos", dims=(1, 2))
    k_pos = check_int_tensor(k_pos, "k_pos", dims=(1, 2))
    if q_pos.dim() == 2 and k_pos.dim() == 2 and q_pos.shape[0] != k_pos.shape[0]:
        raise ValueError(
            f"q_pos and k_pos per-row batch sizes must match, got {q_pos.shape[0]} and {k_pos.shape[0]}"
        )
    return q_pos.to(k_pos.device), k_pos


def contiguous_start(pos: torch.Tensor) -> int | None:
    """``pos[0]`` if ``pos`` is a non-empty 1-D integer tensor equal to
    ``arange(pos[0], pos[0] + len(pos))`` (consecutive positions shared by the batch), else
    ``None``. The fast paths (Toeplitz biases, ``rel_shift``) use it."""
    if not isinstance(pos, torch.Tensor) or pos.dim() != 1 or pos.numel() == 0 or pos.dtype not in INT_DTYPES:
        return None
    start = int(pos[0])
    if pos.numel() == 1 or bool((pos[1:] - pos[:-1] == 1).all()):
        return start
    return None


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
    rejected on purpose (see :func:`check_int_tensor`).
    """
    if pos is None:
        return torch.arange(default_start, default_start + length, device=device)
    pos = check_int_tensor(pos, name)
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
    return pos


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
    ``(batch, kv_heads, k_len, v_dim)``; all three share one floating dtype and one device.
    """
    check_tensor(q, "q", 4)
    check_tensor(k, "k", 4)
    check_tensor(v, "v", 4)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_has_data(t, name)
    b, h, lq, d = q.shape
    if d < 1:
        raise ValueError(f"q head_dim must be >= 1 (the logits are scaled by 1 / sqrt(head_dim)), got shape {tuple(q.shape)}")
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
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    return b, h, lq, d, hk, lk


def check_scheme_heads(scheme_heads: int, q_heads: int, scheme_name: str) -> None:
    """Require a scheme built for ``scheme_heads`` heads to meet exactly ``q_heads`` query heads.

    A per-head table or slope vector of the wrong length must never be broadcast or read
    past its end: ``ALiBi(1)`` with 4 query heads would give every head the one slope, and
    ``T5RelativeBias(num_heads=2)`` with 4 would leave heads 2 and 3 without a table. Raises
    ``ValueError`` naming both counts. Every backend (reference, blockwise, Triton) calls it
    through :meth:`companion.attention.PositionScheme.check_heads`.
    """
    if scheme_heads != q_heads:
        raise ValueError(
            f"{scheme_name} was built for {scheme_heads} heads but the queries have {q_heads} "
            f"heads; a scheme's head count must equal the number of query heads"
        )


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """``True`` if a tensor of ``shape`` broadcasts to exactly ``target`` (torch's rules)."""
    try:
        return torch.broadcast_shapes(tuple(shape), tuple(target)) == torch.Size(target)
    except RuntimeError:
        return False


def normalize_mask(
    attn_mask: object,
    shape: tuple[int, int, int, int],
    *,
    name: str = "attn_mask",
    device: torch.device | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Validate an attention mask; return ``(allowed, additive)``, at most one not ``None``.

    The one mask convention of the package, for every attention path (reference,
    blockwise, model, kernels):

    * ``None``: no mask, returns ``(None, None)``;
    * ``bool``: ``True`` = attend, returned as ``allowed``;
    * integer (any int dtype, ``uint8`` included): the HuggingFace convention, ``1`` = attend,
      ``0`` = masked, converted to a bool ``allowed``. Any other value raises ``ValueError``
      (pass a bool mask, or a float additive mask);
    * floating: added to the logits (``0`` keeps, ``-inf`` removes), returned as ``additive``.
      A float mask of only ``0.0`` and ``1.0`` (at least one ``1.0``) raises ``ValueError``:
      added to the logits it masks nothing, so it is a keep-mask given the wrong dtype. An
      all-zero float mask is a valid additive mask.

    The mask must broadcast to ``shape = (batch, heads, q_len, k_len)`` under torch's rules
    (trailing dimensions align: a 2-D mask is ``(q_len, k_len)``, a 3-D one ``(heads, q_len,
    k_len)``), else ``ValueError``. A 2-D mask of shape ``(batch, k_len)`` (a HuggingFace
    padding mask) is never read as ``(q_len, k_len)``: where the readings differ (``batch >
    1``) it raises ``ValueError`` giving the 4-D form to pass, ``attn_mask[:, None, None, :]``,
    and, where ``batch = q_len`` makes the shape ambiguous, ``attn_mask[None, None]`` for a
    ``(q_len, k_len)`` mask. The returned tensor keeps the mask's own (broadcastable) shape; it
    is moved to ``device`` when given.
    """
    if attn_mask is None:
        return None, None
    check_tensor(attn_mask, name)
    assert isinstance(attn_mask, torch.Tensor)
    check_has_data(attn_mask, name)
    b, h, lq, lk = shape
    if attn_mask.dim() > 4:
        raise ValueError(
            f"{name} must have at most 4 dimensions (batch, heads, q_len, k_len), got shape "
            f"{tuple(attn_mask.shape)}"
        )
    _check_mask_reading(attn_mask, shape, name)
    if not broadcasts_to(attn_mask.shape, shape):
        hint = ""
        if attn_mask.dim() == 3 and tuple(attn_mask.shape) == (b, lq, lk):
            hint = (f"; a 3-D mask is read as (heads, q_len, k_len): pass {name}[:, None] for a "
                    f"(batch, q_len, k_len) mask")
        raise ValueError(
            f"{name} shape {tuple(attn_mask.shape)} must broadcast to "
            f"(batch, heads, q_len, k_len) = {tuple(shape)}{hint}"
        )
    if device is not None and attn_mask.device != device:
        attn_mask = attn_mask.to(device)
    if attn_mask.dtype == torch.bool:
        return attn_mask, None
    if attn_mask.dtype in INT_DTYPES:
        if attn_mask.numel() and not bool(((attn_mask == 0) | (attn_mask == 1)).all()):
            bad = attn_mask[(attn_mask != 0) & (attn_mask != 1)][0].item()
            raise ValueError(
                f"{name} is an integer mask, read as 1 = attend, 0 = masked (the HuggingFace "
                f"convention), but it holds the value {bad}; pass a bool mask (True = attend) "
                f"or a float additive mask (0 = keep, -inf = masked)"
            )
        return attn_mask == 1, None
    if attn_mask.is_floating_point():
        if bool((attn_mask == 1).any()) and bool(((attn_mask == 0) | (attn_mask == 1)).all()):
            raise ValueError(
                f"{name} is a float mask holding only 0.0 and 1.0, which looks like a keep-mask "
                f"(1 = attend), but a float mask is added to the logits, where 0.0 and 1.0 both "
                f"leave every key visible; pass a bool mask ({name}.bool(), True = attend) or an "
                f"additive float mask with -inf (or a large negative number) for the masked keys "
                f"and 0.0 for the others"
            )
        return None, attn_mask
    raise TypeError(f"{name} must be a bool, integer or floating tensor, got dtype {attn_mask.dtype}")


def _check_mask_reading(attn_mask: torch.Tensor, shape: tuple[int, int, int, int], name: str) -> None:
    """Refuse a 2-D mask of shape ``(batch, k_len)`` where reading it as torch does, as
    ``(q_len, k_len)``, would differ from reading it as a HuggingFace padding mask (``batch
    != 1``). Where ``batch = q_len`` the shape fits both and nothing can tell them apart: the
    message names both 4-D forms. A ``(1, k_len)`` mask means the same under both readings."""
    b, _, lq, lk = shape
    if attn_mask.dim() != 2 or tuple(attn_mask.shape) != (b, lk) or b == 1:
        return
    if lq == b:
        if b == 0:  # empty batch and no queries: both readings give the same empty output
            return
        raise ValueError(
            f"{name} has shape {(b, lk)}, which is both (batch, k_len), a HuggingFace padding "
            f"mask, and (q_len, k_len), how torch reads a 2-D mask; the two readings give "
            f"different results and batch = q_len = {b} cannot tell them apart, so pass a 4-D "
            f"mask: {name}[:, None, None, :] for a (batch, k_len) padding mask (True = attend), "
            f"or {name}[None, None] for a (q_len, k_len) mask"
        )
    raise ValueError(
        f"{name} has shape {(b, lk)} = (batch, k_len), which looks like a HuggingFace padding "
        f"mask (a tokenizer's attention_mask, 1 = token, 0 = padding), but a 2-D mask is read "
        f"as (q_len, k_len) = {(lq, lk)}; pass {name}[:, None, None, :] (shape (batch, 1, 1, "
        f"k_len), bool or 0/1 integer, True = attend)"
    )


# --- helpers added for rope and kernels ---


def check_device(device: object, name: str = "device") -> torch.device:
    """Require a ``torch.device``, a device string (``"cpu"``, ``"cuda"``, ``"cuda:0"``) or a
    tensor (meaning its device); return the ``torch.device``.

    ``"gpu"`` raises ``ValueError`` and an int or ``None`` ``TypeError``, with the allowed forms
    named (torch's own errors list every backend it was built for, or ask for a CUDA driver).
    """
    if isinstance(device, torch.Tensor):
        return device.device
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"{name} must be a device such as 'cpu', 'cuda' or 'cuda:0', got {device!r}") from exc
    raise TypeError(
        f"{name} must be a torch.device, a device string such as 'cpu' or 'cuda:0', or a tensor, "
        f"got {type(device).__name__}"
    )


def _element_span(x: torch.Tensor) -> tuple[int, int]:
    """``(first, last + 1)``: the storage offsets, in elements, that ``x`` can touch."""
    last = sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
    return x.storage_offset(), x.storage_offset() + last + 1


def has_internal_overlap(x: torch.Tensor) -> bool:
    """Whether two elements of ``x`` are one memory location (an ``expand``-ed view, say).

    Writing such a tensor in place writes some locations several times. Exact: a layout
    whose strides, sorted, each exceed the reach of the smaller ones cannot overlap (the
    common case, decided without touching memory); any other layout is checked by counting
    distinct offsets.
    """
    if x.numel() == 0:
        return False
    dims = sorted((st, size) for size, st in zip(x.shape, x.stride()) if size > 1)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            break
        reach += (size - 1) * stride
    else:
        return False
    first, end = _element_span(x)
    offsets = torch.arange(first, end).as_strided(x.shape, x.stride(), 0)
    return offsets.unique().numel() < x.numel()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether some element of ``a`` and some element of ``b`` are one memory location.

    Views of one buffer that never touch the same element (the ``q`` and ``k`` slices of a
    fused ``qkv`` projection) do not share memory. Different storages, or disjoint ranges,
    are decided at once; otherwise the elements of ``a`` are marked in a one-byte map of the
    shared range and ``b``'s are looked up (exact for one element size; views of different
    element sizes whose ranges meet count as sharing).
    """
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _element_span(a), _element_span(b)
    if a.element_size() != b.element_size():  # compare byte ranges
        sa, sb = a.element_size(), b.element_size()
        return not (a1 * sa <= b0 * sb or b1 * sb <= a0 * sa)
    if a1 <= b0 or b1 <= a0:
        return False
    first = min(a0, b0)
    marks = torch.zeros(max(a1, b1) - first, dtype=torch.bool, device=a.device)
    marks.as_strided(a.shape, a.stride(), a0 - first).fill_(True)
    return bool(marks.as_strided(b.shape, b.stride(), b0 - first).any())


def check_path(path: object, name: str = "path") -> Path:
    """Require a file-system path (a ``str`` or an ``os.PathLike``); return it as a ``Path``.
    ``None``, numbers and other objects raise ``TypeError`` naming ``name``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (a str or a pathlib.Path), got {type(path).__name__}")
    return Path(path)


# --- non-finite values: one rule for every attention backend ---


def nonfinite_flags(v: torch.Tensor) -> torch.Tensor | None:
    """The NaN rule every attention backend shares (a query sees only the non-finite values of
    the keys it may attend), part 1 of 3.

    Indicators ``[isnan | == +inf | == -inf]`` of ``v`` along its last axis, as ``v``'s
    dtype, ``(..., k_len, 3 * v_dim)``; ``None`` if every value is finite (the usual case)."""
    if bool(torch.isfinite(v).all()):
        return None
    return torch.cat([v.isnan(), v == float("inf"), v == float("-inf")], dim=-1).to(v.dtype)


def zero_nonfinite(v: torch.Tensor) -> torch.Tensor:
    """``v`` with every non-finite entry replaced by 0 (their effect is added back by
    :func:`restore_nonfinite`, only for the queries that see them)."""
    return torch.where(torch.isfinite(v), v, torch.zeros((), dtype=v.dtype, device=v.device))


def restore_nonfinite(out: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Put back the non-finite values a query sees: ``seen`` ``(..., q_len, 3 * v_dim)``
    counts, per output entry, the visible keys whose value is NaN, +inf, -inf."""
    dv = out.shape[-1]
    nan, pos, neg = seen[..., :dv] > 0, seen[..., dv:2 * dv] > 0, seen[..., 2 * dv:] > 0
    out = torch.where(pos, float("inf"), out)
    out = torch.where(neg, float("-inf"), out)
    return torch.where(nan | (pos & neg), float("nan"), out)


# --- grid positions (schemes with position_axes > 1) ---


def as_grid_positions(
    pos: object,
    name: str,
    length: int,
    axes: int,
    batch: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Validate grid positions and return them as ``int64``.

    Grid positions carry one integer per axis of the grid: shape ``(length, axes)`` (shared by
    the batch) or ``(batch, length, axes)`` (per row). Anything else, a 1-D sequence of
    positions included, raises ``ValueError`` naming ``name``; floating-point positions raise
    ``TypeError`` (see :func:`check_int_tensor`).
    """
    if pos is None:
        raise TypeError(f"{name} must be an integer tensor of grid positions, got None")
    pos = check_int_tensor(pos, name, what="grid positions")
    shapes = f"({length}, {axes})" + (f" or ({batch}, {length}, {axes})" if batch is not None else "")
    if pos.dim() == 2:
        ok = tuple(pos.shape) == (length, axes)
    elif pos.dim() == 3 and batch is not None:
        ok = tuple(pos.shape) == (batch, length, axes)
    else:
        ok = False
    if not ok:
        hint = ""
        if pos.dim() in (1, 2) and tuple(pos.shape[:1]) in ((length,), (batch,)) and pos.shape[-1] != axes:
            hint = (f"; this scheme takes {axes} coordinates per token (companion.grid_positions "
                    f"builds them for a grid)")
        raise ValueError(f"{name} must have shape {shapes}, got {tuple(pos.shape)}{hint}")
    if device is not None and pos.device != device:
        pos = pos.to(device)
    return pos


# --- bases, floating tensors, files: one rule each for every module ---


def check_base(base: object, name: str = "base") -> float:
    """Require the base of a geometric frequency ladder ``base ** (-2 i / d)`` (sinusoidal
    tables, RoPE and its grid and scaled forms, ``rope_theta``): a finite number ``> 1``.

    ``base = 1`` gives every pair the frequency 1 (all pairs turn alike, so the table carries
    no more than one pair's information), and ``base < 1`` turns the ladder upside down; both
    raise ``ValueError`` naming ``name``. Strings, bools and ``None`` raise ``TypeError``.
    """
    return check_finite_number(base, name, above=1)


def check_float_tensor(x: object, name: str, ndim: int | None = None) -> torch.Tensor:
    """Require a floating-point tensor (optionally of ``ndim`` dimensions) that holds data.

    An integer or bool tensor raises ``TypeError`` naming ``name``: adding a float table or
    rotating in its dtype would truncate the result (``sin`` and ``cos`` to 0 and 1)."""
    check_tensor(x, name, ndim)
    assert isinstance(x, torch.Tensor)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return check_has_data(x, name)


def check_file(path: object, name: str = "path", what: str = "a file") -> Path:
    """Require the path of an existing file; return it as a ``Path``.

    A folder raises ``IsADirectoryError`` and a missing path ``FileNotFoundError``; both
    messages name ``name``, the path, and ``what`` was expected (``"a .gguf file"``, say).
    Anything but a ``str`` or ``os.PathLike`` raises ``TypeError`` (``check_path``).
    """
    p = check_path(path, name)
    if p.is_dir():
        raise IsADirectoryError(f"{name} {p} is a directory (a folder), not a file; pass the path of {what}")
    if not p.is_file():
        if p.exists():
            raise FileNotFoundError(f"{name} {p} is not a regular file; pass the path of {what}")
        raise FileNotFoundError(f"{name} {p} does not exist; pass the path of {what}")
    return p
