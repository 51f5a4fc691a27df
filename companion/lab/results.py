"""Stored lab results, indexed for the claims the chapters make about them.

:class:`Sweep` reads the JSON that ``python -m companion.lab sweep`` writes (chapter 8) and
:class:`Extension` the CSV and JSON of ``python -m companion.lab extend`` (chapter 9), and
:class:`Bases` those of ``python -m companion.lab.recipe_lab bases`` (chapter 13). All
return NumPy arrays with one row per seed, so that a claim can be checked seed by seed
(:func:`companion.lab.stats.check_seeds`), and the per-block values behind every
bits-per-byte mean, so that it can be given a bootstrap interval
(:func:`companion.lab.stats.paired_bootstrap_ci`) without running anything again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._checks import check_path
from ..utils import load_csv, load_result
from .stats import Interval, paired_bootstrap_ci

__all__ = ["Sweep", "Extension", "Bases", "difference", "merge_sweeps", "load_sweep", "merge_extensions",
           "load_extension", "load_bases"]

#: The bits-per-byte metrics of a sweep: all positions, the last 64 (tail), sliding window.
BPB_METRICS = ("all", "tail", "sliding")

#: What a sweep's ``data`` holds (and :class:`Sweep` reads): the evaluation config and the
#: runs, each with its ``config`` (scheme, seed, training length) and ``eval``.
_SWEEP_HOLDS = ("a sweep's data holds 'eval_config' and 'runs' (a non-empty list, each run with 'config' "
                "{'scheme', 'seed', 'seq_len', ...} and 'eval' {'lengths', 'passkey', ...})")

#: The fields of an extension CSV row (``companion.lab.extend.CSV_FIELDS``, kept here to avoid
#: importing the trainer) and of an extension job's per-unit record.
_ROW_FIELDS = ("seed", "method", "factor", "finetune_steps", "metric", "length", "where", "value")
_UNIT_FIELDS = ("method", "factor", "finetune_steps", "seed")


def _missing(value: object, keys: Sequence[str]) -> list[str]:
    """The ``keys`` a mapping ``value`` lacks (all of them when it is not a mapping)."""
    return [k for k in keys if not isinstance(value, Mapping) or k not in value]


def _check_sweep_data(data: object) -> None:
    """Raise unless ``data`` has the layout :class:`Sweep` reads (see ``_SWEEP_HOLDS``)."""
    if not isinstance(data, Mapping):
        raise TypeError(f"data must be a sweep's data (a dict), got {type(data).__name__}; {_SWEEP_HOLDS}")
    lacks = _missing(data, ("eval_config", "runs"))
    if lacks:
        raise ValueError(f"data is not a sweep's data: it lacks {', '.join(map(repr, lacks))}; {_SWEEP_HOLDS}")
    runs = data["runs"]
    if isinstance(runs, (str, bytes, Mapping)) or not isinstance(runs, Sequence) or not runs:
        raise ValueError(f"data['runs'] must be a non-empty list of runs, got {runs!r:.80}; {_SWEEP_HOLDS}")
    for i, r in enumerate(runs):
        lacks = [repr(k) for k in _missing(r, ("config", "eval"))]
        if not lacks:
            lacks = [f"config[{k!r}]" for k in _missing(r["config"], ("scheme", "seed", "seq_len"))]
        if not lacks and i == 0:
            lacks = [f"eval[{k!r}]" for k in _missing(r["eval"], ("lengths", "passkey"))]
            if not lacks:
                lacks = [f"eval['passkey'][{k!r}]" for k in _missing(r["eval"]["passkey"], ("lengths", "depths"))]
        if lacks:
            raise ValueError(f"data['runs'][{i}] lacks {', '.join(lacks)}; {_SWEEP_HOLDS}")


def difference(a: np.ndarray, b: np.ndarray, **kwargs: Any) -> Interval:
    """Interval for ``mean(a) - mean(b)`` of two ``(seeds, blocks)`` arrays on the same blocks.

    Each array is first averaged over its own seeds, block by block (the two may have other
    seeds, or another number of them: they are different models), then the blocks are
    resampled in pairs (:func:`~companion.lab.stats.paired_bootstrap_ci`). The interval
    reflects the text; whether a claim holds seed by seed is a separate check.
    """
    a, b = np.atleast_2d(np.asarray(a, float)), np.atleast_2d(np.asarray(b, float))
    return paired_bootstrap_ci(a.mean(0), b.mean(0), **kwargs)


def merge_sweeps(parts: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None) -> dict[str, Any]:
    """One sweep's ``data`` from the result files of several sweeps run with one protocol.

    A sweep too long for one sitting is run in parts (each ``python -m companion.lab sweep``
    over some schemes or seeds, with its own ``--out``); each part is a whole result payload
    (``provenance`` and ``data``). The parts must share the evaluation config and the corpus,
    and no (scheme, seed) may appear twice. The merged ``data`` has every part's runs in order,
    the shared ``eval_config`` and ``corpus``, ``wall_seconds`` and ``workers`` of the parts
    summed (``wall_seconds``: the time the parts took one after the other; ``workers``: the
    largest), and ``parts``: for each, its name, provenance, wall seconds and (scheme, seed)
    pairs, so that a reader sees which machine ran which runs.

    Raises:
        ValueError: no parts, a part that is not a sweep result, parts with different
            evaluation configs or corpora, or a (scheme, seed) in two parts.
    """
    if not parts:
        raise ValueError("parts must hold at least one sweep result, got none")
    names = [f"part {i}" for i in range(len(parts))] if names is None else list(names)
    if len(names) != len(parts):
        raise ValueError(f"names must have one entry per part ({len(parts)}), got {len(names)}")
    runs: list[dict[str, Any]] = []
    seen: dict[tuple[str, int], str] = {}
    info = []
    first = None
    for name, part in zip(names, parts):
        data = part.get("data") if isinstance(part, Mapping) else None
        if not isinstance(data, Mapping) or not {"eval_config", "runs", "corpus"} <= set(data):
            raise ValueError(f"{name} is not a sweep result (expected 'data' with 'eval_config', 'runs', 'corpus')")
        if first is None:
            first = (name, data)
        else:
            for key in ("eval_config", "corpus"):
                if data[key] != first[1][key]:
                    raise ValueError(f"{name} has another {key} than {first[0]}: the parts of one sweep must "
                                     f"share one protocol ({data[key]} against {first[1][key]})")
        pairs = []
        for r in data["runs"]:
            key = (r["config"]["scheme"], int(r["config"]["seed"]))
            if key in seen:
                raise ValueError(f"scheme {key[0]!r} seed {key[1]} is in both {seen[key]} and {name}")
            seen[key] = name
            pairs.append(list(key))
            runs.append(r)
        info.append({"name": name, "provenance": part.get("provenance"),
                     "wall_seconds": data.get("wall_seconds"), "runs": pairs})
    return {
        "eval_config": first[1]["eval_config"],
        "corpus": first[1]["corpus"],
        "runs": runs,
        "wall_seconds": sum(float(p["wall_seconds"] or 0.0) for p in info),
        "workers": max(int(p["data"].get("workers", 1)) for p in parts),
        "parts": info,
    }


def load_sweep(path: str | os.PathLike[str]) -> "Sweep":
    """A :class:`Sweep` from one result file, or from a folder of parts (every ``*.json``
    in it, in name order, merged by :func:`merge_sweeps`).

    Raises:
        TypeError: ``path`` is not a ``str`` or ``os.PathLike`` (``None``, say).
        FileNotFoundError: no such file or folder, or a folder without ``.json`` files.
        ValueError: a file that is not a sweep result (it names the file and what a sweep's
            data holds), or what :func:`~companion.utils.load_result` or
            :func:`merge_sweeps` raise.
    """
    path = check_path(path, "path")
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise FileNotFoundError(f"path {path} holds no .json sweep parts")
        return Sweep(merge_sweeps([load_result(f) for f in files], names=[f.name for f in files]))
    result = load_result(path)
    data = result.get("data") if isinstance(result, Mapping) else None
    try:
        _check_sweep_data(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"path {path} is not a sweep result ({exc})") from None
    return Sweep(data)


class Sweep:
    """A chapter 8 sweep (the ``data`` of its result file), by scheme, seed and length.

    ``data`` holds ``eval_config`` and ``runs``: a non-empty list, each run with its
    ``config`` (``scheme``, ``seed``, ``seq_len``, ...) and ``eval`` (``lengths``,
    ``passkey`` with its ``lengths`` and ``depths``, ...), as ``python -m companion.lab
    sweep`` writes them.

    Raises:
        TypeError: ``data`` is not a mapping.
        ValueError: ``data`` lacks one of those fields (the message names it), or holds two
            runs of the same scheme and seed.
    """

    def __init__(self, data: Mapping[str, Any]) -> None:
        _check_sweep_data(data)
        self.data = data
        self.eval_config = data["eval_config"]
        self.runs = {(r["config"]["scheme"], r["config"]["seed"]): r for r in data["runs"]}
        if len(self.runs) != len(data["runs"]):
            raise ValueError("the sweep holds two runs of the same scheme and seed")
        self.schemes = list(dict.fromkeys(r["config"]["scheme"] for r in data["runs"]))
        first = data["runs"][0]
        self.train_len = int(first["config"]["seq_len"])
        self.lengths = [int(w) for w in first["eval"]["lengths"]]
        self.multiples = [w // self.train_len for w in self.lengths]
        pk = first["eval"]["passkey"]
        self.passkey_lengths = [int(w) for w in pk["lengths"]]
        self.depths = [float(d) for d in pk["depths"]]

    def seeds(self, scheme: str) -> list[int]:
        """The seeds of ``scheme``, sorted."""
        if scheme not in self.schemes:
            raise ValueError(f"scheme must be one of {self.schemes}, got {scheme!r}")
        return sorted(sd for s, sd in self.runs if s == scheme)

    def _eval(self, scheme: str) -> list[dict[str, Any]]:
        return [self.runs[scheme, sd]["eval"] for sd in self.seeds(scheme)]

    def _index(self, length: int) -> str:
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or int(length) not in self.lengths:
            raise ValueError(f"length must be one of {self.lengths}, got {length!r}")
        return str(int(length))

    def curve(self, scheme: str, metric: str = "tail") -> np.ndarray:
        """``(seeds, lengths)`` mean bits per byte of ``metric`` (``all``, ``tail``, ``sliding``)."""
        if metric not in BPB_METRICS:
            raise ValueError(f"metric must be one of {BPB_METRICS}, got {metric!r}")
        if metric == "sliding":
            return np.array([[e["sliding_bpb"][str(w)] for w in self.lengths] for e in self._eval(scheme)])
        return np.array([[e["bpb"][str(w)][metric] for w in self.lengths] for e in self._eval(scheme)])

    def blocks(self, scheme: str, metric: str, length: int) -> np.ndarray:
        """``(seeds, blocks)`` per-block bits per byte of ``metric`` at ``length``."""
        if metric not in BPB_METRICS:
            raise ValueError(f"metric must be one of {BPB_METRICS}, got {metric!r}")
        w = self._index(length)
        evals = self._eval(scheme)
        if any("blocks" not in e for e in evals):
            raise ValueError(f"this sweep stores no per-block values for {scheme!r} (it was run before the "
                             f"lab stored them); re-run it with the current `python -m companion.lab sweep`")
        return np.array([e["blocks"][metric][w] for e in evals])

    def passkey(self, scheme: str, key: str = "exact") -> np.ndarray:
        """``(seeds, lengths, depths)`` passkey cells (``exact``, ``gain``, ``bits``,
        ``control_bits``), or ``(seeds, lengths, depths, trials)`` for ``exact_trials`` and
        ``gain_trials``."""
        keys = ("exact", "gain", "bits", "control_bits", "exact_trials", "gain_trials")
        if key not in keys:
            raise ValueError(f"key must be one of {keys}, got {key!r}")
        return np.array([e["passkey"][key] for e in self._eval(scheme)])

    def entropy(self, scheme: str) -> np.ndarray:
        """``(seeds, lengths, layers)`` attention entropy in bits."""
        return np.array([[e["entropy"][str(w)] for w in self.lengths] for e in self._eval(scheme)])


class Extension:
    """A chapter 9 extension run: the CSV rows of means and the JSON's per-unit values.

    ``rows`` are the CSV's rows, each with the fields ``seed``, ``method``, ``factor``,
    ``finetune_steps``, ``metric``, ``length``, ``where`` and ``value``; ``data`` is the
    JSON's ``data``, whose optional ``units`` (one per job, each with ``method``, ``factor``,
    ``finetune_steps``, ``seed`` and its per-unit values) feed :meth:`Extension.blocks` and
    :meth:`Extension.trials`.

    Raises:
        TypeError: ``rows`` is not a sequence of mappings, or ``data`` not a mapping.
        ValueError: a row or unit lacking one of its fields (the message names the row and
            the field), or two units of the same job.
    """

    def __init__(self, rows: Sequence[Mapping[str, str]], data: Mapping[str, Any]) -> None:
        if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
            raise TypeError(f"rows must be a list of an extension CSV's rows (dicts with the fields "
                            f"{list(_ROW_FIELDS)}), got {type(rows).__name__}")
        if not isinstance(data, Mapping):
            raise TypeError(f"data must be an extension result's data (a dict, its optional 'units' one per job), "
                            f"got {type(data).__name__}")
        for i, r in enumerate(rows):
            if not isinstance(r, Mapping):
                raise TypeError(f"rows[{i}] must be a dict with the fields {list(_ROW_FIELDS)}, got {type(r).__name__}")
            lacks = _missing(r, _ROW_FIELDS)
            if lacks:
                raise ValueError(f"rows[{i}] lacks the field(s) {', '.join(map(repr, lacks))}; a row of an "
                                 f"extension CSV holds {list(_ROW_FIELDS)}")
        units = data.get("units", [])
        if isinstance(units, (str, bytes, Mapping)) or not isinstance(units, Sequence):
            raise TypeError(f"data['units'] must be a list of per-unit records, got {type(units).__name__}")
        for i, u in enumerate(units):
            lacks = _missing(u, _UNIT_FIELDS)
            if lacks:
                raise ValueError(f"data['units'][{i}] lacks the field(s) {', '.join(map(repr, lacks))}; a unit "
                                 f"of an extension result holds {list(_UNIT_FIELDS)} and its per-unit values")
        self.data = data
        self._vals: dict[tuple, dict[int, float]] = {}
        for i, r in enumerate(rows):
            try:
                key = (r["method"], float(r["factor"]), int(r["finetune_steps"]), r["metric"], int(r["length"]),
                       r["where"])
                self._vals.setdefault(key, {})[int(r["seed"])] = float(r["value"])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"rows[{i}] is not a row of an extension CSV (factor and value numbers, seed, "
                                 f"finetune_steps and length integers): {exc}") from None
        self._units = {(u["method"], float(u["factor"]), int(u["finetune_steps"]), int(u["seed"])): u
                       for u in data.get("units", [])}
        if len(self._units) != len(data.get("units", [])):
            raise ValueError("the extension run holds two jobs with the same method, factor, steps and seed")
        self.methods = list(dict.fromkeys(r["method"] for r in rows))
        self.factors = sorted({float(r["factor"]) for r in rows} - {1.0})
        self.steps = sorted({int(r["finetune_steps"]) for r in rows})

    @staticmethod
    def _factor(method: str, factor: float, steps: int) -> float:
        # unscaled RoPE without fine-tuning is stored once, at factor 1
        return 1.0 if (method == "none" and steps == 0) else float(factor)

    def has(self, method: str, factor: float, steps: int, metric: str, length: int, where: str = "") -> bool:
        """Whether the run measured this cell."""
        return (method, self._factor(method, factor, steps), steps, metric, int(length), where) in self._vals

    def seeds(self, method: str, factor: float, steps: int, metric: str = "bpb_tail", length: int | None = None,
              where: str = "") -> list[int]:
        """The seeds measured for a cell (any length of the job when ``length`` is None)."""
        f = self._factor(method, factor, steps)
        w0 = None if length is None else int(length)
        found = {sd for (m, ff, n, met, w, wh), d in self._vals.items() for sd in d
                 if (m, ff, n, met, wh) == (method, f, steps, metric, where) and (w0 is None or w == w0)}
        return sorted(found)

    def _job_units(self, method: str, factor: float, steps: int, seeds: Sequence[int], what: str) -> list[dict]:
        f = self._factor(method, factor, steps)
        if not seeds:
            raise KeyError(f"no {what} measured for {(method, f, steps)}")
        missing = [sd for sd in seeds if (method, f, steps, sd) not in self._units]
        if missing:
            raise KeyError(f"no per-unit values for {(method, f, steps)} on seeds {missing}")
        return [self._units[method, f, steps, sd] for sd in seeds]

    def get(self, method: str, factor: float, steps: int, metric: str, length: int, where: str = "",
            seeds: Sequence[int] | None = None) -> np.ndarray:
        """One value per seed (``seeds``, default every seed measured), as an array."""
        key = (method, self._factor(method, factor, steps), steps, metric, int(length), where)
        if key not in self._vals:
            raise KeyError(f"no measurement {key}")
        d = self._vals[key]
        return np.array([d[s] for s in (sorted(d) if seeds is None else seeds)])

    def blocks(self, method: str, factor: float, steps: int, metric: str, length: int,
               seeds: Sequence[int] | None = None) -> np.ndarray:
        """``(seeds, blocks)`` per-block bits per byte (``tail`` or ``sliding``) of a job."""
        chosen = self.seeds(method, factor, steps, "bpb_tail", length) if seeds is None else list(seeds)
        units = self._job_units(method, factor, steps, chosen, f"{metric} blocks at length {length}")
        try:
            return np.array([u[metric][str(int(length))] for u in units])
        except KeyError as exc:
            raise KeyError(f"no {metric} blocks at length {length} for {(method, factor, steps)}") from exc

    def trials(self, method: str, factor: float, steps: int, length: int, depth: str, key: str = "exact",
               seeds: Sequence[int] | None = None) -> np.ndarray:
        """``(seeds, trials)`` passkey trials (``exact`` 0/1 or ``gain``) of a job at one depth."""
        chosen = self.seeds(method, factor, steps, "passkey_exact", length, depth) if seeds is None else list(seeds)
        units = self._job_units(method, factor, steps, chosen, f"passkey trials at length {length}, depth {depth!r}")
        try:
            return np.array([u["passkey"][str(int(length))][depth][key] for u in units])
        except KeyError as exc:
            raise KeyError(f"no passkey {key!r} trials at length {length}, depth {depth!r} "
                           f"for {(method, factor, steps)}") from exc


def merge_extensions(parts: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, str]], Mapping[str, Any]]],
                     names: Sequence[str] | None = None) -> tuple[list[Mapping[str, str]], dict[str, Any]]:
    """The ``(rows, data)`` of one extension run from several run with one protocol.

    Each part is ``(provenance, rows, data)``: what :func:`~companion.utils.load_csv` reads
    from a part's CSV and the ``data`` of its JSON (``python -m companion.lab extend`` over
    some seeds, with its own ``--out`` and ``--json``). The parts must share the
    ``extend_config``, and no job (method, factor, fine-tune steps, seed) may appear twice; a
    LongRoPE search may (a part that fine-tunes LongRoPE reads its checkpoints' searches again),
    and is kept once if it is the same in every part.
    ``data`` has the parts' ``units``, ``searches`` and ``finetune_logs`` concatenated,
    ``job_seconds`` and ``wall_seconds`` summed, and ``parts``: for each, its name,
    provenance, wall seconds and seeds.

    Raises:
        ValueError: no parts, a part without ``extend_config`` or ``units``, parts with
            different configs, or a job in two parts.
    """
    if not parts:
        raise ValueError("parts must hold at least one extension result, got none")
    names = [f"part {i}" for i in range(len(parts))] if names is None else list(names)
    if len(names) != len(parts):
        raise ValueError(f"names must have one entry per part ({len(parts)}), got {len(names)}")
    rows: list[Mapping[str, str]] = []
    merged: dict[str, Any] = {"units": [], "searches": [], "finetune_logs": [], "job_seconds": 0.0,
                              "wall_seconds": 0.0, "parts": []}
    seen: dict[tuple, str] = {}
    searches_seen: dict[tuple, Any] = {}
    for name, (prov, part_rows, data) in zip(names, parts):
        if not isinstance(data, Mapping) or "extend_config" not in data or "units" not in data:
            raise ValueError(f"{name} is not an extension result (expected 'extend_config' and 'units')")
        if "extend_config" not in merged:
            merged["extend_config"], first = data["extend_config"], name
        elif data["extend_config"] != merged["extend_config"]:
            raise ValueError(f"{name} has another extend_config than {first}: the parts of one run must share "
                             f"one protocol ({data['extend_config']} against {merged['extend_config']})")
        for u in data["units"]:
            key = (u["method"], float(u["factor"]), int(u["finetune_steps"]), int(u["seed"]))
            if key in seen:
                raise ValueError(f"job {key} (method, factor, steps, seed) is in both {seen[key]} and {name}")
            seen[key] = name
        rows.extend(part_rows)
        for key in ("units", "finetune_logs"):
            merged[key].extend(data.get(key, []))
        for search in data.get("searches", []):
            # a part that fine-tunes LongRoPE re-reads the searches of its checkpoints (from the
            # run's cache): the same search in two parts is kept once, and must be the same
            skey = (os.path.basename(str(search.get("checkpoint"))), float(search.get("factor", 0)),
                    search.get("search_seed"))
            same = {k: v for k, v in search.items() if k != "checkpoint"}
            if skey in searches_seen:
                if searches_seen[skey] != same:
                    raise ValueError(f"the LongRoPE search {skey} (checkpoint, factor, search seed) differs between "
                                     f"parts; the parts of one run must share their searches")
                continue
            searches_seen[skey] = same
            merged["searches"].append(search)
        for key in ("job_seconds", "wall_seconds"):
            merged[key] += float(data.get(key, 0.0))
        merged["parts"].append({"name": name, "provenance": prov, "wall_seconds": data.get("wall_seconds"),
                                "seeds": sorted({int(u["seed"]) for u in data["units"]})})
    return rows, merged


def load_extension(path: str | os.PathLike[str]) -> "Extension":
    """An :class:`Extension` from a folder of parts: every ``NAME.csv`` in it with its
    ``NAME.json`` (the ``--out`` and ``--json`` of one ``extend`` command), in name order,
    merged by :func:`merge_extensions`.

    Raises:
        TypeError: ``path`` is not a ``str`` or ``os.PathLike`` (``None``, say).
        FileNotFoundError: no such folder, a folder without ``.csv`` files, or a CSV without
            its JSON.
        NotADirectoryError: ``path`` is a file.
        ValueError: what :func:`~companion.utils.load_csv`, :func:`~companion.utils.load_result`,
            :func:`merge_extensions` or :class:`Extension` raise.
    """
    path = check_path(path, "path")
    if not path.exists():
        raise FileNotFoundError(f"path {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"path {path} is a file; pass the folder of an extension run's parts")
    csvs = sorted(path.glob("*.csv"))
    if not csvs:
        raise FileNotFoundError(f"path {path} holds no .csv extension parts")
    parts = []
    for f in csvs:
        js = f.with_suffix(".json")
        if not js.is_file():
            raise FileNotFoundError(f"part {f.name} has no {js.name} beside it (the --json of its command)")
        prov, rows = load_csv(f)
        parts.append((prov, rows, load_result(js)["data"]))
    rows, data = merge_extensions(parts, names=[f.stem for f in csvs])
    return Extension(rows, data)


class Bases:
    """Chapter 13's bases run: one :class:`Extension` per RoPE base, and what
    :mod:`companion.recipe` predicts for each.

    ``rows`` are the run's CSV rows (:data:`companion.lab.recipe_lab.BASES_CSV_FIELDS`: an
    extension row with its ``scheme`` and ``base``), ``data`` the ``data`` of its JSON
    (``units`` each with its ``scheme``, and ``bounds`` keyed by scheme). ``bases`` lists the
    bases in increasing order; :meth:`extension` gives one base's jobs (method ``none``, as
    trained at factor 1 and fine-tuned at the run's factor); :meth:`bound` its bounds.

    Raises:
        TypeError: ``rows`` or ``data`` of the wrong type.
        ValueError: a row without ``scheme`` or ``base`` (or a base that is not a number), a
            unit without ``scheme``, one scheme under two bases, or what :class:`Extension` raises.
    """

    def __init__(self, rows: Sequence[Mapping[str, str]], data: Mapping[str, Any]) -> None:
        if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
            raise TypeError(f"rows must be a list of a bases CSV's rows, got {type(rows).__name__}")
        if not isinstance(data, Mapping):
            raise TypeError(f"data must be a bases result's data (a dict), got {type(data).__name__}")
        schemes: dict[str, float] = {}
        for i, r in enumerate(rows):
            if not isinstance(r, Mapping) or _missing(r, ("scheme", "base")):
                raise ValueError(f"rows[{i}] lacks 'scheme' or 'base'; a row of a bases CSV holds them before "
                                 f"{list(_ROW_FIELDS)}")
            try:
                base = float(r["base"])
            except (TypeError, ValueError):
                raise ValueError(f"rows[{i}] has base {r['base']!r}, not a number") from None
            if schemes.setdefault(r["scheme"], base) != base:
                raise ValueError(f"scheme {r['scheme']!r} appears under two bases ({schemes[r['scheme']]:g} and "
                                 f"{base:g})")
        units = data.get("units", [])
        if isinstance(units, (str, bytes, Mapping)) or not isinstance(units, Sequence):
            raise TypeError(f"data['units'] must be a list of per-unit records, got {type(units).__name__}")
        for i, u in enumerate(units):
            if not isinstance(u, Mapping) or "scheme" not in u:
                raise ValueError(f"data['units'][{i}] lacks 'scheme'")
        self.data = data
        self.bases = sorted(set(schemes.values()))
        self._scheme = {b: s for s, b in schemes.items()}
        self._ext = {
            b: Extension([r for r in rows if r["scheme"] == s],
                         {"units": [u for u in units if u["scheme"] == s]})
            for b, s in self._scheme.items()}

    def _base(self, base: float) -> float:
        if isinstance(base, bool) or not isinstance(base, (int, float, np.integer, np.floating)) or \
                float(base) not in self._ext:
            raise ValueError(f"base must be one of {self.bases}, got {base!r}")
        return float(base)

    def scheme(self, base: float) -> str:
        """The lab scheme trained at ``base`` (``rope`` at 10000, ``rope-b<base>`` otherwise)."""
        return self._scheme[self._base(base)]

    def extension(self, base: float) -> Extension:
        """The jobs of the models trained at ``base``, as an :class:`Extension`."""
        return self._ext[self._base(base)]

    def bound(self, base: float) -> dict[str, Any]:
        """What :mod:`companion.recipe` predicts for ``base`` (``critical_dimension``,
        ``extrapolation_bound``, ``longest_context``, ``head_dim``, ``train_len``)."""
        bounds = self.data.get("bounds", {})
        scheme = self.scheme(base)
        if scheme not in bounds:
            raise KeyError(f"the run stores no bounds for {scheme!r}")
        return dict(bounds[scheme])


def load_bases(path: str | os.PathLike[str]) -> Bases:
    """A :class:`Bases` from the CSV of a ``recipe_lab bases`` run and the JSON beside it
    (same name, ``.json``).

    Raises:
        TypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        FileNotFoundError: no such CSV, or no JSON beside it.
        ValueError: what :func:`~companion.utils.load_csv`, :func:`~companion.utils.load_result`
            or :class:`Bases` raise.
    """
    path = check_path(path, "path")
    if not path.is_file():
        raise FileNotFoundError(f"path {path} is not a file (the CSV of a bases run, its --out)")
    js = path.with_suffix(".json")
    if not js.is_file():
        raise FileNotFoundError(f"{path.name} has no {js.name} beside it (the --json of its command)")
    _, rows = load_csv(path)
    return Bases(rows, load_result(js)["data"])
