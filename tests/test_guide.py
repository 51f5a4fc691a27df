"""Tests for companion.lab.guide, the computation behind Appendix B.

Two kinds of input:

* the real stored results in ``chapters/data/``: every section is compared with a value read
  here straight from the raw JSON or CSV files (means over seeds, intervals of the raw
  per-block values, Wilson intervals of the raw passkey trials, perplexities from the bucket
  rows, passkey counts), never through the guide's own helpers, and the rules of thumb are
  shown to fail, each on its own, when one stored number is moved past a rule's threshold;
* small synthetic inputs whose answer follows by hand: :func:`verdict` on curves built to be
  flat, between or broken, :func:`geometric_mean`, and sweep parts under ``08_sweep/`` and
  ``11_sweep/`` for :func:`lab_sweeps` (seeds per scheme, its intervals, its errors).

Every public function is also given bad input, and the error must name the argument. Two
presentation rules are checked on every section: no Markdown table is wider than
:data:`MAX_COLUMNS` columns, and no printed line repeats a row of a table (the page shows each
table once, as Markdown); and every table a section glues is shown by the appendix.
Equalities are exact where a value is copied or formatted from the same doubles (an interval
is recomputed here from the raw blocks with the same seeded bootstrap); the tolerances are a
few ulps, for a geometric mean and for a Wilson interval written out from its formula.
"""

from __future__ import annotations

import copy
import csv
import functools
import io
import json
import math
import re
from collections import Counter
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from companion.lab import guide
from companion.lab.evaluate import TAIL
from companion.lab.results import difference
from companion.lab.schemes import scheme_label
from companion.utils import SCHEDULING_FLAGS, shown_command

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "chapters" / "data"
APPENDIX = REPO / "book" / "appendix_b_choosing.ipynb"
#: The widest table the book shows, counting the label column (a wider one is split or plotted).
MAX_COLUMNS = 7
#: Every function that returns a Section, in the appendix's order.
SECTIONS = [guide.provenance, guide.models, guide.encoder_table, guide.decoder_table, guide.extension_lab_table,
            guide.extension_smol_table, guide.smol_passkey, guide.streaming_lab_table, guide.streaming_smol_table,
            guide.grid_table, guide.kernel_table, guide.recipe_rules, guide.engine_support, guide.rules_of_thumb]
#: The folders of chapter 8's and chapter 11's sweep parts.
SWEEPS = ("08_sweep", "11_sweep")
#: Floating-point slack of a Wilson bound written out here against the package's.
ULPS = 1e-12


@pytest.fixture(scope="module")
def stored() -> guide.Stored:
    return guide.load_stored(DATA)


def _copy(stored: guide.Stored, data_dir: Path | None = None) -> guide.Stored:
    """A fresh Stored (its own memo) over deep copies of the stored results."""
    return guide.Stored(data_dir or stored.data_dir, copy.deepcopy(stored.results), copy.deepcopy(stored.tables))


def _row(table: guide.Table, label: str) -> list[str]:
    rows = [r for r in table.rows if r[0] == label]
    assert len(rows) == 1, (label, [r[0] for r in table.rows])
    return rows[0]


def _f2(x: float) -> str:
    return f"{x:.2f}".replace("-0.00", "0.00")


# ------------------------------------------------------------------------------------------------
# the raw files, read here (never through the guide); nothing read is ever changed
# ------------------------------------------------------------------------------------------------


@functools.cache
def _raw(rel: str) -> dict:
    """The payload (provenance and data) of a JSON result, by its path in the data folder."""
    return json.loads((DATA / rel).read_text(encoding="utf-8"))


@functools.cache
def _raw_csv(rel: str) -> tuple[dict, list[dict[str, str]]]:
    """(provenance, rows) of a result CSV, by its path in the data folder."""
    first, _, rest = (DATA / rel).read_text(encoding="utf-8").partition("\n")
    assert first.startswith("# provenance: ")
    return json.loads(first[len("# provenance: "):]), list(csv.DictReader(io.StringIO(rest, newline="")))


def _part_files(folder: str, ext: str = "json") -> list[str]:
    """The parts in a folder, as paths in the data folder, in name order."""
    return [f"{folder}/{p.name}" for p in sorted((DATA / folder).glob(f"*.{ext}"))]


def _raw_schemes(folder: str) -> list[str]:
    """A sweep folder's schemes, in the order of its parts and runs."""
    return list(dict.fromkeys(r["config"]["scheme"] for p in _part_files(folder) for r in _raw(p)["data"]["runs"]))


def _scheme_runs(scheme: str) -> list[dict]:
    """A lab scheme's runs in chapters 8 and 11's sweep parts, by seed."""
    runs = [r for f in SWEEPS for p in _part_files(f) for r in _raw(p)["data"]["runs"]
            if r["config"]["scheme"] == scheme]
    assert runs, scheme
    return sorted(runs, key=lambda r: r["config"]["seed"])


def _raw_eval_config() -> dict:
    return _raw(_part_files("08_sweep")[0])["data"]["eval_config"]


def _raw_lengths() -> list[int]:
    train = _raw(_part_files("08_sweep")[0])["data"]["runs"][0]["config"]["seq_len"]
    return [m * train for m in _raw_eval_config()["multiples"]]


def _raw_tail(scheme: str) -> np.ndarray:
    """(seeds, lengths) tail bits per byte of a lab scheme, from the raw sweep parts."""
    return np.array([[r["eval"]["bpb"][str(w)]["tail"] for w in _raw_lengths()] for r in _scheme_runs(scheme)])


def _raw_blocks(scheme: str, w: int) -> np.ndarray:
    """(seeds, blocks) per-block tail bits per byte at length w, from the raw sweep parts."""
    return np.array([r["eval"]["blocks"]["tail"][str(w)] for r in _scheme_runs(scheme)])


def _raw_far(scheme: str) -> np.ndarray:
    """(seeds, trials): the exact copies of the key farthest back (the smallest depth) at the longest length."""
    out = []
    for r in _scheme_runs(scheme):
        pk = r["eval"]["passkey"]
        out.append(pk["exact_trials"][pk["lengths"].index(r["eval"]["lengths"][-1])][
            pk["depths"].index(min(pk["depths"]))])
    return np.array(out)


def _wilson(k: int, n: int) -> tuple[float, float, float]:
    """(share, low, high): the 95% Wilson score interval, written out from its formula."""
    z = NormalDist().inv_cdf(0.975)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return p, max(0.0, centre - half), min(1.0, centre + half)


def _wilson_text(hits: np.ndarray) -> str:
    p, low, high = _wilson(int(np.sum(hits)), int(np.size(hits)))
    return f"{p:.2f} [{low:.2f}, {high:.2f}]"


def _raw_verdict(tail: np.ndarray, mult: list[int]) -> str:
    rise = tail - tail[:, [mult.index(1)]]
    if (rise < 0.5).all():
        return "flat"
    return "breaks" if (rise[:, -1] > 2.0).all() else "between"


def _raw_ext_rows() -> list[dict[str, str]]:
    """Every row of chapter 9's CSV parts."""
    return [r for p in _part_files("09_extension", "csv") for r in _raw_csv(p)[1]]


def _raw_ext(method: str, factor: float, steps: int, length: int, seeds: list[int] | None = None) -> np.ndarray:
    """One tail value per seed (sorted, or ``seeds``) of a cell of chapter 9's CSV parts."""
    vals = {int(r["seed"]): float(r["value"]) for r in _raw_ext_rows()
            if r["method"] == method and float(r["factor"]) == factor and int(r["finetune_steps"]) == steps
            and r["metric"] == "bpb_tail" and int(r["length"]) == length and r["where"] == ""}
    assert vals, (method, factor, steps, length)
    return np.array([vals[s] for s in (sorted(vals) if seeds is None else seeds)])


def _raw_trainfree() -> list[dict]:
    """Chapter 11's training-free runs on the lab model, by seed."""
    return sorted((r for p in _part_files("11_trainfree_lab") for r in _raw(p)["data"]["runs"]),
                  key=lambda r: r["seed"])


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------


def test_load_stored_reads_every_result_and_every_part(stored):
    parts_json = {p.removesuffix(".json") for f in guide.STORED_PARTS for p in _part_files(f)}
    parts_csv = {p.removesuffix(".csv") for f in guide.STORED_PARTS for p in _part_files(f, "csv")}
    assert len(parts_json) == 7 + 4 + 2 + 1 and len(parts_csv) == 4      # what the folders hold today
    assert set(stored.results) == set(guide.STORED_JSON) | parts_json
    assert set(stored.tables) == set(guide.STORED_CSV) | parts_csv
    assert stored.data("11_sweep") is stored.results["11_sweep"]["data"]       # the first-protocol file
    assert stored.data("08_sweep/rope-alibi") is stored.results["08_sweep/rope-alibi"]["data"]
    assert stored.data("08_sweep/rope-alibi") == _raw("08_sweep/rope-alibi.json")["data"]
    assert stored.rows("09_extension/1-as-is") == _raw_csv("09_extension/1-as-is.csv")[1]
    assert stored.rows("10_context") == _raw_csv("10_context.csv")[1]
    assert stored.rows("10_passkey") is stored.tables["10_passkey"][1]
    for folder in guide.STORED_PARTS:
        assert stored.parts(folder) == sorted(
            {p.rsplit(".", 1)[0] for p in _part_files(folder) + _part_files(folder, "csv")})
    assert stored.parts("09_extension") == [f"09_extension/{n}" for n in
                                            ("1-as-is", "2-tuned-200", "3-budget", "4-tuned-200-more-seeds")]
    assert stored.data_dir == DATA


def test_load_stored_bad_input(tmp_path):
    with pytest.raises(TypeError, match="data_dir"):
        guide.load_stored(None)
    with pytest.raises(NotADirectoryError, match="data_dir"):
        guide.load_stored(tmp_path / "missing")
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(NotADirectoryError, match="data_dir"):
        guide.load_stored(tmp_path / "a.json")
    with pytest.raises(FileNotFoundError, match="04_relative_cpu.json"):   # an empty folder: the first file
        guide.load_stored(tmp_path)


@pytest.mark.parametrize("folder", guide.STORED_PARTS)
def test_load_stored_wants_every_folder_of_parts(tmp_path, folder):
    data = tmp_path / "data"
    data.mkdir()
    for name in guide.STORED_JSON:
        (data / f"{name}.json").symlink_to(DATA / f"{name}.json")
    for name in guide.STORED_CSV:
        (data / f"{name}.csv").symlink_to(DATA / f"{name}.csv")
    for other in guide.STORED_PARTS:
        if other != folder:
            (data / other).symlink_to(DATA / other, target_is_directory=True)
    missing = re.escape(str(Path(folder))) + r" holds no stored parts"
    with pytest.raises(FileNotFoundError, match=missing):          # no folder
        guide.load_stored(data)
    (data / folder).mkdir()
    with pytest.raises(FileNotFoundError, match=missing):          # an empty folder
        guide.load_stored(data)
    (data / folder / "x.csv").symlink_to(DATA / "10_ppl.csv")
    with pytest.raises(FileNotFoundError, match=missing):          # a CSV alone is not a part
        guide.load_stored(data)
    (data / folder / "x.csv").unlink()
    for p in _part_files(folder) + _part_files(folder, "csv"):
        (data / p).symlink_to(DATA / p)
    assert guide.load_stored(data).parts(folder) == guide.load_stored(DATA).parts(folder)


def test_stored_lookups_name_the_argument(stored):
    with pytest.raises(ValueError, match="name must be one of"):
        stored.data("10_passkey")   # a CSV, not a JSON result
    with pytest.raises(ValueError, match="name must be one of"):
        stored.data("08_sweep")     # a folder of parts, not a result
    with pytest.raises(ValueError, match="name must be one of"):
        stored.rows("08_sweep/rope-alibi")   # a part without a CSV
    with pytest.raises(ValueError, match="name must be one of"):
        stored.rows("09_extension")
    for folder in ("10_ppl", "08", "13_recipe", ""):
        with pytest.raises(ValueError, match=rf"folder must be one of the folders of parts .*got '{folder}'"):
            stored.parts(folder)


@pytest.mark.parametrize("fn", [guide.lab_sweeps] + SECTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [None, "chapters/data", {"08_sweep": {}}])
def test_every_section_wants_a_stored(fn, bad):
    with pytest.raises(TypeError, match="stored must be the Stored"):
        fn(bad)


# ------------------------------------------------------------------------------------------------
# small helpers, on synthetic input
# ------------------------------------------------------------------------------------------------


def test_chapter_link():
    assert guide.chapter_link(8) == "[ch. 8](../chapters/08_extrapolation.ipynb)"
    assert guide.chapter_link(12, "*Grids*") == "[ch. 12](../chapters/12_grids.ipynb), *Grids*"


@pytest.mark.parametrize("chapter, where, error, match", [
    (1, "", ValueError, "chapter must be one of"),
    (13, "", ValueError, "chapter must be one of"),
    ("8", "", ValueError, "chapter must be one of"),
    (True, "", ValueError, "chapter must be one of"),
    (8, None, TypeError, "where must be a str"),
])
def test_chapter_link_bad_input(chapter, where, error, match):
    with pytest.raises(error, match=match):
        guide.chapter_link(chapter, where)


MULT = [1, 2, 4]


@pytest.mark.parametrize("tail, expected", [
    ([[2.0, 2.1, 2.4], [3.0, 2.9, 3.45]], "flat"),       # no seed rises 0.5 anywhere
    ([[2.0, 2.1, 2.5], [3.0, 2.9, 3.0]], "between"),     # a rise of exactly 0.5 is not flat
    ([[2.0, 4.5, 4.1], [2.0, 2.0, 4.01]], "breaks"),     # every seed more than 2 worse at the end
    ([[2.0, 4.5, 4.1], [2.0, 2.0, 4.0]], "between"),     # one seed exactly 2 worse: not broken
    ([[2.0, 9.0, 2.0]], "between"),                      # a rise in the middle only
    ([[3.0, 1.0, 1.0]], "flat"),                         # falling is flat
])
def test_verdict_on_built_curves(tail, expected):
    assert guide.verdict(tail, MULT) == expected


def test_verdict_uses_the_training_length_column_and_thresholds():
    # the training length is the middle column here: a rise is measured from it
    assert guide.verdict([[1.0, 2.0, 2.2]], [0.5, 1, 2]) == "flat"
    assert guide.verdict([[1.0, 2.0, 2.2]], [1, 0.5, 2]) == "between"
    assert guide.verdict([[2.0, 2.2, 2.6]], MULT, flat_bits=1.0) == "flat"
    assert guide.verdict([[2.0, 2.2, 2.6]], MULT, break_bits=0.5) == "breaks"


@pytest.mark.parametrize("tail, multiples, kwargs, error, match", [
    ([[1.0, 2.0]], [2, 4], {}, ValueError, "multiples must hold 1"),
    ([[1.0, 2.0]], [1, 2, 4], {}, ValueError, "multiples must have one entry per column"),
    ([[1.0, float("nan")]], [1, 2], {}, ValueError, "tail must hold finite"),
    ([1.0, 2.0], [1, 2], {}, ValueError, "tail must be a non-empty 2-D array"),
    ([[]], [], {}, ValueError, "tail must be a non-empty 2-D array"),
    ("abc", [1], {}, TypeError, "tail must be an array of numbers"),
    ([[1.0, 2.0]], [1, 2], {"flat_bits": 0}, ValueError, "flat_bits"),
    ([[1.0, 2.0]], [1, 2], {"break_bits": "2"}, TypeError, "break_bits"),
])
def test_verdict_bad_input(tail, multiples, kwargs, error, match):
    with pytest.raises(error, match=match):
        guide.verdict(tail, multiples, **kwargs)


def test_geometric_mean():
    assert guide.geometric_mean([1.0, 100.0]) == pytest.approx(10.0, rel=4 * np.finfo(float).eps)
    assert guide.geometric_mean([2, 8]) == pytest.approx(4.0, rel=4 * np.finfo(float).eps)
    assert guide.geometric_mean(np.array([7.5])) == pytest.approx(7.5, rel=4 * np.finfo(float).eps)


@pytest.mark.parametrize("values, error, match", [
    ([], ValueError, "values must hold at least one"),
    ([1.0, -2.0], ValueError, r"values\[1\]"),
    ([1.0, 0.0], ValueError, r"values\[1\]"),
    ([1.0, float("inf")], ValueError, r"values\[1\]"),
    ([1.0, "2"], TypeError, r"values\[1\]"),
    ("12", TypeError, "values must be a sequence"),
    (3.0, TypeError, "values must be a sequence"),
])
def test_geometric_mean_bad_input(values, error, match):
    with pytest.raises(error, match=match):
        guide.geometric_mean(values)


def test_section_markdown_and_failed():
    table = guide.Table(["a", "b"], [["1", 2], ["3", "4"]])
    s = guide.Section(["a line"], {"x": 1}, {"holds": True, "breaks": False}, {"table_ab": table})
    assert table.markdown() == "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |"
    assert s.markdown("table_ab") == table.markdown()
    assert s.failed == ["breaks"]
    with pytest.raises(ValueError, match=r"name must be one of this section's tables \['table_ab'\]"):
        s.markdown("table_a")
    with pytest.raises(ValueError, match=r"name must be one of this section's tables \[\]"):
        guide.Section(["a line"]).markdown("table_ab")


@pytest.mark.parametrize("header, rows, match", [
    ([], [], "header must name at least one column"),
    (["a", "b"], [["1", "2"], ["3"]], r"one cell per heading \(2\); rows \[1\]"),
    (["a"], [["1", "2"]], r"one cell per heading \(1\); rows \[0\]"),
])
def test_table_bad_input(header, rows, match):
    with pytest.raises(ValueError, match=match):
        guide.Table(header, rows)


def test_split_keeps_the_label_column_and_every_other_column_once():
    header, rows = ["x", "a", "b", "c"], [["r1", "1", "2", "3"], ["r2", "4", "5", "6"]]
    parts = guide._split(header, rows, {"t_ac": [1, 3], "t_b": [2]})
    assert list(parts) == ["t_ac", "t_b"]
    assert parts["t_ac"] == guide.Table(["x", "a", "c"], [["r1", "1", "3"], ["r2", "4", "6"]])
    assert parts["t_b"] == guide.Table(["x", "b"], [["r1", "2"], ["r2", "5"]])
    for bad in ({"t": [1, 2]}, {"t": [1, 2, 3], "u": [3]}, {"t": [0, 1, 2, 3]}):
        with pytest.raises(ValueError, match="share out the columns 1 to 3 once each"):
            guide._split(header, rows, bad)


# ------------------------------------------------------------------------------------------------
# lab_sweeps on synthetic parts
# ------------------------------------------------------------------------------------------------


def _part(runs_of, tail, train=16, multiples=(1, 2, 4), pk_multiples=(2, 4), depths=(0.5, 0.0), trials=4,
          steps=5, windows=8):
    """A sweep part's payload. ``runs_of`` is [(scheme, seed), ...]; tail(scheme, seed, w) the bits
    per byte, the three blocks around it (their mean); the passkey copies every key exactly but
    the farthest one (depth 0.0, index 1) at the longest length, where it copies ``seed + 1`` of
    its ``trials``."""
    lengths = [m * train for m in multiples]
    pk_lengths = [m * train for m in pk_multiples]
    runs = []
    for s, sd in runs_of:
        exact = [[[1] * trials for _ in depths] for _ in pk_lengths]
        if lengths[-1] in pk_lengths:
            exact[pk_lengths.index(lengths[-1])][list(depths).index(min(depths))] = \
                [1] * (sd + 1) + [0] * (trials - sd - 1)
        runs.append({"config": {"scheme": s, "seed": sd, "seq_len": train, "steps": steps, "d_model": 8},
                     "parameters": 100 + len(s),
                     "eval": {"lengths": lengths, "bpb": {str(w): {"tail": tail(s, sd, w)} for w in lengths},
                              "blocks": {"tail": {str(w): [tail(s, sd, w) - 0.02 * (sd + 1), tail(s, sd, w),
                                                           tail(s, sd, w) + 0.02 * (sd + 1)] for w in lengths}},
                              "passkey": {"lengths": pk_lengths, "depths": list(depths), "exact_trials": exact}}})
    data = {"eval_config": {"multiples": list(multiples), "windows": windows, "blocks": 3,
                            "passkey_multiples": list(pk_multiples), "passkey_depths": list(depths),
                            "passkey_trials": trials},
            "corpus": {"source": "synthetic"}, "runs": runs}
    return {"provenance": {}, "data": data}


def _lab_stored(tmp_path, parts):
    """A Stored holding only sweep parts, by name (``08_sweep/x``)."""
    return guide.Stored(tmp_path, dict(parts), {})


def _tail(s, sd, w):
    return {"nope": 3.0, "rope": 2.0, "alibi": 2.5}[s] + sd / 10 + w / 1000


def _blocks_of(parts, scheme, w):
    """(seeds, blocks) read from synthetic parts, by seed."""
    runs = sorted((r for p in parts.values() for r in p["data"]["runs"] if r["config"]["scheme"] == scheme),
                  key=lambda r: r["config"]["seed"])
    return np.array([r["eval"]["blocks"]["tail"][str(w)] for r in runs])


def test_lab_sweeps_on_synthetic_parts(tmp_path):
    parts = {"08_sweep/b": _part([("rope", 1), ("rope", 0)], _tail),    # seeds stored out of order
             "08_sweep/a": _part([("nope", 2), ("nope", 0), ("nope", 1)], _tail),
             "11_sweep/y": _part([("alibi", 0), ("alibi", 1)], _tail),
             "11_sweep/z": _part([("alibi", 3)], _tail)}                 # one scheme in two parts
    st = _lab_stored(tmp_path, parts)
    assert st.parts("08_sweep") == ["08_sweep/a", "08_sweep/b"] and st.parts("11_sweep") == ["11_sweep/y", "11_sweep/z"]
    lab = guide.lab_sweeps(st)
    assert lab is guide.lab_sweeps(st)                                  # computed once per Stored
    assert lab.schemes8 == ["nope", "rope"] and lab.schemes11 == ["alibi"] and lab.schemes == ["nope", "rope", "alibi"]
    assert lab.seeds == {"nope": [0, 1, 2], "rope": [0, 1], "alibi": [0, 1, 3]}
    assert lab.train_len == 16 and lab.multiples == [1, 2, 4] and lab.lengths == [16, 32, 64]
    assert lab.i1 == 0 and lab.i_last == 2
    assert lab.config == parts["08_sweep/a"]["data"]["runs"][0]["config"]      # the first part's first run
    assert lab.eval_config == parts["08_sweep/a"]["data"]["eval_config"]
    assert sorted(lab.sweep.runs) == sorted((s, sd) for p in parts.values() for s, sd in
                                            ((r["config"]["scheme"], r["config"]["seed"]) for r in p["data"]["runs"]))
    for s, seeds in lab.seeds.items():
        expected = np.array([[_tail(s, sd, w) for w in (16, 32, 64)] for sd in seeds])
        np.testing.assert_array_equal(lab.tail[s], expected)
        np.testing.assert_array_equal(lab.mean[s], expected.mean(0))
        # the key farthest back (depth 0.0) at the longest length (64): seed + 1 of 4 trials copied
        np.testing.assert_array_equal(lab.far_trials[s], [[1] * (sd + 1) + [0] * (3 - sd) for sd in seeds])
    assert lab.checks == {"chapter 11's sweep trained with chapter 8's recipe": True}

    # the intervals: the package's bootstrap on the raw blocks, each scheme averaged over its own seeds
    for m, w in ((None, 64), (4, 64), (2, 32), (1, 16)):
        assert lab.gap("rope", "alibi", m) == difference(_blocks_of(parts, "rope", w), _blocks_of(parts, "alibi", w))
        assert lab.rise("nope", m) == difference(_blocks_of(parts, "nope", w), _blocks_of(parts, "nope", 16))
    assert lab.gap("rope", "alibi").estimate == pytest.approx(
        np.mean([_tail("rope", sd, 64) for sd in (0, 1)]) - np.mean([_tail("alibi", sd, 64) for sd in (0, 1, 3)]))
    assert lab.rise("nope").estimate == pytest.approx(0.048)              # (64 - 16) / 1000 on every seed
    assert lab.rise("nope", 1).estimate == 0.0
    # the Wilson interval of the pooled far-key trials: alibi's seeds 0, 1, 3 copy 1 + 2 + 4 of 12
    for s, (k, n) in {"alibi": (7, 12), "rope": (3, 8), "nope": (6, 12)}.items():
        rate = lab.far_rate(s)
        p, low, high = _wilson(k, n)
        assert (rate.estimate, rate.units) == (p, n)
        assert rate.low == pytest.approx(low, abs=ULPS) and rate.high == pytest.approx(high, abs=ULPS)


def test_lab_sweeps_far_rate_at_none_and_every_trial(tmp_path):
    def copies(hits):   # every far-key trial of both ALiBi seeds set to ``hits``
        p8, p11 = _part([("nope", 0)], _tail), _part([("alibi", 0), ("alibi", 1)], _tail)
        for r in p11["data"]["runs"]:
            r["eval"]["passkey"]["exact_trials"][1][1] = [hits] * 4
        return guide.lab_sweeps(_lab_stored(tmp_path, {"08_sweep/x": p8, "11_sweep/y": p11})).far_rate("alibi")

    none, every = copies(0), copies(1)
    assert (none.estimate, none.low, none.units) == (0.0, 0.0, 8) and none.high == pytest.approx(_wilson(0, 8)[2])
    assert (every.estimate, every.high) == (1.0, 1.0) and every.low == pytest.approx(_wilson(8, 8)[1])


def test_lab_sweeps_bad_arguments_name_them(tmp_path):
    st = _lab_stored(tmp_path, {"08_sweep/x": _part([("nope", 0), ("rope", 0)], _tail),
                                "11_sweep/y": _part([("alibi", 0)], _tail)})
    lab = guide.lab_sweeps(st)
    for bad in (3, 0, 8, True, 2.0, "2"):
        with pytest.raises(ValueError, match=r"multiple must be one of \[1, 2, 4\]"):
            lab.gap("rope", "alibi", bad)
        with pytest.raises(ValueError, match=r"multiple must be one of \[1, 2, 4\]"):
            lab.rise("rope", bad)
    assert lab.gap("rope", "alibi", np.int64(2)) == lab.gap("rope", "alibi", 2)
    with pytest.raises(ValueError, match="scheme must be one of"):
        lab.gap("rope", "t5")
    with pytest.raises(ValueError, match="scheme must be one of"):
        lab.rise("t5")
    with pytest.raises(ValueError, match=r"scheme must be one of \['nope', 'rope', 'alibi'\], got 't5'"):
        lab.far_rate("t5")


def test_lab_sweeps_checks_and_errors(tmp_path):
    def sweeps(p8, p11):
        return guide.lab_sweeps(_lab_stored(tmp_path, {"08_sweep/x": p8, "11_sweep/y": p11}))

    p8 = _part([("nope", 0), ("nope", 1), ("rope", 0), ("rope", 1)], _tail)
    other = _part([("alibi", 0), ("alibi", 1)], _tail, steps=6)          # another recipe
    assert [n for n, ok in sweeps(p8, other).checks.items() if not ok] == [
        "chapter 11's sweep trained with chapter 8's recipe"]
    assert all(sweeps(p8, _part([("alibi", 0)], _tail)).checks.values())

    with pytest.raises(ValueError, match="11_sweep/y has another eval_config than 08_sweep/x"):
        sweeps(p8, _part([("alibi", 0)], _tail, windows=16))            # another evaluation
    corpus = _part([("alibi", 0)], _tail)
    corpus["data"]["corpus"] = {"source": "another"}
    with pytest.raises(ValueError, match="11_sweep/y has another corpus than 08_sweep/x"):
        sweeps(p8, corpus)
    with pytest.raises(ValueError, match=r"the schemes \['rope'\] are in both chapter 8's and chapter 11's"):
        sweeps(p8, _part([("rope", 2)], _tail))
    with pytest.raises(ValueError, match="scheme 'rope' seed 1 is in both 08_sweep/x and 11_sweep/y"):
        sweeps(p8, _part([("rope", 1)], _tail))
    with pytest.raises(ValueError, match=r"passkey test must reach the longest length 64, its lengths are \[16, 32\]"):
        sweeps(_part([("nope", 0)], _tail, pk_multiples=(1, 2)), _part([("alibi", 0)], _tail, pk_multiples=(1, 2)))
    bare = _part([("alibi", 0)], _tail)
    del bare["data"]["corpus"]
    with pytest.raises(ValueError, match="11_sweep/y is not a sweep result"):
        sweeps(p8, bare)
    with pytest.raises(ValueError, match="folder must be one of the folders of parts .*got '11_sweep'"):
        guide.lab_sweeps(_lab_stored(tmp_path, {"08_sweep/x": p8}))
    with pytest.raises(ValueError, match="folder must be one of the folders of parts .*got '08_sweep'"):
        guide.lab_sweeps(guide.Stored(tmp_path, {}, {}))


# ------------------------------------------------------------------------------------------------
# the sections, on the real stored results
# ------------------------------------------------------------------------------------------------


def test_lab_sweeps_on_the_stored_sweeps(stored):
    lab = guide.lab_sweeps(stored)
    assert lab.checks == {"chapter 11's sweep trained with chapter 8's recipe": True}
    assert lab.schemes8 == _raw_schemes("08_sweep") and lab.schemes11 == _raw_schemes("11_sweep")
    assert len(lab.schemes8) == 8 and len(lab.schemes11) == 6
    assert lab.config == _raw(_part_files("08_sweep")[0])["data"]["runs"][0]["config"]
    assert lab.eval_config == _raw_eval_config() and lab.lengths == _raw_lengths()
    for s in lab.schemes:
        assert lab.seeds[s] == [r["config"]["seed"] for r in _scheme_runs(s)]
        np.testing.assert_array_equal(lab.tail[s], _raw_tail(s))
        np.testing.assert_array_equal(lab.far_trials[s], _raw_far(s))
    assert {s: len(v) for s, v in lab.seeds.items() if len(v) != 5} == {"learned": 3, "sinusoidal": 3, "shaw": 3}
    assert lab.far_trials["alibi"].shape == (5, _raw_eval_config()["passkey_trials"])
    w_last, w1 = lab.lengths[-1], lab.lengths[0]
    assert lab.gap("t5", "learned", 1) == difference(_raw_blocks("t5", w1), _raw_blocks("learned", w1))
    assert lab.gap("shaw", "xl") == difference(_raw_blocks("shaw", w_last), _raw_blocks("xl", w_last))
    assert lab.rise("rope") == difference(_raw_blocks("rope", w_last), _raw_blocks("rope", w1))
    assert lab.rise("rope", 2) == difference(_raw_blocks("rope", 2 * w1), _raw_blocks("rope", w1))
    for s in ("shaw", "rope-window-nope", "alibi"):
        k, n = int(_raw_far(s).sum()), _raw_far(s).size
        rate, (p, low, high) = lab.far_rate(s), _wilson(k, n)
        assert (rate.estimate, rate.units) == (p, n)
        assert rate.low == pytest.approx(low, abs=ULPS) and rate.high == pytest.approx(high, abs=ULPS)


def _raw_provenance() -> dict[tuple[str, str], dict]:
    """(stem, ext) -> provenance of every stored result the guide reads, from the files."""
    prov = {(n, "json"): _raw(f"{n}.json")["provenance"] for n in guide.STORED_JSON}
    prov.update({(n, "csv"): _raw_csv(f"{n}.csv")[0] for n in guide.STORED_CSV})
    for folder in guide.STORED_PARTS:
        prov.update({(p.removesuffix(".json"), "json"): _raw(p)["provenance"] for p in _part_files(folder)})
        prov.update({(p.removesuffix(".csv"), "csv"): _raw_csv(p)[0] for p in _part_files(folder, "csv")})
    for name in ("abf", "bases", "hybrids"):
        prov[f"{guide.RECIPE_DIR}/{name}", "json"] = _raw(f"{guide.RECIPE_DIR}/{name}.json")["provenance"]
    return prov


def test_provenance_one_line_per_command(stored):
    lines = guide.provenance(stored).lines
    prov = _raw_provenance()

    def paired(stem):
        return {(stem, "csv"), (stem, "json")} <= set(prov) and \
            prov[stem, "csv"]["command"] == prov[stem, "json"]["command"]

    shown = [(f"{stem}.{ext}" + (" + .json" if paired(stem) else ""), prov[stem, ext])
             for stem, ext in sorted(prov) if not (ext == "json" and paired(stem))]
    assert lines == [f"{name}: {shown_command(p['command'])} ({p['date_utc'][:10]}, "
                     f"{p.get('cpu_model') or p['machine']}, torch {p['torch']})" for name, p in shown]
    assert [line.split(": ")[0] for line in lines if " + .json: " in line] == [
        f"09_extension/{n}.csv + .json" for n in ("1-as-is", "2-tuned-200", "3-budget", "4-tuned-200-more-seeds")
    ] + ["10_ppl.csv + .json", "11_trainfree_ppl.csv + .json"]
    assert len(lines) == len(prov) - 6
    commands = [line.split(": ", 1)[1].rsplit(" (", 1)[0] for line in lines]
    assert len(set(commands)) == len(lines)                              # one line per command
    assert lines[[n for n, _ in shown].index("08_sweep/rope-alibi.json")].startswith(
        "08_sweep/rope-alibi.json: " + _raw("08_sweep/rope-alibi.json")["provenance"]["command"] + " (")


def test_provenance_pairs_only_files_of_one_command(stored):
    moved = _copy(stored)
    moved.results["10_ppl"]["provenance"]["command"] = "python -m companion.longctx ppl --another-run"
    names = [line.split(": ")[0] for line in guide.provenance(moved).lines]
    assert "10_ppl.csv" in names and "10_ppl.json" in names and "10_ppl.csv + .json" not in names
    assert len(names) == len(guide.provenance(stored).lines) + 1


@pytest.mark.parametrize("command, shown", [
    ("python benchmarks/x.py --threads 1 2 --max-load 0.7 --wait-s 1200", "python benchmarks/x.py --threads 1 2"),
    ("python b.py --max-load=0.5 --out a.json", "python b.py --out a.json"),
    ("python -m companion.lab sweep --seeds 0 1", "python -m companion.lab sweep --seeds 0 1"),
])
def test_shown_command_drops_only_the_scheduling_flags(command, shown):
    assert shown_command(command) == shown


def test_provenance_shows_no_scheduling_flag(stored):
    raw = [p["command"] for p in _raw_provenance().values()]
    assert any("--max-load" in c for c in raw), "the stored data no longer has a scheduled run to check"
    assert not any(flag in line for line in guide.provenance(stored).lines for flag in SCHEDULING_FLAGS)


def test_shown_command_bad_input():
    with pytest.raises(TypeError, match="command"):
        shown_command(["python", "x.py"])


def test_models(stored):
    s = guide.models(stored)
    evc = _raw_eval_config()
    nope = _scheme_runs("nope")[0]
    counts = Counter(len(_scheme_runs(x)) for f in SWEEPS for x in _raw_schemes(f))
    first = _raw("11_sweep.json")["data"]
    first_seeds = {r["config"]["seed"] for r in first["runs"] if r["config"]["scheme"] in guide.FIRST_PROTOCOL}
    assert s.facts == {
        "tail": TAIL, "lab_params": f"{nope['parameters']:,}", "lab_len": nope["config"]["seq_len"],
        "lab_seeds": f"{min(counts)} to {max(counts)}", "lab_tokens": f"{evc['windows'] * TAIL:,}",
        "lab_blocks": evc["blocks"], "lab_trials": evc["passkey_trials"], "first_seeds": len(first_seeds),
        "first_tokens": f"{first['eval_config']['tokens']:,}", "mult_lo": f"{evc['multiples'][0]}x",
        "mult_hi": f"{evc['multiples'][-1]}x", "smol_model": "SmolLM2-135M-Instruct"}
    assert (s.facts["lab_seeds"], s.facts["lab_tokens"], s.facts["first_seeds"]) == ("3 to 5", "131,072", 2)
    assert s.checks == {"chapter 11's sweep trained with chapter 8's recipe": True,
                        "first protocol: one evaluation for both files": True,
                        "first protocol: one recipe for both files": True,
                        "first protocol: every scheme has the same seeds": True}
    assert len(s.lines) == 1 and "3 to 5 seeds per scheme" in s.lines[0]
    assert f"on {evc['windows']:,} windows ({evc['windows'] * TAIL:,} scored bytes per length, in {evc['blocks']} " \
           f"blocks)" in s.lines[0]


def test_models_checks_fail_when_the_protocols_differ(stored):
    def failed(change):
        moved = _copy(stored)
        change(moved)
        return guide.models(moved).failed

    def recipe11(st):    # one run of chapter 11's sweep trained longer
        st.data("11_sweep/a-compared")["runs"][3]["config"]["steps"] += 1

    def first_eval(st):  # the first protocol's baselines scored on other bytes
        st.data("11_baselines")["eval_config"]["tokens"] *= 2

    def first_recipe(st):
        st.data("11_sweep")["runs"][0]["config"]["lr"] /= 2

    assert failed(recipe11) == ["chapter 11's sweep trained with chapter 8's recipe"]
    assert failed(first_eval) == ["first protocol: one evaluation for both files"]
    assert failed(first_recipe) == ["first protocol: one recipe for both files"]

    def first_seeds(st):  # a baseline's seed 1 dropped: the table's header would name seeds it lacks
        st.data("11_baselines")["runs"] = [r for r in st.data("11_baselines")["runs"]
                                           if (r["config"]["scheme"], r["config"]["seed"]) != ("alibi", 1)]

    assert failed(first_seeds) == ["first protocol: every scheme has the same seeds"]
    moved = _copy(stored)
    moved.data("11_sweep")["runs"] = [r for r in moved.data("11_sweep")["runs"] if r["config"]["scheme"] != "fire"]
    with pytest.raises(ValueError, match=r"the first-protocol runs lack the schemes \['fire'\]"):
        guide.models(moved)
    moved = _copy(stored)
    moved.data("08_sweep/t5")["eval_config"]["windows"] = 1024
    with pytest.raises(ValueError, match="08_sweep/t5 has another eval_config than 08_sweep/learned-sinusoidal"):
        guide.models(moved)


def test_encoder_table(stored):
    s = guide.encoder_table(stored)
    schemes = _raw_schemes("08_sweep")
    assert list(s.tables) == ["table_encoder"] and s.lines == []     # the table is shown once, as Markdown
    t = s.tables["table_encoder"]
    assert len(t.rows) == len(schemes) == 8
    order = sorted(schemes, key=lambda x: _raw_tail(x)[:, 0].mean())
    assert [r[0] for r in t.rows] == [scheme_label(x) for x in order]
    nope = _scheme_runs("nope")[0]["parameters"]
    for x in schemes:
        row = _row(t, scheme_label(x))
        assert row[1] == f"{_raw_tail(x)[:, 0].mean():.2f} ({len(_scheme_runs(x))} seeds)"
        assert row[2] == f"{_scheme_runs(x)[0]['parameters'] - nope:,}"
    assert _row(t, "Shaw")[1].endswith(" (3 seeds)") and _row(t, "RoPE")[1].endswith(" (5 seeds)")
    assert s.facts["enc_learned_rows"] == f"{_scheme_runs('learned')[0]['config']['max_len']:,}"
    assert s.checks and not s.failed


def test_encoder_table_fails_its_check_when_the_benchmark_ran_elsewhere(stored):
    moved = _copy(stored)
    rec = next(r for r in moved.data("lab_train_cpu")["results"]
               if r["scheme"] == "rope" and r["attention_impl"] == "auto")
    rec["path"] = "reference"
    assert guide.encoder_table(moved).failed == ["rope benchmarked on the dispatcher's path"]


def _speed(scheme: str) -> float:
    """A lab scheme's stored training speed against NoPE, on the dispatcher's path."""
    name = {"sinusoidal": "scaled_sinusoidal"}.get(scheme, scheme)
    return next(r["ratio_to_nope"] for r in _raw("lab_train_cpu.json")["data"]["results"]
                if r["scheme"] == name and r["attention_impl"] == "auto")


def test_decoder_table(stored):
    s = guide.decoder_table(stored)
    mult = _raw_eval_config()["multiples"]
    lengths = _raw_lengths()
    s8, s11 = _raw_schemes("08_sweep"), _raw_schemes("11_sweep")
    assert list(s.tables) == ["table_decoder_loss", "table_decoder_cost", "table_decoder_first"] and s.lines == []
    loss, cost = s.tables["table_decoder_loss"], s.tables["table_decoder_cost"]
    assert loss.header == ["scheme"] + [f"{m}x" for m in mult] + [f"verdict; rise to {mult[-1]}x [95%]"]
    assert cost.header == ["scheme", "seeds", f"farthest key copied at {mult[-1]}x, pooled [95%]",
                           f"training tokens/s vs NoPE (L = {_raw('lab_train_cpu.json')['data']['seq_len']})", "path",
                           "backed by"]
    order = sorted(s8 + s11, key=lambda x: _raw_tail(x)[:, -1].mean())
    assert [r[0] for r in loss.rows] == [r[0] for r in cost.rows] == [scheme_label(x) for x in order]
    verdicts = {}
    for x in s8 + s11:
        row, tail = _row(loss, scheme_label(x)), _raw_tail(x)
        assert row[1:1 + len(mult)] == [_f2(v) for v in tail.mean(0)]
        verdicts[x] = _raw_verdict(tail, mult)
        rise = difference(_raw_blocks(x, lengths[-1]), _raw_blocks(x, lengths[0]))
        assert row[-1] == f"{verdicts[x]}, {rise.format(2)}"
        c = _row(cost, scheme_label(x))
        assert c[1:3] == [str(len(_scheme_runs(x))), _wilson_text(_raw_far(x))]
        assert c[3] == (f"{_speed(x):.2f}x" if x in s8 else "not measured")
        assert ("ch. 8" in c[-1]) == (x in s8) and ("ch. 11" in c[-1]) == (x in s11)
    assert {"flat", "breaks", "between"} <= set(verdicts.values())    # the table tells them apart
    assert verdicts["t5"] == "between" and verdicts["shaw"] == "flat" and verdicts["rope"] == "breaks"
    assert _row(cost, "Shaw")[1:3] == ["3", _wilson_text(_raw_far("shaw"))]
    assert _row(cost, "Shaw")[2] == "0.23 [0.16, 0.32]"                # 22 of 96 trials
    assert s.facts == {"flat_bits": "0.5", "t5_speed": f"{_speed('t5'):.2f}",
                       "ref_speed": f"{max(_speed('shaw'), _speed('xl')):.2f}", "break_bits": "2",
                       "first_n": 4, "first_base_n": 3}
    assert s.checks == {"T5's bias is between": True}


def test_decoder_table_check_fails_when_t5_stays_flat(stored):
    moved = _copy(stored)
    for r in moved.data("08_sweep/t5")["runs"]:          # T5 as flat as its loss at 1x
        bpb = r["eval"]["bpb"]
        for w in bpb:
            bpb[w]["tail"] = bpb[min(bpb, key=int)]["tail"]
    assert guide.decoder_table(moved).failed == ["T5's bias is between"]


def test_decoder_table_first_protocol(stored):
    t = guide.decoder_table(stored).tables["table_decoder_first"]
    new, base = _raw("11_sweep.json")["data"], _raw("11_baselines.json")["data"]
    mult = new["eval_config"]["multiples"]

    def tail(data, scheme):
        runs = sorted((r for r in data["runs"] if r["config"]["scheme"] == scheme), key=lambda r: r["config"]["seed"])
        return np.array([[r["eval"]["bpb"][str(m * r["config"]["seq_len"])]["tail"] for m in mult] for r in runs])

    tails = {s: tail(new, s) for s in guide.FIRST_PROTOCOL} | {s: tail(base, s) for s in guide.FIRST_BASELINES}
    seeds = sorted({r["config"]["seed"] for r in new["runs"] if r["config"]["scheme"] in guide.FIRST_PROTOCOL})
    assert seeds == [0, 1] and all(v.shape == (2, len(mult)) for v in tails.values())
    assert t.header == ["scheme"] + [f"{m}x, seeds 0 / 1" for m in mult] + ["verdict"]
    order = sorted(tails, key=lambda s: tails[s][:, -1].mean())
    labels = {s: scheme_label(s) + ("" if s in guide.FIRST_PROTOCOL else " (baseline)") for s in tails}
    assert [r[0] for r in t.rows] == [labels[s] for s in order]
    assert {"ALiBi (baseline)", "NoPE (baseline)", "RoPE (baseline)", "xPos", "CoPE", "FIRE"} <= set(labels.values())
    for s, v in tails.items():
        assert _row(t, labels[s])[1:] == [f"{a:.2f} / {b:.2f}" for a, b in v.T] + [_raw_verdict(v, mult)]
    assert _row(t, "Kerple (power)")[-1] == "flat" and _row(t, "CoPE")[-1] == "breaks"


def test_extension_lab_table(stored):
    s = guide.extension_lab_table(stored)
    train = _raw_lengths()[0]
    rows = _raw_ext_rows()
    factors = sorted({float(r["factor"]) for r in rows} - {1.0})
    ft = max(int(r["finetune_steps"]) for r in rows)
    tuned_at = {(r["method"], float(r["factor"]), int(r["seed"])) for r in rows if int(r["finetune_steps"]) == ft}
    s_ft = {f for _, f, _ in tuned_at}
    assert factors == [2.0, 4.0, 8.0] and ft == 200 and s_ft == {4.0}
    tuned_methods = list(dict.fromkeys(m for m, _, _ in sorted(tuned_at)))
    shared = sorted(set.intersection(*({sd for m2, _, sd in tuned_at if m2 == m} for m in tuned_methods)))
    assert shared == [0, 1, 2] and {sd for m, _, sd in tuned_at if m == "pi"} == {0, 1, 2, 3, 4}
    assert list(s.tables) == ["table_extend_lab_as_is", "table_extend_lab_tuned"]
    as_is, tuned = s.tables["table_extend_lab_as_is"], s.tables["table_extend_lab_tuned"]
    assert as_is.header == ["method", "s = 2, as is", "s = 4, as is", "s = 8, as is",
                            f"at L = {train}, set up for s = 4"]
    assert tuned.header == ["method", "s = 4, +200 steps (seeds 0, 1, 2)", "config", "llama.cpp", "backed by"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    assert [r[0] for r in as_is.rows] == [r[0] for r in tuned.rows] and len(as_is.rows) == len(methods) == 9
    labels = {"none": "no scaling", "pi": "PI (linear)", "yarn": "YaRN", "longrope": "LongRoPE",
              "ntk-matched": "NTK at s²-s+1", "yarn-no-temp": "YaRN, no temperature", "dynamic": "Dynamic NTK"}
    for m, label in labels.items():
        base = 1.0 if m == "none" else None   # the unscaled model is stored once, at factor 1
        cells = [_f2(_raw_ext(m, base or f, 0, int(f * train)).mean()) for f in factors]
        assert _row(as_is, label)[1:] == cells + [_f2(_raw_ext(m, base or 4.0, 0, train).mean())]
        want = _f2(_raw_ext(m, 4.0, ft, 4 * train, seeds=shared).mean()) if m in tuned_methods else "not fine-tuned"
        assert _row(tuned, label)[1] == want
    assert _row(tuned, "NTK at s²-s+1")[1] == _row(tuned, "YaRN, no temperature")[1] == "not fine-tuned"
    # the tuned cell is the mean of the shared seeds, not of every seed PI has
    assert _row(tuned, "PI (linear)")[1] != _f2(_raw_ext("pi", 4.0, ft, 4 * train).mean())
    assert _row(tuned, "Dynamic NTK")[-2] == "no counterpart"
    assert s.checks == {"chapter 9's seeds are chapter 8's RoPE seeds": True,
                        "chapter 9 scored chapter 8's windows and blocks": True}
    none_l, rope_l = _raw_ext("none", 1.0, 0, train).mean(), _raw_tail("rope")[:, 0].mean()
    assert s.facts == {"ext_none_l": _f2(none_l), "ext_rope_l": _f2(rope_l), "ext_s_ft": "4", "ext_ft": 200,
                       "ext_tuned_seeds": 3}
    evc = _raw_eval_config()
    assert s.lines == [f"bits per byte at s x {train} as is, mean of seeds [0, 1, 2, 3, 4]; and at {train}; "
                       f"fine-tuned at s = 4 for 200 steps",
                       f"the unscaled model at L: {_f2(none_l)} here, {_f2(rope_l)} in chapter 8, on the same "
                       f"{evc['windows'] * TAIL:,} bytes (chapter 9 trained its models again with chapter 8's recipe)"]


def test_extension_lab_table_checks_and_errors(stored):
    moved = _copy(stored)
    for name in moved.parts("09_extension"):   # every part scored other windows
        moved.data(name)["extend_config"]["windows"] = 1024
    assert guide.extension_lab_table(moved).failed == ["chapter 9 scored chapter 8's windows and blocks"]

    moved = _copy(stored)
    rows = moved.rows("09_extension/1-as-is")
    rows[:] = [r for r in rows if not (r["method"] == "none" and r["seed"] == "4")]
    assert guide.extension_lab_table(moved).failed == ["chapter 9's seeds are chapter 8's RoPE seeds"]

    moved = _copy(stored)
    moved.data("09_extension/3-budget")["extend_config"]["blocks"] = 128   # one part: not one protocol
    with pytest.raises(ValueError, match="09_extension/3-budget has another extend_config than 09_extension/1-as-is"):
        guide.extension_lab_table(moved)

    moved = _copy(stored)
    for r in moved.rows("09_extension/2-tuned-200"):   # the fine-tunes at two factors
        if r["method"] == "none" and r["seed"] == "0":
            r["factor"] = "2.0"
    for u in moved.data("09_extension/2-tuned-200")["units"]:
        if u["method"] == "none" and u["seed"] == 0:
            u["factor"] = 2.0
    with pytest.raises(ValueError, match=r"must fine-tune 200 steps at one factor, got \[2.0, 4.0\]"):
        guide.extension_lab_table(moved)


def _raw_ppl(rows, method, lo, hi):
    """Geometric mean over windows of exp(nll / count) on buckets in [lo, hi), from raw CSV rows."""
    logs = []
    for w in sorted({r["window"] for r in rows}):
        rs = [r for r in rows if r["window"] == w and r["method"] == method and lo <= int(r["bucket_start"]) < hi]
        logs.append(sum(float(r["nll_sum"]) for r in rs) / sum(int(r["count"]) for r in rs))
    return math.exp(np.mean(logs))


def test_extension_smol_table(stored):
    s = guide.extension_smol_table(stored)
    rows, side = stored.rows("10_ppl"), stored.data("10_ppl")
    n, native = side["length"], int(side["length"] / side["factor"])
    assert list(s.tables) == ["table_extend_smol_ppl", "table_extend_smol_tools"]
    ppl, tools = s.tables["table_extend_smol_ppl"], s.tables["table_extend_smol_tools"]
    for method, label in (("none", "plain RoPE"), ("yarn", "YaRN")):
        row = _row(ppl, label)
        assert row[1] == f"{_raw_ppl(rows, method, 0, native):.2f}"
        assert row[2] == f"{_raw_ppl(rows, method, native, n):.2f}"
    assert ppl.rows[-1][:2] == ["LongRoPE", "not run on this model"]
    assert tools.rows[-1][:2] == ["LongRoPE", "`longrope`"]
    assert _row(tools, "plain RoPE")[1:3] == ["`default`", "collapses there too"]
    assert s.lines[0] == f"{len({r['window'] for r in rows})} windows of {n} tokens; native context {native}; factor 2"
    assert s.facts["smol_native"] == f"{native:,}"


def test_smol_passkey(stored):
    s = guide.smol_passkey(stored)
    side = stored.data("10_ppl")
    native = int(side["length"] / side["factor"])
    got = [r["correct"] for r in stored.rows("10_passkey") if int(r["tokens"]) == native and r["method"] == "none"]
    assert got and s.facts["pk_native"] == f"{got.count('1')} of {len(got)}"
    got = [r["correct"] for r in stored.rows("10_passkey") if int(r["tokens"]) == side["length"]
           and r["method"] == "yarn"]
    assert got and s.facts["pk_yarn"] == f"{got.count('1')} of {len(got)}"


def test_smol_passkey_without_trials(stored, tmp_path):
    moved = _copy(stored)
    moved.tables["10_passkey"] = (moved.tables["10_passkey"][0],
                                  [r for r in moved.rows("10_passkey") if r["method"] != "yarn"])
    with pytest.raises(ValueError, match="no trial of 'yarn'"):
        guide.smol_passkey(moved)


def test_streaming_lab_table(stored):
    s = guide.streaming_lab_table(stored)
    runs = _raw_trainfree()
    lengths, seeds = _raw_lengths(), [r["seed"] for r in runs]
    assert seeds == [0, 1]
    assert list(s.tables) == ["table_stream_lab_loss", "table_stream_lab_memory"]
    loss, memory = s.tables["table_stream_lab_loss"], s.tables["table_stream_lab_memory"]
    assert loss.header == ["method"] + [f"{m}x" for m in _raw_eval_config()["multiples"]]
    plain = np.array([[r["plain"][str(w)]["tail"] for w in lengths] for r in runs])
    assert _row(loss, "plain RoPE")[1:] == [_f2(v) for v in plain.mean(0)]
    for name, label in guide.TRAINFREE_LABELS.items():
        tail = np.array([[r["methods"][name]["bpb"][str(w)]["tail"] for w in lengths] for r in runs])
        assert _row(loss, label)[1:] == [_f2(v) for v in tail.mean(0)]
    alibi = f"ALiBi, trained from scratch ({len(_scheme_runs('alibi'))} seeds)"
    assert alibi == "ALiBi, trained from scratch (5 seeds)"
    assert _row(loss, alibi)[1:] == [_f2(v) for v in _raw_tail("alibi").mean(0)]
    assert [r[0] for r in loss.rows] == [r[0] for r in memory.rows] == (
        ["plain RoPE"] + list(guide.TRAINFREE_LABELS.values()) + [alibi])
    sinks = runs[0]["methods"]["sinks"]["settings"][str(lengths[-1])]
    assert _row(memory, "sinks + window")[1].startswith(f"{sinks['n_sink'] + sinks['window'] + sinks['chunk'] - 1}; ")
    assert _row(memory, "sinks, no re-rotation")[1].startswith(f"{lengths[-1] - 1}, from the sinks; ")
    assert _row(memory, "ReRoPE")[1] == f"{runs[0]['methods']['rerope']['settings'][str(lengths[-1])]['window']}; " \
                                        "every key is read"
    rope = {r["config"]["seed"]: r["eval"]["bpb"][str(lengths[0])]["tail"] for r in _scheme_runs("rope")}
    gap = max(abs(r["plain"][str(lengths[0])]["tail"] - rope[r["seed"]]) for r in runs)
    assert s.lines == [f"RoPE models of seeds 0 and 1 (chapter 8's recipe); plain RoPE within {gap:.2f} bits of "
                       f"chapter 8's at 1x"]
    assert s.facts == {"tf_seeds": "0 and 1"}
    assert s.checks["its plain RoPE is chapter 8's at the training length"] and len(s.checks) == 2 + 6 + 5
    assert not s.failed


@pytest.mark.parametrize("off, failed", [(0.049, []), (0.051, ["its plain RoPE is chapter 8's at the training length"]),
                                         (-0.051, ["its plain RoPE is chapter 8's at the training length"])])
def test_streaming_lab_table_fails_when_its_rope_is_not_chapter_8s(stored, off, failed):
    moved = _copy(stored)
    train = str(_raw_lengths()[0])
    run = moved.data("11_trainfree_lab/two-seeds")["runs"][1]
    rope = next(r for r in _scheme_runs("rope") if r["config"]["seed"] == run["seed"])
    run["plain"][train]["tail"] = rope["eval"]["bpb"][train]["tail"] + off    # 0.05 bits is the threshold
    assert guide.streaming_lab_table(moved).failed == failed


def test_streaming_lab_table_errors(stored):
    moved = _copy(stored)
    moved.data("11_trainfree_lab/two-seeds")["runs"][1]["seed"] = 7     # no RoPE model of chapter 8 has seed 7
    with pytest.raises(ValueError, match=r"distinct seeds among its RoPE seeds \[0, 1, 2, 3, 4\], got \[0, 7\]"):
        guide.streaming_lab_table(moved)
    moved = _copy(stored)
    moved.data("11_trainfree_lab/two-seeds")["multiples"] = [1, 2, 4, 8]
    with pytest.raises(ValueError, match=r"must have chapter 8's multiples \[1, 2, 4, 8, 16\]"):
        guide.streaming_lab_table(moved)
    moved = _copy(stored)
    settings = moved.data("11_trainfree_lab/two-seeds")["runs"][1]["methods"]["rerope"]["settings"]
    settings[str(_raw_lengths()[-1])]["window"] = 32                      # seed 1 ran with another window
    assert guide.streaming_lab_table(moved).failed == ["rerope: one setting for every seed"]


def test_streaming_smol_table(stored):
    s = guide.streaming_smol_table(stored)
    rows = stored.rows("11_trainfree_ppl")
    n = stored.data("11_trainfree_ppl")["length"]
    assert list(s.tables) == ["table_stream_smol"]
    assert _row(s.tables["table_stream_smol"], "ReRoPE")[2] == f"{_raw_ppl(rows, 'rerope', n // 2, n):.2f}"
    assert not s.failed
    moved = _copy(stored)
    moved.data("11_trainfree_ppl")["windows"][0]["ids_sha256"] = "0" * 64
    assert guide.streaming_smol_table(moved).failed == ["the same tokens as chapter 10"]


def test_grid_table(stored):
    s = guide.grid_table(stored)
    summ = stored.data("12_grid")["summary"]
    by = summ["axial"]["by_grid"]["12"]
    assert list(s.tables) == ["table_grid_accuracy", "table_grid_diagnostics"]
    acc, diag = s.tables["table_grid_accuracy"], s.tables["table_grid_diagnostics"]
    assert _row(acc, "axial RoPE")[2] == f"{by['mean']:.2f} [{by['min']:.2f} to {by['max']:.2f}]"
    assert _row(diag, "axial RoPE")[1] == f"{summ['axial']['shifted']['24']['mean']:.2f}"
    assert _row(diag, "NoPE")[1:3] == ["-", "-"]
    for t in (acc, diag):    # M-RoPE last, and said to be absent in both tables
        assert t.rows[-1][:2] == ["M-RoPE (Qwen2-VL)", "not in the experiment"]
    assert not s.failed


def test_kernel_table(stored, tmp_path):
    s = guide.kernel_table(stored)
    schemes = _raw_schemes("08_sweep") + _raw_schemes("11_sweep") + list(guide.FIRST_PROTOCOL)
    known = {scheme_label(x) for x in schemes}
    assert "ALiBi, learned slopes" in known                 # a label with a comma: the cells join with "; "
    rows = s.tables["table_kernels"].rows
    names = [n for r in rows for n in r[0].split("; ")]
    assert set(names) <= known
    assert Counter(names) == Counter(scheme_label(x) for x in schemes)        # each scheme in one family
    families = {r[1]: r[0].split("; ") for r in rows}
    assert set(families) == {"`none`", "`bias`", "`embed`", "`rotate`", "`score`"}
    assert {"Kerple (power)", "FIRE"} <= set(families["`bias`"]) and "CoPE" in families["`score`"]
    assert "xPos" in families["`rotate`"]
    bias = _raw("06_bias_attention_cpu.json")["data"]
    big = bias["ratios"][str(max(bias["config"]["threads"]))][str(max(bias["config"]["lengths"]))]
    assert len(rows) == 5 and f"held {big['memory']:.4f}x the memory" in next(r for r in rows if r[1] == "`bias`")[4]
    assert s.lines[-1] == "07_gpu_benchmarks.json is absent: no GPU timing is stored for this build"
    assert not s.failed
    (tmp_path / "07_gpu_benchmarks.json").write_text("{}")
    with_gpu = guide.kernel_table(_copy(stored, tmp_path))
    assert with_gpu.lines[-1] == "07_gpu_benchmarks.json is present: GPU timings are stored"
    assert all(r[5] == "stored" for r in with_gpu.tables["table_kernels"].rows)


# ------------------------------------------------------------------------------------------------
# presentation: every section's tables and printed lines, and the appendix that shows them
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sections(stored):
    return {fn.__name__: fn(stored) for fn in SECTIONS}


def _columns(markdown: str) -> int:
    """The columns of a Markdown table, counted on its rule line (one ``---|`` per column)."""
    return markdown.split("\n")[1].count("---|")


def _copies(section: guide.Section) -> list[str]:
    """The printed lines that repeat a row of one of the section's tables: a line holding the
    row's label and another of its cells (backticks dropped; one-character cells ignored)."""
    found = []
    for table in section.tables.values():
        for row in table.rows:
            cells = [c for c in (str(c).strip("`") for c in row[1:]) if len(c) > 1]
            found += [line for line in section.lines if row[0] in line and any(c in line for c in cells)]
    return found


def test_every_section_glues_its_tables(sections):
    tables = {name: list(s.tables) for name, s in sections.items() if s.tables}
    assert tables == {
        "encoder_table": ["table_encoder"],
        "decoder_table": ["table_decoder_loss", "table_decoder_cost", "table_decoder_first"],
        "extension_lab_table": ["table_extend_lab_as_is", "table_extend_lab_tuned"],
        "extension_smol_table": ["table_extend_smol_ppl", "table_extend_smol_tools"],
        "streaming_lab_table": ["table_stream_lab_loss", "table_stream_lab_memory"],
        "streaming_smol_table": ["table_stream_smol"],
        "grid_table": ["table_grid_accuracy", "table_grid_diagnostics"],
        "kernel_table": ["table_kernels"],
        "engine_support": ["table_engines_rope", "table_engines_other"]}
    assert {name: len(s.lines) for name, s in sections.items() if name in (
        "provenance", "models", "streaming_lab_table", "extension_lab_table", "rules_of_thumb")} == {
        "provenance": len(_raw_provenance()) - 6, "models": 1, "streaming_lab_table": 1, "extension_lab_table": 2,
        "rules_of_thumb": 1}


def test_no_table_is_wider_than_the_page_allows(sections):
    assert _columns(guide.Table(list("abcdefgh")).markdown()) == 8     # the count itself
    widths = {name: _columns(s.markdown(name)) for s in sections.values() for name in s.tables}
    assert len(widths) == 16
    assert {name: w for name, w in widths.items() if w > MAX_COLUMNS} == {}
    assert widths["table_decoder_loss"] == widths["table_decoder_first"] == MAX_COLUMNS   # 1x to 16x and a verdict


def test_printed_lines_do_not_repeat_a_table(sections):
    table = guide.Table(["scheme", "1x", "path"], [["RoPE", "1.89", "`sdpa-causal`"]])
    text_copy = guide.Section(["scheme 1x path", "RoPE 1.89 sdpa-causal", "a note on RoPE"], tables={"t": table})
    assert _copies(text_copy) == ["RoPE 1.89 sdpa-causal"]                # the check finds a copied row
    with_tables = [name for name, s in sections.items() if s.tables]
    assert len(with_tables) == 9
    assert {name: _copies(sections[name]) for name in with_tables} == {name: [] for name in with_tables}


def test_the_appendix_shows_every_table_and_quotes_only_glued_facts(sections):
    cells = json.loads(APPENDIX.read_text(encoding="utf-8"))["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    shown = re.findall(r"```\{glue:md\}\s+(\S+)", text)
    assert shown == [name for s in sections.values() for name in s.tables]     # each once, in the page's order
    quoted = set(re.findall(r"\{glue:text\}`([^`]+)`", text))
    facts = {name for s in sections.values() for name in s.facts}
    assert quoted and quoted - facts == set()


# ------------------------------------------------------------------------------------------------
# the rules of thumb
# ------------------------------------------------------------------------------------------------

RULES = ["fixed length", "flat from scratch", "rotary breaks", "flat is not memory", "no fine-tune: YaRN",
         "not PI as is", "fine-tuned", "llama.cpp", "streaming", "grids", "kernels"]


def test_rules_of_thumb_hold_on_the_stored_data(stored):
    s = guide.rules_of_thumb(stored)
    assert list(s.checks) == RULES and not s.failed
    assert len(s.facts) == 69 and all(k.startswith("r_") for k in s.facts)
    assert s.lines == ["rules that hold on the stored data, 11 of 11: " + ", ".join(RULES)]
    # facts read back independently, from the raw files
    lengths = _raw_lengths()
    assert s.facts["r_rope1"] == _f2(_raw_tail("rope")[:, 0].mean())
    assert s.facts["r_rope_long"] == _f2(_raw_tail("rope")[:, -1].mean())
    assert s.facts["r_trials"] == _raw_far("alibi").size == 5 * _raw_eval_config()["passkey_trials"]
    assert s.facts["r_kl_alibi"] == difference(_raw_blocks("alibi", lengths[0]),
                                               _raw_blocks("kerple-log", lengths[0])).format(2)
    assert s.facts["r_window_key"] == _wilson_text(_raw_far("rope-window-nope"))
    assert s.facts["r_shaw_key"] == _wilson_text(_raw_far("shaw"))
    assert s.facts["r_blind_keys"] == "; ".join(f"{scheme_label(x)} {_wilson_text(_raw_far(x))}"
                                                for x in ("alibi", "alibi-learned", "kerple-log"))
    far = [h for r in _raw_trainfree() for h in r["methods"]["sinks"]["passkey"][str(lengths[-1])]["0"]["exact"]]
    assert s.facts["r_sink_key"] == _wilson_text(np.array(far))
    assert (s.facts["r_tf_seeds"], s.facts["r_ft_seeds"], s.facts["r_pi_ft_seeds"], s.facts["r_ft"]) == (
        "0 and 1", 3, len(_raw_ext("pi", 4.0, 200, 4 * lengths[0])), 200)
    assert s.facts["r_pi_ft_seeds"] == 5
    assert s.facts["r_yarn_mid"] == _f2(_raw_ext("yarn", 4.0, 0, 4 * lengths[0]).mean())
    pi_lab = min((_raw_ext("pi", f, 0, lengths[0]) - _raw_ext("none", 1.0, 0, lengths[0])).min()
                 for f in (2.0, 4.0, 8.0))
    assert s.facts["r_pi_lab"] == _f2(pi_lab)
    bias = _raw("06_bias_attention_cpu.json")["data"]
    big = bias["ratios"][str(max(bias["config"]["threads"]))][str(max(bias["config"]["lengths"]))]
    assert s.facts["r_bias_mem"] == f"{big['memory']:.4f}"


def _moved_rule(stored, change):
    """The rules that fail once ``change`` has moved numbers in a fresh copy of the stored results."""
    moved = _copy(stored)
    change(moved)
    return guide.rules_of_thumb(moved).failed


def _sweep_run(st, part, scheme, seed):
    return next(r for r in st.data(part)["runs"] if r["config"]["scheme"] == scheme and r["config"]["seed"] == seed)


def _ext_rows(st, part, method, factor, steps, length, seed=None):
    """The bpb_tail rows of a cell of a chapter 9 part (strings, as stored), one per seed."""
    rows = [r for r in st.rows(part) if r["method"] == method and float(r["factor"]) == factor
            and r["finetune_steps"] == str(steps) and r["metric"] == "bpb_tail" and r["length"] == str(length)
            and r["where"] == "" and (seed is None or r["seed"] == str(seed))]
    assert rows
    return rows


def _ext_units(st, part, method, factor, steps):
    units = [u for u in st.data(part)["units"] if u["method"] == method and float(u["factor"]) == factor
             and u["finetune_steps"] == steps]
    assert units
    return units


def test_rule_fixed_length_can_fail(stored):
    w1 = _raw_lengths()[0]

    def rope_slow(st):          # RoPE timed at half NoPE's speed
        rec = next(r for r in st.data("lab_train_cpu")["results"]
                   if r["scheme"] == "rope" and r["attention_impl"] == "auto")
        rec["ratio_to_nope"] = 0.5

    def shaw_fast(st):          # Shaw timed at a quarter of NoPE's speed: the score hook no longer costly
        rec = next(r for r in st.data("lab_train_cpu")["results"]
                   if r["scheme"] == "shaw" and r["attention_impl"] == "auto")
        rec["ratio_to_nope"] = 0.25

    def learned_seed_close(st):  # one seed of the learned table within 0.02 bits of the worst ahead: seed by seed
        worst = max(_raw_tail(x)[:, 0].max() for x in ("rope", "t5", "shaw", "xl"))
        _sweep_run(st, "08_sweep/learned-sinusoidal", "learned", 0)["eval"]["bpb"][str(w1)]["tail"] = worst + 0.02

    def t5_blocks_close(st):    # T5's blocks at L raised 0.1: the interval of the closest pair falls under 0.05
        for sd in range(5):
            blocks = _sweep_run(st, "08_sweep/t5", "t5", sd)["eval"]["blocks"]["tail"]
            blocks[str(w1)] = [v + 0.1 for v in blocks[str(w1)]]

    for change in (rope_slow, shaw_fast, learned_seed_close, t5_blocks_close):
        assert _moved_rule(stored, change) == ["fixed length"], change.__name__


def test_rule_flat_from_scratch_can_fail(stored):
    lengths = _raw_lengths()

    def alibi_rises(st):        # ALiBi's seed 0 three bits worse at the longest length: no longer flat
        _sweep_run(st, "08_sweep/rope-alibi", "alibi", 0)["eval"]["bpb"][str(lengths[-1])]["tail"] += 3.0

    def shaw_blocks_rise(st):   # Shaw's blocks at the longest length raised 0.3: its rise interval above 0.5
        for sd in range(3):
            blocks = _sweep_run(st, "08_sweep/shaw", "shaw", sd)["eval"]["blocks"]["tail"]
            blocks[str(lengths[-1])] = [v + 0.3 for v in blocks[str(lengths[-1])]]

    def kerple_seed_behind(st):  # one Kerple seed at L behind ALiBi's best seed (the interval unchanged)
        best = _raw_tail("alibi")[:, 0].min()
        _sweep_run(st, "11_sweep/a-compared", "kerple-log", 2)["eval"]["bpb"][str(lengths[0])]["tail"] = best + 0.01

    def kerple_seed_ahead(st):  # one Kerple seed ahead of ALiBi with learned slopes at 8x
        learned = _sweep_run(st, "11_sweep/a-compared", "alibi-learned", 1)["eval"]["bpb"][str(lengths[3])]["tail"]
        _sweep_run(st, "11_sweep/a-compared", "kerple-log", 1)["eval"]["bpb"][str(lengths[3])]["tail"] = learned - 0.001

    def nope_close(st):         # NoPE's seed 0 at L within 0.4 bits of the worst other seed
        worst = max(_raw_tail(x)[:, 0].max() for f in SWEEPS for x in _raw_schemes(f) if x != "nope")
        _sweep_run(st, "08_sweep/nope", "nope", 0)["eval"]["bpb"][str(lengths[0])]["tail"] = worst + 0.4

    def alibi_slow(st):
        rec = next(r for r in st.data("lab_train_cpu")["results"]
                   if r["scheme"] == "alibi" and r["attention_impl"] == "auto")
        rec["ratio_to_nope"] = 0.85

    for change in (alibi_rises, shaw_blocks_rise, kerple_seed_behind, kerple_seed_ahead, nope_close, alibi_slow):
        assert _moved_rule(stored, change) == ["flat from scratch"], change.__name__


def test_rule_rotary_breaks_can_fail(stored):
    lengths = _raw_lengths()

    def seed_recovers(st):      # RoPE + NoPE layers' seed 0 only 1.5 bits worse at the longest length
        bpb = _sweep_run(st, "11_sweep/b-hybrids", "rope-nope", 0)["eval"]["bpb"]
        bpb[str(lengths[-1])]["tail"] = bpb[str(lengths[0])]["tail"] + 1.5

    def blocks_recover(st):     # its blocks at the longest length 1 bit lower: the rise interval under 2
        for sd in range(5):
            blocks = _sweep_run(st, "11_sweep/b-hybrids", "rope-nope", sd)["eval"]["blocks"]["tail"]
            blocks[str(lengths[-1])] = [v - 1.0 for v in blocks[str(lengths[-1])]]

    for change in (seed_recovers, blocks_recover):
        assert _moved_rule(stored, change) == ["rotary breaks"], change.__name__


def test_rule_flat_is_not_memory_can_fail(stored):
    def copies(part, scheme, hit):   # every trial of the farthest key at the longest length set to ``hit``
        def change(st):
            for r in st.data(part)["runs"]:
                if r["config"]["scheme"] == scheme:
                    pk = r["eval"]["passkey"]
                    cell = pk["exact_trials"][pk["lengths"].index(r["eval"]["lengths"][-1])]
                    i = pk["depths"].index(min(pk["depths"]))
                    cell[i] = [hit] * len(cell[i])
        return change

    assert _moved_rule(stored, copies("08_sweep/rope-alibi", "alibi", 1)) == ["flat is not memory"]
    assert _moved_rule(stored, copies("11_sweep/a-compared", "kerple-log", 1)) == ["flat is not memory"]
    assert _moved_rule(stored, copies("11_sweep/b-hybrids", "rope-window-nope", 0)) == ["flat is not memory"]
    assert _moved_rule(stored, copies("08_sweep/shaw", "shaw", 0)) == ["flat is not memory"]


def test_rule_no_fine_tune_yarn_can_fail(stored):
    L = _raw_lengths()[0]

    def yarn_mean_behind(st):   # YaRN's seed 0 at 4x as is made 9 bits: no longer among the best two means
        for r in _ext_rows(st, "09_extension/1-as-is", "yarn", 4.0, 0, 4 * L, seed=0):
            r["value"] = "9.0"

    def yarn_seed_behind(st):   # YaRN's seed 3 at 8x third on that seed, its mean still among the best two
        for r in _ext_rows(st, "09_extension/1-as-is", "yarn", 8.0, 0, 8 * L, seed=3):
            r["value"] = str(float(r["value"]) + 0.3)

    def yarn_blocks_behind(st):  # YaRN's blocks at 4x 0.5 higher: the third's interval no longer above zero
        for u in _ext_units(st, "09_extension/1-as-is", "yarn", 4.0, 0):
            u["tail"][str(4 * L)] = [v + 0.5 for v in u["tail"][str(4 * L)]]

    def smol_window(st):        # on one SmolLM2 window PI gets the best second half (its first half as stored)
        rows, side = st.rows("10_ppl"), _raw("10_ppl.json")["data"]
        for r in rows:
            if r["window"] == rows[0]["window"] and r["method"] == "pi" and \
                    int(r["bucket_start"]) >= side["length"] / side["factor"]:
                r["nll_sum"] = "0.0"

    def docs(st):               # on chapter 10's documents YaRN predicts as plain RoPE does
        rows = st.rows("10_context")
        yarn = {(r["document"], r["context"], r["bucket_start"]): r for r in rows if r["method"] == "yarn"}
        for r in rows:
            key = (r["document"], r["context"], r["bucket_start"])
            if r["method"] == "none" and key in yarn:
                r["nll_sum"], r["count"] = yarn[key]["nll_sum"], yarn[key]["count"]

    for change in (yarn_mean_behind, yarn_seed_behind, yarn_blocks_behind, smol_window, docs):
        assert _moved_rule(stored, change) == ["no fine-tune: YaRN"], change.__name__


def test_rule_not_pi_as_is_can_fail(stored):
    L = _raw_lengths()[0]

    def pi_free(st):            # PI as good as no scaling at the training length, seed by seed, at s = 2
        base = {r["seed"]: r["value"] for r in _ext_rows(st, "09_extension/1-as-is", "none", 1.0, 0, L)}
        for r in _ext_rows(st, "09_extension/1-as-is", "pi", 2.0, 0, L):
            r["value"] = base[r["seed"]]

    def pi_blocks_free(st):     # PI's blocks at L (s = 8) those of no scaling plus 0.5: the interval under 1
        none = {u["seed"]: u for u in _ext_units(st, "09_extension/1-as-is", "none", 1.0, 0)}
        for u in _ext_units(st, "09_extension/1-as-is", "pi", 8.0, 0):
            u["tail"][str(L)] = [v + 0.5 for v in none[u["seed"]]["tail"][str(L)]]

    def smol_pi(st):            # PI's native-half perplexity on SmolLM2 as plain RoPE's, on every window
        rows, side = st.rows("10_ppl"), _raw("10_ppl.json")["data"]
        none = {(r["window"], r["bucket_start"]): r for r in rows if r["method"] == "none"}
        for r in rows:
            if r["method"] == "pi" and int(r["bucket_start"]) < side["length"] / side["factor"]:
                r["nll_sum"], r["count"] = none[r["window"], r["bucket_start"]]["nll_sum"], \
                    none[r["window"], r["bucket_start"]]["count"]

    for change in (pi_free, pi_blocks_free, smol_pi):
        assert _moved_rule(stored, change) == ["not PI as is"], change.__name__


def test_rule_fine_tuned_can_fail(stored):
    L = _raw_lengths()[0]

    def yarn_worse(st):         # YaRN's seed 0 fine-tuned 0.5 bits worse
        for r in _ext_rows(st, "09_extension/2-tuned-200", "yarn", 4.0, 200, 4 * L, seed=0):
            r["value"] = str(float(r["value"]) + 0.5)

    def llama3_blocks(st):      # Llama 3's fine-tuned blocks 0.2 lower: its interval outside (-0.1, 0.1)
        for u in _ext_units(st, "09_extension/2-tuned-200", "llama3", 4.0, 200):
            u["tail"][str(4 * L)] = [v - 0.2 for v in u["tail"][str(4 * L)]]

    def pi_seed_ahead(st):      # PI fine-tuned on seed 3 (the more-seeds part) ahead of no scaling
        none = _ext_rows(st, "09_extension/4-tuned-200-more-seeds", "none", 4.0, 200, 4 * L, seed=3)[0]
        for r in _ext_rows(st, "09_extension/4-tuned-200-more-seeds", "pi", 4.0, 200, 4 * L, seed=3):
            r["value"] = str(float(none["value"]) - 0.01)

    for change in (yarn_worse, llama3_blocks, pi_seed_ahead):
        assert _moved_rule(stored, change) == ["fine-tuned"], change.__name__


def test_rule_llama_cpp_can_fail(stored):
    def yarn_differs(st):       # llama.cpp's YaRN 10% off the stored perplexity
        st.data("10_llamacpp")["stored"]["methods"]["yarn"]["llamacpp"]["first_half"] *= 1.1

    def rope_holds(st):         # plain RoPE no longer collapses in llama.cpp
        none = st.data("10_llamacpp")["stored"]["methods"]["none"]["llamacpp"]
        none["second_half"] = none["first_half"]

    for change in (yarn_differs, rope_holds):
        assert _moved_rule(stored, change) == ["llama.cpp"], change.__name__


def test_rule_streaming_can_fail(stored):
    lengths = _raw_lengths()
    part = "11_trainfree_lab/two-seeds"

    def sinks_remember(st):     # the sink cache copies the farthest key at the longest length
        for r in st.data(part)["runs"]:
            cell = r["methods"]["sinks"]["passkey"][str(lengths[-1])]["0"]
            cell["exact"] = [1] * len(cell["exact"])

    def rerope_forgets(st):
        for r in st.data(part)["runs"]:
            cell = r["methods"]["rerope"]["passkey"][str(lengths[-1])]["0"]
            cell["exact"] = [0] * len(cell["exact"])

    def rerotation_cheap(st):   # on seed 0 re-rotation worth only 0.2 bits at 4x
        r = st.data(part)["runs"][0]
        r["methods"]["sinks_no_rerotate"]["bpb"][str(lengths[2])]["tail"] = \
            r["methods"]["sinks"]["bpb"][str(lengths[2])]["tail"] + 0.2

    def self_extend_close(st):  # Self-Extend's seed 1 less than a bit ahead of plain RoPE at 8x
        r = st.data(part)["runs"][1]
        r["methods"]["self_extend"]["bpb"][str(lengths[3])]["tail"] = r["plain"][str(lengths[3])]["tail"] - 0.9

    def sinks_behind_alibi(st):  # the sink cache's blocks at 16x 0.2 worse: its interval against ALiBi under zero
        for r in st.data(part)["runs"]:
            e = r["methods"]["sinks"]["bpb"][str(lengths[-1])]
            e["tail_blocks"] = [v + 0.2 for v in e["tail_blocks"]]

    for change in (sinks_remember, rerope_forgets, rerotation_cheap, self_extend_close, sinks_behind_alibi):
        assert _moved_rule(stored, change) == ["streaming"], change.__name__


def test_rule_grids_can_fail(stored):
    def grid_shift(st):         # axial RoPE no longer scores the shifted grid as the training grid
        runs = st.data("12_grid")["runs"]
        runs[[r["scheme"] for r in runs].index("axial")]["shifted_accuracy"]["24"] -= 0.2

    def learned_holds(st):      # the resized learned table keeps its accuracy at the largest grid
        summ = st.data("12_grid")["summary"]["learned"]["by_grid"]
        summ["24"]["mean"] = summ[str(st.data("12_grid")["task"]["grid"])]["mean"]

    for change in (grid_shift, learned_holds):
        assert _moved_rule(stored, change) == ["grids"], change.__name__


def test_rule_kernels_can_fail(stored):
    def rope_kernel(st):        # apply_rope no faster than HuggingFace's formula
        st.data("rope_cpu")["ratios"]["apply_rope"]["hf_eager_over"] = 1.0

    def bias_memory(st):        # the blockwise bias holding a fifth of a materialised one's memory
        bias = st.data("06_bias_attention_cpu")
        bias["ratios"][str(max(bias["config"]["threads"]))][str(max(bias["config"]["lengths"]))]["memory"] = 0.2

    for change in (rope_kernel, bias_memory):
        assert _moved_rule(stored, change) == ["kernels"], change.__name__


# ------------------------------------------------------------------------------------------------
# chapter 13's recipe and the engine table
# ------------------------------------------------------------------------------------------------


def _chapter_glue(name: str) -> dict[str, str]:
    """The values a chapter's stored notebook glued, by name (the chapter computes them with
    its own code; the guide must quote the same numbers)."""
    nb = json.loads((REPO / "chapters" / f"{name}.ipynb").read_text(encoding="utf-8"))
    found = {}
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            name = out.get("metadata", {}).get("scrapbook", {}).get("name")
            if name:
                found[name] = out["data"]["application/papermill.record/text/plain"].strip("'")
    return found


def test_grid_rule_quotes_chapter_12s_own_intervals(stored):
    """The guide repeats chapter 12's two-stage bootstrap (the chapter's code is in its notebook):
    both must give the same interval for axial RoPE against RoPE-Mixed at base 100, G = 12."""
    ch12 = _chapter_glue("12_grids")
    assert guide.rules_of_thumb(stored).facts["r_axmix"] == ch12["mix12_100"]


def test_recipe_rules_quote_chapter_13s_own_numbers(stored):
    s = guide.recipe_rules(stored)
    assert not s.failed and len(s.checks) == 5
    ch13 = _chapter_glue("13_long_context_recipe")
    assert s.facts["rc_lg_rise"] == ch13["lg_rise"] and s.facts["rc_rope_rise"] == ch13["rope_rise16"]
    assert s.facts["rc_irope_cost"] == ch13["irope_cost"] and s.facts["rc_rise4"] == ch13["bases_rise4"]
    assert s.facts["rc_yarn_2"].split(" ")[0] == ch13["abf_yarn_2"]
    assert s.facts["rc_yarn_ft"].split(" ")[0] == ch13["abf_yarn_200"]
    assert s.facts["rc_llama2_reach"] == "1,707"      # chapter 5's first negative distance for base 1e4


def test_recipe_rules_fail_when_a_stored_number_moves(stored, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(DATA / guide.RECIPE_DIR, data / guide.RECIPE_DIR)
    shutil.copytree(DATA / "09_extension", data / "09_extension")
    for part in ("08_sweep/rope-alibi.json", "11_sweep/b-hybrids.json"):
        (data / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DATA / part, data / part)
    moved = guide.Stored(data, stored.results, stored.tables)
    assert guide.recipe_rules(moved).failed == []
    hybrids = data / guide.RECIPE_DIR / "hybrids.json"
    payload = json.loads(hybrids.read_text())
    for run in payload["data"]["runs"]:           # the Gemma pattern made flat: rises by less than 0.5
        if run["config"]["scheme"] == "rope-local-global":
            bpb = run["eval"]["bpb"]
            for w, entry in bpb.items():
                entry["tail"] = bpb[min(bpb, key=int)]["tail"]
    hybrids.write_text(json.dumps(payload))
    assert "local/global" in guide.recipe_rules(guide.Stored(data, stored.results, stored.tables)).failed


def test_engine_support_table(stored):
    s = guide.engine_support(stored)
    assert not s.failed and set(s.tables) == {"table_engines_rope", "table_engines_other"}
    raw = json.loads((DATA / guide.ENGINE_SUPPORT).read_text())
    rows = {r[0]: r[1:] for t in s.tables.values() for r in t.rows}
    assert len(rows) == len(raw["schemes"]) == 16
    for key, label in guide.SCHEME_ROWS.items():
        assert rows[label] == [raw["support"][e][key]["status"] for e in raw["engines"]]
    assert s.facts["eng_no_dynamic"] == "llama.cpp"


def test_engine_support_checks_fail_on_a_bad_file(stored, tmp_path):
    raw = json.loads((DATA / guide.ENGINE_SUPPORT).read_text())
    unsourced = copy.deepcopy(raw)
    unsourced["support"]["vllm"]["yarn"]["sources"] = []
    wrong = copy.deepcopy(raw)
    wrong["support"]["llama.cpp"]["dynamic"]["status"] = "yes"     # the package says llama.cpp has none
    research = copy.deepcopy(raw)
    research["support"]["sglang"]["fire"]["status"] = "yes"
    for payload, failed in ((unsourced, "every cell sourced"), (wrong, "llama.cpp agrees with the package"),
                            (research, "research schemes run nowhere")):
        (tmp_path / guide.ENGINE_SUPPORT).write_text(json.dumps(payload))
        assert failed in guide.engine_support(guide.Stored(tmp_path, stored.results, stored.tables)).failed
    (tmp_path / guide.ENGINE_SUPPORT).write_text(json.dumps({**raw, "engines": ["vllm"]}))
    with pytest.raises(ValueError, match="must list the engines"):
        guide.engine_support(guide.Stored(tmp_path, stored.results, stored.tables))
    (tmp_path / guide.ENGINE_SUPPORT).unlink()
    with pytest.raises(FileNotFoundError, match="engine table"):
        guide.engine_support(guide.Stored(tmp_path, stored.results, stored.tables))
    for section in (guide.recipe_rules, guide.engine_support):
        with pytest.raises(TypeError, match="stored must be"):
            section("chapters/data")
