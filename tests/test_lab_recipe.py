"""Chapter 13's engine (issue 32): the per-layer position plan, attention temperature, the RoPE
base bounds, ABF, the published-recipes data and the lab runs of :mod:`companion.lab.recipe_lab`.

The plan is checked against an independent forward pass written out here (HuggingFace's RoPE
formulas from tests/helpers.py, masks and temperatures from their definitions, an explicit
softmax), forward and backward; the temperature against transformers' Llama 4 attention where
transformers is installed; the bounds against the numbers their papers print and against
direct sums.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from companion import recipe
from companion.alibi import ALiBi
from companion.attention import NoPE, attention
from companion.lab import TrainConfig, load_corpus, train
from companion.lab import recipe_lab
from companion.lab.extend import method_config
from companion.lab.schemes import (LAYER_PLANS, build_scheme, layer_plan_for, rope_base_name, rope_base_of,
                                   scheme_label)
from companion.lab.sweep import checkpoint_path
from companion.lab.train import build_model
from companion.model import AttentionTemperature, LayerPosition, MultiHeadAttention, TinyDecoder
from companion.rope import RotaryEmbedding
from companion.scaling import compute_inv_freq
from companion.utils import load_csv, load_result
from helpers import U32, U64, hf_apply, hf_inv_freq, rand
from test_window import allowed

#: The tiny lab model of tests/test_lab.py, with two layers for the hybrids.
TINY = dict(d_model=16, n_heads=2, n_layers=2, seq_len=32, batch_size=4, max_len=128)


def bound(length: int, magnitude: float, d: int) -> float:
    """tests/test_dispatch.py's ``C (d + 2 L) eps m`` in float64: two float64 computations of
    the same attention (sums of at most ``d + L`` terms each) differ by a few units of that."""
    return 8 * (d + 2 * length) * torch.finfo(torch.float64).eps * magnitude


# ----------------------------------------------------------------------------- an independent forward


def _visible(n: int, window: int | None, chunk: int | None) -> torch.Tensor:
    """The visibility of self-attention over positions ``0 .. n - 1`` (tests/test_window.py's
    statement of the window and chunk rules)."""
    return allowed(torch.arange(n), torch.arange(n), window, chunk)


def _tau(t: AttentionTemperature | None, n: int) -> torch.Tensor:
    """The temperature's definition, position by position, in float64 (math, not torch)."""
    if t is None:
        return torch.ones(n, dtype=torch.float64)
    vals = []
    for p in range(n):
        if t.form == "llama4":
            vals.append(1 + t.strength * math.log(1 + (p + 1) // t.length))
        elif t.form == "log-n":
            vals.append(max(1.0, math.log(p + 1) / math.log(t.length)))
        elif t.form == "log-n-all":
            vals.append(math.log(p + 1) / math.log(t.length))
        else:
            vals.append(t.strength)
    return torch.tensor(vals, dtype=torch.float64)


def manual_forward(model: TinyDecoder, idx: torch.Tensor) -> torch.Tensor:
    """TinyDecoder's forward pass written out from its plan, without companion's attention or
    RoPE code: HuggingFace's RoPE (tests/helpers.py) at each layer's base, the masks and
    temperatures from their definitions, an explicit softmax."""
    b, n = idx.shape
    x = model.tok(idx)
    pos = torch.arange(n)
    for block, lp in zip(model.blocks, model.layer_plan):
        attn = block.attn
        h, d = attn.n_heads, attn.head_dim
        y = block.ln1(x)
        q = attn.q_proj(y).view(b, n, h, d).transpose(1, 2)
        k = attn.k_proj(y).view(b, n, h, d).transpose(1, 2)
        v = attn.v_proj(y).view(b, n, h, d).transpose(1, 2)
        if lp.scheme in ("rope", "shared"):  # HuggingFace's half-split rotation, float64 angles
            base = 10000.0 if lp.base is None else lp.base
            inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
            angles = pos[:, None].double() * inv[None]
            emb = torch.cat((angles, angles), -1)[None]
            q, k = hf_apply(q, k, emb.cos(), emb.sin())
        q = q * _tau(lp.temperature, n).to(q.dtype)[:, None]
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        logits = logits.masked_fill(~_visible(n, lp.window, lp.chunk), float("-inf"))
        out = torch.softmax(logits, -1) @ v
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, n, h * d))
        x = x + block.mlp(block.ln2(x))
    return model.head(model.ln_f(x))


PLANS = {
    "gemma": (LayerPosition("rope", base=10000.0, window=5), LayerPosition("rope", base=1e6)),
    "irope-temp": (LayerPosition("shared", chunk=4), LayerPosition("nope", temperature=AttentionTemperature("llama4", 3))),
    "log-n": (LayerPosition("rope", base=500.0, window=7, chunk=5),
              LayerPosition("nope", temperature=AttentionTemperature("log-n", 4))),
    "constant": (LayerPosition("nope", temperature=AttentionTemperature("constant", strength=1.7)),
                 LayerPosition("rope", base=3e4, temperature=AttentionTemperature("log-n-all", 6))),
}


def _model(plan, impl="auto", seed=0):
    torch.manual_seed(seed)
    return TinyDecoder(40, 16, 2, 2, scheme=RotaryEmbedding(8), layers=plan, attention_impl=impl).double()


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_matches_an_independent_forward_and_backward(name):
    """Logits and every parameter's gradient of a planned model (the fast path) against the
    forward pass written out above, float64, at a length past the windows and chunks."""
    model = _model(PLANS[name])
    idx = torch.randint(0, 40, (2, 17), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 40, (2, 17), generator=torch.Generator().manual_seed(2))
    got = model(idx)
    want = manual_forward(model, idx)
    m = max(1.0, float(want.detach().abs().max()))
    tol = bound(17, m, 64)  # d_ff = 64 is the longest sum
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    params = [p for p in model.parameters() if p.requires_grad]
    g_got = torch.autograd.grad(torch.nn.functional.cross_entropy(got.flatten(0, 1), target.flatten()), params)
    g_want = torch.autograd.grad(torch.nn.functional.cross_entropy(want.flatten(0, 1), target.flatten()), params)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=bound(17, max(1.0, float(b.abs().max())), 64))
    # not vacuous: the plan moves the logits (the same weights without positions or windows)
    plain = TinyDecoder(40, 16, 2, 2, scheme=NoPE()).double()
    plain.load_state_dict(model.state_dict(), strict=False)
    assert (plain(idx) - got).abs().max() > 1e3 * tol


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_auto_equals_reference(name):
    """The dispatcher's paths and the reference attention give one function, with gradients."""
    idx = torch.randint(0, 40, (2, 13), generator=torch.Generator().manual_seed(3))
    results = []
    for impl in ("auto", "reference"):
        model = _model(PLANS[name], impl)
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
        loss.backward()
        results.append((logits.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}))
    (la, ga), (lr_, gr) = results
    tol = bound(13, max(1.0, float(lr_.abs().max())), 64)
    torch.testing.assert_close(la, lr_, rtol=0, atol=tol)
    assert ga.keys() == gr.keys()
    for k in ga:
        torch.testing.assert_close(ga[k], gr[k], rtol=0, atol=bound(13, max(1.0, float(gr[k].abs().max())), 64))


def test_a_plan_reproduces_the_legacy_window_and_nope_arguments_bit_for_bit():
    """``rope-window-nope``'s construction (window_layers + nope_layers) and the same thing as a
    plan are one model: equal logits, bit for bit, and the same state dict."""
    torch.manual_seed(0)
    legacy = TinyDecoder(40, 16, 2, 2, scheme=RotaryEmbedding(8), nope_layers=[1], window=4, window_layers=[0])
    torch.manual_seed(0)
    planned = TinyDecoder(40, 16, 2, 2, scheme=RotaryEmbedding(8),
                          layers=[LayerPosition("shared", window=4), LayerPosition("nope")])
    assert legacy.state_dict().keys() == planned.state_dict().keys()
    idx = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(4))
    assert torch.equal(legacy(idx), planned(idx))
    assert legacy.layer_plan is None and len(planned.layer_plan) == 2


def test_equal_rope_settings_share_one_table_and_bases_are_honoured():
    model = TinyDecoder(40, 16, 2, 4, layers=[LayerPosition("rope", base=1e6), LayerPosition("rope"),
                                               LayerPosition("rope", base=1e6), LayerPosition("rope", base=10000.0)])
    s = [b.attn.scheme for b in model.blocks]
    assert s[0] is s[2] and s[1] is s[3] and s[0] is not s[1]
    assert torch.equal(s[0].inv_freq, hf_inv_freq(8, 1e6)) and torch.equal(s[1].inv_freq, hf_inv_freq(8))


def test_a_rope_config_layer_gets_the_configs_frequencies():
    """Gemma 4's global layers: proportional RoPE, a quarter of the pairs rotating."""
    cfg = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    model = TinyDecoder(40, 32, 2, 2, layers=[LayerPosition("rope", window=8), LayerPosition("rope", rope_config=cfg)])
    inv, _ = compute_inv_freq(cfg, 16)
    assert torch.equal(model.blocks[1].attn.scheme.inv_freq, inv)
    assert int((inv > 0).sum()) == 2  # int(0.25 * 16 // 2)


def test_a_scheme_instance_in_a_plan_trains_with_the_model():
    alibi = ALiBi(2)
    model = TinyDecoder(40, 16, 2, 2, layers=[LayerPosition(alibi, window=3), LayerPosition("nope")])
    assert model.blocks[0].attn.scheme is alibi and model.blocks[0].attn.window == 3


@pytest.mark.parametrize("kw, err, match", [
    (dict(scheme="rotary"), ValueError, "scheme must be one of"),
    (dict(scheme=3), TypeError, "scheme must be one of"),
    (dict(scheme="nope", base=100.0), ValueError, "base and rope_config belong to a 'rope' layer"),
    (dict(scheme="rope", base=100.0, rope_config={"rope_theta": 1e4}), ValueError, "not both"),
    (dict(scheme="rope", base=1.0), ValueError, "base must be a finite number > 1"),
    (dict(scheme="rope", rope_config=[1]), TypeError, "rope_config must be a dict"),
    (dict(window=0), ValueError, "window must be"),
    (dict(chunk=2.5), TypeError, "chunk must be"),
    (dict(temperature=1.5), TypeError, "temperature must be an AttentionTemperature"),
])
def test_layer_position_rejects_bad_fields(kw, err, match):
    with pytest.raises(err, match=match):
        LayerPosition(**kw)


def test_tiny_decoder_rejects_a_bad_plan():
    with pytest.raises(ValueError, match="one LayerPosition per layer, n_layers = 2, got 1"):
        TinyDecoder(40, 16, 2, 2, layers=[LayerPosition()])
    with pytest.raises(TypeError, match=r"layers\[1\] must be a LayerPosition"):
        TinyDecoder(40, 16, 2, 2, layers=[LayerPosition(), "nope"])
    with pytest.raises(TypeError, match="layers must be a sequence of LayerPosition"):
        TinyDecoder(40, 16, 2, 2, layers=LayerPosition())
    with pytest.raises(ValueError, match="without nope_layers, window or window_layers"):
        TinyDecoder(40, 16, 2, 2, nope_layers=[1], layers=[LayerPosition(), LayerPosition()])
    with pytest.raises(ValueError, match="chunk=4.*needs causal=True"):
        MultiHeadAttention(16, 2, chunk=4)(rand(1, 5, 16, dtype=torch.float32))
    with pytest.raises(TypeError, match="temperature must be an AttentionTemperature"):
        MultiHeadAttention(16, 2, temperature="llama4")


# ----------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("t", [AttentionTemperature("llama4", 8, 0.1), AttentionTemperature("llama4", 1, 0.3),
                               AttentionTemperature("log-n", 16), AttentionTemperature("log-n-all", 5),
                               AttentionTemperature("constant", strength=1.25)], ids=repr)
def test_temperature_scales_are_their_formulas(t):
    pos = torch.arange(300)
    want = _tau(t, 300)
    got = t.scales(pos, torch.float64)
    # float64: one log (2 ulps) and a product and a sum, against math's correctly rounded log
    torch.testing.assert_close(got, want, rtol=8 * U64, atol=8 * U64)
    per_row = t.scales(torch.stack([pos, pos.flip(0)]), torch.float64)
    assert torch.equal(per_row[0], got) and torch.equal(per_row[1], got.flip(0))


def test_llama4_temperature_is_transformers_float32_expression():
    """transformers' Llama4TextAttention computes ``log1p(floor((positions.float() + 1) /
    floor_scale)) * attn_scale + 1`` in float32; the integer floor here gives the same bits."""
    pos = torch.arange(0, 1 << 16, 7)
    for floor_scale, attn_scale in ((8192, 0.1), (64, 0.1), (3, 0.37)):
        theirs = torch.log1p(torch.floor((pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        ours = AttentionTemperature("llama4", floor_scale, attn_scale).scales(pos)
        assert ours.dtype == torch.float32 and torch.equal(ours, theirs)


def test_llama4_temperature_matches_transformers_nope_attention():
    """A NoPE layer with Llama 4's temperature against transformers' Llama4TextAttention with
    ``use_rope = 0`` and copied weights, eager attention, float64 (transformers rounds the scales
    to float32 first: the logits move by at most ``4 u32`` of their size, the weights by twice
    that relative, the output by that times ``max |v|``)."""
    pytest.importorskip("transformers")
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    cfg = Llama4TextConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                           num_hidden_layers=1, no_rope_layers=[0], attn_temperature_tuning=True, floor_scale=4,
                           attn_scale=0.1, attention_bias=False, intermediate_size=32, intermediate_size_mlp=32)
    cfg._attn_implementation = "eager"
    theirs = Llama4TextAttention(cfg, 0).double().eval()
    ours = MultiHeadAttention(16, 2, NoPE(), temperature=AttentionTemperature("llama4", 4, 0.1),
                              attention_impl="reference").double()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(ours, name).weight.data.copy_(getattr(theirs, name).weight.data)
    n = 23
    x = rand(2, n, 16, seed=5)
    mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~_visible(n, None, None), float("-inf"))
    with torch.no_grad():
        want, _ = theirs(x, None, mask[None, None].expand(2, 1, n, n))
        got = ours(x, causal=True)
        q = theirs.q_proj(x).view(2, n, 2, 8).transpose(1, 2) * _tau(ours.temperature, n)[:, None]
        k = theirs.k_proj(x).view(2, n, 2, 8).transpose(1, 2)
        v = theirs.v_proj(x)
        logit_max = float((q @ k.transpose(-1, -2)).abs().max()) / math.sqrt(8)
    w_o = float(theirs.o_proj.weight.detach().abs().sum(1).max())
    tol = 2 * (4 * U32 * logit_max) * float(v.abs().max()) * w_o + bound(n, float(want.abs().max()) + 1, 16)
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    # not vacuous: the scales reach 1 + 0.1 ln(1 + 23 // 4), and without them the output moves
    assert float(_tau(ours.temperature, n).max()) == pytest.approx(1 + 0.1 * math.log(6))
    ours.temperature = None
    with torch.no_grad():
        assert (ours(x, causal=True) - want).abs().max() > 100 * tol


def test_a_temperature_scales_the_content_logits_not_a_bias():
    """``tau`` multiplies q: the same as the reference attention with scale ``tau / sqrt(d)`` for
    NoPE, and with the queries multiplied for ALiBi, whose bias is not scaled."""
    x = rand(2, 9, 16, seed=6)
    for scheme in (NoPE(), ALiBi(2)):
        torch.manual_seed(0)
        layer = MultiHeadAttention(16, 2, scheme, temperature=AttentionTemperature("constant", strength=2.5)).double()
        q = layer._split(layer.q_proj(x), 2)
        k = layer._split(layer.k_proj(x), 2)
        v = layer._split(layer.v_proj(x), 2)
        want = attention(2.5 * q, k, v, scheme, causal=True)
        if isinstance(scheme, NoPE):
            torch.testing.assert_close(attention(q, k, v, scheme, causal=True, scale=2.5 / math.sqrt(8)), want,
                                       rtol=0, atol=bound(9, 4.0, 8))
        want = layer.o_proj(want.transpose(1, 2).reshape(2, 9, 16))
        want = want.detach()
        torch.testing.assert_close(layer(x, causal=True), want, rtol=0, atol=bound(9, float(want.abs().max()) + 1, 16))


@pytest.mark.parametrize("kw, err, match", [
    (dict(form="cosine"), ValueError, "form must be one of"),
    (dict(form=None), TypeError, "form must be one of"),
    (dict(form="log-n", length=1), ValueError, "length must be"),
    (dict(form="llama4", length=0), ValueError, "length must be"),
    (dict(form="llama4", strength=-0.1), ValueError, "strength must be a finite number >= 0"),
    (dict(form="constant", strength=0.0), ValueError, "strength must be a finite number > 0"),
    (dict(form="constant", strength="2"), TypeError, "strength must be"),
])
def test_attention_temperature_rejects_bad_fields(kw, err, match):
    with pytest.raises(err, match=match):
        AttentionTemperature(**kw)


def test_temperature_scales_rejects_bad_positions():
    t = AttentionTemperature("log-n", 8)
    with pytest.raises(TypeError, match="pos must be an integer tensor"):
        t.scales(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="pos must hold positions >= 0"):
        t.scales(torch.tensor([-1, 2]))
    with pytest.raises(TypeError, match="dtype must be torch.float32 or torch.float64"):
        t.scales(torch.tensor([1]), torch.float16)


def test_longrope_and_yarn_logit_scales_are_their_attention_factors_squared():
    """LongRoPE's factor sqrt(1 + ln s / ln L) on q and k scales the logits by
    ``1 + ln s / ln L = ln(s L) / ln L``: log-n scaling at n = s L. YaRN's by (0.1 ln s + 1)^2."""
    L, d = 4096, 128
    for s in (1.5, 4.0, 8.0, 32.0):
        lr = {"rope_type": "longrope", "rope_theta": 1e4, "factor": s, "original_max_position_embeddings": L,
              "short_factor": [1.0] * 64, "long_factor": [s] * 64}
        _, att = compute_inv_freq(lr, d, max_position_embeddings=L)
        assert recipe.longrope_logit_scale(s, L) == pytest.approx(att ** 2, rel=4 * U64)
        assert recipe.longrope_logit_scale(s, L) == pytest.approx(recipe.logn_logit_scale(s * L, L), rel=4 * U64)
        yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": s, "original_max_position_embeddings": L}
        _, att = compute_inv_freq(yarn, d, max_position_embeddings=L)
        assert recipe.yarn_logit_scale(s) == pytest.approx(att ** 2, rel=4 * U64)
        assert recipe.yarn_logit_scale(s) == pytest.approx((0.1 * math.log(s) + 1) ** 2, rel=4 * U64)
    assert recipe.longrope_logit_scale(1.0, L) == 1.0 and recipe.yarn_logit_scale(0.5) == 1.0


def test_yarn_factor_scales_rotated_logits_by_its_square():
    """End to end: the YaRN table with and without its attention factor, the same q and k: the
    logits differ by the factor squared (within float32 rounding of the tables)."""
    s, L, d = 4.0, 64, 8
    cfg = method_config("yarn", s, L, d)
    with_t = RotaryEmbedding(d, rope_config=cfg, max_position_embeddings=L)
    without = RotaryEmbedding(d, rope_config={**cfg, "attention_factor": 1.0}, max_position_embeddings=L)
    q, k = rand(1, 1, 200, d, seed=7, dtype=torch.float32), rand(1, 1, 200, d, seed=8, dtype=torch.float32)
    pos = torch.arange(200)
    a = torch.einsum("bhqd,bhkd->bhqk", *with_t.rotate(q, k, pos, pos)).double()
    b = torch.einsum("bhqd,bhkd->bhqk", *without.rotate(q, k, pos, pos)).double()
    mag = float(q.abs().max() * k.abs().max()) * d
    torch.testing.assert_close(a, b * recipe.yarn_logit_scale(s), rtol=0, atol=32 * d * U32 * mag)


def test_logit_scale_functions_reject_bad_input():
    with pytest.raises(ValueError, match="n must be a finite number >= 1"):
        recipe.logn_logit_scale(0.5, 128)
    with pytest.raises(ValueError, match="train_len must be"):
        recipe.logn_logit_scale(4, 1)
    with pytest.raises(TypeError, match="factor must be"):
        recipe.longrope_logit_scale("4", 128)
    with pytest.raises(ValueError, match="factor must be"):
        recipe.yarn_logit_scale(float("nan"))


# ----------------------------------------------------------------------------- the base


def _pairs_turning(d: int, L: int, base: float) -> int:
    """Pairs whose wavelength 2 pi base^(2i/d) is shorter than L, counted in float64."""
    return sum(1 for i in range(d // 2) if 2 * math.pi * base ** (2 * i / d) < L)


def test_critical_dimension_is_92_for_llama2_and_counts_the_fully_turning_pairs():
    assert recipe.critical_dimension(128, 4096, 10000.0) == 92  # Liu et al.'s Llama 2 value
    assert recipe.critical_dimension(16, 128) == 6               # the lab's head: 3 pairs turn fully
    for d in (8, 16, 64, 128):
        for L in (16, 100, 128, 4096, 100000):
            for base in (50.0, 1e4, 5e5, 1e6):
                assert recipe.critical_dimension(d, L, base) == 2 * _pairs_turning(d, L, base), (d, L, base)


def test_extrapolation_bound_is_the_wavelength_of_the_first_partial_pair():
    d, L = 128, 4096
    extra = recipe.critical_dimension(d, L)
    wavelengths = 2 * math.pi / (1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
    assert recipe.extrapolation_bound(d, L, 1e6, pretrain_base=1e4) == pytest.approx(float(wavelengths[extra // 2]),
                                                                                      rel=16 * U64)
    assert recipe.extrapolation_bound(d, L, 1e4) == pytest.approx(2 * math.pi * 1e4 ** (92 / 128), rel=4 * U64)
    assert recipe.extrapolation_bound(8, 1000, 10.0) == math.inf  # every pair turns within 1000


def test_critical_base_inverts_the_bound():
    L, T = 4096, 32768
    b = recipe.critical_base(T, L)
    x = math.log(L / (2 * math.pi)) / math.log(1e4)  # the unrounded d_extra / d
    assert 2 * math.pi * b ** x == pytest.approx(T, rel=64 * U64)
    assert recipe.critical_base(L, L) == pytest.approx(1e4, rel=64 * U64)
    with pytest.raises(ValueError, match="target_len must be at least train_len"):
        recipe.critical_base(100, 4096)
    with pytest.raises(ValueError, match="train_len must exceed 2 pi"):
        recipe.critical_base(100, 6)


def test_decay_sum_is_the_sum_of_cosines():
    m = np.array([0, 1, 7, 1000, 54321])
    for d, base in ((16, 1e4), (128, 5e5)):
        want = [sum(math.cos(int(k) * base ** (-2 * i / d)) for i in range(d // 2)) for k in m]
        np.testing.assert_allclose(recipe.decay_sum(m, base, d), want, rtol=0, atol=d * 64 * U64 * 1e5)
    assert recipe.decay_sum([0], 1e4, 16)[0] == 8.0


def test_longest_context_is_the_first_negative_sum():
    """The chunked matrix-product evaluation against the direct sums."""
    for d, base in ((16, 3000.0), (16, 1e4), (16, 6e4), (32, 2e4), (128, 2.7e4)):
        direct = recipe.decay_sum(np.arange(6000), base, d)
        neg = np.flatnonzero(direct < 0)
        want = int(neg[0]) if neg.size else 6000
        assert recipe.longest_context(base, d, limit=6000) == want, (d, base)


def test_longest_context_of_scaled_frequencies():
    """Any frequencies: the direct sums of cos(m f_i), for PI-scaled and uneven frequencies;
    plain RoPE's frequencies give longest_context; a tensor in float32 is read in float64."""
    import torch

    rng = np.random.default_rng(5)
    for f in (1e4 ** (-np.arange(0, 16, 2) / 16) / 8, rng.uniform(1e-4, 1.0, 12)):
        direct = np.cos(np.multiply.outer(np.arange(6000.0), f)).sum(-1)
        neg = np.flatnonzero(direct < 0)
        assert recipe.longest_context_of(f, limit=6000) == (int(neg[0]) if neg.size else 6000)
    plain = 3000.0 ** (-np.arange(0, 16, 2) / 16)
    assert recipe.longest_context_of(plain, limit=6000) == recipe.longest_context(3000.0, 16, limit=6000)
    assert recipe.longest_context_of(torch.tensor(plain), limit=6000) == recipe.longest_context(3000.0, 16, limit=6000)
    for bad, exc, match in (([], ValueError, "non-empty 1-D"), ([[0.1]], ValueError, "non-empty 1-D"),
                            ([0.1, 0.0], ValueError, "finite frequencies > 0"),
                            ([0.1, np.nan], ValueError, "finite frequencies > 0"),
                            (["a"], TypeError, "real numbers")):
        with pytest.raises(exc, match=match):
            recipe.longest_context_of(bad)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        recipe.longest_context_of(plain, limit=0)


def test_base_lower_bound_reproduces_the_printed_values():
    """Men et al.'s table (d = 128): 4.3e3 at 1K, 2.7e4 at 4K, 8.4e4 at 8K. At 2K the paper
    prints 1.6e4, but 1.2e4 already satisfies the condition (Su Jianlin's search finds it too)."""
    def two_digits(x):
        return float(f"{x:.1e}")
    assert two_digits(recipe.base_lower_bound(1024)) == 4.3e3
    assert two_digits(recipe.base_lower_bound(4096)) == 2.7e4
    assert two_digits(recipe.base_lower_bound(8192)) == 8.4e4
    b = recipe.base_lower_bound(2048)
    assert two_digits(b) == 1.2e4 and b < 1.6e4
    assert (recipe.decay_sum(np.arange(2048), b, 128) >= 0).all()  # by the direct sums: enough at 2K


def test_base_lower_bound_is_the_first_grid_base_and_the_set_is_not_an_interval():
    for d, L in ((16, 128), (16, 512), (128, 1024)):
        b = recipe.base_lower_bound(L, d)
        assert (recipe.decay_sum(np.arange(L), b, d) >= 0).all()
        assert (recipe.decay_sum(np.arange(L), b / 1.001, d) < 0).any()  # the grid point below fails
    ok = lambda b: bool((recipe.decay_sum(np.arange(4096), b, 128) >= 0).all())  # noqa: E731
    b = recipe.base_lower_bound(4096)
    assert 26953 <= b <= 26970 and ok(b)  # as the docstring says: a narrow window, then gaps
    assert not ok(27000.0) and not ok(28000.0) and ok(28700.0) and ok(29000.0) and not ok(30000.0)


def test_base_lower_bound_rejects_bad_input():
    with pytest.raises(ValueError, match="head_dim must be even"):
        recipe.base_lower_bound(100, 15)
    with pytest.raises(ValueError, match="rel_step must lie in"):
        recipe.base_lower_bound(100, 16, rel_step=0.5)
    with pytest.raises(ValueError, match="no base up to max_base"):
        recipe.base_lower_bound(100, 2, max_base=1e6)  # one pair: cos(m) < 0 at m = 2, whatever the base
    with pytest.raises(TypeError, match="length must be"):
        recipe.base_lower_bound(100.0)


def test_abf_base_raises_the_base_to_the_condition_at_the_target():
    assert recipe.abf_base(512, 16) == 6e4   # the lab at 4x
    assert (recipe.decay_sum(np.arange(512), 6e4, 16) >= 0).all()
    for lower in (1e4, 2e4, 3e4, 4e4, 5e4):  # the one-digit candidates below it fail (bound 5.6e4)
        assert lower < recipe.base_lower_bound(512, 16) or (recipe.decay_sum(np.arange(512), lower, 16) < 0).any()
    assert recipe.abf_base(64, 8) == 1e4     # a base that already satisfies the condition stays
    assert (recipe.decay_sum(np.arange(64), 1e4, 8) >= 0).all()
    assert method_config("abf", 4.0, 128, 16)["rope_theta"] == 6e4
    assert method_config("abf", 4.0, 128, 16, base=1e6)["rope_theta"] == 1e6  # enough already


# ----------------------------------------------------------------------------- the published data


def test_published_recipes_are_sourced_and_their_fractions_computed():
    rows = recipe.published_recipes()
    names = " ".join(r["model"] for r in rows)
    for word in ("Position Interpolation", "YaRN", "Code Llama", "Llama 3.1", "Qwen2.5", "LongRoPE", "Gemma 3", "Xiong"):
        assert word in names
    for r in rows:
        assert r["sources"] and all({"ref", "where", "says"} <= set(s) for s in r["sources"])
        if r["finetune_tokens"] is None or r["pretrain_tokens"] is None:
            assert r["fraction"] is None and r["unverified"], r["model"]
        else:
            assert r["fraction"] == float(f"{r['finetune_tokens'] / r['pretrain_tokens']:.4g}")
        assert r["base_after"] >= r["base_before"] > 1
    yarn = next(r for r in rows if r["model"].startswith("Llama 2 7B, YaRN s = 16"))
    assert yarn["fraction"] < 1e-3  # "less than ~0.1% of the original pre-training data"
    rows[0]["model"] = "changed"
    assert recipe.published_recipes()[0]["model"] != "changed"  # a copy


def test_every_cited_source_is_in_the_bibliography():
    # chapter 13 cites a source whose ref is a bibliography key; the others name a repository,
    # a file of the book or a package module, and are printed as written
    bib = (Path(__file__).resolve().parents[1] / "book" / "references.bib").read_text(encoding="utf-8")
    keys = set(re.findall(r"^@\w+\{([^,]+),", bib, re.M))
    refs = {s["ref"] for r in recipe.published_recipes() + recipe.local_global_models() for s in r["sources"]}
    cited = {ref for ref in refs if re.fullmatch(r"[a-z]+\d{4}[a-z0-9]+", ref)}
    assert cited - keys == set()
    assert {"gemmateam2025gemma3", "yang2024qwen25", "gemmateam2024gemma2"} <= cited
    assert not any(ref.startswith("arXiv") for ref in refs)  # a paper is cited by its key


def test_local_global_data_agrees_with_transformers_configs():
    rows = {r["model"].split(" (")[0]: r for r in recipe.local_global_models()}
    assert set(rows) == {"Gemma 2", "Gemma 3", "Gemma 4", "Llama 4", "gpt-oss"}
    assert all(r["sources"] for r in rows.values())
    pytest.importorskip("transformers")
    from transformers import Gemma2Config, Gemma3TextConfig, GptOssConfig, Llama4TextConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g2, g3, oss, l4 = Gemma2Config(num_hidden_layers=4), Gemma3TextConfig(num_hidden_layers=12), \
            GptOssConfig(num_hidden_layers=4), Llama4TextConfig(num_hidden_layers=8)
    assert g2.layer_types[:2] == ["sliding_attention", "full_attention"] and g2.sliding_window == 4096
    assert g3.layer_types[5] == "full_attention" and g3.layer_types[:5] == ["sliding_attention"] * 5
    assert g3.rope_parameters["full_attention"]["rope_theta"] == rows["Gemma 3"]["global"]["rope_base"]
    assert g3.rope_parameters["sliding_attention"]["rope_theta"] == rows["Gemma 3"]["local"]["rope_base"]
    assert oss.sliding_window == rows["gpt-oss"]["local"]["size"] and oss.rope_parameters["factor"] == 32.0
    assert oss.rope_parameters["rope_theta"] == rows["gpt-oss"]["local"]["rope_base"]
    t = rows["Llama 4"]["temperature"]
    assert (l4.attn_scale, l4.floor_scale) == (t["attn_scale"], t["floor_scale"])
    assert l4.attention_chunk_size == rows["Llama 4"]["local"]["size"]
    assert l4.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
    assert l4.layer_types[:4] == ["chunked_attention"] * 3 + ["full_attention"]


# ----------------------------------------------------------------------------- lab schemes


def test_rope_base_names_round_trip_and_are_canonical():
    for base, name in ((100.0, "rope-b100"), (3000.0, "rope-b3000"), (1e4, "rope"), (1e5, "rope-b1e5"),
                       (1e6, "rope-b1e6"), (5e5, "rope-b5e5"), (1.5, "rope-b1.5e0"), (56558.75, "rope-b5.655875e4")):
        assert rope_base_name(base) == name and rope_base_of(name) == base
    assert rope_base_of("alibi") is None
    with pytest.raises(ValueError, match="is spelt 'rope-b1e5'"):
        rope_base_of("rope-b100000")
    with pytest.raises(ValueError, match="is spelt 'rope'"):
        rope_base_of("rope-b10000")
    with pytest.raises(ValueError, match="a RoPE base name is 'rope-b<base>'"):
        rope_base_of("rope-bx")
    with pytest.raises(ValueError, match="base must be a finite number > 1"):
        rope_base_name(1.0)
    scheme = build_scheme("rope-b1e6", d_model=64, n_heads=4, max_len=2048, train_len=128)
    assert scheme.base == 1e6 and torch.equal(scheme.inv_freq, hf_inv_freq(16, 1e6))
    assert scheme_label("rope-b1e6") == "RoPE, base 1e+06"
    cfg = TrainConfig(scheme="rope-b100", **TINY)
    assert checkpoint_path("ck", cfg).name.startswith("rope-b100-L32")
    with pytest.raises(ValueError, match="is spelt"):
        TrainConfig(scheme="rope-b1000000")


def test_hybrid_schemes_have_equal_parameters_and_their_plans():
    counts = {}
    for name in ("rope", "rope-window-nope", "rope-local-global", "irope", "irope-temp", "rope-b1e6"):
        model = build_model(TrainConfig(scheme=name, n_layers=2, steps=10))
        counts[name] = sum(p.numel() for p in model.parameters())
    assert len(set(counts.values())) == 1, counts
    gemma = build_model(TrainConfig(scheme="rope-local-global", steps=10))
    assert [b.attn.window for b in gemma.blocks] == [64, None]
    assert [b.attn.scheme.base for b in gemma.blocks] == [1e4, 1e6]
    for name, temp in (("irope", None), ("irope-temp", AttentionTemperature("llama4", 64, 0.1))):
        model = build_model(TrainConfig(scheme=name, steps=10))
        assert [b.attn.chunk for b in model.blocks] == [64, None]
        assert [type(b.attn.scheme).__name__ for b in model.blocks] == ["RotaryEmbedding", "NoPE"]
        assert [b.attn.temperature for b in model.blocks] == [None, temp]
    assert set(LAYER_PLANS) == {"rope-local-global", "irope", "irope-temp"}
    assert layer_plan_for("rope", 2, 128) is None and len(layer_plan_for("irope", 6, 128)) == 6


# ----------------------------------------------------------------------------- lab runs


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recipe")
    corpus = load_corpus()
    paths = []
    for name in ("rope-b100", "irope-temp"):
        cfg = TrainConfig(scheme=name, steps=20, warmup=2, **TINY)
        path = checkpoint_path(folder, cfg)
        train(cfg, corpus, checkpoint=path, progress=False)
        paths.append(str(path))
    return folder, paths


EV = recipe_lab.AllLengths(multiples=[1, 2, 4], windows=16, blocks=4, sliding_tokens=256, passkey_depths=[0.5],
                           passkey_trials=2, entropy_windows=1)


def test_run_bases_evaluates_every_job_at_every_length(tiny_ckpts):
    folder, paths = tiny_ckpts
    res = recipe_lab.run_bases(paths[:1], 2.0, [0, 3], EV, workers=1, cache_dir=str(folder / "cache"), verbose=False)
    lengths = {(r["finetune_steps"], r["length"]) for r in res["rows"] if r["metric"] == "bpb_tail"}
    assert lengths == {(s, w) for s in (0, 3) for w in (32, 64, 128)}
    assert {r["scheme"] for r in res["rows"]} == {"rope-b100"} and {r["base"] for r in res["rows"]} == {"100"}
    b = res["bounds"]["rope-b100"]
    assert b["critical_dimension"] == recipe.critical_dimension(8, 32, 100.0)
    assert b["longest_context"] == recipe.longest_context(100.0, 8, limit=64 * 32)
    assert len(res["finetune_logs"]) == 1 and res["finetune_logs"][0]["steps"] == 3
    again = recipe_lab.run_bases(paths[:1], 2.0, [0, 3], EV, workers=1, cache_dir=str(folder / "cache"), verbose=False)
    assert again["rows"] == res["rows"]  # from the cache
    with pytest.raises(TypeError, match="ev must be an AllLengths"):
        recipe_lab.run_bases(paths[:1], 2.0, [0], asdict(EV))
    with pytest.raises(ValueError, match="factor must be"):
        recipe_lab.run_bases(paths[:1], 0.5, [0], EV)


def test_temperature_job_is_paired_and_sharpens_the_first_layer(tiny_ckpts):
    _, paths = tiny_ckpts
    out = recipe_lab.temperature_job(paths[0], ["trained", "none", "log-n", "yarn"], [1, 4], windows=8, blocks=2,
                                     entropy_windows=1)
    r = out["results"]
    assert out["layers"] == [0, 1]  # a RoPE model: every layer
    assert r["trained"] is r["none"]  # a model trained without a temperature is measured once for both
    assert r["log-n"]["32"]["entropy"] == r["none"]["32"]["entropy"]  # tau = 1 within the training length
    assert r["log-n"]["128"]["tau_last"] == pytest.approx(math.log(128) / math.log(32))
    # softmax(tau z) has less entropy than softmax(z) for tau > 1: the first layer sees the same inputs
    assert r["log-n"]["128"]["entropy"][0] < r["none"]["128"]["entropy"][0]
    assert r["yarn"]["128"]["entropy"][0] < r["none"]["128"]["entropy"][0]
    hyb = recipe_lab.temperature_job(paths[1], ["trained", "none"], [4], windows=8, blocks=2, entropy_windows=1)
    assert hyb["layers"] == [1]  # iRoPE: the NoPE layer only
    assert hyb["results"]["trained"]["128"]["tau_last"] == pytest.approx(1 + 0.1 * math.log(1 + 128 // 16))
    assert hyb["results"]["none"]["128"]["entropy"][0] == hyb["results"]["trained"]["128"]["entropy"][0]
    assert hyb["results"]["none"]["128"]["tau_last"] == 1.0  # a trained temperature: both measured
    assert hyb["results"]["none"]["128"]["entropy"][1] != hyb["results"]["trained"]["128"]["entropy"][1]


def test_temperature_for_names():
    assert recipe_lab.temperature_for("none", 64, 32) is None
    assert recipe_lab.temperature_for("yarn", 128, 32).strength == pytest.approx(recipe.yarn_logit_scale(4.0))
    assert recipe_lab.temperature_for("longrope", 128, 32).strength == pytest.approx(math.log(128) / math.log(32))
    with pytest.raises(ValueError, match="temperature must be one of"):
        recipe_lab.temperature_for("trained", 64, 32)


def test_the_command_line_runs_and_refuses_bad_flags(tiny_ckpts, tmp_path, capsys):
    folder, _ = tiny_ckpts
    flags = ["--d-model", "16", "--n-heads", "2", "--n-layers", "2", "--seq-len", "32", "--batch-size", "4",
             "--max-len", "128", "--steps", "20", "--warmup", "2", "--workers", "1", "--checkpoint-dir", str(folder)]
    out = tmp_path / "bases.csv"
    assert recipe_lab.main(["bases", "--bases", "100", "--seeds", "0", "--finetune-steps", "0", "--factor", "2",
                            "--multiples", "1", "2", "--windows", "16", "--blocks", "4", "--sliding-tokens", "256",
                            "--passkey-depths", "0.5", "--passkey-trials", "2", "--entropy-windows", "1",
                            "--out", str(out), "--json", str(tmp_path / "b.json"), *flags]) == 0
    prov, rows = load_csv(out)
    assert {r["scheme"] for r in rows} == {"rope-b100"} and prov["command"].startswith("python -m companion.lab.recipe_lab")
    assert "rope-b100" in load_result(tmp_path / "b.json")["data"]["bounds"]
    tout = tmp_path / "t.json"
    assert recipe_lab.main(["temperature", "--schemes", "irope-temp", "--seeds", "0", "--temperatures", "none",
                            "llama4", "--multiples", "1", "2", "--windows", "8", "--blocks", "2", "--entropy-windows",
                            "1", "--out", str(tout), *flags]) == 0
    assert set(load_result(tout)["data"]["runs"][0]["results"]) == {"none", "llama4"}
    for argv, flag in ((["bases", "--bases", "1", "--out", "x.csv"], "--bases"),
                       (["bases", "--bases", "100000", "1e5", "--out", "x.csv"], "--bases"),
                       (["bases", "--factor", "0.5", "--out", "x.csv"], "--factor"),
                       (["bases", "--multiples", "1", "32", "--out", "x.csv"], "--max-len"),
                       (["temperature", "--temperatures", "cold", "--out", "x.json"], "--temperatures"),
                       (["temperature", "--schemes", "rope-b10000", "--out", "x.json"], "--schemes"),
                       (["temperature", "--windows", "10", "--blocks", "4", "--out", "x.json"], "--blocks")):
        with pytest.raises(SystemExit) as exc:
            recipe_lab.main(argv)
        assert exc.value.code == 2
        assert flag in capsys.readouterr().err, argv


def test_every_option_of_the_command_line_has_a_meaning_and_a_default(monkeypatch):
    """tests/test_cli_help.py's rule, for ``python -m companion.lab.recipe_lab``."""
    import argparse

    from test_cli_help import commands, parser_of

    parser = parser_of(recipe_lab.main, monkeypatch)
    checked = 0
    for prog, p in commands(parser):
        for action in p._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            text = action.help or ""
            assert len(text.split()) >= 2 and ("(required)" in text if action.required else "(default:" in text), \
                f"{prog} {action.option_strings[-1]}: {text!r}"
            checked += 1
    assert checked >= 40
