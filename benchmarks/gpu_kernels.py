"""GPU benchmark of companion.kernels: fused RoPE and flash attention with an in-kernel bias.

    python benchmarks/gpu_kernels.py                 # on a CUDA machine; writes the JSON below
    python benchmarks/gpu_kernels.py --smoke --out '' # anywhere: tiny shapes, CPU, no file

Never run in CI. On a CUDA GPU it measures, in bf16 at Llama-like shapes (32 query heads,
head_dim 128; RoPE with 8 key heads as in Llama 3 8B), batch 1 and 8, sequence 1K to 16K:

RoPE, forward and backward, as GB/s (bytes of q and k read and written, plus the table rows)
and as a fraction of the copy bandwidth measured in the same run (``clone()`` of q and k:
the same bytes), for

* ``fused``            :func:`companion.kernels.fused_rope` (one Triton launch for q and k);
* ``hf_eager``         HuggingFace's ``q * cos + rotate_half(q) * sin`` with full-width tables
                       in the activations' dtype, as ``LlamaRotaryEmbedding`` returns them;
* ``hf_compiled``      ``torch.compile`` of the same function;
* ``liger``            Liger-Kernel's ``liger_rotary_pos_emb`` (:cite:`hsu2024liger`), if
                       installed.

Causal attention, forward and forward + backward, as TFLOP/s (the causal half of
``4 * B * H * L^2 * D`` for the forward, 2.5 times that for the backward), for

* ``flash_alibi``, ``flash_t5``  :func:`companion.kernels.flash_attention_with_bias`;
* ``sdpa_bias_alibi``, ``sdpa_bias_t5``  ``scaled_dot_product_attention`` with the bias (and
                       the causal mask folded in as ``-inf``) materialised as a
                       ``(1, H, L, L)`` tensor, built before the timer starts;
* ``sdpa_causal``      ``scaled_dot_product_attention(is_causal=True)`` with no bias: the
                       ceiling a bias kernel can hope for.

Targets on an H100/H200: RoPE at >= 80% of the copy bandwidth and no slower than Liger;
bias attention within 1.3x of bias-free causal SDPA, and faster than SDPA with a materialised
bias from 8K on (``long_seq``). The script checks the kernels against the references first, then prints
every figure and ratio and writes them with provenance (device, driver, CUDA, versions,
commit, date) via :func:`companion.utils.save_result`.

``--smoke`` runs every code path that does not need CUDA (shape lists, byte and FLOP models,
the contenders, timing, the result assembly and the JSON) on the CPU with tiny shapes, where
the contenders dispatch to the torch references (or Triton's interpreter); it is a test of
the script, and its timings mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from companion.alibi import alibi_bias, alibi_slopes  # noqa: E402
from companion.kernels import flash_attention_with_bias, fused_rope, kernel_backend  # noqa: E402
from companion.relative import T5RelativeBias  # noqa: E402
from companion.rope import apply_rope, rope_cos_sin, rope_frequencies, rotate_half  # noqa: E402
from companion.utils import save_result  # noqa: E402

DEFAULT_OUT = ROOT / "chapters" / "data" / "07_gpu_benchmarks.json"

# long_seq: from this length on, the bias kernels must beat SDPA with a materialised bias.
FULL = dict(batches=(1, 8), seqs=(1024, 2048, 4096, 8192, 16384), heads=32, kv_heads=8, head_dim=128,
            dtype=torch.bfloat16, long_seq=8192)
SMOKE = dict(batches=(1,), seqs=(48, 80), heads=2, kv_heads=1, head_dim=32, dtype=torch.float32, long_seq=80)


# ----------------------------------------------------------------------------- models of the work


def rope_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, elt: int) -> int:
    """Bytes a fused RoPE must move: q and k read once and written once, plus the float32
    cos and sin rows (read once per position and batch row)."""
    activations = 2 * batch * (heads + kv_heads) * seq * head_dim * elt
    tables = 2 * batch * seq * (head_dim // 2) * 4
    return activations + tables


def attention_flops(batch: int, seq: int, heads: int, head_dim: int, causal: bool = True,
                    backward: bool = False) -> float:
    """FLOPs of attention as FlashAttention counts them: ``4 B H L^2 D`` for the two matrix
    products of the forward, halved when causal; the backward does 2.5 times the forward."""
    f = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return f * 3.5 if backward else f


# ----------------------------------------------------------------------------- contenders


def hf_rope(q, k, cos_full, sin_full):
    """HuggingFace's apply_rotary_pos_emb: full-width tables (B or 1, 1, S, D) in q's dtype."""
    return q * cos_full + rotate_half(q) * sin_full, k * cos_full + rotate_half(k) * sin_full


def liger_rope() -> Callable | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    return liger_rotary_pos_emb


# ----------------------------------------------------------------------------- timing


def timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """A function ``time(fn, repeats)`` returning the median milliseconds of ``fn()``."""
    if device.type == "cuda":
        import triton.testing

        def cuda_time(fn: Callable[[], object], repeats: int) -> float:
            return float(triton.testing.do_bench(fn, warmup=25, rep=max(repeats, 20), return_mode="median"))
        return cuda_time

    def cpu_time(fn: Callable[[], object], repeats: int) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    return cpu_time


def _oom_safe(fn: Callable[[], float]) -> float | None:
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


# ----------------------------------------------------------------------------- RoPE


def bench_rope(cfg: dict, device: torch.device, repeats: int, compile_ok: bool) -> list[dict]:
    time_ms = timer(device)
    dtype, d, hq, hk = cfg["dtype"], cfg["head_dim"], cfg["heads"], cfg["kv_heads"]
    elt = torch.tensor([], dtype=dtype).element_size()
    liger = liger_rope() if device.type == "cuda" else None
    hf_compiled = torch.compile(hf_rope) if compile_ok else None
    rows = []
    for batch in cfg["batches"]:
        for seq in cfg["seqs"]:
            g = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(batch, hq, seq, d, device=device, dtype=dtype, generator=g)
            k = torch.randn(batch, hk, seq, d, device=device, dtype=dtype, generator=g)
            cos, sin = rope_cos_sin(torch.arange(seq, device=device), rope_frequencies(d, device=device))
            cos_full = torch.cat((cos, cos), -1).to(dtype)[None, None]
            sin_full = torch.cat((sin, sin), -1).to(dtype)[None, None]
            fwd = {
                "fused": lambda: fused_rope(q, k, cos, sin),
                "hf_eager": lambda: hf_rope(q, k, cos_full, sin_full),
                "copy": lambda: (q.clone(), k.clone()),
            }
            if hf_compiled is not None:
                fwd["hf_compiled"] = lambda: hf_compiled(q, k, cos_full, sin_full)
            if liger is not None:
                fwd["liger"] = lambda: liger(q, k, cos_full[0], sin_full[0])
            # Correctness first: the fused kernel is the float32 result rounded once to bf16.
            ours, ref = fused_rope(q, k, cos, sin), apply_rope(q.float(), k.float(), cos, sin)
            max_err = max(float((a.float() - r).abs().max()) for a, r in zip(ours, ref))
            nbytes = rope_bytes(batch, seq, hq, hk, d, elt)
            row = dict(batch=batch, seq=seq, bytes=nbytes, max_abs_err_vs_fp32=max_err, forward_ms={},
                       backward_ms={})
            for name, fn in fwd.items():
                row["forward_ms"][name] = _oom_safe(lambda fn=fn: time_ms(fn, repeats))
            # Backward: time autograd.grad of each contender's outputs.
            qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
            dq, dk = torch.randn_like(q), torch.randn_like(k)
            bwd = {
                "fused": lambda: fused_rope(qg, kg, cos, sin),
                "hf_eager": lambda: hf_rope(qg, kg, cos_full, sin_full),
            }
            if hf_compiled is not None:
                bwd["hf_compiled"] = lambda: hf_compiled(qg, kg, cos_full, sin_full)
            if liger is not None:
                bwd["liger"] = lambda: liger(qg, kg, cos_full[0], sin_full[0])
            for name, make in bwd.items():
                def run_bwd(make=make):
                    outs = make()
                    return lambda: torch.autograd.grad(outs, (qg, kg), (dq, dk), retain_graph=True)
                row["backward_ms"][name] = _oom_safe(lambda run_bwd=run_bwd: time_ms(run_bwd(), repeats))
            row["backward_ms"]["copy"] = row["forward_ms"]["copy"]
            # The copy moves the activations only (its own bytes); every contender is credited
            # with the bytes a fused RoPE must move (its useful bytes), tables included.
            copy_bytes = 2 * batch * (hq + hk) * seq * d * elt
            copy_gbps = copy_bytes / (row["forward_ms"]["copy"] * 1e6)
            row["copy_GBps"] = copy_gbps
            for phase in ("forward", "backward"):
                row[f"{phase}_GBps"] = {n: ((copy_bytes if n == "copy" else nbytes) / (ms * 1e6) if ms else None)
                                        for n, ms in row[f"{phase}_ms"].items()}
                row[f"{phase}_fraction_of_copy"] = {n: (gb / copy_gbps if gb else None)
                                                    for n, gb in row[f"{phase}_GBps"].items()}
            rows.append(row)
            print(f"rope b={batch} s={seq}: " + ", ".join(
                f"{n} {row['forward_fraction_of_copy'][n]:.2f}" for n in fwd if row["forward_ms"][n]),
                "(forward, fraction of copy bandwidth)")
            del q, k, qg, kg, dq, dk
    return rows


# ----------------------------------------------------------------------------- attention


def _materialised_bias(kind: str, t5: T5RelativeBias, heads: int, seq: int, device: torch.device,
                       dtype: torch.dtype) -> torch.Tensor:
    pos = torch.arange(seq, device=device)
    with torch.no_grad():
        return _bias_tensor(kind, t5, heads, pos, device).to(dtype)[None]


def _bias_tensor(kind: str, t5: T5RelativeBias, heads: int, pos: torch.Tensor,
                 device: torch.device) -> torch.Tensor:
    if kind == "alibi":
        return alibi_bias(alibi_slopes(heads, device=device), pos, pos, form="causal")
    else:
        bias = t5.bias(pos, pos).masked_fill_(pos[None, :] > pos[:, None], float("-inf"))
    return bias


def bench_attention(cfg: dict, device: torch.device, repeats: int) -> list[dict]:
    time_ms = timer(device)
    dtype, d, h = cfg["dtype"], cfg["head_dim"], cfg["heads"]
    t5 = T5RelativeBias(h, 32, 128, bidirectional=False).to(device)
    rows = []
    for batch in cfg["batches"]:
        for seq in cfg["seqs"]:
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(batch, h, seq, d, device=device, dtype=dtype, generator=g) for _ in range(3))
            row = dict(batch=batch, seq=seq, forward_ms={}, fwd_bwd_ms={}, bias_bytes=None)
            ours = {
                "flash_alibi": lambda: flash_attention_with_bias(q, k, v, bias="alibi", causal=True),
                "flash_t5": lambda: flash_attention_with_bias(q, k, v, bias="t5", t5=t5, causal=True),
                "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            }
            for name, fn in ours.items():
                row["forward_ms"][name] = _oom_safe(lambda fn=fn: time_ms(fn, repeats))
            for kind in ("alibi", "t5"):
                def sdpa_bias(kind=kind):
                    bias = _materialised_bias(kind, t5, h, seq, device, dtype)
                    row["bias_bytes"] = bias.numel() * bias.element_size()
                    with torch.no_grad():
                        ref = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=bias)
                        mine = (flash_attention_with_bias(q[:1], k[:1], v[:1], bias="alibi", causal=True)
                                if kind == "alibi" else
                                flash_attention_with_bias(q[:1], k[:1], v[:1], bias="t5", t5=t5, causal=True))
                        row[f"max_abs_err_{kind}_vs_sdpa"] = float((mine.float() - ref.float()).abs().max())
                    ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias), repeats)
                    del bias
                    return ms
                row["forward_ms"][f"sdpa_bias_{kind}"] = _oom_safe(sdpa_bias)
            # forward + backward for the kernels and the ceiling
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            do = torch.randn_like(q)
            fb = {
                "flash_alibi": lambda: flash_attention_with_bias(qg, kg, vg, bias="alibi", causal=True),
                "flash_t5": lambda: flash_attention_with_bias(qg, kg, vg, bias="t5", t5=t5, causal=True),
                "sdpa_causal": lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True),
            }
            for name, fn in fb.items():
                def step(fn=fn):
                    return torch.autograd.grad(fn(), (qg, kg, vg), do)
                row["fwd_bwd_ms"][name] = _oom_safe(lambda step=step: time_ms(step, repeats))
            fl_f = attention_flops(batch, seq, h, d)
            fl_fb = attention_flops(batch, seq, h, d, backward=True)
            row["forward_TFLOPs"] = {n: (fl_f / (ms * 1e9) if ms else None) for n, ms in row["forward_ms"].items()}
            row["fwd_bwd_TFLOPs"] = {n: (fl_fb / (ms * 1e9) if ms else None)
                                     for n, ms in row["fwd_bwd_ms"].items()}
            ceiling = row["forward_ms"]["sdpa_causal"]
            row["forward_slowdown_vs_sdpa_causal"] = {
                n: (ms / ceiling if ms and ceiling else None) for n, ms in row["forward_ms"].items()}
            rows.append(row)
            print(f"attention b={batch} s={seq}: " + ", ".join(
                f"{n} {tf:.1f}" for n, tf in row["forward_TFLOPs"].items() if tf), "(forward TFLOP/s)")
            del q, k, v, qg, kg, vg, do
    return rows


# ----------------------------------------------------------------------------- summary


def summarise(rope_rows: list[dict], attn_rows: list[dict], long_seq: int) -> dict:
    """The issue's targets, checked over the measured shapes (None: nothing to compare)."""
    def ok(values):
        values = [x for x in values if x is not None]
        return all(values) if values else None

    rope_frac = [r["forward_fraction_of_copy"].get("fused") for r in rope_rows]
    liger_ratio = [(r["forward_ms"]["liger"] / r["forward_ms"]["fused"])
                   if r["forward_ms"].get("liger") and r["forward_ms"].get("fused") else None for r in rope_rows]
    within = [max(r["forward_slowdown_vs_sdpa_causal"][n] for n in ("flash_alibi", "flash_t5"))
              if all(r["forward_slowdown_vs_sdpa_causal"].get(n) for n in ("flash_alibi", "flash_t5")) else None
              for r in attn_rows]
    beats = [r["forward_ms"][f"flash_{kind}"] < r["forward_ms"][f"sdpa_bias_{kind}"]
             if r["forward_ms"].get(f"sdpa_bias_{kind}") else True  # SDPA out of memory: beaten
             for r in attn_rows if r["seq"] >= long_seq for kind in ("alibi", "t5")]
    return {
        "rope_min_fraction_of_copy": min((x for x in rope_frac if x is not None), default=None),
        "rope_at_least_80pct_of_copy": ok([x >= 0.8 if x is not None else None for x in rope_frac]),
        "rope_min_speedup_over_liger": min((x for x in liger_ratio if x is not None), default=None),
        "rope_no_slower_than_liger": ok([x >= 1.0 if x is not None else None for x in liger_ratio]),
        "attention_max_slowdown_vs_sdpa_causal": max((x for x in within if x is not None), default=None),
        "attention_within_1_3x_of_sdpa_causal": ok([x <= 1.3 if x is not None else None for x in within]),
        "attention_beats_materialised_sdpa_at_long_seq": ok(beats),
    }


def cuda_details() -> dict:
    """Device, capability, driver and library versions for the provenance block."""
    info: dict = {"triton": None, "liger_kernel": None}
    for pkg in ("triton", "liger_kernel"):
        if importlib.util.find_spec(pkg) is not None:
            try:
                info[pkg] = __import__(pkg).__version__
            except AttributeError:
                info[pkg] = "unknown"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_GiB=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: test the script itself")
    ap.add_argument("--repeats", type=int, default=50, help="timing samples (CUDA: milliseconds of do_bench)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output ('' to skip writing)")
    args = ap.parse_args(argv)

    if args.smoke:
        device, cfg, repeats, compile_ok = torch.device("cpu"), SMOKE, 1, False
    else:
        if not torch.cuda.is_available():
            print("gpu_kernels.py needs a CUDA GPU (use --smoke to test the script on a CPU)", file=sys.stderr)
            return 2
        device, cfg, repeats, compile_ok = torch.device("cuda"), FULL, args.repeats, not args.no_compile
    torch.manual_seed(0)
    backends = {op: kernel_backend(device, op) for op in ("rope", "attention")}
    print(f"device {device}, backends {backends}")
    rope_rows = bench_rope(cfg, device, repeats, compile_ok)
    attn_rows = bench_attention(cfg, device, repeats)
    summary = summarise(rope_rows, attn_rows, cfg["long_seq"])
    for key, value in summary.items():
        print(f"{key}: {value if not isinstance(value, float) else round(value, 3)}")
    data = {
        "smoke": bool(args.smoke),
        "backends": backends,
        "config": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in cfg.items()},
        "environment": cuda_details(),
        "rope": rope_rows,
        "attention": attn_rows,
        "summary": summary,
    }
    if args.out:
        args_used = argv if argv is not None else sys.argv[1:]
        cmd = " ".join(["python benchmarks/gpu_kernels.py", *args_used])
        path = save_result(args.out, data, command=cmd)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
