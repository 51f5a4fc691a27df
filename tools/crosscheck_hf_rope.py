"""Cross-check companion.scaling.compute_inv_freq against HuggingFace transformers v5, bit for bit.

transformers is not a dependency of the project (it is large, and the unit tests check every
method against the papers' formulas instead); this script is for whoever has it installed::

    pip install "transformers>=5,<6"
    python tools/crosscheck_hf_rope.py            # the full grid (a few thousand configs)
    python tools/crosscheck_hf_rope.py --quick    # a sample of it

For every rope type, base, head dim, rotary fraction, factor, original length and sequence
length of the grid, it builds a ``LlamaConfig`` with those ``rope_parameters``, asks
transformers for ``(inv_freq, attention_factor)`` (``ROPE_INIT_FUNCTIONS``, or the model's
``compute_default_rope_parameters`` of GPT-NeoX, which has partial rotary, for the default
type), and requires ``torch.equal`` on the
frequencies and ``==`` on the factor. Dynamic NTK is checked both with an int ``seq_len``
and with the 0-d tensor that HuggingFace's forward pass passes. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import sys
import warnings

import torch

from companion.scaling import compute_inv_freq


def hf_inv_freq(params: dict, head_dim: int, max_pos: int, seq_len):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=4, head_dim=head_dim,
                      max_position_embeddings=max_pos, rope_parameters=dict(params))
    kind = cfg.rope_parameters["rope_type"]
    if kind == "default":  # GPT-NeoX's honours partial_rotary_factor (Llama's ignores it)
        return GPTNeoXRotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)


def grid(quick: bool):
    bases = [10000.0, 500000.0, 1e6]
    head_dims = [16, 64, 80, 128]
    fractions = [1.0, 0.5, 0.25]
    factors = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    originals = [128, 2048, 4096, 8192]
    for base, hd, prf, s, orig in itertools.product(bases, head_dims, fractions, factors, originals):
        dim = int(hd * prf)
        if dim < 4 or dim % 2:
            continue
        max_pos = int(orig * s)
        common = {"rope_theta": base}
        if prf != 1.0:
            common["partial_rotary_factor"] = prf
        yield {"rope_type": "default", **common}, hd, max_pos, None
        yield {"rope_type": "linear", "factor": s, **common}, hd, max_pos, None
        for n in (None, orig // 2, orig, max_pos, 3 * max_pos + 1):
            yield {"rope_type": "dynamic", "factor": s, **common}, hd, orig, n
        for extra in ({}, {"beta_fast": 16, "beta_slow": 2}, {"truncate": False},
                      {"mscale": 1.0, "mscale_all_dim": 1.0}, {"mscale": 0.707, "mscale_all_dim": 0.707},
                      {"mscale": 1.0, "mscale_all_dim": 0.0}, {"attention_factor": 1.25}):
            yield {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": orig, **extra, **common}, hd, max_pos, None
        for lo, hi in ((1.0, 4.0), (2.0, 8.0)):
            yield ({"rope_type": "llama3", "factor": s, "low_freq_factor": lo, "high_freq_factor": hi,
                    "original_max_position_embeddings": orig, **common}, hd, max_pos, None)
        rng = random.Random(hash((base, hd, prf, s, orig)) & 0xFFFF)
        short = [round(rng.uniform(1.0, 1.5), 4) for _ in range(dim // 2)]
        long = [round(rng.uniform(1.0, s * 1.5), 4) for _ in range(dim // 2)]
        for n in (None, orig, orig + 1):
            yield ({"rope_type": "longrope", "short_factor": short, "long_factor": long,
                    "original_max_position_embeddings": orig, **common}, hd, max_pos, n)
            if s > 1:
                yield ({"rope_type": "longrope", "short_factor": short, "long_factor": long, "factor": s,
                        "original_max_position_embeddings": orig, **common}, hd, max_pos, n)


def check_module(params: dict, head_dim: int, max_pos: int, lengths: list[int]) -> int:
    """Our RotaryEmbedding's tables against LlamaRotaryEmbedding's forward, call after call
    (dynamic types change their frequencies with the length of each call)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from companion.rope import RotaryEmbedding

    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=4, head_dim=head_dim,
                      max_position_embeddings=max_pos, rope_parameters=dict(params))
    hf = LlamaRotaryEmbedding(cfg)
    ours = RotaryEmbedding(head_dim, rope_config=params, max_position_embeddings=max_pos)
    bad = 0
    for n in lengths:
        pos = torch.arange(n)[None]
        x = torch.zeros(1, 1, n, head_dim)
        cos_hf, sin_hf = hf(x, pos)
        ours.rotate(x, x, pos[0], pos[0])  # lets a dynamic type follow the length
        cos, sin = ours.cos_sin(pos[0])
        h = head_dim // 2
        if not (torch.equal(cos, cos_hf[0, :, :h]) and torch.equal(sin, sin_hf[0, :, :h])):
            bad += 1
            print(f"MODULE MISMATCH {params} at length {n}: max|d cos|="
                  f"{(cos - cos_hf[0, :, :h]).abs().max().item():.3g}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="check a random tenth of the grid")
    args = ap.parse_args()
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    cases = list(grid(args.quick))
    if args.quick:
        cases = random.Random(0).sample(cases, len(cases) // 10)
    bad = 0
    for params, hd, max_pos, n in cases:
        for seq in ([n] if n is None else [n, torch.tensor(n)]) if params["rope_type"] == "dynamic" else [n]:
            ref, ref_att = hf_inv_freq(params, hd, max_pos, seq)
            ours, att = compute_inv_freq(params, hd, max_position_embeddings=max_pos, seq_len=seq)
            if not (torch.equal(ours, ref.float()) and att == ref_att):
                bad += 1
                diff = (ours - ref).abs().max().item() if ours.shape == ref.shape else "shape"
                print(f"MISMATCH {params} head_dim={hd} max_pos={max_pos} seq_len={seq}: "
                      f"max|d inv_freq|={diff}, attention {att} vs {ref_att}")
    print(f"transformers {transformers.__version__}: {len(cases)} configs, {bad} mismatches")
    lengths = [64, 300, 1000, 700, 100, 129, 128, 2000, 50]
    modules = [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 8.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 128},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 64 for i in range(32)],
         "long_factor": [1.0 + i / 4 for i in range(32)], "original_max_position_embeddings": 128},
    ]
    module_bad = sum(check_module(p, 64, 128, lengths) for p in modules)
    print(f"RotaryEmbedding against LlamaRotaryEmbedding: {len(modules)} configs x {len(lengths)} calls, "
          f"{module_bad} mismatches")
    bad += module_bad
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
