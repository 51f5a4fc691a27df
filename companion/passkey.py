"""Passkey retrieval scored by log-probability, with the filler's KV cache shared (chapter 10).

Chapter 10's first passkey test asked SmolLM2 for one key per cell and judged its greedy
answer: a coin with one toss, null at the native 8K. This module measures retrieval as a
signal (:cite:`mohtashami2023landmark`; chapter 8's measure, :func:`companion.lab.evaluate.passkey_retrieval`):

* **Two formats** (:data:`FORMATS`). ``"classic"`` is the base-model prompt of Mohtashami and
  Jaggi's test, as the YaRN paper runs it: the task line, filler sentences, ``"The pass key
  is NNNNN. Remember it. NNNNN is the pass key."``, more filler, and ``"What is the pass key?
  The pass key is"``, joined by newlines (:func:`prompt_text`). ``"chat"`` is chapter 10's
  first prompt (:func:`companion.longctx.passkey_prompt`): the same story in a user turn of
  the model's chat template, the assistant's turn starting ``"The pass key is"``.
  ``depth`` is the fraction of the filler sentences before the key; the number of sentences
  is the largest that keeps the prompt and its answer within ``length`` tokens
  (:func:`prompt_ids`).
* **The score** (:func:`score_prompts`). After each prompt, the answer's tokens (``" "`` and
  the five digits, for SmolLM2's and Gemma's tokenizers alike) are scored for the true key
  and for ``controls`` other keys, all after *the same prompt*: two candidate answers after
  one prompt, rather than chapter 8's control prompt (the same question after a prompt
  holding another key). Both are sound: a model that ignores the context gives each
  candidate the log-probability ``f(candidate)`` whatever the prompt, and the true key and
  each control are drawn from the same distribution (:func:`draw_keys`: uniform five-digit
  keys, each control uniform among the others), so the gain ``f(key) - mean f(controls)``
  is 0 in expectation (tested). This one costs one prompt per trial instead of two, and a
  control costs six tokens after the cached prompt, so four controls cost nothing
  noticeable and make the control side's prior (a model's taste for some digits) less
  noisy. The gain is reported in bits per digit, ``(log p(key) - mean log p(control)) /
  (5 ln 2)``, beside ``bits`` (``-log2 p(key) / 5``) and **exact match**: whether the
  argmax at every answer position is the key's token (what greedy decoding would write,
  by teacher forcing).
* **Shared work.** Every trial of a cell (one length, one depth) has the same tokens up to
  the key, so the filler before it is run once into a cache, and each trial runs only its
  own suffix (from the key on) and its candidates, each rolled back after
  (:meth:`companion.llama.KVCache.truncate`). The cached path gives the full pass's logits
  to rounding (tested against full passes). Rotary tables that depend on the length
  (Dynamic NTK, LongRoPE's switch) would give the cached prefix other frequencies than a
  full pass: they are fixed at the length of the prompt and its answer
  (:func:`companion.longctx_docs.frozen_length`), which is what one pass over prompt and
  answer computes. The training-free methods share the prefix too: ReRoPE, Leaky ReRoPE and
  Self-Extend keep unrotated keys and run :func:`companion.trainfree.two_region_attention`
  for the new queries; attention sinks stream the prompt in chunks through a
  :class:`companion.trainfree.SinkCache` (the prefix a whole number of chunks, the answer
  one more chunk), copied for each trial.

What a trial costs is its suffix: at depth ``d`` of ``L`` tokens, ``(1 - d) L`` queries
against up to ``L`` keys, about ``(1 - d^2)`` of a full pass's attention. Keys are the same
for every method at a given (seed, length, depth), so methods compare trial by trial
(:func:`companion.lab.stats.paired_bootstrap_ci`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._checks import check_finite_number, check_positive_int
from .longctx import FILLER
from .trainfree import ReRoPE, SelfExtend, SinkCache, TRAINFREE_METHODS

__all__ = [
    "FORMATS",
    "TASK",
    "QUESTION",
    "DIGITS",
    "PASSKEY_FIELDS",
    "prompt_text",
    "passkey_prompts",
    "prompt_ids",
    "answer_ids",
    "draw_keys",
    "score_prompts",
    "passkey_rows",
    "passkey_summary",
]

#: The prompt formats, Mohtashami and Jaggi's base-model prompt and chapter 10's chat prompt.
FORMATS: tuple[str, ...] = ("classic", "chat")
#: The classic prompt's first line (Mohtashami and Jaggi's ``task_description``).
TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
#: The classic prompt's last line; the answer follows it.
QUESTION = "What is the pass key? The pass key is"
#: Digits of a key (keys are ``10000 .. 99999``).
DIGITS = 5
#: The columns of the passkey measure's CSV.
PASSKEY_FIELDS = ("model", "format", "method", "rope_config", "rope_layers", "factor", "length", "depth", "trial",
                  "key", "controls", "prompt_tokens", "key_position", "logp_key", "logp_controls", "gain_bits", "bits",
                  "exact", "seconds", "cpu_seconds", "prefix_tokens", "prefix_seconds")
_LN2 = math.log(2.0)


def _key_line(key: int) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def prompt_text(fmt: str, units: int, depth: float, key: int, template: str | None = None) -> str:
    """The text of a passkey prompt with ``units`` filler sentences, a fraction ``depth`` of
    them (rounded) before the key.

    ``"classic"``: ``TASK``, the filler before, the key line, the filler after and
    ``QUESTION``, joined by newlines (the filler is :data:`companion.longctx.FILLER`'s
    sentences, joined by spaces). ``"chat"``: chapter 10's prompt, the user turn rendered
    with ``template`` (:func:`companion.llama.render_chat`) and ``"The pass key is"`` after.

    Raises:
        TypeError: integer arguments of another type, a ``template`` that is not a string.
        ValueError: an unknown ``fmt``, ``units < 0``, ``depth`` outside ``[0, 1]``, ``key < 1``,
            or ``"chat"`` without a ``template``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {list(FORMATS)}, got {fmt!r}")
    units = check_positive_int(units, "units", minimum=0)
    depth = check_finite_number(depth, "depth", positive=False)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    key = check_positive_int(key, "key")
    before = int(round(units * depth))
    if fmt == "classic":
        return "\n".join([TASK, (FILLER * before).rstrip(), _key_line(key), (FILLER * (units - before)).rstrip(),
                          QUESTION])
    from .llama import render_chat

    if template is None:
        raise ValueError("template must be given for the chat format (the model's tokenizer.chat_template)")
    user = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and "
            "memorize it. I will quiz you about the pass key.\n" + FILLER * before
            + _key_line(key) + " " + FILLER * (units - before) + "\nWhat is the pass key?")
    return render_chat(template, [{"role": "user", "content": user}]) + "The pass key is"


def answer_ids(tokenizer: Any, text: str, ids: Sequence[int], key: int) -> list[int]:
    """The tokens of the answer ``" " + str(key)`` after the prompt ``text`` (whose ids are ``ids``).

    They are ``tokenizer.encode(text + " " + key)``'s ids after ``len(ids)``; the encoding of
    the whole must start with the prompt's ids (true for byte-level BPE and SentencePiece
    after ``"is"``), or a ``ValueError`` says so.
    """
    full = tokenizer.encode(f"{text} {key}").ids
    if list(full[:len(ids)]) != list(ids) or len(full) == len(ids):
        raise ValueError(f"the answer ' {key}' does not tokenize as a continuation of the prompt (the encoding of "
                         f"prompt + answer does not start with the prompt's ids)")
    return list(full[len(ids):])


def prompt_ids(tokenizer: Any, fmt: str, length: int, depth: float, key: int, *, template: str | None = None,
               reserve: int = 0) -> tuple[list[int], str, int]:
    """``(ids, text, units)``: the prompt with the most filler sentences whose ids and
    ``reserve`` more tokens (its answer) fit in ``length`` tokens.

    Raises:
        ValueError: ``length`` too small for the prompt without filler (the message gives
            the least length), and as :func:`prompt_text`.
    """
    length = check_positive_int(length, "length")
    reserve = check_positive_int(reserve, "reserve", minimum=0)
    return _fit(tokenizer, lambda units: prompt_text(fmt, units, depth, key, template), length, reserve, "length")


def _fit(tokenizer: Any, text: Any, length: int, reserve: int, name: str) -> tuple[list[int], str, int]:
    """The most filler sentences ``units`` for which ``text(units)``'s ids and ``reserve`` more
    tokens fit in ``length``: ``(ids, text, units)``; a ``ValueError`` naming ``name`` when not
    even ``text(0)`` fits."""
    def build(units: int) -> tuple[list[int], str]:
        t = text(units)
        return tokenizer.encode(t).ids, t

    ids, t = build(0)
    if len(ids) + reserve > length:
        what = "the prompt without filler" + (" and its answer" if reserve else "")
        raise ValueError(f"{name} must be at least {len(ids) + reserve} ({what}), got {length}")
    per_unit = len(tokenizer.encode(FILLER * 64).ids) / 64
    units = max(0, int((length - reserve - len(ids)) / per_unit))
    ids, t = build(units)
    while len(ids) + reserve > length and units > 0:
        units -= 1
        ids, t = build(units)
    return ids, t, units


def draw_keys(seed: int, length: int, depth: float, trials: int, controls: int = 4) -> list[tuple[int, list[int]]]:
    """``trials`` pairs ``(key, controls)``: five-digit keys, uniform on ``[10000, 99999]``,
    and for each ``controls`` distinct other keys, each uniform among the keys other than
    ``key``. The draw depends on ``(seed, length, depth)`` only (Python's ``random`` seeded
    with that string), so every method and format of a cell sees the same keys.

    Raises:
        TypeError, ValueError: integer arguments of another type or below their minimum
            (``seed >= 0``, ``length >= 1``, ``trials >= 1``, ``controls >= 1``).
    """
    check_positive_int(seed, "seed", minimum=0)
    check_positive_int(length, "length")
    depth = check_finite_number(depth, "depth", positive=False)
    check_positive_int(trials, "trials")
    check_positive_int(controls, "controls")
    rng = random.Random(f"passkey/{seed}/{length}/{depth!r}")
    lo, hi = 10 ** (DIGITS - 1), 10 ** DIGITS - 1
    out = []
    for _ in range(trials):
        key = rng.randint(lo, hi)
        others: list[int] = []
        while len(others) < controls:
            c = rng.randint(lo, hi)
            if c != key and c not in others:
                others.append(c)
        out.append((key, others))
    return out


# ----------------------------------------------------------------------------- the cached passes


class _TwoRegionCache(SinkCache):
    """A prompt cache for ReRoPE / Leaky ReRoPE / Self-Extend: the unrotated keys and values of
    every position (a :class:`companion.llama.KVCache`), and attention by ``mode.attend`` over
    all of them, the new queries last (:func:`companion.trainfree.two_region_attention`).

    A :class:`~companion.trainfree.SinkCache` by type only: :class:`companion.llama.Attention`
    hands a sink cache the unrotated ``q``, ``k``, ``v`` and the rope, which is what a
    two-region method needs; nothing of the sink cache's own state is used."""

    def __init__(self, n_layers: int, mode: ReRoPE | SelfExtend) -> None:
        from .llama import KVCache

        super().__init__(n_layers, 0, 1)
        self.mode = mode
        self.store = KVCache(n_layers)

    @property
    def length(self) -> int:
        return self.store.length

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Any, scale: float | None = None) -> Tensor:
        keys, values = self.store.update(layer, k, v)
        return self.mode.attend(q, keys, values, rope, scale=scale)

    def truncate(self, length: int) -> None:
        self.store.truncate(length)


def _copy_sinks(cache: SinkCache) -> SinkCache:
    """A copy of a sink cache that can be extended without changing ``cache``: the per-layer
    lists are copied; their tensors are shared, which is safe because
    :meth:`~companion.trainfree.SinkCache.attend` replaces them and never writes into them."""
    new = SinkCache(cache.n_layers, cache.n_sink, cache.window, rerotate=cache.rerotate)
    new._k, new._v, new._pos, new._seen = list(cache._k), list(cache._v), list(cache._pos), list(cache._seen)
    return new


class _Runner:
    """One method's cached passes over a model: ``new()`` an empty cache, ``feed(cache, ids)``
    the hidden states of ``ids`` appended at ``cache.length``, ``save``/``restore`` a rollback
    point (a length to truncate to, or a copy of a sink cache)."""

    def __init__(self, model: Any, config: Mapping[str, Any] | None, method: str, chunk: int) -> None:
        self.model, self.chunk = model, chunk
        self.sinks = method == "sinks"
        self.mode = None
        if method in TRAINFREE_METHODS and not self.sinks:
            self.mode = (SelfExtend(config["window"], config["group"]) if method == "self_extend"
                         else ReRoPE(config["window"], config.get("leak")))
        if self.sinks:
            self.n_sink, self.window, self.rerotate = config["n_sink"], config["window"], config["rerotate"]
            self.chunk = config["chunk"]  # the stream's own chunk: part of the method

    def new(self) -> Any:
        from .llama import KVCache

        n = self.model.config.n_layers
        if self.sinks:
            return SinkCache(n, self.n_sink, self.window, rerotate=self.rerotate)
        return KVCache(n) if self.mode is None else _TwoRegionCache(n, self.mode)

    def feed(self, cache: Any, ids: Sequence[int]) -> Tensor:
        """Hidden states ``(1, t, dim)`` of the last piece fed (all of ``ids`` when it fits in one)."""
        x = torch.tensor([list(ids)], dtype=torch.int64)
        step = self.chunk if (self.sinks or cache.length) else x.shape[1]  # a prefill from 0 in one causal call
        h = None
        for s in range(0, x.shape[1], step):
            h = self.model.hidden(x[:, s:s + step], cache)
        return h

    def save(self, cache: Any) -> Any:
        return _copy_sinks(cache) if self.sinks else cache.length

    def restore(self, cache: Any, state: Any) -> Any:
        if self.sinks:
            return _copy_sinks(state)
        cache.truncate(state)
        return cache


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        if any(s[i] != first[i] for s in seqs[1:]):
            return i
    return n


@torch.no_grad()
def score_prompts(
    model: Any,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[Sequence[int]]],
    method: str = "none",
    *,
    factor: float = 2.0,
    rope_layers: str = "global",
    trainfree: Mapping[str, Any] | None = None,
    chunk: int = 1024,
    share: bool = True,
) -> dict[str, Any]:
    """Log-probabilities of candidate answers after each prompt, with ``method`` installed.

    ``answers[i]`` lists the candidate answers of prompt ``i`` (token lists, the true one
    first). Returns ``{"trials": [{"logp": [one per candidate], "exact": bool, "seconds",
    "cpu_seconds"}], "prefix_tokens", "prefix_seconds", "config"}``: ``logp`` is the summed
    log-probability (nats) of a candidate's tokens after the prompt, ``exact`` whether the
    argmax at each position of the first candidate is its token. With ``share`` the
    prompts' common prefix is run once (see the module doc; for ``sinks`` rounded down to
    whole stream chunks) and its time is ``prefix_seconds``; without, each prompt is run
    whole (the reference the tests compare with). Length-dependent ropes are fixed at the
    length of the prompt and its longest answer (prompts of different lengths are run in
    groups). The scaling methods and the training-free ones (Llama only) as in
    :func:`companion.longctx_docs.applied_method`; ``chunk`` is the most tokens fed in one
    call after a cached prefix, not a parameter of the result: each call attends with a
    ``(chunk, keys)`` mask, computing the masked triangle of its own chunk too, so smaller
    chunks waste less (1024 took 20 s where 4096 took 27 s, for a trial of 4096 tokens on
    SmolLM2).

    Raises:
        TypeError: integer arguments of another type, ``share`` not a bool.
        ValueError: no prompts, a number of candidate lists unlike the number of prompts,
            an empty prompt, candidate or candidate list, ids outside the vocabulary, and as
            :func:`companion.longctx_docs.applied_method`.
    """
    from ._checks import check_bool
    from .longctx_docs import applied_method, frozen_length

    chunk = check_positive_int(chunk, "chunk")
    check_bool(share, "share")
    prompts = [list(p) for p in prompts]
    if not prompts or len(answers) != len(prompts):
        raise ValueError(f"prompts must be non-empty and answers must hold one list of candidates per prompt, got "
                         f"{len(prompts)} prompts and {len(answers)} candidate lists")
    vocab = model.config.vocab_size
    for i, (p, cands) in enumerate(zip(prompts, answers)):
        if not p or not cands or any(not c for c in cands):
            raise ValueError(f"prompt {i} and each of its candidate answers must hold at least one token")
        for ids in (p, *cands):
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt {i} or one of its candidates holds an id outside [0, {vocab}) (or not an int)")
    groups: dict[int, list[int]] = {}
    for i, (p, cands) in enumerate(zip(prompts, answers)):
        groups.setdefault(len(p) + max(len(c) for c in cands), []).append(i)
    trials: list[dict[str, Any]] = [{} for _ in prompts]
    prefix_tokens, prefix_seconds = 0, 0.0
    with applied_method(model, method, factor=factor, rope_layers=rope_layers, trainfree=trainfree) as config:
        runner = _Runner(model, config, method, chunk)
        for total, members in groups.items():
            with frozen_length(model, total):
                cache = runner.new()
                p_len = 0
                if share:
                    p_len = min(_common_prefix([prompts[i] for i in members]), min(len(prompts[i]) for i in members) - 1)
                    if runner.sinks:
                        p_len = p_len // runner.chunk * runner.chunk
                t = time.perf_counter()
                if p_len:
                    runner.feed(cache, prompts[members[0]][:p_len])
                prefix_seconds += time.perf_counter() - t
                prefix_tokens = max(prefix_tokens, p_len)
                base = runner.save(cache)
                for i in members:
                    t, c = time.perf_counter(), time.process_time()
                    cache = runner.restore(cache, base)
                    trials[i] = _score_one(model, runner, cache, prompts[i][p_len:], answers[i])
                    trials[i].update(seconds=time.perf_counter() - t, cpu_seconds=time.process_time() - c)
    return {"trials": trials, "prefix_tokens": prefix_tokens, "prefix_seconds": prefix_seconds, "config": config}


def _score_one(model: Any, runner: _Runner, cache: Any, suffix: Sequence[int],
               candidates: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Feed ``suffix`` (the prompt after the cached part), then score each candidate after it."""
    h_last = runner.feed(cache, suffix)[:, -1:]
    work = torch.promote_types(h_last.dtype, torch.float32)
    first = torch.log_softmax(model.logits(h_last)[0, -1].to(work), -1)
    after = runner.save(cache)
    logps, exact = [], False
    for j, cand in enumerate(candidates):
        rows = [first]
        if len(cand) > 1:
            cache = runner.restore(cache, after)
            h = runner.feed(cache, cand[:-1])
            rows += list(torch.log_softmax(model.logits(h)[0].to(work), -1))
        lp = torch.stack(rows)
        target = torch.tensor(list(cand))
        logps.append(float(lp.gather(1, target[:, None]).double().sum()))
        if j == 0:
            exact = bool((lp.argmax(-1) == target).all())
    return {"logp": logps, "exact": exact}


def passkey_prompts(
    tokenizer: Any,
    fmt: str,
    length: int,
    depth: float,
    *,
    trials: int = 20,
    controls: int = 4,
    seed: int = 0,
    template: str | None = None,
) -> tuple[list[tuple[int, list[int]]], list[list[int]], list[list[list[int]]]]:
    """``(keys, prompts, answers)``: the prompts of one cell of the passkey measure.

    ``keys`` is :func:`draw_keys` ``(seed, length, depth, trials, controls)`` (each true key
    with its controls); every prompt has the same number of filler sentences, the most for
    which :func:`prompt_ids` leaves room for an answer within ``length`` tokens; ``prompts[i]``
    is the ids of trial ``i``'s prompt and ``answers[i]`` the ids of its candidates, the true
    key first, then the controls (:func:`answer_ids`). :func:`passkey_rows` scores them.

    Raises:
        ValueError: a length too small for the prompt, or a tokenizer whose prompts differ in
            length between keys beyond ``length``, and as :func:`prompt_ids` and
            :func:`draw_keys`.
    """
    keys = draw_keys(seed, length, depth, trials, controls)
    ref_ids, ref_text, units = prompt_ids(tokenizer, fmt, length, depth, 99999, template=template)
    reserve = len(answer_ids(tokenizer, ref_text, ref_ids, 99999))
    _, _, units = prompt_ids(tokenizer, fmt, length, depth, 99999, template=template, reserve=reserve)
    prompts, answers = [], []
    for key, others in keys:
        text = prompt_text(fmt, units, depth, key, template)
        ids = tokenizer.encode(text).ids
        cands = [answer_ids(tokenizer, text, ids, k) for k in (key, *others)]
        if len(ids) + max(map(len, cands)) > length:
            raise ValueError(f"the prompt for key {key} and its answers take {len(ids) + max(map(len, cands))} "
                             f"tokens, more than length {length} (a tokenizer that merges digits?)")
        prompts.append(ids)
        answers.append(cands)
    return keys, prompts, answers


def passkey_rows(
    model: Any,
    tokenizer: Any,
    fmt: str,
    length: int,
    depth: float,
    method: str,
    *,
    trials: int = 20,
    controls: int = 4,
    seed: int = 0,
    template: str | None = None,
    factor: float = 2.0,
    rope_layers: str = "global",
    trainfree: Mapping[str, Any] | None = None,
    chunk: int = 1024,
) -> list[dict[str, Any]]:
    """One cell of the passkey measure for one method: a row per trial (:data:`PASSKEY_FIELDS`).

    The keys, prompts and candidates are :func:`passkey_prompts`' (every prompt and its
    answer fit in ``length`` tokens, so at the native length no position reaches it; the
    true key, then the controls), scored by :func:`score_prompts`.
    ``key_position`` is the first token where the cell's prompts differ (the key's first
    digits), ``prompt_tokens - key_position`` the distance the model must read back.

    Raises:
        ValueError: a length too small for the prompt, a tokenizer whose prompts differ in
            length between keys beyond ``length``, and as :func:`score_prompts`.
    """
    keys, prompts, answers = passkey_prompts(tokenizer, fmt, length, depth, trials=trials, controls=controls,
                                             seed=seed, template=template)
    res = score_prompts(model, prompts, answers, method, factor=factor, rope_layers=rope_layers,
                        trainfree=trainfree, chunk=chunk)
    import json

    from .longctx_docs import _model_name

    key_pos = _common_prefix(prompts) if len(prompts) > 1 else None
    rows = []
    for i, ((key, others), trial) in enumerate(zip(keys, res["trials"])):
        lp_key, lp_ctrl = trial["logp"][0], sum(trial["logp"][1:]) / len(others)
        rows.append({
            "model": _model_name(model), "format": fmt, "method": method,
            "rope_config": json.dumps(res["config"], sort_keys=True), "rope_layers": rope_layers, "factor": factor,
            "length": length, "depth": depth, "trial": i, "key": key, "controls": " ".join(map(str, others)),
            "prompt_tokens": len(prompts[i]), "key_position": "" if key_pos is None else key_pos,
            "logp_key": repr(lp_key), "logp_controls": repr(lp_ctrl),
            "gain_bits": repr((lp_key - lp_ctrl) / (DIGITS * _LN2)), "bits": repr(-lp_key / (DIGITS * _LN2)),
            "exact": int(trial["exact"]), "seconds": round(trial["seconds"], 3),
            "cpu_seconds": round(trial["cpu_seconds"], 3), "prefix_tokens": res["prefix_tokens"],
            "prefix_seconds": round(res["prefix_seconds"], 3),
        })
    return rows


def passkey_summary(rows: Sequence[Mapping[str, Any]], *, confidence: float = 0.95, resamples: int = 4000,
                    seed: int = 0) -> dict[tuple[str, str, int, float], dict[str, Any]]:
    """Per ``(format, method, length, depth)``: the mean gain (bits per digit) with a bootstrap
    interval over trials (:func:`companion.lab.stats.bootstrap_ci`), and the exact-match count
    with its Wilson interval (:func:`companion.lab.stats.proportion_ci`), from stored rows
    (:func:`passkey_rows`, or the CSV's strings).

    Raises:
        ValueError: a row without the keys ``format``, ``method``, ``length``, ``depth``,
            ``gain_bits``, ``exact`` (or with values that are not numbers).
    """
    from .lab.stats import bootstrap_ci, proportion_ci

    cells: dict[tuple[str, str, int, float], list[tuple[float, int]]] = {}
    for i, r in enumerate(rows):
        try:
            key = (str(r["format"]), str(r["method"]), int(r["length"]), float(r["depth"]))
            cells.setdefault(key, []).append((float(r["gain_bits"]), int(r["exact"])))
        except KeyError as exc:
            raise ValueError(f"rows[{i}] lacks the key {exc}; passkey rows have the keys {list(PASSKEY_FIELDS)}") from None
        except (TypeError, ValueError):
            raise ValueError(f"rows[{i}] holds a value that is not a number among length, depth, gain_bits, exact: "
                             f"{dict(r)!r:.200}") from None
    out = {}
    for key, vals in sorted(cells.items()):
        gains = [g for g, _ in vals]
        hits = sum(e for _, e in vals)
        out[key] = {"gain": bootstrap_ci(gains, confidence=confidence, resamples=resamples, seed=seed),
                    "exact": proportion_ci(hits, len(vals), confidence=confidence), "trials": len(vals)}
    return out
