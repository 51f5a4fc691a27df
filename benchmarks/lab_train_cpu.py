"""Training throughput of the lab's model with every scheme, as a ratio to NoPE (CPU).

    python benchmarks/lab_train_cpu.py --reference          # the stored run
    python benchmarks/lab_train_cpu.py --rounds 2 --no-save # a quick look

The lab (:mod:`companion.lab`) trains :class:`companion.model.TinyDecoder` with vocabulary
256, ``d_model = 64``, 4 heads and 2 layers on bytes. This script measures, from one run,
the training tokens per second of that model (forward, backward and one AdamW step) at
``L = 512``, batch 8, for each scheme, and divides by the tokens per second of the same
model with no position scheme (NoPE), whose attention runs torch's
``scaled_dot_product_attention`` with ``is_causal=True``. Every model uses the default
``attention_impl="auto"``, and every scheme is built as the lab builds it
(:func:`companion.lab.schemes.build_scheme`; ``scaled_sinusoidal`` is the lab's
``sinusoidal``, and ``sinusoidal`` the plain table of Vaswani et al.), so each scheme takes
the path
:func:`companion.dispatch.attention_path` names for it (recorded in the result). With
``--reference`` every scheme is also timed with ``attention_impl="reference"`` (the dense
:func:`companion.attention.attention`), which shows what the dispatcher gains.

Noise hits all schemes alike: the schemes are timed round-robin, ``--steps`` training steps
of one scheme, then of the next, for ``--rounds`` rounds, after ``--warmup`` untimed steps
each; the ratio of a scheme is the median of its rounds over NoPE's median. Torch runs with
``--threads`` threads (default 1, as the lab trains: one thread per process avoids OpenMP
stalls on a shared 2-core machine).

Targets (issue 13): RoPE >= 0.85, ALiBi >= 0.7, T5 bias >= 0.6. The result goes to
``chapters/data/lab_train_cpu.json`` with provenance (:func:`companion.utils.save_result`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "chapters" / "data" / "lab_train_cpu.json"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from companion import PositionScheme, SinusoidalEmbedding, TinyDecoder  # noqa: E402
from companion.dispatch import attention_path  # noqa: E402
from companion.lab.schemes import build_scheme  # noqa: E402
from companion.utils import save_result, seed_everything  # noqa: E402

VOCAB, D_MODEL, HEADS, LAYERS = 256, 64, 4, 2
HEAD_DIM = D_MODEL // HEADS
#: The longest evaluation length of the lab (a learned table's size).
MAX_LEN = 2048
#: The issue's targets: tokens/s as a fraction of NoPE's.
TARGETS = {"rope": 0.85, "alibi": 0.7, "t5": 0.6}
#: The lab's schemes (companion.lab.schemes.build_scheme, whose "sinusoidal" is the scaled
#: table), plus the plain sinusoidal table of Vaswani et al.
SCHEMES = ("nope", "sinusoidal", "scaled_sinusoidal", "learned", "shaw", "xl", "t5", "rope", "alibi")


def build(name: str, seq_len: int) -> PositionScheme:
    """The scheme ``name`` exactly as the lab builds it for its model."""
    if name == "sinusoidal":
        return SinusoidalEmbedding(D_MODEL)
    lab_name = "sinusoidal" if name == "scaled_sinusoidal" else name
    return build_scheme(lab_name, d_model=D_MODEL, n_heads=HEADS, max_len=MAX_LEN, train_len=seq_len)


class Trainer:
    """One model, its optimiser and a fixed batch; :meth:`steps` times training steps."""

    def __init__(self, name: str, impl: str, seq_len: int, batch: int, seed: int) -> None:
        seed_everything(seed)
        self.model = TinyDecoder(VOCAB, D_MODEL, HEADS, LAYERS, scheme=build(name, seq_len),
                                 attention_impl=impl)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(seed)
        data = torch.randint(0, VOCAB, (batch, seq_len + 1), generator=gen)
        self.idx, self.targets = data[:, :-1], data[:, 1:].contiguous()
        q = torch.zeros(batch, HEADS, seq_len, HEAD_DIM)
        self.path = "reference" if impl == "reference" else attention_path(
            q, q, q, self.model.scheme, torch.arange(seq_len), torch.arange(seq_len), causal=True)

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model.loss(self.idx, self.targets)
        loss.backward()
        self.opt.step()
        return loss.item()

    def steps(self, n: int) -> float:
        """Seconds for ``n`` training steps."""
        start = time.perf_counter()
        for _ in range(n):
            self.step()
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per scheme per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--reference", action="store_true", help="also time attention_impl='reference'")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = ["nope"] + [s for s in args.schemes if s != "nope"]
    runs = [(n, "auto") for n in names] + ([(n, "reference") for n in names] if args.reference else [])
    trainers = {r: Trainer(*r, args.seq_len, args.batch, args.seed) for r in runs}
    for t in trainers.values():
        for _ in range(args.warmup):
            t.step()
    tokens = args.steps * args.batch * args.seq_len
    rates: dict[tuple[str, str], list[float]] = {r: [] for r in runs}
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        for r, t in trainers.items():
            rates[r].append(tokens / t.steps(args.steps))
    load_after = os.getloadavg()[0]
    base = statistics.median(rates[("nope", "auto")])
    rows = []
    print(f"TinyDecoder({VOCAB}, d_model={D_MODEL}, heads={HEADS}, layers={LAYERS}), L={args.seq_len}, "
          f"batch {args.batch}, {args.threads} thread(s), {args.rounds} rounds x {args.steps} steps")
    print(f"{'scheme':<18} {'impl':<10} {'path':<12} {'tokens/s':>9} {'ratio':>6}  target")
    for (name, impl), rs in rates.items():
        med = statistics.median(rs)
        ratio = med / base
        target = TARGETS.get(name) if impl == "auto" else None
        verdict = "" if target is None else f">= {target}: {'met' if ratio >= target else 'MISSED'}"
        print(f"{name:<18} {impl:<10} {trainers[(name, impl)].path:<12} {med:9.0f} {ratio:6.3f}  {verdict}")
        rows.append({"scheme": name, "attention_impl": impl, "path": trainers[(name, impl)].path,
                     "tokens_per_s_median": med, "tokens_per_s_rounds": rs, "ratio_to_nope": ratio,
                     "target": target, "target_met": None if target is None else ratio >= target})
    data = {
        "model": {"vocab_size": VOCAB, "d_model": D_MODEL, "n_heads": HEADS, "n_layers": LAYERS},
        "seq_len": args.seq_len, "batch": args.batch, "threads": args.threads, "rounds": args.rounds,
        "steps_per_round": args.steps, "warmup_steps": args.warmup, "optimizer": "AdamW(lr=1e-3)",
        "baseline": "nope with attention_impl='auto' (SDPA, is_causal=True)",
        "load_average_1min": {"before": load_before, "after": load_after},
        "results": rows,
    }
    if not args.no_save:
        command = "python benchmarks/lab_train_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        path = save_result(args.out, data, command=command.strip())
        print(f"saved {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return data


if __name__ == "__main__":
    main()
