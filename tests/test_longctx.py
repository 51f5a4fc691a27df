"""companion.longctx: the chapter-10 experiments (perplexity by position, passkey retrieval).

The pure parts (configs, buckets, summaries, windows) are tested on synthetic data. The parts
that run SmolLM2-135M use short sequences (<= 1024 tokens) and module-scoped fixtures; they
are skipped, with the fetch command in the reason, when the GGUF file is not cached.
"""

import hashlib
import json
import math
import random
import re
import time

import numpy as np
import pytest
import torch

from companion import llama, longctx
from companion import pretrained as pt
from companion.rope import RotaryEmbedding
from companion.scaling import compute_inv_freq
from companion.utils import load_csv, load_result

MODEL = pt.cached_smollm2_path()
needs_model = pytest.mark.skipif(
    not MODEL.is_file(),
    reason=f"SmolLM2 GGUF not cached at {MODEL}; run `python -m companion.pretrained fetch`",
)

# float32 and float64 unit roundoffs
U32, U64 = 2.0**-24, 2.0**-53

BASE, NATIVE, HEAD_DIM = 100000.0, 8192, 64  # SmolLM2-135M's RoPE


# ----------------------------------------------------------------------------- method_config


def test_method_config_dicts():
    assert longctx.method_config("none", 2.0, NATIVE, BASE) is None
    common = {"rope_theta": BASE, "factor": 2.0}
    expected = {
        "pi": {**common, "rope_type": "linear"},
        "ntk": {**common, "rope_type": "ntk"},
        "dynamic": {**common, "rope_type": "dynamic"},
        "yarn": {**common, "rope_type": "yarn", "original_max_position_embeddings": NATIVE},
        "llama3": {**common, "rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": NATIVE},
    }
    assert set(expected) | {"none"} == set(longctx.METHODS)
    for method, want in expected.items():
        got = longctx.method_config(method, 2, NATIVE, 100000)  # ints in, floats out
        assert got == want, method
        assert type(got["factor"]) is float and type(got["rope_theta"]) is float
    # a fresh dict each call: editing one result cannot change the next
    a = longctx.method_config("yarn", 2.0, NATIVE, BASE)
    a["factor"] = 9.0
    assert longctx.method_config("yarn", 2.0, NATIVE, BASE)["factor"] == 2.0
    # factor 1 is allowed (no extension)
    assert longctx.method_config("pi", 1.0, NATIVE, BASE)["factor"] == 1.0


def test_method_config_rejects_bad_input():
    with pytest.raises(ValueError, match=r"method must be one of \['none', 'pi'"):
        longctx.method_config("linear", 2.0, NATIVE, BASE)
    with pytest.raises(ValueError, match="factor must be >= 1, got 0.5"):
        longctx.method_config("pi", 0.5, NATIVE, BASE)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="factor must be a finite number"):
            longctx.method_config("yarn", bad, NATIVE, BASE)
    with pytest.raises(TypeError, match="factor must be a finite number"):
        longctx.method_config("yarn", "2", NATIVE, BASE)
    with pytest.raises(ValueError, match="original must be >= 1, got 0"):
        longctx.method_config("yarn", 2.0, 0, BASE)
    with pytest.raises(TypeError, match="original must be an int"):
        longctx.method_config("yarn", 2.0, 8192.0, BASE)
    with pytest.raises(ValueError, match="base must be a finite number"):
        longctx.method_config("ntk", 2.0, NATIVE, float("nan"))
    # "none" validates its arguments too, although it returns None
    with pytest.raises(ValueError, match="factor must be >= 1"):
        longctx.method_config("none", 0.5, NATIVE, BASE)


def _inv(cfg, seq_len=None):
    inv, attn = compute_inv_freq(cfg, HEAD_DIM, max_position_embeddings=NATIVE, seq_len=seq_len)
    assert inv.dtype == torch.float32 and inv.shape == (HEAD_DIM // 2,)
    return inv.double(), attn


def _plain64(base):
    """1 / base**(2i/d) in float64."""
    i = np.arange(HEAD_DIM // 2, dtype=np.float64)
    return torch.from_numpy(1.0 / base ** (2 * i / HEAD_DIM))


def _close(got, want, ulps):
    """Relative distance within ``ulps`` float32 roundoffs, elementwise."""
    return bool(((got - want).abs() <= ulps * U32 * want.abs()).all())


# Tolerance of the frequency checks: compute_inv_freq works in float32. Each frequency is
# base**(2i/d) (the base rounded to float32: <= 1 u relative, not amplified since 2i/d < 1;
# powf: <= 1 ulp = 2 u), then a reciprocal (1 u), a division by s (1 u) and, for the blends,
# a weighted sum of two such values with a rounded weight (a few u). 16 u covers all of that;
# a wrong formula is off by a factor of s in some frequency (50% at s = 2).
ULPS = 16


@pytest.mark.parametrize("s", [2.0, 3.0])
def test_method_configs_give_the_documented_frequencies(s):
    d, b, L = HEAD_DIM, BASE, NATIVE
    default = _plain64(b)
    cfg = {m: longctx.method_config(m, s, L, b) for m in longctx.METHODS if m != "none"}

    inv, attn = _inv(cfg["pi"])
    assert _close(inv, default / s, ULPS) and attn == 1.0

    inv, attn = _inv(cfg["ntk"])
    ntk = _plain64(b * s ** (d / (d - 2)))
    assert _close(inv, ntk, ULPS) and attn == 1.0
    assert inv[0] == 1.0 and _close(inv[-1:], default[-1:] / s, ULPS)  # theta_0 kept, the lowest / s

    # Dynamic NTK: plain RoPE up to the native length, then HuggingFace's base
    # b * ((s * n / L) - (s - 1)) ** (d / (d - 2)) at n = 16384.
    plain32, _ = _inv({"rope_type": "default", "rope_theta": b})
    for n in (None, 1, 256, L):
        inv, attn = _inv(cfg["dynamic"], n)
        assert torch.equal(inv, plain32) and attn == 1.0, n  # the same float32 computation
    n = 2 * L
    inv16k, attn = _inv(cfg["dynamic"], n)
    dyn = _plain64(b * ((s * n / L) - (s - 1)) ** (d / (d - 2)))
    assert _close(inv16k, dyn, ULPS) and attn == 1.0
    # the lowest frequency is divided by exactly s n / L - (s - 1) (3 at s = 2, 5 at s = 3)
    assert _close(inv16k[-1:], default[-1:] / (s * n / L - (s - 1)), ULPS)

    # YaRN: HF's ramp between the dims of beta_fast = 32 and beta_slow = 1 rotations over L,
    # frequencies kept below it, divided by s above it; attention factor 0.1 ln s + 1.
    inv, attn = _inv(cfg["yarn"])
    assert math.isclose(attn, 0.1 * math.log(s) + 1.0, rel_tol=1e-15)

    def correction_dim(rotations):
        return d * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(b))

    low, high = math.floor(correction_dim(32)), math.ceil(correction_dim(1))
    assert (low, high) == (10, 20)  # for SmolLM2's base and context: a real ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    yarn = default / s * ramp + default * (1 - ramp)
    assert _close(inv, yarn, ULPS)
    assert torch.equal(inv[:low + 1], plain32[:low + 1])  # ramp 0: the original frequencies

    # Llama 3.1 with low_freq_factor 1, high_freq_factor 4 over L: wavelengths above L are
    # divided by s, those below L / 4 kept, and in between blended by L / wavelength.
    inv, attn = _inv(cfg["llama3"])
    wavelen = 2 * math.pi / default
    smooth = ((L / wavelen - 1.0) / (4.0 - 1.0)).clamp(0, 1)
    llama3 = default / s * (1 - smooth) + default * smooth
    assert _close(inv, llama3, ULPS) and attn == 1.0
    assert (wavelen > L).any() and (wavelen < L / 4).any() and ((wavelen > L / 4) & (wavelen < L)).any()


def test_dynamic_frequencies_depend_on_the_length_beyond_the_native_context():
    """Why causality cannot hold for Dynamic NTK past 8192 tokens: the whole pass's length
    sets the base, so a longer pass rotates its first tokens with other frequencies."""
    cfg = longctx.method_config("dynamic", 2.0, NATIVE, BASE)
    at_8k, _ = _inv(cfg, NATIVE)
    at_16k, _ = _inv(cfg, 2 * NATIVE)
    assert at_8k[0] == at_16k[0] == 1.0
    assert (at_16k[1:] < at_8k[1:]).all()
    assert (at_8k[-1] / at_16k[-1]).item() == pytest.approx(3.0, rel=ULPS * U32)
    # the rotary module that the model uses follows the length of each call
    rope = RotaryEmbedding(HEAD_DIM, rope_config=cfg, max_position_embeddings=NATIVE)
    q = torch.randn(1, 1, 1, HEAD_DIM)
    rope.rotate(q, q, torch.tensor([NATIVE - 1]), torch.tensor([NATIVE - 1]))
    assert torch.equal(rope.inv_freq.double(), at_8k)
    rope.rotate(q, q, torch.tensor([2 * NATIVE - 1]), torch.tensor([2 * NATIVE - 1]))
    assert torch.equal(rope.inv_freq.double(), at_16k)


# ----------------------------------------------------------------------------- buckets and summaries


def _fsum_bound(values):
    """A float64 sum of n terms is within (n - 1) u64 sum|x| of the exact sum."""
    return max(len(values) - 1, 0) * U64 * math.fsum(abs(v) for v in values)


@pytest.mark.parametrize("length,bucket", [(256, 64), (300, 64), (65, 64), (64, 64), (2, 64), (129, 1), (10, 7)])
def test_bucket_rows_against_a_direct_loop(length, bucket):
    gen = torch.Generator().manual_seed(length * 1000 + bucket)
    nll = torch.rand(length - 1, generator=gen, dtype=torch.float32) * 10  # nll[i]: target i + 1
    rows = longctx._bucket_rows(nll, bucket)
    # the direct loop: target position t (1 .. L-1) falls in bucket t // bucket
    n_buckets = -(-length // bucket)
    values = [[] for _ in range(n_buckets)]
    for t in range(1, length):
        values[t // bucket].append(float(nll[t - 1]))  # float32 -> exact float64
    assert [(r[0], r[1]) for r in rows] == [(j * bucket, min((j + 1) * bucket, length)) for j in range(n_buckets)]
    assert [r[3] for r in rows] == [len(v) for v in values]
    assert sum(r[3] for r in rows) == length - 1  # every target once
    assert rows[0][3] == min(bucket, length) - 1  # position 0 has no target
    for (_, _, total, _), v in zip(rows, values):
        assert isinstance(total, float)
        # summed in float64: a float32 sum of 64 terms of size ~5 would be off by ~1e-5
        assert abs(total - math.fsum(v)) <= _fsum_bound(v)


def _rows(tokens, bucket, sums, window=0, method="none", seconds=1.5, as_text=True):
    """Bucket rows with given nll sums (the counts follow from the positions)."""
    rows = []
    for j, total in enumerate(sums):
        start, end = j * bucket, min((j + 1) * bucket, tokens)
        count = end - max(start, 1)
        rows.append({"window": window, "window_start": window * tokens, "tokens": tokens, "method": method,
                     "rope_config": "null", "bucket_start": start, "bucket_end": end,
                     "nll_sum": repr(float(total)) if as_text else float(total), "count": count,
                     "seconds": seconds})
    if as_text:  # as load_csv returns them: every value a string
        rows = [{k: str(v) for k, v in r.items()} for r in rows]
    return rows


def test_summarize_against_hand_computations():
    # 4096 tokens in 8 buckets of 512: targets 1..511 in the first bucket, 512 in each other.
    # The sums are dyadic, so every partial sum is exact and the results are bit-equal.
    sums_a = [511 * 2.0, 512 * 2.5, 512 * 1.5, 512 * 2.0, 512 * 3.0, 512 * 2.25, 512 * 2.75, 512 * 3.5]
    sums_b = [511 * 1.0] + [512 * 1.0] * 7
    rows = (_rows(4096, 512, sums_a, window=0, method="none")
            + _rows(4096, 512, sums_b, window=1, method="yarn", seconds=7.0, as_text=False))
    random.Random(0).shuffle(rows)  # the grouping and the sums must not depend on the order
    out = longctx.summarize(rows)
    assert set(out) == {(0, "none"), (1, "yarn")}
    a = out[(0, "none")]
    assert a["first_half"] == math.exp((511 * 2.0 + 512 * 2.5 + 512 * 1.5 + 512 * 2.0) / 2047)
    assert a["second_half"] == math.exp((512 * 3.0 + 512 * 2.25 + 512 * 2.75 + 512 * 3.5) / 2048)
    assert a["last"] == math.exp((512 * 2.75 + 512 * 3.5) / 1024)  # the last 1024 positions
    assert a["all"] == math.exp(math.fsum(sums_a) / 4095)
    assert a["seconds"] == 1.5
    b = out[(1, "yarn")]
    assert b["first_half"] == b["second_half"] == b["last"] == b["all"] == math.e and b["seconds"] == 7.0
    # another `last` that falls on an edge: the final 512 positions
    assert longctx.summarize(rows, last=512)[(0, "none")]["last"] == math.exp(3.5)


def test_summarize_rejects_boundaries_off_the_bucket_edges():
    # half = 2048 is not an edge of buckets of 768 (0, 768, 1536, 2304, ...)
    rows = _rows(4096, 768, [1.0] * 6)
    with pytest.raises(ValueError, match=r"tokens / 2 = 2048 is not a bucket edge of window 0 \(none\)"):
        longctx.summarize(rows)
    # the halves are fine but 4096 - 1000 is not an edge
    with pytest.raises(ValueError, match=r"tokens - last = 3096 is not a bucket edge"):
        longctx.summarize(_rows(4096, 512, [1.0] * 8), last=1000)
    # a window shorter than `last`: n - last is negative, never an edge
    with pytest.raises(ValueError, match=r"tokens - last = -512 is not a bucket edge"):
        longctx.summarize(_rows(512, 256, [1.0, 1.0]))


# ----------------------------------------------------------------------------- windows


def test_window_slices_the_stream():
    stream = list(range(1000))
    w = longctx.window(stream, 2, 100)
    assert w.dtype == torch.int64 and w.shape == (1, 100)
    assert w[0].tolist() == list(range(200, 300))
    assert longctx.window(stream, 9, 100)[0, -1].item() == 999  # the last full window
    assert longctx.window(tuple(stream), 0, 2)[0].tolist() == [0, 1]


def test_window_rejects_bad_indices():
    stream = list(range(999))
    with pytest.raises(IndexError, match=r"needs 1000 tokens; the stream has 999, so index must lie in \[0, 8\]"):
        longctx.window(stream, 9, 100)
    with pytest.raises(IndexError, match=r"index must lie in \[0, 0\]"):
        longctx.window(stream, 1, 999)
    with pytest.raises(ValueError, match="index must be >= 0, got -1"):
        longctx.window(stream, -1, 100)
    with pytest.raises(ValueError, match="length must be >= 2, got 1"):
        longctx.window(stream, 0, 1)
    with pytest.raises(TypeError, match="index must be an int"):
        longctx.window(stream, 1.0, 100)


# ----------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return smollm2_gguf      # read once per test process (tests/conftest.py)


@pytest.fixture(scope="module")
def model(smol):
    config, weights, _, _ = smol
    return llama.build_model(config, weights, "half")


@pytest.fixture(scope="module")
def model64(smol, smollm2_weights64):
    """A float64 copy: the reference for the rounding bounds."""
    return llama.build_model(smol[0], smollm2_weights64, "half")


@pytest.fixture(scope="module")
def stream(smol):
    return longctx.token_stream(smol[3])


@pytest.fixture(scope="module")
def template(smol):
    return smol[2]["tokenizer.chat_template"]


def _by_bucket(rows, method):
    return [r for r in rows if r["method"] == method]


@needs_model
def test_token_stream_info(stream):
    ids, info = stream
    assert info["tokens"] == len(ids) > 100_000  # 89 held-out stdlib files
    assert info["ids_sha256"] == hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()
    assert info["files"]["val"] > 0 and "split" in info


def assert_pass_seconds(rows, methods, wall):
    # every bucket of a pass carries that pass's time (rounded to 0.01 s); the passes ran one
    # after another inside the call, so their times add up to at most its wall time
    per_pass = {}
    for r in rows:
        assert isinstance(r["seconds"], float) and r["seconds"] >= 0
        assert per_pass.setdefault(r["method"], r["seconds"]) == r["seconds"], r
    assert list(per_pass) == list(methods)
    assert sum(per_pass.values()) <= wall + 0.005 * len(methods)


@needs_model
def test_evaluate_window_rows_restore_and_causality(model, model64, stream):
    ids = longctx.window(stream[0], 3, 256)
    plain_nll = model.token_nll(ids)[0]  # plain RoPE, before anything is installed
    messages = []
    # yarn last: the restore check below must see a config that changes the tables
    methods = ["none", "dynamic", "yarn"]
    t0 = time.perf_counter()
    rows = longctx.evaluate_window(model, ids, methods, bucket=64, window_index=3, window_start=768,
                                   progress=messages.append)
    wall = time.perf_counter() - t0
    assert len(rows) == 3 * 4 and len(messages) == 3
    assert [m.split(":")[0] for m in messages] == [f"window 3 {m}" for m in methods]
    for r in rows:
        assert set(r) == set(longctx.PPL_FIELDS)
        assert (r["window"], r["window_start"], r["tokens"]) == (3, 768, 256)
        assert json.loads(r["rope_config"]) == longctx.method_config(r["method"], 2.0, NATIVE, BASE)
    assert_pass_seconds(rows, methods, wall)
    assert [(r["bucket_start"], r["bucket_end"], r["count"]) for r in _by_bucket(rows, "none")] == [
        (0, 64, 63), (64, 128, 64), (128, 192, 64), (192, 256, 64)]

    # plain RoPE is back: the same config, tables and losses as before
    assert model.rope.rope_config == {"rope_type": "default", "rope_theta": BASE}
    assert model.rope.attention_scaling == 1.0
    assert torch.equal(model.rope.inv_freq, compute_inv_freq({"rope_type": "default", "rope_theta": BASE}, 64)[0])
    assert torch.equal(model.token_nll(ids)[0], plain_nll)

    # "none" is model.token_nll(ids): the same float32 computation, deterministic on the CPU,
    # so the per-token losses are bit-equal and each bucket's float64 sum is the same sum.
    none = _by_bucket(rows, "none")
    for r in none:
        part = plain_nll[max(r["bucket_start"] - 1, 0):r["bucket_end"] - 1]
        assert float(r["nll_sum"]) == float(part.double().sum())
    # The total: the bucket sums added in Python, against one torch float64 reduction of the
    # 255 losses. Each is within (n - 1) u64 sum|x| of the exact sum (nll >= 0).
    total = sum(float(r["nll_sum"]) for r in none)
    reference = float(plain_nll.double().sum())
    assert abs(total - reference) <= 2 * 254 * U64 * reference
    # Dynamic NTK within the native context is plain RoPE, bit for bit (same frequencies)
    assert [r["nll_sum"] for r in _by_bucket(rows, "dynamic")] == [r["nll_sum"] for r in none]

    # Causality: the first 128 positions of the 256-token pass score their targets exactly
    # as a 128-token pass does. In float32 the two passes round differently (other matrix
    # shapes). Each per-token loss is within about d32 = max |nll32 - nll64| of the float64
    # loss (measured here on the 128-token pass), so the two float32 losses differ by at most
    # about 2 d32 per token (x2 margin: 4 d32), and a bucket of `count` targets by count * 4 d32.
    short = ids[:, :128]
    for m in ("none", "yarn"):
        cfg = longctx.method_config(m, 2.0, NATIVE, BASE)
        model.set_rope_config(cfg)
        model64.set_rope_config(cfg)
        try:
            nll32, nll64 = model.token_nll(short)[0], model64.token_nll(short)[0]
        finally:
            model.set_rope_config(None)
            model64.set_rope_config(None)
        d32 = (nll32.double() - nll64).abs().max().item()
        assert 0 < d32 < 1e-3  # float32 is sane
        b128 = longctx._bucket_rows(nll32, 64)  # the rows evaluate_window makes of the 128-token pass
        b256 = _by_bucket(rows, m)[:2]
        for (start, _, total, count), r256 in zip(b128, b256, strict=True):
            assert (start, count) == (r256["bucket_start"], r256["count"])
            diff = abs(total - float(r256["nll_sum"]))
            print(f"{m} bucket {start}: |256-pass - 128-pass| = {diff:.1e}, bound {count * 4 * d32:.1e}")
            assert diff <= count * 4 * d32, (m, start, diff, d32)
        # the bound is not vacuous: YaRN's frequencies and attention factor move every bucket
        # by more than it (measured: ~20x)
        if m == "yarn":
            for ry, rn in zip(b256, _by_bucket(rows, "none")[:2]):
                assert abs(float(ry["nll_sum"]) - float(rn["nll_sum"])) > ry["count"] * 4 * d32


@needs_model
def test_evaluate_window_restores_plain_rope_after_an_error(model, stream):
    ids = longctx.window(stream[0], 0, 16)

    def fail(message):
        raise RuntimeError("stop: " + message)

    with pytest.raises(RuntimeError, match="stop: window 0 yarn"):
        longctx.evaluate_window(model, ids, ["yarn"], bucket=8, progress=fail)
    assert model.rope.rope_config == {"rope_type": "default", "rope_theta": BASE}
    assert model.rope.attention_scaling == 1.0


@needs_model
def test_evaluate_window_rejects_bad_input(model):
    ids = torch.arange(10)[None]
    with pytest.raises(ValueError, match=r"ids must be a \(1, L\) tensor, got torch.Size\(\[10\]\)"):
        longctx.evaluate_window(model, ids[0], ["none"])
    with pytest.raises(ValueError, match=r"ids must be a \(1, L\) tensor, got torch.Size\(\[2, 5\]\)"):
        longctx.evaluate_window(model, ids.view(2, 5), ["none"])
    with pytest.raises(ValueError, match=r"ids must be a \(1, L\) tensor, got list"):
        longctx.evaluate_window(model, [[1, 2, 3]], ["none"])
    with pytest.raises(ValueError, match=r"methods must be drawn from \['none'.*got 'linear'"):
        longctx.evaluate_window(model, ids, ["none", "linear"])
    with pytest.raises(ValueError, match="bucket must be >= 1, got 0"):
        longctx.evaluate_window(model, ids, ["none"], bucket=0)
    assert model.rope.rope_config == {"rope_type": "default", "rope_theta": BASE}


# ----------------------------------------------------------------------------- passkey


@needs_model
@pytest.mark.parametrize("n_tokens", [300, 565, 1000])
def test_passkey_prompt_shape_and_placement(smol, template, n_tokens):
    tok = smol[3]
    unit = len(tok.encode(longctx.FILLER).ids)  # 25 tokens on its own, 24 inside a run
    key = 48213
    for depth in (0.01, 0.5, 1.0):
        ids = longctx.passkey_prompt(tok, template, n_tokens, depth, key)
        # the most filler that fits: one more unit would pass n_tokens
        assert 0 <= n_tokens - len(ids) < unit, (depth, len(ids))
        text = tok.decode(ids, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n")
        assert text.count("<|im_start|>user\n") == 1 and text.count("<|im_start|>") == 3
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\nThe pass key is")
        assert text.count(str(key)) == 2  # "The pass key is K. Remember it. K is the pass key."
        units = text.count(longctx.FILLER)
        assert units >= 1
        at = text.index(f"The pass key is {key}.")
        before = text[:at].count(longctx.FILLER)
        assert abs(before - units * depth) <= 0.5  # a fraction `depth` of the filler precedes the key
        if depth == 0.01:  # round(units / 100) = 0: the key precedes all the filler
            assert before == 0 and at < text.index(longctx.FILLER)
        if depth == 1.0:  # the key follows all of it
            assert before == units and at > text.rindex(longctx.FILLER)


@needs_model
def test_passkey_prompt_depth_zero(smol, template):
    tok = smol[3]
    ids = longctx.passkey_prompt(tok, template, 300, 0.0, 48213)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.index("The pass key is 48213.") < text.index(longctx.FILLER)


@needs_model
def test_passkey_prompt_rejects_bad_input(smol, template):
    tok = smol[3]
    with pytest.raises(ValueError, match=r"n_tokens must be at least \d+ \(the prompt without filler\), got 50"):
        longctx.passkey_prompt(tok, template, 50, 0.5, 12345)
    for depth in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"depth must"):
            longctx.passkey_prompt(tok, template, 300, depth, 12345)
    with pytest.raises(ValueError, match=r"depth must lie in \[0, 1\], got 1.5"):
        longctx.passkey_prompt(tok, template, 300, 1.5, 12345)
    with pytest.raises(ValueError, match="depth must be a finite number"):
        longctx.passkey_prompt(tok, template, 300, float("nan"), 12345)
    with pytest.raises(ValueError, match="n_tokens must be >= 1"):
        longctx.passkey_prompt(tok, template, 0, 0.5, 12345)
    with pytest.raises(ValueError, match="key must be >= 1"):
        longctx.passkey_prompt(tok, template, 300, 0.5, 0)


@needs_model
def test_passkey_trial_on_short_prompts(model, smol, template):
    tok = smol[3]
    rng = random.Random(10)
    for depth in (0.1, 0.5, 0.9):
        key = rng.randint(10000, 99999)
        ids = longctx.passkey_prompt(tok, template, 300, depth, key)
        answer, ok = longctx.passkey_trial(model, tok, ids, key, max_new_tokens=7)  # " ", 5 digits, one more
        print(f"depth {depth}: key {key}, answer {answer!r}")
        assert ok and str(key) in answer, (depth, key, answer)
    # the same prompt judged against another key: same greedy answer, not correct
    wrong_answer, wrong_ok = longctx.passkey_trial(model, tok, ids, key + 1, max_new_tokens=7)
    assert wrong_answer == answer and wrong_ok is False


class _Echo:
    """A stand-in model whose greedy continuation is a fixed token list."""

    def __init__(self, reply):
        self.reply = reply

    def generate(self, prompt, max_new_tokens):
        return torch.cat([prompt, torch.tensor([self.reply[:max_new_tokens]])], dim=1)


@needs_model
def test_passkey_trial_judges_the_first_number(smol):
    tok = smol[3]
    prompt = tok.encode("What is the pass key? The pass key is").ids
    cases = [(" 12345.", True), (" 12345 and 67890", True), (" 67890, not 12345", False),
             (" 123456", False), (" 1234", False), (" unknown", False)]
    for reply, want in cases:
        reply_ids = tok.encode(reply).ids  # every digit is a token of its own
        answer, ok = longctx.passkey_trial(_Echo(reply_ids), tok, prompt, 12345, max_new_tokens=len(reply_ids))
        assert answer == reply and ok is want, reply


# ----------------------------------------------------------------------------- command line


def _reuse_fixtures(monkeypatch, model, smol, stream):
    """main loads the GGUF and tokenizes the corpus; hand it this module's copies instead
    (the same objects, built by the same functions) to save ~6 s per call."""
    monkeypatch.setattr(longctx, "_load", lambda layout="half": (model, smol[3], smol[2]))
    monkeypatch.setattr(longctx, "token_stream", lambda tokenizer, root=None: stream)


@needs_model
def test_main_ppl_writes_csv_and_json(tmp_path, model, smol, stream, monkeypatch, capsys):
    _reuse_fixtures(monkeypatch, model, smol, stream)
    out, side = tmp_path / "x.csv", tmp_path / "x.json"
    # 1024 tokens in buckets of 512: the halves and the last 1024 positions fall on edges
    argv = ["ppl", "--length", "1024", "--windows", "1", "--methods", "none", "--bucket", "512",
            "--out", str(out), "--json", str(side)]
    assert longctx.main(argv) == 0
    prov, rows = load_csv(out)
    assert prov["command"] == "python -m companion.longctx " + " ".join(argv)
    assert [(r["method"], r["bucket_start"], r["bucket_end"], r["count"]) for r in rows] == [
        ("none", "0", "512", "511"), ("none", "512", "1024", "512")]
    assert all(r["tokens"] == "1024" and r["rope_config"] == "null" for r in rows)
    summary = longctx.summarize(rows)[(0, "none")]
    assert 1.5 < summary["all"] < 30  # stdlib code for a 135M model: ppl ~ 3..10
    data = load_result(side)["data"]
    ids = longctx.window(stream[0], 0, 1024)[0].tolist()
    assert data["windows"][0]["ids_sha256"] == hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()
    assert data["corpus"]["ids_sha256"] == stream[1]["ids_sha256"]
    assert (data["length"], data["bucket"], data["methods"]) == (1024, 512, ["none"])
    assert "quick" not in prov and "quick" not in data  # a real run is not marked
    out_text, err = capsys.readouterr()
    assert "first half" in out_text and "SMOKE RUN" not in out_text
    # progress on stderr: the plan, a line per window and one per pass (none of it on stdout)
    assert err.startswith("ppl: 1 window(s) x 1 method(s) = 1 pass(es) of 1024 tokens")
    assert "window 0 (1 of 1): tokens 0 .. 1023" in err and "[pass 1/1, " in err and "[pass" not in out_text


@needs_model
def test_main_ppl_short_length(tmp_path, model, smol, stream, monkeypatch):
    _reuse_fixtures(monkeypatch, model, smol, stream)
    out = tmp_path / "x.csv"
    argv = ["ppl", "--length", "128", "--windows", "1", "--methods", "none", "--bucket", "32", "--out", str(out),
            "--json", str(tmp_path / "x.json")]
    assert longctx.main(argv) == 0  # the summary's "last" shrinks to half the window
    assert load_csv(out)[0]["command"] == "python -m companion.longctx " + " ".join(argv)


@pytest.fixture
def nothing_loaded(monkeypatch):
    """main must check every flag before it loads the model, the tokenizer or the corpus."""
    def refuse(*args, **kwargs):
        raise AssertionError("main loaded something before checking its arguments")

    for name in ("_load", "token_stream"):
        monkeypatch.setattr(longctx, name, refuse)
    monkeypatch.setattr(torch, "set_num_threads", refuse)


def _usage_error(argv, capsys):
    """main(argv) must end in argparse's usage error: exit status 2, the message on stderr."""
    with pytest.raises(SystemExit) as exc:
        longctx.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m companion.longctx " + argv[0])
    return err


def test_main_rejects_bad_arguments(tmp_path, nothing_loaded, capsys):
    out = str(tmp_path / "x.csv")
    ppl = ["ppl", "--out", out]
    cases = [
        (["--length", "128", "--windows", "0"], "--windows must be >= 1, got 0"),
        (["--length", "1"], "--length must be >= 2, got 1"),
        (["--length", "-256"], "--length must be >= 2, got -256"),
        (["--length", "128"], r"--length must be a multiple of 2 \* --bucket = 512, .* got --length 128"),
        (["--length", "128", "--bucket", "0"], "--bucket must be >= 1, got 0"),
        (["--factor", "0.5"], "--factor must be a finite number >= 1, got 0.5"),
        (["--factor", "nan"], "--factor must be a finite number >= 1, got nan"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--methods", "none", "pi", "none"], "--methods must not repeat a method, got none pi none"),
        (["--methods", "linear"], "argument --methods: invalid choice: 'linear'"),
        (["--length", "1.5"], "argument --length: invalid int value: '1.5'"),
    ]
    for extra, message in cases:
        assert re.search("error: " + message, _usage_error(ppl + extra, capsys)), extra
    assert "error: --out must be a file path, got ''" in _usage_error(["ppl", "--out", ""], capsys)
    assert f"error: --json must be a file path, got the folder {str(tmp_path)!r}" in _usage_error(
        ["ppl", "--out", out, "--json", str(tmp_path)], capsys)
    assert "error: --out must be a file path, got the folder" in _usage_error(["passkey", "--out", str(tmp_path)],
                                                                               capsys)
    passkey = ["passkey", "--out", out]
    cases = [
        (["--depths", "0.5", "1.5"], r"--depths must lie in \[0, 1\], got 1.5"),
        (["--depths", "-0.1"], r"--depths must lie in \[0, 1\], got -0.1"),
        (["--depths", "nan"], r"--depths must lie in \[0, 1\], got nan"),
        (["--factor", "0.5"], "--factor must be a finite number >= 1, got 0.5"),
        (["--factor", "inf"], "--factor must be a finite number >= 1, got inf"),
        (["--lengths", "8192", "0"], "--lengths must be >= 1, got 0"),
        (["--threads", "-1"], "--threads must be >= 1, got -1"),
        (["--native-methods", "none", "none"], "--native-methods must not repeat a method"),
        (["--methods", "rerope"], "argument --methods: invalid choice: 'rerope'"),
        (["--depths", "x"], "argument --depths: invalid float value: 'x'"),
    ]
    for extra, message in cases:
        assert re.search("error: " + message, _usage_error(passkey + extra, capsys)), extra
    assert not (tmp_path / "x.csv").exists()


def _fake_load(monkeypatch, stream_len=1000):
    """A stand-in model, a byte tokenizer and a trivial chat template: enough for the checks
    main makes once the tokenizer exists (nothing may run after them)."""
    class Tok:
        def encode(self, text):
            return type("Encoding", (), {"ids": list(text.encode())})()

    fields = {"tokenizer.chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    monkeypatch.setattr(longctx, "_load", lambda layout="half": (object(), Tok(), fields))
    monkeypatch.setattr(longctx, "token_stream", lambda tokenizer, root=None: ([0] * stream_len, {}))
    monkeypatch.setattr(longctx, "evaluate_window", lambda *a, **k: pytest.fail("a window was evaluated"))
    monkeypatch.setattr(longctx, "passkey_trial", lambda *a, **k: pytest.fail("a trial was run"))


def test_main_checks_what_needs_the_tokenizer_before_any_pass(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "x.csv")
    _fake_load(monkeypatch, stream_len=1000)
    err = _usage_error(["ppl", "--length", "256", "--bucket", "32", "--windows", "4", "--out", out], capsys)
    assert "error: --windows 4 of --length 256 need 1024 tokens; the corpus stream has 1000, so --windows must " \
           "be <= 3" in err
    err = _usage_error(["passkey", "--lengths", "1000", "50", "--out", out], capsys)
    assert re.search(r"error: --lengths 50: n_tokens must be at least \d+ \(the prompt without filler\), got 50", err)
    assert not (tmp_path / "x.csv").exists()


# ----------------------------------------------------------------------------- training-free methods


def test_trainfree_configs_and_reach():
    assert longctx.TRAINFREE_METHODS == ("rerope", "leaky_rerope", "self_extend", "sinks")
    assert not set(longctx.TRAINFREE_METHODS) & set(longctx.METHODS)
    cfgs = {m: longctx.trainfree_config(m) for m in longctx.TRAINFREE_METHODS}
    assert cfgs == {
        "rerope": {"method": "rerope", "window": 4096},
        "leaky_rerope": {"method": "leaky_rerope", "window": 4096, "leak": 4.0},
        "self_extend": {"method": "self_extend", "window": 2048, "group": 4},
        "sinks": {"method": "sinks", "n_sink": 4, "window": 7168, "chunk": 512, "rerotate": True},
    }
    # the defaults keep every relative position below SmolLM2's 8192 trained ones at 16K
    reach = {m: longctx.trainfree_reach(c, 16384) for m, c in cfgs.items()}
    assert reach == {"rerope": 4096.0, "leaky_rerope": 4096 + 12287 / 4, "self_extend": 16383 // 4 + 2048 - 512,
                     "sinks": 4 + 7168 + 512 - 1.0}
    assert max(reach.values()) < NATIVE
    # plain RoPE would reach 16383; without rerotation the sinks do
    no_rot = longctx.trainfree_config("sinks", {"rerotate": False})
    assert longctx.trainfree_reach(no_rot, 16384) == 16383.0
    assert longctx.trainfree_reach(cfgs["sinks"], 1000) == 999.0  # a short pass: its length
    assert longctx.trainfree_config("self_extend", {"se_window": 64, "se_group": 2}) == {
        "method": "self_extend", "window": 64, "group": 2}


def test_trainfree_config_rejects_bad_input():
    with pytest.raises(ValueError, match=r"method must be one of \['rerope'.*got 'yarn'"):
        longctx.trainfree_config("yarn")
    with pytest.raises(ValueError, match=r"params has unknown keys \['window'\]"):
        longctx.trainfree_config("rerope", {"window": 3})
    bad = [("rerope", "rerope_window", 0, "rerope_window must be >= 1, got 0"),
           ("leaky_rerope", "leak", 1.0, "leak must be a finite number > 1, got 1.0"),
           ("self_extend", "se_window", 0, "se_window must be >= 1, got 0"),
           ("self_extend", "se_group", 0, "se_group must be >= 1, got 0"),
           ("sinks", "sinks", -1, "sinks must be >= 0, got -1"),
           ("sinks", "sink_window", 0, "sink_window must be >= 1, got 0"),
           ("sinks", "chunk", 0, "chunk must be >= 1, got 0")]
    for method, key, value, message in bad:
        with pytest.raises(ValueError, match=message):
            longctx.trainfree_config(method, {key: value})
    with pytest.raises(TypeError, match="rerotate must be a bool"):
        longctx.trainfree_config("sinks", {"rerotate": "no"})


@needs_model
def test_evaluate_window_trainfree_rows(model, stream):
    from companion.trainfree import ReRoPE, stream_nll

    ids = longctx.window(stream[0], 2, 128)
    params = {"rerope_window": 32, "se_window": 32, "se_group": 2, "sink_window": 48, "chunk": 16}
    methods = ["rerope", "sinks"]
    t0 = time.perf_counter()
    rows = longctx.evaluate_window(model, ids, methods, bucket=64, window_index=2, window_start=256,
                                   trainfree=params)
    wall = time.perf_counter() - t0
    assert len(rows) == 2 * 2
    assert_pass_seconds(rows, methods, wall)
    for r in rows:
        assert set(r) == set(longctx.PPL_FIELDS)
        assert json.loads(r["rope_config"]) == longctx.trainfree_config(r["method"], params)
    # the rows are the bucketed losses of the documented passes (same float32 computations)
    with model.attention_mode(ReRoPE(32)):
        want = model.token_nll(ids)[0]
    got = _by_bucket(rows, "rerope")
    assert [float(r["nll_sum"]) for r in got] == [float(want[:63].double().sum()), float(want[63:].double().sum())]
    sinks = stream_nll(model, ids, 4, 48, 16)[0]
    assert [float(r["nll_sum"]) for r in _by_bucket(rows, "sinks")] == [
        float(sinks[:63].double().sum()), float(sinks[63:].double().sum())]
    assert model.current_attention_mode is None
    assert model.rope.rope_config == {"rope_type": "default", "rope_theta": BASE}


@needs_model
def test_main_ppl_trainfree_methods(tmp_path, model, smol, stream, monkeypatch):
    _reuse_fixtures(monkeypatch, model, smol, stream)
    out, side = tmp_path / "t.csv", tmp_path / "t.json"
    argv = ["ppl", "--length", "128", "--windows", "1", "--bucket", "32", "--methods", "none", "leaky_rerope",
            "self_extend", "sinks", "--rerope-window", "32", "--leak", "2", "--se-window", "16", "--se-group", "2",
            "--sinks", "2", "--sink-window", "40", "--chunk", "32", "--no-rerotate",
            "--out", str(out), "--json", str(side)]
    assert longctx.main(argv) == 0
    _, rows = load_csv(out)
    assert [r["method"] for r in rows[::4]] == ["none", "leaky_rerope", "self_extend", "sinks"]
    assert json.loads(_by_bucket(rows, "sinks")[0]["rope_config"]) == {
        "method": "sinks", "n_sink": 2, "window": 40, "chunk": 32, "rerotate": False}
    data = load_result(side)["data"]
    assert data["trainfree"] == {
        "leaky_rerope": {"method": "leaky_rerope", "window": 32, "leak": 2.0, "reach": 32 + 95 / 2},
        "self_extend": {"method": "self_extend", "window": 16, "group": 2, "reach": 127 // 2 + 16 - 8},
        "sinks": {"method": "sinks", "n_sink": 2, "window": 40, "chunk": 32, "rerotate": False, "reach": 127.0}}
    assert set(data["seconds_per_pass"]) == {"none", "leaky_rerope", "self_extend", "sinks"}
    # one window: each method's one pass time is the one its rows carry, and the passes add up
    # to at most the command's measured total
    methods = ["none", "leaky_rerope", "self_extend", "sinks"]
    assert data["seconds_per_pass"] == {m: [float(_by_bucket(rows, m)[0]["seconds"])] for m in methods}
    assert_pass_seconds([{**r, "seconds": float(r["seconds"])} for r in rows], methods, data["seconds"])
    summary = longctx.summarize(rows, last=64)
    assert set(summary) == {(0, m) for m in ("none", "leaky_rerope", "self_extend", "sinks")}
    # the first chunk of the stream (targets 1 .. 31, the first bucket) sees everything: the
    # plain model's losses to float32 rounding (far below the 1e-3 relative bound)
    none, sinks = _by_bucket(rows, "none"), _by_bucket(rows, "sinks")
    assert abs(float(none[0]["nll_sum"]) - float(sinks[0]["nll_sum"])) < 1e-3 * float(none[0]["nll_sum"])


def test_main_rejects_bad_trainfree_arguments(tmp_path, nothing_loaded, capsys):
    out = str(tmp_path / "x.csv")
    base = ["ppl", "--length", "128", "--bucket", "32", "--out", out, "--methods"]
    cases = [(["leaky_rerope", "--leak", "1"], "--leak must be a finite number > 1, got 1.0"),
             (["leaky_rerope", "--leak", "nan"], "--leak must be a finite number > 1, got nan"),
             (["self_extend", "--se-group", "0"], "--se-group must be >= 1, got 0"),
             (["self_extend", "--se-window", "-4"], "--se-window must be >= 1, got -4"),
             (["sinks", "--chunk", "0"], "--chunk must be >= 1, got 0"),
             (["sinks", "--sinks", "-1"], "--sinks must be >= 0, got -1"),
             (["sinks", "--sink-window", "0"], "--sink-window must be >= 1, got 0"),
             (["rerope", "--rerope-window", "0"], "--rerope-window must be >= 1, got 0"),
             # a flag of a method not chosen is checked too: a bad value never passes silently
             (["none", "--leak", "0.5"], "--leak must be a finite number > 1, got 0.5")]
    for extra, message in cases:
        assert "error: " + message in _usage_error(base + extra, capsys), extra
    assert not (tmp_path / "x.csv").exists()


def test_trainfree_configs_are_checked_where_they_are_read():
    """A hand-written config gets a ValueError naming the key, not a KeyError."""
    good = longctx.trainfree_config("self_extend")
    assert longctx.trainfree_reach(dict(good), 4096) == longctx.trainfree_reach(good, 4096)
    with pytest.raises(ValueError, match=r"config\['method'\] must be one of \['rerope', .*'sinks'\], got 'yarn'"):
        longctx.trainfree_reach({"method": "yarn"}, 4096)
    with pytest.raises(ValueError, match=r"config\['method'\] must be one of .*got None"):
        longctx.trainfree_reach({"window": 8}, 4096)
    with pytest.raises(ValueError, match=r"config for method 'self_extend' must have the keys \['method', "
                                         r"'window', 'group'\] .*got \['method', 'window'\]"):
        longctx.trainfree_reach({"method": "self_extend", "window": 8}, 4096)
    with pytest.raises(ValueError, match=r"config\['group'\] must be >= 1, got 0"):
        longctx.trainfree_reach({"method": "self_extend", "window": 8, "group": 0}, 4096)
    with pytest.raises(TypeError, match="config must be a mapping"):
        longctx.trainfree_reach("rerope", 4096)
    with pytest.raises(ValueError, match=r"config for method 'sinks' must have the keys"):
        longctx.trainfree_nll(None, None, {"method": "sinks", "n_sink": 4})
    with pytest.raises(ValueError, match=r"method must be one of \['rerope'.*got 3"):
        longctx.trainfree_config(3)
    with pytest.raises(TypeError, match="params must be a mapping"):
        longctx.trainfree_config("rerope", [("rerope_window", 3)])


def test_evaluate_window_rejects_repeated_methods():
    """A method twice would store its rows twice, and summarize would sum them together
    (checked before the model is touched, so no model is needed here)."""
    with pytest.raises(ValueError, match=r"methods must not repeat a method, got \['none', 'rerope', 'none'\]"):
        longctx.evaluate_window(None, torch.arange(10)[None], ["none", "rerope", "none"])


# ----------------------------------------------------------------------------- bad input (issue 29)


def test_method_config_base_must_exceed_one():
    for bad, exc, got in ((1.0, ValueError, "1.0"), (1, ValueError, "1"), (0.5, ValueError, "0.5"), (math.nan, ValueError, "nan"),
                          ("1e4", TypeError, "str '1e4'"), (True, TypeError, "bool True")):
        for method in ("none", "pi", "yarn"):
            with pytest.raises(exc, match=rf"base must be a finite number > 1, got {got}"):
                longctx.method_config(method, 2.0, NATIVE, bad)
    assert longctx.method_config("pi", 2.0, NATIVE, 1.5)["rope_theta"] == 1.5


def test_summarize_checks_last_and_rows():
    rows = _rows(512, 128, [1.0, 2.0, 3.0, 4.0])
    for bad, exc, match in ((0, ValueError, "last must be >= 1, got 0"), (-128, ValueError, "last must be >= 1, got -128"),
                            (True, TypeError, "last must be an int, got bool"), ("128", TypeError, "last must be an int, got str"),
                            (128.0, TypeError, "last must be an int, got float")):
        with pytest.raises(exc, match=match):
            longctx.summarize(rows, last=bad)
    for key in ("window", "method", "tokens", "bucket_start", "nll_sum", "count", "seconds"):
        broken = [dict(r) for r in rows]
        del broken[2][key]
        with pytest.raises(ValueError, match=rf"rows\[2\] lacks the key\(s\) \['{key}'\]; bucket rows .* have the keys"):
            longctx.summarize(broken, last=128)
    with pytest.raises(ValueError, match=r"rows\[0\] lacks the key\(s\) \['method', 'tokens'"):
        longctx.summarize([{"window": 0}])
    with pytest.raises(ValueError, match=r"rows\[1\]\['nll_sum'\] must be a number, got 'abc'"):
        longctx.summarize([rows[0], {**rows[1], "nll_sum": "abc"}, *rows[2:]], last=128)
    for bad in ("rows", {"window": 0}, None, 3):
        with pytest.raises(TypeError, match=rf"rows must be a sequence of bucket rows \(mappings\), got {type(bad).__name__}"):
            longctx.summarize(bad)
    with pytest.raises(TypeError, match=r"rows\[1\] must be a mapping \(a bucket row\), got str"):
        longctx.summarize([rows[0], "x"])
    # valid rows still give the hand-computed perplexity of the last 128 positions
    assert longctx.summarize(rows, last=128)[(0, "none")]["last"] == math.exp(4.0 / 128)
    assert longctx.summarize([]) == {}


def _tiny_llama():
    config = llama.LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=16,
                               head_dim=8, rope_base=1e4, norm_eps=1e-5, context_length=16)
    torch.manual_seed(0)
    return llama.LlamaModel(config).eval()


def test_evaluate_window_progress_must_be_callable():
    model, ids = _tiny_llama(), torch.arange(8)[None]
    for bad in ("log", 3, True):
        with pytest.raises(TypeError, match=rf"progress must be a callable taking a string \(such as print\) or None, "
                                            rf"got {type(bad).__name__}"):
            longctx.evaluate_window(model, ids, ["none"], bucket=4, progress=bad)
    said = []
    rows = longctx.evaluate_window(model, ids, ["none"], bucket=4, progress=said.append)
    assert len(said) == 1 and said[0].startswith("window 0 none: ")
    nll = model.token_nll(ids)[0].double()
    assert [r["count"] for r in rows] == [3, 4] and float(rows[1]["nll_sum"]) == pytest.approx(float(nll[3:].sum()), rel=1e-6)


class _Recorder:
    """A model stand-in that records the prompt and answers with fixed tokens."""

    def __init__(self, reply):
        self.reply, self.prompts = reply, []

    def generate(self, prompt, max_new_tokens):
        self.prompts.append(prompt)
        return torch.cat([prompt, torch.tensor([self.reply[:max_new_tokens]])], dim=1)


class _DigitTokenizer:
    def decode(self, ids):
        return "".join(str(i) for i in ids)


def test_passkey_trial_checks_key_and_ids():
    model, tok = _Recorder([1, 2, 3, 4, 5]), _DigitTokenizer()
    for bad, exc, match in (("12345", TypeError, "key must be an int, got str"), (12345.0, TypeError, "key must be an int, got float"),
                            (True, TypeError, "key must be an int, got bool"), (0, ValueError, "key must be >= 1, got 0")):
        with pytest.raises(exc, match=match):
            longctx.passkey_trial(model, tok, [3, 4], bad, 5)
    for bad, exc, match in (([0.5, 1.5], TypeError, "ids must hold integers .* got dtype torch.float32; token ids are never floating point"),
                            (torch.tensor([1.0, 2.0]), TypeError, "ids must hold integers"),
                            (None, TypeError, "ids must be an integer tensor of token ids, got None"),
                            ([[1, 2]], ValueError, r"ids must have shape \(seq,\), got \(1, 2\)")):
        with pytest.raises(exc, match=match):
            longctx.passkey_trial(model, tok, bad, 12345, 5)
    assert model.prompts == []  # nothing was generated for a bad call
    assert longctx.passkey_trial(model, tok, [3, 4], 12345, 5) == ("12345", True)
    assert longctx.passkey_trial(model, tok, torch.tensor([3, 4], dtype=torch.int32), 1234, 5) == ("12345", False)
    for prompt in model.prompts:
        assert prompt.dtype == torch.int64 and torch.equal(prompt, torch.tensor([[3, 4]]))


# ----------------------------------------------------------------------------- --quick and --quiet (issue 31)


def _parsed(monkeypatch, argv):
    """The arguments main hands to its command (which is not run), and what it printed."""
    seen = {}

    def capture(args, command, error):
        seen.update(vars(args), command=command)
        return 0

    from companion import longctx_runs

    monkeypatch.setattr(longctx, "_cmd_ppl", capture)
    monkeypatch.setattr(longctx, "_cmd_passkey", capture)
    monkeypatch.setattr(longctx_runs, "_cmd_context", capture)  # the second edition's commands
    monkeypatch.setattr(longctx_runs, "_cmd_retrieval", capture)
    assert longctx.main(argv) == 0
    return seen


def test_quick_sets_its_preset_and_explicit_flags_win(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "x.csv")
    plain = _parsed(monkeypatch, ["ppl", "--out", out])
    assert plain["quick"] is False and plain["length"] == 16384 and plain["windows"] == 2
    assert capsys.readouterr().out == ""
    quick = _parsed(monkeypatch, ["ppl", "--quick", "--out", out])
    assert {k: quick[k] for k in longctx.QUICK_PPL} == longctx.QUICK_PPL and quick["quick"] is True
    assert quick["length"] < plain["length"] and quick["windows"] < plain["windows"]
    printed = capsys.readouterr().out
    assert printed.startswith("SMOKE RUN (--quick)") and "not a measurement" in printed
    assert "--quick set --length 512 --windows 1 --bucket 128 --methods none yarn\n" in printed
    # an explicit flag keeps its value, wherever it stands, and the rest of the preset applies
    mixed = _parsed(monkeypatch, ["ppl", "--length", "1024", "--quick", "--out", out])
    assert (mixed["length"], mixed["windows"], mixed["methods"]) == (1024, 1, ["none", "yarn"])
    assert "kept from the command line: --length 1024" in capsys.readouterr().out
    passkey = _parsed(monkeypatch, ["passkey", "--quick", "--out", out])
    assert {k: passkey[k] for k in longctx.QUICK_PASSKEY} == longctx.QUICK_PASSKEY
    assert passkey["command"] == f"python -m companion.longctx passkey --quick --out {out}"


def test_quick_flags_are_still_checked(tmp_path, nothing_loaded, capsys):
    out = str(tmp_path / "x.csv")
    # the preset's length 512 with a bucket of 512 given: the halves are no bucket edges
    assert "error: --length must be a multiple of 2 * --bucket = 1024" in _usage_error(
        ["ppl", "--quick", "--bucket", "512", "--out", out], capsys)


@needs_model
def test_quick_ppl_is_marked_and_quiet_is_quiet(tmp_path, model, smol, stream, monkeypatch, capsys):
    _reuse_fixtures(monkeypatch, model, smol, stream)
    out, side = tmp_path / "q.csv", tmp_path / "q.json"
    # the preset with a shorter window and one method, to stay fast
    argv = ["ppl", "--quick", "--length", "128", "--bucket", "32", "--methods", "none", "--quiet",
            "--out", str(out), "--json", str(side)]
    assert longctx.main(argv) == 0
    prov, rows = load_csv(out)
    assert prov["quick"] is True and prov["command"] == "python -m companion.longctx " + " ".join(argv)
    assert len(rows) == 4 and {r["tokens"] for r in rows} == {"128"}
    assert load_result(side)["data"]["quick"] is True
    printed, err = capsys.readouterr()
    assert err == ""  # --quiet: no progress
    assert f'SMOKE RUN (--quick): small settings to try the command, not a measurement: {out} records "quick": true' \
        in printed and "first half" in printed
