"""The command lines of chapter 10's second edition (``docs``, ``context``, ``retrieval``) and
chapter 13's ``temperature``.

Subcommands of ``python -m companion.longctx`` (registered by ``add_commands``), on
SmolLM2-135M (``--model smollm2``) or Gemma 3 270M (``--model gemma3``)::

    python -m companion.longctx docs --out chapters/data/10_docs.json
    python -m companion.longctx context --context 8192 --documents 4 --cache runs/10_context \\
        --out chapters/data/10_context.csv --json chapters/data/10_context.json
    python -m companion.longctx retrieval --lengths 1024 2048 4096 8192 --cache runs/10_passkey \\
        --out chapters/data/10_retrieval.csv

* ``docs`` lists the long documents (:func:`companion.longctx_docs.long_documents`) with
  their token counts and hashes.
* ``context`` runs the same-token measure (:func:`companion.longctx_docs.same_token_rows`)
  on the ``--documents`` longest of them: per document, the sliding baseline and one pass
  per method. Its JSON sidecar holds the document set and, per method, the value of the
  context beyond the native window with its interval (:func:`companion.longctx_docs.context_value`).
* ``temperature`` (chapter 13) measures attention entropy and loss against context length on
  windows that end together, as trained within the native context and with and without an
  attention temperature past it (:mod:`companion.longctx_temperature`)::

    python -m companion.longctx temperature --lengths 2048 4096 8192 16384 --documents 4 \
        --exclude 'encodings/*' --cache runs/13_temperature \
        --out chapters/data/13_recipe/real_temperature.csv
* ``retrieval`` runs the passkey measure (:func:`companion.passkey.passkey_rows`): for each
  length, depth and format, ``--trials`` keys, with ``--methods`` beyond the native context
  and ``--native-methods`` within it.

**Units and resuming.** The work is cut into units (a document and a method, or the
baseline; a cell of the passkey grid and a method). With ``--cache DIR`` each finished unit
is written to ``DIR`` as it ends, and a run that is started again with the same flags reuses
the finished units and computes only the others (as ``companion.lab.extend`` does); the CSV
of ``--out`` is rewritten, with provenance, after each unit, so a partial run leaves a
usable file. A unit's file name is a hash of everything that decides its result (model,
document hash, method and its parameters, sizes, seed). ``--quick`` is a smoke run of about
a minute on a loaded two-core machine (:data:`QUICK_CONTEXT`, :data:`QUICK_RETRIEVAL`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._checks import check_finite_number, check_positive_int
from ._cli import SMOKE_RUN, say
from .longctx import (METHODS, TRAINFREE_METHODS, _add_run_flags, _add_trainfree_flags, _check_trainfree_args,
                      _duration, _save_rows, _trainfree_flags)

__all__ = ["MODELS", "QUICK_CONTEXT", "QUICK_RETRIEVAL", "QUICK_TEMPERATURE", "load_subject", "cached_unit"]

#: The models the commands run, by ``--model`` name.
MODELS: tuple[str, ...] = ("smollm2", "gemma3")
#: What ``context --quick`` sets: one document, a 512-token window, two methods.
QUICK_CONTEXT: dict[str, Any] = {"context": 256, "documents": 1, "block": 64, "bucket": 64, "methods": ["none", "yarn"]}
#: What ``temperature --quick`` sets: one document, a 256-token native window stretched to 512.
QUICK_TEMPERATURE: dict[str, Any] = {"lengths": [256, 512], "documents": 1, "native": 256, "last": 16, "tail": 64,
                                     "block": 32}
#: What ``retrieval --quick`` sets: two keys in one 512-token classic prompt, the key in the middle.
QUICK_RETRIEVAL: dict[str, Any] = {"lengths": [512], "depths": [0.5], "trials": 2, "formats": ["classic"]}


def load_subject(name: str) -> tuple[Any, Any, str | None]:
    """``(model, tokenizer, chat template or None)`` of ``--model name``, from the cached GGUF
    file (:mod:`companion.pretrained`; a missing file raises ``FileNotFoundError`` with the
    fetch command)."""
    if name == "smollm2":
        from .longctx import _load

        model, tok, fields = _load()
        return model, tok, fields.get("tokenizer.chat_template")
    if name == "gemma3":
        from .gemma import build_model, gguf_tokenizer, read_gguf
        from .pretrained import gemma3_gguf_path

        config, weights, fields = read_gguf(gemma3_gguf_path())
        return build_model(config, weights), gguf_tokenizer(fields), fields.get("tokenizer.chat_template")
    raise ValueError(f"model must be one of {list(MODELS)}, got {name!r}")


def cached_unit(cache: str | Path | None, kind: str, params: dict[str, Any],
                compute: Callable[[], list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], bool]:
    """``(rows, reused)``: the rows of a unit, from ``cache/<kind>-<hash of params>.json`` when a
    run left it there, else ``compute()`` (written there when ``cache`` is given). ``params``
    must be JSON (it is stored beside the rows, and a file whose params differ is not reused).

    Raises:
        TypeError: ``kind`` not a string, ``params`` not a JSON-serialisable dict, ``compute``
            not callable.
        ValueError: ``kind`` empty or holding a path separator; ``cache`` an existing file.
    """
    if not isinstance(kind, str) or not kind or "/" in kind or "\\" in kind:
        raise (TypeError if not isinstance(kind, str) else ValueError)(
            f"kind must be a non-empty name without a path separator, got {kind!r}")
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict of JSON values, got {type(params).__name__}")
    if not callable(compute):
        raise TypeError(f"compute must be a function returning the unit's rows, got {type(compute).__name__}")
    try:
        text = json.dumps(params, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"params must be a dict of JSON values: {exc}") from None
    if cache is None:
        return compute(), False
    if Path(cache).exists() and not Path(cache).is_dir():
        raise ValueError(f"cache must be a folder, got the existing file {str(cache)!r}")
    path = Path(cache) / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"
    if path.is_file():
        stored = json.loads(path.read_text(encoding="utf-8"))
        if json.dumps(stored.get("params"), sort_keys=True) == text:
            return stored["rows"], True
    rows = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"params": params, "rows": rows}), encoding="utf-8")
    tmp.replace(path)  # atomic: an interrupted write leaves no half unit
    return rows, False


# ----------------------------------------------------------------------------- argument checks


def _check_out(args: argparse.Namespace) -> None:
    if args.threads is not None:
        check_positive_int(args.threads, "--threads")
    for flag, path in (("--out", args.out), ("--json", getattr(args, "json", None))):
        if path is not None and (not path or Path(path).is_dir()):
            raise ValueError(f"{flag} must be a file path, got {'the folder ' if path else ''}{path!r}")
    cache = getattr(args, "cache", None)
    if cache is not None and Path(cache).exists() and not Path(cache).is_dir():
        raise ValueError(f"--cache must be a folder, got the existing file {cache!r}")


def _check_methods(args: argparse.Namespace, keys: Sequence[str]) -> None:
    for key in keys:
        chosen = getattr(args, key) or []
        if len(set(chosen)) < len(chosen):
            raise ValueError(f"--{key.replace('_', '-')} must not repeat a method, got {' '.join(chosen)}")
        if args.model == "gemma3":
            bad = [m for m in chosen if m in TRAINFREE_METHODS]
            if bad:
                raise ValueError(f"--{key.replace('_', '-')}: the training-free methods ({' '.join(bad)}) run on "
                                 f"SmolLM2 only (companion.llama's attention hooks); Gemma 3 takes {' '.join(METHODS)}")
    if args.model != "gemma3" and args.rope_layers != "global":
        raise ValueError("--rope-layers all is Gemma 3's ablation (SmolLM2 has one RoPE for every layer)")


def _check_context_args(args: argparse.Namespace) -> None:
    """Every ``context`` flag, before anything is loaded."""
    _check_out(args)
    check_finite_number(args.factor, "--factor", minimum=1.0)
    if args.context is not None:
        check_positive_int(args.context, "--context", minimum=2)
        check_positive_int(args.bucket, "--bucket")
        if args.context % args.bucket:
            raise ValueError(f"--bucket must divide --context ({args.context}), got {args.bucket}")
        if args.block is not None and not 1 <= args.block <= args.context - 1:
            raise ValueError(f"--block must lie in [1, --context - 1] = [1, {args.context - 1}], got {args.block}")
    else:
        check_positive_int(args.bucket, "--bucket")
    if args.block is not None:
        check_positive_int(args.block, "--block")
    if args.documents is not None:
        check_positive_int(args.documents, "--documents")
    if args.pass_chunk is not None:
        check_positive_int(args.pass_chunk, "--pass-chunk")
    _check_methods(args, ["methods"])
    _check_trainfree_args(args)


def _check_retrieval_args(args: argparse.Namespace) -> None:
    """Every ``retrieval`` flag, before anything is loaded."""
    _check_out(args)
    check_finite_number(args.factor, "--factor", minimum=1.0)
    for n in args.lengths:
        check_positive_int(n, "--lengths")
    if len(set(args.lengths)) < len(args.lengths):
        raise ValueError(f"--lengths must not repeat a length, got {' '.join(map(str, args.lengths))}")
    for depth in args.depths:
        if not (math.isfinite(depth) and 0.0 <= depth <= 1.0):
            raise ValueError(f"--depths must lie in [0, 1], got {depth}")
    if len(set(args.depths)) < len(args.depths):
        raise ValueError(f"--depths must not repeat a depth, got {' '.join(map(str, args.depths))}")
    check_positive_int(args.trials, "--trials")
    check_positive_int(args.controls, "--controls")
    check_positive_int(args.seed, "--seed", minimum=0)
    check_positive_int(args.pass_chunk, "--pass-chunk")
    formats = args.formats or []
    if len(set(formats)) < len(formats):
        raise ValueError(f"--formats must not repeat a format, got {' '.join(formats)}")
    if args.model == "gemma3" and "chat" in formats:
        raise ValueError("--formats chat needs a chat template; the Gemma 3 270M file (a base model) has none: "
                         "use --formats classic")
    _check_methods(args, ["methods", "native_methods"])
    _check_trainfree_args(args)


def _check_temperature_args(args: argparse.Namespace) -> None:
    """Every ``temperature`` flag, before anything is loaded."""
    _check_out(args)
    if args.model != "smollm2":
        raise ValueError("--model: the temperature measure runs on smollm2 (companion.llama's attention hooks)")
    for n in args.lengths:
        check_positive_int(n, "--lengths", minimum=2)
    if len(set(args.lengths)) < len(args.lengths):
        raise ValueError(f"--lengths must not repeat a length, got {' '.join(map(str, args.lengths))}")
    shortest = min(args.lengths)
    for flag in ("last", "tail", "block"):
        v = check_positive_int(getattr(args, flag), f"--{flag}")
        if v > shortest - 1:
            raise ValueError(f"--{flag} must lie in [1, min(--lengths) - 1] = [1, {shortest - 1}], got {v}")
    if args.tail % args.block:
        raise ValueError(f"--block ({args.block}) must divide --tail ({args.tail})")
    if args.documents is not None:
        check_positive_int(args.documents, "--documents")
    if args.native is not None:
        check_positive_int(args.native, "--native", minimum=2)


# ----------------------------------------------------------------------------- parsers


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=MODELS, default="smollm2", help="the model (default: smollm2, SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")


def _document_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--split", choices=("val", "train", "all"), default="val",
                   help="the lab corpus's split the documents come from (default: val)")
    p.add_argument("--exclude", nargs="+", default=[],
                   help="fnmatch patterns of paths to leave out, e.g. 'encodings/*', the generated code-page "
                        "tables (default: none)")


def _measure_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--factor", type=float, default=2.0, help="scaling factor s >= 1 of the scaling methods (default: 2)")
    p.add_argument("--rope-layers", choices=("global", "all"), default="global",
                   help="gemma3: the layers a scaling config goes to, 'global' (as HuggingFace and llama.cpp) or "
                        "'all' (the ablation) (default: global)")
    _add_trainfree_flags(p)
    p.add_argument("--cache", default=None,
                   help="a folder for finished units: a run started again reuses them (default: none, nothing kept)")
    p.add_argument("--json", default=None, help="a JSON sidecar with the settings and the summary (default: none)")


def add_commands(sub: Any) -> dict[str, tuple[argparse.ArgumentParser, Callable, Callable, dict[str, Any]]]:
    """Register ``docs``, ``context`` and ``retrieval`` on the subparsers ``sub``; returns
    ``{name: (parser, check, run, quick preset)}`` for :func:`companion.longctx.main`."""
    d = sub.add_parser("docs", help="the long single documents of the corpus, with token counts and hashes")
    _common(d)
    d.add_argument("--min-tokens", type=int, default=16384, help="the least tokens of a document (default: 16384)")
    d.add_argument("--split", choices=("val", "train", "all"), default="val",
                   help="the lab corpus's split (default: val, the held-out files)")
    d.add_argument("--exclude", nargs="+", default=[],
                   help="fnmatch patterns of paths to leave out, e.g. 'encodings/*' (default: none)")
    d.add_argument("--out", required=True, help="JSON file of the document set, with provenance (required)")
    d.set_defaults(quick=False, quiet=False)

    c = sub.add_parser("context", help="the value of context on the same tokens: a pass per method against a "
                                       "sliding native window")
    _common(c)
    c.add_argument("--context", type=int, default=None,
                   help="T: tokens [T, 2T) of each document are scored (default: the model's native context, "
                        "8192 for smollm2, 32768 for gemma3)")
    c.add_argument("--documents", type=int, default=None,
                   help="the longest documents of at least 2T tokens to use (default: every one)")
    _document_flags(c)
    c.add_argument("--methods", nargs="+", choices=METHODS + TRAINFREE_METHODS, default=None,
                   help="methods, each a pass of 2T tokens per document (default: every scaling method, and for "
                        "smollm2 every training-free one)")
    c.add_argument("--block", type=int, default=None,
                   help="S: the sliding baseline scores S tokens per pass of T, so each sees T - S to T - 1 "
                        "tokens (default: T / 8)")
    c.add_argument("--bucket", type=int, default=512, help="target positions per stored row (default: 512)")
    c.add_argument("--targets", choices=("all", "measured"), default="all",
                   help="the targets a method's pass scores: 'all' (the first half too) or 'measured' (only "
                        "[T, 2T): half the cost of a gemma3 pass, whose LM head is large) (default: all)")
    c.add_argument("--pass-chunk", type=int, default=None,
                   help="feed each pass this many tokens at a time through a KV cache, for memory "
                        "(default: one call for smollm2, 4096 for gemma3)")
    c.add_argument("--no-keep-bos", action="store_true",
                   help="the sliding baseline's passes start mid-document, without the <bos> token that "
                        "the methods' pass starts with (gemma3; smollm2 has none): what dropping it costs "
                        "(default: each pass keeps the document's <bos>)")
    _measure_flags(c)
    c.add_argument("--out", required=True, help="CSV file of the bucketed losses, with provenance (required)")
    _add_run_flags(c, QUICK_CONTEXT)

    r = sub.add_parser("retrieval", help="passkey retrieval scored by log-probability, 20+ keys per cell")
    _common(r)
    r.add_argument("--formats", nargs="+", choices=("classic", "chat"), default=None,
                   help="prompt formats (default: classic and chat for smollm2, classic for gemma3)")
    r.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                   help="prompt lengths in tokens, answer included (default: 1024 2048 4096 8192 16384)")
    r.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9],
                   help="fraction of the filler before the key (default: 0.1 0.5 0.9)")
    r.add_argument("--trials", type=int, default=20, help="keys per (length, depth) cell (default: 20)")
    r.add_argument("--controls", type=int, default=4, help="control keys scored after each prompt (default: 4)")
    r.add_argument("--seed", type=int, default=0, help="seed of the keys (default: 0)")
    r.add_argument("--methods", nargs="+", choices=METHODS + TRAINFREE_METHODS, default=None,
                   help="methods at lengths beyond the native context (default: every scaling method, and for "
                        "smollm2 every training-free one)")
    r.add_argument("--native-methods", nargs="+", choices=METHODS + TRAINFREE_METHODS, default=["none"],
                   help="methods at lengths within the native context (default: none)")
    r.add_argument("--pass-chunk", type=int, default=1024,
                   help="tokens fed per call after the cached filler: speed and memory, not the result (each call "
                        "computes its queries' masked rectangle; 1024 was a quarter faster than 4096 at 4K) "
                        "(default: 1024)")
    _measure_flags(r)
    r.add_argument("--out", required=True, help="CSV file of the trials, with provenance (required)")
    _add_run_flags(r, QUICK_RETRIEVAL)

    t = sub.add_parser("temperature", help="attention entropy and loss against context length, with and without "
                                           "an attention temperature (chapter 13)")
    _common(t)
    t.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384],
                   help="window lengths in tokens; every window ends at the longest's last token (default: 2048 "
                        "4096 8192 16384)")
    t.add_argument("--documents", type=int, default=None,
                   help="the longest documents of at least max(--lengths) tokens to use (default: every one)")
    _document_flags(t)
    t.add_argument("--native", type=int, default=None,
                   help="treat the model as trained at this many tokens (the YaRN factor and log-n's length "
                        "are taken from it): a smoke run's small windows (default: the model's, 8192)")
    t.add_argument("--last", type=int, default=64, help="queries whose attention entropy is averaged (default: 64)")
    t.add_argument("--tail", type=int, default=1024, help="last targets whose loss is stored (default: 1024)")
    t.add_argument("--block", type=int, default=64, help="targets per stored loss (default: 64)")
    t.add_argument("--cache", default=None,
                   help="a folder for finished units: a run started again reuses them (default: none, nothing kept)")
    t.add_argument("--json", default=None, help="a JSON sidecar with the settings and documents (default: none)")
    t.add_argument("--out", required=True, help="CSV file of the rows, with provenance (required)")
    _add_run_flags(t, QUICK_TEMPERATURE)
    return {"docs": (d, _check_docs_args, _cmd_docs, {}), "context": (c, _check_context_args, _cmd_context, QUICK_CONTEXT),
            "retrieval": (r, _check_retrieval_args, _cmd_retrieval, QUICK_RETRIEVAL),
            "temperature": (t, _check_temperature_args, _cmd_temperature, QUICK_TEMPERATURE)}


def _check_docs_args(args: argparse.Namespace) -> None:
    _check_out(args)
    check_positive_int(args.min_tokens, "--min-tokens", minimum=2)


# ----------------------------------------------------------------------------- commands


def _default_methods(model: str) -> list[str]:
    return list(METHODS) + (list(TRAINFREE_METHODS) if model == "smollm2" else [])


def _factor(args: argparse.Namespace, method: str) -> float | None:
    """``--factor`` where it decides a unit's result (a scaling method other than ``none``)."""
    return args.factor if method in METHODS and method != "none" else None


def _model_id(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    return {"model": args.model, "name": str(getattr(model.config, "name", "")),
            "context_length": model.config.context_length}


def _finish(args: argparse.Namespace, command: str, data: dict[str, Any] | None) -> int:
    """The JSON sidecar of ``--json`` (``data``, with ``"quick": true`` after ``--quick``) and a
    smoke run's last word; the exit status 0."""
    if args.json:
        from .utils import save_result

        save_result(args.json, dict(data, quick=True) if args.quick else data, command=command)
    if args.quick:
        print(f"{SMOKE_RUN}: {args.out} records \"quick\": true in its provenance")
    return 0


def _cmd_docs(args: argparse.Namespace, command: str, error: Any) -> int:
    from .longctx_docs import documents_record, long_documents
    from .utils import save_result

    _, tok, _ = load_subject(args.model)
    docs = long_documents(tok, args.min_tokens, split=args.split, exclude=args.exclude)
    record = documents_record(docs, min_tokens=args.min_tokens, split=args.split, tokenizer=args.model,
                              exclude=args.exclude)
    save_result(args.out, record, command=command)
    for doc in docs:
        print(f"{doc.tokens:8d} tokens  {doc.bytes:8d} bytes  {doc.ids_sha256[:16]}  {doc.split:5s} {doc.path}")
    print(f"{len(docs)} document(s) of at least {args.min_tokens} tokens in split {args.split!r}: {args.out}")
    return 0


def _cmd_context(args: argparse.Namespace, command: str, error: Any) -> int:
    from .longctx_docs import (SAME_TOKEN_FIELDS, SLIDING, _kept_bos, context_value, documents_record, long_documents,
                               same_token_rows)

    progress = say(args.quiet)
    model, tok, _ = load_subject(args.model)
    gemma = args.model == "gemma3"
    T = args.context or model.config.context_length
    if T % args.bucket:
        error(f"--bucket must divide --context ({T}), got {args.bucket}")
    block = args.block or max(T // 8, 1)
    if block > T - 1:
        error(f"--block must lie in [1, --context - 1] = [1, {T - 1}], got {block}")
    chunk = args.pass_chunk if args.pass_chunk is not None else (4096 if gemma else None)
    methods = args.methods or _default_methods(args.model)
    trainfree = _trainfree_flags(args)
    docs = long_documents(tok, 2 * T, split=args.split, exclude=args.exclude)
    if not docs:
        error(f"no document of the {args.split!r} split has 2 * --context = {2 * T} tokens")
    docs = docs[:args.documents] if args.documents else docs
    units = len(docs) * (len(methods) + 1)
    progress(f"context: {len(docs)} document(s) x ({len(methods)} method(s) + the sliding baseline) = {units} units "
             f"on {args.model}, T = {T}, S = {block} (a baseline is {T // block} passes of {T} tokens; a method one "
             f"pass of {2 * T}){'' if args.quick else '; --quick for a smoke run'}")
    rows: list[dict[str, Any]] = []
    ident = _model_id(args, model)
    t0, done, computed = time.perf_counter(), 0, 0
    for doc in docs:
        for m in [SLIDING, *methods]:
            params = dict(ident, measure="same-token", document=doc.ids_sha256, context=T, method=m,
                          factor=_factor(args, m), block=block, bucket=args.bucket, rope_layers=args.rope_layers,
                          trainfree=trainfree if m in TRAINFREE_METHODS else None,
                          targets=None if m == SLIDING else args.targets)
            if m == SLIDING and _kept_bos(model, doc, not args.no_keep_bos):
                params["keep"] = 1  # a <bos> kept in each pass; no key change otherwise

            def compute(doc=doc, m=m) -> list[dict[str, Any]]:
                return same_token_rows(model, doc, T, [] if m == SLIDING else [m], factor=args.factor, block=block,
                                       bucket=args.bucket, rope_layers=args.rope_layers, trainfree=trainfree,
                                       chunk=chunk, baseline=m == SLIDING, targets=args.targets,
                                       keep_bos=not args.no_keep_bos, progress=progress)

            got, reused = cached_unit(args.cache, "context", params, compute)
            rows += got
            done += 1
            computed += not reused
            spent = time.perf_counter() - t0
            left = spent / computed * (units - done) if computed else 0.0
            progress(f"  unit {done}/{units} {doc.path} {m}{' (from the cache)' if reused else ''}; "
                     f"{_duration(spent)} so far, about {_duration(left)} left")
            _save_rows(args, rows, SAME_TOKEN_FIELDS, command)
    summary = {}
    for m in methods:
        v = context_value(rows, m, T)
        iv = v["interval"]
        summary[m] = {"estimate": iv.estimate, "low": iv.low, "high": iv.high, "per_document": v["per_document"]}
        print(f"{m:13s} value of the context beyond {T} tokens: {iv.format(4)} nats/token "
              f"({v['documents']} document(s) x {v['buckets']} buckets)")
    data = None
    if args.json:
        data = {"documents": documents_record(docs, min_tokens=2 * T, split=args.split, tokenizer=args.model,
                                              exclude=args.exclude),
                "model": ident, "context": T, "block": block, "keep_bos": not args.no_keep_bos,
                "bucket": args.bucket, "factor": args.factor,
                "rope_layers": args.rope_layers, "methods": methods, "trainfree": trainfree,
                "value_of_context": summary, "seconds": time.perf_counter() - t0}
    return _finish(args, command, data)


def _cmd_retrieval(args: argparse.Namespace, command: str, error: Any) -> int:
    from .passkey import PASSKEY_FIELDS, passkey_rows, passkey_summary, prompt_ids

    progress = say(args.quiet)
    model, tok, template = load_subject(args.model)
    formats = args.formats or (["classic", "chat"] if template else ["classic"])
    if "chat" in formats and not template:
        error(f"--formats chat needs the model's chat template; the {args.model} file has none")
    for n in args.lengths:  # the check that needs the tokenizer: room for each prompt
        for fmt in formats:
            try:
                prompt_ids(tok, fmt, n, 0.0, 99999, template=template, reserve=8)
            except ValueError as exc:
                error(f"--lengths {n} ({fmt}): {exc}")
    native = model.config.context_length
    methods = args.methods or _default_methods(args.model)
    trainfree = _trainfree_flags(args)
    plan = [(n, depth, fmt, m) for n in args.lengths for depth in args.depths for fmt in formats
            for m in (methods if n > native else args.native_methods)]
    progress(f"retrieval: {len(plan)} unit(s) (length x depth x format x method) of {args.trials} trials on "
             f"{args.model}; a trial costs about the part of its prompt after the key"
             f"{'' if args.quick else '; --quick for a smoke run'}")
    rows: list[dict[str, Any]] = []
    ident = _model_id(args, model)
    t0, computed = time.perf_counter(), 0
    for done, (n, depth, fmt, m) in enumerate(plan, 1):
        params = dict(ident, measure="passkey", format=fmt, length=n, depth=depth, method=m, factor=_factor(args, m),
                      rope_layers=args.rope_layers, trials=args.trials, controls=args.controls, seed=args.seed,
                      trainfree=trainfree if m in TRAINFREE_METHODS else None)

        def compute(n=n, depth=depth, fmt=fmt, m=m) -> list[dict[str, Any]]:
            return passkey_rows(model, tok, fmt, n, depth, m, trials=args.trials, controls=args.controls,
                                seed=args.seed, template=template, factor=args.factor, rope_layers=args.rope_layers,
                                trainfree=trainfree, chunk=args.pass_chunk)

        got, reused = cached_unit(args.cache, "retrieval", params, compute)
        rows += got
        computed += not reused
        spent = time.perf_counter() - t0
        left = spent / computed * (len(plan) - done) if computed else 0.0
        gain = sum(float(x["gain_bits"]) for x in got) / len(got)
        progress(f"  unit {done}/{len(plan)} {fmt} {n} depth {depth:g} {m}: mean gain {gain:+.2f} bits/digit, "
                 f"exact {sum(int(x['exact']) for x in got)}/{len(got)}{' (from the cache)' if reused else ''}; "
                 f"{_duration(spent)} so far, about {_duration(left)} left")
        _save_rows(args, rows, PASSKEY_FIELDS, command)
    summary = passkey_summary(rows)
    for (fmt, m, n, depth), s in summary.items():
        print(f"{fmt:7s} {m:13s} {n:6d} depth {depth:4.2f}: gain {s['gain'].format(2)} bits/digit, exact "
              f"{round(s['exact'].estimate * s['trials'])}/{s['trials']}")
    data = None
    if args.json:
        data = {"model": ident, "formats": formats, "lengths": args.lengths, "depths": args.depths,
                "trials": args.trials, "controls": args.controls, "seed": args.seed, "factor": args.factor,
                "rope_layers": args.rope_layers, "methods": methods, "native_methods": args.native_methods,
                "trainfree": trainfree, "seconds": time.perf_counter() - t0,
                "summary": [{"format": f, "method": m, "length": n, "depth": dp, "gain": s["gain"].estimate,
                             "gain_low": s["gain"].low, "gain_high": s["gain"].high, "exact": s["exact"].estimate,
                             "trials": s["trials"]} for (f, m, n, dp), s in summary.items()]}
    return _finish(args, command, data)


def _cmd_temperature(args: argparse.Namespace, command: str, error: Any) -> int:
    import dataclasses

    from .longctx_docs import documents_record, long_documents
    from .longctx_temperature import TEMPERATURE_FIELDS, temperature_rows

    progress = say(args.quiet)
    model, tok, _ = load_subject(args.model)
    if args.native is not None:
        model.config = dataclasses.replace(model.config, context_length=args.native)
    end = max(args.lengths)
    docs = long_documents(tok, end, split=args.split, exclude=args.exclude)
    if not docs:
        error(f"no document of the {args.split!r} split has max(--lengths) = {end} tokens")
    docs = docs[:args.documents] if args.documents else docs
    progress(f"temperature: {len(docs)} document(s) x {len(args.lengths)} length(s) on {args.model} (native "
             f"{model.config.context_length}); a unit is one document, a pass per length and condition"
             f"{'' if args.quick else '; --quick for a smoke run'}")
    rows: list[dict[str, Any]] = []
    ident = _model_id(args, model)
    t0, computed = time.perf_counter(), 0
    for done, doc in enumerate(docs, 1):
        params = dict(ident, measure="temperature", document=doc.ids_sha256, lengths=sorted(args.lengths),
                      last=args.last, tail=args.tail, block=args.block)

        def compute(doc=doc) -> list[dict[str, Any]]:
            return temperature_rows(model, doc.ids, sorted(args.lengths), document=doc.path, last=args.last,
                                    tail=args.tail, block=args.block, progress=progress)

        got, reused = cached_unit(args.cache, "temperature", params, compute)
        rows += got
        computed += not reused
        spent = time.perf_counter() - t0
        left = spent / computed * (len(docs) - done) if computed else 0.0
        progress(f"  unit {done}/{len(docs)} {doc.path}{' (from the cache)' if reused else ''}; "
                 f"{_duration(spent)} so far, about {_duration(left)} left")
        _save_rows(args, rows, TEMPERATURE_FIELDS, command)
    data = None
    if args.json:
        data = {"documents": documents_record(docs, min_tokens=end, split=args.split, tokenizer=args.model,
                                              exclude=args.exclude),
                "model": ident, "lengths": sorted(args.lengths), "last": args.last, "tail": args.tail,
                "block": args.block, "seconds": time.perf_counter() - t0}
    return _finish(args, command, data)
