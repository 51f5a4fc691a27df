"""Appendix B's guide to choosing a position encoding, computed from the chapters' stored results.

The appendix puts the chapters' measurements side by side, one table per use case, and ends with
rules of thumb checked on the stored data. This module computes all of it from the files in
``chapters/data/`` (:func:`load_stored`); nothing is trained or timed again. Each function of a
section returns a :class:`Section`: its Markdown tables (each a :class:`Table` of at most seven
columns, a wider one split in two that both keep the label column), the lines the page prints
that no table holds, the numbers its prose quotes (by their glue name) and the named checks the
page asserts (a check that fails says the stored files disagree with one another or with a
claim).

The sections, in the appendix's order: :func:`provenance`, :func:`models`,
:func:`encoder_table` (a fixed-length encoder), :func:`decoder_table` (a decoder trained from
scratch to run longer), :func:`extension_lab_table` and :func:`extension_smol_table` (extending a
RoPE model), :func:`smol_passkey`, :func:`streaming_lab_table` and
:func:`streaming_smol_table` (streaming input), :func:`grid_table` (2-D input),
:func:`kernel_table` and :func:`rules_of_thumb`. The building blocks are public too:
:func:`lab_sweeps` (chapters 8 and 11's sweeps, seed by seed, with the intervals of
:meth:`LabSweeps.gap`, :meth:`LabSweeps.rise` and :meth:`LabSweeps.far_rate`), :func:`verdict`
(chapter 8's flat, between or breaks), :func:`geometric_mean` and :func:`chapter_link`.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .. import kernels
from .._checks import check_choice, check_finite_number, check_path
from ..dispatch import attention_path
from ..grid import grid_positions
from ..longctx import method_config as smol_method_config
from ..longctx import summarize, trainfree_reach
from ..longctx_docs import context_value
from ..recipe import base_lower_bound, longest_context
from ..scaling import llama_cpp_rope_args
from ..trainfree import ReRoPE, SelfExtend, max_relative_position
from ..utils import load_csv, load_result, shown_command
from . import grid_task
from .evaluate import TAIL
from .extend import METHOD_LABELS, method_config
from .results import Extension, Sweep, difference, load_bases, merge_extensions, merge_sweeps
from .stats import bootstrap_ci, proportion_ci
from .schemes import build_scheme, scheme_label

__all__ = ["STORED_JSON", "STORED_CSV", "STORED_PARTS", "FIRST_PROTOCOL", "FIRST_BASELINES", "CHAPTER_PAGES",
           "FLAT_BITS", "BREAK_BITS", "TRAINFREE_LABELS",
           "Stored", "Table", "Section", "LabSweeps", "load_stored", "chapter_link",
           "verdict", "geometric_mean",
           "lab_sweeps", "provenance", "models", "encoder_table", "decoder_table", "extension_lab_table",
           "extension_smol_table", "smol_passkey", "streaming_lab_table", "streaming_smol_table", "grid_table",
           "kernel_table", "rules_of_thumb"]

#: The JSON results the guide reads from ``chapters/data/``, by file stem. ``11_sweep`` and
#: ``11_baselines`` are chapter 11's first-protocol runs (:data:`FIRST_PROTOCOL`).
STORED_JSON = ("04_relative_cpu", "06_bias_attention_cpu", "10_ppl", "10_llamacpp", "11_sweep", "11_baselines",
               "11_trainfree_ppl", "12_grid", "lab_train_cpu", "llama_cpu", "rope_cpu")
#: The CSV results it reads, by file stem.
STORED_CSV = ("10_context", "10_ppl", "10_passkey", "11_trainfree_ppl")
#: The folders of results stored in parts, one command per part. They hold chapter 8's sweep,
#: chapter 9's extension run, chapter 11's sweep and its training-free run. Every JSON and CSV
#: in them is read, under ``folder/stem``.
STORED_PARTS = ("08_sweep", "09_extension", "11_sweep", "11_trainfree_lab")
#: Chapter 11's schemes that were run only with the first protocol (2 seeds, 32,768 scored
#: bytes per length), beside that protocol's runs of chapter 8's baselines (``11_baselines``).
FIRST_PROTOCOL = ("kerple-power", "fire", "xpos", "cope")
#: The baselines of the first protocol the guide shows beside them.
FIRST_BASELINES = ("alibi", "nope", "rope")
#: Chapter 13's stored runs (a subfolder of the data folder): the base sweep, ABF, and the
#: local/global layer patterns.
RECIPE_DIR = "13_recipe"
#: Which inference engines run which schemes, checked against the engines' sources (a plain
#: JSON file in the data folder, with one source per cell).
ENGINE_SUPPORT = "appendix_engine_support.json"
#: A GPU benchmark of chapter 7's kernels; the guide says whether the folder holds one.
GPU_BENCHMARK = "07_gpu_benchmarks.json"

#: The chapters' notebooks, by number, for the links of the "backed by" columns.
CHAPTER_PAGES = {2: "02_sinusoidal", 3: "03_learned", 4: "04_relative", 5: "05_rope", 6: "06_alibi",
                 7: "07_kernels", 8: "08_extrapolation", 9: "09_rope_scaling", 10: "10_pretrained_llm",
                 11: "11_newer_encodings", 12: "12_grids"}
#: Where the chapters' pages are, seen from the appendix (``book/``).
PAGE_BASE = "../chapters"

#: Chapter 8's threshold of a *flat* scheme, in bits per byte: no seed rises this much above
#: its loss at the training length, at any length (see :func:`verdict`).
FLAT_BITS = 0.5
#: Chapter 8's threshold of a scheme that *breaks*, in bits per byte: every seed is more than
#: this much worse at the longest length than at the training length (see :func:`verdict`).
BREAK_BITS = 2.0

#: Chapter 11's training-free configurations on the lab model, with their labels.
TRAINFREE_LABELS = {"rerope": "ReRoPE", "leaky_rerope": "Leaky ReRoPE", "self_extend": "Self-Extend",
                    "sinks": "sinks + window", "window_only": "window, no sinks",
                    "sinks_no_rerotate": "sinks, no re-rotation"}

# The lab benchmark's name of a lab scheme where they differ: the lab's sinusoidal is the
# scaled table.
_BENCH_NAME = {"sinusoidal": "scaled_sinusoidal"}
# Chapter 4's names of the relative schemes in its per-layer benchmark.
_CORE_NAME = {"shaw": "Shaw", "xl": "Transformer-XL", "t5": "T5 bias"}
_HALVES = ("first_half", "second_half", "last")


# ------------------------------------------------------------------------------------------------
# the stored results, and the section a function returns
# ------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Stored:
    """The stored results the guide reads, as :func:`load_stored` returns them.

    Attributes:
        data_dir: the folder they were read from (``chapters/data/``), a ``pathlib.Path``.
        results: each JSON result's payload (``provenance`` and ``data``), by file stem.
        tables: each CSV result as ``(provenance, rows)``, by file stem.
    """

    data_dir: Any  # a pathlib.Path (Any: the API page cannot link pathlib offline)
    results: dict[str, dict[str, Any]]
    tables: dict[str, tuple[dict[str, Any], list[dict[str, str]]]]
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    def data(self, name: str) -> Any:
        """The ``data`` of the JSON result ``name`` (a file stem of :data:`STORED_JSON`, or
        ``folder/stem`` of a part, :meth:`parts`).

        Raises:
            ValueError: no JSON result of that name was loaded.
        """
        if name not in self.results:
            raise ValueError(f"name must be one of the stored JSON results {sorted(self.results)}, got {name!r}")
        return self.results[name]["data"]

    def parts(self, folder: str) -> list[str]:
        """The names (``folder/stem``) of the results stored in parts in ``folder`` (one of
        :data:`STORED_PARTS`), sorted: each a key of ``results`` (and of ``tables`` where the
        part has a CSV).

        Raises:
            ValueError: ``folder`` holds no loaded result.
        """
        names = sorted({n for n in (*self.results, *self.tables) if n.startswith(f"{folder}/")})
        if not names:
            raise ValueError(f"folder must be one of the folders of parts {list(STORED_PARTS)} that were loaded, "
                             f"got {folder!r}")
        return names

    def rows(self, name: str) -> list[dict[str, str]]:
        """The rows of the CSV result ``name`` (a file stem of :data:`STORED_CSV`, or
        ``folder/stem`` of a part).

        Raises:
            ValueError: no CSV result of that name was loaded.
        """
        if name not in self.tables:
            raise ValueError(f"name must be one of the stored CSV results {sorted(self.tables)}, got {name!r}")
        return self.tables[name][1]


@dataclass(frozen=True)
class Table:
    """One Markdown table of a section.

    Attributes:
        header: the column headings, the label column first.
        rows: the rows, one cell per heading.

    Raises:
        ValueError: the header is empty, or a row has not one cell per heading.
    """

    header: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.header:
            raise ValueError("header must name at least one column, got none")
        bad = [i for i, row in enumerate(self.rows) if len(row) != len(self.header)]
        if bad:
            raise ValueError(f"every row must have one cell per heading ({len(self.header)}); rows {bad} do not")

    def markdown(self) -> str:
        """The table as Markdown: the header, a rule, then one line per row."""
        lines = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class Section:
    """What one section of the guide shows.

    Attributes:
        lines: the lines printed under the cell, in order: sentences that no table holds (the
            page wraps the long ones), never a copy of a table.
        facts: the values its prose quotes, by glue name.
        checks: the claims the page asserts, by name: ``True`` where the stored data bear it out.
        tables: its Markdown tables, in the page's order, by the glue name the page shows each
            under (empty when the section has no table).
    """

    lines: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    tables: dict[str, Table] = field(default_factory=dict)

    @property
    def failed(self) -> list[str]:
        """The names of the checks that do not hold (empty when all hold)."""
        return [name for name, ok in self.checks.items() if not ok]

    def markdown(self, name: str) -> str:
        """The table ``name`` as Markdown (:meth:`Table.markdown`).

        Raises:
            ValueError: the section has no table of that name.
        """
        if name not in self.tables:
            raise ValueError(f"name must be one of this section's tables {list(self.tables)}, got {name!r}")
        return self.tables[name].markdown()


def _split(header: list[str], rows: list[list[str]], parts: Mapping[str, Sequence[int]]) -> dict[str, Table]:
    """One wide table as several, by glue name: each part keeps the label column (column 0) and
    the columns listed for it, in that order; every other column goes to exactly one part."""
    used = sorted(i for cols in parts.values() for i in cols)
    if used != list(range(1, len(header))):
        raise ValueError(f"the parts must share out the columns 1 to {len(header) - 1} once each, got {used}")
    return {name: Table([header[0]] + [header[i] for i in cols], [[row[0]] + [row[i] for i in cols] for row in rows])
            for name, cols in parts.items()}


def load_stored(data_dir: str | Path) -> Stored:
    """Read every result the guide needs (:data:`STORED_JSON`, :data:`STORED_CSV` and the parts in
    :data:`STORED_PARTS`) from ``data_dir``.

    Args:
        data_dir: the folder of the stored results, ``chapters/data/``.

    Returns:
        A :class:`Stored` holding them.

    Raises:
        TypeError: ``data_dir`` is not a ``str`` or ``os.PathLike``.
        NotADirectoryError: ``data_dir`` is not a folder.
        FileNotFoundError: a result is missing from it, or a folder of parts is missing or
            empty (the message names the file or folder).
        ValueError: a file is not a result file (:func:`companion.utils.load_result`,
            :func:`companion.utils.load_csv`).
    """
    folder = check_path(data_dir, "data_dir")
    if not folder.is_dir():
        raise NotADirectoryError(f"data_dir {folder} is not a folder; pass the folder of the stored results "
                                 f"(chapters/data)")
    results = {name: load_result(folder / f"{name}.json") for name in STORED_JSON}
    tables = {name: load_csv(folder / f"{name}.csv") for name in STORED_CSV}
    for sub in STORED_PARTS:
        where = folder / sub
        files = sorted(where.glob("*.json")) if where.is_dir() else []
        if not files:
            raise FileNotFoundError(f"{where} holds no stored parts (.json); the guide reads every part in it")
        results.update({f"{sub}/{f.stem}": load_result(f) for f in files})
        tables.update({f"{sub}/{f.stem}": load_csv(f) for f in sorted(where.glob("*.csv"))})
    return Stored(folder, results, tables)


def _check_stored(stored: object) -> Stored:
    if not isinstance(stored, Stored):
        raise TypeError(f"stored must be the Stored that load_stored returns, got {type(stored).__name__}")
    return stored


def _memo(stored: Stored, key: str, build: Callable[[], Any]) -> Any:
    """``build()``, computed once per :class:`Stored`."""
    if key not in stored._memo:
        stored._memo[key] = build()
    return stored._memo[key]


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------


def chapter_link(chapter: int, where: str = "") -> str:
    """A Markdown link to a chapter, with the section whose figure or table backs a row.

    Args:
        chapter: the chapter's number, a key of :data:`CHAPTER_PAGES`.
        where: the section (Markdown), or ``""`` for the link alone.

    Returns:
        ``"[ch. 8](../chapters/08_extrapolation.ipynb), *The result*"``, say.

    Raises:
        ValueError: ``chapter`` is not one of :data:`CHAPTER_PAGES`.
        TypeError: ``where`` is not a string.
    """
    check_choice(chapter, "chapter", list(CHAPTER_PAGES))
    if not isinstance(where, str):
        raise TypeError(f"where must be a str (the section, or '' for none), got {type(where).__name__}")
    link = f"[ch. {chapter}]({PAGE_BASE}/{CHAPTER_PAGES[chapter]}.ipynb)"
    return f"{link}, {where}" if where else link


def _f2(x: float) -> str:
    """Two decimals, without a minus sign on a rounded zero."""
    s = f"{x:.2f}"
    return "0.00" if s == "-0.00" else s


def _listing(names: Any) -> str:
    """A, B and C."""
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _span(v: np.ndarray) -> str:
    """Mean and range over seeds."""
    return f"{_f2(v.mean())} [{_f2(v.min())} to {_f2(v.max())}]"


def _seed_array(value: object, name: str) -> np.ndarray:
    """A finite 2-D ``(seeds, lengths)`` float array, or ``ValueError``/``TypeError`` naming ``name``."""
    try:
        arr = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an array of numbers, (seeds, lengths), got {type(value).__name__}") from None
    if arr.ndim != 2 or 0 in arr.shape:
        raise ValueError(f"{name} must be a non-empty 2-D array (seeds, lengths), got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} must hold finite bits per byte, got a nan or inf")
    return arr


def verdict(tail: Any, multiples: Sequence[int], flat_bits: float = FLAT_BITS,
            break_bits: float = BREAK_BITS) -> str:
    """Chapter 8's verdict on one scheme: ``"flat"``, ``"breaks"`` or ``"between"``.

    With ``rise = tail - tail[:, [i1]]``, each seed's loss over its own loss at the training
    length (multiple 1): *flat* when ``rise.max() < flat_bits`` (no seed rises that much at any
    length), *breaks* when ``rise[:, -1].min() > break_bits`` (every seed is that much worse at
    the longest length), *between* otherwise.

    Args:
        tail: bits per byte, ``(seeds, lengths)``.
        multiples: the evaluation lengths over the training length, one per column; must hold 1.
        flat_bits: the threshold of *flat* (bits per byte, > 0).
        break_bits: the threshold of *breaks* (bits per byte, > 0).

    Returns:
        The verdict.

    Raises:
        TypeError: ``tail`` is not numeric, or a threshold not a number.
        ValueError: ``tail`` not a finite non-empty 2-D array, ``multiples`` without 1 or not
            one per column, a threshold not positive.
    """
    tail = _seed_array(tail, "tail")
    multiples = list(multiples)
    if len(multiples) != tail.shape[1]:
        raise ValueError(f"multiples must have one entry per column of tail ({tail.shape[1]}), got {len(multiples)}")
    if 1 not in multiples:
        raise ValueError(f"multiples must hold 1 (the training length), got {multiples}")
    flat_bits = check_finite_number(flat_bits, "flat_bits")
    break_bits = check_finite_number(break_bits, "break_bits")
    rise = tail - tail[:, [multiples.index(1)]]
    if rise.max() < flat_bits:
        return "flat"
    return "breaks" if rise[:, -1].min() > break_bits else "between"


def _sink_reach(settings: Mapping[str, Any], length: int) -> int:
    """The largest position RoPE sees in a pass of ``length`` with a sink cache's stored
    settings, by :func:`companion.longctx.trainfree_reach` (the rule chapters 10 and 11 use)."""
    config = {"method": "sinks", **{k: settings[k] for k in ("n_sink", "window", "chunk")},
              "rerotate": settings.get("rerotate", True)}
    return int(trainfree_reach(config, length))


def geometric_mean(values: Sequence[float]) -> float:
    """``exp(mean(log v))`` of positive numbers (perplexities over windows, say).

    Raises:
        TypeError: ``values`` is not a sequence of numbers.
        ValueError: it is empty, or holds a number that is not finite and positive.
    """
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"values must be a sequence of positive numbers, got {type(values).__name__}")
    if len(values) == 0:
        raise ValueError("values must hold at least one number, got none")
    logs = [math.log(check_finite_number(v, f"values[{i}]")) for i, v in enumerate(values)]
    return math.exp(np.mean(logs))


# ------------------------------------------------------------------------------------------------
# the lab's sweeps and benchmarks
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LabSweeps:
    """Chapter 8's and chapter 11's sweeps, one protocol, seed by seed (:func:`lab_sweeps`).

    Everything but the chapters' scheme lists and the recipe check is read from ``sweep``:
    ``eval_config``, ``train_len``, ``multiples`` and ``lengths`` as it holds them, and, per
    scheme, ``seeds`` (sorted; 3 to 5, the schemes have different numbers), ``tail`` (tail
    bits per byte, ``(seeds, lengths)``), ``mean`` (``tail`` averaged over its seeds) and
    ``far_trials`` (the passkey trials of the key farthest back at the longest length,
    ``(seeds, trials)``, 1 where the key was copied exactly).

    Attributes:
        sweep: the merged parts (a :class:`~companion.lab.results.Sweep`).
        schemes8: chapter 8's schemes, in stored order.
        schemes11: chapter 11's schemes, in stored order.
        checks: whether chapter 11's sweep used chapter 8's training recipe.
    """

    sweep: Any
    schemes8: list[str]
    schemes11: list[str]
    checks: dict[str, bool]

    @property
    def config(self) -> dict[str, Any]:
        """The training config of chapter 8's first run (the recipe every run shares)."""
        return self.sweep.data["runs"][0]["config"]

    @property
    def eval_config(self) -> dict[str, Any]:
        """The evaluation config every part shares."""
        return self.sweep.eval_config

    @property
    def train_len(self) -> int:
        """The training length, in bytes."""
        return self.sweep.train_len

    @property
    def multiples(self) -> list[int]:
        """The evaluation lengths over the training length."""
        return self.sweep.multiples

    @property
    def lengths(self) -> list[int]:
        """The evaluation lengths, in bytes."""
        return self.sweep.lengths

    @cached_property
    def seeds(self) -> dict[str, list[int]]:
        """Per scheme, its seeds, sorted."""
        return {s: self.sweep.seeds(s) for s in self.schemes}

    @cached_property
    def tail(self) -> dict[str, Any]:
        """Per scheme, tail bits per byte, ``(seeds, lengths)``."""
        return {s: self.sweep.curve(s, "tail") for s in self.schemes}

    @cached_property
    def mean(self) -> dict[str, Any]:
        """Per scheme, ``tail`` averaged over its seeds."""
        return {s: t.mean(0) for s, t in self.tail.items()}

    @cached_property
    def far_trials(self) -> dict[str, Any]:
        """Per scheme, ``(seeds, trials)``: 1 where the key farthest back was copied exactly at
        the longest length."""
        sw = self.sweep
        i_far, j_last = sw.depths.index(min(sw.depths)), sw.passkey_lengths.index(sw.lengths[-1])
        return {s: sw.passkey(s, "exact_trials")[:, j_last, i_far] for s in self.schemes}

    @property
    def schemes(self) -> list[str]:
        """Chapter 8's schemes, then chapter 11's."""
        return self.schemes8 + self.schemes11

    @property
    def i1(self) -> int:
        """The column of the training length."""
        return self.multiples.index(1)

    @property
    def i_last(self) -> int:
        """The column of the longest length."""
        return len(self.multiples) - 1

    def _length(self, multiple: int | None) -> int:
        m = self.multiples[-1] if multiple is None else multiple
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m not in self.multiples:
            raise ValueError(f"multiple must be one of {self.multiples}, got {multiple!r}")
        return m * self.train_len

    def gap(self, a: str, b: str, multiple: int | None = None) -> Any:
        """The 95% interval of ``mean(a) - mean(b)`` at ``multiple`` times the training length
        (default the longest), over the scored blocks of the seed means
        (:func:`companion.lab.results.difference`): an :class:`~companion.lab.stats.Interval`.

        Raises:
            ValueError: a scheme not in the sweeps, or a multiple not evaluated.
        """
        w = self._length(multiple)
        return difference(self.sweep.blocks(a, "tail", w), self.sweep.blocks(b, "tail", w))

    def rise(self, scheme: str, multiple: int | None = None) -> Any:
        """The 95% interval of a scheme's rise from the training length to ``multiple`` times it
        (default the longest), on the same bytes (an :class:`~companion.lab.stats.Interval`).

        Raises:
            ValueError: a scheme not in the sweeps, or a multiple not evaluated.
        """
        blocks = self.sweep.blocks(scheme, "tail", self._length(multiple))
        return difference(blocks, self.sweep.blocks(scheme, "tail", self.train_len))

    def far_rate(self, scheme: str) -> Any:
        """The Wilson 95% interval of the share of the farthest keys copied exactly at the
        longest length, its trials pooled over the seeds
        (:func:`companion.lab.stats.proportion_ci`).

        Raises:
            ValueError: a scheme not in the sweeps.
        """
        if scheme not in self.far_trials:
            raise ValueError(f"scheme must be one of {self.schemes}, got {scheme!r}")
        t = self.far_trials[scheme]
        return proportion_ci(int(t.sum()), int(t.size))


def lab_sweeps(stored: Stored) -> LabSweeps:
    """Chapters 8 and 11's sweeps (the parts in ``08_sweep/`` and ``11_sweep/``), seed by seed.

    The parts are merged by :func:`companion.lab.results.merge_sweeps`, which requires one
    evaluation config and one corpus.

    Args:
        stored: the stored results (:func:`load_stored`).

    Returns:
        A :class:`LabSweeps`.

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        ValueError: a folder without parts, parts that do not share one protocol or hold one
            run twice (:func:`~companion.lab.results.merge_sweeps`), a scheme in both chapters'
            sweeps, or a passkey test that did not reach the longest length.
    """
    _check_stored(stored)
    return _memo(stored, "lab", lambda: _lab_sweeps(stored))


def _lab_sweeps(stored: Stored) -> LabSweeps:
    parts8, parts11 = stored.parts("08_sweep"), stored.parts("11_sweep")
    sweep = Sweep(merge_sweeps([stored.results[n] for n in parts8 + parts11], names=parts8 + parts11))

    def schemes_of(parts: list[str]) -> list[str]:
        return list(dict.fromkeys(r["config"]["scheme"] for n in parts for r in stored.data(n)["runs"]))

    schemes8, schemes11 = schemes_of(parts8), schemes_of(parts11)
    both = sorted(set(schemes8) & set(schemes11))
    if both:
        raise ValueError(f"the schemes {both} are in both chapter 8's and chapter 11's sweeps; one run each is read")
    cfg = stored.data(parts8[0])["runs"][0]["config"]
    recipe = {k: v for k, v in cfg.items() if k not in ("scheme", "seed")}
    checks = {"chapter 11's sweep trained with chapter 8's recipe":
              all({k: r["config"].get(k) for k in recipe} == recipe for n in parts11 for r in stored.data(n)["runs"])}
    if sweep.lengths[-1] not in sweep.passkey_lengths:
        raise ValueError(f"the passkey test must reach the longest length {sweep.lengths[-1]}, "
                         f"its lengths are {sweep.passkey_lengths}")
    return LabSweeps(sweep, schemes8, schemes11, checks)


def _first_protocol(stored: Stored) -> SimpleNamespace:
    """Chapter 11's first-protocol runs: :data:`FIRST_PROTOCOL` and :data:`FIRST_BASELINES`, their
    ``seeds``, ``multiples``, ``tail`` (per scheme, ``(seeds, lengths)``), ``mean``, ``tokens``
    (scored bytes per length) and ``checks`` (one protocol, one recipe, one set of seeds)."""
    def build() -> SimpleNamespace:
        new, base = Sweep(stored.data("11_sweep")), Sweep(stored.data("11_baselines"))
        missing = [s for s in FIRST_PROTOCOL if s not in new.schemes] + [
            s for s in FIRST_BASELINES if s not in base.schemes]
        if missing:
            raise ValueError(f"the first-protocol runs lack the schemes {missing}")
        cfg_new, cfg_base = new.data["runs"][0]["config"], base.data["runs"][0]["config"]
        same = [k for k in cfg_base if k not in ("scheme", "seed")]
        checks = {"first protocol: one evaluation for both files": new.eval_config == base.eval_config,
                  "first protocol: one recipe for both files": all(cfg_new.get(k) == cfg_base[k] for k in same)}
        tail = {s: (new if s in FIRST_PROTOCOL else base).curve(s, "tail") for s in FIRST_PROTOCOL + FIRST_BASELINES}
        seeds = sorted({sd for s in FIRST_PROTOCOL for sd in new.seeds(s)})
        checks["first protocol: every scheme has the same seeds"] = all(
            (new if s in FIRST_PROTOCOL else base).seeds(s) == seeds for s in FIRST_PROTOCOL + FIRST_BASELINES)
        return SimpleNamespace(seeds=seeds, multiples=list(new.multiples), tail=tail,
                               mean={s: t.mean(0) for s, t in tail.items()},
                               tokens=new.eval_config.get("tokens"), checks=checks)
    return _memo(stored, "first", build)


def _bench(stored: Stored) -> SimpleNamespace:
    """The lab model's training benchmark (``seq_len``; ``speed(scheme)``, its record on the
    dispatcher's path) and chapter 4's per-layer benchmark at the same length (``core``)."""
    train = stored.data("lab_train_cpu")
    length = train["seq_len"]
    records = {r["scheme"]: r for r in train["results"] if r["attention_impl"] == "auto"}

    def speed(s: str) -> dict[str, Any]:
        name = _BENCH_NAME.get(s, s)
        if name not in records:
            raise ValueError(f"scheme {s!r} was not benchmarked; the benchmark holds {sorted(records)}")
        return records[name]

    def measured(s: str) -> bool:
        return _BENCH_NAME.get(s, s) in records

    core = {r["scheme"]: r for r in stored.data("04_relative_cpu")["layer"] if r["L"] == length}
    return SimpleNamespace(seq_len=length, speed=speed, measured=measured, core=core)


def _lab_scheme(lab: LabSweeps, s: str) -> Any:
    cfg = lab.config
    return build_scheme(s, d_model=cfg["d_model"], n_heads=cfg["n_heads"], max_len=cfg["max_len"],
                        train_len=lab.train_len)


def _schemes(stored: Stored) -> SimpleNamespace:
    """Each lab scheme's attention ``path`` at the benchmark's length, and its ``hooks`` (the
    sweeps' schemes and :data:`FIRST_PROTOCOL`)."""
    def build() -> SimpleNamespace:
        lab, length = lab_sweeps(stored), _bench(stored).seq_len
        cfg = lab.config
        q = torch.zeros(1, cfg["n_heads"], length, cfg["d_model"] // cfg["n_heads"])
        built = {s: _lab_scheme(lab, s) for s in lab.schemes + list(FIRST_PROTOCOL)}
        return SimpleNamespace(path={s: attention_path(q, q, q, sch, causal=True) for s, sch in built.items()},
                               hooks={s: ",".join(sch.hooks()) for s, sch in built.items()})
    return _memo(stored, "schemes", build)


# ------------------------------------------------------------------------------------------------
# the sections
# ------------------------------------------------------------------------------------------------


def provenance(stored: Stored) -> Section:
    """The stored results with the command that wrote each
    (:func:`companion.utils.shown_command`), its date,
    CPU and torch version: one line per command (a CSV and the JSON its command wrote beside
    it share the line, ``name.csv + .json``).

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
    """
    _check_stored(stored)
    prov = {(n, "json"): r["provenance"] for n, r in stored.results.items()}
    prov.update({(n, "csv"): t[0] for n, t in stored.tables.items()})
    for name in ("bases", "abf", "hybrids"):   # chapter 13's runs (recipe_rules)
        path = stored.data_dir / RECIPE_DIR / f"{name}.json"
        if path.is_file():
            prov[f"{RECIPE_DIR}/{name}", "json"] = load_result(path)["provenance"]

    def paired(stem: str) -> bool:   # a CSV whose command also wrote the JSON beside it
        return {(stem, "csv"), (stem, "json")} <= set(prov) and \
            prov[stem, "csv"].get("command") == prov[stem, "json"].get("command")

    lines = []
    for stem, ext in sorted(prov):
        if ext == "json" and paired(stem):
            continue   # shown on its CSV's line
        p = prov[stem, ext]
        cpu = p.get("cpu_model") or p["machine"]
        shown = f"{stem}.{ext}" + (" + .json" if paired(stem) else "")
        lines.append(f"{shown}: {shown_command(p['command'])} ({p['date_utc'][:10]}, {cpu}, torch {p['torch']})")
    return Section(lines)


def models(stored: Stored) -> Section:
    """The lab model and its training, as the sweeps stored them, and the pretrained model.

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        ValueError: as :func:`lab_sweeps`.
    """
    lab = lab_sweeps(_check_stored(stored))
    first = _first_protocol(stored)
    cfg, mult, evc = lab.config, lab.multiples, lab.eval_config
    params = lab.sweep.runs["nope", lab.seeds["nope"][0]]["parameters"]
    counts = sorted({len(v) for v in lab.seeds.values()})
    n_seeds = f"{counts[0]} to {counts[-1]}" if len(counts) > 1 else f"{counts[0]}"
    tokens = evc["windows"] * TAIL
    line = (f"lab model: {cfg['n_layers']} layers of width {cfg['d_model']}, {cfg['n_heads']} heads, "
            f"{params:,} parameters without a position scheme; trained for {cfg['steps']} "
            f"steps at {lab.train_len} bytes, batch {cfg['batch_size']}, {n_seeds} seeds per scheme; "
            f"evaluated at " + ", ".join(f"{m}x" for m in mult) + f" on {evc['windows']:,} windows "
            f"({tokens:,} scored bytes per length, in {evc['blocks']} blocks); loss on the last {TAIL} positions")
    facts = {"tail": TAIL, "lab_params": f"{params:,}", "lab_len": lab.train_len, "lab_seeds": n_seeds,
             "lab_tokens": f"{tokens:,}", "lab_blocks": evc["blocks"], "lab_trials": evc["passkey_trials"],
             "first_seeds": len(first.seeds), "first_tokens": f"{first.tokens:,}",
             "mult_lo": f"{mult[0]}x", "mult_hi": f"{mult[-1]}x",
             "smol_model": stored.data("10_llamacpp")["model"].split(".")[0]}
    return Section([line], facts, {**lab.checks, **first.checks})


#: What loads into each scheme of the lab (the encoder table's checkpoints column).
_CHECKPOINTS = {
    "nope": "nothing to load",
    "sinusoidal": "the table of HuggingFace's `create_sinusoidal_embeddings` (DistilBERT, XLM) "
                  + chapter_link(2),
    "learned": "BERT-style tables load row by row; RoBERTa, XLM-R and OPT keep offset rows to drop; no row "
               "past the table " + chapter_link(3, "*Tables with an offset*"),
    "shaw": "none shown in the book",
    "xl": "none shown in the book",
    "t5": "T5's bucket function, its float32 truncation included " + chapter_link(4),
    "rope": "HuggingFace's half-split and Meta's or GGUF's interleaved layouts are one rotation up to a "
            "permutation of rows " + chapter_link(5, "*Proofs*") + "; "
            + chapter_link(10, "*Perplexity, and the layout pitfall*"),
    "alibi": "the symmetric form of MosaicBERT and Jina-BERT v2, which cannot tell a text from its reverse "
             + chapter_link(6, "*ALiBi in encoders*"),
}


def encoder_table(stored: Stored) -> Section:
    """A short fixed-length encoder: chapter 8's schemes at their training length, with costs.

    One table, ``table_encoder``; each row: the loss at the training length (mean over seeds),
    the parameters the scheme adds to the lab model, its training speed against NoPE and
    attention path (the lab's CPU benchmark), chapter 4's per-layer cost for the relative
    schemes, and what checkpoints load. Sorted by the loss. Nothing is printed. The check: each
    scheme was benchmarked on the path the dispatcher names.

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        ValueError: as :func:`lab_sweeps`, or a scheme missing from the benchmark or without a
            checkpoints entry.
    """
    lab = lab_sweeps(_check_stored(stored))
    bench, path = _bench(stored), _schemes(stored).path
    i1 = lab.i1
    runs = lab.sweep.runs
    unknown = [s for s in lab.schemes8 if s not in _CHECKPOINTS]
    if unknown:
        raise ValueError(f"no checkpoints entry for the schemes {unknown}; the guide knows {list(_CHECKPOINTS)}")
    checks = {f"{s} benchmarked on the dispatcher's path": bench.speed(s)["path"] == path[s] for s in lab.schemes8}
    params_nope = runs["nope", lab.seeds["nope"][0]]["parameters"]
    rows = []
    for s in sorted(lab.schemes8, key=lambda s: lab.mean[s][i1]):
        b = bench.speed(s)
        extra = runs[s, lab.seeds[s][0]]["parameters"] - params_nope
        backed = chapter_link(8, "*The result: bits per byte against length* (table and figure)")
        if s in _CORE_NAME:
            c = bench.core[_CORE_NAME[s]]
            layer = f"{c['forward_ratio_to_nope']:.2f}x time, {c['peak_bytes_ratio_to_nope']:.2f}x memory"
            backed += "; " + chapter_link(4, "*Cost per layer*")
        elif s in ("learned", "sinusoidal"):
            layer = "as NoPE: it acts on the embeddings"
        else:
            layer = "the baseline" if s == "nope" else "not measured"
        mean1 = f"{_f2(lab.mean[s][i1])} ({len(lab.seeds[s])} seeds)"
        rows.append([scheme_label(s), mean1, f"{extra:,}", f"{b['ratio_to_nope']:.2f}x (`{b['path']}`)", layer,
                     _CHECKPOINTS[s], backed])
    header = ["option", f"loss at the training length (bits/byte, L = {lab.train_len}), seed mean",
              "extra parameters (lab model)", f"training tokens/s vs NoPE (L = {bench.seq_len}), path",
              f"one attention layer vs NoPE (L = {bench.seq_len})", "checkpoints", "backed by"]
    facts = {"enc_learned_rows": f"{runs['learned', lab.seeds['learned'][0]]['config']['max_len']:,}",
             "bench_len": bench.seq_len}
    return Section([], facts, checks, {"table_encoder": Table(header, rows)})


def decoder_table(stored: Stored) -> Section:
    """A long-context decoder trained from scratch: chapters 8 and 11's schemes at every length.

    Three tables. ``table_decoder_loss`` and ``table_decoder_cost`` have the same rows in the
    same order (sorted by the loss at the longest length): the first the mean loss at each
    multiple of the training length and chapter 8's :func:`verdict` with the rise to the
    longest length (its 95% interval over the blocks, :meth:`LabSweeps.rise`); the second the
    seeds, the share of farthest keys copied exactly at the longest length (pooled over the
    seeds, Wilson 95%), the training speed against NoPE (chapter 8's schemes), the attention
    path and the chapter that backs the row. ``table_decoder_first`` shows the four schemes
    chapter 11 ran only with its first protocol (:data:`FIRST_PROTOCOL`), beside that
    protocol's baselines, each cell the two seeds. Nothing is printed. The check: T5's bias is
    *between* (the page says so; the rules of thumb check the flat and broken schemes).

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        ValueError: as :func:`lab_sweeps`, or T5, Shaw or Transformer-XL missing from the benchmark.
    """
    lab = lab_sweeps(_check_stored(stored))
    first = _first_protocol(stored)
    bench, path = _bench(stored), _schemes(stored).path
    mult, last = lab.multiples, lab.i_last
    rows = []
    for s in sorted(lab.tail, key=lambda s: lab.mean[s][last]):
        b = bench.speed(s) if s in lab.schemes8 and bench.measured(s) else None
        cost = f"{b['ratio_to_nope']:.2f}x" if b else "not measured"
        where = (chapter_link(8, "*The result* (figure) and *Retrieval: a passkey at every depth*")
                 if s in lab.schemes8 else chapter_link(11, "*The lab: every newer scheme* (table and figure)"))
        v = f"{verdict(lab.tail[s], mult)}, {lab.rise(s).format(2)}"
        rows.append([scheme_label(s)] + [_f2(x) for x in lab.mean[s]]
                    + [v, str(len(lab.seeds[s])), lab.far_rate(s).format(2), cost, f"`{path[s]}`", where])
    header = (["scheme"] + [f"{m}x" for m in mult]
              + [f"verdict; rise to {mult[-1]}x [95%]", "seeds",
                 f"farthest key copied at {mult[-1]}x, pooled [95%]",
                 f"training tokens/s vs NoPE (L = {bench.seq_len})", "path", "backed by"])
    n = len(mult) + 2   # the label, the losses and the verdict
    tables = _split(header, rows, {"table_decoder_loss": range(1, n), "table_decoder_cost": range(n, len(header))})
    first_rows = []
    for s in sorted(first.tail, key=lambda s: first.mean[s][-1]):
        label = scheme_label(s) + ("" if s in FIRST_PROTOCOL else " (baseline)")
        first_rows.append([label] + [" / ".join(_f2(v) for v in col) for col in first.tail[s].T]
                          + [verdict(first.tail[s], first.multiples)])
    tables["table_decoder_first"] = Table(
        ["scheme"] + [f"{m}x, seeds {' / '.join(map(str, first.seeds))}" for m in first.multiples] + ["verdict"],
        first_rows)
    facts = {"flat_bits": f"{FLAT_BITS:g}", "t5_speed": f"{bench.speed('t5')['ratio_to_nope']:.2f}",
             "ref_speed": f"{max(bench.speed(s)['ratio_to_nope'] for s in ('shaw', 'xl')):.2f}",
             "break_bits": f"{BREAK_BITS:g}", "first_n": len(FIRST_PROTOCOL), "first_base_n": len(FIRST_BASELINES)}
    checks = {"T5's bias is between": verdict(lab.tail["t5"], mult) == "between"}
    return Section([], facts, checks, tables)


def _extension_parts(stored: Stored) -> list[tuple[str, tuple[Any, Any, Any]]]:
    """Chapter 9's parts as :func:`companion.lab.results.merge_extensions` takes them, by name:
    ``(name, (provenance, rows, data))`` for each CSV in ``09_extension/`` and its JSON."""
    return [(n, (*stored.tables[n], stored.data(n))) for n in stored.parts("09_extension") if n in stored.tables]


def _extension(stored: Stored) -> SimpleNamespace:
    """Chapter 9's run (the parts in ``09_extension/``, merged by
    :func:`companion.lab.results.merge_extensions`): ``ext`` (the
    :class:`~companion.lab.results.Extension`); ``get(method, s, steps, length=None,
    seeds=None)``, one value per seed at ``s`` times the training length by default, and
    ``blocks`` with the same arguments, ``(seeds, blocks)``; its ``factors``, ``methods``,
    ``ft`` (the longest fine-tune), ``s_ft`` (the factor it was run at), ``tuned_methods``
    (the methods fine-tuned there), ``tuned_seeds`` (the seeds all of them have), ``s_mid``
    (the middle factor), ``data`` (the merged run's data) and ``head_dim``."""
    def build() -> SimpleNamespace:
        lab = lab_sweeps(stored)
        parts = _extension_parts(stored)
        rows, data = merge_extensions([p for _, p in parts], names=[n for n, _ in parts])
        ext = Extension(rows, data)

        def get(m: str, s: float, ft: int, length: int | None = None,
                seeds: Sequence[int] | None = None) -> np.ndarray:
            w = int(s * lab.train_len) if length is None else length    # by default the target s L
            return ext.get(m, s, ft, "bpb_tail", w, seeds=seeds)

        def blocks(m: str, s: float, ft: int, length: int | None = None,
                   seeds: Sequence[int] | None = None) -> np.ndarray:
            w = int(s * lab.train_len) if length is None else length
            return ext.blocks(m, s, ft, "tail", w, seeds=seeds)

        factors, ft = ext.factors, max(ext.steps)
        tuned = [s for s in factors if ext.seeds("none", s, ft)]
        if len(tuned) != 1:
            raise ValueError(f"chapter 9's run must fine-tune {ft} steps at one factor, got {tuned}")
        s_ft = tuned[0]
        tuned_methods = [m for m in ext.methods if ext.seeds(m, s_ft, ft)]
        tuned_seeds = sorted(set.intersection(*(set(ext.seeds(m, s_ft, ft)) for m in tuned_methods)))
        return SimpleNamespace(ext=ext, get=get, blocks=blocks, factors=factors, methods=ext.methods, ft=ft,
                               s_ft=s_ft, tuned_methods=tuned_methods, tuned_seeds=tuned_seeds,
                               s_mid=factors[len(factors) // 2], data=data,
                               head_dim=lab.config["d_model"] // lab.config["n_heads"])
    return _memo(stored, "extension", build)


def _llama_cpp_note(conf: dict[str, Any], head_dim: int, native: int) -> str:
    """How llama.cpp takes the scaling config ``conf``."""
    args = llama_cpp_rope_args(conf, head_dim, max_position_embeddings=native)
    if args is None:
        return "no counterpart"
    if any(k.startswith("rope_f") for k in args):
        return "per-pair divisors stored in the GGUF file"
    return f"flags (`--rope-scaling {args['--rope-scaling']}`)"


def extension_lab_table(stored: Stored) -> Section:
    """Extending the lab's RoPE model: chapter 9's methods at each factor, as is and fine-tuned.

    Two tables, one row per method: ``table_extend_lab_as_is``, tail bits per byte at ``s``
    times the training length for each factor ``s``, as is (the mean of the seeds), and at
    the training length when set up for the middle factor; ``table_extend_lab_tuned``, the
    same at the factor of the fine-tunes after the longest one (the mean of the seeds every
    method has there), the config's ``rope_type``, what llama.cpp makes of it and the chapter
    that backs the row. The lines say what the numbers are and compare the unscaled model with
    chapter 8's. Checks: chapter 9's models have chapter 8's RoPE seeds, and it scored chapter
    8's windows in chapter 8's blocks.

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        ValueError: as :func:`lab_sweeps` or :class:`~companion.lab.results.Extension`.
    """
    lab = lab_sweeps(_check_stored(stored))
    x = _extension(stored)
    length, ft, s_mid, s_ft = lab.train_len, x.ft, x.s_mid, x.s_ft
    xc, evc = x.data["extend_config"], lab.eval_config
    checks = {"chapter 9's seeds are chapter 8's RoPE seeds": x.ext.seeds("none", 1.0, 0) == lab.seeds["rope"],
              "chapter 9 scored chapter 8's windows and blocks": all(xc.get(k) == evc[k] for k in
                                                                    ("windows", "blocks", "multiples"))}
    n_eval = sorted({r["evaluations"] for r in x.data["searches"]})
    rows = []
    for m in x.methods:
        conf = method_config(m, s_mid, length, x.head_dim)
        note = f"; a search of {n_eval[0]} evaluations per model and factor" if m == "longrope" else ""
        as_is = [_f2(x.get(m, s, 0).mean()) for s in x.factors]
        at_l = _f2(x.get(m, s_mid, 0, length=length).mean())
        tuned = _f2(x.get(m, s_ft, ft, seeds=x.tuned_seeds).mean()) if m in x.tuned_methods else "not fine-tuned"
        rows.append([METHOD_LABELS[m]] + as_is + [at_l, tuned, f"`{conf['rope_type']}`",
                     _llama_cpp_note(conf, x.head_dim, length) + note,
                     chapter_link(9, "*Measuring them* (table and figure)")])
    tuned_head = f"s = {s_ft:g}, +{ft} steps (seeds {', '.join(map(str, x.tuned_seeds))})"
    header = (["method"] + [f"s = {s:g}, as is" for s in x.factors]
              + [f"at L = {length}, set up for s = {s_mid:g}", tuned_head, "config", "llama.cpp", "backed by"])
    n = len(x.factors) + 1   # the label's neighbours: the as-is losses and the cost at L
    tables = _split(header, rows, {"table_extend_lab_as_is": range(1, n + 1),
                                   "table_extend_lab_tuned": range(n + 1, len(header))})
    none_l, rope_l = x.get("none", 1.0, 0, length=length), lab.tail["rope"][:, lab.i1]
    lines = [f"bits per byte at s x {length} as is, mean of seeds {x.ext.seeds('none', 1.0, 0)}; and at "
             f"{length}; fine-tuned at s = {s_ft:g} for {ft} steps",
             f"the unscaled model at L: {_f2(none_l.mean())} here, {_f2(rope_l.mean())} in chapter 8, on the same "
             f"{evc['windows'] * TAIL:,} bytes (chapter 9 trained its models again with chapter 8's recipe)"]
    facts = {"ext_none_l": _f2(none_l.mean()), "ext_rope_l": _f2(rope_l.mean()), "ext_s_ft": f"{s_ft:g}",
             "ext_ft": ft, "ext_tuned_seeds": len(x.tuned_seeds)}
    return Section(lines, facts, checks, tables)


def _smol(stored: Stored) -> SimpleNamespace:
    """Chapter 10's SmolLM2 runs: perplexities ``ppl`` per (window, method), ``windows``,
    ``methods``, ``length`` and ``native`` context, ``last``, the llama.cpp cross-check ``xc``
    with each method's largest relative difference ``xc_rel`` and whether plain RoPE collapses
    there too (``xc_none``), the model's RoPE ``base``, the ``labels`` and ``smol`` (each
    method's geometric means over the windows)."""
    def build() -> SimpleNamespace:
        side = stored.data("10_ppl")
        ppl = summarize(stored.rows("10_ppl"))
        windows = sorted({w for w, _ in ppl})
        methods = list(side["methods"])
        xc = stored.data("10_llamacpp")["stored"]["methods"]
        smol = {m: {k: geometric_mean([ppl[w, m][k] for w in windows]) for k in _HALVES} for m in methods}
        xc_rel = {m: max(abs(xc[m]["llamacpp"][k] / xc[m]["stored"][k] - 1) for k in ("first_half", "second_half"))
                  for m in xc if m != "none"}
        xc_none = all(xc["none"][src]["second_half"] > 3 * xc["none"][src]["first_half"]
                      for src in ("llamacpp", "stored"))
        return SimpleNamespace(
            side=side, ppl=ppl, windows=windows, methods=methods, length=side["length"],
            native=int(side["length"] / side["factor"]), last=inspect.signature(summarize).parameters["last"].default,
            xc=xc, base=xc["none"]["rope_args"]["--rope-freq-base"],   # SmolLM2's rope_theta, as stored
            labels={"none": "plain RoPE", **{m: METHOD_LABELS[m] for m in methods if m != "none"}},
            smol=smol, xc_rel=xc_rel, xc_none=xc_none)
    return _memo(stored, "smol", build)


def extension_smol_table(stored: Stored) -> Section:
    """Extending SmolLM2 past its native context (chapter 10): perplexity by half, per method.

    Two tables, one row per method: ``table_extend_smol_ppl``, the geometric mean over the
    stored windows of the perplexity of the native half, the extension half and the last
    tokens, and their ratio; ``table_extend_smol_tools``, the config, whether llama.cpp agrees
    and the chapter that backs the row. The lines give the windows and the stored inference
    speeds of plain RoPE and YaRN.

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        ValueError: as :func:`companion.longctx.summarize`.
    """
    sm = _smol(_check_stored(stored))
    rows = []
    for m in sm.methods:
        t = sm.smol[m]
        conf = smol_method_config(m, sm.side["factor"], sm.native, sm.base)
        if m == "none":
            check = "collapses there too" if sm.xc_none else "a different verdict there"
        elif m in sm.xc_rel:
            check = f"both halves within {100 * sm.xc_rel[m]:.1f}% of it"
        else:
            check = "not run in it"
        ratio = _f2(t["second_half"] / t["first_half"])
        rows.append([sm.labels[m], _f2(t["first_half"]), _f2(t["second_half"]), _f2(t["last"]), ratio,
                     f"`{conf['rope_type']}`" if conf else "`default`", check,
                     chapter_link(10, "*The experiment* (table and figure) and *The 16K results in llama.cpp*")])
    rows.append(["LongRoPE", "not run on this model", "", "", "", "`longrope`", "", chapter_link(10)])
    header = ["method", f"perplexity, tokens 0 to {sm.native - 1}", f"tokens {sm.native} to {sm.length - 1}",
              f"last {sm.last}", "second half / first", "config", "llama.cpp", "backed by"]
    bench = {r["tokens"]: r["runs"] for r in stored.data("llama_cpu")["results"]}
    tables = _split(header, rows, {"table_extend_smol_ppl": range(1, 5),
                                   "table_extend_smol_tools": range(5, len(header))})
    lines = ([f"{len(sm.windows)} windows of {sm.length} tokens; native context {sm.native}; factor "
              f"{sm.side['factor']:g}"]
             + [f"stored speed at {n} tokens: plain RoPE {r['default']['tokens_per_second']:.0f} tokens/s, "
                f"YaRN {r['yarn-2']['tokens_per_second']:.0f} tokens/s" for n, r in sorted(bench.items())])
    yarn_not_slower = all(r["yarn-2"]["seconds"] <= r["default"]["seconds"] for r in bench.values())
    facts = {"yarn_speed": "was not the slower one at either length" if yarn_not_slower
             else "was the slower one at some length",
             "smol_native": f"{sm.native:,}", "smol_len": f"{sm.length:,}"}
    return Section(lines, facts, {}, tables)


def smol_passkey(stored: Stored) -> Section:
    """Chapter 10's passkey test on SmolLM2: keys found by plain RoPE at the native context and
    by YaRN at the extended one.

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        ValueError: the test has no trial at one of those lengths.
    """
    sm = _smol(_check_stored(stored))
    found: dict[tuple[int, str], list[bool]] = {}
    for r in stored.rows("10_passkey"):
        found.setdefault((int(r["tokens"]), r["method"]), []).append(r["correct"] == "1")
    for key in ((sm.native, "none"), (sm.length, "yarn")):
        if key not in found:
            raise ValueError(f"the passkey test has no trial of {key[1]!r} at {key[0]} tokens")
    native, yarn = found[sm.native, "none"], found[sm.length, "yarn"]
    line = (f"passkey, SmolLM2: plain RoPE at {sm.native} tokens found {sum(native)} of {len(native)} keys; "
            f"YaRN at {sm.length} found {sum(yarn)} of {len(yarn)}")
    return Section([line], {"pk_native": f"{sum(native)} of {len(native)}", "pk_yarn": f"{sum(yarn)} of {len(yarn)}"})


def _trainfree(stored: Stored) -> SimpleNamespace:
    """Chapter 11's training-free methods on the lab model (the parts in ``11_trainfree_lab/``):
    ``runs`` by seed, ``seeds``, ``tf`` (per method and ``"plain"``, ``(seeds, lengths)`` tail
    bits per byte), ``blocks(name, multiple)`` (``(seeds, blocks)``), ``far_rate(name)`` (the
    Wilson interval of the farthest keys copied at the longest length), ``plain_gap_1x`` (the
    largest difference of its plain RoPE from chapter 8's at the training length, seed by seed)
    and ``data``."""
    def build() -> SimpleNamespace:
        lab = lab_sweeps(stored)
        parts = [stored.data(n) for n in stored.parts("11_trainfree_lab")]
        data = parts[0]
        runs = sorted((r for p in parts for r in p["runs"]), key=lambda r: r["seed"])
        seeds = [r["seed"] for r in runs]
        bad = [p["multiples"] for p in parts if p["multiples"] != lab.multiples]
        if bad or not set(seeds) <= set(lab.seeds["rope"]) or len(set(seeds)) != len(seeds):
            raise ValueError(f"chapter 11's training-free runs must have chapter 8's multiples {lab.multiples} and "
                             f"distinct seeds among its RoPE seeds {lab.seeds['rope']}, got {seeds} and "
                             f"{[p['multiples'] for p in parts]}")

        def entry(r: dict[str, Any], n: str, w: int) -> dict[str, Any]:
            return r["plain"][str(w)] if n == "plain" else r["methods"][n]["bpb"][str(w)]

        tf = {n: np.array([[entry(r, n, w)["tail"] for w in lab.lengths] for r in runs])
              for n in ("plain", *TRAINFREE_LABELS)}

        def blocks(n: str, multiple: int) -> np.ndarray:
            return np.array([entry(r, n, multiple * lab.train_len)["tail_blocks"] for r in runs])

        def far_rate(n: str) -> Any:   # the farthest key copied exactly at the longest length, pooled
            hits = []
            for r in runs:
                cells = r["methods"][n]["passkey"][str(lab.lengths[-1])]   # by depth, as the JSON keys it
                hits += cells[min(cells, key=float)]["exact"]
            return proportion_ci(int(sum(hits)), len(hits))

        rope = lab.tail["rope"][[lab.seeds["rope"].index(sd) for sd in seeds], lab.i1]
        gap = float(np.abs(tf["plain"][:, lab.i1] - rope).max())
        return SimpleNamespace(runs=runs, seeds=seeds, tf=tf, blocks=blocks, far_rate=far_rate, plain_gap_1x=gap,
                               data=data)
    return _memo(stored, "trainfree", build)


def streaming_lab_table(stored: Stored) -> Section:
    """Streaming on the lab's RoPE model: chapter 11's training-free methods beside plain RoPE
    and ALiBi trained from scratch.

    Two tables, one row per method: ``table_stream_lab_loss``, the mean tail bits per byte at
    each length; ``table_stream_lab_memory``, the largest distance RoPE sees at the longest
    length and what the method keeps in memory, what it needs of a checkpoint and the chapter
    that backs the row. The line names the seeds. Checks: its plain RoPE is chapter 8's recipe
    and seeds (within 0.05 bits of chapter 8's at the training length), every seed ran with
    the same settings, and every method keeps RoPE inside the trained range (a sink cache's
    reach by :func:`companion.longctx.trainfree_reach`, checked against the reach chapter 11
    stored for SmolLM2).

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        ValueError: as :func:`lab_sweeps`, or a run with other seeds or lengths than chapter 8's.
    """
    lab = lab_sweeps(_check_stored(stored))
    t = _trainfree(stored)
    w_last = lab.lengths[-1]
    smol_sinks = stored.data("11_trainfree_ppl")["trainfree"]["sinks"]
    checks = {"its plain RoPE is chapter 8's at the training length": t.plain_gap_1x < 0.05,
              "the sink reach rule gives SmolLM2's stored reach":
                  _sink_reach(smol_sinks, _smol(stored).length) == smol_sinks["reach"]}

    def memory_cell(n: str) -> str:
        """The largest distance RoPE sees at the longest length, and which keys a query reads."""
        st = t.runs[0]["methods"][n]["settings"][str(w_last)]
        checks[f"{n}: one setting for every seed"] = all(r["methods"][n]["settings"][str(w_last)] == st
                                                         for r in t.runs)
        if "n_sink" in st:
            cache = (f"a cache of {st['n_sink']} sinks and {st['window']} recent keys, read in chunks of "
                     f"{st['chunk']}: bounded")
            if not st.get("rerotate", True):   # every key keeps its position in the stream
                return f"{w_last - 1}, from the sinks; {cache}"
            top = _sink_reach(st, w_last)
            checks[f"{n}: inside the trained range"] = top < lab.train_len
            return f"{top}; {cache}"
        mode = SelfExtend(st["window"], st["group"]) if n == "self_extend" else ReRoPE(st["window"], st.get("leak"))
        far = max_relative_position(mode, w_last)
        checks[f"{n}: inside the trained range"] = far < lab.train_len
        return f"{far:g}; every key is read"

    rows = []
    for n, label in [("plain", "plain RoPE")] + list(TRAINFREE_LABELS.items()):
        cell = f"{w_last - 1}; every key is read" if n == "plain" else memory_cell(n)
        rows.append([label] + [_f2(v) for v in t.tf[n].mean(0)]
                    + [cell, "any RoPE checkpoint, no training", chapter_link(11, "*On the lab model*")])
    rows.append([f"ALiBi, trained from scratch ({len(lab.seeds['alibi'])} seeds)"] + [_f2(v) for v in lab.mean["alibi"]]
                + ["no rotation; every key is read", "needs a model trained with it",
                   chapter_link(8, "*The result*")])
    header = (["method"] + [f"{m}x" for m in lab.multiples]
              + [f"largest distance RoPE sees at {w_last}; memory", "checkpoints", "backed by"])
    n = len(lab.multiples) + 1   # the label and the losses
    tables = _split(header, rows, {"table_stream_lab_loss": range(1, n),
                                   "table_stream_lab_memory": range(n, len(header))})
    line = (f"RoPE models of seeds {' and '.join(map(str, t.seeds))} (chapter 8's recipe); plain RoPE within "
            f"{t.plain_gap_1x:.2f} bits of chapter 8's at 1x")
    return Section([line], {"tf_seeds": " and ".join(map(str, t.seeds))}, checks, tables)


def _smol_trainfree(stored: Stored) -> SimpleNamespace:
    """Chapter 11's training-free methods on SmolLM2 beside chapter 10's plain RoPE and YaRN on
    the same windows: ``smol_tf`` (per method, geometric means),
    ``windows``, ``methods``, ``data`` and the ``checks`` that the tokens are chapter 10's."""
    def build() -> SimpleNamespace:
        sm = _smol(stored)
        data = stored.data("11_trainfree_ppl")
        tfp = summarize(stored.rows("11_trainfree_ppl"))
        wins = [w["index"] for w in data["windows"]]
        hash10 = {w["index"]: w["ids_sha256"] for w in sm.side["windows"]}
        checks = {"the same tokens as chapter 10": all(hash10.get(w["index"]) == w["ids_sha256"]
                                                       for w in data["windows"]),
                  "the same length as chapter 10": data["length"] == sm.length}
        methods = list(data["methods"])
        smol_tf = {}
        for m in ["none", "yarn"] + methods:
            src = sm.ppl if m in ("none", "yarn") else tfp
            smol_tf[m] = {k: geometric_mean([src[w, m][k] for w in wins]) for k in _HALVES}
        return SimpleNamespace(smol_tf=smol_tf, windows=wins, methods=methods, data=data, checks=checks)
    return _memo(stored, "smol_trainfree", build)


def streaming_smol_table(stored: Stored) -> Section:
    """The training-free methods on SmolLM2 past its native context, beside plain RoPE and YaRN.

    One table, ``table_stream_smol``; each row: the geometric mean over the stored windows of
    the perplexity of each half and of the last tokens and the largest position RoPE sees. The
    line names the windows. Checks: the windows are chapter 10's tokens at chapter 10's length.

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        ValueError: as :func:`companion.longctx.summarize`.
    """
    sm = _smol(_check_stored(stored))
    st = _smol_trainfree(stored)
    rows = []
    for m, t in st.smol_tf.items():
        label = sm.labels.get(m) or TRAINFREE_LABELS[m]
        if m in st.methods:
            cell = f"{st.data['trainfree'][m]['reach']:g}" + ("; bounded cache" if m == "sinks" else "")
        else:
            cell = f"{sm.length - 1}" + ("" if m == "none" else ", at rescaled frequencies")
        rows.append([label, _f2(t["first_half"]), _f2(t["second_half"]), _f2(t["last"]), cell,
                     chapter_link(11, "*On SmolLM2-135M at twice its context*") if m in st.methods
                     else chapter_link(10, "*The experiment*")])
    header = ["method", f"perplexity, tokens 0 to {sm.native - 1}", f"tokens {sm.native} to {sm.length - 1}",
              f"last {sm.last}", "largest position RoPE sees", "backed by"]
    return Section([f"window(s) {st.windows}"], {}, dict(st.checks), {"table_stream_smol": Table(header, rows)})


#: The grid schemes of chapter 12, with their labels.
_GRID_LABELS = {"learned": "learned (resized)", "sincos-2d": "2-D sin-cos", "axial": "axial RoPE",
                "mixed": "RoPE-Mixed", "nope": "NoPE"}
_GRID_CHECKPOINTS = {
    "learned": "a ViT table, resampled bicubically to a new grid as DeiT does " + chapter_link(12),
    "sincos-2d": "MAE's table " + chapter_link(12),
    "axial": "rope-vit's axial form " + chapter_link(12),
    "mixed": "rope-vit's learned mixed frequencies " + chapter_link(12),
    "nope": "nothing to load",
}


def _grid(stored: Stored) -> SimpleNamespace:
    """Chapter 12's grid experiment: ``data``, ``summary``, ``grids`` (as strings), ``train`` and
    ``last`` grid sizes, and ``gmean`` (per scheme and grid, the mean accuracy)."""
    data = stored.data("12_grid")
    summ = data["summary"]
    grids = [str(g) for g in data["grids"]]
    return SimpleNamespace(data=data, summary=summ, grids=grids, train=str(data["task"]["grid"]), last=grids[-1],
                           gmean={n: {g: summ[n]["by_grid"][g]["mean"] for g in grids} for n in _GRID_LABELS})


def grid_table(stored: Stored) -> Section:
    """Vision and 2-D inputs: chapter 12's grid encoders, trained on one grid, tested on larger.

    Two tables, one row per scheme and then M-RoPE, which the experiment did not run:
    ``table_grid_accuracy``, the accuracy at each grid size (mean and range over seeds);
    ``table_grid_diagnostics``, the two diagnostics at the largest grid (the training grid
    shifted, attention windowed), the attention path, what checkpoints load and the chapter
    that backs the row. The line gives the task's protocol. The check: the first grid is the
    training grid.

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
    """
    g = _grid(_check_stored(stored))
    data, summ, grids, g_last = g.data, g.summary, g.grids, g.last
    settings = data["settings"]
    n_heads = settings["n_heads"]
    q = torch.zeros(1, n_heads, int(g.train) ** 2, settings["d_model"] // n_heads)
    gpos = grid_positions((int(g.train), int(g.train)))
    rows = []
    for n, label in _GRID_LABELS.items():
        by = summ[n]["by_grid"]
        cells = [f"{_f2(by[x]['mean'])} [{_f2(by[x]['min'])} to {_f2(by[x]['max'])}]" for x in grids]
        sh, wi = summ[n]["shifted"].get(g_last), summ[n]["window"].get(g_last)
        sch = grid_task.build_scheme(n)
        pos = (gpos, gpos) if sch.position_axes == 2 else ()
        p = attention_path(q, q, q, sch, *pos)
        sh_cell, wi_cell = _f2(sh["mean"]) if sh else "-", _f2(wi["mean"]) if wi else "-"
        rows.append([label] + cells + [sh_cell, wi_cell, f"`{p}`", _GRID_CHECKPOINTS[n],
                     chapter_link(12, "*Experiment: train on one grid, test on larger ones* (table and figure)")])
    absent = ["not in the experiment"]   # said in both tables
    rows.append(["M-RoPE (Qwen2-VL)"] + absent + [""] * (len(grids) - 1) + absent + ["", ""]
                + ["HuggingFace's Qwen2-VL arithmetic, bit for bit in float32; text positions give back 1-D RoPE "
                   + chapter_link(12, "*HuggingFace's arithmetic*"), chapter_link(12)])
    header = (["scheme"] + [f"accuracy at G = {x}, mean [range]" for x in grids]
              + [f"training grid shifted, at G = {g_last}", f"attention windowed, at G = {g_last}", "path",
                 "checkpoints", "backed by"])
    n_params = {n: sum(p.numel() for p in grid_task.build_scheme(n).parameters()) for n in ("mixed", "learned")}
    tables = _split(header, rows, {"table_grid_accuracy": range(1, len(grids) + 1),
                                   "table_grid_diagnostics": range(len(grids) + 1, len(header))})
    lines = [f"accuracy (both offsets right), mean of {summ['axial']['seeds']} seeds, trained at G = {g.train}; "
             f"chance {data['runs'][0]['chance']:.3f}"]
    facts = {"mixed_params": n_params["mixed"], "learned_params": f"{n_params['learned']:,}"}
    return Section(lines, facts, {"the first grid is the training grid": grids[0] == g.train}, tables)


#: What each hook gets from ``companion.kernels`` (the kernel table's column).
_KERNEL = {
    "rotate": "`fused_rope` rotates by any cos/sin table: RoPE and its rescaled or truncated frequencies; "
              "not xPos's scales",
    "bias": "`flash_attention_with_bias` for ALiBi and T5; none for Kerple or FIRE",
    "score": "none: a per-distance table enters every logit",
    "embed": "none needed: attention is plain",
    "": "none needed: attention is plain",
}


def _kernel_bench(stored: Stored) -> SimpleNamespace:
    """The CPU benchmarks of chapters 5 and 6: ``rope`` (the RoPE ratios), ``length`` (the
    longest of the bias benchmark, a string) and ``big`` (its ratios at that length, at the
    largest thread count)."""
    bias = stored.data("06_bias_attention_cpu")
    threads, length = str(max(bias["config"]["threads"])), str(max(bias["config"]["lengths"]))
    return SimpleNamespace(rope=stored.data("rope_cpu")["ratios"], length=length, big=bias["ratios"][threads][length])


def kernel_table(stored: Stored) -> Section:
    """Kernel availability: what ``companion.kernels`` offers each family of schemes, grouped by
    hook and attention path, with the CPU measurements that were stored and whether a GPU
    benchmark is (``07_gpu_benchmarks.json`` in the folder). One table, ``table_kernels``; the
    lines give the kernels' limits and say whether that file is there. The check: the bias
    kernel covers ALiBi and T5.

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        ValueError: as :func:`lab_sweeps`.
    """
    lab = lab_sweeps(_check_stored(stored))
    bench, sch, kb = _bench(stored), _schemes(stored), _kernel_bench(stored)
    gpu_stored = (stored.data_dir / GPU_BENCHMARK).exists()
    lines = [f"companion.kernels: fused_rope (layouts 'half' and 'interleaved', head_dim up to "
             f"{kernels.MAX_ROPE_HEAD_DIM}); flash_attention_with_bias with the biases "
             f"{[b for b in kernels.BIASES if b]} (head_dim up to {kernels.MAX_ATTENTION_HEAD_DIM}); "
             f"dtypes {[str(d).split('.')[-1] for d in kernels.KERNEL_DTYPES]}"]

    def speeds(names: list[str]) -> str:
        return ", ".join(f"{scheme_label(s)} {bench.speed(s)['ratio_to_nope']:.2f}x" for s in names
                         if s in lab.schemes8)

    families: dict[tuple[str, str], list[str]] = {}
    for s in lab.schemes + list(FIRST_PROTOCOL):
        families.setdefault((sch.hooks[s], sch.path[s]), []).append(s)
    rows = []
    for (hook, p), names in sorted(families.items()):
        measured = f"training tokens/s vs NoPE: {speeds(names)}" if hook else "the baseline"
        if hook == "rotate":
            measured += (f"; `apply_rope` {kb.rope['apply_rope']['hf_eager_over']:.2f}x faster than HuggingFace's "
                         f"eager formula, in place {kb.rope['apply_rope_inplace']['hf_eager_over']:.2f}x "
                         + chapter_link(5, "*Timings*"))
        if hook == "bias" and "alibi" in names:
            measured += (f"; at {int(kb.length):,} tokens the blockwise path held {kb.big['memory']:.4f}x the memory "
                         f"of a materialised bias and took {kb.big['time']:.2f}x the time "
                         + chapter_link(6, "*Measured: memory and time on this CPU*"))
        if hook == "score":
            measured += ("; a layer's peak memory is NoPE's plus one float32 (heads, L, L) tensor "
                         + chapter_link(4, "*Cost per layer*"))
        rows.append(["; ".join(scheme_label(s) for s in names), f"`{hook or 'none'}`", f"`{p}`", _KERNEL[hook],
                     measured, "stored" if gpu_stored else "not measured: no stored GPU run", chapter_link(7)])
    header = ["schemes", "hook", f"CPU path (L = {bench.seq_len})", "fused GPU kernel", "stored CPU measurement",
              "GPU speed", "backed by"]
    lines.append(f"{GPU_BENCHMARK} is present: GPU timings are stored" if gpu_stored else
                 f"{GPU_BENCHMARK} is absent: no GPU timing is stored for this build")
    facts = {"gpu_note": "stores GPU timings" if gpu_stored
             else "stores no GPU timings, so this guide ranks no kernel by GPU speed"}
    return Section(lines, facts, {"the bias kernel covers ALiBi and T5": {"alibi", "t5"} <= set(kernels.BIASES)},
                   {"table_kernels": Table(header, rows)})


def _grid_compare(g: SimpleNamespace, a: str, b: str, grid: str) -> Any:
    """Chapter 12's comparison of two grid schemes at one size: the interval of the mean
    difference of their held-out accuracy, resampling the seeds and the held-out grids (a
    two-stage bootstrap, :func:`companion.lab.stats.bootstrap_ci` with ``resample_rows``)."""
    runs = {(r["scheme"], r["seed"]): r for r in g.data["runs"]}
    seeds = sorted({r["seed"] for r in g.data["runs"]})

    def hits(name: str) -> np.ndarray:
        full = [(runs[name, sd]["hits"]["full"][grid], runs[name, sd]["evaluated"]["full"][grid]) for sd in seeds]
        return np.stack([grid_task.unpack_hits(h, n) for h, n in full]).astype(float)
    return bootstrap_ci(hits(a) - hits(b), resample_rows=True)


def rules_of_thumb(stored: Stored) -> Section:
    """The appendix's rules of thumb, each computed from the stored results, checked seed by
    seed and with a 95% interval.

    ``checks`` holds one entry per rule (``True`` where the stored data bear it out) and
    ``facts`` the numbers the rules quote, by glue name: an interval is a 95% bootstrap interval
    over the scored blocks of the seed means (:meth:`LabSweeps.gap`), a Wilson interval for a
    share of passkey trials (:meth:`LabSweeps.far_rate`), a two-stage bootstrap over documents
    or seeds and held-out grids where the chapter uses one. The rules:

    * *fixed length*: at the training length RoPE, T5, Shaw and Transformer-XL beat the
      absolute tables and ALiBi by more than 0.05 bits on every seed and by an interval above
      0.05 for the closest pair; RoPE trains at more than 0.9 times NoPE's speed, Shaw and
      Transformer-XL at less than 0.25;
    * *flat from scratch*: ALiBi (fixed or learned slopes), Kerple (log), Shaw,
      Transformer-XL and the windowed hybrid are flat (:func:`verdict`), each with a rise
      interval below the flat threshold; Kerple (log) is ahead of fixed ALiBi at the training
      length (on every seed, by an interval above 0.03) and behind ALiBi with learned slopes
      at every length (on every seed; by an interval above zero at the training length); NoPE
      is behind every other scheme at the training length by more than 0.5 bits; ALiBi trains
      at more than 0.9 times NoPE's speed;
    * *rotary breaks*: RoPE, both p-RoPEs, RoPE with NoPE layers and the absolute tables break,
      the smallest of their rises with an interval above the break threshold;
    * *flat is not memory*: ALiBi (both) and Kerple (log) copy the farthest key at the longest
      length with a Wilson upper bound below 0.15, while the windowed hybrid copies it with a
      lower bound above 0.5 and Shaw above 0.1;
    * *no fine-tune: YaRN*: at each factor above the smallest YaRN and LongRoPE have the two
      best means, YaRN is among the best two on every seed and ahead of the third by an
      interval above zero; on SmolLM2 YaRN has the best second half on every window and beats
      plain RoPE on chapter 10's documents by an interval above zero;
    * *not PI as is*: unfine-tuned PI costs more than 1 bit at the lab model's training length
      at every factor, on every seed and by an interval above 1, and more than doubles
      SmolLM2's native-half perplexity on every window;
    * *fine-tuned*: after the longest fine-tune every method but PI is within 0.1 bits of
      fine-tuning with no scaling, on every seed and with its interval inside (-0.1, 0.1), and
      PI is worse on every seed, by an interval above zero;
    * *llama.cpp*: Dynamic NTK has no llama.cpp counterpart, plain RoPE collapses in llama.cpp
      too, and the others agree with it within 5%;
    * *streaming*: every training-free method beats plain RoPE by more than a bit from 4x on,
      on every seed and by an interval above 1 at the longest length; the sink cache beats
      ALiBi at the longest length on every seed and by an interval above zero; re-rotation is
      worth more than 0.25 bits at 4x on every seed and by its interval; the sinks change the
      loss by less than 0.01 bits; on SmolLM2's documents the sink cache's interval against
      YaRN includes zero; the sink cache copies the farthest key at the longest length with a
      Wilson upper bound below 0.15, ReRoPE with a lower bound above 0.3;
    * *grids*: a 2-D RoPE has the best mean one size up, both RoPEs beat the resized learned
      table at every larger grid by intervals above zero, the interval of axial RoPE against
      RoPE-Mixed (base 100) one size up includes zero and axial RoPE's seeds spread more than
      0.3 there, the RoPEs score the shifted training grid within 0.01 of the training grid
      while the absolute tables fall below 0.5, and every scheme loses more than half its
      accuracy at the largest;
    * *kernels*: Shaw, Transformer-XL and CoPE take the reference path, RoPE torch's fused
      causal attention; the blockwise bias holds less than a tenth of the memory of a
      materialised one at the longest length, and ``apply_rope`` beats HuggingFace's eager
      formula by more than 1.5 times (ratios taken within one benchmark run).

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        ValueError: as the sections it reads (:func:`lab_sweeps` and the others).
    """
    lab = lab_sweeps(_check_stored(stored))
    bench, path = _bench(stored), _schemes(stored).path
    x, sm, t, g, kb = _extension(stored), _smol(stored), _trainfree(stored), _grid(stored), _kernel_bench(stored)
    tail, mean, i1, iL, mult = lab.tail, lab.mean, lab.i1, lab.i_last, lab.multiples
    tf, smol, summ, gmean = t.tf, sm.smol, g.summary, g.gmean
    label = scheme_label
    rules: dict[str, bool] = {}
    f: dict[str, Any] = {}

    def worse(s: str, i: int) -> float:      # the worse seed
        return float(tail[s][:, i].max())

    def better(s: str, i: int) -> float:     # the better seed
        return float(tail[s][:, i].min())

    def ratio(s: str) -> float:
        return bench.speed(s)["ratio_to_nope"]

    # 1. Fixed length: rotary and relative schemes ahead of the absolute tables and ALiBi; RoPE
    #    nearly free, the score-hook schemes not.
    behind, ahead = ("learned", "sinusoidal", "alibi"), ("rope", "t5", "shaw", "xl")
    gap1 = min(better(b, i1) for b in behind) - max(worse(a, i1) for a in ahead)
    pairs = {(b, a): lab.gap(b, a, 1) for b in behind for a in ahead}
    closest = min(pairs, key=lambda k: pairs[k].estimate)
    score_speed = max(ratio(s) for s in ("shaw", "xl"))
    rules["fixed length"] = (gap1 > 0.05 and pairs[closest].above(0.05) and ratio("rope") > 0.9
                             and score_speed < 0.25)
    f.update(r_gap1=f"{gap1:.2f}", r_gap1_ci=pairs[closest].format(2),
             r_gap1_pair=f"{label(closest[1])} against {label(closest[0])}",
             r_rope_speed=f"{ratio('rope'):.2f}", r_score_speed=f"{score_speed:.2f}")

    # 2. From scratch, beyond the training length: which schemes stay flat; what Kerple's lead is.
    verdicts = {s: verdict(tail[s], mult) for s in tail}
    flat = [s for s, v in verdicts.items() if v == "flat"]
    breaks = [s for s, v in verdicts.items() if v == "breaks"]
    must_flat = ("alibi", "alibi-learned", "kerple-log", "shaw", "xl", "rope-window-nope")
    flat_rise = {s: lab.rise(s) for s in must_flat}
    steepest = max(flat_rise, key=lambda s: flat_rise[s].high)
    flat_ci = flat_rise[steepest]
    by_long = sorted(tail, key=lambda s: mean[s][iL])
    best_long, runner = by_long[0], by_long[1]
    kl_alibi, kl_learned = lab.gap("alibi", "kerple-log", 1), lab.gap("kerple-log", "alibi-learned", 1)
    kl_every = all(((tail["kerple-log"][:, i] - tail["alibi-learned"][:, i]) > 0).all() for i in range(len(mult)))
    kl_alibi_seeds = better("alibi", i1) > worse("kerple-log", i1)    # every seed of Kerple ahead of every ALiBi's
    nope_behind = min(better("nope", i1) - worse(s, i1) for s in tail if s != "nope")
    rules["flat from scratch"] = (set(must_flat) <= set(flat) and flat_ci.high < FLAT_BITS
                                  and kl_alibi.above(0.03) and kl_alibi_seeds and kl_learned.above(0) and kl_every
                                  and nope_behind > 0.5 and ratio("alibi") > 0.9)
    f.update(r_flat="; ".join(label(s) for s in sorted(flat, key=lambda s: mean[s][iL]) if s != "nope"),
             r_flat_ci=f"{label(steepest)} {flat_ci.format(2)}",
             r_best_long=f"{label(best_long)} ({_f2(mean[best_long][iL])})",
             r_best_gap=f"{label(runner)} {lab.gap(runner, best_long).format(2)} behind",
             r_kl_alibi=kl_alibi.format(2), r_kl_learned=kl_learned.format(3),
             r_nope_behind=f"{nope_behind:.2f}", r_alibi_speed=f"{ratio('alibi'):.2f}")

    # 3. Rotary variants break without an inference-time fix.
    must_break = ("rope", "p-rope", "p-rope-0.375", "rope-nope", "learned", "sinusoidal")
    break_rise = {s: lab.rise(s) for s in must_break}
    least = min(break_rise, key=lambda s: break_rise[s].estimate)
    rules["rotary breaks"] = set(must_break) <= set(breaks) and break_rise[least].above(BREAK_BITS)
    f.update(r_breaks=_listing(label(s) for s in breaks), r_rope_long=_f2(mean["rope"][iL]),
             r_rope1=_f2(mean["rope"][i1]), r_break_least=f"{label(least)} {break_rise[least].format(2)}")

    # 4. Flat is not long memory.
    blind = ("alibi", "alibi-learned", "kerple-log")
    blind_high = max(lab.far_rate(s).high for s in blind)
    window_key, shaw_key = lab.far_rate("rope-window-nope"), lab.far_rate("shaw")
    rules["flat is not memory"] = blind_high < 0.15 and window_key.low > 0.5 and shaw_key.low > 0.1
    f.update(r_blind_keys="; ".join(f"{label(s)} {lab.far_rate(s).format(2)}" for s in blind),
             r_window_key=window_key.format(2), r_shaw_key=shaw_key.format(2),
             r_xl_key=lab.far_rate("xl").format(2), r_trials=int(lab.far_trials["alibi"].size))

    # 5. Stretching without fine-tuning: YaRN or LongRoPE on the lab model, YaRN on SmolLM2.
    get, blocks, factors, s_mid, L = x.get, x.blocks, x.factors, x.s_mid, lab.train_len
    big = [s for s in factors if s > factors[0]]
    seeds0 = x.ext.seeds("none", 1.0, 0)
    two = {}
    third = {}
    for s in big:
        per_seed = {m: get(m, s, 0, seeds=seeds0) for m in x.methods}
        by_mean = sorted(x.methods, key=lambda m: per_seed[m].mean())
        two[s] = set(by_mean[:2]) == {"yarn", "longrope"} and all(
            "yarn" in sorted(x.methods, key=lambda m: per_seed[m][i])[:2] for i in range(len(seeds0)))
        third[s] = (by_mean[2], difference(blocks(by_mean[2], s, 0), blocks("yarn", s, 0)))
    yl = difference(blocks("yarn", s_mid, 0), blocks("longrope", s_mid, 0))
    best_smol = {w: min(sm.methods, key=lambda m: sm.ppl[w, m]["second_half"]) for w in sm.windows}
    docs = context_value(stored.rows("10_context"), "yarn", sm.native, baseline="none")
    rules["no fine-tune: YaRN"] = (all(two.values()) and all(ci.above(0) for _, ci in third.values())
                                   and set(best_smol.values()) == {"yarn"} and docs["interval"].above(0))
    f.update(r_big=" and ".join(f"s = {s:g}" for s in big), r_yarn_mid=_f2(get("yarn", s_mid, 0).mean()),
             r_none_mid=_f2(get("none", s_mid, 0).mean()), r_s_mid=f"{s_mid:g}",
             r_yarn_third="; ".join(f"{METHOD_LABELS[m]} {ci.format(2)} behind at s = {s:g}"
                                    for s, (m, ci) in third.items()),
             r_yarn_longrope=yl.format(2),
             r_longrope_worst=_f2(get("longrope", factors[-1], 0).max()), r_s_last=f"{factors[-1]:g}",
             r_yarn_smol=_f2(smol["yarn"]["second_half"]), r_none_smol=_f2(smol["none"]["second_half"]),
             r_yarn_docs=docs["interval"].format(2), r_docs=docs["documents"])

    # 6. PI costs the native range when nothing is fine-tuned.
    pi_lab = min(float((get("pi", s, 0, length=L) - get("none", 1.0, 0, length=L)).min()) for s in factors)
    pi_ci = min((difference(blocks("pi", s, 0, length=L), blocks("none", 1.0, 0, length=L)) for s in factors),
                key=lambda ci: ci.estimate)
    pi_smol = min(sm.ppl[w, "pi"]["first_half"] / sm.ppl[w, "none"]["first_half"] for w in sm.windows)
    rules["not PI as is"] = pi_lab > 1.0 and pi_ci.above(1.0) and pi_smol > 2.0
    f.update(r_pi_lab=_f2(pi_lab), r_pi_ci=pi_ci.format(2), r_pi_smol=f"{pi_smol:.1f}")

    # 7. With a short fine-tune the method matters little, PI excepted.
    ft, s_ft, ts = x.ft, x.s_ft, x.tuned_seeds
    others = [m for m in x.tuned_methods if m not in ("none", "pi")]
    ft_gap = max(float(np.abs(get(m, s_ft, ft, seeds=ts) - get("none", s_ft, ft, seeds=ts)).max()) for m in others)
    ft_ci = {m: difference(blocks(m, s_ft, ft, seeds=ts), blocks("none", s_ft, ft, seeds=ts)) for m in others}
    pi_seeds = sorted(set(x.ext.seeds("pi", s_ft, ft)) & set(x.ext.seeds("none", s_ft, ft)))
    pi_ft = difference(blocks("pi", s_ft, ft, seeds=pi_seeds), blocks("none", s_ft, ft, seeds=pi_seeds))
    pi_ft_worse = bool((get("pi", s_ft, ft, seeds=pi_seeds) > get("none", s_ft, ft, seeds=pi_seeds)).all()) \
        and pi_ft.above(0)
    rules["fine-tuned"] = (ft_gap < 0.1 and all(-0.1 < ci.low and ci.high < 0.1 for ci in ft_ci.values())
                           and pi_ft_worse)
    widest = max(ft_ci, key=lambda m: abs(ft_ci[m].estimate))
    f.update(r_ft_gap=_f2(ft_gap), r_ft=ft, r_ft_s=f"{s_ft:g}", r_ft_seeds=len(ts),
             r_ft_widest=f"{METHOD_LABELS[widest]} {ft_ci[widest].format(2)}", r_pi_ft=pi_ft.format(2),
             r_pi_ft_seeds=len(pi_seeds))

    # 8. Tooling: the frequency-only methods translate to llama.cpp, Dynamic NTK does not.
    no_dyn = llama_cpp_rope_args(method_config("dynamic", s_mid, L, x.head_dim), x.head_dim,
                                 max_position_embeddings=L) is None
    rules["llama.cpp"] = no_dyn and sm.xc_none and max(sm.xc_rel.values()) < 0.05
    f.update(r_xc=f"{100 * max(sm.xc_rel.values()):.1f}", r_xc_methods=_listing(sm.labels[m] for m in sm.xc_rel))

    # 9. Unbounded input on a RoPE model: a re-rotated sink cache.
    i4 = mult.index(4)
    four = ("rerope", "leaky_rerope", "self_extend", "sinks")
    tf_ci = {n: difference(t.blocks("plain", mult[-1]), t.blocks(n, mult[-1])) for n in four}
    tf_ahead = all((tf[n][:, i4:] < tf["plain"][:, i4:] - 1).all() and tf_ci[n].above(1) for n in four)
    sinks_alibi = difference(lab.sweep.blocks("alibi", "tail", lab.lengths[-1]), t.blocks("sinks", mult[-1]))
    sinks_vs_alibi = tf["sinks"][:, iL].max() < tail["alibi"][:, iL].min() and sinks_alibi.above(0)
    rerot = float((tf["sinks_no_rerotate"][:, i4] - tf["sinks"][:, i4]).min())
    rerot_ci = difference(t.blocks("sinks_no_rerotate", 4), t.blocks("sinks", 4))
    sink_effect = float(np.abs(tf["sinks"] - tf["window_only"]).max())
    sink_docs = context_value(stored.rows("10_context"), "sinks", sm.native, baseline="yarn")
    sink_key, rerope_key = t.far_rate("sinks"), t.far_rate("rerope")
    rules["streaming"] = (tf_ahead and sinks_vs_alibi and rerot > 0.25 and rerot_ci.above(0.25)
                          and sink_effect < 0.01 and not sink_docs["interval"].excludes(0)
                          and sink_key.high < 0.15 and rerope_key.low > 0.3)
    least_tf = min(tf_ci, key=lambda n: tf_ci[n].estimate)
    f.update(r_sinks_long=_f2(tf["sinks"][:, iL].mean()), r_mult4=f"{mult[i4]}x", r_rerot=_f2(rerot),
             r_rerot_ci=rerot_ci.format(2), r_sinks_alibi=sinks_alibi.format(2),
             r_tf_least=f"{TRAINFREE_LABELS[least_tf]} {tf_ci[least_tf].format(2)}",
             r_sink_docs=sink_docs["interval"].format(2), r_sink_effect=f"{sink_effect:.3f}",
             r_tf_seeds=" and ".join(map(str, t.seeds)), r_sink_key=sink_key.format(2),
             r_rerope_key=rerope_key.format(2))

    # 10. Grids: a 2-D RoPE, for modest growth only, and no reliable winner among the RoPEs.
    grids, g_train, g_last = g.grids, g.train, g.last
    trained = [n for n in _GRID_LABELS if n != "nope"]
    g1 = grids[1]
    ropes_first = max(trained, key=lambda n: gmean[n][g1]) in ("axial", "mixed")
    over = {(n, sz): _grid_compare(g, n, "learned", sz) for n in ("axial", "mixed") for sz in grids[1:]}
    over_learned = all(ci.above(0) for ci in over.values())
    axmix = _grid_compare(g, "axial", "mixed-b100", g1)
    axial = summ["axial"]["by_grid"][g1]
    shift_ok = all(abs(r["shifted_accuracy"][sz] - r["accuracy"][g_train]) <= 0.01
                   for r in g.data["runs"] if r["scheme"] in ("axial", "mixed") for sz in grids[1:])
    abs_shift = max(summ[n]["shifted"][g_last]["mean"] for n in ("learned", "sincos-2d"))
    halved = all(gmean[n][g_train] - gmean[n][g_last] > 0.5 for n in trained)
    rules["grids"] = (ropes_first and over_learned and not axmix.excludes(0) and axial["max"] - axial["min"] > 0.3
                      and shift_ok and abs_shift < 0.5 and halved)
    weakest = min(over, key=lambda k: over[k].low)
    f.update(r_axial_g1=_f2(gmean["axial"][g1]), r_mixed_g1=_f2(gmean["mixed"][g1]), r_axial_g1_lo=_f2(axial["min"]),
             r_axial_g1_hi=_f2(axial["max"]), r_grid_best_last=_f2(max(gmean[n][g_last] for n in trained)),
             r_g1=g1, r_glast=g_last, r_abs_shift=_f2(abs_shift), r_axmix=axmix.format(2),
             r_over_learned=f"{_GRID_LABELS[weakest[0]]} at G = {weakest[1]}, {over[weakest].format(2)}")

    # 11. Kernels: rotate or bias, not score.
    rules["kernels"] = (path["shaw"] == path["xl"] == path["cope"] == "reference"
                        and path["rope"] == "sdpa-causal" and kb.big["memory"] < 0.1
                        and kb.rope["apply_rope"]["hf_eager_over"] > 1.5)
    f.update(r_bias_mem=f"{kb.big['memory']:.4f}", r_bias_len=f"{int(kb.length):,}")

    line = (f"rules that hold on the stored data, {sum(rules.values())} of {len(rules)}: "
            + ", ".join(n for n, ok in rules.items() if ok))
    return Section([line], f, rules)


# ------------------------------------------------------------------------------------------------
# Chapter 13: the recipe (the base, ABF, local and global layers)


def _recipe(stored: Stored) -> SimpleNamespace:
    def build() -> SimpleNamespace:
        recipe = stored.data_dir / RECIPE_DIR
        bases = load_bases(recipe / "bases.csv")
        # chapter 9's parts (loaded already, as _extension reads them) and chapter 13's ABF run
        ch9 = _extension_parts(stored)
        abf_part = (*load_csv(recipe / "abf.csv"), load_result(recipe / "abf.json")["data"])
        abf = Extension(*merge_extensions([p for _, p in ch9] + [abf_part],
                                          names=[n for n, _ in ch9] + [f"{RECIPE_DIR}/abf"]))
        parts = {"08_sweep/rope-alibi": stored.results["08_sweep/rope-alibi"],
                 "11_sweep/b-hybrids": stored.results["11_sweep/b-hybrids"],
                 f"{RECIPE_DIR}/hybrids": load_result(recipe / "hybrids.json")}
        hybrids = Sweep(merge_sweeps(list(parts.values()), names=list(parts)))
        return SimpleNamespace(bases=bases, abf=abf, hybrids=hybrids)

    return _memo(stored, "recipe", build)


#: Chapter 13's protocol: the lab model's training length, the factor and length of its
#: fine-tunes (4x, 512 bytes), the longest budget, and the budgets.
RECIPE_L, RECIPE_S, RECIPE_FT, RECIPE_BUDGETS = 128, 4.0, 200, (2, 10, 50, 200)


def recipe_rules(stored: Stored) -> Section:
    """What chapter 13 measured of the modern recipe, as the guide's rules quote it.

    ``checks``:

    * *no base extrapolates*: as trained, every base of the sweep (1e2 to 1e6) rises more than
      2.5 bits per byte from 1x to 4x, on every seed;
    * *ABF*: at 4x (the fine-tune's length) raising the base (ABF) is ahead of fine-tuning with
      the base unchanged and of PI at every budget, on every seed, and the interval of the
      seed means excludes zero;
    * *YaRN ahead of ABF*: YaRN is ahead of ABF at every budget, on every seed, with intervals
      above zero;
    * *Men's bound*: Llama 2's base 1e4 turns ``B(m)`` negative inside its 4,096 tokens, and
      the bound for 4,096 tokens (:func:`companion.recipe.base_lower_bound`) is above 2e4;
    * *local/global*: the Gemma pattern (local RoPE + global RoPE 1e6) rises by 16x less than
      full RoPE on every seed and more than 0.5 bits; chunked RoPE + global NoPE rises less
      than 0.1 bits but costs more than 0.05 bits at 1x (interval).

    ``facts`` holds the intervals (95%, bootstrap over the scored blocks of the seed means,
    :func:`companion.lab.results.difference`) under the glue names the page uses.

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        FileNotFoundError: a chapter 13 result is missing from the data folder.
    """
    r = _recipe(_check_stored(stored))
    f: dict[str, Any] = {}
    checks: dict[str, bool] = {}
    L, S, FT = RECIPE_L, RECIPE_S, RECIPE_FT
    w = int(S) * L

    # 1. No base extrapolates without training.
    rise4 = []
    for b in r.bases.bases:
        ext = r.bases.extension(b)
        rise4.append(ext.get("none", 1.0, 0, "bpb_tail", 4 * L) - ext.get("none", 1.0, 0, "bpb_tail", L))
    rise4 = np.array(rise4)
    checks["no base extrapolates"] = bool((rise4 > 2.5).all())
    f.update(rc_rise4=f"{rise4.min():.1f}", rc_bases=f"{min(r.bases.bases):.0e} to {max(r.bases.bases):.0e}")

    # 2. ABF against fine-tuning with the base unchanged and against PI; 3. YaRN against ABF.
    ax = r.abf
    seeds = ax.seeds("abf", S, FT)

    def abf_minus(m: str, n: int) -> tuple[np.ndarray, Any]:
        per = ax.get("abf", S, n, "bpb_tail", w) - ax.get(m, S, n, "bpb_tail", w, seeds=seeds)
        ci = difference(ax.blocks("abf", S, n, "tail", w), ax.blocks(m, S, n, "tail", w, seeds=seeds))
        return per, ci

    ahead = {}
    for m in ("none", "pi"):
        res = {n: abf_minus(m, n) for n in RECIPE_BUDGETS}
        ahead[m] = all((per < 0).all() and ci.below(0) for per, ci in res.values())
        f[f"rc_abf_{m}"] = res[FT][1].format(2)
    checks["ABF"] = ahead["none"] and ahead["pi"]
    yarn = {n: abf_minus("yarn", n) for n in RECIPE_BUDGETS}
    checks["YaRN ahead of ABF"] = all((per > 0).all() and ci.above(0) for per, ci in yarn.values())
    f.update(rc_yarn_2=yarn[2][1].format(2), rc_yarn_ft=yarn[FT][1].format(3), rc_ft=FT, rc_seeds=len(seeds),
             rc_target=f"{w:,}")

    # 4. Men et al.'s lower bound on the base, on a Llama-sized head.
    llama2, bound4k = longest_context(1e4, 128), base_lower_bound(4096, 128)
    checks["Men's bound"] = llama2 < 4096 and bound4k > 2e4
    f.update(rc_llama2_reach=f"{llama2:,}", rc_bound_4k=f"{bound4k:.1e}")

    # 5. Local and global layers.
    hy = r.hybrids

    def rise16(s: str) -> tuple[np.ndarray, Any]:
        tail = hy.curve(s, "tail")
        i16 = hy.multiples.index(16)
        return tail[:, i16] - tail[:, 0], difference(hy.blocks(s, "tail", 16 * hy.train_len),
                                                     hy.blocks(s, "tail", hy.train_len))

    lg, lg_ci = rise16("rope-local-global")
    rope, rope_ci = rise16("rope")
    irope, irope_ci = rise16("irope")
    cost = difference(hy.blocks("irope", "tail", hy.train_len), hy.blocks("rope", "tail", hy.train_len))
    checks["local/global"] = bool(((lg > 0.5) & (lg < rope.min())).all() and (irope < 0.1).all()
                                  and cost.above(0.05))
    f.update(rc_lg_rise=lg_ci.format(2), rc_rope_rise=rope_ci.format(2), rc_irope_rise=irope_ci.format(3),
             rc_irope_cost=cost.format(3))
    line = (f"chapter 13's claims that hold on the stored data, {sum(checks.values())} of {len(checks)}: "
            + ", ".join(n for n, ok in checks.items() if ok))
    return Section([line], f, checks)


# ------------------------------------------------------------------------------------------------
# Inference engines


#: What a cell of the engine table may say.
ENGINE_STATUSES = ("yes", "no", "partial")
#: The engines, as :data:`ENGINE_SUPPORT` names them and as the tables show them.
ENGINE_LABELS = {"transformers": "transformers", "vllm": "vLLM", "llama.cpp": "llama.cpp",
                 "tensorrt-llm": "TensorRT-LLM", "sglang": "SGLang"}
#: The schemes, as :data:`ENGINE_SUPPORT` names them and as the tables show them.
SCHEME_ROWS = {"rope": "RoPE", "linear": "PI (linear)", "dynamic": "Dynamic NTK", "yarn": "YaRN",
               "llama3": "Llama 3 scaling", "longrope": "LongRoPE", "partial-rotary": "partial rotary",
               "interleaved-layout": "interleaved layout", "m-rope": "M-RoPE", "alibi": "ALiBi",
               "t5-bias": "T5 bias", "learned-absolute": "learned table", "kerple": "Kerple", "fire": "FIRE",
               "cope": "CoPE", "xpos": "xPos"}


def engine_support(stored: Stored) -> Section:
    """Which schemes each inference engine runs (transformers, vLLM, llama.cpp, TensorRT-LLM,
    SGLang), from :data:`ENGINE_SUPPORT`, in two tables of at most 7 columns (RoPE and its
    scaling types; the rest).

    ``checks``: every cell has a status (yes, no, partial) and at least one source; the
    research schemes (Kerple, FIRE, CoPE, xPos) run nowhere; the transformers row of the
    scaling types matches the installed transformers' ``ROPE_INIT_FUNCTIONS`` (where
    transformers is installed); and the rows the package can check itself agree with it:
    llama.cpp has no Dynamic NTK (:func:`companion.scaling.
    llama_cpp_rope_args` maps it to nothing) and its other scaling types map to llama.cpp's
    options.

    Raises:
        TypeError: ``stored`` is not a :class:`Stored`.
        FileNotFoundError: :data:`ENGINE_SUPPORT` is missing from the data folder.
        ValueError: the file does not have the expected engines and schemes.
    """
    path = _check_stored(stored).data_dir / ENGINE_SUPPORT
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the engine table reads it")
    data = json.loads(path.read_text(encoding="utf-8"))
    engines, schemes, support = data.get("engines"), data.get("schemes"), data.get("support", {})
    if list(engines or []) != list(ENGINE_LABELS) or sorted(schemes or []) != sorted(SCHEME_ROWS):
        raise ValueError(f"{path.name} must list the engines {list(ENGINE_LABELS)} and the schemes "
                         f"{sorted(SCHEME_ROWS)}, got {engines} and {schemes}")
    complete = True
    notes: list[str] = []
    rows: list[list[str]] = []
    for scheme in SCHEME_ROWS:
        row = [SCHEME_ROWS[scheme]]
        for engine in ENGINE_LABELS:
            cell = support.get(engine, {}).get(scheme, {})
            status = cell.get("status")
            complete &= status in ENGINE_STATUSES and bool(cell.get("sources"))
            row.append(status if status in ENGINE_STATUSES else "?")
            if status == "partial":
                notes.append(f"{ENGINE_LABELS[engine]}, {SCHEME_ROWS[scheme]}: {cell.get('note', '')}")
        rows.append(row)
    header = ["scheme", *ENGINE_LABELS.values()]
    rotary = [r for r, s in zip(rows, SCHEME_ROWS) if s in ("rope", "linear", "dynamic", "yarn", "llama3", "longrope",
                                                             "partial-rotary", "interleaved-layout", "m-rope")]
    others = [r for r in rows if r not in rotary]
    research = ("kerple", "fire", "cope", "xpos")
    nowhere = all(support[e][s]["status"] == "no" for e in ENGINE_LABELS for s in research)
    cpp = support["llama.cpp"]
    base = {"rope_theta": 1e4, "factor": 4.0}
    no_dynamic = llama_cpp_rope_args({"rope_type": "dynamic", **base}, 128, max_position_embeddings=4096) is None
    maps = all(llama_cpp_rope_args(cfg, 128, max_position_embeddings=4096) is not None for cfg in (
        {"rope_type": "linear", **base},
        {"rope_type": "yarn", **base, "original_max_position_embeddings": 4096}))
    try:   # the installed transformers, where there is one (the hf extra pins it)
        with warnings.catch_warnings():   # tqdm warns about notebook widgets on import
            warnings.simplefilter("ignore")
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        hf_agrees = True
    else:
        hf_agrees = all((support["transformers"][t]["status"] == "yes") == (t in ROPE_INIT_FUNCTIONS)
                        for t in ("linear", "dynamic", "yarn", "llama3", "longrope"))
    checks = {"every cell sourced": complete, "research schemes run nowhere": nowhere,
              "the installed transformers agrees": hf_agrees,
              "llama.cpp agrees with the package": (cpp["dynamic"]["status"] == "no") == no_dynamic
              and cpp["linear"]["status"] == cpp["yarn"]["status"] == "yes" and maps}
    lines = [f"checked on {data.get('checked_on', '?')} against the engines' sources (one per cell in "
             f"chapters/data/{ENGINE_SUPPORT})"] + notes
    def where(scheme: str, status: str = "yes") -> list[str]:
        return [ENGINE_LABELS[e] for e in ENGINE_LABELS if support[e][scheme]["status"] == status]

    def listed(names: list[str]) -> str:
        return _listing(names) if names else "none"

    facts = {"eng_checked": data.get("checked_on", "?"), "eng_no_dynamic": listed(where("dynamic", "no")),
             "eng_alibi": f"{len(where('alibi'))} of {len(ENGINE_LABELS)}",
             "eng_alibi_partial": listed(where("alibi", "partial")), "eng_no_t5": listed(where("t5-bias", "no"))}
    return Section(lines, facts, checks, {"table_engines_rope": Table(header, rotary),
                                          "table_engines_other": Table(header, others)})
