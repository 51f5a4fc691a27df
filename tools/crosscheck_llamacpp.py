"""Cross-check companion.llama (and chapter 10's stored results) against llama.cpp on the same ids.

Not part of CI: llama-cpp-python is not a project dependency (its source package compiles
llama.cpp, about 10 minutes on 2 cores). Build it outside the project and put it on the path::

    python -m venv /tmp/lcpvenv && /tmp/lcpvenv/bin/pip install numpy diskcache
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/lcpvenv/bin/pip install --no-deps llama-cpp-python==0.3.36
    PYTHONPATH=/tmp/lcpvenv/lib/python3.11/site-packages \\
        python tools/crosscheck_llamacpp.py --out chapters/data/10_llamacpp.json

Three checks, all on the cached SmolLM2-135M-Instruct GGUF:

1. **Tokenizer.** llama.cpp's tokenizer and :func:`companion.llama.gguf_tokenizer` on the
   whole of ``typing.py``: the id lists must be equal.
2. **Per-token loss** on the first 2048 tokens of ``typing.py``: llama.cpp's logits (every
   position, KV cache in float32) against :meth:`LlamaModel.token_nll`, as perplexities,
   the largest and mean per-token difference, and the top-1 agreement.
3. **The stored 16K results.** Window 0 of ``chapters/data/10_ppl.csv``, re-scored by
   llama.cpp with the options :func:`companion.scaling.llama_cpp_rope_args` gives for each
   method it can express (none, PI, NTK-aware, YaRN; Dynamic NTK and Llama-3 need what
   llama.cpp's options cannot say), compared bucket by bucket with the stored sums.

llama.cpp multiplies the Q4_1 weights with activations quantized to 8 bits, while
companion.llama runs the dequantized weights in float32; the two therefore differ by more
than rounding, and this script reports by how much rather than asserting a bound.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import typing
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from companion.llama import read_gguf, build_model, gguf_tokenizer  # noqa: E402
from companion.longctx import _bucket_rows, method_config, summarize, token_stream, window  # noqa: E402
from companion.pretrained import smollm2_gguf_path  # noqa: E402
from companion.scaling import llama_cpp_rope_args  # noqa: E402
from companion.utils import load_csv, save_result  # noqa: E402


def llamacpp(n_ctx: int, rope_args: dict | None, threads: int):  # noqa: ANN201
    import llama_cpp

    kw = {}
    if rope_args is not None:
        kind = rope_args["--rope-scaling"]
        kw["rope_scaling_type"] = {"none": llama_cpp.LLAMA_ROPE_SCALING_TYPE_NONE,
                                   "linear": llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR,
                                   "yarn": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN}[kind]
        kw["rope_freq_base"] = float(rope_args["--rope-freq-base"])
        kw["rope_freq_scale"] = float(rope_args.get("--rope-freq-scale", 1.0))
        if kind == "yarn":
            kw.update(yarn_ext_factor=float(rope_args["--yarn-ext-factor"]),
                      yarn_attn_factor=float(rope_args["--yarn-attn-factor"]),
                      yarn_beta_fast=float(rope_args["--yarn-beta-fast"]),
                      yarn_beta_slow=float(rope_args["--yarn-beta-slow"]),
                      yarn_orig_ctx=int(rope_args["--yarn-orig-ctx"]))
        else:
            kw["yarn_ext_factor"] = 0.0
    f32 = 0  # GGML_TYPE_F32: a float32 KV cache, one source of difference fewer
    return llama_cpp.Llama(model_path=str(smollm2_gguf_path()), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                           n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False,
                           type_k=f32, type_v=f32, **kw)


def llamacpp_nll(llm, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    """Per-token NLL (float64) of ids[1:] from llama.cpp's logits, 512 rows at a time."""
    llm.reset()
    llm.eval(ids)
    out = []
    for s in range(0, len(ids) - 1, 512):
        logits = torch.from_numpy(np.array(llm.scores[s:min(s + 512, len(ids) - 1)], dtype=np.float64))
        target = torch.tensor(ids[s + 1:s + 1 + logits.shape[0]])
        out.append(torch.nn.functional.cross_entropy(logits, target, reduction="none").numpy())
    return np.concatenate(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--stored", default=str(ROOT / "chapters/data/10_ppl.csv"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["none", "pi", "ntk", "yarn"])
    args = parser.parse_args()
    command = "PYTHONPATH=<llama-cpp-python> python tools/crosscheck_llamacpp.py " + " ".join(sys.argv[1:])
    import llama_cpp

    torch.set_num_threads(args.threads)
    config, weights, fields = read_gguf(smollm2_gguf_path())
    model, tok = build_model(config, weights, "half"), gguf_tokenizer(fields)
    result: dict = {"llama_cpp_python": llama_cpp.__version__, "model": smollm2_gguf_path().name}

    # 1. the tokenizer
    text = Path(typing.__file__).read_text(encoding="utf-8")
    llm = llamacpp(2048, None, args.threads)
    ours = tok.encode(text).ids
    theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    result["tokenizer"] = {"text": "typing.py", "tokens_ours": len(ours), "tokens_llamacpp": len(theirs),
                           "equal": ours == theirs, "first_difference": first_diff}
    print("tokenizer:", result["tokenizer"])

    # 2. per-token loss on the first 2048 tokens of typing.py
    ids = ours[:2048]
    t = time.perf_counter()
    nll_cpp = llamacpp_nll(llm, ids)
    sec_cpp = time.perf_counter() - t
    t = time.perf_counter()
    nll_ours = model.token_nll(torch.tensor([ids]))[0].double().numpy()
    sec_ours = time.perf_counter() - t
    diff = np.abs(nll_cpp - nll_ours)
    top1_cpp = np.array(llm.scores[:len(ids) - 1]).argmax(-1)
    with torch.no_grad():
        top1_ours = model(torch.tensor([ids[:-1]]))[0].argmax(-1).numpy()
    result["typing_2048"] = {
        "tokens": len(ids), "ppl_ours": math.exp(nll_ours.mean()), "ppl_llamacpp": math.exp(nll_cpp.mean()),
        "max_abs_nll_diff": float(diff.max()), "mean_abs_nll_diff": float(diff.mean()),
        "median_abs_nll_diff": float(np.median(diff)), "top1_agreement": float((top1_cpp == top1_ours).mean()),
        "seconds_llamacpp": sec_cpp, "seconds_ours": sec_ours,
    }
    print("typing.py 2048:", result["typing_2048"])
    del llm

    # 3. window 0 of the stored 16K run
    prov, rows = load_csv(args.stored)
    rows0 = [r for r in rows if r["window"] == "0"]
    length = int(rows0[0]["tokens"])
    stream, info = token_stream(tok)
    ids = window(stream, 0, length)[0].tolist()
    bucket = int(rows0[0]["bucket_end"]) - int(rows0[0]["bucket_start"])
    stored = summarize(rows0)
    result["stored"] = {"file": Path(args.stored).name, "git_commit": prov.get("git_commit"), "tokens": length,
                        "bucket": bucket, "methods": {}}
    for m in args.methods:
        cfg = method_config(m, 2.0, config.context_length, config.rope_base)
        rope_args = llama_cpp_rope_args(cfg or {"rope_type": "default", "rope_theta": config.rope_base},
                                        config.head_dim, max_position_embeddings=config.context_length)
        llm = llamacpp(length, rope_args, args.threads)
        t = time.perf_counter()
        nll = llamacpp_nll(llm, ids)
        sec = time.perf_counter() - t
        del llm
        cpp_rows = [{"window": 0, "method": m, "tokens": length, "bucket_start": start, "nll_sum": total,
                     "count": count, "seconds": sec}
                    for start, _, total, count in _bucket_rows(torch.from_numpy(nll), bucket)]
        mine = {(int(r["bucket_start"])): math.exp(float(r["nll_sum"]) / int(r["count"]))
                for r in rows0 if r["method"] == m}
        theirs_b = {r["bucket_start"]: math.exp(r["nll_sum"] / r["count"]) for r in cpp_rows}
        rel = [abs(theirs_b[k] / mine[k] - 1) for k in mine]
        s_cpp = summarize(cpp_rows)[(0, m)]
        s_ours = stored[(0, m)]
        result["stored"]["methods"][m] = {
            "rope_args": {k: v for k, v in rope_args.items()},
            "llamacpp": {k: s_cpp[k] for k in ("first_half", "second_half", "last", "all")},
            "stored": {k: s_ours[k] for k in ("first_half", "second_half", "last", "all")},
            "max_rel_bucket_ppl_diff": max(rel), "seconds_llamacpp": sec,
        }
        print(m, result["stored"]["methods"][m])
        result["corpus_ids_sha256"] = info["ids_sha256"]
        save_result(args.out, result, command=command)  # after every method: a partial run survives
    return 0


if __name__ == "__main__":
    sys.exit(main())
