"""Attention temperature on a real model (chapter 13): entropy and loss against context length.

Chapter 13 derives YaRN's attention factor, LongRoPE's and Llama 4's temperatures and log-n
scaling as one idea: multiply the attention logits by a factor that grows with the context,
so that attention does not spread thinner as the keys multiply. This module measures what
they do on SmolLM2-135M (:class:`companion.llama.LlamaModel`, native context 8192), on the
same tokens at every length:

* **Windows that end together.** For a document of at least ``max(lengths)`` tokens, the
  window of length ``n`` is the ``n`` tokens that end at token ``max(lengths)``
  (:func:`same_end_windows`). Every length therefore scores the same last ``tail`` tokens and
  probes the same last ``last`` queries, with more or less context before them.
* **Conditions** (:func:`conditions_for`). Within the native context, the model as trained
  (``none``, ``off``). Past it, with ``s = n / native``: plain RoPE as it is, and with log-n
  scaling; YaRN's frequencies at ``s`` with no attention factor, with its factor
  ``(0.1 ln s + 1)**2`` on the logits (HuggingFace's default), and with log-n scaling instead.
  Log-n is :class:`companion.model.AttentionTemperature` ``("log-n", length=native)``:
  ``max(1, ln(p + 1) / ln native)`` at query position ``p``, in every layer.
* **Measures** (:func:`temperature_rows`). One pass per window and condition: the attention
  entropy in bits of each layer, averaged over its heads and the last ``last`` queries
  (:meth:`companion.llama.LlamaModel.attention_entropy`), and the mean loss in nats of each
  block of ``block`` tokens among the last ``tail`` targets.

The command is ``python -m companion.longctx temperature`` (:mod:`companion.longctx_runs`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._checks import check_positive_int
from .model import AttentionTemperature

__all__ = ["TEMPERATURE_FIELDS", "TEMPERATURES", "conditions_for", "same_end_windows", "temperature_rows"]

#: The columns of the measure's CSV, one row per document, length, condition and metric
#: (``entropy`` with ``where`` the layer, ``nll`` with ``where`` the block's first target as
#: an offset from the window's end, ``tau_last`` the logit factor of the last query).
TEMPERATURE_FIELDS = ("document", "length", "method", "factor", "temperature", "metric", "where", "value")

#: The temperatures compared, ``off`` (no factor; for YaRN, its attention factor set to 1),
#: ``yarn`` (YaRN's own factor, HuggingFace's default) and ``log-n`` (log-n scaling in every layer).
TEMPERATURES: tuple[str, ...] = ("off", "yarn", "log-n")


def conditions_for(length: int, native: int) -> list[tuple[str, str]]:
    """The ``(method, temperature)`` pairs measured at ``length`` for a model of ``native``
    context: ``[("none", "off")]`` within it; past it plain RoPE without and with log-n, and
    YaRN with no factor, its own, and log-n.

    Raises:
        TypeError, ValueError: ``length`` or ``native`` not an int >= 2.
    """
    n = check_positive_int(length, "length", minimum=2)
    native = check_positive_int(native, "native", minimum=2)
    if n <= native:
        return [("none", "off")]
    return [("none", "off"), ("none", "log-n"), ("yarn", "off"), ("yarn", "yarn"), ("yarn", "log-n")]


def same_end_windows(ids: Sequence[int], lengths: Sequence[int]) -> dict[int, Tensor]:
    """For each of ``lengths``, the ``(1, n)`` window of ``ids`` that ends at token
    ``max(lengths)``: ``ids[max - n : max]``.

    Raises:
        TypeError: a length not an int.
        ValueError: no lengths, a repeated one, a length < 2, or ``ids`` shorter than the longest.
    """
    if not len(lengths):
        raise ValueError("lengths must hold at least one length, got none")
    ns = [check_positive_int(n, "lengths", minimum=2) for n in lengths]
    if len(set(ns)) < len(ns):
        raise ValueError(f"lengths must not repeat a length, got {ns}")
    end = max(ns)
    if len(ids) < end:
        raise ValueError(f"ids must hold at least max(lengths) = {end} tokens, got {len(ids)}")
    t = torch.as_tensor(list(ids[:end]), dtype=torch.long)
    return {n: t[end - n:][None] for n in ns}


def _rope_config(method: str, factor: float, native: int, base: float, temperature: str) -> dict[str, Any] | None:
    """Plain RoPE (``None``), or chapter 9's YaRN config at ``factor``: with its own attention
    factor for the temperature ``yarn``, without it (``yarn-no-temp``) otherwise."""
    if method == "none":
        return None
    from .lab.extend import method_config

    return method_config("yarn" if temperature == "yarn" else "yarn-no-temp", factor, native, head_dim=0, base=base)


@torch.no_grad()
def temperature_rows(model: Any, ids: Sequence[int], lengths: Sequence[int], *, document: str = "",
                     last: int = 64, tail: int = 1024, block: int = 64,
                     conditions: Sequence[tuple[str, str]] | None = None,
                     progress: Any = None) -> list[dict[str, Any]]:
    """Rows of :data:`TEMPERATURE_FIELDS` for one document: every length of ``lengths`` (its
    window from :func:`same_end_windows`) under each condition of :func:`conditions_for` (or
    ``conditions``, the same pairs at every length), each one pass of ``model`` (a
    :class:`companion.llama.LlamaModel`). The model's RoPE and temperatures are restored after.

    Raises:
        TypeError: ``model`` not a :class:`companion.llama.LlamaModel`; bad ints.
        ValueError: ``last``, ``tail`` or ``block`` outside ``[1, min(lengths) - 1]``,
            ``block`` not dividing ``tail``, an unknown method or temperature, a YaRN condition
            within the native context, or what :func:`same_end_windows` raises.
    """
    from .llama import LlamaModel
    from .longctx_docs import _head_nll

    if not isinstance(model, LlamaModel):
        raise TypeError(f"model must be a companion.llama.LlamaModel, got {type(model).__name__}")
    windows = same_end_windows(ids, lengths)
    shortest = min(windows)
    for name, value in (("last", last), ("tail", tail), ("block", block)):
        v = check_positive_int(value, name)
        if v > shortest - 1:
            raise ValueError(f"{name} must lie in [1, min(lengths) - 1] = [1, {shortest - 1}], got {v}")
    if tail % block:
        raise ValueError(f"block ({block}) must divide tail ({tail})")
    native, base = model.config.context_length, model.config.rope_base
    plans = {n: conditions_for(n, native) if conditions is None else list(conditions) for n in windows}
    for n, plan in plans.items():
        for method, temp in plan:
            if method not in ("none", "yarn"):
                raise ValueError(f"method must be 'none' or 'yarn', got {method!r}")
            if temp not in TEMPERATURES or (temp == "yarn" and method != "yarn"):
                raise ValueError(f"temperature must be one of {list(TEMPERATURES)} ('yarn' with YaRN only), got "
                                 f"{temp!r} for {method!r}")
            if method == "yarn" and n <= native:
                raise ValueError(f"YaRN needs a factor > 1: length {n} is within the native context {native}")
    saved = model.attention_temperatures
    rows: list[dict[str, Any]] = []
    try:
        for n, window in windows.items():
            factor = max(1.0, n / native)
            targets = window[0, n - tail:]
            for method, temp in plans[n]:
                t0 = time.perf_counter()
                model.set_rope_config(_rope_config(method, factor, native, base, temp))
                model.set_attention_temperature(AttentionTemperature("log-n", length=native) if temp == "log-n"
                                                else None)
                ent, h = model.attention_entropy(window, last, return_hidden=True)
                nll = _head_nll(model, h[:, n - tail - 1:n - 1], targets)
                tau = model.layers[0].attention.temperature
                tau_last = 1.0 if tau is None else float(tau.scales(torch.tensor([n - 1]))[0])
                if method == "yarn" and temp == "yarn":
                    tau_last = float(model.rope.attention_scaling) ** 2
                key = {"document": document, "length": n, "method": method,
                       "factor": round(factor, 6) if method == "yarn" else 1.0, "temperature": temp}
                rows += [{**key, "metric": "entropy", "where": i, "value": round(float(e), 5)}
                         for i, e in enumerate(ent.mean(-1))]
                rows += [{**key, "metric": "nll", "where": tail - j * block,
                          "value": round(float(nll[j * block:(j + 1) * block].mean()), 5)}
                         for j in range(tail // block)]
                rows.append({**key, "metric": "tau_last", "where": "", "value": round(tau_last, 6)})
                if progress is not None:
                    progress(f"    {document} n={n} {method}/{temp}: {time.perf_counter() - t0:.0f} s")
    finally:
        model.set_rope_config(None)
        for block_, t in zip(model.layers, saved):
            block_.attention.temperature = t
    return rows

