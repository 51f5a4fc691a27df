"""Chapter 13's temperature measure on a real model (:mod:`companion.longctx_temperature`) and
its command ``python -m companion.longctx temperature``, on a tiny random Llama.

Every stored value is compared with a computation that does not go through
:func:`~companion.longctx_temperature.temperature_rows`: the loss with
:func:`companion.longctx_docs.tail_nll` on the window, the entropy with
:meth:`companion.llama.LlamaModel.attention_entropy` after installing the condition by hand,
the logit factors from their formulas. Float64 model: rounding is ~1e-13 on losses of ~4
nats; the values are stored rounded to 5 decimals, so the comparisons allow 1e-5.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from test_longctx import _usage_error
from test_longctx_docs import tiny_llama
from test_longctx_runs import _Failing, _fake_subject

from companion import longctx
from companion import longctx_docs as ld
from companion import longctx_temperature as lt
from companion.model import AttentionTemperature
from companion.utils import load_csv, load_result

NATIVE = 16
LENGTHS = [8, 16, 32]
IDS = tuple(torch.randint(0, 61, (40,), generator=torch.Generator().manual_seed(3)).tolist())
ROUND = 1e-5


def test_conditions_within_and_past_the_native_context():
    assert lt.conditions_for(16, 16) == [("none", "off")]
    assert lt.conditions_for(17, 16) == [("none", "off"), ("none", "log-n"), ("yarn", "off"), ("yarn", "yarn"),
                                         ("yarn", "log-n")]
    with pytest.raises(ValueError, match="length must be >= 2"):
        lt.conditions_for(1, 16)
    with pytest.raises(TypeError, match="native"):
        lt.conditions_for(8, 16.0)


def test_windows_end_together():
    w = lt.same_end_windows(IDS, [8, 32, 16])
    assert sorted(w) == [8, 16, 32]
    for n, t in w.items():
        assert t.shape == (1, n) and t[0].tolist() == list(IDS[32 - n:32])
    with pytest.raises(ValueError, match="at least max\\(lengths\\) = 64 tokens, got 40"):
        lt.same_end_windows(IDS, [8, 64])
    with pytest.raises(ValueError, match="must not repeat"):
        lt.same_end_windows(IDS, [8, 8])
    with pytest.raises(ValueError, match="at least one length"):
        lt.same_end_windows(IDS, [])
    with pytest.raises(ValueError, match="lengths must be >= 2"):
        lt.same_end_windows(IDS, [1, 8])


def _cell(rows, n, method, temp, metric):
    return [r for r in rows if (r["length"], r["method"], r["temperature"], r["metric"]) == (n, method, temp, metric)]


def test_rows_match_independent_computations():
    model = tiny_llama(context_length=NATIVE)
    rows = lt.temperature_rows(model, IDS, LENGTHS, document="d.py", last=4, tail=6, block=3)
    plans = {8: 1, 16: 1, 32: 5}
    per = model.config.n_layers + 6 // 3 + 1
    assert len(rows) == sum(plans.values()) * per
    windows = lt.same_end_windows(IDS, LENGTHS)
    for n, window in windows.items():
        for method, temp in lt.conditions_for(n, NATIVE):
            s = n / NATIVE
            if method == "yarn":
                cfg = {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": NATIVE}
                if temp != "yarn":
                    cfg["attention_factor"] = 1.0
                model.set_rope_config(cfg)
            model.set_attention_temperature(AttentionTemperature("log-n", length=NATIVE) if temp == "log-n" else None)
            nll = ld.tail_nll(model, window, n - 6)
            ent = model.attention_entropy(window, last=4).mean(-1)
            model.set_rope_config(None)
            model.set_attention_temperature(None)
            got_nll = _cell(rows, n, method, temp, "nll")
            assert [r["where"] for r in got_nll] == [6, 3]                      # offsets from the end
            for r, j in zip(got_nll, range(2)):
                assert abs(r["value"] - nll[3 * j:3 * j + 3].mean().item()) < ROUND
            got_ent = _cell(rows, n, method, temp, "entropy")
            assert [r["where"] for r in got_ent] == [0, 1]
            assert max(abs(r["value"] - e) for r, e in zip(got_ent, ent.tolist())) < ROUND
            tau = _cell(rows, n, method, temp, "tau_last")[0]["value"]
            want = {"off": 1.0, "log-n": max(1.0, math.log(n) / math.log(NATIVE)),
                    "yarn": (0.1 * math.log(s) + 1) ** 2}[temp]
            assert abs(tau - want) < 1e-6
            assert all(r["factor"] == (s if method == "yarn" else 1.0) for r in _cell(rows, n, method, temp, "nll"))
    # the conditions differ from one another (a condition that changed nothing would not show)
    past = {(m, t): [r["value"] for r in _cell(rows, 32, m, t, "nll")] for m, t in lt.conditions_for(32, NATIVE)}
    assert len({tuple(v) for v in past.values()}) == 5
    # the same last targets at every length: within the native context only the context differs
    assert [r["value"] for r in _cell(rows, 8, "none", "off", "nll")] != \
        [r["value"] for r in _cell(rows, 16, "none", "off", "nll")]
    # the model is left as it was
    assert model.attention_temperatures == [None, None] and model.rope.rope_config["rope_type"] == "default"


def test_rows_restore_the_model_after_an_error():
    model = tiny_llama(context_length=NATIVE)
    t = AttentionTemperature("constant", strength=2.0)
    model.set_attention_temperature(t, layers=[1])
    calls = []

    def boom(msg):
        calls.append(msg)
        if len(calls) == 2:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        lt.temperature_rows(model, IDS, [8, 32], last=2, tail=4, block=2, progress=boom)
    assert model.attention_temperatures == [None, t] and model.rope.rope_config["rope_type"] == "default"


def test_rows_bad_input():
    model = tiny_llama(context_length=NATIVE)
    with pytest.raises(TypeError, match="model must be a companion.llama.LlamaModel, got str"):
        lt.temperature_rows("model", IDS, LENGTHS)
    with pytest.raises(ValueError, match=r"tail must lie in \[1, min\(lengths\) - 1\] = \[1, 7\], got 8"):
        lt.temperature_rows(model, IDS, LENGTHS, last=2, tail=8, block=2)
    with pytest.raises(ValueError, match=r"last must lie in \[1, min\(lengths\) - 1\] = \[1, 7\], got 9"):
        lt.temperature_rows(model, IDS, LENGTHS, last=9, tail=4, block=2)
    with pytest.raises(ValueError, match=r"block \(3\) must divide tail \(4\)"):
        lt.temperature_rows(model, IDS, LENGTHS, last=2, tail=4, block=3)
    with pytest.raises(ValueError, match="YaRN needs a factor > 1: length 8 is within the native context 16"):
        lt.temperature_rows(model, IDS, [8], last=2, tail=4, block=2, conditions=[("yarn", "off")])
    with pytest.raises(ValueError, match="'yarn' with YaRN only"):
        lt.temperature_rows(model, IDS, [32], last=2, tail=4, block=2, conditions=[("none", "yarn")])
    with pytest.raises(ValueError, match="method must be 'none' or 'yarn', got 'pi'"):
        lt.temperature_rows(model, IDS, [32], last=2, tail=4, block=2, conditions=[("pi", "off")])


def test_temperature_command_flags(tmp_path, capsys, monkeypatch):
    from companion import longctx_runs as runs

    def refuse(*a, **k):
        raise AssertionError("loaded before checking the flags")

    monkeypatch.setattr(runs, "load_subject", refuse)
    base = ["temperature", "--out", str(tmp_path / "t.csv")]
    cases = [
        (["--lengths", "1024", "1024"], "--lengths must not repeat a length"),
        (["--lengths", "1"], "--lengths must be >= 2, got 1"),
        (["--lengths", "512", "--tail", "1024"], r"--tail must lie in \[1, min\(--lengths\) - 1\] = \[1, 511\], got 1024"),
        (["--tail", "100"], r"--block \(64\) must divide --tail \(100\)"),
        (["--last", "0"], "--last must be >= 1, got 0"),
        (["--documents", "0"], "--documents must be >= 1, got 0"),
        (["--native", "1"], "--native must be >= 2, got 1"),
        (["--model", "gemma3"], "--model: the temperature measure runs on smollm2"),
    ]
    for extra, message in cases:
        assert re.search("error: " + message, _usage_error(base + extra, capsys)), extra
    assert not (tmp_path / "t.csv").exists()


def test_temperature_command_writes_rows_and_resumes(tmp_path, monkeypatch, capsys):
    model = tiny_llama(context_length=NATIVE)
    docs = [ld.Document("a.py", "val", 100, IDS), ld.Document("b.py", "val", 90, IDS[::-1])]
    _fake_subject(monkeypatch, model, docs)
    out, side, cache = tmp_path / "t.csv", tmp_path / "t.json", tmp_path / "parts"
    argv = ["temperature", "--lengths", "32", "8", "16", "--last", "4", "--tail", "6", "--block", "3",
            "--cache", str(cache), "--out", str(out), "--json", str(side), "--quiet"]
    assert longctx.main(argv) == 0
    _, rows = load_csv(out)
    want = []
    for d in docs:
        want += lt.temperature_rows(model, d.ids, LENGTHS, document=d.path, last=4, tail=6, block=3)
    assert [(r["document"], r["length"], r["method"], r["temperature"], r["metric"], r["where"]) for r in rows] == \
        [(w["document"], str(w["length"]), w["method"], w["temperature"], w["metric"], str(w["where"])) for w in want]
    assert [float(r["value"]) for r in rows] == pytest.approx([w["value"] for w in want], abs=ROUND)
    data = load_result(side)["data"]
    assert data["lengths"] == LENGTHS and [d["path"] for d in data["documents"]["documents"]] == ["a.py", "b.py"]
    assert len(list(cache.iterdir())) == 2
    monkeypatch.setattr(lt, "temperature_rows", _Failing())
    assert longctx.main(argv) == 0
    assert load_csv(out)[1] == rows
