"""Peak memory and time: blockwise ALiBi attention against SDPA with a materialised bias (CPU).

    python benchmarks/bias_attention_cpu.py --threads 1 2 --max-load 0.7   # the stored run
    python benchmarks/bias_attention_cpu.py --lengths 2048 --no-save --repeats 1

For each sequence length ``L`` (batch 1, 8 heads, head_dim 64, float32, causal ALiBi) it runs
two variants, each in a fresh Python subprocess so that neither inherits the other's heap:

* ``blockwise``: :func:`companion.alibi.bias_attention` with ``ALiBi(heads).bias``; the
  bias is produced tile by tile and fully-future key tiles are skipped.
* ``materialised``: ``torch.nn.functional.scaled_dot_product_attention`` with a
  ``(1, heads, L, L)`` float32 additive mask holding ``-m_h |i - j|`` below the diagonal and
  ``-inf`` above it (the causal mask folded in). A 4-D mask lets torch use its fused CPU
  flash kernel; a 3-D ``(heads, L, L)`` mask sends it to the unfused math path, which also
  materialises the logits, so the 4-D form is the strongest baseline.

**Peak memory** is measured by the kernel, not estimated. Right before the measured work the
worker writes ``5`` to ``/proc/self/clear_refs``, which resets the process's resident-set
high-water mark (``VmHWM``) to the current resident set; afterwards ``VmHWM - VmRSS(before)``
is the peak extra memory of that work. Inputs ``q, k, v`` exist before the reset, so they are
not counted; for the materialised path the bias is built after the reset, so it is. (If
``clear_refs`` is unavailable the worker falls back to ``ru_maxrss`` minus the resident set
before, which can only overstate a peak.)

**Time** is wall-clock ``perf_counter`` around the attention call, the median of
``--repeats`` runs after one warm-up on a small input. The materialised path is timed without
building its bias (as if cached across layers, as the paper's fairseq code does); the build
time is reported separately. Both variants run with the same torch thread count: torch's
default, or each count given with ``--threads``.

On a machine shared with other jobs, timings of the blockwise path (many small kernels, each
a parallel region that waits for every thread) suffer far more from oversubscription than one
fused kernel does. ``--max-load X`` waits before each variant until the 1-minute load average
is below ``X``, and every result records the load average before and after it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "chapters" / "data" / "06_bias_attention_cpu.json"
VARIANTS = ("blockwise", "materialised")
# Acceptance at L = 16384: blockwise peak <= 1/10 of materialised, time <= 1.0x.
MEMORY_RATIO_MAX = 0.1
TIME_RATIO_MAX = 1.0


# ----------------------------------------------------------------------------- worker side


def _status_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) / 1024


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_since(rss_before: float, reset_ok: bool) -> float:
    peak = _status_mib("VmHWM") if reset_ok else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return max(0.0, peak - rss_before)


def _materialised_bias(slopes, length: int):
    """``(1, heads, L, L)`` float32 causal ALiBi bias, built in row chunks (no L x L temporary)."""
    import torch

    h = slopes.numel()
    bias = torch.empty(1, h, length, length)
    pos = torch.arange(length)
    for r0 in range(0, length, 1024):
        r1 = min(r0 + 1024, length)
        rel = (pos[None, :] - pos[r0:r1, None]).to(torch.float32)  # j - i
        for hh in range(h):
            torch.mul(rel, -float(slopes[hh]), out=bias[0, hh, r0:r1]).abs_().neg_()
            bias[0, hh, r0:r1].masked_fill_(rel > 0, float("-inf"))
    return bias


def worker(variant: str, length: int, heads: int, head_dim: int, repeats: int,
           block: tuple[int, int], out_file: str | None, threads: int | None = None) -> dict:
    import torch
    import torch.nn.functional as F

    if threads:
        torch.set_num_threads(threads)

    sys.path.insert(0, str(ROOT))
    from companion.alibi import ALiBi, bias_attention

    scheme = ALiBi(heads)
    # Warm-up on a small input (first-call dispatch and thread-pool start-up).
    g = torch.Generator().manual_seed(1)
    small = [torch.randn(1, heads, 256, head_dim, generator=g) for _ in range(3)]
    bias_attention(*small, scheme.bias, causal=True, block_size=block)
    pos = torch.arange(256)
    F.scaled_dot_product_attention(*small, attn_mask=scheme.bias(pos, pos)[None])
    del small

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=g) for _ in range(3))
    rss_before = _status_mib("VmRSS")
    reset_ok = _reset_peak()
    build_s = None
    times = []
    with torch.no_grad():
        if variant == "materialised":
            t0 = time.perf_counter()
            bias = _materialised_bias(scheme.slopes, length)
            build_s = time.perf_counter() - t0
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
                times.append(time.perf_counter() - t0)
        else:
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = bias_attention(q, k, v, scheme.bias, causal=True, block_size=block)
                times.append(time.perf_counter() - t0)
    peak = _peak_since(rss_before, reset_ok)
    if out_file:
        torch.save(out, out_file)
    return {
        "variant": variant,
        "length": length,
        "time_s": statistics.median(times),
        "times_s": times,
        "peak_extra_mib": peak,
        "bias_build_s": build_s,
        "peak_method": "VmHWM after clear_refs" if reset_ok else "ru_maxrss",
        "inputs_mib": 3 * q.numel() * 4 / 2**20,
        "threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------- parent side


def wait_for_quiet(max_load: float | None, timeout_s: float) -> float:
    """On a shared machine, wait (up to ``timeout_s``) until the 1-minute load average is
    below ``max_load``; return the load average when the wait ended."""
    start = time.monotonic()
    while max_load is not None and os.getloadavg()[0] >= max_load and time.monotonic() - start < timeout_s:
        time.sleep(5)
    return os.getloadavg()[0]


def run_variant(variant: str, length: int, threads: int, args: argparse.Namespace,
                out_file: str | None) -> dict:
    load_before = wait_for_quiet(args.max_load, args.wait_s)
    cmd = [sys.executable, __file__, "--worker", variant, "--lengths", str(length),
           "--heads", str(args.heads), "--head-dim", str(args.head_dim),
           "--repeats", str(args.repeats), "--block-size", *map(str, args.block_size),
           "--threads", str(threads)]
    if out_file:
        cmd += ["--worker-out", out_file]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{variant} at L={length} failed:\n{res.stderr[-2000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["load_average_before"] = round(load_before, 2)
    out["load_average_after"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, nargs=2, default=[512, 512], metavar=("BQ", "BK"),
                   help="tile size of the blockwise path (default: the library's, 512 x 512)")
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="torch intra-op thread counts to measure, each in both workers "
                        "(default: torch's default only)")
    p.add_argument("--max-load", type=float, default=None,
                   help="before each variant, wait until the 1-minute load average is below this")
    p.add_argument("--wait-s", type=float, default=900, help="longest wait for --max-load (s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-save", action="store_true", help="print results, write no file")
    p.add_argument("--json", action="store_true", help="print the result dict as JSON last")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        threads = args.threads[0] if args.threads else None
        print(json.dumps(worker(args.worker, args.lengths[0], args.heads, args.head_dim,
                                args.repeats, tuple(args.block_size), args.worker_out, threads)))
        return {}

    import torch

    thread_counts = args.threads or [torch.get_num_threads()]
    rows, ratios = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for threads in thread_counts:
            ratios[str(threads)] = {}
            for length in args.lengths:
                got = {}
                for variant in VARIANTS:  # one at a time, never both at once
                    got[variant] = run_variant(variant, length, threads, args, f"{tmp}/{variant}.pt")
                    rows.append(got[variant])
                a = torch.load(f"{tmp}/blockwise.pt")
                b = torch.load(f"{tmp}/materialised.pt")
                diff = float((a - b).abs().max())
                blk, mat = got["blockwise"], got["materialised"]
                r = ratios[str(threads)][str(length)] = {
                    "memory": blk["peak_extra_mib"] / mat["peak_extra_mib"],
                    "time": blk["time_s"] / mat["time_s"],
                    "time_with_bias_build": blk["time_s"] / (mat["time_s"] + mat["bias_build_s"]),
                    "max_abs_diff": diff,
                    "bias_mib": args.heads * length * length * 4 / 2**20,
                }
                print(f"threads={threads} L={length:6d}  blockwise: {blk['time_s']:7.3f} s, peak "
                      f"+{blk['peak_extra_mib']:7.1f} MiB | materialised: {mat['time_s']:7.3f} s "
                      f"(+{mat['bias_build_s']:.3f} s to build the bias), peak "
                      f"+{mat['peak_extra_mib']:7.1f} MiB | ratios: memory {r['memory']:.4f}, "
                      f"time {r['time']:.3f} | max |diff| {diff:.2e}", flush=True)
    data = {
        "config": {"heads": args.heads, "head_dim": args.head_dim, "batch": 1, "dtype": "float32",
                   "causal": True, "scheme": "ALiBi", "block_size": list(args.block_size),
                   "repeats": args.repeats, "lengths": args.lengths, "threads": thread_counts,
                   "max_load": args.max_load},
        "results": rows,
        "ratios": ratios,
    }
    if 16384 in args.lengths:
        per = {}
        for threads in thread_counts:
            r = ratios[str(threads)]["16384"]
            per[str(threads)] = {
                "memory_ratio": r["memory"], "time_ratio": r["time"],
                "met": r["memory"] <= MEMORY_RATIO_MAX and r["time"] <= TIME_RATIO_MAX,
            }
            print(f"acceptance at L=16384, {threads} thread(s): memory ratio {r['memory']:.4f} "
                  f"(<= {MEMORY_RATIO_MAX}), time ratio {r['time']:.3f} (<= {TIME_RATIO_MAX}): "
                  f"{'met' if per[str(threads)]['met'] else 'NOT met'}")
        data["acceptance"] = {"memory_ratio_max": MEMORY_RATIO_MAX, "time_ratio_max": TIME_RATIO_MAX,
                              "by_threads": per, "met": all(x["met"] for x in per.values())}
    if not args.no_save:
        sys.path.insert(0, str(ROOT))
        from companion.utils import save_result

        command = "python benchmarks/bias_attention_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        path = save_result(args.out, data, command=command.strip())
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if args.json:
        print(json.dumps(data))
    return data


if __name__ == "__main__":
    main()
