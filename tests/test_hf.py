"""companion.hf against transformers itself (5.24.0, the hf extra).

* The rotary module: swapped into a tiny random ``LlamaForCausalLM`` (no download) for every
  scaling type, the float32 logits are bit for bit the original ones (``torch.equal``), and so
  are its tables against ``LlamaRotaryEmbedding``'s in float32, bf16 and fp16.
* ``attn_implementation="companion"``: on a left-padded batch, each attention call is within
  the derived float32 bound of the float64 attention of the same inputs
  (``helpers.attention_out_bound``), and the logits are within the float32 model's own
  distance from float64 (``d32``, the convention of tests/test_llama.py); without the mask
  function the padded rows are visibly wrong (the trap this module avoids).
* Position-bias schemes (ALiBi, T5, Kerple) through ``use_scheme``, against transformers'
  eager and SDPA attention given the bias as a 4-D float mask, the blockwise path included.
* SmolLM2-135M loaded by transformers from the project's GGUF (``gguf_file=``) and by
  ``companion.llama``: the same logits (skipped when the GGUF is not cached).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'pe-companion[hf]') is not installed")

import companion.hf as chf  # noqa: E402
from companion import ALiBi, KerpleBias, RotaryEmbedding, T5RelativeBias  # noqa: E402
from companion import pretrained as pt  # noqa: E402
from companion.attention import attention  # noqa: E402
from companion.dispatch import SDPA_BIAS_PAIRS, attention_path  # noqa: E402
from helpers import attention_out_bound  # noqa: E402
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()  # the GGUF loader's bars

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
MAX_POS, ORIGINAL = 64, 32  # the tiny model's max_position_embeddings, and a scaled model's pretraining length

#: Realistic rope_parameters for every HuggingFace type, with lengths scaled to the tiny model:
#: each method's own defaults (YaRN's betas, Llama 3.1's frequency factors and base, LongRoPE's
#: per-pair factors rising from 1, Gemma 4's proportional quarter).
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
             "beta_fast": 32.0, "beta_slow": 1.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
                 "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + 0.6 * i for i in range(HEAD_DIM // 2)]},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "proportional": {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}
#: Lengths of successive calls: past max_position_embeddings (dynamic grows its base) and back
#: (it returns), past original_max_position_embeddings (LongRoPE's long factors) and back.
LENGTHS = (20, 80, 20)


def tiny_config(rope: dict, **kw) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=128,
                       max_position_embeddings=kw.pop("max_position_embeddings", MAX_POS),
                       rope_parameters=copy.deepcopy(rope), **kw)


def tiny_model(rope: dict, seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(rope, **kw)).eval()


def token_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded(length: int, pads: tuple[int, ...] = (0, 4, 9)) -> tuple[torch.Tensor, torch.Tensor]:
    """A tokenizer's attention mask with ``pads[b]`` pads before row ``b``, and the position ids
    transformers' generate gives it: ``cumsum - 1``, 1 on the pads."""
    mask = torch.ones(len(pads), length, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    return mask, (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


# ----------------------------------------------------------------------------- the rotary module


def test_importing_registers_the_attention_and_its_mask():
    assert AttentionInterface().get(chf.ATTENTION_NAME) is chf.attention_forward
    assert chf.ATTENTION_NAME in AttentionMaskInterface()


@pytest.mark.parametrize("rope_type", sorted(ROPES))
def test_swapped_rotary_gives_bit_equal_logits(rope_type):
    model = tiny_model(ROPES[rope_type])
    ids = token_ids(2, max(LENGTHS))
    with torch.no_grad():
        want = [model(ids[:, :n]).logits for n in LENGTHS]
        model.model.rotary_emb = chf.rotary_embedding(model.config)
        got = [model(ids[:, :n]).logits for n in LENGTHS]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    if rope_type != "default":  # the scaling is live: the same weights with plain RoPE differ
        plain = tiny_model(ROPES["default"])
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert not torch.equal(plain(ids).logits, want[1])


@pytest.mark.parametrize("rope_type", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tables_equal_transformers_in_every_dtype(rope_type, dtype):
    config = tiny_config(ROPES[rope_type])
    theirs, ours = LlamaRotaryEmbedding(config), chf.rotary_embedding(config)
    x = torch.zeros(3, 1, dtype=dtype)
    _, per_row = left_padded(90)  # (3, 90) per-row positions, past both lengths of the config
    for pos in (torch.arange(7)[None], per_row, torch.arange(70, 75)[None], torch.arange(5)[None]):
        want, got = theirs(x, pos), ours(x, pos)
        assert got[0].shape == (*pos.shape, HEAD_DIM) and got[0].dtype == dtype  # proportional: the whole head
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_tables_of_a_partial_rotary_config_have_the_rotated_width():
    config = tiny_config({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5})
    cos, sin = chf.rotary_embedding(config)(torch.zeros(1), torch.arange(5)[None])
    params = chf.rope_config_of(config)[0]
    assert params["partial_rotary_factor"] == 0.5
    want = RotaryEmbedding(HEAD_DIM, rope_config=params, max_position_embeddings=MAX_POS).cos_sin(torch.arange(5)[None])
    assert cos.shape == (1, 5, HEAD_DIM // 2)
    assert torch.equal(cos, torch.cat([want[0], want[0]], -1)) and torch.equal(sin, torch.cat([want[1], want[1]], -1))


LLAMA31 = {  # the RoPE fields of Llama 3.1's config.json before transformers v5
    "hidden_size": HEADS * HEAD_DIM, "num_attention_heads": HEADS, "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def test_a_legacy_config_converts_as_transformers_converts_it():
    # transformers reads the legacy fields into rope_parameters; so does rope_config_of for the dict
    converted = LlamaConfig(**copy.deepcopy(LLAMA31))
    assert converted.rope_parameters["rope_theta"] == 500000.0
    params, head_dim, max_pos = chf.rope_config_of(LLAMA31)
    assert (head_dim, max_pos) == (HEAD_DIM, 131072)
    assert params == {**LLAMA31["rope_scaling"], "rope_theta": 500000.0}
    pos = torch.tensor([[0, 1, 4000, 9000, 131071]])
    x = torch.zeros(1)
    want = LlamaRotaryEmbedding(converted)(x, pos)
    for config in (LLAMA31, converted):
        assert all(torch.equal(g, w) for g, w in zip(chf.rotary_embedding(config)(x, pos), want, strict=True))
    # the legacy "type" key and a top-level original length (Phi-3's spelling) convert too
    phi = {**LLAMA31, "original_max_position_embeddings": 8192,
           "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA31["rope_scaling"].items()
                                                 if k not in ("rope_type", "original_max_position_embeddings")}}}
    assert chf.rope_config_of(phi)[0] == params
    # the input dict is not modified
    assert LLAMA31["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_a_legacy_config_without_its_base_is_an_error():
    bad = {k: v for k, v in LLAMA31.items() if k != "rope_theta"}
    with pytest.raises(ValueError, match="rope_scaling but no rope_theta"):
        chf.rotary_embedding(bad)
    with pytest.raises(ValueError, match=r"no 'rope_theta'.*rope_parameters_from_legacy"):
        chf.rotary_embedding({**bad, "rope_parameters": bad["rope_scaling"]})  # the old dict as v5's


@pytest.mark.parametrize("config, exc, match", [
    (None, TypeError, "config must be a transformers config"),
    ("llama", TypeError, "config must be a transformers config"),
    ({"hidden_size": 64, "num_attention_heads": 4}, ValueError, "no RoPE fields"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, ValueError, "head_dim"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "head_dim": 16},
     ValueError, "nested by layer type"),
    ({"rope_parameters": "yarn", "head_dim": 16}, TypeError, "rope_parameters must be a dict"),
    ({"rope_parameters": {"rope_type": "yarn2", "rope_theta": 1e4}, "head_dim": 16}, ValueError, "rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "hidden_size": 64, "num_attention_heads": 0},
     ValueError, "num_attention_heads"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "hidden_size": "64", "num_attention_heads": 4},
     TypeError, "hidden_size"),
])
def test_bad_configs_get_clear_errors(config, exc, match):
    with pytest.raises(exc, match=match):
        chf.rotary_embedding(config)


@pytest.mark.parametrize("x, pos, exc, match", [
    (torch.zeros(1, dtype=torch.long), torch.arange(3)[None], TypeError, "x must be a floating-point tensor"),
    (torch.zeros(1), torch.arange(3.0)[None], TypeError, "position_ids must hold integers"),
    (torch.zeros(1), torch.zeros(1, 1, 3, dtype=torch.long), ValueError, "position_ids must have shape"),
    (torch.zeros(1), torch.tensor([[2**24]]), ValueError, r"position_ids must lie in \[-2\*\*24, 2\*\*24\)"),
])
def test_bad_forward_arguments_get_clear_errors(x, pos, exc, match):
    with pytest.raises(exc, match=match):
        chf.rotary_embedding(tiny_config(ROPES["default"]))(x, pos)


# ----------------------------------------------------------------------------- attention


class Capture:
    """An attention implementation that records what transformers hands it, then runs
    :func:`companion.hf.attention_forward`; registered with or without the mask function."""

    def __init__(self, name: str, with_mask: bool) -> None:
        self.calls: list[tuple] = []
        AttentionInterface.register(name, self)
        if with_mask:
            AttentionMaskInterface.register(name, AttentionMaskInterface()[chf.ATTENTION_NAME])
        self.name = name

    def __call__(self, module, query, key, value, attention_mask, **kw):
        out = chf.attention_forward(module, query, key, value, attention_mask, **kw)
        self.calls.append((query.detach(), key.detach(), value.detach(), attention_mask, kw.get("scaling"), out[0]))
        return out


def float64_oracle(model, ids, mask, pos, mask4_64=None):
    """The float64 logits of the same model with transformers' SDPA attention (float64
    throughout; its eager attention computes the softmax in float32)."""
    m64 = copy.deepcopy(model).to(torch.float64)
    m64.set_attn_implementation("sdpa")
    with torch.no_grad():
        return m64(ids, attention_mask=mask if mask4_64 is None else mask4_64, position_ids=pos).logits


@pytest.mark.parametrize("rope_type", sorted(ROPES))
def test_companion_attention_on_a_left_padded_batch(rope_type):
    model = tiny_model(ROPES[rope_type], seed=1)
    length = 80 if rope_type in ("dynamic", "longrope") else 24  # past the lengths where the frequencies change
    ids = token_ids(3, length, seed=1)
    mask, pos = left_padded(length)
    keep = mask.bool()
    capture = Capture("companion-capture", with_mask=True)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, position_ids=pos).logits
        model.set_attn_implementation(capture.name)
        ours = model(ids, attention_mask=mask, position_ids=pos).logits
    exact = float64_oracle(model, ids, mask, pos)
    # 1. each attention call: within the derived float32 bound of the float64 attention of the
    #    same inputs (helpers.attention_out_bound: rounding of the logits, softmax, sums)
    assert len(capture.calls) == 2
    for q, k, v, m, scale, out in capture.calls:
        assert m is not None and m.dtype == torch.bool and m.shape == (3, 1, length, length)
        assert scale == HEAD_DIM**-0.5
        out = out.transpose(1, 2).double()
        with torch.no_grad():
            ref = attention(q.double(), k.double(), v.double(), None, attn_mask=m, scale=scale)
        bound = attention_out_bound(q, k, v, None, mask=m, scale=scale)
        assert bool(((out - ref).abs() <= bound).all()), f"max excess {float(((out - ref).abs() - bound).max()):.3g}"
    # 2. the logits of the real tokens: the float32 eager model's distance from float64 (d32)
    #    measures how this network amplifies roundoff; another float32 computation of the same
    #    function is within about d32 of float64 too (x2 margin), so within about 2 d32 of
    #    eager (x2 margin). The pad rows attend to nothing and are not compared.
    d32 = (eager.double() - exact)[keep].abs().max().item()
    assert 0 < d32 < 1e-4
    assert (ours.double() - exact)[keep].abs().max().item() <= 2 * d32
    assert (ours - eager)[keep].abs().max().item() <= 4 * d32


def test_without_the_mask_function_the_padding_leaks_in():
    """The trap: an attention registered alone gets attention_mask=None from transformers."""
    model = tiny_model(ROPES["default"], seed=2)
    ids = token_ids(3, 24, seed=2)
    mask, pos = left_padded(24)
    keep = mask.bool()
    bare = Capture("companion-no-mask", with_mask=False)
    with torch.no_grad():
        model.set_attn_implementation(chf.ATTENTION_NAME)
        ours = model(ids, attention_mask=mask, position_ids=pos).logits
        model.set_attn_implementation(bare.name)
        leaky = model(ids, attention_mask=mask, position_ids=pos).logits
    exact = float64_oracle(model, ids, mask, pos)
    assert all(call[3] is None for call in bare.calls)  # no mask reached the attention
    right = (ours.double() - exact)[keep].abs().max().item()
    wrong = (leaky.double() - exact)[keep].abs().max().item()
    assert right < 1e-5 and wrong > 0.1 and wrong > 1e4 * right
    # the unpadded row is the same either way: only the padded rows go wrong
    assert (leaky[0] - ours[0]).abs().max().item() <= 1e-5


def test_kv_cache_decoding_with_the_companion_attention():
    model = tiny_model(ROPES["llama3"], seed=3, attn_implementation=chf.ATTENTION_NAME)
    ids = token_ids(1, 20, seed=3)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :12], use_cache=True)
        steps = [out.logits]
        cache = out.cache
        for i in range(12, 20):
            out = model(ids[:, i:i + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
    stepped = torch.cat(steps, dim=1)
    exact = float64_oracle(model, ids, None, None)
    # both float32 paths are within about d32 of float64 (see the padded-batch test)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        d32 = (model(ids).logits.double() - exact).abs().max().item()
    assert (stepped.double() - exact).abs().max().item() <= 2 * d32
    assert (full.double() - exact).abs().max().item() <= 2 * d32


def test_attention_refuses_what_it_does_not_have():
    model = tiny_model(ROPES["default"])
    layer = model.model.layers[0].self_attn
    q, k, v = torch.zeros(1, HEADS, 3, HEAD_DIM), torch.zeros(1, KV_HEADS, 3, HEAD_DIM), torch.zeros(1, KV_HEADS, 3, HEAD_DIM)
    with pytest.raises(ValueError, match="dropout must be 0"):
        chf.attention_forward(layer, q, k, v, None, scaling=0.25, dropout=0.1)
    for name in ("softcap", "s_aux", "position_bias"):
        with pytest.raises(ValueError, match=f"no '{name}'"):
            chf.attention_forward(layer, q, k, v, None, scaling=0.25, **{name: torch.ones(1)})
    out, weights = chf.attention_forward(layer, q, k, v, None, scaling=0.25)
    assert out.shape == (1, 3, HEADS, HEAD_DIM) and weights is None


@pytest.mark.parametrize("name, exc", [("sdpa", ValueError), ("eager", ValueError), ("", ValueError),
                                       ("paged|sdpa", ValueError), (3, TypeError)])
def test_register_refuses_builtin_names(name, exc):
    with pytest.raises(exc, match="name"):
        chf.register(name)


def test_register_another_name():
    assert chf.register("companion-other") == "companion-other"
    model = tiny_model(ROPES["default"], attn_implementation="companion-other")
    mask, pos = left_padded(12)
    with torch.no_grad():
        a = model(token_ids(3, 12), attention_mask=mask, position_ids=pos).logits
        model.set_attn_implementation(chf.ATTENTION_NAME)
        b = model(token_ids(3, 12), attention_mask=mask, position_ids=pos).logits
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- position-bias schemes


def alibi_reference(length: int) -> torch.Tensor:
    """ALiBi's bias for 4 heads, the paper's slopes 2 ** (-8 h / n), ``-m |i - j|``, float64."""
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)], dtype=torch.float64)
    i = torch.arange(length)
    return -slopes[:, None, None] * (i[:, None] - i[None, :]).abs()


SCHEMES = {
    "alibi": lambda: (ALiBi(HEADS), alibi_reference),
    "t5": lambda: (T5RelativeBias(HEADS, num_buckets=8, max_distance=16, bidirectional=False), None),
    "kerple": lambda: (KerpleBias(HEADS), None),
}


def bias_mask(bias: torch.Tensor, attn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 4-D float mask for transformers' own attention: the bias where a key is visible,
    the dtype's most negative number elsewhere (transformers' convention)."""
    length = attn.shape[-1]
    i = torch.arange(length)
    allowed = (i[None, :] <= i[:, None])[None] & attn.bool()[:, None, :]  # (batch, q, k)
    return torch.where(allowed[:, None], bias.to(dtype)[None], torch.finfo(dtype).min)


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("length", [24, 600])
def test_bias_schemes_against_transformers_given_the_bias_as_a_mask(name, length):
    torch.manual_seed(4)
    scheme, reference = SCHEMES[name]()
    model = tiny_model(ROPES["default"], seed=4, max_position_embeddings=1024, attn_implementation=chf.ATTENTION_NAME)
    assert chf.use_scheme(model, scheme, rope=False) is model
    pads = (0, 5) if length > 100 else (0, 4, 9)
    ids = token_ids(len(pads), length, seed=4)
    mask, pos = left_padded(length, pads)
    keep = mask.bool()
    idx = torch.arange(length)
    with torch.no_grad():
        bias64 = reference(length) if reference else copy.deepcopy(scheme).double().bias(idx, idx)
        ours = model(ids, attention_mask=mask, position_ids=pos).logits
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=bias_mask(bias64, mask, torch.float32), position_ids=pos).logits
    exact = float64_oracle(model, ids, mask, pos, bias_mask(bias64, mask, torch.float64))
    d32 = (eager.double() - exact)[keep].abs().max().item()
    assert 0 < d32 < 1e-4
    assert (ours.double() - exact)[keep].abs().max().item() <= 2 * d32
    # the path the attention takes: SDPA with the bias as a mask at short lengths, the
    # blockwise one past companion.dispatch.SDPA_BIAS_PAIRS pairs
    q = torch.zeros(len(pads), HEADS, length, HEAD_DIM)
    kv = torch.zeros(len(pads), KV_HEADS, length, HEAD_DIM)
    m = mask.bool()[:, None, None, :] & (idx[None, :] <= idx[:, None])
    with torch.no_grad():
        path = attention_path(q, kv, kv, scheme, attn_mask=m)
    assert path == ("blockwise" if length * length > SDPA_BIAS_PAIRS else "sdpa-bias")
    # not vacuous: without the scheme the model is another function
    model.set_attn_implementation(chf.ATTENTION_NAME)
    chf.use_scheme(model, None)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, position_ids=pos).logits
    assert (plain.double() - exact)[keep].abs().max().item() > 1e3 * d32


def test_use_scheme_keeps_rope_by_default():
    model = tiny_model(ROPES["default"], attn_implementation=chf.ATTENTION_NAME)
    rotary = model.model.rotary_emb
    chf.use_scheme(model, ALiBi(HEADS))
    assert model.model.rotary_emb is rotary
    assert all(layer.self_attn.companion_scheme is not None for layer in model.model.layers)
    chf.use_scheme(model, None, rope=False)  # a swapped rotary module is found too
    assert isinstance(model.model.rotary_emb, chf.HFRotaryEmbedding) and model.model.rotary_emb.identity
    assert all(layer.self_attn.companion_scheme is None for layer in model.model.layers)


@pytest.mark.parametrize("make, kw, exc, match", [
    (lambda m: ALiBi(HEADS), {}, ValueError, "attn_implementation is 'sdpa'"),
    (lambda m: RotaryEmbedding(HEAD_DIM), {}, ValueError, "only the 'bias' hook"),
    (lambda m: ALiBi(HEADS + 1), {}, ValueError, "built for 5 heads"),
    (lambda m: "alibi", {}, TypeError, "scheme must be a companion PositionScheme"),
    (lambda m: ALiBi(HEADS), {"rope": "no"}, TypeError, "rope must be a bool"),
])
def test_use_scheme_errors(make, kw, exc, match):
    implementation = "sdpa" if "sdpa" in match else chf.ATTENTION_NAME
    model = tiny_model(ROPES["default"], attn_implementation=implementation)
    with pytest.raises(exc, match=match):
        chf.use_scheme(model, make(model), **kw)


def test_use_scheme_needs_a_model():
    with pytest.raises(TypeError, match="model must be a transformers model"):
        chf.use_scheme("model", ALiBi(HEADS))
    with pytest.raises(ValueError, match="no attention layers"):
        empty = torch.nn.Linear(2, 2)
        empty.config = tiny_config(ROPES["default"], attn_implementation=chf.ATTENTION_NAME)
        chf.use_scheme(empty, ALiBi(HEADS))


# ----------------------------------------------------------------------------- bf16


def test_bf16_tables_are_rounded_as_transformers_rounds_them():
    """transformers returns bf16 tables for bf16 activations and the module does the same,
    bit for bit; the package's own rotation reads float32 tables instead (the book's page on
    transformers measures the difference)."""
    config = tiny_config(ROPES["llama3"], max_position_embeddings=131072)
    pos = torch.tensor([[0, 5, 131071]])
    x = torch.zeros(1, dtype=torch.bfloat16)
    theirs = LlamaRotaryEmbedding(config)(x, pos)
    ours = chf.rotary_embedding(config)(x, pos)
    full = chf.rotary_embedding(config)(x.float(), pos)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert all(torch.equal(a, b.bfloat16()) for a, b in zip(ours, full, strict=True))
    assert not torch.equal(ours[0].float(), full[0])  # the bf16 tables are rounded


# ----------------------------------------------------------------------------- SmolLM2 from its GGUF

MODEL = pt.cached_smollm2_path()
needs_model = pytest.mark.skipif(
    not MODEL.is_file(), reason=f"SmolLM2 GGUF not cached at {MODEL}; run `python -m companion.pretrained fetch`")
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="session")
def smol_both(smollm2_gguf, smollm2_weights64):
    """SmolLM2-135M loaded twice from the cached GGUF: by transformers (``gguf_file=``, its own
    dequantisation, float32) and by companion.llama; plus a float64 companion copy (the
    reference for the rounding bound) and the prompt's token ids."""
    from companion import llama

    t0 = time.perf_counter()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL.parent), gguf_file=MODEL.name,
                                                               dtype=torch.float32).eval()
    t1 = time.perf_counter()
    config, weights, _, tokenizer = smollm2_gguf       # read once per test process (conftest)
    ours = llama.build_model(config, weights, "half")
    ours64 = llama.build_model(config, smollm2_weights64, "half")
    ids = torch.tensor([tokenizer.encode(PROMPT).ids])
    print(f"\ntransformers loaded the GGUF in {t1 - t0:.1f} s, companion.llama in {time.perf_counter() - t1:.1f} s")
    return theirs, ours, ours64, ids


@needs_model
def test_smollm2_from_the_gguf_gives_the_same_logits_in_both(smol_both):
    theirs, ours, ours64, ids = smol_both
    assert theirs.config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    with torch.no_grad():
        hf = theirs(ids).logits
        ref = ours(ids)
        exact = ours64(ids)
    # The two load the same weights and compute the same function in float32: each within
    # about d32 of float64 (d32: the float32 model's own distance, as in tests/test_llama.py),
    # so within 2 d32 of each other (x2 margin). Measured: 0, the same operations bit for bit.
    d32 = (ref.double() - exact).abs().max().item()
    diff = (hf - ref).abs().max().item()
    print(f"SmolLM2 on {ids.shape[1]} tokens: max |transformers - companion.llama| = {diff:.3g}, "
          f"float32 vs float64 {d32:.2g}, max |logits| {exact.abs().max().item():.1f}")
    assert 0 < d32 < 1e-2
    assert diff <= 4 * d32 and (hf.double() - exact).abs().max().item() <= 2 * d32
    assert torch.equal(hf.argmax(-1), ref.argmax(-1))


@needs_model
def test_smollm2_with_the_companion_rotary_and_attention(smol_both):
    theirs, _, ours64, ids = smol_both
    original = theirs.model.rotary_emb  # the fixture's model: restored below
    try:
        with torch.no_grad():
            want = theirs(ids).logits
            theirs.model.rotary_emb = chf.rotary_embedding(theirs.config)
            swapped = theirs(ids).logits
            theirs.set_attn_implementation(chf.ATTENTION_NAME)
            both = theirs(ids).logits
            exact = ours64(ids)
    finally:
        theirs.model.rotary_emb = original
        theirs.set_attn_implementation("sdpa")
    assert torch.equal(swapped, want)
    d32 = (want.double() - exact).abs().max().item()  # as in the test above
    assert 0 < d32 < 1e-2
    assert (both.double() - exact).abs().max().item() <= 2 * d32
