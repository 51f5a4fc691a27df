"""Tests for context extension in the lab: :mod:`companion.lab.extend`, the ``extend`` command
and :func:`companion.utils.save_csv` / :func:`companion.utils.load_csv`.

Everything runs on one tiny RoPE checkpoint (the 5k-parameter model of ``tests/test_lab.py``,
trained for 20 steps once per module) and tiny evaluation settings, in one process except
one test of the two-worker pool.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict

import numpy as np
import pytest
import torch

import companion.lab.extend as extend_mod
from companion.lab import TrainConfig, load_checkpoint, load_corpus, train
from companion.lab.__main__ import main
from companion.lab.data import windows
from companion.lab.evaluate import (
    attention_entropy,
    bits_per_byte,
    evenly_spaced_starts,
    passkey_retrieval,
    sliding_bits_per_byte,
)
from companion.lab.extend import (
    BASE,
    CSV_FIELDS,
    METHOD_LABELS,
    METHODS,
    ExtendConfig,
    apply_method,
    extension_job,
    finetune,
    longrope_search,
    method_config,
    run_extension,
)
from companion.lab.sweep import checkpoint_path
from companion.lab.train import build_model
from companion.scaling import compute_inv_freq, parse_rope_config
from companion.utils import load_csv, load_result, save_csv

#: The tiny model of tests/test_lab.py. seq_len = 32 leaves room for the training mix's key
#: and 3 queries (7 + 3 * 6 = 25 bytes, see companion.lab.data.sample_batch) and for the
#: passkey's key and query (13 bytes) at 1x.
TINY = dict(d_model=16, n_heads=2, n_layers=1, seq_len=32, batch_size=4, max_len=64)
L = TINY["seq_len"]
HEAD_DIM = TINY["d_model"] // TINY["n_heads"]  # 8: four rotated pairs
#: The evaluation every extension job here runs: lengths 32 and 64, one passkey length.
EV = ExtendConfig(multiples=[1, 2], tokens=1024, sliding_tokens=256, passkey_multiples=[1], passkey_trials=1,
                  entropy_windows=1)
METRICS = {"bpb_all", "bpb_tail", "sliding_bpb", "passkey_gain", "passkey_exact", "entropy"}
#: method -> the HuggingFace rope_type it must produce (written out here, not read from the code)
ROPE_TYPE = {"none": "default", "pi": "linear", "ntk": "ntk", "dynamic": "dynamic", "yarn": "yarn",
             "yarn-no-temp": "yarn", "llama3": "llama3", "longrope": "longrope"}
SCALED = [m for m in METHODS if m != "none"]


@pytest.fixture(scope="module")
def stdlib():
    return load_corpus()


@pytest.fixture(scope="module")
def ckpt(stdlib, tmp_path_factory):
    """A RoPE checkpoint trained for 20 steps (about a second)."""
    path = tmp_path_factory.mktemp("extend") / "rope.pt"
    train(TrainConfig(scheme="rope", steps=20, warmup=2, **TINY), stdlib, checkpoint=path, progress=False)
    return str(path)


def _ids(stdlib, length: int, rows: int = 2) -> torch.Tensor:
    return torch.from_numpy(stdlib.val[: rows * length].astype(np.int64)).view(rows, length)


@torch.no_grad()
def _logits(model, ids):
    return model(ids)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------
# method_config


def test_method_names_are_the_documented_ones():
    assert list(METHODS) == list(ROPE_TYPE)
    assert set(METHOD_LABELS) == set(METHODS)


@pytest.mark.parametrize("method", list(METHODS))
def test_method_config_parses_and_has_the_right_fields(method):
    cfg = method_config(method, 3, L, HEAD_DIM)  # an int factor: stored as a float
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unrecognised key or a missing rope_theta warns
        spec = parse_rope_config(cfg, HEAD_DIM, max_position_embeddings=L)
    assert spec.rope_type == ROPE_TYPE[method]
    assert spec.theta == BASE and spec.dim == HEAD_DIM
    if method == "none":
        assert "factor" not in cfg
    else:
        assert cfg["factor"] == 3.0 and isinstance(cfg["factor"], float)
    if ROPE_TYPE[method] in ("yarn", "llama3", "longrope"):  # the types that read the training length
        assert cfg["original_max_position_embeddings"] == L
        assert spec.params["original_max_position_embeddings"] == L
    else:
        assert "original_max_position_embeddings" not in cfg
    # the base is passed through
    assert method_config(method, 2.0, L, HEAD_DIM, base=5e5)["rope_theta"] == 5e5


def test_method_config_unknown_method():
    with pytest.raises(ValueError, match=r"method must be one of \[.*'yarn'.*\], got 'rope2'"):
        method_config("rope2", 2.0, L, HEAD_DIM)


def test_yarn_without_temperature_keeps_yarns_frequencies():
    s = 4.0
    yarn_inv, yarn_att = compute_inv_freq(method_config("yarn", s, L, HEAD_DIM), HEAD_DIM,
                                          max_position_embeddings=L)
    cfg = method_config("yarn-no-temp", s, L, HEAD_DIM)
    assert cfg["attention_factor"] == 1.0
    inv, att = compute_inv_freq(cfg, HEAD_DIM, max_position_embeddings=L)
    assert torch.equal(inv, yarn_inv)
    assert att == 1.0
    # YaRN's own temperature is 0.1 ln s + 1 (1.139 at s = 4), so the two really differ
    assert yarn_att == pytest.approx(0.1 * math.log(s) + 1.0, rel=1e-6)


def test_longrope_config_uses_the_given_long_factors():
    s = 2.0
    default = method_config("longrope", s, L, HEAD_DIM)
    assert default["short_factor"] == [1.0] * 4 and default["long_factor"] == [s] * 4
    given = [1.0, 1.25, 2.0, 3.5]
    cfg = method_config("longrope", s, L, HEAD_DIM, long_factor=np.array(given))
    assert cfg["long_factor"] == given and all(type(x) is float for x in cfg["long_factor"])
    assert cfg["short_factor"] == [1.0] * 4
    short, _ = compute_inv_freq(cfg, HEAD_DIM, max_position_embeddings=L, seq_len=L)
    long, _ = compute_inv_freq(cfg, HEAD_DIM, max_position_embeddings=L, seq_len=2 * L)
    # inv_freq = 1 / (factor_i * base ** (2 i / d)) in float32: the ratio of the short (factor
    # 1) and long frequencies is factor_i up to a few float32 roundings (eps = 1.2e-7 each)
    assert (short / long).tolist() == pytest.approx(given, rel=1e-6)
    # the other methods take no long factors
    assert "long_factor" not in method_config("pi", s, L, HEAD_DIM, long_factor=given)


# ---------------------------------------------------------------------------------------
# apply_method


@pytest.mark.parametrize("method", SCALED)
def test_apply_method_changes_the_logits_past_the_training_length(ckpt, stdlib, method):
    untouched, _ = load_checkpoint(ckpt)
    model, _ = load_checkpoint(ckpt)
    ids = _ids(stdlib, 2 * L)
    ref = _logits(untouched, ids)
    apply_method(model, method_config(method, 2.0, L, HEAD_DIM), L)
    assert model.scheme.rope_spec.rope_type == ROPE_TYPE[method]
    assert model.scheme.rope_spec.max_position_embeddings == L
    got = _logits(model, ids)
    # Float noise: the whole float32 forward pass is off from a float64 one by this much
    # (about 5e-7 here), and never less than one rounding of the largest logit. Tables that
    # differed only by rounding could not move the logits further than that; a method moves
    # the angles themselves. Require 100 times the noise.
    exact = _logits(load_checkpoint(ckpt)[0].double(), ids)
    noise = max(float((ref.double() - exact).abs().max()), float(ref.abs().max()) * torch.finfo(torch.float32).eps)
    assert (got - ref).abs().max() > 100 * noise


def test_apply_method_none_restores_the_original_logits(ckpt, stdlib):
    untouched, _ = load_checkpoint(ckpt)
    model, _ = load_checkpoint(ckpt)
    ids = _ids(stdlib, 2 * L)
    ref = _logits(untouched, ids)
    for method in ("yarn", "dynamic", "none"):  # dynamic grows its base at 2L, then back
        apply_method(model, method_config(method, 2.0, L, HEAD_DIM), L)
        last = _logits(model, ids)
    assert torch.equal(last, ref)
    assert torch.equal(model.scheme.inv_freq, untouched.scheme.inv_freq)
    assert model.scheme.attention_scaling == 1.0


def test_apply_method_needs_a_rope_model():
    model = build_model(TrainConfig(scheme="alibi", **TINY))
    with pytest.raises(ValueError, match="context extension needs a RoPE model, got scheme ALiBi"):
        apply_method(model, method_config("pi", 2.0, L, HEAD_DIM), L)


# ---------------------------------------------------------------------------------------
# finetune


def test_finetune_trains_logs_and_ends_in_eval_mode(ckpt):
    model, raw = load_checkpoint(ckpt)
    cfg = TrainConfig.from_dict(raw["config"])
    apply_method(model, method_config("yarn", 2.0, L, HEAD_DIM), L)
    before = _params(model)
    model.train()
    log = finetune(model, cfg, load_corpus(), seq_len=2 * L, steps=12, warmup=2)
    assert not model.training and not any(m.training for m in model.modules())
    assert [e["step"] for e in log] == [10, 12]  # every 10 steps and the last
    # bits per byte of one batch: positive and at most a little above the 8 of a uniform guess
    assert all(0 < e["loss"] < 9 for e in log)
    after = _params(model)
    assert all(not torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("new_len, batch", [(L, 4), (2 * L, 2), (48, 2), (100, 1), (8 * L, 1)])
def test_finetune_batch_keeps_the_tokens_per_step(ckpt, monkeypatch, new_len, batch):
    """batch = max(1, batch_size * seq_len // new_len), with the pretraining data mix."""
    model, raw = load_checkpoint(ckpt)
    cfg = TrainConfig.from_dict(raw["config"])
    calls = []
    real = extend_mod.sample_batch

    def recording(data, batch_size, seq_len, generator, **kw):
        x, y = real(data, batch_size, seq_len, generator, **kw)
        calls.append((batch_size, seq_len, kw, tuple(x.shape)))
        return x, y

    monkeypatch.setattr(extend_mod, "sample_batch", recording)
    finetune(model, cfg, load_corpus(), seq_len=new_len, steps=2)
    mix = {"retrieval_fraction": cfg.retrieval_fraction, "retrieval_queries": cfg.retrieval_queries}
    assert calls == [(batch, new_len, mix, (batch, new_len))] * 2


def test_finetune_warms_up_then_holds_the_rate(ckpt, monkeypatch):
    model, raw = load_checkpoint(ckpt)
    cfg = TrainConfig.from_dict(raw["config"])
    rates = []
    real = extend_mod._optimizer

    def recording(m, c):
        opt = real(m, c)
        step = opt.step

        def logged_step(*a, **kw):
            rates.append([g["lr"] for g in opt.param_groups])
            return step(*a, **kw)

        opt.step = logged_step
        return opt

    monkeypatch.setattr(extend_mod, "_optimizer", recording)
    finetune(model, cfg, load_corpus(), seq_len=2 * L, steps=5, lr=2e-3, warmup=3)
    # linear warmup over 3 steps, then constant: no cosine decay (cfg.lr = 1e-2 is not used)
    expected = [2e-3 / 3, 4e-3 / 3, 2e-3, 2e-3, 2e-3]
    assert [r[0] for r in rates] == pytest.approx(expected, rel=1e-12)
    assert all(r[0] == r[1] for r in rates)  # both parameter groups


def test_finetune_is_deterministic(ckpt):
    corpus = load_corpus()
    runs = []
    for seed in (3, 3, 4):
        model, raw = load_checkpoint(ckpt)
        apply_method(model, method_config("pi", 2.0, L, HEAD_DIM), L)
        log = finetune(model, TrainConfig.from_dict(raw["config"]), corpus, seq_len=2 * L, steps=5, seed=seed)
        runs.append((log, _params(model)))
    (log_a, pa), (log_b, pb), (log_c, pc) = runs
    assert log_a == log_b
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    # another seed draws other batches, so the run can tell seeds apart
    assert not all(torch.equal(a, c) for a, c in zip(pa, pc))


# ---------------------------------------------------------------------------------------
# longrope_search


def _search_rows(corpus, factor, count):
    n = int(round(factor * L))
    return windows(corpus.train, evenly_spaced_starts(corpus.train.size, n + 1, count), n + 1)


@torch.no_grad()
def _bpb(model, rows):
    logits = model(rows[:, :-1]).float()
    return float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), rows[:, 1:]) / math.log(2))


def test_longrope_search_constraints_and_scores(ckpt, stdlib, monkeypatch):
    model, _ = load_checkpoint(ckpt)
    apply_method(model, method_config("yarn", 2.0, L, HEAD_DIM), L)  # a config to restore
    config_before = model.scheme.rope_config
    ids = _ids(stdlib, 2 * L)
    logits_before = _logits(model, ids)
    count = [0]
    real = extend_mod._train_bpb

    def counting(m, rows):
        count[0] += 1
        return real(m, rows)

    monkeypatch.setattr(extend_mod, "_train_bpb", counting)
    s = 2.0
    res = longrope_search(model, stdlib, s, L, generations=1, population=4, windows_count=2, seed=0)
    f = np.array(res["long_factor"])
    assert f.shape == (HEAD_DIM // 2,)
    assert np.all(f >= 1.0) and np.all(f <= 2 * s)
    assert np.all(np.diff(f) >= 0)  # non-decreasing from high to low frequency
    assert set(res["start_scores"]) == {"pi", "ntk", "yarn"}
    # the best is the minimum over a pool that holds the three starting points
    assert all(res["score"] <= v for v in res["start_scores"].values())
    # elitism: the best score never gets worse; one entry for the start and each generation
    assert len(res["history"]) == 2 and res["history"][1] <= res["history"][0]
    assert res["score"] == res["history"][-1]
    # 4 initial candidates, then 4 - max(2, 4 // 4) = 2 children per generation
    assert res["evaluations"] == count[0] == 6
    # the reported score is the one of the reported factors, on the same training windows
    # (the same computation in the same process: the same float, bit for bit)
    monkeypatch.undo()
    probe, _ = load_checkpoint(ckpt)
    apply_method(probe, method_config("longrope", s, L, HEAD_DIM, long_factor=res["long_factor"]), L)
    assert _bpb(probe, _search_rows(stdlib, s, 2)) == res["score"]
    # the model's config is restored, and so are its outputs
    assert model.scheme.rope_config == config_before
    assert torch.equal(_logits(model, ids), logits_before)


def test_longrope_search_candidates_obey_the_constraints(ckpt, stdlib, monkeypatch):
    """Every factor list the search scores (not only the best) lies in [1, 2 s] and is
    non-decreasing, and the mutations really move away from the starting points."""
    seen = []
    real = extend_mod.method_config

    def recording(method, *args, **kw):
        if method == "longrope":
            seen.append(np.array(kw["long_factor"]))
        return real(method, *args, **kw)

    monkeypatch.setattr(extend_mod, "method_config", recording)
    model, _ = load_checkpoint(ckpt)
    s = 2.0
    res = longrope_search(model, stdlib, s, L, generations=4, population=8, windows_count=1, seed=1)
    assert len(seen) == res["evaluations"] == 8 + 4 * 6
    for f in seen:
        assert f.shape == (HEAD_DIM // 2,)
        assert np.all(f >= 1.0) and np.all(f <= 2 * s) and np.all(np.diff(f) >= 0)
    starts = seen[:3]  # PI, NTK, YaRN
    assert np.allclose(starts[0], s, rtol=1e-6)  # PI divides every frequency by s
    # NTK keeps the highest frequency and divides the lowest by s (float32 powers: a few ulps)
    assert starts[1][0] == 1.0 and starts[1][-1] == pytest.approx(s, rel=1e-6)
    assert np.all((starts[1][1:-1] > 1) & (starts[1][1:-1] < s))
    assert sum(not any(np.array_equal(f, g) for g in starts) for f in seen[3:]) >= 10


def test_longrope_search_is_seeded(ckpt, stdlib):
    results = []
    for _ in range(2):
        model, _ = load_checkpoint(ckpt)
        results.append(longrope_search(model, stdlib, 2.0, L, generations=2, population=4, windows_count=2,
                                       seed=5))
    assert results[0] == results[1]


def test_longrope_search_restores_a_plain_rope_model(ckpt, stdlib):
    model, _ = load_checkpoint(ckpt)
    assert model.scheme.rope_config is None
    ids = _ids(stdlib, 2 * L)
    before = _logits(model, ids)
    longrope_search(model, stdlib, 2.0, L, generations=1, population=4, windows_count=2)
    assert model.scheme.rope_config is None
    assert torch.equal(_logits(model, ids), before)


# ---------------------------------------------------------------------------------------
# extension jobs


def _by_key(rows):
    return {(r["metric"], r["length"], r["where"]): r["value"] for r in rows}


def test_dynamic_ntk_gets_a_fresh_state_for_each_evaluation(ckpt, stdlib):
    """Dynamic NTK grows its base to the longest length seen, and keeps it for any call that
    is not shorter than the training length. Each evaluation must start from the installed
    config, as a freshly loaded model does, not from the base the previous one left."""
    # lengths L and 4L, the passkey at 2L: each evaluation after the first follows one that
    # reached 4L, and looks at a length (L, or 2L for the passkey) where that state shows
    ev = ExtendConfig(multiples=[1, 4], tokens=1024, sliding_tokens=256, passkey_multiples=[2], passkey_trials=1,
                      entropy_windows=1)
    got = _by_key(extension_job(ckpt, "dynamic", 2.0, 0, ev)["rows"])
    cfg = method_config("dynamic", 2.0, L, HEAD_DIM)
    val = stdlib.val
    lengths = [L, 4 * L]

    def fresh():
        model, _ = load_checkpoint(ckpt)
        apply_method(model, cfg, L)
        return model

    def stale():  # what the model computes right after a call at 4L
        model = fresh()
        _logits(model, _ids(stdlib, 4 * L, rows=1))
        return model

    def fmt(values):
        return [f"{v:.6g}" for v in values]

    # the first evaluation, at the longest length (the base grown to 4L, fresh or not) and at L
    bpb = bits_per_byte(fresh(), val, lengths, tokens=ev.tokens)
    assert [got[("bpb_all", w, "")] for w in lengths] == fmt(bpb[w]["all"] for w in lengths)
    # each later one matches a fresh model, and not one with the grown base (so the
    # comparison can tell the two states apart)
    def sliding(model):
        return sliding_bits_per_byte(model, val, lengths, scored_tokens=ev.sliding_tokens)[L]

    def passkey(model):
        return passkey_retrieval(model, val, [2 * L], ev.passkey_depths, trials=ev.passkey_trials, seed=0)["gain"][0]

    def entropy(model):
        return attention_entropy(model, val, lengths, windows_per_length=ev.entropy_windows)[L]

    for name, measure, keys in [
        ("sliding", lambda m: [sliding(m)], [("sliding_bpb", L, "")]),
        ("passkey", passkey, [("passkey_gain", 2 * L, f"{d:g}") for d in ev.passkey_depths]),
        ("entropy", entropy, [("entropy", L, "layer0")]),
    ]:
        assert [got[k] for k in keys] == fmt(measure(fresh())), name
        assert fmt(measure(stale())) != fmt(measure(fresh())), name


def test_extension_job_finetunes_at_the_scaled_length(ckpt, monkeypatch):
    calls = []
    real = extend_mod.finetune

    def recording(model, cfg, corpus, **kw):
        calls.append((model.scheme.rope_spec.rope_type, kw))
        return real(model, cfg, corpus, **kw)

    monkeypatch.setattr(extend_mod, "finetune", recording)
    ev = ExtendConfig(**{**vars(EV), "finetune_lr": 3e-3})
    job = extension_job(ckpt, "pi", 2.0, 3, ev)
    # with the method in place, at s L, with the ExtendConfig's rate and the checkpoint's seed
    assert calls == [("linear", {"seq_len": 2 * L, "steps": 3, "lr": 3e-3, "seed": 0})]
    assert [e["step"] for e in job["finetune_log"]] == [3]
    assert job["rope_config"] == method_config("pi", 2.0, L, HEAD_DIM)
    assert {r["finetune_steps"] for r in job["rows"]} == {3}
    # the fine-tuned model is another model: its numbers differ from the untuned job's
    plain = extension_job(ckpt, "pi", 2.0, 0, ev)
    assert len(calls) == 1  # no fine-tuning with 0 steps
    assert plain["finetune_log"] == []
    assert _by_key(job["rows"]) != _by_key(plain["rows"])


# ---------------------------------------------------------------------------------------
# run_extension


def _check_rows(rows, seed=0):
    """Every row has the CSV fields; every job has each metric at the expected lengths."""
    groups = defaultdict(list)
    for row in rows:
        assert list(row) == CSV_FIELDS
        assert row["seed"] == seed
        assert math.isfinite(float(row["value"]))
        groups[(row["method"], row["factor"], row["finetune_steps"])].append(row)
    for group in groups.values():
        by_metric = defaultdict(set)
        for r in group:
            by_metric[r["metric"]].add((r["length"], r["where"]))
        assert set(by_metric) == METRICS
        for m in ("bpb_all", "bpb_tail", "sliding_bpb"):
            assert by_metric[m] == {(L, ""), (2 * L, "")}  # multiples [1, 2] x seq_len
        for m in ("passkey_gain", "passkey_exact"):
            assert by_metric[m] == {(L, "0"), (L, "0.5"), (L, "1")}  # passkey_multiples [1]
        assert by_metric["entropy"] == {(L, "layer0"), (2 * L, "layer0")}  # one layer
        assert len(group) == 2 + 2 + 2 + 3 + 3 + 2
        for r in group:
            v = float(r["value"])
            if r["metric"] == "passkey_exact":
                assert 0 <= v <= 1
            if r["metric"].startswith("bpb") or r["metric"] == "sliding_bpb":
                assert 0 < v < 9
    return groups


def test_run_extension_jobs_and_rows(ckpt):
    factors = [2.0, 4.0]
    res = run_extension([ckpt], list(METHODS), factors, [0, 3], EV, workers=1, verbose=False)
    groups = _check_rows(res["rows"])
    expected = {("none", 1.0, 0)}  # plain RoPE without fine-tuning does not depend on the factor
    expected |= {(m, f, 0) for m in SCALED for f in factors}
    expected |= {(m, f, 3) for m in METHODS for f in factors}  # "none" fine-tuned at s L
    assert set(groups) == expected
    assert len(res["rows"]) == 14 * len(expected)
    # one search per factor, with the default settings, before the jobs
    assert [r["factor"] for r in res["searches"]] == factors
    for r in res["searches"]:
        assert r["checkpoint"] == ckpt and len(r["long_factor"]) == HEAD_DIM // 2
        assert r["evaluations"] == 12 + 8 * (12 - 3)
    # a fine-tune log for every fine-tuned job, none for the others
    logs = {(r["method"], r["factor"]): r["log"] for r in res["finetune_logs"]}
    assert set(logs) == {(m, f) for m in METHODS for f in factors}
    assert all([e["step"] for e in log] == [3] for log in logs.values())
    # the LongRoPE jobs ran with the searched factors
    lf = res["searches"][0]["long_factor"]
    job = extension_job(ckpt, "longrope", 2.0, 0, EV, long_factor=lf)
    assert [r for r in res["rows"] if (r["method"], r["factor"], r["finetune_steps"]) == ("longrope", 2.0, 0)] \
        == job["rows"]


def test_run_extension_rejects_an_unknown_method(ckpt):
    with pytest.raises(ValueError, match=r"method must be one of .*, got 'pl'"):
        run_extension([ckpt], ["pi", "pl"], [2.0], [0], EV, workers=1, verbose=False)


@pytest.mark.slow
def test_run_extension_in_two_workers_matches_one(ckpt, capsys):
    args = ([ckpt], ["none", "pi"], [2.0], [0], EV)
    one = run_extension(*args, workers=1, verbose=False)
    capsys.readouterr()
    two = run_extension(*args, workers=2, verbose=True)
    # each worker uses one thread, as this process does: the same arithmetic, the same rows
    assert two["rows"] == one["rows"]
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[0] for line in out] == ["[1/2]", "[2/2]"]
    assert "default none s=1 ft=0" in out[0] and "linear pi s=2 ft=0" in out[1]


# ---------------------------------------------------------------------------------------
# the command line


def test_cli_extend_writes_csv_and_json(tmp_path, capsys):
    out, js, ck = tmp_path / "ext.csv", tmp_path / "ext.json", tmp_path / "ck"
    argv = ["extend", "--seeds", "0", "--checkpoint-dir", str(ck), "--methods", "all", "--factors", "2",
            "--finetune-steps", "0", "2", "--workers", "1", "--out", str(out), "--json", str(js),
            "--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--seq-len", "32", "--batch-size", "4",
            "--max-len", "64", "--steps", "5", "--warmup", "1",
            "--multiples", "1", "2", "--tokens", "1024", "--sliding-tokens", "256", "--passkey-multiples", "1",
            "--passkey-trials", "1", "--entropy-windows", "1"]
    assert main(argv) == 0
    # the missing checkpoint was trained first, with the options given
    cfg = TrainConfig(scheme="rope", seed=0, d_model=16, n_heads=2, n_layers=1, seq_len=32, batch_size=4,
                      max_len=64, steps=5, warmup=1)
    _, raw = load_checkpoint(checkpoint_path(ck, cfg))
    assert raw["config"] == vars(cfg)
    prov, rows = load_csv(out)
    assert prov["command"].startswith("python -m companion.lab extend --seeds 0 --checkpoint-dir ")
    assert prov["command"].endswith("--entropy-windows 1")
    assert list(rows[0]) == CSV_FIELDS
    jobs = {(r["method"], r["factor"], r["finetune_steps"]) for r in rows}
    assert jobs == {("none", "1.0", "0")} | {(m, "2.0", "0") for m in SCALED} | {(m, "2.0", "2") for m in METHODS}
    assert len(rows) == 14 * len(jobs)
    assert {r["metric"] for r in rows} == METRICS and {r["length"] for r in rows} == {"32", "64"}
    payload = load_result(js)
    assert payload["provenance"]["command"] == prov["command"]
    data = payload["data"]
    assert set(data) == {"searches", "finetune_logs", "wall_seconds"}
    assert [s["factor"] for s in data["searches"]] == [2.0] and len(data["searches"][0]["long_factor"]) == 4
    assert len(data["finetune_logs"]) == len(METHODS)
    assert f"extend: {len(rows)} rows in" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# save_csv / load_csv


def test_csv_round_trip(tmp_path):
    path = tmp_path / "deeper" / "r.csv"  # folders are made
    rows = [{"a": 1, "b": 2.5, "c": "x,y"}, {"c": 'say "hi"', "a": -3, "b": float("nan")}]
    assert save_csv(path, rows, ["a", "b", "c"], command="python -m x --y") == path
    prov, back = load_csv(path)
    assert prov["command"] == "python -m x --y" and "git_commit" in prov and "torch" in prov
    # values come back as strings, in the field order given; quoting survives
    assert back == [{"a": "1", "b": "2.5", "c": "x,y"}, {"a": "-3", "b": "nan", "c": 'say "hi"'}]
    assert list(back[0]) == ["a", "b", "c"]
    assert path.read_text().splitlines()[1] == "a,b,c"
    save_csv(path, [], ["a"])  # no rows: a header only
    prov, back = load_csv(path)
    assert back == [] and prov["command"] is None


@pytest.mark.parametrize("text", ["two\nlines", "carriage\rreturn", "line\u2028separator"])
def test_csv_round_trip_of_line_breaks_in_a_value(tmp_path, text):
    save_csv(tmp_path / "r.csv", [{"a": text, "b": 1}], ["a", "b"])
    assert load_csv(tmp_path / "r.csv")[1] == [{"a": text, "b": "1"}]


def test_save_csv_rejects_rows_with_other_keys(tmp_path):
    path = tmp_path / "r.csv"
    with pytest.raises(ValueError, match=r"rows\[1\] has keys \['a'\], expected \['a', 'b'\]"):
        save_csv(path, [{"a": 1, "b": 2}, {"a": 1}], ["a", "b"])
    with pytest.raises(ValueError, match=r"rows\[0\] has keys \['a', 'b', 'c'\], expected \['a', 'b'\]"):
        save_csv(path, [{"a": 1, "b": 2, "c": 3}], ["a", "b"])
    assert not path.exists()  # nothing written
    with pytest.raises(TypeError, match="path must be a path"):
        save_csv(None, [], ["a"])


def test_load_csv_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_csv(tmp_path / "missing.csv")
    plain = tmp_path / "plain.csv"
    plain.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"plain.csv is not a result CSV \(its first line must start with "
                                         r"'# provenance: '\)"):
        load_csv(plain)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match="is not a result CSV"):
        load_csv(empty)
