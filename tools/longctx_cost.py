"""What chapter 10's second-edition measures cost on this machine: seconds per unit, and a plan.

Not part of CI (it runs the real models for about half an hour). Every unit is timed in
wall-clock and process CPU seconds with ``--threads`` torch threads (default 1: on a
loaded machine, two threads spin-wait for each other and a pass can take ten times its CPU
time; on two quiet cores, two single-threaded processes on different units use both). ::

    python tools/longctx_cost.py --out /tmp/10_cost.json              # SmolLM2 and Gemma 3
    python tools/longctx_cost.py --skip-gemma --skip-long --out ...   # 1K-4K only, minutes

Measured, for SmolLM2-135M (on a document of the held-out split):

* plain passes of 1024, 2048, 4096 tokens (and 16384 unless ``--skip-long``), fitted as
  ``a n + b n^2`` (the linear layers and the attention), which predicts 8192 and 16384;
* each training-free method's pass at 4096 tokens, with its windows scaled to 4096 as the
  defaults are to 16384 (ReRoPE and Self-Extend windows / 4, the sink window / 4), as a
  ratio to the plain pass;
* the sliding baseline of the 4K/2K control (``T = 2048``, ``S = 256``: 8 passes of 2K);
* passkey cells (``companion.passkey.passkey_rows``, classic format, 2 trials, depths 0.1,
  0.5, 0.9) at 1024, 2048 and 4096 with plain RoPE, at 4096 with YaRN, Self-Extend and
  sinks; per trial, against the prediction ``pass(L) - pass(d L)`` (the suffix after the
  shared filler).

For Gemma 3 270M: passes of 4096, 16384 and 32768 tokens scoring the second half only (as
``context --targets measured``), each in a fresh process whose peak resident memory is read,
fitted and extrapolated to 65536; and one passkey cell at 4096.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from companion import longctx_docs as ld  # noqa: E402
from companion import passkey as pk  # noqa: E402
from companion.longctx_runs import load_subject  # noqa: E402
from companion.utils import save_result  # noqa: E402

DEPTHS = (0.1, 0.5, 0.9)


def timed(fn):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


def fit(points):
    """Least squares ``seconds = a n + b n^2`` through ``{n: seconds}``; returns a predictor."""
    n = np.array(sorted(points), dtype=float)
    y = np.array([points[int(k)] for k in n])
    a, b = np.linalg.lstsq(np.stack([n, n * n], 1), y, rcond=None)[0]
    return (lambda m: float(a * m + b * m * m)), (float(a), float(b))


def say(msg):
    print(msg, flush=True)


def smollm2(args, out):
    model, tok, template = load_subject("smollm2")
    doc = ld.long_documents(tok, 16384, split="val")[1]  # subprocess.py: code, not the pydoc topics text
    out["smollm2_document"] = doc.record()
    ids = doc.head(16384)
    ld.tail_nll(model, ids[:, :256], 1)  # warm-up
    passes = {}
    for n in (1024, 2048, 4096) + (() if args.skip_long else (16384,)):
        _, w, c = timed(lambda n=n: ld.method_nll(model, ids[:, :n], "none"))
        passes[n] = c
        say(f"smollm2 plain pass {n:6d}: {w:7.1f} s wall, {c:7.1f} s CPU")
    out["smollm2_pass_cpu"] = {str(n): c for n, c in passes.items()}
    pred, coef = fit(passes)
    out["smollm2_pass_fit"] = {"a": coef[0], "b": coef[1], "predicted": {str(n): pred(n) for n in (8192, 16384)}}
    say(f"  fit a n + b n^2: 8192 -> {pred(8192):.0f} s, 16384 -> {pred(16384):.0f} s")
    tf = {"rerope_window": 1024, "leak": 4.0, "se_window": 512, "se_group": 4, "sinks": 4, "sink_window": 1792,
          "chunk": 512}
    ratios = {}
    for m in ("rerope", "leaky_rerope", "self_extend", "sinks"):
        _, w, c = timed(lambda m=m: ld.method_nll(model, ids[:, :4096], m, trainfree=tf))
        ratios[m] = c / passes[4096]
        say(f"smollm2 {m:13s} pass 4096: {w:7.1f} s wall, {c:7.1f} s CPU, {ratios[m]:.2f} x plain")
    out["smollm2_trainfree_ratio_4096"] = ratios
    with ld.applied_method(model, "none"):
        _, w, c = timed(lambda: ld.sliding_nll(model, ids[:, :4096], 2048, 4096, 2048, 256))
    out["smollm2_sliding_2048_256_cpu"] = c
    say(f"smollm2 sliding baseline T 2048, S 256 (8 passes of 2048): {w:.1f} s wall, {c:.1f} s CPU")
    cells = []
    for n, methods in ((1024, ["none"]), (2048, ["none"]), (4096, ["none", "yarn", "self_extend", "sinks"])):
        for m in methods:
            for d in DEPTHS:
                params = dict(trainfree=tf) if m in ("self_extend", "sinks") else {}
                rows, w, c = timed(lambda n=n, m=m, d=d: pk.passkey_rows(model, tok, "classic", n, d, m, trials=2,
                                                                          **params))
                trial = float(np.mean([r["cpu_seconds"] for r in rows]))
                predicted = pred(n) - pred(d * n) if m == "none" else None
                cells.append({"length": n, "method": m, "depth": d, "trial_cpu": trial,
                              "prefix_seconds": rows[0]["prefix_seconds"], "cell_cpu": c, "predicted": predicted,
                              "gain": [float(r["gain_bits"]) for r in rows], "exact": [r["exact"] for r in rows]})
                say(f"smollm2 passkey {n:5d} {m:12s} depth {d}: {trial:6.1f} s CPU per trial"
                    + (f" (predicted {predicted:.1f})" if predicted is not None else "")
                    + f", prefix {rows[0]['prefix_seconds']:.1f} s; gains {[round(g, 2) for g in cells[-1]['gain']]}")
    out["smollm2_passkey"] = cells
    chat = pk.passkey_rows(model, tok, "chat", 2048, 0.5, "none", trials=2, template=template)
    out["smollm2_passkey_chat_2048"] = [r["cpu_seconds"] for r in chat]


GEMMA_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads({threads})
from companion import longctx_docs as ld
from companion.longctx_runs import load_subject
model, tok, _ = load_subject("gemma3")
doc = ld.long_documents(tok, {n}, split="all")[{index}]
ids = doc.head({n})
t, c = time.perf_counter(), time.process_time()
nll, _ = ld.method_nll(model, ids, "none", chunk=4096, first={n} // 2)
w, c = time.perf_counter() - t, time.process_time() - c
print(json.dumps({{"n": {n}, "wall": w, "cpu": c, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "doc": doc.path, "nll": float(nll.mean())}}))
"""


def gemma(args, out):
    passes = {}
    for n in (4096, 16384, 32768):
        code = GEMMA_CHILD.format(root=str(ROOT), threads=args.threads, n=n, index=0)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        row = json.loads(res.stdout.strip().splitlines()[-1])
        passes[n] = row
        say(f"gemma3 pass {n:6d} (second half scored, chunks of 4096): {row['wall']:7.1f} s wall, {row['cpu']:7.1f} s "
            f"CPU, peak RSS {row['maxrss_mb']:.0f} MB ({row['doc']}, mean nll {row['nll']:.3f})")
    out["gemma3_pass"] = {str(n): r for n, r in passes.items()}
    pred, coef = fit({n: r["cpu"] for n, r in passes.items()})
    mem = np.polyfit([n for n in passes], [r["maxrss_mb"] for r in passes.values()], 1)
    out["gemma3_pass_fit"] = {"a": coef[0], "b": coef[1], "predicted_65536": pred(65536),
                              "rss_mb_65536_linear": float(np.polyval(mem, 65536))}
    say(f"  fit: 65536 -> {pred(65536):.0f} s CPU, about {np.polyval(mem, 65536):.0f} MB")
    model, tok, _ = load_subject("gemma3")
    cells = []
    for d in DEPTHS:
        rows, w, c = timed(lambda d=d: pk.passkey_rows(model, tok, "classic", 4096, d, "none", trials=2, chunk=4096))
        cells.append({"length": 4096, "depth": d, "trial_cpu": float(np.mean([r["cpu_seconds"] for r in rows])),
                      "prefix_seconds": rows[0]["prefix_seconds"], "gain": [float(r["gain_bits"]) for r in rows]})
        say(f"gemma3 passkey 4096 depth {d}: {cells[-1]['trial_cpu']:.1f} s CPU per trial, gains "
            f"{[round(g, 2) for g in cells[-1]['gain']]}")
    out["gemma3_passkey"] = cells


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-long", action="store_true", help="no 16K SmolLM2 pass")
    p.add_argument("--skip-gemma", action="store_true")
    p.add_argument("--skip-smollm2", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = open("/proc/loadavg").read().split()[:3] if Path("/proc/loadavg").exists() else None
    out = {"threads": args.threads, "loadavg_at_start": load}
    if not args.skip_smollm2:
        smollm2(args, out)
    if not args.skip_gemma:
        gemma(args, out)
    out["loadavg_at_end"] = open("/proc/loadavg").read().split()[:3] if load else None
    out["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    save_result(args.out, out, command="python tools/longctx_cost.py " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
