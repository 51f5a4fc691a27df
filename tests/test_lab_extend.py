"""Tests for context extension in the lab: :mod:`companion.lab.extend`, the ``extend`` command
and :func:`companion.utils.save_csv` / :func:`companion.utils.load_csv`.

Everything runs on one tiny RoPE checkpoint (the 5k-parameter model of ``tests/test_lab.py``,
trained for 20 steps once per module) and tiny evaluation settings, in one process except
one test of the two-worker pool.
"""

from __future__ import annotations

import math
import shutil
import warnings
from collections import defaultdict
from dataclasses import asdict

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
    finetune_fraction,
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
#: passkey's key and query (13 bytes) at 1x. max_len = 128 lets a job at factor 4 evaluate
#: at its target length 4 L (RoPE has no table, so max_len changes nothing else).
TINY = dict(d_model=16, n_heads=2, n_layers=1, seq_len=32, batch_size=4, max_len=128)
L = TINY["seq_len"]
HEAD_DIM = TINY["d_model"] // TINY["n_heads"]  # 8: four rotated pairs
#: The evaluation every extension job here runs: the unscaled model at lengths 32, 64 and 128
#: (a job at factor s at L and s L; the windows of every job are placed for 4 L, so factors
#: up to 4), 32 tail windows and 4 sliding stretches of 64 bytes in 4 blocks, 2 passkey
#: trials per depth; LongRoPE's searches score 6 windows at 2 L.
EV = ExtendConfig(multiples=[1, 2, 4], windows=32, blocks=4, sliding_tokens=256, passkey_trials=2,
                  entropy_windows=1, search_tokens=6 * 2 * L)
METRICS = {"bpb_all", "bpb_tail", "sliding_bpb", "passkey_gain", "passkey_exact", "entropy"}
#: method -> the HuggingFace rope_type it must produce (written out here, not read from the code)
ROPE_TYPE = {"none": "default", "pi": "linear", "ntk": "ntk", "dynamic": "dynamic", "yarn": "yarn",
             "ntk-matched": "ntk", "yarn-no-temp": "yarn", "llama3": "llama3", "longrope": "longrope",
             "abf": "default"}
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
    assert spec.dim == HEAD_DIM
    # ABF raises the base (tests/test_lab_recipe.py checks its rule); every other method keeps it
    assert spec.theta > BASE if method == "abf" else spec.theta == BASE
    if method in ("none", "abf"):
        assert "factor" not in cfg
    elif method == "ntk-matched":  # the scale Dynamic NTK reaches at s L: s^2 - s + 1
        assert cfg["factor"] == 7.0 and isinstance(cfg["factor"], float)
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


@pytest.mark.parametrize("method", list(METHODS))
def test_method_config_factor_must_be_at_least_one(method):
    """A scaling factor stretches the trained range: s >= 1 for every method (``none`` too, which
    the lab calls at 1); 1 itself and NumPy floats are fine and give the float."""
    for bad in (0.5, 0.0, -2.0):
        with pytest.raises(ValueError, match=rf"factor must be >= 1 \(a scaling factor .*\), got {bad!r}"):
            method_config(method, bad, L, HEAD_DIM)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="factor must be a finite number"):
            method_config(method, bad, L, HEAD_DIM)
    for bad in ("2", None, True):
        with pytest.raises(TypeError, match="factor must be a finite number"):
            method_config(method, bad, L, HEAD_DIM)
    assert method_config(method, np.float32(2.0), L, HEAD_DIM) == method_config(method, 2.0, L, HEAD_DIM)
    one = method_config(method, 1, L, HEAD_DIM)
    assert one.get("factor", 1.0) == 1.0 and isinstance(one.get("factor", 1.0), float)


def test_method_config_method_not_a_string():
    with pytest.raises(TypeError, match=r"method must be a name among \[.*'pi'.*\], got list \['pi'\]"):
        method_config(["pi"], 2.0, L, HEAD_DIM)


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


@pytest.mark.parametrize("method", [m for m in SCALED if m != "abf"])  # ABF keeps a base that already
def test_apply_method_changes_the_logits_past_the_training_length(ckpt, stdlib, method):  # suffices (test_lab_recipe)
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
    # finetune_fraction counts the tokens those batches held, against the pretraining's
    pre = cfg.steps * cfg.batch_size * cfg.seq_len
    assert finetune_fraction(2, cfg, new_len) == sum(b * n for b, n, _, _ in calls) / pre


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
    # search_tokens // (s L) = 2 windows of s L + 1 bytes
    res = longrope_search(model, stdlib, s, L, generations=1, population=4, search_tokens=2 * 2 * L, seed=0)
    assert res["search_windows"] == 2 and res["search_seed"] == 0
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
    res = longrope_search(model, stdlib, s, L, generations=4, population=8, search_tokens=2 * L, seed=1)
    assert res["search_windows"] == 2 and res["search_seed"] == 1  # one window's tokens: still 2 windows
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


def test_longrope_search_is_seeded(ckpt, stdlib, monkeypatch):
    seen = []
    real = extend_mod.method_config

    def recording(method, *args, **kw):
        if method == "longrope":
            seen[-1].append([float(x) for x in kw["long_factor"]])
        return real(method, *args, **kw)

    monkeypatch.setattr(extend_mod, "method_config", recording)
    results = []
    for seed in (5, 5, 6):
        seen.append([])
        model, _ = load_checkpoint(ckpt)
        results.append(longrope_search(model, stdlib, 2.0, L, generations=2, population=4, search_tokens=4 * L,
                                       seed=seed))
    assert results[0] == results[1] and seen[0] == seen[1]
    # another seed scores other candidates (the mutations and crossovers are drawn from it)
    assert results[2]["search_seed"] == 6 and seen[2] != seen[0]
    assert seen[2][:3] == seen[0][:3]  # from the same starting points (PI, NTK, YaRN)


def test_longrope_search_restores_a_plain_rope_model(ckpt, stdlib):
    model, _ = load_checkpoint(ckpt)
    assert model.scheme.rope_config is None
    ids = _ids(stdlib, 2 * L)
    before = _logits(model, ids)
    longrope_search(model, stdlib, 2.0, L, generations=1, population=4, search_tokens=4 * L)
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
    # the job's lengths are L and 2 L: each evaluation after the first follows one that
    # reached 2 L, and looks first at L, where that state shows
    assert EV.job_multiples("dynamic", 2.0, 0) == [1.0, 2.0]
    got = _by_key(extension_job(ckpt, "dynamic", 2.0, 0, EV)["rows"])
    cfg = method_config("dynamic", 2.0, L, HEAD_DIM)
    val = stdlib.val
    lengths = [L, 2 * L]
    reach = max(EV.multiples) * L  # every job's windows are placed for the sweep's longest length

    def fresh():
        model, _ = load_checkpoint(ckpt)
        apply_method(model, cfg, L)
        return model

    def stale():  # what the model computes right after a call at 2L
        model = fresh()
        _logits(model, _ids(stdlib, 2 * L, rows=1))
        return model

    def fmt(values):
        return [f"{v:.6g}" for v in values]

    # the first evaluation, at the longest length (the base grown to 2L, fresh or not) and at L
    bpb = bits_per_byte(fresh(), val, lengths, windows_per_length=EV.windows, blocks=EV.blocks, reach=reach)
    assert [got[("bpb_all", w, "")] for w in lengths] == fmt(bpb[w]["all"] for w in lengths)
    # each later one matches a fresh model, and not one with the grown base (so the
    # comparison can tell the two states apart)
    def sliding(model):
        return sliding_bits_per_byte(model, val, lengths, scored_tokens=EV.sliding_tokens, blocks=EV.blocks,
                                     reach=reach)[L]["sliding"]

    def passkey(model):  # the job's passkey runs at its lengths, L first
        res = passkey_retrieval(model, val, lengths, EV.passkey_depths, trials=EV.passkey_trials, seed=0)
        return res["gain"][0] + res["gain"][1]

    def entropy(model):
        return attention_entropy(model, val, lengths, windows_per_length=EV.entropy_windows)[L]

    for name, measure, keys, shows in [
        ("sliding", lambda m: [sliding(m)], [("sliding_bpb", L, "")], True),
        # the passkey's first call (at L) reads L - 1 bytes, shorter than the training length,
        # which restores the base by itself: there the stale state does not show
        ("passkey", passkey, [("passkey_gain", w, f"{d:g}") for w in lengths for d in EV.passkey_depths], False),
        ("entropy", entropy, [("entropy", L, "layer0")], True),
    ]:
        assert [got[k] for k in keys] == fmt(measure(fresh())), name
        if shows:
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
    # with the method in place, at s L, with the ExtendConfig's rate, a warmup of
    # min(20, max(1, steps // 10)) = 1 step and the checkpoint's seed
    assert calls == [("linear", {"seq_len": 2 * L, "steps": 3, "lr": 3e-3, "warmup": 1, "seed": 0})]
    assert [e["step"] for e in job["finetune_log"]] == [3]
    assert job["rope_config"] == method_config("pi", 2.0, L, HEAD_DIM)
    assert {r["finetune_steps"] for r in job["rows"]} == {3}
    # the fine-tuned model is another model: its numbers differ from the untuned job's
    plain = extension_job(ckpt, "pi", 2.0, 0, ev)
    assert len(calls) == 1  # no fine-tuning with 0 steps
    assert plain["finetune_log"] == []
    assert _by_key(job["rows"]) != _by_key(plain["rows"])


@pytest.mark.parametrize("steps, warmup", [(1, 1), (9, 1), (10, 1), (35, 3), (200, 20), (1000, 20)])
def test_extension_job_warmup_is_a_tenth_of_the_steps_up_to_20(ckpt, monkeypatch, steps, warmup):
    calls = []

    def recording(model, cfg, corpus, **kw):  # records, trains nothing
        calls.append(kw)
        return [{"step": kw["steps"], "loss": 1.0}]

    monkeypatch.setattr(extend_mod, "finetune", recording)
    job = extension_job(ckpt, "yarn", 2.0, steps, EV)
    assert [c["warmup"] for c in calls] == [warmup] and calls[0]["steps"] == steps
    assert job["finetune_log"] == [{"step": steps, "loss": 1.0}]


def test_job_multiples_rules():
    ev = ExtendConfig(multiples=[1, 2, 4, 8, 16], beyond=2.0, beyond_steps=[200])
    # the unscaled model as it is: every multiple (sorted, as floats)
    assert ExtendConfig(multiples=[4, 1, 2]).job_multiples("none", 1.0, 0) == [1.0, 2.0, 4.0]
    assert ev.job_multiples("none", 1.0, 0) == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert all(type(m) is float for m in ev.job_multiples("none", 1.0, 0))
    # a method at scale s: L and s L; fine-tuned for beyond_steps steps, also beyond * s L
    # where that is at most max(multiples) // 2
    assert ev.job_multiples("pi", 2.0, 0) == [1.0, 2.0]
    assert ev.job_multiples("pi", 2.0, 200) == [1.0, 2.0, 4.0]
    assert ev.job_multiples("none", 2.0, 200) == [1.0, 2.0, 4.0]  # RoPE fine-tuned at 2 L
    assert ev.job_multiples("yarn", 4.0, 200) == [1.0, 4.0, 8.0]  # 8 = 16 // 2: still in
    assert ev.job_multiples("yarn", 8.0, 200) == [1.0, 8.0]  # 16 > 8: out
    assert ev.job_multiples("longrope", 8.0, 0) == [1.0, 8.0]
    assert ev.job_multiples("pi", 2.0, 50) == [1.0, 2.0]  # 50 steps are not among beyond_steps
    assert ExtendConfig(beyond_steps=[10, 50]).job_multiples("pi", 1.5, 10) == [1.0, 1.5, 3.0]
    assert ExtendConfig(beyond_steps=[10, 50]).job_multiples("pi", 2.0, 200) == [1.0, 2.0]
    assert ExtendConfig().job_multiples("pi", 2.0, 200) == [1.0, 2.0, 4.0]  # the default: 200 steps
    odd = ExtendConfig(multiples=[1, 2, 4, 9], beyond=2.0, beyond_steps=[5])  # max // 2 = 4
    assert odd.job_multiples("pi", 2.0, 5) == [1.0, 2.0, 4.0] and odd.job_multiples("pi", 4.0, 5) == [1.0, 4.0]
    assert ExtendConfig(multiples=[1, 16], beyond=0.0).job_multiples("pi", 2.0, 200) == [1.0, 2.0]
    assert ExtendConfig(multiples=[1, 16], beyond=3.0).job_multiples("pi", 2.0, 200) == [1.0, 2.0, 6.0]


def test_extension_job_refuses_lengths_past_max_len(ckpt, monkeypatch):
    # max_len = 128 = 4 L: a job at factor 8 would evaluate at 256; refused before any evaluation
    monkeypatch.setattr(extend_mod, "_evaluate", None)  # (calling it would raise a TypeError)
    with pytest.raises(ValueError, match=r"reaches length 256, past the model's max_len = 128"):
        extension_job(ckpt, "pi", 8.0, 0, EV)
    far = ExtendConfig(**{**vars(EV), "multiples": [1, 8]})  # the unscaled model at 8 L
    with pytest.raises(ValueError, match=r"reaches length 256, past the model's max_len = 128"):
        extension_job(ckpt, "none", 1.0, 0, far)
    # a target past the evaluation's longest length (max(multiples) * L = 64 here) is refused
    # before the fine-tune runs, not after it
    monkeypatch.setattr(extend_mod, "finetune", None)
    short = ExtendConfig(**{**vars(EV), "multiples": [1, 2]})
    with pytest.raises(ValueError, match=r"reaches length 128, .*max\(multiples\) \* L = 64"):
        extension_job(ckpt, "pi", 4.0, 50, short)


def test_plan_jobs():
    from companion.lab.extend import plan_jobs
    # without fine-tuning every method at every factor, except "none": once, at factor 1
    assert plan_jobs(["none", "pi"], [2, 4], [0]) == [("none", 1.0, 0), ("pi", 2.0, 0), ("pi", 4.0, 0)]
    jobs = plan_jobs(["none", "pi"], [2.0], [0, 5])
    assert jobs == [("none", 1.0, 0), ("pi", 2.0, 0), ("none", 2.0, 5), ("pi", 2.0, 5)]
    assert all(type(f) is float and type(n) is int for _, f, n in jobs)
    # finetune_methods: which methods the positive step counts fine-tune
    assert plan_jobs(["none", "pi", "yarn"], [2.0, 4.0], [0, 5], finetune_methods=["yarn"]) == [
        ("none", 1.0, 0), ("pi", 2.0, 0), ("pi", 4.0, 0), ("yarn", 2.0, 0), ("yarn", 4.0, 0),
        ("yarn", 2.0, 5), ("yarn", 4.0, 5)]
    assert plan_jobs(["pi"], [2.0], [5]) == [("pi", 2.0, 5)]  # no untuned jobs asked for
    # extra steps at the extra factors only, for extra_methods (default: methods), and no
    # job twice
    got = plan_jobs(["none", "pi", "yarn"], [2.0, 4.0], [0, 5], finetune_methods=["pi"], extra_steps=[5, 20],
                    extra_factors=[4.0], extra_methods=["pi", "yarn"])
    assert got == [("none", 1.0, 0), ("pi", 2.0, 0), ("pi", 4.0, 0), ("yarn", 2.0, 0), ("yarn", 4.0, 0),
                   ("pi", 2.0, 5), ("pi", 4.0, 5),
                   ("yarn", 4.0, 5), ("pi", 4.0, 20), ("yarn", 4.0, 20)]
    assert len(set(got)) == len(got)
    assert plan_jobs(["none", "pi"], [2.0], [0], extra_steps=[10], extra_factors=[2, 8]) == [
        ("none", 1.0, 0), ("pi", 2.0, 0), ("none", 2.0, 10), ("none", 8.0, 10), ("pi", 2.0, 10), ("pi", 8.0, 10)]
    assert plan_jobs(["pi"], [2.0], [0], extra_steps=[0], extra_factors=[2.0]) == [("pi", 2.0, 0)]
    for kw in ({"finetune_methods": ["pl"]}, {"extra_methods": ["pl"], "extra_steps": [5]}):
        with pytest.raises(ValueError, match=r"method must be one of .*, got 'pl'"):
            plan_jobs(["pi"], [2.0], [0, 5], **kw)
    with pytest.raises(ValueError, match=r"method must be one of .*, got 'pl'"):
        plan_jobs(["pi", "pl"], [2.0], [0])
    for kw in ({"finetune_steps": [0, -1]}, {"finetune_steps": [0], "extra_steps": [-5]}):
        with pytest.raises(ValueError, match="finetune_steps"):
            plan_jobs(["pi"], [2.0], extra_factors=[2.0], **kw)


@pytest.mark.parametrize("s", [2.0, 2.5, 4.0, 8.0])
def test_ntk_matched_is_dynamic_ntk_at_its_target_length(s):
    cfg = method_config("ntk-matched", s, L, HEAD_DIM)
    assert cfg == {"rope_type": "ntk", "rope_theta": BASE, "factor": s * s - s + 1}
    inv, att = compute_inv_freq(cfg, HEAD_DIM, max_position_embeddings=L)
    # HuggingFace's Dynamic NTK at length s L: base * (s * sL / L - (s - 1)) ** (d / (d - 2)),
    # the NTK-aware base at scale s^2 - s + 1; the same float32 table, bit for bit
    dyn, dyn_att = compute_inv_freq(method_config("dynamic", s, L, HEAD_DIM), HEAD_DIM,
                                    max_position_embeddings=L, seq_len=int(s * L))
    assert torch.equal(inv, dyn) and att == dyn_att == 1.0
    base = BASE * (s * s - s + 1) ** (HEAD_DIM / (HEAD_DIM - 2))
    want = base ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    assert inv.double().tolist() == pytest.approx(want.tolist(), rel=1e-6)  # float32 powers: a few ulps
    # not NTK at s, nor Dynamic NTK at L (the training length: plain RoPE)
    plain_ntk, _ = compute_inv_freq(method_config("ntk", s, L, HEAD_DIM), HEAD_DIM, max_position_embeddings=L)
    at_l, _ = compute_inv_freq(method_config("dynamic", s, L, HEAD_DIM), HEAD_DIM, max_position_embeddings=L,
                               seq_len=L)
    assert not torch.equal(inv, plain_ntk) and not torch.equal(inv, at_l)
    assert bool((inv[1:] < plain_ntk[1:]).all())  # a larger scale: lower frequencies


def test_finetune_fraction(ckpt):
    cfg = TrainConfig.from_dict(load_checkpoint(ckpt)[1]["config"])  # 20 steps of 4 x 32 tokens
    pre = cfg.steps * cfg.batch_size * cfg.seq_len
    assert finetune_fraction(3, cfg, L) == 3 * 4 * 32 / pre
    assert finetune_fraction(3, cfg, 2 * L) == 3 * 2 * 64 / pre  # batch 2 of 64: as many tokens
    assert finetune_fraction(10, cfg, 100) == 10 * 1 * 100 / pre  # 128 // 100 = 1 row
    assert finetune_fraction(3, cfg, 8 * L) == 3 * 1 * 256 / pre  # at least one row
    assert finetune_fraction(20, cfg, L) == 1.0  # the pretraining budget again
    assert finetune_fraction(0, cfg, L) == 0.0


# ---------------------------------------------------------------------------------------
# run_extension


def _check_rows(rows, ev=EV, seed=0):
    """Every row has the CSV fields; every job has each metric at the lengths of its
    ev.job_multiples, the passkey at every depth."""
    groups = defaultdict(list)
    for row in rows:
        assert list(row) == CSV_FIELDS
        assert row["seed"] == seed
        assert math.isfinite(float(row["value"]))
        groups[(row["method"], row["factor"], row["finetune_steps"])].append(row)
    for (method, factor, steps), group in groups.items():
        lengths = [int(round(m * L)) for m in ev.job_multiples(method, factor, steps)]
        by_metric = defaultdict(set)
        for r in group:
            by_metric[r["metric"]].add((r["length"], r["where"]))
        assert set(by_metric) == METRICS
        for m in ("bpb_all", "bpb_tail", "sliding_bpb"):
            assert by_metric[m] == {(w, "") for w in lengths}
        for m in ("passkey_gain", "passkey_exact"):
            assert by_metric[m] == {(w, d) for w in lengths for d in ("0", "0.5", "1")}
        assert by_metric["entropy"] == {(w, "layer0") for w in lengths}  # one layer
        assert len(group) == (2 + 1 + 3 + 3 + 1) * len(lengths)
        for r in group:
            v = float(r["value"])
            if r["metric"] == "passkey_exact":
                assert 0 <= v <= 1
            if r["metric"].startswith("bpb") or r["metric"] == "sliding_bpb":
                assert 0 < v < 9
    return groups


def _check_units(res, ev=EV):
    """Each job's units: the block means and trials behind its rows (stored to 4 decimals, so
    their mean is within 5e-5 of the row's; a row holds 6 significant digits)."""
    assert len(res["units"]) == len({(r["method"], r["factor"], r["finetune_steps"]) for r in res["rows"]})
    rows = {(r["method"], r["factor"], r["finetune_steps"], r["metric"], r["length"], r["where"]): float(r["value"])
            for r in res["rows"]}
    for u in res["units"]:
        key = (u["method"], u["factor"], u["finetune_steps"])
        assert set(u) == {"seed", "method", "factor", "finetune_steps", "tail", "sliding", "passkey"}
        lengths = [str(int(round(m * L))) for m in ev.job_multiples(*key)]
        assert sorted(u["tail"]) == sorted(u["sliding"]) == sorted(u["passkey"]) == sorted(lengths)
        for w in lengths:
            for name, metric in (("tail", "bpb_tail"), ("sliding", "sliding_bpb")):
                blocks = u[name][w]
                assert len(blocks) == ev.blocks and all(b == round(b, 4) for b in blocks)
                assert np.mean(blocks) == pytest.approx(rows[(*key, metric, int(w), "")], abs=6e-5)
            assert sorted(u["passkey"][w]) == ["0", "0.5", "1"]
            for depth, cell in u["passkey"][w].items():
                assert len(cell["gain"]) == len(cell["exact"]) == ev.passkey_trials
                assert set(cell["exact"]) <= {0, 1} and all(type(x) is int for x in cell["exact"])
                assert np.mean(cell["gain"]) == pytest.approx(rows[(*key, "passkey_gain", int(w), depth)], abs=6e-5)
                assert np.mean(cell["exact"]) == pytest.approx(rows[(*key, "passkey_exact", int(w), depth)],
                                                               abs=1e-6)


def test_run_extension_jobs_and_rows(ckpt, tmp_path, monkeypatch):
    factors = [2.0, 4.0]
    cache = tmp_path / "cache"
    res = run_extension([ckpt], list(METHODS), factors, [0, 3], EV, workers=1, verbose=False, cache_dir=str(cache))
    groups = _check_rows(res["rows"])
    expected = {("none", 1.0, 0)}  # plain RoPE without fine-tuning does not depend on the factor
    expected |= {(m, f, 0) for m in SCALED for f in factors}
    expected |= {(m, f, 3) for m in METHODS for f in factors}  # "none" fine-tuned at s L
    assert set(groups) == expected
    # 10 rows per length: L, 2 L and 4 L as it is; L and s L for the others (3 steps are not
    # EV.beyond_steps, so no length beyond s L)
    assert len(res["rows"]) == 30 + 20 * (len(expected) - 1)
    _check_units(res)
    # ev.search_seeds = 2 searches per factor (seeds 0 and 1), with the default settings, before the jobs
    assert [(r["factor"], r["search_seed"]) for r in res["searches"]] == [(2.0, 0), (2.0, 1), (4.0, 0), (4.0, 1)]
    for r in res["searches"]:
        assert r["checkpoint"] == ckpt and len(r["long_factor"]) == HEAD_DIM // 2
        assert r["evaluations"] == 12 + 8 * (12 - 3)
        assert r["search_windows"] == EV.search_tokens // int(r["factor"] * L)  # 6 at 2 L, 3 at 4 L
    # a fine-tune log for every fine-tuned job, none for the others
    logs = {(r["method"], r["factor"], r["steps"]): r["log"] for r in res["finetune_logs"]}
    assert set(logs) == {(m, f, 3) for m in METHODS for f in factors}
    assert all([e["step"] for e in log] == [3] for log in logs.values())
    assert res["job_seconds"] > 0 and res["wall_seconds"] > 0
    assert res["extend_config"] == asdict(EV)
    # the LongRoPE jobs ran with the factors of seed 0's search
    by_seed = {r["search_seed"]: r["long_factor"] for r in res["searches"] if r["factor"] == 2.0}
    job = extension_job(ckpt, "longrope", 2.0, 0, EV, long_factor=by_seed[0])
    picked = [r for r in res["rows"] if (r["method"], r["factor"], r["finetune_steps"]) == ("longrope", 2.0, 0)]
    assert picked == job["rows"]
    if by_seed[1] != by_seed[0]:  # (seed 1's search may end on the same factors)
        assert picked != extension_job(ckpt, "longrope", 2.0, 0, EV, long_factor=by_seed[1])["rows"]

    # Every search and job was kept in cache_dir: the same run again reuses them all,
    # computing nothing.
    assert len(list(cache.glob("search-*.json"))) == 4 and len(list(cache.glob("job-*.json"))) == len(expected)

    def refuse(*args, **kwargs):
        raise AssertionError("computed again")

    monkeypatch.setattr(extend_mod, "longrope_search", refuse)
    monkeypatch.setattr(extend_mod, "extension_job", refuse)
    again = run_extension([ckpt], list(METHODS), factors, [0, 3], EV, workers=1, verbose=False, cache_dir=str(cache))
    for key in ("extend_config", "rows", "units", "searches", "finetune_logs", "job_seconds"):
        assert again[key] == res[key], key


def test_run_extension_cache_is_keyed_by_the_job(ckpt, tmp_path, monkeypatch):
    calls = defaultdict(int)
    real_job, real_search = extend_mod.extension_job, extend_mod.longrope_search

    def job(*args, **kwargs):
        calls["job"] += 1
        return real_job(*args, **kwargs)

    def search(*args, **kwargs):
        calls["search"] += 1
        return real_search(*args, **kwargs)

    monkeypatch.setattr(extend_mod, "extension_job", job)
    monkeypatch.setattr(extend_mod, "longrope_search", search)
    ev = ExtendConfig(**{**vars(EV), "search_tokens": 2 * 2 * L, "search_seeds": 1})
    args = ([ckpt], ["none", "pi"], [2.0], [0])
    first = run_extension(*args, ev, workers=1, verbose=False, cache_dir=str(tmp_path))
    assert calls == {"job": 2}
    assert run_extension(*args, ev, workers=1, verbose=False, cache_dir=str(tmp_path))["rows"] == first["rows"]
    assert calls == {"job": 2}
    # another evaluation config is another job; a new method or factor too; the old stay
    other = ExtendConfig(**{**vars(ev), "windows": 16})
    changed = run_extension(*args, other, workers=1, verbose=False, cache_dir=str(tmp_path))
    assert calls == {"job": 4} and changed["rows"] != first["rows"]
    run_extension([ckpt], ["none", "pi", "longrope"], [2.0], [0], ev, workers=1, verbose=False,
                  cache_dir=str(tmp_path))
    assert calls == {"job": 5, "search": 1}
    run_extension([ckpt], ["longrope"], [2.0], [0], ev, workers=1, verbose=False, cache_dir=str(tmp_path))
    assert calls == {"job": 5, "search": 1}
    # without a cache_dir nothing is kept
    run_extension(*args, ev, workers=1, verbose=False)
    assert calls == {"job": 7, "search": 1}


def test_run_extension_finetune_checkpoints(ckpt, tmp_path, monkeypatch):
    """The fine-tuned jobs of finetune_steps run on finetune_checkpoints only; the untuned and
    the extra jobs on every checkpoint."""
    other = str(tmp_path / "other.pt")
    shutil.copy(ckpt, other)
    ran = []

    def stub(checkpoint, method, factor, steps, ev, long_factor=None):  # records, computes nothing
        ran.append((checkpoint, method, factor, steps))
        key = {"seed": 0, "method": method, "factor": factor, "finetune_steps": steps}
        return {"rows": [{**key, "metric": "bpb_all", "length": L, "where": "", "value": "1"}], "units": key,
                "finetune_log": [], "rope_config": {}, "seconds": 0.0}

    monkeypatch.setattr(extend_mod, "extension_job", stub)
    run_extension([ckpt, other], ["pi"], [2.0], [0, 3], EV, finetune_checkpoints=[other], extra_steps=[5],
                  extra_factors=[2.0], workers=1, verbose=False)
    assert ran == [(ckpt, "pi", 2.0, 0), (ckpt, "pi", 2.0, 5),
                   (other, "pi", 2.0, 0), (other, "pi", 2.0, 3), (other, "pi", 2.0, 5)]
    with pytest.raises(ValueError, match="finetune_checkpoints must be among checkpoints"):
        run_extension([ckpt], ["pi"], [2.0], [0, 3], EV, finetune_checkpoints=[other], workers=1, verbose=False)


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


def test_cli_extend_writes_csv_and_json(tmp_path, capsys, monkeypatch):
    out, js, ck = tmp_path / "ext.csv", tmp_path / "ext.json", tmp_path / "ck"
    argv = ["extend", "--seeds", "0", "--checkpoint-dir", str(ck), "--methods", "all", "--factors", "2",
            "--finetune-steps", "0", "2", "--workers", "1", "--out", str(out), "--json", str(js),
            "--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--seq-len", "32", "--batch-size", "4",
            "--max-len", "64", "--steps", "5", "--warmup", "1",
            "--multiples", "1", "2", "--windows", "32", "--blocks", "4", "--sliding-tokens", "256",
            "--passkey-trials", "2", "--search-tokens", "384", "--entropy-windows", "1"]
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
    assert len(rows) == 20 * len(jobs)  # two lengths of 10 rows each
    assert {r["metric"] for r in rows} == METRICS and {r["length"] for r in rows} == {"32", "64"}
    payload = load_result(js)
    assert payload["provenance"]["command"] == prov["command"]
    data = payload["data"]
    assert set(data) == {"extend_config", "units", "searches", "finetune_logs", "job_seconds", "wall_seconds"}
    assert data["extend_config"]["windows"] == 32 and data["extend_config"]["blocks"] == 4
    assert len(data["units"]) == len(jobs)
    assert all(len(u["tail"]["32"]) == 4 for u in data["units"])  # --blocks 4
    assert [(s["factor"], s["search_seed"]) for s in data["searches"]] == [(2.0, 0), (2.0, 1)]
    assert all(len(s["long_factor"]) == 4 and s["search_windows"] == 6 for s in data["searches"])
    assert len(data["finetune_logs"]) == len(METHODS)
    assert f"extend: {len(rows)} rows in" in capsys.readouterr().out
    # every search and job is kept under <checkpoint-dir>/extend: a rerun computes nothing
    assert len(list((ck / "extend").glob("*.json"))) == 2 + len(jobs)

    def refuse(*args, **kwargs):
        raise AssertionError("computed again")

    monkeypatch.setattr(extend_mod, "longrope_search", refuse)
    monkeypatch.setattr(extend_mod, "extension_job", refuse)
    assert main(argv) == 0
    assert load_csv(out)[1] == rows
    # the options that pick the fine-tuned jobs; only the one new job runs
    monkeypatch.undo()
    computed = []
    real = extend_mod.extension_job

    def counting(checkpoint, method, factor, steps, *args):
        computed.append((method, factor, steps))
        return real(checkpoint, method, factor, steps, *args)

    monkeypatch.setattr(extend_mod, "extension_job", counting)
    picked = [a for a in argv if a != "all"]
    picked[picked.index("--methods") + 1: picked.index("--methods") + 1] = ["none", "pi", "yarn"]
    picked += ["--finetune-methods", "pi", "--extra-steps", "4", "--extra-factors", "2", "--extra-methods", "yarn"]
    assert main(picked) == 0
    assert computed == [("yarn", 2.0, 4)]
    jobs = {(r["method"], r["factor"], r["finetune_steps"]) for r in load_csv(out)[1]}
    assert jobs == {("none", "1.0", "0"), ("pi", "2.0", "0"), ("yarn", "2.0", "0"), ("pi", "2.0", "2"),
                    ("yarn", "2.0", "4")}


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
