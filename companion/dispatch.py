"""The attention dispatcher: the fastest correct path for each scheme.

Every attention path of the package is in one of three modules: the reference
:func:`companion.attention.attention` (all four hooks, the ``L x L`` logits materialised),
the block paths of :mod:`companion.blockwise` (a bias, one block of queries at a time) and
this module, which picks between them and torch's fused
``torch.nn.functional.scaled_dot_product_attention`` (SDPA) by the hooks a scheme overrides
(:meth:`~companion.attention.PositionScheme.hooks`). :func:`fast_attention` computes the
same function as the reference; :func:`attention_path` names the path it takes:

==================  =======================================================================
path                when
==================  =======================================================================
``"reference"``     ``return_weights=True``; a scheme with the ``score`` hook (Shaw,
                    Transformer-XL), or a grid scheme with a ``bias`` hook; a NaN or
                    infinite value in ``q``, ``k`` or ``v``; a floating ``attn_mask``
                    holding NaN or ``+inf``; an empty batch or sequence
``"sdpa-causal"``   no ``bias`` hook (NoPE, the ``embed`` schemes, RoPE after ``rotate``),
                    ``causal=True`` without ``window`` or ``chunk``, no ``attn_mask``, and
                    query and key positions that are consecutive and start at the same
                    position (self-attention): SDPA with ``is_causal=True``
``"sdpa-mask"``     no ``bias`` hook otherwise, with a ``window`` or a ``chunk`` only up to
                    :data:`SDPA_BIAS_PAIRS` pairs ``q_len * k_len``: SDPA with a mask built
                    from the positions (``k_pos <= q_pos`` when causal, the window and the
                    chunk) and ``attn_mask``, or none
``"sdpa-bias"``     a ``bias`` hook (ALiBi, T5) at short lengths: ``q_len * k_len <=``
                    :data:`SDPA_BIAS_PAIRS` (a bias without a gradient) or
                    :data:`SDPA_GRAD_BIAS_PAIRS` (with one, T5's table), and a ``(batch | 1,
                    heads, q_len, k_len)`` float mask (bias, ``attn_mask``, ``-inf`` where
                    masked) within :data:`SDPA_MASK_BYTES`: SDPA with that mask
``"blockwise"``     a ``bias`` hook otherwise, a ``window`` or a ``chunk`` past
                    :data:`SDPA_BIAS_PAIRS` pairs, or a mask over the budget:
                    ``companion.blockwise.fused_bias_attention``, one call of torch's fused
                    kernel per block of queries over the keys it may see (key blocks outside
                    the causal mask, the window or the chunk skipped), the bias and masks as
                    the kernel's float mask, with the block size ``fused_block_size``
                    measured for the shape (below)
``"query-blocks"``  before all of the above except ``"reference"`` for non-finite inputs:
                    a ``score`` hook, no gradient wanted (``torch.no_grad``, or no input or
                    scheme parameter that requires one), causal self-attention over
                    consecutive 1-D positions, no ``attn_mask``, ``q_len = k_len`` above
                    :data:`QUERY_BLOCK`: the queries in blocks of :data:`QUERY_BLOCK`, each
                    against only the keys the causal mask, the window and the chunk let it
                    see (see below)
==================  =======================================================================

**The block path** (``"blockwise"``) brings the design of
:func:`companion.trainfree.two_region_attention` to any bias: each block of queries makes
one call of torch's fused CPU attention kernel over the keys it may see, with the bias as a
float mask, so the work is the causal half and the arithmetic is the kernel's; a bias of the
offset ``k - q`` alone (ALiBi, T5, KERPLE) is one vector per head, and every block's mask a
strided view of it (``companion.blockwise.fused_bias_attention`` explains how). Its extra
memory is ``O(heads * L)`` for that vector, ``O(batch * heads * L * head_dim)`` for the
output and one block of queries at a time (reversed); the backward pass of a bias with
parameters (T5's table) holds tiles of at most ``2**21`` logits. Measured as a user calls it
(``benchmarks/attention_paths_cpu.py``, stored in ``chapters/data/attention_paths_cpu.json``:
batch 1, 8 heads, head dim 64, float32, causal, 2 threads, the median of 3 rounds), ALiBi
and T5 through :func:`fast_attention` at ``L = 8192`` and ``16384`` take 0.98 to 1.14 times
the time of SDPA ``is_causal`` without a bias forward, and 1.03 to 1.33 times forward plus
backward, with a peak extra memory of at most 0.082 of the materialised float32 bias;
KERPLE 0.99 to 1.14 and 1.33 to 1.37 times; FIRE, whose bias is not one vector per head,
5.16 to 7.84 times. The block size comes from a measurement
stored with the package (``companion/data/attention_tiles.json``, written by
``benchmarks/attention_tiles_cpu.py``) for three modes: ``forward`` (no gradient: evaluation,
generation), ``backward`` (forward plus backward, gradients of ``q, k, v`` only: ALiBi in
training) and ``bias-grad`` (also the bias's parameters: T5's table). For a call, the
measured head dim and ``batch * heads`` nearest to the call's (on a log scale) and then the
nearest measured length give the block; the same measurement sets the two thresholds of the
float mask: :data:`SDPA_BIAS_PAIRS` is the square of the longest measured length up to which
the ``"sdpa-bias"`` path beats the best block (geometric mean over the measured shapes of the
``forward`` and ``backward`` modes), :data:`SDPA_GRAD_BIAS_PAIRS` the same for ``bias-grad``.
The table below is generated from that file by ``companion.dispatch.tile_table`` (a test
checks that it is): per mode, head dim and ``batch x heads``, the chosen block and its time as
a multiple of SDPA with ``is_causal`` at the same shape, forward or forward plus backward, and
below it the time of SDPA with the ``(1, heads, L, L)`` float mask where it was measured:

.. begin tile table

Measurement: median of 2 rounds, 2 thread(s), wall-clock time, float32, causal, batch and heads as given.

=====================  ==========  =========  =========  =========  =========  ==========  ==========  ==========  ==========
mode, head dim, b x h  path        L = 128    256        512        1024       2048        4096        8192        16384
=====================  ==========  =========  =========  =========  =========  ==========  ==========  ==========  ==========
forward, 16, 1 x 8     block       128: 2.73  256: 1.76  256: 1.15  256: 1.21  256: 1.13   1024: 1.21  1024: 1.25  1024: 1.07
forward, 16, 1 x 8     float mask  2.30       5.26       5.86       7.56       9.80        -           -           -
forward, 16, 8 x 4     block       64: 1.04   256: 1.36  256: 0.95  256: 1.38  1024: 1.24  1024: 1.14  1024: 1.13  -
forward, 16, 8 x 4     float mask  0.78       1.42       1.33       2.71       3.25        3.67        -           -
forward, 64, 1 x 8     block       64: 2.88   128: 1.60  256: 1.19  256: 1.25  256: 1.26   1024: 1.20  1024: 1.16  1024: 1.07
forward, 64, 1 x 8     float mask  1.63       3.61       1.73       4.48       5.19        -           -           -
forward, 64, 8 x 4     block       64: 1.47   128: 1.14  128: 0.87  256: 1.10  256: 1.11   1024: 1.18  1024: 1.18  -
forward, 64, 8 x 4     float mask  1.13       1.12       1.13       1.66       2.24        2.52        -           -
forward, 128, 1 x 8    block       128: 1.55  64: 1.38   256: 0.99  128: 1.03  256: 1.10   512: 1.02   1024: 1.10  1024: 1.04
forward, 128, 1 x 8    float mask  1.24       1.44       1.61       2.98       3.46        -           -           -
forward, 128, 8 x 4    block       64: 1.31   64: 1.14   256: 0.92  256: 1.06  256: 1.05   512: 1.05   1024: 1.11  -
forward, 128, 8 x 4    float mask  1.09       1.11       1.15       1.51       1.93        2.14        -           -
backward, 16, 1 x 8    block       128: 1.96  256: 1.36  256: 1.05  256: 1.14  64: 1.18    1024: 1.27  1024: 1.12  1024: 1.12
backward, 16, 1 x 8    float mask  1.33       1.31       1.41       3.16       3.93        -           -           -
backward, 16, 8 x 4    block       128: 1.31  128: 1.29  128: 0.85  256: 1.04  256: 1.03   256: 1.03   1024: 1.10  -
backward, 16, 8 x 4    float mask  1.03       1.12       1.13       1.75       2.25        2.36        -           -
backward, 64, 1 x 8    block       128: 1.79  128: 1.30  128: 0.89  256: 1.03  256: 1.13   512: 1.15   1024: 1.14  1024: 0.99
backward, 64, 1 x 8    float mask  1.21       1.17       1.28       2.04       2.58        -           -           -
backward, 64, 8 x 4    block       64: 0.56   128: 1.08  128: 0.83  256: 1.02  256: 1.21   256: 1.10   1024: 1.23  -
backward, 64, 8 x 4    float mask  0.47       1.10       1.02       1.44       1.79        2.01        -           -
backward, 128, 1 x 8   block       128: 1.68  128: 1.15  128: 0.93  256: 1.14  256: 1.20   1024: 1.17  1024: 1.15  1024: 1.03
backward, 128, 1 x 8   float mask  1.15       1.08       1.19       1.69       2.14        -           -           -
backward, 128, 8 x 4   block       64: 1.20   64: 0.94   256: 0.92  256: 1.02  256: 1.14   1024: 1.20  1024: 1.12  -
backward, 128, 8 x 4   float mask  1.05       0.85       1.10       1.31       1.75        1.94        -           -
bias-grad, 16, 1 x 8   block       128: 2.52  256: 2.06  128: 1.04  256: 1.45  128: 1.46   64: 1.60    256: 1.78   128: 1.79
bias-grad, 16, 1 x 8   float mask  1.76       2.24       2.43       5.52       10.30       -           -           -
bias-grad, 16, 8 x 4   block       128: 1.59  128: 1.35  64: 0.88   64: 1.12   256: 1.39   128: 1.62   256: 1.46   -
bias-grad, 16, 8 x 4   float mask  1.25       1.59       3.04       4.69       8.11        11.77       -           -
bias-grad, 64, 1 x 8   block       128: 2.80  128: 1.81  128: 1.07  256: 1.17  256: 1.16   256: 1.29   512: 1.31   512: 1.38
bias-grad, 64, 1 x 8   float mask  1.77       2.19       1.84       4.14       4.99        -           -           -
bias-grad, 64, 8 x 4   block       128: 1.43  64: 1.09   64: 0.86   256: 1.11  256: 1.23   256: 1.40   256: 1.26   -
bias-grad, 64, 8 x 4   float mask  1.21       1.29       1.73       2.56       4.92        7.14        -           -
bias-grad, 128, 1 x 8  block       128: 1.77  128: 1.19  64: 0.86   128: 0.89  256: 1.10   256: 1.19   512: 1.26   256: 1.39
bias-grad, 128, 1 x 8  float mask  1.37       1.28       1.23       2.25       3.69        -           -           -
bias-grad, 128, 8 x 4  block       128: 1.33  64: 1.05   128: 0.74  256: 1.07  256: 1.18   256: 1.19   256: 1.26   -
bias-grad, 128, 8 x 4  float mask  1.07       1.12       1.18       2.02       3.60        4.87        -           -
=====================  ==========  =========  =========  =========  =========  ==========  ==========  ==========  ==========

.. end tile table

**Evaluation of ``score`` schemes at long lengths** (the lab's, chapter 8) wants no
gradient, and there a simpler path wins: the query positions in blocks of
:data:`QUERY_BLOCK`, each block against the keys up to its last position (the causal mask
hides the rest, so the work halves; a window or a chunk hides more), with one fused SDPA call
per block whose float mask is the block's score times the scale (Transformer-XL), or the
reference on the block for a scheme with a value term (Shaw).
``benchmarks/eval_attention_cpu.py`` measured it against the reference path taken before:
forward only, the lab's schemes, batch 8, 4 heads, head dim 16, one thread, ``L = 2048``, as
multiples of SDPA ``is_causal`` without a bias (0.18 s), one run of ``--lengths 2048
--repeats 3`` on a loaded 2-core machine (the bias schemes of that run now take the block
path):

==============  =====  =====  =====
scheme          Shaw   T-XL   CoPE
==============  =====  =====  =====
query-blocks    10.2   7.2    22.0
before          21.5   25.0   85.6
speedup         2.11   3.48   3.89
==============  =====  =====  =====

Precision follows the reference: float16 and bfloat16 inputs are computed in float32 and
the output cast back; float32 and float64 run in their own dtype. On the SDPA and block paths
a query that may attend no key gets a zero output and zero gradients, as in the reference
(torch's CPU kernels do this, and the tests check it; other devices are not checked). NaN and
infinite values take the reference, whose rule (a query sees only the non-finite values of
the keys it may attend) SDPA does not keep.

A layer stack that shares one scheme and one set of positions (the model's blocks) can pass
the same ``cache`` dict to every call, so the mask and bias are built once per forward pass
and shared (their gradients, T5's, add up over the layers). The dict must be fresh for every
new set of positions, masks or scheme state: :class:`companion.model.TinyDecoder` makes one
per forward pass. Layers with different ``window`` or ``chunk`` arguments (local and global
layers) may share it: the masks are kept apart by those arguments.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_bool, check_choice, check_positive_int, contiguous_start
from .attention import (
    PositionScheme,
    _as_scheme,
    _check_hook_shape,
    _Prologue,
    _prologue,
    _rotate_checked,
    _visibility,
    attention,
)
from .blockwise import _all_finite, _as4d, _bias_parameters, _fused, _grad_mode

__all__ = [
    "ATTENTION_PATHS",
    "SDPA_BIAS_PAIRS",
    "SDPA_GRAD_BIAS_PAIRS",
    "SDPA_MASK_BYTES",
    "QUERY_BLOCK",
    "TILES_FILE",
    "attention_path",
    "block_size_for",
    "fast_attention",
    "fused_block_size",
    "tile_table",
]

#: The paths :func:`attention_path` can name, from the most to the least specialised.
ATTENTION_PATHS: tuple[str, ...] = ("sdpa-causal", "sdpa-mask", "sdpa-bias", "blockwise", "query-blocks",
                                    "reference")

#: Queries per block on the ``"query-blocks"`` path (see the module docstring).
QUERY_BLOCK = 256

#: The largest mask (in bytes) the SDPA paths build; a larger one takes the blockwise path,
#: which never holds an ``L x L`` tensor. 256 MiB is a float32 mask of 4 heads at ``L = 4096``.
SDPA_MASK_BYTES = 1 << 28

#: The measured block sizes of the ``"blockwise"`` path (package data, see the module
#: docstring): written by ``benchmarks/attention_tiles_cpu.py`` with
#: :func:`companion.utils.save_result`.
TILES_FILE = Path(__file__).resolve().parent / "data" / "attention_tiles.json"

#: The modes of the measurement, what a call differentiates (see the module docstring).
MODES = ("forward", "backward", "bias-grad")


@functools.lru_cache(maxsize=None)
def _tiles() -> dict[str, Any]:
    """The stored measurement's ``data`` (read once)."""
    from .utils import load_result

    return load_result(TILES_FILE)["data"]


def _best(row: dict[str, Any]) -> tuple[int, float]:
    """The fastest measured block of a row and its time (a multiple of SDPA ``is_causal``);
    the smaller block on a tie."""
    block, ratio = min(((int(b), float(r)) for b, r in row["blocks"].items()), key=lambda t: (t[1], t[0]))
    return block, ratio


def _log_distance(a: float, b: float) -> float:
    return abs(math.log2(a) - math.log2(b))


def fused_block_size(batch_heads: int, length: int, head_dim: int, mode: str = "forward",
                     window: int | None = None, chunk: int | None = None) -> int:
    """The block of queries the ``"blockwise"`` path gives each fused-kernel call, measured.

    From the stored measurement (:data:`TILES_FILE`, see the module docstring): among the rows
    of ``mode``, those whose head dim and ``batch * heads`` are nearest to the call's (the sum
    of the distances of their base-2 logarithms), then the one whose length is nearest (on the
    same scale); its fastest block. The measurement is of full causal attention; with a
    ``window`` or a ``chunk`` of ``w`` keys a block of ``B`` queries sees up to ``w + B`` keys,
    so the block is at most the largest power of two ``<= w / 2`` (and at least 64): at ``L =
    8192``, ``w = 512``, blocks of 256 took half the time of blocks of 1024 (one thread).

    Args:
        batch_heads: ``batch * heads``, at least 1.
        length: the longer of ``q_len`` and ``k_len``, at least 1.
        head_dim: at least 1.
        mode: ``"forward"``, ``"backward"`` or ``"bias-grad"`` (what the call differentiates).
        window, chunk: the call's, ``None`` or an int ``>= 1``.

    Returns:
        The number of queries per call, a measured block size (or the cap above).

    Raises:
        TypeError, ValueError: a size that is not an int ``>= 1``; an unknown ``mode``.
    """
    batch_heads = check_positive_int(batch_heads, "batch_heads")
    length = check_positive_int(length, "length")
    head_dim = check_positive_int(head_dim, "head_dim")
    check_choice(mode, "mode", MODES)
    rows = [r for r in _tiles()["rows"] if r["mode"] == mode]

    def shape_distance(r: dict[str, Any]) -> float:
        return _log_distance(r["head_dim"], head_dim) + _log_distance(r["batch"] * r["heads"], batch_heads)

    near = min(shape_distance(r) for r in rows)
    rows = [r for r in rows if shape_distance(r) == near]
    row = min(rows, key=lambda r: (_log_distance(r["length"], length), r["length"]))
    block = _best(row)[0]
    local = [check_positive_int(w, name) for w, name in ((window, "window"), (chunk, "chunk")) if w is not None]
    if local:
        block = min(block, max(64, 1 << max(0, (min(local) // 2).bit_length() - 1)))
    return block


def _crossover(modes: tuple[str, ...]) -> int:
    """The longest measured length up to which SDPA's float mask beats the best block (the
    geometric mean of the ratios over the measured shapes of ``modes``), counting from the
    shortest: 0 if the block path wins there already."""
    by_length: dict[int, list[tuple[float, float]]] = {}
    for r in _tiles()["rows"]:
        if r["mode"] in modes and r.get("sdpa_bias") is not None:
            by_length.setdefault(r["length"], []).append((float(r["sdpa_bias"]), _best(r)[1]))
    best = 0
    for length in sorted(by_length):
        pairs = by_length[length]
        mask = sum(math.log(m) for m, _ in pairs) / len(pairs)
        block = sum(math.log(b) for _, b in pairs) / len(pairs)
        if mask > block:
            break
        best = length
    return best


#: The most ``q_len * k_len`` pairs for which a bias without a gradient (ALiBi) takes the
#: SDPA float mask rather than the block path; also the most pairs for which a ``window`` or
#: a ``chunk`` without a bias takes ``"sdpa-mask"``. The square of a measured length (see
#: the module docstring).
SDPA_BIAS_PAIRS = _crossover(("forward", "backward")) ** 2

#: The same limit for a bias with a gradient (T5's table), the square of a measured length.
SDPA_GRAD_BIAS_PAIRS = _crossover(("bias-grad",)) ** 2


def tile_table(data: dict[str, Any] | None = None) -> str:
    """The module docstring's table of the measured blocks, as reStructuredText.

    One row per mode, head dim and ``batch x heads`` of the measurement (``data``, default
    the stored :data:`TILES_FILE`'s), one column per length: ``block: ratio``, the fastest
    block and its time as a multiple of SDPA ``is_causal`` at the same shape, and under it
    (``float mask``) the ratio of SDPA with the materialised float mask where it was measured.
    The header line names the run: ``quick`` for a provisional smoke run, else the number of
    rounds whose median each ratio is.

    Args:
        data: a measurement's ``data`` dict (rows as ``benchmarks/attention_tiles_cpu.py``
            writes them), or ``None``.

    Returns:
        The table, lines joined by newlines, without a trailing newline.

    Raises:
        ValueError: ``data`` is not a dict with a ``rows`` list.
    """
    data = _tiles() if data is None else data
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError("data must be a measurement's data dict, with its 'rows' list (as "
                         "benchmarks/attention_tiles_cpu.py writes them), or None")
    rows = data["rows"]
    lengths = sorted({r["length"] for r in rows})
    keys = sorted({(MODES.index(r["mode"]), r["head_dim"], r["batch"], r["heads"]) for r in rows})
    cells = {(MODES.index(r["mode"]), r["head_dim"], r["batch"], r["heads"], r["length"]): r for r in rows}
    body = []
    for key in keys:
        mode, d, b, h = key
        found = [cells.get((*key, n)) for n in lengths]
        label = f"{MODES[mode]}, {d}, {b} x {h}"  # repeated: a blank first cell continues a row
        body.append([label, "block"] + ["-" if r is None else "{}: {:.2f}".format(*_best(r)) for r in found])
        if any(r is not None and r.get("sdpa_bias") is not None for r in found):
            body.append([label, "float mask"] + ["-" if r is None or r.get("sdpa_bias") is None
                                                 else f"{float(r['sdpa_bias']):.2f}" for r in found])
    head = ["mode, head dim, b x h", "path"] + [f"L = {n}" if i == 0 else str(n) for i, n in enumerate(lengths)]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    rule = "  ".join("=" * w for w in widths)
    fmt = lambda line: "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()  # noqa: E731
    kind = "quick (provisional)" if data.get("quick") else f"median of {data.get('rounds', '?')} rounds"
    clock = {"cpu": ", CPU time", "wall": ", wall-clock time"}.get(data.get("clock", ""), "")
    return "\n".join([f"Measurement: {kind}, {data.get('threads', '?')} thread(s){clock}, {data.get('dtype', 'float32')}, "
                      f"causal, batch and heads as given.", "", rule, fmt(head), rule, *map(fmt, body), rule])


def block_size_for(batch_heads: int, length: int) -> int:
    """The tile size of the explicit tile loop (:func:`~companion.blockwise.bias_attention`),
    where the fused kernel does not apply (not a CPU tensor, ``v_dim != head_dim``).

    The largest power of two ``s`` in ``[64, 512]`` whose ``batch_heads * s * s`` logits
    tile holds at most ``2**17`` entries (``length <= 512``) or ``2**19`` (longer): at ``L =
    512`` with batch 8 and 4 heads, tiles of 64 (forward plus backward 1.5 times SDPA's
    causal time) against 128 (1.8 times) and 512 (4.7 times); at ``L = 2048``, 128 (1.6
    times) against 64 (2.0) and 256 (2.1), measured by an earlier version of
    ``benchmarks/attention_paths_cpu.py`` (one thread, head dim 16). Larger tiles cost more in
    allocations and cache misses than they save in fewer, larger matrix products.

    Args:
        batch_heads: ``batch * heads``, at least 1.
        length: the longer of ``q_len`` and ``k_len``.

    Returns:
        The tile size, a power of two from 64 to 512.

    Raises:
        TypeError, ValueError: an argument that is not an int ``>= 1``.
    """
    batch_heads = check_positive_int(batch_heads, "batch_heads")
    length = check_positive_int(length, "length")
    budget = (1 << 17) if length <= 512 else (1 << 19)
    size = 512
    while size > 64 and batch_heads * size * size > budget:
        size //= 2
    return size


def _bias_needs_grad(scheme: PositionScheme) -> bool:
    """Whether the scheme's bias will carry a gradient (trainable parameters, grad mode on)."""
    return torch.is_grad_enabled() and any(p.requires_grad for p in scheme.parameters())


def _local(pro: _Prologue) -> bool:
    """Whether a ``window`` or a ``chunk`` limits the keys."""
    return pro.window is not None or pro.chunk is not None


def _choose(pro: _Prologue, scheme: PositionScheme, q: Tensor, k: Tensor, v: Tensor,
            return_weights: bool) -> str:
    """The path for validated arguments (see the module docstring for the rules)."""
    hooks = scheme.hooks()
    if return_weights or 0 in (pro.batch, pro.q_len, pro.k_len):
        return "reference"
    if not _all_finite(q, k, v):
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
        return "reference"  # the block path takes a bias over 1-D positions only
    per_row = pro.q_order.dim() == 2 or pro.k_order.dim() == 2
    pairs = pro.q_len * pro.k_len
    if "bias" in hooks:
        if _mask_bytes(pro, per_row, with_bias=True) > SDPA_MASK_BYTES:
            return "blockwise"
        limit = SDPA_GRAD_BIAS_PAIRS if _bias_needs_grad(scheme) else SDPA_BIAS_PAIRS
        return "sdpa-bias" if pairs <= limit else "blockwise"
    if pro.causal and not _local(pro) and pro.allowed is None and add is None and not per_row:
        start = contiguous_start(pro.q_order)
        if start is not None and start == contiguous_start(pro.k_order):
            return "sdpa-causal"
    if _local(pro) and pairs > SDPA_BIAS_PAIRS:
        return "blockwise"  # skips the key blocks outside the window or the chunk
    if _mask_bytes(pro, per_row, with_bias=False) > SDPA_MASK_BYTES:
        return "blockwise"
    return "sdpa-mask"


def _query_blocks_apply(pro: _Prologue, scheme: PositionScheme, hooks: tuple[str, ...],
                        q: Tensor, k: Tensor, v: Tensor) -> bool:
    """The ``"query-blocks"`` rule of the module docstring."""
    if "score" not in hooks or not pro.causal or pro.allowed is not None or pro.additive is not None:
        return False
    if scheme.position_axes > 1 or pro.q_len != pro.k_len or pro.q_len <= QUERY_BLOCK:
        return False
    assert pro.q_order is not None and pro.k_order is not None
    if pro.q_order.dim() != 1 or pro.k_order.dim() != 1:
        return False
    start = contiguous_start(pro.q_order)
    if start is None or start != contiguous_start(pro.k_order):
        return False
    return _grad_mode(q, k, v, [p for p in scheme.parameters()]) == "forward"


def _first_key(pro: _Prologue, a: int) -> int:
    """The first key index the queries from index ``a`` on may see (causal self-attention
    over consecutive positions from one start): ``0``, or later with a window or a chunk."""
    assert pro.q_pos is not None
    lo = 0
    if pro.window is not None:
        lo = max(lo, a - pro.window + 1)
    if pro.chunk is not None:
        first = int(pro.q_pos[a])
        lo = max(lo, a - (first - first // pro.chunk * pro.chunk))
    return lo


def _query_blocks(q: Tensor, k: Tensor, v: Tensor, scheme: PositionScheme, pro: _Prologue) -> Tensor:
    """The ``"query-blocks"`` path: causal self-attention, queries in blocks of :data:`QUERY_BLOCK`.

    Block ``[a, e)`` attends to keys ``[lo, e)``, which hold every key its queries may see
    (``lo = 0``, or later with a window or a chunk, :func:`_first_key`). A scheme with a value
    term (``score_values``, Shaw) runs the reference on each block; any other gets one SDPA
    call per block with the float mask ``scale * score`` (``-inf`` where hidden), which is
    what the reference adds to ``scale * q k^T``. Rotation is per position, so rotating a
    block with its own positions rotates it as the whole sequence would.
    """
    assert pro.q_pos is not None and pro.k_pos is not None
    assert pro.q_order is not None and pro.k_order is not None
    with_values = type(scheme).score_values is not PositionScheme.score_values
    local = dict(window=pro.window, chunk=pro.chunk)
    if not with_values and "rotate" in scheme.hooks():
        q, k = _rotate_checked(scheme, q, k, pro.q_pos, pro.k_pos)
    qw, kw, vw = pro.operands(q, k, v)
    b, h, n = pro.batch, pro.heads, pro.q_len
    outs = []
    for a in range(0, n, QUERY_BLOCK):
        e = min(n, a + QUERY_BLOCK)
        lo = _first_key(pro, a)
        qp, kp = pro.q_pos[a:e], pro.k_pos[lo:e]
        if with_values:
            # the reference rotates (if the scheme does) with the block's own positions
            outs.append(attention(q[:, :, a:e], k[:, :, lo:e], v[:, :, lo:e], scheme, qp, kp, causal=True,
                                  scale=pro.scale, **local).to(pro.work))
            continue
        extra = scheme.score(qw[:, :, a:e], kw[:, :, lo:e], qp, kp)
        _check_hook_shape(extra, (b, h, e - a, e - lo), scheme, "score", "(batch, heads, q_len, k_len)")
        vis = _visibility(pro.q_order[a:e], pro.k_order[lo:e], True, **local)
        assert vis is not None
        tile = _as4d(extra.to(pro.work) * pro.scale).masked_fill(~vis, float("-inf"))
        outs.append(F.scaled_dot_product_attention(qw[:, :, a:e], kw[:, :, lo:e], vw[:, :, lo:e], attn_mask=tile,
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
    """Bool ``True`` = attend, 4-D, from the causal mask (with the window and the chunk) and
    a bool ``attn_mask``; or None."""
    vis = pro.visible()
    if vis is not None:
        vis = _as4d(vis if vis.dim() == 2 else vis.unsqueeze(1))
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
    window: int | None = None,
    chunk: int | None = None,
) -> str:
    """The path :func:`fast_attention` takes for these arguments, one of :data:`ATTENTION_PATHS`.

    Validates the arguments exactly as :func:`fast_attention` does, then applies the rules
    of the module docstring; computes no attention.

    Args:
        q: and every other argument (``k``, ``v``, ``scheme``, ``q_pos``, ``k_pos``,
            ``causal``, ``attn_mask``, ``scale``, ``return_weights``, ``window``, ``chunk``):
            as in :func:`fast_attention`.

    Returns:
        ``"sdpa-causal"``, ``"sdpa-mask"``, ``"sdpa-bias"``, ``"blockwise"``,
        ``"query-blocks"`` or ``"reference"``.

    Raises:
        TypeError, ValueError: as :func:`companion.attention.attention` documents.
    """
    scheme = _as_scheme(scheme)
    pro = _prologue(q, k, v, scheme, q_pos, k_pos, causal=causal, scale=scale, attn_mask=attn_mask,
                    window=window, chunk=chunk)
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
    window: int | None = None,
    chunk: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with any scheme, by the fastest correct path: the reference's result.

    Computes what :func:`companion.attention.attention` computes, ``softmax(scale * (q k^T +
    score) + bias) v + score_values`` after ``rotate`` (Vaswani et al.,
    :cite:`vaswani2017attention`), with the same arguments, defaults, errors and
    masked-row rule, but through torch's fused ``scaled_dot_product_attention`` (the
    FlashAttention algorithm on CPU, :cite:`dao2022flashattention`), called once or once per
    block of queries, whenever the scheme allows: see the module docstring, and
    :func:`attention_path` for the choice. Results agree with the reference to rounding (the
    summation order differs), forward and backward, gradients of scheme parameters (T5's
    table) included.

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
        window: sliding-window attention, as in :func:`~companion.attention.attention`
            (HuggingFace's ``sliding_window``): with ``causal=True``, query ``i`` sees the keys
            ``j`` with ``i - window < j <= i``. An int ``>= 1`` or ``None``.
        chunk: chunked attention, as in :func:`~companion.attention.attention` (HuggingFace's
            ``attention_chunk_size``): with ``causal=True``, query ``i`` sees the keys ``j <=
            i`` with ``j // chunk == i // chunk``. An int ``>= 1`` or ``None``.

    Returns:
        The output ``(batch, heads, q_len, v_dim)`` in ``q``'s dtype (and the weights if
        asked). Half-precision inputs are computed in float32.

    Raises:
        TypeError: a wrong type (float positions, ``causal="False"``, a scheme that is not a
            :class:`~companion.attention.PositionScheme`, a ``window`` that is not an int).
        ValueError: bad shapes, values or masks; a scheme built for another number of heads;
            ``window`` or ``chunk`` below 1 or without ``causal=True``.
    """
    scheme = _as_scheme(scheme)
    pro = _prologue(q, k, v, scheme, q_pos, k_pos, causal=causal, scale=scale, attn_mask=attn_mask,
                    window=window, chunk=chunk)
    return_weights = check_bool(return_weights, "return_weights")
    path = _choose(pro, scheme, q, k, v, return_weights)
    if path == "reference":
        return attention(q, k, v, scheme, pro.q_pos, pro.k_pos, causal=pro.causal, attn_mask=attn_mask,
                         scale=pro.scale, return_weights=return_weights, window=pro.window, chunk=pro.chunk)
    if path == "query-blocks":
        return _query_blocks(q, k, v, scheme, pro)
    assert pro.q_pos is not None and pro.k_pos is not None
    if "rotate" in scheme.hooks():
        q, k = _rotate_checked(scheme, q, k, pro.q_pos, pro.k_pos)
    if path == "blockwise":
        has_bias = "bias" in scheme.hooks()
        params = _bias_parameters(scheme) if has_bias else []
        mode = _grad_mode(q, k, v, params)
        block = fused_block_size(pro.batch * pro.heads, max(pro.q_len, pro.k_len), pro.head_dim, mode,
                                 pro.window, pro.chunk)
        # a grid scheme has no bias here (see _choose): the blocks need only the causal order
        blocks = pro._replace(q_pos=pro.q_order, k_pos=pro.k_order)
        return _fused(q, k, v, blocks, scheme.bias if has_bias else None, params, block, None, finite=True)
    qw, kw, vw = pro.operands(q, k, v)
    if path == "sdpa-causal":
        out = F.scaled_dot_product_attention(qw, kw, vw, is_causal=True, scale=pro.scale)
        return out.to(q.dtype)
    key = (path, pro.work, q.device, pro.window, pro.chunk)
    if cache is not None and key in cache:
        mask = cache[key]
    else:
        mask = _sdpa_mask(path, pro, scheme)
        if cache is not None:
            cache[key] = mask
    out = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=mask, scale=pro.scale)
    return out.to(q.dtype)
