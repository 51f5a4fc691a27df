"""Cross-check companion.gemma (Gemma 3 270M) against llama.cpp on the same ids.

Not part of CI: llama-cpp-python is not a project dependency (its source package compiles
llama.cpp, 10 minutes or more on 2 cores). Build it outside the project, as for
``tools/crosscheck_llamacpp.py``, and put it on the path::

    python -m venv /tmp/lcpvenv && /tmp/lcpvenv/bin/pip install numpy diskcache
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/lcpvenv/bin/pip install --no-deps llama-cpp-python==0.3.36
    python -m companion.pretrained fetch --model gemma3
    PYTHONPATH=/tmp/lcpvenv/lib/python3.11/site-packages \\
        python tools/crosscheck_gemma_llamacpp.py --out chapters/data/10_gemma_llamacpp.json

Three checks, all on the cached ``gemma-3-270m-q4_k_m.gguf``:

1. **Tokenizer.** llama.cpp's tokenizer (``add_bos=True``, with ``special`` False and True)
   and :func:`companion.gemma.gguf_tokenizer` on the whole of the standard library's
   ``typing.py``, and on ``html/entities.py`` (thousands of non-ASCII characters, byte
   fallback) and ``argparse.py``: the id lists must be equal.
2. **Per-token loss** on the first 2048 tokens of ``typing.py`` (``<bos>`` first; four
   sliding windows of 512, so local and global layers both matter): llama.cpp's logits
   (every position, KV cache in float32) against :meth:`GemmaModel.token_nll`, as
   perplexities, the largest and mean per-token difference, and the top-1 agreement.
3. **RoPE scaling on the global layers only.** The same 2048 tokens with linear
   interpolation (factor 2) installed on the global layers (``rope_layers="global"``)
   against llama.cpp's ``rope_freq_scale=0.5``, which llama.cpp applies to Gemma 3's global
   layers only (its local layers keep ``rope_freq_base_train_swa`` and scale 1).

4. **The same weights in float32.** llama.cpp multiplies the quantized weights with
   activations quantized to 8 bits, while companion.gemma runs the dequantized weights in
   float32; the two differ by more than rounding (checks 2 and 3 report by how much rather
   than asserting a bound). So the dequantized weights are also written, with the same
   metadata, to a float32 GGUF in a temporary folder (1 GB), and llama.cpp runs that file
   on the first 1024 tokens: what differs then is arithmetic (llama.cpp's GELU reads an
   fp16 table, its sums run in another order), not the architecture.
"""

from __future__ import annotations

import argparse
import html.entities
import math
import sys
import time
import typing
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from companion.gemma import build_model, gguf_tokenizer, read_gguf  # noqa: E402
from companion.llama import KVCache  # noqa: E402
from companion.pretrained import gemma3_gguf_path  # noqa: E402
from companion.utils import save_result  # noqa: E402


def llamacpp(n_ctx: int, threads: int, freq_scale: float = 1.0, path: Path | None = None):  # noqa: ANN201
    import llama_cpp

    f32 = 0  # GGML_TYPE_F32: a float32 KV cache, one source of difference fewer
    kw = {}
    if freq_scale != 1.0:
        kw = dict(rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR, rope_freq_scale=freq_scale,
                  yarn_ext_factor=0.0)
    return llama_cpp.Llama(model_path=str(path or gemma3_gguf_path()), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                           n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False,
                           type_k=f32, type_v=f32, **kw)


def llamacpp_scores(llm, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    """Per-token NLL (float64) of ids[1:] and the argmax of each row, from llama.cpp's logits."""
    llm.reset()
    llm.eval(ids)
    nll, top1 = [], []
    for s in range(0, len(ids) - 1, 256):
        logits = torch.from_numpy(np.array(llm.scores[s:min(s + 256, len(ids) - 1)], dtype=np.float64))
        target = torch.tensor(ids[s + 1:s + 1 + logits.shape[0]])
        nll.append(torch.nn.functional.cross_entropy(logits, target, reduction="none").numpy())
        top1.append(logits.argmax(-1).numpy())
    return np.concatenate(nll), np.concatenate(top1)


@torch.no_grad()
def our_top1(model, ids: list[int], chunk: int = 512) -> np.ndarray:  # noqa: ANN001
    """The argmax of our logits at every position but the last (a second, cached pass)."""
    cache = KVCache(model.config.n_layers)
    x = torch.tensor([ids[:-1]])
    out = []
    for s in range(0, x.shape[1], chunk):
        h = model.hidden(x[:, s:s + chunk], cache)
        for a in range(0, h.shape[1], 128):
            out.append(model.logits(h[:, a:a + 128]).argmax(-1)[0])
    return torch.cat(out).numpy()


def compare(model, llm, ids: list[int]) -> dict:  # noqa: ANN001
    t = time.perf_counter()
    nll_cpp, top1_cpp = llamacpp_scores(llm, ids)
    sec_cpp = time.perf_counter() - t
    t = time.perf_counter()
    nll_ours = model.token_nll(torch.tensor([ids]))[0].double().numpy()
    sec_ours = time.perf_counter() - t
    top1_ours = our_top1(model, ids)
    diff = np.abs(nll_cpp - nll_ours)
    return {
        "tokens": len(ids), "ppl_ours": math.exp(nll_ours.mean()), "ppl_llamacpp": math.exp(nll_cpp.mean()),
        "max_abs_nll_diff": float(diff.max()), "mean_abs_nll_diff": float(diff.mean()),
        "median_abs_nll_diff": float(np.median(diff)), "top1_agreement": float((top1_cpp == top1_ours).mean()),
        "seconds_llamacpp": sec_cpp, "seconds_ours_token_nll": sec_ours,
    }


def write_f32_copy(src: Path, dst: Path) -> None:
    """``src`` with every tensor dequantized to float32 (the metadata copied as it is)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, array.reshape(tuple(reversed(t.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--skip-scaling", action="store_true", help="skip check 3")
    parser.add_argument("--skip-f32", action="store_true", help="skip check 4")
    parser.add_argument("--f32-tokens", type=int, default=1024)
    args = parser.parse_args()
    command = "PYTHONPATH=<llama-cpp-python> python tools/crosscheck_gemma_llamacpp.py " + " ".join(sys.argv[1:])
    import llama_cpp

    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    config, weights, fields = read_gguf(gemma3_gguf_path())
    model, tok = build_model(config, weights), gguf_tokenizer(fields)
    load = time.perf_counter() - t
    result: dict = {"llama_cpp_python": llama_cpp.__version__, "model": gemma3_gguf_path().name,
                    "seconds_load_ours": load}

    # 1. the tokenizer
    llm = llamacpp(args.tokens, args.threads)
    result["tokenizer"] = {}
    for name, module in (("typing.py", typing), ("html/entities.py", html.entities), ("argparse.py", argparse)):
        text = Path(module.__file__).read_text(encoding="utf-8")
        ours = tok.encode(text).ids
        entry = {"characters": len(text), "tokens_ours": len(ours)}
        for special in (False, True):
            theirs = llm.tokenize(text.encode("utf-8"), add_bos=True, special=special)
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            entry[f"special_{special}".lower()] = {"tokens_llamacpp": len(theirs), "equal": ours == theirs,
                                                   "first_difference": first}
        result["tokenizer"][name] = entry
        print("tokenizer", name, entry)

    # 2. per-token loss on the first tokens of typing.py
    ids = tok.encode(Path(typing.__file__).read_text(encoding="utf-8")).ids[:args.tokens]
    result["typing"] = compare(model, llm, ids)
    print("typing.py", result["typing"])
    del llm
    save_result(args.out, result, command=command)

    # 3. linear RoPE scaling (factor 2) on the global layers only
    if not args.skip_scaling:
        model.set_rope_config({"rope_type": "linear", "factor": 2.0}, layers="global")
        llm = llamacpp(args.tokens, args.threads, freq_scale=0.5)
        result["linear_2_global_layers"] = compare(model, llm, ids)
        print("linear x2 on global layers", result["linear_2_global_layers"])
        del llm
        save_result(args.out, result, command=command)

    # 4. the dequantized weights in float32, in llama.cpp too
    if not args.skip_f32:
        import tempfile

        model.set_rope_config(None)
        with tempfile.TemporaryDirectory(prefix="gemma-f32-") as tmp:
            f32 = Path(tmp) / "gemma-3-270m-f32.gguf"
            write_f32_copy(gemma3_gguf_path(), f32)
            llm = llamacpp(args.f32_tokens, args.threads, path=f32)
            result["f32_weights"] = compare(model, llm, ids[:args.f32_tokens])
            del llm
        print("float32 weights", result["f32_weights"])
        save_result(args.out, result, command=command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
