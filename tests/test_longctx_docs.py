"""companion.longctx_docs: long documents and the same-token value of context (chapter 10).

Everything runs on tiny random models built here, in float64 (a Llama from companion.llama,
a Gemma 3 from companion.gemma), against independent computations: the sliding baseline
against a brute-force loop of one pass per block (per token with S = 1), the chunked and
frozen passes against one plain pass, the bootstrap against companion.lab.stats called on
arrays built here.

Tolerances. Two float64 computations of the same losses along different code paths (other
slices, chunks or matrix shapes) differ by rounding only: each loss is a sum of
O(layers x dim x seq) products of O(1) values, so its error is within about
1e4 x u64 x |value| ~ 1e-12 x |value| for these sizes; 1e-9 (absolute, losses of a few nats)
leaves a factor 1000 to spare, and every test also checks that the alternative it rules out
(a context one token shorter, another method) moves the losses by far more (> 1e-6).
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import torch

from companion import gemma as gm
from companion import llama
from companion import longctx_docs as ld
from companion.lab import stats
from companion.lab.corpus import split_of
from companion.longctx import method_config, trainfree_config

TOL = 1e-9  # see the module doc
FAR = 1e-6  # what a wrong context or method must exceed


def tiny_llama(seed: int = 0, context_length: int = 32) -> llama.LlamaModel:
    cfg = llama.LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, head_dim=8,
                            rope_base=100.0, norm_eps=1e-5, context_length=context_length, name="tiny")
    torch.manual_seed(seed)
    return llama.LlamaModel(cfg).double().eval().requires_grad_(False)


def tiny_gemma(seed: int = 0) -> gm.GemmaModel:
    cfg = gm.GemmaConfig(vocab_size=61, dim=32, n_layers=4, n_heads=2, n_kv_heads=1, hidden_dim=48, head_dim=16,
                         norm_eps=1e-6, context_length=32, rope_base=1e4, rope_local_base=100.0, sliding_window=6,
                         sliding_window_pattern=2, bos_id=2, eos_id=1)
    g = torch.Generator().manual_seed(seed)
    model = gm.GemmaModel(cfg, device="meta")
    w = {n: (1 + 0.3 * torch.randn(p.shape, generator=g) if n.endswith("norm.weight")
             else torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])).double()
         for n, p in model.state_dict().items()}
    return gm.build_model(cfg, w)


def ids_of(n: int, seed: int = 1, vocab: int = 61) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def full_nll(model, ids):
    """Per-token NLL of ids[0, 1:] from one forward over all of ids (logits of every position)."""
    logits = model(ids)[0, :-1]
    return torch.nn.functional.cross_entropy(logits.double(), ids[0, 1:], reduction="none")


# ----------------------------------------------------------------------------- documents


class CharTok:
    """One token per character (id = code point mod 61), ``<bos>`` (0) first if asked."""

    def __init__(self, bos: bool = False):
        self.bos = bos

    def encode(self, text):
        return type("Enc", (), {"ids": [0] * self.bos + [ord(c) % 61 for c in text]})()


@pytest.fixture
def corpus(tmp_path):
    """A fake standard library: files of known lengths, one in a test folder (excluded)."""
    files = {"a.py": "x" * 50, "b.py": "y" * 30, "pkg/c.py": "z" * 70, "pkg/d.py": "\u00e9" * 20,
             "test/e.py": "w" * 90, "f.txt": "v" * 90, "g.py": b"\xff" * 25}
    for name, body in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return tmp_path


def test_long_documents_selects_sorts_and_hashes(corpus):
    tok = CharTok()
    docs = ld.long_documents(tok, 25, split="all", root=corpus)
    # characters are tokens: a 70, x 50, y 30, g 25 (each invalid byte one U+FFFD), d 20 (too short);
    # test/ and .txt files are not corpus files
    assert [(d.path, d.tokens) for d in docs] == [("pkg/c.py", 70), ("a.py", 50), ("b.py", 30), ("g.py", 25)]
    for d in docs:
        assert d.split == split_of(__import__("pathlib").Path(d.path), 0.1)
        assert d.ids_sha256 == hashlib.sha256(np.asarray(d.ids, dtype="<i8").tobytes()).hexdigest()
        assert d.record() == {"path": d.path, "split": d.split, "bytes": (corpus / d.path).stat().st_size,
                              "tokens": d.tokens, "ids_sha256": d.ids_sha256}
    assert docs[2].ids == tuple(ord("y") % 61 for _ in range(30))
    # the byte prefilter keeps a file whose characters are multi-byte (d: 20 characters, 40 bytes)
    assert [d.path for d in ld.long_documents(tok, 20, split="all", root=corpus)][-1] == "pkg/d.py"
    # a <bos> counts: b (30 + 1) passes 31, not 32
    assert [d.path for d in ld.long_documents(CharTok(bos=True), 31, split="all", root=corpus)][-1] == "b.py"
    # the splits partition "all"
    by_split = {s: {d.path for d in ld.long_documents(tok, 2, split=s, root=corpus)} for s in ("val", "train")}
    assert by_split["val"] | by_split["train"] == {d.path for d in ld.long_documents(tok, 2, split="all", root=corpus)}
    assert not by_split["val"] & by_split["train"]
    assert [d.path for d in ld.long_documents(tok, 25, split="all", root=corpus, exclude=["pkg/*", "b*"])] == [
        "a.py", "g.py"]
    with pytest.raises(TypeError, match="exclude must be a sequence of fnmatch patterns"):
        ld.long_documents(tok, 25, root=corpus, exclude="pkg/*")
    rec = ld.documents_record(docs, min_tokens=25, split="all", tokenizer="char", root=corpus)
    assert rec["documents"] == [d.record() for d in docs] and rec["min_tokens"] == 25 and rec["root"] == str(corpus)


def test_long_documents_and_head_reject_bad_input(corpus):
    tok = CharTok()
    with pytest.raises(TypeError, match="tokenizer must be a tokenizers.Tokenizer"):
        ld.long_documents(object(), 10, root=corpus)
    with pytest.raises(ValueError, match="min_tokens must be >= 2, got 1"):
        ld.long_documents(tok, 1, root=corpus)
    with pytest.raises(ValueError, match=r"split must be one of \['val', 'train', 'all'\], got 'test'"):
        ld.long_documents(tok, 10, split="test", root=corpus)
    with pytest.raises(ValueError, match=r"val_fraction must lie in \(0, 1\), got 1.0"):
        ld.long_documents(tok, 10, root=corpus, val_fraction=1.0)
    doc = ld.long_documents(tok, 25, split="all", root=corpus)[0]
    assert torch.equal(doc.head(5), torch.tensor([doc.ids[:5]]))
    with pytest.raises(IndexError, match=r"length must be at most the document's 70 tokens \(pkg/c.py\), got 71"):
        doc.head(71)
    with pytest.raises(ValueError, match="length must be >= 2, got 1"):
        doc.head(1)


# ----------------------------------------------------------------------------- passes


def test_sliding_nll_against_a_brute_force_loop():
    model = tiny_llama()
    ids = ids_of(40)
    context = 8
    # S = 1: each target t is the last of its own pass over the `context` tokens ending at it
    exact = ld.sliding_nll(model, ids, 8, 40, context, 1)
    brute = torch.stack([model.token_nll(ids[:, t + 1 - context:t + 1])[0, -1] for t in range(8, 40)])
    assert (exact - brute).abs().max() <= TOL
    # S = 3: targets of a block [a, e) in one pass over ids[e - context : e]
    blocked = ld.sliding_nll(model, ids, 8, 40, context, 3)
    want = []
    for a in range(8, 40, 3):
        e = min(a + 3, 40)
        nll = model.token_nll(ids[:, e - context:e])[0]
        want += [nll[t - (e - context) - 1] for t in range(a, e)]
    assert (blocked - torch.stack(want)).abs().max() <= TOL
    # each target sees context - (e - t) tokens: not the exact window, by far more than rounding
    assert (blocked - exact).abs().max() > FAR
    # a target before `context` sees every earlier token: a whole prefix pass
    early = ld.sliding_nll(model, ids, 1, 6, context, 2)
    assert (early - full_nll(model, ids[:, :6])).abs().max() <= TOL


def test_sliding_nll_keeps_the_first_tokens_in_every_pass():
    model = tiny_llama()
    ids = ids_of(40)
    context, block = 8, 3
    for keep in (1, 2):
        got = ld.sliding_nll(model, ids, 8, 40, context, block, keep=keep)
        want = []
        for a in range(8, 40, block):
            e = min(a + block, 40)
            # the kept tokens, then the last context - keep tokens up to e: a pass of `context`
            window = ids[:, :e] if e <= context else torch.cat([ids[:, :keep], ids[:, e - context + keep:e]], 1)
            assert window.shape[1] == min(e, context)
            nll = model.token_nll(window)[0]
            want += [nll[window.shape[1] - (e - t) - 1] for t in range(a, e)]
        assert (got - torch.stack(want)).abs().max() <= TOL
        # the kept tokens replace the oldest ones: not the plain sliding window
        assert (got - ld.sliding_nll(model, ids, 8, 40, context, block)).abs().max() > FAR
    # before `context` a pass is the whole prefix, which holds the kept tokens already
    assert (ld.sliding_nll(model, ids, 2, 6, context, 2, keep=1) - full_nll(model, ids[:, :6])[1:]).abs().max() <= TOL
    for keep, match in ((-1, r"keep must lie in \[0, min\(lo, context - block - 1\)\] = \[0, 4\], got -1"),
                        (5, r"= \[0, 4\], got 5")):
        with pytest.raises(ValueError, match=match):
            ld.sliding_nll(model, ids, 8, 40, context, block, keep=keep)
    with pytest.raises(ValueError, match=r"= \[0, 2\], got 3"):  # lo = 2 bounds it
        ld.sliding_nll(model, ids, 2, 40, context, block, keep=3)
    for keep in (True, 1.0):
        with pytest.raises(TypeError, match="keep must be an int"):
            ld.sliding_nll(model, ids, 8, 40, context, block, keep=keep)


def test_sliding_nll_rejects_bad_sizes():
    model, ids = tiny_llama(), ids_of(20)
    for args, match in (((0, 10, 8, 1), "lo must be >= 1"), ((5, 5, 8, 1), "lo and hi must satisfy 1 <= lo < hi <= 20"),
                        ((5, 21, 8, 1), "lo and hi must satisfy"), ((5, 10, 1, 1), "context must be >= 2, got 1"),
                        ((5, 10, 8, 8), r"block must lie in \[1, context - 1\] = \[1, 7\], got 8"),
                        ((5, 10, 8, 0), "block must be >= 1, got 0")):
        with pytest.raises(ValueError, match=match):
            ld.sliding_nll(model, ids, *args)
    with pytest.raises(TypeError, match="block must be an int"):
        ld.sliding_nll(model, ids, 5, 10, 8, 2.0)
    with pytest.raises(ValueError, match=r"ids must be a \(1, n\) tensor"):
        ld.sliding_nll(model, ids[0], 5, 10, 8, 2)
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        ld.sliding_nll(model, ids.double(), 5, 10, 8, 2)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma])
def test_tail_nll_one_call_chunked_and_full_agree(make):
    model, ids = make(), ids_of(30)
    want = full_nll(model, ids)
    assert (ld.tail_nll(model, ids, 1) - want).abs().max() <= TOL
    for chunk in (1, 4, 7, 29):
        assert (ld.tail_nll(model, ids, 11, chunk=chunk) - want[10:]).abs().max() <= TOL, chunk
    with pytest.raises(ValueError, match=r"first must lie in \[1, 29\] \(a target after the first token\), got 30"):
        ld.tail_nll(model, ids, 30)
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        ld.tail_nll(model, ids, 1, chunk=0)


def test_frozen_length_fixes_the_dynamic_frequencies_and_restores_them():
    model = tiny_llama(context_length=16)
    ids = ids_of(40)
    cfg = method_config("dynamic", 2.0, 16, 100.0)
    model.set_rope_config(cfg)
    try:
        one = full_nll(model, ids)  # rotate follows max(position) + 1 = 40
        inv40 = model.rope.inv_freq.clone()
        model.set_rope_config(cfg)  # fresh state
        plain = model.rope.inv_freq.clone()
        # chunked without freezing: the first chunks rotate with shorter-length frequencies
        drift = ld.tail_nll(model, ids, 1, chunk=8)
        assert (drift - one).abs().max() > FAR
        model.set_rope_config(cfg)
        with ld.frozen_length(model, 40):
            assert torch.equal(model.rope.inv_freq, inv40) and not model.rope.rope_spec.is_dynamic
            frozen = ld.tail_nll(model, ids, 1, chunk=8)
        assert (frozen - one).abs().max() <= TOL
        assert model.rope.rope_spec.is_dynamic and torch.equal(model.rope.inv_freq, plain)  # reinstalled
        assert not torch.equal(inv40, plain)
    finally:
        model.set_rope_config(None)
    yarn = method_config("yarn", 2.0, 16, 100.0)
    model.set_rope_config(yarn)
    inv = model.rope.inv_freq.clone()
    with ld.frozen_length(model, 40):  # a static config is left alone
        assert torch.equal(model.rope.inv_freq, inv) and model.rope.rope_spec.rope_type == "yarn"
    model.set_rope_config(None)


def test_method_nll_is_the_method_pass_and_restores_plain_rope():
    model = tiny_llama(context_length=16)
    ids = ids_of(32)
    plain = full_nll(model, ids)
    for m in ("none", "pi", "yarn", "dynamic"):
        got, config = ld.method_nll(model, ids, m, chunk=None if m != "dynamic" else 5)
        assert config == method_config(m, 2.0, 16, 100.0)
        model.set_rope_config(config)
        want = full_nll(model, ids)
        model.set_rope_config(None)
        assert (got - want).abs().max() <= TOL, m
        if m != "none":
            assert (got - plain).abs().max() > FAR, m
    from companion.longctx import trainfree_nll

    params = {"rerope_window": 6, "se_window": 6, "se_group": 2, "sink_window": 10, "chunk": 4}
    for m in ("rerope", "leaky_rerope", "self_extend", "sinks"):
        got, config = ld.method_nll(model, ids, m, trainfree=params)
        assert config == trainfree_config(m, params)
        assert torch.equal(got, trainfree_nll(model, ids, config)[0].float())
    assert model.rope.rope_config == {"rope_type": "default", "rope_theta": 100.0}
    assert model.current_attention_mode is None


def test_applied_method_on_gemma_global_or_all_layers():
    model = tiny_gemma()
    local, glob = model.rope_local.inv_freq.clone(), model.rope_global.inv_freq.clone()
    with ld.applied_method(model, "pi", factor=2.0) as config:
        assert config == {"rope_type": "linear", "factor": 2.0}  # no rope_theta: each kind keeps its base
        assert torch.equal(model.rope_local.inv_freq, local)
        torch.testing.assert_close(model.rope_global.inv_freq, glob / 2, rtol=0, atol=0)
    with ld.applied_method(model, "pi", rope_layers="all"):
        torch.testing.assert_close(model.rope_local.inv_freq, local / 2, rtol=0, atol=0)
        torch.testing.assert_close(model.rope_global.inv_freq, glob / 2, rtol=0, atol=0)
    assert torch.equal(model.rope_local.inv_freq, local) and torch.equal(model.rope_global.inv_freq, glob)
    with pytest.raises(ValueError, match="training-free method, which needs companion.llama's attention hooks"):
        with ld.applied_method(model, "rerope"):
            pass
    with pytest.raises(ValueError, match=r"rope_layers must be one of \['global', 'all'\], got 'local'"):
        with ld.applied_method(model, "pi", rope_layers="local"):
            pass
    with pytest.raises(ValueError, match="rope_layers must be 'global' for a Llama model"):
        with ld.applied_method(tiny_llama(), "pi", rope_layers="all"):
            pass
    with pytest.raises(ValueError, match=r"method must be one of \['none', 'pi'"):
        with ld.applied_method(model, "linear"):
            pass
    with pytest.raises(TypeError, match="model must be a companion.llama.LlamaModel or a companion.gemma.GemmaModel"):
        with ld.applied_method(object(), "pi"):
            pass
    # after an error inside, plain RoPE is back
    with pytest.raises(RuntimeError):
        with ld.applied_method(model, "yarn"):
            raise RuntimeError
    assert torch.equal(model.rope_global.inv_freq, glob)


# ----------------------------------------------------------------------------- the measure


def _doc(n=64, seed=3):
    return ld.Document("doc.py", "val", n, tuple(ids_of(n, seed)[0].tolist()))


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma])
def test_same_token_rows_are_the_bucketed_passes(make):
    model = make()
    doc, T = _doc(), 16
    said = []
    methods = ["none", "yarn"]
    rows = ld.same_token_rows(model, doc, T, methods, block=4, bucket=8, progress=said.append)
    assert len(said) == 3 and said[0].startswith("doc.py sliding:")
    for r in rows:
        assert set(r) == set(ld.SAME_TOKEN_FIELDS)
        assert (r["document"], r["ids_sha256"], r["context"], r["tokens"]) == ("doc.py", doc.ids_sha256, T, 2 * T)
    ids = doc.head(2 * T)
    base = [r for r in rows if r["method"] == ld.SLIDING]
    assert [(r["bucket_start"], r["bucket_end"], r["count"]) for r in base] == [(16, 24, 8), (24, 32, 8)]
    assert json.loads(base[0]["rope_config"]) == {"block": 4, "context": 16}
    sliding = ld.sliding_nll(model, ids, T, 2 * T, T, 4)
    assert [float(r["nll_sum"]) for r in base] == [float(sliding[:8].double().sum()), float(sliding[8:].double().sum())]
    for m in methods:
        got = [r for r in rows if r["method"] == m]
        assert [(r["bucket_start"], r["count"]) for r in got] == [(0, 7), (8, 8), (16, 8), (24, 8)]
        nll, config = ld.method_nll(model, ids, m)
        assert json.loads(got[0]["rope_config"]) == config
        for r in got:
            want = float(nll[max(r["bucket_start"] - 1, 0):r["bucket_end"] - 1].double().sum())
            assert abs(float(r["nll_sum"]) - want) <= TOL
        assert len({(r["seconds"], r["cpu_seconds"]) for r in got}) == 1
    # "none" on the first half is plain RoPE seeing everything: the sliding baseline there is
    # the same pass for targets < T, and past T the full window differs from the sliding one
    none = {r["bucket_start"]: float(r["nll_sum"]) for r in rows if r["method"] == "none"}
    assert abs(none[16] - float(base[0]["nll_sum"])) > FAR
    assert rows[-1]["model"] == (model.config.name or type(model).__name__)
    # targets="measured": the methods score [T, 2T) only, the same losses
    measured = ld.same_token_rows(model, doc, T, ["yarn"], block=4, bucket=8, baseline=False, targets="measured")
    full = [r for r in rows if r["method"] == "yarn" and r["bucket_start"] >= T]
    assert [(r["bucket_start"], r["count"]) for r in measured] == [(r["bucket_start"], r["count"]) for r in full]
    for a, b in zip(measured, full):
        assert abs(float(a["nll_sum"]) - float(b["nll_sum"])) <= TOL


def test_same_token_rows_keep_a_documents_bos_in_the_baseline():
    model = tiny_gemma()  # bos_id 2
    T = 16
    body = [t if t != 2 else 3 for t in ids_of(2 * T, seed=5)[0].tolist()]
    with_bos = ld.Document("bos.py", "val", 2 * T, tuple([2] + body[1:]))
    rows = ld.same_token_rows(model, with_bos, T, [], block=4, bucket=8)
    assert json.loads(rows[0]["rope_config"]) == {"block": 4, "context": T, "keep": 1}
    ids = with_bos.head(2 * T)
    for kept, rs in ((1, rows), (0, ld.same_token_rows(model, with_bos, T, [], block=4, bucket=8, keep_bos=False))):
        nll = ld.sliding_nll(model, ids, T, 2 * T, T, 4, keep=kept)
        assert [float(r["nll_sum"]) for r in rs] == [float(nll[:8].double().sum()), float(nll[8:].double().sum())]
    dropped = ld.same_token_rows(model, with_bos, T, [], block=4, bucket=8, keep_bos=False)
    assert json.loads(dropped[0]["rope_config"]) == {"block": 4, "context": T}
    assert abs(float(rows[0]["nll_sum"]) - float(dropped[0]["nll_sum"])) > FAR
    # a document without the BOS token at its start, or a model without one: nothing kept
    no_bos = ld.Document("body.py", "val", 2 * T, tuple(body))
    plain = ld.same_token_rows(model, no_bos, T, [], block=4, bucket=8)
    assert json.loads(plain[0]["rope_config"]) == {"block": 4, "context": T}
    assert tiny_llama().config.bos_id is None
    with pytest.raises(TypeError, match="keep_bos must be a bool"):
        ld.same_token_rows(model, with_bos, T, [], block=4, bucket=8, keep_bos=1)


def test_same_token_rows_rejects_bad_input():
    model, doc = tiny_llama(), _doc(40)
    with pytest.raises(TypeError, match="document must be a Document"):
        ld.same_token_rows(model, "doc.py", 16, ["none"])
    with pytest.raises(ValueError, match=r"bucket must divide context \(16\)"):
        ld.same_token_rows(model, doc, 16, ["none"], bucket=5)
    with pytest.raises(ValueError, match="document doc.py has 40 tokens; the measure at context 32 needs 2 \\* context = 64"):
        ld.same_token_rows(model, doc, 32, ["none"], bucket=8)
    with pytest.raises(ValueError, match="methods must not repeat a method"):
        ld.same_token_rows(model, doc, 16, ["none", "none"], bucket=8)
    with pytest.raises(ValueError, match=r"method must be one of"):
        ld.same_token_rows(model, doc, 16, ["linear"], bucket=8)
    with pytest.raises(TypeError, match="progress must be a callable"):
        ld.same_token_rows(model, doc, 16, ["none"], bucket=8, progress="log")
    with pytest.raises(ValueError, match="targets must be 'all' or 'measured', got 'half'"):
        ld.same_token_rows(model, doc, 16, ["none"], bucket=8, targets="half")


def _rows(docs, buckets, T, values):
    """Same-token rows (as the CSV stores them: strings) from {method: (docs, buckets) means}."""
    out = []
    for m, arr in values.items():
        for i, d in enumerate(docs):
            for j, b in enumerate(buckets):
                out.append({"method": m, "context": str(T), "document": d, "bucket_start": str(b),
                            "nll_sum": repr(float(arr[i][j] * 8)), "count": "8"})
            out.append({"method": m, "context": str(T), "document": d, "bucket_start": "0", "nll_sum": "99.0",
                        "count": "8"})  # the first half: not part of the measure
    return out


def test_context_value_is_the_two_stage_paired_bootstrap():
    rng = np.random.default_rng(0)
    docs, buckets, T = ["a.py", "b.py", "c.py"], [16, 24, 32, 40], 16
    base = rng.normal(3.0, 0.3, (3, 4))
    meth = base - rng.normal(0.1, 0.05, (3, 4))
    rows = _rows(docs, buckets, T, {"sliding": base, "yarn": meth})
    got = ld.context_value(rows, "yarn", T, resamples=500, seed=4)
    want = stats.paired_bootstrap_ci(base, meth, resample_rows=True, resamples=500, seed=4)
    assert got["interval"] == want and (got["documents"], got["buckets"]) == (3, 4)
    assert got["per_document"] == pytest.approx({d: float((base[i] - meth[i]).mean()) for i, d in enumerate(docs)},
                                                rel=1e-12)
    # the rows of another context are not read
    assert ld.context_value(rows + _rows(docs, [8], 8, {"sliding": base[:, :1], "yarn": base[:, :1]}), "yarn", T,
                            resamples=500, seed=4)["interval"] == want
    with pytest.raises(ValueError, match="rows hold no bucket of method 'pi' at context 16"):
        ld.context_value(rows, "pi", T)
    with pytest.raises(ValueError, match="must be scored on the same documents"):
        ld.context_value(rows + _rows(["d.py"], buckets, T, {"sliding": base[:1]}), "yarn", T)
    with pytest.raises(ValueError, match="must have the buckets"):
        ld.context_value([r for r in rows if not (r["method"] == "yarn" and r["bucket_start"] == "40"
                                                   and r["document"] == "a.py")], "yarn", T)
    with pytest.raises(ValueError, match="two rows of method 'yarn' for bucket 16"):
        ld.context_value(rows + rows[-5:-4], "yarn", T)
    with pytest.raises(ValueError, match=r"row\['nll_sum'\] must be a float, got 'x'"):
        ld.context_value([dict(rows[0], nll_sum="x")] + rows[1:], "sliding", T)



def test_bucket_differences_are_the_stored_means_in_document_and_bucket_order():
    rng = np.random.default_rng(1)
    docs, buckets, T = ["b.py", "a.py"], [24, 16, 32], 16
    base, meth = rng.normal(3.0, 0.3, (2, 3)), rng.normal(2.9, 0.3, (2, 3))
    rows = _rows(docs, buckets, T, {"sliding": base, "yarn": meth})
    got_docs, got_buckets, a, b = ld.bucket_differences(rows, "yarn", T)
    assert got_docs == ["a.py", "b.py"] and got_buckets == [16, 24, 32]
    order, cols = [1, 0], [1, 0, 2]  # sorted documents, sorted buckets
    # nll_sum = mean * 8 and count 8: multiplying and dividing by 8 is exact in binary
    assert np.array_equal(a, base[order][:, cols]) and np.array_equal(b, meth[order][:, cols])
    _, _, a2, b2 = ld.bucket_differences(rows, "sliding", T, baseline="yarn")  # roles swap
    assert np.array_equal(a2, b) and np.array_equal(b2, a)
    with pytest.raises(ValueError, match="rows hold no bucket of method 'sliding' at context 8"):
        ld.bucket_differences(rows, "yarn", 8)
    with pytest.raises(ValueError, match="context must be"):
        ld.bucket_differences(rows, "yarn", 1)


def _far_repeats_brute(ids, context, lo, hi, n):
    out = []
    for t in range(lo, hi):
        gram = ids[t - n + 1:t + 1]
        ends = [e for e in range(n - 1, t) if ids[e - n + 1:e + 1] == gram]
        out.append(bool(ends) and all(e < t - context for e in ends))
    return np.array(out, dtype=bool)


def test_far_repeats_marks_what_only_a_long_reader_can_copy():
    # a passage, filler longer than the window, the passage again: its repeat is far
    passage, filler = list(range(100, 120)), [7, 8, 9] * 20
    ids = passage + filler + passage
    far = ld.far_repeats(ids, 40, 3, len(ids), n=4)
    second = len(passage) + len(filler)
    # the first n - 1 tokens of the repeat end n-grams that straddle filler and passage: new
    assert not far[:second - 3].any() and not far[second - 3:second - 3 + 3].any()
    assert far[second - 3 + 3:].all()  # every later token of the repeat continues a far n-gram
    # within reach of the window, the same repeat is near, not far
    assert not ld.far_repeats(ids, 80, 3, len(ids), n=4).any()
    # the filler repeats itself every 3 tokens: near, never far
    assert not far[len(passage):second - 3].any()


@pytest.mark.parametrize("seed", range(5))
def test_far_repeats_against_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(0, 3, size=120)]  # a small alphabet: many repeats
    for context, n in ((5, 2), (20, 3), (40, 4)):
        got = ld.far_repeats(ids, context, n - 1 + 7, 120, n=n)
        assert np.array_equal(got, _far_repeats_brute(ids, context, n - 1 + 7, 120, n)), (context, n)


def test_far_repeats_rejects_bad_input():
    ids = list(range(10))
    with pytest.raises(ValueError, match="lo and hi must satisfy"):
        ld.far_repeats(ids, 4, 0, 10, n=3)          # lo < n - 1
    with pytest.raises(ValueError, match="lo and hi must satisfy"):
        ld.far_repeats(ids, 4, 5, 11)               # hi beyond ids
    with pytest.raises(ValueError, match="context"):
        ld.far_repeats(ids, 0, 8, 10)
    with pytest.raises(ValueError, match="n "):
        ld.far_repeats(ids, 4, 8, 10, n=0)
    with pytest.raises(TypeError, match="ids must be a sequence of int"):
        ld.far_repeats("abcdefghij", 4, 8, 10)
    with pytest.raises(TypeError, match="ids must be a sequence of int"):
        ld.far_repeats([1.0] * 10, 4, 8, 10)
