"""Stored lab results, indexed for the claims the chapters make about them.

:class:`Sweep` reads the JSON that ``python -m companion.lab sweep`` writes (chapter 8) and
:class:`Extension` the CSV and JSON of ``python -m companion.lab extend`` (chapter 9). Both
return NumPy arrays with one row per seed, so that a claim can be checked seed by seed
(:func:`companion.lab.stats.check_seeds`), and the per-block values behind every
bits-per-byte mean, so that it can be given a bootstrap interval
(:func:`companion.lab.stats.paired_bootstrap_ci`) without running anything again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .stats import Interval, paired_bootstrap_ci

__all__ = ["Sweep", "Extension", "difference"]

#: The bits-per-byte metrics of a sweep: all positions, the last 64 (tail), sliding window.
BPB_METRICS = ("all", "tail", "sliding")


def difference(a: np.ndarray, b: np.ndarray, **kwargs: Any) -> Interval:
    """Interval for ``mean(a) - mean(b)`` of two ``(seeds, blocks)`` arrays on the same blocks.

    Each array is first averaged over its own seeds, block by block (the two may have other
    seeds, or another number of them: they are different models), then the blocks are
    resampled in pairs (:func:`~companion.lab.stats.paired_bootstrap_ci`). The interval
    reflects the text; whether a claim holds seed by seed is a separate check.
    """
    a, b = np.atleast_2d(np.asarray(a, float)), np.atleast_2d(np.asarray(b, float))
    return paired_bootstrap_ci(a.mean(0), b.mean(0), **kwargs)


class Sweep:
    """A chapter 8 sweep (the ``data`` of its result file), by scheme, seed and length."""

    def __init__(self, data: Mapping[str, Any]) -> None:
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
        return np.array([e["blocks"][metric][w] for e in self._eval(scheme)])

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
    """A chapter 9 extension run: the CSV rows of means and the JSON's per-unit values."""

    def __init__(self, rows: Sequence[Mapping[str, str]], data: Mapping[str, Any]) -> None:
        self.data = data
        self._vals: dict[tuple, dict[int, float]] = {}
        for r in rows:
            key = (r["method"], float(r["factor"]), int(r["finetune_steps"]), r["metric"], int(r["length"]),
                   r["where"])
            self._vals.setdefault(key, {})[int(r["seed"])] = float(r["value"])
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
