"""The measurement behind the block sizes of the dispatcher's ``"blockwise"`` path (CPU).

    python benchmarks/attention_tiles_cpu.py --quick     # smoke run: a provisional file, "quick": true
    python benchmarks/attention_tiles_cpu.py             # the full measurement (quiet cores, hours)
    python benchmarks/attention_tiles_cpu.py --write-docstring   # only regenerate the table

For each mode, shape (``batch x heads``, head dim) and length ``L`` (causal, float32,
``--threads`` torch threads, random ``q, k, v``) it times, round-robin over ``--rounds``
rounds, the median of each of:

* ``sdpa``: ``scaled_dot_product_attention(q, k, v, is_causal=True)``, no bias: the unit;
* ``sdpa_bias``: SDPA with the ``(1, heads, L, L)`` float mask (the bias, ``-inf`` above the
  diagonal), built inside the timed call as the ``"sdpa-bias"`` path builds it; only where
  that mask fits :data:`companion.dispatch.SDPA_MASK_BYTES`;
* ``blocks``: :func:`companion.blockwise.fused_bias_attention` with ``block_size=(B, None)``
  for each ``B`` of ``--blocks`` with ``B <= L <= 256 B``.

The modes are what a call differentiates (:func:`companion.dispatch.fused_block_size`):
``forward`` (ALiBi under ``torch.no_grad()``), ``backward`` (ALiBi, forward plus backward of
``q, k, v`` with a fixed random upstream gradient) and ``bias-grad`` (T5 with 32 buckets up to
distance 128 and its table trainable, forward plus backward). Every timed function is first
checked once against the float64 reference on a small case (``L = 150``, the smallest block).
Shapes whose ``batch * heads * L * L`` exceeds ``--max-entries`` are skipped (the full run's
default keeps ``L = 32768`` for 8 heads and ``L = 16384`` for 32).

It writes each row's times as multiples of ``sdpa`` (``sdpa_bias`` and ``blocks``) with the
seconds, the configuration and the load average, with provenance
(:func:`companion.utils.save_result`), to ``--out`` (default the package's
``companion/data/attention_tiles.json``, which the dispatcher reads), then regenerates the
table in the module docstring of :mod:`companion.dispatch` from it
(:func:`companion.dispatch.tile_table`) unless ``--no-docstring``. ``--quick`` measures a
small grid (``L`` 128 to 8192, the last for ``1 x 8`` only, two rounds, one thread, CPU
time: on a machine loaded by other jobs, wall-clock times of two threads are mostly waiting) and marks the file ``"quick":
true``: a smoke run, provisional, to be replaced by the full measurement.

The full run, on a quiet machine, 2 threads (the default arguments). Estimated from single
calls at ``L = 8192`` and ``16384`` on the book's machine: about six hours, most of it in the
two backward modes at ``L = 16384`` (``8 x 4``) and ``32768`` (``1 x 8``); ``--lengths``,
``--head-dims``, ``--shapes``, ``--modes`` and ``--rounds`` restrict it (``--rounds 2`` saves
about a quarter), and a restricted run replaces the whole file::

    python benchmarks/attention_tiles_cpu.py --threads 2 --clock wall --rounds 3

The stored file is a restricted wall-clock run on otherwise idle cores (64 minutes on the
book's 2-core AMD EPYC): ``L`` 128 to 16384, head dims 16, 64 and 128, ``1 x 8`` and ``8 x
4`` (the latter to ``L = 8192``), all three modes, 2 threads, 2 rounds::

    python benchmarks/attention_tiles_cpu.py --lengths 128 256 512 1024 2048 4096 8192 16384 \
        --head-dims 16 64 128 --shapes 1x8 8x4 --blocks 64 128 256 512 1024 --rounds 2 \
        --threads 2 --clock wall --max-entries 2147483648

``L = 32768`` is not measured, nor ``8 x 4`` at 16384; for those the dispatcher takes the
nearest measured row (``L = 16384`` for ``1 x 8``, ``8192`` for ``8 x 4``).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from companion import ALiBi, T5RelativeBias, attention, causal_mask  # noqa: E402
from companion import dispatch  # noqa: E402
from companion.blockwise import fused_bias_attention  # noqa: E402
from companion.utils import load_result, save_result  # noqa: E402

QUICK = dict(lengths=[128, 256, 512, 2048, 8192], head_dims=[16, 64], shapes=["1x8", "8x4"],
             blocks=[64, 128, 256, 512, 1024], rounds=2, threads=1, clock="cpu", max_entries=8 * 8192**2)
FULL = dict(lengths=[128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768], head_dims=[16, 64, 128],
            shapes=["1x8", "8x4"], blocks=[64, 128, 256, 512, 1024], rounds=3, threads=2, clock="wall",
            max_entries=8 * 32768**2)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def scheme_for(mode: str, heads: int) -> torch.nn.Module:
    if mode == "bias-grad":
        return T5RelativeBias(heads, num_buckets=32, max_distance=128, bidirectional=False)
    return ALiBi(heads)


def calls(mode: str, b: int, h: int, length: int, d: int, blocks: list[int], dtype=torch.float32, seed=0):
    """The timed functions of one row (name -> zero-argument callable) and the inputs."""
    gen = torch.Generator().manual_seed(seed)
    grad = mode != "forward"
    q, k, v = (torch.randn(b, h, length, d, generator=gen, dtype=dtype).requires_grad_(grad) for _ in range(3))
    upstream = torch.randn(b, h, length, d, generator=gen, dtype=dtype)
    scheme = scheme_for(mode, h).to(dtype)
    scheme.requires_grad_(mode == "bias-grad")
    pos = torch.arange(length)

    def run(fn):
        if not grad:
            def call():
                with torch.no_grad():
                    return fn()
            return call

        def call():
            out = fn()
            out.backward(upstream)
            return out
        return call

    def sdpa_bias():
        mask = scheme.bias(pos, pos).to(dtype).masked_fill(~causal_mask(pos, pos), float("-inf"))[None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    out = {"sdpa": run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))}
    mask_bytes = h * length * length * torch.finfo(dtype).bits // 8
    if mask_bytes <= dispatch.SDPA_MASK_BYTES:
        out["sdpa_bias"] = run(sdpa_bias)
    for bq in blocks:
        if bq <= length <= 256 * bq:  # at most 256 blocks of queries
            out[str(bq)] = run(lambda bq=bq: fused_bias_attention(q, k, v, scheme, causal=True, block_size=(bq, None)))
    return out, (q, k, v, scheme)


def check(mode: str, h: int, d: int, block: int) -> None:
    """Each path of a row against the float64 reference on a small case: a wrong computation is never timed."""
    fns, (q, k, v, scheme) = calls(mode, 1, h, 150, d, [block], dtype=torch.float64, seed=1)
    with torch.no_grad():
        ref = attention(q, k, v, scheme, causal=True)
        plain = attention(q, k, v, None, causal=True)
    for name, fn in fns.items():
        for t in (q, k, v):
            t.grad = None
        got = fn().detach()
        err = float((got - (plain if name == "sdpa" else ref)).abs().max())  # sdpa: the unit, no bias
        if not err < 1e-9:  # float64: rounding is ~1e-15
            raise AssertionError(f"{mode} {name}: max |error| {err:.3g} against the reference")


def round_robin(fns: dict, rounds: int, clock) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Every function once (warm-up), then ``rounds`` rounds of each in turn, so that a
    machine's changing load hits them alike: the times by name, and their medians."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return times, {name: statistics.median(t) for name, t in times.items()}


def measure(mode: str, b: int, h: int, length: int, d: int, blocks: list[int], rounds: int, clock) -> dict:
    fns, _ = calls(mode, b, h, length, d, blocks)
    _, med = round_robin(fns, rounds, clock)
    base = med["sdpa"]
    return {
        "mode": mode, "batch": b, "heads": h, "head_dim": d, "length": length,
        "sdpa_s": base,
        "sdpa_bias": None if "sdpa_bias" not in med else med["sdpa_bias"] / base,
        "blocks": {name: med[name] / base for name in med if name.isdigit()},
        "seconds": med,
    }


def write_docstring(path: Path = ROOT / "companion" / "dispatch.py", data: dict | None = None) -> None:
    """Replace the table between the ``.. begin tile table`` and ``.. end tile table``
    comments of the dispatcher's module docstring by :func:`companion.dispatch.tile_table`."""
    text = path.read_text(encoding="utf-8")
    table = dispatch.tile_table(data)
    new, n = re.subn(r"(\.\. begin tile table\n).*?(\n\.\. end tile table)",
                     lambda m: m.group(1) + "\n" + table + "\n" + m.group(2), text, flags=re.S)
    if n != 1:
        raise RuntimeError(f"{path}: expected one '.. begin tile table' ... '.. end tile table' block, found {n}")
    path.write_text(new, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small smoke grid, stored as quick (provisional)")
    ap.add_argument("--lengths", type=int, nargs="+")
    ap.add_argument("--head-dims", type=int, nargs="+")
    ap.add_argument("--shapes", nargs="+", help="batch x heads, as 1x8")
    ap.add_argument("--blocks", type=int, nargs="+")
    ap.add_argument("--modes", nargs="+", choices=dispatch.MODES, default=list(dispatch.MODES))
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--threads", type=int, help="torch threads (full run 2, --quick 1)")
    ap.add_argument("--clock", choices=sorted(CLOCKS),
                    help="wall: perf_counter (full run); cpu: this process's CPU time, with 1 thread only "
                         "(--quick: on a loaded machine it leaves out the waits for a core)")
    ap.add_argument("--max-entries", type=float,
                    help="skip shapes with more batch * heads * L * L logits (full run 8 * 32768**2, --quick 8 * 8192**2)")
    ap.add_argument("--out", type=Path, default=dispatch.TILES_FILE)
    ap.add_argument("--no-save", action="store_true", help="print, write nothing")
    ap.add_argument("--no-docstring", action="store_true", help="leave companion/dispatch.py as it is")
    ap.add_argument("--write-docstring", action="store_true", help="only regenerate the table from --out")
    args = ap.parse_args(argv)
    if args.write_docstring:
        write_docstring(data=load_result(args.out)["data"])
        return
    grid = dict(QUICK if args.quick else FULL)
    for key in grid:
        if getattr(args, key, None) is not None:
            grid[key] = getattr(args, key)
    if grid["clock"] == "cpu" and grid["threads"] != 1:
        ap.error("--clock cpu needs --threads 1 (CPU time adds up every thread's spinning)")
    torch.set_num_threads(grid["threads"])
    shapes = [tuple(int(x) for x in s.split("x")) for s in grid["shapes"]]
    load_before = os.getloadavg()[0]
    rows = []
    for mode in args.modes:
        for d in grid["head_dims"]:
            check(mode, 4, d, min(grid["blocks"]))
            for b, h in shapes:
                for length in grid["lengths"]:
                    if b * h * length * length > grid["max_entries"]:
                        continue
                    row = measure(mode, b, h, length, d, grid["blocks"], grid["rounds"], CLOCKS[grid["clock"]])
                    rows.append(row)
                    best = min(row["blocks"].items(), key=lambda t: t[1])
                    mask = "-" if row["sdpa_bias"] is None else f"{row['sdpa_bias']:.2f}"
                    print(f"{mode:9s} d={d:<3d} {b}x{h:<2d} L={length:<6d} sdpa {row['sdpa_s'] * 1e3:9.1f} ms  "
                          f"float mask {mask:>5s}  blocks " + " ".join(f"{k}: {v:.2f}" for k, v in row["blocks"].items())
                          + f"  best {best[0]}", flush=True)
    data = {"quick": bool(args.quick), "threads": grid["threads"], "clock": grid["clock"], "dtype": "float32",
            "rounds": grid["rounds"],
            "grid": {k: grid[k] for k in ("lengths", "head_dims", "shapes", "blocks")}, "modes": args.modes,
            "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
            "rows": rows}
    if args.no_save:
        print(dispatch.tile_table(data))
        return
    command = "python benchmarks/attention_tiles_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    path = save_result(args.out, data, command=command.strip())
    print(f"wrote {path}")
    if not args.no_docstring:
        write_docstring(data=data)
        print("regenerated the table in companion/dispatch.py")


if __name__ == "__main__":
    main()
