"""companion.passkey: passkey prompts, keys, and the log-probability score with a shared prefix.

The model parts run on tiny random models in float64 (test_longctx_docs.py's), with a
character tokenizer (digits and spaces are tokens, as in SmolLM2's and Gemma's tokenizers).
The cached, prefix-sharing scores are compared with full passes over prompt and answer
(one forward each, logits of every position), which share nothing with the cache code; the
tolerance is that file's (1e-9 on log-probabilities of a few nats, float64). The tests on
the real SmolLM2 tokenizer skip when its GGUF file is not cached.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from test_longctx_docs import CharTok, tiny_gemma, tiny_llama

from companion import llama
from companion import longctx
from companion import passkey as pk
from companion import pretrained as pt
from companion.lab import stats
from companion.trainfree import ReRoPE, SelfExtend, SinkCache

TOL, FAR = 1e-9, 1e-6
TF = {"rerope_window": 24, "leak": 3.0, "se_window": 24, "se_group": 4, "sinks": 2, "sink_window": 40, "chunk": 16}


class Tok(CharTok):
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


# ----------------------------------------------------------------------------- prompts and keys


def test_classic_prompt_is_mohtashami_and_jaggis():
    garbage = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    want = "\n".join([
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.",
        " ".join([garbage] * 3), "The pass key is 12345. Remember it. 12345 is the pass key.",
        " ".join([garbage] * 7), "What is the pass key? The pass key is"])
    assert pk.prompt_text("classic", 10, 0.3, 12345) == want
    assert pk.prompt_text("classic", 10, 0.0, 12345).split("\n")[1] == ""  # the key right after the task
    assert pk.prompt_text("classic", 10, 1.0, 12345).split("\n")[3] == ""


def test_chat_prompt_is_chapter_10s(monkeypatch):
    tmpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tok = Tok()
    ids = longctx.passkey_prompt(tok, tmpl, 900, 0.5, 48213)
    ids2, text, units = pk.prompt_ids(tok, "chat", 900, 0.5, 48213, template=tmpl)
    assert ids == ids2 and len(ids) <= 900 < len(tok.encode(pk.prompt_text("chat", units + 1, 0.5, 48213, tmpl)).ids)
    assert text.startswith("<user>There is an important pass key hidden") and text.endswith(
        "\nWhat is the pass key?The pass key is")
    assert text.count("The pass key is 48213. Remember it. 48213 is the pass key. ") == 1
    with pytest.raises(ValueError, match="template must be given for the chat format"):
        pk.prompt_text("chat", 3, 0.5, 12345)


def test_prompt_ids_fits_the_length_with_the_answer():
    tok = Tok()
    for length in (400, 777, 1500):
        for reserve in (0, 6):
            ids, text, units = pk.prompt_ids(tok, "classic", length, 0.5, 12345, reserve=reserve)
            assert ids == tok.encode(text).ids and text == pk.prompt_text("classic", units, 0.5, 12345)
            assert len(ids) + reserve <= length < len(tok.encode(pk.prompt_text("classic", units + 1, 0.5, 12345)).ids) + reserve
    least = len(pk.prompt_text("classic", 0, 0.5, 12345)) + 6  # characters are tokens
    with pytest.raises(ValueError, match=rf"length must be at least {least} \(the prompt without filler and its answer\), "
                                         rf"got {least - 1}"):
        pk.prompt_ids(tok, "classic", least - 1, 0.5, 12345, reserve=6)
    assert len(pk.prompt_ids(tok, "classic", least, 0.5, 12345, reserve=6)[0]) == least - 6
    with pytest.raises(ValueError, match=r"fmt must be one of \['classic', 'chat'\], got 'plain'"):
        pk.prompt_ids(tok, "plain", 500, 0.5, 12345)
    with pytest.raises(ValueError, match=r"depth must lie in \[0, 1\], got 1.5"):
        pk.prompt_ids(tok, "classic", 500, 1.5, 12345)


def test_answer_ids_continue_the_prompt():
    tok = Tok()
    text = pk.prompt_text("classic", 2, 0.5, 12345)
    ids = tok.encode(text).ids
    assert pk.answer_ids(tok, text, ids, 67890) == tok.encode(" 67890").ids

    class Merging(Tok):  # merges "s 6" into one token: the prompt's last token changes
        def encode(self, text):
            out = super().encode(text).ids
            return type("Enc", (), {"ids": out[:-7] + [7] + out[-4:] if text.endswith("s 67890") else out})()

    with pytest.raises(ValueError, match="does not tokenize as a continuation of the prompt"):
        pk.answer_ids(Merging(), text, ids, 67890)


def test_draw_keys_are_five_digit_and_shared_by_cell():
    a = pk.draw_keys(0, 8192, 0.5, 30, 4)
    assert a == pk.draw_keys(0, 8192, 0.5, 30, 4)  # the same for every method and format
    assert a != pk.draw_keys(1, 8192, 0.5, 30, 4) and a != pk.draw_keys(0, 8192, 0.1, 30, 4)
    assert a != pk.draw_keys(0, 4096, 0.5, 30, 4)
    assert pk.draw_keys(0, 8192, 0.5, 10, 4) == a[:10]  # more trials extend the same draw
    for key, others in a:
        assert all(10000 <= k <= 99999 for k in (key, *others))
        assert len(set(others)) == 4 and key not in others
    for bad, match in (((-1, 10, 0.5, 2), "seed must be >= 0"), ((0, 10, 0.5, 0), "trials must be >= 1"),
                       ((0, 10, 0.5, 2, 0), "controls must be >= 1")):
        with pytest.raises(ValueError, match=match):
            pk.draw_keys(*bad)


def test_control_keys_are_uniform_like_the_key():
    # the gain of a context-blind model is f(key) - mean f(controls): 0 in expectation when
    # each control is distributed as the key. A chi-square test on the first digits of
    # 4000 draws (9 classes; the 0.999 quantile of chi2(8) is 26.1) for key and controls.
    draws = pk.draw_keys(7, 100, 0.5, 4000, 2)
    for values in ([k for k, _ in draws], [c[0] for _, c in draws], [c[1] for _, c in draws]):
        counts = np.bincount([v // 10000 for v in values], minlength=10)[1:]
        chi2 = float(((counts - 4000 / 9) ** 2 / (4000 / 9)).sum())
        assert chi2 < 26.1, chi2


# ----------------------------------------------------------------------------- the cached scores


def reference_scores(model, prompts, answers, method, factor=2.0):
    """One full forward per (prompt, candidate), the method installed for that pass alone:
    log p of the candidate's tokens and whether each is the argmax."""
    from companion.longctx_docs import applied_method

    out = []
    for p, cands in zip(prompts, answers):
        logps, exact = [], None
        for j, c in enumerate(cands):
            ids = torch.tensor([list(p) + list(c)])
            with applied_method(model, method, factor=factor, trainfree=TF) as config:
                if method in ("rerope", "leaky_rerope", "self_extend"):
                    mode = SelfExtend(24, 4) if method == "self_extend" else ReRoPE(24, config.get("leak"))
                    with model.attention_mode(mode):
                        logits = model.logits(model.hidden(ids))[0]
                else:
                    logits = model(ids)[0]
            lp = torch.log_softmax(logits[len(p) - 1:-1].double(), -1)
            target = torch.tensor(list(c))
            logps.append(float(lp.gather(1, target[:, None]).sum()))
            if j == 0:
                exact = bool((lp.argmax(-1) == target).all())
        out.append((logps, exact))
    return out


def _cell(length=300, depth=0.4, trials=3):
    tok = Tok()
    keys = pk.draw_keys(0, length, depth, trials, 2)
    _, _, units = pk.prompt_ids(tok, "classic", length, depth, 99999, reserve=6)
    prompts, answers = [], []
    for key, others in keys:
        text = pk.prompt_text("classic", units, depth, key)
        ids = tok.encode(text).ids
        prompts.append(ids)
        answers.append([pk.answer_ids(tok, text, ids, k) for k in (key, *others)])
    return prompts, answers


@pytest.mark.parametrize("method", ["none", "yarn", "dynamic", "rerope", "leaky_rerope", "self_extend"])
def test_shared_prefix_scores_equal_full_passes(method):
    model = tiny_llama(context_length=128)
    prompts, answers = _cell()
    t0, c0 = time.perf_counter(), time.process_time()
    got = pk.score_prompts(model, prompts, answers, method, trainfree=TF, chunk=37)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # the prefix and the trials ran one after another inside the call (unrounded times)
    assert got["prefix_seconds"] + sum(t["seconds"] for t in got["trials"]) <= wall
    assert sum(t["cpu_seconds"] for t in got["trials"]) <= cpu
    assert 150 < got["prefix_tokens"] < len(prompts[0])  # the filler before the key, run once
    alone = pk.score_prompts(model, prompts, answers, method, trainfree=TF, share=False)
    assert alone["prefix_tokens"] == 0
    ref = reference_scores(model, prompts, answers, method)
    for trial, again, (logps, exact) in zip(got["trials"], alone["trials"], ref):
        assert np.abs(np.subtract(trial["logp"], logps)).max() <= TOL, method
        assert np.abs(np.subtract(again["logp"], logps)).max() <= TOL, method
        assert trial["exact"] == exact and trial["seconds"] > 0 and trial["cpu_seconds"] >= 0
    # the candidates are told apart by far more than the tolerance
    assert max(abs(t["logp"][0] - t["logp"][1]) for t in got["trials"]) > FAR
    assert model.rope.rope_config == {"rope_type": "default", "rope_theta": 100.0}


def test_dynamic_is_fixed_at_the_prompts_length_not_the_prefix():
    # without freezing, the cached prefix (shorter than the native 128) would be rotated with
    # plain frequencies and the suffix with the length's: the scores would move
    model = tiny_llama(context_length=128)
    prompts, answers = _cell()
    frozen = pk.score_prompts(model, prompts, answers, "dynamic")
    import companion.longctx_docs as ld

    real = ld.frozen_length
    try:
        ld.frozen_length = lambda model, length: __import__("contextlib").nullcontext()
        drifting = pk.score_prompts(model, prompts, answers, "dynamic")
    finally:
        ld.frozen_length = real
    assert max(abs(a["logp"][0] - b["logp"][0]) for a, b in zip(frozen["trials"], drifting["trials"])) > FAR


def test_sinks_share_whole_chunks_and_equal_a_fresh_stream():
    model = tiny_llama(context_length=128)
    prompts, answers = _cell()
    got = pk.score_prompts(model, prompts, answers, "sinks", trainfree=TF)
    assert got["prefix_tokens"] % 16 == 0 and got["prefix_tokens"] > 100
    for p, cands, trial in zip(prompts, answers, got["trials"]):
        logps = []
        for c in cands:  # a fresh stream: the prompt in chunks of 16 from 0, then the answer as one chunk
            cache = SinkCache(model.config.n_layers, 2, 40)
            for s in range(0, len(p), 16):
                h = model.hidden(torch.tensor([p[s:s + 16]]), cache)
            rows = [h[0, -1]]
            if len(c) > 1:
                rows += list(model.hidden(torch.tensor([c[:-1]]), cache)[0])
            lp = torch.log_softmax(model.logits(torch.stack(rows)).double(), -1)
            logps.append(float(lp.gather(1, torch.tensor(c)[:, None]).sum()))
        assert np.abs(np.subtract(trial["logp"], logps)).max() <= TOL


def test_gemma_shared_prefix_scores_equal_full_passes():
    model = tiny_gemma()
    tok = Tok(bos=True)
    keys = pk.draw_keys(0, 260, 0.5, 2, 2)
    prompts, answers = [], []
    _, _, units = pk.prompt_ids(tok, "classic", 260, 0.5, 99999, reserve=6)
    for key, others in keys:
        text = pk.prompt_text("classic", units, 0.5, key)
        ids = tok.encode(text).ids
        prompts.append(ids)
        answers.append([pk.answer_ids(tok, text, ids, k) for k in (key, *others)])
    for method, layers in (("none", "global"), ("yarn", "global"), ("dynamic", "all")):
        got = pk.score_prompts(model, prompts, answers, method, rope_layers=layers, chunk=50)
        for trial, p, cands in zip(got["trials"], prompts, answers):
            from companion.longctx_docs import applied_method

            for j, c in enumerate(cands):
                with applied_method(model, method, rope_layers=layers):
                    logits = model(torch.tensor([p + c]))[0, len(p) - 1:-1]
                lp = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(c)[:, None]).sum()
                assert abs(trial["logp"][j] - float(lp)) <= TOL, (method, j)


def test_score_prompts_rejects_bad_input():
    model = tiny_llama()
    for prompts, answers, match in (([], [], "prompts must be non-empty"), ([[1, 2]], [], "one list of candidates per prompt"),
                                    ([[1, 2]], [[[]]], "must hold at least one token"),
                                    ([[1, 2]], [[[61]]], r"outside \[0, 61\)"), ([[1, -2]], [[[3]]], r"outside \[0, 61\)")):
        with pytest.raises(ValueError, match=match):
            pk.score_prompts(model, prompts, answers)
    with pytest.raises(TypeError, match="share must be a bool"):
        pk.score_prompts(model, [[1, 2]], [[[3]]], share=1)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        pk.score_prompts(model, [[1, 2]], [[[3]]], chunk=0)
    with pytest.raises(ValueError, match="training-free method"):
        pk.score_prompts(tiny_gemma(), [[1, 2]], [[[3]]], "rerope")


# ----------------------------------------------------------------------------- the gain


def blind_llama():
    """A tiny Llama that ignores its context: every value projection is zero, so attention adds
    nothing and the logits at a position depend on that position's token alone."""
    model = tiny_llama(seed=5, context_length=128)
    for block in model.layers:
        block.attention.wv.weight.zero_()
    return model


def test_a_context_blind_model_gains_nothing_in_expectation():
    model, tok = blind_llama(), Tok()
    rows = pk.passkey_rows(model, tok, "classic", 300, 0.5, "none", trials=40, controls=2)
    # (1) each trial's gain is f(key) - mean f(controls), f the candidate's log-probability
    # after any prompt ending in the same token (here: the bare question)
    q = tok.encode(pk.QUESTION).ids

    def f(key):
        ids = torch.tensor([q + tok.encode(f" {key}").ids])
        lp = torch.log_softmax(model(ids)[0, len(q) - 1:-1].double(), -1)
        return float(lp.gather(1, ids[0, len(q):, None]).sum())

    gains = []
    for r in rows:
        controls = [int(c) for c in r["controls"].split()]
        want = (f(r["key"]) - sum(map(f, controls)) / 2) / (5 * math.log(2))
        assert abs(float(r["gain_bits"]) - want) <= TOL
        gains.append(float(r["gain_bits"]))
    # (2) with key and controls drawn alike, the mean gain over trials is 0 within its noise:
    # |mean| below 4 standard errors (a 6e-5 chance of failing for a correct sampler, fixed seed)
    g = np.asarray(gains)
    assert abs(g.mean()) < 4 * g.std(ddof=1) / math.sqrt(g.size), (g.mean(), g.std())
    assert g.std() > 0.1  # and not because every gain is 0: f varies between keys


def test_passkey_rows_fields_and_a_model_that_reads():
    model, tok = tiny_llama(context_length=128), Tok()
    rows = pk.passkey_rows(model, tok, "classic", 300, 0.4, "yarn", trials=3, controls=2, seed=2)
    keys = pk.draw_keys(2, 300, 0.4, 3, 2)
    assert [(r["key"], r["controls"]) for r in rows] == [(k, f"{c[0]} {c[1]}") for k, c in keys]
    for r in rows:
        assert set(r) == set(pk.PASSKEY_FIELDS)
        assert r["prompt_tokens"] + 6 <= 300 and r["method"] == "yarn" and r["format"] == "classic"
        lk, lc = float(r["logp_key"]), float(r["logp_controls"])
        assert float(r["gain_bits"]) == pytest.approx((lk - lc) / (5 * math.log(2)), rel=1e-12)
        assert float(r["bits"]) == pytest.approx(-lk / (5 * math.log(2)), rel=1e-12)
        # the prompts differ first where the key is written (characters are tokens here)
        _, _, units = pk.prompt_ids(tok, "classic", 300, 0.4, 99999, reserve=6)
        text = pk.prompt_text("classic", units, 0.4, r["key"])
        at = text.index(f"The pass key is {r['key']}.") + len("The pass key is ")
        assert at <= r["key_position"] < at + 5 and len(text) == r["prompt_tokens"]


def test_passkey_prompts_are_the_cells_prompts_and_candidates():
    tok = Tok()
    keys, prompts, answers = pk.passkey_prompts(tok, "classic", 300, 0.4, trials=3, controls=2, seed=2)
    assert keys == pk.draw_keys(2, 300, 0.4, 3, 2)
    _, _, units = pk.prompt_ids(tok, "classic", 300, 0.4, 99999, reserve=6)  # " 99999": 6 characters
    for (key, others), ids, cands in zip(keys, prompts, answers):
        text = pk.prompt_text("classic", units, 0.4, key)
        assert ids == tok.encode(text).ids and len(ids) + 6 <= 300
        assert cands == [tok.encode(f" {k}").ids for k in (key, *others)]  # the true key first
    assert len({len(p) for p in prompts}) == 1  # the same filler in every trial of the cell
    with pytest.raises(ValueError, match="length must be at least"):
        pk.passkey_prompts(tok, "classic", 100, 0.4, trials=2)
    with pytest.raises(ValueError, match="trials must be >= 1"):
        pk.passkey_prompts(tok, "classic", 300, 0.4, trials=0)


def test_passkey_summary_intervals():
    rows = [{"format": "classic", "method": "none", "length": "1024", "depth": "0.5", "gain_bits": repr(g),
             "exact": str(int(g > 1))} for g in (0.5, 1.5, 2.5, 0.2)]
    rows += [dict(rows[0], method="yarn")]
    s = pk.passkey_summary(rows, resamples=500)
    cell = s[("classic", "none", 1024, 0.5)]
    assert cell["gain"] == stats.bootstrap_ci([0.5, 1.5, 2.5, 0.2], resamples=500)
    assert cell["exact"] == stats.proportion_ci(2, 4) and cell["trials"] == 4
    assert s[("classic", "yarn", 1024, 0.5)]["trials"] == 1
    with pytest.raises(ValueError, match=r"rows\[0\] lacks the key 'gain_bits'"):
        pk.passkey_summary([{"format": "classic", "method": "none", "length": 1, "depth": 0.5}])
    with pytest.raises(ValueError, match=r"rows\[0\] holds a value that is not a number"):
        pk.passkey_summary([dict(rows[0], length="x")])


def test_kvcache_truncate_rolls_back():
    model = tiny_llama()
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = llama.KVCache(2)
    model.hidden(ids[:, :8], cache)
    first = model.hidden(ids[:, 8:], cache)
    cache.truncate(8)
    assert cache.length == 8
    other = model.hidden(ids[:, :4], cache)  # something else at positions 8 .. 11
    cache.truncate(8)
    again = model.hidden(ids[:, 8:], cache)
    assert torch.equal(first, again) and not torch.equal(first, other)
    with pytest.raises(ValueError, match=r"length must lie in \[0, 12\] \(the cached positions\), got 13"):
        cache.truncate(13)
    with pytest.raises(ValueError, match="length must be >= 0, got -1"):
        cache.truncate(-1)
    with pytest.raises(TypeError, match="length must be an int"):
        cache.truncate(2.0)
    cache.truncate(0)
    assert cache.length == 0


# ----------------------------------------------------------------------------- the real tokenizer

MODEL = pt.cached_smollm2_path()


@pytest.mark.skipif(not MODEL.is_file(), reason=f"SmolLM2 GGUF not cached at {MODEL}")
def test_real_tokenizer_answers_are_a_space_and_five_digits():
    fields = llama.gguf_metadata(MODEL)
    tok = llama.gguf_tokenizer(fields)
    for fmt in pk.FORMATS:
        ids, text, _ = pk.prompt_ids(tok, fmt, 600, 0.5, 12345, template=fields["tokenizer.chat_template"], reserve=6)
        ans = pk.answer_ids(tok, text, ids, 40719)
        assert [tok.decode([t]) for t in ans] == [" ", "4", "0", "7", "1", "9"]
