"""The measurements behind the dispatcher's thresholds (companion.dispatch), on CPU.

    python benchmarks/attention_paths_cpu.py
    python benchmarks/attention_paths_cpu.py --lengths 512 --block-sizes 32 64 128 256 512

For each length ``L`` (default batch 8, 4 heads, head dim 16, causal, float32, one thread,
forward plus backward of ``out.sum()``) it times, round-robin over ``--rounds`` rounds:

* ``causal``: ``scaled_dot_product_attention(q, k, v, is_causal=True)``, the baseline;
* ``alibi sdpa`` / ``t5 sdpa``: SDPA with the ``(1, heads, L, L)`` float mask (the bias
  with ``-inf`` above the diagonal), built inside the timed call; T5's table needs a
  gradient, which sends SDPA to its unfused math kernel;
* ``alibi blockwise`` / ``t5 blockwise``: :func:`companion.blockwise.bias_attention` with
  the tile size :func:`companion.dispatch.block_size_for` picks (or each of
  ``--block-sizes``).

It prints each median as a multiple of the baseline's median at the same length: the table
in the docstring of :mod:`companion.dispatch`. Nothing is stored; timings on a shared
machine are noisy, the ratios within one run less so.

The forward-only timings of the ``"query-blocks"`` path (evaluation, no gradient) are
``benchmarks/eval_attention_cpu.py``'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from companion import ALiBi, T5RelativeBias, bias_attention, causal_mask  # noqa: E402
from companion.dispatch import block_size_for  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-sizes", type=int, nargs="*", default=None,
                    help="time the blockwise paths with these tile sizes (default: block_size_for's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    b, h, d = args.batch, args.heads, args.head_dim
    alibi = ALiBi(h)
    t5 = T5RelativeBias(h, num_buckets=32, max_distance=128, bidirectional=False)
    print(f"batch {b}, {h} heads, head dim {d}, causal, float32, {args.threads} thread(s); "
          f"median of {args.rounds} rounds, as a multiple of SDPA is_causal")
    for length in args.lengths:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, length, d, generator=gen).requires_grad_() for _ in range(3))
        pos = torch.arange(length)
        future = ~causal_mask(pos, pos)

        def sdpa_bias(scheme):
            mask = scheme.bias(pos, pos).masked_fill(future, float("-inf"))[None]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        calls = {"causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 "alibi sdpa": lambda: sdpa_bias(alibi), "t5 sdpa": lambda: sdpa_bias(t5)}
        for bs in args.block_sizes or [block_size_for(b * h, length)]:
            calls[f"alibi blockwise {bs}"] = lambda bs=bs: bias_attention(q, k, v, alibi, causal=True, block_size=bs)
            calls[f"t5 blockwise {bs}"] = lambda bs=bs: bias_attention(q, k, v, t5, causal=True, block_size=bs)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for fn in calls.values():  # warm-up
            fn().sum().backward()
        for _ in range(args.rounds):
            for name, fn in calls.items():
                start = time.perf_counter()
                fn().sum().backward()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["causal"])
        cells = "  ".join(f"{n} {statistics.median(t) / base:.2f}" for n, t in times.items() if n != "causal")
        print(f"L={length:<5d} causal {base * 1e3:7.1f} ms  {cells}", flush=True)


if __name__ == "__main__":
    main()
