"""CPU benchmark of companion.apply_rope against the HuggingFace-style eager formula and clone().

    python benchmarks/rope_cpu.py [--repeats 25] [--shape 1 32 4096 128] [--out chapters/data/rope_cpu.json]

RoPE is memory-bound: it reads q and k once and writes them once, which is exactly what
``clone()`` of q and k does, so two clones are the memory-traffic floor. Measured in one run,
interleaved round by round so that machine noise hits every contender alike (fp32):

* ``apply_rope``          companion.apply_rope, half layout, out of place (the default);
* ``apply_rope_inplace``  the same with ``inplace=True``;
* ``hf_eager``            ``q * cos + rotate_half(q) * sin`` with ``torch.cat`` in ``rotate_half``
                          and duplicated tables of width head_dim, as in HuggingFace's Llama;
* ``clone``               ``q.clone(), k.clone()``: the floor named by the issue;
* ``copy_``               copying q and k into buffers allocated once (no fresh allocation, so
                          no page faults): the lower floor that an in-place update can aim at.

Targets (issue 5): ``hf_eager / apply_rope >= 2`` and ``apply_rope / clone <= 2``, with the
in-place option named as a lever. The script prints every median and the ratios for both modes
of apply_rope, checks that apply_rope equals the eager formula bit for bit, and writes
everything with provenance to ``--out`` (``--out ''`` to skip writing). An out-of-place result
must be written to freshly allocated memory, as ``clone`` does, so the out-of-place mode pays
the same page faults as ``clone`` plus its arithmetic; the in-place mode pays neither.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from companion.rope import apply_rope, rope_cos_sin, rope_frequencies, rotate_half  # noqa: E402
from companion.utils import save_result  # noqa: E402


def hf_eager(q, k, cos_full, sin_full):
    return q * cos_full + rotate_half(q) * sin_full, k * cos_full + rotate_half(k) * sin_full


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 32, 4096, 128], metavar=("B", "H", "S", "D"))
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--out", default=str(ROOT / "chapters" / "data" / "rope_cpu.json"))
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    b, h, s, d = args.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, s, d, generator=g)
    k = torch.randn(b, h, s, d, generator=g)
    cos, sin = rope_cos_sin(s, rope_frequencies(d))
    cos_full, sin_full = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)

    ours = apply_rope(q, k, cos, sin)
    ref = hf_eager(q, k, cos_full, sin_full)
    bit_exact = torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    qi, ki = q.clone(), k.clone()
    apply_rope(qi, ki, cos, sin, inplace=True)
    inplace_exact = torch.equal(qi, ref[0]) and torch.equal(ki, ref[1])
    del ours, ref

    qo, ko = torch.empty_like(q), torch.empty_like(k)
    contenders = {
        "apply_rope": lambda: apply_rope(q, k, cos, sin),
        "apply_rope_inplace": lambda: apply_rope(qi, ki, cos, sin, inplace=True),
        "hf_eager": lambda: hf_eager(q, k, cos_full, sin_full),
        "clone": lambda: (q.clone(), k.clone()),
        "copy_": lambda: (qo.copy_(q), ko.copy_(k)),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            del out
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    ratios = {
        mode: {
            "hf_eager_over": med["hf_eager"] / med[mode],
            "over_clone": med[mode] / med["clone"],
            "over_copy": med[mode] / med["copy_"],
        }
        for mode in ("apply_rope", "apply_rope_inplace")
    }

    mib = q.numel() * q.element_size() / 2**20
    print(f"shape {tuple(args.shape)} fp32, q and k {mib:.0f} MiB each, {torch.get_num_threads()} threads, "
          f"{args.repeats} rounds")
    print(f"apply_rope equals the eager formula bit for bit: {bit_exact} (in place: {inplace_exact})")
    for name, ms in med.items():
        print(f"  {name:<20s} median {ms:8.2f} ms")
    for mode, r in ratios.items():
        print(f"{mode:<20s} hf_eager / it = {r['hf_eager_over']:.2f} (target >= 2), "
              f"it / clone = {r['over_clone']:.2f} (target <= 2), it / copy_ = {r['over_copy']:.2f}")
    met = {
        mode: bool(r["hf_eager_over"] >= 2 and r["over_clone"] <= 2) for mode, r in ratios.items()
    }
    ok = bit_exact and inplace_exact and any(met.values())
    for mode, flag in met.items():
        print(f"{mode}: both targets {'met' if flag else 'NOT met'}")

    if args.out:
        data = {
            "shape": list(args.shape),
            "dtype": "float32",
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
            "median_ms": {name: round(ms, 3) for name, ms in med.items()},
            "ratios": {mode: {k: round(v, 3) for k, v in r.items()} for mode, r in ratios.items()},
            "targets_met": met,
            "bit_exact_vs_hf_eager": bit_exact and inplace_exact,
        }
        cmd = "python benchmarks/rope_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        path = save_result(args.out, data, command=cmd.strip())
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
