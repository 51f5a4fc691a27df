"""Evaluation-time attention on CPU: the dispatcher's evaluation paths against the old ones.

    python benchmarks/eval_attention_cpu.py                          # L = 1024, 2048; 5 repeats
    python benchmarks/eval_attention_cpu.py --lengths 2048 --repeats 3
    python benchmarks/eval_attention_cpu.py --schemes alibi shaw --out /tmp/eval_attention.json

The lab evaluates (chapter 8) without a gradient, and there :func:`companion.dispatch.fast_attention`
takes its ``"query-blocks"`` path for causal self-attention past :data:`~companion.dispatch.QUERY_BLOCK`
positions with a ``score`` hook, and its fused ``"blockwise"`` path for a ``bias`` hook past
:data:`~companion.dispatch.SDPA_BIAS_PAIRS` pairs (see the module docstring of
:mod:`companion.dispatch`). For each length ``L`` (default batch 8,
4 heads, head dim 16: the lab model's; float32, causal, under ``torch.no_grad()``, one thread)
and each scheme built as the lab builds it (:func:`companion.lab.build_scheme` with ``d_model=64,
n_heads=4, max_len=2048, train_len=128``), it times, round-robin over ``--repeats`` rounds:

* ``sdpa``: ``scaled_dot_product_attention(q, k, v, is_causal=True)``, no position scheme: the unit;
* ``qb``: :func:`~companion.dispatch.fast_attention` as dispatched (asserted to be
  ``"query-blocks"`` for a ``score`` scheme, ``"blockwise"`` for a ``bias`` one);
* ``old``: the path ``fast_attention`` took before ``"query-blocks"`` existed: for a ``bias``
  scheme (ALiBi, T5, Kerple, FIRE) :func:`companion.blockwise.bias_attention`'s explicit tiles,
  sized by :func:`~companion.dispatch.block_size_for`; for a ``score`` scheme (Shaw,
  Transformer-XL, CoPE) the reference :func:`companion.attention.attention`.

Time is the CPU time of this process (``time.process_time``) around one call: on one thread, on
a machine shared with other jobs, it leaves out the time spent waiting for a core (the
wall-clock medians are stored too). It prints the median of each as a multiple of ``sdpa``'s
median at the same length and ``old / qb``, the speedup, all taken in this one run.

Before timing, each scheme is checked once on a small case (batch 2, ``L = 2 * QUERY_BLOCK + 37``,
so the last block is partial), with its parameters perturbed from their initial values (CoPE's
table starts at zero, which would hide a wrong score): both float32 paths are compared to the
reference in float64, and the query-blocks error must be at most ``4x`` the old path's error or
``16`` float32 ulps of the output's largest entry, whichever is larger. A scheme that fails
stops the run, so that the benchmark never times a wrong computation.

``--out FILE.json`` also stores the configuration, every sample, the medians, the ratios, the
checks and the 1-minute load average before and after, with provenance
(:func:`companion.utils.save_result`); by default nothing is written.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from companion.attention import attention  # noqa: E402
from companion.blockwise import bias_attention  # noqa: E402
from companion.dispatch import QUERY_BLOCK, attention_path, block_size_for, fast_attention  # noqa: E402
from companion.lab import build_scheme  # noqa: E402
from companion.utils import save_result  # noqa: E402

SCHEMES = ("alibi", "t5", "kerple-log", "fire", "shaw", "xl", "cope")
LAB_SHAPE = {"d_model": 64, "n_heads": 4, "max_len": 2048, "train_len": 128}
CHECK_BATCH, CHECK_LEN = 2, 2 * QUERY_BLOCK + 37
CHECK_REL, CHECK_ULPS = 4.0, 16.0


def new_path(scheme) -> str:
    """The path ``fast_attention`` takes now: ``"query-blocks"`` for a ``score`` scheme, the
    fused block path (``"blockwise"``) for a ``bias`` one."""
    return "query-blocks" if "score" in scheme.hooks() else "blockwise"


def old_path(scheme) -> str:
    """``"blockwise"`` for a ``bias`` scheme, ``"reference"`` for a ``score`` one."""
    hooks = scheme.hooks()
    if "score" in hooks:
        return "reference"
    if "bias" in hooks:
        return "blockwise"
    raise ValueError(f"{type(scheme).__name__} has neither a score nor a bias hook")


def run_old(q, k, v, scheme):
    if old_path(scheme) == "reference":
        return attention(q, k, v, scheme, causal=True)
    b, h, length, _ = q.shape
    return bias_attention(q, k, v, scheme, causal=True, block_size=block_size_for(b * h, length))


def check(name: str, scheme, heads: int, head_dim: int) -> dict:
    """Both float32 paths against the float64 reference on one small case (see the docstring)."""
    gen = torch.Generator().manual_seed(1)
    s32 = copy.deepcopy(scheme)
    with torch.no_grad():
        for p in s32.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    s64 = copy.deepcopy(s32).double()
    q, k, v = (torch.randn(CHECK_BATCH, heads, CHECK_LEN, head_dim, generator=gen) for _ in range(3))
    with torch.no_grad():
        path = attention_path(q, k, v, s32, causal=True)
        if path != new_path(s32):
            raise SystemExit(f"{name}: fast_attention takes {path!r} on the check case, not {new_path(s32)!r}")
        want = attention(q.double(), k.double(), v.double(), s64, causal=True)
        err_qb = float((fast_attention(q, k, v, s32, causal=True).double() - want).abs().max())
        err_old = float((run_old(q, k, v, s32).double() - want).abs().max())
    tol = max(CHECK_REL * err_old, CHECK_ULPS * torch.finfo(torch.float32).eps * float(want.abs().max()))
    if not err_qb <= tol:
        raise SystemExit(f"{name}: query-blocks differs from the float64 reference by {err_qb:.2e} "
                         f"(old path {err_old:.2e}, tolerance {tol:.2e})")
    return {"length": CHECK_LEN, "batch": CHECK_BATCH, "err_query_blocks": err_qb, "err_old": err_old,
            "tolerance": tol}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048],
                    help="each above QUERY_BLOCK (256), and above 512 for a bias scheme (SDPA_BIAS_PAIRS)")
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="rounds; each times every call once")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.repeats < 1 or any(n <= QUERY_BLOCK for n in args.lengths):
        ap.error(f"--repeats must be at least 1 and every length above QUERY_BLOCK = {QUERY_BLOCK}")
    torch.set_num_threads(args.threads)
    b, h, d = args.batch, LAB_SHAPE["n_heads"], LAB_SHAPE["d_model"] // LAB_SHAPE["n_heads"]
    load_before = os.getloadavg()[0]
    schemes = {name: build_scheme(name, **LAB_SHAPE) for name in args.schemes}
    checks = {name: check(name, s, h, d) for name, s in schemes.items()}
    for name, c in checks.items():
        print(f"check {name:<10s} max |err| vs float64 at L={c['length']}: query-blocks {c['err_query_blocks']:.1e}, "
              f"old {c['err_old']:.1e} (tolerance {c['tolerance']:.1e})", flush=True)
    print(f"batch {b}, {h} heads, head dim {d}, causal, float32, no_grad, {args.threads} thread(s); "
          f"median CPU time of {args.repeats} rounds; qb = fast_attention (query-blocks for a score scheme, "
          f"the fused blockwise path for a bias scheme), old = the explicit blockwise tiles "
          f"(bias) or reference (score); times as multiples of SDPA is_causal; load {load_before:.2f}", flush=True)
    rows: dict[str, dict] = {}
    for length in args.lengths:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, length, d, generator=gen) for _ in range(3))
        calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
        for name, s in schemes.items():
            with torch.no_grad():
                path = attention_path(q, k, v, s, causal=True)
            if path != new_path(s):
                raise SystemExit(f"{name}: fast_attention takes {path!r} at L={length}, not {new_path(s)!r}")
            calls[f"{name} qb"] = lambda s=s: fast_attention(q, k, v, s, causal=True)
            calls[f"{name} old"] = lambda s=s: run_old(q, k, v, s)
        cpu: dict[str, list[float]] = {c: [] for c in calls}
        wall: dict[str, list[float]] = {c: [] for c in calls}
        with torch.no_grad():
            for _ in range(args.repeats):
                for c, fn in calls.items():
                    c0, w0 = time.process_time(), time.perf_counter()
                    fn()
                    cpu[c].append(time.process_time() - c0)
                    wall[c].append(time.perf_counter() - w0)
        med = {c: statistics.median(t) for c, t in cpu.items()}
        unit = med["sdpa"]
        row = rows[str(length)] = {
            "sdpa_s": unit, "cpu_s": cpu, "wall_s": wall,
            "wall_median_s": {c: statistics.median(t) for c, t in wall.items()}, "schemes": {}}
        print(f"L={length}: sdpa is_causal {unit * 1e3:.0f} ms", flush=True)
        print(f"  {'scheme':<11s} {'old path':<10s} {'qb s':>7s} {'old s':>7s} {'qb/sdpa':>8s} {'old/sdpa':>9s} "
              f"{'speedup':>8s}")
        for name, s in schemes.items():
            qb, old = med[f"{name} qb"], med[f"{name} old"]
            row["schemes"][name] = {"old_path": old_path(s), "query_blocks_s": qb, "old_s": old,
                                    "query_blocks_over_sdpa": qb / unit, "old_over_sdpa": old / unit,
                                    "speedup": old / qb}
            print(f"  {name:<11s} {old_path(s):<10s} {qb:7.3f} {old:7.3f} {qb / unit:8.2f} {old / unit:9.2f} "
                  f"{old / qb:7.2f}x", flush=True)
    load_after = os.getloadavg()[0]
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
    data = {"config": {"batch": b, "heads": h, "head_dim": d, "dtype": "float32", "causal": True,
                       "grad": False, "threads": args.threads, "repeats": args.repeats,
                       "lengths": args.lengths, "lab_shape": LAB_SHAPE, "query_block": QUERY_BLOCK,
                       "timer": "process_time"},
            "checks": checks, "results": rows, "load_avg_1min": {"before": load_before, "after": load_after}}
    if args.out:
        command = "python benchmarks/eval_attention_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        path = save_result(args.out, data, command=command.strip())
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return data


if __name__ == "__main__":
    main()
