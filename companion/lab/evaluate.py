"""The lab's evaluations: bits per byte against length, passkey retrieval, attention entropy.

Every evaluation runs the trained model at lengths it never saw (the training length ``L``
up to ``16 L``) on the validation split, with positions ``0 .. W - 1``. Two rules make the
lengths comparable and the numbers strong enough to carry a claim:

* **The same bytes at every length.** A metric that compares lengths must score the same
  text at each of them, or the difficulty of the text enters the curve.
* **Units for intervals.** Every bits-per-byte metric is reported with its means over
  ``blocks`` units of neighbouring windows, so that :mod:`companion.lab.stats` can put a
  bootstrap interval on it (and on the difference of two schemes or two lengths scored on
  the same units) from the stored results alone.

The evaluations:

* :func:`bits_per_byte`: ``windows`` windows, one per end offset, spread evenly over the data
  and **shared by every length**: the window of length ``W`` that ends at byte ``e`` is
  ``data[e - W : e + 1]``. ``"all"`` is the mean loss over every position of a window
  (positions ``0 .. W-1``, so short contexts dilute it, and it is *not* the same bytes at
  every length); ``"tail"`` the mean over its last 64 positions, which are the bytes
  ``e - 63 .. e`` at every length, each predicted from at least ``W - 64`` bytes of
  context: the sharpest test of long positions.
* :func:`sliding_bits_per_byte` slides a window of ``W`` bytes by a stride ``S`` and scores
  only the last ``S`` positions of each window, so every scored byte has ``W - S`` to
  ``W - 1`` bytes of context: the usual perplexity protocol for a fixed context size. Its
  scored bytes are ``blocks`` stretches, the same at every length.
* :func:`passkey_retrieval` writes a key at a given depth of a window and a query at its end,
  and measures the bits per digit of the query against a control whose key has other digits,
  trial by trial.
* :func:`attention_entropy` measures how spread out each layer's attention is.

All losses are in bits (natural-log loss divided by ``ln 2``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check_finite_number, check_positive_int
from ..model import TinyDecoder
from .data import KEY_DIGITS, KEY_LEN, QUERY_LEN, random_digits, windows, write_key

__all__ = ["bits_per_byte", "sliding_bits_per_byte", "passkey_retrieval", "attention_entropy",
           "evenly_spaced_starts", "shared_ends", "window_bits", "TAIL", "WINDOWS", "BLOCKS", "SLIDING_TOKENS"]

#: Positions at the end of each window that the ``"tail"`` figure averages.
TAIL = 64
#: Windows per length of :func:`bits_per_byte` by default: ``2048 * TAIL = 2**17`` tail bytes.
WINDOWS = 2048
#: Units per metric for the bootstrap (blocks of neighbouring windows or stretches).
BLOCKS = 256
#: Bytes :func:`sliding_bits_per_byte` scores per length by default.
SLIDING_TOKENS = 1 << 17
LN2 = math.log(2.0)


def evenly_spaced_starts(n_bytes: int, length: int, count: int) -> Tensor:
    """``count`` window starts spread evenly over ``[0, n_bytes - length]``, int64."""
    span = n_bytes - length
    if span < 0 or count < 1:
        raise ValueError(f"cannot place {count} windows of {length} bytes in {n_bytes} bytes")
    return torch.from_numpy(np.linspace(0, span, count).astype(np.int64))


def shared_ends(n_bytes: int, longest: int, count: int) -> Tensor:
    """``count`` distinct last-byte offsets spread evenly over ``[longest, n_bytes - 1]``, int64.

    A window of ``W + 1 <= longest + 1`` bytes ending at each of them fits in the data, so
    windows of every length up to ``longest`` can end at the same bytes.

    Raises:
        ValueError: fewer than ``count`` bytes after the first ``longest``, or ``count < 1``.
    """
    check_positive_int(count, "count")
    free = n_bytes - 1 - longest
    if free + 1 < count:
        raise ValueError(
            f"the data ({n_bytes} bytes) is too short for {count} windows ending at distinct bytes "
            f"after a context of {longest}: at most {max(free + 1, 0)}"
        )
    return longest + torch.from_numpy(np.linspace(0, free, count).round().astype(np.int64))


def _block_means(bits: Tensor, blocks: int) -> list[float]:
    """Means of ``blocks`` equal runs of consecutive rows of ``bits`` (rows, positions)."""
    return [float(x) for x in bits.reshape(blocks, -1).mean(1)]


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (Sequence, np.ndarray)):
        raise TypeError(f"lengths must be a list of ints >= 1 (window lengths), got {type(lengths).__name__} "
                        f"{lengths!r}")
    out = [check_positive_int(int(w) if isinstance(w, (int, np.integer)) else w, "lengths") for w in lengths]
    if not out:
        raise ValueError("lengths must hold at least one length")
    return out


def _check_model(model: object) -> torch.nn.Module:
    """Require a model to evaluate: a ``torch.nn.Module`` mapping ``(batch, seq)`` byte ids to logits."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a companion.model.TinyDecoder), got "
                        f"{type(model).__name__}")
    return model


def _check_data(data: object) -> np.ndarray:
    """Require the bytes to evaluate on: a 1-D numpy array of integers in ``[0, 256)``
    (``Corpus.val`` is ``uint8``)."""
    if not isinstance(data, np.ndarray):
        raise TypeError(f"data must be a 1-D numpy array of bytes (such as Corpus.val, dtype uint8), got "
                        f"{type(data).__name__}")
    if not np.issubdtype(data.dtype, np.integer):
        raise TypeError(f"data must hold integer byte values (dtype uint8), got dtype {data.dtype}")
    if data.ndim != 1:
        raise ValueError(f"data must be 1-D (a stream of bytes), got shape {data.shape}")
    if data.dtype != np.uint8 and data.size and (int(data.min()) < 0 or int(data.max()) > 255):
        raise ValueError(f"data must hold byte values in [0, 256), got values from {int(data.min())} "
                         f"to {int(data.max())}")
    return data


def _check_depths(depths: object, name: str = "depths") -> list[float]:
    """Require a non-empty list of numbers in ``[0, 1]`` (where a passkey sits in its window)."""
    if isinstance(depths, (str, bytes)) or not isinstance(depths, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a non-empty list of numbers in [0, 1], got {type(depths).__name__} "
                        f"{depths!r}")
    if not len(depths):
        raise ValueError(f"{name} must be a non-empty list of numbers in [0, 1], got {depths!r}")
    for depth in depths:
        if check_finite_number(depth, name, minimum=0) > 1:
            raise ValueError(f"{name} must lie in [0, 1] (0: the key at the start, 1: just before "
                             f"the query), got {depth!r}")
    return list(depths)


def _check_blocks(blocks: int, count: int, count_name: str) -> int:
    check_positive_int(blocks, "blocks")
    if count % blocks:
        raise ValueError(f"blocks ({blocks}) must divide {count_name} ({count})")
    return blocks


@torch.no_grad()
def _token_bits(model: TinyDecoder, rows: Tensor, batch_size: int) -> Tensor:
    """Per-position loss in bits of predicting ``rows[:, 1:]`` from ``rows[:, :-1]``."""
    out = []
    for chunk in rows.split(batch_size):
        logits = model(chunk[:, :-1]).float()
        nats = F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none")
        out.append(nats / LN2)
    return torch.cat(out)


def _rows_per_batch(length: int, tokens_per_batch: int) -> int:
    return max(1, tokens_per_batch // length)


def window_bits(
    bits_fn: Callable[[Tensor, int], Tensor],
    data: np.ndarray,
    lengths: Sequence[int],
    *,
    windows_per_length: int = WINDOWS,
    blocks: int = BLOCKS,
    reach: int | None = None,
) -> dict[int, dict[str, float | list[float]]]:
    """The windows of :func:`bits_per_byte`, scored by any model: see its docstring.

    ``bits_fn(rows, w)`` takes ``(count, w + 1)`` rows of bytes and returns the ``(count,
    w)`` losses in bits of predicting ``rows[:, 1:]`` (a training-free method of
    :mod:`companion.trainfree` plugs in here, so its numbers compare with the model's own).
    """
    data = _check_data(data)
    lengths = _check_lengths(lengths)
    check_positive_int(windows_per_length, "windows_per_length")
    _check_blocks(blocks, windows_per_length, "windows_per_length")
    reach = max(lengths) if reach is None else check_positive_int(reach, "reach")
    if reach < max(lengths):
        raise ValueError(f"reach ({reach}) must be at least the longest length ({max(lengths)})")
    ends = shared_ends(data.size, reach, windows_per_length)
    result: dict[int, dict[str, float | list[float]]] = {}
    for w in lengths:
        rows = windows(data, ends - w, w + 1)
        bits = bits_fn(rows, w)
        tail = bits[:, -min(TAIL, w):]
        result[w] = {"all": float(bits.mean()), "tail": float(tail.mean()),
                     "all_blocks": _block_means(bits, blocks), "tail_blocks": _block_means(tail, blocks)}
    return result


def bits_per_byte(
    model: TinyDecoder,
    data: np.ndarray,
    lengths: Sequence[int],
    *,
    windows_per_length: int = WINDOWS,
    blocks: int = BLOCKS,
    reach: int | None = None,
    tokens_per_batch: int = 1 << 14,
) -> dict[int, dict[str, float | list[float]]]:
    """Non-overlapping evaluation at every length on windows that end at the same bytes.

    ``windows_per_length`` end offsets ``e`` are spread evenly over ``data`` after its first
    ``reach`` bytes (default ``max(lengths)``; calls with the same ``reach`` score the same
    bytes, whatever lengths each asks for; :func:`shared_ends`); at length ``W`` the window
    ending at ``e`` is ``data[e - W : e + 1]``, whose ``W`` predictions are scored. Returns,
    for each ``W``:

    * ``"all"``: mean bits over every position of every window;
    * ``"tail"``: mean bits over the last ``min(TAIL, W)`` positions, the bytes ``e - 63 ..
      e``: the same bytes at every length ``W >= TAIL``, each with at least ``W - TAIL``
      bytes of context;
    * ``"all_blocks"``, ``"tail_blocks"``: the same means over each of ``blocks`` runs of
      consecutive windows (the units of :func:`companion.lab.stats.bootstrap_ci`; their mean
      is the overall mean).

    Raises:
        TypeError: ``model`` not a ``torch.nn.Module``, ``data`` not a 1-D numpy array of
            integers, ``lengths`` not a list of ints, or a count that is not an int.
        ValueError: no lengths, a length below 1, ``windows_per_length`` or
            ``tokens_per_batch`` below 1, ``blocks`` not dividing ``windows_per_length``, a
            ``reach`` below the longest length, data values outside ``[0, 256)``, or data
            too short for that many distinct ends.
    """
    _check_model(model)
    check_positive_int(tokens_per_batch, "tokens_per_batch")
    model.eval()

    def bits_fn(rows: Tensor, w: int) -> Tensor:
        return _token_bits(model, rows, _rows_per_batch(w, tokens_per_batch))

    return window_bits(bits_fn, data, lengths, windows_per_length=windows_per_length, blocks=blocks, reach=reach)


def sliding_bits_per_byte(
    model: TinyDecoder,
    data: np.ndarray,
    lengths: Sequence[int],
    *,
    stride_fraction: float = 0.25,
    scored_tokens: int = SLIDING_TOKENS,
    blocks: int = BLOCKS,
    reach: int | None = None,
    tokens_per_batch: int = 1 << 14,
) -> dict[int, dict[str, float | list[float]]]:
    """Sliding-window evaluation, the same bytes scored at every length.

    The scored bytes are ``blocks`` stretches of ``scored_tokens // blocks`` bytes each,
    spread evenly over ``data`` after its first ``reach`` bytes (default ``max(lengths)``;
    calls with the same ``reach`` and stride fraction score the same bytes), and they are the same
    for every ``W`` whose stride divides the stretch (all powers of two up to it, as in the
    book), so the lengths are compared on identical text. Each stretch is covered by windows
    of ``W + 1`` bytes that end ``S = W * stride_fraction`` bytes apart; each window scores
    only its last ``S`` predictions, so every scored byte is predicted from between
    ``W - S + 1`` and ``W`` bytes of context. Where a stride does not divide the stretch,
    the first ``(stretch // S) * S`` bytes of each stretch are scored (at least one window).

    Returns ``{W: {"sliding": mean bits, "sliding_blocks": [mean bits of each stretch]}}``.

    Raises:
        TypeError: ``model`` not a ``torch.nn.Module``, ``data`` not a 1-D numpy array of
            integers, ``lengths`` not a list of ints, ``stride_fraction`` not a number, or a
            count that is not an int.
        ValueError: no lengths, a length below 1, ``stride_fraction`` outside ``(0, 1]``,
            ``scored_tokens``, ``blocks`` or ``tokens_per_batch`` below 1, ``scored_tokens``
            below ``blocks`` (each stretch scores at least one byte), a ``reach`` below the
            longest length, or data too short for the stretches.
    """
    _check_model(model)
    data = _check_data(data)
    lengths = _check_lengths(lengths)
    if check_finite_number(stride_fraction, "stride_fraction") > 1:
        raise ValueError(f"stride_fraction must lie in (0, 1], got {stride_fraction}")
    check_positive_int(scored_tokens, "scored_tokens")
    check_positive_int(blocks, "blocks")
    check_positive_int(tokens_per_batch, "tokens_per_batch")
    if scored_tokens < blocks:
        raise ValueError(f"scored_tokens ({scored_tokens}) must be at least blocks ({blocks}): each of the "
                         f"blocks stretches scores scored_tokens // blocks bytes")
    model.eval()
    span = scored_tokens // blocks
    longest = max(lengths) if reach is None else check_positive_int(reach, "reach")
    if longest < max(lengths):
        raise ValueError(f"reach ({longest}) must be at least the longest length ({max(lengths)})")
    # the scored bytes of a stretch end at most this far after its start (the longest stride
    # the reach allows, so that the stretches do not depend on which lengths are asked for)
    after = max(span, max(1, int(longest * stride_fraction)))
    free = data.size - longest - after - 1
    if span < 1 or free < 0:
        raise ValueError(
            f"data ({data.size} bytes) too short for {blocks} scored stretches of {span} bytes "
            f"after a context of {longest}"
        )
    region_starts = longest + torch.from_numpy(np.linspace(0, free, blocks).astype(np.int64))
    result: dict[int, dict[str, float | list[float]]] = {}
    for w in lengths:
        stride = max(1, int(w * stride_fraction))
        # a window scores the predictions of bytes (end - stride, end]; its first byte is end - w
        ends = (region_starts[:, None] + stride * torch.arange(1, max(1, span // stride) + 1)).flatten()
        rows = windows(data, ends - w, w + 1)
        bits = _token_bits(model, rows, _rows_per_batch(w, tokens_per_batch))[:, -stride:]
        result[w] = {"sliding": float(bits.mean()), "sliding_blocks": _block_means(bits, blocks)}
    return result


@torch.no_grad()
def passkey_retrieval(
    model: TinyDecoder,
    data: np.ndarray,
    lengths: Sequence[int],
    depths: Sequence[float],
    *,
    trials: int = 32,
    seed: int = 0,
    tokens_per_batch: int = 1 << 14,
    forward: Callable[[Tensor], Tensor] | None = None,
) -> dict[str, list]:
    """Retrieval heatmaps over ``lengths`` x ``depths``.

    For each cell, ``trials`` validation windows of ``W`` bytes get a key at position
    ``round(depth * (W - KEY_LEN - QUERY_LEN))`` and a query in their last ``QUERY_LEN``
    bytes. The *control* windows are the same windows with another key (fresh random digits)
    and the same query, so the text, the positions and the query are identical and only the
    key's agreement with the query differs.

    Returns a dict of ``len(lengths) x len(depths)`` lists:

    * ``"bits"``: mean bits per query digit when the key matches;
    * ``"control_bits"``: the same with the mismatched key;
    * ``"gain"``: ``control_bits - bits``, the bits per digit that reading the key saves
      (0 for a model that ignores it). It has no upper bound: a model that gives the key's
      digit probability ``p`` and each other digit ``(1 - p) / 9`` gains
      ``log2(9 p / (1 - p))`` on each control digit that differs from the key (about 9 in
      10 of them), 2.85 bits per digit at ``p = 1/2`` and more the surer it is, since the
      control's wrong key costs it ``-log2((1 - p) / 9)``;
    * ``"exact"``: fraction of trials whose five digits are all the argmax prediction;
    * ``"gain_trials"`` and ``"exact_trials"``: ``len(lengths) x len(depths) x trials``, the
      gain of each trial (its control's bits per digit minus its own) and whether it was
      exact (0 or 1), so that intervals can be computed from stored results
      (:func:`companion.lab.stats.proportion_ci` for the exact-match rate).

    ``forward`` replaces the model's own forward pass: a function from token rows
    ``(rows, W - 1)`` to logits ``(rows, W - 1, vocab)``, for a training-free method that
    runs the same model another way (:mod:`companion.lab.trainfree_lab`); default ``model``.

    Raises:
        TypeError: ``model`` not a ``torch.nn.Module``, ``data`` not a 1-D numpy array of
            integers, ``lengths`` not a list of ints, ``depths`` not a list of numbers,
            ``trials``, ``seed`` or ``tokens_per_batch`` not an int, or ``forward`` neither
            ``None`` nor callable.
        ValueError: no lengths or no depths, a length shorter than a key and a query, a
            depth outside ``[0, 1]`` (or ``nan``), ``trials`` or ``tokens_per_batch`` below 1,
            or a ``seed`` below 0.
    """
    _check_model(model)
    data = _check_data(data)
    lengths = _check_lengths(lengths)
    depths = _check_depths(depths, "depths")
    check_positive_int(trials, "trials")
    check_positive_int(seed, "seed", 0)
    check_positive_int(tokens_per_batch, "tokens_per_batch")
    if forward is None:
        forward = model
    elif not callable(forward):
        raise TypeError(f"forward must be None or a function from token rows to logits, got "
                        f"{type(forward).__name__}")
    for w in lengths:
        if w < KEY_LEN + QUERY_LEN:
            raise ValueError(f"lengths must be at least {KEY_LEN + QUERY_LEN}, got {w}")
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list] = {"bits": [], "control_bits": [], "gain": [], "exact": [],
                            "gain_trials": [], "exact_trials": []}
    for w in lengths:
        rows_bits, rows_ctrl, rows_gain, rows_exact, trial_gain, trial_exact = [], [], [], [], [], []
        base = windows(data, evenly_spaced_starts(data.size, w, trials), w)
        for depth in depths:
            at = int(round(float(depth) * (w - KEY_LEN - QUERY_LEN)))
            digits, other = random_digits(trials, gen), random_digits(trials, gen)
            same = other.eq(digits).all(-1)
            other[same, 0] = (other[same, 0] - 48 + 1) % 10 + 48  # never the true key
            true_rows, ctrl_rows = base.clone(), base.clone()
            for i in range(trials):
                write_key(true_rows[i], at, digits[i])
                write_key(ctrl_rows[i], at, other[i])
                write_key(true_rows[i], w - QUERY_LEN, digits[i], close=False)
                write_key(ctrl_rows[i], w - QUERY_LEN, digits[i], close=False)
            stats = []
            for rows in (true_rows, ctrl_rows):
                bits, hits = [], []
                for chunk in rows.split(_rows_per_batch(w, tokens_per_batch)):
                    # inputs end before the last digit; targets are the query's five digits
                    logits = forward(chunk[:, :-1])[:, -KEY_DIGITS:].float()
                    target = chunk[:, -KEY_DIGITS:]
                    bits.append(F.cross_entropy(logits.transpose(1, 2), target, reduction="none") / LN2)
                    hits.append(logits.argmax(-1).eq(target).all(-1))
                stats.append((torch.cat(bits).mean(-1), torch.cat(hits)))
            (b_true, hit), (b_ctrl, _) = stats  # per trial: bits per digit, exact match
            rows_bits.append(b_true.mean().item())
            rows_ctrl.append(b_ctrl.mean().item())
            rows_gain.append(rows_ctrl[-1] - rows_bits[-1])
            rows_exact.append(hit.float().mean().item())
            trial_gain.append([float(g) for g in b_ctrl - b_true])
            trial_exact.append([int(x) for x in hit])
        out["bits"].append(rows_bits)
        out["control_bits"].append(rows_ctrl)
        out["gain"].append(rows_gain)
        out["exact"].append(rows_exact)
        out["gain_trials"].append(trial_gain)
        out["exact_trials"].append(trial_exact)
    return out


@torch.no_grad()
def attention_entropy(
    model: TinyDecoder,
    data: np.ndarray,
    lengths: Sequence[int],
    *,
    windows_per_length: int = 4,
    tail: int = TAIL,
) -> dict[int, list[float]]:
    """Mean attention entropy in bits, per layer, of the last ``tail`` queries of each window.

    Runs the model block by block with the reference attention (which returns the weights),
    averaging ``-sum_j w_ij log2 w_ij`` over heads, windows and the last ``min(tail, W)``
    query positions. A query at position ``i`` that attends uniformly to its ``i + 1``
    visible keys has entropy ``log2(i + 1)``; one that attends to a single key has 0.

    Raises:
        TypeError: ``model`` not a :class:`~companion.model.TinyDecoder`, ``data`` not a 1-D
            numpy array of integers, ``lengths`` not a list of ints, or a count not an int.
        ValueError: no lengths, a length below 1, ``windows_per_length`` or ``tail`` below
            1, or data too short for the windows.
    """
    if not isinstance(model, TinyDecoder):
        raise TypeError(f"model must be a companion.model.TinyDecoder (its blocks are run one by one), got "
                        f"{type(model).__name__}")
    data = _check_data(data)
    lengths = _check_lengths(lengths)
    check_positive_int(windows_per_length, "windows_per_length")
    check_positive_int(tail, "tail")
    model.eval()
    result = {}
    for w in lengths:
        rows = windows(data, evenly_spaced_starts(data.size, w, windows_per_length), w)
        per_layer = torch.zeros(len(model.blocks))
        for row in rows.split(1):
            pos = torch.arange(w)
            x = model.scheme.embed(model.tok(row), pos)
            for li, block in enumerate(model.blocks):
                # the block's own attention layer, on the reference path (it returns weights)
                out, weights = block.attn(block.ln1(x), pos, causal=True, return_weights=True)
                wt = weights[..., -min(tail, w):, :].float()
                ent = -(wt * torch.log2(wt.clamp_min(1e-30))).sum(-1)
                per_layer[li] += ent.mean() / rows.shape[0]
                x = x + out
                x = x + block.mlp(block.ln2(x))
        result[int(w)] = [float(e) for e in per_layer]
    return result
