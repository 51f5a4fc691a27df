"""CPU cost of relative position encodings per attention layer (chapter 4's comparison table).

    python benchmarks/relative_cpu.py            # writes chapters/data/04_relative_cpu.json
    python benchmarks/relative_cpu.py --quick    # small sizes only, prints, writes nothing

One causal self-attention layer core (the reference ``companion.attention`` with each scheme)
at batch 1, 8 heads of dim 64 (d_model 512), float32, on this machine's CPU:

* peak bytes of the tensors alive during a forward pass (``peak_tensor_bytes``: every
  storage an operator creates, freed when it dies), measured once per size;
* the time of a forward pass, and of forward + backward at the smaller sizes, as CPU time
  of this process (``time.process_time``) on one thread, which leaves out the time it waits
  for a core on a shared machine; the best of a few runs (as ``timeit`` advises), the
  schemes interleaved so that what interference remains (caches, memory bandwidth) hits
  them alike. Ratios are to NoPE, whose attention is also what absolute encodings (which act
  on the embeddings) pay;
* the same forward time for a whole pre-LayerNorm Transformer block (projections, attention,
  MLP of width 2048) at the smaller sizes, where the attention core is a small part of it;
* for T5, the time to build its ``(heads, L, L)`` bias once (T5 shares it across layers);
* learned parameters per layer (T5's table is per model: all layers share it).

Sizes where the predicted peak (from the measured peak at the previous size, times the
growth in L^2) would not fit in the memory available now are skipped and recorded as such.
A separate sweep measures Shaw's naive (L, L, d) form against the efficient gather form for
the memory figure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch import nn  # noqa: E402

from companion import MultiHeadAttention, NoPE, attention, save_result, seed_everything  # noqa: E402
from companion.relative import ShawRelative, T5RelativeBias, TransformerXL  # noqa: E402
from companion.utils import peak_tensor_bytes  # noqa: E402

HEADS, HEAD_DIM, SHAW_K = 8, 64, 16


def make_schemes() -> dict[str, torch.nn.Module]:
    return {
        "NoPE": NoPE(),
        "Shaw": ShawRelative(HEAD_DIM, SHAW_K, init_std=0.1),
        "Shaw (naive)": ShawRelative(HEAD_DIM, SHAW_K, naive=True, init_std=0.1),
        "Transformer-XL": TransformerXL(HEADS, HEAD_DIM),
        "T5 bias": T5RelativeBias(HEADS, 32, 128, bidirectional=False),
    }


class Block(nn.Module):
    """A pre-LayerNorm Transformer block around ``MultiHeadAttention`` (d_model 512)."""

    def __init__(self, scheme: nn.Module) -> None:
        super().__init__()
        d = HEADS * HEAD_DIM
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = MultiHeadAttention(d, HEADS, scheme)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), causal=True)
        return x + self.mlp(self.ln2(x))


def qkv(length: int, grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    return [torch.randn(1, HEADS, length, HEAD_DIM, generator=g).requires_grad_(grad) for _ in range(3)]


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_bytes(scheme: torch.nn.Module, length: int) -> int:
    q, k, v = qkv(length)
    with torch.no_grad():
        peak, _ = peak_tensor_bytes(attention, q, k, v, scheme, causal=True)
    return peak


def forward_once(scheme: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    with torch.no_grad():
        t0 = time.process_time()
        attention(q, k, v, scheme, causal=True)
        return time.process_time() - t0


def train_step_once(scheme: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    t0 = time.process_time()
    attention(q, k, v, scheme, causal=True).square().mean().backward()
    return time.process_time() - t0


def block_once(block: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        t0 = time.process_time()
        block(x)
        return time.process_time() - t0


def best_times(schemes: dict[str, torch.nn.Module], length: int, reps: int, mode: str) -> dict[str, float]:
    """Best-of-``reps`` CPU time per scheme, the schemes interleaved round-robin so that a
    burst of load from other processes hits all of them alike (one warm-up round first).
    ``mode``: "forward" or "train" (attention core), or "block" (a whole block, forward)."""
    q, k, v = qkv(length, grad=mode == "train")
    if mode == "block":
        blocks = {name: Block(s) for name, s in schemes.items()}
        x = torch.randn(1, length, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(1))
    once = train_step_once if mode == "train" else forward_once
    best = {name: float("inf") for name in schemes}
    for rnd in range(reps + 1):
        for name, scheme in schemes.items():
            t = block_once(blocks[name], x) if mode == "block" else once(scheme, q, k, v)
            if rnd:
                best[name] = min(best[name], t)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, print only")
    ap.add_argument("--out", default=str(ROOT / "chapters" / "data" / "04_relative_cpu.json"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    seed_everything(0)
    lengths = [128, 256] if args.quick else [512, 2048, 8192]
    shaw_lengths = [64, 128, 256] if args.quick else [128, 256, 512, 1024, 2048]
    schemes = make_schemes()
    params = {
        name: sum(p.numel() for p in s.parameters()) for name, s in schemes.items()
    }
    rows = []
    limit = {name: None for name in schemes}  # (L, peak) of the last size measured
    for length in lengths:
        todo = {}
        for name, scheme in schemes.items():
            row: dict = {"scheme": name, "L": length}
            prev = limit[name]
            predicted = None if prev is None else prev[1] * (length / prev[0]) ** 2
            if predicted is not None and predicted > 0.6 * mem_available():
                row["skipped"] = (f"predicted peak {predicted / 2**30:.1f} GiB exceeds 60% of the "
                                  f"{mem_available() / 2**30:.1f} GiB available")
            else:
                row["peak_bytes"] = peak_bytes(scheme, length)
                limit[name] = (length, row["peak_bytes"])
                todo[name] = scheme
            rows.append(row)
        reps = 15 if length <= 512 else (5 if length <= 2048 else 2)
        times = {"forward_s": best_times(todo, length, reps, "forward")}
        if length <= 2048:
            times["train_step_s"] = best_times(todo, length, reps, "train")
            times["block_forward_s"] = best_times(todo, length, reps, "block")
        t5 = todo.get("T5 bias")
        if t5 is not None:  # T5 builds its bias once per stack; what that one build costs:
            pos = torch.arange(length)
            with torch.no_grad():
                builds = []
                for _ in range(reps + 1):
                    t0 = time.process_time()
                    t5.bias(pos, pos)
                    builds.append(time.process_time() - t0)
            times["bias_build_s"] = {"T5 bias": min(builds[1:])}
        for row in rows[-len(schemes):]:
            for key, values in times.items():
                if row["scheme"] in values:
                    row[key] = values[row["scheme"]]
            print(row, flush=True)
    base = {r["L"]: r for r in rows if r["scheme"] == "NoPE"}
    for r in rows:
        b = base.get(r["L"], {})
        for key in ("forward_s", "train_step_s", "block_forward_s", "peak_bytes"):
            if key in r and key in b:
                r[key.removesuffix("_s") + "_ratio_to_nope"] = r[key] / b[key]
    shaw = []
    for length in shaw_lengths:
        entry = {"L": length}
        for name in ("NoPE", "Shaw", "Shaw (naive)"):
            entry[name] = peak_bytes(schemes[name], length)
        shaw.append(entry)
        print("memory", entry, flush=True)
    data = {
        "config": {"batch": 1, "heads": HEADS, "head_dim": HEAD_DIM, "shaw_max_distance": SHAW_K,
                   "t5_num_buckets": 32, "t5_max_distance": 128, "xl_d_r": HEADS * HEAD_DIM,
                   "dtype": "float32", "causal": True, "threads": torch.get_num_threads()},
        "params_per_layer": params,
        "layer": rows,
        "shaw_memory": shaw,
    }
    if args.quick:
        return 0
    path = save_result(args.out, data, command="python benchmarks/relative_cpu.py")
    print("wrote", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
