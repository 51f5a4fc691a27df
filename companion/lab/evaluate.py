"""The lab's evaluations: bits per byte against length, passkey retrieval, attention entropy.

Every evaluation runs the trained model at lengths it never saw (the training length ``L``
up to ``16 L``) on the validation split, with positions ``0 .. W - 1``:

* :func:`bits_per_byte` cuts evenly spaced, non-overlapping windows of ``W`` bytes and
  reports the mean loss over every position of a window (``"all"``: positions ``0 .. W-1``,
  so short contexts dilute it) and over the last 64 positions (``"tail"``: each of them has
  at least ``W - 64`` bytes of context, the sharpest test of long positions).
* :func:`sliding_bits_per_byte` slides a window of ``W`` bytes by a stride ``S`` and scores
  only the last ``S`` positions of each window, so every scored byte has ``W - S`` to
  ``W - 1`` bytes of context: the usual perplexity protocol for a fixed context size.
* :func:`passkey_retrieval` writes a key at a given depth of a window and a query at its end,
  and measures the bits per digit of the query against a control whose key has other digits.
* :func:`attention_entropy` measures how spread out each layer's attention is.

All losses are in bits (natural-log loss divided by ``ln 2``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..model import TinyDecoder
from .data import KEY_DIGITS, KEY_LEN, QUERY_LEN, random_digits, windows, write_key

__all__ = ["bits_per_byte", "sliding_bits_per_byte", "passkey_retrieval", "attention_entropy",
           "evenly_spaced_starts", "TAIL"]

#: Positions at the end of each window that the ``"tail"`` figure averages.
TAIL = 64
LN2 = math.log(2.0)


def evenly_spaced_starts(n_bytes: int, length: int, count: int) -> Tensor:
    """``count`` window starts spread evenly over ``[0, n_bytes - length]``, int64."""
    span = n_bytes - length
    if span < 0 or count < 1:
        raise ValueError(f"cannot place {count} windows of {length} bytes in {n_bytes} bytes")
    return torch.from_numpy(np.linspace(0, span, count).astype(np.int64))


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


def bits_per_byte(
    model: TinyDecoder,
    data: np.ndarray,
    lengths: Sequence[int],
    *,
    tokens: int = 1 << 15,
    tokens_per_batch: int = 1 << 14,
) -> dict[int, dict[str, float]]:
    """Non-overlapping evaluation: ``{W: {"all": bits, "tail": bits}}`` for each length.

    ``tokens // W`` windows (at least one) of ``W + 1`` bytes are spread evenly over
    ``data``, so every length scores about the same number of bytes from the same stretch of
    text. ``"tail"`` averages the last ``min(TAIL, W)`` positions of each window.
    """
    model.eval()
    result = {}
    for w in lengths:
        count = max(1, tokens // w)
        rows = windows(data, evenly_spaced_starts(data.size, w + 1, count), w + 1)
        bits = _token_bits(model, rows, _rows_per_batch(w, tokens_per_batch))
        result[int(w)] = {"all": float(bits.mean()), "tail": float(bits[:, -min(TAIL, w):].mean())}
    return result


def sliding_bits_per_byte(
    model: TinyDecoder,
    data: np.ndarray,
    lengths: Sequence[int],
    *,
    stride_fraction: float = 0.25,
    scored_tokens: int = 1 << 13,
    regions: int = 8,
    tokens_per_batch: int = 1 << 14,
) -> dict[int, float]:
    """Sliding-window evaluation: ``{W: bits}``, the same bytes scored at every length.

    The scored bytes are ``regions`` stretches of ``scored_tokens // regions`` bytes each,
    spread evenly over ``data`` after its first ``max(lengths)`` bytes, and they are the same
    for every ``W`` whose stride divides the stretch (all powers of two up to it, as in the
    book), so the lengths are compared on identical text. Each stretch is covered by windows
    of ``W + 1`` bytes that end ``S = W * stride_fraction`` bytes apart; each window scores
    only its last ``S`` predictions, so every scored byte is predicted from between
    ``W - S + 1`` and ``W`` bytes of context. Where a stride does not divide the stretch,
    the first ``(stretch // S) * S`` bytes of each stretch are scored (at least one window).
    """
    model.eval()
    lengths = [int(w) for w in lengths]
    if not 0 < stride_fraction <= 1:
        raise ValueError(f"stride_fraction must lie in (0, 1], got {stride_fraction}")
    span = scored_tokens // regions
    longest = max(lengths)
    # the scored bytes of a stretch end at most this far after its start
    reach = max([span] + [max(1, int(w * stride_fraction)) for w in lengths])
    free = data.size - longest - reach - 1
    if span < 1 or free < 0:
        raise ValueError(
            f"data ({data.size} bytes) too short for {regions} scored stretches of {span} bytes "
            f"after a context of {longest}"
        )
    region_starts = longest + torch.from_numpy(np.linspace(0, free, regions).astype(np.int64))
    result = {}
    for w in lengths:
        stride = max(1, int(w * stride_fraction))
        # a window scores the predictions of bytes (end - stride, end]; its first byte is end - w
        ends = (region_starts[:, None] + stride * torch.arange(1, max(1, span // stride) + 1)).flatten()
        rows = windows(data, ends - w, w + 1)
        bits = _token_bits(model, rows, _rows_per_batch(w, tokens_per_batch))
        result[w] = float(bits[:, -stride:].mean())
    return result


@torch.no_grad()
def passkey_retrieval(
    model: TinyDecoder,
    data: np.ndarray,
    lengths: Sequence[int],
    depths: Sequence[float],
    *,
    trials: int = 16,
    seed: int = 0,
    tokens_per_batch: int = 1 << 14,
) -> dict[str, list[list[float]]]:
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
    * ``"exact"``: fraction of trials whose five digits are all the argmax prediction.
    """
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[list[float]]] = {"bits": [], "control_bits": [], "gain": [], "exact": []}
    for w in lengths:
        if w < KEY_LEN + QUERY_LEN:
            raise ValueError(f"lengths must be at least {KEY_LEN + QUERY_LEN}, got {w}")
        rows_bits, rows_ctrl, rows_gain, rows_exact = [], [], [], []
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
                    logits = model(chunk[:, :-1])[:, -KEY_DIGITS:].float()
                    target = chunk[:, -KEY_DIGITS:]
                    bits.append(F.cross_entropy(logits.transpose(1, 2), target, reduction="none") / LN2)
                    hits.append(logits.argmax(-1).eq(target).all(-1))
                stats.append((torch.cat(bits).mean().item(), torch.cat(hits).float().mean().item()))
            (b_true, exact), (b_ctrl, _) = stats
            rows_bits.append(b_true)
            rows_ctrl.append(b_ctrl)
            rows_gain.append(b_ctrl - b_true)
            rows_exact.append(exact)
        out["bits"].append(rows_bits)
        out["control_bits"].append(rows_ctrl)
        out["gain"].append(rows_gain)
        out["exact"].append(rows_exact)
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
    """
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
