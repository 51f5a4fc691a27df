"""Tests for companion.lab.guide, the computation behind Appendix B.

Two kinds of input:

* the real stored results in ``chapters/data/``: every section is compared with a value read
  here straight from the raw JSON or CSV (means over seeds, perplexities from the bucket rows,
  passkey counts), never through the guide's own helpers, and the rules of thumb are shown to
  fail when one stored number is moved past a rule's threshold;
* small synthetic inputs whose answer follows by hand: :func:`verdict` on curves built to be
  flat, between or broken, :func:`geometric_mean`, and a two-scheme sweep
  for :func:`lab_sweeps`.

Every public function is also given bad input, and the error must name the argument. Two
presentation rules are checked on every section: no Markdown table is wider than
:data:`MAX_COLUMNS` columns, and no printed line repeats a row of a table (the page shows each
table once, as Markdown); and every table a section glues is shown by the appendix.
Equalities are exact where a value is copied or formatted to two decimals from the same
doubles; the one tolerance (a geometric mean) is a few ulps of a float64 log-sum.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from companion.lab import guide
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


@pytest.fixture(scope="module")
def stored() -> guide.Stored:
    return guide.load_stored(DATA)


def _copy(stored: guide.Stored, data_dir: Path | None = None) -> guide.Stored:
    """A fresh Stored (its own memo) over deep copies of the stored results."""
    return guide.Stored(data_dir or stored.data_dir, copy.deepcopy(stored.results), copy.deepcopy(stored.tables))


def _raw_tail(stored: guide.Stored, scheme: str) -> np.ndarray:
    """(seeds, lengths) tail bits per byte of a lab scheme, read from the raw sweeps."""
    for name in ("08_sweep", "11_sweep"):
        data = stored.results[name]["data"]
        runs = sorted((r for r in data["runs"] if r["config"]["scheme"] == scheme), key=lambda r: r["config"]["seed"])
        if runs:
            train = runs[0]["config"]["seq_len"]
            lengths = [m * train for m in data["eval_config"]["multiples"]]
            return np.array([[r["eval"]["bpb"][str(w)]["tail"] for w in lengths] for r in runs])
    raise KeyError(scheme)


def _row(table: guide.Table, label: str) -> list[str]:
    rows = [r for r in table.rows if r[0] == label]
    assert len(rows) == 1, (label, [r[0] for r in table.rows])
    return rows[0]


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------


def test_load_stored_reads_every_result(stored):
    assert set(stored.results) == set(guide.STORED_JSON) and set(stored.tables) == set(guide.STORED_CSV)
    assert stored.data("08_sweep") is stored.results["08_sweep"]["data"]
    assert stored.rows("10_passkey") is stored.tables["10_passkey"][1]
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


def test_stored_lookups_name_the_argument(stored):
    with pytest.raises(ValueError, match="name must be one of"):
        stored.data("10_passkey")   # a CSV, not a JSON result
    with pytest.raises(ValueError, match="name must be one of"):
        stored.rows("08_sweep")


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
# lab_sweeps on a synthetic pair of sweeps
# ------------------------------------------------------------------------------------------------


def _sweep(schemes, seeds, tail, train=16, multiples=(1, 2, 4), pk_multiples=(2, 4), depths=(0.5, 0.0)):
    """A sweep's data: tail(scheme, seed, w) bits per byte; passkey gain = 10 * seed + 100 * depth
    + length index (so that the far key at the longest length is identifiable)."""
    lengths = [m * train for m in multiples]
    runs = []
    for s in schemes:
        for sd in seeds:
            gain = [[10 * sd + 100 * d + i for d in depths] for i, _ in enumerate(pk_multiples)]
            runs.append({"config": {"scheme": s, "seed": sd, "seq_len": train, "steps": 5},
                         "parameters": 100 + len(s),
                         "eval": {"lengths": lengths, "bpb": {str(w): {"tail": tail(s, sd, w)} for w in lengths},
                                  "passkey": {"lengths": [m * train for m in pk_multiples], "depths": list(depths),
                                              "gain": gain}}})
    return {"eval_config": {"multiples": list(multiples), "passkey_multiples": list(pk_multiples),
                            "passkey_depths": list(depths), "tokens": 1024}, "runs": runs}


def _lab_stored(tmp_path, s8, s11):
    results = {"08_sweep": {"provenance": {}, "data": s8}, "11_sweep": {"provenance": {}, "data": s11}}
    return guide.Stored(tmp_path, results, {})


def test_lab_sweeps_on_a_synthetic_pair(tmp_path):
    def tail(s, sd, w):
        return {"nope": 3.0, "rope": 2.0, "alibi": 2.5}[s] + sd / 10 + w / 1000

    s8 = _sweep(["nope", "rope"], [1, 0], tail)   # seeds stored out of order
    s11 = _sweep(["alibi"], [0, 1], tail)
    lab = guide.lab_sweeps(_lab_stored(tmp_path, s8, s11))
    assert lab.schemes8 == ["nope", "rope"] and lab.schemes11 == ["alibi"] and lab.schemes == ["nope", "rope", "alibi"]
    assert lab.seeds == [0, 1] and lab.train_len == 16 and lab.multiples == [1, 2, 4] and lab.lengths == [16, 32, 64]
    assert lab.i1 == 0 and lab.i_last == 2
    expected = np.array([[2.0 + sd / 10 + w / 1000 for w in (16, 32, 64)] for sd in (0, 1)])
    np.testing.assert_array_equal(lab.tail["rope"], expected)
    np.testing.assert_array_equal(lab.mean["rope"], expected.mean(0))
    # the key farthest back is depth 0.0 (index 1), at the longest multiple 4 (index 1): 10 sd + 0 + 1
    np.testing.assert_array_equal(lab.far_passkey["alibi"], [1.0, 11.0])
    assert all(lab.checks.values())


def test_lab_sweeps_checks_and_errors(tmp_path):
    def tail(s, sd, w):
        return 2.0

    s8 = _sweep(["nope", "rope"], [0, 1], tail)
    other = _sweep(["alibi"], [0, 1], tail)
    other["runs"][0]["config"]["steps"] = 6          # another recipe
    other["eval_config"]["tokens"] = 2048            # another evaluation
    lab = guide.lab_sweeps(_lab_stored(tmp_path, s8, other))
    assert sorted(n for n, ok in lab.checks.items() if not ok) == [
        "chapter 11's sweep evaluated as chapter 8's", "chapter 11's sweep trained with chapter 8's recipe"]

    with pytest.raises(ValueError, match="missing"):
        guide.lab_sweeps(_lab_stored(tmp_path, s8, _sweep(["alibi"], [0], tail)))
    with pytest.raises(ValueError, match="in both"):
        guide.lab_sweeps(_lab_stored(tmp_path, s8, _sweep(["rope"], [0, 1], tail)))
    with pytest.raises(ValueError, match="passkey test must reach"):
        guide.lab_sweeps(_lab_stored(tmp_path, _sweep(["nope"], [0], tail, pk_multiples=(1, 2)),
                                     _sweep(["alibi"], [0], tail, pk_multiples=(1, 2))))
    with pytest.raises(ValueError, match="runs"):
        guide.lab_sweeps(_lab_stored(tmp_path, {"eval_config": {}, "runs": []}, s8))
    with pytest.raises(ValueError, match="name must be one of"):
        guide.lab_sweeps(guide.Stored(tmp_path, {}, {}))


# ------------------------------------------------------------------------------------------------
# the sections, on the real stored results
# ------------------------------------------------------------------------------------------------


def test_lab_sweeps_on_the_stored_sweeps(stored):
    lab = guide.lab_sweeps(stored)
    assert lab.checks and all(lab.checks.values())
    for s in ("rope", "alibi", "kerple-log", "cope"):
        np.testing.assert_array_equal(lab.tail[s], _raw_tail(stored, s))
    evc = stored.data("08_sweep")["eval_config"]
    far = evc["passkey_depths"].index(min(evc["passkey_depths"]))
    at = evc["passkey_multiples"].index(evc["multiples"][-1])
    shaw = sorted((r for r in stored.data("08_sweep")["runs"] if r["config"]["scheme"] == "shaw"),
                  key=lambda r: r["config"]["seed"])
    np.testing.assert_array_equal(lab.far_passkey["shaw"], [r["eval"]["passkey"]["gain"][at][far] for r in shaw])


def test_provenance(stored):
    lines = guide.provenance(stored).lines
    names = sorted([f"{n}.json" for n in guide.STORED_JSON] + [f"{n}.csv" for n in guide.STORED_CSV]
                   + [f"{guide.RECIPE_DIR}/{n}.json" for n in ("abf", "bases", "hybrids")])
    assert [line.split(": ")[0] for line in lines] == names
    cmd = stored.results["08_sweep"]["provenance"]["command"]
    assert lines[names.index("08_sweep.json")].startswith(f"08_sweep.json: {cmd} (")


@pytest.mark.parametrize("command, shown", [
    ("python benchmarks/x.py --threads 1 2 --max-load 0.7 --wait-s 1200", "python benchmarks/x.py --threads 1 2"),
    ("python b.py --max-load=0.5 --out a.json", "python b.py --out a.json"),
    ("python -m companion.lab sweep --seeds 0 1", "python -m companion.lab sweep --seeds 0 1"),
])
def test_shown_command_drops_only_the_scheduling_flags(command, shown):
    assert shown_command(command) == shown


def test_provenance_shows_no_scheduling_flag(stored):
    raw = [r["provenance"]["command"] for r in stored.results.values()]
    assert any("--max-load" in c for c in raw), "the stored data no longer has a scheduled run to check"
    assert not any(flag in line for line in guide.provenance(stored).lines for flag in SCHEDULING_FLAGS)


def test_shown_command_bad_input():
    with pytest.raises(TypeError, match="command"):
        shown_command(["python", "x.py"])


def test_models(stored):
    s = guide.models(stored)
    nope = next(r for r in stored.data("08_sweep")["runs"] if r["config"]["scheme"] == "nope")
    assert s.facts["lab_params"] == f"{nope['parameters']:,}"
    assert s.facts["lab_len"] == nope["config"]["seq_len"]
    assert s.facts["smol_model"] == "SmolLM2-135M-Instruct"
    assert not s.failed and len(s.lines) == 1


def test_encoder_table(stored):
    s = guide.encoder_table(stored)
    schemes = list(dict.fromkeys(r["config"]["scheme"] for r in stored.data("08_sweep")["runs"]))
    assert list(s.tables) == ["table_encoder"] and s.lines == []     # the table is shown once, as Markdown
    t = s.tables["table_encoder"]
    assert len(t.rows) == len(schemes)
    order = sorted(schemes, key=lambda x: _raw_tail(stored, x)[:, 0].mean())
    assert [r[0] for r in t.rows] == [scheme_label(x) for x in order]
    for x in schemes:
        assert _row(t, scheme_label(x))[1] == f"{_raw_tail(stored, x)[:, 0].mean():.2f}"
    assert s.checks and not s.failed


def test_encoder_table_fails_its_check_when_the_benchmark_ran_elsewhere(stored):
    moved = _copy(stored)
    rec = next(r for r in moved.data("lab_train_cpu")["results"]
               if r["scheme"] == "rope" and r["attention_impl"] == "auto")
    rec["path"] = "reference"
    assert guide.encoder_table(moved).failed == ["rope benchmarked on the dispatcher's path"]


def _raw_verdict(tail, mult):
    rise = tail - tail[:, [mult.index(1)]]
    if (rise < 0.5).all():
        return "flat"
    return "breaks" if (rise[:, -1] > 2.0).all() else "between"


def test_decoder_table(stored):
    s = guide.decoder_table(stored)
    mult = stored.data("08_sweep")["eval_config"]["multiples"]
    schemes = [r["config"]["scheme"] for n in ("08_sweep", "11_sweep") for r in stored.data(n)["runs"]]
    schemes = list(dict.fromkeys(schemes))
    assert list(s.tables) == ["table_decoder_loss", "table_decoder_cost"] and s.lines == []
    loss, cost = s.tables["table_decoder_loss"], s.tables["table_decoder_cost"]
    assert loss.header == ["scheme"] + [f"{m}x" for m in mult] + ["verdict"]
    assert [r[0] for r in cost.rows] == [r[0] for r in loss.rows]     # the same schemes, in the same order
    assert sorted(r[0] for r in loss.rows) == sorted(scheme_label(x) for x in schemes)
    evc = stored.data("08_sweep")["eval_config"]
    far, at = evc["passkey_depths"].index(min(evc["passkey_depths"])), evc["passkey_multiples"].index(mult[-1])
    verdicts = {}
    for x in schemes:
        row, tail = _row(loss, scheme_label(x)), _raw_tail(stored, x)
        assert row[1:1 + len(mult)] == [f"{v:.2f}".replace("-0.00", "0.00") for v in tail.mean(0)]
        verdicts[x] = row[1 + len(mult)]
        assert verdicts[x] == _raw_verdict(tail, mult)
    shaw = [r["eval"]["passkey"]["gain"][at][far] for r in stored.data("08_sweep")["runs"]
            if r["config"]["scheme"] == "shaw"]
    assert _row(cost, "Shaw")[1] == f"{np.mean(shaw):.2f} [{min(shaw):.2f} to {max(shaw):.2f}]"
    assert {"flat", "breaks"} <= set(verdicts.values())    # the table tells them apart
    assert s.facts["flat_bits"] == "0.5" and s.facts["break_bits"] == "2"


def test_extension_lab_table(stored):
    s = guide.extension_lab_table(stored)
    rows = stored.rows("09_extension")
    train = stored.data("08_sweep")["runs"][0]["config"]["seq_len"]

    def raw(method, factor, steps, length):
        vals = [float(r["value"]) for r in rows if r["method"] == method and float(r["factor"]) == factor
                and int(r["finetune_steps"]) == steps and r["metric"] == "bpb_tail" and int(r["length"]) == length
                and r["where"] == ""]
        assert vals
        return f"{np.mean(vals):.2f}"

    ft = max(int(r["finetune_steps"]) for r in rows)
    assert list(s.tables) == ["table_extend_lab_as_is", "table_extend_lab_tuned"]
    as_is, tuned = s.tables["table_extend_lab_as_is"], s.tables["table_extend_lab_tuned"]
    assert as_is.header[1:4] == ["s = 2, as is", "s = 4, as is", "s = 8, as is"]
    assert tuned.header[1:4] == [f"s = {f}, +{ft} steps" for f in (2, 4, 8)]
    assert _row(as_is, "YaRN")[1] == raw("yarn", 2.0, 0, 2 * train)
    assert _row(tuned, "YaRN")[1] == raw("yarn", 2.0, ft, 2 * train)
    none = _row(as_is, "no scaling")
    assert none[1] == raw("none", 1.0, 0, 2 * train)    # the unscaled model is stored once, at factor 1
    assert none[2] == raw("none", 1.0, 0, 4 * train)
    assert none[4] == raw("none", 1.0, 0, train)        # at L, as is
    assert _row(tuned, "Dynamic NTK")[-2] == "no counterpart"
    assert s.checks and not s.failed
    assert s.lines[-1].startswith(f"the unscaled model at L: {raw('none', 1.0, 0, train)} here")


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
    assert ppl.rows[-1][:2] == ["LongRoPE", "not run on this model"] and tools.rows[-1][:2] == ["LongRoPE", "`longrope`"]
    assert _row(tools, "plain RoPE")[1:3] == ["`default`", "collapses there too"]
    assert s.lines[0] == f"{len({r['window'] for r in rows})} windows of {n} tokens; native context {native}; factor 2"
    assert s.facts["smol_native"] == f"{native:,}"


def test_smol_passkey(stored):
    s = guide.smol_passkey(stored)
    side = stored.data("10_ppl")
    native = int(side["length"] / side["factor"])
    got = [r["correct"] for r in stored.rows("10_passkey") if int(r["tokens"]) == native and r["method"] == "none"]
    assert got and s.facts["pk_native"] == f"{got.count('1')} of {len(got)}"


def test_smol_passkey_without_trials(stored, tmp_path):
    moved = _copy(stored)
    moved.tables["10_passkey"] = (moved.tables["10_passkey"][0],
                                  [r for r in moved.rows("10_passkey") if r["method"] != "yarn"])
    with pytest.raises(ValueError, match="no trial of 'yarn'"):
        guide.smol_passkey(moved)


def test_streaming_lab_table(stored):
    s = guide.streaming_lab_table(stored)
    assert list(s.tables) == ["table_stream_lab_loss", "table_stream_lab_memory"] and s.lines == []
    loss, memory = s.tables["table_stream_lab_loss"], s.tables["table_stream_lab_memory"]
    dec = guide.decoder_table(stored).tables["table_decoder_loss"]
    assert _row(loss, "plain RoPE")[1:] == _row(dec, "RoPE")[1:6]
    assert _row(loss, "ALiBi, trained from scratch")[1:] == _row(dec, "ALiBi")[1:6]
    runs = stored.data("11_trainfree_lab")["runs"]
    sinks = runs[0]["methods"]["sinks"]["settings"][str(guide.lab_sweeps(stored).lengths[-1])]
    assert _row(memory, "sinks + window")[1].startswith(
        f"{sinks['n_sink'] + sinks['window'] + sinks['chunk'] - 1}; ")
    assert s.checks and not s.failed


def test_streaming_lab_table_fails_when_its_rope_is_not_chapter_8s(stored):
    moved = _copy(stored)
    moved.data("11_trainfree_lab")["runs"][0]["plain"]["256"]["tail"] += 0.01
    assert guide.streaming_lab_table(moved).failed == ["its plain RoPE is chapter 8's"]


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
    names = [n for r in s.tables["table_kernels"].rows for n in r[0].split(", ")]
    lab = guide.lab_sweeps(stored)
    assert sorted(names) == sorted(scheme_label(x) for x in lab.schemes)      # each scheme in one family
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


def test_no_table_is_wider_than_the_page_allows(sections):
    assert _columns(guide.Table(list("abcdefgh")).markdown()) == 8     # the count itself
    widths = {name: _columns(s.markdown(name)) for s in sections.values() for name in s.tables}
    assert len(widths) == 15
    assert {name: w for name, w in widths.items() if w > MAX_COLUMNS} == {}


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


def test_rules_of_thumb_hold_on_the_stored_data(stored):
    s = guide.rules_of_thumb(stored)
    assert len(s.checks) == 11 and not s.failed
    assert len(s.facts) == 41 and all(k.startswith("r_") for k in s.facts)
    assert s.lines == ["rules that hold on the stored data, 11 of 11: " + ", ".join(s.checks)]
    # two facts read back independently
    assert s.facts["r_rope1"] == f"{_raw_tail(stored, 'rope')[:, 0].mean():.2f}"
    bias = stored.data("06_bias_attention_cpu")
    big = bias["ratios"][str(max(bias["config"]["threads"]))][str(max(bias["config"]["lengths"]))]
    assert s.facts["r_bias_mem"] == f"{big['memory']:.4f}"


def _moved_rule(stored, change):
    moved = _copy(stored)
    change(moved)
    return guide.rules_of_thumb(moved).failed


def test_rules_of_thumb_fail_when_the_data_say_otherwise(stored):
    def alibi_rises(st):   # ALiBi's seed 0 three bits worse at the longest length: no longer flat
        run = next(r for r in st.data("08_sweep")["runs"]
                   if r["config"]["scheme"] == "alibi" and r["config"]["seed"] == 0)
        run["eval"]["bpb"][str(run["eval"]["lengths"][-1])]["tail"] += 3.0

    def rope_slow(st):     # RoPE timed at half NoPE's speed
        rec = next(r for r in st.data("lab_train_cpu")["results"] if r["scheme"] == "rope")
        rec["ratio_to_nope"] = 0.5

    def grid_shift(st):    # axial RoPE no longer scores the shifted grid as the training grid
        st.data("12_grid")["runs"][[r["scheme"] for r in st.data("12_grid")["runs"]].index("axial")][
            "shifted_accuracy"]["24"] -= 0.2

    def rope_kernel(st):   # apply_rope no faster than HuggingFace's formula
        st.data("rope_cpu")["ratios"]["apply_rope"]["hf_eager_over"] = 1.0

    assert "flat from scratch" in _moved_rule(stored, alibi_rises)
    assert _moved_rule(stored, rope_slow) == ["fixed length"]
    assert _moved_rule(stored, grid_shift) == ["grids"]
    assert _moved_rule(stored, rope_kernel) == ["kernels"]


def test_rules_of_thumb_pi_and_passkey_rules_can_fail(stored):
    def pi_free(st):       # PI as good as no scaling at the training length
        rows = st.rows("09_extension")
        base = {(r["seed"], r["length"]): r["value"] for r in rows
                if r["method"] == "none" and float(r["factor"]) == 1.0 and r["finetune_steps"] == "0"
                and r["metric"] == "bpb_tail" and r["where"] == ""}
        train = str(st.data("08_sweep")["runs"][0]["config"]["seq_len"])
        for r in rows:
            if r["method"] == "pi" and r["finetune_steps"] == "0" and r["metric"] == "bpb_tail" \
                    and r["length"] == train and r["where"] == "":
                r["value"] = base[r["seed"], r["length"]]

    def alibi_remembers(st):   # ALiBi retrieves the far key
        evc = st.data("08_sweep")["eval_config"]
        far = evc["passkey_depths"].index(min(evc["passkey_depths"]))
        at = evc["passkey_multiples"].index(evc["multiples"][-1])
        for r in st.data("08_sweep")["runs"]:
            if r["config"]["scheme"] == "alibi":
                r["eval"]["passkey"]["gain"][at][far] = 3.0

    assert _moved_rule(stored, pi_free) == ["not PI as is"]
    assert _moved_rule(stored, alibi_remembers) == ["flat is not memory"]



# ------------------------------------------------------------------------------------------------
# chapter 13's recipe and the engine table
# ------------------------------------------------------------------------------------------------


def _chapter13_glue() -> dict[str, str]:
    """The values chapter 13's stored notebook glued, by name (the chapter computes them with
    its own code; the guide must quote the same numbers)."""
    nb = json.loads((REPO / "chapters" / "13_long_context_recipe.ipynb").read_text(encoding="utf-8"))
    found = {}
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            name = out.get("metadata", {}).get("scrapbook", {}).get("name")
            if name:
                found[name] = out["data"]["application/papermill.record/text/plain"].strip("'")
    return found


def test_recipe_rules_quote_chapter_13s_own_numbers(stored):
    s = guide.recipe_rules(stored)
    assert not s.failed and len(s.checks) == 5
    ch13 = _chapter13_glue()
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
