"""A counting task for contextual positions: which marker was the k-th last?

Each sequence is noise tokens with *markers* scattered among them at random gaps, and ends
with a query token ``Q_k`` that asks: **which marker was the k-th last one?** For example,
with noise ``a b c``, markers ``X Y Z`` and ``k = 2``::

    b X a c c Y b Z a a Q_2   ->   Y

The answer is ``k`` markers back, whatever the gaps, so its distance from the query in
tokens varies from sequence to sequence (and grows when the gaps grow). A scheme that
measures distance in tokens (RoPE, ALiBi) can find the *nearest* marker, and a second layer
can hop from a marker to the one before it, but it has no attention pattern that picks "the
k-th marker back" in one step. One attention layer of CoPE (:class:`companion.cope.CoPE`,
Golovneva et al. :cite:`golovneva2024cope`) can, if its gates open on markers and stay shut
on noise: the contextual position of the ``k``-th last marker is then ``k`` (or ``k + 1``
with the query's own gate), a constant. The task is the counting / selective-copy family of
the CoPE paper, reduced to a size that trains on one CPU thread in seconds. Whether two
layers of token positions can learn it anyway (hop from marker to marker) is an empirical
question: the stored runs say what they did within their budgets, not what they cannot do.

The stored result (``chapters/data/11_counting.json``) and chapter 11 report what it
measured; CoPE is the most sensitive of the schemes to the learning rate, which is why the
command line runs two.

**The protocol.** Three fixed sets of sequences, drawn from generators of their own and never
from a training stream: a *validation* split (:data:`VALID_SEED`, the training gaps), on
which each scheme's learning rate is chosen (:func:`best_lr`: the highest mean validation
accuracy over seeds), and two *test* splits, the training gaps (:data:`EVAL_SEED`) and the
longer ones (:data:`LONG_EVAL_SEED`), scored only for the chosen rate (:func:`run_all`), so
that the reported accuracy is not the maximum of several tries on the reported set. Every
accuracy is stored with the number right and the number scored (and which, with
:func:`companion.lab.grid_task.pack_hits`), so that intervals can be computed from the stored
file. A second budget (``--long-steps``, three times the steps by default, for RoPE and CoPE)
says whether what a scheme did not learn in the first budget it learns with more.

Vocabulary (:class:`CountingTask`): noise ``0 .. n_noise - 1``, markers ``n_noise .. n_noise
+ n_markers - 1``, queries ``Q_k = n_noise + n_markers + k - 1`` for ``k = 1 .. max_k``.
Every sequence of a task has the same length, :attr:`CountingTask.seq_len`: reading back from
the query, gap ``g_1`` (noise), marker 1, gap ``g_2``, marker 2, ..., marker ``m``, then noise
to the start, with ``m`` uniform in ``[max_k, max_k + extra_markers]`` and each gap uniform in
``[gap_min, gap_max]``.

:func:`train_and_eval` trains :class:`~companion.model.TinyDecoder` with one scheme
(``"cope"``, ``"rope"``, ``"nope"``, ``"alibi"``) on the answer token only, and measures
accuracy on the validation split and on the test splits, with the training gaps and with
longer ones (:meth:`CountingTask.longer`, gaps ``[gap_max + 1, 2 gap_max + 1]``, never seen in
training). The command line runs several schemes, learning rates and seeds and stores the
results with provenance::

    python -m companion.lab.counting --out chapters/data/11_counting.json
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check_bool, check_finite_number, check_positive_int
from .._cli import check_distinct, check_run_flags, usage_errors
from ..alibi import ALiBi
from ..attention import NoPE, PositionScheme
from ..cope import CoPE, cope_gates
from ..model import TinyDecoder
from ..rope import RotaryEmbedding
from ..utils import save_result
from .data import as_generator
from .grid_task import pack_hits

__all__ = [
    "CountingTask",
    "CountingBatch",
    "make_batch",
    "SCHEMES",
    "build_scheme",
    "TrainSettings",
    "train_and_eval",
    "accuracy",
    "evaluate_test_splits",
    "marker_gates",
    "best_lr",
    "run_all",
    "summarize",
    "STEPS",
    "LONG_STEPS",
    "SEEDS",
    "LRS",
    "main",
]

#: Seeds of the held-out sets; training batches come from the run's own seed (a small int),
#: so no evaluation sequence is drawn from the training stream. The validation split
#: (:data:`VALID_SEED`) chooses the learning rate; the test splits (:data:`EVAL_SEED`, training
#: gaps, and :data:`LONG_EVAL_SEED`, longer gaps) are reported for the chosen rate only.
EVAL_SEED = 2_000_003
LONG_EVAL_SEED = 2_000_029
VALID_SEED = 2_000_017

#: The command line's defaults: optimiser steps of a run, the longer budget of the second run
#: (for RoPE and CoPE), the seeds of every scheme and the learning rates tried.
STEPS = 800
LONG_STEPS = 2400
SEEDS: tuple[int, ...] = (0, 1, 2, 3, 4)
LRS: tuple[float, ...] = (3e-3, 1e-2)


@dataclass(frozen=True)
class CountingTask:
    """The parameters of the "k-th last marker" task (see the module docstring).

    Args:
        n_noise: noise tokens (>= 1).
        n_markers: distinct markers (>= 2; chance accuracy is ``1 / n_markers``).
        max_k: the largest ``k`` asked (>= 1); ``k`` is uniform in ``1 .. max_k``.
        extra_markers: markers beyond ``max_k`` a sequence may hold (>= 0): the number of
            markers is uniform in ``[max_k, max_k + extra_markers]``, so the answer is not
            "the first marker".
        gap_min, gap_max: the noise tokens between consecutive markers (and between the last
            marker and the query), uniform in ``[gap_min, gap_max]``, ``0 <= gap_min <=
            gap_max``.
    """

    n_noise: int = 16
    n_markers: int = 8
    max_k: int = 4
    extra_markers: int = 2
    gap_min: int = 0
    gap_max: int = 5

    def __post_init__(self) -> None:
        check_positive_int(self.n_noise, "n_noise")
        check_positive_int(self.n_markers, "n_markers", 2)
        check_positive_int(self.max_k, "max_k")
        check_positive_int(self.extra_markers, "extra_markers", 0)
        check_positive_int(self.gap_min, "gap_min", 0)
        check_positive_int(self.gap_max, "gap_max", 0)
        if self.gap_max < self.gap_min:
            raise ValueError(f"gap_max ({self.gap_max}) must be >= gap_min ({self.gap_min})")

    @property
    def vocab_size(self) -> int:
        """``n_noise + n_markers + max_k``: noise, markers, then one query token per ``k``."""
        return self.n_noise + self.n_markers + self.max_k

    @property
    def max_markers(self) -> int:
        """The most markers a sequence holds, ``max_k + extra_markers``."""
        return self.max_k + self.extra_markers

    @property
    def seq_len(self) -> int:
        """``1 + max_markers (gap_max + 1)``: room for the most markers at the widest gaps,
        and the query."""
        return 1 + self.max_markers * (self.gap_max + 1)

    def is_marker(self, tokens: Tensor) -> Tensor:
        """Boolean mask of the marker tokens in ``tokens``."""
        return (tokens >= self.n_noise) & (tokens < self.n_noise + self.n_markers)

    def query_token(self, k: int | Tensor) -> int | Tensor:
        """The token that asks for the ``k``-th last marker, ``n_noise + n_markers + k - 1``."""
        return self.n_noise + self.n_markers + k - 1

    def longer(self) -> "CountingTask":
        """The same task with gaps ``[gap_max + 1, 2 gap_max + 1]``: every gap longer than any
        seen in training (and longer sequences)."""
        return replace(self, gap_min=self.gap_max + 1, gap_max=2 * self.gap_max + 1)


class CountingBatch(NamedTuple):
    """A batch of the task: ``tokens`` ``(batch, seq_len)`` int64 ending in the query,
    ``answer`` ``(batch,)`` the marker asked for, ``k`` ``(batch,)`` in ``1 .. max_k``."""

    tokens: Tensor
    answer: Tensor
    k: Tensor


def make_batch(batch_size: int, generator: torch.Generator | int,
               task: CountingTask = CountingTask()) -> CountingBatch:
    """Draw ``batch_size`` sequences of ``task``.

    Args:
        batch_size: sequences (>= 1).
        generator: a ``torch.Generator`` (advanced by the call) or an int seed (>= 0). The
            same seed gives the same batch on every machine (torch's CPU generator is
            portable).
        task: the task parameters.

    Returns:
        A :class:`CountingBatch`.
    """
    check_positive_int(batch_size, "batch_size")
    if not isinstance(task, CountingTask):
        raise TypeError(f"task must be a CountingTask, got {type(task).__name__}")
    g = as_generator(generator)
    b, m, n = batch_size, task.max_markers, task.seq_len
    tokens = torch.randint(0, task.n_noise, (b, n), generator=g)
    count = torch.randint(task.max_k, m + 1, (b,), generator=g)
    gaps = torch.randint(task.gap_min, task.gap_max + 1, (b, m), generator=g)
    marks = torch.randint(0, task.n_markers, (b, m), generator=g) + task.n_noise
    k = torch.randint(1, task.max_k + 1, (b,), generator=g)
    back = torch.arange(1, m + 1)  # marker r (r-th last) sits r + g_1 + ... + g_r before the query
    where = (n - 1) - back - gaps.cumsum(-1)
    placed = back[None, :] <= count[:, None]
    rows = torch.arange(b)[:, None].expand(b, m)
    tokens[rows[placed], where[placed]] = marks[placed]
    tokens[:, -1] = task.query_token(k)
    return CountingBatch(tokens, marks[torch.arange(b), k - 1], k)


# ----------------------------------------------------------------------------- schemes


def _cope(head_dim: int, n_heads: int, npos: int) -> PositionScheme:
    return CoPE(head_dim, npos)


def _rope(head_dim: int, n_heads: int, npos: int) -> PositionScheme:
    return RotaryEmbedding(head_dim)


def _alibi(head_dim: int, n_heads: int, npos: int) -> PositionScheme:
    return ALiBi(n_heads)


def _nope(head_dim: int, n_heads: int, npos: int) -> PositionScheme:
    return NoPE()


#: The schemes this task compares, ``name -> factory(head_dim, n_heads, npos)``.
SCHEMES: dict[str, Callable[[int, int, int], PositionScheme]] = {
    "cope": _cope,
    "rope": _rope,
    "nope": _nope,
    "alibi": _alibi,
}


def build_scheme(name: str, head_dim: int, n_heads: int, npos: int | None = None) -> PositionScheme:
    """A fresh scheme by name (one of :data:`SCHEMES`): ``CoPE(head_dim, npos)`` (zero table,
    the authors' start; ``npos=None`` means the default task's ``seq_len + 1``),
    ``RotaryEmbedding(head_dim)``, ``NoPE()``, ``ALiBi(n_heads)``.

    Raises:
        TypeError: ``name`` is not a string (a list of names, None).
        ValueError: ``name`` is not one of :data:`SCHEMES`, or ``npos`` below 1.
    """
    if not isinstance(name, str):
        raise TypeError(f"scheme_name must be a str, one of {tuple(SCHEMES)}, got {type(name).__name__} {name!r}")
    if name not in SCHEMES:
        raise ValueError(f"scheme_name must be one of {tuple(SCHEMES)}, got {name!r}")
    npos = CountingTask().seq_len + 1 if npos is None else check_positive_int(npos, "npos")
    return SCHEMES[name](head_dim, n_heads, npos)


# ----------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainSettings:
    """The model and optimiser of :func:`train_and_eval` (defaults: the chapter's recipe).

    A 2-layer, width-32, 2-head :class:`~companion.model.TinyDecoder` (head dim 16), AdamW at
    a peak learning rate ``lr`` with ``warmup`` linear steps and cosine decay to 0, no weight
    decay, ``batch_size`` fresh sequences per step, the loss on the answer only.

    Args:
        lr: peak learning rate, a finite number > 0. ``3e-3`` is the default because CoPE
            trains reliably there (3 of 3 seeds in the design runs; at ``5e-3`` and ``1e-2``
            some seeds stall); RoPE and NoPE learn faster at ``1e-2`` (at ``3e-3`` they are
            still short of their plateau after 800 steps), so the command line tries both
            and keeps, per scheme, the one the validation split prefers (:func:`best_lr`).
        npos: CoPE's table size (counts saturate at ``npos - 1``); ``None`` (default) means
            the training task's ``seq_len + 1``, every count a query can reach, as the
            authors' default (block size + 1). A small table (8) saturates the counts of an
            untrained model, whose gates are all near 1/2, and so blocks the gradient to the
            gates of distant keys: in the design runs it stalled 2 of 3 seeds.
        grad_clip: clip the gradient norm at this value; 0 (default) does not clip.
        eval_size: held-out sequences per evaluation set.
    """

    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 2
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 50
    npos: int | None = None
    eval_size: int = 1000
    grad_clip: float = 0.0

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "n_layers", "batch_size", "eval_size"):
            check_positive_int(getattr(self, name), name)
        if self.npos is not None:
            check_positive_int(self.npos, "npos")
        check_positive_int(self.warmup, "warmup", 0)
        check_finite_number(self.lr, "lr")
        check_finite_number(self.grad_clip, "grad_clip", minimum=0)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")


def accuracy(model: TinyDecoder, batch: CountingBatch, max_k: int | None = None) -> dict[str, Any]:
    """Fraction of ``batch`` whose answer is the model's top-1 prediction at the query.

    Returns ``{"accuracy": float, "by_k": [accuracy for k = 1 .. max_k], "correct": int,
    "evaluated": int, "by_k_correct": [int], "by_k_evaluated": [int], "hits": str}``:
    ``max_k`` defaults to ``batch.k.max()``, a ``k`` absent from the batch gets ``nan``
    accuracy (and 0 of 0); ``correct`` of ``evaluated`` are the counts behind the accuracy (a
    Wilson interval needs them), and ``hits`` the per-sequence flags in the batch's order
    (:func:`companion.lab.grid_task.pack_hits`; ``unpack_hits(hits, evaluated)`` reads them).
    """
    if not isinstance(model, TinyDecoder):
        raise TypeError(f"model must be a TinyDecoder, got {type(model).__name__}")
    if not isinstance(batch, CountingBatch):
        raise TypeError(f"batch must be a CountingBatch, got {type(batch).__name__}")
    was_training = model.training
    model.eval()
    with torch.no_grad():
        hit = model(batch.tokens)[:, -1].argmax(-1) == batch.answer
    model.train(was_training)
    right = hit.double()
    top = int(batch.k.max()) if max_k is None else check_positive_int(max_k, "max_k")
    by_k = [float(right[batch.k == j].mean()) if bool((batch.k == j).any()) else float("nan")
            for j in range(1, top + 1)]
    return {"accuracy": float(right.mean()), "by_k": by_k, "correct": int(hit.sum()), "evaluated": int(hit.numel()),
            "by_k_correct": [int(hit[batch.k == j].sum()) for j in range(1, top + 1)],
            "by_k_evaluated": [int((batch.k == j).sum()) for j in range(1, top + 1)],
            "hits": pack_hits(hit)}


def evaluate_test_splits(model: TinyDecoder, task: CountingTask = CountingTask(),
                         long_task: CountingTask | None = None, eval_size: int = 1000) -> dict[str, dict[str, Any]]:
    """The test splits' :func:`accuracy`. Call it only for the runs whose learning rate the
    validation split chose (:func:`run_all` does).

    Args:
        model: a trained :class:`~companion.model.TinyDecoder`.
        task: the training task; the in-distribution test split is drawn from it.
        long_task: the longer-gap task (default ``task.longer()``), with ``task``'s vocabulary.
        eval_size: sequences per split (>= 1).

    Returns:
        ``{"in_distribution": accuracy on eval_size sequences of task drawn with EVAL_SEED,
        "longer_gaps": accuracy on eval_size sequences of long_task drawn with
        LONG_EVAL_SEED}``.
    """
    long_task = _check_long_task(task, long_task)
    check_positive_int(eval_size, "eval_size")
    return {"in_distribution": accuracy(model, make_batch(eval_size, EVAL_SEED, task), task.max_k),
            "longer_gaps": accuracy(model, make_batch(eval_size, LONG_EVAL_SEED, long_task), task.max_k)}


def _check_long_task(task: object, long_task: object) -> CountingTask:
    """``long_task`` (``task.longer()`` for None), a task with ``task``'s vocabulary."""
    if not isinstance(task, CountingTask):
        raise TypeError(f"task must be a CountingTask, got {type(task).__name__}")
    long_task = task.longer() if long_task is None else long_task
    if not isinstance(long_task, CountingTask):
        raise TypeError(f"long_task must be a CountingTask or None, got {type(long_task).__name__}")
    if (long_task.n_noise, long_task.n_markers, long_task.max_k) != (task.n_noise, task.n_markers, task.max_k):
        raise ValueError("long_task must share task's vocabulary (n_noise, n_markers, max_k)")
    return long_task


def train_and_eval(scheme_name: str, seed: int, steps: int = STEPS, *,
                   task: CountingTask = CountingTask(), settings: TrainSettings = TrainSettings(),
                   long_task: CountingTask | None = None, test: bool = True,
                   return_model: bool = False) -> dict[str, Any] | tuple[dict[str, Any], TinyDecoder]:
    """Train one scheme on ``task`` and measure its accuracy on the validation split and (with
    ``test``) on the test splits, with training and longer gaps.

    The model's initial weights come from ``torch.manual_seed(seed)`` (this sets torch's
    global seed), the training batches from a generator seeded with ``seed``, the held-out
    sets from fixed seeds of their own (:data:`VALID_SEED`, :data:`EVAL_SEED`,
    :data:`LONG_EVAL_SEED`), so all schemes and seeds are scored on the same sequences.
    Deterministic for a given machine, thread count and numeric configuration. The run's
    speed depends on the threads torch uses; the command line sets one.

    Args:
        scheme_name: one of :data:`SCHEMES`.
        seed: an int >= 0.
        steps: optimiser steps (>= 1).
        task: the training task; the validation split and the in-distribution test split are
            drawn from it too.
        settings: model and optimiser (:class:`TrainSettings`).
        long_task: the generalisation set's task (default ``task.longer()``).
        test: also score the test splits (:func:`evaluate_test_splits`). :func:`run_all` passes
            False, and scores them later for the learning rate the validation split chose.
        return_model: also return the trained model.

    Returns:
        A dict: ``scheme``, ``seed``, ``steps``, ``train_seconds`` (wall clock, machine
        dependent), ``final_loss`` (mean of the last 50 steps' losses), ``validation``
        (:func:`accuracy`'s dict on ``settings.eval_size`` sequences of ``task`` drawn with
        :data:`VALID_SEED`), with ``test`` ``in_distribution`` and ``longer_gaps``
        (:func:`evaluate_test_splits`), and the ``task``, ``long_task`` and ``settings`` as dicts.
    """
    if not isinstance(scheme_name, str) or scheme_name not in SCHEMES:
        raise ValueError(f"scheme_name must be one of {tuple(SCHEMES)}, got {scheme_name!r}")
    check_positive_int(seed, "seed", 0)
    check_positive_int(steps, "steps")
    long_task = _check_long_task(task, long_task)
    if not isinstance(settings, TrainSettings):
        raise TypeError(f"settings must be a TrainSettings, got {type(settings).__name__}")
    check_bool(test, "test")
    s = settings
    torch.manual_seed(seed)
    npos = task.seq_len + 1 if s.npos is None else s.npos
    scheme = build_scheme(scheme_name, s.d_model // s.n_heads, s.n_heads, npos)
    model = TinyDecoder(task.vocab_size, d_model=s.d_model, n_heads=s.n_heads, n_layers=s.n_layers,
                        scheme=scheme)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        lr = s.lr * min(1.0, (step + 1) / max(s.warmup, 1)) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = make_batch(s.batch_size, gen, task)
        loss = F.cross_entropy(model(batch.tokens)[:, -1], batch.answer)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if s.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - start
    result = {
        "scheme": scheme_name,
        "seed": seed,
        "steps": steps,
        "train_seconds": seconds,
        "final_loss": sum(losses[-50:]) / len(losses[-50:]),
        "validation": accuracy(model, make_batch(s.eval_size, VALID_SEED, task), task.max_k),
        **(evaluate_test_splits(model, task, long_task, s.eval_size) if test else {}),
        "task": asdict(task),
        "long_task": asdict(long_task),
        "settings": asdict(s),
    }
    return (result, model) if return_model else result


def marker_gates(model: TinyDecoder, batch: CountingBatch, task: CountingTask = CountingTask()) -> list[dict[str, float]]:
    """What a CoPE model learned to count: per layer, the query's mean gate on markers and
    on noise.

    Runs ``model`` on ``batch`` and, in every layer, recomputes the gates
    :func:`companion.cope.cope_gates` of the last position (the query) from the queries and
    keys the layer's scheme sees. Returns one dict per layer, ``{"marker": mean gate over
    marker keys, "noise": mean gate over noise keys, "query": the query's own gate}``, each
    averaged over heads and the batch. ``model`` must use a :class:`~companion.cope.CoPE`
    scheme.
    """
    if not isinstance(model.scheme, CoPE):
        raise TypeError(f"model must use a CoPE scheme, got {type(model.scheme).__name__}")
    if not isinstance(batch, CountingBatch):
        raise TypeError(f"batch must be a CountingBatch, got {type(batch).__name__}")
    scheme = model.scheme
    seen: list[Tensor] = []
    original = scheme.score

    def recording(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        seen.append(cope_gates(q, k, q_pos, k_pos)[:, :, -1].detach())  # (batch, heads, k_len)
        return original(q, k, q_pos, k_pos)

    scheme.score = recording  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            model(batch.tokens)
    finally:
        del scheme.score
    marker = task.is_marker(batch.tokens)[:, None, :].expand_as(seen[0])
    noise = (batch.tokens < task.n_noise)[:, None, :].expand_as(seen[0])
    return [{"marker": float(g[marker].mean()), "noise": float(g[noise].mean()),
             "query": float(g[..., -1].mean())} for g in seen]


# ----------------------------------------------------------------------------- command line


def best_lr(runs: Sequence[dict[str, Any]]) -> float:
    """The learning rate whose runs have the highest mean *validation* accuracy (the smaller
    rate on a tie), among ``runs`` of one scheme: each a dict with ``settings["lr"]`` and
    ``validation["accuracy"]`` (:func:`train_and_eval`'s result). The test splits play no part.

    Raises:
        ValueError: no runs, or runs of more than one scheme.
        KeyError: a run without a validation accuracy (one stored before the split existed).
    """
    runs = list(runs)
    if not runs:
        raise ValueError("runs must hold at least one run")
    names = {r["scheme"] for r in runs}
    if len(names) > 1:
        raise ValueError(f"runs must be of one scheme, got {sorted(names)}")
    by_lr: dict[float, list[float]] = {}
    for r in runs:
        by_lr.setdefault(float(r["settings"]["lr"]), []).append(r["validation"]["accuracy"])
    return max(by_lr, key=lambda lr: (sum(by_lr[lr]) / len(by_lr[lr]), -lr))


def run_all(schemes: Sequence[str], seeds: Sequence[int], steps: int, *,
            lrs: Sequence[float] = LRS, task: CountingTask = CountingTask(),
            settings: TrainSettings = TrainSettings(),
            log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """:func:`train_and_eval` for every scheme, learning rate and seed, in that order
    (``settings.lr`` is replaced by each of ``lrs``), scored on the validation split only;
    then, per scheme, the test splits (:func:`evaluate_test_splits`) for the runs at the
    :func:`best_lr` of the scheme's runs, and, for CoPE, :func:`marker_gates` of those runs on
    200 sequences of the in-distribution test split. The runs at the other rates keep their
    validation accuracy only (no ``in_distribution`` or ``longer_gaps``)."""
    runs = []
    for name in schemes:
        trained = []
        for lr in lrs:
            for seed in seeds:
                res, model = train_and_eval(name, seed, steps, task=task, settings=replace(settings, lr=lr),
                                            test=False, return_model=True)
                trained.append((res, model))
                if log is not None:
                    log(f"{name} lr {lr:g} seed {seed}: validation {res['validation']['accuracy']:.3f} "
                        f"({res['train_seconds']:.1f} s)")
        chosen = best_lr([res for res, _ in trained])
        for res, model in trained:
            if res["settings"]["lr"] == chosen:
                res.update(evaluate_test_splits(model, task, None, settings.eval_size))
                if name == "cope":
                    res["gates"] = marker_gates(model, make_batch(200, EVAL_SEED, task), task)
                if log is not None:
                    log(f"{name} lr {chosen:g} (chosen) seed {res['seed']}: test in-distribution "
                        f"{res['in_distribution']['accuracy']:.3f}, longer gaps {res['longer_gaps']['accuracy']:.3f}")
            runs.append(res)
    return runs


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per scheme (in first-seen order): ``by_lr``, per learning rate (``repr(lr)`` keys) the
    seeds and the mean and minimum *validation* accuracy (``{"seeds", "valid_mean",
    "valid_min"}``); ``best_lr`` (:func:`best_lr`); and ``test``, the test splits at the best
    rate only: ``{"seeds", "in_mean", "in_min", "long_mean", "long_min"}`` over the runs that
    have them (empty when none has)."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["scheme"] for r in runs):
        mine = [r for r in runs if r["scheme"] == name]
        rows = {}
        for lr_key in dict.fromkeys(repr(r["settings"]["lr"]) for r in mine):
            vals = [r["validation"]["accuracy"] for r in mine if repr(r["settings"]["lr"]) == lr_key]
            rows[lr_key] = {"seeds": len(vals), "valid_mean": sum(vals) / len(vals), "valid_min": min(vals)}
        best = best_lr(mine)
        tested = [r for r in mine if float(r["settings"]["lr"]) == best and "in_distribution" in r]
        test = {}
        if tested:
            ins = [r["in_distribution"]["accuracy"] for r in tested]
            longs = [r["longer_gaps"]["accuracy"] for r in tested]
            test = {"seeds": len(tested), "in_mean": sum(ins) / len(ins), "in_min": min(ins),
                    "long_mean": sum(longs) / len(longs), "long_min": min(longs)}
        out[name] = {"by_lr": rows, "best_lr": best, "test": test}
    return out


def _check_flags(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Every flag of :func:`main`, before any work; a bad one is ``parser.error`` naming it."""
    check_run_flags(parser, ns)
    with usage_errors(parser, "--lrs"):
        for lr in ns.lrs:
            check_finite_number(lr, "lrs")
        check_distinct(ns.lrs, "lrs")
    with usage_errors(parser, "--long-steps"):
        check_positive_int(ns.long_steps, "long_steps", 0)
    with usage_errors(parser, "--long-schemes"):
        check_distinct(ns.long_schemes, "long_schemes")


def _block(schemes: Sequence[str], seeds: Sequence[int], steps: int, lrs: Sequence[float],
           log: Callable[[str], None]) -> dict[str, Any]:
    """One budget's runs, summary and time, as the command line stores them."""
    start = time.perf_counter()
    runs = run_all(schemes, seeds, steps, lrs=lrs, log=log)
    return {"steps": steps, "schemes": list(schemes), "seeds": list(seeds), "lrs": list(lrs),
            "total_seconds": time.perf_counter() - start, "summary": summarize(runs), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    """``python -m companion.lab.counting --out FILE [--schemes ...] [--seeds ...] [--lrs ...]
    [--steps N] [--long-steps N] [--long-schemes ...] [--threads T]``: run :func:`run_all`
    with ``--steps`` for ``--schemes``, then with ``--long-steps`` for ``--long-schemes``
    (unless ``--long-steps 0``), and store both with :func:`companion.utils.save_result`.

    The stored ``data`` holds the first budget at its top level (``steps``, ``schemes``,
    ``seeds``, ``lrs``, ``total_seconds``, ``summary``, ``runs``), the task, the longer-gap
    task, the settings and the seeds of the three splits (``splits``), and the second budget,
    in the same layout, as ``data["long"]`` (absent with ``--long-steps 0``). The defaults are
    the chapter's run: :data:`STEPS` steps for every scheme and :data:`LONG_STEPS` for RoPE
    and CoPE, the five :data:`SEEDS` and both :data:`LRS`.

    Every flag is checked before any training: a bad one (``--steps 0``, ``--threads 0``, a
    negative or repeated seed, a learning rate that is not a finite number > 0, a repeated
    scheme or rate, a negative ``--long-steps``, an ``--out`` that is an existing folder) is
    the parser's usage error (exit status 2) naming the flag."""
    p = argparse.ArgumentParser(prog="python -m companion.lab.counting", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result JSON path (required)")
    p.add_argument("--schemes", nargs="+", default=["cope", "rope", "nope", "alibi"], choices=list(SCHEMES),
                   help="position schemes to train (default: cope rope nope alibi)")
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS),
                   help=f"seeds of every scheme (default: {' '.join(map(str, SEEDS))})")
    p.add_argument("--lrs", nargs="+", type=float, default=list(LRS),
                   help=f"peak learning rates, each a separate run, chosen on the validation split "
                        f"(default: {' '.join(f'{lr:g}' for lr in LRS)})")
    p.add_argument("--steps", type=int, default=STEPS, help=f"training steps per run (default: {STEPS})")
    p.add_argument("--long-steps", type=int, default=LONG_STEPS,
                   help=f"training steps of the second, longer budget; 0 skips it (default: {LONG_STEPS})")
    p.add_argument("--long-schemes", nargs="+", default=["cope", "rope"], choices=list(SCHEMES),
                   help="schemes trained with the longer budget (default: cope rope)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    ns = p.parse_args(argv)
    _check_flags(p, ns)
    torch.set_num_threads(ns.threads)
    argv_list = sys.argv[1:] if argv is None else list(argv)
    data: dict[str, Any] = {"task": asdict(CountingTask()), "long_task": asdict(CountingTask().longer()),
                            "settings": asdict(TrainSettings()), "threads": ns.threads,
                            "splits": {"validation": VALID_SEED, "in_distribution": EVAL_SEED,
                                       "longer_gaps": LONG_EVAL_SEED}}
    data.update(_block(ns.schemes, ns.seeds, ns.steps, ns.lrs, lambda line: print(line, flush=True)))
    if ns.long_steps:
        data["long"] = _block(ns.long_schemes, ns.seeds, ns.long_steps, ns.lrs,
                              lambda line: print(f"{ns.long_steps} steps: {line}", flush=True))
    command = "python -m companion.lab.counting " + " ".join(shlex.quote(a) for a in argv_list)
    print(save_result(ns.out, data, command=command))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
