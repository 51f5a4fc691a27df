"""CPU benchmark of companion.llama on SmolLM2-135M: evaluation speed at 2K and 16K tokens, peak memory.

    python benchmarks/llama_cpu.py [--lengths 2048 16384] [--threads 2] [--out chapters/data/llama_cpu.json]

Each length runs in a fresh child process, so that its peak resident memory (``ru_maxrss``)
is its own: the child loads the GGUF (dequantized to float32), builds the text from the
standard library's ``typing.py``, ``inspect.py``, ``argparse.py`` and ``dataclasses.py``, and
computes the per-token loss of the first ``n`` tokens in one pass (``LlamaModel.token_nll``:
SDPA with ``is_causal`` for attention, the LM head 512 positions at a time), once with plain
RoPE and once with YaRN at factor 2 (the setting of the 16K experiment). It reports seconds,
tokens per second, the perplexity of each half and of the last 1024 tokens, and the peak RSS.
The ratios printed at the end come from the one run. Needs the model file
(``python -m companion.pretrained fetch``).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

YARN2 = {"rope_type": "yarn", "rope_theta": 100000.0, "factor": 2.0, "original_max_position_embeddings": 8192}
FILES = ("typing.py", "inspect.py", "argparse.py", "dataclasses.py")


def child(n: int, threads: int) -> dict:
    import torch

    from companion.llama import load_gguf
    from companion.pretrained import smollm2_gguf_path

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model, tok = load_gguf(smollm2_gguf_path(), layout="half")
    load_s = time.perf_counter() - t0
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids = tok.encode("".join((stdlib / f).read_text() for f in FILES)).ids
    if len(ids) < n:
        raise SystemExit(f"the text has only {len(ids)} tokens, fewer than {n}")
    ids = torch.tensor([ids[:n]])
    out = {"tokens": n, "threads": threads, "load_seconds": load_s, "runs": {}}
    for name, cfg in (("default", None), ("yarn-2", YARN2)):
        if cfg is not None:
            model.set_rope_config(cfg)
        t = time.perf_counter()
        with torch.no_grad():
            nll = model.token_nll(ids)[0]
        sec = time.perf_counter() - t
        half = nll.numel() // 2
        out["runs"][name] = {
            "seconds": sec, "tokens_per_second": n / sec,
            "ppl_first_half": math.exp(float(nll[:half].mean())), "ppl_second_half": math.exp(float(nll[half:].mean())),
            "ppl_last_1024": math.exp(float(nll[-1024:].mean())),
        }
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="chapters/data/llama_cpu.json", help="'' to skip writing")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.threads)))
        return 0
    results = []
    for n in args.lengths:
        proc = subprocess.run([sys.executable, __file__, "--child", str(n), "--threads", str(args.threads)],
                              capture_output=True, text=True, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        for name, run in r["runs"].items():
            print(f"{n:>6} tokens, {name:>8}: {run['seconds']:6.1f} s, {run['tokens_per_second']:6.1f} tokens/s, "
                  f"ppl {run['ppl_first_half']:.2f} / {run['ppl_second_half']:.2f} (halves), "
                  f"{run['ppl_last_1024']:.2f} (last 1024)")
        print(f"{n:>6} tokens: peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB (model load {r['load_seconds']:.1f} s)")
    if len(results) >= 2:
        a, b = results[0], results[-1]
        ratio = a["runs"]["default"]["tokens_per_second"] / b["runs"]["default"]["tokens_per_second"]
        print(f"tokens/s at {a['tokens']} over tokens/s at {b['tokens']}: {ratio:.2f} "
              f"({b['tokens'] / a['tokens']:.0f}x the tokens)")
    if args.out:
        from companion.utils import save_result

        cmd = "python benchmarks/llama_cpu.py " + " ".join(sys.argv[1:])
        save_result(ROOT / args.out, {"results": results, "files": list(FILES)}, command=cmd.strip())
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
