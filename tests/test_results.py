"""Tests for companion.lab.results: :class:`Sweep` over a chapter 8 sweep, :class:`Extension`
over a chapter 9 extension run, and :func:`difference`.

Every input is synthetic and small, built here in the layouts that
:func:`companion.lab.sweep.evaluate_model` (a sweep's ``eval``) and
:func:`companion.lab.extend.extension_job` (an extension's ``rows`` and ``units``) produce. The
values are drawn from seeded generators and kept in a separate "truth" record, so every expected
array is assembled independently of the code under test (the indexing is what is tested, not
arithmetic). Seeds are stored out of order and schemes / jobs have different numbers of seeds,
so that an implementation that kept the stored order, or assumed equal seed counts, fails.

The file formats are exercised too: a sweep through :func:`companion.utils.save_result` /
:func:`~companion.utils.load_result` and extension rows through
:func:`companion.utils.save_csv` / :func:`~companion.utils.load_csv`.

Equalities are exact where the values are copied (JSON writes a float's shortest repr, which
reads back to the same double; the CSV stores strings that both sides parse with ``float``).
The one tolerance, on a mean of means, is derived where it is used.
"""

from __future__ import annotations

import itertools
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pytest

from companion.lab.extend import CSV_FIELDS
from companion.lab.results import (Extension, Sweep, difference, load_extension, load_sweep, merge_extensions,
                                   merge_sweeps)
from companion.lab.stats import Interval, bootstrap_ci, paired_bootstrap_ci
from companion.utils import load_csv, load_result, save_csv, save_result

EPS = np.finfo(np.float64).eps

# ----------------------------------------------------------------------------------------------
# a synthetic sweep
# ----------------------------------------------------------------------------------------------

TRAIN_LEN = 32
MULTIPLES = [1, 2, 4, 8]
LENGTHS = [m * TRAIN_LEN for m in MULTIPLES]  # what evaluate_model stores as "lengths"
PK_MULTIPLES = [2, 4]
PK_LENGTHS = [m * TRAIN_LEN for m in PK_MULTIPLES]
DEPTHS = [0.0, 0.5, 1.0]
N_BLOCKS = 5
N_TRIALS = 4
N_LAYERS = 3

# (scheme, seed) in the stored order: schemes interleaved, seeds out of order, 3 / 2 / 1 seeds.
# "nope:causal" has a colon, as user schemes may.
RUN_ORDER = [("rope", 2), ("alibi", 5), ("rope", 0), ("nope:causal", 7), ("alibi", 3), ("rope", 1)]
SCHEMES = ["rope", "alibi", "nope:causal"]  # order of first appearance in RUN_ORDER
SEEDS = {"rope": [0, 1, 2], "alibi": [3, 5], "nope:causal": [7]}  # sorted, per scheme


def _sweep_truth(scheme: str, seed: int) -> dict[str, np.ndarray]:
    """The values of one run, as arrays indexed by position in LENGTHS / PK_LENGTHS / DEPTHS.

    Each metric has its own range (all in [1, 2), tail [2, 3), sliding [3, 4)) so a mix-up
    between metrics cannot go unnoticed, and every (scheme, seed) its own generator."""
    rng = np.random.default_rng([SCHEMES.index(scheme), seed, 8])
    nl, npk, nd = len(LENGTHS), len(PK_LENGTHS), len(DEPTHS)
    exact_trials = rng.integers(0, 2, size=(npk, nd, N_TRIALS))
    gain_trials = rng.normal(1.0, 0.5, size=(npk, nd, N_TRIALS))
    bits = rng.uniform(0.5, 3.0, size=(npk, nd))
    return {
        "all": 1 + rng.random(nl),
        "tail": 2 + rng.random(nl),
        "sliding": 3 + rng.random(nl),
        "blocks_all": 1 + rng.random((nl, N_BLOCKS)),
        "blocks_tail": 2 + rng.random((nl, N_BLOCKS)),
        "blocks_sliding": 3 + rng.random((nl, N_BLOCKS)),
        "exact": exact_trials.mean(-1),
        "gain": gain_trials.mean(-1),
        "bits": bits,
        "control_bits": bits + gain_trials.mean(-1),
        "exact_trials": exact_trials,
        "gain_trials": gain_trials,
        "entropy": rng.uniform(0.0, 5.0, size=(nl, N_LAYERS)),
    }


def _sweep_eval(t: dict[str, np.ndarray]) -> dict:
    """A run's ``eval`` in the layout of evaluate_model (string length keys, nested lists)."""
    return {
        "lengths": list(LENGTHS),
        "bpb": {str(w): {"all": float(t["all"][i]), "tail": float(t["tail"][i])} for i, w in enumerate(LENGTHS)},
        "sliding_bpb": {str(w): float(t["sliding"][i]) for i, w in enumerate(LENGTHS)},
        "blocks": {m: {str(w): t[f"blocks_{m}"][i].tolist() for i, w in enumerate(LENGTHS)}
                   for m in ("all", "tail", "sliding")},
        "passkey": {"lengths": list(PK_LENGTHS), "depths": list(DEPTHS),
                    **{k: t[k].tolist() for k in ("bits", "control_bits", "gain", "exact", "exact_trials",
                                                   "gain_trials")}},
        "entropy": {str(w): t["entropy"][i].tolist() for i, w in enumerate(LENGTHS)},
    }


EVAL_CONFIG = {"multiples": MULTIPLES, "windows": 8, "blocks": N_BLOCKS, "sliding_tokens": 1024,
               "passkey_multiples": PK_MULTIPLES, "passkey_depths": DEPTHS, "passkey_trials": N_TRIALS,
               "entropy_windows": 2}


def _sweep_data() -> tuple[dict, dict[tuple[str, int], dict[str, np.ndarray]]]:
    truth = {key: _sweep_truth(*key) for key in RUN_ORDER}
    runs = [{"config": {"scheme": s, "seed": sd, "seq_len": TRAIN_LEN, "d_model": 16, "steps": 10},
             "log": [{"step": 10, "loss": 3.0}], "seconds": 1.0,
             "eval": _sweep_eval(truth[s, sd]), "eval_seconds": 0.5} for s, sd in RUN_ORDER]
    return {"eval_config": EVAL_CONFIG, "runs": runs, "wall_seconds": 2.0}, truth


@pytest.fixture(scope="module")
def sweep_case():
    data, truth = _sweep_data()
    return Sweep(data), data, truth


def _expected(truth, scheme: str, key: str, index=None) -> np.ndarray:
    """``truth[...][key]`` stacked over the seeds of ``scheme`` in sorted order (SEEDS)."""
    rows = [truth[scheme, sd][key] for sd in SEEDS[scheme]]
    return np.array([r if index is None else r[index] for r in rows])


# ----------------------------------------------------------------------------------------------
# Sweep
# ----------------------------------------------------------------------------------------------


def test_sweep_attributes(sweep_case):
    sw, data, _ = sweep_case
    assert sw.schemes == SCHEMES
    assert sw.train_len == TRAIN_LEN and isinstance(sw.train_len, int)
    assert sw.lengths == LENGTHS
    assert sw.multiples == MULTIPLES
    assert sw.passkey_lengths == PK_LENGTHS
    assert sw.depths == DEPTHS
    assert all(type(d) is float for d in sw.depths)
    assert sw.eval_config == EVAL_CONFIG
    assert sw.data is data
    assert set(sw.runs) == set(RUN_ORDER)


def test_sweep_attributes_convert_types():
    """Depths stored as ints (0, 1) become floats; lengths stored as strings become ints."""
    data, _ = _sweep_data()
    first = data["runs"][0]
    first["config"]["seq_len"] = str(TRAIN_LEN)
    first["eval"]["lengths"] = [str(w) for w in LENGTHS]
    first["eval"]["passkey"]["depths"] = [0, 0.5, 1]
    first["eval"]["passkey"]["lengths"] = [str(w) for w in PK_LENGTHS]
    sw = Sweep(data)
    assert sw.train_len == TRAIN_LEN
    assert sw.lengths == LENGTHS and all(type(w) is int for w in sw.lengths)
    assert sw.passkey_lengths == PK_LENGTHS and all(type(w) is int for w in sw.passkey_lengths)
    assert sw.depths == [0.0, 0.5, 1.0] and all(type(d) is float for d in sw.depths)
    assert sw.multiples == MULTIPLES


@pytest.mark.parametrize("scheme", SCHEMES)
def test_sweep_seeds_sorted(sweep_case, scheme):
    sw, _, _ = sweep_case
    assert sw.seeds(scheme) == SEEDS[scheme]
    assert sw.seeds(scheme) == sorted(sd for s, sd in RUN_ORDER if s == scheme)


@pytest.mark.parametrize("bad", ["rotary", "ROPE", "nope", ""])
def test_sweep_unknown_scheme(sweep_case, bad):
    sw, _, _ = sweep_case
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        sw.seeds(bad)
    # every accessor goes through seeds(), so it names the scheme too
    for call in (lambda: sw.curve(bad), lambda: sw.blocks(bad, "tail", LENGTHS[0]), lambda: sw.passkey(bad),
                 lambda: sw.entropy(bad)):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            call()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("metric", ["all", "tail", "sliding"])
def test_sweep_curve(sweep_case, scheme, metric):
    sw, _, truth = sweep_case
    got = sw.curve(scheme, metric)
    assert got.shape == (len(SEEDS[scheme]), len(LENGTHS))
    np.testing.assert_array_equal(got, _expected(truth, scheme, metric))


def test_sweep_curve_default_is_tail(sweep_case):
    sw, _, _ = sweep_case
    np.testing.assert_array_equal(sw.curve("rope"), sw.curve("rope", "tail"))
    assert not np.array_equal(sw.curve("rope"), sw.curve("rope", "all"))


def test_sweep_curve_rows_follow_sorted_seeds(sweep_case):
    """Row i is seed SEEDS[i]: the stored order (2, 0, 1 for rope) is not kept."""
    sw, _, truth = sweep_case
    got = sw.curve("rope", "tail")
    for i, sd in enumerate(SEEDS["rope"]):
        np.testing.assert_array_equal(got[i], truth["rope", sd]["tail"])
    stored = np.array([truth["rope", sd]["tail"] for s, sd in RUN_ORDER if s == "rope"])
    assert not np.array_equal(got, stored)


@pytest.mark.parametrize("bad", ["bpb", "Tail", "sliding_bpb", ""])
def test_sweep_bad_metric(sweep_case, bad):
    sw, _, _ = sweep_case
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        sw.curve("rope", bad)
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        sw.blocks("rope", bad, LENGTHS[0])


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("metric", ["all", "tail", "sliding"])
def test_sweep_blocks(sweep_case, scheme, metric):
    sw, _, truth = sweep_case
    for i, w in enumerate(LENGTHS):
        got = sw.blocks(scheme, metric, w)
        assert got.shape == (len(SEEDS[scheme]), N_BLOCKS)
        np.testing.assert_array_equal(got, _expected(truth, scheme, f"blocks_{metric}", i))


def test_sweep_blocks_length_types(sweep_case):
    """A NumPy integer (as an index into an array of lengths gives) finds the same blocks."""
    sw, _, _ = sweep_case
    w = np.array(LENGTHS)[2]
    np.testing.assert_array_equal(sw.blocks("alibi", "tail", w), sw.blocks("alibi", "tail", LENGTHS[2]))


@pytest.mark.parametrize("bad", [TRAIN_LEN * 16, TRAIN_LEN * 3, 0, -TRAIN_LEN])
def test_sweep_blocks_length_not_evaluated(sweep_case, bad):
    sw, _, _ = sweep_case
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        sw.blocks("rope", "tail", bad)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("key", ["exact", "gain", "bits", "control_bits"])
def test_sweep_passkey_cells(sweep_case, scheme, key):
    sw, _, truth = sweep_case
    got = sw.passkey(scheme, key)
    assert got.shape == (len(SEEDS[scheme]), len(PK_LENGTHS), len(DEPTHS))
    np.testing.assert_array_equal(got, _expected(truth, scheme, key))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("key", ["exact_trials", "gain_trials"])
def test_sweep_passkey_trials(sweep_case, scheme, key):
    sw, _, truth = sweep_case
    got = sw.passkey(scheme, key)
    assert got.shape == (len(SEEDS[scheme]), len(PK_LENGTHS), len(DEPTHS), N_TRIALS)
    np.testing.assert_array_equal(got, _expected(truth, scheme, key))


def test_sweep_passkey_default_and_consistency(sweep_case):
    sw, _, _ = sweep_case
    np.testing.assert_array_equal(sw.passkey("rope"), sw.passkey("rope", "exact"))
    # the synthetic cells are the means of their trials, so the two views agree through the index
    np.testing.assert_array_equal(sw.passkey("rope", "exact"), sw.passkey("rope", "exact_trials").mean(-1))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_sweep_entropy(sweep_case, scheme):
    sw, _, truth = sweep_case
    got = sw.entropy(scheme)
    assert got.shape == (len(SEEDS[scheme]), len(LENGTHS), N_LAYERS)
    np.testing.assert_array_equal(got, _expected(truth, scheme, "entropy"))


def test_sweep_round_trip_through_result_file(tmp_path, sweep_case):
    """save_result / load_result (the sweep command's file) and back: the same arrays."""
    mem, data, truth = sweep_case
    path = save_result(tmp_path / "sweep.json", data, command="python -m companion.lab sweep --test")
    payload = load_result(path)
    assert payload["provenance"]["command"] == "python -m companion.lab sweep --test"
    sw = Sweep(payload["data"])
    assert sw.data is not data  # really read from the file
    assert (sw.schemes, sw.train_len, sw.lengths, sw.multiples, sw.passkey_lengths, sw.depths) == (
        SCHEMES, TRAIN_LEN, LENGTHS, MULTIPLES, PK_LENGTHS, DEPTHS)
    _assert_same_sweep(sw, truth)  # seeds, curves, blocks, entropy (defined below)
    for scheme in SCHEMES:
        for key in ("exact", "gain", "bits", "control_bits", "exact_trials", "gain_trials"):
            np.testing.assert_array_equal(sw.passkey(scheme, key), mem.passkey(scheme, key))


# ----------------------------------------------------------------------------------------------
# a sweep in parts: merge_sweeps, load_sweep
# ----------------------------------------------------------------------------------------------

CORPUS = {"name": "synthetic", "bytes": 1000}
# the runs of RUN_ORDER split into two parts; rope's seeds land in both (2, 0 in one, 1 in the other)
PART_A = [0, 2, 3]
PART_B = [1, 4, 5]


def _part(data: dict, idx: list[int], wall: float, *, command: str) -> dict:
    body = {**data, "runs": [data["runs"][i] for i in idx], "corpus": CORPUS, "wall_seconds": wall, "workers": 2}
    return {"provenance": {"command": command}, "data": body}


def _assert_same_sweep(got: Sweep, truth) -> None:
    assert sorted(got.schemes) == sorted(SCHEMES)
    for scheme in SCHEMES:
        assert got.seeds(scheme) == SEEDS[scheme]
        for metric in ("all", "tail", "sliding"):
            np.testing.assert_array_equal(got.curve(scheme, metric), _expected(truth, scheme, metric))
            for i, w in enumerate(LENGTHS):
                np.testing.assert_array_equal(got.blocks(scheme, metric, w),
                                              _expected(truth, scheme, f"blocks_{metric}", i))
        np.testing.assert_array_equal(got.entropy(scheme), _expected(truth, scheme, "entropy"))


def test_merge_sweeps_equals_the_whole_sweep(sweep_case):
    whole, data, truth = sweep_case
    merged = merge_sweeps([_part(data, PART_A, 3.0, command="a"), _part(data, PART_B, 4.5, command="b")],
                          names=["a.json", "b.json"])
    sw = Sweep(merged)
    _assert_same_sweep(sw, truth)
    for scheme in SCHEMES:
        for key in ("exact", "gain", "exact_trials"):
            np.testing.assert_array_equal(sw.passkey(scheme, key), whole.passkey(scheme, key))
    assert merged["eval_config"] == EVAL_CONFIG and merged["corpus"] == CORPUS
    assert merged["wall_seconds"] == 7.5 and merged["workers"] == 2
    assert [p["name"] for p in merged["parts"]] == ["a.json", "b.json"]
    assert [p["provenance"]["command"] for p in merged["parts"]] == ["a", "b"]
    assert merged["parts"][0]["runs"] == [list(RUN_ORDER[i]) for i in PART_A]
    assert merged["parts"][1]["wall_seconds"] == 4.5


def test_merge_sweeps_default_names(sweep_case):
    _, data, _ = sweep_case
    merged = merge_sweeps([_part(data, PART_A, 1.0, command="a"), _part(data, PART_B, 1.0, command="b")])
    assert [p["name"] for p in merged["parts"]] == ["part 0", "part 1"]


def test_merge_sweeps_rejects_a_run_in_two_parts(sweep_case):
    _, data, _ = sweep_case
    with pytest.raises(ValueError, match=r"'rope' seed 0 is in both a.json and b.json"):
        merge_sweeps([_part(data, PART_A, 1.0, command="a"), _part(data, [2], 1.0, command="b")],
                     names=["a.json", "b.json"])


@pytest.mark.parametrize("key, other", [("eval_config", {**EVAL_CONFIG, "windows": 99}),
                                        ("corpus", {**CORPUS, "bytes": 999})])
def test_merge_sweeps_rejects_another_protocol(sweep_case, key, other):
    _, data, _ = sweep_case
    b = _part(data, PART_B, 1.0, command="b")
    b["data"][key] = other
    with pytest.raises(ValueError, match=rf"b.json has another {key} than a.json"):
        merge_sweeps([_part(data, PART_A, 1.0, command="a"), b], names=["a.json", "b.json"])


def test_merge_sweeps_bad_arguments(sweep_case):
    _, data, _ = sweep_case
    with pytest.raises(ValueError, match="at least one sweep result"):
        merge_sweeps([])
    with pytest.raises(ValueError, match=r"one entry per part \(1\), got 2"):
        merge_sweeps([_part(data, PART_A, 1.0, command="a")], names=["a", "b"])
    with pytest.raises(ValueError, match="x.json is not a sweep result"):
        merge_sweeps([{"provenance": {}, "data": {"runs": []}}], names=["x.json"])
    with pytest.raises(ValueError, match="y.json is not a sweep result"):
        merge_sweeps([[1, 2]], names=["y.json"])


def test_load_sweep_from_a_folder_of_parts(tmp_path, sweep_case):
    """Parts saved as the sweep command saves them, read back from their folder in name order."""
    _, data, truth = sweep_case
    folder = tmp_path / "08_sweep"
    folder.mkdir()
    for name, idx, cmd in (("2-b.json", PART_B, "b"), ("1-a.json", PART_A, "a")):
        part = _part(data, idx, 1.0, command=cmd)
        save_result(folder / name, part["data"], command=cmd)
    (folder / "notes.txt").write_text("not a part")
    sw = load_sweep(folder)
    _assert_same_sweep(sw, truth)
    assert [p["name"] for p in sw.data["parts"]] == ["1-a.json", "2-b.json"]
    assert [p["provenance"]["command"] for p in sw.data["parts"]] == ["a", "b"]
    one = load_sweep(folder / "1-a.json")  # a single file is a sweep of its own
    assert one.seeds("rope") == [0, 2] and "parts" not in one.data


def test_load_sweep_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no .json sweep parts"):
        load_sweep(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_sweep(tmp_path / "absent.json")


# ----------------------------------------------------------------------------------------------
# difference
# ----------------------------------------------------------------------------------------------


def _mean_tolerance(*arrays: np.ndarray) -> float:
    """A bound on the rounding of ``mean(a.mean(0) - b.mean(0))`` against ``a.mean() - b.mean()``.

    Each side sums at most n = a.size + b.size terms of magnitude <= M and divides; the
    recursive-summation bound gives an error below n * eps * M for each, so 2 n eps M bounds
    the gap between the two (a loose but honest worst case)."""
    n = sum(a.size for a in arrays)
    m = max(float(np.abs(a).max()) for a in arrays)
    return 2 * n * EPS * m


@pytest.mark.parametrize("pair", [("rope", "alibi"), ("alibi", "rope"), ("rope", "nope:causal"),
                                  ("nope:causal", "alibi")])
@pytest.mark.parametrize("metric", ["tail", "sliding"])
def test_difference_is_paired_bootstrap_of_seed_means(sweep_case, pair, metric):
    """Different seed counts (3, 2, 1) on each side: averaged per block, then paired."""
    sw, _, _ = sweep_case
    w = LENGTHS[-1]
    a, b = sw.blocks(pair[0], metric, w), sw.blocks(pair[1], metric, w)
    assert a.shape[0] != b.shape[0]
    got = difference(a, b, seed=3, resamples=500)
    want = paired_bootstrap_ci(a.mean(0), b.mean(0), seed=3, resamples=500)
    assert isinstance(got, Interval)
    assert got == want  # same bootstrap seed: the very same draws, so the very same Interval
    assert got.units == N_BLOCKS
    assert got.low <= got.estimate <= got.high
    assert abs(got.estimate - (a.mean() - b.mean())) <= _mean_tolerance(a, b)
    # the stacked arrays cannot be paired directly: that is what the seed averaging is for
    with pytest.raises(ValueError, match="same shape"):
        paired_bootstrap_ci(a, b)


def test_difference_default_arguments_match(sweep_case):
    sw, _, _ = sweep_case
    a, b = sw.blocks("rope", "tail", 64), sw.blocks("alibi", "tail", 64)
    assert difference(a, b) == paired_bootstrap_ci(a.mean(0), b.mean(0))
    assert difference(a, b).confidence == 0.95


def test_difference_passes_keywords(sweep_case):
    sw, _, _ = sweep_case
    a, b = sw.blocks("rope", "all", 128), sw.blocks("alibi", "all", 128)
    wide = difference(a, b, confidence=0.99, seed=1)
    narrow = difference(a, b, confidence=0.5, seed=1)
    assert (wide.confidence, narrow.confidence) == (0.99, 0.5)
    # the same draws (same seed): the 50% quantiles lie inside the 99% ones, and strictly so
    # because the resampled means of 5 continuous, distinct block values are not all equal
    assert wide.low < narrow.low <= narrow.high < wide.high
    assert wide.estimate == narrow.estimate
    # another bootstrap seed draws other resamples (only the interval moves, not the estimate)
    other = difference(a, b, confidence=0.99, seed=2)
    assert other.estimate == wide.estimate and (other.low, other.high) != (wide.low, wide.high)
    with pytest.raises(ValueError, match="confidence"):
        difference(a, b, confidence=1.5)


def test_difference_one_dimensional(sweep_case):
    """A single row (one seed's blocks, 1-D) is the row itself."""
    sw, _, _ = sweep_case
    a = sw.blocks("nope:causal", "tail", 32)[0]
    b = sw.blocks("rope", "tail", 32)[1]
    assert difference(a, b, seed=4) == paired_bootstrap_ci(a, b, seed=4)
    assert difference(a[None], b, seed=4) == difference(a, b, seed=4)


def test_difference_pairs_blocks():
    """Shared block difficulty cancels: b is a shifted by 1/4 on every block (exact in binary),
    with blocks that differ by whole bits, so the unpaired spread is wide and the paired one 0."""
    difficulty = np.array([1.0, 4.0, 2.0, 7.0, 3.0, 6.0])
    a = np.stack([difficulty + 0.5, difficulty - 0.5])           # two seeds, mean = difficulty
    b = np.stack([difficulty - 0.25, difficulty - 0.5, difficulty])  # three seeds, mean = difficulty - 0.25
    got = difference(a, b)
    # a.mean(0) and b.mean(0) are exact here (sums of dyadic numbers, divided by 2 and by 3:
    # the 3-row mean is (3 d - 0.75) / 3, which rounds; its error is below 2 eps |d|, so each
    # block's difference is 0.25 within 4 eps * max(d); resampled means stay within that)
    tol = 4 * EPS * difficulty.max()
    assert abs(got.estimate - 0.25) <= tol
    assert got.high - got.low <= 2 * tol
    assert got.low - tol <= 0.25 <= got.high + tol
    # without pairing the same text spread would give an interval over a bit wide
    unpaired = bootstrap_ci(a.mean(0))
    assert unpaired.high - unpaired.low > 1.0


def test_difference_rejects_other_blocks():
    with pytest.raises(ValueError, match="same shape"):
        difference(np.ones((2, 5)), np.ones((2, 4)))


# ----------------------------------------------------------------------------------------------
# a synthetic extension run
# ----------------------------------------------------------------------------------------------

EXT_SEEDS = [4, 1, 3]  # checkpoints in the stored order
TUNED_SEEDS = [4, 3]  # --finetune-seeds: the fine-tuned jobs ran on these only
EXT_METHODS = ["yarn", "none", "pi"]  # the order given on the command line (not alphabetical)
FT_METHODS = ["none", "pi"]
EXT_FACTORS = [4.0, 2.0]  # given unsorted
FT_STEPS = 50
EXT_DEPTHS = ["0", "0.5", "1"]  # f"{depth:g}" of [0.0, 0.5, 1.0], as extension_job writes them
EXT_MULTIPLES = [1, 2, 4, 8]
# a later, shorter run appended to the same files: seed 9, unscaled, at 1 L and 2 L only
LATE_SEED = 9
LATE_LENGTHS = [TRAIN_LEN, 2 * TRAIN_LEN]


def _job_multiples(method: str, factor: float, steps: int) -> list[float]:
    """The multiples of L a job is evaluated at (as ExtendConfig.job_multiples with a far length
    for every fine-tuned job): the unscaled job at every multiple, others at 1 L and s L, a
    fine-tuned one also at 2 s L where that is at most max(multiples) // 2."""
    if method == "none" and steps == 0:
        return [float(m) for m in EXT_MULTIPLES]
    out = {1.0, float(factor)}
    if steps and 2 * factor <= max(EXT_MULTIPLES) // 2:
        out.add(2.0 * factor)
    return sorted(out)


def _jobs() -> list[tuple[int, str, float, int, list[int]]]:
    """``(seed, method, factor, steps, lengths)`` per job, in run_extension's order."""
    jobs = []
    for seed in EXT_SEEDS:
        for steps in (0, FT_STEPS):
            for method in (EXT_METHODS if steps == 0 else FT_METHODS):
                if steps and seed not in TUNED_SEEDS:
                    continue
                for factor in ([1.0] if (method == "none" and steps == 0) else EXT_FACTORS):
                    lengths = [int(round(m * TRAIN_LEN)) for m in _job_multiples(method, factor, steps)]
                    jobs.append((seed, method, factor, steps, lengths))
    jobs.append((LATE_SEED, "none", 1.0, 0, LATE_LENGTHS))
    return jobs


def _job_rows_units(seed, method, factor, steps, lengths, job_index):
    """The rows (Python types, as extension_job returns them) and units of one job."""
    rng = np.random.default_rng([job_index, seed, 9])
    key = {"seed": seed, "method": method, "factor": factor, "finetune_steps": steps}
    rows, units = [], {**key, "tail": {}, "sliding": {}, "passkey": {}}
    for w in lengths:
        for metric in ("bpb_all", "bpb_tail", "sliding_bpb"):
            rows.append({**key, "metric": metric, "length": w, "where": "", "value": f"{2 + rng.random():.6g}"})
        units["tail"][str(w)] = np.round(2 + rng.random(N_BLOCKS), 4).tolist()
        units["sliding"][str(w)] = np.round(3 + rng.random(N_BLOCKS), 4).tolist()
        units["passkey"][str(w)] = {}
        for depth in EXT_DEPTHS:
            exact = rng.integers(0, 2, size=N_TRIALS).tolist()
            gain = np.round(rng.normal(1.0, 0.5, size=N_TRIALS), 4).tolist()
            units["passkey"][str(w)][depth] = {"gain": gain, "exact": exact}
            rows.append({**key, "metric": "passkey_gain", "length": w, "where": depth,
                         "value": f"{np.mean(gain):.6g}"})
            rows.append({**key, "metric": "passkey_exact", "length": w, "where": depth,
                         "value": f"{np.mean(exact):.6g}"})
        for li in range(N_LAYERS):
            rows.append({**key, "metric": "entropy", "length": w, "where": f"layer{li}",
                         "value": f"{rng.uniform(0, 5):.6g}"})
    return rows, units


def _extension_data():
    rows, units = [], []
    for i, job in enumerate(_jobs()):
        r, u = _job_rows_units(*job, job_index=i)
        rows += r
        units.append(u)
    data = {"units": units, "searches": [], "finetune_logs": [], "job_seconds": 1.0, "wall_seconds": 1.0}
    return rows, data


def _as_csv_strings(rows):
    """The rows as load_csv returns them: every value a string."""
    return [{k: str(v) for k, v in r.items()} for r in rows]


def _truth_value(rows, method, factor, steps, metric, length, where, seed) -> float:
    """The value written for a cell, looked up by a plain scan over the Python-typed rows."""
    hits = [r["value"] for r in rows if (r["seed"], r["method"], r["factor"], r["finetune_steps"], r["metric"],
                                         r["length"], r["where"]) == (seed, method, factor, steps, metric, length,
                                                                      where)]
    assert len(hits) == 1, "the synthetic data has one row per cell and seed"
    return float(hits[0])


def _truth_unit(data, method, factor, steps, seed) -> dict:
    hits = [u for u in data["units"] if (u["seed"], u["method"], u["factor"], u["finetune_steps"]) ==
            (seed, method, factor, steps)]
    assert len(hits) == 1
    return hits[0]


@pytest.fixture(scope="module")
def ext_case():
    rows, data = _extension_data()
    return Extension(_as_csv_strings(rows), data), rows, data


# the cells of the synthetic run: (method, stored factor, steps, seeds, lengths)
UNSCALED_LENGTHS = [m * TRAIN_LEN for m in EXT_MULTIPLES]


def test_synthetic_plan_matches_plan_jobs():
    """The synthetic jobs are those the real planner makes (so the fixture is realistic)."""
    from companion.lab.extend import plan_jobs

    planned = plan_jobs(EXT_METHODS, EXT_FACTORS, [0, FT_STEPS], finetune_methods=FT_METHODS)
    made = list(dict.fromkeys((m, f, n) for sd, m, f, n, _ in _jobs() if sd == EXT_SEEDS[0]))
    assert made == planned


def test_extension_attributes(ext_case):
    ext, _, data = ext_case
    assert ext.methods == EXT_METHODS  # order of first appearance
    assert ext.factors == sorted(EXT_FACTORS) == [2.0, 4.0]  # sorted, without the unscaled 1.0
    assert ext.steps == [0, FT_STEPS]
    assert ext.data is data


def test_extension_has(ext_case):
    ext, _, _ = ext_case
    w8 = 8 * TRAIN_LEN
    # unscaled RoPE without fine-tuning is stored at factor 1: found at any factor
    for f in (1.0, 2.0, 4.0, 8.0, 3):
        assert ext.has("none", f, 0, "bpb_tail", w8)
        assert ext.has("none", f, 0, "passkey_exact", w8, "0.5")
    # fine-tuned none is a real job at each factor
    assert ext.has("none", 2.0, FT_STEPS, "bpb_tail", 4 * TRAIN_LEN)  # beyond = 2 x 2 L
    assert ext.has("none", 4.0, FT_STEPS, "bpb_tail", 4 * TRAIN_LEN)
    assert not ext.has("none", 4.0, FT_STEPS, "bpb_tail", 8 * TRAIN_LEN)  # 2 x 4 L is past max // 2
    assert not ext.has("none", 1.0, FT_STEPS, "bpb_tail", TRAIN_LEN)  # no fine-tuned job at 1
    assert not ext.has("none", 8.0, FT_STEPS, "bpb_tail", TRAIN_LEN)
    # other methods only at their factors
    assert ext.has("yarn", 2.0, 0, "bpb_tail", 2 * TRAIN_LEN)
    assert ext.has("yarn", 2, 0, "bpb_tail", TRAIN_LEN)  # an int factor is the same factor
    assert not ext.has("yarn", 1.0, 0, "bpb_tail", TRAIN_LEN)
    assert not ext.has("yarn", 3.0, 0, "bpb_tail", TRAIN_LEN)
    assert not ext.has("yarn", 2.0, 0, "bpb_tail", 4 * TRAIN_LEN)  # as-is: 1 L and s L only
    assert not ext.has("yarn", 2.0, FT_STEPS, "bpb_tail", TRAIN_LEN)  # yarn was not fine-tuned
    assert ext.has("pi", 4.0, FT_STEPS, "entropy", 4 * TRAIN_LEN, "layer2")
    assert not ext.has("pi", 4.0, FT_STEPS, "entropy", 4 * TRAIN_LEN, f"layer{N_LAYERS}")
    # where: passkey cells carry their depth, bpb cells none
    assert not ext.has("pi", 2.0, 0, "passkey_exact", TRAIN_LEN)
    assert not ext.has("pi", 2.0, 0, "bpb_tail", TRAIN_LEN, "0.5")
    assert not ext.has("pi", 2.0, 0, "passkey_exact", TRAIN_LEN, "0.25")
    assert not ext.has("longrope", 2.0, 0, "bpb_tail", TRAIN_LEN)


def test_extension_seeds(ext_case):
    ext, _, _ = ext_case
    everyone = sorted(EXT_SEEDS)
    assert ext.seeds("yarn", 4.0, 0) == everyone
    assert ext.seeds("pi", 2.0, FT_STEPS) == sorted(TUNED_SEEDS)
    assert ext.seeds("none", 2.0, FT_STEPS) == sorted(TUNED_SEEDS)
    # the unscaled job: every checkpoint plus the late seed, at any factor asked
    assert ext.seeds("none", 1.0, 0) == sorted(EXT_SEEDS + [LATE_SEED])
    assert ext.seeds("none", 4.0, 0) == ext.seeds("none", 1.0, 0)
    # with a length: only the seeds measured there (the late seed stopped at 2 L)
    assert ext.seeds("none", 4.0, 0, length=8 * TRAIN_LEN) == everyone
    assert ext.seeds("none", 4.0, 0, length=2 * TRAIN_LEN) == sorted(EXT_SEEDS + [LATE_SEED])
    assert ext.seeds("yarn", 4.0, 0, length=2 * TRAIN_LEN) == []
    assert ext.seeds("pi", 2.0, FT_STEPS, "passkey_exact", 4 * TRAIN_LEN, "0.5") == sorted(TUNED_SEEDS)
    assert ext.seeds("pi", 2.0, FT_STEPS, "passkey_exact", 4 * TRAIN_LEN) == []  # the depth is needed
    assert ext.seeds("longrope", 2.0, 0) == []


def test_extension_get_default_every_seed(ext_case):
    ext, rows, _ = ext_case
    for method, factor, steps in [("yarn", 2.0, 0), ("pi", 4.0, 0), ("pi", 4.0, FT_STEPS),
                                  ("none", 2.0, FT_STEPS)]:
        seeds = ext.seeds(method, factor, steps)
        for metric, w in [("bpb_all", TRAIN_LEN), ("bpb_tail", int(factor) * TRAIN_LEN),
                          ("sliding_bpb", TRAIN_LEN)]:
            got = ext.get(method, factor, steps, metric, w)
            want = [_truth_value(rows, method, factor, steps, metric, w, "", sd) for sd in seeds]
            assert got.shape == (len(seeds),)
            np.testing.assert_array_equal(got, want)


def test_extension_get_depth_and_layer(ext_case):
    ext, rows, _ = ext_case
    w = 2 * TRAIN_LEN
    for metric, where in [("passkey_exact", "0"), ("passkey_gain", "1"), ("entropy", "layer1")]:
        got = ext.get("yarn", 2.0, 0, metric, w, where)
        np.testing.assert_array_equal(got, [_truth_value(rows, "yarn", 2.0, 0, metric, w, where, sd)
                                            for sd in sorted(EXT_SEEDS)])


def test_extension_get_unscaled_at_any_factor(ext_case):
    ext, rows, _ = ext_case
    w = 8 * TRAIN_LEN
    want = [_truth_value(rows, "none", 1.0, 0, "bpb_tail", w, "", sd) for sd in sorted(EXT_SEEDS)]
    for f in (1.0, 2.0, 4.0, 16.0):
        np.testing.assert_array_equal(ext.get("none", f, 0, "bpb_tail", w), want)
    # at 2 L the late seed is measured too, and the default takes every seed of the cell
    w2 = 2 * TRAIN_LEN
    want2 = [_truth_value(rows, "none", 1.0, 0, "bpb_tail", w2, "", sd) for sd in sorted(EXT_SEEDS + [LATE_SEED])]
    np.testing.assert_array_equal(ext.get("none", 4.0, 0, "bpb_tail", w2), want2)
    # fine-tuned none is its own job, with other values than the unscaled one
    tuned = ext.get("none", 2.0, FT_STEPS, "bpb_tail", w2)
    np.testing.assert_array_equal(tuned, [_truth_value(rows, "none", 2.0, FT_STEPS, "bpb_tail", w2, "", sd)
                                          for sd in sorted(TUNED_SEEDS)])
    assert not np.array_equal(tuned, ext.get("none", 2.0, 0, "bpb_tail", w2, seeds=sorted(TUNED_SEEDS)))


def test_extension_get_explicit_seeds(ext_case):
    ext, rows, _ = ext_case
    w = 4 * TRAIN_LEN
    for order in ([4, 1], [3, 4, 1], [1]):
        got = ext.get("pi", 4.0, 0, "bpb_tail", w, seeds=order)
        np.testing.assert_array_equal(got, [_truth_value(rows, "pi", 4.0, 0, "bpb_tail", w, "", sd) for sd in order])
    # the stored order of a default call is sorted, not the order given here
    assert not np.array_equal(ext.get("pi", 4.0, 0, "bpb_tail", w, seeds=[4, 1, 3]),
                              ext.get("pi", 4.0, 0, "bpb_tail", w))
    with pytest.raises(KeyError):
        ext.get("pi", 4.0, FT_STEPS, "bpb_tail", w, seeds=[1])  # seed 1 was not fine-tuned


@pytest.mark.parametrize("cell", [
    ("yarn", 2.0, FT_STEPS, "bpb_tail", TRAIN_LEN, ""),  # not fine-tuned
    ("yarn", 3.0, 0, "bpb_tail", TRAIN_LEN, ""),  # no such factor
    ("pi", 2.0, 0, "bpb_tail", 8 * TRAIN_LEN, ""),  # not at that length
    ("pi", 2.0, 0, "passkey_exact", TRAIN_LEN, ""),  # a passkey cell needs its depth
    ("none", 1.0, FT_STEPS, "bpb_tail", TRAIN_LEN, ""),  # fine-tuned none has no factor 1 job
    ("longrope", 2.0, 0, "bpb_tail", TRAIN_LEN, ""),  # not run
])
def test_extension_get_missing_cell(ext_case, cell):
    ext, _, _ = ext_case
    with pytest.raises(KeyError, match="no measurement"):
        ext.get(*cell)


@pytest.mark.parametrize("metric", ["tail", "sliding"])
def test_extension_blocks(ext_case, metric):
    ext, _, data = ext_case
    for method, factor, steps, w in [("yarn", 4.0, 0, 4 * TRAIN_LEN), ("pi", 2.0, FT_STEPS, 4 * TRAIN_LEN),
                                     ("none", 4.0, FT_STEPS, TRAIN_LEN)]:
        seeds = ext.seeds(method, factor, steps, length=w)
        got = ext.blocks(method, factor, steps, metric, w)
        assert got.shape == (len(seeds), N_BLOCKS)
        np.testing.assert_array_equal(got, [_truth_unit(data, method, factor, steps, sd)[metric][str(w)]
                                            for sd in seeds])


def test_extension_blocks_unscaled_rule_and_seeds(ext_case):
    ext, _, data = ext_case
    w8, w2 = 8 * TRAIN_LEN, 2 * TRAIN_LEN
    want8 = [_truth_unit(data, "none", 1.0, 0, sd)["tail"][str(w8)] for sd in sorted(EXT_SEEDS)]
    for f in (1.0, 2.0, 4.0, 8.0):
        got = ext.blocks("none", f, 0, "tail", w8)
        assert got.shape == (len(EXT_SEEDS), N_BLOCKS)
        np.testing.assert_array_equal(got, want8)
    # at 2 L the late seed is in the default seeds too
    assert ext.blocks("none", 2.0, 0, "sliding", w2).shape == (len(EXT_SEEDS) + 1, N_BLOCKS)
    # fine-tuned none: its own units
    tuned = ext.blocks("none", 2.0, FT_STEPS, "tail", w2)
    np.testing.assert_array_equal(tuned, [_truth_unit(data, "none", 2.0, FT_STEPS, sd)["tail"][str(w2)]
                                          for sd in sorted(TUNED_SEEDS)])
    assert not np.array_equal(tuned, ext.blocks("none", 2.0, 0, "tail", w2, seeds=sorted(TUNED_SEEDS)))
    # explicit seeds, in the order given
    np.testing.assert_array_equal(ext.blocks("yarn", 2.0, 0, "tail", w2, seeds=[3, 1]),
                                  [_truth_unit(data, "yarn", 2.0, 0, sd)["tail"][str(w2)] for sd in (3, 1)])


def test_extension_blocks_feed_difference(ext_case):
    """The intended use: a method against unscaled RoPE at one length, on the same blocks."""
    ext, _, _ = ext_case
    w = 4 * TRAIN_LEN
    a = ext.blocks("pi", 4.0, FT_STEPS, "tail", w)  # 2 seeds
    b = ext.blocks("none", 4.0, 0, "tail", w)  # 3 seeds
    got = difference(a, b, seed=0)
    assert got == paired_bootstrap_ci(a.mean(0), b.mean(0), seed=0)
    assert abs(got.estimate - (a.mean() - b.mean())) <= _mean_tolerance(a, b)


@pytest.mark.parametrize("key", ["exact", "gain"])
def test_extension_trials(ext_case, key):
    ext, _, data = ext_case
    for method, factor, steps, w, depth in [("yarn", 2.0, 0, 2 * TRAIN_LEN, "0.5"),
                                            ("pi", 4.0, FT_STEPS, 4 * TRAIN_LEN, "1"),
                                            ("none", 2.0, FT_STEPS, 4 * TRAIN_LEN, "0")]:
        seeds = ext.seeds(method, factor, steps, "passkey_exact", w, depth)
        got = ext.trials(method, factor, steps, w, depth, key)
        assert got.shape == (len(seeds), N_TRIALS)
        np.testing.assert_array_equal(got, [_truth_unit(data, method, factor, steps, sd)["passkey"][str(w)][depth]
                                            [key] for sd in seeds])


def test_extension_trials_unscaled_rule_and_seeds(ext_case):
    ext, rows, data = ext_case
    w = 8 * TRAIN_LEN
    want = [_truth_unit(data, "none", 1.0, 0, sd)["passkey"][str(w)]["0.5"]["exact"] for sd in sorted(EXT_SEEDS)]
    for f in (1.0, 4.0, 8.0):
        got = ext.trials("none", f, 0, w, "0.5")  # default key: exact
        assert got.shape == (len(EXT_SEEDS), N_TRIALS)
        np.testing.assert_array_equal(got, want)
    # the trials are those behind the stored means
    np.testing.assert_array_equal(ext.trials("none", 8.0, 0, w, "0.5").mean(1),
                                  ext.get("none", 8.0, 0, "passkey_exact", w, "0.5"))
    # explicit seeds in the order given; the late seed exists at 1 L
    np.testing.assert_array_equal(
        ext.trials("none", 2.0, 0, TRAIN_LEN, "1", "gain", seeds=[LATE_SEED, 4]),
        [_truth_unit(data, "none", 1.0, 0, sd)["passkey"][str(TRAIN_LEN)]["1"]["gain"] for sd in (LATE_SEED, 4)])
    tuned = ext.trials("none", 2.0, FT_STEPS, 2 * TRAIN_LEN, "0", "gain")
    assert tuned.shape == (len(TUNED_SEEDS), N_TRIALS)
    assert not np.array_equal(tuned, ext.trials("none", 2.0, 0, 2 * TRAIN_LEN, "0", "gain", seeds=sorted(TUNED_SEEDS)))


def test_extension_without_units_still_reads_means():
    rows, _ = _extension_data()
    ext = Extension(_as_csv_strings(rows), {})
    assert ext.get("yarn", 2.0, 0, "bpb_tail", TRAIN_LEN).shape == (len(EXT_SEEDS),)
    with pytest.raises(KeyError):
        ext.blocks("yarn", 2.0, 0, "tail", TRAIN_LEN)


def test_extension_round_trip_through_files(tmp_path, ext_case):
    """save_csv / load_csv and save_result / load_result (the extend command's two files)."""
    mem, rows, data = ext_case
    csv_path = save_csv(tmp_path / "extend.csv", rows, CSV_FIELDS, command="python -m companion.lab extend")
    json_path = save_result(tmp_path / "extend.json", data)
    prov, loaded = load_csv(csv_path)
    assert prov["command"] == "python -m companion.lab extend"
    assert len(loaded) == len(rows)
    assert all(isinstance(v, str) for r in loaded for v in r.values())  # the format under test
    assert loaded == _as_csv_strings(rows)
    ext = Extension(loaded, load_result(json_path)["data"])
    _assert_same_extension(ext, mem, rows)


def _assert_same_extension(ext: Extension, mem: Extension, rows) -> None:
    """Every cell, block array and trial array of ``ext`` equals the in-memory run's."""
    assert (ext.methods, ext.factors, ext.steps) == (mem.methods, mem.factors, mem.steps)
    jobs = {(m, f, n) for _, m, f, n, _ in _jobs()}
    for method, factor, steps in sorted(jobs):
        for w in set(UNSCALED_LENGTHS):
            for metric, where in [("bpb_tail", ""), ("sliding_bpb", ""), ("passkey_gain", "0.5"),
                                  ("entropy", "layer0")]:
                assert ext.has(method, factor, steps, metric, w, where) == mem.has(method, factor, steps, metric, w,
                                                                                   where)
                if not mem.has(method, factor, steps, metric, w, where):
                    continue
                assert ext.seeds(method, factor, steps, metric, w, where) == mem.seeds(method, factor, steps, metric,
                                                                                       w, where)
                np.testing.assert_array_equal(ext.get(method, factor, steps, metric, w, where),
                                              [_truth_value(rows, method, factor, steps, metric, w, where, sd)
                                               for sd in mem.seeds(method, factor, steps, metric, w, where)])
            if mem.has(method, factor, steps, "bpb_tail", w):
                for metric in ("tail", "sliding"):
                    np.testing.assert_array_equal(ext.blocks(method, factor, steps, metric, w),
                                                  mem.blocks(method, factor, steps, metric, w))
                for depth, key in itertools.product(EXT_DEPTHS, ("exact", "gain")):
                    np.testing.assert_array_equal(ext.trials(method, factor, steps, w, depth, key),
                                                  mem.trials(method, factor, steps, w, depth, key))
    # the none-at-factor-1 rule holds on the file's strings ("1.0") too
    np.testing.assert_array_equal(ext.get("none", 4.0, 0, "bpb_tail", 8 * TRAIN_LEN),
                                  mem.get("none", 1.0, 0, "bpb_tail", 8 * TRAIN_LEN))


EXT_CONFIG = {"windows": 8, "blocks": N_BLOCKS, "passkey_trials": N_TRIALS}


def _ext_part(rows, data, seeds, wall):
    keep = set(seeds)
    part_rows = [r for r in rows if r["seed"] in keep]
    units = [u for u in data["units"] if u["seed"] in keep]
    return part_rows, {**data, "units": units, "extend_config": EXT_CONFIG, "job_seconds": 2 * wall,
                       "wall_seconds": wall}


def test_load_extension_from_a_folder_of_parts(tmp_path, ext_case):
    """A run split by seed, each part saved as the extend command saves it (CSV and JSON with
    one name), reads back as the whole run."""
    mem, rows, data = ext_case
    folder = tmp_path / "09_extension"
    folder.mkdir()
    for name, seeds, wall in (("b-late", [LATE_SEED, 1], 3.0), ("a-tuned", TUNED_SEEDS, 5.0)):
        part_rows, part_data = _ext_part(rows, data, seeds, wall)
        save_csv(folder / f"{name}.csv", part_rows, CSV_FIELDS, command=f"extend {name}")
        save_result(folder / f"{name}.json", part_data, command=f"extend {name}")
    ext = load_extension(folder)
    _assert_same_extension(ext, mem, rows)
    assert [p["name"] for p in ext.data["parts"]] == ["a-tuned", "b-late"]
    assert [p["provenance"]["command"] for p in ext.data["parts"]] == ["extend a-tuned", "extend b-late"]
    assert [p["seeds"] for p in ext.data["parts"]] == [sorted(TUNED_SEEDS), sorted([LATE_SEED, 1])]
    assert ext.data["wall_seconds"] == 8.0 and ext.data["job_seconds"] == 16.0
    assert ext.data["extend_config"] == EXT_CONFIG
    assert len(ext.data["units"]) == len(data["units"])


def test_merge_extensions_rejects_bad_parts(ext_case):
    _, rows, data = ext_case
    a = ({"command": "a"}, *_ext_part(rows, data, TUNED_SEEDS, 1.0))
    b = ({"command": "b"}, *_ext_part(rows, data, [1, LATE_SEED], 1.0))
    assert len(merge_extensions([a, b])[0]) == len(rows)
    with pytest.raises(ValueError, match=r"job \('(yarn|none|pi)', .*\) .* is in both x and y"):
        merge_extensions([a, a], names=["x", "y"])
    other = ({"command": "b"}, b[1], {**b[2], "extend_config": {**EXT_CONFIG, "windows": 16}})
    with pytest.raises(ValueError, match="y has another extend_config than x"):
        merge_extensions([a, other], names=["x", "y"])
    with pytest.raises(ValueError, match="at least one extension result"):
        merge_extensions([])
    with pytest.raises(ValueError, match=r"one entry per part \(2\), got 1"):
        merge_extensions([a, b], names=["x"])
    with pytest.raises(ValueError, match="z is not an extension result"):
        merge_extensions([({}, [], {"units": []})], names=["z"])


def test_merge_extensions_keeps_a_search_two_parts_share_once(ext_case):
    _, rows, data = ext_case
    search = {"checkpoint": "runs/lab/rope-L128-d64-n1500-s0.pt", "factor": 4.0, "search_seed": 0,
              "long_factor": [1.0, 2.0], "score": 2.5}
    other = {**search, "search_seed": 1, "score": 2.6}
    a = ({"command": "a"}, *_ext_part(rows, {**data, "searches": [search, other]}, TUNED_SEEDS, 1.0))
    # the second part read the same search from the run's cache (another path to the same file)
    again = {**search, "checkpoint": "/elsewhere/rope-L128-d64-n1500-s0.pt"}
    b = ({"command": "b"}, *_ext_part(rows, {**data, "searches": [again]}, [1, LATE_SEED], 1.0))
    _, merged = merge_extensions([a, b])
    assert merged["searches"] == [search, other]
    changed = ({"command": "b"}, *_ext_part(rows, {**data, "searches": [{**again, "score": 9.0}]}, [1, LATE_SEED], 1.0))
    with pytest.raises(ValueError, match="differs between parts"):
        merge_extensions([a, changed])


def test_load_extension_missing(tmp_path, ext_case):
    _, rows, data = ext_case
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_extension(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="holds no .csv extension parts"):
        load_extension(tmp_path)
    part_rows, _ = _ext_part(rows, data, TUNED_SEEDS, 1.0)
    save_csv(tmp_path / "only.csv", part_rows, CSV_FIELDS)
    with pytest.raises(FileNotFoundError, match="part only.csv has no only.json"):
        load_extension(tmp_path)
    with pytest.raises(NotADirectoryError, match="is a file"):
        load_extension(tmp_path / "only.csv")


def test_interval_is_a_plain_value():
    """difference returns the stats Interval (compared by value above): check that equality is
    by fields, so `got == want` in these tests compares the five numbers."""
    x = Interval(0.1, 0.0, 0.2, 0.95, 5)
    assert x == Interval(*astuple(x)) and x != Interval(0.1, 0.0, 0.2, 0.95, 6)


def test_extension_missing_units_raise(ext_case):
    ext, _, _ = ext_case
    # an unmeasured job, length or depth is a KeyError that names it, never an empty array
    with pytest.raises(KeyError, match="no tail blocks at length .* measured"):
        ext.blocks("yarn", 2.0, FT_STEPS, "tail", TRAIN_LEN)
    with pytest.raises(KeyError, match="no tail blocks"):
        ext.blocks("yarn", 2.0, 0, "tail", 4 * TRAIN_LEN, seeds=sorted(EXT_SEEDS))
    with pytest.raises(KeyError, match="no passkey trials at length .* measured"):
        ext.trials("pi", 2.0, 0, TRAIN_LEN, "0.25")
    with pytest.raises(KeyError, match="no per-unit values"):
        ext.blocks("yarn", 2.0, 0, "tail", TRAIN_LEN, seeds=[LATE_SEED + 100])
    # a length given as a string is the same length for seeds, blocks and get
    w = 2 * TRAIN_LEN
    assert ext.seeds("yarn", 2.0, 0, length=str(w)) == ext.seeds("yarn", 2.0, 0, length=w)


def test_sweep_rejects_fractional_lengths_bad_keys_and_duplicates(sweep_case):
    sw = sweep_case[0]
    scheme = sw.schemes[0]
    with pytest.raises(ValueError, match="length must be one of"):
        sw.blocks(scheme, "tail", sw.lengths[0] + 0.9)
    with pytest.raises(ValueError, match="key must be one of"):
        sw.passkey(scheme, "exactt")
    data = dict(sw.data)
    data["runs"] = list(data["runs"]) + [data["runs"][0]]
    with pytest.raises(ValueError, match="two runs of the same scheme and seed"):
        Sweep(data)


# ----------------------------------------------------------------------------------------------
# bad input: say what is missing and what a sweep / extension result holds
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [load_sweep, load_extension])
def test_load_path_must_be_a_path(fn):
    for bad in (None, 3, ["a.json"]):
        with pytest.raises(TypeError, match=r"path must be a path \(a str or a pathlib.Path\), got"):
            fn(bad)


def test_load_sweep_a_result_that_is_not_a_sweep(tmp_path):
    save_result(tmp_path / "not_a_sweep.json", {"runs": []})
    with pytest.raises(ValueError, match=r"not_a_sweep.json is not a sweep result \(data is not a sweep's data: "
                                         r"it lacks 'eval_config'; a sweep's data holds 'eval_config' and 'runs'"):
        load_sweep(tmp_path / "not_a_sweep.json")
    save_result(tmp_path / "a_list.json", [1, 2])
    with pytest.raises(ValueError, match=r"a_list.json is not a sweep result \(data must be a sweep's data \(a dict\), "
                                         r"got list"):
        load_sweep(tmp_path / "a_list.json")
    save_result(tmp_path / "no_runs.json", {"eval_config": EVAL_CONFIG, "runs": []})
    with pytest.raises(ValueError, match=r"no_runs.json is not a sweep result \(data\['runs'\] must be a non-empty"):
        load_sweep(tmp_path / "no_runs.json")


def test_sweep_of_an_incomplete_data_names_what_is_missing(sweep_case):
    _, data, _ = sweep_case
    with pytest.raises(ValueError, match=r"it lacks 'eval_config', 'runs'; a sweep's data holds 'eval_config' and "
                                         r"'runs' \(a non-empty list, each run with 'config'"):
        Sweep({})
    with pytest.raises(TypeError, match=r"data must be a sweep's data \(a dict\), got list"):
        Sweep([data])
    with pytest.raises(ValueError, match=r"data\['runs'\] must be a non-empty list of runs"):
        Sweep({**data, "runs": []})
    runs = [dict(r) for r in data["runs"]]
    runs[2] = {k: v for k, v in runs[2].items() if k != "eval"}
    with pytest.raises(ValueError, match=r"data\['runs'\]\[2\] lacks 'eval'"):
        Sweep({**data, "runs": runs})
    runs = [dict(r) for r in data["runs"]]
    runs[1] = {**runs[1], "config": {k: v for k, v in runs[1]["config"].items() if k != "seq_len"}}
    with pytest.raises(ValueError, match=r"data\['runs'\]\[1\] lacks config\['seq_len'\]"):
        Sweep({**data, "runs": runs})
    runs = [dict(r) for r in data["runs"]]
    runs[0] = {**runs[0], "eval": {k: v for k, v in runs[0]["eval"].items() if k != "passkey"}}
    with pytest.raises(ValueError, match=r"data\['runs'\]\[0\] lacks eval\['passkey'\]"):
        Sweep({**data, "runs": runs})
    runs[0] = {**runs[0], "eval": {**data["runs"][0]["eval"], "passkey": {"lengths": PK_LENGTHS}}}
    with pytest.raises(ValueError, match=r"data\['runs'\]\[0\] lacks eval\['passkey'\]\['depths'\]"):
        Sweep({**data, "runs": runs})


def _row() -> dict[str, str]:
    return {"method": "pi", "factor": "2.0", "finetune_steps": "0", "metric": "bpb_tail", "length": "256",
            "where": "", "seed": "0", "value": "1.5"}


@pytest.mark.parametrize("field", CSV_FIELDS)
def test_extension_row_without_a_field_names_it(field):
    rows = [_row(), {k: v for k, v in _row().items() if k != field}]
    with pytest.raises(ValueError, match=rf"rows\[1\] lacks the field\(s\) '{field}'; a row of an extension CSV "
                                         rf"holds \['seed', 'method', .*'value'\]"):
        Extension(rows, {})


def test_extension_bad_rows_units_and_data():
    with pytest.raises(TypeError, match="rows must be a list of an extension CSV's rows"):
        Extension(_row(), {})
    with pytest.raises(TypeError, match=r"rows\[0\] must be a dict"):
        Extension(["pi,2.0"], {})
    with pytest.raises(TypeError, match="data must be an extension result's data"):
        Extension([_row()], None)
    with pytest.raises(ValueError, match=r"rows\[0\] is not a row of an extension CSV .*: could not convert"):
        Extension([{**_row(), "value": "abc"}], {})
    with pytest.raises(ValueError, match=r"rows\[0\] is not a row of an extension CSV .*invalid literal for int"):
        Extension([{**_row(), "length": "2.5"}], {})
    unit = {"method": "pi", "factor": 2.0, "finetune_steps": 0, "seed": 0, "tail": {}}
    with pytest.raises(ValueError, match=r"data\['units'\]\[1\] lacks the field\(s\) 'seed'; a unit of an "
                                         r"extension result holds \['method', 'factor', 'finetune_steps', 'seed'\]"):
        Extension([_row()], {"units": [unit, {k: v for k, v in unit.items() if k != "seed"}]})
    with pytest.raises(TypeError, match=r"data\['units'\] must be a list"):
        Extension([_row()], {"units": unit})
    ext = Extension([_row()], {"units": [unit]})  # complete: reads as before
    assert (ext.methods, ext.factors, ext.steps) == (["pi"], [2.0], [0])
    np.testing.assert_array_equal(ext.get("pi", 2.0, 0, "bpb_tail", 256), [1.5])


def test_load_extension_a_part_with_an_incomplete_row(tmp_path, ext_case):
    _, rows, data = ext_case
    part_rows, part_data = _ext_part(rows, data, TUNED_SEEDS, 1.0)
    save_csv(tmp_path / "p.csv", [{k: v for k, v in r.items() if k != "value"} for r in part_rows],
             [f for f in CSV_FIELDS if f != "value"])
    save_result(tmp_path / "p.json", part_data)
    with pytest.raises(ValueError, match=r"rows\[0\] lacks the field\(s\) 'value'"):
        load_extension(tmp_path)


# ----------------------------------------------------------------------------------------------
# the stored results still load (each read against the JSON itself)
# ----------------------------------------------------------------------------------------------

STORED = Path(__file__).resolve().parents[1] / "chapters" / "data"


@pytest.mark.parametrize("name", ["08_sweep", "11_baselines.json", "11_sweep.json"])
def test_stored_sweeps_load(name):
    path = STORED / name
    sw = load_sweep(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    runs = [r for f in files for r in load_result(f)["data"]["runs"]]
    assert sw.schemes == list(dict.fromkeys(r["config"]["scheme"] for r in runs))
    for scheme in sw.schemes:
        mine = sorted((r for r in runs if r["config"]["scheme"] == scheme), key=lambda r: r["config"]["seed"])
        assert sw.seeds(scheme) == [r["config"]["seed"] for r in mine]
        want = [[r["eval"]["bpb"][str(w)]["tail"] for w in r["eval"]["lengths"]] for r in mine]
        np.testing.assert_array_equal(sw.curve(scheme), want)


def test_stored_extension_loads():
    """Chapter 9's run, stored in parts: every stored row reads back through load_extension, and
    every job has its per-block and per-trial values."""
    folder = STORED / "09_extension"
    ext = load_extension(folder)
    parts = sorted(folder.glob("*.csv"))
    assert len(parts) == len(ext.data["parts"]) >= 1
    rows = [r for p in parts for r in load_csv(p)[1]]
    assert ext.methods == list(dict.fromkeys(r["method"] for r in rows))
    for r in rows[:: max(1, len(rows) // 200)]:              # a spread of the rows, every metric
        got = ext.get(r["method"], float(r["factor"]), int(r["finetune_steps"]), r["metric"], int(r["length"]),
                      r["where"], seeds=[int(r["seed"])])
        assert got.tolist() == [float(r["value"])]
    assert len(ext.data["units"]) == len({(r["method"], r["factor"], r["finetune_steps"], r["seed"]) for r in rows})


def test_blocks_of_a_sweep_stored_without_them_is_a_clear_error():
    # a sweep stored without per-block values (as the lab wrote them before it kept blocks)
    data = load_result(STORED / "08_sweep" / "rope-alibi.json")["data"]
    sw = Sweep(data)
    assert sw.blocks("rope", "tail", sw.lengths[0]).shape[0] == len(sw.seeds("rope"))
    for run in data["runs"]:
        del run["eval"]["blocks"]
    with pytest.raises(ValueError, match="no per-block values for 'rope'"):
        Sweep(data).blocks("rope", "tail", sw.lengths[0])


# ----------------------------------------------------------------------------------------------
# chapter 13's bases run: the extension rows of several bases in one CSV
# ----------------------------------------------------------------------------------------------

BASES_RUN = {"rope-b100": 100.0, "rope": 10000.0, "rope-b1e6": 1e6}  # scheme -> base, stored order


def _bases_case():
    """Rows and data of a synthetic bases run: per scheme, seeds 2 and 0 (out of order), an
    as-trained job (factor 1, 0 steps) and a fine-tuned one (factor 4, 5 steps), each with a
    distinct value per cell and a unit with tail blocks."""
    rng = np.random.default_rng(13)
    rows, units, truth = [], [], {}
    for scheme, base in BASES_RUN.items():
        for seed in (2, 0):
            for factor, steps in ((1.0, 0), (4.0, 5)):
                for length in (TRAIN_LEN, 4 * TRAIN_LEN):
                    v = float(rng.uniform(1, 5))
                    truth[scheme, seed, factor, steps, length] = v
                    rows.append({"scheme": scheme, "base": f"{base:g}", "seed": seed, "method": "none",
                                 "factor": factor, "finetune_steps": steps, "metric": "bpb_tail",
                                 "length": length, "where": "", "value": repr(v)})
                units.append({"scheme": scheme, "base": base, "seed": seed, "method": "none", "factor": factor,
                              "finetune_steps": steps, "tail": {str(TRAIN_LEN): rng.uniform(1, 5, 4).tolist()}})
    bounds = {s: {"base": b, "head_dim": 16, "critical_dimension": 2 * i} for i, (s, b) in enumerate(BASES_RUN.items())}
    return _as_csv_strings(rows), {"units": units, "bounds": bounds}, truth


def test_bases_split_by_base():
    from companion.lab.results import Bases

    rows, data, truth = _bases_case()
    run = Bases(rows, data)
    assert run.bases == [100.0, 10000.0, 1e6]                    # increasing, whatever the stored order
    for scheme, base in BASES_RUN.items():
        assert run.scheme(base) == scheme
        ext = run.extension(base)
        for factor, steps in ((1.0, 0), (4.0, 5)):
            got = ext.get("none", factor, steps, "bpb_tail", 4 * TRAIN_LEN)
            assert got.tolist() == [truth[scheme, 0, factor, steps, 4 * TRAIN_LEN],
                                    truth[scheme, 2, factor, steps, 4 * TRAIN_LEN]]    # seeds sorted
            unit = [u for u in data["units"] if (u["scheme"], u["seed"], u["finetune_steps"]) == (scheme, 2, steps)]
            assert ext.blocks("none", factor, steps, "tail", TRAIN_LEN, seeds=[2]).tolist() == \
                [unit[0]["tail"][str(TRAIN_LEN)]]
        assert run.bound(base) == data["bounds"][scheme]
    # a base's extension holds no other base's rows
    assert run.extension(100.0).get("none", 1.0, 0, "bpb_tail", TRAIN_LEN).tolist() != \
        run.extension(1e6).get("none", 1.0, 0, "bpb_tail", TRAIN_LEN).tolist()


def test_bases_round_trip_through_files(tmp_path):
    from companion.lab.recipe_lab import BASES_CSV_FIELDS
    from companion.lab.results import Bases, load_bases

    rows, data, truth = _bases_case()
    csv_path = save_csv(tmp_path / "bases.csv", rows, BASES_CSV_FIELDS, command="recipe_lab bases")
    save_result(tmp_path / "bases.json", data)
    run = load_bases(csv_path)
    mem = Bases(rows, data)
    for base in mem.bases:
        assert run.extension(base).get("none", 4.0, 5, "bpb_tail", TRAIN_LEN).tolist() == \
            mem.extension(base).get("none", 4.0, 5, "bpb_tail", TRAIN_LEN).tolist()
    with pytest.raises(FileNotFoundError, match="is not a file"):
        load_bases(tmp_path / "absent.csv")
    (tmp_path / "bases.json").unlink()
    with pytest.raises(FileNotFoundError, match="bases.json"):
        load_bases(csv_path)
    with pytest.raises(TypeError, match="path"):
        load_bases(None)


def test_bases_bad_input():
    from companion.lab.results import Bases

    rows, data, _ = _bases_case()
    run = Bases(rows, data)
    with pytest.raises(ValueError, match=r"base must be one of \[100.0, 10000.0, 1000000.0\], got 500"):
        run.extension(500)
    with pytest.raises(ValueError, match="base must be one of"):
        run.scheme(True)
    with pytest.raises(ValueError, match=r"rows\[0\] lacks 'scheme' or 'base'"):
        Bases([{k: v for k, v in rows[0].items() if k != "base"}], data)
    with pytest.raises(ValueError, match=r"rows\[1\] has base 'x', not a number"):
        Bases([rows[0], {**rows[1], "base": "x"}], data)
    with pytest.raises(ValueError, match="'rope' appears under two bases"):
        Bases([r if r["scheme"] != "rope" or i % 2 else {**r, "base": "20000"} for i, r in enumerate(rows)], data)
    with pytest.raises(ValueError, match=r"data\['units'\]\[0\] lacks 'scheme'"):
        Bases(rows, {"units": [{k: v for k, v in data["units"][0].items() if k != "scheme"}]})
    with pytest.raises(TypeError, match="rows must be a list"):
        Bases("rows", data)
    with pytest.raises(TypeError, match="data must be"):
        Bases(rows, None)
    with pytest.raises(KeyError, match="no bounds"):
        Bases(rows, {"units": data["units"]}).bound(100.0)
