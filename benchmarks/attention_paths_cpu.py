"""Each attention path against SDPA ``is_causal`` at the same shape, in time and peak memory (CPU).

    python benchmarks/attention_paths_cpu.py                  # L = 8192 and 16384, the issue's shape
    python benchmarks/attention_paths_cpu.py --quick          # smoke run: L = 1024, one round
    python benchmarks/attention_paths_cpu.py --lengths 4096 --modes forward --schemes alibi t5

For each length ``L`` (batch 1, 8 heads, head dim 64, float32, causal, ``--threads`` torch
threads; the issue's shape) and mode (``forward`` under ``torch.no_grad()``, ``backward``:
forward plus backward with a fixed random upstream gradient, the bias's parameters trainable)
it times, round-robin over ``--rounds`` rounds, the median of:

* ``sdpa``: ``scaled_dot_product_attention(q, k, v, is_causal=True)``, no bias: the unit;
* each bias scheme (ALiBi, T5 with 32 buckets to distance 128, KERPLE log, FIRE) through
  :func:`companion.dispatch.fast_attention`, as dispatched (the path is printed);
* ``window``: NoPE and RoPE with ``window=W`` (``--window``) through ``fast_attention``, and
  RoPE without a window, the full causal attention the window replaces;
* ``shaw`` (forward only, with ``--shaw``): Shaw et al.'s relative attention through
  ``fast_attention`` (the ``"query-blocks"`` path: no gradient).

It prints each median as a multiple of ``sdpa``'s, all from this one run, and the peak extra
memory of one call of each (forward, or forward plus backward) as a fraction of the
materialised float32 bias ``batch * heads * L * L * 4`` bytes. Peak memory is measured in a
fresh subprocess per call, as ``benchmarks/bias_attention_cpu.py`` does (the resident-set
high-water mark after ``/proc/self/clear_refs``, minus the resident set before; the inputs
exist before). ``--out FILE`` stores everything with provenance; ``--quick`` is a smoke run
(``L = 1024``, one round), and on a machine loaded by other jobs every ratio is noisy:
there ``--threads 1 --clock cpu`` (this process's CPU time) leaves out the waits for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from attention_tiles_cpu import round_robin  # noqa: E402
from bias_attention_cpu import _peak_since, _reset_peak, _status_mib  # noqa: E402
from companion import FIRE, ALiBi, KerpleBias, NoPE, RotaryEmbedding, ShawRelative, T5RelativeBias  # noqa: E402
from companion.dispatch import attention_path, fast_attention  # noqa: E402
from companion.utils import save_result  # noqa: E402

BIAS_SCHEMES = ("alibi", "t5", "kerple", "fire")


def build(name: str, heads: int, head_dim: int, train: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    scheme = {"alibi": lambda: ALiBi(heads),
              "t5": lambda: T5RelativeBias(heads, num_buckets=32, max_distance=128, bidirectional=False),
              "kerple": lambda: KerpleBias(heads, form="log"),
              "fire": lambda: FIRE(heads),
              "nope": NoPE, "rope": lambda: RotaryEmbedding(head_dim),
              "shaw": lambda: ShawRelative(head_dim, max_distance=128)}[name]()
    return scheme.requires_grad_(train)


def calls(args: argparse.Namespace, length: int, mode: str) -> tuple[dict, dict]:
    """The timed functions (label -> zero-argument callable) and their paths."""
    b, h, d = args.batch, args.heads, args.head_dim
    grad = mode == "backward"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, length, d, generator=gen).requires_grad_(grad) for _ in range(3))
    upstream = torch.randn(b, h, length, d, generator=gen)

    def run(fn):
        def call():
            with torch.set_grad_enabled(grad):
                out = fn()
                if grad:
                    out.backward(upstream)
        return call

    fns = {"sdpa": run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))}
    paths = {"sdpa": "SDPA is_causal"}
    entries = [(name, name, {}) for name in args.schemes]
    if args.window:
        entries += [(f"nope w={args.window}", "nope", {"window": args.window}),
                    (f"rope w={args.window}", "rope", {"window": args.window}), ("rope full", "rope", {})]
    if args.shaw and not grad:
        entries.append(("shaw", "shaw", {}))
    for label, name, kw in entries:
        scheme = build(name, h, d, grad)
        with torch.set_grad_enabled(grad):
            paths[label] = attention_path(q, k, v, scheme, causal=True, **kw)
        fns[label] = run(lambda scheme=scheme, kw=kw: fast_attention(q, k, v, scheme, causal=True, **kw))
    return fns, paths


def worker(args: argparse.Namespace) -> None:
    """One call of one label after resetting the peak; prints its peak extra MiB as JSON."""
    label, length, mode = args.worker
    torch.set_num_threads(args.threads)
    fns, _ = calls(args, int(length), mode)
    rss = _status_mib("VmRSS")
    ok = _reset_peak()
    fns[label]()
    print(json.dumps({"peak_extra_mib": _peak_since(rss, ok)}))


def peak(args: argparse.Namespace, label: str, length: int, mode: str, argv: list[str]) -> float:
    cmd = [sys.executable, __file__, *argv, "--worker", label, str(length), mode]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{label} at L={length} ({mode}) failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_extra_mib"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: L = 1024, one round")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time, with --threads 1 only (a machine loaded by other jobs)")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 1)")
    ap.add_argument("--modes", nargs="+", choices=("forward", "backward"), default=["forward", "backward"])
    ap.add_argument("--schemes", nargs="*", choices=BIAS_SCHEMES, default=list(BIAS_SCHEMES))
    ap.add_argument("--window", type=int, default=512, help="the sliding window of the NoPE/RoPE rows (0: none)")
    ap.add_argument("--shaw", action="store_true", help="also Shaw (forward; its reference path is L x L)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--out", default=None, help="also store the results (JSON with provenance)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    lengths = args.lengths or ([1024] if args.quick else [8192, 16384])
    rounds = args.rounds or (1 if args.quick else 3)
    worker_argv = [a for a in argv if a != "--quick"] + ["--batch", str(args.batch), "--heads", str(args.heads),
                                                         "--head-dim", str(args.head_dim)]
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (CPU time adds up every thread's spinning)")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    print(f"batch {args.batch}, {args.heads} heads, head dim {args.head_dim}, causal, float32, {args.threads} "
          f"thread(s), median of {rounds} round(s); time as a multiple of SDPA is_causal, peak extra memory as a "
          f"fraction of the materialised float32 bias; load {load_before:.2f}", flush=True)
    results = []
    for length in lengths:
        bias_mib = args.batch * args.heads * length * length * 4 / 2**20
        for mode in args.modes:
            fns, paths = calls(args, length, mode)
            times, med = round_robin(fns, rounds, clock)
            print(f"L={length} {mode}: sdpa is_causal {med['sdpa']:.3f} s; bias {bias_mib:.0f} MiB", flush=True)
            for name in fns:
                mib = None if args.no_memory else peak(args, name, length, mode, worker_argv)
                row = {"length": length, "mode": mode, "label": name, "path": paths[name], "seconds": med[name],
                       "times": times[name], "over_sdpa": med[name] / med["sdpa"], "peak_extra_mib": mib,
                       "peak_over_bias": None if mib is None else mib / bias_mib}
                results.append(row)
                memory = "" if mib is None else f"  peak +{mib:8.1f} MiB = {mib / bias_mib:.3f} of the bias"
                print(f"  {name:<14s} {paths[name]:<14s} {med[name]:8.3f} s  {med[name] / med['sdpa']:6.2f}x{memory}",
                      flush=True)
    data = {"config": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "threads": args.threads,
                       "rounds": rounds, "lengths": lengths, "modes": args.modes, "window": args.window,
                       "quick": args.quick, "clock": args.clock},
            "load_average": {"before": load_before, "after": os.getloadavg()[0]}, "results": results}
    if args.out:
        path = save_result(args.out, data, command="python benchmarks/attention_paths_cpu.py " + " ".join(argv))
        print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
