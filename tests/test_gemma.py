"""companion.gemma: Gemma 3 against an independent float64 reimplementation of its formulas.

A tiny random Gemma-shaped model is built here (no download): the norms, the QK-norm, RoPE
with two bases, the sliding window, grouped-query attention, GeGLU and the whole forward pass
are checked against code written in this file from the formulas. The GGUF reader runs on a
tiny file written with ``gguf.GGUFWriter``, and the tokenizer on a tiny SentencePiece
vocabulary against llama.cpp's SPM algorithm written out here. The tests on the real Gemma 3
270M file skip unless it is cached (``python -m companion.pretrained fetch --model gemma3``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from companion import gemma as gm
from companion import pretrained as pt
from companion.llama import KVCache
from companion.scaling import compute_inv_freq

torch.set_num_threads(1)

TINY = dict(vocab_size=40, dim=32, n_layers=6, n_heads=4, n_kv_heads=2, hidden_dim=48, head_dim=16,
            norm_eps=1e-6, context_length=64, rope_base=1e6, rope_local_base=1e4, sliding_window=4,
            sliding_window_pattern=3, bos_id=2, eos_id=1)


def tiny_config(**kw) -> gm.GemmaConfig:
    return gm.GemmaConfig(**{**TINY, **kw})


def random_weights(cfg: gm.GemmaConfig, seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Random weights by name; norm weights are ``1 + w`` with ``w`` random (as the GGUF stores them)."""
    g = torch.Generator().manual_seed(seed)
    model = gm.GemmaModel(cfg, device="meta")
    out = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):
            out[name] = (1 + 0.5 * torch.randn(p.shape, generator=g)).to(dtype)
        else:
            out[name] = (torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])).to(dtype)
    return out


def tiny_model(seed: int = 0, **kw) -> tuple[gm.GemmaModel, dict[str, torch.Tensor]]:
    cfg = tiny_config(**kw)
    w = random_weights(cfg, seed)
    return gm.build_model(cfg, w), w


# ----------------------------------------------------------------------------- the reference


def ref_rmsnorm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_rope(x, pos, base):
    """Half-split (NeoX) rotation of the last dim of x (..., seq, d) at integer positions."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[:, None] * inv[None, :]
    c, s = torch.cos(ang), torch.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def ref_gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def ref_mask(t, window):
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    vis = j <= i
    if window is not None:
        vis &= (i - j) < window
    return vis


def ref_attention(x, w, p, cfg, layer, inv_freq=None):
    """One attention sublayer from the formulas (float64); ``inv_freq`` overrides the base."""
    t = x.shape[0]
    H, Hk, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    glob = (layer + 1) % cfg.sliding_window_pattern == 0
    base = cfg.rope_base if glob else cfg.rope_local_base
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, H, d).transpose(0, 1)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(t, Hk, d).transpose(0, 1)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, Hk, d).transpose(0, 1)
    q = ref_rmsnorm(q, w[p + "self_attn.q_norm.weight"], cfg.norm_eps)
    k = ref_rmsnorm(k, w[p + "self_attn.k_norm.weight"], cfg.norm_eps)
    pos = torch.arange(t)
    if inv_freq is None:
        q, k = ref_rope(q, pos, base), ref_rope(k, pos, base)
    else:  # the same rotation from given frequencies
        ang = pos.double()[:, None] * inv_freq.double()[None, :]
        c, s = torch.cos(ang), torch.sin(ang)

        def rot(z):
            z1, z2 = z[..., : d // 2], z[..., d // 2:]
            return torch.cat((z1 * c - z2 * s, z2 * c + z1 * s), dim=-1)

        q, k = rot(q), rot(k)
    mask = ref_mask(t, None if glob else cfg.sliding_window)
    outs = []
    for h in range(H):
        kh, vh = k[h // (H // Hk)], v[h // (H // Hk)]
        s = (q[h] @ kh.T) / math.sqrt(cfg.head_dim)
        s = s.masked_fill(~mask, float("-inf"))
        outs.append(torch.softmax(s, -1) @ vh)
    y = torch.stack(outs, 1).reshape(t, H * d)
    return y @ w[p + "self_attn.o_proj.weight"].T


def ref_logits(ids, w, cfg, inv_freqs=None):
    """The whole forward pass from the formulas (float64), ids 1-D."""
    x = w["embed_tokens.weight"][ids] * math.sqrt(cfg.dim)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        a = ref_attention(ref_rmsnorm(x, w[p + "input_layernorm.weight"], cfg.norm_eps), w, p, cfg, i,
                          None if inv_freqs is None else inv_freqs[i])
        h = x + ref_rmsnorm(a, w[p + "post_attention_layernorm.weight"], cfg.norm_eps)
        z = ref_rmsnorm(h, w[p + "pre_feedforward_layernorm.weight"], cfg.norm_eps)
        m = (ref_gelu_tanh(z @ w[p + "mlp.gate_proj.weight"].T) * (z @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        x = h + ref_rmsnorm(m, w[p + "post_feedforward_layernorm.weight"], cfg.norm_eps)
    x = ref_rmsnorm(x, w["norm.weight"], cfg.norm_eps)
    return x @ w["embed_tokens.weight"].T


IDS = torch.tensor([2, 5, 17, 9, 30, 3, 11, 11, 25, 7, 39, 0, 14])


# ----------------------------------------------------------------------------- architecture


def test_layer_types_follow_the_pattern():
    cfg = tiny_config(n_layers=18, sliding_window_pattern=6)
    glob = [i for i in range(18) if cfg.is_global(i)]
    assert glob == [5, 11, 17]  # HuggingFace's (i + 1) % 6 == 0, llama.cpp's il % 6 == 5
    assert cfg.types[5] == "full_attention" and cfg.types[0] == "sliding_attention"
    assert all(t == "full_attention" for t in tiny_config(sliding_window=None).types)
    assert all(t == "full_attention" for t in tiny_config(sliding_window_pattern=1).types)
    explicit = ("full_attention",) + ("sliding_attention",) * 5
    assert tiny_config(layer_types=explicit).types == explicit
    assert cfg.scale == 16 ** -0.5 and tiny_config(query_pre_attn_scalar=64.0).scale == 0.125


def test_model_matches_the_reference_float64():
    model, w = tiny_model()
    cfg = model.config
    got = model(IDS[None])[0]
    want = ref_logits(IDS, w, cfg)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_each_layer_matches_the_reference():
    model, w = tiny_model(seed=1)
    cfg = model.config
    x = torch.randn(len(IDS), cfg.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for i, block in enumerate(model.layers):
        p = f"layers.{i}."
        got = block.self_attn(x[None], model.rope_for(i), 0, None)[0]
        torch.testing.assert_close(got, ref_attention(x, w, p, cfg, i), rtol=1e-10, atol=1e-10)
        z = ref_rmsnorm(x, w[p + "pre_feedforward_layernorm.weight"], cfg.norm_eps)
        mlp = (ref_gelu_tanh(z @ w[p + "mlp.gate_proj.weight"].T) * (z @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        torch.testing.assert_close(block.mlp(block.pre_feedforward_layernorm(x)), mlp, rtol=1e-10, atol=1e-10)


def test_local_and_global_layers_differ_in_mask_and_base():
    """Perturbing a token outside the window changes a local layer's output at a later query
    only through a global layer; and each kind uses its own RoPE base."""
    model, _ = tiny_model(seed=2)
    cfg = model.config
    assert [model.rope_for(i) is model.rope_global for i in range(6)] == [False, False, True, False, False, True]
    assert model.rope_local.base == 1e4 and model.rope_global.base == 1e6
    x = torch.randn(1, 10, cfg.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0, 0] += 1.0  # position 0 is outside the window (4) of query 9
    for i in (0, 2):
        att = model.layers[i].self_attn
        a, b = att(x, model.rope_for(i), 0, None), att(y, model.rope_for(i), 0, None)
        changed = (a - b).abs().amax(-1)[0] > 1e-12
        if cfg.is_global(i):
            assert changed.all()
        else:
            assert changed.tolist() == [True] * 4 + [False] * 6


def test_global_layers_see_the_whole_prefix_local_only_the_window():
    for glob in (True, False):
        window = None if glob else 4
        q = torch.randn(1, 2, 9, 8, dtype=torch.float64)
        k = torch.randn(1, 1, 9, 8, dtype=torch.float64)
        v = torch.randn(1, 1, 9, 8, dtype=torch.float64)
        out = gm.sliding_window_attention(q, k, v, window, block=2)
        mask = ref_mask(9, window)
        s = (q[0] @ k[0].transpose(-1, -2)) / math.sqrt(8)
        want = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v[0]
        torch.testing.assert_close(out[0], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t, n, window, block", [(7, 7, 3, 2), (7, 7, 1, 3), (3, 10, 4, 2), (1, 10, 4, 512),
                                                  (10, 10, 100, 4), (5, 12, 12, 1), (12, 12, 5, 5)])
def test_sliding_window_attention_against_a_dense_mask(t, n, window, block):
    g = torch.Generator().manual_seed(t * 100 + n)
    q = torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, n, 6, generator=g, dtype=torch.float64)
    got = gm.sliding_window_attention(q, k, v, window, scale=0.3, block=block)
    qp = torch.arange(n - t, n)[:, None]
    kp = torch.arange(n)[None, :]
    vis = (kp <= qp) & (qp - kp < window)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kk.transpose(-1, -2) * 0.3).masked_fill(~vis, float("-inf"))
    torch.testing.assert_close(got, torch.softmax(s, -1) @ vv, rtol=1e-12, atol=1e-12)


def test_norm_weights_one_plus_w():
    """GGUF norms hold 1 + w and are used as they are; HuggingFace's w need norm_offset=1."""
    cfg = tiny_config()
    w = random_weights(cfg, seed=4)
    raw = {k: (v - 1 if k.endswith("norm.weight") else v) for k, v in w.items()}
    a = gm.build_model(cfg, w)(IDS[None])
    b = gm.build_model(cfg, raw, norm_offset=1.0)(IDS[None])
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    wrong = gm.build_model(cfg, raw)(IDS[None])  # raw w without the 1: another model
    assert (a - wrong).abs().max() > 1e-2
    assert raw["norm.weight"] is not w["norm.weight"]


def test_norms_look_shifted_on_bfloat16_weights():
    g = torch.Generator().manual_seed(0)
    w = {f"layers.{i}.input_layernorm.weight": (3 * torch.randn(64, generator=g)).to(torch.bfloat16).float()
         for i in range(3)}
    w["embed.weight"] = torch.randn(4, 4)  # not a norm: ignored
    assert not gm.norms_look_shifted(w)
    assert gm.norms_look_shifted({k: v + 1 for k, v in w.items()})


def test_embedding_is_scaled_by_sqrt_dim():
    model, w = tiny_model()
    torch.testing.assert_close(model.embed(IDS[None])[0], w["embed_tokens.weight"][IDS] * math.sqrt(32))


def test_token_nll_chunked_equals_one_pass():
    model, w = tiny_model(seed=5)
    ids = torch.randint(0, 40, (2, 23), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    ref = torch.stack([torch.nn.functional.cross_entropy(ref_logits(r, w, model.config)[:-1], r[1:], reduction="none")
                       for r in ids])
    torch.testing.assert_close(want, ref, rtol=1e-10, atol=1e-10)
    for chunk in (1, 3, 7, 22, 512):  # chunks shorter than the window trim the local layers' keys
        torch.testing.assert_close(model.token_nll(ids, chunk=chunk), want, rtol=1e-10, atol=1e-10)


def test_generate_is_greedy_over_the_full_forward():
    model, _ = tiny_model(seed=6)
    ids = IDS[None, :5]
    out = model.generate(ids, 8, stop_at_eos=False)
    seq = ids
    for _ in range(8):  # no cache: the whole sequence every step
        seq = torch.cat((seq, model(seq)[:, -1].argmax(-1, keepdim=True)), 1)
    assert torch.equal(out, seq)
    assert model.generate(ids, 0).shape == (1, 5)


def test_rope_scaling_on_global_layers_only_or_all():
    model, w = tiny_model(seed=7)
    cfg = model.config
    linear = {"rope_type": "linear", "factor": 4.0}
    model.set_rope_config(linear)  # layers="global"
    inv_g, _ = compute_inv_freq({**linear, "rope_theta": 1e6}, 16, max_position_embeddings=64)
    inv_l, _ = compute_inv_freq({"rope_type": "default", "rope_theta": 1e4}, 16)
    torch.testing.assert_close(model.rope_global.inv_freq, inv_g)
    torch.testing.assert_close(model.rope_local.inv_freq, inv_l)
    freqs = [inv_g if cfg.is_global(i) else inv_l for i in range(6)]
    torch.testing.assert_close(model(IDS[None])[0], ref_logits(IDS, w, cfg, freqs), rtol=1e-6, atol=1e-6)
    model.set_rope_config(linear, layers="all")
    inv_la, _ = compute_inv_freq({**linear, "rope_theta": 1e4}, 16, max_position_embeddings=64)
    torch.testing.assert_close(model.rope_local.inv_freq, inv_la)
    assert model.rope_layers == "all"
    model.set_rope_config(None)
    torch.testing.assert_close(model(IDS[None])[0], ref_logits(IDS, w, cfg), rtol=1e-6, atol=1e-6)


def test_softcapping_when_configured():
    cfg = tiny_config(final_logit_softcapping=2.0)
    w = random_weights(cfg, seed=8)
    got = gm.build_model(cfg, w)(IDS[None])[0]
    torch.testing.assert_close(got, 2.0 * torch.tanh(ref_logits(IDS, w, cfg) / 2.0), rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- a tiny GGUF file


def _tiny_vocab(tie: bool = False):
    """A SentencePiece-style vocabulary: controls, 256 bytes, user-defined runs, pieces with
    distinct scores (as Gemma's are), or with ``tie`` two pieces of one score."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 3] + [6] * 256
    scores = [-1000.0] * 4 + [0.0] * 256
    for t in ("\n", "\n\n", "  ", "   "):
        tokens.append(t), types.append(4), scores.append(-1000.0)
    tokens.append("<start_of_turn>"), types.append(3), scores.append(-1000.0)
    pieces = ["\u2581", "a", "b", "c", "d", "\u2581a", "ab", "bc", "abc", "\u2581ab", "\u2581abc", "ca", "cab",
              "aa", "aaa", "\u2581b", "d\u2581", "bcd", "é"]
    for rank, t in enumerate(pieces):
        tokens.append(t), types.append(1), scores.append(-float(rank))
    if tie:
        scores[tokens.index("ca")] = scores[tokens.index("ab")]
    return tokens, scores, types


def ref_spm(text, tokens, scores, types, bos=2):
    """llama.cpp's SPM tokenizer (llm_tokenizer_spm) written out: special pieces split off
    longest first, spaces as U+2581, the best-scoring adjacent merge first (ties: leftmost),
    resegmentation into bytes for pieces that are no token."""
    vocab = {t: i for i, t in enumerate(tokens)}
    frags = [(False, text)]
    for sp in sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len, reverse=True):
        new = []
        for is_tok, f in frags:
            if is_tok:
                new.append((True, f))
                continue
            for k, part in enumerate(f.split(sp)):
                if k:
                    new.append((True, sp))
                if part:
                    new.append((False, part))
        frags = new
    out = [bos]
    for is_tok, f in frags:
        if is_tok:
            out.append(vocab[f])
            continue
        syms, rev = list(f.replace(" ", "\u2581")), {}
        while True:
            best = None
            for i in range(len(syms) - 1):
                t = syms[i] + syms[i + 1]
                if t in vocab and (best is None or scores[vocab[t]] > best[0]):
                    best = (scores[vocab[t]], i)
            if best is None:
                break
            i = best[1]
            rev[syms[i] + syms[i + 1]] = (syms[i], syms[i + 1])
            syms[i:i + 2] = [syms[i] + syms[i + 1]]

        def reseg(s):
            if s in vocab:
                out.append(vocab[s])
            elif s in rev:
                reseg(rev[s][0]), reseg(rev[s][1])
            else:
                out.extend(vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8"))

        for s in syms:
            reseg(s)
    return out


def _tiny_fields(tie: bool = False):
    tokens, scores, types = _tiny_vocab(tie)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": False}


TEXTS = ["abc", " abc abc", "cab", "abcab", "a  b\n\nc", "xyz", "é and ü", "<start_of_turn>ab\n",
         "aaaa aaaaa", "bcd d d", "ab   cab    abc", "", "\n\n\n", " ", "ca ab caab"]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_llama_cpp_spm_on_a_tiny_vocabulary(text):
    fields = _tiny_fields()
    tok = gm.gguf_tokenizer(fields)
    ids = tok.encode(text).ids
    assert ids == ref_spm(text, fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"],
                          fields["tokenizer.ggml.token_type"])
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<start_of_turn>", "")


def test_tied_scores_rank_by_token_id():
    """The one documented difference: two pieces of equal score. llama.cpp merges the leftmost
    pair of the two, the BPE the piece of the smaller id everywhere first (Gemma's normal
    pieces have distinct scores, so it never arises there)."""
    fields = _tiny_fields(tie=True)
    tokens = fields["tokenizer.ggml.tokens"]
    ours = [tokens[i] for i in gm.gguf_tokenizer(fields).encode("abcab").ids]
    theirs = [tokens[i] for i in ref_spm("abcab", *_tiny_vocab(tie=True))]
    assert ours == ["<bos>", "abc", "ab"] and theirs == ["<bos>", "ab", "cab"]
    assert [tokens[i] for i in ref_spm("abcab", *_tiny_vocab())] == ["<bos>", "abc", "ab"]


def test_tokenizer_known_ids():
    fields = _tiny_fields()
    tokens = fields["tokenizer.ggml.tokens"]
    tok = gm.gguf_tokenizer(fields)
    name = [tokens[i] for i in tok.encode(" abc x").ids]
    assert name == ["<bos>", "\u2581abc", "\u2581", "<0x78>"]  # 'x' has no piece: byte fallback
    assert [tokens[i] for i in tok.encode("ab", add_special_tokens=False).ids] == ["ab"]
    assert [tokens[i] for i in tok.encode("  a").ids] == ["<bos>", "  ", "a"]  # user-defined run split first
    no_bos = gm.gguf_tokenizer({**fields, "tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("ab").ids == [tokens.index("ab")]
    prefix = gm.gguf_tokenizer({**fields, "tokenizer.ggml.add_space_prefix": True})
    assert [tokens[i] for i in prefix.encode("abc").ids] == ["<bos>", "\u2581abc"]


def _write_gguf(path, cfg, weights, fields, q8=True):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.hidden_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_sliding_window(cfg.sliding_window)
    w.add_sliding_window_pattern(cfg.sliding_window_pattern)
    w.add_name("tiny gemma")
    w.add_tokenizer_model("llama")
    w.add_token_list(fields["tokenizer.ggml.tokens"])
    w.add_token_scores(fields["tokenizer.ggml.scores"])
    w.add_token_types(fields["tokenizer.ggml.token_type"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    names = {v: k for k, v in gm._BLOCK_NAMES.items()}
    stored = {}
    for name, t in weights.items():
        if name.startswith("layers."):
            _, i, *rest = name.split(".")
            gname = f"blk.{i}.{names['.'.join(rest[:-1])]}.weight"
        else:
            gname = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}[name]
        a = t.float().numpy()
        if q8 and a.ndim == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            stored[name] = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(a.shape))
        else:
            w.add_tensor(gname, a)
            stored[name] = torch.from_numpy(a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tokens = _tiny_vocab()[0]
    cfg = tiny_config(vocab_size=len(tokens), n_heads=2, n_kv_heads=1, hidden_dim=64, sliding_window_pattern=3)
    weights = random_weights(cfg, seed=9, dtype=torch.float32)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    stored = _write_gguf(path, cfg, weights, _tiny_fields())
    return path, cfg, stored


def test_read_gguf_round_trip(tiny_gguf):
    gguf = pytest.importorskip("gguf")
    path, cfg, stored = tiny_gguf
    got_cfg, weights, fields = gm.read_gguf(path)
    assert got_cfg.types == cfg.types and got_cfg.name == "tiny gemma"
    for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "head_dim", "context_length",
              "rope_base", "rope_local_base", "sliding_window", "bos_id", "eos_id"):
        assert getattr(got_cfg, f) == getattr(cfg, f), f
    assert got_cfg.query_pre_attn_scalar == 16.0 and got_cfg.norm_eps == pytest.approx(1e-6)
    assert sorted(weights) == sorted(stored)
    for name, t in stored.items():
        assert torch.equal(weights[name], t), name  # Q8_0 in torch equals gguf's dequantize
    reader = gguf.GGUFReader(str(path))  # the fast header parser reads what gguf reads
    for name, field in reader.fields.items():
        if not name.startswith("GGUF."):
            assert fields[name] == field.contents() and type(fields[name]) is type(field.contents()), name
    model = gm.build_model(got_cfg, weights)
    ids = torch.tensor([2, 270, 271, 282, 266, 283])
    torch.testing.assert_close(model(ids[None])[0].double(),
                               ref_logits(ids, {k: v.double() for k, v in stored.items()}, cfg),
                               rtol=1e-4, atol=1e-4)
    tok = gm.gguf_tokenizer(fields)
    assert tok.encode(" abc").ids == ref_spm(" abc", *_tiny_vocab())


def test_from_gguf_fields_pattern_as_bools_and_no_window():
    fields = {"general.architecture": "gemma3", "gemma3.attention.head_count": 2, "gemma3.embedding_length": 8,
              "gemma3.block_count": 3, "gemma3.feed_forward_length": 16, "gemma3.context_length": 32,
              "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "tokenizer.ggml.tokens": ["a", "b", "c"],
              "gemma3.attention.sliding_window": 4,
              "gemma3.attention.sliding_window_pattern": [True, False, True]}
    cfg = gm.GemmaConfig.from_gguf_fields(fields)
    assert cfg.types == ("sliding_attention", "full_attention", "sliding_attention")
    assert cfg.head_dim == 4 and cfg.rope_base == 1e6 and cfg.rope_local_base == 1e4
    fields["gemma3.attention.sliding_window_pattern"] = 2
    assert gm.GemmaConfig.from_gguf_fields(fields).types[1] == "full_attention"
    fields["gemma3.attention.sliding_window"] = 0
    assert gm.GemmaConfig.from_gguf_fields(fields).types[0] == "full_attention"
    fields["gemma3.final_logit_softcapping"] = 30.0
    assert gm.GemmaConfig.from_gguf_fields(fields).final_logit_softcapping == 30.0


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kw, err, match", [
    (dict(dim=True), TypeError, "dim"),
    (dict(n_layers=0), ValueError, "n_layers"),
    (dict(n_heads=3), ValueError, "multiple of n_kv_heads"),
    (dict(head_dim=15), ValueError, "head_dim must be even"),
    (dict(rope_local_base=1.0), ValueError, "rope_local_base"),
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(sliding_window="512"), TypeError, "sliding_window"),
    (dict(norm_eps=float("nan")), ValueError, "norm_eps"),
    (dict(query_pre_attn_scalar=0.0), ValueError, "query_pre_attn_scalar"),
    (dict(layer_types=("full_attention",)), ValueError, "one entry per layer"),
    (dict(layer_types=("local",) * 6), ValueError, r"layer_types\[0\]"),
    (dict(layer_types="full_attention"), TypeError, "layer_types"),
    (dict(bos_id=40), ValueError, r"bos_id must lie in \[0, 40\)"),
    (dict(add_bos=1), TypeError, "add_bos"),
])
def test_config_rejects(kw, err, match):
    with pytest.raises(err, match=match):
        tiny_config(**kw)


def test_bad_inputs_are_named():
    model, w = tiny_model()
    cfg = model.config
    with pytest.raises(IndexError, match=r"layer must lie in \[0, 6\)"):
        cfg.is_global(6)
    with pytest.raises(TypeError, match="layer must be an int"):
        cfg.is_global(True)
    with pytest.raises(TypeError, match="cfg must be a GemmaConfig"):
        gm.GemmaAttention(object(), 0)
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 40\)"):
        model(torch.tensor([[1, 40]]))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        model.token_nll(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="chunk"):
        model.token_nll(IDS[None], chunk=0)
    with pytest.raises(TypeError, match="max_new_tokens"):
        model.generate(IDS[None], 2.0)
    with pytest.raises(TypeError, match="stop_at_eos"):
        model.generate(IDS[None], 2, stop_at_eos=None)
    with pytest.raises(ValueError, match="cache has 3 layers"):
        model.hidden(IDS[None], KVCache(3))
    with pytest.raises(TypeError, match="cache must be"):
        model.hidden(IDS[None], {})
    with pytest.raises(ValueError, match="layers must be 'global' or 'all'"):
        model.set_rope_config({"rope_type": "linear", "factor": 2.0}, layers="local")
    with pytest.raises(TypeError, match="layers must be"):
        model.set_rope_config(None, layers=None)
    with pytest.raises(TypeError, match="rope_config must be a mapping"):
        model.set_rope_config("linear")
    with pytest.raises(ValueError, match="factor"):
        model.set_rope_config({"rope_type": "linear", "factor": 0.0})
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="window"):
        gm.sliding_window_attention(q, q, q, 0)
    with pytest.raises(TypeError, match="window"):
        gm.sliding_window_attention(q, q, q, True)
    with pytest.raises(ValueError, match="block"):
        gm.sliding_window_attention(q, q, q, 2, block=0)
    with pytest.raises(ValueError, match=r"q_len \(3\) must not exceed k_len \(2\)"):
        gm.sliding_window_attention(q, q[:, :, :2], q[:, :, :2], 2)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        gm.sliding_window_attention(q, [1], q, 2)


def test_build_and_read_reject_bad_input(tmp_path, tiny_gguf):
    cfg = tiny_config()
    w = random_weights(cfg)
    with pytest.raises(TypeError, match="config must be a GemmaConfig"):
        gm.build_model({}, w)
    with pytest.raises(TypeError, match="weights must be a mapping"):
        gm.build_model(cfg, [1])
    with pytest.raises(ValueError, match="lack 1 tensor"):
        gm.build_model(cfg, {k: v for k, v in w.items() if k != "norm.weight"})
    with pytest.raises(ValueError, match="has shape"):
        gm.build_model(cfg, {**w, "norm.weight": torch.ones(3)})
    with pytest.raises(TypeError, match="norm_offset"):
        gm.build_model(cfg, w, norm_offset="1")
    with pytest.raises(ValueError, match="norm_offset"):
        gm.build_model(cfg, w, norm_offset=float("inf"))
    with pytest.raises(TypeError, match="weights must be a mapping"):
        gm.norms_look_shifted(None)
    with pytest.raises(ValueError, match="no norm weight"):
        gm.norms_look_shifted({"a.weight": torch.ones(2)})
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all, not at all")
    with pytest.raises(ValueError, match=r"bad\.gguf is not a readable GGUF file"):
        gm.read_gguf(bad)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf[0].read_bytes()[:3000])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        gm.read_gguf(cut)
    with pytest.raises(FileNotFoundError):
        gm.read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="'llama' GGUF architecture|'gemma3' GGUF architecture"):
        gm.GemmaConfig.from_gguf_fields({"general.architecture": "llama"})
    with pytest.raises(TypeError, match="fields must be a mapping"):
        gm.GemmaConfig.from_gguf_fields([])
    with pytest.raises(ValueError, match="lacks 'gemma3.attention.head_count'"):
        gm.GemmaConfig.from_gguf_fields({"general.architecture": "gemma3"})
    fields = _tiny_fields()
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        gm.gguf_tokenizer({**fields, "tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        gm.gguf_tokenizer({**fields, "tokenizer.ggml.scores": [0.0]})
    with pytest.raises(ValueError, match="byte-fallback"):
        gm.gguf_tokenizer({**fields, "tokenizer.ggml.tokens": ["x" + t if t.startswith("<0x") else t
                                                               for t in fields["tokenizer.ggml.tokens"]]})
    with pytest.raises(TypeError, match="fields must be a mapping"):
        gm.gguf_tokenizer(None)


# ----------------------------------------------------------------------------- the real file

REAL = pt.cached_gemma3_path()
needs_real = pytest.mark.skipif(
    not REAL.is_file(),
    reason=f"Gemma 3 270M GGUF not cached at {REAL}; run `python -m companion.pretrained fetch --model gemma3`",
)


@pytest.fixture(scope="module")
def real():
    cfg, weights, fields = gm.read_gguf(REAL)
    return cfg, weights, fields


@needs_real
def test_real_config_and_norms(real):
    cfg, weights, fields = real
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim) == (18, 640, 4, 1, 256, 2048)
    assert (cfg.sliding_window, cfg.rope_base, cfg.rope_local_base, cfg.vocab_size) == (512, 1e6, 1e4, 262144)
    assert [i for i in range(18) if cfg.is_global(i)] == [5, 11, 17]
    assert cfg.scale == 1 / 16 and cfg.bos_id == 2 and cfg.add_bos and cfg.tie_embeddings
    assert gm.norms_look_shifted(weights)  # llama.cpp's converter stored 1 + w


@needs_real
def test_real_model_continues_a_sentence(real):
    cfg, weights, fields = real
    model = gm.build_model(cfg, weights)
    ids = [2, 818, 5279, 529, 7001, 563, 9079, 236761, 669, 5279, 529, 11702, 563]  # "The capital of France is Paris. ..."
    with torch.no_grad():
        nxt = model(torch.tensor([ids]))[0, -1].argmax().item()
    assert nxt == 13706  # " Rome"


@needs_real
def test_real_tokenizer(real):
    tok = gm.gguf_tokenizer(real[2])
    ids = tok.encode("The capital of France is Paris.\n\n    x = 1").ids
    assert ids[:8] == [2, 818, 5279, 529, 7001, 563, 9079, 236761]
    assert tok.decode(ids, skip_special_tokens=True) == "The capital of France is Paris.\n\n    x = 1"


def test_gemma3_gguf_path_names_the_fetch_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m companion\.pretrained fetch --model gemma3"):
        pt.gemma3_gguf_path(tmp_path)
