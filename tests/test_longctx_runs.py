"""The ``docs``, ``context`` and ``retrieval`` commands of ``python -m companion.longctx``.

Every flag is checked before anything is loaded (usage errors, exit status 2); the commands
run end to end on a tiny random Llama with a character tokenizer (test_longctx_docs.py's),
their files are compared with the library functions called directly, and a second run with
``--cache`` must reuse every finished unit (the measuring functions are replaced by ones that
fail, so a recomputed unit would show).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_longctx import _parsed, _usage_error
from test_longctx_docs import tiny_llama
from test_passkey import Tok

from companion import longctx
from companion import longctx_docs as ld
from companion import longctx_runs as runs
from companion import passkey as pk
from companion.utils import load_csv, load_result


@pytest.fixture
def nothing_loaded(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("main loaded something before checking its arguments")

    monkeypatch.setattr(runs, "load_subject", refuse)
    monkeypatch.setattr(ld, "long_documents", refuse)
    monkeypatch.setattr(torch, "set_num_threads", refuse)


def test_flags_are_checked_before_anything_is_loaded(tmp_path, nothing_loaded, capsys):
    out = str(tmp_path / "x.csv")
    afile = tmp_path / "file"
    afile.write_text("")
    context = ["context", "--out", out]
    cases = [
        (["--context", "1"], "--context must be >= 2, got 1"),
        (["--context", "100"], r"--bucket must divide --context \(100\), got 512"),
        (["--context", "64", "--bucket", "8", "--block", "64"], r"--block must lie in \[1, --context - 1\] = \[1, 63\], got 64"),
        (["--block", "0"], "--block must be >= 1, got 0"),
        (["--documents", "0"], "--documents must be >= 1, got 0"),
        (["--pass-chunk", "0"], "--pass-chunk must be >= 1, got 0"),
        (["--methods", "none", "yarn", "none"], "--methods must not repeat a method, got none yarn none"),
        (["--model", "gemma3", "--methods", "yarn", "sinks"], "--methods: the training-free methods \\(sinks\\) run on SmolLM2 only"),
        (["--rope-layers", "all"], "--rope-layers all is Gemma 3's ablation"),
        (["--leak", "1"], "--leak must be a finite number > 1"),
        (["--sink-window", "0"], "--sink-window must be >= 1, got 0"),
        (["--factor", "0.5"], "--factor must be a finite number >= 1, got 0.5"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--cache", str(afile)], "--cache must be a folder, got the existing file"),
        (["--json", str(tmp_path)], "--json must be a file path, got the folder"),
    ]
    for extra, message in cases:
        assert re.search("error: " + message, _usage_error(context + extra, capsys)), extra
    retrieval = ["retrieval", "--out", out]
    cases = [
        (["--depths", "0.5", "1.5"], r"--depths must lie in \[0, 1\], got 1.5"),
        (["--depths", "0.5", "0.5"], "--depths must not repeat a depth, got 0.5 0.5"),
        (["--lengths", "1024", "1024"], "--lengths must not repeat a length"),
        (["--lengths", "0"], "--lengths must be >= 1, got 0"),
        (["--trials", "0"], "--trials must be >= 1, got 0"),
        (["--controls", "0"], "--controls must be >= 1, got 0"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--pass-chunk", "0"], "--pass-chunk must be >= 1, got 0"),
        (["--formats", "classic", "classic"], "--formats must not repeat a format"),
        (["--model", "gemma3", "--formats", "chat"], "--formats chat needs a chat template; the Gemma 3 270M file"),
        (["--model", "gemma3", "--native-methods", "rerope"], "--native-methods: the training-free methods"),
        (["--native-methods", "none", "none"], "--native-methods must not repeat a method"),
        (["--se-group", "0"], "--se-group must be >= 1, got 0"),
        (["--formats", "plain"], "argument --formats: invalid choice: 'plain'"),
    ]
    for extra, message in cases:
        assert re.search("error: " + message, _usage_error(retrieval + extra, capsys)), extra
    assert "error: --min-tokens must be >= 2, got 1" in _usage_error(["docs", "--min-tokens", "1", "--out", out], capsys)
    assert not (tmp_path / "x.csv").exists()


def test_quick_presets(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "x.csv")
    plain = _parsed(monkeypatch, ["context", "--out", out])
    assert plain["quick"] is False and plain["context"] is None and plain["documents"] is None
    quick = _parsed(monkeypatch, ["context", "--quick", "--out", out])
    assert {k: quick[k] for k in runs.QUICK_CONTEXT} == runs.QUICK_CONTEXT
    assert "--quick set --context 256 --documents 1 --block 64 --bucket 64 --methods none yarn" in capsys.readouterr().out
    mixed = _parsed(monkeypatch, ["retrieval", "--quick", "--trials", "5", "--out", out])
    assert (mixed["trials"], mixed["lengths"], mixed["formats"]) == (5, [512], ["classic"])
    assert "kept from the command line: --trials 5" in capsys.readouterr().out


class _Failing:
    def __call__(self, *args, **kwargs):
        raise AssertionError("a unit was computed again instead of read from the cache")


def _fake_subject(monkeypatch, model, docs=None):
    monkeypatch.setattr(runs, "load_subject", lambda name: (model, Tok(), None))
    if docs is not None:
        monkeypatch.setattr(ld, "long_documents", lambda tok, min_tokens, split="val", exclude=(), **kw:
                            [d for d in docs if d.tokens >= min_tokens])


def test_context_command_writes_rows_summary_and_resumes(tmp_path, monkeypatch, capsys):
    model = tiny_llama(context_length=16)
    gen = torch.Generator().manual_seed(0)
    docs = [ld.Document(f"d{i}.py", "val", 100, tuple(torch.randint(0, 61, (40 + i,), generator=gen).tolist()))
            for i in range(3)]
    _fake_subject(monkeypatch, model, docs)
    out, side, cache = tmp_path / "c.csv", tmp_path / "c.json", tmp_path / "parts"
    argv = ["context", "--documents", "2", "--methods", "none", "yarn", "rerope", "--rerope-window", "4",
            "--block", "4", "--bucket", "8", "--cache", str(cache), "--out", str(out), "--json", str(side), "--quiet"]
    assert longctx.main(argv) == 0
    printed, err = capsys.readouterr()
    assert err == ""
    prov, rows = load_csv(out)
    assert prov["command"] == "python -m companion.longctx " + " ".join(argv)
    want = []
    for d in docs[:2]:  # the two longest would be d2, d1 with long_documents' order; the stub keeps ours
        want += ld.same_token_rows(model, d, 16, [], block=4, bucket=8)
        for m in ("none", "yarn", "rerope"):
            want += ld.same_token_rows(model, d, 16, [m], block=4, bucket=8, baseline=False,
                                       trainfree={**longctx.TRAINFREE_DEFAULTS, "rerope_window": 4})
    keys = ("document", "method", "context", "bucket_start", "bucket_end", "count", "rope_config")
    assert [tuple(str(r[k]) for k in keys) for r in rows] == [tuple(str(r[k]) for k in keys) for r in want]
    assert [float(r["nll_sum"]) for r in rows] == pytest.approx([float(r["nll_sum"]) for r in want], rel=1e-12)
    data = load_result(side)["data"]
    assert [d["path"] for d in data["documents"]["documents"]] == ["d0.py", "d1.py"]
    assert data["context"] == 16 and data["block"] == 4 and data["methods"] == ["none", "yarn", "rerope"]
    for m in ("none", "yarn", "rerope"):
        iv = ld.context_value(rows, m, 16)["interval"]
        assert data["value_of_context"][m]["estimate"] == pytest.approx(iv.estimate, rel=1e-12)
        assert f"{m:13s} value of the context beyond 16 tokens: " in printed
    assert len(list(cache.iterdir())) == 2 * 4
    # a second run computes nothing: every unit comes from the cache, and the file is the same
    monkeypatch.setattr(ld, "same_token_rows", _Failing())
    assert longctx.main(argv) == 0
    assert load_csv(out)[1] == rows
    # another factor is another unit for the scaling methods (and only for them)
    with pytest.raises(AssertionError, match="computed again"):
        longctx.main(argv[:-1] + ["--factor", "3", "--quiet"])


def test_retrieval_command_writes_trials_and_resumes(tmp_path, monkeypatch, capsys):
    model = tiny_llama(context_length=450)
    _fake_subject(monkeypatch, model)
    out, side, cache = tmp_path / "r.csv", tmp_path / "r.json", tmp_path / "parts"
    argv = ["retrieval", "--lengths", "400", "500", "--depths", "0.2", "0.8", "--trials", "2", "--controls", "2",
            "--methods", "yarn", "self_extend", "--se-window", "16", "--cache", str(cache), "--out", str(out),
            "--json", str(side)]
    assert longctx.main(argv) == 0
    _, rows = load_csv(out)
    # 400 is within the native 450: plain RoPE only; 500 beyond: the two methods
    assert [(r["length"], r["depth"], r["method"]) for r in rows[::2]] == [
        ("400", "0.2", "none"), ("400", "0.8", "none"), ("500", "0.2", "yarn"), ("500", "0.2", "self_extend"),
        ("500", "0.8", "yarn"), ("500", "0.8", "self_extend")]
    tf = {**longctx.TRAINFREE_DEFAULTS, "se_window": 16}
    direct = pk.passkey_rows(model, Tok(), "classic", 500, 0.8, "self_extend", trials=2, controls=2, trainfree=tf)
    got = [r for r in rows if (r["length"], r["depth"], r["method"]) == ("500", "0.8", "self_extend")]
    assert [float(r["gain_bits"]) for r in got] == pytest.approx([float(r["gain_bits"]) for r in direct], rel=1e-9)
    assert [r["key"] for r in got] == [str(r["key"]) for r in direct]
    data = load_result(side)["data"]
    assert data["formats"] == ["classic"] and len(data["summary"]) == 6
    printed = capsys.readouterr().out
    assert "classic self_extend      500 depth 0.80: gain " in printed
    monkeypatch.setattr(pk, "passkey_rows", _Failing())
    assert longctx.main(argv) == 0
    assert load_csv(out)[1] == rows


def test_docs_command(tmp_path, monkeypatch, capsys):
    docs = [ld.Document("a.py", "val", 90, tuple(range(50))), ld.Document("b.py", "val", 80, tuple(range(40)))]
    _fake_subject(monkeypatch, tiny_llama(), docs)
    out = tmp_path / "docs.json"
    assert longctx.main(["docs", "--min-tokens", "45", "--out", str(out)]) == 0
    data = load_result(out)["data"]
    assert data["documents"] == [docs[0].record()] and data["min_tokens"] == 45 and data["split"] == "val"
    assert "1 document(s) of at least 45 tokens in split 'val'" in capsys.readouterr().out


def test_cached_unit_reuses_only_the_same_params(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return [{"x": len(calls)}]

    params = {"a": 1, "b": [1, 2]}
    assert runs.cached_unit(tmp_path, "k", params, compute) == ([{"x": 1}], False)
    assert runs.cached_unit(tmp_path, "k", {"b": [1, 2], "a": 1}, compute) == ([{"x": 1}], True)
    assert runs.cached_unit(tmp_path, "k", {"a": 2, "b": [1, 2]}, compute) == ([{"x": 2}], False)
    assert runs.cached_unit(None, "k", params, compute) == ([{"x": 3}], False)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and all(f.startswith("k-") and f.endswith(".json") for f in files)
    assert json.loads((tmp_path / files[0]).read_text())["params"] in (params, {"a": 2, "b": [1, 2]})
