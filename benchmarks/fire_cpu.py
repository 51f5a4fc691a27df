"""FIRE's cost on CPU: the full bias through the reference attention against blockwise attention.

    python benchmarks/fire_cpu.py                          # L = 512, 1024, 2048, 4096
    python benchmarks/fire_cpu.py --lengths 512 1024 --repeats 3

FIRE (:class:`companion.learned_bias.FIRE`) runs a small MLP (1 -> hidden -> heads) on every
(query, key) pair. The reference :func:`companion.attention` asks for the whole bias at
once: ``heads x L x L`` outputs plus a ``hidden x L x L`` hidden layer (and its input), so
with the paper's ``hidden = 32`` the bias costs far more memory than the logits. The
blockwise :func:`companion.blockwise.bias_attention` asks for one tile at a time, and a
causal call skips the tiles entirely in the future.

For each length ``L`` (batch 1, 8 heads of dim 64, float32, causal, inference under
``torch.no_grad()``, one thread unless ``--threads``) it prints, all taken in this one run:

* ``ref``: the reference attention with FIRE (the full bias materialised);
* ``blk``: blockwise attention with FIRE, tiles of ``--block-size`` (default: the
  dispatcher's :func:`companion.dispatch.block_size_for`);
* ``alibi``: blockwise attention with ALiBi, same tiles: the cost of the attention itself
  with a bias that is nearly free to compute;
* ``blk / alibi``: what FIRE's MLP adds to the blockwise path.

**Peak memory** is :func:`companion.utils.peak_tensor_bytes`: the peak of the tensor
storages created during the call and alive at once (inputs and parameters excluded; scratch
memory inside an operator not seen). **Time** is the CPU time of this process
(``time.process_time``) around that same call, on one thread by default: on a machine
shared with other jobs it leaves out the time spent waiting for a core, which wall-clock
time does not (the wall-clock seconds are printed too). One call per variant after a
warm-up at the smallest length, so that the four lengths fit in about two minutes; the tracker's
dispatch hook costs a few percent (at ``L = 1024``, blockwise FIRE 2.76 s untracked against
3.00 s tracked, the reference 1.04 s against 1.01 s, one wall-clock run each).
``--repeats N`` times ``N`` further untracked calls instead and reports their median. The
1-minute load average before and after is printed. ``--out FILE.json`` also stores the rows
with provenance (:func:`companion.utils.save_result`), as chapter 11 reads them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from companion import ALiBi, attention, bias_attention  # noqa: E402
from companion.dispatch import block_size_for  # noqa: E402
from companion.learned_bias import FIRE  # noqa: E402
from companion.utils import peak_tensor_bytes, save_result  # noqa: E402

HEADS, HEAD_DIM = 8, 64
MIB = 2.0**20


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median ``(CPU seconds, wall seconds)`` of ``repeats`` calls of ``fn``."""
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def measured(fn, repeats: int):
    """``((CPU s, wall s), peak bytes, result)``: one call under the peak tracker, timed; with
    ``repeats > 0`` the times are the medians of that many untracked calls instead."""
    c0, w0 = time.process_time(), time.perf_counter()
    peak, out = peak_tensor_bytes(fn)
    seconds = (time.process_time() - c0, time.perf_counter() - w0)
    return (timed(fn, repeats) if repeats > 0 else seconds), peak, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=0,
                        help="untracked timed calls per variant (default 0: time the tracked call)")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    fire, alibi = FIRE(HEADS), ALiBi(HEADS)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 1, {HEADS} heads x "
          f"{HEAD_DIM}, float32, causal, no grad; FIRE hidden {fire.hidden}; "
          f"load {os.getloadavg()[0]:.2f}")

    def inputs(length: int):
        g = torch.Generator().manual_seed(length)
        return tuple(torch.randn(1, HEADS, length, HEAD_DIM, generator=g) for _ in range(3))

    def runs(length: int):
        q, k, v = inputs(length)
        bs = args.block_size or block_size_for(HEADS, length)
        return bs, {
            "ref": lambda: attention(q, k, v, fire, causal=True),
            "blk": lambda: bias_attention(q, k, v, fire, causal=True, block_size=bs),
            "alibi": lambda: bias_attention(q, k, v, alibi, causal=True, block_size=bs),
        }

    header = (f"{'L':>5} {'tile':>4} | {'ref cpu s':>9} {'MiB':>7} | {'blk cpu s':>9} {'MiB':>5} | "
              f"{'alibi cpu s':>11} {'MiB':>5} | {'blk/alibi':>9} {'ref/blk':>7} | "
              f"{'wall s ref/blk/alibi':>20} | {'max|ref-blk|':>12}")
    records = []
    load_before = os.getloadavg()[0]
    with torch.no_grad():
        # Warm-up: the allocator, first touch, and the tracker's own imports (about 1 s).
        for fn in runs(min(args.lengths))[1].values():
            peak_tensor_bytes(fn)
        print(header)
        print("-" * len(header))
        for length in args.lengths:
            bs, fns = runs(length)
            secs, peaks, outs = {}, {}, {}
            for name, fn in fns.items():
                secs[name], peaks[name], outs[name] = measured(fn, args.repeats)
            diff = (outs["ref"] - outs["blk"]).abs().max().item()
            del outs
            cpu = {name: t[0] for name, t in secs.items()}
            wall = "/".join(f"{secs[name][1]:.2f}" for name in fns)
            print(f"{length:>5} {bs:>4} | {cpu['ref']:>9.2f} {peaks['ref'] / MIB:>7.1f} | "
                  f"{cpu['blk']:>9.2f} {peaks['blk'] / MIB:>5.1f} | {cpu['alibi']:>11.2f} "
                  f"{peaks['alibi'] / MIB:>5.1f} | {cpu['blk'] / cpu['alibi']:>9.2f} "
                  f"{cpu['ref'] / cpu['blk']:>7.2f} | {wall:>20} | {diff:>12.1e}", flush=True)
            records.append({"length": length, "block": bs, "cpu_seconds": cpu,
                            "wall_seconds": {name: t[1] for name, t in secs.items()},
                            "peak_bytes": peaks, "max_abs_ref_minus_blk": diff})
    print(f"load {os.getloadavg()[0]:.2f}")
    if args.out:
        save_result(args.out, {"heads": HEADS, "head_dim": HEAD_DIM, "hidden": fire.hidden,
                               "threads": torch.get_num_threads(), "repeats": args.repeats,
                               "load_before": load_before, "load_after": os.getloadavg()[0],
                               "rows": records},
                    command="python benchmarks/fire_cpu.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
